"""Operations: what the monitor reads of a long backlog, ``top``'s first frame, and the
Prometheus gauges of processes that are gone."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from handoffbus import HandoffBus, Worker
from handoffbus.acl import monitor_user
from handoffbus.cli.watch import Frame
from handoffbus.monitor import BANDS, ROUTE_ENDS, AgentView, observe_agents
from handoffbus.plainreads import observe_replies
from handoffbus.stats import BUCKETS, AgentCounts
from handoffbus.workers.inbox import Inbox

from .conftest import make_bus, new_prefix
from .helpers import req, routed
from .test_monitor_user import monitor_url
from .test_routing import Specialist

pytestmark = pytest.mark.anyio


# ---------------------------------------------------------------------- backlog age


@pytest.mark.parametrize("reader", ["scripts", "plain-reads"])
async def test_the_oldest_waiting_handoff_is_found_past_many_priority_bands(
        real_backend: str, servers: dict, reader: str) -> None:
    """The handoff most likely to starve is the one of the highest priority number: with more
    priorities queued than the monitor looks at from the front of the queue, its age is still
    the backlog's age (with the scripts, and with the monitor user's plain reads)."""
    prefix = new_prefix()
    async with make_bus(real_backend, servers, prefix=prefix, sweep_interval=3600) as admin:
        client = admin.client("req")
        blocker = await client.request_handoff(req("req", "slow-1", priority=-1000))
        _, [taken] = await Inbox(admin, "slow-1", "stuck-1").take(1)  # held by a stuck worker
        assert taken.handoff_id == blocker.handoff_id
        starving = await client.request_handoff(req("req", "slow-1", priority=1000))
        # it has waited ten minutes (its record's creation time is what the age is read from)
        keys = admin.keys.record("req", starving.handoff_id.split("/")[1])
        created = int(await admin.redis.hget(keys.record, "created"))
        await admin.redis.hset(keys.record, "created", created - 600_000)
        for priority in range(2 * BANDS):  # more bands than are looked at from either end alone
            await client.request_handoff(req("req", "slow-1", priority=priority))
        if reader == "scripts":
            [view] = await observe_agents(admin, ["slow-1"])
        else:
            with monitor_url(servers[real_backend], monitor_user(prefix)) as url:
                async with HandoffBus.connect(url, prefix=prefix, sweep_interval=3600) as monitor:
                    [view] = await observe_agents(monitor, ["slow-1"])
                    assert monitor.plain_reads
    assert (view.queued, view.in_flight) == (2 * BANDS + 1, 1)
    assert view.oldest_waiting_s is not None and view.oldest_waiting_s >= 600


@pytest.mark.parametrize("reader", ["scripts", "plain-reads"])
async def test_routed_handoffs_an_agent_could_take_are_in_its_view(
        real_backend: str, servers: dict, reader: str) -> None:
    """Routed work waits in capability sets' queues, not in the agent's own: the view counts
    the waiting handoffs of the sets the agent's live workers serve, and finds the oldest one
    even at the far end of a queue (a low priority, aged into the score)."""
    prefix = new_prefix()
    async with make_bus(real_backend, servers, prefix=prefix, sweep_interval=3600) as admin:
        client = admin.client("req")
        starving = await client.request_handoff(routed(["x"], priority=1000))  # the end of the set's queue
        keys = admin.keys.record("req", starving.handoff_id.split("/")[1])
        created = int(await admin.redis.hget(keys.record, "created"))
        await admin.redis.hset(keys.record, "created", created - 600_000)  # it has waited ten minutes
        for _ in range(2 * ROUTE_ENDS):
            await client.request_handoff(routed(["x"]))
        await client.request_handoff(routed(["x", "z"]))  # a set it does not serve
        await Worker(admin, Specialist("cap-1", ["x", "y"]))._register()  # live, but not pulling
        if reader == "scripts":
            views = await observe_agents(admin, ["cap-1", "idle-1"])
        else:
            with monitor_url(servers[real_backend], monitor_user(prefix)) as url:
                async with HandoffBus.connect(url, prefix=prefix, sweep_interval=3600) as monitor:
                    views = await observe_agents(monitor, ["cap-1", "idle-1"])
    view, idle = views
    assert (view.queued, view.routed) == (0, 2 * ROUTE_ENDS + 1)
    assert view.oldest_routed_s is not None and view.oldest_routed_s >= 600
    assert (idle.routed, idle.oldest_routed_s) == (0, None)  # no live worker: no capabilities known


@pytest.mark.parametrize("reader", ["scripts", "plain-reads"])
async def test_band_heads_are_each_band_once(real_backend: str, servers: dict, reader: str) -> None:
    """Few bands: every band's head once, whichever end reaches it; many: the lowest and the
    highest ``BANDS`` of them."""
    prefix = new_prefix()
    async with make_bus(real_backend, servers, prefix=prefix, sweep_interval=3600) as admin:
        client = admin.client("req")
        few = [await client.request_handoff(req("req", "few-1", priority=p)) for p in (3, -2, 3, 7)]
        many = [await client.request_handoff(req("req", "many-1", priority=p)) for p in range(-50, 50)]
        agents = [(admin.keys.target(a), admin.keys.stats(a)) for a in ("few-1", "many-1", "none-1")]
        if reader == "scripts":
            replies = [await admin.script("observe", [*target.as_list(), stats], [BANDS])
                       for target, stats in agents]
        else:
            replies = await observe_replies(admin.redis, agents, BANDS)
    heads = [sorted(h.decode() if isinstance(h, bytes) else h for h in reply[5][::2]) for reply in replies]
    assert heads[0] == sorted(h.handoff_id for h in (few[1], few[0], few[3]))
    assert heads[1] == sorted(h.handoff_id for h in many[:BANDS] + many[-BANDS:])
    assert heads[2] == []


# ---------------------------------------------------------------------- top


def _view(decisions: int, at_ms: int) -> AgentView:
    histogram = [0] * (len(BUCKETS) + 1)
    histogram[3] = decisions
    return AgentView(agent_id="a-1", at_ms=at_ms, queued=0, in_flight=0, oldest_waiting_s=None,
                     oldest_in_flight_s=None, workers=1, last_beat_ms=at_ms,
                     counts=AgentCounts(decision=histogram, duration=list(histogram)))


def test_tops_first_frame_shows_no_latency_of_all_time() -> None:
    """The first frame has no earlier reading: its quantiles are unknown ("-"), not the
    all-time ones labelled as the last minute's; from the second on they are the window's."""
    first = [_view(100, 1_000)]
    [row] = Frame(first, [], []).rows
    assert row["rates"] is None
    assert [row[k] for k in ("decision_p50_s", "decision_p99_s", "completion_p50_s", "completion_p99_s")] == [
        None] * 4
    [row] = Frame([_view(110, 2_000)], first, first).rows
    assert row["decision_p50_s"] is not None and row["completion_p99_s"] is not None


# ---------------------------------------------------------------------- multiprocess gauges


_EXITING_PROCESS = """
import anyio, os
from prometheus_client import CollectorRegistry
from handoffbus import HandoffBus, Worker
from handoffbus.metrics import Metrics, serve_metrics

