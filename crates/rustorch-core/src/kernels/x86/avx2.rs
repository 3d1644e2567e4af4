//! AVX2 (+FMA, F16C) kernels: the same algorithms as `avx512.rs` on 8-lane vectors.
//!
//! `vpmaddubsw` + `vpmaddwd` stand in for `vpdpbusd`. Their 16-bit intermediate saturates
//! only if both bytes of a pair are extreme; the unsigned K-quant values stay below 64.

use std::arch::x86_64::*;

use super::{rd_i32, rd_u16, rd_u32};
use crate::kernels::fmt::*;

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn hsum(v: __m256i) -> i32 {
    let s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
    let s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
    let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b10_11_00_01>(s));
    _mm_cvtsi128_si32(s)
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn f16(h: u16) -> f32 {
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(h as i32)))
}

/// Q4_K/Q5_K scales and mins as bytes `sc0..7, m0..7`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn k4_scales(p: *const u8) -> [u8; 16] {
    const KMASK1: u32 = 0x3f3f_3f3f;
    const KMASK2: u32 = 0x0f0f_0f0f;
    const KMASK3: u32 = 0x0303_0303;
    let mut u = [rd_u32(p), rd_u32(p.add(4)), rd_u32(p.add(8)), 0];
    u[3] = ((u[2] >> 4) & KMASK2) | (((u[1] >> 6) & KMASK3) << 4);
    let uaux = u[1] & KMASK1;
    u[1] = (u[2] & KMASK2) | (((u[0] >> 6) & KMASK3) << 4);
    u[2] = uaux;
    u[0] &= KMASK1;
    std::mem::transmute::<[u32; 4], [u8; 16]>(u)
}

