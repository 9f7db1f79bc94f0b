#!/usr/bin/env bash
# Creates .venv and installs specserve with its cluster, test and bench extras.
#
# torch is installed FIRST and pinned, so that the package's install never brings another torch:
# on the reference CPU machine `torch==2.13.0` resolves to the CPU wheel on its disk; elsewhere
# PyPI's Linux wheel is the multi-GB CUDA build. Choose the build with SPECSERVE_TORCH, e.g.
#   CPU, any machine:  SPECSERVE_TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"
#   NVIDIA GPU:        SPECSERVE_TORCH="torch==2.13.0"   (PyPI's Linux wheel is the CUDA build)
set -euo pipefail
cd "$(dirname "$0")"
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# shellcheck disable=SC2086
.venv/bin/python -m pip install -q ${SPECSERVE_TORCH:-torch==2.13.0}
.venv/bin/python -m pip install -q -e ".[cluster,test,bench]"
