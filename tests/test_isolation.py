"""Isolated agents: each connects as its own ACL user, confined to its own slot; a forwarder
carries handoffs between them and refuses calls that act as someone else."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.lowlevel
import msgspec
import pytest
import redis.asyncio as aioredis
from anyio.abc import Process
from anyio.streams.buffered import BufferedByteReceiveStream
from redis.exceptions import NoPermissionError

from handoffbus import (
    CallRefused,
    HandoffBus,
    HandoffContext,
    HandoffHandle,
    HandoffRequest,
    HandoffStatus,
    InvalidRequest,
    Keyring,
    NotPermitted,
    QueueFull,
    SigningKey,
    TooManyPending,
    Worker,
    forwarding,
    serialize_context,
)
from handoffbus.acl import AclUser, agent_user, forwarder_user
from handoffbus.backoff import lost_connection
from handoffbus.errors import HandoffbusError
from handoffbus.forwarding import Forwarder
from handoffbus.policies.blobs import offload, restore
from handoffbus.routing import set_id
from handoffbus.workers import Accept, Agent, ReceivedHandoff, Reject
from handoffbus.workers.routes import RouteFeed

from .agents import Echo, ReadsReport
from .conftest import new_prefix
from .helpers import LARGE, ROOT, req, response_statuses, serve_until_done

pytestmark = pytest.mark.anyio
AGENTS = ("req", "echo-1", "mallory")


@dataclass
class Setup:
    prefix: str
    forwarder: Forwarder
    trusted: HandoffBus
    buses: dict[str, HandoffBus]


@asynccontextmanager
async def isolated(real_backend: str, servers: dict, agents: tuple[str, ...] = AGENTS,
                   forwarder_connections: int | None = None,
                   grants: dict[str, list[str]] | None = None, **settings: Any) -> AsyncIterator[Setup]:
    """ACL users for the agents and the forwarder; a bus per agent, as its own user."""
    server = servers[real_backend]
    prefix = new_prefix()
    users: dict[str, AclUser] = {a: agent_user(prefix, a) for a in agents}
    users["forwarder"] = forwarder_user(prefix)
    admin = aioredis.Redis.from_url(server.url)
    for user in users.values():
        await admin.execute_command(*user.setuser())

    def url(user: AclUser) -> str:
        return f"redis://{user.name}:{user.password}@127.0.0.1:{server.port}/0"

    try:
        async with HandoffBus.connect(url(users["forwarder"]), prefix=prefix, sweep_interval=0.05,
                                      max_connections=forwarder_connections) as trusted, \
                anyio.create_task_group() as tg:
            forwarder = Forwarder(trusted, agents, grants=grants)
            await tg.start(forwarder.run)
            async with contextlib.AsyncExitStack() as stack:
                buses = {a: await stack.enter_async_context(
                    HandoffBus.connect(url(users[a]), prefix=prefix, isolated=a, **settings)) for a in agents}
                yield Setup(prefix, forwarder, trusted, buses)
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
        # the first with a large context: an isolated worker's load brings its envelope through the forwarder
        handles = [await client.request_handoff(req("req", "echo-1", reason=f"r{i}",
                                                    context_snapshot=LARGE if i == 0 else None)) for i in range(20)]
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
        await setup.buses["echo-1"].stats.flush()  # as its own user: its ACL allows what count runs
        counted = await setup.trusted.redis.hmget(setup.trusted.keys.stats("echo-1"), "ACCEPTED", "COMPLETED")
    assert [o.result["echo"] for o in outcomes] == [f"r{i}" for i in range(20)]
    assert [o.result["messages"] for o in outcomes] == [8] + [0] * 19
    assert counted == [b"20", b"20"]
    assert statuses == [["ACCEPTED", "COMPLETED"]] * 20
    assert gone.status is HandoffStatus.CANCELLED and late.status is HandoffStatus.EXPIRED
    assert queue_left == 0  # the cancelled and the expired one were taken out of the queue, by forwarded settles
    assert setup.forwarder.forwarded > 0 and setup.forwarder.refused == 0


async def test_a_forwarder_serves_more_agents_than_its_pool_has_connections(real_backend: str, servers: dict) -> None:
    """The forwarder blocks on every served agent's outbox: with more agents than its bus's pool
    has connections, the calls it runs for them must not wait for a read to time out."""
    requesters = tuple(f"req{i}" for i in range(5))
    async with isolated(real_backend, servers, ("echo-1", *requesters), forwarder_connections=4) as setup, \
            anyio.create_task_group() as tg:
        worker = Worker(setup.buses["echo-1"], Echo())
        await tg.start(worker.run)
        with anyio.fail_after(20):
            for name in requesters:
                handle = await setup.buses[name].client(name).request_handoff(req(name, "echo-1"))
                assert (await handle.outcome()).status is HandoffStatus.COMPLETED
        worker.drain()


async def test_isolated_agents_carry_on_after_the_library_is_flushed(real_backend: str, servers: dict) -> None:
    """An agent's user may not load functions (one that loops would stall the server): after the
    server loses the library, its calls wait for the forwarder to load it again, and carry on."""
    admin = aioredis.Redis.from_url(servers[real_backend].url)
    async with contextlib.aclosing(admin), isolated(real_backend, servers) as setup, \
            anyio.create_task_group() as tg:
        worker = Worker(setup.buses["echo-1"], Echo())
        await tg.start(worker.run)
        client = setup.buses["req"].client("req")
        with anyio.fail_after(30):
            first = await (await client.request_handoff(req("req", "echo-1"))).outcome()
            await admin.function_flush()
            second = await (await client.request_handoff(req("req", "echo-1"))).outcome()
        worker.drain()
    assert first.status is second.status is HandoffStatus.COMPLETED


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
            await mallory.script("load", [record.record, record.envelope], [])
        # nor behind a handoff it may read: the script reads every pair of keys it is given, the
        # forwarder lets one through a call
        mine = await setup.buses["req"].client("req").request_handoff(req("req", "mallory", reason="for m"))
        own = keys.record("req", mine.request_id)
        assert (await mallory.script("load", [own.record, own.envelope], []))[0] == b"PENDING"
        with pytest.raises(CallRefused, match="malformed load"):
            await mallory.script("load", [own.record, own.envelope, record.record, record.envelope], [])
        with pytest.raises(CallRefused, match="which 'mallory' did not send"):
            await mallory.script("enqueue", keys.target("echo-1").as_list(), [handle.handoff_id, 0, 0])
        # a bus isolated as one agent cannot even make a client for another, nor route
        with pytest.raises(InvalidRequest):
            mallory.client("echo-1")
        with pytest.raises(InvalidRequest, match="fail_fast"):
            await mallory.client("mallory").request_handoff(
                HandoffRequest(from_agent="mallory", to_agent="", capabilities_required=["x"], reason="r"),
                fail_fast=True)
        # pulling routed work from a set it does not serve (the set exists: req routed to it)
        await setup.buses["req"].client("req").request_handoff(
            HandoffRequest(from_agent="req", to_agent="", capabilities_required=["x"], reason="r"))
        assert await setup.trusted.redis.hget(keys.routes, set_id("x")) == b"x"
        with pytest.raises(CallRefused, match="does not serve"):
            await mallory.script("pull", keys.route(set_id("x")).as_list(), ["mallory", 1, 10_000, 64])
        refused = setup.forwarder.refused
        async with anyio.create_task_group() as tg:
            worker = Worker(setup.buses["echo-1"], Echo())
            await tg.start(worker.run)
            with anyio.fail_after(10):
                outcome = await handle.outcome()
            worker.drain()
        statuses = await response_statuses(setup.trusted, "req", handle.handoff_id)
    assert refused == 5
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
            with anyio.move_on_after(30):
                codes.append(await process.wait())
            if process.returncode is None:  # say which one did not stop, and what it said
                process.kill()
                await process.wait()
                assert process.stderr is not None
                said = (await process.stderr.receive(65536)).decode(errors="replace")
                pytest.fail(f"{process} did not exit within 30 s of SIGTERM; its stderr:\n{said[-3000:]}")
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


class Capable(Agent):
    """An isolated agent with capability x: refuses when told to, else completes."""

    capabilities = ["x"]

    def __init__(self, agent_id: str, refuse: bool) -> None:
        super().__init__()
        self.agent_id = agent_id  # type: ignore[misc]
        self.refuse = refuse

    async def on_handoff_request(self, request: HandoffRequest) -> Accept | Reject:
        return Reject(reason="not me", code="NOPE") if self.refuse else Accept()

    async def on_handoff_received(self, handoff: ReceivedHandoff) -> Any:
        return self.agent_id


async def test_routed_handoffs_between_isolated_agents(real_backend: str, servers: dict) -> None:
    async with isolated(real_backend, servers, ("req", "spec-a", "spec-b")) as setup:
        client = setup.buses["req"].client("req")
        routed_request = HandoffRequest(from_agent="req", to_agent="", capabilities_required=["x"], reason="r")
        refusing, accepting = Capable("spec-a", refuse=True), Capable("spec-b", refuse=False)
        async with anyio.create_task_group() as tg:
            first = Worker(setup.buses["spec-a"], refusing)
            await tg.start(first.run)
            # spec-a alone: it refuses, and nobody else can take it
            lonely = await client.request_handoff(routed_request)
            with anyio.fail_after(10):
                rejected = await lonely.outcome()
            second = Worker(setup.buses["spec-b"], accepting)
            await tg.start(second.run)
            handles = [await client.request_handoff(routed_request) for _ in range(10)]
            with anyio.fail_after(20):
                outcomes = [await h.outcome() for h in handles]
            first.drain()
            second.drain()
        chains = [[(s.agent, s.event) for s in (await h.status()).route] for h in handles]  # type: ignore[union-attr]
    assert rejected.status is HandoffStatus.REJECTED and rejected.rejection_code == "NO_CAPABLE_AGENT"
    assert [o.result for o in outcomes] == ["spec-b"] * 10
    for chain in chains:  # offered to spec-a first or not, spec-b completes it; nobody is offered it twice
        assert chain[-1] == ("spec-b", "OFFERED") and chain[:-1] in ([], [("spec-a", "OFFERED"), ("spec-a", "REFUSED")])
    assert setup.forwarder.refused == 0


async def test_an_isolated_workers_stop_releases_a_routed_handoff_through_the_forwarder(
    real_backend: str, servers: dict
) -> None:
    """A stopping worker gives back an undecided routed handoff to its set: an isolated
    agent's release goes through the forwarder, which sends it on, as it does a refusal."""

    class Stuck(Capable):
        def __init__(self) -> None:
            super().__init__("spec-a", refuse=False)
            self.holding = anyio.Event()

        async def on_handoff_request(self, request: HandoffRequest) -> Accept | Reject:
            self.holding.set()
            await anyio.sleep_forever()
            raise AssertionError("unreachable")

    async with isolated(real_backend, servers, ("req", "spec-a", "spec-b")) as setup:
        client = setup.buses["req"].client("req")
        handle = await client.request_handoff(
            HandoffRequest(from_agent="req", to_agent="", capabilities_required=["x"], reason="r", timeout=60))
        stuck = Stuck()
        async with anyio.create_task_group() as tg:
            worker = Worker(setup.buses["spec-a"], stuck, grace=0.05)
            await tg.start(worker.run)
            with anyio.fail_after(10):
                await stuck.holding.wait()
            worker.drain()
        async with anyio.create_task_group() as tg:
            other = Worker(setup.buses["spec-b"], Capable("spec-b", refuse=False))
            await tg.start(other.run)
            with anyio.fail_after(10):  # well within the offer time (30 s)
                outcome = await handle.outcome()
            other.drain()
        record = await handle.status()
    assert outcome.result == "spec-b"
    assert record is not None and [(s.agent, s.event) for s in record.route] == [
        ("spec-a", "OFFERED"), ("spec-a", "RELEASED"), ("spec-b", "OFFERED")]
    assert setup.forwarder.refused == 0


