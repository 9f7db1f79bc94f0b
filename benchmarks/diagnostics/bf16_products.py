"""Diagnostic (prints, writes no result file): one torch thread, the demo target's weight shapes.
1. x @ w.T at 1, 5 and 160 rows: float32 (F.linear, and x @ a transposed copy), bfloat16 F.linear
   (oneDNN reorders w on every call), bfloat16 prepacked (`fast_llama.packed_bf16`).
2. The scores product of the packed path's attention at 32 sequences (6 heads, 128 keys, one
   query each) over a strided slice of the KV cache, against copying the slice first.
Medians of 300 calls. Made the micro-timings of stop 26 in docs/benchmarks/README.md and the
comment in `FastLlama._attend_same_bits`:

    .venv/bin/python benchmarks/diagnostics/bf16_products.py
"""
import statistics, time, torch
import torch.nn.functional as F
torch.set_num_threads(1)
def us(fn, n=300):
    for _ in range(20): fn()
    ts = []
    for _ in range(n):
        t0 = time.perf_counter(); fn(); ts.append(time.perf_counter() - t0)
    return 1e6 * statistics.median(ts)
pack, linear = torch.ops.mkldnn._reorder_linear_weight, torch.ops.mkldnn._linear_pointwise
for out_f, in_f in ((384, 384), (1024, 384), (384, 1024), (8192, 384)):
    w = torch.randn(out_f, in_f); wt = w.t().contiguous(); wb = w.bfloat16(); pw = pack(wb, 8)
    cells = []
    for m in (1, 5, 160):
        x = torch.randn(m, in_f); xb = x.bfloat16()
        cells.append(f"{m} rows: f32 {us(lambda: F.linear(x, w)):.0f} / f32 x@wT {us(lambda: x @ wt):.0f} / "
                     f"bf16 {us(lambda: F.linear(xb, wb)):.0f} / packed {us(lambda: linear(xb, pw, None, 'none', [], '')):.0f}")
    print(f"{out_f}x{in_f} (µs):", " | ".join(cells))
b, h, cap, d, span = 32, 6, 256, 64, 128
cache = torch.randn(b + 1, h, cap, d).bfloat16()
q = torch.randn(b * h, 1, d).bfloat16()
k = cache[:b, :, :span].reshape(b * h, span, d)
print(f"scores at {b} sequences (ms): strided {1e-3 * us(lambda: torch.bmm(q, k.transpose(1, 2)), 50):.3f}, "
      f"copy {1e-3 * us(lambda: k.contiguous(), 50):.3f} + contiguous "
      f"{1e-3 * us((lambda kc: lambda: torch.bmm(q, kc.transpose(1, 2)))(k.contiguous()), 50):.3f}")
