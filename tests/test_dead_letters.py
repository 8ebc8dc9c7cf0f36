"""Poison handoffs go to the dead-letter stream; workers carry on; dead letters replay."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import pytest

from handoffbus import (
    DeadLetterAction,
    HandoffBus,
    HandoffNotFound,
    HandoffStatus,
    InvalidRequest,
    InvalidTransition,
    Keyring,
    SigningKey,
    deadletters,
)
from handoffbus.workers import Worker
from handoffbus.workers.inbox import Delivery, Inbox

from .agents import Echo
from .helpers import req, serve_until_done, serving

pytestmark = pytest.mark.anyio


async def test_an_undecodable_record_is_dead_lettered_and_the_worker_carries_on(bus: HandoffBus) -> None:
    client = bus.client("req")
    poison = await client.request_handoff(req("req", "echo-1", reason="poison", request_id="bad"))
    good = [await client.request_handoff(req("req", "echo-1", reason=f"ok{i}")) for i in range(3)]
    await bus.redis.set(bus.keys.record("req", "bad").envelope, b"\xc1 not a request")
    outcomes, worker = await serve_until_done(bus, Echo(), good)
    assert all(o.status is HandoffStatus.COMPLETED for o in outcomes)
    [dead] = await client.get_dead_letters("echo-1")
    assert dead.handoff_id == poison.handoff_id and dead.deliveries == 1
    assert "DecodeError" in dead.reason and dead.consumer == worker.consumer
    inbox = bus.keys.target("echo-1").inbox
    assert (await bus.redis.xpending(inbox, "workers"))["pending"] == 0  # acknowledged, not stuck


@asynccontextmanager
async def dead_lettering(bus: HandoffBus, entry_id: str) -> AsyncIterator[Worker]:
    """The ghost's inbox entry made to look delivered 8 times, and a worker of echo-1 that
    dead-letters it (max_deliveries 5): the block runs once the dead letter is there, the
    worker serving on until it ends."""
    inbox = bus.keys.target("echo-1").inbox
    await bus.redis.xclaim(inbox, "workers", "ghost", 0, [entry_id], idle=60_000, retrycount=7)
    async with serving(bus, Echo(), reclaim_idle=0.2, max_deliveries=5) as [worker]:
        with anyio.fail_after(10):
            while not await bus.client("req").get_dead_letters("echo-1"):
                await worker.wait_reclaim_pass()
        yield worker


async def test_an_entry_delivered_too_often_is_dead_lettered_then_replayed(bus: HandoffBus) -> None:
    client = bus.client("req")
    handle = await client.request_handoff(req("req", "echo-1", reason="crashy"))
    ghost = Inbox(bus, "echo-1", "ghost")  # a worker that took it and kept dying
    _, [taken] = await ghost.take(1)
    async with dead_lettering(bus, taken.entry_id):
        [dead] = await client.get_dead_letters("echo-1")
        assert dead.handoff_id == handle.handoff_id and dead.deliveries == 8
        record = await client.get_handoff_status(handle.handoff_id)
        assert record is not None and record.status is HandoffStatus.PENDING  # parked, not lost
        assert await client.replay_dead_letter("echo-1", dead.entry_id) == DeadLetterAction(
            handoff_id=handle.handoff_id, done=True, status=HandoffStatus.PENDING)
        with anyio.fail_after(10):
            outcome = await handle.outcome()
    assert outcome.status is HandoffStatus.COMPLETED
    assert await client.get_dead_letters("echo-1") == []
    with pytest.raises(HandoffNotFound):
        await client.replay_dead_letter("echo-1", dead.entry_id)


async def test_an_accepted_handoff_dead_lettered_then_replayed_is_taken_over(bus: HandoffBus) -> None:
    """A handoff accepted by a worker whose handling kept stopping workers: replayed, it is not
    queued (a worker takes no accepted work from the queue) but re-issued to the agent's inbox,
    where a live worker takes it over once idle and finishes it."""
    client = bus.client("req")
    handle = await client.request_handoff(req("req", "echo-1", reason="accepted, then crashy"))
    ghost = Inbox(bus, "echo-1", "ghost")
    _, [taken] = await ghost.take(1)
    await bus.client("echo-1")._transition("accept", handle.handoff_id, {"lease": "ghost"}, settle=False)
    await ghost.dead_letter(taken, "delivered 8 times; its handling kept stopping workers", 8)
    [dead] = await client.get_dead_letters("echo-1")
    assert await client.replay_dead_letter("echo-1", dead.entry_id)  # true: issued again
    assert await bus.redis.zcard(bus.keys.target("echo-1").queue) == 0  # not queued
    echo = Echo()
    async with anyio.create_task_group() as tg:
        worker = Worker(bus, echo, reclaim_idle=0.2)
        await tg.start(worker.run)
        with anyio.fail_after(10):
            outcome = await handle.outcome()
        worker.drain()
    assert outcome.status is HandoffStatus.COMPLETED and echo.order == [handle.handoff_id]
    record = await client.get_handoff_status(handle.handoff_id)
    assert record is not None and record.attempt == 2  # taken over


async def test_a_dead_letter_whose_handoff_ended_or_that_names_none_is_dropped_and_says_why(
    bus: HandoffBus,
) -> None:
    client = bus.client("req")
    handle = await client.request_handoff(req("req", "echo-1", reason="crashy, then cancelled"))
    inbox = Inbox(bus, "echo-1", "ghost")
    _, [taken] = await inbox.take(1)
    await inbox.dead_letter(taken, "delivered 6 times; its handling kept stopping workers", 6)
    await client.cancel_handoff(handle.handoff_id)
    # hand-written queue members a worker dead-lettered as they were: they name no handoff
    for member in ("garbage", "", "\\xff/x"):
        await inbox.dead_letter(Delivery(handoff_id=member, entry_id="1-1"), "names no handoff", 1)
    replays = [await client.replay_dead_letter("echo-1", d.entry_id) for d in await client.get_dead_letters("echo-1")]
    assert replays == [
        DeadLetterAction(handoff_id=handle.handoff_id, done=False, status=HandoffStatus.CANCELLED),
        DeadLetterAction(handoff_id="garbage", done=False), DeadLetterAction(handoff_id="", done=False),
        DeadLetterAction(handoff_id="\\xff/x", done=False),
    ]
    assert not any(replays) and await client.get_dead_letters("echo-1") == []
    assert await bus.redis.zcard(bus.keys.target("echo-1").queue) == 0  # nothing queued


async def test_a_dead_letter_written_by_hand_is_listed_and_dropped_not_an_error(bus: HandoffBus) -> None:
    client = bus.client("req")
    stream = bus.keys.dead_letters("echo-1")
    bare = (await bus.redis.xadd(stream, {"note": "no fields of ours"})).decode()
    odd = (await bus.redis.xadd(stream, {"h": "req/x", "deliveries": "many", "reason": b"\xff"})).decode()
    listed = await client.get_dead_letters("echo-1")
    assert [(d.entry_id, d.handoff_id, d.reason, d.deliveries, d.consumer) for d in listed] == [
        (bare, "", "", 0, ""), (odd, "req/x", "\\xff", 0, "")]
    assert listed[0].at_ms == int(bare.split("-")[0])
    assert await client.replay_dead_letter("echo-1", bare) == DeadLetterAction(handoff_id="", done=False)
    # it names a handoff id of the right shape, whose record is gone: dropped alone, as any such
    assert await client.fail_dead_letter("echo-1", odd, "gone") == DeadLetterAction(handoff_id="req/x", done=False)
    assert await client.get_dead_letters("echo-1") == []


async def test_a_dead_letter_written_by_hand_with_an_overlong_count_is_listed_not_an_error(bus: HandoffBus) -> None:
    client = bus.client("req")
    stream = bus.keys.dead_letters("echo-1")
    entry = (await bus.redis.xadd(stream, {"h": "req/x", "deliveries": "9" * 5000})).decode()
    assert [(d.entry_id, d.handoff_id, d.deliveries) for d in await client.get_dead_letters("echo-1")] == [
        (entry, "req/x", 0)]


async def test_a_dead_lettered_accepted_handoff_can_be_failed_so_its_requester_hears(bus: HandoffBus) -> None:
    """Accepted work has no deadline and its requester may not cancel it: failing its dead
    letter ends it, and the requester's await wakes with FAILED."""
    client = bus.client("req")
    accepted, pending = [await client.request_handoff(req("req", "echo-1", reason=r)) for r in ("a", "p")]
    ghost = Inbox(bus, "echo-1", "ghost")
    _, taken = await ghost.take(2)
    await bus.client("echo-1")._transition("accept", accepted.handoff_id, {"lease": "ghost"}, settle=False)
    for delivery in taken:
        await ghost.dead_letter(delivery, "delivered 8 times; its handling kept stopping workers", 8)
    first, second = await client.get_dead_letters("echo-1")
    with pytest.raises(InvalidTransition, match="PENDING"):  # its requester's to cancel; it expires
        await client.fail_dead_letter("echo-1", second.entry_id, "given up")
    async with anyio.create_task_group() as tg:
        heard: list[HandoffStatus] = []

        async def await_outcome() -> None:
            heard.append((await accepted.outcome()).status)

        tg.start_soon(await_outcome)
        action = await client.fail_dead_letter("echo-1", first.entry_id, "given up: it kept stopping workers")
    assert action == DeadLetterAction(handoff_id=accepted.handoff_id, done=True, status=HandoffStatus.FAILED)
    assert heard == [HandoffStatus.FAILED]
    record = await client.get_handoff_status(accepted.handoff_id)
    assert record is not None and record.response.error == "given up: it kept stopping workers"
    assert [d.entry_id for d in await client.get_dead_letters("echo-1")] == [second.entry_id]  # kept
    await pending.cancel()  # then it ended: its dead letter is dropped alone
    assert await client.fail_dead_letter("echo-1", second.entry_id, "given up") == DeadLetterAction(
        handoff_id=pending.handoff_id, done=False, status=HandoffStatus.CANCELLED)
    assert await client.get_dead_letters("echo-1") == []


