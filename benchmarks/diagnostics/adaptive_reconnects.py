"""Diagnostic (prints, writes no result file): an adaptive pair (demo pair, pipelined, k <= 4) under C
concurrent greedy requests of 64 tokens (closed loop) for S seconds; then the verifier's remote
proposer's reconnects, its degraded state and health. A reconnect here would be the Propose stream's
watchdog cancelling a stream whose reply was only unread (fixed in stop 47, 0ac6bf6). Stop 47 with the
client before that fix: 0 reconnects at 8 sequences for 90 s (699 requests) and at 16 for 150 s
(1,846); after it, 0 at 8 for 90 s (685).

    .venv/bin/python benchmarks/diagnostics/adaptive_reconnects.py 8 90    # C, S
"""
import sys, time, threading
import ray
from specserve.cluster.pair import SpeculativePair, start_ray
from specserve.config import DEFAULT_MODEL_DIR
from specserve.core.sampling import SamplingParams
C, SECONDS = int(sys.argv[1]), float(sys.argv[2])
start_ray(num_cpus=8)
pair = SpeculativePair(str(DEFAULT_MODEL_DIR / "target"), str(DEFAULT_MODEL_DIR / "drafter"), pipeline=True,
                       speculation="adaptive", max_num_seqs=C, cpus_per_actor=1, k=4)
stop = time.monotonic() + SECONDS
done = [0]
def worker(i):
    while time.monotonic() < stop:
        ray.get(pair.submit(list(range(10 + i, 74 + i)), 64, SamplingParams(), 4, ignore_eos=True))
        done[0] += 1
ts = [threading.Thread(target=worker, args=(i,)) for i in range(C)]
[t.start() for t in ts]; [t.join() for t in ts]
f = lambda self: (self.engine.proposers["draft_model"].reconnects, self.engine.degraded, self.engine.health())
print("requests", done[0], "reconnects, degraded, health:", ray.get(pair.verifier.__ray_call__.remote(f)))
pair.shutdown()
