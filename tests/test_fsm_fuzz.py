"""Seeded random walk over the handoff state machine, on a real server, with handles and queues.

Complements test_state_machine.py (which compares raw state with a model under Hypothesis):
here a fixed seed drives a few hundred operations of five agents on a handful of handoffs,
including what that test leaves out: a reject with a redirect, retry and code; a repeat of
the same transition with different arguments; the target's inbox (a taken handoff sits in
the in-flight index); the expiry sweep; the requester's handles (decision() and outcome()
against the record); and the response each actor got against the entry its requester's
stream holds. Deadlines pass by what the marker's TTL lapsing means to the scripts: the
marker gone and the deadline index entry due; only ``lapse`` lets a 20 ms timeout run out,
awaited by the handle itself. ``Walk.events`` counts what each transition met (for a look at
what a seed covers).
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import anyio
import pytest

from handoffbus import HandoffBus, HandoffHandle, HandoffRequest, HandoffResponse, HandoffStatus
from handoffbus.errors import (
    HandoffbusError,
    HandoffExpired,
    InvalidTransition,
    LeaseLost,
    NotPermitted,
    RequestConflict,
)
from handoffbus.keys import GROUP
from handoffbus.models import DECISIONS, TERMINAL
from handoffbus.records import response_from_fields

from .conftest import Servers, make_bus
from .helpers import ACTIONS

S = HandoffStatus
REQUESTERS = ("r1", "r2")
TARGETS = ("t1", "t2")
AGENTS = (*REQUESTERS, *TARGETS, "x")
RIDS = ("a", "b", "c", "d", "e")
CONSUMERS = ("w1", "w2")
BUS = "bus"


@dataclass
class Model:
    handoff_id: str
    requester: str
    target: str
    request_id: str
    reason: str
    status: S = S.PENDING
    overdue: bool = False
    owner: str | None = None
    lease: str = ""  # the record's lease: the consumer that accepted it, for a worker
    place: str | None = "queue"  # where the target holds it: "queue", "inflight" or None
    # (status, actor, the response's expected fields)
    steps: list[tuple[S, str, dict[str, Any]]] = field(default_factory=list)
    responses: list[HandoffResponse] = field(default_factory=list)  # what each actor got, by step
    last_call: tuple[str, str, dict[str, Any]] | None = None
    handles: list[HandoffHandle] = field(default_factory=list)

    def move(self, status: S, actor: str, fields: dict[str, Any]) -> None:
        assert self.status not in TERMINAL
        self.status = status
        if status is S.ACCEPTED:
            self.owner = actor
        self.steps.append((status, actor, {"accepting_agent": self.owner, **fields}))
        self.place = None if status is not S.PENDING else self.place

    @property
    def last_actor(self) -> str:
        return self.steps[-1][1] if self.steps else self.requester

    def expire_if_due(self) -> bool:
        if self.status is S.PENDING and self.overdue:
            self.move(S.EXPIRED, BUS, {})
            self.responses.append(None)  # type: ignore[arg-type]  # no caller got it
            return True
        return False


async def call(coro: Any) -> tuple[Any, HandoffbusError | None]:
    try:
        return await coro, None
    except HandoffbusError as exc:
        return None, exc


class Walk:
    def __init__(self, bus: HandoffBus, rng: random.Random) -> None:
        self.bus = bus
        self.rng = rng
        self.model: dict[str, Model] = {}
        self.log: list[str] = []
        self.events: Counter[tuple[Any, ...]] = Counter()

    # ------------------------------------------------------------------ operations

    async def request(self) -> None:
        rng = self.rng
        requester, rid = rng.choice(REQUESTERS), rng.choice(RIDS)
        hid = f"{requester}/{rid}"
        m = self.model.get(hid)
        target = m.target if m else rng.choice(TARGETS)
        reason = m.reason if m else rng.choice(("x", "y"))
        conflict = m is not None and rng.random() < 0.3
        if conflict:
            reason = reason + "-other"
        request = HandoffRequest(from_agent=requester, to_agent=target, request_id=rid, reason=reason, timeout=300.0)
        self.log.append(f"request {hid} -> {target} {'conflict' if conflict else ('resubmit' if m else 'new')}")
        handle, error = await call(self.bus.client(requester).request_handoff(request))
        if m is None:
            assert error is None, f"new {hid}: {error!r}"
            self.model[hid] = m = Model(hid, requester, target, rid, reason)
            m.handles.append(handle)
            return
        if conflict:
            assert type(error) is RequestConflict, f"{hid}: conflict answered {error!r}"
            return
        assert error is None, f"resubmit {hid}: {error!r}"
        m.expire_if_due()
        if m.status is S.PENDING and m.place is None:
            m.place = "queue"
        m.handles.append(handle)

    async def lapse(self) -> None:
        """A request nobody decides, with a short timeout: its handle hears EXPIRED by the
        deadline (its read of the record expires it), and the target's queue lets it go."""
        rng = self.rng
        requester, target = rng.choice(REQUESTERS), rng.choice(TARGETS)
        rid = f"q{len(self.model)}"
        self.log.append(f"lapse {requester}/{rid} -> {target}")
        handle = await self.bus.client(requester).request_handoff(
            HandoffRequest(from_agent=requester, to_agent=target, request_id=rid, reason="x", timeout=0.02))
        self.model[handle.handoff_id] = m = Model(handle.handoff_id, requester, target, rid, "x", overdue=True)
        m.handles.append(handle)
        with anyio.fail_after(5):
            decision = await handle.decision()
        m.expire_if_due()
        self.check_response(m, 0, decision, what="decision")

    async def transition(self, action: str | None = None, actor: str | None = None, *,
                         repeat: bool = False) -> None:
        rng = self.rng
        if not self.model:
            return
        live = sorted(h for h, m in self.model.items() if m.status not in TERMINAL)
        m = self.model[rng.choice(live if live and rng.random() < 0.8 else sorted(self.model))]
        lease = ""
        if repeat:
            if m.last_call is None:
                return
            action, actor, kwargs = m.last_call
            kwargs = dict(kwargs)
            lease = kwargs.pop("lease", "")
            if action == "reject" and rng.random() < 0.5:  # the same transition, other details
                kwargs = {"reason": "again"}
        else:
            action = rng.choice(sorted(ACTIONS))
            who = ACTIONS[action][2]
            rightful = {"target": m.target, "owner": m.owner or m.target, "requester": m.requester}[who]
            actor = rightful if rng.random() < 0.6 else rng.choice(AGENTS)
            kwargs = {}
            if action == "reject":
                kwargs = {"reason": rng.choice(("busy", "no"))}
                if rng.random() < 0.5:
                    kwargs["redirect_to"] = rng.choice(TARGETS)
                if rng.random() < 0.3:
                    kwargs["code"] = "BUSY"
                    kwargs["retry_after_ms"] = 250
            elif action == "complete":
                kwargs = {"result": {"n": rng.randint(0, 9)}}
            elif action == "fail":
                kwargs = {"error": rng.choice(("boom", "bang"))}
            elif action == "cancel" and rng.random() < 0.5:
                kwargs = {"reason": "changed my mind"}
            if action in ("accept", "complete", "fail") and rng.random() < 0.5:
                lease = rng.choice(CONSUMERS)  # as a worker: under its consumer's lease
        assert action is not None and actor is not None
        self.log.append(f"{action} {m.handoff_id} by {actor}{'@' + lease if lease else ''} {kwargs} "
                        f"(model {m.status}{' overdue' if m.overdue else ''}, lease {m.lease!r})")
        client = self.bus.client(actor)
        if lease:  # what a worker sends (steps.py), settled at once here
            fields = {"accept": lambda: {}, "complete": lambda: {"result": self.bus.codec.dumps_value(
                kwargs["result"]) if kwargs.get("result") is not None else None},
                "fail": lambda: {"error": kwargs["error"]}}[action]()
            full = dict(kwargs)

            async def as_worker() -> HandoffResponse:
                done = await client._transit(action, m.handoff_id, {**fields, "lease": lease})
                return done.response(self.bus.codec) if hasattr(done, "response") else done

            response, error = await call(as_worker())
        else:
            method = getattr(client, f"{action}_handoff")
            args = [kwargs.pop("reason")] if action == "reject" else ([kwargs.pop("error")] if action == "fail" else [])
            full = dict(kwargs, **({"reason": args[0]} if action == "reject" else {}),
                        **({"error": args[0]} if action == "fail" else {}))
            response, error = await call(method(m.handoff_id, *args, **kwargs))
        where = self.log[-1]
        self.events[(action, m.status.value + ("*" if m.overdue else ""), type(error).__name__ if error else "ok",
                     bool(lease))] += 1

        status, allowed_from, who = ACTIONS[action]
        if m.expire_if_due():
            assert type(error) is HandoffExpired, f"{where}: {error!r}"
            return
        if m.status is status and m.last_actor == actor and m.lease == lease:
            assert error is None, f"{where}: a repeat raised {error!r}"
            assert response == m.responses[-1], f"{where}: repeat answered {response} != {m.responses[-1]}"
            return
        if m.status not in allowed_from:
            expected = HandoffExpired if m.status is S.EXPIRED else InvalidTransition
            assert type(error) is expected, f"{where}: expected {expected.__name__}, got {error!r}"
            if type(error) is InvalidTransition:
                assert error.current == m.status.value
                assert error.owner == (m.owner if actor in (m.owner, m.requester) else None), where
            return
        allowed = {"target": m.target, "owner": m.owner, "requester": m.requester}[who] == actor
        if not allowed:
            assert type(error) is NotPermitted, f"{where}: expected NotPermitted, got {error!r}"
            return
        if who == "owner" and m.lease != lease:
            assert type(error) is LeaseLost, f"{where}: expected LeaseLost, got {error!r}"
            assert error.holder == m.lease, where
            return
        assert error is None, f"{where}: expected {status}, got {error!r}"
        expect: dict[str, Any] = {}
        if action == "reject":
            expect = {"rejection_reason": full["reason"], "redirect_to_agent": full.get("redirect_to"),
                      "rejection_code": full.get("code"), "retry_after_ms": full.get("retry_after_ms")}
        elif action == "complete":
            expect = {"result": full.get("result")}
        elif action == "fail":
            expect = {"error": full["error"]}
        elif action == "cancel":
            expect = {"rejection_reason": full.get("reason")}
        m.move(status, actor, expect)
        if action == "accept":
            m.lease = lease
        m.responses.append(response)
        m.last_call = (action, actor, dict(full, **({"lease": lease} if lease else {})))
        self.check_response(m, len(m.steps) - 1, response)

    async def overdue(self) -> None:
        """The acceptance deadline passes: the marker is gone and the index entry is due."""
        pending = [m for m in self.model.values() if m.status is S.PENDING and not m.overdue]
        if not pending:
            return
        m = self.rng.choice(sorted(pending, key=lambda m: m.handoff_id))
        self.log.append(f"overdue {m.handoff_id}")
        keys = self.bus.keys.record(m.requester, m.request_id)
        assert await self.bus.redis.delete(keys.marker) == 1
        await self.bus.redis.zadd(keys.deadlines, {m.request_id: 1}, xx=True)
        m.overdue = True

    async def sweep(self) -> None:
        self.log.append("sweep")
        due = [m for m in self.model.values() if m.status is S.PENDING and m.overdue]
        expired = await self.bus.sweeper.sweep_once()
        assert expired == len(due), f"sweep expired {expired}, model {len(due)}"
        for m in due:
            m.expire_if_due()

    async def read(self) -> None:
        if not self.model:
            return
        m = self.model[self.rng.choice(sorted(self.model))]
        reader = self.rng.choice(AGENTS)
        self.log.append(f"read {m.handoff_id} by {reader}")
        record = await self.bus.client(reader).get_handoff_status(m.handoff_id)
        m.expire_if_due()
        assert record is not None
        assert record.status is m.status, f"{m.handoff_id}: read {record.status}, model {m.status}"

    async def take(self) -> None:
        target = self.rng.choice(TARGETS)
        self.log.append(f"take {target}")
        await self.bus.register_target(target)
        reply = await self.bus.script("take", self.bus.keys.target(target).as_list(), [GROUP, "w1", 1])
        taken = [h.decode() for h in reply[1::2]]
        queued = [m.handoff_id for m in self.model.values() if m.target == target and m.place == "queue"]
        assert len(taken) == min(1, len(queued)), f"take {target}: took {taken}, model queued {queued}"
        for hid in taken:
            assert hid in queued, f"take {target}: took {hid}, model queued {queued}"
            self.model[hid].place = "inflight"

    async def await_handle(self) -> None:
        decided = [m for m in self.model.values() if m.status is not S.PENDING or m.overdue]
        if not decided:
            return
        m = self.rng.choice(sorted(decided, key=lambda m: m.handoff_id))
        # a handle already held waits for the deadline it was told (300 s): one made overdue
        # here is found out by a handle that reads the record first
        fresh = self.rng.random() < 0.5 or (m.status is S.PENDING and m.overdue)
        handle = self.bus.client(m.requester).handle(m.handoff_id) if fresh else self.rng.choice(m.handles)
        self.log.append(f"await {m.handoff_id} ({'new handle' if fresh else 'its handle'})")
        with anyio.fail_after(10):
            decision = await handle.decision()
        m.expire_if_due()
        first = next(i for i, (status, _, _) in enumerate(m.steps) if status in DECISIONS)
        self.check_response(m, first, decision, what="decision")
        if m.status in TERMINAL:
            with anyio.fail_after(10):
                outcome = await handle.outcome()
            self.check_response(m, len(m.steps) - 1, outcome, what="outcome")

    # ------------------------------------------------------------------ checks

    def check_response(self, m: Model, index: int, got: HandoffResponse, what: str = "response") -> None:
        status, actor, fields = m.steps[index]
        where = f"{m.handoff_id} {what} of step {index} ({status} by {actor}); after {self.log[-1]}"
        assert got.handoff_id == m.handoff_id and got.status is status and got.actor == actor, f"{where}: {got}"
        for name, value in fields.items():
            assert getattr(got, name) == value, f"{where}: {name} {getattr(got, name)!r} != {value!r} in {got}"
        known = m.responses[index] if index < len(m.responses) else None
        if known is not None and what != "response":
            assert got == known, f"{where}: {got} != what its actor got, {known}"

    async def check(self) -> None:
        bus = self.bus
        async with bus.redis.pipeline(transaction=False) as pipe:
            models = list(self.model.values())
            for m in models:
                keys = bus.keys.record(m.requester, m.request_id)
                target = bus.keys.target(m.target)
                pipe.hmget(keys.record, "status", "lease")
                pipe.exists(keys.marker)
                pipe.zscore(keys.deadlines, m.request_id)
                pipe.zscore(target.queue, m.handoff_id)
                pipe.hexists(target.inflight, m.handoff_id)
            for r in REQUESTERS:
                pipe.xrange(bus.keys.responses(r))
            replies = await pipe.execute()
        for i, m in enumerate(models):
            (status, lease), marker, deadline, queued, inflight = replies[5 * i:5 * i + 5]
            where = f"{m.handoff_id} (model {m.status}{'*' if m.overdue else ''}, {m.place}) after {self.log[-1]}"
            assert status.decode() == m.status.value, f"{where}: stored {status}"
            assert (lease or b"").decode() == m.lease, f"{where}: lease {lease}"
            assert bool(marker) == (m.status is S.PENDING and not m.overdue), f"{where}: marker {marker}"
            assert (deadline is not None) == (m.status is S.PENDING), f"{where}: deadline index {deadline}"
            assert (queued is not None) == (m.place == "queue"), f"{where}: queued {queued}"
            assert bool(inflight) == (m.place == "inflight"), f"{where}: in flight {inflight}"
        entries: dict[str, list[HandoffResponse]] = {}
        for r, stream in zip(REQUESTERS, replies[5 * len(models):], strict=True):
            for _id, fields in stream:
                hid = fields[b"id"].decode()
                assert hid.startswith(r + "/"), f"{hid} on {r}'s stream"
                entries.setdefault(hid, []).append(response_from_fields(hid, fields, bus.codec))
        for m in models:
            got = entries.get(m.handoff_id, [])
            assert len(got) == len(m.steps), (
                f"{m.handoff_id}: {len(got)} responses {[(r.status, r.actor) for r in got]} for "
                f"{[(s, a) for s, a, _ in m.steps]} after {self.log[-1]}")
            for index, response in enumerate(got):
                self.check_response(m, index, response, what="stream entry")


OPERATIONS = (
    ("request", 4), ("transition", 10), ("repeat", 3), ("overdue", 2), ("sweep", 1), ("read", 2), ("take", 3),
    ("await_handle", 2), ("lapse", 0.3),
)


async def walk(bus: HandoffBus, seed: int, steps: int) -> Walk:
    w = Walk(bus, random.Random(seed))
    names = [name for name, _ in OPERATIONS]
    weights = [weight for _, weight in OPERATIONS]
    try:
        for _ in range(steps):
            name = w.rng.choices(names, weights)[0]
            if name == "repeat":
                await w.transition(repeat=True)
            else:
                await getattr(w, name)()
            await w.check()
    except BaseException:
        print("\n".join(w.log[-40:]))
        raise
    return w


@pytest.mark.anyio
@pytest.mark.parametrize("seed", range(12))
async def test_random_walk_of_the_state_machine(servers: Servers, seed: int) -> None:
    async with make_bus("valkey", servers, sweep_interval=3600.0) as bus:
        if bus.sweeper.passes == 0:  # its first pass, at the start: then it waits an hour
            await bus.sweeper.wait_pass()
        try:
            await walk(bus, seed, 300)
        finally:
            await bus.clear(confirm=bus.keys.prefix)
