//! Non-linear 4-bit formats: IQ4_NL (blocks of 32) and IQ4_XS (super-blocks of 256).
//!
//! Each 4-bit code indexes [`IQ4NL_VALUES`], a fixed non-uniform grid denser near zero; the
//! weight is `scale * IQ4NL_VALUES[code]`. Byte `j` of each 16-byte group holds weight `j` of
//! its 32 in the low nibble and weight `j + 16` in the high nibble.
//!
//! * IQ4_NL (18 bytes): `d` f16 at 0..2, `qs` at 2..18; `w = d * v[q]`.
//! * IQ4_XS (136 bytes): `d` f16 at 0..2, `scales_h` u16 at 2..4, `scales_l` at 4..8, `qs` at
//!   8..136. Sub-block `ib` (of 8) has the 6-bit scale `ls = (nibble ib of scales_l) |
//!   (bits 2ib..2ib+2 of scales_h) << 4`, and `w = d * (ls - 32) * v[q]`.
//!
//! Quantization is ggml's `quantize_iq4_nl` / `quantize_iq4_xs` (what `ggml_quantize_chunk`
//! and `llama-quantize` run), without an importance matrix or with one (`quantize_weighted`):
//! per 32 weights a scale search over 15 candidates with x²-weights (or `qw·√(σ²+x²)`),
//! then, for IQ4_XS, 6-bit sub-block scales relative to `d` and a final re-assignment of
//! codes. (ggml's `quantize_row_iq4_nl_ref` skips the search and so gives
//! different bytes; it is not what GGUF files are made with.)

use super::{f16_to_f32, f32_to_f16, le_u16, nearest_int, sub_array, GROUP_MAX_EPS, QK_K};

/// The IQ4_NL / IQ4_XS code book (`kvalues_iq4nl`).
pub const IQ4NL_VALUES: [i8; 16] = [
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
];

/// Number of extra scale candidates tried on each side of the first guess.
const NTRY: i32 = 7;

/// Index of the code-book value nearest to `x` (ties and NaN resolved as ggml's
/// `best_index_int8`: binary search, then the upper neighbour unless the lower is strictly closer).
#[inline]
fn best_index(x: f32) -> u8 {
    let v = |i: usize| f32::from(IQ4NL_VALUES[i]);
    if x <= v(0) {
        return 0;
    }
    if x >= v(15) {
        return 15;
    }
    let (mut lo, mut hi) = (0usize, 15usize);
    while hi - lo > 1 {
        let mid = (lo + hi) / 2;
        if x < v(mid) {
            hi = mid;
        } else {
            lo = mid;
        }
    }
    if x - v(hi - 1) < v(hi) - x {
        (hi - 1) as u8
    } else {
        hi as u8
    }
}

/// Best scale for 32 weights on the non-linear grid, maximizing `(Σ w q x)² / Σ w q²` over
/// the candidates `(t - 127) / max`, t in -7..=7 (`w = x²` without an importance matrix).
/// `None` for an all-zero block.
fn search_scale(x: &[f32], w: &[f32]) -> Option<f32> {
    let (mut amax, mut max) = (0f32, 0f32);
    for &v in x {
        if v.abs() > amax {
            amax = v.abs();
            max = v;
        }
    }
    if amax < GROUP_MAX_EPS {
        return None;
    }
    let v0 = f32::from(IQ4NL_VALUES[0]);
    let sums = |id: f32| {
        let (mut sumqx, mut sumq2) = (0f32, 0f32);
        for (&xv, &w) in x.iter().zip(w) {
            let q = f32::from(IQ4NL_VALUES[usize::from(best_index(id * xv))]);
            sumqx += w * q * xv;
            sumq2 += w * q * q;
        }
        (sumqx, sumq2)
    };
    let d0 = -max / v0;
    let (sumqx, sumq2) = sums(1.0 / d0);
    let mut d = if sumq2 > 0.0 { sumqx / sumq2 } else { 0.0 };
    let mut best = d * sumqx;
    for t in -NTRY..=NTRY {
        let id = (t + i32::from(IQ4NL_VALUES[0])) as f32 / max;
        let (sumqx, sumq2) = sums(id);
        if sumq2 > 0.0 && sumqx * sumqx > best * sumq2 {
            d = sumqx / sumq2;
            best = d * sumqx;
        }
    }
    Some(d)
}

