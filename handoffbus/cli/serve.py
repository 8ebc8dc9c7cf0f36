"""Long-running and setup commands: serve agents, forward isolated agents' calls, the demo,
ACL users."""

from __future__ import annotations

import importlib
import logging
import os
import signal
import sys
from typing import Annotated, Any

import anyio
import typer

from ..bus import HandoffBus
from ..errors import HandoffbusError, InvalidName, InvalidRequest
from ..logs import FORMAT
from ..names import check_name, check_names
from ..workers import Agent, Worker
from ..workers.runner import MIN_RECLAIM_IDLE
from ..workers.signals import serve_until_signalled
from .common import (
    EXIT_FAILED,
    EXIT_OK,
    Options,
    Prefix,
    RedisUrl,
    check_usage,
    open_bus,
    options,
    run,
    serve,
    usage_error,
)

__all__ = ["register"]

#: seconds between reads of the gauges a worker's metrics server reports
METRICS_REFRESH = 2.0


def register(app: typer.Typer) -> None:
    app.command("worker")(worker)
    app.command("forwarder")(forwarder)
    app.command("demo")(demo)
    app.command("acl")(acl)
    app.command("exporter")(exporter)


async def _signalled(*more: signal.Signals) -> None:
    """Return at the first SIGTERM or SIGINT (or one of ``more``)."""
    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, *more) as signals:
        async for _ in signals:
            return


def _logging() -> None:
    logging.basicConfig(level=logging.INFO, format=FORMAT)


def _import(spec: str) -> Any:
    """The attribute named by ``module.path:attribute``; a usage error if it cannot be loaded."""
    module_name, _, attribute = spec.partition(":")
    try:
        return getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError, ValueError) as exc:
        usage_error(f"cannot load {spec!r}: {exc}")


def load_agent_class(spec: str) -> type[Agent]:
    agent_class = _import(spec)
    if not (isinstance(agent_class, type) and issubclass(agent_class, Agent)):
        usage_error(f"{spec!r} is not an Agent subclass")
    return agent_class


def load_sdk_agent(spec: str) -> Agent:
    """``module:attribute[=agent-id]`` naming an Agents SDK ``Agent``, wrapped to be served."""
    from ..integrations.openai_agents import SdkAgent

    target, _, agent_id = spec.partition("=")
    found = _import(target)
    try:
        from agents import Agent as SdkAgentClass
    except ImportError:
        usage_error("--openai-agent needs the Agents SDK: pip install 'handoffbus[agents]'")
    if not isinstance(found, SdkAgentClass):
        usage_error(f"{target!r} is not an Agents SDK Agent")
    return SdkAgent(found, agent_id or None)


def worker(
    ctx: typer.Context,
    agents: Annotated[list[str] | None, typer.Argument(
        metavar="[AGENT]...", help="Agent subclasses to serve in this process, as module.path:ClassName")] = None,
    concurrency: Annotated[int, typer.Option(help="handoffs handled at once, per agent")] = 8,
    grace: Annotated[float, typer.Option(help="seconds running handlers get to finish on SIGTERM")] = 30.0,
    reclaim_idle: Annotated[float, typer.Option(
        help="seconds after which work left idle by a dead worker is taken over")] = 30.0,
    offer_time: Annotated[float, typer.Option(
        help="seconds these agents have to decide a routed offer before it goes to another agent")] = 30.0,
    metrics_port: Annotated[int | None, typer.Option(
        help="serve Prometheus metrics on this port (needs the 'metrics' extra)")] = None,
    metrics_address: Annotated[str, typer.Option(help="address the metrics server listens on")] = "0.0.0.0",
    openai_agent: Annotated[list[str] | None, typer.Option(
        help="an OpenAI Agents SDK Agent to serve, as module.path:attribute[=agent-id] (repeatable; needs the "
        "'agents' extra)")] = None,
    scenario: Annotated[str | None, typer.Option(
        help="a scenario YAML: these agents hand off only along its routes (needs the 'scenarios' extra)")] = None,
    isolated: Annotated[bool, typer.Option(
        "--isolated",
        help="connect as the agent's own ACL user (see 'acl'); a forwarder carries its handoffs")] = False,
    redis_url: RedisUrl = None, prefix: Prefix = None,
) -> None:
    """Serve Agent classes until SIGTERM/SIGINT: the first drains, a second stops at once."""
    opts = options(ctx, redis_url, prefix)
    url = opts.url("worker")
    classes = [load_agent_class(spec) for spec in agents or []]
    sdk_agents = [load_sdk_agent(spec) for spec in openai_agent or []]
    if not classes and not sdk_agents:
        usage_error("name an Agent class to serve, or an SDK agent with --openai-agent")
    if isolated and len(classes) + len(sdk_agents) != 1:
        usage_error("--isolated serves one agent per process: its bus connects as that agent's user")
    if concurrency < 1:
        usage_error("--concurrency must be at least 1")
    check_usage(None, [("--grace", grace, 0.0), ("--reclaim-idle", reclaim_idle, MIN_RECLAIM_IDLE),
                       ("--offer-time", offer_time, 0.001)])
    _logging()
    instances = [agent_class() for agent_class in classes] + sdk_agents
    registry = None
    if metrics_port is not None:
        from ..metrics import serve_metrics

        try:
            registry = serve_metrics(metrics_port, metrics_address)
        except (HandoffbusError, OSError, ValueError) as exc:  # ValueError: UnicodeError of a bad host name
            usage_error(f"cannot serve metrics on {metrics_address}:{metrics_port}: {exc}")
    policy = None
    if scenario is not None:
        from ..policies import HandoffPolicy, Scenario, ScenarioError

        try:
            policy = HandoffPolicy(Scenario.load(scenario))
        except ScenarioError as exc:
            usage_error(str(exc))
    serve(_worker, opts, url, instances, concurrency, grace, reclaim_idle, offer_time,
        instances[0].agent_id if isolated else None, registry, policy)


