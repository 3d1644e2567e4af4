//! AVX-512 (F/BW/VL + VNNI) kernels.
//!
//! * GEMV for Q4_K/Q5_K (one activation row against up to 8 weight rows), row by row
//!   (`vpmaddubsw` + `vpdpwssd` with the sub-block scales, one reduction per super-block).
//!   Legacy formats and Q6_K use `x86::lanes` instead, which follows ggml's float order.
//! * GEMM for Q4_K/Q5_K: 16-row panels packed by `x86::pack_panel` (one byte per value,
//!   `[quad][row][4]`) against 8 activation rows at a time: every `vpdpbusd` is one 4-byte
//!   activation broadcast times 16 rows, lanes are rows, so no horizontal sums at all.
//!   `gemm_q4k_exact` is the same layout with llama.cpp's repacked-Q4_K float order.

use std::arch::x86_64::*;

use super::{rd_i32, rd_u16, rd_u32};
use crate::kernels::fmt::*;

/// The 8 scales and 8 mins of a Q4_K/Q5_K super-block, as 16 i16 (`sc0..7, m0..7`).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn k4_scales(p: *const u8) -> __m256i {
    const KMASK1: u32 = 0x3f3f_3f3f;
    const KMASK2: u32 = 0x0f0f_0f0f;
    const KMASK3: u32 = 0x0303_0303;
    let mut u = [rd_u32(p), rd_u32(p.add(4)), rd_u32(p.add(8)), 0];
    u[3] = ((u[2] >> 4) & KMASK2) | (((u[1] >> 6) & KMASK3) << 4);
    let uaux = u[1] & KMASK1;
    u[1] = (u[2] & KMASK2) | (((u[0] >> 6) & KMASK3) << 4);
    u[2] = uaux;
    u[0] &= KMASK1;
    _mm256_cvtepu8_epi16(_mm_loadu_si128(u.as_ptr() as *const __m128i))
}

#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn idx16(groups: [i16; 4], per: usize) -> __m512i {
    let mut v = [0i16; 32];
    for (i, x) in v.iter_mut().enumerate() {
        *x = groups[(i / per).min(3)];
    }
    _mm512_loadu_si512(v.as_ptr() as *const __m512i)
}

#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn hsum128(v: __m128i) -> i32 {
    let s = _mm_add_epi32(v, _mm_unpackhi_epi64(v, v));
    let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b10_11_00_01>(s));
    _mm_cvtsi128_si32(s)
}

