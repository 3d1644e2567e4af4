//! Quantization with an importance matrix: ggml's `quantize_q*` functions when
//! `ggml_quantize_chunk` gets `quant_weights` (what `llama-quantize --imatrix` runs).
//!
//! The importance matrix gives one weight per column of a matrix (the mean of the squared
//! activations that column multiplied, from `llama-imatrix`); every row of the matrix is
//! quantized with the same weights. The scale searches then minimise the error weighted by
//! `qw[j] · √(σ² + x[j]²)` (σ² from the row or super-block's mean square) instead of the
//! reference quantizers' own weights:
//!
//! * Q4_0, Q5_0: `make_qx_quants` (a symmetric fit over 19 candidate scales), σ² over the row;
//! * Q4_1, Q5_1: `make_qkx3_quants` (an affine fit with a minimum), σ² over the row;
//! * Q2_K, Q4_K, Q5_K: `make_qkx3_quants` per sub-block, then the sub-block scales and mins
//!   themselves by `make_qp_quants` (a weighted positive fit); σ² per super-block;
//! * Q3_K: `make_qx_quants` per sub-block and for the sub-block scales;
//! * Q6_K: `make_qx_quants` per sub-block with the importance weights as they are;
//! * IQ4_NL, IQ4_XS: the reference search with the weights above ([`super::iquants`]).
//!
//! Q8_0, F16, BF16, F32 and the other formats ignore the weights, as in ggml. The arithmetic
//! is the C code's operation by operation, each product and sum rounded on its own (see the
//! module documentation of [`super`]).

use super::iquants::{BlockIq4Nl, BlockIq4Xs};
use super::kquants::{
    pack_2bit, pack_scale_q3k, pack_scales_mins_k4, scale_min_k4, BlockQ2K, BlockQ3K, BlockQ4K,
    BlockQ5K, BlockQ6K, QK_K,
};
use super::legacy::{BlockQ4_0, BlockQ4_1, BlockQ5_0, BlockQ5_1, QK};
use super::{c_max, f16_to_f32, f32_to_f16, nearest_int, QuantError, GROUP_MAX_EPS};
use crate::types::GgmlType;

/// Whether [`quantize_rows`] uses the importance weights for `ty` (ggml has a weighted
/// quantizer for it); other types are quantized as without them.
pub fn uses_weights(ty: GgmlType) -> bool {
    use GgmlType::*;
    matches!(
        ty,
        Q4_0 | Q4_1 | Q5_0 | Q5_1 | Q2_K | Q3_K | Q4_K | Q5_K | Q6_K | IQ4_NL | IQ4_XS
    )
}

/// ggml's `ggml_quantize_chunk(ty, src, dst, 0, nrows, n_per_row, imatrix)`: `src` holds whole
/// rows of `n_per_row` values; `imatrix` (one weight per column) selects the weighted
/// quantizers. Gives the same bytes as ggml.
pub fn quantize_rows(
    ty: GgmlType,
    src: &[f32],
    dst: &mut [u8],
    n_per_row: usize,
    imatrix: Option<&[f32]>,
) -> Result<(), QuantError> {
    let Some(qw) = imatrix.filter(|_| uses_weights(ty)) else {
        return super::quantize(ty, src, dst);
    };
    if n_per_row == 0 || !n_per_row.is_multiple_of(ty.block_size()) {
        return Err(QuantError::NotBlockAligned {
            ty,
            len: n_per_row,
            multiple: ty.block_size(),
            unit: "f32 values per row",
        });
    }
    if qw.len() != n_per_row {
        return Err(QuantError::LengthMismatch {
            ty,
            blocks: n_per_row / ty.block_size(),
            expected: n_per_row,
            actual: qw.len(),
            unit: "importance weights",
        });
    }
    let row_bytes = n_per_row / ty.block_size() * ty.type_size();
    let rows = src.len() / n_per_row;
    if rows * n_per_row != src.len() {
        return Err(QuantError::NotBlockAligned {
            ty,
            len: src.len(),
            multiple: n_per_row,
            unit: "f32 values",
        });
    }
    if rows * row_bytes != dst.len() {
        return Err(QuantError::LengthMismatch {
            ty,
            blocks: rows * (n_per_row / ty.block_size()),
            expected: rows * row_bytes,
            actual: dst.len(),
            unit: "bytes",
        });
    }
    for (x, out) in src
        .chunks_exact(n_per_row)
        .zip(dst.chunks_exact_mut(row_bytes))
    {
        quantize_row(ty, x, qw, out);
    }
    Ok(())
}

