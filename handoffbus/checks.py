"""What a request or a rejection must be before anything is written: the checks, a request's
normal form, and its content fingerprint (what tells a resend from a conflicting request)."""

from __future__ import annotations

import hashlib
import math
import os
from typing import Any

import msgspec

from . import tracing
from .config import MAX_PRIORITY, MAX_SECONDS
from .errors import EncodeError, InvalidRequest, NotPermitted
from .models import HandoffRequest
from .names import check_agent_id, check_name, check_names

__all__ = ["MAX_TEXT", "MIN_TIMEOUT", "NOT_IDENTITY", "OFFER_MARK", "SETTLE_MARK", "check_text", "normalize_request",
           "rejection_fields", "request_fingerprint"]

_canonical = msgspec.msgpack.Encoder(order="sorted")

#: the shortest acceptance timeout, in seconds (as config.check_seconds: Redis takes milliseconds)
MIN_TIMEOUT = 0.001


#: the longest reason or error text a transition writes, in characters: it goes into the record
#: and the requester's response stream as it is, and read back by every status query
MAX_TEXT = 64 * 1024


def check_text(value: object, what: str) -> str:
    """``value`` if it is a str of at most ``MAX_TEXT`` characters, else InvalidRequest."""
    if not isinstance(value, str):
        raise InvalidRequest(f"{what} must be a str")
    if len(value) > MAX_TEXT:
        raise InvalidRequest(f"{what} is {len(value)} characters long; at most {MAX_TEXT}")
    return value


#: the longest a refusal may defer an agent (as long as any setting's seconds): the deferral is
#: stored as a time in ms, which must stay a whole number the scripts can format
MAX_RETRY_MS = int(MAX_SECONDS * 1000)


def rejection_fields(
    reason: object, code: object, retry_after_ms: object, redirect_to: object
) -> dict[str, Any]:
    """Validate a rejection's details and return them as the reject script's fields."""
    check_text(reason, "reason")
    if code is not None:
        check_name(code, "rejection code")
    if redirect_to is not None:
        check_name(redirect_to, "agent id")
    if retry_after_ms is not None and (type(retry_after_ms) is not int or not 0 <= retry_after_ms <= MAX_RETRY_MS):
        raise InvalidRequest(f"retry_after_ms must be an int from 0 to {MAX_RETRY_MS}")
    return {"reason": reason, "code": code, "retry": retry_after_ms, "redirect": redirect_to}


#: how the deadline index marks a routed handoff's offer entry ("o:<request id>")
OFFER_MARK = "o:"
#: a deadline index member "~s:<request id>": an expired handoff whose target's queue the sweep
#: is yet to settle (see lua/sweep-1.lua); "~" is in no request id
SETTLE_MARK = "~s:"

#: metadata that says how a request was sent, not what it asks: the trace it was sent from,
#: and the scenario's resolution (its greeting and templates may differ between sends)
NOT_IDENTITY = (*tracing.TRACE_KEYS, "hb.handoff")


def request_fingerprint(request: HandoffRequest) -> bytes:
    """A digest of the request's content, the same whatever codec, compression or key order,
    and whatever trace or scenario resolution it was sent with (``NOT_IDENTITY``)."""
    if any(key in request.metadata for key in NOT_IDENTITY):
        request = msgspec.structs.replace(
            request, metadata={k: v for k, v in request.metadata.items() if k not in NOT_IDENTITY})
    try:
        body = _canonical.encode(request)
    except (TypeError, ValueError, OverflowError, RecursionError) as exc:  # e.g. a dict key that is not text
        raise EncodeError(f"cannot encode the request: {exc}") from None
    return hashlib.blake2b(body, digest_size=16).digest()


def normalize_request(
    request: HandoffRequest, agent_id: str, default_timeout: float, max_timeout: float
) -> HandoffRequest:
    """``request`` as ``agent_id`` sends it: checked (a typed error for anything a script or a
    reader would trip on, before anything is written), with a generated request id if it had
    none, its timeout defaulted and in seconds, and its names in their checked form."""
    if not isinstance(request, HandoffRequest):
        raise InvalidRequest(f"expected HandoffRequest, got {type(request).__name__}")
    if request.from_agent != agent_id:
        raise NotPermitted("-", agent_id, f"send a request as {request.from_agent!r}")
    to_agent = check_agent_id(request.to_agent) if request.to_agent else ""
    if to_agent == "" and not request.capabilities_required:
        raise InvalidRequest("a request needs to_agent, or capabilities_required for routing")
    caps = list(check_names(request.capabilities_required, "capability"))
    # a generated id: 128 random bits as 32 hex digits (what uuid4().hex gave, at a fifth of the cost)
    request_id = check_name(request.request_id, "request id") if request.request_id else os.urandom(16).hex()
    if request_id.startswith(OFFER_MARK):
        raise InvalidRequest(f"request ids starting with {OFFER_MARK!r} are reserved: the deadline index "
                             "keeps a routed handoff's offer under that prefix")
    if type(request.priority) is not int or abs(request.priority) > MAX_PRIORITY:
        raise InvalidRequest(f"priority must be an int in [-{MAX_PRIORITY}, {MAX_PRIORITY}]")
    timeout = default_timeout if request.timeout is None else request.timeout
    if (
        isinstance(timeout, bool)
        or not isinstance(timeout, int | float)
        or not -math.inf < timeout < math.inf  # NaN fails; a huge int compares (isfinite would overflow)
        # at least a millisecond: the deadline is kept in ms, and less would round to "now"
        or not MIN_TIMEOUT <= timeout <= max_timeout
    ):
        raise InvalidRequest(
            f"timeout must be a number of seconds from {MIN_TIMEOUT:g} to {max_timeout}")
    if request.context_snapshot is not None and not isinstance(request.context_snapshot, bytes):
        raise InvalidRequest("context_snapshot must be bytes (see serialize_context)")
    if not isinstance(request.reason, str) or not isinstance(request.preserve_history, bool):
        raise InvalidRequest("reason must be a str and preserve_history a bool")
    if not isinstance(request.metadata, dict):
        raise InvalidRequest("metadata must be a dict")
    return msgspec.structs.replace(
        request, to_agent=to_agent, capabilities_required=caps, request_id=request_id, timeout=float(timeout)
    )
