//! The exponential and SiLU of ggml's CPU backend, bit for bit: llama.cpp's SwiGLU
//! feed-forward computes `silu(x) = x / (1 + e^-x)` with `ggml_v_expf`, a polynomial
//! approximation (not `expf`), 16 lanes at a time on AVX-512 builds. Reproducing it exactly
//! is part of parity: a different last bit in a gate activation can flip the rounding of the
//! next matmul's quantized input.
//!
//! The scalar [`expf`] performs the very operations of the AVX-512 variant one lane at a time
//! (fused multiply-adds in f32, the final `2^n` scaling rounded once); the AVX-512 code is
//! used where the CPU has it, and both agree bit for bit (tested).

use super::cpu::Isa;

const SHIFT: f32 = 12582912.0; // 0x1.8p23
const LOG2E: f32 = f32::from_bits(0x3fb8_aa3b); // 0x1.715476p+0
const LN2_HI: f32 = f32::from_bits(0x3f31_7200); // 0x1.62e4p-1
const LN2_LO: f32 = f32::from_bits(0x35bf_be8e); // 0x1.7f7d1cp-20
const P0: f32 = f32::from_bits(0x3c07_2010); // 0x1.0e4020p-7
const P1: f32 = f32::from_bits(0x3d2b_9f17); // 0x1.573e2ep-5
const P2: f32 = f32::from_bits(0x3e2a_af33); // 0x1.555e66p-3
const P3: f32 = f32::from_bits(0x3eff_fedb); // 0x1.fffdb6p-2
const P4: f32 = f32::from_bits(0x3f7f_fff6); // 0x1.ffffecp-1

/// ggml's vectorised `expf`, one lane.
pub fn expf(x: f32) -> f32 {
    let z = x.mul_add(LOG2E, SHIFT);
    let n = z - SHIFT;
    let b = (-n).mul_add(LN2_LO, (-n).mul_add(LN2_HI, x));
    let u = b * b;
    let j = P0
        .mul_add(b, P1)
        .mul_add(u, P2.mul_add(b, P3))
        .mul_add(u, P4.mul_add(b, 1.0));
    if n.abs() > 192.0 {
        return if n <= 0.0 { 0.0 } else { f32::INFINITY };
    }
    if n.is_nan() {
        return f32::NAN;
    }
    // scalef: j · 2^n rounded once (exact in f64, then one rounding to f32)
    (j as f64 * 2f64.powi(n as i32)) as f32
}

/// `x / (1 + expf(-x))` as `ggml_v_silu`.
pub fn silu(x: f32) -> f32 {
    x / (1.0 + expf(0.0 - x))
}

/// `gate = silu(gate) * up` over rows of `n_row` values, as ggml's `ggml_vec_swiglu_f32`
/// on an AVX-512 build: the first `n_row & !15` values of each row with [`silu`], the rest
/// with the C library's `expf`, as ggml's scalar tail does.
pub fn swiglu(isa: Isa, gate: &mut [f32], up: &[f32], n_row: usize) {
    let n_row = n_row.max(1);
    for (g, u) in gate.chunks_mut(n_row).zip(up.chunks(n_row)) {
        swiglu_part(isa, g, u, 0, n_row);
    }
}

