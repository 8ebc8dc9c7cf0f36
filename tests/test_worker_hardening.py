"""What a worker, the router and the sweep meet that no well-behaved writer leaves: records and
queue entries written by hand, hooks that return or raise odd things, replies lost on the
wire. Each is dropped, refused or recorded as the handoff's outcome; none stops the process
that met it, nor strands a handoff."""

from __future__ import annotations

import datetime
import logging
import os
from typing import Any

import anyio
import msgspec
import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from handoffbus import DecodeError, HandoffBus, HandoffRequest, HandoffStatus, InvalidRequest, Worker
from handoffbus.forwarding import Forwarder
from handoffbus.keys import GROUP
from handoffbus.policies.policy import RESOLUTION_KEY
from handoffbus.policies.scenario import HandoffResolution
from handoffbus.routing import Reroute, set_id
from handoffbus.workers import Accept, ReceivedHandoff, Reject, RetryPolicy
from handoffbus.workers.inbox import Inbox

from .agents import Echo
from .helpers import live, req, routed, serve_until_done, serving

pytestmark = pytest.mark.anyio


class Capable(Echo):
    """Serves routed work of capability x."""

    agent_id = "capable-1"
    capabilities = ["x"]


async def tamper(bus: HandoffBus, handoff_id: str, **fields: str) -> None:
    """Write fields of a record as its requester may: anything, in its own slot."""
    await bus.redis.hset(bus.keys.record(*handoff_id.split("/")).record, mapping=fields)


def mallorys(**kw: Any) -> HandoffRequest:
    """A routed request (capability x) from a requester that then writes its record by hand."""
    return HandoffRequest(from_agent="mallory", to_agent="", reason="r", capabilities_required=["x"], **kw)


# ---------------------------------------------------------------- routed records not as written


async def test_a_stale_routed_record_not_as_written_stops_no_worker(bus: HandoffBus) -> None:
    """Its requester made the record say the agent refused it, with a priority that is no
    number: the pull's assign answers 'stale, route it again', and the record cannot be read
    for that. The claim is let go; the honest handoff behind it is served."""
    bad = await bus.client("mallory").request_handoff(mallorys(priority=-5))
    await tamper(bus, bad.handoff_id, refused=f",{Capable.agent_id},", prio="x")
    good = await bus.client("req").request_handoff(routed(["x"]))
    async with serving(bus, Capable()):
        with anyio.fail_after(10):
            assert (await good.outcome()).status is HandoffStatus.COMPLETED
    route = bus.keys.route(set_id("x"))
    assert await bus.redis.zscore(route.claims, bad.handoff_id) is None  # not left to lapse back
    record = await bus.client("mallory").get_handoff_status(bad.handoff_id)
    assert record is not None and record.status is HandoffStatus.PENDING  # to expire at its deadline


async def test_the_forwarder_runs_on_after_an_assign_of_a_record_not_as_written(bus: HandoffBus) -> None:
    bad = await bus.client("mallory").request_handoff(mallorys())
    await tamper(bus, bad.handoff_id, refused=f",{Capable.agent_id},", prio="x")
    call = bus.router.assign_call(bad.handoff_id, Capable.agent_id)
    reply = await bus.script(*call)
    assert int(reply[0]) == 2  # stale: the record says the agent refused it
    await Forwarder(bus, [Capable.agent_id])._after(Capable.agent_id, call, reply)  # neither raises


async def test_a_redirect_to_a_refuser_with_a_record_not_as_written_is_dropped(bus: HandoffBus) -> None:
    await live(bus, "expert-1", "e1")
    bad = await bus.client("mallory").request_handoff(mallorys())
    await tamper(bus, bad.handoff_id, refused=",expert-1,", prio="x")
    item = Reroute(bad.handoff_id, "x", 0, 0, 2**40, ",", ",", redirect="expert-1")
    assert await bus.router.reroute([item]) == [None]  # stays PENDING, until its deadline


