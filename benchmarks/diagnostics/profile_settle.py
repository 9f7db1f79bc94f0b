"""Diagnostic (prints, writes no result file): the adaptive policy's startup profile of the
drafter's on-demand calls (`profile_drafter`) back to back (settle 0) against settled (settle 2:
idle twice each call's time before the next), 3 runs alternating, on one pipelined pair (Ray +
gRPC, 8 sequence slots); then the on-demand (miss) calls of real rounds at one sequence, k = 4
(8 held-out prompts, 64 new tokens, greedy), median. Made the figures in profile_drafter's
docstring (verifier_service/policy.py):

    .venv/bin/python benchmarks/diagnostics/profile_settle.py
"""
import statistics, ray
from pathlib import Path
from specserve.cluster.pair import SpeculativePair
from specserve.benchmarks.bench import init_ray
from specserve.core.runner import load_tokenizer
from specserve.core.sampling import SamplingParams
from specserve.training.demo_pair import heldout_prompts
m = Path("models/demo")
init_ray(4)
p = SpeculativePair(str(m/"target"), str(m/"drafter"), pipeline=True, cpus_per_actor=1, max_num_seqs=8, speculation="fixed")
def profile(self, settle):
    import specserve.verifier.policy as pol
    fits = pol.profile_drafter(self.engine.proposers["draft_model"], self.engine.target.vocab_size, 8, 4, settle=settle)
    return {b: (round(f(1) * 1e3, 2), round(f(4) * 1e3, 2)) for b, f in fits.items()}
for rep in range(3):
    for settle in (0, 2):
        print(f"settle {settle}: M(1), M(4) ms by batch size", ray.get(p.verifier.__ray_call__.remote(profile, settle)))
def record(self):
    pol, self.misses = self.engine.policy, []
    orig = pol.observe_draft
    def observe(proposer, b, k, seconds, all_ready=False):
        if b == 1 and k == 4 and not all_ready:
            self.misses.append(seconds)
        return orig(proposer, b, k, seconds, all_ready)
    pol.observe_draft = observe
ray.get(p.verifier.__ray_call__.remote(record))
for prompt in heldout_prompts(m, 8, 64, load_tokenizer(str(m / "target"))):
    p.generate(prompt, 64, SamplingParams(), 4)
misses = ray.get(p.verifier.__ray_call__.remote(lambda self: self.misses))
print(f"real rounds, one sequence, k = 4: {len(misses)} misses, median {statistics.median(misses) * 1e3:.2f} ms")
p.shutdown()
