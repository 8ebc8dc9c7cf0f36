"""Capability routing: a request that names capabilities instead of an agent.

A routed request waits in its capability set's priority sorted set (one hash slot per set,
see docs/routing.md). Workers with free slots pull from every set their agent can serve; a
pulled handoff is offered to that agent on its record (``assign``), becomes an entry in the
agent's own inbox (``admit``), and from there is handled exactly like a direct one. The
record is the truth: only the agent a handoff is offered to may accept or refuse it. A
refusal sends the handoff on to the next capable agent (or the one it was redirected to);
when no capable agent is left it ends REJECTED with ``NO_CAPABLE_AGENT``. An offer that is
not decided in time (the agent died) lapses and the expiry sweep routes it again.

This module holds what requesters, workers and the sweep share: the capability-set naming,
the directory of live agents, and ``Router.reroute``.
"""

from __future__ import annotations

import hashlib
import logging
import random
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import msgspec
from redis.exceptions import RedisClusterException, RedisError

from . import errors
from .config import MAX_PRIORITY
from .errors import raise_for_code
from .models import AgentInfo, HandoffResponse, HandoffStatus, WorkerInfo
from .names import check_names, split_handoff_id, stored_names
from .records import response_from_reply, text
from .registered import Registered
from .wire import refuses_writes

if TYPE_CHECKING:
    from .bus import HandoffBus

__all__ = ["NO_CAPABLE_AGENT", "Directory", "Reroute", "Router", "capability_set", "deferred_until", "set_id",
           "still_deferred"]

log = logging.getLogger("handoffbus")

#: rejection code of a routed handoff that no capable agent is left to take
NO_CAPABLE_AGENT = "NO_CAPABLE_AGENT"
#: actor of the transitions the router makes itself
ROUTER = "_router"
#: how many idle capable agents are woken for each routed request
RING = 2

Call = tuple[str, list[str], list[Any]]
_worker_info = msgspec.json.Decoder(WorkerInfo)


def capability_set(capabilities: Iterable[str]) -> str:
    """The canonical form of a set of capabilities: sorted, unique, comma-separated."""
    return ",".join(sorted(set(check_names(list(capabilities), "capability"))))


def set_id(canonical: str) -> str:
    """Short stable id of a capability set (its routing slot's hash tag)."""
    return hashlib.blake2b(canonical.encode(), digest_size=8).hexdigest()


def serves(agent_capabilities: Iterable[str], canonical: str) -> bool:
    return set(canonical.split(",")) <= set(agent_capabilities)


class Reroute(NamedTuple):
    """A routed handoff to route again, as the reject and sweep scripts describe it."""

    handoff_id: str
    caps: str
    priority: int
    created_ms: int
    deadline_ms: int
    refused: str  # ",a,b,"
    deferred: str  # ",a=<until ms>,"
    redirect: str | None = None
    #: whether routing it may end it (REJECTED, NO_CAPABLE_AGENT) when every live capable
    #: agent refused it; not after a release: the agent that gave it back is only restarting
    may_end: bool = True

    @classmethod
    def of(cls, values: Sequence[Any], redirect: Any = None) -> Reroute:
        hid, caps, prio, created, deadline, refused, deferred = (
            v.decode() if isinstance(v, bytes) else v for v in values[:7]
        )
        return cls(hid, caps, int(prio), int(created), int(deadline), refused or ",", deferred or ",",
                   redirect.decode() if isinstance(redirect, bytes) else None)

    @classmethod
    def read(cls, values: Sequence[Any], what: str, redirect: Any = None) -> Reroute | None:
        """``of``, or None, with a warning, for a record not as the scripts write it: its
        requester may write anything in its own slot, and one such record must not stop the
        worker, forwarder or sweep that routes it from routing the others. It stays where
        it is until its deadline expires it."""
        try:
            return cls.of(values, redirect)
        except (TypeError, ValueError, AttributeError) as exc:  # UnicodeDecodeError is a ValueError
            hid = values[0] if values else None
            log.warning("%s: handoff %r cannot be routed again, its record is not as written (%s)",
                        what, hid.decode(errors="replace") if isinstance(hid, bytes) else hid, exc)
            return None

    @property
    def refused_agents(self) -> list[str]:
        return [a for a in self.refused.split(",") if a]

    def within(self, max_timeout_ms: int) -> Reroute:
        """The terms as a request could have made them. They are read from the record, which
        its requester's own user may write: a priority past MAX_PRIORITY, or a creation time
        older than the longest timeout, would put it ahead of everyone in the set's queue (or,
        out of a double's range, make the score NaN)."""
        deadline = min(max(self.deadline_ms, 0), 2**53)
        return self._replace(priority=min(max(self.priority, -MAX_PRIORITY), MAX_PRIORITY), deadline_ms=deadline,
                             created_ms=min(max(self.created_ms, deadline - max_timeout_ms), deadline))


