"""The exception tree, and the one place where Lua return codes become exceptions."""

from __future__ import annotations

from typing import NoReturn

__all__ = [
    "AuthenticationFailed",
    "CallRefused",
    "DecodeError",
    "EncodeError",
    "ForwarderUnavailable",
    "HandoffExpired",
    "HandoffNotFound",
    "HandoffbusError",
    "InvalidName",
    "InvalidRequest",
    "InvalidTransition",
    "LeaseLost",
    "NotPermitted",
    "PayloadTooLarge",
    "QueueFull",
    "RequestConflict",
    "ServerUnsupported",
    "SignatureInvalid",
    "TooManyPending",
    "raise_for_code",
]


class HandoffbusError(Exception):
    """Root of every error handoffbus raises."""


class InvalidRequest(HandoffbusError, ValueError):
    """A request or argument is malformed; nothing was written to Redis."""


class RouteRefused(InvalidRequest):
    """The bus's handoff policy does not allow this request; nothing was written. ``code``:
    ``ROUTE_NOT_IN_SCENARIO``, ``MAX_DEPTH``, ``CYCLE`` or ``BAD_HOP_CHAIN``."""

    def __init__(self, handoff_id: str, code: str, reason: str) -> None:
        super().__init__(f"{code}: {reason}")
        self.handoff_id = handoff_id
        self.code = code
        self.reason = reason


class InvalidName(InvalidRequest):
    """An agent id, capability or request id breaks the name rule."""


class DecodeError(HandoffbusError, ValueError):
    """Bytes could not be decoded into the expected shape."""


class EncodeError(HandoffbusError, ValueError):
    """A value could not be encoded (an unsupported type, a dict key that is not text, nesting too deep)."""


class PayloadTooLarge(HandoffbusError, ValueError):
    """A payload exceeds the configured size limit (checked before decoding)."""


class HandoffNotFound(HandoffbusError, LookupError, ValueError):
    """No handoff record exists for this id (never created, or past retention). A ValueError
    too, as sw4rm's client raises for a missing handoff id."""

    def __init__(self, handoff_id: str) -> None:
        super().__init__(f"handoff {handoff_id!r} not found")
        self.handoff_id = handoff_id


class InvalidTransition(HandoffbusError, ValueError):
    """The handoff's current status does not allow this transition. A ValueError too, as
    sw4rm's client raises for an invalid state transition."""

    def __init__(self, handoff_id: str, current: str, attempted: str, owner: str | None = None) -> None:
        super().__init__(f"cannot {attempted} handoff {handoff_id!r}: it is {current}")
        self.handoff_id = handoff_id
        self.current = current
        self.attempted = attempted
        #: the agent that accepted it, told only to that agent and to the requester (else None)
        self.owner = owner


class HandoffExpired(InvalidTransition):
    """The acceptance deadline passed before this transition; the handoff is EXPIRED."""

    def __init__(self, handoff_id: str, attempted: str) -> None:
        super().__init__(handoff_id, "EXPIRED", attempted)


class NotPermitted(HandoffbusError, PermissionError):
    """The acting agent has no right to make this transition."""

    def __init__(self, handoff_id: str, actor: str, attempted: str) -> None:
        super().__init__(f"agent {actor!r} may not {attempted} handoff {handoff_id!r}")
        self.handoff_id = handoff_id
        self.actor = actor
        self.attempted = attempted


class LeaseLost(HandoffbusError):
    """The handoff's lease is held by another consumer: its work was reclaimed from this one."""

    def __init__(self, handoff_id: str, holder: str) -> None:
        super().__init__(f"handoff {handoff_id!r} is now held by {holder or 'no worker'!r}")
        self.handoff_id = handoff_id
        self.holder = holder


class RequestConflict(HandoffbusError):
    """A request id was reused with different content."""

    def __init__(self, handoff_id: str) -> None:
        super().__init__(f"request id of {handoff_id!r} was already used for a different request")
        self.handoff_id = handoff_id


