"""Worker: serves one Agent from its inbox until told to stop.

One task group: a fetch loop that takes only as many handoffs as there is free
concurrency, and lanes (``lanes.py``) that run each handoff's handler (acceptance hook,
then the work), up to the concurrency at once. Settling rides on
the next ``take``. Stopping is two-phase: ``drain()`` stops fetching and lets running
handlers finish within the grace period; what is still running then is cancelled and stays
in the consumer group's pending list, where it is not lost. A second stop request cancels
at once.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import math
import os
import signal
import socket
import uuid
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
import msgspec
from anyio.abc import TaskStatus
from redis.exceptions import RedisError, ResponseError

from .. import tracing
from ..backoff import LOST_CONNECTION, Backoff
from ..client import rejection_fields
from ..config import check_seconds
from ..errors import (
    CallRefused,
    EncodeError,
    HandoffbusError,
    InvalidRequest,
    InvalidTransition,
    LeaseLost,
    NotPermitted,
    PayloadTooLarge,
    raise_for_code,
)
from ..keys import GROUP
from ..logs import AgentLog
from ..models import TERMINAL, HandoffRequest, HandoffResponse, HandoffStatus
from ..names import check_names, split_handoff_id
from ..policies.blobs import has_blobs, restore
from ..records import Loaded
from .agent import Accept, Agent, AgentState, ReceivedHandoff, Reject, RetryPolicy, is_inline
from .inbox import Delivery, Inbox
from .lanes import Lanes
from .routes import RouteFeed

if TYPE_CHECKING:
    from ..bus import HandoffBus

__all__ = ["HookCancelled", "Worker", "serve_until_signalled"]

log = logging.getLogger("handoffbus")
#: seconds a registry beat may take once sent before stopping stops waiting for it
REGISTER_WAIT = 5.0
#: seconds an idle worker waits before settling finished handoffs by themselves
SETTLE_DELAY = 0.02
#: seconds a settle of finished handoffs may take once sent, a stop notwithstanding
SETTLE_WAIT = 10.0
#: the shortest reclaim time a worker takes (seconds)
MIN_RECLAIM_IDLE = 0.01
T = TypeVar("T")


def default_consumer_name() -> str:
    host = "".join(c if c.isalnum() or c in "-." else "-" for c in socket.gethostname())[:60] or "host"
    return f"{host}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


def describe(exc: BaseException) -> str:
    """``"<type>: <message>"`` for the record, even when the exception's own ``__str__``
    raises (a hook's custom exception): the handoff's outcome must still be sent."""
    name = type(exc).__name__
    for show in (str, repr):
        try:
            return f"{name}: {show(exc)}"
        except Exception:  # e.g. a __str__ reading an attribute its __init__ never set
            continue
    return name


def _handoff_of(fields: dict[bytes, bytes]) -> str | None:
    """The handoff id an inbox entry names, or None for an entry no worker wrote."""
    raw = fields.get(b"h")
    try:
        return raw.decode() if raw else None
    except UnicodeDecodeError:
        return None


class HookCancelled(HandoffbusError):
    """A hook raised CancelledError while nothing cancelled its handler (it awaited something
    its owner cancelled): a failure of the hook, not a stop of the worker."""


async def _call(hook: Callable[..., Any], arg: Any) -> Any:
    """Await an async hook; run a plain one in a worker thread so it cannot block the loop,
    unless it is marked inline."""
    try:
        if inspect.iscoroutinefunction(hook):
            return await hook(arg)
        if is_inline(hook):
            result = hook(arg)
        else:
            # a stop does not wait for the thread (it may never return): the handler ends, and
            # its handoff is given back or left pending as for any hook
            result = await anyio.to_thread.run_sync(hook, arg, abandon_on_cancel=True)
        return await result if inspect.isawaitable(result) else result  # e.g. a plain def returning a coroutine
    except asyncio.CancelledError as exc:
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            raise  # the handler itself is cancelled: a stop
        # not an Exception: raised on, it would end the lane and, through the task group, the worker
        raise HookCancelled(f"{getattr(hook, '__name__', 'hook')} raised CancelledError: {exc}") from exc


class Worker:
    def __init__(
        self,
        bus: HandoffBus,
        agent: Agent,
        *,
        concurrency: int = 8,
        consumer: str | None = None,
        block: float = 1.0,
        grace: float = 30.0,
        reclaim_idle: float = 30.0,
        max_deliveries: int = 5,
    ) -> None:
        # a float would reach Redis as a COUNT and fail every take (the worker never serves)
        for name, value in (("concurrency", concurrency), ("max_deliveries", max_deliveries)):
            if type(value) is not int or value < 1:
                raise InvalidRequest(f"{name} must be an int of at least 1, not {value!r}")
        # a reclaim time near 0 would take over every other worker's running handoffs at once
        # (and make the heartbeat's time to live 0)
        check_seconds("reclaim_idle", reclaim_idle, least=MIN_RECLAIM_IDLE)
        check_seconds("block", block)
        check_seconds("grace", grace, least=0.0)
        # read only when a work hook raises: a bad one would strand that handoff ACCEPTED
        if not isinstance(agent.retry, RetryPolicy):
            raise InvalidRequest(f"{type(agent).__name__}.retry must be a RetryPolicy, not {agent.retry!r}")
        check_names(agent.capabilities, "capability")  # they go into the registry and routing as they are
        self.bus = bus
        self.agent = agent
        self._log = AgentLog(agent.agent_id)
        self.concurrency = concurrency
        self.consumer = consumer or default_consumer_name()
        self.grace = grace
        #: a handoff whose inbox entry sits idle this long (its worker died or froze) is taken
        #: over by a live worker of the agent; running handlers send heartbeats well within it
        self.reclaim_idle = reclaim_idle
        #: an entry delivered more often than this (its handling kept killing workers) is
        #: dead-lettered instead of handled again
        self.max_deliveries = max_deliveries
        self._block_ms = int(block * 1000)
        self._entries: dict[str, str] = {}  # handoff id -> inbox entry of every running handler
        self._reclaim_pass = anyio.Event()
        #: the registry heartbeat: every ``beat`` seconds, with a time to live of three beats
        self.beat = min(1.0, reclaim_idle / 3)
        self._started_ms = 0
        self._inbox = Inbox(bus, agent.agent_id, self.consumer)
        self._routes = RouteFeed(bus, agent.agent_id, list(agent.capabilities), self.consumer)
        self._inbox_key = bus.keys.target(agent.agent_id).inbox
        self._client = bus.client(agent.agent_id)
        self._done: list[str] = []
        #: the fetch loop is blocked waiting for work: finished handoffs are settled at once then
        #: (under load the next take settles them in the same round trip)
        self._idle = False
        self._settle_wanted = anyio.Event()
        self._give_back: list[tuple[str, int]] = []  # stopped before accepting: back to the queue
        self._active = 0
        self._changed = anyio.Event()  # a handler finished, or drain was asked for
        self._draining = False
        #: when this worker last found Redis out of reach or slow (see _lost_contact); never yet
        self._contact_since = -math.inf
        self._fetch_scope: anyio.CancelScope | None = None
        self._stop_scope: anyio.CancelScope | None = None
        #: handoffs this worker decided or finished, by final status (for operators and tests)
        self.handled: dict[HandoffStatus, int] = {}
        #: the worker's load state, for the registry and routing: BUSY at its concurrency limit,
        #: DRAINING once stopping. The agent's own ``state`` is the agent's to set; a handoff
        #: the worker fetched always has a free slot, so it is never refused for being busy.
        self.state = AgentState.RUNNABLE
        #: Redis time (ms) of this worker's last registry heartbeat (0 before the first)
        self.last_beat_ms = 0

    # ------------------------------------------------------------------ control

    def drain(self) -> None:
        """Stop fetching; running handlers get ``grace`` seconds. Called twice: stop at once."""
        if self._draining:
            if self._stop_scope is not None:
                self._stop_scope.cancel()
            return
        self._draining = True
        self.state = AgentState.DRAINING
        if self._fetch_scope is not None:
            self._fetch_scope.cancel()
        self._changed.set()

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Serve until ``drain()`` (or cancellation); returns when drained."""
        try:
            with anyio.CancelScope() as self._stop_scope:
                await self._join()
                async with anyio.create_task_group() as handlers:
                    lanes = Lanes(handlers, self.concurrency)
                    handlers.start_soon(self._registry_loop)
                    handlers.start_soon(self._heartbeat_loop)
                    handlers.start_soon(self._settle_loop)
                    handlers.start_soon(self._reclaim_loop, lanes)
                    task_status.started()
                    await self._fetch_loop(lanes)
                    with anyio.move_on_after(self.grace):
                        while self._active:
                            await self._wait_change()
                    handlers.cancel_scope.cancel()  # what did not finish stays pending: not lost
        finally:
            # shielded, and each step bounded: a server that stopped answering must not keep a
            # stopping worker forever (what is not handed back stays pending, to be reclaimed;
            # a registry entry not removed ages out by its TTL)
            await self._settle_done()
            with anyio.move_on_after(SETTLE_WAIT, shield=True):
                await self._hand_back()
            with anyio.move_on_after(REGISTER_WAIT, shield=True):
                await self._leave()

    async def serve_until_signalled(self) -> None:
        """``run()`` with SIGTERM/SIGINT handling: the first drains, the second stops at once."""
        await serve_until_signalled([self])

    # ------------------------------------------------------------------ loop

    async def _wait_change(self) -> None:
        await self._changed.wait()
        self._changed = anyio.Event()

    async def _settle_loop(self) -> None:
        """Settle finished handoffs while the fetch loop waits for work, so that an idle agent's
        in-flight count and queue cap free up at once instead of at its next take."""
        while True:
            await self._settle_wanted.wait()
            self._settle_wanted = anyio.Event()
            # a moment first: under load the fetch loop wakes for new work at once and settles
            # them with its next take, in the same round trip, and this one finds none left
            await anyio.sleep(SETTLE_DELAY)
            if self._idle:
                await self._settle_done()

    async def _settle_done(self) -> None:
        if not self._done:
            return
        done, self._done = self._done, []
        # shielded: a stop arriving mid-call must not drop the list (its round trip is short)
        with anyio.move_on_after(SETTLE_WAIT, shield=True) as scope:
            try:
                await self._inbox.take(0, settle=done)
            except (RedisError, OSError, HandoffbusError) as exc:  # the bus closing too
                self._log.warning("%s: could not settle %d handoffs (%s); trying again with the next take",
                                  self.consumer, len(done), exc)
                self._done = done + self._done
        if scope.cancelled_caught:
            self._done = done + self._done  # not answered in time: the next settle tries again

    async def _hand_back(self) -> None:
        """Re-queue handoffs stopped while their acceptance hook ran: others take them now."""
        while self._give_back:
            hid, priority = self._give_back[0]
            try:
                if not await self._inbox.requeue(hid, priority):
                    self._log.info("%s: %s was claimed by another worker meanwhile; left to it", self.consumer, hid,
                                   extra={"handoff_id": hid})
            except (RedisError, OSError, HandoffbusError) as exc:  # the bus closing too
                self._log.warning("%s: could not hand %s back (%s); it stays in this worker's pending "
                                  "entries, to be reclaimed", self.consumer, hid, exc, extra={"handoff_id": hid})
            del self._give_back[0]

    async def _join(self) -> None:
        self._started_ms = await self.bus.server_time_ms()
        await self._routes.refresh()
        if self.bus.isolated is None:  # an isolated agent is registered by the forwarder
            await self.bus.redis.sadd(self.bus.keys.agents, self.agent.agent_id)
        await self._register()

    async def _register(self, *, leave: bool = False) -> None:
        keys = self.bus.keys
        ttl_ms = 0 if leave else int(self.beat * 3000)
        info = msgspec.json.encode({
            "consumer": self.consumer, "state": str(self.state), "load": self._active, "limit": self.concurrency,
            "capabilities": sorted(set(self.agent.capabilities)), "started_ms": self._started_ms,
            "ttl_ms": ttl_ms, "offer_ms": int(self.bus.config.offer_time * 1000),
        })
        beat = await self.bus.script(
            "register", [keys.workers(self.agent.agent_id), keys.worker_beat(self.agent.agent_id, self.consumer)],
            [self.consumer, info, ttl_ms],
        )
        if not leave:
            self.last_beat_ms = int(beat)

    async def _leave(self) -> None:
        try:
            await self._register(leave=True)
            # out of the group too, unless it still holds entries (live workers retire it once
            # they took those over): a group must not keep every worker that ever ran
            await self._inbox.retire([self.consumer])
        except Exception as exc:  # the bus may be closing: the entry then ages out by its TTL
            self._log.info("%s: could not deregister (%s)", self.consumer, exc)

    async def _registry_loop(self) -> None:
        """Report state and load to the registry every beat (what routing and operators read)."""
        while True:
            await anyio.sleep(self.beat)  # a timer
            try:
                # shielded: a beat cancelled once sent would still run, possibly after the
                # leave that stopping writes, and list this worker again until its TTL ran out
                with anyio.move_on_after(REGISTER_WAIT, shield=True):
                    await self._register()
                await self._routes.refresh()
            except (RedisError, OSError) as exc:
                self._lost_contact()
                self._log.warning("%s: registry heartbeat failed (%s)", self.consumer, exc)

    async def _heartbeat_loop(self) -> None:
        """Keep the inbox entries of running handlers fresh, so a long handler is never reclaimed."""
        while True:
            await anyio.sleep(self.reclaim_idle / 3)  # a timer: beats three times per idle period
            if self._entries:
                await self._beat_entries()

    async def _beat_entries(self) -> None:
        """Touch the running handoffs' entries, trying again at once after a failure: a
        connection the server dropped fails its first command, and a beat missed three times
        in a row lets another worker take live work over."""
        backoff = Backoff(first=0.05, cap=0.4)
        for attempt in range(4):
            try:
                await self._touch(list(self._entries))
                return
            except (RedisError, OSError) as exc:
                self._lost_contact()
                if attempt == 3:
                    self._log.warning("%s: heartbeat failed (%s)", self.consumer, exc)
                    return
            await anyio.sleep(backoff.delay())  # the retry's backoff

    def _lost_contact(self) -> None:
        """Redis was out of reach, or slow to answer: other workers' entries look idle to this
        one for a while (their beats failed too, and a server's idle times run on while it is
        down), so it claims none until ``reclaim_idle`` of unbroken contact has passed."""
        self._contact_since = anyio.current_time()

    async def _touch(self, hids: list[str]) -> None:
        """Reset the idle time of the inbox entries of handoffs this worker is handling (XCLAIM
        JUSTID to itself). An entry that is gone was re-issued when the group was restored
        after a deletion: adopt the new one, before another worker claims it as idle."""
        held = {hid: self._entries[hid] for hid in hids if hid in self._entries}
        try:
            claimed = await self.bus.redis.xclaim(
                self._inbox_key, GROUP, self.consumer, 0, list(held.values()), justid=True)
        except ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            await self._restore()
            claimed = []
        kept = {c.decode() if isinstance(c, bytes) else c for c in claimed}
        lost = [hid for hid, entry in held.items() if entry not in kept]
        if not lost:
            return
        moved = {hid: entry for hid, entry in (await self._inbox.entries(lost)).items() if entry != held[hid]}
        if moved:
            await self.bus.redis.xclaim(self._inbox_key, GROUP, self.consumer, 0, list(moved.values()), justid=True)
            for hid, entry in moved.items():
                if hid in self._entries:
                    self._entries[hid] = entry

    async def _restore(self) -> None:
        restored = await self._inbox.restore()
        if restored:
            self._log.warning("%s: the consumer group of %s was deleted; recreated it and re-issued %d in-flight "
                              "handoffs from their records", self.consumer, self.agent.agent_id, restored)

    async def wait_reclaim_pass(self) -> None:
        """Return after the reclaim loop's next look for idle entries (for operators and tests)."""
        await self._reclaim_pass.wait()

    def _reclaim_pass_done(self) -> None:
        self._reclaim_pass.set()
        self._reclaim_pass = anyio.Event()

    async def _reclaim_loop(self, lanes: Lanes) -> None:
        """Take over entries other consumers of this agent left idle (they died or froze)."""
        cursor: bytes | str = "0-0"
        while not self._draining:
            await anyio.sleep(self.reclaim_idle / 2)  # a timer: idle entries are looked for twice per period
            try:
                cursor = await self._reclaim_once(lanes, cursor)
                await self._retire_gone()
            finally:
                self._reclaim_pass_done()

    async def _retire_gone(self) -> None:
        """Delete consumers of workers that are gone and hold nothing any more."""
        try:
            retired = await self._inbox.retire_gone()
        except (RedisError, OSError) as exc:  # no group yet (restored by the next take), or an outage
            self._log.debug("%s: retiring gone consumers failed (%s)", self.consumer, exc)
            return
        if retired:
            self._log.info("%s: retired %d consumers of workers that are gone", self.consumer, retired)

    async def _reclaim_once(self, lanes: Lanes, cursor: bytes | str) -> bytes | str:
        free = self.concurrency - self._active
        if free <= 0 or self._draining or anyio.current_time() - self._contact_since < self.reclaim_idle:
            return cursor
        try:
            # a server that froze answers late: claims sent now would land after the thaw,
            # before the holders' beats, and take their running work
            asked = anyio.current_time()
            await self.bus.server_time_ms()
            if anyio.current_time() - asked > self.reclaim_idle / 3:
                self._lost_contact()
                return cursor
            reply = await self.bus.redis.xautoclaim(
                self._inbox_key, GROUP, self.consumer, int(self.reclaim_idle * 1000), cursor, count=free
            )
            cursor, claimed = reply[0], reply[1]
            taken: list[Delivery] = []
            nameless: list[Delivery] = []
            for eid, fields in claimed:
                if not fields:
                    continue  # deleted meanwhile
                hid = _handoff_of(fields)
                if hid is None:
                    nameless.append(Delivery(handoff_id="", entry_id=eid.decode()))
                elif hid not in self._entries:
                    # (an entry this worker is still running went idle too, its heartbeats failing
                    # for a while: it is ours already, and a second run of it must not start)
                    taken.append(Delivery(handoff_id=hid, entry_id=eid.decode()))
            if not taken and not nameless:
                return cursor
            counts = await self._delivery_counts(taken + nameless)
            for delivery in nameless:  # written by hand: left pending, it would be claimed again forever
                deliveries = counts.get(delivery.entry_id, 1)
                await self._inbox.dead_letter(delivery, "the inbox entry names no handoff", deliveries)
                self._log.error("%s: dead-lettered inbox entry %s, which names no handoff", self.consumer,
                                delivery.entry_id)
            loaded = await self._inbox.load([d.handoff_id for d in taken])
        except ResponseError as exc:
            if "NOGROUP" not in str(exc):
                self._log.warning("%s: reclaim failed (%s)", self.consumer, exc)
                return cursor
            try:
                await self._restore()  # the group or the stream was deleted: rebuild it from the index
            except (RedisError, OSError) as again:
                self._log.warning("%s: restoring the consumer group failed (%s)", self.consumer, again)
            return "0-0"
        except (RedisError, OSError) as exc:
            self._lost_contact()
            self._log.warning("%s: reclaim failed (%s)", self.consumer, exc)
            return cursor
        for delivery, row in zip(taken, loaded, strict=True):
            deliveries = counts.get(delivery.entry_id, 1)
            self._log.info("%s: reclaimed %s (delivery %d)", self.consumer, delivery.handoff_id, deliveries,
                           extra={"handoff_id": delivery.handoff_id})
            if deliveries > 1:
                self.bus.tally.add(self.agent.agent_id, "redelivered")
            self._submit(lanes, delivery, row, deliveries, reclaimed=True)
        return cursor

    async def _delivery_counts(self, taken: list[Delivery]) -> dict[str, int]:
        # each entry on its own: one range over them all would also list this worker's other
        # entries between them, and a COUNT could cut off some of those asked for
        async with self.bus.redis.pipeline(transaction=False) as pipe:
            for delivery in taken:
                pipe.xpending_range(self._inbox_key, GROUP, min=delivery.entry_id, max=delivery.entry_id, count=1)
            replies = await pipe.execute()
        return {row["message_id"].decode(): int(row["times_delivered"]) for rows in replies for row in rows}

    async def _fetch_loop(self, lanes: Lanes) -> None:
        backoff = Backoff()
        carried: list[Delivery] = []  # taken, but their load failed: loaded and started first
        while not self._draining:
            free = self.concurrency - self._active
            if free <= 0:
                self.state = AgentState.BUSY
                await self._wait_change()  # never fetch more than there is room for
                continue
            if self.state is AgentState.BUSY:
                self.state = AgentState.RUNNABLE
            done: list[str] = []
            taken: list[Delivery] = []
            try:
                if carried:
                    taken, carried = carried, []
                    loaded = await self._inbox.load([d.handoff_id for d in taken])
                    self._start(lanes, taken, loaded)
                    continue
                done, self._done = self._done, []
                bell, taken = await self._inbox.take(free, settle=done)
                if len(taken) < free and self.agent.state is AgentState.RUNNABLE and self._routes.due(bell):
                    taken += await self._routes.pull(free - len(taken))
                if not taken:
                    with anyio.CancelScope() as self._fetch_scope:
                        self._idle = True
                        try:
                            if self._done:
                                self._settle_wanted.set()  # finished while this loop looked for work
                            await self._inbox.wait(bell, self._block_ms)
                        finally:
                            self._idle = False
                    continue
                loaded = await self._inbox.load([d.handoff_id for d in taken])
            except (RedisError, OSError) as exc:
                if not isinstance(exc, CallRefused):  # an answer (isolated: a pull not granted)
                    self._lost_contact()
                self._done = done + self._done  # settle them next time
                carried = taken  # delivered to this consumer already: not left for a reclaim
                for delivery in carried:  # held: kept fresh by the heartbeat, and not reclaimed by this worker
                    self._entries[delivery.handoff_id] = delivery.entry_id
                # connection lost, server restarting, or a failover's UNBLOCKED/READONLY/LOADING; or,
                # isolated, the forwarder refused a call (a pull from a set it was not granted)
                delay = backoff.delay()
                what = "the forwarder refused a call" if isinstance(exc, CallRefused) else "Redis unavailable"
                self._log.warning("%s: %s (%s); retrying in %.2fs", self.consumer, what, exc, delay)
                await anyio.sleep(delay)
                continue
            backoff.reset()
            self._start(lanes, taken, loaded)

    def _start(self, lanes: Lanes, taken: list[Delivery], loaded: list[Loaded | None]) -> None:
        for delivery, row in zip(taken, loaded, strict=True):
            self._submit(lanes, delivery, row)

    def _submit(
        self, lanes: Lanes, delivery: Delivery, row: Loaded | None, deliveries: int = 1, *, reclaimed: bool = False
    ) -> None:
        self._active += 1
        # held from now: one that waits for a lane (a reclaim can overshoot the concurrency)
        # keeps its inbox entry fresh through the heartbeat, so no other worker claims it
        self._entries[delivery.handoff_id] = delivery.entry_id
        lanes.submit(self._handle, delivery, row, deliveries, reclaimed)

    async def _handle(
        self, delivery: Delivery, row: Loaded | None, deliveries: int = 1, reclaimed: bool = False
    ) -> None:
        hid = delivery.handoff_id
        # what becomes of the delivery when this handler ends
        after = "settle"
        try:
            if row is None or row.status in TERMINAL:
                return  # decided elsewhere, expired or gone: only settle it
            if row.status is HandoffStatus.ACCEPTED and not reclaimed:
                # accepted work is carried on only from this agent's own pending entries (a worker
                # that stopped); taken from the queue, an ACCEPTED record was written by its
                # requester, whose slot holds it: never by this agent
                self._log.warning("%s: %s came from the queue already ACCEPTED; not taken over", self.consumer, hid,
                                  extra={"handoff_id": hid})
                return
            poison = row.error or (
                f"delivered {deliveries} times; its handling kept stopping workers"
                if deliveries > self.max_deliveries else None
            )
            if poison or row.request is None:
                after = "keep pending"  # a stop mid-call leaves it to be looked at again, never settled
                await self._inbox.dead_letter(delivery, poison or "no request", deliveries)
                self._log.error("%s: dead-lettered %s: %s", self.consumer, hid, poison, extra={"handoff_id": hid})
                after = "dead"
                return
            metadata = row.request.metadata
            with tracing.consumer_span("receive", self._inbox_key, hid, metadata, GROUP, self.consumer):
                pass  # the delivery itself: the requester's trace reaches this worker
            with tracing.consumer_span("process", self._inbox_key, hid, metadata, GROUP, self.consumer):
                if row.status is HandoffStatus.ACCEPTED:
                    # accepted by a worker of this agent that stopped: carry on from there (a stop
                    # mid-takeover leaves it pending too: settled, no one would finish it)
                    after = "keep pending"
                    attempt = await self._take_over(hid, row.attempt)
                    status = await self._work(hid, row.request, attempt, row.created_ms)
                else:
                    after = "give back"  # nothing sent yet: a stop now hands it back to the queue
                    decision = await self._decide(hid, row.request)
                    after = "keep pending"  # from here a stop leaves it pending, to be reclaimed
                    status = await self._act(hid, row.request, decision, row.created_ms)
            self.handled[status] = self.handled.get(status, 0) + 1
            # a routed handoff refused and sent on was settled already; settled again by its id
            # later, it could take the entry of its next delivery to this agent
            after = "settled" if status is HandoffStatus.PENDING else "settle"
        except LeaseLost:
            self._log.info("%s: %s was taken over by another worker; dropping this attempt", self.consumer, hid,
                           extra={"handoff_id": hid})
            after = "keep pending"  # its entry belongs to the new holder now
        except InvalidTransition as exc:
            after = "settle"  # cancelled, expired or finished meanwhile; or another agent took it
            if exc.current == HandoffStatus.ACCEPTED.value and exc.owner == self.agent.agent_id:
                # another worker of this agent claimed the entry while this one was slow and works
                # under it now: settled from here, it would be acknowledged under that worker, and
                # never reclaimed if that worker stopped
                after = "keep pending"
        except NotPermitted:
            after = "settle"  # a routed offer that lapsed
        except Exception:
            self._log.exception("%s: handling %s failed; it stays pending", self.consumer, hid,
                                extra={"handoff_id": hid})
            after = "keep pending"
        finally:
            self._active -= 1
            self._entries.pop(hid, None)
            if after == "settle":
                self._done.append(hid)
                if self._idle:
                    self._settle_wanted.set()
            elif after == "give back" and row is not None and row.request is not None:
                self._give_back.append((hid, row.request.priority))
            self._changed.set()

    async def _take_over(self, hid: str, seen: int, *, retry: bool = False) -> int:
        """Hold the handoff's lease for a new run of its work after attempt ``seen``; returns
        the new attempt number. A takeover moves the lease from a stopped worker; a retry
        requires holding it. Sent until answered: a repeat whose first reply was lost finds
        the lease ours at ``seen + 1`` and takes no second attempt."""
        requester, request_id = split_handoff_id(hid)
        keys = self.bus.keys.record(requester, request_id).as_list()
        args = [hid, request_id, self.agent.agent_id, self.consumer, self.consumer if retry else "", seen]
        reply = await self._until_answered(
            "retry" if retry else "takeover", hid, lambda: self.bus.script("reclaim", keys, args))
        if int(reply[0]) < 0:
            raise_for_code(int(reply[0]), hid, self.agent.agent_id, "reclaim", reply[1] if len(reply) > 1 else None)
        return int(reply[1])

    async def _decide(self, hid: str, request: HandoffRequest) -> Accept | Reject:
        try:
            decision = await _call(self.agent.on_handoff_request, request)
        except Exception as exc:
            self._log.exception("%s: acceptance hook failed for %s", self.consumer, hid, extra={"handoff_id": hid})
            return Reject(reason=f"acceptance hook failed: {describe(exc)}", code="HOOK_FAILED")
        if not isinstance(decision, Accept | Reject):
            return Reject(reason=f"acceptance hook returned {type(decision).__name__}", code="HOOK_FAILED")
        if isinstance(decision, Accept) and not isinstance(decision.metadata, dict):
            # it would be written ACCEPTED, then no one could decode the response (this worker
            # neither, which would leave the work to a reclaim)
            return Reject(reason="acceptance hook returned an invalid Accept: metadata must be a dict, "
                                 f"not {type(decision.metadata).__name__}", code="HOOK_FAILED")
        if isinstance(decision, Reject):
            try:
                rejection_fields(decision.reason, decision.code, decision.retry_after_ms, decision.redirect_to)
            except InvalidRequest as exc:
                return Reject(reason=f"acceptance hook returned an invalid Reject: {exc}", code="HOOK_FAILED")
        return decision

    async def _act(
        self, hid: str, request: HandoffRequest, decision: Accept | Reject, created_ms: int
    ) -> HandoffStatus:
        meta = None
        if isinstance(decision, Accept) and decision.metadata:
            try:
                meta = self.bus.codec.dumps_value(decision.metadata)
            except (EncodeError, PayloadTooLarge) as exc:  # the same on every run: refused, not retried
                self._log.error("%s: acceptance hook for %s returned metadata that cannot be sent: %s",
                                self.consumer, hid, exc, extra={"handoff_id": hid})
                decision = Reject(reason=f"acceptance hook returned metadata that cannot be sent: {exc}",
                                  code="HOOK_FAILED")
        if isinstance(decision, Reject):
            fields = rejection_fields(decision.reason, decision.code, decision.retry_after_ms, decision.redirect_to)
            # a routed handoff refused goes on to another agent: it stays PENDING
            with tracing.settle_span(self._inbox_key, hid, "REJECTED"):
                return (await self._send("reject", hid, fields, created_ms)).status
        await self._send("accept", hid, {"rmeta": meta, "lease": self.consumer}, created_ms)
        return await self._work(hid, request, 1, created_ms)

    async def _work(self, hid: str, request: HandoffRequest, attempt: int, created_ms: int) -> HandoffStatus:
        """Run the work hook (retried per the agent's policy) and record its outcome under
        this worker's lease."""
        client, codec, policy = self._client, self.bus.codec, self.agent.retry

        async def renew() -> None:
            await self._renew(hid)

        while True:
            try:
                received = ReceivedHandoff.of(hid, request, attempt, renew, client,
                                              limit=self.bus.config.payload_limit)
                context = received.context
                if context is not None and has_blobs(request.context_snapshot):
                    restoring = functools.partial(restore, self.bus, context, hid)
                    restored = await self._until_answered("restoring the context", hid, restoring)
                    received = msgspec.structs.replace(received, context=restored)
                result = await _call(self.agent.on_handoff_received, received)
                break
            except LeaseLost:
                raise
            except Exception as exc:
                if not policy.should_retry(attempt, exc):
                    self._log.exception("%s: handler failed for %s (attempt %d)", self.consumer, hid, attempt,
                                       extra={"handoff_id": hid})
                    with tracing.settle_span(self._inbox_key, hid, "FAILED"):
                        await self._send("fail", hid, {"error": describe(exc), "lease": self.consumer}, created_ms)
                    return HandoffStatus.FAILED
                delay = policy.delay_before(attempt)
                self._log.warning("%s: handler failed for %s (attempt %d: %s); retrying in %.2fs",
                                  self.consumer, hid, attempt, describe(exc), delay, extra={"handoff_id": hid})
            await anyio.sleep(delay)  # the retry backoff (a stop meanwhile leaves it pending)
            attempt = await self._take_over(hid, attempt, retry=True)
        try:
            packed = None if result is None else codec.dumps_value(result)
        except (EncodeError, PayloadTooLarge) as exc:  # the same on every run: failed, not run again
            self._log.error("%s: the result of %s cannot be sent: %s", self.consumer, hid, exc,
                            extra={"handoff_id": hid})
            with tracing.settle_span(self._inbox_key, hid, "FAILED"):
                await self._send("fail", hid, {"error": f"result cannot be sent: {type(exc).__name__}: {exc}",
                                               "lease": self.consumer}, created_ms)
            return HandoffStatus.FAILED
        with tracing.settle_span(self._inbox_key, hid, "COMPLETED"):
            await self._send("complete", hid, {"result": packed, "lease": self.consumer}, created_ms)
        return HandoffStatus.COMPLETED

    async def _send(self, name: str, hid: str, fields: dict[str, Any], created_ms: int) -> HandoffResponse:
        """Send a transition this worker decided on until the server answers it: given up on a
        lost connection, the handoff would be reclaimed and its hooks run again. A repeat under
        the same lease is answered as done."""
        return await self._until_answered(
            name, hid, lambda: self._client._transition(name, hid, fields, settle=False, created_ms=created_ms))

    async def _until_answered(self, what: str, hid: str, call: Callable[[], Awaitable[T]]) -> T:
        """``call()`` again, with backoff, while the server cannot be reached (a lost connection,
        a timeout, a failover's READONLY): a step of a handler that Redis failed is no failure of
        its hooks. A stop ends the trying, leaving the handoff pending; a refusal is raised."""
        backoff = Backoff()
        while True:
            try:
                return await call()
            except PermissionError:  # refused (a forwarder's CallRefused): no retry changes that
                raise
            except LOST_CONNECTION as exc:
                delay = backoff.delay()
                self._log.warning("%s: %s of %s not answered (%s); retrying in %.2fs", self.consumer, what, hid, exc,
                                  delay, extra={"handoff_id": hid})
                await anyio.sleep(delay)

    async def _renew(self, hid: str) -> None:
        """A handler's own heartbeat: refresh its inbox entry, then confirm the lease is still ours.
        Redis out of reach is not the handler's failure: the background heartbeat keeps trying,
        and the lease is checked again at the next beat and when the outcome is sent."""
        requester, request_id = split_handoff_id(hid)
        try:
            if hid in self._entries:
                await self._touch([hid])
            # the load script, not HGET: an isolated agent reads a peer's record through the forwarder
            keys = self.bus.keys.record(requester, request_id)
            row = await self.bus.script("load", [keys.record, keys.envelope], [0])  # a large envelope left out
        except PermissionError:
            raise
        except LOST_CONNECTION as exc:
            self._log.warning("%s: heartbeat of %s not answered (%s); the handler goes on", self.consumer, hid, exc,
                              extra={"handoff_id": hid})
            return
        holder = row[13] if len(row) > 13 else None
        if holder != self.consumer.encode():
            raise LeaseLost(hid, (holder or b"").decode())


async def serve_until_signalled(workers: list[Worker], ready: Callable[[], None] | None = None) -> None:
    """Run several workers in one process until SIGTERM/SIGINT: the first signal drains them all,
    a second stops them at once. ``ready`` is called once the signals are handled (a signal
    before that would end the process undrained)."""
    async with anyio.create_task_group() as tg:

        async def on_signals() -> None:
            with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                if ready is not None:
                    ready()
                async for signum in signals:
                    log.info("received %s: draining %d workers", signal.Signals(signum).name, len(workers))
                    for worker in workers:
                        worker.drain()

        tg.start_soon(on_signals)
        async with anyio.create_task_group() as running:
            for worker in workers:
                running.start_soon(worker.run)
        tg.cancel_scope.cancel()
