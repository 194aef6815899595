#!/usr/bin/env bash
# Builds ft's extension from source on the GPU machine and runs, within 8 minutes: the GPU
# tests, the README demo (2 replica groups, one kill, identical hashes), the heal benchmark on
# 8 GiB of CUDA state and the CUDA backend benchmark.
#
# The GPU machine (the device tool's `run`): Python 3.12, torch 2.11.0+cu130,
# nvcc 13.0, ninja, one H200, no package index. Run from the repository root:
#
#   run(command="bash tests/gpu/run_on_device.sh", carry=[".whl"], timeout_s=540)
#
# FT_GPU_BUDGET_S (default 480) bounds the whole script; FT_GPU_TESTS picks test files.
#
# Where grpcio/protobuf/pytest there are missing or too old for ft (setup.py's
# floors), carry cp312 wheels of them in .whl (see the device tool's README:
# pip download --python-version 3.12 ...); they are installed into /tmp/site
# only when the machine's own copies do not import ft's stubs.
# Output: the build log tail, pytest's report and the benchmark's JSON, also
# copied to $OUT when the device tool sets it.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."

PY=${PYTHON:-python3}
OUT=${OUT:-/tmp/ft-gpu-out}
mkdir -p "$OUT"
t0=$(date +%s)
stamp() { echo "[gpu +$(( $(date +%s) - t0 ))s] $*"; }
# Every step gets at most its own cap and never more than what is left of the
# whole budget, so the run ends (with a report) inside the device call's limit.
BUDGET=${FT_GPU_BUDGET_S:-480}
cap() {
  local left=$(( BUDGET - ($(date +%s) - t0) ))
  [ "$left" -lt 10 ] && left=10
  echo $(( $1 < left ? $1 : left ))
}

stamp "machine"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
"$PY" -c "import sys, torch; print(sys.version.split()[0], torch.__version__, 'cuda', torch.version.cuda, 'devices', torch.cuda.device_count())"

stamp "building ft._C (NCCL path) from source"
rm -f ft/_C*.so
export MAX_JOBS=${MAX_JOBS:-16}
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
export FT_NATIVE_GRPC=${FT_NATIVE_GRPC:-0}
if ! timeout "$(cap 240)" "$PY" setup.py -q build_ext --inplace >"$OUT/build.log" 2>&1; then
  tail -n 80 "$OUT/build.log"
  stamp "build failed"
  exit 1
fi
tail -n 3 "$OUT/build.log"
python_deps_ok() {
  "$PY" -c '
import grpc, google.protobuf, pytest
from ft.coordination._proto import torchft_pb2, torchft_pb2_grpc
print("grpcio", grpc.__version__, "protobuf", google.protobuf.__version__, "pytest", pytest.__version__)
' 2>&1 | tail -n 1
  return "${PIPESTATUS[0]}"
}
# After the build: importing the stubs imports ft, which needs ft._C.
if ! python_deps_ok; then
  if compgen -G ".whl/*.whl" >/dev/null; then
    stamp "installing the carried wheels into /tmp/site"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl || exit 2
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    python_deps_ok || { echo "the carried wheels did not help"; exit 2; }
  else
    echo "grpcio/protobuf/pytest missing or too old, and no .whl carried"; exit 2
  fi
fi

"$PY" -c "import torch, ft; print('has_nccl', ft._C.has_nccl, 'nccl', ft._C.nccl_version(), 'torch nccl', torch.cuda.nccl.version())" || exit 1

# One pytest per file: a fatal CUDA error aborts only its own file's run, and
# every other file still prints its report and tracebacks.
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
rc=0
for f in ${FT_GPU_TESTS:-tests/gpu/test_*.py}; do
  stamp "GPU tests: $f"
  timeout "$(cap 150)" "$PY" -m pytest -v -s -p no:cacheprovider --durations=5 --tb=short "$f" 2>&1 \
    | tee -a "$OUT/pytest.log"
  r=${PIPESTATUS[0]}
  [ "$r" -ne 0 ] && rc=$r && echo "[$f exit $r]"
done

# The README demo with 2 replica groups on this host's GPUs (on one GPU they share it, and
# their cross-group collectives go host-staged), one group killed: it must end with every
# replica's state hash identical. The ranks report which GPU they ran on.
stamp "demo: 2 groups, one kill, identical hashes"
timeout "$(cap 150)" "$PY" -m ft.launch --replicas 2 --chaos kill --every 8 --max-steps 120 \
  --timeout 130 --stop-grace 20 --log-dir "$OUT/demo_logs" --summary-json "$OUT/demo.json" \
  -- examples/train_ddp.py 2>&1 | tail -n 25
r=${PIPESTATUS[0]}
[ "$r" -ne 0 ] && rc=$r && echo "[demo exit $r]"
grep -ho '"gpu":"[^"]*"' "$OUT"/demo_logs/*.log 2>/dev/null | sort | uniq -c || true

stamp "heal benchmark (CUDA state, 8 GiB)"
timeout "$(cap 120)" "$PY" -m bench.heal_bench --device cuda --gib 8 --reps 3 2>&1 | tail -n 30 || true

stamp "CUDA backend benchmark"
timeout "$(cap 90)" "$PY" bench/backend_bench.py --cuda --json "$OUT/bench_cuda.json" 2>&1 | tail -n 40 || true

stamp "done (pytest exit $rc)"
exit "$rc"
