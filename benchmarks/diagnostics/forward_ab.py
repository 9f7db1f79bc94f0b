"""Diagnostic (prints, writes no result file): two versions of the lean forward (`FastLlama`) on the
demo pair's weights, one torch thread: whether their logits are bit-identical (widths 1 and 5,
batched, compact and gathered slots), and their pass times (width 1, width 5, a 3-sequence decode
pass), the version and case drawn at random before every pass, medians of ~400 passes each.

    git show REV:core/fast_llama.py > /tmp/fast_llama_old.py
    .venv/bin/python benchmarks/diagnostics/forward_ab.py /tmp/fast_llama_old.py [core/fast_llama.py [TARGET_DTYPE]]

TARGET_DTYPE: float32 (the default) or bfloat16 (what `dtype: auto` gives the target on an AMX or AVX512-BF16 CPU).
"""
import importlib.util, os, random, statistics, sys, time, torch
from specserve.core.runner import compile_cache_dir
torch.set_num_threads(1)
import transformers
def load(path, name):
    spec = importlib.util.spec_from_file_location(name, path); m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); return m
old = load(sys.argv[1], "fl_old"); new = load(sys.argv[2] if len(sys.argv) > 2 else "core/fast_llama.py", "fl_new")
R = {}
target_dtype = getattr(torch, sys.argv[3]) if len(sys.argv) > 3 else torch.float32
for name in ("drafter", "target"):
    dtype = target_dtype if name == "target" else torch.float32
    for tag, mod in (("old", old), ("new", new)):  # a model each: a version may re-lay its weights
        model = transformers.AutoModelForCausalLM.from_pretrained(f"models/demo/{name}", dtype=dtype).eval()
        fl = mod.FastLlama(model, slots=8, plan_store=os.path.join(compile_cache_dir(), "gemm_plan.json"))
        with torch.inference_mode():
            fl.forward([list(range(1, 65))], [0]); fl.forward([list(range(1, 40))] * 3, [1, 2, 3])
        R[name, tag] = fl
# bit identity
with torch.inference_mode():
    for name in ("drafter", "target"):
        outs = []
        for tag in ("old", "new"):
            fl = R[name, tag]
            a = fl.forward([[5, 6, 7, 8, 9]], [0]); fl.cache.lengths[0] -= 5
            b2 = fl.forward([[5], [6, 7, 8]], [2, 1]); fl.cache.lengths[2] -= 1; fl.cache.lengths[1] -= 3
            c = fl.forward([[5]], [0], last_only=True); fl.cache.lengths[0] -= 1
            outs.append([a[0], *b2, c[0]])
        print(name, "bit-identical:", all(torch.equal(x, y) for x, y in zip(*outs)))
def step(fl, w):
    with torch.inference_mode():
        fl.forward([list(range(5, 5 + w))], [0], last_only=(w == 1)); fl.cache.lengths[0] -= w
def step16(fl):
    with torch.inference_mode():
        fl.forward([[5]] * 3, [1, 2, 3], last_only=True)
        for s in (1, 2, 3): fl.cache.lengths[s] -= 1
cases = [(n, t, w) for n in ("drafter", "target") for t in ("old", "new") for w in (1, 5, "b3")]
T = {c: [] for c in cases}
for _ in range(4800):
    c = random.choice(cases); n, t, w = c; fl = R[n, t]
    t0 = time.perf_counter(); step16(fl) if w == "b3" else step(fl, w); T[c].append(time.perf_counter() - t0)
for n in ("drafter", "target"):
    for w in (1, 5, "b3"):
        o, nw = statistics.median(T[n, "old", w]), statistics.median(T[n, "new", w])
        print(f"{n} width {w}: old {1e3*o:.3f} ms, new {1e3*nw:.3f} ms, new/old {nw/o:.3f}")
