#!/usr/bin/env python3
"""Make small GGUF models whose weights use the low-bit formats, for end-to-end smoke runs.

From models/synthetic/synthetic-llama.gguf (scripts/make-synthetic-models.py) it writes
OUTDIR/synthetic-llama-<type>.gguf for each TYPE (default: iq1_s iq1_m iq2_xxs iq2_xs iq2_s
iq3_xxs iq3_s tq1_0 tq2_0 mxfp4): every 2-D weight whose row length is a multiple of the type's
block size (ffn_down for the 256-blocks; every matrix but the token embedding for MXFP4) is
dequantized by gguf-py and re-quantized by libggml's ggml_quantize_chunk. The grid i-quants need
an importance matrix in ggml; an all-ones one is passed (the quantizer then weighs the squared
error uniformly). Everything else (metadata, other tensors) is copied unchanged.

llama-quantize cannot make these from this model: it refuses IQ1/IQ2 without an imatrix, and
its row-length fallbacks would leave no tensor in the type for most of them.

  python3 scripts/make_lowbit_models.py [--src models/synthetic/synthetic-llama.gguf]
          [--out models/lowbit] [--lib .../libggml-base.so] [TYPE ...]

Then e.g. (all ten load and run; llama.cpp multiplies these types with q8_K-quantized activations,
which the dequantize-then-multiply path does not reproduce, so logits agree to ~0.3, not bit for bit):
  target/release/rustorch run -m models/lowbit/synthetic-llama-iq2_xxs.gguf -p "Hello" -n 16 --temp 0
  ~/.cache/rustorch/lcpp-build/bin/llama-completion -m ... -p "Hello" -n 16 --temp 0 -no-cnv
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from record_quant_fixtures import DEFAULT_LIB, Ggml  # noqa: E402

TYPES = ["iq1_s", "iq1_m", "iq2_xxs", "iq2_xs", "iq2_s", "iq3_xxs", "iq3_s", "tq1_0", "tq2_0", "mxfp4"]


def main() -> int:
    root = Path(__file__).resolve().parent.parent
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--src", default=str(root / "models/synthetic/synthetic-llama.gguf"))
    ap.add_argument("--out", default=str(root / "models/lowbit"))
    ap.add_argument("--lib", default=os.environ.get("GGML_BASE_LIB", DEFAULT_LIB))
    ap.add_argument("types", nargs="*", default=TYPES)
    args = ap.parse_args()

    import gguf

    g = Ggml(args.lib)
    g.lib.ggml_quantize_requires_imatrix.restype = ctypes.c_bool
    g.lib.ggml_quantize_requires_imatrix.argtypes = [ctypes.c_int]
    src = gguf.GGUFReader(args.src)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in args.types:
        qt = gguf.GGMLQuantizationType[name.upper()]
        tid = int(qt)
        tr = g.traits(tid)
        block, type_size = int(tr.blck_size), int(tr.type_size)
        g.lib.ggml_quantize_init(tid)
        needs_imatrix = g.lib.ggml_quantize_requires_imatrix(tid)
        dest = out_dir / f"synthetic-llama-{name}.gguf"
        arch = src.fields["general.architecture"].contents()
        w = gguf.GGUFWriter(str(dest), arch)
        for f in src.fields.values():
            if f.name.startswith("GGUF.") or f.name == "general.architecture":
                continue
            vt = f.types[0]
            sub = f.types[-1] if vt == gguf.GGUFValueType.ARRAY else None
            w.add_key_value(f.name, f.contents(), vt, sub_type=sub)
        converted = []
        for t in src.tensors:
            shape = [int(d) for d in t.shape]
            if len(shape) == 2 and shape[0] % block == 0 and t.name != "token_embd.weight":
                x = np.ascontiguousarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype="<f4")
                n_per_row, nrows = shape[0], shape[1]
                q = np.zeros(nrows * n_per_row // block * type_size, np.uint8)
                imat = np.ones(n_per_row, dtype="<f4") if needs_imatrix else None
                written = g.lib.ggml_quantize_chunk(
                    tid,
                    x.ctypes.data,
                    q.ctypes.data,
                    0,
                    nrows,
                    n_per_row,
                    imat.ctypes.data if imat is not None else None,
                )
                assert written == q.size, (t.name, written, q.size)
                w.add_tensor(t.name, q.reshape(nrows, -1), raw_dtype=qt)
                converted.append(t.name)
            else:
                w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        print(f"{dest}: {len(converted)} tensors in {name} ({', '.join(converted[:3])}...)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