async def _worker(opts: Options, url: str, agents: list[Agent], concurrency: int, grace: float,
                  reclaim_idle: float, offer_time: float, isolated: str | None, registry: Any,
                  policy: Any) -> int:
    async with HandoffBus.connect(url, prefix=opts.prefix, offer_time=offer_time, isolated=isolated,
                                  policy=policy) as bus:
        workers = [Worker(bus, agent, concurrency=concurrency, grace=grace, reclaim_idle=reclaim_idle)
                   for agent in agents]

        def ready() -> None:  # printed once a SIGTERM drains: what a supervisor may wait for
            for w in workers:
                print(f"worker {w.consumer} serving {w.agent.agent_id}", flush=True)

        async with anyio.create_task_group() as tg:
            if registry is not None:
                from ..metrics import Metrics

                agents_served = sorted({w.agent.agent_id for w in workers})
                tg.start_soon(Metrics(bus, registry).keep_fresh, METRICS_REFRESH, agents_served, workers)
            await serve_until_signalled(workers, ready)
            tg.cancel_scope.cancel()
        for w in workers:
            print(f"worker {w.consumer} drained: {dict(w.handled)}", flush=True)
    return EXIT_OK


def forwarder(
    ctx: typer.Context,
    agents: Annotated[list[str] | None, typer.Argument(
        metavar="[AGENT]...", help="agents to serve at once (others are found by their outboxes)")] = None,
    grant: Annotated[list[str] | None, typer.Option(
        metavar="AGENT=CAP[,CAP...]", help="capabilities an agent may be routed by (repeatable); with any "
        "given, an agent gets only what it claims and was granted, and one not named gets none")] = None,
    redis_url: RedisUrl = None, prefix: Prefix = None,
) -> None:
    """Carry handoffs between isolated agents (run it as the forwarder ACL user)."""
    opts = options(ctx, redis_url, prefix)
    opts.url("forwarder")
    grants: dict[str, list[str]] | None = None
    if grant:
        grants = {}
        for item in grant:
            agent, sep, caps = item.partition("=")
            names = [c for c in caps.split(",") if c]
            if not sep or not agent or not names:
                usage_error(f"--grant takes AGENT=CAP[,CAP...], not {item!r}")
            try:
                check_name(agent, "agent id")
                check_names(names, "capability")
            except InvalidName as exc:
                usage_error(str(exc))
            grants.setdefault(agent, []).extend(names)
    _logging()
    serve(_forwarder, opts, agents or [], grants)


async def _forwarder(opts: Options, agents: list[str], grants: dict[str, list[str]] | None) -> int:
    from ..forwarding import Forwarder

    async with open_bus(opts, "forwarder") as bus, anyio.create_task_group() as tg:
        await tg.start(Forwarder(bus, agents, grants=grants).run)
        print(f"forwarder serving prefix {opts.prefix}", flush=True)
        await _signalled()  # nothing is held: an unanswered outbox entry is answered by the next forwarder
        tg.cancel_scope.cancel()
    return EXIT_OK


