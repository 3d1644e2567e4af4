//! Float dot products (F32·F32 and F16·F16 weights/activations) with SIMD.
//!
//! They differ from the scalar references in `dot.rs` only in summation order: F32 products
//! are rounded to f32 and summed in f32 (8 or 16 partial sums), F16 products (exact in f32)
//! are summed in f64 as in the reference.

use super::cpu::Isa;
use super::dot::vec_dot;
use crate::types::GgmlType;

/// `vec_dot` for F32/F16 with the given kernel family; other types go to the reference.
pub fn dot_float(isa: Isa, ty: GgmlType, n: usize, w: &[u8], a: &[u8]) -> f32 {
    debug_assert!(w.len() >= n * ty.type_size() && a.len() >= n * ty.type_size());
    match (isa, ty) {
        #[cfg(target_arch = "x86_64")]
        (Isa::Avx512, GgmlType::F32) => unsafe { x86::f32_avx512(n, w.as_ptr(), a.as_ptr()) },
        #[cfg(target_arch = "x86_64")]
        (Isa::Avx512, GgmlType::F16) => unsafe { x86::f16_avx512(n, w.as_ptr(), a.as_ptr()) },
        #[cfg(target_arch = "x86_64")]
        (Isa::Avx2, GgmlType::F32) => unsafe { x86::f32_avx2(n, w.as_ptr(), a.as_ptr()) },
        #[cfg(target_arch = "x86_64")]
        (Isa::Avx2, GgmlType::F16) => unsafe { x86::f16_avx2(n, w.as_ptr(), a.as_ptr()) },
        #[cfg(target_arch = "aarch64")]
        (Isa::Neon, GgmlType::F32) => unsafe { neon::f32_neon(n, w.as_ptr(), a.as_ptr()) },
        _ => vec_dot(ty, n, w, a),
    }
}

