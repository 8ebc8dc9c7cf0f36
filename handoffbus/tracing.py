"""OpenTelemetry tracing (the optional extra ``otel``: ``pip install 'handoffbus[otel]'``).

Spans follow the messaging semantic conventions, with ``messaging.system`` = ``redis``:
- **send** (PRODUCER), in the requester: the request is written. The destination is the
  target's inbox stream, or the capability set's queue for a routed request.
- **receive** (CONSUMER), in the worker: the handoff is delivered to it.
- **process** (CONSUMER), in the worker: the acceptance hook and the work hook run.
- **settle** (CLIENT), in the worker: the outcome is written.

The requester's W3C ``traceparent`` (and ``tracestate``) travel in the request's metadata.
The worker's spans are children of the requester's send span, so one trace covers the
handoff across processes.

Trace keys are left out of the request's fingerprint, so a resubmission from another
trace is still the same request. Without opentelemetry-api installed, or with no SDK
configured, every function here does nothing.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping
from typing import Any

__all__ = ["TRACE_KEYS", "active", "consumer_span", "send_span", "settle_span", "with_trace_context"]

#: metadata keys that carry the trace context (not part of a request's identity)
TRACE_KEYS = ("traceparent", "tracestate")

trace: Any
try:
    from opentelemetry import propagate, trace
    from opentelemetry.trace import SpanKind
except ImportError:  # pragma: no cover - the extra is not installed
    trace = None


#: a provider named by the environment is loaded by the API on first use (read once: the
#: API's own check reads the environment on every call, several times per handoff)
_PROVIDER_FROM_ENV = "OTEL_PYTHON_TRACER_PROVIDER" in os.environ
_UNKNOWN = object()


def active() -> bool:
    """Whether spans are recorded at all: an SDK's tracer provider was set. Until then the API
    only hands out no-op spans, and skipping them saves ~10 µs a span on the hot path."""
    if trace is None:
        return False
    # the API's global, set by set_tracer_provider; should it ever move, ask the API
    if getattr(trace, "_TRACER_PROVIDER", _UNKNOWN) is None and not _PROVIDER_FROM_ENV:
        return False
    return not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)


def _attributes(operation: str, destination: str, handoff_id: str, **more: Any) -> dict[str, Any]:
    attributes = {
        "messaging.system": "redis",
        "messaging.operation.type": operation,
        "messaging.operation.name": operation,
        "messaging.destination.name": destination,
        "messaging.message.id": handoff_id,
    }
    attributes.update({k: v for k, v in more.items() if v is not None})
    return attributes


@contextlib.contextmanager
def _span(operation: str, destination: str, kind: SpanKind, attributes: Mapping[str, Any],
          parent: Mapping[str, str] | None = None) -> Iterator[None]:
    """A span current for the block, when an SDK provider records spans; nothing otherwise."""
    if not active():
        yield
        return
    context = propagate.extract(parent) if parent else None
    with trace.get_tracer("handoffbus").start_as_current_span(
            f"{operation} {destination}", context=context, kind=kind, attributes=attributes):
        yield


def send_span(destination: str, handoff_id: str) -> contextlib.AbstractContextManager[None]:
    """The requester's send span, current while the request is built and written."""
    return _span("send", destination, SpanKind.PRODUCER, _attributes("send", destination, handoff_id))


def with_trace_context(metadata: Mapping[str, Any]) -> dict[str, Any]:
    """``metadata`` plus the current trace context (unchanged when no span is recording)."""
    if not active():
        return dict(metadata)
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return {**metadata, **{k: v for k, v in carrier.items() if k in TRACE_KEYS}}


def consumer_span(operation: str, destination: str, handoff_id: str, metadata: Mapping[str, Any],
                  group: str, consumer: str) -> contextlib.AbstractContextManager[None]:
    """A worker's receive or process span: a child of the requester's span, when the request
    carried one."""
    if not active():  # before building the attributes: this runs for every handoff
        return contextlib.nullcontext()
    carrier = {k: str(metadata[k]) for k in TRACE_KEYS if isinstance(metadata.get(k), str)}
    return _span(operation, destination, SpanKind.CONSUMER, _attributes(operation, destination, handoff_id, **{
        "messaging.consumer.group.name": group, "messaging.client.id": consumer}), carrier)


def settle_span(destination: str, handoff_id: str, status: str) -> contextlib.AbstractContextManager[None]:
    """The worker writing the outcome (a child of the current process span)."""
    if not active():
        return contextlib.nullcontext()
    return _span("settle", destination, SpanKind.CLIENT,
                 _attributes("settle", destination, handoff_id, **{"handoffbus.status": status}))
