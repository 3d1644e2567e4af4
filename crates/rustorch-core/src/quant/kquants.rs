//! The "k-quants": Q2_K, Q3_K, Q4_K, Q5_K, Q6_K and Q8_K, each over a super-block of
//! [`QK_K`] = 256 weights split into sub-blocks with their own quantized scales.
//!
//! | format | sub-blocks | decoded value                          | bytes |
//! |--------|------------|----------------------------------------|-------|
//! | Q2_K   | 16 × 16    | `d*sc*q - dmin*m`, q 2 bits, sc/m 4 bits | 84  |
//! | Q3_K   | 16 × 16    | `d*(sc-32)*(q-4)`, q 3 bits, sc 6 bits  | 110   |
//! | Q4_K   | 8 × 32     | `d*sc*q - dmin*m`, q 4 bits, sc/m 6 bits | 144  |
//! | Q5_K   | 8 × 32     | `d*sc*q - dmin*m`, q 5 bits, sc/m 6 bits | 176  |
//! | Q6_K   | 16 × 16    | `d*sc*(q-32)`, q 6 bits, sc i8          | 210   |
//! | Q8_K   | 1 × 256    | `d*q`, d f32, q i8, plus 16 group sums  | 292   |
//!
//! The 2-bit planes (`qs` of Q2_K/Q3_K, `qh` of Q6_K) interleave four groups of 32: within
//! each half of 128 weights, byte `l` (0..32) holds weights `l`, `l+32`, `l+64`, `l+96` at bit
//! offsets 0, 2, 4, 6. The 4-bit planes of Q4_K/Q5_K/Q6_K hold weights `l` and `l+32` of each 64
//! (Q6_K: `l`/`l+64` in `ql[l]`, `l+32`/`l+96` in `ql[l+32]` of each 128).
//!
//! Quantization reproduces `quantize_row_q{2..6,8}_K_ref` exactly, including its iterative scale
//! searches (`make_qkx2_quants`, `make_q3_quants`, `make_qx_quants`). Every float operation is
//! rounded separately in C's evaluation order (the reference build has no FMA contraction), sums
//! run in index order, and `nearest_int` uses the same magic-number trick, so results agree to
//! the bit even for NaN and out-of-range inputs.

use super::{f16_to_f32, f32_to_f16, le_u16, nearest_int, sub_array, GROUP_MAX_EPS};

/// Weights per super-block.
pub const QK_K: usize = 256;

/// Bytes of packed 6-bit scales and mins in Q4_K / Q5_K.
pub const K_SCALE_SIZE: usize = 12;

