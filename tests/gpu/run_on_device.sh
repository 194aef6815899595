#!/usr/bin/env bash
# Builds ft's extension from source on the GPU machine and runs the GPU tests
# (plus the CUDA benchmark) within 8 minutes.
#
# The GPU machine (the device tool's `run`): Python 3.12, torch 2.11.0+cu130,
# nvcc 13.0, ninja, one H200, no package index. Run from the repository root:
#
#   run(command="bash tests/gpu/run_on_device.sh", timeout_s=540)
#
# If pytest is not installed there, download its wheels on the dev machine
# first (`pip download -d .ci/gpu-wheels pytest`) and pass
# carry=[".ci/gpu-wheels"]; this script installs from there offline.
# Output: the build log tail, pytest's report and the benchmark's JSON, also
# copied to $OUT when the device tool sets it.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."

PY=${PYTHON:-python3}
OUT=${OUT:-/tmp/ft-gpu-out}
mkdir -p "$OUT"
t0=$(date +%s)
stamp() { echo "[gpu +$(( $(date +%s) - t0 ))s] $*"; }

stamp "machine"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
"$PY" -c "import sys, torch; print(sys.version.split()[0], torch.__version__, 'cuda', torch.version.cuda, 'devices', torch.cuda.device_count())"

if ! "$PY" -c "import pytest" 2>/dev/null; then
  if [ -d .ci/gpu-wheels ]; then
    "$PY" -m pip install -q --no-index --find-links .ci/gpu-wheels pytest
  else
    echo "pytest is missing and no .ci/gpu-wheels was carried"; exit 2
  fi
fi

stamp "building ft._C (NCCL path) from source"
rm -f ft/_C*.so
export MAX_JOBS=${MAX_JOBS:-16}
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
if ! timeout 300 "$PY" setup.py -q build_ext --inplace >"$OUT/build.log" 2>&1; then
  tail -n 80 "$OUT/build.log"
  stamp "build failed"
  exit 1
fi
tail -n 3 "$OUT/build.log"
"$PY" -c "import torch, ft; print('has_nccl', ft._C.has_nccl, 'nccl', ft._C.nccl_version(), 'torch nccl', torch.cuda.nccl.version())" || exit 1

stamp "GPU tests"
timeout 240 "$PY" -m pytest -v -s -p no:cacheprovider tests/gpu 2>&1 | tee "$OUT/pytest.log"
rc=${PIPESTATUS[0]}

stamp "CUDA benchmark"
timeout 90 "$PY" bench/backend_bench_cuda.py --json "$OUT/bench_cuda.json" 2>&1 | tail -n 40 || true

stamp "done (pytest exit $rc)"
exit "$rc"
