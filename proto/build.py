"""Regenerates the Python stubs from speculative.proto with grpcio-tools: `python -m proto.build`.

`generate(out_dir)` is also what the staleness test runs, then compares with the committed files.
"""

from __future__ import annotations

import os
import sys

PROTO_DIR = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(PROTO_DIR)
STUBS = ("speculative_pb2.py", "speculative_pb2_grpc.py")


def generate(out_root: str = ROOT) -> list[str]:
    """Writes <out_root>/proto/speculative_pb2*.py; returns their paths."""
    from grpc_tools import protoc

    os.makedirs(os.path.join(out_root, "proto"), exist_ok=True)
    rc = protoc.main(["grpc_tools.protoc", f"-I{ROOT}", f"--python_out={out_root}", f"--grpc_python_out={out_root}",
                      os.path.join(ROOT, "proto", "speculative.proto")])
    if rc != 0:
        raise RuntimeError(f"protoc failed with exit code {rc}")
    return [os.path.join(out_root, "proto", name) for name in STUBS]


if __name__ == "__main__":
    for path in generate():
        print("wrote", os.path.relpath(path, ROOT))
    sys.exit(0)
