#!/usr/bin/env bash
# Build llama.cpp's own OpenAI-compatible server (`llama-server`: continuous batching over -np slots)
# for the serving bench (bench/serving_bench.py, issue 45), from the same vendored llama.cpp source the
# whole-model bench measures (bench/llama_setup.sh unpacks it), into that environment:
#   $QUANTREG_LLAMA_ENV/llama-server/bin/llama-server
# llama-cpp-python's own server serialises requests, so it is not the fair peer under load.
# Same ISA flags as llama_setup.sh (native; AMX off, see there). Idempotent: a binary built with the
# same flags is left as it is (marker file .ready beside it). ~10-20 min on 2 cores.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ENV_DIR=${QUANTREG_LLAMA_ENV:-$HOME/.cache/quantreg-bench/llama-venv}
"$HERE/llama_setup.sh"  # the environment and the unpacked sdist (idempotent)
FLAGS=(-DGGML_NATIVE=ON -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_CURL=OFF
       -DCMAKE_BUILD_TYPE=Release)
if grep -q 'amx_tile' /proc/cpuinfo 2>/dev/null; then
  FLAGS+=("-DCMAKE_C_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" "-DCMAKE_CXX_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16")
fi
OUT="$ENV_DIR/llama-server"
WANT="${FLAGS[*]}"
if [ -x "$OUT/bin/llama-server" ] && [ -f "$OUT/.ready" ] && [ "$(cat "$OUT/.ready")" = "$WANT" ]; then
  echo "llama_server_setup: $OUT/bin/llama-server ready already"
  exit 0
fi
SRC=$(ls -d "$ENV_DIR"/src/llama_cpp_python-*/vendor/llama.cpp | head -1)
[ -f "$SRC/CMakeLists.txt" ] || { echo "llama_server_setup: no vendored llama.cpp under $ENV_DIR/src" >&2; exit 1; }
mkdir -p "$OUT/bin"
cmake -S "$SRC" -B "$OUT/build" "${FLAGS[@]}" > "$OUT/cmake.log" 2>&1 || { tail -30 "$OUT/cmake.log" >&2; exit 1; }
cmake --build "$OUT/build" --target llama-server -j "$(nproc)" > "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log" >&2; exit 1; }
cp "$OUT/build/bin/llama-server" "$OUT/bin/llama-server"
"$OUT/bin/llama-server" --version 2>&1 | head -3
echo "$WANT" > "$OUT/.ready"
echo "llama_server_setup: $OUT/bin/llama-server ready"
