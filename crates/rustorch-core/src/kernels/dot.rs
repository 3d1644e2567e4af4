//! Scalar reference dot products between one row of quantized weights and one row of
//! activations quantized to the weight type's "vec-dot type", as ggml pairs them:
//! Q4_0/Q5_0/Q8_0/IQ4_NL with Q8_0, Q4_1/Q5_1 with Q8_1, the K-quants and IQ4_XS with Q8_K,
//! F16 with F16, F32 with F32. Integer products are summed per block and scaled once, as in
//! ggml, so results agree with llama.cpp up to float summation order.

use crate::quant::{f16_to_f32, IQ4NL_VALUES};
use crate::types::GgmlType;

#[inline(always)]
pub(crate) fn rd_f16(b: &[u8], o: usize) -> f32 {
    f16_to_f32(u16::from_le_bytes([b[o], b[o + 1]]))
}

#[inline(always)]
pub(crate) fn rd_f32(b: &[u8], o: usize) -> f32 {
    f32::from_le_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]])
}

/// The activation format ggml quantizes the other operand to for weights of type `ty`.
pub fn vec_dot_type(ty: GgmlType) -> GgmlType {
    use GgmlType::*;
    match ty {
        Q4_0 | Q5_0 | Q8_0 | IQ4_NL => Q8_0,
        Q4_1 | Q5_1 => Q8_1,
        Q2_K | Q3_K | Q4_K | Q5_K | Q6_K | IQ4_XS => Q8_K,
        F16 => F16,
        BF16 => BF16,
        _ => F32,
    }
}

/// Whether [`vec_dot`] has an integer kernel for weights of type `ty` (others go
/// through dequantization to f32).
pub fn has_kernel(ty: GgmlType) -> bool {
    use GgmlType::*;
    matches!(
        ty,
        F32 | F16 | Q4_0 | Q4_1 | Q5_0 | Q5_1 | Q8_0 | Q4_K | Q5_K | Q6_K | IQ4_NL
    )
}

/// Dot product of `n` elements: `w` encoded as `ty`, `a` encoded as `vec_dot_type(ty)`.
/// Callers guarantee both slices hold exactly `n` elements of their format.
pub fn vec_dot(ty: GgmlType, n: usize, w: &[u8], a: &[u8]) -> f32 {
    use GgmlType::*;
    match ty {
        F32 => dot_f32(n, w, a),
        F16 => dot_f16(n, w, a),
        Q4_0 => dot_legacy(Q4_0, n / 32, w, a),
        Q4_1 => dot_legacy(Q4_1, n / 32, w, a),
        Q5_0 => dot_legacy(Q5_0, n / 32, w, a),
        Q5_1 => dot_legacy(Q5_1, n / 32, w, a),
        Q8_0 => dot_legacy(Q8_0, n / 32, w, a),
        IQ4_NL => dot_legacy(IQ4_NL, n / 32, w, a),
        Q4_K => dot_q4_k(n / 256, w, a),
        Q5_K => dot_q5_k(n / 256, w, a),
        Q6_K => dot_q6_k(n / 256, w, a),
        _ => 0.0,
    }
}

fn dot_f32(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let mut s = 0.0f32;
    for i in 0..n {
        s += rd_f32(w, 4 * i) * rd_f32(a, 4 * i);
    }
    s
}

fn dot_f16(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let mut s = 0.0f64;
    for i in 0..n {
        s += (rd_f16(w, 2 * i) * rd_f16(a, 2 * i)) as f64;
    }
    s as f32
}

/// The 32 values of a legacy weight block (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL) as
/// integers in element order, zero points removed (Q4_1/Q5_1 keep their unsigned values;
/// their minimum is applied through the activation block's `s`).
#[inline(always)]
pub(crate) fn legacy_values(ty: GgmlType, x: &[u8]) -> [i32; 32] {
    use GgmlType::*;
    let mut v = [0i32; 32];
    match ty {
        Q8_0 => {
            for (o, &q) in v.iter_mut().zip(&x[2..34]) {
                *o = q as i8 as i32;
            }
        }
        Q4_0 | Q4_1 | IQ4_NL => {
            let qs = if ty == Q4_1 { &x[4..20] } else { &x[2..18] };
            for j in 0..16 {
                let (lo, hi) = ((qs[j] & 0x0f) as usize, (qs[j] >> 4) as usize);
                (v[j], v[j + 16]) = match ty {
                    Q4_0 => (lo as i32 - 8, hi as i32 - 8),
                    Q4_1 => (lo as i32, hi as i32),
                    _ => (IQ4NL_VALUES[lo] as i32, IQ4NL_VALUES[hi] as i32),
                };
            }
        }
        _ => {
            // Q5_0 / Q5_1
            let (hq, qs, off) = if ty == Q5_0 {
                (2, &x[6..22], 16)
            } else {
                (4, &x[8..24], 0)
            };
            let qh = u32::from_le_bytes([x[hq], x[hq + 1], x[hq + 2], x[hq + 3]]);
            for j in 0..16 {
                let h0 = ((qh >> j) << 4) & 0x10;
                let h1 = (qh >> (j + 12)) & 0x10;
                v[j] = ((qs[j] & 0x0f) as u32 | h0) as i32 - off;
                v[j + 16] = ((qs[j] >> 4) as u32 | h1) as i32 - off;
            }
        }
    }
    v
}

