"""Automatic pipelining: script calls made at the same time travel in one round trip.

Every transition is one FCALL; sent one by one from many concurrent tasks, each pays a
full round trip and redis-py's per-command overhead. Calls are queued instead, and a few
sender tasks drain the queue into pipelines: whatever was queued while the previous
pipeline was on the wire goes out together. A lone call still goes out at once, so idle
latency is one round trip as before.

Each call keeps its own reply or error. A call whose function the server does not have (a
FUNCTION FLUSH, a restart without persistence, a new primary) has the library loaded and is
sent again. When the bus closes, calls not yet answered fail with ``HandoffbusError``
instead of waiting forever.

On a Redis Cluster, ``cluster.py`` sends each batch (see there).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

import anyio
from anyio.abc import TaskStatus
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from . import wire
from .cluster import ClusterSender, is_cluster
from .errors import HandoffbusError, ScriptsFlushed
from .scripts import GET, SET, Reload, Script, Scripts
from .wire import Group, Line, ScriptCall, Watcher, no_script, refuses_writes, unsendable, with_unsendable

__all__ = ["ScriptBatcher"]

#: times a call whose function was missing is loaded and sent again before its error is returned
RELOAD_ROUNDS = 5
#: seconds a load the server refused is not tried again (see ScriptBatcher.load)
REFUSED_LOAD_WAIT = 5.0


class ScriptBatcher:
    def __init__(self, redis: Any, scripts: Scripts, *, senders: int = 2, max_batch: int = 512,
                 reload: Reload | None = None, lines: Any = None) -> None:
        """``reload``: by default the batcher loads the scripts itself (``load``). ``lines``: on
        one server, the pool each sender takes the connection it keeps from (by default the
        client's own; the bus gives one outside its pool's cap, see ``connections.blocking_client``)."""
        self._redis = redis
        self._scripts = scripts
        self._senders = senders
        self._max_batch = max_batch
        self._queue: list[ScriptCall] = []
        self._in_flight: set[ScriptCall] = set()
        self._wake = anyio.Event()
        self._closed = False
        # fakeredis has no wire: it takes commands through redis-py's pipeline
        direct = not type(redis).__module__.startswith("fakeredis")
        self._reload = reload or self.load
        self._refused: tuple[RedisError, float] | None = None  # the last refused load, and until when
        self._cluster = ClusterSender(redis, self._in_flight, self._reload) if is_cluster(redis) else None
        #: on one server, where each sender's kept connection comes from (see wire.Line)
        self._lines: Any = None
        #: bounds the exchanges of the senders' lines, and of the bus's others (``Line``)
        self.watcher = Watcher()
        if direct and self._cluster is None:
            self._lines = lines if lines is not None else redis.connection_pool

    async def load(self, missing: Sequence[Script]) -> None:
        """Load the library the server (or a primary) lost: every function at once (see
        Scripts.load_all). A load the server refused (a replica, a full server: see
        ``wire.refuses_writes``) is not sent again for ``REFUSED_LOAD_WAIT`` seconds: the calls
        that miss meanwhile hear the same refusal at once, rather than each send the library
        (78 KB) to be refused."""
        if self._refused is not None and time.monotonic() < self._refused[1]:
            exc = self._refused[0]
            raise type(exc)(*exc.args)
        try:
            # bounded as the calls waiting on it: a server that stopped answering would hold
            # this sender, and every call it took, for ever (redis-py sets no socket timeout)
            source = len(self._scripts.source)
            with anyio.fail_after(wire.REPLY_WAIT + source / wire.SLOWEST_LINK):
                await self._scripts.load_all(self._redis)
        except TimeoutError:
            raise RedisTimeoutError(f"no reply to FUNCTION LOAD within {wire.REPLY_WAIT:g} s") from None
        except RedisError as exc:
            if refuses_writes(exc):
                self._refused = (exc, time.monotonic() + REFUSED_LOAD_WAIT)
            raise
        self._refused = None

    @property
    def redirects(self) -> Counter[str]:
        """On a cluster: script calls sent again after a MOVED, ASK or TRYAGAIN reply, by kind."""
        return Counter(self._cluster.redirects) if self._cluster is not None else Counter()

    async def call(self, script: Script, keys: list[str], args: list[Any]) -> Any:
        # not through call_many: one coroutine less to pass through, each way, on every wait
        # (a worker's call goes through a dozen)
        [call], group = self._enqueue([(script, keys, args)])
        await group.wait()
        if call.error is not None:
            raise call.error
        return call.result

    async def call_many(self, calls: list[tuple[Script, list[str], list[Any]]]) -> list[Any]:
        """Queue several calls together (they run in this order; on a cluster, see ``cluster.Run``);
        each reply or its exception."""
        if not calls:
            return []  # nothing to wait for (a group of none would never be done)
        queued, group = self._enqueue(calls)
        await group.wait()
        return [call.error if call.error is not None else call.result for call in queued]

    def _enqueue(self, calls: list[tuple[Script, list[str], list[Any]]]) -> tuple[list[ScriptCall], Group]:
        """Queue the calls as one group, for the senders to take."""
        if self._closed:
            raise HandoffbusError("the bus is closed")
        group = Group(len(calls))
        queued = [ScriptCall(script, keys, args, group) for script, keys, args in calls]
        self._queue.extend(queued)
        self._wake.set()
        return queued, group

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        try:
            async with anyio.create_task_group() as tg:
                for _ in range(self._senders):
                    tg.start_soon(self._sender)
                if self._lines is not None:
                    tg.start_soon(self.watcher.run)
                if self._cluster is not None:
                    tg.start_soon(self._cluster.run)
                task_status.started()
        finally:
            self._closed = True
            closed = HandoffbusError("the bus closed before Redis answered")
            for call in [*self._queue, *self._in_flight]:
                call.finish(error=closed)
            self._queue.clear()
            if self._cluster is not None:
                await self._cluster.close()

    async def _sender(self) -> None:
        line = None if self._lines is None else Line(self._lines, self.watcher)
        try:
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
                    await (self._cluster.send(batch) if self._cluster is not None else self._send(batch, line))
                except BaseException:  # cancelled (the bus is closing) mid-batch
                    closed = HandoffbusError("the bus closed before Redis answered")
                    for call in batch:
                        call.finish(error=closed)
                    raise
                finally:  # calls still waiting out a slot migration are the unparker's now
                    self._in_flight.difference_update(
                        batch if self._cluster is None else [call for call in batch if call.finished])
        finally:
            if line is not None:
                await line.close()

    async def _execute(self, batch: list[ScriptCall], line: Line | None) -> list[Any]:
        if line is None:  # fakeredis
            errors = unsendable(batch)  # as exchange answers them (the in-memory mode: checked always)
            sent = [call for i, call in enumerate(batch) if i not in errors]
            async with self._redis.pipeline(transaction=False) as pipe:
                for call in sent:
                    if call.script.function:
                        pipe.execute_command("FCALL", call.script.function, len(call.keys), *call.keys, *call.args)
                    elif call.script is GET:  # the plain commands (scripts.Command)
                        pipe.get(*call.keys)
                    else:
                        assert call.script is SET
                        pipe.execute_command("SET", *call.keys, *call.args)
                return with_unsendable(errors, await pipe.execute(raise_on_error=False) if sent else [], len(batch))
        return await line.exchange(batch)

    async def _send(self, batch: list[ScriptCall], line: Line | None) -> None:
        failure: Exception | None = None
        try:
            replies = await self._execute(batch, line)
        except Exception as exc:  # the connection failed: the calls it left unanswered hear it
            replies, failure = getattr(exc, "replies_read", []), exc
        else:
            if not any(map(no_script, replies)):  # the usual case: every call answered
                for call, reply in zip(batch, replies, strict=True):
                    _finish(call, reply)
                return
        await self._recover(batch, line, replies, failure)

    async def _recover(
        self, batch: list[ScriptCall], line: Line | None, first: list[Any], failure: Exception | None
    ) -> None:
        """Finish a batch some of whose calls found their function missing or went unanswered:
        those are sent again after a reload, but not those of a group in which a later call ran
        already (sent again, they would run out of order): they fail with ScriptsFlushed, and
        the rest of their group keep their replies."""
        answers: dict[int, Any] = {}  # id(call) -> its latest reply
        broken: set[Group] = set()
        _answered(batch, first, answers, broken)
        sending = batch
        rounds = RELOAD_ROUNDS if failure is None else 0  # a connection that failed: nothing is sent again
        try:
            for _ in range(rounds):  # the library may be flushed again between load and retry
                lost = [c for c in sending if no_script(answers.get(id(c)))]
                if not lost:
                    break
                await self._reload([call.script for call in lost])
                sending = [c for c in lost if c.group not in broken]  # a broken group is not sent again
                if not sending:
                    break
                _answered(sending, await self._execute(sending, line), answers, broken)
        except Exception as exc:
            _answered(sending, getattr(exc, "replies_read", []), answers, broken)  # these ran
            failure = exc
        for call in batch:
            reply = answers.get(id(call), _UNANSWERED)
            if no_script(reply) and call.group in broken:
                call.finish(error=ScriptsFlushed(
                    "the server lost its functions while these calls were on their way, and a later one ran "
                    "before this one could; not sent again, it may be tried again"))
            elif failure is not None and (reply is _UNANSWERED or no_script(reply)):
                call.finish(error=failure)
            else:
                _finish(call, reply)


def _finish(call: ScriptCall, reply: Any) -> None:
    """A call's reply to its caller: an error reply raised there, any other returned."""
    if isinstance(reply, Exception):
        call.finish(error=reply)
    else:
        call.finish(result=reply)


#: a call the connection's failure left without a reply
_UNANSWERED = object()


def _answered(calls: list[ScriptCall], replies: list[Any], answers: dict[int, Any], broken: set[Group]) -> None:
    """Note the replies to the first ``len(replies)`` of ``calls`` (all of them, unless the
    connection failed midway), and the groups they show to have run out of order."""
    answered = calls[:len(replies)]
    answers.update(zip(map(id, answered), replies, strict=True))
    broken |= _out_of_order(answered, replies)


def _out_of_order(calls: list[ScriptCall], replies: list[Any]) -> set[Group]:
    """The groups in which a call ran after an earlier one found its function missing. The
    server read their pipeline in parts, and something loaded the library between them
    (another client that missed it too): sending the earlier call again would run it after
    the later one, e.g. a record after its queue entry, which a worker may have taken and
    dropped meanwhile."""
    missed: set[Group] = set()
    broken: set[Group] = set()
    for call, reply in zip(calls, replies, strict=True):
        if no_script(reply):
            missed.add(call.group)
        elif call.group in missed:
            broken.add(call.group)
    return broken
