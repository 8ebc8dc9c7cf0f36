"""Crash recovery with real worker processes: SIGKILL, a frozen zombie, heartbeats."""

from __future__ import annotations

import signal

import anyio
import pytest

from handoffbus import HandoffBus, HandoffStatus
from handoffbus.keys import GROUP
from handoffbus.workers import Worker

from .agents import Gated, Quick, Rival, Sleepy
from .conftest import make_bus
from .helpers import req, response_statuses, start_worker

pytestmark = pytest.mark.anyio
IDLE = 1.0


async def wait_accepted(bus: HandoffBus, handles: list) -> None:
    with anyio.fail_after(30):
        for handle in handles:
            assert (await handle.decision()).status is HandoffStatus.ACCEPTED


async def test_work_of_a_killed_worker_is_finished_by_another(real_backend: str, servers: dict) -> None:
    async with make_bus(real_backend, servers) as bus:
        doomed, _ = await start_worker(servers[real_backend].url, bus.config.prefix, "tests.agents:Sleepy",
                                       "--reclaim-idle", str(IDLE), "--concurrency", "500")
        client = bus.client("req")
        handles = [await client.request_handoff(req("req", "sleepy-1", reason=f"r{i}")) for i in range(500)]
        await wait_accepted(bus, handles)  # all 500 in the doomed worker's hands
        doomed.kill()
        await doomed.wait()
        killed_at = anyio.current_time()
        quick = Quick()
        async with anyio.create_task_group() as tg:
            worker = Worker(bus, quick, concurrency=500, reclaim_idle=IDLE)
            await tg.start(worker.run)
            with anyio.fail_after(30):
                outcomes = [await h.outcome() for h in handles]
            recovered_in = anyio.current_time() - killed_at
            worker.drain()
        await doomed.aclose()
        print(f"\n500 handoffs of a SIGKILLed worker finished in {recovered_in:.2f}s (idle {IDLE}s)")
        assert recovered_in <= IDLE + 2
        assert all(
            o.status is HandoffStatus.COMPLETED and o.result == {"attempt": 2, "by": "quick"} for o in outcomes
        )
        for handle in handles:
            assert await response_statuses(bus, "req", handle.handoff_id) == ["ACCEPTED", "COMPLETED"]
        assert (await bus.redis.xpending(bus.keys.target("sleepy-1").inbox, "workers"))["pending"] == 0


async def test_a_frozen_worker_cannot_write_an_outcome_when_it_wakes(real_backend: str, servers: dict) -> None:
    async with make_bus(real_backend, servers) as bus:
        zombie, _ = await start_worker(servers[real_backend].url, bus.config.prefix, "tests.agents:Sleepy",
                                       "--reclaim-idle", str(IDLE))
        handle = await bus.client("req").request_handoff(
            req("req", "sleepy-1", reason="z", metadata={"work_s": 3 * IDLE})
        )
        await wait_accepted(bus, [handle])
        zombie.send_signal(signal.SIGSTOP)  # frozen past the idle time: its work is taken over
        stopped_at = anyio.current_time()
        quick = Quick()
        async with anyio.create_task_group() as tg:
            worker = Worker(bus, quick, reclaim_idle=IDLE)
            await tg.start(worker.run)
            with anyio.fail_after(30):
                outcome = await handle.outcome()
            taken_over_in = anyio.current_time() - stopped_at
            await anyio.sleep(max(0.0, stopped_at + 2 * IDLE - anyio.current_time()))  # a timer: frozen 2 x idle
            frozen_for = anyio.current_time() - stopped_at
            zombie.send_signal(signal.SIGCONT)  # it wakes, finishes its sleep and tries to complete
            zombie.send_signal(signal.SIGTERM)  # drain: its handler finishes within the grace period
            with anyio.fail_after(30):
                assert await zombie.wait() == 0
            worker.drain()
        await zombie.aclose()
        print(f"\nzombie frozen {frozen_for:.2f}s (idle {IDLE}s); its work finished by another in {taken_over_in:.2f}s")
        assert outcome.result == {"attempt": 2, "by": "quick"}
        assert await response_statuses(bus, "req", handle.handoff_id) == ["ACCEPTED", "COMPLETED"]
        record = await bus.client("req").get_handoff_status(handle.handoff_id)
        assert record is not None and [h.status for h in record.history] == [
            HandoffStatus.PENDING, HandoffStatus.ACCEPTED, HandoffStatus.COMPLETED]


