"""The behavioural suite: every test runs on memory(), the embedded Valkey and redis-server."""

from __future__ import annotations

import random

import anyio
import pytest

from handoffbus import (
    EncodeError,
    HandoffBus,
    HandoffExpired,
    HandoffNotFound,
    HandoffRequest,
    HandoffStatus,
    InvalidName,
    InvalidRequest,
    InvalidTransition,
    NotPermitted,
    PayloadTooLarge,
    RequestConflict,
)
from handoffbus.workers.inbox import Inbox

from .helpers import prefix_keys, req, response_statuses

pytestmark = pytest.mark.anyio
S = HandoffStatus


async def test_request_accept_complete_round_trip(bus: HandoffBus) -> None:
    a, b = bus.client("general-agent-1"), bus.client("security-specialist-1")
    handle = await a.request_handoff(req("general-agent-1", "security-specialist-1", context_snapshot=b"{}"))
    assert [p.handoff_id for p in await b.get_pending_handoffs()] == [handle.handoff_id]
    accepted = await b.accept_handoff(handle.handoff_id, metadata={"capabilities": ["security_analysis"]})
    with anyio.fail_after(5):
        decision = await handle.decision()
    assert decision == accepted
    assert decision.status is S.ACCEPTED and decision.accepted and decision.accepting_agent == "security-specialist-1"
    assert decision.metadata == {"capabilities": ["security_analysis"]}
    assert await b.get_pending_handoffs() == []
    completed = await b.complete_handoff(handle.handoff_id, result={"verdict": "ok", "raw": b"\x00\x01"})
    with anyio.fail_after(5):
        outcome = await handle.outcome()
    assert outcome == completed and outcome.status is S.COMPLETED
    assert outcome.result == {"verdict": "ok", "raw": b"\x00\x01"}
    record = await a.get_handoff_status(handle.handoff_id)
    assert record is not None and record.status is S.COMPLETED and record.terminal
    assert [(h.status, h.actor) for h in record.history] == [
        (S.PENDING, "general-agent-1"), (S.ACCEPTED, "security-specialist-1"), (S.COMPLETED, "security-specialist-1"),
    ]
    times = [h.at_ms for h in record.history]
    assert times == sorted(times) and record.created_ms == times[0] and record.deadline_ms > times[0]
    assert record.request.context_snapshot == b"{}"
    assert await response_statuses(bus, "general-agent-1", handle.handoff_id) == ["ACCEPTED", "COMPLETED"]


async def test_reject_carries_code_retry_and_redirect(bus: HandoffBus) -> None:
    a, b = bus.client("a"), bus.client("b")
    handle = await a.request_handoff(req("a", "b"))
    await b.reject_handoff(handle.handoff_id, "busy", code="AGENT_BUSY", retry_after_ms=1500, redirect_to="c")
    with anyio.fail_after(5):
        decision = await handle.decision()
        outcome = await handle.outcome()
    assert decision.status is S.REJECTED and not decision.accepted
    assert (decision.rejection_reason, decision.rejection_code) == ("busy", "AGENT_BUSY")
    assert (decision.retry_after_ms, decision.redirect_to_agent, decision.actor) == (1500, "c", "b")
    assert outcome == decision
    assert await b.get_pending_handoffs() == []
    # the routing guard every refusal sends is for a routed one: not stored on a direct record
    assert await bus.redis.hget(bus.keys.record("a", handle.request_id).record, "guard") is None


async def test_fail_and_cancel(bus: HandoffBus) -> None:
    a, b = bus.client("a"), bus.client("b")
    failing = await a.request_handoff(req("a", "b"))
    await b.accept_handoff(failing.handoff_id)
    await b.fail_handoff(failing.handoff_id, "tool crashed")
    cancelled = await a.request_handoff(req("a", "b"))
    response = await cancelled.cancel(reason="no longer needed")
    with anyio.fail_after(5):
        assert (await failing.outcome()).error == "tool crashed"
        assert await cancelled.decision() == response
    assert response.status is S.CANCELLED and response.rejection_reason == "no longer needed"
    with pytest.raises(InvalidTransition) as info:
        await b.accept_handoff(cancelled.handoff_id)
    assert info.value.current == "CANCELLED"
    assert await b.get_pending_handoffs() == []


