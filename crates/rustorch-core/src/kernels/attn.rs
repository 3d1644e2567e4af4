//! One query head attending over f16 key/value rows with the arithmetic of llama.cpp's CPU
//! flash attention (`ggml_compute_forward_flash_attn_ext_f16_one_chunk`, f16 K/V cache, on
//! an AVX-512 build with AVX512-FP16), bit for bit:
//!
//! * the query is rounded to f16;
//! * each score is `ggml_vec_dot_f16`: four 16-lane f32 accumulators fed by fused
//!   multiply-adds over blocks of 64 elements, reduced `(a0 + a2) + (a1 + a3)`, then lanes
//!   `v[l] + v[l + 8]`, `v[l] + v[l + 4]`, `(u0 + u2) + (u1 + u3)`; leftover elements are
//!   added in f64; the score is multiplied by the scale in f32;
//! * the softmax is online: on a new maximum `M` the f16 accumulator is scaled by
//!   `ms = expf(M_old - M)`, otherwise the value's weight is `vs = expf(s - M)`;
//! * the accumulator update `acc += v · vs` and the scaling are native f16 operations on
//!   blocks of 128 elements (one rounding of the exact result, `vs` rounded to f16 first) and
//!   f32 fused multiply-adds rounded to f16 for the rest;
//! * the running sum is `S = fma(S, ms, vs)`, and the output is `f32(acc) · (1 / S)`;
//! * with an attention sink (gpt-oss: a logit `s` per head that joins the softmax without a
//!   value), after the last cell: if `s > M`, the f32 accumulator is scaled by
//!   `ms = expf(M - s)` and `S = S · ms + 1` (not fused), else `S = S + expf(s - M)`.
//!
//! llama.cpp switches to other algorithms for batches of 64 or more queries (tiled) and for
//! single-token decoding over 512 or more cache cells (split over threads); those are not
//! reproduced here, so results there agree to rounding rather than bit for bit.

use super::cpu::Isa;
use crate::quant::{f16_to_f32, f32_to_f16, f32_to_f16_row};

/// Attention inputs for one query head.
#[derive(Clone, Copy)]
pub struct HeadAttn<'a> {
    /// The query head (`hd` values, not yet rounded).
    pub q: &'a [f32],
    /// Key rows, f16 bits; row `c` of this head starts at `c * stride + offset`.
    pub k: &'a [u16],
    /// Value rows, same layout as `k`.
    pub v: &'a [u16],
    pub stride: usize,
    pub offset: usize,
    /// Position of each cell; cells with position above `max_pos` (causal mask) or below
    /// `min_pos` (sliding window) are skipped.
    pub pos: &'a [u32],
    pub min_pos: u32,
    pub max_pos: u32,
    /// Score scale (1 / sqrt(head_dim), divided by `softcap` when capping).
    pub scale: f32,
    /// Attention-logit soft-capping: a scaled score `s` becomes `softcap · tanh(s)`
    /// (0 = none), as ggml's flash attention does.
    pub softcap: f32,
    /// The f16 accumulator's arithmetic: llama.cpp built with AVX512-FP16 (native f16 on
    /// blocks of 128, see [`crate::kernels::native_f16`]) or without (f32 multiply-adds).
    pub native_f16: bool,
}

impl HeadAttn<'_> {
    /// The soft-capped score (identity without a cap).
    #[inline(always)]
    pub fn cap(&self, s: f32) -> f32 {
        if self.softcap != 0.0 {
            self.softcap * s.tanh()
        } else {
            s
        }
    }
}

/// One query of a group attending over the same key/value rows.
pub struct GroupQuery<'a> {
    /// The query head (`hd` values, not yet rounded).
    pub q: &'a [f32],
    /// Cells with a position below `min_pos` or above `max_pos` are invisible to the query.
    pub min_pos: u32,
    pub max_pos: u32,
    /// Output (`hd` values).
    pub out: &'a mut [f32],
}

/// Writes the attention output of one head to `out` (`q.len()` values; zeros when no cell
/// is visible).
pub fn attend_head(isa: Isa, h: &HeadAttn<'_>, out: &mut [f32]) {
    attend_head_sink(isa, h, None, out)
}

