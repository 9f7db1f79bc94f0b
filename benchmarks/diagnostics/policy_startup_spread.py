"""Diagnostic (prints, writes no result file): one fresh adaptive pair (Ray + gRPC, pipelined,
32 slots), one warm-up request, then closed-loop runs at 1, 1, 2 and 2 sequences (4 x C requests
of 64 held-out prompt tokens, 64 new tokens, at least 8): tokens/s and rounds by k per run, then
the policy's last choices and its state (startup profile, M(k) fits, guard, calibrations).
Stop 44 (the Zen 5 EPYC), two fresh pairs a minute apart. The first: at one sequence 88-113 of
about 210 rounds drafted nothing (444 and 431 tok/s), at two its guard vetoed speculation
(608-648 tok/s), and its M(1, k) fit at the end stood at 5.4 ms for k = 1 and 4 alike. The
second (run at one sequence only): every round but one drafted (511 and 552 tok/s), M(1, 1) =
1.2 and M(1, 4) = 4.8 ms. Two identical fresh pairs can differ that much at one sequence; which
of the policy's inputs tipped the first one is not established.

    .venv/bin/python benchmarks/diagnostics/policy_startup_spread.py
"""
import time, ray, collections
from pathlib import Path
from specserve.benchmarks.bench import closed_loop, init_ray
from specserve.cluster.pair import SpeculativePair
from specserve.core.runner import load_tokenizer
from specserve.core.sampling import SamplingParams
from specserve.training.demo_pair import heldout_prompts
m = Path("models/demo"); tp, dp = str(m/"target"), str(m/"drafter")
prompts = heldout_prompts(m, 64, 64, load_tokenizer(tp))
init_ray(4)
p = SpeculativePair(tp, dp, pipeline=True, cpus_per_actor=1, max_num_seqs=32, max_waiting=32, speculation="adaptive")
ray.get(p.submit(prompts[0], 64, SamplingParams(), 4, ignore_eos=True))
for c in (1, 1, 2, 2):
    a = ray.get(p.verifier.times.remote()); t0 = time.perf_counter()
    outs = closed_loop(p, prompts, c, max(4 * c, 8), 64, 4)
    wall = time.perf_counter() - t0
    st = ray.get(p.verifier.policy.remote())
    ks = collections.Counter()
    for o in outs:
        for k, n in enumerate(o["stats"]["rounds_by_k"]): ks[k] += n
    print(f"c={c} tok/s {sum(len(o['token_ids']) for o in outs)/wall:.1f} rounds_by_k {dict(ks)}")
rec = st["recent_choices_b_k_rate0_ratebest_probe"]
print("recent", rec[-120:])
print({k: v for k, v in st.items() if k not in ("recent_choices_b_k_rate0_ratebest_probe",)})
