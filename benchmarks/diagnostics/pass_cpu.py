"""Diagnostic (prints, writes no result file): two pairs under the batching bench's closed loop,
their target passes timed by wall clock and by the engine thread's CPU time. Pairs: "adaptive"
(a plain pair, then an adaptive one), "control" (two identical plain pairs) or "all" (plain,
adaptive, and a second plain pair). Levels as given,
one run of each pair per level, alternating (4 x C greedy requests of 64 held-out prompt tokens,
64 new tokens). Printed per run: tokens/s, and the full-batch width-1 passes' median wall and CPU
ms. Two identical plain pairs parted by up to 9% in a run, their passes' CPU time with them: the
spread any one-run ratio to plain carries on this machine.

    .venv/bin/python benchmarks/diagnostics/pass_cpu.py control 4,16,16,4
"""
import statistics, sys, time, ray
from pathlib import Path
from specserve.cluster.pair import SpeculativePair
from specserve.benchmarks.bench import init_ray, closed_loop
from specserve.core.runner import load_tokenizer
from specserve.core.sampling import SamplingParams
from specserve.training.demo_pair import heldout_prompts
which = sys.argv[1] if len(sys.argv) > 1 else "control"
levels = [int(x) for x in (sys.argv[2] if len(sys.argv) > 2 else "4,16").split(",")]
m = Path("models/demo")
prompts = heldout_prompts(m, 4 * max(levels), 64, load_tokenizer(str(m / "target")))
kinds = {"adaptive": (("plain", "fixed", 0), ("adaptive", "adaptive", 4)),
         "control": (("plain A", "fixed", 0), ("plain B", "fixed", 0)),
         "all": (("plain", "fixed", 0), ("adaptive", "adaptive", 4), ("control", "fixed", 0))}[which]
init_ray(2 * len(kinds))
pairs = {name: SpeculativePair(str(m / "target"), str(m / "drafter"), pipeline=True, cpus_per_actor=1,
                               max_num_seqs=32, max_waiting=32, speculation=sp) for name, sp, _ in kinds}
K = {name: k for name, _, k in kinds}


def instrument(self):
    import time as _t
    self._log, score = [], self.engine.target.score_batch
    def timed(batch, *a, **kw):
        w0, c0 = _t.perf_counter(), _t.thread_time()
        out = score(batch, *a, **kw)
        self._log.append((_t.perf_counter() - w0, _t.thread_time() - c0, len(batch), max(len(t) for _, t in batch)))
        return out
    self.engine.target.score_batch = timed


def take(self):
    out, self._log = self._log, []
    return out


for name, p in pairs.items():
    ray.get(p.verifier.__ray_call__.remote(instrument))
    ray.get(p.submit(prompts[0], 64, SamplingParams(), K[name], ignore_eos=True))
for i, c in enumerate(levels):
    rates = {}
    for name, p in pairs.items():
        ray.get(p.verifier.__ray_call__.remote(take))
        t0 = time.perf_counter()
        outs = closed_loop(p, prompts, c, 4 * c, 64, K[name])
        dt = time.perf_counter() - t0
        log = ray.get(p.verifier.__ray_call__.remote(take))
        rates[name] = sum(len(o["token_ids"]) for o in outs) / dt
        x = [(w, cpu) for w, cpu, b, width in log if width == 1 and b >= c - 1]
        print(f"run {i} C={c} {name}: {rates[name]:.1f} tok/s; {len(x)} full width-1 passes, median "
              f"{1e3 * statistics.median(w for w, _ in x):.2f} ms wall, {1e3 * statistics.median(u for _, u in x):.2f} ms CPU",
              flush=True)
    first, *others = rates.values()
    print("  over the first: " + ", ".join(f"{n} {r / first:.2f}x" for n, r in list(rates.items())[1:]), flush=True)
for p in pairs.values():
    p.shutdown()
