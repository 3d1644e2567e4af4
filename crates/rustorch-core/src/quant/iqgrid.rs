//! The grid i-quants: IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S and IQ1_M, all over
//! super-blocks of [`QK_K`] = 256 weights in 8 sub-blocks of 32.
//!
//! Weights come in groups of 8 (IQ3: two groups of 4) whose magnitudes are one entry of a fixed
//! grid ([`grids`](super::grids), generated from ggml's tables); an index selects the entry, and
//! signs and sub-block scales are stored beside it.
//!
//! | format  | bytes | layout (byte offsets)                              | weight                                   |
//! |---------|-------|----------------------------------------------------|------------------------------------------|
//! | IQ2_XXS | 66    | d 0..2, qs 2..66 (per sub-block 2 × u32)           | `d·(0.5+s)·0.25 · grid · ±1`, s 4 bits   |
//! | IQ2_XS  | 74    | d 0..2, qs 2..66 (32 × u16), scales 66..74         | same, a 4-bit `s` per 16 weights         |
//! | IQ2_S   | 82    | d 0..2, qs 2..34, signs 34..66, qh 66..74, scales 74..82 | same, 10-bit grid index, raw sign bits |
//! | IQ3_XXS | 98    | d 0..2, qs 2..66, scales+signs 66..98 (8 × u32)    | `d·(0.5+s)·0.5 · grid · ±1`              |
//! | IQ3_S   | 110   | d 0..2, qs 2..66, qh 66..74, signs 74..106, scales 106..110 | `d·(1+2s) · grid · ±1`, 9-bit index |
//! | IQ1_S   | 50    | d 0..2, qs 2..34, qh 34..50 (8 × u16)              | `d·(2s+1) · (grid ± 0.125)`, grid ∈ {-1,0,1} |
//! | IQ1_M   | 56    | qs 0..32, qh 32..48, scales 48..56 (d in their top nibbles) | same, a 3-bit `s` per 16 weights |
//!
//! In the "±1" formats the signs of 8 weights are 7 stored bits expanded by
//! [`KSIGNS_IQ2XS`] (the 8th makes the count of minus signs even), except IQ2_S and IQ3_S, which
//! store all 8. Dequantization follows ggml's `dequantize_row_iq*` operation by operation: the
//! sub-block scale is `(d · f) · c` rounded after each product, each weight is `db · grid[j]`
//! rounded once, and a minus sign is applied to that product as a negation (which is how the
//! reference build evaluates `x * (neg ? -1.f : 1.f)`: measured, a NaN scale gives negative NaNs
//! where the sign bit is set).

use super::grids::{
    IQ1S_GRID, IQ2S_GRID, IQ2XS_GRID, IQ2XXS_GRID, IQ3S_GRID, IQ3XXS_GRID, KMASK_IQ2XS,
    KSIGNS_IQ2XS,
};
use super::{f16_to_f32, le_u16, le_u16_array, sub_array, QK_K};

/// ggml's `IQ1S_DELTA` / `IQ1M_DELTA`.
const IQ1_DELTA: f32 = 0.125;

/// Byte `j` of a grid entry.
#[inline]
fn grid_byte(entry: u64, j: usize) -> u8 {
    (entry >> (8 * j)) as u8
}

/// `v`, negated when bit `j` of `signs` is set.
#[inline]
fn signed(v: f32, signs: u8, j: usize) -> f32 {
    if signs & KMASK_IQ2XS[j] != 0 {
        -v
    } else {
        v
    }
}

/// Eight weights `db * grid[j]` with the signs of `signs`.
#[inline]
fn put8(y: &mut [f32], db: f32, entry: u64, signs: u8) {
    for (j, y) in y.iter_mut().take(8).enumerate() {
        *y = signed(db * f32::from(grid_byte(entry, j)), signs, j);
    }
}

/// `d * (0.5 + s) * c`, rounded after each product as in ggml.
#[inline]
fn half_scale(d: f32, s: u32, c: f32) -> f32 {
    d * (0.5 + s as f32) * c
}

/// `block_iq2_xxs`: per sub-block two u32, the first holding 4 grid indices (one per byte), the
/// second 4 × 7 sign bits and a 4-bit scale in the top bits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(C)]
pub struct BlockIq2Xxs {
    /// Super-block scale (f16 bits).
    pub d: u16,
    /// 32 little-endian u16: sub-block `ib` is `qs[4ib..4ib+4]`.
    pub qs: [u16; 32],
}

