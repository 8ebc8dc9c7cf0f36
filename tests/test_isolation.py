"""Isolated agents: each connects as its own ACL user, confined to its own slot; a forwarder
carries handoffs between them and refuses calls that act as someone else."""

from __future__ import annotations

import os
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import anyio
import pytest
import redis.asyncio as aioredis
from anyio.abc import Process
from anyio.streams.buffered import BufferedByteReceiveStream
from redis.exceptions import NoPermissionError

from handoffbus import CallRefused, HandoffBus, HandoffRequest, HandoffStatus, InvalidRequest, NotPermitted, Worker
from handoffbus.acl import AclUser, agent_user, forwarder_user
from handoffbus.forwarding import Forwarder

from .agents import Echo
from .conftest import new_prefix
from .helpers import ROOT, req, response_statuses

pytestmark = pytest.mark.anyio
AGENTS = ("req", "echo-1", "mallory")


@dataclass
class Setup:
    prefix: str
    forwarder: Forwarder
    trusted: HandoffBus
    buses: dict[str, HandoffBus]


@asynccontextmanager
async def isolated(real_backend: str, servers: dict) -> AsyncIterator[Setup]:
    """ACL users for three agents and the forwarder; a bus per agent, as its own user."""
    server = servers[real_backend]
    prefix = new_prefix()
    users: dict[str, AclUser] = {a: agent_user(prefix, a) for a in AGENTS}
    users["forwarder"] = forwarder_user(prefix)
    admin = aioredis.Redis.from_url(server.url)
    for user in users.values():
        await admin.execute_command(*user.setuser())

    def url(user: AclUser) -> str:
        return f"redis://{user.name}:{user.password}@127.0.0.1:{server.port}/0"

    try:
        async with HandoffBus.connect(url(users["forwarder"]), prefix=prefix, sweep_interval=0.05) as trusted, \
                anyio.create_task_group() as tg:
            forwarder = Forwarder(trusted, AGENTS)
            await tg.start(forwarder.run)
            async with HandoffBus.connect(url(users["req"]), prefix=prefix, isolated="req") as req_bus, \
                    HandoffBus.connect(url(users["echo-1"]), prefix=prefix, isolated="echo-1") as echo_bus, \
                    HandoffBus.connect(url(users["mallory"]), prefix=prefix, isolated="mallory") as mallory_bus:
                yield Setup(prefix, forwarder, trusted, {"req": req_bus, "echo-1": echo_bus, "mallory": mallory_bus})
            tg.cancel_scope.cancel()
    finally:
        for user in users.values():
            await admin.execute_command("ACL", "DELUSER", user.name)
        await admin.aclose()


async def test_a_handoff_between_isolated_agents(real_backend: str, servers: dict) -> None:
    async with isolated(real_backend, servers) as setup:
        client = setup.buses["req"].client("req")
        # the agents' users really are confined: the requester cannot touch the target's queue
        with pytest.raises(NoPermissionError):
            await setup.buses["req"].redis.zcard(setup.buses["req"].keys.target("echo-1").queue)
        handles = [await client.request_handoff(req("req", "echo-1", reason=f"r{i}")) for i in range(20)]
        cancelled = await client.request_handoff(req("req", "nobody-1", reason="never mind"))
        expiring = await client.request_handoff(req("req", "nobody-1", reason="too late", timeout=0.3))
        async with anyio.create_task_group() as tg:
            worker = Worker(setup.buses["echo-1"], Echo())
            await tg.start(worker.run)
            with anyio.fail_after(20):
                outcomes = [await h.outcome() for h in handles]
                late = await expiring.outcome()
            worker.drain()
        gone = await cancelled.cancel()
        queue_left = await setup.trusted.redis.zcard(setup.trusted.keys.target("nobody-1").queue)
        statuses = [await response_statuses(setup.trusted, "req", h.handoff_id) for h in handles]
    assert [o.result["echo"] for o in outcomes] == [f"r{i}" for i in range(20)]
    assert statuses == [["ACCEPTED", "COMPLETED"]] * 20
    assert gone.status is HandoffStatus.CANCELLED and late.status is HandoffStatus.EXPIRED
    assert queue_left == 0  # the cancelled and the expired one were taken out of the queue, by forwarded settles
    assert setup.forwarder.forwarded > 0 and setup.forwarder.refused == 0


