"""Diagnostic (prints, writes no result file): the engine in this process with its drafter in
process, in process with a 3.5 ms sleep after each drafting call, and behind a gRPC drafter
server in a child process (no Ray, sequential), batch 1, k = 4, 6 held-out prompts, 64 tokens;
per round: the target pass's wall and CPU ms, this process's minor faults and context switches,
and the context switches of each thread (MAIN: the engine's loop). PIN=1 pins the loop thread to
CPU 0 and every other thread of this process, and the drafter's process, to CPU 1.
Stop 44 (the Zen 5 EPYC): remote / in process 0.77-0.89 in tokens/s (five runs); the remote engine's pass
2.68-2.98 ms against 2.47-2.61 in process (2.72-2.75 after the sleep); 12-15 voluntary and 4-6
involuntary context switches per round against 0.7 and 0.1, the loop thread preempted 1.7-1.8
times a round (the stream's request-feeding thread woke 6 times a round). Pinned, the loop
thread was preempted 0.08 times a round, and its pass took 3.13 ms: the preemptions are not
what slows it.

    .venv/bin/python benchmarks/diagnostics/remote_switches.py
"""
import time, statistics, resource, torch
torch.set_num_threads(1)
from pathlib import Path
from transformers.utils import logging as hf_logging; hf_logging.disable_progress_bar()
from specserve.benchmarks.rounds import DrafterProcess
from specserve.core.runner import ModelRunner
from specserve.core.sampling import SamplingParams
from specserve.drafter.draft_model import DraftModelProposer
from specserve.verifier.client import RemoteProposer
from specserve.verifier.engine import SpeculativeEngine
from specserve.training.demo_pair import heldout_prompts
m = "models/demo"
target = ModelRunner.from_pretrained(f"{m}/target", name="target")
drafter = ModelRunner.from_pretrained(f"{m}/drafter", name="drafter", role="drafter")
prompts = heldout_prompts(Path(m), 6, 64, target.tokenizer)
srv = DrafterProcess(f"{m}/drafter", False)
class Sleepy(DraftModelProposer):
    def propose(self, items):
        out = super().propose(items); time.sleep(0.0035); return out
engines = {"in process": SpeculativeEngine(target, DraftModelProposer(drafter)),
           "in process + 3.5 ms sleep": SpeculativeEngine(target, Sleepy(drafter)),
           "remote seq": SpeculativeEngine(target, RemoteProposer(srv.address))}
import os, collections
def ctx():
    out = collections.Counter()
    for tid in os.listdir("/proc/self/task"):
        try:
            comm = open(f"/proc/self/task/{tid}/comm").read().strip()
            st = open(f"/proc/self/task/{tid}/status").read().split("\n")
        except OSError: continue
        name = "MAIN" if int(tid) == os.getpid() else comm
        for l in st:
            if l.startswith("voluntary_ctxt_switches"): out[name + " vol"] += int(l.split()[1])
            if l.startswith("nonvoluntary_ctxt_switches"): out[name + " invol"] += int(l.split()[1])
    return out
R = {n: [] for n in engines}
CT = {}
PIN = os.environ.get("PIN")
def pin():
    if not PIN: return
    for tid in os.listdir("/proc/self/task"):
        t = int(tid)
        os.sched_setaffinity(t, {0} if t == os.getpid() else {1})
    os.sched_setaffinity(srv.proc.pid, {1})
    if PIN == "all1":  # drafter threads too
        for tid in os.listdir(f"/proc/{srv.proc.pid}/task"): os.sched_setaffinity(int(tid), {1})
engines["remote seq"].generate(prompts[0], 8, SamplingParams(), 4); pin()
try:
    for rep in range(4):
        for name, e in engines.items():
            a = e.times.to_dict(); a = {"rounds": a["rounds"], "s": dict(a["seconds"]), "c": a["pass_cpu"]}
            pin(); c0 = ctx(); r0 = resource.getrusage(resource.RUSAGE_SELF); t0 = time.perf_counter()
            n = sum(len(e.generate(p, 64, SamplingParams(), 4).token_ids) for p in prompts)
            wall = time.perf_counter() - t0; r1 = resource.getrusage(resource.RUSAGE_SELF)
            b = e.times.to_dict(); rounds = b["rounds"] - a["rounds"]
            c1 = ctx(); c1.subtract(c0); CT[name] = {k: round(v / rounds, 2) for k, v in c1.items() if v}
            if rep:
                R[name].append(dict(tps=n / wall, pass_ms=1e3*(b["seconds"]["pass"]-a["s"]["pass"])/rounds,
                                    pass_cpu=1e3*(b["pass_cpu"]-a["c"])/rounds, minflt=(r1.ru_minflt-r0.ru_minflt)/rounds,
                                    nvcsw=(r1.ru_nvcsw-r0.ru_nvcsw)/rounds, nivcsw=(r1.ru_nivcsw-r0.ru_nivcsw)/rounds))
finally:
    srv.close()
for name, rs in R.items():
    print(f"{name:28s}", {k: round(statistics.median(r[k] for r in rs), 3) for k in rs[0]})
for n, c in CT.items(): print(n, c)
