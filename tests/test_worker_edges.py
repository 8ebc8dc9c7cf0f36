"""A worker's edges: a failed step never strands a handoff, nor runs one twice."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from handoffbus import (
    CallRefused,
    HandoffBus,
    HandoffContext,
    HandoffRequest,
    HandoffStatus,
    Worker,
    serialize_context,
)
from handoffbus.keys import GROUP
from handoffbus.policies.blobs import offload, restore
from handoffbus.routing import set_id
from handoffbus.workers import Accept, Agent, ReceivedHandoff, steps
from handoffbus.workers.inbox import Delivery, Inbox
from handoffbus.workers.lanes import Lanes
from handoffbus.workers.routes import RouteFeed

from .agents import Echo, ReadsReport
from .helpers import first_call_fails, req, routed, serve_until_done

pytestmark = pytest.mark.anyio


async def test_a_claim_whose_offer_failed_is_kept_to_lapse_back_into_the_queue(bus: HandoffBus) -> None:
    handle = await bus.client("req").request_handoff(routed(["x"]))
    feed = RouteFeed(bus, "x-agent", ["x"], "w1")
    await feed.refresh()
    real = bus.scripts_many

    async def assign_fails(calls: list[tuple[str, list[str], list[Any]]]) -> list[Any]:
        if calls and all(name == "assign" for name, _, _ in calls):
            return [RedisConnectionError("the record's node did not answer") for _ in calls]
        return await real(calls)

    bus.scripts_many = assign_fails  # type: ignore[method-assign]
    assert await feed.pull(5) == []  # offered to no one
    bus.scripts_many = real  # type: ignore[method-assign]
    route = bus.keys.route(set_id("x"))
    # the claim stands, with its meta: once it lapses, `pull` puts the handoff back in the queue
    assert await bus.redis.zrange(route.claims, 0, -1) == [handle.handoff_id.encode()]
    assert await bus.redis.hexists(route.meta, handle.handoff_id)


async def test_a_handoff_given_back_is_settled_and_queued_in_one_step(bus: HandoffBus) -> None:
    for i in range(3):
        await bus.client("a").request_handoff(req("a", "b", request_id=f"r{i}"))
    inbox = Inbox(bus, "b", "w1")
    _, taken = await inbox.take(1)
    [delivery] = taken
    keys = bus.keys.target("b")
    assert await inbox.requeue(delivery.handoff_id, 0) is True
    assert await bus.redis.hlen(keys.inflight) == 0
    assert (await bus.redis.xpending(keys.inbox, GROUP))["pending"] == 0
    # back in the queue, behind the handoffs of its priority that waited meanwhile
    assert await bus.redis.zrange(keys.queue, 0, -1) == [b"a/r1", b"a/r2", b"a/r0"]


async def test_a_handoff_claimed_by_another_worker_is_not_given_back(bus: HandoffBus) -> None:
    """A worker stopped while its acceptance hook ran gives the handoff back; but another worker
    claimed the entry meanwhile (the first was slow) and may be working under it: left alone.
    An entry restored after the group was deleted, not yet adopted, is still the first's."""
    await bus.client("a").request_handoff(req("a", "b", request_id="r0"))
    slow, keys = Inbox(bus, "b", "slow"), bus.keys.target("b")
    _, [delivery] = await slow.take(1)
    await bus.redis.xclaim(keys.inbox, GROUP, "other", 0, [delivery.entry_id])
    assert await slow.requeue(delivery.handoff_id, 0) is False
    pending = await bus.redis.xpending_range(keys.inbox, GROUP, min="-", max="+", count=10)
    assert [(p["message_id"].decode(), p["consumer"]) for p in pending] == [(delivery.entry_id, b"other")]
    assert await bus.redis.zcard(keys.queue) == 0 and await bus.redis.hlen(keys.inflight) == 1
    assert await bus.redis.xgroup_destroy(keys.inbox, GROUP) == 1
    assert await slow.restore() == 1  # re-issued to the restored-entries consumer
    assert await slow.requeue(delivery.handoff_id, 0) is True
    assert await bus.redis.zrange(keys.queue, 0, -1) == [b"a/r0"] and await bus.redis.hlen(keys.inflight) == 0


