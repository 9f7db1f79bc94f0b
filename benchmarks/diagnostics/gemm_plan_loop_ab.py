"""Diagnostic (prints, writes no result file): in-process speculation at one sequence (k = 4
fixed, the demo pair under `dtype: auto`) with the drafter's GemmPlan measured two ways, and plain
decoding: "evicted" (each layout timed with the weights evicted from L1/L2, GemmPlan.EVICT_BYTES,
since stop 36) and "hot" (the same products back to back, as before). Only float32 weights are
planned: under auto on a CPU with bf16 GEMM that is the drafter's layers; elsewhere the target's
too, and both models get each plan. 10 held-out prompts x 64 greedy tokens per row and repeat,
rows interleaved (order flipped every repeat), the first repeat dropped; medians of tokens/s and
each row over plain, then greedy == plain for each row.

    .venv/bin/python benchmarks/diagnostics/gemm_plan_loop_ab.py [repeats]
"""
import statistics
import sys
import time
from pathlib import Path

import torch

torch.set_num_threads(1)
from specserve.core import fast_llama  # noqa: E402
from specserve.core.runner import ModelRunner, load_tokenizer  # noqa: E402
from specserve.core.sampling import SamplingParams  # noqa: E402
from specserve.drafter.draft_model import DraftModelProposer  # noqa: E402
from specserve.training.demo_pair import heldout_prompts  # noqa: E402
from specserve.verifier.engine import SpeculativeEngine  # noqa: E402


def hot_plan(runner: ModelRunner) -> None:
    """Gives the runner's lean forward a plan measured hot (and a key of its own)."""
    f = runner.fast
    if f.gemm is None:
        return
    saved = fast_llama.GemmPlan.EVICT_BYTES, fast_llama.GemmPlan.VERSION
    fast_llama.GemmPlan.EVICT_BYTES, fast_llama.GemmPlan.VERSION = 4, -1
    try:
        f.gemm, f._gemm_tables = fast_llama.GemmPlan(f._weights(), None), {}
    finally:
        fast_llama.GemmPlan.EVICT_BYTES, fast_llama.GemmPlan.VERSION = saved


def main() -> None:
    repeats = int(next((a for a in sys.argv[1:] if a.isdigit()), 7))
    pairs = {}
    for how in ("evicted", "hot"):
        target = ModelRunner.from_pretrained("models/demo/target", name="target", slots=4, role="target")
        drafter = ModelRunner.from_pretrained("models/demo/drafter", name="drafter", slots=4, role="drafter")
        if how == "hot":
            hot_plan(target), hot_plan(drafter)
        for name, r in (("target", target), ("drafter", drafter)):
            if r.fast.gemm is not None:
                print(f"{how} plan, {name}, one row:",
                      {s: layout for (s, rows), layout in r.fast.gemm.plan.items() if rows == 1})
        pairs[how] = SpeculativeEngine(target, DraftModelProposer(drafter), eos_ids=set(), speculation="fixed", max_k=4)
    prompts = heldout_prompts(Path("models/demo"), 10, 64, load_tokenizer("models/demo/target"))
    rows = ["plain", "evicted", "hot"]
    res = {m: [] for m in rows}
    for rep in range(repeats):
        for m in (rows if rep % 2 else rows[::-1]):
            engine, k = (pairs["evicted"], 0) if m == "plain" else (pairs[m], 4)
            n, t0 = 0, time.perf_counter()
            for p in prompts:
                n += len(engine.generate(p, 64, SamplingParams(), k=k).token_ids)
            if rep:
                res[m].append(n / (time.perf_counter() - t0))
    med = {m: statistics.median(v) for m, v in res.items()}
    print("tok/s", {m: round(v, 1) for m, v in med.items()})
    print("over plain", {m: round(v / med["plain"], 3) for m, v in med.items()})
    plain = [pairs["evicted"].generate(p, 64, SamplingParams(), k=0).token_ids for p in prompts]
    for m in ("evicted", "hot"):
        outs = [pairs[m].generate(p, 64, SamplingParams(), k=4).token_ids for p in prompts]
        print(f"{m}: greedy == plain {outs == plain}")


if __name__ == "__main__":
    main()
