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

/// [`quantize_row_q8k_4x8_ggml`] compiled for the CPU's vector rounding where available
/// (otherwise `round_ties_even` is a library call).
pub(crate) fn quantize_row_q8k_4x8(x: &[f32], out: &mut [u8]) {
    #[cfg(target_arch = "x86_64")]
    if super::isa() == super::Isa::Avx512 {
        // SAFETY: AVX-512 F/BW was detected; the lengths are those of the scalar encoder.
        unsafe { x86::quantize_row_q8k_4x8_avx512(x, out) };
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if matches!(super::isa(), super::Isa::Avx2 | super::Isa::Avx512) {
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn fast(x: &[f32], out: &mut [u8]) {
            quantize_row_q8k_4x8_ggml(x, out)
        }
        // SAFETY: the family (AVX2, FMA, F16C) was detected.
        unsafe { fast(x, out) };
        return;
    }
    quantize_row_q8k_4x8_ggml(x, out)
}

/// Quantizes one row (whole super-blocks) to Q8_K bytes exactly as
/// `ggml_quantize_mat_q8_K_4x8` does for each of its 4 rows (x86 AVX2/AVX-512 build), in the
/// plain `block_q8_K` layout (f32 d, 256 i8, 16 i16 bsums). Differs from
/// `quantize_row_q8_K_ref` only in the sign choice on ±amax ties (module docs).
/// (`inline(always)`: inlined into an AVX2 caller, the rounding is one instruction instead
/// of a `rintf` call per value.)
#[inline(always)]
pub(crate) fn quantize_row_q8k_4x8_ggml(x: &[f32], out: &mut [u8]) {
    let nb = x.len() / QK_K;
    debug_assert_eq!(x.len(), nb * QK_K);
    debug_assert!(out.len() >= nb * Q8K_BYTES);
    for b in 0..nb {
        let xs = &x[b * QK_K..(b + 1) * QK_K];
        let o = &mut out[b * Q8K_BYTES..(b + 1) * Q8K_BYTES];
        let amax = xs.iter().fold(0f32, |m, &v| m.max(v.abs()));
        let (iscale, d) = if amax != 0.0 {
            let iscale = if xs.contains(&amax) {
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

/// AVX2 (+FMA, F16C) versions of [`dot_q4k_gemv_ggml`] / [`dot_q4k_gemm_ggml`] over tiles of
/// weight rows × activation rows, bit-identical to the scalar functions: the integer parts
/// (exact, any order) come from `maddubs`/`madd`, the float steps are lane-wise the scalar
/// ones (`f32(isum)`, `dw * d_a`, one fma per super-block or per sub-block pair, `acc - accm`).
#[cfg(target_arch = "x86_64")]
pub(crate) mod x86 {
    use super::{Q4K_BYTES, Q8K_BYTES, QK_K};
    use core::arch::x86_64::*;

    /// [`super::quantize_row_q8k_4x8_ggml`] with AVX-512, byte for byte: one group of 16
    /// quants (one bsum) per register; `cvtps_epi32` rounds half to even as
    /// `round_ties_even` does. Blocks with non-finite values go to the scalar encoder.
    ///
    /// # Safety
    /// AVX-512 F/BW must be available; `x.len()` is a multiple of 256 and `out` holds
    /// `x.len() / 256` Q8_K blocks.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    pub(crate) unsafe fn quantize_row_q8k_4x8_avx512(x: &[f32], out: &mut [u8]) {
        let nb = x.len() / QK_K;
        debug_assert!(out.len() >= nb * Q8K_BYTES);
        for b in 0..nb {
            let xs = x.as_ptr().add(b * QK_K);
            let o = out.as_mut_ptr().add(b * Q8K_BYTES);
            let v: [__m512; 16] = std::array::from_fn(|i| _mm512_loadu_ps(xs.add(16 * i)));
            let mut amax = _mm512_setzero_ps();
            let mut finite = true;
            for &vi in &v {
                let a = _mm512_abs_ps(vi);
                finite &= _mm512_cmp_ps_mask::<_CMP_LE_OQ>(a, _mm512_set1_ps(f32::MAX)) == 0xffff;
                amax = _mm512_max_ps(amax, a);
            }
            if !finite {
                super::quantize_row_q8k_4x8_ggml(
                    &x[b * QK_K..(b + 1) * QK_K],
                    &mut out[b * Q8K_BYTES..(b + 1) * Q8K_BYTES],
                );
                continue;
            }
            let amax = _mm512_reduce_max_ps(amax);
            let (iscale, d) = if amax != 0.0 {
                let am = _mm512_set1_ps(amax);
                let pos = v
                    .iter()
                    .any(|&vi| _mm512_cmp_ps_mask::<_CMP_EQ_OQ>(vi, am) != 0);
                let iscale = if pos { -127.0 / amax } else { 127.0 / amax };
                (iscale, 1.0 / iscale)
            } else {
                (0.0, 0.0)
            };
            std::ptr::write_unaligned(o as *mut f32, d);
            let is = _mm512_set1_ps(iscale);
            let (lo, hi) = (_mm512_set1_epi32(-128), _mm512_set1_epi32(127));
            for (g, &vi) in v.iter().enumerate() {
                let q = _mm512_cvtps_epi32(_mm512_mul_ps(vi, is));
                let q = _mm512_min_epi32(_mm512_max_epi32(q, lo), hi);
                _mm_storeu_si128(o.add(4 + 16 * g) as *mut __m128i, _mm512_cvtepi32_epi8(q));
                let s = _mm512_reduce_add_epi32(q) as i16;
                std::ptr::write_unaligned(o.add(4 + QK_K + 2 * g) as *mut i16, s);
            }
        }
    }

    /// Unpacked Q4_K super-block: the 8 sub-blocks' 4-bit quants (32 bytes each), each
    /// sub-block scale broadcast to 16 i16 lanes, and the mins duplicated per bsum pair.
    struct Block {
        q: [__m256i; 8],
        sc: [__m256i; 8],
        mdup: __m256i,
    }

    /// `[sc0..sc7, m0..m7]` (u8) of the block at `wb` (ggml's `get_scale_min_k4` for all 8).
    #[inline(always)]
    unsafe fn scales_mins(wb: *const u8) -> __m128i {
        let p = wb.add(4);
        let a0 = (p as *const u32).read_unaligned();
        let a1 = (p.add(4) as *const u32).read_unaligned();
        let a2 = (p.add(8) as *const u32).read_unaligned();
        let sc_lo = a0 & 0x3f3f_3f3f;
        let m_lo = a1 & 0x3f3f_3f3f;
        let sc_hi = (a2 & 0x0f0f_0f0f) | (((a0 >> 6) & 0x0303_0303) << 4);
        let m_hi = ((a2 >> 4) & 0x0f0f_0f0f) | (((a1 >> 6) & 0x0303_0303) << 4);
        _mm_setr_epi32(sc_lo as i32, sc_hi as i32, m_lo as i32, m_hi as i32)
    }

    #[inline(always)]
    unsafe fn unpack(wb: *const u8) -> Block {
        let sm = _mm256_broadcastsi128_si256(scales_mins(wb));
        let low = _mm256_set1_epi8(0x0f);
        let qs = wb.add(16);
        let mut q = [_mm256_setzero_si256(); 8];
        for k in 0..4 {
            let x = _mm256_loadu_si256(qs.add(32 * k) as *const __m256i);
            q[2 * k] = _mm256_and_si256(x, low);
            q[2 * k + 1] = _mm256_and_si256(_mm256_srli_epi16(x, 4), low);
        }
        let mut sc = [_mm256_setzero_si256(); 8];
        for (s, v) in sc.iter_mut().enumerate() {
            // i16 lanes = sc[s]: bytes (s, zero) repeated
            let m = _mm256_set1_epi16((s as i16) | (0x80u16 << 8) as i16);
            *v = _mm256_shuffle_epi8(sm, m);
        }
        // i16 lanes [m0 m0 m1 m1 .. m3 m3 | m4 m4 .. m7 m7]
        let mdup = _mm256_shuffle_epi8(
            sm,
            _mm256_setr_epi8(
                8, -128, 8, -128, 9, -128, 9, -128, 10, -128, 10, -128, 11, -128, 11, -128, 12,
                -128, 12, -128, 13, -128, 13, -128, 14, -128, 14, -128, 15, -128, 15, -128,
            ),
        );
        Block { q, sc, mdup }
    }

    /// `sc[s] * (partial dot of sub-block s)` in 8 i32 lanes, for sub-block `s`.
    #[inline(always)]
    unsafe fn sub(blk: &Block, a: *const u8, s: usize) -> __m256i {
        let qa = _mm256_loadu_si256(a.add(4 + 32 * s) as *const __m256i);
        _mm256_madd_epi16(_mm256_maddubs_epi16(blk.q[s], qa), blk.sc[s])
    }

    /// Lane s = `m[s] * B[s]`.
    #[inline(always)]
    unsafe fn mins(blk: &Block, a: *const u8) -> __m256i {
        let bs = _mm256_loadu_si256(a.add(4 + QK_K) as *const __m256i);
        _mm256_madd_epi16(bs, blk.mdup)
    }

    /// Lane j = sum of the 8 lanes of `v[j]`.
    #[inline(always)]
    unsafe fn hsum8(v: &[__m256i; 8]) -> __m256i {
        let a01 = _mm256_hadd_epi32(v[0], v[1]);
        let a23 = _mm256_hadd_epi32(v[2], v[3]);
        let a45 = _mm256_hadd_epi32(v[4], v[5]);
        let a67 = _mm256_hadd_epi32(v[6], v[7]);
        let b0 = _mm256_hadd_epi32(a01, a23);
        let b1 = _mm256_hadd_epi32(a45, a67);
        _mm256_add_epi32(
            _mm256_permute2x128_si256(b0, b1, 0x20),
            _mm256_permute2x128_si256(b0, b1, 0x31),
        )
    }

    #[inline(always)]
    unsafe fn da(a: *const u8) -> f32 {
        (a as *const f32).read_unaligned()
    }

    /// `out[t * ostride + r] = dot(row r, activation row t)` for `r < nrows`, `t < nt <= T`,
    /// with [`super::dot_q4k_gemm_ggml`]'s float order if `GEMM`, else
    /// [`super::dot_q4k_gemv_ggml`]'s. Weight row `r` is `nb` Q4_K blocks at `w + r * rb`,
    /// activation row `t` is `nb` Q8_K blocks at `acts[t]` (entries `>= nt` are ignored).
    ///
    /// # Safety
    /// The CPU must support AVX2, FMA and F16C; all pointers must be valid for the sizes
    /// above and `out` for every written element.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) unsafe fn tile<const GEMM: bool, const T: usize>(
        w: *const u8,
        rb: usize,
        nrows: usize,
        nb: usize,
        acts: &[*const u8; T],
        nt: usize,
        out: *mut f32,
        ostride: usize,
    ) {
        debug_assert!(nt <= T);
        if nt == 0 || nrows == 0 {
            return;
        }
        if GEMM {
            let mut t0 = 0;
            while t0 < nt {
                let mut groups = [[acts[0]; 4]; 4];
                let mut nts = [0usize; 4];
                let mut ng = 0;
                let base = t0;
                while ng < 4 && t0 < nt {
                    let n = (nt - t0).min(4);
                    groups[ng] = core::array::from_fn(|i| acts[t0 + i.min(n - 1)]);
                    nts[ng] = n;
                    ng += 1;
                    t0 += 4;
                }
                gemm16(
                    w,
                    rb,
                    nrows,
                    nb,
                    &groups[..ng],
                    &nts[..ng],
                    out.add(base * ostride),
                    ostride,
                );
            }
        } else {
            gemv::<T>(w, rb, nrows, nb, acts, nt, out, ostride);
        }
    }

    /// Gemm order, one weight row at a time against up to 4 groups of 4 activation rows (each
    /// weight block is unpacked once for all of them); lanes `[acc(t0..t3) | accm(t0..t3)]`
    /// per group.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn gemm16(
        w: *const u8,
        rb: usize,
        nrows: usize,
        nb: usize,
        groups: &[[*const u8; 4]],
        nts: &[usize],
        out: *mut f32,
        ostride: usize,
    ) {
        let ng = groups.len().min(4);
        let perm = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
        let dup = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
        for r in 0..nrows {
            let wr = w.add(r * rb);
            let mut accs = [_mm256_setzero_ps(); 4];
            for b in 0..nb {
                let wb = wr.add(b * Q4K_BYTES);
                let hdr = (wb as *const u32).read_unaligned();
                // [dw dmw dw dmw ..] -> [dw x4 | dmw x4]
                let dwm =
                    _mm256_permutevar8x32_ps(_mm256_cvtph_ps(_mm_set1_epi32(hdr as i32)), dup);
                let blk = unpack(wb);
                for (acts, acc) in groups.iter().zip(accs.iter_mut()).take(ng) {
                    let a: [*const u8; 4] = core::array::from_fn(|t| acts[t].add(b * Q8K_BYTES));
                    let d4 = _mm_setr_ps(da(a[0]), da(a[1]), da(a[2]), da(a[3]));
                    let ds = _mm256_mul_ps(dwm, _mm256_set_m128(d4, d4));
                    let mut rt = [_mm256_setzero_si256(); 4];
                    for (t, rv) in rt.iter_mut().enumerate() {
                        let at = a[t];
                        let v: [__m256i; 4] = core::array::from_fn(|p| {
                            _mm256_add_epi32(sub(&blk, at, 2 * p), sub(&blk, at, 2 * p + 1))
                        });
                        // [P0 P1 P2 P3 | P0 P1 P2 P3] (low / high 128-bit partials)
                        let x = _mm256_hadd_epi32(
                            _mm256_hadd_epi32(v[0], v[1]),
                            _mm256_hadd_epi32(v[2], v[3]),
                        );
                        // [m0 m2 m4 m6 | m1 m3 m5 m7]
                        let y = _mm256_permutevar8x32_epi32(mins(&blk, at), perm);
                        *rv = _mm256_add_epi32(
                            _mm256_permute2x128_si256(x, y, 0x20),
                            _mm256_permute2x128_si256(x, y, 0x31),
                        ); // [P0..P3 | Q0..Q3]
                    }
                    let u0 = _mm256_unpacklo_epi32(rt[0], rt[1]);
                    let u1 = _mm256_unpackhi_epi32(rt[0], rt[1]);
                    let u2 = _mm256_unpacklo_epi32(rt[2], rt[3]);
                    let u3 = _mm256_unpackhi_epi32(rt[2], rt[3]);
                    let f = [
                        _mm256_unpacklo_epi64(u0, u2),
                        _mm256_unpackhi_epi64(u0, u2),
                        _mm256_unpacklo_epi64(u1, u3),
                        _mm256_unpackhi_epi64(u1, u3),
                    ]; // f[p] = [isum_p(t0..t3) | imin_p(t0..t3)]
                    for fp in f {
                        *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(fp), ds, *acc);
                    }
                }
            }
            for (g, acc) in accs.iter().enumerate().take(ng) {
                let res = _mm_sub_ps(_mm256_castps256_ps128(*acc), _mm256_extractf128_ps(*acc, 1));
                let mut o = [0f32; 4];
                _mm_storeu_ps(o.as_mut_ptr(), res);
                for (t, &v) in o.iter().enumerate().take(nts[g]) {
                    *out.add((4 * g + t) * ostride + r) = v;
                }
            }
        }
    }

    /// One activation row (reference Q8_K bytes at `a.q`) against `nrows` rows in the gemv
    /// order, with the fused GEMV job's signature (`kernels::GemvFn`).
    ///
    /// # Safety
    /// AVX2, FMA and F16C must be available; pointers must cover the stated sizes.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) unsafe fn gemv_repacked(
        w: *const u8,
        rb: usize,
        nrows: usize,
        nb: usize,
        a: crate::kernels::fmt::ActRow,
        out: *mut f32,
    ) {
        gemv::<1>(w, rb, nrows, nb, &[a.q], 1, out, 0)
    }

    /// [`gemv_repacked`] compiled for AVX-512: the same instructions' arithmetic, with 32
    /// vector registers.
    ///
    /// # Safety
    /// As [`gemv_repacked`], and AVX-512 F/BW/VL must be available.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    pub(crate) unsafe fn gemv_repacked512(
        w: *const u8,
        rb: usize,
        nrows: usize,
        nb: usize,
        a: crate::kernels::fmt::ActRow,
        out: *mut f32,
    ) {
        gemv::<1>(w, rb, nrows, nb, &[a.q], 1, out, 0)
    }

    /// Blocks per chunk of [`gemv`]: the integer sums of 8 rows × this many blocks (× `T`
    /// activation rows) are kept on the stack between the integer and the float passes.
    const GEMV_CHUNK: usize = 32;

    /// Gemv order, 8 weight rows per group in the lanes (as `ggml_gemv_q4_K_8x8_q8_K`), but
    /// the weights are read in memory order, row after row: llama.cpp's repacked layout
    /// interleaves the 8 rows so its gemv streams memory linearly; on the GGUF layout,
    /// walking the 8 rows block by block jumps `rb` bytes at every step, which the hardware
    /// prefetchers follow badly (2.3× less bandwidth from DRAM on Zen 4). The integer sums
    /// of each (row, block) are exact, so they are computed first, row by row, for a chunk
    /// of blocks, and the float steps then run block by block over the 8-row lanes in
    /// ggml's order.
    /// (Inlined into its callers, compiled for AVX2 or AVX-512.)
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    unsafe fn gemv<const T: usize>(
        w: *const u8,
        rb: usize,
        nrows: usize,
        nb: usize,
        acts: &[*const u8; T],
        nt: usize,
        out: *mut f32,
        ostride: usize,
    ) {
        // not zeroed: each chunk's integer pass writes every entry its float pass reads
        let mut scr_s = std::mem::MaybeUninit::<[[[__m256i; 8]; GEMV_CHUNK]; T]>::uninit();
        let mut scr_m = std::mem::MaybeUninit::<[[[__m256i; 8]; GEMV_CHUNK]; T]>::uninit();
        let (scr_s, scr_m) = (scr_s.as_mut_ptr(), scr_m.as_mut_ptr());
        let act = |t: usize| acts[t.min(nt - 1)];
        let mut r0 = 0;
        while r0 < nrows {
            let valid = (nrows - r0).min(8);
            let rows: [*const u8; 8] =
                core::array::from_fn(|j| w.add((r0 + j.min(valid - 1)) * rb));
            let mut acc = [_mm256_setzero_ps(); T];
            let mut accm = [_mm256_setzero_ps(); T];
            let mut b0 = 0;
            while b0 < nb {
                let nc = (nb - b0).min(GEMV_CHUNK);
                // integer pass, in memory order (rows past `valid` repeat the last row)
                for (j, row) in rows.iter().enumerate() {
                    for c in 0..nc {
                        let wb = row.add((b0 + c) * Q4K_BYTES);
                        // 2 KiB ahead of the stream (the best of 0.5, 1, 2, 4 KiB on Zen 4)
                        let p = wb.wrapping_add(2048);
                        _mm_prefetch::<_MM_HINT_T0>(p as *const i8);
                        _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(64) as *const i8);
                        _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(128) as *const i8);
                        let blk = unpack(wb);
                        for t in 0..T {
                            let at = act(t).add((b0 + c) * Q8K_BYTES);
                            let v01 = _mm256_add_epi32(sub(&blk, at, 0), sub(&blk, at, 1));
                            let v23 = _mm256_add_epi32(sub(&blk, at, 2), sub(&blk, at, 3));
                            let v45 = _mm256_add_epi32(sub(&blk, at, 4), sub(&blk, at, 5));
                            let v67 = _mm256_add_epi32(sub(&blk, at, 6), sub(&blk, at, 7));
                            (*scr_s)[t][c][j] = _mm256_add_epi32(
                                _mm256_add_epi32(v01, v23),
                                _mm256_add_epi32(v45, v67),
                            );
                            (*scr_m)[t][c][j] = mins(&blk, at);
                        }
                    }
                }
                // float pass, block by block over the 8 rows' lanes
                for c in 0..nc {
                    let off = (b0 + c) * Q4K_BYTES;
                    let dm: [u32; 8] =
                        core::array::from_fn(|j| (rows[j].add(off) as *const u32).read_unaligned());
                    let hv = _mm256_loadu_si256(dm.as_ptr() as *const __m256i);
                    let lo16 = _mm256_set1_epi32(0xffff);
                    // [d0..d3 m0..m3 | d4..d7 m4..m7] -> [d0..d7 | m0..m7]
                    let pk = _mm256_permute4x64_epi64(
                        _mm256_packus_epi32(_mm256_and_si256(hv, lo16), _mm256_srli_epi32(hv, 16)),
                        0b11_01_10_00,
                    );
                    let dwv = _mm256_cvtph_ps(_mm256_castsi256_si128(pk));
                    let dmv = _mm256_cvtph_ps(_mm256_extracti128_si256(pk, 1));
                    for t in 0..T {
                        let d = _mm256_set1_ps(da(act(t).add((b0 + c) * Q8K_BYTES)));
                        acc[t] = _mm256_fmadd_ps(
                            _mm256_cvtepi32_ps(hsum8(&(*scr_s)[t][c])),
                            _mm256_mul_ps(dwv, d),
                            acc[t],
                        );
                        accm[t] = _mm256_fmadd_ps(
                            _mm256_cvtepi32_ps(hsum8(&(*scr_m)[t][c])),
                            _mm256_mul_ps(dmv, d),
                            accm[t],
                        );
                    }
                }
                b0 += nc;
            }
            for t in 0..nt {
                let res = _mm256_sub_ps(acc[t], accm[t]);
                let o = out.add(t * ostride + r0);
                if valid == 8 {
                    _mm256_storeu_ps(o, res);
                } else {
                    let mut tmp = [0f32; 8];
                    _mm256_storeu_ps(tmp.as_mut_ptr(), res);
                    for (j, &v) in tmp.iter().enumerate().take(valid) {
                        *o.add(j) = v;
                    }
                }
            }
            r0 += 8;
        }
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
        let mut misses = Vec::new(); // the first differences, for the failure message
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
                } else if misses.len() < 20 {
                    misses.push(format!("case {case}: q8 row {i} differs"));
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
                    } else if misses.len() < 20 {
                        misses.push(format!("case {case}: out[{i}][{j}] = {got:e} want {e:e}"));
                    }
                }
            }
            total[0] += m;
            total[1] += qok;
            total[2] += m * n;
            total[3] += ook;
        }
        assert!(r.0.is_empty());
        let summary = format!(
            "q8 rows {}/{}, outputs {}/{} (the other path's formula would miss {}); first \
             differences: {misses:#?}",
            total[1], total[0], total[3], total[2], total[4]
        );
        assert_eq!(total[0], total[1], "{summary}");
        assert_eq!(total[2], total[3], "{summary}");
    }
}

