"""Diagnostic (prints, writes no result file): batch 1, demo pair, k = 4 fixed, greedy, the
target in this process (dtype auto): plain decoding, and speculation with the drafter in float32,
in bfloat16 and in `auto` (on a CPU with bf16 GEMM: float32 with a bfloat16 head), in process and as a pipelined gRPC server in a child process (no Ray; as in
`specserve bench rounds`). Rows interleaved, the order flipped every repeat, the first repeat
dropped; medians of tokens/s and each row over plain. Stop 32 (AMD EPYC) ran it to see whether
the bfloat16 drafter that helped in process (drafter_dtype_loop.py) helps a remote drafter too;
stop 34 added the `auto` rows (two runs, 5 repeats: remote pipelined / plain 1.39 and 1.32 with
`auto`, 1.22 and 1.22 bfloat16, 1.09 and 1.10 float32; in process 1.70 and 1.41, 1.46 and 1.39,
1.21 and 1.15; a first run before the drafter server kept the bfloat16 head had its `auto` rows
run float32 there):

    .venv/bin/python benchmarks/diagnostics/drafter_dtype_remote.py [repeats]
"""
import statistics, sys, time
from pathlib import Path
import torch
from specserve.benchmarks.rounds import DrafterProcess, _generate
from specserve.core.runner import ModelRunner
from specserve.drafter.draft_model import DraftModelProposer
from specserve.training.demo_pair import heldout_prompts
from specserve.verifier.client import RemoteProposer
from specserve.verifier.engine import SpeculativeEngine

torch.set_num_threads(1)
repeats = int(sys.argv[1]) if len(sys.argv) > 1 else 5
m = Path("models/demo")
target = ModelRunner.from_pretrained(str(m / "target"), name="target")
prompts = heldout_prompts(m, 4, 64, target.tokenizer)
servers = {dt: DrafterProcess(str(m / "drafter"), True, dt) for dt in ("float32", "bfloat16", "auto")}
try:
    rows = {"plain": (SpeculativeEngine(target, None), 0)}
    for dt in servers:
        local = ModelRunner.from_pretrained(str(m / "drafter"), name="drafter", role="drafter", dtype=dt)
        rows[f"in process, drafter {dt}"] = (SpeculativeEngine(target, DraftModelProposer(local)), 4)
    for dt, server in servers.items():
        rows[f"remote pipelined, drafter {dt}"] = (SpeculativeEngine(target, RemoteProposer(server.address)), 4)
    runs = {name: [] for name in rows}
    for rep in range(repeats + 1):
        for name in (list(rows) if rep % 2 else list(rows)[::-1]):
            engine, k = rows[name]
            t0 = time.perf_counter()
            n = sum(_generate(engine, p, 64, k) for p in prompts)
            if rep:
                runs[name].append(n / (time.perf_counter() - t0))
finally:
    for server in servers.values():
        server.close()
plain = statistics.median(runs["plain"])
for name, r in runs.items():
    print(f"{name:34s} {statistics.median(r):7.1f} tok/s  {statistics.median(r) / plain:.2f}x plain  runs {[round(x) for x in r]}")
