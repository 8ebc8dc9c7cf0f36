"""Automatic pipelining: script calls made at the same time travel in one round trip.

Every transition is one EVALSHA; sent one by one from many concurrent tasks, each pays a
full round trip and redis-py's per-command overhead. Calls are queued instead, and a few
sender tasks drain the queue into pipelines: whatever was queued while the previous
pipeline was on the wire goes out together. A lone call still goes out at once, so idle
latency is one round trip as before.

Each call keeps its own reply or error. A call that meets NOSCRIPT (script cache flushed,
failover, restart) has its script loaded and is sent again. When the bus closes, calls not
yet answered fail with ``HandoffbusError`` instead of waiting forever.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import anyio
from anyio.abc import TaskStatus
from redis.exceptions import NoScriptError, ResponseError

from .errors import HandoffbusError
from .scripts import Script

__all__ = ["ScriptBatcher"]

log = logging.getLogger("handoffbus")
#: times a call that met NOSCRIPT is loaded and sent again before its error is returned
NOSCRIPT_ROUNDS = 5


def _pack_evalsha(call: _Call) -> bytes:
    """RESP for EVALSHA. redis-py's general packer costs several times more per command."""
    args = (call.script.sha, len(call.keys), *call.keys, *call.args)
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
    __slots__ = ("args", "error", "finished", "group", "keys", "result", "script")

    def __init__(self, script: Script, keys: list[str], args: list[Any], group: _Group) -> None:
        self.script = script
        self.keys = keys
        self.args = args
        self.group = group
        self.result: Any = None
        self.error: BaseException | None = None
        self.finished = False

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


class ScriptBatcher:
    def __init__(self, redis: Any, *, senders: int = 2, max_batch: int = 512) -> None:
        self._redis = redis
        self._senders = senders
        self._max_batch = max_batch
        self._queue: list[_Call] = []
        self._in_flight: set[_Call] = set()
        self._wake = anyio.Event()
        self._closed = False
        # fakeredis has no wire: it takes commands through redis-py's pipeline
        self._direct = not type(redis).__module__.startswith("fakeredis")

    async def call(self, script: Script, keys: list[str], args: list[Any]) -> Any:
        (reply,) = await self.call_many([(script, keys, args)])
        if isinstance(reply, BaseException):
            raise reply
        return reply

    async def call_many(self, calls: list[tuple[Script, list[str], list[Any]]]) -> list[Any]:
        """Queue several calls together (they run in this order); each reply or its exception."""
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
            batch = self._queue[: self._max_batch]
            del self._queue[: self._max_batch]
            self._in_flight.update(batch)
            try:
                await self._send(batch)
            except BaseException:  # cancelled (the bus is closing) mid-batch
                closed = HandoffbusError("the bus closed before Redis answered")
                for call in batch:
                    call.finish(error=closed)
                raise
            finally:
                self._in_flight.difference_update(batch)

    async def _execute(self, batch: list[_Call]) -> list[Any]:
        if not self._direct:
            async with self._redis.pipeline(transaction=False) as pipe:
                for call in batch:
                    pipe.execute_command("EVALSHA", call.script.sha, len(call.keys), *call.keys, *call.args)
                replies: list[Any] = await pipe.execute(raise_on_error=False)
                return replies
        # the whole batch as one write on one pooled connection, then one reply per call
        data = b"".join(_pack_evalsha(call) for call in batch)
        pool = self._redis.connection_pool
        conn = await pool.get_connection()
        try:
            await conn.send_packed_command(data, check_health=False)
            # the parser itself, when it has one: redis-py's per-reply wrapper (timeouts, host
            # bookkeeping) costs more than the reply; hiredis hands error replies back as values
            read = getattr(getattr(conn, "_parser", None), "read_response", None) or conn.read_response
            replies = []
            for _ in batch:
                try:
                    replies.append(await read())
                except ResponseError as exc:  # an error reply answers its own call only
                    replies.append(exc)
        except BaseException:
            with anyio.CancelScope(shield=True):  # even when cancelled: never leak the socket
                await conn.disconnect()  # the replies left on the wire belong to no one now
            raise
        finally:
            with anyio.CancelScope(shield=True):
                await pool.release(conn)
        return replies

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
