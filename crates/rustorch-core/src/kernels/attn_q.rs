//! One query head attending over key/value rows of any KV cache type (f16, Q8_0, Q4_0,
//! Q4_1, Q5_0, Q5_1, IQ4_NL, for keys and values independently), with the arithmetic of
//! llama.cpp's CPU flash attention for those types
//! (`ggml_compute_forward_flash_attn_ext_f16_one_chunk`), bit for bit:
//!
//! * the query is converted to the key type's vec-dot format: f16 for f16 keys, Q8_0 blocks
//!   (ggml-cpu's x86 encoder) for Q8_0/Q4_0/Q5_0/IQ4_NL keys, Q8_1 for Q4_1/Q5_1 keys;
//! * each score is that type's `ggml_vec_dot` (f16: [`dot_f16`]; block types: the x86
//!   legacy-format kernels of [`super::dot`] / `x86::lanes`), times the scale in f32, then
//!   soft-capped;
//! * the softmax is online, as in [`super::attn`];
//! * f16 values go through the f16 accumulator of [`super::attn`]; quantized values are
//!   decoded to f32 (`to_float`) and accumulated in f32: `acc *= ms` on a new maximum,
//!   `acc = fma(v, vs, acc)` per element (`ggml_vec_scale_f32`, `ggml_vec_mad_f32`);
//! * with attention sinks (gpt-oss), as in [`super::attn`]: a sink above the running maximum
//!   scales the (f32) accumulator by `ms = expf(M - s)` and makes `S = S · ms + 1`, else
//!   `S = S + expf(s - M)`;
//! * the output is `acc · (1 / S)`.
//!
//! llama.cpp takes this algorithm for every batch and context size as soon as either type
//! is quantized (its tiled and split paths are for f16/f32 caches only), so these results
//! equal llama.cpp's for long prompts and long contexts too.

use super::attn::{dot_f16, mad_f16, online_step, scale_f16, GroupQuery};
use super::cpu::Isa;
use super::dot::{vec_dot, vec_dot_type};
use super::qact::QActs;
use crate::quant::{f16_to_f32, f32_to_f16_row};
use crate::types::GgmlType;

/// The key or value rows of one KV head.
#[derive(Clone, Copy)]
pub enum KvRows<'a> {
    /// f16 values: the head of cell `c` is `data[c * stride + offset..][..hd]`.
    F16 {
        data: &'a [u16],
        stride: usize,
        offset: usize,
    },
    /// Blocks of `ty`: the head of cell `c` starts at byte `c * stride + offset`.
    Quant {
        ty: GgmlType,
        data: &'a [u8],
        stride: usize,
        offset: usize,
    },
}

/// What the queries of one KV head attend over.
#[derive(Clone, Copy)]
pub struct QuantAttn<'a> {
    pub k: KvRows<'a>,
    pub v: KvRows<'a>,
    /// Position of each cell (see [`super::attn::HeadAttn`]).
    pub pos: &'a [u32],
    /// Score scale (divided by `softcap` when capping).
    pub scale: f32,
    /// Soft-cap of the scores (0 = none).
    pub softcap: f32,
    /// The f16 accumulator's arithmetic (f16 values only).
    pub native_f16: bool,
}

/// Each query of `queries` (heads of one KV group, tokens of one sequence) attending over
/// `h`'s rows; queries with no visible cell get zeros.
pub fn attend_group(isa: Isa, h: &QuantAttn<'_>, queries: &mut [GroupQuery<'_>]) {
    attend_group_sinks_opt(isa, h, queries, None)
}