async def test_a_forwarder_with_grants_routes_only_granted_capabilities(real_backend: str, servers: dict) -> None:
    """An agent's workers register what it claims to do; with grants, the forwarder believes a
    claim only if the operator granted it. mallory claims x, only spec-b was granted it: mallory
    is not offered one routed handoff, and its pulls from x's set are refused."""
    async with isolated(real_backend, servers, ("req", "spec-b", "mallory"), grants={"spec-b": ["x"]}) as setup:
        client = setup.buses["req"].client("req")
        routed_request = HandoffRequest(from_agent="req", to_agent="", capabilities_required=["x"], reason="r")
        async with anyio.create_task_group() as tg:
            claimer, granted = Worker(setup.buses["mallory"], Capable("mallory", refuse=False)), \
                Worker(setup.buses["spec-b"], Capable("spec-b", refuse=False))
            await tg.start(claimer.run)
            await tg.start(granted.run)
            live = {a.agent_id: a.capabilities for a in await setup.trusted.router.directory.of(["mallory", "spec-b"])}
            handles = [await client.request_handoff(routed_request) for _ in range(10)]
            with anyio.fail_after(20):
                outcomes = [await h.outcome() for h in handles]
            claimer.drain()
            granted.drain()
        chains = [[s.agent for s in (await h.status()).route] for h in handles]  # type: ignore[union-attr]
        pull = ("pull", setup.trusted.keys.route(set_id("x")).as_list(), ["mallory", 1, 5000, 16])
        [refused] = await setup.buses["mallory"].scripts_many([pull])
        # nor may it take one whose id it learned (a ring, a guess): the offer is refused too
        waiting = await client.request_handoff(routed_request)
        [offer] = await setup.buses["mallory"].scripts_many([setup.buses["mallory"].router.assign_call(
            waiting.handoff_id, "mallory", 0)])
        record = await waiting.status()
        # a worker of mallory's asks the forwarder once, then leaves the set alone for a while
        feed = RouteFeed(setup.buses["mallory"], "mallory", ["x"], "mallory-w")
        await feed.refresh()
        assert await feed.pull(4) == []
        asked = setup.forwarder.refused
        assert await feed.pull(4) == [] and setup.forwarder.refused == asked
    assert live == {"mallory": [], "spec-b": ["x"]}
    assert isinstance(refused, CallRefused) and "does not serve" in str(refused)
    assert isinstance(offer, CallRefused) and "does not serve" in str(offer)
    assert record is not None and record.status is HandoffStatus.PENDING and "mallory" not in [
        step.agent for step in record.route]
    assert [o.result for o in outcomes] == ["spec-b"] * 10
    assert all(set(chain) == {"spec-b"} for chain in chains)


