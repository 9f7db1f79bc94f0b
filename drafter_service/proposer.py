"""Proposers: what suggests the k draft tokens, behind one small interface (as vLLM's
`spec_decode` proposers and HF's `CandidateGenerator`).

A proposer is told, on every call, only which tokens were committed since its last call. It
keeps its own KV cache and, from those tokens, works out how much of its cached drafting
survived and rolls the rest back. It never needs to know the acceptance rule.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from drafter_service.runner import ModelRunner
from drafter_service.sampling import SamplingParams, request_generator, sample, warp


@dataclass
class Draft:
    tokens: list[int]
    probs: torch.Tensor | None  # [k, V] q the tokens were sampled from; None when greedy
    pipeline_hit: bool = False  # prepared while the previous round was being verified


def common_prefix_len(a: list[int], b: list[int], start: int = 0) -> int:
    n = start
    limit = min(len(a), len(b))
    while n < limit and a[n] == b[n]:
        n += 1
    return n


class Proposer:
    """Interface: start a sequence, propose k tokens after newly committed ones, release."""

    max_length: int = 1 << 30  # longest sequence the proposer can hold

    def start(self, prompt_ids: list[int], params: SamplingParams) -> None:
        raise NotImplementedError

    def propose(self, new_tokens: list[int], k: int) -> Draft:
        raise NotImplementedError

    def release(self) -> None:
        pass


class DraftModelProposer(Proposer):
    """Drafts with a small causal LM; q = warp(drafter logits) with the request's settings."""

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.tokens: list[int] = []  # committed tokens
        self.cached: list[int] = []  # tokens in the runner's KV cache (committed prefix + drafts)
        self.max_length = runner.max_length

    def start(self, prompt_ids: list[int], params: SamplingParams) -> None:
        if params.seed is None:
            raise ValueError("the proposer needs a fixed seed (SamplingParams.with_seed())")
        self.params = params
        self.tokens = list(prompt_ids)
        self.cached = list(prompt_ids[:-1])
        self.runner.prefill(self.cached)

    def propose(self, new_tokens: list[int], k: int) -> Draft:
        committed_before = len(self.tokens)
        self.tokens.extend(new_tokens)
        # Keep what agrees with the committed tokens (at least one token must be fed to get logits).
        keep = min(common_prefix_len(self.cached, self.tokens, start=min(committed_before, len(self.cached))),
                   len(self.tokens) - 1)
        self.runner.rollback(len(self.cached) - keep)
        # One token per forward, so the cache holds the same numbers whichever path led here
        # (on demand or pipelined): q, and so sampled output, does not depend on timing.
        for token in self.tokens[keep:]:
            logits = self.runner.score([token], last_only=True)[-1]
        self.cached = list(self.tokens)
        return self._draft(logits, k)

    def _draft(self, logits: torch.Tensor, k: int) -> Draft:
        generator = request_generator(self.params.seed, "draft", len(self.tokens))
        drafts, qs = [], []
        for i in range(k):
            if self.params.greedy:
                x = int(logits.argmax())
            else:
                q = warp(logits, self.params)
                x = sample(q, generator)
                qs.append(q)
            drafts.append(x)
            if i < k - 1:
                logits = self.runner.score([x])[-1]
                self.cached.append(x)
        return Draft(drafts, torch.stack(qs) if qs else None)

    def most_likely_after(self, token: int) -> int:
        """Feed one more (drafted) token and return the drafter's argmax after it."""
        logits = self.runner.score([token], last_only=True)[-1]
        self.cached.append(token)
        return int(logits.argmax())

    def release(self) -> None:
        self.runner.release()
        self.tokens, self.cached = [], []
