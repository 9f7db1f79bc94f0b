"""Diagnostic (prints, writes no result file): whether the drafter working on the other CPU slows
the target's passes on this one. The demo target runs here, pinned to CPU 0; a child process
pinned to CPU 1 runs the demo drafter's batched passes back to back, or sleeps. The two states
alternate in 12 rounds; each round times 25 passes of each shape. The figure is the loop thread's
CPU time per pass (medians).

    .venv/bin/python benchmarks/diagnostics/pass_beside_drafter.py
"""
import os, sys, time, statistics, subprocess, signal, torch
torch.set_num_threads(1)
if len(sys.argv) > 1 and sys.argv[1] == "load":
    os.sched_setaffinity(0, {1})
    from specserve.core.runner import ModelRunner
    r = ModelRunner.from_pretrained("models/demo/drafter", name="drafter", role="drafter", slots=4)
    r.prefill_batch([(s, list(range(1, 64))) for s in range(4)])
    ids = torch.tensor([[5]] * 4)
    busy = [False]
    signal.signal(signal.SIGUSR1, lambda *a: busy.__setitem__(0, True))
    signal.signal(signal.SIGUSR2, lambda *a: busy.__setitem__(0, False))
    print("ready", flush=True)
    while True:
        if busy[0]:
            r.score_ids(ids, [0, 1, 2, 3]); [r.rollback(1, slot=s) for s in range(4)]
        else:
            time.sleep(0.001)
os.sched_setaffinity(0, {0})
from specserve.core.runner import ModelRunner
t = ModelRunner.from_pretrained("models/demo/target", name="target", slots=8)
t.prefill_batch([(s, list(range(1, 97))) for s in range(8)])
p = subprocess.Popen([sys.executable, __file__, "load"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True); p.stdout.readline()
def passes(b, w, n=25):
    ts = []
    for _ in range(n):
        c0 = time.thread_time(); t.score_batch([(s, list(range(5, 5 + w))) for s in range(b)]); ts.append(time.thread_time() - c0)
        for s in range(b): t.rollback(w, slot=s)
    return statistics.median(ts)
R = {}
for rep in range(12):
    for state in ("quiet", "busy"):
        os.kill(p.pid, signal.SIGUSR1 if state == "busy" else signal.SIGUSR2); time.sleep(0.05)
        for b, w in ((1, 5), (4, 5), (8, 1)):
            R.setdefault((b, w, state), []).append(passes(b, w))
p.kill()
for b, w in ((1, 5), (4, 5), (8, 1)):
    q, bz = statistics.median(R[(b, w, "quiet")]), statistics.median(R[(b, w, "busy")])
    print(f"{b}x{w} pass CPU time: other cpu quiet {1e3*q:.2f} ms, other cpu drafting {1e3*bz:.2f} ms, ratio {bz/q:.3f}")
