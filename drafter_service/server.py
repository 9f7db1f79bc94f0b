"""The drafter's gRPC server: the `Drafter` service of proto/speculative.proto around one drafter
model, with one KV cache (one proposer) per live sequence.

Proposes come as unary calls or, from the verifier, on one long-lived ProposeStream per
connection (answered in order, each request exactly as the unary call would be).
Model work runs under one lock, so a sequence's state is never touched by two threads at once.
With pipelining on, each Propose schedules the next round's speculative draft on a background
thread; it runs while the verifier scores the round just answered. A ProposeItem with
skip_preparation schedules nothing for its sequence (the verifier's adaptive policy asks that where
a prepared round would rarely be used: see verifier_service/policy.py).

A Release is answered at once and applied by whoever holds the lock next, or now if nobody does
(`_drain_releases`): it never waits for a preparation (or a Propose) to end. The verifier sends
it between rounds, so before, every round that released a finished sequence waited for the
drafter's preparation of all the others (23.5 ms per round at 32 sequences in the batching bench).

A sequence whose verifier went away without a Release (a verifier crash, a lost network) is
reclaimed once it has had no call for `seq_ttl_s`. The server pings every connection, and closes
one whose verifier stopped answering (its host died, its network was cut), which ends its
ProposeStream (`specserve.proto.transport`). The server binds to one address (the node's, from
the actor) and refuses messages over `specserve.proto.transport.MAX_MESSAGE_BYTES`.

`DrafterTimes` counts where the server's time goes (Propose handlers, the model lock, drafting,
preparations), for benchmarks to split a remote round into drafting and transport.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from concurrent import futures
from dataclasses import dataclass, field

import grpc
import torch

from specserve.core.proposer import MAX_K, CapacityError, ProposeItem
from specserve.core.runner import ModelRunner
from specserve.drafter.draft_model import DraftModelProposer
from specserve.drafter.pipeline import PipelinedProposer
from specserve.proto import speculative_pb2 as pb
from specserve.proto import speculative_pb2_grpc as pb_grpc
from specserve.proto.codec import PROTOCOL_VERSION, WIRE_DTYPES, dtype_code, q_to_proto, sampling_from_proto
from specserve.proto.transport import KEEPALIVE_S, KEEPALIVE_TIMEOUT_S, server_options

log = logging.getLogger("specserve.drafter")

BRANCH_SEQUENCES = 4  # branch slots are kept for this many sequences' fan-out (pipelining pays at small batches)
DEFAULT_SEQ_TTL_S = 600.0


@dataclass
class DrafterTimes:
    """The server's time, summed (seconds): Propose handlers from the request's arrival to its
    reply built ("handler"); in them, waiting for the model lock ("lock_wait": a preparation or
    another call held it) and the proposer's call ("propose"); and background preparations
    ("prepare"). Counts: Propose requests answered, preparations run."""

    proposes: int = 0
    preparations: int = 0
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(
        ("handler", "lock_wait", "propose", "prepare"), 0.0))
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, count: str | None = None, **seconds: float) -> None:
        with self.lock:  # handlers of several streams and the preparation thread add at once
            if count:
                setattr(self, count, getattr(self, count) + 1)
            for phase, s in seconds.items():
                self.seconds[phase] += s

    def to_dict(self) -> dict:
        with self.lock:
            return {"proposes": self.proposes, "preparations": self.preparations, "seconds": dict(self.seconds)}


class RequestError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code


class DrafterServicer(pb_grpc.DrafterServicer):
    def __init__(self, model, pipeline: bool | str = True, max_sequences: int = 64,
                 seq_ttl_s: float = DEFAULT_SEQ_TTL_S, q_dtype: str = "float32", compile: bool = False,
                 fanout: int = 1, bf16_head: bool = False, vocab: list[int] | None = None):
        """fanout: with pipelining, outcomes prepared per sequence and round (see pipeline.py);
        (fanout - 1) x BRANCH_SEQUENCES extra drafter slots hold the branches. bf16_head: a float32
        model multiplies by a bfloat16 head; vocab: the draft vocabulary (ModelRunner; pass the
        loading runner's `bf16_head` and `vocab`)."""
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        self.q_dtype = WIRE_DTYPES[q_dtype]
        self.fanout = fanout if pipeline else 1
        branch_slots = (self.fanout - 1) * min(max_sequences, BRANCH_SEQUENCES)
        runner = ModelRunner(model, name="drafter", slots=max_sequences + branch_slots, compile=compile,
                             bf16_head=bf16_head, vocab=vocab)
        runner.warmup(widths=(1,), branches=branch_slots > 0)  # compiles now (when compiled), not on the first request
        self.inner = DraftModelProposer(runner, q_dtype=self.q_dtype, branch_slots=branch_slots)
        # pipeline: False, True (the default policy) or a policy name from specserve.config.PIPELINE_POLICIES
        self.proposer = (PipelinedProposer(self.inner, *([pipeline] if isinstance(pipeline, str) else []),
                                           fanout=self.fanout)
                         if pipeline else self.inner)
        self.max_length = self.inner.max_length
        self.pipeline = bool(pipeline)
        self.max_sequences = max_sequences
        self.versions: dict[str, int] = {}  # bumps on every Propose: stale speculation is skipped
        self.seq_ttl_s = seq_ttl_s
        self.last_call: dict[str, float] = {}  # monotonic time of each sequence's last Start / Propose
        self.reclaimed = 0
        self.lock = threading.Lock()  # all model work and sequence state, one thread at a time
        self.to_release: set[str] = set()  # released, not applied yet (see `_locked`)
        self.release_lock = threading.Lock()  # guards to_release only
        self.streams = 0  # ProposeStreams open now (each holds an RPC thread)
        self.streams_lock = threading.Lock()
        self.background = futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="speculate")
        self.times = DrafterTimes()

    @property
    def live_sequences(self) -> int:
        """Sequences held, not counting released ones not applied yet."""
        return len(self.inner.seqs) - len(self.to_release & self.inner.seqs.keys())

    # -- helpers ---------------------------------------------------------------------------
    @contextlib.contextmanager
    def _locked(self, timeout: float = -1):
        """The model lock, with pending releases applied first (and after: any that came in
        meanwhile). timeout: give up waiting after this long; yields whether it holds the lock."""
        got = self.lock.acquire(timeout=timeout)
        try:
            if got:
                self._apply_releases()
            yield got
        finally:  # (a refused call too)
            if got:
                self.lock.release()
            self._drain_releases()

    def _apply_releases(self) -> None:
        """Under the model lock."""
        with self.release_lock:
            ids, self.to_release = self.to_release, set()
        for seq_id in ids:
            self._release(seq_id)

    def _drain_releases(self) -> None:
        """Applies pending releases now unless the lock is held (its holder applies them when done)."""
        while self.to_release and self.lock.acquire(blocking=False):
            try:
                self._apply_releases()
            finally:
                self.lock.release()

    def _check_tokens(self, tokens, what: str) -> list[int]:
        tokens = list(tokens)
        bad = [t for t in tokens if not 0 <= t < self.vocab_size]
        if bad:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT,
                               f"{what} holds token id {bad[0]} outside the vocabulary [0, {self.vocab_size})")
        return tokens

    def _handle(self, context, fn):
        try:
            return fn()
        except RequestError as e:
            context.abort(e.code, str(e))
        except CapacityError as e:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))

    # -- RPCs ------------------------------------------------------------------------------
    def Start(self, request, context):
        return self._handle(context, lambda: self._start(request, context))

    def _start(self, request, context=None):
        items = []
        for item in request.items:  # validate everything before touching state
            if not item.seq_id:
                raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, "seq_id is empty")
            prompt = self._check_tokens(item.prompt_ids, "prompt_ids")
            if not prompt:
                raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, f"sequence {item.seq_id!r}: empty prompt")
            if len(prompt) >= self.max_length:
                raise RequestError(grpc.StatusCode.OUT_OF_RANGE, f"prompt of {len(prompt)} tokens exceeds the "
                                   f"drafter's context of {self.max_length}")
            items.append((item.seq_id, prompt, sampling_from_proto(item.sampling)))
        with self._locked():  # (a release of the same id sent before this Start is applied first)
            if context is not None and not context.is_active():  # the caller gave up waiting for the lock: its
                # client counts these sequences as not started, and the Release it sends them on its next
                # connection may have come already (applied above, to nothing): started now, they would hold
                # their slots for the TTL (until stop 52)
                raise RequestError(grpc.StatusCode.CANCELLED, "the caller gave up on this Start")
            self._reclaim_idle()  # (first: an id past its TTL is free again)
            ids = [seq_id for seq_id, _, _ in items]
            for seq_id in ids:
                if seq_id in self.inner.seqs or ids.count(seq_id) > 1:
                    raise RequestError(grpc.StatusCode.ALREADY_EXISTS, f"sequence {seq_id!r} already started")
            if self.live_sequences + len(items) > self.max_sequences:
                raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                   f"the drafter holds {self.live_sequences} sequences (max {self.max_sequences})")
            self.proposer.start_many(items)  # one batched prefill
            for seq_id, prompt, params in items:
                self.versions[seq_id] = 0
                self.last_call[seq_id] = time.monotonic()
            return pb.StartReply(live_sequences=self.live_sequences)

    def Propose(self, request, context):
        return self._handle(context, lambda: self._propose(request))

    def ProposeStream(self, request_iterator, context):
        """Propose over one long-lived stream: one reply per request, in order; a refused request
        ends the stream with its status (as Propose would have answered it)."""
        with self.streams_lock:
            self.streams += 1
        try:
            for request in request_iterator:
                yield self._handle(context, lambda: self._propose(request))
        finally:
            with self.streams_lock:
                self.streams -= 1

    def _propose(self, request):
        arrived = time.perf_counter()
        if len({item.seq_id for item in request.items}) < len(request.items):
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, "a sequence id appears twice in one Propose")
        if self.pipeline and self.proposer.preparing and not all(
                self.proposer.served_by_preparation(item.seq_id, list(item.new_tokens), item.k, item.min_confidence)
                for item in request.items):
            self.proposer.interrupt.set()  # drafting on demand follows: stop preparing guesses that lost
        with self._locked():
            locked = time.perf_counter()
            if self.pipeline:
                self.proposer.interrupt.clear()
            items = []
            for item in request.items:
                seq = self.inner.seqs.get(item.seq_id)
                if seq is None:
                    raise RequestError(grpc.StatusCode.NOT_FOUND, f"unknown sequence id {item.seq_id!r}")
                if not 0 <= item.k <= MAX_K:
                    raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, f"k must be in [0, {MAX_K}], got {item.k}")
                if not 0.0 <= item.min_confidence <= 1.0:
                    raise RequestError(grpc.StatusCode.INVALID_ARGUMENT,
                                       f"min_confidence must be in [0, 1], got {item.min_confidence}")
                new_tokens = self._check_tokens(item.new_tokens, "new_tokens")
                base = self.proposer.base_length(item.seq_id) if self.pipeline else len(seq.tokens)
                if base + len(new_tokens) + item.k > self.max_length:
                    raise RequestError(grpc.StatusCode.OUT_OF_RANGE,
                                       f"sequence {item.seq_id!r} would exceed the drafter's context")
                items.append(ProposeItem(item.seq_id, new_tokens, item.k, item.min_confidence,
                                         prepare=not item.skip_preparation))
            drafts = self.proposer.propose(items)
            drafted = time.perf_counter()
            now = time.monotonic()
            for item in items:
                self.versions[item.seq_id] += 1
                self.last_call[item.seq_id] = now
            self._reclaim_idle(now)
            versions = {item.seq_id: self.versions[item.seq_id] for item in items if item.prepare and item.k}
        if self.pipeline and versions:
            self.background.submit(self._speculate, versions)
        qs = _to_host([d.probs for d in drafts])
        reply = pb.ProposeReply(drafts=[
            pb.Draft(seq_id=item.seq_id, round=req.round, tokens=d.tokens, pipeline_hit=d.pipeline_hit,
                     prepared=d.prepared, q=[q_to_proto(row) for row in q] if q is not None else [])
            for item, req, d, q in zip(items, request.items, drafts, qs)])
        self.times.add("proposes", handler=time.perf_counter() - arrived, lock_wait=locked - arrived,
                       propose=drafted - locked)
        return reply

    def _speculate(self, versions: dict[str, int]) -> None:
        """Background: prepares the drafts of the sequences just answered. A failure here (undone
        by the proposer) is logged; their next Propose drafts on demand."""
        try:
            with self._locked():
                t0 = time.perf_counter()
                # skip sequences released since, or whose verifier already came back: nothing to hide
                current = [s for s, v in versions.items() if self.versions.get(s) == v]
                if current:
                    self.proposer.speculate(current)
                    self.times.add("preparations", prepare=time.perf_counter() - t0)
        except Exception:
            log.exception("preparing drafts for %d sequences failed", len(versions))

    def Release(self, request, context):
        """Answered at once: applied now if the lock is free, else by its holder when it is done."""
        with self.release_lock:
            self.to_release.update(request.seq_ids)
        self._drain_releases()
        return pb.ReleaseReply(live_sequences=self.live_sequences)

    def _release(self, seq_id: str) -> None:
        self.proposer.release(seq_id)
        self.versions.pop(seq_id, None)
        self.last_call.pop(seq_id, None)

    def _reclaim_idle(self, now: float | None = None) -> None:
        """Releases sequences with no call for seq_ttl_s (their verifier never sent Release)."""
        now = time.monotonic() if now is None else now
        for seq_id in [s for s, t in self.last_call.items() if now - t > self.seq_ttl_s]:
            self._release(seq_id)
            self.reclaimed += 1

    def Info(self, request, context):
        # a busy drafter (a long Start or pass holding the model lock) answers at once: a verifier
        # connecting asks it, and takes a drafter that does not answer for a while for hung
        with self._locked(timeout=0.05) as locked:
            live = self.live_sequences if locked else len(self.inner.seqs)  # (else: a moment's count)
        return pb.InfoReply(vocab_size=self.vocab_size, max_length=self.max_length, live_sequences=live,
                            pipeline=self.pipeline, pipeline_hits=getattr(self.proposer, "hits", 0),
                            pipeline_misses=getattr(self.proposer, "misses", 0), protocol_version=PROTOCOL_VERSION,
                            q_dtype=dtype_code(self.q_dtype), fanout=self.fanout, seq_ttl_s=self.seq_ttl_s)


