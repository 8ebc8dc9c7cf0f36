"""HandoffHandle: what a requester awaits."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .backoff import LOST_CONNECTION, Backoff, lost_connection
from .errors import HandoffNotFound
from .models import TERMINAL, HandoffRecord, HandoffResponse
from .names import split_handoff_id
from .waiters import Waiter, clock

if TYPE_CHECKING:
    from .client import HandoffClient

__all__ = ["HandoffHandle"]

#: Wait this long past the server's deadline before asking the server (which expires it).
_DEADLINE_GRACE = 0.02
#: However a response might have been missed (a reader paused for longer than the response
#: stream's retention), a waiter re-reads the record at least this often.
_SAFETY_REFRESH = 30.0


class HandoffHandle:
    """An awaitable view of one handoff. Responses are pushed; nothing here polls."""

    def __init__(self, client: HandoffClient, waiter: Waiter, *, holding: bool = True) -> None:
        self._client = client
        self._waiter = waiter
        # whether this handle holds its waiter: taken when awaited, let go if the handoff is
        # found gone (a handle never awaited holds nothing, so dropping it leaks nothing)
        self._holding = holding
        # whether the waiter is in step with the record: a request's handle read it when made;
        # one taken anew, or whose read failed or was cancelled, reads it before it waits
        self._synced = holding
        # the waiter's unread responses when this handle last read the record: another since
        # means the record has news the stream could not give
        self._unread = waiter.unread
        self.handoff_id = waiter.handoff_id
        self.request_id = split_handoff_id(waiter.handoff_id)[1]

    @property
    def deadline_at(self) -> float | None:
        """When the acceptance deadline falls, on anyio's clock (``anyio.current_time()``), as
        the server last reported it (None: not known yet, or decided)."""
        return self._waiter.deadline_at

    def __repr__(self) -> str:
        return f"<HandoffHandle {self.handoff_id!r}>"

    def _held(self) -> Waiter:
        """The waiter to wait on, held by this handle: taken anew if it let go, or if responses
        no longer reach it (the bus was closed and opened again). Taken anew, it is not in
        step with the record: what it missed meanwhile is only there (``_sync``)."""
        reader = self._client._reader()
        if not (self._holding and reader.holds(self._waiter)):
            self._waiter = reader.watch(self.handoff_id)
            self._holding = True
            self._synced = False
        return self._waiter

    async def _sync(self, backoff: Backoff) -> None:
        """Read the record into the waiter, unless Redis is out of reach: then the waiter
        stays out of step, and the caller waits a backoff before the next try (the response
        reader rides out the outage too, and a response it reads meanwhile ends the wait)."""
        unread = self._waiter.unread
        try:
            await self._reread()
        except LOST_CONNECTION as exc:
            if not lost_connection(exc):
                raise
            self._synced = False
            return
        self._synced, self._unread = True, unread
        backoff.reset()

    async def decision(self) -> HandoffResponse:
        """ACCEPTED, REJECTED, EXPIRED or CANCELLED; always arrives by the acceptance deadline
        (while Redis can be reached).

        To bound the wait further, wrap it: ``with anyio.fail_after(5): await handle.decision()``.
        """
        return await self._until_known(outcome=False)

    async def outcome(self) -> HandoffResponse:
        """COMPLETED or FAILED, or the decision when it was final (REJECTED, EXPIRED, CANCELLED)."""
        decision = await self.decision()
        if decision.status in TERMINAL:
            return decision
        return await self._until_known(outcome=True)

    def _known(self, outcome: bool) -> HandoffResponse | None:
        return self._waiter.outcome if outcome else self._waiter.decision

    async def _until_known(self, *, outcome: bool) -> HandoffResponse:
        """Wait for the decision (or the outcome): pushed by the reader, or found in the record,
        which is read when the waiter is out of step, at the deadline (a decision: the read
        itself expires it), at least every ``_SAFETY_REFRESH``, and after a backoff while Redis
        is out of reach."""
        backoff = Backoff(cap=2.0)
        while self._known(outcome) is None:
            waiter = self._held()
            if waiter.unread != self._unread:
                self._synced = False
            if not self._synced:
                await self._sync(backoff)
            if self._known(outcome) is not None:
                break
            if not self._synced:
                wait = backoff.delay()
            else:
                wait = _SAFETY_REFRESH
                if not outcome and waiter.deadline_at is not None:
                    wait = min(wait, max(waiter.deadline_at - clock(), 0) + _DEADLINE_GRACE)
            await (waiter.wait_finished if outcome else waiter.wait_decided)(wait)
            if self._known(outcome) is None:
                self._synced = False  # read the record again
        known = self._known(outcome)
        assert known is not None
        return known

    async def _reread(self) -> None:
        """Read the record; not found by then, the handoff is gone and this handle stops
        holding its waiter."""
        try:
            await self._client._refresh(self._waiter)
        except HandoffNotFound:
            if self._holding:
                self._holding = False
                self._client._reader().release(self._waiter)  # a request of this id under way keeps it
            raise

    async def status(self) -> HandoffRecord | None:
        return await self._client.get_handoff_status(self.handoff_id)

    async def cancel(self, reason: str | None = None) -> HandoffResponse:
        return await self._client.cancel_handoff(self.handoff_id, reason=reason)
