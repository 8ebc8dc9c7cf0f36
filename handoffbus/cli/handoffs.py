"""Commands about handoffs: send one, look at one, list an agent's pending work, dead letters."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Any

import anyio
import typer
from redis.exceptions import ResponseError

from ..a2a import utc_iso
from ..context import deserialize_context, serialize_context
from ..errors import DecodeError, InvalidTransition, PayloadTooLarge
from ..keys import GROUP
from ..models import HandoffRecord, HandoffRequest, HandoffResponse, HandoffStatus, PendingHandoff
from ..names import split_handoff_id
from .common import (
    EXIT_FAILED,
    EXIT_OK,
    Json,
    Options,
    Prefix,
    RedisUrl,
    ago,
    check_count,
    check_usage,
    console,
    emit_json,
    errors,
    open_bus,
    options,
    run,
    seconds,
    table,
    usage_error,
)

__all__ = ["dlq", "register"]

dlq = typer.Typer(help="list or replay an agent's dead letters", no_args_is_help=True)


def register(app: typer.Typer) -> None:
    app.command("request")(request)
    app.command("status")(status)
    app.command("pending")(pending)
    app.add_typer(dlq, name="dlq")


# ---------------------------------------------------------------------- request


def read_context(spec: str) -> bytes:
    """``@file.json``, ``-`` (stdin) or inline JSON: a sw4rm context, checked and re-encoded."""
    try:
        if spec == "-":
            raw = sys.stdin.buffer.read()
        elif spec.startswith("@"):
            raw = Path(spec[1:]).read_bytes()
        else:
            raw = spec.encode()
    except OSError as exc:
        usage_error(f"cannot read the context: {exc}")
    try:
        return serialize_context(deserialize_context(raw))
    except (DecodeError, PayloadTooLarge) as exc:
        usage_error(f"not a handoff context: {exc}")


def _metadata(pairs: list[str]) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            usage_error(f"--metadata takes KEY=VALUE, not {pair!r}")
        found[key] = value
    return found


def request(
    ctx: typer.Context,
    agent: Annotated[str | None, typer.Argument(help="the target agent (or route by --capability)")] = None,
    capability: Annotated[list[str] | None, typer.Option(
        "--capability", "-c", help="a capability the handling agent needs (repeatable); without AGENT, "
        "any live agent with all of them takes it")] = None,
    sender: Annotated[str, typer.Option("--from", help="the requesting agent's id")] = "cli",
    reason: Annotated[str, typer.Option(help="why the work is handed over")] = "",
    context: Annotated[str | None, typer.Option(
        help="the context snapshot: @file.json, - for stdin, or inline JSON (sw4rm's format)")] = None,
    priority: Annotated[int, typer.Option(help="-1000..1000, lower first")] = 0,
    timeout: Annotated[float | None, typer.Option(help="seconds to acceptance (default: the bus's, 300)")] = None,
    request_id: Annotated[str, typer.Option(help="idempotency key (default: generated)")] = "",
    metadata: Annotated[list[str] | None, typer.Option(help="KEY=VALUE (repeatable)")] = None,
    wait: Annotated[bool, typer.Option("--wait", help="wait for the outcome; exit 1 unless COMPLETED")] = False,
    fail_fast: Annotated[bool, typer.Option(help="routed: reject at once when no capable agent is live")] = False,
    redis_url: RedisUrl = None, prefix: Prefix = None, as_json: Json = False,
) -> None:
    """Send one handoff (exit 1 with --wait unless it ends COMPLETED)."""
    opts = options(ctx, redis_url, prefix, as_json)
    if not agent and not capability:
        usage_error("name the target AGENT, or the capabilities with --capability")
    snapshot = read_context(context) if context is not None else None
    handoff = HandoffRequest(
        from_agent=sender, to_agent=agent or "", reason=reason, context_snapshot=snapshot,
        capabilities_required=list(capability or []), priority=priority, timeout=timeout,
        metadata=_metadata(metadata or []), request_id=request_id,
    )
    run(_request, opts, handoff, wait, fail_fast)


async def _request(opts: Options, handoff: HandoffRequest, wait: bool, fail_fast: bool) -> int:
    async with open_bus(opts, "request") as bus:
        handle = await bus.client(handoff.from_agent).request_handoff(handoff, fail_fast=fail_fast)
        record = await handle.status()
        target = handoff.to_agent or f"capabilities {','.join(handoff.capabilities_required)}"
        if opts.json:
            emit_json({"handoff_id": handle.handoff_id, "status": record.status if record else None,
                       "to": target, "deadline_ms": record.deadline_ms if record else None})
        else:
            console.print(f"requested {handle.handoff_id} -> {target} "
                          f"({record.status.value if record else '?'}, priority {handoff.priority})")
        if not wait:
            return EXIT_OK
        decision = await handle.decision()
        _say_response(opts, decision)
        if decision.status is not HandoffStatus.ACCEPTED:
            return EXIT_FAILED
        outcome = await handle.outcome()
        _say_response(opts, outcome)
        return EXIT_OK if outcome.status is HandoffStatus.COMPLETED else EXIT_FAILED


def _say_response(opts: Options, response: HandoffResponse) -> None:
    if opts.json:
        emit_json(response)
        return
    line = f"{response.status.value}"
    if response.actor:
        line += f" by {response.actor}"
    if response.rejection_code or response.rejection_reason:
        line += f": {response.rejection_code or ''} {response.rejection_reason or ''}".rstrip()
    if response.redirect_to_agent:
        line += f" (redirect to {response.redirect_to_agent})"
    if response.status is HandoffStatus.COMPLETED and response.result is not None:
        line += f": {response.result!r}"
    if response.error:
        line += f": {response.error}"
    console.print(line)


# ---------------------------------------------------------------------- status


def status(
    ctx: typer.Context,
    handoff_id: Annotated[str, typer.Argument(help="<requester>/<request id>")],
    watch: Annotated[bool, typer.Option("--watch", help="print each change until the handoff ends")] = False,
    interval: Annotated[float, typer.Option(help="seconds between looks with --watch")] = 0.5,
    redis_url: RedisUrl = None, prefix: Prefix = None, as_json: Json = False,
) -> None:
    """Show a handoff: status, history, who holds it, time left to its deadline (exit 1 if unknown)."""
    opts = options(ctx, redis_url, prefix, as_json)
    try:
        split_handoff_id(handoff_id)
    except ValueError as exc:
        usage_error(str(exc))
    check_usage(None, [("--interval", interval, 0.001)])
    run(_status, opts, handoff_id, watch, interval)


async def _status(opts: Options, handoff_id: str, watch: bool, interval: float) -> int:
    async with open_bus(opts, "status") as bus:
        shown: tuple[HandoffStatus, int] | None = None
        while True:
            found = await bus.read_record(handoff_id)  # the record, and the server's time of the read
            if found is None:
                console.print(f"no handoff {handoff_id}") if not opts.json else emit_json(None)
                return EXIT_FAILED
            now_ms, _, record = found
            if (record.status, len(record.history)) != shown:
                shown = (record.status, len(record.history))
                show_record(opts, record, now_ms)
            if not watch or record.terminal:
                return EXIT_OK
            await anyio.sleep(interval)  # an operator's view: a look every interval


def show_record(opts: Options, record: HandoffRecord, now_ms: int) -> None:
    if opts.json:
        emit_json({"record": record, "now_ms": now_ms})
        return
    request, response = record.request, record.response
    rows: list[tuple[str, str]] = [
        ("handoff", record.handoff_id),
        ("status", record.status.value),
        ("from -> to", f"{request.from_agent} -> {request.to_agent or '(routed)'}"),
    ]
    if request.capabilities_required:
        rows.append(("capabilities", ", ".join(request.capabilities_required)))
    rows += [("reason", request.reason or "-"), ("priority", str(request.priority)),
             ("created", f"{utc_iso(record.created_ms)} ({ago(record.created_ms, now_ms)})")]
    if record.status is HandoffStatus.PENDING:
        rows.append(("deadline", f"{utc_iso(record.deadline_ms)} ({ago(record.deadline_ms, now_ms)})"))
        rows.append(("waiting for", request.to_agent or "a capable agent"))
    elif response.accepting_agent or record.lease:
        held = response.accepting_agent or "?"
        if record.lease:
            held += f", worker {record.lease}, attempt {record.attempt}"
        rows.append(("held by", held))
    history = " -> ".join(
        f"{h.status.value}({h.actor}) +{h.at_ms - record.created_ms} ms" for h in record.history)
    rows.append(("history", history))
    if record.route:
        rows.append(("route", " -> ".join(f"{s.agent} {s.event}{f' {s.code}' if s.code else ''}"
                                          for s in record.route)))
    if response.rejection_code or response.rejection_reason:
        rows.append(("rejected", f"{response.rejection_code or ''} {response.rejection_reason or ''}".strip()))
    if response.result is not None:
        rows.append(("result", repr(response.result)))
    if response.error:
        rows.append(("error", response.error))
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        console.print(f"{key:<{width}}  {value}")


# ---------------------------------------------------------------------- pending


def pending(
    ctx: typer.Context,
    agent: Annotated[str, typer.Argument(help="the agent whose work to list")],
    idle: Annotated[int | None, typer.Option(
        help="only handoffs in flight whose inbox entry has been idle at least this many ms "
        "(XPENDING's IDLE: candidates for takeover)")] = None,
    count: Annotated[int, typer.Option(help="at most this many of each")] = 100,
    redis_url: RedisUrl = None, prefix: Prefix = None, as_json: Json = False,
) -> None:
    """List an agent's queued handoffs (in serving order) and those in flight at its workers."""
    check_count(count)
    if idle is not None and idle < 0:
        usage_error("--idle must not be negative")
    run(_pending, options(ctx, redis_url, prefix, as_json), agent, idle, count)


