"""Capability routing at scale: 10 agents with overlapping capabilities, 5,000 routed requests
at mixed priorities. One agent is a worker process killed while it holds the offers it was
chosen for; one joins late. Everything is checked from the records and response streams."""

from __future__ import annotations

import random
from collections import Counter, defaultdict
from typing import Any

import anyio
import pytest

from handoffbus import HandoffHandle, HandoffRequest, HandoffStatus
from handoffbus.workers import Accept, Agent, ReceivedHandoff, Reject, Worker

from .conftest import make_bus
from .helpers import routed, serving, start_worker

pytestmark = pytest.mark.anyio
S = HandoffStatus

TOTAL = 5_000
LATE_AFTER = 2_000  # outcomes before the late agent starts
#: the in-process agents and their capabilities; doomed-1 (a worker process) has a, b
AGENTS = {"ag-0": "a", "ag-1": "a b", "ag-2": "a b c", "ag-3": "b c", "ag-4": "b c d", "ag-5": "c d",
          "ag-6": "d e", "ag-7": "a e"}
LATE = ("late-1", "a b c")
#: capability sets asked for, in varied order and with duplicates (matched as sets)
SETS = [["a"], ["b", "a"], ["c", "b", "b"], ["d", "c"], ["e", "d"], ["e", "a"], ["b"], ["c", "a", "b"]]
#: refusals that leave a capable agent willing (ag-2 serves the first three, ag-1 the last)
FALLBACK = [(["a"], ["ag-0", "ag-7"]), (["a", "b"], ["ag-1"]), (["b", "c"], ["ag-3", "ag-4"]),
            (["b"], ["ag-2", "ag-3", "ag-4"])]
#: refusals by every agent that has the capabilities: NO_CAPABLE_AGENT
NOBODY = [(["c", "d"], ["ag-4", "ag-5"]), (["d", "e"], ["ag-6"])]


class Member(Agent):
    """Refuses a handoff whose metadata lists it in ``refuse``; else accepts and completes it."""

    def __init__(self, agent_id: str, capabilities: str, done: Tally) -> None:
        super().__init__()
        self.agent_id = agent_id  # type: ignore[misc]
        self.capabilities = capabilities.split()  # type: ignore[misc]
        self.done = done
        self.handled: list[str] = []

    async def on_handoff_request(self, request: HandoffRequest) -> Accept | Reject:
        if self.agent_id in request.metadata.get("refuse", []):
            return Reject(reason="not mine", code="DECLINED")
        return Accept()

    async def on_handoff_received(self, handoff: ReceivedHandoff) -> Any:
        self.handled.append(handoff.handoff_id)
        self.done.add()
        return {"by": self.agent_id}


class Tally:
    """Counts completed handoffs; ``reached`` is set at ``threshold``."""

    def __init__(self, threshold: int) -> None:
        self.count = 0
        self.threshold = threshold
        self.reached = anyio.Event()

    def add(self) -> None:
        self.count += 1
        if self.count >= self.threshold:
            self.reached.set()


def plan(seed: int = 7) -> list[tuple[list[str], int, list[str]]]:
    """(capabilities, priority, refusers) of every request: 1 in 25 refused by every capable
    agent, 2 in 25 refused by some, the rest across the sets."""
    rng = random.Random(seed)
    out = []
    for i in range(TOTAL):
        kind = i % 25
        if kind == 0:
            caps, refuse = rng.choice(NOBODY)
        elif kind in (1, 2):
            caps, refuse = rng.choice(FALLBACK)
        else:
            caps, refuse = rng.choice(SETS), []
        out.append((caps, rng.randint(0, 9), refuse))
    return out


