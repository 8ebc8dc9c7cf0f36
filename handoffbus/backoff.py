"""Backoff for the loops that must outlive a Redis outage, failover or restart."""

from __future__ import annotations

import random

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ReadOnlyError
from redis.exceptions import TimeoutError as RedisTimeoutError

__all__ = ["LOST_CONNECTION", "Backoff", "lost_connection"]

#: Redis out of reach for now, worth waiting out: a lost connection, a timeout, a failover's
#: READONLY (OSError covers sockets). A forwarder's refusal is an OSError too (PermissionError):
#: an answer, not a loss; ``lost_connection`` and callers that catch these leave it out.
LOST_CONNECTION = (RedisConnectionError, RedisTimeoutError, ReadOnlyError, OSError)


def lost_connection(exc: object) -> bool:
    """Whether ``exc`` (a call's error or reply) says the server could not be reached."""
    return isinstance(exc, LOST_CONNECTION) and not isinstance(exc, PermissionError)


class Backoff:
    """Exponential delays with jitter: each wait is drawn from [d/2, d] and d doubles up to
    ``cap``, so a fleet of workers that lost the same server does not reconnect in step."""

    def __init__(self, first: float = 0.05, cap: float = 2.0) -> None:
        self.first = first
        self.cap = cap
        self._next = first

    def delay(self) -> float:
        """The next wait, in seconds."""
        current = self._next
        self._next = min(self._next * 2, self.cap)
        return current * (0.5 + random.random() / 2)

    def reset(self) -> None:
        """Call after a success: the next failure waits ``first`` again."""
        self._next = self.first
