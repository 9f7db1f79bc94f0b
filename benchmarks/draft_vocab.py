"""`specserve bench draft-vocab`: the drafter's draft vocabulary (specserve.core.draft_vocab) against
its whole head, batch 1, k = 4, greedy, on held-out prompts, one torch thread per model:

1. the head's product alone (the drafter's normed hidden states times its head rows), by
   vocabulary size, one row (median microseconds);
2. one drafter pass (a token fed, logits out) by vocabulary size, at 1 and 4 sequences, each
   right after a target pass as in a round (median CPU ms of the pass; sizes drawn at random
   pass by pass, so the machine's drift hits every size alike);
3. end to end, the rows' runs interleaved (`bench.run_rows`): plain decoding; in-process
   speculation; the pair over Ray + gRPC, sequential and pipelined; each speculative row with the
   whole head ("off") and with the draft vocabulary ("vocab"), whose output must equal plain
   decoding's (checked).

Writes OUT.md, OUT.json and OUT.png.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from specserve.benchmarks.bench import (RESULTS_DIR, add_dtype_arg, check_draft_k, dtypes_line, init_ray, resolved_dtypes,
                                        round_probe, run_rows)
from specserve.benchmarks.endpoint import out_prefix
from specserve.config import DEFAULT_MODEL_DIR


def head_products(drafter_path: str, sizes: list[int], dtype: str, reps: int = 300) -> dict:
    """Median microseconds of the head's product for one row, by vocabulary size (0: every token)."""
    from specserve.core.runner import ModelRunner
    out = {}
    for n in sizes:
        runner = ModelRunner.from_pretrained(drafter_path, role="drafter", dtype=dtype,
                                             draft_vocab=n if n else "off")
        fast = runner.fast
        x = torch.randn(1, 1, fast.lm_head.shape[1], dtype=fast.lm_head.dtype, device=fast.device)
        with torch.inference_mode():
            for _ in range(50):
                fast.head(x, vocab=bool(n))
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                fast.head(x, vocab=bool(n))
                times.append(time.perf_counter() - t0)
        out[n] = statistics.median(times) * 1e6
    return out


def drafter_passes(target_path: str, drafter_path: str, sizes: list[int], dtype: str, reps: int = 400) -> dict:
    """Median CPU ms of one drafter pass after a target pass, by (sequences, vocabulary size)."""
    from specserve.core.runner import ModelRunner
    target = ModelRunner.from_pretrained(target_path, dtype=dtype)
    target.prefill_batch([(0, list(range(1, 97)))])
    wide = torch.tensor([[5] * 5])
    runners = {}
    for n in sizes:
        r = ModelRunner.from_pretrained(drafter_path, role="drafter", dtype=dtype, slots=4,
                                        draft_vocab=n if n else "off")
        r.prefill_batch([(s, list(range(1, 97))) for s in range(4)])
        runners[n] = r
    times: dict[tuple[int, int], list[float]] = {}
    rng = random.Random(0)
    for b in (1, 4):
        ids = torch.tensor([[5]] * b)
        for _ in range(reps):
            n = rng.choice(sizes)
            target.score_ids(wide, [0])
            target.rollback(5)
            c0 = time.thread_time()
            runners[n].score_ids(ids, list(range(b)), vocab=bool(n))
            times.setdefault((b, n), []).append(time.thread_time() - c0)
            for s in range(b):
                runners[n].rollback(1, slot=s)
    return {f"{b}x{n}": statistics.median(v) * 1e3 for (b, n), v in sorted(times.items())}


def bench(args) -> dict:
    import ray

    from specserve.cluster.pair import SpeculativePair
    from specserve.core import draft_vocab
    from specserve.core.runner import ModelRunner
    from specserve.core.sampling import SamplingParams
    from specserve.drafter.draft_model import DraftModelProposer
    from specserve.training.demo_pair import heldout_prompts
    from specserve.verifier.engine import SpeculativeEngine

    torch.set_num_threads(1)
    model_dir = Path(args.models)
    target_path, drafter_path = str(model_dir / "target"), str(model_dir / "drafter")
    data = draft_vocab.read(drafter_path)
    if data is None:
        raise SystemExit(f"specserve bench draft-vocab: {drafter_path} has no {draft_vocab.FILE}")
    size = args.size or data["size"]
    sizes = [0] + [int(s) for s in args.sizes.split(",")]
    heads = head_products(drafter_path, sizes, args.dtype)
    passes = drafter_passes(target_path, drafter_path, sizes, args.dtype)

    target = ModelRunner.from_pretrained(target_path, name="target", dtype=args.dtype)
    prompts = heldout_prompts(model_dir, args.prompts, args.prompt_tokens, target.tokenizer)
    plain = SpeculativeEngine(target, None)
    engines = {v: SpeculativeEngine(target, DraftModelProposer(ModelRunner.from_pretrained(
        drafter_path, name="drafter", role="drafter", dtype=args.dtype, draft_vocab=size if v == "vocab" else "off")))
        for v in ("off", "vocab")}

    def distributed(pipeline, vocab):
        def factory():
            pair = SpeculativePair(target_path, drafter_path, pipeline=pipeline, cpus_per_actor=1, speculation="fixed",
                                   dtype=args.dtype, draft_vocab=size if vocab == "vocab" else "off", k=args.k)
            return pair.generate, pair.shutdown, round_probe(lambda: ray.get(pair.verifier.times.remote()),
                                                             lambda: ray.get(pair.drafter.actor.times.remote()))
        return factory

    rows = {"plain": lambda: (plain.generate, lambda: None)}
    for v in ("off", "vocab"):
        rows[f"in process, {v}"] = lambda v=v: (engines[v].generate, lambda: None, round_probe(engines[v].times.to_dict))
    for mode, pipeline in (("sequential", False), ("pipelined", "all-accepted")):
        for v in ("off", "vocab"):
            rows[f"distributed {mode}, {v}"] = distributed(pipeline, v)
    init_ray(2 * (len(rows) - 3))
    results = run_rows(rows, prompts, args.max_tokens, args.k, args.repeats)
    want = [plain.generate(p, args.max_tokens, SamplingParams(), 0).token_ids for p in prompts]
    for v, engine in engines.items():  # greedy output: plain decoding's, with the whole head or the vocabulary
        got = [engine.generate(p, args.max_tokens, SamplingParams(), args.k).token_ids for p in prompts]
        results[f"in process, {v}"]["equal_to_plain"] = sum(a == b for a, b in zip(got, want))
    ratios = {f"{name.rsplit(',', 1)[0]}: vocab / off": results[name]["tokens_per_s"]
              / results[name.replace(", vocab", ", off")]["tokens_per_s"]
              for name in results if name.endswith(", vocab")}
    return dict(models=str(model_dir), k=args.k, prompts=len(prompts), prompt_tokens=args.prompt_tokens,
                max_tokens=args.max_tokens, repeats=args.repeats, dtype=args.dtype, dtypes=resolved_dtypes(args.dtype),
                size=size, vocab_size=target.vocab_size, source=data.get("source"), head_us=heads,
                drafter_pass_cpu_ms=passes, rows=results, ratios=ratios)


