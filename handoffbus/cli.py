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
    args = parser.parse_args(argv)
    if args.command == "demo":
        from .demo import run

        good = anyio.run(run, args.redis_url)
        return 0 if good == 4 else 1
    return 2  # pragma: no cover - argparse rejects unknown commands


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