async def test_a_long_handler_keeps_its_work_with_heartbeats(backend: str, servers: dict) -> None:
    idle = 0.3
    async with make_bus(backend, servers) as bus:
        handle = await bus.client("req").request_handoff(
            req("req", "sleepy-1", reason="long", metadata={"work_s": 3 * idle})
        )
        rival = Quick()  # another live worker of the agent, looking for idle work all along
        async with anyio.create_task_group() as tg:
            holder = Worker(bus, Sleepy(), reclaim_idle=idle)
            await tg.start(holder.run)
            await wait_accepted(bus, [handle])
            other = Worker(bus, rival, reclaim_idle=idle)
            await tg.start(other.run)
            with anyio.fail_after(30):
                outcome = await handle.outcome()
            holder.drain()
            other.drain()
    assert outcome.result == {"attempt": 1, "by": "sleepy"}
    assert rival.seen == []  # never redelivered


async def test_a_worker_resumes_by_itself_after_the_server_restarts(real_backend: str) -> None:
    from handoffbus import EmbeddedServer

    from .agents import Echo
    from .conftest import SERVER_BINARIES

    server = EmbeddedServer(binary=SERVER_BINARIES[real_backend],
                            extra_args=("--appendonly", "yes", "--appendfsync", "always"))
    async with server, HandoffBus.connect(server.url, prefix="restart") as bus:
        client = bus.client("req")
        async with anyio.create_task_group() as tg:
            worker = Worker(bus, Echo(), block=0.2, reclaim_idle=1.0)
            await tg.start(worker.run)
            before = [await client.request_handoff(req("req", "echo-1", reason=f"b{i}")) for i in range(10)]
            with anyio.fail_after(10):
                first = [await h.outcome() for h in before]
            assert all(o.status is HandoffStatus.COMPLETED for o in first)
            server.restart()
            await server.wait_ready()
            after = [await client.request_handoff(req("req", "echo-1", reason=f"a{i}")) for i in range(10)]
            with anyio.fail_after(20):
                outcomes = [await h.outcome() for h in after]
            worker.drain()
        assert all(o.status is HandoffStatus.COMPLETED for o in outcomes)
        record = await client.get_handoff_status(before[0].handoff_id)
        assert record is not None and record.status is HandoffStatus.COMPLETED  # survived the restart


async def test_a_worker_that_loses_the_accept_leaves_the_winners_entry(backend: str, servers: dict) -> None:
    """A slow worker's entry is claimed by another worker of the agent, which accepts. The slow
    one's accept is refused; it must not settle the entry the winner works under, or a winner
    that then stops would leave the handoff ACCEPTED with nothing to reclaim it."""
    async with make_bus(backend, servers) as bus:
        client = bus.client("req")
        handle = await client.request_handoff(req("req", "gated-1", reason="twice"))
        slow = Gated(hold_in_acceptance=True)
        slow.want = 1
        keys = bus.keys.target("gated-1")
        async with anyio.create_task_group() as tg:
            loser = Worker(bus, slow, consumer="slow", reclaim_idle=60)  # no heartbeat in this test
            await tg.start(loser.run)
            with anyio.fail_after(10):
                await slow.reached.wait()
            [entry] = (await bus.redis.hgetall(keys.inflight)).values()
            await bus.redis.xclaim(keys.inbox, GROUP, "winner", 0, [entry])  # what an idle claim does
            await bus.client("gated-1")._transition("accept", handle.handoff_id, {"lease": "winner"}, settle=False)
            slow.gate.set()  # the slow worker's accept now meets ACCEPTED
            loser.drain()  # returns once its handler ended and what it finished is settled
        pending = await bus.redis.xpending_range(keys.inbox, GROUP, min="-", max="+", count=10)
        assert [(p["message_id"], p["consumer"]) for p in pending] == [(entry, b"winner")]
        rival = Rival()  # the winner stopped: a live worker takes its work over
        async with anyio.create_task_group() as tg:
            rescuer = Worker(bus, rival, consumer="rescuer", reclaim_idle=0.2)
            await tg.start(rescuer.run)
            with anyio.fail_after(10):
                outcome = await handle.outcome()
            rescuer.drain()
    assert outcome.status is HandoffStatus.COMPLETED and outcome.result == "rival"
    assert rival.seen == [handle.handoff_id]


