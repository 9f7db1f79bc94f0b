"""Diagnostic (prints, writes no result file), float32: the GEMM plan's "swapped" layout with its output
left column-major (as before 6aa13be) against made row-major again, in one process, passes
alternating, 12 passes of each (the first 2 dropped), median, batch 1/4/16 x width 1/2/5. Made the "one-process
A/B" figures in the README and docs/benchmarks/README.md:

    .venv/bin/python benchmarks/diagnostics/gemm_layout_ab.py models/demo/target
"""
import time, statistics, torch, sys
torch.set_num_threads(1)
from specserve.core.runner import ModelRunner
from specserve.core import fast_llama as fl
new = fl.FastLlama._product
def old(self, w, bucket):  # the "swapped" product left column-major, as before 6aa13be
    if self.gemm.plan.get((tuple(w.shape), bucket), "linear") == "swapped":
        return lambda x: (w @ x.reshape(-1, x.shape[-1]).t()).t().reshape(*x.shape[:-1], w.shape[0])
    return new(self, w, bucket)
path = sys.argv[1]
r = ModelRunner.from_pretrained(path, name="m", slots=16, dtype="float32")  # (the plan is float32's)
prompt=list(range(1,65))
for s in range(16): r.prefill(prompt, slot=s)
res={}
for rep in range(12):
    for name, fn in (("old", old), ("new", new)):
        fl.FastLlama._product = fn
        r.fast._gemm_tables.clear()  # (each row bucket's products are made again with fn)
        for b in (1, 4, 16):
            for w in (1, 2, 5):
                for last in (True, False):
                    t0=time.perf_counter(); out=r.score_batch([(s,prompt[:w]) for s in range(b)], last_only=last); float(out[-1][-1,0])
                    res.setdefault((b,w,last,name),[]).append(time.perf_counter()-t0)
                    for s in range(b): r.rollback(w, slot=s)
for b in (1,4,16):
    for w in (1,2,5):
        for last in (True, False):
            o=statistics.median(res[(b,w,last,"old")][2:])*1e3; n=statistics.median(res[(b,w,last,"new")][2:])*1e3
            print(f"b={b} w={w} last_only={last}: old {o:.2f} new {n:.2f} ms  new/old {n/o:.2f}")