impl BlockIq2Xxs {
    pub const SIZE: usize = 66;
    pub const OFFSET_D: usize = 0;
    pub const OFFSET_QS: usize = 2;

    pub fn from_bytes(b: &[u8; Self::SIZE]) -> Self {
        Self {
            d: le_u16(b, Self::OFFSET_D),
            qs: le_u16_array(b, Self::OFFSET_QS),
        }
    }

    pub fn to_bytes(&self) -> [u8; Self::SIZE] {
        let mut b = [0u8; Self::SIZE];
        b[..2].copy_from_slice(&self.d.to_le_bytes());
        for (o, q) in b[2..].chunks_exact_mut(2).zip(&self.qs) {
            o.copy_from_slice(&q.to_le_bytes());
        }
        b
    }

    pub fn dequantize(&self, y: &mut [f32; QK_K]) {
        let d = f16_to_f32(self.d);
        for (q, y) in self.qs.chunks_exact(4).zip(y.chunks_exact_mut(32)) {
            let aux0 = u32::from(q[0]) | (u32::from(q[1]) << 16);
            let aux1 = u32::from(q[2]) | (u32::from(q[3]) << 16);
            let db = half_scale(d, aux1 >> 28, 0.25);
            for (l, y) in y.chunks_exact_mut(8).enumerate() {
                let entry = IQ2XXS_GRID[((aux0 >> (8 * l)) & 0xff) as usize];
                let signs = KSIGNS_IQ2XS[((aux1 >> (7 * l)) & 127) as usize];
                put8(y, db, entry, signs);
            }
        }
    }
}

/// `block_iq2_xs`: 32 u16 of a 9-bit grid index and 7 sign bits, and a 4-bit scale per 16
/// weights.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(C)]
pub struct BlockIq2Xs {
    /// Super-block scale (f16 bits).
    pub d: u16,
    /// Per group of 8 weights: grid index (bits 0..9) | sign bits (9..16).
    pub qs: [u16; 32],
    /// Per sub-block: scale of its first 16 weights (low nibble) and last 16 (high nibble).
    pub scales: [u8; 8],
}

impl BlockIq2Xs {
    pub const SIZE: usize = 74;
    pub const OFFSET_D: usize = 0;
    pub const OFFSET_QS: usize = 2;
    pub const OFFSET_SCALES: usize = 66;

    pub fn from_bytes(b: &[u8; Self::SIZE]) -> Self {
        Self {
            d: le_u16(b, Self::OFFSET_D),
            qs: le_u16_array(b, Self::OFFSET_QS),
            scales: sub_array(b, Self::OFFSET_SCALES),
        }
    }

    pub fn to_bytes(&self) -> [u8; Self::SIZE] {
        let mut b = [0u8; Self::SIZE];
        b[..2].copy_from_slice(&self.d.to_le_bytes());
        for (o, q) in b[2..66].chunks_exact_mut(2).zip(&self.qs) {
            o.copy_from_slice(&q.to_le_bytes());
        }
        b[66..].copy_from_slice(&self.scales);
        b
    }

    pub fn dequantize(&self, y: &mut [f32; QK_K]) {
        let d = f16_to_f32(self.d);
        for (ib, (q, y)) in self
            .qs
            .chunks_exact(4)
            .zip(y.chunks_exact_mut(32))
            .enumerate()
        {
            let sc = self.scales[ib];
            let db = [
                half_scale(d, u32::from(sc & 0x0f), 0.25),
                half_scale(d, u32::from(sc >> 4), 0.25),
            ];
            for (l, y) in y.chunks_exact_mut(8).enumerate() {
                let entry = IQ2XS_GRID[usize::from(q[l] & 511)];
                let signs = KSIGNS_IQ2XS[usize::from(q[l] >> 9)];
                put8(y, db[l / 2], entry, signs);
            }
        }
    }
}

