"""Codecs: one protocol, two formats, transparent compression, a hard limit, bomb safety."""

from __future__ import annotations

import gzip
import zlib

import pytest

from handoffbus import DecodeError, EncodeError, HandoffRequest, PayloadCodec, PayloadTooLarge
from handoffbus.codecs import json as json_codec
from handoffbus.codecs import msgpack as msgpack_codec

REQUEST = HandoffRequest(
    from_agent="a", to_agent="b", reason="r", context_snapshot=b"\x00\xffctx", capabilities_required=["x"],
    priority=-3, timeout=1.5, metadata={"k": [1, "two"]}, request_id="r1",
)


def test_codec_modules_share_one_protocol() -> None:
    for module in (json_codec, msgpack_codec):
        assert {"NAME", "encode", "decode"} <= set(dir(module))
        assert module.decode(module.encode(REQUEST), HandoffRequest) == REQUEST


@pytest.mark.parametrize("writer", ["json", "msgpack"])
@pytest.mark.parametrize("reader", ["json", "msgpack"])
def test_either_codec_reads_what_the_other_wrote(writer: str, reader: str) -> None:
    data = PayloadCodec(writer).dumps(REQUEST)
    assert PayloadCodec(reader).loads(data, HandoffRequest) == REQUEST


@pytest.mark.parametrize("name", ["json", "msgpack"])
def test_compression_above_threshold_is_transparent(name: str) -> None:
    codec = PayloadCodec(name, compress_threshold=1024)
    big = HandoffRequest(from_agent="a", to_agent="b", context_snapshot=b"y" * 50_000)
    small = HandoffRequest(from_agent="a", to_agent="b", context_snapshot=b"y" * 10)
    packed_big, packed_small = codec.dumps(big), codec.dumps(small)
    assert packed_big[:2] == b"\x1f\x8b" and len(packed_big) < 5_000
    assert packed_small[:2] != b"\x1f\x8b"
    # a reader with other settings needs no flag
    reader = PayloadCodec("msgpack")
    assert reader.loads(packed_big, HandoffRequest) == big
    assert reader.loads(packed_small, HandoffRequest) == small


def test_limit_applies_before_and_after_compression() -> None:
    codec = PayloadCodec(limit=10_000, compress_threshold=100)
    with pytest.raises(PayloadTooLarge):
        codec.dumps(HandoffRequest(from_agent="a", context_snapshot=b"z" * 20_000))
    with pytest.raises(PayloadTooLarge):
        codec.loads(b"\x81" + b"\x00" * 20_000, HandoffRequest)


def test_decompression_bomb_is_refused_without_inflating_it() -> None:
    bomb = gzip.compress(b"\x00" * (200 * 1024 * 1024), compresslevel=9)
    assert len(bomb) < 300_000
    with pytest.raises(PayloadTooLarge):
        PayloadCodec().loads(bomb, HandoffRequest)


@pytest.mark.parametrize(
    "data", [b"\x1f\x8bnot gzip", gzip.compress(b"{}")[:-6], b"\xc1", b"{not json", b"\x81\xa1x",
             # a valid request, then bytes after its gzip stream: junk, or a second member
             pytest.param(gzip.compress(msgpack_codec.encode(REQUEST)) + b"junk", id="gzip-then-junk"),
             pytest.param(gzip.compress(msgpack_codec.encode(REQUEST)) * 2, id="gzip-twice")]
)
def test_corrupt_payloads_raise_decode_error(data: bytes) -> None:
    with pytest.raises(DecodeError):
        PayloadCodec().loads(data, HandoffRequest)


def test_values_keep_bytes_apart_from_text() -> None:
    codec = PayloadCodec(compress_threshold=64)
    for value in [b"\x1f\x8b raw bytes that look like gzip", "text", {"nested": [b"b", 1, None]}, 3.5, None]:
        assert codec.loads_value(codec.dumps_value(value)) == value
    big = {"k": "v" * 10_000}
    packed = codec.dumps_value(big)
    assert packed[:1] == b"z" and codec.loads_value(packed) == big
    with pytest.raises(DecodeError):
        codec.loads_value(b"q" + b"junk")
    with pytest.raises(DecodeError):
        codec.loads_value(b"m" + zlib.compress(b"x"))
    with pytest.raises(EncodeError):
        codec.dumps_value(object())
