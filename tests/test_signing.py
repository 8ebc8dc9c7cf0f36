"""Signed handoffs: a worker checks every request's HMAC before decoding it, and refuses
unsigned, spoofed, tampered, unknown-key and replayed requests before any hook runs."""

from __future__ import annotations

import os
import time
from typing import Any

import anyio
import msgspec
import pytest

from handoffbus import HandoffRequest, HandoffStatus, Keyring, SignatureInvalid, SigningKey, Worker
from handoffbus.signing import response_body, unsigned_response
from handoffbus.workers import Accept, Agent, ReceivedHandoff

from .conftest import make_bus, new_prefix
from .helpers import req

pytestmark = pytest.mark.anyio

SECRETS = {name: os.urandom(32) for name in ("req-1", "req-2", "worker", "mallory")}
REQ_OLD = SigningKey(key_id="req-1", agent="req", secret=SECRETS["req-1"])
REQ_NEW = SigningKey(key_id="req-2", agent="req", secret=SECRETS["req-2"])
WORKER = SigningKey(key_id="w-1", agent="watch-1", secret=SECRETS["worker"])
MALLORY = SigningKey(key_id="m-1", agent="mallory", secret=SECRETS["mallory"])


class Watchful(Agent):
    agent_id = "watch-1"

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    async def on_handoff_request(self, request: HandoffRequest) -> Accept:
        self.calls.append(f"decide {request.reason}")
        return Accept()

    async def on_handoff_received(self, handoff: ReceivedHandoff) -> Any:
        self.calls.append(f"work {handoff.request.reason}")
        return "ok"


async def run_case(real_backend: str, servers: dict, verifier: Keyring, sender: Keyring | None,
                   tamper: bool = False, signed_ago: float = 0.0) -> tuple[Watchful, list[str], HandoffStatus]:
    """One request from a sender bus (its keyring, or none), handled by a worker whose bus
    verifies with ``verifier``; the hook calls, dead-letter reasons and the record's status."""
    prefix = new_prefix()
    agent = Watchful()
    async with make_bus(real_backend, servers, prefix=prefix, keyring=verifier) as worker_bus, \
            make_bus(real_backend, servers, prefix=prefix, keyring=sender) as sender_bus:
        client = sender_bus.client("req")
        if signed_ago:
            client._clock = (await sender_bus.server_time_ms() - int(signed_ago * 1000), time.monotonic())
        handle = await client.request_handoff(req("req", "watch-1", reason="r"))
        if tamper:
            key = sender_bus.keys.record("req", handle.request_id).envelope
            env = bytearray(await sender_bus.redis.get(key))
            env[-1] ^= 0x01  # one flipped bit in the stored payload
            await sender_bus.redis.set(key, bytes(env))
        async with anyio.create_task_group() as tg:
            worker = Worker(worker_bus, agent, reclaim_idle=0.3)
            await tg.start(worker.run)
            with anyio.fail_after(10):
                while True:
                    dead = await worker_bus.client("watch-1").get_dead_letters("watch-1")
                    record = await worker_bus.client("req").get_handoff_status(handle.handoff_id)
                    if dead or (record is not None and record.status is HandoffStatus.COMPLETED):
                        break
                    await worker.wait_reclaim_pass()
            worker.drain()
        assert record is not None
    return agent, [d.reason for d in dead], record.status


async def test_a_signed_request_is_handled(real_backend: str, servers: dict) -> None:
    ring = Keyring([REQ_NEW, WORKER])
    agent, dead, status = await run_case(real_backend, servers, ring, ring)
    assert status is HandoffStatus.COMPLETED and dead == [] and agent.calls == ["decide r", "work r"]


@pytest.mark.parametrize(("case", "sender", "kwargs", "reason"), [
    ("unsigned", None, {}, "unsigned"),
    ("spoofed sender", Keyring([SigningKey(key_id="m-1", agent="req", secret=SECRETS["mallory"])]), {},
     "spoofed sender: key 'm-1' belongs to 'mallory'"),
    ("flipped byte", Keyring([REQ_NEW]), {"tamper": True}, "bad signature"),
    ("unknown key id", Keyring([SigningKey(key_id="k-9", agent="req", secret=os.urandom(32))]), {},
     "unknown key id 'k-9'"),
    ("replayed", Keyring([REQ_NEW]), {"signed_ago": 600.0}, "outside the replay window"),
])
async def test_a_bad_request_is_dead_lettered_before_any_hook(
    real_backend: str, servers: dict, case: str, sender: Keyring | None, kwargs: dict, reason: str
) -> None:
    verifier = Keyring([REQ_NEW, WORKER, MALLORY], replay_window=300)
    agent, dead, status = await run_case(real_backend, servers, verifier, sender, **kwargs)
    assert agent.calls == []  # refused before the acceptance hook
    assert status is HandoffStatus.PENDING  # parked, not acted on; it expires at its deadline
    [why] = dead
    assert why.startswith("SignatureInvalid: signature check failed") and reason in why, why


