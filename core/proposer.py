"""The proposer interface: what suggests the k draft tokens, behind one small interface (as
vLLM's `spec_decode` proposers and HF's `CandidateGenerator`). Implementations: the draft model
(`specserve.drafter.draft_model`), on the verifier's side the remote drafter over gRPC
(`specserve.verifier.client`), and the model-free n-gram proposer (`specserve.verifier.ngram`).

A proposer holds sequences by id. On every call it is told, per sequence, only which tokens were
committed since its last call; it works out how much of its cached drafting survived, rolls the
rest back, and drafts. It never needs to know the acceptance rule. Calls are batched: one
`propose` serves every active sequence of a round.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: the config imports MAX_K without torch
    import torch

    from specserve.core.sampling import SamplingParams

MAX_K = 16  # the most drafts one round of one sequence may carry (a request's k, the config's, the wire's)


@dataclass
class Draft:
    tokens: list[int]
    probs: torch.Tensor | None  # [k, V] q the tokens were sampled from; None when greedy
    pipeline_hit: bool = False  # prepared while the previous round was being verified
    prepared: int = 0  # outcomes the drafter had prepared for this round (its fan-out used; 0: none)


@dataclass
class ProposeItem:
    seq_id: str
    new_tokens: list[int]  # committed since the previous propose (or since start)
    k: int  # at most this many drafts; 0: only take in new_tokens (stay caught up), draft nothing
    min_confidence: float = 0.0  # stop before a position whose top q is below this (see confidence_cut)
    prepare: bool = True  # the drafter's gRPC server prepares this sequence's next round after answering


def confidence_cut(top_probs: list[float], threshold: float) -> int:
    """How many drafts to keep: those before the first position whose distribution's largest
    probability is below threshold. The cut depends on q at a position, never on the token drawn
    there, so speculative sampling stays exact."""
    for i, c in enumerate(top_probs):
        if c < threshold:
            return i
    return len(top_probs)


class CapacityError(RuntimeError):
    """No free sequence slot."""


def common_prefix_len(a: list[int], b: list[int], start: int = 0) -> int:
    n = start
    limit = min(len(a), len(b))
    while n < limit and a[n] == b[n]:
        n += 1
    return n


class Proposer:
    """Interface: start a sequence, propose k tokens after newly committed ones, release."""

    max_length: int = 1 << 30  # longest sequence the proposer can hold
    vocab_size: int | None = None  # the size of its q (None: it makes none); must be the target's
    # True for a proposer whose `send(items)` starts a propose and `receive()` returns its drafts
    # later (a remote drafter): the engine then sends a round's outcome as soon as acceptance is
    # decided, so the drafter drafts while the verifier does the round's bookkeeping
    answers_later: bool = False
    # True for a proposer that drafts each sequence's next round while this one is verified
    # (pipelining: a remote drafter started with it); the policy then expects some drafts ready
    # from the start (`policy.PRIOR_READY`), before it has measured how many
    prepares: bool = False

    def start(self, seq_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        raise NotImplementedError

    def propose(self, items: list[ProposeItem]) -> list[Draft]:
        raise NotImplementedError

    def start_many(self, items: list[tuple[str, list[int], SamplingParams]]) -> None:
        """Several `start`s at once (one batched prefill where the proposer can)."""
        for seq_id, prompt_ids, params in items:
            self.start(seq_id, prompt_ids, params)

    def release(self, seq_id: str) -> None:
        pass

    def abandon(self, seq_ids: list[str]) -> None:
        """Sequences that a Start put on a connection given up since (a remote drafter failed
        while the Start ran): forgotten, and released on the drafter once it is back."""

    def due(self, seq_id: str) -> bool:
        """Whether the sequence needs a call now, drafts or not, to stay alive on the proposer (a
        remote drafter reclaims a sequence it has not heard of for its TTL). The engine then
        sends its committed tokens with k = 0, even while the drafter rests."""
        return False

    def release_many(self, seq_ids: list[str]) -> None:
        for seq_id in seq_ids:
            self.release(seq_id)

    # Failure handling, for proposers that can fail and come back (a remote drafter). The engine
    # calls mark_failed when a call raised something other than CapacityError / ValueError, stops
    # using the proposer, and polls recovered() between rounds: True means usable again, with no
    # sequences (the engine starts its running sequences anew).
    def mark_failed(self, error: Exception) -> None:
        pass

    def recovered(self) -> bool:
        return False

    def recoverable(self) -> bool:
        """Whether `recovered()` would swap a fresh connection in now (nothing changes yet)."""
        return False
