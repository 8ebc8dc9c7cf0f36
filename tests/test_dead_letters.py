"""Poison handoffs go to the dead-letter stream; workers carry on; dead letters replay."""

from __future__ import annotations

import anyio
import pytest

from handoffbus import HandoffBus, HandoffNotFound, HandoffStatus
from handoffbus.workers import Worker
from handoffbus.workers.inbox import Inbox

from .agents import Echo
from .helpers import req, serve_until_done

pytestmark = pytest.mark.anyio


async def test_an_undecodable_record_is_dead_lettered_and_the_worker_carries_on(bus: HandoffBus) -> None:
    client = bus.client("req")
    poison = await client.request_handoff(req("req", "echo-1", reason="poison", request_id="bad"))
    good = [await client.request_handoff(req("req", "echo-1", reason=f"ok{i}")) for i in range(3)]
    await bus.redis.hset(bus.keys.record("req", "bad").record, "env", b"\xc1 not a request")
    outcomes, worker = await serve_until_done(bus, Echo(), good)
    assert all(o.status is HandoffStatus.COMPLETED for o in outcomes)
    [dead] = await client.get_dead_letters("echo-1")
    assert dead.handoff_id == poison.handoff_id and dead.deliveries == 1
    assert "DecodeError" in dead.reason and dead.consumer == worker.consumer
    inbox = bus.keys.target("echo-1").inbox
    assert (await bus.redis.xpending(inbox, "workers"))["pending"] == 0  # acknowledged, not stuck


async def test_an_entry_delivered_too_often_is_dead_lettered_then_replayed(bus: HandoffBus) -> None:
    client = bus.client("req")
    handle = await client.request_handoff(req("req", "echo-1", reason="crashy"))
    ghost = Inbox(bus, "echo-1", "ghost")  # a worker that took it and kept dying
    _, [taken] = await ghost.take(1)
    inbox = bus.keys.target("echo-1").inbox
    await bus.redis.xclaim(inbox, "workers", "ghost", 0, [taken.entry_id], idle=60_000, retrycount=7)
    async with anyio.create_task_group() as tg:
        worker = Worker(bus, Echo(), reclaim_idle=0.2, max_deliveries=5)
        await tg.start(worker.run)
        with anyio.fail_after(10):
            while not await client.get_dead_letters("echo-1"):
                await worker.wait_reclaim_pass()
        [dead] = await client.get_dead_letters("echo-1")
        assert dead.handoff_id == handle.handoff_id and dead.deliveries == 8
        record = await client.get_handoff_status(handle.handoff_id)
        assert record is not None and record.status is HandoffStatus.PENDING  # parked, not lost
        assert await client.replay_dead_letter("echo-1", dead.entry_id) is True
        with anyio.fail_after(10):
            outcome = await handle.outcome()
        worker.drain()
    assert outcome.status is HandoffStatus.COMPLETED
    assert await client.get_dead_letters("echo-1") == []
    with pytest.raises(HandoffNotFound):
        await client.replay_dead_letter("echo-1", dead.entry_id)
