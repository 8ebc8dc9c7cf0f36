"""Agent2Agent (A2A) views of handoffbus: task states and Agent Cards.

| handoffbus | A2A task state | note |
|---|---|---|
| PENDING | ``submitted`` | queued, not yet accepted |
| ACCEPTED | ``working`` | an agent holds it |
| COMPLETED | ``completed`` | |
| REJECTED | ``rejected`` | the rejection code and reason go in the task's metadata |
| CANCELLED | ``canceled`` | |
| FAILED | ``failed`` | the error goes in the task's metadata |
| EXPIRED | ``failed`` | A2A has no expiry: ``metadata["handoffbus.status"] = "EXPIRED"`` and the reason say so |

``a2a_task`` gives a completed handoff's result as one artifact part: a dict as a ``data``
part, ``bytes`` as a ``file`` part (base64, ``application/octet-stream``), a str as a ``text``
part, and any other value as a ``text`` part of JSON (``metadata.mimeType`` says
``application/json``). A2A's JSON has no bytes: bytes inside a dict or list go as base64
strings, and the part's ``metadata["handoffbus.base64"]`` lists where (JSON Pointers). A
result JSON cannot hold otherwise (a NaN, a datetime, a key that is not text, two keys that
are the same as text, such as ``7`` and ``"7"``) raises ``EncodeError``.

``agent_card`` describes a registered agent as an A2A Agent Card: each capability is a
skill. handoffbus has no HTTP endpoint of its own, so the caller gives the URL at which it
exposes the agent (a gateway).
"""

from __future__ import annotations

import base64
import json
from datetime import UTC, datetime
from typing import Any

from .errors import EncodeError
from .models import AgentInfo, HandoffRecord, HandoffStatus

__all__ = ["A2A_PROTOCOL_VERSION", "A2A_STATES", "a2a_state", "a2a_task", "agent_card", "utc_iso"]

A2A_PROTOCOL_VERSION = "0.3.0"
A2A_STATES: dict[HandoffStatus, str] = {
    HandoffStatus.PENDING: "submitted",
    HandoffStatus.ACCEPTED: "working",
    HandoffStatus.COMPLETED: "completed",
    HandoffStatus.REJECTED: "rejected",
    HandoffStatus.CANCELLED: "canceled",
    HandoffStatus.FAILED: "failed",
    HandoffStatus.EXPIRED: "failed",
}


def a2a_state(status: HandoffStatus) -> tuple[str, dict[str, Any]]:
    """The A2A task state of a status, with the metadata that keeps what A2A cannot say."""
    metadata: dict[str, Any] = {"handoffbus.status": status.value}
    if status is HandoffStatus.EXPIRED:
        metadata["reason"] = "not accepted before its deadline"
    return A2A_STATES[status], metadata


