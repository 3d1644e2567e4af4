//! Bit-exact scalar emulation of llama.cpp's CPU *tiled* K-quant matmul
//! (`ggml-cpu/tiled/tiled.cpp` + `tiled/tiled-kernel.cpp`) for Q6_K weights × f32
//! activations, on this build (x86 with AVX-512 F/BW/VL/DQ/VNNI, `-march=native`, so the
//! `__AVX512VNNI__ && __AVX512VL__ && __AVX512DQ__` microkernel `tiled_run_micro_vnni_8x16`
//! is the one compiled in), working on the original GGUF Q6_K bytes.
//!
//! # When llama.cpp uses this path
//!
//! `ggml_compute_forward_mul_mat` first calls `ggml_compute_forward_mul_mat_tiled`, which
//! takes over when: the tiled switch is on (env `GGML_CPU_TILED_MM` unset or non-zero), the
//! weight is not in a repack buffer (`src0->extra == NULL`; on x86 Q6_K is never repacked —
//! repack.cpp only has NEON Q6_K layouts), the type is one of the supported K/IQ quants
//! (Q6_K is) and `src1->ne[1] >= 8` (`ggml_tiled_min_batch`; `GGML_CPU_TILED_MM_FORCE=1`
//! forces it for any batch). So with 10 prompt tokens every Q6_K matmul goes here; with
//! < 8 rows the ordinary `vec_dot` path (`dot.rs::dot_q6_k`) is used instead.
//! Q6_K is instantiated as `SUBBLK = 16, HAS_MIN = false, BIAS = 32, ACTBIAS = true`.
//!
//! # Activation quantization
//!
//! src1 (f32) is converted with the Q8_K type traits' `from_float` = `quantize_row_q8_K`,
//! which on x86 is literally `quantize_row_q8_K_ref` (arch/x86/quants.c). Per row and per
//! 256-element super-block: `amax`/`max` = first element with the largest |x|,
//! `iscale = -127 / max`, `d = 1 / iscale` (f32), `q = nearest_int(iscale * x)` clamped to
//! 127, bsums = exact i16 sums of 16 consecutive quants; `amax == 0` → `d = 0`, q = 0.
//! The crate's `crate::quant::quantize(GgmlType::Q8_K, ..)` is that quantizer (not
//! duplicated; [`quantize_act_q8k_tiled`] wraps it). The threads split each row by whole
//! blocks (`ne10_block_start/end`) — blocks are independent, so no effect. The tiled
//! unpack (`tiled_unpack_src1_q8_K`) copies the 256 codes, widens the 16 bsums to i32 and
//! keeps `d` as the f32 stored in the block (no f16 rounding, despite a comment).
//!
//! # Weight decoding (exact)
//!
//! `tiled_unpack_src0(block_q6_K)`: per super-block `d0 = f16_to_f32(d)`, 16 int8 scales
//! `sc[s]` (one per 16 elements, natural order), unsigned 6-bit codes `w[e]` in 0..64 in the
//! natural dequantization order (element `e = 128 h + 32 quarter + l`:
//! low 4 bits = nibble `quarter >= 2` of `ql[64 h + 32 (quarter & 1) + l]`,
//! high 2 bits = bits `2 quarter .. 2 quarter + 2` of `qh[32 h + l]`). The bias 32 is *not*
//! subtracted from the codes (unlike `vec_dot`); it is corrected with the activation bsums.
//! (`tiled_repack_src0` also computes an AVX2-only act-bias correction into `mins[]`; the
//! VNNI kernel with `HAS_MIN = false` never reads it. `tiled_repack_src1` on VNNI only
//! transposes codes, the +128 act-bias is AVX2-only.)
//!
//! # Arithmetic per output element (weight row `i`, activation row `j`)
//!
//! For each super-block `b` (one 256-K "slab") the VNNI kernel computes in i32 (all exact;
//! `vpdpbusd` u8×s8 with no saturation, `vpmulld`/`vpaddd` wrap but never overflow here):
//! ```text
//! raw[s] = Σ_{e<16} w[16 s + e] * q[16 s + e]          (codes 0..63 times i8)
//! s1     = Σ_{s<16} sc[s] * (raw[s] - 32 * bsums[s])   (= Σ sc[s] Σ (w-32) q, exactly)
//! ```
//! then the float epilogue, once per (element, super-block) — checked in the disassembly of
//! `tiled_run_micro_vnni_8x16<16, false, 32, *>` (`vcvtdq2ps`, `vmulps`, `vfmadd213ps`; GCC
//! contracts the `_mm512_add_ps(buf, _mm512_mul_ps(result, d1))` into one FMA):
//! ```text
//! r   = f32(s1) * d0                 (cvtdq2ps = round-to-nearest-even, then one f32 mul)
//! acc = fma(r, d1, acc)              (d1 = the activation block's f32 d)
//! ```
//! starting from `acc = +0.0` (the 256×256 `acc` window is memset once per macrotile), with
//! `b` strictly in order `0, 1, .., nb-1`; the result is `acc`, stored as is (no further
//! reduction, no `d0 * d1` pre-product, unlike `vec_dot`).
//!
//! # Dependence on tiling / threads
//!
//! None. Both K schedules accumulate into the same `acc` cell in super-block order:
//! * standard path (window of > 16 activation rows): `ib` over 256-K slabs in order, one
//!   microtile call per slab;
//! * narrow path (≤ 16 activation rows in the 256-row window, e.g. 10 tokens):
//!   `ggml_tiled_narrow_k_extent` picks chunks of `k_extent = 256 * num_k` (≤ 31 KiB / (16 +
//!   rows), floored to a multiple of 256 that divides `ne00`), chunks `k0` in order and
//!   inside each chunk slabs `0..num_k` in order, again one microtile call (one fma) per slab.
//! Every microtile call handles exactly one super-block and does the epilogue for it, so the
//! float sequence per element is the same for any `k_extent`, window (256×256 macrotiles,
//! ragged edges, 16×16 microtiles as two 8×16 bands) or thread chunking (chunks of 256 rows /
//! columns; each output is owned by one thread). Zero-padded activation rows / ragged weight
//! rows only produce outputs that are not stored.

