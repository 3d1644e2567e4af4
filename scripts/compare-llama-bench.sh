#!/usr/bin/env bash
# Side-by-side speed of `rustorch bench` and llama.cpp's `llama-bench` on the same models,
# with the same -p/-n/-t/-r, run alternately (ours, llama.cpp, ours, llama.cpp, ...) so that
# both see the same machine load. Prints one table of medians over all samples of all
# rounds and the ratio ours / llama.cpp, plus load time (ours: open + parse + model set-up
# as `rustorch bench` reports it; llama.cpp: `llama_model_load_from_file` timed by
# scripts/llama-load-time.c; and for both the wall time of a process that loads the model
# and decodes one token) and peak RSS of each bench process (/usr/bin/time).
#
#   scripts/compare-llama-bench.sh [-m MODEL]... [-p 512] [-n 128] [-t 2] [-r 5] [--rounds 2]
#                                  [--json-dir DIR] [--llama-bench PATH] [--rustorch PATH]
#                                  [--env VAR=VALUE]... [--no-load]
#
# llama.cpp is built with scripts/build-llama-cpp.sh when llama-bench is missing; rustorch
# with `cargo build --release -p rustorch-cli` (CARGO_TARGET_DIR is honoured).
# Per feature level: --llama-bench takes another llama-bench (e.g. one built with
# GGML_NATIVE=OFF GGML_AVX2=ON GGML_AVX512=OFF), --env sets variables for rustorch only
# (e.g. RUSTORCH_ISA=avx2), --rustorch takes a prebuilt binary (no cargo build), --no-load
# skips the load-time / RSS-at-load runs (the speed table only). rustorch runs with
# `--device cpu` (on a GPU host `auto` would take the GPU); with --llama-bench and --no-load
# nothing is built or downloaded (a GPU host without network: build llama.cpp there from the
# `scripts/build-llama-cpp-cuda.sh --pack` tarball, CPU only).
set -euo pipefail
cd "$(dirname "$0")/.."

models=()
p=512
n=128
t=2
r=5
rounds=2
json_dir=""
lbench=""
ours=""
ours_env=()
do_load=1
while [ $# -gt 0 ]; do
  case "$1" in
    -m) models+=("$2"); shift 2 ;;
    -p) p="$2"; shift 2 ;;
    -n) n="$2"; shift 2 ;;
    -t) t="$2"; shift 2 ;;
    -r) r="$2"; shift 2 ;;
    --rounds) rounds="$2"; shift 2 ;;
    --json-dir) json_dir="$2"; shift 2 ;;
    --llama-bench) lbench="$2"; shift 2 ;;
    --rustorch) ours="$2"; shift 2 ;;
    --env) ours_env+=("$2"); shift 2 ;;
    --no-load) do_load=0; shift ;;
    -h|--help) sed -n '2,22p' "$0"; exit 0 ;;
    *) echo "unknown argument: $1" >&2; exit 2 ;;
  esac