/// One row (lengths checked by the caller).
fn quantize_row(ty: GgmlType, x: &[f32], qw: &[f32], out: &mut [u8]) {
    use GgmlType::*;
    match ty {
        Q4_0 | Q4_1 | Q5_0 | Q5_1 => {
            // σ² over the whole row
            let mut sum_x2 = 0f32;
            for &v in x {
                sum_x2 += v * v;
            }
            let sigma2 = sum_x2 / x.len() as f32;
            let bytes = ty.type_size();
            for ((xb, qb), ob) in x
                .chunks_exact(QK)
                .zip(qw.chunks_exact(QK))
                .zip(out.chunks_exact_mut(bytes))
            {
                let (Ok(xb), Ok(qb)) = (<&[f32; QK]>::try_from(xb), <&[f32; QK]>::try_from(qb))
                else {
                    continue;
                };
                let w = sqrt_weights(xb, qb, sigma2);
                match ty {
                    Q4_0 => ob.copy_from_slice(&q4_0(xb, &w).to_bytes()),
                    Q4_1 => ob.copy_from_slice(&q4_1(xb, &w).to_bytes()),
                    Q5_0 => ob.copy_from_slice(&q5_0(xb, &w).to_bytes()),
                    _ => ob.copy_from_slice(&q5_1(xb, &w).to_bytes()),
                }
            }
        }
        IQ4_NL => blocks(x, qw, out, |x: &[f32; 32], q: &[f32; 32]| {
            BlockIq4Nl::quantize_weighted(x, q).to_bytes()
        }),
        IQ4_XS => blocks(x, qw, out, |x: &[f32; QK_K], q: &[f32; QK_K]| {
            BlockIq4Xs::quantize_weighted(x, q).to_bytes()
        }),
        Q2_K => blocks(x, qw, out, |x, q| q2_k(x, q).to_bytes()),
        Q3_K => blocks(x, qw, out, |x, q| q3_k(x, q).to_bytes()),
        Q4_K => blocks(x, qw, out, |x, q| q4_k(x, q).to_bytes()),
        Q5_K => blocks(x, qw, out, |x, q| q5_k(x, q).to_bytes()),
        Q6_K => blocks(x, qw, out, |x, q| q6_k(x, q).to_bytes()),
        _ => {}
    }
}

/// Runs `f` on each block of `E` values, its `E` weights and its `B` output bytes.
fn blocks<const E: usize, const B: usize>(
    x: &[f32],
    qw: &[f32],
    out: &mut [u8],
    f: impl Fn(&[f32; E], &[f32; E]) -> [u8; B],
) {
    for ((xb, qb), ob) in x
        .chunks_exact(E)
        .zip(qw.chunks_exact(E))
        .zip(out.chunks_exact_mut(B))
    {
        if let (Ok(xb), Ok(qb)) = (<&[f32; E]>::try_from(xb), <&[f32; E]>::try_from(qb)) {
            ob.copy_from_slice(&f(xb, qb));
        }
    }
}

/// `qw[j] * sqrtf(sigma2 + x[j]*x[j])`.
fn sqrt_weights<const N: usize>(x: &[f32; N], qw: &[f32; N], sigma2: f32) -> [f32; N] {
    let mut w = [0f32; N];
    for ((w, &v), &q) in w.iter_mut().zip(x).zip(qw) {
        *w = q * (sigma2 + v * v).sqrt();
    }
    w
}

/// `Σ x²` in order.
fn sum_sq(x: &[f32]) -> f32 {
    let mut s = 0f32;
    for &v in x {
        s += v * v;
    }
    s
}

// ---------------------------------------------------------------------------------------------
// ggml's scale searches with explicit weights.

