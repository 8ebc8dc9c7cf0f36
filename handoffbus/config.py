"""Bus-wide settings, validated once."""

from __future__ import annotations

import re

import msgspec

from .codecs import DEFAULT_COMPRESS_THRESHOLD, DEFAULT_PAYLOAD_LIMIT, PayloadCodec
from .errors import InvalidRequest
from .keys import DEFAULT_PREFIX
from .registered import Registered

__all__ = ["MAX_PRIORITY", "MAX_SWEEP_BATCH", "MIN_REQUESTER_IDLE", "BusConfig", "check_seconds"]

#: Priorities run from -MAX_PRIORITY to MAX_PRIORITY (see lua/enqueue-5.lua for why).
MAX_PRIORITY = 1000
#: The largest sweep batch: the sweep script hands it to ZRANGEBYSCORE ... LIMIT as a Lua number,
#: which Redis writes out in exponent form (an error) from 2^53 on; and one script call over
#: millions of deadlines would stall the server.
MAX_SWEEP_BATCH = 1_000_000
#: The longest duration a setting may take: ten years, in seconds.
MAX_SECONDS = 10 * 365 * 24 * 3600.0
#: The longest route_age_step: 30 days, in seconds. A routed handoff's score,
#: (requested ms + priority x step ms) x 1024 + n (see lua/route-4.lua), is a double: past 2^53
#: the ticks of one millisecond would share a score, and FIFO within a priority would be lost
#: (1000 x 30 days plus the time now stays below 2^53 / 1024 until about 2160).
MAX_ROUTE_AGE_STEP = 30 * 24 * 3600.0
#: The shortest requester_idle: twice the time a process keeps a requester as listed. A requester
#: unlisted after that long without a request is listed again by the next request of any
#: process, whichever version it runs (see Sweeper.unlist_idle).
MIN_REQUESTER_IDLE = 2 * Registered.AGAIN


def check_seconds(name: str, value: object, least: float = 0.001) -> None:
    """Raise InvalidRequest unless ``value`` is a number of seconds from ``least`` to
    MAX_SECONDS. Redis takes milliseconds: under one would round to 0, which means "forever" to
    XREAD BLOCK and "release" to the sweep lease; past MAX_SECONDS, or inf or NaN, breaks timers."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not least <= value <= MAX_SECONDS:
        raise InvalidRequest(f"{name} must be a number of seconds from {least:g} to {MAX_SECONDS:.0f}")


class BusConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Settings shared by every client of a bus. Times are in seconds."""

    prefix: str = DEFAULT_PREFIX
    default_timeout: float = 300.0
    max_timeout: float = 7 * 24 * 3600.0
    record_retention: float = 24 * 3600.0
    response_retention: float = 3600.0
    codec: str = "msgpack"
    compress_threshold: int = DEFAULT_COMPRESS_THRESHOLD
    payload_limit: int = DEFAULT_PAYLOAD_LIMIT
    sweep_interval: float = 0.25
    sweep_lease: float = 2.0
    sweep_batch: int = 500
    read_block: float = 5.0
    #: a bus whose user the server refuses scripts (acl.py's monitor) reads with plain
    #: commands and does not sweep; this long after a refusal it tries the scripts again, so
    #: that widening the user's ACL takes effect without a restart
    scripts_recheck: float = 60.0
    #: capability routing: what one priority level is worth in waiting time (the ageing that
    #: keeps low priorities moving), how long an offer to a chosen agent stands before it is
    #: routed elsewhere, how long a pulling worker's claim lasts, and the routing guard
    route_age_step: float = 1.0
    offer_time: float = 30.0
    route_claim: float = 10.0
    route_guard: float = 5.0
    #: backpressure: a new request to an agent with this many handoffs queued or in flight
    #: raises QueueFull (0 = no cap)
    max_queued: int = 100_000
    #: a requester with this many undecided handoffs gets TooManyPending (0 = no cap)
    max_pending: int = 100_000
    #: a requester with nothing pending and no response written for this long leaves the
    #: requesters set, which every sweep pass walks (its next request lists it again); more
    #: than ``MIN_REQUESTER_IDLE``, as a process lists a requester again only a minute after
    #: it last did (0: requesters stay listed)
    requester_idle: float = 600.0

    def __post_init__(self) -> None:
        if not isinstance(self.prefix, str) or not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", self.prefix):
            raise InvalidRequest(f"invalid key prefix {self.prefix!r}: use letters, digits, '_.-'")
        for name in ("default_timeout", "max_timeout", "record_retention", "response_retention",
                     "sweep_interval", "sweep_lease", "read_block", "scripts_recheck", "route_age_step",
                     "offer_time", "route_claim", "route_guard"):
            check_seconds(name, getattr(self, name))
        if self.route_age_step > MAX_ROUTE_AGE_STEP:
            raise InvalidRequest(f"route_age_step must be at most {MAX_ROUTE_AGE_STEP:.0f} seconds (30 days): "
                                 "a larger one would lose FIFO order within a priority")
        if self.default_timeout > self.max_timeout:
            raise InvalidRequest("default_timeout exceeds max_timeout")
        for name in ("sweep_batch", "max_queued", "max_pending"):
            value = getattr(self, name)
            least = 1 if name == "sweep_batch" else 0  # the caps: 0 is no cap
            if type(value) is not int or value < least:
                raise InvalidRequest(f"{name} must be an int of at least {least}, not {value!r}")
        if self.requester_idle != 0:
            check_seconds("requester_idle", self.requester_idle)
            if self.requester_idle < MIN_REQUESTER_IDLE:
                raise InvalidRequest(f"requester_idle must be 0 (never) or at least {MIN_REQUESTER_IDLE:.0f} "
                                     f"seconds, not {self.requester_idle!r}")
        if self.sweep_batch > MAX_SWEEP_BATCH:
            raise InvalidRequest(f"sweep_batch must be at most {MAX_SWEEP_BATCH}, not {self.sweep_batch!r}")
        # the codec, payload_limit and compress_threshold: checked by the codec they make
        PayloadCodec(self.codec, compress_threshold=self.compress_threshold, limit=self.payload_limit)

    def make_codec(self) -> PayloadCodec:
        return PayloadCodec(self.codec, compress_threshold=self.compress_threshold, limit=self.payload_limit)

    @property
    def retention_ms(self) -> int:
        return int(self.record_retention * 1000)

    @property
    def response_retention_ms(self) -> int:
        return int(self.response_retention * 1000)
