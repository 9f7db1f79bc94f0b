"""Benchmarks (commands, not tests). `specserve bench distributed` runs, on the same prompts:

  1. target only, in process          3. distributed (Ray + gRPC), sequential
  2. the in-process speculative engine 4. distributed, pipelined (default policy "all-accepted";
                                          4b: policy "most-likely")

with one torch thread per model, and reports tokens/s, mean acceptance length, target passes per
token, pipeline hit rate and each row's speedup over row 1 (medians over repeats, all measured in
one run), plus the ideal speedup for the measured acceptance rate:
E(alpha, k) * T_target(1 token) / T_target(k + 1 tokens), E = (1 - alpha^(k+1)) / (1 - alpha).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import torch

from specserve.benchmarks.endpoint import out_prefix
from specserve.benchmarks.serve import int_list
from specserve.config import DEFAULT_MODEL_DIR, REPO_ROOT
from specserve.core.proposer import MAX_K
from specserve.training.demo_pair import heldout_prompts

RESULTS_DIR = REPO_ROOT / "docs" / "benchmarks"
OWN_PARSER_BENCHES = {"soak": "sustained load on the HTTP endpoint, drafter kills, memory over time",
                      "fuzz": "generated bad requests against the HTTP endpoint: no 5xx",
                      "gpu": "the prepared GPU check (--dry-run: the same on the CPU, small)",
                      "wire": "size and encode/decode time of q on the wire",
                      "forward": "pass time of the lean forward, with and without the CPU GEMM plan",
                      "dtype": "pass time of the lean forward by dtype, batch and width; same bits at every width",
                      "runtime": "our model runtime against vLLM (--vllm-python), one run: batch 1, speculative, batched",
                      "serve": "load generator on the HTTP endpoint: Poisson rates, concurrency sweeps, pairs, SLOs",
                      "ngram": "the n-gram proposer and the adaptive policy at batch 1, on edit and completion prompts",
                      "peers": "ours, vLLM and HF assisted generation on the same prompts, batch 1 and 8",
                      "draft-vocab": "the drafter's draft vocabulary against its whole head, batch 1",
                      "overhead": "batch 1: in process, distributed and served (openai client), plain and speculative",
                      "rounds": "batch 1: Propose round trip (unary, stream) and the round's outcome sent early or not"}


def check_draft_k(p: argparse.ArgumentParser, k: int) -> None:
    """-k of a bench whose speculative rows need a drafter (k 0 gave a pair without one, and its
    rows failed; the plain rows run k = 0 themselves)."""
    if not 1 <= k <= MAX_K:
        p.error(f"-k must be in [1, {MAX_K}], got {k}")


def add_dtype_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"),
                   help="both models' dtype (auto: as served, see specserve.core.runner.resolve_dtype)")


def resolved_dtypes(dtype: str) -> dict[str, str]:
    """What `dtype` gives the target and the drafter on this machine's CPU (a model the lean
    forward packs; "auto" gives such a drafter a bfloat16 head: see resolve_dtype)."""
    from specserve.core.runner import auto_bf16_head, resolve_dtype
    cpu = torch.device("cpu")
    return {role: str(resolve_dtype(dtype, cpu, role=role)).removeprefix("torch.")
            + (" with a bfloat16 head" if auto_bf16_head(dtype, cpu, role) else "") for role in ("target", "drafter")}


def dtypes_line(report: dict) -> str:
    d = report.get("dtypes")
    return f"dtype {report.get('dtype', 'auto')}: target {d['target']}, drafter {d['drafter']}. " if d else ""


def ideal_speedup(alpha: float, k: int, t1: float, tk1: float) -> float:
    expected = (1 - alpha ** (k + 1)) / (1 - alpha) if alpha < 1 else k + 1
    return expected * t1 / tk1


def time_target_pass(runner, prompt: list[int], n_tokens: int, reps: int = 30) -> float:
    """Median seconds of one target forward that scores n_tokens new positions after `prompt`."""
    times = []
    runner.prefill(prompt)
    for _ in range(reps):
        t0 = time.perf_counter()
        runner.score(prompt[:n_tokens])
        times.append(time.perf_counter() - t0)
        runner.rollback(n_tokens)
    runner.release()
    return statistics.median(times)


def time_preparation(drafter_path: str, prompt: list[int], k: int, fanouts: list[int], reps: int = 30,
                     dtype: str = "auto") -> dict:
    """Median ms the drafter takes, in process, to prepare one sequence's next round (pipelining's
    `speculate`) for each fan-out: to pay, it must fit in the target's verification pass."""
    from specserve.core.proposer import ProposeItem
    from specserve.core.runner import ModelRunner
    from specserve.core.sampling import SamplingParams
    from specserve.drafter.draft_model import DraftModelProposer
    from specserve.drafter.pipeline import PipelinedProposer
    out = {}
    for f in fanouts:
        runner = ModelRunner.from_pretrained(drafter_path, name="drafter", role="drafter", slots=f, dtype=dtype)
        p = PipelinedProposer(DraftModelProposer(runner, branch_slots=f - 1), fanout=f)
        p.start("s", prompt, SamplingParams(seed=0))
        d = p.propose([ProposeItem("s", [], k)])[0]
        times = []
        for i in range(reps):
            t0 = time.perf_counter()
            p.speculate(["s"])
            times.append(time.perf_counter() - t0)
            d = p.propose([ProposeItem("s", d.tokens[:1] + [prompt[i % len(prompt)]], k)])[0]  # a rejection: a miss
        out[f] = statistics.median(times) * 1e3
    return out


