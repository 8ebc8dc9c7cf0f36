"""The ``handoffbus`` command (also ``python -m handoffbus``).

- ``handoffs.py``: request, status, pending, dlq list|replay;
- ``watch.py``: agents, top, check;
- ``serve.py``: worker, forwarder, demo, acl;
- ``common.py``: global options, exit codes, output.
"""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from .. import __version__
from . import handoffs, serve, watch
from .common import Json, Options, Prefix, RedisUrl, exit_past_hook_threads

__all__ = ["app", "console", "main"]

app = typer.Typer(
    name="handoffbus", help="Asynchronous handoff bus for AI agents on Redis.", no_args_is_help=True,
    add_completion=False, pretty_exceptions_enable=False, context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(value: bool) -> None:
    if value:
        print(f"handoffbus {__version__}")
        raise typer.Exit()


@app.callback()
def _global(
    ctx: typer.Context,
    redis_url: RedisUrl = None,
    prefix: Prefix = None,
    as_json: Json = False,
    version: Annotated[bool, typer.Option("-V", "--version", callback=_version, is_eager=True,
                                          help="print the version and exit")] = False,
) -> None:
    ctx.obj = Options(redis_url=redis_url, prefix=prefix or "hb", json=as_json)


handoffs.register(app)
watch.register(app)
serve.register(app)


def console() -> None:
    """The ``handoffbus`` command: ``main``, then exit (past hook threads a stopped worker left
    running, see ``exit_past_hook_threads``)."""
    code = main()
    exit_past_hook_threads(code)
    sys.exit(code)


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit code (click's standalone mode maps usage errors
    to 2 and ``typer.Exit`` to its code)."""
    command = typer.main.get_command(app)
    try:
        command.main(args=argv, prog_name="handoffbus", standalone_mode=True)
    except SystemExit as done:
        return done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
    return 0
