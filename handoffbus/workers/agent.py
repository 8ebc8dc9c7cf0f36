"""What a user writes: an Agent with an acceptance hook and a work hook.

    class SecuritySpecialist(Agent):
        agent_id = "security-specialist-1"
        capabilities = ["code_review", "security_analysis"]

        async def on_handoff_request(self, request):   # -> Accept() or Reject(...) (or sw4rm's HandoffResponse)
            ...
        async def on_handoff_received(self, handoff):   # return value -> COMPLETED result
            ...

Hooks may be plain functions; the worker runs those in a worker thread so they never block
the event loop, unless marked ``@inline`` (quick and non-blocking: called on the loop, which
saves the thread hop). The default acceptance hook is inline.

With no acceptance hook written, an agent follows sw4rm: it rejects a request that needs a
capability it lacks, or that arrives while it is not RUNNABLE, and accepts the rest.
"""

from __future__ import annotations

import enum
import math
import random
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, ClassVar, TypeVar

import msgspec

from ..config import check_seconds
from ..context import DEFAULT_CONTEXT_LIMIT, HandoffContext, deserialize_context, serialize_context
from ..errors import DecodeError, HandoffbusError, InvalidRequest
from ..models import HandoffRequest, HandoffResponse
from ..policies.guards import HOPS_KEY, RETURN_KEY, hops_of
from ..policies.policy import RESOLUTION_KEY
from ..policies.scenario import HandoffResolution

__all__ = ["Accept", "Agent", "AgentState", "ReceivedHandoff", "Reject", "RetryPolicy", "inline", "is_inline"]

_INLINE = "__handoffbus_inline__"
_F = TypeVar("_F", bound=Callable[..., Any])


def inline(hook: _F) -> _F:
    """Mark a plain hook as quick and non-blocking: the worker calls it on its event loop
    instead of in a worker thread. Only for hooks that never wait on I/O or locks."""
    setattr(hook, _INLINE, True)
    return hook


def is_inline(hook: Callable[..., Any]) -> bool:
    return bool(getattr(hook, _INLINE, False))  # a bound method reads its function's attributes


class AgentState(enum.StrEnum):
    RUNNABLE = "RUNNABLE"
    BUSY = "BUSY"
    DRAINING = "DRAINING"


class Accept(msgspec.Struct, frozen=True, kw_only=True):
    """The acceptance hook's yes; ``metadata`` travels in the ACCEPTED response."""

    metadata: dict[str, Any] = {}


class Reject(msgspec.Struct, frozen=True, kw_only=True):
    """The acceptance hook's no, with what the requester (or a router) needs to act on it."""

    reason: str
    code: str | None = None
    retry_after_ms: int | None = None
    redirect_to: str | None = None


class RetryPolicy(msgspec.Struct, frozen=True, kw_only=True):
    """What happens when ``on_handoff_received`` raises: run it again after a backoff, up to
    ``attempts`` runs in all, then the handoff ends FAILED with the last error.

    Runs cut short by a crashed worker count too (the record's attempt number is the one
    counter), so a handler that kills its process cannot be retried forever. Only exceptions
    that are instances of ``retry_on`` are retried; anything else fails at once.
    """

    attempts: int = 1
    delay: float = 1.0
    backoff: float = 2.0
    max_delay: float = 60.0
    #: each delay is scaled by a random factor in [1 - jitter, 1] so retries do not march in step
    jitter: float = 0.5
    retry_on: tuple[type[BaseException], ...] = (Exception,)

    def __post_init__(self) -> None:
        if type(self.attempts) is not int or self.attempts < 1:
            raise InvalidRequest(f"RetryPolicy.attempts must be an int of at least 1, not {self.attempts!r}")
        for name in ("delay", "max_delay"):
            check_seconds(f"RetryPolicy.{name}", getattr(self, name), least=0)
        for name, value, least, most in (("backoff", self.backoff, 1, math.inf), ("jitter", self.jitter, 0, 1)):
            if (isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value)
                    or not least <= value <= most):
                bounds = f"from {least} to {most}" if math.isfinite(most) else f"finite and at least {least}"
                raise InvalidRequest(f"RetryPolicy.{name} must be a number {bounds}, not {value!r}")
        kinds = self.retry_on if isinstance(self.retry_on, tuple) else (self.retry_on,)
        if not all(isinstance(k, type) and issubclass(k, BaseException) for k in kinds):
            raise InvalidRequest(f"RetryPolicy.retry_on must be a tuple of exception classes, not {self.retry_on!r}")

    def should_retry(self, attempt: int, exc: BaseException) -> bool:
        return attempt < self.attempts and isinstance(exc, self.retry_on)

    def delay_before(self, attempt: int) -> float:
        """Seconds to wait before the run after ``attempt``."""
        try:
            grown = self.delay * float(self.backoff) ** (attempt - 1)
        except OverflowError:  # past any max_delay
            grown = math.inf if self.delay else 0.0
        base = min(self.max_delay, grown)
        return base * (1 - self.jitter * random.random())


async def _no_heartbeat() -> None:
    return None


