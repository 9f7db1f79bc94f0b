"""`specserve bench rounds`: what the verifier-drafter exchange costs per round, in one run, at
batch 1 on the demo pair:

1. one Propose round trip to the real drafter server (one sequence, no new tokens, k = 0:
   next to no model work), as a unary call and on the long-lived ProposeStream the verifier uses;
2. the engine (this process) against a drafter server in a child process (real gRPC between two
   processes, no Ray), greedy, ignore EOS, one request at a time: with the drafter in process,
   and remote, sequential and pipelined, each with the round's outcome sent early (as soon as
   acceptance is decided: the default) and sent with the next round's call instead.

Runs are interleaved and repeated; medians. Writes OUT.md and OUT.json.

    specserve bench rounds --prompts 4 --repeats 3
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from specserve.benchmarks.bench import add_dtype_arg, dtypes_line, resolved_dtypes
from specserve.benchmarks.endpoint import out_prefix, write_results
from specserve.config import DEFAULT_MODEL_DIR, REPO_ROOT

SERVER = r"""
import sys, torch
torch.set_num_threads(1)
from specserve.core.runner import ModelRunner
from specserve.drafter.server import serve
runner = ModelRunner.from_pretrained(sys.argv[1], name="drafter", role="drafter", dtype=sys.argv[3])
server, port, _ = serve(runner.model, port=0, pipeline=sys.argv[2] == "1", bf16_head=runner.bf16_head)
print(port, flush=True)
sys.stdin.read()  # until the parent closes it
server.stop(0)
"""


class DrafterProcess:
    """A drafter gRPC server in a child process (one torch thread), its model in `dtype`."""

    def __init__(self, drafter_path: str, pipeline: bool, dtype: str = "auto"):
        self.proc = subprocess.Popen([sys.executable, "-c", SERVER, drafter_path, "1" if pipeline else "0", dtype],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        if not line.strip().isdigit():
            self.close()
            raise RuntimeError("the drafter server did not start")
        self.address = f"127.0.0.1:{int(line)}"

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def round_trips(address: str, n: int) -> dict:
    """Median ms of a k = 0 Propose: unary, and on a stream."""
    import grpc

    from specserve.proto import speculative_pb2 as pb
    from specserve.proto import speculative_pb2_grpc as pb_grpc
    from specserve.verifier.client import ProposeStream

    channel = grpc.insecure_channel(address)
    stub = pb_grpc.DrafterStub(channel)
    stub.Start(pb.StartRequest(items=[pb.StartItem(seq_id="rt", prompt_ids=[1, 2, 3])]), timeout=30)
    counter = iter(range(1 << 30))

    def request():
        return pb.ProposeRequest(items=[pb.ProposeItem(seq_id="rt", round=next(counter), new_tokens=[], k=0)])

    def unary():
        stub.Propose(request(), timeout=30)

    stream = ProposeStream(stub)

    def streamed():
        stream.send(request(), 30.0)
        stream.receive()

    out = {}
    for name, fn in (("unary", unary), ("stream", streamed)):
        for _ in range(20):
            fn()
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        out[name] = 1e3 * statistics.median(times)
    stream.close()
    stub.Release(pb.ReleaseRequest(seq_ids=["rt"]), timeout=30)
    channel.close()
    return out


def _generate(engine, prompt: list[int], max_tokens: int, k: int) -> int:
    from specserve.core.sampling import SamplingParams
    req = engine.submit(prompt, max_tokens, SamplingParams(), k, ignore_eos=True)
    while not req.done.is_set():
        engine.step()
    return len(req.result().token_ids)


def bench(args) -> dict:
    from specserve.core.runner import ModelRunner
    from specserve.drafter.draft_model import DraftModelProposer
    from specserve.training.demo_pair import heldout_prompts
    from specserve.verifier.client import RemoteProposer
    from specserve.verifier.engine import SpeculativeEngine

    torch.set_num_threads(1)
    target_path, drafter_path = f"{args.models}/target", f"{args.models}/drafter"
    target = ModelRunner.from_pretrained(target_path, name="target", dtype=args.dtype)
    prompts = heldout_prompts(Path(args.models), args.prompts, args.prompt_tokens, target.tokenizer)
    drafter = ModelRunner.from_pretrained(drafter_path, name="drafter", role="drafter", dtype=args.dtype)
    servers = {p: DrafterProcess(drafter_path, p, args.dtype) for p in (False, True)}
    try:
        trips = round_trips(servers[False].address, args.round_trips)
        engines = {"in process": SpeculativeEngine(target, DraftModelProposer(drafter))}
        for pipelined, server in servers.items():
            for early in (True, False):
                remote = RemoteProposer(server.address)
                remote.answers_later = early  # False: the outcome travels with the next round's call
                name = f"remote, {'pipelined' if pipelined else 'sequential'}, outcome sent " + \
                       ("early" if early else "with the next call")
                engines[name] = SpeculativeEngine(target, remote)
        runs: dict[str, list[float]] = {name: [] for name in engines}
        for rep in range(args.repeats + 1):  # the first pass warms up
            for name, engine in engines.items():
                t0 = time.perf_counter()
                n = sum(_generate(engine, p, args.max_tokens, args.k) for p in prompts)
                if rep:
                    runs[name].append(n / (time.perf_counter() - t0))
    finally:
        for server in servers.values():
            server.close()
    rows = {name: {"tokens_per_s": statistics.median(r), "runs": r} for name, r in runs.items()}
    return {"round_trip_ms": trips, "rows": rows, "k": args.k, "prompts": args.prompts,
            "dtype": args.dtype, "dtypes": resolved_dtypes(args.dtype),
            "max_tokens": args.max_tokens, "repeats": args.repeats}


def markdown(report: dict, command: str) -> str:
    rows, trips = report["rows"], report["round_trip_ms"]
    base = rows["in process"]["tokens_per_s"]
    lines = [f"Command: `{command}`", "",
             f"Demo pair, {dtypes_line(report)}k = {report['k']} (fixed), greedy, {report['prompts']} prompts, {report['max_tokens']} new "
             f"tokens each, one request at a time, median of {report['repeats']} interleaved runs; one torch thread "
             "per process. Remote: the drafter's gRPC server in a child process, the engine here (no Ray).", "",
             "| Propose round trip (one sequence, nothing to take in or draft) | ms |", "|---|---|",
             f"| unary call | {trips['unary']:.3f} |", f"| on the ProposeStream | {trips['stream']:.3f} |", "",
             "| engine | tokens/s | × in process | runs |", "|---|---|---|---|"]
    for name, r in rows.items():
        lines.append(f"| {name} | {r['tokens_per_s']:.1f} | {r['tokens_per_s'] / base:.2f}× | "
                     + ", ".join(f"{x:.1f}" for x in r["runs"]) + " |")
    lines.append("")
    for mode in ("sequential", "pipelined"):
        a = rows[f"remote, {mode}, outcome sent early"]["tokens_per_s"]
        b = rows[f"remote, {mode}, outcome sent with the next call"]["tokens_per_s"]
        lines.append(f"- {mode}: outcome sent early / with the next call = {a / b:.2f}×")
    lines += ["", f"![tokens/s per engine, every run]({report['png']})"]
    return "\n".join(lines) + "\n"


def plot(report: dict, path: str) -> None:
    """Every run's tokens/s per engine (dots) and the median (bar)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(report["rows"])
    fig, ax = plt.subplots(figsize=(9, 3.8))
    for i, name in enumerate(names):
        r = report["rows"][name]
        ax.barh(i, r["tokens_per_s"], color="C0" if i == 0 else "C1", alpha=0.6)
        ax.plot(r["runs"], [i] * len(r["runs"]), "k.", ms=4)
    ax.set_yticks(range(len(names)), names)
    ax.invert_yaxis()
    ax.set(xlabel="tokens/s (bar: median; dots: runs)", title="batch 1, demo pair: the drafter in process or remote")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="specserve bench rounds", description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=str(DEFAULT_MODEL_DIR))
    p.add_argument("-k", type=int, default=4)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--round-trips", type=int, default=500)
    add_dtype_arg(p)
    p.add_argument("--out", type=out_prefix, default=str(REPO_ROOT / "docs" / "benchmarks" / "rounds"))
    argv = list(sys.argv[1:] if argv is None else argv)
    args = p.parse_args(argv)
    report = bench(args)
    report["png"] = Path(args.out).name + ".png"
    plot(report, args.out + ".png")
    write_results(args.out, report, markdown(report, ("specserve bench rounds " + shlex.join(argv)).strip()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
