"""Automatic pipelining: script calls made at the same time travel in one round trip.

Every transition is one EVALSHA; sent one by one from many concurrent tasks, each pays a
full round trip and redis-py's per-command overhead. Calls are queued instead, and a few
sender tasks drain the queue into pipelines: whatever was queued while the previous
pipeline was on the wire goes out together. A lone call still goes out at once, so idle
latency is one round trip as before.

Each call keeps its own reply or error. A call that meets NOSCRIPT (script cache flushed,
failover, restart) has its script loaded and is sent again. When the bus closes, calls not
yet answered fail with ``HandoffbusError`` instead of waiting forever.

On a Redis Cluster a batch is split by node (the primary of each call's slot; every key of
one call shares one hash tag, so one slot) and the nodes are written to at once. A call
answered MOVED is sent again to the node named (and the client's slot table updated), one
answered ASK is sent there with ASKING on the same connection, and one answered TRYAGAIN is
sent again after a short pause: none of those replies means the script ran.

While a slot migrates, a script must not run on either node. The source node runs a script
whose declared keys are all still there, but aborts it with an error at the first command
that touches a key missing there (one it deleted itself a moment before, or one built from
an argument), keeping the writes made before: a half-done transition. So on a cluster every
call also declares a guard key of its slot that never exists: a node answers TRYAGAIN to a
call with a missing key while the slot is migrating or importing, and sees nothing special
about it otherwise. A migration thus holds a slot's calls back until its keys have moved.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from typing import Any

import anyio
from anyio.abc import TaskStatus
from redis.crc import key_slot
from redis.exceptions import (
    AskError,
    MaxConnectionsError,
    MovedError,
    NoScriptError,
    RedisError,
    ResponseError,
    TryAgainError,
)

from .errors import HandoffbusError
from .scripts import Script

__all__ = ["ScriptBatcher", "guard_key", "is_cluster"]

log = logging.getLogger("handoffbus")
#: times a call that met NOSCRIPT is loaded and sent again before its error is returned
NOSCRIPT_ROUNDS = 5
#: rounds of MOVED/ASK/NOSCRIPT replies a cluster call follows before its error is returned
REDIRECT_ROUNDS = 16
#: seconds a cluster call answered TRYAGAIN (its slot is migrating) is sent again before its
#: error is returned: a reshard moves a slot's keys in far less, an aborted one never ends
MIGRATION_WAIT = 30.0
_ASKING = b"*1\r\n$6\r\nASKING\r\n"


def is_cluster(redis: Any) -> bool:
    """Whether ``redis`` is redis-py's asyncio Redis Cluster client."""
    from redis.asyncio.cluster import RedisCluster

    return isinstance(redis, RedisCluster)


def guard_key(key: str) -> str | None:
    """A key of ``key``'s slot that handoffbus never writes, for a cluster call to declare (see
    above): ``key`` with ``~`` appended (no agent or request id contains one), and for a key
    without a hash tag, also the key as a tag, so the slot stays the same. Starting with ``key``,
    it matches the same ACL key patterns."""
    guard = f"{key}~" if "{" in key else f"{key}~{{{key}}}"
    return guard if key_slot(guard.encode()) == key_slot(key.encode()) else None


def _pack_evalsha(call: _Call, guard: bool = False) -> bytes:
    """RESP for EVALSHA. redis-py's general packer costs several times more per command."""
    keys = call.keys
    if guard and keys:
        extra = guard_key(keys[0])
        if extra is not None:
            keys = [*keys, extra]  # the scripts read KEYS by position: one more is never looked at
    args = (call.script.sha, len(keys), *keys, *call.args)
    parts = [b"*%d\r\n$7\r\nEVALSHA\r\n" % (len(args) + 1)]
    for value in args:
        if type(value) is str:
            value = value.encode()
        elif type(value) is int:
            value = b"%d" % value
        elif not isinstance(value, bytes):
            raise TypeError(f"cannot send {type(value).__name__} to Redis")
        parts += (b"$%d\r\n" % len(value), value, b"\r\n")
    return b"".join(parts)


class _Group:
    """The calls of one ``call_many``: one event for all of them.

    An asyncio.Event: the bus runs on asyncio only (redis-py's asyncio client), and creating an
    anyio.Event looks the backend up every time; waiting on it is cancelled by anyio's cancel
    scopes all the same.
    """

    __slots__ = ("done", "pending")

    def __init__(self, size: int) -> None:
        self.pending = size
        self.done = asyncio.Event()


