"""What operators watch: each agent's backlog, work in flight, live workers and counters, read
from Redis alone (``handoffbus top``, ``check``, the metrics exporter and the tests use it).

One ``observe`` script per agent (its own slot) returns queue depth, in-flight count, the
oldest in-flight inbox entry, the stats hash and the heads of priority bands of the queue:
up to ``BANDS`` of the lowest priority numbers and up to ``BANDS`` of the highest. A band is
served first in, first out, so each band's oldest waiting handoff is its head: their records
(in the requesters' slots) give the ages. Under a steady stream of urgent work the bands
that starve are the highest numbers, which are always looked at; only when more than
2 * ``BANDS`` priorities are queued at once may a middle band's head go unseen.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import msgspec

from .errors import InvalidName
from .names import split_handoff_id, stored_names
from .plainreads import observe_replies
from .records import text
from .routing import serves
from .stats import AgentCounts

if TYPE_CHECKING:
    from .bus import HandoffBus

__all__ = ["AgentView", "known_agents", "observe", "observe_agents"]

#: priority bands, from each end of the queue, whose head is looked at for the oldest waiting handoff
BANDS = 16
#: entries read from each end of a capability set's queue for its oldest waiting handoff: ageing
#: mixes priority into the score, so the oldest is near the head, or, a low priority's, near
#: the tail (see docs/routing.md on the starvation bound)
ROUTE_ENDS = 16


class AgentView(msgspec.Struct, frozen=True, kw_only=True):
    """One agent at one moment (``at_ms``, Redis time)."""

    agent_id: str
    at_ms: int
    queued: int
    in_flight: int
    #: seconds the oldest queued handoff has waited since it was requested; None: none queued
    oldest_waiting_s: float | None
    #: seconds since the oldest in-flight handoff was taken by a worker; None: none in flight
    oldest_in_flight_s: float | None
    #: live worker processes, and the latest heartbeat among them (Redis time ms, 0: none)
    workers: int
    last_beat_ms: int
    capabilities: list[str] = []
    counts: AgentCounts = AgentCounts()
    #: routed handoffs waiting in the queues of the capability sets the agent's live workers
    #: serve (shared with the other agents that serve them), and the oldest one's wait (seconds;
    #: None: none waiting), as far as ``ROUTE_ENDS`` entries from each end of each queue show it
    routed: int = 0
    oldest_routed_s: float | None = None

    @property
    def beat_age_s(self) -> float | None:
        return (self.at_ms - self.last_beat_ms) / 1000 if self.last_beat_ms else None


async def known_agents(bus: HandoffBus) -> list[str]:
    """Every agent with a registered worker or a queue, sorted."""
    # not SUNION: on a cluster the two sets live in different slots (the pipeline splits by node)
    async with bus.redis.pipeline(transaction=False) as pipe:
        pipe.smembers(bus.keys.agents)
        pipe.smembers(bus.keys.targets)
        agents, targets = await pipe.execute()
    return stored_names(agents | targets, f"{bus.keys.agents} or {bus.keys.targets}")


async def observe_agents(bus: HandoffBus, agents: Sequence[str] | None = None) -> list[AgentView]:
    """The views of ``agents`` (default: every known agent), read together."""
    names = list(agents) if agents is not None else await known_agents(bus)
    if not names:
        return []
    keys = bus.keys
    replies = await bus.read_scripts(
        [("observe", [*keys.target(name).as_list(), keys.stats(name)], [BANDS]) for name in names],
        lambda: observe_replies(bus.redis, [(keys.target(name), keys.stats(name)) for name in names], BANDS))
    heads: list[tuple[int, str]] = []  # (agent index, handoff id) of every band head
    for i, reply in enumerate(replies):
        heads += [(i, text(hid)) for hid in reply[5][::2]]
    created = await _created_times(bus, [hid for _, hid in heads])
    oldest: dict[int, int] = {}
    for (i, _), at in zip(heads, created, strict=True):
        if at:
            oldest[i] = min(oldest.get(i, at), at)
    live = {a.agent_id: a for a in await bus.router.directory.of(names)}
    routed = await _routed(bus, {name: info.capabilities for name, info in live.items()})
    views = []
    for i, (name, reply) in enumerate(zip(names, replies, strict=True)):
        queued, in_flight, first_entry, now = int(reply[0]), int(reply[1]), text(reply[2]), int(reply[3])
        flat = reply[4]
        info = live.get(name)
        views.append(AgentView(
            agent_id=name, at_ms=now, queued=queued, in_flight=in_flight,
            oldest_waiting_s=max(0.0, (now - oldest[i]) / 1000) if i in oldest else None,
            oldest_in_flight_s=max(0.0, (now - int(first_entry.split("-")[0])) / 1000) if first_entry else None,
            workers=len(info.workers) if info else 0,
            last_beat_ms=max((w.beat_ms for w in info.workers), default=0) if info else 0,
            capabilities=info.capabilities if info else [],
            counts=AgentCounts.parse(dict(zip(flat[::2], flat[1::2], strict=True))),
            **routed.get(name, {}),
        ))
    return views


async def _routed(bus: HandoffBus, capabilities: dict[str, list[str]]) -> dict[str, dict[str, Any]]:
    """Per agent: ``routed`` and ``oldest_routed_s`` over the capability sets it serves."""
    if not any(capabilities.values()):
        return {}
    sets = await bus.router.sets()
    served = {name: [sid for sid, caps in sets.items() if serves(caps_of, caps)]
              for name, caps_of in capabilities.items()}
    sids = sorted({sid for sids in served.values() for sid in sids})
    if not sids:
        return {}
    async with bus.redis.pipeline(transaction=False) as pipe:
        for sid in sids:
            queue = bus.keys.route(sid).queue
            pipe.zcard(queue)
            pipe.zrange(queue, 0, ROUTE_ENDS - 1)
            pipe.zrange(queue, -ROUTE_ENDS, -1)
        replies = await pipe.execute()
    now = await bus.server_time_ms()  # on its own: a cluster pipeline takes no TIME
    ends = {sid: {text(h) for h in (*replies[3 * i + 1], *replies[3 * i + 2])} for i, sid in enumerate(sids)}
    heads = sorted(set().union(*ends.values()))
    created = dict(zip(heads, await _created_times(bus, heads), strict=True))
    out: dict[str, dict[str, Any]] = {}
    depth = {sid: int(replies[3 * i]) for i, sid in enumerate(sids)}
    for name, sids_of in served.items():
        waiting = sum(depth[sid] for sid in sids_of)
        times = [created[h] for sid in sids_of for h in ends[sid] if created[h]]
        out[name] = {"routed": waiting,
                     "oldest_routed_s": max(0.0, (now - min(times)) / 1000) if times else None}
    return out


async def observe(bus: HandoffBus, agent: str) -> AgentView:
    [view] = await observe_agents(bus, [agent])
    return view


async def _created_times(bus: HandoffBus, handoff_ids: list[str]) -> list[int]:
    """The records' creation times (0 where a record is gone, or a queue member names no
    handoff: written by hand, a worker dead-letters it); one pipeline, split by node on a cluster."""
    records: list[str | None] = []
    for hid in handoff_ids:
        try:
            records.append(bus.keys.record(*split_handoff_id(hid)).record)
        except InvalidName:
            records.append(None)
    named = [key for key in records if key is not None]
    if not named:
        return [0] * len(handoff_ids)
    async with bus.redis.pipeline(transaction=False) as pipe:
        for key in named:
            pipe.hget(key, "created")
        values = iter(await pipe.execute())
    return [0 if key is None else int(next(values) or 0) for key in records]
