#!/usr/bin/env bash
# On a GPU host: one variant of the GPU path (environment assignments, e.g.
# "RUSTORCH_CUDA_NORM_TAIL=1") against the same binary without it, on the given models:
# first the variant through the bit-exactness test (exact mode), then tg128 benches
# alternating base / variant for ROUNDS rounds, then a table of both and their ratio.
#   BIN=path/rustorch GPU_TEST=path/gpu-test-binary [ROUNDS=2] [EXACT=1] \
#     scripts/gpu-ab.sh "VAR=VALUE ..." MODEL...
# GPU_TEST is the stripped `cargo test --release -p rustorch-llm --test gpu --no-run`
# binary (run from the repository root: it reads RUSTORCH_ROOT=.); EXACT=0 benches the
# default arithmetic instead and skips the test.
set -uo pipefail
BIN="${BIN:?set BIN to the rustorch binary}"
VARIANT="${1:?the variant, e.g. RUSTORCH_CUDA_NORM_TAIL=1}"
shift
[ $# -gt 0 ] || { echo "usage: scripts/gpu-ab.sh \"VAR=VALUE ...\" MODEL..." >&2; exit 2; }
ROUNDS="${ROUNDS:-2}"
EXACT="${EXACT:-1}"
flag=""
[ "$EXACT" = 1 ] && flag="--gpu-exact"
if [ "$EXACT" = 1 ] && [ -n "${GPU_TEST:-}" ]; then
  models=$(IFS=,; echo "$*")
  echo "== bit-exactness with $VARIANT"
  env $VARIANT RUSTORCH_ROOT=. RUSTORCH_GPU_MODELS="$models" "$GPU_TEST" gpu_exact_equals_cpu \
    --nocapture 2>&1 | grep -E "gpu-exact|test result|panicked|rror"
fi
tg() {  # tg128 t/s of model $1 with environment $2
  env $2 "$BIN" bench -m "$1" --device cuda -p 0 -n 128 -r 5 $flag 2>&1 \
    | grep -E 'tg[0-9]' | awk -F'|' '{print $(NF-1)}' | awk '{print $1}'
}
declare -A base var
for r in $(seq "$ROUNDS"); do
  for m in "$@"; do
    b=$(tg "$m" ""); v=$(tg "$m" "$VARIANT")
    echo "round $r $(basename "$m"): base $b, variant $v"
    base[$m]="${base[$m]:-} $b"; var[$m]="${var[$m]:-} $v"
  done
done
echo
echo "| model | base (t/s) | $VARIANT (t/s) | ratio of medians |"
echo "| --- | --- | --- | ---: |"
for m in "$@"; do
  python3 - "$(basename "$m")" "${base[$m]}" "${var[$m]}" <<'PY'
import statistics, sys
name, b, v = sys.argv[1], sys.argv[2].split(), sys.argv[3].split()
try:
    r = statistics.median(map(float, v)) / statistics.median(map(float, b))
    print(f"| {name} | {', '.join(b)} | {', '.join(v)} | {r:.3f} |")
except (ValueError, statistics.StatisticsError):
    print(f"| {name} | {', '.join(b)} | {', '.join(v)} | (a bench failed) |")
PY
done
