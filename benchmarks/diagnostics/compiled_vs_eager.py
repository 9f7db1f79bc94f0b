"""Diagnostic (prints, writes no result file): the demo pair's passes eager against compiled
(`compile=True`: torch.compile of the layer stack, inductor on this CPU), one torch
thread, median ms of 100 passes, two rounds alternating: the target's width-1 and width-5 passes,
four drafter passes, and four drafter passes then a target width-5 pass (an in-process
speculative round's model work). Loading and warming up a compiled model took 52-57 s on a cold
inductor cache on the 2-core EPYC at stop 58, 6-8 s eager (196-376 s before, every size dynamic:
docs/benchmarks/ab/compile_static_sizes.txt).
Made the compiled-forward figures in README.md and docs/benchmarks/README.md:

    .venv/bin/python benchmarks/diagnostics/compiled_vs_eager.py [models/demo]
"""
import sys, time
import torch
torch.set_num_threads(1)
from specserve.core.runner import ModelRunner
from _shared import median_us

models = sys.argv[1] if len(sys.argv) > 1 else "models/demo"


def median_ms(fn, n=100):
    return median_us(fn, n) / 1e3


runners = {}
for name in ("drafter", "target"):
    for compiled in (False, True):
        t0 = time.time()
        r = ModelRunner.from_pretrained(f"{models}/{name}", name=name, role=name, slots=8, compile=compiled)
        r.warmup(widths=(1, 5))
        r.prefill(list(range(1, 65)))
        runners[name, compiled] = r
        print(f"{name} {'compiled' if compiled else 'eager'}: loaded and warmed up in {time.time() - t0:.1f} s",
              flush=True)


def target_pass(r, width):
    def run():
        r.score_batch([(0, list(range(5, 5 + width)))], last_only=width == 1)
        r.rollback(width)
    return run


def drafter_passes(r):
    def run():
        for _ in range(4):
            r.score_batch([(0, [5])], last_only=True)
        r.rollback(4)
    return run


for rep in range(2):
    for compiled in (False, True):
        t, d = runners["target", compiled], runners["drafter", compiled]
        both = lambda: (drafter_passes(d)(), target_pass(t, 5)())
        print(f"{'compiled' if compiled else 'eager   '}: target width 1 {median_ms(target_pass(t, 1)):.2f}, "
              f"width 5 {median_ms(target_pass(t, 5)):.2f} | 4 drafter passes {median_ms(drafter_passes(d)):.2f} | "
              f"4 drafter passes + target width 5 {median_ms(both):.2f}", flush=True)
