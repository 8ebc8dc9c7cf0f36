"""Awaiting is push: many waiters share one reader and one connection."""

from __future__ import annotations

from typing import Any

import anyio
import anyio.lowlevel
import pytest
import redis.asyncio as aioredis

from handoffbus import HandoffBus, HandoffNotFound, HandoffResponse, HandoffStatus, PayloadTooLarge
from handoffbus.waiters import Waiter

from .conftest import SERVER_BINARIES, Servers, make_bus, new_prefix
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
            await bus.redis.function_flush()  # a reload takes a pool connection while a sender holds its own
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


async def test_a_reader_started_by_a_later_request_leaves_no_response_unheard(bus: HandoffBus) -> None:
    """A fresh process: a request's record is written and accepted at once; before its task
    starts the agent's reader, a second request starts it, from after that ACCEPTED."""
    alice, bob = bus.client("alice"), bus.client("bob")
    scripts_many = bus.scripts_many
    interleaved: list[str] = []

    async def accepted_meanwhile(calls: list[tuple[str, list[str], list[Any]]]) -> list[Any]:
        replies = await scripts_many(calls)
        if calls[0][0] == "request" and not interleaved:
            interleaved.append(calls[0][2][0])
            await bob.accept_handoff(calls[0][2][0])  # its response lands after this request's cursor
            await alice.request_handoff(req("alice", "bob"))  # starts the reader after that response
        return replies

    bus.scripts_many = accepted_meanwhile  # type: ignore[method-assign]
    handle = await alice.request_handoff(req("alice", "bob"))
    bus.scripts_many = scripts_many  # type: ignore[method-assign]
    with anyio.fail_after(5):  # not at the 30 s safety re-read
        assert (await handle.decision()).status is HandoffStatus.ACCEPTED


async def test_a_handle_awaited_again_after_it_found_nothing_hears_the_handoff(
    real_backend: str, servers: Servers
) -> None:
    """A handle on r1 finds nothing; r1 is then requested (by another process) and the handle
    awaited again: it must be pushed the decision, not hear it at the 30 s safety re-read."""
    async with make_bus(real_backend, servers) as bus, \
            make_bus(real_backend, servers, prefix=bus.config.prefix) as elsewhere:
        alice, bob = bus.client("alice"), bus.client("bob")
        early = alice.handle("alice/r1")
        with pytest.raises(HandoffNotFound):
            await early.decision()
        await elsewhere.client("alice").request_handoff(req("alice", "bob", request_id="r1"))
        scripts_many = bus.scripts_many
        read = anyio.Event()

        async def noting(calls: list[tuple[str, list[str], list[Any]]]) -> list[Any]:
            replies = await scripts_many(calls)
            if calls[0][0] == "status":
                read.set()  # the handle read the record (PENDING) and waits now
            return replies

        bus.scripts_many = noting  # type: ignore[method-assign]
        with anyio.fail_after(5):
            async with anyio.create_task_group() as tg:

                async def await_it() -> None:
                    assert (await early.decision()).status is HandoffStatus.ACCEPTED

                tg.start_soon(await_it)
                await read.wait()
                bus.scripts_many = scripts_many  # type: ignore[method-assign]
                await bob.accept_handoff("alice/r1")


async def test_a_handle_not_awaited_holds_nothing(bus: HandoffBus) -> None:
    alice = bus.client("alice")
    first = await alice.request_handoff(req("alice", "bob", request_id="r1"))
    await first.cancel()
    with anyio.fail_after(5):
        await first.outcome()
    for _ in range(3):
        record = await alice.handle("alice/r1").status()
        assert record is not None and record.status is HandoffStatus.CANCELLED
    assert not bus.reader("alice", alice._refresh).watching("alice/r1")  # nothing left to re-read on a resync


@pytest.mark.parametrize("heard", ["nothing", "the decision"])
async def test_a_handle_from_before_the_bus_was_reopened_is_pushed_to(
    backend: str, servers: Servers, heard: str
) -> None:
    bus = make_bus(backend, servers)
    async with bus:
        handle = await bus.client("alice").request_handoff(req("alice", "bob"))
        if heard == "the decision":
            await bus.client("bob").accept_handoff(handle.handoff_id)
            with anyio.fail_after(5):
                await handle.decision()
    async with bus:  # its readers were dropped at close
        with anyio.fail_after(5):  # not at the 30 s safety re-read
            async with anyio.create_task_group() as tg:

                async def finish() -> None:
                    await anyio.wait_all_tasks_blocked()  # the handle waits now
                    if heard == "nothing":
                        await bus.client("bob").accept_handoff(handle.handoff_id)
                    await bus.client("bob").complete_handoff(handle.handoff_id, result="r")

                tg.start_soon(finish)
                assert (await handle.outcome()).result == "r"


