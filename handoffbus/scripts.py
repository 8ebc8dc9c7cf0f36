"""Loads the Lua scripts under ``handoffbus/lua/`` and registers them with a client.

Why EVALSHA rather than a FUNCTION library: redis-py's Script objects send EVALSHA and
reload on NOSCRIPT by themselves, in pipelines too, so a ``SCRIPT FLUSH``, a failover to a
replica or a restarted server costs one retried call and never a failed one; the cluster
client routes each call by its first key; and fakeredis runs the same scripts, so the
in-memory mode shares every line of Lua. A FUNCTION library must be re-loaded by hand after
``FUNCTION FLUSH`` or a restart and is not implemented by fakeredis.

Scripts are files named ``<name>-<number of keys>.lua``. A line ``-- @include <name>`` is
replaced by ``lua/includes/<name>.lua``: files are joined, never generated, and all data
travels in KEYS and ARGV.
"""

from __future__ import annotations

import re
from functools import cache
from importlib import resources
from typing import Any

__all__ = ["SCRIPT_NAMES", "Scripts", "script_source"]

SCRIPT_NAMES = (
    "request",
    "accept",
    "reject",
    "complete",
    "fail",
    "cancel",
    "status",
    "sweep",
    "enqueue",
    "take",
    "settle",
    "lease",
)
_INCLUDE = re.compile(r"^-- @include (\w+)$", re.MULTILINE)


@cache
def _files() -> dict[str, tuple[int, str]]:
    root = resources.files("handoffbus") / "lua"
    found: dict[str, tuple[int, str]] = {}
    for entry in root.iterdir():
        match = re.fullmatch(r"(\w+)-(\d+)\.lua", entry.name)
        if match:
            found[match[1]] = (int(match[2]), entry.read_text("utf-8"))
    return found


@cache
def script_source(name: str) -> str:
    """The full source of script ``name`` with its includes pasted in."""
    text = _files()[name][1]
    root = resources.files("handoffbus") / "lua" / "includes"
    return _INCLUDE.sub(lambda m: (root / f"{m[1]}.lua").read_text("utf-8"), text)


def key_count(name: str) -> int:
    return _files()[name][0]


class Scripts:
    """The registered scripts of one client, as attributes: ``scripts.accept(keys=..., args=...)``."""

    def __init__(self, redis: Any) -> None:
        for name in SCRIPT_NAMES:
            setattr(self, name, redis.register_script(script_source(name)))

    request: Any
    accept: Any
    reject: Any
    complete: Any
    fail: Any
    cancel: Any
    status: Any
    sweep: Any
    enqueue: Any
    take: Any
    settle: Any
    lease: Any
