#!/usr/bin/env python3
"""Checks / records llama.cpp's repacked Q4_K x Q8_K matmul arithmetic (q4_K_8x8_q8_K path).

Calls the exported kernels of the real libggml-cpu.so through ctypes
(ggml_quantize_mat_q8_K_4x8, quantize_row_q8_K, ggml_gemm_q4_K_8x8_q8_K,
ggml_gemv_q4_K_8x8_q8_K), with the weights repacked here into block_q4_Kx8 exactly as
repack.cpp's make_block_q4_Kx8 does, and emulates forward_mul_mat's row split (rows
0..M-M%4 through quantize_mat_4x8 + gemm, the last M%4 rows through quantize_row_q8_K + gemv).

1. With a llama.cpp dump (scripts/dump_llama_tensors.py output) and the GGUF model, it
   recomputes whole Q4_K matmuls (attn_q -> "Qcur-N", ffn_gate -> "ffn_gate-N",
   ffn_up -> "ffn_up-N") and counts bit-identical outputs: this checks the row split /
   quantizer choice against what llama.cpp really does.
2. It writes tests/fixtures/q4k_ggml/q4k_ggml.bin, read by the Rust test in
   crates/rustorch-core/src/kernels/q4k_ggml.rs (synthetic case + a real slice of layer 0).

LIB=/root/.cache/rustorch/lcpp-build/bin python3 scripts/check_q4k_ggml.py \
    models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf DUMP.npz
(dump made with tokens 12522 5193 264 882 11 304 264 2613 14126 11)
"""
import ctypes
import os
import struct
import sys

import numpy as np

QK = 256
Q4K = 144
Q8K = 292
LIB = os.environ.get("LIB", "/root/.cache/rustorch/lcpp-build/bin")

base = ctypes.CDLL(os.path.join(LIB, "libggml-base.so"), mode=ctypes.RTLD_GLOBAL)
cpu = ctypes.CDLL(os.path.join(LIB, "libggml-cpu.so"), mode=ctypes.RTLD_GLOBAL)
cpu.ggml_cpu_init.restype = None
cpu.ggml_cpu_init()
P = ctypes.c_void_p
for name in ("ggml_quantize_mat_q8_K_4x8", "quantize_row_q8_K", "quantize_row_q4_K"):
    getattr(cpu, name).argtypes = [P, P, ctypes.c_int64]
    getattr(cpu, name).restype = None
for name in ("ggml_gemm_q4_K_8x8_q8_K", "ggml_gemv_q4_K_8x8_q8_K"):
    getattr(cpu, name).argtypes = [ctypes.c_int, P, ctypes.c_size_t, P, P, ctypes.c_int, ctypes.c_int]
    getattr(cpu, name).restype = None


def ptr(a):
    return a.ctypes.data_as(P)


