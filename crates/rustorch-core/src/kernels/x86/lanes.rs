//! Legacy-format (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL) products with the float steps of
//! ggml's x86 kernels, bit for bit (see `dot::dot_legacy`, the scalar reference): per
//! (weight row, activation row) eight f32 accumulators, one fused multiply-add per 32-block
//! of the block's eight 4-product lane sums with the scale `dw * da`, then `hsum_float_8`.
//!
//! A tile unpacks each weight block once and applies it to up to `T` activation rows.

use std::arch::x86_64::*;

use super::{rd_u16, rd_u32, unpack_legacy};
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
    let nt = nt.min(T);
    if nt == 0 {
        return;
    }
    // the narrowest fixed width that holds the rows (rows past `nt` repeat the last one:
    // computed, never stored), so the token loop has a constant trip count
    fn first<const N: usize>(acts: &[ActRow], nt: usize) -> [ActRow; N] {
        std::array::from_fn(|t| acts[t.min(nt - 1)])
    }
    let (a, o) = (&acts[..], ostride);
    match nt {
        1 => tile_n::<F, 1>(w, rb, nrows, nb, &first(a, nt), nt, out, o),
        2 => tile_n::<F, 2>(w, rb, nrows, nb, &first(a, nt), nt, out, o),
        3 | 4 => tile_n::<F, 4>(w, rb, nrows, nb, &first(a, nt), nt, out, o),
        _ => tile_n::<F, 8>(w, rb, nrows, nb, &first(a, nt), nt, out, o),
    }
}

/// A signed legacy block's (Q4_0, Q5_0, Q8_0) 32 values as signed bytes. Q5_0 as ggml's
/// AVX2 code builds them: the low four bits, and `0xF0` where the fifth bit is clear.
#[inline(always)]
unsafe fn svalues<const F: u8>(p: *const u8) -> __m256i {
    if F != Q5_0 {
        return values::<F>(p);
    }
    let qs = _mm_loadu_si128(p.add(qs_off(F)) as *const __m128i);
    let v = _mm256_and_si256(
        _mm256_set_m128i(_mm_srli_epi16::<4>(qs), qs),
        _mm256_set1_epi8(0x0f),
    );
    let hi = super::bytes_from_bits_32(p.add(qh_off(F)));
    _mm256_or_si256(v, _mm256_andnot_si256(hi, _mm256_set1_epi8(-16)))
}

