"""Pipelined drafting: the drafter works on round r+1 while the target verifies round r.

Policy ("assume all accepted"): right after answering round r with drafts d_1..d_k, the drafter
feeds d_k, guesses the target's bonus token as its own most likely next token g, and drafts
round r+1 as if d_1..d_k, g had been committed.

- Hit: the verifier then reports exactly d_1..d_k, g as committed. The prepared draft is
  returned at once; round r+1's drafting was hidden behind round r's verification.
- Miss: the guess is discarded: the committed tokens are reset and the KV cache rolls back to
  the longest prefix that agrees with what was really committed, then round r+1 is drafted.

Output is unchanged by this: a sampled draft's random stream is derived from the committed
length (see sampling.request_generator), and the drafter feeds one token per pass, so a prepared
draft equals the one that would have been drafted on demand.
"""

from __future__ import annotations

from dataclasses import dataclass

from drafter_service.proposer import Draft, DraftModelProposer, ProposeItem, Proposer
from drafter_service.sampling import SamplingParams


@dataclass
class _Prepared:
    base: int  # committed length before the assumed tokens
    assumed: list[int]
    draft: Draft


class PipelinedProposer(Proposer):
    def __init__(self, inner: DraftModelProposer):
        self.inner = inner
        self.max_length = inner.max_length
        self.last: dict[str, Draft] = {}  # the draft most recently returned, per sequence
        self.ready: dict[str, _Prepared] = {}
        self.hits = 0
        self.misses = 0

    def start(self, seq_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        self.inner.start(seq_id, prompt_ids, params)

    def propose(self, items: list[ProposeItem]) -> list[Draft]:
        out: list[Draft | None] = [None] * len(items)
        todo = []
        for i, item in enumerate(items):
            prepared = self.ready.pop(item.seq_id, None)
            if prepared is not None:
                if prepared.assumed == item.new_tokens and len(prepared.draft.tokens) == item.k:
                    self.hits += 1
                    out[i] = Draft(prepared.draft.tokens, prepared.draft.probs, pipeline_hit=True)
                    continue
                self.misses += 1
                self.inner.uncommit(item.seq_id, prepared.base)  # propose() rolls the cache back
            todo.append(i)
        if todo:
            for i, draft in zip(todo, self.inner.propose([items[i] for i in todo])):
                out[i] = draft
        for item, draft in zip(items, out):
            self.last[item.seq_id] = draft
        return out

    def speculate(self, seq_ids: list[str]) -> None:
        """Prepare the next round of these sequences (same k as their last), assuming their last
        drafts are accepted in full. Runs between rounds, as one batch."""
        ids = [s for s in seq_ids if s in self.inner.seqs and s not in self.ready and self.last.get(s)
               and self.last[s].tokens
               and self.inner.committed_length(s) + 2 * len(self.last[s].tokens) + 1 <= self.max_length]
        if not ids:
            return
        bases = [self.inner.committed_length(s) for s in ids]
        lasts = [self.last[s].tokens for s in ids]
        guesses = self.inner.guess_bonus(ids, lasts)
        assumed = [d + [g] for d, g in zip(lasts, guesses)]
        drafts = self.inner.propose([ProposeItem(s, a, len(d)) for s, a, d in zip(ids, assumed, lasts)])
        for s, base, a, d in zip(ids, bases, assumed, drafts):
            self.ready[s] = _Prepared(base, a, d)

    def release(self, seq_id: str) -> None:
        self.inner.release(seq_id)
        self.last.pop(seq_id, None)
        self.ready.pop(seq_id, None)
