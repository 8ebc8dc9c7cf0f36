"""Small helpers shared by the behavioural tests."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import anyio

from handoffbus import HandoffBus, HandoffHandle, HandoffRequest, HandoffResponse
from handoffbus.workers import Agent, Worker


def req(frm: str, to: str, **kw: Any) -> HandoffRequest:
    kw.setdefault("reason", "test")
    kw.setdefault("timeout", 60.0)
    return HandoffRequest(from_agent=frm, to_agent=to, **kw)


async def prefix_keys(bus: HandoffBus) -> list[bytes]:
    """Every key of the bus's prefix except the sweep lease, which any open bus refreshes."""
    lease = bus.keys.sweep_lease.encode()
    return sorted([k async for k in bus.redis.scan_iter(match=bus.keys.pattern()) if k != lease])


async def response_statuses(bus: HandoffBus, requester: str, handoff_id: str) -> list[str]:
    entries = await bus.redis.xrange(bus.keys.responses(requester))
    return [f[b"status"].decode() for _, f in entries if f[b"id"].decode() == handoff_id]


async def serve_until_done(
    bus: HandoffBus, agent: Agent, handles: Sequence[HandoffHandle], **options: Any
) -> tuple[list[HandoffResponse], Worker]:
    """Run a worker for ``agent`` until every handle has its outcome; the outcomes and the worker."""
    async with anyio.create_task_group() as tg:
        worker = Worker(bus, agent, **options)
        await tg.start(worker.run)
        with anyio.fail_after(30):
            outcomes = [await h.outcome() for h in handles]
        worker.drain()
    return outcomes, worker
