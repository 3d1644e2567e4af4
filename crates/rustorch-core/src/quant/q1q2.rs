//! Q1_0 and Q2_0: one f16 scale `d` and 1 or 2 bits per weight, 18 bytes per block.
//!
//! * Q1_0 (128 weights): `d` 0..2, `qs` 2..18; bit `j % 8` of byte `j / 8` set means `+d`,
//!   clear `-d`. Quantization (`quantize_row_q1_0_ref`): `d` = the mean magnitude (an f32 sum in
//!   index order, divided by 128), bit set where `x >= 0`.
//! * Q2_0 (64 weights): `d` 0..2, `qs` 2..18; weight `j` is bits `2(j % 4)..` of byte `j / 4`,
//!   `q` in 0..4 decoding to `(q - 1) * d` (-d, 0, d, 2d). Quantization
//!   (`quantize_row_q2_0_ref`): `d` = the largest magnitude, `q = (int)roundf(x / d) + 1`
//!   clamped to 0..=3 (`x / d` computed as `x * (1/d)`, the cast as x86's `cvttss2si`).

use super::{f16_to_f32, f32_to_f16, le_u16, sub_array, trunc_i32};

/// Weights per Q1_0 block.
pub const QK1_0: usize = 128;
/// Weights per Q2_0 block.
pub const QK2_0: usize = 64;

/// `block_q1_0`: 128 weights `±d`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(C)]
pub struct BlockQ1_0 {
    /// Scale (f16 bits).
    pub d: u16,
    /// Sign bits, weight `j` at bit `j % 8` of byte `j / 8` (set: positive).
    pub qs: [u8; 16],
}

impl BlockQ1_0 {
    pub const SIZE: usize = 18;
    pub const OFFSET_D: usize = 0;
    pub const OFFSET_QS: usize = 2;

    pub fn from_bytes(b: &[u8; Self::SIZE]) -> Self {
        Self {
            d: le_u16(b, Self::OFFSET_D),
            qs: sub_array(b, Self::OFFSET_QS),
        }
    }

    pub fn to_bytes(&self) -> [u8; Self::SIZE] {
        let mut b = [0u8; Self::SIZE];
        b[..2].copy_from_slice(&self.d.to_le_bytes());
        b[2..].copy_from_slice(&self.qs);
        b
    }

    pub fn dequantize(&self, y: &mut [f32; QK1_0]) {
        let d = f16_to_f32(self.d);
        let neg_d = -d;
        for (j, y) in y.iter_mut().enumerate() {
            *y = if (self.qs[j / 8] >> (j % 8)) & 1 != 0 {
                d
            } else {
                neg_d
            };
        }
    }

    /// ggml's `quantize_row_q1_0_ref`.
    pub fn quantize(x: &[f32; QK1_0]) -> Self {
        let mut sum_abs = 0f32;
        for v in x {
            sum_abs += v.abs();
        }
        let d = sum_abs / QK1_0 as f32;
        let mut qs = [0u8; 16];
        for (j, &v) in x.iter().enumerate() {
            if v >= 0.0 {
                qs[j / 8] |= 1 << (j % 8);
            }
        }
        Self {
            d: f32_to_f16(d),
            qs,
        }
    }
}

/// `block_q2_0`: 64 weights `(q - 1) * d` with 2-bit `q`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(C)]
pub struct BlockQ2_0 {
    /// Scale (f16 bits).
    pub d: u16,
    /// Codes, weight `j` at bits `2(j % 4)` of byte `j / 4`.
    pub qs: [u8; 16],
}

impl BlockQ2_0 {
    pub const SIZE: usize = 18;
    pub const OFFSET_D: usize = 0;
    pub const OFFSET_QS: usize = 2;

    pub fn from_bytes(b: &[u8; Self::SIZE]) -> Self {
        Self {
            d: le_u16(b, Self::OFFSET_D),
            qs: sub_array(b, Self::OFFSET_QS),
        }
    }

    pub fn to_bytes(&self) -> [u8; Self::SIZE] {
        let mut b = [0u8; Self::SIZE];
        b[..2].copy_from_slice(&self.d.to_le_bytes());
        b[2..].copy_from_slice(&self.qs);
        b
    }

    pub fn dequantize(&self, y: &mut [f32; QK2_0]) {
        let d = f16_to_f32(self.d);
        for (j, y) in y.iter_mut().enumerate() {
            let q = (self.qs[j / 4] >> (2 * (j % 4))) & 3;
            *y = (i32::from(q) - 1) as f32 * d;
        }
    }

    /// ggml's `quantize_row_q2_0_ref`.
    pub fn quantize(x: &[f32; QK2_0]) -> Self {
        let mut amax = 0f32;
        for v in x {
            if v.abs() > amax {
                amax = v.abs();
            }
        }
        let d = amax;
        let id = if d > 0.0 { 1.0 / d } else { 0.0 };
        let mut qs = [0u8; 16];
        for (j, &v) in x.iter().enumerate() {
            let q = trunc_i32((v * id).round()).wrapping_add(1).clamp(0, 3);
            qs[j / 4] |= (q as u8) << (2 * (j % 4));
        }
        Self {
            d: f32_to_f16(d),
            qs,
        }
    }
}