def demo(
    ctx: typer.Context,
    agents: Annotated[int, typer.Option(help="specialist agents in a load run")] = 3,
    handoffs: Annotated[int, typer.Option(help="make it a load run of this many handoffs")] = 0,
    cluster: Annotated[bool, typer.Option(
        "--cluster", help="without a URL: start an embedded Redis Cluster of three primaries instead")] = False,
    redis_url: Annotated[str | None, typer.Option(
        "--redis-url", show_default=False,
        help="a server to run on (default: HANDOFFBUS_REDIS_URL, else an embedded one; REDIS_URL is not used: "
        "a demo writes nothing to a server it was not pointed at)")] = None,
    prefix: Prefix = None,
) -> None:
    """Run agents handing work to each other (on a throwaway embedded server by default)."""
    from ..demo import run as run_demo

    opts = options(ctx, redis_url, prefix)
    url = opts.redis_url or os.environ.get("HANDOFFBUS_REDIS_URL")
    if agents < 1 or handoffs < 0:
        usage_error("--agents must be at least 1 and --handoffs not negative")
    if cluster and url:
        given = "--redis-url" if opts.redis_url else "HANDOFFBUS_REDIS_URL (set in the environment)"
        usage_error(f"--cluster starts an embedded cluster: give it no {given}")

    async def go() -> int:
        ok = False
        async with anyio.create_task_group() as tg:
            async def stop_on_signal() -> None:
                # SIGTERM and SIGHUP (a closed terminal) too: the embedded server is stopped on the
                # way out, not left running without its parent
                await _signalled(signal.SIGHUP)
                tg.cancel_scope.cancel()

            tg.start_soon(stop_on_signal)
            ok = await run_demo(url, print, agents, handoffs, cluster, prefix=opts.prefix)
            tg.cancel_scope.cancel()
        return EXIT_OK if ok else EXIT_FAILED

    run(go)


def acl(
    ctx: typer.Context,
    agents: Annotated[list[str], typer.Argument(metavar="AGENT...", help="agent ids to make users for")],
    prefix: Prefix = None,
) -> None:
    """Print ACL SETUSER commands: a user per agent, the forwarder, a read-only monitor."""
    from ..acl import agent_user, forwarder_user, monitor_user, setuser_commands
    from ..config import BusConfig
    from ..errors import InvalidName

    opts = options(ctx, prefix=prefix)
    try:
        BusConfig(prefix=opts.prefix)
        users = [*(agent_user(opts.prefix, agent) for agent in agents), forwarder_user(opts.prefix),
                 monitor_user(opts.prefix)]
    except (InvalidRequest, InvalidName) as exc:
        usage_error(str(exc))
    print("pipe stdout into redis-cli; keep the generated passwords: each user connects with "
          "redis://<user>:<password>@host", file=sys.stderr)
    for line in setuser_commands(users):
        print(line)


def exporter(
    ctx: typer.Context,
    port: Annotated[int, typer.Option(help="port to serve Prometheus metrics on")] = 9100,
    address: Annotated[str, typer.Option(help="address to listen on")] = "0.0.0.0",
    interval: Annotated[float, typer.Option(help="seconds between reads of Redis")] = 5.0,
    redis_url: RedisUrl = None, prefix: Prefix = None,
) -> None:
    """Serve every agent's gauges (queue depth, in flight, oldest ages, live workers) for
    Prometheus, read from Redis: it sees agents whose workers are all down (needs 'metrics')."""
    from ..metrics import serve_metrics

    opts = options(ctx, redis_url, prefix)
    opts.url("exporter")
    check_usage(None, [("--interval", interval, 0.001)])
    _logging()
    try:
        registry = serve_metrics(port, address)
    except (HandoffbusError, OSError, ValueError) as exc:  # ValueError: UnicodeError of a bad host name
        usage_error(f"cannot serve metrics on {address}:{port}: {exc}")
    serve(_exporter, opts, registry, interval)


async def _exporter(opts: Options, registry: Any, interval: float) -> int:
    from ..metrics import Metrics

    async with open_bus(opts, "exporter") as bus, anyio.create_task_group() as tg:
        tg.start_soon(Metrics(bus, registry).keep_fresh, interval)
        print(f"exporter serving prefix {opts.prefix}", flush=True)
        await _signalled()
        tg.cancel_scope.cancel()
    return EXIT_OK
