"""Large or binary context content out of band.

A context is JSON, kept whole in its handoff's record, and read by every status call. A
large document or file in it would make each of those reads cost as much. ``offload``
moves such content into keys of their own, in the requester's slot
(``<p>:{R}:blob:<sha256>``), with a time to live. The context keeps a reference in its
place: ``{"$hb_blob": key, "size": n, "sha256": ..., "kind": "str"|"bytes"}``.
``restore`` puts the content back on the receiving side.

What goes out: ``bytes`` anywhere in the tool state (JSON cannot hold them), and any string
in the tool state or message content longer than the threshold, which counts UTF-8 bytes,
not characters. The content is stored once per digest, so the same content sent twice
costs one key. That key lives as long as the longest lifetime any of its handoffs asked
for: a later offload of the same content with a shorter ``ttl`` never shortens it (Redis
>= 7.0's ``PEXPIRE ... GT``). A reference whose key has expired raises ``DecodeError`` when
it is restored.
"""

from __future__ import annotations

import hashlib
import re
from typing import TYPE_CHECKING, Any

import msgspec

from ..config import check_seconds
from ..context import HandoffContext
from ..errors import DecodeError, InvalidRequest
from ..names import split_handoff_id
from .context import entries_of

if TYPE_CHECKING:
    from ..bus import HandoffBus

__all__ = ["BLOB_REF", "has_blobs", "offload", "restore"]

BLOB_REF = "$hb_blob"
#: entries whose content went out of band say so in their extra fields
ENTRY_REF = "hb.blob"
_BLOB_REF_JSON = f'"{BLOB_REF}"'.encode()
#: the fields of a reference, exactly as ``_ref`` writes them: a dict of the user's that merely
#: has a ``$hb_blob`` key is data, not a reference (and never names a key for restore to read)
_REF_FIELDS = frozenset({BLOB_REF, "size", "sha256", "kind"})
#: a blob key (``Keys.blob``): the bus's prefix, a requester's slot, the content's digest
_BLOB_KEY = re.compile(r"(.+):\{[^{}]+\}:blob:([0-9a-f]{64})")
#: text may end in half an emoji (a lone surrogate), which a context carries (see context.py):
#: stored as its three bytes, read back the same
SURROGATES = "surrogatepass"


def _ref(bus: HandoffBus, requester: str, data: bytes, kind: str, found: dict[str, bytes]) -> dict[str, Any]:
    digest = hashlib.sha256(data).hexdigest()
    key = bus.keys.blob(requester, digest)
    found[key] = data
    return {BLOB_REF: key, "size": len(data), "sha256": digest, "kind": kind}


def _utf8_over(text: str, threshold: int) -> bytes | None:
    """``text`` as UTF-8 when that is longer than ``threshold`` bytes, else None. The threshold
    is in bytes, as the stored content is: a character may take up to four."""
    if len(text) * 4 <= threshold:  # cannot be over: spare encoding every short string
        return None
    data = text.encode("utf-8", SURROGATES)
    return data if len(data) > threshold else None


