"""Diagnostic (prints, writes no result file): the demo target's pass, 1 thread, with its batch in
slots 0..b-1 (attention reads the KV cache as a view) and with one hole (slots 0..b-2 and b:
every pass gathers every row's K/V), at 4, 16 and 32 sequences of ~100 cached tokens, widths 1
and 5. Made the figures in `SpeculativeEngine._compact`'s docstring (median of 25 passes, in one
run, quiet machine: b=4 8.5 -> 9.8 ms, b=16 19.4 -> 23.4, b=32 29.4 -> 40.2 at width 1):

    .venv/bin/python benchmarks/diagnostics/slot_gather.py [models/demo/target]
"""
import statistics, sys, time

import torch
torch.set_num_threads(1)
from specserve.core.runner import ModelRunner
t = ModelRunner.from_pretrained((sys.argv[1] if len(sys.argv) > 1 else "models/demo/target"), name="target", slots=33)
prompt = [(i * 37) % 8000 + 5 for i in range(100)]
t.prefill_batch([(s, prompt) for s in range(33)])
for b in (4, 16, 32):
    for name, slots in (("compact", list(range(b))), ("hole", list(range(b - 1)) + [b])):
        for w in (1, 5):
            ts = []
            for _ in range(25):
                t0 = time.perf_counter(); t.score_batch([(s, [5] * w) for s in slots]); ts.append(time.perf_counter() - t0)
                for s in slots: t.rollback(w, slot=s)
            print(f"b={b} w={w} {name}: {1e3*statistics.median(ts):.2f} ms")
