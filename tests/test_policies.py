"""Context policies and input filters, large content out of band, loop guards and
return-to-sender, the LLM tool surface, and the A2A mapping."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest

from handoffbus import (
    ConversationEntry,
    DecodeError,
    HandoffbusError,
    HandoffContext,
    HandoffRequest,
    HandoffStatus,
    InvalidRequest,
    RouteRefused,
    deserialize_context,
    serialize_context,
)
from handoffbus.a2a import A2A_STATES, a2a_state, a2a_task, agent_card
from handoffbus.models import AgentInfo, WorkerInfo
from handoffbus.policies import (
    HOPS_KEY,
    RETURN_KEY,
    ContextPolicy,
    HandoffPolicy,
    InvalidHook,
    Scenario,
    ToolCallError,
    TransferTarget,
    apply_context_policy,
    check_hops,
    handoff_tool,
    offload,
    remove_all_tools,
    request_from_tool_call,
    restore,
    transfer_tool_name,
    transfer_tools,
)
from handoffbus.workers import Agent, ReceivedHandoff

from .conftest import make_bus
from .helpers import req, serving

pytestmark = pytest.mark.anyio
BANKING = Path(__file__).resolve().parent / "scenarios" / "banking.yaml"


def conversation() -> HandoffContext:
    entries = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "what is my balance?"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "function": {"name": "balance"}}]},
        {"role": "tool", "content": "1200 EUR", "tool_call_id": "c1"},
        {"role": "assistant", "content": "1200 EUR"},
        {"role": "user", "content": "and my card limit?"},
    ]
    return HandoffContext(conversation_history=[ConversationEntry.from_dict(e) for e in entries],
                          tool_state={"balance": {"last": 1200}}, metadata={"session": "s-1"})


# ---------------------------------------------------------------------- context policies


async def test_context_policies() -> None:
    ctx = conversation()
    only_last = await apply_context_policy(ctx, ContextPolicy(preserve_history=False))
    assert [(e.role, e.content) for e in only_last.conversation_history] == [
        ("system", "be brief"), ("user", "and my card limit?")]
    no_system = await apply_context_policy(ctx, ContextPolicy(preserve_history=False, transfer_system_message=False))
    assert [e.role for e in no_system.conversation_history] == ["user"]
    trimmed = await apply_context_policy(ctx, ContextPolicy(max_history=2))
    assert [e.content for e in trimmed.conversation_history] == ["1200 EUR", "and my card limit?"]
    assert trimmed.metadata == {"session": "s-1", "original_history_length": 6, "trimmed": True}
    untouched = await apply_context_policy(ctx, ContextPolicy(max_history=10))
    assert untouched.conversation_history == ctx.conversation_history  # recorded all the same, as sw4rm does
    assert untouched.metadata == {"session": "s-1", "original_history_length": 6, "trimmed": False}
    assert "trimmed" not in (await apply_context_policy(ctx, ContextPolicy())).metadata  # no max_history
    dropped = await apply_context_policy(ctx, ContextPolicy(drop_tool_results=True))
    # the call goes with its result (an assistant message that was only the call goes whole):
    # a model API refuses a tool call that no result answers
    assert [e.role for e in dropped.conversation_history] == ["system", "user", "assistant", "user"]
    assert not any("tool_calls" in e.extra for e in dropped.conversation_history)
    with pytest.raises(ValueError):
        ContextPolicy(max_history=0)


async def test_input_filters_sync_async_and_remove_all_tools() -> None:
    async def redact(ctx: HandoffContext) -> HandoffContext:
        history = [msgspec.structs.replace(e, content=e.content.replace("1200", "XXXX")) for e in
                   ctx.conversation_history]
        return msgspec.structs.replace(ctx, conversation_history=history)

    out = await apply_context_policy(conversation(), None, [remove_all_tools, redact])
    assert [e.role for e in out.conversation_history] == ["system", "user", "assistant", "user"]
    assert out.conversation_history[2].content == "XXXX EUR" and out.tool_state == {}
    with pytest.raises(TypeError, match="returned dict"):
        await apply_context_policy(conversation(), None, [lambda ctx: {}])  # type: ignore[arg-type,return-value]


async def test_a_filter_that_returns_no_context_is_a_typed_error(real_backend: str, servers: dict) -> None:
    """A bad input filter or ``is_enabled`` raises a HandoffbusError (an InvalidRequest), which
    stays a TypeError for code that caught one; nothing is sent."""
    policy = HandoffPolicy(input_filters=[lambda ctx: ctx.to_dict()])  # type: ignore[list-item]
    async with make_bus(real_backend, servers, policy=policy) as bus:
        with pytest.raises(InvalidHook, match="returned dict, not HandoffContext") as caught:
            await bus.client("req").request_handoff(req("req", "w-1", context_snapshot=serialize_context(
                conversation())))
        assert await bus.client("w-1").get_pending_handoffs() == []
    assert isinstance(caught.value, InvalidRequest) and isinstance(caught.value, TypeError)
    # checked when made, as every setting is: not first when a model's tools are listed
    with pytest.raises(InvalidRequest, match="is_enabled must be a bool or a callable"):
        TransferTarget(agent="a-1", is_enabled="yes")
    with pytest.raises(InvalidRequest, match=r"invalid TransferTarget\.agent 'bad name!'"):
        TransferTarget(agent="bad name!")


async def test_a_context_the_policy_cannot_read_is_refused_not_sent_unshaped(
        real_backend: str, servers: dict) -> None:
    """A policy that shapes contexts fails closed: a context it cannot decode (here an
    assistant tool-call turn with content null, which sw4rm's schema does not allow) would
    otherwise skip its filters and reach the target whole. A policy that shapes nothing
    passes opaque contexts on as sent, and leaves their keys alone."""
    turns = [{"role": "system", "content": "internal prompt"}, {"role": "user", "content": "hi"},
             {"role": "assistant", "content": None, "tool_calls": [{"id": "c1"}]}]
    raw = json.dumps({"conversation_history": turns, "tool_state": {"_secret": 1}, "metadata": {}}).encode()
    shaping = HandoffPolicy(context=ContextPolicy(max_history=1), input_filters=[remove_all_tools])
    async with make_bus(real_backend, servers, policy=shaping) as bus:
        with pytest.raises(InvalidRequest, match="not a sw4rm context"):
            await bus.client("req").request_handoff(req("req", "w-1", context_snapshot=raw))
        assert await bus.client("w-1").get_pending_handoffs() == []
    readable = serialize_context(HandoffContext(
        conversation_history=[ConversationEntry(role="user", content="hi")], tool_state={"_id": 7, "success": 1}))
    async with make_bus(real_backend, servers, policy=HandoffPolicy(max_depth=4)) as bus:
        client = bus.client("req")
        for snapshot in (raw, readable):
            handle = await client.request_handoff(req("req", "w-1", context_snapshot=snapshot))
            record = await client.get_handoff_status(handle.handoff_id)
            assert record.request.context_snapshot == snapshot  # no scenario, no shaping: as sent


async def test_a_request_without_history_carries_only_the_last_user_message(
        real_backend: str, servers: dict) -> None:
    """sw4rm's ``preserve_history=False`` on the request itself, with no policy on the bus: the
    history stays behind but for the system messages and the last user message. A context
    it cannot trim is refused rather than sent whole."""
    context = serialize_context(HandoffContext(conversation_history=[
        ConversationEntry(role="system", content="be brief"), ConversationEntry(role="user", content="q1"),
        ConversationEntry(role="assistant", content="a1"), ConversationEntry(role="user", content="q2")]))
    async with make_bus(real_backend, servers) as bus:
        client = bus.client("req")
        kept = await client.request_handoff(req("req", "w-1", context_snapshot=context, preserve_history=False))
        whole = await client.request_handoff(req("req", "w-1", context_snapshot=context))
        sent = [(await client.get_handoff_status(h.handoff_id)).request.context_snapshot for h in (kept, whole)]
        assert [(e.role, e.content) for e in deserialize_context(sent[0]).conversation_history] == \
            [("system", "be brief"), ("user", "q2")]
        assert sent[1] == context
        with pytest.raises(InvalidRequest, match="preserve_history=False shapes this context"):
            await client.request_handoff(req("req", "w-1", context_snapshot=b"opaque", preserve_history=False))
        assert len(await bus.client("w-1").get_pending_handoffs()) == 2


class ContextReader(Agent):
    agent_id = "reader-1"

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[ReceivedHandoff] = []

    async def on_handoff_received(self, handoff: ReceivedHandoff) -> Any:
        self.seen.append(handoff)
        return None


def big_conversation() -> HandoffContext:
    """A context of 1.5 MB, over the default limit of 1 MiB."""
    return HandoffContext(conversation_history=[ConversationEntry(role="system", content="internal only"),
                                                ConversationEntry(role="user", content="z" * 1_500_000)])


async def test_a_raised_payload_limit_lets_the_work_hook_and_the_policy_read_large_contexts(
        real_backend: str, servers: dict) -> None:
    """With ``payload_limit`` raised, a context over 1 MiB reaches the work hook decoded, and
    the bus's context policy applies to it (both decoded it with the 1 MiB default before)."""
    limit = 4 * 1024 * 1024
    snapshot = serialize_context(big_conversation())
    assert len(snapshot) > 1024 * 1024
    async with make_bus(real_backend, servers, payload_limit=limit) as bus:
        reader = ContextReader()
        handle = await bus.client("req").request_handoff(req("req", "reader-1", context_snapshot=snapshot))
        async with serving(bus, reader):
            with anyio.fail_after(30):
                assert (await handle.outcome()).status is HandoffStatus.COMPLETED
    [received] = reader.seen
    assert received.context == big_conversation()
    policy = HandoffPolicy(context=ContextPolicy(transfer_system_message=False))
    async with make_bus(real_backend, servers, payload_limit=limit, policy=policy) as bus:
        await bus.client("req").request_handoff(req("req", "reader-1", context_snapshot=snapshot))
        [pending] = await bus.client("reader-1").get_pending_handoffs()
    sent = deserialize_context(pending.request.context_snapshot or b"", limit=limit)
    assert [e.role for e in sent.conversation_history] == ["user"]


def test_a_received_handoff_decodes_up_to_the_limit_it_is_given() -> None:
    snapshot = serialize_context(big_conversation())
    request = req("req", "reader-1", context_snapshot=snapshot)
    assert ReceivedHandoff.of("req/1", request).context is None  # no bus: the 1 MiB default
    assert ReceivedHandoff.of("req/1", request, limit=len(snapshot)).context == big_conversation()


async def test_large_and_binary_content_goes_out_of_band(real_backend: str, servers: dict) -> None:
    async with make_bus(real_backend, servers) as bus:
        big = "x" * 5000
        ctx = HandoffContext(
            conversation_history=[ConversationEntry(role="user", content=big),
                                  ConversationEntry(role="user", content="hi")],
            tool_state={"scan": b"\x00\x01binary", "report": {"pages": [big, "short"]}})
        out = await offload(bus, "req", ctx, threshold=1000, ttl=60)
        assert out.conversation_history[0].content == "" and out.conversation_history[1].content == "hi"
        ref = out.tool_state["scan"]
        assert ref["kind"] == "bytes" and ref["$hb_blob"].startswith(f"{bus.keys.prefix}:{{req}}:blob:")
        assert 0 < await bus.redis.pttl(ref["$hb_blob"]) <= 60_000
        assert len(serialize_context(out)) < 2000  # the context itself stays small
        # one key per distinct content: the big string twice is stored once
        assert len({out.conversation_history[0].extra["hb.blob"]["$hb_blob"],
                    out.tool_state["report"]["pages"][0]["$hb_blob"]}) == 1
        back = await restore(bus, out)
        assert back == ctx
        await bus.redis.delete(ref["$hb_blob"])
        with pytest.raises(DecodeError, match="is gone"):
            await restore(bus, out)


async def test_a_shorter_lived_offload_of_the_same_content_never_shortens_a_blob(
        real_backend: str, servers: dict) -> None:
    """Two handoffs carrying the same content share one blob key: its lifetime is the longest
    asked for, whichever came first."""
    async with make_bus(real_backend, servers) as bus:
        ctx = HandoffContext(tool_state={"file": b"\x00" * 10})
        first = await offload(bus, "a", ctx, ttl=3600)
        key = first.tool_state["file"]["$hb_blob"]
        assert 3_500_000 < await bus.redis.pttl(key) <= 3_600_000
        assert await offload(bus, "a", ctx, ttl=1) == first  # the same content, short-lived
        assert await bus.redis.pttl(key) > 3_500_000  # still the first handoff's lifetime
        await offload(bus, "a", ctx, ttl=7200)  # a longer one lengthens it
        assert await bus.redis.pttl(key) > 7_100_000
        await bus.redis.delete(key)  # gone (expired): the next offload writes it again
        await offload(bus, "a", ctx, ttl=60)
        assert 0 < await bus.redis.pttl(key) <= 60_000
        assert await restore(bus, first) == ctx
        with pytest.raises(InvalidRequest):
            await offload(bus, "a", ctx, ttl=float("nan"))


# ---------------------------------------------------------------------- loop guards


def _hops(frm: str, to: str, hops: list[str], **metadata: Any) -> HandoffRequest:
    return HandoffRequest(from_agent=frm, to_agent=to, metadata={HOPS_KEY: hops, **metadata})


def test_depth_and_cycles() -> None:
    check_hops(_hops("e", "f", ["a", "b", "c", "d"]))  # the fifth handoff
    with pytest.raises(RouteRefused) as deep:
        check_hops(_hops("f", "g", ["a", "b", "c", "d", "e"]))
    assert deep.value.code == "MAX_DEPTH" and "a -> b -> c -> d -> e -> f" in str(deep.value)
    with pytest.raises(RouteRefused) as cycle:
        check_hops(_hops("c", "a", ["a", "b"]))
    assert cycle.value.code == "CYCLE"
    check_hops(_hops("c", "a", ["a", "b"]), cycles="allow", max_visits=2)  # a second visit allowed
    with pytest.raises(RouteRefused, match="CYCLE"):
        check_hops(_hops("c", "a", ["a", "b", "a", "b"]), cycles="allow", max_visits=2)
    check_hops(_hops("b", "a", ["a"], **{RETURN_KEY: "a/r-1"}))  # a return is not a cycle
    with pytest.raises(RouteRefused, match="CYCLE"):  # ... only to the agent that handed over
        check_hops(_hops("c", "a", ["a", "b"], **{RETURN_KEY: "b/r-2"}))
    with pytest.raises(RouteRefused, match="BAD_HOP_CHAIN"):
        check_hops(HandoffRequest(from_agent="a", to_agent="b", metadata={HOPS_KEY: "a"}))


class Relay(Agent):
    """Hands each conversation on to the next agent of ``chain``; the last returns it."""

    def __init__(self, agent_id: str, nxt: str | None) -> None:
        super().__init__()
        self.agent_id = agent_id  # type: ignore[misc]
        self.nxt = nxt
        self.seen: list[ReceivedHandoff] = []
        self.errors: list[str] = []
        self.handled = anyio.Event()
        self.refused = anyio.Event()

    async def on_handoff_received(self, handoff: ReceivedHandoff) -> Any:
        self.seen.append(handoff)
        context = HandoffContext(conversation_history=[ConversationEntry(role="assistant", content=self.agent_id)])
        try:
            if self.nxt is None:
                back = await handoff.return_to_sender(context, reason="done here")
                return {"returned": back.handoff_id}
            onward = await handoff.hand_to(self.nxt, reason="next", context=context)
            return {"onward": onward.handoff_id}
        except RouteRefused as exc:
            self.errors.append(exc.code)
            self.refused.set()
            return {"refused": exc.code}
        finally:
            self.handled.set()


async def test_hop_chains_travel_and_the_depth_limit_holds(real_backend: str, servers: dict) -> None:
    async with make_bus(real_backend, servers, policy=HandoffPolicy(max_depth=3)) as bus:
        relays = [Relay("r1", "r2"), Relay("r2", "r3"), Relay("r3", "r4"), Relay("r4", None)]
        first = await bus.client("start").request_handoff(req("start", "r1"))
        async with serving(bus, *relays):
            with anyio.fail_after(20):
                assert (await first.outcome()).status is HandoffStatus.COMPLETED
                await relays[2].handled.wait()
    chain = [relay.seen[0].request.metadata.get(HOPS_KEY, []) for relay in relays[:3]]
    assert chain == [[], ["start"], ["start", "r1"]]
    assert relays[2].errors == ["MAX_DEPTH"] and relays[3].seen == []


async def test_return_to_sender(real_backend: str, servers: dict) -> None:
    """Each agent hands the conversation back to the one that handed it over: returns are not
    cycles, so the two agents play it back and forth until the depth limit stops them."""
    async with make_bus(real_backend, servers, policy=HandoffPolicy(max_depth=5)) as bus:
        home, away = Relay("home-1", None), Relay("away-1", None)
        first = await bus.client("home-1").request_handoff(req("home-1", "away-1", reason="go"))
        async with serving(bus, away, home):
            with anyio.fail_after(20):
                assert (await first.outcome()).status is HandoffStatus.COMPLETED
                await away.refused.wait()
    handed_back = home.seen[0]
    assert handed_back.request.from_agent == "away-1" and handed_back.request.to_agent == "home-1"
    assert handed_back.request.metadata[RETURN_KEY] == first.handoff_id
    assert handed_back.request.metadata[HOPS_KEY] == ["home-1"]
    assert handed_back.context is not None and handed_back.context.conversation_history[0].content == "away-1"
    # depth 1 (home -> away) .. 5 accepted; the sixth handoff, away's third return, is too deep
    assert (len(away.seen), len(home.seen)) == (3, 2)
    assert away.errors == ["MAX_DEPTH"] and home.errors == []
    assert away.seen[-1].request.metadata[HOPS_KEY] == ["home-1", "away-1", "home-1", "away-1"]


# ---------------------------------------------------------------------- tools


def test_the_unified_handoff_tool_lists_exactly_the_allowed_routes() -> None:
    scenario = Scenario.load(BANKING)
    tool = handoff_tool(scenario, "Concierge")
    assert tool is not None
    function = tool["function"]
    assert tool["type"] == "function" and function["name"] == "handoff_to_agent" and function["strict"] is True
    parameters = function["parameters"]
    assert parameters["additionalProperties"] is False and parameters["required"] == ["target_agent", "reason"]
    assert parameters["properties"]["target_agent"]["enum"] == ["AuthAgent", "InvestmentAdvisor", "CardRecommendation"]
    assert "InvestmentAdvisor: User asks about investments" in function["description"]
    assert handoff_tool(scenario, "InvestmentAdvisor")["function"]["parameters"]["properties"][  # type: ignore[index]
        "target_agent"]["enum"] == ["Concierge"]
    assert handoff_tool(Scenario.from_yaml("name: s\nstart_agent: A\nagents: [A]"), "A") is None


async def test_transfer_tools_and_is_enabled() -> None:
    async def after_hours(run: dict[str, Any]) -> bool:
        return bool(run["after_hours"])

    targets = [TransferTarget(agent="Billing.Desk", description="billing questions"),
               TransferTarget(agent="fraud-1", is_enabled=lambda run: run["verified"]),
               TransferTarget(agent="night-1", is_enabled=after_hours),
               TransferTarget(agent="off-1", is_enabled=False)]
    tools = await transfer_tools(targets, {"verified": True, "after_hours": False})
    assert [t["function"]["name"] for t in tools] == ["transfer_to_billing_desk", "transfer_to_fraud_1"]
    assert tools[0]["function"]["description"] == "billing questions"
    assert transfer_tool_name("Billing Desk") == "transfer_to_billing_desk"
    made = await request_from_tool_call("transfer_to_fraud_1", '{"reason": "card stolen"}', from_agent="triage-1",
                                        targets=targets, run_context={"verified": True}, priority=1)
    assert (made.to_agent, made.reason, made.priority) == ("fraud-1", "card stolen", 1)
    with pytest.raises(ToolCallError, match="not available right now"):
        await request_from_tool_call("transfer_to_fraud_1", {}, from_agent="t", targets=targets,
                                     run_context={"verified": False})


async def test_two_agents_that_make_one_transfer_tool_name_are_refused() -> None:
    """``billing-1`` and ``Billing.1`` both make ``transfer_to_billing_1``: a call of it could
    mean either, so neither the tools nor a call of them is made."""
    targets = [TransferTarget(agent="billing-1", description="billing"),
               TransferTarget(agent="Billing.1", description="billing (EU entity)")]
    with pytest.raises(InvalidRequest, match=r"'Billing\.1' and 'billing-1' both make it"):
        await transfer_tools(targets)
    with pytest.raises(InvalidRequest, match="transfer_to_billing_1"):
        await request_from_tool_call("transfer_to_billing_1", "{}", from_agent="triage-1", targets=targets)
    with pytest.raises(InvalidRequest, match="listed twice"):
        await transfer_tools([targets[0], targets[0]])
    with pytest.raises(InvalidRequest):
        TransferTarget(agent=None)  # type: ignore[arg-type]
    assert issubclass(InvalidRequest, HandoffbusError)


async def test_tool_calls_become_requests_or_errors_the_model_can_read() -> None:
    scenario = Scenario.load(BANKING)
    made = await request_from_tool_call("handoff_to_agent", json.dumps(
        {"target_agent": "AuthAgent", "reason": "verify"}), from_agent="Concierge", scenario=scenario)
    assert (made.from_agent, made.to_agent, made.reason) == ("Concierge", "AuthAgent", "verify")
    with pytest.raises(ToolCallError) as unknown:
        await request_from_tool_call("handoff_to_agent", {"target_agent": "FraudAgent", "reason": "?"},
                                     from_agent="Concierge", scenario=scenario)
    message = str(unknown.value)
    assert "cannot hand off to 'FraudAgent'" in message
    assert "AuthAgent, InvestmentAdvisor, CardRecommendation" in message
    with pytest.raises(ToolCallError, match="not valid JSON"):
        await request_from_tool_call("handoff_to_agent", "{oops", from_agent="Concierge", scenario=scenario)
    with pytest.raises(ToolCallError, match="there is no tool 'delete_everything'"):
        await request_from_tool_call("delete_everything", {}, from_agent="Concierge")


async def test_an_unknown_tool_is_answered_with_the_tools_the_model_may_call() -> None:
    """docs/policies.md: a ``ToolCallError`` "lists what it may call instead". With a scenario
    that is ``handoff_to_agent`` (not "none"), and a target disabled now is no tool to call."""
    scenario = Scenario.load(BANKING)
    with pytest.raises(ToolCallError) as unknown:
        await request_from_tool_call("transfer_to_authagent", {"reason": "?"}, from_agent="Concierge",
                                     scenario=scenario)
    assert "the handoff tools are: handoff_to_agent" in str(unknown.value)
    targets = [TransferTarget(agent="fraud-1"), TransferTarget(agent="off-1", is_enabled=False)]
    with pytest.raises(ToolCallError) as unknown:
        await request_from_tool_call("transfer_to_fraud", {}, from_agent="t", targets=targets)
    assert "the handoff tools are: transfer_to_fraud_1" in str(unknown.value)
    assert "transfer_to_off_1" not in str(unknown.value)


# ---------------------------------------------------------------------- A2A


async def test_a2a_states_tasks_and_agent_cards(real_backend: str, servers: dict) -> None:
    assert set(A2A_STATES) == set(HandoffStatus)
    assert a2a_state(HandoffStatus.EXPIRED) == ("failed", {"handoffbus.status": "EXPIRED",
                                                           "reason": "not accepted before its deadline"})
    assert a2a_state(HandoffStatus.CANCELLED)[0] == "canceled"
    async with make_bus(real_backend, servers) as bus:
        client, target = bus.client("req"), bus.client("echo-1")
        handle = await client.request_handoff(req("req", "echo-1"))
        await target.accept_handoff(handle.handoff_id)
        await target.complete_handoff(handle.handoff_id, result={"answer": 42})
        record = await handle.status()
    assert record is not None
    task = a2a_task(record)
    assert task["kind"] == "task" and task["id"] == handle.handoff_id
    assert task["status"]["state"] == "completed" and task["status"]["timestamp"].endswith("Z")
    assert [m["parts"][0]["text"] for m in task["history"]] == ["PENDING", "ACCEPTED", "COMPLETED"]
    assert task["artifacts"][0]["parts"] == [{"kind": "data", "data": {"answer": 42}}]
    info = AgentInfo(agent_id="security-reviewer-1", capabilities=["code_review", "security_analysis"],
                     workers=[WorkerInfo(consumer="w-1", state="RUNNABLE", load=0, limit=8)])
    card = agent_card(info, "https://agents.example.com/security-reviewer-1")
    for field in ("protocolVersion", "name", "description", "url", "version", "capabilities",
                  "defaultInputModes", "defaultOutputModes", "skills"):
        assert field in card
    assert [s["id"] for s in card["skills"]] == ["code_review", "security_analysis"]


async def test_a_users_own_hb_blob_key_is_data_not_a_reference(real_backend: str, servers: dict) -> None:
    """A context that was never offloaded may hold a dict with a ``$hb_blob`` key of its own
    (a reference in some other system, the docs of this very format): it reaches the work hook
    as sent, and ``restore`` leaves it alone rather than reading a key it happens to name."""
    user_data = {"$hb_blob": "doc-42", "title": "quarterly report"}
    ctx = HandoffContext(conversation_history=[ConversationEntry(role="user", content="summarise it")],
                         tool_state={"attachment": user_data})
    async with make_bus(real_backend, servers) as bus:
        reader = ContextReader()
        handle = await bus.client("req").request_handoff(req("req", "reader-1",
                                                               context_snapshot=serialize_context(ctx)))
        async with serving(bus, reader):
            with anyio.fail_after(30):
                outcome = await handle.outcome()
        assert outcome.status is HandoffStatus.COMPLETED, outcome
        assert [h.context for h in reader.seen] == [ctx]
        # one that names a key of the bus (here a handoff's record hash) is data too, and never
        # an untyped redis error
        record = bus.keys.record("req", handle.handoff_id.split("/", 1)[1]).record
        named = HandoffContext(tool_state={"x": {"$hb_blob": record, "sha256": "0" * 64, "kind": "str"}})
        assert await restore(bus, named) == named


async def test_max_history_never_leaves_a_tool_result_without_its_call(real_backend: str, servers: dict) -> None:
    """A cut between an assistant's tool call and its result would send the result alone, which
    model APIs refuse ("messages with role 'tool' must be a response to a preceding message with
    'tool_calls'"): the orphaned result stays behind with its call."""
    policy = HandoffPolicy(context=ContextPolicy(max_history=3))
    async with make_bus(real_backend, servers, policy=policy) as bus:
        await bus.client("req").request_handoff(req("req", "w-1", context_snapshot=serialize_context(
            conversation())))
        [pending] = await bus.client("w-1").get_pending_handoffs()
    sent = deserialize_context(pending.request.context_snapshot or b"")
    calls = {call["id"] for e in sent.conversation_history for call in e.extra.get("tool_calls", [])}
    orphans = [e for e in sent.conversation_history if e.role == "tool" and e.tool_call_id not in calls]
    assert orphans == []
    assert [e.content for e in sent.conversation_history] == ["1200 EUR", "and my card limit?"]
    assert sent.metadata["trimmed"] is True and sent.metadata["original_history_length"] == 6
