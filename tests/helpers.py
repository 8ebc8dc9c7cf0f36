"""Small helpers shared by the behavioural tests."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
from anyio.abc import Process
from anyio.streams.buffered import BufferedByteReceiveStream

from handoffbus import (
    ConversationEntry,
    HandoffBus,
    HandoffContext,
    HandoffHandle,
    HandoffRequest,
    HandoffResponse,
    HandoffStatus,
    serialize_context,
)
from handoffbus.workers import Agent, Worker

ROOT = Path(__file__).resolve().parent.parent

#: each transition: (the status it moves to, the statuses it may leave, who may make it), as
#: lua/includes/record.lua's run_transition has it; the state machine tests' model
ACTIONS: dict[str, tuple[HandoffStatus, frozenset[HandoffStatus], str]] = {
    "accept": (HandoffStatus.ACCEPTED, frozenset({HandoffStatus.PENDING}), "target"),
    "reject": (HandoffStatus.REJECTED, frozenset({HandoffStatus.PENDING}), "target"),
    "complete": (HandoffStatus.COMPLETED, frozenset({HandoffStatus.ACCEPTED}), "owner"),
    "fail": (HandoffStatus.FAILED, frozenset({HandoffStatus.ACCEPTED}), "owner"),
    "cancel": (HandoffStatus.CANCELLED, frozenset({HandoffStatus.PENDING}), "requester"),
}

#: a context of 8 messages, over ``scripts.INLINE_ENVELOPE``: its envelope goes by plain SET and GET
LARGE = serialize_context(HandoffContext(conversation_history=[
    ConversationEntry(role="user", content=f"{i}:" + "h" * 4096) for i in range(8)]))


async def start_worker(url: str, prefix: str, agent: str, *extra: str) -> tuple[Process, BufferedByteReceiveStream]:
    """A ``handoffbus worker`` process serving ``agent`` (tests.agents:Name), once it says it
    serves; with its stdout, to read the lines it prints after that."""
    process = await anyio.open_process(
        [sys.executable, "-m", "handoffbus", "worker", agent, "--redis-url", url, "--prefix", prefix, *extra],
        cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert process.stdout is not None
    lines = BufferedByteReceiveStream(process.stdout)
    with anyio.fail_after(30):
        assert b"serving" in await lines.receive_until(b"\n", 4096)
    return process, lines


@asynccontextmanager
async def handoffbus_process(*args: str, ready: bytes, env: dict[str, str] | None = None) -> AsyncIterator[Process]:
    """A ``handoffbus`` command in its own process, once it printed ``ready``; stopped with
    SIGTERM after the block, which it must answer by exiting 0."""
    process = await anyio.open_process([sys.executable, "-m", "handoffbus", *args], cwd=ROOT,
                                       env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
    try:
        assert process.stdout is not None
        with anyio.fail_after(30):
            assert ready in await process.stdout.receive()
        yield process
    finally:
        process.terminate()
        with anyio.fail_after(30):
            assert await process.wait() == 0
        await process.aclose()


def req(frm: str, to: str, **kw: Any) -> HandoffRequest:
    kw.setdefault("reason", "test")
    kw.setdefault("timeout", 60.0)
    return HandoffRequest(from_agent=frm, to_agent=to, **kw)


def routed(caps: Sequence[str], **kw: Any) -> HandoffRequest:
    """A capability-routed request: no target agent, only the capabilities it needs."""
    kw.setdefault("reason", "r")
    return HandoffRequest(from_agent="req", to_agent="", capabilities_required=list(caps), **kw)


@asynccontextmanager
async def serving(bus: HandoffBus, *agents: Agent, **options: Any) -> AsyncIterator[list[Worker]]:
    """Workers for ``agents`` while the block runs; drained after it."""
    async with anyio.create_task_group() as tg:
        workers = [Worker(bus, agent, **options) for agent in agents]
        for worker in workers:
            await tg.start(worker.run)
        yield workers
        for worker in workers:
            worker.drain()


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


async def live(bus: HandoffBus, agent: str, consumer: str) -> None:
    """Register a live worker of ``agent`` (capability x) without running one."""
    info = json.dumps({"consumer": consumer, "state": "RUNNABLE", "load": 0, "limit": 4,
                       "capabilities": ["x"], "started_ms": 0, "ttl_ms": 60000})
    await bus.script("register", [bus.keys.workers(agent), bus.keys.worker_beat(agent, consumer)],
                     [consumer, info, 60000])
    await bus.redis.sadd(bus.keys.agents, agent)


def first_call_fails(
    call: Callable[..., Awaitable[Any]], error: BaseException
) -> tuple[Callable[..., Awaitable[Any]], anyio.Event]:
    """``call`` wrapped so that its first call raises ``error`` (setting the event) and the
    later ones go through: a step whose connection dropped once."""
    failed = anyio.Event()

    async def wrapped(*args: Any, **kwargs: Any) -> Any:
        if not failed.is_set():
            failed.set()
            raise error
        return await call(*args, **kwargs)

    return wrapped, failed


async def blocked_clients(admin: Any, count: int, command: str | None = None) -> list[int]:
    """Ids of clients blocked in a command (``command``, lower case, if given), once there are
    ``count`` of them."""
    with anyio.fail_after(10):
        while True:
            clients = await admin.client_list()
            blocked = [int(c["id"]) for c in clients if "b" in c["flags"] and command in (None, c["cmd"])]
            if len(blocked) >= count:
                return blocked
            await anyio.sleep(0.01)  # polling the server's client list: it has no change event