/// `out[r] = dot(row r, a)` for `nrows` rows of K-quant format `F`, `nb` super-blocks each.
///
/// # Safety
/// The kernel family's CPU features must be available; pointers must cover the stated sizes.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(crate) unsafe fn gemv_k<const F: u8>(
    w: *const u8,
    rb: usize,
    nrows: usize,
    nb: usize,
    a: ActRow,
    out: *mut f32,
) {
    let bs = block_bytes(F);
    let m4 = _mm512_set1_epi8(0x0f);
    // scale-broadcast indices: Q4_K/Q5_K chunk k covers sub-blocks 2k, 2k+1 (16 i16 each);
    // Q6_K vector (half h, part p) covers groups 8h+4p..8h+4p+4 (8 i16 each)
    let kidx = [
        idx16([0, 1, 1, 1], 16),
        idx16([2, 3, 3, 3], 16),
        idx16([4, 5, 5, 5], 16),
        idx16([6, 7, 7, 7], 16),
    ];
    let q6idx = [
        idx16([0, 1, 2, 3], 8),
        idx16([4, 5, 6, 7], 8),
        idx16([8, 9, 10, 11], 8),
        idx16([12, 13, 14, 15], 8),
    ];
    let q5sel: [__m512i; 4] = std::array::from_fn(|k| {
        let lo = _mm256_set1_epi8((1u8 << (2 * k)) as i8);
        let hi = _mm256_set1_epi8((2u8 << (2 * k)) as i8);
        _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi)
    });
    // rows stream one after another: prefetch about 8 KiB ahead
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
            let mut acc = _mm512_setzero_si512();
            if F == Q6_K {
                let sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(x.add(192) as *const __m128i));
                let sc512 = _mm512_castsi256_si512(sc16);
                for h in 0..2 {
                    let l = _mm512_loadu_si512(x.add(64 * h) as *const __m512i);
                    let hb = _mm256_loadu_si256(x.add(128 + 32 * h) as *const __m256i);
                    let hz = _mm512_inserti64x4::<1>(
                        _mm512_castsi256_si512(hb),
                        _mm256_srli_epi16::<2>(hb),
                    );
                    let va = _mm512_or_si512(
                        _mm512_and_si512(l, m4),
                        _mm512_slli_epi16::<4>(_mm512_and_si512(hz, _mm512_set1_epi8(0x03))),
                    );
                    let vb = _mm512_or_si512(
                        _mm512_and_si512(_mm512_srli_epi16::<4>(l), m4),
                        _mm512_and_si512(hz, _mm512_set1_epi8(0x30)),
                    );
                    let aa = _mm512_loadu_si512(y.add(4 + 128 * h) as *const __m512i);
                    let ab = _mm512_loadu_si512(y.add(4 + 128 * h + 64) as *const __m512i);
                    let pa = _mm512_maddubs_epi16(va, aa);
                    let pb = _mm512_maddubs_epi16(vb, ab);
                    acc =
                        _mm512_dpwssd_epi32(acc, pa, _mm512_permutexvar_epi16(q6idx[2 * h], sc512));
                    acc = _mm512_dpwssd_epi32(
                        acc,
                        pb,
                        _mm512_permutexvar_epi16(q6idx[2 * h + 1], sc512),
                    );
                }
                let corr =
                    _mm256_madd_epi16(sc16, _mm256_loadu_si256(y.add(260) as *const __m256i));
                acc = _mm512_sub_epi32(acc, _mm512_slli_epi32::<5>(_mm512_zextsi256_si512(corr)));
                let sumi = _mm512_reduce_add_epi32(acc);
                let d = yd * f16(rd_u16(x.add(208)));
                sum += d * sumi as f32;
            } else {
                let ms = k4_scales(x.add(4));
                let sc512 = _mm512_castsi256_si512(ms);
                let qs = x.add(if F == Q4_K { 16 } else { 48 });
                let hz = if F == Q5_K {
                    _mm512_broadcast_i64x4(_mm256_loadu_si256(x.add(16) as *const __m256i))
                } else {
                    _mm512_setzero_si512()
                };
                for k in 0..4 {
                    let q = _mm256_loadu_si256(qs.add(32 * k) as *const __m256i);
                    let mut wz = _mm512_and_si512(
                        _mm512_inserti64x4::<1>(
                            _mm512_castsi256_si512(q),
                            _mm256_srli_epi16::<4>(q),
                        ),
                        m4,
                    );
                    if F == Q5_K {
                        let m = _mm512_test_epi8_mask(hz, q5sel[k]);
                        wz = _mm512_mask_add_epi8(wz, m, wz, _mm512_set1_epi8(0x10));
                    }
                    let az = _mm512_loadu_si512(y.add(4 + 64 * k) as *const __m512i);
                    let p = _mm512_maddubs_epi16(wz, az);
                    acc = _mm512_dpwssd_epi32(acc, p, _mm512_permutexvar_epi16(kidx[k], sc512));
                }
                let sumi = _mm512_reduce_add_epi32(acc);
                let bl = _mm_loadu_si128(y.add(260) as *const __m128i);
                let bh = _mm_loadu_si128(y.add(276) as *const __m128i);
                let pairs = _mm_hadd_epi16(bl, bh);
                let summs = hsum128(_mm_madd_epi16(_mm256_extracti128_si256::<1>(ms), pairs));
                let d = yd * f16(rd_u16(x));
                let dmin = yd * f16(rd_u16(x.add(2)));
                sum += d * sumi as f32 - dmin * summs as f32;
            }
        }
        *out.add(r) = sum;
    }
}

#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn f16(h: u16) -> f32 {
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(h as i32)))
}

/// One GEMM tile for the K-quants (`nb` super-blocks).
///
/// # Safety
/// The kernel families' CPU features must be available; `panel` holds
/// `nb * panel_block_bytes(F)` bytes; the tile's pointers cover its rows.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(crate) unsafe fn gemm_k<const F: u8, const T: usize>(
    panel: *const u8,
    nb: usize,
    tile: Tile,
    nvalid: usize,
) {
    let a: [ActRow; T] = std::array::from_fn(|t| tile.act(t));
    let pbb = panel_block_bytes(F);
    let (ng, qpg) = if F == Q6_K { (16, 4) } else { (8, 8) };
    let base2 = if F == Q6_K { 5120 } else { 4608 };
    let mut accf = [_mm512_setzero_ps(); T];
    let zero = _mm512_setzero_si512();
    for sb in 0..nb {
        let pb = panel.add(sb * pbb);
        let ao = sb * 292;
        let mut sumi = [zero; T];
        for g in 0..ng {
            let mut s = [zero; T];
            for qq in 0..qpg {
                let q = g * qpg + qq;
                let wv = _mm512_loadu_si512(pb.add(64 * q) as *const __m512i);
                for t in 0..T {
                    let av = _mm512_set1_epi32(rd_i32(a[t].q.add(ao + 4 + 4 * q)));
                    s[t] = _mm512_dpbusd_epi32(s[t], wv, av);
                }
            }
            let scv = _mm512_loadu_si512(pb.add(4096 + 64 * g) as *const __m512i);
            for t in 0..T {
                sumi[t] = _mm512_add_epi32(sumi[t], _mm512_mullo_epi32(s[t], scv));
            }
        }
        let mut s2 = [zero; T];
        for k in 0..8 {
            let v = _mm512_loadu_si512(pb.add(base2 + 64 * k) as *const __m512i);
            for t in 0..T {
                let bv = _mm512_set1_epi32(rd_i32(a[t].q.add(ao + 260 + 4 * k)));
                s2[t] = _mm512_dpwssd_epi32(s2[t], v, bv);
            }
        }
        for t in 0..T {
            let yd = _mm512_set1_ps(*a[t].d.add(sb));
            if F == Q6_K {
                let si = _mm512_sub_epi32(sumi[t], _mm512_slli_epi32::<5>(s2[t]));
                let d = _mm512_mul_ps(_mm512_loadu_ps(pb.add(5632) as *const f32), yd);
                accf[t] = _mm512_add_ps(accf[t], _mm512_mul_ps(d, _mm512_cvtepi32_ps(si)));
            } else {
                let d = _mm512_mul_ps(_mm512_loadu_ps(pb.add(5120) as *const f32), yd);
                let dmin = _mm512_mul_ps(_mm512_loadu_ps(pb.add(5184) as *const f32), yd);
                let term = _mm512_sub_ps(
                    _mm512_mul_ps(d, _mm512_cvtepi32_ps(sumi[t])),
                    _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(s2[t])),
                );
                accf[t] = _mm512_add_ps(accf[t], term);
            }
        }
    }
    let m: __mmask16 = if nvalid >= 16 {
        0xffff
    } else {
        (1u16 << nvalid) - 1
    };
    for (t, acc) in accf.iter().enumerate().take(tile.nt.min(T)) {
        _mm512_mask_storeu_ps(tile.out.add(t * tile.ostride), m, *acc);
    }
}

