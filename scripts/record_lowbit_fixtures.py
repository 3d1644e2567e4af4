#!/usr/bin/env python3
"""Record ggml's dequantization (and, where rustorch quantizes, quantization) of the low-bit formats.

Formats: IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S (grid i-quants), TQ1_0, TQ2_0
(ternary), MXFP4, NVFP4, Q1_0 and Q2_0 (types are appended at the end of TYPES so that the random
streams, and so the files, of the earlier ones stay the same). For each it writes tests/fixtures/quant/<type>.json (ggml's type name), in
the layout of scripts/record_quant_fixtures.py's files plus three sections of its own:

  edge_blocks    hand-made blocks, element for element: every f16 scale class (±0, smallest and
                 largest subnormal, ±1, largest finite, ±inf, quiet/signalling/negative NaN) over
                 random payloads, and payloads of all-zero and all-one bits (every grid index,
                 sign bit, sub-block scale and shift bit at its limit); for MXFP4 the E8M0 scale
                 and for NVFP4 the UE4M3 scales at their limits with all 16 codes; labels say
                 which block is which.
  random_blocks  random bytes, half of the blocks with a moderate finite scale, element for
                 element (the same section name and meaning as in the older fixtures).
  sweep          blocks that together use every entry of the format's lookup table (every grid
                 index of iq2xxs/iq2xs/iq2s/iq3xxs/iq3s/iq1s_grid, every byte value of the
                 ternary, Q1_0 and Q2_0 payloads, every E8M0 exponent of MXFP4 and UE4M3 byte of
                 NVFP4) at a moderate scale; the bytes
                 and one SHA-256 of ggml's f32 output per block (a mismatch names the block).
  bulk           SHA-256 of ggml's dequantization of 16384 blocks of bulk_random_bytes() (the
                 generator of record_quant_fixtures.py, which the Rust test regenerates).

For TQ1_0, TQ2_0, MXFP4, NVFP4, Q1_0 and Q2_0, which rustorch also quantizes, the file additionally holds what
record_quant_fixtures.py records for its types: per case of inputs.json ggml's quantized bytes and
their dequantization ("cases"), SHA-256 of the quantization of bulk_inputs(2^20) and of its
dequantization ("bulk"), plus "extra_cases": inputs aimed at these quantizers (exact rounding
ties, block maxima at and around powers of two for MXFP4's floor(log2f(amax)), subnormal and
huge maxima, NaN/inf at the first and the last position of a block).

Every output value comes from ggml itself through ctypes on libggml-base.so:
  * dequantize: ggml_get_type_traits(type)->to_float
  * quantize:   ggml_quantize_chunk(type, src, dst, 0, 1, n, NULL), which for these types is
                quantize_row_<type>_ref (the script checks from_float_ref gives the same bytes)

How to run (re-runnable and deterministic; a few seconds):

  python3 scripts/record_lowbit_fixtures.py [--lib .../libggml-base.so] [--out tests/fixtures/quant]

Then: cargo test -p rustorch-core --release --test quant_lowbit  (and --test quant_reference,
which checks the quantizing types' "cases"/"bulk" sections like the older formats').
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
from record_quant_fixtures import (  # noqa: E402
    BULK_N,
    BULK_RANDOM_BLOCKS,
    DEFAULT_LIB,
    Ggml,
    bulk_inputs,
    bulk_random_bytes,
)

SEED = 20251124
RANDOM_ELEMENTS = 1024

# name, ggml id, block size, type size, byte offset of the f16 scale (None: no f16 scale field),
# and whether rustorch quantizes the type.
TYPES = [
    ("iq2_xxs", 16, 256, 66, 0, False),
    ("iq2_xs", 17, 256, 74, 0, False),
    ("iq3_xxs", 18, 256, 98, 0, False),
    ("iq1_s", 19, 256, 50, 0, False),
    ("iq3_s", 21, 256, 110, 0, False),
    ("iq2_s", 22, 256, 82, 0, False),
    ("iq1_m", 29, 256, 56, None, False),
    ("tq1_0", 34, 256, 54, 52, True),
    ("tq2_0", 35, 256, 66, 64, True),
    ("mxfp4", 39, 32, 17, None, True),
    ("nvfp4", 40, 64, 36, None, True),
    ("q1_0", 41, 128, 18, 0, True),
    ("q2_0", 42, 64, 18, 0, True),
]

F16_EDGES = [
    ("zero", 0x0000),
    ("neg_zero", 0x8000),
    ("min_subnormal", 0x0001),
    ("max_subnormal", 0x03FF),
    ("one", 0x3C00),
    ("neg_one", 0xBC00),
    ("max_finite", 0x7BFF),
    ("inf", 0x7C00),
    ("neg_inf", 0xFC00),
    ("qnan", 0x7E00),
    ("snan_payload", 0x7C01),
    ("neg_nan_payload", 0xFE01),
]
MODERATE = 0x2A0C  # f16 ~0.0471: a scale with a non-trivial mantissa

E8M0_EDGES = [0, 1, 2, 3, 64, 100, 126, 127, 128, 129, 200, 252, 253, 254, 255]


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def set_scale(name: str, blk: np.ndarray, d_off: int | None, h: int) -> None:
    """Writes the f16 bits `h` as the block's super-block scale."""
    if name == "iq1_m":
        # The f16 is spread over the top nibbles of the four u16 scale words (bytes 48..56).
        sc = blk[48:56].copy().view("<u2")
        for k in range(4):
            sc[k] = (sc[k] & 0x0FFF) | (((h >> (4 * k)) & 0xF) << 12)
        blk[48:56] = sc.view(np.uint8)
    else:
        blk[d_off : d_off + 2] = np.frombuffer(np.array([h], "<u2").tobytes(), np.uint8)


