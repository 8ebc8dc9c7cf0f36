"""Keeper: a worker's hold on its inbox entries, and its claim on entries others left behind.

Every entry a worker holds (a handler runs it, or waits for a lane) is touched well within
the reclaim time, so no live worker's work is taken over. Entries that stopped workers left
idle are claimed, with their delivery counts (a handoff delivered too often is poison).
Claiming waits while contact with Redis is fresh: after an outage every holder's entries
look idle, their beats having failed too, and claims sent then would take running work.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import anyio
from redis.exceptions import RedisError, ResponseError

from ..backoff import Backoff
from ..keys import GROUP
from ..logs import AgentLog
from ..records import Loaded
from .inbox import Delivery, Inbox

if TYPE_CHECKING:
    from ..bus import HandoffBus

__all__ = ["Claimed", "Keeper"]

#: an entry taken over: its delivery, what its record says (None: gone), and how often it was delivered
Claimed = tuple[Delivery, Loaded | None, int]


def _handoff_of(fields: dict[bytes, bytes]) -> str | None:
    """The handoff id an inbox entry names, or None for an entry no worker wrote."""
    raw = fields.get(b"h")
    try:
        return raw.decode() if raw else None
    except UnicodeDecodeError:
        return None


class Keeper:
    """``entries`` is the worker's own map of held handoff ids to inbox entries: the keeper
    touches what it lists, and updates an entry re-issued by a group restore."""

    def __init__(self, bus: HandoffBus, inbox: Inbox, entries: dict[str, str], log: AgentLog) -> None:
        self.bus = bus
        self._inbox = inbox
        self._inbox_key = bus.keys.target(inbox.agent).inbox
        self.consumer = inbox.consumer
        self._entries = entries
        self._log = log
        #: when this worker last found Redis out of reach or slow (see lost_contact); never yet
        self.contact_since = -math.inf
        #: entries claimed (delivered to this worker, their delivery counted) whose records could
        #: not be read then: held (kept fresh by the beat) and handed out by the next claim_idle,
        #: not left to be claimed, and counted, once more
        self._carried: list[Delivery] = []

    def lost_contact(self) -> None:
        """Redis was out of reach, or slow to answer: other workers' entries look idle to this
        one for a while (their beats failed too, and a server's idle times run on while it is
        down), so it claims none until ``reclaim_idle`` of unbroken contact has passed."""
        self.contact_since = anyio.current_time()

    async def beat(self) -> None:
        """Touch the held entries, trying again at once after a failure: a connection the
        server dropped fails its first command, and a beat missed three times in a row lets
        another worker take live work over."""
        backoff = Backoff(first=0.05, cap=0.4)
        for attempt in range(4):
            try:
                await self.touch(list(self._entries))
                return
            except (RedisError, OSError) as exc:
                self.lost_contact()
                if attempt == 3:
                    self._log.warning("%s: heartbeat failed (%s)", self.consumer, exc)
                    return
            await anyio.sleep(backoff.delay())  # the retry's backoff

    async def touch(self, hids: list[str]) -> None:
        """Reset the idle time of the inbox entries of handoffs this worker is handling (XCLAIM
        JUSTID to itself). An entry that is gone was re-issued when the group was restored
        after a deletion: adopt the new one, before another worker claims it as idle."""
        held = {hid: self._entries[hid] for hid in hids if hid in self._entries}
        if not held:  # all finished (during a beat's retry, say): XCLAIM takes no empty list
            return
        try:
            claimed = await self.bus.redis.xclaim(
                self._inbox_key, GROUP, self.consumer, 0, list(held.values()), justid=True)
        except ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            await self.restore()
            claimed = []
        kept = {c.decode() if isinstance(c, bytes) else c for c in claimed}
        lost = [hid for hid, entry in held.items() if entry not in kept]
        if not lost:
            return
        moved = {hid: entry for hid, entry in (await self._inbox.entries(lost)).items() if entry != held[hid]}
        if moved:
            await self.bus.redis.xclaim(self._inbox_key, GROUP, self.consumer, 0, list(moved.values()), justid=True)
            for hid, entry in moved.items():
                if hid in self._entries:
                    self._entries[hid] = entry

    async def restore(self) -> None:
        restored = await self._inbox.restore()
        if restored:
            self._log.warning("%s: the consumer group of %s was deleted; recreated it and re-issued %d in-flight "
                              "handoffs from their records", self.consumer, self._inbox.agent, restored)

    async def claim_idle(
        self, count: int, reclaim_idle: float, cursor: bytes | str
    ) -> tuple[bytes | str, list[Claimed]]:
        """Claim up to ``count`` entries idle for ``reclaim_idle`` seconds, from ``cursor`` on;
        the cursor to go on from, and what was claimed. Entries naming no handoff are
        dead-lettered; entries this worker runs already are left to it. Nothing is claimed
        while contact is fresh, and a failure is logged, not raised."""
        if self._carried:
            return cursor, await self._carry_on()
        if anyio.current_time() - self.contact_since < reclaim_idle:
            return cursor, []
        taken: list[Delivery] = []
        try:
            # a server that froze answers late: claims sent now would land after the thaw,
            # before the holders' beats, and take their running work
            asked = anyio.current_time()
            await self.bus.server_time_ms()
            if anyio.current_time() - asked > reclaim_idle / 3:
                self.lost_contact()
                return cursor, []
            reply = await self.bus.redis.xautoclaim(
                self._inbox_key, GROUP, self.consumer, int(reclaim_idle * 1000), cursor, count=count
            )
            cursor, claimed = reply[0], reply[1]
            nameless: list[Delivery] = []
            for eid, fields in claimed:
                if not fields:
                    continue  # deleted meanwhile
                hid = _handoff_of(fields)
                if hid is None:
                    nameless.append(Delivery(handoff_id="", entry_id=eid.decode()))
                elif hid not in self._entries:
                    # (an entry this worker is still running went idle too, its heartbeats failing
                    # for a while: it is ours already, and a second run of it must not start)
                    taken.append(Delivery(handoff_id=hid, entry_id=eid.decode()))
            if not taken and not nameless:
                return cursor, []
            counts = await self.delivery_counts(taken + nameless)
            for delivery in nameless:  # written by hand: left pending, it would be claimed again forever
                deliveries = counts.get(delivery.entry_id, 1)
                await self._inbox.dead_letter(delivery, "the inbox entry names no handoff", deliveries)
                self._log.error("%s: dead-lettered inbox entry %s, which names no handoff", self.consumer,
                                delivery.entry_id)
            loaded = await self._inbox.load([d.handoff_id for d in taken])
        except ResponseError as exc:
            self._hold(taken)
            if "NOGROUP" not in str(exc):
                self._log.warning("%s: reclaim failed (%s)", self.consumer, exc)
                return cursor, []
            try:
                await self.restore()  # the group or the stream was deleted: rebuild it from the index
            except (RedisError, OSError) as again:
                self._log.warning("%s: restoring the consumer group failed (%s)", self.consumer, again)
            return "0-0", []
        except (RedisError, OSError) as exc:
            self._hold(taken)
            self.lost_contact()
            self._log.warning("%s: reclaim failed (%s)", self.consumer, exc)
            return cursor, []
        return cursor, self._claimed(taken, loaded, counts)

    def _hold(self, taken: list[Delivery]) -> None:
        """Entries claimed by a reclaim that failed after the claim: this worker's now, their
        delivery counted; claimed again once idle, they would be counted again for no handling
        (a few outages in a row would dead-letter a handoff no worker tried)."""
        for delivery in taken:
            self._entries[delivery.handoff_id] = delivery.entry_id
        self._carried += taken

    async def _carry_on(self) -> list[Claimed]:
        carried = self._carried
        try:
            counts = await self.delivery_counts(carried)
            loaded = await self._inbox.load([d.handoff_id for d in carried])
        except (RedisError, OSError) as exc:
            self.lost_contact()
            self._log.warning("%s: reading %d reclaimed handoffs failed (%s)", self.consumer, len(carried), exc)
            return []
        self._carried = []
        return self._claimed(carried, loaded, counts)

    def _claimed(self, taken: list[Delivery], loaded: list[Loaded | None], counts: dict[str, int]) -> list[Claimed]:
        out: list[Claimed] = []
        for delivery, row in zip(taken, loaded, strict=True):
            deliveries = counts.get(delivery.entry_id, 1)
            self._log.info("%s: reclaimed %s (delivery %d)", self.consumer, delivery.handoff_id, deliveries,
                           extra={"handoff_id": delivery.handoff_id})
            if deliveries > 1:
                self.bus.tally.add(self._inbox.agent, "redelivered")
            out.append((delivery, row, deliveries))
        return out

    async def delivery_counts(self, taken: list[Delivery]) -> dict[str, int]:
        # each entry on its own: one range over them all would also list this worker's other
        # entries between them, and a COUNT could cut off some of those asked for
        async with self.bus.redis.pipeline(transaction=False) as pipe:
            for delivery in taken:
                pipe.xpending_range(self._inbox_key, GROUP, min=delivery.entry_id, max=delivery.entry_id, count=1)
            replies = await pipe.execute()
        return {row["message_id"].decode(): int(row["times_delivered"]) for rows in replies for row in rows}

    async def retire_gone(self) -> None:
        """Delete consumers of workers that are gone and hold nothing any more."""
        try:
            retired = await self._inbox.retire_gone()
        except (RedisError, OSError) as exc:  # no group yet (restored by the next take), or an outage
            self._log.debug("%s: retiring gone consumers failed (%s)", self.consumer, exc)
            return
        if retired:
            self._log.info("%s: retired %d consumers of workers that are gone", self.consumer, retired)
