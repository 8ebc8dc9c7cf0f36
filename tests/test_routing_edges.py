"""Edges of routing and of the expiry sweep: a requester whose sweep fails does not hold up the
others; a record without a history still expires; a routed handoff queued both in its set and
in an agent's own queue is delivered once; entries an agent may not take hide no work behind
them; FIFO within a priority holds however many requests fall in one millisecond; expired
routed handoffs leave their set's queue."""

from __future__ import annotations

import json
from typing import Any

import anyio
import pytest
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisClusterException

from handoffbus import HandoffBus, HandoffExpired, HandoffRequest, HandoffStatus, InvalidRequest
from handoffbus.client import HandoffClient
from handoffbus.keys import GROUP
from handoffbus.routing import Reroute, deferred_until, set_id
from handoffbus.workers import Accept, AgentState, Reject, Worker
from handoffbus.workers.inbox import Inbox
from handoffbus.workers.routes import SCAN, RouteFeed

from .conftest import make_bus
from .helpers import first_call_fails, live, req, routed, serving
from .test_routing import Specialist, outcomes

pytestmark = pytest.mark.anyio
S = HandoffStatus


# ---------------------------------------------------------------------- the expiry sweep


async def test_a_guard_whose_routing_by_the_sweep_failed_is_set_again(
    backend: str, servers: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A requester died between its record and its routing, and when the guard fired, the
    sweep's routing failed too (the set's node out of reach during a failover): the guard was
    gone, and the handoff waited in no queue until its deadline. The sweep sets it again."""
    async with make_bus(backend, servers, route_guard=0.2) as bus:
        async def no_route(*args: Any) -> list[Any]:
            return []  # the requester died before its route call

        monkeypatch.setattr(HandoffClient, "_route_calls", no_route)
        handle = await bus.client("req").request_handoff(routed(["x"], timeout=60.0))
        monkeypatch.undo()
        first_one_lost, lost = first_call_fails(bus.router.reroute,
                                                RedisConnectionError("the set's node is out of reach"))
        monkeypatch.setattr(bus.router, "reroute", first_one_lost)
        queue = bus.keys.route(set_id("x")).queue
        guard = f"o:{handle.request_id}"
        with anyio.fail_after(10):
            await lost.wait()
            await bus.sweeper.wait_pass()  # the pass whose routing failed
            assert await bus.redis.zscore(bus.keys.deadlines("req"), guard) is not None  # set again
            while await bus.redis.zscore(queue, handle.handoff_id) is None:
                await bus.sweeper.wait_pass()
        assert await bus.redis.zscore(bus.keys.deadlines("req"), guard) is None  # routed: fired once more
        async with serving(bus, Specialist("cap-1", ["x"])):
            [outcome] = await outcomes([handle], limit=10)
        assert outcome.status is S.COMPLETED


async def test_a_pull_with_fewer_free_slots_than_sets_finds_the_backlog_of_any(backend: str, servers: dict) -> None:
    """A worker with one free slot and two sets asked one set per pull, in turn: the empty one
    half the time, and the worker then waited for its doorbell (a second) with the other's
    backlog untouched."""
    async with make_bus(backend, servers) as bus:
        await bus.router.register_set("x")
        handles = [await bus.client("req").request_handoff(routed(["y"])) for _ in range(4)]
        feed = RouteFeed(bus, "both-1", ["x", "y"], "w1")
        await feed.refresh()
        assert sorted(feed.sets.values()) == ["x", "y"]
        pulled = [[d.handoff_id for d in await feed.pull(1)] for _ in range(4)]
        assert pulled == [[h.handoff_id] for h in handles]  # every pull, whichever set came first


async def test_routed_work_and_running_workers_are_found_again_after_clear_all_handoffs(
    backend: str, servers: dict
) -> None:
    """``clear_all_handoffs`` deletes the registries: the requester's process must register its
    capability set again (workers learn sets only there), and a running worker its agent."""
    async with make_bus(backend, servers) as bus:
        client = bus.client("req")
        first = await client.request_handoff(routed(["x"], timeout=5.0))
        await client.cancel_handoff(first.handoff_id)
        async with serving(bus, Specialist("cap-1", ["x"])) as [worker]:
            assert [a.agent_id for a in await client.list_agents()] == ["cap-1"]
            await client.clear_all_handoffs(confirm=bus.config.prefix)
            await worker._register()  # its next heartbeat
            assert [a.agent_id for a in await client.list_agents()] == ["cap-1"]
            handle = await client.request_handoff(routed(["x"], timeout=10.0), fail_fast=True)
            [outcome] = await outcomes([handle], limit=10)
        assert outcome.status is S.COMPLETED


async def test_a_routed_entry_whose_lists_hold_a_bar_stalls_no_set(
    backend: str, servers: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A record's refused list written by hand (or by a requester's own user) holding '|' made
    a meta no pull could read: every pull of the set failed, for every agent. Route calls now
    keep such a list out, and pulls drop an entry whose meta they cannot read."""
    async with make_bus(backend, servers) as bus:
        client = bus.client("req")
        unreadable, good = [await client.request_handoff(routed(["x"])) for _ in range(2)]
        route = bus.keys.route(set_id("x"))
        await bus.redis.hset(route.meta, unreadable.handoff_id, "1|2|a|b|c")  # written by hand

        async def no_route(*args: Any) -> list[Any]:
            return []

        monkeypatch.setattr(HandoffClient, "_route_calls", no_route)
        unrouted = await client.request_handoff(routed(["x"]))
        monkeypatch.undo()
        await bus.scripts_many([bus.router.route_call("x", unrouted.handoff_id, 0, "+60000", refused=",a|b,")])
        meta = await bus.redis.hget(route.meta, unrouted.handoff_id)
        assert meta is not None and meta.split(b"|")[2:] == [b",", b","]  # the list left out
        feed = RouteFeed(bus, "cap-1", ["x"], "w1")
        await feed.refresh()
        taken = [d.handoff_id for d in await feed.pull(5)]
        assert taken == [good.handoff_id, unrouted.handoff_id]
        assert await bus.redis.hget(route.meta, unreadable.handoff_id) is None  # dropped


