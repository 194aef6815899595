#!/usr/bin/env bash
# Sets everything up from nothing (venv, torch, build) and runs the whole test suite.
# Tests start their own servers (TCPStore, lighthouse, manager servers, HTTP) on loopback.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Headless Chromium for the dashboard test; the test skips with a message if absent.
if ! command -v chromium >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  (timeout 300 apt-get update -qq && timeout 600 apt-get install -y -qq chromium chromium-driver) \
    > .venv/apt.log 2>&1 || echo "test: chromium not installed (see .venv/apt.log); the dashboard screenshot test will skip"
fi
exec .venv/bin/python -m pytest -q -p no:cacheprovider tests "$@"