async def test_the_group_keeps_no_consumer_of_a_worker_that_is_gone(bus: HandoffBus) -> None:
    """Every worker process joins its agent's group under a name of its own. One that leaves
    cleanly takes its consumer out of the group; one that died is retired by a live worker
    once its entries were taken over. A live worker's is kept, even holding nothing, and so
    is a gone one's while it still holds an entry (deleting it would strand that entry)."""
    from handoffbus.workers.inbox import Inbox

    from .agents import Echo

    client = bus.client("req")
    inbox = bus.keys.target("echo-1").inbox

    async def consumers() -> dict[str, int]:
        return {r["name"].decode(): r["pending"] for r in await bus.redis.xinfo_consumers(inbox, GROUP)}

    first = await client.request_handoff(req("req", "echo-1"))
    async with anyio.create_task_group() as tg:
        left = Worker(bus, Echo())
        await tg.start(left.run)
        with anyio.fail_after(10):
            await first.outcome()
        left.drain()
    assert left.consumer not in await consumers()  # it left cleanly: out of the group

    # a worker that died holding an entry, and one that died holding nothing
    held = await client.request_handoff(req("req", "echo-1"))
    dead = Inbox(bus, "echo-1", "dead-holding")
    _, [taken] = await dead.take(1)
    idle_live = Inbox(bus, "echo-1", "live-idle")  # registered, holding nothing
    for name in ("dead-empty", "live-idle"):  # joined the group, took nothing
        await bus.redis.xgroup_createconsumer(inbox, GROUP, name)
    await bus.redis.set(bus.keys.worker_beat("echo-1", "live-idle"), "{}", px=60_000)
    assert (await dead.retire(["dead-holding"]), await idle_live.retire(["live-idle"])) == (0, 0)
    assert set(await consumers()) == {"dead-holding", "dead-empty", "live-idle"}

    async with anyio.create_task_group() as tg:
        worker = Worker(bus, Echo(), reclaim_idle=0.05)
        await tg.start(worker.run)
        with anyio.fail_after(10):
            await held.outcome()  # taken over from the dead worker
            while set(await consumers()) - {worker.consumer} != {"live-idle"}:
                await worker.wait_reclaim_pass()
        worker.drain()
    assert taken.handoff_id == held.handoff_id
    assert set(await consumers()) == {"live-idle"}


async def test_a_worker_that_lost_contact_claims_nothing_until_contact_held_for_a_while(bus: HandoffBus) -> None:
    """After an outage every worker's entries look idle (their beats failed too; a server's
    idle times run on while it is down): a worker that lost contact claims nothing until it
    has had ``reclaim_idle`` of unbroken contact, time for the holders to beat again."""
    from redis.exceptions import ConnectionError as RedisConnectionError

    from handoffbus.workers.inbox import Inbox

    from .agents import Echo

    client = bus.client("req")
    handle = await client.request_handoff(req("req", "echo-1"))
    _, [taken] = await Inbox(bus, "echo-1", "holder").take(1)
    inbox = bus.keys.target("echo-1").inbox
    await bus.redis.xclaim(inbox, GROUP, "holder", 0, [taken.entry_id], idle=60_000)  # it looks idle

    async def holder() -> str:
        [row] = await bus.redis.xpending_range(inbox, GROUP, min=taken.entry_id, max=taken.entry_id, count=1)
        return str(row["consumer"].decode())

    async with anyio.create_task_group() as tg:
        worker = Worker(bus, Echo(), reclaim_idle=1.0)
        await tg.start(worker.run)
        probe, lost = bus.server_time_ms, []

        async def lost_once() -> int:
            if not lost:
                lost.append("the reclaim's probe")
                raise RedisConnectionError("connection lost")
            return await probe()

        bus.server_time_ms = lost_once  # type: ignore[method-assign]
        with anyio.fail_after(10):
            while not lost:
                await worker.wait_reclaim_pass()
            await worker.wait_reclaim_pass()  # the next pass, half a reclaim_idle later
            assert await holder() == "holder"  # not taken while contact is fresh
            assert (await handle.outcome()).status is HandoffStatus.COMPLETED  # taken over later
        worker.drain()


