//! The original ggml block formats: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q8_1.
//!
//! Every block covers [`QK`] = 32 consecutive weights. Scales are IEEE halves stored as raw
//! `u16` bits (little-endian in the byte stream). In the 4- and 5-bit formats, byte `j` of `qs`
//! holds weight `j` in its low nibble and weight `j + 16` in its high nibble; the fifth bit of
//! weight `i` is bit `i` of the little-endian u32 `qh`.
//!
//! | format | decoded value          | bytes                                         |
//! |--------|------------------------|-----------------------------------------------|
//! | Q4_0   | `d * (q - 8)`          | d 0..2, qs 2..18                              |
//! | Q4_1   | `d * q + m`            | d 0..2, m 2..4, qs 4..20                      |
//! | Q5_0   | `d * (q - 16)`         | d 0..2, qh 2..6, qs 6..22                     |
//! | Q5_1   | `d * q + m`            | d 0..2, m 2..4, qh 4..8, qs 8..24             |
//! | Q8_0   | `d * q` (q: i8)        | d 0..2, qs 2..34                              |
//! | Q8_1   | `d * q`, `s = d*Σq`    | d 0..2, s 2..4, qs 4..36                      |
//!
//! Bit-exactness notes (checked against libggml, see `tests/quant_reference.rs`): the reference
//! C code has no fused operations, so products and sums are rounded one at a time here too; the
//! C casts `(int8_t)(x + 8.5f)` etc. truncate through a 32-bit integer (`trunc_i32`) and then
//! wrap, which only matters for NaN/inf inputs.

use super::{c_max, f16_to_f32, f32_to_f16, le_u16, sub_array, trunc_i32};

/// Weights per block of every format in this module.
pub const QK: usize = 32;

/// Smallest and largest finite value over a block, as ggml's Q4_1/Q5_1 quantizers find them.
fn min_max(x: &[f32; QK]) -> (f32, f32) {
    let (mut min, mut max) = (f32::MAX, -f32::MAX);
    for &v in x {
        if v < min {
            min = v;
        }
        if v > max {
            max = v;
        }
    }
    (min, max)
}

/// The value with the largest magnitude (the first one on ties), or 0 for an all-zero block.
fn signed_absmax(x: &[f32]) -> f32 {
    let (mut amax, mut max) = (0f32, 0f32);
    for &v in x {
        if amax < v.abs() {
            amax = v.abs();
            max = v;
        }
    }
    max
}

fn recip_or_zero(d: f32) -> f32 {
    if d != 0.0 {
        1.0 / d
    } else {
        0.0
    }
}

/// `block_q4_0`: 32 weights `d * (q - 8)` with 4-bit `q`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(C)]
pub struct BlockQ4_0 {
    /// Scale (f16 bits).
    pub d: u16,
    /// Nibbles: byte `j` = weight `j` (low) | weight `j + 16` (high).
    pub qs: [u8; 16],
}

impl BlockQ4_0 {
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

    pub fn dequantize(&self, y: &mut [f32; QK]) {
        let d = f16_to_f32(self.d);
        for (j, &q) in self.qs.iter().enumerate() {
            y[j] = (i32::from(q & 0x0f) - 8) as f32 * d;
            y[j + 16] = (i32::from(q >> 4) - 8) as f32 * d;
        }
    }

    /// ggml's `quantize_row_q4_0_ref`: `d = max / -8` where `max` is the signed value of largest
    /// magnitude, so that value maps exactly to `q = 0`.
    pub fn quantize(x: &[f32; QK]) -> Self {
        let d = signed_absmax(x) / -8.0;
        let id = recip_or_zero(d);
        let code = |v: f32| (i32::from(trunc_i32(v * id + 8.5) as i8)).min(15) as u8;
        let mut qs = [0u8; 16];
        for (j, q) in qs.iter_mut().enumerate() {
            *q = code(x[j]) | (code(x[j + 16]) << 4);
        }
        Self {
            d: f32_to_f16(d),
            qs,
        }
    }
}

