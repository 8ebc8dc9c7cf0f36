"""Scenarios: which agent may hand a conversation to which, and how (shared/seeds/004).

A scenario is a YAML file: its agents, the one a conversation starts with, and the allowed
handoffs as directed edges. Each edge is ``announced`` (the target greets the user) or
``discrete`` (it carries on seamlessly); it may share the conversation's context, carry a
``handoff_condition`` (turned into the source agent's handoff instructions) and
``context_vars`` (Jinja2 templates rendered when the handoff is made).

A bus given a scenario (``HandoffPolicy``) refuses a request along any other route before
anything is queued. Everything here is validated when the scenario is loaded: unknown
agents, self or duplicate edges and bad types are ``ScenarioError`` with the reason.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Literal

import msgspec

from ..errors import InvalidRequest
from ..names import check_name

__all__ = ["AgentProfile", "HandoffResolution", "Route", "Scenario", "ScenarioError", "sanitize_shared_context"]

log = logging.getLogger("handoffbus")

HandoffType = Literal["announced", "discrete"]
#: keys of a shared context that steer the handoff itself and must not reach the target's
#: conversation (besides any key starting with "_" or "hb."): the resolution's own fields, and
#: the flags a handoff tool's result carries (the voice-agent service's _HANDOFF_CONTROL_FLAGS)
CONTROL_KEYS = frozenset({
    "greet_on_switch", "handoff_type", "share_context", "target_agent", "source_agent", "is_return",
    "system_vars", "tool_name", "greeting", "return_greeting",
    "success", "handoff", "message", "handoff_summary", "should_interrupt_playback", "session_overrides",
})


class ScenarioError(InvalidRequest):
    """A scenario that cannot be used: malformed YAML, unknown agents, self or duplicate edges."""


class AgentProfile(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """An agent of a scenario, with what it says on arrival (announced handoffs only)."""

    name: str
    description: str = ""
    greeting: str | None = None
    return_greeting: str | None = None


class Route(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One allowed handoff: a directed edge of the scenario's agent graph."""

    from_agent: str
    to_agent: str
    #: None: the scenario's default ``handoff_type``
    type: HandoffType | None = None
    #: the conversation goes along (the scenario format's default); false: only the last user message
    share_context: bool = True
    handoff_condition: str = ""
    #: name -> Jinja2 template, rendered when the handoff is made
    context_vars: dict[str, str] = {}
    #: the tool that triggers this route, as the scenario format names it (kept, not used: the
    #: handoff tool is ``handoff_to_agent`` for every route)
    tool: str = ""


class ByHandoffType:
    """``is_announced`` and ``is_discrete`` of a struct with a ``handoff_type`` field."""

    __slots__ = ()
    handoff_type: HandoffType

    @property
    def is_announced(self) -> bool:
        return self.handoff_type == "announced"

    @property
    def is_discrete(self) -> bool:
        return self.handoff_type == "discrete"


class HandoffResolution(msgspec.Struct, ByHandoffType, frozen=True, kw_only=True):
    """What a scenario says of one handoff about to be made."""

    source_agent: str
    target_agent: str
    handoff_type: HandoffType
    share_context: bool
    is_return: bool
    #: what the target says on arrival (None: it carries on without a greeting)
    greeting: str | None
    context_vars: dict[str, Any] = {}