def measure(generate, prompts, max_tokens: int, k: int, sampling=None) -> dict:
    """One pass over all prompts (greedy unless `sampling`): throughput and speculation statistics."""
    from specserve.core.sampling import SamplingParams
    tokens = passes = drafts = accepted = drafted = hits = prepared_rounds = prepared = 0
    by_outcome = [[0, 0] for _ in range(k + 1)]  # drafted rounds, hits by drafts accepted the round before
    t0 = time.perf_counter()
    for p in prompts:
        r = generate(p, max_tokens, sampling or SamplingParams(), k)
        tokens += len(r.token_ids)
        prepared_rounds += r.stats.num_prepared_rounds
        prepared += r.stats.num_prepared_outcomes
        passes += r.stats.num_target_passes
        drafts += r.stats.num_drafts
        drafted += r.stats.num_draft_tokens
        accepted += r.stats.num_accepted_tokens
        hits += r.stats.num_pipeline_hits
        for a, (n, h) in enumerate(zip(r.stats.outcome_rounds, r.stats.outcome_hits)):
            by_outcome[a][0] += n
            by_outcome[a][1] += h
    elapsed = time.perf_counter() - t0
    return dict(tokens_per_s=tokens / elapsed, passes_per_token=passes / tokens,
                mean_acceptance_length=1 + accepted / drafts if drafts else 1.0,
                acceptance_rate=accepted / drafted if drafted else 0.0,
                pipeline_hit_rate=hits / drafts if drafts else 0.0,
                # over the rounds after each request's first (which nothing was prepared for), as hit_ceiling counts
                pipeline_hit_rate_later=hits / sum(x[0] for x in by_outcome) if sum(x[0] for x in by_outcome) else 0.0,
                fanout_used=prepared / prepared_rounds if prepared_rounds else 0.0,
                **{f"hit_rate_after_{a}_accepted": h / n if n else 0.0 for a, (n, h) in enumerate(by_outcome)},
                **{f"share_after_{a}_accepted": n / max(sum(x[0] for x in by_outcome), 1)
                   for a, (n, h) in enumerate(by_outcome)})


def run_rows(rows: dict, prompts, max_tokens: int, k: int, repeats: int, sampling: dict | None = None) -> dict:
    """rows: name -> factory() returning (generate, close) or (generate, close, probe);
    generate(prompt_ids, max_tokens, sampling, k) returns a GenerationResult; probe() returns a
    flat dict of counters (round times), whose growth over the timed runs the row's result keeps
    as "probe". Every row is started (and warmed up) before any is timed, and the rows' runs are
    interleaved, so the machine's drift over minutes hits every row alike (timed one after
    another, rows differed more between runs than from each other). sampling: name ->
    SamplingParams for rows that sample (default greedy)."""
    from specserve.core.sampling import SamplingParams
    started, per_run, probed = {}, {name: [] for name in rows}, {}
    try:
        for name, factory in rows.items():
            started[name] = factory()
            started[name][0](prompts[0], 8, SamplingParams(), k)  # warm-up
        for rep in range(repeats):
            for name, (generate, _, *probe) in started.items():
                before = probe[0]() if probe else None
                per_run[name].append(measure(generate, prompts, max_tokens, k, (sampling or {}).get(name)))
                if probe:
                    grown = Counter(probe[0]())
                    grown.subtract(before)
                    probed.setdefault(name, Counter()).update(grown)
                print(f"  {name}: {per_run[name][-1]['tokens_per_s']:.1f} tok/s", file=sys.stderr, flush=True)
    finally:
        for _, close, *_ in started.values():
            close()
    results = {}
    for name, runs in per_run.items():
        results[name] = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
        results[name]["runs_tokens_per_s"] = [r["tokens_per_s"] for r in runs]
        if name in probed:
            results[name]["probe"] = dict(probed[name])
    base = results[next(iter(results))]["tokens_per_s"]
    for r in results.values():
        r["speedup"] = r["tokens_per_s"] / base
    return results


def round_probe(verifier_times, drafter_times=None):
    """A run_rows probe: the engine's round times (RoundTimes.to_dict() from `verifier_times()`)
    and, for a remote drafter, its server's (DrafterTimes.to_dict() from `drafter_times()`),
    flattened."""
    def probe() -> dict:
        v = verifier_times()
        out = {"rounds": v["rounds"], **{f"verifier_{p}": s for p, s in v["seconds"].items()}}
        if drafter_times is not None:
            d = drafter_times()
            out.update(drafter_proposes=d["proposes"], drafter_preparations=d["preparations"],
                       **{f"drafter_{p}": s for p, s in d["seconds"].items()})
        return out
    return probe


