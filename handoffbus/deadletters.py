"""Dead letters: the handoffs an agent's workers gave up on, listed, replayed or failed.

A dead letter is one entry of the agent's dead-letter stream naming the handoff (``h``); the
handoff's record is left as it was. Replaying queues the handoff again; failing ends an
ACCEPTED one as FAILED under its recorded lease, so its requester hears the outcome (it has
no deadline left to expire it, and the requester may not cancel accepted work). Either way
the dead letter is dropped last, so a crash between the two steps loses nothing; one whose
handoff ended meanwhile, or that names no handoff, is dropped alone.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from . import errors
from .keys import GROUP, RESTORED
from .models import DeadLetter, DeadLetterAction, HandoffRecord, HandoffStatus
from .names import check_name

if TYPE_CHECKING:
    from .bus import HandoffBus

__all__ = ["dead_letters", "fail_dead_letter", "replay_dead_letter"]

#: the largest part of a stream entry id ("<ms>-<seq>", each an unsigned 64-bit number)
MAX_STREAM_ID_PART = 2**64 - 1


async def dead_letters(bus: HandoffBus, agent_id: str, count: int) -> list[DeadLetter]:
    agent = check_name(agent_id, "agent id")
    if type(count) is not int or count < 1:
        raise errors.InvalidRequest(f"count must be an int of at least 1, not {count!r}")
    entries = await bus.redis.xrange(bus.keys.dead_letters(agent), count=count)
    return [
        DeadLetter(
            # a queue member that was not text was dead-lettered as it was: shown escaped
            entry_id=eid.decode(), handoff_id=f[b"h"].decode(errors="backslashreplace"),
            reason=f[b"reason"].decode(errors="backslashreplace"), deliveries=int(f[b"deliveries"]),
            consumer=f[b"consumer"].decode(errors="backslashreplace"),
            at_ms=int(eid.split(b"-")[0]),
        )
        for eid, f in entries
    ]


async def _read(bus: HandoffBus, agent: str, entry_id: str) -> tuple[str, HandoffRecord | None]:
    """The handoff a dead letter names and its record (None: gone, or it names no handoff)."""
    if (not isinstance(entry_id, str) or not re.fullmatch(r"\d{1,20}-\d{1,20}", entry_id)
            or any(int(part) > MAX_STREAM_ID_PART for part in entry_id.split("-"))):
        raise errors.InvalidRequest(f"not a stream entry id: {entry_id!r} (like 1700000000000-0)")
    found = await bus.redis.xrange(bus.keys.dead_letters(agent), entry_id, entry_id)
    if not found:
        raise errors.HandoffNotFound(f"dead letter {entry_id} of {agent}")
    handoff_id = found[0][1][b"h"].decode(errors="backslashreplace")
    try:
        read = await bus.read_record(handoff_id)
    except errors.InvalidName:  # a queue member written by hand: no handoff to act on
        return handoff_id, None
    return handoff_id, None if read is None else read[2]


async def _drop(bus: HandoffBus, agent: str, entry_id: str, handoff_id: str,
                status: HandoffStatus | None, done: bool) -> DeadLetterAction:
    await bus.redis.xdel(bus.keys.dead_letters(agent), entry_id)
    return DeadLetterAction(handoff_id=handoff_id, done=done, status=status)


async def replay_dead_letter(bus: HandoffBus, agent_id: str, entry_id: str) -> DeadLetterAction:
    agent = check_name(agent_id, "agent id")
    handoff_id, record = await _read(bus, agent, entry_id)
    live = record is not None and not record.terminal
    if record is not None and record.status is HandoffStatus.ACCEPTED:
        await bus.script("admit", bus.keys.target(agent).as_list(), [GROUP, RESTORED, handoff_id])
    elif live and record is not None:
        await bus.enqueue(agent, handoff_id, record.request.priority)
    return await _drop(bus, agent, entry_id, handoff_id, None if record is None else record.status, live)


async def fail_dead_letter(bus: HandoffBus, agent_id: str, entry_id: str, error: str) -> DeadLetterAction:
    agent = check_name(agent_id, "agent id")
    if not isinstance(error, str):
        raise errors.InvalidRequest("error must be a str")
    if bus.keyring is not None and not bus.keyring.can_sign(agent):
        # responses are signed on this bus: an unsigned FAILED would fail its requester's check
        raise errors.InvalidRequest(f"this bus has no signing key of {agent!r}: its FAILED could not be signed")
    handoff_id, record = await _read(bus, agent, entry_id)
    if record is not None and record.status is HandoffStatus.PENDING:
        # not this agent's to end: its requester may cancel it, and its deadline expires it
        raise errors.InvalidTransition(handoff_id, record.status.value, "fail")
    if record is None or record.terminal:
        return await _drop(bus, agent, entry_id, handoff_id, None if record is None else record.status, False)
    # as the agent, under the lease its last worker held (no worker holds it now: a replay
    # meanwhile that a worker took over moves the lease, and this fail is refused)
    response = await bus.client(agent)._transition("fail", handoff_id, {"error": error, "lease": record.lease})
    return await _drop(bus, agent, entry_id, handoff_id, response.status, True)