def markdown(report: dict, command: str) -> str:
    size, vocab = report["size"], report["vocab_size"]
    lines = [f"Command: `{command}`", "",
             f"Models: `{report['models']}`, {dtypes_line(report)}The draft vocabulary: the {size} most frequent "
             f"of the drafter's {vocab} tokens ({report['source']}). k = {report['k']} (fixed), "
             f"{report['prompts']} held-out prompts of {report['prompt_tokens']} tokens, {report['max_tokens']} new "
             f"tokens each, greedy, one torch thread per model.", "",
             "The head's product alone, one row (median µs), and one drafter pass right after a target pass "
             "(median CPU ms), by vocabulary size:", "",
             "| vocabulary | head µs | pass ms, 1 sequence | pass ms, 4 sequences |", "|---|---|---|---|"]
    for n, us in report["head_us"].items():
        n = int(n)
        lines.append(f"| {n or f'all {vocab}'} | {us:.1f} | {report['drafter_pass_cpu_ms'][f'1x{n}']:.3f} | "
                     f"{report['drafter_pass_cpu_ms'][f'4x{n}']:.3f} |")
    lines += ["", f"End to end, batch 1, medians of {report['repeats']} runs, the rows' runs interleaved "
              f"(`off`: the whole head; `vocab`: the draft vocabulary of {size}):", "",
              "| row | tokens/s | × plain | mean acceptance length | pipeline hit rate | runs |", "|---|---|---|---|---|---|"]
    for row, r in report["rows"].items():
        lines.append(f"| {row} | {r['tokens_per_s']:.1f} | {r['speedup']:.2f} | {r['mean_acceptance_length']:.2f} | "
                     f"{r['pipeline_hit_rate']:.2f} | {', '.join(f'{x:.0f}' for x in r['runs_tokens_per_s'])} |")
    lines += ["", "| ratio | value |", "|---|---|"]
    lines += [f"| {k} | {v:.2f}× |" for k, v in report["ratios"].items()]
    eq = {row: r["equal_to_plain"] for row, r in report["rows"].items() if "equal_to_plain" in r}
    lines += ["", "Greedy output equal to plain decoding's, in process: " +
              ", ".join(f"{row} {n}/{report['prompts']}" for row, n in eq.items()) + "."]
    return "\n".join(lines) + "\n"


def plot(report: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    sizes = [int(n) for n in report["head_us"]]
    labels = [str(n) if n else "all" for n in sizes]
    a.plot(labels, [report["drafter_pass_cpu_ms"][f"1x{n}"] for n in sizes], "o-", label="1 sequence")
    a.plot(labels, [report["drafter_pass_cpu_ms"][f"4x{n}"] for n in sizes], "s-", label="4 sequences")
    a.set_xlabel("draft vocabulary (tokens)")
    a.set_ylabel("drafter pass, CPU ms")
    a.set_ylim(bottom=0)
    a.legend()
    rows = report["rows"]
    b.barh(list(rows)[::-1], [r["tokens_per_s"] for r in rows.values()][::-1],
           color=["tab:green" if n.endswith("vocab") else "tab:gray" for n in list(rows)[::-1]])
    b.set_xlabel("tokens/s, batch 1")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="specserve bench draft-vocab", description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=str(DEFAULT_MODEL_DIR), help="folder with target/ and drafter/")
    p.add_argument("-k", type=int, default=4)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--size", type=int, default=0, help="the draft vocabulary's size (0: its file's default)")
    p.add_argument("--sizes", default="4096,2048,1024,512", help="sizes whose head and pass are timed")
    add_dtype_arg(p)
    p.add_argument("--out", type=out_prefix, default=str(RESULTS_DIR / "draft_vocab"), help="writes OUT.json, OUT.md and OUT.png")
    args = p.parse_args(argv)
    check_draft_k(p, args.k)
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    report = bench(args)
    command = "specserve bench draft-vocab " + " ".join(argv if argv is not None else sys.argv[1:])
    md = markdown(report, command)
    print(md)
    Path(args.out + ".json").write_text(json.dumps(report, indent=2) + "\n")
    Path(args.out + ".md").write_text(md)
    plot(report, args.out + ".png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
