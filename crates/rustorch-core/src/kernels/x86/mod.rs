//! x86-64 kernels. Everything here is compiled with `#[target_feature]` and entered only
//! after run-time detection (`kernels::cpu`).
//!
//! This module holds what the AVX2 and AVX-512 families share: unpacking weight blocks to
//! one byte per value in activation order, and packing 16-row GEMM panels.

pub(crate) mod avx2;
pub(crate) mod avx512;
pub(crate) mod lanes;

use std::arch::x86_64::*;

use super::dot::scale_min_k4;
use super::fmt::*;
use crate::quant::{f16_to_f32, IQ4NL_VALUES};

#[inline(always)]
pub(crate) unsafe fn rd_u16(p: *const u8) -> u16 {
    std::ptr::read_unaligned(p as *const u16)
}

#[inline(always)]
pub(crate) unsafe fn rd_u32(p: *const u8) -> u32 {
    std::ptr::read_unaligned(p as *const u32)
}

#[inline(always)]
pub(crate) unsafe fn rd_i32(p: *const u8) -> i32 {
    std::ptr::read_unaligned(p as *const i32)
}

/// IQ4_NL's grid as a byte shuffle table (signed values).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn iq4nl_table() -> __m128i {
    _mm_loadu_si128(IQ4NL_VALUES.as_ptr() as *const __m128i)
}

/// Spreads the 32 bits at `p` to 32 bytes, 0xFF where the bit is set (byte `e` ↔ bit `e`).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn bytes_from_bits_32(p: *const u8) -> __m256i {
    let x = rd_u32(p) as i32;
    let shuf = _mm256_set_epi64x(
        0x0303_0303_0303_0303,
        0x0202_0202_0202_0202,
        0x0101_0101_0101_0101,
        0,
    );
    let bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(x), shuf);
    let bits = _mm256_or_si256(bytes, _mm256_set1_epi64x(0x7fbf_dfef_f7fb_fdfe));
    _mm256_cmpeq_epi8(bits, _mm256_set1_epi64x(-1))
}

/// The 32 values of legacy block `p` as bytes in activation order (element `e` pairs with
/// activation quant `e`): unsigned `0..16` / `0..32` for Q4/Q5 (zero point [`offset`]),
/// signed for Q8_0 and IQ4_NL.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn unpack_legacy<const F: u8>(p: *const u8) -> __m256i {
    if F == Q8_0 {
        return _mm256_loadu_si256(p.add(2) as *const __m256i);
    }
    let qs = _mm_loadu_si128(p.add(qs_off(F)) as *const __m128i);
    let v = _mm256_and_si256(
        _mm256_set_m128i(_mm_srli_epi16::<4>(qs), qs),
        _mm256_set1_epi8(0x0f),
    );
    match F {
        IQ4_NL => {
            let t = iq4nl_table();
            _mm256_shuffle_epi8(_mm256_set_m128i(t, t), v)
        }
        Q5_0 | Q5_1 => _mm256_or_si256(
            v,
            _mm256_and_si256(bytes_from_bits_32(p.add(qh_off(F))), _mm256_set1_epi8(0x10)),
        ),
        _ => v,
    }
}

