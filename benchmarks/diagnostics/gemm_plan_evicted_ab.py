"""Diagnostic (prints, writes no result file): the demo drafter's one-token pass (one sequence of
64 cached tokens, one torch thread) under two GemmPlans, the passes interleaved 3000 times,
median ms: the plan as measured since stop 36 (each layout timed with the weights read from
memory, GemmPlan.EVICT_BYTES) and as measured before (the same products back to back, hot in
cache). Prints the layouts each chose at one row.

    .venv/bin/python benchmarks/diagnostics/gemm_plan_evicted_ab.py [models/demo/drafter]
"""
import collections
import statistics
import sys
import time

import torch

torch.set_num_threads(1)
from _shared import hot_gemm_plan  # noqa: E402
from specserve.core.runner import ModelRunner  # noqa: E402

r = ModelRunner.from_pretrained(sys.argv[1] if len(sys.argv) > 1 else "models/demo/drafter", role="drafter", slots=4)
f = r.fast
if f.gemm is None:
    sys.exit("the drafter's layers are not planned float32 products here (prepacked bfloat16?)")
evicted = f.gemm
hot = hot_gemm_plan(f)
for name, plan in (("evicted", evicted), ("hot", hot)):
    print(f"{name}-measured plan at one row:", {s: how for (s, rows), how in plan.plan.items() if rows == 1})
r.prefill(list(range(10, 74)))
ids = torch.tensor([[5]])
plans = {"hot-measured": (hot, {}), "evicted-measured": (evicted, {})}
times = collections.defaultdict(list)
for _ in range(3000):
    for name, (plan, tables) in plans.items():
        f.gemm, f._gemm_tables = plan, tables
        t0 = time.perf_counter()
        r.score_ids(ids, [0])
        r.rollback(1)
        times[name].append(time.perf_counter() - t0)
for name, ts in times.items():
    print(f"{name} plan: pass {1e3 * statistics.median(ts[100:]):.3f} ms")
