"""Codecs for what the bus stores: one small protocol, a JSON and a MessagePack module.

``PayloadCodec`` adds framing (compression above a threshold, a hard size limit) and
reads either format whatever it writes: a JSON document here always starts with ``{``,
which MessagePack never uses for a map, so mixed deployments and migrations just work.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any, Protocol, TypeVar

import msgspec

from ..errors import DecodeError, EncodeError, InvalidRequest
from . import framing
from . import json as json_codec
from . import msgpack as msgpack_codec

__all__ = [
    "CODECS",
    "DEFAULT_COMPRESS_THRESHOLD",
    "DEFAULT_PAYLOAD_LIMIT",
    "Codec",
    "PayloadCodec",
]

T = TypeVar("T")
DEFAULT_COMPRESS_THRESHOLD = 100 * 1024
DEFAULT_PAYLOAD_LIMIT = 1024 * 1024


class Codec(Protocol):
    """What every codec module provides."""

    NAME: str

    def encode(self, obj: Any) -> bytes: ...

    def decode(self, data: bytes, tp: type[T]) -> T: ...


CODECS: dict[str, ModuleType] = {json_codec.NAME: json_codec, msgpack_codec.NAME: msgpack_codec}


class PayloadCodec:
    """Encode with one codec, decode either; compress and limit transparently."""

    def __init__(
        self,
        name: str = msgpack_codec.NAME,
        *,
        compress_threshold: int = DEFAULT_COMPRESS_THRESHOLD,
        limit: int = DEFAULT_PAYLOAD_LIMIT,
    ) -> None:
        if not isinstance(name, str) or name not in CODECS:
            raise InvalidRequest(f"unknown codec {name!r}; choose from {sorted(CODECS)}")
        if type(limit) is not int or limit < 1:
            raise InvalidRequest(f"the payload limit must be an int of at least 1 (bytes), not {limit!r}")
        if type(compress_threshold) is not int or compress_threshold < 0:
            raise InvalidRequest(f"compress_threshold must be an int of at least 0 (bytes), not {compress_threshold!r}")
        self.name = name
        self._codec: Codec = CODECS[name]
        self.compress_threshold = compress_threshold
        self.limit = limit

    def dumps(self, obj: Any) -> bytes:
        try:
            body = self._codec.encode(obj)
        # RecursionError: nested too deep; anything else: user code the encoder calls (a tzinfo's
        # utcoffset, a Struct's unset field) raised
        except Exception as exc:
            raise EncodeError(f"cannot encode {type(obj).__name__}: {exc}") from None
        return framing.pack(body, threshold=self.compress_threshold, limit=self.limit)

    def loads(self, data: bytes, tp: type[T]) -> T:
        body = framing.unpack(bytes(data), limit=self.limit)
        codec = json_codec if body[:1] == b"{" else msgpack_codec
        try:
            result: T = codec.decode(body, tp)
            return result
        # msgspec raises UnicodeDecodeError for invalid UTF-8 in JSON text, RecursionError past its depth limit
        except (msgspec.DecodeError, UnicodeDecodeError, RecursionError) as exc:
            raise DecodeError(f"invalid {codec.NAME} payload: {exc}") from None

    def dumps_value(self, value: Any) -> bytes:
        """Encode a free-form value (a result, response metadata): bytes stay bytes.

        Values are MessagePack, which keeps ``bytes`` apart from ``str``. Arbitrary bytes may
        start with anything, so values carry a one-byte kind: ``m`` plain, ``z`` gzip.
        """
        try:
            body = msgpack_codec.encode(value)
        except Exception as exc:  # as in dumps: what cannot be encoded is an EncodeError, whatever raised
            raise EncodeError(f"cannot encode {type(value).__name__}: {exc}") from None
        packed = framing.pack(body, threshold=self.compress_threshold, limit=self.limit)
        return (b"m" if packed is body else b"z") + packed

    def loads_value(self, data: bytes) -> Any:
        kind, body = data[:1], bytes(data[1:])
        if kind not in (b"m", b"z") or (kind == b"z") != body.startswith(framing.GZIP_MAGIC):
            raise DecodeError(f"unknown value encoding {kind!r}")
        body = framing.unpack(body, limit=self.limit)
        try:
            return msgpack_codec.decode(body, object)
        except (msgspec.DecodeError, UnicodeDecodeError, RecursionError) as exc:
            raise DecodeError(f"invalid value payload: {exc}") from None
