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
    assert lines[-1].endswith("6/6 handoffs ended as expected")
    assert "'COMPLETED': 4, 'EXPIRED': 1, 'REJECTED': 1" in lines[-1]

    def at(text: str) -> int:
        return next(i for i, line in enumerate(lines) if text in line)

    # the reviewer works one at a time, best priority first: the priority 1 review ends before the 9
    assert at("'review the login handler for injection' COMPLETED") < at("'tidy the README wording' COMPLETED")
    assert "CAPABILITY_MISSING: missing capability: translation" in lines[at("'translate the release notes' REJ")]
    assert at("A-1002' REJECTED OVER_LIMIT") < at("follows the redirect to refunds-supervisor-1")
    assert "refunds-supervisor-1: 'refund order A-1002' COMPLETED {'refunded': 900}" in lines[at("A-1002' COMPLETED")]
    assert "'update the billing address' EXPIRED" in lines[-2]


def test_demo_load_run() -> None:
    done = run("-m", "handoffbus", "demo", "--agents", "3", "--handoffs", "300")
    assert done.returncode == 0, done.stderr
    assert "300/300 handoffs completed over 3 agents" in done.stdout


@pytest.mark.parametrize("server", list(SERVER_BINARIES))
def test_demo_against_a_given_url(servers: dict, server: str) -> None:
    done = run("-m", "handoffbus", "demo", "--redis-url", servers[server].url)
    assert done.returncode == 0, done.stderr
    assert f"demo on {servers[server].url}" in done.stdout


def test_demo_on_an_embedded_cluster() -> None:
    done = run("-m", "handoffbus", "demo", "--cluster")
    assert done.returncode == 0, done.stderr
    assert "demo on an embedded cluster of three primaries" in done.stdout
    assert done.stdout.splitlines()[-1].endswith("6/6 handoffs ended as expected")


def test_version_and_usage_errors() -> None:
    assert run("-m", "handoffbus", "-V").stdout.startswith("handoffbus ")
    assert run("-m", "handoffbus").returncode == 2


def test_a_demo_stopped_with_sigterm_stops_its_embedded_server() -> None:
    import os
    import signal

    with subprocess.Popen([sys.executable, "-m", "handoffbus", "demo", "--handoffs", "1000000"], cwd=ROOT,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as demo:
        try:
            assert demo.stdout is not None and "embedded server" in demo.stdout.readline()  # it is running
            [server] = Path(f"/proc/{demo.pid}/task/{demo.pid}/children").read_text().split()
            demo.send_signal(signal.SIGTERM)
            _, errors = demo.communicate(timeout=30)
        finally:
            demo.kill()
    with pytest.raises(ProcessLookupError):  # stopped with it, not left behind
        os.kill(int(server), 0)
    assert "Traceback" not in errors
