"""The ``handoffbus`` command. Operations commands arrive with the CLI issue; ``demo`` is here."""

from __future__ import annotations

import argparse
import os
import sys

import anyio

from . import __version__


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="handoffbus", description="Asynchronous handoff bus for AI agents.")
    parser.add_argument("-V", "--version", action="version", version=f"handoffbus {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="run agents handing work to each other (embedded server by default)")
    demo.add_argument(
        "--redis-url", default=os.environ.get("HANDOFFBUS_REDIS_URL"),
        help="server to use (default: HANDOFFBUS_REDIS_URL, else a throwaway embedded server)",
    )
    demo.add_argument("--agents", type=int, default=3, help="specialist agents in a load run (default 3)")
    demo.add_argument("--handoffs", type=int, default=0, help="make it a load run of this many handoffs")
    demo.add_argument("--cluster", action="store_true",
                      help="without a URL: start an embedded Redis Cluster of three primaries instead")
    worker = commands.add_parser("worker", help="serve an Agent class (module:Class) until SIGTERM/SIGINT")
    worker.add_argument("agents", nargs="+", metavar="AGENT",
                        help="Agent subclasses to serve in this process, as module.path:ClassName")
    worker.add_argument("--concurrency", type=int, default=8, help="handoffs handled at once (default 8)")
    worker.add_argument("--grace", type=float, default=30.0, help="seconds to finish running handlers on stop")
    worker.add_argument("--reclaim-idle", type=float, default=30.0,
                        help="seconds after which work left idle by a dead worker is taken over (default 30)")
    worker.add_argument("--offer-time", type=float, default=30.0,
                        help="seconds this worker's agents have to decide a routed offer before it goes "
                             "to another agent (default 30)")
    worker.add_argument("--redis-url", default=None,
                        help="server (default: HANDOFFBUS_REDIS_URL, then REDIS_URL)")
    worker.add_argument("--prefix", default="hb", help="key prefix (default hb)")
    worker.add_argument("--isolated", action="store_true",
                        help="connect as the agent's own ACL user (see 'acl'); a forwarder carries its handoffs")
    forwarder = commands.add_parser("forwarder", help="carry handoffs between isolated agents (as the forwarder user)")
    forwarder.add_argument("agents", nargs="*", metavar="AGENT",
                           help="agents to serve at once (others are found by their outboxes)")
    forwarder.add_argument("--redis-url", default=None, help="server (default: HANDOFFBUS_REDIS_URL, then REDIS_URL)")
    forwarder.add_argument("--prefix", default="hb", help="key prefix (default hb)")
    acl = commands.add_parser("acl", help="print ACL SETUSER commands: a user per agent, the forwarder, a monitor")
    acl.add_argument("agents", nargs="+", metavar="AGENT", help="agent ids to make users for")
    acl.add_argument("--prefix", default="hb", help="key prefix (default hb)")
    args = parser.parse_args(argv)
    if args.command == "acl":
        return _acl(args, parser)
    if args.command == "worker":
        return _worker(args, parser)
    if args.command == "forwarder":
        return _forwarder(args, parser)
    if args.command == "demo":
        from .demo import run

        if args.agents < 1 or args.handoffs < 0:
            parser.error("--agents must be at least 1 and --handoffs not negative")
        if args.cluster and args.redis_url:
            parser.error("--cluster starts an embedded cluster: give it no --redis-url")
        return 0 if anyio.run(run, args.redis_url, print, args.agents, args.handoffs, args.cluster) else 1
    return 2  # pragma: no cover - argparse rejects unknown commands


def _url(args: argparse.Namespace, parser: argparse.ArgumentParser) -> str:
    url: str | None = args.redis_url or os.environ.get("HANDOFFBUS_REDIS_URL") or os.environ.get("REDIS_URL")
    if not url:
        parser.error(f"'{args.command}' needs a shared server: give --redis-url, HANDOFFBUS_REDIS_URL or REDIS_URL")
    return url


def _forwarder(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    import logging
    import signal

    from .bus import HandoffBus
    from .forwarding import Forwarder

    url = _url(args, parser)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    async def serve() -> None:
        async with HandoffBus.connect(url, prefix=args.prefix) as bus, anyio.create_task_group() as tg:
            await tg.start(Forwarder(bus, args.agents).run)
            print(f"forwarder serving prefix {args.prefix}", flush=True)
            with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                async for _ in signals:
                    break  # nothing is held: an unanswered outbox entry is answered by the next forwarder
            tg.cancel_scope.cancel()

    anyio.run(serve)
    return 0


def _acl(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from .acl import agent_user, forwarder_user, monitor_user, setuser_commands
    from .config import BusConfig
    from .errors import InvalidRequest

    try:
        BusConfig(prefix=args.prefix)
        users = [*(agent_user(args.prefix, agent) for agent in args.agents), forwarder_user(args.prefix),
                 monitor_user(args.prefix)]
    except InvalidRequest as exc:
        parser.error(str(exc))
    print("pipe stdout into redis-cli; keep the generated passwords: each user connects with "
          "redis://<user>:<password>@host", file=sys.stderr)
    for line in setuser_commands(users):
        print(line)
    return 0


def _worker(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    import importlib
    import logging

    from .bus import HandoffBus
    from .workers import Agent, Worker
    from .workers.runner import serve_until_signalled

    url = _url(args, parser)
    classes = []
    for spec in args.agents:
        module_name, _, class_name = spec.partition(":")
        try:
            agent_class = getattr(importlib.import_module(module_name), class_name)
        except (ImportError, AttributeError, ValueError) as exc:
            parser.error(f"cannot load {spec!r}: {exc}")
        if not (isinstance(agent_class, type) and issubclass(agent_class, Agent)):
            parser.error(f"{spec!r} is not an Agent subclass")
        classes.append(agent_class)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    if args.isolated and len(classes) != 1:
        parser.error("--isolated serves one agent per process: its bus connects as that agent's user")
    agents = [agent_class() for agent_class in classes]
    isolated = agents[0].agent_id if args.isolated else None

    async def serve() -> None:
        async with HandoffBus.connect(url, prefix=args.prefix, offer_time=args.offer_time, isolated=isolated) as bus:
            workers = [
                Worker(bus, agent, concurrency=args.concurrency, grace=args.grace, reclaim_idle=args.reclaim_idle)
                for agent in agents
            ]
            for worker in workers:
                print(f"worker {worker.consumer} serving {worker.agent.agent_id}", flush=True)
            await serve_until_signalled(workers)
            for worker in workers:
                print(f"worker {worker.consumer} drained: {dict(worker.handled)}", flush=True)

    anyio.run(serve)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
