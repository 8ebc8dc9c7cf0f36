"""HandoffBus: a connection to Redis, the scripts, and the background tasks of one process."""

from __future__ import annotations

import contextlib
import difflib
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from typing import Any

import anyio
from anyio.abc import TaskGroup
from redis.exceptions import AuthenticationError, NoPermissionError, RedisClusterException, RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from . import wire
from .batching import ScriptBatcher
from .client import HandoffClient
from .cluster import is_cluster, seal
from .codecs import PayloadCodec
from .config import BusConfig
from .connections import blocking_client, cluster_url, make_client
from .embedded import EmbeddedCluster, EmbeddedServer
from .errors import AuthenticationFailed, HandoffbusError, InvalidRequest, ServerUnavailable, ServerUnsupported
from .forwarding import Outbox
from .keys import GROUP, Keys, RecordKeys
from .models import HandoffRecord
from .names import split_handoff_id
from .plainreads import LOAD_ROW, load_rows, refuses_scripts, server_time_ms, status_reply
from .policies import HandoffPolicy
from .records import Loaded, loaded_from_row, poison_row, record_from_hash
from .registered import Registered
from .routing import Router, set_id
from .scripts import INLINE_ENVELOPE, LOAD_MANY, Script, Scripts
from .signing import Keyring
from .stats import StatsFlusher, Tally
from .sweeper import Sweeper
from .waiters import ResponseReader, Waiter, clock
from .wire import Line, refuses_writes

__all__ = ["HandoffBus"]


log = logging.getLogger("handoffbus")
MIN_SERVER_VERSION = (7, 0)
#: how long an isolated agent's calls that found their function missing wait before they are
#: sent again (five times, see batching.py; the forwarder loads the library every `discover` seconds)
SCRIPT_WAIT = 1.0


