"""Commands for watching the bus: the live registry, a live view of every agent, and a health
check for container probes."""

from __future__ import annotations

import contextlib
import sys
import time
from collections import deque
from typing import Annotated, Any

import anyio
import typer
from redis.exceptions import NoPermissionError
from rich.live import Live
from rich.table import Table

from ..errors import InvalidName, InvalidRequest
from ..monitor import AgentView, observe_agents
from ..stats import AgentCounts, quantile
from .common import (
    EXIT_FAILED,
    EXIT_OK,
    Json,
    Options,
    Prefix,
    RedisUrl,
    ago,
    check_usage,
    console,
    emit_json,
    open_bus,
    options,
    run,
    seconds,
    table,
    usage_error,
)

__all__ = ["Frame", "register"]

#: seconds of readings ``top`` keeps for its latency quantiles
WINDOW = 60.0


def register(app: typer.Typer) -> None:
    app.command("agents")(agents)
    app.command("top")(top)
    app.command("check")(check)


# ---------------------------------------------------------------------- agents


def agents(
    ctx: typer.Context, redis_url: RedisUrl = None, prefix: Prefix = None, as_json: Json = False,
) -> None:
    """List the live agents: capabilities, workers, state, load and last heartbeat."""
    run(_agents, options(ctx, redis_url, prefix, as_json))


async def _agents(opts: Options) -> int:
    async with open_bus(opts, "agents") as bus:
        found = await bus.client("cli").list_agents()
        if opts.json:
            emit_json(found)
            return EXIT_OK
        now = await bus.server_time_ms()
        console.print(table(f"{len(found)} live agents",
                            ("agent", "capabilities", "worker", "state", "load", "last heartbeat"),
                            [(agent.agent_id if i == 0 else "", ", ".join(agent.capabilities) if i == 0 else "",
                              w.consumer, w.state, f"{w.load}/{w.limit}", ago(w.beat_ms, now))
                             for agent in found for i, w in enumerate(agent.workers)]))
        return EXIT_OK


# ---------------------------------------------------------------------- top


class Frame:
    """One refresh of ``top``: each agent's view, with rates since the previous reading and
    latency quantiles since the oldest reading kept (up to ``WINDOW`` seconds back)."""

    def __init__(self, views: list[AgentView], previous: list[AgentView], oldest: list[AgentView]) -> None:
        self.views = views
        self.rows: list[dict[str, Any]] = []
        before_of = {v.agent_id: v for v in previous}
        first_of = {v.agent_id: v for v in oldest}
        for view in views:
            before, first = before_of.get(view.agent_id), first_of.get(view.agent_id)
            since = view.counts.minus(before.counts) if before else None
            dt = (view.at_ms - before.at_ms) / 1000 if before else 0
            # no earlier reading: the counts are all-time, not the window's (as rates, unknown until then)
            window = view.counts.minus(first.counts) if first else None
            self.rows.append({
                "agent": view.agent_id, "queued": view.queued, "in_flight": view.in_flight,
                "oldest_waiting_s": view.oldest_waiting_s, "oldest_in_flight_s": view.oldest_in_flight_s,
                "routed": view.routed, "oldest_routed_s": view.oldest_routed_s,
                "workers": view.workers, "beat_age_s": view.beat_age_s,
                "rates": {k: round(n / dt, 2) for k, n in since.counts.items()} if since and dt > 0 else None,
                **_quantiles(window),
            })


def _quantiles(counts: AgentCounts | None) -> dict[str, float | None]:
    if counts is None:
        return dict.fromkeys(("decision_p50_s", "decision_p99_s", "completion_p50_s", "completion_p99_s"))
    return {
        "decision_p50_s": quantile(counts.decision, 0.5), "decision_p99_s": quantile(counts.decision, 0.99),
        "completion_p50_s": quantile(counts.duration, 0.5), "completion_p99_s": quantile(counts.duration, 0.99),
    }


def _rate(row: dict[str, Any], name: str) -> str:
    rates = row["rates"]
    return "-" if rates is None else f"{rates.get(name, 0):g}"


def render(frame: Frame) -> Table:
    table = Table(title="handoffbus top (rates per second; latency p50/p99 over the last minute)",
                  title_justify="left")
    columns = ("agent", "queued", "in flight", "oldest waiting", "oldest in flight", "routed", "acc/s", "rej/s",
               "exp/s", "done/s", "fail/s", "decision p50/p99", "completion p50/p99", "workers")
    for column in columns:
        table.add_column(column, overflow="fold", justify="left" if column == "agent" else "right")
    for row in frame.rows:
        table.add_row(
            row["agent"], str(row["queued"]), str(row["in_flight"]), seconds(row["oldest_waiting_s"]),
            seconds(row["oldest_in_flight_s"]),
            f"{row['routed']} ({seconds(row['oldest_routed_s'])})" if row["routed"] else "0",
            _rate(row, "ACCEPTED"), _rate(row, "REJECTED"),
            _rate(row, "EXPIRED"), _rate(row, "COMPLETED"), _rate(row, "FAILED"),
            f"{seconds(row['decision_p50_s'])} / {seconds(row['decision_p99_s'])}",
            f"{seconds(row['completion_p50_s'])} / {seconds(row['completion_p99_s'])}",
            str(row["workers"]),
        )
    return table


