"""What several diagnostics share (each is run as a script, so this folder is on its path:
`from _shared import median_us`)."""
import statistics
import time

from specserve.core.sampling import SamplingParams


def median_us(fn, n: int = 300) -> float:
    """fn's median wall time over n calls, in µs."""
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e6 * statistics.median(times)


def interleaved_tok_s(rows: dict, prompts, repeats: int, max_tokens: int = 64) -> dict[str, float]:
    """rows: name -> (engine, k). Each repeat generates every prompt greedily under each row, the
    rows' order reversed every other repeat; the first repeat is a warm-up and dropped. Returns
    each row's median tokens/s."""
    names, rates = list(rows), {name: [] for name in rows}
    for rep in range(repeats):
        for name in (names if rep % 2 else names[::-1]):
            engine, k = rows[name]
            n, t0 = 0, time.perf_counter()
            for p in prompts:
                n += len(engine.generate(p, max_tokens, SamplingParams(), k=k).token_ids)
            if rep:
                rates[name].append(n / (time.perf_counter() - t0))
    return {name: statistics.median(v) for name, v in rates.items()}


def hot_gemm_plan(fast):
    """A GemmPlan for a lean forward's weights measured as before stop 36 (the products back to
    back, hot in cache: EVICT_BYTES of 4), under a plan key of its own; GemmPlan's class settings
    are restored."""
    from specserve.core.fast_llama import GemmPlan
    saved = GemmPlan.EVICT_BYTES, GemmPlan.VERSION
    GemmPlan.EVICT_BYTES, GemmPlan.VERSION = 4, -1
    try:
        return GemmPlan(fast._weights(), None)
    finally:
        GemmPlan.EVICT_BYTES, GemmPlan.VERSION = saved