@pytest.mark.parametrize("what", ["group", "stream"])
async def test_a_handoff_is_given_back_when_its_group_was_deleted(bus: HandoffBus, what: str) -> None:
    await bus.client("a").request_handoff(req("a", "b", request_id="r0"))
    inbox, keys = Inbox(bus, "b", "w1"), bus.keys.target("b")
    _, [delivery] = await inbox.take(1)
    if what == "group":
        assert await bus.redis.xgroup_destroy(keys.inbox, GROUP) == 1
    else:
        assert await bus.redis.delete(keys.inbox) == 1
    assert await inbox.requeue(delivery.handoff_id, 0) is True
    assert await bus.redis.zrange(keys.queue, 0, -1) == [b"a/r0"] and await bus.redis.hlen(keys.inflight) == 0


async def test_delivery_counts_are_read_entry_by_entry(real_bus: HandoffBus) -> None:
    # the worker holds more entries than any COUNT a range read would ask for: each reclaimed
    # entry's own count must still be found (a poison handoff is recognised by it)
    for i in range(80):
        await real_bus.client("a").request_handoff(req("a", Echo.agent_id, request_id=f"r{i:03}"))
    inbox = Inbox(real_bus, Echo.agent_id, "w1")
    _, taken = await inbox.take(80)
    keys = real_bus.keys.target(Echo.agent_id)
    first, last = taken[0], taken[-1]
    for _ in range(3):  # the last one delivered three more times
        await real_bus.redis.xclaim(keys.inbox, GROUP, "w1", 0, [last.entry_id])
    worker = Worker(real_bus, Echo(), consumer="w1")
    counts = await worker._keeper.delivery_counts([first, last])
    assert counts == {first.entry_id: 1, last.entry_id: 4}


async def test_a_worker_does_not_reclaim_what_it_is_running(real_bus: HandoffBus) -> None:
    started, release = anyio.Event(), anyio.Event()
    runs: list[str] = []

    class Slow(Echo):
        async def on_handoff_received(self, handoff: Any) -> Any:
            runs.append(handoff.handoff_id)
            started.set()
            await release.wait()
            return "done"

    handle = await real_bus.client("a").request_handoff(req("a", Slow.agent_id))
    async with anyio.create_task_group() as tg:
        worker = Worker(real_bus, Slow(), reclaim_idle=60)
        await tg.start(worker.run)
        with anyio.fail_after(10):
            await started.wait()
        # its heartbeats failed for a while (say, an outage): the entry went idle, and the
        # reclaim pass finds this worker's own running handoff among the idle ones
        keys = real_bus.keys.target(Slow.agent_id)
        [entry] = [e["message_id"] for e in await real_bus.redis.xpending_range(keys.inbox, GROUP, "-", "+", 10)]
        await real_bus.redis.xclaim(keys.inbox, GROUP, worker.consumer, 0, [entry], idle=10**6)
        worker.reclaim_idle = 0.001
        await worker._reclaim_once(Lanes(tg, 1), "0-0")
        release.set()
        with anyio.fail_after(10):
            assert (await handle.outcome()).status is HandoffStatus.COMPLETED
        worker.drain()
    assert runs == [handle.handoff_id]  # one run, not a second beside it


