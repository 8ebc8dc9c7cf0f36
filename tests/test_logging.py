"""The library logs nothing unless asked, and every record names its agent and handoff."""

from __future__ import annotations

import logging

import anyio
import pytest

import handoffbus
from handoffbus import HandoffBus

from .agents import Faulty
from .helpers import req, serving

pytestmark = pytest.mark.anyio


def test_the_library_logger_has_a_null_handler() -> None:
    assert any(isinstance(h, logging.NullHandler) for h in logging.getLogger("handoffbus").handlers)
    assert handoffbus.logs.FORMAT.count("%(agent)s") == 1


async def test_worker_records_carry_agent_and_handoff_id(bus: HandoffBus, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="handoffbus")
    handle = await bus.client("req").request_handoff(req("req", "faulty-1"))
    async with serving(bus, Faulty()):
        with anyio.fail_after(10):
            await handle.outcome()
    failed = [r for r in caplog.records if "handler failed" in r.getMessage()]
    assert failed and all(r.agent == "faulty-1" and r.handoff_id == handle.handoff_id  # type: ignore[attr-defined]
                          for r in failed)
    # every record of the library has both attributes, "-" where none applies
    records = [r for r in caplog.records if r.name == "handoffbus"]
    assert records and all(hasattr(r, "agent") and hasattr(r, "handoff_id") for r in records)
    formatter = logging.Formatter(handoffbus.logs.FORMAT)
    assert f"[faulty-1 {handle.handoff_id}]" in formatter.format(failed[0])
