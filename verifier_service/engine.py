"""The draft -> verify -> accept loop, with continuous batching. Reads top to bottom:

    each round (`step`):
        admit at most one waiting request (prefill its target slot; the drafter prefills too)
        draft k tokens for every running sequence       (ONE batched proposer call)
        score k+1 positions of every running sequence   (ONE batched target pass)
        per sequence: accept, roll its target slot back to the accepted prefix, emit, stop
        (the drafter rolls itself back on its next call, from the tokens it is told were committed)

A target slot always holds every committed token but the last ("pending") one, so a round scores
[pending, d_1 .. d_k] and gets the k+1 distributions it needs. Sequences join and leave between
rounds; k = 0 (or no proposer) is plain decoding through the same loop, so baselines share it.
`generate` is one request through this loop; `submit` + a background `start()`ed loop serves many.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Callable

from specserve.core.proposer import Draft, ProposeItem, Proposer
from specserve.core.runner import ModelRunner
from specserve.core.sampling import SamplingParams, request_generator, warp
from specserve.verifier.acceptance import accept


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
    finish_reason: str  # "stop" (EOS or a stop token), "length", "cancelled" (or "error")
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


class Overloaded(RuntimeError):
    """The waiting queue is full: the request is refused (HTTP 503)."""


@dataclass(eq=False)
class Request:
    """One sequence's state in the loop."""

    id: str
    prompt_ids: list[int]
    max_new_tokens: int
    params: SamplingParams
    k: int
    stop_ids: set[int]
    on_tokens: Callable[[list[int]], bool] | None = None
    on_finish: Callable[["Request"], None] | None = None  # called once, from the loop, when done
    slot: int = -1
    pending: int = -1  # the last committed token, not yet in the target's cache
    unsent: list[int] = field(default_factory=list)  # committed tokens the drafter has not been told
    out: list[int] = field(default_factory=list)
    stats: SpecStats = field(default_factory=SpecStats)
    chunks: list[tuple[float, int]] = field(default_factory=list)  # (monotonic time, tokens) per round
    finish_reason: str | None = None
    error: BaseException | None = None
    cancelled: bool = False
    done: threading.Event = field(default_factory=threading.Event)

    def result(self) -> GenerationResult:
        if self.error is not None:
            raise self.error
        return GenerationResult(self.out, self.finish_reason, self.stats)


