"""Failover errors under running workers and waiting requesters: UNBLOCKED and READONLY are
survived (backoff with jitter), and work resumes without anyone restarting anything."""

from __future__ import annotations

import functools
import logging
import socket
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import msgspec
import pytest
import redis
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import OutOfMemoryError

from handoffbus import EmbeddedServer, HandoffBus, HandoffClient, HandoffResponse, HandoffStatus, Worker
from handoffbus.embedded import EmbeddedCluster, _cluster_ok, _node_client, _pings, _poll
from handoffbus.models import WorkerInfo

from .agents import Echo
from .conftest import SERVER_BINARIES, start_cluster, start_server
from .helpers import blocked_clients, req, serve_until_done

pytestmark = pytest.mark.anyio


class LogSeen(logging.Handler):
    """Sets an event once the handoffbus logger reports each expected text."""

    def __init__(self, *texts: str) -> None:
        super().__init__(logging.WARNING)
        self.events = {text: anyio.Event() for text in texts}

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        for text, event in self.events.items():
            if text in message:
                event.set()


@pytest.fixture
def watch_log() -> Iterator[type[LogSeen]]:
    logger = logging.getLogger("handoffbus")
    added: list[LogSeen] = []

    class Attached(LogSeen):
        def __init__(self, *texts: str) -> None:
            super().__init__(*texts)
            logger.addHandler(self)
            added.append(self)

    yield Attached
    for handler in added:
        logger.removeHandler(handler)


@pytest.fixture(params=list(SERVER_BINARIES))
def own_server(request: pytest.FixtureRequest) -> Iterator[EmbeddedServer]:
    """A server of the test's own: it is demoted to a replica and back."""
    server = start_server(SERVER_BINARIES[request.param])
    yield server
    server.stop()


def unused_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def handled(client: HandoffClient, reason: str) -> HandoffResponse:
    """Request a handoff of the Echo worker and wait for its outcome."""
    handle = await client.request_handoff(req("req", "echo-1", reason=reason))
    with anyio.fail_after(10):
        return await handle.outcome()


@asynccontextmanager
async def serving_echo(server: EmbeddedServer, block: float, **settings: Any) -> AsyncIterator[
        tuple[aioredis.Redis, HandoffClient, Worker]]:
    """An admin connection, a requester and a running Echo worker that has completed one handoff."""
    admin = aioredis.Redis(unix_socket_path=str(server.socket_path))
    try:
        async with HandoffBus.connect(server.url, **settings) as bus, anyio.create_task_group() as tg:
            worker = Worker(bus, Echo(), block=block)
            await tg.start(worker.run)
            client = bus.client("req")
            assert (await handled(client, "before")).status is HandoffStatus.COMPLETED
            yield admin, client, worker
            worker.drain()
    finally:
        await admin.aclose()


async def test_unblocked_readers_carry_on(own_server: EmbeddedServer, watch_log: type[LogSeen]) -> None:
    seen = watch_log("UNBLOCKED")
    async with serving_echo(own_server, block=30.0, read_block=30.0) as (admin, client, _worker):
        # the worker waits on its doorbell, the requester's reader on its responses: both blocked
        for client_id in await blocked_clients(admin, 2):
            assert await admin.client_unblock(client_id, error=True)
        with anyio.fail_after(10):
            await seen.events["UNBLOCKED"].wait()
        outcome = await handled(client, "after")
        assert outcome.status is HandoffStatus.COMPLETED and outcome.result["echo"] == "after"


async def test_readonly_after_demotion_then_resume(own_server: EmbeddedServer, watch_log: type[LogSeen]) -> None:
    seen = watch_log("read only replica")
    async with serving_echo(own_server, block=0.1) as (admin, client, worker):
        # a failover demotes the server: its master is unreachable, so it keeps its data
        await admin.execute_command("REPLICAOF", "127.0.0.1", unused_port())
        try:
            with anyio.fail_after(10):
                await seen.events["read only replica"].wait()  # the worker's next take was refused
        finally:
            await admin.execute_command("REPLICAOF", "NO", "ONE")
        outcome = await handled(client, "after")
        assert outcome.status is HandoffStatus.COMPLETED and outcome.result["echo"] == "after"
    assert worker.handled == {HandoffStatus.COMPLETED: 2}


