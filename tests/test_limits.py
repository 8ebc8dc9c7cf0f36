"""Limits: a cap on each requester's undecided handoffs, oversized payloads refused by the
producer and by the consumer before parsing, and the eviction-policy warning."""

from __future__ import annotations

import gzip
import logging

import anyio
import pytest

from handoffbus import HandoffBus, HandoffStatus, PayloadTooLarge, TooManyPending, Worker
from handoffbus.routing import capability_set, set_id
from handoffbus.workers import Accept, Agent, ReceivedHandoff

from .conftest import SERVER_BINARIES, make_bus, start_server
from .helpers import prefix_keys, req, routed

pytestmark = pytest.mark.anyio


class Watchful(Agent):
    """Records every hook call: a refused payload must reach neither."""

    agent_id = "watch-1"

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    async def on_handoff_request(self, request: object) -> Accept:
        self.calls.append("request")
        return Accept()

    async def on_handoff_received(self, handoff: ReceivedHandoff) -> str:
        self.calls.append(handoff.request.reason)
        return "ok"


async def test_a_requester_at_its_cap_of_undecided_handoffs_is_refused(backend: str, servers: dict) -> None:
    async with make_bus(backend, servers, max_pending=50) as bus:
        client = bus.client("req")
        handles = [await client.request_handoff(req("req", "slow-1", reason=f"r{i}")) for i in range(50)]
        before = await prefix_keys(bus)
        with pytest.raises(TooManyPending):
            await client.request_handoff(req("req", "slow-1", reason="one too many", request_id="extra"))
        with pytest.raises(TooManyPending):
            await client.request_handoff(routed(["x"], request_id="extra-routed"))
        assert await client.get_handoff_status("req/extra") is None
        assert await bus.redis.zcard(bus.keys.target("slow-1").queue) == 50  # nothing queued for it
        routing = [*bus.keys.route(set_id(capability_set(["x"]))).as_list(), bus.keys.routes]
        # no record (the stats flush, once a second, may write the earlier requests' counts meanwhile)
        new = {k for k in set(await prefix_keys(bus)) - set(before) if not k.endswith(b":stats")}
        assert new <= {k.encode() for k in routing}
        # another requester is not limited by this one's backlog
        other = await bus.client("other").request_handoff(req("other", "slow-1", reason="fine"))
        assert (await other.status()).status is HandoffStatus.PENDING  # type: ignore[union-attr]
        await handles[0].cancel()  # room for one more
        again = await client.request_handoff(req("req", "slow-1", reason="now fits", request_id="extra"))
        assert (await again.status()).status is HandoffStatus.PENDING  # type: ignore[union-attr]


async def test_an_oversized_payload_is_refused_by_the_producer(backend: str, servers: dict) -> None:
    async with make_bus(backend, servers, payload_limit=10_000, compress_threshold=100_000) as bus:
        before = await prefix_keys(bus)
        with pytest.raises(PayloadTooLarge):
            await bus.client("req").request_handoff(req("req", "watch-1", metadata={"blob": "x" * 20_000}))
        assert await prefix_keys(bus) == before  # nothing written


@pytest.mark.parametrize("kind", ["oversized", "zip bomb"])
async def test_an_oversized_payload_is_refused_by_the_consumer_before_parsing(
    backend: str, servers: dict, kind: str
) -> None:
    async with make_bus(backend, servers, payload_limit=100_000) as bus:
        client = bus.client("req")
        bad = await client.request_handoff(req("req", "watch-1", reason="bad", request_id="bad"))
        good = await client.request_handoff(req("req", "watch-1", reason="good"))
        # written behind the producer's back, as a peer that skipped the checks could
        blob = b"\x80" + b"\x00" * 200_000 if kind == "oversized" else gzip.compress(b"\x00" * 50_000_000)
        assert len(blob) > 100_000 if kind == "oversized" else len(blob) < 100_000  # a bomb passes the size check
        await bus.redis.set(bus.keys.record("req", "bad").envelope, blob)
        agent = Watchful()
        async with anyio.create_task_group() as tg:
            worker = Worker(bus, agent)
            await tg.start(worker.run)
            with anyio.fail_after(10):
                outcome = await good.outcome()
                while not await client.get_dead_letters("watch-1"):
                    await worker.wait_reclaim_pass()
            worker.drain()
        [dead] = await client.get_dead_letters("watch-1")
    assert outcome.status is HandoffStatus.COMPLETED and agent.calls == ["request", "good"]
    assert dead.handoff_id == bad.handoff_id and "PayloadTooLarge" in dead.reason


async def test_a_server_that_may_evict_keys_is_warned_about(
    real_backend: str, caplog: pytest.LogCaptureFixture
) -> None:
    server = start_server(SERVER_BINARIES[real_backend], "--maxmemory-policy", "allkeys-lru")
    try:
        with caplog.at_level(logging.WARNING, logger="handoffbus"):
            async with HandoffBus.connect(server.url):
                pass
    finally:
        server.stop()
    assert any("maxmemory-policy is allkeys-lru" in r.getMessage() for r in caplog.records)