#![allow(dead_code)]

use crate::quant::f16_to_f32;

/// Bytes of one Q6_K block: ql[128], qh[64], scales[16] (i8), d (f16).
const Q6K_BYTES: usize = 210;
/// Bytes of one Q8_K block: d (f32), qs[256] (i8), bsums[16] (i16).
const Q8K_BYTES: usize = 292;
const QK_K: usize = 256;

/// Quantizes one activation row (length a multiple of 256) to Q8_K bytes
/// (`nb * 292`: f32 d, 256 i8 quants, 16 i16 bsums per block), as the tiled path's
/// `from_float` (= `quantize_row_q8_K_ref` on x86) does.
pub(crate) fn quantize_act_q8k_tiled(x: &[f32]) -> Vec<u8> {
    assert_eq!(x.len() % QK_K, 0);
    let mut out = vec![0u8; x.len() / QK_K * Q8K_BYTES];
    crate::quant::quantize(crate::types::GgmlType::Q8_K, x, &mut out)
        .expect("Q8_K quantization of a whole number of blocks");
    out
}

/// The 256 unsigned 6-bit codes (0..63) of a Q6_K block, natural element order.
#[inline]
fn q6k_codes(blk: &[u8]) -> [u8; QK_K] {
    let ql = &blk[0..128];
    let qh = &blk[128..192];
    let mut w = [0u8; QK_K];
    for h in 0..2 {
        for quarter in 0..4 {
            for l in 0..32 {
                let lo = ql[64 * h + 32 * (quarter & 1) + l];
                let lo = if quarter >= 2 { lo >> 4 } else { lo & 0x0f };
                let hi = (qh[32 * h + l] >> (2 * quarter)) & 3;
                w[128 * h + 32 * quarter + l] = lo | (hi << 4);
            }
        }
    }
    w
}

