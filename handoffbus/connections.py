"""The Redis clients a bus makes: from a URL, one server's pooled client or a cluster client,
and on one server a second client for the connections that are each held by one task."""

from __future__ import annotations

import re
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisClusterException

from .cluster import ClusterClient, is_cluster
from .errors import InvalidRequest

__all__ = ["CLUSTER_MAX_CONNECTIONS", "CLUSTER_SCHEMES", "blocking_client", "cluster_url", "make_client",
           "redact_url"]


#: URL schemes that ask for a Redis Cluster client, and the plain scheme each stands for
CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}
#: connections per node of a cluster client; redis-py's cluster client fails a command
#: rather than wait for a free connection, and every blocking read holds one
CLUSTER_MAX_CONNECTIONS = 512


#: a password given as a URL option (redis-py passes unknown options on as keywords)
_PASSWORD_OPTION = re.compile(r"(?i)([?&]password=)[^&#]*")
_MASKED = r"\1***"


def redact_url(url: str) -> str:
    """``url`` fit to print or log: the password of its user info, and a ``password=`` option,
    shown as ``***`` (something without ``://`` and with an ``@``: all of it)."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return "***" if "@" in url else url
    end = min((i for i in (rest.find(c) for c in "/?#") if i >= 0), default=len(rest))
    netloc, tail = rest[:end], rest[end:]
    user, at, host = netloc.rpartition("@")
    if at:
        name, colon, _ = user.partition(":")
        netloc = f"{name}{':***' if colon else ''}@{host}"
    return f"{scheme}://{netloc}{_PASSWORD_OPTION.sub(_MASKED, tail)}"


def cluster_url(url: str, cluster: bool | None) -> tuple[str, bool]:
    """The URL redis-py takes and whether to open a cluster client (a scheme of
    ``CLUSTER_SCHEMES`` asks for one; ``cluster`` forces the choice either way)."""
    scheme, sep, rest = url.partition("://")
    if sep and scheme.lower() in CLUSTER_SCHEMES:
        if cluster is False:
            raise InvalidRequest(f"{scheme}:// asks for a cluster client, but cluster=False was passed")
        return f"{CLUSTER_SCHEMES[scheme.lower()]}://{rest}", True
    if cluster and scheme.lower() == "unix":
        raise InvalidRequest("a Redis Cluster is reached over TCP (redis:// or rediss://), not a unix socket")
    if not sep or scheme.lower() not in ("redis", "rediss", "unix"):
        raise InvalidRequest(
            f"not a Redis URL: {redact_url(url)!r} (use redis://, rediss://, unix://, or redis+cluster://)")
    return url, bool(cluster)


def make_client(url: str, max_connections: int | None, cluster: bool | None = None) -> Any:
    try:
        return _new_client(url, max_connections, cluster)
    except InvalidRequest:
        raise
    except (ValueError, TypeError, RedisClusterException) as exc:
        # redis-py's own word on the URL: a port out of range, a bad option (a cluster client
        # takes options as keywords: TypeError), a database or no node for a cluster
        raise InvalidRequest(f"not a usable Redis URL: {exc}") from None


def _new_client(url: str, max_connections: int | None, cluster: bool | None) -> Any:
    url, cluster = cluster_url(url, cluster)
    options: dict[str, Any] = {"socket_timeout": None}
    if not url.startswith("unix:"):
        options["socket_keepalive"] = True  # TCP only: finds dead peers without a socket timeout
    if cluster:
        options["max_connections"] = max_connections or CLUSTER_MAX_CONNECTIONS
        return ClusterClient.from_url(url, **options)
    pool = aioredis.BlockingConnectionPool.from_url(
        url, max_connections=max_connections or 64, timeout=None, **options)
    return aioredis.Redis.from_pool(pool)  # the client owns the pool and closes it


def blocking_client(redis: Any) -> Any:
    """On one server, a client whose connections are each held by one task, made as they are
    needed: every blocked reader holds one for as long as it blocks, and each of the batcher's
    senders keeps one (``wire.Line``). Taken from the bus's pool, they would leave it short: a
    process with more readers than the pool has connections (a forwarder serving many agents,
    many requesters or served agents in one process), or a pool of one or two, would leave every
    other command waiting for one. None where the bus's client serves them too: a cluster client
    (a pool of 512 per node) or fakeredis."""
    if is_cluster(redis) or type(redis).__module__.startswith("fakeredis"):
        return None
    pool = redis.connection_pool
    # no cap: one connection per blocked reader (redis-py's default of 100 would leave the
    # readers past it polling on "Too many connections")
    return aioredis.Redis.from_pool(aioredis.ConnectionPool(
        connection_class=pool.connection_class, **{**pool.connection_kwargs, "max_connections": 2**31}))
