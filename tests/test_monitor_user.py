"""The read-only monitor user of ``handoffbus acl`` may run no script: the bus reads records,
pending work and agent views with plain commands instead (plainreads.py), on one server or a
cluster (the user is created on every node)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import anyio
import msgspec
import pytest
import redis

from handoffbus import EmbeddedCluster, EmbeddedServer, HandoffBus, HandoffRequest, HandoffStatus
from handoffbus.acl import AclUser, monitor_user
from handoffbus.monitor import observe_agents
from handoffbus.workers.inbox import Inbox

from .conftest import make_bus, new_prefix

pytestmark = pytest.mark.anyio


def on_every_node(server: EmbeddedServer | EmbeddedCluster, *command: str) -> None:
    for node in server.nodes if isinstance(server, EmbeddedCluster) else [server]:
        with redis.Redis(unix_socket_path=str(node.socket_path)) as admin:
            admin.execute_command(*command)


@contextmanager
def monitor_url(server: EmbeddedServer | EmbeddedCluster, user: AclUser) -> Iterator[str]:
    """Create ``user`` on the server (every node of a cluster); the URL to connect as it."""
    try:
        on_every_node(server, *user.setuser())
        if isinstance(server, EmbeddedCluster):
            yield f"redis+cluster://{user.name}:{user.password}@127.0.0.1:{server.nodes[0].port}"
        else:
            yield f"unix://{user.name}:{user.password}@{server.socket_path}"
    finally:
        on_every_node(server, "ACL", "DELUSER", user.name)


async def test_the_monitor_user_reads_what_the_scripts_read(real_backend: str, servers: dict) -> None:
    """The monitor user may run no script: the bus reads records, pending work and agent views
    with plain commands instead, says what the scripts say, and writes nothing (a handoff past
    its deadline stays PENDING until a sweep with the right to write expires it)."""
    prefix = new_prefix()
    with monitor_url(servers[real_backend], monitor_user(prefix)) as url:
        await read_as_monitor(real_backend, servers, prefix, url)


async def read_as_monitor(real_backend: str, servers: dict, prefix: str, url: str) -> None:
    async with make_bus(real_backend, servers, prefix=prefix, sweep_interval=3600) as admin:
        requester = admin.client("alice")
        first = await requester.request_handoff(HandoffRequest(from_agent="alice", to_agent="bob", reason="a"))
        second = await requester.request_handoff(HandoffRequest(from_agent="alice", to_agent="bob", reason="b",
                                                                 priority=5))
        due = await requester.request_handoff(HandoffRequest(from_agent="alice", to_agent="bob", reason="c",
                                                             priority=-3))
        _, [taken] = await Inbox(admin, "bob", "worker-1").take(1)  # the best priority: the one falling due
        assert taken.handoff_id == due.handoff_id
        # its deadline passed with no sweep: what the scripts see then is a PENDING record without
        # its marker (whose TTL is the deadline)
        due_keys = admin.keys.record("alice", due.handoff_id.split("/")[1])
        await admin.redis.hset(due_keys.record, "deadline", await admin.redis.hget(due_keys.record, "created"))
        await admin.redis.delete(due_keys.marker)
        ids = [first.handoff_id, second.handoff_id, due.handoff_id]
        # a worker of bob's that died long ago: a bus that may write forgets it when it lists agents
        await admin.redis.hset(admin.keys.workers("bob"), "gone-1", msgspec.json.encode({
            "consumer": "gone-1", "state": "RUNNABLE", "load": 0, "limit": 1, "beat_ms": 1, "ttl_ms": 1000}))
        async with HandoffBus.connect(url, prefix=prefix) as monitor:
            seen = [await monitor.read_record(hid) for hid in ids]
            loaded = await monitor.load_records(ids)
            views = await observe_agents(monitor, ["bob"])
            pending = await monitor.client("ops").get_pending_handoffs("bob")
            with anyio.fail_after(5):
                await monitor.sweeper.wait_refused()  # refused the lease script: it leaves sweeping to others
            assert monitor.plain_reads and not admin.plain_reads
            assert monitor.sweeper.passes == 0
        assert [found[2].status for found in seen if found] == [HandoffStatus.PENDING] * 3
        assert seen[2] is not None and seen[2][2].deadline_ms < seen[2][0]  # reported as it stands: overdue
        assert await admin.redis.hget(due_keys.record, "status") == b"PENDING"  # nothing written
        assert [p.handoff_id for p in pending] == [first.handoff_id, second.handoff_id]
        assert loaded == await admin.load_records(ids)
        [view] = views
        assert view.workers == 0 and await admin.redis.hexists(admin.keys.workers("bob"), "gone-1")  # left as it was
        [truth] = await observe_agents(admin, ["bob"])
        assert (view.queued, view.in_flight, view.counts) == (truth.queued, truth.in_flight, truth.counts) == (
            2, 1, truth.counts)
        assert view.oldest_waiting_s is not None and view.oldest_in_flight_s is not None
        assert abs(view.oldest_waiting_s - (truth.oldest_waiting_s or 0)) < 5
        for hid, found in zip(ids, seen, strict=True):
            assert found is not None
            expected = await admin.read_record(hid)  # the scripts' read (it expires the overdue one)
            assert expected is not None
            if hid != due.handoff_id:
                assert found[2] == expected[2]
        assert (await admin.read_record(due.handoff_id) or (0, b"", None))[2].status is HandoffStatus.EXPIRED


async def test_a_bus_runs_scripts_again_once_its_user_is_widened(real_backend: str, servers: dict) -> None:
    """A bus refused scripts tries them again every ``scripts_recheck``: once an operator widens
    its user's ACL, it sweeps and reads with the scripts, without a restart."""
    prefix, server = new_prefix(), servers[real_backend]
    user = monitor_user(prefix)
    with monitor_url(server, user) as url:
        async with make_bus(real_backend, servers, prefix=prefix, sweep_interval=3600) as admin:
            handle = await admin.client("alice").request_handoff(
                HandoffRequest(from_agent="alice", to_agent="bob", reason="a"))
            keys = admin.keys.record("alice", handle.handoff_id.split("/")[1])
            await admin.redis.hset(keys.record, "deadline", await admin.redis.hget(keys.record, "created"))
            await admin.redis.delete(keys.marker)  # overdue, and no sweep has seen it
        async with HandoffBus.connect(url, prefix=prefix, scripts_recheck=0.2) as monitor:
            found = await monitor.read_record(handle.handoff_id)
            assert monitor.plain_reads and found is not None and found[2].status is HandoffStatus.PENDING
            with anyio.fail_after(5):
                await monitor.sweeper.wait_refused()
            on_every_node(server, "ACL", "SETUSER", user.name, "+@all", f"~{prefix}:*")
            with anyio.fail_after(10):
                await monitor.sweeper.wait_pass()  # it sweeps: the overdue handoff expires
                while monitor.plain_reads:
                    found = await monitor.read_record(handle.handoff_id)
                    await monitor.sweeper.wait_pass()  # a sweep interval: the reads' recheck falls due
            assert monitor.sweeper.passes > 0 and not monitor.sweeper.refused
            found = await monitor.read_record(handle.handoff_id)
            assert found is not None and found[2].status is HandoffStatus.EXPIRED
