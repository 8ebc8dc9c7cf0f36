"""The requesters set does not keep every requester ever seen: the sweep unlists idle ones."""

from __future__ import annotations

from typing import Any

import anyio
import pytest

from handoffbus import BusConfig, HandoffBus, HandoffStatus, InvalidRequest, QueueFull
from handoffbus import sweeper as sweeper_module
from handoffbus.registered import Registered

from .agents import Echo
from .conftest import Servers, make_bus
from .helpers import req, serve_until_done

pytestmark = pytest.mark.anyio


async def listed(bus: HandoffBus, agent: str) -> bool:
    return bool(await bus.redis.sismember(bus.keys.requesters, agent))


async def age(bus: HandoffBus, agent: str) -> None:
    """Make ``agent``'s last response look as old as a requester idle for hours: what the idle
    check reads is the id of the stream's last entry, the time it was written."""
    stream = bus.keys.responses(agent)
    await bus.redis.delete(stream)
    await bus.redis.xadd(stream, {"status": "COMPLETED"}, id="1000-0")


async def finished(bus: HandoffBus, agent: str) -> None:
    """One handoff of ``agent``'s, completed: it is listed, and nothing of it is pending."""
    handle = await bus.client(agent).request_handoff(req(agent, "echo-1"))
    [outcome], _ = await serve_until_done(bus, Echo(), [handle])
    assert outcome.status is HandoffStatus.COMPLETED and await listed(bus, agent)


async def test_an_idle_requester_is_unlisted_and_a_busy_or_recent_one_is_not(bus: HandoffBus) -> None:
    for agent in ("idle", "recent", "waiting"):
        await finished(bus, agent)
    await age(bus, "idle")
    await age(bus, "waiting")
    await bus.client("waiting").request_handoff(req("waiting", "nobody", timeout=600))  # pending: not idle
    assert await bus.sweeper.unlist_idle() == 1
    assert [await listed(bus, a) for a in ("idle", "recent", "waiting")] == [False, True, True]
    # a requester with no response stream at all (its entries trimmed away, or written by hand) and nothing
    # pending is idle too
    await bus.redis.sadd(bus.keys.requesters, "never-answered")
    assert await bus.sweeper.unlist_idle() == 1 and not await listed(bus, "never-answered")


async def test_an_unlisted_requester_is_listed_again_by_its_next_request_and_swept(
    bus: HandoffBus, monkeypatch: pytest.MonkeyPatch,
) -> None:
    await finished(bus, "req")
    await age(bus, "req")
    assert await bus.sweeper.unlist_idle() == 1 and not await listed(bus, "req")
    monkeypatch.setattr(Registered, "AGAIN", 0.0)  # what over a minute without a request does to the memory of it
    handle = await bus.client("req").request_handoff(req("req", "nobody", timeout=0.2))
    assert await listed(bus, "req")
    with anyio.fail_after(10):
        while await bus.redis.zcard(bus.keys.deadlines("req")):  # the sweep expires it: it walks "req" again
            await bus.sweeper.wait_pass()
    assert (await handle.outcome()).status is HandoffStatus.EXPIRED


@pytest.mark.parametrize("failure", ["none", "lost", "slow"])
async def test_a_request_between_the_idle_check_and_the_removal_lists_its_requester_back(
    bus: HandoffBus, monkeypatch: pytest.MonkeyPatch, failure: str,
) -> None:
    """Caught by the second look, which follows the removal even when the SREM's own reply is
    lost with the connection, or later than the follow-up bound."""
    await finished(bus, "req")
    await age(bus, "req")
    client = bus.client("req")  # it listed "req" a moment ago, so this request lists nothing
    monkeypatch.setattr(sweeper_module, "FOLLOW_UP_WAIT", 0.5)
    real_srem = bus.redis.srem
    made: list[Any] = []

    async def srem_then_request(*args: Any) -> Any:
        removed = await real_srem(*args)
        made.append(await client.request_handoff(req("req", "nobody", timeout=600)))
        if failure == "lost":
            raise ConnectionError("lost")
        if failure == "slow":
            await anyio.sleep_forever()  # no reply before the bound
        return removed

    bus.redis.srem = srem_then_request  # type: ignore[method-assign]
    try:
        if failure == "lost":
            with pytest.raises(ConnectionError):
                await bus.sweeper.unlist_idle()
        else:
            assert await bus.sweeper.unlist_idle() == 0
    finally:
        del bus.redis.srem
    assert made and await listed(bus, "req")


@pytest.mark.parametrize("version", ["this", "older"])
async def test_a_sweep_between_a_requests_listing_and_its_record_leaves_the_requester_listed(
    bus: HandoffBus, monkeypatch: pytest.MonkeyPatch, version: str,
) -> None:
    """The sweep finds the requester idle and unlists it after a request listed it, before the
    record: this version lists it again once the record is written; a process of an older version
    does not (nor again for a minute), and the sweep's look a minute later lists it back."""
    await finished(bus, "req")
    await age(bus, "req")
    monkeypatch.setattr(Registered, "AGAIN", 0.0)  # the next request lists "req" (a minute went by)
    if version == "older":

        async def no_second_listing(agent: str) -> None:
            return None

        monkeypatch.setattr(bus, "relist_requester", no_second_listing)
    real_scripts_many = bus.scripts_many
    unlisted: list[int] = []

    async def sweep_first(calls: Any) -> Any:  # the request's record call: the sweep runs just before it
        if not unlisted and calls and calls[0][0] == "request":
            unlisted.append(await bus.sweeper.unlist_idle())
        return await real_scripts_many(calls)

    monkeypatch.setattr(bus, "scripts_many", sweep_first)
    handle = await bus.client("req").request_handoff(req("req", "nobody", timeout=0.2))
    assert unlisted == [1] and await listed(bus, "req") is (version == "this")
    if version == "older":
        monkeypatch.setattr(sweeper_module, "RECHECK_AFTER", 0.0)  # the look a minute later
        assert await bus.sweeper.recheck_unlisted() == 1 and await listed(bus, "req")
    with anyio.fail_after(10):
        while await bus.redis.zcard(bus.keys.deadlines("req")):  # the sweep expires it: it walks "req" again
            await bus.sweeper.wait_pass()
    assert (await handle.outcome()).status is HandoffStatus.EXPIRED


