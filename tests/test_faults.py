"""Fault injection on real servers: a server SIGKILLed under load, a connection cut right after
a request was written, the script cache flushed mid-run, skewed client clocks, expiry among a
million unrelated keys, and accept racing expiry at the deadline. Each prints its figure."""

from __future__ import annotations

import logging
import os
import random
import sys
import textwrap
from collections import Counter, defaultdict
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest
import redis.asyncio as aioredis
from anyio.abc import TaskGroup
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from handoffbus import (
    EmbeddedServer,
    HandoffBus,
    HandoffExpired,
    HandoffHandle,
    HandoffStatus,
    InvalidTransition,
    Worker,
    wire,
)
from handoffbus.forwarding import Forwarder
from handoffbus.keys import GROUP
from handoffbus.workers.inbox import Inbox

from .agents import Echo, SlowEcho
from .conftest import SERVER_BINARIES, make_bus, start_server
from .faultproxy import FaultProxy
from .helpers import ROOT, blocked_clients, req, response_statuses

pytestmark = pytest.mark.anyio
S = HandoffStatus


@pytest.fixture(params=list(SERVER_BINARIES))
def own_server(request: pytest.FixtureRequest) -> Iterator[EmbeddedServer]:
    """A server of the test's own, with AOF on every write: it is killed, flooded or proxied."""
    server = start_server(SERVER_BINARIES[request.param], "--appendonly", "yes", "--appendfsync", "always")
    yield server
    server.stop()


def late_ms(entry_id: bytes, deadline_ms: int) -> int:
    return int(entry_id.split(b"-")[0]) - deadline_ms


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def test_server_sigkilled_mid_run_loses_no_acknowledged_request(own_server: EmbeddedServer) -> None:
    """appendfsync always: every request acknowledged to its sender survives a SIGKILL of the
    server and reaches a terminal state once it is back; the group and its pending list too."""
    acknowledged: list[HandoffHandle] = []
    async with HandoffBus.connect(own_server.url, sweep_interval=0.05) as bus:
        client = bus.client("req")
        async with anyio.create_task_group() as tg:
            worker = Worker(bus, SlowEcho(), concurrency=16, reclaim_idle=1.0, block=0.2)
            await tg.start(worker.run)
            busy = anyio.Event()

            async def produce() -> None:
                i = 0
                while True:
                    try:
                        handle = await client.request_handoff(req("req", "echo-1", reason=f"r{i}"))
                    except (RedisConnectionError, OSError):
                        return  # the server is gone: what was not acknowledged was never promised
                    acknowledged.append(handle)
                    i += 1
                    if i == 200:
                        busy.set()

            tg.start_soon(produce)
            with anyio.fail_after(30):
                await busy.wait()  # 200 acknowledged, many in the worker's hands
            assert own_server.process is not None
            own_server.process.kill()
            own_server.process.wait()
            own_server.restart()  # same directory: the AOF is replayed
            await own_server.wait_ready()
            keys = bus.keys.target("echo-1")
            async with bus.redis.pipeline(transaction=True) as pipe:
                pipe.xinfo_groups(keys.inbox).xpending(keys.inbox, GROUP).hlen(keys.inflight)
                groups, pending, inflight = await pipe.execute()
            with anyio.fail_after(60):
                outcomes = [await h.outcome() for h in acknowledged]
            worker.drain()
        for handle in acknowledged:
            assert await response_statuses(bus, "req", handle.handoff_id) == ["ACCEPTED", "COMPLETED"]
    print(f"\nserver SIGKILLed with {len(acknowledged)} acknowledged requests, {pending['pending']} pending "
          f"entries in the group after the restart; all reached COMPLETED")
    assert [g["name"] for g in groups] == [GROUP.encode()]
    assert pending["pending"] == inflight  # every in-flight handoff still has its pending entry
    assert all(o.status is S.COMPLETED for o in outcomes)


