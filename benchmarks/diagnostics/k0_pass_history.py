"""Diagnostic (prints, writes no result file): whether an adaptive pair that speculated at lower
loads runs its plain passes slower than a plain pair. Three pairs (plain, adaptive pipelined with
k <= 4, a second plain one), max_num_seqs 32, closed loop of 64-token greedy requests: 16
sequences fresh (two interleaved runs), then one run each at 1, 2, 4 and 8 sequences, then 16
again. Prints each run's tokens/s and the verifier's mean pass time, and each pair's pass shapes
(rows, width, attended span, compact: the batch in slots 0..b-1). Stop 44's run (the Zen 5 EPYC):
at 16 after the lower levels, the adaptive pair drafted nothing and its passes took 4.92-4.94 ms
against plain's 5.02-5.29 and the control's 4.87-4.97, every pair's 16-row passes compact; so the
batching bench's slower k = 0 passes of the adaptive row (batching_45459d5.md: 6.90 against 5.16
ms at 16) do not come from the pair's own state.

    .venv/bin/python benchmarks/diagnostics/k0_pass_history.py
"""
import time, collections, ray
from pathlib import Path
from specserve.benchmarks.bench import closed_loop, init_ray
from specserve.cluster.pair import SpeculativePair
from specserve.core.runner import load_tokenizer
from specserve.core.sampling import SamplingParams
from specserve.training.demo_pair import heldout_prompts
m = Path("models/demo"); tp, dp = str(m/"target"), str(m/"drafter")
prompts = heldout_prompts(m, 64, 64, load_tokenizer(tp))
init_ray(6)
modes = {"plain": (False, 0, "fixed"), "adaptive": (True, 4, "adaptive"), "control": (False, 0, "fixed")}
pairs = {}
for name, (pl, k, pol) in modes.items():
    pairs[name] = SpeculativePair(tp, dp, pipeline=pl, cpus_per_actor=1, max_num_seqs=32, max_waiting=32, speculation=pol)
    ray.get(pairs[name].submit(prompts[0], 64, SamplingParams(), k, ignore_eos=True))
def instrument(self):
    import collections
    f = self.engine.target.fast
    f._stats = collections.Counter()
    orig = f._pass
    def wrapped(ids, pos, wslot, wpos, last, slot, span, compact, *a):
        f._stats[(ids.shape[0], ids.shape[1], span, compact)] += 1
        return orig(ids, pos, wslot, wpos, last, slot, span, compact, *a)
    f._pass = wrapped
    return True
for p in pairs.values(): ray.get(p.verifier.__ray_call__.remote(instrument))
def level(c, tag, reps=2):
    for rep in range(reps):
        for name, (pl, k, pol) in modes.items():
            p = pairs[name]
            a = ray.get(p.verifier.times.remote()); t0 = time.perf_counter()
            outs = closed_loop(p, prompts, c, max(4 * c, 8), 64, k)
            wall = time.perf_counter() - t0; b = ray.get(p.verifier.times.remote())
            r = b["rounds"] - a["rounds"]
            print(f"{tag} c={c} {name:9s} tok/s {sum(len(o['token_ids']) for o in outs)/wall:7.1f} pass ms {1e3*(b['seconds']['pass']-a['seconds']['pass'])/r:.2f}", flush=True)
def stats(tag):
    for name, p in pairs.items():
        s = ray.get(p.verifier.__ray_call__.remote(lambda self: dict(self.engine.target.fast._stats)))
        noncompact = sum(v for k, v in s.items() if not k[3]); tot = sum(s.values())
        big = collections.Counter({k: v for k, v in s.items() if k[0] >= 12})
        print(tag, name, "passes", tot, "non-compact", noncompact, "top b>=12 shapes", big.most_common(4))
        ray.get(p.verifier.__ray_call__.remote(lambda self: self.engine.target.fast._stats.clear()))
level(16, "fresh"); stats("fresh")
for c in (1, 2, 4, 8): level(c, "hist", 1)
stats("hist lower")
level(16, "after"); stats("after")
