"""``handoffbus demo``: a triage agent hands work to specialists served by real workers.

No model and no network: the hooks are scripted. The trace shows who handed what to whom,
how it ended and when (milliseconds since the start), then a summary. With ``handoffs``
set it becomes a small load run over ``agents`` specialists instead.
"""

from __future__ import annotations

import statistics
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import anyio

from .bus import HandoffBus
from .client import HandoffClient
from .connections import redact_url
from .context import ConversationEntry, HandoffContext, serialize_context
from .handle import HandoffHandle
from .models import HandoffRequest, HandoffResponse, HandoffStatus
from .workers import Accept, Agent, ReceivedHandoff, Reject, Worker

TRIAGE = "triage-1"
S = HandoffStatus


class SecurityReviewer(Agent):
    agent_id = "security-reviewer-1"
    capabilities = ["code_review", "security_analysis"]

    async def on_handoff_received(self, handoff: ReceivedHandoff) -> Any:
        await anyio.sleep(0.02)  # simulated work
        return {"finding": f"reviewed: {handoff.request.reason}"}


class Refunds(Agent):
    agent_id = "refunds-1"
    capabilities = ["refunds"]

    async def on_handoff_request(self, request: HandoffRequest) -> Accept | Reject:
        if request.metadata.get("amount", 0) > 500:
            return Reject(reason="over my refund limit", code="OVER_LIMIT", redirect_to="refunds-supervisor-1")
        return Accept()

    async def on_handoff_received(self, handoff: ReceivedHandoff) -> Any:
        return {"refunded": handoff.request.metadata.get("amount")}


class RefundSupervisor(Refunds):
    agent_id = "refunds-supervisor-1"

    async def on_handoff_request(self, request: HandoffRequest) -> Accept | Reject:
        return Accept(metadata={"approved_by": self.agent_id})


#: (reason, capabilities, target, priority, timeout s, metadata, the status it should end in)
SCENARIO: list[tuple[str, list[str], str, int, float, dict[str, Any], HandoffStatus]] = [
    ("review the login handler for injection", ["security_analysis"], "security-reviewer-1", 1, 30, {}, S.COMPLETED),
    ("tidy the README wording", ["code_review"], "security-reviewer-1", 9, 30, {}, S.COMPLETED),
    ("refund order A-1001", ["refunds"], "refunds-1", 5, 30, {"amount": 120}, S.COMPLETED),
    ("refund order A-1002", ["refunds"], "refunds-1", 5, 30, {"amount": 900}, S.COMPLETED),
    ("translate the release notes", ["translation"], "security-reviewer-1", 5, 30, {}, S.REJECTED),
    ("update the billing address", ["billing"], "billing-agent-1", 5, 1.0, {}, S.EXPIRED),
]


def _detail(response: HandoffResponse) -> str:
    if response.status is S.REJECTED:
        redirect = f", redirect to {response.redirect_to_agent}" if response.redirect_to_agent else ""
        return f"{response.rejection_code}: {response.rejection_reason}{redirect}"
    if response.status is S.COMPLETED:
        return str(response.result)
    return response.error or ""


async def _follow(
    client: HandoffClient, handle: HandoffHandle, request: HandoffRequest, trace: Callable[[str], None]
) -> HandoffResponse:
    """Await a handoff; on a rejection that names a redirect, hand it there instead (once)."""
    outcome = await handle.outcome()
    trace(f"{request.from_agent} -> {request.to_agent}: {request.reason!r} {outcome.status} {_detail(outcome)}")
    if outcome.status is S.REJECTED and outcome.redirect_to_agent:
        redirected = HandoffRequest(
            from_agent=request.from_agent, to_agent=outcome.redirect_to_agent, reason=request.reason,
            context_snapshot=request.context_snapshot, capabilities_required=request.capabilities_required,
            priority=request.priority, timeout=request.timeout, metadata=request.metadata,
        )
        trace(f"{request.from_agent} follows the redirect to {redirected.to_agent}")
        return await _follow(client, await client.request_handoff(redirected), redirected, trace)
    return outcome