async def main():
    registry = serve_metrics(0, "127.0.0.1")
    async with HandoffBus.memory() as bus:
        metrics = Metrics(bus, registry)
        metrics.live_workers.labels("gone-1").set(3)
        metrics.queue_depth.labels("gone-1").set(7)
        metrics.requested.labels("gone-1").inc(2)

anyio.run(main)
"""


def test_a_process_gone_leaves_no_gauges_in_the_merged_view(tmp_path: Path) -> None:
    """In multiprocess mode a process that exited no longer reports live workers or a queue
    depth (a dead worker's last values would hide the very outage the alerts are for); its
    counters still count."""
    from prometheus_client import CollectorRegistry
    from prometheus_client.multiprocess import MultiProcessCollector

    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    subprocess.run([sys.executable, "-c", _EXITING_PROCESS], env=env, check=True, timeout=60,
                   cwd=Path(__file__).resolve().parent.parent)
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(tmp_path))  # type: ignore[no-untyped-call]
    assert registry.get_sample_value("handoffbus_handoffs_requested_total", {"agent": "gone-1"}) == 2
    assert registry.get_sample_value("handoffbus_live_workers", {"agent": "gone-1"}) is None
    assert registry.get_sample_value("handoffbus_queue_depth", {"agent": "gone-1"}) is None

