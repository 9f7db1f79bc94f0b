"""Diagnostic (prints, writes no result file): the same colocated engine (the drafter in the
engine's process, no gRPC), batch 1, k = 4 fixed, greedy, demo pair, one torch thread, in three
homes: this process (as `bench overhead`'s "in process" rows), a Ray actor (`SpeculativePair` with
`colocate: true`, one request at a time through Ray), and a Serve replica (the app with
`colocate: true`, through the openai client, non-streamed). Plain and speculative rows, all up
before any is timed, interleaved, every other round in reverse. For the actor, also the engine's
own time (from the actor's receipt of a request to its last round), so the Ray call is apart,
and for this process and the actor the engine loop's ms per round by phase (RoundTimes).

Stop 47 (the Xeon of stop 46, noisy): actor / in process 0.85x plain, 0.89x speculative; served
(colocated) / in process 0.90x plain, 0.82x speculative. Inside the actor the engine's passes took
more CPU time than in this process (plain: 8.81 against 7.49 ms a round; speculative: pass 10.22
against 9.14, drafting 8.23 against 7.36), with no wait for the CPU or the GIL (wall and CPU
alike). A check just after (pass_homes.py), the target's passes back to back (no engine) in this process,
a Ray actor and two child processes (OMP_NUM_THREADS=1 set or not, the one environment variable of
a Ray worker that could matter), alternating, had the actor as fast as the fastest (medians 7.7 ms of CPU a pass, against 7.7-9.3 for
the others): the machine's drift, not the process, so this run's gap is not a finding.

    .venv/bin/python benchmarks/diagnostics/engine_homes.py 6 5    # prompts, repeats
"""
import contextlib
import dataclasses
import statistics
import sys
import time

import ray
import torch

from specserve.benchmarks.overhead import _complete
from specserve.builder import build_engine
from specserve.cluster.pair import SpeculativePair, start_ray
from specserve.config import DEFAULT_MODEL_DIR, SpecServeConfig
from specserve.core.runner import load_tokenizer
from specserve.core.sampling import SamplingParams
from specserve.training.demo_pair import heldout_prompts

N, REPEATS = (int(a) for a in (sys.argv[1:] + ["6", "5"])[:2])
MAX_TOKENS = 64


@contextlib.contextmanager
def in_process_rows(cfg):
    engine = build_engine(cfg)
    engine.start()

    def one(k):
        def run(p):
            req = engine.submit(p, MAX_TOKENS, SamplingParams(), k, ignore_eos=True)
            req.done.wait()
            return len(req.result().token_ids)
        return run
    try:
        yield {"in process: plain": one(0), "in process: speculative": one(cfg.k)}, engine.times.to_dict
    finally:
        engine.stop()


@contextlib.contextmanager
def actor_rows(cfg):
    pair = SpeculativePair(cfg.target, cfg.drafter, pipeline=False, colocate=True, cpus_per_actor=1, k=cfg.k,
                           speculation=cfg.speculation, max_num_seqs=1)
    inner = {"plain": [], "speculative": []}

    def one(mode):
        def run(p):
            out = ray.get(pair.submit(p, MAX_TOKENS, SamplingParams(), cfg.k if mode == "speculative" else 0,
                                      ignore_eos=True))
            inner[mode].append((len(out["token_ids"]), out["chunks"][-1][0] - out["start"]))
            return len(out["token_ids"])
        return run
    try:
        yield ({"actor: plain": one("plain"), "actor: speculative": one("speculative")}, inner,
               lambda: ray.get(pair.verifier.times.remote()))
    finally:
        pair.shutdown()


@contextlib.contextmanager
def served_rows(cfg):
    import openai
    from ray import serve

    from specserve.benchmarks.endpoint import _free_port
    from specserve.cluster.serve_app import build_app
    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app(dataclasses.replace(cfg, colocate=True).to_dict()), name="homes", route_prefix="/")
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=600)
    try:
        yield {f"served: {mode}": (lambda p, extra=({"ignore_eos": True, **({"speculative": {"method": "none"}}
                                                                            if mode == "plain" else {})}):
                                   _complete(client, cfg.model, p, MAX_TOKENS, extra, False))
               for mode in ("plain", "speculative")}
    finally:
        serve.delete("homes")
        serve.shutdown()


def main():
    torch.set_num_threads(1)
    models = DEFAULT_MODEL_DIR
    cfg = SpecServeConfig(target=str(models / "target"), drafter=str(models / "drafter"), k=4, max_num_seqs=1,
                          device="cpu", compile=False, speculation="fixed")
    prompts = heldout_prompts(models, N, 64, load_tokenizer(cfg.target))
    start_ray(num_cpus=8)
    with contextlib.ExitStack() as stack:
        rows, driver_times = stack.enter_context(in_process_rows(cfg))
        actor, inner, actor_times = stack.enter_context(actor_rows(cfg))
        rows.update(actor)
        clocks = {"in process": driver_times, "actor": actor_times}
        phases = {row: {} for row in rows if row.split(":")[0] in clocks}
        rows.update(stack.enter_context(served_rows(cfg)))
        runs = {row: [] for row in rows}
        inner_runs = {m: [] for m in inner}
        names = list(rows)
        for rep in range(REPEATS + 1):
            for row in (names if rep % 2 else names[::-1]):
                for m in inner:
                    inner[m].clear()
                clock = clocks.get(row.split(":")[0])
                before = clock() if clock else None
                t0 = time.perf_counter()
                n = sum(rows[row](p) for p in prompts)
                if rep and clock:
                    after, acc = clock(), phases[row]
                    for ph, v in after["seconds"].items():
                        acc[ph] = acc.get(ph, 0.0) + v - before["seconds"][ph]
                    acc["pass_cpu"] = acc.get("pass_cpu", 0.0) + after["pass_cpu"] - before["pass_cpu"]
                    acc["rounds"] = acc.get("rounds", 0) + after["rounds"] - before["rounds"]
                if rep:
                    runs[row].append(n / (time.perf_counter() - t0))
                    for m in inner:
                        if inner[m] and row == f"actor: {m}":
                            inner_runs[m].append(sum(c for c, _ in inner[m]) / sum(s for _, s in inner[m]))
            print(f"repeat {rep}: " + ", ".join(f"{r} {runs[r][-1]:.1f}" for r in names if runs[r]), flush=True)
    med = {row: statistics.median(r) for row, r in runs.items()}
    for row in names:
        print(f"{row:28s} {med[row]:7.1f} tok/s  ({', '.join(f'{x:.1f}' for x in runs[row])})")
    for m in inner_runs:
        print(f"actor: {m}, inside the actor {statistics.median(inner_runs[m]):7.1f} tok/s")
    for row, acc in phases.items():
        r = max(acc.get("rounds", 0), 1)
        print(f"{row:28s} ms/round: " + ", ".join(f"{ph} {1000 * v / r:.2f}" for ph, v in acc.items() if ph != "rounds"
                                                   and v > 0) + f" ({r} rounds)")
    for m in ("plain", "speculative"):
        base = med[f"in process: {m}"]
        print(f"{m}: actor / in process {med[f'actor: {m}'] / base:.2f}x (inside {statistics.median(inner_runs[m]) / base:.2f}x),"
              f" served / in process {med[f'served: {m}'] / base:.2f}x")


if __name__ == "__main__":
    main()
