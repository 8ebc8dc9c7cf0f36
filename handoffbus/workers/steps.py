"""Steps: one handoff's way through a worker once it is taken.

The acceptance hook, the decision sent, the work hook with the agent's retries, and the
outcome sent under the worker's lease. Every transition the worker decided on is sent until
Redis answers it: given up on a lost connection, the handoff would be reclaimed and its
hooks run again, while a repeat under the same lease is answered as done.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
import msgspec

from .. import tracing
from ..backoff import LOST_CONNECTION, Backoff
from ..checks import rejection_fields
from ..errors import EncodeError, InvalidRequest, LeaseLost, PayloadTooLarge, raise_for_code
from ..logs import AgentLog
from ..models import HandoffRequest, HandoffResponse, HandoffStatus
from ..names import split_handoff_id
from ..policies.blobs import has_blobs, restore
from ..records import Made
from .agent import Accept, Agent, ReceivedHandoff, Reject
from .hooks import HookTimedOut, Watchdog, call_hook, describe, sendable, stops
from .keeper import Keeper

if TYPE_CHECKING:
    from ..bus import HandoffBus

__all__ = ["Steps"]

T = TypeVar("T")

#: ms past a handoff's deadline an acceptance hook still running is cut short: by then
#: the sweep made it EXPIRED, and the hook would hold its worker's slot for nothing
DECIDE_MARGIN_MS = 1000


def from_sw4rm(response: HandoffResponse) -> Accept | Reject:
    """sw4rm's acceptance hook answers with a HandoffResponse: ``accepted`` says which, and the
    rejection's fields say why. A ported hook's answer, as handoffbus's own."""
    if response.accepted:
        return Accept(metadata=response.metadata)
    return Reject(reason=response.rejection_reason or "", code=response.rejection_code,
                  retry_after_ms=response.retry_after_ms, redirect_to=response.redirect_to_agent)


