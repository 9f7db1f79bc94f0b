"""Diagnostic (prints, writes no result file): what a pause between two target passes costs the
second one. The demo target does 4 sequences x 5 positions, one torch thread. Before each pass
comes one of: nothing (back to back), an 8 ms sleep, an 8 ms spin, or 5 passes of the demo
drafter in this process. The four are shuffled in each of 8 rounds of 20 passes. The figure is
the pass's CPU time (medians). In the engine a pass always follows other work (the drafter's
answer, bookkeeping), so back-to-back timings (a profile, a micro-benchmark) understate it.

    .venv/bin/python benchmarks/diagnostics/pass_after_gap.py
"""
import time, statistics, torch, random
torch.set_num_threads(1)
from transformers.utils import logging as hf_logging; hf_logging.disable_progress_bar()
from specserve.core.runner import ModelRunner
t = ModelRunner.from_pretrained("models/demo/target", name="target", slots=8)
d = ModelRunner.from_pretrained("models/demo/drafter", name="drafter", role="drafter", slots=8)
b = 4
t.prefill_batch([(s, list(range(1, 97))) for s in range(b)]); d.prefill_batch([(s, list(range(1, 97))) for s in range(b)])
ids = torch.tensor([[5]] * b)
def gap(kind):
    if kind == "sleep 8 ms": time.sleep(0.008)
    elif kind == "spin 8 ms":
        e = time.perf_counter() + 0.008
        while time.perf_counter() < e: pass
    elif kind == "5 drafter passes":
        for _ in range(5): d.score_ids(ids, list(range(b)))
        for s in range(b): d.rollback(5, slot=s)
R = {}
kinds = ["none", "sleep 8 ms", "spin 8 ms", "5 drafter passes"]
for rep in range(8):
    random.shuffle(kinds)
    for kind in kinds:
        cs = []
        for _ in range(20):
            gap(kind)
            c0 = time.thread_time(); t.score_batch([(s, [5, 6, 7, 8, 9]) for s in range(b)]); cs.append(time.thread_time() - c0)
            for s in range(b): t.rollback(5, slot=s)
        R.setdefault(kind, []).append(statistics.median(cs))
base = statistics.median(R["none"])
for k, v in R.items(): print(f"4x5 pass CPU after {k:18s}: {1e3*statistics.median(v):.2f} ms ({statistics.median(v)/base:.2f}x)")