/// [`attend_group`] with attention sinks: `sinks[i]` is query `i`'s sink logit.
pub fn attend_group_sinks(
    isa: Isa,
    h: &QuantAttn<'_>,
    queries: &mut [GroupQuery<'_>],
    sinks: &[f32],
) {
    attend_group_sinks_opt(isa, h, queries, Some(sinks))
}

fn attend_group_sinks_opt(
    isa: Isa,
    h: &QuantAttn<'_>,
    queries: &mut [GroupQuery<'_>],
    sinks: Option<&[f32]>,
) {
    #[cfg(target_arch = "x86_64")]
    if matches!(isa, Isa::Avx2 | Isa::Avx512) {
        // SAFETY: the family (with FMA and F16C) was detected.
        unsafe { attend_group_fma(isa, h, queries, sinks) };
        return;
    }
    attend_group_body(isa, h, queries, sinks);
}

/// [`attend_group_body`] compiled with FMA, so that its fused multiply-adds are single
/// instructions.
///
/// # Safety
/// AVX2, FMA and F16C must be available.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn attend_group_fma(
    isa: Isa,
    h: &QuantAttn<'_>,
    queries: &mut [GroupQuery<'_>],
    sinks: Option<&[f32]>,
) {
    attend_group_body(isa, h, queries, sinks);
}

#[inline(always)]
fn attend_group_body(
    isa: Isa,
    h: &QuantAttn<'_>,
    queries: &mut [GroupQuery<'_>],
    sinks: Option<&[f32]>,
) {
    let Some(hd) = queries.first().map(|q| q.q.len()) else {
        return;
    };
    // the queries in the key type's vec-dot format
    let mut q16 = Vec::new();
    let mut qa = QActs::new();
    match h.k {
        KvRows::F16 { .. } => {
            q16.resize(queries.len() * hd, 0);
            for (gq, o) in queries.iter().zip(q16.chunks_exact_mut(hd)) {
                f32_to_f16_row(gq.q, o);
            }
        }
        KvRows::Quant { ty, .. } => {
            let flat: Vec<f32> = queries.iter().flat_map(|gq| gq.q.iter().copied()).collect();
            if qa.quantize(None, isa, vec_dot_type(ty), &flat, hd).is_err() {
                // head sizes are checked when the cache is made; never reached
                for gq in queries.iter_mut() {
                    gq.out.fill(0.0);
                }
                return;
            }
        }
    }
    let mut scores = Vec::new();
    let mut acc16 = vec![0u16; hd];
    let mut acc32 = vec![0f32; hd];
    let mut vrow = vec![0f32; hd];
    for (i, gq) in queries.iter_mut().enumerate() {
        let visible = |p: u32| p >= gq.min_pos && p <= gq.max_pos;
        let (Some(lo), Some(hi)) = (
            h.pos.iter().position(|&p| visible(p)),
            h.pos.iter().rposition(|&p| visible(p)),
        ) else {
            gq.out.fill(0.0);
            continue;
        };
        let hi = hi + 1;
        // K·Q of every cell in lo..hi
        scores.clear();
        scores.resize(hi - lo, 0f32);
        match h.k {
            KvRows::F16 {
                data,
                stride,
                offset,
            } => {
                let q = &q16[i * hd..(i + 1) * hd];
                for (c, s) in (lo..hi).zip(scores.iter_mut()) {
                    if visible(h.pos[c]) {
                        let b = c * stride + offset;
                        *s = dot_f16(isa, &data[b..b + hd], q);
                    }
                }
            }
            KvRows::Quant {
                ty,
                data,
                stride,
                offset,
            } => kq_scores(
                isa,
                ty,
                data,
                stride,
                offset,
                lo,
                hi,
                &qa,
                i,
                hd,
                &mut scores,
            ),
        }
        // the online softmax and the weighted sum of values
        let (mut m, mut sum) = (f32::NEG_INFINITY, 0f32);
        match h.v {
            KvRows::F16 { .. } => acc16.fill(0),
            KvRows::Quant { .. } => acc32.fill(0.0),
        }
        for c in lo..hi {
            if !visible(h.pos[c]) {
                continue;
            }
            let mut s = scores[c - lo] * h.scale;
            if h.softcap != 0.0 {
                s = h.softcap * s.tanh();
            }
            let (ms, vs, new_max) = online_step(&mut m, s);
            match h.v {
                KvRows::F16 {
                    data,
                    stride,
                    offset,
                } => {
                    if new_max {
                        scale_f16(isa, h.native_f16, &mut acc16, ms);
                    }
                    let b = c * stride + offset;
                    mad_f16(isa, h.native_f16, &mut acc16, &data[b..b + hd], vs);
                }
                KvRows::Quant {
                    ty,
                    data,
                    stride,
                    offset,
                } => {
                    if new_max {
                        for a in acc32.iter_mut() {
                            *a *= ms;
                        }
                    }
                    let b = c * stride + offset;
                    let n = hd / ty.block_size() * ty.type_size();
                    crate::kv_cache::decode_row(ty, &data[b..b + n], &mut vrow);
                    for (a, &x) in acc32.iter_mut().zip(&vrow) {
                        *a = x.mul_add(vs, *a);
                    }
                }
            }
            sum = sum.mul_add(ms, vs);
        }
        // the sink, after the last cell (not fused: see `super::attn`)
        let mut post = 1.0;
        if let Some(s) = sinks.map(|s| s[i]) {
            if s > m {
                post = (m - s).exp();
                sum = sum * post + 1.0;
            } else {
                sum += (s - m).exp();
            }
        }
        let inv = if sum == 0.0 { 0.0 } else { 1.0 / sum };
        match h.v {
            KvRows::F16 { .. } => {
                for (o, &a) in gq.out.iter_mut().zip(&acc16) {
                    *o = f16_to_f32(a) * post * inv;
                }
            }
            KvRows::Quant { .. } => {
                for (o, &a) in gq.out.iter_mut().zip(&acc32) {
                    *o = a * post * inv;
                }
            }
        }
    }
}

/// `scores[c - lo] = vec_dot(key head of cell c, query row qi of qa)` for cells `lo..hi`
/// (invisible cells too: their scores are not read).
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn kq_scores(
    isa: Isa,
    ty: GgmlType,
    data: &[u8],
    stride: usize,
    offset: usize,
    lo: usize,
    hi: usize,
    qa: &QActs,
    qi: usize,
    hd: usize,
    scores: &mut [f32],
) {
    let nb = hd / ty.block_size();
    let head_bytes = nb * ty.type_size();
    let (qb, rb) = (qa.row(qi), qa.row_bytes());
    debug_assert_eq!(qb.len(), rb);
    let last = (hi - 1) * stride + offset + head_bytes;
    #[cfg(target_arch = "x86_64")]
    if let (Some(gemv), Isa::Avx2 | Isa::Avx512, true) = (
        legacy_gemv(ty),
        isa,
        last <= data.len() && scores.len() == hi - lo,
    ) {
        let a = super::fmt::ActRow {
            q: qb.as_ptr(),
            d: qa.d.as_ptr().wrapping_add(qi * qa.nb),
            s: qa.s.as_ptr().wrapping_add(qi * qa.nb),
            isum: qa.isum.as_ptr().wrapping_add(qi * qa.nb),
        };
        let w = data[lo * stride + offset..].as_ptr();
        // SAFETY: the family was detected; rows lo..hi of `nb` blocks lie in `data` (checked
        // above), the activation row holds `nb` blocks and its side data, `scores` holds
        // `hi - lo` values.
        unsafe { gemv(w, stride, hi - lo, nb, a, scores.as_mut_ptr()) };
        return;
    }
    let _ = last;
    for (c, s) in (lo..hi).zip(scores.iter_mut()) {
        let b = c * stride + offset;
        *s = vec_dot(ty, hd, &data[b..b + head_bytes], qb);
    }
}

/// The x86 kernel of `ggml_vec_dot_<ty>_q8_*` for rows of a legacy block type.
#[cfg(target_arch = "x86_64")]
fn legacy_gemv(ty: GgmlType) -> Option<super::GemvFn> {
    use super::fmt;
    use super::x86::lanes::gemv;
    Some(match ty {
        GgmlType::Q4_0 => gemv::<{ fmt::Q4_0 }>,
        GgmlType::Q4_1 => gemv::<{ fmt::Q4_1 }>,
        GgmlType::Q5_0 => gemv::<{ fmt::Q5_0 }>,
        GgmlType::Q5_1 => gemv::<{ fmt::Q5_1 }>,
        GgmlType::Q8_0 => gemv::<{ fmt::Q8_0 }>,
        GgmlType::IQ4_NL => gemv::<{ fmt::IQ4_NL }>,
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::attn::{attend_group as attend_group_f16, HeadAttn};
    use crate::kv_cache::encode_row;
    use crate::quant::f32_to_f16;

    fn rng(seed: u64) -> impl FnMut() -> f32 {
        let mut s = seed;
        move || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 4.0 - 2.0
        }
    }

    fn encode(ty: GgmlType, x: &[f32]) -> Vec<u8> {
        let mut out = vec![0u8; x.len() / ty.block_size() * ty.type_size()];
        encode_row(ty, x, &mut out);
        out
    }

    /// Every family computes the scalar reference's results, for every type pair.
    #[test]
    fn simd_and_scalar_agree() {
        let mut rnd = rng(0x9e37_79b9_7f4a_7c15);
        let (hd, n_kv, n_cells) = (64usize, 2usize, 41usize);
        let kvd = hd * n_kv;
        let keys: Vec<f32> = (0..kvd * n_cells).map(|_| rnd()).collect();
        let vals: Vec<f32> = (0..kvd * n_cells).map(|_| rnd()).collect();
        let qs: Vec<f32> = (0..3 * hd).map(|_| rnd()).collect();
        let pos: Vec<u32> = (0..n_cells as u32).collect();
        let types = [
            GgmlType::F16,
            GgmlType::Q8_0,
            GgmlType::Q4_0,
            GgmlType::Q4_1,
            GgmlType::Q5_0,
            GgmlType::Q5_1,
            GgmlType::IQ4_NL,
        ];
        let k16: Vec<u16> = keys.iter().map(|&x| f32_to_f16(x)).collect();
        let v16: Vec<u16> = vals.iter().map(|&x| f32_to_f16(x)).collect();
        for &kt in &types {
            for &vt in &types {
                let kq = encode(kt, &keys);
                let vq = encode(vt, &vals);
                let side = |ty: GgmlType, h16: &'static [u16], q: &'static [u8]| {
                    if ty == GgmlType::F16 {
                        KvRows::F16 {
                            data: h16,
                            stride: kvd,
                            offset: hd,
                        }
                    } else {
                        KvRows::Quant {
                            ty,
                            data: q,
                            stride: kvd / ty.block_size() * ty.type_size(),
                            offset: hd / ty.block_size() * ty.type_size(),
                        }
                    }
                };
                let (k16s, v16s): (&'static [u16], &'static [u16]) = (
                    Box::leak(k16.clone().into_boxed_slice()),
                    Box::leak(v16.clone().into_boxed_slice()),
                );
                let (kqs, vqs): (&'static [u8], &'static [u8]) = (
                    Box::leak(kq.into_boxed_slice()),
                    Box::leak(vq.into_boxed_slice()),
                );
                let h = QuantAttn {
                    k: side(kt, k16s, kqs),
                    v: side(vt, v16s, vqs),
                    pos: &pos,
                    scale: 0.125,
                    softcap: if kt == vt { 0.0 } else { 30.0 },
                    native_f16: false,
                };
                let run = |isa: Isa| -> Vec<f32> {
                    let mut out = vec![0f32; 3 * hd];
                    let mut qv: Vec<GroupQuery<'_>> = out
                        .chunks_exact_mut(hd)
                        .zip(qs.chunks_exact(hd))
                        .enumerate()
                        .map(|(i, (o, q))| GroupQuery {
                            q,
                            min_pos: 3 * i as u32,
                            max_pos: 20 + 9 * i as u32,
                            out: o,
                        })
                        .collect();
                    attend_group(isa, &h, &mut qv);
                    out
                };
                let want = run(Isa::Scalar);
                for isa in Isa::available() {
                    assert_eq!(run(isa), want, "{isa:?} K {kt:?} V {vt:?}");
                }
                if kt == GgmlType::F16 && vt == GgmlType::F16 {
                    // f16/f16 is the f16 cache's kernel
                    let hf = HeadAttn {
                        q: &[],
                        k: k16s,
                        v: v16s,
                        stride: kvd,
                        offset: hd,
                        pos: &pos,
                        min_pos: 0,
                        max_pos: 0,
                        scale: 0.125,
                        softcap: 0.0,
                        native_f16: false,
                    };
                    let mut out = vec![0f32; 3 * hd];
                    let mut qv: Vec<GroupQuery<'_>> = out
                        .chunks_exact_mut(hd)
                        .zip(qs.chunks_exact(hd))
                        .enumerate()
                        .map(|(i, (o, q))| GroupQuery {
                            q,
                            min_pos: 3 * i as u32,
                            max_pos: 20 + 9 * i as u32,
                            out: o,
                        })
                        .collect();
                    attend_group_f16(Isa::Scalar, &hf, &mut qv);
                    assert_eq!(out, want, "f16/f16 against the f16 kernel");
                }
            }
        }
    }
}