class HeldLine:
    """The response reader's connection; while ``holding``, a reply with entries is handed over
    only once ``released`` is set (the reader lagging: a busy loop, or backing off)."""

    def __init__(self, line: Any) -> None:
        self.line = line
        self.holding = False
        self.held = anyio.Event()
        self.released = anyio.Event()

    async def command(self, *args: Any, blocks: float = 0.0) -> Any:
        reply = await self.line.command(*args, blocks=blocks)
        if self.holding and reply:
            self.held.set()
            await self.released.wait()
        return reply

    async def close(self) -> None:
        await self.line.close()


def held_lines(bus: HandoffBus) -> tuple[list[HeldLine], anyio.Event]:
    """The bus's response readers read through HeldLines from now (listed as they are made);
    the event is set once the first is made."""
    lines: list[HeldLine] = []
    blocking_line = bus.blocking_line
    reading = anyio.Event()

    def held_line() -> Any:
        lines.append(HeldLine(blocking_line()))
        reading.set()
        return lines[-1]

    bus.blocking_line = held_line  # type: ignore[method-assign]
    return lines, reading


async def _r1_finished_and_gone_while_the_reader_lags(bus: HandoffBus, reason: str) -> HeldLine:
    """alice's r1 (``reason``) ACCEPTED and COMPLETED by bob ("old result"), and its record gone
    (what record_retention's TTL does), while alice's reader holds ACCEPTED, not yet passed on:
    its held line is returned, to be released."""
    alice, bob = bus.client("alice"), bus.client("bob")
    lines, reading = held_lines(bus)
    await alice.request_handoff(req("alice", "bob", request_id="r1", reason=reason))
    await reading.wait()
    [line] = lines
    line.holding = True
    await bob.accept_handoff("alice/r1")
    await line.held.wait()
    await bob.complete_handoff("alice/r1", result="old result")
    keys = bus.keys.record("alice", "r1")
    await bus.redis.delete(keys.record, keys.envelope)
    return line


@pytest.mark.parametrize("caught_up", ["after the request", "while the request is on its way"])
async def test_a_request_id_used_again_hears_only_its_own_handoff(
    real_backend: str, servers: Servers, caught_up: str
) -> None:
    """r1 is finished and its record gone (retention), while the reader still has r1's
    responses to pass on; r1 is requested again: its handle must not take them as its own,
    whether the reader passes them on before or after the request returns."""
    async with make_bus(real_backend, servers) as bus:
        alice, bob = bus.client("alice"), bus.client("bob")
        line = await _r1_finished_and_gone_while_the_reader_lags(bus, "first")
        scripts_many = bus.scripts_many

        async def lag_ends_on_the_way(calls: list[tuple[str, list[str], list[Any]]]) -> list[Any]:
            replies = await scripts_many(calls)
            if calls[0][0] == "request":  # the record written, its reply not yet handled
                waiter = bus.reader("alice", alice._refresh).watch("alice/r1")
                line.released.set()  # the reader catches up now
                with anyio.fail_after(5):
                    while waiter.outcome is None:
                        await waiter.wait_finished(5)
                bus.reader("alice", alice._refresh).release(waiter)
            return replies

        if caught_up == "while the request is on its way":
            bus.scripts_many = lag_ends_on_the_way  # type: ignore[method-assign]
        second = await alice.request_handoff(req("alice", "bob", request_id="r1", reason="second"))
        bus.scripts_many = scripts_many  # type: ignore[method-assign]
        line.released.set()
        await bob.accept_handoff("alice/r1")
        await bob.complete_handoff("alice/r1", result="new result")
        with anyio.fail_after(5):
            outcome = await second.outcome()
        assert outcome.status is HandoffStatus.COMPLETED and outcome.result == "new result"