def top(
    ctx: typer.Context,
    agent: Annotated[list[str] | None, typer.Option("--agent", "-a", help="only these agents (repeatable)")] = None,
    interval: Annotated[float, typer.Option(help="seconds between refreshes")] = 1.0,
    iterations: Annotated[int, typer.Option(help="stop after this many refreshes (0: until Ctrl-C)")] = 0,
    redis_url: RedisUrl = None, prefix: Prefix = None, as_json: Json = False,
) -> None:
    """A live view of every agent: backlog, oldest ages, rates, latencies, live workers.
    Not on a terminal (or with --json), it prints one frame per refresh instead."""
    check_usage(agent, [("--interval", interval, 0.001)])
    if iterations < 0:
        usage_error("--iterations must be 0 (until Ctrl-C) or more")
    run(_top, options(ctx, redis_url, prefix, as_json), agent or None, interval, iterations)


async def _top(opts: Options, agents: list[str] | None, interval: float, iterations: int) -> int:
    async with open_bus(opts, "top") as bus:
        history: deque[tuple[float, list[AgentView]]] = deque()  # (monotonic time, views)
        live = Live(console=console, auto_refresh=False) if console.is_terminal and not opts.json else None
        shown = 0
        with live if live is not None else contextlib.nullcontext():
            while True:
                views = await observe_agents(bus, agents)
                now = time.monotonic()
                while len(history) > 1 and now - history[1][0] >= WINDOW:
                    history.popleft()
                frame = Frame(views, history[-1][1] if history else [], history[0][1] if history else [])
                history.append((now, views))
                if opts.json:
                    emit_json({"at_ms": views[0].at_ms if views else None, "agents": frame.rows})
                elif live is not None:
                    live.update(render(frame), refresh=True)
                else:
                    console.print(render(frame))
                shown += 1
                if iterations and shown >= iterations:
                    return EXIT_OK
                await anyio.sleep(interval)  # the refresh timer


# ---------------------------------------------------------------------- check


def check(
    ctx: typer.Context,
    agent: Annotated[list[str] | None, typer.Option(
        "--agent", "-a", help="also require this agent (repeatable) to have a live worker and a fresh backlog")] = None,
    max_backlog_age: Annotated[float, typer.Option(
        help="seconds the oldest queued handoff of a checked agent (its own queue's, or a routed one it "
             "could take) may have waited")] = 300.0,
    timeout: Annotated[float, typer.Option(
        help="seconds the check may take: a server that does not answer in time is unhealthy")] = 10.0,
    redis_url: RedisUrl = None, prefix: Prefix = None, as_json: Json = False,
) -> None:
    """Exit 0 when healthy, 1 when not (Redis out of reach included): for container probes."""
    opts = options(ctx, redis_url, prefix, as_json)
    check_usage(agent, [("--timeout", timeout, 0.001), ("--max-backlog-age", max_backlog_age, 0.0)])
    try:
        run(_check, opts, agent or [], max_backlog_age, timeout)
    except typer.Exit as done:
        if done.exit_code not in (EXIT_OK, EXIT_FAILED, 2):
            raise typer.Exit(EXIT_FAILED) from None  # a probe wants one failure code
        raise


async def _check(opts: Options, agents: list[str], max_backlog_age: float, wait: float) -> int:
    problems: list[str] = []
    views: list[AgentView] = []
    try:
        # bounded: a server that stopped answering (frozen, a network that drops packets) would
        # otherwise keep the probe waiting until its orchestrator killed it, and a person for ever
        with anyio.fail_after(wait):
            async with open_bus(opts, "check") as bus:
                await bus.redis.ping()
                views = await observe_agents(bus, agents) if agents else []
    except (typer.Exit, InvalidRequest, InvalidName):
        raise  # a usage error (no server given, a bad prefix or URL): exit 2, not "unhealthy"
    except TimeoutError:
        problems.append(f"Redis did not answer within {wait:g} s")
    except NoPermissionError as exc:  # reachable: this user may not read what the check reads
        problems.append(f"the server's ACL refused this user: {exc}")
    except Exception as exc:
        problems.append(f"Redis unavailable: {exc}")
    for view in views:
        if view.workers == 0:
            problems.append(f"{view.agent_id}: no live worker")
        if view.oldest_waiting_s is not None and view.oldest_waiting_s > max_backlog_age:
            problems.append(f"{view.agent_id}: oldest queued handoff waited {view.oldest_waiting_s:.0f} s "
                            f"(> {max_backlog_age:g} s)")
        if view.oldest_routed_s is not None and view.oldest_routed_s > max_backlog_age:
            problems.append(f"{view.agent_id}: oldest routed handoff it could take waited "
                            f"{view.oldest_routed_s:.0f} s (> {max_backlog_age:g} s)")
    if opts.json:
        emit_json({"ok": not problems, "problems": problems,
                   "agents": [{"agent": v.agent_id, "workers": v.workers, "queued": v.queued,
                               "oldest_waiting_s": v.oldest_waiting_s, "routed": v.routed,
                               "oldest_routed_s": v.oldest_routed_s} for v in views]})
    elif problems:
        for problem in problems:
            print(f"unhealthy: {problem}", file=sys.stderr)
    else:
        console.print("ok" + "".join(f"; {v.agent_id}: {v.workers} live workers, {v.queued} queued"
                                     for v in views))
    return EXIT_FAILED if problems else EXIT_OK
