#!/usr/bin/env bash
# CUDA build lane (docs/building.md, "The CUDA build lane").
#
# Builds ft against the CUDA 13.0 build of torch 2.14.1 and the CUDA 13.0
# toolkit on this GPU-less machine, with the NCCL path compiled in
# (FT_USE_NCCL), checks that the extension imports with NCCL linked, and runs
# the CPU test suite against that build. The CPU-torch build in the clone is
# tested by .ci/run and is never touched here: the CUDA build happens in a
# copy of the tree, because both builds would write ft/_C.cpython-311-*.so.
#
# Cached outside the clone, reused by later runs on the same machine, and
# rebuilt from nothing on a fresh one:
#   $FT_CUDA_VENV   (default /var/cache/ft/venv-cu130)  venv with CUDA torch + test deps
#   $FT_CUDA_CACHE  (default /var/cache/ft)             source copy and object files
#
# Usage: bash .ci/cuda_lane.sh [extra pytest args]   (exit status: pytest's)
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
CACHE=${FT_CUDA_CACHE:-/var/cache/ft}
VENV=${FT_CUDA_VENV:-$CACHE/venv-cu130}
SRC=$CACHE/src-cu130
BUILD_TEMP=$CACHE/build-cu130
TORCH_SPEC=${FT_CUDA_TORCH:-torch==2.14.1}
BASE_PYTHON=${FT_CUDA_PYTHON:-python3}
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda-13.0}
# Only matters if a .cu file is ever added: without it torch's helper
# crashes on a machine with no visible GPU.
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
export MAX_JOBS=${MAX_JOBS:-2}

t0=$(date +%s)
stamp() { echo "[cuda-lane +$(( $(date +%s) - t0 ))s] $*"; }

mkdir -p "$CACHE"
# One lane at a time per cache (the venv and the build dir are shared).
exec 9>"$CACHE/.cuda-lane.lock"
flock 9

# --- 1. venv with the CUDA torch and ft's requirements ----------------------
# Requirements come from pyproject.toml (dependencies + the "test" extra + the build
# system), read statically, so this list never drifts from the package's; constraints.txt
# pins their versions (less its torch line: this lane brings its own torch).
REQS=$("$BASE_PYTHON" -c '
import re, sys, tomllib
with open(sys.argv[1], "rb") as f:
    p = tomllib.load(f)
seen = set()
for req in (p["project"]["dependencies"] + p["project"]["optional-dependencies"]["test"]
            + p["build-system"]["requires"]):
    name = re.match(r"[A-Za-z0-9_.-]+", req).group(0).lower()
    if name != "torch" and name not in seen:
        seen.add(name)
        print(req)
' "$ROOT/pyproject.toml")
CONSTRAINTS="$CACHE/constraints-cuda-lane.txt"
grep -v -i '^torch==' "$ROOT/constraints.txt" > "$CONSTRAINTS"
WANT="$TORCH_SPEC $(echo $REQS) -c $(grep -v '^#' "$CONSTRAINTS" | grep . | tr '\n' ' ')"
if [ ! -x "$VENV/bin/python" ] || [ "$(cat "$VENV/.ft-requirements" 2>/dev/null)" != "$WANT" ]; then
  stamp "creating $VENV ($TORCH_SPEC $(echo $REQS))"
  rm -rf "$VENV"
  "$BASE_PYTHON" -m venv "$VENV"
  # shellcheck disable=SC2086
  "$VENV/bin/pip" install -q --progress-bar off -c "$CONSTRAINTS" "$TORCH_SPEC" $REQS \
    2> >(grep -v "is neither a file nor a directory" >&2)
  echo "$WANT" > "$VENV/.ft-requirements"
else
  stamp "reusing $VENV"
fi
PY="$VENV/bin/python"
"$PY" -c "import torch, sys; assert torch.version.cuda, 'torch in $VENV is not a CUDA build: ' + torch.__version__"

# --- 2. a copy of the tree (mtimes kept, so ninja rebuilds only what changed)
stamp "copying the tree to $SRC"
rm -rf "$SRC"
mkdir -p "$SRC"
tar -C "$ROOT" --exclude=./.git --exclude=./.venv --exclude=./build \
  --exclude='*.so' --exclude=__pycache__ --exclude=.pytest_cache --exclude=.hypothesis \
  -cf - . | tar -C "$SRC" -xf -

# --- 3. build ---------------------------------------------------------------
stamp "building ft against $("$PY" -c 'import torch; print(torch.__version__)') and $CUDA_HOME"
(cd "$SRC" && "$PY" setup.py -q build_ext --inplace --build-temp "$BUILD_TEMP" >"$CACHE/cuda-lane-build.log" 2>&1) || {
  tail -n 60 "$CACHE/cuda-lane-build.log"
  echo "cuda lane: build failed (full log: $CACHE/cuda-lane-build.log)"
  exit 1
}

# --- 4. NCCL compiled, linked and imported ----------------------------------
stamp "checking the extension"
(cd "$SRC" && "$PY" - <<'EOF'
import torch
import ft
from ft import _C

assert torch.version.cuda, torch.__version__
assert _C.has_nccl, "ft._C was built without the NCCL path"
linked = _C.nccl_version()  # calls ncclGetVersion in the linked libnccl
assert linked == tuple(torch.cuda.nccl.version()), (linked, torch.cuda.nccl.version())
maps = open("/proc/self/maps").read()
libs = sorted({line.split()[-1] for line in maps.splitlines() if "libnccl" in line})
assert libs, "libnccl is not mapped"
pg = ft.ProcessGroupNCCL()
assert pg.backend.cuda_device == -1
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), "
      f"cuda available: {torch.cuda.is_available()}")
print(f"ft._C: {_C.__file__}")
print(f"has_nccl={_C.has_nccl} nccl_version={linked} libnccl={libs}")
EOF
)

# --- 5. the CPU tests against the CUDA build -----------------------------------
# The backend's own suite (every collective, reconfigure, failures, lanes, bad
# input): ft._C is what a CUDA build changes. Of coordination (which imports
# neither torch nor ft._C), the native gRPC module this lane also builds: its
# server and client tests. Of the Manager, its reconfigure tests: this lane's
# torch (2.14) is the one with torch's own reconfigurable groups. The whole suite
# runs on the CPU build in the main lane; FT_CUDA_LANE_TESTS=tests runs it all
# here too.
TESTS=${FT_CUDA_LANE_TESTS:-tests/backend tests/coordination/test_rpc_server.py tests/coordination/test_client_transports.py tests/manager/test_reconfigure_pg.py}
stamp "running $TESTS against the CUDA build"
set +e
# shellcheck disable=SC2086
(cd "$SRC" && "$PY" -m pytest -q -x -p no:cacheprovider $TESTS "$@")
rc=$?
set -e
stamp "done (pytest exit $rc)"
exit $rc