/// `block_q4_1`: 32 weights `d * q + m` with 4-bit `q`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(C)]
pub struct BlockQ4_1 {
    /// Scale (f16 bits).
    pub d: u16,
    /// Minimum (f16 bits).
    pub m: u16,
    /// Nibbles: byte `j` = weight `j` (low) | weight `j + 16` (high).
    pub qs: [u8; 16],
}

impl BlockQ4_1 {
    pub const SIZE: usize = 20;
    pub const OFFSET_D: usize = 0;
    pub const OFFSET_M: usize = 2;
    pub const OFFSET_QS: usize = 4;

    pub fn from_bytes(b: &[u8; Self::SIZE]) -> Self {
        Self {
            d: le_u16(b, Self::OFFSET_D),
            m: le_u16(b, Self::OFFSET_M),
            qs: sub_array(b, Self::OFFSET_QS),
        }
    }

    pub fn to_bytes(&self) -> [u8; Self::SIZE] {
        let mut b = [0u8; Self::SIZE];
        b[..2].copy_from_slice(&self.d.to_le_bytes());
        b[2..4].copy_from_slice(&self.m.to_le_bytes());
        b[4..].copy_from_slice(&self.qs);
        b
    }

    pub fn dequantize(&self, y: &mut [f32; QK]) {
        let d = f16_to_f32(self.d);
        let m = f16_to_f32(self.m);
        for (j, &q) in self.qs.iter().enumerate() {
            y[j] = f32::from(q & 0x0f) * d + m;
            y[j + 16] = f32::from(q >> 4) * d + m;
        }
    }

    /// ggml's `quantize_row_q4_1_ref`: `m = min`, `d = (max - min) / 15`.
    pub fn quantize(x: &[f32; QK]) -> Self {
        let (min, max) = min_max(x);
        let d = (max - min) / 15.0;
        let id = recip_or_zero(d);
        let code = |v: f32| (i32::from(trunc_i32((v - min) * id + 0.5) as i8)).min(15) as u8;
        let mut qs = [0u8; 16];
        for (j, q) in qs.iter_mut().enumerate() {
            *q = code(x[j]) | (code(x[j + 16]) << 4);
        }
        Self {
            d: f32_to_f16(d),
            m: f32_to_f16(min),
            qs,
        }
    }
}

/// `block_q5_0`: 32 weights `d * (q - 16)` with 5-bit `q`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(C)]
pub struct BlockQ5_0 {
    /// Scale (f16 bits).
    pub d: u16,
    /// Fifth bits: bit `i` of this little-endian u32 belongs to weight `i`.
    pub qh: [u8; 4],
    /// Low nibbles: byte `j` = weight `j` (low) | weight `j + 16` (high).
    pub qs: [u8; 16],
}

impl BlockQ5_0 {
    pub const SIZE: usize = 22;
    pub const OFFSET_D: usize = 0;
    pub const OFFSET_QH: usize = 2;
    pub const OFFSET_QS: usize = 6;

    pub fn from_bytes(b: &[u8; Self::SIZE]) -> Self {
        Self {
            d: le_u16(b, Self::OFFSET_D),
            qh: sub_array(b, Self::OFFSET_QH),
            qs: sub_array(b, Self::OFFSET_QS),
        }
    }

    pub fn to_bytes(&self) -> [u8; Self::SIZE] {
        let mut b = [0u8; Self::SIZE];
        b[..2].copy_from_slice(&self.d.to_le_bytes());
        b[2..6].copy_from_slice(&self.qh);
        b[6..].copy_from_slice(&self.qs);
        b
    }

    pub fn dequantize(&self, y: &mut [f32; QK]) {
        let d = f16_to_f32(self.d);
        let qh = u32::from_le_bytes(self.qh);
        for (j, &q) in self.qs.iter().enumerate() {
            let lo = i32::from(q & 0x0f) | (((qh >> j) & 1) << 4) as i32;
            let hi = i32::from(q >> 4) | (((qh >> (j + 16)) & 1) << 4) as i32;
            y[j] = (lo - 16) as f32 * d;
            y[j + 16] = (hi - 16) as f32 * d;
        }
    }

