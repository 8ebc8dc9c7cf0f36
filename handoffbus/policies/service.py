"""The voice-agent accelerator's ``HandoffService``, over a Scenario.

For an orchestrator that switches agents itself, within one session (a voice loop that
intercepts the ``handoff_to_agent`` tool): the same answers the bus's ``HandoffPolicy``
gives the handoffs it carries. ``resolve_handoff`` says whether the route exists and, if so,
what the target needs: its ``system_vars`` (the route's rendered ``context_vars``, the
reason, the user's last words, the session profile and the sanitised handoff context),
whether it greets, and whether the conversation goes along.

    service = HandoffService(scenario, session_id="s-1")
    resolution = service.resolve_handoff("Concierge", "FraudAgent", "card stolen",
                                         user_last_utterance="someone used my card")
    if not resolution.success: ...          # no such route in the scenario
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import msgspec

from .scenario import ByHandoffType, HandoffType, Scenario, sanitize_shared_context
from .tools import HANDOFF_TOOL

__all__ = ["HandoffService", "ServiceResolution"]


class ServiceResolution(msgspec.Struct, ByHandoffType, frozen=True, kw_only=True):
    """What ``HandoffService.resolve_handoff`` says of one handoff (the accelerator's
    ``HandoffResolution``); ``success`` is False for a route the scenario does not have."""

    success: bool
    target_agent: str | None = None
    source_agent: str | None = None
    tool_name: str | None = None
    #: what the target agent's prompt is rendered with
    system_vars: dict[str, Any] = {}
    greet_on_switch: bool = True
    share_context: bool = True
    handoff_type: HandoffType = "announced"
    #: what the target says on arrival (``select_greeting`` for this handoff; None: nothing)
    greeting: str | None = None


class HandoffService:
    """Resolves one session's handoffs against ``scenario``."""

    def __init__(self, scenario: Scenario, session_id: str = "", *, tool_name: str = HANDOFF_TOOL) -> None:
        self.scenario = scenario
        self.session_id = session_id
        self.tool_name = tool_name

    def is_handoff(self, tool_name: str) -> bool:
        """Whether a tool call is the handoff tool (every other is a business tool)."""
        return tool_name == self.tool_name

    def get_handoff_target(self, source_agent: str, target_agent: str) -> str | None:
        """``target_agent`` if the scenario has the route, else None."""
        return target_agent if self.scenario.route(source_agent, target_agent) is not None else None

    def select_greeting(self, target_agent: str, is_return: bool = False, handoff_type: HandoffType = "announced",
                        *, override: str | None = None, with_context: bool = False) -> str | None:
        """An explicit override wins; a handoff that brings its context (``with_context``) has
        no automatic greeting, the agent picks the conversation up; else the scenario's rule
        (discrete: none; announced: the return greeting on a return visit, else the greeting)."""
        if override is not None:
            return override
        if with_context:
            return None
        return self.scenario.select_greeting(target_agent, is_return=is_return, handoff_type=handoff_type)

    def resolve_handoff(
        self, source_agent: str, target_agent: str, handoff_reason: str = "", *,
        user_last_utterance: str | None = None, session_profile: Mapping[str, Any] | None = None,
        handoff_context: Mapping[str, Any] | None = None, visited: Iterable[str] = (), **variables: Any,
    ) -> ServiceResolution:
        """The handoff along ``source_agent -> target_agent``. ``visited``: the agents the
        session has been with (a return visit when ``target_agent`` is one); ``variables``:
        more for the route's ``context_vars`` templates."""
        route = self.scenario.route(source_agent, target_agent)
        if route is None:
            return ServiceResolution(success=False, source_agent=source_agent, target_agent=target_agent,
                                     tool_name=self.tool_name)
        shared = sanitize_shared_context(handoff_context or {})
        system_vars: dict[str, Any] = {
            "handoff_reason": handoff_reason, "user_last_utterance": user_last_utterance,
            "session_profile": dict(session_profile or {}), "handoff_context": shared,
            "session_id": self.session_id, "previous_agent": source_agent, "active_agent": target_agent,
        }
        resolution = self.scenario.resolve(source_agent, target_agent, visited=visited,
                                           variables={**variables, **system_vars})
        assert resolution is not None  # the route exists
        return ServiceResolution(
            success=True, target_agent=target_agent, source_agent=source_agent, tool_name=self.tool_name,
            system_vars={**system_vars, **resolution.context_vars}, greet_on_switch=resolution.is_announced,
            share_context=resolution.share_context, handoff_type=resolution.handoff_type,
            greeting=resolution.greeting,
        )
