"""Diagnostic (prints, writes no result file): how much slower one target pass of the demo pair
(batch 1, width 5, one torch thread) runs when other work comes between passes: back to back, after
a 5 ms sleep or a 5 ms Python spin, after four drafter passes in the same process (what an
in-process speculative round does), and with an idle Ray pair (a verifier and a drafter actor,
nothing to do) alive beside this process. Median ms of 60-100 passes each. Made the
"pass interference" figures in docs/benchmarks/README.md:

    .venv/bin/python benchmarks/diagnostics/pass_interference.py
"""
import statistics, time, torch
from specserve.core.runner import ModelRunner
torch.set_num_threads(1)
target = ModelRunner.from_pretrained("models/demo/target", slots=1)
drafter = ModelRunner.from_pretrained("models/demo/drafter", slots=1)
target.prefill(list(range(1, 65)))
drafter.prefill(list(range(1, 65)))


def target_pass():
    target.score_batch([(0, [5, 6, 7, 8, 9])])
    target.rollback(5)


def drafter_passes():
    for _ in range(4):
        drafter.score_batch([(0, [5])], last_only=True)
    drafter.rollback(4)


def spin(seconds):
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def median_ms(between, n=80):
    times = []
    for _ in range(n):
        between()
        t0 = time.perf_counter()
        target_pass()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


cases = {"back to back": lambda: None, "after a 5 ms sleep": lambda: time.sleep(0.005),
         "after a 5 ms spin": lambda: spin(0.005), "after 4 drafter passes": drafter_passes}
for rep in range(2):
    for name, between in cases.items():
        print(f"{name}: {median_ms(between):.2f} ms")
from specserve.cluster.pair import SpeculativePair, start_ray
start_ray(num_cpus=4)
pair = SpeculativePair("models/demo/target", "models/demo/drafter", pipeline=True, cpus_per_actor=1,
                       speculation="fixed")
time.sleep(3)
for rep in range(2):
    print(f"after a 4 ms sleep, Ray up, an idle pair alive: {median_ms(lambda: time.sleep(0.004)):.2f} ms")
pair.shutdown()
