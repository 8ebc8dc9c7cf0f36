"""Server time per step of a direct handoff: what each script costs Redis.

    python benchmarks/script_costs.py [--url URL] [--n 5000] [--payload 1024] [--callgrind]
                                      [--json benchmarks/results/script_costs.json]

Runs the steps of ``--n`` direct handoffs one phase at a time, each through the library's own
calls, 100 at once so that the batcher pipelines them as it does in production:

    request_handoff (the request and enqueue scripts), enqueue alone (on a second agent, to
    tell the two apart), take, load, accept, complete, and the settling that rides on a take.

Around each phase it reads ``INFO commandstats`` and ``INFO cpu``. Per call it prints the
FCALL time (the whole script: its Lua and the commands it runs), the commands' own time,
and what is left, which is the Lua and the cost of each ``redis.call``; per handoff, the
server's CPU, sockets included. ``SLOWLOG`` is not used: logging every call adds its own cost
to each. The server should be otherwise idle: its counters are server-wide.

``--callgrind`` runs the embedded server under valgrind's callgrind and adds the instructions
the server executed in each phase, per script call. Timings move with whatever else the host
runs; instruction counts repeat to within 0.5% (the same binary, the same calls), so a
change to a script can be judged on one run. The server runs tens of times slower: use a
small ``--n`` (500 by default there).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any

import anyio
import redis.asyncio as aioredis
from bench_core import (
    REQUESTER,
    TARGET,
    _nothing,
    benchmark_parser,
    commandstats,
    delta,
    environment,
    padded_context,
    run_and_report,
    server_cpu,
    server_info,
)

from handoffbus import EmbeddedServer, HandoffBus, HandoffRequest
from handoffbus.embedded import find_server_binary
from handoffbus.workers.inbox import Inbox

#: commands that are not the scripts' own (the requester's response reader, the readings)
_OUTSIDE = frozenset({"FCALL", "XREAD", "CONFIG|RESETSTAT", "FUNCTION|LOAD"})
WINDOW = 100
CONSUMER = "consumer-1"


async def in_windows(items: Sequence[Any], step: Callable[[Any], Coroutine[Any, Any, Any]]) -> None:
    """``step`` for every item, WINDOW at a time (the batcher pipelines a window's calls)."""
    for first in range(0, len(items), WINDOW):
        async with anyio.create_task_group() as tg:
            for item in items[first:first + WINDOW]:
                tg.start_soon(step, item)


class Callgrind:
    """An embedded server run under callgrind: its instruction count between two points of a run."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        wrapper = directory / "server-under-callgrind"  # the server's binary, exec'd under valgrind
        wrapper.write_text(f'#!/bin/sh\nexec valgrind --tool=callgrind --callgrind-out-file={directory}/callgrind.out '
                           f'{find_server_binary()} "$@"\n')
        wrapper.chmod(0o755)
        self.server = EmbeddedServer(binary=str(wrapper))

    def _control(self, option: str) -> None:
        assert self.server.process is not None  # the wrapper execs valgrind: the same process
        subprocess.run(["callgrind_control", option, str(self.server.process.pid)], check=True, capture_output=True)

    def zero(self) -> None:
        self._control("-z")

    def instructions(self) -> int:
        """Instructions since the last zero: callgrind writes them to a new numbered dump."""
        before = set(self.directory.glob("callgrind.out.*"))
        self._control("-d")
        [dump] = set(self.directory.glob("callgrind.out.*")) - before
        for line in dump.read_text().splitlines():
            if line.startswith(("summary:", "totals:")):
                return int(line.split()[1])
        raise RuntimeError(f"no instruction total in {dump}")


async def phase(
    stats: aioredis.Redis, name: str, handoffs: int, body: Callable[[], Awaitable[None]],
    callgrind: Callgrind | None = None,
) -> dict[str, Any]:
    (calls0, usec0), cpu0 = await commandstats(stats), await server_cpu(stats)
    if callgrind is not None:
        callgrind.zero()
    await body()
    instructions = callgrind.instructions() if callgrind is not None else None
    (calls1, usec1), cpu1 = await commandstats(stats), await server_cpu(stats)
    calls, usec = delta(calls1, calls0), delta(usec1, usec0)
    fcall = calls.get("FCALL", 0)
    inner = sum(v for k, v in usec.items() if k not in _OUTSIDE)
    return {
        **({} if instructions is None else {"instructions_per_call": round(instructions / max(fcall, 1)),
                                            "instructions_per_handoff": round(instructions / handoffs)}),
        "phase": name, "handoffs": handoffs, "fcall_calls": fcall,
        "fcall_us_per_call": round(usec.get("FCALL", 0) / max(fcall, 1), 2),
        "commands_us_per_call": round(inner / max(fcall, 1), 2),
        "commands_per_call": round(sum(v for k, v in calls.items() if k not in _OUTSIDE) / max(fcall, 1), 2),
        "fcall_us_per_handoff": round(usec.get("FCALL", 0) / handoffs, 2),
        "server_cpu_us_per_handoff": round((cpu1 - cpu0) / handoffs * 1e6, 1),
    }


async def run(args: argparse.Namespace) -> dict[str, Any]:
    if not args.callgrind:
        return await measure(args, None)
    with tempfile.TemporaryDirectory(prefix="handoffbus-callgrind-") as scratch:
        return await measure(args, Callgrind(Path(scratch)))


async def measure(args: argparse.Namespace, callgrind: Callgrind | None) -> dict[str, Any]:
    n, context = args.n, padded_context(args.payload)
    prefix = f"costs{os.getpid()}"
    embedded = callgrind.server if callgrind is not None else EmbeddedServer()
    async with embedded if args.url is None else _nothing() as server:
        url = args.url if server is None else server.url
        async with contextlib.AsyncExitStack() as stack:
            stats = aioredis.Redis.from_url(url)
            stack.push_async_callback(stats.aclose)
            # the expiry sweep runs once, at the start: its scripts would count in whichever phase
            # they fell (every 0.25 s by default), and no handoff here comes near a deadline
            bus = await stack.enter_async_context(HandoffBus.connect(url, prefix=prefix, sweep_interval=3600))
            if args.url is not None:
                stack.push_async_callback(bus.clear, confirm=prefix)
            requester, target = bus.client(REQUESTER), bus.client(TARGET)
            inbox = Inbox(bus, TARGET, CONSUMER)
            handles: list[Any] = []
            taken: list[str] = []

            async def request(i: int) -> None:
                handles.append(await requester.request_handoff(HandoffRequest(
                    from_agent=REQUESTER, to_agent=TARGET, reason="cost", context_snapshot=context, timeout=600)))

            async def take_all() -> None:
                while len(taken) < n:
                    _, got = await inbox.take(WINDOW)
                    taken.extend(d.handoff_id for d in got)

            async def settle_all() -> None:
                for first in range(0, n, WINDOW):
                    await inbox.take(0, settle=taken[first:first + WINDOW])

            async def load(first: int) -> None:
                await inbox.load(taken[first:first + WINDOW])

            def transition(name: str, fields: dict[str, Any]) -> Callable[[], Awaitable[None]]:
                async def one(hid: str) -> None:  # as a worker does: its next take settles
                    await target._transition(name, hid, fields, settle=False)
                return lambda: in_windows(taken, one)

            async def enqueue_alone() -> None:
                await in_windows(range(n), lambda i: bus.enqueue("cost-other", f"{REQUESTER}~x{i}", 0))

            await in_windows(range(min(n, 500)), request)  # warm up: scripts loaded, pools grown
            await bus.clear(confirm=prefix)
            handles.clear()
            await bus.redis.config_resetstat()

            async def phase_of(name: str, handoffs: int, body: Callable[[], Awaitable[None]]) -> dict[str, Any]:
                return await phase(stats, name, handoffs, body, callgrind)

            phases = [
                await phase_of("request_handoff (request + enqueue)", n, lambda: in_windows(range(n), request)),
                await phase_of("enqueue alone", n, enqueue_alone),
                await phase_of("take", n, take_all),
                await phase_of("load", n, lambda: in_windows(range(0, n, WINDOW), load)),
                await phase_of("accept", n, transition("accept", {"lease": CONSUMER})),
                await phase_of("complete", n, transition(
                    "complete", {"result": bus.codec.dumps_value({"ok": True}), "lease": CONSUMER})),
                await phase_of("settle (in a take)", n, settle_all),
            ]
            server_desc = await server_info(stats)
    by_name = {p["phase"]: p for p in phases}
    both, alone = by_name["request_handoff (request + enqueue)"], by_name["enqueue alone"]
    request_only = round(both["fcall_us_per_handoff"] - alone["fcall_us_per_handoff"], 2)
    lifecycle = [p for p in phases if p["phase"] != "enqueue alone"]
    return {
        "config": {"url": args.url or "embedded (unix socket)", "n": n, "payload": args.payload,
                   "context_bytes": len(context), "window": WINDOW},
        "environment": environment(server_desc),
        "phases": phases,
        "request_script_us": request_only,
        "callgrind": bool(args.callgrind),
        "per_lifecycle": {
            "fcall_us": round(sum(p["fcall_us_per_handoff"] for p in lifecycle), 1),
            "server_cpu_us": round(sum(p["server_cpu_us_per_handoff"] for p in lifecycle), 1),
        },
    }


def render(result: dict[str, Any]) -> str:
    env, cfg = result["environment"], result["config"]
    lines = [f"server   {env['server']} {env['version']}, {cfg['url']}; {env['cpus']} CPUs; n {cfg['n']}, "
             f"{cfg['context_bytes']} B contexts, {cfg['window']} calls at a time", "",
             f"{'phase':38}{'calls':>7}{'FCALL us':>12}{'commands us':>13}{'(count)':>9}{'Lua+calls us':>14}"
             f"{'us/handoff':>12}{'server CPU us':>15}"]
    for p in result["phases"]:
        per_handoff = p["fcall_calls"] / p["handoffs"]
        lua = p["fcall_us_per_call"] - p["commands_us_per_call"]
        lines.append(f"{p['phase']:38}{per_handoff:>7.2f}{p['fcall_us_per_call']:>12.2f}"
                     f"{p['commands_us_per_call']:>13.2f}{p['commands_per_call']:>9.1f}{lua:>14.2f}"
                     f"{p['fcall_us_per_handoff']:>12.2f}{p['server_cpu_us_per_handoff']:>15.1f}")
    life = result["per_lifecycle"]
    lines += ["", f"request script alone (first phase less the second): {result['request_script_us']:.2f} us",
              f"per lifecycle (every phase but 'enqueue alone'): FCALL {life['fcall_us']:.1f} us, "
              f"server CPU {life['server_cpu_us']:.1f} us",
              "calls = script calls per handoff; the us columns are per call, but for us/handoff and server CPU"]
    if result["callgrind"]:
        lines += ["", f"{'server instructions (callgrind)':38}{'per call':>12}{'per handoff':>14}"]
        lines += [f"{p['phase']:38}{p['instructions_per_call']:>12,}{p['instructions_per_handoff']:>14,}"
                  for p in result["phases"]]
        total = sum(p["instructions_per_handoff"] for p in result["phases"] if p["phase"] != "enqueue alone")
        lines.append(f"{'per lifecycle':38}{'':>12}{total:>14,}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--n", type=int, default=None, help="handoffs (default 5000; 500 with --callgrind)")
    parser.add_argument("--payload", type=int, default=1024, help="context bytes (default 1024)")
    parser.add_argument("--callgrind", action="store_true",
                        help="run the embedded server under callgrind and count its instructions per phase")
    parser.add_argument("--json", default="benchmarks/results/script_costs.json", help="where to write the results")
    args = parser.parse_args(argv)
    if args.n is None:
        args.n = 500 if args.callgrind else 5000
    if args.n <= 0 or args.payload < 0:
        parser.error("--n must be positive and --payload non-negative")
    if args.callgrind:
        if args.url is not None:
            parser.error("--callgrind starts its own server: leave out --url")
        missing = [tool for tool in ("valgrind", "callgrind_control") if shutil.which(tool) is None]
        if missing:
            parser.error(f"--callgrind needs valgrind, and {', '.join(missing)} is not on PATH "
                         "(Debian: apt-get install valgrind)")
    run_and_report(run, args, render)
    return 0


if __name__ == "__main__":
    sys.exit(main())
