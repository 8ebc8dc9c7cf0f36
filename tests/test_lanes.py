"""Lanes: a worker's handlers run on long-lived tasks, each as if it were a task of its own."""

from __future__ import annotations

import contextvars

import anyio
import pytest

from handoffbus.workers.lanes import Lanes

pytestmark = pytest.mark.anyio

tag: contextvars.ContextVar[str] = contextvars.ContextVar("tag", default="unset")


async def test_each_job_runs_in_the_context_it_was_submitted_from() -> None:
    seen: list[tuple[str, str]] = []
    done = anyio.Event()

    async def job(name: str) -> None:
        seen.append((name, tag.get()))
        tag.set(f"left by {name}")  # never reset: it must not reach the next job on this lane
        await anyio.lowlevel.checkpoint()
        seen.append((name, tag.get()))  # a job's own setting stays with it across suspensions
        if name == "third":
            done.set()

    async with anyio.create_task_group() as tg:
        lanes = Lanes(tg, 1)
        lanes.submit(job, "first")
        token = tag.set("submitter's")
        lanes.submit(job, "second")
        tag.reset(token)
        lanes.submit(job, "third")
        await done.wait()
        tg.cancel_scope.cancel()
    assert lanes.started == 1
    assert seen == [
        ("first", "unset"), ("first", "left by first"),
        ("second", "submitter's"), ("second", "left by second"),
        ("third", "unset"), ("third", "left by third"),
    ]


async def test_no_more_than_size_jobs_run_at_once_and_none_is_dropped() -> None:
    release = anyio.Event()
    running = peak = finished = 0
    three_running, all_done = anyio.Event(), anyio.Event()

    async def job() -> None:
        nonlocal running, peak, finished
        running += 1
        peak = max(peak, running)
        if running == 3:
            three_running.set()
        await release.wait()
        running -= 1
        finished += 1
        if finished == 10:
            all_done.set()

    async with anyio.create_task_group() as tg:
        lanes = Lanes(tg, 3)
        for _ in range(10):
            lanes.submit(job)
        await three_running.wait()
        release.set()
        await all_done.wait()
        tg.cancel_scope.cancel()
    assert (peak, finished, lanes.started) == (3, 10, 3)


async def test_a_free_lane_takes_the_next_job_instead_of_a_new_lane_starting() -> None:
    finished = 0
    each = anyio.Event()

    async def job() -> None:
        nonlocal finished
        finished += 1
        each.set()

    async with anyio.create_task_group() as tg:
        lanes = Lanes(tg, 8)
        for expected in range(1, 6):
            each = anyio.Event()
            lanes.submit(job)
            await each.wait()
            assert finished == expected
        tg.cancel_scope.cancel()
    assert lanes.started == 1


async def test_cancelling_the_group_reaches_a_running_job() -> None:
    started = anyio.Event()
    cleaned: list[str] = []

    async def job() -> None:
        try:
            started.set()
            await anyio.sleep_forever()
        finally:
            cleaned.append("job")

    async with anyio.create_task_group() as tg:
        Lanes(tg, 2).submit(job)
        await started.wait()
        tg.cancel_scope.cancel()
    assert cleaned == ["job"]


async def test_a_job_that_raises_fails_the_group_as_a_task_would() -> None:
    async def job() -> None:
        await anyio.lowlevel.checkpoint()
        raise ValueError("boom")

    with pytest.raises(ExceptionGroup) as caught:
        async with anyio.create_task_group() as tg:
            Lanes(tg, 2).submit(job)
    assert caught.group_contains(ValueError, match="boom")
