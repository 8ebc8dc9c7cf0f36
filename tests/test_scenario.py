"""Scenarios (shared/seeds/004): loading and validation, routes enforced before anything is
queued, greetings, context_vars in Jinja2's sandbox, control flags sanitised, handoff
instructions, and the banking scenario end to end through real workers."""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest

from handoffbus import HandoffContext, RouteRefused, deserialize_context, serialize_context
from handoffbus.policies import (
    RESOLUTION_KEY,
    HandoffPolicy,
    HandoffService,
    Scenario,
    ScenarioError,
    sanitize_shared_context,
)
from handoffbus.workers import Agent, ReceivedHandoff

from .conftest import make_bus
from .helpers import prefix_keys, req, serving

pytestmark = pytest.mark.anyio

BANKING = Path(__file__).resolve().parent / "scenarios" / "banking.yaml"


def banking() -> Scenario:
    return Scenario.load(BANKING)


# ---------------------------------------------------------------------- loading


def test_the_banking_scenario_loads() -> None:
    scenario = banking()
    assert scenario.start_agent == "Concierge"
    assert scenario.agent_names == ["Concierge", "AuthAgent", "InvestmentAdvisor", "CardRecommendation"]
    assert scenario.targets("Concierge") == ["AuthAgent", "InvestmentAdvisor", "CardRecommendation"]
    assert scenario.targets("InvestmentAdvisor") == ["Concierge"]
    assert scenario.profile("AuthAgent").greeting == "I need to verify your identity before we continue."


@pytest.mark.parametrize(("change", "message"), [
    ("start_agent: Nobody", "start_agent 'Nobody' is not one of its agents"),
    ("handoffs:\n  - {from_agent: A, to_agent: Ghost}", "names 'Ghost', which is not one of its agents"),
    ("handoffs:\n  - {from_agent: A, to_agent: A}", "a handoff from 'A' to itself"),
    ("handoffs:\n  - {from_agent: A, to_agent: B}\n  - {from_agent: A, to_agent: B}", "is listed twice"),
    ("handoffs:\n  - {from_agent: A, to_agent: B, type: loud}", "Invalid enum value 'loud'"),
    ("handoff_type: maybe", "Invalid enum value 'maybe'"),
    ("handoffs:\n  - {from_agent: A, to_agent: B, colour: red}", "unknown field `colour`"),
    ("agents: [A, A]", "an agent is listed twice"),
    ("agents: ['a b', B]", "agent id"),
])
def test_bad_scenarios_are_refused_at_load(change: str, message: str) -> None:
    base = {"name": "s", "start_agent": "A", "agents": "[A, B]"}
    key = change.split(":", 1)[0]
    lines = [f"{k}: {v}" for k, v in base.items() if k != key] + [change]
    with pytest.raises(ScenarioError, match=message.replace("[", r"\[").replace("`", ".")):
        Scenario.from_yaml("\n".join(lines))


def test_agents_start_agent_and_an_edges_tool_are_optional_as_in_the_format() -> None:
    # the scenario format: start_agent optional, agents empty = all; an edge may name its tool
    scenario = Scenario.from_yaml("name: s\nhandoffs:\n  - {from_agent: A, to_agent: B, tool: handoff_to_agent}\n"
                                  "  - {from_agent: B, to_agent: C}\n")
    assert scenario.agent_names == ["A", "B", "C"] and scenario.start_agent == ""
    assert scenario.governs("C") and not scenario.governs("D")
    assert scenario.route("A", "B") is not None and scenario.route("A", "B").tool == "handoff_to_agent"  # type: ignore[union-attr]
    assert scenario.targets("B") == ["C"] and scenario.route("A", "C") is None
    with pytest.raises(ScenarioError, match="agent id"):
        Scenario.from_yaml("name: s\nhandoffs:\n  - {from_agent: 'a b', to_agent: B}\n")


def test_unreadable_scenarios() -> None:
    with pytest.raises(ScenarioError, match="cannot read scenario"):
        Scenario.load("/nonexistent/scenario.yaml")
    with pytest.raises(ScenarioError, match="invalid scenario"):
        Scenario.from_yaml("name: [unclosed")


# ---------------------------------------------------------------------- greetings, templates, instructions


