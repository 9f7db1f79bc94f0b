"""Diagnostic (prints, writes no result file): acceptance of the demo drafter's drafts by the size
of its draft vocabulary (the shipped ranking, `models/demo/drafter/draft_vocab.json`), greedy and
sampled (T = 0.8, seeds 0..n-1), in process, k = 4, fixed. The sampled rows restrict q to the
vocabulary too, which the product does not do (a sampled pass scores every token: see
specserve.core.draft_vocab); they measure that alternative. Acceptance does not depend on the
machine's speed.

    .venv/bin/python benchmarks/diagnostics/draft_vocab_acceptance.py [prompts] [sizes]
"""
import sys
from pathlib import Path

import torch

from specserve.core import draft_vocab
from specserve.core.runner import ModelRunner
from specserve.core.sampling import SamplingParams
from specserve.drafter.draft_model import DraftModelProposer
from specserve.training.demo_pair import heldout_prompts
from specserve.verifier.engine import SpeculativeEngine

torch.set_num_threads(1)
m = Path("models/demo")
n_prompts = int(sys.argv[1]) if len(sys.argv) > 1 else 20
sizes = [int(s) for s in (sys.argv[2] if len(sys.argv) > 2 else "8192,4096,2048,1024,512,256").split(",")]
ranked = draft_vocab.read(str(m / "drafter"))["ranked_ids"]
target = ModelRunner.from_pretrained(str(m / "target"), name="target")
prompts = heldout_prompts(m, n_prompts, 64, target.tokenizer, seed=1)
DraftModelProposer._greedy = staticmethod(lambda seqs: True)  # sampled passes restricted too (see above)
for n in sizes:
    drafter = ModelRunner.from_pretrained(str(m / "drafter"), role="drafter", draft_vocab=n if n < 8192 else "off")
    engine = SpeculativeEngine(target, DraftModelProposer(drafter))
    line = [f"vocabulary {n:5d}:"]
    for name, params in (("greedy", lambda i: SamplingParams()),
                         ("T = 0.8", lambda i: SamplingParams(temperature=0.8, seed=i))):
        accepted = drafted = rounds = tokens = 0
        for i, p in enumerate(prompts):
            r = engine.generate(p, 64, params(i), 4)
            accepted, drafted = accepted + r.stats.num_accepted_tokens, drafted + r.stats.num_draft_tokens
            rounds, tokens = rounds + r.stats.num_rounds, tokens + len(r.token_ids)
        line.append(f"{name} acceptance {accepted / drafted:.3f}, tokens/round {tokens / rounds:.2f};")
    print(" ".join(line), flush=True)