async def test_isolated_agents_with_signed_handoffs(real_backend: str, servers: dict) -> None:
    """Signatures and isolation together: the worker checks the request it read through the
    forwarder, the requester the responses the forwarder wrote for the worker."""
    ring = Keyring([SigningKey(key_id=f"k-{a}", agent=a, secret=os.urandom(32)) for a in ("req", "echo-1")])
    async with isolated(real_backend, servers, ("req", "echo-1")) as setup:
        for bus in setup.buses.values():
            bus.keyring = ring
        handle = await setup.buses["req"].client("req").request_handoff(req("req", "echo-1", reason="signed"))
        async with anyio.create_task_group() as tg:
            worker = Worker(setup.buses["echo-1"], Echo())
            await tg.start(worker.run)
            with anyio.fail_after(10):
                outcome = await handle.outcome()
            worker.drain()
        record = await setup.buses["req"].client("req").get_handoff_status(handle.handoff_id)
    assert outcome.status is HandoffStatus.COMPLETED and outcome.result["echo"] == "signed"
    assert record is not None and record.status is HandoffStatus.COMPLETED  # its signed outcome verified on read


async def test_mallory_cannot_reach_other_agents_handoffs_through_what_it_writes(
    real_backend: str, servers: dict
) -> None:
    async with isolated(real_backend, servers) as setup:
        trusted, mallory = setup.trusted, setup.buses["mallory"]
        victim = await setup.buses["req"].client("req").request_handoff(req("req", "echo-1", reason="real"))
        mine = await setup.buses["req"].client("req").request_handoff(req("req", "mallory", reason="for m"))
        keys = trusted.keys.record("req", mine.request_id)
        # 1. a transition may write only its own fields: not another handoff's id (which would
        # send mallory's response in the victim's name), nor status, to, fp or hist
        with pytest.raises((InvalidRequest, CallRefused)):
            await mallory.client("mallory")._transition("accept", mine.handoff_id, {"id": victim.handoff_id})
        assert await trusted.redis.hget(keys.record, "id") == mine.handoff_id.encode()
        # 2. the retention times are the bus's: a reject asking for 0 ms keeps the record and the
        # requester's response stream (other handoffs' responses are in it)
        before = await trusted.redis.xlen(trusted.keys.responses("req"))
        reply = await mallory.script("reject", keys.as_list(), [mine.handoff_id, mine.request_id, "mallory", -1, 0,
                                                                "reason", "no"])
        assert int(reply[0]) == 1 and await trusted.redis.exists(keys.record)
        assert await trusted.redis.xlen(trusted.keys.responses("req")) == before + 1
        # 3. a record in its own slot naming another requester's handoff: the sweep neither
        # settles the victim out of echo-1's queue nor routes it
        forged = f"{mallory.keys.slot('mallory')}h:x"
        await mallory.redis.hset(forged, mapping={"id": victim.handoff_id, "status": "PENDING", "to": "echo-1",
                                                  "hist": "[]"})
        await mallory.redis.zadd(mallory.keys.deadlines("mallory"), {"x": 1})
        await trusted.redis.sadd(trusted.keys.requesters, "mallory")
        passes = trusted.sweeper.passes
        with anyio.fail_after(10):
            while trusted.sweeper.passes < passes + 2:
                await trusted.sweeper.wait_pass()
        assert await trusted.redis.zrange(trusted.keys.target("echo-1").queue, 0, -1) == [victim.handoff_id.encode()]
        assert await mallory.redis.zcard(mallory.keys.deadlines("mallory")) == 0  # dropped as not its own
        # 4. a workers entry that is not a worker's leaves routing working for everyone else
        await mallory.redis.hset(mallory.keys.workers("mallory"), "w1", "not json")
        assert await trusted.router.directory.of(["mallory", "echo-1"]) == []
        # 5. an outbox entry the forwarder cannot handle is answered, and the forwarder goes on
        await mallory.redis.xadd(mallory.keys.outbox("mallory"), {"rid": "x", "calls": b"\x93"})
        again = await setup.buses["req"].client("req").request_handoff(req("req", "echo-1", reason="after"))
        assert await trusted.redis.zscore(trusted.keys.target("echo-1").queue, again.handoff_id) is not None


