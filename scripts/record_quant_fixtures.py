#!/usr/bin/env python3
"""Record ggml's own quantize/dequantize results as test fixtures for rustorch's `quant` module.

What it writes (into tests/fixtures/quant/ at the repository root):

  inputs.json        the shared f32 test inputs: named cases (gaussian, zeros, tiny values, one
                     outlier, negative-only, huge range, NaN/inf, ...), little-endian f32, base64
  <type>.json        one per ggml type (f32, f16, bf16, q4_0 ... q8_K, iq4_nl, iq4_xs), holding for
                     every input case ggml's quantized bytes and ggml's dequantization of those bytes,
                     plus random block bytes (arbitrary bit patterns) and ggml's dequantization of them.
                     Each also holds a "bulk" record: SHA-256 digests of ggml's quantization of 2^20
                     generated values (bulk_inputs(), which the Rust test regenerates bit for bit),
                     of ggml's dequantization of those bytes, and of ggml's dequantization of 16384
                     blocks of generated arbitrary bytes (bulk_random_bytes()).
                     f16.json / bf16.json also carry SHA-256 digests of exhaustive conversions
                     (all 65536 halves -> f32, all 2^32 f32 bit patterns -> half, and a strided subset).

Every byte comes from ggml itself, called through ctypes on libggml-base.so:
  * quantize:   ggml_quantize_chunk(type, src, dst, 0, 1, n, NULL)  -- what llama-quantize does
                without an imatrix; for q8_1 and q8_K, which ggml_quantize_chunk does not handle, the
                exported reference quantizers quantize_row_q8_1_ref / quantize_row_q8_K_ref.
  * dequantize: ggml_get_type_traits(type)->to_float; for q8_K the exported dequantize_row_q8_K.
                q8_1 has no dequantizer in ggml at all; its "dequant" is recorded as d*q computed
                with numpy in f32 (a single rounded product, which is what any C code would give),
                and the JSON says so.

The script also notes, per type, whether ggml's from_float_ref (quantize_row_*_ref) gives the same
bytes as ggml_quantize_chunk. They agree for every type except iq4_nl, whose _ref variant runs
the scale search with ntry=-1 while quantize_iq4_nl (the path models are made with) uses ntry=7;
the fixtures hold the ggml_quantize_chunk bytes.

How to run (re-runnable and deterministic; takes ~1 minute, mostly the exhaustive f32 sweeps):

  python3 scripts/record_quant_fixtures.py \
      [--lib /root/.cache/rustorch/lcpp-build/bin/libggml-base.so] [--out tests/fixtures/quant]

  The library comes from building the llama.cpp tree vendored in llama-cpp-python 0.3.36 with
  cmake (Release, GGML_NATIVE=ON). libggml-base is compiled with plain `-O3` and no -march, so the
  reference C code runs on baseline x86-64 SSE2: no FMA instructions exist in it and nothing is
  contracted (`objdump -d libggml-base.so | grep -c vfmadd` gives 0). The environment variable
  GGML_BASE_LIB can also point at the library. Needs Python 3 with numpy.

Then check the Rust side with:
  cargo test -p rustorch-core --release --test quant_reference
"""

from __future__ import annotations

import argparse
import base64
import ctypes
import hashlib
import json
import os
import sys
from pathlib import Path

import numpy as np

DEFAULT_LIB = "/root/.cache/rustorch/lcpp-build/bin/libggml-base.so"

# (name, ggml id, elements per block, bytes per block)
TYPES = [
    ("f32", 0, 1, 4),
    ("f16", 1, 1, 2),
    ("bf16", 30, 1, 2),
    ("q4_0", 2, 32, 18),
    ("q4_1", 3, 32, 20),
    ("q5_0", 6, 32, 22),
    ("q5_1", 7, 32, 24),
    ("q8_0", 8, 32, 34),
    ("q8_1", 9, 32, 36),
    ("q2_K", 10, 256, 84),
    ("q3_K", 11, 256, 110),
    ("q4_K", 12, 256, 144),
    ("q5_K", 13, 256, 176),
    ("q6_K", 14, 256, 210),
    ("q8_K", 15, 256, 292),
    ("iq4_nl", 20, 32, 18),
    ("iq4_xs", 23, 256, 136),
]

