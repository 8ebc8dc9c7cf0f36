"""Script calls on a Redis Cluster.

On a Redis Cluster a batch is split by node (the primary of each call's slot; every key of
one call shares one hash tag, so one slot) and the nodes are written to at once. A call
answered MOVED is sent again to the node named (and the client's slot table updated), one
answered ASK is sent there with ASKING on the same connection, and one answered TRYAGAIN is
sent again after a short pause: none of those replies means the script ran.

While a slot migrates, a script must not run on either node. The source node runs a script
whose declared keys are all still there, but aborts it with an error at the first command
that touches a key missing there (one it deleted itself a moment before, or one built from
an argument), keeping the writes made before: a half-done transition. So on a cluster every
call also declares a guard key of its slot that never exists: a node answers TRYAGAIN to a
call with a missing key while the slot is migrating or importing, and sees nothing special
about it otherwise. A migration thus holds a slot's calls back until its keys have moved.

A node that stops answering without closing its connections (frozen, or cut off by the
network) would hold every round that sends it a call, and with them the batcher's few
senders and every other node's calls. So a node's replies are awaited ``NODE_REPLY_WAIT``
seconds at most; past that its calls fail as on a lost connection, and the node counts as
silent: its calls fail at once, without being sent, until it answers a PING.
"""

from __future__ import annotations

import contextlib
import logging
import time
import weakref
from collections import Counter
from contextvars import ContextVar
from typing import Any

