"""The drafter's gRPC server: the `Drafter` service of proto/speculative.proto around one drafter
model, with one KV cache (one proposer) per live sequence.

Model work runs under one lock, so a sequence's state is never touched by two threads at once.
With pipelining on, each Propose schedules the next round's speculative draft on a background
thread; it runs while the verifier scores the round just answered.
"""

from __future__ import annotations

import threading
from concurrent import futures

import grpc
import torch

from drafter_service.pipeline import PipelinedProposer
from drafter_service.proposer import DraftModelProposer
from drafter_service.runner import ModelRunner
from drafter_service.sampling import SamplingParams
from proto import speculative_pb2 as pb
from proto import speculative_pb2_grpc as pb_grpc

MAX_K = 64


class RequestError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code


def q_to_proto(q: torch.Tensor) -> pb.Distribution:
    """float32 q, exactly: sparse (support only) when most of the vocabulary is zero, else dense."""
    q = q.float()
    support = torch.nonzero(q).flatten()
    if support.numel() * 2 < q.numel():
        return pb.Distribution(token_ids=support.tolist(), probs=q[support].tolist())
    return pb.Distribution(probs=q.tolist())


def q_from_proto(dist: pb.Distribution, vocab_size: int) -> torch.Tensor:
    if dist.token_ids:
        q = torch.zeros(vocab_size, dtype=torch.float32)
        q[torch.tensor(list(dist.token_ids))] = torch.tensor(list(dist.probs), dtype=torch.float32)
        return q
    if len(dist.probs) != vocab_size:
        raise ValueError(f"dense distribution has {len(dist.probs)} entries, vocabulary has {vocab_size}")
    return torch.tensor(list(dist.probs), dtype=torch.float32)


def sampling_from_proto(s: pb.Sampling) -> SamplingParams:
    return SamplingParams(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p if s.top_p > 0 else 1.0,
                          seed=s.seed)


class DrafterServicer(pb_grpc.DrafterServicer):
    def __init__(self, model, pipeline: bool = True, max_sequences: int = 256):
        self.model = model.eval()
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        self.max_length = ModelRunner(model).max_length
        self.pipeline = pipeline
        self.max_sequences = max_sequences
        self.seqs: dict[str, PipelinedProposer | DraftModelProposer] = {}
        self.versions: dict[str, int] = {}  # bumps on every Propose: stale speculation is skipped
        self.lock = threading.Lock()
        self.background = futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="speculate")
        self.hits_released = self.misses_released = 0

    # -- helpers ---------------------------------------------------------------------------
    def _get(self, seq_id: str):
        seq = self.seqs.get(seq_id)
        if seq is None:
            raise RequestError(grpc.StatusCode.NOT_FOUND, f"unknown sequence id {seq_id!r}")
        return seq

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
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))

    # -- RPCs ------------------------------------------------------------------------------
    def Start(self, request, context):
        return self._handle(context, lambda: self._start(request))

    def _start(self, request):
        items = []
        for item in request.items:  # validate everything before touching state
            if not item.seq_id:
                raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, "seq_id is empty")
            if item.seq_id in self.seqs:
                raise RequestError(grpc.StatusCode.ALREADY_EXISTS, f"sequence {item.seq_id!r} already started")
            prompt = self._check_tokens(item.prompt_ids, "prompt_ids")
            if not prompt:
                raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, f"sequence {item.seq_id!r}: empty prompt")
            if len(prompt) >= self.max_length:
                raise RequestError(grpc.StatusCode.OUT_OF_RANGE, f"prompt of {len(prompt)} tokens exceeds the "
                                   f"drafter's context of {self.max_length}")
            items.append((item.seq_id, prompt, sampling_from_proto(item.sampling)))
        if len(self.seqs) + len(items) > self.max_sequences:
            raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"the drafter holds {len(self.seqs)} sequences (max {self.max_sequences})")
        with self.lock:
            for seq_id, prompt, params in items:
                proposer = DraftModelProposer(ModelRunner(self.model, name="drafter"))
                seq = PipelinedProposer(proposer) if self.pipeline else proposer
                seq.start(prompt, params)
                self.seqs[seq_id] = seq
                self.versions[seq_id] = 0
        return pb.StartReply(live_sequences=len(self.seqs))

    def Propose(self, request, context):
        return self._handle(context, lambda: self._propose(request))

    def _propose(self, request):
        work = []
        for item in request.items:
            seq = self._get(item.seq_id)
            if not 1 <= item.k <= MAX_K:
                raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, f"k must be in [1, {MAX_K}], got {item.k}")
            work.append((item, seq, self._check_tokens(item.new_tokens, "new_tokens")))
        drafts = []
        with self.lock:
            for item, seq, new_tokens in work:
                inner = seq.inner if self.pipeline else seq
                if len(inner.tokens) + len(new_tokens) + item.k > self.max_length:
                    raise RequestError(grpc.StatusCode.OUT_OF_RANGE,
                                       f"sequence {item.seq_id!r} would exceed the drafter's context")
                draft = seq.propose(new_tokens, item.k)
                self.versions[item.seq_id] += 1
                drafts.append(pb.Draft(seq_id=item.seq_id, round=item.round, tokens=draft.tokens,
                                       q=[q_to_proto(q) for q in draft.probs] if draft.probs is not None else [],
                                       pipeline_hit=draft.pipeline_hit))
        if self.pipeline:
            for item, _, _ in work:
                self.background.submit(self._speculate, item.seq_id, self.versions[item.seq_id], item.k)
        return pb.ProposeReply(drafts=drafts)

    def _speculate(self, seq_id: str, version: int, k: int) -> None:
        with self.lock:
            seq = self.seqs.get(seq_id)
            if seq is None or self.versions.get(seq_id) != version:
                return  # released, or the verifier already came back: nothing to hide
            if len(seq.inner.tokens) + 2 * k + 1 > self.max_length:
                return
            seq.speculate(k)

    def Release(self, request, context):
        with self.lock:
            for seq_id in request.seq_ids:
                seq = self.seqs.pop(seq_id, None)
                self.versions.pop(seq_id, None)
                if seq is not None:
                    if self.pipeline:
                        self.hits_released += seq.hits
                        self.misses_released += seq.misses
                    seq.release()
            return pb.ReleaseReply(live_sequences=len(self.seqs))

    def Info(self, request, context):
        with self.lock:
            live = list(self.seqs.values()) if self.pipeline else []
            return pb.InfoReply(vocab_size=self.vocab_size, max_length=self.max_length, live_sequences=len(self.seqs),
                                pipeline=self.pipeline,
                                pipeline_hits=self.hits_released + sum(s.hits for s in live),
                                pipeline_misses=self.misses_released + sum(s.misses for s in live))


def serve(model, host: str = "0.0.0.0", port: int = 0, pipeline: bool = True, max_workers: int = 8):
    """Starts the gRPC server; returns (server, bound_port, servicer)."""
    servicer = DrafterServicer(model, pipeline=pipeline)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers),
                         options=[("grpc.max_receive_message_length", 64 << 20),
                                  ("grpc.max_send_message_length", 64 << 20)])
    pb_grpc.add_DrafterServicer_to_server(servicer, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise RuntimeError(f"could not bind the drafter's gRPC server to {host}:{port}")
    server.start()
    return server, bound, servicer
