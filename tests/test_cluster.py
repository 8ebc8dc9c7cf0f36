"""Redis Cluster: the bus on a real three-primary cluster on loopback, one per server binary.

- A mixed run (direct, routed, rejected, failed, retried, cancelled and expired handoffs, a
  script cache flush, listings, clearing) makes no CROSSSLOT error on any node, counted by
  the servers themselves (``INFO errorstats``), after a control that shows they count one.
- The keys of one handoff, one agent and one capability set each share a slot, and different
  agents spread over the three nodes.
- The slots of a busy agent and of a requester migrate to other nodes (SETSLOT IMPORTING and
  MIGRATING, MIGRATE of the keys in small batches, SETSLOT NODE) while requests flow and a
  worker serves them: every handoff ends in exactly one terminal state with exactly one
  outcome response, and its work ran exactly once.

The behavioural suites run on a cluster too: see the cluster backends in conftest.py.
"""

from __future__ import annotations

import logging
import signal
import time
from collections import Counter, defaultdict
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from itertools import count
from typing import Any

import anyio
import msgspec
import pytest
import redis.asyncio as aioredis
from redis.crc import key_slot
from redis.exceptions import ClusterCrossSlotError, RedisError
from redis.exceptions import ConnectionError as RedisConnectionError

from handoffbus import HandoffBus, HandoffHandle, HandoffRequest, HandoffResponse, HandoffStatus
from handoffbus import cluster as clustering
from handoffbus.batching import ScriptBatcher
from handoffbus.embedded import EmbeddedCluster
from handoffbus.models import TERMINAL
from handoffbus.routing import set_id
from handoffbus.scripts import Command
from handoffbus.wire import guard_key
from handoffbus.workers import Accept, Agent, ReceivedHandoff, Reject, RetryPolicy, Worker

from .agents import Echo, Faulty
from .conftest import SERVER_BINARIES, new_prefix, start_cluster
from .helpers import LARGE, req, routed, serving

pytestmark = pytest.mark.anyio
S = HandoffStatus


@pytest.fixture(scope="module", params=list(SERVER_BINARIES))
def cluster(request: pytest.FixtureRequest) -> Iterator[EmbeddedCluster]:
    """A cluster of this module's own: its slots are moved and its error counters reset."""
    started = start_cluster(SERVER_BINARIES[request.param])
    try:
        yield started
    finally:
        started.stop()


@asynccontextmanager
async def admin(cluster: EmbeddedCluster) -> AsyncIterator[list[aioredis.Redis]]:
    """A plain client on each node (its unix socket), for what only a node can answer."""
    clients = [aioredis.Redis(unix_socket_path=str(node.socket_path)) for node in cluster.nodes]
    try:
        yield clients
    finally:
        for client in clients:
            await client.aclose()


async def error_counts(nodes: list[aioredis.Redis]) -> list[dict[str, int]]:
    """Each node's error replies since its last CONFIG RESETSTAT, by error code."""
    counts = []
    for node in nodes:
        info = await node.info("errorstats")
        counts.append({name.removeprefix("errorstat_"): int(v["count"]) for name, v in info.items()})
    return counts


class Refuser(Agent):
    agent_id = "refuser-1"

    async def on_handoff_request(self, request: HandoffRequest) -> Accept | Reject:
        return Reject(reason="not mine", code="NOT_MINE")


class Retried(Agent):
    """Fails the first run of every handoff: each completes on its second attempt."""

    agent_id = "retried-1"
    retry = RetryPolicy(attempts=2, delay=0.0)

    async def on_handoff_received(self, handoff: ReceivedHandoff) -> Any:
        if handoff.attempt == 1:
            raise ConnectionError("first run fails")
        return {"attempt": handoff.attempt}


class Capable(Agent):
    """An agent with capabilities x and y, for routed handoffs."""

    capabilities = ["x", "y"]

    def __init__(self, agent_id: str) -> None:
        super().__init__()
        self.agent_id = agent_id  # type: ignore[misc]

    async def on_handoff_received(self, handoff: ReceivedHandoff) -> Any:
        return {"by": self.agent_id}


