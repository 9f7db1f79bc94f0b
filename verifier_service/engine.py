"""The draft -> verify -> accept loop, with continuous batching. Reads top to bottom:

    each round (`step`):
        admit waiting requests, up to PREFILL_BUDGET prompt tokens (ONE batched prefill on each side)
        choose k for every running sequence             (`policy.SpeculationPolicy`)
        draft up to k tokens for each                   (ONE batched call per proposer in use)
        score k+1 positions of every running sequence   (ONE batched target pass)
        accept for every sequence at once (`_accept`: greedy rows from the argmax, sampled rows by
            the full rule; one device -> host transfer each)
        a remote drafter is sent the outcome now, asking for the next round's drafts (`_send_early`)
        per sequence: roll its target slot back to the accepted prefix, emit, stop
        (the drafter rolls itself back on its next call, from the tokens it is told were committed)
        release finished sequences (one batched call per proposer; it waits for nothing)
        keep the running sequences in target slots 0..b-1 (`_compact`: attention reads a view)

`RoundTimes` (`engine.times`) sums where the loop's time goes by phase; `bench batching` reports it.

A target slot always holds every committed token but the last ("pending") one, so a round scores
[pending, d_1 .. d_k] and gets the k+1 distributions it needs. Sequences join and leave between
rounds; k = 0 (or no proposer) is plain decoding through the same loop, so baselines share it.
`generate` is one request through this loop; `submit` + a background `start()`ed loop serves many.

Proposers, chosen per request (`method`): "draft_model" (the drafter: in process or remote),
"ngram" (prompt lookup, no model: `ngram.NgramProposer`, when the engine is built with
ngram=True) and "none". The default is the drafter when there is one, else the n-gram proposer.

Failures stay where they belong:
- the drafter fails (an RPC error, a missed deadline): every affected sequence continues on the
  n-gram proposer (or target-only without one; greedy output is unchanged either way),
  `health()` says "degraded", and once the drafter has recovered (a remote drafter restarted or
  recreated, found again) running and new sequences are started on it afresh;
- one request fails (non-finite numbers, its own callback, its timeout): it alone ends with an
  error, the rest of its round continues;
- no lock is held across a call to the proposer (a network call for a remote drafter): releases
  of finished sequences are batched and sent after each round.
"""

from __future__ import annotations

import logging
import operator
import threading
import time
import uuid
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Callable

from specserve.core.proposer import MAX_K, CapacityError, Draft, ProposeItem, Proposer
from specserve.core.runner import ModelRunner
from specserve.core.sampling import SamplingParams, is_int_like, request_generator, warp
from specserve.verifier.acceptance import accept_batch, accept_greedy
from specserve.verifier.ngram import NgramProposer
from specserve.verifier.policy import (CATCH_UP_TOKENS, PROFILE_SETTLE, Acceptance, PassCosts, SpeculationPolicy,
                                       profile_drafter, profile_target)

METHODS = ("draft_model", "ngram", "none")


log = logging.getLogger("specserve.engine")


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
    rounds_by_k: list[int] = field(default_factory=list)  # rounds by the k the policy chose
    # draft-model rounds right after a draft-model round whose call asked the drafter to prepare the
    # next (see policy.PREPARE_MIN_READY), and pipeline hits among them, by the outcome of the round
    # before: index a = drafts accepted then (the drafter prepares for "all accepted")
    outcome_rounds: list[int] = field(default_factory=list)
    outcome_hits: list[int] = field(default_factory=list)
    drafts_by_method: dict[str, int] = field(default_factory=dict)  # drafted rounds by proposer
    num_prepared_rounds: int = 0  # drafted rounds for which the drafter had prepared outcomes
    num_prepared_outcomes: int = 0  # outcomes prepared for them (the speculation cache's fan-out used)

    def record_outcome(self, previous_accepted: int, hit: bool) -> None:
        while len(self.outcome_rounds) <= previous_accepted:
            self.outcome_rounds.append(0)
            self.outcome_hits.append(0)
        self.outcome_rounds[previous_accepted] += 1
        self.outcome_hits[previous_accepted] += hit

    def record(self, k: int, num_accepted: int, chosen_k: int = 0, method: str | None = None) -> None:
        self.num_rounds += 1
        self.num_target_passes += 1
        if len(self.rounds_by_k) <= chosen_k:
            self.rounds_by_k += [0] * (chosen_k + 1 - len(self.rounds_by_k))
        self.rounds_by_k[chosen_k] += 1
        if k and method:
            self.drafts_by_method[method] = self.drafts_by_method.get(method, 0) + 1
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


PHASES = ("admit", "start", "policy", "draft", "catch_up", "early_wait", "pass", "rest", "release")


@dataclass
class RoundTimes:
    """Where the loop's time goes, summed over rounds (seconds): the target's prefill of joining
    requests ("admit"), their proposers' start calls ("start"), choosing k ("policy"), proposer
    calls that drafted
    ("draft"), calls that only caught a drafter up ("catch_up"), waiting for drafts asked for
    early ("early_wait"), the target pass with the acceptance rule ("pass"), the rest of the
    round (bookkeeping, callbacks, the early send: "rest") and batched releases ("release").
    pass_cpu: the loop thread's CPU seconds in the passes (against "pass", the wall seconds: a
    pass that waited for the CPU or the GIL shows a gap; one that ran slower, none)."""

    rounds: int = 0
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    pass_cpu: float = 0.0

    def add(self, phase: str, seconds: float) -> None:
        self.seconds[phase] += seconds

    def to_dict(self) -> dict:
        return {"rounds": self.rounds, "seconds": dict(self.seconds), "pass_cpu": self.pass_cpu}


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


class InvalidRequest(ValueError):
    """A request that cannot run, with the request field at fault (an API's `param`) and a code."""

    def __init__(self, message: str, param: str, code: str = "invalid_value"):
        super().__init__(message)
        self.param, self.code = param, code

    def __reduce__(self):  # (pickled whole: a Ray actor raises it to its caller)
        return type(self), (str(self), self.param, self.code)


def check_call(sampling, request_id) -> None:
    """InvalidRequest for a Python caller's sampling that is no SamplingParams (an AttributeError
    until stop 65) or a request id that is no non-empty string (taken)."""
    if not isinstance(sampling, SamplingParams):
        raise InvalidRequest(f"sampling must be a SamplingParams, got {type(sampling).__name__}", "sampling")
    if request_id is not None and (not isinstance(request_id, str) or not request_id):
        raise InvalidRequest(f"a request id must be a non-empty string, got {request_id!r}", "id")


