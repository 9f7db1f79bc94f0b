"""Diagnostic: the speculation cache's hit rate if preparing outcomes cost nothing, against the
fan-out F, on the demo pair (k = 4, batch 1). It separates what the drafter can guess from what
this CPU leaves time to prepare: the distributed bench measures the hit rate with real timing
(a branch not ready when the verifier answers is a miss); this counts a hit whenever the
round's real outcome is among the F outcomes the pipeline would prepare.

Each round, the drafter drafts d_1..d_k from the committed text (greedy: its argmax; sampled:
drawn from its q at temperature T), the target scores them and the acceptance rule gives the
outcome: a drafts accepted and the token c written at a. The rounds are the engine's (greedy:
identical output to plain decoding). The main outcome (all accepted, bonus = the drafter's
likeliest next token) comes first, then the others by P(exactly a accepted) times the drafter's
probability of the token (for a < k, its share of what d_{a+1} leaves), for a < k the drafter's
runner-up to d_{a+1} only (what `DraftModelProposer` keeps per position), for a = k the next
likeliest bonus tokens. Columns, by where P(a) comes from:

- "past shares": the share of past rounds with a accepted (decayed counts), the same for every
  round: `drafter_service/pipeline.py` until stop 41;
- "past shares, any token": the same with every token at every a as a candidate (how far a wider
  candidate set would go);
- "calibrated": this round's own P(a), from each draft's chance of acceptance given the drafter's
  probability of it (`AcceptanceCalibration`, learnt online): pipeline.py since stop 41;
- "calibrated, main not first": the same, the all-accepted outcome ranked like the others;
- "a known": a hit when c is among the drafter's F likeliest tokens at the real a (alternatives
  to d_{a+1}, or bonus tokens when a = k): the accepted length known in advance, a bound on any
  ranking of a.

The first round of each request is not counted (nothing prepared).

Models run through transformers (no cache), the target in --target-dtype (bfloat16, as `dtype:
auto` serves it on a CPU with bf16 GEMMs; its argmax agrees with the lean forward's at about 99%
of positions), the drafter in float32. Writes OUT.md, OUT.json and OUT.png:

    .venv/bin/python benchmarks/diagnostics/hit_ceiling.py --prompts 40
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

import torch

from specserve.benchmarks.endpoint import out_prefix, write_results
from specserve.config import DEFAULT_MODEL_DIR, REPO_ROOT
from specserve.drafter.pipeline import AcceptanceCalibration

FANOUTS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
TOP_ALTERNATIVES = 40  # tokens per position considered (bonus tokens; every alternative in "any token")


def next_probs(model, ids: list[int], last: int, temperature: float) -> torch.Tensor:
    """The model's next-token distributions at the last `last` positions of ids (greedy: T = 1 for ranking)."""
    logits = model(torch.tensor([ids])).logits[0, -last:].float()
    return torch.softmax(logits / (temperature or 1.0), dim=-1)


def accepted_distribution(counts: list[float]) -> list[float]:
    total = sum(counts) + len(counts)
    return [(c + 1) / total for c in counts]


def ranked_outcomes(drafts: list[int], q: torch.Tensor, p_a: list[float], any_token: bool,
                    main_first: bool = True) -> list[tuple[int, int]]:
    """(a, token) outcomes in the pipeline's order: the main one (all accepted, the likeliest
    bonus) first unless not main_first, then by rank."""
    k = len(drafts)
    top = torch.topk(q, TOP_ALTERNATIVES, dim=-1)
    bonus = top.indices[k].tolist()
    out = [(k, bonus[0])] if main_first else []
    cands = [(p_a[k] * float(q[k, t]), k, t) for t in (bonus[1:] if main_first else bonus)]
    for a in range(k):
        alts = [t for t in top.indices[a].tolist() if t != drafts[a]]
        share = max(1.0 - float(q[a, drafts[a]]), 1e-6)
        cands += [(p_a[a] * float(q[a, t]) / share, a, t) for t in (alts if any_token else alts[:1])]
    cands.sort(key=lambda c: -c[0])
    return out + [(a, t) for _, a, t in cands]


