"""Every Redis key name handoffbus uses, built in one place.

Keys that belong to one agent carry the agent id as hash tag, ``<prefix>:{<agent>}:...``,
so every script touches a single cluster slot:

- the requester's slot ``{R}`` holds each handoff record it created, the pending marker,
  the deadline index and R's response stream: a transition and the response it emits are
  one atomic script;
- the target's slot ``{T}`` holds T's priority queue, inbox stream, in-flight index,
  sequence counter and doorbell.

See docs/redis-layout.md for every key with redis-cli examples.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DEFAULT_PREFIX", "GROUP", "Keys", "RecordKeys", "RouteKeys", "TargetKeys"]

DEFAULT_PREFIX = "hb"
#: The consumer group every worker of an agent joins on that agent's inbox stream.
GROUP = "workers"
#: the consumer that holds re-issued inbox entries until a live worker claims them once idle
#: (lua/includes/holder.lua's RESTORED)
RESTORED = "_restored"
#: requesters whose shared record keys a Keys keeps (see Keys.record)
_REQUESTERS_KEPT = 4096


@dataclass(frozen=True, slots=True)
class RecordKeys:
    """Keys in the requester's slot for one handoff (KEYS[1..5] of the record scripts)."""

    record: str
    marker: str
    deadlines: str
    responses: str
    envelope: str

    def as_list(self) -> list[str]:
        return [self.record, self.marker, self.deadlines, self.responses, self.envelope]


@dataclass(frozen=True, slots=True)
class TargetKeys:
    """Keys in a target agent's slot (KEYS[1..5] of the queue scripts)."""

    queue: str
    inbox: str
    inflight: str
    seq: str
    bell: str

    def as_list(self) -> list[str]:
        return [self.queue, self.inbox, self.inflight, self.seq, self.bell]


@dataclass(frozen=True, slots=True)
class RouteKeys:
    """Keys in a capability set's routing slot (KEYS[1..4] of the route scripts)."""

    queue: str
    meta: str
    claims: str
    seq: str

    def as_list(self) -> list[str]:
        return [self.queue, self.meta, self.claims, self.seq]


class Keys:
    """Key builder for one bus prefix."""

    def __init__(self, prefix: str = DEFAULT_PREFIX) -> None:
        self.prefix = prefix
        #: requester -> (slot, deadline index, response stream): a handoff's record keys are
        #: built for every call on it, a few times per handoff in a worker
        self._requesters: dict[str, tuple[str, str, str]] = {}

    def slot(self, agent: str) -> str:
        """The key prefix of everything in ``agent``'s hash slot, e.g. ``hb:{billing-1}:``."""
        return f"{self.prefix}:{{{agent}}}:"

    def record(self, requester: str, request_id: str) -> RecordKeys:
        shared = self._requesters.get(requester)
        if shared is None:
            if len(self._requesters) >= _REQUESTERS_KEPT:
                self._requesters.clear()
            shared = self._requesters[requester] = (
                self.slot(requester), self.deadlines(requester), self.responses(requester))
        base, deadlines, responses = shared
        return RecordKeys(f"{base}h:{request_id}", f"{base}p:{request_id}", deadlines, responses,
                          f"{base}e:{request_id}")

    def staged(self, requester: str, request_id: str, nonce: str) -> str:
        """A large request's envelope on its way in: written by a plain SET beside the
        ``request`` script, which renames it to the envelope key if it creates the record and
        deletes it otherwise. ``nonce`` is the call's own, so that two requests with one id
        never meet here."""
        return f"{self.slot(requester)}s:{request_id}:{nonce}"

    def responses(self, requester: str) -> str:
        return f"{self.slot(requester)}responses"

    def deadlines(self, requester: str) -> str:
        return f"{self.slot(requester)}deadlines"

    def target(self, agent: str) -> TargetKeys:
        base = self.slot(agent)
        return TargetKeys(
            queue=f"{base}queue",
            inbox=f"{base}inbox",
            inflight=f"{base}inflight",
            seq=f"{base}seq",
            bell=f"{base}bell",
        )

    def route(self, set_id: str) -> RouteKeys:
        """The routing slot of one capability set. Its hash tag starts with '~', which no agent
        id contains, so a routing slot never shares keys with an agent's."""
        base = f"{self.prefix}:{{~r:{set_id}}}:"
        return RouteKeys(queue=f"{base}route", meta=f"{base}rmeta", claims=f"{base}rclaims", seq=f"{base}rseq")

    @property
    def routes(self) -> str:
        """Hash of every capability set requests were routed by: set id -> capabilities (comma-separated)."""
        return f"{self.prefix}:routes"

    @property
    def grants(self) -> str:
        """Hash agent -> the capabilities it may be routed by (comma-separated), written by the
        forwarder; while it has any entry, an agent is routed only what it claims and was granted."""
        return f"{self.prefix}:grants"

    def outbox(self, agent: str) -> str:
        """Stream of an isolated agent's calls outside its own slot, for the forwarder to run."""
        return f"{self.slot(agent)}outbox"

    def replies(self, agent: str) -> str:
        """Stream of the forwarder's replies to an isolated agent's outbox entries."""
        return f"{self.slot(agent)}replies"

    def dead_letters(self, agent: str) -> str:
        """Stream of handoffs the agent's workers could not handle (undecodable, or crashed too often)."""
        return f"{self.slot(agent)}dead"

    def workers(self, agent: str) -> str:
        """Hash of the agent's registered workers (consumer -> info with its last beat)."""
        return f"{self.slot(agent)}workers"

    def blob(self, requester: str, digest: str) -> str:
        """Large context content of the requester's handoffs, out of band (policies/blobs.py)."""
        return f"{self.slot(requester)}blob:{digest}"

    def stats(self, agent: str) -> str:
        """Hash of the agent's counters and latency histograms (see handoffbus/stats.py)."""
        return f"{self.slot(agent)}stats"

    def counted(self, agent: str, process: str) -> str:
        """Zset of the flush numbers of ``process`` added to the agent's stats (see count-2.lua)."""
        return f"{self.slot(agent)}counted:{process}"

    def worker_beat(self, agent: str, consumer: str) -> str:
        """A worker's heartbeat key: its TTL runs out when the worker stops beating."""
        return f"{self.slot(agent)}w:{consumer}"

    @property
    def agents(self) -> str:
        """Set of agent ids that ever registered a worker (what ``list_agents`` walks)."""
        return f"{self.prefix}:agents"

    @property
    def requesters(self) -> str:
        """Set of agent ids that own handoff records (what the expiry sweep walks)."""
        return f"{self.prefix}:requesters"

    @property
    def unlisted(self) -> str:
        """Zset of requesters the sweep took out of ``requesters`` as idle -> when (server ms):
        each is checked once more a minute later, and listed back if it has work by then."""
        return f"{self.prefix}:unlisted"

    @property
    def targets(self) -> str:
        """Set of agent ids that have a queue."""
        return f"{self.prefix}:targets"

    @property
    def sweep_lease(self) -> str:
        return f"{self.prefix}:sweep-lease"

    def pattern(self) -> str:
        """SCAN pattern matching every key of this prefix (and nothing of another prefix)."""
        return f"{self.prefix}:*"