async def test_a_routed_refusal_of_a_record_not_as_written_is_answered(bus: HandoffBus) -> None:
    bad = await bus.client("mallory").request_handoff(mallorys())
    assert int((await bus.script(*bus.router.assign_call(bad.handoff_id, "b")))[0]) == 1
    await tamper(bus, bad.handoff_id, prio="x")
    refused = await bus.client("b").reject_handoff(bad.handoff_id, "not mine")
    assert refused.status is HandoffStatus.PENDING


def test_reroute_read_drops_what_cannot_be_routed(caplog: pytest.LogCaptureFixture) -> None:
    good = [b"a/r1", b"x", b"0", b"1", b"2", b",", b""]
    assert Reroute.read(good, "test") == Reroute("a/r1", "x", 0, 1, 2, ",", ",")
    with caplog.at_level(logging.WARNING, "handoffbus"):
        assert Reroute.read([b"a/r2", b"x", b"x", b"1", b"2", b",", b","], "test") is None
        assert Reroute.read([b"a/r3", b"x", b"\xff", b"1", b"2", b",", b","], "test") is None
        assert Reroute.read([b"a/r4"], "test") is None
    assert [r.getMessage().split(" cannot")[0] for r in caplog.records] == [
        "test: handoff 'a/r2'", "test: handoff 'a/r3'", "test: handoff 'a/r4'"]


# ---------------------------------------------------------------- hooks that misbehave


class ToolError(Exception):
    """An exception whose ``__str__`` raises: it reads an attribute its ``__init__`` never set."""

    def __init__(self, code: int, *, no_repr: bool = False) -> None:
        self.code, self.no_repr = code, no_repr

    def __str__(self) -> str:
        return f"tool error {self.code}: {self.detail}"  # type: ignore[attr-defined]

    def __repr__(self) -> str:
        if self.no_repr:
            raise RuntimeError("no repr either")
        return f"ToolError({self.code})"


class RaisesOddly(Echo):
    agent_id = "odd-1"

    def __init__(self, *, in_decide: bool = False) -> None:
        super().__init__()
        self.in_decide = in_decide
        self.runs: list[int] = []

    async def on_handoff_request(self, request: HandoffRequest) -> Any:
        if self.in_decide:
            raise ToolError(3, no_repr=True)
        return Accept()

    async def on_handoff_received(self, handoff: ReceivedHandoff) -> Any:
        self.runs.append(handoff.attempt)
        raise ToolError(7)


async def test_a_work_hook_raising_an_exception_that_cannot_be_shown_fails_its_handoff(bus: HandoffBus) -> None:
    agent = RaisesOddly()
    handle = await bus.client("req").request_handoff(req("req", agent.agent_id))
    async with serving(bus, agent, reclaim_idle=60):  # failed now, not after a reclaim
        with anyio.fail_after(10):
            outcome = await handle.outcome()
    assert outcome.status is HandoffStatus.FAILED and outcome.error == "ToolError: ToolError(7)"
    assert agent.runs == [1]


async def test_an_acceptance_hook_raising_an_exception_that_cannot_be_shown_is_a_hook_failure(
        bus: HandoffBus) -> None:
    agent = RaisesOddly(in_decide=True)
    handle = await bus.client("req").request_handoff(req("req", agent.agent_id))
    async with serving(bus, agent):
        with anyio.fail_after(10):
            outcome = await handle.outcome()
    assert outcome.status is HandoffStatus.REJECTED and outcome.rejection_code == "HOOK_FAILED"
    assert outcome.rejection_reason == "acceptance hook failed: ToolError"
    assert agent.runs == []


class AcceptsWithAList(Echo):
    agent_id = "listy-1"

    async def on_handoff_request(self, request: HandoffRequest) -> Any:
        return Accept(metadata=["not", "a", "map"])  # type: ignore[arg-type]  # msgspec does not check it


async def test_an_accept_whose_metadata_is_not_a_map_is_a_hook_failure(bus: HandoffBus) -> None:
    agent = AcceptsWithAList()
    handle = await bus.client("req").request_handoff(req("req", agent.agent_id))
    async with serving(bus, agent, reclaim_idle=60):
        with anyio.fail_after(10):
            outcome = await handle.outcome()
    assert outcome.status is HandoffStatus.REJECTED and outcome.rejection_code == "HOOK_FAILED"
    assert outcome.rejection_reason == "acceptance hook returned an invalid Accept: metadata must be a dict, not list"
    assert agent.order == []  # the work hook never ran


