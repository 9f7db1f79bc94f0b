"""Diagnostic (prints, writes no result file): what a target pass of the demo pair costs by what
ran before it, and inside the engine. One torch thread.

1. The target's width-5 pass (batch 1) after: another width-5 pass, a width-1 pass, four drafter
   passes, a 5 ms sleep, a 5 ms Python spin, or writing 64 MB. The case is drawn at random before
   every pass (this machine's speed drifts by tens of percent over minutes, so cases measured in
   blocks one after another compare the drift, not the cases). Median ms per case.
2. The target passes inside the in-process engine, 24 greedy requests of 64 tokens each in a
   plain engine (k = 0) and a speculative one (k = 4) alternating: median ms of its width-1
   passes (plain decoding) and width-5 passes (verification), and of their matrix products by
   shape (torch.profiler, one request each).

    .venv/bin/python benchmarks/diagnostics/pass_interference.py
"""
import random, statistics, time
from pathlib import Path

import torch
torch.set_num_threads(1)
from specserve.core.runner import ModelRunner
from specserve.core.sampling import SamplingParams
from specserve.drafter.draft_model import DraftModelProposer
from specserve.training.demo_pair import heldout_prompts
from specserve.verifier.engine import SpeculativeEngine

target = ModelRunner.from_pretrained("models/demo/target", name="target", slots=8)
drafter = ModelRunner.from_pretrained("models/demo/drafter", name="drafter", role="drafter", slots=8)
prompts = heldout_prompts(Path("models/demo"), 6, 64, target.tokenizer)
SCRATCH = 7  # part 1's slot; the engines use slots 0-3
target.prefill(prompts[0], slot=SCRATCH)
drafter.prefill(prompts[0], slot=SCRATCH)
buffer = torch.zeros(16 << 20)  # 64 MB


def target_pass(width):
    target.score_batch([(SCRATCH, prompts[1][:width])], last_only=width == 1)
    target.rollback(width, slot=SCRATCH)


def drafter_passes():
    for _ in range(4):
        drafter.score_batch([(SCRATCH, [5])], last_only=True)
    drafter.rollback(4, slot=SCRATCH)


def spin(seconds):
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


before = {"another width-5 pass": lambda: target_pass(5), "a width-1 pass": lambda: target_pass(1),
          "four drafter passes": drafter_passes, "a 5 ms sleep": lambda: time.sleep(0.005),
          "a 5 ms spin": lambda: spin(0.005), "writing 64 MB": lambda: buffer.add_(1.0)}
times = {name: [] for name in before}
for _ in range(1800):
    name = random.choice(list(before))
    before[name]()
    t0 = time.perf_counter()
    target_pass(5)
    times[name].append(time.perf_counter() - t0)
print("1. the target's width-5 pass, median ms, after:")
for name, ts in times.items():
    print(f"   {name}: {1e3 * statistics.median(ts):.2f} (n = {len(ts)})")

spec = SpeculativeEngine(target, DraftModelProposer(drafter), speculation="fixed", max_num_seqs=4)
plain = SpeculativeEngine(target, None, max_num_seqs=4)
score, by_width = target.score_batch, {}


def timed_score(batch, **kwargs):
    t0 = time.perf_counter()
    out = score(batch, **kwargs)
    by_width.setdefault(len(batch[0][1]), []).append(time.perf_counter() - t0)
    return out


target.score_batch = timed_score
for i in range(24):
    for engine, k in ((spec, 4), (plain, 0)):
        engine.generate(prompts[i % 6], 64, SamplingParams(), k)
target.score_batch = score
print("2. in the engine, median ms: width-1 passes (plain) %.2f, width-5 passes (speculative) %.2f" % (
    1e3 * statistics.median(by_width[1]), 1e3 * statistics.median(by_width[5])))
from torch.profiler import ProfilerActivity, profile
for engine, k in ((plain, 0), (spec, 4)):
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        engine.generate(prompts[0], 64, SamplingParams(), k)
    rows = [e for e in prof.key_averages(group_by_input_shape=True) if e.key == "aten::mm" and e.count >= 20]
    rows.sort(key=lambda e: -e.self_cpu_time_total)
    print(f"   matrix products, k = {k} (shape: mean us per call, profiled):",
          ", ".join(f"{e.input_shapes[0]}x{e.input_shapes[1]}: {e.self_cpu_time_total / e.count:.0f}" for e in rows[:6]))
