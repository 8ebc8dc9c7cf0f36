"""ACL users: an agent reaches only its own slot's keys and no administrative command; the
two server facts the design is built around are checked on each server."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
import pytest
import redis
import redis.asyncio as aioredis
from redis.exceptions import NoPermissionError, ResponseError

from handoffbus import HandoffRequest
from handoffbus.acl import AclUser, agent_user, monitor_user

from .conftest import make_bus, new_prefix
from .helpers import ROOT

pytestmark = pytest.mark.anyio

FORBIDDEN = [
    ("FLUSHALL",), ("FLUSHDB",), ("CONFIG", "GET", "*"), ("CONFIG", "SET", "maxmemory", "1"), ("KEYS", "*"),
    ("SCRIPT", "FLUSH"), ("SCRIPT", "KILL"), ("FUNCTION", "FLUSH"), ("FUNCTION", "LIST"), ("FUNCTION", "DELETE", "x"),
    ("FUNCTION", "KILL"), ("EVALSHA", "0" * 40, "0"), ("ACL", "LIST"),
    ("ACL", "SETUSER", "x"), ("SWAPDB", "0", "1"), ("EVAL", "return 1", "0"), ("SCAN", "0"),
]
#: checked with ACL DRYRUN only: run for real they would stop or block the server, or are
#: refused by server settings before the ACL is consulted (DEBUG)
NOT_RUN = [("DEBUG", "SLEEP", "0"), ("SHUTDOWN", "NOSAVE"), ("MONITOR",), ("DEBUG", "RELOAD")]


@asynccontextmanager
async def connected(server_url: str, *users: AclUser) -> AsyncIterator[list[aioredis.Redis]]:
    """Create ``users`` on the server, and a connection as each."""
    admin = aioredis.Redis.from_url(server_url)
    for user in users:
        await admin.execute_command(*user.setuser())
    path = server_url.removeprefix("unix://")
    clients = [aioredis.Redis(unix_socket_path=path, username=u.name, password=u.password) for u in users]
    try:
        yield clients
    finally:
        for client in clients:
            await client.aclose()
        for user in users:
            await admin.execute_command("ACL", "DELUSER", user.name)
        await admin.aclose()


async def assert_dryrun_refused(admin: aioredis.Redis, user: AclUser, *command: str) -> None:
    verdict = await admin.execute_command("ACL", "DRYRUN", user.name, *command)
    assert b"no permissions" in verdict, (command, verdict)


async def assert_noperm(client: aioredis.Redis, *command: str | int) -> None:
    with pytest.raises((NoPermissionError, ResponseError)) as caught:
        await client.execute_command(*command)
    assert "NOPERM" in str(caught.value) or "permission" in str(caught.value).lower(), caught.value


async def test_an_agent_reaches_only_its_own_keys(real_backend: str, servers: dict) -> None:
    prefix = new_prefix()
    own, peer = f"{prefix}:{{alpha}}", f"{prefix}:{{beta}}"
    users = [agent_user(prefix, "alpha"), agent_user(prefix, "beta")]
    admin = aioredis.Redis.from_url(servers[real_backend].url)
    async with connected(servers[real_backend].url, *users) as (alpha, beta), contextlib.aclosing(admin):
        # its own slot: streams, groups, hashes, sorted sets, scripts on its own keys
        await alpha.xgroup_create(f"{own}:inbox", "workers", id="$", mkstream=True)
        await alpha.xadd(f"{own}:inbox", {"h": "x"})
        assert len((await alpha.xreadgroup("workers", "c1", {f"{own}:inbox": ">"}))[0][1]) == 1
        await alpha.hset(f"{own}:h:r1", "status", "PENDING")
        await alpha.zadd(f"{own}:queue", {"x": 1})
        # functions the forwarder loaded (an agent may load none: one that loops would stall the server)
        await assert_noperm(alpha, "FUNCTION", "LOAD", f"#!lua name={prefix}_own\n"
                            f"redis.register_function('{prefix}_own', function() return 1 end)")
        await assert_noperm(alpha, "SCRIPT", "LOAD", "return 1")
        hget, delete = f"{prefix}_hget", f"{prefix}_del"
        await admin.function_load(
            f"#!lua name={prefix}_acl\n"
            f"redis.register_function('{hget}', function(keys) return redis.call('HGET', keys[1], 'status') end)\n"
            f"redis.register_function('{delete}', function(keys, args) return redis.call('DEL', args[1]) end)\n")
        assert await alpha.fcall(hget, 1, f"{own}:h:r1") == b"PENDING"
        await beta.xgroup_create(f"{peer}:inbox", "workers", id="$", mkstream=True)
        await beta.xadd(f"{peer}:inbox", {"h": "y"})
        # a peer's keys: no read (XREADGROUP would steal its handoffs), no write (MAXLEN 0 would wipe them)
        for command in [("XREADGROUP", "GROUP", "workers", "thief", "STREAMS", f"{peer}:inbox", ">"),
                        ("XRANGE", f"{peer}:inbox", "-", "+"), ("XADD", f"{peer}:inbox", "MAXLEN", "0", "*", "h", "z"),
                        ("XACK", f"{peer}:inbox", "workers", "0-1"), ("HGETALL", f"{peer}:h:r1"),
                        ("ZADD", f"{peer}:queue", "1", "x"), ("DEL", f"{peer}:inbox"),
                        ("FCALL", hget, "1", f"{peer}:h:r1")]:
            await assert_noperm(alpha, *command)
        # nor through a function that names the key only in its arguments
        with pytest.raises(ResponseError, match=r"(?i)noperm|permission|acl|can.t access"):
            await alpha.fcall(delete, 0, f"{peer}:inbox")
        for command in FORBIDDEN:
            await assert_noperm(alpha, *command)
        for command in NOT_RUN:
            await assert_dryrun_refused(admin, users[0], *command)
        assert await admin.execute_command("ACL", "DRYRUN", users[0].name, "HGET", f"{own}:h:r1", "x") == b"OK"
        assert await beta.xlen(f"{peer}:inbox") == 1  # untouched


async def test_the_monitor_user_only_reads(real_backend: str, servers: dict) -> None:
    prefix = new_prefix()
    async with connected(servers[real_backend].url, agent_user(prefix, "alpha"), monitor_user(prefix)) as (
            alpha, monitor):
        await alpha.hset(f"{prefix}:{{alpha}}:h:r1", "status", "PENDING")
        assert await monitor.hgetall(f"{prefix}:{{alpha}}:h:r1") == {b"status": b"PENDING"}
        await assert_noperm(monitor, "HSET", f"{prefix}:{{alpha}}:h:r1", "status", "DONE")
        await assert_noperm(monitor, "XREADGROUP", "GROUP", "g", "c", "STREAMS", f"{prefix}:{{alpha}}:inbox", ">")
        for command in FORBIDDEN[:-1]:  # SCAN is a monitor's
            await assert_noperm(monitor, *command)


async def test_why_agents_never_get_a_grant_on_a_peers_stream(real_backend: str, servers: dict) -> None:
    """The two server facts the ACL design is built around."""
    prefix = new_prefix()
    peer = f"{prefix}:{{beta}}:inbox"
    reader = AclUser(f"{prefix}-reader", ["resetkeys", f"%R~{prefix}:{{beta}}:*", "-@all", "+xreadgroup", "+hello"])
    writer = AclUser(f"{prefix}-writer", ["resetkeys", f"%W~{prefix}:{{beta}}:*", "-@all", "+xadd", "+hello"])
    async with connected(servers[real_backend].url, reader, writer, agent_user(prefix, "beta")) as (
            as_reader, as_writer, beta):
        await beta.xgroup_create(peer, "workers", id="$", mkstream=True)
        await beta.xadd(peer, {"h": "y"})
        # 1. XREADGROUP needs only read permission: a read-only grant takes the peer's entry
        taken = await as_reader.xreadgroup("workers", "thief", {peer: ">"})
        assert taken[0][1][0][1] == {b"h": b"y"}
        assert (await beta.xpending(peer, "workers"))["consumers"] == [{"name": b"thief", "pending": 1}]
        # 2. a write-only XADD grant empties the peer's stream
        await as_writer.xadd(peer, {"h": "z"}, maxlen=0, approximate=False)
        assert await beta.xlen(peer) == 0


def test_the_acl_command_prints_a_user_per_agent_plus_forwarder_and_monitor() -> None:
    done = subprocess.run([sys.executable, "-m", "handoffbus", "acl", "alpha", "beta", "--prefix", "app"],
                          cwd=ROOT, capture_output=True, text=True, check=True)
    lines = done.stdout.splitlines()
    assert [line.split()[2] for line in lines] == ["app-agent-alpha", "app-agent-beta", "app-forwarder", "app-monitor"]
    assert "~app:{alpha}:*" in lines[0].split() and "~app:*" in lines[2].split() and "%R~app:*" in lines[3].split()
    assert all(line.startswith("ACL SETUSER ") and " -@all " in line for line in lines)
    bad = subprocess.run([sys.executable, "-m", "handoffbus", "acl", "bad{id}"], cwd=ROOT, capture_output=True,
                         text=True)
    assert bad.returncode == 2 and "invalid agent id" in bad.stderr


def test_the_cli_runs_read_commands_as_the_monitor_user(servers: dict) -> None:
    """`status` and `pending` work as the monitor user; a write says the ACL refused it, no traceback."""
    prefix = new_prefix()
    user = monitor_user(prefix)
    name = next(iter(servers))
    server = servers[name]
    admin = redis.Redis(unix_socket_path=server.url.removeprefix("unix://"))
    admin.execute_command(*user.setuser())
    try:
        async def request() -> str:
            async with make_bus(name, servers, prefix=prefix) as bus:
                handle = await bus.client("alice").request_handoff(
                    HandoffRequest(from_agent="alice", to_agent="bob", reason="look"))
                return handle.handoff_id

        hid = anyio.run(request)
        url = f"unix://{user.name}:{user.password}@{server.url.removeprefix('unix://')}"
        base = [sys.executable, "-m", "handoffbus", "--redis-url", url, "--prefix", prefix]
        status = subprocess.run([*base, "status", hid], cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert status.returncode == 0 and "PENDING" in status.stdout, status.stderr
        pending = subprocess.run([*base, "pending", "bob", "--json"], cwd=ROOT, capture_output=True, text=True,
                                 timeout=60)
        assert pending.returncode == 0 and f'"{hid}"' in pending.stdout, pending.stderr
        write = subprocess.run([*base, "request", "bob", "--from", "carol"], cwd=ROOT, capture_output=True,
                               text=True, timeout=60)
        assert write.returncode == 1 and "ACL refused" in write.stderr and "Traceback" not in write.stderr
    finally:
        admin.execute_command("ACL", "DELUSER", user.name)
        admin.close()