/// Q4_K panel (16 rows, packed by `x86::pack_panel`) against up to `T` Q8_K activation rows
/// with the float steps of llama.cpp's repacked Q4_K kernels (see `kernels::q4k_ggml`): with
/// `GEMM`, per super-block and sub-block pair `p`, `acc = fma(f32(sc·dot over the pair),
/// dw·da, acc)` and `accm = fma(f32(m·bsums over the pair), dmin·da, accm)`; without
/// (the gemv rows), the same once per super-block over all sub-blocks; then `acc - accm`.
/// Lanes are the 16 weight rows, so every lane performs exactly the scalar sequence.
///
/// # Safety
/// As [`gemm_k`]; the activations' `d` side array must hold each block's Q8_K scale.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(crate) unsafe fn gemm_q4k_exact<const T: usize, const GEMM: bool>(
    panel: *const u8,
    nb: usize,
    tile: Tile,
    nvalid: usize,
) {
    let a: [ActRow; T] = std::array::from_fn(|t| tile.act(t));
    let pbb = panel_block_bytes(Q4_K);
    let zero = _mm512_setzero_si512();
    let mut acc = [_mm512_setzero_ps(); T];
    let mut accm = [_mm512_setzero_ps(); T];
    for sb in 0..nb {
        let pb = panel.add(sb * pbb);
        let ao = sb * 292;
        let d = _mm512_loadu_ps(pb.add(5120) as *const f32);
        let dmin = _mm512_loadu_ps(pb.add(5184) as *const f32);
        let (pairs, per) = if GEMM { (4, 2) } else { (1, 8) };
        for p in 0..pairs {
            let mut isum = [zero; T];
            let mut imin = [zero; T];
            for g in p * per..(p + 1) * per {
                let mut s = [zero; T];
                for qq in 0..8 {
                    let q = g * 8 + qq;
                    let wv = _mm512_loadu_si512(pb.add(64 * q) as *const __m512i);
                    for t in 0..T {
                        let av = _mm512_set1_epi32(rd_i32(a[t].q.add(ao + 4 + 4 * q)));
                        s[t] = _mm512_dpbusd_epi32(s[t], wv, av);
                    }
                }
                let scv = _mm512_loadu_si512(pb.add(4096 + 64 * g) as *const __m512i);
                let mv = _mm512_loadu_si512(pb.add(4608 + 64 * g) as *const __m512i);
                for t in 0..T {
                    isum[t] = _mm512_add_epi32(isum[t], _mm512_mullo_epi32(s[t], scv));
                    let bv = _mm512_set1_epi32(rd_i32(a[t].q.add(ao + 260 + 4 * g)));
                    imin[t] = _mm512_dpwssd_epi32(imin[t], mv, bv);
                }
            }
            for t in 0..T {
                let yd = _mm512_set1_ps(*a[t].d.add(sb));
                acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[t]), _mm512_mul_ps(d, yd), acc[t]);
                accm[t] = _mm512_fmadd_ps(
                    _mm512_cvtepi32_ps(imin[t]),
                    _mm512_mul_ps(dmin, yd),
                    accm[t],
                );
            }
        }
    }
    let m: __mmask16 = if nvalid >= 16 {
        0xffff
    } else {
        (1u16 << nvalid) - 1
    };
    for t in 0..tile.nt.min(T) {
        let r = _mm512_sub_ps(acc[t], accm[t]);
        _mm512_mask_storeu_ps(tile.out.add(t * tile.ostride), m, r);
    }
}