def init_ray(actors: int) -> None:
    """A local Ray with logical CPUs for `actors` one-CPU actors at once (each runs one torch thread)."""
    import ray

    from specserve.cluster.pair import start_ray
    if not ray.is_initialized():
        start_ray(num_cpus=actors + 2)


def bench_distributed(args) -> dict:
    import ray

    from specserve.cluster.pair import SpeculativePair
    from specserve.core.runner import ModelRunner
    from specserve.core.sampling import SamplingParams
    from specserve.drafter.draft_model import DraftModelProposer
    from specserve.verifier.engine import SpeculativeEngine

    torch.set_num_threads(1)
    model_dir = Path(args.models)
    target_path, drafter_path = str(model_dir / "target"), str(model_dir / "drafter")
    target = ModelRunner.from_pretrained(target_path, name="target", dtype=args.dtype)
    drafter = ModelRunner.from_pretrained(drafter_path, name="drafter", role="drafter", dtype=args.dtype)
    prompts = heldout_prompts(model_dir, args.prompts, args.prompt_tokens, target.tokenizer)
    plain = SpeculativeEngine(target, None)
    spec = SpeculativeEngine(target, DraftModelProposer(drafter))
    t1 = time_target_pass(target, prompts[0], 1)
    tk1 = time_target_pass(target, prompts[0], args.k + 1)
    fanouts = args.fanout
    prepare_ms = time_preparation(drafter_path, prompts[0], args.k, sorted({1, *fanouts}), dtype=args.dtype)

    def distributed(pipeline, fanout=1):
        def factory():
            pair = SpeculativePair(target_path, drafter_path, pipeline=pipeline, cpus_per_actor=1, speculation="fixed",
                                   fanout=fanout, dtype=args.dtype, k=args.k)
            return pair.generate, pair.shutdown, round_probe(lambda: ray.get(pair.verifier.times.remote()),
                                                             lambda: ray.get(pair.drafter.actor.times.remote()))
        return factory

    rows = {"1 target only (in process)": lambda: (plain.generate, lambda: None),
            "2 speculative (in process)": lambda: (spec.generate, lambda: None, round_probe(spec.times.to_dict)),
            "3 distributed, sequential": distributed(False),
            "4 distributed, pipelined": distributed("all-accepted"),
            "4b distributed, pipelined (most-likely policy)": distributed("most-likely"),
            **{f"5 distributed, pipelined, fan-out {f}": distributed("all-accepted", f) for f in fanouts},
            f"6 distributed, pipelined, fan-out {fanouts[-1]}, sampled T = 0.8": distributed("all-accepted",
                                                                                            fanouts[-1])}
    sampled = {name: SamplingParams(temperature=0.8, seed=0) for name in rows if name.startswith("6 ")}
    init_ray(2 * (len(rows) - 2))
    results = run_rows(rows, prompts, args.max_tokens, args.k, args.repeats, sampled)
    alpha = results["2 speculative (in process)"]["acceptance_rate"]
    ideal = ideal_speedup(alpha, args.k, t1, tk1)
    # the E(alpha, k) takes drafts as accepted independently; they are not (a round keeps all k or
    # few), so the tokens a pass writes, measured, make a higher ideal
    measured_ideal = results["2 speculative (in process)"]["mean_acceptance_length"] * t1 / tk1
    return dict(models=str(model_dir), k=args.k, prompts=len(prompts), prompt_tokens=args.prompt_tokens,
                max_tokens=args.max_tokens, repeats=args.repeats, threads_per_model=1,
                dtype=args.dtype, dtypes=resolved_dtypes(args.dtype),
                t_target_1_ms=t1 * 1e3, t_target_k1_ms=tk1 * 1e3, alpha=alpha, ideal_speedup=ideal,
                pipelined_fraction_of_ideal=results["4 distributed, pipelined"]["speedup"] / ideal,
                measured_ideal_speedup=measured_ideal,
                pipelined_fraction_of_measured_ideal=results["4 distributed, pipelined"]["speedup"] / measured_ideal,
                pipelined_over_sequential=results["4 distributed, pipelined"]["tokens_per_s"]
                / results["3 distributed, sequential"]["tokens_per_s"],
                fanout=fanouts, prepare_ms=prepare_ms, best_fanout=max([1, *fanouts], key=lambda f: results[
                    "4 distributed, pipelined" if f == 1 else f"5 distributed, pipelined, fan-out {f}"]["tokens_per_s"]),
                distributed_overhead=1 - results["3 distributed, sequential"]["tokens_per_s"]
                / results["2 speculative (in process)"]["tokens_per_s"],
                rows=results)


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))] if values else float("nan")


