"""Diagnostic (prints, writes no result file): the demo drafter's pass eager (`dtype: auto`, its
bfloat16 head; or all float32) against torch.compile of the layer stack with inductor's
`freezing` (weights as constants; F.linear), static or dynamic shapes, with or without
`cpp_wrapper`, at 1 x 1, 1 x 2, 1 x 5 and 4 x 1 (rows x width), median ms of 5 x 100 passes, one
torch thread; run one variant per process:

    for v in eager-auto eager-f32 freeze freeze-dyn freeze-cpp; do
        TORCHINDUCTOR_CACHE_DIR=/tmp/ind .venv/bin/python benchmarks/diagnostics/drafter_frozen_compile.py $v
    done

Stop 44 (the Zen 5 EPYC): eager-auto 0.41, 0.47, 0.67, 0.69 ms; freeze-cpp (static shapes)
0.29, 0.44, 0.71, 0.65 (compiling those four shapes: 13 s); freeze with dynamic shapes 0.38,
0.63, 1.15, 1.05. Static shapes would need a graph per (rows, width, attended span): not built.
"""
import time, statistics, sys, torch
torch.set_num_threads(1)
from transformers.utils import logging as hf_logging; hf_logging.disable_progress_bar()
from specserve.core.runner import ModelRunner
variant = sys.argv[1]
if variant == "eager-auto":
    r = ModelRunner.from_pretrained("models/demo/drafter", name="drafter", role="drafter", slots=8)
else:
    r = ModelRunner.from_pretrained("models/demo/drafter", name="drafter", role="drafter", slots=8, dtype="float32")
    f = r.fast
    if variant != "eager-f32":
        f.packed = None; f.gemm = None; f.head_packed = None
        opts = {"freezing": True}
        if "cpp" in variant: opts["cpp_wrapper"] = True
        f._pass = torch.compile(f._pass_eager, dynamic="dyn" in variant, options=opts)
r.prefill_batch([(s, list(range(1, 65))) for s in range(4)])
shapes = {"1x1": (1, 1), "1x2": (1, 2), "1x5": (1, 5), "4x1": (4, 1)}
def step(b, w):
    r.score_batch([(s, [5] * w) for s in range(b)]) if w > 1 else r.score_ids(torch.tensor([[5]] * b), list(range(b)))
    for s in range(b): r.rollback(w, slot=s)
t0 = time.time()
for b, w in shapes.values():
    for _ in range(3): step(b, w)
warm = time.time() - t0
res = {}
for name, (b, w) in shapes.items():
    ts = []
    for rep in range(5):
        a = time.perf_counter()
        for _ in range(100): step(b, w)
        ts.append((time.perf_counter() - a) / 100)
    res[name] = round(1e3 * statistics.median(ts), 3)
print(f"{variant:22s} warm {warm:5.1f} s  ms/pass {res}", flush=True)