@pytest.mark.parametrize("server", list(SERVER_BINARIES))  # holds the reader's kept line (one server)
@pytest.mark.parametrize("how", ["resubmitted", "handle"])
async def test_a_reused_request_id_joined_here_hears_only_its_own_handoff(
    server: str, servers: Servers, how: str
) -> None:
    """As above, but the new r1 was created by another process: this one joins it by resubmitting
    the request, or takes a handle on it. Neither saw where the stream stood at its creation,
    and the old r1's COMPLETED, passed on late, was taken for the new one's outcome."""
    async with make_bus(server, servers) as bus, make_bus(server, servers, prefix=bus.config.prefix) as elsewhere:
        alice, bob = bus.client("alice"), bus.client("bob")
        line = await _r1_finished_and_gone_while_the_reader_lags(bus, "same")
        await elsewhere.client("alice").request_handoff(req("alice", "bob", request_id="r1", reason="same"))
        if how == "resubmitted":
            handle = await alice.request_handoff(req("alice", "bob", request_id="r1", reason="same"))
        else:
            handle = alice.handle("alice/r1")
        heard: list[HandoffResponse] = []
        async with anyio.create_task_group() as tg:

            async def await_it() -> None:
                heard.append(await handle.outcome())

            tg.start_soon(await_it)
            await anyio.wait_all_tasks_blocked()  # the handle read the record (PENDING) and waits
            line.released.set()  # the reader catches up on the old r1's responses
            [(last, _)] = await bus.redis.xrevrange(bus.keys.responses("alice"), count=1)
            reader = bus.reader("alice", alice._refresh)
            with anyio.fail_after(5):
                while reader._cursor != last:  # until the reader has passed on the old COMPLETED
                    await anyio.lowlevel.checkpoint()
                await anyio.wait_all_tasks_blocked()
            assert not heard, f"the new r1 is PENDING, yet its handle heard {heard[0]!r}"
            await bob.accept_handoff("alice/r1")
            await bob.complete_handoff("alice/r1", result="new result")
        assert heard[0].status is HandoffStatus.COMPLETED and heard[0].result == "new result"


async def test_responses_heard_before_the_request_returns_are_kept(bus: HandoffBus) -> None:
    alice, bob = bus.client("alice"), bus.client("bob")
    scripts_many = bus.scripts_many

    async def decided_meanwhile(calls: list[tuple[str, list[str], list[Any]]]) -> list[Any]:
        replies = await scripts_many(calls)
        if calls[0][0] == "request" and len(calls) > 1:  # the record and its queue entry, written
            hid = calls[0][2][0]
            reader = bus.reader("alice", alice._refresh)
            waiter = reader.watch(hid)  # the request's own (held once more while this looks on)
            await bob.accept_handoff(hid)
            await bob.complete_handoff(hid, result="early")
            with anyio.fail_after(5):
                while waiter.outcome is None:  # heard through the reader before the request returns
                    await waiter.wait_finished(5)
            reader.release(waiter)
        return replies

    await alice.request_handoff(req("alice", "bob"))  # the reader runs from now on
    bus.scripts_many = decided_meanwhile  # type: ignore[method-assign]
    handle = await alice.request_handoff(req("alice", "bob"))
    bus.scripts_many = scripts_many  # type: ignore[method-assign]
    with anyio.fail_after(5):
        outcome = await handle.outcome()
    assert outcome.status is HandoffStatus.COMPLETED and outcome.result == "early"


async def test_closing_the_bus_wakes_every_await_with_a_typed_error(backend: str, servers: Servers) -> None:
    """Awaits under way when the bus closes end at once with "the bus is closed", not at their
    next re-read (up to 30 s later); a handle awaited on a closed bus says so too."""
    from handoffbus import HandoffbusError

    bus = make_bus(backend, servers)
    errors: list[str] = []
    async with anyio.create_task_group() as tg:
        async with bus:
            alice = bus.client("alice")
            handle = await alice.request_handoff(req("alice", "bob", timeout=600))
            other = await alice.request_handoff(req("alice", "bob", timeout=600))

            async def awaiting(wait: Any) -> None:
                with pytest.raises(HandoffbusError, match="the bus is closed") as raised:
                    await wait()
                errors.append(str(raised.value))

            tg.start_soon(awaiting, handle.decision)
            tg.start_soon(awaiting, other.outcome)
            await anyio.wait_all_tasks_blocked()
        with anyio.fail_after(5):  # not at the 30 s safety re-read
            while len(errors) < 2:
                await anyio.wait_all_tasks_blocked()
                await anyio.lowlevel.checkpoint()
    with pytest.raises(HandoffbusError, match="the bus is closed"):
        await handle.outcome()
    assert bus._readers == {}  # no reader made on the closed bus


