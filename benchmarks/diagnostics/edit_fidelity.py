"""Diagnostic (prints, writes no result file): does the target carry out the ngram bench's "edit
this function" tasks? For each task, the target's greedy output (96 new tokens, plain decoding)
against the edited function's text that should follow the prompt: how many characters agree
before the first difference. Prompt lookup can only draft what the output copies from the prompt,
so this bounds what the n-gram proposer gains there (issue 14's goal: 1.3x plain on these tasks).

Stop 59, the demo target, 12 tasks: 0-21 characters of each edited function (82-490) agree, 86
of 2603 (3.3%) in all: the 14M target continues the code its own way; it does not copy the
function with the rename, so the n-gram proposer has little to copy there.

    .venv/bin/python benchmarks/diagnostics/edit_fidelity.py [--tasks 12]
"""
import argparse
from pathlib import Path

import torch

from specserve.benchmarks.ngram import edit_tasks
from specserve.builder import build_engine
from specserve.config import SpecServeConfig
from specserve.core.sampling import SamplingParams

parser = argparse.ArgumentParser()
parser.add_argument("--tasks", type=int, default=12)
parser.add_argument("--models", default="models/demo")
args = parser.parse_args()
torch.set_num_threads(1)
models = Path(args.models)
engine = build_engine(SpecServeConfig(target=str(models / "target"), drafter=None, k=0, max_num_seqs=1,
                                      compile=False))
tokenizer = engine.target.tokenizer
agreed = []
for ids, expected in edit_tasks(models, args.tasks, tokenizer):
    text = tokenizer.decode(engine.generate(ids, 96, SamplingParams(), 0).token_ids)
    same = next((i for i, (a, b) in enumerate(zip(text, expected)) if a != b), min(len(text), len(expected)))
    agreed.append((same, len(expected)))
    print(f"prompt {len(ids)} tokens: the output agrees with the edited function for {same} of its "
          f"{len(expected)} characters", flush=True)
print(f"in all: {sum(a for a, _ in agreed)} of {sum(n for _, n in agreed)} characters "
      f"({sum(a for a, _ in agreed) / max(1, sum(n for _, n in agreed)):.1%}) before the first difference")
