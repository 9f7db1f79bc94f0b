#!/usr/bin/env bash
# The prepared GPU check, as one command on a lent GPU machine with no network (this project's
# `device` tool: its python3 holds torch with CUDA, transformers, tokenizers and safetensors; no
# Ray, so the Ray + gRPC stages are skipped). Run from the repository root:
#
#   OUT=/path/that/comes/back bash benchmarks/gpu_device.sh [more `specserve bench gpu` args]
#
# It prints the versions, installs this checkout without its dependencies (nothing to fetch), and
# runs `specserve bench gpu` on the in-process rows, writing $OUT/gpu.md, $OUT/gpu.json and
# $OUT/gpu.log as it goes; BUDGET_S (default 480) bounds it, so that a rerun fits a 10-minute call.
set -uo pipefail
OUT=${OUT:-/tmp/specserve-gpu}
mkdir -p "$OUT"
export OUT PYTHONUNBUFFERED=1
python3 -c "import sys, torch, transformers; print('python', sys.version.split()[0], '| torch', torch.__version__,
'| cuda', torch.version.cuda, '|', torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU',
'| transformers', transformers.__version__)" 2>&1 | tee "$OUT/gpu.log"
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >>"$OUT/gpu.log" 2>&1 \
  || { echo "installing specserve from this checkout failed (see $OUT/gpu.log)"; exit 1; }
timeout "${BUDGET_S:-480}" python3 -m specserve.cli bench gpu --stages in_process --prompts "${PROMPTS:-5}" \
  --max-tokens "${MAX_TOKENS:-64}" "$@" 2>&1 | tee -a "$OUT/gpu.log"
