//! Ternary formats (BitNet b1.58, TriLMs): TQ1_0 and TQ2_0, super-blocks of [`QK_K`] = 256
//! weights `d * t` with `t` in {-1, 0, 1} and one f16 scale `d` (stored last).
//!
//! * TQ2_0 (66 bytes): `qs` 0..64, `d` 64..66. Two bits per weight, `t = q - 1` (the unused
//!   code 3 decodes as 2). Byte `m` of each 32-byte half holds weights `m`, `m+32`, `m+64`,
//!   `m+96` of that half's 128 at bit offsets 0, 2, 4, 6.
//! * TQ1_0 (54 bytes): `qs` 0..48, `qh` 48..52, `d` 52..54. Five trits per byte, stored as the
//!   byte `ceil(v · 256 / 243)` of their base-3 number `v` (first trit most significant), so that
//!   trit `n` is `((byte · 3^n mod 256) · 3) >> 8`. Bytes 0..32 hold weights `m + 32n` (n < 5) of
//!   the first 160, bytes 32..48 weights `160 + m + 16n` of the next 80, and `qh` weights
//!   `240 + j + 4n` (n < 4) of the last 16.
//!
//! Quantization is ggml's `quantize_row_tq{1,2}_0_ref` (what `ggml_quantize_chunk` runs):
//! `d = max |x|` (C's `MAX`, so a NaN can be the result only as the last element), trits
//! `lroundf(x / d)` computed as `x * (1/d)`, with glibc's `lroundf` results for NaN and
//! out-of-range values (`i64::MIN`) and C's wrapping `uint8_t` arithmetic.

use super::{c_max, f16_to_f32, f32_to_f16, le_u16, sub_array, QK_K};

/// glibc's `lroundf` on x86-64: round half away from zero; NaN and values outside the `long`
/// range give `LONG_MIN` (what its final `(long) x` conversion, `cvttss2si`, returns).
#[inline]
fn lroundf(x: f32) -> i64 {
    const LIMIT: f32 = 9_223_372_036_854_775_808.0; // 2^63
    if x.is_nan() || !(-LIMIT..LIMIT).contains(&x) {
        i64::MIN
    } else {
        x.round() as i64
    }
}

/// `d = max |x|` folded with C's `MAX` and `1/d` (0 for a zero `d`), as both quantizers do.
fn scale(x: &[f32; QK_K]) -> (f32, f32) {
    let amax = x.iter().fold(0f32, |m, v| c_max(m, v.abs()));
    let id = if amax != 0.0 { 1.0 / amax } else { 0.0 };
    (amax, id)
}

/// `lroundf(x * id) + 1` as C's `int`, reduced to the low byte (all that the callers keep).
#[inline]
fn trit(x: f32, id: f32) -> u8 {
    lroundf(x * id).wrapping_add(1) as u8
}

/// C's `q = ((uint16_t)q * 256 + 242) / 243` stored back into a `uint8_t`.
#[inline]
fn ceil_div_243(q: u8) -> u8 {
    (u32::from(q) * 256).div_ceil(243) as u8
}

/// Trit `n` (0..5) of a TQ1_0 byte, 0..=2.
#[inline]
fn tq1_trit(byte: u8, n: usize) -> i32 {
    const POW3: [u8; 6] = [1, 3, 9, 27, 81, 243];
    let q = byte.wrapping_mul(POW3[n]);
    i32::from((u16::from(q) * 3) >> 8)
}

/// `block_tq1_0`: 5 trits per byte in `qs`, 4 per byte in `qh`, then `d`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(C)]
pub struct BlockTq1_0 {
    /// 48 bytes of 5 trits each.
    pub qs: [u8; 48],
    /// 4 bytes of 4 trits each (the fifth, least significant trit is 0).
    pub qh: [u8; 4],
    /// Scale (f16 bits).
    pub d: u16,
}

impl BlockTq1_0 {
    pub const SIZE: usize = 54;
    pub const OFFSET_QS: usize = 0;
    pub const OFFSET_QH: usize = 48;
    pub const OFFSET_D: usize = 52;