async def scenario(bus: HandoffBus, say: Callable[[str], None]) -> int:
    """The narrated scenario; returns how many handoffs ended as the scenario expects."""
    start = time.perf_counter()

    def trace(line: str) -> None:
        say(f"{(time.perf_counter() - start) * 1000:7.0f} ms  {line}")

    client = bus.client(TRIAGE)
    ctx = serialize_context(HandoffContext(
        conversation_history=[ConversationEntry(role="user", content="Can you look into these for me?")],
    ))
    requests = [
        HandoffRequest(from_agent=TRIAGE, to_agent=target, reason=reason, context_snapshot=ctx,
                       capabilities_required=caps, priority=priority, timeout=timeout, metadata=meta)
        for reason, caps, target, priority, timeout, meta, _ in SCENARIO
    ]
    handles = []
    for request in requests:  # all queued before any worker runs: the reviewer sees priority 1 first
        handles.append(await client.request_handoff(request))
        trace(f"{TRIAGE} -> {request.to_agent}: {request.reason!r} (priority {request.priority})")
    outcomes: list[HandoffResponse | None] = [None] * len(handles)
    workers = [Worker(bus, SecurityReviewer(), concurrency=1), Worker(bus, Refunds()),
               Worker(bus, RefundSupervisor())]
    async with anyio.create_task_group() as tg:
        for worker in workers:
            await tg.start(worker.run)

        async def follow(i: int) -> None:
            outcomes[i] = await _follow(client, handles[i], requests[i], trace)

        async with anyio.create_task_group() as waiting:
            for i in range(len(handles)):
                waiting.start_soon(follow, i)
        for worker in workers:
            worker.drain()
    good = sum(o is not None and o.status is expected for o, (*_, expected) in zip(outcomes, SCENARIO, strict=True))
    counts = Counter(str(o.status) for o in outcomes if o is not None)
    say(f"summary: {dict(sorted(counts.items()))}; {good}/{len(SCENARIO)} handoffs ended as expected")
    return good


async def load(bus: HandoffBus, agents: int, handoffs: int, say: Callable[[str], None]) -> int:
    """A small load run: ``handoffs`` requests spread over ``agents`` specialist workers."""

    class Specialist(SecurityReviewer):
        async def on_handoff_received(self, handoff: ReceivedHandoff) -> Any:
            return {"ok": True}

    specialists = [type(f"Specialist{i}", (Specialist,), {"agent_id": f"specialist-{i}"}) for i in range(agents)]
    client = bus.client(TRIAGE)
    latencies: list[float] = []

    async def one(i: int) -> None:
        began = time.perf_counter()
        handle = await client.request_handoff(HandoffRequest(
            from_agent=TRIAGE, to_agent=f"specialist-{i % agents}", reason=f"task {i}", timeout=60))
        if (await handle.outcome()).status is S.COMPLETED:
            latencies.append(time.perf_counter() - began)

    workers = [Worker(bus, cls(), concurrency=32) for cls in specialists]
    start = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for worker in workers:
            await tg.start(worker.run)
        issued = 0

        async def sender() -> None:  # 100 of these keep 100 in flight (not a task per handoff)
            nonlocal issued
            while issued < handoffs:
                issued += 1
                await one(issued - 1)

        async with anyio.create_task_group() as sending:
            for _ in range(min(100, handoffs)):
                sending.start_soon(sender)
        for worker in workers:
            worker.drain()
    elapsed = time.perf_counter() - start
    ms = sorted(x * 1000 for x in latencies)
    p99 = ms[min(len(ms) - 1, int(len(ms) * 0.99))] if ms else 0.0
    say(f"{len(latencies)}/{handoffs} handoffs completed over {agents} agents in {elapsed:.2f}s: "
        f"{len(latencies) / elapsed:,.0f}/s, latency p50 {statistics.median(ms) if ms else 0:.1f} ms "
        f"p99 {p99:.1f} ms")
    return len(latencies)


async def run(url: str | None = None, say: Callable[[str], None] = print,
              agents: int = 3, handoffs: int = 0, cluster: bool = False, *, prefix: str = "hb") -> bool:
    """Run the demo (or, with ``handoffs``, the load run) under key ``prefix``; True when
    everything ended as expected. Without ``url`` it starts an embedded server, or with
    ``cluster`` an embedded three-primary Redis Cluster."""
    bus = HandoffBus.connect(url, prefix=prefix) if url else HandoffBus.embedded(cluster=cluster, prefix=prefix)
    async with bus:
        kind = "cluster of three primaries" if cluster else "server"
        where = redact_url(url) if url else f"an embedded {kind} ({bus._server.binary if bus._server else ''})"
        say(f"handoffbus demo on {where}")
        if handoffs:
            return await load(bus, agents, handoffs, say) == handoffs
        return await scenario(bus, say) == len(SCENARIO)
