"""OpenAI Agents SDK bridge (the optional extra ``agents``: ``pip install 'handoffbus[agents]'``).

**A remote agent as an SDK handoff.** ``remote_agent(bus, "triage-1", "billing-1")``
returns an SDK ``Agent`` to put in another agent's ``handoffs``. Its model is a
``RemoteAgentModel``: when the SDK hands the conversation over and calls the model, the
whole conversation the SDK passes (the history, the handoff call and its output,
``input_filter`` applied) crosses the bus as a ``HandoffContext``. The remote agent's worker
answers, and its final output becomes this agent's reply.

Why a proxy agent rather than a handoff straight to the bus: an SDK handoff must resolve to
a local ``Agent`` object, and the run goes on with that agent. A proxy agent whose model
is remote keeps everything the SDK gives a handoff: the ``transfer_to_<agent>`` tool,
``input_filter``, ``on_handoff``, ``is_enabled``, tracing of the run, and the last agent in
the result. The alternative, an agent-as-tool, would not carry the conversation history.

**An SDK agent as a handoffbus worker.** ``SdkAgent(agent)`` serves an SDK ``Agent``:
each handoff's context becomes the run's input, and the run's final output is the
COMPLETED result (``{"output": ..., "agent": <last agent>, "usage": {requests, input_tokens,
output_tokens, total_tokens}}``); a remote agent's model reports that usage to the run that
handed to it, so its tokens count where the handoff was made. From the command line:
``handoffbus worker --openai-agent module:attribute``, where the attribute is an SDK
``Agent``; add ``=agent-id`` to name it on the bus.
"""

from __future__ import annotations

import contextvars
import hashlib
import json
import re
from typing import TYPE_CHECKING, Any

from ..context import ConversationEntry, HandoffContext, serialize_context
from ..errors import HandoffbusError
from ..models import HandoffRequest, HandoffStatus
from ..names import check_name
from ..workers.agent import Agent, ReceivedHandoff

if TYPE_CHECKING:
    from ..bus import HandoffBus

__all__ = ["RemoteAgentModel", "SdkAgent", "context_to_items", "items_to_context", "remote_agent"]

#: context metadata holding the SDK's own input items, for a lossless trip when both sides speak SDK
ITEMS_KEY = "openai_agents.items"
#: context metadata holding a digest of the conversation history the items were carried with:
#: the items are used only while the history still has that digest, so that whatever changed
#: the history on the way (a context policy, an input filter) changes what the SDK runs too
ITEMS_DIGEST_KEY = "openai_agents.items_history"
#: the roles of SDK input messages; an entry of another role becomes a user message naming it
_SDK_ROLES = ("user", "assistant", "system", "developer")


def history_digest(history: list[ConversationEntry]) -> str:
    """A digest of a conversation history's content (its entries as sw4rm serializes them)."""
    data = json.dumps([e.to_dict() for e in history], separators=(",", ":"), sort_keys=True,
                      ensure_ascii=True, default=repr)
    return hashlib.sha256(data.encode()).hexdigest()


def _sdk() -> Any:
    try:
        import agents
    except ImportError as exc:
        raise HandoffbusError("the Agents SDK bridge needs openai-agents: pip install 'handoffbus[agents]'") from exc
    return agents


def _plain(item: Any) -> dict[str, Any]:
    if hasattr(item, "model_dump"):
        dumped: dict[str, Any] = item.model_dump(exclude_unset=True)
        return dumped
    return dict(item)


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(part.get("text", "")) for part in map(_plain, content))
    return "" if content is None else str(content)