/// `make_qx_quants(n, nmax, x, L, 1, qw)`: a symmetric fit `x ≈ scale · (L - nmax)`, the
/// first guess `-nmax / max` and 18 more around it, keeping the best weighted fit. `l` gets
/// `L` (biased by `nmax`); returns the scale.
fn make_qx_quants(nmax: i32, x: &[f32], l: &mut [i8], w: &[f32]) -> f32 {
    let (mut max, mut amax) = (0f32, 0f32);
    for &v in x {
        let ax = v.abs();
        if ax > amax {
            amax = ax;
            max = v;
        }
    }
    if amax < GROUP_MAX_EPS {
        l[..x.len()].fill(0);
        return 0.0;
    }
    let code = |iscale: f32, v: f32| nearest_int(iscale * v).clamp(-nmax, nmax - 1);
    let mut iscale = -(nmax as f32) / max;
    let (mut sumlx, mut suml2) = (0f32, 0f32);
    for i in 0..x.len() {
        let q = code(iscale, x[i]);
        l[i] = (q + nmax) as i8;
        let q = q as f32;
        sumlx += w[i] * x[i] * q;
        suml2 += w[i] * q * q;
    }
    let mut scale = if suml2 != 0.0 { sumlx / suml2 } else { 0.0 };
    let mut best = scale * sumlx;
    for is in (-9..=9).filter(|&s| s != 0) {
        iscale = -(nmax as f32 + 0.1 * is as f32) / max;
        sumlx = 0.0;
        suml2 = 0.0;
        for i in 0..x.len() {
            let q = code(iscale, x[i]) as f32;
            sumlx += w[i] * x[i] * q;
            suml2 += w[i] * q * q;
        }
        if suml2 > 0.0 && sumlx * sumlx > best * suml2 {
            for i in 0..x.len() {
                l[i] = (code(iscale, x[i]) + nmax) as i8;
            }
            scale = sumlx / suml2;
            best = scale * sumlx;
        }
    }
    scale
}

/// `make_qkx3_quants(n, nmax, x, weights, L, &the_min, Laux, rmin, rdelta, nstep, false)`: an
/// affine fit `x ≈ scale · L + min` (`min ≤ 0`, `L` in `0..=nmax`) over `nstep + 1` candidate
/// scales, least weighted squared error. Returns `(scale, -min)`.
fn make_qkx3_quants(
    nmax: i32,
    x: &[f32],
    w: &[f32],
    l: &mut [u8],
    rmin: f32,
    rdelta: f32,
    nstep: i32,
) -> (f32, f32) {
    let n = x.len();
    let mut min = x[0];
    let mut max = x[0];
    let mut sum_w = w[0];
    let mut sum_x = sum_w * x[0];
    for i in 1..n {
        if x[i] < min {
            min = x[i];
        }
        if x[i] > max {
            max = x[i];
        }
        sum_w += w[i];
        sum_x += w[i] * x[i];
    }
    if min > 0.0 {
        min = 0.0;
    }
    if max <= min {
        l[..n].fill(0);
        return (0.0, -min);
    }
    let code = |iscale: f32, v: f32, min: f32| nearest_int(iscale * (v - min)).clamp(0, nmax);
    let mut iscale = nmax as f32 / (max - min);
    let mut scale = 1.0 / iscale;
    let mut best_mad = 0f32;
    for i in 0..n {
        let q = code(iscale, x[i], min);
        l[i] = q as u8;
        let diff = scale * q as f32 + min - x[i];
        best_mad += w[i] * (diff * diff);
    }
    if nstep < 1 {
        return (scale, -min);
    }
    let mut laux = [0u8; 32];
    for is in 0..=nstep {
        iscale = (rmin + rdelta * is as f32 + nmax as f32) / (max - min);
        let (mut sum_l, mut sum_l2, mut sum_xl) = (0f32, 0f32, 0f32);
        for i in 0..n {
            let q = code(iscale, x[i], min);
            laux[i] = q as u8;
            let q = q as f32;
            sum_l += w[i] * q;
            sum_l2 += w[i] * q * q;
            sum_xl += w[i] * q * x[i];
        }
        let det = sum_w * sum_l2 - sum_l * sum_l;
        if det > 0.0 {
            let mut this_scale = (sum_w * sum_xl - sum_x * sum_l) / det;
            let mut this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det;
            if this_min > 0.0 {
                this_min = 0.0;
                this_scale = sum_xl / sum_l2;
            }
            let mut mad = 0f32;
            for i in 0..n {
                let diff = this_scale * f32::from(laux[i]) + this_min - x[i];
                mad += w[i] * (diff * diff);
            }
            if mad < best_mad {
                l[..n].copy_from_slice(&laux[..n]);
                best_mad = mad;
                scale = this_scale;
                min = this_min;
            }
        }
    }
    (scale, -min)
}

