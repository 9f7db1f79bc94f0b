"""Diagnostic (prints, writes no result file): one engine configuration four ways in Ray actors,
fixed k = 4, greedy, at C concurrent sequences (closed loop, 4 x C requests of 64 new tokens per
run, two interleaved rounds of runs): plain; the remote drafter, sequential and pipelined; and
colocated (the drafter in the verifier's process). Prints tokens/s and the engine loop's ms per
round by phase, plus the verifier's and drafter's page faults and CPU per round.

    .venv/bin/python benchmarks/diagnostics/pair_modes.py 4 32    # C, max_num_seqs
"""
import sys, time, ray
from pathlib import Path
from transformers.utils import logging as hf_logging; hf_logging.disable_progress_bar()
from specserve.benchmarks.bench import init_ray, closed_loop
from specserve.cluster.pair import SpeculativePair
from specserve.core.sampling import SamplingParams
from specserve.core.runner import load_tokenizer
from specserve.training.demo_pair import heldout_prompts
m = Path("models/demo"); t, d = str(m/"target"), str(m/"drafter")
c = int(sys.argv[1])
prompts = heldout_prompts(m, 16, 64, load_tokenizer(t))
rows = {"plain": (dict(pipeline=False, speculation="fixed"), 0),
        "seq": (dict(pipeline=False, speculation="fixed"), 4),
        "pipe": (dict(pipeline=True, speculation="fixed"), 4),
        "coloc": (dict(pipeline=False, speculation="fixed", colocate=True), 4),
}
init_ray(16)
pairs = {}
for name, (kw, k) in rows.items():
    pairs[name] = SpeculativePair(t, d, cpus_per_actor=1, max_num_seqs=int(sys.argv[2]), max_waiting=int(sys.argv[2]), dtype="auto", **kw)
    ray.get(pairs[name].submit(prompts[0], 64, SamplingParams(), k, ignore_eos=True))
from ray.util.state import list_actors
acts = {a.actor_id: a.pid for a in list_actors(limit=1000)}
for rep in range(2):
    for name, (kw, k) in rows.items():
        p = pairs[name]
        vp = acts[p.verifier._actor_id.hex()]; dp = acts[p.drafter.actor._actor_id.hex()] if p.drafter else None
        def st(pid):
            f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
            return int(f[7]), int(f[11]) + int(f[12])  # minflt, utime+stime ticks
        s0 = st(vp); d0 = st(dp) if dp else (0, 0)
        b = ray.get(p.verifier.times.remote()); t0 = time.perf_counter()
        outs = closed_loop(p, prompts, c, 4 * c, 64, k)
        el = time.perf_counter() - t0; a = ray.get(p.verifier.times.remote())
        n = a["rounds"] - b["rounds"]; s1 = st(vp); d1 = st(dp) if dp else (0, 0)
        print("   verifier minflt/round", (s1[0]-s0[0])/n, "cpu ms/round", 10*(s1[1]-s0[1])/n, "drafter minflt/round", (d1[0]-d0[0])/n, "cpu ms/round", 10*(d1[1]-d0[1])/n)
        print(rep, name, f"{sum(len(o['token_ids']) for o in outs)/el:.1f} tok/s", n, " ".join(f"{ph} {1e3*(a['seconds'][ph]-b['seconds'][ph])/n:.2f}" for ph in a["seconds"] if a['seconds'][ph]-b['seconds'][ph] > 1e-5), flush=True)