async def test_invalid_transitions_name_the_current_status(bus: HandoffBus) -> None:
    a, b = bus.client("a"), bus.client("b")
    h1 = await a.request_handoff(req("a", "b"))
    with pytest.raises(InvalidTransition) as info:
        await b.complete_handoff(h1.handoff_id)
    assert info.value.current == "PENDING" and "PENDING" in str(info.value)
    await b.reject_handoff(h1.handoff_id, "no")
    attempts = (b.accept_handoff(h1.handoff_id), b.fail_handoff(h1.handoff_id, "x"), a.cancel_handoff(h1.handoff_id))
    for attempt in attempts:
        with pytest.raises(InvalidTransition) as info:
            await attempt
        assert info.value.current == "REJECTED"
    h2 = await a.request_handoff(req("a", "b"))
    await b.accept_handoff(h2.handoff_id)
    await b.complete_handoff(h2.handoff_id, result=1)
    with pytest.raises(InvalidTransition) as info:
        await b.fail_handoff(h2.handoff_id, "late")
    assert info.value.current == "COMPLETED" and info.value.owner == "b"  # told to the accepting agent
    with pytest.raises(InvalidTransition) as info:
        await a.cancel_handoff(h2.handoff_id)
    assert info.value.owner == "b"  # and to the requester
    with pytest.raises(InvalidTransition) as info:
        await bus.client("c").accept_handoff(h2.handoff_id)
    assert info.value.current == "COMPLETED" and info.value.owner is None  # not to anyone else
    assert await response_statuses(bus, "a", h2.handoff_id) == ["ACCEPTED", "COMPLETED"]


async def test_only_the_right_agent_may_act(bus: HandoffBus) -> None:
    a, b, c = bus.client("a"), bus.client("b"), bus.client("c")
    handle = await a.request_handoff(req("a", "b"))
    with pytest.raises(NotPermitted):
        await c.accept_handoff(handle.handoff_id)
    with pytest.raises(NotPermitted):
        await c.reject_handoff(handle.handoff_id, "not mine")
    with pytest.raises(NotPermitted):
        await b.cancel_handoff(handle.handoff_id)
    await b.accept_handoff(handle.handoff_id)
    with pytest.raises(NotPermitted):
        await c.complete_handoff(handle.handoff_id)
    with pytest.raises(NotPermitted):
        await a.request_handoff(req("b", "c"))
    record = await a.get_handoff_status(handle.handoff_id)
    assert record is not None and [h.status for h in record.history] == [S.PENDING, S.ACCEPTED]


async def test_repeating_a_transition_returns_the_same_response_and_emits_nothing(bus: HandoffBus) -> None:
    a, b = bus.client("a"), bus.client("b")
    h1 = await a.request_handoff(req("a", "b"))
    first = await b.accept_handoff(h1.handoff_id)
    assert await b.accept_handoff(h1.handoff_id) == first
    done = await b.complete_handoff(h1.handoff_id, result="r")
    assert await b.complete_handoff(h1.handoff_id, result="r") == done
    h2 = await a.request_handoff(req("a", "b"))
    rejected = await b.reject_handoff(h2.handoff_id, "no")
    assert await b.reject_handoff(h2.handoff_id, "no") == rejected
    assert await response_statuses(bus, "a", h1.handoff_id) == ["ACCEPTED", "COMPLETED"]
    assert await response_statuses(bus, "a", h2.handoff_id) == ["REJECTED"]


