"""The live registry: workers announce agent, capabilities, state and load; the dead age out."""

from __future__ import annotations

import anyio
import msgspec
import pytest

from handoffbus import HandoffBus
from handoffbus.workers import Worker

from .agents import Echo, SyncEcho

pytestmark = pytest.mark.anyio


async def test_live_workers_are_listed_and_leave_cleanly(bus: HandoffBus) -> None:
    client = bus.client("ops")
    assert await client.list_agents() == []
    first = Worker(bus, Echo(), concurrency=3)
    second = Worker(bus, Echo(), concurrency=5)
    other = Worker(bus, SyncEcho(), concurrency=1)
    async with anyio.create_task_group() as tg:
        await tg.start(second.run)
        await tg.start(other.run)
        async with anyio.create_task_group() as own:
            await own.start(first.run)  # registered before it reports ready
            agents = await client.list_agents()
            assert [a.agent_id for a in agents] == ["echo-1", "sync-1"]
            echo = agents[0]
            assert echo.capabilities == ["echo"] and echo.limit == 8 and echo.load == 0
            assert sorted(w.consumer for w in echo.workers) == sorted([first.consumer, second.consumer])
            assert all(w.state == "RUNNABLE" and w.beat_ms >= w.started_ms > 0 for w in echo.workers)
            beat_key = bus.keys.worker_beat("echo-1", first.consumer)
            assert 0 < await bus.redis.pttl(beat_key) <= 3000
            first.drain()  # leaving this block waits for its run() to return
        assert await bus.redis.exists(beat_key) == 0
        [echo] = [a for a in await client.list_agents() if a.agent_id == "echo-1"]
        assert [w.consumer for w in echo.workers] == [second.consumer]
        second.drain()
        other.drain()
    assert await client.list_agents() == []


async def test_a_dead_worker_ages_out(bus: HandoffBus) -> None:
    client = bus.client("ops")
    long_ago = {"consumer": "crashed-1", "state": "RUNNABLE", "load": 2, "limit": 4, "capabilities": ["echo"],
                "started_ms": 1, "ttl_ms": 3000, "beat_ms": 2}
    await bus.redis.sadd(bus.keys.agents, "echo-1")
    await bus.redis.hset(bus.keys.workers("echo-1"), "crashed-1", msgspec.json.encode(long_ago))
    assert await client.list_agents() == []  # not live
    assert await bus.redis.hlen(bus.keys.workers("echo-1")) == 0  # and forgotten
