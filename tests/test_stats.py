"""Per-agent counters and latency histograms in Redis, and what the monitor reads of an agent."""

from __future__ import annotations

import anyio
import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from handoffbus import HandoffBus, HandoffStatus
from handoffbus.monitor import known_agents, observe, observe_agents
from handoffbus.stats import BUCKETS, AgentCounts, Tally, quantile

from .agents import Echo, Faulty
from .helpers import req, serving

pytestmark = pytest.mark.anyio
S = HandoffStatus


def test_quantiles_interpolate_within_buckets() -> None:
    histogram = [0] * (len(BUCKETS) + 1)
    histogram[2] = 10  # ten between 10 and 25 ms
    assert quantile(tuple(histogram), 0.5) == pytest.approx(0.0175)
    assert quantile(tuple(histogram), 1.0) == pytest.approx(0.025)
    histogram[-1] = 10  # ten longer than the last bound: reported as that bound
    assert quantile(tuple(histogram), 0.99) == BUCKETS[-1]
    assert quantile((0,) * (len(BUCKETS) + 1), 0.5) is None


def test_a_tally_counts_statuses_and_latencies_and_takes_them_once() -> None:
    tally = Tally()
    tally.transition("a", S.ACCEPTED, created_ms=1000, at_ms=1007)
    tally.transition("a", S.COMPLETED, created_ms=1000, at_ms=1300)
    tally.transition("a", S.CANCELLED)  # not an agent's doing: not counted
    tally.add("b", "EXPIRED", 3)
    taken = tally.take()
    assert taken["a"] == {"ACCEPTED": 1, "decision:1": 1, "decision:sum_ms": 7,
                          "COMPLETED": 1, "duration:6": 1, "duration:sum_ms": 300}
    assert taken["b"] == {"EXPIRED": 3}
    assert tally.take() == {}


def test_differences_of_readings() -> None:
    first = AgentCounts.parse({b"ACCEPTED": b"2", b"decision:0": b"2"})
    later = AgentCounts.parse({b"ACCEPTED": b"5", b"decision:0": b"3", b"decision:3": b"2"})
    delta = later.minus(first)
    assert delta.counts["ACCEPTED"] == 3 and delta.decision[0] == 1 and delta.decision[3] == 2
    assert first.minus(later) == first  # the hash was deleted meanwhile: all of it is new


async def test_work_is_counted_per_agent(bus: HandoffBus) -> None:
    client = bus.client("req")
    echoes = [await client.request_handoff(req("req", "echo-1")) for _ in range(5)]
    failing = [await client.request_handoff(req("req", "faulty-1")) for _ in range(2)]
    expiring = [await client.request_handoff(req("req", "nobody-1", timeout=0.2)) for _ in range(3)]
    async with serving(bus, Echo(), Faulty()):
        with anyio.fail_after(20):
            for handle in [*echoes, *failing, *expiring]:
                await handle.outcome()
    # the requester hears EXPIRED from the response stream, possibly before the sweep that made
    # it has its own reply (on a cluster a round waits for every node): the sweep counts it then
    await bus.sweeper.stop()  # returns once the batch under way is counted and settled
    await bus.stats.flush()
    echo, faulty, nobody = await observe_agents(bus, ["echo-1", "faulty-1", "nobody-1"])
    assert {k: v for k, v in echo.counts.counts.items() if v} == {"requested": 5, "ACCEPTED": 5, "COMPLETED": 5}
    assert {k: v for k, v in faulty.counts.counts.items() if v} == {"requested": 2, "ACCEPTED": 2, "FAILED": 2}
    assert {k: v for k, v in nobody.counts.counts.items() if v} == {"requested": 3, "EXPIRED": 3}
    assert sum(echo.counts.decision) == 5 and sum(echo.counts.duration) == 5
    p99 = quantile(echo.counts.duration, 0.99)
    assert p99 is not None and 0 < p99 <= 10  # handled within seconds of the request
    raw = await bus.redis.hgetall(bus.keys.stats("echo-1"))  # as redis-cli shows it
    assert raw[b"COMPLETED"] == b"5"


async def test_backlog_ages_in_flight_and_live_workers(real_bus: HandoffBus) -> None:
    bus = real_bus
    client = bus.client("req")
    for priority in (5, 1, 5, 9, 1):
        await client.request_handoff(req("req", "slow-1", priority=priority))
    first = await client.request_handoff(req("req", "slow-1", priority=-3))
    view = await observe(bus, "slow-1")
    assert (view.queued, view.in_flight, view.workers) == (6, 0, 0)
    # the oldest waiting is the first request made, though it is not first in line
    record = await client.get_handoff_status(first.handoff_id)
    assert record is not None and view.oldest_waiting_s is not None
    oldest_created = min([(await client.get_handoff_status(p.handoff_id)).created_ms  # type: ignore[union-attr]
                          for p in await client.get_pending_handoffs("slow-1")])
    assert view.oldest_waiting_s == pytest.approx((view.at_ms - oldest_created) / 1000, abs=0.002)
    assert view.oldest_in_flight_s is None

    async with serving(bus, Echo()):
        echo = await observe(bus, "echo-1")
    assert echo.workers == 1 and echo.capabilities == ["echo"] and echo.beat_age_s is not None
    assert 0 <= echo.beat_age_s < 3


