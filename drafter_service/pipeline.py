"""Pipelined drafting: the drafter works on round r+1 while the target verifies round r.

Right after answering round r with drafts d_1..d_k, the drafter guesses the outcome of the
verification and drafts round r+1 as if that outcome had been committed. Two policies:

- "all-accepted" (default): the outcome is d_1..d_k plus a bonus token g, the drafter's own
  most likely token after d_k.
- "most-likely": the more frequent of two outcomes, "all accepted, bonus = g" and "d_1
  rejected, the target writing the drafter's runner-up token instead", by the rates this drafter
  has observed: (share of rounds with all k accepted) x (accuracy of g) against (share of rounds
  with d_1 rejected) x (accuracy of the runner-up). Acceptances come in runs, so these shares
  are measured, not derived from the per-token acceptance rate.

- Hit: the verifier then reports exactly the guessed tokens as committed. The prepared draft is
  returned at once; round r+1's drafting was hidden behind round r's verification.
- Miss: the guess is discarded: the committed tokens are reset and the KV cache rolls back to
  the longest prefix that agrees with what was really committed, then round r+1 is drafted.

The prepared draft uses the sequence's last k and confidence threshold. It serves a request for
the same threshold and at most that k (cut to k: a shorter draft is a prefix of a longer one);
anything else is a miss. A k = 0 call (only catching up) is never served from a prepared draft.

Output is unchanged by this: a sampled draft's random stream is derived from the committed
length (see specserve.core.sampling.request_generator), and the drafter feeds one token per pass, so a prepared
draft equals the one that would have been drafted on demand.
"""

from __future__ import annotations

from dataclasses import dataclass

from specserve.config import PIPELINE_POLICIES as POLICIES
from specserve.core.proposer import Draft, ProposeItem, Proposer
from specserve.core.sampling import SamplingParams
from specserve.drafter.draft_model import DraftModelProposer


@dataclass
class _Prepared:
    base: int  # committed length before the assumed tokens
    assumed: list[int]
    draft: Draft
    k: int  # asked for (the draft may be shorter: cut by confidence)
    min_confidence: float
    confidence: list[tuple[float, int, float]]  # the draft's, see DraftModelProposer


class PipelinedProposer(Proposer):
    def __init__(self, inner: DraftModelProposer, policy: str = POLICIES[0]):
        if policy not in POLICIES:
            raise ValueError(f"unknown pipelining policy {policy!r}; one of {POLICIES}")
        self.policy = policy
        self.inner = inner
        self.max_length = inner.max_length
        self.last: dict[str, Draft] = {}  # the draft most recently returned, per sequence
        self.last_ask: dict[str, tuple[int, float]] = {}  # its (k, min_confidence)
        self.last_conf: dict[str, list[tuple[float, int, float]]] = {}
        # what the verifier did with past drafts, for "most-likely": rounds seen, rounds with all
        # drafts accepted / with the first rejected, and how often g / the runner-up was right
        self.rounds = self.all_accepted = self.first_rejected = 0
        self.guess_right = self.guesses = self.runner_up_right = 0
        self.guessed: dict[str, int] = {}  # the bonus guess g made for a sequence's last draft
        self.ready: dict[str, _Prepared] = {}
        self.hits = 0
        self.misses = 0

    def start(self, seq_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        self.inner.start(seq_id, prompt_ids, params)

    def start_many(self, items) -> None:
        self.inner.start_many(items)

    def propose(self, items: list[ProposeItem]) -> list[Draft]:
        out: list[Draft | None] = [None] * len(items)
        todo = []
        for i, item in enumerate(items):
            self._observe(item)
            prepared = self.ready.pop(item.seq_id, None)
            if prepared is not None:
                if (prepared.assumed == item.new_tokens and 0 < item.k <= prepared.k
                        and prepared.min_confidence == item.min_confidence):
                    self.hits += 1
                    d = prepared.draft
                    out[i] = Draft(d.tokens[:item.k], d.probs[:item.k] if d.probs is not None else None,
                                   pipeline_hit=True)
                    self.last_conf[item.seq_id] = prepared.confidence
                    continue
                self.misses += item.k > 0
                self.inner.uncommit(item.seq_id, prepared.base)  # propose() rolls the cache back
            todo.append(i)
        if todo:
            for i, draft in zip(todo, self.inner.propose([items[i] for i in todo])):
                out[i] = draft
                self.last_conf[items[i].seq_id] = list(self.inner.confidence(items[i].seq_id))
        for item, draft in zip(items, out):
            self.last[item.seq_id] = draft
            self.last_ask[item.seq_id] = (item.k, item.min_confidence)
        return out

    def _observe(self, item: ProposeItem) -> None:
        """Learn from the verifier's answer to this sequence's last draft."""
        last = self.last.get(item.seq_id)
        if last is None or not last.tokens or not item.new_tokens:
            return
        k = len(last.tokens)
        n = 0
        while n < k and n < len(item.new_tokens) - 1 and item.new_tokens[n] == last.tokens[n]:
            n += 1
        self.rounds += 1
        guess = self.guessed.pop(item.seq_id, None)
        if n == k:
            self.all_accepted += 1
            if guess is not None:
                self.guesses += 1
                self.guess_right += item.new_tokens[k] == guess
        elif n == 0:
            self.first_rejected += 1
            conf = self.last_conf.get(item.seq_id)
            self.runner_up_right += bool(conf) and item.new_tokens[0] == conf[0][1]

    def speculate(self, seq_ids: list[str]) -> None:
        """Prepare the next round of these sequences (same k as their last) for the guessed outcome
        of their verification. Runs between rounds, as one batch."""
        ids = [s for s in seq_ids if s in self.inner.seqs and s not in self.ready and self.last.get(s)
               and self.last[s].tokens
               and self.inner.committed_length(s) + len(self.last[s].tokens) + self.last_ask[s][0] + 1
               <= self.max_length]
        if not ids:
            return
        bases = {s: self.inner.committed_length(s) for s in ids}
        assumed = {s: self._likeliest_rejection(s) for s in ids} if self.policy == "most-likely" else {}
        full = [s for s in ids if assumed.get(s) is None]
        if full:
            lasts = [self.last[s].tokens for s in full]
            for s, d, g in zip(full, lasts, self.inner.guess_bonus(full, lasts)):
                assumed[s] = d + [g]
                self.guessed[s] = g
        drafts = self.inner.propose([ProposeItem(s, assumed[s], *self.last_ask[s]) for s in ids])
        for s, d in zip(ids, drafts):
            self.ready[s] = _Prepared(bases[s], assumed[s], d, *self.last_ask[s], list(self.inner.confidence(s)))

    def _likeliest_rejection(self, seq_id: str) -> list[int] | None:
        """The committed tokens of the outcome "d_1 rejected, runner-up written" when it has been
        the more frequent bet, else None (bet on "all accepted")."""
        conf = self.last_conf.get(seq_id)
        p_all = (self.all_accepted + 1) / (self.rounds + 2) * (self.guess_right + 1) / (self.guesses + 2)
        p_rej = (self.first_rejected + 1) / (self.rounds + 2) * (self.runner_up_right + 1) / (self.first_rejected + 2)
        if not conf or p_rej <= p_all:
            return None
        return [conf[0][1]]

    def release(self, seq_id: str) -> None:
        self.inner.release(seq_id)
        self.last.pop(seq_id, None)
        self.last_ask.pop(seq_id, None)
        self.last_conf.pop(seq_id, None)
        self.guessed.pop(seq_id, None)
        self.ready.pop(seq_id, None)
