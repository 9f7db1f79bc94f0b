"""The wire codec: conversions between the proto messages of `speculative.proto` and the Python
objects both sides use. The drafter encodes, the verifier decodes; this is the only place either
does.
"""

from __future__ import annotations

import torch

from specserve.core.sampling import SamplingParams
from specserve.proto import speculative_pb2 as pb


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


def sampling_to_proto(params: SamplingParams) -> pb.Sampling:
    return pb.Sampling(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p, seed=params.seed)
