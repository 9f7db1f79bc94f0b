"""`specserve bench wire`: what q costs on the wire per round. For vocabularies of 8,192 (the demo
pair) and 128,256 (Llama 3), k = 4 and batches of 1, 8 and 64 sequences, in each wire dtype:
the size of one ProposeReply, and the time to encode it on the drafter (q -> bytes -> message ->
serialized) plus decode it on the verifier (parse -> tensors), medians of repeats, on this machine.
Dense q (temperature sampling without top-k / top-p): the worst case. Writes OUT.md and OUT.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from specserve.benchmarks.endpoint import out_prefix, write_results
from specserve.config import REPO_ROOT
from specserve.proto.transport import MAX_MESSAGE_BYTES
from specserve.proto import speculative_pb2 as pb
from specserve.proto.codec import WIRE_DTYPES, q_from_proto, q_to_proto

RESULTS_DIR = REPO_ROOT / "docs" / "benchmarks"


def one(vocab: int, k: int, batch: int, dtype: torch.dtype, repeats: int) -> dict:
    qs = torch.softmax(torch.randn(batch, k, vocab, generator=torch.Generator().manual_seed(0)) * 2, -1).to(dtype)
    enc, dec, size = [], [], 0
    for _ in range(repeats):
        t0 = time.perf_counter()
        reply = pb.ProposeReply(drafts=[pb.Draft(seq_id=str(i), tokens=[1] * k, q=[q_to_proto(q) for q in qs[i]])
                                        for i in range(batch)])
        raw = reply.SerializeToString()
        t1 = time.perf_counter()
        back = pb.ProposeReply.FromString(raw)
        out = [torch.stack([q_from_proto(d, vocab) for d in draft.q]) for draft in back.drafts]
        t2 = time.perf_counter()
        enc.append(t1 - t0)
        dec.append(t2 - t1)
        size = len(raw)
    assert torch.equal(out[0], qs[0])
    return {"vocab": vocab, "k": k, "batch": batch, "dtype": str(dtype).replace("torch.", ""), "bytes": size,
            "fits": size <= MAX_MESSAGE_BYTES, "encode_ms": 1e3 * statistics.median(enc),
            "decode_ms": 1e3 * statistics.median(dec)}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="specserve bench wire", description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", type=out_prefix, default=str(RESULTS_DIR / "wire"))
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    for vocab in (8192, 128256):
        for batch in (1, 8, 64):
            for name, dtype in WIRE_DTYPES.items():
                if vocab * 4 * batch * dtype.itemsize > MAX_MESSAGE_BYTES:  # refused by gRPC; not built
                    rows.append({"vocab": vocab, "k": 4, "batch": batch, "dtype": name,
                                 "bytes": vocab * 4 * batch * dtype.itemsize, "fits": False})
                    continue
                rows.append(one(vocab, 4, batch, dtype, args.repeats))
    lines = [f"Command: `specserve bench wire {' '.join(argv)}`", "",
             f"One ProposeReply, k = 4, dense q, message limit {MAX_MESSAGE_BYTES >> 20} MiB; one thread, medians "
             f"of {args.repeats}.", "", "| vocab | batch | dtype | bytes | fits | encode ms | decode ms |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['vocab']} | {r['batch']} | {r['dtype']} | {r['bytes']:,} | {'yes' if r['fits'] else 'no'} | "
                     + (f"{r['encode_ms']:.2f} | {r['decode_ms']:.2f} |" if "encode_ms" in r else "– | – |"))
    write_results(args.out, {"rows": rows, "repeats": args.repeats}, "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
