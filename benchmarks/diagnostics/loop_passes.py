"""Diagnostic (prints, writes no result file): where an in-process speculative round at one
sequence goes, demo pair under `dtype: auto`, k = 4 fixed, greedy, one torch thread: 10 held-out
prompts x 64 tokens after 3 warm-up prompts; per round, the proposer's call (and within it the
drafter's passes: count and median), and the target's passes. A drafter pass beside the
target's ones is slower than alone (benchmarks/diagnostics/drafter_pass.py): stop 34's run had
2.095 and 1.955 ms in the loop (two runs) against 1.214 alone:

    .venv/bin/python benchmarks/diagnostics/loop_passes.py
"""
import statistics
import time
from pathlib import Path

import torch
torch.set_num_threads(1)
from specserve.core.runner import ModelRunner, load_tokenizer
from specserve.core.sampling import SamplingParams
from specserve.drafter.draft_model import DraftModelProposer
from specserve.training.demo_pair import heldout_prompts
from specserve.verifier.engine import SpeculativeEngine


def timed(times: list, fn):
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        times.append(time.perf_counter() - t0)
        return out
    return wrapper


def main() -> None:
    target = ModelRunner.from_pretrained("models/demo/target", name="target", slots=4, role="target")
    drafter = ModelRunner.from_pretrained("models/demo/drafter", name="drafter", slots=4, role="drafter")
    proposer = DraftModelProposer(drafter)
    engine = SpeculativeEngine(target, proposer, eos_ids=set(), speculation="fixed", max_k=4)
    prompts = heldout_prompts(Path("models/demo"), 10, 64, load_tokenizer("models/demo/target"))
    times = {"propose": [], "drafter": [], "target": []}
    proposer.propose = timed(times["propose"], proposer.propose)
    drafter.fast.forward_ids = timed(times["drafter"], drafter.fast.forward_ids)
    target.fast.forward_ids = timed(times["target"], target.fast.forward_ids)
    for p in prompts[:3]:
        engine.generate(p, 64, SamplingParams(), k=4)
    for t in times.values():
        t.clear()
    n, t0 = 0, time.perf_counter()
    for p in prompts:
        n += len(engine.generate(p, 64, SamplingParams(), k=4).token_ids)
    wall = time.perf_counter() - t0
    rounds = len(times["propose"])
    per = {name: 1e3 * sum(t) / rounds for name, t in times.items()}
    print(f"{n / wall:.1f} tok/s, {rounds} rounds, {n / rounds:.2f} tokens a round; ms a round: wall "
          f"{1e3 * wall / rounds:.2f}, proposer {per['propose']:.2f} (drafter passes {per['drafter']:.2f}: "
          f"{len(times['drafter']) / rounds:.2f} a round, median {1e3 * statistics.median(times['drafter']):.3f}), "
          f"target passes {per['target']:.2f} (median {1e3 * statistics.median(times['target']):.3f})")


if __name__ == "__main__":
    main()
