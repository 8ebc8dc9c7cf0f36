"""Capture the output shown in docs/monitoring.md: ``python docs/capture.py``.

Starts an embedded server, builds the docs' running example (tests/docstate.py), runs every
``$ redis-cli ...`` line of the page's console blocks with the real redis-cli, and writes
what it printed under the line. Needs ``redis-cli`` on PATH.
"""

from __future__ import annotations

import re
import shlex
import shutil
import sys
from pathlib import Path

import anyio

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from handoffbus import EmbeddedServer, HandoffBus  # noqa: E402
from tests.docstate import build_monitoring_state, run_with_redis_cli  # noqa: E402

PAGE = ROOT / "docs" / "monitoring.md"


async def capture(text: str, cli: str, socket_path: Path) -> str:
    """The page with the output under each ``$ redis-cli`` line of a console block replaced."""
    out: list[str] = []
    in_console = False
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("```"):
            if in_console:
                in_console = False
                out.append(line)
                continue
            in_console = stripped == "```console"
            out.append(line)
            continue
        if not in_console:
            out.append(line)
            continue
        if stripped.startswith("$ redis-cli "):
            shown = await run_with_redis_cli(cli, socket_path, shlex.split(stripped[2:])[1:])
            out.append(line)
            out += shown.rstrip("\n").splitlines()
        # any other line of a console block is old output: dropped, replaced above
    return "\n".join(out) + "\n"


async def main() -> None:
    cli = shutil.which("redis-cli")
    if cli is None:
        sys.exit("capture.py needs redis-cli on PATH")
    async with EmbeddedServer() as server, HandoffBus.connect(server.url) as bus:
        await build_monitoring_state(bus, server.url)
        text = await capture(PAGE.read_text("utf-8"), cli, server.socket_path)
    PAGE.write_text(re.sub(r"\n{3,}", "\n\n", text), "utf-8")
    print(f"captured {text.count('$ redis-cli')} commands into {PAGE.relative_to(ROOT)} ({server.binary})")


if __name__ == "__main__":
    anyio.run(main)
