//! Plain float formats: F32, F16 (IEEE binary16) and BF16 (brain float).
//!
//! All three are stored little-endian, one value per "block". The conversions match ggml's
//! scalar ones bit for bit (checked exhaustively against ggml in `tests/quant_reference.rs`):
//!
//! * f32 → f16 rounds to nearest, ties to even; overflow gives ±inf, values below half the
//!   smallest subnormal give ±0, and every NaN becomes the quiet NaN `0x7e00` with its sign kept
//!   (the payload is dropped).
//! * f16 → f32 is exact; NaNs come back quiet, with the f16 payload in the top mantissa bits.
//! * f32 → bf16 rounds to nearest, ties to even; NaNs keep their top payload bits and are forced
//!   quiet by setting bit 6 (`0x40`). Subnormals are kept, not flushed.
//! * bf16 → f32 is a 16-bit shift.

/// Converts IEEE half-precision bits to `f32`, exactly (as ggml's `GGML_FP16_TO_FP32`).
#[inline]
pub fn f16_to_f32(h: u16) -> f32 {
    let sign = u32::from(h & 0x8000) << 16;
    let exp = u32::from(h >> 10) & 0x1f;
    let man = u32::from(h & 0x03ff);
    let bits = match (exp, man) {
        (0, 0) => sign,
        // Subnormal: man * 2^-24, exact in f32.
        (0, _) => sign | (man as f32 * (1.0 / 16_777_216.0)).to_bits(),
        (0x1f, 0) => sign | 0x7f80_0000,
        // NaN: quiet, payload kept in the high mantissa bits.
        (0x1f, _) => sign | 0x7fc0_0000 | (man << 13),
        _ => sign | ((exp + 112) << 23) | (man << 13),
    };
    f32::from_bits(bits)
}

/// [`f16_to_f32`] of every value of `src` into `dst` (the shorter length), eight at a time
/// with the CPU's F16C conversion where it has one (exact either way, NaNs quiet with their
/// payload as in the scalar conversion).
pub fn f16_to_f32_row(src: &[u16], dst: &mut [f32]) {
    let n = src.len().min(dst.len());
    let (src, dst) = (&src[..n], &mut dst[..n]);
    let mut done = 0;
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("f16c") && std::arch::is_x86_feature_detected!("avx") {
        // SAFETY: F16C and AVX were detected; `done` stays within both slices.
        done = unsafe { f16_to_f32_f16c(src, dst) };
    }
    for (d, &h) in dst[done..].iter_mut().zip(&src[done..]) {
        *d = f16_to_f32(h);
    }
}

/// The whole chunks of eight of [`f16_to_f32_row`]; returns how many values it wrote.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx,f16c")]
unsafe fn f16_to_f32_f16c(src: &[u16], dst: &mut [f32]) -> usize {
    use std::arch::x86_64::*;
    let whole = src.len() / 8 * 8;
    for i in (0..whole).step_by(8) {
        let h = _mm_loadu_si128(src.as_ptr().add(i) as *const __m128i);
        _mm256_storeu_ps(dst.as_mut_ptr().add(i), _mm256_cvtph_ps(h));
    }
    whole
}

/// [`f32_to_f16`] of every value of `src` into `dst` (the shorter length), eight at a time
/// with the CPU's F16C conversion where it has one (the same rounding; chunks holding a NaN
/// take the scalar path, which drops the payload).
pub fn f32_to_f16_row(src: &[f32], dst: &mut [u16]) {
    let n = src.len().min(dst.len());
    let (src, dst) = (&src[..n], &mut dst[..n]);
    let mut done = 0;
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("f16c") && std::arch::is_x86_feature_detected!("avx") {
        // SAFETY: F16C and AVX were detected; `done` stays within both slices.
        done = unsafe { f32_to_f16_f16c(src, dst) };
    }
    for (d, &x) in dst[done..].iter_mut().zip(&src[done..]) {
        *d = f32_to_f16(x);
    }
}