# ---------------------------------------------------------------- settings


class RetriesAsANumber(Echo):
    retry = 3  # type: ignore[assignment]  # meant: RetryPolicy(attempts=3)


@pytest.mark.parametrize("settings", [
    {"concurrency": 2.5}, {"concurrency": "4"}, {"concurrency": None}, {"concurrency": True}, {"concurrency": 0},
    {"max_deliveries": 2.0}, {"max_deliveries": "3"}, {"max_deliveries": False}, {"max_deliveries": 0},
])
def test_worker_counts_are_type_checked(settings: dict[str, Any]) -> None:
    with pytest.raises(InvalidRequest):
        Worker(HandoffBus.memory(), Echo(), **settings)


def test_an_agents_retry_must_be_a_retry_policy() -> None:
    with pytest.raises(InvalidRequest, match=r"RetriesAsANumber\.retry must be a RetryPolicy"):
        Worker(HandoffBus.memory(), RetriesAsANumber())
    Worker(HandoffBus.memory(), Echo(), concurrency=1, max_deliveries=1)  # the edges are fine


# ---------------------------------------------------------------- queue and inbox entries written by hand


@pytest.mark.parametrize("member", [b"not-a-handoff-id", b"\xff/x"], ids=["no handoff id", "not text"])
async def test_a_queue_member_that_is_no_handoff_id_is_dead_lettered(bus: HandoffBus, member: bytes) -> None:
    client, keys = bus.client("req"), bus.keys.target(Echo.agent_id)
    await bus.redis.zadd(keys.queue, {member: 0})
    good = await client.request_handoff(req("req", Echo.agent_id))
    assert [p.handoff_id for p in await client.get_pending_handoffs(Echo.agent_id)] == [good.handoff_id]
    async with serving(bus, Echo(), concurrency=1):  # one at a time: the bad one, queued first, then the good
        with anyio.fail_after(10):
            assert (await good.outcome()).status is HandoffStatus.COMPLETED
    [dead] = await client.get_dead_letters(Echo.agent_id)  # shown escaped when it is not text
    assert dead.handoff_id == member.decode(errors="backslashreplace") and dead.reason.startswith("InvalidName:")
    [raw] = [f[b"h"] for _, f in await bus.redis.xrange(bus.keys.dead_letters(Echo.agent_id))]
    assert raw == member  # kept as it was
    assert (await bus.redis.xpending(keys.inbox, GROUP))["pending"] == 0
    assert await bus.redis.hlen(keys.inflight) == 0


async def test_a_reclaim_of_entries_that_name_no_handoff_dead_letters_them(bus: HandoffBus) -> None:
    """A worker that died held a good handoff, a queue member that is no handoff id, and an
    inbox entry written by hand with no handoff at all: its successor reclaims all three,
    dead-letters the last two, and finishes the first."""
    client, keys = bus.client("req"), bus.keys.target(Echo.agent_id)
    await bus.redis.zadd(keys.queue, {"not-a-handoff-id": -1})
    good = await client.request_handoff(req("req", Echo.agent_id))
    _, taken = await Inbox(bus, Echo.agent_id, "gone-1").take(2)
    assert len(taken) == 2
    nameless = (await bus.redis.xadd(keys.inbox, {"x": "y"})).decode()
    await bus.redis.xreadgroup(GROUP, "gone-1", {keys.inbox: ">"})
    async with serving(bus, Echo(), reclaim_idle=0.05) as [worker]:
        with anyio.fail_after(10):
            assert (await good.outcome()).status is HandoffStatus.COMPLETED
            while len(await client.get_dead_letters(Echo.agent_id)) < 2:
                await worker.wait_reclaim_pass()
    dead = {d.handoff_id: d.reason for d in await client.get_dead_letters(Echo.agent_id)}
    assert dead.keys() == {"not-a-handoff-id", ""} and dead[""] == "the inbox entry names no handoff"
    [entry] = [f[b"entry"] for _, f in await bus.redis.xrange(bus.keys.dead_letters(Echo.agent_id)) if f[b"h"] == b""]
    assert entry.decode() == nameless
    assert (await bus.redis.xpending(keys.inbox, GROUP))["pending"] == 0


