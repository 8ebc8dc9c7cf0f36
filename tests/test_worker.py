"""Workers in process: hooks, priority order, backpressure, failures, graceful drain."""

from __future__ import annotations

import functools
import gc
import threading
import weakref
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import pytest

from handoffbus import (
    ConversationEntry,
    HandoffBus,
    HandoffContext,
    HandoffRequest,
    HandoffResponse,
    HandoffStatus,
    serialize_context,
)
from handoffbus.workers import Accept, Agent, AgentState, Reject, Worker
from handoffbus.workers import inline as mark_inline
from handoffbus.workers.agent import is_inline
from handoffbus.workers.hooks import call_hook

from .agents import Echo, Faulty, Gated, InlineEcho, SyncEcho
from .helpers import req, response_statuses, serve_until_done

pytestmark = pytest.mark.anyio
S = HandoffStatus


async def test_a_worker_serves_requests_in_priority_order(bus: HandoffBus) -> None:
    client = bus.client("req")
    ctx = serialize_context(HandoffContext(conversation_history=[ConversationEntry(role="user", content="hi")]))
    priorities = [5, 1, 9, 1, 0, 5, 3]
    handles = [
        await client.request_handoff(req("req", "echo-1", priority=p, reason=f"r{i}", context_snapshot=ctx))
        for i, p in enumerate(priorities)
    ]
    agent = Echo()
    outcomes, worker = await serve_until_done(bus, agent, handles, concurrency=1)
    expected = [handles[i].handoff_id for i in sorted(range(len(priorities)), key=lambda i: (priorities[i], i))]
    assert agent.order == expected
    assert [o.status for o in outcomes] == [S.COMPLETED] * len(handles)
    assert outcomes[1].result == {"echo": "r1", "messages": 1, "attempt": 1}
    assert worker.handled == {S.COMPLETED: len(handles)}
    inbox = bus.keys.target("echo-1").inbox
    assert await bus.redis.xlen(inbox) == 0  # everything settled on the way out
    for handle in handles:
        assert await response_statuses(bus, "req", handle.handoff_id) == ["ACCEPTED", "COMPLETED"]


async def test_default_acceptance_follows_sw4rm(bus: HandoffBus) -> None:
    client = bus.client("req")
    missing = await client.request_handoff(req("req", "echo-1", capabilities_required=["echo", "translation"]))
    async with anyio.create_task_group() as tg:
        worker = Worker(bus, Echo())
        await tg.start(worker.run)
        with anyio.fail_after(10):
            decision = await missing.decision()
        worker.drain()
    assert decision.status is S.REJECTED and decision.rejection_code == "CAPABILITY_MISSING"
    assert decision.rejection_reason == "missing capability: translation"
    draining = Echo()
    draining.state = AgentState.DRAINING
    refused = draining.on_handoff_request(HandoffRequest(from_agent="a", to_agent="echo-1"))
    assert isinstance(refused, Reject) and refused.code == "AGENT_NOT_RUNNABLE"


@pytest.mark.parametrize("inline", [False, True], ids=["thread", "inline"])
async def test_plain_function_hooks_run_off_the_event_loop_unless_inline(bus: HandoffBus, inline: bool) -> None:
    agent = InlineEcho() if inline else SyncEcho()
    handle = await bus.client("req").request_handoff(req("req", agent.agent_id, reason="shout"))
    async with anyio.create_task_group() as tg:
        worker = Worker(bus, agent)
        await tg.start(worker.run)
        with anyio.fail_after(10):
            decision, outcome = await handle.decision(), await handle.outcome()
        worker.drain()
    assert decision.metadata == {"by": "inline" if inline else "sync"} and outcome.result == "SHOUT"
    loop_thread = threading.get_ident()
    if inline:  # the acceptance hook on the loop; the work hook, not marked, in a thread
        assert loop_thread in agent.threads and len(agent.threads) == 2
    else:
        assert agent.threads and loop_thread not in agent.threads
    assert is_inline(Agent.on_handoff_request) and is_inline(Echo().on_handoff_request)
    assert not is_inline(SyncEcho().on_handoff_request)


@pytest.mark.parametrize("inline", [False, True], ids=["thread", "inline"])
async def test_a_plain_hook_may_return_an_awaitable_decision(bus: HandoffBus, inline: bool) -> None:
    class Deferring(Echo):
        async def _decide(self, request: HandoffRequest) -> Accept:
            return Accept(metadata={"deferred": True})

        def on_handoff_request(self, request: HandoffRequest) -> Awaitable[Accept]:
            return self._decide(request)

    if inline:
        Deferring.on_handoff_request = mark_inline(Deferring.on_handoff_request)  # type: ignore[method-assign]
    handle = await bus.client("req").request_handoff(req("req", "echo-1", reason="later"))
    [outcome], _ = await serve_until_done(bus, Deferring(), [handle])
    decision = await handle.decision()
    assert decision.metadata == {"deferred": True} and outcome.status is HandoffStatus.COMPLETED