/// The whole chunks of eight of [`f32_to_f16_row`]; returns how many values it wrote.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx,f16c")]
unsafe fn f32_to_f16_f16c(src: &[f32], dst: &mut [u16]) -> usize {
    use std::arch::x86_64::*;
    let whole = src.len() / 8 * 8;
    for i in (0..whole).step_by(8) {
        let v = _mm256_loadu_ps(src.as_ptr().add(i));
        if _mm256_movemask_ps(_mm256_cmp_ps::<_CMP_UNORD_Q>(v, v)) != 0 {
            for k in i..i + 8 {
                dst[k] = f32_to_f16(src[k]);
            }
            continue;
        }
        let h = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(v);
        _mm_storeu_si128(dst.as_mut_ptr().add(i) as *mut __m128i, h);
    }
    whole
}

/// Converts `f32` to IEEE half-precision bits, rounding to nearest even (as ggml's
/// `GGML_FP32_TO_FP16`; NaN becomes `0x7e00` with the sign kept).
#[inline]
pub fn f32_to_f16(x: f32) -> u16 {
    let bits = x.to_bits();
    let sign = ((bits >> 16) & 0x8000) as u16;
    let abs = bits & 0x7fff_ffff;
    if abs > 0x7f80_0000 {
        return sign | 0x7e00;
    }
    // 65520 = 65504 + half an ulp: from here on the value rounds to infinity.
    if abs >= 0x477f_f000 {
        return sign | 0x7c00;
    }
    let exp = abs >> 23;
    if exp < 113 {
        // Result is an f16 subnormal (or zero, or rounds up to the smallest normal): count in
        // units of 2^-24. The f32 value is m * 2^(exp - 150) with m the 24-bit significand.
        if exp < 102 {
            // below 2^-25 = half the smallest subnormal
            return sign;
        }
        let m = (abs & 0x007f_ffff) | 0x0080_0000;
        let shift = 126 - exp; // 14..=24
        let q = m >> shift;
        let rem = m & ((1 << shift) - 1);
        let half = 1 << (shift - 1);
        let round_up = rem > half || (rem == half && q & 1 == 1);
        return sign | (q + u32::from(round_up)) as u16;
    }
    // Normal: rebias the exponent (127 → 15) and round the mantissa from 23 to 10 bits; a carry
    // out of the mantissa correctly bumps the exponent.
    let q = ((exp - 112) << 10) | ((abs >> 13) & 0x03ff);
    let rem = abs & 0x1fff;
    let round_up = rem > 0x1000 || (rem == 0x1000 && q & 1 == 1);
    sign | (q + u32::from(round_up)) as u16
}

/// Converts bfloat16 bits to `f32` (exact).
#[inline]
pub fn bf16_to_f32(h: u16) -> f32 {
    f32::from_bits(u32::from(h) << 16)
}

/// Converts `f32` to bfloat16 bits, rounding to nearest even; NaNs are made quiet (as ggml's
/// `GGML_FP32_TO_BF16`).
#[inline]
pub fn f32_to_bf16(x: f32) -> u16 {
    let bits = x.to_bits();
    if bits & 0x7fff_ffff > 0x7f80_0000 {
        return ((bits >> 16) | 0x40) as u16;
    }
    let rounding = 0x7fff + ((bits >> 16) & 1);
    (bits.wrapping_add(rounding) >> 16) as u16
}

pub(crate) fn dequantize_f32(src: &[u8], dst: &mut [f32]) {
    for (s, d) in src.chunks_exact(4).zip(dst.iter_mut()) {
        *d = f32::from_le_bytes([s[0], s[1], s[2], s[3]]);
    }
}

pub(crate) fn quantize_f32(src: &[f32], dst: &mut [u8]) {
    for (x, d) in src.iter().zip(dst.chunks_exact_mut(4)) {
        d.copy_from_slice(&x.to_le_bytes());
    }
}

pub(crate) fn dequantize_f16(src: &[u8], dst: &mut [f32]) {
    for (s, d) in src.chunks_exact(2).zip(dst.iter_mut()) {
        *d = f16_to_f32(u16::from_le_bytes([s[0], s[1]]));
    }
}

pub(crate) fn quantize_f16(src: &[f32], dst: &mut [u8]) {
    for (x, d) in src.iter().zip(dst.chunks_exact_mut(2)) {
        d.copy_from_slice(&f32_to_f16(*x).to_le_bytes());
    }
}

