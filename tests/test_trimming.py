"""Streams stay bounded: responses are trimmed by age, inbox entries leave only when settled,
and an unacknowledged entry is never deleted."""

from __future__ import annotations

import anyio
import msgspec
import pytest

from handoffbus import HandoffStatus, QueueFull, Worker

from .agents import Gated
from .conftest import make_bus
from .helpers import req

pytestmark = pytest.mark.anyio


async def test_response_stream_is_trimmed_by_age_and_outcomes_stay_readable(
    real_backend: str, servers: dict
) -> None:
    async with make_bus(real_backend, servers, response_retention=0.001) as bus:
        client, target = bus.client("req"), bus.client("echo-1")
        handles = [await client.request_handoff(req("req", "echo-1", reason=f"r{i}")) for i in range(300)]
        for handle in handles:
            await target.accept_handoff(handle.handoff_id)
            await target.complete_handoff(handle.handoff_id, result=handle.request_id)
        responses = await bus.redis.xlen(bus.keys.responses("req"))
        # 600 responses were written; whole stream nodes older than the retention are gone
        assert responses < 300
        # the outcome of a trimmed response is still on its record
        with anyio.fail_after(10):
            first = await handles[0].outcome()
        assert first.status is HandoffStatus.COMPLETED and first.result == handles[0].request_id


async def test_inbox_holds_exactly_the_unacknowledged_entries(real_backend: str, servers: dict) -> None:
    async with make_bus(real_backend, servers) as bus:
        client = bus.client("req")
        inbox = bus.keys.target("gated-1").inbox
        agent = Gated()
        agent.want = 6
        handles = [await client.request_handoff(req("req", "gated-1", reason=f"r{i}")) for i in range(40)]
        async with anyio.create_task_group() as tg:
            worker = Worker(bus, agent, concurrency=6)
            await tg.start(worker.run)
            with anyio.fail_after(10):
                await agent.reached.wait()
            # six in hand, unacknowledged: all six entries are in the stream, and nothing else
            pending = await bus.redis.xpending(inbox, "workers")
            assert pending["pending"] == 6 and await bus.redis.xlen(inbox) == 6
            agent.gate.set()
            with anyio.fail_after(30):
                outcomes = [await h.outcome() for h in handles]
            worker.drain()
        assert {o.status for o in outcomes} == {HandoffStatus.COMPLETED}
        # every entry was settled (acknowledged, then deleted): the inbox is empty again
        assert (await bus.redis.xpending(inbox, "workers"))["pending"] == 0
        assert await bus.redis.xlen(inbox) == 0
        assert await bus.redis.xlen(bus.keys.target("gated-1").bell) == 1


async def test_an_agent_at_its_cap_pushes_back_on_producers_and_loses_nothing(
    real_backend: str, servers: dict
) -> None:
    cap = 1000
    async with make_bus(real_backend, servers, max_queued=cap) as bus:
        client = bus.client("req")
        inbox = bus.keys.target("gated-1").inbox
        agent = Gated()
        agent.want = cap
        requests = [req("req", "gated-1", reason=f"h{i}", metadata={"n": i}) for i in range(cap)]
        held = [await client.request_handoff(r) for r in requests]
        async with anyio.create_task_group() as tg:
            worker = Worker(bus, agent, concurrency=cap)
            await tg.start(worker.run)
            with anyio.fail_after(30):
                await agent.reached.wait()
            # 1,000 unacknowledged entries: the inbox is at its cap, and keeps every one of them
            assert (await bus.redis.xpending(inbox, "workers"))["pending"] == cap
            assert await bus.redis.xlen(inbox) == cap
            refused: list[QueueFull] = []

            async def producer(p: int) -> None:
                for i in range(50):
                    with pytest.raises(QueueFull) as caught:
                        await client.request_handoff(req("req", "gated-1", reason="more", request_id=f"p{p}-{i}"))
                    refused.append(caught.value)

            async with anyio.create_task_group() as producers:
                for p in range(4):
                    producers.start_soon(producer, p)
            assert len(refused) == 200 and {e.target for e in refused} == {"gated-1"}
            for error in refused:  # refused before anything was left behind
                assert await client.get_handoff_status(error.handoff_id) is None
            # a resubmission of a handoff already in flight is no new work: not refused
            again = await client.request_handoff(msgspec.structs.replace(requests[0], request_id=held[0].request_id))
            assert again.handoff_id == held[0].handoff_id
            assert await bus.redis.xlen(inbox) == cap and await bus.redis.zcard(bus.keys.target("gated-1").queue) == 0
            agent.gate.set()
            with anyio.fail_after(60):
                outcomes = [await h.outcome() for h in held]
            # a worker settles finished handoffs (frees their places) after their outcomes are
            # sent, and a drained one has settled them all
            worker.drain()
        # room again: the refused requests go through with the same request ids
        retried = [await client.request_handoff(req("req", "gated-1", reason="more", request_id=f"p0-{i}"))
                   for i in range(50)]
        async with anyio.create_task_group() as tg:
            worker = Worker(bus, agent, concurrency=cap)
            await tg.start(worker.run)
            with anyio.fail_after(30):
                later = [await h.outcome() for h in retried]
            worker.drain()
    assert [o.status for o in outcomes + later] == [HandoffStatus.COMPLETED] * (cap + 50)
    assert [o.request_id for o in outcomes] == [h.request_id for h in held]
