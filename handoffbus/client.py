"""HandoffClient: sw4rm's method set, async, for one agent identity."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import anyio
import msgspec

from . import deadletters, errors, tracing
from .backoff import LOST_CONNECTION, Backoff, lost_connection
from .checks import check_text, normalize_request, rejection_fields, request_fingerprint
from .errors import QUEUE_FULL, InvalidRequest, NotPermitted, QueueFull, raise_for_code
from .handle import HandoffHandle
from .models import (
    TERMINAL,
    AgentInfo,
    DeadLetter,
    DeadLetterAction,
    HandoffRecord,
    HandoffRequest,
    HandoffResponse,
    HandoffStatus,
    PendingHandoff,
)
from .names import check_agent_id, check_name, join_handoff_id, split_handoff_id
from .policies.context import without_history
from .records import Made, response_from_reply
from .routing import Call, Directory, capability_set, refusal_response, set_id
from .scripts import STAGE_OVER, STAGED_TTL_MS
from .signing import RESPONSE_VERSION, response_body
from .waiters import ResponseReader, Waiter

if TYPE_CHECKING:
    from .bus import HandoffBus


__all__ = ["HandoffClient"]

log = logging.getLogger("handoffbus")

#: how often the calls that follow a new record are sent again when their replies were lost
FOLLOW_TRIES = 4


#: the status each signed transition writes
SIGNED_STATUS = {"accept": "ACCEPTED", "reject": "REJECTED", "complete": "COMPLETED", "fail": "FAILED",
                 "cancel": "CANCELLED"}
MADE_STATUS = {name: HandoffStatus(status) for name, status in SIGNED_STATUS.items()}


class HandoffClient:
    """Requests, decides and settles handoffs as agent ``agent_id``.

    Every transition is one atomic script on the requester's slot; its response reaches the
    requester's response stream in the same step. Methods raise subclasses of
    ``HandoffbusError``; bad input is refused before anything reaches Redis.
    """

    def __init__(self, bus: HandoffBus, agent_id: str) -> None:
        self._bus = bus
        self.agent_id = check_agent_id(agent_id)

    def __repr__(self) -> str:
        return f"<HandoffClient {self.agent_id!r}>"

    # ------------------------------------------------------------------ requesting

    def _normalize(self, request: HandoffRequest) -> HandoffRequest:
        config = self._bus.config
        return normalize_request(request, self.agent_id, config.default_timeout, config.max_timeout)

    async def request_handoff(
        self, request: HandoffRequest, *, fail_fast: bool = False, variables: Mapping[str, Any] | None = None,
    ) -> HandoffHandle:
        """Create a handoff (or re-attach to the one with this request id) and return its handle.

        A request without ``to_agent`` is routed by ``capabilities_required`` (docs/routing.md).
        With no capable agent live it waits for one until its deadline; ``fail_fast=True``
        makes it REJECTED (code ``NO_CAPABLE_AGENT``) at once instead.

        A bus with a ``HandoffPolicy`` applies it first: a route its scenario does not allow,
        or one that breaks the loop guards, raises ``RouteRefused`` before anything is
        written; ``variables`` are what the scenario's ``context_vars`` templates may use.

        Two idempotent scripts, sent in this order: the record in this agent's slot, then the
        target's queue (or the route). A crash between them leaves a PENDING record that a retry
        with the same request_id re-queues, or that expires at its deadline; nothing is doubled.
        With a generated request id both go in one round trip; with the caller's own, the queue
        step waits for the record's answer, so that a conflicting or decided handoff is never
        queued again.
        """
        given = request
        request = self._normalize(request)  # checked first: anything but a HandoffRequest is refused
        resubmittable = bool(given.request_id)  # the caller's own id; a new one is generated
        if not request.to_agent and fail_fast and self._bus.isolated is not None:
            raise InvalidRequest("fail_fast needs the live agents, which an isolated agent cannot read")
        handoff_id = join_handoff_id(self.agent_id, request.request_id)
        if not request.preserve_history and request.context_snapshot is not None:
            request = msgspec.structs.replace(request, context_snapshot=await without_history(
                request.context_snapshot, limit=self._bus.config.payload_limit))
        if self._bus.policy is not None:
            request = await self._bus.policy.prepare(self._bus, request, handoff_id, variables)
        if not tracing.active():  # the common case: nothing to record, nothing to carry
            return await self._request(request, handoff_id, fail_fast, resubmittable)
        keys = self._bus.keys
        destination = (keys.target(request.to_agent).inbox if request.to_agent
                       else keys.route(set_id(capability_set(request.capabilities_required))).queue)
        with tracing.send_span(destination, handoff_id):
            traced = tracing.with_trace_context(request.metadata)
            if traced != request.metadata:
                request = msgspec.structs.replace(request, metadata=traced)
            return await self._request(request, handoff_id, fail_fast, resubmittable)

    async def _request(
        self, request: HandoffRequest, handoff_id: str, fail_fast: bool, resubmittable: bool
    ) -> HandoffHandle:
        envelope = self._bus.codec.dumps(request)
        fingerprint = request_fingerprint(request)
        bus = self._bus
        keys = bus.keys.record(self.agent_id, request.request_id)
        listed = await bus.register_requester(self.agent_id)
        reader = self._reader()
        waiter = reader.watch(handoff_id)  # shared with earlier handles or requests of this id
        try:
            assert request.timeout is not None
            caps = "" if request.to_agent else capability_set(request.capabilities_required)
            timeout_ms = int(request.timeout * 1000)
            signature = ""
            if bus.keyring is not None:
                signature = bus.keyring.sign(self.agent_id, "request", [
                    handoff_id, self.agent_id, request.to_agent, caps, str(timeout_ms)], envelope, await bus.now_ms())
            record_args: list[Any] = [
                handoff_id, request.request_id, self.agent_id, request.to_agent, timeout_ms,
                envelope, bus.config.retention_ms, bus.config.response_retention_ms, fingerprint,
                caps, request.priority, int(bus.config.route_guard * 1000), bus.config.max_pending, signature,
            ]
            record_calls = [("request", keys.as_list(), record_args)]
            if len(envelope) > STAGE_OVER:  # written apart, renamed in by the script (see request-6.lua)
                staged = bus.keys.staged(self.agent_id, request.request_id, os.urandom(8).hex())
                record_args[5] = ""
                record_args.append("1")
                record_calls = [("SET", [staged], [envelope, "PX", STAGED_TTL_MS]),
                                ("request", [*keys.as_list(), staged], record_args)]
            if request.to_agent:
                await bus.register_target(request.to_agent)
                follow = [bus.enqueue_call(request.to_agent, handoff_id, request.priority, bus.config.max_queued)]
            else:
                follow = await self._route_calls(handoff_id, caps, request, fail_fast)
            if resubmittable:
                # the caller's request id may name a handoff that exists: queue or route it only once
                # the record says it is this request and still PENDING, never another request's (a
                # conflict) nor a decided one (a worker could take it and run its work again)
                replies = await bus.scripts_many(record_calls)
                reply = replies[-1]
                pending = not isinstance(reply, BaseException) and (
                    int(reply[0]) == 1 or (int(reply[0]) == 0 and reply[1] == b"PENDING"))
                followed = await bus.scripts_many(follow) if pending else []
            else:
                # a new request id: the record and its queue entry in one round trip, in this order; a
                # crash between them leaves a PENDING record that expires at its deadline
                replies = await bus.scripts_many([*record_calls, *follow])
                reply, followed = replies[len(record_calls) - 1], replies[len(record_calls):]
                if not isinstance(reply, BaseException) and int(reply[0]) == 1 and any(map(lost_connection, followed)):
                    # the record stands, its queue entry's reply was lost with the connection: sent
                    # again (enqueue and route are idempotent), not a failed request that a caller
                    # would retry into a second handoff
                    followed = await self._follow_again(keys.record, follow, followed)
            if listed:  # again, after the record: the sweep may have unlisted it as idle meanwhile
                await bus.relist_requester(self.agent_id)
            for failed in replies[:len(record_calls)]:
                if isinstance(failed, BaseException):
                    if resubmittable and lost_connection(failed):  # it may stand: counted when resubmitted
                        bus.tally.doubt(handoff_id, "request")
                    raise failed
            code = int(reply[0])
            status = HandoffStatus(reply[1].decode()) if code >= 0 else None
            if status is None and not request.to_agent and followed and followed[0] == 1:
                # refused, nothing created: the route entry sent with it goes (pulled, an entry
                # without a record is dropped too)
                await bus.drop_routes([(caps, handoff_id)])
            if status is not None:  # a refused record says why first: the calls after it failed for it
                for failed in followed:
                    if isinstance(failed, BaseException):
                        # made all the same (code 1): counted now, as its resubmission joins it uncounted
                        if bus.tally.made(handoff_id, "request", code):
                            bus.tally.add(request.to_agent, "requested")
                        raise failed
            enqueued = followed[0] if request.to_agent and followed else None
            if enqueued == 1 and bus.isolated is None and (
                status is not HandoffStatus.PENDING
                # joined: the record answered PENDING a round trip before the entry was added
                or (code == 0 and await bus.redis.hget(keys.record, "status") != b"PENDING")
            ):
                # refused (nothing written), or decided already: take back the queue entry this call
                # added (the queue only: an in-flight entry belongs to the worker handling it)
                await bus.redis.zrem(bus.keys.target(request.to_agent).queue, handoff_id)
            if status is None:
                raise_for_code(code, handoff_id, self.agent_id, "request", None)
            if enqueued == QUEUE_FULL:
                if code == 1:  # created by this call: take it back (unless a resubmission joined it since)
                    await bus.script("withdraw", keys.as_list(), [request.request_id])
                raise_for_code(QUEUE_FULL, handoff_id, self.agent_id, "request", request.to_agent.encode())
            # a new handoff ("" for a routed one: counted by listeners, not in Redis), or one whose
            # creating call's reply was lost, found by its resubmission
            if bus.tally.made(handoff_id, "request", code):
                bus.tally.add(request.to_agent, "requested")
            if code == 1:
                reader.created(waiter, reply[4])
            elif code == 0 and len(reply) > 7:  # joined: responses before its creation are not its own
                reader.began(waiter, int(reply[7]))
            waiter.set_deadline(int(reply[2]), int(reply[3]))
            late = reader.start(reply[4])
            if code == 0 and len(reply) > 6 and int(reply[5]) == 1:  # this resubmission expired it
                if reply[6]:  # its target (none for a routed handoff never offered): settled and counted
                    await bus.settle_expired({reply[6].decode(): [handoff_id]})
                elif not request.to_agent:  # waiting in its set's queue, for no one
                    await bus.drop_routes([(caps, handoff_id)])
            elif status in TERMINAL and request.to_agent:
                await bus.settle(request.to_agent, [handoff_id])
            if status is not HandoffStatus.PENDING or late:
                await self._refresh(waiter)
            return HandoffHandle(self, waiter)
        except BaseException as exc:
            reader.release(waiter)  # no handle came of this call (it failed, or was cancelled)
            if isinstance(exc, QueueFull):
                # its record withdrawn, it left nothing behind that keeps the sweep from unlisting
                # this requester: the next request lists it again at once (other refusals wait for
                # the sweep's second look, Sweeper.recheck_unlisted; a failure of the connection
                # must not send the next request to a node that may not answer)
                bus.forget_requester(self.agent_id)
            raise

    async def _follow_again(self, record: str, follow: list[Call], followed: list[Any]) -> list[Any]:
        """The calls that follow a new record, sent again with backoff while their replies are
        lost with the connection, and only while the record is PENDING: the first sending may
        have queued it, and a worker decided it since (queued again, a decided handoff would
        be taken for nothing; refused at the queue's cap, it would be reported as not created).
        After a few tries the record stands alone, to expire at its deadline, and the caller
        hears the error."""
        backoff = Backoff()
        for _ in range(FOLLOW_TRIES):
            await anyio.sleep(backoff.delay())
            if await self._bus.redis.hget(record, "status") != b"PENDING":  # (its own slot: readable)
                return [0] * len(follow)  # decided: it was queued, and taken
            followed = await self._bus.scripts_many(follow)
            if not any(map(lost_connection, followed)):
                break
        return followed

    async def _route_calls(
        self, handoff_id: str, caps: str, request: HandoffRequest, fail_fast: bool
    ) -> list[tuple[str, list[str], list[Any]]]:
        """What routes a new request, sent right after its record: into its capability set's
        queue, ringing capable agents with room; or, failing fast, straight to REJECTED."""
        router = self._bus.router
        assert request.timeout is not None
        deadline = f"+{int(request.timeout * 1000)}"  # counted by the route script: a few ms after the record's
        if self._bus.isolated is not None:  # the forwarder registers the set and rings capable agents
            return [router.route_call(caps, handoff_id, request.priority, deadline)]
        candidates = Directory.capable(await router.directory.agents(max_age=0 if fail_fast else 1.0), caps)
        if fail_fast and not candidates:
            return [router.unroutable_call(handoff_id, [])]
        await router.register_set(caps)
        return [router.route_call(caps, handoff_id, request.priority, deadline),
                *router.ring_calls(candidates, handoff_id)]

    def handle(self, handoff_id: str) -> HandoffHandle:
        """A handle on a handoff this agent requested earlier (in this process or another)."""
        requester, _ = split_handoff_id(handoff_id)
        if requester != self.agent_id:
            raise NotPermitted(handoff_id, self.agent_id, "await a handoff requested by another agent")
        return HandoffHandle(self, Waiter(handoff_id), holding=False)  # it holds a waiter once awaited

    def _reader(self) -> ResponseReader:
        """This agent's response reader (a bus opened again has a new one)."""
        return self._bus.reader(self.agent_id, self._refresh)

    async def _refresh(self, waiter: Waiter) -> None:
        """Read the record (expiring it if due), feed the waiter and make sure the reader runs."""
        reader = self._reader()
        found = await self._bus.read_record(waiter.handoff_id)
        if found is not None and reader.start(found[1]):  # read before where reading began: once more
            found = await self._bus.read_record(waiter.handoff_id)
        if found is None:  # or not written yet: a waiter is registered before its request
            raise errors.HandoffNotFound(waiter.handoff_id)
        now_ms, _, record = found
        reader.began(waiter, record.created_ms)  # a handle taken on it may not know where it began
        if record.status is HandoffStatus.PENDING:
            waiter.set_deadline(now_ms, record.deadline_ms)
        else:
            waiter.deadline_at = None
        waiter.feed_record(record)
        if waiter.outcome is not None:
            reader.forget(waiter)  # nothing more will come for it

    # ------------------------------------------------------------------ transitions

    async def _transition(
        self, name: str, handoff_id: str, fields: dict[str, Any], *, settle: bool = True, created_ms: int = 0
    ) -> HandoffResponse:
        """Run one transition script and return its response (see ``_transit``)."""
        done = await self._transit(name, handoff_id, fields, settle=settle, created_ms=created_ms)
        return done.response(self._bus.codec) if isinstance(done, Made) else done

    async def _transit(
        self, name: str, handoff_id: str, fields: dict[str, Any], *, settle: bool = True, created_ms: int = 0
    ) -> HandoffResponse | Made:
        """Run one transition script. ``settle`` also takes the handoff out of the target's queue
        and inbox; a worker passes False and settles in its next ``take`` instead (but a routed
        handoff refused and sent on, PENDING, is settled here in any case). A transition made
        now comes back as ``Made``, whose response is built only by a caller that wants it."""
        requester, request_id = split_handoff_id(handoff_id)
        bus = self._bus
        args: list[Any] = [handoff_id, request_id, self.agent_id, bus.config.retention_ms,
                           bus.config.response_retention_ms]
        for key, value in fields.items():
            if value is not None:
                args += [key, value]
        if bus.keyring is not None:
            # an unsigned response would be refused by its requester after the record moved on
            sig = bus.keyring.sign(self.agent_id, "response", [handoff_id, SIGNED_STATUS[name], self.agent_id],
                                   response_body(fields), await self._bus.now_ms(), RESPONSE_VERSION)
            args += ["sig", sig]
            fields = {**fields, "sig": sig}
        if name == "reject":
            args += ["guard", int(bus.config.route_guard * 1000)]
        record_keys = bus.keys.record(requester, request_id).as_list()
        try:
            reply = await bus.script(name, record_keys, args)
        except LOST_CONNECTION as exc:
            if lost_connection(exc):  # it may have run: a repeat answered "made already" is counted
                bus.tally.doubt(handoff_id, name)
            raise
        code = int(reply[0])
        if code == 2:  # a routed handoff refused: it goes on to another capable agent
            # settled at once, whatever ``settle`` says (see Router.send_on); the forwarder does
            # it for an isolated agent, but not for the agent's own request, refused in its own
            # slot: that one it settles itself, and having no directory to route with, leaves
            # to the record's routing guard
            if not bus.forwarded(record_keys):
                final = await bus.router.send_on(self.agent_id, handoff_id, reply, route=bus.isolated is None)
                if final is not None:
                    return final
            return refusal_response(handoff_id, self.agent_id, fields)
        if code == errors.EXPIRED and reply[1]:
            await bus.settle_expired({reply[1].decode(): [handoff_id]})
        if ((code == errors.EXPIRED or (name == "cancel" and code == 1)) and reply[1] == b""
                and not bus.forwarded(record_keys)):
            # a routed handoff that ended (expired by this call, or cancelled) while it waited in
            # its set's queue, offered to no one: out of that queue (an isolated agent's through
            # the forwarder, for its own requests only: another's record it cannot read, and the
            # forwarder unroutes only the sender's; a pull drops that entry)
            caps = await bus.redis.hget(record_keys[0], "caps")
            await bus.drop_routes([((caps or b"").decode(), handoff_id)])
        if code < 0:
            raise_for_code(code, handoff_id, self.agent_id, name, reply[1] if len(reply) > 1 else None,
                           reply[2] if len(reply) > 2 else None)
        # a transition made now answers {1, to, ts, owner}; relayed by a forwarder of a version
        # before that, it comes whole, as a repeated one does
        done: HandoffResponse | Made
        if code == 1 and len(reply) == 4:
            done = Made(handoff_id, MADE_STATUS[name], self.agent_id, reply[2], reply[3], fields)
            at_ms = int(reply[2])
        else:
            done = response_from_reply(handoff_id, reply[2:], bus.codec)
            at_ms = done.timestamp_ms
        if bus.tally.made(handoff_id, name, code):
            bus.tally.transition(self.agent_id, done.status, created_ms, at_ms)
        if settle:
            await bus.settle(reply[1].decode() if reply[1] else self.agent_id, [handoff_id])
        return done

    def _meta(self, metadata: dict[str, Any] | None) -> bytes | None:
        if metadata is None:
            return None
        if not isinstance(metadata, dict):
            raise InvalidRequest("metadata must be a dict")
        return self._bus.codec.dumps_value(metadata)

    async def accept_handoff(self, handoff_id: str, *, metadata: dict[str, Any] | None = None) -> HandoffResponse:
        """Take a PENDING handoff addressed to this agent. It leaves the agent's queue."""
        return await self._transition("accept", handoff_id, {"rmeta": self._meta(metadata)})

    async def reject_handoff(
        self,
        handoff_id: str,
        reason: str,
        *,
        code: str | None = None,
        retry_after_ms: int | None = None,
        redirect_to: str | None = None,
        metadata: dict[str, Any] | None = None,
    ) -> HandoffResponse:
        fields = rejection_fields(reason, code, retry_after_ms, redirect_to)
        return await self._transition("reject", handoff_id, {**fields, "rmeta": self._meta(metadata)})

    async def complete_handoff(
        self, handoff_id: str, result: Any = None, *, metadata: dict[str, Any] | None = None
    ) -> HandoffResponse:
        """Finish an ACCEPTED handoff this agent owns. ``result``: bytes or any msgpack/JSON-able value."""
        packed = None if result is None else self._bus.codec.dumps_value(result)
        return await self._transition("complete", handoff_id, {"result": packed, "rmeta": self._meta(metadata)})

    async def fail_handoff(
        self, handoff_id: str, error: str, *, metadata: dict[str, Any] | None = None
    ) -> HandoffResponse:
        check_text(error, "error")
        return await self._transition("fail", handoff_id, {"error": error, "rmeta": self._meta(metadata)})

    async def cancel_handoff(self, handoff_id: str, *, reason: str | None = None) -> HandoffResponse:
        """Withdraw a PENDING handoff this agent requested."""
        if reason is not None:
            check_text(reason, "reason")
        return await self._transition("cancel", handoff_id, {"reason": reason})

    # ------------------------------------------------------------------ reading

    async def get_handoff_status(self, handoff_id: str) -> HandoffRecord | None:
        """The record with its history, or None. Past its deadline a PENDING one reads EXPIRED."""
        found = await self._bus.read_record(handoff_id)
        return None if found is None else found[2]

    async def get_pending_handoffs(self, agent_id: str | None = None) -> list[PendingHandoff]:
        """PENDING handoffs queued for ``agent_id`` (default, None: this agent), in serving order.

        A queued handoff whose record cannot be decoded (its request is unreadable: corrupt,
        or written by an incompatible codec) is left out with a logged warning, and the rest
        are listed; its worker dead-letters it when it takes it.
        """
        pending, _ = await self._read_pending(agent_id)
        return pending

    async def _read_pending(self, agent_id: str | None) -> tuple[list[PendingHandoff], dict[str, str]]:
        """``get_pending_handoffs``, and the queued handoffs it left out as undecodable, with why."""
        agent = check_name(self.agent_id if agent_id is None else agent_id, "agent id")
        bus = self._bus
        # (a member that is not text, written by hand, is shown escaped, as unreadable)
        handoff_ids = [h.decode(errors="backslashreplace")
                       for h in await bus.redis.zrange(bus.keys.target(agent).queue, 0, -1)]
        rows = await bus.load_records(handoff_ids)
        now_ms = await bus.server_time_ms()
        pending, unreadable = [], {}
        for handoff_id, row in zip(handoff_ids, rows, strict=True):
            if row is None:
                continue
            if row.request is None:  # a poison record, or no handoff's id: one must not hide the others
                log.warning("pending handoffs of %s: left out %s, whose record cannot be decoded: %s",
                            agent, handoff_id, row.error)
                unreadable[handoff_id] = str(row.error)
                continue
            if row.status is not HandoffStatus.PENDING or row.deadline_ms <= now_ms:
                continue
            pending.append(PendingHandoff(
                handoff_id=handoff_id, request=row.request, created_ms=row.created_ms, deadline_ms=row.deadline_ms,
            ))
        return pending, unreadable

    async def list_agents(self) -> list[AgentInfo]:
        """Agents with at least one live worker (beating within its time to live), by agent id."""
        return list(await self._bus.router.directory.agents(max_age=0))

    async def get_dead_letters(self, agent_id: str | None = None, count: int = 100) -> list[DeadLetter]:
        """The dead letters of ``agent_id`` (default, None: this agent), oldest first: at most
        ``count`` (an int of at least 1)."""
        return await deadletters.dead_letters(self._bus, self.agent_id if agent_id is None else agent_id, count)

    async def replay_dead_letter(self, agent_id: str, entry_id: str) -> DeadLetterAction:
        """Queue a dead-lettered handoff for ``agent_id`` again and drop the dead letter.

        A worker carries on from the recorded state. An ACCEPTED one is not queued (a worker
        takes no accepted work from the queue): its new inbox entry waits, as a restored one
        does, for a live worker of the agent to take it over once idle (``reclaim_idle``),
        attempt + 1. The dead letter is dropped alone (the action is false) when the handoff
        has ended or is gone meanwhile, or the entry names no handoff.
        """
        return await deadletters.replay_dead_letter(self._bus, agent_id, entry_id)

    async def fail_dead_letter(self, agent_id: str, entry_id: str, error: str) -> DeadLetterAction:
        """End a dead-lettered ACCEPTED handoff as FAILED with ``error`` (its requester hears it)
        and drop the dead letter: accepted work has no deadline, and its requester may not
        cancel it. A PENDING one raises InvalidTransition (its requester may cancel it, and its
        deadline expires it); one that ended, is gone or names no handoff is dropped alone."""
        return await deadletters.fail_dead_letter(self._bus, agent_id, entry_id, error)

    async def clear_all_handoffs(self, *, confirm: str) -> int:
        """Delete every key of this bus's prefix (and only those). ``confirm`` must equal the prefix."""
        return await self._bus.clear(confirm=confirm)
