"""docs/redis-layout.md checked against a live server.

The test builds a realistic state through the public API (one handoff completed, one
waiting in the queue, one taken into a worker's inbox, one queued behind it at a better
priority), then runs every ``redis-cli`` line of the doc's code blocks against it. A command
that fails, or that shows nothing (no such key, an empty range, a zero count), means the doc
and the code have drifted apart. The doc's key table must name every key ``handoffbus.keys``
builds, with the type that ``TYPE`` reports.
"""

from __future__ import annotations

import dataclasses
import re
import shlex
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import pytest
import redis.asyncio as aioredis
from anyio import run_process

from handoffbus import HandoffBus, HandoffRequest, HandoffStatus
from handoffbus.forwarding import Forwarder
from handoffbus.keys import Keys, RecordKeys, RouteKeys, TargetKeys
from handoffbus.routing import set_id
from handoffbus.scripts import SCRIPT_NAMES
from handoffbus.workers.inbox import Inbox

from .conftest import SERVER_BINARIES, start_server

pytestmark = pytest.mark.anyio

DOC = Path(__file__).resolve().parent.parent / "docs" / "redis-layout.md"
REQUESTER = "general-agent-1"
TARGET = "security-specialist-1"
PREFIX = "hb"
#: Every key suffix handoffbus/keys.py builds (the doc must explain each).
SUFFIXES = ("h:", "p:", "deadlines", "responses", "queue", "inbox", "inflight", "seq", "bell", "dead",
            "workers", "w:", "agents", "requesters", "targets", "sweep-lease", "route", "rmeta", "rclaims", "rseq",
            "routes", "outbox", "replies", "stats")
#: the capability set of the doc's routed example
ROUTED_SET = "code_review,security"


# ---------------------------------------------------------------------- reading the doc


def doc_text() -> str:
    return DOC.read_text("utf-8")


def doc_commands(text: str) -> list[str]:
    """Every line starting with ``redis-cli `` inside a fenced code block, in order."""
    commands: list[str] = []
    fence: str | None = None
    for line in text.splitlines():
        stripped = line.strip()
        marker = re.match(r"(`{3,}|~{3,})", stripped)
        if marker:
            if fence is None:
                fence = marker[1]
            elif stripped.startswith(fence) and stripped.strip(fence[0]) == "":
                fence = None
            continue
        if fence is not None and stripped.startswith("redis-cli "):
            commands.append(stripped)
    assert fence is None, "unclosed code fence in docs/redis-layout.md"
    return commands


def doc_key_types(text: str) -> dict[str, str]:
    """The summary table: example key (first column, in backticks) -> stated type (second column)."""
    found: dict[str, str] = {}
    for line in text.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if line.lstrip().startswith("|") and len(cells) >= 2:
            key = re.fullmatch(r"`([^`]+)`", cells[0])
            if key and key[1].startswith(f"{PREFIX}:"):
                found[key[1]] = cells[1].strip("`* ").lower()
    return found


def expected_keys() -> set[str]:
    """Every concrete key handoffbus.keys builds for the example agents and request id."""
    keys = Keys(PREFIX)
    record = keys.record(REQUESTER, "req-42")
    target = keys.target(TARGET)
    found = {getattr(record, f.name) for f in dataclasses.fields(RecordKeys)}
    found |= {getattr(target, f.name) for f in dataclasses.fields(TargetKeys)}
    route = keys.route(set_id(ROUTED_SET))
    found |= {getattr(route, f.name) for f in dataclasses.fields(RouteKeys)}
    found.add(keys.dead_letters(TARGET))
    found |= {keys.workers(TARGET), keys.worker_beat(TARGET, "worker-1")}
    found |= {keys.outbox(TARGET), keys.replies(TARGET)}  # an isolated agent's (forwarding.py)
    found.add(keys.stats(TARGET))
    for name, member in vars(Keys).items():
        if isinstance(member, property):
            found.add(getattr(keys, name))
    return found


# ---------------------------------------------------------------------- the state


def request(request_id: str, priority: int, reason: str, caps: list[str]) -> HandoffRequest:
    return HandoffRequest(
        from_agent=REQUESTER, to_agent=TARGET, reason=reason, request_id=request_id,
        capabilities_required=caps, priority=priority, timeout=300,
    )


