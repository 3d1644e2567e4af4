//! The FP4 formats, 4-bit E2M1 codes with a shared scale:
//!
//! * MXFP4 (OCP microscaling FP4): blocks of 32 weights, 17 bytes: a shared power-of-two scale
//!   `e` (E8M0, byte 0) and 16 bytes of codes, byte `j` holding weight `j` (low nibble) and
//!   weight `j + 16` (high nibble).
//! * NVFP4: blocks of 64 weights, 36 bytes: four UE4M3 scales (bytes 0..4, one per 16 weights)
//!   and 32 bytes of codes, byte `8s + j` holding weights `16s + j` (low) and `16s + j + 8` (high).
//!
//! ggml keeps the E2M1 values doubled ([`KVALUES_MXFP4`]: 0, 1, 2, 3, 4, 6, 8, 12 and their
//! negatives) and halves the scale instead: `w = KVALUES_MXFP4[q] * 2^(e - 128)`
//! ([`e8m0_to_f32_half`]), one rounded product (exact unless it leaves the f32 range).
//!
//! Quantization is ggml's `quantize_row_mxfp4_ref`: `e = (uint8_t)(floorf(log2f(amax)) - 2 +
//! 127)` from the block's largest magnitude (0 for an all-zero block; `log2f` is the C
//! library's, the function Rust's `f32::log2` calls, and the float-to-`uint8_t` cast is
//! `cvttss2si` plus truncation to the low byte), then for each weight the code whose value is
//! nearest, the first one on ties.
//!
//! NVFP4's scale is an unsigned E4M3 byte, decoded by [`ue4m3_to_f32_half`] (also halved; 0x00
//! and 0x7F decode to 0) and encoded by `quantize_row_nvfp4_ref`'s `ggml_fp32_to_ue4m3(amax /
//! 6)` (clamped to 448, mantissa rounded half up by its first dropped bit, subnormals as
//! `(int)(x * 512 + 0.5)`).

use super::grids::KVALUES_MXFP4;
use super::{sub_array, trunc_i32};

/// Weights per NVFP4 block, and per NVFP4 scale.
pub const QK_NVFP4: usize = 64;
pub const QK_NVFP4_SUB: usize = 16;

/// Weights per MXFP4 block.
pub const QK_MXFP4: usize = 32;

/// ggml's `ggml_e8m0_to_fp32_half`: `2^(e - 128)` as f32 bits (subnormal for `e < 2`).
#[inline]
pub fn e8m0_to_f32_half(e: u8) -> f32 {
    let bits = if e < 2 {
        0x0020_0000u32 << e
    } else {
        u32::from(e - 1) << 23
    };
    f32::from_bits(bits)
}

/// ggml's `ggml_ue4m3_to_fp32`: the UE4M3 value times 0.5 (bit 7 is ignored; 0x00 and 0x7F are 0).
#[inline]
pub fn ue4m3_to_f32_half(x: u8) -> f32 {
    if x == 0 || x == 0x7f {
        return 0.0;
    }
    let exp = i32::from((x >> 3) & 0x0f);
    let man = f32::from(x & 7);
    // ldexpf of these small values is exact: scale by an exactly built power of two.
    let raw = if exp == 0 {
        man * f32::from_bits(((127 - 9) as u32) << 23)
    } else {
        (1.0 + man / 8.0) * f32::from_bits(((exp - 7 + 127) as u32) << 23)
    };
    raw * 0.5
}

/// ggml's `ggml_fp32_to_ue4m3`.
#[inline]
pub fn f32_to_ue4m3(x: f32) -> u8 {
    #[allow(clippy::neg_cmp_op_on_partial_ord)] // C's `!(x > 0.0f)`: NaN is refused too
    if !(x > 0.0) {
        return 0;
    }
    let x = if x > 448.0 { 448.0 } else { x };
    let bits = x.to_bits();
    let fp32_exp = ((bits >> 23) & 0xff) as i32 - 127;
    let fp32_man = ((bits >> 20) & 7) as i32;
    let mut exp = fp32_exp + 7;
    if exp <= 0 {
        let man = trunc_i32(x * 512.0 + 0.5).min(7);
        return if man < 1 { 0 } else { man as u8 };
    }
    if exp >= 15 {
        return 0x7e;
    }
    let mut man = fp32_man + ((bits >> 19) & 1) as i32;
    if man > 7 {
        man = 0;
        exp += 1;
        if exp >= 15 {
            return 0x7e;
        }
    }
    ((exp << 3) | man) as u8
}

