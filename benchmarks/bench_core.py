"""Core throughput benchmark: handoffbus against a hand-written Redis Streams round trip.

    python benchmarks/bench_core.py [--url URL] [--n 5000] [--inflight 100] [--payload 1024]
                                    [--json benchmarks/results/core.json]
                                    [--rounds 1] [--warmup N] [--max-connections N] [--socket-timeout S]

Without ``--url`` an EmbeddedServer is started (unix socket) and stopped afterwards.

1. Ceiling: a bare ``redis.asyncio`` request/reply over two streams. A client keeps
   ``--inflight`` requests outstanding (XADD, pipelined when several slots are free); one
   worker task XREADGROUPs up to 100, XADDs a reply per entry and XACKs the batch in one
   pipeline; the client reads replies with XREAD BLOCK and completes them. Reports msgs/s.
2. Ours: request -> accept -> complete with ``--inflight`` handoffs in flight: one requester
   client running ``--inflight`` tasks (request_handoff, decision(), outcome()), one worker
   loop (Inbox.take with count = free capacity up to 100, Inbox.load, accept and complete
   run concurrently in a task group, settle ids carried to the next take).
3. Redis commands per lifecycle: the INFO commandstats delta over the measured run (every
   call, including the commands scripts run) and the top-level commands the process sent,
   counted exactly where redis-py packs each command for the wire.

4. CPU per message on both sides: this process (time.process_time) and the server (INFO cpu).

Both parts warm up (scripts loaded, connections open) before the measured run; with
``--rounds`` > 1 they alternate and the median round of each is reported.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import re
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import redis
import redis.asyncio as aioredis
from redis.asyncio.connection import ConnectionPool

from handoffbus import (
    ConversationEntry,
    EmbeddedServer,
    HandoffBus,
    HandoffContext,
    HandoffRequest,
    HandoffStatus,
    serialize_context,
)
from handoffbus.runtime import backend_options, freeze_startup, uses_uvloop
from handoffbus.workers.inbox import Delivery, Inbox

REQUESTER = "bench-requester"
_THIS_SCRIPT = str(Path(__file__).resolve())
TARGET = "bench-target"
#: Commands whose second argument names a subcommand worth telling apart.
_SUBCOMMANDS = frozenset({"CLIENT", "CONFIG", "SCRIPT", "XGROUP", "XINFO", "COMMAND", "FUNCTION"})


# ---------------------------------------------------------------------------- counting


_FCALL = re.compile(rb"\*\d+\r\n\$5\r\nFCALL\r\n\$\d+\r\n(hb_[0-9a-f]+_\w+)\r\n")


class CommandCounter:
    """Top-level commands sent by one client, by name; FCALL also by script.

    ``record`` runs once per command on the hot path, so it only bumps a counter keyed by
    what redis-py passed; names are tidied up when a snapshot is taken.
    """

    def __init__(self) -> None:
        self._raw: Counter[Any] = Counter()

    def record(self, args: Sequence[Any]) -> None:
        head = args[0]
        if head == "FCALL":
            self._raw[(head, args[1])] += 1
        elif head in _SUBCOMMANDS and len(args) > 1:
            self._raw[f"{head} {args[1]}"] += 1
        else:
            self._raw[head] += 1

    def snapshot(self) -> tuple[Counter[str], Counter[str]]:
        commands: Counter[str] = Counter()
        scripts: Counter[str] = Counter()
        for key, count in self._raw.items():
            if isinstance(key, tuple):
                commands["FCALL"] += count
                function = key[1].decode() if isinstance(key[1], bytes) else str(key[1])
                scripts[function.rsplit("_", 1)[-1] if function.startswith("hb_") else function] += count
            else:
                # redis-py passes some subcommands inside the first argument ("CLIENT SETINFO")
                name = key.decode() if isinstance(key, bytes) else str(key)
                commands[" ".join(name.upper().split()[:2])] += count
        return commands, scripts


def counting_client(url: str, counter: CommandCounter, pool_options: dict[str, Any]) -> aioredis.Redis:
    """A redis.asyncio client, configured as ``Redis.from_url(url)`` is but for the pool size,
    that counts every command where it is packed for the socket (single commands and pipelines).

    The pool size is explicit: redis-py's default (100 in redis-py 8) raises MaxConnectionsError
    as soon as ~100 handoffs are requested at once, because every concurrent command holds a
    connection of its own.
    """
    pool = ConnectionPool.from_url(url, **pool_options)
    base = pool.connection_class

    class CountingConnection(base):  # type: ignore[misc, valid-type]
        def pack_command(self, *args: Any) -> list[bytes]:
            counter.record(args)
            return super().pack_command(*args)

        async def send_packed_command(self, command: Any, check_health: bool = True) -> None:
            # handoffbus's script batcher writes pre-packed FCALL batches as one bytes object
            if isinstance(command, bytes):
                for function in _FCALL.findall(command):
                    counter.record(("FCALL", function))
            await super().send_packed_command(command, check_health)

    CountingConnection.__name__ = f"Counting{base.__name__}"
    pool.connection_class = CountingConnection
    return aioredis.Redis.from_pool(pool)


async def commandstats(client: aioredis.Redis) -> tuple[dict[str, int], dict[str, int]]:
    """Server-side calls and microseconds per command (INFO commandstats), INFO itself left out.
    Commands run by scripts count here too; a script's usec include theirs."""
    info = await client.info("commandstats")
    calls, usec = {}, {}
    for key, value in info.items():
        name = key.removeprefix("cmdstat_").upper()
        if name != "INFO":
            calls[name], usec[name] = int(value["calls"]), int(value["usec"])
    return calls, usec


