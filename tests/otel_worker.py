"""``handoffbus`` run with an OpenTelemetry SDK whose spans go to an in-memory exporter; they
are written as JSON lines to ``$SPANS_FILE`` when the command ends (see test_tracing.py)."""

from __future__ import annotations

import json
import os
import sys

from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from handoffbus.cli import main

exporter = InMemorySpanExporter()
provider = TracerProvider()
provider.add_span_processor(SimpleSpanProcessor(exporter))
trace.set_tracer_provider(provider)

code = main(sys.argv[1:])
with open(os.environ["SPANS_FILE"], "w", encoding="utf-8") as out:
    for span in exporter.get_finished_spans():
        out.write(json.dumps({
            "name": span.name, "kind": span.kind.name, "trace_id": span.context.trace_id,
            "span_id": span.context.span_id, "parent_id": span.parent.span_id if span.parent else None,
            "attributes": dict(span.attributes or {}),
        }) + "\n")
sys.exit(code)