class Numbered(Echo):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.agent_id = f"echo-{n}"  # type: ignore[misc]


async def test_twenty_blocked_consumers_resume_after_a_demotion(
    own_server: EmbeddedServer, watch_log: type[LogSeen]
) -> None:
    """REPLICAOF another node, then REPLICAOF NO ONE, while 20 workers block on their reads."""
    seen = watch_log("UNBLOCKED", "read only replica")
    admin = aioredis.Redis(unix_socket_path=str(own_server.socket_path))
    try:
        async with HandoffBus.connect(own_server.url, read_block=30.0) as bus, anyio.create_task_group() as tg:
            workers = [Worker(bus, Numbered(n), block=30.0) for n in range(20)]
            for worker in workers:
                await tg.start(worker.run)
            client = bus.client("req")
            first = [await client.request_handoff(req("req", f"echo-{n}", reason="before")) for n in range(20)]
            with anyio.fail_after(10):
                assert all([(await h.outcome()).status is HandoffStatus.COMPLETED for h in first])
            await blocked_clients(admin, 21)  # 20 workers on their doorbells, the requester's reader
            await admin.execute_command("REPLICAOF", "127.0.0.1", unused_port())
            try:
                with anyio.fail_after(10):
                    await seen.events["UNBLOCKED"].wait()  # the demotion woke the blocked readers
                    await seen.events["read only replica"].wait()  # and their writes were refused
            finally:
                await admin.execute_command("REPLICAOF", "NO", "ONE")
            promoted = anyio.current_time()
            after = [await client.request_handoff(req("req", f"echo-{n}", reason="after")) for n in range(20)]
            with anyio.fail_after(5):
                outcomes = [await h.outcome() for h in after]
            resumed_in = anyio.current_time() - promoted
            for worker in workers:
                worker.drain()
    finally:
        await admin.aclose()
    print(f"\n20 blocked consumers resumed {resumed_in:.2f}s after REPLICAOF NO ONE")
    assert [o.result["echo"] for o in outcomes] == ["after"] * 20
    assert all(w.handled == {HandoffStatus.COMPLETED: 2} for w in workers)


@pytest.fixture(params=list(SERVER_BINARIES))
def own_cluster(request: pytest.FixtureRequest) -> Iterator[EmbeddedCluster]:
    """A cluster of the test's own: every node of it is stopped and started again."""
    cluster = start_cluster(SERVER_BINARIES[request.param])
    yield cluster
    cluster.stop()


def _restarted(cluster: EmbeddedCluster) -> None:
    """Start the stopped nodes again on their directories, and wait for the cluster to be whole."""
    for node in cluster.nodes:
        node._launch()
    for node in cluster.nodes:
        with _node_client(node) as client:
            _poll(f"node {node.port} to rejoin", functools.partial(_rejoined, client, node, len(cluster.nodes)))


def _rejoined(client: redis.Redis, node: EmbeddedServer, size: int) -> bool:
    return _pings(client, node) and _cluster_ok(client, size)


async def test_a_worker_waits_out_a_cluster_whose_nodes_are_all_down(
    own_cluster: EmbeddedCluster, watch_log: type[LogSeen]
) -> None:
    """Every node down at once (a cluster restart): calls fail with the ConnectionError every
    loop backs off on. The cluster client's own error for it, RedisClusterException, is no
    RedisError: it ended the worker, and reached callers wrapped in an error group."""
    seen = watch_log("Redis unavailable")
    async with HandoffBus.connect(own_cluster.url, sweep_interval=3600) as bus:
        client = bus.client("req")
        worker = Worker(bus, Echo(), block=0.2)
        async with anyio.create_task_group() as tg:
            await tg.start(worker.run)
            first = await client.request_handoff(req("req", Echo.agent_id))
            with anyio.fail_after(10):
                assert (await first.outcome()).status is HandoffStatus.COMPLETED
            for node in own_cluster.nodes:
                node._terminate()
            with pytest.raises(RedisConnectionError):
                await client.get_handoff_status(first.handoff_id)
            with anyio.fail_after(10):
                await seen.events["Redis unavailable"].wait()  # the fetch loop met it, and goes on
            await anyio.to_thread.run_sync(_restarted, own_cluster)
            with anyio.fail_after(30):
                later = await client.request_handoff(req("req", Echo.agent_id))
                assert (await later.outcome()).status is HandoffStatus.COMPLETED
            worker.drain()