def delta(after: dict[str, int] | Counter[str], before: dict[str, int] | Counter[str]) -> dict[str, int]:
    out = {k: after[k] - before.get(k, 0) for k in after}
    return {k: v for k, v in sorted(out.items(), key=lambda kv: (-kv[1], kv[0])) if v}


def per(counts: dict[str, int], n: int) -> dict[str, float]:
    return {k: round(v / n, 4) for k, v in counts.items()}


# ---------------------------------------------------------------------------- statistics


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile of already sorted values."""
    if not sorted_values:
        return math.nan
    rank = max(1, math.ceil(q / 100 * len(sorted_values)))
    return sorted_values[rank - 1]


def latency_ms(values: Iterable[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {
        "p50": round(percentile(ordered, 50) * 1000, 3),
        "p99": round(percentile(ordered, 99) * 1000, 3),
        "max": round(ordered[-1] * 1000, 3) if ordered else math.nan,
    }


# ---------------------------------------------------------------------------- ceiling


@dataclass
class _Flow:
    """Credit-based flow control shared by a sender and the task that sees completions."""

    credits: int
    wake: anyio.Event = field(default_factory=anyio.Event)

    def give(self, k: int) -> None:
        self.credits += k
        self.wake.set()

    async def take_all(self) -> int:
        while self.credits == 0:
            self.wake = anyio.Event()
            await self.wake.wait()
        k, self.credits = self.credits, 0
        return k


async def ceiling_worker(r: aioredis.Redis, req: str, rep: str, group: str, n: int) -> None:
    """The ceiling's worker: XREADGROUP up to 100, an XADD reply each and one XACK, pipelined."""
    handled = 0
    while handled < n:
        reply = await r.xreadgroup(group, "w1", {req: ">"}, count=100, block=1000)
        if not reply:
            continue
        entries = reply[0][1]
        async with r.pipeline(transaction=False) as pipe:
            for _entry_id, fields in entries:
                pipe.xadd(rep, {"c": fields[b"c"], "r": b"ok"})
            pipe.xack(req, group, *[entry_id for entry_id, _ in entries])
            await pipe.execute()
        handled += len(entries)


async def _ceiling_worker_process(url: str, req: str, rep: str, group: str, n: int) -> None:
    async with aioredis.Redis.from_url(url) as r:
        await r.ping()
        print("ready", flush=True)  # the parent starts its clock after this line
        await ceiling_worker(r, req, rep, group, n)