async def test_a_request_whose_connection_is_cut_after_writing_is_made_once(own_server: EmbeddedServer) -> None:
    async with anyio.create_task_group() as tg:
        proxy = FaultProxy(own_server.port)
        await tg.start(proxy.serve)
        async with HandoffBus.connect(proxy.url, sweep_interval=0.05) as bus:
            client = bus.client("req")
            request = req("req", "echo-1", reason="once", request_id="cut-me")
            proxy.cut_after(b"cut-me")
            retried_by_us = False
            try:
                handle = await client.request_handoff(request)
            except (RedisConnectionError, OSError):
                retried_by_us = True  # the reply was lost: the caller retries with the same request id
                handle = await client.request_handoff(request)
            sent = proxy.marker_seen  # chunks that carried the request before any worker ran
            echo = Echo()
            async with anyio.create_task_group() as workers:
                worker = Worker(bus, echo)
                await workers.start(worker.run)
                with anyio.fail_after(10):
                    outcome = await handle.outcome()
                worker.drain()
            queue_left = await bus.redis.zcard(bus.keys.target("echo-1").queue)
            statuses = await response_statuses(bus, "req", handle.handoff_id)
            records = [k async for k in bus.redis.scan_iter(match=f"{bus.config.prefix}:*:h:*")]
        tg.cancel_scope.cancel()
    print(f"\nconnection cut after the request was written ({proxy.cuts} cut); the request reached the "
          f"server {sent} times; retried by {'the caller' if retried_by_us else 'the client library'}")
    # written, cut, written again; then its queue entry, sent once the record answered (the
    # caller's own request id: see request_handoff); then, having joined the handoff the first
    # write made, a read that it is still PENDING (else the new queue entry is taken back)
    assert proxy.cuts == 1 and sent == 4
    assert outcome.status is S.COMPLETED and echo.order == [handle.handoff_id]  # handled once
    assert statuses == ["ACCEPTED", "COMPLETED"] and queue_left == 0 and len(records) == 1


async def test_a_socket_timeout_in_the_url_bounds_script_calls_too(own_server: EmbeddedServer) -> None:
    """``?socket_timeout=`` in the URL: a peer that stopped answering fails a script call with
    redis-py's TimeoutError, as it fails redis-py's own commands (script replies are read from
    the parser directly, past redis-py's timeout, so they waited for ever)."""
    async with anyio.create_task_group() as tg:
        proxy = FaultProxy(own_server.port)
        await tg.start(proxy.serve)
        async with HandoffBus.connect(proxy.url + "?socket_timeout=0.5", sweep_interval=3600) as bus:
            client = bus.client("req")
            handle = await client.request_handoff(req("req", "echo-1"))
            proxy.blackhole()  # connections stay open; nothing comes back
            with anyio.fail_after(10), pytest.raises(RedisTimeoutError):
                await client.get_handoff_status(handle.handoff_id)
            proxy.restore()
            proxy.reset()
        tg.cancel_scope.cancel()


class _Heard(logging.Handler):
    """Sets ``event`` when the handoffbus logger says something containing ``words``."""

    def __init__(self, words: str) -> None:
        super().__init__(logging.WARNING)
        self.words, self.event = words, anyio.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if self.words in record.getMessage():
            self.event.set()


