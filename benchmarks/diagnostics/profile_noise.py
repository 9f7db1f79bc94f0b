"""Diagnostic (prints, writes no result file): how far the adaptive policy's startup profile of
the demo target's passes (`profile_target`, up to 32 sequences and width 5, one torch thread)
moves between profiles: its ratios T(b, w) / T(b, 1) for w = 2, 3, 5 (and T(b, 1) in ms), six
profiles timed as before stop 37 (one width after another, 3 reps each) and six as now
(`profile_target`: the widths taking turns within each of 7 reps), the two kinds alternating.

    .venv/bin/python benchmarks/diagnostics/profile_noise.py [profiles]
"""
import sys
import time

import torch

torch.set_num_threads(1)
from specserve.core.runner import ModelRunner  # noqa: E402
from specserve.verifier.policy import profile_target  # noqa: E402


def main() -> None:
    profiles = int(sys.argv[1]) if len(sys.argv) > 1 else 6
    target = ModelRunner.from_pretrained("models/demo/target", name="target", slots=32, role="target")
    ratios = {"before": [], "now": []}
    for i in range(2 * profiles):
        kind = "before" if i % 2 == 0 else "now"
        t0 = time.perf_counter()
        g = profile_target(target, 32, 5, reps=3, interleaved=False) if kind == "before" else profile_target(target, 32, 5)
        print(f"{kind:6s} {time.perf_counter() - t0:.2f} s  " + "  ".join(
            f"b{b}: " + ",".join(f"{g[(b, w)] / g[(b, 1)]:.2f}" for w in (2, 3, 5)) + f" ({g[(b, 1)] * 1e3:.1f})"
            for b in (1, 2, 4, 8, 16, 32)))
        ratios[kind].append(g)
    for kind, gs in ratios.items():
        print(f"{kind}: range of T(b, w) / T(b, 1) over the profiles: " + "  ".join(
            f"b{b}w{w} {min(g[(b, w)] / g[(b, 1)] for g in gs):.2f}-{max(g[(b, w)] / g[(b, 1)] for g in gs):.2f}"
            for b in (1, 2, 4, 32) for w in (2, 5)))


if __name__ == "__main__":
    main()