/// The weights of the scale search for 32 values: `x²`, or with an importance matrix
/// `qw · √(σ² + x²)` where `σ²` is twice the mean square of the (super-)block
/// (`quantize_row_iq4_nl_impl`).
fn search_weights(xb: &[f32], qw: Option<(&[f32], f32)>) -> [f32; 32] {
    let mut w = [0f32; 32];
    match qw {
        Some((qw, sigma2)) => {
            for ((w, &x), &q) in w.iter_mut().zip(xb).zip(qw) {
                *w = q * (sigma2 + x * x).sqrt();
            }
        }
        None => {
            for (w, &x) in w.iter_mut().zip(xb) {
                *w = x * x;
            }
        }
    }
    w
}

/// `σ²` of `quantize_row_iq4_nl_impl`: `Σ x² · (2 / n)`.
fn sigma2(x: &[f32]) -> f32 {
    let mut s = 0f32;
    for &v in x {
        s += v * v;
    }
    s * (2.0 / x.len() as f32)
}

/// Codes for 32 weights at inverse scale `id`, packed two per byte.
fn pack_codes(x: &[f32], id: f32, out: &mut [u8]) {
    for (j, q) in out.iter_mut().take(16).enumerate() {
        *q = best_index(id * x[j]) | (best_index(id * x[j + 16]) << 4);
    }
}

/// `block_iq4_nl`: 32 weights `d * IQ4NL_VALUES[q]`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(C)]
pub struct BlockIq4Nl {
    /// Scale (f16 bits).
    pub d: u16,
    /// Codes: byte `j` = weight `j` (low) | weight `j + 16` (high).
    pub qs: [u8; 16],
}

impl BlockIq4Nl {
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

    pub fn dequantize(&self, y: &mut [f32; 32]) {
        let d = f16_to_f32(self.d);
        for (j, &q) in self.qs.iter().enumerate() {
            y[j] = d * f32::from(IQ4NL_VALUES[usize::from(q & 0x0f)]);
            y[j + 16] = d * f32::from(IQ4NL_VALUES[usize::from(q >> 4)]);
        }
    }

    /// ggml's `quantize_iq4_nl` without an importance matrix.
    pub fn quantize(x: &[f32; 32]) -> Self {
        Self::quantize_impl(x, None)
    }

    /// ggml's `quantize_iq4_nl` with the importance weights `qw` of these 32 columns.
    pub fn quantize_weighted(x: &[f32; 32], qw: &[f32; 32]) -> Self {
        Self::quantize_impl(x, Some(qw))
    }

    fn quantize_impl(x: &[f32; 32], qw: Option<&[f32; 32]>) -> Self {
        let w = search_weights(x, qw.map(|q| (&q[..], sigma2(x))));
        // An all-zero block gets scale 0 and then every code from best_index(0 * x).
        let d = search_scale(x, &w).unwrap_or(0.0);
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        let mut qs = [0u8; 16];
        pack_codes(x, id, &mut qs);
        Self {
            d: f32_to_f16(d),
            qs,
        }
    }
}

/// `block_iq4_xs`: 8 sub-blocks of 32, `w = d * (ls - 32) * IQ4NL_VALUES[q]` with 6-bit `ls`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(C)]
pub struct BlockIq4Xs {
    /// Super-block scale (f16 bits).
    pub d: u16,
    /// High 2 bits of the 8 sub-block scales, 2 bits each from bit 0.
    pub scales_h: u16,
    /// Low 4 bits of the sub-block scales, two per byte (even sub-block in the low nibble).
    pub scales_l: [u8; 4],
    /// Codes, 16 bytes per sub-block laid out as IQ4_NL's `qs`.
    pub qs: [u8; 128],
}