/// `block_iq2_s`: 10-bit grid indices (low 8 bits in `qs`, top 2 in `qh`), 8 raw sign bits per
/// group, a 4-bit scale per 16 weights.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(C)]
pub struct BlockIq2S {
    /// Super-block scale (f16 bits).
    pub d: u16,
    /// Low 8 bits of the 32 grid indices (bytes 0..32), then the 32 sign bytes (32..64).
    pub qs: [u8; 64],
    /// Per sub-block: bits `2l..2l+2` are the top bits of its index `l`.
    pub qh: [u8; 8],
    /// Per sub-block: scale of its first 16 weights (low nibble) and last 16 (high nibble).
    pub scales: [u8; 8],
}

impl BlockIq2S {
    pub const SIZE: usize = 82;
    pub const OFFSET_D: usize = 0;
    pub const OFFSET_QS: usize = 2;
    pub const OFFSET_SIGNS: usize = 34;
    pub const OFFSET_QH: usize = 66;
    pub const OFFSET_SCALES: usize = 74;

    pub fn from_bytes(b: &[u8; Self::SIZE]) -> Self {
        Self {
            d: le_u16(b, Self::OFFSET_D),
            qs: sub_array(b, Self::OFFSET_QS),
            qh: sub_array(b, Self::OFFSET_QH),
            scales: sub_array(b, Self::OFFSET_SCALES),
        }
    }

    pub fn to_bytes(&self) -> [u8; Self::SIZE] {
        let mut b = [0u8; Self::SIZE];
        b[..2].copy_from_slice(&self.d.to_le_bytes());
        b[2..66].copy_from_slice(&self.qs);
        b[66..74].copy_from_slice(&self.qh);
        b[74..].copy_from_slice(&self.scales);
        b
    }

    pub fn dequantize(&self, y: &mut [f32; QK_K]) {
        let d = f16_to_f32(self.d);
        let (qs, signs) = self.qs.split_at(QK_K / 8);
        for (ib, y) in y.chunks_exact_mut(32).enumerate() {
            let sc = self.scales[ib];
            let db = [
                half_scale(d, u32::from(sc & 0x0f), 0.25),
                half_scale(d, u32::from(sc >> 4), 0.25),
            ];
            let qh = usize::from(self.qh[ib]);
            for (l, y) in y.chunks_exact_mut(8).enumerate() {
                let index = usize::from(qs[4 * ib + l]) | ((qh << (8 - 2 * l)) & 0x300);
                put8(y, db[l / 2], IQ2S_GRID[index], signs[4 * ib + l]);
            }
        }
    }
}

/// `block_iq3_xxs`: 64 byte grid indices (groups of 4), then per sub-block a u32 of 4 × 7 sign
/// bits and a 4-bit scale in the top bits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(C)]
pub struct BlockIq3Xxs {
    /// Super-block scale (f16 bits).
    pub d: u16,
    /// Grid indices (bytes 0..64), then 8 little-endian u32 of signs and scales (64..96).
    pub qs: [u8; 96],
}

impl BlockIq3Xxs {
    pub const SIZE: usize = 98;
    pub const OFFSET_D: usize = 0;
    pub const OFFSET_QS: usize = 2;
    pub const OFFSET_SCALES_SIGNS: usize = 66;

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

    pub fn dequantize(&self, y: &mut [f32; QK_K]) {
        let d = f16_to_f32(self.d);
        let (qs, scales_signs) = self.qs.split_at(QK_K / 4);
        for (ib, (q, y)) in qs.chunks_exact(8).zip(y.chunks_exact_mut(32)).enumerate() {
            let s = &scales_signs[4 * ib..4 * ib + 4];
            let aux = u32::from_le_bytes([s[0], s[1], s[2], s[3]]);
            let db = half_scale(d, aux >> 28, 0.5);
            for (l, y) in y.chunks_exact_mut(8).enumerate() {
                let signs = KSIGNS_IQ2XS[((aux >> (7 * l)) & 127) as usize];
                let g1 = IQ3XXS_GRID[usize::from(q[2 * l])];
                let g2 = IQ3XXS_GRID[usize::from(q[2 * l + 1])];
                for j in 0..4 {
                    y[j] = signed(db * f32::from(grid_byte(g1.into(), j)), signs, j);
                    y[j + 4] = signed(db * f32::from(grid_byte(g2.into(), j)), signs, j + 4);
                }
            }
        }
    }
}