#[cfg(all(test, target_arch = "x86_64"))]
mod simd_tests {
    use super::*;
    use crate::types::GgmlType;

    fn has_avx2() -> bool {
        crate::kernels::Isa::available().contains(&crate::kernels::Isa::Avx2)
    }

    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }
        /// Roughly normal, times a per-call magnitude.
        fn f(&mut self) -> f32 {
            let s: f32 = (0..4)
                .map(|_| (self.next() >> 40) as f32 / (1u64 << 24) as f32)
                .sum();
            s - 2.0
        }
    }

    fn weights(rng: &mut Rng, nrows: usize, nb: usize) -> Vec<u8> {
        let k = nb * QK_K;
        let mut w = vec![0u8; nrows * nb * Q4K_BYTES];
        for r in 0..nrows {
            let mag = [0.01f32, 1.0, 30.0][r % 3];
            let x: Vec<f32> = (0..k)
                .map(|i| {
                    // some sub-blocks strictly positive so the mins matter
                    let v = rng.f() * mag;
                    if (i / 32) % 3 == 1 {
                        v.abs() + mag
                    } else {
                        v
                    }
                })
                .collect();
            crate::quant::quantize(
                GgmlType::Q4_K,
                &x,
                &mut w[r * nb * Q4K_BYTES..(r + 1) * nb * Q4K_BYTES],
            )
            .unwrap();
        }
        w
    }

    /// Activation rows: 4x8 rule (gemm) or reference Q8_K (gemv).
    fn acts(rng: &mut Rng, n: usize, nb: usize, gemm: bool) -> Vec<u8> {
        let k = nb * QK_K;
        let mut a = vec![0u8; n * nb * Q8K_BYTES];
        for t in 0..n {
            let mag = [0.5f32, 7.0, 1e-3][t % 3];
            let x: Vec<f32> = (0..k).map(|_| rng.f() * mag).collect();
            let o = &mut a[t * nb * Q8K_BYTES..(t + 1) * nb * Q8K_BYTES];
            if gemm {
                quantize_row_q8k_4x8_ggml(&x, o);
            } else {
                crate::quant::quantize(GgmlType::Q8_K, &x, o).unwrap();
            }
        }
        a
    }

    fn check<const GEMM: bool, const T: usize>(rng: &mut Rng) -> usize {
        let mut n = 0;
        // long rows (more blocks than one gemv chunk) for the gemv order only
        let long: &[usize] = if GEMM { &[] } else { &[31, 32, 33, 70] };
        for &nrows in &[1usize, 7, 8, 16, 37] {
            for nb in (1..=6).chain(long.iter().copied()) {
                let w = weights(rng, nrows, nb);
                let a = acts(rng, T, nb, GEMM);
                let rb = nb * Q4K_BYTES;
                let ab = nb * Q8K_BYTES;
                for nt in 1..=T {
                    let ptrs: [*const u8; T] =
                        std::array::from_fn(|t| a[t.min(nt - 1) * ab..].as_ptr());
                    let ostride = nrows + 3;
                    let mut out = vec![f32::NAN; T * ostride];
                    unsafe {
                        x86::tile::<GEMM, T>(
                            w.as_ptr(),
                            rb,
                            nrows,
                            nb,
                            &ptrs,
                            nt,
                            out.as_mut_ptr(),
                            ostride,
                        )
                    };
                    for t in 0..T {
                        for r in 0..ostride {
                            let got = out[t * ostride + r];
                            if t >= nt || r >= nrows {
                                assert!(got.is_nan(), "wrote outside the tile");
                                continue;
                            }
                            let wr = &w[r * rb..(r + 1) * rb];
                            let ar = &a[t * ab..(t + 1) * ab];
                            let want = if GEMM {
                                dot_q4k_gemm_ggml(wr, ar)
                            } else {
                                dot_q4k_gemv_ggml(wr, ar)
                            };
                            assert_eq!(
                                got.to_bits(),
                                want.to_bits(),
                                "GEMM={GEMM} T={T} nrows={nrows} nb={nb} nt={nt} r={r} t={t}: {got:e} vs {want:e}"
                            );
                            n += 1;
                        }
                    }
                }
            }
        }
        n
    }

    /// The AVX-512 4x8 activation encoder writes the scalar encoder's bytes, including the
    /// sign choice when +amax occurs, all-zero blocks, and blocks with a non-finite value.
    #[test]
    fn q8k_4x8_avx512_encoder_bit_exact() {
        if !crate::kernels::Isa::available().contains(&crate::kernels::Isa::Avx512) {
            eprintln!("SKIPPED: no AVX-512");
            return;
        }
        let mut rng = Rng(0x2545_f491_4f6c_dd1d);
        for case in 0..300 {
            let nb = 1 + case % 3;
            let mag = [1e-3f32, 0.5, 7.0, 300.0][case % 4];
            let mut x: Vec<f32> = (0..nb * QK_K).map(|_| rng.f() * mag).collect();
            match case % 6 {
                // +amax present (and -amax too): the negative scale
                1 => {
                    x[3] = 9.0 * mag;
                    x[200] = -9.0 * mag;
                }
                // only -amax: the positive scale
                2 => x[17] = -9.0 * mag,
                3 => x[..QK_K].iter_mut().for_each(|v| *v = 0.0),
                // ties at .5 after scaling
                4 => {
                    x[0] = 127.0;
                    for (i, v) in x[1..QK_K].iter_mut().enumerate() {
                        *v = (i % 254) as f32 - 126.5;
                    }
                }
                5 if nb > 1 => x[QK_K + 5] = f32::INFINITY,
                _ => {}
            }
            let mut want = vec![0u8; nb * Q8K_BYTES];
            let mut got = vec![0xAAu8; nb * Q8K_BYTES];
            quantize_row_q8k_4x8_ggml(&x, &mut want);
            // SAFETY: AVX-512 was detected; the sizes match.
            unsafe { x86::quantize_row_q8k_4x8_avx512(&x, &mut got) };
            assert_eq!(got, want, "case {case}");
        }
    }

    #[test]
    fn q4k_simd_tile_bit_exact() {
        if !has_avx2() {
            eprintln!("SKIPPED: no AVX2/FMA/F16C");
            return;
        }
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
        let n = check::<false, 1>(&mut rng)
            + check::<false, 4>(&mut rng)
            + check::<true, 4>(&mut rng)
            + check::<true, 1>(&mut rng)
            + check::<true, 6>(&mut rng);
        assert!(n > 0, "no outputs compared");
    }

    /// The whole `matmul` (pool split, gemm tiles + gemv tail) against the scalar functions.
    #[test]
    fn q4k_simd_matmul_bit_exact() {
        use crate::kernels::{matmul, QActs, QMatrix, ThreadPool};
        let pool = ThreadPool::new(2);
        let mut rng = Rng(42);
        let (n_rows, nb) = (200usize, 3usize);
        let k = nb * QK_K;
        let w = weights(&mut rng, n_rows, nb);
        let qm = QMatrix {
            ty: GgmlType::Q4_K,
            data: &w,
            n_rows,
            n_cols: k,
        };
        let rb = nb * Q4K_BYTES;
        for n_tok in [1usize, 2, 3, 4, 5, 9, 12] {
            let x: Vec<f32> = (0..n_tok * k).map(|_| rng.f()).collect();
            let mut out = vec![0f32; n_tok * n_rows];
            matmul(&pool, &qm, &x, &mut out, &mut QActs::default()).unwrap();
            let n_gemm = n_tok - n_tok % 4;
            let mut a = vec![0u8; nb * Q8K_BYTES];
            for t in 0..n_tok {
                let xr = &x[t * k..(t + 1) * k];
                if t < n_gemm {
                    quantize_row_q8k_4x8_ggml(xr, &mut a);
                } else {
                    crate::quant::quantize(GgmlType::Q8_K, xr, &mut a).unwrap();
                }
                for r in 0..n_rows {
                    let wr = &w[r * rb..(r + 1) * rb];
                    let want = if t < n_gemm {
                        dot_q4k_gemm_ggml(wr, &a)
                    } else {
                        dot_q4k_gemv_ggml(wr, &a)
                    };
                    assert_eq!(
                        out[t * n_rows + r].to_bits(),
                        want.to_bits(),
                        "n_tok={n_tok} t={t} r={r}"
                    );
                }
            }
        }
    }

    /// Timing print: `cargo test --release -p rustorch-core --lib q4k_simd_timing -- --ignored --nocapture`
    #[test]
    #[ignore]
    fn q4k_simd_timing() {
        if !has_avx2() {
            eprintln!("SKIPPED: no AVX2/FMA/F16C");
            return;
        }
        let mut rng = Rng(7);
        let (nrows, nb) = (1536usize, 8960 / QK_K);
        let w = weights(&mut rng, nrows, nb);
        let rb = nb * Q4K_BYTES;
        let ab = nb * Q8K_BYTES;
        let a1 = acts(&mut rng, 1, nb, false);
        let a4 = acts(&mut rng, 4, nb, true);
        let mut out = vec![0f32; 4 * nrows];
        let time = |f: &mut dyn FnMut()| {
            f();
            let it = 20;
            let t0 = std::time::Instant::now();
            for _ in 0..it {
                f();
            }
            t0.elapsed().as_secs_f64() * 1e3 / it as f64
        };
        let scalar_gemv = time(&mut || {
            for r in 0..nrows {
                out[r] = dot_q4k_gemv_ggml(&w[r * rb..(r + 1) * rb], &a1);
            }
        });
        let simd_gemv = time(&mut || unsafe {
            x86::tile::<false, 1>(
                w.as_ptr(),
                rb,
                nrows,
                nb,
                &[a1.as_ptr()],
                1,
                out.as_mut_ptr(),
                nrows,
            )
        });
        let scalar_gemm = time(&mut || {
            for t in 0..4 {
                for r in 0..nrows {
                    out[t * nrows + r] =
                        dot_q4k_gemm_ggml(&w[r * rb..(r + 1) * rb], &a4[t * ab..(t + 1) * ab]);
                }
            }
        });
        let p4: [*const u8; 4] = std::array::from_fn(|t| a4[t * ab..].as_ptr());
        let simd_gemm = time(&mut || unsafe {
            x86::tile::<true, 4>(w.as_ptr(), rb, nrows, nb, &p4, 4, out.as_mut_ptr(), nrows)
        });
        eprintln!(
            "1536x8960 Q4_K, 1 thread: gemv 1 row scalar {scalar_gemv:.2} ms, simd {simd_gemv:.3} ms; \
             gemm 4 rows scalar {scalar_gemm:.2} ms, simd {simd_gemm:.3} ms"
        );
    }

    /// DRAM-bound gemv speed (a 226 MB matrix, 1536 columns, streamed once per pass):
    /// `NT=2 cargo test --release -p rustorch-core --lib q4k_dram_timing -- --ignored --nocapture`
    #[test]
    #[ignore]
    fn q4k_dram_timing() {
        if !has_avx2() {
            eprintln!("SKIPPED: no AVX2/FMA/F16C");
            return;
        }
        let mut rng = Rng(7);
        let (nrows0, nb) = (1024usize, 1536 / QK_K);
        let w0 = weights(&mut rng, nrows0, nb);
        let rb = nb * Q4K_BYTES;
        let reps = 256;
        let nrows = nrows0 * reps;
        let w = w0.repeat(reps);
        let a1 = acts(&mut rng, 1, nb, false);
        let mut out = vec![0f32; nrows];
        let nthr: usize = std::env::var("NT")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(1);
        let per = nrows / nthr;
        let (wp, op, ap) = (
            w.as_ptr() as usize,
            out.as_mut_ptr() as usize,
            a1.as_ptr() as usize,
        );
        let it = 5;
        let t0 = std::time::Instant::now();
        for _ in 0..it {
            std::thread::scope(|sc| {
                for th in 0..nthr {
                    sc.spawn(move || {
                        for r0 in (th * per..(th + 1) * per).step_by(64) {
                            unsafe {
                                x86::tile::<false, 1>(
                                    (wp as *const u8).add(r0 * rb),
                                    rb,
                                    64,
                                    nb,
                                    &[ap as *const u8],
                                    1,
                                    (op as *mut f32).add(r0),
                                    nrows,
                                )
                            };
                        }
                    });
                }
            });
        }
        let secs = t0.elapsed().as_secs_f64() / it as f64;
        eprintln!(
            "Q4_K gemv from DRAM, {nthr} thread(s): {:.1} GB/s",
            w.len() as f64 / secs / 1e9
        );
    }
}