async def test_a_server_that_stops_answering_fails_calls_and_reads_without_a_socket_timeout(
    own_server: EmbeddedServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No socket timeout in the URL (the default): a server that stopped answering without
    closing its connections (frozen, or cut off where no reset reaches the client; TCP
    keepalive does not notice a live host) held every script call for ever, and the
    requester's response reader with them. A batch now fails after ``wire.REPLY_WAIT``, as on
    a lost connection, and a blocked read that long past its block; both work again after."""
    monkeypatch.setattr(wire, "REPLY_WAIT", 0.5)
    heard = _Heard("response reader for req")
    logging.getLogger("handoffbus").addHandler(heard)
    try:
        async with anyio.create_task_group() as tg:
            proxy = FaultProxy(own_server.port)
            await tg.start(proxy.serve)
            async with HandoffBus.connect(proxy.url, sweep_interval=3600, read_block=0.2) as bus:
                client, target = bus.client("req"), bus.client("echo-1")
                handle = await client.request_handoff(req("req", "echo-1"))
                proxy.blackhole()  # connections stay open; nothing comes back
                with anyio.fail_after(5):
                    with pytest.raises(RedisTimeoutError):
                        await client.get_handoff_status(handle.handoff_id)
                    await heard.event.wait()  # the reader's XREAD gave up too
                proxy.restore()
                await target.accept_handoff(handle.handoff_id)
                await target.complete_handoff(handle.handoff_id, result="ok")
                with anyio.fail_after(10):
                    outcome = await handle.outcome()
            tg.cancel_scope.cancel()
    finally:
        logging.getLogger("handoffbus").removeHandler(heard)
    assert outcome.status is S.COMPLETED and outcome.result == "ok"


async def test_a_workers_doorbell_wait_on_a_server_that_stopped_answering_fails(
    own_server: EmbeddedServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An idle worker waits on its doorbell (XREAD BLOCK). On a server that stopped answering
    the wait held for ever: the worker never took work again, even once the server was back
    for every other connection. It fails now past its block, and the worker's loop retries."""
    monkeypatch.setattr(wire, "REPLY_WAIT", 0.5)
    async with anyio.create_task_group() as tg:
        proxy = FaultProxy(own_server.port)
        await tg.start(proxy.serve)
        async with HandoffBus.connect(proxy.url, sweep_interval=3600) as bus:
            inbox = Inbox(bus, "echo-1", "w1")
            try:
                bell, _ = await inbox.take(0)
                assert not await inbox.wait(bell, 100)  # nothing queued: the block ran out
                proxy.blackhole()
                with anyio.fail_after(5), pytest.raises(RedisTimeoutError):
                    await inbox.wait(bell, 100)
                proxy.restore()
                await bus.client("req").request_handoff(req("req", "echo-1"))  # rings the bell
                with anyio.fail_after(5):
                    assert await inbox.wait(bell, 5000)  # a new connection
            finally:
                await inbox.close()
        tg.cancel_scope.cancel()


async def test_a_large_request_over_a_slow_but_steady_link_is_not_taken_for_silence(
    own_server: EmbeddedServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every chunk gets through within 0.1 s, but a 900 KB envelope takes longer than the
    reply wait to cross, either way: the bound on a server that stops answering must not fail
    (for good: a retry is as large, and a worker's load of it would fail at every take) a call
    or a reply that is on its way."""
    monkeypatch.setattr(wire, "REPLY_WAIT", 1.0)
    async with anyio.create_task_group() as tg:
        proxy = FaultProxy(own_server.port)
        await tg.start(proxy.serve)
        async with HandoffBus.connect(proxy.url, sweep_interval=3600) as bus:
            client = bus.client("req")
            assert await client.get_handoff_status("req/warm-up") is None  # connected before the link slows
            proxy.delay = 0.1
            started = anyio.current_time()
            handle = await client.request_handoff(req("req", "echo-1", context_snapshot=os.urandom(900_000)))
            sent = anyio.current_time()
            record = await client.get_handoff_status(handle.handoff_id)  # the envelope comes back
            read = anyio.current_time()
            proxy.delay = 0.0
        tg.cancel_scope.cancel()
    assert min(sent - started, read - sent) > wire.REPLY_WAIT  # the link was that slow
    assert record is not None and record.status is S.PENDING and len(record.request.context_snapshot or b"") == 900_000


async def test_script_cache_flushed_mid_run_fails_no_call(
    real_backend: str, servers: dict, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="handoffbus")
    flushes = 0
    async with make_bus(real_backend, servers) as bus:
        client = bus.client("req")
        async with anyio.create_task_group() as tg:
            worker = Worker(bus, Echo(), concurrency=32)
            await tg.start(worker.run)
            done = anyio.Event()

            async def flush() -> None:
                nonlocal flushes
                while not done.is_set():
                    await bus.redis.function_flush()  # on a cluster: every primary
                    await bus.redis.script_flush()  # nothing of the bus's lives there: no harm either
                    flushes += 1
                    await anyio.sleep(0.01)  # a flush every 10 ms: the fault's pace

            tg.start_soon(flush)
            handles = [await client.request_handoff(req("req", "echo-1", reason=f"r{i}")) for i in range(1000)]
            with anyio.fail_after(60):
                outcomes = [await h.outcome() for h in handles]
            done.set()
            worker.drain()
    print(f"\n1000 handoffs under {flushes} FUNCTION FLUSH + SCRIPT FLUSH: "
          f"{Counter(o.status.value for o in outcomes)}")
    assert flushes > 10
    assert all(o.status is S.COMPLETED for o in outcomes)
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []  # no call failed


SKEW = textwrap.dedent("""
    import os, time
    _skew = float(os.environ["HANDOFFBUS_TEST_CLOCK_SKEW"])
    _time, _time_ns = time.time, time.time_ns
    time.time = lambda: _time() + _skew
    time.time_ns = lambda: _time_ns() + int(_skew * 1e9)
""")


async def test_skewed_client_clocks_neither_expire_nor_reclaim_early(
    real_backend: str, servers: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two worker processes of one agent with clocks 300 s ahead and behind, a requester 300 s
    behind: deadlines and idle times are the server's, so nothing happens early."""
    (tmp_path / "sitecustomize.py").write_text(SKEW)
    real_time = __import__("time").time
    monkeypatch.setattr("time.time", lambda: real_time() - 300)
    idle = 1.0
    async with make_bus(real_backend, servers) as bus:
        procs = []
        for skew in ("300", "-300"):
            env = {**os.environ, "PYTHONUNBUFFERED": "1", "HANDOFFBUS_TEST_CLOCK_SKEW": skew,
                   "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
            process = await anyio.open_process(
                [sys.executable, "-c", "import time, sys; print(int(time.time()), flush=True); "
                 "from handoffbus.cli import main; sys.exit(main())", "worker", "tests.agents:Sleepy",
                 "--redis-url", servers[real_backend].url, "--prefix", bus.config.prefix,
                 "--reclaim-idle", str(idle), "--concurrency", "20"], cwd=ROOT, env=env)
            assert process.stdout is not None
            with anyio.fail_after(30):
                banner = b""
                while b"serving" not in banner:
                    banner += await process.stdout.receive()
            seen_time = int(banner.split()[0])
            assert abs(seen_time - real_time() - int(skew)) < 5  # the process's clock really is skewed
            procs.append(process)
        client = bus.client("req")
        work = [await client.request_handoff(req("req", "sleepy-1", reason=f"w{i}", timeout=3.0,
                                                 metadata={"work_s": 0.8 * idle})) for i in range(40)]
        unwanted = await client.request_handoff(req("req", "nobody-1", reason="wait", timeout=2.0))
        with anyio.fail_after(30):
            outcomes = [await h.outcome() for h in work]
            expired = await unwanted.outcome()
        for process in procs:
            process.terminate()
            await process.wait()
            await process.aclose()
        record = await unwanted.status()
        [(entry_id, _)] = [e for e in await bus.redis.xrange(bus.keys.responses("req"))
                           if e[1][b"id"] == unwanted.handoff_id.encode()]
    assert record is not None
    waited = int(entry_id.split(b"-")[0]) - record.created_ms
    print(f"\nclocks skewed +-300 s: 40 handoffs done at attempt 1; a 2 s request expired after {waited} ms")
    assert all(o.status is S.COMPLETED and o.result["attempt"] == 1 for o in outcomes)  # none reclaimed early
    assert expired.status is S.EXPIRED and 2000 <= waited < 3000  # not early, not much later


async def test_expiry_among_a_million_unrelated_keys(own_server: EmbeddedServer) -> None:
    """No keyspace notifications: 10,000 handoffs with 2 s deadlines among 1,000,000 keys with
    long TTLs are all reported EXPIRED within deadline + 1 s."""
    async with HandoffBus.connect(own_server.url) as bus:
        for start in range(0, 1_000_000, 100_000):  # filler, written by the server in batches
            await bus.redis.eval("for i = ARGV[1], ARGV[2] do redis.call('SET', 'filler:' .. i, 'x', 'EX', 86400) end",
                                 0, start, start + 99_999)
        assert await bus.redis.dbsize() >= 1_000_000
        client = bus.client("req")
        handles: list[HandoffHandle] = []

        async def make(n: int) -> None:
            for _ in range(n):
                handles.append(await client.request_handoff(req("req", "nobody-1", reason="x", timeout=2.0)))

        async with anyio.create_task_group() as tg:
            for _ in range(8):
                tg.start_soon(make, 1250)
        with anyio.fail_after(60):
            outcomes = [await h.outcome() for h in handles]
        deadlines = {}
        async with bus.redis.pipeline(transaction=False) as pipe:
            for h in handles:
                pipe.hget(bus.keys.record("req", h.request_id).record, "deadline")
            for h, deadline in zip(handles, await pipe.execute(), strict=True):
                deadlines[h.handoff_id] = int(deadline)
        lateness = [late_ms(eid, deadlines[f[b"id"].decode()])
                    for eid, f in await bus.redis.xrange(bus.keys.responses("req")) if f[b"status"] == b"EXPIRED"]
    print(f"\n10,000 expiries among 1,000,000 keys: late by p50 {quantile(lateness, 0.5)} ms, "
          f"p99 {quantile(lateness, 0.99)} ms, max {max(lateness)} ms")
    assert all(o.status is S.EXPIRED for o in outcomes) and len(lateness) == 10_000
    assert min(lateness) >= 0 and max(lateness) <= 1000


async def test_accept_racing_expiry_has_exactly_one_winner(real_backend: str, servers: dict) -> None:
    """10,000 trials of an accept sent right at the deadline while the sweep expires it."""
    trials = 10_000
    async with make_bus(real_backend, servers, sweep_interval=0.01) as bus:
        client, target = bus.client("req"), bus.client("race-1")
        handles: list[HandoffHandle] = []
        accepted: dict[str, bool] = {}

        async def make(n: int, tg: TaskGroup) -> None:
            for _ in range(n):
                handle = await client.request_handoff(req("req", "race-1", reason="race", timeout=1.0))
                handles.append(handle)
                tg.start_soon(race, handle)

        async def race(handle: HandoffHandle) -> None:
            assert handle.deadline_at
            # around the deadline as this process sees it (a few ms off the server's, either way)
            await anyio.sleep(max(0.0, handle.deadline_at + random.uniform(-0.02, 0.01) - anyio.current_time()))
            try:
                await target.accept_handoff(handle.handoff_id)
                accepted[handle.handoff_id] = True
            except (HandoffExpired, InvalidTransition):
                accepted[handle.handoff_id] = False

        async with anyio.create_task_group() as tg:
            for _ in range(10):
                tg.start_soon(make, trials // 10, tg)
        decisions: dict[str, list[str]] = defaultdict(list)
        for _, fields in await bus.redis.xrange(bus.keys.responses("req")):
            decisions[fields[b"id"].decode()].append(fields[b"status"].decode())
        async with bus.redis.pipeline(transaction=False) as pipe:
            for h in handles:
                pipe.hget(bus.keys.record("req", h.request_id).record, "status")
            statuses = [s.decode() for s in await pipe.execute()]
    wins = Counter(accepted.values())
    print(f"\n{trials} accept-vs-expiry races: accept won {wins[True]}, expiry won {wins[False]}")
    assert len(accepted) == trials
    for handle, status in zip(handles, statuses, strict=True):
        won = accepted[handle.handoff_id]
        assert status == ("ACCEPTED" if won else "EXPIRED")
        assert decisions[handle.handoff_id] == [status]  # one decision, announced once
    assert wins[True] > 0 and wins[False] > 0  # both sides of the race were exercised


@pytest.mark.parametrize("side", ["agent", "forwarder"])
async def test_isolated_reads_on_a_server_that_stopped_answering_fail_and_recover(
    own_server: EmbeddedServer, monkeypatch: pytest.MonkeyPatch, side: str
) -> None:
    """An isolated agent waits for the forwarder's replies, and the forwarder for the agent's
    calls, each in an XREAD BLOCK of its own. Past a server that stopped answering (frozen, or
    cut off where no reset reaches the client) both held for ever without a socket timeout:
    the agent never heard a forwarded reply again, the forwarder never served that agent
    again. Each read now fails past its block, and works again on a new connection."""
    monkeypatch.setattr(wire, "REPLY_WAIT", 0.5)
    # blocked, once the first request is in: the agent's reply reader and response reader, or
    # the forwarder's read of the agent's outbox
    words, command, blocked = (("req: reading forwarder replies failed", "xread", 2) if side == "agent"
                               else ("forwarder: serving req failed", "xreadgroup", 1))
    heard = _Heard(words)
    logging.getLogger("handoffbus").addHandler(heard)
    admin = aioredis.Redis.from_url(own_server.url)
    try:
        async with anyio.create_task_group() as tg:
            proxy = FaultProxy(own_server.port)
            await tg.start(proxy.serve)
            agent_url, forwarder_url = (proxy.url, own_server.url) if side == "agent" else (own_server.url, proxy.url)
            prefix = f"silent{side}"
            async with HandoffBus.connect(forwarder_url, prefix=prefix, sweep_interval=3600) as trusted, \
                    HandoffBus.connect(agent_url, prefix=prefix, sweep_interval=3600, isolated="req") as bus, \
                    anyio.create_task_group() as serving:
                await serving.start(Forwarder(trusted, ["req"]).run)
                client = bus.client("req")
                await client.request_handoff(req("req", "echo-1"))  # its queue step goes by the forwarder
                await blocked_clients(admin, blocked, command)
                proxy.blackhole()  # connections stay open; nothing comes back
                with anyio.fail_after(5):
                    await heard.event.wait()
                proxy.restore()
                with anyio.fail_after(20):
                    handle = await client.request_handoff(req("req", "echo-1", reason="after"))
                queued = await trusted.redis.zrange(trusted.keys.target("echo-1").queue, 0, -1)
                serving.cancel_scope.cancel()
            tg.cancel_scope.cancel()
    finally:
        logging.getLogger("handoffbus").removeHandler(heard)
        await admin.aclose()
    assert handle.handoff_id.encode() in queued  # forwarded again: the read that failed was made anew


async def test_a_take_whose_reply_was_lost_is_served_at_once(own_server: EmbeddedServer) -> None:
    """The connection is cut right after a worker's take reached the server: the server moved
    the handoff into this consumer's pending entries, the worker never heard of it. Left so,
    it waited for a reclaim (``reclaim_idle`` after contact came back, 30 s by default) while
    the worker idled, and a short request expired in the meantime."""
    admin = aioredis.Redis.from_url(own_server.url)
    async with anyio.create_task_group() as tg:
        proxy = FaultProxy(own_server.port)
        await tg.start(proxy.serve)
        async with HandoffBus.connect(proxy.url, sweep_interval=0.05) as bus:
            client, echo = bus.client("req"), Echo()
            async with anyio.create_task_group() as workers:
                worker = Worker(bus, echo)
                await workers.start(worker.run)
                await blocked_clients(admin, 1, "xread")  # the worker waits on its doorbell
                proxy.cut_after(bus.scripts["take"].function.encode())
                handle = await client.request_handoff(req("req", "echo-1", reason="x", timeout=5.0))
                with anyio.fail_after(10):
                    outcome = await handle.outcome()
                worker.drain()
        tg.cancel_scope.cancel()
    await admin.aclose()
    assert proxy.cuts == 1
    assert outcome.status is S.COMPLETED and echo.order == [handle.handoff_id]


async def test_a_request_whose_queue_entry_reply_was_lost_is_counted_once(own_server: EmbeddedServer) -> None:
    """The record is made (code 1), the connection is cut after its queue entry was written:
    the caller hears the error and resubmits, which joins the handoff (code 0). It was never
    counted as requested: not by the call that made it, nor by the one that joined it."""
    async with anyio.create_task_group() as tg:
        proxy = FaultProxy(own_server.port)
        await tg.start(proxy.serve)
        async with HandoffBus.connect(proxy.url, sweep_interval=3600) as bus:
            client = bus.client("req")
            await bus.register_target("echo-1")
            request = req("req", "echo-1", reason="once", request_id="lost-enqueue")
            proxy.cut_after(bus.scripts["enqueue"].function.encode())
            with pytest.raises(RedisConnectionError):
                await client.request_handoff(request)
            handle = await client.request_handoff(request)  # resubmitted, as the README says
            await bus.stats.flush()
            requested = await bus.redis.hget(bus.keys.stats("echo-1"), "requested")
            queued = await bus.redis.zrange(bus.keys.target("echo-1").queue, 0, -1)
        tg.cancel_scope.cancel()
    assert proxy.cuts == 1 and queued == [handle.handoff_id.encode()]
    assert requested == b"1"


async def test_a_reload_on_a_server_that_stops_answering_fails_the_calls(
    own_server: EmbeddedServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A call finds the library gone, and the server stops answering as the batcher loads it
    again: the load (redis-py's, no socket timeout) held the sender and its calls for ever.
    They fail as a stalled batch does, and the next call works once the server answers."""
    monkeypatch.setattr(wire, "REPLY_WAIT", 0.5)
    admin = aioredis.Redis.from_url(own_server.url)
    async with anyio.create_task_group() as tg:
        proxy = FaultProxy(own_server.port)
        await tg.start(proxy.serve)
        async with HandoffBus.connect(proxy.url, sweep_interval=3600) as bus:
            client = bus.client("req")
            assert await client.get_handoff_status("req/warm-up") is None
            await admin.function_flush()  # the library is gone (a restart without persistence)
            proxy.stall_on(b"FUNCTION")  # and the server stops answering as it is loaded again
            with anyio.fail_after(5), pytest.raises(RedisTimeoutError):
                await client.get_handoff_status("req/after")
            proxy.restore()
            with anyio.fail_after(10):
                assert await client.get_handoff_status("req/again") is None
            proxy.reset()
        tg.cancel_scope.cancel()
    await admin.aclose()
