"""HandoffContext and its wire format, byte-compatible with sw4rm's SDK.

sw4rm serializes with ``json.dumps(ctx, separators=(",", ":"))``: compact UTF-8 JSON,
keys in the order conversation_history, tool_state, metadata, non-ASCII escaped as
``\\uXXXX``. msgspec writes non-ASCII raw and formats floats differently (``1e16`` vs
``1e+16``), so encoding goes through the stdlib encoder to stay byte-identical; decoding
goes through msgspec for strict, typed validation.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import msgspec

from .errors import DecodeError, EncodeError, PayloadTooLarge

__all__ = [
    "DEFAULT_CONTEXT_LIMIT",
    "ConversationEntry",
    "HandoffContext",
    "context_json_schema",
    "deserialize_context",
    "serialize_context",
]

DEFAULT_CONTEXT_LIMIT = 1024 * 1024
_ENTRY_FIELDS = ("role", "content", "timestamp", "tool_call_id", "name", "metadata")


class ConversationEntry(msgspec.Struct, frozen=True, kw_only=True):
    """One message of the conversation. Keys sw4rm does not name are kept in ``extra``, and so
    is an optional key read as null (sw4rm writes what its dict holds): written back as null,
    in its place, so that the bytes read are the bytes written."""

    role: str
    content: str
    timestamp: str | None = None
    tool_call_id: str | None = None
    name: str | None = None
    metadata: dict[str, Any] | None = None
    extra: dict[str, Any] = {}

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        for key in _ENTRY_FIELDS[2:]:
            value = getattr(self, key)
            if value is not None:
                out[key] = value
            elif key in self.extra:  # read as null
                out[key] = None
        out.update((k, v) for k, v in self.extra.items() if k not in out)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ConversationEntry:
        try:
            known = {k: data[k] for k in _ENTRY_FIELDS if k in data}
            entry = msgspec.convert(known, cls, strict=True)
        except msgspec.ValidationError as exc:
            raise DecodeError(f"invalid conversation entry: {exc}") from None
        extra = {k: v for k, v in data.items() if k not in _ENTRY_FIELDS or (v is None and k not in _ENTRY_FIELDS[:2])}
        return msgspec.structs.replace(entry, extra=extra) if extra else entry


class HandoffContext(msgspec.Struct, frozen=True, kw_only=True):
    """Everything the receiving agent needs to carry on: history, tool state, metadata."""

    conversation_history: list[ConversationEntry] = []
    tool_state: dict[str, Any] = {}
    metadata: dict[str, Any] = {}

    def to_dict(self) -> dict[str, Any]:
        return {
            "conversation_history": [_entry_dict(e) for e in self.conversation_history],
            "tool_state": self.tool_state,
            "metadata": self.metadata,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> HandoffContext:
        """Build from a plain mapping. A key left out is empty, as sw4rm's ``from_dict`` has it
        (the bytes ``deserialize_context`` reads must hold all three, as the JSON Schema says)."""
        if not isinstance(data, Mapping):
            raise DecodeError(f"a context must be a mapping, not {type(data).__name__}")
        history, tool_state = data.get("conversation_history", []), data.get("tool_state", {})
        metadata = data.get("metadata", {})
        if not isinstance(history, list) or not all(isinstance(e, Mapping) for e in history):
            raise DecodeError("conversation_history must be a list of objects")
        if not isinstance(tool_state, dict) or not isinstance(metadata, dict):
            raise DecodeError("tool_state and metadata must be objects")
        return cls(
            conversation_history=[ConversationEntry.from_dict(e) for e in history],
            tool_state=tool_state,
            metadata=metadata,
        )


def _entry_dict(entry: ConversationEntry | Mapping[str, Any]) -> dict[str, Any]:
    if isinstance(entry, ConversationEntry):
        return entry.to_dict()
    if isinstance(entry, Mapping):
        # sw4rm users build history from plain dicts; hold them to the same rule.
        return ConversationEntry.from_dict(entry).to_dict()
    raise EncodeError(f"conversation entries must be ConversationEntry or dict, not {type(entry).__name__}")


class _Wire(msgspec.Struct, forbid_unknown_fields=False):
    conversation_history: list[dict[str, Any]]
    tool_state: dict[str, Any]
    metadata: dict[str, Any]


_wire_decoder = msgspec.json.Decoder(_Wire)


def serialize_context(context: HandoffContext) -> bytes:
    """Encode a context to sw4rm's exact bytes. Raises EncodeError for values JSON cannot hold."""
    if not isinstance(context, HandoffContext):
        raise EncodeError(f"expected HandoffContext, got {type(context).__name__}")
    try:
        data = context.to_dict()
        _distinct_keys(data)
        return json.dumps(data, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode("ascii")
    except DecodeError as exc:
        raise EncodeError(str(exc)) from None
    except (TypeError, ValueError, RecursionError) as exc:
        raise EncodeError(f"context is not JSON-serializable: {exc}") from None


def _distinct_keys(value: Any) -> None:
    """Raise ValueError for an object two of whose keys are one in JSON (``1`` and ``"1"``,
    ``True`` and ``"true"``): both would be written, and the reader keep only the last."""
    stack = [value]
    while stack:  # only containers are pushed: a context is mostly text
        item = stack.pop()
        if isinstance(item, dict):
            if not all(type(k) is str for k in item) and len({_key_text(k) for k in item}) < len(item):
                raise ValueError(f"two keys of {sorted(map(repr, item))[:8]} are the same in JSON")
            stack.extend(v for v in item.values() if type(v) is not str and isinstance(v, _CONTAINERS))
        else:
            stack.extend(v for v in item if type(v) is not str and isinstance(v, _CONTAINERS))


_CONTAINERS = (dict, list, tuple)


def _key_text(key: object) -> object:
    """A key as JSON writes it (json.dumps turns numbers, True, False and None into text)."""
    return key if isinstance(key, str) else json.dumps(key)


def deserialize_context(data: bytes | bytearray | memoryview, *, limit: int = DEFAULT_CONTEXT_LIMIT) -> HandoffContext:
    """Decode sw4rm context bytes. Every malformed input raises DecodeError (or PayloadTooLarge)."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise DecodeError(f"context must be bytes, not {type(data).__name__}")
    if len(data) > limit:
        raise PayloadTooLarge(f"context is {len(data)} bytes; the limit is {limit}")
    try:
        wire = _wire_decoder.decode(data)
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError) as exc:  # RecursionError: nested too deep
        wire = _read_as_sw4rm(data, exc)
    return HandoffContext(
        conversation_history=[ConversationEntry.from_dict(e) for e in wire.conversation_history],
        tool_state=wire.tool_state,
        metadata=wire.metadata,
    )


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _read_as_sw4rm(data: bytes | bytearray | memoryview, exc: Exception) -> _Wire:
    """What msgspec refused, read as sw4rm reads it (Python's json): the escape of a lone UTF-16
    surrogate (half an emoji, cut off), which sw4rm and ``serialize_context`` both write. Still
    strict UTF-8, and NaN and Infinity stay refused (``serialize_context`` never writes them)."""
    try:
        return msgspec.convert(json.loads(bytes(data).decode("utf-8"), parse_constant=_refuse_constant), _Wire)
    except (ValueError, RecursionError, msgspec.ValidationError):  # UnicodeDecodeError and JSON's own are ValueErrors
        raise DecodeError(f"invalid handoff context: {exc}") from None


def context_json_schema() -> dict[str, Any]:
    """The JSON Schema (draft-07) of the serialized context, as published by sw4rm."""
    entry = {
        "type": "object",
        "properties": {
            "role": {"type": "string", "description": "Message role (user, assistant, system, tool)"},
            "content": {"type": "string", "description": "Message content"},
            "timestamp": {"type": "string", "format": "date-time", "description": "ISO 8601 timestamp"},
            "tool_call_id": {"type": "string", "description": "For tool responses, the call ID"},
            "name": {"type": "string", "description": "For tool calls, the tool name"},
            "metadata": {"type": "object", "description": "Optional message metadata"},
        },
        "required": ["role", "content"],
    }
    return {
        "$schema": "http://json-schema.org/draft-07/schema#",
        "title": "HandoffContext",
        "type": "object",
        "properties": {
            "conversation_history": {
                "type": "array",
                "description": "Prior messages in the conversation",
                "items": entry,
            },
            "tool_state": {
                "type": "object",
                "description": "Current tool state including active calls and cached results",
                "additionalProperties": True,
            },
            "metadata": {
                "type": "object",
                "description": "Additional context metadata",
                "additionalProperties": True,
            },
        },
        "required": ["conversation_history", "tool_state", "metadata"],
    }
