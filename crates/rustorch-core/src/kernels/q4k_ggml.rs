//! Bit-exact scalar emulation of llama.cpp's x86 (AVX2 / AVX-512 build) arithmetic for
//! Q4_K weight × Q8_K activation matmuls done through the *repacked* `q4_K_8x8_q8_K` path
//! (`ggml-cpu/repack.cpp` + `ggml-cpu/arch/x86/repack.cpp`), working on the original
//! (not repacked) GGUF bytes.
//!
//! # When llama.cpp uses this path
//!
//! On an AVX2/AVX-512 CPU every Q4_K weight tensor whose row count (`ne[1]`) is a multiple of
//! 8 is repacked into `block_q4_Kx8` (8 weight rows interleaved) and `MUL_MAT` goes through
//! `tensor_traits<block_q4_K, 8, 8, Q8_K>::forward_mul_mat`:
//!
//! * src1 (the f32 activations, `ne11` rows per plane) is quantized once:
//!   - rows `0 .. ne11 - ne11 % 4` in groups of 4 with `ggml_quantize_mat_q8_K_4x8`
//!     (→ [`quantize_rows_q8k_4x8_ggml`]);
//!   - the remaining `ne11 % 4` rows, one by one, with `quantize_row_q8_K`, which on x86 is
//!     exactly `quantize_row_q8_K_ref` (the crate's reference Q8_K quantizer,
//!     `crate::quant::quantize(GgmlType::Q8_K, ..)`, is that one; not duplicated here).
//! * the same split is used for the products: in every chunk, `nrows = ne11` (src1 is chunked
//!   only by whole planes) so rows `0 .. ne11 - ne11 % 4` go through
//!   `ggml_gemm_q4_K_8x8_q8_K` (→ [`dot_q4k_gemm_ggml`]) and the last `ne11 % 4` rows through
//!   `ggml_gemv_q4_K_8x8_q8_K` (→ [`dot_q4k_gemv_ggml`]). With fewer than 4 rows (e.g. token
//!   generation, 1 row) everything is gemv. Example: 10 prompt tokens → rows 0..8 gemm,
//!   rows 8, 9 gemv.
//! * the split of weight rows (src0) over threads/chunks (multiples of 8, and inside the
//!   AVX-512 gemm pairs of 8-row groups with an AVX2 tail for an odd group) never changes an
//!   output: each output element is computed by one lane with the same float steps in all
//!   variants (AVX-512 16-row-tile, AVX-512 4-row-tile, AVX2 tails all do the same
//!   per-element arithmetic described below). Results do not depend on the thread count.
//!
//! # Activation quantization (`ggml_quantize_mat_q8_K_4x8`, AVX2 code, also used by AVX-512)
//!
//! Per row and per 256-element super-block, identical to `quantize_row_q8_K_ref` except for
//! how the sign of the scale is chosen:
//! * `amax = max |x|`.
//! * ref: `max` = the *first* element (in order) with `|x| == amax`; `iscale = -127 / max`.
//! * 4x8: `iscale = -127 / amax` if **any** element equals `+amax`, else `127 / amax`.
//!   Since `-127/(-amax) == 127/amax` exactly, the two differ only when both `+amax` and
//!   `-amax` occur and `-amax` comes first (ref: positive iscale, 4x8: negative iscale — all
//!   quants and `d` flip sign).
//! * `amax == 0`: `d = 0`, all quants 0.
//! * `d = 1 / iscale` (f32 division), quants `q = round_half_even(x * iscale)` (one f32
//!   multiply, `_mm256_round_ps(.., _MM_ROUND_NEAREST)` then saturating packs to i8; the ref's
//!   `nearest_int` is the same rounding and `|x*iscale| <= 127` so no clamping ever happens).
//! * bsums: exact integer sums of 16 consecutive quants (only their storage order is
//!   interleaved in `block_q8_Kx4`; un-interleaved they equal the ref layout).
//!
//! # Weight decoding (exact, integer)
//!
//! For a Q4_K super-block: `dw = f16(d)`, `dmw = f16(dmin)`, 8 sub-blocks of 32 with 6-bit
//! `sc[s]`, `m[s]` (`get_scale_min_k4`), 4-bit quants `w[s][i]` (byte `qs[32*(s/2) + i]`, low
//! nibble for even `s`, high nibble for odd `s`). With Q8_K activations `d_a`, `q[256]`,
//! `bsums[16]` define the exact integers
//! * `dot[s] = Σ_{i<32} w[s][i] * q[32 s + i]`
//! * `B[s]  = bsums[2 s] + bsums[2 s + 1]` (= Σ of the 32 activation quants of sub-block s)
//!
//! (The SIMD code accumulates in i16 lanes via `maddubs`; with u4 × i8 and ≤ 16 products per
//! lane there is no saturation or wrap, so all integer partial sums below are exact.)
//!
//! # Float accumulation, gemv (`ggml_gemv_q4_K_8x8_q8_K`, AVX2 code; no AVX-512 variant)
//!
//! Per output (weight row, activation row), two f32 accumulators starting at +0.0, for each
//! super-block `b` in order:
//! ```text
//! isum = Σ_{s<8} sc[s] * dot[s]          (i32, exact)
//! imin = Σ_{s<8} m[s]  * B[s]            (i32, exact)
//! acc  = fma(f32(isum), dw  * d_a, acc)  (dw*d_a: one f32 multiply, rounded)
//! accm = fma(f32(imin), dmw * d_a, accm)
//! ```
//! result = `acc - accm` (one f32 subtraction; no horizontal reduction — each output is one
//! SIMD lane). `f32(i32)` is `cvtdq2ps`, round-to-nearest-even (same as Rust `as f32`).
//!
//! # Float accumulation, gemm (`ggml_gemm_q4_K_8x8_q8_K`, AVX-512BW/DQ code and AVX2 tails)
//!
//! Same as gemv except that the float accumulation is done per *pair* of sub-blocks
//! (`sb` loop, 64 elements), i.e. 4 fmas per super-block for each accumulator:
//! ```text
//! for b in 0..nb, for p in 0..4:
//!     isum = sc[2p] * dot[2p] + sc[2p+1] * dot[2p+1]        (i32, exact)
//!     imin = m[2p]  * B[2p]   + m[2p+1]  * B[2p+1]          (i32, exact)
//!     acc  = fma(f32(isum), dw  * d_a, acc)
//!     accm = fma(f32(imin), dmw * d_a, accm)
//! result = acc - accm
//! ```
//! where `d_a`, `q`, `B` come from the 4x8-quantized activations.

