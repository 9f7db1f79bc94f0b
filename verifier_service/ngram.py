"""The n-gram (prompt-lookup) proposer: drafts by copying what followed the latest earlier
occurrence of the sequence's last n tokens, n from `max_n` down to `min_n`. No model: it runs in
the verifier's process, costs microseconds, and is the proposer of a deployment without a drafter
and the fallback while a drafter is down.

Index: per sequence and per n, a dict from each n-gram to the position right after its latest
occurrence, grown as tokens are committed (O(new tokens x n) per round; a lookup is one dict
read per n). The draft is the indexed continuation. Where it reaches the sequence's end (the
match is the latest period of a repeating stretch: "7 7 7 7", "a b a b"), it goes on with its
own tokens, as the repetition would: until stop 50 it was cut there, so a loop of period p drafted
p tokens a round whatever k was.

q: drafts are deterministic, so a sampled request's q is one-hot on the draft, which the
acceptance rule takes a draft without probabilities to be (`accept_on_device`; until stop 50 this
proposer built the [k, V] one-hot itself, on the device, for every sampled row). The rule is then
exact as always: accept x with p(x), else resample from (p - q)+, which is p with x removed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specserve.core.proposer import Draft, ProposeItem, Proposer
from specserve.core.sampling import SamplingParams


@dataclass
class _Seq:
    params: SamplingParams
    tokens: list[int]
    index: dict[int, dict[tuple, int]] = field(default_factory=dict)  # n -> n-gram -> position after it
    indexed: int = 0  # n-grams ending before this position are in the index


class NgramProposer(Proposer):
    def __init__(self, vocab_size: int, min_n: int = 2, max_n: int = 4):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.vocab_size = vocab_size
        self.min_n, self.max_n = min_n, max_n
        self.seqs: dict[str, _Seq] = {}

    def start(self, seq_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        if seq_id in self.seqs:
            raise ValueError(f"sequence {seq_id!r} already started")
        self.seqs[seq_id] = _Seq(params, list(prompt_ids), {n: {} for n in range(self.min_n, self.max_n + 1)})

    def release(self, seq_id: str) -> None:
        self.seqs.pop(seq_id, None)

    def propose(self, items: list[ProposeItem]) -> list[Draft]:
        drafts = []
        for item in items:
            seq = self.seqs[item.seq_id]
            seq.tokens.extend(item.new_tokens)
            tokens = self.lookup(seq, item.k) if item.k else []
            drafts.append(Draft(tokens, None))  # q: one-hot on the draft (see the module)
        return drafts

    def lookup(self, seq: _Seq, k: int) -> list[int]:
        """The continuation of the longest indexed n-gram that ends the sequence (up to k tokens)."""
        tokens = seq.tokens
        for end in range(seq.indexed, len(tokens) - 1):  # index n-grams that now have a continuation
            for n, table in seq.index.items():
                if end + 1 >= n:
                    table[tuple(tokens[end + 1 - n:end + 1])] = end + 1
        seq.indexed = max(seq.indexed, len(tokens) - 1)
        for n in range(self.max_n, self.min_n - 1, -1):
            if len(tokens) > n:
                at = seq.index[n].get(tuple(tokens[-n:]))
                if at is not None:
                    draft, period = tokens[at:at + k], len(tokens) - at
                    while len(draft) < k:  # past the end: the stretch repeats with this period
                        draft.append(draft[len(draft) - period])
                    return draft
        return []

