"""Prometheus metrics (the optional extra ``metrics``: ``pip install 'handoffbus[metrics]'``).

``Metrics(bus)`` listens to the bus's tally, so every request, decision, outcome, expiry
and redelivery this process makes is counted as it happens. The gauges (queue depth, in
flight, oldest waiting age, last heartbeat) describe shared state: ``refresh`` reads them
from Redis for the agents this process serves. ``handoffbus worker --metrics-port`` serves
them over HTTP.

Labels are agent ids and statuses only, never handoff ids. Counters are per process:
Prometheus sums them over processes. Every process serving an agent reports the same gauge
values, so alert rules take their ``max``.

With ``PROMETHEUS_MULTIPROC_DIR`` set, prometheus_client's multiprocess mode is used: every
process writes its values to files in that directory, and ``serve_metrics`` serves the merged
view of all of them. Scrape exactly one process of the group then (each serves the same merged
view, so summing the scrapes of several counts everything several times). The gauges merge
live processes only: the freshest reading of Redis state (``livemostrecent``), the latest
heartbeat (``livemax``); a process marks itself dead when it exits, so a worker that is gone
no longer reports live workers or a queue depth. A process killed without exiting cannot: clear
the directory when the group starts.
"""

from __future__ import annotations

import atexit
import glob
import logging
import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import anyio
from redis.exceptions import RedisError

from .errors import HandoffbusError, InvalidRequest
from .monitor import known_agents, observe_agents
from .stats import BUCKETS, COUNTED

if TYPE_CHECKING:
    from .bus import HandoffBus
    from .workers import Worker

__all__ = ["Metrics", "serve_metrics"]

log = logging.getLogger("handoffbus")

prom: Any
try:
    import prometheus_client as prom
except ImportError:  # pragma: no cover - the extra is not installed
    prom = None

#: how multiprocess mode merges each gauge over the processes: live ones only (a dead
#: process's last values would hide the outage the alerts are for); the gauges that read
#: shared state from Redis take the freshest reading, the heartbeat the latest beat
GAUGE_MODES = {
    "handoffbus_queue_depth": "livemostrecent",
    "handoffbus_inflight": "livemostrecent",
    "handoffbus_oldest_waiting_age_seconds": "livemostrecent",
    "handoffbus_oldest_inflight_age_seconds": "livemostrecent",
    "handoffbus_routed_waiting": "livemostrecent",
    "handoffbus_oldest_routed_age_seconds": "livemostrecent",
    "handoffbus_live_workers": "livemostrecent",
    "handoffbus_worker_heartbeat_timestamp_seconds": "livemax",
    "handoffbus_agent_handoffs": "livemostrecent",
}

_marked_at_exit = False


def _mark_dead_at_exit() -> None:
    """In multiprocess mode, have this process's live gauges dropped from the merged view
    when it exits (once per process; the pid is read at exit, so a forked child marks itself)."""
    global _marked_at_exit
    if _marked_at_exit or not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        return
    from prometheus_client import multiprocess

    def mark() -> None:
        multiprocess.mark_process_dead(os.getpid())  # type: ignore[no-untyped-call]

    atexit.register(mark)
    _marked_at_exit = True


def _require() -> Any:
    if prom is None:
        raise HandoffbusError("metrics need prometheus-client: pip install 'handoffbus[metrics]'")
    return prom


