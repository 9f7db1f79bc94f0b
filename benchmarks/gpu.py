"""`specserve bench gpu`: the prepared GPU check. On one GPU, in a few minutes, it

1. loads the demo pair on `cuda` in float32 and in bfloat16, eagerly, and bfloat16 compiled
   (CUDA graphs, its compile time in the load column), and checks that greedy speculative
   output equals plain decoding (parting only at a tie within rounding, as in tests/test_device.py),
   with the sampled drafts' acceptance rate (two sequences at a time: compiled, it should match
   the eager rows'),
   with in-process tokens/s, load time and peak GPU memory; bfloat16 eager once more with the
   drafter's whole head (`draft_vocab: off`), against the draft vocabulary every other row uses;
2. runs the pair's two actors on that one GPU (`gpus_per_actor: 0.5`) and measures plain,
   speculative (sequential) and pipelined tokens/s through Ray + gRPC, and a colocated pair
   (`colocate: true`: one actor, the drafter in its process, on the whole GPU);
3. sweeps the speculation cache's fan-out (pipelined, k fixed, `--fanouts`, default 1, 4, 8):
   tokens/s and pipeline hit rate at each. On the CPU, preparing F outcomes costs about F drafter
   passes, so fan-out past 3 loses (docs/benchmarks/distributed.md); on a GPU a batched drafter pass
   costs about the same at any F, and hit_ceiling.md puts the free-preparation hit rate at 0.67,
   0.75, 0.82 for F = 4, 8, 16 (greedy): this row says how close the timed pair comes;
4. writes OUT.md and OUT.json (default docs/benchmarks/gpu) after each part, so a run cut off
   keeps what it measured; a part that fails is listed under errors and the others still run;
   greedy output parting from plain decoding off a tie is listed, not raised; either exits 1.

    specserve bench gpu                 # on a machine with a GPU
    specserve bench gpu --prompts 3 --max-tokens 64 --fanouts 1,4 --out $OUT/gpu
                                        # a GPU lent for minutes (each pair compiles on start)
    specserve bench gpu --stages in_process   # one part (in_process, distributed, fanout)
    specserve bench gpu --dry-run       # the same code on the CPU, small: what CI runs
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import logging
import os
import statistics
import sys
import time

import torch

from specserve.benchmarks.bench import round_split_table
from specserve.benchmarks.endpoint import out_prefix, write_results
from specserve.benchmarks.serve import int_list
from specserve.config import DEFAULT_MODEL_DIR, REPO_ROOT, SpecServeConfig

RESULTS_DIR = REPO_ROOT / "docs" / "benchmarks"
STAGES = ("in_process", "distributed", "fanout")


def _tok_per_s(generate, prompts, max_tokens, k) -> float:
    from specserve.core.sampling import SamplingParams
    rates = []
    for p in prompts:
        t0 = time.perf_counter()
        n = len(generate(p, max_tokens, SamplingParams(), k).token_ids)
        rates.append(n / (time.perf_counter() - t0))
    return statistics.median(rates)


def in_process(device: str, dtype: str, prompts, max_tokens: int, k: int, compile: bool = False,
               draft_vocab: str = "auto") -> dict:
    from specserve.builder import build_engine
    from specserve.core.sampling import SamplingParams
    from specserve.verifier.engine import SpeculativeEngine
    if device == "cuda":  # (the rows before: their engines gone, their cached blocks freed)
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    base_mib = torch.cuda.memory_allocated() / 2**20 if device == "cuda" else 0.0
    t0 = time.perf_counter()
    # k fixed: every round drafts k, so the row measures speculation at k (the adaptive policy may
    # draft little where a drafter pass costs about what a target pass does, as on a GPU at batch 1)
    spec = build_engine(SpecServeConfig(device=device, dtype=dtype, max_num_seqs=2, compile=compile,
                                        draft_vocab=draft_vocab, speculation="fixed", k=k))
    if device == "cuda":
        torch.cuda.synchronize()
    load_s = time.perf_counter() - t0
    plain = SpeculativeEngine(spec.target, None)
    eps = torch.finfo(getattr(torch, dtype)).eps
    equal, tie_parted, parted = 0, 0, []
    for p in prompts:
        a = spec.generate(p, max_tokens, SamplingParams(), k).token_ids
        b = plain.generate(p, max_tokens, SamplingParams(), 0).token_ids
        if a == b:
            equal += 1
            continue
        i = next(j for j, (x, y) in enumerate(zip(a, b)) if x != y)
        with torch.no_grad():
            top = torch.topk(spec.target.model(torch.tensor([p + b[:i]], device=spec.target.device))
                             .logits[0, -1].float(), 2).values
        gap = float(top[0] - top[1])
        if gap > 2 * eps * max(abs(float(top[0])), 1.0):  # (within two rounding steps: a tie; a GPU's
            parted.append({"at": i, "gap": gap})        # k+1-wide pass and 1-wide pass use other kernels)
        else:
            tie_parted += 1
    # sampled (T = 0.8, a seed per prompt, two at a time so catch-ups differ in length): the drafts'
    # acceptance rate, which should match the eager rows': the compiled drafter keeps a pass's logits
    # across later passes, and before stop 49 a CUDA graph's next replay rewrote them (not yet seen on a GPU)
    accepted = drafted = 0
    for i in range(0, len(prompts), 2):
        reqs = [spec.submit(p, max_tokens, SamplingParams(temperature=0.8, seed=i + j), k)
                for j, p in enumerate(prompts[i:i + 2])]
        while not all(r.done.is_set() for r in reqs):
            spec.step()
        accepted += sum(r.stats.num_accepted_tokens for r in reqs)
        drafted += sum(r.stats.num_draft_tokens for r in reqs)
    warm = prompts[:1]
    _tok_per_s(plain.generate, warm, 8, 0), _tok_per_s(spec.generate, warm, 8, k)  # warm-up
    row = {"device": str(spec.target.device), "dtype": str(spec.target.model.dtype), "load_s": load_s,
           "compiled": spec.target.compiled, "drafter_compiled": spec.proposer.runner.compiled,
           "draft_vocab": len(spec.proposer.runner.vocab) if spec.proposer.runner.vocab is not None else "off",
           "greedy_equal": equal, "greedy_parted_at_a_tie": tie_parted, "greedy_parted": parted,
           "prompts": len(prompts),
           "sampled_acceptance": accepted / drafted if drafted else None,
           "plain_tok_s": _tok_per_s(plain.generate, prompts, max_tokens, 0),
           "speculative_tok_s": _tok_per_s(spec.generate, prompts, max_tokens, k)}
    row["speedup"] = row["speculative_tok_s"] / row["plain_tok_s"]
    if device == "cuda":
        row["peak_gpu_memory_mib"] = torch.cuda.max_memory_allocated() / 2**20 - base_mib
    print(f"  {row['device']} / {row['dtype']}{' compiled' if compile else ''}: {row['speculative_tok_s']:.1f} tok/s "
          f"speculative, {row['plain_tok_s']:.1f} plain, greedy equal {equal}/{len(prompts)}", flush=True)
    return row


def _hit_rate_run(generate, prompts, max_tokens, k) -> tuple[float, float]:
    """Median tokens/s over prompts, and the pipeline hit rate over all their drafted rounds."""
    from specserve.core.sampling import SamplingParams
    rates, hits, drafts = [], 0, 0
    for p in prompts:
        t0 = time.perf_counter()
        r = generate(p, max_tokens, SamplingParams(), k)
        rates.append(len(r.token_ids) / (time.perf_counter() - t0))
        hits, drafts = hits + r.stats.num_pipeline_hits, drafts + r.stats.num_drafts
    return statistics.median(rates), hits / drafts if drafts else 0.0


def fanout_sweep(device: str, dtype: str, prompts, max_tokens: int, k: int, fanouts: list[int]) -> list[dict]:
    """The pair pipelined at each fan-out, k fixed (so every round drafts k and the hit rate is the
    issue's measure), both actors on one device."""
    from specserve.cluster.pair import SpeculativePair, ensure_ray
    ensure_ray()
    target, drafter = str(DEFAULT_MODEL_DIR / "target"), str(DEFAULT_MODEL_DIR / "drafter")
    rows = []
    for f in fanouts:
        pair = SpeculativePair(target, drafter, pipeline=True, fanout=f, speculation="fixed", device=device,
                               dtype=dtype, use_gpu=device == "cuda", gpus_per_actor=0.5, cpus_per_actor=1, k=k)
        try:
            _hit_rate_run(pair.generate, prompts[:1], 8, k)  # warm-up
            tok_s, hit = _hit_rate_run(pair.generate, prompts, max_tokens, k)
        finally:
            pair.shutdown()
        rows.append({"fanout": f, "tok_s": tok_s, "pipeline_hit_rate": hit})
    return rows


def distributed(device: str, dtype: str, prompts, max_tokens: int, k: int) -> dict:
    """tokens/s of each pair mode, and where its rounds went over the timed run ("round_split":
    the engine's round times and the drafter server's, as the distributed bench splits them)."""
    from collections import Counter

    import ray

    from specserve.benchmarks.bench import round_probe
    from specserve.cluster.pair import SpeculativePair, ensure_ray
    ensure_ray()
    fields = dict(device=device, dtype=dtype, use_gpu=device == "cuda", gpus_per_actor=0.5, cpus_per_actor=1, k=k)
    target, drafter = str(DEFAULT_MODEL_DIR / "target"), str(DEFAULT_MODEL_DIR / "drafter")
    out = {}
    for name, drafter_path, pipeline, kk in (("plain", None, False, 0), ("speculative", drafter, False, k),
                                             ("pipelined", drafter, True, k), ("colocated", drafter, False, k)):
        colocated = dict(colocate=True, gpus_per_actor=1.0) if name == "colocated" else {}
        pair = SpeculativePair(target, drafter_path, pipeline=pipeline, **{**fields, **colocated})
        probe = round_probe(lambda: ray.get(pair.verifier.times.remote()),
                            (lambda: ray.get(pair.drafter.actor.times.remote())) if pair.drafter else None)
        try:
            _tok_per_s(pair.generate, prompts[:1], 8, kk)  # warm-up
            before = probe()
            out[f"{name}_tok_s"] = _tok_per_s(pair.generate, prompts, max_tokens, kk)
            grown = Counter(probe())
            grown.subtract(before)
            out.setdefault("round_split", {})[name] = {"probe": dict(grown)}
        finally:
            pair.shutdown()
    out["speculative_over_plain"] = out["speculative_tok_s"] / out["plain_tok_s"]
    out["pipelined_over_sequential"] = out["pipelined_tok_s"] / out["speculative_tok_s"]
    out["colocated_over_plain"] = out["colocated_tok_s"] / out["plain_tok_s"]
    return out


def markdown(report: dict, command: str) -> str:
    lines = [f"Command: `{command}`", "", f"{report['machine']}; torch {report['torch']}; demo pair, k = "
             f"{report['k']}, {report['prompts']} held-out prompts, {report['max_tokens']} new tokens, greedy, "
             "medians over prompts."]
    if report["in_process"]:
        lines += ["", "| device / dtype | draft vocabulary | load (+ compile) s | greedy spec == plain | sampled acceptance (T = 0.8) | plain tok/s | speculative tok/s | speedup | peak MiB |",
                  "|---|---|---|---|---|---|---|---|---|"]
    for r in report["in_process"]:
        lines.append(f"| {r['device']} / {r['dtype']}{' compiled' if r.get('compiled') else ''} | {r['draft_vocab']} | "
                     f"{r['load_s']:.1f} | {r['greedy_equal']}/{r['prompts']}"
                     f"{' (+' + str(r['greedy_parted_at_a_tie']) + ' at a tie)' if r['greedy_parted_at_a_tie'] else ''}"
                     f"{' **(+' + str(len(r['greedy_parted'])) + ' parted off a tie)**' if r['greedy_parted'] else ''}"
                     f" | {'–' if r['sampled_acceptance'] is None else format(r['sampled_acceptance'], '.2f')} | {r['plain_tok_s']:.1f} | {r['speculative_tok_s']:.1f} | {r['speedup']:.2f} | "
                     f"{r.get('peak_gpu_memory_mib', float('nan')):.0f} |")
    d = report.get("distributed")
    if d is None:  # (not run, or failed: see errors)
        d = {}
    if report.get("errors"):
        lines += ["", "**Errors** (the stage failed, the others ran):", ""] + [f"- {e}" for e in report["errors"]]
    if report.get("skipped"):
        lines += ["", "Skipped:", ""] + [f"- {e}" for e in report["skipped"]]
    if d:
        lines += ["", f"Both actors on one device (gpus_per_actor 0.5), Ray + gRPC, {report['distributed_dtype']}:", "",
              "| plain tok/s | speculative (sequential) tok/s | pipelined tok/s | spec / plain | pipelined / sequential "
              "| colocated tok/s (one actor, whole device) | colocated / plain |",
              "|---|---|---|---|---|---|---|",
              f"| {d['plain_tok_s']:.1f} | {d['speculative_tok_s']:.1f} | {d['pipelined_tok_s']:.1f} | "
              f"{d['speculative_over_plain']:.2f} | {d['pipelined_over_sequential']:.2f} | {d['colocated_tok_s']:.1f} | "
              f"{d['colocated_over_plain']:.2f} |"]
        lines += round_split_table(d.get("round_split", {})) + [""]
    if report.get("fanout_sweep"):
        base = report["fanout_sweep"][0]["tok_s"]
        lines += ["", f"The speculation cache's fan-out, pipelined, k = {report['k']} fixed, {report['distributed_dtype']} "
                  "(greedy; the free-preparation ceiling is in hit_ceiling.md):", "",
                  "| fan-out | tok/s | pipeline hit rate | tok/s / the first row's |", "|---|---|---|---|"]
        lines += [f"| {r['fanout']} | {r['tok_s']:.1f} | {r['pipeline_hit_rate']:.2f} | {r['tok_s'] / base:.2f} |"
                  for r in report["fanout_sweep"]] + [""]
    if report["dry_run"]:
        lines.insert(2, "**Dry run on the CPU** (the code path of the GPU check, small): no GPU figure here.\n")
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="specserve bench gpu", description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true", help="run on the CPU, small (CI)")
    p.add_argument("--prompts", type=int, default=None, help="default 10 (dry run: 2)")
    p.add_argument("--max-tokens", type=int, default=None, help="default 128 (dry run: 16)")
    p.add_argument("-k", type=int, default=4)
    p.add_argument("--no-compile-row", action="store_true",
                   help="skip the compiled (CUDA graphs) bfloat16 row (a dry run skips it unless --compile-row)")
    p.add_argument("--compile-row", action="store_true", help="with --dry-run: run the compiled row too")
    p.add_argument("--fanouts", type=int_list, default=None, help="fan-outs to sweep, comma-separated (default 1,4,8; dry run: 1,2)")
    p.add_argument("--stages", default=",".join(STAGES),
                   help=f"which parts to run, comma-separated, of {','.join(STAGES)} (default: all; one GPU "
                        "lent for minutes may not run them all)")
    # on the lent GPU machine only $OUT comes back: the results go there when it is set
    p.add_argument("--out", type=out_prefix, default=os.path.join(os.environ["OUT"], "gpu") if os.environ.get("OUT") else str(RESULTS_DIR / "gpu"),
                   help="writes OUT.md and OUT.json (default $OUT/gpu when $OUT is set, else docs/benchmarks/gpu)")
    args = p.parse_args(argv)
    stages = [st for st in args.stages.split(",") if st]
    if not stages or set(stages) - set(STAGES):
        print(f"specserve bench gpu: error: --stages takes some of {','.join(STAGES)}, got {args.stages!r}",
              file=sys.stderr)
        return 2
    device = "cpu" if args.dry_run else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("specserve bench gpu: error: no CUDA GPU visible (use --dry-run on a CPU)", file=sys.stderr)
        return 2
    if args.k == 0:  # (the config then has no drafter, and the speculative rows failed: the plain ones run k 0)
        print("specserve bench gpu: error: -k must be >= 1", file=sys.stderr)
        return 2
    try:
        fanouts = args.fanouts or ([1, 2] if args.dry_run else [1, 4, 8])
        for f in fanouts:
            SpecServeConfig(pipeline=True, fanout=f, k=args.k)
    except ValueError as e:  # (before any stage runs: until stop 53 a bad -k failed every stage, one by one)
        print(f"specserve bench gpu: error: --fanouts / -k: {e}", file=sys.stderr)
        return 2
    n = args.prompts if args.prompts is not None else (2 if args.dry_run else 10)
    max_tokens = args.max_tokens if args.max_tokens is not None else (16 if args.dry_run else 128)
    if n < 1 or max_tokens < 1:
        print(f"specserve bench gpu: error: --prompts and --max-tokens must be >= 1, got {n} and {max_tokens}",
              file=sys.stderr)
        return 2
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    if args.dry_run:
        torch.set_num_threads(1)
    from specserve.core.runner import load_tokenizer
    from specserve.training.demo_pair import heldout_prompts
    prompts = heldout_prompts(DEFAULT_MODEL_DIR, n, 64, load_tokenizer(str(DEFAULT_MODEL_DIR / "target")))
    dtypes = ["float32", "bfloat16"]
    t0 = time.perf_counter()
    report = {"dry_run": args.dry_run, "torch": torch.__version__, "k": args.k, "prompts": n, "max_tokens": max_tokens,
              "machine": torch.cuda.get_device_name() if device == "cuda" else "CPU (dry run)",
              "in_process": [], "distributed_dtype": "bfloat16" if device == "cuda" else "float32", "errors": []}
    rows = [dict(dtype=dt) for dt in dtypes] + [dict(dtype="bfloat16", draft_vocab="off")]
    if (args.compile_row or not args.dry_run) and not args.no_compile_row:
        rows.append(dict(dtype="bfloat16", compile=True))
    command = "specserve bench gpu " + " ".join(argv)

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")  # (compiling: progress)
    if device == "cuda":  # the CUDA context and the libraries' start-up, before the first row's load is timed
        torch.ones(1, device="cuda").sum().item()
    has_ray = importlib.util.find_spec("ray") is not None

    def run(stage: str, step) -> None:  # each part written as it ends: a run cut off keeps what it measured
        if stage not in stages:
            return
        if stage in ("distributed", "fanout") and not has_ray:
            report.setdefault("skipped", []).append(f"{stage}: Ray is not installed here")
            return
        print(f"{stage}: {time.perf_counter() - t0:.0f} s in", flush=True)
        try:
            step()
        except Exception as e:  # one part failing (a kernel, an actor) leaves the others to run
            report["errors"].append(f"{stage}: {type(e).__name__}: {str(e)[:300]}")
        report["seconds"] = time.perf_counter() - t0
        write_results(args.out, report, markdown(report, command))

    dtype = report["distributed_dtype"]
    for row in rows:
        run("in_process", lambda: report["in_process"].append(
            in_process(device, prompts=prompts, max_tokens=max_tokens, k=args.k, **row)))
    run("distributed", lambda: report.update(distributed=distributed(device, dtype, prompts, max_tokens, args.k)))
    run("fanout", lambda: report.update(
        fanout_sweep=fanout_sweep(device, dtype, prompts, max_tokens, args.k, fanouts)))
    parted = any(r["greedy_parted"] for r in report["in_process"])
    return 1 if report["errors"] or parted else 0


if __name__ == "__main__":
    sys.exit(main())
