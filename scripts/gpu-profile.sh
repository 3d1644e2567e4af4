#!/usr/bin/env bash
# On a GPU host: per-kernel GPU time of a short decode under Nsight Compute, for the
# synthetic TinyLlama-shape models (made here as in gpu-compare-llama.sh), and the
# decode's host-side breakdown (examples/gpu_decode if GPU_DECODE is set).
#   BIN=... VOCAB=... [TYPES="f16 q4_0 q4_k_m"] [GPU_DECODE=path] scripts/gpu-profile.sh
set -uo pipefail
BIN="${BIN:-.gpu/rustorch}"
DIR="${DIR:-/tmp/gpu-compare}"
VOCAB="${VOCAB:-models/vocab/ggml-vocab-llama-spm.gguf}"
mkdir -p "$DIR"
f16="$DIR/tinyllama-f16.gguf"
[ -f "$f16" ] || "$BIN" make-model --shape tinyllama --type f16 --seed 1 --vocab "$VOCAB" "$f16" >/dev/null
for t in ${TYPES:-f16 q4_0 q4_k_m}; do
  m="$DIR/tinyllama-$t.gguf"
  [ -f "$m" ] || "$BIN" quantize "$f16" "$m" "${t^^}" "$(nproc)" > /dev/null 2>&1
  echo "== $t"
  if [ -n "${GPU_DECODE:-}" ]; then "$GPU_DECODE" "$m" 128 16 2>&1 | tail -3; fi
  for mode in ${MODES:-warp}; do
  echo "-- RUSTORCH_CUDA_DECODE=$mode"
  RUSTORCH_CUDA_DECODE=$mode ncu --clock-control none --metrics gpu__time_duration.sum --csv \
    "$BIN" run -m "$m" -p "Hello there" -n 8 --temp 0 --device cuda \
    > "$DIR/ncu-$t.csv" 2>/dev/null
  python3 - "$DIR/ncu-$t.csv" <<'PY'
import csv, sys, io
rows = [l for l in open(sys.argv[1]) if l.startswith('"')]
tot = {}
for x in csv.DictReader(io.StringIO("".join(rows))):
    if x.get("Metric Name") != "gpu__time_duration.sum": continue
    key = (x["Kernel Name"].split("(")[0], x.get("Grid Size", ""))
    v = float(x["Metric Value"].replace(",", ""))
    us = v * {"nsecond": 1e-3, "usecond": 1.0, "msecond": 1e3}.get(x.get("Metric Unit", "nsecond"), 1e-3)
    t = tot.setdefault(key, [0, 0.0]); t[0] += 1; t[1] += us
s = sum(v[1] for v in tot.values())
for (n, g), (inv, us) in sorted(tot.items(), key=lambda kv: -kv[1][1])[:16]:
    print(f"{n:28s} grid {g:18s} {inv:5d} x {us/inv:7.2f} us  {100*us/s:5.1f}%")
print(f"total kernel time {s:.0f} us")
PY
  done
done
