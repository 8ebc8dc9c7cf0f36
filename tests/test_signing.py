"""Signed handoffs: a worker checks every request's HMAC before decoding it, and refuses
unsigned, spoofed, tampered, unknown-key and replayed requests before any hook runs."""

from __future__ import annotations

import os
import time
from typing import Any

import anyio
import msgspec
import pytest

from handoffbus import (
    EncodeError,
    HandoffBus,
    HandoffRequest,
    HandoffStatus,
    InvalidRequest,
    Keyring,
    SignatureInvalid,
    SigningKey,
    Worker,
)
from handoffbus.signing import response_body, unsigned_response
from handoffbus.workers import Accept, Agent, ReceivedHandoff

from .conftest import make_bus, new_prefix
from .helpers import req, serve_until_done

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
            sender_bus._clock = (await sender_bus.server_time_ms() - int(signed_ago * 1000), time.monotonic())
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


async def test_a_signed_request_that_waited_in_the_queue_past_the_window_is_handled(
        real_backend: str, servers: dict) -> None:
    # the window was measured to the worker's read: a queue longer than the window (5 min by
    # default) dead-lettered every request in it as stale, though none was a replay
    prefix = new_prefix()
    agent = Watchful()
    verifier = Keyring([REQ_NEW, WORKER], replay_window=0.1)
    async with make_bus(real_backend, servers, prefix=prefix, keyring=verifier) as bus:
        handle = await bus.client("req").request_handoff(req("req", "watch-1", reason="r"))
        await anyio.sleep(0.3)  # it waits in the queue longer than the window: the subject, not a sync
        [outcome], _ = await serve_until_done(bus, agent, [handle])
    assert outcome.status is HandoffStatus.COMPLETED and agent.calls == ["decide r", "work r"]


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
    assert all(f[b"sig"].startswith(b"v2.w-1.") for f in entries[2:])  # the worker's key signed both
    assert any("undecodable response" in r.getMessage() for r in caplog.records)


def test_only_the_bus_own_verdicts_pass_unsigned() -> None:
    assert unsigned_response("EXPIRED", "bus", None)
    assert unsigned_response("REJECTED", "_router", "NO_CAPABLE_AGENT")
    # any other status or code under those names must be signed like an agent's
    assert not unsigned_response("COMPLETED", "_router", None)
    assert not unsigned_response("ACCEPTED", "_router", None)
    assert not unsigned_response("REJECTED", "_router", "BUSY")
    assert not unsigned_response("COMPLETED", "bus", None)


async def _forge(bus: HandoffBus, ring: Keyring, case: str) -> str:
    """Write a forged handoff to ``watch-1`` and queue it; returns its handoff id."""
    if case == "copied under another id":
        # a signed request, copied whole (its id and signature too) under another request id
        orig = await bus.client("req").request_handoff(req("req", "watch-1", reason="orig"))
        src, dst = bus.keys.record("req", orig.request_id), bus.keys.record("req", "copy")
        await bus.redis.set(dst.envelope, await bus.redis.get(src.envelope))
        await bus.redis.set(dst.marker, "1", px=60_000)
        await bus.redis.hset(dst.record, mapping=await bus.redis.hgetall(src.record))
        hid = "req/copy"
    elif case == "in another agent's name":
        # mallory signs, in its own slot, a request that says it comes from "req"
        hid, keys = "mallory/spoof", bus.keys.record("mallory", "spoof")
        env = bus.codec.dumps(HandoffRequest(from_agent="req", to_agent="watch-1", reason="spoof",
                                             request_id="spoof", timeout=60.0))
        sig = ring.sign("mallory", "request", [hid, "mallory", "watch-1", "", "60000"], env,
                        await bus.server_time_ms())
        reply = await bus.script("request", keys.as_list(), [
            hid, "spoof", "mallory", "watch-1", 60_000, env, bus.config.retention_ms,
            bus.config.response_retention_ms, "fp", "", 0, 1000, 0, sig])
        assert int(reply[0]) == 1
    else:
        # mallory writes, in its own slot, a record that says watch-1 accepted it already
        hid, keys = "mallory/forged", bus.keys.record("mallory", "forged")
        now = await bus.server_time_ms()
        await bus.redis.set(keys.envelope, bus.codec.dumps(HandoffRequest(
            from_agent="mallory", to_agent="watch-1", reason="forged", request_id="forged", timeout=60.0)))
        await bus.redis.hset(keys.record, mapping={
            "id": hid, "from": "mallory", "to": "watch-1", "status": "ACCEPTED", "actor": "watch-1",
            "agent": "watch-1", "attempt": "1", "lease": "gone", "created": now, "updated": now,
            "deadline": now + 60_000, "hist": "[]"})
    assert await bus.enqueue("watch-1", hid, 0)
    return hid