def test_greetings() -> None:
    s = banking()
    assert s.select_greeting("AuthAgent", is_return=False, handoff_type="announced") == \
        "I need to verify your identity before we continue."
    assert s.select_greeting("AuthAgent", is_return=True, handoff_type="announced") == \
        "Let's finish verifying your identity."
    assert s.select_greeting("AuthAgent", is_return=True, handoff_type="discrete") is None
    assert s.select_greeting("AuthAgent", is_return=False, handoff_type="discrete", override="Hi") == "Hi"
    assert s.select_greeting("InvestmentAdvisor", is_return=True, handoff_type="announced") is None  # has none


def test_resolution_renders_context_vars_in_the_sandbox(caplog: pytest.LogCaptureFixture) -> None:
    s = banking()
    session = {"profile": {"investment_tier": "gold", "name": "ada"}}
    resolution = s.resolve("Concierge", "InvestmentAdvisor", visited=["Concierge"], variables={"session": session})
    assert resolution is not None
    assert (resolution.handoff_type, resolution.share_context, resolution.is_return) == ("discrete", True, False)
    assert resolution.greeting is None  # discrete
    assert resolution.context_vars == {"portfolio_focus": "gold", "greeting_name": "ADA"}
    # a template that fails keeps its raw text, and says so
    caplog.set_level(logging.WARNING, logger="handoffbus")
    failed = s.resolve("Concierge", "InvestmentAdvisor", variables={"session": {}})
    assert failed is not None and failed.context_vars["portfolio_focus"] == "{{ session.profile.investment_tier }}"
    assert "kept as written" in caplog.text
    # the sandbox: no way to the interpreter's internals
    from handoffbus.policies.scenario import render_context_vars

    escaped = render_context_vars({"x": "{{ ''.__class__.__mro__[1].__subclasses__() }}",
                                   "y": "{{ cycler.__init__.__globals__ }}"}, {})
    assert escaped == {"x": "{{ ''.__class__.__mro__[1].__subclasses__() }}", "y": "{{ cycler.__init__.__globals__ }}"}
    immutable = render_context_vars({"z": "{{ items.append(1) }}"}, {"items": []})
    assert immutable == {"z": "{{ items.append(1) }}"}
    assert s.resolve("InvestmentAdvisor", "CardRecommendation") is None  # no such route


def test_the_scenario_formats_defaults_and_template_vars() -> None:
    s = banking()
    # an edge without share_context shares the conversation, as the scenario format says
    card = s.resolve("Concierge", "CardRecommendation")
    assert card is not None and card.share_context is True
    auth = s.resolve("Concierge", "AuthAgent")
    assert auth is not None and auth.share_context is False  # said so on the edge
    # template_vars are global variables; the caller's own win
    vars_ = Scenario.from_yaml("""
name: t
start_agent: A
agents: [A, B]
template_vars: {desk: private, tier: gold}
handoffs:
  - {from_agent: A, to_agent: B, context_vars: {where: "{{ desk }}/{{ tier }}"}}
""")
    resolved = vars_.resolve("A", "B", variables={"tier": "platinum"})
    assert resolved is not None and resolved.context_vars == {"where": "private/platinum"}


def test_returns_and_announced_greetings() -> None:
    s = banking()
    first = s.resolve("Concierge", "AuthAgent", visited=["Concierge"])
    back_again = s.resolve("Concierge", "AuthAgent", visited=["Concierge", "AuthAgent", "Concierge"])
    assert first is not None and back_again is not None
    assert first.greeting == "I need to verify your identity before we continue." and not first.is_return
    assert back_again.greeting == "Let's finish verifying your identity." and back_again.is_return


def test_handoff_conditions_become_instructions() -> None:
    text = banking().instructions("Concierge")
    assert text.count("When the following condition is met") == 3
    assert ('"User asks about investments, portfolios, or retirement"\n'
            '→ Call handoff_to_agent(target_agent="InvestmentAdvisor", reason="...")') in text
    assert banking().instructions("CardRecommendation") == ""  # its route has no condition


def test_control_flags_are_sanitised_out_of_the_top_level_and_a_handoff_context() -> None:
    shared = {"handoff_reason": "r", "greet_on_switch": True, "_internal": 1, "hb.hops": ["x"],
              "should_interrupt_playback": True, "session_overrides": {"greeting": "hi"}, "handoff_summary": "s",
              "profile": {"name": "ada", "_id": 7, "nested": [{"tool_name": "lookup", "ok": 1}]}}
    # the voice-agent service's flags go too; the same names inside the data are the data
    assert sanitize_shared_context(shared) == {
        "handoff_reason": "r", "profile": {"name": "ada", "_id": 7, "nested": [{"tool_name": "lookup", "ok": 1}]}}
    # a handoff tool's result, carried as handoff_context, is sanitised as the service does it
    tool_result = {"handoff_context": {"success": True, "target_agent": "x", "topic": "fraud",
                                       "detail": {"success": "data"}}, "profile": {"success": 1}}
    assert sanitize_shared_context(tool_result) == {
        "handoff_context": {"topic": "fraud", "detail": {"success": "data"}}, "profile": {"success": 1}}