async def test_ten_agents_five_thousand_routed_requests(real_backend: str, servers: dict) -> None:
    # a huge ageing step: strict priority, so that the order can be checked exactly
    async with make_bus(real_backend, servers, route_age_step=1000.0, offer_time=5.0) as bus:
        client = bus.client("req")
        requests = plan()
        handles: list[HandoffHandle] = []
        with anyio.fail_after(120):
            for i, (caps, priority, refuse) in enumerate(requests):
                handles.append(await client.request_handoff(routed(
                    caps, priority=priority, reason=f"r{i}", timeout=300, metadata={"refuse": refuse})))
        index = {h.handoff_id: i for i, h in enumerate(handles)}
        tally = Tally(LATE_AFTER)
        members = [Member(name, caps, tally) for name, caps in AGENTS.items()]
        late = Member(*LATE, tally)

        # the doomed agent starts first, is chosen for four handoffs and never decides them
        doomed, lines = await start_worker(servers[real_backend].url, bus.config.prefix, "tests.agents:Doomed",
                                           "--concurrency", "4", "--offer-time", "1")
        async with serving(bus, *members, concurrency=8), anyio.create_task_group() as tg:
            chosen: list[str] = []
            with anyio.fail_after(30):
                while len(chosen) < 4:
                    chosen.append("req/" + (await lines.receive_until(b"\n", 4096)).decode().split()[1])
            doomed.kill()
            await doomed.wait()
            with anyio.fail_after(60):
                await tally.reached.wait()
            late_worker = Worker(bus, late, concurrency=8)
            await tg.start(late_worker.run)
            with anyio.fail_after(120):
                results = [await h.outcome() for h in handles]
            late_worker.drain()
        await doomed.aclose()

        records = [await client.get_handoff_status(h.handoff_id) for h in handles]
        stream = await bus.redis.xrange(bus.keys.responses("req"))

    capabilities = {name: set(caps.split()) for name, caps in [*AGENTS.items(), LATE]}
    capabilities["doomed-1"] = {"a", "b"}

    # outcomes: NO_CAPABLE_AGENT with its refusers for the refused-by-all, COMPLETED for the rest
    for (caps, _, refuse), outcome in zip(requests, results, strict=True):
        if (caps, refuse) in NOBODY:
            assert outcome.status is S.REJECTED and outcome.rejection_code == "NO_CAPABLE_AGENT"
            assert outcome.actor == "_router" and sorted(outcome.metadata["refused"]) == sorted(refuse)
        else:
            assert outcome.status is S.COMPLETED, outcome
            assert set(caps) <= capabilities[outcome.result["by"]]
            assert outcome.result["by"] not in refuse

    # assigned exactly once: each completed handoff handled by one agent, once; one decision and one outcome each
    handled = Counter(hid for m in [*members, late] for hid in m.handled)
    completed = {o.handoff_id for o in results if o.status is S.COMPLETED}
    assert set(handled) == completed and set(handled.values()) == {1}
    for member in [*members, late]:
        assert all(results[index[hid]].result == {"by": member.agent_id} for hid in member.handled)
    statuses: dict[str, list[str]] = defaultdict(list)
    for _, fields in stream:
        statuses[fields[b"id"].decode()].append(fields[b"status"].decode())
    assert len(statuses) == TOTAL
    for outcome in results:
        expected = ["ACCEPTED", "COMPLETED"] if outcome.status is S.COMPLETED else ["REJECTED"]
        assert statuses[outcome.handoff_id] == expected

    # the route of each: offers answered by a refusal, a lapse or (last) the acceptance; the chain recorded
    refusals = 0
    for (caps, _, refuse), record, outcome in zip(requests, records, results, strict=True):
        assert record is not None
        steps = [(s.agent, s.event) for s in record.route]
        offered = [a for a, e in steps if e == "OFFERED"]
        # never offered to the same agent twice
        assert len(offered) == len(set(offered)), (record.handoff_id, record.route, record.history)
        for (agent, event), nxt in zip(steps, [*steps[1:], ("", "")], strict=True):
            if event == "OFFERED":
                assert set(caps) <= capabilities[agent]
                assert nxt in {(agent, "REFUSED"), (agent, "LAPSED"), ("", "")}, steps
            elif event == "REFUSED":
                refusals += 1
                assert agent in refuse
            else:
                assert (agent, event) == ("doomed-1", "LAPSED"), steps
        if outcome.status is S.COMPLETED:
            assert steps[-1] == (outcome.result["by"], "OFFERED")
        else:
            assert {a for a, e in steps if e == "REFUSED"} == set(refuse) and steps[-1][1] == "REFUSED"
    assert refusals > len([r for r in requests if r[2]])  # the fallback chains were exercised

    # the agent killed after being chosen lost nothing: its offers lapsed and went elsewhere
    for hid in chosen:
        steps = [(s.agent, s.event) for s in records[index[hid]].route]  # type: ignore[union-attr]
        assert steps[:2] == [("doomed-1", "OFFERED"), ("doomed-1", "LAPSED")]
        assert results[index[hid]].status is S.COMPLETED

    # the late joiner got work
    assert len(late.handled) > 0

    # priority order per capability set: handoffs leave a set's queue best first (priority,
    # then FIFO), all having been queued before the first pull; the first offer is when a
    # handoff left its queue
    by_set: dict[frozenset[str], list[tuple[int, int, int]]] = defaultdict(list)
    for (caps, priority, _), record in zip(requests, records, strict=True):
        assert record is not None
        first = next(s.at_ms for s in record.route if s.event == "OFFERED")
        by_set[frozenset(caps)].append((priority, record.created_ms, first))
    for entries in by_set.values():
        entries.sort()
        seen_before = 0  # the latest first offer among handoffs of better rank
        i = 0
        while i < len(entries):
            j = i
            while j < len(entries) and entries[j][:2] == entries[i][:2]:
                j += 1  # same priority, same millisecond: their order is the queue's sequence
            block = [e[2] for e in entries[i:j]]
            assert min(block) >= seen_before, (entries[i], seen_before)
            seen_before = max(seen_before, *block)
            i = j
    shares = Counter(o.result["by"] for o in results if o.status is S.COMPLETED)
    print(f"\nshares: {dict(sorted(shares.items()))}; refusals {refusals}; doomed offers {chosen}")