async def test_resubmitting_a_request_id_never_makes_a_second_handoff(bus: HandoffBus) -> None:
    a, b = bus.client("a"), bus.client("b")
    request = req("a", "b", request_id="order-7", priority=2)
    h1 = await a.request_handoff(request)
    h2 = await a.request_handoff(request)
    assert h1.handoff_id == h2.handoff_id == "a/order-7"
    assert [p.handoff_id for p in await b.get_pending_handoffs()] == ["a/order-7"]
    await b.accept_handoff("a/order-7")
    h3 = await a.request_handoff(request)
    with anyio.fail_after(5):
        assert (await h3.decision()).status is S.ACCEPTED
    assert await b.get_pending_handoffs() == []
    with pytest.raises(RequestConflict):
        await a.request_handoff(req("a", "b", request_id="order-7", priority=3))
    assert await response_statuses(bus, "a", "a/order-7") == ["ACCEPTED"]


async def test_unknown_and_malformed_ids(bus: HandoffBus) -> None:
    b = bus.client("b")
    for call in (b.accept_handoff("a/missing"), b.reject_handoff("a/missing", "x"), b.complete_handoff("a/missing")):
        with pytest.raises(HandoffNotFound):
            await call
    assert await b.get_handoff_status("a/missing") is None
    for bad in ("no-slash", "a/b/c", "{a}/x", "a/ x", "", "a/*"):
        with pytest.raises(InvalidName):
            await b.accept_handoff(bad)
    assert await prefix_keys(bus) == []


@pytest.mark.parametrize(
    ("request_", "error"),
    [
        (HandoffRequest(from_agent="a", to_agent="b{x}"), InvalidName),
        (HandoffRequest(from_agent="a", to_agent="b c"), InvalidName),
        (HandoffRequest(from_agent="a", to_agent="b\n"), InvalidName),
        (HandoffRequest(from_agent="a", to_agent="b*"), InvalidName),
        (HandoffRequest(from_agent="a", to_agent="b", capabilities_required=["ok", "bad cap"]), InvalidName),
        (HandoffRequest(from_agent="a", to_agent="b", request_id="r/1"), InvalidName),
        (HandoffRequest(from_agent="a", to_agent="b", priority=5000), InvalidRequest),
        (HandoffRequest(from_agent="a", to_agent="b", priority=1.5), InvalidRequest),  # type: ignore[arg-type]
        (HandoffRequest(from_agent="a", to_agent="b", timeout=0), InvalidRequest),
        (HandoffRequest(from_agent="a", to_agent="b", timeout=float("nan")), InvalidRequest),
        (HandoffRequest(from_agent="a", to_agent="b", timeout=1e12), InvalidRequest),
        (HandoffRequest(from_agent="a", to_agent="b", context_snapshot="text"), InvalidRequest),  # type: ignore[arg-type]
        (HandoffRequest(from_agent="a", to_agent="b", metadata=[]), InvalidRequest),  # type: ignore[arg-type]
        (HandoffRequest(from_agent="a"), InvalidRequest),
        (HandoffRequest(from_agent="a", to_agent="b", context_snapshot=b"x" * (2 * 1024 * 1024)), PayloadTooLarge),
        (HandoffRequest(from_agent="a", to_agent="b", metadata={"x": object()}), EncodeError),
    ],
)
async def test_bad_requests_raise_typed_errors_and_write_nothing(
    bus: HandoffBus, request_: HandoffRequest, error: type[Exception]
) -> None:
    with pytest.raises(error):
        await bus.client("a").request_handoff(request_)
    assert await prefix_keys(bus) == []


async def test_bad_transition_arguments_write_nothing(bus: HandoffBus) -> None:
    b = bus.client("b")
    with pytest.raises(InvalidName):
        await b.reject_handoff("a/x", "r", code="has space")
    with pytest.raises(InvalidRequest):
        await b.reject_handoff("a/x", "r", retry_after_ms=-1)
    with pytest.raises(InvalidRequest):
        await b.fail_handoff("a/x", 42)  # type: ignore[arg-type]
    with pytest.raises(InvalidName):
        bus.client("bad agent")
    assert await prefix_keys(bus) == []


