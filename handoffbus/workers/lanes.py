"""Lanes: long-lived tasks that run a worker's handlers, one handoff after another.

Starting an anyio task per handoff (its asyncio task, cancel scope and bookkeeping) cost a
worker more than the rest of its Python work on a handoff but the script calls. A lane
that waits on a future takes the next handler in about a tenth of that. Lanes are started
as the load needs them, up to the worker's concurrency, in the worker's handler task
group: its cancel scope stops them like the tasks they replace.

Each handler still runs in a copy of the context it was submitted from, as a task of its
own would: a context variable a hook sets stays with that handoff, not with the lane. The
asyncio task it runs in (``asyncio.current_task()``) is the lane's, shared with the handlers
the lane ran before it.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections import deque
from collections.abc import Callable, Coroutine, Generator
from typing import Any, Generic, TypeVar

from anyio.abc import TaskGroup

__all__ = ["Lanes"]

T = TypeVar("T")
Handler = Callable[..., Coroutine[Any, Any, Any]]


class Lanes:
    """Run submitted coroutine functions on at most ``size`` lanes of ``group``."""

    __slots__ = ("_group", "_idle", "_jobs", "_lanes", "_size")

    def __init__(self, group: TaskGroup, size: int) -> None:
        self._group = group
        self._size = size
        self._jobs: deque[tuple[contextvars.Context, Handler, tuple[Any, ...]]] = deque()
        self._idle: list[asyncio.Future[None]] = []
        self._lanes = 0

    @property
    def started(self) -> int:
        """Lanes started so far (they stay until the group ends)."""
        return self._lanes

    def submit(self, func: Handler, *args: Any) -> None:
        """Run ``func(*args)`` on a free lane, or on a new one while fewer than ``size`` exist;
        otherwise it waits for the first lane to finish what it runs."""
        self._jobs.append((contextvars.copy_context(), func, args))
        while self._idle:
            waiting = self._idle.pop()
            if not waiting.done():  # (done: its lane was cancelled while idle)
                waiting.set_result(None)
                return
        if self._lanes < self._size:
            self._lanes += 1
            self._group.start_soon(self._lane, name="handoffbus lane")

    def unstarted(self) -> list[tuple[Any, ...]]:
        """The arguments of what was submitted but never started (its lanes stopped first),
        oldest first; they are no longer queued."""
        jobs = [args for _, _, args in self._jobs]
        self._jobs.clear()
        return jobs

    async def _lane(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            while not self._jobs:
                waiting = loop.create_future()
                self._idle.append(waiting)
                try:
                    await waiting
                finally:
                    if waiting in self._idle:  # cancelled while idle
                        self._idle.remove(waiting)
            context, func, args = self._jobs.popleft()
            await _InContext(func(*args), context)
            del context, func, args  # an idle lane keeps nothing of its last handoff alive


class _InContext(Generic[T]):
    """Await ``coro`` with each of its steps run in ``context``, as a task made with that
    context would run it (asyncio's tasks do the same per step). Cancellation and every
    other exception thrown in reach the coroutine unchanged."""

    __slots__ = ("_context", "_coro")

    def __init__(self, coro: Coroutine[Any, Any, T], context: contextvars.Context) -> None:
        self._coro = coro
        self._context = context

    def __await__(self) -> Generator[Any, Any, T]:
        run, send, throw = self._context.run, self._coro.send, self._coro.throw
        value: Any = None
        error: BaseException | None = None
        while True:
            try:
                out = run(send, value) if error is None else run(throw, error)
            except StopIteration as stop:
                result: T = stop.value
                return result
            try:
                value, error = (yield out), None
            except BaseException as exc:  # thrown into this task (a cancellation): the coroutine's to handle
                value, error = None, exc
