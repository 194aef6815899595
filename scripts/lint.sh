#!/usr/bin/env bash
# Lint and layout checks of the whole tree (CI runs this; run it before committing):
#   ruff check         Python lint (rules in pyproject.toml, [tool.ruff.lint])
#   ruff format        Python layout (pyproject.toml, [tool.ruff.format])
#   clang-format       C++ layout of csrc/ (.clang-format)
# With --fix it rewrites what the tools can fix instead of failing on it.
# The tools are pinned in constraints.txt and installed by scripts/setup.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${FT_LINT_BIN:-.venv/bin}
mapfile -t CXX < <(git ls-files 'csrc/*.cpp' 'csrc/*.hpp' 'csrc/**/*.cpp' 'csrc/**/*.hpp' | sort -u)
if [ "${1:-}" = "--fix" ]; then
  "$BIN/ruff" check --fix .
  "$BIN/ruff" format .
  "$BIN/clang-format" -i "${CXX[@]}"
  exit 0
fi
status=0
"$BIN/ruff" check --output-format concise . || status=1
"$BIN/ruff" format --check . || status=1
"$BIN/clang-format" --dry-run --Werror "${CXX[@]}" || status=1
if [ "$status" != 0 ]; then
  echo "lint: failed (bash scripts/lint.sh --fix rewrites what the tools can fix)" >&2
fi
exit "$status"