async def test_a_requester_whose_sweep_fails_does_not_stop_the_sweep_of_the_others(
    real_backend: str, servers: dict
) -> None:
    """One requester's sweep script fails on every pass (its deadline index is not a sorted
    set): requesters in later batches of the requester set are swept all the same."""
    async with make_bus(real_backend, servers) as bus:
        names = [f"rq{i:03d}" for i in range(300)]
        await bus.redis.sadd(bus.keys.requesters, *names)
        order = [m.decode() async for m in bus.redis.sscan_iter(bus.keys.requesters, count=500)]
        bad, victim = order[0], order[250]  # the sweep goes in batches of 200: one in each
        await bus.redis.set(bus.keys.deadlines(bad), "not a sorted set")
        handle = await bus.client(victim).request_handoff(HandoffRequest(
            from_agent=victim, to_agent="nobody-1", reason="r", timeout=0.2))
        record = bus.keys.record(victim, handle.handoff_id.split("/")[1]).record
        with anyio.fail_after(10):  # the handle is never awaited: only the sweep expires it
            while await bus.redis.hget(record, "status") != b"EXPIRED":
                await bus.sweeper.wait_pass()


async def test_a_record_without_a_history_is_expired_by_the_sweep(real_backend: str, servers: dict) -> None:
    async with make_bus(real_backend, servers) as bus:
        keys = bus.keys.record("hand", "written")
        await bus.redis.sadd(bus.keys.requesters, "hand")
        await bus.redis.hset(keys.record, mapping={"status": "PENDING", "id": "hand/written"})
        await bus.redis.zadd(keys.deadlines, {"written": 0})
        with anyio.fail_after(10):
            while await bus.redis.hget(keys.record, "status") != b"EXPIRED":
                await bus.sweeper.wait_pass()
        [[status, actor, _]] = json.loads(await bus.redis.hget(keys.record, "hist"))
        assert (status, actor) == ("EXPIRED", "bus")
        assert await bus.redis.zcard(keys.deadlines) == 0