# ---------------------------------------------------------------- lost replies


class FailsOnce(Echo):
    agent_id = "flaky-1"
    retry = RetryPolicy(attempts=3, delay=0.01, jitter=0)

    def __init__(self) -> None:
        super().__init__()
        self.runs: list[int] = []

    async def on_handoff_received(self, handoff: ReceivedHandoff) -> Any:
        self.runs.append(handoff.attempt)
        if len(self.runs) == 1:
            raise ValueError("transient")
        return "ok"


def lose_first_reclaim_reply(bus: HandoffBus, *, retry: bool) -> list[Any]:
    """Make the first ``reclaim`` call of the kind run, then lose its reply."""
    real, lost = bus.script, []

    async def script(name: str, keys: list[str], args: list[Any], *more: Any, **kwargs: Any) -> Any:
        reply = await real(name, keys, args, *more, **kwargs)
        if name == "reclaim" and bool(args[4]) is retry and not lost:
            lost.append(reply)
            raise RedisConnectionError("Connection reset by peer")
        return reply

    bus.script = script  # type: ignore[method-assign]
    return lost


async def test_a_retry_whose_lease_reply_was_lost_goes_on_at_the_next_attempt(bus: HandoffBus) -> None:
    agent = FailsOnce()
    handle = await bus.client("req").request_handoff(req("req", agent.agent_id))
    lost = lose_first_reclaim_reply(bus, retry=True)
    async with serving(bus, agent, reclaim_idle=60):  # not left for a reclaim
        with anyio.fail_after(10):
            outcome = await handle.outcome()
    assert lost and outcome.status is HandoffStatus.COMPLETED
    assert agent.runs == [1, 2]  # the lost reply's increment is not counted again
    record = await bus.client("req").get_handoff_status(handle.handoff_id)
    assert record is not None and record.attempt == 2


async def test_a_takeover_whose_reply_was_lost_counts_one_attempt(bus: HandoffBus) -> None:
    handle = await bus.client("a").request_handoff(req("a", Echo.agent_id))
    assert len((await Inbox(bus, Echo.agent_id, "gone-1").take(1))[1]) == 1  # taken, accepted, then it died
    await bus.client(Echo.agent_id)._transition("accept", handle.handoff_id, {"lease": "gone-1"}, settle=False)
    lost = lose_first_reclaim_reply(bus, retry=False)
    agent = Echo()
    async with serving(bus, agent, reclaim_idle=0.05):
        with anyio.fail_after(10):
            outcome = await handle.outcome()
    assert lost and outcome.status is HandoffStatus.COMPLETED
    assert outcome.result["attempt"] == 2 and agent.order == [handle.handoff_id]


# ---------------------------------------------------------------- the sweep


async def test_a_requesters_member_that_is_not_text_stops_no_sweep(
        bus: HandoffBus, caplog: pytest.LogCaptureFixture) -> None:
    await bus.redis.sadd(bus.keys.requesters, b"\xff\xfe")
    handle = await bus.client("req").request_handoff(req("req", "nobody-1", timeout=0.2))
    record = bus.keys.record(*handle.handoff_id.split("/")).record
    with caplog.at_level(logging.WARNING, "handoffbus"):
        await bus.sweeper.sweep_once()
        with anyio.fail_after(10):
            while await bus.redis.hget(record, "status") != b"EXPIRED":
                await bus.sweeper.wait_pass()  # swept, not expired by a read of the requester
        await bus.sweeper.sweep_once()
    assert await bus.redis.zcard(bus.keys.target("nobody-1").queue) == 0
    assert len([r for r in caplog.records if "not an agent id" in r.getMessage()]) == 1  # once


