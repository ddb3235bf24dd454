#!/usr/bin/env bash
# Build the llama.cpp side of the whole-model bench (bench/wholemodel_bench.py) into its OWN
# environment, outside the repository: llama.cpp is the engine quantreg is compared against, not a
# dependency, and its build (cmake + g++ of the vendored llama.cpp, ~10-30 min on 2 cores) must not
# touch quantreg's .venv or CI.
#   QUANTREG_LLAMA_ISA   native (default: the host's ISA) or avx2: the generic x86-64 build with
#                        AVX2/FMA/F16C and no AVX-512 (-DGGML_NATIVE=OFF), what an AVX2-only host
#                        runs; on an AVX-512 host it stands in for that host kind's llama.cpp beside
#                        quantreg's kernels forced to AVX2 (docs/benchmarks.md)
#   QUANTREG_LLAMA_ENV   directory of that environment (default ~/.cache/quantreg-bench/llama-venv,
#                        llama-venv-avx2 for QUANTREG_LLAMA_ISA=avx2)
# It holds: the virtualenv (llama-cpp-python 0.3.36 built with -DGGML_NATIVE=ON, gguf 0.19.0, and
# what llama.cpp's converter imports) and src/ = the unpacked llama-cpp-python sdist, whose
# vendor/llama.cpp/convert_hf_to_gguf.py is the converter the bench runs (never committed here).
# Idempotent: a finished environment is left as it is (marker file .ready).
set -euo pipefail
ISA=${QUANTREG_LLAMA_ISA:-native}
case "$ISA" in
  native) ENV_DIR=${QUANTREG_LLAMA_ENV:-$HOME/.cache/quantreg-bench/llama-venv} ;;
  avx2) ENV_DIR=${QUANTREG_LLAMA_ENV:-$HOME/.cache/quantreg-bench/llama-venv-avx2} ;;
  *) echo "llama_setup: QUANTREG_LLAMA_ISA must be native or avx2, got '$ISA'" >&2; exit 2 ;;
esac
PY=${PYTHON:-python3}
LLAMA_VERSION=0.3.36
GGUF_VERSION=0.19.0
# The engine is built for the host's ISA (-DGGML_NATIVE=ON) except AMX: llama.cpp's AMX back-end
# (ggml_backend_amx_mul_mat, used when the compiler targets AMX-INT8) segfaults at the first
# forward on the AMX host kind (measured here on GPT-OSS GGUFs at 20B width, 1 or 2 threads, every
# layer count; upstream ggml-org/llama.cpp#20824, fix proposed in #26954). Without it llama.cpp
# runs its AVX-512-VNNI repacked kernels, as on AVX-512 hosts without AMX; the bench's JSON keeps
# llama.cpp's own system line, which says AMX_INT8 = 0.
CMAKE_ARGS_WANTED="-DGGML_NATIVE=ON"
if [ "$ISA" = avx2 ]; then
  # ggml's own defaults without GGML_NATIVE: SSE4.2, AVX, AVX2, BMI2, FMA, F16C on, AVX-512 off.
  CMAKE_ARGS_WANTED="-DGGML_NATIVE=OFF -DGGML_AVX512=OFF"
elif grep -q 'amx_tile' /proc/cpuinfo 2>/dev/null; then
  NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
  CMAKE_ARGS_WANTED="$CMAKE_ARGS_WANTED -DCMAKE_C_FLAGS='$NO_AMX' -DCMAKE_CXX_FLAGS='$NO_AMX'"
fi
if [ -f "$ENV_DIR/.ready" ] && [ "$(cat "$ENV_DIR/.ready")" = "$CMAKE_ARGS_WANTED" ]; then
  echo "llama_setup: $ENV_DIR ready already"
  exit 0
fi
mkdir -p "$ENV_DIR"
[ -x "$ENV_DIR/bin/python" ] || "$PY" -m venv "$ENV_DIR"
PIP="$ENV_DIR/bin/python -m pip"
$PIP install -q --upgrade pip
# Build back-end first (wheels), so the sdist's metadata and build run without an isolated build
# environment (which, with --no-binary, would compile the back-end's own dependencies too).
$PIP install -q "scikit-build-core[pyproject]>=0.9.2"
# The sdist once, from the registry (pip's cache serves it again): built from this file and unpacked
# so the bench can run the vendored converter of exactly the llama.cpp it measures.
mkdir -p "$ENV_DIR/sdist" "$ENV_DIR/src"
$PIP download -q --no-deps --no-binary llama-cpp-python --no-build-isolation -d "$ENV_DIR/sdist" "llama-cpp-python==$LLAMA_VERSION"
SDIST=$(ls "$ENV_DIR"/sdist/llama_cpp_python-"$LLAMA_VERSION".tar.gz)
tar -xzf "$SDIST" -C "$ENV_DIR/src"
# The converter's imports (torch from the same pinned CPU build quantreg's .venv uses).
$PIP install -q "gguf==$GGUF_VERSION" numpy safetensors sentencepiece protobuf "transformers<5.18" "torch==2.13.0"
# llama-cpp-python's own runtime dependencies (its pyproject's list): the engine is installed with
# --no-deps below (so pip never swaps torch or numpy), so they are named here; without them
# `import llama_cpp` fails after the whole build ("No module named 'diskcache'", measured).
$PIP install -q "typing-extensions>=4.5.0" "numpy>=1.20.0" "diskcache>=5.6.1" "jinja2>=2.11.3"
# The engine itself, at the ISA chosen above (native: AVX-512 where the host has it).
CMAKE_ARGS="$CMAKE_ARGS_WANTED" $PIP install -q --no-build-isolation --force-reinstall --no-deps "$SDIST"
"$ENV_DIR/bin/python" -c "import llama_cpp, gguf; print('llama_setup: llama_cpp', llama_cpp.__version__, 'gguf ok'); print(llama_cpp.llama_print_system_info().decode())"
echo "$CMAKE_ARGS_WANTED" > "$ENV_DIR/.ready"  # a change of build flags rebuilds
echo "llama_setup: $ENV_DIR ready"
