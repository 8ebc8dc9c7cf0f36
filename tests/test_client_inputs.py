"""What the client refuses before anything reaches Redis, and what it lists despite bad data."""

from __future__ import annotations

import logging

import pytest

from handoffbus import HandoffBus, HandoffNotFound, HandoffStatus, InvalidName, InvalidRequest

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