async def test_expiry_is_exact_for_accept_and_status(bus: HandoffBus) -> None:
    a, b = bus.client("a"), bus.client("b")
    handle = await a.request_handoff(req("a", "b", timeout=0.2))
    with anyio.fail_after(5):
        decision = await handle.decision()  # the handle itself asks the server at the deadline
    assert decision.status is S.EXPIRED and decision.actor == "bus"
    record = await b.get_handoff_status(handle.handoff_id)
    assert record is not None and record.status is S.EXPIRED
    assert decision.timestamp_ms >= record.deadline_ms
    with pytest.raises(HandoffExpired):
        await b.accept_handoff(handle.handoff_id)
    assert await response_statuses(bus, "a", handle.handoff_id) == ["EXPIRED"]
    assert await b.get_pending_handoffs() == []


async def test_requester_hears_expired_within_deadline_plus_one_second(bus: HandoffBus) -> None:
    a = bus.client("a")
    handles = [await a.request_handoff(req("a", "b", timeout=0.3 + i * 0.01)) for i in range(20)]
    lateness = []

    async def wait(handle: object) -> None:
        assert hasattr(handle, "decision")
        decision = await handle.decision()
        record = await a.get_handoff_status(decision.handoff_id)
        assert record is not None
        lateness.append(decision.timestamp_ms - record.deadline_ms)

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            for handle in handles:
                tg.start_soon(wait, handle)
    assert len(lateness) == 20 and all(0 <= late <= 1000 for late in lateness)


async def test_sweep_expires_what_nobody_awaits(bus: HandoffBus, backend: str, servers: dict) -> None:
    # a requester that went away: only the other bus's sweeper can expire its handoff
    from .conftest import make_bus

    async with make_bus(backend, servers, prefix=bus.config.prefix) if backend != "memory" else _same(bus) as other:
        handle = await other.client("gone").request_handoff(req("gone", "b", timeout=0.2))
    stream = bus.keys.responses("gone")
    with anyio.fail_after(5):
        reply = await bus.redis.xread({stream: "0-0"}, block=5000)
    (_, [(_, fields)]), = reply
    assert fields[b"id"].decode() == handle.handoff_id and fields[b"status"] == b"EXPIRED"
    with anyio.fail_after(5):
        await bus.sweeper.wait_pass()  # the pass that expired it also settles the target's queue
    assert await bus.redis.zcard(bus.keys.target("b").queue) == 0


class _same:
    """Stand-in for a second process on memory(), whose server lives inside the first bus."""

    def __init__(self, bus: HandoffBus) -> None:
        self.bus = bus

    async def __aenter__(self) -> HandoffBus:
        return self.bus

    async def __aexit__(self, *exc: object) -> None:
        self.bus._readers.clear()


async def test_accept_racing_expiry_has_exactly_one_winner(bus: HandoffBus) -> None:
    a, b = bus.client("a"), bus.client("b")
    handles = [await a.request_handoff(req("a", "b", timeout=0.05 + i * 0.0005)) for i in range(150)]
    won: dict[str, bool] = {}

    async def accept_all() -> None:
        for handle in handles:
            try:
                await b.accept_handoff(handle.handoff_id)
                won[handle.handoff_id] = True
            except HandoffExpired:
                won[handle.handoff_id] = False

    async def read_all() -> None:
        for handle in reversed(handles):
            await a.get_handoff_status(handle.handoff_id)

    async with anyio.create_task_group() as tg:
        tg.start_soon(accept_all)
        tg.start_soon(read_all)
    for handle in handles:
        record = await a.get_handoff_status(handle.handoff_id)
        assert record is not None
        decisions = await response_statuses(bus, "a", handle.handoff_id)
        expected = "ACCEPTED" if won[handle.handoff_id] else "EXPIRED"
        assert record.status == expected and decisions == [expected]