#![allow(dead_code)]

use crate::quant::f16_to_f32;

/// Bytes of one Q4_K block.
const Q4K_BYTES: usize = 144;
/// Bytes of one Q8_K block.
const Q8K_BYTES: usize = 292;
const QK_K: usize = 256;

/// The 6-bit scale and min of sub-block `j` (ggml's `get_scale_min_k4`).
#[inline]
fn scale_min(j: usize, q: &[u8]) -> (i32, i32) {
    if j < 4 {
        ((q[j] & 63) as i32, (q[j + 4] & 63) as i32)
    } else {
        (
            ((q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4)) as i32,
            ((q[j + 4] >> 4) | ((q[j] >> 6) << 4)) as i32,
        )
    }
}

/// Per super-block integer data: (`dw`, `dmw`, `d_a`, `sc[s]*dot[s]`, `m[s]*B[s]`).
#[inline]
fn block_ints(w: &[u8], a: &[u8]) -> (f32, f32, f32, [i32; 8], [i32; 8]) {
    let dw = f16_to_f32(u16::from_le_bytes([w[0], w[1]]));
    let dmw = f16_to_f32(u16::from_le_bytes([w[2], w[3]]));
    let scales = &w[4..16];
    let qs = &w[16..144];
    let da = f32::from_le_bytes([a[0], a[1], a[2], a[3]]);
    let q8 = &a[4..4 + QK_K];
    let bs = |g: usize| i16::from_le_bytes([a[4 + QK_K + 2 * g], a[4 + QK_K + 2 * g + 1]]) as i32;
    let mut sd = [0i32; 8];
    let mut mb = [0i32; 8];
    for s in 0..8 {
        let (sc, m) = scale_min(s, scales);
        let shift = 4 * (s & 1);
        let base = 32 * (s / 2);
        let mut dot = 0i32;
        for i in 0..32 {
            let wq = ((qs[base + i] >> shift) & 0x0f) as i32;
            dot += wq * (q8[32 * s + i] as i8 as i32);
        }
        sd[s] = sc * dot;
        mb[s] = m * (bs(2 * s) + bs(2 * s + 1));
    }
    (dw, dmw, da, sd, mb)
}