async def test_a_stale_dead_letter_of_a_handoff_taken_again_is_dropped_not_acted_on(bus: HandoffBus) -> None:
    """Dead-lettered PENDING, then sent again by their requester and taken, one accepted, by a
    live worker: failing a dead letter would fail live work, replaying it deliver it twice."""
    client, keys = bus.client("req"), bus.keys.target("echo-1")
    handles = [await client.request_handoff(req("req", "echo-1", request_id=f"job-{i}")) for i in (1, 2)]
    ghost = Inbox(bus, "echo-1", "ghost")
    for taken in (await ghost.take(2))[1]:
        await ghost.dead_letter(taken, "delivered 6 times; its handling kept stopping workers", 6)
    for i in (1, 2):  # sent again: queued again
        await client.request_handoff(req("req", "echo-1", request_id=f"job-{i}"))
    assert len((await Inbox(bus, "echo-1", "live").take(2))[1]) == 2
    accepted, pending = handles
    await bus.client("echo-1")._transition("accept", accepted.handoff_id, {"lease": "live"}, settle=False)
    first, second = await client.get_dead_letters("echo-1")
    assert await client.fail_dead_letter("echo-1", first.entry_id, "given up") == DeadLetterAction(
        handoff_id=accepted.handoff_id, done=False, status=HandoffStatus.ACCEPTED, held=True)
    record = await client.get_handoff_status(accepted.handoff_id)
    assert record is not None and record.status is HandoffStatus.ACCEPTED and record.lease == "live"
    assert await client.replay_dead_letter("echo-1", second.entry_id) == DeadLetterAction(
        handoff_id=pending.handoff_id, done=False, status=HandoffStatus.PENDING, held=True)
    assert (await bus.redis.xpending(keys.inbox, "workers"))["pending"] == 2  # the live worker's only
    assert await bus.redis.zcard(keys.queue) == 0 and await client.get_dead_letters("echo-1") == []