/// Plain f32 dot of two slices with the given family (attention, tests).
pub fn dot_f32_slices(isa: Isa, a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe {
            x86::f32_avx512(n, a.as_ptr() as *const u8, b.as_ptr() as *const u8)
        },
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { x86::f32_avx2(n, a.as_ptr() as *const u8, b.as_ptr() as *const u8) },
        #[cfg(target_arch = "aarch64")]
        Isa::Neon => unsafe { neon::f32_neon(n, a.as_ptr() as *const u8, b.as_ptr() as *const u8) },
        _ => a.iter().zip(b).map(|(x, y)| x * y).sum(),
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn hsum8(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_movehdup_ps(s));
        _mm_cvtss_f32(s)
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn hsum4d(v: __m256d) -> f64 {
        let s = _mm_add_pd(_mm256_castpd256_pd128(v), _mm256_extractf128_pd::<1>(v));
        let s = _mm_add_sd(s, _mm_unpackhi_pd(s, s));
        _mm_cvtsd_f64(s)
    }

    #[inline(always)]
    unsafe fn rd_f32(p: *const u8, i: usize) -> f32 {
        std::ptr::read_unaligned((p as *const f32).add(i))
    }

    #[inline(always)]
    unsafe fn rd_f16(p: *const u8, i: usize) -> f32 {
        crate::quant::f16_to_f32(std::ptr::read_unaligned((p as *const u16).add(i)))
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn f32_avx2(n: usize, w: *const u8, a: *const u8) -> f32 {
        let (w, a) = (w as *const f32, a as *const f32);
        let mut acc = [_mm256_setzero_ps(); 4];
        let mut i = 0;
        while i + 32 <= n {
            for (k, s) in acc.iter_mut().enumerate() {
                let p = _mm256_mul_ps(
                    _mm256_loadu_ps(w.add(i + 8 * k)),
                    _mm256_loadu_ps(a.add(i + 8 * k)),
                );
                *s = _mm256_add_ps(*s, p);
            }
            i += 32;
        }
        while i + 8 <= n {
            acc[0] = _mm256_add_ps(
                acc[0],
                _mm256_mul_ps(_mm256_loadu_ps(w.add(i)), _mm256_loadu_ps(a.add(i))),
            );
            i += 8;
        }
        let mut s = hsum8(_mm256_add_ps(
            _mm256_add_ps(acc[0], acc[1]),
            _mm256_add_ps(acc[2], acc[3]),
        ));
        while i < n {
            s += rd_f32(w as *const u8, i) * rd_f32(a as *const u8, i);
            i += 1;
        }
        s
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn f16_avx2(n: usize, w: *const u8, a: *const u8) -> f32 {
        let mut acc = [_mm256_setzero_pd(); 4];
        let mut i = 0;
        while i + 16 <= n {
            for k in 0..2 {
                let x = _mm256_cvtph_ps(_mm_loadu_si128(w.add(2 * (i + 8 * k)) as *const __m128i));
                let y = _mm256_cvtph_ps(_mm_loadu_si128(a.add(2 * (i + 8 * k)) as *const __m128i));
                let p = _mm256_mul_ps(x, y);
                acc[2 * k] = _mm256_add_pd(acc[2 * k], _mm256_cvtps_pd(_mm256_castps256_ps128(p)));
                acc[2 * k + 1] = _mm256_add_pd(
                    acc[2 * k + 1],
                    _mm256_cvtps_pd(_mm256_extractf128_ps::<1>(p)),
                );
            }
            i += 16;
        }
        let mut s = hsum4d(_mm256_add_pd(
            _mm256_add_pd(acc[0], acc[1]),
            _mm256_add_pd(acc[2], acc[3]),
        ));
        while i < n {
            s += (rd_f16(w, i) * rd_f16(a, i)) as f64;
            i += 1;
        }
        s as f32
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    pub(super) unsafe fn f32_avx512(n: usize, w: *const u8, a: *const u8) -> f32 {
        let (wf, af) = (w as *const f32, a as *const f32);
        let mut acc = [_mm512_setzero_ps(); 4];
        let mut i = 0;
        while i + 64 <= n {
            for (k, s) in acc.iter_mut().enumerate() {
                let p = _mm512_mul_ps(
                    _mm512_loadu_ps(wf.add(i + 16 * k)),
                    _mm512_loadu_ps(af.add(i + 16 * k)),
                );
                *s = _mm512_add_ps(*s, p);
            }
            i += 64;
        }
        while i + 16 <= n {
            acc[0] = _mm512_add_ps(
                acc[0],
                _mm512_mul_ps(_mm512_loadu_ps(wf.add(i)), _mm512_loadu_ps(af.add(i))),
            );
            i += 16;
        }
        let mut s = _mm512_reduce_add_ps(_mm512_add_ps(
            _mm512_add_ps(acc[0], acc[1]),
            _mm512_add_ps(acc[2], acc[3]),
        ));
        while i < n {
            s += rd_f32(w, i) * rd_f32(a, i);
            i += 1;
        }
        s
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    pub(super) unsafe fn f16_avx512(n: usize, w: *const u8, a: *const u8) -> f32 {
        let mut acc = [_mm512_setzero_pd(); 4];
        let mut i = 0;
        while i + 32 <= n {
            for k in 0..2 {
                let x =
                    _mm512_cvtph_ps(_mm256_loadu_si256(w.add(2 * (i + 16 * k)) as *const __m256i));
                let y =
                    _mm512_cvtph_ps(_mm256_loadu_si256(a.add(2 * (i + 16 * k)) as *const __m256i));
                let p = _mm512_mul_ps(x, y);
                let lo = _mm512_castps512_ps256(p);
                let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(p)));
                acc[2 * k] = _mm512_add_pd(acc[2 * k], _mm512_cvtps_pd(lo));
                acc[2 * k + 1] = _mm512_add_pd(acc[2 * k + 1], _mm512_cvtps_pd(hi));
            }
            i += 32;
        }
        let mut s = _mm512_reduce_add_pd(_mm512_add_pd(
            _mm512_add_pd(acc[0], acc[1]),
            _mm512_add_pd(acc[2], acc[3]),
        ));
        while i < n {
            s += (rd_f16(w, i) * rd_f16(a, i)) as f64;
            i += 1;
        }
        s as f32
    }
}

#[cfg(target_arch = "aarch64")]
mod neon {
    use std::arch::aarch64::*;

    /// # Safety
    /// NEON must be available; `w`/`a` hold `n` f32 each.
    #[target_feature(enable = "neon")]
    pub(super) unsafe fn f32_neon(n: usize, w: *const u8, a: *const u8) -> f32 {
        let (w, a) = (w as *const f32, a as *const f32);
        let mut acc = [vdupq_n_f32(0.0); 4];
        let mut i = 0;
        while i + 16 <= n {
            for (k, s) in acc.iter_mut().enumerate() {
                let p = vmulq_f32(vld1q_f32(w.add(i + 4 * k)), vld1q_f32(a.add(i + 4 * k)));
                *s = vaddq_f32(*s, p);
            }
            i += 16;
        }
        let mut s = vaddvq_f32(vaddq_f32(
            vaddq_f32(acc[0], acc[1]),
            vaddq_f32(acc[2], acc[3]),
        ));
        while i < n {
            s += std::ptr::read_unaligned(w.add(i)) * std::ptr::read_unaligned(a.add(i));
            i += 1;
        }
        s
    }
}
