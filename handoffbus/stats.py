"""Per-agent counters and latency histograms, kept in Redis for operators.

Every process tallies the transitions its clients make (decisions and outcomes, with the
time from the request to each, both Redis times) and the expiries it causes, and adds them
to each agent's stats hash, ``<p>:{agent}:stats``, about once a second: one ``count`` call
per agent, batched with whatever else is on the wire. Nothing is added to the path of a
handoff. The hash only ever grows by increments, so any number of processes can add to it,
and readers (``handoffbus top``, ``check``, the metrics exporter) turn the difference
between two readings into rates and quantiles. A process that dies loses at most its last
second of counts. A lost reply neither loses nor doubles any: a flush is numbered and added
once (``count-2.lua``), and a transition whose reply was lost is counted when its repeat is
answered "made already" (``Tally.doubt``).

Fields (all integers): ``requested`` (direct requests made to the agent), ``ACCEPTED``,
``REJECTED``, ``COMPLETED``, ``FAILED``, ``EXPIRED``, ``redelivered``; ``decision:<i>`` and
``duration:<i>``, the number of decisions and of outcomes whose time since the request fell
in bucket ``i`` of ``BUCKETS`` (the last one is "longer"); ``decision:sum_ms`` and
``duration:sum_ms``.
"""

from __future__ import annotations

import bisect
import logging
import uuid
from collections import Counter, defaultdict
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

import anyio
import msgspec
from anyio.abc import TaskStatus
from redis.exceptions import RedisError

from .errors import HandoffbusError
from .models import HandoffStatus

if TYPE_CHECKING:
    from .bus import HandoffBus

__all__ = ["BUCKETS", "AgentCounts", "StatsFlusher", "Tally", "TallyListener", "quantile"]

log = logging.getLogger("handoffbus")

#: upper bounds (seconds) of the latency buckets; one more bucket holds anything longer
BUCKETS: tuple[float, ...] = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
#: statuses counted per agent
COUNTED = ("ACCEPTED", "REJECTED", "COMPLETED", "FAILED", "EXPIRED")
DECISIONS = frozenset({HandoffStatus.ACCEPTED, HandoffStatus.REJECTED})
OUTCOMES = frozenset({HandoffStatus.COMPLETED, HandoffStatus.FAILED})


def bucket_of(seconds: float) -> int:
    return bisect.bisect_left(BUCKETS, seconds)


class TallyListener(Protocol):
    """Told of every count as it is made (the Prometheus exporter is one)."""

    def counted(self, agent: str, field: str, n: int) -> None: ...

    def timed(self, agent: str, kind: str, seconds: float) -> None: ...


#: transitions in doubt a tally remembers
MAX_IN_DOUBT = 10_000


class Tally:
    """Increments not yet added to Redis, by agent; listeners hear of each as it is made."""

    def __init__(self) -> None:
        self._pending: defaultdict[str, Counter[str]] = defaultdict(Counter)
        self.listeners: list[TallyListener] = []
        #: (handoff id, script) of transitions sent whose reply was lost, oldest first
        self._in_doubt: dict[tuple[str, str], bool] = {}

    def transition(self, agent: str, status: HandoffStatus, created_ms: int = 0, at_ms: int = 0) -> None:
        """``agent`` made a transition; with the request's creation time, its latency too."""
        if status.value in COUNTED:
            self.add(agent, status.value)
        if created_ms and at_ms >= created_ms:
            kind = "decision" if status in DECISIONS else "duration" if status in OUTCOMES else None
            if kind is not None:
                counts = self._pending[agent]
                counts[f"{kind}:{bucket_of((at_ms - created_ms) / 1000)}"] += 1
                counts[f"{kind}:sum_ms"] += at_ms - created_ms
                for listener in self.listeners:
                    listener.timed(agent, kind, (at_ms - created_ms) / 1000)

    def add(self, agent: str, field: str, n: int = 1) -> None:
        self._pending[agent][field] += n
        for listener in self.listeners:
            listener.counted(agent, field, n)

    def take(self) -> dict[str, Counter[str]]:
        """The pending increments, leaving none."""
        pending, self._pending = dict(self._pending), defaultdict(Counter)
        return pending

    def doubt(self, handoff_id: str, script: str) -> None:
        """A transition whose reply was lost: it may have run, uncounted. Its repeat, answered
        "made already" (code 0), is counted then (see ``made``). Bounded: the oldest go."""
        self._in_doubt[(handoff_id, script)] = True
        if len(self._in_doubt) > MAX_IN_DOUBT:
            del self._in_doubt[next(iter(self._in_doubt))]

    def made(self, handoff_id: str, script: str, code: int) -> bool:
        """Whether a call answered ``code`` is to be counted: it made its change (1), or it
        repeats one whose reply was lost and finds it made (0). Either way it is no longer in doubt."""
        doubted = bool(self._in_doubt) and self._in_doubt.pop((handoff_id, script), False)  # usually none
        return code == 1 or (doubted and code == 0)


