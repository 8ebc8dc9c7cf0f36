"""Loads the Lua scripts under ``handoffbus/lua/`` and registers them with a client.

Why EVALSHA rather than a FUNCTION library: a call that meets NOSCRIPT loads the script and
is retried (see ``batching.py``), so a ``SCRIPT FLUSH``, a failover to a replica or a
restarted server costs one retried call and never a failed one; on a cluster each call goes
to the primary of its first key's slot (every key of a script shares that slot); and
fakeredis runs the same scripts, so the in-memory mode shares every line of Lua. A FUNCTION
library must be re-loaded by hand after ``FUNCTION FLUSH`` or a restart and is not
implemented by fakeredis.

Scripts are files named ``<name>-<number of keys>.lua``. A line ``-- @include <name>`` is
replaced by ``lua/includes/<name>.lua``: files are joined, never generated, and all data
travels in KEYS and ARGV.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from functools import cache
from importlib import resources
from typing import Any

__all__ = ["GET", "INLINE_ENVELOPE", "SCRIPT_NAMES", "SET", "STAGED_TTL_MS", "STAGE_OVER", "Command", "Reload",
           "Script", "Scripts", "script_source"]

SCRIPT_NAMES = (
    "request",
    "accept",
    "reject",
    "complete",
    "fail",
    "cancel",
    "status",
    "sweep",
    "guard",
    "enqueue",
    "take",
    "settle",
    "requeue",
    "release",
    "lease",
    "load",
    "reclaim",
    "deadletter",
    "register",
    "retire",
    "route",
    "pull",
    "assign",
    "admit",
    "restore",
    "withdraw",
    "ring",
    "unroutable",
    "count",
    "observe",
    "blob",
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


class Script:
    """One script: its name, number of keys, full source and SHA1 (what EVALSHA names it by)."""

    __slots__ = ("keys", "name", "sha", "source")

    def __init__(self, name: str) -> None:
        self.name = name
        self.keys = key_count(name)
        self.source = script_source(name)
        self.sha = hashlib.sha1(self.source.encode()).hexdigest()


class Command(Script):
    """A plain command sent through the batcher like a script call, packed without EVALSHA (it
    has no SHA): for a large envelope, which costs Redis far more passing through Lua than as
    a plain value (see ``HandoffBus.load_records``)."""

    __slots__ = ()

    def __init__(self, name: str) -> None:
        self.name, self.keys, self.source, self.sha = name, 1, "", ""


#: Passing through Lua, a value costs Redis 7.0 about 1.3 ns a byte (Lua's garbage collector
#: is paced by the bytes its strings take): some 80 us at 64 KB, against a few for a plain GET
#: or SET. So a large envelope travels by plain commands.
#: The largest envelope the ``load`` and ``status`` reads return: a larger one is left to a GET
#: in a second round trip, which below about 16 KB costs more than it saves.
INLINE_ENVELOPE = 16 * 1024
#: The largest envelope passed to the ``request`` script: a larger one is written by a plain SET
#: beside it, in the same batch (no round trip more; it saves the server more than the extra
#: command costs the requester from about 8 KB on).
STAGE_OVER = 8 * 1024
#: ms a staged envelope lives if its ``request`` script never runs (a lost connection)
STAGED_TTL_MS = 600_000

#: a large request envelope, read apart from its record (``HandoffBus.load_records``) and
#: written apart from it (``HandoffClient._request``)
GET = Command("GET")
SET = Command("SET")
PLAIN = {command.name: command for command in (GET, SET)}


#: what brings back scripts the server lost, before calls that met NOSCRIPT go again (the
#: batcher's own loading, or an isolated agent's wait for its forwarder): given the missing ones
Reload = Callable[[Sequence[Script]], Awaitable[None]]

class Scripts:
    """Every script, as attributes: ``scripts.accept.sha``. Calls go through ``HandoffBus.script``."""

    def __init__(self) -> None:
        for name in SCRIPT_NAMES:
            setattr(self, name, Script(name))

    def __iter__(self) -> Iterator[Script]:
        return (getattr(self, name) for name in SCRIPT_NAMES)

    def __getitem__(self, name: str) -> Script:
        plain = PLAIN.get(name)  # a plain command among the script calls
        if plain is not None:
            return plain
        if name not in SCRIPT_NAMES:
            raise KeyError(name)
        script: Script = getattr(self, name)
        return script

    async def load_all(self, redis: Any) -> None:
        """SCRIPT LOAD every script, so the first calls of a burst do not all miss the cache.
        On one server in a MULTI: the cache never holds some of them and not others, so calls
        sent together in order (a record, then its queue entry) either all run or all meet
        NOSCRIPT and are sent again in order. On a cluster every primary gets them (redis-py
        sends SCRIPT LOAD to all primaries; a cluster pipeline takes no command meant for
        several nodes); calls there go in waves anyway (cluster.py)."""
        from .cluster import is_cluster

        if is_cluster(redis):
            await self.load_some(redis, self)
            return
        async with redis.pipeline(transaction=True) as pipe:
            for script in self:
                pipe.script_load(script.source)
            await pipe.execute()

    async def load_some(self, redis: Any, scripts: Iterable[Script]) -> None:
        """SCRIPT LOAD these (on a cluster, redis-py sends each to every primary)."""
        for script in scripts:
            await redis.script_load(script.source)

    async def ensure_loaded(self, redis: Any) -> bool:
        """Load every script if the server (any primary of a cluster) lost one; True if it did.
        The forwarder's job: isolated agents may not load scripts themselves."""
        present = await redis.script_exists(*(script.sha for script in self))
        if all(present):
            return False
        await self.load_all(redis)
        return True

    request: Script
    accept: Script
    reject: Script
    complete: Script
    fail: Script
    cancel: Script
    status: Script
    sweep: Script
    enqueue: Script
    take: Script
    settle: Script
    requeue: Script
    release: Script
    lease: Script
    load: Script
    reclaim: Script
    deadletter: Script
    register: Script
    route: Script
    pull: Script
    assign: Script
    admit: Script
    restore: Script
    withdraw: Script
    ring: Script
    unroutable: Script
    count: Script
    observe: Script
