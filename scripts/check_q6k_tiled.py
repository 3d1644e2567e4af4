#!/usr/bin/env python3
"""Checks / records llama.cpp's *tiled* Q6_K x Q8_K matmul arithmetic (ggml-cpu/tiled,
AVX-512 VNNI build), the path llama.cpp takes for Q6_K weights when the batch has >= 8 rows.

Emulation (see crates/rustorch-core/src/kernels/q6k_tiled.rs for the derivation):
  activations: quantize_row_q8_K (= quantize_row_q8_K_ref on x86), called here from the real
  libggml-cpu.so; per super-block b, exact integer
      s1 = sum_s sc[s] * (sum_e w[16s+e] * q[16s+e] - 32 * bsums[s])     (w = 6-bit code 0..63)
  and per output  acc = fma(f32(s1) * d0, d1, acc), acc from +0.0, b in order.
numpy has no f32 fma: it is done in f64 (the product is exact) with a TwoSum-based fix of
the double rounding, so the emulation is exact.

1. With llama.cpp dumps (scripts/dump_llama_tensors.py, tokens
   12522 5193 264 882 11 304 264 2613 14126 11) and the GGUF models it recomputes the Q6_K
   matmuls: ffn_down (ffn_swiglu-N -> ffn_out-N), attn_v (attn_norm-N -> Vcur-N: the dump
   keeps the first tensor named "Vcur-N", the matmul output before the bias add), output.weight
   (result_norm -> result_output), and counts bit-identical outputs.
2. It writes tests/fixtures/q6k_tiled/q6k_tiled.bin (small slices), read by the Rust test in
   q6k_tiled.rs; with --full PATH also a file of whole ffn_down matmuls for the ignored
   Rust test (Q6K_TILED_FULL=PATH).

LIB=/root/.cache/rustorch/lcpp-build/bin python3 scripts/check_q6k_tiled.py \
    models/qwen2.5-coder-0.5b-instruct-q4km.gguf DUMP05.npz \
    models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf DUMP15.npz [--full PATH]
"""
import ctypes
import os
import struct
import sys

import numpy as np

QK = 256
Q6K = 210
Q8K = 292
LIB = os.environ.get("LIB", "/root/.cache/rustorch/lcpp-build/bin")

base = ctypes.CDLL(os.path.join(LIB, "libggml-base.so"), mode=ctypes.RTLD_GLOBAL)
cpu = ctypes.CDLL(os.path.join(LIB, "libggml-cpu.so"), mode=ctypes.RTLD_GLOBAL)
cpu.ggml_cpu_init.restype = None
cpu.ggml_cpu_init()
P = ctypes.c_void_p
cpu.quantize_row_q8_K.argtypes = [P, P, ctypes.c_int64]
cpu.quantize_row_q8_K.restype = None


def ptr(a):
    return a.ctypes.data_as(P)