/// [`attend_head`] with an optional attention sink (see the module documentation).
fn attend_head_sink(isa: Isa, h: &HeadAttn<'_>, sink: Option<f32>, out: &mut [f32]) {
    let hd = h.q.len();
    debug_assert_eq!(out.len(), hd);
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx512 && hd < 128 && hd.is_multiple_of(16) {
        // SAFETY: the family was detected; `hd` is a multiple of 16 below 128.
        unsafe { x86::attend_head_regs(h, sink, out) };
        return;
    }
    // head sizes up to 256 live on the stack (no allocation per head and token)
    let (mut q_st, mut acc_st) = ([0u16; 256], [0u16; 256]);
    let (mut q_heap, mut acc_heap) = (Vec::new(), Vec::new());
    let (q16, acc) = if hd <= 256 {
        (&mut q_st[..hd], &mut acc_st[..hd])
    } else {
        q_heap.resize(hd, 0);
        acc_heap.resize(hd, 0);
        (&mut q_heap[..], &mut acc_heap[..])
    };
    f32_to_f16_row(h.q, q16);
    let (post, inv) = online_softmax(
        isa,
        h,
        q16,
        acc,
        |acc, ms| scale_f16(isa, h.native_f16, acc, ms),
        |acc, v, vs| mad_f16(isa, h.native_f16, acc, v, vs),
        sink,
    );
    for (o, &a) in out.iter_mut().zip(acc.iter()) {
        *o = f16_to_f32(a) * post * inv;
    }
}

/// The online-softmax walk of [`attend_head`] over the cells visible to `h`'s query (`q16`,
/// already rounded): per cell the score, then `rescale(acc, ms)` on a new maximum and
/// `add(acc, value_row, vs)`, and the running sum `S = fma(S, ms, vs)`; then the sink, if
/// any. Returns the factor of the (f32) accumulator the sink asks for (1 without one, or when
/// it is not a new maximum) and `1 / S` (0 when the sum is 0).
#[inline(always)]
fn online_softmax<A: ?Sized>(
    isa: Isa,
    h: &HeadAttn<'_>,
    q16: &[u16],
    acc: &mut A,
    mut rescale: impl FnMut(&mut A, f32),
    mut add: impl FnMut(&mut A, &[u16], f32),
    sink: Option<f32>,
) -> (f32, f32) {
    let hd = q16.len();
    let mut m = f32::NEG_INFINITY;
    let mut sum = 0f32;
    for (c, &p) in h.pos.iter().enumerate() {
        if p > h.max_pos || p < h.min_pos {
            continue;
        }
        let base = c * h.stride + h.offset;
        let s = h.cap(dot_f16(isa, &h.k[base..base + hd], q16) * h.scale);
        let (ms, vs, new_max) = online_step(&mut m, s);
        if new_max {
            rescale(acc, ms);
        }
        add(acc, &h.v[base..base + hd], vs);
        sum = sum.mul_add(ms, vs);
    }
    let mut post = 1.0;
    if let Some(s) = sink {
        if s > m {
            post = (m - s).exp();
            // two roundings: the build does not contract this one (its branches are
            // specialised for `vs = 1`)
            sum = sum * post + 1.0;
        } else {
            sum += (s - m).exp();
        }
    }
    (post, if sum == 0.0 { 0.0 } else { 1.0 / sum })
}

/// One step of the online softmax for a new score `s` against the running maximum `m`:
/// on a new maximum `m` becomes `s`, the accumulator is to be scaled by
/// `ms = expf(m_old - s)` and the value's weight `vs` is 1; otherwise `ms` is 1 and
/// `vs = expf(s - m)`. Returns `(ms, vs, new maximum)`.
#[inline(always)]
pub(crate) fn online_step(m: &mut f32, s: f32) -> (f32, f32, bool) {
    if s > *m {
        let ms = (*m - s).exp();
        *m = s;
        (ms, 1.0, true)
    } else {
        (1.0, (s - *m).exp(), false)
    }
}

/// Several queries (heads of one KV group, tokens of one sequence) over the same key/value
/// rows; `h.q` and `h.max_pos` are ignored. Each output equals [`attend_head`] for that
/// query alone.
pub fn attend_group(isa: Isa, h: &HeadAttn<'_>, queries: &mut [GroupQuery<'_>]) {
    for gq in queries.iter_mut() {
        let one = HeadAttn {
            q: gq.q,
            min_pos: gq.min_pos,
            max_pos: gq.max_pos,
            ..*h
        };
        attend_head(isa, &one, gq.out);
    }
}