async def test_requesters_removed_go_back_when_the_second_look_fails(
    bus: HandoffBus, monkeypatch: pytest.MonkeyPatch,
) -> None:
    for agent in ("a", "b"):
        await finished(bus, agent)
        await age(bus, agent)
    real_scripts_many = bus.scripts_many
    looks: list[int] = []

    async def second_look_fails(calls: Any) -> Any:
        looks.append(len(calls))
        if len(looks) == 2:  # the look after the removal: its connection lost, say
            raise ConnectionError("lost")
        return await real_scripts_many(calls)

    monkeypatch.setattr(bus, "scripts_many", second_look_fails)
    with pytest.raises(ConnectionError):
        await bus.sweeper.unlist_idle()
    assert looks == [2, 2] and await listed(bus, "a") and await listed(bus, "b")  # not known idle: back


async def test_a_requester_given_work_by_a_process_that_lists_nothing_is_listed_back_a_minute_later(
    bus: HandoffBus, monkeypatch: pytest.MonkeyPatch,
) -> None:
    await finished(bus, "req")
    await age(bus, "req")
    await finished(bus, "quiet")
    await age(bus, "quiet")
    assert await bus.sweeper.unlist_idle() == 2
    # this process listed "req" a moment ago, so it lists nothing now (as a process of any version
    # does within the minute); the sweep had found "req" idle, as a request that leaves nothing
    # behind (one refused for a full queue, say) would leave it
    await bus.client("req").request_handoff(req("req", "nobody", timeout=600))
    assert not await listed(bus, "req")
    assert await bus.sweeper.recheck_unlisted() == 0  # not due yet: a minute after the removal
    monkeypatch.setattr(sweeper_module, "RECHECK_AFTER", 0.0)
    assert await bus.sweeper.recheck_unlisted() == 1
    assert await listed(bus, "req") and not await listed(bus, "quiet")  # still idle: stays out
    assert await bus.redis.zcard(bus.keys.unlisted) == 0  # each looked at once more, then forgotten


async def test_a_request_a_full_queue_refused_does_not_spare_the_next_one_its_listing(
    backend: str, servers: Servers,
) -> None:
    """A request refused by its target's full queue leaves nothing behind (its record taken back,
    no response written): the sweep may unlist its requester at once. The requester's next
    request, however soon, lists it again."""
    async with make_bus(backend, servers, max_queued=1) as bus:
        await bus.client("other").request_handoff(req("other", "bob", timeout=600))  # bob's queue is full
        client = bus.client("req")
        with pytest.raises(QueueFull):
            await client.request_handoff(req("req", "bob"))
        assert await bus.sweeper.unlist_idle() == 1 and not await listed(bus, "req")  # nothing of it anywhere
        handle = await client.request_handoff(req("req", "carol", timeout=0.2))  # a retry elsewhere, seconds later
        assert await listed(bus, "req")
        with anyio.fail_after(10):
            while await bus.redis.zcard(bus.keys.deadlines("req")):  # the sweep expires it: it walks "req"
                await bus.sweeper.wait_pass()
        assert (await handle.outcome()).status is HandoffStatus.EXPIRED


async def test_the_sweep_unlists_idle_requesters_on_its_own(
    backend: str, servers: Servers, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(sweeper_module, "UNLIST_LOOKS", 100_000)  # a look every few ms, not every 150 s
    async with make_bus(backend, servers) as bus:
        await finished(bus, "req")
        await age(bus, "req")
        with anyio.fail_after(10):
            while await listed(bus, "req"):
                await bus.sweeper.wait_pass()
        # given work by a process that lists nothing (see above), it is listed back by the sweep's look
        # a minute later
        await bus.client("req").request_handoff(req("req", "nobody", timeout=600))
        monkeypatch.setattr(sweeper_module, "RECHECK_AFTER", 0.0)
        monkeypatch.setattr(sweeper_module, "RECHECK_EVERY", 0.0)
        with anyio.fail_after(10):
            while not await listed(bus, "req"):
                await bus.sweeper.wait_pass()
    async with make_bus(backend, servers, requester_idle=0) as bus:  # 0: never
        await finished(bus, "req")
        await age(bus, "req")
        for _ in range(5):
            await bus.sweeper.wait_pass()
        assert await listed(bus, "req")


@pytest.mark.parametrize("value", [60, 119.9, -1, float("nan"), "600", True])
def test_requester_idle_is_0_or_at_least_two_minutes(value: object) -> None:
    with pytest.raises(InvalidRequest, match="requester_idle"):
        BusConfig(requester_idle=value)  # type: ignore[arg-type]
    assert BusConfig(requester_idle=0).requester_idle == 0 and BusConfig(requester_idle=120).requester_idle == 120
