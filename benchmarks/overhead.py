"""`specserve bench overhead`: what each layer of serving costs at batch 1, on the same prompts
(the demo pair's held-out prompts as token ids), greedy, ignore EOS, one request at a time:

- in process: `build_engine` with the drafter in the same process;
- distributed: a `SpeculativePair` (verifier and drafter as Ray actors, drafts over gRPC);
- served: the Serve app `specserve serve` runs (started here, on a local Ray), through the real
  `openai` client, non-streamed and streamed;
- served, colocated: the same app with `colocate: true` (the drafter in the replica's process, no
  drafter actor), speculative only.

Each layer runs plain (`speculative.method = none`, k = 0) and speculative (the config's k and
policy). Reports tokens/s per row (median of repeats) and served / in-process and served /
distributed per mode: issue 12's "the HTTP path costs no more than 5% at batch 1". With
--vllm-python, vLLM's draft-model speculation (1 and 2 threads) runs as rows too, interleaved
with ours, and the ratios include ours / vLLM's best.

    specserve bench overhead --prompts 6 --max-tokens 64 --repeats 3
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import statistics
import sys
import time
from pathlib import Path

from specserve.benchmarks.endpoint import out_prefix, write_results
from specserve.benchmarks.bench import add_dtype_arg, dtypes_line, resolved_dtypes
from specserve.config import DEFAULT_MODEL_DIR, REPO_ROOT, SpecServeConfig

MODES = ("plain", "speculative")
PROXY = "Serve's proxy actor"  # (the HTTP entry until stop 64; RAY_SERVE_ENABLE_HA_PROXY=0 keeps it)


@contextlib.contextmanager
def _in_process(cfg: SpecServeConfig, max_tokens: int):
    """{mode: generate one prompt -> tokens written} with the engine in this process."""
    from specserve.builder import build_engine
    from specserve.core.sampling import SamplingParams
    engine = build_engine(cfg)
    engine.start()
    try:
        yield {mode: lambda p, k=(cfg.k if mode == "speculative" else 0): len(
            _wait(engine.submit(p, max_tokens, SamplingParams(), k, ignore_eos=True)).token_ids) for mode in MODES}
    finally:
        engine.stop()


def _wait(req):
    req.done.wait()
    return req.result()


@contextlib.contextmanager
def _distributed(cfg: SpecServeConfig, max_tokens: int):
    import ray

    from specserve.cluster.pair import SpeculativePair
    from specserve.core.sampling import SamplingParams
    pair = SpeculativePair(cfg.target, cfg.drafter, pipeline=cfg.pipeline, cpus_per_actor=1, k=cfg.k,
                           speculation=cfg.speculation)
    try:
        yield {mode: lambda p, k=(cfg.k if mode == "speculative" else 0): len(
            ray.get(pair.submit(p, max_tokens, SamplingParams(), k, ignore_eos=True))["token_ids"]) for mode in MODES}
    finally:
        pair.shutdown()


@contextlib.contextmanager
def _served(cfg: SpecServeConfig, max_tokens: int):
    """The app as `specserve serve` runs it, and beside it (its own route) the app colocated."""
    import dataclasses

    import openai
    from ray import serve

    from specserve.benchmarks.endpoint import _free_port
    from specserve.cluster.serve_app import build_app
    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    apps = {"": cfg, "colocated": dataclasses.replace(cfg, colocate=True)}
    for name, app_cfg in apps.items():
        serve.run(build_app(app_cfg.to_dict()), name=f"overhead{name}", route_prefix=f"/{name}")
    try:
        rows = {}
        for name in apps:
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/{name + '/' if name else ''}v1", api_key="none",
                                   max_retries=0, timeout=600)
            for mode in MODES[1:] if name else MODES:
                extra = {"ignore_eos": True, **({"speculative": {"method": "none"}} if mode == "plain" else {})}
                for stream in (False, True):
                    row = f"{mode}{', streamed' if stream else ''}"
                    rows[f"{name}, {row}" if name else row] = lambda p, client=client, extra=extra, stream=stream: \
                        _complete(client, cfg.model, p, max_tokens, extra, stream)
        yield rows
    finally:
        for name in apps:
            serve.delete(f"overhead{name}")
        serve.shutdown()


def _complete(client, model: str, prompt, max_tokens: int, extra: dict, stream: bool) -> int:
    """One completion through the openai client; the tokens it wrote."""
    if not stream:
        return client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                         extra_body=extra).usage.completion_tokens
    n = 0
    for chunk in client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                           stream=True, stream_options={"include_usage": True}, extra_body=extra):
        if chunk.usage is not None:
            n += chunk.usage.completion_tokens
    return n


def bench(args) -> dict:
    from transformers.utils import logging as hf_logging

    from specserve.core.runner import load_tokenizer
    from specserve.training.demo_pair import heldout_prompts
    hf_logging.disable_progress_bar()
    import torch
    torch.set_num_threads(1)
    models = Path(args.models)
    cfg = SpecServeConfig(target=str(models / "target"), drafter=str(models / "drafter"), k=args.k,
                          max_num_seqs=1, device="cpu", dtype=args.dtype, compile=False, speculation=args.speculation)
    prompts = heldout_prompts(models, args.prompts, args.prompt_tokens, load_tokenizer(cfg.target))
    import ray

    from specserve.cluster.pair import start_ray
    if not ray.is_initialized():  # logical CPUs for two pairs at once (each actor runs one torch thread)
        start_ray(num_cpus=8)
    with contextlib.ExitStack() as stack:  # every layer is up (and idle) before any is timed
        rows = {f"{layer}: {row}": fn for layer, start in (("in process", _in_process), ("distributed", _distributed),
                                                            ("served", _served))
                for row, fn in stack.enter_context(start(cfg, args.max_tokens)).items()}
        if args.vllm_python:  # the peer's engines stay loaded too, and run in the same alternation
            rows.update(stack.enter_context(_vllm(args, prompts)))
        runs = {row: [] for row in rows}
        for rep in range(args.repeats + 1):  # rows interleaved, a warm-up round first: drift hits all alike
            for row, generate_one in rows.items():
                t0 = time.perf_counter()
                n = sum(generate_one(p) for p in prompts)
                if rep:
                    runs[row].append(n / (time.perf_counter() - t0))
                    print(f"  {row}: {runs[row][-1]:.1f} tok/s", file=sys.stderr, flush=True)
    med = {row: statistics.median(r) for row, r in runs.items()}
    peer = {row: med[row] for row in med if row.startswith("vLLM")}
    ratios = {}
    for mode in MODES:
        for served in (mode, f"{mode}, streamed"):
            ratios[f"served ({served}) / in process"] = med[f"served: {served}"] / med[f"in process: {mode}"]
            ratios[f"served ({served}) / distributed"] = med[f"served: {served}"] / med[f"distributed: {mode}"]
    for served in ("speculative", "speculative, streamed"):
        ratios[f"served colocated ({served}) / in process"] = med[f"served: colocated, {served}"] / \
            med["in process: speculative"]
    if peer:
        best = max(peer, key=peer.get)
        for row in ("in process: speculative", "served: speculative", "served: speculative, streamed",
                    "served: colocated, speculative"):
            ratios[f"{row.replace(': ', ' (', 1)}) / {best} (vLLM's best)"] = med[row] / peer[best]
    return dict(models=str(models), k=args.k, dtype=args.dtype, dtypes=resolved_dtypes(args.dtype),
                speculation=args.speculation, prompts=len(prompts),
                prompt_tokens=args.prompt_tokens, max_tokens=args.max_tokens, repeats=args.repeats,
                runs=runs, vllm=peer,
                tokens_per_s=med, ratios=ratios)


@contextlib.contextmanager
def _vllm(args, prompts):
    """vLLM's draft-model speculation on the same prompts, with 1 and 2 threads: each engine is
    loaded (and compiled) once in a child process of its venv and kept alive, so its runs
    alternate with our rows'. A peer that fails to start is reported and left out."""
    from specserve.benchmarks.vllm_peer import PeerProcess
    peers = {}
    try:
        for threads in (1, 2):
            name = f"vLLM: draft model, {threads} thread{'s' if threads > 1 else ''}"
            try:
                peers[name] = PeerProcess(args.vllm_python, Path(args.models), prompts, "draft", threads=threads,
                                          k=args.k, max_tokens=args.max_tokens, dtype=resolved_dtypes(args.dtype)["target"])
            except Exception as e:
                print(f"  {name} did not start: {e}", file=sys.stderr, flush=True)
        yield {name: peer.generate for name, peer in peers.items()}
    finally:
        for peer in peers.values():
            peer.close()


