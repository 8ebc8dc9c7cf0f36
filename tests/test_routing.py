"""Capability routing: offers, fallback chain, redirects, deferrals, NO_CAPABLE_AGENT, lapsed
offers, late joiners, priority order with ageing, and fairness."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

import anyio
import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from handoffbus import HandoffBus, HandoffHandle, HandoffRequest, HandoffResponse, HandoffStatus
from handoffbus.routing import set_id
from handoffbus.workers import Accept, Agent, AgentState, ReceivedHandoff, Reject
from handoffbus.workers.inbox import Inbox
from handoffbus.workers.routes import RouteFeed

from .conftest import make_bus
from .helpers import first_call_fails, response_statuses, routed, serving

pytestmark = pytest.mark.anyio
S = HandoffStatus


class Specialist(Agent):
    """A capable agent: accepts, or refuses with ``refuse`` (a Reject) when one is set."""

    refuse: Reject | None = None

    def __init__(self, agent_id: str, capabilities: Sequence[str], refuse: Reject | None = None) -> None:
        super().__init__()
        self.agent_id = agent_id  # type: ignore[misc]
        self.capabilities = list(capabilities)  # type: ignore[misc]
        self.refuse = refuse
        self.seen: list[str] = []
        self.order: list[str] = []

    async def on_handoff_request(self, request: HandoffRequest) -> Accept | Reject:
        self.seen.append(request.request_id)
        return self.refuse or Accept()

    async def on_handoff_received(self, handoff: ReceivedHandoff) -> Any:
        self.order.append(handoff.request.reason)
        return {"by": self.agent_id}


async def outcomes(handles: Sequence[HandoffHandle], limit: float = 30) -> list[HandoffResponse]:
    with anyio.fail_after(limit):
        return [await h.outcome() for h in handles]


async def test_a_routed_request_goes_to_an_agent_with_every_capability(bus: HandoffBus) -> None:
    narrow, wide = Specialist("narrow-1", ["code_review"]), Specialist("wide-1", ["code_review", "security"])
    client = bus.client("req")
    async with serving(bus, narrow, wide):
        handle = await client.request_handoff(routed(["security", "code_review", "security"]))
        [outcome] = await outcomes([handle])
    assert outcome.status is S.COMPLETED and outcome.result == {"by": "wide-1"}
    assert narrow.seen == []
    record = await client.get_handoff_status(handle.handoff_id)
    assert [(s.agent, s.event) for s in record.route] == [("wide-1", "OFFERED")]
    assert await response_statuses(bus, "req", handle.handoff_id) == ["ACCEPTED", "COMPLETED"]


async def test_fallback_chain_is_followed_and_recorded(bus: HandoffBus) -> None:
    no = Reject(reason="not today", code="TOO_BUSY")
    agents = [Specialist("spec-a", ["x"], no), Specialist("spec-b", ["x"], no), Specialist("spec-c", ["x"])]
    client = bus.client("req")
    async with serving(bus, *agents):
        handles = [await client.request_handoff(routed(["x"])) for _ in range(10)]
        results = await outcomes(handles)
    assert {(o.status, o.result["by"]) for o in results} == {(S.COMPLETED, "spec-c")}
    for handle in handles:
        route = (await client.get_handoff_status(handle.handoff_id)).route
        offered = [s.agent for s in route if s.event == "OFFERED"]
        assert offered[-1] == "spec-c" and len(offered) == len(set(offered))  # never offered twice
        assert [s.agent for s in route if s.event == "REFUSED"] == offered[:-1]
        assert all(s.code == "TOO_BUSY" for s in route if s.event == "REFUSED")
        # refusals are the router's business: the requester hears one decision and one outcome
        assert await response_statuses(bus, "req", handle.handoff_id) == ["ACCEPTED", "COMPLETED"]


async def test_no_capable_agent_left_ends_rejected_with_the_refusers(bus: HandoffBus) -> None:
    no = Reject(reason="no", code="NOPE")
    agents = [Specialist("spec-a", ["x", "y"], no), Specialist("spec-b", ["x", "y", "z"], no),
              Specialist("spec-c", ["y"])]  # spec-c lacks x: never offered
    client = bus.client("req")
    async with serving(bus, *agents):
        [outcome] = await outcomes([await client.request_handoff(routed(["x", "y"]))])
    assert outcome.status is S.REJECTED and outcome.rejection_code == "NO_CAPABLE_AGENT"
    assert outcome.actor == "_router" and sorted(outcome.metadata["refused"]) == ["spec-a", "spec-b"]
    assert agents[2].seen == []


async def test_fail_fast_rejects_at_once_and_otherwise_a_late_agent_gets_the_work(bus: HandoffBus) -> None:
    client = bus.client("req")
    fast = await client.request_handoff(routed(["rare"]), fail_fast=True)
    [decided] = await outcomes([fast], limit=5)
    assert decided.status is S.REJECTED and decided.rejection_code == "NO_CAPABLE_AGENT"
    waiting = await client.request_handoff(routed(["rare"]))
    assert (await waiting.status()).status is S.PENDING
    late = Specialist("late-1", ["rare", "other"])
    async with serving(bus, late):
        [outcome] = await outcomes([waiting])
    assert outcome.status is S.COMPLETED and outcome.result == {"by": "late-1"}


async def test_redirect_to_a_capable_live_agent_is_honoured(bus: HandoffBus) -> None:
    first = Specialist("first-1", ["x"], Reject(reason="ask the expert", code="REDIRECT", redirect_to="expert-1"))
    expert = Specialist("expert-1", ["x"])
    expert.state = AgentState.BUSY  # it pulls no routed work itself: only a redirect reaches it
    client = bus.client("req")
    async with serving(bus, first, expert):
        [outcome] = await outcomes([await client.request_handoff(routed(["x"]))])
        record = await client.get_handoff_status(outcome.handoff_id)
    assert outcome.result == {"by": "expert-1"}
    assert [(s.agent, s.event) for s in record.route] == [
        ("first-1", "OFFERED"), ("first-1", "REFUSED"), ("expert-1", "OFFERED")]


async def test_retry_after_defers_the_next_offer_to_that_agent(bus: HandoffBus) -> None:
    class Later(Specialist):
        async def on_handoff_request(self, request: HandoffRequest) -> Accept | Reject:
            self.seen.append(request.request_id)
            if len(self.seen) == 1:
                return Reject(reason="in a moment", code="LATER", retry_after_ms=200)
            return Accept()

    agent = Later("only-1", ["x"])
    client = bus.client("req")
    async with serving(bus, agent):
        [outcome] = await outcomes([await client.request_handoff(routed(["x"]))])
        record = await client.get_handoff_status(outcome.handoff_id)
    assert outcome.status is S.COMPLETED and len(agent.seen) == 2
    events = [(s.event, s.code) for s in record.route]
    assert events == [("OFFERED", ""), ("DEFERRED", "LATER"), ("OFFERED", "")]
    deferred, reoffered = record.route[1].at_ms, record.route[2].at_ms
    assert reoffered - deferred >= 200


async def test_a_refusal_sent_on_is_not_settled_again_by_the_worker(
    bus: HandoffBus, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Refused and sent on, a routed handoff leaves the refusing agent's inbox then and there;
    the worker does not settle it by its id again later, which could take the entry of its
    next delivery to this agent (it came back here: the only capable agent, retrying at once)."""
    settled: list[str] = []
    take = Inbox.take

    async def recording(inbox: Inbox, count: int, settle: Iterable[str] = ()) -> Any:
        settle = list(settle)
        settled.extend(settle)
        return await take(inbox, count, settle)

    monkeypatch.setattr(Inbox, "take", recording)

    class Later(Specialist):
        async def on_handoff_request(self, request: HandoffRequest) -> Accept | Reject:
            self.seen.append(request.request_id)
            return Reject(reason="in a moment", retry_after_ms=0) if len(self.seen) == 1 else Accept()

    agent = Later("only-1", ["x"])
    async with serving(bus, agent):
        [outcome] = await outcomes([await bus.client("req").request_handoff(routed(["x"]))])
    assert outcome.status is S.COMPLETED and len(agent.seen) == 2
    assert settled == [outcome.handoff_id]  # once: after its second delivery was completed


