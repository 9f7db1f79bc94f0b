"""Diagnostic (prints, writes no result file): where a demo-drafter pass goes, eager lean forward,
one torch thread, one sequence of 64 cached tokens, width 1: the pass's median ms (400 passes),
the aten ops it runs (torch.profiler, 100 passes), the 8192-wide head's product alone, and the
greedy per-row bookkeeping of a drafting step before stop 29 (softmax, argmax, top-2, gather
on one row's logits), each a median of 2000.

    .venv/bin/python benchmarks/diagnostics/drafter_pass.py [models/demo/drafter]
"""
import sys
import torch
torch.set_num_threads(1)
from torch.profiler import ProfilerActivity, profile
from specserve.core.runner import ModelRunner
from _shared import median_us


def median_ms(fn, n):
    return median_us(fn, n) / 1e3


r = ModelRunner.from_pretrained(sys.argv[1] if len(sys.argv) > 1 else "models/demo/drafter", role="drafter", slots=4)
r.prefill(list(range(10, 74)))
ids = torch.tensor([[5]])


def one_pass():
    r.score_ids(ids, [0])
    r.rollback(1)


print(f"pass, width 1: {median_ms(one_pass, 400):.3f} ms")
with profile(activities=[ProfilerActivity.CPU]) as prof:
    for _ in range(100):
        one_pass()
print(f"aten ops per pass: {sum(e.count for e in prof.key_averages()) / 100:.0f}")
f = r.fast
x = torch.randn(1, 1, f.cfg.hidden_size, dtype=f.embed.dtype)
with torch.inference_mode():
    print(f"the head's product (1 x {f.cfg.hidden_size} @ {f.cfg.hidden_size} x {f.lm_head.shape[0]}, "
          f"{'packed bfloat16' if f.packed is not None or f.head_packed is not None else f.embed.dtype}): "
          f"{median_ms(lambda: f.head(x), 2000):.3f} ms")
    logits = torch.randn(f.lm_head.shape[0])

    def row():
        q = torch.softmax(logits, -1)
        x_ = q.argmax(-1)
        top = torch.topk(q, 2)
        alt = torch.where(top.indices[0] == x_, top.indices[1], top.indices[0])
        picked = q.gather(-1, torch.stack([x_, alt])).double()
        torch.stack([x_.double(), picked[0], alt.double(), picked[1], top.values[0].double()])
    print(f"one greedy row's bookkeeping per step (before stop 29): {median_ms(row, 2000):.3f} ms")
