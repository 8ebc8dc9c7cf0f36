"""The handoff tools a model calls, as strict JSON schemas in OpenAI's function-calling format.

- ``handoff_tool``: one ``handoff_to_agent(target_agent, reason)`` tool per agent, whose
  ``target_agent`` enum is exactly the agents the scenario lets that agent hand off to.
- ``transfer_tools``: one ``transfer_to_<agent>`` tool per target, in the Agents SDK's
  naming style; each target may be switched on and off with ``is_enabled`` (a bool, or a
  callable, plain or async, given the run context). Two targets whose agents make the same
  tool name (``billing-1`` and ``Billing.1``) raise ``InvalidRequest``: a call of that name
  could not say which one it means.
- ``request_from_tool_call``: a model's tool call turned into a ``HandoffRequest``. An
  unknown tool, unknown target or bad arguments raise ``ToolCallError``, whose message is
  written for the model to read and correct itself.
"""

from __future__ import annotations

import inspect
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

from ..errors import HandoffbusError, InvalidRequest
from ..models import HandoffRequest
from ..names import check_name
from .context import InvalidHook
from .scenario import Scenario

__all__ = ["HANDOFF_TOOL", "ToolCallError", "TransferTarget", "handoff_tool", "request_from_tool_call",
           "transfer_tool_name", "transfer_tools"]

HANDOFF_TOOL = "handoff_to_agent"

class ToolCallError(HandoffbusError):
    """A model's handoff tool call that cannot be made; the message tells the model why and
    what it may call instead."""


class TransferTarget(msgspec.Struct, frozen=True, kw_only=True):
    """An agent a ``transfer_to_<agent>`` tool hands off to."""

    agent: str
    description: str = ""
    is_enabled: Any = True  # a bool, or a callable (sync or async) of the run context

    def __post_init__(self) -> None:
        check_name(self.agent, "TransferTarget.agent")  # the id a tool call hands off to, as it is
        if not isinstance(self.description, str):
            raise InvalidRequest(f"TransferTarget.description must be a str, not {type(self.description).__name__}")
        if not (isinstance(self.is_enabled, bool) or callable(self.is_enabled)):
            raise InvalidHook(f"TransferTarget.is_enabled must be a bool or a callable, not "
                              f"{type(self.is_enabled).__name__}")


def transfer_tool_name(agent: str) -> str:
    """``transfer_to_<agent>`` as the Agents SDK names it: lower case, anything but letters,
    digits and ``_`` turned into ``_``."""
    return "transfer_to_" + re.sub(r"[^a-z0-9_]", "_", agent.lower())


def _function(name: str, description: str, properties: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "function": {
        "name": name, "description": description, "strict": True,
        "parameters": {"type": "object", "properties": properties, "required": list(properties),
                       "additionalProperties": False},
    }}


def handoff_tool(scenario: Scenario, agent: str) -> dict[str, Any] | None:
    """The unified handoff tool for ``agent``, or None when the scenario gives it no route."""
    targets = scenario.targets(agent)
    if not targets:
        return None
    conditions = [f"- {r.to_agent}: {r.handoff_condition}" for r in scenario.handoffs
                  if r.from_agent == agent and r.handoff_condition]
    description = "Transfer the conversation to another agent." + (
        "\nWhen to hand off to whom:\n" + "\n".join(conditions) if conditions else "")
    return _function(HANDOFF_TOOL, description, {
        "target_agent": {"type": "string", "enum": targets, "description": "the agent to transfer to"},
        "reason": {"type": "string", "description": "why the handoff is needed (passed on as context)"},
    })


def _by_tool_name(targets: Sequence[TransferTarget]) -> dict[str, TransferTarget]:
    """The targets by tool name; raises ``InvalidRequest`` when two of them make one name."""
    by_name: dict[str, TransferTarget] = {}
    for target in targets:
        if not isinstance(target, TransferTarget):
            raise InvalidRequest(f"transfer targets must be TransferTarget, not {type(target).__name__}")
        name = transfer_tool_name(target.agent)
        seen = by_name.get(name)
        if seen is not None:
            twice = "is listed twice" if seen.agent == target.agent else f"and {seen.agent!r} both make it"
            raise InvalidRequest(f"two transfer targets make the tool {name!r}: {target.agent!r} {twice}; "
                                 "a call of it could not say which is meant")
        by_name[name] = target
    return by_name


async def transfer_tools(targets: Sequence[TransferTarget], run_context: Any = None) -> list[dict[str, Any]]:
    """A ``transfer_to_<agent>`` tool for every target enabled now (``InvalidRequest`` when two
    targets make one tool name)."""
    tools = []
    for target in _by_tool_name(targets).values():
        if await _enabled(target.is_enabled, run_context):
            tools.append(_function(transfer_tool_name(target.agent),
                                   target.description or f"Handoff to the {target.agent} agent to handle the request.",
                                   {"reason": {"type": "string", "description": "why the handoff is needed"}}))
    return tools