/// The 6-bit scale and min of sub-block `j` (0..8) from Q4_K / Q5_K's 12 packed bytes.
///
/// Sub-blocks 0..4 keep scale and min in the low 6 bits of bytes `j` and `j + 4`; sub-blocks
/// 4..8 keep their low 4 bits in the nibbles of byte `j + 4` and their top 2 bits in the top
/// bits of bytes `j - 4` (scale) and `j` (min).
#[inline]
pub fn scale_min_k4(j: usize, q: &[u8; K_SCALE_SIZE]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// The 6-bit scale of sub-block `j` (0..16) from Q3_K's 12 packed bytes, still biased by 32.
///
/// Low 4 bits: nibble of byte `j % 8` (low for `j < 8`); high 2 bits: bits `2*(j/4)` of byte
/// `8 + j % 4`.
#[inline]
pub fn scale_q3k(j: usize, q: &[u8; 12]) -> u8 {
    let low = if j < 8 { q[j] & 0x0f } else { q[j - 8] >> 4 };
    low | (((q[8 + j % 4] >> (2 * (j / 4))) & 3) << 4)
}

/// Stores the biased 6-bit scale `v` of sub-block `j` into Q3_K's 12 packed bytes (the
/// inverse of [`scale_q3k`]; the bytes start zeroed).
#[inline]
pub(crate) fn pack_scale_q3k(q: &mut [u8; 12], j: usize, v: u8) {
    if j < 8 {
        q[j] = v & 0x0f;
    } else {
        q[j - 8] |= (v & 0x0f) << 4;
    }
    q[8 + j % 4] |= (v >> 4) << (2 * (j / 4));
}

// ---------------------------------------------------------------------------------------------
// Scale searches shared by the quantizers.

/// Affine fit `x ≈ scale * L + min` with `L` in `0..=nmax` and `min <= 0`, minimizing the
/// weighted error over a grid of candidate scales (`make_qkx2_quants`). Returns
/// `(scale, -min)` and fills `l`.
#[allow(clippy::too_many_arguments)]
fn fit_scale_min(
    nmax: i32,
    x: &[f32],
    weights: &[f32],
    l: &mut [u8],
    rmin: f32,
    rdelta: f32,
    nstep: i32,
    use_mad: bool,
) -> (f32, f32) {
    let n = x.len();
    let mut min = x[0];
    let mut max = x[0];
    let mut sum_w = weights[0];
    let mut sum_x = sum_w * x[0];
    for i in 1..n {
        if x[i] < min {
            min = x[i];
        }
        if x[i] > max {
            max = x[i];
        }
        sum_w += weights[i];
        sum_x += weights[i] * x[i];
    }
    if min > 0.0 {
        min = 0.0;
    }
    if max == min {
        l.fill(0);
        return (0.0, -min);
    }
    let err = |diff: f32| if use_mad { diff.abs() } else { diff * diff };
    let code = |iscale: f32, v: f32, min: f32| nearest_int(iscale * (v - min)).clamp(0, nmax);

    let mut iscale = nmax as f32 / (max - min);
    let mut scale = 1.0 / iscale;
    let mut best_error = 0f32;
    for i in 0..n {
        let q = code(iscale, x[i], min);
        l[i] = q as u8;
        best_error += weights[i] * err(scale * q as f32 + min - x[i]);
    }
    if nstep < 1 {
        return (scale, -min);
    }
    let mut laux = [0u8; 32];
    for step in 0..=nstep {
        iscale = (rmin + rdelta * step as f32 + nmax as f32) / (max - min);
        let (mut sum_l, mut sum_l2, mut sum_xl) = (0f32, 0f32, 0f32);
        for i in 0..n {
            let q = code(iscale, x[i], min);
            laux[i] = q as u8;
            let (w, q) = (weights[i], q as f32);
            sum_l += w * q;
            sum_l2 += w * q * q;
            sum_xl += w * q * x[i];
        }
        let det = sum_w * sum_l2 - sum_l * sum_l;
        if det > 0.0 {
            let mut this_scale = (sum_w * sum_xl - sum_x * sum_l) / det;
            let mut this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det;
            if this_min > 0.0 {
                this_min = 0.0;
                this_scale = sum_xl / sum_l2;
            }
            let mut cur_error = 0f32;
            for i in 0..n {
                cur_error += weights[i] * err(this_scale * f32::from(laux[i]) + this_min - x[i]);
            }
            if cur_error < best_error {
                l[..n].copy_from_slice(&laux[..n]);
                best_error = cur_error;
                scale = this_scale;
                min = this_min;
            }
        }
    }
    (scale, -min)
}

/// Symmetric fit for Q3_K (`make_q3_quants` with `do_rmse`): `L` in `0..2*nmax` (biased by
/// `nmax`), refined by coordinate descent on the x²-weighted error. Returns the scale.
fn fit_q3(nmax: i32, x: &[f32; 16], l: &mut [i8]) -> f32 {
    let (mut max, mut amax) = (0f32, 0f32);
    for &v in x {
        if v.abs() > amax {
            amax = v.abs();
            max = v;
        }
    }
    if amax < GROUP_MAX_EPS {
        l[..16].fill(0);
        return 0.0;
    }
    let iscale = -(nmax as f32) / max;
    let (mut sumlx, mut suml2) = (0f32, 0f32);
    for i in 0..16 {
        let q = nearest_int(iscale * x[i]).clamp(-nmax, nmax - 1);
        l[i] = q as i8;
        let w = x[i] * x[i];
        sumlx += w * x[i] * q as f32;
        suml2 += w * q as f32 * q as f32;
    }
    for _ in 0..5 {
        let mut changed = false;
        for i in 0..16 {
            let w = x[i] * x[i];
            let cur = f32::from(l[i]);
            let mut slx = sumlx - w * x[i] * cur;
            if slx > 0.0 {
                let mut sl2 = suml2 - w * cur * cur;
                let new_l = nearest_int(x[i] * sl2 / slx).clamp(-nmax, nmax - 1);
                if new_l != i32::from(l[i]) {
                    let nl = new_l as f32;
                    slx += w * x[i] * nl;
                    sl2 += w * nl * nl;
                    if sl2 > 0.0 && slx * slx * suml2 > sumlx * sumlx * sl2 {
                        l[i] = new_l as i8;
                        sumlx = slx;
                        suml2 = sl2;
                        changed = true;
                    }
                }
            }
        }
        if !changed {
            break;
        }
    }
    for q in l[..16].iter_mut() {
        *q += nmax as i8;
    }
    if suml2 > 0.0 {
        sumlx / suml2
    } else {
        0.0
    }
}

/// Symmetric fit for Q6_K (`make_qx_quants` with x²-weights): tries 19 scales around
/// `-nmax / max` and keeps the best. `L` is biased by `nmax`. Returns the scale.
fn fit_symmetric(nmax: i32, x: &[f32; 16], l: &mut [i8]) -> f32 {
    let (mut max, mut amax) = (0f32, 0f32);
    for &v in x {
        let av = v.abs();
        if av > amax {
            amax = av;
            max = v;
        }
    }
    if amax < GROUP_MAX_EPS {
        l[..16].fill(0);
        return 0.0;
    }
    let code = |iscale: f32, v: f32| nearest_int(iscale * v).clamp(-nmax, nmax - 1);
    let sums = |iscale: f32| {
        let (mut sumlx, mut suml2) = (0f32, 0f32);
        for &v in x {
            let q = code(iscale, v) as f32;
            let w = v * v;
            sumlx += w * v * q;
            suml2 += w * q * q;
        }
        (sumlx, suml2)
    };
    let iscale = -(nmax as f32) / max;
    for i in 0..16 {
        l[i] = (code(iscale, x[i]) + nmax) as i8;
    }
    let (sumlx, suml2) = sums(iscale);
    let mut scale = if suml2 != 0.0 { sumlx / suml2 } else { 0.0 };
    let mut best = scale * sumlx;
    for step in (-9..=9).filter(|&s| s != 0) {
        let iscale = -(nmax as f32 + 0.1 * step as f32) / max;
        let (sumlx, suml2) = sums(iscale);
        if suml2 > 0.0 && sumlx * sumlx > best * suml2 {
            for i in 0..16 {
                l[i] = (code(iscale, x[i]) + nmax) as i8;
            }
            scale = sumlx / suml2;
            best = scale * sumlx;
        }
    }
    scale
}

/// Packs four 2-bit planes per 128 weights: byte `l` of each 32 = `L[l] | L[l+32]<<2 | ...`.
pub(crate) fn pack_2bit(l: &[u8; QK_K], qs: &mut [u8; QK_K / 4]) {
    for (half, out) in qs.chunks_exact_mut(32).enumerate() {
        let base = half * 128;
        for (i, q) in out.iter_mut().enumerate() {
            let j = base + i;
            *q = l[j] | (l[j + 32] << 2) | (l[j + 64] << 4) | (l[j + 96] << 6);
        }
    }
}

/// Packs Q4_K / Q5_K sub-block scales and mins (each clamped to 63) into 12 bytes.
pub(crate) fn pack_scales_mins_k4(ls: &[u8; 8], lm: &[u8; 8]) -> [u8; K_SCALE_SIZE] {
    let mut s = [0u8; K_SCALE_SIZE];
    for j in 0..8 {
        if j < 4 {
            s[j] = ls[j];
            s[j + 4] = lm[j];
        } else {
            s[j + 4] = (ls[j] & 0x0f) | ((lm[j] & 0x0f) << 4);
            s[j - 4] |= (ls[j] >> 4) << 6;
            s[j] |= (lm[j] >> 4) << 6;
        }
    }
    s
}

/// Quantizes the eight 32-weight sub-blocks of Q4_K / Q5_K: per-sub-block affine fits, then 6-bit
/// scales and mins relative to the super-block `d` / `dmin`, then a final pass recomputing each
/// weight's code against the rounded scales. Returns `(d, dmin, scales, L)`.
fn quantize_k4_family(
    x: &[f32; QK_K],
    nmax: i32,
    rmin: f32,
    nstep: i32,
) -> (u16, u16, [u8; K_SCALE_SIZE], [u8; QK_K]) {
    let mut l = [0u8; QK_K];
    let mut scales = [0f32; 8];
    let mut mins = [0f32; 8];
    let (mut max_scale, mut max_min) = (0f32, 0f32);
    for j in 0..8 {
        let xs = &x[32 * j..32 * j + 32];
        let mut sum_x2 = 0f32;
        for &v in xs {
            sum_x2 += v * v;
        }
        let av_x = (sum_x2 / 32.0).sqrt();
        let mut weights = [0f32; 32];
        for (w, &v) in weights.iter_mut().zip(xs) {
            *w = av_x + v.abs();
        }
        let (scale, min) = fit_scale_min(
            nmax,
            xs,
            &weights,
            &mut l[32 * j..32 * j + 32],
            rmin,
            0.1,
            nstep,
            false,
        );
        scales[j] = scale;
        mins[j] = min;
        if scale > max_scale {
            max_scale = scale;
        }
        if min > max_min {
            max_min = min;
        }
    }
    let inv_scale = if max_scale > 0.0 {
        63.0 / max_scale
    } else {
        0.0
    };
    let inv_min = if max_min > 0.0 { 63.0 / max_min } else { 0.0 };
    let mut ls = [0u8; 8];
    let mut lm = [0u8; 8];
    for j in 0..8 {
        // ggml stores the rounded value in a uint8_t before clamping.
        ls[j] = (nearest_int(inv_scale * scales[j]) as u8).min(63);
        lm[j] = (nearest_int(inv_min * mins[j]) as u8).min(63);
    }
    let packed = pack_scales_mins_k4(&ls, &lm);
    let d = f32_to_f16(max_scale / 63.0);
    let dmin = f32_to_f16(max_min / 63.0);
    for j in 0..8 {
        let (sc, m) = scale_min_k4(j, &packed);
        let dj = f16_to_f32(d) * f32::from(sc);
        if dj == 0.0 {
            continue;
        }
        let dm = f16_to_f32(dmin) * f32::from(m);
        for i in 32 * j..32 * j + 32 {
            l[i] = nearest_int((x[i] + dm) / dj).clamp(0, nmax) as u8;
        }
    }
    (d, dmin, packed, l)
}

// ---------------------------------------------------------------------------------------------

/// `block_q2_K`: 16 sub-blocks of 16, `w = d*(sc & 15)*q - dmin*(sc >> 4)`, 2-bit `q`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(C)]
pub struct BlockQ2K {
    /// Per sub-block: scale in the low nibble, min in the high nibble.
    pub scales: [u8; 16],
    /// 2-bit quants, four planes per 128 weights.
    pub qs: [u8; 64],
    /// Super-block scale for the scales (f16 bits).
    pub d: u16,
    /// Super-block scale for the mins (f16 bits).
    pub dmin: u16,
}

impl BlockQ2K {
    pub const SIZE: usize = 84;
    pub const OFFSET_SCALES: usize = 0;
    pub const OFFSET_QS: usize = 16;
    pub const OFFSET_D: usize = 80;
    pub const OFFSET_DMIN: usize = 82;

    pub fn from_bytes(b: &[u8; Self::SIZE]) -> Self {
        Self {
            scales: sub_array(b, Self::OFFSET_SCALES),
            qs: sub_array(b, Self::OFFSET_QS),
            d: le_u16(b, Self::OFFSET_D),
            dmin: le_u16(b, Self::OFFSET_DMIN),
        }
    }

    pub fn to_bytes(&self) -> [u8; Self::SIZE] {
        let mut b = [0u8; Self::SIZE];
        b[..16].copy_from_slice(&self.scales);
        b[16..80].copy_from_slice(&self.qs);
        b[80..82].copy_from_slice(&self.d.to_le_bytes());
        b[82..].copy_from_slice(&self.dmin.to_le_bytes());
        b
    }

    pub fn dequantize(&self, y: &mut [f32; QK_K]) {
        let d = f16_to_f32(self.d);
        let min = f16_to_f32(self.dmin);
        let mut out = y.iter_mut();
        for (half, q) in self.qs.chunks_exact(32).enumerate() {
            for shift in [0u32, 2, 4, 6] {
                for part in 0..2 {
                    let sc = self.scales[half * 8 + (shift as usize / 2) * 2 + part];
                    let dl = d * f32::from(sc & 0x0f);
                    let ml = min * f32::from(sc >> 4);
                    for &byte in &q[16 * part..16 * part + 16] {
                        if let Some(o) = out.next() {
                            *o = dl * f32::from((byte >> shift) & 3) - ml;
                        }
                    }
                }
            }
        }
    }

    /// ggml's `quantize_row_q2_K_ref`.
    pub fn quantize(x: &[f32; QK_K]) -> Self {
        const Q4SCALE: f32 = 15.0;
        let mut l = [0u8; QK_K];
        let mut scales = [0f32; 16];
        let mut mins = [0f32; 16];
        let (mut max_scale, mut max_min) = (0f32, 0f32);
        for j in 0..16 {
            let xs = &x[16 * j..16 * j + 16];
            let mut weights = [0f32; 16];
            for (w, &v) in weights.iter_mut().zip(xs) {
                *w = v.abs();
            }
            let (scale, min) = fit_scale_min(
                3,
                xs,
                &weights,
                &mut l[16 * j..16 * j + 16],
                -0.5,
                0.1,
                15,
                true,
            );
            scales[j] = scale;
            mins[j] = min;
            if scale > max_scale {
                max_scale = scale;
            }
            if min > max_min {
                max_min = min;
            }
        }
        let mut sc = [0u8; 16];
        let d = if max_scale > 0.0 {
            let iscale = Q4SCALE / max_scale;
            for (s, &v) in sc.iter_mut().zip(&scales) {
                *s = nearest_int(iscale * v) as u8;
            }
            f32_to_f16(max_scale / Q4SCALE)
        } else {
            f32_to_f16(0.0)
        };
        let dmin = if max_min > 0.0 {
            let iscale = Q4SCALE / max_min;
            for (s, &v) in sc.iter_mut().zip(&mins) {
                *s |= nearest_int(iscale * v).wrapping_shl(4) as u8;
            }
            f32_to_f16(max_min / Q4SCALE)
        } else {
            f32_to_f16(0.0)
        };
        for ((&s, xs), ls) in sc
            .iter()
            .zip(x.chunks_exact(16))
            .zip(l.chunks_exact_mut(16))
        {
            let dj = f16_to_f32(d) * f32::from(s & 0x0f);
            if dj == 0.0 {
                continue;
            }
            let dm = f16_to_f32(dmin) * f32::from(s >> 4);
            for (q, &v) in ls.iter_mut().zip(xs) {
                *q = nearest_int((v + dm) / dj).clamp(0, 3) as u8;
            }
        }
        let mut qs = [0u8; 64];
        pack_2bit(&l, &mut qs);
        Self {
            scales: sc,
            qs,
            d,
            dmin,
        }
    }
}

/// `block_q3_K`: 16 sub-blocks of 16, `w = d*(sc - 32)*(q - 4)`, 3-bit `q` (2 low bits in `qs`,
/// the high bit in `hmask`), 6-bit `sc` packed in 12 bytes (see [`scale_q3k`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(C)]
pub struct BlockQ3K {
    /// High bits: bit `b` of byte `m` belongs to weight `32*b + m`.
    pub hmask: [u8; 32],
    /// Low 2 bits, four planes per 128 weights.
    pub qs: [u8; 64],
    /// Packed 6-bit scales.
    pub scales: [u8; 12],
    /// Super-block scale (f16 bits).
    pub d: u16,
}

impl BlockQ3K {
    pub const SIZE: usize = 110;
    pub const OFFSET_HMASK: usize = 0;
    pub const OFFSET_QS: usize = 32;
    pub const OFFSET_SCALES: usize = 96;
    pub const OFFSET_D: usize = 108;

    pub fn from_bytes(b: &[u8; Self::SIZE]) -> Self {
        Self {
            hmask: sub_array(b, Self::OFFSET_HMASK),
            qs: sub_array(b, Self::OFFSET_QS),
            scales: sub_array(b, Self::OFFSET_SCALES),
            d: le_u16(b, Self::OFFSET_D),
        }
    }

    pub fn to_bytes(&self) -> [u8; Self::SIZE] {
        let mut b = [0u8; Self::SIZE];
        b[..32].copy_from_slice(&self.hmask);
        b[32..96].copy_from_slice(&self.qs);
        b[96..108].copy_from_slice(&self.scales);
        b[108..].copy_from_slice(&self.d.to_le_bytes());
        b
    }

    pub fn dequantize(&self, y: &mut [f32; QK_K]) {
        let d_all = f16_to_f32(self.d);
        let mut out = y.iter_mut();
        let mut sub = 0;
        let mut bit = 0u32;
        for q in self.qs.chunks_exact(32) {
            for shift in [0u32, 2, 4, 6] {
                for part in 0..2 {
                    let dl = d_all * (i32::from(scale_q3k(sub, &self.scales)) - 32) as f32;
                    sub += 1;
                    let range = 16 * part..16 * part + 16;
                    for (&qb, &hb) in q[range.clone()].iter().zip(&self.hmask[range]) {
                        let low = i32::from((qb >> shift) & 3);
                        let high_clear = hb & (1 << bit) == 0;
                        let v = low - if high_clear { 4 } else { 0 };
                        if let Some(o) = out.next() {
                            *o = dl * v as f32;
                        }
                    }
                }
                bit += 1;
            }
        }
    }

    /// ggml's `quantize_row_q3_K_ref`.
    pub fn quantize(x: &[f32; QK_K]) -> Self {
        let mut l = [0i8; QK_K];
        let mut scales = [0f32; 16];
        let (mut amax, mut max_scale) = (0f32, 0f32);
        for j in 0..16 {
            let xs: &[f32; 16] = match x[16 * j..16 * j + 16].try_into() {
                Ok(xs) => xs,
                Err(_) => continue,
            };
            scales[j] = fit_q3(4, xs, &mut l[16 * j..16 * j + 16]);
            let scale = scales[j].abs();
            if scale > amax {
                amax = scale;
                max_scale = scales[j];
            }
        }
        let mut packed = [0u8; 12];
        let d = if max_scale != 0.0 {
            let iscale = -32.0 / max_scale;
            for (j, &s) in scales.iter().enumerate() {
                // C stores nearest_int() into an int8_t first, then clamps and biases.
                let v = (i32::from(nearest_int(iscale * s) as i8).clamp(-32, 31) + 32) as u8;
                pack_scale_q3k(&mut packed, j, v);
            }
            f32_to_f16(1.0 / iscale)
        } else {
            f32_to_f16(0.0)
        };
        Self::with_scales(x, &mut l, packed, d)
    }

    /// The block for `x` given its packed scales and super-block scale `d`: each
    /// sub-block's codes re-derived from `x` with the final (rounded) scales, as both of
    /// ggml's Q3_K quantizers end; `l` keeps the first fit's codes where a scale is zero.
    pub(crate) fn with_scales(
        x: &[f32; QK_K],
        l: &mut [i8; QK_K],
        packed: [u8; 12],
        d: u16,
    ) -> Self {
        for j in 0..16 {
            let sc = i32::from(scale_q3k(j, &packed)) - 32;
            let dj = f16_to_f32(d) * sc as f32;
            if dj == 0.0 {
                continue;
            }
            for i in 16 * j..16 * j + 16 {
                l[i] = (nearest_int(x[i] / dj).clamp(-4, 3) + 4) as i8;
            }
        }
        let mut hmask = [0u8; 32];
        let mut low = [0u8; QK_K];
        for (j, (&q, lo)) in l.iter().zip(low.iter_mut()).enumerate() {
            let mut q = q as u8;
            if q > 3 {
                hmask[j % 32] |= 1 << (j / 32);
                q -= 4;
            }
            *lo = q;
        }
        let mut qs = [0u8; 64];
        pack_2bit(&low, &mut qs);
        Self {
            hmask,
            qs,
            scales: packed,
            d,
        }
    }
}

/// `block_q4_K`: 8 sub-blocks of 32, `w = d*sc*q - dmin*m`, 4-bit `q`, 6-bit `sc`/`m` (see
/// [`scale_min_k4`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(C)]
pub struct BlockQ4K {
    /// Super-block scale for the scales (f16 bits).
    pub d: u16,
    /// Super-block scale for the mins (f16 bits).
    pub dmin: u16,
    /// Packed 6-bit scales and mins.
    pub scales: [u8; K_SCALE_SIZE],
    /// Nibbles: byte `l` of each 32 holds weights `l` (low) and `l + 32` (high) of each 64.
    pub qs: [u8; 128],
}

impl BlockQ4K {
    pub const SIZE: usize = 144;
    pub const OFFSET_D: usize = 0;
    pub const OFFSET_DMIN: usize = 2;
    pub const OFFSET_SCALES: usize = 4;
    pub const OFFSET_QS: usize = 16;

    pub fn from_bytes(b: &[u8; Self::SIZE]) -> Self {
        Self {
            d: le_u16(b, Self::OFFSET_D),
            dmin: le_u16(b, Self::OFFSET_DMIN),
            scales: sub_array(b, Self::OFFSET_SCALES),
            qs: sub_array(b, Self::OFFSET_QS),
        }
    }

    pub fn to_bytes(&self) -> [u8; Self::SIZE] {
        let mut b = [0u8; Self::SIZE];
        b[..2].copy_from_slice(&self.d.to_le_bytes());
        b[2..4].copy_from_slice(&self.dmin.to_le_bytes());
        b[4..16].copy_from_slice(&self.scales);
        b[16..].copy_from_slice(&self.qs);
        b
    }

    pub fn dequantize(&self, y: &mut [f32; QK_K]) {
        let d = f16_to_f32(self.d);
        let min = f16_to_f32(self.dmin);
        for (pair, (q, y)) in self
            .qs
            .chunks_exact(32)
            .zip(y.chunks_exact_mut(64))
            .enumerate()
        {
            let (sc1, m1) = scale_min_k4(2 * pair, &self.scales);
            let (sc2, m2) = scale_min_k4(2 * pair + 1, &self.scales);
            let (d1, m1) = (d * f32::from(sc1), min * f32::from(m1));
            let (d2, m2) = (d * f32::from(sc2), min * f32::from(m2));
            for (i, &byte) in q.iter().enumerate() {
                y[i] = d1 * f32::from(byte & 0x0f) - m1;
                y[i + 32] = d2 * f32::from(byte >> 4) - m2;
            }
        }
    }

    /// ggml's `quantize_row_q4_K_ref`.
    pub fn quantize(x: &[f32; QK_K]) -> Self {
        let (d, dmin, scales, l) = quantize_k4_family(x, 15, -1.0, 20);
        let mut qs = [0u8; 128];
        for (chunk, out) in qs.chunks_exact_mut(32).enumerate() {
            let base = 64 * chunk;
            for (i, q) in out.iter_mut().enumerate() {
                *q = l[base + i] | (l[base + i + 32] << 4);
            }
        }
        Self {
            d,
            dmin,
            scales,
            qs,
        }
    }
}

/// `block_q5_K`: like Q4_K with a fifth bit per weight in `qh`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(C)]
pub struct BlockQ5K {
    /// Super-block scale for the scales (f16 bits).
    pub d: u16,
    /// Super-block scale for the mins (f16 bits).
    pub dmin: u16,
    /// Packed 6-bit scales and mins.
    pub scales: [u8; K_SCALE_SIZE],
    /// Fifth bits: for weights `64*c + l` and `64*c + l + 32`, bits `2c` and `2c + 1` of `qh[l]`.
    pub qh: [u8; 32],
    /// Low nibbles, laid out as Q4_K's `qs`.
    pub qs: [u8; 128],
}

impl BlockQ5K {
    pub const SIZE: usize = 176;
    pub const OFFSET_D: usize = 0;
    pub const OFFSET_DMIN: usize = 2;
    pub const OFFSET_SCALES: usize = 4;
    pub const OFFSET_QH: usize = 16;
    pub const OFFSET_QS: usize = 48;

    pub fn from_bytes(b: &[u8; Self::SIZE]) -> Self {
        Self {
            d: le_u16(b, Self::OFFSET_D),
            dmin: le_u16(b, Self::OFFSET_DMIN),
            scales: sub_array(b, Self::OFFSET_SCALES),
            qh: sub_array(b, Self::OFFSET_QH),
            qs: sub_array(b, Self::OFFSET_QS),
        }
    }

    pub fn to_bytes(&self) -> [u8; Self::SIZE] {
        let mut b = [0u8; Self::SIZE];
        b[..2].copy_from_slice(&self.d.to_le_bytes());
        b[2..4].copy_from_slice(&self.dmin.to_le_bytes());
        b[4..16].copy_from_slice(&self.scales);
        b[16..48].copy_from_slice(&self.qh);
        b[48..].copy_from_slice(&self.qs);
        b
    }

    pub fn dequantize(&self, y: &mut [f32; QK_K]) {
        let d = f16_to_f32(self.d);
        let min = f16_to_f32(self.dmin);
        for (pair, (q, y)) in self
            .qs
            .chunks_exact(32)
            .zip(y.chunks_exact_mut(64))
            .enumerate()
        {
            let (sc1, m1) = scale_min_k4(2 * pair, &self.scales);
            let (sc2, m2) = scale_min_k4(2 * pair + 1, &self.scales);
            let (d1, m1) = (d * f32::from(sc1), min * f32::from(m1));
            let (d2, m2) = (d * f32::from(sc2), min * f32::from(m2));
            let (u1, u2) = (1u8 << (2 * pair), 2u8 << (2 * pair));
            for (i, &byte) in q.iter().enumerate() {
                let h1 = if self.qh[i] & u1 != 0 { 16 } else { 0 };
                let h2 = if self.qh[i] & u2 != 0 { 16 } else { 0 };
                y[i] = d1 * f32::from((byte & 0x0f) + h1) - m1;
                y[i + 32] = d2 * f32::from((byte >> 4) + h2) - m2;
            }
        }
    }

    /// ggml's `quantize_row_q5_K_ref`.
    pub fn quantize(x: &[f32; QK_K]) -> Self {
        let (d, dmin, scales, l) = quantize_k4_family(x, 31, -0.5, 15);
        let mut qh = [0u8; 32];
        let mut qs = [0u8; 128];
        for (chunk, out) in qs.chunks_exact_mut(32).enumerate() {
            let base = 64 * chunk;
            let (m1, m2) = (1u8 << (2 * chunk), 2u8 << (2 * chunk));
            for (i, q) in out.iter_mut().enumerate() {
                let (mut l1, mut l2) = (l[base + i], l[base + i + 32]);
                if l1 > 15 {
                    l1 -= 16;
                    qh[i] |= m1;
                }
                if l2 > 15 {
                    l2 -= 16;
                    qh[i] |= m2;
                }
                *q = l1 | (l2 << 4);
            }
        }
        Self {
            d,
            dmin,
            scales,
            qh,
            qs,
        }
    }
}

/// `block_q6_K`: 16 sub-blocks of 16, `w = d*sc*(q - 32)`, 6-bit `q`, `sc` a signed byte.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(C)]
pub struct BlockQ6K {
    /// Low 4 bits: per 128 weights, `ql[l]` = weights `l` | `l+64` << 4, `ql[l+32]` = `l+32` |
    /// `l+96` << 4.
    pub ql: [u8; 128],
    /// High 2 bits, four planes per 128 weights.
    pub qh: [u8; 64],
    /// Sub-block scales.
    pub scales: [i8; 16],
    /// Super-block scale (f16 bits).
    pub d: u16,
}

impl BlockQ6K {
    pub const SIZE: usize = 210;
    pub const OFFSET_QL: usize = 0;
    pub const OFFSET_QH: usize = 128;
    pub const OFFSET_SCALES: usize = 192;
    pub const OFFSET_D: usize = 208;

    pub fn from_bytes(b: &[u8; Self::SIZE]) -> Self {
        let sc: [u8; 16] = sub_array(b, Self::OFFSET_SCALES);
        Self {
            ql: sub_array(b, Self::OFFSET_QL),
            qh: sub_array(b, Self::OFFSET_QH),
            scales: sc.map(|v| v as i8),
            d: le_u16(b, Self::OFFSET_D),
        }
    }

    pub fn to_bytes(&self) -> [u8; Self::SIZE] {
        let mut b = [0u8; Self::SIZE];
        b[..128].copy_from_slice(&self.ql);
        b[128..192].copy_from_slice(&self.qh);
        b[192..208].copy_from_slice(&self.scales.map(|v| v as u8));
        b[208..].copy_from_slice(&self.d.to_le_bytes());
        b
    }

    pub fn dequantize(&self, y: &mut [f32; QK_K]) {
        let d = f16_to_f32(self.d);
        for half in 0..2 {
            let ql = &self.ql[64 * half..64 * half + 64];
            let qh = &self.qh[32 * half..32 * half + 32];
            let sc = &self.scales[8 * half..8 * half + 8];
            let y = &mut y[128 * half..128 * half + 128];
            for l in 0..32 {
                let is = l / 16;
                let q1 = i32::from((ql[l] & 0x0f) | ((qh[l] & 3) << 4)) - 32;
                let q2 = i32::from((ql[l + 32] & 0x0f) | (((qh[l] >> 2) & 3) << 4)) - 32;
                let q3 = i32::from((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
                let q4 = i32::from((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
                y[l] = d * f32::from(sc[is]) * q1 as f32;
                y[l + 32] = d * f32::from(sc[is + 2]) * q2 as f32;
                y[l + 64] = d * f32::from(sc[is + 4]) * q3 as f32;
                y[l + 96] = d * f32::from(sc[is + 6]) * q4 as f32;
            }
        }
    }

    /// ggml's `quantize_row_q6_K_ref`.
    pub fn quantize(x: &[f32; QK_K]) -> Self {
        let mut l = [0i8; QK_K];
        let mut scales = [0f32; 16];
        for ib in 0..16 {
            let xs: &[f32; 16] = match x[16 * ib..16 * ib + 16].try_into() {
                Ok(xs) => xs,
                Err(_) => continue,
            };
            let scale = fit_symmetric(32, xs, &mut l[16 * ib..16 * ib + 16]);
            scales[ib] = scale;
        }
        Self::from_sub_scales(x, &scales, l)
    }

    /// The rest of ggml's Q6_K quantizers once each sub-block has its scale (and its codes
    /// `l`, kept where a sub-block's rounded scale is 0): 8-bit sub-block scales relative to
    /// `d`, then every code again against the rounded scales.
    pub(crate) fn from_sub_scales(x: &[f32; QK_K], scales: &[f32; 16], mut l: [i8; QK_K]) -> Self {
        let (mut max_scale, mut max_abs_scale) = (0f32, 0f32);
        for &scale in scales {
            if scale.abs() > max_abs_scale {
                max_abs_scale = scale.abs();
                max_scale = scale;
            }
        }
        if max_abs_scale < GROUP_MAX_EPS {
            return Self {
                ql: [0; 128],
                qh: [0; 64],
                scales: [0; 16],
                d: f32_to_f16(0.0),
            };
        }
        let iscale = -128.0 / max_scale;
        let d = f32_to_f16(1.0 / iscale);
        let mut sc = [0i8; 16];
        for (s, &v) in sc.iter_mut().zip(scales.iter()) {
            *s = nearest_int(iscale * v).min(127) as i8;
        }
        for ((&s, xs), ls) in sc
            .iter()
            .zip(x.chunks_exact(16))
            .zip(l.chunks_exact_mut(16))
        {
            let dj = f16_to_f32(d) * f32::from(s);
            if dj == 0.0 {
                continue;
            }
            for (q, &v) in ls.iter_mut().zip(xs) {
                *q = (nearest_int(v / dj).clamp(-32, 31) + 32) as i8;
            }
        }
        let mut ql = [0u8; 128];
        let mut qh = [0u8; 64];
        for half in 0..2 {
            let lh = &l[128 * half..128 * half + 128];
            for i in 0..32 {
                let q = |k: usize| lh[i + 32 * k] as u8;
                ql[64 * half + i] = (q(0) & 0x0f) | ((q(2) & 0x0f) << 4);
                ql[64 * half + i + 32] = (q(1) & 0x0f) | ((q(3) & 0x0f) << 4);
                qh[32 * half + i] =
                    (q(0) >> 4) | ((q(1) >> 4) << 2) | ((q(2) >> 4) << 4) | ((q(3) >> 4) << 6);
            }
        }
        Self {
            ql,
            qh,
            scales: sc,
            d,
        }
    }
}

/// `block_q8_K`: 256 weights `d * q` with an f32 scale and the sums of each 16 quants (used by
/// the k-quant dot products as the activation side).
#[derive(Clone, Copy, Debug, PartialEq)]
#[repr(C)]
pub struct BlockQ8K {
    /// Scale.
    pub d: f32,
    /// Quants.
    pub qs: [i8; QK_K],
    /// Sum of each group of 16 quants.
    pub bsums: [i16; 16],
}

impl BlockQ8K {
    pub const SIZE: usize = 292;
    pub const OFFSET_D: usize = 0;
    pub const OFFSET_QS: usize = 4;
    pub const OFFSET_BSUMS: usize = 260;

    pub fn from_bytes(b: &[u8; Self::SIZE]) -> Self {
        let qs: [u8; QK_K] = sub_array(b, Self::OFFSET_QS);
        let mut bsums = [0i16; 16];
        for (k, s) in bsums.iter_mut().enumerate() {
            *s = le_u16(b, Self::OFFSET_BSUMS + 2 * k) as i16;
        }
        Self {
            d: f32::from_le_bytes(sub_array(b, Self::OFFSET_D)),
            qs: qs.map(|v| v as i8),
            bsums,
        }
    }

    pub fn to_bytes(&self) -> [u8; Self::SIZE] {
        let mut b = [0u8; Self::SIZE];
        b[..4].copy_from_slice(&self.d.to_le_bytes());
        b[4..260].copy_from_slice(&self.qs.map(|v| v as u8));
        for (k, s) in self.bsums.iter().enumerate() {
            b[260 + 2 * k..262 + 2 * k].copy_from_slice(&s.to_le_bytes());
        }
        b
    }

    pub fn dequantize(&self, y: &mut [f32; QK_K]) {
        for (y, &q) in y.iter_mut().zip(&self.qs) {
            *y = self.d * f32::from(q);
        }
    }

    /// ggml's `quantize_row_q8_K_ref` (scale `-127 / max`). For an all-zero block ggml leaves
    /// `bsums` untouched; here they are written as the zeros they should be.
    pub fn quantize(x: &[f32; QK_K]) -> Self {
        let (mut max, mut amax) = (0f32, 0f32);
        for &v in x {
            if v.abs() > amax {
                amax = v.abs();
                max = v;
            }
        }
        if amax == 0.0 {
            return Self {
                d: 0.0,
                qs: [0; QK_K],
                bsums: [0; 16],
            };
        }
        let iscale = -127.0 / max;
        let mut qs = [0i8; QK_K];
        for (q, &v) in qs.iter_mut().zip(x) {
            *q = nearest_int(iscale * v).min(127) as i8;
        }
        let mut bsums = [0i16; 16];
        for (s, group) in bsums.iter_mut().zip(qs.chunks_exact(16)) {
            *s = group.iter().map(|&q| i32::from(q)).sum::<i32>() as i16;
        }
        Self {
            d: 1.0 / iscale,
            qs,
            bsums,
        }
    }
}
