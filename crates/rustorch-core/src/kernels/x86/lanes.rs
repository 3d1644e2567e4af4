//! Legacy-format (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL) products with the float steps of
//! ggml's x86 kernels, bit for bit (see `dot::dot_legacy`, the scalar reference): per
//! (weight row, activation row) eight f32 accumulators, one fused multiply-add per 32-block
//! of the block's eight 4-product lane sums with the scale `dw * da`, then `hsum_float_8`.
//!
//! A tile unpacks each weight block once and applies it to up to `T` activation rows.

use std::arch::x86_64::*;

use super::{rd_u16, unpack_legacy};
use crate::kernels::fmt::*;

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn f16(h: u16) -> f32 {
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(h as i32)))
}

/// ggml's `hsum_float_8`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn hsum_float_8(x: __m256) -> f32 {
    let r = _mm_add_ps(_mm256_extractf128_ps::<1>(x), _mm256_castps256_ps128(x));
    let r = _mm_add_ps(r, _mm_movehl_ps(r, r));
    let r = _mm_add_ss(r, _mm_movehdup_ps(r));
    _mm_cvtss_f32(r)
}

/// The block's values as bytes ready for `maddubs`: unsigned (Q4_1, Q5_1) or signed.
#[inline(always)]
unsafe fn values<const F: u8>(p: *const u8) -> __m256i {
    let u = unpack_legacy::<F>(p);
    if offset(F) != 0 {
        _mm256_sub_epi8(u, _mm256_set1_epi8(offset(F) as i8))
    } else {
        u
    }
}

/// Eight exact lane sums of four products each, as f32.
#[inline(always)]
unsafe fn lanes<const F: u8>(x: __m256i, y: __m256i) -> __m256 {
    let p = if has_min(F) {
        _mm256_maddubs_epi16(x, y)
    } else {
        _mm256_maddubs_epi16(_mm256_sign_epi8(x, x), _mm256_sign_epi8(y, x))
    };
    _mm256_cvtepi32_ps(_mm256_madd_epi16(p, _mm256_set1_epi16(1)))
}

/// `out[t * ostride + r] = dot(weight row r, activation row t)` for `nrows` rows starting at
/// `w` (`rb` bytes apart, `nb` blocks each) and the activation rows `acts[..nt]`.
///
/// # Safety
/// AVX2, FMA and F16C must be available; pointers must cover the stated sizes.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn tile<const F: u8, const T: usize>(
    w: *const u8,
    rb: usize,
    nrows: usize,
    nb: usize,
    acts: &[ActRow; T],
    nt: usize,
    out: *mut f32,
    ostride: usize,
) {
    let bs = block_bytes(F);
    let (abs, aqo) = (act_block_bytes(F), act_qs_off(F));
    let pairs = F == IQ4_NL;
    let nb_main = if pairs { nb & !1 } else { nb };
    for r in 0..nrows {
        let row = w.add(r * rb);
        let mut acc = [[_mm256_setzero_ps(); T]; 2];
        let mut summs = [0f32; T];
        for b in 0..nb_main {
            let p = row.add(b * bs);
            let x = values::<F>(p);
            let dw = f16(rd_u16(p));
            let mw = if has_min(F) {
                f16(rd_u16(p.add(2)))
            } else {
                0.0
            };
            let k = if pairs { b & 1 } else { 0 };
            for t in 0..T {
                if t >= nt {
                    break;
                }
                let a = acts[t];
                let y = _mm256_loadu_si256(a.q.add(b * abs + aqo) as *const __m256i);
                let sc = _mm256_set1_ps(dw * *a.d.add(b));
                acc[k][t] = _mm256_fmadd_ps(sc, lanes::<F>(x, y), acc[k][t]);
                if has_min(F) {
                    summs[t] = mw.mul_add(*a.s.add(b), summs[t]);
                }
            }
        }
        for t in 0..nt.min(T) {
            let a = acts[t];
            let mut s = if pairs {
                hsum_float_8(_mm256_add_ps(acc[0][t], acc[1][t]))
            } else {
                hsum_float_8(acc[0][t])
            };
            for b in nb_main..nb {
                // IQ4_NL's odd last block, summed separately as in ggml
                let p = row.add(b * bs);
                let x = values::<F>(p);
                let y = _mm256_loadu_si256(a.q.add(b * abs + aqo) as *const __m256i);
                let l = lanes::<F>(x, y);
                let mut v = [0f32; 8];
                _mm256_storeu_ps(v.as_mut_ptr(), l);
                let si: f32 = v.iter().sum();
                s = (*a.d.add(b) * f16(rd_u16(p))).mul_add(si, s);
            }
            *out.add(t * ostride + r) = s + summs[t];
        }
    }
}