/// Per super-block exact integer `s1 = Σ_s sc[s] * (Σ_e w*q - 32 * bsums[s])` and the two
/// scales (`d0` of the weight block as f32, `d1` of the activation block).
#[inline]
fn block_s1(w: &[u8], a: &[u8]) -> (i32, f32, f32) {
    let codes = q6k_codes(w);
    let sc = &w[192..208];
    let d0 = f16_to_f32(u16::from_le_bytes([w[208], w[209]]));
    let d1 = f32::from_le_bytes([a[0], a[1], a[2], a[3]]);
    let q8 = &a[4..4 + QK_K];
    let mut s1 = 0i32;
    for s in 0..16 {
        let mut raw = 0i32;
        for e in 16 * s..16 * s + 16 {
            raw += codes[e] as i32 * (q8[e] as i8 as i32);
        }
        let bsum = i16::from_le_bytes([a[4 + QK_K + 2 * s], a[4 + QK_K + 2 * s + 1]]) as i32;
        let corr = raw.wrapping_sub(32i32.wrapping_mul(bsum));
        s1 = s1.wrapping_add((sc[s] as i8 as i32).wrapping_mul(corr));
    }
    (s1, d0, d1)
}

/// One output of llama.cpp's tiled matmul (x86 AVX-512 VNNI build): weight row `w_row`
/// (GGUF Q6_K bytes, `nb * 210`) times activation row `act` (Q8_K bytes from
/// [`quantize_act_q8k_tiled`], `nb * 292`). Per super-block: exact i32 `s1`, then
/// `acc = fma(f32(s1) * d0, d1, acc)` from `+0.0`, blocks in order (module docs).
/// Independent of the tiling, batch size (≥ 8) and thread count.
pub(crate) fn dot_q6k_tiled_ggml(w_row: &[u8], act: &[u8]) -> f32 {
    let nb = w_row.len() / Q6K_BYTES;
    debug_assert_eq!(w_row.len(), nb * Q6K_BYTES);
    debug_assert_eq!(act.len(), nb * Q8K_BYTES);
    let mut acc = 0f32;
    for b in 0..nb {
        let (s1, d0, d1) = block_s1(
            &w_row[b * Q6K_BYTES..(b + 1) * Q6K_BYTES],
            &act[b * Q8K_BYTES..(b + 1) * Q8K_BYTES],
        );
        let r = (s1 as f32) * d0;
        acc = r.mul_add(d1, acc);
    }
    acc
}

/// A different, plausible float order (vec_dot style `d = d1 * d0` then
/// `fma(f32(s1), d, acc)`), only used by the test to show the fixture discriminates.
#[cfg(test)]
fn dot_q6k_other_order(w_row: &[u8], act: &[u8]) -> f32 {
    let nb = w_row.len() / Q6K_BYTES;
    let mut acc = 0f32;
    for b in 0..nb {
        let (s1, d0, d1) = block_s1(
            &w_row[b * Q6K_BYTES..(b + 1) * Q6K_BYTES],
            &act[b * Q8K_BYTES..(b + 1) * Q8K_BYTES],
        );
        acc = (s1 as f32).mul_add(d1 * d0, acc);
    }
    acc
}

#[cfg(test)]
mod tests {
    //! Fixture written by `scripts/check_q6k_tiled.py` from llama.cpp forward-pass dumps
    //! (10 tokens ⇒ tiled path): slices of real Q6_K matmuls (weight rows, f32 inputs, the
    //! Q8_K bytes of libggml-cpu.so's `quantize_row_q8_K`, llama.cpp's outputs).
    use super::*;