class SpeculativeEngine:
    """A target runner with `max_num_seqs` slots plus an optional proposer."""

    def __init__(self, target: ModelRunner, proposer: Proposer | None = None, eos_ids: set[int] | None = None,
                 max_num_seqs: int | None = None, max_model_len: int | None = None, max_waiting: int = 256):
        self.target = target
        self.proposer = proposer
        self.eos_ids = eos_token_ids(target.model) if eos_ids is None else set(eos_ids)
        self.max_num_seqs = min(max_num_seqs or target.slots, target.slots)
        self.max_length = min(target.max_length, proposer.max_length if proposer else 1 << 30,
                              max_model_len or 1 << 30)
        self.max_waiting = max_waiting
        self.free_slots = list(range(self.max_num_seqs - 1, -1, -1))
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.lock = threading.Lock()  # guards waiting, running's membership and cancel flags
        self.step_lock = threading.Lock()  # one thread runs rounds at a time
        self.work = threading.Condition(self.lock)
        self.loop: threading.Thread | None = None
        self.stopping = False

    # ---------------------------------------------------------------- requests
    def submit(self, prompt_ids: list[int], max_new_tokens: int, sampling: SamplingParams = SamplingParams(),
               k: int = 4, on_tokens: Callable[[list[int]], bool] | None = None,
               request_id: str | None = None, on_finish: Callable[[Request], None] | None = None,
               ignore_eos: bool = False) -> Request:
        """Queues a request (ValueError if it cannot run, Overloaded if the queue is full).
        ignore_eos: stop only at max_new_tokens or a stop token id (benchmarks, vLLM's extension)."""
        k = k if self.proposer is not None else 0
        check_request(prompt_ids, max_new_tokens, k, self.max_length, self.target.vocab_size)
        params = sampling.with_seed()
        req = Request(request_id or uuid.uuid4().hex, list(prompt_ids), max_new_tokens, params, k,
                      (set() if ignore_eos else self.eos_ids) | set(params.stop_token_ids), on_tokens, on_finish)
        with self.lock:
            if len(self.waiting) >= self.max_waiting + len(self.free_slots):  # free slots take waiters first
                raise Overloaded(f"overloaded: {len(self.running)} running and {len(self.waiting)} waiting "
                                 f"requests (queue bound {self.max_waiting}); retry later")
            self.waiting.append(req)
            self.work.notify()
        return req

    def generate(self, prompt_ids: list[int], max_new_tokens: int, sampling: SamplingParams = SamplingParams(),
                 k: int = 4, on_tokens: Callable[[list[int]], bool] | None = None) -> GenerationResult:
        """One request, start to end. on_tokens, if given, receives each round's written tokens;
        returning False cancels the request (finish_reason "cancelled")."""
        req = self.submit(prompt_ids, max_new_tokens, sampling, k, on_tokens)
        if self.loop is None:
            with self.step_lock:
                while not req.done.is_set():
                    self.step()
        req.done.wait()
        return req.result()

    def cancel(self, request_id: str) -> bool:
        """Ends a waiting or running request before the next round; its slots are freed."""
        with self.lock:
            for req in list(self.waiting) + self.running:
                if req.id == request_id:
                    req.cancelled = True
                    self.work.notify()
                    return True
        return False

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # ---------------------------------------------------------------- the loop
    def start(self) -> None:
        """Runs rounds on a background thread whenever there is work."""
        if self.loop is None:
            self.loop = threading.Thread(target=self._run, name="engine-loop", daemon=True)
            self.loop.start()

    def stop(self) -> None:
        with self.lock:
            self.stopping = True
            self.work.notify()

    def _run(self) -> None:
        while True:
            with self.lock:
                while not self.stopping and not self.waiting and not self.running:
                    self.work.wait()
                if self.stopping:
                    return
            with self.step_lock:
                self.step()

    def step(self) -> None:
        """One round for every running sequence."""
        with self.lock:
            for req in [r for r in self.waiting if r.cancelled]:
                self.waiting.remove(req)
                self._finish(req, "cancelled")
            for req in [r for r in self.running if r.cancelled]:
                self._finish(req, "cancelled")
            # one prefill per round, so a joining sequence stalls the running ones for at most one
            # prefill; with nothing running there is nobody to stall, and every free slot fills
            n = len(self.free_slots) if not self.running else 1
            admit = [self.waiting.popleft() for _ in range(min(n, len(self.waiting), len(self.free_slots)))]
        for req in admit:
            self._admit(req)
        running = list(self.running)
        if not running:
            return
        try:
            self._round(running)
        except Exception as e:  # a failed round fails its requests, never the loop
            for req in running:
                if not req.done.is_set():
                    req.error = e
                    self._finish(req, "error")

    def _admit(self, req: Request) -> None:
        req.slot = self.free_slots.pop()
        self.running.append(req)
        try:
            self.target.prefill(req.prompt_ids[:-1], slot=req.slot)
            if req.k:
                self.proposer.start(req.id, req.prompt_ids, req.params)
            req.pending = req.prompt_ids[-1]
        except Exception as e:
            req.error = e
            self._finish(req, "error")

    def _round(self, running: list[Request]) -> None:
        ks = [min(r.k, r.max_new_tokens - len(r.out) - 1) for r in running]  # never overshoot
        drafts = [Draft([], None)] * len(running)
        drafting = [i for i, k in enumerate(ks) if k > 0]
        if drafting:
            proposed = self.proposer.propose([ProposeItem(running[i].id, running[i].unsent, ks[i]) for i in drafting])
            for i, draft in zip(drafting, proposed):
                drafts[i] = draft
                running[i].unsent = []
        logits = self.target.score_batch([(r.slot, [r.pending] + d.tokens) for r, d in zip(running, drafts)])
        for req, draft, lg, k in zip(running, drafts, logits, ks):
            position = len(req.prompt_ids) + len(req.out)
            num_accepted, next_token = accept(draft.tokens, draft.probs, warp(lg, req.params),
                                              request_generator(req.params.seed, "verify", position))
            self.target.rollback(k - num_accepted, slot=req.slot)
            req.stats.record(k, num_accepted)
            req.stats.num_pipeline_hits += draft.pipeline_hit
            emitted, stopped = truncate_at_stop(draft.tokens[:num_accepted] + [next_token], req.stop_ids)
            req.out += emitted
            req.unsent += emitted
            req.pending = next_token
            req.chunks.append((time.monotonic(), len(emitted)))
            wanted = req.on_tokens is None or req.on_tokens(emitted) is not False
            if stopped or len(req.out) >= req.max_new_tokens:
                self._finish(req, "stop" if stopped else "length")
            elif not wanted:
                self._finish(req, "cancelled")

    def _finish(self, req: Request, reason: str) -> None:
        """Frees the request's slots on both sides and wakes its waiter."""
        if req in self.running:
            self.running.remove(req)
            self.target.release(req.slot)
            self.free_slots.append(req.slot)
            if req.k:
                try:
                    self.proposer.release(req.id)
                except Exception as e:  # the drafter is gone; its state went with it
                    req.error = req.error or e
        req.finish_reason = reason
        req.done.set()
        if req.on_finish is not None:
            req.on_finish(req)