async def test_the_forwarder_refuses_calls_that_act_as_someone_else(real_backend: str, servers: dict) -> None:
    async with isolated(real_backend, servers) as setup:
        handle = await setup.buses["req"].client("req").request_handoff(req("req", "echo-1", reason="mine"))
        mallory, keys = setup.buses["mallory"], setup.buses["mallory"].keys
        record = keys.record("req", handle.request_id)
        config = mallory.config
        # accepting while claiming to be the target
        with pytest.raises(CallRefused, match="acting as 'echo-1'"):
            await mallory.script("accept", record.as_list(), [handle.handoff_id, handle.request_id, "echo-1",
                                                              config.retention_ms, config.response_retention_ms])
        # as itself: forwarded, and the script refuses it (the handoff is not addressed to it)
        with pytest.raises(NotPermitted):
            await mallory.client("mallory").accept_handoff(handle.handoff_id)
        # reading the request, or queueing it for itself
        with pytest.raises(CallRefused, match="not addressed to or sent by 'mallory'"):
            await mallory.script("load", [record.record], [])
        with pytest.raises(CallRefused, match="which 'mallory' did not send"):
            await mallory.script("enqueue", keys.target("echo-1").as_list(), [handle.handoff_id, 0, 0])
        # a bus isolated as one agent cannot even make a client for another, nor route
        with pytest.raises(InvalidRequest):
            mallory.client("echo-1")
        with pytest.raises(InvalidRequest, match="routing"):
            await mallory.client("mallory").request_handoff(
                HandoffRequest(from_agent="mallory", to_agent="", capabilities_required=["x"], reason="r"))
        refused = setup.forwarder.refused
        async with anyio.create_task_group() as tg:
            worker = Worker(setup.buses["echo-1"], Echo())
            await tg.start(worker.run)
            with anyio.fail_after(10):
                outcome = await handle.outcome()
            worker.drain()
        statuses = await response_statuses(setup.trusted, "req", handle.handoff_id)
    assert refused == 3
    assert outcome.status is HandoffStatus.COMPLETED and outcome.actor == "echo-1"
    assert statuses == ["ACCEPTED", "COMPLETED"]  # nothing of mallory's reached the requester


async def test_forwarder_and_isolated_worker_processes(real_backend: str, servers: dict) -> None:
    server = servers[real_backend]
    prefix = new_prefix()
    users = {"req": agent_user(prefix, "req"), "echo-1": agent_user(prefix, "echo-1"),
             "forwarder": forwarder_user(prefix)}
    admin = aioredis.Redis.from_url(server.url)
    for user in users.values():
        await admin.execute_command(*user.setuser())

    def url(name: str) -> str:
        return f"redis://{users[name].name}:{users[name].password}@127.0.0.1:{server.port}/0"

    async def start(*argv: str) -> Process:
        process = await anyio.open_process([sys.executable, "-m", "handoffbus", *argv, "--prefix", prefix],
                                           cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        assert process.stdout is not None
        with anyio.fail_after(30):
            assert b"serving" in await BufferedByteReceiveStream(process.stdout).receive_until(b"\n", 4096)
        return process

    processes = []
    try:
        processes.append(await start("forwarder", "req", "echo-1", "--redis-url", url("forwarder")))
        processes.append(await start("worker", "tests.agents:Echo", "--isolated", "--redis-url", url("echo-1")))
        async with HandoffBus.connect(url("req"), prefix=prefix, isolated="req") as bus:
            handles = [await bus.client("req").request_handoff(req("req", "echo-1", reason=f"p{i}"))
                       for i in range(20)]
            with anyio.fail_after(30):
                outcomes = [await h.outcome() for h in handles]
        codes = []
        for process in processes:
            process.terminate()
            with anyio.fail_after(30):
                codes.append(await process.wait())
    finally:
        for process in processes:
            if process.returncode is None:
                process.kill()
                await process.wait()
            await process.aclose()
        for user in users.values():
            await admin.execute_command("ACL", "DELUSER", user.name)
        await admin.aclose()
    assert [o.result["echo"] for o in outcomes] == [f"p{i}" for i in range(20)]
    assert codes == [0, 0]
