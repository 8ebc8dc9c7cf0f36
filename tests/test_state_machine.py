"""Stateful property test: the handoff state machine on a real server against a pure-Python model.

Hypothesis drives three agents that request, accept, reject, complete, fail and cancel
handoffs, re-submit request ids, read statuses, and make PENDING handoffs overdue. Every
call's outcome (its status, or the exact exception class) is compared with a model that
follows ``run_transition`` in ``handoffbus/lua/includes/record.lua`` check by check:

1. no record                               -> HandoffNotFound
2. PENDING and the marker is gone          -> made EXPIRED (actor "bus"), HandoffExpired
3. the same actor already made it          -> the same response again, nothing emitted
4. the status does not allow it            -> HandoffExpired if EXPIRED, else InvalidTransition
   (so anything on a terminal handoff, or completing a PENDING one, is refused by status)
5. the actor may not make this transition  -> NotPermitted
   (target: the to_agent; owner: the accepting agent; requester: the from_agent)
6. otherwise the transition is made and one response is emitted

Overdue is made by deleting the pending marker, which is what its TTL lapsing means to the
scripts; timeouts are long enough that nothing expires by the clock, and nothing sleeps.
After every step the raw Redis state (read without running a script, so without expiring
anything) is compared with the model: records, histories, markers, deadline index, target
queues and the requesters' response streams.
"""

from __future__ import annotations

import functools
import itertools
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import anyio.from_thread
import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    invariant,
    multiple,
    precondition,
    rule,
    run_state_machine_as_test,
)

from handoffbus import HandoffBus
from handoffbus.errors import (
    HandoffbusError,
    HandoffExpired,
    HandoffNotFound,
    InvalidTransition,
    NotPermitted,
    RequestConflict,
)
from handoffbus.models import DECISIONS, TERMINAL, HandoffRecord, HandoffRequest, HandoffResponse, HandoffStatus
from handoffbus.records import record_from_hash

from .conftest import SERVER_BINARIES, Servers, start_server
from .helpers import ACTIONS, req

S = HandoffStatus
AGENTS = ("a1", "a2", "a3")
TIMEOUT = 300.0  # seconds: nothing expires by the clock during a run
BUS_ACTOR = "bus"  # the actor of an EXPIRED transition
REASONS = ("", "help", "review")
# an actor drawn for a transition: about half the time the agent entitled to make it
RIGHTFUL = "rightful"
ACTORS = st.sampled_from((RIGHTFUL, *AGENTS))
# few handoffs per run, so that runs go deep into each one's life rather than wide
MAX_HANDOFFS = 5

REJECT_REASON = "busy"
RESULT = {"ok": True, "n": 3}
FAIL_ERROR = "boom"

_runs = itertools.count()


# ---------------------------------------------------------------------------- the model


@dataclass(frozen=True)
class Expect:
    """What a transition call should do: ``status`` on success, else raise ``error``."""

    status: S | None = None
    repeat: bool = False
    error: type[HandoffbusError] | None = None
    current: S | None = None  # InvalidTransition.current