def simulate(target, drafter, prompt: list[int], max_tokens: int, k: int, temperature: float,
             counts: list[float], calibration: AcceptanceCalibration, gen: torch.Generator) -> list[dict]:
    """One request's rounds: each with the outcome, and its place in each ranking."""
    ids, rounds = list(prompt), []
    while len(ids) - len(prompt) < max_tokens:
        drafts = []
        for _ in range(k):
            q = next_probs(drafter, ids + drafts, 1, temperature)[0]
            t = int(q.argmax()) if not temperature else int(torch.multinomial(q, 1, generator=gen))
            drafts.append(t)
        q = next_probs(drafter, ids + drafts, k + 1, temperature)  # q at d_1..d_k and the bonus position
        p = next_probs(target, ids + drafts, k + 1, temperature)
        a = 0
        while a < k:
            x = drafts[a]
            if temperature:
                if float(torch.rand((), generator=gen)) >= min(1.0, float(p[a, x] / q[a, x])):
                    break
            elif int(p[a].argmax()) != x:
                break
            a += 1
        if a == k:
            c = int(p[k].argmax()) if not temperature else int(torch.multinomial(p[k], 1, generator=gen))
        elif not temperature:
            c = int(p[a].argmax())
        else:
            resid = (p[a] - q[a]).clamp(min=0)
            c = int(torch.multinomial(resid / resid.sum(), 1, generator=gen))
        p_a = accepted_distribution(counts)
        outcome = (a, c)
        rank = {}
        confidences = [float(q[i, t]) for i, t in enumerate(drafts)]
        p_round = calibration.accepted_distribution(confidences)
        for name, order in (("past shares", ranked_outcomes(drafts, q, p_a, False)),
                            ("past shares, any token", ranked_outcomes(drafts, q, p_a, True)),
                            ("calibrated", ranked_outcomes(drafts, q, p_round, False)),
                            ("calibrated, main not first", ranked_outcomes(drafts, q, p_round, False, main_first=False))):
            rank[name] = order.index(outcome) + 1 if outcome in order else None
        calibration.observe(confidences, a)
        if a == k:
            known = torch.topk(q[k], TOP_ALTERNATIVES).indices.tolist()
        else:
            known = [t for t in torch.topk(q[a], TOP_ALTERNATIVES).indices.tolist() if t != drafts[a]]
        rank["a known"] = known.index(c) + 1 if c in known else None
        rounds.append({"a": a, "rank": rank})
        for i in range(len(counts)):
            counts[i] *= 0.99
        counts[a] += 1
        ids += drafts[:a] + [c]
    return rounds[1:]  # the first round had nothing prepared


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=str(DEFAULT_MODEL_DIR))
    p.add_argument("--prompts", type=int, default=40)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("-k", type=int, default=4)
    p.add_argument("--temperature", type=float, default=0.8, help="the sampled run's (a greedy run always comes first)")
    p.add_argument("--target-dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--out", type=out_prefix, default=str(REPO_ROOT / "docs" / "benchmarks" / "hit_ceiling"))
    argv = list(sys.argv[1:] if argv is None else argv)
    args = p.parse_args(argv)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specserve.training.demo_pair import heldout_prompts
    torch.set_num_threads(1)
    models = Path(args.models)
    tok = AutoTokenizer.from_pretrained(models / "target")
    target = AutoModelForCausalLM.from_pretrained(models / "target", dtype=getattr(torch, args.target_dtype)).eval()
    drafter = AutoModelForCausalLM.from_pretrained(models / "drafter", dtype=torch.float32).eval()
    prompts = heldout_prompts(models, args.prompts, args.prompt_tokens, tok)  # the distributed bench's first 10
    report = {"k": args.k, "target_dtype": args.target_dtype, "prompts": len(prompts), "max_tokens": args.max_tokens, "fanouts": list(FANOUTS), "runs": {}}
    with torch.no_grad():
        for temperature in (0.0, args.temperature):
            counts, calibration = [0.0] * (args.k + 1), AcceptanceCalibration()
            gen, rounds = torch.Generator().manual_seed(0), []
            for prompt in prompts:
                rounds += simulate(target, drafter, prompt, args.max_tokens, args.k, temperature, counts,
                                   calibration, gen)
            n = len(rounds)
            run = {"rounds": n, "share_by_a": [sum(r["a"] == a for r in rounds) / n for a in range(args.k + 1)]}
            for name in ("past shares", "past shares, any token", "calibrated", "calibrated, main not first", "a known"):
                run[name] = [sum(r["rank"][name] is not None and r["rank"][name] <= f for r in rounds) / n
                             for f in FANOUTS]
            report["runs"]["greedy" if not temperature else f"sampled T = {temperature}"] = run
            print(run, flush=True)
    out = Path(args.out)
    report["png"] = out.name + ".png"
    command = "python benchmarks/diagnostics/hit_ceiling.py " + shlex.join(argv)
    write_results(str(out), report, markdown(report, command.strip()))  # the run's figures first, the plot after
    plot(report, str(out) + ".png")
    return 0


def markdown(report: dict, command: str) -> str:
    f = report["fanouts"]
    lines = [f"Command: `{command}`", "",
             f"Demo pair (transformers: the target in {report['target_dtype']}, the drafter in float32), k = {report['k']}, batch 1, {report['prompts']} held-out prompts of "
             f"64 tokens, {report['max_tokens']} new tokens each. The hit rate the speculation cache would have if "
             "preparing F outcomes cost nothing: a round hits when its real outcome is among the F the pipeline "
             "ranks first (see the script's docstring). The first round of each request is not counted.", ""]
    for name, run in report["runs"].items():
        lines += [f"**{name}** ({run['rounds']} rounds; share of rounds by drafts accepted a = 0..{report['k']}: "
                  + ", ".join(f"{s:.2f}" for s in run["share_by_a"]) + ")", "",
                  "| candidates | " + " | ".join(f"F = {x}" for x in f) + " |",
                  "|---|" + "---|" * len(f)]
        for col in ("past shares", "past shares, any token", "calibrated", "calibrated, main not first", "a known"):
            lines.append(f"| {col} | " + " | ".join(f"{h:.2f}" for h in run[col]) + " |")
        lines.append("")
    lines += [f"![hit rate against fan-out]({report['png']})"]
    return "\n".join(lines) + "\n"


def plot(report: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    for i, (name, run) in enumerate(report["runs"].items()):
        for col, style in (("past shares", "--"), ("calibrated", "-"), ("a known", ":")):
            ax.plot(report["fanouts"], run[col], style, color=f"C{i}", marker=".", label=f"{name}: {col}")
    ax.axhline(0.85, color="gray", lw=0.8)
    ax.set(xscale="log", xlabel="fan-out F (outcomes prepared per round)", ylabel="hit rate, preparation free",
           title="speculation cache: hit-rate ceiling, demo pair, k = 4", ylim=(0, 1))
    ax.set_xticks(report["fanouts"], [str(x) for x in report["fanouts"]])
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