    /// ggml's `quantize_row_q5_0_ref`: `d = max / -16` with `max` the signed absmax.
    pub fn quantize(x: &[f32; QK]) -> Self {
        let d = signed_absmax(x) / -16.0;
        let id = recip_or_zero(d);
        let code = |v: f32| (i32::from(trunc_i32(v * id + 16.5) as i8)).min(31) as u8;
        let mut qs = [0u8; 16];
        let mut qh = 0u32;
        for (j, q) in qs.iter_mut().enumerate() {
            let (a, b) = (code(x[j]), code(x[j + 16]));
            *q = (a & 0x0f) | ((b & 0x0f) << 4);
            qh |= u32::from((a & 0x10) >> 4) << j;
            qh |= u32::from((b & 0x10) >> 4) << (j + 16);
        }
        Self {
            d: f32_to_f16(d),
            qh: qh.to_le_bytes(),
            qs,
        }
    }
}

/// `block_q5_1`: 32 weights `d * q + m` with 5-bit `q`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(C)]
pub struct BlockQ5_1 {
    /// Scale (f16 bits).
    pub d: u16,
    /// Minimum (f16 bits).
    pub m: u16,
    /// Fifth bits: bit `i` of this little-endian u32 belongs to weight `i`.
    pub qh: [u8; 4],
    /// Low nibbles: byte `j` = weight `j` (low) | weight `j + 16` (high).
    pub qs: [u8; 16],
}

impl BlockQ5_1 {
    pub const SIZE: usize = 24;
    pub const OFFSET_D: usize = 0;
    pub const OFFSET_M: usize = 2;
    pub const OFFSET_QH: usize = 4;
    pub const OFFSET_QS: usize = 8;

    pub fn from_bytes(b: &[u8; Self::SIZE]) -> Self {
        Self {
            d: le_u16(b, Self::OFFSET_D),
            m: le_u16(b, Self::OFFSET_M),
            qh: sub_array(b, Self::OFFSET_QH),
            qs: sub_array(b, Self::OFFSET_QS),
        }
    }

    pub fn to_bytes(&self) -> [u8; Self::SIZE] {
        let mut b = [0u8; Self::SIZE];
        b[..2].copy_from_slice(&self.d.to_le_bytes());
        b[2..4].copy_from_slice(&self.m.to_le_bytes());
        b[4..8].copy_from_slice(&self.qh);
        b[8..].copy_from_slice(&self.qs);
        b
    }

    pub fn dequantize(&self, y: &mut [f32; QK]) {
        let d = f16_to_f32(self.d);
        let m = f16_to_f32(self.m);
        let qh = u32::from_le_bytes(self.qh);
        for (j, &q) in self.qs.iter().enumerate() {
            let lo = u32::from(q & 0x0f) | (((qh >> j) & 1) << 4);
            let hi = u32::from(q >> 4) | (((qh >> (j + 16)) & 1) << 4);
            y[j] = lo as f32 * d + m;
            y[j + 16] = hi as f32 * d + m;
        }
    }

    /// ggml's `quantize_row_q5_1_ref`: `m = min`, `d = (max - min) / 31`.
    pub fn quantize(x: &[f32; QK]) -> Self {
        let (min, max) = min_max(x);
        let d = (max - min) / 31.0;
        let id = recip_or_zero(d);
        // ggml casts straight to uint8_t here, without clamping to 31.
        let code = |v: f32| trunc_i32((v - min) * id + 0.5) as u8;
        let mut qs = [0u8; 16];
        let mut qh = 0u32;
        for (j, q) in qs.iter_mut().enumerate() {
            let (a, b) = (code(x[j]), code(x[j + 16]));
            *q = (a & 0x0f) | ((b & 0x0f) << 4);
            qh |= u32::from((a & 0x10) >> 4) << j;
            qh |= u32::from((b & 0x10) >> 4) << (j + 16);
        }
        Self {
            d: f32_to_f16(d),
            m: f32_to_f16(min),
            qh: qh.to_le_bytes(),
            qs,
        }
    }
}

