"""`specserve bench serve`: throughput and latency of the HTTP endpoint under load, per number of
pairs, with a cost model of what N pairs on their own devices deliver.

    specserve bench serve --concurrency 1,2,4,8 --request-rates 1,2,inf --num-pairs 1,2 --load-per-pair

Load: closed-loop sweeps (`--concurrency`: C clients send streamed completions back to back) and
open-loop Poisson arrivals (`--request-rates`, requests/s; `inf` sends all at once), `--requests`
per level, greedy and ignore_eos by default. Each request streams SSE from /v1/completions: TTFT
is the first text chunk, ITL the gap between text chunks shared by the chunk's tokens (a chunk is
one speculation round; tokens per chunk = usage.completion_tokens / chunks), TPOT the request's
mean time per output token after the first. Reported per level: request throughput, output
tokens/s, goodput under the SLOs given (`--slo-ttft-ms`, `--slo-itl-ms` on TPOT, `--slo-e2e-ms`),
TTFT / ITL / TPOT / end-to-end latency p50/p90/p99, and acceptance rate and pipeline hit rate from
the difference of /metrics counters before and after the level.

With `--num-pairs 1,2` the endpoint is started here once per count (not with --url), and the
Markdown gives aggregate and per-pair tokens/s and the scaling efficiency
aggregate(N) / (N x aggregate(1)). The cost model times the target's and the drafter's passes
here (`ModelRunner`, one thread per model, as in a pair's actor) and predicts, for a pair running
b sequences of M new tokens each,
    tok/s = b M / ((M / E) (T(b, k+1) + k T_draft(b)) + b (T_prefill + T_draft,prefill)),
E = (1 - alpha^(k+1)) / (1 - alpha), alpha the acceptance rate measured at that level; N pairs on
independent devices share the load evenly. Writes OUT.md, OUT.json and OUT.png.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import math
import os
import random
import re
import shlex
import statistics
import sys
import time
from pathlib import Path

from specserve.benchmarks.endpoint import add_endpoint_args, check_url, open_endpoint, out_prefix, write_results
from specserve.config import REPO_ROOT

RESULTS_DIR = REPO_ROOT / "docs" / "benchmarks"
COUNTERS = {"drafts": "specserve_spec_decode_num_drafts", "draft_tokens": "specserve_spec_decode_num_draft_tokens",
            "accepted": "specserve_spec_decode_num_accepted_tokens", "hits": "specserve_pipeline_hits"}
PCTS = (0.5, 0.9, 0.99)


# ----------------------------------------------------------------------------- arguments

def int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return values


def rate_list(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated rates (requests/s, or inf), got {text!r}") from None
    if not values or any(not (v > 0) for v in values):
        raise argparse.ArgumentTypeError(f"rates must be > 0 (or inf), got {text!r}")
    return values


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specserve bench serve", description=__doc__.split("\n\n")[0],
                                conflict_handler="resolve")
    add_endpoint_args(p)
    p.add_argument("--num-pairs", type=int_list, default=None,
                   help="pair counts to start the endpoint with, one sweep each (e.g. 1,2; not with --url)")
    p.add_argument("--load-per-pair", action="store_true",
                   help="scale each concurrency, rate and request count by the number of pairs")
    p.add_argument("--models", default=None,
                   help="folder with target/ and drafter/ (prompts, tokenizer, cost model); default: the config's")
    p.add_argument("--concurrency", type=int_list, default=None, help="closed-loop levels, e.g. 1,2,4,8")
    p.add_argument("--request-rates", type=rate_list, default=None, help="Poisson rates in requests/s, e.g. 1,2,4,inf")
    p.add_argument("--requests", type=int, default=32, help="requests per level (at least the concurrency)")
    p.add_argument("--warmup-requests", type=int, default=2)
    p.add_argument("--dataset", choices=("code", "mixed"), default="code")
    p.add_argument("--prompt-tokens", type=int, default=64, help="code: prompt length in tokens")
    p.add_argument("--max-tokens", type=int, default=64, help="code: new tokens per request")
    p.add_argument("--mixed-prompt-tokens", type=int_list, default=[32, 128, 384], help="mixed: prompt sizes")
    p.add_argument("--mixed-max-tokens", type=int_list, default=[16, 64, 128], help="mixed: output sizes")
    p.add_argument("--prompt-format", choices=("ids", "text"), default="ids", help="send token ids or decoded text")
    p.add_argument("--temperature", type=float, default=0.0, help="> 0: sampled (seeded per request)")
    p.add_argument("-k", type=int, default=None, help="draft tokens per round to request (default: the server's)")
    p.add_argument("--slo-ttft-ms", type=float, default=None)
    p.add_argument("--slo-itl-ms", type=float, default=None, help="on each request's TPOT (mean ITL)")
    p.add_argument("--slo-e2e-ms", type=float, default=None)
    p.add_argument("--no-cost-model", action="store_true", help="skip timing the passes and the model")
    p.add_argument("--model-reps", type=int, default=10, help="timed passes per point of the cost model")
    p.add_argument("--ray-num-cpus", type=float, default=None,
                   help="logical CPUs of the local Ray started here (default: enough for the pairs)")
    p.add_argument("--request-timeout", type=float, default=300.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=out_prefix, default=str(RESULTS_DIR / "serve"), help="writes OUT.md, OUT.json and OUT.png")
    return p


def check_args(p: argparse.ArgumentParser, args) -> None:
    if not args.concurrency and not args.request_rates:
        p.error("give --concurrency and/or --request-rates")
    if args.url and args.num_pairs and len(args.num_pairs) > 1:
        p.error("--num-pairs with several counts starts the endpoint here: not with --url")
    for name in ("requests", "prompt_tokens", "max_tokens", "model_reps"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.warmup_requests < 0 or args.temperature < 0 or (args.k is not None and args.k < 0):
        p.error("--warmup-requests, --temperature and -k must be >= 0")
    for name in ("slo_ttft_ms", "slo_itl_ms", "slo_e2e_ms"):
        if getattr(args, name) is not None and getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be > 0")
    check_url(p, args.url)


# ----------------------------------------------------------------------------- prompts

def model_paths(args) -> tuple[str, str | None, dict]:
    """(target, drafter, app args) of the endpoint's models (from --models, else the config)."""
    from specserve.cli import load_app_args
    from specserve.config import SpecServeConfig
    app_args = load_app_args(args.config)
    if args.models:
        return str(Path(args.models) / "target"), str(Path(args.models) / "drafter"), app_args
    cfg = SpecServeConfig.from_dict(app_args)
    return cfg.target, cfg.drafter, app_args