def repack(w):
    """[N, nb*144] uint8 GGUF Q4_K rows -> block_q4_Kx8 bytes (make_block_q4_Kx8, interleave 8)."""
    n, rb = w.shape
    nb = rb // Q4K
    assert n % 8 == 0
    out = bytearray()
    for g in range(0, n, 8):
        for b in range(nb):
            blk = [w[g + i, b * Q4K:(b + 1) * Q4K] for i in range(8)]
            d = b"".join(bytes(x[0:2]) for x in blk)
            dm = b"".join(bytes(x[2:4]) for x in blk)
            sc = [x[4:16] for x in blk]
            qs = [x[16:144] for x in blk]
            q = bytearray(1024)
            for i in range(128):  # QK_K*4/8 chunks of 8 bytes
                src, off = i % 8, (i // 8) * 8
                q[i * 8:i * 8 + 8] = bytes(qs[src][off:off + 8])
            s96 = bytearray(96)
            for half in range(2):
                for i in range(4):
                    if half == 0:
                        s = [int(sc[j][i]) & 63 for j in range(8)]
                        m = [int(sc[j][i + 4]) & 63 for j in range(8)]
                    else:
                        s = [((int(sc[j][i]) & 192) >> 2) | (int(sc[j][i + 8]) & 15) for j in range(8)]
                        m = [((int(sc[j][i + 4]) & 192) >> 2) | ((int(sc[j][i + 8]) & 240) >> 4) for j in range(8)]
                    o = half * 48 + i * 12
                    for c in range(4):
                        s96[o + c] = ((s[c] & 63) + ((s[c + 4] & 48) << 2)) & 0xFF
                        s96[o + 4 + c] = ((m[c] & 63) + ((m[c + 4] & 48) << 2)) & 0xFF
                        s96[o + 8 + c] = ((s[c + 4] & 15) + ((m[c + 4] & 15) << 4)) & 0xFF
            out += d + dm + bytes(s96) + bytes(q)
    return np.frombuffer(bytes(out), dtype=np.uint8).copy()


def uninterleave_q8kx4(buf, nb):
    """block_q8_Kx4 bytes (nb blocks) -> 4 rows of plain block_q8_K bytes."""
    rows = [bytearray() for _ in range(4)]
    sz = 16 + 1024 + 128
    for b in range(nb):
        blk = buf[b * sz:(b + 1) * sz]
        d = np.frombuffer(bytes(blk[0:16]), dtype=np.float32)
        qs = np.frombuffer(bytes(blk[16:1040]), dtype=np.int8)
        bs = np.frombuffer(bytes(blk[1040:1168]), dtype=np.int16)
        for r in range(4):
            e = np.arange(256)
            j = (e // 8) * 32 + r * 8 + e % 8
            g = np.arange(16)
            idx = (g // 4) * 16 + r * 4 + g % 4
            rows[r] += d[r].tobytes() + qs[j].tobytes() + bs[idx].astype(np.int16).tobytes()
    return [bytes(r) for r in rows]


def ggml_matmul(w, x):
    """forward_mul_mat emulation. w: [N, nb*144] uint8, x: [M, K] f32 ->
    (out [M, N] f32, q8 rows [M] bytes, m_gemm)."""
    n = w.shape[0]
    m, k = x.shape
    nb = k // QK
    x = np.ascontiguousarray(x, dtype=np.float32)
    wr = repack(w)
    out = np.zeros((m, n), dtype=np.float32)
    m_gemm = m - m % 4
    q8rows = []
    if m_gemm:
        vy = np.zeros(m_gemm // 4 * nb * (16 + 1024 + 128), dtype=np.uint8)
        gsz = nb * (16 + 1024 + 128)
        for g in range(m_gemm // 4):
            cpu.ggml_quantize_mat_q8_K_4x8(ptr(x[4 * g:4 * g + 4]), ptr(vy[g * gsz:]), k)
            q8rows += uninterleave_q8kx4(vy[g * gsz:(g + 1) * gsz].tobytes(), nb)
        cpu.ggml_gemm_q4_K_8x8_q8_K(k, ptr(out), n, ptr(wr), ptr(vy), m_gemm, n)
    for i in range(m_gemm, m):
        a = np.zeros(nb * Q8K, dtype=np.uint8)
        cpu.quantize_row_q8_K(ptr(x[i]), ptr(a), k)
        q8rows.append(a.tobytes())
        o = np.zeros(n, dtype=np.float32)
        cpu.ggml_gemv_q4_K_8x8_q8_K(k, ptr(o), n, ptr(wr), ptr(a), 1, n)
        out[i] = o
    return out, q8rows, m_gemm


def case_bytes(w, x, q8rows, out, m_gemm):
    n = w.shape[0]
    m, k = x.shape
    return (struct.pack("<4I", k, n, m, m_gemm) + w.tobytes() + x.astype("<f4").tobytes()
            + b"".join(q8rows) + out.astype("<f4").tobytes())


def synthetic():
    rng = np.random.default_rng(1234)
    k, n, m = 512, 24, 19
    wf = (rng.standard_normal((n, k)) * 0.02).astype(np.float32)
    wf[3, :40] += 0.3  # skewed block -> nonzero mins
    w = np.zeros((n, k // QK * Q4K), dtype=np.uint8)
    for i in range(n):
        cpu.quantize_row_q4_K(ptr(wf[i]), ptr(w[i]), k)
    x = (rng.standard_normal((m, k)) * rng.uniform(0.1, 30, (m, 1))).astype(np.float32)
    x[2, 10] = 50.0  # outliers
    x[0, 3], x[0, 10] = -200.0, 200.0  # +-amax tie, negative first (4x8 differs from ref)
    x[0, 300], x[0, 301] = 150.0, -150.0  # tie, positive first
    x[1, 256:512] = 0.0  # all-zero block
    x[5, 7] = -300.0  # only -amax
    x[17, 3], x[17, 10] = -200.0, 200.0  # tie on a gemv row (ref rule)
    x[18, 300], x[18, 301] = -150.0, 150.0
    return w, x


def main():
    cases = []
    w, x = synthetic()
    out, q8, mg = ggml_matmul(w, x)
    cases.append(case_bytes(w, x, q8, out, mg))
    # the 4x8 quantizer vs quantize_row_q8_K (ref) on the tie row
    a = np.zeros(2 * Q8K, dtype=np.uint8)
    cpu.quantize_row_q8_K(ptr(x[0]), ptr(a), x.shape[1])
    print("row 0 (-amax first): 4x8 bytes == ref bytes:", a.tobytes() == q8[0],
          "; d 4x8 / ref:", np.frombuffer(q8[0][:4], np.float32)[0], np.frombuffer(a.tobytes()[:4], np.float32)[0])

    if len(sys.argv) >= 3:
        import gguf
        model, dump = sys.argv[1], np.load(sys.argv[2])
        r = gguf.GGUFReader(model)
        tens = {t.name: t for t in r.tensors}
        tot = [0, 0]
        layers = [0, 1, 13, 27] if "ffn_norm-27" in dump else [0]
        for L in layers:
            for wname, inp, outn in (("attn_q", "attn_norm", "Qcur"), ("ffn_gate", "ffn_norm", "ffn_gate"),
                                     ("ffn_up", "ffn_norm", "ffn_up")):
                t = tens[f"blk.{L}.{wname}.weight"]
                if t.tensor_type.name != "Q4_K":
                    continue
                w = np.asarray(t.data)
                xin = dump[f"{inp}-{L}"].reshape(-1, w.shape[1] // Q4K * QK)
                want = dump[f"{outn}-{L}"].reshape(xin.shape[0], -1)
                got, q8, mg = ggml_matmul(w, xin)
                same = int((got.view(np.uint32) == want.view(np.uint32)).sum())
                print(f"layer {L} {wname}: {same}/{want.size} bit-identical to llama.cpp "
                      f"(gemm rows {mg}, gemv rows {xin.shape[0] - mg})")
                tot[0] += same
                tot[1] += want.size
                if L == 0 and wname == "ffn_gate":
                    rows = np.r_[0:8, 4096:4104]
                    cases.append(case_bytes(w[rows], xin, q8, want[:, rows], mg))
        print(f"total: {tot[0]}/{tot[1]} bit-identical")

    os.makedirs("tests/fixtures/q4k_ggml", exist_ok=True)
    blob = struct.pack("<I", len(cases)) + b"".join(cases)
    with open("tests/fixtures/q4k_ggml/q4k_ggml.bin", "wb") as f:
        f.write(blob)
    print(f"wrote tests/fixtures/q4k_ggml/q4k_ggml.bin ({len(blob)} bytes, {len(cases)} cases)")


if __name__ == "__main__":
    main()