# ---------------------------------------------------------------------- on the bus


def _context(*messages: tuple[str, str], **metadata: Any) -> bytes:
    return serialize_context(HandoffContext(
        conversation_history=[{"role": r, "content": c} for r, c in messages], metadata=metadata))


async def test_a_route_not_in_the_scenario_is_refused_before_anything_is_queued(backend: str, servers: dict) -> None:
    async with make_bus(backend, servers, policy=HandoffPolicy(banking())) as bus:
        advisor = bus.client("InvestmentAdvisor")
        with pytest.raises(RouteRefused) as refused:
            await advisor.request_handoff(req("InvestmentAdvisor", "CardRecommendation"))
        assert refused.value.code == "ROUTE_NOT_IN_SCENARIO"
        assert "allowed from InvestmentAdvisor: Concierge" in str(refused.value)
        with pytest.raises(RouteRefused, match="by agent, not by capabilities"):
            await advisor.request_handoff(msgspec.structs.replace(req("InvestmentAdvisor", ""),
                                                                  capabilities_required=["x"]))
        with pytest.raises(RouteRefused):  # into the scenario from outside it
            await bus.client("stranger-1").request_handoff(req("stranger-1", "Concierge"))
        assert await prefix_keys(bus) == []  # nothing was written
        # agents the scenario does not govern are not its business
        await bus.client("stranger-1").request_handoff(req("stranger-1", "other-1"))


async def test_a_routed_request_from_outside_never_reaches_a_scenario_agent(backend: str, servers: dict) -> None:
    # refused by name, the same request by capabilities reached Concierge around the scenario
    class Capable(BankAgent):
        capabilities = ["banking"]

    async with make_bus(backend, servers, policy=HandoffPolicy(banking())) as bus:
        concierge, outsider = Capable("Concierge"), Capable("helpdesk-1")
        async with serving(bus, concierge, outsider):
            agents = {a.agent_id: a.capabilities for a in await bus.client("stranger-1").list_agents()}
            assert agents == {"Concierge": [], "helpdesk-1": ["banking"]}  # governed: serves no set
            handle = await bus.client("stranger-1").request_handoff(msgspec.structs.replace(
                req("stranger-1", ""), capabilities_required=["banking"]))
            with anyio.fail_after(10):
                outcome = await handle.outcome()
        assert outcome.status.value == "COMPLETED" and outcome.accepting_agent == "helpdesk-1"
        assert concierge.received == []


async def test_the_sessions_greeting_override_is_the_explicit_greeting(backend: str, servers: dict) -> None:
    # the voice-agent service's order: session_overrides.greeting first, then the profile's
    async with make_bus(backend, servers, policy=HandoffPolicy(banking())) as bus:
        client = bus.client("Concierge")
        for override in ("Hello Ada, security desk here.", None):
            metadata = {"session_overrides": {"greeting": override}} if override else {}
            await client.request_handoff(req("Concierge", "AuthAgent", context_snapshot=_context(
                ("user", "hi"), **metadata)))
        greetings = [p.request.metadata[RESOLUTION_KEY]["greeting"]
                     for p in await bus.client("AuthAgent").get_pending_handoffs()]
    assert sorted(greetings) == ["Hello Ada, security desk here.",
                                 "I need to verify your identity before we continue."]


class BankAgent(Agent):
    """Records what it received; completes with its name."""

    def __init__(self, agent_id: str) -> None:
        super().__init__()
        self.agent_id = agent_id  # type: ignore[misc]
        self.received: list[ReceivedHandoff] = []

    async def on_handoff_received(self, handoff: ReceivedHandoff) -> Any:
        self.received.append(handoff)
        return {"by": self.agent_id}


