#!/usr/bin/env python3
"""Element-by-element comparison of llama.cpp's intermediate tensors
(`scripts/dump_llama_tensors.py`) with rustorch's (`tensor_sums` example with
RUSTORCH_DUMP_DIR), in graph order: prints, per tensor, how many elements differ and the
largest difference, and marks the first one that is not bit-identical.

python3 scripts/compare_tensors.py REF.npz OURS_DIR
"""
import os
import sys

import numpy as np

ALIASES = {"Qcur_rope": "#3", "Kcur_rope": "#3"}


def main():
    ref = np.load(sys.argv[1])
    d = sys.argv[2]
    first = None
    ours = {}
    for f in os.listdir(d):
        name = f[:-4]
        key = name
        for a, suffix in ALIASES.items():
            if name.startswith(a + "-"):
                key = a.split("_")[0] + name[len(a):] + suffix
        ours[key] = (name, f)
    seen = set()
    for key in ref.keys():  # graph order
        if key not in ours or key in seen:
            continue
        seen.add(key)
        name, f = ours[key]
        o = np.fromfile(os.path.join(d, f), dtype="<f4")
        # the same name may be used several times in llama.cpp's graph (before and after a
        # bias, a reshape, RoPE): compare with the closest of them
        base = key.split("#")[0]
        variants = [k for k in ref.keys() if k == base or k.startswith(base + "#")]
        variants = [k for k in variants if ref[k].size == o.size] or [key]
        key = min(variants, key=lambda k: int(np.count_nonzero(ref[k].reshape(-1) != o)))
        r = ref[key].reshape(-1)
        if r.size != o.size:
            print(f"{name:20s} size {o.size} vs {r.size}")
            continue
        diff = np.abs(r.astype(np.float64) - o)
        ndiff = int(np.count_nonzero(r != o))
        mark = ""
        if ndiff and first is None:
            first = name
            mark = "  <-- first difference"
        print(f"{name:20s} differ {ndiff:7d}/{r.size:<7d} max {diff.max():.3e}{mark}")
    print("all identical" if first is None else f"first difference: {first}")


if __name__ == "__main__":
    main()