def check_request(prompt_ids: list[int], max_new_tokens: int, k: int, max_length: int, vocab_size: int) -> None:
    """Raises InvalidRequest with a user-facing message for a request that cannot run."""
    if not isinstance(prompt_ids, (list, tuple)) or not all(is_int_like(t) for t in prompt_ids):  # (the range apart)
        # (a string, a tensor or floats: a TypeError or "truth value ... ambiguous" until stop 61)
        raise InvalidRequest(f"the prompt must be a list of token ids (ints), got {type(prompt_ids).__name__}"
                             + (" holding other things" if isinstance(prompt_ids, (list, tuple)) else ""), "prompt")
    if not prompt_ids:
        raise InvalidRequest("the prompt is empty", "prompt")
    if any(not (0 <= operator.index(t) < vocab_size) for t in prompt_ids):  # (-1 was "other things" until stop 65)
        raise InvalidRequest(f"prompt token ids must be in [0, {vocab_size})", "prompt")
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
        raise InvalidRequest(f"max_tokens must be an integer >= 1, got {max_new_tokens!r}", "max_tokens")
    if not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= MAX_K:
        raise InvalidRequest(f"k must be an integer in [0, {MAX_K}], got {k!r}", "speculative.k")
    if len(prompt_ids) + max_new_tokens > max_length:
        raise InvalidRequest(f"prompt ({len(prompt_ids)} tokens) + max_tokens ({max_new_tokens}) exceeds the "
                             f"context of {max_length} tokens", "prompt", "context_length_exceeded")


def truncate_at_stop(tokens: list[int], stop_ids: set[int]) -> tuple[list[int], bool]:
    for i, t in enumerate(tokens):
        if t in stop_ids:
            return tokens[: i + 1], True
    return tokens, False


class Overloaded(RuntimeError):
    """The waiting queue is full: the request is refused (HTTP 503)."""


class RequestFailed(RuntimeError):
    """This request failed on its own (its numbers, its callback); others in its round go on."""


class RequestTimeout(RequestFailed):
    """The request ran past its timeout (HTTP 504)."""


@dataclass(eq=False)
class Request:
    """One sequence's state in the loop."""

    id: str
    prompt_ids: list[int]
    max_new_tokens: int
    params: SamplingParams
    k: int  # the most drafts per round (the policy chooses each round's, up to this)
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
    deadline: float | None = None  # time.monotonic() past which the request fails with RequestTimeout
    method: str = "none"  # the proposer asked for: see METHODS
    via: str | None = None  # the proposer this sequence is started on now (its current incarnation)
    acceptance: Acceptance = field(default_factory=Acceptance)  # for the policy
    previous_accepted: int | None = None  # drafts accepted in its last drafted round
    previous_k: int = 0  # drafts in its last drafted round
    previous_drafted: bool = False  # whether its last round was drafted by the draft model
    asked_prepare: bool = True  # whether the call that gave its current draft asked the drafter to prepare the next
    previous_prepared: bool = True  # asked_prepare of its last drafted round
    fixed_k: bool = False  # always drafts k: a sampled request with its own seed (reproducible text)
    resting: bool = False  # joined while the drafter rests (`SpeculativeEngine._resting`): not started on it yet
    done: threading.Event = field(default_factory=threading.Event)

    @property
    def drafting(self) -> bool:
        return self.via is not None

    def result(self) -> GenerationResult:
        """The request's result once `done` is set (its error, raised, if it failed). Until stop 61 an
        unfinished request gave an empty result, silently: an engine whose loop nobody runs (neither
        `start()` nor `step()` calls) never finishes one."""
        if self.error is not None:
            raise self.error
        if not self.done.is_set():
            raise RuntimeError(f"request {self.id!r} is not finished: wait on its `done` event, with the engine's "
                               "loop running (engine.start(), or engine.step() calls; engine.generate does both)")
        return GenerationResult(self.out, self.finish_reason, self.stats)


