"""The expiry sweep: turns overdue PENDING handoffs into EXPIRED without keyspace notifications.

Every open bus runs one; a lease with a TTL lets one of them sweep at a time and hands the
job over within one lease period when its holder dies. Correctness never waits for the
sweep: every script checks the deadline itself, and a waiting requester asks for its own
handoff at the deadline. The sweep decides how soon everything else hears EXPIRED, and
takes expired handoffs out of their targets' queues.
"""

from __future__ import annotations

import contextlib
import logging
import uuid
from collections import defaultdict
from collections.abc import AsyncGenerator
from typing import TYPE_CHECKING

import anyio
from anyio.abc import TaskStatus
from redis.exceptions import RedisClusterException, RedisError

from .checks import SETTLE_MARK
from .errors import HandoffbusError
from .keys import GROUP, RESTORED
from .names import split_handoff_id, stored_names
from .plainreads import refuses_scripts
from .registered import Registered
from .routing import Reroute

if TYPE_CHECKING:
    from .bus import HandoffBus

__all__ = ["Sweeper"]

log = logging.getLogger("handoffbus")

#: the longest a batch's follow-ups (settling, routing lapsed offers again) may hold up a stop,
#: and the longest a stop waits to hand the lease over
FOLLOW_UP_WAIT = 5.0
RELEASE_WAIT = 1.0
#: requesters whose scripts go in one round trip
REQUESTERS_A_CALL = 200
#: looks for idle requesters per ``requester_idle``: one idle is unlisted at most this much later
UNLIST_LOOKS = 4
#: seconds after unlisting a requester that the sweep looks at it once more (past the minute for
#: which a process remembers having listed it: Registered.AGAIN), and how often it looks for those due
RECHECK_AFTER = Registered.AGAIN + 10.0
RECHECK_EVERY = 5.0