async def _pending(opts: Options, agent: str, idle: int | None, count: int) -> int:
    async with open_bus(opts, "pending") as bus:
        now = await bus.server_time_ms()
        queued: list[PendingHandoff] = []
        unreadable: dict[str, str] = {}
        if idle is None:  # a record that cannot be decoded is left out, and named apart
            queued, unreadable = await bus.client("cli")._read_pending(agent)
        total = len(queued)
        queued = queued[:count]
        keys = bus.keys.target(agent)
        async with bus.redis.pipeline(transaction=False) as pipe:  # one slot: one round trip
            pipe.hgetall(keys.inflight)
            pipe.xpending_range(keys.inbox, GROUP, min="-", max="+", count=count, idle=idle)
            inflight, rows = await pipe.execute(raise_on_error=False)
        if isinstance(rows, ResponseError):  # no inbox or consumer group yet: nothing in flight
            rows = []
        elif isinstance(rows, BaseException):
            raise rows
        index = {v.decode(): k.decode() for k, v in inflight.items()}
        entries = [{"handoff_id": index.get(r["message_id"].decode(), "?"), "entry_id": r["message_id"].decode(),
                    "consumer": r["consumer"].decode(), "idle_ms": int(r["time_since_delivered"]),
                    "deliveries": int(r["times_delivered"])} for r in rows]
        if opts.json:
            emit_json({"agent": agent, "queued": queued, "in_flight": entries,
                       "unreadable": [{"handoff_id": h, "error": e} for h, e in unreadable.items()]})
            return EXIT_OK
        for handoff_id, error in unreadable.items():
            errors.print(f"handoffbus: left out {handoff_id}, whose record cannot be decoded: {error}")
        if idle is None:
            console.print(table(
                f"{agent}: {total} queued, in serving order" + (f" (the first {count})" if total > count else ""),
                ("#", "handoff", "priority", "waiting", "deadline", "reason"),
                [(str(i), p.handoff_id, str(p.request.priority), seconds((now - p.created_ms) / 1000),
                  ago(p.deadline_ms, now), p.request.reason) for i, p in enumerate(queued, 1)]))
        title = f"{agent}: {len(entries)} in flight" + (f", idle >= {idle} ms" if idle is not None else "")
        console.print(table(title, ("handoff", "inbox entry", "worker", "idle", "deliveries"), [
            (e["handoff_id"], e["entry_id"], e["consumer"], seconds(e["idle_ms"] / 1000), str(e["deliveries"]))
            for e in entries]))
        return EXIT_OK


