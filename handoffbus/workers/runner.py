"""Worker: serves one Agent from its inbox until told to stop.

One task group: a fetch loop that takes only as many handoffs as there is free
concurrency, and lanes (``lanes.py``) that run each handoff's handler (its steps, in
``steps.py``: acceptance hook, then the work), up to the concurrency at once; beside them,
the heartbeat and reclaim loops (``keeper.py``) and the registry beat. Settling rides on
the next ``take``. Stopping is two-phase: ``drain()`` stops fetching and lets running
handlers finish within the grace period; what is still running then is cancelled and stays
in the consumer group's pending list, where it is not lost. A second stop request cancels
at once.
"""

from __future__ import annotations

import os
import socket
import uuid
from typing import TYPE_CHECKING

import anyio
import msgspec
from anyio.abc import TaskStatus
from redis.exceptions import RedisError

from .. import tracing
from ..backoff import Backoff
from ..config import check_seconds
from ..errors import (
    CallRefused,
    HandoffbusError,
    InvalidRequest,
    InvalidTransition,
    LeaseLost,
    NotPermitted,
)
from ..keys import GROUP
from ..logs import AgentLog
from ..models import TERMINAL, HandoffRequest, HandoffStatus
from ..names import check_names
from ..records import Loaded
from ..waiters import entry_position
from .agent import Agent, AgentState, RetryPolicy
from .inbox import Delivery, Inbox
from .keeper import Keeper
from .lanes import Lanes
from .routes import RouteFeed
from .signals import serve_until_signalled
from .steps import Steps

if TYPE_CHECKING:
    from ..bus import HandoffBus

__all__ = ["Worker"]

#: seconds a registry beat may take once sent before stopping stops waiting for it
REGISTER_WAIT = 5.0
#: seconds an idle worker waits before settling finished handoffs by themselves
SETTLE_DELAY = 0.02
#: seconds a settle of finished handoffs may take once sent, a stop notwithstanding
SETTLE_WAIT = 10.0
#: how often a worker looks for acceptance hooks past their handoff's deadline (seconds)
WATCHDOG_EVERY = 1.0
#: the shortest reclaim time a worker takes (seconds)
MIN_RECLAIM_IDLE = 0.01


