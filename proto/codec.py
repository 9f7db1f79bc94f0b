"""The wire codec: conversions between the proto messages of `speculative.proto` and the Python
objects both sides use. The drafter encodes, the verifier decodes; this is the only place either
does.
"""

from __future__ import annotations

import sys

import torch

from specserve.core.sampling import SamplingParams
from specserve.proto import speculative_pb2 as pb


PROTOCOL_VERSION = 8  # 8: ProposeItem.skip_preparation; 7: k at most 16 (core.proposer.MAX_K); 6: InfoReply.seq_ttl_s; 5: ProposeStream; 4: fan-out (Draft.prepared, InfoReply.fanout); 3: Propose takes k = 0 and min_confidence
_TORCH = {pb.PROB_FLOAT32: torch.float32, pb.PROB_FLOAT16: torch.float16, pb.PROB_BFLOAT16: torch.bfloat16}
_CODE = {v: k for k, v in _TORCH.items()}
WIRE_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
assert sys.byteorder == "little", "the wire format is little-endian"


def dtype_code(dtype: torch.dtype) -> int:
    return _CODE[dtype]


def q_to_proto(q: torch.Tensor) -> pb.Distribution:
    """q exactly as it is, in its own dtype (float32, float16 or bfloat16): packed bytes, sparse
    (support only) when most of the vocabulary is zero, else dense. One copy to the host."""
    q = q.detach().cpu()
    support = torch.nonzero(q).flatten()
    if support.numel() * 2 < q.numel():
        return pb.Distribution(token_ids=support.tolist(), packed=_pack(q[support]), dtype=_CODE[q.dtype])
    return pb.Distribution(packed=_pack(q), dtype=_CODE[q.dtype])


def _pack(t: torch.Tensor) -> bytes:
    return (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).contiguous().numpy().tobytes()


def q_from_proto(dist: pb.Distribution, vocab_size: int) -> torch.Tensor:
    """The [V] tensor, in the dtype it was sent in (on the host)."""
    if dist.dtype not in _TORCH:
        raise ValueError(f"unknown q dtype {dist.dtype}")
    dtype = _TORCH[dist.dtype]
    values = torch.frombuffer(bytearray(dist.packed), dtype=dtype) if dist.packed else torch.zeros(0, dtype=dtype)
    if dist.token_ids:
        if values.numel() != len(dist.token_ids):
            raise ValueError(f"sparse distribution has {len(dist.token_ids)} ids and {values.numel()} values")
        q = torch.zeros(vocab_size, dtype=dtype)
        q[torch.tensor(list(dist.token_ids))] = values
        return q
    if values.numel() != vocab_size:
        raise ValueError(f"dense distribution has {values.numel()} entries, vocabulary has {vocab_size}")
    return values


def sampling_from_proto(s: pb.Sampling) -> SamplingParams:
    return SamplingParams(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p if s.top_p > 0 else 1.0,
                          seed=s.seed)


def sampling_to_proto(params: SamplingParams) -> pb.Sampling:
    return pb.Sampling(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p, seed=params.seed)
