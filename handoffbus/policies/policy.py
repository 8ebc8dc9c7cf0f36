"""A bus's handoff policy: what every request goes through before anything is queued.

``HandoffBus.connect(url, policy=HandoffPolicy(...))`` (or ``handoffbus worker --scenario``).
For each request, in this order:

1. **Routes.** When the scenario governs the sender or the target, the route must be one of
   its edges. Otherwise the request is refused: ``RouteRefused``, code
   ``ROUTE_NOT_IN_SCENARIO``.
2. **Loop guards.** These are the hop chain's depth and cycles (codes ``MAX_DEPTH`` and
   ``CYCLE``; see guards.py). On a scenario's route, going back to an agent is no cycle
   (specialists return to the concierge): it is bounded by ``max_visits`` only.
3. **The scenario's resolution.** The request's metadata gets ``hb.handoff``: the type
   (announced or discrete), the greeting the target says on arrival (none when discrete; the
   return greeting when the conversation was with the target before), whether the context is
   shared, and the rendered ``context_vars``.
4. **The context.** On a scenario's route, control flags are sanitised out of its metadata
   and tool state, and a route that does not share context passes only the last user message
   and the reason. The context policy and input filters apply, and large content goes out of
   band (blobs.py). A context this step would change must be a sw4rm context: any other is
   refused (``InvalidRequest``), never passed on unshaped.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

import msgspec

from ..context import HandoffContext, serialize_context
from ..errors import InvalidRequest, RouteRefused
from ..models import HandoffRequest
from .blobs import offload
from .context import ContextPolicy, InputFilter, apply_context_policy, context_to_shape
from .guards import check_hops, hops_of
from .scenario import HandoffResolution, Scenario, sanitize_shared_context

if TYPE_CHECKING:
    from ..bus import HandoffBus

__all__ = ["RESOLUTION_KEY", "HandoffPolicy"]

#: metadata key of the scenario's resolution of a handoff (see ``HandoffResolution``)
RESOLUTION_KEY = "hb.handoff"


class HandoffPolicy:
    def __init__(
        self,
        scenario: Scenario | None = None,
        *,
        max_depth: int = 5,
        cycles: Literal["refuse", "allow"] = "refuse",
        max_visits: int = 2,
        context: ContextPolicy | None = None,
        input_filters: Sequence[InputFilter] = (),
        offload_over: int | None = None,
    ) -> None:
        numbers = [("max_depth", max_depth), ("max_visits", max_visits)]
        if offload_over is not None:
            numbers.append(("offload_over", offload_over))
        for name, value in numbers:
            if type(value) is not int or value < 1:
                raise InvalidRequest(f"HandoffPolicy.{name} must be an int of at least 1, not {value!r}")
        if cycles not in ("refuse", "allow"):
            raise InvalidRequest(f"HandoffPolicy.cycles must be 'refuse' or 'allow', not {cycles!r}")
        if scenario is not None and not isinstance(scenario, Scenario):
            raise InvalidRequest(f"HandoffPolicy.scenario must be a Scenario, not {type(scenario).__name__}")
        if context is not None and not isinstance(context, ContextPolicy):
            raise InvalidRequest(f"HandoffPolicy.context must be a ContextPolicy, not {type(context).__name__}")
        try:
            filters: list[Any] = [input_filters] if isinstance(input_filters, str | bytes) else list(input_filters)
        except TypeError:  # not a sequence
            filters = [input_filters]
        if not all(callable(f) for f in filters):
            raise InvalidRequest("HandoffPolicy.input_filters must be a sequence of callables")
        self.scenario = scenario
        self.max_depth = max_depth
        self.cycles = cycles
        self.max_visits = max_visits
        self.context = context
        self.input_filters: list[InputFilter] = filters
        self.offload_over = offload_over

    def check(self, request: HandoffRequest, handoff_id: str = "-") -> None:
        """Raise ``RouteRefused`` for a request this policy does not allow (steps 1 and 2)."""
        sender, target = request.from_agent, request.to_agent
        scenario = self.scenario
        cycles = self.cycles
        if scenario is not None and (scenario.governs(sender) or (target and scenario.governs(target))):
            if not target:
                raise RouteRefused(handoff_id, "ROUTE_NOT_IN_SCENARIO", f"scenario {scenario.name!r} routes "
                                   f"{sender!r}'s handoffs by agent, not by capabilities")
            if scenario.route(sender, target) is None:
                allowed = ", ".join(scenario.targets(sender)) or "none"
                raise RouteRefused(handoff_id, "ROUTE_NOT_IN_SCENARIO", f"scenario {scenario.name!r} has no "
                                   f"handoff {sender} -> {target} (allowed from {sender}: {allowed})")
            # a scenario's own route may go back to an agent (a specialist returns to the
            # concierge; its return greeting is for that), up to max_visits times
            cycles = "allow"
        check_hops(request, handoff_id, max_depth=self.max_depth, cycles=cycles, max_visits=self.max_visits)

    async def prepare(self, bus: HandoffBus, request: HandoffRequest, handoff_id: str = "-",
                      variables: Mapping[str, Any] | None = None) -> HandoffRequest:
        """The request as it is to be sent (steps 1 to 4); raises ``RouteRefused`` first."""
        self.check(request, handoff_id)
        metadata = dict(request.metadata)
        scenario = self.scenario
        resolution = None
        snapshot = request.context_snapshot
        on_route = scenario is not None and request.to_agent and scenario.route(request.from_agent, request.to_agent)
        context = None
        if snapshot is not None and (on_route or self.shapes_context):
            context = context_to_shape(snapshot, limit=bus.config.payload_limit,
                                       shaper=f"handoff {handoff_id}'s policy")
        if scenario is not None and on_route:
            visited = [*hops_of(metadata), request.from_agent]
            resolution = scenario.resolve(request.from_agent, request.to_agent, visited=visited, variables={
                "handoff_reason": request.reason, **(variables or {})}, greeting=_greeting_override(context))
        if resolution is not None:
            metadata[RESOLUTION_KEY] = msgspec.to_builtins(resolution)
        if context is not None:
            context = await self._shape(bus, request, context, resolution)
            snapshot = serialize_context(context)
        return msgspec.structs.replace(request, metadata=metadata, context_snapshot=snapshot)

    @property
    def shapes_context(self) -> bool:
        """Whether this policy changes contexts whatever the route (an opaque one is then refused;
        with none of these, only a scenario's resolution reads the context)."""
        return self.context is not None or bool(self.input_filters) or self.offload_over is not None

    async def _shape(self, bus: HandoffBus, request: HandoffRequest, context: HandoffContext,
                     resolution: HandoffResolution | None) -> HandoffContext:
        if resolution is not None and not resolution.share_context:
            last_user = [e for e in context.conversation_history if e.role == "user"][-1:]
            context = HandoffContext(conversation_history=last_user,
                                     metadata={"handoff_reason": request.reason})
        elif resolution is not None:  # a scenario's handoff: its control flags stay behind
            context = msgspec.structs.replace(
                context, metadata=sanitize_shared_context(context.metadata),
                tool_state=sanitize_shared_context(context.tool_state))
        context = await apply_context_policy(context, self.context, self.input_filters)
        if self.offload_over is not None:
            context = await offload(bus, request.from_agent, context, threshold=self.offload_over)
        return context


def _greeting_override(context: HandoffContext | None) -> str | None:
    """The session's explicit greeting, as the voice-agent service takes it: the context's
    ``session_overrides.greeting`` (sanitised out of what the target receives, with the other
    control flags)."""
    overrides = context.metadata.get("session_overrides") if context is not None else None
    greeting = overrides.get("greeting") if isinstance(overrides, dict) else None
    return greeting if isinstance(greeting, str) and greeting else None