async def test_reads_go_on_while_the_server_refuses_writes(own_server: EmbeddedServer) -> None:
    """A replica, too few replicas for min-replicas-to-write, and a server past maxmemory each
    refuse a function that may write, up front: ``load`` is flagged ``no-writes``, and
    ``status`` (which expires a record that is due) reads plainly then; a listing of agents
    still comes, with a long-gone worker to forget in it. A bus still opens: the library is
    there, and it is loaded only where missing."""
    admin = aioredis.Redis.from_url(own_server.url)
    async with HandoffBus.connect(own_server.url, prefix="ro") as bus:
        handle = await bus.client("a").request_handoff(req("a", "b"))
        gone = WorkerInfo(consumer="c-gone", state="RUNNABLE", load=0, limit=1, beat_ms=1000)
        await admin.sadd(bus.keys.agents, "b")
        await admin.hset(bus.keys.workers("b"), "c-gone", msgspec.json.encode({**msgspec.structs.asdict(gone),
                                                                                "ttl_ms": 1000}))
        for refuse, undo in [(("CONFIG", "SET", "maxmemory", "1"), ("CONFIG", "SET", "maxmemory", "0")),
                             (("CONFIG", "SET", "min-replicas-to-write", "1"),
                              ("CONFIG", "SET", "min-replicas-to-write", "0")),
                             (("REPLICAOF", "127.0.0.1", unused_port()), ("REPLICAOF", "NO", "ONE"))]:
            await admin.execute_command(*refuse)
            try:
                status = await bus.client("a").get_handoff_status(handle.handoff_id)
                pending = await bus.client("b").get_pending_handoffs()
                agents = await bus.client("a").list_agents()
                async with HandoffBus.connect(own_server.url, prefix="ro") as other:
                    again = await other.client("a").get_handoff_status(handle.handoff_id)
            finally:
                await admin.execute_command(*undo)
            assert status.status is again.status is HandoffStatus.PENDING, refuse
            assert [p.handoff_id for p in pending] == [handle.handoff_id], refuse
            assert agents == [], refuse
    await admin.aclose()


async def test_past_maxmemory_work_under_way_ends_and_new_work_is_refused(own_server: EmbeddedServer) -> None:
    """Functions that decide, finish or expire handoffs are flagged allow-oom (as EVALSHA
    scripts ran once their first write freed memory): a handoff under way completes, one due
    expires when read, and a new request is refused."""
    admin = aioredis.Redis.from_url(own_server.url)
    async with HandoffBus.connect(own_server.url, prefix="oom") as bus:
        a, b = bus.client("a"), bus.client("b")
        under_way = await a.request_handoff(req("a", "b"))
        await b.accept_handoff(under_way.handoff_id)
        due = await a.request_handoff(req("a", "b", timeout=0.2))
        await admin.config_set("maxmemory", 1)
        try:
            completed = await b.complete_handoff(under_way.handoff_id, result="done")
            with anyio.fail_after(5):
                expired = await due.decision()
            with pytest.raises(OutOfMemoryError):
                await a.request_handoff(req("a", "b"))
        finally:
            await admin.config_set("maxmemory", 0)
    assert completed.status is HandoffStatus.COMPLETED and expired.status is HandoffStatus.EXPIRED
    await admin.aclose()