class Steps:
    """A worker's steps for the handoffs it runs, under its consumer name (the lease)."""

    def __init__(self, bus: HandoffBus, agent: Agent, keeper: Keeper, entries: dict[str, str], log: AgentLog) -> None:
        self.bus = bus
        self.agent = agent
        self.consumer = keeper.consumer
        self._keeper = keeper
        self._entries = entries
        self._log = log
        self._client = bus.client(agent.agent_id)
        self._inbox_key = bus.keys.target(agent.agent_id).inbox
        #: acceptance hooks past their handoff's deadline are cut short (the worker checks it)
        self.watchdog = Watchdog()

    async def take_over(self, hid: str, seen: int, *, retry: bool = False) -> int:
        """Hold the handoff's lease for a new run of its work after attempt ``seen``; returns
        the new attempt number. A takeover moves the lease from a stopped worker; a retry
        requires holding it. Sent until answered: a repeat whose first reply was lost finds
        the lease ours at ``seen + 1`` and takes no second attempt."""
        requester, request_id = split_handoff_id(hid)
        keys = self.bus.keys.record(requester, request_id).as_list()
        args = [hid, request_id, self.agent.agent_id, self.consumer, self.consumer if retry else "", seen]
        reply = await self.until_answered(
            "retry" if retry else "takeover", hid, lambda: self.bus.script("reclaim", keys, args))
        if int(reply[0]) < 0:
            raise_for_code(int(reply[0]), hid, self.agent.agent_id, "reclaim", reply[1] if len(reply) > 1 else None)
        return int(reply[1])

    async def decide(self, hid: str, request: HandoffRequest, deadline_ms: int = 0) -> Accept | Reject:
        """The acceptance hook's answer. One still running past the handoff's deadline is cut
        short (it could never be sent), so that a hook that never returns gives its slot back."""
        until = deadline_ms + DECIDE_MARGIN_MS if deadline_ms else None
        try:
            decision = await self.watchdog.call(self.agent.on_handoff_request, request, until)
        except HookTimedOut:
            self._log.error("%s: acceptance hook for %s did not answer by the handoff's deadline", self.consumer,
                            hid, extra={"handoff_id": hid})
            return Reject(reason="acceptance hook did not answer by the handoff's deadline", code="HOOK_TIMEOUT")
        except BaseException as exc:
            if stops(exc):
                raise
            self._log.exception("%s: acceptance hook failed for %s", self.consumer, hid, extra={"handoff_id": hid})
            return Reject(reason=describe(exc, "acceptance hook failed: "), code="HOOK_FAILED")
        if isinstance(decision, HandoffResponse):
            decision = from_sw4rm(decision)
        if not isinstance(decision, Accept | Reject):
            return Reject(reason=f"acceptance hook returned {type(decision).__name__}", code="HOOK_FAILED")
        if isinstance(decision, Accept) and not isinstance(decision.metadata, dict):
            # it would be written ACCEPTED, then no one could decode the response (this worker
            # neither, which would leave the work to a reclaim)
            return Reject(reason="acceptance hook returned an invalid Accept: metadata must be a dict, "
                                 f"not {type(decision.metadata).__name__}", code="HOOK_FAILED")
        if isinstance(decision, Reject):
            # its reason as the record can hold it first (a hook may give an exception's whole text)
            reason = sendable(decision.reason) if isinstance(decision.reason, str) else decision.reason
            try:
                rejection_fields(reason, decision.code, decision.retry_after_ms, decision.redirect_to)
            except InvalidRequest as exc:
                return Reject(reason=f"acceptance hook returned an invalid Reject: {exc}", code="HOOK_FAILED")
            refusal: Reject = msgspec.structs.replace(decision, reason=reason)
            return refusal
        return decision

    async def act(
        self, hid: str, request: HandoffRequest, decision: Accept | Reject, created_ms: int
    ) -> HandoffStatus:
        meta = None
        if isinstance(decision, Accept) and decision.metadata:
            try:
                meta = self.bus.codec.dumps_value(decision.metadata)
            except (EncodeError, PayloadTooLarge) as exc:  # the same on every run: refused, not retried
                self._log.error("%s: acceptance hook for %s returned metadata that cannot be sent: %s",
                                self.consumer, hid, exc, extra={"handoff_id": hid})
                decision = Reject(reason=sendable(f"acceptance hook returned metadata that cannot be sent: {exc}"),
                                  code="HOOK_FAILED")
        if isinstance(decision, Reject):
            fields = rejection_fields(decision.reason, decision.code, decision.retry_after_ms, decision.redirect_to)
            # a routed handoff refused goes on to another agent: it stays PENDING
            with tracing.settle_span(self._inbox_key, hid, "REJECTED"):
                return (await self.send("reject", hid, fields, created_ms)).status
        await self.send("accept", hid, {"rmeta": meta, "lease": self.consumer}, created_ms)
        return await self.work(hid, request, 1, created_ms)

    async def work(self, hid: str, request: HandoffRequest, attempt: int, created_ms: int) -> HandoffStatus:
        """Run the work hook (retried per the agent's policy) and record its outcome under
        this worker's lease."""
        client, codec, policy = self._client, self.bus.codec, self.agent.retry

        async def renew() -> None:
            await self.renew(hid)

        # each run gets the request as sent: a hook may change its metadata as it works, and a
        # retry must not see what the failed run left (a takeover reads it from Redis anyway)
        try:
            sent = msgspec.msgpack.encode(request) if policy.attempts > attempt else None
        except Exception:  # the acceptance hook put something in it that cannot be copied: kept as it is
            sent = None
        while True:
            try:
                received = ReceivedHandoff.of(hid, request, attempt, renew, client,
                                              limit=self.bus.config.payload_limit)
                context = received.context
                if context is not None and has_blobs(request.context_snapshot):
                    restoring = functools.partial(restore, self.bus, context, hid)
                    restored = await self.until_answered("restoring the context", hid, restoring)
                    received = msgspec.structs.replace(received, context=restored)
                result = await call_hook(self.agent.on_handoff_received, received)
                break
            except LeaseLost:
                raise
            except BaseException as exc:
                if stops(exc):
                    raise
                if not policy.should_retry(attempt, exc):
                    self._log.exception("%s: handler failed for %s (attempt %d)", self.consumer, hid, attempt,
                                       extra={"handoff_id": hid})
                    with tracing.settle_span(self._inbox_key, hid, "FAILED"):
                        await self.send("fail", hid, {"error": describe(exc), "lease": self.consumer}, created_ms)
                    return HandoffStatus.FAILED
                delay = policy.delay_before(attempt)
                self._log.warning("%s: handler failed for %s (attempt %d: %s); retrying in %.2fs",
                                  self.consumer, hid, attempt, describe(exc), delay, extra={"handoff_id": hid})
            await anyio.sleep(delay)  # the retry backoff (a stop meanwhile leaves it pending)
            attempt = await self.take_over(hid, attempt, retry=True)
            if sent is not None:
                request = msgspec.msgpack.decode(sent, type=HandoffRequest)
        try:
            packed = None if result is None else codec.dumps_value(result)
        except (EncodeError, PayloadTooLarge) as exc:  # the same on every run: failed, not run again
            self._log.error("%s: the result of %s cannot be sent: %s", self.consumer, hid, exc,
                            extra={"handoff_id": hid})
            with tracing.settle_span(self._inbox_key, hid, "FAILED"):
                await self.send("fail", hid, {"error": describe(exc, "result cannot be sent: "),
                                               "lease": self.consumer}, created_ms)
            return HandoffStatus.FAILED
        with tracing.settle_span(self._inbox_key, hid, "COMPLETED"):
            await self.send("complete", hid, {"result": packed, "lease": self.consumer}, created_ms)
        return HandoffStatus.COMPLETED

    async def send(self, name: str, hid: str, fields: dict[str, Any], created_ms: int) -> HandoffResponse | Made:
        """Send a transition this worker decided on until the server answers it: given up on a
        lost connection, the handoff would be reclaimed and its hooks run again. A repeat under
        the same lease is answered as done."""
        return await self.until_answered(
            name, hid, lambda: self._client._transit(name, hid, fields, settle=False, created_ms=created_ms))

    async def until_answered(self, what: str, hid: str, call: Callable[[], Awaitable[T]]) -> T:
        """``call()`` again, with backoff, while the server cannot be reached (a lost connection,
        a timeout, a failover's READONLY): a step of a handler that Redis failed is no failure of
        its hooks. A stop ends the trying, leaving the handoff pending; a refusal is raised."""
        backoff = Backoff()
        while True:
            try:
                return await call()
            except PermissionError:  # refused (a forwarder's CallRefused): no retry changes that
                raise
            except LOST_CONNECTION as exc:
                delay = backoff.delay()
                self._log.warning("%s: %s of %s not answered (%s); retrying in %.2fs", self.consumer, what, hid, exc,
                                  delay, extra={"handoff_id": hid})
                await anyio.sleep(delay)

    async def renew(self, hid: str) -> None:
        """A handler's own heartbeat: refresh its inbox entry, then confirm the lease is still ours.
        Redis out of reach is not the handler's failure: the background heartbeat keeps trying,
        and the lease is checked again at the next beat and when the outcome is sent."""
        requester, request_id = split_handoff_id(hid)
        try:
            if hid in self._entries:
                await self._keeper.touch([hid])
            # the load script, not HGET: an isolated agent reads a peer's record through the forwarder
            keys = self.bus.keys.record(requester, request_id)
            row = await self.bus.script("load", [keys.record, keys.envelope], [0])  # a large envelope left out
        except PermissionError:
            raise
        except LOST_CONNECTION as exc:
            self._log.warning("%s: heartbeat of %s not answered (%s); the handler goes on", self.consumer, hid, exc,
                              extra={"handoff_id": hid})
            return
        holder = row[13] if len(row) > 13 else None
        if holder != self.consumer.encode():
            raise LeaseLost(hid, (holder or b"").decode())