/// ggml's `best_index_mxfp4`: the code whose `KVALUES_MXFP4[i] * d` is nearest to `x` (the first
/// on ties; 0 when every distance is NaN).
#[inline]
fn best_index(x: f32, d: f32) -> u8 {
    let err = |i: usize| (f32::from(KVALUES_MXFP4[i]) * d - x).abs();
    let (mut best, mut best_err) = (0u8, err(0));
    for i in 1..16 {
        let e = err(i);
        if e < best_err {
            best = i as u8;
            best_err = e;
        }
    }
    best
}

/// `block_mxfp4`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(C)]
pub struct BlockMxfp4 {
    /// Shared scale exponent (E8M0).
    pub e: u8,
    /// Codes: byte `j` = weight `j` (low) | weight `j + 16` (high).
    pub qs: [u8; 16],
}

impl BlockMxfp4 {
    pub const SIZE: usize = 17;
    pub const OFFSET_E: usize = 0;
    pub const OFFSET_QS: usize = 1;

    pub fn from_bytes(b: &[u8; Self::SIZE]) -> Self {
        Self {
            e: b[Self::OFFSET_E],
            qs: sub_array(b, Self::OFFSET_QS),
        }
    }

    pub fn to_bytes(&self) -> [u8; Self::SIZE] {
        let mut b = [0u8; Self::SIZE];
        b[0] = self.e;
        b[1..].copy_from_slice(&self.qs);
        b
    }

    pub fn dequantize(&self, y: &mut [f32; QK_MXFP4]) {
        let d = e8m0_to_f32_half(self.e);
        for (j, &q) in self.qs.iter().enumerate() {
            y[j] = f32::from(KVALUES_MXFP4[usize::from(q & 0x0f)]) * d;
            y[j + 16] = f32::from(KVALUES_MXFP4[usize::from(q >> 4)]) * d;
        }
    }

    /// ggml's `quantize_row_mxfp4_ref`.
    pub fn quantize(x: &[f32; QK_MXFP4]) -> Self {
        let mut amax = 0f32;
        for v in x {
            if amax < v.abs() {
                amax = v.abs();
            }
        }
        let e = if amax > 0.0 {
            trunc_i32(amax.log2().floor() - 2.0 + 127.0) as u8
        } else {
            0
        };
        let d = e8m0_to_f32_half(e);
        let mut qs = [0u8; 16];
        for (j, q) in qs.iter_mut().enumerate() {
            *q = best_index(x[j], d) | (best_index(x[j + 16], d) << 4);
        }
        Self { e, qs }
    }
}

/// `block_nvfp4`: four 16-weight groups, each with its UE4M3 scale.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(C)]
pub struct BlockNvfp4 {
    /// UE4M3 scales, one per 16 weights.
    pub d: [u8; 4],
    /// Codes: byte `8s + j` = weight `16s + j` (low) | weight `16s + j + 8` (high).
    pub qs: [u8; 32],
}

impl BlockNvfp4 {
    pub const SIZE: usize = 36;
    pub const OFFSET_D: usize = 0;
    pub const OFFSET_QS: usize = 4;

    pub fn from_bytes(b: &[u8; Self::SIZE]) -> Self {
        Self {
            d: sub_array(b, Self::OFFSET_D),
            qs: sub_array(b, Self::OFFSET_QS),
        }
    }

    pub fn to_bytes(&self) -> [u8; Self::SIZE] {
        let mut b = [0u8; Self::SIZE];
        b[..4].copy_from_slice(&self.d);
        b[4..].copy_from_slice(&self.qs);
        b
    }

    pub fn dequantize(&self, y: &mut [f32; QK_NVFP4]) {
        for ((&ds, q), y) in self
            .d
            .iter()
            .zip(self.qs.chunks_exact(8))
            .zip(y.chunks_exact_mut(QK_NVFP4_SUB))
        {
            let d = ue4m3_to_f32_half(ds);
            for (j, &q) in q.iter().enumerate() {
                y[j] = f32::from(KVALUES_MXFP4[usize::from(q & 0x0f)]) * d;
                y[j + 8] = f32::from(KVALUES_MXFP4[usize::from(q >> 4)]) * d;
            }
        }
    }

    /// ggml's `quantize_row_nvfp4_ref`.
    pub fn quantize(x: &[f32; QK_NVFP4]) -> Self {
        let mut out = Self::default();
        for ((ds, q), x) in out
            .d
            .iter_mut()
            .zip(out.qs.chunks_exact_mut(8))
            .zip(x.chunks_exact(QK_NVFP4_SUB))
        {
            let mut amax = 0f32;
            for v in x {
                if amax < v.abs() {
                    amax = v.abs();
                }
            }
            *ds = f32_to_ue4m3(amax / 6.0);
            let d = ue4m3_to_f32_half(*ds);
            for (j, q) in q.iter_mut().enumerate() {
                *q = best_index(x[j], d) | (best_index(x[j + 8], d) << 4);
            }
        }
        out
    }
}
