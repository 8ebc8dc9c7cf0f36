"""Awaiting is push: many waiters share one reader and one connection."""

from __future__ import annotations

from typing import Any

import anyio
import pytest
import redis.asyncio as aioredis

from handoffbus import HandoffBus, HandoffNotFound, HandoffResponse, HandoffStatus

from .conftest import SERVER_BINARIES, Servers, new_prefix
from .helpers import req

pytestmark = pytest.mark.anyio


async def connections(bus: HandoffBus) -> int:
    return len(await bus.redis.client_list())


async def test_two_hundred_waiters_open_no_connections(real_bus: HandoffBus) -> None:
    a, b = real_bus.client("a"), real_bus.client("b")
    handles = [await a.request_handoff(req("a", "b")) for _ in range(200)]
    before = await connections(real_bus)
    decisions: list[HandoffResponse] = []
    waiting = 0
    all_waiting = anyio.Event()

    async def wait(handle: object) -> None:
        nonlocal waiting
        assert hasattr(handle, "decision")
        waiting += 1
        if waiting == len(handles):
            all_waiting.set()
        decisions.append(await handle.decision())

    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            for handle in handles:
                tg.start_soon(wait, handle)
            await all_waiting.wait()
            during = await connections(real_bus)
            for handle in handles:
                await b.accept_handoff(handle.handoff_id)
    assert before <= 4, "one reader, one sweeper, one command connection"
    assert during <= before + 1
    assert len(decisions) == 200 and all(d.status is HandoffStatus.ACCEPTED for d in decisions)
    assert len(real_bus._readers) == 1


async def test_waiters_on_several_requesters_each_get_their_own_answers(bus: HandoffBus) -> None:
    clients = [bus.client(f"req-{i}") for i in range(5)]
    target = bus.client("t")
    handles = [await c.request_handoff(req(c.agent_id, "t")) for c in clients for _ in range(3)]
    for n, handle in enumerate(handles):
        await target.accept_handoff(handle.handoff_id)
        await target.complete_handoff(handle.handoff_id, result=n)
    with anyio.fail_after(10):
        outcomes = [await h.outcome() for h in handles]
    assert [o.result for o in outcomes] == list(range(len(handles)))
    assert all(o.handoff_id == h.handoff_id for o, h in zip(outcomes, handles, strict=True))


async def test_a_burst_of_concurrent_first_requests(real_bus: HandoffBus) -> None:
    a = real_bus.client("burst")
    handles: list[object] = []

    async def send(i: int) -> None:
        handles.append(await a.request_handoff(req("burst", "t", request_id=f"r{i}")))

    async with anyio.create_task_group() as tg:
        for i in range(150):
            tg.start_soon(send, i)
    assert len(handles) == 150
    assert await real_bus.redis.zcard(real_bus.keys.target("t").queue) == 150
    assert await real_bus.redis.smembers(real_bus.keys.requesters) == {b"burst"}


async def test_an_idle_reader_outlasts_the_client_library_socket_timeout(
    real_bus: HandoffBus, caplog: pytest.LogCaptureFixture
) -> None:
    # redis-py 8 gives connections a 5 s socket timeout unless told otherwise; a reader in
    # XREAD BLOCK 5000 (read_block's default) must not be cut off and reconnect
    handle = await real_bus.client("a").request_handoff(req("a", "nobody", timeout=5.6))
    with anyio.fail_after(10):
        assert (await handle.decision()).status is HandoffStatus.EXPIRED
    assert not [r for r in caplog.records if "lost its connection" in r.getMessage()]


async def test_a_resync_outlives_records_that_are_gone(bus: HandoffBus) -> None:
    alice = bus.client("alice")
    await alice.request_handoff(req("alice", "bob"))  # alice's reader runs
    reader = bus.reader("alice", alice._refresh)
    with pytest.raises(HandoffNotFound):
        await alice.handle("alice/gone").decision()
    assert not reader.watching("alice/gone")  # found gone: nothing more can come for it
    # one watched while its record went (past retention), or before its request is written:
    # the pass after a lost connection re-reads every watched record, and must not end the
    # reader (nor the bus with it), nor drop a waiter whose request is about to be written
    reader.watch("alice/not-written-yet")
    await reader._resync()
    assert reader.watching("alice/not-written-yet")


async def test_a_handoff_resubmitted_after_its_outcome_is_not_watched(bus: HandoffBus) -> None:
    alice = bus.client("alice")
    first = await alice.request_handoff(req("alice", "bob", request_id="r1"))
    await first.cancel()
    again = await alice.request_handoff(req("alice", "bob", request_id="r1"))
    assert (await again.outcome()).status is HandoffStatus.CANCELLED
    assert not bus.reader("alice", alice._refresh).watching(again.handoff_id)


