"""Bench: the lean forward's pass time by dtype, batch and width, on one CPU thread, and whether
a position scores the same bits at every width (what lets a verify pass agree exactly with plain
decoding: the share of positions that differ). It is what `dtype: auto` on a CPU rests on (specserve.core.runner.resolve_dtype).

Rows, per model of the pair: float32 (the CPU GEMM plan, fast_llama.GemmPlan); bfloat16 with
F.linear (its weight reordered by oneDNN on every call); bfloat16 with prepacked weights
(fast_llama.packed_bf16, used where the CPU multiplies bf16 in hardware: AMX or AVX512-BF16) with SDPA, and with the
attention that path uses (`FastLlama._attend_same_bits`; the other rows use SDPA). Every (row, batch, width)
case is drawn at random before each pass, so drift of a shared machine hits all alike; medians.

    specserve bench dtype [--passes 3000] [--out docs/benchmarks/dtype]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from specserve.benchmarks.endpoint import out_prefix, write_results
from specserve.config import DEFAULT_MODEL_DIR, REPO_ROOT

BATCHES = (1, 2, 4, 8, 16, 32)
WIDTHS = (1, 5)


def _models(path: str):
    """The three rows' FastLlama over one checkpoint (None for the packed row without bf16 GEMM in hardware)."""
    from transformers import AutoModelForCausalLM

    from specserve.core.fast_llama import FastLlama
    from specserve.core.runner import compile_cache_dir
    store = str(Path(compile_cache_dir()) / "gemm_plan.json")
    rows = {}
    for row, dtype in (("float32", torch.float32), ("bfloat16, F.linear", torch.bfloat16),
                       ("bfloat16, packed, SDPA", torch.bfloat16), ("bfloat16, packed", torch.bfloat16)):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True).eval()
        fast = FastLlama(model, slots=max(BATCHES) + 1, plan_store=store)
        if row == "bfloat16, F.linear":  # F.linear and SDPA: what a bfloat16 model ran before packing
            fast.packed = fast.gemm = None
            fast.exact_attention = False
        elif row.startswith("bfloat16, packed") and fast.packed is None:
            continue
        elif row == "bfloat16, packed, SDPA":
            fast.exact_attention = False
        rows[row] = fast
    return rows


def differing_positions(fast, vocab: int, lengths=(70, 125, 128, 160, 200, 250)) -> float:
    """After prompts of these lengths (continuations crossing the attended length's 64-buckets),
    a 9-token continuation scored 1, 2, 5 (next to another sequence) and 9 at a time: the share
    of positions of the wider passes whose logits differ in any bit from the 1-wide pass's."""
    g = torch.Generator().manual_seed(0)
    differ = total = 0
    for n in lengths:
        prompt, cont = torch.randint(1, vocab, (n,), generator=g).tolist(), torch.randint(1, vocab, (9,), generator=g).tolist()
        outs = []
        for width in (1, 2, 5, 9):
            fast.cache.reset(0), fast.cache.reset(1)
            fast.forward([prompt], [0]), fast.forward([prompt[:50]], [1])
            outs.append(torch.cat([fast.forward([cont[i:i + width], prompt[50:51]], [0, 1])[0] if width == 5
                                   else fast.forward([cont[i:i + width]], [0])[0] for i in range(0, 9, width)]))
        fast.cache.reset(0), fast.cache.reset(1)
        for o in outs[1:]:
            differ += sum(not torch.equal(a, b) for a, b in zip(outs[0], o))
            total += len(o)
    return differ / total