/// `make_qp_quants(n, nmax, x, L, quant_weights)`: a fit `x ≈ scale · L` of non-negative
/// values (sub-block scales or mins) with `L` in `0..=nmax`, weighted by `w`: the best of 9
/// candidate scales, then coordinate descent. `L` is C's `uint8_t` (negative codes wrap, as
/// there). Returns the scale.
fn make_qp_quants(nmax: i32, x: &[f32], l: &mut [u8], w: &[f32]) -> f32 {
    let n = x.len();
    let mut max = 0f32;
    for &v in x {
        max = c_max(max, v);
    }
    if max < GROUP_MAX_EPS {
        l[..n].fill(0);
        return 0.0;
    }
    let mut iscale = nmax as f32 / max;
    for i in 0..n {
        l[i] = nearest_int(iscale * x[i]) as u8;
    }
    let scale = 1.0 / iscale;
    let mut best_mse = 0f32;
    for i in 0..n {
        let diff = x[i] - scale * f32::from(l[i]);
        best_mse += w[i] * diff * diff;
    }
    for is in (-4..=4).filter(|&s| s != 0) {
        let iscale_is = (0.1 * is as f32 + nmax as f32) / max;
        let scale_is = 1.0 / iscale_is;
        let mut mse = 0f32;
        for i in 0..n {
            let q = nearest_int(iscale_is * x[i]).min(nmax);
            let diff = x[i] - scale_is * q as f32;
            mse += w[i] * diff * diff;
        }
        if mse < best_mse {
            best_mse = mse;
            iscale = iscale_is;
        }
    }
    let (mut sumlx, mut suml2) = (0f32, 0f32);
    for i in 0..n {
        let q = nearest_int(iscale * x[i]).min(nmax);
        l[i] = q as u8;
        let q = q as f32;
        sumlx += w[i] * x[i] * q;
        suml2 += w[i] * q * q;
    }
    for _ in 0..5 {
        let mut n_changed = 0;
        for i in 0..n {
            let cur = f32::from(l[i]);
            let mut slx = sumlx - w[i] * x[i] * cur;
            let mut sl2 = suml2 - w[i] * cur * cur;
            if slx > 0.0 && sl2 > 0.0 {
                let new_l = nearest_int(x[i] * sl2 / slx).min(nmax);
                if new_l != i32::from(l[i]) {
                    let nl = new_l as f32;
                    slx += w[i] * x[i] * nl;
                    sl2 += w[i] * nl * nl;
                    if slx * slx * suml2 > sumlx * sumlx * sl2 {
                        l[i] = new_l as u8;
                        sumlx = slx;
                        suml2 = sl2;
                        n_changed += 1;
                    }
                }
            }
        }
        if n_changed == 0 {
            break;
        }
    }
    if suml2 > 0.0 {
        sumlx / suml2
    } else {
        0.0
    }
}

// ---------------------------------------------------------------------------------------------
// The legacy formats (`quantize_row_q{4,5}_{0,1}_impl`), one block given its weights.

fn q4_0(x: &[f32; QK], w: &[f32; QK]) -> BlockQ4_0 {
    let mut l = [0i8; QK];
    let d = make_qx_quants(8, x, &mut l, w);
    let mut qs = [0u8; 16];
    for (j, q) in qs.iter_mut().enumerate() {
        *q = (l[j] as u8) | ((l[j + 16] as u8) << 4);
    }
    BlockQ4_0 {
        d: f32_to_f16(d),
        qs,
    }
}

fn q4_1(x: &[f32; QK], w: &[f32; QK]) -> BlockQ4_1 {
    let mut l = [0u8; QK];
    let (d, min) = make_qkx3_quants(15, x, w, &mut l, -0.9, 0.05, 36);
    let mut qs = [0u8; 16];
    for (j, q) in qs.iter_mut().enumerate() {
        *q = l[j] | (l[j + 16] << 4);
    }
    BlockQ4_1 {
        d: f32_to_f16(d),
        m: f32_to_f16(-min),
        qs,
    }
}