class ReceivedHandoff(msgspec.Struct, frozen=True, kw_only=True):
    """An accepted handoff as ``on_handoff_received`` gets it.

    ``context`` is the decoded sw4rm context, or None when the request carried none (or bytes
    in another format: ``request.context_snapshot`` has them as sent). ``attempt`` counts the
    runs of this handoff's work (it rises on a retry and when a crashed worker's handoff is
    taken over): handlers must be idempotent.
    """

    handoff_id: str
    request: HandoffRequest
    context: HandoffContext | None
    attempt: int = 1
    renew: Callable[[], Awaitable[None]] = _no_heartbeat
    #: the receiving agent's client (a HandoffClient), for handing the conversation on
    client: Any = None

    @classmethod
    def of(
        cls, handoff_id: str, request: HandoffRequest, attempt: int = 1,
        renew: Callable[[], Awaitable[None]] = _no_heartbeat, client: Any = None, *,
        limit: int = DEFAULT_CONTEXT_LIMIT,
    ) -> ReceivedHandoff:
        """``limit``: the largest context decoded (a worker passes its bus's payload limit: a
        context the bus carried is never refused here)."""
        context = None
        if request.context_snapshot is not None:
            try:
                context = deserialize_context(request.context_snapshot, limit=limit)
            except HandoffbusError:
                context = None
        return cls(handoff_id=handoff_id, request=request, context=context, attempt=attempt, renew=renew,
                   client=client)

    @property
    def hops(self) -> list[str]:
        """The agents this conversation went through before this handoff's sender, oldest first."""
        return hops_of(self.request.metadata)

    @property
    def resolution(self) -> HandoffResolution | None:
        """What the sender's scenario said of this handoff (type, greeting, context_vars), if any.
        Raises DecodeError when the metadata holds one not in that shape (any sender may write it)."""
        found = self.request.metadata.get(RESOLUTION_KEY)
        if not isinstance(found, dict):
            return None
        try:
            return msgspec.convert(found, HandoffResolution)
        except msgspec.ValidationError as exc:
            raise DecodeError(
                f"metadata {RESOLUTION_KEY!r} of {self.handoff_id!r} is not a resolution: {exc}") from None

    def onward(self, to_agent: str, reason: str = "", context: HandoffContext | None = None,
               **fields: Any) -> HandoffRequest:
        """A request handing this conversation on to ``to_agent``, carrying the hop chain."""
        if self.client is None:
            raise InvalidRequest("this handoff has no client to hand it on with")
        metadata = {**fields.pop("metadata", {}), HOPS_KEY: [*self.hops, self.request.from_agent]}
        snapshot = serialize_context(context) if context is not None else fields.pop("context_snapshot", None)
        return HandoffRequest(from_agent=self.client.agent_id, to_agent=to_agent, reason=reason,
                              context_snapshot=snapshot, metadata=metadata, **fields)

    async def hand_to(self, to_agent: str, reason: str = "", context: HandoffContext | None = None,
                      **fields: Any) -> Any:
        """Hand the conversation on (its hop chain grows by this handoff's sender); returns the
        new handoff's handle. The bus's policy may refuse it: ``RouteRefused``."""
        return await self.client.request_handoff(self.onward(to_agent, reason, context, **fields))

    async def return_to_sender(self, context: HandoffContext | None = None, reason: str = "returned",
                               **fields: Any) -> Any:
        """Hand control back to the agent that handed this conversation over, with the updated
        context; not a cycle for the loop guards. Returns the new handoff's handle."""
        metadata = {**fields.pop("metadata", {}), RETURN_KEY: self.handoff_id}
        return await self.hand_to(self.request.from_agent, reason, context, metadata=metadata, **fields)

    async def heartbeat(self) -> None:
        """Renew this worker's hold on the handoff now, and check it still has it.

        The worker already renews every running handoff in the background; a handler calls
        this to learn early that it was taken over (``LeaseLost``), e.g. between long steps.
        With the server out of reach it returns: the lease is checked again at the next beat
        and when the outcome is sent.
        """
        await self.renew()


class Agent:
    """Base class of an agent served by a Worker. Override the hooks; set the two class fields."""

    agent_id: ClassVar[str]
    capabilities: ClassVar[Sequence[str]] = ()
    #: how a raising ``on_handoff_received`` is retried before the handoff ends FAILED
    retry: ClassVar[RetryPolicy] = RetryPolicy()

    def __init__(self) -> None:
        #: the agent's own availability (sw4rm): the default acceptance refuses unless RUNNABLE
        self.state = AgentState.RUNNABLE

    @inline
    def on_handoff_request(
        self, request: HandoffRequest
    ) -> Accept | Reject | HandoffResponse | Awaitable[Accept | Reject | HandoffResponse]:
        """Decide on a request (sw4rm's default). May be ``async def`` in a subclass. A hook
        ported from sw4rm may answer with a HandoffResponse: ``accepted`` says which."""
        missing = sorted(set(request.capabilities_required) - set(self.capabilities))
        if missing:
            return Reject(reason=f"missing capability: {', '.join(missing)}", code="CAPABILITY_MISSING")
        if self.state is not AgentState.RUNNABLE:
            return Reject(reason=f"agent is {self.state}", code="AGENT_NOT_RUNNABLE")
        return Accept()

    def on_handoff_received(self, handoff: ReceivedHandoff) -> Any:
        """Do the work; the return value becomes the COMPLETED result. Raising retries it per
        ``retry``, then makes it FAILED."""
        raise NotImplementedError(f"{type(self).__name__} does not implement on_handoff_received")