async def test_a_handle_whose_first_read_was_cut_short_reads_again(bus: HandoffBus) -> None:
    """A handle made from an id reads the record when first awaited. That read cancelled by
    the caller's timeout, the next await must read it (and so start the reader), not wait
    30 s for a push that no reader will bring."""
    alice, bob = bus.client("alice"), bus.client("bob")
    made = await alice.request_handoff(req("alice", "bob"))
    handle = alice.handle(made.handoff_id)
    with anyio.move_on_after(0):
        await handle.decision()  # cancelled before its read
    await bob.accept_handoff(made.handoff_id)
    with anyio.fail_after(5):
        assert (await handle.decision()).status is HandoffStatus.ACCEPTED
    assert handle.deadline_at is None  # decided: no deadline to wait for


@pytest.mark.parametrize("server", list(SERVER_BINARIES))  # a cluster's reader has no line of its own to hold
async def test_a_response_trimmed_before_a_lagging_reader_read_it_is_found_on_its_record(
        server: str, servers: Servers) -> None:
    """The response stream is trimmed by age at each XADD. A reader that lagged past the
    retention may find entries gone it had yet to read: it reads its waiters' records then,
    rather than leave their handles to the 30 s safety re-read."""
    async with make_bus(server, servers, response_retention=0.05) as bus:
        alice, bob = bus.client("alice"), bus.client("bob")
        lines, reading = held_lines(bus)
        first = await alice.request_handoff(req("alice", "bob"))
        target = await alice.request_handoff(req("alice", "bob"))
        fillers = [await alice.request_handoff(req("alice", "bob")) for _ in range(150)]
        await reading.wait()
        [line] = lines
        line.holding = True
        await bob.accept_handoff(first.handoff_id)
        await line.held.wait()  # the reader lags from here
        await bob.accept_handoff(target.handoff_id)
        await bob.complete_handoff(target.handoff_id, result="done")
        for filler in fillers[:120]:  # a whole stream node (100 entries) of responses the reader lags on
            await bob.reject_handoff(filler.handoff_id, reason="no")
        start = await bus.server_time_ms()
        while await bus.server_time_ms() <= start + 60:  # past the retention, by the server's clock
            await anyio.lowlevel.checkpoint()
        for filler in fillers[120:]:  # their XADDs trim the nodes older than the retention
            await bob.reject_handoff(filler.handoff_id, reason="no")
        left = await bus.redis.xrange(bus.keys.responses("alice"))
        assert target.handoff_id.encode() not in {f[b"id"] for _, f in left}  # trimmed unread
        line.released.set()
        with anyio.fail_after(10):  # not at the 30 s safety re-read
            outcome = await target.outcome()
        assert outcome.status is HandoffStatus.COMPLETED and outcome.result == "done"


@pytest.mark.parametrize("server", list(SERVER_BINARIES))  # holds the reader's kept line (one server)
async def test_a_trimmed_response_is_found_when_the_lag_is_more_than_one_read(server: str, servers: Servers) -> None:
    """As above, with more than one read's worth (512) to catch up on: the first read's last
    entry was within the retention of the cursor, the next read began past the gap, and
    nothing noticed the trimmed COMPLETED until the 30 s safety re-read."""
    async with make_bus(server, servers, response_retention=1.0) as bus:
        alice, bob = bus.client("alice"), bus.client("bob")
        stream = bus.keys.responses("alice")
        lines, reading = held_lines(bus)
        first = await alice.request_handoff(req("alice", "bob"))
        target = await alice.request_handoff(req("alice", "bob"))
        await reading.wait()
        [line] = lines
        line.holding = True
        await bob.accept_handoff(first.handoff_id)
        await line.held.wait()  # the reader lags from here
        t0 = await bus.server_time_ms()
        await bob.accept_handoff(target.handoff_id)
        await bob.complete_handoff(target.handoff_id, result="done")

        async def others(n: int) -> None:  # responses to other handoffs of alice's (no waiter here)
            async with bus.redis.pipeline(transaction=False) as pipe:
                for i in range(n):
                    pipe.xadd(stream, {"id": f"alice/x{i}", "status": "REJECTED", "actor": "bob", "ts": "1"})
                await pipe.execute()

        async def until_server_ms(at_ms: int) -> None:  # by the server's clock, which the trimming reads
            while await bus.server_time_ms() <= at_ms:
                await anyio.lowlevel.checkpoint()

        await others(300)  # whole stream nodes of responses from t0
        await until_server_ms(t0 + 500)
        await others(600)  # more than one read's worth, within the retention of t0
        await until_server_ms(t0 + 1300)
        extra = await alice.request_handoff(req("alice", "bob"))
        await bob.reject_handoff(extra.handoff_id, reason="no")  # its XADD trims what is older than 1 s
        left = {f[b"id"] for _, f in await bus.redis.xrange(stream)}
        assert target.handoff_id.encode() not in left  # trimmed unread
        assert len(left) > 512  # more than one read's worth to catch up on
        line.released.set()
        with anyio.fail_after(10):  # not at the 30 s safety re-read
            outcome = await target.outcome()
        assert outcome.status is HandoffStatus.COMPLETED and outcome.result == "done"