/// The 256 values of K-quant super-block `p` as unsigned bytes in element order (Q6_K
/// without its `-32`), written to `out`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn unpack_k<const F: u8>(p: *const u8, out: *mut u8) {
    let m4 = _mm256_set1_epi8(0x0f);
    match F {
        Q4_K | Q5_K => {
            let qs = p.add(if F == Q4_K { 16 } else { 48 });
            let hq = if F == Q5_K {
                _mm256_loadu_si256(p.add(16) as *const __m256i)
            } else {
                _mm256_setzero_si256()
            };
            let one = _mm256_set1_epi8(1);
            for j in 0..4 {
                let q = _mm256_loadu_si256(qs.add(32 * j) as *const __m256i);
                let mut lo = _mm256_and_si256(q, m4);
                let mut hi = _mm256_and_si256(_mm256_srli_epi16::<4>(q), m4);
                if F == Q5_K {
                    let s0 = _mm_cvtsi32_si128(2 * j as i32);
                    let s1 = _mm_cvtsi32_si128(2 * j as i32 + 1);
                    let h0 = _mm256_and_si256(_mm256_srl_epi16(hq, s0), one);
                    let h1 = _mm256_and_si256(_mm256_srl_epi16(hq, s1), one);
                    lo = _mm256_or_si256(lo, _mm256_slli_epi16::<4>(h0));
                    hi = _mm256_or_si256(hi, _mm256_slli_epi16::<4>(h1));
                }
                _mm256_storeu_si256(out.add(64 * j) as *mut __m256i, lo);
                _mm256_storeu_si256(out.add(64 * j + 32) as *mut __m256i, hi);
            }
        }
        _ => {
            for h in 0..2 {
                let l0 = _mm256_loadu_si256(p.add(64 * h) as *const __m256i);
                let l1 = _mm256_loadu_si256(p.add(64 * h + 32) as *const __m256i);
                let hb = _mm256_loadu_si256(p.add(128 + 32 * h) as *const __m256i);
                let v1 = _mm256_or_si256(
                    _mm256_and_si256(l0, m4),
                    _mm256_slli_epi16::<4>(_mm256_and_si256(hb, _mm256_set1_epi8(0x03))),
                );
                let v2 = _mm256_or_si256(
                    _mm256_and_si256(l1, m4),
                    _mm256_slli_epi16::<2>(_mm256_and_si256(hb, _mm256_set1_epi8(0x0c))),
                );
                let v3 = _mm256_or_si256(
                    _mm256_and_si256(_mm256_srli_epi16::<4>(l0), m4),
                    _mm256_and_si256(hb, _mm256_set1_epi8(0x30)),
                );
                let v4 = _mm256_or_si256(
                    _mm256_and_si256(_mm256_srli_epi16::<4>(l1), m4),
                    _mm256_srli_epi16::<2>(_mm256_and_si256(hb, _mm256_set1_epi8(-64))),
                );
                let o = out.add(128 * h);
                _mm256_storeu_si256(o as *mut __m256i, v1);
                _mm256_storeu_si256(o.add(32) as *mut __m256i, v2);
                _mm256_storeu_si256(o.add(64) as *mut __m256i, v3);
                _mm256_storeu_si256(o.add(96) as *mut __m256i, v4);
            }
        }
    }
}

/// Packs 16 weight rows (`rows`, each `nblk` blocks of format `F`) into a GEMM panel at
/// `out` (`nblk * panel_block_bytes(F)` bytes, see [`panel_block_bytes`]). With `to_u8`
/// the signed formats are stored as `value + 128`.
///
/// # Safety
/// AVX2 must be available; pointers must cover the stated sizes.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn pack_panel<const F: u8>(
    rows: &[*const u8; PANEL],
    nblk: usize,
    to_u8: bool,
    out: *mut u8,
) {
    let bs = block_bytes(F);
    let pb = panel_block_bytes(F);
    let mut tmp = [0u8; 256];
    let tp = tmp.as_mut_ptr();
    for b in 0..nblk {
        let o = out.add(b * pb);
        for (r, &row) in rows.iter().enumerate() {
            let p = row.add(b * bs);
            let wr =
                |off: usize, v: u32| std::ptr::write_unaligned(o.add(off + 4 * r) as *mut u32, v);
            if is_k(F) {
                unpack_k::<F>(p, tp);
                for q in 0..64 {
                    wr(64 * q, rd_u32(tp.add(4 * q)));
                }
                if F == Q6_K {
                    let sc = std::slice::from_raw_parts(p.add(192), 16);
                    #[allow(clippy::needless_range_loop)] // indices address several arrays in step
                    for g in 0..16 {
                        wr(4096 + 64 * g, sc[g] as i8 as i32 as u32);
                    }
                    for k in 0..8 {
                        let lo = sc[2 * k] as i8 as i16 as u16 as u32;
                        let hi = sc[2 * k + 1] as i8 as i16 as u16 as u32;
                        wr(5120 + 64 * k, lo | (hi << 16));
                    }
                    wr(5632, f16_to_f32(rd_u16(p.add(208))).to_bits());
                } else {
                    let scales = std::slice::from_raw_parts(p.add(4), 12);
                    for j in 0..8 {
                        let (sc, m) = scale_min_k4(j, scales);
                        wr(4096 + 64 * j, sc as u32);
                        wr(4608 + 64 * j, m as u32 | ((m as u32) << 16));
                    }
                    wr(5120, f16_to_f32(rd_u16(p)).to_bits());
                    wr(5184, f16_to_f32(rd_u16(p.add(2))).to_bits());
                }
            } else {
                let mut v = unpack_legacy::<F>(p);
                if signed(F) && to_u8 {
                    v = _mm256_xor_si256(v, _mm256_set1_epi8(-128));
                }
                _mm256_storeu_si256(tp as *mut __m256i, v);
                for q in 0..8 {
                    wr(64 * q, rd_u32(tp.add(4 * q)));
                }
                wr(512, f16_to_f32(rd_u16(p)).to_bits());
                if has_min(F) {
                    wr(576, f16_to_f32(rd_u16(p.add(2))).to_bits());
                }
            }
        }
    }
}
