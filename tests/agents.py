"""Agents used by the worker tests (importable by worker subprocesses as tests.agents:Name)."""

from __future__ import annotations

import threading
from typing import Any

import anyio

from handoffbus import HandoffRequest, LeaseLost, RouteRefused
from handoffbus.workers import Accept, Agent, ReceivedHandoff, Reject, RetryPolicy, inline


class Echo(Agent):
    agent_id = "echo-1"
    capabilities = ["echo"]

    def __init__(self) -> None:
        super().__init__()
        self.order: list[str] = []

    async def on_handoff_received(self, handoff: ReceivedHandoff) -> Any:
        self.order.append(handoff.handoff_id)
        history = handoff.context.conversation_history if handoff.context else []
        return {"echo": handoff.request.reason, "messages": len(history), "attempt": handoff.attempt}


class SlowEcho(Echo):
    """Works for a while, so that a stop lands while handoffs are in its hands."""

    async def on_handoff_received(self, handoff: ReceivedHandoff) -> Any:
        await anyio.sleep(0.3)  # simulated work, not synchronisation
        return await super().on_handoff_received(handoff)


class SyncEcho(Agent):
    agent_id = "sync-1"

    def __init__(self) -> None:
        super().__init__()
        self.threads: set[int] = set()

    def on_handoff_request(self, request: HandoffRequest) -> Accept | Reject:
        self.threads.add(threading.get_ident())
        return Accept(metadata={"by": "sync"})

    def on_handoff_received(self, handoff: ReceivedHandoff) -> Any:
        self.threads.add(threading.get_ident())
        return handoff.request.reason.upper()


class InlineEcho(SyncEcho):
    """SyncEcho whose acceptance hook is marked inline: the worker calls it on its loop."""

    agent_id = "inline-1"

    @inline
    def on_handoff_request(self, request: HandoffRequest) -> Accept | Reject:
        self.threads.add(threading.get_ident())
        return Accept(metadata={"by": "inline"})


class Gated(Agent):
    """Holds every handoff until ``gate`` opens; counts how many it holds."""

    agent_id = "gated-1"

    def __init__(self, hold_in_acceptance: bool = False) -> None:
        super().__init__()
        self.gate = anyio.Event()
        self.holding = 0
        self.reached: anyio.Event = anyio.Event()
        self.want = 0
        self.hold_in_acceptance = hold_in_acceptance

    async def _hold(self) -> None:
        self.holding += 1
        if self.holding >= self.want:
            self.reached.set()
        await self.gate.wait()

    async def on_handoff_request(self, request: HandoffRequest) -> Accept | Reject:
        if self.hold_in_acceptance:
            await self._hold()
        return Accept()

    async def on_handoff_received(self, handoff: ReceivedHandoff) -> Any:
        if not self.hold_in_acceptance:
            await self._hold()
        return "done"


class Faulty(Agent):
    agent_id = "faulty-1"

    async def on_handoff_request(self, request: HandoffRequest) -> Accept | Reject:
        if request.reason == "explode in acceptance":
            raise RuntimeError("acceptance bug")
        if request.reason == "bad reject":
            return Reject(reason="no", code="not a valid code")
        return Accept()

    async def on_handoff_received(self, handoff: ReceivedHandoff) -> Any:
        raise ValueError("the tool crashed")


class Sleepy(Agent):
    """Works for a long time: the worker holding it is killed or frozen meanwhile."""

    agent_id = "sleepy-1"

    async def on_handoff_received(self, handoff: ReceivedHandoff) -> Any:
        await anyio.sleep(float(handoff.request.metadata.get("work_s", 60)))  # simulated work
        return {"attempt": handoff.attempt, "by": "sleepy"}


class Rival(Agent):
    """Another worker of gated-1's agent: it takes over any entry left idle."""

    agent_id = "gated-1"

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    async def on_handoff_received(self, handoff: ReceivedHandoff) -> Any:
        self.seen.append(handoff.handoff_id)
        return "rival"


class Quick(Agent):
    """The same agent id as Sleepy, finishing at once: the live worker that takes over."""

    agent_id = "sleepy-1"

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, int]] = []

    async def on_handoff_received(self, handoff: ReceivedHandoff) -> Any:
        self.seen.append((handoff.handoff_id, handoff.attempt))
        return {"attempt": handoff.attempt, "by": "quick"}


class Flaky(Agent):
    """Raises on its first ``fails`` runs of each handoff, then succeeds (retried per policy)."""

    agent_id = "flaky-1"
    retry = RetryPolicy(attempts=3, delay=0.0)

    def __init__(self, fails: int = 2, error: type[Exception] = ConnectionError) -> None:
        super().__init__()
        self.fails = fails
        self.error = error
        self.attempts: list[int] = []

    async def on_handoff_received(self, handoff: ReceivedHandoff) -> Any:
        self.attempts.append(handoff.attempt)
        if len(self.attempts) <= self.fails:
            raise self.error(f"transient failure {len(self.attempts)}")
        return {"attempt": handoff.attempt}


class Beating(Agent):
    """Renews its hold between steps; ``told`` is set once the handler learned it lost it."""

    agent_id = "beating-1"

    def __init__(self) -> None:
        super().__init__()
        self.started = anyio.Event()
        self.proceed = anyio.Event()
        self.lost: list[str] = []
        self.told = anyio.Event()

    async def on_handoff_received(self, handoff: ReceivedHandoff) -> Any:
        await handoff.heartbeat()  # held: returns quietly
        self.started.set()
        await self.proceed.wait()
        try:
            await handoff.heartbeat()
        except LeaseLost as exc:
            self.lost.append(exc.holder)
            self.told.set()
            raise
        return "finished"


class Doomed(Agent):
    """A routed agent that reports each offer it is chosen for on stdout and never decides it:
    the test kills its process while it holds them."""

    agent_id = "doomed-1"
    capabilities = ["a", "b"]

    async def on_handoff_request(self, request: HandoffRequest) -> Accept | Reject:
        print(f"chosen {request.request_id}", flush=True)
        await anyio.sleep_forever()
        return Accept()


class ConciergeRelay(Agent):
    """The banking scenario's Concierge: hands each conversation on to ``metadata["next"]``,
    and says what became of it (the new handoff's id, or the refusal's code)."""

    agent_id = "Concierge"

    async def on_handoff_received(self, handoff: ReceivedHandoff) -> Any:
        try:
            onward = await handoff.hand_to(handoff.request.metadata["next"], reason="routing on")
        except RouteRefused as exc:
            return {"refused": exc.code}
        return {"onward": onward.handoff_id}


class BlockingSync(Agent):
    """A plain-def work hook that never returns by itself (a model call without a timeout).
    It says so on stdout when it starts, for a test running it in a worker process."""

    agent_id = "blocking-sync-1"

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()

    def on_handoff_received(self, handoff: ReceivedHandoff) -> Any:
        print(f"working on {handoff.handoff_id}", flush=True)
        self.release.wait()
        return "done"


class ReadsReport(Echo):
    """Keeps what its handoffs' contexts hold under tool_state["report"] (out-of-band content,
    restored before the work hook runs)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[Any] = []

    async def on_handoff_received(self, handoff: ReceivedHandoff) -> Any:
        assert handoff.context is not None
        self.seen.append(handoff.context.tool_state["report"])
        return "read"