import anyio
from hiredis import pack_command
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.cluster import PRIMARY
from redis.exceptions import (
    AskError,
    MaxConnectionsError,
    MovedError,
    RedisClusterException,
    RedisError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from .errors import HandoffbusError
from .scripts import Command, Reload, Script
from .wire import REPLY_WAIT, ScriptCall, exchange, no_script

__all__ = ["ClusterSender", "is_cluster"]

log = logging.getLogger("handoffbus")
#: rounds of MOVED/ASK/"Function not found" replies a cluster call follows before its error is returned
REDIRECT_ROUNDS = 16
#: seconds a cluster call answered TRYAGAIN (its slot is migrating) is sent again before its
#: error is returned: a reshard moves a slot's keys in far less, an aborted one never ends
MIGRATION_WAIT = 30.0


#: seconds a node may take to answer a batch of calls before it is taken for silent (frozen,
#: or cut off without a reset): its calls fail as on a lost connection, and its later calls
#: fail at once until it answers a PING, so that no other node's calls wait on it
NODE_REPLY_WAIT = REPLY_WAIT
#: seconds between PINGs to a silent node, and how long each may take
PROBE_EVERY = 1.0
#: seconds closing connections may take (a socket's close waits on its peer)
CLOSE_WAIT = 2.0


async def _disconnect(conn: Any) -> None:
    with contextlib.suppress(RedisError, OSError):  # gone already, or the peer is: closed either way
        await conn.disconnect()


def is_cluster(redis: Any) -> bool:
    """Whether ``redis`` is redis-py's asyncio Redis Cluster client."""
    return isinstance(redis, RedisCluster)


async def _closed_client(*args: Any, **kwargs: Any) -> None:
    raise HandoffbusError("the bus is closed")


def seal(redis: Any, sealed: bool) -> None:
    """After ``aclose()`` a cluster client would learn its nodes anew and connect again for a
    command still running (redis-py retries a command whose connection closed under it), and
    nothing would close those connections. Sealed, it fails such commands instead, with a
    HandoffbusError, which redis-py does not retry; unsealed, it opens again as usual."""
    if sealed:
        redis.initialize = _closed_client  # shadows the method, on this client only
    else:
        vars(redis).pop("initialize", None)


class Run:
    """The calls of one ``call_many`` in a batch sent to a cluster, in waves: each wave is sent
    once the one before it is answered, so that the calls run in their order even when they
    go to different nodes (a request's record is written before its handoff is queued on the
    target's node, where a worker could otherwise take it and find no record). Consecutive
    calls of one script share a wave: each acts on its own slot alone (one record, one
    queue), and none of them waits for another. So does a call after plain commands in its
    own slot (a staged envelope's SET, then its ``request``): one node runs them in order on
    one connection, and a redirect cannot put the call first, as a single-key command is
    never answered TRYAGAIN (the call may be parked; the SET, done or sent again at once,
    stays ahead). After a failed call, the calls of the later waves are not sent: they get
    its error."""

    __slots__ = ("at", "waves")

    def __init__(self, calls: list[ScriptCall]) -> None:
        self.waves: list[list[ScriptCall]] = []
        for call in calls:
            if self.waves and _joins(self.waves[-1], call):
                self.waves[-1].append(call)
            else:
                self.waves.append([call])
        self.at = 0

    def current(self) -> list[ScriptCall]:
        return self.waves[self.at] if self.at < len(self.waves) else []

    def advance(self) -> list[ScriptCall]:
        """The next wave's calls once every call of the current one is answered, else none."""
        wave = self.current()
        if not wave or not all(call.finished for call in wave):
            return []
        self.at += 1
        error = next((call.error for call in wave if call.error is not None), None)
        if error is not None:
            for later in self.waves[self.at:]:
                for call in later:
                    call.finish(error=error)
            self.at = len(self.waves)
        return self.current()

    def calls(self) -> list[ScriptCall]:
        return [call for wave in self.waves for call in wave]


def _joins(wave: list[ScriptCall], call: ScriptCall) -> bool:
    if wave[-1].script is call.script:
        return True
    return all(isinstance(c.script, Command) and c.slot == call.slot for c in wave)


def runs_of(batch: list[ScriptCall]) -> list[Run]:
    groups: dict[int, list[ScriptCall]] = {}
    for call in batch:
        groups.setdefault(id(call.group), []).append(call)
    return [Run(calls) for calls in groups.values()]


class ClusterSender:
    """Sends batches of script calls to the nodes of a cluster (see above) for a
    ``ScriptBatcher``. Calls still waiting out a migration stay in the batcher's ``in_flight``
    until answered, so that closing the bus fails them too."""

    def __init__(self, redis: Any, in_flight: set[ScriptCall], reload: Reload) -> None:
        self._redis = redis
        self._in_flight = in_flight
        self._reload = reload  # what brings back scripts a node lost (the batcher's)
        #: calls answered TRYAGAIN and the runs they hold up, sent again by one task
        self._parked: list[ScriptCall] = []
        self._parked_runs: list[Run] = []
        self._unpark = anyio.Event()
        self._refreshed = float("-inf")
        #: replies that sent a call again, by kind (MOVED, ASK, TRYAGAIN): a slot moved
        self.redirects: Counter[str] = Counter()
        #: connections this sender took from nodes, and their node: one handed back to a node
        #: that a later topology refresh dropped is beyond the client's own close
        self._used: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
        #: nodes that did not answer within NODE_REPLY_WAIT, by name, until one answers a PING
        self.silent: dict[str, Any] = {}
        self._heard_silence = anyio.Event()

    async def close(self) -> None:
        """Close the connections left on nodes the client no longer knows; the rest are the
        client's (perhaps the caller's) to close."""
        cached = self._redis.nodes_manager.nodes_cache
        orphans = [conn for conn, node in list(self._used.items()) if cached.get(node.name) is not node]
        if orphans:
            with anyio.move_on_after(CLOSE_WAIT, shield=True):
                async with anyio.create_task_group() as tg:
                    for conn in orphans:
                        tg.start_soon(_disconnect, conn)

    async def send(self, batch: list[ScriptCall]) -> None:
        """Send a batch to a cluster: one pipeline per node, all nodes at once, wave after wave
        (see ``Run``), following MOVED, ASK and a missing function at once. Calls answered TRYAGAIN (their
        slot is being migrated) are parked with their groups' later waves, so that this sender
        takes the next batch meanwhile."""
        runs = runs_of(batch)
        try:
            later = await self._drive(runs, [call for run in runs for call in run.current()])
        except Exception as exc:  # e.g. no node serves a slot: every call not answered yet hears it
            for call in batch:
                call.finish(error=unreachable(exc))
            return
        self._park(runs, later)

    async def _drive(self, runs: list[Run], ready: list[ScriptCall]) -> list[ScriptCall]:
        """Send ``ready`` and each wave it opens until only calls answered TRYAGAIN are left;
        returns those."""
        later: list[ScriptCall] = []
        while ready:
            again, waiting = await self._round(ready)
            later += waiting
            ready = again + [call for run in runs for call in run.advance()]
        return later

    def _park(self, runs: list[Run], later: list[ScriptCall]) -> None:
        if later:
            self._parked += later
            self._parked_runs += [run for run in runs if run.current()]
            self._unpark.set()

    async def run(self) -> None:
        """The sender's own tasks, until cancelled: the unparker and the prober."""
        async with anyio.create_task_group() as tg:
            tg.start_soon(self.unparker)
            tg.start_soon(self.prober)

    async def prober(self) -> None:
        """PING the silent nodes every PROBE_EVERY seconds; one that answers takes calls again,
        and one a topology refresh dropped (a failover replaced it) is forgotten."""
        while True:
            if not self.silent:
                self._heard_silence = anyio.Event()
                await self._heard_silence.wait()
            await anyio.sleep(PROBE_EVERY)  # a timer
            cached = self._redis.nodes_manager.nodes_cache
            for name, node in list(self.silent.items()):
                if cached.get(name) is not node or await _answers(node):
                    del self.silent[name]
                    log.info("cluster node %s answers again", name)

    async def unparker(self) -> None:
        """Send the parked calls again, all together, with growing pauses while their slots
        stay in migration; then their groups' later waves. One task for all of them, so a
        migration holds one connection per node however many calls wait on it."""
        pause = 0.002
        while True:
            if not self._parked:
                pause = 0.002
                self._unpark = anyio.Event()
                await self._unpark.wait()
            await anyio.sleep(pause)  # the MIGRATE of the slot's keys is under way
            pause = min(pause * 2, 0.1)
            runs, later = self._parked_runs, self._parked
            self._parked_runs, self._parked = [], []
            calls = [call for run in runs for call in run.calls()]
            try:
                later = await self._drive(runs, later)
            except Exception as exc:
                for call in calls:
                    call.finish(error=unreachable(exc))
                later = []
            finally:
                self._in_flight.difference_update([call for call in calls if call.finished])
            self._park(runs, later)

    async def _round(self, calls: list[ScriptCall]) -> tuple[list[ScriptCall], list[ScriptCall]]:
        """Send each call to its node once. Finishes the calls answered for good; returns those
        to send again now (MOVED, ASK, a missing function) and those to send again later (TRYAGAIN)."""
        manager = self._redis.nodes_manager
        by_node: dict[str, tuple[Any, list[ScriptCall]]] = {}
        for call in calls:
            node = call.asked or manager.get_node_from_slot(call.slot)
            by_node.setdefault(node.name, (node, []))[1].append(call)
        answers: dict[str, list[Any]] = {}
        async with anyio.create_task_group() as tg:
            for name, (node, sent) in by_node.items():
                if name in self.silent:  # not sent: it would hold this round up to NODE_REPLY_WAIT
                    answers[name] = [RedisConnectionError(f"cluster node {name} is not answering")] * len(sent)
                    tg.start_soon(self._refresh_slots, name)  # a failover may have moved its slots
                else:
                    tg.start_soon(self._on_node, node, sent, answers, name)
        again: list[ScriptCall] = []
        later: list[ScriptCall] = []
        missing: dict[str, Script] = {}
        for name, (_node, sent) in by_node.items():
            for call, reply in zip(sent, answers[name], strict=True):
                asked, call.asked = call.asked, None
                retry: list[ScriptCall] | None = None
                if isinstance(reply, MovedError):
                    retry, kind = again, "MOVED"
                    await manager.move_slot(reply)
                elif isinstance(reply, AskError):
                    call.asked = self._node_named(reply.host, reply.port)
                    retry, kind = again, "ASK"
                elif isinstance(reply, TryAgainError):
                    retry, kind, call.asked = later, "TRYAGAIN", asked  # importing: ask that node again
                elif no_script(reply):
                    retry, kind, call.asked = again, "", asked
                    missing[call.script.name] = call.script
                if retry is later:
                    call.parked = call.parked or time.monotonic()
                    gave_up = time.monotonic() - call.parked > MIGRATION_WAIT
                else:
                    call.tries += 1
                    gave_up = call.tries > REDIRECT_ROUNDS
                if retry is None or gave_up:
                    if isinstance(reply, Exception):
                        call.finish(error=reply)
                    else:
                        call.finish(result=reply)
                    continue
                if kind:
                    self.redirects[kind] += 1
                retry.append(call)
        if missing:
            try:
                await self._reload(list(missing.values()))
            except (RedisError, OSError) as exc:
                for call in again:
                    if call.script.name in missing:
                        call.finish(error=exc)
                again = [call for call in again if not call.finished]
        return again, later

    async def _on_node(self, node: Any, calls: list[ScriptCall], answers: dict[str, list[Any]], name: str) -> None:
        try:
            conn = node.acquire_connection()
        except MaxConnectionsError as exc:
            answers[name] = [exc] * len(calls)
            return
        self._used[conn] = node
        try:
            answers[name] = await exchange(conn, calls, [call.asked is not None for call in calls],
                                           reply_wait=NODE_REPLY_WAIT)
        except (RedisError, OSError) as exc:  # this node's calls hear it; the other nodes' do not
            read = getattr(exc, "replies_read", [])  # those calls ran: they keep their replies
            answers[name] = [*read, *[exc] * (len(calls) - len(read))]
            if isinstance(exc, RedisTimeoutError) and name not in self.silent:
                log.warning("cluster node %s did not answer within %g s; its calls fail until it answers a PING",
                            name, NODE_REPLY_WAIT)
                self.silent[name] = node
                self._heard_silence.set()
            await self._refresh_slots(node.name)
        finally:
            if self._redis.nodes_manager.nodes_cache.get(node.name) is node:
                node.release(conn)
            else:  # a refresh dropped the node: nothing else would ever close this connection
                self._used.pop(conn, None)
                with anyio.move_on_after(CLOSE_WAIT, shield=True):
                    await _disconnect(conn)

    def _node_named(self, host: str, port: int) -> Any:
        """The node an ASK names (see ``node_named``)."""
        return node_named(self._redis.nodes_manager, host, port)

    async def _refresh_slots(self, failed: str | None = None) -> None:
        """Learn the cluster's slots again after a node failed (a failover may have moved them);
        at most once a second."""
        if time.monotonic() - self._refreshed < 1.0:
            return
        self._refreshed = time.monotonic()
        try:
            await self._redis.nodes_manager.initialize(last_failed_node_name=failed)
        except (RedisError, RedisClusterException, OSError) as exc:  # no node answered at all
            log.warning("could not refresh the cluster's slots (%s)", exc)


def node_named(manager: Any, host: str, port: int) -> Any:
    """The node an ASK names. One this client has not met is made from the reply, as
    redis-py does for a MOVED: a new primary a scale-out reshards slots to serves none
    yet, so no topology refresh (CLUSTER SLOTS) would list it."""
    node = manager.get_node(host=host, port=port)
    if node is None:
        node = ClusterNode(host, port, PRIMARY, **manager.connection_kwargs)
        manager.set_nodes(manager.nodes_cache, {node.name: node})
    return node


#: set while redis-py runs one of its own commands (``ClusterClient._execute_command``)
_COMMANDING: ContextVar[bool] = ContextVar("handoffbus_commanding", default=False)


class _Asked:
    """The node an ASK names, for the one command redis-py sends there next. redis-py sends
    ASKING as a command of its own, on a connection of the node's pool, then the command on
    another whenever two are free: the importing node answers that one MOVED (back to the
    source, which answers ASK again) until redis-py gives up (ClusterError "TTL exhausted").
    Here ASKING is held and written with the command, on one connection."""

    __slots__ = ("_asking", "_node")

    def __init__(self, node: Any) -> None:
        self._node = node
        self._asking = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._node, name)

    async def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        if args == ("ASKING",):
            self._asking = True
            return True
        if not self._asking or kwargs.get("asking"):  # (redis-py folds its own for HIMPORT SET)
            return await self._node.execute_command(*args, **kwargs)
        self._asking = False
        node = self._node
        conn = node.acquire_connection()
        try:
            await node.disconnect_if_needed(conn)
            await conn.send_packed_command(conn.pack_commands([("ASKING",), args]))
            try:
                await conn.read_response()
            except BaseException:  # the command's reply would be left on the connection
                await _disconnect(conn)
                raise
            return await node.parse_response(conn, args[0], **kwargs)
        finally:
            try:
                await node.disconnect_if_needed(conn)
            finally:
                node.release(conn)


