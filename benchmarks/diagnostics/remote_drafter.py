"""Diagnostic (prints, writes no result file): the drafter behind its gRPC server against the same
drafting in process, no Ray. A drafter server in a child process (sequential: no pipelining; one
torch thread) and a DraftModelProposer in this process, each given the same rounds (B sequences of
64 prompt tokens; each round commits 4 tokens and asks for 4 drafts, greedy), in alternating
blocks of 15 rounds, 6 blocks a repeat, 3 repeats. Printed per repeat: the median round trip of
the remote Propose (RemoteProposer, on its ProposeStream), the server's handler time, its
drafting time (DraftModelProposer.propose inside the handler), and the in-process drafting time.
SW=seconds sets sys.setswitchinterval in both processes.

    .venv/bin/python benchmarks/diagnostics/remote_drafter.py 8
"""
import subprocess, sys, time, statistics, json, torch, os
SW = float(os.environ.get("SW", "0"))
if SW: sys.setswitchinterval(SW)
torch.set_num_threads(1)
from specserve.core.proposer import ProposeItem
from specserve.core.runner import ModelRunner
from specserve.core.sampling import SamplingParams
from specserve.drafter.draft_model import DraftModelProposer
from specserve.verifier.client import RemoteProposer
SERVER = r"""
import sys, time, json, torch, threading, os
if float(os.environ.get("SW", "0")): sys.setswitchinterval(float(os.environ["SW"]))
torch.set_num_threads(1)
from specserve.core.runner import ModelRunner
from specserve.drafter import server as srv
T = []
orig = srv.DraftModelProposer.propose
def timed(self, items):
    t0 = time.perf_counter(); out = orig(self, items); T.append(time.perf_counter() - t0); return out
srv.DraftModelProposer.propose = timed
T2 = []
orig2 = srv.DrafterServicer._propose
def timed2(self, request):
    t0 = time.perf_counter(); out = orig2(self, request); T2.append(time.perf_counter() - t0); return out
srv.DrafterServicer._propose = timed2
runner = ModelRunner.from_pretrained(sys.argv[1], name="drafter", role="drafter")
server, port, _ = srv.serve(runner.model, port=0, pipeline=False, bf16_head=runner.bf16_head)
print(port, flush=True)
for line in sys.stdin:
    print(json.dumps([T, T2]), flush=True); T.clear(); T2.clear()
server.stop(0)
"""
proc = subprocess.Popen([sys.executable, "-c", SERVER, "models/demo/drafter"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
port = int(proc.stdout.readline())
remote = RemoteProposer(f"127.0.0.1:{port}")
local = DraftModelProposer(ModelRunner.from_pretrained("models/demo/drafter", role="drafter", slots=64))
b = int(sys.argv[1])
for rep in range(3):
    res = {"remote": [], "local": []}
    for block in range(6):
        for name, p in (("remote", remote), ("local", local)):
            names = [f"q{rep}_{block}_{i}" for i in range(b)]
            p.start_many([(s, list(range(10 + i, 74 + i)), SamplingParams(seed=i)) for i, s in enumerate(names)])
            for r in range(15):
                items = [ProposeItem(s, [(100 + 4 * r + 7 * i + j) % 8000 for j in range(4)], 4) for i, s in enumerate(names)]
                t0 = time.perf_counter(); p.propose(items); res[name].append(time.perf_counter() - t0)
            p.release_many(names) if hasattr(p, "release_many") else [p.release(s) for s in names]
    proc.stdin.write("x\n"); proc.stdin.flush()
    server_t, handler_t = json.loads(proc.stdout.readline())
    print(f"{b} seqs: remote round trip {statistics.median(res['remote'])*1e3:.2f} ms, server handler {statistics.median(handler_t)*1e3:.2f} ms, server propose {statistics.median(server_t)*1e3:.2f} ms, in process {statistics.median(res['local'])*1e3:.2f} ms")
proc.stdin.close(); proc.wait()
