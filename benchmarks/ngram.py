"""`specserve bench ngram`: the n-gram (prompt-lookup) proposer and the adaptive policy at batch 1,
in process, on two prompt sets, against plain decoding of the same prompts in the same run:

- "edit": "edit this function" tasks built from held-out stdlib code: a function's source, an
  instruction to rename one of its arguments, and the first three lines of the edited copy; the
  answer repeats most of the prompt, which prompt lookup can draft;
- "complete": held-out code completion (`heldout_prompts`), little repetition.

Rows: plain; n-gram with fixed k; n-gram adaptive; draft model with fixed k; draft model adaptive.
Greedy, ignore EOS, one torch thread, medians of repeats; each row's output is checked against
plain decoding. Writes OUT.md, OUT.json and OUT.png.
"""

from __future__ import annotations

import argparse
import ast
import json
import random
import re
import statistics
import sys
import textwrap
import time
from pathlib import Path

from specserve.benchmarks.bench import add_dtype_arg, dtypes_line, resolved_dtypes
from specserve.benchmarks.endpoint import out_prefix
from specserve.config import DEFAULT_MODEL_DIR, REPO_ROOT

ROWS = {"plain": ("fixed", "none"), "n-gram, fixed k": ("fixed", "ngram"), "n-gram, adaptive": ("adaptive", "ngram"),
        "draft model, fixed k": ("fixed", "draft_model"), "draft model, adaptive": ("adaptive", "draft_model")}


def edit_prompts(model_dir: Path, n: int, tokenizer, max_prompt_tokens: int = 200, seed: int = 0) -> list[list[int]]:
    """'Rename x to y in this function' tasks over functions of the held-out stdlib files: their prompts."""
    return [ids for ids, _ in edit_tasks(model_dir, n, tokenizer, max_prompt_tokens, seed)]


def edit_tasks(model_dir: Path, n: int, tokenizer, max_prompt_tokens: int = 200,
               seed: int = 0) -> list[tuple[list[int], str]]:
    """The edit tasks: (prompt ids, the edited function's text after the prompt's three lines of it)."""
    from specserve.training.demo_pair import heldout_files
    rng = random.Random(seed)
    funcs = []
    for path in sorted(heldout_files(str(model_dir / "split.json"))):
        source = Path(path).read_text(encoding="utf-8", errors="replace")
        try:
            tree = ast.parse(source)
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and 5 <= node.end_lineno - node.lineno <= 14:
                names = sorted({a.arg for a in node.args.args if a.arg not in ("self", "cls") and len(a.arg) > 2})
                if names:
                    lines = source.splitlines()[node.lineno - 1:node.end_lineno]
                    funcs.append((textwrap.dedent("\n".join(lines)), names))
    rng.shuffle(funcs)
    tasks = []
    for src, names in funcs:
        old = rng.choice(names)
        new = f"{old}_value"
        edited = re.sub(rf"\b{re.escape(old)}\b", new, src)
        head = "\n".join(edited.splitlines()[:3])  # no trailing newline: BPE merges it with the indent
        text = f"# Rename `{old}` to `{new}` in this function.\n{src}\n\n# After the rename:\n{head}"
        ids = tokenizer(text)["input_ids"]
        if len(ids) <= max_prompt_tokens:
            tasks.append((ids, edited[len(head):]))
        if len(tasks) == n:
            break
    return tasks


def run_row(engine, prompts, max_tokens: int, k: int, method: str) -> dict:
    from specserve.core.sampling import SamplingParams
    tokens = drafted = accepted = rounds = chosen = 0
    outs = []
    t0 = time.perf_counter()
    for p in prompts:
        req = engine.submit(p, max_tokens, SamplingParams(), k, method=method, ignore_eos=True)
        while not req.done.is_set():
            engine.step()
        r = req.result()
        outs.append(r.token_ids)
        tokens += len(r.token_ids)
        drafted += r.stats.num_draft_tokens
        accepted += r.stats.num_accepted_tokens
        rounds += r.stats.num_rounds
        chosen += sum(i * c for i, c in enumerate(r.stats.rounds_by_k))
    elapsed = time.perf_counter() - t0
    return dict(tokens_per_s=tokens / elapsed, acceptance_rate=accepted / drafted if drafted else 0.0,
                tokens_per_round=tokens / rounds, mean_chosen_k=chosen / rounds, outputs=outs)


