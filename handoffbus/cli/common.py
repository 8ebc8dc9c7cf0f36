"""What every command shares: where Redis is, the key prefix, JSON output and exit codes.

``--redis-url``, ``--prefix`` and ``--json`` may be given before the command (global) or
after it; the command's own wins. The URL falls back to ``HANDOFFBUS_REDIS_URL``, then
``REDIS_URL``. Exit codes: 0 ok, 1 a check or a handoff failed, 2 usage, 69 Redis
unavailable (sysexits' EX_UNAVAILABLE).
"""

from __future__ import annotations

import atexit
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Annotated, Any, NoReturn

import anyio
import msgspec
import typer
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoPermissionError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError
from rich.console import Console
from rich.table import Table

from ..bus import HandoffBus
from ..config import check_seconds
from ..errors import AuthenticationFailed, HandoffbusError, InvalidName, InvalidRequest, ServerUnavailable
from ..names import check_name
from ..runtime import backend_options, freeze_startup

__all__ = [
    "EXIT_FAILED", "EXIT_OK", "EXIT_UNAVAILABLE", "EXIT_USAGE", "Json", "Options", "Prefix", "RedisUrl",
    "console", "emit_json", "exit_past_hook_threads", "open_bus", "options", "run", "table", "usage_error",
]

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_UNAVAILABLE = 0, 1, 2, 69

RedisUrl = Annotated[str | None, typer.Option(
    "--redis-url", help="server URL (default: HANDOFFBUS_REDIS_URL, then REDIS_URL)", show_default=False)]
Prefix = Annotated[str | None, typer.Option("--prefix", help="key prefix (default hb)", show_default=False)]
Json = Annotated[bool, typer.Option("--json", help="print JSON instead of text")]

# no markup: what the commands print holds user data (reasons, errors, results, names) that may
# contain square brackets, and no fixed label of theirs is styled
console = Console(highlight=False, soft_wrap=True, markup=False)
errors = Console(stderr=True, highlight=False, soft_wrap=True, markup=False)


@dataclass
class Options:
    redis_url: str | None = None
    prefix: str = "hb"
    json: bool = False

    def url(self, command: str) -> str:
        url = self.redis_url or os.environ.get("HANDOFFBUS_REDIS_URL") or os.environ.get("REDIS_URL")
        if not url:
            usage_error(f"'{command}' needs a server: give --redis-url, HANDOFFBUS_REDIS_URL or REDIS_URL")
        return url


def options(ctx: typer.Context, redis_url: str | None = None, prefix: str | None = None,
            as_json: bool = False) -> Options:
    """The global options, overridden by the command's own."""
    base: Options = ctx.find_root().obj or Options()
    return Options(redis_url=redis_url or base.redis_url, prefix=prefix or base.prefix, json=as_json or base.json)


def usage_error(message: str) -> NoReturn:
    """Bad input: say why, exit 2."""
    errors.print(f"handoffbus: error: {message}")
    raise typer.Exit(EXIT_USAGE)


#: the most entries a listing may ask for (Redis takes a COUNT up to 2^63 - 1; no listing needs that)
MAX_COUNT = 1_000_000_000


def check_count(count: int) -> None:
    if not 1 <= count <= MAX_COUNT:
        usage_error(f"--count must be from 1 to {MAX_COUNT}")


def check_usage(agents: list[str] | None, durations: list[tuple[str, float, float]]) -> None:
    """Agent ids and durations given on the command line, checked before anything runs (a
    0 s refresh would spin; a malformed agent id would read as "no live worker")."""
    try:
        for name, value, least in durations:
            check_seconds(name, value, least=least)
        for agent in agents or []:
            check_name(agent, "agent id")
    except (InvalidRequest, InvalidName) as exc:
        usage_error(str(exc))


def open_bus(opts: Options, command: str, **settings: Any) -> HandoffBus:
    """A bus for a command (bad settings raise, and ``run`` reports them as usage errors)."""
    return HandoffBus.connect(opts.url(command), prefix=opts.prefix, **settings)


