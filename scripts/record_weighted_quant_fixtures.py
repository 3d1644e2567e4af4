#!/usr/bin/env python3
"""Record ggml's quantization *with an importance matrix* as a test fixture for rustorch's
`quant::weighted` (what `llama-quantize --imatrix` runs).

Writes tests/fixtures/quant/weighted.json: for every type with a weighted quantizer in ggml
(q4_0 q4_1 q5_0 q5_1 q2_K q3_K q4_K q5_K q6_K iq4_nl iq4_xs) the bytes of

    ggml_quantize_chunk(type, src, dst, 0, nrows, n_per_row, imatrix)

for (a) every named input case of tests/fixtures/quant/inputs.json, quantized as one row with
generated weights, and (b) "bulk": 2^18 values of record_quant_fixtures.bulk_inputs() as 128
rows of 2048 with one generated weight per column (SHA-256 of the output; the Rust test
regenerates inputs and weights bit for bit).

Weights: w[j] = u(j)^2 * 2^(j % 11 - 5), u(j) = (splitmix64(2^41 + j) >> 40) * 2^-24, and 0
where j % 97 == 0 (an importance matrix has zero columns where an activation never fired).

    python3 scripts/record_weighted_quant_fixtures.py [--lib .../libggml-base.so]

Check with: cargo test -p rustorch-core --release --test quant_weighted
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import record_quant_fixtures as rq  # noqa: E402

TYPES = [
    ("q4_0", 2, 32, 18),
    ("q4_1", 3, 32, 20),
    ("q5_0", 6, 32, 22),
    ("q5_1", 7, 32, 24),
    ("q2_K", 10, 256, 84),
    ("q3_K", 11, 256, 110),
    ("q4_K", 12, 256, 144),
    ("q5_K", 13, 256, 176),
    ("q6_K", 14, 256, 210),
    ("iq4_nl", 20, 32, 18),
    ("iq4_xs", 23, 256, 136),
]
BULK_N = 1 << 18
BULK_ROW = 2048


def weights(n: int) -> np.ndarray:
    j = np.arange(n, dtype=np.uint64)
    u = (rq.splitmix64(j + np.uint64(1 << 41)) >> np.uint64(40)).astype(np.float32) * np.float32(2.0**-24)
    e = (j % np.uint64(11)).astype(np.int64) - 5
    w = (u * u).astype(np.float32) * np.ldexp(np.float32(1.0), e).astype(np.float32)
    w = np.where(j % np.uint64(97) == 0, np.float32(0.0), w).astype(np.float32)
    return w


def quantize(g: rq.Ggml, type_id: int, x: np.ndarray, n_per_row: int, w: np.ndarray, block: int, size: int) -> bytes:
    x = np.ascontiguousarray(x, dtype="<f4")
    w = np.ascontiguousarray(w, dtype="<f4")
    nrows = x.size // n_per_row
    out = np.zeros(x.size // block * size, dtype=np.uint8)
    written = g.lib.ggml_quantize_chunk(type_id, x.ctypes.data, out.ctypes.data, 0, nrows, n_per_row, w.ctypes.data)
    assert written == out.size
    return out.tobytes()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lib", default=os.environ.get("GGML_BASE_LIB", rq.DEFAULT_LIB))
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent.parent / "tests/fixtures/quant"))
    a = ap.parse_args()
    g = rq.Ggml(a.lib)
    out = Path(a.out)
    inputs = json.loads((out / "inputs.json").read_text())
    cases = inputs["cases"]
    bulk = rq.bulk_inputs(BULK_N)
    wb = weights(BULK_ROW)
    doc = {
        "source": "ggml_quantize_chunk with quant_weights, libggml-base of llama.cpp "
        "(llama-cpp-python 0.3.36), via scripts/record_weighted_quant_fixtures.py",
        "ggml_version": g.lib.ggml_version().decode(),
        "ggml_commit": g.lib.ggml_commit().decode(),
        "bulk": {
            "n": BULK_N,
            "n_per_row": BULK_ROW,
            "input_sha256": hashlib.sha256(bulk.astype("<f4").tobytes()).hexdigest(),
            "weights_sha256": hashlib.sha256(wb.astype("<f4").tobytes()).hexdigest(),
        },
        "types": {},
    }
    for name, tid, block, size in TYPES:
        t = {"cases": {}}
        for case in cases:
            x = np.frombuffer(base64.b64decode(case["f32_le_b64"]), dtype="<f4")
            t["cases"][case["name"]] = base64.b64encode(
                quantize(g, tid, x, x.size, weights(x.size), block, size)
            ).decode()
        t["bulk_sha256"] = hashlib.sha256(quantize(g, tid, bulk, BULK_ROW, wb, block, size)).hexdigest()
        doc["types"][name] = t
        print(f"{name}: {len(t['cases'])} cases, bulk {t['bulk_sha256'][:16]}")
    (out / "weighted.json").write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {out / 'weighted.json'}")


if __name__ == "__main__":
    main()