async def test_priority_then_fifo_order_to_a_single_consumer(bus: HandoffBus) -> None:
    a = bus.client("a")
    rng = random.Random(7)
    priorities = [rng.randint(-5, 5) for _ in range(1000)]
    ids = []
    for i, priority in enumerate(priorities):
        handle = await a.request_handoff(req("a", "b", priority=priority, request_id=f"r{i}"))
        ids.append(handle.handoff_id)
    expected = [ids[i] for i in sorted(range(1000), key=lambda i: (priorities[i], i))]
    listed = await bus.client("b").get_pending_handoffs()
    assert [p.handoff_id for p in listed] == expected
    inbox = Inbox(bus, "b", "worker-1")
    served: list[str] = []
    while True:
        _bell, taken = await inbox.take(rng.randint(1, 64))
        if not taken:
            break
        served += [d.handoff_id for d in taken]
    assert served == expected
    pending = await bus.redis.xpending(bus.keys.target("b").inbox, "workers")
    assert pending["pending"] == 1000  # taken work stays claimable until settled
    await inbox.take(0, settle=served)
    assert (await bus.redis.xpending(bus.keys.target("b").inbox, "workers"))["pending"] == 0
    assert await bus.redis.xlen(bus.keys.target("b").inbox) == 0


async def test_pending_lists_only_live_pending_handoffs(bus: HandoffBus) -> None:
    a, b = bus.client("a"), bus.client("b")
    keep = await a.request_handoff(req("a", "b", priority=1))
    cancel = await a.request_handoff(req("a", "b", priority=0))
    await cancel.cancel()
    listed = await b.get_pending_handoffs()
    assert [p.handoff_id for p in listed] == [keep.handoff_id]
    assert listed[0].request.priority == 1 and listed[0].deadline_ms > listed[0].created_ms
    assert await bus.client("c").get_pending_handoffs("b") == listed


async def test_routed_request_is_stored_and_expires(bus: HandoffBus) -> None:
    a = bus.client("a")
    handle = await a.request_handoff(
        HandoffRequest(from_agent="a", capabilities_required=["sql", "python", "sql"], timeout=0.2)
    )
    record = await a.get_handoff_status(handle.handoff_id)
    assert record is not None and record.status is S.PENDING and record.request.to_agent == ""
    assert record.request.capabilities_required == ["python", "sql"]
    with anyio.fail_after(5):
        assert (await handle.decision()).status is S.EXPIRED


async def test_record_and_marker_ttls(bus: HandoffBus) -> None:
    a, b = bus.client("a"), bus.client("b")
    handle = await a.request_handoff(req("a", "b", timeout=30, request_id="ttl"))
    keys = bus.keys.record("a", "ttl")
    assert 0 < await bus.redis.pttl(keys.marker) <= 30_000
    assert await bus.redis.pttl(keys.record) == -1
    await b.reject_handoff(handle.handoff_id, "no")
    assert await bus.redis.exists(keys.marker) == 0
    assert 0 < await bus.redis.pttl(keys.record) <= bus.config.retention_ms
    assert await bus.redis.zscore(keys.deadlines, "ttl") is None


async def test_a_second_process_can_await_a_handoff(bus: HandoffBus) -> None:
    a, b = bus.client("a"), bus.client("b")
    handle = await a.request_handoff(req("a", "b"))
    bus._readers.clear()  # as if another process: no waiter, no reader
    other = bus.client("a").handle(handle.handoff_id)
    await b.accept_handoff(handle.handoff_id)
    await b.complete_handoff(handle.handoff_id, result=b"done")
    with anyio.fail_after(5):
        assert (await other.decision()).status is S.ACCEPTED
        assert (await other.outcome()).result == b"done"
    with pytest.raises(NotPermitted):
        bus.client("z").handle(handle.handoff_id)


async def test_clear_all_handoffs_needs_confirmation_and_keeps_other_prefixes(
    bus: HandoffBus, backend: str, servers: dict
) -> None:
    from .conftest import make_bus

    a = bus.client("a")
    await a.request_handoff(req("a", "b"))
    if backend == "memory":
        await bus.redis.set("other:key", "1")
    else:
        async with make_bus(backend, servers) as neighbour:
            await neighbour.client("a").request_handoff(req("a", "b"))
            await neighbour.stats.flush()  # its counters now, not when it closes
            neighbour_keys = await prefix_keys(neighbour)
    with pytest.raises(InvalidRequest):
        await a.clear_all_handoffs(confirm="yes")
    await bus.stats.flush()  # the request's count now: a flush after the clear would write it back
    assert await prefix_keys(bus) != []
    assert await a.clear_all_handoffs(confirm=bus.config.prefix) > 0
    assert await prefix_keys(bus) == []
    if backend == "memory":
        assert await bus.redis.get("other:key") == b"1"
    else:
        async with make_bus(backend, servers, prefix=neighbour.config.prefix) as again:
            assert await prefix_keys(again) == neighbour_keys


