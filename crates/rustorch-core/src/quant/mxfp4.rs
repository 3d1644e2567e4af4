//! MXFP4 (OCP microscaling FP4): blocks of 32 weights, 17 bytes: a shared power-of-two scale `e`
//! (E8M0, byte 0) and 16 bytes of 4-bit E2M1 codes, byte `j` holding weight `j` (low nibble)
//! and weight `j + 16` (high nibble).
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

use super::grids::KVALUES_MXFP4;
use super::{sub_array, trunc_i32};

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