def items_to_context(items: str | list[Any], *, reason: str = "") -> HandoffContext:
    """The SDK's input (a string, or response input items) as a handoff context: messages
    become conversation entries, function calls assistant entries with ``tool_calls``, their
    outputs ``tool`` entries. The items themselves ride along in the metadata, with a digest
    of the history they came with (see ``context_to_items``)."""
    if isinstance(items, str):
        return HandoffContext(conversation_history=[ConversationEntry(role="user", content=items)],
                              metadata={"handoff_reason": reason} if reason else {})
    plain = [_plain(i) for i in items]
    history: list[ConversationEntry] = []
    for item in plain:
        kind = item.get("type", "message")
        if kind == "message" and item.get("role") in ("user", "assistant", "system", "developer"):
            role = "system" if item["role"] == "developer" else item["role"]
            history.append(ConversationEntry(role=role, content=_text(item.get("content"))))
        elif kind == "function_call":
            history.append(ConversationEntry.from_dict({"role": "assistant", "content": "", "tool_calls": [
                {"id": item.get("call_id"), "type": "function",
                 "function": {"name": item.get("name"), "arguments": item.get("arguments", "")}}]}))
        elif kind == "function_call_output":
            history.append(ConversationEntry(role="tool", content=_text(item.get("output")),
                                             tool_call_id=item.get("call_id")))
    metadata: dict[str, Any] = {"handoff_reason": reason} if reason else {}
    try:
        json.dumps(plain)
        metadata[ITEMS_KEY] = plain
        metadata[ITEMS_DIGEST_KEY] = history_digest(history)
    except (TypeError, ValueError):
        pass  # not plain JSON: the entries carry the conversation
    return HandoffContext(conversation_history=history, metadata=metadata)


def context_to_items(context: HandoffContext | None, reason: str = "") -> list[dict[str, Any]]:
    """A handoff context as SDK input items.

    The SDK's own items, when they came along and the history is still the one they came
    with. When something on the way changed the history (the bus's context policy, an input
    filter), or they came without its digest, the items are built from the history as it
    arrived: what the policy left out stays out."""
    if context is None:
        return [{"role": "user", "content": reason or "(handed over without context)"}]
    carried = context.metadata.get(ITEMS_KEY)
    if (isinstance(carried, list) and all(isinstance(i, dict) for i in carried)
            and context.metadata.get(ITEMS_DIGEST_KEY) == history_digest(context.conversation_history)):
        return list(carried)
    items: list[dict[str, Any]] = []
    for entry in context.conversation_history:
        calls = entry.extra.get("tool_calls")
        if entry.role == "tool":
            items.append({"type": "function_call_output", "call_id": entry.tool_call_id, "output": entry.content})
            continue
        if entry.role in _SDK_ROLES:
            if entry.content or not (entry.role == "assistant" and calls):
                items.append({"role": entry.role, "content": entry.content})
        else:  # a role the SDK has no word for: what was said, and by whom
            speaker = entry.role + (f" {entry.name}" if entry.name else "")
            items.append({"role": "user", "content": f"[{speaker}] {entry.content}"})
        if entry.role == "assistant" and isinstance(calls, list):
            for call in calls:
                if not isinstance(call, dict):
                    continue
                function = call.get("function")
                function = function if isinstance(function, dict) else {}
                items.append({"type": "function_call", "call_id": call.get("id"), "name": function.get("name"),
                              "arguments": function.get("arguments", "")})
    return items or [{"role": "user", "content": reason or "(handed over without context)"}]


def _agent_id(name: str) -> str:
    return check_name(re.sub(r"[^A-Za-z0-9_.:-]+", "-", name).strip("-") or "agent", "agent id")


def _model_base() -> type:
    return _sdk().models.interface.Model  # type: ignore[no-any-return]


#: the handoff an SdkAgent's run serves (each handler runs in a context of its own: see lanes.py)
_serving: contextvars.ContextVar[ReceivedHandoff | None] = contextvars.ContextVar("handoffbus_sdk_serving",
                                                                                  default=None)


