"""The draft -> verify -> accept loop, in one process. Reads top to bottom:

    prefill target and drafter
    each round:  draft k tokens  ->  score k+1 positions in ONE target pass  ->  accept
                 ->  roll the target back to the accepted prefix (the drafter rolls itself back
                     on its next call, from the tokens it is told were committed)

The target's cache always holds every committed token but the last ("pending") one, so a
round scores [pending, d_1 .. d_k] and gets the k+1 distributions it needs in one pass.
k = 0 (or no proposer) is plain target decoding through the same runner and loop.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Callable

from drafter_service.proposer import Draft, DraftModelProposer, Proposer
from drafter_service.runner import ModelRunner
from drafter_service.sampling import SamplingParams, request_generator, warp
from verifier_service.acceptance import accept


@dataclass
class SpecStats:
    """Per-request statistics, named as vLLM's spec-decode metrics."""

    num_rounds: int = 0
    num_target_passes: int = 0  # target forward passes after prefill (one per round)
    num_drafts: int = 0  # rounds that had a draft (k > 0)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    num_pipeline_hits: int = 0  # rounds whose draft was ready from pipelined drafting

    def record(self, k: int, num_accepted: int) -> None:
        self.num_rounds += 1
        self.num_target_passes += 1
        if k:
            self.num_drafts += 1
            self.num_draft_tokens += k
            self.num_accepted_tokens += num_accepted
            if len(self.num_accepted_tokens_per_pos) < k:
                self.num_accepted_tokens_per_pos += [0] * (k - len(self.num_accepted_tokens_per_pos))
            for i in range(num_accepted):
                self.num_accepted_tokens_per_pos[i] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens written per drafted round: accepted drafts + the target's own token."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d["acceptance_rate"] = self.acceptance_rate
        d["mean_acceptance_length"] = self.mean_acceptance_length
        return d


@dataclass
class GenerationResult:
    token_ids: list[int]
    finish_reason: str  # "stop" (EOS or a stop token), "length", or "cancelled"
    stats: SpecStats


def eos_token_ids(model) -> set[int]:
    eos = getattr(model.generation_config, "eos_token_id", None)
    if eos is None:
        eos = getattr(model.config, "eos_token_id", None)
    if eos is None:
        return set()
    return {int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])}


def check_request(prompt_ids: list[int], max_new_tokens: int, k: int, max_length: int, vocab_size: int) -> None:
    """Raises ValueError with a user-facing message for a request that cannot run."""
    if not prompt_ids:
        raise ValueError("the prompt is empty")
    if any(not (0 <= t < vocab_size) for t in prompt_ids):
        raise ValueError(f"prompt token ids must be in [0, {vocab_size})")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_tokens must be an integer >= 1, got {max_new_tokens!r}")
    if not isinstance(k, int) or k < 0:
        raise ValueError(f"k must be an integer >= 0, got {k!r}")
    if len(prompt_ids) + max_new_tokens > max_length:
        raise ValueError(
            f"prompt ({len(prompt_ids)} tokens) + max_tokens ({max_new_tokens}) exceeds the context of {max_length} tokens")


def truncate_at_stop(tokens: list[int], stop_ids: set[int]) -> tuple[list[int], bool]:
    for i, t in enumerate(tokens):
        if t in stop_ids:
            return tokens[: i + 1], True
    return tokens, False


class SpeculativeEngine:
    """A target runner plus an optional proposer, generating one request at a time."""

    def __init__(self, target: ModelRunner, proposer: Proposer | None = None, eos_ids: set[int] | None = None):
        self.target = target
        self.proposer = proposer
        self.eos_ids = eos_token_ids(target.model) if eos_ids is None else set(eos_ids)
        self.max_length = target.max_length
        if proposer is not None:
            self.max_length = min(self.max_length, proposer.max_length)

    def generate(self, prompt_ids: list[int], max_new_tokens: int, sampling: SamplingParams = SamplingParams(),
                 k: int = 4, on_tokens: Callable[[list[int]], bool] | None = None) -> GenerationResult:
        """on_tokens, if given, receives each round's written tokens; returning False cancels the
        request (finish_reason "cancelled"). Both caches are released however the request ends."""
        if self.proposer is None:
            k = 0
        check_request(prompt_ids, max_new_tokens, k, self.max_length, self.target.vocab_size)
        params = sampling.with_seed()
        stop_ids = self.eos_ids | set(params.stop_token_ids)
        stats = SpecStats()
        out: list[int] = []
        pending, unsent = prompt_ids[-1], []  # unsent: committed tokens the drafter has not been told
        try:
            self.target.prefill(prompt_ids[:-1])
            if k:
                self.proposer.start(prompt_ids, params)
            while True:
                kk = min(k, max_new_tokens - len(out) - 1)  # never overshoot max_new_tokens
                draft = self.proposer.propose(unsent, kk) if kk else Draft([], None)
                unsent = [] if kk else unsent
                num_accepted, next_token = self.verify(pending, draft, params, len(prompt_ids) + len(out))
                stats.record(kk, num_accepted)
                stats.num_pipeline_hits += draft.pipeline_hit
                emitted, stopped = truncate_at_stop(draft.tokens[:num_accepted] + [next_token], stop_ids)
                out += emitted
                unsent += emitted
                wanted = on_tokens is None or on_tokens(emitted) is not False
                if stopped or len(out) >= max_new_tokens:
                    return GenerationResult(out, "stop" if stopped else "length", stats)
                if not wanted:
                    return GenerationResult(out, "cancelled", stats)
                pending = next_token
        finally:
            self.target.release()
            if k:
                self.proposer.release()

    def verify(self, pending: int, draft: Draft, params: SamplingParams, position: int) -> tuple[int, int]:
        """Score [pending] + drafts in one target pass, accept, roll the target back."""
        p = warp(self.target.score([pending] + draft.tokens), params)
        num_accepted, next_token = accept(draft.tokens, draft.probs, p,
                                          request_generator(params.seed, "verify", position))
        self.target.rollback(len(draft.tokens) - num_accepted)
        return num_accepted, next_token


def same_tokenizer(a, b) -> bool:
    """Speculation compares token ids, so drafter and target must share one vocabulary."""
    return a.get_vocab() == b.get_vocab() and a.all_special_tokens == b.all_special_tokens


def load_engine(target_path: str, drafter_path: str | None, **runner_kwargs) -> SpeculativeEngine:
    """Loads a target (and drafter) from local HF folders; raises ModelLoadError or ValueError."""
    target = ModelRunner.from_pretrained(target_path, name="target", **runner_kwargs)
    proposer = None
    if drafter_path is not None:
        drafter = ModelRunner.from_pretrained(drafter_path, name="drafter", **runner_kwargs)
        if not same_tokenizer(target.tokenizer, drafter.tokenizer):
            raise ValueError(f"the drafter's tokenizer ({drafter_path}) differs from the target's ({target_path}); "
                             "speculative decoding needs one shared vocabulary")
        proposer = DraftModelProposer(drafter)
    return SpeculativeEngine(target, proposer)
