"""Worker-process benchmark: handoffs served by real `handoffbus worker` processes.

    python benchmarks/bench_workers.py [--url URL] [--processes 1,4] [--n 5000] [--inflight 100]
                                       [--concurrency INFLIGHT] [--payload 1024] [--rounds 1]
                                       [--json benchmarks/results/workers.json]

Without ``--url`` an EmbeddedServer is started (unix socket) and stopped afterwards.

For each process count P: start P ``handoffbus worker bench_workers:BenchEcho`` processes
(each with ``--concurrency``), wait until all P have registered, warm up, then run ``--n``
handoffs (request -> the worker's acceptance hook -> work hook -> COMPLETED) from
``--inflight`` requester tasks in this process, each awaiting decision and outcome. Then
SIGTERM every worker and check it exits 0. Each count runs direct handoffs (``to_agent``
named) and routed ones (``capabilities_required`` only, pulled from the capability set's
queue), unless ``--modes`` says otherwise; ``isolated`` runs direct handoffs between isolated
agents (workers started with ``--isolated``, a ``handoffbus forwarder`` process carrying
every call between agents; its CPU is counted with the workers'). Reports handoffs/s, decision and outcome
latency, CPU per handoff in this process, the workers and the server, and the ratio to the
bare and batched streams loops of bench_core.py, run first: their client in this process, their
worker loop in a process of its own.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import anyio
import redis.asyncio as aioredis
from anyio.abc import Process
from bench_core import (
    _nothing,
    benchmark_parser,
    ceiling_round,
    environment,
    latency_ms,
    median_run,
    padded_context,
    run_and_report,
    server_cpu,
    server_info,
)

from handoffbus import EmbeddedServer, HandoffBus, HandoffRequest, HandoffStatus
from handoffbus.workers import Agent, ReceivedHandoff

HERE = Path(__file__).resolve().parent
REQUESTER = "bench-req"


class BenchEcho(Agent):
    """The served agent: sw4rm's default acceptance, a trivial work hook."""

    agent_id = "bench-worker"
    capabilities = ["echo"]

    async def on_handoff_received(self, handoff: ReceivedHandoff) -> Any:
        return {"ok": True, "attempt": handoff.attempt}