class AgentCounts(msgspec.Struct, frozen=True, kw_only=True):
    """An agent's stats hash as read: totals since the hash was made."""

    counts: dict[str, int] = {}
    decision: tuple[int, ...] = ()
    duration: tuple[int, ...] = ()
    decision_sum_ms: int = 0
    duration_sum_ms: int = 0

    @classmethod
    def parse(cls, flat: Mapping[Any, Any]) -> AgentCounts:
        fields = {(k.decode() if isinstance(k, bytes) else str(k)): int(v) for k, v in flat.items()}
        return cls(
            counts={name: fields.get(name, 0) for name in ("requested", *COUNTED, "redelivered")},
            decision=tuple(fields.get(f"decision:{i}", 0) for i in range(len(BUCKETS) + 1)),
            duration=tuple(fields.get(f"duration:{i}", 0) for i in range(len(BUCKETS) + 1)),
            decision_sum_ms=fields.get("decision:sum_ms", 0),
            duration_sum_ms=fields.get("duration:sum_ms", 0),
        )

    def minus(self, earlier: AgentCounts) -> AgentCounts:
        """What happened between ``earlier`` and this reading (a hash deleted meanwhile: all of it)."""
        if any(self.counts.get(k, 0) < v for k, v in earlier.counts.items()):
            return self

        def sub(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...]:
            return tuple(x - y for x, y in zip(a, b or (0,) * len(a), strict=True)) if a else ()

        return AgentCounts(
            counts={k: v - earlier.counts.get(k, 0) for k, v in self.counts.items()},
            decision=sub(self.decision, earlier.decision), duration=sub(self.duration, earlier.duration),
            decision_sum_ms=self.decision_sum_ms - earlier.decision_sum_ms,
            duration_sum_ms=self.duration_sum_ms - earlier.duration_sum_ms,
        )


def quantile(histogram: tuple[int, ...], q: float) -> float | None:
    """The ``q`` quantile (seconds) of a bucket histogram, interpolated within its bucket as
    Prometheus's histogram_quantile does; None when it is empty. Past the last bound: that bound."""
    total = sum(histogram)
    if total == 0:
        return None
    rank, seen = q * total, 0
    for i, count in enumerate(histogram):
        if count and seen + count >= rank:
            if i == len(BUCKETS):
                return BUCKETS[-1]
            low = BUCKETS[i - 1] if i > 0 else 0.0
            return low + (BUCKETS[i] - low) * (rank - seen) / count
        seen += count
    return BUCKETS[-1]


class StatsFlusher:
    """Adds a bus's tally to the agents' stats hashes every ``interval`` seconds; the bus
    flushes once more before it closes.

    Each flush of an agent's counts is numbered. One whose reply did not come back (it may
    have been added) is kept apart and sent again with its number, and the count script adds
    a number once: given back to the tally instead, it would be added twice when it had run."""

    def __init__(self, bus: HandoffBus, interval: float = 1.0) -> None:
        self._bus = bus
        self._interval = interval
        # one flush at a time: the closing flush waits for a timed one under way, whose counts
        # would otherwise go back to the tally after the last flush and be lost
        self._lock = anyio.Lock()
        #: the name this process numbers its flushes under (in its `counted:<process>` keys)
        self.process = uuid.uuid4().hex[:16]
        self._number = 0
        #: flushes not known to be added: (number, agent, counts); at most one per agent, as no
        #: new flush is made while there are any
        self._unsure: list[tuple[int, str, Counter[str]]] = []

    async def flush(self) -> None:
        async with self._lock:
            await self._flush()

    async def _flush(self) -> None:
        if self._unsure:  # first the flushes not known to be added; new counts wait in the tally
            await self._send(self._unsure)
            if self._unsure:
                return
        bus = self._bus
        pending = bus.tally.take()
        # an isolated agent's user reaches its own slot only: what it counted for others is dropped
        agents = [agent for agent, counts in pending.items() if agent and counts and bus.isolated in (None, agent)]
        if agents:
            self._number += 1
            await self._send([(self._number, agent, pending[agent]) for agent in agents])

    async def _send(self, batches: list[tuple[int, str, Counter[str]]]) -> None:
        """Send ``batches``; those without a reply stay in ``_unsure``, to be sent again."""
        bus = self._bus
        lowest = min(number for number, _, _ in batches)  # numbers below it were all added
        calls: list[tuple[str, list[str], list[Any]]] = []
        for number, agent, counts in batches:
            args: list[Any] = [number, lowest]
            for name, n in counts.items():
                args += [name, n]
            calls.append(("count", [bus.keys.stats(agent), bus.keys.counted(agent, self.process)], args))
        self._unsure = batches
        replies = await bus.scripts_many(calls)
        self._unsure = [batch for batch, reply in zip(batches, replies, strict=True)
                        if isinstance(reply, BaseException)]

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            await anyio.sleep(self._interval)  # a timer: counts are for operators, a second late is fine
            try:
                await self.flush()
            except (RedisError, OSError, HandoffbusError) as exc:
                log.info("stats not written (%s); they go with the next flush", exc)
