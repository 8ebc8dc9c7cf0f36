"""What this process has written to the bus's registries (requesters, targets, capability
sets), so that a burst of requests writes each entry once, not once per request.

An entry is known for ``AGAIN`` seconds, not for good: an operator's ``clear_all_handoffs``
from another process deletes the registries under running processes, and each writes its
entries again within that time (a requester the sweep no longer lists would never hear
EXPIRED pushed; a set workers no longer learn would never be served).
"""

from __future__ import annotations

import time

__all__ = ["Registered"]


class Registered:
    """A set of ids that forgets them all every ``AGAIN`` seconds."""

    #: seconds an id stays known
    AGAIN = 60.0

    __slots__ = ("_ids", "_since")

    def __init__(self) -> None:
        self._ids: set[str] = set()
        self._since = time.monotonic()

    def __contains__(self, name: str) -> bool:
        now = time.monotonic()
        if now - self._since > self.AGAIN:
            self.clear()
            self._since = now
        return name in self._ids

    def add(self, name: str) -> None:
        self._ids.add(name)

    def discard(self, name: str) -> None:
        self._ids.discard(name)

    def clear(self) -> None:
        self._ids.clear()
