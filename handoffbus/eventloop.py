"""The event loop the CLI's long-running processes run on: uvloop where it is installed.

uvloop cuts the loop's own cost per socket read, write and callback by about half, which is
most of a worker's time outside its hooks. ``HANDOFFBUS_UVLOOP=0`` keeps asyncio's loop.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

__all__ = ["backend_options", "uses_uvloop"]


def uses_uvloop() -> bool:
    if os.environ.get("HANDOFFBUS_UVLOOP", "1") == "0":
        return False
    return importlib.util.find_spec("uvloop") is not None


def backend_options() -> dict[str, Any]:
    """anyio.run's ``backend_options`` for the asyncio backend."""
    return {"use_uvloop": uses_uvloop()}
