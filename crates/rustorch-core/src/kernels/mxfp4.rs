//! MXFP4 weights times activations, as llama.cpp's CPU backend multiplies them on x86 with
//! AVX2 (the reference machine has AVX-512; these kernels have no AVX-512 variant).
//! Activations are encoded as Q8_0 blocks (ggml-cpu's x86 encoder, see `qact`), and each
//! 32-weight block's integer dot product with its activation block is exact in i32 (the
//! codes are the doubled E2M1 values [`KVALUES_MXFP4`], the scale halved accordingly,
//! [`e8m0_to_f32_half`]). The float order depends on how llama.cpp stores the matrix:
//!
//! * a matrix whose row count is a multiple of 8 (every MoE expert matrix: both of its
//!   dimensions are multiples of the 32-weight block) is repacked into panels of 8 rows
//!   (`mxfp4_8x8`), and its gemv and gemm kernels (`gemv_q4_b32_8x8_q8_0_lut_avx`,
//!   `mul_mat_id` taking the gemv for every routed row) give each output
//!   `acc = fma(f32(Σ w·a), e8m0_half(e) · d_a, acc)`, one block after the other;
//! * any other matrix goes through `ggml_vec_dot_mxfp4_q8_0`: blocks in pairs, each
//!   block's 32 products summed four at a time into 8 lanes, `lane = fma(d_a · scale,
//!   f32(lane sum), lane)` with even blocks in one 8-lane accumulator and odd ones in a
//!   second, reduced by `hsum_float_8` of their sum; an odd last block is added as
//!   `sum + d · f32(Σ)` (that line is not contracted in the build).

use super::{each_output, Isa, QActs, QMatrix, ThreadPool};
use crate::quant::grids::KVALUES_MXFP4;
use crate::quant::mxfp4::e8m0_to_f32_half;
use crate::quant::{f16_to_f32, QuantError};
use crate::types::GgmlType;

/// Bytes of an MXFP4 block (scale byte + 16 bytes of codes) and of a Q8_0 block.
const MX: usize = 17;
const Q8: usize = 34;

/// `out[t][r] = w[r] · x[t]` for the `x.len() / w.n_cols` rows of `x`, with llama.cpp's
/// arithmetic for this matrix (see the module documentation).
pub(crate) fn matmul(
    pool: &ThreadPool,
    isa: Isa,
    w: &QMatrix<'_>,
    x: &[f32],
    out: &mut [f32],
    qa: &mut QActs,
) -> Result<(), QuantError> {
    qa.quantize(Some(pool), isa, GgmlType::Q8_0, x, w.n_cols)?;
    let (n_rows, n_tok, nb) = (w.n_rows, qa.n_rows, w.n_cols / 32);
    let repacked = n_rows.is_multiple_of(8);
    let qa = &*qa;
    each_output(pool, n_rows, n_tok, out, &|r, t| {
        if repacked {
            dot_repacked(w.row(r), qa.row(t), nb)
        } else {
            dot_vec(w.row(r), qa.row(t), nb)
        }
    });
    Ok(())
}

/// The 8 lane sums of one block pair's products: lane `l` holds elements `4l..4l + 4`
/// (elements 0-15 are the low nibbles, 16-31 the high ones).
#[inline(always)]
fn lanes(w: &[u8], a: &[u8]) -> [i32; 8] {
    let mut lanes = [0i32; 8];
    for (j, &b) in w[1..MX].iter().enumerate() {
        let lo = KVALUES_MXFP4[(b & 0x0f) as usize] as i32 * a[2 + j] as i8 as i32;
        let hi = KVALUES_MXFP4[(b >> 4) as usize] as i32 * a[2 + 16 + j] as i8 as i32;
        lanes[j / 4] += lo;
        lanes[4 + j / 4] += hi;
    }
    lanes
}

/// The activation block's scale times the weight block's.
#[inline(always)]
fn scale(w: &[u8], a: &[u8]) -> f32 {
    f16_to_f32(u16::from_le_bytes([a[0], a[1]])) * e8m0_to_f32_half(w[0])
}

/// One output of the repacked gemv/gemm kernels.
pub(crate) fn dot_repacked(w: &[u8], a: &[u8], nb: usize) -> f32 {
    let mut acc = 0f32;
    for b in 0..nb {
        let (wb, ab) = (&w[b * MX..(b + 1) * MX], &a[b * Q8..(b + 1) * Q8]);
        let sum: i32 = lanes(wb, ab).iter().sum();
        acc = (sum as f32).mul_add(scale(wb, ab), acc);
    }
    acc
}

/// `ggml_vec_dot_mxfp4_q8_0` (AVX2).
pub(crate) fn dot_vec(w: &[u8], a: &[u8], nb: usize) -> f32 {
    let mut acc = [[0f32; 8]; 2];
    let mut b = 0;
    while b + 1 < nb {
        for (k, lanes_acc) in acc.iter_mut().enumerate() {
            let (wb, ab) = (
                &w[(b + k) * MX..(b + k + 1) * MX],
                &a[(b + k) * Q8..(b + k + 1) * Q8],
            );
            let d = scale(wb, ab);
            for (l, s) in lanes(wb, ab).iter().enumerate() {
                lanes_acc[l] = d.mul_add(*s as f32, lanes_acc[l]);
            }
        }
        b += 2;
    }
    let v: [f32; 8] = std::array::from_fn(|l| acc[0][l] + acc[1][l]);
    // hsum_float_8
    let mut sum = ((v[0] + v[4]) + (v[2] + v[6])) + ((v[1] + v[5]) + (v[3] + v[7]));
    if b < nb {
        let (wb, ab) = (&w[b * MX..(b + 1) * MX], &a[b * Q8..(b + 1) * Q8]);
        let s: i32 = lanes(wb, ab).iter().sum();
        sum += scale(wb, ab) * s as f32;
    }
    sum
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant;

    /// Both orders agree with the dequantized product up to rounding, and differ from each
    /// other only in rounding.
    #[test]
    fn mxfp4_products_match_dequantized() {
        let n = 96; // 3 blocks: a pair and an odd one
        let mut seed = 7u32;
        let mut rnd = || {
            seed = seed.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            (seed >> 8) as f32 / (1u32 << 24) as f32 - 0.5
        };
        let wf: Vec<f32> = (0..n).map(|_| rnd() * 3.0).collect();
        let xf: Vec<f32> = (0..n).map(|_| rnd()).collect();
        let mut w = vec![0u8; n / 32 * MX];
        quant::quantize(GgmlType::MXFP4, &wf, &mut w).expect("mxfp4");
        let mut a = vec![0u8; n / 32 * Q8];
        quant::quantize(GgmlType::Q8_0, &xf, &mut a).expect("q8_0");
        let mut wd = vec![0f32; n];
        quant::dequantize(GgmlType::MXFP4, &w, &mut wd).expect("dequantize");
        let mut ad = vec![0f32; n];
        quant::dequantize(GgmlType::Q8_0, &a, &mut ad).expect("dequantize");
        let exact: f64 = wd.iter().zip(&ad).map(|(p, q)| *p as f64 * *q as f64).sum();
        for v in [dot_repacked(&w, &a, n / 32), dot_vec(&w, &a, n / 32)] {
            assert!((v as f64 - exact).abs() < 1e-5, "{v} vs {exact}");
        }
    }
}
