"""Python instructions per direct handoff: the requester and a worker, counted by callgrind.

    python benchmarks/client_costs.py [--url URL] [--n 3000] [--payload 1024]
                                      [--json benchmarks/results/client_costs.json]

Runs the direct lifecycle through the public API in one process: ``request_handoff``, then
the decision and the outcome awaited, 100 in flight, against a ``Worker`` serving
``bench_workers:BenchEcho`` on the same event loop (its acceptance hook, work hook, lease and
settling, as a worker process runs them). The process runs under valgrind's callgrind twice,
after the same warm-up: once with ``--n`` handoffs, once with none. The difference, divided
by ``--n``, is what one handoff costs the requester and the worker together, start-up left out.

CPU time on a shared host moves by 10-20% from run to run; these counts repeat to within
about 0.2%, so a change to the Python side can be judged on one run. They are not times:
callgrind slows the process fifty-fold while the server runs at full speed, so batches are
larger than in production and a handoff's share of each batch's fixed costs is smaller.
Needs valgrind (Debian: ``apt-get install valgrind``).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import anyio
from bench_core import benchmark_parser, environment, padded_context, report
from bench_workers import BenchEcho, handoff_round

from handoffbus import EmbeddedServer, HandoffBus
from handoffbus.runtime import backend_options, freeze_startup
from handoffbus.workers.runner import Worker

HERE = Path(__file__).resolve().parent
WARMUP = 300
WINDOW = 100
_COLLECTED = re.compile(r"Collected : (\d+)")


async def lifecycles(url: str, n: int, payload: int) -> None:
    """The measured body, run in the child: ``WARMUP`` handoffs, then ``n``."""
    async with HandoffBus.connect(url, prefix=f"costs{os.getpid()}") as bus:
        worker = Worker(bus, BenchEcho(), concurrency=WINDOW)
        async with anyio.create_task_group() as tg:
            await tg.start(worker.run)
            context = padded_context(payload)
            await handoff_round(bus, WARMUP, WINDOW, context, False)
            freeze_startup()  # as a worker process does once started
            if n:
                await handoff_round(bus, n, WINDOW, context, False)
            worker.drain()
            tg.cancel_scope.cancel()


def instructions(url: str, n: int, payload: int, scratch: Path) -> int:
    """Instructions the child executed in all, under callgrind."""
    out = subprocess.run(
        ["valgrind", "--tool=callgrind", f"--callgrind-out-file={scratch}/callgrind.%p", sys.executable,
         str(Path(__file__).resolve()), "--child", url, "--n", str(n), "--payload", str(payload)],
        capture_output=True, text=True, cwd=HERE, check=True)
    found = _COLLECTED.search(out.stderr)
    if found is None:
        raise RuntimeError(f"callgrind printed no count:\n{out.stderr[-2000:]}")
    return int(found.group(1))


async def run(args: argparse.Namespace) -> dict[str, Any]:
    async with contextlib.AsyncExitStack() as stack:
        url = args.url or (await stack.enter_async_context(EmbeddedServer())).url
        scratch = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="handoffbus-client-costs-")))
        measured, base = await anyio.to_thread.run_sync(
            lambda: (instructions(url, args.n, args.payload, scratch), instructions(url, 0, args.payload, scratch)))
    return {"config": {"n": args.n, "warmup": WARMUP, "inflight": WINDOW, "payload": args.payload},
            "instructions": {"with_n": measured, "warmup_only": base,
                             "per_handoff": round((measured - base) / args.n)},
            "environment": environment({"server": "embedded" if args.url is None else args.url})}


def render(result: dict[str, Any]) -> str:
    counts, config = result["instructions"], result["config"]
    return "\n".join([
        f"config      n {config['n']} after {config['warmup']} warm-up, inflight {config['inflight']}, "
        f"context {config['payload']} B",
        f"requester + worker, one process: {counts['per_handoff']:,} instructions per handoff "
        f"({counts['with_n']:,} - {counts['warmup_only']:,} over {config['n']})",
    ])


def main(argv: list[str] | None = None) -> int:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--n", type=int, default=3000, help="measured handoffs (default 3000)")
    parser.add_argument("--payload", type=int, default=1024, help="context bytes (default 1024)")
    parser.add_argument("--json", default="benchmarks/results/client_costs.json", help="where to write the results")
    parser.add_argument("--child", metavar="URL", help=argparse.SUPPRESS)  # the run under callgrind
    args = parser.parse_args(argv)
    if args.n < 0 or args.payload < 0:
        parser.error("--n and --payload must not be negative")
    if args.child:
        anyio.run(lifecycles, args.child, args.n, args.payload, backend="asyncio", backend_options=backend_options())
        return 0
    if args.n == 0:
        parser.error("--n must be positive")
    if shutil.which("valgrind") is None:
        parser.error("client_costs.py needs valgrind, which is not on PATH (Debian: apt-get install valgrind)")
    report(anyio.run(run, args, backend="asyncio", backend_options=backend_options()), render, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
