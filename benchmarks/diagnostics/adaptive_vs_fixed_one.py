"""Diagnostic (prints, writes no result file): at one sequence, in process (the drafter colocated,
the demo pair under `dtype: auto`), the adaptive policy (k <= 4) against fixed k = 4 and plain
decoding: 10 held-out prompts x 64 greedy tokens per row and repeat, rows interleaved (order
flipped every repeat), the first repeat dropped; medians of tokens/s and each row over plain; then
the adaptive engine's rounds by k and what its policy believes.

    .venv/bin/python benchmarks/diagnostics/adaptive_vs_fixed_one.py [repeats]
"""
import json
import sys
from pathlib import Path

import torch

torch.set_num_threads(1)
from specserve.core.runner import ModelRunner, load_tokenizer  # noqa: E402
from specserve.drafter.draft_model import DraftModelProposer  # noqa: E402
from specserve.training.demo_pair import heldout_prompts  # noqa: E402
from specserve.verifier.engine import SpeculativeEngine  # noqa: E402
from _shared import interleaved_tok_s  # noqa: E402


def engine(speculation: str) -> SpeculativeEngine:
    target = ModelRunner.from_pretrained("models/demo/target", name="target", slots=4, role="target")
    drafter = ModelRunner.from_pretrained("models/demo/drafter", name="drafter", slots=4, role="drafter")
    return SpeculativeEngine(target, DraftModelProposer(drafter), eos_ids=set(), speculation=speculation,
                             max_k=4, max_num_seqs=4)


def main() -> None:
    repeats = int(next((a for a in sys.argv[1:] if a.isdigit()), 7))
    fixed, adaptive = engine("fixed"), engine("adaptive")
    prompts = heldout_prompts(Path("models/demo"), 10, 64, load_tokenizer("models/demo/target"))
    med = interleaved_tok_s({"plain": (fixed, 0), "fixed k=4": (fixed, 4), "adaptive": (adaptive, 4)},
                            prompts, repeats)
    print("tok/s", {m: round(v, 1) for m, v in med.items()})
    print("over plain", {m: round(v / med["plain"], 3) for m, v in med.items()})
    st = adaptive.policy.state()
    print(json.dumps({k: st[k] for k in ("engine_acceptance", "position_acceptance", "target_pass_ms",
                                         "draft_ms_for_k_1_and_4", "guard", "calibration", "round_overhead_ms",
                                         "probes")})[:3000])
    print("recent", st["recent_choices_b_k_rate0_ratebest_probe"])


if __name__ == "__main__":
    main()