done
if [ ${#models[@]} -eq 0 ]; then
  models=(models/SmolLM2-135M-Instruct.Q4_1.gguf
          models/qwen2.5-coder-0.5b-instruct-q4km.gguf
          models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf)
fi

cache="${RUSTORCH_CACHE:-$HOME/.cache/rustorch}"
lbin="$cache/lcpp-build/bin"
if [ -z "$lbench" ] && [ ! -x "$lbin/llama-bench" ]; then
  scripts/build-llama-cpp.sh
fi
lbench="${lbench:-$lbin/llama-bench}"
if [ -z "$ours" ]; then
  cargo build --release -p rustorch-cli >&2
  ours="${CARGO_TARGET_DIR:-target}/release/rustorch"
fi
# rustorch runs under `env` with --env's variables (none by default)
ours_cmd=(env "${ours_env[@]}" "$ours")
# llama.cpp's model load time, measured around llama_model_load_from_file
src="$cache/llama_cpp_python-0.3.36/vendor/llama.cpp"
loadtool="$cache/llama-load-time"
if [ "$do_load" = 1 ] && { [ ! -x "$loadtool" ] || [ scripts/llama-load-time.c -nt "$loadtool" ]; }; then
  cc -O2 -o "$loadtool" scripts/llama-load-time.c -I"$src/include" -I"$src/ggml/include" \
    -L"$lbin" -lllama -lggml -lggml-base -Wl,-rpath,"$lbin"
fi

out="${json_dir:-$(mktemp -d)}"
mkdir -p "$out"
timer=()
if [ -x /usr/bin/time ]; then timer=(/usr/bin/time -f "%M"); fi

# run CMD... > $1 (stdout), peak RSS (KiB) > $1.rss
measure() {
  local dst="$1"; shift
  if [ ${#timer[@]} -gt 0 ]; then
    "${timer[@]}" -o "$dst.rss" "$@" > "$dst" 2> "$dst.err"
  else
    "$@" > "$dst" 2> "$dst.err"; echo 0 > "$dst.rss"
  fi
}

for round in $(seq 1 "$rounds"); do
  for i in "${!models[@]}"; do
    m="${models[$i]}"
    [ -f "$m" ] || { echo "missing model $m" >&2; exit 1; }
    echo "round $round: $m" >&2
    measure "$out/ours-$round-$i.json" "${ours_cmd[@]}" bench -m "$m" --device cpu -p "$p" -n "$n" -t "$t" -r "$r" -o json
    measure "$out/lcpp-$round-$i.json" "$lbench" -m "$m" -p "$p" -n "$n" -t "$t" -r "$r" -o json
  done
done

# Load time: each tool's own figure (ours: open + parse + set up the model; llama.cpp:
# llama-completion's "load time") and the wall time of a process that loads the model and
# decodes one token (both tools), alternating, `loads` times per model.
loads=$((5 * do_load))
now_ns() { date +%s%N; }
for i in "${!models[@]}"; do
  m="${models[$i]}"
  for k in $(seq 1 "$loads"); do
    t0=$(now_ns)
    "${ours_cmd[@]}" bench -m "$m" --device cpu -p 0 -n 1 -r 1 --no-warmup -t "$t" -o json > "$out/ours-load-$k-$i.json" 2> /dev/null
    t1=$(now_ns)
    "$lbench" -m "$m" -p 0 -n 1 -r 1 --no-warmup -t "$t" -o json > /dev/null 2>&1
    t2=$(now_ns)
    echo "$(( (t1 - t0) / 1000 )) $(( (t2 - t1) / 1000 ))" > "$out/wall-load-$k-$i.txt"
    "$loadtool" "$m" > "$out/lcpp-load-$k-$i.txt" 2> /dev/null || echo nan > "$out/lcpp-load-$k-$i.txt"
  done
done

python3 - "$out" "$rounds" "$lbench" "${models[@]}" <<'EOF'
import json, os, statistics, sys
out, rounds, lbench, models = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4:]
isas = set()
def load(path):
    with open(path) as f:
        return json.load(f)
rows = []
extra = []
for i, m in enumerate(models):
    ours, lcpp, ours_rss, lcpp_rss, ours_load, lcpp_load = {}, {}, [], [], [], []
    file_size, kv = 0, 0
    for rd in range(1, rounds + 1):
        for name, dst, rss in (("ours", ours, ours_rss), ("lcpp", lcpp, lcpp_rss)):
            base = f"{out}/{name}-{rd}-{i}.json"
            for rec in load(base):
                key = f"pp{rec['n_prompt']}" if rec["n_gen"] == 0 else f"tg{rec['n_gen']}"
                dst.setdefault(key, []).extend(rec["samples_ts"])
                if name == "ours":
                    isas.add(rec.get("isa", "?"))
                    file_size, kv = rec["file_size"], max(kv, rec["kv_cache_bytes"])
            try:
                rss.append(int(open(base + ".rss").read().split()[-1]) * 1024)
            except (OSError, ValueError, IndexError):
                pass
    ours_load, walls = [], []
    k = 1
    while os.path.exists(f"{out}/wall-load-{k}-{i}.txt"):
        ours_load += [r["load_ms"] for r in load(f"{out}/ours-load-{k}-{i}.json")]
        walls.append([int(v) / 1000 for v in open(f"{out}/wall-load-{k}-{i}.txt").read().split()])
        try:
            lcpp_load.append(float(open(f"{out}/lcpp-load-{k}-{i}.txt").read().split()[0]))
        except (OSError, ValueError, IndexError):
            pass
        k += 1
    name = os.path.basename(m)
    for key in sorted(ours, key=lambda k: (k[:2] != "pp", k)):
        a, b = statistics.median(ours[key]), statistics.median(lcpp.get(key, [float("nan")]))
        rows.append((name, key, a, b, a / b))
    ol = statistics.median(ours_load) if ours_load else float("nan")
    ll = statistics.median(lcpp_load) if lcpp_load else float("nan")
    orss = max(ours_rss) if ours_rss else 0
    lrss = max(lcpp_rss) if lcpp_rss else 0
    wo = statistics.median(w[0] for w in walls) if walls else float("nan")
    wl = statistics.median(w[1] for w in walls) if walls else float("nan")
    extra.append((name, ol, ll, wo, wl, orss, lrss, file_size + kv + 64 * 2**20))
print("| model | test | rustorch t/s | llama.cpp t/s | ratio |")
print("| --- | --- | ---: | ---: | ---: |")
for name, key, a, b, q in rows:
    print(f"| {name} | {key} | {a:.2f} | {b:.2f} | {q:.2f} |")
print()
print("| model | load rustorch (ms) | load llama.cpp (ms) | load+1 token, process wall: rustorch / llama-bench (ms) | peak RSS rustorch (MiB) | peak RSS llama-bench (MiB) | RSS budget file+KV+64 MiB |")
print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
for name, ol, ll, wo, wl, orss, lrss, budget in extra:
    print(f"| {name} | {ol:.1f} | {ll:.1f} | {wo:.0f} / {wl:.0f} | {orss / 2**20:.1f} | {lrss / 2**20:.1f} | {budget / 2**20:.1f} |")
print()
print(f"medians over {rounds} alternating rounds; rustorch kernels: {', '.join(sorted(isas))}; "
      f"llama-bench: {lbench}; raw JSON in {out}")
EOF