class RemoteAgentModel:
    """An SDK ``Model`` that answers by handing the conversation to an agent on the bus."""

    def __init__(self, bus: HandoffBus, from_agent: str, to_agent: str, *, timeout: float | None = None,
                 priority: int = 0, reason: str = "handed over by the Agents SDK") -> None:
        self.bus, self.from_agent, self.to_agent = bus, from_agent, to_agent
        self.timeout, self.priority, self.reason = timeout, priority, reason

    async def get_response(self, system_instructions: str | None, input: str | list[Any], *args: Any,
                           **kwargs: Any) -> Any:
        sdk = _sdk()
        from agents.items import ModelResponse
        from agents.usage import Usage
        from openai.types.responses import ResponseOutputMessage, ResponseOutputText

        context = items_to_context(input, reason=self.reason)
        serving = _serving.get()
        if serving is not None and serving.client is not None and serving.client.agent_id == self.from_agent:
            # handed on from the handoff this agent serves: the hop chain goes along, so the
            # loop guards see the whole chain (two SDK agents could hand a conversation back
            # and forth for ever otherwise)
            request = serving.onward(self.to_agent, self.reason, context, priority=self.priority,
                                     timeout=self.timeout)
        else:
            request = HandoffRequest(from_agent=self.from_agent, to_agent=self.to_agent, reason=self.reason,
                                     context_snapshot=serialize_context(context), priority=self.priority,
                                     timeout=self.timeout)
        handle = await self.bus.client(self.from_agent).request_handoff(request)
        outcome = await handle.outcome()
        if outcome.status is not HandoffStatus.COMPLETED:
            detail = outcome.error or outcome.rejection_reason or outcome.status.value
            raise sdk.exceptions.AgentsException(f"remote agent {self.to_agent!r} ended {outcome.status.value}: "
                                                 f"{detail}")
        result = outcome.result
        text = _output_text(result.get("output", "")) if isinstance(result, dict) else str(result)
        message = ResponseOutputMessage(id=f"hb-{handle.handoff_id}", type="message", role="assistant",
                                        status="completed", content=[ResponseOutputText(
                                            text=text, type="output_text", annotations=[], logprobs=[])])
        usage = Usage()
        for name, value in _usage_counts(result.get("usage") if isinstance(result, dict) else None).items():
            setattr(usage, name, value)  # the remote run's cost, counted in this run's usage
        return ModelResponse(output=[message], usage=usage, response_id=None)

    def stream_response(self, *args: Any, **kwargs: Any) -> Any:
        raise HandoffbusError("a remote agent answers whole: run it with Runner.run, not run_streamed")


def remote_agent(bus: HandoffBus, from_agent: str, to_agent: str, *, name: str | None = None,
                 handoff_description: str = "", **model_options: Any) -> Any:
    """An SDK ``Agent`` standing for ``to_agent`` on the bus, to be handed off to (see above)."""
    sdk = _sdk()
    model_class = type("RemoteAgentModel", (RemoteAgentModel, _model_base()), {})
    return sdk.Agent(name=name or to_agent, handoff_description=handoff_description or f"the {to_agent} agent",
                     model=model_class(bus, from_agent, to_agent, **model_options))


def _plain_output(output: Any) -> Any:
    """A run's final output as a COMPLETED result carries it: a plain value as it is, a
    structured one (an ``output_type``'s pydantic model or dataclass, a list or dict of them) as
    the JSON data it stands for, and only what has none as its text."""
    if output is None or isinstance(output, str | int | float | bool | bytes):
        return output
    from pydantic_core import to_jsonable_python  # the SDK's own dependency

    try:
        return to_jsonable_python(output)
    except Exception:  # nothing JSON can hold (PydanticSerializationError)
        return str(output)


def _output_text(output: Any) -> str:
    """A remote agent's output as this run's reply text: structured data as JSON."""
    if isinstance(output, dict | list):
        try:
            return json.dumps(output, ensure_ascii=False)
        except (TypeError, ValueError):
            pass
    return str(output)


#: the token counts an SdkAgent's result reports, for the run that handed to it (its cost)
USAGE_FIELDS = ("requests", "input_tokens", "output_tokens", "total_tokens")


def _usage_counts(spent: Any) -> dict[str, int]:
    """The remote run's token counts, as its result reported them (none from another agent)."""
    if not isinstance(spent, dict):
        return {}
    return {name: value for name in USAGE_FIELDS
            if type(value := spent.get(name)) is int and value >= 0}


class SdkAgent(Agent):
    """A handoffbus agent whose work is an SDK agent's run."""

    def __init__(self, sdk_agent: Any, agent_id: str | None = None, capabilities: list[str] | None = None) -> None:
        super().__init__()
        self.sdk_agent = sdk_agent
        self.agent_id = agent_id or _agent_id(sdk_agent.name)  # type: ignore[misc]
        self.capabilities = list(capabilities or [])  # type: ignore[misc]

    async def on_handoff_received(self, handoff: ReceivedHandoff) -> Any:
        sdk = _sdk()
        serving = _serving.set(handoff)  # what a remote agent the run hands to is handed on from
        try:
            result = await sdk.Runner.run(self.sdk_agent, context_to_items(handoff.context, handoff.request.reason))
        finally:
            _serving.reset(serving)
        output = result.final_output
        usage = result.context_wrapper.usage
        return {"output": _plain_output(output),
                "agent": result.last_agent.name,
                "usage": {name: getattr(usage, name) for name in USAGE_FIELDS}}