def bench(args) -> dict:
    import torch

    from specserve.builder import build_engine
    from specserve.config import SpecServeConfig
    from specserve.training.demo_pair import heldout_prompts

    torch.set_num_threads(1)
    model_dir = Path(args.models)
    engines = {policy: build_engine(SpecServeConfig(target=str(model_dir / "target"),
                                                    drafter=str(model_dir / "drafter"), k=args.k, max_num_seqs=1,
                                                    speculation=policy, compile=False, dtype=args.dtype))
               for policy in ("fixed", "adaptive")}
    tokenizer = engines["fixed"].target.tokenizer
    sets = {"edit": edit_prompts(model_dir, args.prompts, tokenizer),
            "complete": heldout_prompts(model_dir, args.prompts, 64, tokenizer)}
    report = dict(models=str(model_dir), k=args.k, dtype=args.dtype, dtypes=resolved_dtypes(args.dtype),
                  prompts=args.prompts, max_tokens=args.max_tokens,
                  repeats=args.repeats, threads=1, sets={})
    for name, prompts in sets.items():
        rows: dict[str, list[dict]] = {row: [] for row in ROWS}
        for _ in range(args.repeats):  # rows interleaved, so drift on a shared machine hits all alike
            for row, (policy, method) in ROWS.items():
                rows[row].append(run_row(engines[policy], prompts, args.max_tokens, args.k, method))
                print(f"  {name} / {row}: {rows[row][-1]['tokens_per_s']:.1f} tok/s", file=sys.stderr, flush=True)
        plain = rows["plain"][0]["outputs"]
        out = {}
        for row, runs in rows.items():
            out[row] = {key: statistics.median(r[key] for r in runs) for key in runs[0] if key != "outputs"}
            out[row]["runs_tokens_per_s"] = [r["tokens_per_s"] for r in runs]
            out[row]["identical_to_plain"] = all(r["outputs"] == plain for r in runs)
        for r in out.values():
            r["over_plain"] = r["tokens_per_s"] / out["plain"]["tokens_per_s"]
        report["sets"][name] = dict(prompt_tokens_mean=statistics.mean(len(p) for p in prompts), rows=out)
    return report


def markdown(report: dict, command: str) -> str:
    lines = [f"Command: `{command}`", "",
             f"Models: `{report['models']}`, {dtypes_line(report)}batch 1, in process, k <= {report['k']}, {report['prompts']} prompts "
             f"per set, {report['max_tokens']} new tokens each (greedy, ignore EOS), median of {report['repeats']} "
             f"runs (rows interleaved), 1 torch thread. Plot: `{report.get('plot', 'ngram.png')}`.", ""]
    for name, s in report["sets"].items():
        lines += [f"**{name}** prompts (mean {s['prompt_tokens_mean']:.0f} tokens)", "",
                  "| row | tok/s | × plain | acceptance | tokens / round | mean k chosen | output = plain |",
                  "|---|---|---|---|---|---|---|"]
        for row, r in s["rows"].items():
            lines.append(f"| {row} | {r['tokens_per_s']:.1f} | {r['over_plain']:.2f}× | {r['acceptance_rate']:.2f} "
                         f"| {r['tokens_per_round']:.2f} | {r['mean_chosen_k']:.2f} "
                         f"| {'yes' if r['identical_to_plain'] else 'NO'} |")
        lines.append("")
    edit = report["sets"]["edit"]["rows"]
    lines.append(f"- n-gram / plain on edit prompts: {edit['n-gram, adaptive']['over_plain']:.2f}× adaptive, "
                 f"{edit['n-gram, fixed k']['over_plain']:.2f}× fixed (goal ≥ 1.3)")
    return "\n".join(lines) + "\n"


def plot(report: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4))
    names = list(report["sets"])
    rows = [r for r in ROWS if r != "plain"]
    width = 0.8 / len(rows)
    for i, row in enumerate(rows):
        ax.bar([j + i * width for j in range(len(names))],
               [report["sets"][n]["rows"][row]["over_plain"] for n in names], width, label=row)
    ax.axhline(1.0, color="gray", lw=1, ls="--")
    ax.set_xticks([j + width * (len(rows) - 1) / 2 for j in range(len(names))], [f"{n} prompts" for n in names])
    ax.set(ylabel="tok/s / plain tok/s", title="batch 1, in process")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="specserve bench ngram", description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=str(DEFAULT_MODEL_DIR))
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("-k", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    add_dtype_arg(p)
    p.add_argument("--out", type=out_prefix, default=str(REPO_ROOT / "docs" / "benchmarks" / "ngram"))
    args = p.parse_args(argv)
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    report = bench(args)
    report["plot"] = Path(args.out).name + ".png"  # named in the Markdown
    report["command"] = "specserve bench ngram " + " ".join(sys.argv[1:] if argv is None else argv)
    md = markdown(report, report["command"])
    Path(args.out + ".json").write_text(json.dumps(report, indent=1) + "\n")
    Path(args.out + ".md").write_text(md)
    plot(report, args.out + ".png")
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