async def test_a_due_handoff_on_a_replica_is_waited_for_not_read_again_and_again(
        own_server: EmbeddedServer) -> None:
    """Only a write settles a PENDING handoff past its deadline. Read plainly on a replica it
    would stay PENDING, and a handle waiting on its decision would read it every few ms: the
    refusal is raised instead, which the handle rides out as it does a failover (with
    backoff), and once the server takes writes again the read expires it."""
    admin = aioredis.Redis.from_url(own_server.url)
    async with HandoffBus.connect(own_server.url, prefix="due", sweep_interval=3600) as bus:
        due = await bus.client("a").request_handoff(req("a", "b", timeout=0.2))
        await admin.execute_command("REPLICAOF", "127.0.0.1", unused_port())
        try:
            before = (await admin.info("commandstats")).get("cmdstat_hgetall", {}).get("calls", 0)
            with anyio.move_on_after(1.5):
                await due.decision()
            reads = (await admin.info("commandstats"))["cmdstat_hgetall"]["calls"] - before
        finally:
            await admin.execute_command("REPLICAOF", "NO", "ONE")
        with anyio.fail_after(10):
            decided = await due.decision()
    assert 1 <= reads <= 12 and decided.status is HandoffStatus.EXPIRED, reads
    await admin.aclose()


async def test_opening_a_bus_loads_the_library_only_where_it_is_missing(own_server: EmbeddedServer) -> None:
    """FUNCTION LOAD is a write, replicated and appended to the AOF whole even when it changes
    nothing; health checks open a bus every few seconds."""
    admin = aioredis.Redis.from_url(own_server.url)
    async with HandoffBus.connect(own_server.url, prefix="once"):
        pass
    await admin.config_resetstat()
    for _ in range(3):
        async with HandoffBus.connect(own_server.url, prefix="once") as bus:
            await bus.client("a").get_handoff_status("a/nothing")
    stats = await admin.info("commandstats")
    assert "cmdstat_function|load" not in stats and stats["cmdstat_fcall"]["calls"] >= 3
    await admin.function_flush()
    async with HandoffBus.connect(own_server.url, prefix="once"):
        pass
    assert (await admin.info("commandstats"))["cmdstat_function|load"]["calls"] == 1
    await admin.aclose()


async def test_a_refused_load_is_not_sent_again_for_every_read(own_server: EmbeddedServer) -> None:
    """On a replica whose primary lacks this version's library, every call misses its function;
    the first load is refused, and the next calls hear that refusal without sending the 78 KB
    library again (the reads themselves go on plainly)."""
    admin = aioredis.Redis.from_url(own_server.url)
    async with HandoffBus.connect(own_server.url, prefix="nolib", sweep_interval=3600) as bus:
        handle = await bus.client("a").request_handoff(req("a", "b"))
        await admin.function_flush()
        await admin.config_resetstat()
        await admin.execute_command("REPLICAOF", "127.0.0.1", unused_port())
        try:
            statuses = [(await bus.client("a").get_handoff_status(handle.handoff_id)).status for _ in range(5)]
            load = (await admin.info("commandstats")).get("cmdstat_function|load", {})
        finally:
            await admin.execute_command("REPLICAOF", "NO", "ONE")
    assert statuses == [HandoffStatus.PENDING] * 5
    assert load.get("calls", 0) + load.get("rejected_calls", 0) == 1, load
    await admin.aclose()


async def test_a_cluster_node_that_stops_answering_does_not_hold_the_response_reader_for_ever(
    own_cluster: EmbeddedCluster, watch_log: type[LogSeen], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A node frozen, or cut off with no reset, never answers a blocked XREAD: on one server a
    watched line bounds the wait, but a cluster's reads went through redis-py with no socket
    timeout, and the reader stayed deaf (to the node a failover gives its slots to, too). Now
    it gives up after its block plus ``REPLY_WAIT``, and reads again."""
    import os
    import signal

    from handoffbus import wire

    monkeypatch.setattr(wire, "REPLY_WAIT", 0.5)
    seen = watch_log("response reader for req: no reply within")
    async with HandoffBus.connect(own_cluster.url, sweep_interval=3600, read_block=0.2) as bus:
        handle = await bus.client("req").request_handoff(req("req", Echo.agent_id))  # its reader reads
        port = bus.redis.get_node_from_key(bus.keys.responses("req")).port
        [node] = [n for n in own_cluster.nodes if n.port == port]
        assert node.process is not None
        os.kill(node.process.pid, signal.SIGSTOP)
        try:
            with anyio.fail_after(10):
                await seen.events["response reader for req: no reply within"].wait()
        finally:
            os.kill(node.process.pid, signal.SIGCONT)
        [outcome], _ = await serve_until_done(bus, Echo(), [handle])  # and it hears the node again
        assert outcome.status is HandoffStatus.COMPLETED
