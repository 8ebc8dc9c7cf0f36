"""Script calls on the wire: a queued FCALL and its group, RESP packing, and one exchange of
many calls on one connection.

redis-py's general command packer and per-reply wrapper cost several times more than the
work they wrap, so the batcher (``batching.py``) and the cluster sender (``cluster.py``)
pack FCALL themselves and read replies straight from the parser.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import weakref
from collections.abc import Awaitable
from typing import Any

import anyio
from hiredis import pack_command
from redis._parsers.hiredis import NOT_ENOUGH_DATA
from redis.crc import key_slot
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import OutOfMemoryError, ReadOnlyError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from .errors import EncodeError
from .scripts import Script

__all__ = ["Group", "Line", "ScriptCall", "entry_fields", "exchange", "guard_key", "no_script", "pack_call",
           "pack_fcall", "refuses_writes", "stream_entries", "unsendable", "with_unsendable"]

_ASKING = b"*1\r\n$6\r\nASKING\r\n"


def guard_key(key: str) -> str | None:
    """A key of ``key``'s slot that handoffbus never writes, for a cluster call to declare (see
    ``cluster.py``): ``key`` with ``~`` appended (no agent or request id contains one), and for a
    key without a hash tag, also the key as a tag, so the slot stays the same. Starting with
    ``key``, it matches the same ACL key patterns."""
    guard = f"{key}~" if "{" in key else f"{key}~{{{key}}}"
    return guard if key_slot(guard.encode()) == key_slot(key.encode()) else None


def pack_fcall(call: ScriptCall, guard: bool = False) -> bytes:
    """RESP for FCALL, by hiredis's packer (in C): redis-py's general packer costs several times
    more per command. Arguments are str, bytes, int or float (TypeError otherwise)."""
    keys = call.keys
    if guard and keys:
        extra = guard_key(keys[0])
        if extra is not None:
            keys = [*keys, extra]  # the scripts read KEYS by position: one more is never looked at
    packed: bytes = pack_command(("FCALL", call.script.function, len(keys), *keys, *call.args))
    return packed


class Group:
    """The calls of one ``call_many``, and the task waiting for all of them.

    The wait is a bare asyncio future, made when the task starts waiting: the bus runs on
    asyncio only (redis-py's asyncio client), a future costs less than an event (a script
    call's whole round trip is a few of these), and anyio's cancel scopes cancel it all the same.
    """

    __slots__ = ("_all_done", "pending")

    def __init__(self, size: int) -> None:
        self.pending = size
        self._all_done: asyncio.Future[None] | None = None

    def wait(self) -> Awaitable[None]:
        """Until every call of the group is finished: the future itself, awaited by the caller
        (a coroutine around it would be one more frame for every wait to pass through)."""
        done = self._all_done = asyncio.get_running_loop().create_future()
        if not self.pending:
            done.set_result(None)
        return done

    def one_finished(self) -> None:
        self.pending -= 1
        if self.pending == 0 and self._all_done is not None and not self._all_done.done():
            self._all_done.set_result(None)  # (done already: the waiter was cancelled)


class ScriptCall:
    __slots__ = ("args", "asked", "error", "finished", "group", "keys", "parked", "result", "script", "tries")

    def __init__(self, script: Script, keys: list[str], args: list[Any], group: Group) -> None:
        self.script = script
        self.keys = keys
        self.args = args
        self.group = group
        self.result: Any = None
        self.error: BaseException | None = None
        self.finished = False
        #: on a cluster: the node an ASK reply sent the call to, how often it was sent again at
        #: once, and when it was first answered TRYAGAIN
        self.asked: Any = None
        self.tries = 0
        self.parked: float | None = None

    @property
    def slot(self) -> int:
        """The call's cluster slot: its first key's (all its keys share the hash tag)."""
        return key_slot(self.keys[0].encode())

    def finish(self, result: Any = None, error: BaseException | None = None) -> None:
        if self.finished:
            return
        self.finished = True
        self.result, self.error = result, error
        self.group.one_finished()


def no_script(reply: Any) -> bool:
    """Whether a reply says the server does not have the function called (the library is not
    loaded there): Redis and Valkey answer "ERR Function not found"."""
    return isinstance(reply, ResponseError) and str(reply).startswith("Function not found")


def refuses_writes(reply: object) -> bool:
    """Whether a reply is a server's refusal of anything that may write: a replica (READONLY),
    past maxmemory (OOM; a function flagged allow-oom runs), a failed snapshot (MISCONF), too
    few replicas (NOREPLICAS). A function not flagged no-writes is refused whole, before it runs."""
    return isinstance(reply, OutOfMemoryError | ReadOnlyError) or (
        isinstance(reply, ResponseError) and str(reply).startswith(("MISCONF", "NOREPLICAS")))


def pack_call(call: ScriptCall, guard: bool = False) -> bytes:
    """RESP for one batched call: FCALL, or a plain command (``scripts.Command``, no function)
    as itself, which needs no guard key (its key is its slot's own)."""
    if call.script.function:
        return pack_fcall(call, guard)
    plain: bytes = pack_command((call.script.name, *call.keys, *call.args))
    return plain


async def exchange(
    conn: Any, calls: list[ScriptCall], asking: list[bool] | None = None, reply_wait: float | None = None,
    watch: Line | None = None,
) -> list[Any]:
    """Write the calls as one write on one connection, then read one reply per call. On a
    cluster node (``asking`` given) each call declares its guard key, and a call marked in
    ``asking`` goes right after an ASKING, which applies to the next command only. Each reply
    is awaited ``reply_wait`` seconds at most (see ``_round_trip``), or the connection's socket
    timeout if shorter; ``watch``: the Line whose watcher bounds the wait instead."""
    try:
        if asking is None:
            data = b"".join(pack_call(call) for call in calls)
        else:  # a cluster node
            data = b"".join((_ASKING if ask else b"") + pack_call(call, guard=True)
                            for call, ask in zip(calls, asking, strict=True))
    except (UnicodeEncodeError, TypeError):  # nothing was sent: send what can be, each other call hears why not
        return await _without_unsendable(conn, calls, asking, reply_wait, watch)
    # a script never blocks: the connection's socket timeout, if its URL set one, bounds each reply
    waits = [w for w in (reply_wait, getattr(conn, "socket_timeout", None)) if w]
    return await _round_trip(conn, data, len(calls), asking, min(waits) if waits else None, watch)


def unsendable(calls: list[ScriptCall]) -> dict[int, EncodeError]:
    """The calls that cannot be packed, by position, each with its error: one holding text that
    is not UTF-8 (a str with a lone surrogate, as ``os.fsdecode`` makes of a file name's bytes)
    or a value no command takes (None: an isolated agent's forwarded call can hold anything),
    and every other call of its group (sent alone, a later call of a group could run without
    the earlier one). Only looked for when a batch would not pack: one caller's bad argument
    must fail that caller's calls alone, not everyone's in the batch."""
    bad: dict[Group, EncodeError] = {}
    for call in calls:
        try:
            pack_call(call)
        except UnicodeEncodeError as exc:
            bad.setdefault(call.group, EncodeError(f"cannot send {call.script.name}: text that is not UTF-8 ({exc})"))
        except TypeError as exc:
            bad.setdefault(call.group, EncodeError(f"cannot send {call.script.name}: {exc}"))
    return {i: bad[call.group] for i, call in enumerate(calls) if call.group in bad}


async def _without_unsendable(
    conn: Any, calls: list[ScriptCall], asking: list[bool] | None, reply_wait: float | None, watch: Line | None
) -> list[Any]:
    """``exchange`` of the calls that can be packed; the others answered by their EncodeError.
    A failure raised carries ``replies_read`` for the calls in order, as ``exchange`` does."""
    errors = unsendable(calls)
    sent = [i for i in range(len(calls)) if i not in errors]
    replies: list[Any] = []
    try:
        if sent:
            replies = await exchange(conn, [calls[i] for i in sent],
                                     None if asking is None else [asking[i] for i in sent], reply_wait, watch)
    except BaseException as exc:
        replies = getattr(exc, "replies_read", [])
        # the calls in order up to the first one sent and not answered
        upto = sent[len(replies)] if len(replies) < len(sent) else len(calls)
        answers = dict(zip(sent, replies, strict=False))
        exc.replies_read = [errors.get(i, answers.get(i)) for i in range(upto)]  # type: ignore[attr-defined]
        raise
    return with_unsendable(errors, replies, len(calls))


def with_unsendable(errors: dict[int, EncodeError], replies: list[Any], count: int) -> list[Any]:
    """The ``count`` calls' answers: ``unsendable``'s errors in their places, and the replies of
    the calls sent, in order, in the others."""
    answers = iter(replies)
    return [errors[i] if i in errors else next(answers) for i in range(count)]


async def _round_trip(
    conn: Any, data: bytes, count: int, asking: list[bool] | None = None, reply_wait: float | None = None,
    watch: Line | None = None, blocks: float = 0.0,
) -> list[Any]:
    """Write ``data`` (``count`` commands, each after an ASKING where ``asking`` says so) and
    read their replies, each within ``reply_wait`` seconds if given (the first one after the
    write, plus what a slow link needs for a large one: see ``SLOWEST_LINK``), else redis-py's
    TimeoutError; an error reply is returned as its exception, in its command's place. A
    failure raised carries the replies read before it as ``replies_read``: their commands ran.
    ``watch``: the Line to tell when this exchange is due (``blocks`` seconds later for a command
    that blocks) and how many replies it has read."""
    replies: list[Any] = []
    try:
        if watch is not None:
            watch.due = asyncio.get_running_loop().time() + blocks + REPLY_WAIT + len(data) / SLOWEST_LINK
        if not reply_wait:
            await _send_and_read(conn, data, count, asking, replies, watch)
        else:
            try:
                with anyio.fail_after(reply_wait + len(data) / SLOWEST_LINK) as scope:
                    await _send_and_read(conn, data, count, asking, replies, watch, scope, reply_wait)
            except TimeoutError:
                raise RedisTimeoutError(f"no reply within {reply_wait:g} s") from None
    except BaseException as exc:
        with anyio.CancelScope(shield=True):  # even when cancelled: never leak the socket
            await conn.disconnect()  # the replies left on the wire belong to no one now
        exc.replies_read = replies  # type: ignore[attr-defined]
        raise
    finally:
        if watch is not None:
            watch.due = 0.0
    return replies


async def _send_and_read(
    conn: Any, data: bytes, count: int, asking: list[bool] | None, replies: list[Any], watch: Line | None,
    scope: anyio.CancelScope | None = None, reply_wait: float = 0.0,
) -> None:
    await conn.send_packed_command(data, check_health=False)
    # the parser itself, when it has one: redis-py's per-reply wrapper (timeouts, host
    # bookkeeping) costs more than the reply; hiredis hands error replies back as values
    parser = getattr(conn, "_parser", None)
    if asking is None and scope is None and _reads_plain(parser):
        await _read_replies(parser, count, replies, watch)
        return
    read = getattr(parser, "read_response", None) or conn.read_response
    for i in range(count):
        if asking is not None and asking[i]:
            with contextlib.suppress(ResponseError):  # the call's own reply says what went wrong
                await read()  # +OK
        try:
            replies.append(await read())
        except ResponseError as exc:  # an error reply answers its own call only
            replies.append(exc)
        if watch is not None:
            watch.read += 1
        # a server that answers is not silent: the next reply has the wait again (at least half
        # of it: moving the deadline reschedules a timer, too dear to do for every reply)
        if scope is not None and i + 1 < count:
            now = asyncio.get_running_loop().time()  # anyio's clock on asyncio, without its lookups
            if scope.deadline - now < reply_wait / 2:
                scope.deadline = now + reply_wait


def _reads_plain(parser: Any) -> bool:
    """Whether replies can be taken from the parser's hiredis reader directly."""
    return getattr(parser, "_reader", None) is not None and hasattr(parser, "_hiredis_PushNotificationType")


async def _read_replies(parser: Any, count: int, replies: list[Any], watch: Line | None) -> None:
    """``count`` replies from the hiredis reader, reading the socket only when it holds no whole
    reply: what the parser's ``read_response`` does, without a coroutine per reply (most are
    in the buffer already when the first one is). Error replies come back as values; a RESP3
    push message (none is asked for on these connections) goes to the parser's handler."""
    gets, push = parser._reader.gets, parser._hiredis_PushNotificationType
    got = 0
    while got < count:
        reply = gets()
        while reply is NOT_ENOUGH_DATA:
            if not parser._connected:  # disconnected meanwhile (the watcher cut it): as read_response
                raise RedisConnectionError("Connection closed by server.")
            await parser.read_from_socket()
            reply = gets()
        if isinstance(reply, RedisConnectionError):
            raise reply
        if isinstance(reply, list) and reply and isinstance(reply[0], RedisConnectionError):
            raise reply[0]  # as read_response does (e.g. an array led by a LOADING error)
        if push is not None and isinstance(reply, push):
            await parser.handle_push_response(reply)
            continue
        replies.append(reply)
        got += 1
        if watch is not None:
            watch.read += 1


#: seconds one server may take to answer a batch of calls before they fail as on a lost
#: connection: a server that stops answering without closing its connections (frozen, or cut
#: off where no reset reaches us) would otherwise hold the batcher's senders, and with them
#: every call, for ever (TCP keepalive does not notice a live host whose server is stuck)
REPLY_WAIT = 10.0
#: bytes per second the slowest link is taken to carry: a write of ``n`` bytes adds
#: ``n / SLOWEST_LINK`` seconds to the wait for its first reply (most of a large write sits
#: in socket buffers when the send returns, so the reply's wait covers its way to the server)
SLOWEST_LINK = 64 * 1024


def stream_entries(reply: Any) -> Any:
    """The (stream, entries) pairs of an XREAD or XREADGROUP reply, as redis-py or
    ``Line.command`` gives it: a list, a map (RESP3), or nil when the block ran out."""
    return reply.items() if isinstance(reply, dict) else reply or ()


def entry_fields(fields: Any) -> dict[Any, Any]:
    """A stream entry's fields as a dict (``Line.command`` leaves them a flat list; an entry
    deleted while still pending in a group has none)."""
    if isinstance(fields, dict):
        return fields
    return {} if fields is None else dict(zip(fields[::2], fields[1::2], strict=True))


class Watcher:
    """Bounds the exchanges of the lines given to it without a timer each (one per batch cost
    a few percent of a handoff's CPU): one look every second, or a quarter of ``REPLY_WAIT``
    if shorter (see ``Line.check``)."""

    def __init__(self) -> None:
        self._lines: weakref.WeakSet[Line] = weakref.WeakSet()  # a line dropped by its owner leaves

    def add(self, line: Line) -> None:
        self._lines.add(line)

    async def run(self) -> None:
        while True:
            await anyio.sleep(min(1.0, REPLY_WAIT / 4))
            now = anyio.current_time()
            for line in list(self._lines):
                line.check(now)


class Line:
    """A connection of one's own to one server, taken from a pool and kept: for a batcher's
    sender, and for a reader that blocks on a stream. Taking a connection from the pool and
    giving it back for every batch or read (a lock, redis-py's health and metrics bookkeeping,
    a shielded scope) cost more than a small batch.

    A failed exchange disconnects it and the next one connects again; so does one after the
    server closed it while it was held, as the pool's own check would. It goes back to the pool
    and is taken again every ``HOLD`` seconds, so that what the pool does on a release (a new
    token for a streaming credential provider, a reconnect a maintenance notice asked for)
    still happens under steady load."""

    #: seconds a connection is kept before it goes back to the pool and is taken again
    HOLD = 1.0

    __slots__ = ("__weakref__", "_buffered", "_conn", "_pool", "_seen", "_taken", "_watched", "due", "read", "stalled")

    def __init__(self, pool: Any, watcher: Watcher | None = None) -> None:
        """``watcher``: what bounds its exchanges; without one, a timer for each does."""
        self._pool = pool
        self._conn: Any = None
        self._taken = 0.0
        self._watched = watcher is not None
        if watcher is not None:
            watcher.add(self)
        # an exchange's bound, kept by a watcher (``check``) rather than a timer per exchange:
        # when it is due (loop time; 0: none in flight), replies it has read, and as last seen
        self.due = 0.0
        self.read = self._seen = self._buffered = 0
        self.stalled = False

    def check(self, now: float) -> None:
        """A watcher's look: an exchange past its due time with no reply, and no part of one,
        since the last look has its connection cut, and fails as timed out (a server that
        answers gets the wait again)."""
        if not self.due:
            return
        # bytes of a reply not yet whole, in hiredis' reader: a large one on a slow link
        reader = getattr(getattr(self._conn, "_parser", None), "_reader", None)
        buffered = reader.len() if reader is not None and hasattr(reader, "len") else 0
        if self.read != self._seen or buffered != self._buffered:
            self._seen, self._buffered = self.read, buffered
            self.due = max(self.due, now + REPLY_WAIT)
        elif now > self.due and self._conn is not None:
            self.stalled = True
            writer = getattr(self._conn, "_writer", None)
            if writer is not None:
                writer.transport.abort()  # the read waiting on it fails now

    async def _connection(self) -> Any:
        conn, now = self._conn, time.monotonic()
        if conn is not None and now - self._taken > self.HOLD:
            await self.close()
            conn = None
        if conn is None:
            try:
                # a pooled one is checked, a new one greets: both ask the server. asyncio's
                # timeout cancels once, so the pool's own cleanup (a release, under its lock)
                # still runs; anyio's would cancel that too and leak the connection
                async with asyncio.timeout(REPLY_WAIT):
                    conn = await self._pool.get_connection()
            except TimeoutError:
                raise RedisTimeoutError(f"no connection within {REPLY_WAIT:g} s") from None
            self._conn, self._taken = conn, now
        else:
            reader = getattr(conn, "_reader", None)
            if reader is not None and reader.at_eof():  # closed by the server while we held it
                await conn.disconnect()
        return conn

    async def exchange(self, calls: list[ScriptCall]) -> list[Any]:
        conn = await self._connection()
        if not self._watched:
            return await exchange(conn, calls, reply_wait=REPLY_WAIT)
        return await self._bounded(exchange(conn, calls, watch=self))

    async def command(self, *args: Any, blocks: float = 0.0) -> Any:
        """One command's reply, packed and parsed without redis-py's per-command layers (its
        reply callbacks too: an XREAD's entries stay flat field/value lists). An error reply
        is raised. The connection's health check, if the client asks for one, runs first.
        Awaited ``REPLY_WAIT`` seconds past ``blocks``, the time the command itself may block."""
        conn = await self._connection()
        if getattr(conn, "health_check_interval", 0):
            try:
                async with asyncio.timeout(REPLY_WAIT):  # its PING
                    await conn.check_health()
            except TimeoutError:
                with anyio.CancelScope(shield=True):
                    await conn.disconnect()  # its PONG, if it comes, would answer the next command
                raise RedisTimeoutError(f"no reply to a health check within {REPLY_WAIT:g} s") from None
        data = pack_command(args)
        if self._watched:
            (reply,) = await self._bounded(_round_trip(conn, data, 1, watch=self, blocks=blocks))
        else:
            (reply,) = await _round_trip(conn, data, 1, reply_wait=blocks + REPLY_WAIT)
        if isinstance(reply, Exception):
            raise reply
        return reply

    async def _bounded(self, exchange: Awaitable[list[Any]]) -> list[Any]:
        """The exchange's replies; its failure as a timeout if the watcher cut it off."""
        self.stalled = False
        try:
            return await exchange
        except Exception as exc:
            if not self.stalled:
                raise
            timeout = RedisTimeoutError(f"no reply within {REPLY_WAIT:g} s")
            timeout.replies_read = getattr(exc, "replies_read", [])  # type: ignore[attr-defined]
            raise timeout from None

    async def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with anyio.CancelScope(shield=True):
                await self._pool.release(conn)