async def test_a_handoff_waiting_for_a_lane_is_kept_fresh_by_the_heartbeat(real_bus: HandoffBus) -> None:
    # a reclaim can start more handoffs than the concurrency: one that waits for a lane must be
    # among the entries the heartbeat touches, or another worker would claim it as idle
    started, release = anyio.Event(), anyio.Event()

    class Slow(Echo):
        async def on_handoff_received(self, handoff: Any) -> Any:
            started.set()
            await release.wait()
            return "done"

    handles = [await real_bus.client("a").request_handoff(req("a", Slow.agent_id)) for _ in range(2)]
    worker = Worker(real_bus, Slow(), consumer="w1", concurrency=1)
    _, taken = await worker._inbox.take(2)
    loaded = await worker._inbox.load([d.handoff_id for d in taken])
    async with anyio.create_task_group() as tg:
        worker._start(Lanes(tg, 1), taken, loaded)
        with anyio.fail_after(10):
            await started.wait()
        assert worker._entries == {d.handoff_id: d.entry_id for d in taken}  # the waiting one too
        release.set()
        with anyio.fail_after(10):
            assert [(await h.outcome()).status for h in handles] == [HandoffStatus.COMPLETED] * 2
        tg.cancel_scope.cancel()
    assert worker._entries == {}


class _Stuck(Echo):
    """Once it starts on a handoff, works on it for good."""

    def __init__(self) -> None:
        super().__init__()
        self.started = anyio.Event()

    async def on_handoff_received(self, handoff: Any) -> Any:
        self.started.set()
        await anyio.sleep_forever()


async def _stopped_while_one_works(
    worker: Worker, count: int, start: Callable[[Lanes, list[Delivery], list[Any]], None],
    meanwhile: Callable[[], Awaitable[Any]] | None = None,
) -> None:
    """The worker (concurrency 1, a ``_Stuck`` agent) takes ``count`` handoffs and ``start``s
    them on one lane (``meanwhile`` runs first): the first works for good, the others wait for
    the lane. Then its handlers stop and it winds down."""
    _, taken = await worker._inbox.take(count)
    loaded = await worker._inbox.load([d.handoff_id for d in taken])
    if meanwhile is not None:
        await meanwhile()
    assert isinstance(worker.agent, _Stuck)
    async with anyio.create_task_group() as tg:
        lanes = Lanes(tg, 1)
        start(lanes, taken, loaded)
        with anyio.fail_after(10):
            await worker.agent.started.wait()
        tg.cancel_scope.cancel()
    await worker._wind_down(lanes)


async def test_a_stop_hands_back_what_waited_for_a_lane_and_keeps_what_was_accepted(real_bus: HandoffBus) -> None:
    # a reclaim started more than the concurrency and the worker stopped: the handoff that never
    # reached a lane goes back to the queue at once (no reclaim wait), the one accepted stays
    # pending, and one cancelled meanwhile is settled, not queued again
    client = real_bus.client("a")
    running, waiting, cancelled = [await client.request_handoff(req("a", _Stuck.agent_id)) for _ in range(3)]
    worker = Worker(real_bus, _Stuck(), consumer="w1", concurrency=1)
    await _stopped_while_one_works(worker, 3, worker._start, cancelled.cancel)
    keys = real_bus.keys.target(_Stuck.agent_id)
    assert await real_bus.redis.zrange(keys.queue, 0, -1) == [waiting.handoff_id.encode()]
    assert await real_bus.redis.hkeys(keys.inflight) == [running.handoff_id.encode()]
    pending = await real_bus.redis.xpending_range(keys.inbox, GROUP, min="-", max="+", count=10)
    assert [p["consumer"] for p in pending] == [b"w1"]  # the accepted one's, to be reclaimed
    assert [(await h.status()).status for h in (running, waiting, cancelled)] == [  # type: ignore[union-attr]
        HandoffStatus.ACCEPTED, HandoffStatus.PENDING, HandoffStatus.CANCELLED]
    assert worker._entries == {} and worker._active == 0


async def test_a_stop_leaves_an_unstarted_handoff_due_for_dead_lettering_pending(real_bus: HandoffBus) -> None:
    # reclaimed after more deliveries than max_deliveries (its handling kept killing workers),
    # it would be dead-lettered; queued again by a stop, its delivery count started over
    for _ in range(2):
        await real_bus.client("a").request_handoff(req("a", _Stuck.agent_id))
    worker = Worker(real_bus, _Stuck(), consumer="w1", concurrency=1, max_deliveries=5)

    def start(lanes: Lanes, taken: list[Delivery], loaded: list[Any]) -> None:
        worker._submit(lanes, taken[0], loaded[0])
        worker._submit(lanes, taken[1], loaded[1], 6, reclaimed=True)  # its 6th delivery

    await _stopped_while_one_works(worker, 2, start)
    keys = real_bus.keys.target(_Stuck.agent_id)
    assert await real_bus.redis.zrange(keys.queue, 0, -1) == []  # not queued again
    assert (await real_bus.redis.xpending(keys.inbox, GROUP))["pending"] == 2  # both stay pending


