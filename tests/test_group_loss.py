"""An agent's consumer group, or its whole inbox stream, deleted under running workers: the
group is recreated, in-flight work is re-issued from the in-flight index and the records,
live handlers keep their work, a dead worker's work is taken over, and nothing spins."""

from __future__ import annotations

import anyio
import pytest

from handoffbus import HandoffBus, HandoffStatus
from handoffbus.keys import GROUP
from handoffbus.workers import Worker

from .agents import Gated, Quick, Rival
from .conftest import make_bus
from .helpers import req, response_statuses, start_worker

pytestmark = pytest.mark.anyio
S = HandoffStatus


async def delete(bus: HandoffBus, agent: str, what: str) -> None:
    inbox = bus.keys.target(agent).inbox
    if what == "group":
        assert await bus.redis.xgroup_destroy(inbox, GROUP) == 1
    else:
        assert await bus.redis.delete(inbox) == 1


async def commands_per_second(bus: HandoffBus, seconds: float) -> float:
    """The server's command rate over a window (a timer: this measures, it does not wait for anything)."""

    async def calls() -> int:
        stats = await bus.redis.info("commandstats")
        return sum(int(v["calls"]) for v in stats.values())

    before = await calls()
    await anyio.sleep(seconds)
    return (await calls() - before - 1) / seconds


@pytest.mark.parametrize("what", ["group", "stream"])
async def test_live_handlers_keep_their_work_when_the_group_is_deleted(
    real_backend: str, servers: dict, what: str
) -> None:
    idle = 0.6
    async with make_bus(real_backend, servers) as bus:
        client = bus.client("req")
        held = [await client.request_handoff(req("req", "gated-1", reason=f"h{i}")) for i in range(20)]
        agent, rival = Gated(), Rival()
        agent.want = 20
        async with anyio.create_task_group() as tg:
            worker = Worker(bus, agent, concurrency=20, reclaim_idle=idle)
            await tg.start(worker.run)
            with anyio.fail_after(10):
                await agent.reached.wait()  # all 20 accepted and in its handlers
            await delete(bus, "gated-1", what)
            other = Worker(bus, rival, concurrency=20, reclaim_idle=idle)
            await tg.start(other.run)
            # queued after the deletion: the next take recreates the group
            later = [await client.request_handoff(req("req", "gated-1", reason=f"l{i}")) for i in range(5)]
            with anyio.fail_after(10):
                for _ in range(4):  # two idle periods: a re-issued entry nobody adopted would be claimed
                    await other.wait_reclaim_pass()
            agent.gate.set()
            with anyio.fail_after(20):
                outcomes = [await h.outcome() for h in held + later]
            worker.drain()
            other.drain()
        inflight = await bus.redis.hlen(bus.keys.target("gated-1").inflight)
        pending = (await bus.redis.xpending(bus.keys.target("gated-1").inbox, GROUP))["pending"]
        for handle in held:
            assert await response_statuses(bus, "req", handle.handoff_id) == ["ACCEPTED", "COMPLETED"]
    assert all(o.status is S.COMPLETED for o in outcomes)
    assert [o.result for o in outcomes[:20]] == ["done"] * 20  # finished by the handlers that held them
    assert not set(rival.seen) & {h.handoff_id for h in held}  # none was taken over
    assert inflight == 0 and pending == 0


async def test_work_of_a_dead_worker_is_recovered_after_its_stream_is_deleted(
    real_backend: str, servers: dict
) -> None:
    idle = 1.0
    async with make_bus(real_backend, servers) as bus:
        doomed, _ = await start_worker(servers[real_backend].url, bus.config.prefix, "tests.agents:Sleepy",
                                       "--reclaim-idle", str(idle), "--concurrency", "50")
        client = bus.client("req")
        handles = [await client.request_handoff(req("req", "sleepy-1", reason=f"r{i}")) for i in range(50)]
        with anyio.fail_after(30):
            for handle in handles:
                assert (await handle.decision()).status is S.ACCEPTED
        doomed.kill()
        await doomed.wait()
        await doomed.aclose()
        await delete(bus, "sleepy-1", "stream")  # its pending entries are gone with the stream
        quick = Quick()
        async with anyio.create_task_group() as tg:
            worker = Worker(bus, quick, concurrency=50, reclaim_idle=idle)
            await tg.start(worker.run)
            with anyio.fail_after(30):
                outcomes = [await h.outcome() for h in handles]
            worker.drain()
        for handle in handles:
            assert await response_statuses(bus, "req", handle.handoff_id) == ["ACCEPTED", "COMPLETED"]
        keys = bus.keys.target("sleepy-1")
        assert await bus.redis.hlen(keys.inflight) == 0
        assert (await bus.redis.xpending(keys.inbox, GROUP))["pending"] == 0
    assert all(o.status is S.COMPLETED and o.result == {"attempt": 2, "by": "quick"} for o in outcomes)
    assert sorted(hid for hid, _ in quick.seen) == sorted(h.handoff_id for h in handles)


async def test_a_deleted_group_does_not_make_workers_spin(real_backend: str, servers: dict) -> None:
    async with make_bus(real_backend, servers) as bus:
        async with anyio.create_task_group() as tg:
            agents = [Gated() for _ in range(3)]
            workers = [Worker(bus, agent, reclaim_idle=0.3, block=0.5) for agent in agents]
            for worker in workers:
                await tg.start(worker.run)
            await bus.client("req").request_handoff(req("req", "gated-1"))  # creates the group
            baseline = await commands_per_second(bus, 1.5)
            await delete(bus, "gated-1", "group")
            after = await commands_per_second(bus, 1.5)
            for worker, agent in zip(workers, agents, strict=True):
                agent.gate.set()  # whichever holds the handoff finishes it
                worker.drain()
        print(f"\nserver commands/s with 3 idle workers: {baseline:.0f} before, {after:.0f} after the deletion")
        assert after < 2 * baseline + 20  # a hot loop would run thousands per second