class QueueFull(HandoffbusError):
    """Backpressure: the target agent already has ``max_queued`` handoffs queued or in flight.
    Nothing was created; retry later (the same request id may be reused)."""

    def __init__(self, handoff_id: str, target: str) -> None:
        super().__init__(f"{target!r} has too many handoffs queued or in flight; {handoff_id!r} was not created")
        self.handoff_id = handoff_id
        self.target = target


class TooManyPending(HandoffbusError):
    """The requester already has ``max_pending`` undecided handoffs; nothing was created."""

    def __init__(self, handoff_id: str) -> None:
        super().__init__(f"too many undecided handoffs from this requester; {handoff_id!r} was not created")
        self.handoff_id = handoff_id


class SignatureInvalid(HandoffbusError):
    """A handoff's signature is missing, malformed, from an unknown or another agent's key,
    does not match its content, or is outside the replay window (see signing.py)."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"signature check failed: {reason}")
        self.reason = reason


class AuthenticationFailed(HandoffbusError, PermissionError):
    """The server refused the URL's credentials (wrong password, unknown or disabled user)."""


class CallRefused(HandoffbusError, PermissionError):
    """The forwarder refused an isolated agent's call: it acted as another agent, or on keys
    that are not its handoff's (see forwarding.py)."""


class ForwarderUnavailable(HandoffbusError, ConnectionError):
    """An isolated agent's call got no answer from the forwarder in time (it may still run)."""


class ScriptsFlushed(HandoffbusError, ConnectionError):
    """The server lost its functions (a FUNCTION FLUSH, a restart) while the calls of one step were
    on their way, and a later call ran before an earlier one could: none is sent again, which
    would run them out of order. Nothing the step meant to create exists (what a later call
    wrote alone, such as a queue entry with no record, is dropped where it is found); it may
    be tried again."""


class ServerUnsupported(HandoffbusError):
    """The Redis server is older than the supported minimum."""


class ServerUnavailable(HandoffbusError):
    """Redis could not be reached (refused, unreachable, timed out) when the bus opened."""


# Negative codes returned by the scripts under handoffbus/lua/ (see their headers).
NOT_FOUND = -1
INVALID_TRANSITION = -2
EXPIRED = -3
NOT_PERMITTED = -4
CONFLICT = -5
LEASE_LOST = -6
QUEUE_FULL = -7
TOO_MANY_PENDING = -8
NOT_WRITABLE = -9
ENVELOPE_MISSING = -10


def raise_for_code(
    code: int, handoff_id: str, actor: str, attempted: str, detail: bytes | None, owner: bytes | None = None
) -> NoReturn:
    """Raise the exception for a negative script return code (``owner``: a transition's -2
    reply's third element)."""
    if code == NOT_FOUND:
        raise HandoffNotFound(handoff_id)
    if code == INVALID_TRANSITION:
        raise InvalidTransition(handoff_id, (detail or b"?").decode(), attempted, owner.decode() if owner else None)
    if code == EXPIRED:
        raise HandoffExpired(handoff_id, attempted)
    if code == NOT_PERMITTED:
        raise NotPermitted(handoff_id, actor, attempted)
    if code == CONFLICT:
        raise RequestConflict(handoff_id)
    if code == LEASE_LOST:
        raise LeaseLost(handoff_id, (detail or b"").decode())
    if code == QUEUE_FULL:
        raise QueueFull(handoff_id, (detail or b"").decode())
    if code == TOO_MANY_PENDING:
        raise TooManyPending(handoff_id)
    if code == NOT_WRITABLE:
        field = (detail or b"?").decode()
        raise InvalidRequest(f"{attempted} on {handoff_id!r}: {field!r} is not a field it may write")
    if code == ENVELOPE_MISSING:
        raise HandoffbusError(f"{attempted} of {handoff_id!r}: the envelope sent beside it was gone before the "
                              "record was made (nothing was created: send it again)")
    raise HandoffbusError(f"unexpected script code {code} for {attempted} on {handoff_id!r}")
