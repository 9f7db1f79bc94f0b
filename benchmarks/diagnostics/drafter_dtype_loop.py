"""Diagnostic (prints, writes no result file): in-process speculation at one sequence with the
demo drafter in float32 and in bfloat16 (prepacked where the CPU multiplies bf16 in hardware),
beside one bfloat16-or-auto target, and plain decoding with the same target: 10 held-out
prompts x 64 greedy tokens per row and repeat, rows interleaved (order flipped every repeat),
the first repeat dropped; medians of tokens/s. Made the 1.08-1.23x (bf16 drafter over float32,
four runs on stop 32's AMD EPYC) behind `dtype: auto` giving the drafter bfloat16
(specserve.core.runner.resolve_dtype):

    .venv/bin/python benchmarks/diagnostics/drafter_dtype_loop.py
"""
import time, torch, statistics
torch.set_num_threads(1)
from specserve.core.runner import ModelRunner, load_tokenizer
from specserve.drafter.draft_model import DraftModelProposer
from specserve.verifier.engine import SpeculativeEngine
from specserve.core.sampling import SamplingParams
from specserve.training.demo_pair import heldout_prompts
from pathlib import Path
t = ModelRunner.from_pretrained("models/demo/target", name="target", slots=4, role="target")
d32 = ModelRunner.from_pretrained("models/demo/drafter", name="drafter", slots=4, role="drafter", dtype="float32")
d16 = ModelRunner.from_pretrained("models/demo/drafter", name="drafter", slots=4, role="drafter", dtype="bfloat16")
print("drafter dtypes", d32.model.dtype, d16.model.dtype, "packed", d16.fast.packed is not None)
engs = {"fp32": SpeculativeEngine(t, DraftModelProposer(d32), eos_ids=set(), speculation="fixed", max_k=4),
        "bf16": SpeculativeEngine(t, DraftModelProposer(d16), eos_ids=set(), speculation="fixed", max_k=4)}
prompts = heldout_prompts(Path("models/demo"), 10, 64, load_tokenizer("models/demo/target"))
res = {m: [] for m in ("plain", "fp32", "bf16")}
for rep in range(7):
    for m in (list(res) if rep % 2 else list(res)[::-1]):
        e = engs["fp32" if m == "plain" else m]; k = 0 if m == "plain" else 4
        n = 0; t0 = time.perf_counter()
        for p in prompts: n += len(e.generate(p, 64, SamplingParams(), k=k).token_ids)
        if rep: res[m].append(n / (time.perf_counter() - t0))
print({m: round(statistics.median(v), 1) for m, v in res.items()})
p = prompts[0]
a = engs["fp32"].generate(p, 64, SamplingParams(), k=4); b = engs["bf16"].generate(p, 64, SamplingParams(), k=4); c = engs["fp32"].generate(p, 64, SamplingParams(), k=0)
print("same greedy", a.token_ids == b.token_ids == c.token_ids, "acc fp32", a.stats.mean_acceptance_length, "bf16", b.stats.mean_acceptance_length)
