"""Diagnostic (prints, writes no result file): two versions of the draft-model proposer
(`drafter_service/draft_model.py`) on the demo drafter, one torch thread, each with a runner of
its own: whether they draft the same (tokens, q and confidences over 12 mixed greedy and sampled
rounds), then the time of a round (commit 4 tokens, draft 4) at 1, 8 and 16 sequences, greedy
and sampled (T = 0.8), the versions alternating, medians of 5 blocks of 20 rounds each.

    git show REV:drafter_service/draft_model.py > /tmp/draft_model_old.py
    .venv/bin/python benchmarks/diagnostics/drafter_round.py /tmp/draft_model_old.py [drafter_service/draft_model.py]
"""
import importlib.util, statistics, sys, time, torch
torch.set_num_threads(1)
from specserve.core.proposer import ProposeItem
from specserve.core.runner import ModelRunner
from specserve.core.sampling import SamplingParams


def load(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    m = importlib.util.module_from_spec(spec)
    sys.modules[name] = m  # (dataclasses look their module up)
    spec.loader.exec_module(m)
    return m


mods = {"old": load(sys.argv[1], "dm_old"), "new": load(sys.argv[2] if len(sys.argv) > 2 else "drafter_service/draft_model.py", "dm_new")}
P = {tag: m.DraftModelProposer(ModelRunner.from_pretrained("models/demo/drafter", role="drafter", slots=17)) for tag, m in mods.items()}

# the same drafts?
seen = {}
for tag, p in P.items():
    params = [SamplingParams(temperature=0.0 if i % 2 == 0 else 0.8, top_p=0.9, seed=i) for i in range(6)]
    p.start_many([(f"s{i}", list(range(10 + 3 * i, 60 + 5 * i)), params[i]) for i in range(6)])
    out = []
    for rnd in range(12):
        items = [ProposeItem(f"s{i}", [(rnd * 13 + i * 7 + j) % 8000 for j in range(1 + (rnd + i) % 4)],
                             [4, 3, 0, 2, 4, 1][(rnd + i) % 6]) for i in range(6)]
        for i, d in enumerate(p.propose(items)):
            out.append((d.tokens, None if d.probs is None else d.probs.tolist(), p.confidence(f"s{i}")))
    seen[tag] = out
    for i in range(6):
        p.release(f"s{i}")
print("same drafts, q and confidences:", seen["old"] == seen["new"], f"({sum(len(o[0]) for o in seen['old'])} draft tokens)")


def rounds(p, b, temp, n):
    names = [f"r{i}" for i in range(b)]
    p.start_many([(s, list(range(10 + i, 74 + i)), SamplingParams(temperature=temp, seed=i)) for i, s in enumerate(names)])
    ts = []
    for r in range(n):
        items = [ProposeItem(s, [(100 + 4 * r + 7 * i + j) % 8000 for j in range(4)], 4) for i, s in enumerate(names)]
        t0 = time.perf_counter()
        p.propose(items)
        ts.append(time.perf_counter() - t0)
    for s in names:
        p.release(s)
    return ts


for temp in (0.0, 0.8):
    for b in (1, 8, 16):
        T = {tag: [] for tag in P}
        for block in range(5):
            for tag, p in P.items():
                T[tag] += rounds(p, b, temp, 20)
        o, nw = statistics.median(T["old"]) * 1e3, statistics.median(T["new"]) * 1e3
        print(f"{'greedy' if temp == 0 else 'sampled T=0.8'}, {b} sequences: old {o:.2f} ms, new {nw:.2f} ms, new/old {nw / o:.3f}")
