"""Diagnostic (prints, writes no result file): how much sequences differ in acceptance, per
proposer and prompt set. Fixed k = 4, greedy, 64 new tokens, in process (the demo pair), one
request at a time; each request's accepted drafts and trials (accepted drafts plus the rejection
of each round that had one, as the policy counts them), then the weight in trials of a beta prior
that fits their spread beyond chance (the policy's `SequenceSpread` on all of them, no clamp).

Stop 67 (the 2-core AMD EPYC with AVX512-BF16, 64 requests each; 96 for the first): draft model
on held-out prompts p = 0.855, rates 0.59-0.98, weight 27.0; draft model on edit prompts p = 0.888,
0.69-0.98, weight 60.7; n-gram on edit prompts p = 0.713, 0.35-0.98, weight 5.5; n-gram on
held-out prompts p = 0.768, 0.37-0.95, weight 9.0. The policy used 4 for all until then.

    .venv/bin/python benchmarks/diagnostics/acceptance_spread.py [--method draft_model|ngram] [--prompts heldout|edit] [-n 64]
"""
import argparse
import statistics
from pathlib import Path

import torch

torch.set_num_threads(1)
from specserve.benchmarks.ngram import edit_prompts  # noqa: E402
from specserve.core.runner import ModelRunner, load_tokenizer  # noqa: E402
from specserve.drafter.draft_model import DraftModelProposer  # noqa: E402
from specserve.training.demo_pair import heldout_prompts  # noqa: E402
from specserve.verifier.engine import SpeculativeEngine  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--method", choices=("draft_model", "ngram"), default="draft_model")
    ap.add_argument("--prompts", choices=("heldout", "edit"), default="heldout")
    ap.add_argument("-n", type=int, default=64)
    args = ap.parse_args()
    models = Path("models/demo")
    tokenizer = load_tokenizer(str(models / "target"))
    target = ModelRunner.from_pretrained(str(models / "target"), name="target", slots=2, role="target")
    drafter = ModelRunner.from_pretrained(str(models / "drafter"), name="drafter", slots=2, role="drafter")
    engine = SpeculativeEngine(target, DraftModelProposer(drafter), eos_ids=set(), speculation="fixed", ngram=True,
                               max_k=4, max_num_seqs=2)
    prompts = edit_prompts(models, args.n, tokenizer) if args.prompts == "edit" else \
        heldout_prompts(models, args.n, 64, tokenizer)
    seen = []  # (accepted, trials) per request
    for prompt in prompts:
        stats = engine.generate(prompt, 64, k=4, method=args.method).stats
        all_accepted = stats.num_accepted_tokens_per_pos[3] if len(stats.num_accepted_tokens_per_pos) > 3 else 0
        seen.append((stats.num_accepted_tokens, stats.num_accepted_tokens + stats.num_drafts - all_accepted))
    seen = [(a, t) for a, t in seen if t]
    p = sum(a for a, _ in seen) / sum(t for _, t in seen)
    rates = [a / t for a, t in seen]
    observed = statistics.pvariance(rates)
    chance = statistics.mean(p * (1 - p) / t for _, t in seen)
    beyond = observed - chance
    weight = p * (1 - p) / beyond - 1 if beyond > 0 else float("inf")
    print(f"{args.method} on {args.prompts} prompts: {len(seen)} requests, pooled rate {p:.3f}, mean trials "
          f"{statistics.mean(t for _, t in seen):.1f}, rates {min(rates):.2f}-{max(rates):.2f}; variance "
          f"{observed:.5f}, by chance {chance:.5f}, beyond {beyond:.5f}: prior weight {weight:.1f} trials")


if __name__ == "__main__":
    main()
