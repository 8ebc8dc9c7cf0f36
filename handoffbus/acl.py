"""Redis ACL users for a bus: one per agent, one for the forwarder, one for monitoring.

An agent's user may touch only its own slot's keys, ``<prefix>:{<agent>}:*`` (and read the
list of routed capability sets, ``<prefix>:routes``), with only the commands the bus runs.
That rules out two holes a narrower grant would leave on Redis 7.0: XREADGROUP needs only
read permission, so read access to a peer's stream lets an agent take
the peer's handoffs into its own pending list; and XADD with ``MAXLEN 0`` empties a stream,
so write access to a peer's stream lets an agent wipe it. An agent therefore never reads or
writes a peer's keys; handoffs between agents cross over through a trusted forwarder, whose
user alone reaches every key of the prefix. The monitoring user only reads.

No user gets FLUSHALL/FLUSHDB, CONFIG, KEYS, SCRIPT, FUNCTION FLUSH/DELETE/KILL, DEBUG, ACL,
MONITOR, SHUTDOWN or any other administrative command: the users start from ``-@all``. Only
the forwarder's loads the function library (the bus's own, which agents then run by FCALL):
a script an agent wrote could loop and stall the server.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable, Sequence

from .names import check_name

__all__ = ["AGENT_COMMANDS", "AclUser", "agent_user", "forwarder_user", "monitor_user", "setuser_commands"]

_CONNECTION = ("hello", "auth", "ping", "select", "info", "time", "client|setname",
               "client|getname", "client|id", "command", "readonly")
#: FCALL only: an agent runs the bus's functions, which the forwarder loads (one it loaded
#: itself could loop and stall the server)
_SCRIPTS = ("fcall",)
#: the forwarder keeps the library loaded (FUNCTION LOAD is all of it at once), and writes
#: the grants in a MULTI
_SCRIPT_LOADING = ("function|load", "function|list", "multi", "exec", "discard")
_STREAMS = ("xadd", "xread", "xreadgroup", "xack", "xclaim", "xautoclaim", "xpending", "xrange", "xrevrange",
            "xdel", "xlen", "xinfo|stream", "xinfo|groups", "xinfo|consumers", "xgroup|create",
            "xgroup|createconsumer", "xgroup|delconsumer")
_DATA = ("get", "set", "del", "unlink", "exists", "type", "pexpire", "pttl", "incr", "rename", "persist", "strlen",
         "hget", "hmget", "hgetall", "hset", "hdel", "hlen", "hexists", "hscan", "hincrby",
         "zadd", "zrem", "zremrangebyscore", "zrange", "zrangebyscore", "zcard", "zscore", "zpopmin", "zcount",
         "sadd", "srem", "smembers", "sismember", "sscan")
#: what an agent's worker and client run, on their own slot's keys only
AGENT_COMMANDS = (*_CONNECTION, *_SCRIPTS, *_STREAMS, *_DATA)
#: the forwarder also finds the agents' outboxes and reads cluster layout
_FORWARDER_EXTRA = (*_SCRIPT_LOADING, "scan", "cluster|slots", "cluster|shards", "cluster|myid", "cluster|info",
                    "cluster|keyslot", "xgroup|destroy")
#: the monitor's: reads only, no script at all (a loaded script could loop and stall the
#: server; the bus reads with plain commands for this user, see plainreads.py)
_READS = ("xread", "xrange", "xrevrange", "xlen", "xpending", "xinfo|stream", "xinfo|groups", "xinfo|consumers",
          "get", "exists", "type", "pttl", "hget", "hmget", "hgetall", "hlen", "hexists", "hscan", "zrange",
          "zrangebyscore", "zcard", "zscore", "zcount", "smembers", "sismember", "sscan", "scan",
          "cluster|slots", "cluster|shards", "cluster|myid", "cluster|info", "cluster|keyslot")


class AclUser:
    """One ACL user: its name, password and rules (``ACL SETUSER`` arguments)."""

    def __init__(self, name: str, rules: Sequence[str], password: str | None = None) -> None:
        self.name = check_name(name, "ACL user name")
        self.password = password or secrets.token_urlsafe(24)
        self.rules = list(rules)

    def setuser(self) -> list[str]:
        """The ``ACL SETUSER`` command, as arguments."""
        return ["ACL", "SETUSER", self.name, "reset", "on", f">{self.password}", *self.rules]


def _commands(names: Iterable[str]) -> list[str]:
    return ["-@all", *(f"+{name}" for name in names)]


def agent_user(prefix: str, agent: str, *, name: str | None = None, password: str | None = None) -> AclUser:
    """The user an agent's processes (its workers and its requesting clients) connect as."""
    check_name(agent, "agent id")
    # and the names of the capability sets requests were routed by, to know what to pull
    return AclUser(name or f"{prefix}-agent-{agent}",
                   ["resetkeys", f"~{prefix}:{{{agent}}}:*", f"%R~{prefix}:routes", "resetchannels",
                    *_commands(AGENT_COMMANDS)], password)


def forwarder_user(prefix: str, *, name: str | None = None, password: str | None = None) -> AclUser:
    """The trusted user that moves handoffs between agents and runs the expiry sweep."""
    return AclUser(name or f"{prefix}-forwarder",
                   ["resetkeys", f"~{prefix}:*", "resetchannels", *_commands((*AGENT_COMMANDS, *_FORWARDER_EXTRA))],
                   password)


def monitor_user(prefix: str, *, name: str | None = None, password: str | None = None) -> AclUser:
    """A read-only user for operators' dashboards and probes."""
    return AclUser(name or f"{prefix}-monitor",
                   ["resetkeys", f"%R~{prefix}:*", "resetchannels", *_commands((*_CONNECTION, *_READS))], password)


def setuser_commands(users: Iterable[AclUser]) -> list[str]:
    """``ACL SETUSER`` lines for redis-cli (one per user; values need no quoting: names and
    generated passwords are URL-safe)."""
    return [" ".join(user.setuser()) for user in users]
