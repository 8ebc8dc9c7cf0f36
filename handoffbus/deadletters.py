"""Dead letters: the handoffs an agent's workers gave up on, listed, replayed or failed.

A dead letter is one entry of the agent's dead-letter stream naming the handoff (``h``); the
handoff's record is left as it was. Replaying queues the handoff again; failing ends an
ACCEPTED one as FAILED under its recorded lease, so its requester hears the outcome (it has
no deadline left to expire it, and the requester may not cancel accepted work). Either way
the dead letter is dropped last, so a crash between the two steps loses nothing; one whose
handoff ended meanwhile, or that names no handoff, is dropped alone. So is a stale one, whose
handoff a worker of the agent holds again (its requester sent it again, say): acting on it
would deliver the handoff twice, or fail live work. A record a worker could not decode is
read for its status all the same. Two operators at once: a replay whose handoff ended
while it was being issued again takes its entry back.
"""

from __future__ import annotations

import contextlib
import re
from typing import TYPE_CHECKING, NamedTuple

from . import errors
from .keys import GROUP, RESTORED
from .models import TERMINAL, DeadLetter, DeadLetterAction, HandoffResponse, HandoffStatus
from .names import check_name, split_handoff_id
from .records import Loaded

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
    return [_dead_letter(eid, f) for eid, f in entries]


def _text(fields: dict[bytes, bytes], name: bytes) -> str:
    """A field as text: a queue member that was not text was dead-lettered as it was, and is
    shown escaped; a field missing from an entry written by hand reads as empty."""
    return fields.get(name, b"").decode(errors="backslashreplace")


def _dead_letter(entry_id: bytes, fields: dict[bytes, bytes]) -> DeadLetter:
    # an entry written by hand is listed all the same (deliveries 0 where it has no count), so
    # that an operator sees it, and can drop it by replaying it: it names no handoff
    deliveries = fields.get(b"deliveries", b"")
    return DeadLetter(entry_id=entry_id.decode(), handoff_id=_text(fields, b"h"), reason=_text(fields, b"reason"),
                      # (a count of more digits than any count has is no count: int() refuses 4,300)
                      deliveries=int(deliveries) if deliveries.isdigit() and len(deliveries) <= 20 else 0,
                      consumer=_text(fields, b"consumer"), at_ms=int(entry_id.split(b"-")[0]))


class _Read(NamedTuple):
    """What acting on a dead letter reads: its handoff, that handoff's record as a worker reads
    it (None: gone, or the dead letter names no handoff; never raises for a record that cannot
    be decoded), and whether a worker of the agent holds the handoff again."""

    handoff_id: str
    row: Loaded | None
    held: bool


async def _read(bus: HandoffBus, agent: str, entry_id: str) -> _Read:
    if (not isinstance(entry_id, str) or not re.fullmatch(r"\d{1,20}-\d{1,20}", entry_id)
            or any(int(part) > MAX_STREAM_ID_PART for part in entry_id.split("-"))):
        raise errors.InvalidRequest(f"not a stream entry id: {entry_id!r} (like 1700000000000-0)")
    found = await bus.redis.xrange(bus.keys.dead_letters(agent), entry_id, entry_id)
    if not found:
        raise errors.HandoffNotFound(f"dead letter {entry_id} of {agent}")
    handoff_id = _text(found[0][1], b"h")
    try:
        split_handoff_id(handoff_id)
    except errors.InvalidName:  # a queue member written by hand: no handoff to act on
        return _Read(handoff_id, None, False)
    [row] = await bus.load_records([handoff_id])
    if row is not None and row.request is None:  # it cannot be decoded (why it is a dead letter, often)
        status = await bus.redis.hget(bus.keys.record(*split_handoff_id(handoff_id)).record, "status")
        with contextlib.suppress(ValueError, AttributeError):  # read as a worker reads it, PENDING
            row = row._replace(status=HandoffStatus(status.decode()))
    # taken again since (the same request sent again, a routed offer made again), or accepted
    # by another agent (routed on): the dead letter is stale, and acting on it would deliver
    # the handoff twice, or fail live work
    held = row is not None and row.status is HandoffStatus.ACCEPTED and row.agent not in (None, agent)
    held = held or bool(await bus.redis.hexists(bus.keys.target(agent).inflight, handoff_id))
    return _Read(handoff_id, row, held)


def _left_alone(read: _Read) -> bool:
    """Whether the dead letter is only to be dropped: its handoff ended, is gone, or is held again."""
    return read.row is None or read.row.status in TERMINAL or read.held


async def _drop(bus: HandoffBus, agent: str, entry_id: str, read: _Read, done: bool,
                row: Loaded | HandoffResponse | None) -> DeadLetterAction:
    """Drop the dead letter (last: a crash before it leaves the dead letter, never the handoff
    unattended); ``row``: what says the handoff's status now."""
    await bus.redis.xdel(bus.keys.dead_letters(agent), entry_id)
    return DeadLetterAction(handoff_id=read.handoff_id, done=done, status=None if row is None else row.status,
                            held=read.held and not done)


async def replay_dead_letter(bus: HandoffBus, agent_id: str, entry_id: str) -> DeadLetterAction:
    agent = check_name(agent_id, "agent id")
    read = await _read(bus, agent, entry_id)
    row = read.row
    if row is None or _left_alone(read):
        return await _drop(bus, agent, entry_id, read, False, row)
    if row.status is HandoffStatus.ACCEPTED:
        await bus.script("admit", bus.keys.target(agent).as_list(), [GROUP, RESTORED, read.handoff_id])
    else:  # (a record that cannot be decoded goes at priority 0: its worker dead-letters it again)
        await bus.enqueue(agent, read.handoff_id, row.request.priority if row.request is not None else 0)
    [now] = await bus.load_records([read.handoff_id])
    if now is None or now.status in TERMINAL:  # ended meanwhile (a fail of this dead letter, say)
        await bus.settle(agent, [read.handoff_id])  # not left queued or in flight
        return await _drop(bus, agent, entry_id, read, False, now)
    return await _drop(bus, agent, entry_id, read, True, row)


async def fail_dead_letter(bus: HandoffBus, agent_id: str, entry_id: str, error: str) -> DeadLetterAction:
    agent = check_name(agent_id, "agent id")
    if not isinstance(error, str):
        raise errors.InvalidRequest("error must be a str")
    if bus.keyring is not None and not bus.keyring.can_sign(agent):
        # responses are signed on this bus: an unsigned FAILED would fail its requester's check
        raise errors.InvalidRequest(f"this bus has no signing key of {agent!r}: its FAILED could not be signed")
    read = await _read(bus, agent, entry_id)
    if read.row is not None and read.row.status is HandoffStatus.PENDING and not read.held:
        # not this agent's to end: its requester may cancel it, and its deadline expires it
        raise errors.InvalidTransition(read.handoff_id, read.row.status.value, "fail")
    if _left_alone(read):
        return await _drop(bus, agent, entry_id, read, False, read.row)
    # as the agent, under the lease its last worker held; read apart from the record, which a
    # worker could not decode (that is why some are dead-lettered)
    record = bus.keys.record(*split_handoff_id(read.handoff_id)).record
    lease = await bus.redis.hget(record, "lease")
    response = await bus.client(agent)._transition(
        "fail", read.handoff_id, {"error": error, "lease": None if lease is None else lease.decode()})
    return await _drop(bus, agent, entry_id, read, True, response)