def process_cpu_s(pid: int) -> float:
    """user + system CPU seconds of a child process, from /proc (0.0 where unavailable)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def start_workers(url: str, prefix: str, count: int, concurrency: int, isolated: bool = False) -> list[Process]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get(
        "PYTHONPATH", "")])}
    procs = []
    if isolated:  # the forwarder first: isolated workers' first calls go through it
        procs.append(await anyio.open_process(
            [sys.executable, "-m", "handoffbus", "forwarder", REQUESTER, BenchEcho.agent_id, "--redis-url", url,
             "--prefix", prefix], cwd=HERE, env=env, stderr=None))
    for _ in range(count):
        procs.append(await anyio.open_process(
            [sys.executable, "-m", "handoffbus", "worker", "bench_workers:BenchEcho", "--redis-url", url,
             "--prefix", prefix, "--concurrency", str(concurrency), *(["--isolated"] if isolated else [])],
            cwd=HERE, env=env, stderr=None,
        ))
    for proc in procs:  # each prints one "worker ... serving" line once it has joined
        assert proc.stdout is not None
        with anyio.fail_after(60):
            banner = await proc.stdout.receive()
        if b"serving" not in banner:
            raise RuntimeError(f"worker did not start: {banner!r}")
    return procs


async def stop_workers(procs: list[Process]) -> list[int]:
    for proc in procs:
        proc.send_signal(signal.SIGTERM)
    codes = []
    for proc in procs:
        with anyio.fail_after(60):
            codes.append(await proc.wait())
        await proc.aclose()
    return codes


#: where a handoff's time goes: until request_handoff returns; from then until the server
#: wrote ACCEPTED; until it wrote COMPLETED; until the requester heard it. The middle two are
#: Redis TIME, set against this host's clock: right only with the server on this host.
STAGES = ("request", "to accepted", "to completed", "heard")


async def handoff_round(bus: HandoffBus, n: int, inflight: int, context: bytes, routed: bool) -> dict[str, Any]:
    requester = bus.client(REQUESTER)
    decision_lat: list[float] = []
    outcome_lat: list[float] = []
    stages: list[tuple[float, float, float, float]] = []
    problems: Counter[str] = Counter()
    issued = 0

    async def request_loop() -> None:
        nonlocal issued
        while issued < n:
            issued += 1
            t0 = time.perf_counter()
            handle = await requester.request_handoff(HandoffRequest(
                from_agent=REQUESTER, to_agent="" if routed else BenchEcho.agent_id, reason="bench",
                context_snapshot=context,
                capabilities_required=["echo"], timeout=60,
            ))
            requested, requested_at = time.perf_counter(), time.time()
            decision = await handle.decision()
            t1 = time.perf_counter()
            outcome = await handle.outcome()
            t2, heard_at = time.perf_counter(), time.time()
            decision_lat.append(t1 - t0)
            outcome_lat.append(t2 - t0)
            accepted_at, completed_at = decision.timestamp_ms / 1000, outcome.timestamp_ms / 1000
            stages.append((requested - t0, accepted_at - requested_at, completed_at - accepted_at,
                           heard_at - completed_at))
            if decision.status is not HandoffStatus.ACCEPTED or outcome.status is not HandoffStatus.COMPLETED:
                problems[f"{decision.status}/{outcome.status}"] += 1

    t0 = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for _ in range(min(inflight, n)):
            tg.start_soon(request_loop)
    elapsed = time.perf_counter() - t0
    return {"n": n, "seconds": round(elapsed, 4), "handoffs_per_s": round(n / elapsed, 1),
            "decision_ms": latency_ms(decision_lat), "outcome_ms": latency_ms(outcome_lat),
            "stages_ms": {name: latency_ms(s[i] for s in stages) for i, name in enumerate(STAGES)},
            "problems": dict(problems)}


async def measure_processes(
    url: str, stats: aioredis.Redis, count: int, args: argparse.Namespace, context: bytes, mode: str
) -> dict[str, Any]:
    prefix = f"benchw{os.getpid()}p{count}{mode[0]}"
    routed, isolated = mode == "routed", mode == "isolated"
    async with HandoffBus.connect(url, prefix=prefix, isolated=REQUESTER if isolated else None) as bus:
        procs = await start_workers(url, prefix, count, args.concurrency, isolated)
        try:
            await handoff_round(bus, args.warmup, args.inflight, context, routed)
            runs = []
            for _ in range(args.rounds):
                workers0 = sum(process_cpu_s(p.pid) for p in procs)
                server0, client0 = await server_cpu(stats), time.process_time()
                result = await handoff_round(bus, args.n, args.inflight, context, routed)
                client1, server1 = time.process_time(), await server_cpu(stats)
                workers1 = sum(process_cpu_s(p.pid) for p in procs)
                result["cpu_us_per_handoff"] = {
                    "requester": round((client1 - client0) / args.n * 1e6, 1),
                    "workers": round((workers1 - workers0) / args.n * 1e6, 1),
                    "server": round((server1 - server0) / args.n * 1e6, 1),
                }
                runs.append(result)
        finally:
            with anyio.CancelScope(shield=True):
                codes = await stop_workers(procs)
                if args.url is not None and not isolated:
                    await bus.clear(confirm=prefix)
    best = median_run(runs, "handoffs_per_s")
    return {**best, "processes": count, "mode": mode, "exit_codes": codes,
            "rounds_handoffs_per_s": [r["handoffs_per_s"] for r in runs]}


async def run(args: argparse.Namespace) -> dict[str, Any]:
    context = padded_context(args.payload)
    async with EmbeddedServer() if args.url is None else _nothing() as server:
        url = args.url or server.url
        stats = aioredis.Redis.from_url(url)
        raw = aioredis.Redis.from_url(url, max_connections=2 * args.inflight + 32)
        try:
            desc = await server_info(stats)
            base = f"benchw{os.getpid()}:raw"
            # the loops' worker runs in a process of its own, as the handoff workers do
            await ceiling_round(raw, args.warmup, args.inflight, args.payload, base, batched=False, worker_url=url)
            bare = median_run([await ceiling_round(raw, args.n, args.inflight, args.payload, base, batched=False,
                                                   worker_url=url)
                               for _ in range(args.rounds)], "msgs_per_s")
            batched = median_run([await ceiling_round(raw, args.n, args.inflight, args.payload, base, worker_url=url)
                                  for _ in range(args.rounds)], "msgs_per_s")
            results = [await measure_processes(url, stats, count, args, context, mode)
                       for count in args.processes for mode in args.modes]
        finally:
            await raw.aclose()
            await stats.aclose()
    for r in results:
        r["ratio_to_bare"] = round(r["handoffs_per_s"] / bare["msgs_per_s"], 4)
        r["ratio_to_batched"] = round(r["handoffs_per_s"] / batched["msgs_per_s"], 4)
    return {
        "config": {"url": args.url or "embedded (unix socket)", "n": args.n, "inflight": args.inflight,
                   "concurrency_per_process": args.concurrency, "payload": args.payload,
                   "context_bytes": len(context), "warmup": args.warmup, "rounds": args.rounds},
        "environment": environment(desc),
        "bare_ceiling": bare, "batched_ceiling": batched, "workers": results,
    }


def render(result: dict[str, Any]) -> str:
    cfg, env = result["config"], result["environment"]
    lines = [
        f"server      {env['server']} {env['version']}, {cfg['url']}; {env['cpus']} CPUs",
        f"config      n {cfg['n']}, inflight {cfg['inflight']}, concurrency {cfg['concurrency_per_process']}"
        f"/process, context {cfg['context_bytes']} B, rounds {cfg['rounds']} (median shown)",
        f"bare loop   {result['bare_ceiling']['msgs_per_s']:>9,.0f} msgs/s",
        f"batched     {result['batched_ceiling']['msgs_per_s']:>9,.0f} msgs/s",
    ]
    for r in result["workers"]:
        cpu = r["cpu_us_per_handoff"]
        lines.append(
            f"{r['processes']} process{'es' if r['processes'] > 1 else '  '} {r['mode']:<8}"
            f" {r['handoffs_per_s']:>9,.0f} handoffs/s"
            f"  ({r['ratio_to_bare']:.1%} of bare, {r['ratio_to_batched']:.1%} of batched)"
            f"  decision p50/p99 {r['decision_ms']['p50']:.1f}/{r['decision_ms']['p99']:.1f} ms"
            f"  outcome p50/p99 {r['outcome_ms']['p50']:.1f}/{r['outcome_ms']['p99']:.1f} ms"
            f"  CPU us/handoff: requester {cpu['requester']:.0f}, workers {cpu['workers']:.0f},"
            f" server {cpu['server']:.0f}  exit codes {r['exit_codes']}"
            + (f"  PROBLEMS {r['problems']}" if r["problems"] else "")
        )
        lines.append("            stages p50 ms: " + ", ".join(
            f"{name} {r['stages_ms'][name]['p50']:.1f}" for name in STAGES))
    if env.get("loadavg_after"):
        lines.append("load avg    " + " ".join(f"{x:.2f}" for x in env["loadavg_after"]))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--processes", default="1,4", help="worker process counts to run (default 1,4)")
    parser.add_argument("--modes", default="direct,routed",
                        help="direct (to_agent named), routed (by capability) and/or isolated (direct, between "
                             "isolated agents through a forwarder) handoffs (default direct,routed)")
    parser.add_argument("--n", type=int, default=5000, help="measured handoffs per run (default 5000)")
    parser.add_argument("--inflight", type=int, default=100, help="outstanding handoffs (default 100)")
    parser.add_argument("--concurrency", type=int, default=None,
                        help="--concurrency of each worker (default: --inflight, so one worker can hold the window)")
    parser.add_argument("--payload", type=int, default=1024, help="context bytes (default 1024)")
    parser.add_argument("--warmup", type=int, default=1000, help="warm-up handoffs per run (default 1000)")
    parser.add_argument("--rounds", type=int, default=1, help="measured rounds per run; the median is shown")
    parser.add_argument("--json", default="benchmarks/results/workers.json", help="where to write the results")
    args = parser.parse_args(argv)
    if args.concurrency is None:
        args.concurrency = args.inflight
    try:
        args.processes = [int(p) for p in args.processes.split(",")]
    except ValueError:
        parser.error("--processes takes a comma-separated list of counts, e.g. 1,4")
    args.modes = args.modes.split(",")
    if not set(args.modes) <= {"direct", "routed", "isolated"}:
        parser.error("--modes takes direct, routed and/or isolated")
    if min(args.processes) <= 0 or args.n <= 0 or args.inflight <= 0 or args.rounds <= 0 or args.concurrency <= 0:
        parser.error("--processes, --n, --inflight, --concurrency and --rounds must be positive")
    run_and_report(run, args, render)
    return 0


if __name__ == "__main__":
    sys.exit(main())
