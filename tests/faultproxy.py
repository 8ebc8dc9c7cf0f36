"""A TCP proxy on loopback in front of a server, injecting network faults on demand: delay,
blackhole, reset, and cutting a connection right after a chosen command was written."""

from __future__ import annotations

import contextlib

import anyio
from anyio.abc import SocketStream, TaskGroup, TaskStatus


class FaultProxy:
    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.port = 0
        self.delay = 0.0  # seconds added before each chunk is passed on
        self._open = anyio.Event()  # set: chunks flow; cleared by blackhole()
        self._open.set()
        self._cut_marker: bytes | None = None
        self._stall_marker: bytes | None = None
        self.marker_seen = 0  # how often a chunk with the armed marker went to the server
        self.cuts = 0
        self._scopes: set[anyio.CancelScope] = set()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def cut_after(self, marker: bytes) -> None:
        """The next connection to send ``marker`` to the server is killed right after the
        server received it: the command runs, its reply never reaches the client."""
        self._cut_marker = marker

    def stall_on(self, marker: bytes) -> None:
        """The next chunk carrying ``marker`` to the server, and every byte after it in both
        directions, is held (as ``blackhole()``) until ``restore()``: the server stops answering
        right before that command."""
        self._stall_marker = marker

    def blackhole(self) -> None:
        """Hold every byte in both directions (connections stay open) until ``restore()``."""
        self._open = anyio.Event()

    def restore(self) -> None:
        self._open.set()

    def reset(self) -> None:
        """Drop every open connection now."""
        for scope in list(self._scopes):
            scope.cancel()

    async def serve(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
        self.port = listener.extra(anyio.abc.SocketAttribute.local_port)
        async with listener, anyio.create_task_group() as tg:
            task_status.started()
            await listener.serve(lambda client: self._pair(client, tg), task_group=tg)

    async def _pair(self, client: SocketStream, tg: TaskGroup) -> None:
        with anyio.CancelScope() as scope:
            self._scopes.add(scope)
            try:
                async with (client, await anyio.connect_tcp("127.0.0.1", self.upstream_port) as server,
                            anyio.create_task_group() as pumps):
                    pumps.start_soon(self._pump, client, server, True, scope)
                    pumps.start_soon(self._pump, server, client, False, scope)
            except (OSError, anyio.BrokenResourceError, anyio.EndOfStream):
                pass
            finally:
                self._scopes.discard(scope)

    async def _pump(self, source: SocketStream, sink: SocketStream, upstream: bool, scope: anyio.CancelScope) -> None:
        with contextlib.suppress(anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            while True:
                chunk = await source.receive()
                if upstream and self._stall_marker is not None and self._stall_marker in chunk:
                    self._stall_marker = None
                    self.blackhole()
                await self._open.wait()
                if self.delay:
                    await anyio.sleep(self.delay)  # the injected latency
                await sink.send(chunk)
                if upstream and self._cut_marker is not None and self._cut_marker in chunk:
                    self.marker_seen += 1
                    if self.cuts == 0:
                        self.cuts += 1
                        scope.cancel()  # both sockets close: the reply is lost
                        return
        scope.cancel()  # one side closed: close the other
