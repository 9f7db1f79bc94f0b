"""Evaluate a target/drafter pair on held-out code: `specserve eval-demo` (`python -m specserve.training.eval_demo`).

Everything runs in process with ONE torch thread, on prompts taken from the held-out stdlib
modules of the pair's ``split.json`` (``specserve.training.demo_pair.heldout_prompts``; a folder without a
split, e.g. a tiny random pair, falls back to random token ids). Sections (``--sections``):

* ``loss``     held-out next-token loss / perplexity of the target and the drafter(s)
               (``specserve.training.demo_pair.heldout_loss``, first ``--loss-tokens`` held-out tokens);
* ``greedy``   greedy acceptance rate (accepted / drafted draft tokens, totals over all prompts)
               and mean acceptance length (1 + accepted / drafted rounds) for each k in ``--ks``;
* ``sampled``  the same at ``--temperature`` / ``--top-p`` with fixed per-prompt seeds;
* ``speed``    single-stream tokens/s of plain target decoding (k = 0 through the same engine
               loop and target runner) and of speculative decoding at each k, medians of
               ``--repeats`` passes over ``--speed-prompts`` prompts, the rows interleaved pass by
               pass so that load drift hits all rows alike; the headline is the best k's ratio;
* ``compare``  greedy and sampled acceptance at ``--compare-k`` of ``--drafter`` and
               ``--compare-drafter`` (e.g. a CE-trained baseline) on the same prompts and seeds;
* ``samples``  a few held-out prompts with their greedy (speculative, k = 4) completions.

Prints a markdown report and writes JSON (``--out x.json``), or markdown plus a JSON twin
(``--out x.md`` writes ``x.md`` and ``x.json``).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Sequence

import torch

from specserve.benchmarks.bench import ideal_speedup, measure, time_target_pass
from specserve.config import DEFAULT_MODEL_DIR, REPO_ROOT, SpecServeConfig
from specserve.core.proposer import MAX_K
from specserve.training.demo_pair import heldout_prompts

SECTIONS = ("loss", "greedy", "sampled", "speed", "compare", "samples")
DEFAULT_OUT = REPO_ROOT / "docs" / "demo-models.json"


# ----------------------------------------------------------------------------- measurements

def acceptance_stats(engine, prompts: list[list[int]], max_tokens: int, k: int, sampling_for) -> dict:
    """One pass over ``prompts`` at draft length ``k``; ``sampling_for(i)`` gives prompt i's
    SamplingParams. Totals over all prompts (sequences that stop early at EOS count as they are)."""
    tokens = passes = drafts = drafted = accepted = 0
    per_pos = [0] * k
    reasons: dict[str, int] = {}
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        r = engine.generate(p, max_tokens, sampling_for(i), k)
        s = r.stats
        tokens += len(r.token_ids)
        passes += s.num_target_passes
        drafts += s.num_drafts
        drafted += s.num_draft_tokens
        accepted += s.num_accepted_tokens
        for j, n in enumerate(s.num_accepted_tokens_per_pos[:k]):
            per_pos[j] += n
        reasons[r.finish_reason] = reasons.get(r.finish_reason, 0) + 1
    return {
        "k": k, "prompts": len(prompts), "generated_tokens": tokens, "target_passes": passes,
        "drafts": drafts, "draft_tokens": drafted, "accepted_tokens": accepted,
        "acceptance_rate": accepted / drafted if drafted else 0.0,
        "mean_acceptance_length": 1 + accepted / drafts if drafts else 1.0,
        "tokens_per_target_pass": tokens / passes if passes else 0.0,
        # P(draft position j accepted | a draft of length > j was made), from the per-position counts
        "accepted_per_position": per_pos,
        "finish_reasons": reasons,
        "seconds": time.perf_counter() - t0,
    }


def speed_rows(plain, spec, prompts: list[list[int]], max_tokens: int, ks: Sequence[int], repeats: int) -> dict:
    """Greedy tokens/s of plain decoding and of speculation at each k; medians over ``repeats``
    passes, rows interleaved within each pass (one warm-up generate per row first)."""
    from specserve.core.sampling import SamplingParams
    rows = {"plain (k=0)": (plain.generate, 0)}
    rows.update({f"speculative k={k}": (spec.generate, k) for k in ks})
    for gen, k in rows.values():
        gen(prompts[0], 8, SamplingParams(), k)
    runs: dict[str, list[dict]] = {name: [] for name in rows}
    for rep in range(repeats):
        for name, (gen, k) in rows.items():
            runs[name].append(measure(gen, prompts, max_tokens, k))
        print(f"  speed pass {rep + 1}/{repeats}: " + ", ".join(
            f"{n} {runs[n][-1]['tokens_per_s']:.1f}" for n in rows) + " tok/s", file=sys.stderr, flush=True)
    out = {}
    for name, rs in runs.items():
        out[name] = {key: statistics.median(r[key] for r in rs) for key in rs[0]}
        out[name]["runs_tokens_per_s"] = [r["tokens_per_s"] for r in rs]
        out[name]["k"] = rows[name][1]
    base = out["plain (k=0)"]["tokens_per_s"]
    for r in out.values():
        r["speedup"] = r["tokens_per_s"] / base
    return out


def folder_bytes(path: str) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def count_params(runner) -> int:
    return sum(p.numel() for p in runner.model.parameters())


def _sampling(temperature: float, top_p: float, seed: int):
    from specserve.core.sampling import SamplingParams
    if temperature == 0:
        return lambda i: SamplingParams()
    return lambda i: SamplingParams(temperature=temperature, top_p=top_p, seed=seed + i)


# ----------------------------------------------------------------------------- the evaluation

def evaluate(args) -> dict:
    from specserve.builder import build_engine
    from specserve.core.sampling import SamplingParams
    from specserve.core.runner import ModelRunner, same_tokenizer
    from specserve.drafter.draft_model import DraftModelProposer
    from specserve.verifier.engine import SpeculativeEngine

    torch.set_num_threads(1)
    t_start = time.perf_counter()
    models = Path(args.models)
    target_path = args.target or str(models / "target")
    drafter_path = args.drafter or str(models / "drafter")
    split = models / "split.json"
    sections = set(args.sections)
    if not args.compare_drafter:
        sections.discard("compare")

    # speculation fixed: each figure is at the k it is labelled with (until stop 61 the config's default,
    # adaptive, let the policy draft fewer, with its state carried from one k's run into the next)
    spec = build_engine(SpecServeConfig(target=target_path, drafter=drafter_path, max_num_seqs=1, speculation="fixed",
                                        k=max(*args.ks, args.compare_k)))  # (the config's k is each request's limit)
    plain = SpeculativeEngine(spec.target, None)
    tok = spec.target.tokenizer
    prompts = heldout_prompts(models, args.prompts, args.prompt_tokens, tok, seed=args.seed)
    report: dict = {
        "models": str(models), "target": target_path, "drafter": drafter_path,
        "compare_drafter": args.compare_drafter,
        "prompt_source": f"held-out files of {split}" if split.exists() else "random token ids (no split.json)",
        "settings": {"prompts": len(prompts), "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens,
                     "ks": list(args.ks), "temperature": args.temperature, "top_p": args.top_p,
                     "seed": args.seed, "torch_threads": torch.get_num_threads(),
                     "speed_prompts": args.speed_prompts, "repeats": args.repeats,
                     "loss_tokens": args.loss_tokens, "compare_k": args.compare_k,
                     "eos": "default (sequences may stop early at EOS)"},
        "params": {"target": count_params(spec.target), "drafter": count_params(spec.proposer.runner)
                   if hasattr(spec.proposer, "runner") else None},
        "size_mb": {"target": folder_bytes(target_path) / 1e6, "drafter": folder_bytes(drafter_path) / 1e6},
        "loadavg_start": list(os.getloadavg()),
        "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    for name, path in (("target", target_path), ("drafter", drafter_path)):
        info = Path(path) / "training_info.json"
        if info.exists():
            report.setdefault("training_info", {})[name] = json.loads(info.read_text())

    def log(msg):
        print(f"[eval {time.perf_counter() - t_start:5.0f}s] {msg}", file=sys.stderr, flush=True)

    if "loss" in sections:
        if split.exists():
            from specserve.training.demo_pair import heldout_loss
            report["heldout_loss"] = {}
            paths = [("target", target_path), ("drafter", drafter_path)]
            if args.compare_drafter:
                paths.append(("compare_drafter", args.compare_drafter))
            for name, path in paths:
                report["heldout_loss"][name] = heldout_loss(path, str(split), args.loss_tokens)
                log(f"held-out loss {name}: {report['heldout_loss'][name]['loss']:.4f}")
        else:
            report["heldout_loss"] = None
            log("no split.json: held-out loss skipped")

    if "greedy" in sections:
        report["greedy"] = {}
        for k in args.ks:
            report["greedy"][str(k)] = acceptance_stats(spec, prompts, args.max_tokens, k, _sampling(0, 1, 0))
            log(f"greedy k={k}: acceptance {report['greedy'][str(k)]['acceptance_rate']:.3f}")

    if "sampled" in sections:
        report["sampled"] = {}
        for k in args.ks:
            report["sampled"][str(k)] = acceptance_stats(
                spec, prompts, args.max_tokens, k, _sampling(args.temperature, args.top_p, args.seed))
            log(f"sampled k={k}: acceptance {report['sampled'][str(k)]['acceptance_rate']:.3f}")

    if "compare" in sections:
        other = ModelRunner.from_pretrained(args.compare_drafter, name="compare-drafter", role="drafter")
        if not same_tokenizer(tok, other.tokenizer):
            raise ValueError(f"{args.compare_drafter}: tokenizer differs from the target's")
        cmp_engine = SpeculativeEngine(spec.target, DraftModelProposer(other))
        k = args.compare_k
        report["params"]["compare_drafter"] = count_params(other)
        report["size_mb"]["compare_drafter"] = folder_bytes(args.compare_drafter) / 1e6
        info = Path(args.compare_drafter) / "training_info.json"
        if info.exists():
            report.setdefault("training_info", {})["compare_drafter"] = json.loads(info.read_text())
        cmp: dict = {"k": k}
        for mode, samp in (("greedy", _sampling(0, 1, 0)),
                           ("sampled", _sampling(args.temperature, args.top_p, args.seed))):
            mine = report.get(mode, {}).get(str(k)) or acceptance_stats(spec, prompts, args.max_tokens, k, samp)
            cmp[mode] = {"drafter": mine,
                         "compare_drafter": acceptance_stats(cmp_engine, prompts, args.max_tokens, k, samp)}
            log(f"compare {mode} k={k}: drafter {mine['acceptance_rate']:.3f}, compare drafter "
                f"{cmp[mode]['compare_drafter']['acceptance_rate']:.3f}")
        report["compare"] = cmp

    if "speed" in sections:
        sp = prompts[: args.speed_prompts]
        rows = speed_rows(plain, spec, sp, args.max_tokens, args.ks, args.repeats)
        best = max((r for r in rows.values() if r["k"] > 0), key=lambda r: r["tokens_per_s"])
        t1 = time_target_pass(spec.target, sp[0], 1)
        tk1 = time_target_pass(spec.target, sp[0], best["k"] + 1)
        d1 = time_target_pass(spec.proposer.runner, sp[0], 1) if hasattr(spec.proposer, "runner") else None
        report["speed"] = {
            "prompts": len(sp), "repeats": args.repeats, "mode": "greedy", "rows": rows,
            "best_k": best["k"], "speedup": best["speedup"],
            "plain_tokens_per_s": rows["plain (k=0)"]["tokens_per_s"], "best_tokens_per_s": best["tokens_per_s"],
            "t_target_1_ms": t1 * 1e3, "t_target_k1_ms": tk1 * 1e3,
            "t_drafter_1_ms": d1 * 1e3 if d1 is not None else None,
            "ideal_speedup_no_draft_cost": ideal_speedup(best["acceptance_rate"], best["k"], t1, tk1),
        }
        log(f"speed: plain {report['speed']['plain_tokens_per_s']:.1f} tok/s, k={best['k']} "
            f"{best['tokens_per_s']:.1f} tok/s, speedup {best['speedup']:.2f}x")

    if "samples" in sections and args.samples:
        report["samples"] = []
        for p in prompts[: args.samples]:
            r = spec.generate(p, args.max_tokens, SamplingParams(), 4)
            report["samples"].append({
                "prompt": tok.decode(p), "completion": tok.decode(r.token_ids, skip_special_tokens=True),
                "finish_reason": r.finish_reason, "acceptance_rate": r.stats.acceptance_rate,
                "mean_acceptance_length": r.stats.mean_acceptance_length})

    report["loadavg_end"] = list(os.getloadavg())
    report["elapsed_s"] = time.perf_counter() - t_start
    return report


# ----------------------------------------------------------------------------- report

def markdown(report: dict) -> str:
    s = report["settings"]
    L = [f"Command: `{report.get('command', '')}`", "",
         f"Target `{report['target']}` ({report['params']['target'] / 1e6:.2f}M params, "
         f"{report['size_mb']['target']:.1f} MB), drafter `{report['drafter']}` "
         f"({(report['params']['drafter'] or 0) / 1e6:.2f}M params, {report['size_mb']['drafter']:.1f} MB). "
         f"Prompts: {s['prompts']} × {s['prompt_tokens']} tokens from {report['prompt_source']}, "
         f"{s['max_tokens']} new tokens each, {s['torch_threads']} torch thread. "
         f"Load average at start {report['loadavg_start'][0]:.1f}, at end {report['loadavg_end'][0]:.1f}; "
         f"{report['elapsed_s'] / 60:.1f} min.", ""]
    hl = report.get("heldout_loss")
    if hl:
        L += ["| model | held-out loss (nats/token) | perplexity | tokens |", "|---|---|---|---|"]
        for name, r in hl.items():
            L.append(f"| {name} | {r['loss']:.4f} | {r['ppl']:.2f} | {r['tokens']:,} |")
        L.append("")
    for mode, title in (("greedy", "greedy"),
                        ("sampled", f"temperature {s['temperature']}, top-p {s['top_p']}, seed {s['seed']} + prompt index")):
        if report.get(mode):
            L += [f"Acceptance, {title}:", "",
                  "| k | acceptance rate | mean acceptance length | tokens / target pass | accepted at draft position 1..k | tokens | finish reasons |",
                  "|---|---|---|---|---|---|---|"]
            for k, r in report[mode].items():
                L.append(f"| {k} | {r['acceptance_rate']:.3f} | {r['mean_acceptance_length']:.2f} "
                         f"| {r['tokens_per_target_pass']:.2f} | {r['accepted_per_position']} "
                         f"| {r['generated_tokens']} | {r['finish_reasons']} |")
            L.append("")
    c = report.get("compare")
    if c:
        L += [f"Drafter comparison at k = {c['k']} (same prompts and seeds):", "",
              "| drafter | greedy acceptance | greedy mean acc. length | sampled acceptance | sampled mean acc. length |",
              "|---|---|---|---|---|"]
        for who, path in (("drafter", report["drafter"]), ("compare_drafter", report["compare_drafter"])):
            g, sm = c["greedy"][who], c["sampled"][who]
            L.append(f"| {who.replace('_', ' ')} `{path}` | {g['acceptance_rate']:.3f} | {g['mean_acceptance_length']:.2f} "
                     f"| {sm['acceptance_rate']:.3f} | {sm['mean_acceptance_length']:.2f} |")
        L.append("")
    sp = report.get("speed")
    if sp:
        L += [f"Single-stream speed, greedy, {sp['prompts']} prompts, median of {sp['repeats']} interleaved passes:", "",
              "| row | tokens/s | speedup | acceptance rate | mean acceptance length | runs (tok/s) |",
              "|---|---|---|---|---|---|"]
        for name, r in sp["rows"].items():
            L.append(f"| {name} | {r['tokens_per_s']:.1f} | {r['speedup']:.2f}× | {r['acceptance_rate']:.3f} "
                     f"| {r['mean_acceptance_length']:.2f} | {', '.join(f'{x:.1f}' for x in r['runs_tokens_per_s'])} |")
        L += ["", f"Best k = {sp['best_k']}: **{sp['speedup']:.2f}×** over plain decoding. "
              f"T_target(1 token) = {sp['t_target_1_ms']:.2f} ms, T_target({sp['best_k'] + 1} tokens) = "
              f"{sp['t_target_k1_ms']:.2f} ms, T_drafter(1 token) = "
              + (f"{sp['t_drafter_1_ms']:.2f} ms" if sp['t_drafter_1_ms'] is not None else "n/a")
              + f"; ideal speedup ignoring draft cost {sp['ideal_speedup_no_draft_cost']:.2f}×.", ""]
    for i, smp in enumerate(report.get("samples") or []):
        L += [f"Sample {i + 1} (greedy, k = 4, acceptance {smp['acceptance_rate']:.2f}, "
              f"finish {smp['finish_reason']}); prompt, then `# ---- completion ----`, then the completion:", "",
              "```python", smp["prompt"].rstrip("\n"), "# ---- completion ----", smp["completion"].rstrip("\n"), "```", ""]
    return "\n".join(L)


# ----------------------------------------------------------------------------- CLI

def _ks(s: str) -> list[int]:
    try:
        ks = [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        ks = []
    if not ks or any(not 1 <= k <= MAX_K for k in ks):  # (past MAX_K: the engine's traceback until stop 61)
        raise argparse.ArgumentTypeError(f"--ks must be a comma-separated list of integers in [1, {MAX_K}], got {s!r}")
    return ks


def _sections(s: str) -> list[str]:
    out = [x.strip() for x in s.split(",") if x.strip()]
    bad = [x for x in out if x not in SECTIONS]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown section(s) {bad}; choose from {','.join(SECTIONS)}")
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specserve eval-demo", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--models", default=str(DEFAULT_MODEL_DIR), help="folder with target/, drafter/, split.json")
    p.add_argument("--target", default=None, help="target folder (default <models>/target)")
    p.add_argument("--drafter", default=None, help="drafter folder (default <models>/drafter)")
    p.add_argument("--compare-drafter", default=None, help="a second drafter (e.g. a CE baseline) to compare")
    p.add_argument("--prompts", type=int, default=50)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--ks", type=_ks, default=[2, 4, 6], help="draft lengths, comma-separated")
    p.add_argument("--compare-k", type=int, default=4)
    p.add_argument("--temperature", type=float, default=0.8, help="for the sampled section")
    p.add_argument("--top-p", type=float, default=0.95, help="for the sampled section")
    p.add_argument("--seed", type=int, default=0, help="prompt selection; sampling seed = seed + prompt index")
    p.add_argument("--speed-prompts", type=int, default=10)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--loss-tokens", type=int, default=100_000)
    p.add_argument("--samples", type=int, default=3)
    p.add_argument("--sections", type=_sections, default=list(SECTIONS), help=",".join(SECTIONS))
    p.add_argument("--out", default=str(DEFAULT_OUT),
                   help="x.json writes JSON; x.md writes the markdown report and x.json; '-' writes nothing")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.temperature > 0 or not 0 < args.top_p <= 1:  # (until stop 53 a traceback from the sampler)
        parser.error(f"--temperature must be > 0 and --top-p in (0, 1], got {args.temperature} and {args.top_p}")
    small = [f"--{n.replace('_', '-')}" for n in ("prompts", "prompt_tokens", "max_tokens", "speed_prompts", "repeats",
                                                  "loss_tokens") if getattr(args, n) < 1]
    if small:  # (tracebacks after loading the models until stop 61)
        parser.error(f"{', '.join(small)} must be >= 1")
    if not 1 <= args.compare_k <= MAX_K:
        parser.error(f"--compare-k must be in [1, {MAX_K}], got {args.compare_k}")
    if args.samples < 0:
        parser.error(f"--samples must be >= 0, got {args.samples}")
    if not 0 <= args.seed < 2 ** 63 - 10 ** 6:  # (seed + prompt index seeds each sampled prompt)
        parser.error(f"--seed must be in [0, 2**63 - 10**6), got {args.seed}")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    report = evaluate(args)
    report["command"] = "python -m specserve.training.eval_demo " + " ".join(argv if argv is not None else sys.argv[1:])
    report["command"] = report["command"].rstrip()
    md = markdown(report)
    print(md)
    if args.out != "-":
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        if out.suffix == ".md":
            out.write_text(md)
            out = out.with_suffix(".json")
        out.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.out}" + (f" and {out}" if str(out) != args.out else ""), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