/// The shared part of Q8_0 and Q8_1: `d = absmax / 127`, `q = round(x / d)`.
fn quantize_8bit(x: &[f32; QK]) -> (f32, [i8; QK]) {
    let amax = x.iter().fold(0f32, |a, v| c_max(a, v.abs()));
    let d = amax / 127.0;
    let id = recip_or_zero(d);
    let mut qs = [0i8; QK];
    for (q, &v) in qs.iter_mut().zip(x) {
        *q = trunc_i32((v * id).round()) as i8;
    }
    (d, qs)
}

fn i8_array(b: [u8; QK]) -> [i8; QK] {
    b.map(|v| v as i8)
}

fn u8_array(b: &[i8; QK]) -> [u8; QK] {
    b.map(|v| v as u8)
}

/// `block_q8_0`: 32 weights `d * q` with signed 8-bit `q`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(C)]
pub struct BlockQ8_0 {
    /// Scale (f16 bits).
    pub d: u16,
    /// Quants.
    pub qs: [i8; QK],
}

impl BlockQ8_0 {
    pub const SIZE: usize = 34;
    pub const OFFSET_D: usize = 0;
    pub const OFFSET_QS: usize = 2;

    pub fn from_bytes(b: &[u8; Self::SIZE]) -> Self {
        Self {
            d: le_u16(b, Self::OFFSET_D),
            qs: i8_array(sub_array(b, Self::OFFSET_QS)),
        }
    }

    pub fn to_bytes(&self) -> [u8; Self::SIZE] {
        let mut b = [0u8; Self::SIZE];
        b[..2].copy_from_slice(&self.d.to_le_bytes());
        b[2..].copy_from_slice(&u8_array(&self.qs));
        b
    }

    pub fn dequantize(&self, y: &mut [f32; QK]) {
        let d = f16_to_f32(self.d);
        for (y, &q) in y.iter_mut().zip(&self.qs) {
            *y = f32::from(q) * d;
        }
    }

    /// ggml's `quantize_row_q8_0_ref`.
    pub fn quantize(x: &[f32; QK]) -> Self {
        let (d, qs) = quantize_8bit(x);
        Self {
            d: f32_to_f16(d),
            qs,
        }
    }
}

/// `block_q8_1`: like Q8_0 plus `s = d * Σq`, used as the activation side of Q4_1/Q5_1 dots.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(C)]
pub struct BlockQ8_1 {
    /// Scale (f16 bits).
    pub d: u16,
    /// `d * sum(qs)` (f16 bits).
    pub s: u16,
    /// Quants.
    pub qs: [i8; QK],
}

impl BlockQ8_1 {
    pub const SIZE: usize = 36;
    pub const OFFSET_D: usize = 0;
    pub const OFFSET_S: usize = 2;
    pub const OFFSET_QS: usize = 4;

    pub fn from_bytes(b: &[u8; Self::SIZE]) -> Self {
        Self {
            d: le_u16(b, Self::OFFSET_D),
            s: le_u16(b, Self::OFFSET_S),
            qs: i8_array(sub_array(b, Self::OFFSET_QS)),
        }
    }

    pub fn to_bytes(&self) -> [u8; Self::SIZE] {
        let mut b = [0u8; Self::SIZE];
        b[..2].copy_from_slice(&self.d.to_le_bytes());
        b[2..4].copy_from_slice(&self.s.to_le_bytes());
        b[4..].copy_from_slice(&u8_array(&self.qs));
        b
    }

    /// `d * q` (ggml itself has no Q8_1 dequantizer; `s` is redundant and ignored).
    pub fn dequantize(&self, y: &mut [f32; QK]) {
        let d = f16_to_f32(self.d);
        for (y, &q) in y.iter_mut().zip(&self.qs) {
            *y = f32::from(q) * d;
        }
    }

    /// ggml's `quantize_row_q8_1_ref`; `s` uses the unrounded f32 `d`.
    pub fn quantize(x: &[f32; QK]) -> Self {
        let (d, qs) = quantize_8bit(x);
        let sum: i32 = qs.iter().map(|&q| i32::from(q)).sum();
        Self {
            d: f32_to_f16(d),
            s: f32_to_f16(sum as f32 * d),
            qs,
        }
    }
}
