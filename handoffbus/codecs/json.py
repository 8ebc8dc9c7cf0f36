"""JSON codec (msgspec). Same names as ``handoffbus.codecs.msgpack``."""

from __future__ import annotations

from functools import lru_cache
from typing import Any, TypeVar

import msgspec

__all__ = ["NAME", "decode", "encode"]

NAME = "json"
T = TypeVar("T")
_encoder = msgspec.json.Encoder()


@lru_cache(maxsize=64)
def _decoder(tp: Any) -> msgspec.json.Decoder[Any]:
    return msgspec.json.Decoder(tp)


def encode(obj: Any) -> bytes:
    return _encoder.encode(obj)


def decode(data: bytes, tp: type[T]) -> T:
    result: T = _decoder(tp).decode(data)  # type: ignore[arg-type]
    return result