async def test_a_lapsed_offer_whose_rerouting_was_lost_is_routed_again(
    backend: str, servers: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sweep takes back a lapsed offer, then the sweeping bus dies (or its connection
    drops) before it routes the handoff again: the guard the sweep leaves routes it once more,
    instead of nothing until its deadline."""
    async with make_bus(backend, servers, offer_time=0.2, route_guard=0.3) as bus:
        handle = await bus.client("req").request_handoff(routed(["x"], timeout=60.0))
        feed = RouteFeed(bus, "dead-1", ["x"], "w1")
        await feed.refresh()
        assert [d.handoff_id for d in await feed.pull(1)] == [handle.handoff_id]  # offered; never decided
        first_one_lost, lost = first_call_fails(bus.router.reroute, RedisConnectionError("connection lost"))
        monkeypatch.setattr(bus.router, "reroute", first_one_lost)
        queue = bus.keys.route(set_id("x")).queue
        with anyio.fail_after(10):
            while not lost.is_set() or await bus.redis.zscore(queue, handle.handoff_id) is None:
                await bus.sweeper.wait_pass()
        record = await handle.status()
        assert record is not None and record.status is S.PENDING
        assert [(s.agent, s.event) for s in record.route] == [("dead-1", "OFFERED"), ("dead-1", "LAPSED")]


async def test_a_lapsed_offer_leaves_nothing_in_flight_at_an_agent_that_is_gone(
    backend: str, servers: dict
) -> None:
    """An agent's only worker pulled a routed handoff into the agent's inbox and died; its
    offer lapsed and another agent finished the handoff. No worker of the dead agent will ever
    reclaim that inbox entry: the handoff must not stay in flight there for ever (in the
    agent's in-flight index, pending entries list and ``max_queued`` count)."""
    async with make_bus(backend, servers, offer_time=0.2) as bus:
        handle = await bus.client("req").request_handoff(routed(["x"], timeout=60.0))
        feed = RouteFeed(bus, "dead-1", ["x"], "w1")
        await feed.refresh()
        assert [d.handoff_id for d in await feed.pull(1)] == [handle.handoff_id]  # in dead-1's inbox; never decided
        live = Specialist("live-1", ["x"])
        async with serving(bus, live):
            [outcome] = await outcomes([handle])
        assert outcome.result == {"by": "live-1"}
        for _ in range(2):  # settled by then, or by a sweep soon after
            await bus.sweeper.wait_pass()
        keys = bus.keys.target("dead-1")
        assert await bus.redis.hgetall(keys.inflight) == {}
        assert await bus.redis.xlen(keys.inbox) == 0


async def test_a_routed_request_nobody_can_take_expires(bus: HandoffBus) -> None:
    handle = await bus.client("req").request_handoff(routed(["nobody-has-this"], timeout=0.2))
    [outcome] = await outcomes([handle], limit=10)
    assert outcome.status is S.EXPIRED


async def test_an_offer_the_chosen_agent_never_decides_is_routed_again(real_backend: str, servers: dict) -> None:
    class Frozen(Specialist):
        """Takes the offer, then hangs in its acceptance hook (as a dead or stuck agent would)."""

        def __init__(self) -> None:
            super().__init__("frozen-1", ["x"])
            self.holding = anyio.Event()
            self.thaw = anyio.Event()

        async def on_handoff_request(self, request: HandoffRequest) -> Accept | Reject:
            self.holding.set()
            await self.thaw.wait()
            return Accept()

    async with make_bus(real_backend, servers, offer_time=0.3) as bus:
        frozen, healthy = Frozen(), Specialist("healthy-1", ["x"])
        healthy.state = AgentState.BUSY  # pulls nothing until the frozen agent holds the offer
        client = bus.client("req")
        async with serving(bus, frozen, healthy):
            handle = await client.request_handoff(routed(["x"]))
            with anyio.fail_after(10):
                await frozen.holding.wait()
            healthy.state = AgentState.RUNNABLE
            [outcome] = await outcomes([handle])
            frozen.thaw.set()  # too late: its offer lapsed; its accept is refused and dropped
        record = await client.get_handoff_status(handle.handoff_id)
        assert await response_statuses(bus, "req", handle.handoff_id) == ["ACCEPTED", "COMPLETED"]
    assert outcome.result == {"by": "healthy-1"}
    assert [(s.agent, s.event) for s in record.route] == [
        ("frozen-1", "OFFERED"), ("frozen-1", "LAPSED"), ("healthy-1", "OFFERED")]


async def test_priority_order_holds_within_a_capability_set(bus: HandoffBus) -> None:
    client = bus.client("req")
    priorities = [5, 1, 9, 1, 0, 5, 3, -2]
    handles = [await client.request_handoff(routed(["x"], priority=p, reason=f"r{i}"))
               for i, p in enumerate(priorities)]
    agent = Specialist("one-1", ["x"])
    async with serving(bus, agent, concurrency=1):
        await outcomes(handles)
    assert agent.order == [f"r{i}" for i in sorted(range(len(priorities)), key=lambda i: (priorities[i], i))]


async def test_equal_agents_get_comparable_shares(real_bus: HandoffBus) -> None:
    """On real servers only: shares follow how soon each agent's worker runs after a ring,
    and the in-memory server runs its scripts inside the test's own event loop, so a stall
    of that loop (as under a loaded CI host) decides shares there, not routing."""
    bus = real_bus
    class Working(Specialist):
        async def on_handoff_received(self, handoff: ReceivedHandoff) -> Any:
            await anyio.sleep(0.002)  # simulated work, so that every agent is kept busy
            return await super().on_handoff_received(handoff)

    agents = [Working(f"peer-{i}", ["x"]) for i in range(4)]
    client = bus.client("req")
    async with serving(bus, *agents, concurrency=2):
        handles = [await client.request_handoff(routed(["x"])) for _ in range(400)]
        results = await outcomes(handles, limit=60)
    shares = Counter(o.result["by"] for o in results)
    assert sum(shares.values()) == 400 and len(shares) == 4
    assert min(shares.values()) >= 400 / 4 / 2, shares  # no agent gets less than half its fair share


async def test_ageing_bounds_how_long_a_low_priority_request_waits(real_backend: str, servers: dict) -> None:
    """A priority-10 request is overtaken only by priority-0 requests made less than
    10 x route_age_step after it; later ones, however many, queue behind it."""
    async with make_bus(real_backend, servers, route_age_step=0.05) as bus:
        client = bus.client("req")
        low = await client.request_handoff(routed(["x"], priority=10, reason="low"))
        created = (await low.status()).created_ms
        early = [await client.request_handoff(routed(["x"], reason=f"early{i}")) for i in range(50)]
        # a timer, not synchronisation: the bound is 10 x 50 ms = 500 ms after "low" was made
        await anyio.sleep(max(0.0, created + 600 - await bus.server_time_ms()) / 1000)
        late = [await client.request_handoff(routed(["x"], reason=f"late{i}")) for i in range(50)]
        for handle in early:
            assert (await handle.status()).created_ms < created + 500
        agent = Specialist("one-1", ["x"])
        async with serving(bus, agent, concurrency=1):
            await outcomes([low, *early, *late])
    # strict priority would serve "low" last; ageing serves it before everything made after its bound
    assert agent.order == [f"early{i}" for i in range(50)] + ["low"] + [f"late{i}" for i in range(50)]
