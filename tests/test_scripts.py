"""The Lua contract: headers, one hash slot per call, one library, and survival of a flushed library."""

from __future__ import annotations

import re
from typing import Any

import anyio
import hiredis
import pytest
import redis.asyncio as aioredis
from hypothesis import given
from hypothesis import strategies as st
from redis._parsers.encoders import Encoder
from redis._parsers.hiredis import NOT_ENOUGH_DATA, _AsyncHiredisParser
from redis.connection import PythonRespSerializer
from redis.crc import key_slot
from redis.exceptions import BusyLoadingError, InvalidResponse, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError

from handoffbus import EncodeError, HandoffBus, HandoffHandle, HandoffStatus, ScriptsFlushed, wire
from handoffbus.scripts import SCRIPT_NAMES, Scripts, _files, key_count, script_flags, script_source
from handoffbus.wire import Group, Line, ScriptCall, _round_trip, pack_fcall
from handoffbus.workers.inbox import Inbox

from .conftest import SERVER_BINARIES, Servers, make_bus
from .helpers import req

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize("name", SCRIPT_NAMES)
def test_every_script_has_a_header_matching_its_keys(name: str) -> None:
    raw = _files()[name][1]
    header = raw.split("]]", 1)[0]
    assert raw.startswith("--[[") and "Returns" in header
    declared = {int(n) for n in re.findall(r"KEYS\[(\d+)\]", header)}
    assert declared == set(range(1, key_count(name) + 1))
    code = raw.split("]]", 1)[1]
    used = {int(n) for n in re.findall(r"KEYS\[(\d+)\]", code)}
    assert used <= declared
    assert re.search(r"^-- @include", script_source(name), re.MULTILINE) is None


def test_every_script_file_is_registered() -> None:
    assert set(_files()) == set(SCRIPT_NAMES)


def test_the_scripts_are_flagged_for_a_server_that_refuses_writes() -> None:
    """A function without ``no-writes`` counts as a write: a replica or a server out of memory
    refuses it up front. The reads a worker, a listing and the exporter make carry the flag
    (the server then refuses any write they would make). Past maxmemory, what decides,
    finishes, expires or moves handoffs already made runs (``allow-oom``); what makes new work
    or bookkeeping is refused."""
    assert {name for name in SCRIPT_NAMES if script_flags(name) == ["no-writes"]} == {"load", "blob", "observe", "idle"}
    assert {name for name in SCRIPT_NAMES if script_flags(name) == []} == {
        "request", "enqueue", "route", "register", "count", "unlisted"}
    assert all(script_flags(name) in ([], ["no-writes"], ["allow-oom"]) for name in SCRIPT_NAMES)


@given(keys=st.lists(st.text(min_size=1), max_size=5),
       args=st.lists(st.text() | st.binary() | st.integers(-(2**70), 2**70), max_size=12))
def test_an_fcall_is_packed_as_redis_py_packs_it(keys: list[str], args: list[Any]) -> None:
    """Text of any script (non-ASCII included), bytes and big integers, framed byte for byte as
    redis-py's own RESP serializer frames them."""
    script = Scripts().accept
    reference = PythonRespSerializer(6000, Encoder("utf-8", "strict", False).encode)
    expected = b"".join(reference.pack("FCALL", script.function, len(keys), *keys, *args))
    assert pack_fcall(ScriptCall(script, keys, args, Group(1))) == expected


@pytest.mark.parametrize("bad", [None, True, bytearray(b"x"), {"a": 1}])
def test_an_argument_redis_cannot_carry_is_refused(bad: Any) -> None:
    with pytest.raises(TypeError):
        pack_fcall(ScriptCall(Scripts().accept, ["k"], ["a", bad], Group(1)))