async def test_an_idle_worker_settles_finished_handoffs_at_once(real_bus: HandoffBus) -> None:
    """Finished handoffs leave the in-flight count (and free their places under max_queued)
    while the worker waits for work, not at its next take."""
    bus = real_bus
    handles = [await bus.client("req").request_handoff(req("req", "echo-1")) for _ in range(5)]
    async with serving(bus, Echo()) as [worker]:
        settled = [anyio.Event()]
        settle = worker._settle_done

        async def watched() -> None:
            await settle()
            settled[0].set()

        worker._settle_done = watched  # type: ignore[method-assign]
        with anyio.fail_after(10):
            for handle in handles:
                await handle.outcome()
        assert worker._block_ms >= 1000  # without the settle, they would wait for the block to end
        with anyio.fail_after(0.5):
            while (await observe(bus, "echo-1")).in_flight:
                await settled[0].wait()  # each settle the worker makes while it waits for work
                settled[0] = anyio.Event()
        view = await observe(bus, "echo-1")
    assert (view.queued, view.in_flight, view.oldest_in_flight_s) == (0, 0, None)


def _counts(bus: HandoffBus) -> list[tuple[str, str, int]]:
    """What the bus counts from now on, as (agent, field, increment)."""
    counted: list[tuple[str, str, int]] = []

    class Listener:
        def counted(self, agent: str, field: str, n: int) -> None:
            counted.append((agent, field, n))

        def timed(self, agent: str, kind: str, seconds: float) -> None:
            pass

    bus.tally.listeners.append(Listener())
    return counted


async def test_an_expiry_is_counted_once_however_often_the_handoff_is_touched(bus: HandoffBus) -> None:
    from handoffbus import HandoffExpired

    counted = _counts(bus)
    alice, bob = bus.client("alice"), bus.client("bob")
    handle = await alice.request_handoff(req("alice", "bob", timeout=0.2))
    with anyio.fail_after(5):
        assert (await handle.decision()).status is HandoffStatus.EXPIRED
    for late in (lambda: bob.accept_handoff(handle.handoff_id), lambda: bob.reject_handoff(handle.handoff_id, "no"),
                 lambda: alice.cancel_handoff(handle.handoff_id)):
        with pytest.raises(HandoffExpired):
            await late()
    assert [c for c in counted if c[1] == "EXPIRED"] == [("bob", "EXPIRED", 1)]


async def test_an_expiry_made_by_a_resubmission_is_counted_and_settled(real_bus: HandoffBus) -> None:
    # the request script expires a resubmitted handoff whose deadline passed (its pending marker
    # gone): that expiry is counted for the target, and settled, as a status read's is
    counted = _counts(real_bus)
    alice = real_bus.client("alice")
    request = req("alice", "bob", request_id="again-1", timeout=600)  # far off: the sweep leaves it alone
    first = await alice.request_handoff(request)
    # its deadline passes: the marker expiring at it is what the scripts go by
    await real_bus.redis.delete(real_bus.keys.record("alice", "again-1").marker)
    again = await alice.request_handoff(request)  # the same request id and content: this call expires it
    assert again.handoff_id == first.handoff_id
    assert (await again.decision()).status is HandoffStatus.EXPIRED
    assert (await alice.get_handoff_status(first.handoff_id)).status is HandoffStatus.EXPIRED  # counted once
    assert [c for c in counted if c[1] == "EXPIRED"] == [("bob", "EXPIRED", 1)]
    assert await real_bus.redis.zcard(real_bus.keys.target("bob").queue) == 0


async def test_a_flush_waits_for_the_one_under_way(real_bus: HandoffBus) -> None:
    # the closing flush must not return while a timed one still holds counts in flight: were
    # the bus then closed, those would go back to a tally nobody flushes again
    from anyio.lowlevel import checkpoint

    real_bus.tally.add("x", "requested", 3)
    started, go, second_done = anyio.Event(), anyio.Event(), anyio.Event()
    scripts_many = real_bus.scripts_many

    async def held(calls: list) -> list:
        if not started.is_set():  # the first flush's round trip only
            started.set()
            await go.wait()
        return await scripts_many(calls)

    real_bus.scripts_many = held  # type: ignore[method-assign]

    async def second() -> None:
        await real_bus.stats.flush()
        second_done.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(real_bus.stats.flush)  # the timed flush, its counts on the wire
        await started.wait()
        real_bus.tally.add("x", "requested", 2)
        tg.start_soon(second)  # the closing one
        await anyio.wait_all_tasks_blocked()
        await checkpoint()
        assert not second_done.is_set()
        go.set()
    assert int(await real_bus.redis.hget(real_bus.keys.stats("x"), "requested")) == 5


