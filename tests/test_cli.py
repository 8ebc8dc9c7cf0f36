"""Every ``handoffbus`` command against a real server, its output and exit code checked.

Commands run in-process through typer's runner (each opens its own bus and event loop, as
the installed command does); the workers they watch are real ``handoffbus worker``
processes. Exit codes: 0 ok, 1 a check or handoff failed, 2 usage, 69 Redis unavailable.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from typer.testing import CliRunner

from handoffbus import HandoffBus, HandoffContext, serialize_context
from handoffbus.cli import app
from handoffbus.workers.inbox import Inbox

from .conftest import SERVER_BINARIES, new_prefix, start_server
from .helpers import req

ROOT = Path(__file__).resolve().parent.parent


class Cli:
    """``handoffbus`` against one server and prefix."""

    def __init__(self, url: str, prefix: str) -> None:
        self.url, self.prefix = url, prefix
        self.runner = CliRunner()

    def __call__(self, *args: str, input: str | None = None, env: dict[str, str] | None = None) -> Any:
        result = self.runner.invoke(app, [*args, "--redis-url", self.url, "--prefix", self.prefix],
                                    input=input, env={"COLUMNS": "250", **(env or {})})
        if result.exception and not isinstance(result.exception, SystemExit):
            raise result.exception
        return result

    def json(self, *args: str) -> Any:
        result = self(*args, "--json")
        assert result.exit_code == 0, result.output
        return json.loads(result.stdout)

    def bus(self) -> HandoffBus:
        return HandoffBus.connect(self.url, prefix=self.prefix)


@pytest.fixture
def cli(servers: dict) -> Cli:
    return Cli(servers["valkey"].url, new_prefix())


@pytest.fixture
def worker(cli: Cli) -> Iterator[subprocess.Popen[str]]:
    """A ``handoffbus worker`` process serving tests.agents:Echo and Faulty."""
    process = subprocess.Popen(
        [sys.executable, "-m", "handoffbus", "worker", "tests.agents:Echo", "tests.agents:Faulty",
         "--redis-url", cli.url, "--prefix", cli.prefix],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert process.stdout is not None
    for _ in range(2):
        assert "serving" in process.stdout.readline()
    try:
        yield process
    finally:
        process.send_signal(signal.SIGTERM)
        out, _ = process.communicate(timeout=30)
        assert process.returncode == 0 and "drained" in out


def in_loop(func: Any, *args: Any) -> Any:
    return anyio.run(func, *args)


# ---------------------------------------------------------------------- request and status


def test_request_then_status_and_pending(cli: Cli, tmp_path: Path) -> None:
    context = HandoffContext(conversation_history=[{"role": "user", "content": "my card was charged twice"}])
    path = tmp_path / "ctx.json"
    path.write_bytes(serialize_context(context))
    done = cli("request", "billing-1", "--from", "triage-1", "--reason", "refund", "--priority", "3",
               "--context", f"@{path}", "--request-id", "r-1", "--metadata", "ticket=T-9")
    assert done.exit_code == 0, done.output
    assert done.stdout.strip() == "requested triage-1/r-1 -> billing-1 (PENDING, priority 3)"

    shown = cli("status", "triage-1/r-1")
    assert shown.exit_code == 0
    lines = dict(line.split(None, 1) if " " in line else (line, "") for line in shown.stdout.splitlines())
    assert lines["status"].strip() == "PENDING"
    assert "triage-1 -> billing-1" in shown.stdout and re.search(r"\(in (299\.\d|300\.0) s\)", lines["deadline"])
    assert lines["waiting"].split() == ["for", "billing-1"]
    assert "PENDING(triage-1) +0 ms" in shown.stdout

    record = cli.json("status", "triage-1/r-1")["record"]
    assert record["request"]["metadata"] == {"ticket": "T-9"} and record["request"]["priority"] == 3
    made = cli.json("request", "other-1", "--from", "triage-1", "--request-id", "r-2", "--timeout", "60")
    deadline = cli.json("status", "triage-1/r-2")["record"]["deadline_ms"]
    assert made["deadline_ms"] == deadline and made["status"] == "PENDING"  # the server's epoch ms

    pending = cli("pending", "billing-1")
    assert pending.exit_code == 0 and "triage-1/r-1" in pending.stdout and "1 queued" in pending.stdout
    listed = cli.json("pending", "billing-1")
    assert [p["handoff_id"] for p in listed["queued"]] == ["triage-1/r-1"] and listed["in_flight"] == []


def test_context_from_stdin_and_bad_contexts(cli: Cli) -> None:
    good = serialize_context(HandoffContext(conversation_history=[{"role": "user", "content": "hi"}])).decode()
    assert cli("request", "a-1", "--context", "-", input=good).exit_code == 0
    bad = cli("request", "a-1", "--context", '{"conversation_history": 7}')
    assert bad.exit_code == 2 and "not a handoff context" in bad.stderr
    missing = cli("request", "a-1", "--context", "@/nonexistent.json")
    assert missing.exit_code == 2 and "cannot read the context" in missing.stderr
    assert cli("request").exit_code == 2  # neither an agent nor capabilities
    assert cli("request", "a b").exit_code == 2  # not a valid agent id
    assert cli("request", "a-1", "--metadata", "novalue").exit_code == 2


def test_request_wait_exit_codes_and_routing(cli: Cli, worker: subprocess.Popen[str]) -> None:
    done = cli("request", "echo-1", "--reason", "hello", "--wait")
    assert done.exit_code == 0, done.output
    assert done.stdout.splitlines()[1:] == ["ACCEPTED by echo-1", "COMPLETED by echo-1: "
                                            "{'echo': 'hello', 'messages': 0, 'attempt': 1}"]
    failed = cli("request", "faulty-1", "--wait")
    assert failed.exit_code == 1 and "FAILED by faulty-1: ValueError: the tool crashed" in failed.stdout
    routed = cli("request", "--capability", "echo", "--reason", "routed", "--wait")
    assert routed.exit_code == 0 and "capabilities echo" in routed.stdout and "COMPLETED" in routed.stdout
    nobody = cli("request", "--capability", "teleport", "--fail-fast", "--wait")
    assert nobody.exit_code == 1 and "REJECTED by _router: NO_CAPABLE_AGENT" in nobody.stdout
    expired = cli("request", "nobody-1", "--timeout", "0.3", "--wait")
    assert expired.exit_code == 1 and "EXPIRED" in expired.stdout


def test_status_watch_until_the_end_and_unknown_ids(cli: Cli, worker: subprocess.Popen[str]) -> None:
    assert cli("request", "echo-1", "--request-id", "w-1", "--from", "req").exit_code == 0
    watched = cli("status", "req/w-1", "--watch", "--interval", "0.05")
    assert watched.exit_code == 0
    assert watched.stdout.count("handoff ") >= 1 and "COMPLETED" in watched.stdout
    final = watched.stdout.split("handoff ")[-1]
    assert "status      COMPLETED" in final and "held by     echo-1, worker" in final and "attempt 1" in final
    assert "result      {'echo': '', 'messages': 0, 'attempt': 1}" in final
    unknown = cli("status", "req/nothing")
    assert unknown.exit_code == 1 and "no handoff req/nothing" in unknown.stdout
    assert cli("status", "no-slash").exit_code == 2


def test_square_brackets_in_user_data_are_printed_as_they_are(cli: Cli) -> None:
    # what users write (reasons, rejections, errors, results) is never read as Rich markup: "[/x]"
    # crashed the commands with a MarkupError, and "[red]" vanished from the output
    reason = "parse config[/etc/app.ini], list[red] and arr[bold]"
    assert cli("request", "w-1", "--from", "req", "--request-id", "b-1", "--reason", reason).exit_code == 0
    shown = cli("status", "req/b-1")
    assert shown.exit_code == 0 and [reason] == [line.split(None, 1)[1] for line in shown.stdout.splitlines()
                                                 if line.startswith("reason ")]
    pending = cli("pending", "w-1")
    assert pending.exit_code == 0 and reason in pending.stdout

    async def refuse() -> None:
        async with cli.bus() as bus:
            await bus.client("w-1").reject_handoff("req/b-1", "no [/b] way [green]", code="BUSY")

    in_loop(refuse)
    refused = cli("status", "req/b-1")
    rejected = [line.split(None, 1)[1] for line in refused.stdout.splitlines() if line.startswith("rejected ")]
    assert refused.exit_code == 0 and rejected == ["BUSY no [/b] way [green]"]
    # the same request again: it answers the handoff's decision at once
    waited = cli("request", "w-1", "--from", "req", "--request-id", "b-1", "--reason", reason, "--wait")
    assert waited.exit_code == 1 and "REJECTED by w-1: BUSY no [/b] way [green]" in waited.stdout
    assert "Traceback" not in waited.output + refused.output + pending.output + shown.output


def test_pending_lists_what_it_can_around_an_undecodable_record(cli: Cli) -> None:
    async def poison() -> None:
        async with cli.bus() as bus:
            for name in ("p-1", "p-2", "p-3"):
                await bus.client("req").request_handoff(req("req", "q-1", request_id=name, reason=name))
            await bus.redis.set(bus.keys.record("req", "p-2").envelope, b"\x92garbage")
            await bus.redis.zadd(bus.keys.target("q-1").queue, {b"no-handoff-id": 1e15, b"\xff/x": 1e15 + 1})
            _, taken = await Inbox(bus, "q-1", "worker-3").take(1)  # one in flight as well
            assert [d.handoff_id for d in taken] == ["req/p-1"]

    in_loop(poison)
    text = cli("pending", "q-1")
    assert text.exit_code == 0, text.output
    assert "req/p-3" in text.stdout and "1 queued" in text.stdout and "req/p-2" not in text.stdout
    assert "1 in flight" in text.stdout and "worker-3" in text.stdout
    assert "left out req/p-2, whose record cannot be decoded" in text.stderr
    listed = cli.json("pending", "q-1")
    assert [p["handoff_id"] for p in listed["queued"]] == ["req/p-3"]
    assert [u["handoff_id"] for u in listed["unreadable"]] == ["req/p-2", "no-handoff-id", "\\xff/x"]
    assert [e["handoff_id"] for e in listed["in_flight"]] == ["req/p-1"]
    # the monitors read around the members that name no handoff (a worker dead-letters them)
    [row] = [r for r in cli.json("top", "--iterations", "1")["agents"] if r["agent"] == "q-1"]
    assert row["queued"] == 4 and row["in_flight"] == 1 and row["oldest_waiting_s"] > 0
    probe = cli("check", "--agent", "q-1", "--json")
    assert probe.exit_code == 1 and json.loads(probe.stdout)["problems"] == ["q-1: no live worker"]


def test_dead_letter_counts_and_entry_ids_out_of_range_are_usage_errors(cli: Cli) -> None:
    for args in (("dlq", "list", "x-1", "--count", "0"), ("dlq", "list", "x-1", "--count", "-3"),
                 ("dlq", "list", "x-1", "--count", str(2**64)), ("pending", "x-1", "--count", str(2**64)),
                 ("dlq", "replay", "x-1", "99999999999999999999-0"),
                 ("dlq", "replay", "x-1", "1-18446744073709551616")):
        result = cli(*args)
        assert result.exit_code == 2 and "Traceback" not in result.output, (args, result.output)
        assert "--count must be from 1 to" in result.stderr or "not a stream entry id" in result.stderr
    assert cli.json("dlq", "list", "x-1", "--count", "1") == []


def test_status_watch_interval_is_checked(cli: Cli) -> None:
    for value in ("-1", "nan", "0"):  # sleep() raised on the first two after a first look; 0 spun
        result = cli("status", "req/x", "--watch", "--interval", value)
        assert result.exit_code == 2 and "--interval" in result.stderr, (value, result.output)


def test_a_request_the_server_refuses_is_reported_not_a_traceback() -> None:
    server = start_server(SERVER_BINARIES["valkey"])
    try:
        async def fill() -> None:
            async with HandoffBus.connect(server.url) as bus:
                await bus.redis.config_set("maxmemory", "1")  # at its limit, with noeviction

        in_loop(fill)
        result = CliRunner().invoke(app, ["request", "x-1", "--redis-url", server.url, "--prefix", "oom"])
        assert isinstance(result.exception, SystemExit) and result.exit_code == 1, repr(result.exception)
        assert "the server refused the command" in result.stderr and "maxmemory" in result.stderr
    finally:
        server.stop()


def test_a_pending_listing_cut_by_count_says_how_many_are_queued(cli: Cli) -> None:
    async def queue_three() -> None:
        async with cli.bus() as bus:
            for i in range(3):
                await bus.client("req").request_handoff(req("req", "many-1", request_id=f"c-{i}"))

    in_loop(queue_three)
    text = cli("pending", "many-1", "--count", "2")
    assert "3 queued, in serving order (the first 2)" in text.stdout


# ---------------------------------------------------------------------- pending in flight, dead letters


def test_in_flight_entries_and_their_idle_time(cli: Cli) -> None:
    async def take_one() -> None:
        async with cli.bus() as bus:
            await bus.client("req").request_handoff(req("req", "slow-1", request_id="f-1"))
            await bus.client("req").request_handoff(req("req", "slow-1", request_id="f-2"))
            _, taken = await Inbox(bus, "slow-1", "worker-9").take(1)
            assert [d.handoff_id for d in taken] == ["req/f-1"]

    in_loop(take_one)
    shown = cli.json("pending", "slow-1")
    assert [p["handoff_id"] for p in shown["queued"]] == ["req/f-2"]
    [entry] = shown["in_flight"]
    assert entry["handoff_id"] == "req/f-1" and entry["consumer"] == "worker-9" and entry["deliveries"] == 1
    text = cli("pending", "slow-1", "--idle", "0")
    assert "1 in flight, idle >= 0 ms" in text.stdout and "worker-9" in text.stdout and "queued" not in text.stdout
    assert cli.json("pending", "slow-1", "--idle", "3600000")["in_flight"] == []


def test_dead_letters_listed_and_replayed(cli: Cli) -> None:
    async def poison() -> None:
        async with cli.bus() as bus:
            await bus.client("req").request_handoff(req("req", "sick-1", request_id="d-1"))
            inbox = Inbox(bus, "sick-1", "worker-1")
            _, [taken] = await inbox.take(1)
            await inbox.dead_letter(taken, "delivered 6 times; its handling kept stopping workers", 6)

    in_loop(poison)
    [letter] = cli.json("dlq", "list", "sick-1")
    assert letter["handoff_id"] == "req/d-1" and letter["deliveries"] == 6 and "kept stopping" in letter["reason"]
    text = cli("dlq", "list", "sick-1")
    assert "1 dead letters" in text.stdout and letter["entry_id"] in text.stdout
    replayed = cli("dlq", "replay", "sick-1", letter["entry_id"])
    assert replayed.exit_code == 0 and f"replayed {letter['entry_id']} (req/d-1) to sick-1" in replayed.stdout
    assert cli.json("dlq", "list", "sick-1") == []
    assert [p["handoff_id"] for p in cli.json("pending", "sick-1")["queued"]] == ["req/d-1"]
    assert cli("dlq", "replay", "sick-1", letter["entry_id"]).exit_code == 1  # gone now

    async def dead_again() -> None:  # the replayed handoff kept failing; then it was cancelled
        async with cli.bus() as bus:
            inbox = Inbox(bus, "sick-1", "worker-2")
            _, [taken] = await inbox.take(1)
            await inbox.dead_letter(taken, "delivered 6 times; its handling kept stopping workers", 6)
            await bus.client("req").cancel_handoff("req/d-1")

    in_loop(dead_again)
    [again] = cli.json("dlq", "list", "sick-1")
    dropped = cli("dlq", "replay", "sick-1", again["entry_id"])
    assert dropped.exit_code == 1 and f"dropped dead letter {again['entry_id']} of sick-1: req/d-1 is CANCELLED" \
        in dropped.stdout
    assert cli.json("dlq", "list", "sick-1") == []


def test_a_dead_letters_accepted_handoff_failed_from_the_cli(cli: Cli) -> None:
    async def poison() -> None:
        async with cli.bus() as bus:
            for name in ("d-1", "d-2"):
                await bus.client("req").request_handoff(req("req", "sick-2", request_id=name))
            inbox = Inbox(bus, "sick-2", "worker-1")
            _, taken = await inbox.take(2)
            await bus.client("sick-2")._transition("accept", "req/d-1", {"lease": "worker-1"}, settle=False)
            for delivery in taken:
                await inbox.dead_letter(delivery, "delivered 6 times; its handling kept stopping workers", 6)

    in_loop(poison)
    accepted, pending = cli.json("dlq", "list", "sick-2")
    refused = cli("dlq", "fail", "sick-2", pending["entry_id"])
    assert refused.exit_code == 1 and "cannot fail handoff 'req/d-2': it is PENDING" in refused.stdout
    refused = cli("dlq", "fail", "sick-2", pending["entry_id"], "--json")  # JSON asked for: JSON, refusal too
    assert refused.exit_code == 1 and json.loads(refused.stdout) == {
        "agent": "sick-2", "entry_id": pending["entry_id"], "handoff_id": "req/d-2", "failed": False,
        "error": "cannot fail handoff 'req/d-2': it is PENDING; replay it, or its requester cancels it (its deadline "
                 "expires it)"}
    failed = cli.json("dlq", "fail", "sick-2", accepted["entry_id"], "--error", "operator gave up")
    assert failed == {"agent": "sick-2", "entry_id": accepted["entry_id"], "handoff_id": "req/d-1", "failed": True,
                      "status": "FAILED", "held": False}
    record = cli.json("status", "req/d-1")["record"]
    assert record["status"] == "FAILED" and record["response"]["error"] == "operator gave up"
    assert [d["entry_id"] for d in cli.json("dlq", "list", "sick-2")] == [pending["entry_id"]]


# ---------------------------------------------------------------------- agents, top, check


def test_agents_lists_the_live_workers(cli: Cli, worker: subprocess.Popen[str]) -> None:
    found = {a["agent_id"]: a for a in cli.json("agents")}
    assert set(found) == {"echo-1", "faulty-1"}
    [echo_worker] = found["echo-1"]["workers"]
    assert echo_worker["state"] == "RUNNABLE" and echo_worker["limit"] == 8
    text = cli("agents").stdout
    assert "2 live agents" in text and "echo-1" in text and "RUNNABLE" in text and "0/8" in text


def test_top_shows_backlog_rates_and_latencies(cli: Cli, worker: subprocess.Popen[str]) -> None:
    for i in range(5):
        assert cli("request", "echo-1", "--wait", "--reason", f"r{i}").exit_code == 0
    assert cli("request", "idle-1").exit_code == 0  # no worker: stays queued
    frames = [json.loads(line) for line in cli("top", "--iterations", "2", "--interval", "1.2", "--json")
              .stdout.splitlines()]
    assert len(frames) == 2
    rows = {row["agent"]: row for row in frames[1]["agents"]}
    assert {"echo-1", "faulty-1", "idle-1"} <= set(rows)
    echo, idle = rows["echo-1"], rows["idle-1"]
    assert (echo["queued"], echo["in_flight"], echo["workers"]) == (0, 0, 1)
    assert 0 < echo["decision_p50_s"] <= echo["decision_p99_s"] < 5
    assert 0 < echo["completion_p50_s"] <= echo["completion_p99_s"] < 5
    assert frames[0]["agents"][0]["rates"] is None and echo["rates"] is not None  # a rate needs two readings
    assert idle["queued"] == 1 and idle["workers"] == 0 and idle["oldest_waiting_s"] > 0
    table = cli("top", "--iterations", "1").stdout
    assert "handoffbus top" in table and "echo-1" in table and "idle-1" in table and "oldest waiting" in table


def test_check_for_probes(cli: Cli, worker: subprocess.Popen[str]) -> None:
    ok = cli("check", "--agent", "echo-1")
    assert ok.exit_code == 0 and ok.stdout.startswith("ok; echo-1: 1 live workers, 0 queued")
    assert cli("check").exit_code == 0
    none = cli("check", "--agent", "ghost-1")
    assert none.exit_code == 1 and "ghost-1: no live worker" in none.stderr
    assert cli("request", "echo-1", "--wait").exit_code == 0
    assert cli("request", "ghost-1").exit_code == 0
    old = cli("check", "--agent", "ghost-1", "--max-backlog-age", "0", "--json")
    assert old.exit_code == 1 and json.loads(old.stdout)["ok"] is False
    assert any("oldest queued handoff waited" in p for p in json.loads(old.stdout)["problems"])
    down = CliRunner().invoke(app, ["check", "--redis-url", "redis://127.0.0.1:1/0"])
    assert down.exit_code == 1 and "Redis unavailable" in down.stderr
    # no server given at all is a usage error (2), not an unhealthy server
    unset = CliRunner(env={"HANDOFFBUS_REDIS_URL": "", "REDIS_URL": ""}).invoke(app, ["check"])
    assert unset.exit_code == 2 and "needs a server" in unset.stderr and "unavailable" not in unset.stderr


# ---------------------------------------------------------------------- global options and exit codes


def test_global_options_environment_and_exit_codes(cli: Cli) -> None:
    runner = CliRunner()
    assert runner.invoke(app, ["--redis-url", cli.url, "--prefix", cli.prefix, "request", "g-1"]).exit_code == 0
    via_env = runner.invoke(app, ["--prefix", cli.prefix, "--json", "pending", "g-1"],
                            env={"HANDOFFBUS_REDIS_URL": cli.url})
    assert via_env.exit_code == 0 and len(json.loads(via_env.stdout)["queued"]) == 1
    via_redis_url = runner.invoke(app, ["pending", "g-1", "--prefix", cli.prefix, "--json"],
                                  env={"HANDOFFBUS_REDIS_URL": "", "REDIS_URL": cli.url})
    assert via_redis_url.exit_code == 0 and len(json.loads(via_redis_url.stdout)["queued"]) == 1
    unset = runner.invoke(app, ["agents"], env={"HANDOFFBUS_REDIS_URL": "", "REDIS_URL": ""})
    assert unset.exit_code == 2 and "needs a server" in unset.stderr
    for command in (["agents"], ["status", "a/b"], ["pending", "x-1"], ["request", "x-1"], ["top", "--iterations", "1"],
                    ["dlq", "list", "x-1"]):
        down = runner.invoke(app, [*command, "--redis-url", "redis://127.0.0.1:1/0"])
        assert down.exit_code == 69, (command, down.output)
        assert "Redis unavailable" in down.stderr
    assert runner.invoke(app, ["no-such-command"]).exit_code == 2
    assert runner.invoke(app, ["pending"]).exit_code == 2  # a missing argument
    assert runner.invoke(app, ["agents", "--prefix", "bad prefix", "--redis-url", cli.url]).exit_code == 2


def test_python_dash_m_and_version() -> None:
    done = subprocess.run([sys.executable, "-m", "handoffbus", "-V"], capture_output=True, text=True, check=False)
    assert done.returncode == 0 and done.stdout.startswith("handoffbus ")
    helped = subprocess.run([sys.executable, "-m", "handoffbus", "--help"], capture_output=True, text=True,
                            check=False)
    for command in ("request", "status", "pending", "agents", "dlq", "top", "check", "acl", "worker", "demo"):
        assert command in helped.stdout


@pytest.mark.parametrize(("flag", "value"), [("--reclaim-idle", "0"), ("--reclaim-idle", "-1"),
                                             ("--grace", "nan"), ("--offer-time", "inf")])
def test_a_worker_refuses_durations_that_would_break_it(cli: Cli, flag: str, value: str) -> None:
    # --reclaim-idle 0 would take over every running handoff of the agent's other workers at once
    result = cli("worker", "tests.agents:Echo", flag, value)
    assert result.exit_code == 2 and flag in result.stderr


def test_bad_input_to_the_operator_commands_is_a_usage_error(cli: Cli) -> None:
    bad = (("pending", "x", "--count", "-1"), ("pending", "x", "--idle", "-5"), ("dlq", "replay", "x", "garbage"),
           ("forwarder", "--grant", "spec-b"), ("forwarder", "--grant", "spec-b="), ("forwarder", "--grant", "a=b{c}"))
    for args in bad:
        result = cli(*args)
        assert result.exit_code == 2 and "Traceback" not in result.output, (args, result.output)
    result = CliRunner().invoke(app, ["status", "a/b", "--redis-url", "foo"])
    assert result.exit_code == 2 and "not a Redis URL" in result.stderr
    # a bad prefix is the caller's mistake, not an unhealthy bus
    result = CliRunner().invoke(app, ["check", "--redis-url", cli.url, "--prefix", "bad{x}"])
    assert result.exit_code == 2 and "invalid key prefix" in result.stderr


def test_a_bad_url_or_port_is_a_usage_error_not_a_traceback() -> None:
    runner = CliRunner()
    for args, said in [
        (["agents", "--redis-url", "redis://127.0.0.1:99999/0"], "not a usable Redis URL: Port out of range"),
        (["status", "a/b", "--redis-url", "redis://127.0.0.1:6379/0?socket_timeout=abc"], "not a usable Redis URL"),
        (["worker", "tests.agents:Echo", "--metrics-port", "99999", "--redis-url", "redis://127.0.0.1:1/0"],
         "cannot serve metrics on 0.0.0.0:99999"),
        # a mistyped host: getaddrinfo's UnicodeError (an empty label) is no OSError
        (["worker", "tests.agents:Echo", "--metrics-port", "0", "--metrics-address", "10.0.0..1",
          "--redis-url", "redis://127.0.0.1:1/0"], "cannot serve metrics on 10.0.0..1:0"),
        (["exporter", "--port", "0", "--address", "10.0.0..1", "--redis-url", "redis://127.0.0.1:1/0"],
         "cannot serve metrics on 10.0.0..1:0"),
    ]:
        result = runner.invoke(app, args)
        assert result.exit_code == 2 and said in result.output, (args, result.output, result.exception)


def test_demo_cluster_says_where_the_url_it_refuses_came_from() -> None:
    runner = CliRunner()
    given = runner.invoke(app, ["demo", "--cluster", "--redis-url", "redis://127.0.0.1:1/0"])
    assert given.exit_code == 2 and "give it no --redis-url" in given.stderr
    from_env = runner.invoke(app, ["demo", "--cluster"], env={"HANDOFFBUS_REDIS_URL": "redis://127.0.0.1:1/0"})
    assert from_env.exit_code == 2 and "HANDOFFBUS_REDIS_URL" in from_env.stderr, from_env.stderr


def test_a_demo_that_cannot_start_says_why_in_one_line(servers: dict) -> None:
    runner = CliRunner()
    down = runner.invoke(app, ["demo", "--redis-url", "redis://127.0.0.1:1/0"])
    assert down.exit_code == 69 and down.output.startswith("handoffbus: Redis unavailable"), down.output
    binary = runner.invoke(app, ["demo"], env={"HANDOFFBUS_REDIS_SERVER": "/nonexistent/redis-server"})
    assert binary.exit_code == 1 and "cannot start the server '/nonexistent/redis-server'" in binary.output


def test_the_demo_writes_under_the_prefix_it_is_given(servers: dict) -> None:
    prefix = new_prefix()
    result = CliRunner().invoke(app, ["--prefix", prefix, "demo", "--redis-url", servers["valkey"].url])
    assert result.exit_code == 0, result.output

    async def keys() -> tuple[int, int]:
        async with HandoffBus.connect(servers["valkey"].url, prefix=prefix) as bus:
            mine = [k async for k in bus.redis.scan_iter(match=f"{prefix}:*")]
            default = [k async for k in bus.redis.scan_iter(match="hb:{refunds-1}:*")]
            return len(mine), len(default)

    mine, default = anyio.run(keys)
    assert mine > 0 and default == 0


def test_a_demo_closed_with_its_terminal_stops_its_embedded_server() -> None:
    """SIGHUP (a closed terminal or ssh session): the embedded server goes with the demo
    (Redis ignores SIGHUP: left alone, it ran on without its parent)."""
    demo = subprocess.Popen([sys.executable, "-m", "handoffbus", "demo", "--handoffs", "5000000"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        assert demo.stdout is not None
        assert demo.stdout.readline().startswith("handoffbus demo on an embedded server")  # it runs now
        children = Path(f"/proc/{demo.pid}/task/{demo.pid}/children").read_text().split()
        servers = [int(pid) for pid in children
                   if "server" in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()]
        assert len(servers) == 1
        demo.send_signal(signal.SIGHUP)
        assert demo.wait(timeout=30) is not None
        assert not Path(f"/proc/{servers[0]}").exists() or b"zombie" in Path(f"/proc/{servers[0]}/status").read_bytes()
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait()
        if demo.stdout is not None:
            demo.stdout.close()


def test_check_gives_up_on_a_server_that_stopped_answering() -> None:
    """A frozen server accepts connections and never replies: the probe says so within its
    --timeout, instead of waiting until its orchestrator kills it (or for ever, run by hand)."""
    server = start_server(SERVER_BINARIES["redis"])
    assert server.process is not None
    try:
        server.process.send_signal(signal.SIGSTOP)
        result = CliRunner().invoke(app, ["check", "--timeout", "1", "--redis-url", server.tcp_url])
        assert result.exit_code == 1 and "did not answer within 1 s" in result.output, result.output
    finally:
        server.process.send_signal(signal.SIGCONT)
        server.stop()


def test_refresh_intervals_and_agent_ids_are_checked_before_anything_runs() -> None:
    runner = CliRunner()
    for args, said in [
        (["top", "--interval", "0", "--redis-url", "redis://127.0.0.1:1/0"], "--interval"),
        (["exporter", "--interval", "-1", "--redis-url", "redis://127.0.0.1:1/0"], "--interval"),
        (["check", "--agent", "bad name!", "--redis-url", "redis://127.0.0.1:1/0"], "agent id"),
        (["top", "--agent", "bad name!", "--redis-url", "redis://127.0.0.1:1/0"], "agent id"),
    ]:
        result = runner.invoke(app, args)
        assert result.exit_code == 2 and said in result.output, (args, result.output)


def test_a_password_in_the_redis_url_is_never_printed() -> None:
    runner = CliRunner()
    # a mistyped scheme in HANDOFFBUS_REDIS_URL: the usage error goes to the container's log
    typo = runner.invoke(app, ["agents", "--redis-url", "redis+clustr://app:s3cret-pw@127.0.0.1:1/0"])
    assert typo.exit_code == 2 and "not a Redis URL" in typo.output, typo.output
    assert "s3cret-pw" not in typo.output, typo.output
    server = start_server(SERVER_BINARIES["valkey"])
    try:
        import redis as sync_redis

        with sync_redis.Redis(unix_socket_path=str(server.socket_path)) as admin:
            admin.config_set("requirepass", "s3cret-pw")
        demo = runner.invoke(app, ["--prefix", new_prefix(), "demo", "--redis-url",
                                   f"redis://:s3cret-pw@127.0.0.1:{server.port}/0"])
    finally:
        server.stop()
    assert demo.exit_code == 0 and "demo on redis://" in demo.output, demo.output
    assert "s3cret-pw" not in demo.output, demo.output
