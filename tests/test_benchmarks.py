"""The benchmark scripts keep working: a tiny run of each, checked through its JSON output."""

from __future__ import annotations

import json
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
