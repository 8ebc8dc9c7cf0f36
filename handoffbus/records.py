"""Turn what Redis holds (record hashes, response stream entries, script replies) into models."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import msgspec

from .codecs import PayloadCodec
from .errors import DecodeError, HandoffbusError, InvalidRequest
from .models import HandoffRecord, HandoffRequest, HandoffResponse, HandoffStatus, HistoryEntry, RouteStep
from .names import split_handoff_id
from .signing import SIGNED_RESPONSE_FIELDS, Keyring, response_body, signature_version, unsigned_response

__all__ = ["RESPONSE_FIELDS", "Loaded", "Made", "loaded_from_row", "made_response", "poison_row", "record_from_hash",
           "response_from_fields", "response_from_reply", "text"]

log = logging.getLogger("handoffbus")

#: Order of the fields after the code in a transition script's reply (see lua/includes/record.lua).
RESPONSE_FIELDS = (b"status", b"actor", b"ts", b"agent", b"reason", b"code", b"retry", b"redirect",
                   b"result", b"error", b"rmeta", b"sig")
_ACCEPTED_LIKE = {HandoffStatus.ACCEPTED, HandoffStatus.COMPLETED, HandoffStatus.FAILED}
#: a status as Redis holds it (a lookup costs a fraction of HandoffStatus(raw.decode()))
_STATUS = {status.value.encode(): status for status in HandoffStatus}
_history_decoder = msgspec.json.Decoder(list[HistoryEntry])
_route_decoder = msgspec.json.Decoder(tuple[RouteStep, ...])


def text(value: Any) -> str:
    """A reply value as text (bytes decoded, anything else as ``str``)."""
    return value.decode() if isinstance(value, bytes) else str(value)


def _optional_text(value: bytes | None) -> str | None:
    return None if value is None else value.decode()


def response_from_fields(
    handoff_id: str, f: Mapping[bytes, bytes], codec: PayloadCodec, keyring: Keyring | None = None,
    appended_ms: int | None = None,
) -> HandoffResponse:
    """Build a response from stream-entry style fields (``ts`` is the transition's Redis time).
    With a keyring, an agent's response must carry its actor's valid signature (made within
    the replay window of ``appended_ms``, its stream entry's time, when given)."""
    if keyring is not None:
        check_response(keyring, handoff_id, f, appended_ms)
    try:
        raw_status = f.get(b"status")
        if raw_status is None:  # absent, or a Lua false in a script reply
            raise DecodeError(f"malformed response for {handoff_id!r}: no status")
        status = _STATUS[raw_status]
        retry = f.get(b"retry")
        result, meta = f.get(b"result"), f.get(b"rmeta")
        return HandoffResponse(
            handoff_id=handoff_id,
            request_id=handoff_id.partition("/")[2],  # read back from Redis: validated when written
            status=status,
            accepted=status in _ACCEPTED_LIKE,
            actor=_optional_text(f.get(b"actor")),
            accepting_agent=_optional_text(f.get(b"agent")),
            rejection_reason=_optional_text(f.get(b"reason")),
            rejection_code=_optional_text(f.get(b"code")),
            retry_after_ms=None if retry is None else int(retry),
            redirect_to_agent=_optional_text(f.get(b"redirect")),
            result=None if result is None else codec.loads_value(result),
            error=_optional_text(f.get(b"error")),
            metadata=_metadata(handoff_id, meta, codec),
            timestamp_ms=int(f.get(b"ts") or 0),
        )
    except (KeyError, ValueError) as exc:
        if isinstance(exc, HandoffbusError):  # DecodeError, PayloadTooLarge: typed already
            raise
        raise DecodeError(f"malformed response for {handoff_id!r}: {exc!r}") from None


def _metadata(handoff_id: str, meta: bytes | None, codec: PayloadCodec) -> dict[str, Any]:
    metadata = {} if meta is None else codec.loads_value(meta)
    if not isinstance(metadata, dict):  # any msgpack value decodes; the model promises a map
        raise DecodeError(f"response metadata of {handoff_id!r} is a {type(metadata).__name__}, not a map")
    return metadata


def response_from_reply(handoff_id: str, reply: Sequence[Any], codec: PayloadCodec) -> HandoffResponse:
    """Build a response from a transition script's reply (after its leading code)."""
    return response_from_fields(handoff_id, dict(zip(RESPONSE_FIELDS, reply, strict=False)), codec)


class Made(NamedTuple):
    """A transition the caller has just made, before its response is built: a worker needs
    only the status (building the response would decode the result it has just encoded)."""

    handoff_id: str
    status: HandoffStatus
    actor: str
    ts: bytes
    owner: bytes | None
    fields: Mapping[str, Any]

    def response(self, codec: PayloadCodec) -> HandoffResponse:
        return made_response(self.handoff_id, self.status.value, self.actor, self.ts, self.owner, self.fields, codec)


def made_response(
    handoff_id: str, status: str, actor: str, ts: bytes, owner: bytes | None, fields: Mapping[str, Any],
    codec: PayloadCodec,
) -> HandoffResponse:
    """The response of a transition the caller has just made. Its script answers with what the
    caller cannot know (the time, the owner) and no more: the rest is the caller's own fields,
    as the script stored and sent them (values as they go on the wire; others than a response's
    are ignored)."""
    f: dict[bytes, Any] = {b"status": status.encode(), b"actor": actor.encode(), b"ts": ts, b"agent": owner}
    for name, value in fields.items():
        if value is not None:
            f[name.encode()] = value if isinstance(value, bytes) else str(value).encode()
    return response_from_fields(handoff_id, f, codec)


def record_from_hash(f: Mapping[bytes, bytes], codec: PayloadCodec, keyring: Keyring | None = None) -> HandoffRecord:
    """Build a record from its hash. A field missing or unreadable raises DecodeError."""
    try:
        return _record_from_hash(f, codec, keyring)
    except HandoffbusError:
        raise
    except (KeyError, ValueError) as exc:
        raise DecodeError(f"malformed record {f.get(b'id')!r}: {exc!r}") from None


def _record_from_hash(f: Mapping[bytes, bytes], codec: PayloadCodec, keyring: Keyring | None) -> HandoffRecord:
    handoff_id = f[b"id"].decode()
    try:
        history = tuple(_history_decoder.decode(f[b"hist"]))
        route = _route_decoder.decode(f[b"chain"]) if b"chain" in f else ()
    except msgspec.DecodeError as exc:
        raise DecodeError(f"malformed history or route for {handoff_id!r}: {exc}") from None
    response_fields = dict(f)
    response_fields[b"ts"] = f[b"updated"]
    return HandoffRecord(
        handoff_id=handoff_id,
        request=codec.loads(f[b"env"], HandoffRequest),
        status=HandoffStatus(f[b"status"].decode()),
        created_ms=int(f[b"created"]),
        deadline_ms=int(f[b"deadline"]),
        updated_ms=int(f[b"updated"]),
        history=history,
        response=response_from_fields(handoff_id, response_fields, codec,
                                      None if f[b"status"] == b"PENDING" else keyring),
        attempt=int(f.get(b"attempt", 1)),
        lease=f[b"lease"].decode() if b"lease" in f else None,
        route=route,
        accepted_metadata=_accepted_metadata(handoff_id, f.get(b"ameta"), codec),
    )


def _accepted_metadata(handoff_id: str, meta: bytes | None, codec: PayloadCodec) -> dict[str, Any]:
    """The acceptance's metadata, kept past the later transitions; one this bus cannot read
    (over its payload limit, say) is left out, with a warning, rather than make the whole
    record unreadable: its current response is what a reader asked for."""
    try:
        return _metadata(handoff_id, meta, codec)
    except HandoffbusError as exc:
        log.warning("handoff %s: the acceptance's metadata cannot be read (%s); left out", handoff_id, exc)
        return {}


class Loaded(NamedTuple):
    """What a worker (or a pending listing) reads of a record: status, request, the agent that
    accepted it, its attempt, created and deadline times. ``error`` says why the record could
    not be decoded (then ``request`` is None)."""

    status: HandoffStatus
    request: HandoffRequest | None
    agent: str | None
    attempt: int
    created_ms: int = 0
    deadline_ms: int = 0
    error: str | None = None


def loaded_from_row(
    row: Sequence[Any], codec: PayloadCodec, keyring: Keyring | None = None, handoff_id: str | None = None
) -> Loaded | None:
    """Decode a ``load`` script reply; None when the record is gone. Never raises for bad data.
    With a keyring, the request's signature is checked before its payload is decoded, an
    accepted one's too (a takeover runs it).
    Given the ``handoff_id`` it was read as, a record that names another handoff, or whose
    request is not its requester's own, is poison (see ``check_belongs``)."""
    status, env, agent, attempt, created, deadline = row[:6]
    if status is None:
        return None
    try:
        fields: dict[str, Any] = {
            "agent": agent.decode() if agent else None, "attempt": int(attempt or 0),
            "created_ms": int(created or 0), "deadline_ms": int(deadline or 0),
        }
    except ValueError as exc:  # an unreadable number or agent id poisons the record like a bad envelope
        return poison_row(exc)
    try:
        if keyring is not None:  # accepted ones too: a takeover runs them
            check_request(keyring, row, env or b"")
        request = codec.loads(env or b"", HandoffRequest)
        if handoff_id is not None:
            check_belongs(handoff_id, row, request)
        return Loaded(status=HandoffStatus(status.decode()), request=request, **fields)
    except (HandoffbusError, ValueError) as exc:  # a poison record: reported, never raised
        return poison_row(exc, **fields)


def poison_row(
    exc: Exception, agent: str | None = None, attempt: int = 0, created_ms: int = 0, deadline_ms: int = 0
) -> Loaded:
    """A handoff whose record cannot be read, and why: its worker dead-letters it."""
    return Loaded(status=HandoffStatus.PENDING, request=None, agent=agent, attempt=attempt, created_ms=created_ms,
                  deadline_ms=deadline_ms, error=f"{type(exc).__name__}: {exc}")


def check_belongs(handoff_id: str, row: Sequence[Any], request: HandoffRequest) -> None:
    """A ``load`` reply read as ``handoff_id`` must be that handoff's: the record's id and
    sender, and its request's sender, id and target (a routed one's is set by routing). Its
    requester may write anything in its own slot; a signature covers the record's id and
    sender, so a record copied under another id, or a request in another agent's name, would
    pass it. Raises InvalidRequest."""
    requester, request_id = split_handoff_id(handoff_id)
    hid, sender, to, routed = (v.decode() if isinstance(v, bytes) else v for v in row[6:10])
    if hid != handoff_id or sender != requester:
        raise InvalidRequest(f"the record read as {handoff_id!r} names handoff {hid!r} from {sender!r}")
    if request.from_agent != requester or request.request_id != request_id or (
            routed != "1" and request.to_agent != (to or "")):
        raise InvalidRequest(f"the request stored as {handoff_id!r} is {request.from_agent}/{request.request_id} "
                             f"to {request.to_agent!r}")


def check_request(keyring: Keyring, row: Sequence[Any], env: bytes) -> None:
    """Check the signature of a ``load`` reply's request over the stored bytes (routed
    requests were signed with no target: the record's target is set later, by routing), and
    that it was signed within the replay window of the record's creation."""
    created, deadline, hid, sender, to, routed, caps, sig, now = (
        v.decode() if isinstance(v, bytes) else v for v in row[4:13])
    parts = [hid or "", sender or "", "" if routed == "1" else (to or ""), caps or "",
             str(int(deadline or 0) - int(created or 0))]
    # the window bounds the signing against the record's creation (Redis time when it was
    # written), not against this read: a request that waits in a long queue is not stale, and
    # one replayed later as a new request is created later than it was signed
    keyring.verify(sig, sender or "", "request", parts, env, int(created or 0) or int(now))


def check_response(keyring: Keyring, handoff_id: str, f: Mapping[bytes, bytes], appended_ms: int | None = None) -> None:
    """Check a stored response's signature (raises SignatureInvalid). A response stream entry's
    id is the server's time when it was appended, which no writer can set into the past: a
    signature made longer than the replay window before it is an old response written again
    (under a request id used once more, its earlier handoff's outcome would pass). ``ts`` is
    no bound: any writer of the stream sets it."""
    status = (f.get(b"status") or b"").decode(errors="replace")
    actor = (f.get(b"actor") or b"").decode(errors="replace")
    code = (f.get(b"code") or b"").decode(errors="replace")
    if unsigned_response(status, actor, code):
        return
    sig = f.get(b"sig")
    body = response_body({name: f.get(name.encode()) for name in SIGNED_RESPONSE_FIELDS}, signature_version(sig))
    keyring.verify(sig, actor, "response", [handoff_id, status, actor], body, appended_ms or 0,
                   window=appended_ms is not None)