async def test_key_rotation_overlap(real_backend: str, servers: dict) -> None:
    overlap = Keyring([REQ_OLD, REQ_NEW, WORKER])
    for sender in (Keyring([REQ_OLD]), Keyring([REQ_NEW])):  # both keys verify during the overlap
        _, dead, status = await run_case(real_backend, servers, overlap, sender)
        assert status is HandoffStatus.COMPLETED and dead == []
    retired = Keyring([REQ_NEW, WORKER])  # the old key removed: what it signs is refused
    _, dead, _ = await run_case(real_backend, servers, retired, Keyring([REQ_OLD]))
    assert len(dead) == 1 and "unknown key id 'req-1'" in dead[0]


async def test_a_resubmitted_signed_request_is_one_handoff(real_backend: str, servers: dict) -> None:
    ring = Keyring([REQ_NEW, WORKER])
    agent = Watchful()
    async with make_bus(real_backend, servers, keyring=ring) as bus:
        client = bus.client("req")
        request = req("req", "watch-1", reason="once")
        first = await client.request_handoff(request)
        async with anyio.create_task_group() as tg:
            worker = Worker(bus, agent)
            await tg.start(worker.run)
            with anyio.fail_after(10):
                await first.outcome()
            again = await client.request_handoff(msgspec.structs.replace(request, request_id=first.request_id))
            with anyio.fail_after(10):
                outcome = await again.outcome()
            worker.drain()
    assert again.handoff_id == first.handoff_id and outcome.status is HandoffStatus.COMPLETED
    assert agent.calls == ["decide once", "work once"]  # handled once


def test_keys_are_checked() -> None:
    with pytest.raises(Exception, match="at least 32 bytes"):
        SigningKey(key_id="k", agent="a", secret=b"short")
    with pytest.raises(Exception, match="invalid key id"):
        SigningKey(key_id="a.b", agent="a", secret=os.urandom(32))
    ring = Keyring([REQ_NEW])
    sig = ring.sign("req", "request", ["x"], b"body", 1000)
    ring.verify(sig, "req", "request", ["x"], b"body", 1000)
    for bad in (sig[:-1] + ("0" if sig[-1] != "0" else "1"), "v2" + sig[2:], "garbage", ""):
        with pytest.raises(SignatureInvalid):
            ring.verify(bad, "req", "request", ["x"], b"body", 1000)
    with pytest.raises(SignatureInvalid, match="bad signature"):
        ring.verify(sig, "req", "request", ["y"], b"body", 1000)  # another field


async def test_responses_are_signed_and_a_forged_one_is_not_believed(
    real_backend: str, servers: dict, caplog: pytest.LogCaptureFixture
) -> None:
    ring = Keyring([REQ_NEW, WORKER, MALLORY])
    mallory = Keyring([SigningKey(key_id="m-1", agent="watch-1", secret=SECRETS["mallory"])])
    agent = Watchful()
    async with make_bus(real_backend, servers, keyring=ring) as bus:
        client = bus.client("req")
        handle = await client.request_handoff(req("req", "watch-1", reason="real"))
        # a forged outcome, written straight into the requester's response stream
        forged = {"result": bus.codec.dumps_value("forged")}
        sig = mallory.sign("watch-1", "response", [handle.handoff_id, "COMPLETED", "watch-1"],
                           response_body(forged), 0)
        await bus.redis.xadd(bus.keys.responses("req"), {
            "id": handle.handoff_id, "status": "COMPLETED", "actor": "watch-1", "ts": "1", **forged, "sig": sig})
        # and one unsigned, in the name of the router (whose only unsigned verdict is NO_CAPABLE_AGENT)
        await bus.redis.xadd(bus.keys.responses("req"), {
            "id": handle.handoff_id, "status": "COMPLETED", "actor": "_router", "ts": "1", **forged})
        async with anyio.create_task_group() as tg:
            worker = Worker(bus, agent)
            await tg.start(worker.run)
            with anyio.fail_after(10):
                outcome = await handle.outcome()
            worker.drain()
        entries = [f for _, f in await bus.redis.xrange(bus.keys.responses("req"))
                   if f[b"id"] == handle.handoff_id.encode()]
        # the stored outcome altered afterwards: reading it back fails loudly
        await bus.redis.hset(bus.keys.record("req", handle.request_id).record, "result",
                             bus.codec.dumps_value("altered"))
        with pytest.raises(SignatureInvalid, match="bad signature"):
            await client.get_handoff_status(handle.handoff_id)
    assert outcome.status is HandoffStatus.COMPLETED and outcome.result == "ok"  # the worker's, not the forgery
    assert [f[b"status"] for f in entries] == [b"COMPLETED", b"COMPLETED", b"ACCEPTED", b"COMPLETED"]
    assert all(f[b"sig"].startswith(b"v1.w-1.") for f in entries[2:])  # the worker's key signed both
    assert any("undecodable response" in r.getMessage() for r in caplog.records)


def test_only_the_bus_own_verdicts_pass_unsigned() -> None:
    assert unsigned_response("EXPIRED", "bus", None)
    assert unsigned_response("REJECTED", "_router", "NO_CAPABLE_AGENT")
    # any other status or code under those names must be signed like an agent's
    assert not unsigned_response("COMPLETED", "_router", None)
    assert not unsigned_response("ACCEPTED", "_router", None)
    assert not unsigned_response("REJECTED", "_router", "BUSY")
    assert not unsigned_response("COMPLETED", "bus", None)