/// One output of `ggml_gemv_q4_K_8x8_q8_K` (x86 build): weight row `w_row` (GGUF Q4_K bytes,
/// `nb * 144`) times activation row `a_row` (Q8_K bytes from `quantize_row_q8_K` =
/// `quantize_row_q8_K_ref`, `nb * 292`). Float steps: one fma per super-block for the
/// scaled sums and one for the mins, then `acc - accm` (see the module docs).
pub(crate) fn dot_q4k_gemv_ggml(w_row: &[u8], a_row: &[u8]) -> f32 {
    let nb = w_row.len() / Q4K_BYTES;
    debug_assert_eq!(a_row.len(), nb * Q8K_BYTES);
    let mut acc = 0f32;
    let mut accm = 0f32;
    for b in 0..nb {
        let (dw, dmw, da, sd, mb) = block_ints(
            &w_row[b * Q4K_BYTES..(b + 1) * Q4K_BYTES],
            &a_row[b * Q8K_BYTES..(b + 1) * Q8K_BYTES],
        );
        let isum: i32 = sd.iter().sum();
        let imin: i32 = mb.iter().sum();
        acc = (isum as f32).mul_add(dw * da, acc);
        accm = (imin as f32).mul_add(dmw * da, accm);
    }
    acc - accm
}

/// One output of `ggml_gemm_q4_K_8x8_q8_K` (x86 AVX-512 build, also its AVX2 tails): weight
/// row `w_row` (GGUF Q4_K bytes) times activation row `a_row` (Q8_K bytes as produced by
/// [`quantize_rows_q8k_4x8_ggml`], un-interleaved). Float steps: one fma per pair of
/// sub-blocks (4 per super-block) for the scaled sums and for the mins, then `acc - accm`.
pub(crate) fn dot_q4k_gemm_ggml(w_row: &[u8], a_row: &[u8]) -> f32 {
    let nb = w_row.len() / Q4K_BYTES;
    debug_assert_eq!(a_row.len(), nb * Q8K_BYTES);
    let mut acc = 0f32;
    let mut accm = 0f32;
    for b in 0..nb {
        let (dw, dmw, da, sd, mb) = block_ints(
            &w_row[b * Q4K_BYTES..(b + 1) * Q4K_BYTES],
            &a_row[b * Q8K_BYTES..(b + 1) * Q8K_BYTES],
        );
        let ds = dw * da;
        let dm = dmw * da;
        for p in 0..4 {
            let isum = sd[2 * p] + sd[2 * p + 1];
            let imin = mb[2 * p] + mb[2 * p + 1];
            acc = (isum as f32).mul_add(ds, acc);
            accm = (imin as f32).mul_add(dm, accm);
        }
    }
    acc - accm
}

/// Quantizes one row (whole super-blocks) to Q8_K bytes exactly as
/// `ggml_quantize_mat_q8_K_4x8` does for each of its 4 rows (x86 AVX2/AVX-512 build), in the
/// plain `block_q8_K` layout (f32 d, 256 i8, 16 i16 bsums). Differs from
/// `quantize_row_q8_K_ref` only in the sign choice on ±amax ties (module docs).
pub(crate) fn quantize_row_q8k_4x8_ggml(x: &[f32], out: &mut [u8]) {
    let nb = x.len() / QK_K;
    debug_assert_eq!(x.len(), nb * QK_K);
    debug_assert!(out.len() >= nb * Q8K_BYTES);
    for b in 0..nb {
        let xs = &x[b * QK_K..(b + 1) * QK_K];
        let o = &mut out[b * Q8K_BYTES..(b + 1) * Q8K_BYTES];
        let amax = xs.iter().fold(0f32, |m, &v| m.max(v.abs()));
        let (iscale, d) = if amax != 0.0 {
            let iscale = if xs.iter().any(|&v| v == amax) {
                -127.0 / amax
            } else {
                127.0 / amax
            };
            (iscale, 1.0 / iscale)
        } else {
            (0.0, 0.0)
        };
        o[0..4].copy_from_slice(&d.to_le_bytes());
        for (j, &v) in xs.iter().enumerate() {
            let q = ((v * iscale).round_ties_even() as i32).clamp(-128, 127);
            o[4 + j] = q as i8 as u8;
        }
        for g in 0..16 {
            let s: i32 = o[4 + 16 * g..4 + 16 * g + 16]
                .iter()
                .map(|&q| q as i8 as i32)
                .sum();
            o[4 + QK_K + 2 * g..4 + QK_K + 2 * g + 2].copy_from_slice(&(s as i16).to_le_bytes());
        }
    }
}

/// `ggml_quantize_mat_q8_K_4x8` for 4 rows, written un-interleaved: `out[r]` receives row
/// `r`'s Q8_K blocks (`n/256 * 292` bytes) — the bytes ggml interleaves into
/// `block_q8_Kx4`. The rows are quantized independently.
pub(crate) fn quantize_rows_q8k_4x8_ggml(x: [&[f32]; 4], out: [&mut [u8]; 4]) {
    for (xr, or) in x.into_iter().zip(out) {
        quantize_row_q8k_4x8_ggml(xr, or);
    }
}