def quant_q8k(x):
    """[M, K] f32 -> [M, nb*292] uint8 via libggml's quantize_row_q8_K."""
    m, k = x.shape
    x = np.ascontiguousarray(x, dtype=np.float32)
    out = np.zeros((m, k // QK * Q8K), dtype=np.uint8)
    for i in range(m):
        cpu.quantize_row_q8_K(ptr(x[i]), ptr(out[i]), k)
    return out


def q6k_decode(w):
    """[N, nb*210] uint8 -> codes [N, nb, 256] u8 (0..63), scales [N, nb, 16] i8, d0 [N, nb] f32."""
    n = w.shape[0]
    b = w.reshape(n, -1, Q6K)
    ql, qh = b[:, :, 0:128], b[:, :, 128:192]
    sc = b[:, :, 192:208].view(np.int8)
    d0 = b[:, :, 208:210].copy().view(np.float16)[..., 0].astype(np.float32)
    codes = np.empty(b.shape[:2] + (256,), dtype=np.uint8)
    for h in range(2):
        for quarter in range(4):
            lo = ql[:, :, 64 * h + 32 * (quarter & 1):64 * h + 32 * (quarter & 1) + 32]
            lo = (lo >> 4) if quarter >= 2 else (lo & 15)
            hi = (qh[:, :, 32 * h:32 * h + 32] >> (2 * quarter)) & 3
            codes[:, :, 128 * h + 32 * quarter:128 * h + 32 * quarter + 32] = lo | (hi << 4)
    return codes, sc, d0


def fma32(a, b, c):
    """Correctly rounded f32 fma(a, b, c) on arrays (exact product in f64, TwoSum fix-up)."""
    p = a.astype(np.float64) * b.astype(np.float64)  # exact: 24 + 24 bits
    c = c.astype(np.float64)
    s = p + c
    bb = s - p
    e = (p - (s - bb)) + (c - bb)  # exact error: p + c == s + e
    bits = s.view(np.uint64)
    mid = (bits & np.uint64((1 << 29) - 1)) == np.uint64(1 << 28)  # s halfway between two f32s
    fix = mid & (e != 0)
    if fix.any():
        s = s.copy()
        s[fix] = np.nextafter(s[fix], np.where(e[fix] > 0, np.inf, -np.inf))
    return s.astype(np.float32)


def tiled_matmul(w, q8):
    """w: [N, nb*210] uint8, q8: [M, nb*292] uint8 -> [M, N] f32 (tiled-path emulation)."""
    n = w.shape[0]
    m = q8.shape[0]
    nb = w.shape[1] // Q6K
    a = q8.reshape(m, nb, Q8K)
    d1 = a[:, :, 0:4].copy().view(np.float32)[..., 0]
    q = a[:, :, 4:260].view(np.int8).astype(np.float64)
    bs = a[:, :, 260:292].copy().view(np.int16).astype(np.float64)
    acc = np.zeros((m, n), dtype=np.float32)
    for b in range(nb):
        codes, sc, d0 = q6k_decode(w[:, b * Q6K:(b + 1) * Q6K])
        scf = sc[:, 0, :].astype(np.float64)  # [N, 16]
        ws = (codes[:, 0, :].astype(np.float64).reshape(n, 16, 16) * scf[:, :, None]).reshape(n, 256)
        # exact in f64: |s1| < 2^31
        s1 = q[:, b, :] @ ws.T - 32.0 * (bs[:, b, :] @ scf.T)
        r = s1.astype(np.float32) * d0[:, 0][None, :]
        acc = fma32(r, np.broadcast_to(d1[:, b][:, None], (m, n)), acc)
    return acc


def case_bytes(w, x, q8, out):
    """k, n, m, [has_x] (flag in the top bit of m), weights, x (optional), q8, out."""
    n = w.shape[0]
    m = q8.shape[0]
    k = w.shape[1] // Q6K * QK
    hdr = struct.pack("<3I", k, n, m | (0 if x is None else 0x80000000))
    xs = b"" if x is None else x.astype("<f4").tobytes()
    return hdr + w.tobytes() + xs + q8.tobytes() + out.astype("<f4").tobytes()


def same_bits(a, b):
    return int((a.astype(np.float32).view(np.uint32) == b.astype(np.float32).view(np.uint32)).sum())


def main():
    import gguf
    args = sys.argv[1:]
    full = None
    if "--full" in args:
        i = args.index("--full")
        full = args[i + 1]
        del args[i:i + 2]
    pairs = list(zip(args[0::2], args[1::2]))
    cases, full_cases = [], []
    grand = [0, 0]
    for model, dumpf in pairs:
        dump = np.load(dumpf)
        r = gguf.GGUFReader(model)
        tens = {t.name: t for t in r.tensors}
        tot = [0, 0]
        for name, t in sorted(tens.items()):
            if t.tensor_type.name != "Q6_K":
                continue
            w = np.asarray(t.data)
            parts = name.split(".")
            if name == "output.weight":
                inp, outn = "result_norm", "result_output"
            elif parts[2] == "ffn_down":
                inp, outn = f"ffn_swiglu-{parts[1]}", f"ffn_out-{parts[1]}"
            elif parts[2] == "attn_v":
                inp, outn = f"attn_norm-{parts[1]}", f"Vcur-{parts[1]}"
            else:
                print("skip", name)
                continue
            if inp not in dump or outn not in dump:
                print("not in dump:", name)
                continue
            k = w.shape[1] // Q6K * QK
            x = dump[inp].reshape(-1, k)
            want = dump[outn].reshape(x.shape[0], -1)
            q8 = quant_q8k(x)
            got = tiled_matmul(w, q8)
            same = same_bits(got, want)
            print(f"{os.path.basename(model)} {name}: {same}/{want.size} bit-identical "
                  f"(m={x.shape[0]}, k={k}, n={w.shape[0]})", flush=True)
            tot[0] += same
            tot[1] += want.size
            if "0.5b" in model and parts[2] == "ffn_down":
                full_cases.append(case_bytes(w, None, q8, want))
                if parts[1] == "0":
                    rows = np.r_[0:4, 444:448]
                    cases.append(case_bytes(w[rows], None, q8, want[:, rows]))
            if name == "output.weight":
                rows = np.r_[0:4, 151000:151004]
                sel = np.r_[0:6]
                cases.append(case_bytes(w[rows], x[sel], q8[sel], want[sel][:, rows]))
        print(f"{os.path.basename(model)} total: {tot[0]}/{tot[1]} bit-identical")
        grand[0] += tot[0]
        grand[1] += tot[1]
    print(f"all: {grand[0]}/{grand[1]} bit-identical")

    os.makedirs("tests/fixtures/q6k_tiled", exist_ok=True)
    blob = struct.pack("<I", len(cases)) + b"".join(cases)
    with open("tests/fixtures/q6k_tiled/q6k_tiled.bin", "wb") as f:
        f.write(blob)
    print(f"wrote tests/fixtures/q6k_tiled/q6k_tiled.bin ({len(blob)} bytes, {len(cases)} cases)")
    if full:
        blob = struct.pack("<I", len(full_cases)) + b"".join(full_cases)
        with open(full, "wb") as f:
            f.write(blob)
        print(f"wrote {full} ({len(blob)} bytes, {len(full_cases)} cases)")


if __name__ == "__main__":
    main()
