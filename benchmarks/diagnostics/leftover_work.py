"""Diagnostic (prints, writes no result file): does a pipelined fixed-k pair (Ray + gRPC, 32
slots) keep working after a closed-loop run of C concurrent requests (4 x C greedy requests of
64 held-out prompt tokens, 64 new tokens) has ended? Prints the drafter's and the verifier's CPU
seconds 0.1-1.6 s after each of three runs. Made the "leftover drafter work" figure of stop 27 in
docs/benchmarks/README.md:

    .venv/bin/python benchmarks/diagnostics/leftover_work.py 16
"""
import sys, time, ray
from pathlib import Path
from specserve.cluster.pair import SpeculativePair
from specserve.benchmarks.bench import init_ray, closed_loop
from specserve.core.runner import load_tokenizer
from specserve.core.sampling import SamplingParams
from specserve.training.demo_pair import heldout_prompts
C = int(sys.argv[1]) if len(sys.argv) > 1 else 16
m = Path("models/demo")
prompts = heldout_prompts(m, 4 * C, 64, load_tokenizer(str(m / "target")))
init_ray(4)
p = SpeculativePair(str(m/"target"), str(m/"drafter"), pipeline=True, cpus_per_actor=1, max_num_seqs=32, max_waiting=32, speculation="fixed")
ray.get(p.submit(prompts[0], 64, SamplingParams(), 4, ignore_eos=True))


def cpu(self):
    import time as _t
    return _t.process_time()


for rep in range(3):
    closed_loop(p, prompts, C, 4 * C, 64, 4)
    t0 = time.perf_counter()
    marks = []
    for wait in (0, 0.1, 0.2, 0.4, 0.8, 1.6):
        while time.perf_counter() - t0 < wait:
            time.sleep(0.005)
        marks.append((wait, ray.get(p.drafter.actor.__ray_call__.remote(cpu)), ray.get(p.verifier.__ray_call__.remote(cpu))))
    print(rep, "seconds after the run, drafter and verifier CPU seconds since:",
          [(w, round(d - marks[0][1], 3), round(v - marks[0][2], 3)) for w, d, v in marks], flush=True)
p.shutdown()
