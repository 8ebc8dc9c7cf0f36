"""Retry policy of the work hook, and a handler's own heartbeat."""

from __future__ import annotations

import anyio
import pytest

from handoffbus import HandoffBus, HandoffStatus, InvalidRequest, RetryPolicy, Worker

from .agents import Beating, Flaky
from .helpers import req, response_statuses, serve_until_done

pytestmark = pytest.mark.anyio


async def test_a_raising_handler_is_retried_then_completes(bus: HandoffBus) -> None:
    handle = await bus.client("req").request_handoff(req("req", "flaky-1", reason="x"))
    agent = Flaky(fails=2)
    [outcome], _ = await serve_until_done(bus, agent, [handle])
    assert outcome.status is HandoffStatus.COMPLETED and outcome.result == {"attempt": 3}
    assert agent.attempts == [1, 2, 3]
    record = await bus.client("req").get_handoff_status(handle.handoff_id)
    assert record.attempt == 3
    # the requester heard ACCEPTED once and the outcome once: retries are the worker's business
    assert await response_statuses(bus, "req", handle.handoff_id) == ["ACCEPTED", "COMPLETED"]


async def test_retries_run_out_into_failed(bus: HandoffBus) -> None:
    handle = await bus.client("req").request_handoff(req("req", "flaky-1", reason="x"))
    agent = Flaky(fails=10)
    [outcome], _ = await serve_until_done(bus, agent, [handle])
    assert outcome.status is HandoffStatus.FAILED
    assert outcome.error == "ConnectionError: transient failure 3"
    assert agent.attempts == [1, 2, 3]


async def test_an_error_outside_retry_on_fails_at_once(bus: HandoffBus) -> None:
    class Strict(Flaky):
        retry = RetryPolicy(attempts=5, delay=0.0, retry_on=(ConnectionError,))

    handle = await bus.client("req").request_handoff(req("req", "flaky-1", reason="x"))
    agent = Strict(fails=10, error=KeyError)
    [outcome], _ = await serve_until_done(bus, agent, [handle])
    assert outcome.status is HandoffStatus.FAILED and agent.attempts == [1]


def test_retry_policy_is_validated_and_backs_off() -> None:
    for bad in ({"attempts": 0}, {"delay": -1.0}, {"backoff": 0.5}, {"jitter": 2.0}):
        with pytest.raises(InvalidRequest):
            RetryPolicy(**bad)  # type: ignore[arg-type]
    policy = RetryPolicy(attempts=9, delay=1.0, backoff=2.0, max_delay=5.0, jitter=0.0)
    assert [policy.delay_before(a) for a in (1, 2, 3, 4)] == [1.0, 2.0, 4.0, 5.0]
    jittered = RetryPolicy(delay=1.0, jitter=0.5)
    assert all(0.5 <= jittered.delay_before(1) <= 1.0 for _ in range(200))


async def test_heartbeat_tells_a_handler_it_was_taken_over(bus: HandoffBus) -> None:
    client = bus.client("req")
    handle = await client.request_handoff(req("req", "beating-1", reason="x"))
    agent = Beating()
    async with anyio.create_task_group() as tg:
        worker = Worker(bus, agent)
        await tg.start(worker.run)
        with anyio.fail_after(10):
            await agent.started.wait()
        # another worker of the agent took it over (as the reclaim script would)
        record_key = bus.keys.record("req", handle.request_id).record
        await bus.redis.hset(record_key, "lease", "the-other-worker")
        agent.proceed.set()
        with anyio.fail_after(10):
            await agent.told.wait()
        worker.drain()
    assert agent.lost == ["the-other-worker"]
    # this worker wrote no outcome: the handoff is still the new holder's to finish
    assert (await client.get_handoff_status(handle.handoff_id)).status is HandoffStatus.ACCEPTED
    assert worker.handled == {}
