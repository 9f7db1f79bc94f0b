"""Diagnostic (prints, writes no result file): do the machine's two vCPUs slow each other? One
process pinned to cpu 0 runs a loop alone, then beside a second pinned to cpu 1 running the same,
alternating, 6 times each, medians: a torch product (ARGS: "small", 64x64 @ 64x64, in cache; or
"large", 1x1024 @ 1024x8192, 32 MB of weights) and a pure-Python loop.

    .venv/bin/python benchmarks/diagnostics/cpu_pair.py small
"""
import sys, statistics, subprocess
CHILD = r'''
import os, sys, time, torch
torch.set_num_threads(1)
os.sched_setaffinity(0, {int(sys.argv[1])})
big = sys.argv[2] == 'large'
a, b = (torch.randn(1, 1024), torch.randn(1024, 8192)) if big else (torch.randn(64, 64), torch.randn(64, 64))
x = [0] * 1
import array
def work():
    t0 = time.perf_counter()
    for _ in range(300 if big else 3000):
        torch.mm(a, b)
    return time.perf_counter() - t0
def pywork():
    t0 = time.perf_counter()
    s = 0
    for i in range(300000):
        s += i * i
    return time.perf_counter() - t0
work(); pywork()
print(work(), pywork(), flush=True)
'''
def run(cpus):
    ps = [subprocess.Popen([sys.executable, "-c", CHILD, str(c), SIZE], stdout=subprocess.PIPE, text=True) for c in cpus]
    outs = [tuple(map(float, p.communicate()[0].split())) for p in ps]
    return outs[0]
SIZE = sys.argv[1] if len(sys.argv) > 1 else "small"
alone, both = [], []
for i in range(6):
    alone.append(run([0])); both.append(run([0, 1]))
for j, name in enumerate((f"torch product ({SIZE})", "python loop")):
    a = statistics.median(x[j] for x in alone); b = statistics.median(x[j] for x in both)
    print(f"{name}: cpu0 alone {a*1e3:.1f} ms, with cpu1 busy {b*1e3:.1f} ms, ratio {b/a:.2f}")