# ---------------------------------------------------------------------- dead letters


@dlq.command("list")
def dlq_list(
    ctx: typer.Context,
    agent: Annotated[str, typer.Argument(help="the agent whose dead letters to list")],
    count: Annotated[int, typer.Option(help="at most this many, oldest first")] = 100,
    redis_url: RedisUrl = None, prefix: Prefix = None, as_json: Json = False,
) -> None:
    """List the handoffs an agent's workers gave up on, and why."""
    check_count(count)
    run(_dlq_list, options(ctx, redis_url, prefix, as_json), agent, count)


async def _dlq_list(opts: Options, agent: str, count: int) -> int:
    async with open_bus(opts, "dlq list") as bus:
        letters = await bus.client("cli").get_dead_letters(agent, count=count)
        if opts.json:
            emit_json(letters)
            return EXIT_OK
        now = await bus.server_time_ms()
        console.print(table(f"{agent}: {len(letters)} dead letters",
                            ("entry", "handoff", "deliveries", "worker", "when", "reason"),
                            [(d.entry_id, d.handoff_id, str(d.deliveries), d.consumer, ago(d.at_ms, now), d.reason)
                             for d in letters]))
        return EXIT_OK


@dlq.command("replay")
def dlq_replay(
    ctx: typer.Context,
    agent: Annotated[str, typer.Argument(help="the agent")],
    entry: Annotated[str, typer.Argument(help="the dead letter's entry id (see 'dlq list')")],
    redis_url: RedisUrl = None, prefix: Prefix = None, as_json: Json = False,
) -> None:
    """Queue a dead letter's handoff again (exit 1 if there is no such entry, or it was dropped
    instead: its handoff has ended or is gone)."""
    run(_dlq_act, options(ctx, redis_url, prefix, as_json), agent, entry, None)


