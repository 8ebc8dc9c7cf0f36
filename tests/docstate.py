"""The state the documentation's redis-cli examples are shown on, and how they are run.

``docs/redis-layout.md`` and ``docs/monitoring.md`` show keys of one running example: a
requester ``general-agent-1`` handing work to ``security-specialist-1``. ``build_state``
makes that state through the public API; the doc tests then run every ``redis-cli`` line of
the docs against it, and ``docs/capture.py`` captures the output shown in monitoring.md.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import anyio
import redis.asyncio as aioredis
from anyio import run_process

from handoffbus import HandoffBus, HandoffContext, HandoffRequest, HandoffStatus
from handoffbus.forwarding import Forwarder
from handoffbus.policies import offload
from handoffbus.routing import set_id
from handoffbus.scripts import STAGED_TTL_MS
from handoffbus.workers.inbox import Inbox

REQUESTER = "general-agent-1"
TARGET = "security-specialist-1"
PREFIX = "hb"
#: the capability set of the docs' routed example
ROUTED_SET = "code_review,security"


def doc_commands(text: str) -> list[str]:
    """Every ``redis-cli`` line inside a fenced code block, in order (a ``$ `` prompt dropped)."""
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
        if fence is not None and stripped.removeprefix("$ ").startswith("redis-cli "):
            commands.append(stripped.removeprefix("$ "))
    assert fence is None, "unclosed code fence"
    return commands


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
    bus.stats.process = "3f1c9a0b7d2e4c55"  # the doc's example of a process's flush numbers

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

    # worker-1 registers itself as a live worker of the target, as Worker._register writes it but
    # with a long time to live, for the doc's commands to find it (a worker's lives three beats)
    await bus.redis.sadd(bus.keys.agents, TARGET)
    info = (b'{"consumer":"worker-1","state":"RUNNABLE","load":1,"limit":8,"capabilities":["oauth"],'
            b'"started_ms":1795408050000,"ttl_ms":600000,"offer_ms":30000}')
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
    # leaves its outbox (answered, so empty) and its replies stream (one reply); the forwarder
    # grants the target what its worker claims (hb:grants)
    async with anyio.create_task_group() as tg:
        await tg.start(Forwarder(bus, [TARGET], grants={TARGET: ["oauth"]}).run)
        async with HandoffBus.connect(url, isolated=TARGET) as isolated:
            keys = bus.keys.record(REQUESTER, "req-42")
            row = await isolated.script("load", [keys.record, keys.envelope], [])
            assert row[0] == b"PENDING"
        tg.cancel_scope.cancel()

    await bus.stats.flush()  # req-41's acceptance and completion, counted for the target

    # a large request caught on its way in: its envelope staged, its request script not yet run
    await bus.redis.set(bus.keys.staged(REQUESTER, "req-45", "9f86d081884c7d65"), b"\x85" + b"." * 20_000,
                        px=STAGED_TTL_MS)

    # a 70 kB report in a context goes out of band (policies/blobs.py), into a blob key of R's
    await offload(bus, REQUESTER, HandoffContext(tool_state={"report": "A" * 70_000}), threshold=65_536)

    # support-agent-1: an earlier requester, idle since (its last response, written by hand here,
    # is from 2023): the sweep's look for idle requesters took it out of hb:requesters
    await bus.redis.xadd(bus.keys.responses("support-agent-1"), {"status": "COMPLETED"}, id="1700000000000-0")
    await bus.redis.sadd(bus.keys.requesters, "support-agent-1")
    assert await bus.sweeper.unlist_idle() == 1

    record = await requester.get_handoff_status(f"{REQUESTER}/req-42")
    assert record is not None and record.status is HandoffStatus.PENDING
    queued = [p.handoff_id for p in await specialist.get_pending_handoffs()]
    assert queued == [f"{REQUESTER}/req-44", f"{REQUESTER}/req-42"]


# ---------------------------------------------------------------------- running commands


async def build_monitoring_state(bus: HandoffBus, url: str) -> None:
    """``build_state``, plus what monitoring.md also shows: an EXPIRED handoff, and the target's
    counters written."""
    await build_state(bus, url)
    requester = bus.client(REQUESTER)
    await requester.request_handoff(HandoffRequest(
        from_agent=REQUESTER, to_agent=TARGET, reason="Quick look at a config diff", request_id="req-38",
        timeout=0.05))
    with anyio.fail_after(10):
        assert (await requester.handle(f"{REQUESTER}/req-38").decision()).status is HandoffStatus.EXPIRED
    await bus.stats.flush()


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


