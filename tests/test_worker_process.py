"""`handoffbus worker` as a real process: serving, draining on SIGTERM, usage errors."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import anyio
import pytest

from handoffbus import HandoffStatus

from .agents import Echo
from .conftest import make_bus
from .helpers import req, response_statuses, serve_until_done

pytestmark = pytest.mark.anyio
ROOT = Path(__file__).resolve().parent.parent


async def test_sigterm_drains_and_nothing_is_lost(real_backend: str, servers: dict) -> None:
    bus = make_bus(real_backend, servers)
    url, prefix = servers[real_backend].url, bus.config.prefix
    process = await anyio.open_process(
        [sys.executable, "-m", "handoffbus", "worker", "tests.agents:SlowEcho", "--redis-url", url,
         "--prefix", prefix, "--concurrency", "4"],
        cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    async with bus:
        assert process.stdout is not None
        with anyio.fail_after(30):
            banner = await process.stdout.receive()  # "worker <name> serving echo-1"
        assert b"serving echo-1" in banner
        client = bus.client("req")
        handles = [await client.request_handoff(req("req", "echo-1", reason=f"r{i}")) for i in range(20)]
        with anyio.fail_after(30):
            first = await handles[0].decision()  # the process is working now
        assert first.status is HandoffStatus.ACCEPTED
        process.send_signal(signal.SIGTERM)
        with anyio.fail_after(30):
            code = await process.wait()
        assert code == 0
        # what the process did not take is still queued; another worker finishes it
        outcomes, _ = await serve_until_done(bus, Echo(), handles, concurrency=8)
        assert all(o.status is HandoffStatus.COMPLETED for o in outcomes)
        for handle in handles:
            assert await response_statuses(bus, "req", handle.handoff_id) == ["ACCEPTED", "COMPLETED"]
        pending = await bus.redis.xpending(bus.keys.target("echo-1").inbox, "workers")
        assert pending["pending"] == 0


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "HANDOFFBUS_REDIS_URL")}
    return subprocess.run([sys.executable, "-m", "handoffbus", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=60, env={**clean, **(env or {})}, check=False)


def test_worker_usage_errors_exit_2() -> None:
    no_url = run_cli("worker", "tests.agents:Echo")
    assert no_url.returncode == 2 and "needs a server" in no_url.stderr
    missing = run_cli("worker", "tests.agents:Nope", env={"REDIS_URL": "redis://127.0.0.1:1/0"})
    assert missing.returncode == 2 and "cannot load" in missing.stderr
    not_agent = run_cli("worker", "tests.helpers:req", env={"REDIS_URL": "redis://127.0.0.1:1/0"})
    assert not_agent.returncode == 2 and "not an Agent subclass" in not_agent.stderr


async def test_worker_serves_from_the_environment_url(real_backend: str, servers: dict) -> None:
    async with make_bus(real_backend, servers) as bus:
        env = {**os.environ, "HANDOFFBUS_REDIS_URL": servers[real_backend].url, "PYTHONUNBUFFERED": "1"}
        process = await anyio.open_process(
            [sys.executable, "-m", "handoffbus", "worker", "tests.agents:Echo", "--prefix", bus.config.prefix],
            cwd=ROOT, env=env,
        )
        try:
            handle = await bus.client("req").request_handoff(req("req", "echo-1", reason="env"))
            with anyio.fail_after(30):
                assert (await handle.outcome()).result == {"echo": "env", "messages": 0, "attempt": 1}
        finally:
            process.send_signal(signal.SIGINT)
            with anyio.fail_after(30):
                assert await process.wait() == 0


async def test_one_process_serves_several_agents(real_backend: str, servers: dict) -> None:
    async with make_bus(real_backend, servers) as bus:
        process = await anyio.open_process(
            [sys.executable, "-m", "handoffbus", "worker", "tests.agents:Echo", "tests.agents:SyncEcho",
             "--redis-url", servers[real_backend].url, "--prefix", bus.config.prefix],
            cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        try:
            client = bus.client("req")
            echo = await client.request_handoff(req("req", "echo-1", reason="one"))
            shout = await client.request_handoff(req("req", "sync-1", reason="two"))
            with anyio.fail_after(30):
                assert (await echo.outcome()).result == {"echo": "one", "messages": 0, "attempt": 1}
                assert (await shout.outcome()).result == "TWO"
            assert [a.agent_id for a in await client.list_agents()] == ["echo-1", "sync-1"]
        finally:
            process.send_signal(signal.SIGTERM)
            with anyio.fail_after(30):
                assert await process.wait() == 0
            await process.aclose()


async def test_a_second_sigterm_ends_a_worker_whose_plain_hook_blocks(servers: dict) -> None:
    """The hook's thread never returns: the process still exits, as a second signal promises,
    and the handoff stays ACCEPTED under its lease, to be reclaimed."""
    bus = make_bus("valkey", servers)
    process = await anyio.open_process(
        [sys.executable, "-m", "handoffbus", "worker", "tests.agents:BlockingSync", "--redis-url",
         servers["valkey"].url, "--prefix", bus.config.prefix, "--grace", "0.1"],
        cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        async with bus:
            handle = await bus.client("req").request_handoff(req("req", "blocking-sync-1"))
            assert process.stdout is not None
            seen = b""
            with anyio.fail_after(30):
                while b"working on" not in seen:  # the banner, then the hook's own line
                    seen += await process.stdout.receive()
            process.send_signal(signal.SIGTERM)
            process.send_signal(signal.SIGTERM)
            with anyio.fail_after(30):
                code = await process.wait()
            assert code == 0
            record = await handle.status()
            assert record is not None and record.status is HandoffStatus.ACCEPTED
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


@pytest.mark.parametrize("server", ["valkey"])  # the process's own start, whatever the server
async def test_a_sigterm_as_soon_as_it_says_it_serves_drains(server: str, servers: dict) -> None:
    """"serving" is what a supervisor waits for: from then on a SIGTERM drains (exit 0, its
    drained line), never kills the process undrained."""
    from .helpers import start_worker

    for _ in range(3):
        process, lines = await start_worker(servers[server].url, "sigterm-at-once", "tests.agents:Echo")
        process.send_signal(signal.SIGTERM)  # at once: the line was just read
        with anyio.fail_after(30):
            assert await process.wait() == 0
            assert b"drained" in await lines.receive_until(b"\n", 4096)
        await process.aclose()
