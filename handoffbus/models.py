"""Messages and records: every one a frozen, keyword-only ``msgspec.Struct``.

New fields always get defaults so that messages written by older versions still decode.
"""

from __future__ import annotations

import enum
from typing import Any

import msgspec

__all__ = [
    "DECISIONS",
    "OUTCOMES",
    "TERMINAL",
    "AgentInfo",
    "DeadLetter",
    "HandoffRecord",
    "HandoffRequest",
    "HandoffResponse",
    "HandoffStatus",
    "HistoryEntry",
    "PendingHandoff",
    "WorkerInfo",
]


class HandoffStatus(enum.StrEnum):
    PENDING = "PENDING"
    ACCEPTED = "ACCEPTED"
    REJECTED = "REJECTED"
    COMPLETED = "COMPLETED"
    EXPIRED = "EXPIRED"
    CANCELLED = "CANCELLED"
    FAILED = "FAILED"


#: Statuses that answer "was it taken?" — the first response a requester hears.
DECISIONS = frozenset(
    {HandoffStatus.ACCEPTED, HandoffStatus.REJECTED, HandoffStatus.EXPIRED, HandoffStatus.CANCELLED}
)
#: Statuses after which nothing changes.
TERMINAL = frozenset(
    {
        HandoffStatus.REJECTED,
        HandoffStatus.COMPLETED,
        HandoffStatus.EXPIRED,
        HandoffStatus.CANCELLED,
        HandoffStatus.FAILED,
    }
)
OUTCOMES = TERMINAL


class HandoffRequest(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """A request to hand work to another agent (sw4rm's fields plus request_id, priority, timeout).

    ``to_agent`` empty means capability routing. ``priority``: lower is served first.
    ``timeout``: seconds to acceptance; ``None`` takes the bus default.
    ``request_id``: idempotency key, generated when empty; resubmitting it never creates a
    second handoff.
    """

    from_agent: str
    to_agent: str = ""
    reason: str = ""
    context_snapshot: bytes | None = None
    preserve_history: bool = True
    capabilities_required: list[str] = []
    priority: int = 0
    timeout: float | None = None
    metadata: dict[str, Any] = {}
    request_id: str = ""


class HandoffResponse(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """One transition of a handoff as the requester hears it. ``timestamp_ms`` is Redis time."""

    handoff_id: str
    status: HandoffStatus
    accepted: bool = False
    request_id: str = ""
    actor: str | None = None
    accepting_agent: str | None = None
    rejection_reason: str | None = None
    rejection_code: str | None = None
    retry_after_ms: int | None = None
    redirect_to_agent: str | None = None
    result: Any = None
    error: str | None = None
    metadata: dict[str, Any] = {}
    timestamp_ms: int = 0


class HistoryEntry(msgspec.Struct, frozen=True, kw_only=True, array_like=True):
    """One transition: the status entered, who made it, and when (Redis TIME, ms)."""

    status: HandoffStatus
    actor: str
    at_ms: int


class RouteStep(msgspec.Struct, frozen=True, kw_only=True, array_like=True):
    """One step of a routed handoff's way: an agent it was OFFERED to, that REFUSED or
    DEFERRED it (with the rejection code), whose offer LAPSED (it did not decide in time), or
    that RELEASED it (its worker stopped before deciding)."""

    agent: str
    event: str
    at_ms: int
    code: str = ""


class HandoffRecord(msgspec.Struct, frozen=True, kw_only=True):
    """An immutable snapshot of a handoff as stored in Redis, with its transition history."""

    handoff_id: str
    request: HandoffRequest
    status: HandoffStatus
    created_ms: int
    deadline_ms: int
    updated_ms: int
    history: tuple[HistoryEntry, ...]
    response: HandoffResponse
    #: runs of the work so far (retries and takeovers of a crashed worker's handoff add one)
    attempt: int = 1
    #: the worker (consumer) holding an accepted handoff's work, if any
    lease: str | None = None
    #: a capability-routed handoff's way through the agents, oldest first (empty if direct)
    route: tuple[RouteStep, ...] = ()
    #: what the accepting agent sent with its acceptance (``Accept.metadata``), kept after the
    #: later transitions replaced ``response``
    accepted_metadata: dict[str, Any] = {}

    @property
    def terminal(self) -> bool:
        return self.status in TERMINAL


class DeadLetter(msgspec.Struct, frozen=True, kw_only=True):
    """A handoff an agent's workers gave up on: why, after how many deliveries, by whom."""

    entry_id: str
    handoff_id: str
    reason: str
    deliveries: int
    consumer: str
    at_ms: int


class DeadLetterAction(msgspec.Struct, frozen=True, kw_only=True):
    """What replaying or failing a dead letter did, the dead letter being dropped either way.
    True (``done``): its handoff was queued again (an ACCEPTED one: issued for a live worker
    to take over), or failed. False: nothing else was done, its handoff having ended
    (``status``), being held by a worker again (``held``), its record being gone (``status``
    None), or it naming no handoff (a hand-written queue member; ``handoff_id`` shown escaped)."""

    handoff_id: str
    done: bool
    #: the handoff's status as read (a replay), or as the fail left it (FAILED)
    status: HandoffStatus | None = None
    #: dropped alone because a worker holds the handoff again: one of the agent's (the same
    #: request was sent again, or a routed offer made again), or of another agent that accepted
    #: it since (routed on): the dead letter was stale
    held: bool = False

    def __bool__(self) -> bool:
        return self.done


class WorkerInfo(msgspec.Struct, frozen=True, kw_only=True):
    """One live worker process of an agent, as it last reported itself."""

    consumer: str
    state: str
    load: int
    limit: int
    capabilities: list[str] = []
    started_ms: int = 0
    beat_ms: int = 0
    #: how long its agents have to decide a routed offer (ms; 0: not said, the router's own)
    offer_ms: int = 0


class AgentInfo(msgspec.Struct, frozen=True, kw_only=True):
    """An agent with at least one live worker: its capabilities and its workers."""

    agent_id: str
    capabilities: list[str]
    workers: list[WorkerInfo]

    @property
    def load(self) -> int:
        return sum(w.load for w in self.workers)

    @property
    def limit(self) -> int:
        return sum(w.limit for w in self.workers)


class PendingHandoff(msgspec.Struct, frozen=True, kw_only=True):
    """A handoff waiting in an agent's queue, as listed by ``get_pending_handoffs``."""

    handoff_id: str
    request: HandoffRequest
    created_ms: int
    deadline_ms: int