async def test_an_expired_handoff_whose_settle_was_lost_leaves_its_agents_queue(
        backend: str, servers: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """A handoff for an agent no worker serves expires, but settling its queue is lost (the
    connection drops): a later sweep settles it. Left queued, it would stay there for ever (only
    a take drops it), counted against ``max_queued``: every new request to the agent refused."""
    from .conftest import make_bus

    async with make_bus(backend, servers, max_queued=1) as bus:
        client, queue = bus.client("req"), bus.keys.target("nobody-1").queue
        scripts_many, lost = bus.scripts_many, anyio.Event()

        async def settle_lost_once(calls: list[Any]) -> list[Any]:
            if not lost.is_set() and any(name == "settle" for name, _, _ in calls):
                lost.set()
                raise RedisConnectionError("Connection closed by server.")
            return await scripts_many(calls)

        monkeypatch.setattr(bus, "scripts_many", settle_lost_once)
        handle = await client.request_handoff(req("req", "nobody-1", timeout=0.2))
        with anyio.fail_after(10):
            await lost.wait()
        assert await bus.redis.hget(bus.keys.record(*handle.handoff_id.split("/")).record, "status") == b"EXPIRED"
        for _ in range(3):  # later sweeps
            await bus.sweeper.wait_pass()
        again = await client.request_handoff(req("req", "nobody-1"))  # not QueueFull
        assert await bus.redis.zrange(queue, 0, -1) == [again.handoff_id.encode()]
        # and what told the sweep to settle it again is gone: only the new handoff's deadline
        assert await bus.redis.zrange(bus.keys.deadlines("req"), 0, -1) == [again.request_id.encode()]


@pytest.mark.parametrize(("request_id", "to"), [("bad id", "nobody-1"), ("bad-to", b"\xff\xfe")],
                         ids=["request-id-no-name", "to-not-utf8"])
async def test_a_settle_entry_of_a_record_written_by_hand_stops_no_follow_up_of_the_sweep(
        backend: str, servers: dict, request_id: str, to: str | bytes) -> None:
    """A requester may write anything in its own slot: here an EXPIRED record, under a request id
    that is no name or with a target that is not text, with its "~s:" entry. The sweep must not
    raise on it and skip what follows for the other handoffs of its pass (an expired routed
    handoff left in its capability set's queue for no one), every ``route_guard`` for as long
    as the record lives; and the entry must not stay for ever."""
    from .conftest import make_bus

    async with make_bus(backend, servers, sweep_interval=3600) as bus:
        while bus.sweeper.passes < 1:  # the first pass, at start; the next is an hour away
            await bus.sweeper.wait_pass()
        handle = await bus.client("req").request_handoff(routed(["nobody-serves"], timeout=60))
        keys = bus.keys.record("req", handle.request_id)
        queue = bus.keys.route(set_id("nobody-serves")).queue
        assert await bus.redis.zscore(queue, handle.handoff_id) is not None  # waits for a capable agent
        await bus.redis.delete(keys.marker)  # its deadline passed
        await bus.redis.zadd(keys.deadlines, {handle.request_id: 0})
        await bus.redis.hset(f"{bus.keys.slot('req')}h:{request_id}", mapping={
            "id": f"req/{request_id}", "status": "EXPIRED", "to": to, "hist": "[]"})
        await bus.redis.zadd(keys.deadlines, {f"~s:{request_id}": 0})
        assert await bus.sweeper.sweep_once() == 1
        assert await bus.redis.hget(keys.record, "status") == b"EXPIRED"
        assert await bus.redis.zscore(queue, handle.handoff_id) is None  # out of its set's queue
        assert await bus.redis.zrange(keys.deadlines, 0, -1) == []  # settled: its entry cleared


#: what ``os.fsdecode`` makes of a file name whose bytes are not UTF-8: a str with a lone surrogate
NOT_UTF8 = "cannot read " + os.fsdecode(b"/data/\xff.txt")


class FailsWithAPath(Echo):
    agent_id = "files-1"

    async def on_handoff_received(self, handoff: ReceivedHandoff) -> Any:
        raise RuntimeError(NOT_UTF8)


class RefusesWithAPath(Echo):
    agent_id = "files-2"

    async def on_handoff_request(self, request: HandoffRequest) -> Reject:
        return Reject(reason=NOT_UTF8)


async def test_a_hooks_text_that_is_not_utf8_still_reaches_the_requester(bus: HandoffBus) -> None:
    # an error (or a refusal) naming a file as the OS gave it back: sent as it was, the call
    # could not be encoded, the handoff stayed ACCEPTED (or PENDING) and was delivered again
    # until it was dead-lettered; the requester never heard. The surrogate is sent escaped.
    client = bus.client("req")
    failed = await client.request_handoff(req("req", FailsWithAPath.agent_id))
    refused = await client.request_handoff(req("req", RefusesWithAPath.agent_id))
    async with serving(bus, FailsWithAPath(), RefusesWithAPath()):
        with anyio.fail_after(10):
            outcomes = [await failed.outcome(), await refused.outcome()]
    assert [o.status for o in outcomes] == [HandoffStatus.FAILED, HandoffStatus.REJECTED]
    assert outcomes[0].error == "RuntimeError: cannot read /data/\\udcff.txt"
    assert outcomes[1].rejection_reason == "cannot read /data/\\udcff.txt"


# ---------------------------------------------------------------- what a handler reads


def test_a_malformed_resolution_is_a_decode_error() -> None:
    def received(value: Any) -> ReceivedHandoff:
        return ReceivedHandoff.of("a/r1", req("a", "b", request_id="r1", metadata={RESOLUTION_KEY: value}))

    with pytest.raises(DecodeError, match="greeting"):
        _ = received({"greeting": 5}).resolution
    resolution = HandoffResolution(source_agent="a", target_agent="b", handoff_type="announced", share_context=True,
                                   is_return=False, greeting="hi")
    assert received(msgspec.to_builtins(resolution)).resolution == resolution
    assert received("not a map").resolution is None


# ---------------------------------------------------------------- hooks that hang or raise BaseExceptions


class HangsOnFirst(Echo):
    """Its acceptance hook never returns for a request whose reason is 'hang'."""

    agent_id = "hangs-1"

    def __init__(self) -> None:
        super().__init__()
        self.entered = anyio.Event()

    async def on_handoff_request(self, request: HandoffRequest) -> Accept | Reject:
        if request.reason == "hang":
            self.entered.set()
            await anyio.sleep_forever()
        return Accept()


async def test_an_acceptance_hook_that_never_returns_gives_its_slot_back_at_the_deadline(real_bus: HandoffBus) -> None:
    agent = HangsOnFirst()
    client = real_bus.client("req")
    async with serving(real_bus, agent, concurrency=1):
        stuck = await client.request_handoff(req("req", agent.agent_id, reason="hang", timeout=0.5))
        with anyio.fail_after(10):
            await agent.entered.wait()
            assert (await stuck.outcome()).status is HandoffStatus.EXPIRED
        good = await client.request_handoff(req("req", agent.agent_id, reason="ok"))
        with anyio.fail_after(10):
            assert (await good.outcome()).status is HandoffStatus.COMPLETED


class Interrupted(BaseException):
    """What some libraries raise that is no Exception (gevent's Timeout, a framework's abort)."""


class InterruptedOnce(Echo):
    agent_id = "interrupted-1"
    retry = RetryPolicy(attempts=2, delay=0, retry_on=(Interrupted,))

    async def on_handoff_received(self, handoff: ReceivedHandoff) -> Any:
        if handoff.attempt == 1:
            raise Interrupted("first run cut short")
        return await super().on_handoff_received(handoff)


async def test_a_base_exception_the_retry_policy_names_is_retried(real_bus: HandoffBus) -> None:
    agent = InterruptedOnce()
    handle = await real_bus.client("req").request_handoff(req("req", agent.agent_id))
    [outcome], _ = await serve_until_done(real_bus, agent, [handle])
    assert outcome.status is HandoffStatus.COMPLETED
    assert outcome.result["attempt"] == 2


class RefusesByRaising(Echo):
    agent_id = "raises-base-1"

    async def on_handoff_request(self, request: HandoffRequest) -> Accept | Reject:
        if request.reason == "bad":
            raise GeneratorExit("not an Exception")
        return Accept()


async def test_an_acceptance_hook_raising_a_base_exception_is_a_hook_failure(real_bus: HandoffBus) -> None:
    agent = RefusesByRaising()
    client = real_bus.client("req")
    bad = await client.request_handoff(req("req", agent.agent_id, reason="bad"))
    good = await client.request_handoff(req("req", agent.agent_id, reason="ok"))
    async with serving(real_bus, agent, concurrency=1):
        with anyio.fail_after(10):
            refused, done = await bad.outcome(), await good.outcome()
    assert refused.status is HandoffStatus.REJECTED and refused.rejection_code == "HOOK_FAILED"
    assert done.status is HandoffStatus.COMPLETED


class _NoOffset(datetime.tzinfo):
    """A time zone whose offset cannot be read (a third-party tzinfo with a bug)."""

    def utcoffset(self, dt: datetime.datetime | None) -> datetime.timedelta:
        raise RuntimeError("no offset")


class ReturnsABadTime(Echo):
    agent_id = "bad-time-1"

    def __init__(self) -> None:
        super().__init__()
        self.runs = 0

    async def on_handoff_received(self, handoff: ReceivedHandoff) -> Any:
        self.runs += 1
        return {"when": datetime.datetime(2024, 1, 1, tzinfo=_NoOffset())}


async def test_a_result_whose_encoding_raises_fails_its_handoff_once(real_bus: HandoffBus) -> None:
    agent = ReturnsABadTime()
    handle = await real_bus.client("req").request_handoff(req("req", agent.agent_id))
    [outcome], _ = await serve_until_done(real_bus, agent, [handle])
    assert outcome.status is HandoffStatus.FAILED
    assert outcome.error is not None and "result cannot be sent" in outcome.error
    assert agent.runs == 1


class TakesItsSteps(Echo):
    """Takes its steps out of the request's metadata as it works; its first run then fails
    for a moment (a tool's connection dropped)."""

    agent_id = "takes-steps-1"
    retry = RetryPolicy(attempts=2, delay=0)

    async def on_handoff_received(self, handoff: ReceivedHandoff) -> Any:
        steps = handoff.request.metadata.pop("steps")
        if handoff.attempt == 1:
            raise ConnectionError("the tool's connection dropped")
        return {"steps": steps, "attempt": handoff.attempt}


async def test_a_retry_runs_on_the_request_as_sent_not_as_the_last_run_left_it(real_bus: HandoffBus) -> None:
    agent = TakesItsSteps()
    handle = await real_bus.client("req").request_handoff(req("req", agent.agent_id, metadata={"steps": [1, 2]}))
    async with serving(real_bus, agent):
        with anyio.fail_after(10):
            outcome = await handle.outcome()
    assert outcome.status is HandoffStatus.COMPLETED, outcome.error
    assert outcome.result == {"steps": [1, 2], "attempt": 2}


# ---------------------------------------------------------------------- text of any length

#: an error a library may raise: its message the whole body of a failed HTTP call
HUGE = "upstream said: " + "x" * 300_000


class FailsHugely(Echo):
    agent_id = "huge-1"

    async def on_handoff_request(self, request: HandoffRequest) -> Accept | Reject:
        return Reject(reason=HUGE, code="UPSTREAM") if request.reason == "refuse" else Accept()

    async def on_handoff_received(self, handoff: ReceivedHandoff) -> Any:
        raise RuntimeError(HUGE)


async def test_a_hooks_text_of_any_length_is_cut_not_written_whole(bus: HandoffBus) -> None:
    """A reason or error text went into the record and the response stream whole: 300 KB a
    handoff, read back by every status query. Cut to MAX_TEXT, and said to be cut."""
    from handoffbus.checks import MAX_TEXT

    client = bus.client("req")
    refused = await client.request_handoff(req("req", "huge-1", reason="refuse"))
    failed = await client.request_handoff(req("req", "huge-1", reason="work"))
    async with serving(bus, FailsHugely()):
        with anyio.fail_after(10):
            refusal, failure = await refused.outcome(), await failed.outcome()
    assert refusal.status is HandoffStatus.REJECTED and refusal.rejection_code == "UPSTREAM"  # not HOOK_FAILED
    assert failure.status is HandoffStatus.FAILED
    for text in (refusal.rejection_reason, failure.error):
        assert text is not None and len(text) <= MAX_TEXT and text.endswith(" characters]")
        assert "upstream said: xxx" in text


async def test_text_over_the_limit_is_refused_by_the_api(bus: HandoffBus) -> None:
    from handoffbus.checks import MAX_TEXT

    client, worker = bus.client("req"), bus.client("huge-1")
    handle = await client.request_handoff(req("req", "huge-1"))
    with pytest.raises(InvalidRequest, match="at most"):
        await worker.reject_handoff(handle.handoff_id, "x" * (MAX_TEXT + 1))
    with pytest.raises(InvalidRequest, match="at most"):
        await client.cancel_handoff(handle.handoff_id, reason="x" * (MAX_TEXT + 1))
    await worker.accept_handoff(handle.handoff_id)
    with pytest.raises(InvalidRequest, match="at most"):
        await worker.fail_handoff(handle.handoff_id, "x" * (MAX_TEXT + 1))
    assert (await worker.fail_handoff(handle.handoff_id, "x" * MAX_TEXT)).status is HandoffStatus.FAILED


class RaisesHugely(Echo):
    agent_id = "raises-huge-1"

    async def on_handoff_request(self, request: HandoffRequest) -> Accept | Reject:
        raise RuntimeError(HUGE)


async def test_an_acceptance_hook_raising_a_huge_error_is_refused_once(bus: HandoffBus) -> None:
    """decide() cut the hook's error to MAX_TEXT, then put 'acceptance hook failed: ' before
    it: act's rejection_fields refused the reason (InvalidRequest) and the handoff stayed
    pending, its hook run again by every reclaim until it was dead-lettered."""
    from handoffbus.checks import MAX_TEXT

    handle = await bus.client("req").request_handoff(req("req", RaisesHugely.agent_id))
    async with serving(bus, RaisesHugely()):
        with anyio.fail_after(10):
            refusal = await handle.outcome()
    assert refusal.status is HandoffStatus.REJECTED and refusal.rejection_code == "HOOK_FAILED"
    assert refusal.rejection_reason is not None and len(refusal.rejection_reason) <= MAX_TEXT


async def test_the_watchdog_cuts_short_only_hooks_past_their_time() -> None:
    """One look cuts short the hooks past their time, and them only; a hook that swallows the
    cancel answers, and leaves its task uncancelled (a later scope in the lane must work)."""
    import asyncio

    from handoffbus.workers.hooks import HookTimedOut, Watchdog

    dog, started, outcomes = Watchdog(), {name: anyio.Event() for name in ("due", "later", "swallows")}, {}

    async def hook(name: str) -> str:
        started[name].set()
        try:
            await anyio.sleep_forever()
        except asyncio.CancelledError:
            if name != "swallows":
                raise
        return "answered"

    async def run(name: str, until_ms: int) -> None:
        try:
            outcomes[name] = await dog.call(hook, name, until_ms)
        except HookTimedOut:
            outcomes[name] = "cut"
        task = asyncio.current_task()
        outcomes[f"{name} cancelling"] = task.cancelling() if task else None

    async with anyio.create_task_group() as tg:
        tg.start_soon(run, "due", 1_000)
        tg.start_soon(run, "later", 3_000)
        tg.start_soon(run, "swallows", 1_000)
        with anyio.fail_after(5):
            for event in started.values():
                await event.wait()
            dog.check(2_000)  # the server's time: past the first two, not the third
            while len(outcomes) < 4:
                await anyio.lowlevel.checkpoint()
        assert "later" not in outcomes  # not due: left running
        tg.cancel_scope.cancel()
    assert outcomes["due"] == "cut" and outcomes["swallows"] == "answered"
    assert outcomes["due cancelling"] == 0 and outcomes["swallows cancelling"] == 0