/// `out[r] = dot(row r, a)` for `nrows` rows of K-quant format `F`.
///
/// # Safety
/// AVX2, FMA and F16C must be available; pointers must cover the stated sizes.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn gemv_k<const F: u8>(
    w: *const u8,
    rb: usize,
    nrows: usize,
    nb: usize,
    a: ActRow,
    out: *mut f32,
) {
    let bs = block_bytes(F);
    let m4 = _mm256_set1_epi8(0x0f);
    let one = _mm256_set1_epi8(1);
    let pf = (8192 / rb.max(1)).max(1) * rb;
    for r in 0..nrows {
        let row = w.add(r * rb);
        let mut sum = 0f32;
        for sb in 0..nb {
            let x = row.add(sb * bs);
            let y = a.q.add(sb * 292);
            let yd = *a.d.add(sb);
            let mut l = 0;
            while l < bs {
                _mm_prefetch::<_MM_HINT_T0>(x.wrapping_add(pf + l) as *const i8);
                l += 64;
            }
            let mut acc = _mm256_setzero_si256();
            if F == Q6_K {
                let sc = std::slice::from_raw_parts(x.add(192), 16);
                for h in 0..2 {
                    let l0 = _mm256_loadu_si256(x.add(64 * h) as *const __m256i);
                    let l1 = _mm256_loadu_si256(x.add(64 * h + 32) as *const __m256i);
                    let hb = _mm256_loadu_si256(x.add(128 + 32 * h) as *const __m256i);
                    let v = [
                        _mm256_or_si256(
                            _mm256_and_si256(l0, m4),
                            _mm256_slli_epi16::<4>(_mm256_and_si256(hb, _mm256_set1_epi8(0x03))),
                        ),
                        _mm256_or_si256(
                            _mm256_and_si256(l1, m4),
                            _mm256_slli_epi16::<2>(_mm256_and_si256(hb, _mm256_set1_epi8(0x0c))),
                        ),
                        _mm256_or_si256(
                            _mm256_and_si256(_mm256_srli_epi16::<4>(l0), m4),
                            _mm256_and_si256(hb, _mm256_set1_epi8(0x30)),
                        ),
                        _mm256_or_si256(
                            _mm256_and_si256(_mm256_srli_epi16::<4>(l1), m4),
                            _mm256_srli_epi16::<2>(_mm256_and_si256(hb, _mm256_set1_epi8(-64))),
                        ),
                    ];
                    for (i, vi) in v.iter().enumerate() {
                        let ai = _mm256_loadu_si256(y.add(4 + 128 * h + 32 * i) as *const __m256i);
                        let p = _mm256_maddubs_epi16(*vi, ai);
                        let g = 8 * h + 2 * i;
                        let scv = _mm256_set_m128i(
                            _mm_set1_epi16(sc[g + 1] as i8 as i16),
                            _mm_set1_epi16(sc[g] as i8 as i16),
                        );
                        acc = _mm256_add_epi32(acc, _mm256_madd_epi16(p, scv));
                    }
                }
                let sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(x.add(192) as *const __m128i));
                let corr =
                    _mm256_madd_epi16(sc16, _mm256_loadu_si256(y.add(260) as *const __m256i));
                acc = _mm256_sub_epi32(acc, _mm256_slli_epi32::<5>(corr));
                let d = yd * f16(rd_u16(x.add(208)));
                sum += d * hsum(acc) as f32;
            } else {
                let ms = k4_scales(x.add(4));
                let qs = x.add(if F == Q4_K { 16 } else { 48 });
                let hq = if F == Q5_K {
                    _mm256_loadu_si256(x.add(16) as *const __m256i)
                } else {
                    _mm256_setzero_si256()
                };
                for j in 0..4 {
                    let q = _mm256_loadu_si256(qs.add(32 * j) as *const __m256i);
                    let mut lo = _mm256_and_si256(q, m4);
                    let mut hi = _mm256_and_si256(_mm256_srli_epi16::<4>(q), m4);
                    if F == Q5_K {
                        let h0 = _mm256_and_si256(
                            _mm256_srl_epi16(hq, _mm_cvtsi32_si128(2 * j as i32)),
                            one,
                        );
                        let h1 = _mm256_and_si256(
                            _mm256_srl_epi16(hq, _mm_cvtsi32_si128(2 * j as i32 + 1)),
                            one,
                        );
                        lo = _mm256_or_si256(lo, _mm256_slli_epi16::<4>(h0));
                        hi = _mm256_or_si256(hi, _mm256_slli_epi16::<4>(h1));
                    }
                    let plo = _mm256_maddubs_epi16(
                        lo,
                        _mm256_loadu_si256(y.add(4 + 64 * j) as *const __m256i),
                    );
                    let phi = _mm256_maddubs_epi16(
                        hi,
                        _mm256_loadu_si256(y.add(36 + 64 * j) as *const __m256i),
                    );
                    acc = _mm256_add_epi32(
                        acc,
                        _mm256_madd_epi16(plo, _mm256_set1_epi16(ms[2 * j] as i16)),
                    );
                    acc = _mm256_add_epi32(
                        acc,
                        _mm256_madd_epi16(phi, _mm256_set1_epi16(ms[2 * j + 1] as i16)),
                    );
                }
                let bl = _mm_loadu_si128(y.add(260) as *const __m128i);
                let bh = _mm_loadu_si128(y.add(276) as *const __m128i);
                let pairs = _mm_hadd_epi16(bl, bh);
                let mins = _mm_cvtepu8_epi16(_mm_loadl_epi64(ms.as_ptr().add(8) as *const __m128i));
                let pm = _mm_madd_epi16(mins, pairs);
                let pm = _mm_add_epi32(pm, _mm_unpackhi_epi64(pm, pm));
                let pm = _mm_add_epi32(pm, _mm_shuffle_epi32::<0b10_11_00_01>(pm));
                let summs = _mm_cvtsi128_si32(pm);
                let d = yd * f16(rd_u16(x));
                let dmin = yd * f16(rd_u16(x.add(2)));
                sum += d * hsum(acc) as f32 - dmin * summs as f32;
            }
        }
        *out.add(r) = sum;
    }
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn store_rows(out: *mut f32, v: __m256, nvalid: usize) {
    if nvalid >= 8 {
        _mm256_storeu_ps(out, v);
    } else {
        let mut tmp = [0f32; 8];
        _mm256_storeu_ps(tmp.as_mut_ptr(), v);
        std::ptr::copy_nonoverlapping(tmp.as_ptr(), out, nvalid);
    }
}

