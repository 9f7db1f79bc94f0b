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
import sys
from pathlib import Path

import torch

torch.set_num_threads(1)
from specserve.core.runner import ModelRunner, load_tokenizer  # noqa: E402
from specserve.core.sampling import SamplingParams  # noqa: E402
from specserve.drafter.draft_model import DraftModelProposer  # noqa: E402
from specserve.training.demo_pair import heldout_prompts  # noqa: E402
from specserve.verifier.engine import SpeculativeEngine  # noqa: E402
from _shared import hot_gemm_plan, interleaved_tok_s  # noqa: E402


def main() -> None:
    repeats = int(next((a for a in sys.argv[1:] if a.isdigit()), 7))
    pairs = {}
    for how in ("evicted", "hot"):
        target = ModelRunner.from_pretrained("models/demo/target", name="target", slots=4, role="target")
        drafter = ModelRunner.from_pretrained("models/demo/drafter", name="drafter", slots=4, role="drafter")
        if how == "hot":
            for r in (target, drafter):
                if r.fast.gemm is not None:
                    r.fast.gemm, r.fast._gemm_tables = hot_gemm_plan(r.fast), {}
        for name, r in (("target", target), ("drafter", drafter)):
            if r.fast.gemm is not None:
                print(f"{how} plan, {name}, one row:",
                      {s: layout for (s, rows), layout in r.fast.gemm.plan.items() if rows == 1})
        pairs[how] = SpeculativeEngine(target, DraftModelProposer(drafter), eos_ids=set(), speculation="fixed", max_k=4)
    prompts = heldout_prompts(Path("models/demo"), 10, 64, load_tokenizer("models/demo/target"))
    med = interleaved_tok_s({"plain": (pairs["evicted"], 0), "evicted": (pairs["evicted"], 4),
                             "hot": (pairs["hot"], 4)}, prompts, repeats)
    print("tok/s", {m: round(v, 1) for m, v in med.items()})
    print("over plain", {m: round(v / med["plain"], 3) for m, v in med.items()})
    plain = [pairs["evicted"].generate(p, 64, SamplingParams(), k=0).token_ids for p in prompts]
    for m in ("evicted", "hot"):
        outs = [pairs[m].generate(p, 64, SamplingParams(), k=4).token_ids for p in prompts]
        print(f"{m}: greedy == plain {outs == plain}")


if __name__ == "__main__":
    main()
