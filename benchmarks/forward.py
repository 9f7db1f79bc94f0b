"""`specserve bench forward`: the lean forward's pass time on the demo pair, with the CPU GEMM plan
(`fast_llama.GemmPlan`, the default on a CPU) and without it (every product as F.linear), at each
thread count, for the shapes serving uses: (batch, new tokens) = (1, 1) decode, (1, 5) a k = 4
verify, (10, 1) and (10, 5). Medians of --repeats passes at a context of 100 tokens.

    specserve bench forward --threads 1,2

Writes OUT.md and OUT.json (default docs/benchmarks/forward).
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

from specserve.benchmarks.endpoint import write_results
from specserve.config import DEFAULT_MODEL_DIR, REPO_ROOT

SHAPES = ((1, 1), (1, 5), (10, 1), (10, 5))


def pass_ms(fast, b: int, t: int, repeats: int, context: int = 100) -> float:
    slots = list(range(b))
    for s in slots:
        fast.cache.reset(s)
    fast.forward([[5] * context] * b, slots)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fast.forward([[7] * t] * b, slots, last_only=t == 1)
        times.append(time.perf_counter() - t0)
        for s in slots:
            fast.cache.rollback(t, s)
    return statistics.median(times) * 1e3


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="specserve bench forward", description=__doc__.splitlines()[0])
    p.add_argument("--models", default=str(DEFAULT_MODEL_DIR))
    p.add_argument("--threads", default="1,2")
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--out", default=str(REPO_ROOT / "docs" / "benchmarks" / "forward"))
    args = p.parse_args(argv)
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from specserve.core.fast_llama import FastLlama
    hf_logging.disable_progress_bar()
    command = "specserve bench forward " + shlex.join(list(sys.argv[1:] if argv is None else argv))
    rows = []
    for name in ("target", "drafter"):
        model = AutoModelForCausalLM.from_pretrained(str(Path(args.models) / name), dtype=torch.float32).eval()
        for threads in (int(t) for t in args.threads.split(",")):
            torch.set_num_threads(threads)
            planned = FastLlama(model, slots=10)
            plain = FastLlama(model, slots=10)
            plain.gemm = None  # every product as F.linear
            for b, t in SHAPES:
                row = {"model": name, "threads": threads, "batch": b, "tokens": t,
                       "linear_ms": pass_ms(plain, b, t, args.repeats),
                       "plan_ms": pass_ms(planned, b, t, args.repeats)}
                row["speedup"] = row["linear_ms"] / row["plan_ms"]
                rows.append(row)
                print(f"  {name} {threads}t b{b} t{t}: F.linear {row['linear_ms']:.2f} ms, "
                      f"plan {row['plan_ms']:.2f} ms", file=sys.stderr, flush=True)
    lines = [f"Command: `{command}`", "",
             f"Demo pair, float32, CPU, torch {torch.__version__}; median ms per pass over {args.repeats} passes "
             "at a context of 100 tokens, all rows in one run.", "",
             "| model | threads | batch × new tokens | F.linear everywhere (ms) | GEMM plan (ms) | speedup |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['threads']} | {r['batch']} × {r['tokens']} | {r['linear_ms']:.2f} | "
                     f"{r['plan_ms']:.2f} | {r['speedup']:.2f}× |")
    write_results(args.out, {"command": command, "torch": torch.__version__, "rows": rows}, "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
