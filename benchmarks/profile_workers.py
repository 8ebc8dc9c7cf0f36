"""Profile the direct case of bench_workers.py with py-spy and print where each process spends it.

    python benchmarks/profile_workers.py [--n 8000] [--rate 250] [--top 25] [--raw benchmarks/results/profile.txt]

Runs ``bench_workers.py --processes 1 --modes direct`` under ``py-spy record --subprocesses``
(py-spy is in the ``dev`` extra), leaves out the ceiling loops and idle threads, and prints,
for the requester (this benchmark's process) and the worker process, the functions with the
most samples: inclusive (the function and what it calls) and self (the function's own code;
``Runner.run`` self is the event loop's native code: polling, socket reads and callbacks).
The raw stacks are kept for flame graphs (``flamegraph.pl`` or speedscope read them).
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
_LINE = re.compile(r":\d+\)$")


def summarize(raw: Path, top: int) -> str:
    """Per process: share of samples by function, inclusive and self."""
    inclusive: dict[str, Counter[str]] = {"requester": Counter(), "worker": Counter()}
    own: dict[str, Counter[str]] = {"requester": Counter(), "worker": Counter()}
    totals: Counter[str] = Counter()
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if "_bootstrap" in stack or "ceiling_round" in stack or "--ceiling-worker" in stack:
            continue  # idle threads, and the bare loops measured for the ratio (and their worker process)
        process = "worker" if "handoffbus worker" in stack else "requester"
        frames = [_LINE.sub(")", f) for f in stack.split(";")[1:] if not f.startswith("process ")]
        totals[process] += int(count)
        for frame in set(frames):
            inclusive[process][frame] += int(count)
        if frames:
            own[process][frames[-1]] += int(count)
    out = []
    for process in ("requester", "worker"):
        total = totals[process] or 1
        out.append(f"== {process}: {totals[process]:,} samples")
        for title, counts in (("inclusive", inclusive[process]), ("self", own[process])):
            out.append(f"-- {title}")
            shown = [(f, n) for f, n in counts.most_common() if "handoffbus/" in f or title == "self"]
            out += [f"{100 * n / total:5.1f}%  {f}" for f, n in shown[:top]]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=8000, help="measured handoffs (default 8000)")
    parser.add_argument("--rate", type=int, default=250, help="py-spy samples per second (default 250)")
    parser.add_argument("--top", type=int, default=25, help="functions shown per list (default 25)")
    parser.add_argument("--raw", default="benchmarks/results/profile.txt", help="where the raw stacks go")
    args = parser.parse_args(argv)
    spy = shutil.which("py-spy")
    if spy is None:
        parser.error("py-spy is not installed: pip install -e '.[dev]'")
    raw = Path(args.raw)
    raw.parent.mkdir(parents=True, exist_ok=True)
    bench = [sys.executable, str(HERE / "bench_workers.py"), "--processes", "1", "--modes", "direct",
             "--n", str(args.n), "--json", str(raw.with_suffix(".json"))]
    done = subprocess.run([spy, "record", "--rate", str(args.rate), "--subprocesses", "--format", "raw",
                           "--output", str(raw), "--", *bench], check=False)
    if done.returncode != 0:
        return done.returncode
    print(summarize(raw, args.top))
    print(f"\nraw stacks in {raw}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