async def test_a_cluster_error_when_the_lease_is_handed_over_does_not_fail_the_close(
    real_backend: str, servers: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with make_bus(real_backend, servers) as bus:
        await bus.sweeper.wait_pass()

        async def unreachable() -> None:
            raise RedisClusterException("no node for the lease's slot")

        monkeypatch.setattr(bus.sweeper, "release_lease", unreachable)
    # closed without raising


async def test_expired_routed_handoffs_leave_their_sets_queue(real_backend: str, servers: dict) -> None:
    """A capability set nobody serves keeps no entries of handoffs the sweep made EXPIRED."""
    async with make_bus(real_backend, servers) as bus:
        client = bus.client("req")
        handles = [await client.request_handoff(routed(["typo-capability"], timeout=0.2)) for _ in range(20)]
        route = bus.keys.route(set_id("typo-capability"))
        assert await bus.redis.zcard(route.queue) == 20
        with anyio.fail_after(10):  # the handles are not awaited: the sweep expires them
            while await bus.redis.zcard(route.queue) or await bus.redis.hlen(route.meta):
                await bus.sweeper.wait_pass()
        for handle in handles:
            assert (await handle.status()).status is S.EXPIRED


@pytest.mark.parametrize("expired_by", ["a status read", "a resubmission", "a cancel", "a late cancel"])
async def test_routed_handoffs_expired_outside_the_sweep_leave_their_sets_queue(
    real_backend: str, servers: dict, expired_by: str
) -> None:
    """Expired by its requester's status read or resubmission before any sweep, or cancelled:
    the record leaves the deadline index, so the sweep never sees it, and a set nobody serves
    kept its entry for good."""
    async with make_bus(real_backend, servers, sweep_interval=3600) as bus:
        client = bus.client("req")
        request = routed(["typo-capability"], request_id="r1", timeout=60)
        handle = await client.request_handoff(request)
        route = bus.keys.route(set_id("typo-capability"))
        assert await bus.redis.zcard(route.queue) == 1
        if expired_by == "a cancel":
            await handle.cancel()
        else:
            await bus.redis.delete(bus.keys.record("req", "r1").marker)  # its deadline, passed
        if expired_by == "a late cancel":  # the cancel finds it past its deadline: EXPIRED now
            with pytest.raises(HandoffExpired):
                await handle.cancel()
        if expired_by in ("a status read", "a late cancel"):
            record = await client.get_handoff_status(handle.handoff_id)
        else:
            record = await (await client.request_handoff(request)).status()
        assert record is not None and record.status is (S.CANCELLED if expired_by == "a cancel" else S.EXPIRED)
        assert await bus.redis.zcard(route.queue) == 0 and await bus.redis.hlen(route.meta) == 0


class SlowDecider(Specialist):
    async def on_handoff_request(self, request: HandoffRequest) -> Accept | Reject:
        self.seen.append(request.request_id)
        await anyio.sleep(0.8)  # a slow acceptance hook (simulated work, not synchronisation)
        return Accept()


async def test_a_redirect_is_offered_for_the_targets_own_offer_time(real_backend: str, servers: dict) -> None:
    """The refusing process assigns a redirect: with its own bus's offer time (0.3 s) the offer
    lapsed while the target's acceptance hook ran, though the target's workers run with
    --offer-time 10. The workers publish theirs, and a redirect uses it."""
    async with make_bus(real_backend, servers, offer_time=0.3) as bus_a, \
            make_bus(real_backend, servers, prefix=bus_a.keys.prefix, offer_time=10) as bus_r:
        first = Specialist("first-1", ["x"], Reject(reason="ask the expert", code="REDIRECT", redirect_to="expert-1"))
        expert = SlowDecider("expert-1", ["x"])
        expert.state = AgentState.BUSY  # pulls no routed work itself: only the redirect reaches it
        async with serving(bus_a, first), serving(bus_r, expert):
            handle = await bus_a.client("req").request_handoff(routed(["x"], timeout=30))
            [outcome] = await outcomes([handle])
        record = await bus_a.client("req").get_handoff_status(handle.handoff_id)
    assert record is not None and outcome.status is S.COMPLETED and len(expert.seen) == 1
    assert [(step.agent, step.event) for step in record.route] == [
        ("first-1", "OFFERED"), ("first-1", "REFUSED"), ("expert-1", "OFFERED")]


# ---------------------------------------------------------------------- delivered once


async def test_a_handoff_pulled_while_also_in_the_agents_queue_is_delivered_once(
    real_backend: str, servers: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Redirected to spec-r by a slow refuser while the routing guard had also queued it in its
    set: one worker of spec-r pulls it from the set, another takes it from spec-r's queue."""
    async with make_bus(real_backend, servers, route_guard=0.1) as bus:
        for agent, consumer in [("spec-a", "a1"), ("spec-r", "r1"), ("spec-r", "r2")]:
            await live(bus, agent, consumer)
        handle = await bus.client("req").request_handoff(routed(["x"], timeout=60))
        hid = handle.handoff_id
        feed_a = RouteFeed(bus, "spec-a", ["x"], "a1")
        await feed_a.refresh()
        assert [d.handoff_id for d in await feed_a.pull(1)] == [hid]
        queue, reroute = bus.keys.route(set_id("x")).queue, bus.router.reroute

        async def slow_refuser(items: Any) -> Any:  # sends the redirect on after the guard routed it
            if any(item.redirect for item in items):
                with anyio.fail_after(10):
                    while await bus.redis.zscore(queue, hid) is None:
                        await bus.sweeper.wait_pass()
            return await reroute(items)

        monkeypatch.setattr(bus.router, "reroute", slow_refuser)
        await bus.client("spec-a").reject_handoff(hid, "ask R", code="REDIRECT", redirect_to="spec-r")
        assert await bus.redis.zscore(bus.keys.target("spec-r").queue, hid) is not None
        feed_r2 = RouteFeed(bus, "spec-r", ["x"], "r2")
        await feed_r2.refresh()
        pulled = await feed_r2.pull(1)
        _, taken = await Inbox(bus, "spec-r", "r1").take(1)
        assert [d.handoff_id for d in pulled + taken] == [hid]
        pending = await bus.redis.xpending_range(bus.keys.target("spec-r").inbox, GROUP, "-", "+", 10)
        assert [p["consumer"] for p in pending] == [b"r2"]


async def test_admit_takes_the_handoff_out_of_the_agents_queue(real_bus: HandoffBus) -> None:
    bus = real_bus
    keys = bus.keys.target("spec-r").as_list()
    assert await bus.script("enqueue", keys, ["req/1", 0, 0]) == 1
    [hid, _] = await bus.script("admit", keys, [GROUP, "r2", "req/1"])
    assert hid == b"req/1"
    assert await bus.redis.zscore(bus.keys.target("spec-r").queue, "req/1") is None


async def test_take_does_not_deliver_a_queued_handoff_already_in_flight(real_bus: HandoffBus) -> None:
    """A queue entry for a handoff in flight (left by an earlier version's admit) is dropped,
    and the take fills its place from the rest of the queue."""
    bus = real_bus
    target = bus.keys.target("spec-r")
    await bus.script("admit", target.as_list(), [GROUP, "r2", "req/1"])
    await bus.redis.zadd(target.queue, {"req/1": 0})  # as an enqueue racing an older admit left it
    assert await bus.script("enqueue", target.as_list(), ["req/2", 5, 0]) == 1
    _, taken = await Inbox(bus, "spec-r", "r1").take(1)
    assert [d.handoff_id for d in taken] == ["req/2"]
    assert await bus.redis.zcard(target.queue) == 0
    assert await bus.redis.xlen(target.inbox) == 2  # req/1 once (r2's), req/2


# ---------------------------------------------------------------------- a stopping worker


async def test_a_routed_handoff_a_stopping_worker_hands_back_goes_to_another_capable_agent(
    real_backend: str, servers: dict
) -> None:
    """A worker stopped while its acceptance hook held a routed handoff handed it back to its
    own agent's queue, still offered to that agent: with no other worker of it running, the
    handoff waited out the offer (30 s) while another capable agent sat idle. It is released
    back to its set at once."""

    class Stuck(Specialist):
        def __init__(self) -> None:
            super().__init__("stuck-a", ["x"])
            self.holding = anyio.Event()

        async def on_handoff_request(self, request: HandoffRequest) -> Accept | Reject:
            self.holding.set()
            await anyio.sleep_forever()
            raise AssertionError("unreachable")

    async with make_bus(real_backend, servers) as bus:
        client = bus.client("req")
        handle = await client.request_handoff(routed(["x"], timeout=60))
        stuck = Stuck()
        async with serving(bus, stuck, grace=0.05):
            with anyio.fail_after(10):
                await stuck.holding.wait()
        async with serving(bus, Specialist("other-b", ["x"])):
            [outcome] = await outcomes([handle], limit=10)  # well within the offer time
        record = await client.get_handoff_status(handle.handoff_id)
        stuck_keys = bus.keys.target("stuck-a")
        assert await bus.redis.zcard(stuck_keys.queue) == 0 and await bus.redis.hlen(stuck_keys.inflight) == 0
    assert outcome.status is S.COMPLETED and outcome.result == {"by": "other-b"}
    assert [(s.agent, s.event) for s in record.route] == [
        ("stuck-a", "OFFERED"), ("stuck-a", "RELEASED"), ("other-b", "OFFERED")]


class _Holding(Specialist):
    """Holds its acceptance hook until ``gate`` opens (for ever if never); counts hooks and works."""

    def __init__(self, agent_id: str, gate: anyio.Event | None = None) -> None:
        super().__init__(agent_id, ["x"])
        self.gate = gate or anyio.Event()
        self.holding = anyio.Event()
        self.hooked = self.works = 0

    async def on_handoff_request(self, request: HandoffRequest) -> Accept | Reject:
        self.hooked += 1
        self.holding.set()
        await self.gate.wait()
        return Accept()

    async def on_handoff_received(self, handoff: Any) -> Any:
        self.works += 1
        return {"by": self.agent_id}


async def test_a_release_in_a_rolling_restart_is_not_final(real_backend: str, servers: dict) -> None:
    """ref-b refused; stuck-a, the only other capable agent, is restarted while its hook holds
    the handoff (its worker says DRAINING: no capable agent is live). The release routed it on
    as a refusal would, and with every live capable agent refusing it, made it REJECTED
    (NO_CAPABLE_AGENT). A release sends it back to its set whoever is live, and so does the
    sweep when the release's routing guard fires before the agent is back."""
    async with make_bus(real_backend, servers, route_guard=0.3) as bus:
        client = bus.client("req")
        await live(bus, "stuck-a", "ghost")  # capable while ref-b refuses: the refusal routes it on
        handle = await client.request_handoff(routed(["x"], timeout=60))
        refuser = Specialist("ref-b", ["x"], refuse=Reject(reason="no", code="NO"))
        async with serving(bus, refuser):
            with anyio.fail_after(10):
                while not any(s.event == "REFUSED" for s in (await client.get_handoff_status(handle.handoff_id)).route):
                    await bus.sweeper.wait_pass()
        await bus.redis.hdel(bus.keys.workers("stuck-a"), "ghost")
        stuck = _Holding("stuck-a")
        async with serving(bus, stuck, grace=2.0):  # its beat says DRAINING during the grace
            with anyio.fail_after(10):
                await stuck.holding.wait()
        after_drain = await client.get_handoff_status(handle.handoff_id)
        with anyio.fail_after(10):  # the restart takes longer than the guard: it fires
            while await bus.redis.zscore(bus.keys.deadlines("req"), f"o:{handle.request_id}") is not None:
                await bus.sweeper.wait_pass()
            await bus.sweeper.wait_pass()  # and the pass that fired it has routed it
        after_guard = await client.get_handoff_status(handle.handoff_id)
        async with serving(bus, Specialist("stuck-a", ["x"])):  # the restarted worker
            [outcome] = await outcomes([handle], limit=10)
    assert after_drain.status is S.PENDING and after_drain.route[-1].event == "RELEASED"
    assert after_guard.status is S.PENDING
    assert outcome.status is S.COMPLETED and outcome.result == {"by": "stuck-a"}


async def test_a_stop_leaves_a_routed_handoff_another_worker_of_its_agent_claimed(
    real_backend: str, servers: dict
) -> None:
    """w1 was slow in its hook, and w2 (the same agent) claimed its entry and runs the hook now;
    then w1 stops. Its release settled w2's entry and routed the handoff again: w2 pulled it a
    second time, and the work ran twice. The stop now leaves it to w2."""
    async with make_bus(real_backend, servers) as bus:
        client = bus.client("req")
        handle = await client.request_handoff(routed(["x"], timeout=60))
        gate = anyio.Event()
        slow, claimer = _Holding("a"), _Holding("a", gate)
        async with anyio.create_task_group() as tg:
            async with serving(bus, slow, grace=0.05, reclaim_idle=30, consumer="w1"):
                with anyio.fail_after(10):
                    await slow.holding.wait()
                w2 = Worker(bus, claimer, reclaim_idle=0.3, consumer="w2")
                await tg.start(w2.run)
                with anyio.fail_after(10):
                    await claimer.holding.wait()  # w2 claimed w1's idle entry and runs its hook
            stopped = await client.get_handoff_status(handle.handoff_id)  # w1 has wound down
            gate.set()
            [outcome] = await outcomes([handle], limit=10)
            w2.drain()
    assert [(s.agent, s.event) for s in stopped.route] == [("a", "OFFERED")]
    assert outcome.status is S.COMPLETED and (claimer.hooked, claimer.works) == (1, 1)


async def test_a_release_changes_nothing_unless_the_handoff_is_offered_to_the_releasing_agent(
    real_bus: HandoffBus
) -> None:
    bus, client = real_bus, real_bus.client("req")
    direct = await client.request_handoff(HandoffRequest(from_agent="req", to_agent="spec-a", reason="r"))
    offered = await client.request_handoff(routed(["x"], timeout=60))
    [assigned] = await bus.scripts_many([bus.router.assign_call(offered.handoff_id, "spec-a")])
    assert assigned == [1]
    before = await client.get_handoff_status(offered.handoff_id)
    assert not await bus.router.release("spec-a", direct.handoff_id)  # not routed
    assert not await bus.router.release("spec-b", offered.handoff_id)  # offered to spec-a, not spec-b
    assert await client.get_handoff_status(offered.handoff_id) == before
    assert (await client.get_handoff_status(direct.handoff_id)).route == ()
    assert await bus.router.release("spec-a", offered.handoff_id)
    after = await client.get_handoff_status(offered.handoff_id)
    assert after.status is S.PENDING and [s.event for s in after.route] == ["OFFERED", "RELEASED"]
    assert await bus.redis.zscore(bus.keys.route(set_id("x")).queue, offered.handoff_id) is not None  # sent on
    assert not await bus.router.release("spec-a", offered.handoff_id)  # once


# ---------------------------------------------------------------------- deferrals that passed


async def test_an_agent_whose_deferral_passed_is_rung_and_may_be_redirected_to(real_bus: HandoffBus) -> None:
    """A deferral that has passed no longer holds an agent back: routing on rang every capable
    agent but one deferred at any time (it was woken only by its block timeout), and ignored a
    redirect to it. A deferral still running does both, as before."""
    bus = real_bus
    for agent in ("spec-a", "spec-b"):
        await live(bus, agent, f"{agent}-w")
    client = bus.client("req")
    bells = [bus.keys.target(agent).bell for agent in ("spec-a", "spec-b")]
    now = await bus.server_time_ms()

    async def rung(deferred_until: int, redirect: str | None = None) -> tuple[list[int], str | None]:
        handle = await client.request_handoff(routed(["x"], timeout=60))
        await bus.redis.delete(*bells)  # the request's own rings
        await bus.router.reroute([Reroute(handle.handoff_id, "x", 0, now, now + 60000, ",",
                                          f",spec-a={deferred_until},", redirect)])
        record = await client.get_handoff_status(handle.handoff_id)
        assert record is not None
        offered = [s.agent for s in record.route if s.event == "OFFERED"]
        return [await bus.redis.xlen(bell) for bell in bells], offered[-1] if offered else None

    assert await rung(now - 1000) == ([1, 1], None)
    assert await rung(now + 60000) == ([0, 1], None)
    assert (await rung(now - 1000, "spec-a"))[1] == "spec-a"
    assert (await rung(now + 60000, "spec-a"))[1] is None  # the queue decides


async def test_a_worker_pulls_only_the_sets_its_agent_was_granted(real_bus: HandoffBus) -> None:
    """With grants set, "every bus routes an agent only what it both claims and was granted, and
    an agent with no grant nothing" (README): a worker on a bus of its own (not isolated) of an
    agent that claims x, granted none, pulled x's handoffs and was offered them."""
    bus = real_bus
    await bus.redis.hset(bus.keys.grants, mapping={"spec-b": "x"})
    handle = await bus.client("req").request_handoff(routed(["x"]))
    ungranted, granted = RouteFeed(bus, "spec-a", ["x"], "a1"), RouteFeed(bus, "spec-b", ["x"], "b1")
    for feed in (ungranted, granted):
        await feed.refresh()
    assert await ungranted.pull(4) == []
    assert [d.handoff_id for d in await granted.pull(4)] == [handle.handoff_id]
    record = await handle.status()
    assert record is not None and [(s.agent, s.event) for s in record.route] == [("spec-b", "OFFERED")]


# ---------------------------------------------------------------------- head of line


async def route_entries(bus: HandoffBus, ids: list[str], refused: str) -> None:
    config = bus.config
    replies = await bus.scripts_many([
        ("route", bus.keys.route(set_id("x")).as_list(),
         [hid, 0, "+60000", refused, ",", int(config.route_age_step * 1000), 0]) for hid in ids
    ])
    assert replies == [1] * len(ids)


async def pull(bus: HandoffBus, agent: str, count: int) -> list[bytes]:
    reply = await bus.script("pull", bus.keys.route(set_id("x")).as_list(), [agent, count, 10_000, SCAN])
    return list(reply[2:])


async def test_a_pull_reads_past_entries_the_agent_may_not_take(real_bus: HandoffBus) -> None:
    bus = real_bus
    await route_entries(bus, [f"req/hard{i}" for i in range(3 * SCAN)], ",picky-a,")
    await route_entries(bus, ["req/easy"], ",")
    assert await pull(bus, "picky-a", 2) == [b"req/easy"]
    assert await bus.redis.zcard(bus.keys.route(set_id("x")).queue) == 3 * SCAN  # the others stay


async def test_a_pull_reads_a_bounded_part_of_the_queue(real_bus: HandoffBus) -> None:
    """Sixteen windows at most: what lies further back waits for the entries ahead of it to go."""
    bus = real_bus
    await route_entries(bus, [f"req/hard{i}" for i in range(16 * SCAN)], ",picky-a,")
    await route_entries(bus, ["req/easy"], ",")
    assert await pull(bus, "picky-a", 1) == []
    assert await pull(bus, "other-1", 1) == [b"req/hard0"]
    assert await pull(bus, "picky-a", 1) == [b"req/easy"]


async def test_an_idle_agent_gets_routed_work_queued_behind_what_it_refused(
    real_backend: str, servers: dict
) -> None:
    """picky-a refuses the first 64 handoffs, which then wait for slow-b (live, capable, busy);
    a handoff picky-a would take, routed behind them, still reaches it."""
    n_hard = SCAN

    class Picky(Specialist):
        def __init__(self, agent_id: str) -> None:
            super().__init__(agent_id, ["x"])
            self.refused_all = anyio.Event()

        async def on_handoff_request(self, request: HandoffRequest) -> Accept | Reject:
            self.seen.append(request.reason)
            if self.seen.count("hard") == n_hard:
                self.refused_all.set()
            return Reject(reason="not mine", code="NOT_MINE") if request.reason == "hard" else Accept()

    async with make_bus(real_backend, servers) as bus:
        picky, slow = Picky("picky-a"), Specialist("slow-b", ["x"])
        slow.state = AgentState.BUSY  # pulls nothing: the hard ones wait for it
        client = bus.client("req")
        async with serving(bus, picky, slow):
            hard = [await client.request_handoff(routed(["x"], reason="hard", timeout=60)) for _ in range(n_hard)]
            queue = bus.keys.route(set_id("x")).queue
            with anyio.fail_after(10):
                await picky.refused_all.wait()
                while await bus.redis.zcard(queue) < n_hard:  # the last refusals are sent on
                    await bus.sweeper.wait_pass()
            easy = await client.request_handoff(routed(["x"], reason="easy", timeout=5))
            [outcome] = await outcomes([easy], limit=10)
            for handle in hard:
                await client.cancel_handoff(handle.handoff_id)
    assert outcome.status is S.COMPLETED and outcome.result == {"by": "picky-a"}


# ---------------------------------------------------------------------- FIFO order


async def test_fifo_within_a_priority_holds_past_1024_routes_in_a_millisecond(real_bus: HandoffBus) -> None:
    """The set's counter stands where 1020 routes in this millisecond would leave it; eight more
    in one pipeline (one millisecond, mostly) are queued in the order they were routed."""
    bus = real_bus
    route = bus.keys.route(set_id("x"))
    step = int(bus.config.route_age_step * 1000)
    for _ in range(20):  # each round most likely runs within one millisecond
        await bus.redis.delete(route.queue, route.meta)
        now = await bus.server_time_ms()
        await bus.redis.set(route.seq, now * 1024 + 1020)
        ids = [f"req/r{i}" for i in range(8)]
        await bus.scripts_many([("route", route.as_list(), [hid, 3, "+60000", ",", ",", step, 0]) for hid in ids])
        queued = [m.decode() for m in await bus.redis.zrange(route.queue, 0, -1)]
        assert queued == ids


async def test_fifo_within_a_priority_holds_at_every_route_age_step_accepted(real_backend: str, servers: dict) -> None:
    """A routed score, (requested + priority x step) x 1024 + n, is a double: past 2^53 the ticks
    of one millisecond share a score and the members' names decide, not the order they were
    routed in. A step that large (a year, ten: accepted, for "stricter priority") is refused;
    every step accepted keeps FIFO at priorities +-1000."""
    for days in (1, 30, 365, 3650):
        try:
            bus = make_bus(real_backend, servers, route_age_step=days * 86400.0)
        except InvalidRequest:
            assert days > 30
            continue
        async with bus:
            route = bus.keys.route(set_id("x"))
            step = int(bus.config.route_age_step * 1000)
            for priority in (1000, -1000):
                await bus.redis.delete(route.queue, route.meta)
                # every tick in one (future) millisecond, however long the calls take
                await bus.redis.set(route.seq, (await bus.server_time_ms() + 60_000) * 1024)
                ids = [f"req/r{9 - i}" for i in range(8)]  # named in the reverse of their order
                await bus.scripts_many([("route", route.as_list(), [hid, priority, "+600000", ",", ",", step, 0])
                                        for hid in ids])
                queued = [m.decode() for m in await bus.redis.zrange(route.queue, 0, -1)]
                assert queued == ids, (days, priority)


# ---------------------------------------------------------------------- ended while routed


async def test_a_handoff_the_sweep_ends_unroutable_leaves_its_set_queue(real_backend: str, servers: dict) -> None:
    """Refused by a-1, a routed handoff waited in its set's queue for b-1, which died; when the
    refusal's guard fired the sweep found no capable agent and made it REJECTED. Its queue
    entry and meta stayed: a set no one serves any more kept them for good."""
    async with make_bus(real_backend, servers, route_guard=0.2) as bus:
        await live(bus, "a-1", "w1")
        await live(bus, "b-1", "w1")
        handle = await bus.client("req").request_handoff(routed(["x"], timeout=60.0))
        feed = RouteFeed(bus, "a-1", ["x"], "w1")
        await feed.refresh()
        assert [d.handoff_id for d in await feed.pull(1)] == [handle.handoff_id]  # offered to a-1
        refusal = await bus.client("a-1").reject_handoff(handle.handoff_id, "no", code="NOPE")
        assert refusal.status is S.PENDING
        route = bus.keys.route(set_id("x"))
        assert await bus.redis.zscore(route.queue, handle.handoff_id) is not None  # waiting there for b-1
        await bus.redis.delete(bus.keys.workers("b-1"))  # b-1 died
        await bus.router.directory.agents(max_age=0)  # the router's view, read now
        with anyio.fail_after(10):
            outcome = await handle.outcome()
            await bus.sweeper.wait_pass()  # the end of the pass that decided it
        assert outcome.status is S.REJECTED and outcome.rejection_code == "NO_CAPABLE_AGENT"
        assert await bus.redis.zscore(route.queue, handle.handoff_id) is None
        assert await bus.redis.hget(route.meta, handle.handoff_id) is None


async def test_a_refusal_racing_a_cancel_leaves_no_cancelled_handoff_in_its_set_queue(
    real_backend: str, servers: dict
) -> None:
    """The requester cancels between a refusal's script and its routing on: the cancel found
    nothing to take out of the set's queue yet, and the route script (in the set's slot) cannot
    see the record, so the CANCELLED handoff was queued, for agents that would never take it."""
    async with make_bus(real_backend, servers) as bus:
        await live(bus, "a-1", "w1")
        await live(bus, "b-1", "w1")
        client = bus.client("req")
        handle = await client.request_handoff(routed(["x"], timeout=60.0))
        feed = RouteFeed(bus, "a-1", ["x"], "w1")
        await feed.refresh()
        assert [d.handoff_id for d in await feed.pull(1)] == [handle.handoff_id]
        keys = bus.keys.record("req", handle.request_id).as_list()
        reply = await bus.script("reject", keys, [handle.handoff_id, handle.request_id, "a-1", bus.config.retention_ms,
                                                  bus.config.response_retention_ms, "reason", "no",
                                                  "guard", int(bus.config.route_guard * 1000)])
        assert int(reply[0]) == 2  # refused, to be routed on
        assert (await client.cancel_handoff(handle.handoff_id)).status is S.CANCELLED  # in between
        await bus.router.send_on("a-1", handle.handoff_id, reply)  # reject_handoff's second half
        route = bus.keys.route(set_id("x"))
        assert await bus.redis.zscore(route.queue, handle.handoff_id) is None
        assert await bus.redis.hget(route.meta, handle.handoff_id) is None


async def test_a_target_whose_settling_fails_does_not_cost_the_batch_its_fired_guards(
    real_backend: str, servers: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In one pass a direct handoff expired whose target's queue cannot be settled (written by
    hand), and a routed handoff's guard fired (its requester died before routing it). The
    settling raised, and the routing of the fired guards after it never ran: the sweep had
    taken the guard out, so the handoff waited in no queue until its deadline."""
    async with make_bus(real_backend, servers, sweep_interval=3600, route_guard=0.2) as bus:
        if bus.sweeper.passes == 0:
            with anyio.fail_after(10):
                await bus.sweeper.wait_pass()  # the first pass, at start; the next is an hour away
        await live(bus, "a-1", "w1")
        client = bus.client("req")
        direct = await client.request_handoff(req("req", "broken-1", timeout=0.2))
        queue = bus.keys.target("broken-1").queue
        await bus.redis.delete(queue)
        await bus.redis.set(queue, "written by hand")

        async def no_route(*args: Any) -> list[Any]:
            return []  # the requester died before its route call

        monkeypatch.setattr(HandoffClient, "_route_calls", no_route)
        handle = await client.request_handoff(routed(["x"], timeout=60.0))
        monkeypatch.undo()
        deadlines, guard = bus.keys.deadlines("req"), f"o:{handle.request_id}"
        due = max(await bus.redis.zscore(deadlines, guard), await bus.redis.zscore(deadlines, direct.request_id))
        await anyio.sleep(max(due - await bus.now_ms() + 5, 0) / 1000)  # a timer: until both are due
        assert await bus.now_ms() > due
        await bus.sweeper.sweep_once()  # both in one pass
        assert (await direct.status()).status is S.EXPIRED
        assert await bus.redis.zscore(bus.keys.route(set_id("x")).queue, handle.handoff_id) is not None


async def test_a_refusals_retry_after_is_bounded(real_backend: str, servers: dict) -> None:
    """A retry_after_ms past 2^63 ms was stored as a negative time that no reader parses: the
    agent that asked not to be offered the handoff for ages was offered it again at once. The
    client refuses it; the script bounds what reaches it anyway (an isolated agent's own call)."""
    async with make_bus(real_backend, servers) as bus:
        await live(bus, "a-1", "w1")
        handle = await bus.client("req").request_handoff(routed(["x"], timeout=60.0))
        feed = RouteFeed(bus, "a-1", ["x"], "w1")
        await feed.refresh()
        assert [d.handoff_id for d in await feed.pull(1)] == [handle.handoff_id]
        with pytest.raises(InvalidRequest, match="retry_after_ms"):
            await bus.client("a-1").reject_handoff(handle.handoff_id, "later", retry_after_ms=10**19)
        keys = bus.keys.record("req", handle.request_id).as_list()
        reply = await bus.script("reject", keys, [handle.handoff_id, handle.request_id, "a-1", bus.config.retention_ms,
                                                  bus.config.response_retention_ms, "reason", "later",
                                                  "retry", 10**19, "guard", int(bus.config.route_guard * 1000)])
        assert int(reply[0]) == 2
        await bus.router.send_on("a-1", handle.handoff_id, reply)
        deferred = (await bus.redis.hget(keys[0], "deferred") or b"").decode()
        assert deferred_until(deferred, "a-1") is not None  # a time readers parse
        assert await feed.pull(1) == []  # still deferred


async def test_a_redirect_whose_offer_lapsed_leaves_the_redirect_targets_queue(
    real_backend: str, servers: dict
) -> None:
    """A refusal redirected a routed handoff into spec-r's own queue; spec-r never took it
    (its workers are gone), the offer lapsed and the sweep routed the handoff again. Once the
    handoff has ended, spec-r's queue must not hold it: no worker of an agent that never comes
    back would settle it, and it counts against spec-r's ``max_queued`` and its pending list."""
    async with make_bus(real_backend, servers, offer_time=0.2) as bus:
        for agent, consumer in [("spec-a", "a1"), ("spec-r", "r1")]:
            await live(bus, agent, consumer)
        client = bus.client("req")
        handle = await client.request_handoff(routed(["x"], timeout=60))
        hid = handle.handoff_id
        feed_a = RouteFeed(bus, "spec-a", ["x"], "a1")
        await feed_a.refresh()
        assert [d.handoff_id for d in await feed_a.pull(1)] == [hid]
        await bus.client("spec-a").reject_handoff(hid, "ask R", code="REDIRECT", redirect_to="spec-r")
        queue = bus.keys.target("spec-r").queue
        assert await bus.redis.zscore(queue, hid) is not None  # offered to spec-r, in its own queue
        with anyio.fail_after(10):  # spec-r never takes it: its offer lapses (in a pass run whole)
            await bus.sweeper.wait_pass()
            while not any(step.event == "LAPSED" for step in (await handle.status()).route):
                await bus.sweeper.wait_pass()
        assert await bus.client("spec-r").get_pending_handoffs() == []  # not offered to spec-r any more
        await handle.cancel()
        assert (await handle.status()).status is S.CANCELLED
        assert await bus.redis.zscore(queue, hid) is None
