"""The benchmark scripts keep working: a tiny run of each, checked through its JSON output."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_script(name: str, out: Path, *args: str) -> dict:
    done = subprocess.run([sys.executable, f"benchmarks/{name}", "--json", str(out), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(out.read_text())


def test_core_benchmark_runs(tmp_path: Path) -> None:
    result = run_script("bench_core.py", tmp_path / "core.json", "--n", "200", "--warmup", "50")
    assert result["ours"]["n"] == 200 and result["ours"]["problems"] == {}
    assert result["ours"]["handoffs_per_s"] > 0 and result["bare_ceiling"]["msgs_per_s"] > 0


def test_worker_process_benchmark_runs(tmp_path: Path) -> None:
    result = run_script("bench_workers.py", tmp_path / "workers.json",
                        "--n", "200", "--warmup", "50", "--processes", "1,2", "--modes", "direct,routed,isolated")
    runs = result["workers"]
    assert [(r["processes"], r["mode"]) for r in runs] == [
        (p, mode) for p in (1, 2) for mode in ("direct", "routed", "isolated")]
    for r in runs:
        assert r["problems"] == {} and r["n"] == 200 and r["handoffs_per_s"] > 0
        # every worker (and an isolated run's forwarder) stopped cleanly on SIGTERM
        assert r["exit_codes"] == [0] * (r["processes"] + (r["mode"] == "isolated"))
        # each handoff's stages add up to its outcome latency (the server's ms are whole)
        stages = r["stages_ms"]
        assert list(stages) == ["request", "to accepted", "to completed", "heard"]
        assert stages["request"]["p50"] > 0 and stages["to completed"]["p50"] >= 0
        # "to accepted" counts from when request_handoff returned, and a worker may accept before
        # that: by up to the request's own time (a busy loop returns late), never more
        floor = -stages["request"]["max"] - 2
        assert all(floor <= stage["p50"] <= stage["max"] <= r["outcome_ms"]["max"] + 2 for stage in stages.values())


def test_the_suite_runs_every_case(tmp_path: Path) -> None:
    result = run_script("suite.py", tmp_path / "suite.json", "--n", "200", "--warmup", "50", "--queued", "300",
                        "--memory-count", "200")
    names = [c["case"]["name"] for c in result["cases"]]
    assert names == ["direct", "4 workers", "routed", "64 KB plain", "64 KB gzip", "10,000 queued", "idle"]
    for case in result["cases"]:
        assert case["problems"] == {} and case["handoffs_per_s"] > 0, case["case"]["name"]
        assert case["exit_codes"] == [0] * case["case"]["processes"]
    assert result["commands"]["per_lifecycle"] > 2 and "FCALL" in result["commands"]["by_command"]
    assert result["memory"]["envelope_bytes"] > 1000 and result["memory"]["used_memory_per_handoff"] > 0
    assert set(result["met"]) == set(result["measured"])
    # the ceiling ran both ways: its worker loop in a process of its own (the one the targets use), and
    # in the suite's process
    assert result["batched_ceiling"]["n"] == result["one_process_ceiling"]["n"] == 25_000  # at least, however small n
    direct = result["cases"][0]
    assert direct["ratio_to_batched"] == round(direct["handoffs_per_s"] / result["batched_ceiling"]["msgs_per_s"], 4)


def test_the_profile_summary_splits_processes_and_leaves_out_the_ceiling(tmp_path: Path) -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from profile_workers import summarize
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    bench = 'process 1:"python benchmarks/bench_workers.py"'
    worker = 'process 2:"python -m handoffbus worker bench_workers:BenchEcho"'
    raw = tmp_path / "raw.txt"
    raw.write_text("\n".join([
        f"{bench};run (a.py:1);request_handoff (handoffbus/client.py:10) 30",
        f"{bench};run (a.py:1);request_handoff (handoffbus/client.py:12);pack (handoffbus/wire.py:5) 10",
        f"{bench};run (a.py:1);ceiling_round (bench_core.py:3) 500",
        f'{bench};process 3:"python bench_core.py --ceiling-worker unix:///s x:req x:rep workers 9";'
        "run (c.py:1);ceiling_worker (bench_core.py:9) 300",
        f"{bench};Thread._bootstrap (threading.py:1);wait (threading.py:2) 500",
        f"{bench};{worker};run (b.py:1);_handle (handoffbus/workers/runner.py:7) 20",
    ]) + "\n")
    text = summarize(raw, top=10)
    requester, worker_part = text.split("== worker")
    assert "== requester: 40 samples" in requester and ": 20 samples" in worker_part
    assert "100.0%  request_handoff (handoffbus/client.py)" in requester  # lines merged, inclusive
    assert " 25.0%  pack (handoffbus/wire.py)" in requester and "ceiling" not in text and "threading" not in text
    assert "100.0%  _handle (handoffbus/workers/runner.py)" in worker_part


def test_the_script_cost_breakdown_covers_every_step(tmp_path: Path) -> None:
    result = run_script("script_costs.py", tmp_path / "costs.json", "--n", "300")
    phases = {p["phase"]: p for p in result["phases"]}
    assert list(phases) == ["request_handoff (request + enqueue)", "enqueue alone", "take", "load", "accept",
                            "complete", "settle (in a take)"]
    # one script call per handoff for each step but take, load and settle, which serve up to 100 at a time
    for name in ("enqueue alone", "accept", "complete"):
        assert phases[name]["fcall_calls"] == 300, name
    assert phases["load"]["fcall_calls"] == 3  # a window of 100, all of one requester: one call
    assert phases["request_handoff (request + enqueue)"]["fcall_calls"] == 600
    assert 3 <= phases["take"]["fcall_calls"] < 30 and 3 <= phases["settle (in a take)"]["fcall_calls"] < 30
    for p in phases.values():  # a script's time includes its commands' time
        assert p["fcall_us_per_call"] >= p["commands_us_per_call"] > 0, p["phase"]
    assert result["per_lifecycle"]["fcall_us"] > 0 and result["request_script_us"] > 0


def test_the_script_costs_count_server_instructions_under_callgrind(tmp_path: Path) -> None:
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        done = subprocess.run([sys.executable, "benchmarks/script_costs.py", "--callgrind"], cwd=ROOT,
                              capture_output=True, text=True, timeout=120, check=False)
        assert done.returncode == 2 and "needs valgrind" in done.stderr  # refused, saying why
        return
    result = run_script("script_costs.py", tmp_path / "costs.json", "--n", "100", "--callgrind")
    phases = {p["phase"]: p for p in result["phases"]}
    # a transition (checks, history, response, indexes) runs more than the read that precedes it
    # (per handoff: one load call reads a window's handoffs)
    assert phases["accept"]["instructions_per_handoff"] > phases["load"]["instructions_per_handoff"] > 10_000
    assert phases["complete"]["instructions_per_handoff"] >= phases["complete"]["instructions_per_call"] > 10_000


def test_the_client_costs_count_python_instructions_per_handoff(tmp_path: Path) -> None:
    if shutil.which("valgrind") is None:
        done = subprocess.run([sys.executable, "benchmarks/client_costs.py"], cwd=ROOT,
                              capture_output=True, text=True, timeout=120, check=False)
        assert done.returncode == 2 and "needs valgrind" in done.stderr  # refused, saying why
        return
    result = run_script("client_costs.py", tmp_path / "client.json", "--n", "200")
    counts = result["instructions"]
    assert counts["with_n"] > counts["warmup_only"] > 0
    # a handoff's request, decision, work and outcome in Python: far more than a bare round trip
    assert counts["per_handoff"] == round((counts["with_n"] - counts["warmup_only"]) / 200) > 100_000