def utc_iso(ms: int) -> str:
    """Milliseconds since the epoch as ISO 8601 UTC, to the millisecond: 2026-01-02T03:04:05.678Z."""
    return datetime.fromtimestamp(ms / 1000, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _base64(data: bytes | bytearray | memoryview) -> str:
    return base64.b64encode(data).decode("ascii")


def _pointer_token(key: Any) -> str:
    # a key as JSON writes it (1 -> "1", True -> "true"), escaped as RFC 6901 says
    text = key if isinstance(key, str) else json.dumps(key)
    return text.replace("~", "~0").replace("/", "~1")


def _without_bytes(value: Any, pointer: str, found: list[str]) -> Any:
    """``value`` with the bytes in it as base64 strings; their JSON Pointers go in ``found``."""
    if isinstance(value, bytes | bytearray | memoryview):
        found.append(pointer)
        return _base64(value)
    if isinstance(value, dict):
        return {k: _without_bytes(v, f"{pointer}/{_pointer_token(k)}", found) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_without_bytes(v, f"{pointer}/{i}", found) for i, v in enumerate(value)]
    return value


def _result_part(handoff_id: str, result: Any) -> dict[str, Any]:
    """A result as an A2A part (see the module's docstring)."""
    if isinstance(result, bytes | bytearray | memoryview):
        return {"kind": "file", "file": {"bytes": _base64(result), "mimeType": "application/octet-stream"}}
    if isinstance(result, str):
        return {"kind": "text", "text": result}
    found: list[str] = []
    try:
        text = json.dumps(_without_bytes(result, "", found), allow_nan=False)
    except (TypeError, ValueError, RecursionError) as exc:
        raise EncodeError(f"the result of handoff {handoff_id!r} cannot be given as A2A JSON: {exc}") from None
    metadata: dict[str, Any] = {"handoffbus.base64": found} if found else {}
    if isinstance(result, dict):
        # read back from the JSON, so the part is exactly what is sent (int keys become text)
        try:
            data = json.loads(text, object_pairs_hook=_distinct_keys)
        except ValueError as exc:
            raise EncodeError(f"the result of handoff {handoff_id!r} cannot be given as A2A JSON: {exc}") from None
        return {"kind": "data", "data": data, **({"metadata": metadata} if metadata else {})}
    return {"kind": "text", "text": text, "metadata": {"mimeType": "application/json", **metadata}}


def _distinct_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """An object whose keys all differ: an int key and a str key of the same text would both be
    written, and one value silently lost on reading."""
    out = dict(pairs)
    if len(out) != len(pairs):
        raise ValueError("two keys are the same as text (an int key beside its text?)")
    return out


def a2a_task(record: HandoffRecord) -> dict[str, Any]:
    """A handoff as an A2A Task object (its history as status updates, its result as an artifact).
    Raises ``EncodeError`` for a result JSON cannot hold."""
    state, metadata = a2a_state(record.status)
    response = record.response
    if response.rejection_code or response.rejection_reason:
        metadata.update({"rejection_code": response.rejection_code, "rejection_reason": response.rejection_reason})
    if response.error:
        metadata["error"] = response.error
    task: dict[str, Any] = {
        "kind": "task",
        "id": record.handoff_id,
        "contextId": record.request.metadata.get("context_id", record.handoff_id),
        "status": {"state": state, "timestamp": utc_iso(record.updated_ms)},
        "history": [{"kind": "message", "role": "agent" if h.actor != record.request.from_agent else "user",
                     "messageId": f"{record.handoff_id}#{i}", "parts": [{"kind": "text", "text": h.status.value}],
                     "metadata": {"actor": h.actor, "at": utc_iso(h.at_ms)}}
                    for i, h in enumerate(record.history)],
        "metadata": metadata,
    }
    if record.status is HandoffStatus.COMPLETED and response.result is not None:
        task["artifacts"] = [{"artifactId": f"{record.handoff_id}/result",
                              "parts": [_result_part(record.handoff_id, response.result)]}]
    return task


def agent_card(agent: AgentInfo, url: str, *, description: str = "", version: str = "1.0.0",
               provider: dict[str, str] | None = None) -> dict[str, Any]:
    """An A2A Agent Card for a registered agent: its capabilities become skills."""
    card: dict[str, Any] = {
        "protocolVersion": A2A_PROTOCOL_VERSION,
        "name": agent.agent_id,
        "description": description or f"handoffbus agent {agent.agent_id} ({len(agent.workers)} live workers)",
        "url": url,
        "version": version,
        "capabilities": {"streaming": False, "pushNotifications": False, "stateTransitionHistory": True},
        "defaultInputModes": ["application/json", "text/plain"],
        "defaultOutputModes": ["application/json", "text/plain"],
        "skills": [{"id": capability, "name": capability.replace("_", " "),
                    "description": f"{agent.agent_id} accepts handoffs that need {capability}",
                    "tags": [capability, "handoffbus"]} for capability in agent.capabilities],
    }
    if provider:
        card["provider"] = provider
    return card
