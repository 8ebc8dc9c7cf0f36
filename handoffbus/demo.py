"""``handoffbus demo``: agents handing work to each other on a real server, narrated."""

from __future__ import annotations

import anyio

from .bus import HandoffBus
from .client import HandoffClient
from .context import ConversationEntry, HandoffContext, serialize_context
from .errors import InvalidTransition
from .keys import GROUP
from .models import HandoffRequest, HandoffStatus
from .workers.inbox import Inbox

SPECIALIST = "security-specialist-1"
SKILLS = {"code_review", "security_analysis"}


async def _specialist(bus: HandoffBus, say: object) -> None:
    """A minimal agent loop: take in priority order, decide, work, complete, settle."""
    assert callable(say)
    me: HandoffClient = bus.client(SPECIALIST)
    inbox = Inbox(bus, SPECIALIST, "demo-worker")
    done: list[str] = []
    while True:
        bell, taken = await inbox.take(8, settle=done)
        done = []
        if not taken:
            await inbox.wait(bell, 1000)
            continue
        for delivery, loaded in zip(taken, await inbox.load([d.handoff_id for d in taken]), strict=True):
            done.append(delivery.handoff_id)
            if loaded is None or loaded.request is None or loaded.status is not HandoffStatus.PENDING:
                continue
            request = loaded.request
            missing = set(request.capabilities_required) - SKILLS
            try:
                if missing:
                    await me._transition("reject", delivery.handoff_id, {
                        "reason": f"missing capability: {', '.join(sorted(missing))}", "code": "CAPABILITY_MISSING",
                    }, settle=False)
                    continue
                await me._transition("accept", delivery.handoff_id, {}, settle=False)
                say(f"  {SPECIALIST} accepted {delivery.handoff_id} (priority {request.priority})")
                result = bus.codec.dumps_value({"finding": f"reviewed: {request.reason}"})
                await me._transition("complete", delivery.handoff_id, {"result": result}, settle=False)
            except InvalidTransition:
                continue  # cancelled or expired meanwhile


async def run(url: str | None = None, say: object = print) -> int:
    """Run the demo; returns the number of handoffs that ended as the demo expects them to."""
    assert callable(say)
    bus = HandoffBus.connect(url) if url else HandoffBus.embedded()
    async with bus:
        where = url or f"embedded server {bus._server.binary if bus._server else ''}"
        say(f"handoffbus demo on {where}")
        client = bus.client("general-agent-1")
        ctx = serialize_context(HandoffContext(
            conversation_history=[ConversationEntry(role="user", content="Please check this login handler.")],
        ))
        plan = [
            ("low-priority review", ["code_review"], SPECIALIST, 9, 30.0, HandoffStatus.COMPLETED),
            ("urgent security review", ["security_analysis"], SPECIALIST, 1, 30.0, HandoffStatus.COMPLETED),
            ("translate the docs", ["translation"], SPECIALIST, 5, 30.0, HandoffStatus.REJECTED),
            ("nobody is listening", ["billing"], "billing-agent-1", 5, 1.0, HandoffStatus.EXPIRED),
        ]
        handles = []
        for reason, caps, target, priority, timeout, _ in plan:
            handle = await client.request_handoff(HandoffRequest(
                from_agent="general-agent-1", to_agent=target, reason=reason, context_snapshot=ctx,
                capabilities_required=caps, priority=priority, timeout=timeout,
            ))
            say(f"general-agent-1 -> {target}: {reason!r} (priority {priority}, timeout {timeout:g}s)")
            handles.append(handle)
        good = 0
        async with anyio.create_task_group() as tg:
            tg.start_soon(_specialist, bus, say)
            for handle, (reason, *_rest, expected) in zip(handles, plan, strict=True):
                outcome = await handle.outcome()
                detail = outcome.result or outcome.rejection_reason or outcome.rejection_code or ""
                say(f"  {reason!r}: {outcome.status} {detail}")
                good += outcome.status is expected
            tg.cancel_scope.cancel()
        say(f"{good}/{len(plan)} handoffs ended as expected; inbox group {GROUP!r} drained")
        return good