async def test_a_read_that_expires_a_handoff_also_settles_its_queue(backend: str, servers: dict) -> None:
    from .conftest import make_bus

    async with make_bus(backend, servers, sweep_interval=3600) as quiet:  # only reads can expire here
        a = quiet.client("a")
        handle = await a.request_handoff(req("a", "b", timeout=0.1))
        with anyio.fail_after(5):
            assert (await handle.decision()).status is S.EXPIRED
        assert await quiet.redis.zcard(quiet.keys.target("b").queue) == 0
        again = await a.request_handoff(req("a", "c", timeout=0.1, request_id="late"))
        with anyio.fail_after(5):
            await again.decision()
        await quiet.enqueue("c", again.handoff_id, 0)  # as if the first enqueue came late
        assert (await a.request_handoff(req("a", "c", timeout=0.1, request_id="late"))).handoff_id == "a/late"
        assert await quiet.redis.zcard(quiet.keys.target("c").queue) == 0


async def test_take_after_the_group_was_deleted_delivers_what_it_took(bus: HandoffBus) -> None:
    a = bus.client("a")
    first = await a.request_handoff(req("a", "b", priority=0))
    second = await a.request_handoff(req("a", "b", priority=1))
    inbox = Inbox(bus, "b", "w1")
    _, [taken] = await inbox.take(1)
    assert taken.handoff_id == first.handoff_id
    await bus.redis.xgroup_destroy(bus.keys.target("b").inbox, "workers")
    _, [taken] = await inbox.take(1)
    assert taken.handoff_id == second.handoff_id
    pending = await bus.redis.xpending_range(bus.keys.target("b").inbox, "workers", "-", "+", 10)
    inflight = await bus.redis.hgetall(bus.keys.target("b").inflight)
    assert set(inflight) == {first.handoff_id.encode(), second.handoff_id.encode()}  # nothing forgotten
    # the first handoff lost its pending entry with the group: it was re-issued, held for
    # its handler to adopt or for a live worker to claim once idle
    assert {(p["message_id"], p["consumer"]) for p in pending} == {
        (inflight[first.handoff_id.encode()], b"_restored"), (taken.entry_id.encode(), b"w1")}


async def test_resubmission_is_judged_by_content_not_by_bytes(backend: str, servers: dict) -> None:
    from .conftest import make_bus, new_prefix

    prefix = new_prefix()
    async with make_bus(backend, servers, prefix=prefix, codec="msgpack") as bus:
        a = bus.client("a")
        first = await a.request_handoff(req("a", "b", request_id="same", metadata={"x": 1, "y": 2}))
        reordered = await a.request_handoff(req("a", "b", request_id="same", metadata={"y": 2, "x": 1}))
        assert reordered.handoff_id == first.handoff_id
        if backend != "memory":  # a second bus on the same server, writing JSON
            async with make_bus(backend, servers, prefix=prefix, codec="json") as other:
                again = await other.client("a").request_handoff(
                    req("a", "b", request_id="same", metadata={"x": 1, "y": 2})
                )
                assert again.handoff_id == first.handoff_id
        assert [p.handoff_id for p in await bus.client("b").get_pending_handoffs()] == ["a/same"]


async def test_sw4rm_callers_that_catch_value_error_catch_bad_transitions_and_missing_ids(bus: HandoffBus) -> None:
    # sw4rm's client raises ValueError for both: code written against it must keep working
    handle = await bus.client("a").request_handoff(req("a", "b"))
    await bus.client("a").cancel_handoff(handle.handoff_id)
    with pytest.raises(ValueError, match="it is CANCELLED"):
        await bus.client("b").accept_handoff(handle.handoff_id)
    with pytest.raises(ValueError, match="not found"):
        await bus.client("b").accept_handoff("a/no-such-request")