async def build_state(bus: HandoffBus, url: str) -> None:
    """The state the doc's sample output was captured from (times and stream ids aside)."""
    requester = bus.client(REQUESTER)
    specialist = bus.client(TARGET)
    inbox = Inbox(bus, TARGET, "worker-1")

    # req-42: the doc's running example, queued first; still PENDING and waiting when the doc's commands run
    await requester.request_handoff(request(
        "req-42", 5, "Audit the new OAuth callback for token leakage", ["security-review", "oauth"]
    ))

    # req-41: priority 0 overtakes req-42; taken by worker-1, accepted and completed (terminal, retention TTL)
    await requester.request_handoff(request("req-41", 0, "Review the dependency lockfile", ["dependency-audit"]))
    _, taken = await inbox.take(1)
    assert [d.handoff_id for d in taken] == [f"{REQUESTER}/req-41"]
    await specialist.accept_handoff(f"{REQUESTER}/req-41")
    await specialist.complete_handoff(f"{REQUESTER}/req-41", {"verdict": "no known CVEs", "checked": 212})

    # req-43: a better priority overtakes req-42; worker-1 takes it into the inbox (still PENDING)
    await requester.request_handoff(request("req-43", 1, "Triage a suspicious login spike", ["incident-triage"]))
    _, taken = await inbox.take(1)
    assert [d.handoff_id for d in taken] == [f"{REQUESTER}/req-43"]

    # req-44: queued after req-42 but at priority 0, so served before it
    await requester.request_handoff(request("req-44", 0, "Rotate the leaked staging API key", ["secrets"]))

    # worker-1 registers itself as a live worker of the target (a long time to live, for the doc)
    await bus.redis.sadd(bus.keys.agents, TARGET)
    info = b'{"consumer":"worker-1","state":"RUNNABLE","load":1,"limit":8,"capabilities":["oauth"],"ttl_ms":600000}'
    await bus.script("register", [bus.keys.workers(TARGET), bus.keys.worker_beat(TARGET, "worker-1")],
                     ["worker-1", info, 600_000])

    # req-40: taken by worker-2, whose handling kept stopping workers: dead-lettered
    await requester.request_handoff(request("req-40", -1, "Scan an uploaded archive", ["malware-scan"]))
    crashing = Inbox(bus, TARGET, "worker-2")
    _, taken = await crashing.take(1)
    assert [d.handoff_id for d in taken] == [f"{REQUESTER}/req-40"]
    await crashing.dead_letter(taken[0], "delivered 6 times; its handling kept stopping workers", 6)

    # req-45 and req-46: routed by capabilities (no to_agent); no live agent has both, so they
    # wait in the set's route queue; a worker of another agent pulled req-45 and holds its claim
    for rid in ("req-45", "req-46"):
        await requester.request_handoff(HandoffRequest(
            from_agent=REQUESTER, to_agent="", reason="Review a routed change", request_id=rid,
            capabilities_required=["security", "code_review"], priority=2, timeout=300,
        ))
    route = bus.keys.route(set_id(ROUTED_SET))
    pulled = await bus.script("pull", route.as_list(), ["review-bot-1", 1, 600_000, 64])
    assert [h.decode() for h in pulled[2:]] == [f"{REQUESTER}/req-45"]

    # the target also runs isolated (forwarding.py): one read of req-42 through the forwarder
    # leaves its outbox (answered, so empty) and its replies stream (one reply)
    async with anyio.create_task_group() as tg:
        await tg.start(Forwarder(bus, [TARGET]).run)
        async with HandoffBus.connect(url, isolated=TARGET) as isolated:
            row = await isolated.script("load", [bus.keys.record(REQUESTER, "req-42").record], [])
            assert row[0] == b"PENDING"
        tg.cancel_scope.cancel()

    await bus.stats.flush()  # req-41's acceptance and completion, counted for the target

    record = await requester.get_handoff_status(f"{REQUESTER}/req-42")
    assert record is not None and record.status is HandoffStatus.PENDING
    queued = [p.handoff_id for p in await specialist.get_pending_handoffs()]
    assert queued == [f"{REQUESTER}/req-44", f"{REQUESTER}/req-42"]


# ---------------------------------------------------------------------- running commands


def shows_something(result: Any, command: str) -> bool:
    """False for what redis answers when there is nothing to show (a missing key, an empty range)."""
    if command in ("TTL", "PTTL"):
        return bool(result != -2)  # -2: no such key; -1: a key without TTL, which is worth showing
    if command == "TYPE":
        return bool(result != b"none")
    if isinstance(result, list):
        return any(shows_something(item, "") for item in result)
    return result not in (None, b"", 0)


