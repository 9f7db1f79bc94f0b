"""Diagnostic (prints, writes no result file): in-process speculation at one sequence with the
demo drafter three ways, beside one target under `dtype: auto`, and plain decoding with that
target: float32, bfloat16 (prepacked where the CPU multiplies bf16 in hardware), and `auto`
(on such a CPU: float32 layers with a packed bfloat16 head, fast_llama.packed_bf16_head).
10 held-out prompts x 64 greedy tokens per row and repeat, rows interleaved (order flipped every
repeat), the first repeat dropped; medians of tokens/s and each row over plain. Then, with
--products, each of the drafter's matrix shapes multiplied at 1 and 5 rows in float32 and as a
packed bfloat16 product (medians of 3000 calls, us).

Made the 1.08-1.23x (bf16 drafter over float32, four runs on stop 32's AMD EPYC) behind stop 32's
all-bfloat16 drafter, and on stop 34's EPYC (three runs, 7, 9 and 5 repeats) speculative / plain
1.07, 1.12 and 1.11 with the float32 drafter, 1.23, 1.30 and 1.26 with the bfloat16 one, 1.29,
1.41 and 1.38 with the float32 one with a bfloat16 head, behind `auto`'s choice of that
(runner.resolve_dtype):

    .venv/bin/python benchmarks/diagnostics/drafter_dtype_loop.py [repeats] [--products]
"""
import statistics
import sys
from pathlib import Path

import torch
torch.set_num_threads(1)
from specserve.core.runner import ModelRunner, load_tokenizer
from specserve.core.sampling import SamplingParams
from specserve.drafter.draft_model import DraftModelProposer
from specserve.training.demo_pair import heldout_prompts
from specserve.verifier.engine import SpeculativeEngine
from _shared import interleaved_tok_s, median_us


def products(drafter: ModelRunner) -> None:
    linear = torch.ops.mkldnn._linear_pointwise
    shapes = {tuple(w.shape) for w in (drafter.fast.lm_head, *(w for lw in drafter.fast.layer_weights for w in lw
                                                                 if isinstance(w, torch.Tensor) and w.dim() == 2))}
    with torch.inference_mode():
        for out, inp in sorted(shapes):
            w = torch.randn(out, inp) * 0.05
            packed = torch.ops.mkldnn._reorder_linear_weight(w.bfloat16(), 8)
            for rows in (1, 5):
                x = torch.randn(rows, inp)
                x16 = x.bfloat16()
                f32 = median_us(lambda: torch.nn.functional.linear(x, w), 3000)
                bf16 = median_us(lambda: linear(x16, packed, None, "none", [], ""), 3000)
                print(f"{out} x {inp}, {rows} rows: float32 {f32:.1f} us, packed bfloat16 {bf16:.1f} us")


def main() -> None:
    repeats = int(next((a for a in sys.argv[1:] if a.isdigit()), 7))
    target = ModelRunner.from_pretrained("models/demo/target", name="target", slots=4, role="target")
    drafters = {m: ModelRunner.from_pretrained("models/demo/drafter", name="drafter", slots=4, role="drafter", dtype=m)
                for m in ("float32", "bfloat16", "auto")}
    for m, d in drafters.items():
        print(f"drafter {m}: {d.model.dtype}, layers packed {d.fast.packed is not None}, "
              f"head packed {d.fast.packed is not None or d.fast.head_packed is not None}")
    if "--products" in sys.argv:
        products(drafters["float32"])
    engines = {m: SpeculativeEngine(target, DraftModelProposer(d), eos_ids=set(), speculation="fixed", max_k=4)
               for m, d in drafters.items()}
    prompts = heldout_prompts(Path("models/demo"), 10, 64, load_tokenizer("models/demo/target"))
    med = interleaved_tok_s({"plain": (engines["float32"], 0), **{m: (e, 4) for m, e in engines.items()}},
                            prompts, repeats)
    print("tok/s", {m: round(v, 1) for m, v in med.items()})
    print("over plain", {m: round(v / med["plain"], 3) for m, v in med.items()})
    for m, engine in engines.items():
        outs = [engine.generate(p, 64, SamplingParams(), k=4) for p in prompts]
        plain = [engines["float32"].generate(p, 64, SamplingParams(), k=0).token_ids for p in prompts]
        print(f"{m}: greedy == plain {all(o.token_ids == q for o, q in zip(outs, plain))}, mean acceptance length "
              f"{statistics.mean(o.stats.mean_acceptance_length for o in outs):.3f}")


if __name__ == "__main__":
    main()