async def ceiling_round(
    r: aioredis.Redis, n: int, inflight: int, payload: int, base: str, *, batched: bool = True,
    worker_url: str | None = None,
) -> dict[str, Any]:
    """n request/reply round trips over bare streams with ``inflight`` outstanding.

    ``batched``: one sender pipelines every request it has room for (the batched ceiling).
    Otherwise ``inflight`` tasks each XADD one request and await its reply before the next
    (the bare round trip, shaped like a requester awaiting each handoff). The worker pipelines
    its replies either way. With ``worker_url`` the worker runs in a process of its own,
    connected there, as a handoff worker does; otherwise it is a task of this process."""
    req, rep, group = f"{base}:req", f"{base}:rep", "workers"
    await r.delete(req, rep)
    await r.xgroup_create(req, group, id="0", mkstream=True)
    body = b"x" * payload
    starts: list[float] = [0.0] * n
    latencies: list[float] = []
    flow = _Flow(credits=inflight)
    sent = 0
    received = 0

    async def sender() -> None:
        nonlocal sent
        while sent < n:
            k = min(await flow.take_all(), n - sent)
            first, sent = sent, sent + k
            now = time.perf_counter()
            if k == 1:
                starts[first] = now
                await r.xadd(req, {"c": first, "p": body})
                continue
            async with r.pipeline(transaction=False) as pipe:
                for i in range(first, first + k):
                    starts[i] = now
                    pipe.xadd(req, {"c": i, "p": body})
                await pipe.execute()

    waiting: dict[int, anyio.Event] = {}

    async def requester() -> None:
        nonlocal sent
        while sent < n:
            i, sent = sent, sent + 1
            done = waiting[i] = anyio.Event()
            starts[i] = time.perf_counter()
            await r.xadd(req, {"c": i, "p": body})
            await done.wait()

    async def reader() -> None:
        nonlocal received
        cursor: bytes | str = "0-0"
        while received < n:
            reply = await r.xread({rep: cursor}, count=512, block=1000)
            now = time.perf_counter()
            got = 0
            for _stream, entries in reply or ():
                for entry_id, fields in entries:
                    cursor = entry_id
                    i = int(fields[b"c"])
                    latencies.append(now - starts[i])
                    if not batched:
                        waiting.pop(i).set()
                    got += 1
            received += got
            if got and batched:
                flow.give(got)

    async with contextlib.AsyncExitStack() as stack:
        if worker_url is not None:
            process = await stack.enter_async_context(await anyio.open_process(
                [sys.executable, _THIS_SCRIPT, "--ceiling-worker", worker_url, req, rep, group,
                 str(n)], stderr=None))
            assert process.stdout is not None
            ready = await process.stdout.receive()
            if not ready.startswith(b"ready"):
                raise RuntimeError(f"the ceiling's worker process said {ready!r}")
        t0 = time.perf_counter()
        async with anyio.create_task_group() as tg:
            if worker_url is None:
                tg.start_soon(ceiling_worker, r, req, rep, group, n)
            tg.start_soon(reader)
            if batched:
                tg.start_soon(sender)
            else:
                for _ in range(inflight):
                    tg.start_soon(requester)
        elapsed = time.perf_counter() - t0
        if worker_url is not None and await process.wait() != 0:
            raise RuntimeError(f"the ceiling's worker process exited with {process.returncode}")
    await r.delete(req, rep)
    return {"n": n, "seconds": round(elapsed, 4), "msgs_per_s": round(n / elapsed, 1),
            "round_trip_ms": latency_ms(latencies)}


# ---------------------------------------------------------------------------- ours


def padded_context(size: int) -> bytes:
    """A serialized HandoffContext of exactly ``size`` bytes (or the smallest possible)."""

    def build(pad: int) -> bytes:
        return serialize_context(HandoffContext(
            conversation_history=[
                ConversationEntry(role="user", content="Please take over the refund for order 1234."),
                ConversationEntry(role="assistant", content="x" * pad),
            ],
            tool_state={"active_calls": [], "cache": {"order": 1234}},
            metadata={"bench": True},
        ))

    return build(max(0, size - len(build(0))))