/// ggml's `hsum_float_8`: `(v[i] + v[4 + i])`, then `(r0 + r2) + (r1 + r3)`.
#[inline(always)]
pub(crate) fn hsum8(v: &[f32; 8]) -> f32 {
    let r = [v[4] + v[0], v[5] + v[1], v[6] + v[2], v[7] + v[3]];
    (r[0] + r[2]) + (r[1] + r[3])
}

/// Legacy-format dot product with the float steps of ggml's x86 kernels (AVX2
/// `ggml_vec_dot_*_q8_*` and llamafile's tinyBLAS, which agree): per block, eight lane sums
/// of four consecutive products, converted to f32 and fused-multiply-added into eight
/// accumulators with the block scale `dw * da`; then [`hsum8`]. Q4_1/Q5_1 add the fused sum
/// of `mw * sa` over the blocks. IQ4_NL alternates two accumulators over block pairs, as
/// ggml's kernel does, and adds an odd last block separately.
fn dot_legacy(ty: GgmlType, nb: usize, w: &[u8], a: &[u8]) -> f32 {
    let (wb, ab, aq) = (
        ty.type_size(),
        vec_dot_type(ty).type_size(),
        match ty {
            GgmlType::Q4_1 | GgmlType::Q5_1 => 4,
            _ => 2,
        },
    );
    let mut acc = [[0f32; 8]; 2];
    let mut summs = 0f32;
    let pairs = ty == GgmlType::IQ4_NL;
    let nb_main = if pairs { nb & !1 } else { nb };
    for b in 0..nb_main {
        let x = &w[b * wb..(b + 1) * wb];
        let y = &a[b * ab..(b + 1) * ab];
        let v = legacy_values(ty, x);
        let scale = rd_f16(x, 0) * rd_f16(y, 0);
        let acc = &mut acc[if pairs { b & 1 } else { 0 }];
        for (l, a) in acc.iter_mut().enumerate() {
            let mut s = 0i32;
            for e in 4 * l..4 * l + 4 {
                s += v[e] * y[aq + e] as i8 as i32;
            }
            *a = scale.mul_add(s as f32, *a);
        }
        if aq == 4 {
            summs = rd_f16(x, 2).mul_add(rd_f16(y, 2), summs);
        }
    }
    let mut sum = if pairs {
        let s: [f32; 8] = std::array::from_fn(|l| acc[0][l] + acc[1][l]);
        hsum8(&s)
    } else {
        hsum8(&acc[0])
    };
    for b in nb_main..nb {
        let x = &w[b * wb..(b + 1) * wb];
        let y = &a[b * ab..(b + 1) * ab];
        let v = legacy_values(ty, x);
        let s: i32 = (0..32).map(|e| v[e] * y[aq + e] as i8 as i32).sum();
        sum = (rd_f16(y, 0) * rd_f16(x, 0)).mul_add(s as f32, sum);
    }
    sum + summs
}

/// The 6-bit scale and min of sub-block `j` (0..8) of a Q4_K/Q5_K super-block.
#[inline(always)]
pub(crate) fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// Q8_K block: d (f32) at 0, 256 i8 at 4, 16 i16 group sums at 260.
const Q8K_SIZE: usize = 292;

#[inline(always)]
fn q8k_bsum(y: &[u8], g: usize) -> i32 {
    i16::from_le_bytes([y[260 + 2 * g], y[261 + 2 * g]]) as i32
}

fn dot_q4_k(nb: usize, w: &[u8], a: &[u8]) -> f32 {
    let mut sum = 0.0f32;
    for b in 0..nb {
        let x = &w[b * 144..b * 144 + 144];
        let y = &a[b * Q8K_SIZE..(b + 1) * Q8K_SIZE];
        let yd = rd_f32(y, 0);
        let d = yd * rd_f16(x, 0);
        let dmin = yd * rd_f16(x, 2);
        let scales = &x[4..16];
        let qs = &x[16..144];
        let q8 = &y[4..260];
        let mut sumi = 0i32;
        let mut summs = 0i32;
        for j in 0..4 {
            let (sc0, m0) = scale_min_k4(2 * j, scales);
            let (sc1, m1) = scale_min_k4(2 * j + 1, scales);
            let q = &qs[32 * j..32 * j + 32];
            let y0 = &q8[64 * j..64 * j + 32];
            let y1 = &q8[64 * j + 32..64 * j + 64];
            let mut s0 = 0i32;
            let mut s1 = 0i32;
            for l in 0..32 {
                s0 += (q[l] & 0x0f) as i32 * y0[l] as i8 as i32;
                s1 += (q[l] >> 4) as i32 * y1[l] as i8 as i32;
            }
            sumi += sc0 as i32 * s0 + sc1 as i32 * s1;
            summs += m0 as i32 * (q8k_bsum(y, 4 * j) + q8k_bsum(y, 4 * j + 1))
                + m1 as i32 * (q8k_bsum(y, 4 * j + 2) + q8k_bsum(y, 4 * j + 3));
        }
        sum += d * sumi as f32 - dmin * summs as f32;
    }
    sum
}

