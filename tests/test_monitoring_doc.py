"""docs/monitoring.md checked against a live server: every redis-cli line of the page runs on
the docs' running example and shows something, the page covers the commands operators need,
and each command has captured output under it (``python docs/capture.py``)."""

from __future__ import annotations

import shlex
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from handoffbus import HandoffBus

from .conftest import SERVER_BINARIES, start_server
from .docstate import build_monitoring_state, doc_commands, run_with_redis_cli, run_with_redis_py, shows_something

pytestmark = pytest.mark.anyio

PAGE = Path(__file__).resolve().parent.parent / "docs" / "monitoring.md"
#: what the issue asks the page to show, as the start of a command line
REQUIRED = ("XINFO STREAM", "XINFO GROUPS", "XINFO CONSUMERS", "XPENDING", "XRANGE", "XREVRANGE", "ZRANGE",
            "HGETALL", "TTL", "PTTL", "--scan --pattern")


def page() -> str:
    return PAGE.read_text("utf-8")


def test_the_page_covers_what_operators_run() -> None:
    commands = [line.removeprefix("redis-cli ") for line in doc_commands(page())]
    for required in REQUIRED:
        assert any(c.startswith(required) for c in commands), f"the page never shows {required}"
    assert any(c.startswith("XPENDING") and " IDLE " in c for c in commands)  # the IDLE form
    assert any(c.startswith("ZRANGE") and c.endswith("WITHSCORES") for c in commands)
    for topic in ("priority scores by hand", "reading EXPIRED by hand", "The dead-letter stream"):
        assert topic in page()


def test_every_command_has_captured_output() -> None:
    lines = page().splitlines()
    for i, line in enumerate(lines):
        if line.startswith("$ redis-cli "):
            following = lines[i + 1] if i + 1 < len(lines) else "```"
            assert not following.startswith(("$ ", "```")), f"no output captured under: {line}"


@pytest.fixture
async def live(real_backend: str) -> AsyncIterator[tuple[HandoffBus, aioredis.Redis, Path]]:
    server = start_server(SERVER_BINARIES[real_backend])
    raw = aioredis.Redis(unix_socket_path=str(server.socket_path))
    raw.response_callbacks.clear()
    try:
        async with HandoffBus.connect(server.url) as bus:
            await build_monitoring_state(bus, server.url)
            yield bus, raw, server.socket_path
    finally:
        await raw.aclose()
        server.stop()


async def test_every_command_of_the_page_shows_something(live: tuple[HandoffBus, aioredis.Redis, Path]) -> None:
    bus, raw, socket_path = live
    cli = shutil.which("redis-cli")
    commands = doc_commands(page())
    assert len(commands) >= 30
    for line in commands:
        argv = shlex.split(line)[1:]
        if argv[0].upper() == "TIME":
            continue  # always answers; shown for reading deadlines by hand
        result = await run_with_redis_py(bus, raw, argv)
        assert shows_something(result, argv[0].upper()), f"shows nothing (the page drifted): {line} -> {result!r}"
        if cli is not None:
            await run_with_redis_cli(cli, socket_path, argv)
