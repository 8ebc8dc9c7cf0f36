"""HandoffBus.embedded(): a real throwaway server, stopped by pid, leaving nothing behind."""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator

import anyio
import pytest
import redis
import redis.asyncio as aioredis

from handoffbus import EmbeddedCluster, EmbeddedServer, HandoffBus, HandoffbusError, HandoffStatus
from handoffbus.embedded import find_server_binary

from .helpers import req

pytestmark = pytest.mark.anyio


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def test_embedded_bus_starts_a_real_server_and_stops_it() -> None:
    bus = HandoffBus.embedded()
    async with bus:
        server = bus._server
        assert server is not None and server.process is not None
        pid, directory = server.process.pid, server.directory
        info = await bus.redis.info("server")
        assert int(info["redis_version"].split(".")[0]) >= 7
        assert (await bus.redis.config_get("bind"))["bind"] == "127.0.0.1"
        handle = await bus.client("a").request_handoff(req("a", "b"))
        await bus.client("b").accept_handoff(handle.handoff_id)
        assert (await handle.decision()).status is HandoffStatus.ACCEPTED
    assert not alive(pid)
    assert directory is not None and not directory.exists()


async def test_server_binary_choice_can_be_forced(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HANDOFFBUS_REDIS_SERVER", "/nonexistent/redis-server")
    assert find_server_binary() == "/nonexistent/redis-server"
    monkeypatch.delenv("HANDOFFBUS_REDIS_SERVER")
    assert os.access(find_server_binary(), os.X_OK)


async def test_a_server_that_cannot_start_is_reported_and_cleaned_up() -> None:
    server = EmbeddedServer(extra_args=("--no-such-option", "1"))
    with pytest.raises(Exception, match="exited"):
        async with server:
            pass
    assert server.process is None and server.directory is not None and not server.directory.exists()


async def test_a_server_that_requires_a_password_is_ready_once_it_answers() -> None:
    # a server started to try out authentication answers PING with -NOAUTH: it is up all the same
    with anyio.fail_after(10):
        async with EmbeddedServer(extra_args=("--requirepass", "s3cret-pw")) as server, \
                HandoffBus.connect(f"redis://:s3cret-pw@127.0.0.1:{server.port}/0") as bus:
            assert await bus.redis.ping()


async def test_a_server_that_never_answers_is_a_handoffbus_error_and_is_stopped(
    monkeypatch: pytest.MonkeyPatch, tmp_path: object
) -> None:
    # its socket moved elsewhere by extra_args: the wait ended in a bare TimeoutError
    import handoffbus.embedded as embedded

    monkeypatch.setattr(embedded, "READY_WAIT", 0.5)
    server = EmbeddedServer(extra_args=("--unixsocket", f"{tmp_path}/elsewhere.sock"))
    with pytest.raises(HandoffbusError, match=r"did not answer within 0\.5 s"):
        async with server:
            pass
    assert server.process is None and server.directory is not None and not server.directory.exists()


@contextlib.contextmanager
def taken_port() -> Iterator[int]:
    """A loopback port another process holds (a listening socket of this one)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        yield int(held.getsockname()[1])


def picks_first(monkeypatch: pytest.MonkeyPatch, port: int) -> list[int]:
    """Make the next port picked for a server ``port``, as if something bound it between the
    pick and the server's own bind; the ports picked after it are free ones. What was picked."""
    import handoffbus.embedded as embedded

    picked: list[int] = []
    real = embedded._free_port

    def pick() -> int:
        picked.append(port if not picked else real())
        return picked[-1]

    monkeypatch.setattr(embedded, "_free_port", pick)
    return picked


async def test_a_server_whose_picked_port_was_taken_starts_on_another(monkeypatch: pytest.MonkeyPatch) -> None:
    with taken_port() as port:
        picked = picks_first(monkeypatch, port)
        with anyio.fail_after(15):
            async with EmbeddedServer() as server:
                assert picked[0] == port and server.port not in (0, port)
                assert await server_answers_on(server.port)


async def test_a_port_the_caller_gave_is_never_changed(monkeypatch: pytest.MonkeyPatch) -> None:
    with taken_port() as port:
        server = EmbeddedServer(port=port)
        with pytest.raises(HandoffbusError, match="Address already in use"):
            async with server:
                pass
        assert server.port == port and server.process is None


def test_a_cluster_node_whose_picked_bus_port_was_taken_joins_on_another(monkeypatch: pytest.MonkeyPatch) -> None:
    # the first pick is the first node's bus port (its client port is picked in start())
    with taken_port() as port:
        picked = picks_first(monkeypatch, port)
        cluster = EmbeddedCluster(primaries=2)
        try:
            cluster.start()
            assert picked[0] == port and port not in {n.bus_port for n in cluster.nodes}
            with redis.Redis(unix_socket_path=str(cluster.nodes[0].socket_path)) as client:
                info = client.execute_command("CLUSTER", "INFO").decode()
            assert "cluster_state:ok" in info and "cluster_known_nodes:2" in info
        finally:
            cluster.stop()


async def server_answers_on(port: int) -> bool:
    client = aioredis.Redis(host="127.0.0.1", port=port)
    try:
        return bool(await client.ping())
    finally:
        await client.aclose()