def closed_loop(pair, prompts, concurrency: int, total: int, max_tokens: int, k: int) -> list[dict]:
    """`total` greedy requests (prompts in turn), `concurrency` in flight at a time: a finished
    one is replaced at once. Returns the verifier's outputs."""
    import ray

    from specserve.core.sampling import SamplingParams
    submitted, in_flight, outs = 0, [], []
    while len(outs) < total:
        while submitted < total and len(in_flight) < concurrency:
            in_flight.append(pair.submit(prompts[submitted % len(prompts)], max_tokens, SamplingParams(), k,
                                         ignore_eos=True))
            submitted += 1
        done, in_flight = ray.wait(in_flight, num_returns=1)
        outs += ray.get(done)
    return outs


CONTROL = "plain, control"  # the batching bench's second plain pair
COLOCATED = "adaptive, colocated"  # the batching bench's optional row (--colocated): no drafter actor


def cpu_seconds(pair) -> tuple[float, float]:
    """CPU seconds so far of the pair's verifier process and drafter process (0: none)."""
    import ray
    refs = [pair.verifier.cpu_seconds.remote()] + ([pair.drafter.actor.cpu_seconds.remote()] if pair.drafter else [])
    got = ray.get(refs)
    return got[0], (got[1] if len(got) > 1 else 0.0)


def bench_batching(args) -> dict:
    """Aggregate tokens/s and inter-token latency at each concurrency, for batched plain decoding
    (k = 0 through the same loop) and batched speculation, sequential and pipelined. A second
    plain pair ("plain, control": the same configuration in actors of its own) measures how far
    two identical rows part in this run: the noise any ratio to plain carries."""
    import ray

    from specserve.cluster.pair import SpeculativePair
    from specserve.core.runner import load_tokenizer
    from specserve.core.sampling import SamplingParams

    model_dir = Path(args.models)
    target_path, drafter_path = str(model_dir / "target"), str(model_dir / "drafter")
    levels = args.concurrency
    per_run = {c: max(args.waves * c, args.min_requests) for c in levels}  # requests per run of a level
    prompts = heldout_prompts(model_dir, max(per_run.values()), args.prompt_tokens, load_tokenizer(target_path))
    modes = {"plain": (False, 0, "fixed"), "speculative, sequential": (False, args.k, "fixed"),
             "speculative, pipelined": (True, args.k, "fixed"), "adaptive, pipelined": (True, args.k, "adaptive"),
             CONTROL: (False, 0, "fixed")}
    if args.colocated:  # the adaptive policy with the drafter in the verifier's process
        modes[COLOCATED] = (False, args.k, "adaptive")
    init_ray(2 * len(modes))
    pairs: dict[str, SpeculativePair] = {}
    rows: dict[str, dict] = {mode: {} for mode in modes}
    try:  # every pair is up before any is timed; at each level the modes' runs are interleaved
        for mode, (pipeline, k, policy) in modes.items():
            pairs[mode] = SpeculativePair(target_path, drafter_path, pipeline=pipeline, cpus_per_actor=1,
                                          max_num_seqs=max(levels), max_waiting=max(levels), speculation=policy,
                                          dtype=args.dtype, colocate=mode == COLOCATED, k=args.k)
            # warm-up: one full-length request (compiles, and gives the adaptive policy some rounds)
            ray.get(pairs[mode].submit(prompts[0], args.max_tokens, SamplingParams(), k, ignore_eos=True))
        for c in levels:
            runs = {mode: [] for mode in modes}
            itl = {mode: [] for mode in modes}
            by_k = {mode: Counter() for mode in modes}
            phases = {mode: Counter() for mode in modes}  # the engine loop's seconds by phase, and rounds
            seq_rounds = Counter()  # sequence-rounds per row (over its engine rounds: the mean batch)
            for repeat in range(args.repeats):
                # every other round of runs in the reverse order: a drift of the machine's speed
                # over the level's runs then hits every row alike on average (the median of two)
                order = list(modes.items()) if repeat % 2 == 0 else list(modes.items())[::-1]
                for mode, (_, k, _) in order:
                    before, cpu_before = ray.get(pairs[mode].verifier.times.remote()), cpu_seconds(pairs[mode])
                    t0 = time.perf_counter()
                    outs = closed_loop(pairs[mode], prompts, c, per_run[c], args.max_tokens, k)
                    elapsed = time.perf_counter() - t0
                    after, cpu_after = ray.get(pairs[mode].verifier.times.remote()), cpu_seconds(pairs[mode])
                    phases[mode].update({p: after["seconds"][p] - before["seconds"][p] for p in after["seconds"]})
                    phases[mode]["pass_cpu"] += after["pass_cpu"] - before["pass_cpu"]
                    for actor, t1, t0_ in zip(("verifier_cpu", "drafter_cpu"), cpu_after, cpu_before):
                        phases[mode][actor] += t1 - t0_
                    phases[mode]["rounds"] += after["rounds"] - before["rounds"]
                    phases[mode]["wall"] += elapsed
                    runs[mode].append(sum(len(o["token_ids"]) for o in outs) / elapsed)
                    for o in outs:
                        by_k[mode].update(dict(enumerate(o["stats"]["rounds_by_k"])))
                        seq_rounds[mode] += o["stats"]["num_rounds"]
                        last = None
                        for t, n in o["chunks"]:
                            if last is not None:
                                itl[mode] += [(t - last) / n] * n
                            last = t
            for mode, (_, _, policy) in modes.items():
                rows[mode][c] = dict(tokens_per_s=statistics.median(runs[mode]), runs_tokens_per_s=runs[mode],
                                     itl_p50_ms=percentile(itl[mode], 0.5) * 1e3,
                                     itl_p99_ms=percentile(itl[mode], 0.99) * 1e3,
                                     rounds_by_k=[by_k[mode][i] for i in range(args.k + 1)],
                                     mean_chosen_k=sum(i * n for i, n in by_k[mode].items())
                                     / max(sum(by_k[mode].values()), 1),
                                     rounds=phases[mode]["rounds"],
                                     requests_per_run=per_run[c],
                                     mean_batch=seq_rounds[mode] / max(phases[mode]["rounds"], 1),
                                     ms_per_round={p: 1e3 * v / max(phases[mode]["rounds"], 1)
                                                   for p, v in phases[mode].items() if p != "rounds"})
                if policy == "adaptive":  # what the policy believed at the end of this level
                    rows[mode][c]["policy"] = ray.get(pairs[mode].verifier.policy.remote())
                print(f"  {mode} @ {c}: {rows[mode][c]['tokens_per_s']:.1f} tok/s", file=sys.stderr, flush=True)
    finally:
        for pair in pairs.values():
            pair.shutdown()
    crossover = None
    for c in levels:
        best = max(rows["speculative, sequential"][c]["tokens_per_s"], rows["speculative, pipelined"][c]["tokens_per_s"])
        if best < rows["plain"][c]["tokens_per_s"]:
            crossover = c
            break
    adaptive = {c: rows["adaptive, pipelined"][c]["tokens_per_s"] / rows["plain"][c]["tokens_per_s"] for c in levels}
    control = {c: rows[CONTROL][c]["tokens_per_s"] / rows["plain"][c]["tokens_per_s"] for c in levels}
    return dict(models=str(model_dir), k=args.k, dtype=args.dtype, dtypes=resolved_dtypes(args.dtype),
                prompt_tokens=args.prompt_tokens, max_tokens=args.max_tokens,
                repeats=args.repeats, min_requests=args.min_requests, waves=args.waves, concurrency=levels, rows=rows, speculation_stops_paying_at=crossover,
                adaptive_over_plain=adaptive, adaptive_worst=min(adaptive.values()), control_over_plain=control,
                **({"colocated_over_plain": {c: rows[COLOCATED][c]["tokens_per_s"] / rows["plain"][c]["tokens_per_s"]
                                             for c in levels}} if COLOCATED in rows else {}))


