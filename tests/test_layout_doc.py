"""docs/redis-layout.md checked against a live server.

The test builds a realistic state through the public API (one handoff completed, one
waiting in the queue, one taken into a worker's inbox, one queued behind it at a better
priority), then runs every ``redis-cli`` line of the doc's code blocks against it. A command
that fails, or that shows nothing (no such key, an empty range, a zero count), means the doc
and the code have drifted apart. The doc's key table must name every key ``handoffbus.keys``
builds, with the type that ``TYPE`` reports.
"""

from __future__ import annotations

import dataclasses
import re
import shlex
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from handoffbus import HandoffBus
from handoffbus.keys import Keys, RecordKeys, RouteKeys, TargetKeys
from handoffbus.routing import set_id
from handoffbus.scripts import SCRIPT_NAMES

from .conftest import SERVER_BINARIES, start_server
from .docstate import (
    PREFIX,
    REQUESTER,
    ROUTED_SET,
    TARGET,
    build_state,
    doc_commands,
    run_with_redis_cli,
    run_with_redis_py,
    shows_something,
)

pytestmark = pytest.mark.anyio

DOC = Path(__file__).resolve().parent.parent / "docs" / "redis-layout.md"
#: Every key suffix handoffbus/keys.py builds (the doc must explain each).
SUFFIXES = ("h:", "e:", "p:", "deadlines", "responses", "queue", "inbox", "inflight", "seq", "bell", "dead",
            "workers", "w:", "agents", "requesters", "unlisted", "targets", "sweep-lease", "route", "rmeta", "rclaims",
            "rseq", "routes", "grants", "outbox", "replies", "stats", "counted:", "blob:", "s:")


# ---------------------------------------------------------------------- reading the doc


def doc_text() -> str:
    return DOC.read_text("utf-8")


def doc_key_types(text: str) -> dict[str, str]:
    """The summary table: example key (first column, in backticks) -> stated type (second column)."""
    found: dict[str, str] = {}
    for line in text.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if line.lstrip().startswith("|") and len(cells) >= 2:
            key = re.fullmatch(r"`([^`]+)`", cells[0])
            if key and key[1].startswith(f"{PREFIX}:"):
                found[key[1]] = cells[1].strip("`* ").lower()
    return found


def expected_keys() -> set[str]:
    """Every concrete key handoffbus.keys builds for the example agents and request id."""
    keys = Keys(PREFIX)
    record = keys.record(REQUESTER, "req-42")
    target = keys.target(TARGET)
    found = {getattr(record, f.name) for f in dataclasses.fields(RecordKeys)}
    found |= {getattr(target, f.name) for f in dataclasses.fields(TargetKeys)}
    route = keys.route(set_id(ROUTED_SET))
    found |= {getattr(route, f.name) for f in dataclasses.fields(RouteKeys)}
    found.add(keys.dead_letters(TARGET))
    found |= {keys.workers(TARGET), keys.worker_beat(TARGET, "worker-1")}
    found |= {keys.outbox(TARGET), keys.replies(TARGET)}  # an isolated agent's (forwarding.py)
    found.add(keys.stats(TARGET))
    found.add(keys.counted(TARGET, "3f1c9a0b7d2e4c55"))
    found.add(keys.staged(REQUESTER, "req-45", "9f86d081884c7d65"))
    found.add(keys.blob(REQUESTER, "b80935d45c7fcb544ad1b841005e50e452239aef65d3e0b6c07976a50f356c69"))
    for name, member in vars(Keys).items():
        if isinstance(member, property):
            found.add(getattr(keys, name))
    return found


# ---------------------------------------------------------------------- the state




@pytest.fixture
async def live(real_backend: str) -> AsyncIterator[tuple[HandoffBus, aioredis.Redis, Path]]:
    """A fresh server of its own (valkey, and redis where a redis-server >= 7 is installed) in the doc's state."""
    server = start_server(SERVER_BINARIES[real_backend])
    raw = aioredis.Redis(unix_socket_path=str(server.socket_path))
    raw.response_callbacks.clear()  # keep replies as the server sent them
    try:
        async with HandoffBus.connect(server.url) as bus:
            assert bus.config.prefix == PREFIX
            await build_state(bus, server.url)
            yield bus, raw, server.socket_path
    finally:
        await raw.aclose()
        server.stop()


# ---------------------------------------------------------------------- tests


def test_doc_names_every_key() -> None:
    text = doc_text()
    for suffix in SUFFIXES:
        shown = rf"{PREFIX}:(\{{[^}}]+\}}:)?{re.escape(suffix)}"
        assert re.search(shown, text), f"the doc never shows a key ending in {suffix!r}"
    for key in expected_keys():
        rest = key.split("}:", 1)[1] if "}:" in key else key.split(":", 1)[1]
        assert any(rest == s or (s.endswith(":") and rest.startswith(s)) for s in SUFFIXES), f"new key {key}?"
    assert set(doc_key_types(text)) == expected_keys(), "the doc's key table and handoffbus/keys.py disagree"
    for script in SCRIPT_NAMES:
        assert f"`{script}`" in text, f"the doc never names the {script} script"


def test_doc_commands_are_well_formed() -> None:
    commands = doc_commands(doc_text())
    assert len(commands) >= 20
    for line in commands:
        argv = shlex.split(line)[1:]
        assert argv, line
        for arg in argv:
            # a key with a hash tag must be quoted, or a shell may brace-expand it
            if "{" in arg:
                assert f"'{arg}'" in line, f"unquoted key with braces: {line}"


async def test_every_doc_command_shows_something(live: tuple[HandoffBus, aioredis.Redis, Path]) -> None:
    """redis-py judges each reply (structured, so an empty range is told from a value); where a
    redis-cli is installed, the line also runs verbatim in it, options and quoting included."""
    bus, raw, socket_path = live
    text = doc_text()
    cli = shutil.which("redis-cli")
    for line in doc_commands(text):
        argv = shlex.split(line)[1:]
        result = await run_with_redis_py(bus, raw, argv)
        assert shows_something(result, argv[0].upper()), f"shows nothing (the doc drifted): {line} -> {result!r}"
        if cli is not None:
            await run_with_redis_cli(cli, socket_path, argv)


async def test_doc_states_each_key_type(live: tuple[HandoffBus, aioredis.Redis, Path]) -> None:
    _bus, raw, _ = live
    stated = doc_key_types(doc_text())
    assert stated
    for key, kind in stated.items():
        actual = await raw.execute_command("TYPE", key)  # type: ignore[no-untyped-call]
        assert actual == kind.encode(), f"{key}: the doc says {kind}, TYPE says {actual!r}"