/// Low nibbles and fifth bits of 32 five-bit codes, as Q5_0 / Q5_1 store them.
fn pack5(l: &[u8; QK]) -> ([u8; 16], [u8; 4]) {
    let mut qs = [0u8; 16];
    let mut qh = 0u32;
    for j in 0..16 {
        let (x0, x1) = (l[j], l[j + 16]);
        qs[j] = (x0 & 0x0f) | ((x1 & 0x0f) << 4);
        qh |= u32::from((x0 & 0x10) >> 4) << j;
        qh |= u32::from((x1 & 0x10) >> 4) << (j + 16);
    }
    (qs, qh.to_le_bytes())
}

fn q5_0(x: &[f32; QK], w: &[f32; QK]) -> BlockQ5_0 {
    let mut l = [0i8; QK];
    let d = make_qx_quants(16, x, &mut l, w);
    let (qs, qh) = pack5(&l.map(|v| v as u8));
    BlockQ5_0 {
        d: f32_to_f16(d),
        qh,
        qs,
    }
}

fn q5_1(x: &[f32; QK], w: &[f32; QK]) -> BlockQ5_1 {
    let mut l = [0u8; QK];
    let (d, min) = make_qkx3_quants(31, x, w, &mut l, -0.9, 0.05, 36);
    let (qs, qh) = pack5(&l);
    BlockQ5_1 {
        d: f32_to_f16(d),
        m: f32_to_f16(-min),
        qh,
        qs,
    }
}

// ---------------------------------------------------------------------------------------------
// The k-quants (`quantize_row_q{2..6}_K_impl`), one super-block given its importance weights.

fn q2_k(x: &[f32; QK_K], qw: &[f32; QK_K]) -> BlockQ2K {
    let mut l = [0u8; QK_K];
    let mut scales = [0f32; 16];
    let mut mins = [0f32; 16];
    let mut sw = [0f32; 16];
    let sigma2 = sum_sq(x) / QK_K as f32;
    for j in 0..16 {
        let xs = &x[16 * j..16 * j + 16];
        let mut weight = [0f32; 16];
        for i in 0..16 {
            weight[i] = qw[16 * j + i] * (sigma2 + xs[i] * xs[i]).sqrt();
        }
        for &v in &weight {
            sw[j] += v;
        }
        let (s, m) = make_qkx3_quants(3, xs, &weight, &mut l[16 * j..16 * j + 16], -0.9, 0.05, 36);
        scales[j] = s;
        mins[j] = m;
    }
    let (mut ls, mut lm) = ([0u8; 16], [0u8; 16]);
    let dm = make_qp_quants(15, &scales, &mut ls, &sw);
    let mm = make_qp_quants(15, &mins, &mut lm, &sw);
    let d = f32_to_f16(dm);
    let dmin = f32_to_f16(mm);
    let (dm, mm) = (f16_to_f32(d), f16_to_f32(dmin));
    let mut sc = [0u8; 16];
    for j in 0..16 {
        sc[j] = ls[j] | (lm[j] << 4);
    }
    for (j, &s) in sc.iter().enumerate() {
        let dj = dm * f32::from(s & 0x0f);
        if dj == 0.0 {
            continue;
        }
        let m = mm * f32::from(s >> 4);
        for i in 16 * j..16 * j + 16 {
            l[i] = nearest_int((x[i] + m) / dj).clamp(0, 3) as u8;
        }
    }
    let mut qs = [0u8; 64];
    pack_2bit(&l, &mut qs);
    BlockQ2K {
        scales: sc,
        qs,
        d,
        dmin,
    }
}

fn q3_k(x: &[f32; QK_K], qw: &[f32; QK_K]) -> BlockQ3K {
    let mut l = [0i8; QK_K];
    let mut scales = [0f32; 16];
    let mut sw = [0f32; 16];
    let sigma2 = 2.0 * sum_sq(x) / QK_K as f32;
    for j in 0..16 {
        let xs = &x[16 * j..16 * j + 16];
        let mut weight = [0f32; 16];
        for i in 0..16 {
            weight[i] = qw[16 * j + i] * (sigma2 + xs[i] * xs[i]).sqrt();
        }
        let mut sumw = 0f32;
        for &v in &weight {
            sumw += v;
        }
        sw[j] = sumw;
        scales[j] = make_qx_quants(4, xs, &mut l[16 * j..16 * j + 16], &weight);
    }
    let mut ls = [0i8; 16];
    let d_block = make_qx_quants(32, &scales, &mut ls, &sw);
    let mut packed = [0u8; 12];
    for (j, &v) in ls.iter().enumerate() {
        pack_scale_q3k(&mut packed, j, v as u8);
    }
    BlockQ3K::with_scales(x, &mut l, packed, f32_to_f16(d_block))
}