@pytest.mark.parametrize("ran", [True, False], ids=["it ran", "it did not run"])
async def test_a_flush_whose_reply_was_lost_is_added_once(real_bus: HandoffBus, ran: bool) -> None:
    """A count whose reply was lost may have been added: sent again with its number, it is
    added once whether it had run or not; and new counts are not held up by it for long."""
    scripts_many = real_bus.scripts_many
    lost: list[int] = []

    async def reply_lost(calls: list) -> list:
        if not lost:
            lost.append(len(calls))
            if ran:
                await scripts_many(calls)
            raise RedisConnectionError("connection lost")
        return await scripts_many(calls)

    real_bus.scripts_many = reply_lost  # type: ignore[method-assign]
    real_bus.tally.add("x", "requested", 5)
    with pytest.raises(RedisConnectionError):
        await real_bus.stats.flush()
    real_bus.tally.add("x", "requested", 2)
    await real_bus.stats.flush()
    assert lost == [1]
    assert int(await real_bus.redis.hget(real_bus.keys.stats("x"), "requested")) == 7
    await real_bus.stats.flush()  # nothing new: nothing sent again
    assert int(await real_bus.redis.hget(real_bus.keys.stats("x"), "requested")) == 7


async def test_a_transition_repeated_after_its_reply_was_lost_is_counted_once(real_bus: HandoffBus) -> None:
    """A worker sends a transition again when its reply was lost; the repeat is answered
    "made already", and the transition, uncounted until then, is counted then, once."""
    requester, worker = real_bus.client("req"), real_bus.client("b")
    handle = await requester.request_handoff(req("req", "b"))
    await worker.accept_handoff(handle.handoff_id)
    script = real_bus.script
    lost: list[str] = []

    async def reply_lost(name: str, keys: list, args: list) -> object:
        reply = await script(name, keys, args)
        if name == "complete" and not lost:
            lost.append(name)
            raise RedisConnectionError("connection lost")
        return reply

    real_bus.script = reply_lost  # type: ignore[method-assign]
    with pytest.raises(RedisConnectionError):
        await worker.complete_handoff(handle.handoff_id, result="ok")
    for _ in range(2):  # the repeat, then one more, which was never in doubt
        assert (await worker.complete_handoff(handle.handoff_id, result="ok")).status is S.COMPLETED
    await real_bus.stats.flush()
    stats = await real_bus.redis.hgetall(real_bus.keys.stats("b"))
    assert (stats[b"ACCEPTED"], stats[b"COMPLETED"]) == (b"1", b"1")



async def test_a_request_whose_reply_was_lost_is_counted_once_when_resubmitted(real_bus: HandoffBus) -> None:
    """A request with the caller's own id whose reply was lost is resubmitted, as the README
    says to; the resubmission finds it made and counts it, once."""
    scripts_many = real_bus.scripts_many
    lost: list[str] = []

    async def reply_lost(calls: list) -> list:
        replies = await scripts_many(calls)
        if calls[0][0] == "request" and not lost:
            lost.append(calls[0][2][0])
            return [RedisConnectionError("connection lost")] * len(calls)
        return replies

    real_bus.scripts_many = reply_lost  # type: ignore[method-assign]
    client = real_bus.client("req")
    with pytest.raises(RedisConnectionError):
        await client.request_handoff(req("req", "b", request_id="mine"))
    for _ in range(2):  # the resubmission, then one more, never in doubt
        await client.request_handoff(req("req", "b", request_id="mine"))
    await real_bus.stats.flush()
    assert lost == ["req/mine"]
    assert await real_bus.redis.hget(real_bus.keys.stats("b"), "requested") == b"1"


async def test_a_member_of_the_agent_sets_that_is_no_agent_id_leaves_the_others_observed(real_bus: HandoffBus) -> None:
    # written by hand (or by a tool that mangled it): `handoffbus exporter` and `top` read
    # every known agent, and one such member must not stop them for all the others
    bus = real_bus
    await bus.client("req").request_handoff(req("req", "echo-1"))
    await bus.redis.sadd(bus.keys.targets, b"\xff\xfe", "not an id")
    await bus.redis.sadd(bus.keys.agents, b"\xff\xfe")
    assert await known_agents(bus) == ["echo-1"]
    [view] = await observe_agents(bus)
    assert view.agent_id == "echo-1" and view.queued == 1
    assert await bus.client("req").list_agents() == []  # `handoffbus agents` too: no live worker, no crash