    const FIXTURE: &str = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../tests/fixtures/q6k_tiled/q6k_tiled.bin"
    );

    struct Reader<'a>(&'a [u8]);
    impl<'a> Reader<'a> {
        fn u32(&mut self) -> usize {
            let v = u32::from_le_bytes(self.0[..4].try_into().unwrap());
            self.0 = &self.0[4..];
            v as usize
        }
        fn bytes(&mut self, n: usize) -> &'a [u8] {
            let (a, b) = self.0.split_at(n);
            self.0 = b;
            a
        }
        fn f32s(&mut self, n: usize) -> Vec<f32> {
            self.bytes(4 * n)
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                .collect()
        }
    }

    /// Checks every case of a fixture file; returns (q8 rows ok, rows, outputs ok, outputs,
    /// outputs the other float order would also get right).
    fn check_file(path: &str) -> [usize; 5] {
        let data = match std::fs::read(path) {
            Ok(d) => d,
            Err(e) => panic!("fixture {path}: {e}"),
        };
        let mut r = Reader(&data);
        let ncases = r.u32();
        let mut total = [0usize; 5];
        for case in 0..ncases {
            // k, n weight rows, m activation rows (top bit: the f32 inputs are included)
            let (k, n, m) = (r.u32(), r.u32(), r.u32());
            let has_x = m & 0x8000_0000 != 0;
            let m = m & 0x7fff_ffff;
            let nb = k / QK_K;
            let w = r.bytes(n * nb * Q6K_BYTES);
            let x = if has_x { r.f32s(m * k) } else { Vec::new() };
            let q8 = r.bytes(m * nb * Q8K_BYTES);
            let want = r.f32s(m * n);
            let rb = nb * Q8K_BYTES;
            let mut qok = 0;
            for i in (0..m).filter(|_| has_x) {
                let mine = quantize_act_q8k_tiled(&x[i * k..(i + 1) * k]);
                if mine[..] == q8[i * rb..(i + 1) * rb] {
                    qok += 1;
                } else {
                    eprintln!("case {case}: q8 row {i} differs");
                }
            }
            let (mut ook, mut other_ok) = (0, 0);
            for i in 0..m {
                let a = &q8[i * rb..(i + 1) * rb];
                for j in 0..n {
                    let wr = &w[j * nb * Q6K_BYTES..(j + 1) * nb * Q6K_BYTES];
                    let got = dot_q6k_tiled_ggml(wr, a);
                    let e = want[i * n + j];
                    if dot_q6k_other_order(wr, a).to_bits() == e.to_bits() {
                        other_ok += 1;
                    }
                    if got.to_bits() == e.to_bits() {
                        ook += 1;
                    } else if ook + 20 > i * n + j {
                        eprintln!("case {case}: out[{i}][{j}] = {got:e} want {e:e}");
                    }
                }
            }
            eprintln!(
                "case {case}: k={k} n={n} m={m}: q8 rows {qok}/{}, outputs {ook}/{} (other order {other_ok})",
                if has_x { m } else { 0 },
                m * n
            );
            total[0] += qok;
            total[1] += if has_x { m } else { 0 };
            total[2] += ook;
            total[3] += m * n;
            total[4] += other_ok;
        }
        assert!(r.0.is_empty());
        eprintln!(
            "total: q8 rows {}/{}, outputs {}/{} (other float order: {})",
            total[0], total[1], total[2], total[3], total[4]
        );
        total
    }

    #[test]
    fn q6k_tiled_matches_llama_cpp() {
        let t = check_file(FIXTURE);
        assert_eq!(t[0], t[1]);
        assert_eq!(t[2], t[3]);
        assert!(t[4] < t[3], "fixture does not discriminate the float order");
    }

    /// Whole matmuls: `Q6K_TILED_FULL=/path/full.bin cargo test --release -p rustorch-core
    /// --lib q6k -- --ignored` (file written by `scripts/check_q6k_tiled.py --full`).
    #[test]
    #[ignore]
    fn q6k_tiled_full_dump() {
        let Ok(path) = std::env::var("Q6K_TILED_FULL") else {
            eprintln!("Q6K_TILED_FULL not set");
            return;
        };
        let t = check_file(&path);
        assert_eq!(t[0], t[1]);
        assert_eq!(t[2], t[3]);
    }
}
