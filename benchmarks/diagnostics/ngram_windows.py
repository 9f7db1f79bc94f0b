"""Diagnostic (prints, writes no result file): n-gram windows (min_n-max_n) of the n-gram
proposer on the ngram bench's "edit this function" prompts, in process, adaptive policy, k <= 4,
96 new tokens, rows interleaved, medians of 3 runs, against plain decoding. Made the n-gram
window figures of this stop's closing note (2-4, the default, was best):

    .venv/bin/python benchmarks/diagnostics/ngram_windows.py
"""
import statistics, torch
from pathlib import Path
torch.set_num_threads(1)
from specserve.builder import build_engine
from specserve.config import SpecServeConfig
from specserve.benchmarks.ngram import edit_prompts, run_row
from specserve.verifier.ngram import NgramProposer
m = Path("models/demo")
variants = {"2-4 (now)": (2, 4), "3-4": (3, 4), "2-6": (2, 6), "3-8": (3, 8)}
engines = {}
for name, (lo, hi) in variants.items():
    e = build_engine(SpecServeConfig(target=str(m/"target"), drafter=str(m/"drafter"), k=4, max_num_seqs=1, speculation="adaptive", compile=False))
    e.proposers["ngram"] = NgramProposer(e.target.vocab_size, min_n=lo, max_n=hi)
    engines[name] = e
plain = engines["2-4 (now)"]
prompts = edit_prompts(m, 6, plain.target.tokenizer)
R = {n: [] for n in ["plain", *variants]}
for rep in range(3):
    R["plain"].append(run_row(plain, prompts, 96, 0, "none"))
    for n, e in engines.items():
        R[n].append(run_row(e, prompts, 96, 4, "ngram"))
base = statistics.median(r["tokens_per_s"] for r in R["plain"])
for n, runs in R.items():
    print(f"{n}: {statistics.median(r['tokens_per_s'] for r in runs)/base:.3f}x plain, acceptance {statistics.median(r['acceptance_rate'] for r in runs):.2f}, tokens/round {statistics.median(r['tokens_per_round'] for r in runs):.2f}, mean k {statistics.median(r['mean_chosen_k'] for r in runs):.2f}, same output {all(r['outputs']==R['plain'][0]['outputs'] for r in runs)}")