@pytest.mark.parametrize("case", ["copied under another id", "in another agent's name", "already accepted"])
async def test_a_forged_handoff_runs_no_hook(real_bus: HandoffBus, case: str) -> None:
    """What a requester may write in its own slot does not make another agent work: a signed
    record copied under another id (the signature covers the record's id, not the key's), a
    request signed by one agent in another's name, a record that says the target accepted it
    already (taken from the queue, it is not taken over: that is for a stopped worker's own
    pending entries)."""
    ring = Keyring([REQ_NEW, WORKER, MALLORY])
    real_bus.keyring = ring
    agent = Watchful()
    hid = await _forge(real_bus, ring, case)
    after = await real_bus.client("req").request_handoff(req("req", "watch-1", reason="after"))
    async with anyio.create_task_group() as tg:
        worker = Worker(real_bus, agent, concurrency=1)  # one at a time, in queue order
        await tg.start(worker.run)
        with anyio.fail_after(10):
            assert (await after.outcome()).status is HandoffStatus.COMPLETED
        worker.drain()
    worked = [call for call in agent.calls if call not in ("decide orig", "work orig")]
    assert worked == ["decide after", "work after"], worked
    if case != "already accepted":  # poison: dead-lettered, its record left as it is
        dead = await real_bus.client("watch-1").get_dead_letters("watch-1")
        assert [d.handoff_id for d in dead] == [hid] and "InvalidRequest" in dead[0].reason


async def test_a_tampered_request_is_not_run_when_accepted_work_is_taken_over(real_backend: str, servers: dict) -> None:
    # the signature was checked only while PENDING: a request replaced after its acceptance (by
    # anyone who can write the requester's slot, the requester itself under isolation) ran when a
    # live worker took the work over from a dead one. A genuine one is taken over and completes.
    ring = Keyring([SigningKey(key_id="r-1", agent="req", secret=os.urandom(32)),
                    SigningKey(key_id="w-1", agent="watch-1", secret=os.urandom(32))])
    seen: list[str] = []
    working = anyio.Event()

    class Hangs(Agent):
        agent_id = "watch-1"

        async def on_handoff_received(self, handoff: ReceivedHandoff) -> Any:
            seen.append(handoff.request.reason)
            if len(seen) == 2:
                working.set()
            await anyio.sleep_forever()

    class Works(Hangs):
        async def on_handoff_received(self, handoff: ReceivedHandoff) -> Any:
            seen.append(handoff.request.reason)
            return "done"

    async with make_bus(real_backend, servers, keyring=ring) as bus:
        genuine, forged = [await bus.client("req").request_handoff(req("req", "watch-1", reason=reason))
                           for reason in ("genuine", "to be replaced")]
        async with anyio.create_task_group() as tg:
            await tg.start(Worker(bus, Hangs(), reclaim_idle=0.3).run)
            with anyio.fail_after(10):
                await working.wait()
            tg.cancel_scope.cancel()  # the worker dies mid-work
        key = bus.keys.record("req", forged.request_id).envelope
        stored = bus.codec.loads(await bus.redis.get(key), HandoffRequest)
        await bus.redis.set(key, bus.codec.dumps(msgspec.structs.replace(stored, reason="tampered")))  # not signed
        async with anyio.create_task_group() as tg:
            worker = Worker(bus, Works(), reclaim_idle=0.3)
            await tg.start(worker.run)
            with anyio.fail_after(10):
                assert (await genuine.outcome()).status is HandoffStatus.COMPLETED
                while not (letters := await bus.client("watch-1").get_dead_letters("watch-1")):
                    await worker.wait_reclaim_pass()
            worker.drain()
    assert sorted(seen) == ["genuine", "genuine", "to be replaced"]  # never "tampered"
    assert [d.handoff_id for d in letters] == [forged.handoff_id] and "bad signature" in letters[0].reason


async def test_a_signed_rejection_cannot_be_rewritten_into_a_redirect(real_bus: HandoffBus) -> None:
    """v1 joined a response's fields with a separator a field may hold: text could move from
    one field to another under the same signature (a reason's tail became a redirect)."""
    real_bus.keyring = Keyring([SigningKey(key_id="r-1", agent="req", secret=os.urandom(32)),
                                SigningKey(key_id="w-1", agent="watch-1", secret=os.urandom(32))])
    handle = await real_bus.client("req").request_handoff(req("req", "watch-1"))
    await real_bus.client("watch-1").reject_handoff(handle.handoff_id, "busy\x1f\x1f\x1fmallory")
    record_key = real_bus.keys.record("req", handle.request_id).record
    assert (await real_bus.redis.hget(record_key, "sig") or b"").startswith(b"v2.")
    await real_bus.redis.hset(record_key, mapping={"reason": "busy", "redirect": "mallory", "error": "\x1f\x1f\x1f"})
    with pytest.raises(SignatureInvalid):
        await real_bus.client("req").get_handoff_status(handle.handoff_id)