/// `block_iq3_s`: 9-bit grid indices (low 8 bits in `qs`, the 9th in `qh`), 8 raw sign bits per
/// group of 8, a 4-bit scale per sub-block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(C)]
pub struct BlockIq3S {
    /// Super-block scale (f16 bits).
    pub d: u16,
    /// Low 8 bits of the 64 grid indices.
    pub qs: [u8; 64],
    /// Bit `n % 8` of byte `n / 8` is the top bit of index `n`.
    pub qh: [u8; 8],
    /// One sign byte per 8 weights.
    pub signs: [u8; 32],
    /// Sub-block scales: sub-block `2k` in the low nibble of byte `k`, `2k + 1` in the high.
    pub scales: [u8; 4],
}

impl BlockIq3S {
    pub const SIZE: usize = 110;
    pub const OFFSET_D: usize = 0;
    pub const OFFSET_QS: usize = 2;
    pub const OFFSET_QH: usize = 66;
    pub const OFFSET_SIGNS: usize = 74;
    pub const OFFSET_SCALES: usize = 106;

    pub fn from_bytes(b: &[u8; Self::SIZE]) -> Self {
        Self {
            d: le_u16(b, Self::OFFSET_D),
            qs: sub_array(b, Self::OFFSET_QS),
            qh: sub_array(b, Self::OFFSET_QH),
            signs: sub_array(b, Self::OFFSET_SIGNS),
            scales: sub_array(b, Self::OFFSET_SCALES),
        }
    }

    pub fn to_bytes(&self) -> [u8; Self::SIZE] {
        let mut b = [0u8; Self::SIZE];
        b[..2].copy_from_slice(&self.d.to_le_bytes());
        b[2..66].copy_from_slice(&self.qs);
        b[66..74].copy_from_slice(&self.qh);
        b[74..106].copy_from_slice(&self.signs);
        b[106..].copy_from_slice(&self.scales);
        b
    }

    pub fn dequantize(&self, y: &mut [f32; QK_K]) {
        let d = f16_to_f32(self.d);
        for (ib, y) in y.chunks_exact_mut(32).enumerate() {
            let sc = (self.scales[ib / 2] >> (4 * (ib % 2))) & 0x0f;
            let db = d * (1 + 2 * i32::from(sc)) as f32;
            let qs = &self.qs[8 * ib..8 * ib + 8];
            let qh = usize::from(self.qh[ib]);
            for (l, y) in y.chunks_exact_mut(8).enumerate() {
                let g1 = IQ3S_GRID[usize::from(qs[2 * l]) | ((qh << (8 - 2 * l)) & 256)];
                let g2 = IQ3S_GRID[usize::from(qs[2 * l + 1]) | ((qh << (7 - 2 * l)) & 256)];
                let signs = self.signs[4 * ib + l];
                for j in 0..4 {
                    y[j] = signed(db * f32::from(grid_byte(g1.into(), j)), signs, j);
                    y[j + 4] = signed(db * f32::from(grid_byte(g2.into(), j)), signs, j + 4);
                }
            }
        }
    }
}

/// Eight weights `dl * (grid[j] + delta)` of the signed ternary grid.
#[inline]
fn put8_iq1(y: &mut [f32], dl: f32, entry: u64, delta: f32) {
    for (j, y) in y.iter_mut().take(8).enumerate() {
        *y = dl * (f32::from(grid_byte(entry, j) as i8) + delta);
    }
}

/// `block_iq1_s`: 11-bit indices into the ternary grid (low 8 bits in `qs`, top 3 in `qh`), per
/// sub-block a 3-bit scale and the sign of the 0.125 shift.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(C)]
pub struct BlockIq1S {
    /// Super-block scale (f16 bits).
    pub d: u16,
    /// Low 8 bits of the 32 grid indices.
    pub qs: [u8; 32],
    /// Per sub-block: top index bits (3 per group, bits 0..12), scale (12..15), shift sign (15).
    pub qh: [u16; 8],
}

impl BlockIq1S {
    pub const SIZE: usize = 50;
    pub const OFFSET_D: usize = 0;
    pub const OFFSET_QS: usize = 2;
    pub const OFFSET_QH: usize = 34;

    pub fn from_bytes(b: &[u8; Self::SIZE]) -> Self {
        Self {
            d: le_u16(b, Self::OFFSET_D),
            qs: sub_array(b, Self::OFFSET_QS),
            qh: le_u16_array(b, Self::OFFSET_QH),
        }
    }