def default_consumer_name() -> str:
    host = "".join(c if c.isalnum() or c in "-." else "-" for c in socket.gethostname())[:60] or "host"
    return f"{host}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


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
        if bus.keyring is not None and not bus.keyring.can_sign(agent.agent_id):
            # every decision it wrote would be unsigned, and refused by its requester
            raise InvalidRequest(f"this bus has no signing key of {agent.agent_id!r}: its decisions could not be "
                                 "signed")
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
        self._keeper = Keeper(bus, self._inbox, self._entries, self._log)
        self._steps = Steps(bus, agent, self._keeper, self._entries, self._log)
        # an agent a scenario governs is reached by its scenario's edges only: routed by
        # capabilities, a handoff from any agent would reach it, around the scenario's routes
        scenario = bus.policy.scenario if bus.policy is not None else None
        self.capabilities = [] if scenario is not None and scenario.governs(agent.agent_id) \
            else sorted(set(agent.capabilities))
        self._routes = RouteFeed(bus, agent.agent_id, self.capabilities, self.consumer)
        self._inbox_key = bus.keys.target(agent.agent_id).inbox
        self._done: list[str] = []
        #: the fetch loop is blocked waiting for work: finished handoffs are settled at once then
        #: (under load the next take settles them in the same round trip)
        self._idle = False
        self._settle_wanted = anyio.Event()
        self._give_back: list[tuple[str, HandoffRequest]] = []  # stopped before accepting: back to the queue
        #: taken, but their load failed: loaded and started first (or, stopping, handed back)
        self._carried: list[Delivery] = []
        #: the last inbox entry this worker heard it was given, and whether a take (or a pull)
        #: failed since: its reply may have been lost after the server delivered entries
        self._last_entry = "0-0"
        self._unheard = False
        self._active = 0
        self._changed = anyio.Event()  # a handler finished, or drain was asked for
        self._draining = False
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
        lanes: Lanes | None = None
        try:
            with anyio.CancelScope() as self._stop_scope:
                await self._join()
                async with anyio.create_task_group() as handlers:
                    lanes = Lanes(handlers, self.concurrency)
                    handlers.start_soon(self._registry_loop)
                    handlers.start_soon(self._heartbeat_loop)
                    handlers.start_soon(self._watchdog_loop)
                    handlers.start_soon(self._settle_loop)
                    handlers.start_soon(self._reclaim_loop, lanes)
                    task_status.started()
                    await self._fetch_loop(lanes)
                    with anyio.move_on_after(self.grace):
                        while self._active:
                            await self._wait_change()
                    handlers.cancel_scope.cancel()  # what did not finish stays pending: not lost
        finally:
            await self._wind_down(lanes)

    async def _wind_down(self, lanes: Lanes | None) -> None:
        """Settle what finished, hand back to the queue what was taken but never decided, and
        leave the registry. Shielded, and each step bounded: a server that stopped answering
        must not keep a stopping worker forever (what is not handed back stays pending, to be
        reclaimed; a registry entry not removed ages out by its TTL)."""
        if lanes is not None:
            self._unstarted(lanes)
        with anyio.move_on_after(SETTLE_WAIT, shield=True):
            await self._hand_back_carried()
        await self._settle_done()
        with anyio.move_on_after(SETTLE_WAIT, shield=True):
            await self._hand_back()
        with anyio.move_on_after(REGISTER_WAIT, shield=True):
            await self._leave()
        await self._inbox.close()  # shielded itself

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

    def _unstarted(self, lanes: Lanes) -> None:
        """Sort out the handoffs that waited for a lane when the handlers stopped (a reclaim can
        start more than the concurrency): nothing was sent for them, so a PENDING one goes back
        to the queue and an ended one is settled, as ``_handle`` would; what it would work on or
        dead-letter stays pending, to be reclaimed."""
        for delivery, row, deliveries, reclaimed in lanes.unstarted():
            self._active -= 1
            self._entries.pop(delivery.handoff_id, None)
            if deliveries > self.max_deliveries:
                continue  # due to be dead-lettered: queued again, its count would start over
            self._after_unstarted(delivery.handoff_id, row, reclaimed)

    def _after_unstarted(self, hid: str, row: Loaded | None, reclaimed: bool) -> None:
        if row is None or _only_settled(row, reclaimed):
            self._done.append(hid)
        elif row.status is HandoffStatus.PENDING and row.request is not None and row.error is None:
            self._give_back.append((hid, row.request))

    async def _hand_back_carried(self) -> None:
        """Load what the fetch loop still carried (taken, its load failed) and sort it out as
        ``_unstarted`` does; if the load fails again, it stays pending, to be reclaimed."""
        if not self._carried:
            return
        carried = self._carried
        try:
            loaded = await self._inbox.load([d.handoff_id for d in carried])
        except (RedisError, OSError, HandoffbusError) as exc:  # the bus closing too
            self._log.warning("%s: could not load %d handoffs to hand back (%s); they stay in this worker's "
                              "pending entries, to be reclaimed", self.consumer, len(carried), exc)
            return
        self._carried = []
        for delivery, row in zip(carried, loaded, strict=True):
            self._entries.pop(delivery.handoff_id, None)
            self._after_unstarted(delivery.handoff_id, row, False)

    async def _hand_back(self) -> None:
        """Re-queue handoffs stopped while their acceptance hook ran: others take them now. A
        routed one offered to this agent goes back to its set, for any capable agent."""
        while self._give_back:
            hid, request = self._give_back[0]
            try:
                if not request.to_agent:  # its entry first, and only if still this worker's
                    given_up = await self._inbox.give_up(hid)
                    if given_up:
                        await self.bus.router.release(self.agent.agent_id, hid)  # False: decided, lapsed...
                else:
                    given_up = await self._inbox.requeue(hid, request.priority)
                if not given_up:
                    self._log.info("%s: %s was settled (cancelled or expired) or claimed by another worker "
                                   "meanwhile; left alone", self.consumer, hid, extra={"handoff_id": hid})
            except (RedisError, OSError, HandoffbusError) as exc:  # the bus closing too
                self._log.warning("%s: could not hand %s back (%s); a reclaim of its entry, or the lapse of its "
                                  "offer, brings it back", self.consumer, hid, exc, extra={"handoff_id": hid})
            del self._give_back[0]

    async def _join(self) -> None:
        # the bus's clock estimate, read now: judging an acceptance hook's deadline costs no round trip
        self._started_ms = await self.bus.now_ms()
        await self._routes.refresh()
        await self._register()

    async def _register(self, *, leave: bool = False) -> None:
        keys = self.bus.keys
        ttl_ms = 0 if leave else int(self.beat * 3000)
        info = msgspec.json.encode({
            "consumer": self.consumer, "state": str(self.state), "load": self._active, "limit": self.concurrency,
            "capabilities": self.capabilities, "started_ms": self._started_ms,
            "ttl_ms": ttl_ms, "offer_ms": int(self.bus.config.offer_time * 1000),
        })
        beat = await self.bus.script(
            "register", [keys.workers(self.agent.agent_id), keys.worker_beat(self.agent.agent_id, self.consumer)],
            [self.consumer, info, ttl_ms],
        )
        if not leave:
            self.last_beat_ms = int(beat)
            if self.bus.isolated is None:  # an isolated agent is registered by the forwarder
                # every beat, not once: after an operator's clear_all_handoffs the agent is
                # listed again (routing and fail_fast read the agents set) at the next beat
                await self.bus.redis.sadd(keys.agents, self.agent.agent_id)

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
                self._keeper.lost_contact()
                self._log.warning("%s: registry heartbeat failed (%s)", self.consumer, exc)

    async def _heartbeat_loop(self) -> None:
        """Keep the inbox entries of running handlers fresh, so a long handler is never reclaimed."""
        while True:
            await anyio.sleep(self.reclaim_idle / 3)  # a timer: beats three times per idle period
            if self._entries:
                await self._keeper.beat()

    async def _watchdog_loop(self) -> None:
        """Cut short acceptance hooks still running past their handoff's deadline (see Steps.decide)."""
        while True:
            await anyio.sleep(WATCHDOG_EVERY)  # a timer: one look a second, not one timer a handoff
            self._steps.watchdog.check(await self.bus.now_ms())

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
                await self._keeper.retire_gone()
            finally:
                self._reclaim_pass_done()

    async def _reclaim_once(self, lanes: Lanes, cursor: bytes | str) -> bytes | str:
        free = self.concurrency - self._active
        if free <= 0 or self._draining:
            return cursor
        cursor, claimed = await self._keeper.claim_idle(free, self.reclaim_idle, cursor)
        for delivery, row, deliveries in claimed:
            self._submit(lanes, delivery, row, deliveries, reclaimed=True)
        return cursor

    async def _fetch_loop(self, lanes: Lanes) -> None:
        backoff = Backoff()
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
                if self._unheard:
                    # what a take whose reply was lost delivered to this consumer: left alone, it
                    # would wait for a reclaim (``reclaim_idle`` after contact came back, past
                    # the deadline of a short request) while this worker idles
                    known = {*self._entries.values(), *(d.entry_id for d in self._carried)}
                    found = [d for d in await self._inbox.unseen(self._last_entry, self.concurrency)
                             if d.entry_id not in known and d.handoff_id not in self._entries]
                    self._unheard = False
                    self._heard(found)
                    self._carried = [*self._carried, *found]
                if self._carried:
                    taken, self._carried = self._carried, []
                    loaded = await self._inbox.load([d.handoff_id for d in taken])
                    self._start(lanes, taken, loaded)
                    continue
                done, self._done = self._done, []
                self._unheard = True  # until the take (and a pull) answered
                bell, taken = await self._inbox.take(free, settle=done)
                self._heard(taken)
                if len(taken) < free and self.agent.state is AgentState.RUNNABLE and self._routes.due(bell):
                    pulled = await self._routes.pull(free - len(taken))
                    self._heard(pulled)
                    taken += pulled
                self._unheard = False
                if not taken:
                    with anyio.CancelScope() as self._fetch_scope:
                        if self._draining:  # asked during the take, with no wait yet to cancel
                            self._fetch_scope.cancel()
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
                    self._keeper.lost_contact()
                self._done = done + self._done  # settle them next time
                self._carried = taken  # delivered to this consumer already: not left for a reclaim
                for delivery in taken:  # held: kept fresh by the heartbeat, and not reclaimed by this worker
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

    def _heard(self, taken: list[Delivery]) -> None:
        """Note the last inbox entry given to this worker (a take, a pull and a look for the
        unheard each give entries in the order they were added)."""
        if taken and entry_position(taken[-1].entry_id) > entry_position(self._last_entry):
            self._last_entry = taken[-1].entry_id

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
            if row is None or _only_settled(row, reclaimed):
                if row is not None and row.status is HandoffStatus.ACCEPTED:
                    self._log.warning("%s: %s came from the queue already ACCEPTED; not taken over", self.consumer,
                                      hid, extra={"handoff_id": hid})
                return
            poison = row.error or (
                f"delivered {deliveries} times; its handling kept stopping workers"
                if deliveries > self.max_deliveries else None
            )
            if poison or row.request is None:
                after = "keep pending"  # a stop mid-call leaves it to be looked at again, never settled
                # kept past the dead-letter cap when it may be ACCEPTED (no deadline ends it): accepted,
                # or taken over with a record that cannot be read (its status read as PENDING then)
                keep = row.status is HandoffStatus.ACCEPTED or (reclaimed and row.request is None)
                await self._inbox.dead_letter(delivery, poison or "no request", deliveries, keep=keep)
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
                    attempt = await self._steps.take_over(hid, row.attempt)
                    status = await self._steps.work(hid, row.request, attempt, row.created_ms)
                else:
                    after = "give back"  # nothing sent yet: a stop now hands it back to the queue
                    decision = await self._steps.decide(hid, row.request, row.deadline_ms)
                    after = "keep pending"  # from here a stop leaves it pending, to be reclaimed
                    status = await self._steps.act(hid, row.request, decision, row.created_ms)
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
                self._give_back.append((hid, row.request))
            self._changed.set()


def _only_settled(row: Loaded, reclaimed: bool) -> bool:
    """Whether a taken handoff is settled without a step (as one that is gone): decided
    elsewhere or expired; or ACCEPTED as it came from the queue (accepted work is carried on only from this agent's
    own pending entries, a worker that stopped; an ACCEPTED record from the queue was written
    by its requester, whose slot holds it, never by this agent)."""
    return row.status in TERMINAL or (row.status is HandoffStatus.ACCEPTED and not reclaimed)