async def test_an_outbox_key_naming_no_valid_agent_is_neither_served_nor_registered(
    real_backend: str, servers: dict, caplog: pytest.LogCaptureFixture
) -> None:
    # the forwarder's SCAN pattern "<p>:{*}:outbox" matches a key mallory may make in its own
    # slot, "<p>:{mallory}:x{billing-1}:outbox": its "agent" is no agent id, and is skipped
    caplog.set_level(logging.WARNING, logger="handoffbus")
    async with isolated(real_backend, servers) as setup, anyio.create_task_group() as tg:
        trusted, bogus = setup.trusted, "mallory}:x{billing-1"
        await setup.buses["mallory"].redis.xadd(f"{setup.prefix}:{{{bogus}}}:outbox", {"x": "1"})
        forwarder = Forwarder(trusted, ())
        await tg.start(forwarder.run)  # started once its first look for outboxes is done
        agents = {a.decode() for a in await trusted.redis.smembers(trusted.keys.agents)}
        tg.cancel_scope.cancel()
    assert bogus not in agents and {"req", "echo-1", "mallory"} <= agents  # found, or served from the start
    assert any("not a valid agent id" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)


def test_a_signature_with_a_non_ascii_digest_is_refused_not_a_crash() -> None:
    ring = Keyring([SigningKey(key_id="k-1", agent="req", secret=b"s" * 32)])
    good = ring.sign("req", "request", ["x"], b"body", 1000)
    bad = good[:-1] + "é"
    with pytest.raises(Exception) as caught:
        ring.verify(bad, "req", "request", ["x"], b"body", 1000)
    assert type(caught.value).__name__ == "SignatureInvalid"


async def test_a_stopping_forwarder_still_answers_the_entry_it_started_on(real_backend: str, servers: dict) -> None:
    import msgspec as _msgspec

    async with isolated(real_backend, servers) as setup:
        trusted, forwarder = setup.trusted, setup.forwarder
        mine = await setup.buses["req"].client("req").request_handoff(req("req", "mallory", reason="for m"))
        keys = trusted.keys.record("req", mine.request_id)
        calls = [("load", [keys.record, keys.envelope], [])]
        ran = anyio.Event()
        handle = forwarder._handle

        async def handle_then_yield(sender: str, fields: dict[bytes, bytes]) -> bytes:
            replies = await handle(sender, fields)
            ran.set()  # the calls ran; the forwarder is told to stop before it replies
            await anyio.lowlevel.checkpoint()
            return replies

        forwarder._handle = handle_then_yield  # type: ignore[method-assign]
        before = await trusted.redis.xlen(trusted.keys.replies("mallory"))
        async with anyio.create_task_group() as tg:
            tg.start_soon(forwarder._answer, "mallory", b"1-1",
                          {b"rid": b"stop-test", b"calls": _msgspec.msgpack.encode(calls)}, [])
            await ran.wait()
            tg.cancel_scope.cancel()
        replies = await trusted.redis.xrange(trusted.keys.replies("mallory"), "-", "+")
        assert len(replies) == before + 1 and replies[-1][1][b"rid"] == b"stop-test"


