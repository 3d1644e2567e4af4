#!/usr/bin/env bash
# On a GPU host: rustorch against llama.cpp's CUDA build on the same GPU, in one session.
# Steps (any subset, in this order):
#   build   start building llama.cpp CUDA (scripts/build-llama-cpp-cuda.sh) in the background
#   models  the synthetic TinyLlama-shape models: `rustorch make-model` F16 (seed 1), then
#           `rustorch quantize` (llama-quantize's recipe, byte-identical) to Q8_0, Q4_0, Q4_K_M
#   ours    scripts/gpu-check.sh on them (GPU tests if TEST_BIN is set, diff, bench)
#   wait    wait for the llama.cpp build
#   theirs  llama-bench -ngl 99 -fa 1 -p 512 -n 128 on each model
#   alternate  llama-bench and `rustorch bench --device cuda` (-p 512 -n 128 -r 5) one after
#           the other on each model, two rounds: t/s means, pp512 and tg128
#   kl      KL-divergence of GPU against CPU for both engines, llama-perplexity's method
#           (-c 512, 4 chunks of TEXT): each engine's CPU writes a base file, its GPU reads it;
#           our GPU is also scored against llama.cpp's CPU base (the formats are the same)
#   env: BIN (stripped rustorch), VOCAB (llama-spm vocabulary GGUF), LCPP_SRC (tarball or folder), DIR (work dir), TEXT, MODELS
#        (extra GGUFs for the kl step, comma-separated), OUT (logs), TEST_BIN
set -uo pipefail
BIN="${BIN:-.gpu/rustorch}"
DIR="${DIR:-/tmp/gpu-compare}"
LCPP="$DIR/lcpp"
OUT="${OUT:-$DIR/out}"
TEXT="${TEXT:-$DIR/text.txt}"
VOCAB="${VOCAB:-models/vocab/ggml-vocab-llama-spm.gguf}"
mkdir -p "$DIR" "$OUT"
[ -f "$TEXT" ] || cat docs/parity.md docs/architecture.md docs/performance.md > "$TEXT"
types=(f16 q8_0 q4_0 q4_k_m)
models=()
for t in "${types[@]}"; do models+=("$DIR/tinyllama-$t.gguf"); done
IFS=, read -r -a extra <<< "${MODELS:-}"

for step in "$@"; do
  echo "== $step ($(date +%T))"
  case "$step" in
    build)
      setsid nohup scripts/build-llama-cpp-cuda.sh "${LCPP_SRC:-.gpu/lcpp-src.tar.xz}" "$LCPP" \
        > "$DIR/lcpp-build.log" 2>&1 < /dev/null &
      ;;
    models)
      f16="$DIR/tinyllama-f16.gguf"
      [ -f "$f16" ] || "$BIN" make-model --shape tinyllama --type f16 --seed 1 \
        --vocab "$VOCAB" "$f16"
      for t in q8_0 q4_0 q4_k_m; do
        m="$DIR/tinyllama-$t.gguf"
        [ -f "$m" ] || "$BIN" quantize "$f16" "$m" "${t^^}" "$(nproc)" > "$DIR/quantize-$t.log" 2>&1
      done
      ls -la "$DIR"/*.gguf
      ;;
    ours)
      args=()
      [ -n "${TEST_BIN:-}" ] && args+=(--test "$TEST_BIN")
      scripts/gpu-check.sh "$BIN" --dir "$DIR" --types "$(IFS=,; echo "${types[*]}")" "${args[@]}" -r 5 \
        2>&1 | tee "$OUT/ours.log"
      ;;
    wait)
      while ! grep -q "llama.cpp CUDA built" "$DIR/lcpp-build.log" 2>/dev/null; do
        if ! pgrep -f build-llama-cpp-cuda > /dev/null; then
          echo "llama.cpp build stopped:"; tail -20 "$DIR/lcpp-build.log"; exit 1
        fi
        sleep 5
      done
      tail -2 "$DIR/lcpp-build.log"
      ;;
    theirs)
      for m in "${models[@]}"; do
        "$LCPP/bin/llama-bench" -m "$m" -ngl 99 -fa 1 -p 512 -n 128 -r 5 -o md 2>/dev/null \
          | tee -a "$OUT/theirs.log"
      done
      ;;
    alternate)
      for r in 1 2; do
        for m in "${models[@]}"; do
          l=$("$LCPP/bin/llama-bench" -m "$m" -ngl 99 -fa 1 -p 512 -n 128 -r 5 -o csv 2>/dev/null \
            | awk -F, 'NR>1{gsub(/"/,""); print $(NF-1)}' | tr '\n' ' ')
          o=$("$BIN" bench -m "$m" --device cuda -p 512 -n 128 -r 5 2>&1 \
            | grep -E "pp512|tg128" | awk -F'|' '{print $(NF-1)}' | tr -s ' ' | tr '\n' ' ')
          echo "$(basename "$m" .gguf) round $r llama.cpp (pp512, tg128): $l| rustorch: $o" \
            | tee -a "$OUT/alternate.log"
        done
      done
      ;;
    kl)
      for m in "${models[@]}" "${extra[@]}"; do
        [ -n "$m" ] || continue
        b="$DIR/$(basename "$m" .gguf)"
        CUDA_VISIBLE_DEVICES= "$LCPP/bin/llama-perplexity" -m "$m" -f "$TEXT" -c 512 --chunks 4 \
          -ngl 0 -t "$(nproc)" --kl-divergence-base "$b.lcpp-cpu.kld" > "$b.lcpp-cpu.log" 2>&1
        "$LCPP/bin/llama-perplexity" -m "$m" -ngl 99 -fa on --kl-divergence \
          --kl-divergence-base "$b.lcpp-cpu.kld" > "$b.lcpp-gpu.log" 2>&1
        "$BIN" perplexity -m "$m" --device cpu -f "$TEXT" -c 512 --chunks 4 \
          --kl-divergence-base "$b.ours-cpu.kld" > "$b.ours-cpu.log" 2>&1
        "$BIN" perplexity -m "$m" --device cuda --kl-divergence \
          --kl-divergence-base "$b.ours-cpu.kld" > "$b.ours-gpu.log" 2>&1
        "$BIN" perplexity -m "$m" --device cuda --kl-divergence \
          --kl-divergence-base "$b.lcpp-cpu.kld" > "$b.ours-gpu-vs-lcpp-cpu.log" 2>&1
        for k in lcpp-gpu ours-gpu ours-gpu-vs-lcpp-cpu; do
          kld=$(grep -m1 -E "^Mean +KLD" "$b.$k.log" | awk '{print $3, $4, $5}')
          top=$(grep -m1 -E "^Same top" "$b.$k.log" | awk '{print $4, $5, $6}')
          echo "| $(basename "$m") | $k | $kld | $top |" | tee -a "$OUT/kl.log"
        done
        cp "$b".*.log "$OUT/" 2>/dev/null || true
      done
      ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
done
