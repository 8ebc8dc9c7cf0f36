"""Push delivery of responses to the requester: one reader per requester agent per bus.

Each reader blocks on its agent's response stream with XREAD and hands every entry to the
waiter for that handoff id. A waiter is registered before its request is written, and the
reader starts from the stream position the request script returned, so no response can
slip between writing a request and reading its answer. Many waiters share one reader and
one connection; no waiter polls.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import anyio
import msgspec
from redis.exceptions import RedisError

from .backoff import Backoff
from .errors import HandoffbusError, HandoffNotFound
from .models import DECISIONS, TERMINAL, HandoffRecord, HandoffResponse, HandoffStatus
from .records import response_from_fields
from .wire import Line, entry_fields, stream_entries

if TYPE_CHECKING:
    from .bus import HandoffBus

__all__ = ["ResponseReader", "Waiter", "clock"]

log = logging.getLogger("handoffbus")
#: responses one read of the stream takes at most
READ_COUNT = 512


def entry_position(entry_id: bytes | str) -> tuple[int, int]:
    """A stream entry id as (ms, sequence), to compare two ids."""
    if isinstance(entry_id, str):
        text_ms, _, text_seq = entry_id.partition("-")
        return int(text_ms), int(text_seq or 0)
    ms, _, seq = entry_id.partition(b"-")
    return int(ms), int(seq or 0)


def clock() -> float:
    """``anyio.current_time()`` on asyncio, read from the loop directly: the bus runs on asyncio
    only, and anyio's lookup of the running backend costs several times the read."""
    return asyncio.get_running_loop().time()


class Waiter:
    """What the requester knows of one handoff, and the tasks waiting to hear more.

    A wait is a future with a timer, not an anyio cancel scope and event: a requester waits
    twice per handoff, and the scope costs about three times as much. Outer cancellation
    reaches the future as any await."""

    __slots__ = ("_derived", "_on_decision", "_on_outcome", "deadline_at", "decision", "handoff_id", "heard", "holders",
                 "outcome", "since", "unread")

    def __init__(self, handoff_id: str) -> None:
        self.handoff_id = handoff_id
        self.decision: HandoffResponse | None = None
        self.outcome: HandoffResponse | None = None
        self._on_decision: list[asyncio.Future[None]] = []
        self._on_outcome: list[asyncio.Future[None]] = []
        #: anyio clock time at which the server's acceptance deadline falls, while PENDING.
        self.deadline_at: float | None = None
        #: the requests and handles watching it (see ResponseReader.release)
        self.holders = 0
        #: the response stream's last entry when the handoff was created: entries up to it
        #: belong to an earlier handoff under the same id (its record expired since)
        self.since: tuple[int, int] | None = None
        #: the response stream entry it last heard from
        self.heard: tuple[int, int] | None = None
        #: responses for it the reader could not read (see ``nudge``)
        self.unread = 0
        #: whether ``decision`` was made up from the outcome (its ACCEPTED entry not heard): the
        #: record's, with the acceptance's own time and metadata, replaces it when read
        self._derived = False

    async def wait_decided(self, limit: float) -> None:
        """Until the decision is known, or for ``limit`` seconds at most."""
        if self.decision is None:
            await _wait(self._on_decision, limit)

    async def wait_finished(self, limit: float) -> None:
        """Until the outcome is known, or for ``limit`` seconds at most."""
        if self.outcome is None:
            await _wait(self._on_outcome, limit)

    def set_deadline(self, now_ms: int, deadline_ms: int) -> None:
        """The acceptance deadline, as the server read it; none once decided (a decision can
        arrive before the request's own reply is read)."""
        if self.decision is None:
            self.deadline_at = clock() + max(deadline_ms - now_ms, 0) / 1000

    def nudge(self) -> None:
        """A response for it reached the stream but could not be read: every handle reads the
        record before it waits again (the waiting ones now)."""
        self.unread += 1
        _wake(self._on_decision)
        _wake(self._on_outcome)

    def feed(self, response: HandoffResponse) -> None:
        if self.decision is None:
            if response.status in DECISIONS:
                self.decision = response
            elif response.status in TERMINAL:
                # the ACCEPTED entry was not seen (attached late): derive it from the outcome
                self.decision = msgspec.structs.replace(
                    response, status=HandoffStatus.ACCEPTED, result=None, error=None, metadata={}
                )
                self._derived = True
            if self.decision is not None:
                self.deadline_at = None  # decided: no deadline to wait for
                _wake(self._on_decision)
        if self.outcome is None and response.status in TERMINAL:
            self.outcome = response
            _wake(self._on_outcome)

    def feed_record(self, record: HandoffRecord) -> None:
        if record.status is HandoffStatus.PENDING:
            return
        if (self.decision is None or self._derived) and record.status is not HandoffStatus.ACCEPTED and record.terminal:
            accepted = next((h for h in record.history if h.status is HandoffStatus.ACCEPTED), None)
            if accepted is not None:
                if self._derived:  # the record tells the acceptance whole
                    self.decision, self._derived = None, False
                self.feed(msgspec.structs.replace(
                    record.response, status=HandoffStatus.ACCEPTED, actor=accepted.actor,
                    result=None, error=None, metadata=record.accepted_metadata, timestamp_ms=accepted.at_ms,
                ))
        self.feed(record.response)


