"""Pipelined drafting: the drafter works on round r+1 while the target verifies round r.

Policy ("assume all accepted"): right after answering round r with drafts d_1..d_k, the drafter
feeds d_k, guesses the target's bonus token as its own most likely next token g, and drafts
round r+1 as if d_1..d_k, g had been committed.

- Hit: the verifier then reports exactly d_1..d_k, g as committed. The prepared draft is
  returned at once; round r+1's drafting was hidden behind round r's verification.
- Miss: the guess is discarded: the committed tokens are reset and the KV cache rolls back to
  the longest prefix that agrees with what was really committed, then round r+1 is drafted.

Output is unchanged by this: a sampled draft's random stream is derived from the committed
length (see sampling.request_generator), so a prepared draft equals the one that would have been
drafted on demand.
"""

from __future__ import annotations

from drafter_service.proposer import Draft, DraftModelProposer, Proposer
from drafter_service.sampling import SamplingParams


class PipelinedProposer(Proposer):
    def __init__(self, inner: DraftModelProposer):
        self.inner = inner
        self.max_length = inner.max_length
        self.last: Draft | None = None  # the draft most recently returned
        self.ready: tuple[int, list[int], Draft] | None = None  # (committed length, assumed tokens, draft)
        self.hits = 0
        self.misses = 0

    def start(self, prompt_ids: list[int], params: SamplingParams) -> None:
        self.inner.start(prompt_ids, params)
        self.last = self.ready = None

    def propose(self, new_tokens: list[int], k: int) -> Draft:
        if self.ready is not None:
            base, assumed, draft = self.ready
            self.ready = None
            if assumed == new_tokens and len(draft.tokens) == k:
                self.hits += 1
                self.last = Draft(draft.tokens, draft.probs, pipeline_hit=True)
                return self.last
            self.misses += 1
            del self.inner.tokens[base:]  # forget the assumed commit; propose() rolls the cache back
        self.last = self.inner.propose(new_tokens, k)
        return self.last

    def speculate(self, k: int) -> None:
        """Prepare the next round, assuming the last draft is accepted in full. Run between rounds."""
        if self.last is None or not self.last.tokens or self.ready is not None:
            return
        base = len(self.inner.tokens)
        assumed = self.last.tokens + [self.inner.most_likely_after(self.last.tokens[-1])]
        self.ready = (base, assumed, self.inner.propose(assumed, k))

    def release(self) -> None:
        self.inner.release()
        self.last = self.ready = None