SEED = 20240607
# Elements of random (arbitrary-bit-pattern) block data per type, for dequantization only.
RANDOM_ELEMENTS = 1024
# Stride through the 2^32 f32 bit patterns for the quick conversion check.
F32_STRIDE = 4093


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


# void (*)(const void * x, float * y, int64_t k)
TO_FLOAT = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)
# void (*)(const float * x, void * y, int64_t k)
FROM_FLOAT = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)


class Ggml:
    def __init__(self, path: str):
        self.path = path
        lib = ctypes.CDLL(path)
        self.lib = lib
        lib.ggml_get_type_traits.restype = ctypes.POINTER(TypeTraits)
        lib.ggml_get_type_traits.argtypes = [ctypes.c_int]
        lib.ggml_quantize_chunk.restype = ctypes.c_size_t
        lib.ggml_quantize_chunk.argtypes = [
            ctypes.c_int,
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_int64,
            ctypes.c_int64,
            ctypes.c_int64,
            ctypes.c_void_p,
        ]
        lib.ggml_quantize_init.argtypes = [ctypes.c_int]
        lib.ggml_version.restype = ctypes.c_char_p
        lib.ggml_commit.restype = ctypes.c_char_p
        for fn in ("quantize_row_q8_1_ref", "quantize_row_q8_K_ref", "dequantize_row_q8_K"):
            getattr(lib, fn).argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
            getattr(lib, fn).restype = None
        for fn in ("ggml_fp32_to_fp16_row", "ggml_fp32_to_bf16_row_ref"):
            getattr(lib, fn).argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
            getattr(lib, fn).restype = None

    def traits(self, type_id: int) -> TypeTraits:
        return self.lib.ggml_get_type_traits(type_id).contents

    def quantize(self, name: str, type_id: int, x: np.ndarray, type_size: int, block: int) -> bytes:
        x = np.ascontiguousarray(x, dtype="<f4")
        n = x.size
        out = np.zeros(n // block * type_size, dtype=np.uint8)
        if name == "q8_1":
            self.lib.quantize_row_q8_1_ref(x.ctypes.data, out.ctypes.data, n)
        elif name == "q8_K":
            self.lib.quantize_row_q8_K_ref(x.ctypes.data, out.ctypes.data, n)
        else:
            written = self.lib.ggml_quantize_chunk(type_id, x.ctypes.data, out.ctypes.data, 0, 1, n, None)
            assert written == out.size, (name, written, out.size)
        return out.tobytes()

    def quantize_ref(self, type_id: int, x: np.ndarray, type_size: int, block: int) -> bytes | None:
        fn = self.traits(type_id).from_float_ref
        if not fn:
            return None
        x = np.ascontiguousarray(x, dtype="<f4")
        out = np.zeros(x.size // block * type_size, dtype=np.uint8)
        FROM_FLOAT(fn)(x.ctypes.data, out.ctypes.data, x.size)
        return out.tobytes()

    def dequantize(self, name: str, type_id: int, data: bytes, n: int) -> tuple[np.ndarray, str]:
        buf = np.frombuffer(data, dtype=np.uint8).copy()
        y = np.zeros(n, dtype="<f4")
        if name == "f32":
            # ggml has no to_float for f32: the data already is f32.
            return buf.view("<f4").copy(), "identity (f32 data)"
        if name == "q8_K":
            self.lib.dequantize_row_q8_K(buf.ctypes.data, y.ctypes.data, n)
            return y, "dequantize_row_q8_K"
        if name == "q8_1":
            return dequant_q8_1_numpy(buf), "numpy f32 d*q (ggml has no q8_1 dequantizer)"
        fn = self.traits(type_id).to_float
        assert fn, f"no to_float for {name}"
        TO_FLOAT(fn)(buf.ctypes.data, y.ctypes.data, n)
        return y, "ggml_get_type_traits()->to_float"


def dequant_q8_1_numpy(buf: np.ndarray) -> np.ndarray:
    blocks = buf.reshape(-1, 36)
    d = blocks[:, 0:2].copy().view("<f2").astype(np.float32)  # f16 -> f32 is exact
    q = blocks[:, 4:36].copy().view(np.int8).astype(np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        return (q * d).astype("<f4").reshape(-1)


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def f32(a) -> np.ndarray:
    return np.asarray(a, dtype=np.float64).astype(np.float32)


def make_cases(rng: np.random.Generator) -> list[tuple[str, np.ndarray, str]]:
    """Named inputs; every length is a multiple of 256 so each case fits every block size."""
    cases = []

    def add(name, arr, note):
        arr = f32(arr)
        assert arr.size % 256 == 0
        cases.append((name, arr, note))

    add("gaussian", rng.standard_normal(512), "N(0,1)")
    add("uniform", rng.uniform(-1.0, 1.0, 256), "U(-1,1)")
    add("zeros", np.zeros(256), "all zero (all-zero block paths)")
    tiny = np.concatenate([rng.standard_normal(128) * 1e-20, rng.standard_normal(128) * 1e-39])
    add("tiny", tiny, "1e-20 scale and f32 subnormals: below GROUP_MAX_EPS")
    add("small", rng.standard_normal(256) * 1e-5, "1e-5 scale: f16 subnormal block scales")
    out = rng.standard_normal(256) * 0.02
    out[37] = 30.0
    out[200] = -12.0
    add("outlier", out, "N(0,0.02) with two outliers")
    add("negative", -np.abs(rng.standard_normal(256)) - 0.1, "negative only")
    add("positive", np.abs(rng.standard_normal(256)) + 0.5, "positive only, min > 0")
    lr = np.where(rng.random(256) < 0.5, -1.0, 1.0) * 10.0 ** rng.uniform(-6, 6, 256)
    add("large_range", lr, "random sign, magnitudes 1e-6 .. 1e6")
    add("huge", rng.standard_normal(256) * 1e5, "block scales overflow f16")
    add("constant", np.full(256, 0.37), "constant block")
    add("integers", rng.integers(-8, 8, 256), "small integers (exact grid points)")
    add("ties", (rng.integers(-16, 16, 256) + 0.5) * 0.25, "values on rounding ties")
    sp = np.zeros(256)
    sp[rng.choice(256, 5, replace=False)] = rng.standard_normal(5)
    add("sparse", sp, "mostly zero")
    add("heavy_tail", rng.standard_t(3, 512) * 0.05, "student-t(3) * 0.05, weight-like")
    groups = rng.standard_normal(512).reshape(32, 16) * (10.0 ** rng.uniform(-3, 1, (32, 1)))
    add("subblock_scales", groups.reshape(-1), "each 16-group its own magnitude")
    nf = rng.standard_normal(256)
    nf[3] = np.nan
    nf[40] = np.inf
    nf[77] = -np.inf
    nf[100] = np.nan
    nf[101] = np.inf
    nf[200] = np.nan
    add("nonfinite", nf, "NaN and +-inf scattered (C behaviour there is implementation-defined)")
    return cases


BULK_N = 1 << 20
BULK_RANDOM_BLOCKS = 16384


def splitmix64(k: np.ndarray) -> np.ndarray:
    """splitmix64 of the counters k (uint64, wrapping), as in tests/quant_reference.rs."""
    z = k * np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def bulk_inputs(n: int) -> np.ndarray:
    """2^20 values, bit-reproducible in Rust: every operation is exact or a single f32 rounding
    done in the same order there. Per 256-block: a shape (uniform, bell = sum of three uniforms,
    cubed uniform, uniform with one 16x outlier) and a power-of-two scale 2^-20 .. 2^20."""
    i = np.arange(n, dtype=np.uint64)
    unif = lambda k: (splitmix64(k) >> np.uint64(40)).astype(np.float32) * np.float32(2.0**-24)
    u0, u1, u2 = unif(3 * i + np.uint64(1)), unif(3 * i + np.uint64(2)), unif(3 * i + np.uint64(3))
    block = i // np.uint64(256)
    kind = block % np.uint64(4)
    scale = np.ldexp(np.float32(1.0), ((block * np.uint64(7)) % np.uint64(41)).astype(np.int64) - 20).astype(np.float32)
    t = u0 * np.float32(2.0) - np.float32(1.0)
    bell = ((u0 + u1) + u2) - np.float32(1.5)
    x = np.where(kind == 0, t, np.where(kind == 1, bell, np.where(kind == 2, (t * t) * t, t)))
    outlier = (kind == 3) & ((i % np.uint64(256)) == ((block * np.uint64(37)) % np.uint64(256)))
    x = np.where(outlier, x * np.float32(16.0), x).astype(np.float32)
    return (x * scale).astype(np.float32)


def bulk_random_bytes(n_bytes: int) -> bytes:
    """Arbitrary bytes: the low byte of splitmix64(2^40 + k)."""
    k = np.arange(n_bytes, dtype=np.uint64) + np.uint64(1 << 40)
    return (splitmix64(k) & np.uint64(0xFF)).astype(np.uint8).tobytes()


def random_blocks(rng: np.random.Generator, name: str, block: int, type_size: int) -> bytes:
    n_blocks = RANDOM_ELEMENTS // block
    data = rng.integers(0, 256, n_blocks * type_size, dtype=np.uint8)
    if name in ("f16", "bf16", "f32"):
        # keep every raw pattern, including NaN payloads and subnormals
        return data.tobytes()
    blocks = data.reshape(n_blocks, type_size)
    # Half of the blocks get a moderate, finite f16 scale (and min) so values are realistic;
    # the other half keep raw bits, which may decode as inf/NaN/subnormal scales.
    half_fields = {
        "q4_0": [0], "q4_1": [0, 2], "q5_0": [0], "q5_1": [0, 2], "q8_0": [0], "q8_1": [0, 2],
        "q2_K": [80, 82], "q3_K": [108], "q4_K": [0, 2], "q5_K": [0, 2], "q6_K": [208],
        "iq4_nl": [0], "iq4_xs": [0],
    }
    for b in range(0, n_blocks, 2):
        if name == "q8_K":
            blocks[b, 0:4] = np.frombuffer(np.float32(rng.uniform(-0.01, 0.01)).tobytes(), np.uint8)
            continue
        for off in half_fields[name]:
            h = np.float16(rng.uniform(-0.05, 0.05))
            blocks[b, off : off + 2] = np.frombuffer(h.tobytes(), np.uint8)
    return blocks.tobytes()


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def exhaustive_half(g: Ggml, name: str, type_id: int) -> dict:
    """Digests of ggml's conversions over every half and every (or every k-th) f32 bit pattern."""
    halves = np.arange(65536, dtype="<u2").tobytes()
    to_f32, _ = g.dequantize(name, type_id, halves, 65536)
    conv = g.lib.ggml_fp32_to_fp16_row if name == "f16" else g.lib.ggml_fp32_to_bf16_row_ref
    fn_name = "ggml_fp32_to_fp16_row" if name == "f16" else "ggml_fp32_to_bf16_row_ref"

    stride_bits = np.arange(0, 1 << 32, F32_STRIDE, dtype=np.uint64).astype("<u4")
    out = np.zeros(stride_bits.size, dtype="<u2")
    conv(stride_bits.ctypes.data, out.ctypes.data, stride_bits.size)
    stride_digest = sha256_hex(out.tobytes())

    full = hashlib.sha256()
    chunk = 1 << 24
    out = np.zeros(chunk, dtype="<u2")
    for start in range(0, 1 << 32, chunk):
        bits = np.arange(start, start + chunk, dtype=np.uint64).astype("<u4")
        conv(bits.ctypes.data, out.ctypes.data, chunk)
        full.update(out.tobytes())
    return {
        "note": "SHA-256 of little-endian outputs, inputs in increasing bit-pattern order",
        "to_f32_all_65536_sha256": sha256_hex(to_f32.astype("<f4").tobytes()),
        "from_f32_function": fn_name,
        "from_f32_stride": F32_STRIDE,
        "from_f32_strided_count": int(stride_bits.size),
        "from_f32_strided_sha256": stride_digest,
        "from_f32_all_2pow32_sha256": full.hexdigest(),
    }


def main() -> int:
    root = Path(__file__).resolve().parent.parent
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lib", default=os.environ.get("GGML_BASE_LIB", DEFAULT_LIB))
    ap.add_argument("--out", default=str(root / "tests" / "fixtures" / "quant"))
    ap.add_argument("--skip-exhaustive", action="store_true", help="leave out the 2^32 f32 sweeps")
    args = ap.parse_args()

    g = Ggml(args.lib)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    ggml_info = {
        "library": args.lib,
        "ggml_version": g.lib.ggml_version().decode(),
        "ggml_commit": g.lib.ggml_commit().decode(),
        "source": "llama.cpp vendored in llama-cpp-python 0.3.36",
    }

    rng = np.random.default_rng(SEED)
    cases = make_cases(rng)
    inputs = {
        "generator": "scripts/record_quant_fixtures.py",
        "seed": SEED,
        "ggml": ggml_info,
        "cases": [
            {"name": n, "note": note, "n": int(a.size), "f32_le_b64": b64(a.astype("<f4").tobytes())}
            for n, a, note in cases
        ],
    }
    bulk = bulk_inputs(BULK_N)
    inputs["bulk"] = {"n": BULK_N, "sha256": sha256_hex(bulk.astype("<f4").tobytes())}
    (out_dir / "inputs.json").write_text(json.dumps(inputs, indent=1) + "\n")

    total = 0
    for name, type_id, block, type_size in TYPES:
        tr = g.traits(type_id)
        assert tr.blck_size == block and tr.type_size == type_size, (name, tr.blck_size, tr.type_size)
        rec = {
            "type": name,
            "id": type_id,
            "block_size": block,
            "type_size": type_size,
            "generator": "scripts/record_quant_fixtures.py",
            "ggml": ggml_info,
            "quantize_with": {
                "q8_1": "quantize_row_q8_1_ref",
                "q8_K": "quantize_row_q8_K_ref",
            }.get(name, "ggml_quantize_chunk(type, src, dst, 0, 1, n, NULL)"),
            "cases": [],
        }
        uses_ref_itself = name in ("q8_1", "q8_K")
        ref_agrees = None if uses_ref_itself else True
        dq_source = None
        for case_name, x, _ in cases:
            q = g.quantize(name, type_id, x, type_size, block)
            qref = g.quantize_ref(type_id, x, type_size, block)
            if not uses_ref_itself and qref is not None and qref != q:
                ref_agrees = False
            dq, dq_source = g.dequantize(name, type_id, q, x.size)
            rec["cases"].append(
                {"name": case_name, "quant_b64": b64(q), "dequant_f32_le_b64": b64(dq.astype("<f4").tobytes())}
            )
        rec["dequantize_with"] = dq_source
        rec["from_float_ref_equals_quantize"] = ref_agrees
        rb = random_blocks(rng, name, block, type_size)
        rdq, _ = g.dequantize(name, type_id, rb, RANDOM_ELEMENTS)
        rec["random_blocks"] = {
            "note": "arbitrary bytes (every other block given a moderate finite scale); dequantize only",
            "n": RANDOM_ELEMENTS,
            "bytes_b64": b64(rb),
            "dequant_f32_le_b64": b64(rdq.astype("<f4").tobytes()),
        }
        bq = g.quantize(name, type_id, bulk, type_size, block)
        bdq, _ = g.dequantize(name, type_id, bq, bulk.size)
        rbytes = bulk_random_bytes(BULK_RANDOM_BLOCKS * type_size)
        rdq, _ = g.dequantize(name, type_id, rbytes, BULK_RANDOM_BLOCKS * block)
        rec["bulk"] = {
            "note": "inputs from bulk_inputs(); random bytes from bulk_random_bytes(); SHA-256 of LE output",
            "n": int(bulk.size),
            "quant_sha256": sha256_hex(bq),
            "dequant_sha256": sha256_hex(bdq.astype("<f4").tobytes()),
            "random_blocks": BULK_RANDOM_BLOCKS,
            "random_dequant_sha256": sha256_hex(rdq.astype("<f4").tobytes()),
        }
        if name in ("f16", "bf16") and not args.skip_exhaustive:
            rec["exhaustive"] = exhaustive_half(g, name, type_id)
        path = out_dir / f"{name}.json"
        path.write_text(json.dumps(rec, indent=1) + "\n")
        total += path.stat().st_size
        print(f"{name:7s} {len(cases)} cases, from_float_ref==quantize_chunk: {ref_agrees}, {path.stat().st_size} bytes")
    total += (out_dir / "inputs.json").stat().st_size
    print(f"wrote {out_dir} ({total} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
