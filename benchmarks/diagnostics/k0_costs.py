"""Diagnostic (prints, writes no result file): what an adaptive pair costs while it drafts
nothing. Three pairs (Ray + gRPC, pipelined, 32 sequence slots) under a closed loop of C
concurrent requests (4 x C greedy requests of 64 held-out prompt tokens, 64 new tokens): "k0",
an adaptive pair whose policy is made to choose k = 0 every round with speculation on (its
sequences are started on the drafter, caught up every CATCH_UP_TOKENS tokens and released, as
rows that draft nothing while speculation is on; with it off the drafter rests since stop 67);
"k0nocatch", the same without the catch-up calls; "plain", requests with k = 0 (nothing started
on the drafter). Runs alternate, 3 of each; tokens/s and the engine loop's ms per round by phase.
Made the "k = 0 costs" figures in docs/benchmarks/README.md:

    .venv/bin/python benchmarks/diagnostics/k0_costs.py 2

With a second argument N the second pair catches up every N tokens instead of never (its name
becomes "k0cN"): stop 26's A/B of CATCH_UP_TOKENS 16 against 64 at 8 and 16 sequences was

    .venv/bin/python benchmarks/diagnostics/k0_costs.py 8 64   (and 16 64)
"""
import sys, time, ray
from pathlib import Path
from specserve.cluster.pair import SpeculativePair
from specserve.benchmarks.bench import init_ray, closed_loop
from specserve.core.runner import load_tokenizer
from specserve.core.sampling import SamplingParams
from specserve.training.demo_pair import heldout_prompts
C = int(sys.argv[1]) if len(sys.argv) > 1 else 2
CATCH = int(sys.argv[2]) if len(sys.argv) > 2 else None  # the second pair's catch-up interval (None: never)
SECOND = "k0nocatch" if CATCH is None else f"k0c{CATCH}"
m = Path("models/demo")
prompts = heldout_prompts(m, 4 * C, 64, load_tokenizer(str(m / "target")))
init_ray(4)
pairs = {name: SpeculativePair(str(m/"target"), str(m/"drafter"), pipeline=True, cpus_per_actor=1, max_num_seqs=32,
                               max_waiting=32, speculation=sp)
         for name, sp in (("k0", "adaptive"), (SECOND, "adaptive"), ("plain", "fixed"))}
def force0(self):
    self.engine.policy.choose = lambda limits, *a, **kw: [0] * len(limits)
    self.engine.policy.on = True  # (on: the drafter is fed; off, it rests since stop 67, and this would measure nothing)
def nocatch(self):
    import specserve.verifier.engine as e
    e.CATCH_UP_TOKENS = 10 ** 9 if CATCH is None else CATCH
for name in ("k0", SECOND):
    ray.get(pairs[name].verifier.__ray_call__.remote(force0))
ray.get(pairs[SECOND].verifier.__ray_call__.remote(nocatch))
for name, p in pairs.items():
    ray.get(p.submit(prompts[0], 64, SamplingParams(), 4 if name != "plain" else 0, ignore_eos=True))
for rep in range(3):
    for name, p in pairs.items():
        a = ray.get(p.verifier.times.remote())
        t0 = time.perf_counter()
        outs = closed_loop(p, prompts, C, 4 * C, 64, 4 if name != "plain" else 0)
        dt = time.perf_counter() - t0
        b = ray.get(p.verifier.times.remote())
        r = b["rounds"] - a["rounds"]
        print(name, rep, "%.1f tok/s" % (sum(len(o["token_ids"]) for o in outs) / dt), "rounds", r,
              "wall/round %.2f" % (1e3 * dt / r), {k: round(1e3 * (b["seconds"][k] - a["seconds"][k]) / r, 2) for k in b["seconds"]},
              flush=True)
for p in pairs.values():
    p.shutdown()
