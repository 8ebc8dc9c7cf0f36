"""Prometheus metrics: counted as things happen in-process, and scraped from a real
``handoffbus worker --metrics-port`` process."""

from __future__ import annotations

import socket
import struct
import urllib.request
from collections.abc import Callable
from pathlib import Path

import anyio
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.mmap_dict import MmapedDict, mmap_key
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.parser import text_string_to_metric_families

from handoffbus import HandoffBus
from handoffbus.metrics import Metrics, WholeFiles

from .agents import Echo, Faulty
from .conftest import make_bus
from .helpers import handoffbus_process, req, serving

pytestmark = pytest.mark.anyio


async def test_counters_and_histograms_follow_what_happens(real_backend: str, servers: dict) -> None:
    async with make_bus(real_backend, servers) as bus:
        registry = CollectorRegistry()
        metrics = Metrics(bus, registry)
        client = bus.client("req")
        handles = [await client.request_handoff(req("req", "echo-1")) for _ in range(4)]
        handles += [await client.request_handoff(req("req", "faulty-1"))]
        handles += [await client.request_handoff(req("req", "nobody-1", timeout=0.2))]
        async with serving(bus, Echo(), Faulty()) as workers:
            with anyio.fail_after(20):
                for handle in handles:
                    await handle.outcome()
        await bus.stats.flush()  # the counts into Redis (about once a second on their own)
        await metrics.refresh(["echo-1", "nobody-1"], workers)  # drained: everything settled

    def value(name: str, **labels: str) -> float | None:
        found: float | None = registry.get_sample_value(name, labels)
        return found

    assert value("handoffbus_handoffs_requested_total", agent="echo-1") == 4
    assert value("handoffbus_handoffs_finished_total", agent="echo-1", status="COMPLETED") == 4
    assert value("handoffbus_handoffs_finished_total", agent="faulty-1", status="FAILED") == 1
    assert value("handoffbus_handoffs_finished_total", agent="nobody-1", status="EXPIRED") == 1
    assert value("handoffbus_handoffs_accepted_total", agent="echo-1") == 4
    assert value("handoffbus_decision_seconds_count", agent="echo-1") == 4
    assert value("handoffbus_handoff_duration_seconds_count", agent="echo-1") == 4
    assert value("handoffbus_decision_seconds_bucket", agent="echo-1", le="+Inf") == 4
    assert value("handoffbus_queue_depth", agent="echo-1") == 0
    assert value("handoffbus_inflight", agent="echo-1") == 0
    # every process's counts, read from Redis: what the alerts use (an expiry is counted by the
    # process that made it, seldom one that serves metrics)
    assert value("handoffbus_agent_handoffs", agent="echo-1", event="COMPLETED") == 4
    assert value("handoffbus_agent_handoffs", agent="nobody-1", event="EXPIRED") == 1
    assert (value("handoffbus_worker_heartbeat_timestamp_seconds", agent="echo-1") or 0) > 1.7e9
    # no handoff ids among the labels
    for family in registry.collect():
        for sample in family.samples:
            assert set(sample.labels) <= {"agent", "status", "event", "le"}, sample


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


Scraped = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def _scrape(port: int) -> Scraped:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


async def scrape_until(port: int, done: Callable[[Scraped], bool]) -> Scraped:
    """Scrape until ``done`` says the other process has shown what the test waits for."""
    with anyio.fail_after(20):
        while True:
            scraped = await anyio.to_thread.run_sync(_scrape, port)
            if done(scraped):
                return scraped
            await anyio.sleep(0.1)  # polling another process's HTTP endpoint