async def test_a_dead_letter_of_a_handoff_another_agent_accepted_since_is_dropped(bus: HandoffBus) -> None:
    """A routed handoff dead-lettered by one agent and routed on, then accepted by another:
    neither failing (not that agent's to fail) nor replaying it (an entry no worker of the
    first agent could take over) would do anything but mislead."""
    client = bus.client("req")
    handle = await client.request_handoff(req("req", "echo-1"))
    await bus.client("echo-1").accept_handoff(handle.handoff_id)
    first = Inbox(bus, "first-1", "ghost")
    stale, again = [await first.dead_letter(Delivery(handoff_id=handle.handoff_id, entry_id=f"1-{i}"),
                                            "delivered 6 times; its handling kept stopping workers", 6) for i in (1, 2)]
    accepted_elsewhere = DeadLetterAction(handoff_id=handle.handoff_id, done=False, status=HandoffStatus.ACCEPTED,
                                          held=True)
    assert await client.fail_dead_letter("first-1", stale.decode(), "given up") == accepted_elsewhere
    assert await client.replay_dead_letter("first-1", again.decode()) == accepted_elsewhere
    keys = bus.keys.target("first-1")
    assert await bus.redis.hlen(keys.inflight) == 0 and await client.get_dead_letters("first-1") == []