def deferred_until(deferred: str, agent: str) -> int | None:
    """Until when (server ms) ``agent`` is deferred by a ",a=<until ms>," list, or None (as
    offer.lua reads it)."""
    at = deferred.find(f",{agent}=")
    if at < 0:
        return None
    digits = deferred[at + len(agent) + 2:].partition(",")[0]
    return int(digits) if digits.isdigit() else None


def still_deferred(deferred: str, agent: str, now_ms: int) -> bool:
    until = deferred_until(deferred, agent)
    return until is not None and until > now_ms


def granted(grants: Mapping[bytes, bytes], agent: str, claimed: Iterable[str]) -> set[str]:
    """What of ``claimed`` the agent may be routed: all of it while ``Keys.grants`` (read as
    ``grants``) is empty, else only what it was granted there."""
    if not grants:
        return set(claimed)
    return set(claimed) & set((grants.get(agent.encode()) or b"").decode().split(","))


class Directory:
    """The live agents and what they can do, as their workers' registry entries say.

    Routing reads it on every request, so it is cached for ``max_age`` seconds; listing it
    also forgets workers that died long ago."""

    def __init__(self, bus: HandoffBus) -> None:
        self._bus = bus
        self._agents: list[AgentInfo] = []
        self._at = float("-inf")

    async def agents(self, max_age: float = 1.0) -> list[AgentInfo]:
        if time.monotonic() - self._at > max_age:
            self._agents = await self._fetch()
            self._at = time.monotonic()
        return self._agents

    async def _fetch(self) -> list[AgentInfo]:
        bus = self._bus
        return await self.of(stored_names(await bus.redis.smembers(bus.keys.agents), bus.keys.agents))

    async def of(self, agents: Sequence[str]) -> list[AgentInfo]:
        """Those of ``agents`` with a live worker, read now (not cached)."""
        bus = self._bus
        if not agents:
            return []
        async with bus.redis.pipeline(transaction=False) as pipe:
            pipe.hgetall(bus.keys.grants)
            for agent in agents:
                pipe.hgetall(bus.keys.workers(agent))
            grants, *tables = await pipe.execute()
        now = await bus.server_time_ms()
        found = []
        for agent, table in zip(agents, tables, strict=True):
            workers, gone = [], []
            for consumer, raw in table.items():
                try:
                    info = _worker_info.decode(raw)
                    ttl = int(msgspec.json.decode(raw).get("ttl_ms", 0))
                except (msgspec.DecodeError, ValueError, TypeError, AttributeError):
                    # written by hand, by another version, or by an agent's own user: never
                    # reason enough to stop routing for every other agent
                    log.warning("registry entry %r of %s is not a worker's; left out", consumer, agent)
                    continue
                if info.beat_ms + ttl > now:
                    workers.append(info)
                elif info.beat_ms + 10 * ttl <= now:
                    gone.append(consumer)  # a worker that died long ago: forget it
            if gone and not bus.plain_reads:  # a read-only user (the monitor) leaves it to others
                try:
                    await bus.redis.hdel(bus.keys.workers(agent), *gone)
                except RedisError as exc:  # a replica, say: the listing stands, someone prunes later
                    if not refuses_writes(exc):
                        raise
                    log.info("could not forget %d gone worker(s) of %s (%s)", len(gone), agent, exc)
            if workers:
                caps = sorted(granted(grants, agent, {c for w in workers for c in w.capabilities}))
                found.append(AgentInfo(agent_id=agent, capabilities=caps,
                                       workers=sorted(workers, key=lambda w: w.consumer)))
        return found

    @staticmethod
    def capable(agents: Sequence[AgentInfo], canonical: str, exclude: Iterable[str] = ()) -> list[AgentInfo]:
        """Agents with every capability of the set and a worker not draining, in random order,
        those with room before those that were full. Not least loaded first: the loads a
        requester sees are up to a heartbeat old, and ringing the least loaded by a stale
        figure sends every ring of the next second to the same few agents while the others
        sleep. Pulling balances the load itself: only a worker with free slots pulls."""
        skip = set(exclude)
        found = [
            a for a in agents
            if a.agent_id not in skip and serves(a.capabilities, canonical)
            and any(w.state != "DRAINING" for w in a.workers)
        ]
        return sorted(found, key=lambda a: (a.load >= a.limit > 0, random.random()))


