"""`specserve bench forward`: the lean forward's pass time on the demo pair, float32, with the CPU
GEMM plan (`fast_llama.GemmPlan`, the default on a CPU), with the plan choosing among MKL's layouts
only (no oneDNN "packed" products: the plan before stop 35) and without it (every product as
F.linear), at each thread count, for the shapes serving uses: (batch, new tokens) = (1, 1) decode, (1, 5) a k = 4
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

from specserve.benchmarks.endpoint import out_prefix, write_results
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
    p.add_argument("--out", type=out_prefix, default=str(REPO_ROOT / "docs" / "benchmarks" / "forward"))
    args = p.parse_args(argv)
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from specserve.core.fast_llama import FastLlama, GemmPlan, _cpu_model
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
            mkl = FastLlama(model, slots=10)
            mkl.gemm = GemmPlan(mkl._weights(), layouts=tuple(h for h in GemmPlan.LAYOUTS if h != "packed"))
            for b, t in SHAPES:
                row = {"model": name, "threads": threads, "batch": b, "tokens": t}
                for _ in range(2):  # the three alternate, twice over: a slow spell hits them alike
                    for key, fast in (("linear_ms", plain), ("mkl_plan_ms", mkl), ("plan_ms", planned)):
                        row.setdefault(key, []).append(pass_ms(fast, b, t, args.repeats))
                row.update({key: min(row[key]) for key in ("linear_ms", "mkl_plan_ms", "plan_ms")})
                row["speedup"] = row["linear_ms"] / row["plan_ms"]
                row["packed_speedup"] = row["mkl_plan_ms"] / row["plan_ms"]
                rows.append(row)
                print(f"  {name} {threads}t b{b} t{t}: F.linear {row['linear_ms']:.2f} ms, MKL plan "
                      f"{row['mkl_plan_ms']:.2f} ms, plan {row['plan_ms']:.2f} ms", file=sys.stderr, flush=True)
    lines = [f"Command: `{command}`", "",
             f"Demo pair, float32, CPU ({_cpu_model()}), torch {torch.__version__}; median ms per pass over "
             f"{args.repeats} passes at a context of 100 tokens, the lower of two medians taken alternately; "
             "all rows in one run. MKL plan: the plan among F.linear, a transposed copy and (w @ x.T).T; "
             "GEMM plan: the same and oneDNN's product over a packed copy.", "",
             "| model | threads | batch × new tokens | F.linear everywhere (ms) | MKL plan (ms) | GEMM plan (ms) "
             "| plan / F.linear speedup | plan / MKL plan speedup |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['threads']} | {r['batch']} × {r['tokens']} | {r['linear_ms']:.2f} | "
                     f"{r['mkl_plan_ms']:.2f} | {r['plan_ms']:.2f} | {r['speedup']:.2f}× | {r['packed_speedup']:.2f}× |")
    write_results(args.out, {"command": command, "torch": torch.__version__, "rows": rows}, "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
