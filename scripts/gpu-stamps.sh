#!/usr/bin/env bash
# On a GPU host: where a real decode step's time goes, launch by launch. Runs the
# gpu_decode example (built with `cargo build --release -p rustorch-llm --example
# gpu_decode`) with kernels compiled with RT_STAMP (timing only: each block notes when it
# passed its wait for the grid before), then prints, per kind of launch (blocks x threads),
# the median time from its start to the next launch's start (its work and one boundary).
#   GPU_DECODE=path [DEFS=NAME=VALUE,...] [EXACT=1] scripts/gpu-stamps.sh MODEL...
# Stamping adds 5-10% to a step; compare variants (DEFS) with each other, not with benches.
set -uo pipefail
GD="${GPU_DECODE:?set GPU_DECODE to the gpu_decode example}"
for m in "$@"; do
  out=$(mktemp)
  echo "== $m (exact ${EXACT:-0}, defs ${DEFS:-none})"
  RUSTORCH_CUDA_EXACT="${EXACT:-0}" RUSTORCH_CUDA_DEFS="RT_STAMP${DEFS:+,$DEFS}" \
    RUSTORCH_STAMP_OUT="$out" "$GD" "$m" 128 1 2>&1 | grep -E "t/s|written|rror"
  python3 - "$out" <<'PY'
import collections, sys
rows = [l.split() for l in open(sys.argv[1]) if l.strip()]
kinds = collections.defaultdict(list)
order = []
for start, dt, spread, blocks, threads in rows[:-1]:
    k = (int(blocks), int(threads))
    if k not in kinds:
        order.append(k)
    kinds[k].append((float(dt), float(spread)))
print(f"{'blocks x threads':>18} {'n':>4} {'median us':>10} {'start spread':>13}")
for k in sorted(order, key=lambda k: -sum(d for d, _ in kinds[k])):
    v = kinds[k]
    if len(v) < 5:
        continue  # once a step (embedding, output): the gap to the next step is host time
    d = sorted(x for x, _ in v)[len(v) // 2]
    s = sorted(x for _, x in v)[len(v) // 2]
    print(f"{k[0]:>10} x {k[1]:<5} {len(v):>4} {d:>10.3f} {s:>13.3f}")
PY
  rm -f "$out"
done