/// [`tile`] for one activation row, with the GEMV signature.
///
/// # Safety
/// As [`tile`].
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn gemv<const F: u8>(
    w: *const u8,
    rb: usize,
    nrows: usize,
    nb: usize,
    a: ActRow,
    out: *mut f32,
) {
    tile::<F, 1>(w, rb, nrows, nb, &[a], 1, out, 0);
}

/// Q6_K rows against up to `T` Q8_K activation rows with the float steps of ggml's AVX2
/// `ggml_vec_dot_q6_K_q8_K` (see `dot::dot_q6_k`): each super-block's values are unpacked
/// once and reused for every activation row.
///
/// # Safety
/// As [`tile`]; `F` must be Q6_K.
#[allow(clippy::too_many_arguments, clippy::needless_range_loop)]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn tile_q6k<const T: usize>(
    w: *const u8,
    rb: usize,
    nrows: usize,
    nb: usize,
    acts: &[ActRow; T],
    nt: usize,
    out: *mut f32,
    ostride: usize,
) {
    let m15 = _mm256_set1_epi8(15);
    let m3 = _mm256_set1_epi8(3);
    for r in 0..nrows {
        let row = w.add(r * rb);
        let mut acc = [_mm256_setzero_ps(); T];
        for b in 0..nb {
            let x = row.add(b * 210);
            let pf = x.wrapping_add(2 * rb);
            for l in 0..4 {
                _mm_prefetch::<_MM_HINT_T0>(pf.wrapping_add(64 * l) as *const i8);
            }
            let dw = f16(rd_u16(x.add(208)));
            // unpacked 6-bit values (unsigned) of the 8 groups of 32, and their scales as
            // 16-bit pairs (first 8 lanes' scale, last 8 lanes' scale)
            let mut q = [_mm256_setzero_si256(); 8];
            let mut sc = [_mm256_setzero_si256(); 8];
            for j in 0..2 {
                let b1 = _mm256_loadu_si256(x.add(64 * j) as *const __m256i);
                let b2 = _mm256_loadu_si256(x.add(64 * j + 32) as *const __m256i);
                let h = _mm256_loadu_si256(x.add(128 + 32 * j) as *const __m256i);
                let h0 = _mm256_slli_epi16::<4>(_mm256_and_si256(h, m3));
                let h1 = _mm256_slli_epi16::<2>(_mm256_and_si256(h, _mm256_set1_epi8(12)));
                let h2 = _mm256_and_si256(h, _mm256_set1_epi8(48));
                let h3 = _mm256_srli_epi16::<2>(_mm256_and_si256(h, _mm256_set1_epi8(-64)));
                q[4 * j] = _mm256_or_si256(_mm256_and_si256(b1, m15), h0);
                q[4 * j + 1] = _mm256_or_si256(_mm256_and_si256(b2, m15), h1);
                q[4 * j + 2] =
                    _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16::<4>(b1), m15), h2);
                q[4 * j + 3] =
                    _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16::<4>(b2), m15), h3);
                for k in 0..4 {
                    let s0 = *x.add(192 + 8 * j + 2 * k) as i8 as i16;
                    let s1 = *x.add(192 + 8 * j + 2 * k + 1) as i8 as i16;
                    sc[4 * j + k] = _mm256_setr_epi16(
                        s0, s0, s0, s0, s0, s0, s0, s0, s1, s1, s1, s1, s1, s1, s1, s1,
                    );
                }
            }
            let scales16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(x.add(192) as *const __m128i));
            for t in 0..T {
                if t >= nt {
                    break;
                }
                let a = acts[t];
                let y = a.q.add(b * 292);
                let mut sumi = _mm256_setzero_si256();
                for g in 0..8 {
                    let yv = _mm256_loadu_si256(y.add(4 + 32 * g) as *const __m256i);
                    let p = _mm256_madd_epi16(sc[g], _mm256_maddubs_epi16(q[g], yv));
                    sumi = _mm256_add_epi32(sumi, p);
                }
                let bs = _mm256_loadu_si256(y.add(260) as *const __m256i);
                let corr = _mm256_slli_epi32::<5>(_mm256_madd_epi16(bs, scales16));
                sumi = _mm256_sub_epi32(sumi, corr);
                let d = std::ptr::read_unaligned(y as *const f32) * dw;
                acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), acc[t]);
            }
        }
        for t in 0..nt.min(T) {
            *out.add(t * ostride + r) = hsum_float_8(acc[t]);
        }
    }
}