def _to_host(probs: list) -> list:
    """Every draft's q, from the drafter's device to the host in one transfer."""
    present = [q for q in probs if q is not None]
    if not present or present[0].device.type == "cpu":
        return probs
    host = torch.cat(present).cpu().split([q.shape[0] for q in present])
    it = iter(host)
    return [next(it) if q is not None else None for q in probs]


def serve(model, host: str = "127.0.0.1", port: int = 0, pipeline: bool | str = True, max_sequences: int = 64,
          max_workers: int = 32, seq_ttl_s: float = DEFAULT_SEQ_TTL_S, q_dtype: str = "float32",
          compile: bool = False, fanout: int = 1, bf16_head: bool = False, vocab: list[int] | None = None,
          keepalive_s: float = KEEPALIVE_S, keepalive_timeout_s: float = KEEPALIVE_TIMEOUT_S):
    """Starts the gRPC server on host:port (one interface: the Ray actor passes its node's
    address); returns (server, bound_port, servicer). max_workers: RPC threads; each open
    ProposeStream holds one for as long as its verifier is connected (and answers the keepalive's
    pings: keepalive_s, keepalive_timeout_s)."""
    servicer = DrafterServicer(model, pipeline=pipeline, max_sequences=max_sequences, seq_ttl_s=seq_ttl_s,
                               q_dtype=q_dtype, compile=compile, fanout=fanout, bf16_head=bf16_head, vocab=vocab)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers),
                         options=server_options(keepalive_s, keepalive_timeout_s))
    pb_grpc.add_DrafterServicer_to_server(servicer, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise RuntimeError(f"could not bind the drafter's gRPC server to {host}:{port}")
    server.start()
    return server, bound, servicer
