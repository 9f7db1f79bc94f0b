"""Diagnostic (prints, writes no result file): the power of the sampled exactness checks against
bugs in later rounds only. It runs the setup of tests/test_adaptive.py's
test_sampled_tokens_follow_the_target_with_k_changing_between_rounds[draft_model] (a noisy copy
of a tiny target as drafter, the target's passes 4 ms slower, the adaptive policy, 1500 requests)
with SpeculativeEngine._accept mutated, and prints each check's p-value (the test asserts all
above 1e-4), the share of rounds that drafted, and, over all runs, the p-values of the pooled
counts.

Mutations (the verifier takes q as uniform over the vocabulary instead of what the drafts were
drawn from, in):
- none: no round (the code as it is);
- late: rounds that start at token 3 or later (tokens 1-2 cannot see it);
- kchange: rounds whose k differs from the sequence's last drafted round.

    .venv/bin/python benchmarks/diagnostics/sampled_mutations.py {none,late,kchange} [runs] [tokens]

Stop 39's figures (in the test's docstring) came from this script's scratch original: tokens = 6,
late failed 3 of 3 runs at p <= 3e-7 with tokens 1-2 at p = 0.22-0.31; kchange failed 1 of 2;
none drafted in 51-84% of rounds over nine runs, pooled p = 0.36-0.94. This script, `late 1` at
68dfaf5: tokens 1-2 p = 0.80, every later check p <= 4e-9 (drafted in 87% of rounds).
"""
import pathlib
import sys

import numpy as np
import torch

torch.set_num_threads(1)
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "tests"))
from conftest import SIX_TOKEN_CHECKS, chi_square, near, sequence_probs  # noqa: E402
from test_adaptive import SlowSpell  # noqa: E402

from specserve.core.runner import ModelRunner  # noqa: E402
from specserve.core.sampling import SamplingParams  # noqa: E402
from specserve.drafter.draft_model import DraftModelProposer  # noqa: E402
from specserve.training.tiny import tiny_model  # noqa: E402
from specserve.verifier import engine as eng  # noqa: E402

mode = sys.argv[1]
runs = int(sys.argv[2]) if len(sys.argv) > 2 else 1
length = int(sys.argv[3]) if len(sys.argv) > 3 else 6
keeps = [k for k in SIX_TOKEN_CHECKS if max(k) < length] + ([(0, 1), (2, 3)] if length < 6 else [])
original = eng.SpeculativeEngine._accept


def mutated(running, drafts, logits):
    out = []
    for r, d in zip(running, drafts):
        hit = (mode == "late" and len(r.out) >= 2) or \
              (mode == "kchange" and r.previous_accepted is not None and len(d.tokens) != r.previous_k)
        out.append(eng.Draft(d.tokens, torch.full_like(d.probs, 1.0 / d.probs.shape[-1]))
                   if hit and d.tokens and d.probs is not None else d)
    return original(running, out, logits)


def p_values(counts, want):
    out = {}
    for keep in dict.fromkeys(keeps):
        axes = tuple(a for a in range(length) if a not in keep)
        out[keep] = float(f"{chi_square(counts.sum(axis=axes), want.sum(axis=axes)):.3g}")
    return out


if mode != "none":
    eng.SpeculativeEngine._accept = staticmethod(mutated)
v, params, prompt = 6, SamplingParams(temperature=1.2), [1, 2, 3, 1, 2]
target = tiny_model("llama", v, seed=21, initializer_range=0.5)
want = sequence_probs(target, prompt, params, length)
total = np.zeros((v,) * length)
for run in range(runs):
    engine = eng.SpeculativeEngine(SlowSpell(target, spell=range(10 ** 9), delay=0.004),
                                   DraftModelProposer(ModelRunner(near(target, 0.3, seed=22))), eos_ids=set(),
                                   ngram=True, speculation="adaptive", max_k=3)
    engine.policy.min_confidence = 0.4
    counts, rounds_by_k = np.zeros((v,) * length), np.zeros(4)
    for _ in range(1500):
        r = engine.generate(prompt, length, params, k=3, method="draft_model")
        counts[tuple(r.token_ids)] += 1
        rounds_by_k[:len(r.stats.rounds_by_k)] += r.stats.rounds_by_k
    total += counts
    print(f"{mode} run {run}: p {p_values(counts, want)}, drafted in {rounds_by_k[1:].sum() / rounds_by_k.sum():.2f} "
          f"of rounds, rounds_by_k {rounds_by_k.astype(int).tolist()}", flush=True)
print(f"pooled over {int(total.sum())} requests: p {p_values(total, want)}")