async def _enabled(flag: Any, run_context: Any) -> bool:
    """A target's ``is_enabled`` now: a bool, or what its callable (checked when made) says."""
    if isinstance(flag, bool):
        return flag
    value = flag(run_context)
    if inspect.isawaitable(value):
        value = await value
    return bool(value)


async def _callable_tools(from_agent: str, scenario: Scenario | None, targets: Sequence[TransferTarget],
                          run_context: Any) -> list[str]:
    """The handoff tools the model may call now: ``handoff_to_agent`` where the scenario lets
    this agent hand off, and the transfer tools of the targets enabled now."""
    found = [HANDOFF_TOOL] if scenario is not None and scenario.targets(from_agent) else []
    for tool_name, target in _by_tool_name(targets).items():
        if await _enabled(target.is_enabled, run_context):
            found.append(tool_name)
    return found


_SEND_AN_OBJECT = 'send an object like {"target_agent": "...", "reason": "..."}'


def _arguments(name: str, arguments: object) -> Any:
    """A tool call's arguments decoded, or a ``ToolCallError`` the model can act on."""
    if isinstance(arguments, Mapping):
        return dict(arguments)
    if isinstance(arguments, bytes | bytearray):
        try:
            arguments = arguments.decode()
        except UnicodeDecodeError:
            raise ToolCallError(f"the arguments of {name} are not UTF-8 text; {_SEND_AN_OBJECT}") from None
    if not isinstance(arguments, str):
        raise ToolCallError(f"the arguments of {name} are missing or not JSON text "
                            f"({type(arguments).__name__}); {_SEND_AN_OBJECT}")
    try:
        return json.loads(arguments)
    except json.JSONDecodeError as exc:
        raise ToolCallError(f"the arguments of {name} are not valid JSON ({exc.msg}); {_SEND_AN_OBJECT}") from None
    except RecursionError:  # a truncated or runaway nesting of arrays or objects
        raise ToolCallError(f"the arguments of {name} are nested too deeply; {_SEND_AN_OBJECT}") from None
    except ValueError:  # JSON that parses but is refused: an int of more than 4300 digits
        raise ToolCallError(f"the arguments of {name} hold a number too long to read; {_SEND_AN_OBJECT}") from None


async def request_from_tool_call(
    name: str, arguments: str | bytes | bytearray | Mapping[str, Any], *, from_agent: str,
    scenario: Scenario | None = None, targets: Sequence[TransferTarget] = (), run_context: Any = None,
    **request: Any,
) -> HandoffRequest:
    """The ``HandoffRequest`` a model's call of ``handoff_to_agent`` or ``transfer_to_<agent>``
    asks for (``arguments``: a JSON object as text, UTF-8 bytes or a mapping; ``request`` adds
    fields such as ``context_snapshot`` or ``priority``)."""
    args = _arguments(name, arguments)
    if not isinstance(args, dict):
        raise ToolCallError(f"the arguments of {name} must be a JSON object")
    reason = args.get("reason", "")
    if not isinstance(reason, str):
        raise ToolCallError("reason must be a string")
    try:
        reason.encode()
    except UnicodeEncodeError:  # a JSON escape of half an emoji: the request could not be sent
        raise ToolCallError("reason must be text without lone surrogates (an emoji cut in half?)") from None
    if name == HANDOFF_TOOL:
        if scenario is None:
            callable_now = await _callable_tools(from_agent, scenario, targets, run_context)
            raise ToolCallError(f"{HANDOFF_TOOL} is not available here; the handoff tools are: "
                                f"{', '.join(callable_now) or 'none'}")
        allowed = scenario.targets(from_agent)
        target = args.get("target_agent")
        if target not in allowed:
            raise ToolCallError(f"cannot hand off to {target!r}: from {from_agent} you may hand off to "
                                f"{', '.join(allowed) or 'no agent'}. Call {HANDOFF_TOOL} again with one of them.")
    else:
        by_name = _by_tool_name(targets)
        chosen = by_name.get(name)
        if chosen is None:
            callable_now = await _callable_tools(from_agent, scenario, targets, run_context)
            raise ToolCallError(f"there is no tool {name!r}; the handoff tools are: "
                                f"{', '.join(callable_now) or 'none'}")
        if not await _enabled(chosen.is_enabled, run_context):
            raise ToolCallError(f"{name} is not available right now")
        target = chosen.agent
    if "reason" not in args:  # required by the tool's schema; a model outside strict mode may leave it out
        example = '{"target_agent": "...", "reason": "..."}' if name == HANDOFF_TOOL else '{"reason": "..."}'
        raise ToolCallError(f"{name} needs a reason: call it again with {example}")
    return HandoffRequest(from_agent=from_agent, to_agent=str(target), reason=reason, **request)
