"""Diagnostic (prints, writes no result file): one demo-drafter pass by dtype (`auto`: float32
layers with a bfloat16 head where the CPU multiplies bf16 in hardware; `bfloat16`: all of it) and
by draft-vocabulary size (ids drawn at random: the cost, not the acceptance), each right after a
target pass as in a round, at 1 and 4 sequences; median CPU ms per pass over 4 passes a sample,
the variants drawn at random sample by sample. Stop 46 (the Xeon with AMX, in a slow spell), 1
sequence: auto 1.48 / 1.36 / 1.23 ms with every token / 4096 / 1024, bfloat16 2.11 / 2.05 / 1.88;
4 sequences: auto 2.64 / 2.50 / 2.28, bfloat16 3.79 / 3.72 / 3.41.

    .venv/bin/python benchmarks/diagnostics/drafter_vocab_dtype.py
"""
import collections
import random
import statistics
import time

import torch

from specserve.core.runner import ModelRunner

torch.set_num_threads(1)
ranked = list(range(8192))
random.Random(0).shuffle(ranked)
runners = {}
for dtype in ("auto", "bfloat16"):
    for n in (8192, 4096, 1024):
        r = ModelRunner.from_pretrained("models/demo/drafter", name="drafter", role="drafter", slots=4, dtype=dtype,
                                        draft_vocab="off")
        if n < 8192:
            r = ModelRunner(r.model, name="drafter", slots=4, bf16_head=r.bf16_head, vocab=ranked[:n])
        r.prefill_batch([(s, list(range(1, 97))) for s in range(4)])
        runners[(dtype, n)] = r
target = ModelRunner.from_pretrained("models/demo/target", name="target")
target.prefill_batch([(0, list(range(1, 97)))])
wide = torch.tensor([[5] * 5])
res = collections.defaultdict(list)
for b in (1, 4):
    ids = torch.tensor([[5]] * b)
    for _ in range(300):
        key = random.choice(list(runners))
        r = runners[key]
        target.score_ids(wide, [0])
        target.rollback(5)
        c0 = time.thread_time()
        for _ in range(4):
            r.score_ids(ids, list(range(b)), vocab=key[1] < 8192)
        res[(b,) + key].append((time.thread_time() - c0) / 4)
        for s in range(b):
            r.rollback(4, slot=s)
for key, v in sorted(res.items()):
    print(f"{key[0]} sequence(s), dtype {key[1]}, vocabulary {key[2]}: {statistics.median(v) * 1e3:.3f} ms CPU/pass")
