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
.venv/bin/python -c "import torch, grpc, google.protobuf, pytest, pybind11" \
  || { echo "setup: dependencies did not install" >&2; exit 1; }
# gRPC C++ for the lighthouse's native gRPC server (optional: without it the lighthouse serves
# with grpcio, ~0.5 ms more CPU per request). Debian/Ubuntu as root only.
if ! pkg-config --exists grpc++ libcrypto 2>/dev/null && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  { timeout 600 apt-get install -y -qq libgrpc++-dev libssl-dev pkg-config \
    || { timeout 300 apt-get update -qq && timeout 600 apt-get install -y -qq libgrpc++-dev libssl-dev pkg-config; }; } \
    > .venv/apt-grpc.log 2>&1 \
    || echo "setup: libgrpc++-dev not installed (see .venv/apt-grpc.log); the lighthouse will use grpcio"
fi
# iptables for the multi-host tests' packet-loss fault (they skip that case without it).
if ! command -v iptables >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  { timeout 600 apt-get install -y -qq iptables iproute2 \
    || { timeout 300 apt-get update -qq && timeout 600 apt-get install -y -qq iptables iproute2; }; } \
    > .venv/apt-iptables.log 2>&1 \
    || echo "setup: iptables not installed (see .venv/apt-iptables.log); the packet-loss test will skip"
fi
# Headless Chromium for the dashboard's browser tests: rendering, and the CSRF attack from a
# page of another origin (tests/security; they skip without it).
if ! { command -v chromium && command -v chromedriver; } >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  { timeout 900 apt-get install -y -qq chromium chromium-driver \
    || { timeout 300 apt-get update -qq && timeout 900 apt-get install -y -qq chromium chromium-driver; }; } \
    > .venv/apt-chromium.log 2>&1 \
    || echo "setup: chromium not installed (see .venv/apt-chromium.log); the browser tests will skip"
fi
# The build switches of setup.py (docs/building.md, "Build switches": MAX_JOBS, DEBUG, USE_NCCL, ...)
# pass through from the environment.
.venv/bin/python setup.py build_ext --inplace > .venv/build.log 2>&1 \
  || { tail -50 .venv/build.log >&2; echo "setup: build failed (log: .venv/build.log)" >&2; exit 1; }
.venv/bin/python -c "import ft, ft.coordination.rpc_server as r; print('ft ready: torch', __import__('torch').__version__, '| NCCL:', ft._C.has_nccl, '| native gRPC server:', r.native_available())"