/// Q4_K / Q5_K: per 32 values an affine fit with weights `qw·√(σ²+x²)`, the eight scales and
/// mins fitted to 6 bits by `make_qp_quants`, then every code against the rounded scales.
/// Returns `(d, dmin, packed scales, L)`.
fn k4_family(
    x: &[f32; QK_K],
    qw: &[f32; QK_K],
    nmax: i32,
    clamp63: bool,
) -> (u16, u16, [u8; 12], [u8; QK_K]) {
    let mut l = [0u8; QK_K];
    let mut scales = [0f32; 8];
    let mut mins = [0f32; 8];
    let mut sw = [0f32; 8];
    let sigma2 = 2.0 * sum_sq(x) / QK_K as f32;
    for j in 0..8 {
        let xs = &x[32 * j..32 * j + 32];
        let mut weights = [0f32; 32];
        for i in 0..32 {
            weights[i] = qw[32 * j + i] * (sigma2 + xs[i] * xs[i]).sqrt();
        }
        let mut sumw = 0f32;
        for &v in &weights {
            sumw += v;
        }
        sw[j] = sumw;
        let (s, m) = make_qkx3_quants(
            nmax,
            xs,
            &weights,
            &mut l[32 * j..32 * j + 32],
            -0.9,
            0.05,
            36,
        );
        scales[j] = s;
        mins[j] = m;
    }
    let (mut ls, mut lm) = ([0u8; 8], [0u8; 8]);
    let d_block = make_qp_quants(63, &scales, &mut ls, &sw);
    let m_block = make_qp_quants(63, &mins, &mut lm, &sw);
    if clamp63 {
        for v in ls.iter_mut().chain(lm.iter_mut()) {
            *v = (*v).min(63);
        }
    }
    let packed = pack_scales_mins_k4(&ls, &lm);
    let d = f32_to_f16(d_block);
    let dmin = f32_to_f16(m_block);
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

fn q4_k(x: &[f32; QK_K], qw: &[f32; QK_K]) -> BlockQ4K {
    let (d, dmin, scales, l) = k4_family(x, qw, 15, false);
    let mut qs = [0u8; 128];
    for (chunk, out) in qs.chunks_exact_mut(32).enumerate() {
        let base = 64 * chunk;
        for (i, q) in out.iter_mut().enumerate() {
            *q = l[base + i] | (l[base + i + 32] << 4);
        }
    }
    BlockQ4K {
        d,
        dmin,
        scales,
        qs,
    }
}

fn q5_k(x: &[f32; QK_K], qw: &[f32; QK_K]) -> BlockQ5K {
    let (d, dmin, scales, l) = k4_family(x, qw, 31, true);
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
    BlockQ5K {
        d,
        dmin,
        scales,
        qh,
        qs,
    }
}

fn q6_k(x: &[f32; QK_K], qw: &[f32; QK_K]) -> BlockQ6K {
    let mut l = [0i8; QK_K];
    let mut scales = [0f32; 16];
    for (ib, scale) in scales.iter_mut().enumerate() {
        let r = 16 * ib..16 * ib + 16;
        *scale = make_qx_quants(32, &x[r.clone()], &mut l[r.clone()], &qw[r]);
    }
    BlockQ6K::from_sub_scales(x, &scales, l)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lengths_are_checked() {
        let x = vec![0.5f32; 512];
        let mut out = vec![0u8; 2 * 144];
        assert!(quantize_rows(GgmlType::Q4_K, &x, &mut out, 256, Some(&[1.0; 255])).is_err());
        assert!(quantize_rows(GgmlType::Q4_K, &x, &mut out, 256, Some(&[1.0; 256])).is_ok());
        assert!(quantize_rows(GgmlType::Q4_K, &x, &mut out[1..], 256, Some(&[1.0; 256])).is_err());
        // types without a weighted quantizer ignore the weights
        let mut a = vec![0u8; 16 * 34];
        let mut b = vec![0u8; 16 * 34];
        quantize_rows(GgmlType::Q8_0, &x, &mut a, 256, Some(&[2.0; 256])).unwrap();
        super::super::quantize(GgmlType::Q8_0, &x, &mut b).unwrap();
        assert_eq!(a, b);
    }
}