/// One GEMM tile for the K-quants (8 rows of a packed panel).
///
/// # Safety
/// The kernel families' CPU features must be available; `panel` holds
/// `nb * panel_block_bytes(F)` bytes; the tile's pointers cover its rows.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn gemm_k<const F: u8, const T: usize>(
    panel: *const u8,
    half: usize,
    nb: usize,
    tile: Tile,
    nvalid: usize,
) {
    let a: [ActRow; T] = std::array::from_fn(|t| tile.act(t));
    let pbb = panel_block_bytes(F);
    let (ng, qpg) = if F == Q6_K { (16, 4) } else { (8, 8) };
    let base2 = if F == Q6_K { 5120 } else { 4608 };
    let ho = 32 * half;
    let ones = _mm256_set1_epi16(1);
    let zero = _mm256_setzero_si256();
    let mut accf = [_mm256_setzero_ps(); T];
    for sb in 0..nb {
        let pb = panel.add(sb * pbb);
        let ao = sb * 292;
        let mut sumi = [zero; T];
        for g in 0..ng {
            let mut s = [zero; T];
            for qq in 0..qpg {
                let q = g * qpg + qq;
                let wv = _mm256_loadu_si256(pb.add(64 * q + ho) as *const __m256i);
                for t in 0..T {
                    let av = _mm256_set1_epi32(rd_i32(a[t].q.add(ao + 4 + 4 * q)));
                    s[t] = _mm256_add_epi32(
                        s[t],
                        _mm256_madd_epi16(_mm256_maddubs_epi16(wv, av), ones),
                    );
                }
            }
            let scv = _mm256_loadu_si256(pb.add(4096 + 64 * g + ho) as *const __m256i);
            for t in 0..T {
                sumi[t] = _mm256_add_epi32(sumi[t], _mm256_mullo_epi32(s[t], scv));
            }
        }
        let mut s2 = [zero; T];
        for k in 0..8 {
            let v = _mm256_loadu_si256(pb.add(base2 + 64 * k + ho) as *const __m256i);
            for t in 0..T {
                let bv = _mm256_set1_epi32(rd_i32(a[t].q.add(ao + 260 + 4 * k)));
                s2[t] = _mm256_add_epi32(s2[t], _mm256_madd_epi16(v, bv));
            }
        }
        for t in 0..T {
            let yd = _mm256_set1_ps(*a[t].d.add(sb));
            if F == Q6_K {
                let si = _mm256_sub_epi32(sumi[t], _mm256_slli_epi32::<5>(s2[t]));
                let d = _mm256_mul_ps(_mm256_loadu_ps(pb.add(5632 + ho) as *const f32), yd);
                accf[t] = _mm256_add_ps(accf[t], _mm256_mul_ps(d, _mm256_cvtepi32_ps(si)));
            } else {
                let d = _mm256_mul_ps(_mm256_loadu_ps(pb.add(5120 + ho) as *const f32), yd);
                let dmin = _mm256_mul_ps(_mm256_loadu_ps(pb.add(5184 + ho) as *const f32), yd);
                let term = _mm256_sub_ps(
                    _mm256_mul_ps(d, _mm256_cvtepi32_ps(sumi[t])),
                    _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(s2[t])),
                );
                accf[t] = _mm256_add_ps(accf[t], term);
            }
        }
    }
    for (t, acc) in accf.iter().enumerate().take(tile.nt.min(T)) {
        store_rows(tile.out.add(t * tile.ostride), *acc, nvalid);
    }
}