async def test_an_acceptance_hook_ported_from_sw4rm_answers_with_a_handoff_response(bus: HandoffBus) -> None:
    """sw4rm's on_handoff_request returns a HandoffResponse; it was refused (HOOK_FAILED)."""
    class Ported(Echo):
        async def on_handoff_request(self, request: HandoffRequest) -> HandoffResponse:  # type: ignore[override]
            if request.reason == "yes":
                return HandoffResponse(handoff_id="", status=HandoffStatus.ACCEPTED, accepted=True,
                                       metadata={"eta": 5})
            return HandoffResponse(handoff_id="", status=HandoffStatus.REJECTED, accepted=False,
                                   rejection_reason="busy", rejection_code="AGENT_BUSY", retry_after_ms=1500,
                                   redirect_to_agent="echo-2")

    client = bus.client("req")
    yes = await client.request_handoff(req("req", "echo-1", reason="yes"))
    no = await client.request_handoff(req("req", "echo-1", reason="no"))
    [done, refused], _ = await serve_until_done(bus, Ported(), [yes, no])
    accepted = await yes.decision()
    assert accepted.status is HandoffStatus.ACCEPTED and accepted.metadata == {"eta": 5}
    assert done.status is HandoffStatus.COMPLETED
    assert refused.status is HandoffStatus.REJECTED
    assert (refused.rejection_reason, refused.rejection_code, refused.retry_after_ms, refused.redirect_to_agent) == (
        "busy", "AGENT_BUSY", 1500, "echo-2")


async def test_failures_are_reported_not_fatal(bus: HandoffBus) -> None:
    client = bus.client("req")
    crash = await client.request_handoff(req("req", "faulty-1", reason="work"))
    bad_hook = await client.request_handoff(req("req", "faulty-1", reason="explode in acceptance"))
    bad_reject = await client.request_handoff(req("req", "faulty-1", reason="bad reject"))
    async with anyio.create_task_group() as tg:
        worker = Worker(bus, Faulty())
        await tg.start(worker.run)
        with anyio.fail_after(10):
            crashed, refused, invalid = await crash.outcome(), await bad_hook.outcome(), await bad_reject.outcome()
        worker.drain()
    assert crashed.status is S.FAILED and crashed.error == "ValueError: the tool crashed"
    assert refused.status is S.REJECTED and refused.rejection_code == "HOOK_FAILED"
    assert "RuntimeError: acceptance bug" in (refused.rejection_reason or "")
    assert invalid.status is S.REJECTED and invalid.rejection_code == "HOOK_FAILED"


async def test_never_fetches_more_than_free_concurrency(bus: HandoffBus) -> None:
    client = bus.client("req")
    handles = [await client.request_handoff(req("req", "gated-1")) for _ in range(10)]
    agent = Gated()
    agent.want = 2
    keys = bus.keys.target("gated-1")
    async with anyio.create_task_group() as tg:
        worker = Worker(bus, agent, concurrency=2)
        await tg.start(worker.run)
        with anyio.fail_after(10):
            await agent.reached.wait()
        assert (await bus.redis.xpending(keys.inbox, "workers"))["pending"] == 2
        assert await bus.redis.zcard(keys.queue) == 8
        assert worker.state is AgentState.BUSY
        agent.gate.set()
        with anyio.fail_after(10):
            outcomes = [await h.outcome() for h in handles]
        worker.drain()
    assert all(o.status is S.COMPLETED for o in outcomes) and agent.holding == 10


async def test_drain_finishes_running_work_and_leaves_the_rest_queued(bus: HandoffBus) -> None:
    client = bus.client("req")
    handles = [await client.request_handoff(req("req", "gated-1")) for _ in range(6)]
    agent = Gated()
    agent.want = 2
    worker = Worker(bus, agent, concurrency=2)
    async with anyio.create_task_group() as tg:
        await tg.start(worker.run)
        with anyio.fail_after(10):
            await agent.reached.wait()
        worker.drain()
        assert worker.state is AgentState.DRAINING
        agent.gate.set()  # the two running handlers finish within the grace period
    assert worker.handled == {S.COMPLETED: 2}
    assert await bus.redis.zcard(bus.keys.target("gated-1").queue) == 4  # not fetched, not lost
    outcomes, _ = await serve_until_done(bus, _open_gated(), handles, concurrency=4)
    assert all(o.status is S.COMPLETED for o in outcomes)