@dataclass
class ModelHandoff:
    handoff_id: str
    requester: str
    target: str
    request_id: str
    reason: str
    status: S = S.PENDING  # the status stored in Redis (not yet expired while the marker is merely gone)
    marker_gone: bool = False
    owner: str | None = None  # the record's "agent" field: who accepted
    transitions: list[tuple[S, str]] = field(default_factory=list)  # history: (status, actor)
    last_response: HandoffResponse | None = None  # what the client got for the last transition it made

    def __post_init__(self) -> None:
        self.transitions.append((S.PENDING, self.requester))

    @property
    def last_actor(self) -> str:
        return self.transitions[-1][1]

    def move(self, status: S, actor: str) -> None:
        assert self.status not in TERMINAL, f"model bug: {self.handoff_id} leaves terminal {self.status}"
        self.status = status
        self.transitions.append((status, actor))
        if status is S.ACCEPTED:
            self.owner = actor

    def expire_if_due(self) -> bool:
        """Any script touching the handoff expires it if it is PENDING and its marker is gone."""
        if self.status is S.PENDING and self.marker_gone:
            self.move(S.EXPIRED, BUS_ACTOR)
            return True
        return False

    def attempt(self, action: str, actor: str) -> Expect:
        """Apply ``action`` by ``actor`` to the model; return what the client call should do."""
        status, allowed_from, who = ACTIONS[action]
        if self.expire_if_due():
            return Expect(error=HandoffExpired, current=S.EXPIRED)
        if self.status is status and self.last_actor == actor:
            return Expect(status=status, repeat=True)
        # the status decides before the actor's right: anything on a terminal handoff is invalid
        if self.status not in allowed_from:
            if self.status is S.EXPIRED:
                return Expect(error=HandoffExpired, current=S.EXPIRED)
            return Expect(error=InvalidTransition, current=self.status)
        if who == "target":
            allowed = self.target == actor
        elif who == "owner":
            allowed = self.owner == actor
        else:
            allowed = self.requester == actor
        if not allowed:
            return Expect(error=NotPermitted)
        self.move(status, actor)
        return Expect(status=status)


# ---------------------------------------------------------------------------- calls on the bus


async def _act(bus: HandoffBus, action: str, actor: str, handoff_id: str) -> HandoffResponse:
    client = bus.client(actor)
    if action == "accept":
        return await client.accept_handoff(handoff_id)
    if action == "reject":
        return await client.reject_handoff(handoff_id, REJECT_REASON)
    if action == "complete":
        return await client.complete_handoff(handoff_id, result=RESULT)
    if action == "fail":
        return await client.fail_handoff(handoff_id, FAIL_ERROR)
    assert action == "cancel"
    return await client.cancel_handoff(handoff_id)


async def _request(bus: HandoffBus, request: HandoffRequest) -> str:
    handle = await bus.client(request.from_agent).request_handoff(request)
    return handle.handoff_id


@dataclass(frozen=True)
class Stored:
    """What Redis holds for one handoff, read without running a script."""

    record: HandoffRecord | None
    marker: bool
    deadline_indexed: bool
    queued: bool


async def _snapshot(
    bus: HandoffBus, handoffs: list[ModelHandoff]
) -> tuple[dict[str, Stored], dict[str, list[dict[bytes, bytes]]]]:
    """Every model handoff's stored state and every agent's response stream, in one round trip."""
    async with bus.redis.pipeline(transaction=False) as pipe:
        for m in handoffs:
            keys = bus.keys.record(m.requester, m.request_id)
            pipe.hgetall(keys.record)
            pipe.get(keys.envelope)
            pipe.exists(keys.marker)
            pipe.zscore(keys.deadlines, m.request_id)
            pipe.zscore(bus.keys.target(m.target).queue, m.handoff_id)
        for agent in AGENTS:
            pipe.xrange(bus.keys.responses(agent))
        replies = await pipe.execute()
    stored = {}
    for i, m in enumerate(handoffs):
        fields, envelope, marker, deadline, queued = replies[5 * i : 5 * i + 5]
        assert (envelope is None) == (not fields), f"{m.handoff_id}: record and envelope live and go together"
        stored[m.handoff_id] = Stored(
            record=record_from_hash({**fields, b"env": envelope}, bus.codec) if fields else None,
            marker=bool(marker),
            deadline_indexed=deadline is not None,
            queued=queued is not None,
        )
    streams = {
        agent: [entry for _id, entry in reply]
        for agent, reply in zip(AGENTS, replies[5 * len(handoffs) :], strict=True)
    }
    return stored, streams


# ---------------------------------------------------------------------------- the machine


