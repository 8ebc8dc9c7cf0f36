"""Requests that reuse a request id, or are refused: nothing happens to the handoff already
under that id, and nothing of the refused request stays behind."""

from __future__ import annotations

import contextvars
from typing import Any

import anyio
import pytest

from handoffbus import (
    HandoffBus,
    HandoffClient,
    HandoffHandle,
    HandoffNotFound,
    HandoffRequest,
    HandoffStatus,
    InvalidRequest,
    QueueFull,
    RequestConflict,
    TooManyPending,
)
from handoffbus.routing import capability_set, set_id
from handoffbus.workers.inbox import Inbox

from .conftest import make_bus
from .helpers import req

pytestmark = pytest.mark.anyio


def routed(request_id: str, caps: list[str]) -> HandoffRequest:
    return HandoffRequest(from_agent="alice", capabilities_required=caps, request_id=request_id, timeout=60)



async def completed_and_heard(target: HandoffClient, handle: HandoffHandle) -> None:
    """``target`` accepts and completes the handoff; its handle hears so from the response
    stream, not at the 30 s safety re-read."""
    await target.accept_handoff(handle.handoff_id)
    await target.complete_handoff(handle.handoff_id, result="done")
    with anyio.fail_after(5):
        assert (await handle.outcome()).result == "done"

async def test_a_request_id_may_not_look_like_a_routing_offer(bus: HandoffBus) -> None:
    # the deadline index keeps a routed handoff's offer as "o:<request id>"
    with pytest.raises(InvalidRequest, match="reserved"):
        await bus.client("alice").request_handoff(req("alice", "bob", request_id="o:x"))
    assert await bus.client("alice").get_handoff_status("alice/o:x") is None


@pytest.mark.parametrize("fail_fast", [False, True])
async def test_a_conflicting_routed_request_leaves_the_original_alone(bus: HandoffBus, fail_fast: bool) -> None:
    alice = bus.client("alice")
    await alice.request_handoff(routed("r1", ["gpu"]))
    with pytest.raises(RequestConflict):
        await alice.request_handoff(routed("r1", ["text"]), fail_fast=fail_fast)
    record = await alice.get_handoff_status("alice/r1")
    assert record is not None and record.status is HandoffStatus.PENDING  # not REJECTED NO_CAPABLE_AGENT
    # nor offered to agents of the other request's capabilities
    assert await bus.redis.zrange(bus.keys.route(set_id("text")).queue, 0, -1) == []
    assert await bus.redis.zrange(bus.keys.route(set_id("gpu")).queue, 0, -1) == [b"alice/r1"]


async def test_a_decided_handoff_resubmitted_is_never_queued_again(bus: HandoffBus) -> None:
    alice, bob = bus.client("alice"), bus.client("bob")
    first = await alice.request_handoff(req("alice", "bob", request_id="r1"))
    await bob.accept_handoff(first.handoff_id)  # settled: out of bob's queue
    sent: list[str] = []
    batcher = bus._batcher
    assert batcher is not None
    call_many, call = batcher.call_many, batcher.call

    async def recording(batch: list[tuple[Any, list[str], list[Any]]]) -> list[Any]:
        sent.extend(script.name for script, _, _ in batch)
        return await call_many(batch)

    async def recording_one(script: Any, keys: list[str], args: list[Any]) -> Any:
        sent.append(script.name)
        return await call(script, keys, args)

    batcher.call_many = recording  # type: ignore[method-assign]
    batcher.call = recording_one  # type: ignore[method-assign]
    again = await alice.request_handoff(req("alice", "bob", request_id="r1"))
    assert (await again.decision()).status is HandoffStatus.ACCEPTED
    # queued again, a worker of bob's could take it and run the work a second time
    assert "enqueue" not in sent and sent[0] == "request"


async def test_a_failed_resubmission_keeps_the_first_handle_listening(bus: HandoffBus) -> None:
    alice, bob = bus.client("alice"), bus.client("bob")
    handle = await alice.request_handoff(req("alice", "bob", request_id="r1"))
    with pytest.raises(RequestConflict):
        await alice.request_handoff(req("alice", "bob", request_id="r1", reason="something else"))
    await bob.accept_handoff(handle.handoff_id)
    with anyio.fail_after(5):  # pushed at once, not found by the 30 s safety re-read
        assert (await handle.decision()).status is HandoffStatus.ACCEPTED


