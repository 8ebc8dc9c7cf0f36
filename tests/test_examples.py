"""The README's commands and the examples run as users run them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import SERVER_BINARIES

ROOT = Path(__file__).resolve().parent.parent


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)


def test_quickstart_runs_a_complete_handoff_on_the_embedded_server() -> None:
    done = run("examples/quickstart.py")
    assert done.returncode == 0, done.stderr
    assert "decision   ACCEPTED by security-specialist-1" in done.stdout
    assert "outcome    COMPLETED: {'finding': 'reviewed 1 messages: no injection found'}" in done.stdout
    assert "PENDING(general-agent-1) -> ACCEPTED(security-specialist-1) -> COMPLETED" in done.stdout


def test_demo_command_ends_every_handoff_as_expected() -> None:
    done = run("-m", "handoffbus", "demo")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert "4/4 handoffs ended as expected" in lines[-1]
    accepted = [line for line in lines if "accepted" in line]
    assert "(priority 1)" in accepted[0] and "(priority 9)" in accepted[1]  # served in priority order
    assert any("REJECTED missing capability: translation" in line for line in lines)
    assert any("'nobody is listening': EXPIRED" in line for line in lines)


@pytest.mark.parametrize("server", list(SERVER_BINARIES))
def test_demo_against_a_given_url(servers: dict, server: str) -> None:
    done = run("-m", "handoffbus", "demo", "--redis-url", servers[server].url)
    assert done.returncode == 0, done.stderr
    assert f"demo on {servers[server].url}" in done.stdout


def test_version_and_usage_errors() -> None:
    assert run("-m", "handoffbus", "-V").stdout.startswith("handoffbus ")
    assert run("-m", "handoffbus").returncode == 2
