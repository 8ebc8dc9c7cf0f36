"""Transparent compression and the hard size limit.

A payload above the threshold is gzip-compressed. Readers recognise gzip by its magic
bytes, so no flag travels with the data: an encoded envelope is always a JSON object
(``{``) or a MessagePack map (0x80-0x8f, 0xde, 0xdf), never 0x1f. The limit applies to the
decompressed size and is enforced while decompressing, so a bomb is refused after
inflating at most ``limit + 1`` bytes.
"""

from __future__ import annotations

import zlib

from ..errors import DecodeError, PayloadTooLarge

__all__ = ["GZIP_MAGIC", "pack", "unpack"]

GZIP_MAGIC = b"\x1f\x8b"
_GZIP_WBITS = 31


def pack(body: bytes, *, threshold: int, limit: int) -> bytes:
    if len(body) > limit:
        raise PayloadTooLarge(f"payload is {len(body)} bytes; the limit is {limit}")
    if len(body) <= threshold:
        return body
    compressor = zlib.compressobj(6, zlib.DEFLATED, _GZIP_WBITS)
    return compressor.compress(body) + compressor.flush()


def unpack(data: bytes, *, limit: int) -> bytes:
    if not data.startswith(GZIP_MAGIC):
        if len(data) > limit:
            raise PayloadTooLarge(f"payload is {len(data)} bytes; the limit is {limit}")
        return data
    inflater = zlib.decompressobj(_GZIP_WBITS)
    try:
        body = inflater.decompress(data, limit + 1)
    except zlib.error as exc:
        raise DecodeError(f"corrupt compressed payload: {exc}") from None
    if len(body) > limit or inflater.unconsumed_tail:
        raise PayloadTooLarge(f"payload inflates past the limit of {limit} bytes")
    if not inflater.eof:
        raise DecodeError("truncated compressed payload")
    if inflater.unused_data:  # as a plain payload's trailing bytes are refused: not what was written
        raise DecodeError(f"{len(inflater.unused_data)} bytes after the end of the compressed payload")
    return body
