"""Diagnostic (prints, writes no result file): n-gram windows (min_n-max_n) of the n-gram
proposer on the ngram bench's prompt sets ("edit this function" and held-out completions), in
process, adaptive policy, k <= 4, 96 new tokens, rows interleaved, medians of 3 runs, against
plain decoding. Made the n-gram window figures of stop 24's closing note (2-4 best of 2-4, 3-4,
2-6, 3-8) and stop 59's (2-4 against 1-4 and 1-3):

Stop 59 (`--windows 2-4,1-4,1-3 --sets edit,complete`, the 2-core AVX2 EPYC, float32), tok/s over
plain decoding: edit prompts 2-4 1.19x, 1-4 1.26x, 1-3 1.28x; completions 2-4 1.42x, 1-4 1.28x,
1-3 1.22x. Matching one token drafts more often and less well (acceptance 0.31-0.36 against 0.42
on the edit prompts): it won there and lost on completions, so 2-4 stays.

    .venv/bin/python benchmarks/diagnostics/ngram_windows.py [--windows 2-4,3-4,2-6,3-8] [--sets edit]
"""
import argparse
import statistics
from pathlib import Path

import torch

from specserve.benchmarks.bench import heldout_prompts
from specserve.benchmarks.ngram import edit_prompts, run_row
from specserve.builder import build_engine
from specserve.config import SpecServeConfig
from specserve.verifier.ngram import NgramProposer

parser = argparse.ArgumentParser()
parser.add_argument("--windows", default="2-4,3-4,2-6,3-8", help="min_n-max_n, comma-separated; the first is the base")
parser.add_argument("--sets", default="edit", help="edit and/or complete, comma-separated")
parser.add_argument("--repeats", type=int, default=3)
args = parser.parse_args()
torch.set_num_threads(1)
m = Path("models/demo")
variants = {w: tuple(int(n) for n in w.split("-")) for w in args.windows.split(",")}
engines = {}
for name, (lo, hi) in variants.items():
    e = build_engine(SpecServeConfig(target=str(m/"target"), drafter=str(m/"drafter"), k=4, max_num_seqs=1,
                                     speculation="adaptive", compile=False))
    e.proposers["ngram"] = NgramProposer(e.target.vocab_size, min_n=lo, max_n=hi)
    engines[name] = e
plain = next(iter(engines.values()))
tokenizer = plain.target.tokenizer
sets = {"edit": lambda: edit_prompts(m, 6, tokenizer), "complete": lambda: heldout_prompts(m, 6, 64, tokenizer)}
for set_name in args.sets.split(","):
    prompts = sets[set_name]()
    R = {n: [] for n in ["plain", *variants]}
    for rep in range(args.repeats):
        R["plain"].append(run_row(plain, prompts, 96, 0, "none"))
        for n, e in engines.items():
            R[n].append(run_row(e, prompts, 96, 4, "ngram"))
    base = statistics.median(r["tokens_per_s"] for r in R["plain"])
    for n, runs in R.items():
        print(f"{set_name} {n}: {statistics.median(r['tokens_per_s'] for r in runs)/base:.3f}x plain "
              f"({statistics.median(r['tokens_per_s'] for r in runs):.1f} tok/s), "
              f"acceptance {statistics.median(r['acceptance_rate'] for r in runs):.2f}, "
              f"tokens/round {statistics.median(r['tokens_per_round'] for r in runs):.2f}, "
              f"mean k {statistics.median(r['mean_chosen_k'] for r in runs):.2f}, "
              f"same output {all(r['outputs']==R['plain'][0]['outputs'] for r in runs)}", flush=True)