async def offload(bus: HandoffBus, requester: str, context: HandoffContext, *, threshold: int = 64 * 1024,
                  ttl: float | None = None) -> HandoffContext:
    """``context`` with its large and binary content moved to blob keys (written now, living
    ``ttl`` seconds: by default the bus's longest timeout plus its record retention)."""
    if type(threshold) is not int or threshold < 0:
        raise InvalidRequest(f"offload's threshold must be an int of at least 0 (bytes), not {threshold!r}")
    if ttl is not None:
        check_seconds("offload's ttl", ttl)
    found: dict[str, bytes] = {}

    def walk(value: Any) -> Any:
        if isinstance(value, bytes | bytearray | memoryview):
            return _ref(bus, requester, bytes(value), "bytes", found)
        if isinstance(value, str) and (data := _utf8_over(value, threshold)) is not None:
            return _ref(bus, requester, data, "str", found)
        if isinstance(value, dict):
            return {k: walk(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [walk(v) for v in value]
        return value

    history = []
    for entry in entries_of(context):
        content = _utf8_over(entry.content, threshold)
        if content is not None:
            ref = _ref(bus, requester, content, "str", found)
            entry = msgspec.structs.replace(entry, content="", extra={**entry.extra, ENTRY_REF: ref})
        history.append(entry)
    offloaded = msgspec.structs.replace(context, conversation_history=history, tool_state=walk(context.tool_state))
    if found:
        lifetime = ttl if ttl is not None else bus.config.max_timeout + bus.config.record_retention
        ms = max(1, int(lifetime * 1000))
        async with bus.redis.pipeline(transaction=False) as pipe:
            for key, data in found.items():
                # the same content may be another handoff's, living longer: a lifetime only
                # grows. Written if absent; else lengthened if shorter; and written once more
                # if absent, in case the key lapsed between the first two.
                pipe.set(key, data, px=ms, nx=True)
                pipe.pexpire(key, ms, gt=True)
                pipe.set(key, data, px=ms, nx=True)
            await pipe.execute()
    return offloaded


def _is_ref(bus: HandoffBus, value: Any) -> bool:
    """Whether ``value`` is a reference ``offload`` wrote: its four fields, and a key that is a
    blob key of this bus named by the reference's own digest."""
    if not isinstance(value, dict) or value.keys() != _REF_FIELDS:
        return False
    key = value[BLOB_REF]
    found = _BLOB_KEY.fullmatch(key) if isinstance(key, str) else None
    return (found is not None and found[1] == bus.keys.prefix and found[2] == value["sha256"]
            and type(value["size"]) is int and value["kind"] in ("str", "bytes"))


def has_blobs(snapshot: bytes | None) -> bool:
    """Whether a serialized context refers to out-of-band content (a substring search of its
    JSON: every reference, message or tool state, carries the ``$hb_blob`` key)."""
    return snapshot is not None and _BLOB_REF_JSON in snapshot


async def restore(bus: HandoffBus, context: HandoffContext, handoff_id: str | None = None) -> HandoffContext:
    """``context`` with every blob reference replaced by its content. An isolated agent reads
    a peer's blobs through the forwarder, which needs the ``handoff_id`` whose context it is."""
    refs: list[dict[str, Any]] = []

    def collect(value: Any) -> None:
        if isinstance(value, dict):
            if _is_ref(bus, value):
                refs.append(value)
            else:
                for v in value.values():
                    collect(v)
        elif isinstance(value, list):
            for v in value:
                collect(v)

    entries = entries_of(context)
    collect(context.tool_state)
    for entry in entries:
        collect({"_": entry.extra.get(ENTRY_REF)})
    if not refs:
        return context
    keys = sorted({ref[BLOB_REF] for ref in refs})
    if handoff_id is not None and bus.forwarded(keys):
        record = bus.keys.record(*split_handoff_id(handoff_id)).record
        replies = await bus.scripts_many([("blob", [key, record], []) for key in keys])
        for reply in replies:
            if isinstance(reply, BaseException):
                raise reply
    else:
        async with bus.redis.pipeline(transaction=False) as pipe:
            for key in keys:
                pipe.get(key)
            replies = await pipe.execute()
    values = dict(zip(keys, replies, strict=True))

    def content(ref: dict[str, Any]) -> Any:
        data = values.get(ref[BLOB_REF])
        if data is None:
            raise DecodeError(f"the context's out-of-band content {ref[BLOB_REF]!r} is gone (expired or deleted)")
        if hashlib.sha256(data).hexdigest() != ref.get("sha256"):
            raise DecodeError(f"the context's out-of-band content {ref[BLOB_REF]!r} does not match its digest")
        return data.decode("utf-8", SURROGATES) if ref.get("kind") == "str" else data

    def put_back(value: Any) -> Any:
        if isinstance(value, dict):
            return content(value) if _is_ref(bus, value) else {k: put_back(v) for k, v in value.items()}
        if isinstance(value, list):
            return [put_back(v) for v in value]
        return value

    history = []
    for entry in entries:
        ref = entry.extra.get(ENTRY_REF)
        if isinstance(ref, dict) and _is_ref(bus, ref):
            extra = {k: v for k, v in entry.extra.items() if k != ENTRY_REF}
            entry = msgspec.structs.replace(entry, content=content(ref), extra=extra)
        history.append(entry)
    return msgspec.structs.replace(context, conversation_history=history, tool_state=put_back(context.tool_state))