async def test_a_stop_hands_back_what_was_taken_but_could_not_be_loaded(real_bus: HandoffBus) -> None:
    # the take went through, the load failed, and the worker was told to stop while it backed
    # off: the handoff goes back to the queue now, not after the reclaim time
    handle = await real_bus.client("a").request_handoff(req("a", Echo.agent_id))
    worker = Worker(real_bus, Echo(), consumer="w1")
    worker._inbox.load, failed = first_call_fails(  # type: ignore[method-assign]
        worker._inbox.load, RedisConnectionError("connection lost"))
    async with anyio.create_task_group() as tg:
        await tg.start(worker.run)
        with anyio.fail_after(10):
            await failed.wait()
        worker.drain()
    keys = real_bus.keys.target(Echo.agent_id)
    assert await real_bus.redis.zrange(keys.queue, 0, -1) == [handle.handoff_id.encode()]
    assert (await real_bus.redis.xpending(keys.inbox, GROUP))["pending"] == 0
    assert await real_bus.redis.hlen(keys.inflight) == 0
    assert (await handle.status()).status is HandoffStatus.PENDING  # type: ignore[union-attr]


@pytest.mark.parametrize("step", ["take over", "dead-letter"])
async def test_a_stop_in_the_middle_of_a_takeover_or_dead_lettering_leaves_the_handoff_pending(
        real_bus: HandoffBus, step: str) -> None:
    # a handoff another consumer of the agent took (and, for a takeover, accepted) and left;
    # a stop arriving while its reclaimer's call is on the wire must not settle it: settled,
    # no worker would ever finish it (or dead-letter it)
    handle = await real_bus.client("a").request_handoff(req("a", Echo.agent_id))
    _, [delivery] = await Inbox(real_bus, Echo.agent_id, "gone-1").take(1)
    if step == "take over":
        await real_bus.client(Echo.agent_id)._transition(
            "accept", handle.handoff_id, {"lease": "gone-1"}, settle=False)
    calling = anyio.Event()

    async def on_the_wire(*args: Any, **kwargs: Any) -> Any:
        calling.set()
        await anyio.sleep_forever()

    # a second delivery is past max_deliveries=1: the handoff is poison, and dead-lettered
    limit = 1 if step == "dead-letter" else 5
    worker = Worker(real_bus, Echo(), consumer="w2", reclaim_idle=0.05, max_deliveries=limit)
    if step == "take over":
        worker._steps.take_over = on_the_wire  # type: ignore[method-assign]
    else:
        worker._inbox.dead_letter = on_the_wire  # type: ignore[method-assign]
    async with anyio.create_task_group() as tg:
        await tg.start(worker.run)
        with anyio.fail_after(10):
            await calling.wait()
        worker.drain()
        worker.drain()  # the second: stop at once
    keys = real_bus.keys.target(Echo.agent_id)
    pending = await real_bus.redis.xpending_range(keys.inbox, GROUP, "-", "+", 10)
    assert [(p["message_id"].decode(), p["consumer"].decode()) for p in pending] == [(delivery.entry_id, "w2")]
    assert await real_bus.redis.hget(keys.inflight, handle.handoff_id) == delivery.entry_id.encode()


async def test_taken_handoffs_whose_load_failed_are_started_once_it_works(real_bus: HandoffBus) -> None:
    handle = await real_bus.client("a").request_handoff(req("a", Echo.agent_id))
    worker = Worker(real_bus, Echo(), reclaim_idle=600)  # a reclaim would come far too late
    worker._inbox.load, failed = first_call_fails(  # type: ignore[method-assign]
        worker._inbox.load, RedisConnectionError("connection lost"))
    async with anyio.create_task_group() as tg:
        await tg.start(worker.run)
        with anyio.fail_after(10):
            assert (await handle.outcome()).status is HandoffStatus.COMPLETED
        worker.drain()
    assert failed.is_set()  # the load did fail once


