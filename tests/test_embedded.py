"""HandoffBus.embedded(): a real throwaway server, stopped by pid, leaving nothing behind."""

from __future__ import annotations

import os

import anyio
import pytest

from handoffbus import EmbeddedServer, HandoffBus, HandoffbusError, HandoffStatus
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
