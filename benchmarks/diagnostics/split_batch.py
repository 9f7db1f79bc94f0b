"""Diagnostic (prints, writes no result file): whether splitting a batch in two halves that take
turns would let the remote drafter work beside the target at batch sizes where pipelining's
guess of the outcome rarely hits. A prototype loop, not the engine: the target here (one torch
thread), the drafter's gRPC server in a child process (not pipelining), greedy, k = 4, B
held-out prompts, 64 new tokens each (ignore EOS), all starting together.

- plain: one target pass of all B sequences per token;
- sequential: the drafter drafts for all B (one Propose), then the target verifies all B;
- split: halves A and B take turns. The drafter drafts for one half (its Propose sent as soon as
  that half's outcome is known) while the target verifies the other half, so the drafter always
  drafts from a known outcome and never guesses; each half talks on its own connection.

Every mode's tokens are checked equal to plain decoding's (greedy). Runs interleaved, medians.

    .venv/bin/python benchmarks/diagnostics/split_batch.py 2,4,8 3
"""
import statistics, sys, time, torch
from pathlib import Path
torch.set_num_threads(1)
from transformers.utils import logging as hf_logging
hf_logging.disable_progress_bar()
from specserve.benchmarks.rounds import DrafterProcess
from specserve.core.proposer import ProposeItem
from specserve.core.runner import ModelRunner, load_tokenizer
from specserve.core.sampling import SamplingParams
from specserve.training.demo_pair import heldout_prompts
from specserve.verifier.acceptance import accept_greedy
from specserve.verifier.client import RemoteProposer

K, NEW = 4, 64
m = Path("models/demo")
sizes = [int(b) for b in (sys.argv[1] if len(sys.argv) > 1 else "2,4,8").split(",")]
repeats = int(sys.argv[2]) if len(sys.argv) > 2 else 3
prompts = heldout_prompts(m, max(sizes), 64, load_tokenizer(str(m / "target")))
target = ModelRunner.from_pretrained(str(m / "target"), name="target", slots=max(sizes))
server = DrafterProcess(str(m / "drafter"), pipeline=False)
clients = [RemoteProposer(server.address), RemoteProposer(server.address)]
run_id = iter(range(1 << 30))


class Seq:
    def __init__(self, slot, prompt):
        self.slot, self.out, self.pending, self.unsent = slot, [], prompt[-1], []
        self.id = f"s{next(run_id)}"

    @property
    def left(self):
        return NEW - len(self.out)


def start(seqs, client):
    for s, p in zip(seqs, [prompts[s.slot] for s in seqs]):
        target.prefill(p[:-1], slot=s.slot)
    if client is not None:
        client.start_many([(s.id, prompts[s.slot], SamplingParams().with_seed()) for s in seqs])


def verify(seqs, drafts):
    """One target pass over seqs with their drafts; commits the outcome (or one token, no drafts)."""
    drafts = [d[:max(s.left - 1, 0)] for s, d in zip(seqs, drafts)]
    logits = target.score_batch([(s.slot, [s.pending] + d) for s, d in zip(seqs, drafts)], last_only=not any(drafts))
    if not any(drafts):
        outcomes = [(0, int(lg[-1].argmax())) for lg in logits]
    else:
        outcomes = accept_greedy(drafts, logits)
    for s, d, (a, nxt) in zip(seqs, drafts, outcomes):
        target.rollback(len(d) - a, slot=s.slot)
        emitted = (d[:a] + [nxt])[:s.left]
        s.out += emitted
        s.unsent += emitted
        s.pending = nxt


def items(seqs):
    out = [ProposeItem(s.id, s.unsent, min(K, max(s.left - 1, 0))) for s in seqs if s.left > 0]
    for s in seqs:
        s.unsent = []
    return out


def finish(seqs, client):
    for s in seqs:
        target.release(s.slot)
    if client is not None:
        client.release_many([s.id for s in seqs])
    return [s.out for s in seqs]


def plain(b):
    seqs = [Seq(i, prompts[i]) for i in range(b)]
    start(seqs, None)
    while seqs[0].left > 0:
        verify(seqs, [[] for _ in seqs])
    return finish(seqs, None)


def sequential(b):
    seqs = [Seq(i, prompts[i]) for i in range(b)]
    start(seqs, clients[0])
    while any(s.left > 0 for s in seqs):
        live = [s for s in seqs if s.left > 0]
        drafts = [d.tokens for d in clients[0].propose(items(live))]
        verify(live, drafts)
    return finish(seqs, clients[0])


def split(b):
    seqs = [Seq(i, prompts[i]) for i in range(b)]
    halves = [seqs[:b // 2], seqs[b // 2:]]
    for h, c in zip(halves, clients):
        start(h, c)
    # half 0's first drafts on demand; then each half's Propose goes out once its outcome is known
    clients[0].send(items(halves[0]))
    clients[1].send(items(halves[1]))
    turn = 0
    while any(s.left > 0 for s in seqs):
        h, c = halves[turn], clients[turn]
        if any(s.left > 0 for s in h):
            drafts = [d.tokens for d in c.receive()]
            live = [s for s in h if s.left > 0]
            verify(live, drafts)
            if any(s.left > 0 for s in h):
                c.send(items(h))  # the drafter drafts this half while the target verifies the other
        turn = 1 - turn
    return [*finish(halves[0], clients[0]), *finish(halves[1], clients[1])]


modes = {"plain": plain, "sequential": sequential, "split": split}
for b in sizes:
    T = {name: [] for name in modes}
    reference = plain(b)
    for rep in range(repeats):
        for name, fn in (modes.items() if rep % 2 == 0 else list(modes.items())[::-1]):
            t0 = time.perf_counter()
            out = fn(b)
            T[name].append(b * NEW / (time.perf_counter() - t0))
            if out != reference:
                raise SystemExit(f"{name} at {b} sequences: tokens differ from plain decoding's")
    base = statistics.median(T["plain"])
    print(f"B={b}: " + ", ".join(f"{n} {statistics.median(v):.1f} tok/s ({statistics.median(v) / base:.2f}x)"
                                 for n, v in T.items()) + "; outputs equal to plain decoding's", flush=True)
for c in clients:
    c.client.close()
server.close()