    pub fn to_bytes(&self) -> [u8; Self::SIZE] {
        let mut b = [0u8; Self::SIZE];
        b[..2].copy_from_slice(&self.d.to_le_bytes());
        b[2..34].copy_from_slice(&self.qs);
        for (o, q) in b[34..].chunks_exact_mut(2).zip(&self.qh) {
            o.copy_from_slice(&q.to_le_bytes());
        }
        b
    }

    pub fn dequantize(&self, y: &mut [f32; QK_K]) {
        let d = f16_to_f32(self.d);
        for (ib, y) in y.chunks_exact_mut(32).enumerate() {
            let qh = self.qh[ib];
            let dl = d * (2 * i32::from((qh >> 12) & 7) + 1) as f32;
            let delta = if qh & 0x8000 != 0 {
                -IQ1_DELTA
            } else {
                IQ1_DELTA
            };
            for (l, y) in y.chunks_exact_mut(8).enumerate() {
                let index =
                    usize::from(self.qs[4 * ib + l]) | (usize::from((qh >> (3 * l)) & 7) << 8);
                put8_iq1(y, dl, IQ1S_GRID[index], delta);
            }
        }
    }
}

/// `block_iq1_m`: IQ1_S's grid with per-group shift signs, a 3-bit scale per 16 weights, and the
/// f16 super-block scale spread over the top nibbles of the four scale words.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(C)]
pub struct BlockIq1M {
    /// Low 8 bits of the 32 grid indices.
    pub qs: [u8; 32],
    /// Per group pair: top index bits of the first (bits 0..3) and second (4..7) group, and the
    /// sign of each group's shift (bits 3 and 7).
    pub qh: [u8; 16],
    /// Four little-endian u16: 3-bit scales (4 per word, bits 0..12) and one nibble of `d` each.
    pub scales: [u8; 8],
}

impl BlockIq1M {
    pub const SIZE: usize = 56;
    pub const OFFSET_QS: usize = 0;
    pub const OFFSET_QH: usize = 32;
    pub const OFFSET_SCALES: usize = 48;

    pub fn from_bytes(b: &[u8; Self::SIZE]) -> Self {
        Self {
            qs: sub_array(b, Self::OFFSET_QS),
            qh: sub_array(b, Self::OFFSET_QH),
            scales: sub_array(b, Self::OFFSET_SCALES),
        }
    }

    pub fn to_bytes(&self) -> [u8; Self::SIZE] {
        let mut b = [0u8; Self::SIZE];
        b[..32].copy_from_slice(&self.qs);
        b[32..48].copy_from_slice(&self.qh);
        b[48..].copy_from_slice(&self.scales);
        b
    }

    /// The super-block scale's f16 bits, gathered from the top nibbles of the scale words.
    pub fn d_bits(&self) -> u16 {
        let sc = self.scale_words();
        (sc[0] >> 12) | ((sc[1] >> 8) & 0x00f0) | ((sc[2] >> 4) & 0x0f00) | (sc[3] & 0xf000)
    }

    fn scale_words(&self) -> [u16; 4] {
        le_u16_array(&self.scales, 0)
    }

    pub fn dequantize(&self, y: &mut [f32; QK_K]) {
        let sc = self.scale_words();
        let d = f16_to_f32(self.d_bits());
        let delta = |bit: bool| if bit { -IQ1_DELTA } else { IQ1_DELTA };
        for (ib, y) in y.chunks_exact_mut(32).enumerate() {
            let w = sc[ib / 2] >> (6 * (ib % 2));
            let dl = [
                d * (2 * i32::from(w & 7) + 1) as f32,
                d * (2 * i32::from((w >> 3) & 7) + 1) as f32,
            ];
            let qs = &self.qs[4 * ib..4 * ib + 4];
            let qh = [
                usize::from(self.qh[2 * ib]),
                usize::from(self.qh[2 * ib + 1]),
            ];
            for (l, y) in y.chunks_exact_mut(8).enumerate() {
                let h = qh[l / 2];
                let (high, neg) = if l % 2 == 0 {
                    ((h << 8) & 0x700, h & 0x08 != 0)
                } else {
                    ((h << 4) & 0x700, h & 0x80 != 0)
                };
                let index = usize::from(qs[l]) | high;
                put8_iq1(y, dl[l / 2], IQ1S_GRID[index], delta(neg));
            }
        }
    }
}
