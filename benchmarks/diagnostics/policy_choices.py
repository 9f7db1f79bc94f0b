"""Diagnostic (prints, writes no result file): one adaptive pair (Ray + gRPC, pipelined), 16
requests one after another; after each, its rounds by k, pipeline hits, the policy's
calibrations at batch 1 and ready-draft rate, and now and then its last choices. Made the
"calibration swung 0.9-2.0" observation in docs/benchmarks/README.md (run with the
per-round-ratio calibration that 627f735 replaced; at HEAD it shows the ratio of sums):

    .venv/bin/python benchmarks/diagnostics/policy_choices.py
"""
import ray
from pathlib import Path
from specserve.cluster.pair import SpeculativePair, start_ray
from specserve.core.runner import load_tokenizer
from specserve.core.sampling import SamplingParams
from specserve.training.demo_pair import heldout_prompts
start_ray(num_cpus=4)
m = Path("models/demo")
prompts = heldout_prompts(m, 8, 64, load_tokenizer(str(m / "target")))
pair = SpeculativePair(str(m/"target"), str(m/"drafter"), pipeline=True, cpus_per_actor=1, max_num_seqs=32, speculation="adaptive")
for i, p in enumerate(prompts * 2):
    out = ray.get(pair.submit(p, 64, SamplingParams(), 4, ignore_eos=True))
    st = ray.get(pair.verifier.policy.remote())
    print(i, out["stats"]["rounds_by_k"], "hits", out["stats"]["num_pipeline_hits"], "cal", {k: v for k, v in st["calibration"].items() if k.split("+")[0] == "1"}, "h", st["ready_after_all_accepted"])
    if i in (0, 3, 15):
        print("   ", st["recent_choices_b_k_rate0_ratebest_probe"])
        print("   draft", {k: v for k, v in st["draft_ms_for_k_1_and_4"].items() if k.endswith("@1")}, "ready", st["ready_call_ms"], "pass", {k: v for k, v in st["target_pass_ms"].items() if k.startswith("1x")}, "over", st["round_overhead_ms"], "guard", st["guard"])
pair.shutdown()
