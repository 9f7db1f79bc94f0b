"""Diagnostic (prints, writes no result file): does the demo target carry out the ngram bench's
"edit this function" tasks? For each of the bench's 6 edit prompts, its plain greedy output (96
new tokens, as the bench decodes them) against the edited function's text that follows the
prompt: how many characters it reproduces before they first differ, and difflib's similarity
ratio over the edited text's length. Prompt lookup can only draft what the output copies from the
prompt, so this bounds the n-gram row of the bench. Made stop 56's figures:

    .venv/bin/python benchmarks/diagnostics/edit_copy.py
"""
import difflib
from pathlib import Path

import torch

torch.set_num_threads(1)
from specserve.benchmarks.ngram import edit_tasks, run_row
from specserve.builder import build_engine
from specserve.config import REPO_ROOT, SpecServeConfig

m = Path(REPO_ROOT) / "models" / "demo"
engine = build_engine(SpecServeConfig(target=str(m / "target"), drafter=None, k=0, max_num_seqs=1, compile=False))
tokenizer = engine.target.tokenizer
tasks = edit_tasks(m, 6, tokenizer)
outputs = run_row(engine, [ids for ids, _ in tasks], 96, 0, "none")["outputs"]
for i, ((ids, want), out) in enumerate(zip(tasks, outputs)):
    got = tokenizer.decode(out)
    same = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    ratio = difflib.SequenceMatcher(None, got[:len(want)], want).ratio()
    print(f"task {i}: prompt {len(ids)} tokens; the output reproduces {same} of the edited text's {len(want)} "
          f"characters before it differs; similarity {ratio:.2f}")
    print(f"  edited text: {want[:100]!r}\n  output:      {got[:100]!r}")
