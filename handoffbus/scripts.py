"""Loads the Lua scripts under ``handoffbus/lua/`` as one FUNCTION library, and names its functions.

Why a library rather than EVALSHA: the top level of a library runs once, when it is loaded,
and each FCALL runs only its function. An EVALSHA script runs its whole text on every call,
so every call rebuilt the helpers and tables its includes define: for a script with the
record helpers, about 18,000 of the server's instructions a call, some 7% of a transition.
A library is also replicated and persisted with the data, so a failover keeps it.

A call that meets "Function not found" (a ``FUNCTION FLUSH``, a restarted server without
persistence, a new primary) loads the library and is retried (see ``batching.py``), so that
costs one retried call and never a failed one. On a cluster each call goes to the primary of
its first key's slot (every key of a script shares that slot), and ``FUNCTION LOAD`` goes to
every primary. fakeredis runs the same library, so the in-memory mode shares every line of Lua.

Scripts are files named ``<name>-<number of keys>.lua`` (``load`` takes its two once per
handoff it reads). A line ``-- @include <name>`` names a file of ``lua/includes/``: in the
library each include is pasted once, at the top level, and each script becomes the body of a
function. A line ``-- @flags no-writes`` marks a script that
only reads: a function without it counts as a write, which a replica or a server out of
memory refuses before it runs. Names carry a digest of the whole library, so the versions of
a rolling upgrade each call their own code (but an isolated agent calls what its forwarder
loaded: see docs/redis-layout.md). Files are joined, never generated, and all data travels
in KEYS and ARGV.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Awaitable, Callable, Iterator, Sequence
from functools import cache
from importlib import resources
from typing import Any

__all__ = ["GET", "INLINE_ENVELOPE", "LOAD_MANY", "SCRIPT_NAMES", "SET", "STAGED_TTL_MS", "STAGE_OVER", "Command",
           "Reload", "Script", "Scripts", "script_source"]

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
    "idle",
    "unlisted",
)
_INCLUDE = re.compile(r"^-- @include (\w+)$", re.MULTILINE)
#: a script's function flags, e.g. "-- @flags no-writes" for one that only reads: a function
#: without it counts as a write, which a replica or a server out of memory refuses up front
_FLAGS = re.compile(r"^-- @flags ([\w -]+)$", re.MULTILINE)


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


def _body(name: str) -> tuple[list[str], str]:
    """A script's includes, in order, and its text without them."""
    text = _files()[name][1]
    return _INCLUDE.findall(text), _INCLUDE.sub("", text)


def script_flags(name: str) -> list[str]:
    """The flags a script's function is registered with (its ``-- @flags`` line)."""
    found = _FLAGS.search(_files()[name][1])
    return found[1].split() if found else []


def _register(digest: str, name: str) -> str:
    """The Lua that registers script ``name``: its text as the body of a function."""
    flags = ", ".join(f"'{flag}'" for flag in script_flags(name))
    return (f"redis.register_function{{function_name='{function_name(digest, name)}', flags={{{flags}}}, "
            f"callback=function(keys, args)\nKEYS, ARGV = keys, args\n{_body(name)[1]}\nend}}")


def _include_order() -> list[str]:
    """Every include once, each after the ones any script pastes before it (offerback uses
    record's helpers, queue holder's, route offer's)."""
    order: list[str] = []
    for name in SCRIPT_NAMES:
        for include in _body(name)[0]:
            if include not in order:
                order.append(include)
    for name in SCRIPT_NAMES:
        includes = _body(name)[0]
        if includes != sorted(includes, key=order.index):
            raise RuntimeError(f"script {name} pastes its includes in another order than the library: {includes}")
    return order