impl BlockIq4Xs {
    pub const SIZE: usize = 136;
    pub const OFFSET_D: usize = 0;
    pub const OFFSET_SCALES_H: usize = 2;
    pub const OFFSET_SCALES_L: usize = 4;
    pub const OFFSET_QS: usize = 8;

    pub fn from_bytes(b: &[u8; Self::SIZE]) -> Self {
        Self {
            d: le_u16(b, Self::OFFSET_D),
            scales_h: le_u16(b, Self::OFFSET_SCALES_H),
            scales_l: sub_array(b, Self::OFFSET_SCALES_L),
            qs: sub_array(b, Self::OFFSET_QS),
        }
    }

    pub fn to_bytes(&self) -> [u8; Self::SIZE] {
        let mut b = [0u8; Self::SIZE];
        b[..2].copy_from_slice(&self.d.to_le_bytes());
        b[2..4].copy_from_slice(&self.scales_h.to_le_bytes());
        b[4..8].copy_from_slice(&self.scales_l);
        b[8..].copy_from_slice(&self.qs);
        b
    }

    /// The 6-bit scale of sub-block `ib` (0..8), biased by 32.
    #[inline]
    pub fn sub_scale(&self, ib: usize) -> u8 {
        let low = (self.scales_l[ib / 2] >> (4 * (ib % 2))) & 0x0f;
        let high = ((self.scales_h >> (2 * ib)) & 3) as u8;
        low | (high << 4)
    }

    pub fn dequantize(&self, y: &mut [f32; QK_K]) {
        let d = f16_to_f32(self.d);
        for (ib, (q, y)) in self
            .qs
            .chunks_exact(16)
            .zip(y.chunks_exact_mut(32))
            .enumerate()
        {
            let dl = d * (i32::from(self.sub_scale(ib)) - 32) as f32;
            for (j, &byte) in q.iter().enumerate() {
                y[j] = dl * f32::from(IQ4NL_VALUES[usize::from(byte & 0x0f)]);
                y[j + 16] = dl * f32::from(IQ4NL_VALUES[usize::from(byte >> 4)]);
            }
        }
    }

    /// ggml's `quantize_iq4_xs` without an importance matrix.
    pub fn quantize(x: &[f32; QK_K]) -> Self {
        Self::quantize_impl(x, None)
    }

    /// ggml's `quantize_iq4_xs` with the importance weights `qw` of these 256 columns.
    pub fn quantize_weighted(x: &[f32; QK_K], qw: &[f32; QK_K]) -> Self {
        Self::quantize_impl(x, Some(qw))
    }

    fn quantize_impl(x: &[f32; QK_K], qw: Option<&[f32; QK_K]>) -> Self {
        let s2 = qw.map(|_| sigma2(x));
        let mut scales = [0f32; 8];
        let (mut max_scale, mut amax_scale) = (0f32, 0f32);
        for (ib, (s, xb)) in scales.iter_mut().zip(x.chunks_exact(32)).enumerate() {
            let qwb = qw.zip(s2).map(|(q, s2)| (&q[32 * ib..32 * ib + 32], s2));
            if let Some(d) = search_scale(xb, &search_weights(xb, qwb)) {
                *s = d;
                if d.abs() > amax_scale {
                    amax_scale = d.abs();
                    max_scale = d;
                }
            }
        }
        let d = -max_scale / 32.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        let mut out = Self {
            d: f32_to_f16(d),
            scales_h: 0,
            scales_l: [0; 4],
            qs: [0; 128],
        };
        for (ib, (xb, q)) in x
            .chunks_exact(32)
            .zip(out.qs.chunks_exact_mut(16))
            .enumerate()
        {
            let l = nearest_int(id * scales[ib]).clamp(-32, 31);
            // The codes use the unrounded f32 `d`, as in ggml.
            let dl = d * l as f32;
            let idl = if dl != 0.0 { 1.0 / dl } else { 0.0 };
            pack_codes(xb, idl, q);
            let biased = (l + 32) as u8;
            out.scales_l[ib / 2] |= (biased & 0x0f) << (4 * (ib % 2));
            out.scales_h |= u16::from(biased >> 4) << (2 * ib);
        }
        out
    }
}
