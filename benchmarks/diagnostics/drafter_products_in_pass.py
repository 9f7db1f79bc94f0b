"""Diagnostic (prints, writes no result file): the demo drafter's twelve layer products (float32,
in the layouts its GemmPlan chose for one row) timed three ways, one torch thread, median µs:
inside real one-token passes (each product wrapped in a timer, 300 passes, one sequence of 64
cached tokens), back to back alone (weights hot in cache), and back to back after reading 8 MB of
other memory (weights evicted, as the head's 3 MB and a target pass evict them in a round).

    .venv/bin/python benchmarks/diagnostics/drafter_products_in_pass.py [models/demo/drafter]
"""
import collections
import statistics
import sys
import time

import torch

torch.set_num_threads(1)
from specserve.core.runner import ModelRunner  # noqa: E402
from _shared import median_us  # noqa: E402


r = ModelRunner.from_pretrained(sys.argv[1] if len(sys.argv) > 1 else "models/demo/drafter", role="drafter", slots=4)
r.prefill(list(range(10, 74)))
f = r.fast
if f.gemm is None:
    sys.exit("the drafter's layers are not planned float32 products here (prepacked bfloat16?)")
ids = torch.tensor([[5]])


def one_pass():
    r.score_ids(ids, [0])
    r.rollback(1)


in_pass = collections.defaultdict(list)
make = f._product


def timed(w, bucket):
    fn, key = make(w, bucket), (tuple(w.shape), f.gemm.plan.get((tuple(w.shape), bucket), "linear"))

    def run(x):
        t0 = time.perf_counter()
        y = fn(x)
        in_pass[key].append(time.perf_counter() - t0)
        return y
    return run


for _ in range(20):
    one_pass()
f._product, f._gemm_tables = timed, {}
print(f"pass, width 1: {median_us(one_pass) / 1e3:.3f} ms (each product timed)")
f._product, f._gemm_tables = make, {}
for (shape, how), times in in_pass.items():
    print(f"  {shape[0]} x {shape[1]} ({how}) in the pass: {1e6 * statistics.median(times):.1f} µs")
ws = [w for lw in f.layer_weights for w in (lw.qkv, lw.o, lw.gate_up, lw.down)]
fns = [make(w, 1) for w in ws]
xs = [torch.randn(1, 1, w.shape[1]) for w in ws]
other = torch.randn(8 * 2**20 // 4)
with torch.inference_mode():
    for rep in range(2):
        hot = median_us(lambda: [fn(x) for fn, x in zip(fns, xs)])
        evicted = median_us(lambda: (other.sum(), [fn(x) for fn, x in zip(fns, xs)])) - median_us(other.sum)
        print(f"the twelve back to back: {hot:.0f} µs hot, {evicted:.0f} µs after reading 8 MB of other memory")