async def _wait(waiting: list[asyncio.Future[None]], limit: float) -> None:
    loop = asyncio.get_running_loop()
    future = loop.create_future()
    waiting.append(future)
    timer = loop.call_later(limit, _release, future)
    try:
        await future
    finally:
        timer.cancel()
        if future in waiting:  # timed out or cancelled: no longer waiting
            waiting.remove(future)


def _release(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def _wake(waiting: list[asyncio.Future[None]]) -> None:
    for future in waiting:
        _release(future)
    waiting.clear()


class ResponseReader:
    """Reads one requester's response stream and wakes the waiters of its handoffs."""

    def __init__(self, bus: HandoffBus, agent: str, refresh: Callable[[Waiter], Awaitable[None]]) -> None:
        self._bus = bus
        self._agent = agent
        self._stream = bus.keys.responses(agent)
        self._refresh = refresh
        self._waiters: dict[str, Waiter] = {}
        self._cursor: bytes | None = None
        self._started = b"0-0"  # where reading began

    def watch(self, handoff_id: str) -> Waiter:
        """The handoff's waiter, held once more until ``release`` (or its outcome)."""
        waiter = self._waiters.get(handoff_id)
        if waiter is None:
            waiter = self._waiters[handoff_id] = Waiter(handoff_id)
        waiter.holders += 1
        return waiter

    def watching(self, handoff_id: str) -> bool:
        return handoff_id in self._waiters

    def holds(self, waiter: Waiter) -> bool:
        """Whether responses reach ``waiter`` (it may have been let go, or the bus reopened)."""
        return self._waiters.get(waiter.handoff_id) is waiter

    def created(self, waiter: Waiter, cursor: bytes) -> None:
        """The request holding ``waiter`` created its handoff after ``cursor``: entries up to it
        belong to an earlier handoff under the same id (its record expired since). Those the
        reader has yet to pass on are ignored from now; what the waiter heard from them already
        is dropped, and it listens again. What it heard after them is its own: a handoff's
        responses can come before its request returns."""
        self._since(waiter, entry_position(cursor))

    def began(self, waiter: Waiter, created_ms: int) -> None:
        """``created`` for a request that joined the handoff, or a handle on it, which did not
        see where the stream stood: its record was created at ``created_ms`` (Redis time), and
        entries of an earlier millisecond belong to an earlier handoff under the same id."""
        position = (created_ms - 1, 2**64)
        if waiter.since is None or waiter.since < position:
            self._since(waiter, position)

    def _since(self, waiter: Waiter, since: tuple[int, int]) -> None:
        waiter.since = since
        if waiter.heard is not None and waiter.heard <= since:
            waiter.decision = waiter.outcome = waiter.heard = None
            waiter._derived = False
            self._waiters.setdefault(waiter.handoff_id, waiter)

    def release(self, waiter: Waiter) -> None:
        """A request that failed, or a handle that found its handoff gone, lets its hold go: the
        waiter is forgotten once no request or handle holds it (two requests with one id may be
        under way at once, and the one that fails must not take the waiter from the other)."""
        waiter.holders -= 1
        if waiter.holders <= 0:
            self.forget(waiter)

    def close(self) -> None:
        """The bus closed: every task waiting on a waiter wakes, to find the bus closed."""
        for waiter in self._waiters.values():
            _wake(waiter._on_decision)
            _wake(waiter._on_outcome)

    def forget(self, waiter: Waiter) -> None:
        if self._waiters.get(waiter.handoff_id) is waiter:
            del self._waiters[waiter.handoff_id]

    def start(self, cursor: bytes) -> bool:
        """Start reading after ``cursor`` unless already reading. True when the reading started
        after ``cursor`` (another caller started it first, from a later point): entries between
        the two were never read, and the caller must read its record again."""
        if self._cursor is None:
            self._cursor = self._started = cursor
            self._bus.spawn(self._run, name=f"handoffbus responses {self._agent}")
            return False
        return entry_position(self._started) > entry_position(cursor)

    def _dispatch(self, fields: dict[bytes, bytes], entry_id: bytes) -> None:
        handoff_id = fields[b"id"].decode()
        waiter = self._waiters.get(handoff_id)
        if waiter is None:
            return
        position = entry_position(entry_id)
        if waiter.since is not None and position <= waiter.since:
            return
        waiter.heard = position
        try:
            # with a keyring a response without its actor's signature raises here: it is logged and not believed
            response = response_from_fields(handoff_id, fields, self._bus.codec, self._bus.keyring, position[0])
        except HandoffbusError:
            waiter.nudge()  # its handles read the record now: it says what this entry could not (or raises)
            raise
        waiter.feed(response)
        if waiter.outcome is not None:
            self.forget(waiter)

    async def _resync(self) -> None:
        """Re-read every watched record after a gap in reading (the refresh forgets waiters
        that got their outcome). A record not found stays watched: its request may not be
        written yet, and its handle finds out at the deadline. A record that cannot be read is
        logged; only Redis errors end the pass, to be tried again."""
        for waiter in list(self._waiters.values()):
            try:
                await self._refresh(waiter)
            except HandoffNotFound:
                continue
            except HandoffbusError:
                log.exception("response reader for %s: cannot read %s", self._agent, waiter.handoff_id)

    async def _run(self) -> None:
        await self._bus.reading(self._read)

    async def _read(self, line: Line | None) -> None:
        redis = self._bus.blocking_redis
        block_ms = int(self._bus.config.read_block * 1000)
        retention_ms = self._bus.config.response_retention_ms
        backoff = Backoff(cap=2.0)
        while True:
            assert self._cursor is not None
            try:
                if line is not None:  # one server: the reply as it comes, entries as flat lists
                    reply = await line.command("XREAD", "COUNT", READ_COUNT, "BLOCK", block_ms,
                                               "STREAMS", self._stream, self._cursor, blocks=block_ms / 1000)
                else:
                    reply = await self._bus.blocking_read(
                        redis.xread({self._stream: self._cursor}, count=READ_COUNT, block=block_ms), block_ms / 1000)
            except (RedisError, OSError) as exc:
                # connection lost, server restarted, or a failover's UNBLOCKED/READONLY/LOADING
                log.warning("response reader for %s: %s; retrying", self._agent, exc)
                await anyio.sleep(backoff.delay())
                try:
                    await self._resync()
                except (RedisError, OSError):
                    continue
                backoff.reset()
                continue
            if not reply and not self._waiters:
                # a whole read_block without a response or anyone waiting: the reader retires,
                # with its task and connection (one per requester id a process ever used would
                # add up); the next request of this requester starts a new one
                self._bus.drop_reader(self._agent, self)
                return
            trimmed = full = False
            before = entry_position(self._cursor)
            for _stream, entries in stream_entries(reply):
                # each XADD trims the stream below its time less the retention: one that far past
                # the cursor may have trimmed entries this reader had yet to read (it lagged). A
                # cursor of 0 is a stream that was empty when reading began: nothing read yet
                if entries and 0 < before[0] < entry_position(entries[-1][0])[0] - retention_ms:
                    trimmed = True
                full = len(entries) >= READ_COUNT
                for entry_id, fields in entries:
                    self._cursor = entry_id
                    try:
                        self._dispatch(entry_fields(fields), entry_id)
                    except Exception:
                        log.exception("undecodable response %r on %s", entry_id, self._stream)
            if full and not trimmed and before[0] > 0:
                # more was waiting than one read takes, and entries past this read may have
                # trimmed some of it (the check above sees as far as this read). Trimming takes
                # the oldest first: nothing unread went if the stream still begins at or before
                # where this read began.
                try:
                    first = await self._bus.redis.xrange(self._stream, count=1)
                    trimmed = bool(first) and entry_position(first[0][0]) > before
                except (RedisError, OSError):
                    trimmed = True  # not known: the records say
            if trimmed:  # what was trimmed is on the records
                try:
                    await self._resync()
                except (RedisError, OSError) as exc:
                    log.warning("response reader for %s: %s; the records are read again at the safety refresh",
                                self._agent, exc)
