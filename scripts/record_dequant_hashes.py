#!/usr/bin/env python3
"""Record SHA-256 digests of ggml's dequantization of every tensor of the real test models.

For each model present in models/ it writes tests/fixtures/quant/dequant-<model file stem>.json:

  {"model": file name, "file_size": bytes, "tensors": [
     {"name", "type" (ggml name, e.g. "q4_K"), "type_id", "shape" (ggml order, ne0 first),
      "n_elements", "offset" (absolute file offset of the data), "n_bytes",
      "raw_sha256" (the tensor's bytes as stored), "sha256" (ggml's dequantization, f32 LE)}]}

The dequantization is ggml's own: ggml_get_type_traits(type)->to_float from libggml-base.so via
ctypes, over whole blocks in chunks (it is row-independent). F32 tensors have no to_float in
ggml; their "dequantization" is the stored data itself. Offsets and shapes come from gguf-py's
GGUFReader, so crates/rustorch-core/tests/quant_models.rs can read each tensor straight from the
file without a GGUF parser.

With --check-gguf-py it also runs gguf-py's numpy dequantizer on every tensor and reports any
tensor whose f32 bits differ from ggml's (ggml stays the reference either way).

How to run (re-runnable; ~1 minute for the four models):

  scripts/fetch-models.sh --all      # if the models are missing
  python3 scripts/record_dequant_hashes.py [--lib .../libggml-base.so] [--models models]
          [--out tests/fixtures/quant] [--check-gguf-py] [MODEL.gguf ...]

Then: cargo test -p rustorch-core --release --test quant_models -- --nocapture
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import os
import sys
from pathlib import Path

import numpy as np

DEFAULT_LIB = "/root/.cache/rustorch/lcpp-build/bin/libggml-base.so"
MODELS = [
    "SmolLM2-135M-Instruct.Q4_1.gguf",
    "qwen2.5-coder-0.5b-instruct-q4km.gguf",
    "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
    "gemma-3-270m-q4_k_m.gguf",
]
CHUNK_ELEMENTS = 1 << 22


class TypeTraits(ctypes.Structure):
    # struct ggml_type_traits in ggml/include/ggml.h
    _fields_ = [
        ("type_name", ctypes.c_char_p),
        ("blck_size", ctypes.c_int64),
        ("blck_size_interleave", ctypes.c_int64),
        ("type_size", ctypes.c_size_t),
        ("is_quantized", ctypes.c_bool),
        ("to_float", ctypes.c_void_p),
        ("from_float_ref", ctypes.c_void_p),
    ]


TO_FLOAT = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)


def compact_json(rec: dict) -> str:
    """JSON with one tensor per line: small, and still diffable."""
    head = {k: v for k, v in rec.items() if k != "tensors"}
    lines = [json.dumps(t, separators=(",", ":")) for t in rec["tensors"]]
    body = json.dumps(head, indent=1)[:-2]
    return body + ',\n "tensors": [\n' + ",\n".join(lines) + "\n ]\n}\n"


def main() -> int:
    root = Path(__file__).resolve().parent.parent
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lib", default=os.environ.get("GGML_BASE_LIB", DEFAULT_LIB))
    ap.add_argument("--models", default=str(root / "models"))
    ap.add_argument("--out", default=str(root / "tests" / "fixtures" / "quant"))
    ap.add_argument("--check-gguf-py", action="store_true")
    ap.add_argument("files", nargs="*", help="model files (default: the four test models)")
    args = ap.parse_args()

    import gguf  # gguf-py

    lib = ctypes.CDLL(args.lib)
    lib.ggml_get_type_traits.restype = ctypes.POINTER(TypeTraits)
    lib.ggml_get_type_traits.argtypes = [ctypes.c_int]
    lib.ggml_version.restype = ctypes.c_char_p
    lib.ggml_commit.restype = ctypes.c_char_p

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    files = [Path(f) for f in args.files] or [Path(args.models) / m for m in MODELS]
    for path in files:
        if not path.exists():
            print(f"skip {path}: not present (scripts/fetch-models.sh --all fetches it)")
            continue
        reader = gguf.GGUFReader(str(path))
        raw = np.memmap(path, dtype=np.uint8, mode="r")
        tensors = []
        gguf_py_diffs = []
        for t in reader.tensors:
            type_id = int(t.tensor_type)
            tr = lib.ggml_get_type_traits(type_id).contents
            block, type_size = int(tr.blck_size), int(tr.type_size)
            n = int(t.n_elements)
            off, nbytes = int(t.data_offset), int(t.n_bytes)
            assert n % block == 0 and n // block * type_size == nbytes, t.name
            data = raw[off : off + nbytes]
            raw_sha = hashlib.sha256(data).hexdigest()
            h = hashlib.sha256()
            chunk_blocks = max(1, CHUNK_ELEMENTS // block)
            pieces = [] if args.check_gguf_py else None
            for b0 in range(0, n // block, chunk_blocks):
                b1 = min(n // block, b0 + chunk_blocks)
                src = np.ascontiguousarray(data[b0 * type_size : b1 * type_size])
                if type_id == 0:  # F32: ggml has no to_float; the data is the f32 values
                    y = src.view("<f4")
                else:
                    assert tr.to_float, f"no ggml to_float for {t.name} type {type_id}"
                    y = np.zeros((b1 - b0) * block, dtype="<f4")
                    TO_FLOAT(tr.to_float)(src.ctypes.data, y.ctypes.data, y.size)
                h.update(y.tobytes())
                if pieces is not None:
                    pieces.append(y.copy())
            if pieces is not None:
                ours = np.concatenate(pieces).view("<u4")
                theirs = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)
                theirs = np.ascontiguousarray(theirs, dtype="<f4").reshape(-1).view("<u4")
                if not np.array_equal(ours, theirs):
                    gguf_py_diffs.append(t.name)
            tensors.append(
                {
                    "name": t.name,
                    "type": tr.type_name.decode(),
                    "type_id": type_id,
                    "shape": [int(d) for d in t.shape],
                    "n_elements": n,
                    "offset": off,
                    "n_bytes": nbytes,
                    "raw_sha256": raw_sha,
                    "sha256": h.hexdigest(),
                }
            )
        rec = {
            "model": path.name,
            "file_size": path.stat().st_size,
            "generator": "scripts/record_dequant_hashes.py",
            "ggml": {
                "library": args.lib,
                "ggml_version": lib.ggml_version().decode(),
                "ggml_commit": lib.ggml_commit().decode(),
                "dequantize_with": "ggml_get_type_traits(type)->to_float (f32: the stored data)",
            },
            "tensors": tensors,
        }
        if args.check_gguf_py:
            rec["gguf_py_differs"] = gguf_py_diffs
        dest = out_dir / f"dequant-{path.stem}.json"
        dest.write_text(compact_json(rec))
        types = sorted({x["type"] for x in tensors})
        msg = f"{path.name}: {len(tensors)} tensors ({', '.join(types)}) -> {dest}"
        if args.check_gguf_py:
            msg += f"; gguf-py differs from ggml on {len(gguf_py_diffs)} tensors {gguf_py_diffs[:5]}"
        print(msg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
