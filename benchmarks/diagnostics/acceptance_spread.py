"""Diagnostic (prints, writes no result file): how much sequences differ in acceptance, per
proposer and prompt set. Fixed k = 4, greedy, 64 new tokens, in process (the demo pair), one
request at a time; each request's accepted drafts and trials as the policy counts them (accepted
drafts plus the rejection of each round that had one: `Acceptance.total_*`), then the weight in
trials of a beta prior that fits their spread beyond chance (`policy.prior_trials`, the
estimate the policy's `SequenceSpread` makes from its last 64 finished sequences, here from all
of them and without its bounds: inf where they spread no more than chance gives).

Stop 67 (the 2-core AMD EPYC with AVX512-BF16; 96 requests for the first, 64 for the others):
draft model on held-out prompts: mean rate 0.868, rates 0.60-1.00, weight 22.8 trials; on edit
prompts 0.898, 0.70-1.00, 49.7; n-gram on edit prompts 0.682, 0.35-0.98, 5.5; on held-out prompts
0.753, 0.39-0.98, 8.8. The policy used 4 for all until then. (A first form of this script, with a
first estimator biased towards heavier weights and trials taken from the stats, gave 27.0, 60.7,
5.5 and 9.0.)

    .venv/bin/python benchmarks/diagnostics/acceptance_spread.py [--method draft_model|ngram] [--prompts heldout|edit] [-n 64]
"""
import argparse
from pathlib import Path

import torch

torch.set_num_threads(1)
from specserve.benchmarks.ngram import edit_prompts  # noqa: E402
from specserve.core.runner import ModelRunner, load_tokenizer  # noqa: E402
from specserve.drafter.draft_model import DraftModelProposer  # noqa: E402
from specserve.training.demo_pair import heldout_prompts  # noqa: E402
from specserve.verifier.engine import SpeculativeEngine  # noqa: E402
from specserve.verifier.policy import prior_trials  # noqa: E402


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
        req = engine.submit(prompt, 64, k=4, method=args.method)
        while not req.done.is_set():
            engine.step()
        if req.acceptance.total_trials:
            seen.append((req.acceptance.total_accepted, req.acceptance.total_trials))
    if len(seen) < 2:
        print(f"{len(seen)} request(s) drafted: too few to tell how sequences differ")
        return
    rates = [a / t for a, t in seen]
    print(f"{args.method} on {args.prompts} prompts: {len(seen)} requests, mean rate {sum(rates) / len(rates):.3f}, "
          f"mean trials {sum(t for _, t in seen) / len(seen):.1f}, rates {min(rates):.2f}-{max(rates):.2f}: "
          f"prior weight {prior_trials(seen):.1f} trials")


if __name__ == "__main__":
    main()