/// [`tile_q6k`] for one activation row, with the GEMV signature.
///
/// # Safety
/// As [`tile_q6k`].
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn gemv_q6k(
    w: *const u8,
    rb: usize,
    nrows: usize,
    nb: usize,
    a: ActRow,
    out: *mut f32,
) {
    tile_q6k::<1>(w, rb, nrows, nb, &[a], 1, out, 0);
}

/// Two blocks' worth of [`lanes`] on AVX-512: `x` holds one block of two weight rows
/// (256-bit halves), `y` the activation block in both halves.
#[inline(always)]
unsafe fn lanes512<const F: u8>(x: __m512i, y: __m512i) -> __m512 {
    let z = _mm512_setzero_si512();
    let s = if has_min(F) {
        _mm512_dpbusd_epi32(z, x, y)
    } else {
        let neg = _mm512_movepi8_mask(x);
        let sy = _mm512_mask_sub_epi8(y, neg, z, y);
        _mm512_dpbusd_epi32(z, _mm512_abs_epi8(x), sy)
    };
    _mm512_cvtepi32_ps(s)
}

/// [`gemv`] on AVX-512: two weight rows per 512-bit register (one 8-lane accumulator each,
/// the same float steps per lane), four rows per iteration. Per 16 blocks, each row's scales
/// are gathered and multiplied by the activation scales in one vector operation (the same
/// f32 products `dw * da` as the scalar code). Not for IQ4_NL.
///
/// # Safety
/// AVX-512 F/BW/VL/VNNI/DQ must be available; pointers must cover the stated sizes.
#[allow(clippy::needless_range_loop)]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512dq,avx2,fma,f16c")]
pub(crate) unsafe fn gemv512<const F: u8>(
    w: *const u8,
    rb: usize,
    nrows: usize,
    nb: usize,
    a: ActRow,
    out: *mut f32,
) {
    let bs = block_bytes(F);
    let (abs, aqo) = (act_block_bytes(F), act_qs_off(F));
    let offs = _mm512_mullo_epi32(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
        _mm512_set1_epi32(bs as i32),
    );
    let mut r0 = 0;
    while r0 < nrows {
        let rows: [*const u8; 4] = std::array::from_fn(|i| w.add((r0 + i).min(nrows - 1) * rb));
        let mut acc = [_mm512_setzero_ps(); 2];
        let mut summs = [0f32; 4];
        let mut c = 0;
        while c < nb {
            let n16 = (nb - c).min(16);
            let k: __mmask16 = if n16 == 16 { 0xffff } else { (1u16 << n16) - 1 };
            let da = _mm512_maskz_loadu_ps(k, a.d.add(c));
            // per row: the 16 blocks' scale products and (Q4_1/Q5_1) minimums
            let mut sc = [_mm512_setzero_ps(); 4];
            let mut mw = [[0f32; 16]; 4];
            for (i, row) in rows.iter().enumerate() {
                let g = _mm512_mask_i32gather_epi32::<1>(
                    _mm512_setzero_si512(),
                    k,
                    offs,
                    row.add(c * bs) as *const i32,
                );
                let d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(g));
                sc[i] = _mm512_mul_ps(d, da);
                if has_min(F) {
                    let m = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32::<16>(g)));
                    _mm512_storeu_ps(mw[i].as_mut_ptr(), m);
                }
            }
            let mut idx = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 16, 16, 16, 16, 16, 16, 16, 16);
            for j in 0..n16 {
                let b = c + j;
                // the next four rows, same block: keeps the memory system ahead of the stream
                for row in &rows {
                    _mm_prefetch::<_MM_HINT_T0>(row.wrapping_add(4 * rb + b * bs) as *const i8);
                }
                let y = _mm512_broadcast_i64x4(_mm256_loadu_si256(
                    a.q.add(b * abs + aqo) as *const __m256i
                ));
                for h in 0..2 {
                    let (p0, p1) = (rows[2 * h].add(b * bs), rows[2 * h + 1].add(b * bs));
                    let x = _mm512_inserti64x4::<1>(
                        _mm512_castsi256_si512(values::<F>(p0)),
                        values::<F>(p1),
                    );
                    let s = _mm512_permutex2var_ps(sc[2 * h], idx, sc[2 * h + 1]);
                    acc[h] = _mm512_fmadd_ps(s, lanes512::<F>(x, y), acc[h]);
                }
                if has_min(F) {
                    let sa = *a.s.add(b);
                    for i in 0..4 {
                        summs[i] = mw[i][j].mul_add(sa, summs[i]);
                    }
                }
                idx = _mm512_add_epi32(idx, _mm512_set1_epi32(1));
            }
            c += n16;
        }
        for i in 0..4.min(nrows - r0) {
            let v = acc[i / 2];
            let half = if i % 2 == 0 {
                _mm512_castps512_ps256(v)
            } else {
                _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v)))
            };
            *out.add(r0 + i) = hsum_float_8(half) + summs[i];
        }
        r0 += 4;
    }
}

