"""What the client refuses before anything reaches Redis, and what it lists despite bad data."""

from __future__ import annotations

import logging
import os
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import pytest

from handoffbus import EncodeError, HandoffBus, HandoffNotFound, HandoffStatus, InvalidName, InvalidRequest

from .helpers import req

pytestmark = pytest.mark.anyio


async def test_a_timeout_under_a_millisecond_is_refused(real_bus: HandoffBus) -> None:
    # the deadline is kept in ms: 1e-7 s rounded to 0 and the handoff expired as it was made
    client = real_bus.client("req")
    for timeout in (1e-7, 0.0009, 0, -1.0):
        with pytest.raises(InvalidRequest, match=r"timeout must be a number of seconds from 0\.001 to"):
            await client.request_handoff(req("req", "w-1", timeout=timeout))
    handle = await client.request_handoff(req("req", "w-1", timeout=0.001))  # one millisecond is allowed
    assert (await handle.status()).status in (HandoffStatus.PENDING, HandoffStatus.EXPIRED)


async def test_an_empty_agent_id_is_refused_not_taken_for_the_callers_own(real_bus: HandoffBus) -> None:
    client = real_bus.client("w-1")
    await real_bus.client("req").request_handoff(req("req", "w-1"))
    assert len(await client.get_pending_handoffs()) == 1  # None: the caller's own
    with pytest.raises(InvalidName):
        await client.get_pending_handoffs("")
    with pytest.raises(InvalidName):
        await client.get_dead_letters("")


async def test_dead_letter_counts_and_entry_ids_out_of_range_are_refused(real_bus: HandoffBus) -> None:
    client = real_bus.client("req")
    for count in (0, -1, True, 1.5, "10"):
        with pytest.raises(InvalidRequest, match="count must be an int of at least 1"):
            await client.get_dead_letters("w-1", count=count)  # type: ignore[arg-type]
    assert await client.get_dead_letters("w-1", count=1) == []
    # each part of a stream id is an unsigned 64-bit number: past it, Redis answered an error
    for entry_id in ("99999999999999999999-0", "0-18446744073709551616", "18446744073709551616-0"):
        with pytest.raises(InvalidRequest, match="not a stream entry id"):
            await client.replay_dead_letter("w-1", entry_id)
        with pytest.raises(InvalidRequest, match="not a stream entry id"):
            await client.fail_dead_letter("w-1", entry_id, "given up")
    with pytest.raises(HandoffNotFound):  # the largest id there is: well formed, and not there
        await client.replay_dead_letter("w-1", "18446744073709551615-18446744073709551615")
    with pytest.raises(InvalidRequest, match="error must be a str"):
        await client.fail_dead_letter("w-1", "1-0", None)  # type: ignore[arg-type]


async def test_an_undecodable_queued_record_is_left_out_and_the_rest_listed(
    real_bus: HandoffBus, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="handoffbus")
    client = real_bus.client("req")
    good = [await client.request_handoff(req("req", "w-1", reason=f"good {i}")) for i in range(2)]
    bad = await client.request_handoff(req("req", "w-1", reason="bad"))
    await real_bus.redis.set(real_bus.keys.record("req", bad.request_id).envelope, b"\x92garbage")
    listed = await real_bus.client("w-1").get_pending_handoffs()
    assert [p.handoff_id for p in listed] == [h.handoff_id for h in good]
    assert [p.request.reason for p in listed] == ["good 0", "good 1"]
    assert any(bad.handoff_id in r.getMessage() and "cannot be decoded" in r.getMessage()
               for r in caplog.records if r.levelno == logging.WARNING)


#: what ``os.fsdecode`` makes of a file name whose bytes are not UTF-8: a str with a lone surrogate
NOT_UTF8 = "cannot read " + os.fsdecode(b"/data/\xff.txt")


async def test_text_that_is_not_utf8_fails_its_own_call_alone(bus: HandoffBus) -> None:
    # such text cannot be sent: its call is refused as EncodeError before anything is written,
    # and a call another task made at the same moment (one batch) goes through unharmed
    alice, bob = bus.client("alice"), bus.client("bob")
    first, second, third = [await alice.request_handoff(req("alice", "bob")) for _ in range(3)]
    await bob.accept_handoff(first.handoff_id)
    results: dict[str, Any] = {}

    async def run(name: str, call: Callable[[], Awaitable[Any]]) -> None:
        try:
            results[name] = await call()
        except Exception as exc:
            results[name] = exc

    async with anyio.create_task_group() as tg:
        tg.start_soon(run, "fail", lambda: bob.fail_handoff(first.handoff_id, NOT_UTF8))
        tg.start_soon(run, "accept", lambda: bob.accept_handoff(second.handoff_id))
    assert isinstance(results["fail"], EncodeError), results["fail"]
    assert results["accept"].status is HandoffStatus.ACCEPTED, results["accept"]
    with pytest.raises(EncodeError):
        await alice.cancel_handoff(third.handoff_id, reason=NOT_UTF8)
    with pytest.raises(EncodeError):
        await bob.reject_handoff(third.handoff_id, NOT_UTF8)
    statuses = [(await h.status()).status for h in (first, second, third)]  # type: ignore[union-attr]
    assert statuses == [HandoffStatus.ACCEPTED, HandoffStatus.ACCEPTED, HandoffStatus.PENDING]


async def test_request_handoff_refuses_what_is_not_a_request_with_a_typed_error(bus: HandoffBus) -> None:
    with pytest.raises(InvalidRequest, match="expected HandoffRequest, got dict"):
        await bus.client("alice").request_handoff({"from_agent": "alice", "to_agent": "bob"})  # type: ignore[arg-type]


@pytest.mark.parametrize("url", ["redis+cluster://127.0.0.1:7000/3", "redis+cluster://127.0.0.1:7000?foo=1",
                                 "redis+cluster://"], ids=["database", "unknown-option", "no-node"])
def test_a_bad_cluster_url_is_an_invalid_request(url: str) -> None:
    """A single server's URL said InvalidRequest; a cluster's let redis-py's RedisClusterException
    (no RedisError) or TypeError out."""
    with pytest.raises(InvalidRequest, match="not a usable Redis URL"):
        HandoffBus.connect(url)
