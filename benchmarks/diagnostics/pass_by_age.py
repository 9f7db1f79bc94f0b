"""Diagnostic (prints, writes no result file): why an adaptive pair's plain passes are slower than
a plain pair's. An adaptive pair and a plain pair (Ray + gRPC, pipelined, 32 slots) under a closed
loop of C concurrent requests (4 x C greedy requests, 64 held-out prompt tokens, 64 new tokens),
runs alternating, 3 of each. Each target pass of the verifier is timed with the round's largest k
and the rounds since the last drafting round ("age"); printed: tokens/s, each pair's median pass
of width 1 by age bucket, and the CPU seconds of the verifier and drafter processes per run.

    .venv/bin/python benchmarks/diagnostics/pass_by_age.py 8
"""
import statistics, sys, time, ray
from pathlib import Path
from specserve.cluster.pair import SpeculativePair
from specserve.benchmarks.bench import init_ray, closed_loop
from specserve.core.runner import load_tokenizer
from specserve.core.sampling import SamplingParams
from specserve.training.demo_pair import heldout_prompts
C = int(sys.argv[1]) if len(sys.argv) > 1 else 8  # (-v: the policy's view after each adaptive run)
m = Path("models/demo")
prompts = heldout_prompts(m, 4 * C, 64, load_tokenizer(str(m / "target")))
init_ray(4)
pairs = {name: SpeculativePair(str(m/"target"), str(m/"drafter"), pipeline=True, cpus_per_actor=1, max_num_seqs=32,
                               max_waiting=32, speculation=sp)
         for name, sp in (("adaptive", "adaptive"), ("plain", "fixed"))}


def instrument(self):
    import time as _t
    e = self.engine
    self._log, self._age, self._k = [], 99, 0
    choose, score = e.policy.choose, e.target.score_batch
    def c(*a, **kw):
        out = choose(*a, **kw)
        self._k = max(out) if out else 0
        return out
    def s(batch, *a, **kw):
        t0 = _t.perf_counter()
        out = score(batch, *a, **kw)
        self._log.append((_t.perf_counter() - t0, len(batch), max(len(t) for _, t in batch), self._age))
        self._age = 0 if max(len(t) for _, t in batch) > 1 else self._age + 1
        return out
    e.policy.choose, e.target.score_batch = c, s


def take(self):
    out, self._log = self._log, []
    return out


def cpu(self):
    import time as _t
    return _t.process_time()


for p in pairs.values():
    ray.get(p.verifier.__ray_call__.remote(instrument))
for name, p in pairs.items():
    ray.get(p.submit(prompts[0], 64, SamplingParams(), 4 if name == "adaptive" else 0, ignore_eos=True))
logs = {n: [] for n in pairs}
for rep in range(3):
    for name, p in pairs.items():
        ray.get(p.verifier.__ray_call__.remote(take))
        c0 = ray.get([p.verifier.__ray_call__.remote(cpu), p.drafter.actor.__ray_call__.remote(cpu)])
        t0 = time.perf_counter()
        outs = closed_loop(p, prompts, C, 4 * C, 64, 4 if name == "adaptive" else 0)
        dt = time.perf_counter() - t0
        c1 = ray.get([p.verifier.__ray_call__.remote(cpu), p.drafter.actor.__ray_call__.remote(cpu)])
        log = ray.get(p.verifier.__ray_call__.remote(take))
        logs[name] += log
        print(name, rep, "%.1f tok/s" % (sum(len(o["token_ids"]) for o in outs) / dt), "passes", len(log),
              "wide", sum(w > 1 for _, _, w, _ in log), "cpu verifier %.2f drafter %.2f of %.2f s wall"
              % (c1[0] - c0[0], c1[1] - c0[1], dt), flush=True)
        if name == "adaptive" and "-v" in sys.argv:
            st = ray.get(p.verifier.policy.remote())
            print("  calibration", st["calibration"], "\n  overhead", st["round_overhead_ms"],
                  "\n  pass", {k: v for k, v in st["target_pass_ms"].items() if k.split("x")[0] in ("4", "8", "16")},
                  "\n  draft", st["draft_ms_for_k_1_and_4"], "ready", st["ready_call_ms"], st["ready_after_all_accepted"],
                  "\n  recent", st["recent_choices_b_k_rate0_ratebest_probe"][-12:], "\n  guard", st["guard"], flush=True)
for name, log in logs.items():
    for lo, hi in ((0, 0), (1, 8), (9, 32), (33, 10 ** 9)):
        xs = [1e3 * d for d, b, w, a in log if w == 1 and lo <= a <= hi and b >= C - 1]
        if xs:
            print(name, f"age {lo}-{hi}", "n", len(xs), "median %.2f ms" % statistics.median(xs))
    xs = [1e3 * d for d, b, w, a in log if w > 1]
    if xs:
        print(name, "wide passes", len(xs), "median %.2f ms" % statistics.median(xs))
for p in pairs.values():
    p.shutdown()
