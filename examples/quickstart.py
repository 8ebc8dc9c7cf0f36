"""Quick start: one agent hands a conversation to another, on a throwaway real Redis.

Run: python examples/quickstart.py            (starts an embedded server, stops it after)
     python examples/quickstart.py redis://localhost:6379/0
"""

from __future__ import annotations

import sys

import anyio

from handoffbus import (
    ConversationEntry,
    HandoffBus,
    HandoffContext,
    HandoffRequest,
    deserialize_context,
    serialize_context,
)
from handoffbus.workers.inbox import Inbox


async def specialist(bus: HandoffBus) -> None:
    """The receiving agent: take what is pending, accept it, do the work, complete it."""
    me = bus.client("security-specialist-1")
    inbox = Inbox(bus, "security-specialist-1", "quickstart")
    while True:
        bell, _ = await inbox.take(0)  # where the doorbell is now
        if pending := await me.get_pending_handoffs():
            break
        await inbox.wait(bell, 5000)  # blocks until something is queued for this agent
    handoff = pending[0]
    await me.accept_handoff(handoff.handoff_id, metadata={"capabilities": ["security_analysis"]})
    context = deserialize_context(handoff.request.context_snapshot or b"")
    finding = f"reviewed {len(context.conversation_history)} messages: no injection found"
    await me.complete_handoff(handoff.handoff_id, result={"finding": finding})


async def main(url: str | None) -> None:
    bus = HandoffBus.connect(url) if url else HandoffBus.embedded()
    async with bus, anyio.create_task_group() as tg:
        tg.start_soon(specialist, bus)
        ctx = HandoffContext(
            conversation_history=[ConversationEntry(role="user", content="Review this login code for security issues")],
            tool_state={"repo": "acme/web"},
            metadata={"ticket": "SEC-1"},
        )
        client = bus.client("general-agent-1")
        handle = await client.request_handoff(HandoffRequest(
            from_agent="general-agent-1", to_agent="security-specialist-1",
            reason="needs a security review", context_snapshot=serialize_context(ctx),
            capabilities_required=["security_analysis"], priority=5, timeout=30.0,
        ))
        print(f"requested  {handle.handoff_id}")
        decision = await handle.decision()
        print(f"decision   {decision.status} by {decision.accepting_agent}")
        outcome = await handle.outcome()
        print(f"outcome    {outcome.status}: {outcome.result}")
        record = await client.get_handoff_status(handle.handoff_id)
        assert record is not None
        print("history    " + " -> ".join(f"{h.status}({h.actor})" for h in record.history))




if __name__ == "__main__":
    anyio.run(main, sys.argv[1] if len(sys.argv) > 1 else None)
