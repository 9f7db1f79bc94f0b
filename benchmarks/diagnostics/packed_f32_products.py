"""Diagnostic (prints, writes no result file), float32, one torch thread: each of the demo pair's
matrix shapes (random weights) multiplied at 1, 2, 5, 8, 16 and 32 rows by F.linear, by oneDNN over
a copy packed once (fast_llama._pack / _packed_product: the GEMM plan's "packed" layout) and by
MKL's packed sgemm, median us of 200 calls; for the oneDNN product, whether a row's result has the
same bits beside a copy of itself and its largest difference from F.linear. Made the figures behind
the "packed" layout in fast_llama.GemmPlan's docstring and README.md (stop 35's AVX2-only AMD EPYC:
the target's 8192 x 384 head 2.7 ms at five rows with F.linear, 0.85 ms packed, 0.48 and 0.44 ms at
one row):

    .venv/bin/python benchmarks/diagnostics/packed_f32_products.py
"""

import torch
torch.set_num_threads(1)
from specserve.core.fast_llama import _pack, _packed_product
from _shared import median_us


with torch.inference_mode():
    for out, inp in [(8192, 192), (8192, 384), (1152, 384), (2048, 384), (384, 1024)]:
        w = torch.randn(out, inp)
        packed = _pack(w)
        mkl = torch.ops.mkl._mkl_reorder_linear_weight(w, 8)
        for rows in (1, 2, 5, 8, 16, 32):
            x = torch.randn(rows, inp)
            dnn = _packed_product(x, packed)
            same = torch.equal(dnn, _packed_product(torch.cat([x, x]), packed)[:rows])
            print(f"{out} x {inp}, {rows} rows: F.linear {median_us(lambda: torch.nn.functional.linear(x, w)):.0f} us, "
                  f"oneDNN packed {median_us(lambda: _packed_product(x, packed)):.0f} us (same bits beside a copy "
                  f"{same}, largest difference from F.linear {(dnn - torch.nn.functional.linear(x, w)).abs().max():.1e}), "
                  f"MKL packed {median_us(lambda: torch.ops.mkl._mkl_linear(x, mkl, w, None, 8)):.0f} us")
