//! A vectorized `expf` that returns the same bits as `f32::exp` (glibc's `expf`).
//!
//! glibc (2.27 and later) computes `expf` in double precision: `x·32/ln2` is split into an
//! integer `k` and a remainder `r`, `2^(k/32)` comes from a 32-entry table, and a cubic
//! polynomial in `r` is rounded once to f32. On CPUs with FMA and AVX2 it runs the
//! `__expf_fma` build of that code, whose multiply-adds are fused; this module performs the
//! very same operations on 8 or 16 lanes. Inputs outside the polynomial's range
//! (|x| ≥ 88, infinities, NaN) go through `f32::exp` lane by lane.
//!
//! Whether the results really are identical depends on the C library, so the vector code
//! is only used after a self-check against `f32::exp` on a spread of inputs has passed
//! (`RUSTORCH_VEXP=0` disables it). Everything stays bit-identical either way.

// The constants are read by the x86-64 code only.
#![cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]

use std::sync::OnceLock;

use super::cpu::Isa;

/// `2^(i/32)` as f64 bits, glibc's `__exp2f_data.tab` (with the `i << 47` pre-subtracted).
pub(crate) const TAB: [u64; 32] = [
    0x3ff0000000000000,
    0x3fefd9b0d3158574,
    0x3fefb5586cf9890f,
    0x3fef9301d0125b51,
    0x3fef72b83c7d517b,
    0x3fef54873168b9aa,
    0x3fef387a6e756238,
    0x3fef1e9df51fdee1,
    0x3fef06fe0a31b715,
    0x3feef1a7373aa9cb,
    0x3feedea64c123422,
    0x3feece086061892d,
    0x3feebfdad5362a27,
    0x3feeb42b569d4f82,
    0x3feeab07dd485429,
    0x3feea47eb03a5585,
    0x3feea09e667f3bcd,
    0x3fee9f75e8ec5f74,
    0x3feea11473eb0187,
    0x3feea589994cce13,
    0x3feeace5422aa0db,
    0x3feeb737b0cdc5e5,
    0x3feec49182a3f090,
    0x3feed503b23e255d,
    0x3feee89f995ad3ad,
    0x3feeff76f2fb5e47,
    0x3fef199bdd85529c,
    0x3fef3720dcef9069,
    0x3fef5818dcfba487,
    0x3fef7c97337b9b5f,
    0x3fefa4afa2a490da,
    0x3fefd0765b6e4540,
];
pub(crate) const INV_LN2_N: u64 = 0x40471547652b82fe; // 32 / ln 2
pub(crate) const SHIFT: u64 = 0x4338000000000000; // 0x1.8p52
pub(crate) const C0: u64 = 0x3ebc6af84b912394;
pub(crate) const C1: u64 = 0x3f2ebfce50fac4f3;
pub(crate) const C2: u64 = 0x3f962e42ff0c52d6;
/// Inputs whose `(bits >> 20) & 0x7ff` exceeds this take glibc's special-case path.
pub(crate) const ABSTOP_MAX: i32 = 0x42a;

/// Whether the vector `exp` may be used (self-check passed).
pub fn vexp_enabled(isa: Isa) -> bool {
    static OK: OnceLock<bool> = OnceLock::new();
    if !matches!(isa, Isa::Avx2 | Isa::Avx512) {
        return false;
    }
    *OK.get_or_init(|| {
        if std::env::var("RUSTORCH_VEXP").is_ok_and(|v| v == "0") {
            return false;
        }
        self_check()
    })
}

fn self_check() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        let mut xs: Vec<f32> = Vec::with_capacity(1 << 17);
        let mut s = 0x2545_f491_4f6c_dd1du64;
        for i in 0..(1 << 16) {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            // uniform over the interesting range, and raw bit patterns
            let u = (s >> 40) as f32 / (1u64 << 24) as f32;
            xs.push(-110.0 + 200.0 * u);
            xs.push(f32::from_bits(s as u32));
            if i < 4096 {
                xs.push(-(i as f32) / 64.0);
            }
        }
        xs.extend_from_slice(&[
            0.0,
            -0.0,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            88.0,
            -88.0,
            88.72283,
            -103.97208,
            -87.33655,
            1e-30,
            -1e-30,
        ]);
        while !xs.len().is_multiple_of(16) {
            xs.push(0.5);
        }
        let want: Vec<f32> = xs.iter().map(|x| x.exp()).collect();
        let same = |got: &[f32]| {
            got.iter()
                .zip(&want)
                .all(|(g, w)| g.to_bits() == w.to_bits() || (g.is_nan() && w.is_nan()))
        };
        let mut got = xs.clone();
        unsafe { x86::exp_slice_avx2(&mut got) };
        if !same(&got) {
            return false;
        }
        if Isa::available().contains(&Isa::Avx512) {
            let mut got = xs.clone();
            unsafe { x86::exp_slice_avx512(&mut got) };
            if !same(&got) {
                return false;
            }
        }
        true
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// `x = exp(x)` element-wise, bit-identical to `f32::exp`.
pub fn exp_slice(isa: Isa, x: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if vexp_enabled(isa) {
        // SAFETY: the family was detected.
        unsafe {
            if isa == Isa::Avx512 {
                x86::exp_slice_avx512(x)
            } else {
                x86::exp_slice_avx2(x)
            }
        }
        return;
    }
    let _ = isa;
    for v in x.iter_mut() {
        *v = v.exp();
    }
}