class HandoffMachine(RuleBasedStateMachine):
    handoffs = Bundle("handoffs")

    def __init__(self, url: str) -> None:
        super().__init__()
        self.prefix = f"sm{next(_runs)}-{uuid.uuid4().hex[:8]}"
        self.model: dict[str, ModelHandoff] = {}
        self.terminal_seen: dict[str, S] = {}
        self._portal_cm = anyio.from_thread.start_blocking_portal(backend="asyncio")
        self.portal = self._portal_cm.__enter__()
        try:
            # a long sweep interval: the sweep never has anything due anyway (deadlines are far away)
            self._bus_cm = self.portal.wrap_async_context_manager(
                HandoffBus.connect(url, prefix=self.prefix, sweep_interval=60.0)
            )
            self.bus = self._bus_cm.__enter__()
        except BaseException:
            self._portal_cm.__exit__(None, None, None)
            raise

    def teardown(self) -> None:
        try:
            self.portal.call(functools.partial(self.bus.clear, confirm=self.prefix))
        finally:
            try:
                self._bus_cm.__exit__(None, None, None)
            finally:
                self._portal_cm.__exit__(None, None, None)

    # -------------------------------------------------------------- helpers

    def call(self, func: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[Any, HandoffbusError | None]:
        """Run an async call in the portal; return (result, None) or (None, the handoffbus error)."""
        try:
            return self.portal.call(functools.partial(func, *args, **kwargs)), None
        except HandoffbusError as exc:
            return None, exc

    def check_record(self, record: HandoffRecord | None, m: ModelHandoff) -> None:
        assert record is not None, f"{m.handoff_id}: record missing"
        assert record.handoff_id == m.handoff_id
        assert record.status is m.status, f"{m.handoff_id}: stored {record.status}, model {m.status}"
        history = [(h.status, h.actor) for h in record.history]
        assert history == m.transitions, f"{m.handoff_id}: history {history} != model {m.transitions}"
        stamps = [h.at_ms for h in record.history]
        assert stamps == sorted(stamps), f"{m.handoff_id}: history timestamps go back: {stamps}"
        assert record.created_ms == stamps[0] and record.updated_ms == stamps[-1]
        assert record.response.status is m.status and record.response.actor == m.last_actor
        request = record.request
        assert (request.from_agent, request.to_agent, request.request_id, request.reason) == (
            m.requester,
            m.target,
            m.request_id,
            m.reason,
        )

    def request_for(self, m: ModelHandoff, reason: str | None = None) -> HandoffRequest:
        return HandoffRequest(
            from_agent=m.requester,
            to_agent=m.target,
            request_id=m.request_id,
            reason=m.reason if reason is None else reason,
            timeout=TIMEOUT,
        )

    # -------------------------------------------------------------- rules

    @precondition(lambda self: len(self.model) < MAX_HANDOFFS)
    @rule(
        target=handoffs,
        requester=st.sampled_from(AGENTS),
        offset=st.integers(1, len(AGENTS) - 1),
        request_id=st.text("abc012", min_size=1, max_size=3).map(lambda s: f"r-{s}"),
        reason=st.sampled_from(REASONS),
    )
    def request(self, requester: str, offset: int, request_id: str, reason: str) -> Any:
        """A request with a drawn id: usually fresh; a repeated id is a re-submission or a conflict."""
        target = AGENTS[(AGENTS.index(requester) + offset) % len(AGENTS)]
        handoff_id = f"{requester}/{request_id}"
        existing = self.model.get(handoff_id)
        new = ModelHandoff(handoff_id, requester, target, request_id, reason)
        got, error = self.call(_request, self.bus, self.request_for(new))
        if existing is None:
            assert error is None, f"new request {handoff_id} raised {error!r}"
            assert got == handoff_id
            self.model[handoff_id] = new
            return handoff_id
        if (existing.target, existing.reason) == (target, reason):
            event(f"request re-submitted on {existing.status}{' (overdue)' if existing.marker_gone else ''}")
            existing.expire_if_due()
            assert error is None, f"re-submission of {handoff_id} raised {error!r}"
            assert got == handoff_id
        else:
            # the conflict is found before the deadline is looked at: nothing changes
            assert type(error) is RequestConflict, f"conflicting re-use of {handoff_id}: {error!r}"
        return multiple()

    @rule(handoff_id=handoffs)
    def resubmit(self, handoff_id: str) -> None:
        """The same request again: the same handoff, no new record (expired first if overdue)."""
        m = self.model[handoff_id]
        event(f"re-submit on {m.status}{' (overdue)' if m.marker_gone else ''}")
        m.expire_if_due()
        got, error = self.call(_request, self.bus, self.request_for(m))
        assert error is None, f"re-submission of {handoff_id} raised {error!r}"
        assert got == handoff_id

    @rule(handoff_id=handoffs, reason=st.sampled_from(REASONS))
    def conflicting_request(self, handoff_id: str, reason: str) -> None:
        """The same request id with different content is refused and changes nothing."""
        m = self.model[handoff_id]
        _, error = self.call(_request, self.bus, self.request_for(m, reason=f"{m.reason}-other-{reason}"))
        assert type(error) is RequestConflict, f"conflicting re-use of {handoff_id}: {error!r}"

    def transition(self, action: str, handoff_id: str, actor: str) -> None:
        m = self.model[handoff_id]
        if actor == RIGHTFUL:
            actor = m.requester if ACTIONS[action][2] == "requester" else m.target
        before = m.status
        expected = m.attempt(action, actor)
        response, error = self.call(_act, self.bus, action, actor, handoff_id)
        where = f"{action} {handoff_id} by {actor} (model status {before}, owner {m.owner})"
        if expected.error is not None:
            event(f"{action} on {before}: {expected.error.__name__}")
        else:
            event(f"{action} on {before}: {'repeat' if expected.repeat else expected.status}")
        if expected.error is not None:
            assert type(error) is expected.error, f"{where}: expected {expected.error.__name__}, got {error!r}"
            if isinstance(error, InvalidTransition):
                assert error.current == expected.current, f"{where}: current {error.current} != {expected.current}"
                if type(error) is InvalidTransition:  # who accepted it, told to that agent and the requester
                    owner = m.owner if actor in (m.owner, m.requester) else None
                    assert error.owner == owner, f"{where}: owner {error.owner} != {owner}"
            return
        assert error is None, f"{where}: expected {expected.status}, got {error!r}"
        assert isinstance(response, HandoffResponse)
        if expected.repeat:
            assert response == m.last_response, f"{where}: repeated call answered {response} != {m.last_response}"
            return
        assert response.handoff_id == handoff_id
        assert response.status is expected.status and response.actor == actor, f"{where}: got {response}"
        if action == "accept":
            assert response.accepting_agent == actor
        elif action == "reject":
            assert response.rejection_reason == REJECT_REASON
        elif action == "complete":
            assert response.result == RESULT and response.accepting_agent == actor
        elif action == "fail":
            assert response.error == FAIL_ERROR and response.accepting_agent == actor
        m.last_response = response

    @rule(handoff_id=handoffs, actor=ACTORS)
    def accept(self, handoff_id: str, actor: str) -> None:
        self.transition("accept", handoff_id, actor)

    @rule(handoff_id=handoffs, actor=ACTORS)
    def reject(self, handoff_id: str, actor: str) -> None:
        self.transition("reject", handoff_id, actor)

    @rule(handoff_id=handoffs, actor=ACTORS)
    def complete(self, handoff_id: str, actor: str) -> None:
        self.transition("complete", handoff_id, actor)

    @rule(handoff_id=handoffs, actor=ACTORS)
    def fail(self, handoff_id: str, actor: str) -> None:
        self.transition("fail", handoff_id, actor)

    @rule(handoff_id=handoffs, actor=ACTORS)
    def cancel(self, handoff_id: str, actor: str) -> None:
        self.transition("cancel", handoff_id, actor)

    @rule(handoff_id=handoffs)
    def expire(self, handoff_id: str) -> None:
        """The acceptance deadline passes: the pending marker is gone (what its TTL lapsing does)."""
        m = self.model[handoff_id]
        marker = self.bus.keys.record(m.requester, m.request_id).marker
        deleted, error = self.call(self.bus.redis.delete, marker)
        assert error is None
        assert deleted == int(m.status is S.PENDING and not m.marker_gone), f"{handoff_id}: marker state"
        if m.status is S.PENDING:
            m.marker_gone = True

    @rule(handoff_id=handoffs, reader=st.sampled_from(AGENTS))
    def read_status(self, handoff_id: str, reader: str) -> None:
        """Any agent may read; a read of an overdue PENDING handoff expires it first."""
        m = self.model[handoff_id]
        event(f"read on {m.status}{' (overdue)' if m.marker_gone else ''}")
        m.expire_if_due()
        record, error = self.call(self.bus.client(reader).get_handoff_status, handoff_id)
        assert error is None, f"status of {handoff_id}: {error!r}"
        self.check_record(record, m)

    @rule(
        requester=st.sampled_from(AGENTS),
        actor=st.sampled_from(AGENTS),
        action=st.sampled_from(sorted(ACTIONS)),
    )
    def unknown_handoff(self, requester: str, actor: str, action: str) -> None:
        """No record: every transition raises HandoffNotFound, a read returns None, nothing is created."""
        handoff_id = f"{requester}/missing"
        _, error = self.call(_act, self.bus, action, actor, handoff_id)
        assert type(error) is HandoffNotFound, f"{action} of a missing handoff: {error!r}"
        record, error = self.call(self.bus.client(actor).get_handoff_status, handoff_id)
        assert error is None and record is None
        keys = self.bus.keys.record(requester, "missing")
        created, _ = self.call(self.bus.redis.exists, keys.record, keys.marker)
        assert created == 0

    # -------------------------------------------------------------- invariants

    @invariant()
    def redis_matches_model(self) -> None:
        handoffs = list(self.model.values())
        (stored, streams), error = self.call(_snapshot, self.bus, handoffs)
        assert error is None

        for m in handoffs:
            s = stored[m.handoff_id]
            self.check_record(s.record, m)
            assert s.record is not None
            # a terminal status never changes (checked on what Redis holds, not on the model)
            seen = self.terminal_seen.get(m.handoff_id)
            assert seen is None or s.record.status is seen, f"{m.handoff_id}: terminal {seen} became {s.record.status}"
            if s.record.status in TERMINAL:
                self.terminal_seen[m.handoff_id] = s.record.status
            live = m.status is S.PENDING and not m.marker_gone
            assert s.marker == live, f"{m.handoff_id}: marker {s.marker}, model live={live}"
            assert s.deadline_indexed == (m.status is S.PENDING), f"{m.handoff_id}: deadline index"
            if live:
                assert s.queued, f"{m.handoff_id}: PENDING but not in {m.target}'s queue"
            elif m.status is not S.PENDING:
                # whatever decided it (a client, or the bus expiring it on a read), it is settled
                assert not s.queued, f"{m.handoff_id}: {m.status} but still in {m.target}'s queue"

        # responses: one stream entry per transition, in order, on the requester's stream
        seen_entries: dict[str, list[tuple[S, str]]] = defaultdict(list)
        for agent, entries in streams.items():
            for entry in entries:
                handoff_id = entry[b"id"].decode()
                assert handoff_id in self.model, f"response for unknown handoff {handoff_id}"
                assert self.model[handoff_id].requester == agent, f"{handoff_id}: response on {agent}'s stream"
                seen_entries[handoff_id].append((S(entry[b"status"].decode()), entry[b"actor"].decode()))
        total = sum(len(e) for e in seen_entries.values())
        assert total == sum(len(m.transitions) - 1 for m in handoffs), "response count != transition count"
        for m in handoffs:
            got = seen_entries.get(m.handoff_id, [])
            assert got == m.transitions[1:], f"{m.handoff_id}: responses {got} != transitions {m.transitions[1:]}"
            decisions = sum(status in DECISIONS for status, _ in got)
            assert decisions == (0 if m.status is S.PENDING else 1), f"{m.handoff_id}: {decisions} decisions"
            assert sum(status in TERMINAL for status, _ in got) <= 1, f"{m.handoff_id}: several terminal responses"


SETTINGS = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


@pytest.fixture(scope="module", params=["valkey", "valkey-cluster"])
def valkey_url(request: pytest.FixtureRequest, servers: Servers) -> Iterator[str]:
    if request.param == "valkey-cluster":  # the session's three-primary cluster
        yield servers[request.param].url
        return
    server = start_server(SERVER_BINARIES["valkey"])
    try:
        yield server.url
    finally:
        server.stop()


def test_handoff_state_machine(valkey_url: str) -> None:
    class OnServer(HandoffMachine):
        def __init__(self) -> None:
            super().__init__(valkey_url)

    run_state_machine_as_test(OnServer, settings=SETTINGS)


@pytest.mark.anyio
async def test_response_metadata_belongs_to_its_transition(valkey_url: str) -> None:
    async with HandoffBus.connect(valkey_url, prefix=f"sm-meta-{uuid.uuid4().hex[:8]}") as bus:
        request = HandoffRequest(from_agent="a1", to_agent="a2", request_id="r", timeout=TIMEOUT)
        handle = await bus.client("a1").request_handoff(request)
        try:
            accepted = await bus.client("a2").accept_handoff(handle.handoff_id, metadata={"step": "accept"})
            assert accepted.metadata == {"step": "accept"}
            completed = await bus.client("a2").complete_handoff(handle.handoff_id, result=1)
            assert completed.metadata == {}
        finally:
            await bus.clear(confirm=bus.config.prefix)


@pytest.mark.anyio
async def test_a_transition_clears_the_last_ones_fields_whoever_wrote_them(real_bus: HandoffBus) -> None:
    """A transition that wrote no response fields lets the next skip clearing them (``rf``);
    fields written any other way (here, as a version before ``rf`` wrote them: by hand, with
    the status changed and ``rf`` left alone) are still cleared, never carried into the next
    transition's record."""
    a, b = real_bus.client("a"), real_bus.client("b")
    keys = real_bus.keys

    async def record(handoff_id: str) -> dict[bytes, bytes]:
        requester, request_id = handoff_id.split("/", 1)
        fields: dict[bytes, bytes] = await real_bus.redis.hgetall(keys.record(requester, request_id).record)
        return fields

    plain = await a.request_handoff(req("a", "b"))
    assert (await record(plain.handoff_id))[b"rf"] == b"PENDING"
    await b.accept_handoff(plain.handoff_id)
    assert (await record(plain.handoff_id))[b"rf"] == b"ACCEPTED"  # nothing for complete to clear
    done = await b.complete_handoff(plain.handoff_id, result="ok", metadata={"by": "b"})
    assert done.metadata == {"by": "b"} and (await record(plain.handoff_id))[b"rf"] == b""

    with_meta = await a.request_handoff(req("a", "b"))
    await b.accept_handoff(with_meta.handoff_id, metadata={"step": "accept"})
    assert (await record(with_meta.handoff_id))[b"rf"] == b""  # rmeta written: complete clears
    await b.complete_handoff(with_meta.handoff_id, result=1)
    after = await record(with_meta.handoff_id)
    assert b"rmeta" not in after and after[b"ameta"]
    assert (await a.get_handoff_status(with_meta.handoff_id)).response.metadata == {}

    by_hand = await a.request_handoff(req("a", "b"))
    await b.accept_handoff(by_hand.handoff_id)
    requester, request_id = by_hand.handoff_id.split("/", 1)
    await real_bus.redis.hset(keys.record(requester, request_id).record,
                              mapping={"reason": "stale", "rmeta": real_bus.codec.dumps_value({"stale": 1}),
                                       "status": "ACCEPTED", "rf": "PENDING"})
    await b.complete_handoff(by_hand.handoff_id, result=2)
    after = await record(by_hand.handoff_id)
    assert b"reason" not in after and b"rmeta" not in after
    status = await a.get_handoff_status(by_hand.handoff_id)
    assert status.response.metadata == {} and status.response.rejection_reason is None