fn dot_q5_k(nb: usize, w: &[u8], a: &[u8]) -> f32 {
    let mut sum = 0.0f32;
    for b in 0..nb {
        let x = &w[b * 176..b * 176 + 176];
        let y = &a[b * Q8K_SIZE..(b + 1) * Q8K_SIZE];
        let yd = rd_f32(y, 0);
        let d = yd * rd_f16(x, 0);
        let dmin = yd * rd_f16(x, 2);
        let scales = &x[4..16];
        let qh = &x[16..48];
        let qs = &x[48..176];
        let q8 = &y[4..260];
        let mut sumi = 0i32;
        let mut summs = 0i32;
        for j in 0..4 {
            let (sc0, m0) = scale_min_k4(2 * j, scales);
            let (sc1, m1) = scale_min_k4(2 * j + 1, scales);
            let q = &qs[32 * j..32 * j + 32];
            let u0 = 1u8 << (2 * j);
            let u1 = 2u8 << (2 * j);
            let y0 = &q8[64 * j..64 * j + 32];
            let y1 = &q8[64 * j + 32..64 * j + 64];
            let mut s0 = 0i32;
            let mut s1 = 0i32;
            for l in 0..32 {
                let h0 = if qh[l] & u0 != 0 { 16 } else { 0 };
                let h1 = if qh[l] & u1 != 0 { 16 } else { 0 };
                s0 += ((q[l] & 0x0f) as i32 + h0) * y0[l] as i8 as i32;
                s1 += ((q[l] >> 4) as i32 + h1) * y1[l] as i8 as i32;
            }
            sumi += sc0 as i32 * s0 + sc1 as i32 * s1;
            summs += m0 as i32 * (q8k_bsum(y, 4 * j) + q8k_bsum(y, 4 * j + 1))
                + m1 as i32 * (q8k_bsum(y, 4 * j + 2) + q8k_bsum(y, 4 * j + 3));
        }
        sum += d * sumi as f32 - dmin * summs as f32;
    }
    sum
}

/// Q6_K × Q8_K with the float steps of ggml's x86 `ggml_vec_dot_q6_K_q8_K`: per
/// super-block, eight exact lane sums (lane `l`: elements `4l..4l + 4` of every 32-value
/// group times its 16-value scale, minus `32 · (bsum[2l]·sc[2l] + bsum[2l+1]·sc[2l+1])`),
/// converted to f32 and fused-multiply-added with `d = da · dw`; then [`hsum8`].
fn dot_q6_k(nb: usize, w: &[u8], a: &[u8]) -> f32 {
    let mut acc = [0f32; 8];
    for b in 0..nb {
        let x = &w[b * 210..b * 210 + 210];
        let y = &a[b * Q8K_SIZE..(b + 1) * Q8K_SIZE];
        let lanes = q6k_lanes(x, y);
        let d = rd_f32(y, 0) * rd_f16(x, 208);
        for (a, &l) in acc.iter_mut().zip(&lanes) {
            *a = d.mul_add(l as f32, *a);
        }
    }
    hsum8(&acc)
}

/// The eight integer lane sums of one Q6_K × Q8_K super-block (see [`dot_q6_k`]).
pub(crate) fn q6k_lanes(x: &[u8], y: &[u8]) -> [i32; 8] {
    let (ql, qh, sc) = (&x[0..128], &x[128..192], &x[192..208]);
    let q8 = &y[4..260];
    let mut lanes = [0i32; 8];
    for j in 0..2 {
        for k in 0..4 {
            for (l, lane) in lanes.iter_mut().enumerate() {
                let scale = sc[8 * j + 2 * k + usize::from(l >= 4)] as i8 as i32;
                let mut s = 0i32;
                for e in 4 * l..4 * l + 4 {
                    let h = qh[32 * j + e] >> (2 * k) & 3;
                    let lo = ql[64 * j + 32 * (k & 1) + e];
                    let lo = if k < 2 { lo & 0x0f } else { lo >> 4 };
                    let q = (lo | h << 4) as i32;
                    s += q * q8[128 * j + 32 * k + e] as i8 as i32;
                }
                *lane += scale * s;
            }
        }
    }
    for (l, lane) in lanes.iter_mut().enumerate() {
        let c = q8k_bsum(y, 2 * l) * sc[2 * l] as i8 as i32
            + q8k_bsum(y, 2 * l + 1) * sc[2 * l + 1] as i8 as i32;
        *lane -= c << 5;
    }
    lanes
}
