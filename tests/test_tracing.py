"""OpenTelemetry: a requester's trace continues in a worker process (send -> receive ->
process -> settle), with the messaging semantic conventions' attributes."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.util._once import Once

from handoffbus import HandoffStatus

from .conftest import make_bus
from .helpers import ROOT, req

pytestmark = pytest.mark.anyio


@pytest.fixture
def exporter(monkeypatch: pytest.MonkeyPatch) -> Iterator[InMemorySpanExporter]:
    """An SDK tracer provider for this test only (the global one is put back after)."""
    found = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(found))
    monkeypatch.setattr(trace, "_TRACER_PROVIDER_SET_ONCE", Once())
    monkeypatch.setattr(trace, "_TRACER_PROVIDER", None)
    trace.set_tracer_provider(provider)
    yield found
    provider.shutdown()


async def test_the_requesters_trace_continues_in_the_worker_process(
    servers: dict, exporter: InMemorySpanExporter, tmp_path: Path
) -> None:
    spans_file = tmp_path / "worker-spans.jsonl"
    async with make_bus("valkey", servers) as bus:
        process = await anyio.open_process(
            [sys.executable, "tests/otel_worker.py", "worker", "tests.agents:Echo", "--redis-url",
             servers["valkey"].url, "--prefix", bus.config.prefix],
            cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1", "SPANS_FILE": str(spans_file)},
        )
        try:
            assert process.stdout is not None
            with anyio.fail_after(30):
                assert b"serving" in await process.stdout.receive()
            client = bus.client("req")
            with trace.get_tracer("test").start_as_current_span("agent turn"):
                handle = await client.request_handoff(req("req", "echo-1", request_id="t-1"))
            with anyio.fail_after(20):
                outcome = await handle.outcome()
            # the trace context travelled in the request; a resubmission from another trace is the same request
            record = await handle.status()
            assert record is not None and record.request.metadata["traceparent"].startswith("00-")
            with trace.get_tracer("test").start_as_current_span("another turn"):
                again = await client.request_handoff(req("req", "echo-1", request_id="t-1"))
            assert again.handoff_id == handle.handoff_id
        finally:
            process.terminate()
            with anyio.fail_after(30):
                assert await process.wait() == 0
            await process.aclose()
    assert outcome.status is HandoffStatus.COMPLETED

    inbox = bus.keys.target("echo-1").inbox
    [turn] = [s for s in exporter.get_finished_spans() if s.name == "agent turn"]
    [send, _] = [s for s in exporter.get_finished_spans() if s.name == f"send {inbox}"]
    assert send.kind.name == "PRODUCER" and send.parent is not None and send.parent.span_id == turn.context.span_id
    assert send.attributes is not None
    assert dict(send.attributes) == {
        "messaging.system": "redis", "messaging.operation.type": "send", "messaging.operation.name": "send",
        "messaging.destination.name": inbox, "messaging.message.id": handle.handoff_id}

    worker = {s["name"].split()[0]: s for s in map(json.loads, spans_file.read_text().splitlines())}
    receive, process_span, settle = worker["receive"], worker["process"], worker["settle"]
    trace_id = send.context.trace_id
    assert {receive["trace_id"], process_span["trace_id"], settle["trace_id"]} == {trace_id}
    assert receive["parent_id"] == process_span["parent_id"] == send.context.span_id  # across processes
    assert settle["parent_id"] == process_span["span_id"]
    assert (receive["kind"], process_span["kind"], settle["kind"]) == ("CONSUMER", "CONSUMER", "CLIENT")
    for span in (receive, process_span, settle):
        attributes = span["attributes"]
        assert attributes["messaging.system"] == "redis" and attributes["messaging.destination.name"] == inbox
        assert attributes["messaging.message.id"] == handle.handoff_id
    assert process_span["attributes"]["messaging.consumer.group.name"] == "workers"
    assert settle["attributes"]["handoffbus.status"] == "COMPLETED"


async def test_without_a_recording_span_nothing_is_added(real_bus: object) -> None:
    from handoffbus import HandoffBus

    assert isinstance(real_bus, HandoffBus)
    handle = await real_bus.client("req").request_handoff(req("req", "echo-1"))
    record = await handle.status()
    assert record is not None and "traceparent" not in record.request.metadata