/// [`tile`] on AVX-512: two weight rows per 512-bit register against up to `T` activation
/// rows; each weight block is unpacked once for all of them, the row scales are gathered 16
/// blocks at a time, and every lane performs the scalar float sequence (`dw * da` rounded,
/// one FMA per block, `hsum_float_8`, Q4_1/Q5_1 `summs` by FMA). Not for IQ4_NL.
///
/// # Safety
/// AVX-512 F/BW/VL/VNNI/DQ must be available; pointers must cover the stated sizes.
#[allow(clippy::too_many_arguments, clippy::needless_range_loop)]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512dq,avx2,fma,f16c")]
pub(crate) unsafe fn tile512<const F: u8, const T: usize>(
    w: *const u8,
    rb: usize,
    nrows: usize,
    nb: usize,
    acts: &[ActRow; T],
    nt: usize,
    out: *mut f32,
    ostride: usize,
) {
    let bs = block_bytes(F);
    let (abs, aqo) = (act_block_bytes(F), act_qs_off(F));
    let offs = _mm512_mullo_epi32(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
        _mm512_set1_epi32(bs as i32),
    );
    let zero = _mm512_setzero_si512();
    let nt = nt.min(T);
    let mut r0 = 0;
    while r0 < nrows {
        let rows = [w.add(r0 * rb), w.add((r0 + 1).min(nrows - 1) * rb)];
        let mut acc = [_mm512_setzero_ps(); T];
        let mut summs = [[0f32; T]; 2];
        let mut c = 0;
        while c < nb {
            let n16 = (nb - c).min(16);
            let k: __mmask16 = if n16 == 16 { 0xffff } else { (1u16 << n16) - 1 };
            let mut dv = [_mm512_setzero_ps(); 2];
            let mut mw = [[0f32; 16]; 2];
            for (i, row) in rows.iter().enumerate() {
                let g =
                    _mm512_mask_i32gather_epi32::<1>(zero, k, offs, row.add(c * bs) as *const i32);
                dv[i] = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(g));
                if has_min(F) {
                    let m = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32::<16>(g)));
                    _mm512_storeu_ps(mw[i].as_mut_ptr(), m);
                }
            }
            let mut idx = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 16, 16, 16, 16, 16, 16, 16, 16);
            for j in 0..n16 {
                let b = c + j;
                let (p0, p1) = (rows[0].add(b * bs), rows[1].add(b * bs));
                let x = _mm512_inserti64x4::<1>(
                    _mm512_castsi256_si512(values::<F>(p0)),
                    values::<F>(p1),
                );
                let neg = _mm512_movepi8_mask(x);
                let ux = if has_min(F) { x } else { _mm512_abs_epi8(x) };
                let dwv = _mm512_permutex2var_ps(dv[0], idx, dv[1]);
                for t in 0..T {
                    if t >= nt {
                        break;
                    }
                    let a = acts[t];
                    let y = _mm512_broadcast_i64x4(_mm256_loadu_si256(
                        a.q.add(b * abs + aqo) as *const __m256i
                    ));
                    let sy = if has_min(F) {
                        y
                    } else {
                        _mm512_mask_sub_epi8(y, neg, zero, y)
                    };
                    let l = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(zero, ux, sy));
                    let sc = _mm512_mul_ps(dwv, _mm512_set1_ps(*a.d.add(b)));
                    acc[t] = _mm512_fmadd_ps(sc, l, acc[t]);
                    if has_min(F) {
                        let sa = *a.s.add(b);
                        summs[0][t] = mw[0][j].mul_add(sa, summs[0][t]);
                        summs[1][t] = mw[1][j].mul_add(sa, summs[1][t]);
                    }
                }
                idx = _mm512_add_epi32(idx, _mm512_set1_epi32(1));
            }
            c += n16;
        }
        for t in 0..nt {
            let v = acc[t];
            *out.add(t * ostride + r0) = hsum_float_8(_mm512_castps512_ps256(v)) + summs[0][t];
            if r0 + 1 < nrows {
                let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v)));
                *out.add(t * ostride + r0 + 1) = hsum_float_8(hi) + summs[1][t];
            }
        }
        r0 += 2;
    }
}