def plot_batching(report: dict, path: str) -> None:
    """Throughput over plain by concurrency, and the k the adaptive policy chose."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels, rows = report["concurrency"], report["rows"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for mode in ("speculative, sequential", "speculative, pipelined", "adaptive, pipelined", CONTROL, COLOCATED):
        if mode not in rows:
            continue
        a.plot(levels, [rows[mode][c]["tokens_per_s"] / rows["plain"][c]["tokens_per_s"] for c in levels], "o-",
               label=mode)
    a.axhline(1.0, color="gray", lw=1, ls="--", label="plain")
    a.set(xscale="log", xlabel="concurrency", ylabel="tok/s / plain tok/s", title="speculation over plain decoding")
    a.set_xticks(levels, [str(c) for c in levels])
    a.legend()
    b.plot(levels, [rows["adaptive, pipelined"][c]["mean_chosen_k"] for c in levels], "o-", color="C2")
    b.set(xscale="log", xlabel="concurrency", ylabel="mean k chosen per round", ylim=(0, report["k"] + 0.5),
          title=f"adaptive policy (k <= {report['k']})")
    b.set_xticks(levels, [str(c) for c in levels])
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def markdown_batching(report: dict, command: str) -> str:
    lines = [f"Command: `{command}`", "",
             f"Models: `{report['models']}`, {dtypes_line(report)}k = {report['k']}, prompts of {report['prompt_tokens']} held-out "
             f"tokens, {report['max_tokens']} new tokens each (greedy, ignore_eos), median of {report['repeats']} "
             f"runs; each run of a level is max({report.get('waves', 1)} × concurrency, {report.get('min_requests', 0)}) "
             "requests, concurrency of them in flight (closed loop: a finished one is replaced at once), after one "
             "full-length warm-up request per row; one verifier and "
             "one drafter actor per row, 1 torch thread each; every row's pair is up before any is timed, and at "
             "each level the rows' runs are interleaved, every other round of runs in the reverse order.", "",
             "Rows: plain (k = 0); fixed k, sequential and pipelined; the adaptive policy (`speculation: adaptive`, "
             f"k <= {report['k']}), pipelined; and a control: a second plain pair, the same configuration as "
             "the first in actors of its own, run last in the first round of runs (its ratio to plain is the "
             "spread between two identical rows in this run). "
             f"Plot: `{report.get('plot', 'batching.png')}`.", "",
             "| concurrency | plain tok/s | sequential tok/s (× plain) | pipelined tok/s (× plain) "
             "| adaptive tok/s (× plain) | adaptive mean k | control tok/s (× plain) "
             "| ITL p50 / p99 ms: plain | sequential | pipelined | adaptive |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    rows = report["rows"]
    control = rows.get(CONTROL)
    for c in report["concurrency"]:
        p, s, q, a = (rows[m][c] for m in ("plain", "speculative, sequential", "speculative, pipelined",
                                          "adaptive, pipelined"))
        ctl = f"{control[c]['tokens_per_s']:.1f} ({control[c]['tokens_per_s'] / p['tokens_per_s']:.2f}×)" \
            if control else "–"
        lines.append(f"| {c} | {p['tokens_per_s']:.1f} | {s['tokens_per_s']:.1f} ({s['tokens_per_s'] / p['tokens_per_s']:.2f}×) "
                     f"| {q['tokens_per_s']:.1f} ({q['tokens_per_s'] / p['tokens_per_s']:.2f}×) "
                     f"| {a['tokens_per_s']:.1f} ({a['tokens_per_s'] / p['tokens_per_s']:.2f}×) | {a['mean_chosen_k']:.2f} "
                     f"| {ctl} "
                     f"| {p['itl_p50_ms']:.1f} / {p['itl_p99_ms']:.1f} | {s['itl_p50_ms']:.1f} / {s['itl_p99_ms']:.1f} "
                     f"| {q['itl_p50_ms']:.1f} / {q['itl_p99_ms']:.1f} | {a['itl_p50_ms']:.1f} / {a['itl_p99_ms']:.1f} |")
    from specserve.verifier.engine import PHASES
    if "ms_per_round" in rows["plain"][report["concurrency"][0]]:
        lines += ["", "Where a round's time goes (the engine loop's ms per round, summed over the level's runs; "
                  "`wall`: the client's time over rounds, so wall minus the phases is the loop idle or between "
                  "rounds; see `RoundTimes` in verifier_service/engine.py):", "",
                  "| concurrency | row | rounds | mean batch | " + " | ".join(PHASES) + " | wall |",
                  "|---|---|---|---|" + "---|" * (len(PHASES) + 1)]
        for c in report["concurrency"]:
            for m in rows:
                r = rows[m][c]
                batch = f"{r['mean_batch']:.1f}" if "mean_batch" in r else "–"
                lines.append(f"| {c} | {m} | {r['rounds']} | {batch} | "
                             + " | ".join(f"{r['ms_per_round'].get(ph, 0.0):.2f}" for ph in PHASES)
                             + f" | {r['ms_per_round']['wall']:.2f} |")
        if "pass_cpu" in rows["plain"][report["concurrency"][0]]["ms_per_round"]:
            lines += ["", "CPU per round (ms): the target pass's wall time and the loop thread's CPU time in it "
                      "(a gap: the pass waited for the CPU or the GIL), and the CPU time of the verifier's and "
                      "the drafter's whole processes over the level's runs, per round:", "",
                      "| concurrency | row | pass wall | pass CPU | verifier process CPU | drafter process CPU |",
                      "|---|---|---|---|---|---|"]
            for c in report["concurrency"]:
                for m in rows:
                    t = rows[m][c]["ms_per_round"]
                    lines.append(f"| {c} | {m} | {t['pass']:.2f} | {t['pass_cpu']:.2f} | {t['verifier_cpu']:.2f} "
                                 f"| {t['drafter_cpu']:.2f} |")
    stop = report["speculation_stops_paying_at"]
    lines += ["", f"- fixed-k speculation stops paying at concurrency: "
              f"{stop if stop is not None else 'not within the range measured'}",
              f"- adaptive / plain: worst {report['adaptive_worst']:.2f}× (goal ≥ 0.95 at every concurrency), "
              f"{report['adaptive_over_plain'][report['concurrency'][0]]:.2f}× at concurrency "
              f"{report['concurrency'][0]} (goal ≥ 1.4)"]
    if "control_over_plain" in report:
        ctl = report["control_over_plain"]
        lines += [f"- control / plain (two identical plain pairs): {min(ctl.values()):.2f}×–{max(ctl.values()):.2f}× "
                  "(" + ", ".join(f"{ctl[c]:.2f}× at {c}" for c in report["concurrency"]) + "): a ratio to plain "
                  "in this run is only as sure as this spread"]
    if "colocated_over_plain" in report:
        col, rows_c = report["colocated_over_plain"], report["rows"][COLOCATED]
        lines += [f"- {COLOCATED} (`--colocated`: the adaptive policy, the drafter in the verifier's process, no "
                  "drafter actor, no gRPC, no pipelining) / plain: "
                  + ", ".join(f"{col[c]:.2f}× at {c} (mean k {rows_c[c]['mean_chosen_k']:.2f})" for c in report["concurrency"])]
    return "\n".join(lines) + "\n"


def round_split_table(rows: dict) -> list[str]:
    """Markdown lines: where a round goes in the rows with a probe (ms per round over the timed
    runs), the verifier's wait for drafts set against the drafter server's handler time."""
    probed = {name: r["probe"] for name, r in rows.items() if r.get("probe", {}).get("rounds")}
    if not probed:
        return []
    lines = ["", "Where a round goes (ms per round over the timed runs). `wait`: the verifier's propose call and "
             "its wait for drafts asked for early (in process: the drafting itself); `other`: the loop's other "
             "phases (bookkeeping with the early send, admission, starts, releases); `pass`: the target pass. "
             "`handler`: the drafter server's Propose handlers, from the request's arrival to its reply built, "
             "of which `lock` waited for the model lock and `draft` drafted; `prep`: its background preparations. "
             "`wire`: the transport and the hand-offs on both sides, bounded: the round trip starts at the early "
             "send, inside `other`, so it lies between wait and wait + other, and wire between those minus the "
             "handler.", "",
             "| row | rounds | wait | other | pass | handler | lock | draft | prep | wire |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, p in probed.items():
        ms = {key: 1e3 * value / p["rounds"] for key, value in p.items() if key != "rounds"}
        wait = ms["verifier_draft"] + ms["verifier_early_wait"]
        other = sum(v for key, v in ms.items() if key.startswith("verifier_")) - wait - ms["verifier_pass"]
        remote = ["–"] * 5
        if "drafter_handler" in ms:
            h = ms["drafter_handler"]
            remote = [f"{h:.2f}", f"{ms['drafter_lock_wait']:.2f}", f"{ms['drafter_propose']:.2f}",
                      f"{ms['drafter_prepare']:.2f}", f"{max(wait - h, 0.0):.2f}-{wait + other - h:.2f}"]
        lines.append(f"| {name} | {p['rounds']} | {wait:.2f} | {other:.2f} | {ms['verifier_pass']:.2f} | "
                     + " | ".join(remote) + " |")
    return lines


def markdown(report: dict, command: str) -> str:
    lines = [f"Command: `{command}`", "",
             f"Models: `{report['models']}`, {dtypes_line(report)}k = {report['k']}, {report['prompts']} prompts of "
             f"{report['prompt_tokens']} tokens, {report['max_tokens']} new tokens each (greedy), "
             f"median of {report['repeats']} runs, 1 torch thread per model; every row is up before any is "
             "timed, and the rows' runs are interleaved.", "",
             "Rows 5: the speculation cache (the drafter prepares up to F outcomes per round: the all-accepted one "
             "and the likeliest others on branch slots); row 6 samples (temperature 0.8, seed 0 for every request). "
             "The drafter server stops a preparation between passes when the verifier comes back with an outcome "
             "it does not cover.", "",
             "| row | tokens/s | speedup vs row 1 | mean acceptance length | target passes / token | pipeline hit rate "
             "| fan-out used |",
             "|---|---|---|---|---|---|---|"]
    for name, r in report["rows"].items():
        lines.append(f"| {name} | {r['tokens_per_s']:.1f} | {r['speedup']:.2f}× | {r['mean_acceptance_length']:.2f} "
                     f"| {r['passes_per_token']:.3f} | {r['pipeline_hit_rate']:.2f} | {r.get('fanout_used', 0):.2f} |")
    lines += ["", f"- acceptance rate alpha = {report['alpha']:.3f}; T_target(1) = {report['t_target_1_ms']:.2f} ms, "
              f"T_target({report['k'] + 1}) = {report['t_target_k1_ms']:.2f} ms (same run)",
              f"- ideal speedup E(alpha, k) × T(1)/T(k+1) = {report['ideal_speedup']:.2f}×; "
              f"row 4 reaches {report['pipelined_fraction_of_ideal']:.0%} of it"
              + (f"; E(alpha, k) takes drafts as accepted independently, and with the tokens a pass writes, measured "
                 f"(row 2's mean acceptance length), the ideal is {report['measured_ideal_speedup']:.2f}×, row 4 at "
                 f"{report['pipelined_fraction_of_measured_ideal']:.0%} of it" if "measured_ideal_speedup" in report else ""),
              f"- row 4 / row 3 (pipelined over sequential) = {report['pipelined_over_sequential']:.2f}×",
              f"- distributed overhead (row 3 against row 2) = {report['distributed_overhead']:.1%}"]
    later = {name: r["pipeline_hit_rate_later"] for name, r in report["rows"].items() if r.get("pipeline_hit_rate_later")}
    if later:  # (the column divides by every drafted round; a request's first is never a hit)
        lines.append("- pipeline hit rate over the rounds after each request's first (the rounds a preparation can "
                     "serve, as hit_ceiling.md counts them): " + "; ".join(f"row {n.split()[0]}"
                     + (f" fan-out {n.split()[-1]}" if n.startswith("5 ") else "") + f" {h:.2f}"
                     for n, h in later.items()))
    fanouts = report.get("fanout", [])
    if "prepare_ms" in report:
        lines += ["- the drafter's time to prepare a round (in process, one sequence), by fan-out: "
                  + ", ".join(f"{f}: {ms:.1f} ms" for f, ms in report["prepare_ms"].items())
                  + f"; the target's verification pass it hides behind: {report['t_target_k1_ms']:.1f} ms"]
    if fanouts:
        f = report["best_fanout"]
        best = report["rows"]["4 distributed, pipelined" if f == 1 else f"5 distributed, pipelined, fan-out {f}"]
        lines += [f"- fastest fan-out (rows 4 and 5): {report['best_fanout']} ({best['tokens_per_s'] / report['rows']['3 distributed, sequential']['tokens_per_s']:.2f}× "
                  f"row 3, {best['speedup'] / report['ideal_speedup']:.0%} of the ideal)"]
    lines += round_split_table(report["rows"])
    lines += ["", "Pipeline hit rate by the outcome of the round before (drafts accepted a; without fan-out the "
              "drafter prepares for a = k only):", "",
              "| row | " + " | ".join(f"a = {a}" for a in range(report["k"] + 1)) + " |",
              "|---|" + "---|" * (report["k"] + 1)]
    first = report["rows"]["4 distributed, pipelined"]
    lines.append("| share of rounds (row 4) | " + " | ".join(f"{first[f'share_after_{a}_accepted']:.2f}"
                                                          for a in range(report["k"] + 1)) + " |")
    for name, r in report["rows"].items():
        if name.startswith(("4", "5", "6")):
            lines.append(f"| {name} | " + " | ".join(f"{r[f'hit_rate_after_{a}_accepted']:.2f}"
                                                     for a in range(report["k"] + 1)) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="specserve bench")
    sub = p.add_subparsers(dest="which", required=True)
    d = sub.add_parser("distributed", help="in-process vs Ray+gRPC, sequential vs pipelined")
    b = sub.add_parser("batching", help="continuous batching: throughput and latency by concurrency")
    for q in (d, b):
        q.add_argument("--models", default=str(DEFAULT_MODEL_DIR), help="folder with target/ and drafter/")
        q.add_argument("-k", type=int, default=4)
        q.add_argument("--prompt-tokens", type=int, default=64)
        q.add_argument("--max-tokens", type=int, default=64)
        q.add_argument("--repeats", type=int, default=3)
        add_dtype_arg(q)
    d.add_argument("--prompts", type=int, default=10)
    d.add_argument("--fanout", type=int_list, default=[2, 3], help="fan-outs of the speculation cache to run (rows 5; row 6: the last)")
    d.add_argument("--out", type=out_prefix, default=str(RESULTS_DIR / "distributed"), help="writes OUT.json and OUT.md")
    b.add_argument("--concurrency", type=int_list, default=[1, 2, 4, 8, 16, 32])
    b.add_argument("--waves", type=int, default=4,
                   help="requests per level and run: this many times the concurrency (one wave ends in a drain "
                        "that plain decoding of equal-length requests never has: see docs/benchmarks/README.md)")
    b.add_argument("--min-requests", type=int, default=8,
                   help="requests per level and run at least (closed loop: a finished one is replaced at once)")
    b.add_argument("--colocated", action="store_true",
                   help="also a row of the adaptive policy with the drafter colocated (colocate: true)")
    b.add_argument("--out", type=out_prefix, default=str(RESULTS_DIR / "batching"), help="writes OUT.json and OUT.md")
    for name, help_ in OWN_PARSER_BENCHES.items():  # listed here, parsed by their own modules
        sub.add_parser(name, help=help_, add_help=False)
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in OWN_PARSER_BENCHES:
        return importlib.import_module(f"specserve.benchmarks.{argv[0].replace('-', '_')}").main(argv[1:])
    args = p.parse_args(argv)
    check_draft_k(p, args.k)
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    torch.set_num_threads(1)
    if args.which == "distributed":
        report, render = bench_distributed(args), markdown
    else:
        report, render = bench_batching(args), markdown_batching
        report["plot"] = os.path.basename(args.out) + ".png"  # named in the Markdown
        plot_batching(report, args.out + ".png")
    command = "specserve bench " + " ".join(argv if argv is not None else sys.argv[1:])
    report["command"] = command
    md = render(report, command)
    print(md)
    Path(args.out + ".json").write_text(json.dumps(report, indent=2) + "\n")
    Path(args.out + ".md").write_text(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