async def test_an_accepted_handoff_whose_record_cannot_be_decoded_can_be_failed(bus: HandoffBus) -> None:
    client = bus.client("req")
    handle = await client.request_handoff(req("req", "echo-1", request_id="bad"))
    ghost = Inbox(bus, "echo-1", "ghost")
    _, [taken] = await ghost.take(1)
    await bus.client("echo-1")._transition("accept", handle.handoff_id, {"lease": "ghost"}, settle=False)
    await bus.redis.set(bus.keys.record("req", "bad").envelope, b"\xc1 not a request")
    await ghost.dead_letter(taken, "DecodeError: its record cannot be decoded", 1)
    [dead] = await client.get_dead_letters("echo-1")
    action = await client.fail_dead_letter("echo-1", dead.entry_id, "its record cannot be decoded")
    assert action == DeadLetterAction(handoff_id=handle.handoff_id, done=True, status=HandoffStatus.FAILED)
    assert await client.get_dead_letters("echo-1") == []


async def test_a_replay_that_a_fail_overtook_leaves_nothing_in_flight(
    bus: HandoffBus, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two operators at once: the fail lands between the replay's read and its admit. The
    replay takes back its admit of the now FAILED handoff, and says it did nothing."""
    client, keys = bus.client("req"), bus.keys.target("echo-1")
    handle = await client.request_handoff(req("req", "echo-1"))
    ghost = Inbox(bus, "echo-1", "ghost")
    _, [taken] = await ghost.take(1)
    await bus.client("echo-1")._transition("accept", handle.handoff_id, {"lease": "ghost"}, settle=False)
    await ghost.dead_letter(taken, "delivered 8 times; its handling kept stopping workers", 8)
    [dead] = await client.get_dead_letters("echo-1")
    read, failed = deadletters._read, []

    async def then_failed(*args: Any) -> Any:
        found = await read(*args)
        if not failed:  # the replay's read; the other operator's fail goes first
            monkeypatch.setattr(deadletters, "_read", read)
            failed.append(await client.fail_dead_letter("echo-1", dead.entry_id, "given up"))
        return found

    monkeypatch.setattr(deadletters, "_read", then_failed)
    replayed = await client.replay_dead_letter("echo-1", dead.entry_id)
    assert failed == [DeadLetterAction(handoff_id=handle.handoff_id, done=True, status=HandoffStatus.FAILED)]
    assert replayed == DeadLetterAction(handoff_id=handle.handoff_id, done=False, status=HandoffStatus.FAILED)
    assert await bus.redis.hlen(keys.inflight) == 0
    assert (await bus.redis.xpending(keys.inbox, "workers"))["pending"] == 0


async def test_a_dead_letter_is_not_failed_by_a_bus_that_cannot_sign_for_its_agent(bus: HandoffBus) -> None:
    bus.keyring = Keyring([SigningKey(key_id="k-1", agent="req", secret=b"s" * 32)])  # verifies, signs as req only
    with pytest.raises(InvalidRequest, match="no signing key of 'echo-1'"):
        await bus.client("req").fail_dead_letter("echo-1", "1-0", "given up")


async def _burst_latencies(bus: HandoffBus, n: int, tag: str) -> list[float]:
    """Request ``n`` handoffs at once; each one's time from request to outcome (seconds)."""
    client = bus.client("req")
    latencies: list[float] = []

    async def one(i: int) -> None:
        started = anyio.current_time()
        handle = await client.request_handoff(req("req", "echo-1", reason=f"{tag}{i}"))
        assert (await handle.outcome()).status is HandoffStatus.COMPLETED
        latencies.append(anyio.current_time() - started)

    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            for i in range(n):
                tg.start_soon(one, i)
    return sorted(latencies)


async def _burst_with_new_worker(bus: HandoffBus, n: int, tag: str, dead_letters: int = 0) -> list[float]:
    """A burst served by a new worker, which then runs until ``dead_letters`` are dead-lettered."""
    async with anyio.create_task_group() as tg:
        worker = Worker(bus, Echo(), concurrency=16, reclaim_idle=0.2, max_deliveries=5)
        await tg.start(worker.run)
        latencies = await _burst_latencies(bus, n, tag)
        with anyio.fail_after(10):
            while len(await bus.client("req").get_dead_letters("echo-1")) < dead_letters:
                await worker.wait_reclaim_pass()
        worker.drain()
    return latencies


def _p99(latencies: list[float]) -> float:
    return latencies[int(0.99 * len(latencies))]


async def test_poison_entries_do_not_hold_up_the_others(real_backend: str, servers: dict) -> None:
    from .conftest import make_bus

    async with make_bus(real_backend, servers) as bus:
        client = bus.client("req")
        await _burst_with_new_worker(bus, 100, "warm")
        # every measured burst starts a new worker, so they differ only in the poisons; two clean
        # ones, as one burst's p99 varies by a quarter from run to run
        cleans = [await _burst_with_new_worker(bus, 500, "clean1"), await _burst_with_new_worker(bus, 500, "clean2")]
        p99_clean = max(_p99(burst) for burst in cleans)
        # two poisons ahead of the next burst: an undecodable record, and an entry whose
        # handling already stopped workers 7 times (pending with a ghost consumer)
        crashy = await client.request_handoff(req("req", "echo-1", reason="crashy", priority=-5))
        _, [taken] = await Inbox(bus, "echo-1", "ghost").take(1)
        inbox = bus.keys.target("echo-1").inbox
        await bus.redis.xclaim(inbox, "workers", "ghost", 0, [taken.entry_id], idle=60_000, retrycount=7)
        await client.request_handoff(req("req", "echo-1", reason="p", request_id="bad", priority=-5))
        await bus.redis.set(bus.keys.record("req", "bad").envelope, b"\xc1 not a request")
        poisoned = await _burst_with_new_worker(bus, 500, "poisoned", dead_letters=2)
        dead = {d.handoff_id: d for d in await client.get_dead_letters("echo-1")}
    p99_poisoned = _p99(poisoned)
    print(f"\np99 request-to-outcome over 500 handoffs: clean {p99_clean * 1000:.1f} ms, "
          f"with 2 poison entries {p99_poisoned * 1000:.1f} ms ({p99_poisoned / p99_clean:.2f}x)")
    assert set(dead) == {"req/bad", crashy.handoff_id} and dead[crashy.handoff_id].deliveries == 8
    # the others unaffected: within twice the slower clean burst's p99, with 100 ms for a busy machine
    assert p99_poisoned <= 2 * p99_clean + 0.1


async def _taken_then_restored(bus: HandoffBus) -> tuple[str, Inbox, Delivery, str]:
    """A handoff taken by a worker ("ghost"), then its group deleted and restored: the handoff
    id, the ghost's inbox, what it took, and the entry re-issued for it."""
    handle = await bus.client("req").request_handoff(req("req", "echo-1", reason="poison"))
    ghost = Inbox(bus, "echo-1", "ghost")
    _, [taken] = await ghost.take(1)
    assert await bus.redis.xgroup_destroy(bus.keys.target("echo-1").inbox, "workers") == 1
    assert await ghost.restore() == 1
    [reissued] = (await ghost.entries([handle.handoff_id])).values()
    assert reissued != taken.entry_id
    return handle.handoff_id, ghost, taken, reissued


async def test_a_dead_letter_after_the_group_was_restored_leaves_no_entry_behind(bus: HandoffBus) -> None:
    """A worker dead-letters what it took, but the group was deleted and restored meanwhile:
    the handoff's entry is the re-issued one now, and that is the one acknowledged and deleted
    (the taken entry's id names nothing any more)."""
    handoff_id, ghost, taken, _ = await _taken_then_restored(bus)
    await ghost.dead_letter(taken, "no request", 1)
    [dead] = await bus.client("req").get_dead_letters("echo-1")
    assert dead.handoff_id == handoff_id
    keys = bus.keys.target("echo-1")
    assert await bus.redis.xlen(keys.inbox) == 0  # no entry left for a reclaim to deliver again
    assert (await bus.redis.xpending(keys.inbox, "workers"))["pending"] == 0
    assert await bus.redis.hlen(keys.inflight) == 0


async def test_a_dead_letter_leaves_a_later_delivery_held_by_another_worker(bus: HandoffBus) -> None:
    """The handoff's current entry is another consumer's (re-issued, then adopted by a live
    worker): the slow worker's dead letter acknowledges its own entry only."""
    handoff_id, ghost, taken, reissued = await _taken_then_restored(bus)
    keys = bus.keys.target("echo-1")
    await bus.redis.xclaim(keys.inbox, "workers", "other", 0, [reissued])  # adopted by a live worker
    await ghost.dead_letter(taken, "no request", 1)
    pending = await bus.redis.xpending_range(keys.inbox, "workers", min="-", max="+", count=10)
    assert [(p["message_id"].decode(), p["consumer"]) for p in pending] == [(reissued, b"other")]
    assert await ghost.entries([handoff_id]) == {handoff_id: reissued}


async def test_the_cap_never_trims_the_dead_letter_of_an_accepted_handoff(bus: HandoffBus) -> None:
    """An ACCEPTED handoff has no deadline and its requester may not cancel it: its dead letter
    is all that brings it to an end. Later dead letters past the cap trim the others, oldest
    first, never that one, which can still be failed so its requester hears."""
    client = bus.client("req")
    handle = await client.request_handoff(req("req", "echo-1", reason="accepted, then crashy"))
    ghost = Inbox(bus, "echo-1", "ghost")  # accepted it, then its handling kept stopping workers
    _, [taken] = await ghost.take(1)
    await bus.client("echo-1")._transition("accept", handle.handoff_id, {"lease": "ghost"}, settle=False)
    async with dead_lettering(bus, taken.entry_id):
        pass
    [accepted] = await client.get_dead_letters("echo-1")
    flood = Inbox(bus, "echo-1", "flood")
    for i in range(350):  # poison PENDING work after it, well past a cap of 10
        await flood.dead_letter(Delivery(handoff_id=f"req/gone-{i}", entry_id="1-1"), "no request", 1, cap=10)
    letters = await client.get_dead_letters("echo-1", count=1000)
    assert accepted in letters  # kept: the only trace of live work
    assert len(letters) <= 10 + 1 + 100  # the others capped (as MAXLEN ~: within one stream node)
    assert letters[-1].handoff_id == "req/gone-349"  # the newest kept
    action = await client.fail_dead_letter("echo-1", accepted.entry_id, "given up")
    assert action == DeadLetterAction(handoff_id=handle.handoff_id, done=True, status=HandoffStatus.FAILED)
    with anyio.fail_after(10):
        assert (await handle.outcome()).status is HandoffStatus.FAILED