def edge_blocks(rng, name, type_size, d_off) -> list[tuple[str, bytes]]:
    out = []
    if name == "nvfp4":
        codes = np.array([j | ((15 - j) << 4) for j in range(8)] + [(j + 8) | ((7 - j) << 4) for j in range(8)], np.uint8)
        ue_edges = [0x00, 0x01, 0x07, 0x08, 0x09, 0x38, 0x77, 0x7E, 0x7F, 0x80, 0x81, 0xB8, 0xFE, 0xFF]
        for k in range(0, len(ue_edges), 4):
            d = (ue_edges[k : k + 4] + [0x38] * 4)[:4]
            out.append((f"scales {', '.join(f'{v:#04x}' for v in d)} all codes", bytes(d) + codes.tobytes() * 2))
        out.append(("all bits zero", bytes(type_size)))
        out.append(("all bits one", bytes([0xFF] * type_size)))
        d = bytes([0x30, 0x38, 0x40, 0x48])
        out.append(("moderate scales, random codes", d + rng.integers(0, 256, 32, dtype=np.uint8).tobytes()))
        return out
    if name == "mxfp4":
        all_codes = np.array([j | ((15 - j) << 4) for j in range(16)], np.uint8)
        for e in E8M0_EDGES:
            out.append((f"e={e} all codes", bytes([e]) + all_codes.tobytes()))
        out.append(("all bits zero", bytes(type_size)))
        out.append(("all bits one", bytes([0xFF] * type_size)))
        for e in (127, 1, 254):
            out.append((f"e={e} random codes", bytes([e]) + rng.integers(0, 256, 16, dtype=np.uint8).tobytes()))
        return out
    for fill, label in ((0x00, "payload bits zero"), (0xFF, "payload bits one")):
        for d in (MODERATE, 0x7BFF):
            blk = np.full(type_size, fill, np.uint8)
            set_scale(name, blk, d_off, d)
            out.append((f"d={d:#06x} {label}", blk.tobytes()))
    for label, h in F16_EDGES:
        blk = rng.integers(0, 256, type_size, dtype=np.uint8)
        set_scale(name, blk, d_off, h)
        out.append((f"d={label} ({h:#06x}) random payload", blk.tobytes()))
    return out


def random_blocks(rng, name, block, type_size, d_off) -> bytes:
    n_blocks = RANDOM_ELEMENTS // block
    blocks = rng.integers(0, 256, (n_blocks, type_size), dtype=np.uint8)
    # Every other block gets a moderate finite scale; the rest keep raw (maybe inf/NaN) scales.
    for b in range(0, n_blocks, 2):
        if name == "mxfp4":
            blocks[b, 0] = rng.integers(110, 140)
        elif name == "nvfp4":
            blocks[b, 0:4] = rng.integers(0x28, 0x48, 4)
        else:
            h = int(np.float16(rng.uniform(-0.05, 0.05)).view("<u2"))
            set_scale(name, blocks[b], d_off, h)
    return blocks.tobytes()