def test_a_v1_response_signature_stands_only_where_its_fields_are_unambiguous() -> None:
    """Responses signed before v2 (unit-separated fields) are still believed, unless a field
    holds the separator: then the same bytes could be other fields."""
    ring = Keyring([SigningKey(key_id="w-1", agent="watch-1", secret=os.urandom(32))])
    parts = ["req/x", "REJECTED", "watch-1"]
    plain = {"reason": "busy", "code": "FULL"}
    sig = ring.sign("watch-1", "response", parts, response_body(plain, "v1"), 0)
    ring.verify(sig, "watch-1", "response", parts, response_body(plain, "v1"), 0, window=False)
    mixed = {"reason": "busy\x1fx"}
    with pytest.raises(SignatureInvalid, match="ambiguous"):
        response_body(mixed, "v1")
    assert response_body(mixed) != response_body({"reason": "busy", "code": "x"})  # v2: lengths tell them apart


async def test_text_that_is_not_utf8_is_an_encode_error_with_a_keyring_too(real_bus: HandoffBus) -> None:
    real_bus.keyring = Keyring([SigningKey(key_id="a-1", agent="alice", secret=os.urandom(32)),
                                SigningKey(key_id="b-1", agent="bob", secret=os.urandom(32))])
    handle = await real_bus.client("alice").request_handoff(req("alice", "bob"))
    with pytest.raises(EncodeError):
        await real_bus.client("bob").reject_handoff(handle.handoff_id, "cannot read " + os.fsdecode(b"/data/\xff.txt"))


def test_a_signature_with_an_overlong_time_is_signature_invalid() -> None:
    ring = Keyring([SigningKey(key_id="k-1", agent="req", secret=os.urandom(32))])
    with pytest.raises(SignatureInvalid, match="malformed"):  # int() of 5,000 digits raised ValueError
        ring.verify(f"v1.k-1.{'9' * 5000}.{'0' * 64}", "req", "response", ["req/x", "COMPLETED", "req"], b"", 0,
                    window=False)


def test_a_text_secret_is_refused_when_the_key_is_made() -> None:
    with pytest.raises(InvalidRequest, match="must be bytes"):  # hmac raised TypeError at first use
        SigningKey(key_id="k-1", agent="req", secret="s" * 32)  # type: ignore[arg-type]


async def test_a_transition_that_cannot_be_signed_is_refused_before_it_is_written(real_bus: HandoffBus) -> None:
    """On a signing bus, a decision written unsigned would be refused by its requester (which
    raises SignatureInvalid) while the record moved on: the handoff would be ACCEPTED, or
    ended, under a decision nobody believes. Refused before anything is written instead."""
    real_bus.keyring = Keyring([SigningKey(key_id="a-1", agent="alice", secret=os.urandom(32))])
    handle = await real_bus.client("alice").request_handoff(req("alice", "bob"))
    with pytest.raises(InvalidRequest, match="no signing key of 'bob'"):
        await real_bus.client("bob").accept_handoff(handle.handoff_id)
    record = await real_bus.client("alice").get_handoff_status(handle.handoff_id)
    assert record is not None and record.status is HandoffStatus.PENDING


async def test_a_worker_without_its_agent_key_is_refused_at_once(real_bus: HandoffBus) -> None:
    real_bus.keyring = Keyring([REQ_NEW])  # verifies requests, but cannot sign for watch-1
    with pytest.raises(InvalidRequest, match="no signing key of 'watch-1'"):
        Worker(real_bus, Watchful())


async def test_a_response_replayed_from_an_earlier_handoff_under_the_same_id_is_not_believed(
    real_backend: str, servers: dict
) -> None:
    """A request id used again once its old record is gone: the old handoff's genuinely signed
    outcome, written into the response stream again, named the new handoff and verified (a
    response signature had no time bound). Now it must be signed within the replay window of
    the transition it claims to be: an old one is logged and not believed."""
    ring = Keyring([REQ_NEW, WORKER])
    async with make_bus(real_backend, servers, keyring=ring) as bus:
        handle = await bus.client("req").request_handoff(req("req", "watch-1", reason="again"))
        # the earlier handoff's outcome, signed by the worker's real key ten minutes ago
        old = {"result": bus.codec.dumps_value("the old result")}
        signed_at = await bus.server_time_ms() - 600_000
        sig = ring.sign("watch-1", "response", [handle.handoff_id, "COMPLETED", "watch-1"], response_body(old),
                        signed_at, "v2")
        await bus.redis.xadd(bus.keys.responses("req"), {
            "id": handle.handoff_id, "status": "COMPLETED", "actor": "watch-1", "ts": str(signed_at + 3),
            "agent": "watch-1", **old, "sig": sig})
        [outcome], _ = await serve_until_done(bus, Watchful(), [handle])
    assert outcome.result == "ok"  # the worker's own, not the replayed one


def test_a_key_never_shows_its_secret() -> None:
    secret = b"0123456789abcdef" * 2 + b"-the-secret"
    key = SigningKey(key_id="k-1", agent="req", secret=secret)
    shown = f"{key!r} {key} {Keyring([key])._by_id!r}"
    assert "the-secret" not in shown and "secret=<43 bytes>" in shown