async def test_finished_handoffs_a_failed_settle_left_are_settled_later(real_bus: HandoffBus) -> None:
    worker = Worker(real_bus, Echo())
    take = worker._inbox.take
    worker._done = ["a/r1", "a/r2"]

    async def take_fails(count: int, settle: Any = ()) -> Any:
        raise RedisConnectionError("connection lost")

    worker._inbox.take = take_fails  # type: ignore[method-assign]
    await worker._settle_done()
    assert worker._done == ["a/r1", "a/r2"]  # kept for the next take, not dropped
    worker._inbox.take = take  # type: ignore[method-assign]
    await worker._settle_done()
    assert worker._done == []


async def test_admitting_a_handoff_named_twice_gives_it_one_entry(bus: HandoffBus) -> None:
    keys = bus.keys.target("b")
    reply = await bus.script("admit", keys.as_list(), [GROUP, "w1", "a/r1", "a/r1", "a/r2"])
    assert [reply[i] for i in range(0, len(reply), 2)] == [b"a/r1", b"a/r2"]
    assert await bus.redis.xlen(keys.inbox) == 2 and await bus.redis.hlen(keys.inflight) == 2
    await bus.settle("b", ["a/r1", "a/r2"])
    assert (await bus.redis.xpending(keys.inbox, GROUP))["pending"] == 0  # nothing left pending


async def test_closing_a_bus_mid_sweep_settles_what_the_sweep_expired(real_backend: str, servers: dict) -> None:
    from .conftest import make_bus

    async with make_bus(real_backend, servers) as bus:
        prefix = bus.config.prefix
        await bus.client("a").request_handoff(req("a", "b", timeout=0.05))
        entered, closing = anyio.Event(), anyio.Event()
        settle, stop = bus.settle_many, bus.sweeper.stop

        async def settle_once_closing(by_target: Any) -> dict[str, BaseException]:
            entered.set()
            await closing.wait()  # the sweep's script has run; the bus starts closing now
            return await settle(by_target)

        async def stopping() -> None:
            closing.set()
            await stop()

        bus.settle_many = settle_once_closing  # type: ignore[method-assign]
        bus.sweeper.stop = stopping  # type: ignore[method-assign]
        with anyio.fail_after(10):
            await entered.wait()
    async with make_bus(real_backend, servers, prefix=prefix) as again:
        # made EXPIRED and taken out of the deadline index: out of b's queue too, not left there
        assert await again.redis.zcard(again.keys.target("b").queue) == 0


@pytest.mark.parametrize("settings", [{"reclaim_idle": 0}, {"reclaim_idle": float("nan")}, {"block": float("inf")},
                                      {"grace": -1.0}, {"max_deliveries": 0}])
