"""Regenerates the Python stubs from speculative.proto with grpcio-tools:
`python -m specserve.proto.build`.

The stubs import each other as `specserve.proto.*` (the installed package), so protoc runs on a
copy of the .proto placed at specserve/proto/ in a scratch folder. `generate(out_dir)` is also
what the freshness test runs, then compares with the committed files.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile

PROTO_DIR = os.path.dirname(os.path.abspath(__file__))
PROTO = "speculative.proto"
STUBS = ("speculative_pb2.py", "speculative_pb2_grpc.py")
PACKAGE_PATH = os.path.join("specserve", "proto")  # the import path the stubs are generated for


def generate(out_dir: str = PROTO_DIR) -> list[str]:
    """Writes <out_dir>/speculative_pb2*.py; returns their paths."""
    from grpc_tools import protoc

    with tempfile.TemporaryDirectory() as scratch:
        src = os.path.join(scratch, PACKAGE_PATH)
        os.makedirs(src)
        shutil.copy(os.path.join(PROTO_DIR, PROTO), src)
        rc = protoc.main(["grpc_tools.protoc", f"-I{scratch}", f"--python_out={scratch}",
                          f"--grpc_python_out={scratch}", os.path.join(src, PROTO)])
        if rc != 0:
            raise RuntimeError(f"protoc failed with exit code {rc}")
        os.makedirs(out_dir, exist_ok=True)
        return [shutil.copy(os.path.join(src, name), os.path.join(out_dir, name)) for name in STUBS]


if __name__ == "__main__":
    for path in generate():
        print("wrote", path)
    sys.exit(0)