async def test_banking_end_to_end(real_backend: str, servers: dict) -> None:
    """Concierge -> InvestmentAdvisor (discrete, shared context, context_vars), Concierge ->
    AuthAgent (announced, greeted, context not shared), and a refused route."""
    scenario = banking()
    async with make_bus(real_backend, servers, policy=HandoffPolicy(scenario)) as bus:
        advisor, auth = BankAgent("InvestmentAdvisor"), BankAgent("AuthAgent")
        concierge = bus.client("Concierge")
        history = _context(("system", "You are the concierge."), ("user", "hi"), ("assistant", "hello"),
                           ("user", "move my pension into index funds"), greet_on_switch=True, account="A-7")
        to_advisor = await concierge.request_handoff(
            req("Concierge", "InvestmentAdvisor", reason="retirement question", context_snapshot=history),
            variables={"session": {"profile": {"investment_tier": "platinum", "name": "ada"}}})
        to_auth = await concierge.request_handoff(
            req("Concierge", "AuthAgent", reason="needs verification", context_snapshot=history))
        with pytest.raises(RouteRefused, match="ROUTE_NOT_IN_SCENARIO"):
            await bus.client("CardRecommendation").request_handoff(req("CardRecommendation", "AuthAgent"))
        async with serving(bus, advisor, auth):
            with anyio.fail_after(20):
                outcomes = [await to_advisor.outcome(), await to_auth.outcome()]
    assert [o.result for o in outcomes] == [{"by": "InvestmentAdvisor"}, {"by": "AuthAgent"}]

    [got] = advisor.received
    resolution = got.request.metadata[RESOLUTION_KEY]
    assert resolution["handoff_type"] == "discrete" and resolution["greeting"] is None
    assert resolution["share_context"] is True
    assert resolution["context_vars"] == {"portfolio_focus": "platinum", "greeting_name": "ADA"}
    assert got.context is not None and len(got.context.conversation_history) == 4  # shared whole
    assert got.context.metadata == {"account": "A-7"}  # the control flag is gone

    [greeted] = auth.received
    resolution = greeted.request.metadata[RESOLUTION_KEY]
    assert resolution["handoff_type"] == "announced"
    assert resolution["greeting"] == "I need to verify your identity before we continue."
    assert greeted.context is not None  # not shared: only the reason and the last user message
    assert [(e.role, e.content) for e in greeted.context.conversation_history] == \
        [("user", "move my pension into index funds")]
    assert greeted.context.metadata == {"handoff_reason": "needs verification"}
    assert deserialize_context(greeted.request.context_snapshot or b"").metadata["handoff_reason"] == \
        "needs verification"


async def test_a_worker_process_loads_a_scenario(servers: dict) -> None:
    from .helpers import ROOT, start_worker

    async with make_bus("valkey", servers) as bus:
        process, _ = await start_worker(servers["valkey"].url, bus.config.prefix, "tests.agents:ConciergeRelay",
                                        "--scenario", str(BANKING))
        try:
            client = bus.client("front-door")
            handles = [await client.request_handoff(req("front-door", "Concierge", metadata={"next": target}))
                       for target in ("AuthAgent", "FraudAgent")]
            with anyio.fail_after(20):
                allowed, refused = [(await h.outcome()).result for h in handles]
        finally:
            process.terminate()
            with anyio.fail_after(30):
                assert await process.wait() == 0
            await process.aclose()
        onward = await bus.client("Concierge").get_handoff_status(allowed["onward"])
    assert refused == {"refused": "ROUTE_NOT_IN_SCENARIO"}
    assert onward is not None and onward.request.to_agent == "AuthAgent"
    assert onward.request.metadata[RESOLUTION_KEY]["greeting"] == "I need to verify your identity before we continue."
    assert onward.request.metadata["hb.hops"] == ["front-door"]
    bad = await anyio.run_process(
        [sys.executable, "-m", "handoffbus", "worker", "tests.agents:ConciergeRelay", "--scenario", "/nonexistent.yaml",
         "--redis-url", servers["valkey"].url], cwd=ROOT, check=False)
    assert bad.returncode == 2 and b"cannot read scenario" in bad.stderr