/// [`super::avx512::gemm_q4k_exact`] on 8-lane vectors: a Q4_K panel (16 rows, packed by
/// `x86::pack_panel`) against up to `T` Q8_K activation rows, rows in the lanes, one 8-row
/// half of the panel after the other, with the float steps of llama.cpp's repacked Q4_K
/// kernels (gemm order with `GEMM`, else the gemv order). The integer sums are those of
/// `vpdpbusd`: `vpmaddubsw` pairs (at most 2·15·128) summed in 16 bits over a sub-block's
/// 8 quads (at most 30720, no saturation), then widened by `vpmaddwd`; so every lane
/// performs exactly the scalar sequence.
///
/// # Safety
/// AVX2, FMA and F16C must be available; the panel holds `nb` packed super-blocks; the
/// activations' `d` side array holds each block's Q8_K scale; `tile.out` is writable for
/// rows `< nvalid` of the tile's valid tokens.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn gemm_q4k_exact<const T: usize, const GEMM: bool>(
    panel: *const u8,
    nb: usize,
    tile: Tile,
    nvalid: usize,
) {
    let a: [ActRow; T] = std::array::from_fn(|t| tile.act(t));
    let pbb = panel_block_bytes(Q4_K);
    let zero = _mm256_setzero_si256();
    let ones = _mm256_set1_epi16(1);
    for h in 0..2 {
        if 8 * h >= nvalid {
            break;
        }
        let mut acc = [_mm256_setzero_ps(); T];
        let mut accm = [_mm256_setzero_ps(); T];
        for sb in 0..nb {
            let pb = panel.add(sb * pbb + 32 * h);
            let ao = sb * 292;
            let d = _mm256_loadu_ps(pb.add(5120) as *const f32);
            let dmin = _mm256_loadu_ps(pb.add(5184) as *const f32);
            let (pairs, per) = if GEMM { (4, 2) } else { (1, 8) };
            for p in 0..pairs {
                let mut isum = [zero; T];
                let mut imin = [zero; T];
                for g in p * per..(p + 1) * per {
                    let mut s = [zero; T];
                    for qq in 0..8 {
                        let q = g * 8 + qq;
                        let wv = _mm256_loadu_si256(pb.add(64 * q) as *const __m256i);
                        for t in 0..T {
                            let av = _mm256_set1_epi32(rd_i32(a[t].q.add(ao + 4 + 4 * q)));
                            s[t] = _mm256_add_epi16(s[t], _mm256_maddubs_epi16(wv, av));
                        }
                    }
                    let scv = _mm256_loadu_si256(pb.add(4096 + 64 * g) as *const __m256i);
                    let mv = _mm256_loadu_si256(pb.add(4608 + 64 * g) as *const __m256i);
                    for t in 0..T {
                        let s32 = _mm256_madd_epi16(s[t], ones);
                        isum[t] = _mm256_add_epi32(isum[t], _mm256_mullo_epi32(s32, scv));
                        let bv = _mm256_set1_epi32(rd_i32(a[t].q.add(ao + 260 + 4 * g)));
                        imin[t] = _mm256_add_epi32(imin[t], _mm256_madd_epi16(mv, bv));
                    }
                }
                for t in 0..T {
                    let yd = _mm256_set1_ps(*a[t].d.add(sb));
                    acc[t] =
                        _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[t]), _mm256_mul_ps(d, yd), acc[t]);
                    accm[t] = _mm256_fmadd_ps(
                        _mm256_cvtepi32_ps(imin[t]),
                        _mm256_mul_ps(dmin, yd),
                        accm[t],
                    );
                }
            }
        }
        let n = (nvalid - 8 * h).min(8);
        for t in 0..tile.nt.min(T) {
            let mut o = [0f32; 8];
            _mm256_storeu_ps(o.as_mut_ptr(), _mm256_sub_ps(acc[t], accm[t]));
            let dst = tile.out.add(t * tile.ostride + 8 * h);
            std::ptr::copy_nonoverlapping(o.as_ptr(), dst, n);
        }
    }
}