async def _answers(node: Any) -> bool:
    """Whether ``node`` answers a PING within PROBE_EVERY seconds, on a connection of its own."""
    try:
        conn = node.acquire_connection()
    except MaxConnectionsError:
        return False
    try:
        with anyio.fail_after(PROBE_EVERY):
            await conn.send_packed_command(pack_command(("PING",)), check_health=False)
            return bool(await conn.read_response())
    except (TimeoutError, RedisError, OSError):
        return False
    finally:
        with anyio.move_on_after(CLOSE_WAIT, shield=True):
            await _disconnect(conn)  # (its reply may still be on its way)
        node.release(conn)


def unreachable(exc: Exception) -> Exception:
    """What the calls of a failed round hear: a cluster client's own errors (every node down, a
    slot no node serves) as the ConnectionError every caller backs off on, not a
    RedisClusterException, which is no RedisError; an error group of the per-node tasks as
    its first error."""
    while isinstance(exc, ExceptionGroup):
        exc = exc.exceptions[0]
    if isinstance(exc, RedisClusterException):
        return RedisConnectionError(f"the cluster cannot serve the call: {type(exc).__name__}: {exc}")
    return exc


class ClusterClient(RedisCluster):
    """The cluster client the bus makes: redis-py's, with its own error for a cluster it cannot
    reach (no node answers its topology query, or its slots are not all covered) raised as the
    ConnectionError every loop backs off on. As RedisClusterException, which is no RedisError,
    it ended the loops. A MOVED updates the slot table, never more: redis-py's own commands
    closed every connection of the client at every fifth MOVED (``reinitialize_steps``),
    failing the script calls under way on every node and the blocking reads; ASK is followed
    with ASKING on the command's own connection (``get_node``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("reinitialize_steps", 0)
        super().__init__(*args, **kwargs)

    async def initialize(self, *args: Any, **kwargs: Any) -> RedisCluster:
        try:
            return await super().initialize(*args, **kwargs)
        except RedisClusterException as exc:
            raise unreachable(exc) from exc

    async def _execute_command(self, target_node: Any, *args: Any, **kwargs: Any) -> Any:
        token = _COMMANDING.set(True)
        try:
            return await super()._execute_command(target_node, *args, **kwargs)
        finally:
            _COMMANDING.reset(token)

    def get_node(self, host: str | None = None, port: int | None = None, node_name: str | None = None) -> Any:
        """As redis-py's; but where one of its commands looks up the node an ASK named (by name,
        the one lookup a command makes), that node for the command (``_Asked``), made from
        the name if this client has not met it (a new primary of a scale-out: redis-py found
        none and raised AttributeError)."""
        node = super().get_node(host, port, node_name)
        if node_name is None or host is not None or port is not None or not _COMMANDING.get():
            return node
        if node is None:
            host, _, port_text = node_name.rpartition(":")
            node = node_named(self.nodes_manager, host, int(port_text))
        return _Asked(node)