class Router:
    """Routes handoffs into capability-set queues, and on after a refusal or a lapsed offer."""

    def __init__(self, bus: HandoffBus) -> None:
        self._bus = bus
        self.directory = Directory(bus)
        #: the sets this process has written to the routes registry (see registered.py)
        self.known = Registered()

    async def sets(self) -> dict[str, str]:
        """The capability sets requests were routed by, read now: set id -> capabilities
        (sorted, comma-separated)."""
        table = await self._bus.redis.hgetall(self._bus.keys.routes)
        return {text(sid): text(caps) for sid, caps in table.items()}

    async def register_set(self, canonical: str) -> str:
        """Make the set known to workers (written once in a while, see registered.py); returns its id."""
        sid = set_id(canonical)
        if sid not in self.known:
            await self._bus.redis.hset(self._bus.keys.routes, sid, canonical)
            self.known.add(sid)
        return sid

    def route_call(self, canonical: str, handoff_id: str, priority: int, deadline_ms: int | str,
                   refused: str = ",", deferred: str = ",", since_ms: int = 0) -> Call:
        config = self._bus.config
        return "route", self._bus.keys.route(set_id(canonical)).as_list(), [
            handoff_id, priority, deadline_ms, refused, deferred, int(config.route_age_step * 1000), since_ms,
        ]

    async def unroute_many(self, items: Sequence[tuple[str, str]]) -> None:
        """Take (capability set, handoff id) entries out of their sets' queues, in one round
        trip: handoffs that will never be offered again (expired, or never created). Entries
        already gone do not matter; a claimed one loses its meta, so that its claim, if never
        acknowledged, does not put it back."""
        by_set: dict[str, list[str]] = {}
        for canonical, handoff_id in items:
            by_set.setdefault(set_id(canonical), []).append(handoff_id)
        if not by_set:
            return
        async with self._bus.redis.pipeline(transaction=False) as pipe:
            for sid, ids in by_set.items():
                route = self._bus.keys.route(sid)
                pipe.zrem(route.queue, *ids)
                pipe.hdel(route.meta, *ids)
            await pipe.execute()

    def ring_calls(self, candidates: Sequence[AgentInfo], handoff_id: str, deferred: str = ",",
                   now_ms: int = 0) -> list[Call]:
        """Wake capable agents with room that are not deferred at ``now_ms`` (the others pull
        when they next have room, or after their block timeout)."""
        calls: list[Call] = []
        for agent in candidates:
            if still_deferred(deferred, agent.agent_id, now_ms):
                continue
            calls.append(("ring", [self._bus.keys.target(agent.agent_id).bell], [handoff_id]))
            if len(calls) == RING:
                break
        return calls

    def unroutable_call(self, handoff_id: str, refused: Sequence[str]) -> Call:
        bus = self._bus
        requester, request_id = split_handoff_id(handoff_id)
        reason = "no capable agent available" + (f" (refused by {', '.join(refused)})" if refused else "")
        return "unroutable", bus.keys.record(requester, request_id).as_list(), [
            handoff_id, request_id, bus.config.retention_ms, bus.config.response_retention_ms, reason,
            bus.codec.dumps_value({"refused": list(refused)}),
        ]

    def assign_call(self, handoff_id: str, agent: str, chosen_ms: int = 0, offer_ms: int = 0) -> Call:
        """Offer a handoff to ``agent`` for ``offer_ms`` (0: this bus's ``offer_time``)."""
        bus = self._bus
        requester, request_id = split_handoff_id(handoff_id)
        return "assign", bus.keys.record(requester, request_id).as_list(), [
            handoff_id, request_id, agent, offer_ms or int(bus.config.offer_time * 1000), bus.config.retention_ms,
            bus.config.response_retention_ms, chosen_ms,
        ]

    def response(self, handoff_id: str, reply: Sequence[Any]) -> HandoffResponse | None:
        """The response of an unroutable call: None if it was left alone because it is offered
        to an agent, or gone, decided or expired meanwhile (nothing is left to route: a refusal
        racing a cancel, or a stale queue entry pulled after the last refusal decided it);
        raises on any other negative code."""
        code = int(reply[0])
        if code in (errors.NOT_FOUND, errors.INVALID_TRANSITION, errors.EXPIRED):
            return None
        if code < 0:
            raise_for_code(code, handoff_id, ROUTER, "route", reply[1] if len(reply) > 1 else None)
        return response_from_reply(handoff_id, reply[2:], self._bus.codec) if code == 1 else None

    async def send_on(
        self, refuser: str, handoff_id: str, reply: Sequence[Any], *, route: bool = True
    ) -> HandoffResponse | None:
        """After ``refuser``'s routed refusal (a ``reject`` reply with code 2): the handoff leaves
        its inbox first (routed again, it may come straight back to that agent, and is admitted
        only once the refused delivery has gone), then goes on unless ``route`` is False (the
        record's routing guard sends it on). The final REJECTED response, or None (PENDING)."""
        await self._bus.settle(refuser, [handoff_id])
        if not route:
            return None
        item = Reroute.read(reply[2:9], f"routing on the refusal of {refuser}", reply[9])
        if item is None:
            return None
        [final] = await self.reroute([item])
        return final

    async def release(self, agent: str, handoff_id: str) -> bool:
        """Give up ``agent``'s offer of a routed handoff its stopping worker took and never
        decided (its inbox entry settled first: see ``Inbox.give_up``), and send it back to its
        set at once. False where it was not offered to the agent any more: nothing was changed."""
        bus = self._bus
        requester, request_id = split_handoff_id(handoff_id)
        keys = bus.keys.record(requester, request_id).as_list()
        reply = await bus.script("release", keys, [
            handoff_id, request_id, agent, bus.config.retention_ms, bus.config.response_retention_ms,
            int(bus.config.route_guard * 1000)])
        if int(reply[0]) != 2:
            return False
        if bus.isolated is None:  # else the forwarder sends it back, or (its own request) the routing guard
            await self.send_back(handoff_id, reply)
        return True

    async def send_back(self, handoff_id: str, reply: Sequence[Any]) -> None:
        """After a ``release`` reply: back to the set's queue, even when no other capable agent
        is live (the agent that released it is only restarting: a release is never final)."""
        item = Reroute.read(reply[2:9], f"sending {handoff_id} back to its set")
        if item is not None:
            await self.reroute([item._replace(may_end=False)])

    async def reroute(self, items: Sequence[Reroute]) -> list[HandoffResponse | None]:
        """Send each handoff on: to the agent it was redirected to if that one is capable and
        live, else back to its set's queue (waking capable agents), else, when every capable
        agent refused it (and it ``may_end``), to REJECTED with NO_CAPABLE_AGENT. Returns that
        REJECTED response, or None where the handoff stays PENDING."""
        if not items:
            return []
        bus = self._bus
        items = [item.within(int(bus.config.max_timeout * 1000)) for item in items]
        agents = await self.directory.agents(max_age=0.5)
        if any(item.may_end and item.refused_agents
               and not Directory.capable(agents, item.caps, exclude=item.refused_agents) for item in items):
            agents = await self.directory.agents(max_age=0)  # NO_CAPABLE_AGENT is final: decide on a fresh view
        now_ms = await bus.now_ms()  # deferrals are in the server's time
        results: list[HandoffResponse | None] = [None] * len(items)
        redirected: list[Reroute] = []
        calls: list[Call] = []
        final: list[tuple[int, int]] = []  # (item index, call index) of unroutable calls
        for i, item in enumerate(items):
            candidates = Directory.capable(agents, item.caps, exclude=item.refused_agents)
            names = {a.agent_id for a in candidates}
            if item.redirect and item.redirect in names and not still_deferred(item.deferred, item.redirect, now_ms):
                redirected.append(item)
            elif item.may_end and not candidates and item.refused_agents:
                final.append((i, len(calls)))
                calls.append(self.unroutable_call(item.handoff_id, item.refused_agents))
            else:
                await self.register_set(item.caps)
                calls.append(self._route_again(item))
                calls += self.ring_calls(candidates, item.handoff_id, item.deferred, now_ms)
        if redirected:
            # offered for as long as the agent's own workers say it takes (their --offer-time)
            offers = {a.agent_id: max((w.offer_ms for w in a.workers), default=0) for a in agents}
            replies = await bus.scripts_many([
                self.assign_call(item.handoff_id, item.redirect or "", offer_ms=offers.get(item.redirect or "", 0))
                for item in redirected])
            for item, reply in zip(redirected, replies, strict=True):
                code = 0 if isinstance(reply, BaseException) else int(reply[0])
                if code == 1 and item.redirect:
                    await bus.register_target(item.redirect)
                    calls.append(bus.enqueue_call(item.redirect, item.handoff_id, item.priority))
                elif code == 0:  # offered elsewhere meanwhile, or the assign failed: the queue decides
                    calls.append(self._route_again(item))
                elif code == 2:  # the record knows the agent refused or is deferred: the queue decides
                    again = Reroute.read(reply[2:9], f"redirecting to {item.redirect}")
                    if again is not None:
                        calls.append(self._route_again(again))
                # code < 0: decided, expired or gone meanwhile
        replies = await bus.scripts_many(calls) if calls else []
        for call, reply in zip(calls, replies, strict=True):
            if isinstance(reply, BaseException):
                if call[0] == "ring":  # a doorbell is a hint (an agent's own user may have broken its key)
                    log.info("routing: could not ring %s (%s)", call[1][0], reply)
                    continue
                raise reply
        for i, index in final:
            results[i] = self.response(items[i].handoff_id, replies[index])
        rejected = {items[i].handoff_id for i, _ in final if results[i] is not None}
        queued = {call[2][0] for call in calls if call[0] == "route"}
        await self._drop_ended([item for item in items if item.handoff_id in rejected | queued], rejected)
        return results

    async def _drop_ended(self, items: list[Reroute], rejected: set[str]) -> None:
        """Take out of their sets' queues the handoffs made REJECTED here (``rejected``: an
        earlier routing may have queued them) and those just queued whose records ended
        meanwhile: the route script cannot see the record (another slot), and a cancel between
        a refusal and its routing on dropped the set's entry before this wrote it. A record that
        ends after this read drops the entry itself. Where nothing can be read, a pull from the
        set drops the entry."""
        bus = self._bus
        if not items or bus.isolated is not None:  # (an isolated agent cannot reach a set's slot)
            return
        ended = set(rejected)
        unsure = [item.handoff_id for item in items if item.handoff_id not in rejected]
        if unsure:
            try:
                async with bus.redis.pipeline(transaction=False) as pipe:
                    for hid in unsure:
                        pipe.hget(bus.keys.record(*split_handoff_id(hid)).record, "status")
                    statuses = await pipe.execute()
            except (RedisError, RedisClusterException, OSError) as exc:
                log.warning("routing: could not read whether %d handoffs ended meanwhile: %s", len(unsure), exc)
                statuses = [b"PENDING"] * len(unsure)
            ended |= {hid for hid, status in zip(unsure, statuses, strict=True) if status != b"PENDING"}
        await bus.drop_routes([(item.caps, item.handoff_id) for item in items if item.handoff_id in ended])

    def _route_again(self, item: Reroute) -> Call:
        return self.route_call(item.caps, item.handoff_id, item.priority, item.deadline_ms,
                               item.refused, item.deferred, item.created_ms)


def refusal_response(handoff_id: str, actor: str, fields: dict[str, Any]) -> HandoffResponse:
    """What a refusing agent gets back: the handoff is still PENDING, on its way elsewhere."""
    return HandoffResponse(
        handoff_id=handoff_id, request_id=handoff_id.partition("/")[2], status=HandoffStatus.PENDING,
        actor=actor, rejection_reason=fields.get("reason"), rejection_code=fields.get("code"),
        retry_after_ms=fields.get("retry"), redirect_to_agent=fields.get("redirect"),
    )