    pub fn from_bytes(b: &[u8; Self::SIZE]) -> Self {
        Self {
            qs: sub_array(b, Self::OFFSET_QS),
            qh: sub_array(b, Self::OFFSET_QH),
            d: le_u16(b, Self::OFFSET_D),
        }
    }

    pub fn to_bytes(&self) -> [u8; Self::SIZE] {
        let mut b = [0u8; Self::SIZE];
        b[..48].copy_from_slice(&self.qs);
        b[48..52].copy_from_slice(&self.qh);
        b[52..].copy_from_slice(&self.d.to_le_bytes());
        b
    }

    pub fn dequantize(&self, y: &mut [f32; QK_K]) {
        let d = f16_to_f32(self.d);
        let mut k = 0;
        let mut put = |t: i32| {
            y[k] = (t - 1) as f32 * d;
            k += 1;
        };
        for group in [&self.qs[..32], &self.qs[32..48]] {
            for n in 0..5 {
                for &byte in group {
                    put(tq1_trit(byte, n));
                }
            }
        }
        for n in 0..4 {
            for &byte in &self.qh {
                put(tq1_trit(byte, n));
            }
        }
    }

    /// ggml's `quantize_row_tq1_0_ref`.
    pub fn quantize(x: &[f32; QK_K]) -> Self {
        let (d, id) = scale(x);
        let mut out = Self {
            qs: [0; 48],
            qh: [0; 4],
            d: f32_to_f16(d),
        };
        // (first byte, bytes, first weight): 32 bytes over weights 0..160, 16 over 160..240.
        for (b0, nb, x0) in [(0usize, 32usize, 0usize), (32, 16, 160)] {
            for m in 0..nb {
                let mut q = 0u8;
                for n in 0..5 {
                    q = q.wrapping_mul(3).wrapping_add(trit(x[x0 + m + n * nb], id));
                }
                out.qs[b0 + m] = ceil_div_243(q);
            }
        }
        for j in 0..4 {
            let mut q = 0u8;
            for m in 0..4 {
                q = q.wrapping_mul(3).wrapping_add(trit(x[240 + j + m * 4], id));
            }
            out.qh[j] = ceil_div_243(q.wrapping_mul(3));
        }
        out
    }
}

/// `block_tq2_0`: 2 bits per weight, then `d`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(C)]
pub struct BlockTq2_0 {
    /// Codes `t + 1`, four per byte.
    pub qs: [u8; 64],
    /// Scale (f16 bits).
    pub d: u16,
}

impl BlockTq2_0 {
    pub const SIZE: usize = 66;
    pub const OFFSET_QS: usize = 0;
    pub const OFFSET_D: usize = 64;

    pub fn from_bytes(b: &[u8; Self::SIZE]) -> Self {
        Self {
            qs: sub_array(b, Self::OFFSET_QS),
            d: le_u16(b, Self::OFFSET_D),
        }
    }

    pub fn to_bytes(&self) -> [u8; Self::SIZE] {
        let mut b = [0u8; Self::SIZE];
        b[..64].copy_from_slice(&self.qs);
        b[64..].copy_from_slice(&self.d.to_le_bytes());
        b
    }

    pub fn dequantize(&self, y: &mut [f32; QK_K]) {
        let d = f16_to_f32(self.d);
        for (q, y) in self.qs.chunks_exact(32).zip(y.chunks_exact_mut(128)) {
            for (l, y) in y.chunks_exact_mut(32).enumerate() {
                for (y, &byte) in y.iter_mut().zip(q) {
                    *y = (i32::from((byte >> (2 * l)) & 3) - 1) as f32 * d;
                }
            }
        }
    }

    /// ggml's `quantize_row_tq2_0_ref`.
    pub fn quantize(x: &[f32; QK_K]) -> Self {
        let (d, id) = scale(x);
        let mut qs = [0u8; 64];
        for (q, x) in qs.chunks_exact_mut(32).zip(x.chunks_exact(128)) {
            for (m, q) in q.iter_mut().enumerate() {
                for n in 0..4 {
                    *q = q.wrapping_add((trit(x[m + n * 32], id) & 3) << (2 * n));
                }
            }
        }
        Self {
            qs,
            d: f32_to_f16(d),
        }
    }
}
