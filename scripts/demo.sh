#!/usr/bin/env bash
# Sets everything up from nothing and runs the main demo.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if [ -f ft/launch/cli.py ] && [ -f examples/train_ddp.py ]; then
  exec .venv/bin/python -m ft.launch.cli --replicas 3 --chaos kill --every 5 --max-steps 2000 -- examples/train_ddp.py
else
  exec .venv/bin/python -m examples.backend_demo
fi
