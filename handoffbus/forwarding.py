"""Isolated agents: each agent's ACL user reaches only its own slot (see acl.py), and a
trusted forwarder carries what crosses between agents.

An isolated bus (``HandoffBus.connect(url, isolated="agent-id")``) runs every script whose
keys are all in its agent's slot itself. It writes every other script call to its outbox
stream, ``<p>:{agent}:outbox``, and waits for the answer on ``<p>:{agent}:replies``. The
forwarder (``handoffbus forwarder``, connected as the forwarder user) reads every outbox and
checks each call. The sender is the outbox's owner: only that agent's user can write there,
so the identity is verified by the server itself. Each call passes only if it acts as that
sender, on the keys of the handoff it names: a transition's or an offer's actor, an enqueue
of the sender's own handoff to its record's target, a route of its own handoff into its own
capability set, a pull from a set its registered workers serve, a read of a record addressed
to or sent by the sender. What a shared bus's caller does around such calls (registering
agents and capability sets, ringing capable agents, sending a refused handoff on) the
forwarder does. The forwarder then runs it with the same scripts and writes the replies back. The
scripts still decide everything else, so the rules are those of a shared bus.

Calls are retried by a restarted forwarder when it stopped between running them and
acknowledging them. Every forwarded script is idempotent for the same caller, so a retry
changes nothing.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import re
import uuid
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import anyio
import msgspec
from anyio.abc import TaskStatus
from redis.exceptions import RedisError, ResponseError

from .backoff import LOST_CONNECTION, Backoff, lost_connection
from .config import MAX_PRIORITY
from .errors import QUEUE_FULL, CallRefused, ForwarderUnavailable, HandoffbusError, InvalidName
from .models import HandoffRequest, WorkerInfo
from .names import check_name, check_names, split_handoff_id
from .records import text
from .routing import Directory, Reroute, granted, serves, set_id
from .wire import Line, entry_fields, stream_entries

if TYPE_CHECKING:
    from .bus import HandoffBus

__all__ = ["Forwarder", "Outbox"]

log = logging.getLogger("handoffbus")
GROUP = "forwarder"
Call = tuple[str, list[str], list[Any]]
#: transitions: ARGV[3] is the acting agent, which must be the sender
_ACTING = {"accept", "reject", "complete", "fail", "cancel", "reclaim", "release"}
#: how long a stopping forwarder still answers an entry it has started on
ANSWER_WAIT = 10.0
_encode = msgspec.msgpack.Encoder()
_calls = msgspec.msgpack.Decoder(list[tuple[str, list[str], list[Any]]])
_replies = msgspec.msgpack.Decoder(list[tuple[bool, Any]])
_worker_info = msgspec.json.Decoder(WorkerInfo)


class Outbox:
    """An isolated agent's side: runs own-slot calls itself and forwards the rest, in order."""

    def __init__(self, bus: HandoffBus, agent: str, *, timeout: float = 30.0) -> None:
        self._bus = bus
        self.agent = check_name(agent, "agent id")
        self.timeout = timeout
        self._own = bus.keys.slot(agent)
        self._stream, self._replies = bus.keys.outbox(agent), bus.keys.replies(agent)
        self._waiting: dict[str, tuple[anyio.Event, list[bytes]]] = {}
        self._cursor = "$"

    def own(self, keys: Sequence[str]) -> bool:
        return all(key.startswith(self._own) for key in keys)

    async def start(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Read replies (from now on) until cancelled."""
        last = await self._bus.redis.xrevrange(self._replies, count=1)
        self._cursor = last[0][0] if last else "0-0"
        task_status.started()
        await self._bus.reading(self._read)

    async def _read(self, line: Line | None) -> None:
        backoff = Backoff()
        while True:
            try:
                if line is not None:
                    found = await line.command("XREAD", "COUNT", 100, "BLOCK", 1000, "STREAMS", self._replies,
                                               self._cursor, blocks=1.0)
                else:  # a cluster, fakeredis
                    found = await self._bus.blocking_read(
                        self._bus.blocking_redis.xread({self._replies: self._cursor}, block=1000, count=100), 1.0)
            except (RedisError, OSError) as exc:
                log.warning("%s: reading forwarder replies failed (%s)", self.agent, exc)
                await anyio.sleep(backoff.delay())
                continue
            backoff.reset()
            # every process of the agent reads the whole stream and takes its own replies (so
            # none deletes what it read); the forwarder caps the stream's length
            for _, entries in stream_entries(found):
                for entry_id, raw in entries:
                    self._cursor = entry_id
                    fields = entry_fields(raw)
                    waiting = self._waiting.pop(text(fields.get(b"rid", b"")), None)
                    if waiting is not None:
                        waiting[1].append(fields[b"replies"])
                        waiting[0].set()

    async def call_many(self, calls: list[Call], run: Any) -> list[Any]:
        """Each call's reply or exception, in order: runs of own-slot calls go to ``run`` (the
        batcher), runs of the others to the forwarder as one outbox entry."""
        out: list[Any] = []
        i = 0
        while i < len(calls):
            own = self.own(calls[i][1])
            j = i
            while j < len(calls) and self.own(calls[j][1]) == own:
                j += 1
            out += await (run(calls[i:j]) if own else self._forward(calls[i:j]))
            i = j
        return out

    async def _forward(self, calls: list[Call]) -> list[Any]:
        rid = uuid.uuid4().hex
        event, box = anyio.Event(), list[bytes]()
        self._waiting[rid] = (event, box)
        try:
            await self._bus.redis.xadd(self._stream, {"rid": rid, "calls": _encode.encode(calls)})
            with anyio.move_on_after(self.timeout):
                await event.wait()
            if not box:
                raise ForwarderUnavailable(f"no answer from the forwarder within {self.timeout:.0f}s")
        finally:
            self._waiting.pop(rid, None)
        return [value if ok else _error(value) for ok, value in _replies.decode(box[0])]


def _error(value: Any) -> Exception:
    kind, _, message = text(value).partition(":")
    return CallRefused(message) if kind == "forbidden" else ResponseError(message)


def _is_agent_id(name: str) -> bool:
    """Whether a name found in an outbox's key is a valid agent id. The SCAN pattern's ``{*}``
    matches any text, braces included: a key an agent made in its own slot may name another."""
    try:
        check_name(name, "agent id")
    except InvalidName:
        return False
    return True


class Forwarder:
    """The trusted side: reads every isolated agent's outbox, checks each call, runs it."""

    def __init__(self, bus: HandoffBus, agents: Iterable[str] = (), *, discover: float = 2.0,
                 grants: Mapping[str, Iterable[str]] | None = None) -> None:
        """``grants``: agent -> the capabilities the operator grants it, written to Redis
        (``Keys.grants``, replacing what was there) when the forwarder starts, so that every
        bus routes by them. With grants, an agent is routed only what it both claims (its
        workers register) and was granted, and an agent without a grant nothing; with none
        (that hash empty), what its workers claim. None leaves the hash as it is."""
        self._bus = bus
        self._agents = {check_name(a, "agent id") for a in agents}
        self._grants = None if grants is None else {
            check_name(agent, "agent id"): check_names(caps, "capability") for agent, caps in grants.items()}
        self._discover = discover
        self._serving: set[str] = set()
        self._bogus: set[str] = set()  # outbox keys' names that are no agent id, warned about once
        #: calls run and refused, for operators and tests
        self.forwarded = 0
        self.refused = 0

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        bus = self._bus
        if self._grants is not None:
            async with bus.redis.pipeline(transaction=True) as pipe:  # never half written
                pipe.delete(bus.keys.grants)
                if self._grants:
                    pipe.hset(bus.keys.grants, mapping={a: ",".join(caps) for a, caps in self._grants.items()})
                await pipe.execute()
        async with anyio.create_task_group() as tg:
            started = False
            while True:
                found = set(self._agents)
                pattern = f"{bus.keys.prefix}:{{*}}:outbox"
                try:
                    async for key in bus.redis.scan_iter(match=pattern, count=500):
                        agent = text(key)[len(bus.keys.prefix) + 2:-len("}:outbox")]
                        if _is_agent_id(agent):
                            found.add(agent)
                        elif agent not in self._bogus:  # e.g. "mallory}:x{billing-1": never served
                            self._bogus.add(agent)
                            log.warning("forwarder: ignored %s, whose owner is not a valid agent id", text(key))
                except (RedisError, OSError) as exc:
                    log.warning("forwarder: looking for outboxes failed (%s)", exc)
                for agent in sorted(found - self._serving):
                    self._serving.add(agent)
                    try:
                        await tg.start(self._serve, agent)
                    except (RedisError, OSError) as exc:  # e.g. its own user made its outbox no stream
                        self._serving.discard(agent)  # tried again at the next look
                        if agent not in self._bogus:
                            self._bogus.add(agent)
                            log.warning("forwarder: cannot serve %s (%s)", agent, exc)
                try:
                    if await bus.scripts.ensure_loaded(bus.redis):  # the agents may not load them
                        log.warning("forwarder: the server had lost the function library; loaded it again")
                except (RedisError, OSError) as exc:
                    log.warning("forwarder: checking the function library failed (%s)", exc)
                if not started:
                    task_status.started()
                    started = True
                await anyio.sleep(self._discover)  # a timer: new agents are found this often

    async def _serve(self, agent: str, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        bus = self._bus
        stream = bus.keys.outbox(agent)
        try:
            await bus.redis.xgroup_create(stream, GROUP, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
        await bus.redis.sadd(bus.keys.agents, agent)  # what a shared worker does for itself
        task_status.started()
        await bus.reading(functools.partial(self._serve_from, agent, stream))

    async def _serve_from(self, agent: str, stream: str, line: Line | None) -> None:
        bus = self._bus
        cursor = "0"  # first what a previous forwarder took and did not acknowledge, then new entries
        backoff = Backoff()
        while True:
            try:
                if line is not None:
                    block = () if cursor == "0" else ("BLOCK", 1000)
                    found = await line.command("XREADGROUP", "GROUP", GROUP, "forwarder", "COUNT", 100, *block,
                                               "STREAMS", stream, cursor, blocks=1.0 if block else 0.0)
                else:  # a cluster, fakeredis
                    found = await bus.blocking_read(bus.blocking_redis.xreadgroup(
                        GROUP, "forwarder", {stream: cursor}, count=100, block=None if cursor == "0" else 1000), 1.0)
                entries: list[Any] = next(iter(stream_entries(found)), (None, []))[1]
                if cursor == "0" and not entries:
                    cursor = ">"
                    continue
                lost: list[BaseException] = []  # entries left unanswered for a lost connection
                async with anyio.create_task_group() as batch:  # an agent's calls are independent
                    for entry_id, fields in entries:
                        batch.start_soon(self._answer, agent, entry_id, entry_fields(fields), lost)
                if lost:
                    raise lost[0]
            except (RedisError, OSError) as exc:
                log.warning("forwarder: serving %s failed (%s)", agent, exc)
                cursor = "0"  # read what was taken and not acknowledged again
                await anyio.sleep(backoff.delay())
                if isinstance(exc, ResponseError) and "NOGROUP" in str(exc):
                    # the outbox went (a restart without persistence, a flush): make it anew
                    with contextlib.suppress(RedisError, OSError):
                        await bus.redis.xgroup_create(stream, GROUP, id="0", mkstream=True)
                continue
            backoff.reset()

    async def _answer(self, agent: str, entry_id: bytes, fields: dict[bytes, bytes],
                      lost: list[BaseException]) -> None:
        """Run one outbox entry's calls, then reply and acknowledge in one round trip. Whatever
        an entry holds, it is answered: one bad entry never stops the forwarder. An entry the
        server could not be reached for is noted in ``lost``, and read again once it can.
        Shielded (and bounded): a forwarder stopping between running the calls and replying
        would leave the agent waiting out its timeout for calls that were made. An entry not
        answered in that time counts as lost too: left in the group's pending list, it would be
        read again only after the next failure or restart."""
        with anyio.move_on_after(ANSWER_WAIT, shield=True) as bound:
            try:
                await self._answer_now(agent, entry_id, fields)
            except LOST_CONNECTION as exc:
                lost.append(exc)
        if bound.cancelled_caught:
            lost.append(TimeoutError(f"an entry from {agent} was not answered within {ANSWER_WAIT:g}s"))

    async def _answer_now(self, agent: str, entry_id: bytes, fields: dict[bytes, bytes]) -> None:
        bus = self._bus
        count = 1
        try:
            replies = await self._handle(agent, fields)
        except LOST_CONNECTION:
            raise  # not answered: read again once Redis is back
        except Exception as exc:  # a server's error reply too: it would answer the same again
            log.exception("forwarder: an entry from %s failed", agent)
            with contextlib.suppress(Exception):
                count = len(_calls.decode(fields[b"calls"]))  # one answer per call, as the outbox expects
            replies = _encode.encode([(False, f"error:{type(exc).__name__}: {exc}")] * max(count, 1))
        async with bus.redis.pipeline(transaction=False) as pipe:
            pipe.xadd(bus.keys.replies(agent), {"rid": fields.get(b"rid", b""), "replies": replies},
                      maxlen=10_000, approximate=True)
            pipe.xack(bus.keys.outbox(agent), GROUP, entry_id)
            pipe.xdel(bus.keys.outbox(agent), entry_id)
            answered = await pipe.execute(raise_on_error=False)
        for reply in answered:
            if isinstance(reply, Exception):
                if lost_connection(reply):
                    raise reply
                # e.g. the agent's own user made its replies stream no stream: its call is
                # acknowledged (it would fail the same again), and the forwarder goes on
                log.warning("forwarder: answering an entry from %s failed (%s)", agent, reply)

    async def _handle(self, sender: str, fields: dict[bytes, bytes]) -> bytes:
        try:
            calls = _calls.decode(fields[b"calls"])
        except (KeyError, msgspec.DecodeError):
            self.refused += 1
            return _encode.encode([(False, "forbidden:an outbox entry that is not a list of calls")])
        verdicts = [await self._check(sender, call) for call in calls]
        allowed = [self._pinned(call) for call, why in zip(calls, verdicts, strict=True)
                   if why is None and call[0] != "unroute"]
        results: list[Any] = await self._bus.scripts_many(allowed) if allowed else []
        for result in results:
            if lost_connection(result):  # run or not: the entry is read again, and run again (idempotent)
                raise result
        out: list[tuple[bool, Any]] = []
        for call, why in zip(calls, verdicts, strict=True):
            if why is not None:
                self.refused += 1
                log.warning("forwarder: refused %s from %s: %s", call[0], sender, why)
                out.append((False, f"forbidden:{why}"))
                continue
            self.forwarded += 1
            result = await self._unroute(call) if call[0] == "unroute" else results.pop(0)
            out.append((False, f"error:{result}") if isinstance(result, BaseException) else (True, result))
            if not isinstance(result, BaseException):
                try:
                    await self._after(sender, call, result)
                except Exception as exc:  # the call ran: its answer stands (a routing lost here is
                    # made again by the record's routing guard; a doorbell is only a hint)
                    log.warning("forwarder: what follows %s from %s failed (%s: %s)", call[0], sender,
                                type(exc).__name__, exc)
        return _encode.encode(out)

    async def _unroute(self, call: Call) -> Any:
        """Take the sender's ended routed handoffs out of their set's queue (what a shared bus
        does itself, ``HandoffBus.drop_routes``): the number of entries removed, or the error."""
        _, keys, args = call
        try:
            async with self._bus.redis.pipeline(transaction=False) as pipe:
                pipe.zrem(keys[0], *args)
                pipe.hdel(keys[1], *args)
                removed, _ = await pipe.execute()
        except LOST_CONNECTION:
            raise  # not answered: read again once Redis is back
        except RedisError as exc:
            return exc
        return removed

    async def _after(self, sender: str, call: Call, result: Any) -> None:
        """What a shared bus's caller does around the call, and an isolated one cannot."""
        bus, (name, keys, args) = self._bus, call
        if name == "enqueue":
            if result != QUEUE_FULL:  # refused: its record is taken back, nothing of it to sweep (and
                # remembered as listed, the requester would not be listed by its next request)
                await bus.register_requester(sender)
            await bus.register_target(self._target_of(keys))
        elif name == "route":
            await bus.register_requester(sender)
            handoff_id = text(args[0])
            caps = await bus.redis.hget(bus.keys.record(*split_handoff_id(handoff_id)).record, "caps")
            await bus.router.register_set(text(caps))
            candidates = Directory.capable(await bus.router.directory.agents(), text(caps))
            rings = bus.router.ring_calls(candidates, handoff_id)
            if rings:
                await bus.scripts_many(rings)
        elif name == "reject" and isinstance(result, list) and result and int(result[0]) == 2:
            await bus.router.send_on(sender, text(args[0]), result)  # a refusal sends it on
        elif name == "release" and isinstance(result, list) and result and int(result[0]) == 2:
            await bus.router.send_back(text(args[0]), result)  # its worker settled its entry first
        elif name == "assign" and isinstance(result, list) and result and int(result[0]) == 2:
            stale = Reroute.read(result[2:9], f"forwarder (assign by {sender})")  # pulled from a stale queue entry
            if stale is not None:
                await bus.router.reroute([stale])

    def _pinned(self, call: Call) -> Call:
        """The call with what the bus decides rather than the caller: retention times (they
        trim the requester's whole response stream), the target's queue cap, a new
        request's routing terms, and how long a pull's claims last. The caller chooses only
        what its own request asks."""
        name, keys, args = call
        config, args = self._bus.config, list(args)
        if name in _ACTING and name != "reclaim":
            args[3:5] = [config.retention_ms, config.response_retention_ms]
            if name == "release":
                args[5:6] = [int(config.route_guard * 1000)]
        elif name == "assign":
            args[4:6] = [config.retention_ms, config.response_retention_ms]
        elif name == "enqueue":
            args[2:3] = [config.max_queued]
        elif name == "pull":  # a claim hides the handoffs it took from every other agent of the set
            args[2:3] = [int(config.route_claim * 1000)]
        elif name == "route":
            wait = min(int(text(args[2])[1:]), int(config.max_timeout * 1000))
            args[2:7] = [f"+{wait}", ",", ",", int(config.route_age_step * 1000), 0]
        return name, keys, args

    def _target_of(self, keys: Sequence[str]) -> str:
        prefix = self._bus.keys.prefix
        return keys[0][len(prefix) + 2:keys[0].index("}:")]

    async def _check(self, sender: str, call: Call) -> str | None:
        """None if ``sender`` may make this call, else why not."""
        bus = self._bus
        name, keys, args = call
        try:
            if name in _ACTING or name == "assign":
                handoff_id, actor = text(args[0]), text(args[2])
                requester, request_id = split_handoff_id(handoff_id)
                if actor != sender:
                    return f"{name} acting as {actor!r}"
                if text(args[1]) != request_id or keys != bus.keys.record(requester, request_id).as_list():
                    return f"{name} on keys that are not {handoff_id!r}'s"
                if name == "assign":  # taking a routed handoff: only by an agent that serves its set
                    caps = text(await bus.redis.hget(keys[0], "caps") or b"")
                    if not serves(await self._capabilities(sender), caps):
                        return f"assign of {handoff_id!r}, whose capabilities {sender!r} does not serve"
                return None
            if name == "load":
                handoff_id = _handoff_of_record_key(bus, keys)
                requester, _ = split_handoff_id(handoff_id)
                to = await bus.redis.hget(keys[0], "to")
                if sender in (requester, text(to or b"")):
                    return None
                return f"load of {handoff_id!r}, which is not addressed to or sent by {sender!r}"
            if name == "blob":  # out-of-band content of a handoff's context, read by its target
                if len(keys) != 2:
                    return "blob read with keys that are not a blob's and its handoff's record"
                requester, request_id = split_handoff_id(_handoff_of_record_key(bus, keys[1:2], envelope=False))
                if not keys[0].startswith(f"{bus.keys.slot(requester)}blob:"):
                    return f"blob read of {keys[0]!r}, which is not {requester!r}'s out-of-band content"
                to, status, inline = await bus.redis.hmget(keys[1], ["to", "status", "env"])
                if sender not in (requester, text(to or b"")):
                    return f"blob read for {requester}/{request_id}, which is not addressed to or sent by {sender!r}"
                if status not in (b"PENDING", b"ACCEPTED"):
                    return f"blob read for {requester}/{request_id}, which is {text(status or b'gone')}"
                envelope = inline or await bus.redis.get(bus.keys.record(requester, request_id).envelope)
                snapshot = bus.codec.loads(envelope or b"", HandoffRequest).context_snapshot or b""
                if keys[0].encode() not in snapshot:  # a blob is named by its content's digest: no guessing
                    return f"blob read of {keys[0]!r}, which {requester}/{request_id}'s context does not refer to"
                return None
            if name in ("enqueue", "route") and not _priority(args[1]):
                return f"{name} with a priority that is not an int in [-{MAX_PRIORITY}, {MAX_PRIORITY}]"
            if name == "route" and not re.fullmatch(r"\+\d{1,15}", text(args[2])):
                return "route of a new request with a deadline that is not '+<ms>'"
            if name in ("enqueue", "settle"):
                target = self._target_of(keys)
                if keys != bus.keys.target(target).as_list():
                    return f"{name} on keys that are not an agent's queue"
                ids = [text(a) for a in (args[:1] if name == "enqueue" else args[1:])]  # settle: group, ids
                for handoff_id in ids:
                    requester, request_id = split_handoff_id(handoff_id)
                    to = await bus.redis.hget(bus.keys.record(requester, request_id).record, "to")
                    if requester != sender or text(to or b"") != target:
                        return f"{name} of {handoff_id!r}, which {sender!r} did not send to {target!r}"
                return None
            if name == "unroute":  # the sender's own routed handoffs that ended, out of their set's queue
                sid = self._set_of(keys)
                if not args:
                    return "unroute of no handoff"
                for arg in args:
                    handoff_id = text(arg)
                    requester, request_id = split_handoff_id(handoff_id)
                    if requester != sender:  # (no read of another's record)
                        return f"unroute of {handoff_id!r}, which {sender!r} did not send"
                    status, caps = await bus.redis.hmget(bus.keys.record(requester, request_id).record,
                                                         ["status", "caps"])
                    if status == b"PENDING":
                        return f"unroute of {handoff_id!r}, which is still pending"
                    if caps is not None and set_id(text(caps)) != sid:
                        return f"unroute of {handoff_id!r}, which {sender!r} did not send to that capability set"
                return None
            if name in ("route", "pull"):
                sid = self._set_of(keys)
                caps = text(await bus.redis.hget(bus.keys.routes, sid) or b"")
                if name == "route":
                    handoff_id = text(args[0])
                    requester, request_id = split_handoff_id(handoff_id)
                    record_caps = await bus.redis.hget(bus.keys.record(requester, request_id).record, "caps")
                    if requester != sender or set_id(text(record_caps or b"")) != sid:
                        return f"route of {handoff_id!r}, which {sender!r} did not send to that capability set"
                    return None
                if text(args[0]) != sender:
                    return f"pull acting as {text(args[0])!r}"
                if not caps or not serves(await self._capabilities(sender), caps):
                    return f"pull from a capability set {sender!r} does not serve"
                return None
        except (IndexError, ValueError, HandoffbusError) as exc:
            return f"malformed {name}: {exc}"
        return f"{name} is not forwarded"

    def _set_of(self, keys: Sequence[str]) -> str:
        base = f"{self._bus.keys.prefix}:{{~r:"
        sid = keys[0][len(base):keys[0].index("}:")] if keys and keys[0].startswith(base) else ""
        if not sid or list(keys) != self._bus.keys.route(sid).as_list():
            raise ValueError("not a capability set's routing keys")
        return sid

    async def _capabilities(self, agent: str) -> set[str]:
        """What the agent's registered workers say it can do, and it was granted (if grants are set)."""
        bus = self._bus
        async with bus.redis.pipeline(transaction=False) as pipe:
            pipe.hgetall(bus.keys.workers(agent))
            pipe.hgetall(bus.keys.grants)
            table, grants = await pipe.execute()
        return granted(grants, agent, {c for raw in table.values() for c in _worker_info.decode(raw).capabilities})


def _priority(value: Any) -> bool:
    """Whether ``value`` is a priority: an int in range (the scores rely on it; the bus's own
    calls carry ints)."""
    return type(value) is int and -MAX_PRIORITY <= value <= MAX_PRIORITY


def _handoff_of_record_key(bus: HandoffBus, keys: Sequence[str], *, envelope: bool = True) -> str:
    """The handoff whose record and envelope keys these are (a load's two keys; a record key
    alone with ``envelope=False``)."""
    if len(keys) != (2 if envelope else 1):
        raise ValueError("a record key and its envelope key expected" if envelope else "a record key expected")
    prefix = f"{bus.keys.prefix}:{{"
    key = keys[0]
    if not key.startswith(prefix) or "}:h:" not in key:
        raise ValueError(f"{key!r} is not a record key")
    requester, _, request_id = key[len(prefix):].partition("}:h:")
    if envelope and keys[1] != bus.keys.record(requester, request_id).envelope:
        raise ValueError(f"{keys[1]!r} is not the envelope of {key!r}")
    return f"{requester}/{request_id}"