class _Call:
    __slots__ = ("args", "asked", "error", "finished", "group", "keys", "parked", "result", "script", "tries")

    def __init__(self, script: Script, keys: list[str], args: list[Any], group: _Group) -> None:
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
        self.group.pending -= 1
        if self.group.pending == 0:
            self.group.done.set()


def _no_script(reply: Any) -> bool:
    return isinstance(reply, NoScriptError)


class _Run:
    """The calls of one ``call_many`` in a batch sent to a cluster, in waves: each wave is sent
    once the one before it is answered, so that the calls run in their order even when they
    go to different nodes (a request's record is written before its handoff is queued on the
    target's node, where a worker could otherwise take it and find no record). Consecutive
    calls of one script share a wave: each acts on its own slot alone (one record, one
    queue), and none of them waits for another. After a failed call, the calls of the later
    waves are not sent: they get its error."""

    __slots__ = ("at", "waves")

    def __init__(self, calls: list[_Call]) -> None:
        self.waves: list[list[_Call]] = []
        for call in calls:
            if self.waves and self.waves[-1][-1].script is call.script:
                self.waves[-1].append(call)
            else:
                self.waves.append([call])
        self.at = 0

    def current(self) -> list[_Call]:
        return self.waves[self.at] if self.at < len(self.waves) else []

    def advance(self) -> list[_Call]:
        """The next wave's calls once every call of the current one is answered, else none."""
        wave = self.current()
        if not wave or not all(call.finished for call in wave):
            return []
        self.at += 1
        error = next((call.error for call in wave if call.error is not None), None)
        if error is not None:
            for later in self.waves[self.at:]:
                for call in later:
                    call.finish(error=error)
            self.at = len(self.waves)
        return self.current()

    def calls(self) -> list[_Call]:
        return [call for wave in self.waves for call in wave]


def _runs(batch: list[_Call]) -> list[_Run]:
    groups: dict[int, list[_Call]] = {}
    for call in batch:
        groups.setdefault(id(call.group), []).append(call)
    return [_Run(calls) for calls in groups.values()]


