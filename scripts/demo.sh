#!/usr/bin/env bash
# The README's main-job command: set up .venv, then run `quantreg demo`.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
exec "${QUANTREG_VENV:-.venv}/bin/quantreg" demo "$@"