def markdown(report: dict, command: str) -> str:
    lines = [f"Command: `{command}`", "",
             f"Models: `{report['models']}`, {dtypes_line(report)}k = {report['k']} (speculation: {report['speculation']}), "
             f"{report['prompts']} prompts of {report['prompt_tokens']} tokens, {report['max_tokens']} new tokens "
             f"each, greedy, ignore EOS, one request at a time, median of {report['repeats']} runs after a warm-up "
             "pass; every layer is up before any is timed, and the rows' runs are interleaved; one torch thread per model. In process: the engine with the drafter in the same process. "
             "Distributed: Ray actors, drafts over gRPC. Served: the Serve app through the `openai` client "
             f"(HTTP through {report.get('http_entry', PROXY)}: `specserve.cluster.pair.serve_through_haproxy`); "
             "colocated: the same app with `colocate: true` (the drafter in the replica's process).", "",
             "| layer: mode | tokens/s | runs |", "|---|---|---|"]
    for row, tps in report["tokens_per_s"].items():
        lines.append(f"| {row} | {tps:.1f} | {', '.join(f'{r:.1f}' for r in report['runs'][row])} |")
    lines += ["", "| ratio | value |", "|---|---|"]
    lines += [f"| {name} | {value:.2f}× |" for name, value in report["ratios"].items()]
    if report.get("vllm"):
        lines += ["", "vLLM rows: its draft-model speculation (k = {}), each engine loaded once in a child process of "
                  "its own venv and kept alive, its runs in the same alternation as ours (OMP_NUM_THREADS and "
                  "VLLM_CPU_OMP_THREADS_BIND set to the thread count).".format(report["k"])]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="specserve bench overhead", description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=str(DEFAULT_MODEL_DIR))
    p.add_argument("-k", type=int, default=4)
    p.add_argument("--speculation", default="fixed", choices=("fixed", "adaptive"))
    p.add_argument("--prompts", type=int, default=6)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    add_dtype_arg(p)
    p.add_argument("--vllm-python", help="a venv with vllm-cpu: adds vLLM's draft-model speculation as the peer")
    p.add_argument("--out", type=out_prefix, default=str(REPO_ROOT / "docs" / "benchmarks" / "overhead"))
    argv = list(sys.argv[1:] if argv is None else argv)
    args = p.parse_args(argv)
    said = os.environ.get("RAY_SERVE_ENABLE_HA_PROXY")  # (before start_ray sets it: the command's own)
    report = bench(args)
    report["http_entry"] = "HAProxy" if os.environ.get("RAY_SERVE_ENABLE_HA_PROXY") == "1" else PROXY
    report["command"] = ((f"RAY_SERVE_ENABLE_HA_PROXY={said} " if said is not None else "")
                         + "specserve bench overhead " + shlex.join(argv)).strip()
    write_results(args.out, report, markdown(report, report["command"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
