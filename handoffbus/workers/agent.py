"""What a user writes: an Agent with an acceptance hook and a work hook.

    class SecuritySpecialist(Agent):
        agent_id = "security-specialist-1"
        capabilities = ["code_review", "security_analysis"]

        async def on_handoff_request(self, request):   # -> Accept() or Reject(...)
            ...
        async def on_handoff_received(self, handoff):   # return value -> COMPLETED result
            ...

Hooks may be plain functions; the worker runs those in a worker thread so they never block
the event loop. With no acceptance hook written, an agent follows sw4rm: it rejects a
request that needs a capability it lacks, or that arrives while it is not RUNNABLE, and
accepts the rest.
"""

from __future__ import annotations

import enum
from collections.abc import Awaitable, Sequence
from typing import Any, ClassVar

import msgspec

from ..context import HandoffContext, deserialize_context
from ..errors import HandoffbusError
from ..models import HandoffRequest

__all__ = ["Accept", "Agent", "AgentState", "ReceivedHandoff", "Reject"]


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


class ReceivedHandoff(msgspec.Struct, frozen=True, kw_only=True):
    """An accepted handoff as ``on_handoff_received`` gets it.

    ``context`` is the decoded sw4rm context, or None when the request carried none (or bytes
    in another format: ``request.context_snapshot`` has them as sent).
    """

    handoff_id: str
    request: HandoffRequest
    context: HandoffContext | None
    attempt: int = 1

    @classmethod
    def of(cls, handoff_id: str, request: HandoffRequest, attempt: int = 1) -> ReceivedHandoff:
        context = None
        if request.context_snapshot is not None:
            try:
                context = deserialize_context(request.context_snapshot)
            except HandoffbusError:
                context = None
        return cls(handoff_id=handoff_id, request=request, context=context, attempt=attempt)


class Agent:
    """Base class of an agent served by a Worker. Override the hooks; set the two class fields."""

    agent_id: ClassVar[str]
    capabilities: ClassVar[Sequence[str]] = ()

    def __init__(self) -> None:
        #: the agent's own availability (sw4rm): the default acceptance refuses unless RUNNABLE
        self.state = AgentState.RUNNABLE

    def on_handoff_request(self, request: HandoffRequest) -> Accept | Reject | Awaitable[Accept | Reject]:
        """Decide on a request (sw4rm's default). May be ``async def`` in a subclass."""
        missing = sorted(set(request.capabilities_required) - set(self.capabilities))
        if missing:
            return Reject(reason=f"missing capability: {', '.join(missing)}", code="CAPABILITY_MISSING")
        if self.state is not AgentState.RUNNABLE:
            return Reject(reason=f"agent is {self.state}", code="AGENT_NOT_RUNNABLE")
        return Accept()

    def on_handoff_received(self, handoff: ReceivedHandoff) -> Any:
        """Do the work; the return value becomes the COMPLETED result, raising makes it FAILED."""
        raise NotImplementedError(f"{type(self).__name__} does not implement on_handoff_received")