class Scenario(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    name: str
    #: where a conversation starts (optional, as in the scenario format)
    start_agent: str = ""
    #: the scenario's agents; empty (the format's "all"): every agent its handoffs name
    agents: list[str | AgentProfile] = []
    description: str = ""
    handoff_type: HandoffType = "announced"
    handoffs: list[Route] = []
    agent_defaults: dict[str, Any] = {}
    #: global template variables, for every edge's ``context_vars``
    template_vars: dict[str, Any] = {}

    def __post_init__(self) -> None:
        names = [a if isinstance(a, str) else a.name for a in self.agents]
        try:
            for name in [*(names or self.agent_names), *([self.start_agent] if self.start_agent else [])]:
                check_name(name, "agent id")
        except InvalidRequest as exc:
            raise ScenarioError(f"scenario {self.name!r}: {exc}") from None
        if len(set(names)) != len(names):
            raise ScenarioError(f"scenario {self.name!r}: an agent is listed twice")
        known = set(self.agent_names)
        if self.start_agent and self.start_agent not in known:
            raise ScenarioError(f"scenario {self.name!r}: start_agent {self.start_agent!r} is not one of its agents")
        seen: set[tuple[str, str]] = set()
        for route in self.handoffs:
            for end in (route.from_agent, route.to_agent):
                if end not in known:
                    raise ScenarioError(f"scenario {self.name!r}: handoff {route.from_agent} -> {route.to_agent} "
                                        f"names {end!r}, which is not one of its agents")
            if route.from_agent == route.to_agent:
                raise ScenarioError(f"scenario {self.name!r}: a handoff from {route.from_agent!r} to itself")
            if (route.from_agent, route.to_agent) in seen:
                raise ScenarioError(f"scenario {self.name!r}: handoff {route.from_agent} -> {route.to_agent} "
                                    "is listed twice")
            seen.add((route.from_agent, route.to_agent))

    # ------------------------------------------------------------------ loading

    @classmethod
    def from_yaml(cls, text: str | bytes) -> Scenario:
        try:
            return msgspec.yaml.decode(text, type=cls)
        except ImportError as exc:
            raise ScenarioError("reading scenarios needs pyyaml: pip install 'handoffbus[scenarios]'") from exc
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            raise ScenarioError(f"invalid scenario: {exc}") from None

    @classmethod
    def load(cls, path: str | Path) -> Scenario:
        try:
            text = Path(path).read_bytes()
        except OSError as exc:
            raise ScenarioError(f"cannot read scenario {str(path)!r}: {exc}") from None
        return cls.from_yaml(text)

    # ------------------------------------------------------------------ the graph

    @property
    def agent_names(self) -> list[str]:
        """The listed agents; with none listed, the start agent and every agent a handoff names."""
        if self.agents:
            return [a if isinstance(a, str) else a.name for a in self.agents]
        named = [self.start_agent] if self.start_agent else []
        for route in self.handoffs:
            named += [route.from_agent, route.to_agent]
        return list(dict.fromkeys(named))

    def profile(self, agent: str) -> AgentProfile:
        for entry in self.agents:
            if isinstance(entry, AgentProfile) and entry.name == agent:
                return entry
        return AgentProfile(name=agent)

    def route(self, from_agent: str, to_agent: str) -> Route | None:
        return next((r for r in self.handoffs if r.from_agent == from_agent and r.to_agent == to_agent), None)

    def targets(self, from_agent: str) -> list[str]:
        """The agents ``from_agent`` may hand off to, in the scenario's order."""
        return [r.to_agent for r in self.handoffs if r.from_agent == from_agent]

    def governs(self, agent: str) -> bool:
        return agent in self.agent_names

    def instructions(self, agent: str, tool_name: str = "handoff_to_agent") -> str:
        """The handoff instructions for ``agent``'s system prompt, from its routes' conditions."""
        lines = []
        for route in self.handoffs:
            if route.from_agent == agent and route.handoff_condition:
                lines.append(f'When the following condition is met: "{route.handoff_condition}"\n'
                             f'→ Call {tool_name}(target_agent="{route.to_agent}", reason="...")')
        return "\n\n".join(lines)

    def select_greeting(self, target: str, *, is_return: bool, handoff_type: HandoffType,
                        override: str | None = None) -> str | None:
        """An explicit override wins; a discrete handoff has none; an announced one greets with
        the return greeting when the conversation has been with ``target`` before (if it has
        one), else with its greeting."""
        if override is not None:
            return override
        if handoff_type == "discrete":
            return None
        profile = self.profile(target)
        if is_return and profile.return_greeting:
            return profile.return_greeting
        return profile.greeting

    def resolve(self, from_agent: str, to_agent: str, *, visited: Iterable[str] = (),
                variables: Mapping[str, Any] | None = None, greeting: str | None = None) -> HandoffResolution | None:
        """The handoff along ``from_agent -> to_agent``, or None if the scenario has no such route.
        ``visited``: the agents the conversation has been with (a return when ``to_agent`` is one);
        ``variables``: what the route's ``context_vars`` templates may use."""
        route = self.route(from_agent, to_agent)
        if route is None:
            return None
        handoff_type: HandoffType = route.type or self.handoff_type
        is_return = to_agent in set(visited)
        return HandoffResolution(
            source_agent=from_agent, target_agent=to_agent, handoff_type=handoff_type,
            share_context=route.share_context, is_return=is_return,
            greeting=self.select_greeting(to_agent, is_return=is_return, handoff_type=handoff_type, override=greeting),
            context_vars=render_context_vars(
                route.context_vars, {**self.agent_defaults, **self.template_vars, **(variables or {})}),
        )


# ---------------------------------------------------------------------- templates and context


def render_context_vars(templates: Mapping[str, str], variables: Mapping[str, Any]) -> dict[str, Any]:
    """Each template rendered in Jinja2's immutable sandbox (no attribute of an object's
    internals, no mutation of the variables). A template that fails keeps its raw text, and
    the failure is logged."""
    if not templates:
        return {}
    try:
        from jinja2 import TemplateError
    except ImportError as exc:
        raise ScenarioError("context_vars need jinja2: pip install 'handoffbus[scenarios]'") from exc
    env = _sandbox()
    rendered: dict[str, Any] = {}
    for name, template in templates.items():
        try:
            rendered[name] = env.from_string(template).render(**variables)
        except (TemplateError, TypeError, ValueError, ArithmeticError, LookupError) as exc:
            log.warning("context var %r kept as written: its template failed (%s: %s)", name,
                        type(exc).__name__, exc)
            rendered[name] = template
    return rendered


@functools.cache
def _sandbox() -> Any:
    """One sandboxed environment, built at the first render (its template cache is kept)."""
    from jinja2 import StrictUndefined
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    return ImmutableSandboxedEnvironment(undefined=StrictUndefined, autoescape=False)


def sanitize_shared_context(shared: Mapping[str, Any]) -> dict[str, Any]:
    """A shared context without the keys that steer the handoff itself (``CONTROL_KEYS``, and
    any key starting with ``_`` or ``hb.``). Top level only, and that of a ``handoff_context``
    it holds (a handoff tool's result, which the voice-agent service sanitises): the flags sit
    beside the data, and the same names inside it (a call's ``tool_name``, a record's ``_id``)
    are the data."""
    out = _without_flags(shared)
    inner = out.get("handoff_context")
    if isinstance(inner, Mapping):
        out["handoff_context"] = _without_flags(inner)
    return out


def _without_flags(shared: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in shared.items()
            if not (isinstance(k, str) and (k in CONTROL_KEYS or k.startswith(("_", "hb."))))}
