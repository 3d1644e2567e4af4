#!/usr/bin/env bash
# Build llama.cpp from the llama-cpp-python 0.3.36 sdist into a cache outside the repo
# (default ~/.cache/rustorch): shared libraries for the Python bindings that record
# reference fixtures, and llama-bench / llama-completion / llama-tokenize /
# llama-perplexity / llama-quantize for side-by-side runs.
#
# AMX is disabled: on the development VM the CPU reports AMX but llama.cpp's AMX
# matmul crashes (SIGSEGV in ggml_backend_amx_mul_mat); everything else is -march=native.
set -euo pipefail
cache="${RUSTORCH_CACHE:-$HOME/.cache/rustorch}"
mkdir -p "$cache"
src="$cache/llama_cpp_python-0.3.36"
if [ ! -d "$src" ]; then
  tmp=$(mktemp -d)
  python3 -m pip download --quiet --no-deps --no-binary llama-cpp-python -d "$tmp" llama-cpp-python==0.3.36
  tar -xzf "$tmp"/llama_cpp_python-0.3.36.tar.gz -C "$cache"
  rm -rf "$tmp"
fi
python3 -m pip install --quiet cmake numpy diskcache gguf jinja2 >/dev/null
flags="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
cmake -S "$src/vendor/llama.cpp" -B "$cache/lcpp-build" -DCMAKE_BUILD_TYPE=Release \
  -DBUILD_SHARED_LIBS=ON -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF \
  "-DCMAKE_C_FLAGS=$flags" "-DCMAKE_CXX_FLAGS=$flags" >/dev/null
cmake --build "$cache/lcpp-build" -j"$(nproc)" --target llama-completion llama-tokenize \
  llama-bench llama-quantize llama-perplexity llama >/dev/null
echo "llama.cpp built in $cache/lcpp-build/bin"
echo "  export LLAMA_CPP_LIB_PATH=$cache/lcpp-build/bin PYTHONPATH=$src"
