"""An agent's side of its queue: take handoffs best-priority first, settle them, wait for more.

``take`` moves queued handoffs into the agent's inbox stream and into this consumer's
pending entries list in one script, so work taken by a process that dies stays visible to
the consumer group and can be claimed again. Settling (ack + delete) rides along with the
next ``take``, so a busy worker spends no extra round trip on it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import msgspec
from redis.exceptions import ResponseError

from ..keys import GROUP
from ..names import check_name
from ..records import Loaded

if TYPE_CHECKING:
    from ..bus import HandoffBus
    from ..wire import Line

__all__ = ["Delivery", "Inbox", "Loaded"]


class Delivery(msgspec.Struct, frozen=True, kw_only=True):
    """One handoff taken from the queue: its id and its inbox stream entry."""

    handoff_id: str
    entry_id: str


class Inbox:
    def __init__(self, bus: HandoffBus, agent: str, consumer: str) -> None:
        self._bus = bus
        self.agent = check_name(agent, "agent id")
        self.consumer = check_name(consumer, "consumer name")
        self._keys = bus.keys.target(agent).as_list()
        self._line: Line | None = None  # the doorbell's, made at the first wait

    async def take(self, count: int, settle: Iterable[str] = ()) -> tuple[bytes, list[Delivery]]:
        """Settle ``settle``, then take up to ``count`` handoffs in serving order.

        Returns the doorbell position to pass to ``wait`` when nothing was taken.
        """
        reply = await self._bus.script("take", self._keys, [GROUP, self.consumer, count, *settle])
        # a member that is not text (written by hand) keeps its bytes, to be dead-lettered as it is
        taken = [
            Delivery(handoff_id=reply[i].decode(errors="surrogateescape"), entry_id=reply[i + 1].decode())
            for i in range(1, len(reply), 2)
        ]
        return reply[0], taken

    async def unseen(self, after: str, count: int) -> list[Delivery]:
        """Up to ``count`` of this consumer's entries delivered after entry ``after`` by a take
        (or an admit) whose reply was lost: the server delivered them, the worker never heard.
        Delivered once (an entry claimed from another consumer has been delivered more)."""
        redis = self._bus.redis
        try:
            rows = await redis.xpending_range(self._keys[1], GROUP, min=f"({after}", max="+", count=count,
                                              consumername=self.consumer)
        except ResponseError as exc:
            if "NOGROUP" in str(exc):  # no group (yet, or deleted): nothing was delivered to this consumer
                return []
            raise
        ids = [row["message_id"] for row in rows if int(row["times_delivered"]) == 1]
        if not ids:
            return []
        wanted = set(ids)
        entries = await redis.xrange(self._keys[1], min=ids[0], max=ids[-1])
        return [Delivery(handoff_id=fields[b"h"].decode(errors="surrogateescape"), entry_id=eid.decode())
                for eid, fields in entries if eid in wanted and fields.get(b"h") is not None]

    async def wait(self, bell: bytes, block_ms: int) -> bool:
        """Block until something is enqueued after ``bell`` (True) or ``block_ms`` pass (False).
        On one server the wait reads through a watched line, so that a server that stops
        answering fails it (``wire.REPLY_WAIT`` past the block) rather than hold it for ever."""
        if self._line is None:
            self._line = self._bus.blocking_line()
        if self._line is None:  # a cluster, fakeredis
            return bool(await self._bus.blocking_read(
                self._bus.blocking_redis.xread({self._keys[4]: bell}, count=1, block=block_ms), block_ms / 1000))
        return bool(await self._line.command("XREAD", "COUNT", 1, "BLOCK", block_ms, "STREAMS", self._keys[4], bell,
                                             blocks=block_ms / 1000))

    async def close(self) -> None:
        """Give the doorbell's connection back to the pool."""
        line, self._line = self._line, None
        if line is not None:
            await line.close()

    async def restore(self) -> int:
        """Recreate the consumer group if it (or the inbox stream) was deleted, re-issuing an
        entry for every in-flight handoff; returns how many were re-issued."""
        return int(await self._bus.script("restore", self._keys, [GROUP]))

    async def entries(self, handoff_ids: Sequence[str]) -> dict[str, str]:
        """The current inbox entry of each in-flight handoff (absent once settled)."""
        rows = await self._bus.redis.hmget(self._keys[2], list(handoff_ids))
        return {hid: row.decode() for hid, row in zip(handoff_ids, rows, strict=True) if row is not None}

    async def settle(self, handoff_ids: Sequence[str]) -> int:
        return await self._bus.settle(self.agent, list(handoff_ids))

    async def requeue(self, handoff_id: str, priority: int) -> bool:
        """Settle a handoff taken here and queue it again, in one step (see requeue-5.lua);
        False: left alone, another consumer claimed it meanwhile."""
        return bool(await self._bus.script("requeue", self._keys, [GROUP, handoff_id, priority, self.consumer]))

    async def give_up(self, handoff_id: str) -> bool:
        """Settle a handoff taken here, if this consumer still holds it, without queueing it
        again (a routed one, to be released to its set); False: left alone, as ``requeue``."""
        return bool(await self._bus.script("requeue", self._keys, [GROUP, handoff_id, 0, self.consumer, "1"]))

    async def retire(self, consumers: Sequence[str]) -> int:
        """Forget those of ``consumers`` that are gone: their entries in the worker index, and
        their consumers that hold nothing (see retire-2.lua); returns how many consumers were
        deleted."""
        keys = self._bus.keys
        beats = [keys.worker_beat(self.agent, consumer) for consumer in consumers]
        return int(await self._bus.script("retire", [self._keys[1], keys.workers(self.agent), *beats],
                                          [GROUP, *consumers]))

    async def retire_gone(self) -> int:
        """Retire the other workers that are gone: the group's consumers that hold nothing (a
        worker that crashed, whose entries live workers took over), and the worker index's
        entries (a worker that crashed never deregisters)."""
        bus = self._bus
        async with bus.redis.pipeline(transaction=False) as pipe:
            pipe.hgetall(bus.keys.workers(self.agent))
            pipe.xinfo_consumers(self._keys[1], GROUP)
            registered, rows = await pipe.execute(raise_on_error=False)
        if isinstance(registered, Exception):
            raise registered
        names = [raw.decode(errors="replace") for raw in registered]
        if not isinstance(rows, Exception):  # else no inbox or group yet: no consumer to retire
            names += [row["name"].decode(errors="replace") for row in rows if row["pending"] == 0]
        gone = [name for name in dict.fromkeys(names) if name != self.consumer]
        retired = 0
        for first in range(0, len(gone), 100):
            retired += await self.retire(gone[first:first + 100])
        return retired

    async def load(self, handoff_ids: Sequence[str]) -> list[Loaded | None]:
        """What each taken handoff's record says (None where it is gone), in one round trip."""
        return await self._bus.load_records(handoff_ids)

    async def dead_letter(
        self, delivery: Delivery, reason: str, deliveries: int, cap: int = 10_000, *, keep: bool = False
    ) -> bytes:
        """Move a taken handoff to the dead-letter stream (acknowledged in the same step). Past
        ``cap`` dead letters the oldest are deleted, never one ``keep`` marks: one whose handoff
        may be ACCEPTED, which no deadline ends, so that its dead letter is all that does."""
        bus = self._bus
        keys = [self._keys[1], self._keys[2], bus.keys.dead_letters(self.agent)]
        entry: bytes = await bus.script("deadletter", keys, [
            GROUP, delivery.handoff_id.encode(errors="surrogateescape"), delivery.entry_id, reason, deliveries,
            self.consumer, cap, "1" if keep else "0",
        ])
        return entry