class Metrics:
    """The bus's metrics in ``registry`` (default: prometheus_client's global one)."""

    def __init__(self, bus: HandoffBus, registry: Any = None) -> None:
        p = _require()
        registry = registry if registry is not None else p.REGISTRY
        self._bus = bus
        self.requested = p.Counter("handoffbus_handoffs_requested", "Handoffs requested by this process, by target "
                                   "agent ('' for capability-routed)", ["agent"], registry=registry)
        self.finished = p.Counter("handoffbus_handoffs_finished", "Handoffs this process decided or ended, by the "
                                  "agent and the final status", ["agent", "status"], registry=registry)
        self.accepted = p.Counter("handoffbus_handoffs_accepted", "Handoffs accepted by agents of this process",
                                  ["agent"], registry=registry)
        self.redeliveries = p.Counter("handoffbus_redeliveries", "Handoffs taken over from a dead or frozen worker",
                                      ["agent"], registry=registry)
        self.decision = p.Histogram("handoffbus_decision_seconds", "Time from request to acceptance or rejection",
                                    ["agent"], buckets=BUCKETS, registry=registry)
        self.duration = p.Histogram("handoffbus_handoff_duration_seconds", "Time from request to completion or "
                                    "failure", ["agent"], buckets=BUCKETS, registry=registry)
        def gauge(name: str, documentation: str) -> Any:
            return p.Gauge(name, documentation, ["agent"], registry=registry, multiprocess_mode=GAUGE_MODES[name])

        self.queue_depth = gauge("handoffbus_queue_depth", "Handoffs queued for the agent")
        self.inflight = gauge("handoffbus_inflight", "Handoffs in the agent's workers' hands")
        self.oldest_waiting = gauge("handoffbus_oldest_waiting_age_seconds", "How long the agent's oldest queued "
                                    "handoff has waited since it was requested (0: none)")
        self.oldest_inflight = gauge("handoffbus_oldest_inflight_age_seconds", "How long since the oldest "
                                     "handoff in flight was taken by a worker (0: none)")
        self.routed_waiting = gauge("handoffbus_routed_waiting", "Routed handoffs waiting in the queues of the "
                                    "capability sets the agent serves (shared with the other agents serving them)")
        self.oldest_routed = gauge("handoffbus_oldest_routed_age_seconds", "How long the oldest routed handoff "
                                   "the agent could take has waited since it was requested (0: none)")
        self.live_workers = gauge("handoffbus_live_workers", "Live worker processes of the agent")
        self.heartbeat = gauge("handoffbus_worker_heartbeat_timestamp_seconds", "Redis time of the last "
                               "registry heartbeat of this process's worker of the agent")
        # every process's counts, from the agent's stats hash: an expiry is counted by the
        # process that made it (a sweep's lease holder, a requester reading at the deadline),
        # which seldom serves metrics; this total does not depend on who scrapes whom
        self.agent_handoffs = p.Gauge("handoffbus_agent_handoffs", "The agent's handoffs of every process since "
                                      "its stats began, by event (requested, a status, redelivered; Redis's count: "
                                      "take its rate)", ["agent", "event"], registry=registry,
                                      multiprocess_mode=GAUGE_MODES["handoffbus_agent_handoffs"])
        _mark_dead_at_exit()
        bus.tally.listeners.append(self)

    # the tally's listener interface
    def counted(self, agent: str, field: str, n: int) -> None:
        if field == "requested":
            self.requested.labels(agent).inc(n)
        elif field == "redelivered":
            self.redeliveries.labels(agent).inc(n)
        elif field == "ACCEPTED":
            self.accepted.labels(agent).inc(n)
        elif field in COUNTED:  # the other counted statuses end a handoff
            self.finished.labels(agent, field).inc(n)

    def timed(self, agent: str, kind: str, seconds: float) -> None:
        (self.decision if kind == "decision" else self.duration).labels(agent).observe(seconds)

    async def refresh(self, agents: Sequence[str], workers: Sequence[Worker] = ()) -> None:
        """Set the gauges of ``agents`` from Redis (and the heartbeats of ``workers``)."""
        beats = [(w.agent.agent_id, w.last_beat_ms) for w in workers]  # before the read: never newer than it
        for view in await observe_agents(self._bus, agents):
            self.queue_depth.labels(view.agent_id).set(view.queued)
            self.inflight.labels(view.agent_id).set(view.in_flight)
            self.oldest_waiting.labels(view.agent_id).set(view.oldest_waiting_s or 0)
            self.oldest_inflight.labels(view.agent_id).set(view.oldest_in_flight_s or 0)
            self.routed_waiting.labels(view.agent_id).set(view.routed)
            self.oldest_routed.labels(view.agent_id).set(view.oldest_routed_s or 0)
            self.live_workers.labels(view.agent_id).set(view.workers)
            for event, count in view.counts.counts.items():
                self.agent_handoffs.labels(view.agent_id, event).set(count)
        for agent, beat_ms in beats:
            if beat_ms:
                self.heartbeat.labels(agent).set(beat_ms / 1000)


    async def keep_fresh(self, interval: float, agents: Sequence[str] | None = None,
                         workers: Sequence[Worker] = ()) -> None:
        """``refresh`` every ``interval`` seconds, for ever: of ``agents``, or of every agent the
        bus knows (what ``handoffbus exporter`` reports) when None."""
        while True:
            try:
                await self.refresh(agents if agents is not None else await known_agents(self._bus), workers)
            except (RedisError, OSError, HandoffbusError) as exc:
                log.warning("metrics refresh failed (%s)", exc)
            await anyio.sleep(interval)  # a timer


class WholeFiles:
    """prometheus_client's multiprocess collector, leaving out a value file still being made.
    prometheus_client creates each file empty and sizes it afterwards; a scrape that read one
    in between (made by another process, or by this one's loop while the HTTP thread scrapes)
    failed whole, with a 500 (prometheus/client_python#1199)."""

    def __init__(self, path: str, merge: Callable[..., Any]) -> None:
        self._path = path
        self._merge = merge

    def collect(self) -> Any:
        files = [f for f in glob.glob(os.path.join(self._path, "*.db")) if _begun(f)]
        return self._merge(files, accumulate=True)


def _begun(path: str) -> bool:
    """Whether a value file holds at least its header (the used size, padded to 8 bytes)."""
    try:
        return os.path.getsize(path) >= 8
    except OSError:  # gone since the listing (a dead process's live gauges)
        return False


def serve_metrics(port: int, address: str = "0.0.0.0") -> Any:
    """Serve the metrics over HTTP (a daemon thread); in multiprocess mode, the merged view of
    every process writing to ``PROMETHEUS_MULTIPROC_DIR`` (so scrape one process of the group,
    not each). Returns the registry to create ``Metrics`` in."""
    p = _require()
    if type(port) is not int or not 0 <= port <= 65535:
        raise InvalidRequest(f"a metrics port is from 0 to 65535, not {port!r}")
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        from prometheus_client import multiprocess

        registry = p.CollectorRegistry()
        registry.register(WholeFiles(os.environ["PROMETHEUS_MULTIPROC_DIR"], multiprocess.MultiProcessCollector.merge))
        p.start_http_server(port, addr=address, registry=registry)
        return p.REGISTRY  # each process writes its own files; the collector merges them
    registry = p.CollectorRegistry()
    p.start_http_server(port, addr=address, registry=registry)
    return registry
