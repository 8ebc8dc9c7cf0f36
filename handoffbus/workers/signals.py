"""Serving workers until the process is told to stop: SIGTERM or SIGINT drains, a second stops."""

from __future__ import annotations

import logging
import signal
from collections.abc import Callable
from typing import TYPE_CHECKING

import anyio

if TYPE_CHECKING:
    from .runner import Worker

__all__ = ["serve_until_signalled"]

log = logging.getLogger("handoffbus")


async def serve_until_signalled(workers: list[Worker], ready: Callable[[], None] | None = None) -> None:
    """Run several workers in one process until SIGTERM/SIGINT: the first signal drains them all,
    a second stops them at once. ``ready`` is called once the signals are handled (a signal
    before that would end the process undrained)."""
    async with anyio.create_task_group() as tg:

        async def on_signals() -> None:
            with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                if ready is not None:
                    ready()
                async for signum in signals:
                    log.info("received %s: draining %d workers", signal.Signals(signum).name, len(workers))
                    for worker in workers:
                        worker.drain()

        tg.start_soon(on_signals)
        async with anyio.create_task_group() as running:
            for worker in workers:
                running.start_soon(worker.run)
        tg.cancel_scope.cancel()