def context_of(target: str) -> int:
    cfg = json.loads((Path(target) / "config.json").read_text())
    return int(cfg.get("max_position_embeddings") or cfg.get("n_positions") or 2048)


def code_items(args, target: str, tokenizer, n: int) -> list[dict]:
    from specserve.training.demo_pair import heldout_prompts
    prompts = heldout_prompts(Path(target).parent, n, args.prompt_tokens, tokenizer, seed=args.seed)
    return [{"ids": ids, "max_tokens": args.max_tokens} for ids in prompts]


def source_files(target: str) -> list[str]:
    """The stdlib's .py files, less the demo pair's training files when its split is at hand."""
    import sysconfig
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(str(f) for f in root.glob("*.py"))
    split = Path(target).parent / "split.json"
    if split.exists():
        from specserve.training.demo_pair import train_files
        seen = {os.path.basename(f) for f in train_files(str(split))}
        files = [f for f in files if os.path.basename(f) not in seen] or files
    return files


def mixed_items(args, target: str, tokenizer, n: int) -> list[dict]:
    """Prompts of each --mixed-prompt-tokens size from stdlib source, each with an output size
    drawn from --mixed-max-tokens; prompt + output fit the target's context."""
    rng, files, ctx = random.Random(args.seed), source_files(target), context_of(target)
    items = []
    while len(items) < n:
        with open(rng.choice(files), encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines(keepends=True)
        if len(lines) < 40:
            continue
        out = rng.choice(args.mixed_max_tokens)
        size = min(rng.choice(args.mixed_prompt_tokens), ctx - out - 1)
        start = rng.randrange(0, len(lines) - 20)
        ids = tokenizer("".join(lines[start:start + 400]))["input_ids"][:size]
        if len(ids) == size:
            items.append({"ids": ids, "max_tokens": out})
    return items


def make_items(args, target: str, n: int) -> list[dict]:
    from specserve.core.runner import load_tokenizer
    tokenizer = load_tokenizer(target)
    items = (code_items if args.dataset == "code" else mixed_items)(args, target, tokenizer, n)
    for i, item in enumerate(items):
        item["prompt"] = item["ids"] if args.prompt_format == "ids" else tokenizer.decode(item["ids"])
        item["seed"] = args.seed * 100003 + i
    return items


# ----------------------------------------------------------------------------- requests

def request_body(ep, item: dict, args) -> dict:
    body = {"model": ep.model, "prompt": item["prompt"], "max_tokens": item["max_tokens"], "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True, "temperature": args.temperature,
            "seed": item["seed"]}
    if args.k is not None:
        body["speculative"] = {"enabled": args.k > 0, "k": args.k}
    return body


async def one_request(ac, ep, item: dict, args) -> dict:
    """Streams one completion; returns its send time, chunk times and token count (or error)."""
    headers = {"Authorization": f"Bearer {ep.api_key}"} if ep.api_key else {}
    rec = {"sent": time.monotonic(), "chunks": [], "tokens": 0, "prompt_tokens": len(item["ids"])}
    try:
        async with ac.stream("POST", ep.url + "/v1/completions", json=request_body(ep, item, args),
                             headers=headers) as r:
            rec["code"] = r.status_code
            if r.status_code != 200:
                rec["error"] = (await r.aread()).decode(errors="replace")[:300]
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    rec["code"], rec["error"] = "stream_error", chunk["error"]["message"][:300]
                elif chunk.get("usage"):  # (the last chunk, with no choices: stream_options.include_usage)
                    rec["tokens"] = chunk["usage"]["completion_tokens"]
                elif chunk.get("speculative"):  # the finish chunk
                    rec["k"] = chunk["speculative"].get("k")
                elif chunk["choices"] and chunk["choices"][0]["text"]:
                    rec["chunks"].append(time.monotonic())
    except Exception as e:  # a broken connection or a timeout: counted as a failure
        rec["code"], rec["error"] = f"exception:{type(e).__name__}", str(e)[:300]
    rec["done"] = time.monotonic()
    return rec


async def closed_loop(ac, ep, items, args, concurrency: int, bar) -> list[dict]:
    queue = list(reversed(items))
    records: list[dict] = []

    async def client():
        while queue:
            records.append(await one_request(ac, ep, queue.pop(), args))
            bar.update(1)
    await asyncio.gather(*(client() for _ in range(concurrency)))
    return records


async def open_loop(ac, ep, items, args, rate: float, bar) -> list[dict]:
    rng = random.Random(args.seed)
    start, at, tasks = time.monotonic(), 0.0, []

    async def timed(item, delay):
        await asyncio.sleep(delay)
        rec = await one_request(ac, ep, item, args)
        bar.update(1)
        return rec
    for item in items:
        tasks.append(asyncio.create_task(timed(item, max(0.0, start + at - time.monotonic()))))
        at += rng.expovariate(rate) if math.isfinite(rate) else 0.0
    return list(await asyncio.gather(*tasks))


def read_counters(url: str, api_key: str | None) -> dict | None:
    """Our spec-decode counters from /metrics (summed over labels), or None if unreachable."""
    import httpx
    try:
        r = httpx.get(url + "/metrics", timeout=30,
                      headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
        r.raise_for_status()
    except Exception:
        return None
    out = {}
    for key, name in COUNTERS.items():
        pattern = rf"^{re.escape(name)}(?:_total)?(?:\{{[^}}]*\}})? (\S+)$"
        out[key] = sum(float(v) for v in re.findall(pattern, r.text, re.M))
    return out


# ----------------------------------------------------------------------------- summaries

def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def timings(rec: dict) -> dict:
    """TTFT, TPOT, end-to-end (s) and the per-token ITL samples of one successful request."""
    chunks = rec["chunks"] or [rec["done"]]
    ttft, e2e = chunks[0] - rec["sent"], rec["done"] - rec["sent"]
    per_chunk = max(rec["tokens"], len(rec["chunks"])) / len(rec["chunks"]) if rec["chunks"] else 1.0
    itl = [(b - a) / per_chunk for a, b in zip(chunks, chunks[1:])]
    tpot = (chunks[-1] - chunks[0]) / (rec["tokens"] - 1) if rec["tokens"] > 1 else None
    return {"ttft": ttft, "e2e": e2e, "itl": itl, "tpot": tpot, "tokens_per_chunk": per_chunk}


def meets_slo(t: dict, args) -> bool:
    checks = [(args.slo_ttft_ms, t["ttft"]), (args.slo_itl_ms, t["tpot"] or 0.0), (args.slo_e2e_ms, t["e2e"])]
    return all(slo is None or value * 1e3 <= slo for slo, value in checks)


def spec_rates(before: dict | None, after: dict | None) -> dict:
    if before is None or after is None:
        return {"acceptance_rate": None, "pipeline_hit_rate": None, "mean_acceptance_length": None}
    d = {key: after[key] - before[key] for key in COUNTERS}
    return {"acceptance_rate": d["accepted"] / d["draft_tokens"] if d["draft_tokens"] else None,
            "pipeline_hit_rate": d["hits"] / d["drafts"] if d["drafts"] else None,
            "mean_acceptance_length": 1 + d["accepted"] / d["drafts"] if d["drafts"] else None, "counters": d}


def summarize(records: list[dict], args, before, after) -> dict:
    ok = [r for r in records if r.get("code") == 200]
    elapsed = max(r["done"] for r in records) - min(r["sent"] for r in records)
    ts = [timings(r) for r in ok]
    good = sum(meets_slo(t, args) for t in ts)
    tokens = sum(r["tokens"] for r in ok)
    out = {"requests": len(records), "completed": len(ok), "failed": len(records) - len(ok),
           "codes": {str(c): sum(1 for r in records if r.get("code") == c) for c in {r.get("code") for r in records}},
           "error_samples": [r.get("error") for r in records if r.get("code") != 200][:5],
           "duration_s": elapsed, "request_throughput": len(ok) / elapsed, "output_tokens": tokens,
           "output_tokens_per_s": tokens / elapsed, "good_requests": good, "goodput_share": good / len(records),
           "goodput_rps": good / elapsed,
           "tokens_per_chunk": statistics.mean(t["tokens_per_chunk"] for t in ts) if ts else None,
           "k": max((r["k"] for r in ok if r.get("k") is not None), default=None)}
    samples = {"ttft": [t["ttft"] for t in ts], "itl": [x for t in ts for x in t["itl"]],
               "tpot": [t["tpot"] for t in ts if t["tpot"] is not None], "e2e": [t["e2e"] for t in ts]}
    for name, values in samples.items():
        for q in PCTS:
            v = percentile(values, q)
            out[f"{name}_p{int(q * 100)}_ms"] = v * 1e3 if v is not None else None
    out.update(spec_rates(before, after))
    return out


# ----------------------------------------------------------------------------- cost model

def time_pass(runner, batch: int, width: int, prompt: list[int], reps: int) -> float:
    """Median seconds of one pass scoring `width` tokens in each of `batch` slots after `prompt`."""
    for s in range(batch):
        runner.prefill(prompt, slot=s)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        runner.score_batch([(s, prompt[:width]) for s in range(batch)])
        times.append(time.perf_counter() - t0)
        for s in range(batch):
            runner.rollback(width, slot=s)
    for s in range(batch):
        runner.release(s)
    return statistics.median(times)


def time_prefill(runner, prompt: list[int], reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        runner.prefill(prompt)
        times.append(time.perf_counter() - t0)
        runner.release(0)
    return statistics.median(times)


def measure_costs(target: str, drafter: str | None, batches: list[int], k: int, prompt: list[int],
                  reps: int, threads: int) -> dict:
    """Pass times (s) on this machine, one model at a time with `threads` torch threads."""
    import torch

    from specserve.core.runner import ModelRunner
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        t = ModelRunner.from_pretrained(target, name="target", slots=max(batches))
        costs = {"target_prefill": time_prefill(t, prompt, reps), "target": {}, "draft": {}}
        for b in batches:
            costs["target"][b] = {1: time_pass(t, b, 1, prompt, reps), k + 1: time_pass(t, b, k + 1, prompt, reps)}
        del t
        if drafter:
            d = ModelRunner.from_pretrained(drafter, name="drafter", role="drafter", slots=max(batches))
            costs["draft_prefill"] = time_prefill(d, prompt, reps)
            costs["draft"] = {b: time_pass(d, b, 1, prompt, reps) for b in batches}
    finally:
        torch.set_num_threads(saved)
    return costs


def pair_tokens_per_s(costs: dict, b: int, alpha: float | None, k: int, new_tokens: float) -> float:
    """Model tokens/s of one pair running b sequences of `new_tokens` each (b = 0: idle)."""
    from specserve.verifier.policy import expected_tokens
    if b == 0:
        return 0.0
    speculative = alpha is not None and k > 0 and costs["draft"]
    if speculative:
        e, round_s = expected_tokens(alpha, k), costs["target"][b][k + 1] + k * costs["draft"][b]
        prefill = costs["target_prefill"] + costs["draft_prefill"]
    else:
        e, round_s, prefill = 1.0, costs["target"][b][1], costs["target_prefill"]
    return b * new_tokens / (new_tokens / e * round_s + b * prefill)


def shares(concurrency: int, pairs: int, max_num_seqs: int) -> list[int]:
    """Sequences per pair when `concurrency` requests spread evenly (capped at max_num_seqs)."""
    return [min(max_num_seqs, concurrency // pairs + (i < concurrency % pairs)) for i in range(pairs)]


# ----------------------------------------------------------------------------- runs

def scaled(args, pairs: int) -> tuple[list[int], list[float], int]:
    factor = pairs if args.load_per_pair else 1
    return ([c * factor for c in args.concurrency or []], [r * factor for r in args.request_rates or []],
            args.requests * factor)


async def sweep(ep, items, args, pairs: int) -> list[dict]:
    import httpx
    from tqdm import tqdm
    levels, rates, n = scaled(args, pairs)
    plan = [("concurrency", c, max(n, c)) for c in levels] + [("rate", r, n) for r in rates]
    limits = httpx.Limits(max_connections=max(levels + [n]) + 8, max_keepalive_connections=64)
    results = []
    async with httpx.AsyncClient(timeout=args.request_timeout, limits=limits) as ac:
        warm = items[:args.warmup_requests]
        await asyncio.gather(*(one_request(ac, ep, it, args) for it in warm))
        for kind, value, count in plan:
            before = await asyncio.to_thread(read_counters, ep.url, ep.api_key)
            label = f"{pairs} pair(s), {kind} {value:g}"
            with tqdm(total=count, desc=label, unit="req", file=sys.stderr, disable=not sys.stderr.isatty()) as bar:
                run = closed_loop if kind == "concurrency" else open_loop
                records = await run(ac, ep, items[:count], args, value, bar)
            after = await asyncio.to_thread(read_counters, ep.url, ep.api_key)
            level = {"num_pairs": pairs, "kind": kind, "load": value, **summarize(records, args, before, after)}
            results.append(level)
            print(f"  {label}: {level['output_tokens_per_s']:.1f} tok/s, {level['completed']}/{count} ok, "
                  f"TTFT p50 {level['ttft_p50_ms'] or float('nan'):.0f} ms", file=sys.stderr, flush=True)
    return results


def run_pairs(args, pairs: int | None, items: list[dict]) -> tuple[list[dict], dict]:
    """One endpoint (started here with `pairs` pairs, or --url), one sweep."""
    import ray
    ep_args = copy.copy(args)
    ep_args.num_pairs = pairs
    info = {"started_here": not args.url}
    if not args.url and not ray.is_initialized():
        from specserve.config import SpecServeConfig
        cfg = SpecServeConfig.from_dict({**model_paths(args)[2], **({"num_pairs": pairs} if pairs else {})})
        need = cfg.num_pairs * sum(b["CPU"] for b in cfg.bundles())
        num_cpus = args.ray_num_cpus or max(os.cpu_count() or 1, need)
        from specserve.cluster.pair import start_ray
        start_ray(num_cpus=num_cpus)
        info.update(ray_num_cpus=num_cpus, actor_cpus_needed=need)
    ep = open_endpoint(ep_args)
    try:
        info.update(url=ep.url, model=ep.model)
        return asyncio.run(sweep(ep, items, args, pairs or 1)), info
    finally:
        ep.stop()


def server_config(args, levels: list[dict]) -> dict:
    """The server's settings: k as its responses report it, the rest from --config and the options
    (with --url, pass the server's --config or --max-num-seqs for the cost model)."""
    from specserve.config import SpecServeConfig
    cfg = SpecServeConfig.from_dict(model_paths(args)[2])
    for key in ("max_num_seqs", "max_waiting"):
        if getattr(args, key) is not None:
            setattr(cfg, key, getattr(args, key))
    seen = [lv["k"] for lv in levels if lv["k"] is not None]
    return {"k": max(seen) if seen else cfg.k, "max_num_seqs": cfg.max_num_seqs,
            "max_waiting": cfg.max_waiting, "pipeline": cfg.pipeline,
            "threads_per_actor": max(1, int(cfg.cpus_per_actor)),
            # (a live server's own settings are not read from it: until stop 61 the report stated the defaults
            # as its settings, "max_num_seqs 8" for a server of 2)
            "assumed": bool(args.url) and args.config is None, "k_reported": bool(seen),
            "max_num_seqs_given": args.max_num_seqs is not None or args.config is not None}


def add_model(report: dict, args, items: list[dict]) -> None:
    """Cost-model predictions next to each closed-loop level (tokens/s, aggregate over the pairs)."""
    target, drafter, _ = model_paths(args)
    srv = report["server"]
    levels = [lv for lv in report["levels"] if lv["kind"] == "concurrency"]
    batches = sorted({b for lv in levels for b in shares(int(lv["load"]), lv["num_pairs"], srv["max_num_seqs"]) if b})
    if not batches:
        return
    prompt = items[0]["ids"][:statistics.median_low([len(it["ids"]) for it in items])]
    costs = measure_costs(target, drafter if srv["k"] else None, batches, max(srv["k"], 1), prompt,
                          args.model_reps, srv["threads_per_actor"])
    new_tokens = statistics.mean(it["max_tokens"] for it in items)
    for lv in levels:
        lv["model_output_tokens_per_s"] = sum(
            pair_tokens_per_s(costs, b, lv["acceptance_rate"] if srv["k"] else None, srv["k"], new_tokens)
            for b in shares(int(lv["load"]), lv["num_pairs"], srv["max_num_seqs"]))
    report["cost_model"] = {"prompt_tokens": len(prompt), "new_tokens": new_tokens, "reps": args.model_reps,
                            "threads": srv["threads_per_actor"],
                            "pass_ms": {"target_prefill": costs["target_prefill"] * 1e3,
                                        "draft_prefill": costs.get("draft_prefill", 0) * 1e3,
                                        "target": {b: {w: s * 1e3 for w, s in v.items()}
                                                   for b, v in costs["target"].items()},
                                        "draft": {b: s * 1e3 for b, s in costs["draft"].items()}}}


def scaling(levels: list[dict]) -> list[dict]:
    """Aggregate and per-pair tokens/s, and the efficiency against the fewest pairs at the same
    level (the i-th level of the same kind)."""
    base_n = min(lv["num_pairs"] for lv in levels)

    def group(n: int, kind: str) -> list[dict]:
        return [lv for lv in levels if lv["num_pairs"] == n and lv["kind"] == kind]
    rows = []
    for lv in levels:
        i = next(j for j, x in enumerate(group(lv["num_pairs"], lv["kind"])) if x is lv)
        base = group(base_n, lv["kind"])
        ref = base[i] if i < len(base) else None
        agg = lv["output_tokens_per_s"]
        ideal = lv["num_pairs"] / base_n * ref["output_tokens_per_s"] if ref else 0
        eff = agg / ideal if ideal else None
        rows.append({"num_pairs": lv["num_pairs"], "kind": lv["kind"], "load": lv["load"], "aggregate": agg,
                     "per_pair": agg / lv["num_pairs"], "efficiency": eff,
                     "model": lv.get("model_output_tokens_per_s")})
    return rows


# ----------------------------------------------------------------------------- output

def _f(v, fmt="{:.1f}") -> str:
    return fmt.format(v) if isinstance(v, (int, float)) and not (isinstance(v, float) and math.isnan(v)) else "–"


def _pcts(lv: dict, name: str) -> str:
    return " / ".join(_f(lv[f"{name}_p{int(q * 100)}_ms"], "{:.0f}") for q in PCTS)


def markdown(report: dict, command: str) -> str:
    srv, slo = report["server"], report["slo_ms"]
    lines = [f"Command: `{command}`", "",
             f"Started {report['started_utc']} on {report['cpu_cores']} CPU core(s). Dataset `{report['dataset']}` "
             f"({report['dataset_note']}), prompts as {report['prompt_format']}, temperature {report['temperature']}, "
             f"ignore_eos, streamed. Server: "
             + ((f"k = {srv['k']}, as its responses report it" if srv.get("k_reported") else
                 "k not reported (no request was answered)")
                + (f", max_num_seqs {srv['max_num_seqs']} as given" if srv.get("max_num_seqs_given") else "")
                + "; its other settings were not given (--config) and are not stated"
                + ("; the cost model takes this command's defaults for them. " if "cost_model" in report else ". ")
                if srv.get("assumed") else
                f"k = {srv['k']}, max_num_seqs {srv['max_num_seqs']}, max_waiting {srv['max_waiting']}, pipeline {srv['pipeline']}, "
                f"{srv['threads_per_actor']} torch thread per actor. ")
             + f"Load levels: closed loop (C clients back to back) and Poisson arrivals (rate in requests/s)"
             + (", scaled by the number of pairs" if report["load_per_pair"] else "") + ".",
             "", "SLOs for goodput: " + (", ".join(f"{k} ≤ {v:g} ms" for k, v in slo.items() if v is not None)
                                         or "none given (goodput = all completed requests)")
             + "; ITL's SLO applies to each request's TPOT (mean time per output token after the first).", "",
             "| pairs | load | ok / sent | req/s | out tok/s | goodput req/s (share) | TTFT p50/p90/p99 ms "
             "| ITL p50/p90/p99 ms | TPOT p50/p90/p99 ms | E2E p50/p90/p99 ms | acceptance | pipeline hits "
             "| tok/chunk |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for lv in report["levels"]:
        load = f"C={lv['load']:g}" if lv["kind"] == "concurrency" else f"{lv['load']:g} req/s"
        lines.append(f"| {lv['num_pairs']} | {load} | {lv['completed']} / {lv['requests']} | "
                     f"{_f(lv['request_throughput'], '{:.2f}')} | {_f(lv['output_tokens_per_s'])} | "
                     f"{_f(lv['goodput_rps'], '{:.2f}')} ({lv['goodput_share']:.0%}) | {_pcts(lv, 'ttft')} | "
                     f"{_pcts(lv, 'itl')} | {_pcts(lv, 'tpot')} | {_pcts(lv, 'e2e')} | "
                     f"{_f(lv['acceptance_rate'], '{:.3f}')} | {_f(lv['pipeline_hit_rate'], '{:.2f}')} | "
                     f"{_f(lv['tokens_per_chunk'], '{:.2f}')} |")
    lines += scaling_md(report)
    failed = [e for lv in report["levels"] for e in lv["error_samples"]]
    if failed:
        lines += ["", "Error samples:", ""] + [f"- `{e}`" for e in failed[:10]]
    lines += ["", f"![serve]({Path(report['png']).name})", ""]
    return "\n".join(lines)


def scaling_md(report: dict) -> list[str]:
    pairs = sorted({lv["num_pairs"] for lv in report["levels"]})
    lines = []
    if len(pairs) > 1 or report.get("cost_model"):
        lines += ["", "Aggregate output tokens/s by number of pairs; efficiency = aggregate(N) / "
                  f"(N × aggregate({pairs[0]}) per pair) at the same level"
                  + (" (load per pair held constant)" if report["load_per_pair"] else " (same total load)") + ":", "",
                  "| pairs | load | aggregate tok/s | per pair | efficiency | cost model tok/s |",
                  "|---|---|---|---|---|---|"]
        for r in report["scaling"]:
            load = f"C={r['load']:g}" if r["kind"] == "concurrency" else f"{r['load']:g} req/s"
            lines.append(f"| {r['num_pairs']} | {load} | {_f(r['aggregate'])} | {_f(r['per_pair'])} | "
                         f"{_f(r['efficiency'], '{:.0%}')} | {_f(r['model'])} |")
    if len(pairs) > 1 and report["started_here"]:
        lines += ["", f"**This machine has {report['cpu_cores']} CPU core(s)**: each pair is 2 actors with one "
                  f"thread each, so {max(pairs)} pairs run {2 * max(pairs)} actors (plus the HTTP ingress) on "
                  f"{report['cpu_cores']} cores (Ray told {report['ray_num_cpus']} logical CPUs). The measured "
                  "scaling here shows the cores running out, not what separate devices would do; the cost "
                  "model column is that."]
    cm = report.get("cost_model")
    if cm:
        pm = cm["pass_ms"]
        lines += ["", "Cost model (closed-loop levels): pass times measured here, one model at a time with "
                  f"{cm['threads']} thread(s), prompts of {cm['prompt_tokens']} tokens; "
                  f"{cm['new_tokens']:g} new tokens per request. Per pair with b sequences: "
                  "tok/s = b·M / ((M/E)·(T(b, k+1) + k·T_draft(b)) + b·(T_prefill + T_draft,prefill)), "
                  "E = (1 − α^(k+1)) / (1 − α), α the acceptance rate measured at the level, k the "
                  "configured one (the server's policy may draft fewer); N pairs on "
                  "independent devices (2 per pair) split the load evenly. No overlap of drafting and "
                  "verifying is assumed (pipelining can do better), nor any HTTP or scheduling cost.", "",
                  f"Prefill ms: target {pm['target_prefill']:.2f}, drafter {pm['draft_prefill']:.2f}.", "",
                  "| b | T(b, 1) ms | T(b, k+1) ms | T_draft(b) ms |", "|---|---|---|---|"]
        for b, t in pm["target"].items():
            w = sorted(t)
            lines.append(f"| {b} | {t[w[0]]:.2f} | {t[w[-1]]:.2f} | {_f(pm['draft'].get(b), '{:.2f}')} |")
    return lines


def plot(report: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    kinds = [k for k in ("concurrency", "rate") if any(lv["kind"] == k for lv in report["levels"])]
    fig, axes = plt.subplots(2, len(kinds), figsize=(6 * len(kinds), 8), squeeze=False)
    for col, kind in enumerate(kinds):
        top, bottom = axes[0][col], axes[1][col]
        for pairs in sorted({lv["num_pairs"] for lv in report["levels"]}):
            lvs = [lv for lv in report["levels"] if lv["kind"] == kind and lv["num_pairs"] == pairs]
            xs = [lv["load"] if math.isfinite(lv["load"]) else None for lv in lvs]
            xs = [x if x is not None else 2 * max([v for v in xs if v] or [1]) for x in xs]  # inf: drawn at 2x
            top.plot(xs, [lv["output_tokens_per_s"] for lv in lvs], marker="o", label=f"{pairs} pair(s), measured")
            if any("model_output_tokens_per_s" in lv for lv in lvs):
                top.plot(xs, [lv.get("model_output_tokens_per_s") for lv in lvs], linestyle="--", marker="x",
                         label=f"{pairs} pair(s), cost model (own devices)")
            for q, style in zip(PCTS, (":", "-.", "-")):
                bottom.plot(xs, [lv[f"e2e_p{int(q * 100)}_ms"] for lv in lvs], linestyle=style, marker=".",
                            label=f"{pairs} pair(s), E2E p{int(q * 100)}")
            bottom.plot(xs, [lv["ttft_p50_ms"] for lv in lvs], linestyle="--", marker="^",
                        label=f"{pairs} pair(s), TTFT p50")
        xlabel = "concurrent clients" if kind == "concurrency" else "request rate (req/s; inf drawn at 2× max)"
        top.set_title(f"output tokens/s vs {'concurrency' if kind == 'concurrency' else 'request rate'}")
        top.set_ylabel("output tokens/s")
        bottom.set_ylabel("latency (ms)")
        if any(line.get_ydata().size and (line.get_ydata().astype(float) > 0).any() for line in bottom.get_lines()):
            bottom.set_yscale("log")  # (no request answered, e.g. a wrong --api-key: every latency NaN, and the
            # log scale raised after the run, its results and errors unwritten, until stop 61)
        for ax in (top, bottom):
            ax.set_xscale("log", base=2)
            ax.set_xlabel(xlabel)
            ax.legend(fontsize=7)
            ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ----------------------------------------------------------------------------- main

def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = build_parser()
    args = p.parse_args(argv)
    check_args(p, args)
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    target, _, _ = model_paths(args)
    factor = max(args.num_pairs or [1]) if args.load_per_pair else 1
    items = make_items(args, target, factor * max((args.concurrency or []) + [args.requests]))
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    levels, info = [], {}
    for pairs in args.num_pairs or [None]:
        got, info = run_pairs(args, pairs, items)
        levels += got
    report = {"command": "specserve bench serve " + shlex.join(argv), "started_utc": started,
              "cpu_cores": os.cpu_count(), "dataset": args.dataset, "prompt_format": args.prompt_format,
              "dataset_note": dataset_note(args, items), "temperature": args.temperature,
              "load_per_pair": args.load_per_pair, "server": server_config(args, levels),
              "slo_ms": {"TTFT": args.slo_ttft_ms, "ITL (TPOT)": args.slo_itl_ms, "E2E": args.slo_e2e_ms},
              "png": args.out + ".png", **info, "levels": levels}
    if not args.no_cost_model and args.concurrency:
        add_model(report, args, items)
    report["scaling"] = scaling(levels)
    plot(report, args.out + ".png")
    write_results(args.out, report, markdown(report, report["command"]))
    return 0 if all(lv["failed"] == 0 for lv in levels) else 1


def dataset_note(args, items: list[dict]) -> str:
    if args.dataset == "code":
        return f"held-out code prompts of {args.prompt_tokens} tokens, {args.max_tokens} new tokens each"
    sizes = sorted({len(it["ids"]) for it in items})
    outs = sorted({it["max_tokens"] for it in items})
    return f"stdlib source prompts of {sizes} tokens, {outs} new tokens, seed {args.seed}"


if __name__ == "__main__":
    sys.exit(main())