async def test_a_drain_during_a_take_does_not_wait_out_the_block(bus: HandoffBus) -> None:
    """A drain asked while the fetch loop was in a take found no wait to cancel, and the loop
    then waited for its doorbell a whole ``block`` (30 s here) before it stopped."""
    worker = Worker(bus, Echo(), block=30.0)
    take = worker._inbox.take
    in_take = anyio.Event()

    async def drained_during_take(count: int, settle: Any = ()) -> Any:
        if count > 0 and not in_take.is_set():
            in_take.set()
            worker.drain()  # a SIGTERM while this take is on the wire
        return await take(count, settle)

    worker._inbox.take = drained_during_take  # type: ignore[method-assign]
    with anyio.fail_after(5):
        await worker.run()
    assert in_take.is_set()


async def test_a_heartbeat_retry_after_every_handler_finished_is_no_failure(bus: HandoffBus) -> None:
    """A beat's first touch failed, and the handlers finished during its backoff: the retry sent
    XCLAIM with no ids, which redis-py refuses (DataError), so the beat counted as failed again
    and paused this worker's reclaims once more."""
    keeper = Worker(bus, Echo())._keeper
    contact = keeper.contact_since
    await keeper.touch(["req/finished-meanwhile"])  # held no more: nothing to send
    await keeper.beat()  # a retry's touch, with every handler finished
    assert keeper.contact_since == contact  # not counted as lost contact


def _open_gated() -> Gated:
    agent = Gated()
    agent.gate.set()
    return agent


async def _drained_while_deciding(bus: HandoffBus, count: int,
                                  meanwhile: Callable[[], Awaitable[Any]] | None = None) -> None:
    """Drain a worker whose acceptance hook holds ``count`` handoffs (``meanwhile`` runs first)."""
    stuck = Gated(hold_in_acceptance=True)  # its gate never opens
    stuck.want = count
    worker = Worker(bus, stuck, concurrency=count, grace=0.05)
    async with anyio.create_task_group() as tg:
        await tg.start(worker.run)
        with anyio.fail_after(10):
            await stuck.reached.wait()
        if meanwhile is not None:
            await meanwhile()
        worker.drain()


async def test_drain_hands_back_what_is_still_being_decided(bus: HandoffBus) -> None:
    client = bus.client("req")
    handles = [await client.request_handoff(req("req", "gated-1")) for _ in range(3)]
    await _drained_while_deciding(bus, 3)
    keys = bus.keys.target("gated-1")
    assert await bus.redis.zcard(keys.queue) == 3  # handed back to the queue
    assert (await bus.redis.xpending(keys.inbox, "workers"))["pending"] == 0
    outcomes, _ = await serve_until_done(bus, _open_gated(), handles)
    assert all(o.status is S.COMPLETED for o in outcomes)
    for handle in handles:
        assert await response_statuses(bus, "req", handle.handoff_id) == ["ACCEPTED", "COMPLETED"]


async def test_drain_does_not_hand_back_what_was_cancelled_while_being_decided(bus: HandoffBus) -> None:
    client = bus.client("req")
    kept, cancelled = [await client.request_handoff(req("req", "gated-1")) for _ in range(2)]
    await _drained_while_deciding(bus, 2, cancelled.cancel)  # the cancel settles its queue and inbox entries
    keys = bus.keys.target("gated-1")
    assert await bus.redis.zrange(keys.queue, 0, -1) == [kept.handoff_id.encode()]  # the other only
    assert await bus.redis.hlen(keys.inflight) == 0
    assert (await bus.redis.xpending(keys.inbox, "workers"))["pending"] == 0


def test_an_agent_must_implement_its_work() -> None:
    class Lazy(Agent):
        agent_id = "lazy"

    with pytest.raises(NotImplementedError):
        Lazy().on_handoff_received(None)  # type: ignore[arg-type]


async def test_a_hooks_kind_is_read_from_methods_only_and_keeps_nothing_alive() -> None:
    """Whether a hook is async is remembered per function, for speed; only a bound method is
    read through its ``__func__``, and nothing a hook holds is kept alive by the memory."""
    async def work(state: object, x: int) -> tuple[str, int]:
        return "async", x

    class SyncAdapter:  # a plain callable that happens to carry an async function
        def __init__(self) -> None:
            self.__func__ = work

        def __call__(self, x: int) -> tuple[str, int]:
            return "sync", x

    assert await call_hook(SyncAdapter(), 1) == ("sync", 1)  # a plain call, in a thread: not awaited

    class State:
        pass

    state = State()
    alive = weakref.ref(state)
    assert await call_hook(functools.partial(work, state), 2) == ("async", 2)

    def make() -> Callable[[int], Awaitable[tuple[str, int]]]:
        held = State()

        async def closure(x: int) -> tuple[str, int]:
            return type(held).__name__, x

        return closure

    hook = make()
    gone = weakref.ref(hook)
    assert await call_hook(hook, 3) == ("State", 3) and await call_hook(hook, 4) == ("State", 4)
    del state, hook
    gc.collect()
    assert alive() is None and gone() is None
