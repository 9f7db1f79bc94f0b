"""Diagnostic (prints, writes no result file): what the guard's view of a round misses. A fixed-k
pipelined pair and a plain pair (Ray + gRPC, 32 slots) under a closed loop of C concurrent requests
(4 x C greedy requests, 64 held-out prompt tokens, 64 new tokens), 3 runs each, alternating. Every
round's (batch size, tokens, the engine loop's seconds from its step's start, as the guard counts
them) is logged; printed per run: the client's tokens/s, the logged rounds' tokens over their
seconds (all, and per batch size), and the share of the client's wall time the logged seconds cover.

    .venv/bin/python benchmarks/diagnostics/guard_view.py 4
"""
import sys, time, ray
from collections import defaultdict
from pathlib import Path
from specserve.cluster.pair import SpeculativePair
from specserve.benchmarks.bench import init_ray, closed_loop
from specserve.core.runner import load_tokenizer
from specserve.core.sampling import SamplingParams
from specserve.training.demo_pair import heldout_prompts
C = int(sys.argv[1]) if len(sys.argv) > 1 else 4
m = Path("models/demo")
prompts = heldout_prompts(m, 4 * C, 64, load_tokenizer(str(m / "target")))
init_ray(4)
pairs = {name: SpeculativePair(str(m/"target"), str(m/"drafter"), pipeline=True, cpus_per_actor=1, max_num_seqs=32,
                               max_waiting=32, speculation="fixed") for name in ("fixed k", "plain")}
K = {"fixed k": 4, "plain": 0}


def instrument(self):
    policy = self.engine.policy
    self._log, observe = [], policy.observe_outcome
    def logged(b, tokens, seconds):
        self._log.append((b, tokens, seconds))
        observe(b, tokens, seconds)
    policy.observe_outcome = logged


def take(self):
    out, self._log = self._log, []
    return out


for name, p in pairs.items():
    ray.get(p.verifier.__ray_call__.remote(instrument))
    ray.get(p.submit(prompts[0], 64, SamplingParams(), K[name], ignore_eos=True))
for rep in range(3):
    for name, p in pairs.items():
        ray.get(p.verifier.__ray_call__.remote(take))
        t0 = time.perf_counter()
        outs = closed_loop(p, prompts, C, 4 * C, 64, K[name])
        dt = time.perf_counter() - t0
        log = ray.get(p.verifier.__ray_call__.remote(take))
        tokens = sum(len(o["token_ids"]) for o in outs)
        by_b = defaultdict(lambda: [0, 0.0, 0])
        for b, t, s in log:
            by_b[b][0] += t
            by_b[b][1] += s
            by_b[b][2] += 1
        print(name, rep, "client %.1f tok/s;" % (tokens / dt), "logged %.1f tok/s over %.0f%% of the wall;"
              % (sum(t for _, t, _ in log) / sum(s for _, _, s in log), 100 * sum(s for _, _, s in log) / dt),
              "per b (rounds, tok/s):", {b: (n, round(t / s, 1)) for b, (t, s, n) in sorted(by_b.items())}, flush=True)
for p in pairs.values():
    p.shutdown()