@torch.inference_mode()
def bench(args) -> dict:
    from transformers.utils import logging as hf_logging

    from specserve.core.fast_llama import _cpu_model, cpu_has_bf16_gemm
    hf_logging.disable_progress_bar()
    torch.set_num_threads(1)
    report = {"models": args.models, "passes": args.passes, "threads": 1,
              "cpu_has_bf16_gemm": cpu_has_bf16_gemm(), "cpu": _cpu_model(), "models_ms": {}, "differing_positions": {}}
    for name in ("target", "drafter"):
        rows = _models(str(Path(args.models) / name))
        vocab = next(iter(rows.values())).cfg.vocab_size
        report["differing_positions"][name] = {row: differing_positions(fast, vocab) for row, fast in rows.items()}
        for fast in rows.values():  # every slot holds 99 tokens: a pass appends and is rolled back
            fast.forward([list(range(1, 100))] * max(BATCHES), list(range(max(BATCHES))))
        cases = [(row, b, w) for row in rows for b in BATCHES for w in WIDTHS]
        times = {c: [] for c in cases}
        for _ in range(args.passes):
            row, b, w = c = random.choice(cases)
            fast = rows[row]
            t0 = time.perf_counter()
            fast.forward([list(range(5, 5 + w))] * b, list(range(b)), last_only=(w == 1))
            times[c].append(time.perf_counter() - t0)
            for s in range(b):
                fast.cache.lengths[s] -= w
        report["models_ms"][name] = {row: {f"{b}x{w}": 1e3 * statistics.median(times[row, b, w])
                                           for b in BATCHES for w in WIDTHS} for row in rows}
    return report


def markdown(report: dict, command: str) -> str:
    lines = [f"Command: `{command}`", "",
             f"Models: `{report['models']}`, the lean forward (`FastLlama`), eager, {report['threads']} torch thread; "
             f"pass time in ms, median over {report['passes']} passes per model, the (row, batch, width) case drawn "
             "at random before each; a pass appends `width` tokens to each of `batch` slots holding 99 "
             f"(width 1: the last position's logits only). CPU: {report.get('cpu', 'not recorded')}; bfloat16 products in "
             f"hardware (AMX or AVX512-BF16, `fast_llama.cpu_has_bf16_gemm`): {report['cpu_has_bf16_gemm']}.", ""]
    for name, rows in report["models_ms"].items():
        lines += [f"**{name}**", "", "| batch | " + " | ".join(f"{row}: w1 / w5 (w5/w1)" for row in rows) + " |",
                  "|---|" + "---|" * len(rows)]
        for b in BATCHES:
            cells = [f"{r[f'{b}x1']:.2f} / {r[f'{b}x5']:.2f} ({r[f'{b}x5'] / r[f'{b}x1']:.2f})" for r in rows.values()]
            lines.append(f"| {b} | " + " | ".join(cells) + " |")
        base = rows["float32"]
        for row, r in rows.items():
            if row != "float32":
                ratio = [r[c] / base[c] for c in base]
                lines.append(f"\n{row} / float32, over all cases: {min(ratio):.2f}-{max(ratio):.2f}×")
        differ = report["differing_positions"][name]
        lines += ["", "Positions scored in a 2-, 5- (batched) or 9-wide pass whose logits differ in any bit from "
                  "the 1-wide pass's (6 prompts of 70-250 tokens, 9-token continuations): "
                  + ", ".join(f"{row} {share:.0%}" for row, share in differ.items()), ""]
    return "\n".join(lines)


def plot(report: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, (name, rows) in zip(axes, report["models_ms"].items()):
        for row, r in rows.items():
            for w, ls in zip(WIDTHS, ("-", "--")):
                ax.plot(BATCHES, [r[f"{b}x{w}"] for b in BATCHES], ls, marker="o", label=f"{row}, width {w}")
        ax.set(xscale="log", xticks=BATCHES, xticklabels=[str(b) for b in BATCHES], xlabel="batch (sequences)",
               ylabel="ms per pass", title=name)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="specserve bench dtype")
    p.add_argument("--models", default=str(DEFAULT_MODEL_DIR))
    p.add_argument("--passes", type=int, default=3000, help="timed passes per model, over all cases")
    p.add_argument("--out", type=out_prefix, default=str(REPO_ROOT / "docs" / "benchmarks" / "dtype"))
    args = p.parse_args(argv)
    report = bench(args)
    command = "specserve bench dtype " + " ".join(argv if argv is not None else sys.argv[1:])
    plot(report, args.out + ".png")
    write_results(args.out, report, markdown(report, command.strip()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