pub(crate) fn dequantize_bf16(src: &[u8], dst: &mut [f32]) {
    for (s, d) in src.chunks_exact(2).zip(dst.iter_mut()) {
        *d = bf16_to_f32(u16::from_le_bytes([s[0], s[1]]));
    }
}

pub(crate) fn quantize_bf16(src: &[f32], dst: &mut [u8]) {
    for (x, d) in src.iter().zip(dst.chunks_exact_mut(2)) {
        d.copy_from_slice(&f32_to_bf16(*x).to_le_bytes());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn f16_row_equals_the_scalar_conversion() {
        // every exponent, mantissas near the rounding points, both signs, NaN and inf
        let mut src = Vec::new();
        for exp in 0..=255u32 {
            for man in [
                0u32, 1, 0xfff, 0x1000, 0x1001, 0x2000, 0x3000, 0x7f_e000, 0x7f_ffff,
            ] {
                for sign in [0u32, 1 << 31] {
                    src.push(f32::from_bits(sign | exp << 23 | man));
                }
            }
        }
        src.push(1.0);
        let mut dst = vec![0u16; src.len()];
        f32_to_f16_row(&src, &mut dst);
        for (x, h) in src.iter().zip(&dst) {
            assert_eq!(*h, f32_to_f16(*x), "{:#010x}", x.to_bits());
        }
    }

    #[test]
    fn f32_row_equals_the_scalar_conversion() {
        // every f16 value, NaNs included, plus a tail shorter than eight
        let src: Vec<u16> = (0..=u16::MAX).chain([0x3c00, 0x7e01, 0xfc00]).collect();
        let mut dst = vec![0f32; src.len()];
        f16_to_f32_row(&src, &mut dst);
        for (h, x) in src.iter().zip(&dst) {
            assert_eq!(x.to_bits(), f16_to_f32(*h).to_bits(), "{h:#06x}");
        }
    }

    #[test]
    fn f16_known_values() {
        assert_eq!(f32_to_f16(1.0), 0x3c00);
        assert_eq!(f32_to_f16(-2.0), 0xc000);
        assert_eq!(f32_to_f16(65504.0), 0x7bff);
        assert_eq!(f32_to_f16(65519.99), 0x7bff);
        assert_eq!(f32_to_f16(65520.0), 0x7c00);
        assert_eq!(f32_to_f16(f32::INFINITY), 0x7c00);
        assert_eq!(f32_to_f16(f32::NAN), 0x7e00);
        assert_eq!(f32_to_f16(-f32::NAN), 0xfe00);
        assert_eq!(f32_to_f16(5.960_464_5e-8), 0x0001); // 2^-24
        assert_eq!(f32_to_f16(2.980_232_2e-8), 0x0000); // 2^-25 ties to even (0)
        assert_eq!(f32_to_f16(2.980_232_5e-8), 0x0001); // just above the tie
        assert_eq!(f32_to_f16(-0.0), 0x8000);
        assert_eq!(f16_to_f32(0x3c00), 1.0);
        assert_eq!(f16_to_f32(0x0001), 5.960_464_5e-8);
        assert_eq!(f16_to_f32(0x7c01).to_bits(), 0x7fc0_2000);
    }

    #[test]
    fn f16_round_trips_every_half() {
        for h in 0..=u16::MAX {
            let f = f16_to_f32(h);
            if f.is_nan() {
                // quiet NaNs survive with sign; their payload is dropped on the way back
                assert_eq!(f32_to_f16(f), (h & 0x8000) | 0x7e00);
            } else {
                assert_eq!(f32_to_f16(f), h, "half {h:#06x}");
            }
        }
    }

    #[test]
    fn bf16_known_values() {
        assert_eq!(f32_to_bf16(1.0), 0x3f80);
        assert_eq!(f32_to_bf16(f32::from_bits(0x3f80_8000)), 0x3f80); // tie to even
        assert_eq!(f32_to_bf16(f32::from_bits(0x3f81_8000)), 0x3f82);
        assert_eq!(f32_to_bf16(f32::from_bits(0x7f80_0001)), 0x7fc0);
        assert_eq!(f32_to_bf16(f32::MAX), 0x7f80);
        assert_eq!(bf16_to_f32(0x3f80), 1.0);
    }
}