async def ours_round(
    bus: HandoffBus, inbox: Inbox, n: int, inflight: int, context: bytes
) -> dict[str, Any]:
    """n handoffs request -> accept -> complete with ``inflight`` outstanding."""
    requester = bus.client(REQUESTER)
    target = bus.client(TARGET)
    result_value = bus.codec.dumps_value({"ok": True})
    decision_lat: list[float] = []
    outcome_lat: list[float] = []
    problems: Counter[str] = Counter()
    issued = 0

    async def request_loop() -> None:
        nonlocal issued
        while issued < n:
            issued += 1
            t0 = time.perf_counter()
            handle = await requester.request_handoff(HandoffRequest(
                from_agent=REQUESTER, to_agent=TARGET, reason="bench", context_snapshot=context, timeout=60,
            ))
            decision = await handle.decision()
            t1 = time.perf_counter()
            outcome = await handle.outcome()
            t2 = time.perf_counter()
            decision_lat.append(t1 - t0)
            outcome_lat.append(t2 - t0)
            if decision.status is not HandoffStatus.ACCEPTED or outcome.status is not HandoffStatus.COMPLETED:
                problems[f"requester saw {decision.status}/{outcome.status}"] += 1

    capacity = inflight
    running = 0
    taken_total = 0
    to_settle: list[str] = []
    freed = anyio.Event()
    worker_stats: Counter[str] = Counter()

    async def handle_one(delivery: Delivery, row: tuple[HandoffStatus, HandoffRequest] | None) -> None:
        nonlocal running
        try:
            if row is None or row[0] is not HandoffStatus.PENDING:
                problems[f"worker loaded {row and row[0]}"] += 1
                return
            hid = delivery.handoff_id
            await target._transition("accept", hid, {}, settle=False)
            await target._transition("complete", hid, {"result": result_value}, settle=False)
        finally:
            to_settle.append(delivery.handoff_id)
            running -= 1
            freed.set()

    async def worker_loop() -> None:
        nonlocal running, taken_total, to_settle, freed
        async with anyio.create_task_group() as handlers:
            while taken_total < n:
                free = min(capacity - running, 100, n - taken_total)
                if free <= 0:
                    freed = anyio.Event()
                    await freed.wait()
                    continue
                settle, to_settle = to_settle, []
                bell, taken = await inbox.take(free, settle=settle)
                worker_stats["takes"] += 1
                if not taken:
                    worker_stats["empty_takes"] += 1
                    await inbox.wait(bell, 1000)
                    continue
                taken_total += len(taken)
                worker_stats["taken"] += len(taken)
                rows = await inbox.load([d.handoff_id for d in taken])
                for delivery, row in zip(taken, rows, strict=True):
                    running += 1
                    handlers.start_soon(handle_one, delivery, row)
        if to_settle:
            settle, to_settle = to_settle, []
            await inbox.take(0, settle=settle)

    t0 = time.perf_counter()
    async with anyio.create_task_group() as tg:
        tg.start_soon(worker_loop)
        for _ in range(min(inflight, n)):
            tg.start_soon(request_loop)
    elapsed = time.perf_counter() - t0
    return {
        "n": n, "seconds": round(elapsed, 4), "handoffs_per_s": round(n / elapsed, 1),
        "decision_ms": latency_ms(decision_lat), "outcome_ms": latency_ms(outcome_lat),
        "worker": {"takes": worker_stats["takes"], "empty_takes": worker_stats["empty_takes"],
                   "mean_batch": round(worker_stats["taken"] / max(1, worker_stats["takes"]), 2)},
        "problems": dict(problems),
    }


# ---------------------------------------------------------------------------- driver


async def server_info(client: aioredis.Redis) -> dict[str, str]:
    info = await client.info("server")
    name = str(info.get("server_name", "redis"))
    version = str(info.get("valkey_version") or info.get("redis_version"))
    return {"server": name, "version": version}


@dataclass
class Window:
    """What one measured run cost: commands on both sides and CPU on both sides."""

    top_level: dict[str, int]
    scripts: dict[str, int]
    server_calls: dict[str, int]
    server_usec: dict[str, int]
    client_cpu_s: float
    server_cpu_s: float


async def server_cpu(client: aioredis.Redis) -> float:
    info = await client.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


async def measured(
    stats: aioredis.Redis, counter: CommandCounter, body: Callable[[], Awaitable[dict[str, Any]]]
) -> tuple[dict[str, Any], Window]:
    cmds0, scripts0 = counter.snapshot()
    (srv0, usec0), srv_cpu0 = await commandstats(stats), await server_cpu(stats)
    cpu0 = time.process_time()
    result = await body()
    cpu1 = time.process_time()
    (srv1, usec1), srv_cpu1 = await commandstats(stats), await server_cpu(stats)
    cmds1, scripts1 = counter.snapshot()
    return result, Window(delta(cmds1, cmds0), delta(scripts1, scripts0), delta(srv1, srv0),
                          delta(usec1, usec0), cpu1 - cpu0, srv_cpu1 - srv_cpu0)


