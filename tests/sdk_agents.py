"""OpenAI Agents SDK agents for the bridge tests, run offline on the SDK's scripted model."""

from __future__ import annotations

from typing import Any

from agents import Agent
from agents.testing import ModelStep, ScriptedModel, assistant_message


def _describe(call: Any) -> list[Any]:
    """Answer with what the model was given: how many messages, and the first user one."""
    items = call.input if isinstance(call.input, list) else [{"role": "user", "content": call.input}]
    users = [i for i in items if isinstance(i, dict) and i.get("role") == "user"]
    kinds = sorted({i.get("type", "message") for i in items if isinstance(i, dict)})
    first = users[0]["content"] if users else ""
    return [assistant_message(f"billing saw {len(items)} items {kinds}; the customer said: {first}")]


#: served by ``handoffbus worker --openai-agent tests.sdk_agents:billing=billing-1``
billing = Agent(name="Billing Agent", instructions="You resolve billing problems.",
                model=ScriptedModel([ModelStep.respond(_describe) for _ in range(20)]))
