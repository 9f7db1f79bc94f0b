"""The verifier's side of the gRPC contract: a Proposer whose drafts come from a remote drafter.

The engine's loop does not change: `SpeculativeEngine(target, RemoteProposer(address))` runs the
same draft -> verify -> accept rounds, with each draft fetched over gRPC (with a deadline).
"""

from __future__ import annotations

import grpc
import torch

from specserve.core.proposer import Draft, ProposeItem, Proposer
from specserve.core.sampling import SamplingParams
from specserve.proto import speculative_pb2 as pb
from specserve.proto import speculative_pb2_grpc as pb_grpc
from specserve.proto.codec import q_from_proto, sampling_to_proto

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
    """Proposes through a DrafterClient: one Propose call per round for every active sequence."""

    def __init__(self, client: DrafterClient):
        self.client = client
        self.vocab_size = client.info.vocab_size
        self.max_length = client.info.max_length
        self.rounds: dict[str, int] = {}

    def start(self, seq_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        self.client.call("Start", pb.StartRequest(items=[pb.StartItem(seq_id=seq_id, prompt_ids=prompt_ids,
                                                                      sampling=sampling_to_proto(params))]))
        self.rounds[seq_id] = 0

    def propose(self, items: list[ProposeItem]) -> list[Draft]:
        for item in items:
            self.rounds[item.seq_id] += 1
        reply = self.client.call("Propose", pb.ProposeRequest(items=[pb.ProposeItem(
            seq_id=item.seq_id, round=self.rounds[item.seq_id], new_tokens=item.new_tokens, k=item.k)
            for item in items]))
        drafts = []
        for item, d in zip(items, reply.drafts, strict=True):
            if d.seq_id != item.seq_id or d.round != self.rounds[item.seq_id] or len(d.tokens) != item.k:
                raise RuntimeError(f"drafter answered ({d.seq_id}, round {d.round}, {len(d.tokens)} tokens) "
                                   f"to ({item.seq_id}, round {self.rounds[item.seq_id]}, k={item.k})")
            probs = torch.stack([q_from_proto(q, self.vocab_size) for q in d.q]) if d.q else None
            drafts.append(Draft(list(d.tokens), probs, pipeline_hit=d.pipeline_hit))
        return drafts

    def release(self, seq_id: str) -> None:
        if self.rounds.pop(seq_id, None) is not None:
            self.client.call("Release", pb.ReleaseRequest(seq_ids=[seq_id]))
