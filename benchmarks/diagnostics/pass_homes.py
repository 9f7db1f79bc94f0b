"""Diagnostic (prints, writes no result file): the demo target's width-1 and width-5 passes back to
back (200 each, medians of wall and the thread's CPU ms), in this process, in a Ray actor, and in two
child processes, one with OMP_NUM_THREADS=1 (what a Ray worker's environment sets) and one without;
the four in turn, 6 rounds. Stop 47 (the Xeon, noisy): CPU ms a width-1 pass, medians: this
process 8.60, actor 7.71, child with OMP_NUM_THREADS=1 8.22, child without 7.72 (width 5: 8.74,
7.75, 9.08, 9.29): no gap that a Ray worker's process would explain (see engine_homes.py).

    .venv/bin/python benchmarks/diagnostics/pass_homes.py
"""
import os, sys, time, statistics, subprocess, json
MODE = sys.argv[1] if len(sys.argv) > 1 else "main"

def passes(n=200):
    import torch
    torch.set_num_threads(1)
    from specserve.config import DEFAULT_MODEL_DIR
    from specserve.core.runner import ModelRunner
    r = getattr(passes, "runner", None)
    if r is None:
        r = passes.runner = ModelRunner.from_pretrained(str(DEFAULT_MODEL_DIR / "target"), name="target", slots=1)
        r.warmup(widths=(1, 5))
    r.prefill(list(range(10, 74)))
    out = {}
    for w in (1, 5):
        wall, cpu = [], []
        for i in range(n):
            t0, c0 = time.perf_counter(), time.thread_time()
            r.score([5] * w, last_only=False)
            wall.append(time.perf_counter() - t0); cpu.append(time.thread_time() - c0)
            r.rollback(w)
        out[w] = (1000 * statistics.median(wall), 1000 * statistics.median(cpu))
    r.release()
    return out

if MODE == "child":
    for _ in range(int(sys.argv[2])):
        print(json.dumps(passes()), flush=True)
        sys.stdin.readline()
    sys.exit()

import ray
from specserve.cluster.pair import start_ray
start_ray(num_cpus=8)
A = ray.remote(num_cpus=1)(type("A", (), {"run": lambda self: passes()}))
actor = A.remote()
REPS = 6
env = dict(os.environ, OMP_NUM_THREADS="1")
child = subprocess.Popen([sys.executable, __file__, "child", str(REPS)], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
child_plain = subprocess.Popen([sys.executable, __file__, "child", str(REPS)], env={k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
res = {k: [] for k in ("main", "actor", "child OMP=1", "child")}
for rep in range(REPS):
    res["main"].append(passes())
    res["actor"].append(ray.get(actor.run.remote()))
    res["child OMP=1"].append(json.loads(child.stdout.readline())); child.stdin.write("\n"); child.stdin.flush()
    res["child"].append(json.loads(child_plain.stdout.readline())); child_plain.stdin.write("\n"); child_plain.stdin.flush()
    print(rep, {k: v[-1] for k, v in res.items()}, flush=True)
for k, v in res.items():
    for w in ("1", "5"):
        vals = [x[w] if w in x else x[int(w)] for x in v]
        print(f"{k:12s} w={w}: wall {statistics.median(a for a, b in vals):.2f} ms, cpu {statistics.median(b for a, b in vals):.2f} ms")
