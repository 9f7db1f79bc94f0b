"""Diagnostic (prints, writes no result file): how long a demo pair takes to start, from
`SpeculativePair(...)` to its verifier answering, and its first request; plain (target only),
speculative and pipelined, the rows alternated over the repeats, on one local Ray (its start not
counted). Run it at two commits to compare (stop 55: before and after the verifier loaded its
target while the drafter loaded).

    .venv/bin/python benchmarks/diagnostics/pair_start.py 3    # repeats
"""
import statistics
import subprocess
import sys
import time
from pathlib import Path

from specserve.cluster.pair import SpeculativePair, ensure_ray

m = Path(__file__).resolve().parents[2] / "models" / "demo"
target, drafter = str(m / "target"), str(m / "drafter")
repeats = int(sys.argv[1]) if len(sys.argv) > 1 else 3
commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                        cwd=m.parents[1]).stdout.strip()
dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True,
                       cwd=m.parents[1]).stdout.strip()
ensure_ray()
rows = {"plain": dict(drafter=None, pipeline=False), "speculative": dict(drafter=drafter, pipeline=False),
        "pipelined": dict(drafter=drafter, pipeline=True)}
starts: dict[str, list[float]] = {name: [] for name in rows}
for repeat in range(repeats):
    for name, kw in (rows.items() if repeat % 2 == 0 else list(rows.items())[::-1]):
        t0 = time.perf_counter()
        pair = SpeculativePair(target, kw["drafter"], pipeline=kw["pipeline"], cpus_per_actor=1, dtype="float32")
        up = time.perf_counter() - t0
        try:
            pair.generate([1, 2, 3, 4], 8, k=4 if kw["drafter"] else 0)
        finally:
            pair.shutdown()
        starts[name].append(up)
        print(f"{name}: up in {up:.1f} s", flush=True)
print(f"commit {commit}{' (with local changes)' if dirty else ''}; {repeats} repeats, median seconds to start:")
for name, s in starts.items():
    print(f"  {name}: {statistics.median(s):.1f} (min {min(s):.1f}, max {max(s):.1f})")