async def test_a_request_that_fails_or_is_cancelled_leaves_no_waiter(bus: HandoffBus) -> None:
    """A request that raises before its scripts run, or is cancelled while they run, gave the
    caller no handle: its waiter does not stay behind (re-read on every resync, for good)."""
    alice = bus.client("alice")
    reader = bus.reader("alice", alice._refresh)
    scripts_many, register_target = bus.scripts_many, bus.register_target
    sent = anyio.Event()

    async def never_answered(calls: Any) -> list[Any]:
        sent.set()
        await anyio.sleep_forever()
        raise AssertionError

    async def unreachable(agent: str) -> None:
        raise ConnectionError("the server went away")

    bus.register_target = unreachable  # type: ignore[method-assign]
    with pytest.raises(ConnectionError):
        await alice.request_handoff(req("alice", "bob", request_id="r1"))
    assert not reader.watching("alice/r1")
    bus.register_target = register_target  # type: ignore[method-assign]
    bus.scripts_many = never_answered  # type: ignore[method-assign]
    async with anyio.create_task_group() as tg:
        tg.start_soon(alice.request_handoff, req("alice", "bob", request_id="r2"))
        await sent.wait()
        tg.cancel_scope.cancel()
    bus.scripts_many = scripts_many  # type: ignore[method-assign]
    assert not reader.watching("alice/r2")


async def test_blocked_readers_never_leave_script_calls_waiting_for_a_connection(
        real_backend: str, servers: dict) -> None:
    """Each blocked reader (a requester's responses, a worker's doorbell, a forwarder's outbox)
    holds a connection while it blocks. More of them than the bus's pool has connections must
    not leave the script calls waiting for one until a read times out."""
    from .agents import Echo
    from .conftest import make_bus
    from .helpers import serving

    async with make_bus(real_backend, servers, max_connections=4, read_block=60) as bus, serving(bus, Echo()):
        requesters = [bus.client(f"r{i}") for i in range(6)]  # 6 response readers and a doorbell: 7 > 4
        with anyio.fail_after(20):
            handles = [await r.request_handoff(req(r.agent_id, Echo.agent_id)) for r in requesters]
            outcomes = [await handle.outcome() for handle in handles]
            again = await requesters[0].request_handoff(req("r0", Echo.agent_id))  # with every reader blocked
            outcomes.append(await again.outcome())
    assert [o.status for o in outcomes] == [HandoffStatus.COMPLETED] * 7


@pytest.mark.parametrize("size", [1, 2])
@pytest.mark.parametrize("server", list(SERVER_BINARIES))
async def test_a_pool_of_one_or_two_connections_serves_a_whole_bus(server: str, size: int, servers: Servers) -> None:
    """The connections the batcher's two senders keep (and every blocked reader's) come from
    outside the bus's pool: a pool that small still has one for everything else."""
    from .agents import Echo
    from .conftest import make_bus
    from .helpers import serving

    async with make_bus(server, servers, max_connections=size) as bus, serving(bus, Echo()):
        a = bus.client("a")
        with anyio.fail_after(20):
            handles = [await a.request_handoff(req("a", Echo.agent_id))]
            async with anyio.create_task_group() as tg:  # enough at once for both senders to send

                async def one() -> None:
                    handles.append(await a.request_handoff(req("a", Echo.agent_id)))

                for _ in range(20):
                    tg.start_soon(one)
            other = await a.request_handoff(req("a", "nobody"))  # a new target: an SADD on the pool
            outcomes = [await handle.outcome() for handle in handles]
            await bus.redis.script_flush()  # a reload takes a pool connection while a sender holds its own
            outcomes.append(await (await a.request_handoff(req("a", Echo.agent_id))).outcome())
    assert [o.status for o in outcomes] == [HandoffStatus.COMPLETED] * 22
    assert other.handoff_id.startswith("a/")


@pytest.mark.parametrize("server", list(SERVER_BINARIES))
async def test_responses_reach_their_waiters_over_resp3_connections(server: str, servers: Servers) -> None:
    # the reader parses XREAD replies itself: under RESP3 they come as a map, entries still flat
    client = aioredis.Redis.from_url(servers[server].url, protocol=3)
    async with HandoffBus(client, owns_client=True, prefix=new_prefix()) as bus:
        a, b = bus.client("a"), bus.client("b")
        handle = await a.request_handoff(req("a", "b"))
        await b.accept_handoff(handle.handoff_id)
        await b.complete_handoff(handle.handoff_id, result="ok")
        with anyio.fail_after(5):  # far inside the waiters' 30 s safety re-read: pushed, not re-read
            assert (await handle.decision()).status is HandoffStatus.ACCEPTED
            outcome = await handle.outcome()
        assert (outcome.status, outcome.result) == (HandoffStatus.COMPLETED, "ok")