@pytest.mark.parametrize("multiprocess", [False, True], ids=["one-process", "multiprocess-dir"])
async def test_a_worker_process_serves_its_metrics(servers: dict, multiprocess: bool, tmp_path: Path) -> None:
    server = servers["valkey"]
    port = _free_port()
    # prometheus_client's multiprocess mode: values go through files in this directory
    env = {"PROMETHEUS_MULTIPROC_DIR": str(tmp_path)} if multiprocess else {}
    echo = (("agent", "echo-1"),)
    async with make_bus("valkey", servers) as bus, handoffbus_process(
            "worker", "tests.agents:Echo", "--redis-url", server.url, "--prefix", bus.config.prefix,
            "--metrics-port", str(port), "--metrics-address", "127.0.0.1", ready=b"serving", env=env):
        client = bus.client("req")
        handles = [await client.request_handoff(req("req", "echo-1")) for _ in range(3)]
        with anyio.fail_after(20):
            for handle in handles:
                await handle.outcome()
        await client.request_handoff(req("req", "echo-1", priority=5))  # one more, not awaited here
        # the gauges are read from Redis every 2 s: until a refresh has shown the work
        scraped = await scrape_until(port, lambda found: found.get(
            ("handoffbus_handoffs_finished_total", (*echo, ("status", "COMPLETED")))) == 4 and bool(
            found.get(("handoffbus_worker_heartbeat_timestamp_seconds", echo))))
    assert scraped[("handoffbus_decision_seconds_count", echo)] == 4
    assert scraped[("handoffbus_handoff_duration_seconds_count", echo)] == 4
    assert ("handoffbus_queue_depth", echo) in scraped
    assert scraped[("handoffbus_live_workers", echo)] == 1
    if multiprocess:
        assert [p async for p in anyio.Path(tmp_path).glob("*.db")], "no multiprocess value files written"


async def test_metrics_without_the_extra_say_how_to_get_it(monkeypatch: pytest.MonkeyPatch) -> None:
    import handoffbus.metrics as module
    from handoffbus import HandoffbusError

    monkeypatch.setattr(module, "prom", None)
    async with HandoffBus.memory() as bus:
        with pytest.raises(HandoffbusError, match=r"pip install 'handoffbus\[metrics\]'"):
            Metrics(bus)


async def test_the_exporter_sees_agents_without_live_workers(servers: dict) -> None:
    server = servers["valkey"]
    port = _free_port()
    orphan = (("agent", "orphan-1"),)
    async with make_bus("valkey", servers) as bus:
        await bus.client("req").request_handoff(req("req", "orphan-1"))
        async with handoffbus_process("exporter", "--port", str(port), "--address", "127.0.0.1", "--interval", "0.2",
                              "--redis-url", server.url, "--prefix", bus.config.prefix, ready=b"exporter serving"):
            scraped = await scrape_until(port, lambda found: ("handoffbus_queue_depth", orphan) in found)
    assert scraped[("handoffbus_queue_depth", orphan)] == 1
    assert scraped[("handoffbus_live_workers", orphan)] == 0
    assert scraped[("handoffbus_oldest_waiting_age_seconds", orphan)] > 0


def test_a_multiprocess_scrape_leaves_out_a_value_file_still_being_made(tmp_path: Path) -> None:
    """prometheus_client makes each multiprocess value file empty and sizes it afterwards: a
    scrape that read one in between (another process's, or this one's loop while the HTTP
    thread scrapes) failed whole, a 500 for every metric of every process."""
    done = MmapedDict(str(tmp_path / "counter_1.db"))
    done.write_value(mmap_key("handoffbus_x_total", "handoffbus_x_total", ["agent"], ["a"], "x"), 3.0, 0.0)
    done.close()
    (tmp_path / "counter_2.db").touch()  # being made: empty yet
    with pytest.raises(struct.error):  # what the collector prometheus_client ships does with it
        MultiProcessCollector.merge([str(f) for f in tmp_path.glob("*.db")], accumulate=True)
    registry = CollectorRegistry()
    registry.register(WholeFiles(str(tmp_path), MultiProcessCollector.merge))
    assert 'handoffbus_x_total{agent="a"} 3.0' in generate_latest(registry).decode()
