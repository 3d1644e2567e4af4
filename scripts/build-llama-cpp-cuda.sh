#!/usr/bin/env bash
# Build llama.cpp's CUDA backend from the llama-cpp-python 0.3.36 sdist, kept short as
# the GPU issue asks: only `llama-bench` and `llama-perplexity`, only sm_90 (H100/H200),
# `-DGGML_CUDA=ON`. For a GPU host without network: SRC is the sdist's llama.cpp folder or
# a tarball of it (`scripts/build-llama-cpp-cuda.sh --pack OUT.tar.xz` makes one here,
# about 4 MB, without the other backends, models and docs).
#
#   scripts/build-llama-cpp-cuda.sh SRC_DIR_OR_TARBALL BUILD_DIR [CMAKE_ARG...]
#   scripts/build-llama-cpp-cuda.sh --pack OUT.tar.xz
#
# Extra arguments go to cmake: `-DBUILD_SHARED_LIBS=OFF` gives one self-contained
# `llama-bench` that can be stripped, packed and carried back to the GPU host later.
#
# AMX is disabled as in build-llama-cpp.sh (llama.cpp's AMX matmul crashed on an SPR VM);
# the CPU side is otherwise -march=native, so `CUDA_VISIBLE_DEVICES= llama-perplexity`
# is the same binary's CPU reference.
set -euo pipefail
sdist="${RUSTORCH_CACHE:-$HOME/.cache/rustorch}/llama_cpp_python-0.3.36/vendor/llama.cpp"
if [ "${1:-}" = "--pack" ]; then
  out="$(realpath -m "${2:?--pack OUT.tar.xz}")"
  cd "$sdist"
  tar -cJf "$out" --exclude='ggml/src/ggml-sycl' --exclude='ggml/src/ggml-vulkan' \
    --exclude='ggml/src/ggml-opencl' --exclude='ggml/src/ggml-metal' \
    --exclude='ggml/src/ggml-hexagon' --exclude='ggml/src/ggml-et' \
    --exclude='ggml/src/ggml-cann' --exclude='ggml/src/ggml-musa' \
    --exclude='ggml/src/ggml-webgpu' --exclude='ggml/src/ggml-zdnn' \
    --exclude='tools/ui' --exclude='tools/server/public*' --exclude='*.gguf' \
    CMakeLists.txt cmake include src common vendor ggml tools licenses LICENSE
  echo "packed $out"
  exit 0
fi
src="${1:?usage: build-llama-cpp-cuda.sh SRC_DIR_OR_TARBALL BUILD_DIR}"
build="${2:?usage: build-llama-cpp-cuda.sh SRC_DIR_OR_TARBALL BUILD_DIR}"
if [ -f "$src" ]; then
  mkdir -p "$build/src"
  tar -xJf "$src" -C "$build/src"
  src="$build/src"
fi
flags="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
cmake -S "$src" -B "$build" -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON \
  -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
  -DLLAMA_BUILD_APP=OFF "-DCMAKE_C_FLAGS=$flags" "-DCMAKE_CXX_FLAGS=$flags" "${@:3}" >/dev/null
cmake --build "$build" -j"$(nproc)" --target llama-bench llama-perplexity
echo "llama.cpp CUDA built in $build/bin"
