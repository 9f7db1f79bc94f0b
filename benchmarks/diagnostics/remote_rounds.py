"""Diagnostic (prints, writes no result file): the remote sequential path against the in-process
engine, one pair alive, batch 1, k = 4, the engine's round times by phase (ms per round), 3 runs
of 6 held-out prompts, runs alternating. Made the "one pair alive" figures in
docs/benchmarks/README.md:

    .venv/bin/python benchmarks/diagnostics/remote_rounds.py
"""
import time, ray, torch
from pathlib import Path
from specserve.cluster.pair import SpeculativePair, start_ray
from specserve.core.runner import load_tokenizer, ModelRunner
from specserve.core.sampling import SamplingParams
from specserve.training.demo_pair import heldout_prompts
from specserve.drafter.draft_model import DraftModelProposer
from specserve.verifier.engine import SpeculativeEngine
torch.set_num_threads(1)
start_ray(num_cpus=4)
m = Path("models/demo")
prompts = heldout_prompts(m, 6, 64, load_tokenizer(str(m / "target")))
pair = SpeculativePair(str(m/"target"), str(m/"drafter"), pipeline=False, cpus_per_actor=1, speculation="fixed")
eng = SpeculativeEngine(ModelRunner.from_pretrained(str(m/"target")), DraftModelProposer(ModelRunner.from_pretrained(str(m/"drafter"), role="drafter")))
def show(name, t0, t1, wall):
    r = t1["rounds"] - t0["rounds"]
    print(name, "rounds", r, "wall ms/round %.2f" % (1e3*wall/r), {k: round(1e3*(t1["seconds"][k]-t0["seconds"][k])/r, 2) for k in t1["seconds"]})
for rep in range(3):
    for p in prompts[:1]: pair.generate(p, 64, SamplingParams(), 4); eng.generate(p, 64, SamplingParams(), 4)
    a = ray.get(pair.verifier.times.remote()); t = time.perf_counter()
    for p in prompts: pair.generate(p, 64, SamplingParams(), 4)
    show("remote", a, ray.get(pair.verifier.times.remote()), time.perf_counter() - t)
    a = eng.times.to_dict(); a = {"rounds": a["rounds"], "seconds": dict(a["seconds"])}; t = time.perf_counter()
    for p in prompts: eng.generate(p, 64, SamplingParams(), 4)
    show("local ", a, eng.times.to_dict(), time.perf_counter() - t)
pair.shutdown()