def run(func: Callable[..., Awaitable[int]], *args: Any) -> None:
    """Run a command's coroutine and exit with its code; Redis out of reach exits 69, any other
    handoffbus error 1, bad input 2."""
    try:
        try:
            code = anyio.run(func, *args, backend_options=backend_options())
        except BaseExceptionGroup as group:  # one error out of a task group: reported as itself
            raise _only(group) from None
    except (ServerUnavailable, AuthenticationFailed, RedisConnectionError, RedisTimeoutError, socket.gaierror) as exc:
        errors.print(f"handoffbus: Redis unavailable: {exc}")
        code = EXIT_UNAVAILABLE
    except (InvalidRequest, InvalidName) as exc:
        errors.print(f"handoffbus: error: {exc}")
        code = EXIT_USAGE
    except HandoffbusError as exc:
        errors.print(f"handoffbus: {type(exc).__name__}: {exc}")
        code = EXIT_FAILED
    except NoPermissionError as exc:  # e.g. the read-only monitor user asked to write
        errors.print(f"handoffbus: the server's ACL refused this user: {exc}")
        code = EXIT_FAILED
    except ResponseError as exc:  # e.g. OOM at maxmemory with noeviction, READONLY from a replica
        errors.print(f"handoffbus: the server refused the command: {exc}")
        code = EXIT_FAILED
    except KeyboardInterrupt:
        code = 130
    raise typer.Exit(code)


def _only(group: BaseExceptionGroup[BaseException]) -> BaseException:
    """The one exception a group holds, however deeply nested; the group itself if it holds more."""
    inner: BaseException = group
    while isinstance(inner, BaseExceptionGroup) and len(inner.exceptions) == 1:
        inner = inner.exceptions[0]
    return group if isinstance(inner, BaseExceptionGroup) else inner


def serve(func: Callable[..., Awaitable[int]], *args: Any) -> None:
    """``run`` for a long-running process (worker, forwarder, exporter): its start-up heap is
    frozen out of the garbage collector first (see runtime.py)."""
    freeze_startup()
    run(func, *args)


#: seconds a finished command waits for hook threads a stop left running before it exits anyway
THREADS_WAIT = 1.0


def exit_past_hook_threads(code: int) -> None:
    """A plain-def hook that a stop left running in its thread must not keep the process: the
    interpreter waits for such threads at exit, however long they block. Wait a moment for
    them, then exit without them (exit handlers run first). Returns if none is left."""
    deadline = time.monotonic() + THREADS_WAIT
    for thread in threading.enumerate():
        if thread.name == "AnyIO worker thread":  # idle ones end on their own once the loop closed
            thread.join(max(deadline - time.monotonic(), 0))
    left = [t for t in threading.enumerate() if t.name == "AnyIO worker thread" and t.is_alive()]
    if not left:
        return
    logging.getLogger("handoffbus").warning("%d hook threads still running at exit: not waiting for them", len(left))
    atexit._run_exitfuncs()  # logging's flush, exporters' last batches
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def emit_json(value: Any) -> None:
    """One JSON document on its own line (msgspec structs and enums as plain values)."""
    sys.stdout.write(msgspec.json.encode(msgspec.to_builtins(value)).decode() + "\n")
    sys.stdout.flush()


def table(title: str, columns: tuple[str, ...], rows: list[tuple[str, ...]]) -> Table:
    """A table of text cells; long cells fold rather than being cut."""
    found = Table(title=title, title_justify="left")
    for column in columns:
        found.add_column(column, overflow="fold")
    for row in rows:
        found.add_row(*row)
    return found


def ago(at_ms: int, now_ms: int) -> str:
    """'12.3 s ago' / 'in 4.0 s' for a Redis time relative to another."""
    delta = (now_ms - at_ms) / 1000
    return f"{delta:.1f} s ago" if delta >= 0 else f"in {-delta:.1f} s"


def seconds(value: float | None) -> str:
    """A duration for a table cell: '-' for none."""
    if value is None:
        return "-"
    if value < 1:
        return f"{value * 1000:.0f} ms"
    if value < 120:
        return f"{value:.1f} s"
    return f"{value / 60:.1f} min"
