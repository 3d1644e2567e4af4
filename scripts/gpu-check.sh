#!/usr/bin/env bash
# On a GPU host, with the stripped release binary: make the synthetic TinyLlama-shape
# benchmark models (seeded random weights, made by `rustorch make-model`), run the GPU test
# binary if given (crates/rustorch-llm/tests/gpu.rs: GPU against CPU, KL / top-1 / greedy),
# `rustorch diff` CPU against CUDA on each model, and `rustorch bench --device cuda`, then
# print the table last: t/s and the fraction of the bandwidth floor (bytes of weights + KV
# read per token ÷ the device's copy rate, 3.0 TB/s on an H100 SXM unless BW_GBS says), and
# tg128 with the CPU's arithmetic (--gpu-exact) beside it.
#
#   scripts/gpu-check.sh BIN [--vocab models/vocab/ggml-vocab-llama-spm.gguf] [--dir /tmp/gpu-check]
#                            [--types f16,q8_0,q4_0,q4_k] [--test GPU_TEST_BIN] [-r 5]
set -euo pipefail
bin="${1:?usage: scripts/gpu-check.sh BIN [options]}"
shift
vocab="models/vocab/ggml-vocab-llama-spm.gguf"
dir="/tmp/gpu-check"
types="f16,q8_0,q4_0,q4_k"
test_bin=""
reps=5
while [ $# -gt 0 ]; do
  case "$1" in
    --vocab) vocab="$2"; shift 2 ;;
    --dir) dir="$2"; shift 2 ;;
    --types) types="$2"; shift 2 ;;
    --test) test_bin="$2"; shift 2 ;;
    -r) reps="$2"; shift 2 ;;
    *) echo "gpu-check: unknown argument $1" >&2; exit 2 ;;
  esac
done
bw="${BW_GBS:-3000}"
mkdir -p "$dir"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true

models=()
for t in ${types//,/ }; do
  m="$dir/tinyllama-$t.gguf"
  [ -f "$m" ] || "$bin" make-model --shape tinyllama --type "$t" --seed 1 --vocab "$vocab" "$m"
  models+=("$m")
done

# (a failing test is reported at the end, after the diff and the table, and makes the exit
# code 1: gpu_matches_cpu holds the default arithmetic to the issue's bar, which the 8-bit
# synthetic models miss, see docs/performance.md; --gpu-exact's tests are the bar's proof)
failed=()
if [ -n "$test_bin" ]; then
  echo "== GPU tests"
  RUSTORCH_GPU_MODELS="$(IFS=,; echo "${models[*]}")" "$test_bin" --nocapture \
    || failed+=("GPU tests")
  echo "== the persistent decode kernel against graph replays (bit for bit)"
  RUSTORCH_CUDA_MEGA=1 RUSTORCH_GPU_MODELS="$(IFS=,; echo "${models[*]}")" \
    "$test_bin" megakernel_equals_graphs --nocapture || failed+=("megakernel_equals_graphs")
fi

for m in "${models[@]}"; do
  echo "== diff CPU vs CUDA: $m"
  "$bin" diff -m "$m" -p "The capital of France is" --a cpu --b cuda | tail -3 || true
done

rows=()
for m in "${models[@]}"; do
  json="${m%.gguf}.bench.json"
  "$bin" bench -m "$m" --device cuda -p 512 -n 128 -r "$reps" -o json > "$json"
  # decode with the CPU's arithmetic (--gpu-exact), for the last column
  "$bin" bench -m "$m" --device cuda -p 0 -n 128 -r "$reps" -o json --gpu-exact \
    > "${m%.gguf}.exact.json" 2>/dev/null
  rows+=("$(python3 - "$m" "$bw" "$json" "${m%.gguf}.exact.json" <<'EOF'
import json, os, sys
m, bw, path = sys.argv[1], float(sys.argv[2]) * 1e9, sys.argv[3]
exact = json.load(open(sys.argv[4]))[0]["avg_ts"]
res = json.load(open(path))
pp = next(r for r in res if r["n_prompt"] > 0)
tg = next(r for r in res if r["n_gen"] > 0)
# bytes read per generated token: every weight once, plus the K/V cells written so far
# (on average half of the 128, each kv_cache_bytes / n_gen bytes)
per_cell = tg["kv_cache_bytes"] / max(1, tg["n_gen"])
floor = bw / (tg["model_size"] + per_cell * tg["n_gen"] / 2)
print(f"| {os.path.basename(m)} | {tg['gpu_info']} | {pp['avg_ts']:.1f} | {tg['avg_ts']:.1f} | {floor:.0f} | {tg['avg_ts'] / floor:.2f} | {exact:.1f} |")
EOF
)")
done
echo
echo "| model | GPU | pp512 t/s | tg128 t/s | tg floor t/s (${bw} GB/s) | fraction of floor | tg128 --gpu-exact |"
echo "| --- | --- | ---: | ---: | ---: | ---: | ---: |"
printf '%s\n' "${rows[@]}"
if [ ${#failed[@]} -gt 0 ]; then
  echo "gpu-check: failed: ${failed[*]} (see above)" >&2
  exit 1
fi
