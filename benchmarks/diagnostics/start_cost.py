"""Diagnostic (prints, writes no result file): one Start of a 64-token sequence and one Propose
(k = 4) over gRPC to an idle drafter server in a child process, non-pipelining and pipelining
(medians of 25 after 5), against the same drafter's 63-token prefill in process.

    .venv/bin/python benchmarks/diagnostics/start_cost.py
"""
import time, statistics, torch
torch.set_num_threads(1)
from specserve.benchmarks.rounds import DrafterProcess
from specserve.verifier.client import RemoteProposer
from specserve.core.sampling import SamplingParams
from specserve.core.proposer import ProposeItem
for pipe in (False, True):
    dp = DrafterProcess("models/demo/drafter", pipe)
    rp = RemoteProposer(dp.address)
    prompt = list(range(1, 65))
    ts, tp = [], []
    for i in range(30):
        t0 = time.perf_counter(); rp.start_many([(f"s{i}", prompt, SamplingParams())]); ts.append(time.perf_counter() - t0)
        t0 = time.perf_counter(); rp.propose([ProposeItem(f"s{i}", [5], 4)]); tp.append(time.perf_counter() - t0)
        rp.release_many([f"s{i}"])
        time.sleep(0.02)
    print("pipeline", pipe, "start ms", f"{1e3*statistics.median(ts[5:]):.2f}", "propose k=4 ms", f"{1e3*statistics.median(tp[5:]):.2f}")
    dp.close()

from specserve.core.runner import ModelRunner
r = ModelRunner.from_pretrained("models/demo/drafter", name="drafter", role="drafter")
ts = []
for i in range(20):
    t0 = time.perf_counter(); r.prefill_batch([(0, list(range(1, 64)))]); ts.append(time.perf_counter() - t0); r.release(0)
print("in process: drafter prefill of 63 tokens ms", f"{1e3*statistics.median(ts[3:]):.2f}")