class HandoffBus:
    """The handoff bus of one process. Use as ``async with HandoffBus.connect(url) as bus``.

    ``connect(url)`` talks to Redis >= 7.0 or Valkey >= 7.2, standalone or Cluster;
    ``memory()`` runs the same Lua in-process on fakeredis; ``embedded()`` starts a throwaway
    real server (or cluster) and stops it on exit. Pass your own ``redis.asyncio`` client (or
    ``redis.asyncio.cluster.RedisCluster``) to the constructor to control pooling and TLS.
    """

    def __init__(
        self,
        redis: Any = None,
        *,
        config: BusConfig | None = None,
        server: EmbeddedServer | EmbeddedCluster | None = None,
        owns_client: bool = False,
        keyring: Keyring | None = None,
        isolated: str | None = None,
        policy: HandoffPolicy | None = None,
        **settings: Any,
    ) -> None:
        if config is not None and settings:
            raise InvalidRequest("pass either config or keyword settings, not both")
        unknown = sorted(set(settings) - set(BusConfig.__struct_fields__))
        if unknown:  # a TypeError from BusConfig would not say which settings there are
            close = difflib.get_close_matches(unknown[0], BusConfig.__struct_fields__, n=1)
            raise InvalidRequest(f"unknown setting {unknown[0]!r}" + (f" (did you mean {close[0]!r}?)" if close else "")
                                 + f"; the settings are those of BusConfig: {', '.join(BusConfig.__struct_fields__)}")
        self.config = config or BusConfig(**settings)
        self.keys = Keys(self.config.prefix)
        self.codec: PayloadCodec = self.config.make_codec()
        #: with a keyring, requests are signed and checked, and workers refuse unsigned ones
        self.keyring = keyring
        #: an isolated bus acts as this one agent, whose ACL user reaches only its own slot:
        #: its other calls go through the forwarder (see forwarding.py)
        self.isolated = isolated
        #: what every request goes through before it is queued: scenario routes, loop guards,
        #: context policies (see policies/policy.py)
        self.policy = policy
        self._outbox = Outbox(self, isolated) if isolated is not None else None
        self._redis = redis
        self._server = server
        #: how connect() built the client, so that open can rebuild it for a cluster it finds
        self._connect_args: tuple[str, int | None] | None = None
        self._owns_client = owns_client or server is not None
        self._closed = False  # closed by __aexit__ (a client it owns is closed with it)
        self._blocking: Any = None
        self._clock: tuple[int, float] | None = None  # (server ms, monotonic s) at one TIME call
        self.scripts = Scripts()
        self._batcher: ScriptBatcher | None = None
        self._tg: TaskGroup | None = None
        self._stack: contextlib.AsyncExitStack | None = None
        self._readers: dict[str, ResponseReader] = {}
        self.router = Router(self)
        self._known_requesters = Registered()
        self._known_targets = Registered()
        #: set while the server refuses this bus's user its scripts (a read-only user, such as
        #: acl.py's monitor): records are read with plain commands, and the scripts are tried
        #: again from ``_scripts_again_at`` (clock time) on
        self.plain_reads = False
        self._scripts_again_at = 0.0
        self.sweeper = Sweeper(self)
        #: counts of the transitions and expiries this process makes, added to the agents'
        #: stats hashes every second (see stats.py)
        self.tally = Tally()
        self.stats = StatsFlusher(self)

    # ------------------------------------------------------------------ construction

    @classmethod
    def connect(
        cls, url: str, *, max_connections: int | None = None, cluster: bool | None = None, **settings: Any
    ) -> HandoffBus:
        """A bus on the server at ``url`` (``redis://``, ``rediss://`` or ``unix://``).

        A Redis Cluster is found by itself: when the server answers that it runs in cluster
        mode, the bus opens a cluster client on it instead (over TCP). ``cluster=True``, or the
        scheme ``redis+cluster://`` / ``rediss+cluster://``, asks for the cluster client from
        the start; ``cluster=False`` refuses a cluster server.

        The pool waits for a free connection instead of failing (64 by default); blocking
        reads and the two senders that pipeline script calls use connections of their own,
        one each, outside it. A cluster
        client opens up to ``max_connections`` per node (512 by default), blocking reads
        included, and fails beyond.
        No socket timeout is set: readers block in XREAD for ``read_block`` seconds and must
        not be cut off (TCP keepalive finds dead peers). Script calls and the response reads
        are bounded all the same (``wire.REPLY_WAIT``: a server that is up but stopped
        answering). A ``socket_timeout`` in the URL still applies.
        """
        bus = cls(make_client(url, max_connections, cluster), owns_client=True, **settings)
        if cluster is None and not cluster_url(url, None)[1]:
            bus._connect_args = (url, max_connections)  # a cluster found at open is taken
        return bus

    @classmethod
    def memory(cls, **settings: Any) -> HandoffBus:
        """An in-process bus on fakeredis running the same scripts: for development and unit tests."""
        import fakeredis

        return cls(fakeredis.FakeAsyncRedis(server=fakeredis.FakeServer()), owns_client=True, **settings)

    @classmethod
    def embedded(cls, *, cluster: bool = False, **settings: Any) -> HandoffBus:
        """A bus on a throwaway real server started now and stopped when the bus closes
        (``cluster=True``: a Redis Cluster of three primaries)."""
        return cls(server=EmbeddedCluster() if cluster else EmbeddedServer(), **settings)

    @property
    def is_cluster(self) -> bool:
        """Whether the bus talks to a Redis Cluster."""
        return is_cluster(self._redis)

    @property
    def redirects(self) -> Counter[str]:
        """On a cluster: how many script calls were sent again after a MOVED, ASK or TRYAGAIN
        reply (a slot moved, or was moving), by kind."""
        return self._batcher.redirects if self._batcher is not None else Counter()

    @property
    def redis(self) -> Any:
        if self._redis is None:
            raise HandoffbusError("the bus is not open: use 'async with bus'")
        if self._closed:
            # a command on a closed client would quietly connect it again, and nothing would
            # close those connections (a cluster client even learns its nodes anew)
            raise HandoffbusError("the bus is closed")
        return self._redis

    # ------------------------------------------------------------------ lifecycle

    async def __aenter__(self) -> HandoffBus:
        self._closed = False
        if self._redis is not None and is_cluster(self._redis):
            seal(self._redis, False)  # opened again
        stack = contextlib.AsyncExitStack()
        try:
            if self._server is not None:
                await stack.enter_async_context(self._server)
                self._redis = make_client(self._server.url, None)
            if self._owns_client:
                stack.push_async_callback(self._close_client)
            await self._check_server()
            self._blocking = blocking_client(self.redis)
            stack.push_async_callback(self._close_blocking)  # after the task group: its readers end first
            reload = None
            if self._outbox is not None:
                reload = self._wait_for_scripts  # an isolated agent's user may not load scripts
            else:
                try:
                    # loaded only where missing: FUNCTION LOAD is a write, replicated and logged
                    # (78 KB) even when it changes nothing, and every `handoffbus check` opens a bus
                    await self.scripts.ensure_loaded(self.redis)
                except NoPermissionError:  # a read-only user, like acl.py's monitor: it reads plainly
                    self._read_plainly()
                except RedisError as exc:
                    if not refuses_writes(exc):
                        raise
                    # a replica, a full server...: reads go on (plainly where a function is missing)
                    log.warning("the function library is not loaded, and could not be (%s)", exc)
            self._tg = await stack.enter_async_context(anyio.create_task_group())
            self._batcher = ScriptBatcher(self.redis, self.scripts, reload=reload, lines=self._lines)
            await self._tg.start(self._batcher.run)
            if self._outbox is not None:
                await self._tg.start(self._outbox.start)  # the forwarder's bus sweeps, not this one
            else:
                await self._tg.start(self.sweeper.run)
            await self._tg.start(self.stats.run)
        except BaseException:
            await stack.aclose()
            raise
        self._stack = stack
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        if self._tg is not None:
            with anyio.CancelScope(shield=True):
                await self.sweeper.stop()  # first: its last batch's follow-ups need the batcher
            with anyio.CancelScope(shield=True), anyio.move_on_after(2.0):
                try:
                    await self.stats.flush()  # the last second's counts
                except (RedisError, OSError, HandoffbusError) as exc:
                    log.info("last stats not written (%s)", exc)
            self._tg.cancel_scope.cancel()
        if self._stack is not None:
            # the task group exits first (its tasks were just cancelled), then the client
            # and the server close, each shielded in its own callback
            await self._stack.aclose()
        self._tg = self._stack = None
        readers, self._readers = list(self._readers.values()), {}
        for reader in readers:
            reader.close()  # awaits under way wake now, to find the bus closed

    async def _wait_for_scripts(self, missing: Sequence[Script]) -> None:
        """An isolated agent's calls that found their function missing wait for the forwarder to
        load the library again (it checks every few seconds): the agent's user may not load
        any, or it could load one that loops and stalls the server."""
        log.info("%d function(s) not loaded; waiting %.1f s for the forwarder to load them", len(missing), SCRIPT_WAIT)
        await anyio.sleep(SCRIPT_WAIT)

    @property
    def blocking_redis(self) -> Any:
        """The client for blocking reads (XREAD BLOCK, XREADGROUP BLOCK): see connections.blocking_client."""
        redis = self.redis  # refused once the bus is closed, like the main client
        return redis if self._blocking is None else self._blocking

    async def blocking_read(self, read: Awaitable[Any], blocks: float) -> Any:
        """A blocking read through ``blocking_redis`` (a cluster, fakeredis, a forwarder),
        bounded as a watched line's is: ``wire.REPLY_WAIT`` past the ``blocks`` seconds it may
        block. A node that stops answering without closing the connection (frozen, or cut off
        with no reset) held it for ever, its reader deaf to the node that took its slots over.
        Cancelled mid-read, redis-py drops the connection: no late reply is read by another."""
        wait = blocks + wire.REPLY_WAIT
        with anyio.move_on_after(wait):
            return await read
        raise RedisTimeoutError(f"no reply within {wait:g} s")

    @property
    def _lines(self) -> Any:
        """The pool kept connections (``wire.Line``) come from: the blocking client's, outside
        the bus's cap; None where the bus's client serves them (a cluster, fakeredis)."""
        return None if self._blocking is None else self._blocking.connection_pool

    def blocking_line(self) -> Line | None:
        """A connection of its own for a reader that blocks all the time (see ``wire.Line``);
        None where the bus's client serves blocking reads (use ``blocking_redis``)."""
        if self._lines is None:
            return None
        return Line(self._lines, None if self._batcher is None else self._batcher.watcher)

    async def reading(self, read: Callable[[Line | None], Awaitable[None]]) -> None:
        """Run ``read``, a reader that blocks, with a line of its own (``blocking_line``; a
        watched one, so that a server that stops answering fails its reads), given back when it
        ends."""
        line = self.blocking_line()
        try:
            await read(line)
        finally:
            if line is not None:
                await line.close()

    async def _close_blocking(self) -> None:
        blocking, self._blocking = self._blocking, None
        if blocking is not None:
            with anyio.CancelScope(shield=True):
                await blocking.aclose()

    async def _close_client(self) -> None:
        self._closed = True  # calls still running outside (a caller's tasks) fail from here on
        await self._release_client()

    async def _release_client(self) -> None:
        if self._redis is not None:
            if is_cluster(self._redis):
                seal(self._redis, True)  # a command still running must not connect it again
            with anyio.CancelScope(shield=True):
                await self._redis.aclose()

    async def _check_server(self) -> None:
        try:
            if is_cluster(self.redis):
                from redis.asyncio.cluster import RedisCluster

                replies = await self.redis.info("server", target_nodes=RedisCluster.PRIMARIES)
                infos = list(replies.values()) if "redis_version" not in replies else [replies]
            else:
                infos = [await self.redis.info("server")]
        except AuthenticationError as exc:
            raise AuthenticationFailed(f"Redis refused the credentials: {exc}") from exc
        except Exception as exc:
            if type(self.redis).__module__.startswith("fakeredis"):
                return  # fakeredis has no INFO; it is the in-memory mode
            raise ServerUnavailable(f"cannot reach Redis: {exc}") from exc
        for info in infos:
            version = tuple(int(p) for p in str(info.get("redis_version", "0.0")).split(".")[:2])
            if version < MIN_SERVER_VERSION:
                raise ServerUnsupported(f"Redis {info.get('redis_version')} found; handoffbus needs >= 7.0")
        mode = infos[0].get("redis_mode") or infos[0].get("server_mode")  # Valkey 8+ says server_mode
        if mode == "cluster" and not is_cluster(self.redis):
            await self._reopen_as_cluster()
        with contextlib.suppress(Exception):
            policy = (await self.redis.config_get("maxmemory-policy")).get("maxmemory-policy")
            if policy not in (None, "noeviction"):
                log.warning("maxmemory-policy is %s: eviction can drop handoffs; use noeviction", policy)

    async def _reopen_as_cluster(self) -> None:
        """The server is a cluster node: a plain client would meet MOVED for most keys."""
        if self._connect_args is None:
            raise HandoffbusError(
                "the server is a Redis Cluster node: pass a redis.asyncio.cluster.RedisCluster client, "
                "or connect with cluster=True (or a redis+cluster:// URL)")
        url, max_connections = self._connect_args
        cluster = make_client(url, max_connections, cluster=True)
        await self._release_client()  # the plain client closes, not the bus
        self._redis = cluster
        await self._check_server()

    def spawn(self, func: Callable[[], Coroutine[Any, Any, None]], *, name: str) -> None:
        if self._tg is None:
            raise HandoffbusError("the bus is closed" if self._closed else "the bus is not open: use 'async with bus'")
        if self._tg.cancel_scope.cancel_called:  # closing: its task group takes no task any more
            raise HandoffbusError("the bus is closed")
        self._tg.start_soon(func, name=name)

    # ------------------------------------------------------------------ shared by clients

    def script(self, name: str, keys: list[str], args: list[Any]) -> Awaitable[Any]:
        """Run one script; calls made at the same time share a pipeline (see batching.py). Not
        a coroutine itself: the batcher's call is handed back to be awaited, one coroutine less
        for every wait to pass through."""
        if self._batcher is None:
            raise HandoffbusError("the bus is not open: use 'async with bus'")
        if self._outbox is not None:
            return self._forwarded_script(name, keys, args)
        return self._batcher.call(self.scripts[name], keys, args)

    async def _forwarded_script(self, name: str, keys: list[str], args: list[Any]) -> Any:
        [reply] = await self.scripts_many([(name, keys, args)])
        if isinstance(reply, BaseException):
            raise reply
        return reply

    def scripts_many(self, calls: list[tuple[str, list[str], list[Any]]]) -> Awaitable[list[Any]]:
        """Run several scripts in this order in one round trip; each reply or its exception.
        Not a coroutine itself, as ``script``."""
        if self._batcher is None:
            raise HandoffbusError("the bus is not open: use 'async with bus'")
        batcher = self._batcher

        def run(batch: list[tuple[str, list[str], list[Any]]]) -> Awaitable[list[Any]]:
            return batcher.call_many([(self.scripts[n], k, a) for n, k, a in batch])

        return run(calls) if self._outbox is None else self._outbox.call_many(calls, run)

    def forwarded(self, keys: Sequence[str]) -> bool:
        """Whether a call on ``keys`` goes through the forwarder (an isolated agent's, outside
        its own slot)."""
        return self._outbox is not None and not self._outbox.own(keys)

    def client(self, agent_id: str) -> HandoffClient:
        """A client acting as ``agent_id`` (the identity checked by every transition)."""
        if self.isolated is not None and agent_id != self.isolated:
            raise InvalidRequest(f"this bus is isolated as {self.isolated!r}; it cannot act as {agent_id!r}")
        return HandoffClient(self, agent_id)

    def drop_reader(self, agent: str, reader: ResponseReader) -> None:
        """``reader`` has retired (nothing to wait for): the next ``reader(agent)`` makes a new one."""
        if self._readers.get(agent) is reader:
            del self._readers[agent]

    def reader(self, agent: str, refresh: Callable[[Waiter], Awaitable[None]]) -> ResponseReader:
        if self._tg is None:  # closed (or never opened): a reader made now would never run
            raise HandoffbusError("the bus is closed" if self._closed else "the bus is not open: use 'async with bus'")
        reader = self._readers.get(agent)
        if reader is None:
            reader = self._readers[agent] = ResponseReader(self, agent, refresh)
        return reader

    async def _register(self, known: Registered, key: str, agent: str) -> bool:
        """Add ``agent`` to the registry ``key`` unless this process did within a minute;
        whether it did now."""
        if agent in known or self._outbox is not None:  # the forwarder registers isolated agents
            return False
        known.add(agent)  # before awaiting, so a burst of first requests sends one SADD
        try:
            await self.redis.sadd(key, agent)
        except BaseException as exc:
            known.discard(agent)
            if self._closed and isinstance(exc, RedisError | OSError):  # its connection closed with the bus
                raise HandoffbusError("the bus closed before Redis answered") from exc
            raise
        return True

    async def register_requester(self, agent: str) -> bool:
        """List ``agent`` for the sweep (see ``_register``). A caller that made it now lists it
        again after its request is written: the sweep may have unlisted it as idle meanwhile
        (``Sweeper.unlist_idle``)."""
        return await self._register(self._known_requesters, self.keys.requesters, agent)

    async def relist_requester(self, agent: str) -> None:
        """``register_requester``'s second SADD, after the request: never an error for a request
        that was made (its caller could take it for a failed one and ask again)."""
        try:
            await self.redis.sadd(self.keys.requesters, agent)
        except (RedisError, RedisClusterException, OSError):
            self.forget_requester(agent)

    def forget_requester(self, agent: str) -> None:
        """``agent``'s next request lists it again (see ``register_requester``): a request of
        it failed, or its listing after one did."""
        self._known_requesters.discard(agent)

    async def register_target(self, agent: str) -> None:
        await self._register(self._known_targets, self.keys.targets, agent)

    def enqueue_call(
        self, target: str, handoff_id: str, priority: int, cap: int = 0
    ) -> tuple[str, list[str], list[Any]]:
        return "enqueue", self.keys.target(target).as_list(), [handoff_id, priority, cap]

    async def enqueue(self, target: str, handoff_id: str, priority: int) -> bool:
        await self.register_target(target)
        return bool(await self.script(*self.enqueue_call(target, handoff_id, priority)))

    def settle_call(self, target: str, handoff_ids: list[str]) -> tuple[str, list[str], list[Any]]:
        return "settle", self.keys.target(target).as_list(), [GROUP, *handoff_ids]

    async def settle(self, target: str, handoff_ids: list[str]) -> int:
        return int(await self.script(*self.settle_call(target, handoff_ids)))

    async def settle_many(self, by_target: Mapping[str, list[str]]) -> dict[str, BaseException]:
        """Settle handoffs in their targets' queues, in one round trip; the targets whose
        settling failed, with why."""
        replies = await self.scripts_many([self.settle_call(t, ids) for t, ids in by_target.items()])
        return {t: reply for t, reply in zip(by_target, replies, strict=True) if isinstance(reply, BaseException)}

    async def settle_expired(self, by_target: Mapping[str, list[str]]) -> None:
        """Settle handoffs this process just made EXPIRED, in one round trip, and count them
        for their targets. Should it fail, the sweep settles them again (from the "~s:" entries
        their expiry left in the deadline index: see sweep-1.lua)."""
        for target, ids in by_target.items():
            self.tally.add(target, "EXPIRED", len(ids))
        failed = await self.settle_many(by_target)
        if failed:
            raise next(iter(failed.values()))

    async def load_records(self, handoff_ids: Sequence[str]) -> list[Loaded | None]:
        """What each record holds (None where it is gone), in one round trip; never raises for
        bad data. An id that is no handoff's (a queue member written by hand) is a poison row.
        One ``load`` call per requester (the records' slot) reads all its handoffs, up to
        ``LOAD_MANY`` a call; an isolated agent's reads of its peers' records go one a call,
        as the forwarder checks each."""
        out: list[Loaded | None] = []
        named: list[tuple[int, str, RecordKeys]] = []  # (place in out, handoff id, its keys)
        by_requester: dict[str, list[int]] = {}  # requester -> places in named
        for handoff_id in handoff_ids:
            try:
                requester, request_id = split_handoff_id(handoff_id)
                record_keys = self.keys.record(requester, request_id)
            except InvalidRequest as exc:  # InvalidName
                out.append(poison_row(exc))
                continue
            by_requester.setdefault(requester, []).append(len(named))
            named.append((len(out), handoff_id, record_keys))
            out.append(None)
        if not named:
            return out
        keys = [k for _, _, k in named]
        if self._outbox is None:
            groups = [places[i:i + LOAD_MANY] for places in by_requester.values()
                      for i in range(0, len(places), LOAD_MANY)]
        else:
            groups = [[i] for i in range(len(keys))]
        limit = self._inline_limit()
        calls = [("load", [key for i in group for key in (keys[i].record, keys[i].envelope)], limit)
                 for group in groups]

        async def plain() -> list[Any]:  # each call's reply, as the script gives it
            rows = await load_rows(self.redis, keys)
            return [[value for i in group for value in rows[i]] for group in groups]

        rows: list[list[Any]] = [[]] * len(keys)
        for group, reply in zip(groups, await self.read_scripts(calls, plain), strict=True):
            for at, i in enumerate(group):  # its rows one after another
                rows[i] = reply[at * LOAD_ROW:(at + 1) * LOAD_ROW]
        apart = [i for i, row in enumerate(rows) if row[14] == 1]
        for i, envelope in zip(apart, await self._envelopes([keys[i] for i in apart]), strict=True):
            rows[i] = [rows[i][0], envelope, *rows[i][2:]]  # gone (None): a poison row, as inline
        for (place, handoff_id, _), row in zip(named, rows, strict=True):
            out[place] = loaded_from_row(row, self.codec, self.keyring, handoff_id)
        return out

    def _inline_limit(self) -> list[int]:
        """The ``load`` and ``status`` argument that leaves an envelope over INLINE_ENVELOPE to
        ``_envelopes``; none for an isolated agent, whose reads of a peer's records come whole
        through the forwarder (which runs no plain command)."""
        return [] if self._outbox is not None else [INLINE_ENVELOPE]

    async def _envelopes(self, keys: Sequence[RecordKeys]) -> list[bytes | None]:
        """Envelopes a read left out, by plain GET in one round trip (see scripts.INLINE_ENVELOPE)."""
        if not keys:  # (the usual case: no round trip)
            return []
        envelopes = await self.scripts_many([("GET", [k.envelope], []) for k in keys])
        for envelope in envelopes:
            if isinstance(envelope, BaseException):
                raise envelope
        return envelopes

    async def read_record(self, handoff_id: str) -> tuple[int, bytes, HandoffRecord] | None:
        """(server now ms, response stream position, record) or None; expires the record if due
        (not when this bus's user may only read: see plainreads.py)."""
        requester, request_id = split_handoff_id(handoff_id)
        keys = self.keys.record(requester, request_id)

        async def plain() -> list[Any]:
            return [await status_reply(self.redis, keys)]

        [reply] = await self.read_scripts([("status", keys.as_list(), [
            request_id, self.config.retention_ms, self.config.response_retention_ms, *self._inline_limit()])], plain,
            stands_in=_not_due)
        if reply[0] == -1:
            return None
        fields = dict(zip(reply[3::2], reply[4::2], strict=True))
        if b"env" not in fields and int(fields.get(b"esz") or 0) > INLINE_ENVELOPE:  # left out: a large one
            [envelope] = await self._envelopes([keys])
            if envelope is not None:  # (gone: malformed, as an inline one gone)
                fields[b"env"] = envelope
        if reply[2] == 1:  # this read expired it: out of its queue
            if fields.get(b"to"):
                await self.settle_expired({fields[b"to"].decode(): [handoff_id]})
            elif fields.get(b"routed") == b"1":
                await self.drop_routes([(fields.get(b"caps", b"").decode(), handoff_id)])
        return int(reply[0]), reply[1], record_from_hash(fields, self.codec, self.keyring)

    async def drop_routes(self, items: Sequence[tuple[str, str]]) -> None:
        """Take (capability set, handoff id) entries out of their sets' queues, where no one will
        take them: handoffs that ended (expired, cancelled) or were never created (left there,
        only a pull from the set would drop them: a set no one serves keeps them). A failure is
        logged, not raised: what called for it must be heard. An isolated agent, whose user
        cannot reach a set's slot, has the forwarder do it (``unroute``, its own ended handoffs)."""
        if not items:
            return
        try:
            if self.isolated is None:
                await self.router.unroute_many(items)
                return
            calls = [("unroute", self.keys.route(set_id(caps)).as_list(), [handoff_id])
                     for caps, handoff_id in items if caps]
            for reply in await self.scripts_many(calls) if calls else []:
                if isinstance(reply, BaseException):
                    raise reply
        except (RedisError, RedisClusterException, OSError, HandoffbusError) as exc:
            log.warning("could not take %d handoffs out of their capability sets' queues: %s", len(items), exc)

    async def read_scripts(
        self, calls: list[tuple[str, list[str], list[Any]]], plain: Callable[[], Awaitable[list[Any]]],
        stands_in: Callable[[list[Any]], bool] | None = None,
    ) -> list[Any]:
        """The replies of read scripts (the first error raised), or, once the server refused this
        user FCALL itself, what ``plain`` reads with plain commands (plainreads.py): from then
        on this bus reads plainly, and tries the scripts again every ``scripts_recheck``. A
        server that refuses writes (``wire.refuses_writes``: a replica, say) refuses ``status``,
        which may write: that call reads plainly, unless ``stands_in`` says the plain reading
        cannot stand in for what the script would have done (a record due to expire), and then
        the refusal is raised. A key it may not reach is refused to plain reads as well, and an
        isolated agent's reads of its peers go through the forwarder: never plain."""
        if not self.plain_reads or clock() >= self._scripts_again_at:
            replies = await self.scripts_many(calls)
            if self._outbox is None and any(map(refuses_scripts, replies)):
                self._read_plainly()
            elif self._outbox is None and any(map(refuses_writes, replies)):
                answer = await plain()  # this once
                if stands_in is None or stands_in(answer):
                    return answer
                raise next(reply for reply in replies if refuses_writes(reply))
            else:
                if self.plain_reads:
                    log.info("this bus's user may run scripts again: reading with them")
                    self.plain_reads = False
                for reply in replies:
                    if isinstance(reply, BaseException):
                        raise reply
                return replies
        return await plain()

    def _read_plainly(self) -> None:
        self.plain_reads = True
        self._scripts_again_at = clock() + self.config.scripts_recheck

    async def server_time_ms(self) -> int:
        return await server_time_ms(self.redis)

    async def now_ms(self) -> int:
        """The server's time, estimated from one TIME call and the monotonic clock since, for
        what must be judged in the server's time without a round trip each (a signature's
        time, whether a deferral has passed): client wall clocks may be far off."""
        if self._clock is None:
            self._clock = (await self.server_time_ms(), time.monotonic())
        server_ms, at = self._clock
        return server_ms + int((time.monotonic() - at) * 1000)

    async def clear(self, *, confirm: str) -> int:
        if confirm != self.config.prefix:
            raise InvalidRequest(f"clear_all_handoffs needs confirm={self.config.prefix!r} (the bus prefix)")
        deleted = 0
        batch: list[bytes] = []
        async for key in self.redis.scan_iter(match=self.keys.pattern(), count=1000):
            batch.append(key)
            if len(batch) >= 500:
                deleted += await self._unlink(batch)
                batch = []
        if batch:
            deleted += await self._unlink(batch)
        for known in (self._known_requesters, self._known_targets, self.router.known):
            known.clear()  # written again at their next use
        return deleted

    async def _unlink(self, keys: list[bytes]) -> int:
        # one key per call: keys of different agents live in different cluster slots
        async with self.redis.pipeline(transaction=False) as pipe:
            for key in keys:
                pipe.execute_command("UNLINK", key)
            return sum(await pipe.execute())


def _not_due(replies: list[Any]) -> bool:
    """Whether a record read plainly is not one the ``status`` script would have expired: only
    a write settles a PENDING handoff past its deadline, and a reader waiting on it would read
    it again and again."""
    [reply] = replies
    if reply[0] == -1:
        return True
    fields = dict(zip(reply[3::2], reply[4::2], strict=True))
    return not (fields.get(b"status") == b"PENDING" and int(fields.get(b"deadline") or 0) <= int(reply[0]))