async def test_a_re_read_that_meets_an_outage_is_tried_again_not_raised(backend: str, servers: Servers) -> None:
    """At the deadline a handle reads the record (the read expires it). Redis out of reach
    then, it tries again after a backoff, as the reader does: an outage is not the caller's
    error to handle, and would not be a HandoffbusError."""
    from redis.exceptions import ConnectionError as RedisConnectionError

    async with make_bus(backend, servers, sweep_interval=60) as bus:  # no sweep to expire it first
        alice = bus.client("alice")
        handle = await alice.request_handoff(req("alice", "bob", timeout=0.2))
        refresh, lost = alice._refresh, []

        async def lost_once(waiter: Any) -> None:
            if not lost:
                lost.append(waiter.handoff_id)
                raise RedisConnectionError("connection lost")
            await refresh(waiter)

        alice._refresh = lost_once  # type: ignore[method-assign]
        with anyio.fail_after(10):
            decision = await handle.decision()
    assert lost == [handle.handoff_id] and decision.status is HandoffStatus.EXPIRED


@pytest.mark.parametrize("server", list(SERVER_BINARIES))  # a cluster client's pool is its own
async def test_more_readers_than_a_pools_default_cap_all_block_and_are_pushed_to(
        server: str, servers: Servers) -> None:
    """One blocked connection per requester id read: past redis-py's default cap of 100 the
    readers would poll on "Too many connections" instead of blocking."""
    async with make_bus(server, servers) as bus:
        clients = [bus.client(f"r{i}") for i in range(110)]
        handles = [await c.request_handoff(req(c.agent_id, "bob")) for c in clients]
        with anyio.fail_after(20):
            while sum(1 for c in await bus.redis.client_list() if c.get("cmd") == "xread") < 110:
                await anyio.wait_all_tasks_blocked()
        bob = bus.client("bob")
        for handle in handles:
            await bob.reject_handoff(handle.handoff_id, reason="no")
        with anyio.fail_after(10):
            assert {(await h.decision()).status for h in handles} == {HandoffStatus.REJECTED}


async def test_a_reader_with_nothing_to_wait_for_retires(backend: str, servers: Servers) -> None:
    """A reader, with its task and blocked connection, lasts while something waits on it: a
    process that requested as many agents over time does not keep one per agent for ever.
    The agent's next request starts a new one, which hears that handoff."""
    async with make_bus(backend, servers, read_block=0.05) as bus:
        alice, bob = bus.client("alice"), bus.client("bob")
        first = await alice.request_handoff(req("alice", "bob"))
        await bob.reject_handoff(first.handoff_id, reason="no")
        with anyio.fail_after(5):
            await first.decision()  # nothing waits on the reader from here
            retired = bus.reader("alice", alice._refresh)
            while bus._readers.get("alice") is retired:  # at its next empty read
                await anyio.lowlevel.checkpoint()
        second = await alice.request_handoff(req("alice", "bob"))
        await bob.accept_handoff(second.handoff_id)
        with anyio.fail_after(5):
            assert (await second.decision()).status is HandoffStatus.ACCEPTED
        assert bus._readers["alice"] is not retired


@pytest.mark.parametrize("server", list(SERVER_BINARIES))
async def test_a_handle_attached_later_hears_the_acceptances_metadata(server: str, servers: Servers) -> None:
    # what the accepting agent told the requester must not depend on whether the handle heard
    # it live or was attached from another process after the work completed
    async with make_bus(server, servers) as bus, make_bus(server, servers, prefix=bus.config.prefix) as other:
        handle = await bus.client("alice").request_handoff(req("alice", "bob", request_id="r1"))
        bob = bus.client("bob")
        await bob.accept_handoff(handle.handoff_id, metadata={"eta_s": 30})
        await bob.complete_handoff(handle.handoff_id, result="done", metadata={"took_s": 2})
        with anyio.fail_after(5):
            live = await handle.decision()
            attached = await other.client("alice").handle(handle.handoff_id).decision()
            outcome = await other.client("alice").handle(handle.handoff_id).outcome()
        assert live.metadata == attached.metadata == {"eta_s": 30}
        assert attached.status is HandoffStatus.ACCEPTED and outcome.metadata == {"took_s": 2}
        record = await handle.status()
        assert record is not None and record.accepted_metadata == {"eta_s": 30}