/// [`attend_group`] with attention sinks: `sinks[i]` is query `i`'s sink logit.
pub fn attend_group_sinks(
    isa: Isa,
    h: &HeadAttn<'_>,
    queries: &mut [GroupQuery<'_>],
    sinks: &[f32],
) {
    for (gq, &s) in queries.iter_mut().zip(sinks) {
        let one = HeadAttn {
            q: gq.q,
            min_pos: gq.min_pos,
            max_pos: gq.max_pos,
            ..*h
        };
        attend_head_sink(isa, &one, Some(s), gq.out);
    }
}

/// `ggml_vec_dot_f16` of an AVX-512 build (see the module documentation).
pub fn dot_f16(isa: Isa, x: &[u16], y: &[u16]) -> f32 {
    let n = x.len().min(y.len());
    let np = n & !63;
    #[cfg(target_arch = "x86_64")]
    let v: [f32; 16] = if isa == Isa::Avx512 {
        // SAFETY: the family was detected; `np <= n`.
        unsafe { x86::dot_blocks(x.as_ptr(), y.as_ptr(), np) }
    } else if isa == Isa::Avx2 {
        // SAFETY: the family (with FMA and F16C) was detected; `np <= n`.
        unsafe { x86::dot_blocks_avx2(x.as_ptr(), y.as_ptr(), np) }
    } else {
        dot_blocks_scalar(x, y, np)
    };
    #[cfg(not(target_arch = "x86_64"))]
    let v = {
        let _ = isa;
        dot_blocks_scalar(x, y, np)
    };
    let w: [f32; 8] = std::array::from_fn(|l| v[l] + v[l + 8]);
    let u: [f32; 4] = std::array::from_fn(|l| w[l] + w[l + 4]);
    let mut sum = ((u[0] + u[2]) + (u[1] + u[3])) as f64;
    for i in np..n {
        sum += (f16_to_f32(x[i]) * f16_to_f32(y[i])) as f64;
    }
    sum as f32
}

/// The four accumulators of [`dot_f16`] over the first `np` (a multiple of 64) elements,
/// already reduced to one 16-lane vector.
fn dot_blocks_scalar(x: &[u16], y: &[u16], np: usize) -> [f32; 16] {
    let mut acc = [[0f32; 16]; 4];
    for i in (0..np).step_by(64) {
        for (j, lanes) in acc.iter_mut().enumerate() {
            for (l, a) in lanes.iter_mut().enumerate() {
                let k = i + 16 * j + l;
                *a = f16_to_f32(x[k]).mul_add(f16_to_f32(y[k]), *a);
            }
        }
    }
    std::array::from_fn(|l| (acc[0][l] + acc[2][l]) + (acc[1][l] + acc[3][l]))
}

/// f64 → f16 with one correct rounding (round to odd into f32, then to nearest even).
fn f64_to_f16(x: f64) -> u16 {
    let mut f = x as f32;
    if f.is_finite() && f as f64 != x {
        if (f as f64).abs() > x.abs() {
            f = f32::from_bits(f.to_bits() - 1);
        }
        f = f32::from_bits(f.to_bits() | 1);
    }
    f32_to_f16(f)
}

/// `ggml_vec_mad_f16`: `y += x · v`.
pub fn mad_f16(isa: Isa, native: bool, y: &mut [u16], x: &[u16], v: f32) {
    let n = y.len().min(x.len());
    // blocks of 128 in native f16 where llama.cpp's build has it, f32 arithmetic otherwise
    let np = if native { n & !127 } else { 0 };
    if np > 0 {
        // native f16 fused multiply-add: one rounding of the exact value
        let v16 = f16_to_f32(f32_to_f16(v)) as f64;
        #[cfg(target_arch = "x86_64")]
        if matches!(isa, Isa::Avx2 | Isa::Avx512) {
            // SAFETY: the family (which includes FMA) was detected.
            unsafe { x86::mad_native(&mut y[..np], &x[..np], v16) };
        } else {
            mad_native(&mut y[..np], &x[..np], v16);
        }
        #[cfg(not(target_arch = "x86_64"))]
        mad_native(&mut y[..np], &x[..np], v16);
    }
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx512 {
        // SAFETY: the family was detected.
        unsafe { x86::mad_tail(&mut y[np..n], &x[np..n], v) };
        return;
    } else if isa == Isa::Avx2 {
        // SAFETY: the family (with FMA and F16C) was detected.
        unsafe { x86::mad_tail_avx2(&mut y[np..n], &x[np..n], v) };
        return;
    }
    let _ = isa;
    for (a, &b) in y[np..n].iter_mut().zip(&x[np..n]) {
        *a = f32_to_f16(f16_to_f32(b).mul_add(v, f16_to_f32(*a)));
    }
}

/// The native-f16 part of [`mad_f16`]: `y = f16(x · v16 + y)` with one rounding.
#[inline(always)]
fn mad_native(y: &mut [u16], x: &[u16], v16: f64) {
    for (a, &b) in y.iter_mut().zip(x) {
        *a = f64_to_f16((f16_to_f32(b) as f64).mul_add(v16, f16_to_f32(*a) as f64));
    }
}

/// `ggml_vec_scale_f16`: `y *= v`.
pub fn scale_f16(isa: Isa, native: bool, y: &mut [u16], v: f32) {
    let n = y.len();
    let np = if native { n & !127 } else { 0 };
    if np > 0 {
        let v16 = f16_to_f32(f32_to_f16(v)) as f64;
        for a in y[..np].iter_mut() {
            *a = f64_to_f16(f16_to_f32(*a) as f64 * v16);
        }
    }
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx512 {
        // SAFETY: the family was detected.
        unsafe { x86::scale_tail(&mut y[np..], v) };
        return;
    } else if isa == Isa::Avx2 {
        // SAFETY: the family (with FMA and F16C) was detected.
        unsafe { x86::scale_tail_avx2(&mut y[np..], v) };
        return;
    }
    let _ = isa;
    for a in y[np..].iter_mut() {
        *a = f32_to_f16(f16_to_f32(*a) * v);
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    /// # Safety
    /// AVX-512F must be available; `x` and `y` hold `np` (a multiple of 64) values.
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    pub(super) unsafe fn dot_blocks(x: *const u16, y: *const u16, np: usize) -> [f32; 16] {
        let mut acc = [_mm512_setzero_ps(); 4];
        let mut i = 0;
        while i < np {
            for (j, a) in acc.iter_mut().enumerate() {
                let ax = _mm512_cvtph_ps(_mm256_loadu_si256(x.add(i + 16 * j) as *const __m256i));
                let ay = _mm512_cvtph_ps(_mm256_loadu_si256(y.add(i + 16 * j) as *const __m256i));
                *a = _mm512_fmadd_ps(ax, ay, *a);
            }
            i += 64;
        }
        let r = _mm512_add_ps(_mm512_add_ps(acc[0], acc[2]), _mm512_add_ps(acc[1], acc[3]));
        let mut out = [0f32; 16];
        _mm512_storeu_ps(out.as_mut_ptr(), r);
        out
    }

    /// [`dot_blocks`] with AVX2: each 16-lane accumulator of the AVX-512 build as two 8-lane
    /// halves, the same fused multiply-adds per lane.
    ///
    /// # Safety
    /// AVX2, FMA and F16C must be available; `x` and `y` hold `np` (a multiple of 64) values.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn dot_blocks_avx2(x: *const u16, y: *const u16, np: usize) -> [f32; 16] {
        let mut acc = [[_mm256_setzero_ps(); 2]; 4];
        let ld = |p: *const u16| _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i));
        let mut i = 0;
        while i < np {
            for (j, a) in acc.iter_mut().enumerate() {
                for (h, ah) in a.iter_mut().enumerate() {
                    let k = i + 16 * j + 8 * h;
                    *ah = _mm256_fmadd_ps(ld(x.add(k)), ld(y.add(k)), *ah);
                }
            }
            i += 64;
        }
        let mut out = [0f32; 16];
        for (h, o) in out.chunks_exact_mut(8).enumerate() {
            let r = _mm256_add_ps(
                _mm256_add_ps(acc[0][h], acc[2][h]),
                _mm256_add_ps(acc[1][h], acc[3][h]),
            );
            _mm256_storeu_ps(o.as_mut_ptr(), r);
        }
        out
    }

    /// [`scale_tail`] with AVX2, 8 at a time.
    ///
    /// # Safety
    /// AVX2, FMA and F16C must be available.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn scale_tail_avx2(y: &mut [u16], v: f32) {
        let n = y.len();
        let vv = _mm256_set1_ps(v);
        let mut i = 0;
        while i + 8 <= n {
            let py = y.as_mut_ptr().add(i) as *mut __m128i;
            let r = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128(py)), vv);
            _mm_storeu_si128(py, _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(r));
            i += 8;
        }
        for a in y[i..].iter_mut() {
            *a = super::f32_to_f16(super::f16_to_f32(*a) * v);
        }
    }

    /// [`mad_tail`] with AVX2, 8 at a time (the rest with the FMA instruction).
    ///
    /// # Safety
    /// AVX2, FMA and F16C must be available.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn mad_tail_avx2(y: &mut [u16], x: &[u16], v: f32) {
        let n = y.len().min(x.len());
        let vv = _mm256_set1_ps(v);
        let mut i = 0;
        while i + 8 <= n {
            let py = y.as_mut_ptr().add(i) as *mut __m128i;
            let ax = _mm256_cvtph_ps(_mm_loadu_si128(x.as_ptr().add(i) as *const __m128i));
            let r = _mm256_fmadd_ps(ax, vv, _mm256_cvtph_ps(_mm_loadu_si128(py)));
            _mm_storeu_si128(py, _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(r));
            i += 8;
        }
        for k in i..n {
            let r = super::f16_to_f32(x[k]).mul_add(v, super::f16_to_f32(y[k]));
            y[k] = super::f32_to_f16(r);
        }
    }

    /// [`super::mad_native`] compiled with FMA (a fused multiply-add instruction instead of
    /// a library call).
    ///
    /// # Safety
    /// FMA must be available.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn mad_native(y: &mut [u16], x: &[u16], v16: f64) {
        super::mad_native(y, x, v16)
    }

    /// [`super::attend_head`] for head sizes that are a multiple of 16 below 128 (where
    /// every accumulator update is the f32-then-f16 path): the f16 accumulator lives in
    /// registers as f32 values rounded to f16 after every update, which is what storing
    /// and reloading it does.
    ///
    /// # Safety
    /// AVX-512F must be available; `h.q.len()` is a multiple of 16 below 128 and equals
    /// `out.len()`.
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    pub(super) unsafe fn attend_head_regs(
        h: &super::HeadAttn<'_>,
        sink: Option<f32>,
        out: &mut [f32],
    ) {
        let hd = h.q.len();
        let nv = hd / 16;
        let mut q16 = [0u16; 128];
        super::f32_to_f16_row(h.q, &mut q16[..hd]);
        let round = |x: __m512| _mm512_cvtph_ps(_mm512_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(x));
        let mut acc = [_mm512_setzero_ps(); 7];
        let (post, inv) = super::online_softmax(
            super::Isa::Avx512,
            h,
            &q16[..hd],
            &mut acc,
            |acc, ms| {
                let v = _mm512_set1_ps(ms);
                for a in acc.iter_mut().take(nv) {
                    *a = round(_mm512_mul_ps(*a, v));
                }
            },
            |acc, vrow, vs| {
                let vv = _mm512_set1_ps(vs);
                for (i, a) in acc.iter_mut().take(nv).enumerate() {
                    let x = _mm512_cvtph_ps(_mm256_loadu_si256(
                        vrow.as_ptr().add(16 * i) as *const __m256i
                    ));
                    *a = round(_mm512_fmadd_ps(x, vv, *a));
                }
            },
            sink,
        );
        let (pv, iv) = (_mm512_set1_ps(post), _mm512_set1_ps(inv));
        for (i, a) in acc.iter().take(nv).enumerate() {
            let a = _mm512_mul_ps(*a, pv);
            _mm512_storeu_ps(out.as_mut_ptr().add(16 * i), _mm512_mul_ps(a, iv));
        }
    }

    /// `y = f16(y * v)` element-wise, 16 at a time.
    ///
    /// # Safety
    /// AVX-512F must be available.
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    pub(super) unsafe fn scale_tail(y: &mut [u16], v: f32) {
        let n = y.len();
        let vv = _mm512_set1_ps(v);
        let mut i = 0;
        while i + 16 <= n {
            let py = y.as_mut_ptr().add(i) as *mut __m256i;
            let r = _mm512_mul_ps(_mm512_cvtph_ps(_mm256_loadu_si256(py)), vv);
            _mm256_storeu_si256(py, _mm512_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(r));
            i += 16;
        }
        for a in y[i..].iter_mut() {
            *a = super::f32_to_f16(super::f16_to_f32(*a) * v);
        }
    }

    /// `y = f16(fma(x, v, y))` element-wise, 16 at a time.
    ///
    /// # Safety
    /// AVX-512F must be available.
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    pub(super) unsafe fn mad_tail(y: &mut [u16], x: &[u16], v: f32) {
        let n = y.len().min(x.len());
        let vv = _mm512_set1_ps(v);
        let mut i = 0;
        while i + 16 <= n {
            let py = y.as_mut_ptr().add(i) as *mut __m256i;
            let ax = _mm512_cvtph_ps(_mm256_loadu_si256(x.as_ptr().add(i) as *const __m256i));
            let ay = _mm512_cvtph_ps(_mm256_loadu_si256(py));
            let r = _mm512_fmadd_ps(ax, vv, ay);
            _mm256_storeu_si256(py, _mm512_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(r));
            i += 16;
        }
        for k in i..n {
            let r = super::f16_to_f32(x[k]).mul_add(v, super::f16_to_f32(y[k]));
            y[k] = super::f32_to_f16(r);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn f64_to_f16_rounds_once() {
        // halfway between 1.0 and the next f16 (1 + 2^-10), plus a tiny bit: rounds up
        let x = 1.0 + 2f64.powi(-11) + 2f64.powi(-40);
        assert_eq!(f64_to_f16(x), f32_to_f16(1.0 + 2f32.powi(-10)));
        // exactly halfway: ties to even (down)
        assert_eq!(f64_to_f16(1.0 + 2f64.powi(-11)), f32_to_f16(1.0));
        assert_eq!(f64_to_f16(-3.5), f32_to_f16(-3.5));
    }

    #[test]
    fn simd_and_scalar_agree() {
        let isas = Isa::available();
        let mut s = 0x1234_5678_9abc_def0u64;
        let mut rnd = || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 4.0 - 2.0
        };
        // both accumulator arithmetics, a window and a soft-cap
        for (hd, native) in [64usize, 80, 128, 256]
            .into_iter()
            .flat_map(|h| [(h, true), (h, false)])
        {
            let n_cells = 37;
            let k: Vec<u16> = (0..hd * n_cells).map(|_| f32_to_f16(rnd())).collect();
            let v: Vec<u16> = (0..hd * n_cells).map(|_| f32_to_f16(rnd())).collect();
            let q: Vec<f32> = (0..hd).map(|_| rnd()).collect();
            let pos: Vec<u32> = (0..n_cells as u32).collect();
            let h = HeadAttn {
                q: &q,
                k: &k,
                v: &v,
                stride: hd,
                offset: 0,
                pos: &pos,
                min_pos: if native { 0 } else { 7 },
                max_pos: 30,
                scale: 1.0 / (hd as f32).sqrt(),
                softcap: if native { 0.0 } else { 5.0 },
                native_f16: native,
            };
            let mut want = vec![0f32; hd];
            attend_head(Isa::Scalar, &h, &mut want);
            for &isa in &isas {
                let mut got = vec![0f32; hd];
                attend_head(isa, &h, &mut got);
                assert_eq!(got, want, "{isa:?} hd {hd} native f16 {native}");
            }
            // sinks below and above every score, and with no visible cell
            for (sink, max_pos) in [(-30.0f32, 30), (30.0, 30), (0.5, 30), (0.5, 3)] {
                let h = HeadAttn {
                    max_pos,
                    min_pos: if max_pos == 3 { 7 } else { h.min_pos },
                    ..h
                };
                let mut want = vec![0f32; hd];
                attend_head_sink(Isa::Scalar, &h, Some(sink), &mut want);
                for &isa in &isas {
                    let mut got = vec![0f32; hd];
                    attend_head_sink(isa, &h, Some(sink), &mut got);
                    assert_eq!(got, want, "{isa:?} hd {hd} sink {sink}");
                }
                if sink == 30.0 {
                    // a sink far above every score takes almost all the weight
                    assert!(want.iter().all(|v| v.abs() < 1e-6), "{want:?}");
                }
                if max_pos == 3 {
                    assert!(want.iter().all(|&v| v == 0.0));
                }
            }
        }
    }
}