async def run_with_redis_py(bus: HandoffBus, raw: aioredis.Redis, argv: list[str]) -> Any:
    """Run a redis-cli command line through redis-py; replies come back as the server sent them."""
    if argv[0] == "--scan":
        options = dict(zip(argv[1::2], argv[2::2], strict=True))
        assert set(options) <= {"--pattern", "--count"}, f"unsupported redis-cli options {argv}"
        return [key async for key in bus.redis.scan_iter(match=options.get("--pattern"), count=options.get("--count"))]
    assert not argv[0].startswith("-"), f"doc commands take no redis-cli option but --scan: {argv}"
    return await raw.execute_command(*argv)  # type: ignore[no-untyped-call]


async def run_with_redis_cli(cli: str, socket_path: Path, argv: list[str]) -> str:
    """Run the command line with the real redis-cli (``-s`` socket); fail on any error reply."""
    done = await run_process([cli, "-s", str(socket_path), "--no-raw", *argv], check=False)
    out, err = done.stdout.decode(), done.stderr.decode()
    assert done.returncode == 0 and not err.strip(), f"{argv}: exit {done.returncode}: {err}{out}"
    assert "(error)" not in out and not out.startswith("ERR"), f"{argv}: {out}"
    assert out.strip() not in ("", "(nil)", "(empty array)", "(integer) 0", '"none"', "none"), f"{argv}: {out}"
    return out


@pytest.fixture
async def live(real_backend: str) -> AsyncIterator[tuple[HandoffBus, aioredis.Redis, Path]]:
    """A fresh server of its own (valkey, and redis where a redis-server >= 7 is installed) in the doc's state."""
    server = start_server(SERVER_BINARIES[real_backend])
    raw = aioredis.Redis(unix_socket_path=str(server.socket_path))
    raw.response_callbacks.clear()  # keep replies as the server sent them
    try:
        async with HandoffBus.connect(server.url) as bus:
            assert bus.config.prefix == PREFIX
            await build_state(bus, server.url)
            yield bus, raw, server.socket_path
    finally:
        await raw.aclose()
        server.stop()


# ---------------------------------------------------------------------- tests


def test_doc_names_every_key() -> None:
    text = doc_text()
    for suffix in SUFFIXES:
        shown = rf"{PREFIX}:(\{{[^}}]+\}}:)?{re.escape(suffix)}"
        assert re.search(shown, text), f"the doc never shows a key ending in {suffix!r}"
    for key in expected_keys():
        rest = key.split("}:", 1)[1] if "}:" in key else key.split(":", 1)[1]
        assert any(rest == s or (s.endswith(":") and rest.startswith(s)) for s in SUFFIXES), f"new key {key}?"
    assert set(doc_key_types(text)) == expected_keys(), "the doc's key table and handoffbus/keys.py disagree"
    for script in SCRIPT_NAMES:
        assert f"`{script}`" in text, f"the doc never names the {script} script"


def test_doc_commands_are_well_formed() -> None:
    commands = doc_commands(doc_text())
    assert len(commands) >= 20
    for line in commands:
        argv = shlex.split(line)[1:]
        assert argv, line
        for arg in argv:
            # a key with a hash tag must be quoted, or a shell may brace-expand it
            if "{" in arg:
                assert f"'{arg}'" in line, f"unquoted key with braces: {line}"


async def test_every_doc_command_shows_something(live: tuple[HandoffBus, aioredis.Redis, Path]) -> None:
    """redis-py judges each reply (structured, so an empty range is told from a value); where a
    redis-cli is installed, the line also runs verbatim in it, options and quoting included."""
    bus, raw, socket_path = live
    text = doc_text()
    cli = shutil.which("redis-cli")
    for line in doc_commands(text):
        argv = shlex.split(line)[1:]
        result = await run_with_redis_py(bus, raw, argv)
        assert shows_something(result, argv[0].upper()), f"shows nothing (the doc drifted): {line} -> {result!r}"
        if cli is not None:
            await run_with_redis_cli(cli, socket_path, argv)


async def test_doc_states_each_key_type(live: tuple[HandoffBus, aioredis.Redis, Path]) -> None:
    _bus, raw, _ = live
    stated = doc_key_types(doc_text())
    assert stated
    for key, kind in stated.items():
        actual = await raw.execute_command("TYPE", key)  # type: ignore[no-untyped-call]
        assert actual == kind.encode(), f"{key}: the doc says {kind}, TYPE says {actual!r}"