async def test_an_entry_not_answered_in_time_is_read_again_without_a_restart(
    real_backend: str, servers: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the bound on an answer ran out and the entry stayed in the group's pending list with
    # nothing to say so: it was answered only after the next failure or a restart
    monkeypatch.setattr(forwarding, "ANSWER_WAIT", 0.2)
    async with isolated(real_backend, servers) as setup:
        forwarder, mallory = setup.forwarder, setup.buses["mallory"]
        handle = forwarder._handle
        first_cut_off = anyio.Event()

        async def stuck_once(sender: str, fields: dict[bytes, bytes]) -> bytes:
            if fields.get(b"rid") == b"slow" and not first_cut_off.is_set():
                try:
                    await anyio.sleep_forever()  # a call that never comes back
                finally:
                    first_cut_off.set()
            return await handle(sender, fields)

        forwarder._handle = stuck_once  # type: ignore[method-assign]
        keys = mallory.keys.record("mallory", "x")
        calls = msgspec.msgpack.encode([("load", [keys.record, keys.envelope], [])])
        await mallory.redis.xadd(mallory.keys.outbox("mallory"), {"rid": "slow", "calls": calls})
        await _outbox_answered(mallory, "mallory", "slow")
        assert first_cut_off.is_set()  # answered by the second reading, not the first


async def test_an_isolated_agents_deferral_is_settled_before_it_is_routed_on(
    real_backend: str, servers: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The forwarder sends a deferred routed handoff on: out of the deferring agent's inbox
    first, and the agent does not settle it again after (by then another of its workers may
    hold it again: see test_worker_edges for a shared bus)."""
    async with isolated(real_backend, servers, ("req", "spec-a")) as setup:
        bus, trusted = setup.buses["spec-a"], setup.trusted
        handle = await setup.buses["req"].client("req").request_handoff(
            HandoffRequest(from_agent="req", to_agent="", capabilities_required=["x"], reason="r", timeout=60.0))
        await Worker(bus, Capable("spec-a", refuse=False), consumer="w1")._register()  # serves x, says the registry
        first, second = RouteFeed(bus, "spec-a", ["x"], "w1"), RouteFeed(bus, "spec-a", ["x"], "w2")
        await first.refresh()
        await second.refresh()
        [deferred] = await first.pull(1)
        steps: list[str] = []

        def spy(target: Any, name: str, label: str) -> None:
            real = getattr(target, name)

            async def call(*args: Any, **kwargs: Any) -> Any:
                steps.append(label)
                return await real(*args, **kwargs)

            monkeypatch.setattr(target, name, call)

        spy(trusted, "settle", "forwarder settle")
        spy(trusted.router, "reroute", "forwarder reroute")
        spy(bus, "settle", "agent settle")
        response = await bus.client("spec-a")._transition(
            "reject", handle.handoff_id, {"reason": "later", "retry": 0}, settle=False)
        assert response.status is HandoffStatus.PENDING
        assert steps == ["forwarder settle", "forwarder reroute"]
        [again] = await second.pull(1)
        assert again.handoff_id == handle.handoff_id and again.entry_id != deferred.entry_id
        keys = trusted.keys.target("spec-a")
        assert await trusted.redis.hgetall(keys.inflight) == {handle.handoff_id.encode(): again.entry_id.encode()}
        assert setup.forwarder.refused == 0


async def test_an_isolated_agents_refusal_of_its_own_routed_request_is_settled(
    real_backend: str, servers: dict
) -> None:
    """An isolated agent refuses a routed handoff it requested itself: the record is in its own
    slot, so nothing is forwarded and the agent settles its entry itself (then the record's
    routing guard sends the handoff on)."""
    async with isolated(real_backend, servers, ("solo",)) as setup:
        bus, trusted = setup.buses["solo"], setup.trusted
        handle = await bus.client("solo").request_handoff(
            HandoffRequest(from_agent="solo", to_agent="", capabilities_required=["x"], reason="r", timeout=60.0))
        await Worker(bus, Capable("solo", refuse=False), consumer="w1")._register()  # serves x, says the registry
        feed = RouteFeed(bus, "solo", ["x"], "w1")
        await feed.refresh()
        [taken] = await feed.pull(1)
        response = await bus.client("solo")._transition(
            "reject", handle.handoff_id, {"reason": "later", "retry": 0}, settle=False)
        assert response.status is HandoffStatus.PENDING
        keys = trusted.keys.target("solo")
        assert await trusted.redis.hgetall(keys.inflight) == {}
        assert (await trusted.redis.xpending(keys.inbox, "workers"))["pending"] == 0
        assert taken.handoff_id == handle.handoff_id


@pytest.mark.parametrize("to", ["echo-1", ""])
async def test_an_isolated_requester_at_its_cap_is_told_so(real_backend: str, servers: dict, to: str) -> None:
    """The record is refused; the call sent with it (forwarded, and refused there for want of a
    record) must not hide why."""
    async with isolated(real_backend, servers, max_pending=1) as setup:
        client = setup.buses["req"].client("req")
        await client.request_handoff(req("req", "echo-1"))  # at the cap now
        with anyio.fail_after(10), pytest.raises(TooManyPending):
            await client.request_handoff(HandoffRequest(
                from_agent="req", to_agent=to, capabilities_required=[] if to else ["echo"], timeout=60))


async def test_an_isolated_request_a_full_queue_refused_does_not_spare_the_next_one_its_listing(
    real_backend: str, servers: dict, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A request refused by a full queue leaves nothing behind (its record taken back): the sweep
    may unlist its requester at once, and the forwarder must list it again at its next request."""
    async with isolated(real_backend, servers) as setup:
        trusted = setup.trusted
        monkeypatch.setattr(trusted, "config", msgspec.structs.replace(trusted.config, max_queued=1))
        await setup.buses["mallory"].client("mallory").request_handoff(req("mallory", "echo-1", timeout=600))
        client = setup.buses["req"].client("req")
        with anyio.fail_after(10), pytest.raises(QueueFull):  # echo-1's queue is full
            await client.request_handoff(req("req", "echo-1"))
        await trusted.sweeper.unlist_idle()  # "req" is idle: nothing of it anywhere
        assert not await trusted.redis.sismember(trusted.keys.requesters, "req")
        with anyio.fail_after(10):
            await client.request_handoff(req("req", "nobody-1", timeout=600))  # a retry elsewhere, seconds later
        assert await trusted.redis.sismember(trusted.keys.requesters, "req")


async def test_an_isolated_worker_reads_the_out_of_band_content_of_its_handoffs_only(
    real_backend: str, servers: dict
) -> None:
    """A context's large content lives in its requester's slot, which an isolated target may
    not read: its reads go through the forwarder, which lets a handoff's target and requester
    read the blobs its context refers to while it is undecided or accepted, and no one else."""
    async with isolated(real_backend, servers) as setup:
        req_bus = setup.buses["req"]
        report = "A" * 70_000
        offloaded = await offload(req_bus, "req", HandoffContext(tool_state={"report": report}), threshold=65_536)
        handle = await req_bus.client("req").request_handoff(
            req("req", "echo-1", context_snapshot=serialize_context(offloaded)))
        reads = ReadsReport()
        [outcome], _ = await serve_until_done(setup.buses["echo-1"], reads, [handle])
        assert outcome.status is HandoffStatus.COMPLETED and reads.seen == [report]
        with pytest.raises(CallRefused, match="which is COMPLETED"):  # finished: read no more
            await restore(setup.buses["echo-1"], offloaded, handle.handoff_id)
        # mallory, neither its target nor its requester, is refused the same read; and through a
        # handoff of its own from the same requester, whose context does not refer to that blob
        with pytest.raises(CallRefused, match="not addressed to or sent by"):
            await restore(setup.buses["mallory"], offloaded, handle.handoff_id)
        other = await req_bus.client("req").request_handoff(req("req", "mallory"))
        with pytest.raises(CallRefused, match="does not refer to"):
            await restore(setup.buses["mallory"], offloaded, other.handoff_id)


# ---------------------------------------------------------------------- one agent's abuse harms no other


async def _forge_routed_record(bus: HandoffBus, agent: str, request_id: str, *, prio: int, created: int,
                               to: str = "", caps: str = "x") -> None:
    """A routed PENDING record written by hand in the agent's own slot (its ACL user may)."""
    seconds, micros = await bus.redis.time()
    now = int(seconds) * 1000 + int(micros) // 1000
    keys = bus.keys.record(agent, request_id)
    await bus.redis.hset(keys.record, mapping={
        "id": f"{agent}/{request_id}", "from": agent, "to": to, "status": "PENDING", "actor": agent,
        "created": created, "updated": now, "deadline": now + 60_000, "fp": "x", "hist": "[]",
        "routed": "1", "caps": caps, "prio": prio, "chain": "[]", "refused": ",", "deferred": ","})
    await bus.redis.set(keys.envelope, b"\x80")
    await bus.redis.set(keys.marker, "1", px=60_000)
    await bus.redis.zadd(keys.deadlines, {request_id: now + 60_000})


async def _outbox_answered(bus: HandoffBus, agent: str, rid: str) -> None:
    """Until the forwarder has answered the agent's outbox entry ``rid`` (a blocking read)."""
    cursor: bytes | str = "0"
    with anyio.fail_after(10):
        while True:
            for _, entries in await bus.redis.xread({bus.keys.replies(agent): cursor}, block=1000) or ():
                for entry_id, fields in entries:
                    if fields[b"rid"] == rid.encode():
                        return
                    cursor = entry_id


async def test_one_agents_unpackable_call_fails_no_other_agents_calls(real_backend: str, servers: dict) -> None:
    # mallory's outbox entries hold an allowed call with an argument no command takes (msgpack
    # nil): batched with everyone else's calls, it failed the whole batch, other agents' calls
    # and the forwarder's own sweep included
    async with isolated(real_backend, servers) as setup:
        mallory = setup.buses["mallory"]
        record = mallory.keys.record("mallory", "x")
        bad = msgspec.msgpack.encode([("load", [record.record, record.envelope], [None])])
        failures: list[BaseException] = []
        done = anyio.Event()

        async def flood() -> None:
            n = 0
            while not done.is_set():
                await mallory.redis.xadd(mallory.keys.outbox("mallory"), {"rid": f"m{n}", "calls": bad})
                n += 1
                await anyio.lowlevel.checkpoint()  # a yield: the flood runs beside the requests

        async def one(i: int) -> None:
            try:
                await setup.buses["req"].client("req").request_handoff(req("req", "echo-1", reason=f"r{i}"))
            except Exception as exc:
                failures.append(exc)

        async with anyio.create_task_group() as tg:
            tg.start_soon(flood)
            with anyio.fail_after(60):
                for _ in range(10):
                    async with anyio.create_task_group() as burst:
                        for i in range(20):
                            burst.start_soon(one, i)
            done.set()
    assert failures == []


async def test_a_requester_cannot_raise_its_priority_by_writing_its_own_record(
        real_backend: str, servers: dict) -> None:
    # the sweep routes a handoff again with the priority its record holds, which the
    # requester's own user may write: -10**9 put mallory's ahead of everything in the set
    async with isolated(real_backend, servers) as setup:
        trusted, mallory = setup.trusted, setup.buses["mallory"]
        first = await setup.buses["req"].client("req").request_handoff(
            HandoffRequest(from_agent="req", to_agent="", capabilities_required=["x"], reason="first",
                           priority=-1000, timeout=60))
        await mallory.client("mallory").request_handoff(req("mallory", "echo-1"))  # a known requester
        seconds, micros = await mallory.redis.time()
        await _forge_routed_record(mallory, "mallory", "evil", prio=-10**9,
                                   created=int(seconds) * 1000 + int(micros) // 1000)
        await mallory.redis.zadd(mallory.keys.deadlines("mallory"), {"o:evil": 1})  # a routing guard, due
        queue = trusted.keys.route(set_id("x")).queue
        with anyio.fail_after(10):
            while await trusted.redis.zscore(queue, "mallory/evil") is None:
                await trusted.sweeper.wait_pass()
        order = await trusted.redis.zrange(queue, 0, -1)
    assert order == [first.handoff_id.encode(), b"mallory/evil"]  # priority at most -1000, and later


async def test_one_agents_outbox_entry_does_not_stop_the_forwarder(real_backend: str, servers: dict) -> None:
    # mallory refuses (a permitted call) a routed record of its own whose priority and creation
    # time made the route script fail: the routing on raised inside the entry's task group, and
    # the whole forwarder stopped for every agent (and again after a restart: never acknowledged)
    async with isolated(real_backend, servers) as setup:
        mallory = setup.buses["mallory"]
        await _forge_routed_record(mallory, "mallory", "evil", to="mallory", prio=-10**400, created=10**400)
        keys = mallory.keys.record("mallory", "evil")
        call = ("reject", keys.as_list(), ["mallory/evil", "evil", "mallory", 0, 0, "retry", 1000])
        await mallory.redis.xadd(mallory.keys.outbox("mallory"), {"rid": "m1", "calls": msgspec.msgpack.encode([call])})
        await _outbox_answered(mallory, "mallory", "m1")
        assert await mallory.redis.xlen(mallory.keys.outbox("mallory")) == 0  # acknowledged: never read again
        with anyio.fail_after(10):
            handle = await setup.buses["req"].client("req").request_handoff(req("req", "echo-1", reason="after"))
        assert await setup.trusted.redis.zscore(setup.trusted.keys.target("echo-1").queue, handle.handoff_id)


async def test_a_refusal_routed_on_to_a_broken_doorbell_does_not_stop_the_forwarder(
        real_backend: str, servers: dict) -> None:
    # mallory claims capability x (self-asserted, no grants) and makes its doorbell a string;
    # echo-1's ordinary refusal is routed on, the ring of mallory's doorbell failed, and the
    # error stopped the forwarder
    async with isolated(real_backend, servers) as setup:
        mallory, echo = setup.buses["mallory"], setup.buses["echo-1"]
        now = int((await mallory.redis.time())[0]) * 1000
        for bus, agent in ((mallory, "mallory"), (echo, "echo-1")):
            await bus.redis.hset(bus.keys.workers(agent), "w1", json.dumps({
                "consumer": "w1", "state": "RUNNABLE", "load": 0, "limit": 10, "capabilities": ["x"],
                "beat_ms": now + 600_000, "ttl_ms": 600_000}))
        await mallory.redis.set(mallory.keys.target("mallory").bell, "not a stream")
        handle = await setup.buses["req"].client("req").request_handoff(
            HandoffRequest(from_agent="req", to_agent="", capabilities_required=["x"], reason="r", timeout=60))
        keys = echo.keys.record("req", handle.request_id)
        offer = await echo.script("assign", keys.as_list(), [handle.handoff_id, handle.request_id, "echo-1",
                                                             30_000, 0, 0, 0])
        assert int(offer[0]) == 1
        await echo.client("echo-1").reject_handoff(handle.handoff_id, "not mine")  # answered after the routing on
        with anyio.fail_after(10):
            after = await setup.buses["req"].client("req").request_handoff(req("req", "echo-1", reason="after"))
        assert await setup.trusted.redis.zscore(setup.trusted.keys.target("echo-1").queue, after.handoff_id)


async def test_an_agent_whose_replies_stream_is_no_stream_does_not_stop_the_forwarder(
        real_backend: str, servers: dict) -> None:
    # mallory's own user may replace its replies stream with a string: the forwarder's reply
    # (XADD) failed with WRONGTYPE inside the entry's task group, and the whole forwarder
    # stopped for every agent
    async with isolated(real_backend, servers) as setup:
        mallory = setup.buses["mallory"]
        await mallory.redis.delete(mallory.keys.replies("mallory"))
        await mallory.redis.set(mallory.keys.replies("mallory"), "not a stream")
        keys = mallory.keys.record("mallory", "x")
        calls = msgspec.msgpack.encode([("load", [keys.record, keys.envelope], [])])
        await mallory.redis.xadd(mallory.keys.outbox("mallory"), {"rid": "m1", "calls": calls})
        with anyio.fail_after(10):
            while await mallory.redis.xlen(mallory.keys.outbox("mallory")):  # taken and acknowledged
                await setup.trusted.sweeper.wait_pass()
            handle = await setup.buses["req"].client("req").request_handoff(req("req", "echo-1", reason="after"))
        assert await setup.trusted.redis.zscore(setup.trusted.keys.target("echo-1").queue, handle.handoff_id)


async def test_an_agent_whose_outbox_is_no_stream_does_not_stop_a_starting_forwarder(
        real_backend: str, servers: dict) -> None:
    # mallory's own user may make its outbox key a string: a forwarder starting (or restarting)
    # failed to create its group there (WRONGTYPE) and stopped, serving no agent at all
    async with isolated(real_backend, servers) as setup, anyio.create_task_group() as tg:
        mallory, trusted = setup.buses["mallory"], setup.trusted
        await mallory.redis.delete(mallory.keys.outbox("mallory"))
        await mallory.redis.set(mallory.keys.outbox("mallory"), "not a stream")
        forwarder = Forwarder(trusted, ("mallory", "req"))  # as `handoffbus forwarder mallory req`
        with anyio.fail_after(10):
            await tg.start(forwarder.run)
        assert "req" in forwarder._serving  # the others are served
        tg.cancel_scope.cancel()


async def test_a_call_whose_run_lost_the_forwarders_connection_is_not_answered_as_a_plain_error(
        real_backend: str, servers: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    # the forwarder's batch lost its connection: the call's reply was a ConnectionError, which
    # the forwarder sent back as "error:..." and the agent raised as a plain ResponseError, not
    # a lost connection: a worker's step gave up where on a shared bus it is retried
    from redis.exceptions import ConnectionError as RedisConnectionError

    async with isolated(real_backend, servers) as setup:
        trusted, echo = setup.trusted, setup.buses["echo-1"]
        handle = await setup.buses["req"].client("req").request_handoff(req("req", "echo-1", reason="r"))
        keys = trusted.keys.record("req", handle.request_id)
        real = trusted.scripts_many
        broke = anyio.Event()

        def scripts_many(calls: list[Any]) -> Any:
            if not broke.is_set() and calls and calls[0][0] == "load" and calls[0][1] == [keys.record, keys.envelope]:
                broke.set()

                async def lost() -> list[Any]:
                    return [RedisConnectionError("Connection closed by server.")] * len(calls)

                return lost()
            return real(calls)

        monkeypatch.setattr(trusted, "scripts_many", scripts_many)
        with anyio.fail_after(20):
            try:
                row = await echo.script("load", [keys.record, keys.envelope], [])
            except Exception as exc:  # answered: then as what it is, a lost connection
                assert broke.is_set()
                assert isinstance(exc, HandoffbusError) and lost_connection(exc), repr(exc)
            else:
                assert broke.is_set() and row[6] == handle.handoff_id.encode()


async def routed_to_a_live(setup: Any, agent: str, request_timeout: float) -> HandoffHandle:
    """``agent`` registered with a live worker serving x (a beat ten minutes ahead), and a
    request from req routed by x."""
    bus = setup.buses[agent]
    now = int((await bus.redis.time())[0]) * 1000
    await bus.redis.hset(bus.keys.workers(agent), "w1", json.dumps({
        "consumer": "w1", "state": "RUNNABLE", "load": 0, "limit": 10, "capabilities": ["x"],
        "beat_ms": now + 600_000, "ttl_ms": 600_000}))
    return await setup.buses["req"].client("req").request_handoff(
        HandoffRequest(from_agent="req", to_agent="", capabilities_required=["x"], reason="r",
                       timeout=request_timeout))


async def test_an_agents_pull_claims_routed_handoffs_for_the_buses_claim_time_only(
        real_backend: str, servers: dict) -> None:
    # the claim time is the bus's (route_claim): a pull asking for 10**12 ms hid every handoff it
    # took from every other agent serving the set until their deadlines, undecided and unoffered
    async with isolated(real_backend, servers) as setup:
        trusted, mallory = setup.trusted, setup.buses["mallory"]
        handle = await routed_to_a_live(setup, "mallory", 600)
        route = trusted.keys.route(set_id("x"))
        reply = await mallory.script("pull", route.as_list(), ["mallory", 1, 10**12, 64])
        assert reply[2:] == [handle.handoff_id.encode()]
        claimed_until = await trusted.redis.zscore(route.claims, handle.handoff_id)
        seconds, micros = await trusted.redis.time()
        now = int(seconds) * 1000 + int(micros) // 1000
    assert claimed_until is not None and claimed_until <= now + trusted.config.route_claim * 1000


@pytest.mark.parametrize("chosen", [1, "nan"])
async def test_an_agent_cannot_backdate_its_offer_in_the_requesters_record(
        real_backend: str, servers: dict, chosen: Any) -> None:
    # assign's "when the agent was chosen" came from the caller, unchecked but for the future:
    # an isolated agent wrote an OFFERED step of 1970 (or of no time at all) into the requester's route
    async with isolated(real_backend, servers) as setup:
        echo = setup.buses["echo-1"]
        handle = await routed_to_a_live(setup, "echo-1", 60)
        keys = echo.keys.record("req", handle.request_id)
        offer = await echo.script("assign", keys.as_list(), [handle.handoff_id, handle.request_id, "echo-1",
                                                             30_000, 0, 0, chosen])
        assert int(offer[0]) == 1
        record = await handle.status()
    assert record is not None
    [step] = record.route
    assert step.event == "OFFERED" and record.created_ms <= step.at_ms <= record.updated_ms + 1000


async def test_an_isolated_requesters_routed_handoff_that_ended_leaves_its_sets_queue(
    real_backend: str, servers: dict
) -> None:
    """An isolated requester cancels a routed handoff that waits in its capability set's
    queue for an agent. Its user cannot reach the set's slot: the entry (queue member and
    meta) stayed there for ever when no agent serves the set, outliving the record itself."""
    async with isolated(real_backend, servers, ("req",)) as setup:
        client, trusted = setup.buses["req"].client("req"), setup.trusted
        handle = await client.request_handoff(
            HandoffRequest(from_agent="req", to_agent="", capabilities_required=["rare"], reason="r", timeout=60.0))
        route = trusted.keys.route(set_id("rare"))
        assert await trusted.redis.zscore(route.queue, handle.handoff_id) is not None  # waiting for an agent
        assert (await client.cancel_handoff(handle.handoff_id)).status is HandoffStatus.CANCELLED
        assert await trusted.redis.zscore(route.queue, handle.handoff_id) is None
        assert await trusted.redis.hget(route.meta, handle.handoff_id) is None


async def test_an_isolated_agents_transition_on_an_expired_routed_handoff_is_handoff_expired(
    real_backend: str, servers: dict
) -> None:
    """An isolated agent's accept (or a worker's late reject) meets a routed handoff offered to
    no one whose deadline passed: the script expires it ({-3, ''}). The client then read the
    requester's record for its capability set, a slot the agent's user may not reach: a
    NoPermissionError instead of HandoffExpired (a worker logged it and left the entry to a
    reclaim)."""
    from handoffbus import HandoffExpired

    async with isolated(real_backend, servers, ("req", "spec-a")) as setup:
        await setup.trusted.sweeper.stop()  # the agent's own call is what expires it
        client = setup.buses["req"].client("req")
        handle = await client.request_handoff(
            HandoffRequest(from_agent="req", to_agent="", capabilities_required=["x"], reason="r", timeout=60))
        keys = setup.trusted.keys.record(*handle.handoff_id.split("/"))
        record = keys.record
        await setup.trusted.redis.delete(keys.marker)  # its deadline passed, as the scripts see it
        with pytest.raises(HandoffExpired):
            await setup.buses["spec-a"].client("spec-a").accept_handoff(handle.handoff_id)
        assert (await setup.trusted.redis.hget(record, "status")) == b"EXPIRED"
