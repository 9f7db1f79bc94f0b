"""Diagnostic (prints, writes no result file): what runs beside the target passes. An adaptive and a
plain pair under the closed loop at the levels given (4 x C requests each), one run each per
level, alternating; from the third level on, every full-batch width-1 pass is logged with the CPU
seconds its drafter process and its verifier's other threads used meanwhile (/proc schedstat,
read before and after each pass, which slows the passes: compare the pairs, not the figures with
other files). Printed: passes by what ran beside them, their median wall and CPU ms.

    .venv/bin/python benchmarks/diagnostics/pass_overlap.py 4,8,16,16,16
"""
import statistics, sys, time, ray
from pathlib import Path
from specserve.cluster.pair import SpeculativePair
from specserve.benchmarks.bench import init_ray, closed_loop
from specserve.core.runner import load_tokenizer
from specserve.core.sampling import SamplingParams
from specserve.training.demo_pair import heldout_prompts
m = Path("models/demo")
seq = [int(x) for x in sys.argv[1].split(",")]
prompts = heldout_prompts(m, 4 * max(seq), 64, load_tokenizer(str(m / "target")))
init_ray(4)
kinds = (("adaptive", "adaptive", 4), ("plain", "fixed", 0))
pairs = {n: SpeculativePair(str(m/"target"), str(m/"drafter"), pipeline=True, cpus_per_actor=1, max_num_seqs=32,
                            max_waiting=32, speculation=sp) for n, sp, _ in kinds}
K = {n: k for n, _, k in kinds}
def pid(self):
    import os
    return os.getpid()
def instrument(self, dpid):
    import os, time as _t, threading
    me = threading.get_native_id
    def cpu_of(p, skip=None):
        tot = 0
        for tid in os.listdir(f"/proc/{p}/task"):
            if skip is not None and int(tid) == skip:
                continue
            try: tot += int(open(f"/proc/{p}/task/{tid}/schedstat").read().split()[0])
            except OSError: pass
        return tot
    self._log, score = [], self.engine.target.score_batch
    mypid = os.getpid()
    def timed(batch, *a, **kw):
        eng = me()
        d0, o0 = cpu_of(dpid), cpu_of(mypid, skip=eng)
        w0, c0 = _t.perf_counter(), _t.thread_time()
        out = score(batch, *a, **kw)
        w1, c1 = _t.perf_counter(), _t.thread_time()
        d1, o1 = cpu_of(dpid), cpu_of(mypid, skip=eng)
        self._log.append((w1 - w0, c1 - c0, len(batch), max(len(t) for _, t in batch), (d1 - d0) / 1e9, (o1 - o0) / 1e9))
        return out
    self.engine.target.score_batch = timed
def take(self):
    out, self._log = self._log, []
    return out
for n, p in pairs.items():
    dp = ray.get(p.drafter.actor.__ray_call__.remote(pid))
    ray.get(p.verifier.__ray_call__.remote(instrument, dp))
    ray.get(p.submit(prompts[0], 64, SamplingParams(), K[n], ignore_eos=True))
logs = {n: [] for n in pairs}
for i, c in enumerate(seq):
    for n, p in pairs.items():
        ray.get(p.verifier.__ray_call__.remote(take))
        t0 = time.perf_counter()
        outs = closed_loop(p, prompts, c, 4 * c, 64, K[n])
        dt = time.perf_counter() - t0
        log = ray.get(p.verifier.__ray_call__.remote(take))
        print(f"run {i} C={c} {n}: {sum(len(o['token_ids']) for o in outs)/dt:.1f} tok/s", flush=True)
        if i >= 2: logs[n] += [x for x in log if x[3] == 1 and x[2] >= c - 1]
C = seq[-1]
for n, log in logs.items():
    if not log: continue
    quiet = [x for x in log if x[4] < 1e-4 and x[5] < 1e-4]
    dbusy = [x for x in log if x[4] >= 1e-4]
    obusy = [x for x in log if x[5] >= 1e-4 and x[4] < 1e-4]
    for name, xs in (("all", log), ("quiet", quiet), ("drafter busy", dbusy), ("other verifier threads busy", obusy)):
        if xs:
            print(f"{n} {name}: n={len(xs)} wall {1e3*statistics.median(x[0] for x in xs):.2f} cpu {1e3*statistics.median(x[1] for x in xs):.2f} "
                  f"drafter cpu during {1e3*statistics.mean(x[4] for x in xs):.2f} other {1e3*statistics.mean(x[5] for x in xs):.2f} ms")
for p in pairs.values():
    p.shutdown()