def sweep_blocks(rng, name, type_size, d_off) -> tuple[str, list[bytes]]:
    """Blocks that together use every lookup-table entry of the format."""

    def blank(b):
        blk = rng.integers(0, 256, type_size, dtype=np.uint8)
        if d_off is not None or name == "iq1_m":
            set_scale(name, blk, d_off, MODERATE + 7 * b)
        return blk

    out = []
    if name == "mxfp4":
        for e in range(256):
            blk = rng.integers(0, 256, type_size, dtype=np.uint8)
            blk[0] = e
            out.append(blk.tobytes())
        return "every E8M0 exponent 0..255, random codes", out
    if name == "nvfp4":
        for b in range(64):
            blk = rng.integers(0, 256, type_size, dtype=np.uint8)
            blk[0:4] = np.arange(4 * b, 4 * b + 4)
            out.append(blk.tobytes())
        return "every UE4M3 scale byte 0..255, random codes", out
    if name in ("tq1_0", "tq2_0", "q1_0", "q2_0"):
        # (first payload byte, payload bytes): qs (+ qh) before d, or after it
        first, payload = {"tq1_0": (0, 52), "tq2_0": (0, 64), "q1_0": (2, 16), "q2_0": (2, 16)}[name]
        n = -(-256 // payload)
        for b in range(n):
            blk = blank(b)
            blk[first : first + payload] = (np.arange(payload) + b * payload) % 256
            out.append(blk.tobytes())
        return f"every payload byte value 0..255 ({'qs and qh' if name == 'tq1_0' or name == 'tq2_0' else 'qs'}), moderate d", out
    grid, per_block = {
        "iq2_xxs": (256, 32),
        "iq2_xs": (512, 32),
        "iq2_s": (1024, 32),
        "iq3_xxs": (256, 64),
        "iq3_s": (512, 64),
        "iq1_s": (2048, 32),
        "iq1_m": (2048, 32),
    }[name]
    for b in range(grid // per_block):
        blk = blank(b)
        idx = [(b * per_block + p) % grid for p in range(per_block)]
        if name == "iq2_xxs":
            for ib in range(8):
                for l in range(4):
                    blk[2 + 8 * ib + l] = idx[4 * ib + l]
        elif name == "iq2_xs":
            qs = blk[2:66].copy().view("<u2")
            for p in range(32):
                qs[p] = (qs[p] & 0xFE00) | idx[p]
            blk[2:66] = qs.view(np.uint8)
        elif name == "iq2_s":
            for ib in range(8):
                qh = 0
                for l in range(4):
                    i = idx[4 * ib + l]
                    blk[2 + 4 * ib + l] = i & 0xFF
                    qh |= (i >> 8) << (2 * l)
                blk[66 + ib] = qh
        elif name == "iq3_xxs":
            blk[2:66] = idx
        elif name == "iq3_s":
            qh = [0] * 8
            for n_, i in enumerate(idx):
                blk[2 + n_] = i & 0xFF
                qh[n_ // 8] |= (i >> 8) << (n_ % 8)
            blk[66:74] = qh
        elif name == "iq1_s":
            qh = blk[34:50].copy().view("<u2")
            for ib in range(8):
                v = int(qh[ib]) & 0xF000
                for l in range(4):
                    i = idx[4 * ib + l]
                    blk[2 + 4 * ib + l] = i & 0xFF
                    v |= (i >> 8) << (3 * l)
                qh[ib] = v
            blk[34:50] = qh.view(np.uint8)
        elif name == "iq1_m":
            for ib in range(8):
                for half in range(2):
                    i0, i1 = idx[4 * ib + 2 * half], idx[4 * ib + 2 * half + 1]
                    blk[4 * ib + 2 * half] = i0 & 0xFF
                    blk[4 * ib + 2 * half + 1] = i1 & 0xFF
                    q = blk[32 + 2 * ib + half] & 0x88  # keep the two random delta-sign bits
                    blk[32 + 2 * ib + half] = q | (i0 >> 8) | ((i1 >> 8) << 4)
        out.append(blk.tobytes())
    return f"every one of the {grid} grid entries, {per_block} per block, moderate d", out


def f32(a) -> np.ndarray:
    return np.asarray(a, dtype=np.float64).astype(np.float32)


def extra_cases(rng, name) -> list[tuple[str, str, np.ndarray]]:
    """Inputs aimed at the TQ1_0 / TQ2_0 / MXFP4 quantizers; lengths are multiples of 256."""
    cases = []

    def add(case, note, arr):
        arr = f32(arr)
        assert arr.size % 256 == 0, (case, arr.size)
        cases.append((case, note, arr))

    # Rounding ties of lroundf(x / amax): amax 1 (exact inverse) and values at +-0.5 and around.
    t = rng.choice(np.array([0.5, -0.5, 0.49999997, -0.49999997, 0.50000006, -0.50000006, 0.0, -0.0, 1.0, -1.0]), 256)
    t[0] = 1.0
    add("ternary_ties", "amax 1 with values at and next to +-0.5", t)
    # amax whose inverse is not exact, with values at (float) half of it.
    a = np.full(256, 3.0) * np.where(rng.random(256) < 0.5, -1, 1) * 0.5
    a[7] = 3.0
    add("inexact_inverse_ties", "amax 3, values +-1.5", a)
    # Block maxima at and around powers of two (floor(log2f(amax)) in MXFP4), one per 32-block.
    vals = []
    for k in (-126, -100, -20, -3, -1, 0, 1, 2, 3, 10, 20, 64, 100, 126, 127):
        p = np.float32(2.0) ** np.float32(k) if k > -127 else np.float32(2.0**k)
        for m in (np.nextafter(p, np.float32(0)), p, np.nextafter(p, np.float32(np.inf))):
            blk = rng.uniform(-1, 1, 32).astype(np.float32) * np.float32(m)
            blk[rng.integers(0, 32)] = m * (1 if rng.random() < 0.5 else -1)
            vals.append(blk)
    # Values whose magnitude is just below 1.5/2/3 steps of the E2M1 grid (best_index ties).
    base = np.float32(2.0) ** np.float32(-3)
    blk = np.array([k * base for k in (0, 0.5, 1, 1.5, 2, 2.5, 3, 3.5, 4, 5, 6, 7, 8, 10, 12, 16)], np.float32)
    vals.append(np.concatenate([blk, -blk]))
    x = np.concatenate(vals)
    x = np.concatenate([x, np.zeros((-x.size) % 256, np.float32)])
    add("pow2_maxima", "32-blocks whose max is 2^k, or one ulp below/above, k in -126..127; grid ties", x)
    sub = rng.uniform(-1, 1, 256) * 1e-40
    sub[5] = 1e-45
    add("subnormal_max", "all values f32 subnormal (1/amax overflows)", sub)
    big = rng.uniform(-1, 1, 256) * 3e38
    big[9] = 3.4028235e38
    add("f32_max", "values up to FLT_MAX", big)
    nf = rng.standard_normal(512) * 0.1
    nf[0] = np.nan
    nf[255] = np.nan
    nf[256] = np.inf
    nf[300] = -np.inf
    nf[511] = np.nan
    add("nonfinite_ends", "NaN first and last in a block, inf inside", nf)
    nf2 = rng.standard_normal(256)
    nf2[31] = np.nan
    nf2[32] = np.inf
    nf2[200] = -np.inf
    add("nonfinite_mxfp4_blocks", "NaN last in a 32-block, inf first in the next", nf2)
    return cases


def main() -> int:
    root = Path(__file__).resolve().parent.parent
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lib", default=os.environ.get("GGML_BASE_LIB", DEFAULT_LIB))
    ap.add_argument("--out", default=str(root / "tests" / "fixtures" / "quant"))
    args = ap.parse_args()

    g = Ggml(args.lib)
    out_dir = Path(args.out)
    ggml_info = {
        "library": args.lib,
        "ggml_version": g.lib.ggml_version().decode(),
        "ggml_commit": g.lib.ggml_commit().decode(),
        "source": "llama.cpp vendored in llama-cpp-python 0.3.36",
    }
    inputs = json.loads((out_dir / "inputs.json").read_text())
    cases = [(c["name"], np.frombuffer(base64.b64decode(c["f32_le_b64"]), "<f4")) for c in inputs["cases"]]
    bulk = bulk_inputs(BULK_N)
    assert sha(bulk.astype("<f4").tobytes()) == inputs["bulk"]["sha256"]

    rng = np.random.default_rng(SEED)
    total = 0
    for name, type_id, block, type_size, d_off, quantizes in TYPES:
        tr = g.traits(type_id)
        assert tr.type_name.decode() == name, (name, tr.type_name)
        assert tr.blck_size == block and tr.type_size == type_size, (name, tr.blck_size, tr.type_size)

        def deq(data: bytes) -> np.ndarray:
            n = len(data) // type_size * block
            y, _ = g.dequantize(name, type_id, data, n)
            return y.astype("<f4")

        rec = {
            "type": name,
            "id": type_id,
            "block_size": block,
            "type_size": type_size,
            "generator": "scripts/record_lowbit_fixtures.py",
            "ggml": ggml_info,
            "dequantize_with": "ggml_get_type_traits()->to_float",
        }
        edges = edge_blocks(rng, name, type_size, d_off)
        eb = b"".join(b for _, b in edges)
        rec["edge_blocks"] = {
            "note": "hand-made blocks (labels in order); element for element",
            "labels": [label for label, _ in edges],
            "bytes_b64": b64(eb),
            "dequant_f32_le_b64": b64(deq(eb).tobytes()),
        }
        rb = random_blocks(rng, name, block, type_size, d_off)
        rec["random_blocks"] = {
            "note": "arbitrary bytes (every other block given a moderate finite scale); dequantize only",
            "n": RANDOM_ELEMENTS,
            "bytes_b64": b64(rb),
            "dequant_f32_le_b64": b64(deq(rb).tobytes()),
        }
        note, sweep = sweep_blocks(rng, name, type_size, d_off)
        rec["sweep"] = {
            "note": note + "; SHA-256 of ggml's f32 output per block",
            "blocks": len(sweep),
            "bytes_b64": b64(b"".join(sweep)),
            "block_sha256": [sha(deq(s).tobytes()) for s in sweep],
        }
        rbytes = bulk_random_bytes(BULK_RANDOM_BLOCKS * type_size)
        rec["bulk"] = {
            "note": "random bytes from bulk_random_bytes(); SHA-256 of LE output",
            "random_blocks": BULK_RANDOM_BLOCKS,
            "random_dequant_sha256": sha(deq(rbytes).tobytes()),
        }
        if quantizes:
            rec["quantize_with"] = "ggml_quantize_chunk(type, src, dst, 0, 1, n, NULL)"
            ref_agrees = True
            rec["cases"] = []
            for case_name, x in cases:
                q = g.quantize(name, type_id, x, type_size, block)
                if g.quantize_ref(type_id, x, type_size, block) != q:
                    ref_agrees = False
                rec["cases"].append(
                    {"name": case_name, "quant_b64": b64(q), "dequant_f32_le_b64": b64(deq(q).tobytes())}
                )
            rec["extra_cases"] = []
            for case_name, note_, x in extra_cases(rng, name):
                q = g.quantize(name, type_id, x, type_size, block)
                if g.quantize_ref(type_id, x, type_size, block) != q:
                    ref_agrees = False
                rec["extra_cases"].append(
                    {
                        "name": case_name,
                        "note": note_,
                        "f32_le_b64": b64(x.astype("<f4").tobytes()),
                        "quant_b64": b64(q),
                        "dequant_f32_le_b64": b64(deq(q).tobytes()),
                    }
                )
            rec["from_float_ref_equals_quantize"] = ref_agrees
            bq = g.quantize(name, type_id, bulk, type_size, block)
            rec["bulk"].update(
                {
                    "n": int(bulk.size),
                    "quant_sha256": sha(bq),
                    "dequant_sha256": sha(deq(bq).tobytes()),
                }
            )
        path = out_dir / f"{name}.json"
        path.write_text(json.dumps(rec, indent=1) + "\n")
        total += path.stat().st_size
        print(
            f"{name:8s} {len(edges)} edge + {RANDOM_ELEMENTS // block} random + {len(sweep)} sweep blocks"
            + (f", {len(rec['cases'])}+{len(rec['extra_cases'])} quantize cases" if quantizes else "")
            + f", {path.stat().st_size} bytes"
        )
    print(f"wrote {out_dir} ({total} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