/// [`tile`] for exactly `T` activation rows (the first `nt` stored).
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile_n<const F: u8, const T: usize>(
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
    // Q4_1/Q5_1's minimum chains (fused multiply-adds in block order): for one or two
    // activation rows inside the vector loop, as ggml's gemv does, so that the two chains of
    // a row run side by side; for more, in their own pass after it, so that the vector loop
    // keeps its accumulators in registers
    let min_inline = has_min(F) && T <= 2;
    for r in 0..nrows {
        let row = w.add(r * rb);
        // one token (decode): the row four rows ahead into L1 (the hardware prefetcher alone
        // leaves the two-thread decode below the memory's rate; a software prefetch is no
        // float step, the results are unchanged)
        if T == 1 {
            let pf = row.wrapping_add(4 * rb);
            let mut o = 0;
            while o < rb {
                _mm_prefetch::<_MM_HINT_T0>(pf.wrapping_add(o) as *const i8);
                o += 64;
            }
        }
        let mut acc = [[_mm256_setzero_ps(); T]; 2];
        let mut summs = [0f32; T];
        for b in 0..nb_main {
            let p = row.add(b * bs);
            let x = values::<F>(p);
            let dw = f16(rd_u16(p));
            let k = if pairs { b & 1 } else { 0 };
            let mw = if min_inline {
                f16(rd_u16(p.add(2)))
            } else {
                0.0
            };
            for t in 0..T {
                let a = acts[t];
                let y = _mm256_loadu_si256(a.q.add(b * abs + aqo) as *const __m256i);
                let sc = _mm256_set1_ps(dw * *a.d.add(b));
                acc[k][t] = _mm256_fmadd_ps(sc, lanes::<F>(x, y), acc[k][t]);
                if min_inline {
                    summs[t] = mw.mul_add(*a.s.add(b), summs[t]);
                }
            }
        }
        if has_min(F) && !min_inline {
            for b in 0..nb_main {
                let mw = f16(rd_u16(row.add(b * bs + 2)));
                for t in 0..T {
                    summs[t] = mw.mul_add(*acts[t].s.add(b), summs[t]);
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

/// Unpacks `nr` weight rows of a legacy format (Q4_0, Q5_0, Q8_0, Q4_1, Q5_1; `rb` bytes
/// apart, `nb` blocks each) for [`tile_u`]: block `b` of row `r` as 32 bytes at
/// `xs + 32 (r nb + b)` (signed, or for Q4_1/Q5_1 unsigned), its scale as f32 at
/// `dws + r nb + b` and, for Q4_1/Q5_1, its minimum as f32 at `mws + r nb + b`.
///
/// # Safety
/// AVX2, FMA and F16C must be available; `xs` must hold `32 nr nb` bytes, `dws` `nr nb` f32,
/// and for Q4_1/Q5_1 `mws` `nr nb` f32 (else it is not used).
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn unpack_rows<const F: u8>(
    w: *const u8,
    rb: usize,
    nr: usize,
    nb: usize,
    xs: *mut u8,
    dws: *mut f32,
    mws: *mut f32,
) {
    let bs = block_bytes(F);
    for r in 0..nr {
        let row = w.add(r * rb);
        for b in 0..nb {
            let p = row.add(b * bs);
            let i = r * nb + b;
            let x = if has_min(F) {
                values::<F>(p)
            } else {
                svalues::<F>(p)
            };
            _mm256_storeu_si256(xs.add(32 * i) as *mut __m256i, x);
            *dws.add(i) = f16(rd_u16(p));
            if has_min(F) {
                *mws.add(i) = f16(rd_u16(p.add(2)));
            }
        }
    }
}

/// Blocks per chunk of [`tile_u`]'s scale table.
const TILE_U_CHUNK: usize = 64;

/// [`tile`] for Q4_0/Q5_0/Q8_0/Q4_1/Q5_1 on rows unpacked by [`unpack_rows`] (`nr <= 16`
/// rows of `nb` blocks of format `F`), so that a group of rows is unpacked once for all its
/// activation tiles. The same float steps: per (weight row, activation row) one FMA per block
/// of the eight exact lane sums with the scale `dw * da`, in block order, then
/// `hsum_float_8`, plus for Q4_1/Q5_1 the minimum term's chain `fma(mw, sa, ·)` in block
/// order (its own pass, as [`tile`] does for three or more rows). Each block's `T` scales
/// come from one multiply by a per-chunk table of the activation scales, and the
/// accumulators of the rows stay on the stack between chunks of blocks.
///
/// # Safety
/// AVX2, FMA and F16C must be available; pointers must cover the stated sizes.
#[allow(clippy::too_many_arguments, clippy::needless_range_loop)]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn tile_u<const F: u8, const T: usize>(
    xs: *const u8,
    dws: *const f32,
    mws: *const f32,
    nr: usize,
    nb: usize,
    acts: &[ActRow; T],
    nt: usize,
    out: *mut f32,
    ostride: usize,
) {
    const { assert!(T == 1 || T == 2 || T == 4 || T == 8) };
    debug_assert!(nr <= 16);
    let (abs, aqo) = (act_block_bytes(F), act_qs_off(F));
    // activation scales per block of the chunk, T wide (a 256-bit row each, T <= 8)
    let mut dtab = [[0f32; 8]; TILE_U_CHUNK];
    let mut accs = [[_mm256_setzero_ps(); T]; 16];
    let mut sc = [0f32; 8];
    let mut c0 = 0;
    while c0 < nb {
        let nc = (nb - c0).min(TILE_U_CHUNK);
        for c in 0..nc {
            for t in 0..T {
                dtab[c][t] = *acts[t].d.add(c0 + c);
            }
        }
        for r in 0..nr {
            let mut acc = accs[r];
            for c in 0..nc {
                let b = c0 + c;
                let i = r * nb + b;
                let x = _mm256_loadu_si256(xs.add(32 * i) as *const __m256i);
                let ax = if has_min(F) {
                    x
                } else {
                    _mm256_sign_epi8(x, x)
                };
                let dw = _mm256_broadcast_ss(&*dws.add(i));
                let s = _mm256_mul_ps(dw, _mm256_loadu_ps(dtab[c].as_ptr()));
                _mm256_storeu_ps(sc.as_mut_ptr(), s);
                // read back from memory: one broadcast load per activation row, no shuffles
                std::hint::black_box(&mut sc);
                for t in 0..T {
                    let y = _mm256_loadu_si256(acts[t].q.add(b * abs + aqo) as *const __m256i);
                    let pr = if has_min(F) {
                        _mm256_maddubs_epi16(ax, y)
                    } else {
                        _mm256_maddubs_epi16(ax, _mm256_sign_epi8(y, x))
                    };
                    let l = _mm256_cvtepi32_ps(_mm256_madd_epi16(pr, _mm256_set1_epi16(1)));
                    acc[t] = _mm256_fmadd_ps(_mm256_broadcast_ss(&sc[t]), l, acc[t]);
                }
            }
            accs[r] = acc;
        }
        c0 += nc;
    }
    for r in 0..nr {
        let mut summs = [0f32; T];
        if has_min(F) {
            for b in 0..nb {
                let mw = *mws.add(r * nb + b);
                for t in 0..T {
                    summs[t] = mw.mul_add(*acts[t].s.add(b), summs[t]);
                }
            }
        }
        for t in 0..nt.min(T) {
            *out.add(t * ostride + r) = hsum_float_8(accs[r][t]) + summs[t];
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
#[allow(clippy::too_many_arguments)]
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
    tile_q6k_body::<T>(w, rb, nrows, nb, acts, nt, out, ostride)
}

/// The body of [`tile_q6k`], inlined into callers compiled for AVX2 or for AVX-512 (the same
/// instructions' arithmetic; the AVX-512 build has 32 vector registers).
#[allow(clippy::too_many_arguments, clippy::needless_range_loop)]
#[inline(always)]
unsafe fn tile_q6k_body<const T: usize>(
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
            let scales16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(x.add(192) as *const __m128i));
            // unpacked 6-bit values (unsigned) of the 8 groups of 32, and their scales as
            // 16-bit pairs (first 8 lanes' scale, last 8 lanes' scale)
            let mut q = [_mm256_setzero_si256(); 8];
            let mut sc = [_mm256_setzero_si256(); 8];
            for j in 0..2 {
                // scales 8j..8j+8 in both 128-bit lanes, then one byte shuffle per pair
                let half = if j == 0 {
                    _mm256_permute2x128_si256::<0x00>(scales16, scales16)
                } else {
                    _mm256_permute2x128_si256::<0x11>(scales16, scales16)
                };
                for (k, pat) in Q6K_SCALE_PAIRS.iter().enumerate() {
                    sc[4 * j + k] = _mm256_shuffle_epi8(
                        half,
                        _mm256_loadu_si256(pat.as_ptr() as *const __m256i),
                    );
                }
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
            }
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

/// Byte shuffles that spread, from 8 i16 scales in each 128-bit lane, scale `2k` over the
/// low 8 lanes and scale `2k + 1` over the high 8 lanes (`k = 0..4`).
const Q6K_SCALE_PAIRS: [[u8; 32]; 4] = {
    let mut p = [[0u8; 32]; 4];
    let mut k = 0;
    while k < 4 {
        let mut i = 0;
        while i < 8 {
            p[k][2 * i] = (4 * k) as u8;
            p[k][2 * i + 1] = (4 * k + 1) as u8;
            p[k][16 + 2 * i] = (4 * k + 2) as u8;
            p[k][16 + 2 * i + 1] = (4 * k + 3) as u8;
            i += 1;
        }
        k += 1;
    }
    p
};

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
    tile_q6k_body::<1>(w, rb, nrows, nb, &[a], 1, out, 0);
}

/// [`gemv_q6k`] compiled for AVX-512 (same arithmetic, 32 vector registers).
///
/// # Safety
/// As [`tile_q6k`], and AVX-512 F/BW/VL must be available.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
pub(crate) unsafe fn gemv_q6k512(
    w: *const u8,
    rb: usize,
    nrows: usize,
    nb: usize,
    a: ActRow,
    out: *mut f32,
) {
    tile_q6k_body::<1>(w, rb, nrows, nb, &[a], 1, out, 0);
}

/// Two blocks' worth of [`lanes`] on AVX-512, before the conversion to f32: `x` holds two
/// weight blocks (256-bit halves), `y` the matching activation blocks.
#[inline(always)]
unsafe fn ints512<const F: u8>(x: __m512i, y: __m512i) -> __m512i {
    let z = _mm512_setzero_si512();
    if has_min(F) {
        _mm512_dpbusd_epi32(z, x, y)
    } else {
        let neg = _mm512_movepi8_mask(x);
        let sy = _mm512_mask_sub_epi8(y, neg, z, y);
        _mm512_dpbusd_epi32(z, _mm512_abs_epi8(x), sy)
    }
}

/// Blocks per chunk of [`gemv512`]: the lane sums of 4 rows × this many blocks stay on the
/// stack between its integer and float passes.
const GEMV512_CHUNK: usize = 64;

/// [`gemv`] on AVX-512: four rows per group, two per 512-bit register (one 8-lane
/// accumulator each, the same float steps per lane). The weights are read in memory order,
/// row after row (walking four rows block by block jumps `rb` bytes at every step, which the
/// hardware prefetchers follow badly): for a chunk of blocks, each row's exact integer lane
/// sums are computed first, two blocks per `vpdpbusd`, then the float steps run block by
/// block over the four rows (`dw * da` rounded as in the scalar code, one FMA per block).
/// Not for IQ4_NL.
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
    let act = |b: usize| _mm256_loadu_si256(a.q.add(b * abs + aqo) as *const __m256i);
    // lane sums per (block, row); rows 2h and 2h + 1 adjacent, one 512-bit load. Not
    // zeroed (8 KiB per call showed as 9% of a decode): each chunk's integer pass writes
    // every entry its float pass reads.
    let mut scr = std::mem::MaybeUninit::<[[__m256i; 4]; GEMV512_CHUNK]>::uninit();
    let scr = scr.as_mut_ptr() as *mut [__m256i; 4];
    // [row 2h x8 | row 2h+1 x8] from [d0 d1 d2 d3]
    let pick = [
        _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1),
        _mm512_setr_epi32(2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3),
    ];
    let mut r0 = 0;
    while r0 < nrows {
        let nv = (nrows - r0).min(4);
        let rows: [*const u8; 4] = std::array::from_fn(|i| w.add((r0 + i).min(nrows - 1) * rb));
        let mut acc = [_mm512_setzero_ps(); 2];
        let mut summs = [0f32; 4];
        let mut b0 = 0;
        while b0 < nb {
            let nc = (nb - b0).min(GEMV512_CHUNK);
            // integer pass, in memory order (rows past `nv` repeat the last row, not stored)
            for i in 0..4 {
                let row = rows[i].add(b0 * bs);
                let mut c = 0;
                while c < nc {
                    let p = row.add(c * bs);
                    // 2 KiB ahead of the stream
                    _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(2048) as *const i8);
                    _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(2048 + 64) as *const i8);
                    // two blocks (the last one twice when `nc` is odd)
                    let c1 = (c + 1).min(nc - 1);
                    let x = _mm512_inserti64x4::<1>(
                        _mm512_castsi256_si512(values::<F>(p)),
                        values::<F>(row.add(c1 * bs)),
                    );
                    let y =
                        _mm512_inserti64x4::<1>(_mm512_castsi256_si512(act(b0 + c)), act(b0 + c1));
                    let l = ints512::<F>(x, y);
                    (*scr.add(c))[i] = _mm512_castsi512_si256(l);
                    (*scr.add(c1))[i] = _mm512_extracti64x4_epi64::<1>(l);
                    c += 2;
                }
            }
            // float pass, block by block over the four rows
            for c in 0..nc {
                let b = b0 + c;
                let h = _mm_setr_epi16(
                    rd_u16(rows[0].add(b * bs)) as i16,
                    rd_u16(rows[1].add(b * bs)) as i16,
                    rd_u16(rows[2].add(b * bs)) as i16,
                    rd_u16(rows[3].add(b * bs)) as i16,
                    0,
                    0,
                    0,
                    0,
                );
                let s4 = _mm_mul_ps(_mm_cvtph_ps(h), _mm_set1_ps(*a.d.add(b)));
                let s16 = _mm512_castps128_ps512(s4);
                for j in 0..2 {
                    let s = _mm512_permutexvar_ps(pick[j], s16);
                    let l =
                        _mm512_loadu_si512((scr.add(c) as *const __m256i).add(2 * j) as *const _);
                    acc[j] = _mm512_fmadd_ps(s, _mm512_cvtepi32_ps(l), acc[j]);
                }
                if has_min(F) {
                    let sa = *a.s.add(b);
                    for i in 0..4 {
                        summs[i] = f16(rd_u16(rows[i].add(b * bs + 2))).mul_add(sa, summs[i]);
                    }
                }
            }
            b0 += nc;
        }
        for i in 0..nv {
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

/// Bytes per block of a packed activation tile of `T` rows (see [`pack_act_tile`]).
pub(crate) const fn act_tile_stride(f: u8, t: usize) -> usize {
    if has_min(f) {
        40 * t
    } else {
        68 * t
    }
}

/// The zero point that [`tile512`] removes from its unsigned weight bytes through the
/// activation correction (Q8_0's signed values are shifted by 128).
const fn zero_point(f: u8) -> i32 {
    if f == Q8_0 {
        128
    } else {
        offset(f)
    }
}

/// Packs activation rows `acts[..nt]` (of `nb` blocks) into the interleaved tile layout
/// that [`tile512`] reads, `T` rows wide; rows `nt..T` are zero. Per block, at
/// `b * act_tile_stride(F, T)`: the rows' 32 quant bytes (`[T][32]`), their scales `f32 [T]`,
/// then for Q4_1/Q5_1 the Q8_1 sums `s` (`f32 [T]`), otherwise per row eight `i32` lane
/// corrections `-zero_point * (sum of the lane's four quants)`.
///
/// # Safety
/// AVX-512 F/BW/VL/VNNI must be available; `acts[..nt]` must cover `nb` blocks and `dst`
/// `nb * act_tile_stride(F, T)` bytes.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(crate) unsafe fn pack_act_tile<const F: u8, const T: usize>(
    acts: &[ActRow],
    nb: usize,
    dst: *mut u8,
) {
    let (abs, aqo) = (act_block_bytes(F), act_qs_off(F));
    let stride = act_tile_stride(F, T);
    let ones = _mm256_set1_epi8(1);
    let zp = _mm256_set1_epi32(-zero_point(F));
    for b in 0..nb {
        let blk = dst.add(b * stride);
        for t in 0..T {
            let (y, d, s) = match acts.get(t) {
                Some(a) => (
                    _mm256_loadu_si256(a.q.add(b * abs + aqo) as *const __m256i),
                    *a.d.add(b),
                    if has_min(F) { *a.s.add(b) } else { 0.0 },
                ),
                None => (_mm256_setzero_si256(), 0.0, 0.0),
            };
            _mm256_storeu_si256(blk.add(32 * t) as *mut __m256i, y);
            *(blk.add(32 * T + 4 * t) as *mut f32) = d;
            if has_min(F) {
                *(blk.add(36 * T + 4 * t) as *mut f32) = s;
            } else {
                let sums = _mm256_dpbusd_epi32(_mm256_setzero_si256(), ones, y);
                _mm256_storeu_si256(
                    blk.add(36 * T + 32 * t) as *mut __m256i,
                    _mm256_mullo_epi32(sums, zp),
                );
            }
        }
    }
}

/// A legacy block's 32 values as unsigned bytes (`value + zero_point`).
#[inline(always)]
unsafe fn uvalues<const F: u8>(p: *const u8) -> __m256i {
    let u = unpack_legacy::<F>(p);
    if F == Q8_0 {
        _mm256_xor_si256(u, _mm256_set1_epi8(-128))
    } else {
        u
    }
}

/// The first two f16 of the blocks at `p0` and `p1` as f32 `[a0, b0, a1, b1]`; with
/// [`HALVES_A`] / [`HALVES_B`] a permute spreads `a` (`b`) of `p0` over lanes 0..8 and of
/// `p1` over lanes 8..16.
#[inline(always)]
unsafe fn head_f16x2(p0: *const u8, p1: *const u8) -> __m512 {
    let v = _mm_insert_epi32::<1>(_mm_cvtsi32_si128(rd_u32(p0) as i32), rd_u32(p1) as i32);
    _mm512_castps128_ps512(_mm_cvtph_ps(v))
}

const HALVES_A: [i32; 16] = [0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2];
const HALVES_B: [i32; 16] = [1, 1, 1, 1, 1, 1, 1, 1, 3, 3, 3, 3, 3, 3, 3, 3];

/// `T` consecutive f32 repeated to fill 16 lanes (`T` divides 8).
#[inline(always)]
unsafe fn repeat_t<const T: usize>(p: *const u8) -> __m512 {
    match T {
        8 => _mm512_broadcast_f32x8(_mm256_loadu_ps(p as *const f32)),
        4 => _mm512_broadcast_f32x4(_mm_loadu_ps(p as *const f32)),
        2 => _mm512_castpd_ps(_mm512_set1_pd(std::ptr::read_unaligned(p as *const f64))),
        _ => _mm512_set1_ps(*(p as *const f32)),
    }
}

/// [`tile`] on AVX-512 against a packed activation tile ([`pack_act_tile`]): two weight
/// rows per 512-bit register and two registers per pass, each weight block unpacked once for
/// all `T` activation rows.
/// Every lane performs the scalar float sequence (`dw * da` rounded, one FMA per block of
/// the eight exact 4-product lane sums, `hsum_float_8`, Q4_1/Q5_1 `summs` by FMA); the lane
/// sums come from one `vpdpbusd` of the unsigned weight bytes, started from the tile's
/// zero-point correction. Not for IQ4_NL.
///
/// # Safety
/// AVX-512 F/BW/VL/VNNI/DQ must be available; `w` must cover `nrows` rows of `rb` bytes,
/// `at` `nb` packed blocks, and `out` the outputs `t * ostride + r` for `t < nt`.
#[allow(clippy::too_many_arguments, clippy::needless_range_loop)]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512dq,avx2,fma,f16c")]
pub(crate) unsafe fn tile512<const F: u8, const T: usize>(
    w: *const u8,
    rb: usize,
    nrows: usize,
    nb: usize,
    at: *const u8,
    nt: usize,
    out: *mut f32,
    ostride: usize,
) {
    let bs = block_bytes(F);
    let stride = act_tile_stride(F, T);
    let nt = nt.min(T);
    let ia = _mm512_loadu_si512(HALVES_A.as_ptr() as *const _);
    let ib = _mm512_loadu_si512(HALVES_B.as_ptr() as *const _);
    // four weight rows (two registers) per pass: each activation load and scale serves both
    let mut r0 = 0;
    while r0 < nrows {
        let row = |k: usize| w.add((r0 + k).min(nrows - 1) * rb);
        let (w0, w1, w2, w3) = (row(0), row(1), row(2), row(3));
        // lane 8 * i + t of `summs[j]`: row r0 + 2j + i, activation row t (repeated when T < 8)
        let mut acc = [[_mm512_setzero_ps(); T]; 2];
        let mut summs = [_mm512_setzero_ps(); 2];
        for b in 0..nb {
            let (p0, p1) = (w0.add(b * bs), w1.add(b * bs));
            let (p2, p3) = (w2.add(b * bs), w3.add(b * bs));
            // the next rows, same block: keeps the weight stream ahead of the tile
            for p in [p0, p1, p2, p3] {
                _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(4 * rb) as *const i8);
            }
            let a = at.add(b * stride);
            let x = [
                _mm512_inserti64x4::<1>(_mm512_castsi256_si512(uvalues::<F>(p0)), uvalues::<F>(p1)),
                _mm512_inserti64x4::<1>(_mm512_castsi256_si512(uvalues::<F>(p2)), uvalues::<F>(p3)),
            ];
            let heads = [head_f16x2(p0, p1), head_f16x2(p2, p3)];
            let dw = heads.map(|h| _mm512_permutexvar_ps(ia, h));
            if has_min(F) {
                let s = repeat_t::<T>(a.add(36 * T));
                for j in 0..2 {
                    summs[j] = _mm512_fmadd_ps(_mm512_permutexvar_ps(ib, heads[j]), s, summs[j]);
                }
            }
            for t in 0..T {
                let y = _mm512_broadcast_i64x4(_mm256_loadu_si256(a.add(32 * t) as *const __m256i));
                let c = if has_min(F) {
                    _mm512_setzero_si512()
                } else {
                    _mm512_broadcast_i64x4(_mm256_loadu_si256(
                        a.add(36 * T + 32 * t) as *const __m256i
                    ))
                };
                let da = _mm512_set1_ps(*(a.add(32 * T + 4 * t) as *const f32));
                for j in 0..2 {
                    let l = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(c, x[j], y));
                    acc[j][t] = _mm512_fmadd_ps(_mm512_mul_ps(dw[j], da), l, acc[j][t]);
                }
            }
        }
        for j in 0..2 {
            let r = r0 + 2 * j;
            if r >= nrows {
                break;
            }
            let mut sm = [0f32; 16];
            _mm512_storeu_ps(sm.as_mut_ptr(), summs[j]);
            for t in 0..nt {
                let v = acc[j][t];
                *out.add(t * ostride + r) = hsum_float_8(_mm512_castps512_ps256(v)) + sm[t];
                if r + 1 < nrows {
                    let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v)));
                    *out.add(t * ostride + r + 1) = hsum_float_8(hi) + sm[8 + t];
                }
            }
        }
        r0 += 4;
    }
}