async def test_a_reclaim_that_fails_after_claiming_does_not_use_up_deliveries(bus: HandoffBus) -> None:
    """XAUTOCLAIM raises an entry's delivery count as it claims it. A reclaim whose next step
    fails (a connection lost while loading the records) handled nothing: that claim must not
    count as a delivery, or a few transient errors dead-letter a handoff no worker tried."""
    from redis.exceptions import ConnectionError as RedisConnectionError

    from handoffbus.workers.inbox import Inbox

    from .agents import Echo

    client = bus.client("req")
    handle = await client.request_handoff(req("req", "echo-1"))
    _, [taken] = await Inbox(bus, "echo-1", "holder").take(1)  # its worker died: delivery 1
    inbox = bus.keys.target("echo-1").inbox
    await bus.redis.xclaim(inbox, GROUP, "holder", 0, [taken.entry_id], idle=60_000, retrycount=1)  # idle
    load, failed = bus.load_records, []

    async def flaky(handoff_ids):  # type: ignore[no-untyped-def]
        if len(failed) < 4:  # four reclaims in a row lose their connection after claiming
            failed.append(handoff_ids)
            raise RedisConnectionError("connection lost")
        return await load(handoff_ids)

    bus.load_records = flaky  # type: ignore[method-assign]
    echo = Echo()
    async with anyio.create_task_group() as tg:
        worker = Worker(bus, echo, reclaim_idle=0.1, max_deliveries=5)
        await tg.start(worker.run)
        with anyio.fail_after(10):
            while True:
                record = await client.get_handoff_status(handle.handoff_id)
                if await client.get_dead_letters("echo-1") or record.status is HandoffStatus.COMPLETED:
                    break
                await worker.wait_reclaim_pass()
        worker.drain()
    assert len(failed) == 4
    assert await client.get_dead_letters("echo-1") == []  # tried once only: never poison
    assert record.status is HandoffStatus.COMPLETED and echo.order == [handle.handoff_id]


async def test_the_registry_keeps_no_entry_of_a_worker_that_is_gone(bus: HandoffBus) -> None:
    """A worker process that died (SIGKILL, OOM) never deregisters. Its entry in the agent's
    workers hash must go once it is gone, as its consumer does: on a bus whose requests are
    all addressed (nothing routes or lists agents), every crashed process stayed listed for
    ever, one more hash field per restart."""
    import json

    from handoffbus.workers.inbox import Inbox

    from .agents import Echo

    client = bus.client("req")
    workers = bus.keys.workers("echo-1")
    # two processes that registered and died: one holding a handoff, one that took nothing
    for name in ("dead-holding", "dead-idle"):
        info = json.dumps({"consumer": name, "state": "RUNNABLE", "load": 0, "limit": 4, "capabilities": [],
                           "started_ms": 0, "ttl_ms": 3000})
        await bus.script("register", [workers, bus.keys.worker_beat("echo-1", name)], [name, info, 3000])
    held = await client.request_handoff(req("req", "echo-1"))
    _, [taken] = await Inbox(bus, "echo-1", "dead-holding").take(1)
    for name in ("dead-holding", "dead-idle"):  # their heartbeats ran out
        await bus.redis.delete(bus.keys.worker_beat("echo-1", name))
    inbox = bus.keys.target("echo-1").inbox
    async with anyio.create_task_group() as tg:
        worker = Worker(bus, Echo(), reclaim_idle=0.05)
        await tg.start(worker.run)
        with anyio.fail_after(10):
            await held.outcome()  # taken over from the dead worker
            while {r["name"] for r in await bus.redis.xinfo_consumers(inbox, GROUP)} != {worker.consumer.encode()}:
                await worker.wait_reclaim_pass()  # its consumer retired
            await worker.wait_reclaim_pass()
            live = set(await bus.redis.hkeys(workers))
        worker.drain()
    assert taken.handoff_id == held.handoff_id
    assert live == {worker.consumer.encode()}  # the live worker only: the dead ones are forgotten
    assert await bus.redis.hkeys(workers) == []
