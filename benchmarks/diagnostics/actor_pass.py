"""Diagnostic (prints, writes no result file): a verifier engine in a Ray actor (remote drafter
actor, sequential, fixed k = 4, greedy), its width-5 target passes timed inside the engine (wall
and the loop thread's CPU; requests submitted inside the actor, then through Ray calls as the
batching bench does), against the same runner's passes back to back in the same actor.

    .venv/bin/python benchmarks/diagnostics/actor_pass.py 1    # sequences
"""
import sys, time, statistics, ray
from pathlib import Path
from specserve.cluster.pair import start_ray
from specserve.builder import start_drafter
from specserve.config import SpecServeConfig
m = Path("/work/main/models/demo")
start_ray(num_cpus=4)

@ray.remote(num_cpus=1, max_concurrency=16)
class Probe:
    def __init__(self, cfg, drafter):
        import torch
        torch.set_num_threads(1)
        from transformers.utils import logging as hf_logging; hf_logging.disable_progress_bar()
        from specserve.builder import build_engine
        from specserve.config import SpecServeConfig
        self.cfg = SpecServeConfig.from_dict(cfg)
        self.engine = build_engine(self.cfg, drafter.address if drafter is not None else None)
        self.T = {"score": [], "cpu": [], "shape": []}
        orig = self.orig = self.engine.target.score_batch
        def score(batch, **kw):
            t0, c0 = time.perf_counter(), time.thread_time(); out = orig(batch, **kw)
            self.T["score"].append(time.perf_counter() - t0); self.T["cpu"].append(time.thread_time() - c0); self.T["shape"].append(tuple(len(t) for _, t in batch)); return out
        self.engine.target.score_batch = score
        self.engine.start()
    def generate(self, prompt, n, k):
        from specserve.core.sampling import SamplingParams
        r = self.engine.submit(prompt, n, SamplingParams(), k, ignore_eos=True); r.done.wait(); return len(r.result().token_ids)
    def local(self, prompts, b, k, waves):
        from specserve.core.sampling import SamplingParams
        for v in self.T.values(): v.clear()
        for _ in range(waves):
            reqs = [self.engine.submit(prompts[i], 64, SamplingParams(), k, ignore_eos=True) for i in range(b)]
            for r in reqs: r.done.wait()
        return self.summary(b)
    def summary(self, b):
        full = [i for i, s in enumerate(self.T["shape"]) if len(s) == b and all(x == 5 for x in s)]
        return len(full), 1e3 * statistics.median([self.T["score"][i] for i in full]), 1e3 * statistics.median([self.T["cpu"][i] for i in full])
    def reset(self):
        for v in self.T.values(): v.clear()
    def alone(self, b):
        t = self.engine.target
        self.engine.stop()
        t.prefill_batch([(s, list(range(1, 97))) for s in range(b)])
        ts, cs = [], []
        for _ in range(60):
            t0, c0 = time.perf_counter(), time.thread_time(); self.orig([(s, [5, 6, 7, 8, 9]) for s in range(b)]); ts.append(time.perf_counter() - t0); cs.append(time.thread_time() - c0)
            for s in range(b): t.rollback(5, slot=s)
        return 1e3 * statistics.median(ts), 1e3 * statistics.median(cs)

from specserve.core.runner import load_tokenizer
from specserve.training.demo_pair import heldout_prompts
b = int(sys.argv[1])
prompts = heldout_prompts(m, 16, 64, load_tokenizer(str(m / "target")))
cfg = SpecServeConfig(target=str(m/"target"), drafter=str(m/"drafter"), k=4, max_num_seqs=32, max_waiting=32, pipeline=False, speculation="fixed", cpus_per_actor=1)
drafter = start_drafter(cfg)
p = Probe.remote(cfg.to_dict(), drafter)
ray.get(p.local.remote(prompts, 1, 4, 1))
print("in-actor, requests submitted inside the actor:", ray.get(p.local.remote(prompts, b, 4, 3)))
ray.get(p.reset.remote())
for _ in range(3):
    ray.get([p.generate.remote(prompts[i], 64, 4) for i in range(b)])
print("in-actor, requests through Ray calls (as the bench):", ray.get(p.summary.remote(b)))
print("the same runner alone in the actor (wall, cpu):", ray.get(p.alone.remote(b)))
