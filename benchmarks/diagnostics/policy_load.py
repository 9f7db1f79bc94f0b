"""Diagnostic (prints, writes no result file): an adaptive pair and a plain pair (Ray + gRPC,
pipelined, 32 sequence slots) under a closed loop of C concurrent requests (4 x C greedy requests
of 64 held-out prompt tokens and 64 new tokens), the two pairs' runs alternating, twice; for each
run its tokens/s, rounds by k, and the engine loop's ms per round by phase; then the adaptive
policy's view near batch size C (calibrations, pass and drafting costs, round overheads, its
last choices). Made the "start while speculating at 32 sequences" figures in
docs/benchmarks/README.md:

    .venv/bin/python benchmarks/diagnostics/policy_load.py 32
"""
import sys, time, ray
from pathlib import Path
from collections import Counter
from specserve.cluster.pair import SpeculativePair
from specserve.benchmarks.bench import init_ray, closed_loop
from specserve.core.runner import load_tokenizer
from specserve.core.sampling import SamplingParams
from specserve.training.demo_pair import heldout_prompts
C = int(sys.argv[1]) if len(sys.argv) > 1 else 32
m = Path("models/demo")
prompts = heldout_prompts(m, 4 * C, 64, load_tokenizer(str(m / "target")))
init_ray(4)
pairs = {name: SpeculativePair(str(m/"target"), str(m/"drafter"), pipeline=True, cpus_per_actor=1, max_num_seqs=32, max_waiting=32, speculation=sp)
         for name, sp in (("adaptive", "adaptive"), ("plain", "fixed"))}
for name, p in pairs.items(): ray.get(p.submit(prompts[0], 64, SamplingParams(), 4 if name == "adaptive" else 0, ignore_eos=True))
for rep in range(2):
    for name, p in pairs.items():
        a = ray.get(p.verifier.times.remote())
        t0 = time.perf_counter()
        outs = closed_loop(p, prompts, C, 4 * C, 64, 4 if name == "adaptive" else 0)
        dt = time.perf_counter() - t0
        byk = Counter()
        for o in outs:
            for k, n in enumerate(o["stats"]["rounds_by_k"]): byk[k] += n
        b = ray.get(p.verifier.times.remote()); r = b["rounds"] - a["rounds"]
        print(name, rep, "%.1f tok/s" % (sum(len(o["token_ids"]) for o in outs) / dt), dict(byk), "rounds", r, "wall/round %.2f" % (1e3 * dt / r), {k: round(1e3 * (b["seconds"][k] - a["seconds"][k]) / r, 2) for k in b["seconds"]})
st = ray.get(pairs["adaptive"].verifier.policy.remote())
print("calibration", {k: v for k, v in st["calibration"].items() if int(k.split("+")[0]) >= C - 8})
print("pass", {k: v for k, v in st["target_pass_ms"].items() if int(k.split("x")[0]) >= C - 8 or k.split("x")[0] in ("16", "32")})
print("draft", {k: v for k, v in st["draft_ms_for_k_1_and_4"].items() if int(k.split("@")[1]) >= C - 8})
print("ready", st["ready_call_ms"], st["ready_after_all_accepted"])
print("over", {k: v for k, v in st["round_overhead_ms"].items() if int(k.split("+")[0]) >= C - 8})
print("acc", st["position_acceptance"], st["engine_acceptance"])
print("recent", st["recent_choices_b_k_rate0_ratebest_probe"][-12:])
pp = ray.get(pairs["plain"].verifier.policy.remote())
print("plain pass", {k: v for k, v in pp["target_pass_ms"].items() if int(k.split("x")[0]) >= C - 8})
