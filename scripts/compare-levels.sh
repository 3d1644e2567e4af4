#!/usr/bin/env bash
# scripts/compare-llama-bench.sh at every x86 feature level this CPU has (issue #16): the
# full level, AVX-512 without FP16 (where the CPU has AVX512-FP16), and AVX2, each with
# llama.cpp built for that level and rustorch forced to it (RUSTORCH_NO_AVX512FP16=1,
# RUSTORCH_ISA=avx2), same models, alternating rounds. Works on a host without network
# (e.g. the GPU host): llama.cpp comes from the sdist's llama.cpp folder or the tarball of
# `scripts/build-llama-cpp-cuda.sh --pack`, only `llama-bench`, CPU only.
#
#   scripts/compare-levels.sh --src SRC_DIR_OR_TARBALL --build DIR --rustorch BIN \
#       [--levels full,avx512,avx2] [COMPARE-LLAMA-BENCH ARGS...]
#
# e.g. `scripts/compare-levels.sh --src lcpp.tar.xz --build /tmp/lc --rustorch rustorch
# -m models/SmolLM2-135M-Instruct.Q4_1.gguf -r 3 --rounds 2`. A level's llama-bench already
# in DIR/LEVEL/bin is reused. Every level's build keeps AMX off (llama.cpp's AMX kernels
# crashed on a Sapphire Rapids VM); the AVX2 build is GGML_NATIVE=OFF with AVX2, FMA, F16C
# and BMI2. Where `rustorch make-model` stands in for a model (a host without the Qwen
# files: `--shape qwen2.5-0.5b|qwen2.5-1.5b`, then `rustorch quantize ... Q4_K_M`), say so
# beside the table.
set -euo pipefail
cd "$(dirname "$0")/.."
src=""
build=""
ours=""
levels=""
rest=()
while [ $# -gt 0 ]; do
  case "$1" in
    --src) src="$2"; shift 2 ;;
    --build) build="$2"; shift 2 ;;
    --rustorch) ours="$2"; shift 2 ;;
    --levels) levels="$2"; shift 2 ;;
    -h|--help) sed -n '2,19p' "$0"; exit 0 ;;
    *) rest+=("$1"); shift ;;
  esac
done
[ -n "$build" ] && [ -n "$ours" ] || { echo "--build and --rustorch are required" >&2; exit 2; }
flags=$(grep -m1 '^flags' /proc/cpuinfo || true)
has() { [[ " $flags " == *" $1 "* ]]; }
if [ -z "$levels" ]; then
  levels=full
  if has avx512f && has avx512_fp16; then levels+=",avx512"; fi
  if has avx512f; then levels+=",avx2"; fi
fi
echo "CPU: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//'); levels: $levels" >&2

if [ -n "$src" ] && [ -f "$src" ]; then
  mkdir -p "$build/src"
  [ -f "$build/src/CMakeLists.txt" ] || tar -xJf "$src" -C "$build/src"
  src="$build/src"
fi
amx="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
build_level() {
  local lv="$1" extra=() cf="$amx"
  case "$lv" in
    full) extra=(-DGGML_NATIVE=ON) ;;
    avx512) extra=(-DGGML_NATIVE=ON); cf="$amx -mno-avx512fp16" ;;
    avx2) extra=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
                 -DGGML_BMI2=ON -DGGML_AVX512=OFF); cf="" ;;
    *) echo "unknown level $lv" >&2; exit 2 ;;
  esac
  [ -x "$build/$lv/bin/llama-bench" ] && return 0
  [ -n "$src" ] || { echo "no llama-bench in $build/$lv/bin and no --src" >&2; exit 1; }
  echo "building llama.cpp for $lv" >&2
  cmake -S "$src" -B "$build/$lv" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF \
    -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF "${extra[@]}" \
    "-DCMAKE_C_FLAGS=$cf" "-DCMAKE_CXX_FLAGS=$cf" > "$build/$lv.cmake.log" 2>&1
  cmake --build "$build/$lv" -j"$(nproc)" --target llama-bench > "$build/$lv.build.log" 2>&1
}
IFS=, read -r -a lvs <<< "$levels"
for lv in "${lvs[@]}"; do build_level "$lv"; done
for lv in "${lvs[@]}"; do
  case "$lv" in
    full) env_arg=() ;;
    avx512) env_arg=(--env RUSTORCH_NO_AVX512FP16=1) ;;
    avx2) env_arg=(--env RUSTORCH_ISA=avx2) ;;
  esac
  echo "## level: $lv"
  scripts/compare-llama-bench.sh --no-load --rustorch "$ours" \
    --llama-bench "$build/$lv/bin/llama-bench" "${env_arg[@]}" "${rest[@]}"
  echo
done