@cache
def _library_parts() -> tuple[str, str]:
    """(digest, library text after its first line). Every function sets the library's KEYS and
    ARGV, which the helpers read as upvalues: a script's text runs in a function unchanged. The
    digest is of the whole text (with a placeholder where the names carry it)."""
    root = resources.files("handoffbus") / "lua" / "includes"
    parts = ["local KEYS, ARGV"]
    parts += [(root / f"{include}.lua").read_text("utf-8") for include in _include_order()]
    parts += [_register(_UNNAMED, name) for name in SCRIPT_NAMES]
    text = "\n".join(parts) + "\n"
    digest = hashlib.sha1(text.encode()).hexdigest()[:16]
    return digest, text.replace(function_name(_UNNAMED, ""), function_name(digest, ""))


#: stands for the digest while the text it is the digest of is put together
_UNNAMED = "0" * 16


def function_name(digest: str, name: str) -> str:
    return f"hb_{digest}_{name}"


def library_name() -> str:
    return LIBRARY_PREFIX + _library_parts()[0]


@cache
def library_source() -> str:
    """The whole library, as FUNCTION LOAD takes it."""
    return f"#!lua name={library_name()}\n{_library_parts()[1]}"


#: a handoffbus library's name: this and the digest (``FUNCTION LIST LIBRARYNAME handoffbus_*``)
LIBRARY_PREFIX = "handoffbus_"


class Script:
    """One script: its name, number of keys, its source alone (with its includes pasted in: what
    the library runs as the function's body, with the includes once for all) and the name FCALL
    calls it by."""

    __slots__ = ("function", "keys", "name", "source")

    def __init__(self, name: str) -> None:
        self.name = name
        self.keys = key_count(name)
        self.source = script_source(name)
        self.function = function_name(_library_parts()[0], name)


class Command(Script):
    """A plain command sent through the batcher like a script call, packed as itself (it has no
    function name): for a large envelope, which costs Redis far more passing through Lua than
    as a plain value (see ``HandoffBus.load_records``)."""

    __slots__ = ()

    def __init__(self, name: str) -> None:
        self.name, self.keys, self.source, self.function = name, 1, "", ""


#: Passing through Lua, a value costs Redis 7.0 about 1.3 ns a byte (Lua's garbage collector
#: is paced by the bytes its strings take): some 80 us at 64 KB, against a few for a plain GET
#: or SET. So a large envelope travels by plain commands.
#: The largest envelope the ``load`` and ``status`` reads return: a larger one is left to a GET
#: in a second round trip, which below about 16 KB costs more than it saves.
INLINE_ENVELOPE = 16 * 1024
#: The most handoffs one ``load`` call reads (``HandoffBus.load_records`` reads a batch in one
#: call per requester): bounds the reply, 15 values a handoff, and the time the server spends
#: in one call.
LOAD_MANY = 256
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


#: what brings back the library the server lost, before calls that met "Function not found"
#: go again (the batcher's own loading, or an isolated agent's wait for its forwarder): given
#: the scripts that missed
Reload = Callable[[Sequence[Script]], Awaitable[None]]


class Scripts:
    """Every script, as attributes: ``scripts.accept.function``; ``source`` is the library.
    Calls go through ``HandoffBus.script``."""

    def __init__(self) -> None:
        for name in SCRIPT_NAMES:
            setattr(self, name, Script(name))
        self.source = library_source()
        self.library = library_name()

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
        """FUNCTION LOAD the library, so the first calls of a burst do not all miss it. A load is
        a write, replicated and logged whole even when it changes nothing: a bus that opens
        calls ``ensure_loaded``. One command, so the server never holds some functions and not
        others (calls sent together in order, a record then its queue entry, either all run or
        all miss and are sent again in order). REPLACE: loading the same library twice changes
        nothing. On a cluster redis-py sends it to every primary."""
        await redis.function_load(self.source, replace=True)

    async def ensure_loaded(self, redis: Any) -> bool:
        """Load the library if the server (any primary of a cluster) lost it; True if it did.
        The forwarder's job: isolated agents may not load it themselves."""
        found = await redis.function_list(library=self.library)
        # a cluster answers per primary, as a mapping
        if all(found.values()) if isinstance(found, dict) else found:
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
