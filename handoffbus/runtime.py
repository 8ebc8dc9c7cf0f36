"""How a long-running handoffbus process sets up its interpreter: the event loop, and the
garbage collector.

- uvloop where it is installed: it cuts the loop's own cost per socket read, write and
  callback, which is most of a worker's time outside its hooks. ``HANDOFFBUS_UVLOOP=0``
  keeps asyncio's loop.
- ``gc.freeze()`` once start-up is done: the modules, classes and constants loaded by then
  live as long as the process, yet every full collection walks them all (about 47,000
  objects and 12 ms in a worker; four times that with the SDK integrations loaded). Frozen,
  they are left out, and those pauses were most of a worker's p99 latency under load.
- a collection every 20,000 container allocations instead of 700 (``GC_THRESHOLDS``): almost
  everything a handoff allocates is freed by reference counting within the handoff, but at
  700 the collector ran every few dozen handoffs, caught the ones in flight, promoted them and
  later walked them again in the older generations. Measured with ``gc.callbacks`` over 22,000
  handoffs (``bench_workers.py``, direct): 348 ms in a worker and 503 ms in the requester at
  700, 54 and 35 ms at 20,000.
"""

from __future__ import annotations

import gc
import os
from typing import Any

__all__ = ["GC_THRESHOLDS", "backend_options", "freeze_startup", "uses_uvloop"]


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


#: gc.set_threshold for a long-running process (Python's default is 700, 10, 10)
GC_THRESHOLDS = (20_000, 20, 20)


def freeze_startup() -> None:
    """Collect once, move every object alive now out of the collector's sight, and collect
    less often from here on (``GC_THRESHOLDS``)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)