#[cfg(test)]
mod tests {
    //! Fixture written by `scripts/check_q4k_ggml.py` from the real libggml-cpu.so
    //! (`ggml_quantize_mat_q8_K_4x8`, `quantize_row_q8_K`, `ggml_gemm_q4_K_8x8_q8_K`,
    //! `ggml_gemv_q4_K_8x8_q8_K`) and from a llama.cpp forward pass dump.
    use super::*;

    const FIXTURE: &str = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../tests/fixtures/q4k_ggml/q4k_ggml.bin"
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

    /// One case: `n` weight rows × `k` (Q4_K bytes), `m` activation rows (f32), the expected
    /// Q8_K bytes of every activation row (gemm rows from 4x8, gemv rows from
    /// quantize_row_q8_K) and the expected outputs `[m][n]`; rows `< m_gemm` are gemm rows.
    #[test]
    fn q4k_ggml_matches_libggml() {
        let data = match std::fs::read(FIXTURE) {
            Ok(d) => d,
            Err(e) => panic!("fixture {FIXTURE}: {e}"),
        };
        let mut r = Reader(&data);
        let ncases = r.u32();
        let mut total = [0usize; 5]; // quant rows, quant ok, outputs, outputs ok, other-path mismatches
        for case in 0..ncases {
            let (k, n, m, m_gemm) = (r.u32(), r.u32(), r.u32(), r.u32());
            let nb = k / QK_K;
            let w = r.bytes(n * nb * Q4K_BYTES);
            let x = r.f32s(m * k);
            let q8 = r.bytes(m * nb * Q8K_BYTES);
            let want = r.f32s(m * n);
            let rb = nb * Q8K_BYTES;
            // activation quantization
            let mut mine = vec![0u8; m * rb];
            for g in 0..m_gemm / 4 {
                let xs: [&[f32]; 4] =
                    std::array::from_fn(|i| &x[(4 * g + i) * k..(4 * g + i + 1) * k]);
                let (a, rest) = mine[4 * g * rb..].split_at_mut(rb);
                let (b, rest) = rest.split_at_mut(rb);
                let (c, rest) = rest.split_at_mut(rb);
                quantize_rows_q8k_4x8_ggml(xs, [a, b, c, &mut rest[..rb]]);
            }
            for i in m_gemm..m {
                crate::quant::quantize(
                    crate::types::GgmlType::Q8_K,
                    &x[i * k..(i + 1) * k],
                    &mut mine[i * rb..(i + 1) * rb],
                )
                .unwrap();
            }
            let mut qok = 0;
            for i in 0..m {
                if mine[i * rb..(i + 1) * rb] == q8[i * rb..(i + 1) * rb] {
                    qok += 1;
                } else {
                    eprintln!("case {case}: q8 row {i} differs");
                }
            }
            // products, on ggml's own activation bytes
            let mut ook = 0;
            for i in 0..m {
                let a = &q8[i * rb..(i + 1) * rb];
                for j in 0..n {
                    let wr = &w[j * nb * Q4K_BYTES..(j + 1) * nb * Q4K_BYTES];
                    let got = if i < m_gemm {
                        dot_q4k_gemm_ggml(wr, a)
                    } else {
                        dot_q4k_gemv_ggml(wr, a)
                    };
                    let e = want[i * n + j];
                    // sensitivity: the other path's float order would give these bits
                    let other = if i < m_gemm {
                        dot_q4k_gemv_ggml(wr, a)
                    } else {
                        dot_q4k_gemm_ggml(wr, a)
                    };
                    if other.to_bits() != e.to_bits() {
                        total[4] += 1;
                    }
                    if got.to_bits() == e.to_bits() {
                        ook += 1;
                    } else if ook + 20 > i * n + j {
                        eprintln!("case {case}: out[{i}][{j}] = {got:e} want {e:e}");
                    }
                }
            }
            eprintln!("case {case}: k={k} n={n} m={m} (gemm {m_gemm}): q8 rows {qok}/{m}, outputs {ook}/{}", m * n);
            total[0] += m;
            total[1] += qok;
            total[2] += m * n;
            total[3] += ook;
        }
        assert!(r.0.is_empty());
        eprintln!(
            "total: q8 rows {}/{}, outputs {}/{} (the other path's formula would miss {})",
            total[1], total[0], total[3], total[2], total[4]
        );
        assert_eq!(total[0], total[1]);
        assert_eq!(total[2], total[3]);
    }
}
