"""The verifier's side of the gRPC contract: a Proposer whose drafts come from a remote drafter.

The engine's loop does not change: `SpeculativeEngine(target, RemoteProposer(address))` runs the
same draft -> verify -> accept rounds, with each draft fetched over gRPC (with a deadline).
"""

from __future__ import annotations

import uuid

import grpc
import torch

from drafter_service.proposer import Draft, Proposer
from drafter_service.sampling import SamplingParams
from drafter_service.server import q_from_proto
from proto import speculative_pb2 as pb
from proto import speculative_pb2_grpc as pb_grpc

DEFAULT_DEADLINE_S = 30.0


class DrafterClient:
    """One channel to one drafter server."""

    def __init__(self, address: str, deadline_s: float = DEFAULT_DEADLINE_S):
        self.address = address
        self.deadline_s = deadline_s
        self.channel = grpc.insecure_channel(address, options=[("grpc.max_receive_message_length", 64 << 20),
                                                               ("grpc.max_send_message_length", 64 << 20)])
        self.stub = pb_grpc.DrafterStub(self.channel)
        grpc.channel_ready_future(self.channel).result(timeout=deadline_s)
        self.info = self.stub.Info(pb.InfoRequest(), timeout=deadline_s)

    def call(self, method: str, request):
        return getattr(self.stub, method)(request, timeout=self.deadline_s)

    def close(self) -> None:
        self.channel.close()


class RemoteProposer(Proposer):
    """Proposes through a DrafterClient, one sequence at a time."""

    def __init__(self, client: DrafterClient):
        self.client = client
        self.vocab_size = client.info.vocab_size
        self.max_length = client.info.max_length
        self.seq_id: str | None = None
        self.round = 0

    def start(self, prompt_ids: list[int], params: SamplingParams) -> None:
        self.seq_id = uuid.uuid4().hex
        self.round = 0
        sampling = pb.Sampling(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
                               seed=params.seed)
        self.client.call("Start", pb.StartRequest(items=[pb.StartItem(seq_id=self.seq_id, prompt_ids=prompt_ids,
                                                                      sampling=sampling)]))

    def propose(self, new_tokens: list[int], k: int) -> Draft:
        self.round += 1
        reply = self.client.call("Propose", pb.ProposeRequest(items=[pb.ProposeItem(
            seq_id=self.seq_id, round=self.round, new_tokens=new_tokens, k=k)]))
        d = reply.drafts[0]
        if d.seq_id != self.seq_id or d.round != self.round or len(d.tokens) != k:
            raise RuntimeError(f"drafter answered ({d.seq_id}, round {d.round}, {len(d.tokens)} tokens) "
                               f"to ({self.seq_id}, round {self.round}, k={k})")
        probs = None
        if d.q:
            probs = torch.stack([q_from_proto(q, self.vocab_size) for q in d.q])
        return Draft(list(d.tokens), probs, pipeline_hit=d.pipeline_hit)

    def release(self) -> None:
        if self.seq_id is not None:
            self.client.call("Release", pb.ReleaseRequest(seq_ids=[self.seq_id]))
            self.seq_id = None
