"""Small helpers shared by the behavioural tests."""

from __future__ import annotations

from typing import Any

from handoffbus import HandoffBus, HandoffRequest


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