class ScriptBatcher:
    def __init__(self, redis: Any, *, senders: int = 2, max_batch: int = 512) -> None:
        self._redis = redis
        self._senders = senders
        self._max_batch = max_batch
        self._queue: list[_Call] = []
        self._in_flight: set[_Call] = set()
        self._wake = anyio.Event()
        self._closed = False
        #: cluster calls answered TRYAGAIN and the runs they hold up, sent again by one task
        self._parked: list[_Call] = []
        self._parked_runs: list[_Run] = []
        self._unpark = anyio.Event()
        # fakeredis has no wire: it takes commands through redis-py's pipeline
        self._direct = not type(redis).__module__.startswith("fakeredis")
        self._cluster = is_cluster(redis)
        self._refreshed = float("-inf")
        #: cluster replies that sent a call again, by kind (MOVED, ASK, TRYAGAIN): a slot moved
        self.redirects: Counter[str] = Counter()

    async def call(self, script: Script, keys: list[str], args: list[Any]) -> Any:
        (reply,) = await self.call_many([(script, keys, args)])
        if isinstance(reply, BaseException):
            raise reply
        return reply

    async def call_many(self, calls: list[tuple[Script, list[str], list[Any]]]) -> list[Any]:
        """Queue several calls together (they run in this order; on a cluster, see ``_Run``);
        each reply or its exception."""
        if not calls:
            return []  # nothing to wait for (a group of none would never be done)
        if self._closed:
            raise HandoffbusError("the bus is closed")
        group = _Group(len(calls))
        queued = [_Call(script, keys, args, group) for script, keys, args in calls]
        self._queue.extend(queued)
        self._wake.set()
        await group.done.wait()
        return [call.error if call.error is not None else call.result for call in queued]

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        try:
            async with anyio.create_task_group() as tg:
                for _ in range(self._senders):
                    tg.start_soon(self._sender)
                if self._cluster:
                    tg.start_soon(self._unparker)
                task_status.started()
        finally:
            self._closed = True
            closed = HandoffbusError("the bus closed before Redis answered")
            for call in [*self._queue, *self._in_flight]:
                call.finish(error=closed)
            self._queue.clear()

    async def _sender(self) -> None:
        while True:
            while not self._queue:
                if self._wake.is_set():
                    self._wake = anyio.Event()
                await self._wake.wait()
            end = min(self._max_batch, len(self._queue))
            while end < len(self._queue) and self._queue[end].group is self._queue[end - 1].group:
                end += 1  # a group goes whole in one batch: its calls keep their order
            batch = self._queue[:end]
            del self._queue[:end]
            self._in_flight.update(batch)
            try:
                await (self._send_cluster(batch) if self._cluster else self._send(batch))
            except BaseException:  # cancelled (the bus is closing) mid-batch
                closed = HandoffbusError("the bus closed before Redis answered")
                for call in batch:
                    call.finish(error=closed)
                raise
            finally:  # calls still waiting out a slot migration are the unparker's now
                self._in_flight.difference_update([call for call in batch if call.finished])

    async def _execute(self, batch: list[_Call]) -> list[Any]:
        if not self._direct:
            async with self._redis.pipeline(transaction=False) as pipe:
                for call in batch:
                    pipe.execute_command("EVALSHA", call.script.sha, len(call.keys), *call.keys, *call.args)
                replies: list[Any] = await pipe.execute(raise_on_error=False)
                return replies
        pool = self._redis.connection_pool
        conn = await pool.get_connection()
        try:
            return await _exchange(conn, batch)
        finally:
            with anyio.CancelScope(shield=True):
                await pool.release(conn)

    async def _send_cluster(self, batch: list[_Call]) -> None:
        """Send a batch to a cluster: one pipeline per node, all nodes at once, wave after wave
        (see ``_Run``), following MOVED, ASK and NOSCRIPT at once. Calls answered TRYAGAIN (their
        slot is being migrated) are parked with their groups' later waves, so that this sender
        takes the next batch meanwhile."""
        runs = _runs(batch)
        try:
            later = await self._drive(runs, [call for run in runs for call in run.current()])
        except Exception as exc:  # e.g. no node serves a slot: every call not answered yet hears it
            for call in batch:
                call.finish(error=exc)
            return
        self._park(runs, later)

    async def _drive(self, runs: list[_Run], ready: list[_Call]) -> list[_Call]:
        """Send ``ready`` and each wave it opens until only calls answered TRYAGAIN are left;
        returns those."""
        later: list[_Call] = []
        while ready:
            again, waiting = await self._round(ready)
            later += waiting
            ready = again + [call for run in runs for call in run.advance()]
        return later

    def _park(self, runs: list[_Run], later: list[_Call]) -> None:
        if later:
            self._parked += later
            self._parked_runs += [run for run in runs if run.current()]
            self._unpark.set()

    async def _unparker(self) -> None:
        """Send the parked calls again, all together, with growing pauses while their slots
        stay in migration; then their groups' later waves. One task for all of them, so a
        migration holds one connection per node however many calls wait on it."""
        pause = 0.002
        while True:
            if not self._parked:
                pause = 0.002
                self._unpark = anyio.Event()
                await self._unpark.wait()
            await anyio.sleep(pause)  # the MIGRATE of the slot's keys is under way
            pause = min(pause * 2, 0.1)
            runs, later = self._parked_runs, self._parked
            self._parked_runs, self._parked = [], []
            calls = [call for run in runs for call in run.calls()]
            try:
                later = await self._drive(runs, later)
            except Exception as exc:
                for call in calls:
                    call.finish(error=exc)
                later = []
            finally:
                self._in_flight.difference_update([call for call in calls if call.finished])
            self._park(runs, later)

    async def _round(self, calls: list[_Call]) -> tuple[list[_Call], list[_Call]]:
        """Send each call to its node once. Finishes the calls answered for good; returns those
        to send again now (MOVED, ASK, NOSCRIPT) and those to send again later (TRYAGAIN)."""
        manager = self._redis.nodes_manager
        by_node: dict[str, tuple[Any, list[_Call]]] = {}
        for call in calls:
            node = call.asked or manager.get_node_from_slot(call.slot)
            by_node.setdefault(node.name, (node, []))[1].append(call)
        answers: dict[str, list[Any]] = {}
        async with anyio.create_task_group() as tg:
            for name, (node, sent) in by_node.items():
                tg.start_soon(self._on_node, node, sent, answers, name)
        again: list[_Call] = []
        later: list[_Call] = []
        missing: dict[str, Script] = {}
        for name, (_node, sent) in by_node.items():
            for call, reply in zip(sent, answers[name], strict=True):
                asked, call.asked = call.asked, None
                retry: list[_Call] | None = None
                if isinstance(reply, MovedError):
                    retry, kind = again, "MOVED"
                    await manager.move_slot(reply)
                elif isinstance(reply, AskError):
                    call.asked = await self._node_named(reply.host, reply.port)
                    retry, kind = (again if call.asked is not None else None), "ASK"
                elif isinstance(reply, TryAgainError):
                    retry, kind, call.asked = later, "TRYAGAIN", asked  # importing: ask that node again
                elif _no_script(reply):
                    retry, kind, call.asked = again, "", asked
                    missing[call.script.name] = call.script
                if retry is later:
                    call.parked = call.parked or time.monotonic()
                    gave_up = time.monotonic() - call.parked > MIGRATION_WAIT
                else:
                    call.tries += 1
                    gave_up = call.tries > REDIRECT_ROUNDS
                if retry is None or gave_up:
                    if isinstance(reply, Exception):
                        call.finish(error=reply)
                    else:
                        call.finish(result=reply)
                    continue
                if kind:
                    self.redirects[kind] += 1
                retry.append(call)
        if missing:
            try:
                for script in missing.values():
                    await self._redis.script_load(script.source)  # on every primary
            except (RedisError, OSError) as exc:
                for call in again:
                    if call.script.name in missing:
                        call.finish(error=exc)
                again = [call for call in again if not call.finished]
        return again, later

    async def _on_node(self, node: Any, calls: list[_Call], answers: dict[str, list[Any]], name: str) -> None:
        try:
            conn = node.acquire_connection()
        except MaxConnectionsError as exc:
            answers[name] = [exc] * len(calls)
            return
        try:
            answers[name] = await _exchange(conn, calls, [call.asked is not None for call in calls])
        except (RedisError, OSError) as exc:  # this node's calls hear it; the other nodes' do not
            answers[name] = [exc] * len(calls)
            await self._refresh_slots(node.name)
        finally:
            node.release(conn)

    async def _node_named(self, host: str, port: int) -> Any:
        manager = self._redis.nodes_manager
        node = manager.get_node(host=host, port=port)
        if node is None:  # a node this client has not met yet: learn the topology again
            await self._refresh_slots()
            node = manager.get_node(host=host, port=port)
        return node

    async def _refresh_slots(self, failed: str | None = None) -> None:
        """Learn the cluster's slots again after a node failed (a failover may have moved them);
        at most once a second."""
        if time.monotonic() - self._refreshed < 1.0:
            return
        self._refreshed = time.monotonic()
        try:
            await self._redis.nodes_manager.initialize(last_failed_node_name=failed)
        except (RedisError, OSError) as exc:
            log.warning("could not refresh the cluster's slots (%s)", exc)

    async def _send(self, batch: list[_Call]) -> None:
        try:
            replies = await self._execute(batch)
            missing = [c for c, r in zip(batch, replies, strict=True) if _no_script(r)]
            for _ in range(NOSCRIPT_ROUNDS):  # the cache may be flushed again between load and retry
                if not missing:
                    break
                for script in {c.script.name: c.script for c in missing}.values():
                    await self._redis.script_load(script.source)
                retried = dict(zip(map(id, missing), await self._execute(missing), strict=True))
                replies = [retried.get(id(c), r) for c, r in zip(batch, replies, strict=True)]
                missing = [c for c in missing if _no_script(retried[id(c)])]
        except Exception as exc:  # the connection failed: every call of the batch hears it
            for call in batch:
                call.finish(error=exc)
            return
        for call, reply in zip(batch, replies, strict=True):
            if isinstance(reply, Exception):
                call.finish(error=reply)
            else:
                call.finish(result=reply)