@pytest.mark.parametrize("server", list(SERVER_BINARIES))
async def test_a_response_the_reader_cannot_decode_fails_the_wait_at_once(server: str, servers: Servers) -> None:
    # the worker's bus allows larger payloads than the requester's: the reader cannot decode the
    # COMPLETED entry. Its handle reads the record at once and raises the typed error, rather
    # than at the safety refresh (30 s)
    async with make_bus(server, servers, payload_limit=10_000) as small, \
            make_bus(server, servers, prefix=small.config.prefix) as large:
        handle = await small.client("alice").request_handoff(req("alice", "bob"))
        bob = large.client("bob")
        await bob.accept_handoff(handle.handoff_id)
        assert (await handle.decision()).status is HandoffStatus.ACCEPTED  # the reader is past it
        await bob.complete_handoff(handle.handoff_id, result=b"x" * 50_000)
        with anyio.fail_after(5), pytest.raises(PayloadTooLarge):
            await handle.outcome()


async def test_a_waiter_decided_before_its_requests_reply_was_read_has_no_deadline() -> None:
    waiter = Waiter("a/r1")
    waiter.set_deadline(1_000, 61_000)
    assert waiter.deadline_at is not None
    waiter.feed(HandoffResponse(handoff_id="a/r1", status=HandoffStatus.ACCEPTED))
    assert waiter.deadline_at is None
    waiter.set_deadline(1_000, 61_000)  # the request's own reply, read after the decision
    assert waiter.deadline_at is None


@pytest.mark.parametrize("server", list(SERVER_BINARIES))
async def test_a_record_stays_readable_when_the_acceptances_metadata_is_over_the_readers_limit(
        server: str, servers: Servers) -> None:
    # the record keeps the acceptance's metadata past later transitions; one over the reader's
    # payload limit must not make the finished record unreadable (its outcome is small)
    async with make_bus(server, servers) as large, \
            make_bus(server, servers, prefix=large.config.prefix, payload_limit=100_000) as small:
        handle = await small.client("a").request_handoff(req("a", "b"))
        await large.client("b").accept_handoff(handle.handoff_id, metadata={"blob": b"x" * 200_000})
        await large.client("b").complete_handoff(handle.handoff_id, result="done")
        record = await small.client("a").get_handoff_status(handle.handoff_id)
        assert record is not None and record.status is HandoffStatus.COMPLETED
        assert record.response.result == "done" and record.accepted_metadata == {}
        whole = await large.client("a").get_handoff_status(handle.handoff_id)
        assert whole is not None and whole.accepted_metadata == {"blob": b"x" * 200_000}


@pytest.mark.parametrize("server", list(SERVER_BINARIES))
async def test_a_handle_attached_as_the_outcome_arrives_hears_the_acceptance_whole(
    server: str, servers: Servers, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A handle attached from another process after the acceptance: its reader, already
    running, hears COMPLETED while the handle's first read of the record is under way. The
    decision must still be the acceptance as it was made (its metadata and its time), as the
    record tells it, not one made up from the outcome."""
    async with make_bus(server, servers) as bus, make_bus(server, servers, prefix=bus.config.prefix) as other:
        alice, bob = bus.client("alice"), bus.client("bob")
        await other.client("alice").request_handoff(req("alice", "bob", request_id="keep"))  # other's reader runs
        handle = await alice.request_handoff(req("alice", "bob", request_id="r1"))
        hid = handle.handoff_id
        accepted = await bob.accept_handoff(hid, metadata={"eta_s": 30})
        read_record, reader = other.read_record, other.reader("alice", other.client("alice")._refresh)

        async def completed_meanwhile(handoff_id: str) -> Any:
            if handoff_id == hid and reader.watching(hid):  # the outcome reaches the reader while the record is read
                waiter = reader._waiters[hid]
                await bob.complete_handoff(hid, result="done")
                await waiter.wait_finished(5)
                assert waiter.outcome is not None
            return await read_record(handoff_id)

        monkeypatch.setattr(other, "read_record", completed_meanwhile)
        with anyio.fail_after(5):
            attached = await other.client("alice").handle(hid).decision()
        assert attached.status is HandoffStatus.ACCEPTED
        assert attached.metadata == {"eta_s": 30}
        assert attached == accepted
