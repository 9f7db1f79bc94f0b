"""Diagnostic (prints, writes no result file): where one demo-drafter pass (one token fed, one
row, `dtype: auto`) spends its time: cProfile of 500 passes (Python functions and the torch ops
they call, by own time), the whole head or the draft vocabulary (VOCAB=1, the default, or 0).
Stop 46 (the Xeon with AMX, in a slow spell): about 1.2 ms a pass under cProfile; the twelve
layer products (`_linear_for`'s lambdas) about 19 µs each, seven RMSNorms about 18 µs each, three
attentions about 36 µs each; the head (torch.profiler, the same loop) 0.31 ms whole, 0.085 ms
with the draft vocabulary.

    VOCAB=0 .venv/bin/python benchmarks/diagnostics/drafter_pass_profile.py
"""
import cProfile
import os
import pstats

import torch

from specserve.core.runner import ModelRunner

torch.set_num_threads(1)
vocab = os.environ.get("VOCAB", "1") == "1"
d = ModelRunner.from_pretrained("models/demo/drafter", name="drafter", role="drafter", slots=4)
d.prefill_batch([(0, list(range(1, 97)))])
ids = torch.tensor([[5]])


def one():
    d.score_ids(ids, [0], vocab=vocab)
    d.rollback(1, slot=0)


for _ in range(100):
    one()
profile = cProfile.Profile()
profile.enable()
for _ in range(500):
    one()
profile.disable()
pstats.Stats(profile).sort_stats("tottime").print_stats(20)
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
    for _ in range(100):
        one()
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
