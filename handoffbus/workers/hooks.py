"""Calling an agent's hooks: async ones awaited, plain ones in a thread (unless inline), and
what a hook raised described for the handoff's record."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable
from typing import Any

import anyio

from ..checks import MAX_TEXT
from ..errors import HandoffbusError
from .agent import is_inline

__all__ = ["HookCancelled", "HookTimedOut", "Watchdog", "call_hook", "describe", "sendable", "stops"]


def describe(exc: BaseException, prefix: str = "") -> str:
    """``"<prefix><type>: <message>"`` as the record can hold it (``sendable``), even when the
    exception's own ``__str__`` raises (a hook's custom exception): the handoff's outcome must
    still be sent."""
    name = type(exc).__name__
    for show in (str, repr):
        try:
            return sendable(f"{prefix}{name}: {show(exc)}")
        except Exception:  # e.g. a __str__ reading an attribute its __init__ never set
            continue
    return sendable(f"{prefix}{name}")


def sendable(text: str) -> str:
    """``text`` as the record can hold it: UTF-8, and at most ``MAX_TEXT`` characters (an
    exception's message may hold a whole HTTP body; the rest is cut, and said to be). A lone
    surrogate (what ``os.fsdecode`` makes of a file name's bytes that are not UTF-8) becomes
    its escape, ``\\udcff``, so that a hook's error or refusal still reaches the requester."""
    if len(text) > MAX_TEXT:
        cut = f" [cut: {len(text)} characters]"
        text = text[:MAX_TEXT - len(cut)] + cut
    try:
        text.encode()
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode()
    return text


def stops(exc: BaseException) -> bool:
    """Whether what a hook's step raised stops the worker rather than fails the hook: an exit
    or interrupt, or a cancellation of the handler (``call_hook`` turns a hook's own stray
    CancelledError into HookCancelled). Any other BaseException (a library's own, a
    GeneratorExit) is the hook's failure: raised on, it would end the lane and, through the
    task group, the worker and every handoff it runs."""
    return isinstance(exc, KeyboardInterrupt | SystemExit | anyio.get_cancelled_exc_class())


class HookCancelled(HandoffbusError):
    """A hook raised CancelledError while nothing cancelled its handler (it awaited something
    its owner cancelled): a failure of the hook, not a stop of the worker."""


async def call_hook(hook: Callable[..., Any], arg: Any) -> Any:
    """Await an async hook; run a plain one in a worker thread so it cannot block the loop,
    unless it is marked inline."""
    try:
        if inspect.iscoroutinefunction(hook):
            return await hook(arg)
        if is_inline(hook):
            result = hook(arg)
        else:
            # a stop does not wait for the thread (it may never return): the handler ends, and
            # its handoff is given back or left pending as for any hook
            result = await anyio.to_thread.run_sync(hook, arg, abandon_on_cancel=True)
        return await result if inspect.isawaitable(result) else result  # e.g. a plain def returning a coroutine
    except asyncio.CancelledError as exc:
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            raise  # the handler itself is cancelled: a stop
        # not an Exception: raised on, it would end the lane and, through the task group, the worker
        raise HookCancelled(f"{getattr(hook, '__name__', 'hook')} raised CancelledError: {exc}") from exc


class HookTimedOut(HandoffbusError):
    """A hook a ``Watchdog`` cut short: it did not answer in the time it had."""


class Watchdog:
    """Hooks that must answer by a time (the server's, in ms), cut short once past it by
    ``check()``, which the worker runs about once a second: the hook's task is cancelled, and the hook's call raises
    ``HookTimedOut``. This runs for every handoff, and a cancel scope or a timer per call
    (anyio's, asyncio's or ``call_later``) cost each call several microseconds; this costs a
    dict entry. A cancellation from elsewhere (a stop) meanwhile is raised on as it is."""

    __slots__ = ("_due",)

    def __init__(self) -> None:
        #: the task of each hook running, with the loop time it must answer by and whether
        #: check() cut it short
        self._due: dict[asyncio.Task[Any], list[Any]] = {}

    async def call(self, hook: Callable[..., Any], arg: Any, until_ms: int | None) -> Any:
        """``call_hook``, cut short by the first ``check`` after ``until_ms`` (the server's time;
        None: no bound)."""
        if until_ms is None:
            return await call_hook(hook, arg)
        task = asyncio.current_task()
        assert task is not None
        entry = [until_ms, False]
        self._due[task] = entry
        try:
            result = await call_hook(hook, arg)
        except asyncio.CancelledError:
            if entry[1] and task.uncancel() == 0:  # the watchdog's cancel, and nothing else's
                raise HookTimedOut(f"{getattr(hook, '__name__', 'hook')} did not answer by {until_ms}") from None
            raise
        except BaseException:
            if entry[1]:  # the hook made the watchdog's cancel another error: the task is not cancelled
                task.uncancel()
            raise
        finally:
            del self._due[task]
        if entry[1]:  # the hook swallowed the watchdog's cancel and answered
            task.uncancel()
        return result

    def check(self, now_ms: int) -> None:
        """Cut short every hook past its time at ``now_ms`` (the server's time)."""
        for task, entry in self._due.items():
            if not entry[1] and entry[0] <= now_ms:
                entry[1] = True
                task.cancel()