def cost(window: Window, n: int) -> dict[str, Any]:
    return {
        "client_cpu_us": round(window.client_cpu_s / n * 1e6, 1),
        "server_cpu_us": round(window.server_cpu_s / n * 1e6, 1),
        "total_server_calls": round(sum(window.server_calls.values()) / n, 3),
        "top_level": round(sum(window.top_level.values()) / n, 3),
        "top_level_by_command": per(window.top_level, n),
        "fcall_by_script": per(window.scripts, n),
        "server_calls_by_command": per(window.server_calls, n),
        "server_usec_by_command": per(window.server_usec, n),
    }


def median_run(runs: list[dict[str, Any]], key: str) -> dict[str, Any]:
    return sorted(runs, key=lambda r: r[key])[(len(runs) - 1) // 2]


async def run(args: argparse.Namespace) -> dict[str, Any]:
    n = args.n
    warmup = args.warmup if args.warmup is not None else min(max(n // 10, 500), 2000)
    context = padded_context(args.payload)
    prefix = f"bench{os.getpid()}"
    max_connections = args.max_connections or 2 * args.inflight + 32
    pool_options: dict[str, Any] = {"max_connections": max_connections}
    # both clients as HandoffBus.connect() builds its own: no socket timeout unless asked for
    pool_options["socket_timeout"] = args.socket_timeout or None
    ceilings: list[dict[str, Any]] = []
    bare_ceilings: list[dict[str, Any]] = []
    ours_runs: list[dict[str, Any]] = []
    async with EmbeddedServer() if args.url is None else _nothing() as server:
        url = args.url or server.url
        async with contextlib.AsyncExitStack() as stack:
            stats = aioredis.Redis.from_url(url)
            stack.push_async_callback(stats.aclose)
            server_desc = await server_info(stats)
            raw_counter, counter = CommandCounter(), CommandCounter()
            raw = counting_client(url, raw_counter, pool_options)
            stack.push_async_callback(raw.aclose)
            client = counting_client(url, counter, pool_options)
            stack.push_async_callback(client.aclose)
            bus = await stack.enter_async_context(HandoffBus(client, prefix=prefix))
            if args.url is not None:
                stack.push_async_callback(bus.clear, confirm=prefix)
            inbox = Inbox(bus, TARGET, "consumer-1")

            # warm up both: scripts loaded, connection pools grown, code paths hot
            await ceiling_round(raw, warmup, args.inflight, args.payload, f"{prefix}:raw")
            await ours_round(bus, inbox, warmup, args.inflight, context)

            for _ in range(args.rounds):  # alternate, so that a noisy neighbour hits both alike
                ceiling, window = await measured(stats, raw_counter, lambda: ceiling_round(
                    raw, n, args.inflight, args.payload, f"{prefix}:raw"))
                ceiling["cost_per_msg"] = cost(window, n)
                ceilings.append(ceiling)
                bare_ceilings.append(await ceiling_round(
                    raw, n, args.inflight, args.payload, f"{prefix}:raw", batched=False))
                ours, window = await measured(stats, counter, lambda: ours_round(
                    bus, inbox, n, args.inflight, context))
                ours["cost_per_lifecycle"] = cost(window, n)
                if window.top_level.get("FCALL", 0) != window.server_calls.get("FCALL", 0):
                    ours["warning"] = (f"client counted {window.top_level.get('FCALL', 0)} FCALL, "
                                       f"server {window.server_calls.get('FCALL', 0)}")
                ours_runs.append(ours)

    ceiling, ours = median_run(ceilings, "msgs_per_s"), median_run(ours_runs, "handoffs_per_s")
    ratio = ours["handoffs_per_s"] / ceiling["msgs_per_s"]
    bare = median_run(bare_ceilings, "msgs_per_s")
    bare_ratio = ours["handoffs_per_s"] / bare["msgs_per_s"]
    cpu_ratio = ceiling["cost_per_msg"]["client_cpu_us"] / max(ours["cost_per_lifecycle"]["client_cpu_us"], 1e-9)
    top_level = ours["cost_per_lifecycle"]["top_level"]
    return {
        "config": {"url": args.url or "embedded (unix socket)", "n": n, "inflight": args.inflight,
                   "payload": args.payload, "context_bytes": len(context), "warmup": warmup,
                   "rounds": args.rounds, "pool": pool_options},
        "environment": environment(server_desc),
        "ceiling": ceiling,
        "bare_ceiling": bare,
        "ours": ours,
        "ratio_ours_to_ceiling": round(ratio, 4),
        "ratio_ours_to_bare_ceiling": round(bare_ratio, 4),
        "client_cpu_ratio_ours_to_ceiling": round(cpu_ratio, 4),
        "rounds": {"ceiling_msgs_per_s": [r["msgs_per_s"] for r in ceilings],
                   "bare_ceiling_msgs_per_s": [r["msgs_per_s"] for r in bare_ceilings],
                   "ours_handoffs_per_s": [r["handoffs_per_s"] for r in ours_runs]},
        "all_rounds": {"ceiling": ceilings, "ours": ours_runs},
        "targets": {"ratio_min": 0.30, "ratio_met": ratio >= 0.30, "bare_ratio_met": bare_ratio >= 0.30,
                    "top_level_per_lifecycle_max": 8, "top_level_met": top_level <= 8},
        "notes": [
            "ratio = ours handoffs/s over ceiling msgs/s, from the median round of each",
            "ceiling: the client pipelines its requests (batched); bare ceiling: one XADD round trip "
            "per request from inflight tasks, as a requester awaiting each handoff sends them",
            "client_cpu_ratio = ceiling client CPU per msg over ours per lifecycle (1.0 = as cheap)",
            "top level = every command this process sent in the window, the bus's expiry sweep included",
            "server calls = INFO commandstats delta: top-level commands plus those run inside Lua",
        ],
    }


def _loadavg() -> list[float] | None:
    try:
        return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]
    except OSError:
        return None


class _nothing:
    """``async with`` stand-in for the server when --url names one."""

    async def __aenter__(self) -> None:
        return None

    async def __aexit__(self, *exc: object) -> None:
        return None


def _has_hiredis() -> bool:
    try:
        import hiredis  # noqa: F401
    except ImportError:
        return False
    return True


def render(result: dict[str, Any]) -> str:
    c, o, cfg, env = result["ceiling"], result["ours"], result["config"], result["environment"]
    b = result["bare_ceiling"]
    cc, oc = c["cost_per_msg"], o["cost_per_lifecycle"]
    met = {True: "met", False: "NOT met"}
    rows = [
        ("server", f"{env['server']} {env['version']}, {cfg['url']}; redis-py {env['redis_py']}, "
                   f"pool {cfg['pool']}"),
        ("n / inflight / payload", f"{cfg['n']} / {cfg['inflight']} / {cfg['payload']} B "
                                   f"(context {cfg['context_bytes']} B), warm-up {cfg['warmup']}, "
                                   f"rounds {cfg['rounds']} (median shown)"),
        ("ceiling, batched", f"{c['msgs_per_s']:>9,.0f} msgs/s       round trip p50 "
                             f"{c['round_trip_ms']['p50']:.2f} ms  p99 {c['round_trip_ms']['p99']:.2f} ms"),
        ("ceiling, bare", f"{b['msgs_per_s']:>9,.0f} msgs/s       round trip p50 "
                          f"{b['round_trip_ms']['p50']:.2f} ms  p99 {b['round_trip_ms']['p99']:.2f} ms"),
        ("ours", f"{o['handoffs_per_s']:>9,.0f} handoffs/s"),
        ("ratio ours/batched", f"{result['ratio_ours_to_ceiling']:>9.1%}  (>= 30%: "
                               f"{met[result['targets']['ratio_met']]})"),
        ("ratio ours/bare", f"{result['ratio_ours_to_bare_ceiling']:>9.1%}  (>= 30%: "
                            f"{met[result['targets']['bare_ratio_met']]})"),
        ("decision latency", f"p50 {o['decision_ms']['p50']:.2f} ms   p99 {o['decision_ms']['p99']:.2f} ms"),
        ("outcome latency", f"p50 {o['outcome_ms']['p50']:.2f} ms   p99 {o['outcome_ms']['p99']:.2f} ms"),
        ("top-level cmds", f"ours {oc['top_level']:.2f}/lifecycle (target <= 8: "
                           f"{met[result['targets']['top_level_met']]});  ceiling {cc['top_level']:.2f}/msg"),
        ("server calls incl. Lua", f"ours {oc['total_server_calls']:.2f}/lifecycle;  "
                                   f"ceiling {cc['total_server_calls']:.2f}/msg"),
        ("client CPU", f"ours {oc['client_cpu_us']:.0f} us/lifecycle;  ceiling {cc['client_cpu_us']:.0f} us/msg  "
                       f"(ratio {result['client_cpu_ratio_ours_to_ceiling']:.1%})"),
        ("server CPU", f"ours {oc['server_cpu_us']:.0f} us/lifecycle;  ceiling {cc['server_cpu_us']:.0f} us/msg"),
        ("ours top-level", ", ".join(f"{k} {v:g}" for k, v in oc["top_level_by_command"].items())),
        ("ours FCALL by script", ", ".join(f"{k} {v:g}" for k, v in oc["fcall_by_script"].items())),
        ("ours server calls", ", ".join(f"{k} {v:g}" for k, v in oc["server_calls_by_command"].items())),
        ("ours server usec", ", ".join(f"{k} {v:.1f}" for k, v in list(oc["server_usec_by_command"].items())[:6])),
        ("ceiling top-level", ", ".join(f"{k} {v:g}" for k, v in cc["top_level_by_command"].items())),
        ("worker", f"{o['worker']['takes']} takes ({o['worker']['empty_takes']} empty), "
                   f"mean batch {o['worker']['mean_batch']}"),
    ]
    if cfg["rounds"] > 1:
        rows.append(("rounds", f"batched {result['rounds']['ceiling_msgs_per_s']}; "
                               f"bare {result['rounds']['bare_ceiling_msgs_per_s']}; "
                               f"ours {result['rounds']['ours_handoffs_per_s']}"))
    if env.get("loadavg_after"):
        rows.append(("load average after", " ".join(f"{x:.2f}" for x in env["loadavg_after"])))
    if o["problems"]:
        rows.append(("PROBLEMS", json.dumps(o["problems"])))
    if "warning" in o:
        rows.append(("WARNING", o["warning"]))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def report(result: dict[str, Any], render: Callable[[dict[str, Any]], str], path: str) -> None:
    """Print the table and write the same numbers as JSON (what every benchmark script ends with)."""
    print(render(result))
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {out}")


def environment(server_desc: dict[str, Any]) -> dict[str, Any]:
    """What a result depends on besides its config: the server, the client stack, the host."""
    return {**server_desc, "python": platform.python_version(), "redis_py": redis.__version__,
            "hiredis": _has_hiredis(), "platform": platform.platform(), "cpus": os.cpu_count(),
            "uvloop": uses_uvloop(), "loadavg_after": _loadavg()}


def run_and_report(
    run: Callable[[argparse.Namespace], Awaitable[dict[str, Any]]], args: argparse.Namespace,
    render: Callable[[dict[str, Any]], str],
) -> None:
    """Run a benchmark's coroutine on the loop a handoffbus process runs on, then ``report``."""
    freeze_startup()  # as the CLI does, and as README advises a requester service to
    report(anyio.run(run, args, backend="asyncio", backend_options=backend_options()), render, args.json)


def benchmark_parser(doc: str | None) -> argparse.ArgumentParser:
    """The arguments every benchmark script shares (its docstring's first paragraph, ``--url``)."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0] if doc else None)
    parser.add_argument("--url", help="server to use (default: start an EmbeddedServer on a unix socket)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--n", type=int, default=5000, help="measured round trips / handoffs (default 5000)")
    parser.add_argument("--inflight", type=int, default=100, help="outstanding at any time (default 100)")
    parser.add_argument("--payload", type=int, default=1024, help="request payload / context bytes (default 1024)")
    parser.add_argument("--warmup", type=int, default=None, help="warm-up count (default n/10, 500..2000)")
    parser.add_argument("--max-connections", type=int, default=0,
                        help="connection pool size of each client (default 2 * inflight + 32)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="measured rounds, ceiling and ours alternating; the median is shown (default 1)")
    parser.add_argument("--socket-timeout", type=float, default=0,
                        help="socket_timeout of both clients in seconds (default 0: none, as HandoffBus.connect)")
    parser.add_argument("--json", default="benchmarks/results/core.json", help="where to write the results")
    if argv is None and sys.argv[1:2] == ["--ceiling-worker"]:  # ceiling_round(worker_url=...)'s child
        url, req, rep, group, n = sys.argv[2:7]
        anyio.run(_ceiling_worker_process, url, req, rep, group, int(n), backend_options=backend_options())
        return 0
    args = parser.parse_args(argv)
    if args.n <= 0 or args.inflight <= 0 or args.rounds <= 0 or args.payload < 0:
        parser.error("--n, --inflight and --rounds must be positive, --payload non-negative")
    run_and_report(run, args, render)
    return 0


if __name__ == "__main__":
    sys.exit(main())
