#!/usr/bin/env bash
# Creates .venv (if needed), installs the dev requirements and builds ft._C in place.
# Idempotent: a second run reuses the venv and rebuilds only what changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --disable-pip-version-check -r requirements.txt 2>&1 \
  | grep -v "is ignored: it is neither a file nor a directory" || true
.venv/bin/python -c "import torch, grpc, google.protobuf, pytest" \
  || { echo "setup: dependencies did not install" >&2; exit 1; }
.venv/bin/python setup.py build_ext --inplace > .venv/build.log 2>&1 \
  || { tail -50 .venv/build.log >&2; echo "setup: build failed (log: .venv/build.log)" >&2; exit 1; }
.venv/bin/python -c "import ft; print('ft ready: torch', __import__('torch').__version__, '| NCCL:', ft._C.has_nccl)"