@dlq.command("fail")
def dlq_fail(
    ctx: typer.Context,
    agent: Annotated[str, typer.Argument(help="the agent")],
    entry: Annotated[str, typer.Argument(help="the dead letter's entry id (see 'dlq list')")],
    error: Annotated[str, typer.Option(help="the error its requester is told")] = "given up: dead-lettered",
    redis_url: RedisUrl = None, prefix: Prefix = None, as_json: Json = False,
) -> None:
    """End a dead letter's ACCEPTED handoff as FAILED, so its requester hears the outcome (exit 1
    if there is no such entry, it is PENDING, or it was dropped alone: its handoff had ended)."""
    run(_dlq_act, options(ctx, redis_url, prefix, as_json), agent, entry, error)


async def _dlq_act(opts: Options, agent: str, entry: str, error: str | None) -> int:
    """Replay a dead letter (``error`` None) or fail its handoff with ``error``."""
    async with open_bus(opts, "dlq fail" if error is not None else "dlq replay") as bus:
        client = bus.client("cli")
        try:
            action = await (client.replay_dead_letter(agent, entry) if error is None
                            else client.fail_dead_letter(agent, entry, error))
        except InvalidTransition as exc:  # PENDING: not an operator's to fail
            refusal = f"{exc}; replay it, or its requester cancels it (its deadline expires it)"
            if opts.json:
                emit_json({"agent": agent, "entry_id": entry, "handoff_id": exc.handoff_id, "failed": False,
                           "error": refusal})
            else:
                console.print(refusal)
            return EXIT_FAILED
        status = None if action.status is None else action.status.value
        if opts.json:
            emit_json({"agent": agent, "entry_id": entry, "handoff_id": action.handoff_id,
                       "replayed" if error is None else "failed": action.done, "status": status,
                       "held": action.held})
        elif action:
            console.print(f"replayed {entry} ({action.handoff_id}) to {agent}" if error is None
                          else f"failed {action.handoff_id} ({entry} of {agent})")
        else:
            why = (f"is {status}, held by a worker again" if action.held else f"is {status}" if status
                   else "has no record (it names no handoff, or it expired)")
            console.print(f"dropped dead letter {entry} of {agent}: {action.handoff_id} {why}")
        return EXIT_OK if action else EXIT_FAILED