@pytest.mark.parametrize("backend", ["memory", "valkey"])
async def test_the_request_says_why_before_a_full_queue_does(backend: str, servers: dict) -> None:
    async with make_bus(backend, servers, max_queued=1) as bus:
        alice, bob = bus.client("alice"), bus.client("bob")
        first = await alice.request_handoff(req("alice", "bob", request_id="r1"))
        await bob.accept_handoff(first.handoff_id)
        await bob.complete_handoff(first.handoff_id, result="done")
        await alice.request_handoff(req("alice", "bob", request_id="r2"))  # bob's queue is full now
        # a finished handoff resubmitted: its outcome, not "queue full, retry later"
        again = await alice.request_handoff(req("alice", "bob", request_id="r1"))
        with anyio.fail_after(5):
            assert (await again.outcome()).result == "done"
        # a reused id with another request: the conflict, whatever the queue
        with pytest.raises(RequestConflict):
            await alice.request_handoff(req("alice", "bob", request_id="r2", reason="another"))
        with pytest.raises(QueueFull):  # a new request does meet the full queue
            await alice.request_handoff(req("alice", "bob", request_id="r3"))
        assert await alice.get_handoff_status("alice/r3") is None


async def test_a_resubmission_that_joined_a_handoff_keeps_it_when_its_creator_withdraws(
    backend: str, servers: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The creator meets a full queue and takes its new record back; the same request, sent
    again in between, found that record PENDING and queued it once there was room. The record
    stays, for the resubmission's handle to hear its outcome."""
    async with make_bus(backend, servers, max_queued=1) as bus:
        alice, bob = bus.client("alice"), bus.client("bob")
        filler = await alice.request_handoff(req("alice", "bob", request_id="filler"))  # bob's queue is full
        joined = []
        script = bus.script

        async def resubmitted_before_the_withdraw(name: str, keys: list[str], args: list[Any]) -> Any:
            if name == "withdraw" and not joined:
                await bus.redis.zrem(bus.keys.target("bob").queue, filler.handoff_id)  # room again
                joined.append(await alice.request_handoff(req("alice", "bob", request_id="r1")))
            return await script(name, keys, args)

        monkeypatch.setattr(bus, "script", resubmitted_before_the_withdraw)
        with pytest.raises(QueueFull):
            await alice.request_handoff(req("alice", "bob", request_id="r1"))
        [handle] = joined
        record = await alice.get_handoff_status(handle.handoff_id)
        assert record is not None and record.status is HandoffStatus.PENDING
        _, [taken] = await Inbox(bus, "bob", "w").take(5)
        assert taken.handoff_id == handle.handoff_id
        await bob.accept_handoff(handle.handoff_id)
        await bob.complete_handoff(handle.handoff_id, result="done")
        with anyio.fail_after(5):
            assert (await handle.outcome()).result == "done"


async def test_a_failing_request_leaves_the_waiter_of_its_twin_under_way(backend: str, servers: dict) -> None:
    """Two tasks send the same request at once. The one that created it meets a full queue and
    fails; the other joined it, queued it once there was room, and holds a handle: the failure
    must not take the waiter that handle is fed through."""
    async with make_bus(backend, servers, max_queued=1) as bus:
        alice, bob = bus.client("alice"), bus.client("bob")
        filler = await alice.request_handoff(req("alice", "bob", request_id="filler"))  # bob's queue is full
        sender: contextvars.ContextVar[str] = contextvars.ContextVar("sender")
        created, joined, failed = anyio.Event(), anyio.Event(), anyio.Event()
        scripts_many = bus.scripts_many

        async def interleaved(calls: list[tuple[str, list[str], list[Any]]]) -> list[Any]:
            name = calls[0][0]
            if sender.get() == "twin" and name == "request":
                await created.wait()
            if sender.get() == "creator" and name == "enqueue":
                await joined.wait()
            if sender.get() == "twin" and name == "enqueue":
                await failed.wait()
                await bus.redis.zrem(bus.keys.target("bob").queue, filler.handoff_id)  # room again
            replies = await scripts_many(calls)
            if name == "request":
                (created if sender.get() == "creator" else joined).set()
            return replies

        bus.scripts_many = interleaved  # type: ignore[method-assign]
        results: dict[str, Any] = {}

        async def send(name: str) -> None:
            sender.set(name)
            try:
                results[name] = await alice.request_handoff(req("alice", "bob", request_id="r1"))
            except QueueFull as exc:
                results[name] = exc
            finally:
                if name == "creator":
                    failed.set()

        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                tg.start_soon(send, "creator")
                tg.start_soon(send, "twin")
        bus.scripts_many = scripts_many  # type: ignore[method-assign]
        assert isinstance(results["creator"], QueueFull)
        await completed_and_heard(bob, results["twin"])


async def test_a_handle_that_finds_nothing_leaves_the_waiter_of_a_request_under_way(
    backend: str, servers: dict
) -> None:
    """A handle on an id not requested yet asks the server and finds nothing, while a request of
    that id is on its way: the handle is told so, and the request's own handle still hears its
    responses."""
    async with make_bus(backend, servers) as bus:
        alice, bob = bus.client("alice"), bus.client("bob")
        early = alice.handle("alice/r1")
        asked, told = anyio.Event(), anyio.Event()
        scripts_many = bus.scripts_many

        async def held(calls: list[tuple[str, list[str], list[Any]]]) -> list[Any]:
            if calls[0][0] == "request":  # the request is under way, its record not written yet
                asked.set()
                await told.wait()
            return await scripts_many(calls)

        bus.scripts_many = held  # type: ignore[method-assign]
        results: dict[str, Any] = {}

        async def send() -> None:
            results["handle"] = await alice.request_handoff(req("alice", "bob", request_id="r1"))

        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                tg.start_soon(send)
                await asked.wait()
                with pytest.raises(HandoffNotFound):
                    await early.decision()  # its deadline unknown: it asks the server at once
                told.set()
        bus.scripts_many = scripts_many  # type: ignore[method-assign]
        await completed_and_heard(bob, results["handle"])


async def test_a_resubmission_never_leaves_a_queue_entry_for_a_handoff_decided_meanwhile(
    backend: str, servers: dict
) -> None:
    """A resubmission finds its handoff PENDING and queues it again (its first queue entry may
    be lost); between the two round trips the agent accepts it. The entry just added is taken
    back: it would be served again, or sit in the queue for good."""
    async with make_bus(backend, servers) as bus:
        alice, bob = bus.client("alice"), bus.client("bob")
        first = await alice.request_handoff(req("alice", "bob", request_id="r1"))
        await bus.redis.zrem(bus.keys.target("bob").queue, first.handoff_id)  # say its queue entry was lost
        scripts_many = bus.scripts_many

        async def accepted_between(calls: list[tuple[str, list[str], list[Any]]]) -> list[Any]:
            if calls[0][0] == "enqueue":
                await bob.accept_handoff(first.handoff_id)  # taken by bob some other way meanwhile
            return await scripts_many(calls)

        bus.scripts_many = accepted_between  # type: ignore[method-assign]
        again = await alice.request_handoff(req("alice", "bob", request_id="r1"))
        bus.scripts_many = scripts_many  # type: ignore[method-assign]
        assert await bus.redis.zcard(bus.keys.target("bob").queue) == 0
        await bob.complete_handoff(first.handoff_id, result="done")
        with anyio.fail_after(5):
            assert (await again.outcome()).result == "done"


async def test_a_routed_request_refused_at_the_cap_leaves_no_route_entry(backend: str, servers: dict) -> None:
    """A new id sends its record and its route in one round trip: the record refused, the route
    entry must go too (no handoff stands behind it, and capable agents would pull it for nothing)."""
    async with make_bus(backend, servers, max_pending=1) as bus:
        client = bus.client("req")
        await client.request_handoff(req("req", "slow-1"))  # at the cap now
        with pytest.raises(TooManyPending):
            await client.request_handoff(HandoffRequest(from_agent="req", capabilities_required=["x"], timeout=60))
        route = bus.keys.route(set_id(capability_set(["x"])))
        assert await bus.redis.zrange(route.queue, 0, -1) == []
        assert await bus.redis.hlen(route.meta) == 0