async def test_a_specialist_hands_back_along_the_scenarios_return_edge(backend: str, servers: dict) -> None:
    """The scenario's InvestmentAdvisor -> Concierge, taken as a handoff (not a return to
    sender), was refused as a cycle: the Concierge had had the conversation. A scenario's own
    route may go back, bounded by max_visits; off its routes, cycles are refused as before."""
    scenario = Scenario.load(BANKING)
    refused: list[BaseException] = []

    class Advisor(Agent):
        agent_id = "InvestmentAdvisor"

        async def on_handoff_received(self, handoff: ReceivedHandoff) -> Any:
            try:
                await handoff.hand_to("Concierge", "investment query completed", handoff.context)
            except Exception as exc:
                refused.append(exc)
            return {"ok": True}

    async with make_bus(backend, servers, policy=HandoffPolicy(scenario, max_visits=2)) as bus:
        handle = await bus.client("Concierge").request_handoff(req("Concierge", "InvestmentAdvisor"))
        async with serving(bus, Advisor()):
            with anyio.fail_after(20):
                await handle.outcome()
        back = await bus.client("Concierge").get_pending_handoffs()
    assert refused == []
    [returned] = back
    assert returned.request.from_agent == "InvestmentAdvisor"
    resolution = returned.request.metadata[RESOLUTION_KEY]  # resolved as the scenario's route
    assert (resolution["source_agent"], resolution["target_agent"]) == ("InvestmentAdvisor", "Concierge")
    assert resolution["is_return"]  # the Concierge had the conversation: its return greeting
    policy = HandoffPolicy(scenario, max_visits=2)
    third = msgspec.structs.replace(returned.request, from_agent="Concierge", to_agent="InvestmentAdvisor",
                                    metadata={"hb.hops": ["Concierge", "InvestmentAdvisor"] * 2})
    with pytest.raises(RouteRefused, match="CYCLE"):  # a third visit: past max_visits, even on its route
        policy.check(third)


# ---------------------------------------------------------------------- the accelerator's HandoffService


def test_the_handoff_service_answers_as_the_accelerators_does() -> None:
    """seed 004's own tests of HandoffService, and what its resolution carries."""
    service = HandoffService(Scenario.load(BANKING), session_id="test-session")
    resolution = service.resolve_handoff(source_agent="Concierge", target_agent="InvestmentAdvisor",
                                         handoff_reason="User wants investment advice")
    assert resolution.success and resolution.target_agent == "InvestmentAdvisor" and resolution.is_discrete
    assert not service.resolve_handoff(source_agent="Concierge", target_agent="NonExistentAgent",
                                       handoff_reason="Test").success
    assert service.resolve_handoff("Concierge", "AuthAgent", "").is_announced
    assert service.resolve_handoff("Concierge", "InvestmentAdvisor", "").is_discrete
    assert service.is_handoff("handoff_to_agent") and not service.is_handoff("get_balance")
    assert service.get_handoff_target("Concierge", "AuthAgent") == "AuthAgent"
    assert service.get_handoff_target("AuthAgent", "InvestmentAdvisor") is None
    # what the target's prompt gets: the route's context_vars, rendered, beside the session's state
    investing = service.resolve_handoff(
        "Concierge", "InvestmentAdvisor", "wants a portfolio review", user_last_utterance="review my portfolio",
        session={"profile": {"investment_tier": "gold", "name": "ada"}}, session_profile={"name": "ada"},
        handoff_context={"topic": "portfolio", "tool_name": "handoff_to_agent", "_internal": 1})
    assert investing.system_vars["portfolio_focus"] == "gold" and investing.system_vars["greeting_name"] == "ADA"
    assert investing.system_vars["handoff_reason"] == "wants a portfolio review"
    assert investing.system_vars["user_last_utterance"] == "review my portfolio"
    assert investing.system_vars["session_profile"] == {"name": "ada"}
    assert investing.system_vars["handoff_context"] == {"topic": "portfolio"}  # control flags sanitised out
    assert investing.system_vars["session_id"] == "test-session"
    assert investing.share_context and not investing.greet_on_switch and investing.greeting is None
    auth = service.resolve_handoff("Concierge", "AuthAgent", "verify", visited=["Concierge", "AuthAgent"])
    assert auth.greet_on_switch and auth.greeting == "Let's finish verifying your identity."  # a return visit
    # greetings: first visit, return visit, a handoff that brings its context, an override
    assert service.select_greeting("AuthAgent") == "I need to verify your identity before we continue."
    assert service.select_greeting("AuthAgent", is_return=True) == "Let's finish verifying your identity."
    assert service.select_greeting("AuthAgent", with_context=True) is None
    assert service.select_greeting("AuthAgent", handoff_type="discrete") is None
    assert service.select_greeting("AuthAgent", with_context=True, override="Hello") == "Hello"