class Sweeper:
    def __init__(self, bus: HandoffBus) -> None:
        self._bus = bus
        self._token = uuid.uuid4().hex
        self._pass_done = anyio.Event()
        #: number of complete sweep passes this bus has made
        self.passes = 0
        #: the last pass met a full batch somewhere: sweep again without waiting
        self.backlog = False
        self._scope: anyio.CancelScope | None = None
        self._stopped = anyio.Event()
        #: the server refused this bus's user the sweep's scripts (a read-only user); it tries
        #: again every ``scripts_recheck``
        self.refused = False
        self._refused_event = anyio.Event()
        #: requesters whose sweep script failed at their last pass (each is logged once as a warning)
        self._failing: set[str] = set()

    async def wait_pass(self) -> None:
        """Return when this bus finishes its next sweep pass (expiry and queue settlement)."""
        await self._pass_done.wait()

    async def wait_stopped(self) -> None:
        """Return once the sweep has ended: the bus closed."""
        await self._stopped.wait()

    async def wait_refused(self) -> None:
        """Return once the server has refused this bus's user the sweep's scripts."""
        await self._refused_event.wait()

    async def hold_lease(self) -> bool:
        bus = self._bus
        held = await bus.script("lease", [bus.keys.sweep_lease], [self._token, int(bus.config.sweep_lease * 1000)])
        return bool(held)

    async def sweep_once(self) -> int:
        """Expire what is due for every requester; return how many handoffs expired.

        One script per requester, sent in batches of ``REQUESTERS_A_CALL`` in one round trip each.
        """
        bus = self._bus
        expired = 0
        self.backlog = False

        async def flush(batch: list[str]) -> None:
            nonlocal expired
            by_target: dict[str, list[str]] = defaultdict(list)
            again: dict[str, list[str]] = defaultdict(list)  # expired earlier, settled again (not counted)
            lapsed: list[Reroute] = []  # routed handoffs whose offer lapsed: route them again
            forsaken: list[tuple[str, str]] = []  # (agent, handoff id) of each lapsed offer
            unrouted: list[tuple[str, str]] = []  # (capability set, handoff id) of expired routed ones
            stray: list[tuple[str, bytes]] = []  # (requester, "~s:" entry) naming nothing to settle
            # shielded (and bounded): once the scripts made handoffs EXPIRED or let offers lapse,
            # settling those queues and routing the lapsed again must follow, or nothing would
            # (the deadline index no longer lists them)
            with anyio.move_on_after(FOLLOW_UP_WAIT, shield=True):
                replies = await bus.scripts_many([
                    ("sweep", [bus.keys.deadlines(agent)],
                     [bus.keys.slot(agent), bus.config.sweep_batch, bus.config.retention_ms,
                      bus.config.response_retention_ms, int(bus.config.offer_time * 1000),
                      int(bus.config.route_guard * 1000)])
                    for agent in batch
                ])
                for agent, reply in zip(batch, replies, strict=True):
                    if isinstance(reply, BaseException):
                        # one requester's slot failed (its keys written by hand, its node out of
                        # reach): the others, in this batch and the next, are swept all the same
                        self._failed(agent, reply)
                        continue
                    self._failing.discard(agent)
                    n_expired, n_lapsed = int(reply[0]), int(reply[1])
                    pairs_end = 2 + 3 * n_expired
                    resettled = reply[pairs_end + 9 * n_lapsed:]
                    expired += n_expired
                    if n_expired + n_lapsed + len(resettled) // 2 >= bus.config.sweep_batch:
                        self.backlog = True  # a full batch: more may be due already
                    for i in range(2, pairs_end, 3):
                        hid = reply[i].decode()
                        if reply[i + 1]:
                            by_target[reply[i + 1].decode()].append(hid)
                        if reply[i + 2]:  # routed: its set's queue may hold it still, for no one
                            unrouted.append((reply[i + 2].decode(), hid))
                    for i in range(0, len(resettled), 2):  # expired before, their settling lost
                        try:
                            again[resettled[i + 1].decode()].append(resettled[i].decode())
                        except UnicodeDecodeError:  # written by hand: no agent's queue to settle
                            stray.append((agent, SETTLE_MARK.encode() + resettled[i].partition(b"/")[2]))
                    for i in range(n_lapsed):
                        values = reply[pairs_end + 9 * i:pairs_end + 9 * i + 9]
                        item = Reroute.read(values[:7], "expiry sweep")
                        if item is not None:
                            lapsed.append(item._replace(may_end=values[7] != b"0"))
                            # the agent the offer lapsed at (none for a guard), as the record names it
                            forsaken += [(agent, item.handoff_id) for agent in stored_names(
                                (values[8],) if values[8] else (), f"the record of {item.handoff_id}")]
                if by_target or again or stray:
                    await self._settle(by_target, again, stray)
                await bus.drop_routes(unrouted)
                if forsaken:
                    await self._unqueue(forsaken)
                if lapsed:
                    await self._reroute(lapsed)
                if forsaken:
                    await self._forsake(forsaken)

        async with contextlib.aclosing(self._requesters()) as batches:
            async for batch in batches:
                await flush(batch)
        return expired

    async def _requesters(self) -> AsyncGenerator[list[str], None]:
        """The requesters set, in batches of ``REQUESTERS_A_CALL``; a member that is no agent id
        (written by hand) left out."""
        bus = self._bus
        batch: list[str] = []
        async for raw in bus.redis.sscan_iter(bus.keys.requesters, count=500):
            batch += stored_names((raw,), bus.keys.requesters)
            if len(batch) >= REQUESTERS_A_CALL:
                yield batch
                batch = []
        if batch:
            yield batch

    async def unlist_idle(self) -> int:
        """Take the requesters idle for ``requester_idle`` out of the requesters set, so that
        the set, which every pass walks, does not keep every requester ever seen (one per
        session, say); return how many. Idle: nothing in its deadline index, no response
        written for that long (``idle`` script).

        A request may come between the check, in the requester's slot, and the removal, in
        the set's: each removed one is checked again after its removal, and listed back if it
        is no longer idle. A request that came later lists it again: the client lists a
        requester after its request too, once a minute (HandoffClient.request_handoff), and
        the forwarder only after. Any process lists it again with a request that comes after
        it was idle that long, as its memory of having listed it lapsed meanwhile."""
        bus = self._bus
        idle_ms = int(bus.config.requester_idle * 1000)
        unlisted = 0

        async def flush(batch: list[str]) -> None:
            nonlocal unlisted
            found = await self._idle(batch, idle_ms)
            if not found:
                return
            # noted first: whatever happens next, each is looked at once more (recheck_unlisted)
            await bus.script("unlisted", [bus.keys.unlisted], ["note", *found])
            # shielded (and bounded): once removed, the ones a request came to meanwhile must go back,
            # and all of them if the second look fails or runs out of time
            with anyio.move_on_after(FOLLOW_UP_WAIT, shield=True):
                still: set[str] = set()
                try:  # the removal too: made, its reply lost or late, it is undone as a failed look is
                    await bus.redis.srem(bus.keys.requesters, *found)
                    still = set(await self._idle(found, idle_ms))
                finally:
                    back = [a for a in found if a not in still]
                    if back:
                        with anyio.move_on_after(FOLLOW_UP_WAIT, shield=True):
                            await bus.redis.sadd(bus.keys.requesters, *back)
                unlisted += len(still)

        async with contextlib.aclosing(self._requesters()) as batches:
            async for batch in batches:
                await flush(batch)
        if unlisted:
            log.info("expiry sweep: %d idle requesters left the requesters set", unlisted)
        return unlisted

    async def recheck_unlisted(self) -> int:
        """List back the requesters unlisted at least ``RECHECK_AFTER`` seconds ago that have
        work by now, and stop watching those; return how many went back.

        A process remembers for up to a minute that it listed a requester, and lists it again
        only after that. A request that leaves nothing behind (refused for a full queue, a
        resubmission of a decided handoff) can thus be followed, within that minute, by one
        that lists nothing, after the sweep found the requester idle and unlisted it. By
        ``RECHECK_AFTER`` every such memory has lapsed: a handoff made before then is still in
        the requester's deadline index (undecided, or expired and not yet settled), or it has
        ended and left nothing to sweep; one made after lists the requester itself."""
        bus = self._bus
        back = 0
        while True:
            raw = await bus.script("unlisted", [bus.keys.unlisted],
                                   ["due", int(RECHECK_AFTER * 1000), REQUESTERS_A_CALL])
            if not raw:
                return back
            names = stored_names(raw, bus.keys.unlisted)
            # a requester with anything in its deadline index goes back (one whose look failed too)
            still = set(await self._idle(names, 0))
            working = [a for a in names if a not in still]
            if working:
                await bus.redis.sadd(bus.keys.requesters, *working)
                back += len(working)
            await bus.redis.zrem(bus.keys.unlisted, *raw)

    async def _idle(self, agents: list[str], idle_ms: int) -> list[str]:
        """Those of ``agents`` with nothing in their deadline index and no response for
        ``idle_ms`` (``idle`` script); one whose look failed is not."""
        bus = self._bus
        replies = await bus.scripts_many([("idle", [bus.keys.deadlines(a), bus.keys.responses(a)], [idle_ms])
                                          for a in agents])
        return [a for a, reply in zip(agents, replies, strict=True) if reply == 1]

    async def _settle(self, expired: dict[str, list[str]], again: dict[str, list[str]],
                      stray: list[tuple[str, bytes]]) -> None:
        """Settle expired handoffs in their targets' queues (counting those expired by this pass),
        then remove their "~s:" entries from their requesters' deadline indexes, with the
        ``stray`` (requester, entry) pairs that name nothing to settle. A target whose
        settling failed (written by hand, its node out of reach, a lost reply) keeps its
        handoffs' entries, and a later sweep settles them again: left queued, a handoff would
        stay there until a worker of its agent took it, for ever if none does, counted against
        ``max_queued``. Never raises: what follows must still run (the fired guards are out of
        the index)."""
        bus = self._bus
        for target, ids in expired.items():
            bus.tally.add(target, "EXPIRED", len(ids))
        todo: dict[str, list[str]] = defaultdict(list)
        for by_target in (expired, again):
            for target, ids in by_target.items():
                todo[target] += ids
        try:
            failed = await bus.settle_many(todo) if todo else {}
        except (RedisError, RedisClusterException, OSError) as exc:
            failed = dict.fromkeys(todo, exc)
        if failed:
            log.warning("expiry sweep: settling expired handoffs of %d agents failed (%s); a later sweep settles "
                        "them again", len(failed), next(iter(failed.values())))
        entries: dict[str, list[str | bytes]] = defaultdict(list)
        for requester, member in stray:
            entries[requester].append(member)
        for target, ids in todo.items():
            if target not in failed:
                for handoff_id in ids:
                    # "<requester>/<request id>", as the sweep script checked it against its own
                    # slot: a request id written by hand need not be a name (never raise here)
                    requester, _, request_id = handoff_id.partition("/")
                    entries[requester].append(SETTLE_MARK + request_id)
        if not entries:
            return
        try:
            async with bus.redis.pipeline(transaction=False) as pipe:
                for requester, members in entries.items():
                    pipe.zrem(bus.keys.deadlines(requester), *members)
                await pipe.execute()
        except (RedisError, RedisClusterException, OSError) as exc:  # settled again later: no harm
            log.warning("expiry sweep: could not clear the settle entries of %d requesters (%s)", len(entries), exc)

    async def _reroute(self, lapsed: list[Reroute]) -> None:
        """Route lapsed offers and fired guards again. Should that fail (their set's node out of
        reach during a failover), their guards are set again, in their requesters' slots, so that
        a later sweep routes them then: the sweep took the guards out of the deadline index, and
        nothing else would route them before they expired."""
        bus = self._bus
        try:
            await bus.router.reroute(lapsed)
            return
        except (RedisError, OSError, HandoffbusError) as exc:
            log.warning("expiry sweep: routing %d handoffs again failed (%s); their routing guards are set again",
                        len(lapsed), exc)
        by_requester: dict[str, list[str]] = defaultdict(list)
        for item in lapsed:
            requester, request_id = split_handoff_id(item.handoff_id)
            by_requester[requester].append(request_id)
        guard_ms = int(bus.config.route_guard * 1000)
        replies = await bus.scripts_many([("guard", [bus.keys.deadlines(requester)], [guard_ms, *ids])
                                          for requester, ids in by_requester.items()])
        for requester, reply in zip(by_requester, replies, strict=True):
            if isinstance(reply, BaseException):
                log.warning("expiry sweep: the routing guards of %s could not be set again (%s); its handoffs "
                            "wait for their deadlines", requester, reply)

    async def _unqueue(self, forsaken: list[tuple[str, str]]) -> None:
        """Take each lapsed offer's handoff out of its agent's own queue, where a redirect put
        it (a routed handoff enters an agent's queue only so): the record no longer offers it
        to that agent, so no worker of it may decide it, and left there it would be listed as
        that agent's pending work and count against its ``max_queued`` until a worker of it
        took it, for ever if the agent is gone. Done before the handoff is routed again, while
        it is offered to no one: nothing can have queued it there again meanwhile."""
        bus = self._bus
        try:
            async with bus.redis.pipeline(transaction=False) as pipe:
                for agent, handoff_id in forsaken:
                    pipe.zrem(bus.keys.target(agent).queue, handoff_id)
                await pipe.execute()
        except (RedisError, RedisClusterException, OSError) as exc:
            log.warning("expiry sweep: could not take %d lapsed offers out of their agents' queues (%s)",
                        len(forsaken), exc)

    async def _forsake(self, forsaken: list[tuple[str, str]]) -> None:
        """Take each lapsed offer's handoff out of its agent's inbox if the worker that pulled
        it there is gone: no worker of an agent that is gone for good would ever reclaim it,
        and it would stay in flight there for ever. One a live worker holds is left to it (it
        is refused the accept, and settles it; or, offered it again, decides it)."""
        bus = self._bus
        for agent, handoff_id in forsaken:
            try:
                keys = bus.keys.target(agent)
                entry = await bus.redis.hget(keys.inflight, handoff_id)
                if entry is None:
                    continue
                rows = await bus.redis.xpending_range(keys.inbox, GROUP, min=entry, max=entry, count=1)
                holder = rows[0]["consumer"].decode(errors="replace") if rows else RESTORED
                if holder != RESTORED and await bus.redis.exists(bus.keys.worker_beat(agent, holder)):
                    continue
                # settled only if that consumer holds it still (no live worker claimed it meanwhile)
                await bus.script("requeue", keys.as_list(), [GROUP, handoff_id, 0, holder, "1"])
            except (RedisError, RedisClusterException, OSError, HandoffbusError) as exc:
                log.warning("expiry sweep: could not take %s out of the inbox of %s (%s)", handoff_id, agent, exc)

    def _failed(self, requester: str, exc: BaseException) -> None:
        if requester in self._failing:
            log.debug("expiry sweep of requester %s failed again (%s)", requester, exc)
            return
        self._failing.add(requester)
        log.warning("expiry sweep of requester %s failed (%s); sweeping the others, and it again next pass",
                    requester, exc)

    async def release_lease(self) -> None:
        bus = self._bus
        key = bus.keys.sweep_lease
        args = (bus.scripts.lease.function, 1, key, self._token, 0)
        # straight to Redis: the script batcher may already be closed. On a cluster, to the key's
        # node: redis-py would ask its command parser's node for an FCALL's keys (COMMAND GETKEYS),
        # a connection to a node the client may have dropped since, which its close never closes
        if bus.is_cluster:
            await bus.redis.execute_command("FCALL", *args, target_nodes=bus.redis.get_node_from_key(key))
        else:
            await bus.redis.fcall(*args)

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        self._stopped = anyio.Event()
        try:
            with anyio.CancelScope() as self._scope:
                task_status.started()
                try:
                    await self._loop()
                finally:
                    # hand the job over now rather than when the lease times out
                    with anyio.move_on_after(RELEASE_WAIT, shield=True), contextlib.suppress(
                            RedisError, RedisClusterException, OSError):
                        await self.release_lease()
        finally:
            self._stopped.set()

    async def stop(self) -> None:
        """End the sweep once the batch under way has its follow-ups done (the bus calls this
        before it closes the script batcher they need), and hand the lease over."""
        if self._scope is not None:
            self._scope.cancel()
            await self._stopped.wait()

    async def _loop(self) -> None:
        unlisted_at = anyio.current_time()  # a new sweeper waits before its first look at idle requesters
        rechecked_at = -RECHECK_EVERY  # and looks for unlisted ones due again at once (another's, say)
        while True:
            try:
                held = await self.hold_lease()
                if self.refused:
                    self.refused = False
                    log.info("expiry sweep: this bus's user may run scripts again; sweeping")
                if held:
                    await self.sweep_once()
                    idle = self._bus.config.requester_idle
                    if idle and anyio.current_time() - unlisted_at >= idle / UNLIST_LOOKS:
                        unlisted_at = anyio.current_time()
                        await self.unlist_idle()
                    if anyio.current_time() - rechecked_at >= RECHECK_EVERY:
                        rechecked_at = anyio.current_time()
                        await self.recheck_unlisted()
                    self.passes += 1
                    self._pass_done.set()
                    self._pass_done = anyio.Event()
            except (RedisError, OSError) as exc:
                if refuses_scripts(exc):  # a read-only user (acl.py's monitor): others sweep
                    recheck = self._bus.config.scripts_recheck
                    if not self.refused:
                        log.info("expiry sweep: this bus's user may not run scripts; not sweeping "
                                 "(trying again every %g s)", recheck)
                    self.refused = True
                    self._refused_event.set()
                    await anyio.sleep(recheck)  # a timer: until an operator may have widened the ACL
                    continue
                self.backlog = False
                log.warning("expiry sweep failed (%s); retrying", exc)
            except Exception:  # e.g. a record written by hand: the sweep goes on for the others
                self.backlog = False
                log.exception("expiry sweep failed; retrying")
            # a backlog (a burst of deadlines) is swept again at once, not a whole interval later
            await anyio.sleep(0 if self.backlog else self._bus.config.sweep_interval)