async def test_a_mixed_run_makes_no_crossslot_error(
    cluster: EmbeddedCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[tuple[str, list[str]]] = []
    call_many, call = ScriptBatcher.call_many, ScriptBatcher.call

    async def spy(self: ScriptBatcher, batch: list[tuple[Any, list[str], list[Any]]]) -> list[Any]:
        calls.extend((script.name, keys) for script, keys, _ in batch)
        return await call_many(self, batch)

    async def spy_one(self: ScriptBatcher, script: Any, keys: list[str], args: list[Any]) -> Any:
        calls.append((script.name, keys))
        return await call(self, script, keys, args)

    monkeypatch.setattr(ScriptBatcher, "call_many", spy)
    monkeypatch.setattr(ScriptBatcher, "call", spy_one)
    prefix = new_prefix()
    async with admin(cluster) as nodes:
        # the control: a node does count a cross-slot call
        with pytest.raises(ClusterCrossSlotError):
            await nodes[0].eval("return 1", 2, f"{prefix}:{{a}}:k", f"{prefix}:{{b}}:k")
        assert (await error_counts(nodes))[0].get("CROSSSLOT") == 1
        for node in nodes:
            await node.config_resetstat()

        async with HandoffBus.connect(cluster.url, prefix=prefix, sweep_interval=0.05) as bus:
            assert bus.is_cluster
            requesters = [bus.client(f"req-{i}") for i in range(6)]
            agents = [Echo(), Refuser(), Faulty(), Retried(), Capable("cap-a"), Capable("cap-b")]
            async with serving(bus, *agents, reclaim_idle=3.0):
                handles: dict[str, list[HandoffHandle]] = defaultdict(list)
                for i in range(120):
                    client = requesters[i % len(requesters)]
                    frm = client.agent_id
                    kind, request = [
                        ("echo", req(frm, "echo-1", reason=f"e{i}", priority=i % 5)),
                        ("refused", req(frm, "refuser-1")),
                        ("failed", req(frm, "faulty-1")),
                        ("retried", req(frm, "retried-1")),
                        ("routed", msgspec.structs.replace(routed(["y", "x"], reason=f"r{i}"), from_agent=frm)),
                        ("echo", req(frm, "echo-1", reason=f"e{i}")),
                    ][i % 6]
                    handles[kind].append(await client.request_handoff(request))
                    if i == 60:
                        await bus.redis.function_flush()  # every primary's library: calls reload, none fail
                nobody = requesters[0]
                cancelled = [await nobody.request_handoff(req("req-0", "nobody-1")) for _ in range(5)]
                expiring = [await nobody.request_handoff(req("req-0", "nobody-1", timeout=0.3)) for _ in range(5)]
                unroutable = await nobody.request_handoff(
                    msgspec.structs.replace(routed(["z"]), from_agent="req-0"), fail_fast=True)
                pending = await nobody.get_pending_handoffs("nobody-1")
                assert {p.handoff_id for p in pending} >= {h.handoff_id for h in cancelled}
                for handle in cancelled:
                    await nobody.cancel_handoff(handle.handoff_id)
                with anyio.fail_after(30):
                    outcomes = {kind: [await h.outcome() for h in hs] for kind, hs in handles.items()}
                    assert [(await h.outcome()).status for h in expiring] == [S.EXPIRED] * 5
                live = {a.agent_id for a in await nobody.list_agents()}
            cancelled_now = [(await h.status()).status for h in cancelled]
            unroutable_code = (await unroutable.outcome()).rejection_code
        assert {o.status for o in outcomes["echo"] + outcomes["routed"]} == {S.COMPLETED}
        assert {o.status for o in outcomes["refused"]} == {S.REJECTED}
        assert {o.status for o in outcomes["failed"]} == {S.FAILED}
        assert {o.result["attempt"] for o in outcomes["retried"]} == {2}
        assert {o.result["by"] for o in outcomes["routed"]} <= {"cap-a", "cap-b"}
        assert cancelled_now == [S.CANCELLED] * 5
        assert unroutable_code == "NO_CAPABLE_AGENT"
        assert live >= {a.agent_id for a in agents}

        async with HandoffBus.connect(cluster.url, prefix=prefix) as bus:
            cleared = await bus.clear(confirm=prefix)
            lease = bus.keys.sweep_lease.encode()  # held by this open bus
            left = [k for node in nodes async for k in node.scan_iter(match=f"{prefix}:*") if k != lease]
        assert left == []

        errors = await error_counts(nodes)
        used = {key_slot(keys[0].encode()) for _, keys in calls}
        print(f"\nmixed run on {cluster.binary.rsplit('/', 1)[-1]}: {len(calls)} script calls "
              f"({len(Counter(n for n, _ in calls))} scripts) over {len(used)} slots, {cleared} keys cleared; "
              f"error replies per node: {errors}")
        assert [node.get("CROSSSLOT", 0) for node in errors] == [0, 0, 0]
        assert all(len({key_slot(k.encode()) for k in keys}) == 1 for _, keys in calls)
        assert sum(node.get("ERR", 0) for node in errors) > 0  # the flush was met ("Function not found"), and survived


async def test_keys_share_a_slot_and_agents_spread_over_the_nodes(cluster: EmbeddedCluster) -> None:
    prefix = new_prefix()
    async with admin(cluster) as nodes, HandoffBus.connect(cluster.url, prefix=prefix) as bus:
        keys = bus.keys

        async def slots(names: list[str]) -> set[int]:
            return {int(await nodes[0].execute_command("CLUSTER", "KEYSLOT", name)) for name in names}

        agent_keys = [*keys.record("general-agent-1", "req-42").as_list(), *keys.target("general-agent-1").as_list(),
                      keys.dead_letters("general-agent-1"), keys.workers("general-agent-1"),
                      keys.worker_beat("general-agent-1", "w-1"), keys.outbox("general-agent-1"),
                      keys.replies("general-agent-1")]
        route_keys = keys.route(set_id("code_review,security")).as_list()
        for group in (agent_keys, route_keys, [keys.sweep_lease]):
            guards = [guard for guard in map(guard_key, group) if guard is not None]
            assert len(guards) == len(group) and len(await slots(group + guards)) == 1
        assert len(await slots([keys.slot("a") + "x", keys.slot("b") + "x"])) == 2

        # thirty agents' handoffs to each other: each agent's keys on one node, all nodes used
        agents = [f"agent-{i}" for i in range(30)]
        for i, agent in enumerate(agents):
            await bus.client(agent).request_handoff(req(agent, agents[(i + 7) % len(agents)]))
        where: dict[str, set[int]] = defaultdict(set)
        for index, node in enumerate(nodes):
            async for key in node.scan_iter(match=f"{prefix}:{{*"):
                where[key.decode().split("{", 1)[1].split("}", 1)[0]].add(index)
        await bus.clear(confirm=prefix)
    assert set(where) == set(agents)
    assert all(len(found) == 1 for found in where.values())
    spread = Counter(next(iter(found)) for found in where.values())
    print(f"\n30 agents over the nodes: {dict(sorted(spread.items()))}")
    assert set(spread) == {0, 1, 2}


class Busy(Agent):
    """Works every handoff (a little while, so handlers are running while slots move), but
    refuses every tenth; counts what it ran."""

    agent_id = "busy-1"

    def __init__(self) -> None:
        super().__init__()
        self.worked: Counter[str] = Counter()
        self.attempts: Counter[int] = Counter()

    async def on_handoff_request(self, request: HandoffRequest) -> Accept | Reject:
        if request.priority == 9:
            return Reject(reason="not now", code="BUSY")
        return Accept()

    async def on_handoff_received(self, handoff: ReceivedHandoff) -> Any:
        self.worked[handoff.handoff_id] += 1
        self.attempts[handoff.attempt] += 1
        await anyio.sleep(0.002)  # simulated work
        return {"n": handoff.request.reason}


def watch_exchanges(monkeypatch: pytest.MonkeyPatch, seen: Callable[[list[Any], list[Any]], None]) -> None:
    """Tell ``seen`` of every exchange the bus has with a node: its calls and their replies."""
    exchange = clustering.exchange

    async def watched(conn: Any, calls: list[Any], asking: list[bool] | None = None, **wait: Any) -> list[Any]:
        replies = await exchange(conn, calls, asking, **wait)
        seen(calls, replies)
        return replies

    monkeypatch.setattr(clustering, "exchange", watched)


class SlotWatch:
    """What the script calls the bus sends to one slot are answered, while it is watched (not
    a plain command's: a staged envelope's SET, a single key, is served on a split slot)."""

    def __init__(self) -> None:
        self.slot: int | None = None
        self.answers: Counter[str] = Counter()
        self.want = 0
        self.enough = anyio.Event()

    def watch(self, slot: int, want: int) -> None:
        self.slot, self.want, self.answers, self.enough = slot, want, Counter(), anyio.Event()

    def seen(self, calls: list[Any], replies: list[Any]) -> None:
        if self.slot is None:
            return
        for call, reply in zip(calls, replies, strict=True):
            if call.slot == self.slot and not isinstance(call.script, Command):
                self.answers[type(reply).__name__ if isinstance(reply, Exception) else "ran"] += 1
        if self.answers.total() >= self.want:
            self.enough.set()


async def migrate(nodes: list[aioredis.Redis], ids: list[str], ports: list[int], slot: int, src: int,
                  dst: int, watch: SlotWatch) -> tuple[int, float, Counter[str]]:
    """Move ``slot`` from node ``src`` to node ``dst`` the way ``redis-cli --cluster reshard``
    does, two keys per MIGRATE. Half way, with the slot's keys split between the two nodes,
    the move waits until the bus has sent 20 script calls to the slot. Returns (keys moved,
    seconds, how those 20 calls were answered)."""
    started = time.monotonic()
    await nodes[dst].execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", ids[src])
    await nodes[src].execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", ids[dst])
    half = int(await nodes[src].execute_command("CLUSTER", "COUNTKEYSINSLOT", slot)) // 2
    moved, waited = 0, False
    while batch := await nodes[src].execute_command("CLUSTER", "GETKEYSINSLOT", slot, 2):
        await nodes[src].execute_command("MIGRATE", "127.0.0.1", ports[dst], "", 0, 5000, "KEYS", *batch)
        moved += len(batch)
        if not waited and moved >= half:
            waited = True
            watch.watch(slot, 20)
            with anyio.fail_after(10):
                await watch.enough.wait()
            watch.slot = None
    for i in [dst, src, *(i for i in range(len(nodes)) if i not in (src, dst))]:
        await nodes[i].execute_command("CLUSTER", "SETSLOT", slot, "NODE", ids[dst])
    return moved, time.monotonic() - started, watch.answers


def _owner(table: Any, slot: int) -> int:
    """The port of the node serving ``slot`` in a CLUSTER SLOTS reply."""
    return next(int(primary[1]) for first, last, primary, *_ in table if int(first) <= slot <= int(last))


async def test_migrating_the_slot_of_a_busy_agent_under_load_loses_and_doubles_nothing(
    cluster: EmbeddedCluster, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    caplog.set_level(logging.WARNING, logger="handoffbus")
    prefix = new_prefix()
    ids, ports = cluster.node_ids(), [node.port for node in cluster.nodes]
    agent = Busy()
    requesters = [f"req-{i}" for i in range(4)]
    handles: list[HandoffHandle] = []
    outcomes: dict[str, HandoffResponse] = {}
    resubmitted = 0
    migrations: list[tuple[str, int, int, int, float]] = []
    under_way, migrated = anyio.Event(), anyio.Event()
    watch, split = SlotWatch(), Counter[str]()
    watch_exchanges(monkeypatch, watch.seen)

    async with admin(cluster) as nodes, HandoffBus.connect(cluster.url, prefix=prefix) as bus:

        async def produce(requester: str) -> None:
            nonlocal resubmitted
            client, n = bus.client(requester), 0
            async with anyio.create_task_group() as waiting:
                while not migrated.is_set() or n < 150:
                    # every second one large: its envelope goes by a staged SET ahead of the script
                    request = req(requester, "busy-1", request_id=f"r{n}", reason=f"{requester}/{n}",
                                  priority=9 if n % 10 == 9 else 0, context_snapshot=LARGE if n % 2 else None)
                    try:
                        handle = await client.request_handoff(request)
                    except RedisError:  # a slot moving longer than a call waits: the same id again
                        resubmitted += 1
                        continue
                    handles.append(handle)
                    waiting.start_soon(await_outcome, handle)
                    n += 1

        async def await_outcome(handle: HandoffHandle) -> None:
            outcomes[handle.handoff_id] = await handle.outcome()
            if len(outcomes) >= 100:
                under_way.set()

        async def move_slots() -> None:
            await under_way.wait()
            # the busy agent's slot (queue, inbox, in-flight index) and requesters' (records,
            # response streams) in turn, each to the next node
            for name in ("busy-1", "req-0", "busy-1", "req-1", "busy-1", "req-0"):
                slot = key_slot(bus.keys.slot(name).encode())
                src = ports.index(_owner(await nodes[0].execute_command("CLUSTER", "SLOTS"), slot))
                moved, took, answers = await migrate(nodes, ids, ports, slot, src, (src + 1) % len(nodes), watch)
                migrations.append((name, slot, src, moved, took))
                split.update(answers)
            migrated.set()

        with anyio.fail_after(90):
            async with anyio.create_task_group() as tg:
                worker = Worker(bus, agent, concurrency=16)
                await tg.start(worker.run)
                async with anyio.create_task_group() as load:
                    for requester in requesters:
                        load.start_soon(produce, requester)
                    load.start_soon(move_slots)
                worker.drain()
        redirects = bus.redirects
        records = [await bus.client(h.handoff_id.split("/")[0]).get_handoff_status(h.handoff_id) for h in handles]
        responses: dict[str, list[str]] = defaultdict(list)
        for requester in requesters:
            for _, fields in await bus.redis.xrange(bus.keys.responses(requester)):
                responses[fields[b"id"].decode()].append(fields[b"status"].decode())
        target = bus.keys.target("busy-1")
        left = [await bus.redis.zcard(target.queue), await bus.redis.hlen(target.inflight),
                (await bus.redis.xpending(target.inbox, "workers"))["pending"]]
        busy_slot = key_slot(target.queue.encode())
        holders = [int(await node.execute_command("CLUSTER", "COUNTKEYSINSLOT", busy_slot)) for node in nodes]
        await bus.clear(confirm=prefix)

    statuses = Counter(o.status.value for o in outcomes.values())
    warnings = Counter(r.getMessage().split(":")[0] for r in caplog.records if r.levelno == logging.WARNING)
    print(f"\n{len(handles)} handoffs while moving slots ({cluster.binary.rsplit('/', 1)[-1]}): {dict(statuses)}; "
          + "; ".join(f"{name} (slot {slot}) from node {src}: {moved} keys in {took * 1000:.0f} ms"
                      for name, slot, src, moved, took in migrations)
          + f"; calls to a split slot: {dict(split)}; script calls sent again: {dict(redirects)}; "
          f"requests resubmitted: {resubmitted}; "
          f"warnings: {sum(warnings.values())} {dict(warnings)}")
    assert len(migrations) == 6 and all(moved > 0 for *_, moved, _ in migrations)
    # while a slot's keys were split between two nodes, no script ran on it
    assert split.total() >= 6 * 20 and "ran" not in split, split
    assert len({h.handoff_id for h in handles}) == len(handles) == len(outcomes)
    # exactly one terminal state each, on the record and in the one outcome the requester heard
    for handle, record in zip(handles, records, strict=True):
        outcome = outcomes[handle.handoff_id]
        expected = S.REJECTED if handle.handoff_id.endswith("9") else S.COMPLETED
        assert outcome.status is expected and record is not None and record.status is expected
        assert [h.status for h in record.history if h.status in TERMINAL] == [expected]
        heard = responses[handle.handoff_id]
        assert sum(status in {s.value for s in TERMINAL} for status in heard) == 1, heard
        assert heard == (["REJECTED"] if expected is S.REJECTED else ["ACCEPTED", "COMPLETED"])
    # the work ran once per completed handoff, on its first attempt: nothing doubled
    completed = {hid for hid, o in outcomes.items() if o.status is S.COMPLETED}
    assert set(agent.worked) == completed and set(agent.worked.values()) == {1}
    assert agent.attempts == Counter({1: len(completed)})
    assert left == [0, 0, 0]  # nothing queued, in flight or pending: all settled
    assert sorted(holders, reverse=True)[1:] == [0, 0]  # the agent's keys live on one node
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


async def test_a_staged_envelope_shares_its_request_scripts_round_trip(
    cluster: EmbeddedCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A large request's SET goes to the node of its record together with the ``request``
    script, in one exchange: no round trip more than a small request's (then the enqueue)."""
    sent: list[list[str]] = []

    def seen(calls: list[Any], _replies: list[Any]) -> None:
        names = [call.script.name for call in calls if call.script.name in ("SET", "request", "enqueue")]
        if names:  # not the sweep's and the stats' calls, which may share an exchange
            sent.append(names)

    watch_exchanges(monkeypatch, seen)
    prefix = new_prefix()
    async with HandoffBus.connect(cluster.url, prefix=prefix) as bus:
        client = bus.client("req")
        await bus.register_target("echo-1")
        sent.clear()
        handle = await client.request_handoff(req("req", "echo-1", reason="large", context_snapshot=LARGE))
        large = sent[:]
        sent.clear()
        await client.request_handoff(req("req", "echo-1", reason="small"))
        small = sent[:]
        record = await client.get_handoff_status(handle.handoff_id)
        await bus.clear(confirm=prefix)
    assert large == [["SET", "request"], ["enqueue"]] and small == [["request"], ["enqueue"]]
    assert record is not None and record.request.context_snapshot == LARGE


async def test_closing_the_bus_closes_connections_left_on_a_node_the_client_dropped(cluster: EmbeddedCluster) -> None:
    from redis.asyncio.cluster import ClusterNode

    async with HandoffBus.connect(cluster.url, prefix=new_prefix()) as bus:
        await bus.client("req").request_handoff(req("req", "echo-1"))  # the sender took connections
        manager = bus.redis.nodes_manager
        assert bus._batcher is not None and bus._batcher._cluster is not None
        used = bus._batcher._cluster._used
        [(_, node), *_] = list(used.items())
        left = [c for c, n in used.items() if n is node]  # the sender's (redis-py's own use others)
        assert left and all(c.is_connected for c in left)
        # a topology refresh replaced the node: the client's own close reaches the new one only
        fresh = ClusterNode(node.host, node.port, node.server_type, **manager.connection_kwargs)
        dropped = [n for n in (manager.startup_nodes.get(node.name),) if n is not None and n is not node]
        manager.nodes_cache[node.name] = manager.startup_nodes[node.name] = fresh
        for owners in manager.slots_cache.values():
            owners[:] = [fresh if n is node else n for n in owners]
        await bus.client("req").request_handoff(req("req", "echo-1"))  # served, by the new node
        kept = [c for c, n in used.items() if n is not node]
        await bus._batcher._cluster.close()  # as the bus closing calls it
        assert kept and all(c.is_connected for c in kept)  # live nodes' connections: the client's to close
        assert not any(c.is_connected for c in left)
        for other in node._connections:  # redis-py's own there: its refresh (set_nodes) closes those
            if all(other is not c for c in left):
                await other.disconnect()
        for startup in dropped:  # and the startup node object this test swapped out, as set_nodes would
            await startup.disconnect()
    assert not any(c.is_connected for c in kept)  # and the client closed the rest


async def test_a_plain_url_to_a_cluster_node_opens_a_cluster_bus(cluster: EmbeddedCluster) -> None:
    plain = f"redis://127.0.0.1:{cluster.nodes[0].port}"
    async with HandoffBus.connect(plain, prefix=new_prefix()) as bus:
        assert bus.is_cluster
        alice, bob = bus.client("alice"), bus.client("bob")
        handle = await alice.request_handoff(req("alice", "bob"))
        await bob.accept_handoff(handle.handoff_id)
        with anyio.fail_after(10):
            assert (await handle.decision()).status is S.ACCEPTED


@asynccontextmanager
async def scaling_out(binary: str, tag: str) -> AsyncIterator[tuple[HandoffBus, Any]]:
    """A cluster of two primaries and a third that joined serving no slot, ``tag``'s slot
    half migrated to it (IMPORTING there, MIGRATING at its owner), a bus on it, and
    ``finish()``: the migration ended (the slot the new node's), which returns the new node's
    admin client."""
    cluster = await anyio.to_thread.run_sync(start_cluster, SERVER_BINARIES[binary], 2)
    try:
        new = await anyio.to_thread.run_sync(cluster.add_primary)
        ids = await anyio.to_thread.run_sync(cluster.node_ids)
        async with admin(cluster) as nodes, HandoffBus.connect(cluster.url, prefix=new_prefix()) as bus:
            table = await nodes[0].execute_command("CLUSTER", "SLOTS")
            slot = key_slot(tag.encode())  # its keys' hash tag
            src = [node.port for node in cluster.nodes].index(_owner(table, slot))
            dst = cluster.nodes.index(new)
            await nodes[dst].execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", ids[src])
            await nodes[src].execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", ids[dst])

            async def finish() -> aioredis.Redis:
                for i in [dst, src, *(i for i in range(len(nodes)) if i not in (src, dst))]:
                    await nodes[i].execute_command("CLUSTER", "SETSLOT", slot, "NODE", ids[dst])
                return nodes[dst]

            yield bus, finish
    finally:
        await anyio.to_thread.run_sync(cluster.stop)


@pytest.mark.parametrize("binary", list(SERVER_BINARIES))
async def test_a_call_asked_to_a_new_primary_during_a_scale_out_follows_the_ask(
    binary: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A scale-out: a primary joins serving no slot, and a slot is resharded to it. A call whose
    keys are not on the source (a new requester's first request) is answered ASK, naming a
    node no slot table lists yet: it goes there and waits out the migration, where it failed
    with AskError."""
    requester = "req-0"
    async with scaling_out(binary, requester) as (bus, finish):
        handles: list[HandoffHandle] = []
        asked, named = anyio.Event(), clustering.ClusterSender._node_named

        def noting(sender: clustering.ClusterSender, host: str, port: int) -> Any:
            asked.set()
            return named(sender, host, port)

        monkeypatch.setattr(clustering.ClusterSender, "_node_named", noting)

        async def request() -> None:
            handles.append(await bus.client(requester).request_handoff(req(requester, "echo-1")))

        async with anyio.create_task_group() as tg:
            tg.start_soon(request)
            with anyio.fail_after(10):
                await asked.wait()  # the source answered ASK, naming the new node
            assert not handles  # held back while the slot migrates
            importing = await finish()
        [handle] = handles
        record = await bus.client(requester).get_handoff_status(handle.handoff_id)
        assert record is not None and record.status is S.PENDING
        assert await importing.execute_command("CLUSTER", "COUNTKEYSINSLOT", key_slot(requester.encode())) > 0


@pytest.mark.parametrize("binary", list(SERVER_BINARIES))
async def test_a_node_that_stops_answering_holds_up_no_other_node(
    binary: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A primary frozen (SIGSTOP: its connections stay open, nothing answers): its calls fail
    once NODE_REPLY_WAIT has passed, and at once after that, while calls to the other node go
    on; thawed, it answers a PING and takes calls again. Without a bound, its calls waited for
    ever and held up the senders every other call needs."""
    monkeypatch.setattr(clustering, "NODE_REPLY_WAIT", 0.5)
    monkeypatch.setattr(clustering, "PROBE_EVERY", 0.1)
    cluster = await anyio.to_thread.run_sync(start_cluster, SERVER_BINARIES[binary], 2)
    try:
        async with admin(cluster) as nodes, HandoffBus.connect(cluster.url, prefix=new_prefix()) as bus:
            table = await nodes[0].execute_command("CLUSTER", "SLOTS")
            ports = [node.port for node in cluster.nodes]

            def on(index: int, tag: str) -> str:
                return next(f"{tag}-{i}" for i in count() if _owner(table, key_slot(f"{tag}-{i}".encode()))
                            == ports[index])

            live = bus.client(on(0, "live"))
            frozen = bus.client(on(1, "frozen"))
            target = on(0, "target")  # the live node's: a request of the live requester stays there
            await live.request_handoff(req(live.agent_id, target))
            await frozen.request_handoff(req(frozen.agent_id, target))
            process = cluster.nodes[1].process
            assert process is not None
            process.send_signal(signal.SIGSTOP)
            try:
                with anyio.fail_after(5):
                    with pytest.raises(RedisError):  # the reply wait ran out
                        await frozen.request_handoff(req(frozen.agent_id, target))
                    sender = bus._batcher._cluster if bus._batcher is not None else None
                    assert sender is not None and list(sender.silent) == [f"127.0.0.1:{ports[1]}"]
                    with pytest.raises(RedisError, match="is not answering"):  # at once now
                        await frozen.request_handoff(req(frozen.agent_id, target))
                    for _ in range(3):
                        assert (await live.request_handoff(req(live.agent_id, target))).handoff_id
            finally:
                process.send_signal(signal.SIGCONT)
            with anyio.fail_after(10):
                while True:  # the prober hears it again; until then its calls are refused
                    try:
                        handle = await frozen.request_handoff(req(frozen.agent_id, target, request_id="after"))
                        break
                    except RedisError:
                        await anyio.sleep(0.05)  # the caller's backoff
            assert (await frozen.get_handoff_status(handle.handoff_id)) is not None
    finally:
        await anyio.to_thread.run_sync(cluster.stop)


async def test_replies_read_before_a_nodes_connection_failed_reach_their_callers(
    cluster: EmbeddedCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two calls share an exchange with their node, whose connection fails after the first
    one's reply was read: that call keeps its reply (told the connection failed, its caller
    would send again what ran); only the second hears the failure."""
    exchange, cut = clustering.exchange, []

    async def fails_midway(conn: Any, calls: list[Any], *args: Any, **kwargs: Any) -> list[Any]:
        replies = await exchange(conn, calls, *args, **kwargs)  # every call ran
        if [call.script.name for call in calls] == ["enqueue", "enqueue"] and not cut:
            cut.append(True)
            exc = RedisConnectionError("Connection reset by peer")
            exc.replies_read = replies[:1]  # type: ignore[attr-defined]  # what came back before it
            raise exc
        return replies

    async with HandoffBus.connect(cluster.url, prefix=new_prefix()) as bus:
        monkeypatch.setattr(clustering, "exchange", fails_midway)
        # one group: one batch, and one wave (the same script, one slot), so one exchange
        first, second = await bus.scripts_many([bus.enqueue_call("b", f"a/r{i}", 0) for i in (1, 2)])
        assert cut
        assert not isinstance(first, BaseException) and isinstance(second, RedisConnectionError), (first, second)
        assert await bus.redis.zrange(bus.keys.target("b").queue, 0, -1) == [b"a/r1", b"a/r2"]  # both ran


@pytest.mark.parametrize("binary", list(SERVER_BINARIES))
async def test_a_plain_read_asked_to_a_new_primary_during_a_scale_out_follows_the_ask(binary: str) -> None:
    """redis-py's own commands (a listing, a response reader's XREAD, a worker's claims) follow
    an ASK naming a primary that joined and serves no slot yet, as the script calls do: redis-py
    looked the node up by name, found none, and raised AttributeError, out of the listing and
    out of a response reader (which ended the bus)."""
    agent = "lettered-0"
    async with scaling_out(binary, agent) as (bus, finish):
        # no key of the slot on the source: it answers ASK, naming the new node
        with anyio.fail_after(10):
            assert await bus.client("req").get_dead_letters(agent) == []
        await finish()


async def test_a_plain_read_of_a_migrating_slot_follows_the_ask(cluster: EmbeddedCluster) -> None:
    """A slot half migrated: a key already moved is read from the importing node, with ASKING
    on the same connection as the read. redis-py sent ASKING on one pooled connection and the
    read on another, which the importing node answered MOVED (back to the source, which
    answered ASK again): the read failed with ClusterError "TTL exhausted" whenever the
    importing node's pool had two connections free."""
    ids, ports = cluster.node_ids(), [node.port for node in cluster.nodes]
    async with admin(cluster) as nodes, HandoffBus.connect(cluster.url, prefix=new_prefix()) as bus:
        table = await nodes[0].execute_command("CLUSTER", "SLOTS")
        agent = "lettered-1"
        key = bus.keys.dead_letters(agent)
        slot = key_slot(key.encode())
        src = ports.index(_owner(table, slot))
        dst = (src + 1) % len(nodes)
        await nodes[src].xadd(key, {"h": "a/r1", "reason": "poison", "deliveries": 3, "consumer": "c"})
        # the importing node's pool has connections free (as a busy bus's has)
        there = next(f"{{x-{i}}}" for i in count() if _owner(table, key_slot(f"x-{i}".encode())) == ports[dst])
        node = bus.redis.nodes_manager.get_node_from_slot(key_slot(there.encode()))
        async with anyio.create_task_group() as tg:
            for _ in range(4):
                tg.start_soon(bus.redis.xlen, there)
        assert len(node._free) >= 2
        await nodes[dst].execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", ids[src])
        await nodes[src].execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", ids[dst])
        await nodes[src].execute_command("MIGRATE", "127.0.0.1", ports[dst], "", 0, 5000, "KEYS", key)
        try:
            with anyio.fail_after(10):
                [letter] = await bus.client("req").get_dead_letters(agent)
            assert letter.handoff_id == "a/r1" and letter.reason == "poison"
        finally:
            for i in [dst, src, *(i for i in range(len(nodes)) if i not in (src, dst))]:
                await nodes[i].execute_command("CLUSTER", "SETSLOT", slot, "NODE", ids[dst])


async def agreed(nodes: list[aioredis.Redis], slot: int, port: int) -> bool:
    """Whether every node has ``port``'s node serving ``slot``, at one current epoch (a node's
    epoch bumped by a move gossiped to all: else the next move's bump may collide, and the
    nodes settle on different owners)."""
    epochs = {(await node.execute_command("CLUSTER", "INFO")).split(b"cluster_current_epoch:")[1].split()[0]
              for node in nodes}
    owners = {_owner(await node.execute_command("CLUSTER", "SLOTS"), slot) for node in nodes}
    return len(epochs) == 1 and owners == {port}


async def test_slot_moves_seen_by_plain_reads_fail_no_call_in_flight(
    cluster: EmbeddedCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A slot moved: the next plain read of it is answered MOVED, and the client updates its
    slot table. redis-py also closed every connection of the client at every fifth such
    MOVED (``reinitialize_steps``), those of script calls under way on other nodes included:
    a request to a node no slot move touched failed with ConnectionError."""
    ids, ports = cluster.node_ids(), [node.port for node in cluster.nodes]
    under_way = anyio.Event()

    def seen_sending(calls: list[Any]) -> None:
        if any(call.script.name == "request" and "held-" in call.keys[0] for call in calls):
            under_way.set()

    exchange = clustering.exchange

    async def watched(conn: Any, calls: list[Any], *args: Any, **kwargs: Any) -> list[Any]:
        seen_sending(calls)
        return await exchange(conn, calls, *args, **kwargs)

    async with admin(cluster) as nodes, HandoffBus.connect(cluster.url, prefix=new_prefix()) as bus:
        table = await nodes[0].execute_command("CLUSTER", "SLOTS")
        slot = key_slot(b"moving-0")
        home = ports.index(_owner(table, slot))
        away = (home + 1) % len(nodes)
        still = next(i for i in range(len(nodes)) if i not in (home, away))  # its slots stay
        requester = next(f"held-{i}" for i in count() if _owner(table, key_slot(f"held-{i}".encode())) == ports[still])
        client, lister = bus.client(requester), bus.client("lister")
        with anyio.fail_after(10):
            while not await agreed(nodes, slot, ports[home]):  # noqa: ASYNC110  (an earlier test's moves settle)
                await anyio.sleep(0.01)
        await client.request_handoff(req(requester, "echo-1", request_id="first"))
        handles: list[HandoffHandle] = []

        async def request() -> None:
            handles.append(await client.request_handoff(req(requester, "echo-1", request_id="held")))

        for move in range(5):
            src, dst = (home, away) if move % 2 == 0 else (away, home)
            await nodes[dst].execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", ids[src])
            await nodes[src].execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", ids[dst])
            for i in [dst, src, still]:
                await nodes[i].execute_command("CLUSTER", "SETSLOT", slot, "NODE", ids[dst])
            with anyio.fail_after(10):  # the nodes agree on the owner and on the epoch before the next move
                while not await agreed(nodes, slot, ports[dst]):  # noqa: ASYNC110
                    await anyio.sleep(0.01)  # polling the cluster's state
            if move < 4:
                assert await lister.get_dead_letters("moving-0") == []  # answered MOVED first
                continue
            # the fifth: a request is under way on the third node meanwhile (held there by a pause)
            await nodes[still].execute_command("CLIENT", "PAUSE", 10_000, "WRITE")
            monkeypatch.setattr(clustering, "exchange", watched)
            try:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(request)
                    with anyio.fail_after(10):
                        await under_way.wait()
                        assert await lister.get_dead_letters("moving-0") == []  # answered MOVED first
                    await nodes[still].execute_command("CLIENT", "UNPAUSE")
            finally:
                await nodes[still].execute_command("CLIENT", "UNPAUSE")
        [handle] = handles
        assert (await client.get_handoff_status(handle.handoff_id)) is not None


async def test_the_sweep_lease_is_released_on_its_node_without_asking_a_node_for_the_keys(
        cluster: EmbeddedCluster, monkeypatch: pytest.MonkeyPatch) -> None:
    """redis-py finds an FCALL's keys with COMMAND GETKEYS, sent on a connection of its command
    parser's node: one the client may have dropped since (a topology refresh), whose connection
    no close reaches. The lease, released as the bus closes, is sent to its key's node."""
    asked: list[tuple[Any, ...]] = []
    async with HandoffBus.connect(cluster.url, prefix=new_prefix()) as bus:
        parser = bus.redis.commands_parser
        get_keys = parser.get_keys

        async def spied(*args: Any) -> Any:
            asked.append(args)
            return await get_keys(*args)

        monkeypatch.setattr(parser, "get_keys", spied)
        lease = bus.keys.sweep_lease
        assert await bus.redis.get(lease) is not None  # held by this open bus
    async with HandoffBus.connect(cluster.url, prefix=new_prefix()) as other:
        assert await other.redis.get(lease) is None  # released as the first closed
    assert [args for args in asked if str(args[0]).upper() in ("FCALL", "FCALL_RO")] == []