/// [`swiglu`] for the values `start..start + gate.len()` of one row of `n_row` values.
pub fn swiglu_part(isa: Isa, gate: &mut [f32], up: &[f32], start: usize, n_row: usize) {
    let n = gate.len().min(up.len());
    let main = (n_row & !15).saturating_sub(start).min(n);
    let (gm, gt) = gate[..n].split_at_mut(main);
    let mut done = 0;
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx512 {
        done = main & !15;
        // SAFETY: the family was detected; the length is a multiple of 16.
        unsafe { x86::swiglu16(&mut gm[..done], &up[..done]) };
    } else if isa == Isa::Avx2 {
        done = main & !7;
        // SAFETY: the family was detected; the length is a multiple of 8.
        unsafe { x86::swiglu8(&mut gm[..done], &up[..done]) };
    }
    let _ = isa;
    for (g, &u) in gm[done..].iter_mut().zip(&up[done..main]) {
        *g = silu(*g) * u;
    }
    for (g, &u) in gt.iter_mut().zip(&up[main..n]) {
        *g = *g / (1.0 + (-*g).exp()) * u;
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod x86 {
    use super::*;
    use std::arch::x86_64::*;

    #[inline]
    #[target_feature(enable = "avx512f,avx512dq,avx512bw,avx512vl,avx2,fma")]
    pub(crate) unsafe fn expf16(x: __m512) -> __m512 {
        let r = _mm512_set1_ps(SHIFT);
        let z = _mm512_fmadd_ps(x, _mm512_set1_ps(LOG2E), r);
        let n = _mm512_sub_ps(z, r);
        let b = _mm512_fnmadd_ps(
            n,
            _mm512_set1_ps(LN2_LO),
            _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_HI), x),
        );
        let d = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(_mm512_abs_ps(n), _mm512_set1_ps(192.0));
        let u = _mm512_mul_ps(b, b);
        let j = _mm512_fmadd_ps(
            _mm512_fmadd_ps(
                _mm512_fmadd_ps(_mm512_set1_ps(P0), b, _mm512_set1_ps(P1)),
                u,
                _mm512_fmadd_ps(_mm512_set1_ps(P2), b, _mm512_set1_ps(P3)),
            ),
            u,
            _mm512_fmadd_ps(_mm512_set1_ps(P4), b, _mm512_set1_ps(1.0)),
        );
        let res = _mm512_scalef_ps(j, n);
        if d == 0 {
            return res;
        }
        let zero = _mm512_setzero_ps();
        let le = _mm512_cmp_ps_mask::<_CMP_LE_OQ>(n, zero);
        let alt = _mm512_mask_blend_ps(le, _mm512_set1_ps(f32::INFINITY), zero);
        _mm512_mask_blend_ps(d, res, alt)
    }

    /// [`expf`] in 8 lanes with AVX2 (the AVX-512 variant's arithmetic, not ggml's AVX2
    /// one): the same fused multiply-adds, then `j · 2^n` as a product with `2^n` built from
    /// its exponent bits, exact (so rounded once, as `scalef`) while `|n| <= 126`; a vector
    /// with a lane outside that range is done lane by lane.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub(crate) unsafe fn expf8(x: __m256) -> __m256 {
        let r = _mm256_set1_ps(SHIFT);
        let z = _mm256_fmadd_ps(x, _mm256_set1_ps(LOG2E), r);
        let n = _mm256_sub_ps(z, r);
        let big = _mm256_cmp_ps::<_CMP_NLE_UQ>(
            _mm256_andnot_ps(_mm256_set1_ps(-0.0), n),
            _mm256_set1_ps(126.0),
        );
        if _mm256_movemask_ps(big) != 0 {
            let mut v = [0f32; 8];
            _mm256_storeu_ps(v.as_mut_ptr(), x);
            for e in v.iter_mut() {
                *e = expf(*e);
            }
            return _mm256_loadu_ps(v.as_ptr());
        }
        let b = _mm256_fnmadd_ps(
            n,
            _mm256_set1_ps(LN2_LO),
            _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_HI), x),
        );
        let u = _mm256_mul_ps(b, b);
        let j = _mm256_fmadd_ps(
            _mm256_fmadd_ps(
                _mm256_fmadd_ps(_mm256_set1_ps(P0), b, _mm256_set1_ps(P1)),
                u,
                _mm256_fmadd_ps(_mm256_set1_ps(P2), b, _mm256_set1_ps(P3)),
            ),
            u,
            _mm256_fmadd_ps(_mm256_set1_ps(P4), b, _mm256_set1_ps(1.0)),
        );
        // 2^n for |n| <= 126: n's integer value sits in z's low mantissa bits
        let k = _mm256_castsi256_ps(_mm256_add_epi32(
            _mm256_slli_epi32::<23>(_mm256_castps_si256(z)),
            _mm256_castps_si256(_mm256_set1_ps(1.0)),
        ));
        _mm256_mul_ps(j, k)
    }

    /// # Safety
    /// AVX2 and FMA must be available; `gate.len()` is a multiple of 8 and `up` as long.
    #[target_feature(enable = "avx2,fma")]
    pub(crate) unsafe fn swiglu8(gate: &mut [f32], up: &[f32]) {
        let (g, u) = (gate.as_mut_ptr(), up.as_ptr());
        let one = _mm256_set1_ps(1.0);
        let mut i = 0;
        while i + 8 <= gate.len() {
            let x = _mm256_loadu_ps(g.add(i));
            let e = expf8(_mm256_sub_ps(_mm256_setzero_ps(), x));
            let s = _mm256_div_ps(x, _mm256_add_ps(one, e));
            _mm256_storeu_ps(g.add(i), _mm256_mul_ps(s, _mm256_loadu_ps(u.add(i))));
            i += 8;
        }
    }

    /// # Safety
    /// AVX-512 F/DQ must be available; `gate.len()` is a multiple of 16 and `up` as long.
    #[target_feature(enable = "avx512f,avx512dq,avx512bw,avx512vl,avx2,fma")]
    pub(crate) unsafe fn swiglu16(gate: &mut [f32], up: &[f32]) {
        let (g, u) = (gate.as_mut_ptr(), up.as_ptr());
        let one = _mm512_set1_ps(1.0);
        let mut i = 0;
        while i + 16 <= gate.len() {
            let x = _mm512_loadu_ps(g.add(i));
            let e = expf16(_mm512_sub_ps(_mm512_setzero_ps(), x));
            let s = _mm512_div_ps(x, _mm512_add_ps(one, e));
            _mm512_storeu_ps(g.add(i), _mm512_mul_ps(s, _mm512_loadu_ps(u.add(i))));
            i += 16;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn inputs() -> Vec<f32> {
        let mut xs = vec![
            0.0, -0.0, 1.0, -1.0, 88.7, -88.7, 103.9, -103.9, 150.0, -150.0,
        ];
        xs.extend([f32::INFINITY, f32::NEG_INFINITY, 1e-30, -1e-30, 87.0, -87.0]);
        let mut s = 0x9e37_79b9_7f4a_7c15u64;
        for i in 0..200_000 {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            let u = (s >> 40) as f32 / (1u64 << 24) as f32;
            xs.push(if i % 2 == 0 {
                -120.0 + 240.0 * u
            } else {
                -8.0 + 16.0 * u
            });
        }
        while xs.len() % 16 != 0 {
            xs.push(0.25);
        }
        xs
    }

    #[test]
    fn scalar_and_avx512_agree_bit_for_bit() {
        if !Isa::available().contains(&Isa::Avx512) {
            eprintln!("SKIPPED: no AVX-512");
            return;
        }
        let xs = inputs();
        let up: Vec<f32> = xs.iter().map(|x| 0.5 - x * 0.01).collect();
        let mut a = xs.clone();
        swiglu(Isa::Avx512, &mut a, &up, xs.len());
        let mut b = xs.clone();
        swiglu(Isa::Scalar, &mut b, &up, xs.len());
        for (i, (x, y)) in a.iter().zip(&b).enumerate() {
            assert!(
                x.to_bits() == y.to_bits() || (x.is_nan() && y.is_nan()),
                "x = {}: avx512 {x} scalar {y}",
                xs[i]
            );
        }
    }

    #[test]
    fn scalar_and_avx2_agree_bit_for_bit() {
        if !Isa::available().contains(&Isa::Avx2) {
            eprintln!("SKIPPED: no AVX2");
            return;
        }
        let mut xs = inputs();
        // around the lane-by-lane threshold |n| = 126 and the subnormal range
        for i in 0..4000 {
            let x = 85.0 + i as f32 * 0.005;
            xs.extend([x, -x, -x - 15.0, -x - 20.0]);
        }
        while !xs.len().is_multiple_of(16) {
            xs.push(-0.75);
        }
        let up: Vec<f32> = xs.iter().map(|x| 0.5 - x * 0.01).collect();
        let mut a = xs.clone();
        swiglu(Isa::Avx2, &mut a, &up, xs.len());
        let mut b = xs.clone();
        swiglu(Isa::Scalar, &mut b, &up, xs.len());
        for (i, (x, y)) in a.iter().zip(&b).enumerate() {
            assert!(
                x.to_bits() == y.to_bits() || (x.is_nan() && y.is_nan()),
                "x = {}: avx2 {x} scalar {y}",
                xs[i]
            );
        }
    }

    #[test]
    fn close_to_the_true_exponential() {
        // ggml's approximation is within a few ulps of exp over the range that matters
        for &x in inputs().iter().filter(|x| x.abs() < 80.0) {
            let (g, t) = (expf(x) as f64, (x as f64).exp());
            assert!(((g - t) / t).abs() < 4e-7, "x = {x}: {g} vs {t}");
        }
        assert_eq!(expf(-200.0), 0.0);
        assert_eq!(expf(200.0), f32::INFINITY);
    }
}