async def test_calls_that_cannot_be_packed_answer_alone_even_when_the_connection_fails(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A call holding text that is not UTF-8 is answered by its EncodeError and the others are
    sent; when the connection then fails midway, the replies read stay in the calls' order."""
    script = Scripts().accept
    bad, good1, good2 = (ScriptCall(script, ["k"], [arg], Group(1)) for arg in ("\udcff", "a", "b"))
    sent: list[bytes] = []

    async def fails_after_one(conn: Any, data: bytes, count: int, *args: Any) -> list[Any]:
        sent.append(data)
        exc = RedisConnectionError("Connection reset by peer")
        exc.replies_read = ["one"]  # type: ignore[attr-defined]
        raise exc

    monkeypatch.setattr(wire, "_round_trip", fails_after_one)
    with pytest.raises(RedisConnectionError) as failed:
        await wire.exchange(object(), [bad, good1, good2])
    [data] = sent
    assert data == pack_fcall(good1) + pack_fcall(good2)  # the bad one never reached the wire
    first, second = failed.value.replies_read  # type: ignore[attr-defined]
    assert isinstance(first, EncodeError) and second == "one"


async def test_every_call_stays_in_one_hash_slot(bus: HandoffBus) -> None:
    calls: list[tuple[str, list[str], list[Any]]] = []
    batcher = bus._batcher
    assert batcher is not None
    call_many, call = batcher.call_many, batcher.call

    async def recording(batch: list[tuple[Any, list[str], list[Any]]]) -> list[Any]:
        calls.extend((script.name, keys, args) for script, keys, args in batch)
        return await call_many(batch)

    async def recording_one(script: Any, keys: list[str], args: list[Any]) -> Any:
        calls.append((script.name, keys, args))
        return await call(script, keys, args)

    batcher.call_many = recording  # type: ignore[method-assign]
    batcher.call = recording_one  # type: ignore[method-assign]
    a, b = bus.client("general-agent-1"), bus.client("security-specialist-1")
    h1 = await a.request_handoff(req("general-agent-1", "security-specialist-1"))
    h2 = await a.request_handoff(req("general-agent-1", "security-specialist-1", timeout=0.1))
    h3 = await a.request_handoff(req("general-agent-1", "security-specialist-1"))
    inbox = Inbox(bus, "security-specialist-1", "w1")
    await inbox.take(1)
    await b.accept_handoff(h1.handoff_id)
    await b.complete_handoff(h1.handoff_id, result=1)
    await h3.cancel()
    assert (await a.get_handoff_status(h3.handoff_id)) is not None
    with anyio.fail_after(5):
        assert (await h2.decision()).status is HandoffStatus.EXPIRED
        await bus.sweeper.wait_pass()
    assert {name for name, _, _ in calls} >= {"request", "enqueue", "take", "accept", "complete", "cancel",
                                               "status", "settle", "sweep", "lease"}
    for name, keys, args in calls:
        slots = {key_slot(k.encode()) for k in keys}
        if name == "sweep":  # it builds record keys from ARGV[1], which must share KEYS[1]'s tag
            slots.add(key_slot(f"{args[0]}h:x".encode()))
        assert len(slots) == 1, (name, keys)


async def test_a_flushed_library_costs_no_failed_call(real_bus: HandoffBus) -> None:
    a, b = real_bus.client("a"), real_bus.client("b")
    for _ in range(3):
        handle = await a.request_handoff(req("a", "b"))
        await real_bus.redis.function_flush()
        await b.accept_handoff(handle.handoff_id)
        await real_bus.redis.function_flush()
        await b.complete_handoff(handle.handoff_id, result="ok")
        with anyio.fail_after(5):
            assert (await handle.outcome()).result == "ok"


def _connection_fails_midway(
    monkeypatch: pytest.MonkeyPatch, bus: HandoffBus, names: list[str], read: int
) -> list[str]:
    """The first batch of calls to ``names`` runs whole, then its connection fails with only
    the first ``read`` replies read. Returns a list that records that it happened."""
    batcher = bus._batcher
    assert batcher is not None
    execute, hit = batcher._execute, list[str]()

    async def fails_midway(batch: list[ScriptCall], line: Line | None) -> list[Any]:
        replies = await execute(batch, line)  # every call ran
        if [call.script.name for call in batch] == names and not hit:
            hit.append(names[0])
            exc = RedisConnectionError("Connection reset by peer")
            exc.replies_read = replies[:read]  # type: ignore[attr-defined]  # what came back before it
            raise exc
        return replies

    monkeypatch.setattr(batcher, "_execute", fails_midway)
    return hit


def _first_script_lost(monkeypatch: pytest.MonkeyPatch, bus: HandoffBus, names: list[str]) -> list[str]:
    """The first batch of calls to ``names``: its first call finds its function missing and the
    others run, as when the server read the pipeline in two parts and another client loaded
    the library it had lost between them. Returns a list that records that it happened."""
    batcher = bus._batcher
    assert batcher is not None
    execute, hit = batcher._execute, list[str]()

    async def split(batch: list[ScriptCall], line: Line | None) -> list[Any]:
        if [call.script.name for call in batch] == names and not hit:
            hit.append(names[0])
            return [ResponseError("Function not found"), *await execute(batch[1:], line)]
        return await execute(batch, line)

    monkeypatch.setattr(batcher, "_execute", split)
    return hit


async def test_a_record_whose_script_was_lost_after_its_queue_entry_ran_is_not_sent_again(
    real_bus: HandoffBus, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The queue entry ran, the record's function was missing. Sent again, the record would come after
    its queue entry, which a worker may have taken and dropped meanwhile for having no record:
    a handoff never delivered. The request fails instead, and nothing of it is left to run."""
    client = real_bus.client("a")
    first = await client.request_handoff(req("a", "b"))  # "b" registered as a target: one batch per request
    records = await real_bus.redis.keys(real_bus.keys.record("a", "*").record)
    lost = _first_script_lost(monkeypatch, real_bus, ["request", "enqueue"])
    with pytest.raises(ScriptsFlushed):
        await client.request_handoff(req("a", "b"))
    assert lost and await real_bus.redis.keys(real_bus.keys.record("a", "*").record) == records  # none made
    later = await client.request_handoff(req("a", "b"))
    pending = await real_bus.client("b").get_pending_handoffs()
    assert [p.handoff_id for p in pending] == [first.handoff_id, later.handoff_id]  # the lone entry lists nothing


async def test_calls_that_ran_beside_one_whose_script_was_lost_keep_their_replies(
    real_bus: HandoffBus, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In such a step only the call whose function was missing fails; a call that ran keeps its reply:
    it changed state (a sweep's expiries, a counter), and failing it would hide that."""
    stats = real_bus.keys.stats("a")
    lost = _first_script_lost(monkeypatch, real_bus, ["status", "count"])
    status, count = await real_bus.scripts_many([
        ("status", real_bus.keys.record("a", "nothing").as_list(), ["nothing", 1000, 1000]),
        ("count", [stats, real_bus.keys.counted("a", "p")], [1, 1, "requested", 1])])
    assert lost and isinstance(status, ScriptsFlushed) and count == 1
    assert await real_bus.redis.hget(stats, "requested") == b"1"  # ran once, not again


async def test_script_calls_go_on_after_the_server_dropped_every_connection(real_bus: HandoffBus) -> None:
    # the batcher keeps its connections between batches: one the server closed meanwhile is
    # replaced before the next batch, not written to and failed
    a, b = real_bus.client("a"), real_bus.client("b")
    handle = await a.request_handoff(req("a", "b"))  # the senders hold their connections now
    killed = await real_bus.redis.client_kill_filter(_type="normal", skipme=True)
    assert killed >= 1
    await real_bus.redis.ping()  # one more round trip: the loop has read the closed sockets' ends
    await b.accept_handoff(handle.handoff_id)
    await b.complete_handoff(handle.handoff_id, result="ok")
    with anyio.fail_after(5):
        assert (await handle.outcome()).result == "ok"


@pytest.mark.parametrize("server", list(SERVER_BINARIES))
async def test_a_line_keeps_its_connection_and_gives_it_back_every_hold(
        server: str, servers: Servers, monkeypatch: pytest.MonkeyPatch) -> None:
    # kept between commands (no pool round each time), yet given back now and then, so that
    # what the pool does on a release (re-authentication, a reconnect asked for) still happens
    pool = aioredis.ConnectionPool.from_url(servers[server].url)
    released: list[object] = []
    release = pool.release

    async def counted(conn: Any) -> None:
        released.append(conn)
        await release(conn)

    monkeypatch.setattr(pool, "release", counted)
    line = Line(pool)
    try:
        assert [await line.command("PING") for _ in range(3)] == [b"PONG"] * 3
        assert released == []
        monkeypatch.setattr(Line, "HOLD", 0.0)
        assert await line.command("PING") == b"PONG"
        assert len(released) == 1
    finally:
        await line.close()
        await pool.disconnect()
    assert len(released) == 2


async def test_closing_the_bus_fails_calls_still_waiting(backend: str, servers: dict) -> None:
    from handoffbus import HandoffbusError

    from .conftest import make_bus

    failures: list[BaseException] = []

    async def request(bus: HandoffBus) -> None:
        try:
            while True:  # requests until the bus closes under one: queued, on the wire, or new
                await bus.client("a").request_handoff(req("a", "b"))
        except HandoffbusError as exc:
            failures.append(exc)

    with anyio.fail_after(30):  # nothing may hang (opening a cluster bus included)
        async with anyio.create_task_group() as outer, make_bus(backend, servers) as bus:
            for _ in range(50):
                outer.start_soon(request, bus)
            await anyio.lowlevel.checkpoint()
    # every requester heard that the bus closed: none hangs, none meets another error
    assert len(failures) == 50 and all("closed" in str(f) for f in failures), failures[:3]


async def test_settling_takes_any_number_of_handoffs_in_one_call(bus: HandoffBus) -> None:
    # settle works on the whole list at once, in slices past what Lua's unpack() takes: more
    # than a slice, repeats and ids that are neither queued nor in flight all count right
    hids = [f"a~r{i}" for i in range(2600)]
    for hid in hids:
        assert await bus.enqueue("b", hid, 0)
    inbox = Inbox(bus, "b", "w1")
    _, taken = await inbox.take(2100)
    assert len(taken) == 2100
    keys = bus.keys.target("b")
    assert await bus.redis.xpending(keys.inbox, "workers") and await bus.redis.hlen(keys.inflight) == 2100
    # 2,100 in flight and 500 queued settled, each once, with repeats and unknown ids mixed in
    assert await bus.settle("b", [*hids, *hids[:50], "a~never"]) == 2600
    assert await bus.redis.zcard(keys.queue) == 0
    assert await bus.redis.hlen(keys.inflight) == 0
    assert await bus.redis.xlen(keys.inbox) == 0
    assert (await bus.redis.xpending(keys.inbox, "workers"))["pending"] == 0
    assert await bus.settle("b", hids) == 0  # nothing left to settle


async def test_one_call_that_misses_its_function_reloads_the_whole_library(real_bus: HandoffBus) -> None:
    # all at once: were functions loaded one by one as calls missed them, a record and its
    # queue entry sent together could run queue first (its function back already, not the record's)
    await real_bus.redis.function_flush()
    await real_bus.client("a").get_handoff_status("a/nothing")  # one script call
    found = await real_bus.redis.function_list(library=real_bus.scripts.library)
    for [library] in found.values() if isinstance(found, dict) else [found]:  # a cluster: every primary's
        functions = {f[b"name"].decode() for f in (dict(zip(i[::2], i[1::2], strict=True)) for i in library[5])}
        assert functions == {script.function for script in real_bus.scripts}


async def test_the_doorbell_rings_when_work_lands_in_an_empty_queue(bus: HandoffBus) -> None:
    """Workers block on the doorbell only after finding the queue empty: the first handoff
    queued after that rings it, the ones queued behind it do not, and a requeue always does."""
    bell = bus.keys.target("b").bell

    async def last_ring() -> bytes | None:
        found = await bus.redis.xrevrange(bell, count=1)
        return found[0][0] if found else None

    for i in range(3):
        await bus.enqueue("b", f"a/r{i}", 0)
        if i == 0:
            first = await last_ring()
            assert first is not None
    assert await last_ring() == first  # queued behind r0: no ring
    inbox = Inbox(bus, "b", "w1")
    seen, taken = await inbox.take(10)
    assert seen == first and [d.handoff_id for d in taken] == ["a/r0", "a/r1", "a/r2"]
    await bus.enqueue("b", "a/r3", 0)
    rung = await last_ring()
    assert rung is not None and rung != first  # the queue was empty again: it rings
    with anyio.fail_after(5):
        assert await inbox.wait(seen, 5000)  # a worker blocked after `seen` wakes
    await inbox.requeue("a/r0", 0)  # queued behind r3, and rung all the same
    assert await last_ring() not in (None, rung)


async def test_replies_read_before_the_connection_failed_reach_their_callers(
    real_bus: HandoffBus, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two requests share a pipeline and the connection fails after the first one's replies
    were read: its caller gets its handle (its handoff exists; told the connection failed, it
    would retry and have the work done twice); only the second hears the failure."""
    client = real_bus.client("a")
    await client.request_handoff(req("a", "b"))  # "b" registered as a target: both go in one batch
    cut = _connection_fails_midway(monkeypatch, real_bus, ["request", "enqueue"] * 2, 2)  # two requests
    results: dict[str, Any] = {}

    async def ask(reason: str) -> None:
        try:
            results[reason] = await client.request_handoff(req("a", "b", reason=reason))
        except RedisConnectionError as exc:
            results[reason] = exc

    async with anyio.create_task_group() as tg:
        tg.start_soon(ask, "first")
        tg.start_soon(ask, "second")
    assert cut
    assert isinstance(results["first"], HandoffHandle) and isinstance(results["second"], RedisConnectionError)
    record = await results["first"].status()
    assert record is not None and record.status is HandoffStatus.PENDING


async def test_a_failed_round_trip_says_which_replies_it_read() -> None:
    class Cut:  # a connection that answers two commands, then fails
        def __init__(self) -> None:
            self.replies = iter([b"one", b"two"])
            self.disconnected = False

        async def send_packed_command(self, data: bytes, check_health: bool = True) -> None:
            pass

        async def read_response(self) -> Any:
            for reply in self.replies:
                return reply
            raise RedisConnectionError("Connection reset by peer")

        async def disconnect(self) -> None:
            self.disconnected = True

    conn = Cut()
    with pytest.raises(RedisConnectionError) as failed:
        await _round_trip(conn, b"", 3)
    assert failed.value.replies_read == [b"one", b"two"] and conn.disconnected  # type: ignore[attr-defined]


async def test_a_request_whose_queue_entrys_reply_was_lost_is_not_failed(
    real_bus: HandoffBus, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The connection fails after the record's reply was read, before its queue entry's: the
    handoff stands, so the entry is sent again (enqueue is idempotent) and the request
    returns; told the connection failed, a caller would retry into a second handoff."""
    client = real_bus.client("a")
    await client.request_handoff(req("a", "b"))  # "b" registered as a target: one batch per request
    cut = _connection_fails_midway(monkeypatch, real_bus, ["request", "enqueue"], 1)  # the record's reply only
    handle = await client.request_handoff(req("a", "b", reason="once"))
    assert cut
    queued = await real_bus.client("b").get_pending_handoffs()
    assert [p.request.reason for p in queued] == ["test", "once"] and queued[1].handoff_id == handle.handoff_id


async def test_a_queue_entry_whose_reply_was_lost_is_not_sent_again_once_its_handoff_is_decided(
    real_backend: str, servers: Servers, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The record's reply was read, its queue entry's lost with the connection; before the
    entry is sent again, a worker took the handoff and finished it. Sent again, it would put a
    decided handoff back in the queue (and at the queue's cap, report it as not created)."""
    async with make_bus(real_backend, servers) as bus, \
            make_bus(real_backend, servers, prefix=bus.keys.prefix) as target_bus:
        client = bus.client("a")
        await client.request_handoff(req("a", "b"))  # "b" registered as a target: one batch per request
        batcher = bus._batcher
        assert batcher is not None
        execute, finished = batcher._execute, list[str]()

        async def finished_meanwhile(batch: list[ScriptCall], line: Line | None) -> list[Any]:
            replies = await execute(batch, line)
            if [call.script.name for call in batch] == ["request", "enqueue"] and not finished:
                hid = str(batch[0].args[0])
                inbox = Inbox(target_bus, "b", "w1")
                _, taken = await inbox.take(10)
                await target_bus.client("b").accept_handoff(hid)
                await target_bus.client("b").complete_handoff(hid, result="done")
                await inbox.take(0, settle=[d.handoff_id for d in taken])
                finished.append(hid)
                exc = RedisConnectionError("Connection reset by peer")
                exc.replies_read = replies[:1]  # type: ignore[attr-defined]  # the record's only
                raise exc
            return replies

        monkeypatch.setattr(batcher, "_execute", finished_meanwhile)
        handle = await client.request_handoff(req("a", "b", reason="once"))
        assert finished == [handle.handoff_id]
        assert await bus.redis.zscore(bus.keys.target("b").queue, handle.handoff_id) is None  # not back
        record = await handle.status()
        assert record is not None and record.status is HandoffStatus.COMPLETED


async def test_a_transitions_whole_reply_is_read_as_well(bus: HandoffBus, monkeypatch: pytest.MonkeyPatch) -> None:
    """A transition made now answers {1, to, ts, owner}; a forwarder of an earlier version
    relays the whole response instead, which reads the same."""
    a, b = bus.client("a"), bus.client("b")
    handle = await a.request_handoff(req("a", "b"))
    script = bus.script

    async def whole(name: str, keys: list[str], args: list[Any]) -> Any:
        reply = await script(name, keys, args)
        if name == "accept" and int(reply[0]) == 1:
            assert len(reply) == 4
            fields = dict(zip(args[5::2], args[6::2], strict=True))
            reply = [1, reply[1], b"ACCEPTED", args[2].encode(), reply[2], reply[3],
                     None, None, None, None, None, None, fields.get("rmeta"), None]
        return reply

    monkeypatch.setattr(bus, "script", whole)
    accepted = await b.accept_handoff(handle.handoff_id, metadata={"m": 1})
    assert accepted == (await a.get_handoff_status(handle.handoff_id)).response
    assert accepted.accepting_agent == "b" and accepted.metadata == {"m": 1} and accepted.timestamp_ms > 0


async def test_replies_read_from_the_reader_raise_what_read_response_raises() -> None:
    """Replies of a batch are taken from hiredis' reader directly, not one ``read_response``
    coroutine each; they must come out as they did: error replies as values, a connection
    error (LOADING), alone or leading an array, raised."""
    parser = _AsyncHiredisParser(65536)
    parser._reader = hiredis.Reader(protocolError=InvalidResponse, replyError=parser.parse_error,
                                    notEnoughData=NOT_ENOUGH_DATA)
    parser._connected = True
    parser._hiredis_PushNotificationType = getattr(hiredis, "PushNotification", None)
    replies: list[Any] = []
    parser._reader.feed(b":1\r\n-ERR Function not found\r\n*2\r\n:2\r\n$1\r\nx\r\n")
    await wire._read_replies(parser, 3, replies, None)
    assert replies[0] == 1 and isinstance(replies[1], ResponseError) and replies[2] == [2, b"x"]
    for data in (b"-LOADING Redis is loading\r\n", b"*2\r\n-LOADING Redis is loading\r\n:5\r\n"):
        parser._reader.feed(data)
        with pytest.raises(BusyLoadingError):
            await wire._read_replies(parser, 1, [], None)