class SpeculativeEngine:
    """A target runner with `max_num_seqs` slots plus an optional proposer."""

    def __init__(self, target: ModelRunner, proposer: Proposer | None = None, eos_ids: set[int] | None = None,
                 max_num_seqs: int | None = None, max_model_len: int | None = None, max_waiting: int = 64,
                 request_timeout_s: float | None = None, ngram: bool = False, speculation: str = "fixed",
                 max_k: int = MAX_K, hang_s: float | None = None, k_limit: int | None = None):
        """proposer: the drafter (in process or remote), or None; ngram: whether the n-gram
        proposer is available (the default without a drafter, the fallback while it is down);
        speculation: "fixed" or "adaptive" (see `policy`; adaptive profiles the target's passes
        for up to max_k drafts, and the drafter's on-demand calls, now); hang_s: `health` says
        "dead" while the loop has been in one step this long (None: never); k_limit: the most drafts
        per round of any request, whatever its k (a config's `k`; 0: no speculation; None: no limit)."""
        if not 1 <= max_k <= MAX_K:
            raise ValueError(f"max_k must be in [1, {MAX_K}], got {max_k}")
        if proposer is not None and proposer.vocab_size not in (None, target.vocab_size):
            raise ValueError(f"the drafter's vocabulary ({proposer.vocab_size}) differs from the target's "
                             f"({target.vocab_size})")
        self.target = target
        self.proposer = proposer
        self.proposers: dict[str, Proposer] = {}
        if proposer is not None:
            self.proposers["draft_model"] = proposer
        if ngram:
            self.proposers["ngram"] = NgramProposer(target.vocab_size)
        self.default_method = next(iter(self.proposers), "none")
        if k_limit is not None and not (isinstance(k_limit, int) and 0 <= k_limit <= MAX_K):
            raise ValueError(f"k_limit must be None or in [0, {MAX_K}], got {k_limit!r}")
        self.k_limit = k_limit
        self.eos_ids = eos_token_ids(target.model) if eos_ids is None else set(eos_ids)
        self.max_num_seqs = min(max_num_seqs or target.slots, target.slots)
        self.max_length = min(target.max_length, proposer.max_length if proposer else 1 << 30,
                              max_model_len or 1 << 30)
        if max_model_len and max_model_len > self.max_length:  # (until stop 53 capped without a word)
            log.warning("max_model_len %d is more than the models' context: %d tokens it is", max_model_len,
                        self.max_length)
        self.max_waiting = max_waiting
        self.request_timeout_s = request_timeout_s
        self.hang_s = hang_s
        self._in_step_since: float | None = None  # monotonic time the loop's running step began (None: between steps)
        self.degraded: str | None = None  # why speculation is off (the proposer failed), or None
        self._moved: tuple[str, str] | None = None  # (a drafter address found stale from outside the loop, why)
        self.proposer_failures = 0
        self.degradations = 0  # times `degraded` was set, and cleared (`recoveries`): /metrics, through the
        self.recoveries = 0    # pair's load()
        self._to_release: list[tuple[str, str]] = []  # (proposer, sequence) to release after this round
        self._early: dict[str, int] | None = None  # sequences whose outcome went out early -> k asked
        self._early_got: dict[str, Draft] | None = None  # their drafts, once received
        self._early_prepare = True  # whether that call asked the drafter to prepare the round after
        self._early_waited = 0.0  # seconds waited for them so far (by whichever call needed them first)
        self._early_waited_before = 0.0  # the part of it waited before this round (a release, a start)
        self.early_drafts = 0  # drafts that were asked for at the end of the round before and served
        # remote drafter Starts of new sequences running on helper threads beside the target's
        # prefill (`_start_ahead`): (thread, requests,
        # tokens each had then, outcome, proposer failures then)
        self._starting: list[tuple[threading.Thread, list[Request], list[int], dict, int]] = []
        self.deferred_starts = 0  # sequences started that way
        self._compact_failed = False  # a slot move failed once: `_compact` is off
        self.times = RoundTimes()  # where the loop's time goes (benchmarks read it)
        self._step_started = time.perf_counter()  # when the running step began (the guard times rounds from it)
        self._prefill_seconds = 0.0  # the running step's target prefill of joining requests (the guard leaves it out)
        self.free_slots = list(range(self.max_num_seqs - 1, -1, -1))
        self.policy = SpeculationPolicy(speculation)
        if proposer is not None and proposer.prepares:
            self.policy.prepared.add("draft_model")
        if speculation == "adaptive" and self.proposers:
            self.policy.costs = PassCosts(profile_target(target, self.max_num_seqs, max_k + 1))
            if proposer is not None:  # the drafter's on-demand calls too: no batch size starts blind
                try:
                    for b, fit in profile_drafter(proposer, target.vocab_size, self.max_num_seqs, max_k,
                                                  settle=PROFILE_SETTLE if proposer.prepares else 0.0).items():
                        self.policy.draft_costs[("draft_model", b)] = fit
                except Exception as e:  # a drafter down now is noticed (and handled) on the first round
                    log.warning("could not profile the drafter: %s", e)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.lock = threading.Lock()  # guards waiting, running's membership and cancel flags
        self.step_lock = threading.Lock()  # one thread runs rounds at a time
        self.work = threading.Condition(self.lock)
        self.loop: threading.Thread | None = None
        self.stopping = False
        self.stopped_why = "the engine has stopped"  # what submits are told once it is stopping
        self._admitting: list[Request] = []  # taken off `waiting` by the round being set up

    # ---------------------------------------------------------------- requests
    def submit(self, prompt_ids: list[int], max_new_tokens: int, sampling: SamplingParams = SamplingParams(),
               k: int = 4, on_tokens: Callable[[list[int]], bool] | None = None,
               request_id: str | None = None, on_finish: Callable[[Request], None] | None = None,
               ignore_eos: bool = False, timeout_s: float | None = None, method: str | None = None) -> Request:
        """Queues a request (ValueError if it cannot run, Overloaded if the queue is full).
        k: the most drafts per round, at most `k_limit` (a config's k; 0: plain, whatever the
        method); method: its proposer (METHODS; default: the engine's).
        ignore_eos: stop only at max_new_tokens or a stop token id (benchmarks, vLLM's extension).
        timeout_s: fail the request (RequestTimeout) after this long (default: the engine's)."""
        check_call(sampling, request_id)
        seeded = not sampling.greedy and sampling.seed is not None
        method = self.default_method if method is None else method
        if method not in METHODS:
            raise InvalidRequest(f"speculative method must be one of {METHODS}, got {method!r}", "speculative.method")
        check_request(prompt_ids, max_new_tokens, k, self.max_length, self.target.vocab_size)
        if self.k_limit is not None:  # (a config's k limited HTTP requests only until stop 61: engine.generate,
            k = min(k, self.k_limit)  # the pair's too, drafted the k they were given, and a config's k of 0 n-grams)
        k = k if method != "none" else 0
        if method != "none" and k and method not in self.proposers:  # (k = 0: no proposer runs)
            raise InvalidRequest(f"speculative method {method!r} is not available here (available: "
                                 f"{sorted(self.proposers) + ['none']})", "speculative.method")
        params = sampling.with_seed()
        prompt_ids = [operator.index(t) for t in prompt_ids]  # (ints: a 0-d torch id hashes by identity, and the
        req = Request(request_id or uuid.uuid4().hex, prompt_ids, max_new_tokens, params, k,  # n-gram index missed)
                      (set() if ignore_eos else self.eos_ids) | set(params.stop_token_ids), on_tokens, on_finish,
                      method=method if k else "none", fixed_k=seeded)
        timeout_s = timeout_s if timeout_s is not None else self.request_timeout_s
        if timeout_s is not None:
            req.deadline = time.monotonic() + timeout_s
        with self.lock:
            if self.stopping:
                raise RequestFailed(self.stopped_why)
            starting = [r for start in list(self._starting) for r in start[1]]  # (its Start's answer names it)
            if any(r.id == req.id for r in list(self.waiting) + self._admitting + self.running + starting):
                raise InvalidRequest(f"request id {req.id!r} is in use by a running request", "id")
            if len(self.waiting) >= self.max_waiting + len(self.free_slots):  # free slots take waiters first
                free = f", and {len(self.free_slots)} free slots they are about to take" if self.free_slots else ""
                raise Overloaded(f"overloaded: {len(self.running)} running and {len(self.waiting)} waiting "
                                 f"requests (queue bound {self.max_waiting}{free}); retry later")
            self.waiting.append(req)
            self.work.notify()
        return req

    def generate(self, prompt_ids: list[int], max_new_tokens: int, sampling: SamplingParams = SamplingParams(),
                 k: int = 4, on_tokens: Callable[[list[int]], bool] | None = None,
                 method: str | None = None) -> GenerationResult:
        """One request, start to end. on_tokens, if given, receives each round's written tokens;
        returning False cancels the request (finish_reason "cancelled")."""
        req = self.submit(prompt_ids, max_new_tokens, sampling, k, on_tokens, method=method)
        if self.loop is None:
            with self.step_lock:
                while not req.done.is_set():
                    self.step()
        req.done.wait()
        return req.result()

    def cancel(self, request_id: str) -> bool:
        """Ends a waiting or running request before the next round; its slots are freed."""
        with self.lock:
            for req in list(self.waiting) + self._admitting + self.running:
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

    def health(self) -> dict:
        """{"status": "ok"}; "degraded" with the reason while speculation is off because the
        proposer failed; "dead" when the background loop has stopped, or has been in one step for
        `hang_s` (a device that hangs, a callback that never returns: until stop 52 the pair said
        "ok" while every request waited for ever), or once `stop` was called (it said "ok" until
        stop 65, though it refused every request)."""
        if self.stopping:
            return {"status": "dead", "reason": self.stopped_why}
        if self.loop is not None and not self.loop.is_alive():
            return {"status": "dead", "reason": "the engine loop has stopped"}
        since = self._in_step_since
        stuck = time.monotonic() - since if since is not None else 0.0
        if self.hang_s is not None and stuck > self.hang_s:
            return {"status": "dead", "reason": f"the engine loop has been in one step for {stuck:.0f} s "
                    f"(engine_hang_s {self.hang_s:g})"}
        if self.degraded is not None:
            return {"status": "degraded", "reason": self.degraded}
        return {"status": "ok"}

    def drafter_moved(self, address: str, why: str | None = None) -> None:
        """Word from outside the loop (the pair replica's health probe) that the drafter no longer
        serves at `address`: its actor restarted elsewhere, died, or does not answer (`why`). If
        the loop still drafts through that address, it takes this as a failed drafting call
        (n-gram fallback, reconnect in the background, a hung drafter restarted), so an idle pair
        reconnects now, not in its next request's rounds."""
        with self.lock:
            self._moved = (address, why or f"the drafter no longer serves at {address}")
            self.work.notify()

    def _take_moved(self, moved: tuple[str, str] | None) -> None:
        client = getattr(self.proposer, "client", None)
        if moved is not None and self.degraded is None and getattr(client, "address", None) == moved[0]:
            self._proposer_failed(ConnectionError(moved[1]))

    # ---------------------------------------------------------------- the loop
    def start(self) -> None:
        """Runs rounds on a background thread whenever there is work."""
        if self.loop is None:
            self.loop = threading.Thread(target=self._run, name="engine-loop", daemon=True)
            self.loop.start()

    def stop(self) -> None:
        """Stops the loop: the requests in flight fail (RequestFailed), and so do later submits
        (until stop 50 they waited for ever)."""
        with self.lock:
            self.stopping = True
            self.work.notify()

    def _run(self) -> None:
        try:
            while True:
                with self.lock:
                    if not self.stopping and not self.waiting and not self.running and self._moved is None:
                        # idle; while degraded, wake up now and then to pick up a recovered proposer
                        # (or a Start under way on its helper thread: handled once done, not at the next request)
                        self.work.wait(timeout=0.25 if self.degraded is not None or self._starting else None)
                    if self.stopping:
                        break
                with self.step_lock:
                    self._in_step_since = time.monotonic()
                    try:
                        self.step()
                    except Exception as e:  # outside a round's own handling: its requests fail, never the loop
                        log.exception("a step failed")
                        self._fail_in_flight(e)
                    finally:
                        self._in_step_since = None
        finally:  # stopped, or the loop died (a BaseException, as SystemExit from a caller's callback): every
            # request fails, none waits for ever, later submits included (until stop 51 a dead loop left them hanging)
            with self.step_lock:
                with self.lock:
                    if not self.stopping:
                        self.stopping, self.stopped_why = True, "the engine loop has stopped"
                    waiting, self.waiting = list(self.waiting), deque()
                error = RequestFailed(self.stopped_why)
                self._fail(waiting, error)
                self._fail_in_flight(error)

    def _fail_in_flight(self, error: Exception) -> None:
        """Fails the running and admitting requests (a step raised where nothing else caught it:
        until stop 48 the loop's thread died of it, and every request hung)."""
        with self.lock:
            reqs, self._admitting = self.running + self._admitting, []
        self._fail(reqs, error)

    def _fail(self, reqs: list[Request], error: Exception) -> None:
        for req in reqs:
            if not req.done.is_set():
                req.error = error
                self._finish(req, "error")

    def step(self) -> None:
        """One round for every running sequence."""
        self._step_started = time.perf_counter()
        self._prefill_seconds = 0.0
        now = time.monotonic()
        ended: list[Request] = []  # their on_finish runs after the lock (it may submit or cancel)
        with self.lock:
            moved, self._moved = self._moved, None
            for req in [r for r in self.waiting if r.cancelled or self._expired(r, now)]:
                self.waiting.remove(req)
                self._finish(req, "cancelled" if req.cancelled else "error", notify=False)
                ended.append(req)
            for req in [r for r in self.running if r.cancelled or self._expired(r, now)]:
                self._finish(req, "cancelled" if req.cancelled else "error", notify=False)
                ended.append(req)
            # joining sequences stall the running ones for one batched prefill of at most
            # PREFILL_BUDGET prompt tokens (at least one request); with nothing running there is
            # nobody to stall, and every free slot fills
            admit, tokens = [], 0
            while self.waiting and len(admit) < len(self.free_slots) and (
                    not admit or not self.running or tokens + len(self.waiting[0].prompt_ids) <= self.PREFILL_BUDGET):
                admit.append(self.waiting.popleft())
                tokens += len(admit[-1].prompt_ids)
            self._admitting = admit  # off the queue, not yet running: `cancel` finds them here
        for req in ended:
            self._notify(req)
        self._finish_starts(wait=False)
        self._release_finished()
        self._take_moved(moved)
        self._resume_if_recovered()
        if admit:
            self._admit(admit)
        with self.lock:
            self._admitting = []
        self._compact()
        running = list(self.running)
        if not running:
            self._release_finished()  # (a Start taken up for a request whose prefill failed: released now)
            return
        if not self._resting() and any(r.resting for r in running):
            self._wake([r for r in running if r.resting])
        try:
            self._round(running)
        except Exception as e:  # a failed batch (the target's pass) fails its requests, never the loop
            log.exception("round failed")
            self._fail(running, e)
        self._compact()  # (before the next round's admission takes the lowest free slots)
        self._release_finished()

    @staticmethod
    def _expired(req: Request, now: float) -> bool:
        if req.deadline is None or now < req.deadline:
            return False
        req.error = RequestTimeout(f"the request ran past its timeout ({len(req.out)} tokens written)")
        return True

    # ---------------------------------------------------------------- the proposers, and their failures
    def _start_drafting(self, req: Request) -> None:
        self._start_drafting_many([req])

    def _start_drafting_many(self, reqs: list[Request]) -> None:
        """Registers sequences (all their committed tokens) with their proposers, one call per
        proposer: the one each asked for, or the n-gram proposer while the drafter is down."""
        groups: dict[str, list[Request]] = {}
        for req in reqs:
            name = "ngram" if req.method == "draft_model" and self.degraded is not None else req.method
            if name in self.proposers:
                groups.setdefault(name, []).append(req)
        for name, group in groups.items():
            try:
                self.proposers[name].start_many([(r.id, r.prompt_ids + r.out, r.params) for r in group])
            except (CapacityError, ValueError) as e:  # some cannot be drafted for: they run target-only
                if len(group) > 1:
                    for req in group:
                        self._start_drafting(req)
                else:
                    log.warning("request %s runs without speculation: %s", group[0].id, e)
                continue
            except Exception as e:
                self._proposer_failed(e)
                if name == "draft_model":
                    self._start_drafting_many(group)  # on the fallback, now that the engine is degraded
                continue
            for req in group:
                req.unsent = []
                req.via = name

    def _stop_drafting(self, req: Request) -> None:
        if req.via == "ngram":  # local: released now, so a start on it again (a drafter that fails
            self.proposers["ngram"].release(req.id)  # again in this step) finds it gone
        elif req.via is not None:  # released after the round, outside the locks (a network call)
            self._to_release.append((req.via, req.id))
        req.via = None

    def _proposer_failed(self, error: Exception) -> None:
        """Every drafter sequence continues on the n-gram proposer (or target-only) until the
        drafter has recovered."""
        self.proposer_failures += 1
        self.degradations += self.degraded is None
        fallback = "the n-gram proposer" if "ngram" in self.proposers else "target-only"
        self.degraded = f"the drafter is unavailable ({type(error).__name__}: {str(error)[:200]}); serving with {fallback}"
        log.warning("%s", self.degraded)
        self._to_release = [(p, s) for p, s in self._to_release if p != "draft_model"]  # gone, or reclaimed after its TTL
        self._early = self._early_got = None
        self._early_waited = 0.0
        self.proposer.mark_failed(error)
        for req in self.running:
            if req.via == "draft_model":
                req.via = None
                self._start_drafting(req)

    def _resume_if_recovered(self) -> None:
        if self.degraded is None:
            return
        self._finish_starts(wait=False)  # (the Starts done: to the fallback now)
        if not self.proposer.recoverable():  # (until stop 50 every round of a degraded engine waited here for a
            return                           # Start under way on the drafter that failed: up to its deadline)
        self._finish_starts()  # (a Start still under way belongs to the connection before: done before it goes)
        if not self.proposer.recovered():
            return
        log.warning("the drafter is back: speculation resumes")
        self.degraded = None
        self.recoveries += 1
        self._early = self._early_got = None
        for req in self.running:
            if req.method == "draft_model" and req.via != "draft_model" and not req.resting:
                self._stop_drafting(req)
                self._start_drafting(req)

    def _release_finished(self) -> None:
        """One batched release of finished sequences per proposer, outside every lock."""
        todo, self._to_release = self._to_release, []
        t0 = time.perf_counter()
        for name in {p for p, _ in todo}:
            ids = [s for p, s in todo if p == name]
            try:
                self.proposers[name].release_many(ids)
            except Exception as e:  # their state is reclaimed on the drafter after its TTL
                log.warning("release of %d sequences failed: %s", len(ids), e)
        if todo:
            self.times.add("release", time.perf_counter() - t0)

    PREFILL_BUDGET = 1024  # prompt tokens admitted per round while others run

    def _admit(self, reqs: list[Request]) -> None:
        """One batched target prefill for all; then each proposer starts its new sequences in one
        call. A remote drafter's Start is sent before the prefill, from a helper thread, so that
        the drafter's prefill of the prompts runs beside the target's (`_start_ahead`)."""
        for req in reqs:
            req.slot = min(self.free_slots)  # the lowest: a batch of slots 0..b-1 reads the KV cache as a view
            self.free_slots.remove(req.slot)
            self.running.append(req)
        # (not a seeded sampled request: it drafts from its first round on, so its text never depends on timings)
        if self._resting():  # the drafter rests: these start on it when it drafts again (`_wake`)
            for r in reqs:
                r.resting = bool(r.k and r.method == "draft_model" and not r.fixed_k)
        ahead = self._start_ahead(reqs)
        t0 = time.perf_counter()
        try:
            self.target.prefill_batch([(req.slot, req.prompt_ids[:-1]) for req in reqs])
        except Exception:  # find the request(s) at fault: one by one
            for req in reqs:
                try:
                    self.target.prefill(req.prompt_ids[:-1], slot=req.slot)
                except Exception as e:
                    req.error = e
                    self._finish(req, "error")
        reqs = [r for r in reqs if not r.done.is_set()]
        for req in reqs:
            req.pending = req.prompt_ids[-1]
        self._prefill_seconds += time.perf_counter() - t0
        self.times.add("admit", time.perf_counter() - t0)
        self._start([r for r in reqs if not r.resting and r not in ahead])
        if ahead:
            self._await_early()  # (drafting time: they reached the drafter's model lock before the Start, as a rule)
            self._finish_starts(wait=self.degraded is None)  # these draft from their first round

    def _start_ahead(self, reqs: list[Request]) -> list[Request]:
        """Sends the Start of joining sequences (not those resting) to a remote drafter from a
        helper thread before the target's prefill (`_start_later`), and returns them. The
        drafter's prefill of their prompts then runs beside the target's, on its own device,
        instead of after it; `_admit` waits for it after the prefill, so they draft from their
        first round. Until stop 54 the Start was sent after the prefill and waited for, on the
        loop's thread: 4-6% of each round at 4-32 sequences in the batching bench's sequential
        row, 7-32% in the pipelined one, its drafter busy preparing
        (docs/benchmarks/batching_6070687_b.md, the "start" column). (Until stop 67 a remote
        drafter was also started on sequences joining while speculation was off, their Start not
        waited for; now they rest: `_resting`.)"""
        proposer = self.proposers.get("draft_model")
        if proposer is None or not proposer.answers_later or self.degraded is not None:
            return []
        ahead = [r for r in reqs if r.k and r.method == "draft_model" and not r.resting]
        if ahead:
            self._start_later(ahead)
        return ahead

    def _start(self, reqs: list[Request]) -> None:
        """Starts these sequences on their proposers, in one call per proposer."""
        if any(r.k for r in reqs):
            self._await_early()  # (a start would wait for them anyway: counted as drafting, not as the start)
        t1 = time.perf_counter()
        self._start_drafting_many([r for r in reqs if r.k])
        self.times.add("start", time.perf_counter() - t1)

    def _resting(self) -> bool:
        """The drafter rests whenever the adaptive policy has speculation off, veto or not: new
        sequences are not started on it and running ones are not caught up, so nothing of the
        drafter's runs beside (a remote drafter) or between (one in the loop's own process) the
        plain passes. A sequence the policy then drafts for is brought up to date in that round
        before it drafts (`_bring_up_to_date`): `_wake` starts the sequences that joined meanwhile
        with everything committed, and the committed tokens that piled up go in with the next call
        (through one call of their own on an in-process drafter). Feeding it later is no more work
        than feeding it now (each token once, batched), and none for a sequence that finishes
        meanwhile; acceptance does not suffer, since the drafter has every committed token before it
        drafts.

        Why: a drafter in the loop's process did its starts and catch-ups on the loop's thread
        (joining requests' starts cost the colocated row 0.4-2.4 ms a round at 4-32 sequences,
        batching_d1ccf24.md), and the guard counted them against its plain rounds. A remote one,
        fed while speculation was off until stop 67 (its Starts on a helper thread, its catch-up
        calls not waited for), ran them beside the target's passes on a machine that shares its
        caches: in a scratch A/B of stop 67 (docs/benchmarks/README.md, "Stop 67") an adaptive
        pair held off ran 0.83-0.99x a plain pair at 4-32 sequences with its drafter fed, 0.94-1.05x
        with it resting (rest / fed 1.06-1.14x), and batching_5b364a4's adaptive pair, drafting
        in 2.4% of its sequence-rounds at 16, took 13.6 ms a pass there against the plain pair's
        10.7, its drafter using 3.5 ms of CPU a round."""
        if self.policy.mode != "adaptive" or "draft_model" not in self.proposers or self.degraded is not None:
            return False
        return self.policy.guard.vetoed(len(self.running), self.policy.rounds) or not self.policy.on

    def _bring_up_to_date(self, running: list[Request], chosen: list[int]) -> bool:
        """Before the drafter drafts for sequences it rested for: those that joined meanwhile
        start on it (`_wake`, timed as "start"), and the committed tokens that piled up meanwhile
        go in through one call of their own (timed as "catch_up"; charged to the drafting call, the
        backlog made on-demand drafting look dearer, the policy's M(k), after every rest): on an
        in-process drafter once more than one round's tokens are unsent, on a remote one once more
        than CATCH_UP_TOKENS are (below that they ride in the drafting call, saving a round trip),
        the drafts asked for early received first, and nothing prepared after it. Both are outside
        the round, as a start at admission is: the guard counts them, the round's model not. True
        if anything ran."""
        woken = [r for r, k in zip(running, chosen) if k and r.resting]
        if woken:
            self._wake(woken)
        proposer = self.proposers.get("draft_model")
        if proposer is None:
            return bool(woken)
        most = CATCH_UP_TOKENS if proposer.answers_later else None
        behind = [r for r, k in zip(running, chosen)
                  if k and r.via == "draft_model" and len(r.unsent) > (most or r.k + 1)]
        if not behind:
            return bool(woken)
        if proposer.answers_later:
            self._await_early()  # (the client drops drafts asked for early when it reads the next answer)
            if self.degraded is not None:
                return True
        t0 = time.perf_counter()
        try:
            proposer.propose([ProposeItem(r.id, r.unsent, 0, prepare=False) for r in behind])
        except Exception as e:
            self._proposer_failed(e)
            return True
        for r in behind:
            r.unsent = []
        self.times.add("catch_up", time.perf_counter() - t0)
        return True

    def _wake(self, reqs: list[Request]) -> None:
        for r in reqs:
            r.resting = False
        self._start(reqs)

    def _start_later(self, reqs: list[Request]) -> None:
        items = [(r.id, r.prompt_ids + r.out, r.params) for r in reqs]
        outcome: dict = {}

        def start() -> None:
            try:
                self.proposers["draft_model"].start_many(items)
            except Exception as e:  # handled by `_finish_starts`, on the loop's thread
                outcome["error"] = e

        thread = threading.Thread(target=start, name="drafter-start", daemon=True)
        thread.start()
        self._starting.append((thread, reqs, [len(r.out) for r in reqs], outcome, self.proposer_failures))

    def _finish_starts(self, wait: bool = True) -> None:
        """Handles a Start sent by `_start_later` once it is done, as a Start before the round
        would be: the sequences draft from their next round on (told the tokens committed since
        the Start, if any), or run without the drafter (refused, or the drafter failed meanwhile: the
        fallback takes them). wait=False (after a round's pass, and before a round) leaves one
        still under way for later: its sequences decode plainly meanwhile, as they would anyway
        with speculation off, instead of the loop waiting for the drafter's prefill."""
        for start in list(self._starting):  # (each stays listed until handled: `submit` reads the ids)
            if wait or not start[0].is_alive():
                self._finish_start(*start)
                with self.lock:
                    self._starting.remove(start)

    def _finish_start(self, thread: threading.Thread, reqs: list[Request], sent: list[int], outcome: dict,
                      failures: int) -> None:
        t0 = time.perf_counter()
        thread.join()
        self.times.add("start", time.perf_counter() - t0)  # only the part not hidden by the rounds
        error = outcome.get("error")
        live = [r for r in reqs if r in self.running]
        if failures != self.proposer_failures:  # the drafter failed meanwhile: the fallback takes them
            if error is None:  # (started on the connection given up: released when the drafter is back)
                self.proposers["draft_model"].abandon([r.id for r in reqs])
            self._start_drafting_many(live)
            return
        if error is None:
            self.deferred_starts += len(reqs)
            for req, n in zip(reqs, sent):
                if req in live:
                    req.unsent, req.via = req.out[n:], "draft_model"
                else:  # finished meanwhile: the drafter started it all the same
                    self._to_release.append(("draft_model", req.id))
            return
        if not isinstance(error, (CapacityError, ValueError)):
            self._proposer_failed(error)  # (these then start on the fallback below)
        self._start_drafting_many(live)  # one by one where refused: those run without the drafter

    def _compact(self) -> None:
        """Keeps the b running sequences in target slots 0..b-1: a sequence above a hole (left by
        one that finished) moves into it, its K/V copied once. Attention then reads the cache as
        a view; with holes, every pass gathered every row's K/V (+14% to +37% per pass at 4 to 32
        sequences on the demo target: benchmarks/diagnostics/slot_gather.py)."""
        b = len(self.running)
        holes = sorted(s for s in self.free_slots if s < b)
        if not holes or self._compact_failed:
            return
        movers = sorted((r for r in self.running if r.slot >= b), key=lambda r: r.slot)
        for hole, req in zip(holes, movers):
            try:
                self.target.move(req.slot, hole)
            except Exception:  # an optimisation only: never the loop's end (the slot stays as it was)
                log.exception("moving a sequence between slots failed: batches read their slots gathered from now on")
                self._compact_failed = True
                return
            self.free_slots.remove(hole)
            self.free_slots.append(req.slot)
            req.slot = hole

    def _round(self, running: list[Request]) -> None:
        # k = 0 for sequences not drafted for (plain decoding)
        t_choose = time.perf_counter()
        # (a resting sequence counts as the drafter's: the policy may choose to draft for it)
        limits = [self._draft_room(r) if r.drafting or r.resting else 0 for r in running]
        chosen = self.policy.choose(limits, [r.acceptance for r in running],
                                    ["draft_model" if r.resting else r.via for r in running],
                                    [r.fixed_k for r in running])
        t_round = time.perf_counter()
        self.times.add("policy", t_round - t_choose)
        if self._bring_up_to_date(running, chosen):
            t_round = time.perf_counter()
        drafts, t_draft = self._propose(running, chosen)
        t_propose = time.perf_counter() - t_round
        ks = [len(d.tokens) for d in drafts]
        written = 0
        t0, c0 = time.perf_counter(), time.thread_time()
        logits = self.target.score_batch([(r.slot, [r.pending] + d.tokens) for r, d in zip(running, drafts)])
        # the acceptance rule for the whole round, on the target's device: one transfer back
        outcomes = self._accept(running, drafts, logits)
        t_pass = time.perf_counter() - t0
        self.times.pass_cpu += time.thread_time() - c0
        committed = [None if o is None else truncate_at_stop((d.tokens[:o[0]] + [o[1]])[:r.max_new_tokens - len(r.out)],
                                                             r.stop_ids)  # (a seeded row may go past its budget)
                     for r, d, o in zip(running, drafts, outcomes)]
        vias = [req.via for req in running]  # who drafted this round (a failed Start or early send moves a request on)
        t_join = time.perf_counter()
        self._finish_starts(wait=False)  # (before this round's tokens are counted as not sent to the drafter)
        t_join = time.perf_counter() - t_join  # ("start", not the round's "rest")
        early = self._send_early(running, committed, chosen)  # the drafter drafts during the bookkeeping
        self.policy.observe_pass(len(running), max(ks) + 1, t_pass)
        for req, draft, outcome, k, c, done, via in zip(running, drafts, outcomes, ks, chosen, committed, vias):
            if outcome is None:  # non-finite numbers: this request fails, the round goes on
                req.error = RequestFailed("the model produced non-finite logits")
                self._finish(req, "error")
                continue
            num_accepted, next_token = outcome
            self.target.rollback(k - num_accepted, slot=req.slot)
            # the stats count drafts within the budget: a seeded row drafts past it (`_draft_room`), its
            # last round then writing as many tokens as the budget left; one with none within, none drafted
            counted = max(min(k, req.max_new_tokens - len(req.out) - 1), 0)
            req.stats.record(counted, min(num_accepted, counted), c, via)
            self.policy.observe_acceptance(req.acceptance, k, num_accepted, via)
            req.stats.num_pipeline_hits += bool(counted and draft.pipeline_hit)  # (a prepared draft may be cut to nothing)
            if counted and draft.prepared:
                req.stats.num_prepared_rounds += 1
                req.stats.num_prepared_outcomes += draft.prepared
            drafted = bool(counted) and via == "draft_model"
            if counted and req.previous_accepted is not None and req.previous_prepared:
                # hits by the outcome of the round before, in the stats: draft-model rounds right after a
                # draft-model round that asked for a preparation (after a plain or an n-gram round, or
                # one that asked for none, nothing was prepared to be ready)
                if drafted and req.previous_drafted:
                    req.stats.record_outcome(req.previous_accepted, draft.pipeline_hit)
                    # the policy's hit rate h learns from the same rounds: it stands for what pipelining
                    # gives a stretch of drafting rounds. After a plain round nothing prepared can match,
                    # and counting those misses made drafting look dearer the less the policy drafted.
                    # Stop 49 made this change (378de13) and cfcea7c undid it, its effect on the policy's
                    # choices not measured; stop 66 made it again for what h means, still not measured
                    # apart (docs/benchmarks/README.md, "Stop 66")
                    if req.previous_accepted == req.previous_k:  # the outcome pipelining prepares for
                        self.policy.observe_ready(via, draft.pipeline_hit)
            if k:
                req.previous_accepted, req.previous_k, req.previous_prepared = num_accepted, k, req.asked_prepare
            req.previous_drafted = drafted
            emitted, stopped = done
            req.out += emitted
            written += len(emitted)
            req.unsent = [] if req.id in early else req.unsent + emitted  # (early: already sent)
            req.pending = next_token
            req.chunks.append((time.monotonic(), len(emitted)))
            try:
                wanted = req.on_tokens is None or req.on_tokens(emitted) is not False
            except Exception:  # the consumer is gone
                wanted = False
            if stopped or len(req.out) >= req.max_new_tokens:
                self._finish(req, "stop" if stopped else "length")
            elif not wanted:
                self._finish(req, "cancelled")
        # waiting for this round's drafts before it began (a start of new sequences needed them first)
        # is drafting time of this round too
        before, self._early_waited_before = self._early_waited_before, 0.0
        if not max(chosen):  # drafts asked for by the round before and not used: a sunk cost, not
            t_draft -= before  # this round's (k = 0 must not look dearer for it)
            before = 0.0
        wall = time.perf_counter() - t_round + before
        self.policy.observe_overhead(len(running), max(chosen) > 0, wall - t_pass - t_draft)
        self.policy.observe_round(wall)
        # the guard's seconds: the step's, less the target's prefill of joining requests (see Guard)
        self.policy.observe_outcome(len(running), written,
                                    time.perf_counter() - self._step_started - self._prefill_seconds)
        self.times.rounds += 1
        self.times.add("pass", t_pass)
        self.times.add("rest", wall - before - t_pass - t_propose - t_join)

    def _draft_room(self, req: Request, ahead: int = 0) -> int:
        """The most drafts req's round may take, `ahead` tokens from now: no more than its budget
        has left (a draft past max_new_tokens would be cut), except for a seeded sampled request,
        which drafts its k up to the context's end whatever its budget, its tokens past the budget
        cut. Its last round then draws the random numbers a longer request's round draws there, so
        its text is the longer one's cut at max_tokens, as in plain decoding. Until stop 59 that
        round drafted fewer tokens, drew other numbers, and its last tokens differed (17 of 32
        seeded cases of a user trial through the served API)."""
        end = self.max_length - len(req.prompt_ids) if req.fixed_k else req.max_new_tokens
        return min(req.k, end - len(req.out) - ahead - 1)

    @staticmethod
    def _accept(running: list[Request], drafts: list[Draft], logits: list) -> list:
        """The acceptance rule for the round: greedy rows from the logits' argmax
        (`accept_greedy`), sampled rows on their warped distributions (`accept_batch`), each
        with its request's own random stream for this position. (num_accepted, next_token) or
        None (non-finite logits) per row."""
        outcomes: list = [None] * len(running)
        greedy = [i for i, r in enumerate(running) if r.params.greedy]
        sampled = [i for i, r in enumerate(running) if not r.params.greedy]
        if greedy:
            for i, o in zip(greedy, accept_greedy([drafts[i].tokens for i in greedy], [logits[i] for i in greedy])):
                outcomes[i] = o
        if sampled:
            rows = [(running[i], drafts[i], logits[i]) for i in sampled]
            for i, o in zip(sampled, accept_batch(
                    [d.tokens for _, d, _ in rows], [d.probs for _, d, _ in rows],
                    [warp(lg, r.params) for r, _, lg in rows],
                    [request_generator(r.params.seed, "verify", len(r.prompt_ids) + len(r.out), lg.device)
                     for r, _, lg in rows])):
                outcomes[i] = o
        return outcomes

    def _send_early(self, running: list[Request], committed: list, chosen: list[int]) -> dict[str, int]:
        """Sends the round's outcome (its committed tokens) of every sequence that drafted on a
        proposer that answers later (a remote drafter) and goes on, as soon as acceptance is
        decided, asking for as many drafts as this round's k (k sticks: the policy changes it
        rarely). The drafter drafts while this round's bookkeeping and the next round's admission
        run; the next round takes these drafts where it wants no more of them (`_propose`).
        Returns {sequence: k asked}. Not for a sequence whose next round will draft nothing: with
        the adaptive policy's speculation off, a round that drafted was a probe, and drafts asked
        for after it would only keep the drafter busy beside the next plain passes (a seeded
        sampled request drafts its k whatever the policy, so it still asks)."""
        proposer = self.proposers.get("draft_model")
        if proposer is None or not proposer.answers_later or self.degraded is not None:
            return {}
        off = self.policy.mode == "adaptive" and not self.policy.on
        items = []
        for req, done, c in zip(running, committed, chosen):
            if done is None or req.via != "draft_model" or not c or (off and not req.fixed_k):
                continue
            emitted, stopped = done
            k = min(c, self._draft_room(req, len(emitted)))
            if not stopped and len(req.out) + len(emitted) < req.max_new_tokens and k > 0:
                items.append(ProposeItem(req.id, req.unsent + emitted, k, self.policy.min_confidence,
                                         prepare=self.policy.prepare))
        if not items:
            return {}
        try:
            proposer.send(items)
        except Exception as e:
            self._proposer_failed(e)
            return {}
        self._early = {item.seq_id: item.k for item in items}
        self._early_prepare = self.policy.prepare
        return self._early

    def _propose(self, running: list[Request], ks: list[int]) -> tuple[list[Draft], float]:
        """One batched call per proposer in use. A drafter sequence that drafts nothing this round
        still sends its committed tokens once CATCH_UP_TOKENS have piled up (k = 0: the drafter
        stays caught up, so speculating again costs no long catch-up), and, even while the drafter
        rests, once the proposer says it is `due` (a remote drafter would reclaim it). Drafts asked for early (at
        the end of the last round) are collected first and serve every sequence that wants at
        most as many (a draft's first k tokens are what drafting k gives); the others are drafted
        in the call."""
        drafts = [Draft([], None)] * len(running)
        t_draft = 0.0  # seconds in calls that drafted (catch-up-only calls count as overhead)
        catch_up = CATCH_UP_TOKENS if not self._resting() else float("inf")
        served: set[int] = set()  # rows whose draft came early
        for name, proposer in list(self.proposers.items()):
            if self._early and name == "draft_model":
                t_draft += self._collect_early(running, ks, drafts, served)
            rows = [i for i, r in enumerate(running) if r.via == name and i not in served
                    and (ks[i] > 0 or (name == "draft_model" and (len(r.unsent) >= catch_up or proposer.due(r.id))))]
            if not rows:
                continue
            t0 = time.perf_counter()
            try:
                proposed = proposer.propose([ProposeItem(running[i].id, running[i].unsent, ks[i],
                                                         self.policy.min_confidence, prepare=self.policy.prepare)
                                             for i in rows])
            except Exception as e:
                if name != "draft_model":
                    raise
                self._proposer_failed(e)
                continue
            k = max(ks[i] for i in rows)
            self.times.add("draft" if k else "catch_up", time.perf_counter() - t0)
            if k:
                t_draft += time.perf_counter() - t0
                self.policy.observe_draft(name, len(rows), k, time.perf_counter() - t0,
                                          all_ready=all(d.pipeline_hit for i, d in zip(rows, proposed) if ks[i]))
            for i, draft in zip(rows, proposed):
                drafts[i] = draft
                running[i].unsent = []
                running[i].asked_prepare = self.policy.prepare
        return drafts, t_draft

    def _collect_early(self, running: list[Request], ks: list[int], drafts: list[Draft], served: set[int]) -> float:
        """Puts the drafts asked for early into the rows they serve (adding those to `served`),
        waiting for them only if a row takes them (k went to 0, or up: the client drops them when
        it reads them, before the answer to its next call); returns the seconds waited for them."""
        early = self._early
        rows = [i for i, r in enumerate(running) if r.via == "draft_model" and 0 < ks[i] <= early.get(r.id, 0)
                and not r.unsent]
        if rows:
            self._await_early(before_round=False)
        got, waited = self._early_got, self._early_waited
        self._early = self._early_got = None
        self._early_waited = 0.0
        if got is None:  # not waited for, or the drafter failed
            return waited
        for i in rows:
            d = got[running[i].id]
            drafts[i] = Draft(d.tokens[:ks[i]], d.probs[:ks[i]] if d.probs is not None else None,
                              pipeline_hit=d.pipeline_hit, prepared=d.prepared)
            running[i].asked_prepare = self._early_prepare
        served.update(rows)
        self.early_drafts += len(rows)
        if rows:
            self.policy.observe_draft("draft_model", len(rows), max(ks[i] for i in rows), waited,
                                      all_ready=all(drafts[i].pipeline_hit for i in rows))
        return waited

    def _await_early(self, before_round: bool = True) -> None:
        """Receives the drafts asked for early, if they are in flight and not received yet: the
        first drafter call after an early send (this round's collection, or a start of new
        sequences before it, which the drafter would answer only after them; a Start sent beside
        the prefill, `_start_ahead`, comes after them too, as a rule) waits for them here, and the
        wait counts as drafting (the policy's D, and the round's time)."""
        if not self._early or self._early_got is not None:
            return
        t0 = time.perf_counter()
        try:
            got = dict(zip(self._early, self.proposers["draft_model"].receive()))
        except Exception as e:
            self._proposer_failed(e)
            return
        finally:
            waited = time.perf_counter() - t0
            self.times.add("early_wait", waited)
            if before_round:
                self._early_waited_before += waited
        self._early_got = got
        self._early_waited += waited

    def _finish(self, req: Request, reason: str, notify: bool = True) -> None:
        """Frees the request's slots on both sides and wakes its waiter (notify=False: the caller
        calls `_notify` later, outside the lock it holds)."""
        if req in self.running:
            via = req.via
            self.running.remove(req)
            self.target.release(req.slot)
            self.free_slots.append(req.slot)
            self._stop_drafting(req)
            # how much sequences differ in acceptance, for the policy: from sequences that drafted
            # with one proposer only (one that fell back to the n-gram while the drafter was down
            # mixes two rates), and not from a failed one (its rounds may have stopped anywhere)
            if reason != "error" and set(req.stats.drafts_by_method) == {via}:
                self.policy.observe_finished(req.acceptance, via)
        req.finish_reason = reason
        if notify:
            self._notify(req)

    @staticmethod
    def _notify(req: Request) -> None:
        req.done.set()
        if req.on_finish is not None:
            try:
                req.on_finish(req)
            except Exception:  # the caller's callback: its failure stays with its request, never the loop
                log.exception("on_finish of request %s raised", req.id)