/// `gate = silu(gate) * up` (`silu(x) = x / (1 + exp(-x))`), bit-identical to
/// [`super::ops::swiglu`].
pub fn swiglu(isa: Isa, gate: &mut [f32], up: &[f32]) {
    #[cfg(target_arch = "x86_64")]
    if vexp_enabled(isa) && isa == Isa::Avx512 {
        // SAFETY: the family was detected.
        unsafe { x86::swiglu_avx512(gate, up) };
        return;
    }
    let _ = isa;
    super::ops::swiglu(gate, up)
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod x86 {
    use super::*;
    use std::arch::x86_64::*;

    /// exp of 8 floats; lanes needing glibc's special path are redone with `f32::exp`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) unsafe fn exp8(x: __m256) -> __m256 {
        let bits = _mm256_castps_si256(x);
        let abstop = _mm256_and_si256(_mm256_srli_epi32::<20>(bits), _mm256_set1_epi32(0x7ff));
        let special = _mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(
            abstop,
            _mm256_set1_epi32(ABSTOP_MAX),
        )));
        let lo = half4(_mm256_cvtps_pd(_mm256_castps256_ps128(x)));
        let hi = half4(_mm256_cvtps_pd(_mm256_extractf128_ps::<1>(x)));
        let mut y = _mm256_set_m128(_mm256_cvtpd_ps(hi), _mm256_cvtpd_ps(lo));
        if special != 0 {
            let mut xa = [0f32; 8];
            let mut ya = [0f32; 8];
            _mm256_storeu_ps(xa.as_mut_ptr(), x);
            _mm256_storeu_ps(ya.as_mut_ptr(), y);
            for i in 0..8 {
                if special & (1 << i) != 0 {
                    ya[i] = xa[i].exp();
                }
            }
            y = _mm256_loadu_ps(ya.as_ptr());
        }
        y
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn half4(xd: __m256d) -> __m256d {
        let inv = _mm256_set1_pd(f64::from_bits(INV_LN2_N));
        let shift = _mm256_set1_pd(f64::from_bits(SHIFT));
        let kd = _mm256_fmadd_pd(inv, xd, shift);
        let ki = _mm256_castpd_si256(kd);
        let kd = _mm256_sub_pd(kd, shift);
        let r = _mm256_fmsub_pd(inv, xd, kd);
        let idx = _mm256_and_si256(ki, _mm256_set1_epi64x(31));
        let t = _mm256_i64gather_epi64::<8>(TAB.as_ptr() as *const i64, idx);
        let s = _mm256_castsi256_pd(_mm256_add_epi64(t, _mm256_slli_epi64::<47>(ki)));
        let y0 = _mm256_fmadd_pd(
            r,
            _mm256_set1_pd(f64::from_bits(C0)),
            _mm256_set1_pd(f64::from_bits(C1)),
        );
        let r2 = _mm256_mul_pd(r, r);
        let y1 = _mm256_fmadd_pd(r, _mm256_set1_pd(f64::from_bits(C2)), _mm256_set1_pd(1.0));
        let y = _mm256_fmadd_pd(y0, r2, y1);
        _mm256_mul_pd(y, s)
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn half8(xd: __m512d) -> __m512d {
        let inv = _mm512_set1_pd(f64::from_bits(INV_LN2_N));
        let shift = _mm512_set1_pd(f64::from_bits(SHIFT));
        let kd = _mm512_fmadd_pd(inv, xd, shift);
        let ki = _mm512_castpd_si512(kd);
        let kd = _mm512_sub_pd(kd, shift);
        let r = _mm512_fmsub_pd(inv, xd, kd);
        let t0 = _mm512_loadu_si512(TAB.as_ptr() as *const __m512i);
        let t1 = _mm512_loadu_si512(TAB.as_ptr().add(8) as *const __m512i);
        let t2 = _mm512_loadu_si512(TAB.as_ptr().add(16) as *const __m512i);
        let t3 = _mm512_loadu_si512(TAB.as_ptr().add(24) as *const __m512i);
        let lo = _mm512_permutex2var_epi64(t0, ki, t1);
        let hi = _mm512_permutex2var_epi64(t2, ki, t3);
        let sel = _mm512_test_epi64_mask(ki, _mm512_set1_epi64(16));
        let t = _mm512_mask_blend_epi64(sel, lo, hi);
        let s = _mm512_castsi512_pd(_mm512_add_epi64(t, _mm512_slli_epi64::<47>(ki)));
        let y0 = _mm512_fmadd_pd(
            r,
            _mm512_set1_pd(f64::from_bits(C0)),
            _mm512_set1_pd(f64::from_bits(C1)),
        );
        let r2 = _mm512_mul_pd(r, r);
        let y1 = _mm512_fmadd_pd(r, _mm512_set1_pd(f64::from_bits(C2)), _mm512_set1_pd(1.0));
        let y = _mm512_fmadd_pd(y0, r2, y1);
        _mm512_mul_pd(y, s)
    }

    /// exp of 16 floats (see [`exp8`]).
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    pub(crate) unsafe fn exp16(x: __m512) -> __m512 {
        let bits = _mm512_castps_si512(x);
        let abstop = _mm512_and_si512(_mm512_srli_epi32::<20>(bits), _mm512_set1_epi32(0x7ff));
        let special = _mm512_cmpgt_epi32_mask(abstop, _mm512_set1_epi32(ABSTOP_MAX));
        let xl = _mm512_castps512_ps256(x);
        let xh = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(x)));
        let yl = _mm512_cvtpd_ps(half8(_mm512_cvtps_pd(xl)));
        let yh = _mm512_cvtpd_ps(half8(_mm512_cvtps_pd(xh)));
        let mut y = _mm512_castpd_ps(_mm512_insertf64x4::<1>(
            _mm512_castps_pd(_mm512_castps256_ps512(yl)),
            _mm256_castps_pd(yh),
        ));
        if special != 0 {
            let mut xa = [0f32; 16];
            let mut ya = [0f32; 16];
            _mm512_storeu_ps(xa.as_mut_ptr(), x);
            _mm512_storeu_ps(ya.as_mut_ptr(), y);
            for i in 0..16 {
                if special & (1 << i) != 0 {
                    ya[i] = xa[i].exp();
                }
            }
            y = _mm512_loadu_ps(ya.as_ptr());
        }
        y
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) unsafe fn exp_slice_avx2(x: &mut [f32]) {
        let n = x.len();
        let p = x.as_mut_ptr();
        let mut i = 0;
        while i + 8 <= n {
            _mm256_storeu_ps(p.add(i), exp8(_mm256_loadu_ps(p.add(i))));
            i += 8;
        }
        for v in &mut x[i..] {
            *v = v.exp();
        }
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    pub(crate) unsafe fn exp_slice_avx512(x: &mut [f32]) {
        let n = x.len();
        let p = x.as_mut_ptr();
        let mut i = 0;
        while i + 16 <= n {
            _mm512_storeu_ps(p.add(i), exp16(_mm512_loadu_ps(p.add(i))));
            i += 16;
        }
        for v in &mut x[i..] {
            *v = v.exp();
        }
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    pub(crate) unsafe fn swiglu_avx512(gate: &mut [f32], up: &[f32]) {
        let n = gate.len().min(up.len());
        let (g, u) = (gate.as_mut_ptr(), up.as_ptr());
        let one = _mm512_set1_ps(1.0);
        let sign = _mm512_set1_epi32(i32::MIN);
        let mut i = 0;
        while i + 16 <= n {
            let x = _mm512_loadu_ps(g.add(i));
            let e = exp16(_mm512_castsi512_ps(_mm512_xor_si512(
                _mm512_castps_si512(x),
                sign,
            )));
            let s = _mm512_div_ps(x, _mm512_add_ps(one, e));
            _mm512_storeu_ps(g.add(i), _mm512_mul_ps(s, _mm512_loadu_ps(u.add(i))));
            i += 16;
        }
        super::super::ops::swiglu(&mut gate[i..n], &up[i..n]);
    }
}