async def test_a_worker_refuses_settings_that_would_break_it(bus: HandoffBus, settings: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        Worker(bus, Echo(), **settings)


async def test_a_routed_refusal_is_settled_before_it_is_routed_on(bus: HandoffBus) -> None:
    """A worker refuses a routed handoff for now (retry at once) and leaves its settle to a later
    take; another worker of the same agent pulls it back first. It is admitted to the agent's
    inbox: the refused delivery left it before it was routed again, not after."""
    handle = await bus.client("req").request_handoff(routed(["x"], timeout=60.0))
    first, second = RouteFeed(bus, "x-agent", ["x"], "w1"), RouteFeed(bus, "x-agent", ["x"], "w2")
    await first.refresh()
    await second.refresh()
    [refused] = await first.pull(1)
    response = await bus.client("x-agent")._transition(
        "reject", handle.handoff_id, {"reason": "later", "retry": 0}, settle=False)
    assert response.status is HandoffStatus.PENDING  # sent on
    [again] = await second.pull(1)
    assert again.handoff_id == handle.handoff_id and again.entry_id != refused.entry_id
    keys = bus.keys.target("x-agent")
    assert await bus.redis.hgetall(keys.inflight) == {handle.handoff_id.encode(): again.entry_id.encode()}
    pending = await bus.redis.xpending_range(keys.inbox, GROUP, min="-", max="+", count=10)
    assert [(p["message_id"].decode(), p["consumer"]) for p in pending] == [(again.entry_id, b"w2")]


async def test_taken_handoffs_whose_load_failed_are_not_reclaimed_by_their_own_worker(real_bus: HandoffBus) -> None:
    """Taken, their load failed, and the outage outlasted the reclaim time: the worker's own
    reclaim must not start them beside the fetch loop, which starts them once it can load (two
    starts ran the work twice)."""
    handle = await real_bus.client("a").request_handoff(req("a", Echo.agent_id))
    worker = Worker(real_bus, Echo(), reclaim_idle=0.05)
    load, submit = worker._inbox.load, worker._submit
    fetching: list[Any] = []  # the fetch loop's task: the first to load
    started: list[str] = []
    reloaded = anyio.Event()

    async def load_fails_once(handoff_ids: Any) -> Any:
        task = asyncio.current_task()
        if not fetching:
            fetching.append(task)
            raise RedisConnectionError("connection lost")  # the take went through, its load did not
        if task is not fetching[0]:
            return await load(handoff_ids)
        for _ in range(4):  # the outage outlasts the reclaim time: passes that could claim it
            await worker.wait_reclaim_pass()
        loaded = await load(handoff_ids)
        reloaded.set()  # started as this returns, before the fetch loop waits again
        return loaded

    def counted(lanes: Any, delivery: Delivery, *args: Any) -> None:
        started.append(delivery.handoff_id)
        submit(lanes, delivery, *args)

    worker._inbox.load = load_fails_once  # type: ignore[method-assign]
    worker._submit = counted  # type: ignore[method-assign]
    async with anyio.create_task_group() as tg:
        await tg.start(worker.run)
        with anyio.fail_after(10):
            await reloaded.wait()
            assert (await handle.outcome()).status is HandoffStatus.COMPLETED
        worker.drain()
        worker.drain()  # at once: a second start may still be running
    assert started == [handle.handoff_id]


async def test_an_outcome_whose_sending_failed_is_sent_again_not_worked_again(real_bus: HandoffBus) -> None:
    runs: list[int] = []

    class Counting(Echo):
        async def on_handoff_received(self, handoff: Any) -> Any:
            runs.append(handoff.attempt)
            return "done"

    handle = await real_bus.client("a").request_handoff(req("a", Counting.agent_id))
    worker = Worker(real_bus, Counting(), reclaim_idle=0.05)
    failed = _complete_raises(worker, RedisConnectionError("Connection reset by peer"), times=1)
    async with anyio.create_task_group() as tg:
        await tg.start(worker.run)
        with anyio.fail_after(10):
            outcome = await handle.outcome()
        worker.drain()
    assert failed and outcome.status is HandoffStatus.COMPLETED and outcome.result == "done"
    assert runs == [1]


@pytest.mark.parametrize("hook", ["acceptance", "work"])
async def test_a_hook_raising_cancelled_error_fails_its_handoff_and_the_worker_goes_on(
    real_bus: HandoffBus, hook: str
) -> None:
    """A hook that awaited something its owner cancelled raises CancelledError: a failed hook,
    not a stop (raised on, it ended the worker, and each worker of the agent in turn)."""

    class Awaits(Echo):
        async def on_handoff_request(self, request: HandoffRequest) -> Accept:
            if hook == "acceptance" and request.request_id == "r1":
                await _cancelled()
            return Accept()

        async def on_handoff_received(self, handoff: ReceivedHandoff) -> Any:
            if hook == "work" and handoff.request.request_id == "r1":
                await _cancelled()
            return "done"

    client = real_bus.client("a")
    first = await client.request_handoff(req("a", Awaits.agent_id, request_id="r1"))
    worker = Worker(real_bus, Awaits())
    async with anyio.create_task_group() as tg:
        await tg.start(worker.run)
        with anyio.fail_after(10):
            outcome = await first.outcome()
            later = await client.request_handoff(req("a", Awaits.agent_id, request_id="r2"))
            assert (await later.outcome()).status is HandoffStatus.COMPLETED  # still serving
        worker.drain()
    if hook == "acceptance":
        assert outcome.status is HandoffStatus.REJECTED and outcome.rejection_code == "HOOK_FAILED"
        assert "CancelledError" in (outcome.rejection_reason or "")
    else:
        assert outcome.status is HandoffStatus.FAILED and "CancelledError" in (outcome.error or "")


async def _cancelled() -> None:
    future = asyncio.get_running_loop().create_future()
    future.cancel()  # e.g. a shared call the hook awaits, cancelled by its owner
    await future


@pytest.mark.parametrize("hook", ["acceptance", "work"])
async def test_a_stop_does_not_wait_for_a_blocking_plain_hook(real_bus: HandoffBus, hook: str) -> None:
    """A plain-def hook runs in a thread that may never return (a model call without a timeout):
    a stop past the grace period ends the worker all the same. Stopped in its acceptance hook,
    the handoff goes back to the queue, even if the hook answers Accept as the stop lands."""
    release = threading.Event()
    entered = anyio.Event()

    class Blocking(Agent):
        agent_id = "blocking-1"

        def on_handoff_request(self, request: HandoffRequest) -> Accept:
            if hook == "acceptance":
                anyio.from_thread.run_sync(entered.set)
                release.wait(30)
            return Accept()

        def on_handoff_received(self, handoff: ReceivedHandoff) -> Any:
            anyio.from_thread.run_sync(entered.set)
            release.wait(30)
            return "done"

    handle = await real_bus.client("a").request_handoff(req("a", Blocking.agent_id))
    worker = Worker(real_bus, Blocking(), grace=0.1)
    stopped = anyio.Event()

    async def run() -> None:
        await worker.run()
        stopped.set()

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(run)
            with anyio.fail_after(10):
                await entered.wait()
                worker.drain()
                worker.drain()  # a second stop request: at once
                await stopped.wait()
    finally:
        release.set()  # the hook answers only now, after the stop
    record = await real_bus.client("a").get_handoff_status(handle.handoff_id)
    assert record is not None
    queued = await real_bus.redis.zrange(real_bus.keys.target(Blocking.agent_id).queue, 0, -1)
    if hook == "acceptance":  # given back, not accepted by the leaving worker
        assert record.status is HandoffStatus.PENDING and queued == [handle.handoff_id.encode()]
    else:  # left pending under its lease, to be reclaimed
        assert record.status is HandoffStatus.ACCEPTED and queued == []


async def test_a_refused_outcome_is_not_sent_again(real_bus: HandoffBus) -> None:
    """A refusal (a forwarder's CallRefused is a PermissionError, so an OSError) is no lost
    connection: sending it again changes nothing, and the handler must end."""
    await real_bus.client("a").request_handoff(req("a", Echo.agent_id))
    worker = Worker(real_bus, Echo())
    refused = _complete_raises(worker, CallRefused("complete acting as 'someone-else'"))
    async with anyio.create_task_group() as tg:
        await tg.start(worker.run)
        with anyio.fail_after(10):
            while not refused or worker._active:
                await worker._wait_change()
        worker.drain()
    assert refused == ["complete"]


async def test_a_heartbeat_while_redis_is_out_of_reach_does_not_fail_the_work(real_bus: HandoffBus) -> None:
    """A handler's heartbeat() that cannot reach the server: the handler goes on, its lease
    checked again at the next beat and when the outcome is sent (raised into the hook, a blip
    made the handoff FAILED)."""

    class Beats(Echo):
        async def on_handoff_received(self, handoff: ReceivedHandoff) -> Any:
            await handoff.heartbeat()
            return "done"

    handle = await real_bus.client("a").request_handoff(req("a", Beats.agent_id))
    worker = Worker(real_bus, Beats())
    touch = worker._keeper.touch
    failed: list[list[str]] = []

    async def unreachable(hids: list[str]) -> None:
        if not failed:
            failed.append(hids)
            raise RedisConnectionError("Connection reset by peer")
        await touch(hids)

    worker._keeper.touch = unreachable  # type: ignore[method-assign]
    async with anyio.create_task_group() as tg:
        await tg.start(worker.run)
        with anyio.fail_after(10):
            outcome = await handle.outcome()
        worker.drain()
    assert failed == [[handle.handoff_id]]
    assert outcome.status is HandoffStatus.COMPLETED and outcome.result == "done"


async def test_a_context_whose_blobs_could_not_be_read_for_a_moment_is_restored(
    real_bus: HandoffBus, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Restoring a context's out-of-band content met a lost connection: read again, not a
    failure of the work hook (with the default single attempt, that was FAILED)."""
    report = "A" * 70_000
    offloaded = await offload(real_bus, "a", HandoffContext(tool_state={"report": report}), threshold=65_536)
    handle = await real_bus.client("a").request_handoff(
        req("a", ReadsReport.agent_id, context_snapshot=serialize_context(offloaded)))
    failed: list[str] = []

    async def flaky(bus: HandoffBus, context: HandoffContext, handoff_id: str | None = None) -> HandoffContext:
        if not failed:
            failed.append(handle.handoff_id)
            raise RedisConnectionError("Connection reset by peer")
        return await restore(bus, context, handoff_id)

    monkeypatch.setattr(steps, "restore", flaky)
    reads = ReadsReport()
    [outcome], _ = await serve_until_done(real_bus, reads, [handle])
    assert failed and outcome.status is HandoffStatus.COMPLETED and outcome.result == "read"
    assert reads.seen == [report]


@pytest.mark.parametrize("hook", ["acceptance", "work"])
async def test_what_a_hook_returns_that_cannot_be_sent_ends_the_handoff(real_bus: HandoffBus, hook: str) -> None:
    """A result (or acceptance metadata) the codec refuses fails the same way on every run: the
    handoff ends, told why, and the hook is not run again (it was kept pending, reclaimed and
    run again until dead-lettered, and the requester heard nothing)."""
    runs: list[int] = []

    class Odd(Echo):
        async def on_handoff_request(self, request: HandoffRequest) -> Accept:
            return Accept(metadata={"n": 2**70} if hook == "acceptance" else {})

        async def on_handoff_received(self, handoff: ReceivedHandoff) -> Any:
            runs.append(handoff.attempt)
            return {"n": 2**70}  # no MessagePack integer holds it

    handle = await real_bus.client("a").request_handoff(req("a", Odd.agent_id))
    worker = Worker(real_bus, Odd(), reclaim_idle=0.05)
    async with anyio.create_task_group() as tg:
        await tg.start(worker.run)
        with anyio.fail_after(10):
            outcome = await handle.outcome()
        worker.drain()
    if hook == "acceptance":
        assert outcome.status is HandoffStatus.REJECTED and outcome.rejection_code == "HOOK_FAILED"
        assert "metadata that cannot be sent" in (outcome.rejection_reason or "") and runs == []
    else:
        assert outcome.status is HandoffStatus.FAILED and runs == [1]
        assert "result cannot be sent: EncodeError" in (outcome.error or "")


def _complete_raises(worker: Worker, error: Exception, times: int | None = None) -> list[str]:
    """Make the worker's ``complete`` calls raise ``error`` (the first ``times``, or all);
    returns the list of those that did."""
    transition = worker._steps._client._transit
    raised: list[str] = []

    async def complete(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == "complete" and (times is None or len(raised) < times):
            raised.append(name)
            raise error
        return await transition(name, *args, **kwargs)

    worker._steps._client._transit = complete  # type: ignore[method-assign]
    return raised