async def _exchange(conn: Any, calls: list[_Call], asking: list[bool] | None = None) -> list[Any]:
    """Write the calls as one write on one connection, then read one reply per call. On a
    cluster node (``asking`` given) each call declares its guard key, and a call marked in
    ``asking`` goes right after an ASKING, which applies to the next command only."""
    if asking is None:
        data = b"".join(_pack_evalsha(call) for call in calls)
    else:  # a cluster node
        data = b"".join((_ASKING if ask else b"") + _pack_evalsha(call, guard=True)
                        for call, ask in zip(calls, asking, strict=True))
    try:
        await conn.send_packed_command(data, check_health=False)
        # the parser itself, when it has one: redis-py's per-reply wrapper (timeouts, host
        # bookkeeping) costs more than the reply; hiredis hands error replies back as values
        read = getattr(getattr(conn, "_parser", None), "read_response", None) or conn.read_response
        replies: list[Any] = []
        for i in range(len(calls)):
            if asking is not None and asking[i]:
                with contextlib.suppress(ResponseError):  # the call's own reply says what went wrong
                    await read()  # +OK
            try:
                replies.append(await read())
            except ResponseError as exc:  # an error reply answers its own call only
                replies.append(exc)
    except BaseException:
        with anyio.CancelScope(shield=True):  # even when cancelled: never leak the socket
            await conn.disconnect()  # the replies left on the wire belong to no one now
        raise
    return replies
