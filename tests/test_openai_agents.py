"""The OpenAI Agents SDK bridge, offline on the SDK's scripted model, across two real
processes: an SDK agent in this process hands the conversation to a remote agent, which is
an SDK agent served by ``handoffbus worker --openai-agent`` in another process."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractAsyncContextManager
from typing import Any

import anyio
import pytest
from agents import Agent, Runner, handoff
from agents.extensions import handoff_filters
from agents.testing import ScriptedModel, function_call

from handoffbus import (
    ConversationEntry,
    HandoffBus,
    HandoffContext,
    HandoffStatus,
    deserialize_context,
    serialize_context,
)
from handoffbus.integrations.openai_agents import ITEMS_KEY, context_to_items, items_to_context, remote_agent
from handoffbus.policies import ContextPolicy, HandoffPolicy, remove_all_tools

from .conftest import make_bus
from .helpers import handoffbus_process, req, serving

pytestmark = pytest.mark.anyio


@pytest.fixture(autouse=True)
def no_sdk_tracing(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Offline: the SDK exports no traces (it would try OpenAI's endpoint)."""
    monkeypatch.setenv("OPENAI_AGENTS_DISABLE_TRACING", "1")
    from agents import set_tracing_disabled

    set_tracing_disabled(True)
    yield
    set_tracing_disabled(False)


def test_items_and_contexts_convert_both_ways() -> None:
    items = [
        {"role": "user", "content": "I was charged twice"},
        {"type": "function_call", "call_id": "call-1", "name": "lookup", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call-1", "output": "two charges of 20 EUR"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me check."}]},
    ]
    context = items_to_context(items, reason="billing")
    assert [(e.role, e.content) for e in context.conversation_history] == [
        ("user", "I was charged twice"), ("assistant", ""), ("tool", "two charges of 20 EUR"),
        ("assistant", "Let me check.")]
    assert context.conversation_history[1].extra["tool_calls"][0]["function"]["name"] == "lookup"
    assert context_to_items(context) == items  # the SDK's own items came along
    rebuilt = context_to_items(HandoffContext(conversation_history=context.conversation_history))
    assert rebuilt[0] == {"role": "user", "content": "I was charged twice"}
    assert rebuilt[1]["type"] == "function_call" and rebuilt[2]["type"] == "function_call_output"
    assert context_to_items(None, "why") == [{"role": "user", "content": "why"}]


