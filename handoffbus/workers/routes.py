"""The routed work a worker pulls: handoffs waiting in the queues of every capability set its
agent can serve (see handoffbus/routing.py and docs/routing.md).

A pull claims handoffs in the set's slot, offers them to this agent on their records, and
admits the ones it got into the agent's own inbox, delivered to this worker: from there they
are handled like direct handoffs, crash recovery included. Claims are acknowledged in the
same round trip as the admit; a worker that dies before that leaves claims that return to
the queue by themselves.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from ..errors import CallRefused
from ..keys import GROUP
from ..routing import Reroute, granted, serves
from .inbox import Delivery

if TYPE_CHECKING:
    from ..bus import HandoffBus

__all__ = ["RouteFeed"]

log = logging.getLogger("handoffbus")

#: how many queued entries a pull reads at a time for ones this agent may take; while it has
#: taken fewer than it asked for, it reads the next ones, up to 16 times this many in all
#: (pull-4.lua's WINDOWS), so entries it may not take hide no work further back
SCAN = 64
#: look at the sets again at least this often (seconds), rung or not
RELOOK = 1.0
#: a set whose pulls the forwarder refused (this agent was not granted it) is left alone this long
REFUSED_WAIT = 60.0


class RouteFeed:
    def __init__(self, bus: HandoffBus, agent: str, capabilities: list[str], consumer: str) -> None:
        self._bus = bus
        self.agent = agent
        self.capabilities = sorted(set(capabilities))
        self.consumer = consumer
        self.sets: dict[str, str] = {}  # set id -> capabilities, for the sets this agent serves
        self._waiting: set[str] = set()  # sets that still had queued work at the last look
        self._bell: bytes | None = None
        self._looked = float("-inf")
        self._turn = 0
        self._refused: dict[str, float] = {}  # set id -> when to try a refused set again (monotonic)

    async def refresh(self) -> None:
        """Learn the capability sets requests were routed by, and keep those this agent serves:
        with grants set, only by the capabilities it was granted too (an isolated agent's
        forwarder refuses the others' pulls; it cannot read the grants itself)."""
        bus = self._bus
        sets = await bus.router.sets()
        capabilities: set[str] = set(self.capabilities)
        if bus.isolated is None:
            capabilities = granted(await bus.redis.hgetall(bus.keys.grants), self.agent, capabilities)
        self.sets = {sid: caps for sid, caps in sets.items() if serves(capabilities, caps)}

    def due(self, bell: bytes) -> bool:
        """Whether to look at the sets now: the agent's doorbell rang (requesters ring it for
        routed work), work was left at the last look, or a while has passed."""
        if not self.sets:
            return False
        rung, self._bell = bell != self._bell, bell
        return rung or bool(self._waiting) or time.monotonic() - self._looked > RELOOK

    async def pull(self, count: int) -> list[Delivery]:
        """Take up to ``count`` routed handoffs into this worker's hands."""
        bus = self._bus
        self._looked = now = time.monotonic()
        sids = sorted(sid for sid in self.sets if self._refused.get(sid, 0.0) <= now)
        if not sids or count <= 0:
            return []
        # share the free slots among the sets, starting with a different one each time, and with
        # those that had work left at the last look: with fewer slots than sets only some are
        # asked, and the sets left out are asked for what those could not give, so that a
        # backlog in one set never waits on a look at the empty others
        self._turn = (self._turn + 1) % len(sids)
        sids = sids[self._turn:] + sids[:self._turn]
        sids.sort(key=lambda sid: sid not in self._waiting)  # stable: the rotation holds within each
        pulled: list[tuple[str, str, int]] = []  # (set id, handoff id, when it was chosen)
        while sids and len(pulled) < count:
            want = count - len(pulled)
            quota = {sid: want // len(sids) + (1 if i < want % len(sids) else 0) for i, sid in enumerate(sids)}
            pulled += await self._claim([sid for sid in sids if quota[sid] > 0], quota, now)
            sids = [sid for sid in sids if quota[sid] == 0]
        if not pulled:
            return []
        offers = await bus.scripts_many([bus.router.assign_call(hid, self.agent, at) for _, hid, at in pulled])
        mine = [hid for (_, hid, _), r in zip(pulled, offers, strict=True)
                if not isinstance(r, BaseException) and int(r[0]) == 1]
        # admit what was offered to us, and release the claims assign answered, in one round
        # trip: a claim is done with once its handoff is in the inbox, or decided or offered
        # elsewhere meanwhile (if the admit fails, the offer lapses and the sweep routes the
        # handoff again). A claim whose assign failed stays, to lapse back into the queue (`pull`
        # puts it back); a stale one is dropped by routing it again.
        acks: dict[str, list[Any]] = {}
        stale: list[Reroute] = []
        for (sid, hid, _), offer in zip(pulled, offers, strict=True):
            if isinstance(offer, BaseException):
                continue
            if int(offer[0]) == 2:
                # the record says this agent refused it or is deferred: the queue's copy was stale
                # (a route call raced the refusal); route it again from the record once the claim
                # is gone. A record that cannot be read so is released instead: pulled again, it
                # would only come back here; it waits in its record for its deadline
                item = Reroute.read(offer[2:9], f"{self.consumer}: a stale routed handoff")
                if item is not None:
                    stale.append(item)
                    continue
            acks.setdefault(sid, []).append(hid)
        calls: list[tuple[str, list[str], list[Any]]] = [
            ("pull", bus.keys.route(sid).as_list(), [self.agent, 0, 0, 0, *hids]) for sid, hids in acks.items()
        ]
        if mine:
            calls.append(("admit", bus.keys.target(self.agent).as_list(), [GROUP, self.consumer, *mine]))
        replies = await bus.scripts_many(calls)
        for reply in replies:
            if isinstance(reply, BaseException):
                raise reply
        if stale and bus.isolated is None:  # an isolated agent's forwarder does it
            await bus.router.reroute(stale)
        if not mine:
            return []
        admitted = replies[-1]
        return [Delivery(handoff_id=admitted[i].decode(), entry_id=admitted[i + 1].decode())
                for i in range(0, len(admitted), 2)]

    async def _claim(self, asked: list[str], quota: dict[str, int], now: float) -> list[tuple[str, str, int]]:
        """Claim up to ``quota`` queued handoffs in each set ``asked``, in one round trip:
        (set id, handoff id, when it was chosen) of each."""
        bus, config = self._bus, self._bus.config
        replies = await bus.scripts_many([
            ("pull", bus.keys.route(sid).as_list(),
             [self.agent, quota[sid], int(config.route_claim * 1000), SCAN]) for sid in asked
        ])
        pulled: list[tuple[str, str, int]] = []
        for sid, reply in zip(asked, replies, strict=True):
            if isinstance(reply, CallRefused):  # isolated, and not granted these capabilities
                if sid not in self._refused:
                    log.warning("%s: the forwarder refuses pulls from capability set %s (%s); trying it "
                                "again every %.0f s", self.consumer, self.sets[sid], reply, REFUSED_WAIT)
                self._refused[sid] = now + REFUSED_WAIT
                self._waiting.discard(sid)
                continue
            if isinstance(reply, BaseException):
                raise reply
            self._refused.pop(sid, None)
            if int(reply[0]) > 0:
                self._waiting.add(sid)
            else:
                self._waiting.discard(sid)
            pulled += [(sid, h.decode(), int(reply[1])) for h in reply[2:]]
        return pulled
