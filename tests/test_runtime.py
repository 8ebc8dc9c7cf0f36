"""How the CLI's processes set up the interpreter: uvloop where installed, a frozen start-up heap."""

from __future__ import annotations

import gc

import anyio
import pytest

from handoffbus.runtime import GC_THRESHOLDS, backend_options, freeze_startup, uses_uvloop


def test_uvloop_is_used_where_installed_unless_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HANDOFFBUS_UVLOOP", raising=False)
    assert uses_uvloop() and backend_options() == {"use_uvloop": True}  # a core dependency on Linux

    async def loop_module() -> str:
        import asyncio

        return type(asyncio.get_running_loop()).__module__

    assert anyio.run(loop_module, backend_options=backend_options()).startswith("uvloop")
    monkeypatch.setenv("HANDOFFBUS_UVLOOP", "0")
    assert backend_options() == {"use_uvloop": False}
    assert anyio.run(loop_module, backend_options=backend_options()).startswith("asyncio")


def test_start_up_objects_are_frozen_out_of_the_collector() -> None:
    gc.collect()
    walked = len(gc.get_objects(generation=2))
    thresholds = gc.get_threshold()
    try:
        freeze_startup()
        assert gc.get_freeze_count() > walked / 2 > 5_000  # the modules loaded so far, at the least
        assert len(gc.get_objects(generation=2)) < walked / 100  # a full collection skips them now
        assert gc.get_threshold() == GC_THRESHOLDS != thresholds
        young = [[] for _ in range(5_000)]  # a few thousand containers are no reason to collect
        assert gc.get_count()[0] >= len(young)
    finally:
        gc.unfreeze()
        gc.set_threshold(*thresholds)
    assert gc.get_freeze_count() == 0