def test_assistant_text_beside_tool_calls_and_every_role_reach_the_sdk() -> None:
    """A chat-completions turn with text and a tool call keeps both; a developer message stays
    one; a role the SDK has no word for becomes a user message that names it."""
    context = HandoffContext(conversation_history=[
        ConversationEntry(role="user", content="refund order A-1"),
        ConversationEntry.from_dict({"role": "assistant", "content": "Let me look that order up first.",
                                     "tool_calls": [{"id": "c1", "type": "function", "function": {
                                         "name": "lookup", "arguments": '{"o":"A-1"}'}}]}),
        ConversationEntry(role="tool", content="order A-1: 900 EUR", tool_call_id="c1"),
        ConversationEntry(role="developer", content="Never refund more than 500 EUR without approval."),
        ConversationEntry(role="critic", content="check the limit", name="auditor"),
    ])
    assert context_to_items(context) == [
        {"role": "user", "content": "refund order A-1"},
        {"role": "assistant", "content": "Let me look that order up first."},
        {"type": "function_call", "call_id": "c1", "name": "lookup", "arguments": '{"o":"A-1"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "order A-1: 900 EUR"},
        {"role": "developer", "content": "Never refund more than 500 EUR without approval."},
        {"role": "user", "content": "[critic auditor] check the limit"},
    ]


SDK_ITEMS = [
    {"role": "system", "content": "INTERNAL: the discount code is STAFF50"},
    {"role": "user", "content": "I was charged twice"},
    {"type": "function_call", "call_id": "call-1", "name": "lookup_card", "arguments": "{}"},
    {"type": "function_call_output", "call_id": "call-1", "output": "card 4111-xxxx, two charges"},
    {"role": "user", "content": "please refund one"},
]


async def _sent_items(bus: HandoffBus) -> list[dict[str, object]]:
    """What an SDK agent serving ``billing-1`` runs for the handoff ``triage-1`` sends it now."""
    context = items_to_context(SDK_ITEMS, reason="billing")
    await bus.client("triage-1").request_handoff(req("triage-1", "billing-1",
                                                     context_snapshot=serialize_context(context)))
    [pending] = await bus.client("billing-1").get_pending_handoffs()
    return context_to_items(deserialize_context(pending.request.context_snapshot or b""))


async def test_the_sdk_items_carried_along_never_undo_the_bus_policy(real_backend: str, servers: dict) -> None:
    """The SDK's own items ride along for a lossless trip, but only while the history is the
    one they came with: what the bus's context policy and input filters left out stays out."""
    policy = HandoffPolicy(context=ContextPolicy(transfer_system_message=False, max_history=1),
                           input_filters=[remove_all_tools])
    async with make_bus(real_backend, servers, policy=policy) as bus:
        assert await _sent_items(bus) == [{"role": "user", "content": "please refund one"}]
    async with make_bus(real_backend, servers) as bus:
        assert await _sent_items(bus) == SDK_ITEMS  # nothing changed them: the SDK's own items
    # items with no digest of their history (or another's) are not trusted either
    context = items_to_context(SDK_ITEMS[1:2])
    stale = HandoffContext(conversation_history=context.conversation_history, metadata={ITEMS_KEY: SDK_ITEMS})
    assert context_to_items(stale) == [{"role": "user", "content": "I was charged twice"}]


def sdk_worker(url: str, prefix: str) -> AbstractAsyncContextManager[object]:
    """``handoffbus worker --openai-agent tests.sdk_agents:billing=billing-1``, in its own process."""
    return handoffbus_process("worker", "--openai-agent", "tests.sdk_agents:billing=billing-1", "--redis-url", url,
                              "--prefix", prefix, ready=b"serving billing-1",
                              env={"OPENAI_AGENTS_DISABLE_TRACING": "1"})


async def test_an_sdk_handoff_to_an_agent_in_another_process(servers: dict) -> None:
    async with make_bus("valkey", servers) as bus, sdk_worker(servers["valkey"].url, bus.config.prefix):
        billing = remote_agent(bus, "triage-1", "billing-1", name="billing-1")
        triage = Agent(name="triage-1", instructions="Route customers.", handoffs=[billing],
                       model=ScriptedModel([[function_call("transfer_to_billing_1", {}, call_id="call-h1")]]))
        with anyio.fail_after(30):
            result = await Runner.run(triage, "I was charged twice for my order")
        # the same with the SDK's input filter: only the messages cross
        remote = remote_agent(bus, "triage-2", "billing-1", name="billing-1")
        filtered = Agent(name="triage-2", handoffs=[handoff(remote, input_filter=handoff_filters.remove_all_tools)],
                         model=ScriptedModel([[function_call("transfer_to_billing_1", {}, call_id="call-h2")]]))
        with anyio.fail_after(30):
            plain = await Runner.run(filtered, "refund please")
        entries = await bus.redis.xrange(bus.keys.responses("triage-1"))
        [handoff_id] = {fields[b"id"].decode() for _, fields in entries}
        record = await bus.client("triage-1").get_handoff_status(handoff_id)
    # the remote SDK agent saw the conversation: the user's message, the handoff call and its output
    assert result.last_agent.name == "billing-1"
    assert result.final_output == ("billing saw 3 items ['function_call', 'function_call_output', 'message']; "
                                   "the customer said: I was charged twice for my order")
    assert record is not None and record.status is HandoffStatus.COMPLETED and record.request.to_agent == "billing-1"
    assert record.response.result == {"output": result.final_output, "agent": "Billing Agent",
                                      "usage": {"requests": 1, "input_tokens": 0, "output_tokens": 0,
                                                "total_tokens": 0}}  # the scripted model's
    context = deserialize_context(record.request.context_snapshot or b"")
    assert [e.role for e in context.conversation_history] == ["user", "assistant", "tool"]
    assert context.conversation_history[0].content == "I was charged twice for my order"
    assert plain.final_output == "billing saw 1 items ['message']; the customer said: refund please"


async def test_an_sdk_agents_onward_handoff_carries_the_hop_chain(backend: str, servers: dict) -> None:
    # b-1's SDK run hands on to c-1: the new request started a hop chain of its own, so the loop
    # guards (max_depth, cycles) never saw the chain and two SDK agents could hand a
    # conversation back and forth for ever
    from handoffbus.integrations.openai_agents import SdkAgent
    from handoffbus.workers import Agent as BusAgent
    from handoffbus.workers import ReceivedHandoff

    class Leaf(BusAgent):
        agent_id = "c-1"

        def __init__(self) -> None:
            super().__init__()
            self.received: list[ReceivedHandoff] = []

        async def on_handoff_received(self, handoff: ReceivedHandoff) -> Any:
            self.received.append(handoff)
            return {"output": "leaf answered"}

    async with make_bus(backend, servers) as bus:
        middle = Agent(name="b-1", handoffs=[remote_agent(bus, "b-1", "c-1", name="c-1")],
                       model=ScriptedModel([[function_call("transfer_to_c_1", {}, call_id="h1")]]))
        leaf = Leaf()
        async with serving(bus, SdkAgent(middle, agent_id="b-1"), leaf):
            handle = await bus.client("a-1").request_handoff(req("a-1", "b-1"))
            with anyio.fail_after(20):
                outcome = await handle.outcome()
        assert outcome.status is HandoffStatus.COMPLETED
        [onward] = leaf.received
        assert onward.request.from_agent == "b-1" and onward.hops == ["a-1"]
    async with make_bus(backend, servers, policy=HandoffPolicy(max_depth=1)) as bus:
        middle = Agent(name="b-1", handoffs=[remote_agent(bus, "b-1", "c-1", name="c-1")],
                       model=ScriptedModel([[function_call("transfer_to_c_1", {}, call_id="h1")]]))
        leaf = Leaf()
        async with serving(bus, SdkAgent(middle, agent_id="b-1"), leaf):
            handle = await bus.client("a-1").request_handoff(req("a-1", "b-1"))  # depth 1: allowed
            with anyio.fail_after(20):
                outcome = await handle.outcome()
        assert outcome.status is HandoffStatus.FAILED and "MAX_DEPTH" in (outcome.error or "")
        assert leaf.received == []  # b-1 -> c-1 is a second hop: refused


async def test_the_remote_runs_tokens_count_in_the_run_that_handed_to_it(backend: str, servers: dict) -> None:
    """The remote agent's model reported no usage (zeros): a run that handed off under-counted
    its tokens by all the remote run spent."""
    from agents.testing import ModelStep, assistant_message
    from agents.usage import Usage

    from handoffbus.integrations.openai_agents import SdkAgent

    remote_sdk = Agent(name="b-1", model=ScriptedModel([ModelStep(
        output=[assistant_message("done")], usage=Usage(requests=1, input_tokens=40, output_tokens=2,
                                                         total_tokens=42))]))
    async with make_bus(backend, servers) as bus:
        local = Agent(name="a-1", handoffs=[remote_agent(bus, "a-1", "b-1", name="b-1")],
                      model=ScriptedModel([ModelStep(output=[function_call("transfer_to_b_1", {}, call_id="h1")],
                                                     usage=Usage(requests=1, input_tokens=10, output_tokens=1,
                                                                 total_tokens=11))]))
        async with serving(bus, SdkAgent(remote_sdk, agent_id="b-1")):
            with anyio.fail_after(20):
                result = await Runner.run(local, "hello")
    usage = result.context_wrapper.usage
    assert result.final_output == "done"
    assert (usage.requests, usage.input_tokens, usage.output_tokens, usage.total_tokens) == (2, 50, 3, 53)


async def test_a_structured_final_output_arrives_as_the_output_not_its_repr(real_backend: str, servers: dict) -> None:
    """docs/policies.md: an SdkAgent's result is ``{"output": final_output, ...}``. An agent with
    an ``output_type`` (a pydantic model, a list) sent ``str(final_output)`` instead: the
    requester got ``"order='A-1' amount=900"``, a Python repr it cannot read back."""
    from agents.testing import ModelStep, assistant_message
    from pydantic import BaseModel

    from handoffbus.integrations.openai_agents import SdkAgent

    class Refund(BaseModel):
        order: str
        amount: int

    refunds = Agent(name="refunds-1", output_type=Refund, model=ScriptedModel([ModelStep(
        output=[assistant_message('{"order": "A-1", "amount": 900}')])]))
    listing = Agent(name="lister-1", output_type=list[int], model=ScriptedModel([ModelStep(
        output=[assistant_message('{"response": [1, 2]}')])]))
    async with (make_bus(real_backend, servers) as bus,
                serving(bus, SdkAgent(refunds, agent_id="refunds-1"), SdkAgent(listing, agent_id="lister-1"))):
        client = bus.client("a-1")
        with anyio.fail_after(20):
            refund = await (await client.request_handoff(req("a-1", "refunds-1"))).outcome()
            listed = await (await client.request_handoff(req("a-1", "lister-1"))).outcome()
    assert refund.result["output"] == {"order": "A-1", "amount": 900}
    assert listed.result["output"] == [1, 2]
