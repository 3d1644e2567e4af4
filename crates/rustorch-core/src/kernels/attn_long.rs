//! Attention for batches of 64 or more query rows. There llama.cpp's CPU flash attention
//! switches to a tiled algorithm (`GGML_FA_TILE_Q`) whose float order `attn.rs` does not
//! reproduce, so bit parity is out of reach either way; this module computes the same
//! online-softmax attention with an f16 accumulator, grouped over the queries sharing a
//! KV head so that keys and values are converted once, with a vectorised `exp`.
//!

use super::cpu::Isa;
use crate::quant::{f16_to_f32, f32_to_f16};

pub use super::attn::{GroupQuery, HeadAttn};

/// Writes the attention output of one head to `out` (`q.len()` values; zeros when no cell
/// is visible).
pub fn attend_head(isa: Isa, h: &HeadAttn<'_>, out: &mut [f32]) {
    let hd = h.q.len();
    debug_assert_eq!(out.len(), hd);
    #[cfg(target_arch = "x86_64")]
    {
        if isa == Isa::Avx512 && hd.is_multiple_of(16) && hd <= 256 {
            // SAFETY: the family was detected; slices are bounds-checked per row inside.
            return unsafe { x86::attend_avx512(h, out) };
        }
        if matches!(isa, Isa::Avx2 | Isa::Avx512) && hd.is_multiple_of(8) && hd <= 256 {
            // SAFETY: as above.
            return unsafe { x86::attend_avx2(h, out) };
        }
    }
    let _ = isa;
    attend_scalar(h, out)
}

/// Several queries (heads of one KV group, tokens of one sequence) over the same key/value
/// rows; `h.q` and `h.max_pos` are ignored. Each output equals what [`attend_head`] computes
/// for that query alone up to the key dot product's summation order, and does not depend on
/// which other queries share the call.
pub fn attend_group(isa: Isa, h: &HeadAttn<'_>, queries: &mut [GroupQuery<'_>]) {
    #[cfg(target_arch = "x86_64")]
    {
        let hd = queries.first().map_or(0, |q| q.q.len());
        if isa == Isa::Avx512 && hd.is_multiple_of(16) && hd > 0 && hd <= 256 {
            let vexp = super::vexp::vexp_enabled(isa);
            for chunk in queries.chunks_mut(x86::MAX_Q) {
                // SAFETY: the family was detected; rows are bounds-checked inside.
                unsafe { x86::attend_group_avx512(h, chunk, vexp) };
            }
            return;
        }
        if matches!(isa, Isa::Avx2 | Isa::Avx512) && hd.is_multiple_of(8) && hd > 0 && hd <= 256 {
            let vexp = super::vexp::vexp_enabled(isa);
            for chunk in queries.chunks_mut(x86::MAX_Q) {
                // SAFETY: as above.
                unsafe { x86::attend_group_avx2(h, chunk, vexp) };
            }
            return;
        }
    }
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

/// The scalar reference.
pub fn attend_scalar(h: &HeadAttn<'_>, out: &mut [f32]) {
    let hd = h.q.len();
    out.fill(0.0);
    let mut qh = [0f32; 256];
    let mut acc = [0u16; 256];
    if hd > 256 {
        return attend_scalar_large(h, out);
    }
    let (qh, acc) = (&mut qh[..hd], &mut acc[..hd]);
    for (d, &x) in qh.iter_mut().zip(h.q) {
        *d = f16_to_f32(f32_to_f16(x));
    }
    let mut m = f32::NEG_INFINITY;
    let mut sum = 0f32;
    for (c, &p) in h.pos.iter().enumerate() {
        if p > h.max_pos || p < h.min_pos {
            continue;
        }
        let base = c * h.stride + h.offset;
        let kr = &h.k[base..base + hd];
        let mut s = 0f32;
        for (a, b) in qh.iter().zip(kr) {
            s += a * f16_to_f32(*b);
        }
        let s = h.cap(s * h.scale);
        let (ms, vs, new_max) = crate::kernels::attn::online_step(&mut m, s);
        if new_max {
            for a in acc.iter_mut() {
                *a = f32_to_f16(f16_to_f32(*a) * ms);
            }
        }
        for (a, b) in acc.iter_mut().zip(&h.v[base..base + hd]) {
            *a = f32_to_f16(f16_to_f32(*a) + f16_to_f32(*b) * vs);
        }
        sum = sum * ms + vs;
    }
    if sum == 0.0 {
        return;
    }
    let inv = 1.0 / sum;
    for (o, a) in out.iter_mut().zip(acc.iter()) {
        *o = f16_to_f32(*a) * inv;
    }
}

fn attend_scalar_large(h: &HeadAttn<'_>, out: &mut [f32]) {
    let hd = h.q.len();
    let qh: Vec<f32> = h.q.iter().map(|&x| f16_to_f32(f32_to_f16(x))).collect();
    let mut acc = vec![0u16; hd];
    let mut m = f32::NEG_INFINITY;
    let mut sum = 0f32;
    for (c, &p) in h.pos.iter().enumerate() {
        if p > h.max_pos || p < h.min_pos {
            continue;
        }
        let base = c * h.stride + h.offset;
        let mut s = 0f32;
        for (a, b) in qh.iter().zip(&h.k[base..base + hd]) {
            s += a * f16_to_f32(*b);
        }
        let s = h.cap(s * h.scale);
        let (ms, vs, new_max) = crate::kernels::attn::online_step(&mut m, s);
        if new_max {
            for a in acc.iter_mut() {
                *a = f32_to_f16(f16_to_f32(*a) * ms);
            }
        }
        for (a, b) in acc.iter_mut().zip(&h.v[base..base + hd]) {
            *a = f32_to_f16(f16_to_f32(*a) + f16_to_f32(*b) * vs);
        }
        sum = sum * ms + vs;
    }
    out.fill(0.0);
    if sum == 0.0 {
        return;
    }
    let inv = 1.0 / sum;
    for (o, a) in out.iter_mut().zip(&acc) {
        *o = f16_to_f32(*a) * inv;
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::HeadAttn;
    use std::arch::x86_64::*;

    const RNE: i32 = _MM_FROUND_TO_NEAREST_INT;

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    pub(super) unsafe fn attend_avx512(h: &HeadAttn<'_>, out: &mut [f32]) {
        let hd = h.q.len();
        let nv = hd / 16;
        let zero = _mm512_setzero_ps();
        // query rounded to f16; accumulator values are f16 numbers held as f32
        let mut q = [zero; 16];
        let mut acc = [zero; 16];
        #[allow(clippy::needless_range_loop)] // indices address several arrays in step
        for i in 0..nv {
            let x = _mm512_loadu_ps(h.q.as_ptr().add(16 * i));
            q[i] = _mm512_cvtph_ps(_mm512_cvtps_ph::<RNE>(x));
        }
        let mut m = f32::NEG_INFINITY;
        let mut sum = 0f32;
        let (kp, vp) = (h.k.as_ptr(), h.v.as_ptr());
        for (c, &p) in h.pos.iter().enumerate() {
            if p > h.max_pos || p < h.min_pos {
                continue;
            }
            let base = c * h.stride + h.offset;
            assert!(base + hd <= h.k.len() && base + hd <= h.v.len());
            let mut s0 = zero;
            let mut s1 = zero;
            let mut i = 0;
            while i + 1 < nv {
                let k0 =
                    _mm512_cvtph_ps(_mm256_loadu_si256(kp.add(base + 16 * i) as *const __m256i));
                let k1 = _mm512_cvtph_ps(_mm256_loadu_si256(
                    kp.add(base + 16 * i + 16) as *const __m256i
                ));
                s0 = _mm512_fmadd_ps(q[i], k0, s0);
                s1 = _mm512_fmadd_ps(q[i + 1], k1, s1);
                i += 2;
            }
            if i < nv {
                let k0 =
                    _mm512_cvtph_ps(_mm256_loadu_si256(kp.add(base + 16 * i) as *const __m256i));
                s0 = _mm512_fmadd_ps(q[i], k0, s0);
            }
            let s = h.cap(_mm512_reduce_add_ps(_mm512_add_ps(s0, s1)) * h.scale);
            let (ms, vs, new_max) = crate::kernels::attn::online_step(&mut m, s);
            if new_max {
                let msv = _mm512_set1_ps(ms);
                for a in acc.iter_mut().take(nv) {
                    *a = _mm512_cvtph_ps(_mm512_cvtps_ph::<RNE>(_mm512_mul_ps(*a, msv)));
                }
            }
            let vsv = _mm512_set1_ps(vs);
            for (i, a) in acc.iter_mut().enumerate().take(nv) {
                let v =
                    _mm512_cvtph_ps(_mm256_loadu_si256(vp.add(base + 16 * i) as *const __m256i));
                let t = _mm512_add_ps(*a, _mm512_mul_ps(v, vsv));
                *a = _mm512_cvtph_ps(_mm512_cvtps_ph::<RNE>(t));
            }
            sum = sum * ms + vs;
        }
        if sum == 0.0 {
            out.fill(0.0);
            return;
        }
        let inv = _mm512_set1_ps(1.0 / sum);
        for (i, a) in acc.iter().enumerate().take(nv) {
            _mm512_storeu_ps(out.as_mut_ptr().add(16 * i), _mm512_mul_ps(*a, inv));
        }
    }

    /// One query's scaled scores of a chunk's cells (`sc`), in cell order, as
    /// [`crate::kernels::attn::online_step`] takes them: each visible cell (bit of `mk`)
    /// gets the exponent argument `m - s` where its score `s` is a new maximum (its bit set
    /// in the returned mask: the accumulator is rescaled) and `s - m` otherwise; `m` ends at
    /// the chunk's maximum.
    #[inline(always)]
    fn scan_chunk(sc: &[f32], mk: u32, m: &mut f32, arg: &mut [f32]) -> u32 {
        let mut resc = 0u32;
        for (c, (&s, a)) in sc.iter().zip(arg.iter_mut()).enumerate() {
            if mk & (1 << c) == 0 {
                continue;
            }
            if s > *m {
                *a = *m - s;
                resc |= 1 << c;
                *m = s;
            } else {
                *a = s - *m;
            }
        }
        resc
    }

    /// `exp` of the visible cells' arguments (glibc's `expf`), where no vector `exp` is used.
    #[inline(always)]
    fn exp_visible(arg: &[f32], mk: u32, ex: &mut [f32]) {
        for (c, (&a, e)) in arg.iter().zip(ex.iter_mut()).enumerate() {
            if mk & (1 << c) != 0 {
                *e = a.exp();
            }
        }
    }

    pub(super) const MAX_Q: usize = 16;
    const CH: usize = 16;

    /// Folds 16 vectors into one whose lane `i` is the sum of the lanes of `z[i]`.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn transpose_sum16(z: &[__m512; 16]) -> __m512 {
        let e = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
        let o = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
        let pair = |a: __m512, b: __m512| {
            _mm512_add_ps(
                _mm512_permutex2var_ps(a, e, b),
                _mm512_permutex2var_ps(a, o, b),
            )
        };
        let y: [__m512; 8] = std::array::from_fn(|i| pair(z[2 * i], z[2 * i + 1]));
        let x: [__m512; 4] = std::array::from_fn(|i| pair(y[2 * i], y[2 * i + 1]));
        let w0 = pair(x[0], x[1]);
        let w1 = pair(x[2], x[3]);
        pair(w0, w1)
    }

    /// What the value update of one 16-cell chunk needs.
    struct VState<'a> {
        masks: &'a [u32; MAX_Q],
        resc: &'a [u32; MAX_Q],
        ex: &'a [[f32; 16]; MAX_Q],
        vp: *const f32,
        accp: *mut f32,
        hd: usize,
        nc: usize,
    }

    /// The value update for queries `j0..j0 + P` (head size `16 * NV`), accumulators in
    /// registers.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn vupdate<const NV: usize, const P: usize>(
        st: &VState<'_>,
        j0: usize,
        sum: &mut [f32; MAX_Q],
    ) {
        let mut a = [[_mm512_setzero_ps(); NV]; P];
        for (jj, aj) in a.iter_mut().enumerate() {
            for (i, ai) in aj.iter_mut().enumerate() {
                *ai = _mm512_loadu_ps(st.accp.add((j0 + jj) * st.hd + 16 * i));
            }
        }
        for c in 0..st.nc {
            for (jj, aj) in a.iter_mut().enumerate() {
                let j = j0 + jj;
                if st.masks[j] & (1 << c) == 0 {
                    continue;
                }
                let e = st.ex[j][c];
                let (ms, vs) = if st.resc[j] & (1 << c) != 0 {
                    let msv = _mm512_set1_ps(e);
                    for ai in aj.iter_mut() {
                        *ai = _mm512_cvtph_ps(_mm512_cvtps_ph::<RNE>(_mm512_mul_ps(*ai, msv)));
                    }
                    (e, 1.0f32)
                } else {
                    (1.0f32, e)
                };
                let vsv = _mm512_set1_ps(vs);
                for (i, ai) in aj.iter_mut().enumerate() {
                    let t = _mm512_add_ps(
                        *ai,
                        _mm512_mul_ps(_mm512_loadu_ps(st.vp.add(c * st.hd + 16 * i)), vsv),
                    );
                    *ai = _mm512_cvtph_ps(_mm512_cvtps_ph::<RNE>(t));
                }
                sum[j] = sum[j] * ms + vs;
            }
        }
        for (jj, aj) in a.iter().enumerate() {
            for (i, ai) in aj.iter().enumerate() {
                _mm512_storeu_ps(st.accp.add((j0 + jj) * st.hd + 16 * i), *ai);
            }
        }
    }

    /// [`vupdate`] for one query of any head size (multiple of 16).
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn vupdate_any(st: &VState<'_>, j: usize, nv: usize, sum: &mut [f32; MAX_Q]) {
        let ap = st.accp.add(j * st.hd);
        for c in 0..st.nc {
            if st.masks[j] & (1 << c) == 0 {
                continue;
            }
            let e = st.ex[j][c];
            let rescale = st.resc[j] & (1 << c) != 0;
            let (ms, vs) = if rescale { (e, 1.0f32) } else { (1.0f32, e) };
            for i in 0..nv {
                let mut a = _mm512_loadu_ps(ap.add(16 * i));
                if rescale {
                    a = _mm512_cvtph_ps(_mm512_cvtps_ph::<RNE>(_mm512_mul_ps(
                        a,
                        _mm512_set1_ps(ms),
                    )));
                }
                let t = _mm512_add_ps(
                    a,
                    _mm512_mul_ps(
                        _mm512_loadu_ps(st.vp.add(c * st.hd + 16 * i)),
                        _mm512_set1_ps(vs),
                    ),
                );
                _mm512_storeu_ps(ap.add(16 * i), _mm512_cvtph_ps(_mm512_cvtps_ph::<RNE>(t)));
            }
            sum[j] = sum[j] * ms + vs;
        }
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    pub(super) unsafe fn attend_group_avx512(
        h: &HeadAttn<'_>,
        qs: &mut [super::GroupQuery<'_>],
        vexp: bool,
    ) {
        let nq = qs.len();
        let hd = qs[0].q.len();
        let nv = hd / 16;
        let zero = _mm512_setzero_ps();
        use std::mem::MaybeUninit;
        // Scratch rows of `hd` floats (only written parts are ever read).
        let mut qbuf = MaybeUninit::<[f32; MAX_Q * 256]>::uninit();
        let mut abuf = MaybeUninit::<[f32; MAX_Q * 256]>::uninit();
        let mut kbuf = MaybeUninit::<[f32; CH * 256]>::uninit();
        let mut vbuf = MaybeUninit::<[f32; CH * 256]>::uninit();
        let (qp, accp) = (qbuf.as_mut_ptr() as *mut f32, abuf.as_mut_ptr() as *mut f32);
        let (kp, vp) = (kbuf.as_mut_ptr() as *mut f32, vbuf.as_mut_ptr() as *mut f32);
        let vp_const = vp as *const f32;
        let mut m = [f32::NEG_INFINITY; MAX_Q];
        let mut sum = [0f32; MAX_Q];
        for (j, gq) in qs.iter().enumerate() {
            assert_eq!(gq.q.len(), hd);
            for i in 0..nv {
                let x = _mm512_loadu_ps(gq.q.as_ptr().add(16 * i));
                _mm512_storeu_ps(
                    qp.add(j * hd + 16 * i),
                    _mm512_cvtph_ps(_mm512_cvtps_ph::<RNE>(x)),
                );
                _mm512_storeu_ps(accp.add(j * hd + 16 * i), zero);
            }
        }
        let ncell = h.pos.len();
        let mut c0 = 0;
        while c0 < ncell {
            let nc = (ncell - c0).min(CH);
            let mut masks = [0u32; MAX_Q];
            let mut any = 0u32;
            let valid: u32 = if nc == 16 { 0xffff } else { (1u32 << nc) - 1 };
            let pv = _mm512_maskz_loadu_epi32(valid as u16, h.pos.as_ptr().add(c0) as *const i32);
            for (j, gq) in qs.iter().enumerate() {
                let below = _mm512_mask_cmple_epu32_mask(
                    valid as u16,
                    pv,
                    _mm512_set1_epi32(gq.max_pos as i32),
                );
                let mk =
                    _mm512_mask_cmpge_epu32_mask(below, pv, _mm512_set1_epi32(gq.min_pos as i32))
                        as u32;
                masks[j] = mk;
                any |= mk;
            }
            if any == 0 {
                c0 += nc;
                continue;
            }
            for c in 0..nc {
                if any & (1 << c) == 0 {
                    continue;
                }
                let base = (c0 + c) * h.stride + h.offset;
                assert!(base + hd <= h.k.len() && base + hd <= h.v.len());
                for i in 0..nv {
                    let k = _mm512_cvtph_ps(_mm256_loadu_si256(
                        h.k.as_ptr().add(base + 16 * i) as *const __m256i
                    ));
                    let v = _mm512_cvtph_ps(_mm256_loadu_si256(
                        h.v.as_ptr().add(base + 16 * i) as *const __m256i
                    ));
                    _mm512_storeu_ps(kp.add(c * hd + 16 * i), k);
                    _mm512_storeu_ps(vp.add(c * hd + 16 * i), v);
                }
            }
            // phase 1, per query: the 16 scores, the online-max scan (exponent arguments in
            // cell order) and one vector exp
            let mut ex = [[0f32; 16]; MAX_Q];
            let mut resc = [0u32; MAX_Q];
            for j in 0..nq {
                let mk = masks[j];
                if mk == 0 {
                    continue;
                }
                let mut z = [zero; 16];
                for (c, zc) in z.iter_mut().enumerate().take(nc) {
                    if mk & (1 << c) == 0 {
                        continue;
                    }
                    let mut a = zero;
                    for i in 0..nv {
                        a = _mm512_fmadd_ps(
                            _mm512_loadu_ps(qp.add(j * hd + 16 * i)),
                            _mm512_loadu_ps(kp.add(c * hd + 16 * i)),
                            a,
                        );
                    }
                    *zc = a;
                }
                let sv = _mm512_mul_ps(transpose_sum16(&z), _mm512_set1_ps(h.scale));
                let mut sc = [0f32; 16];
                _mm512_storeu_ps(sc.as_mut_ptr(), sv);
                if h.softcap != 0.0 {
                    for v in sc.iter_mut() {
                        *v = h.cap(*v);
                    }
                }
                let mut arg = [0f32; 16];
                resc[j] = scan_chunk(&sc[..nc], mk, &mut m[j], &mut arg[..nc]);
                if vexp {
                    _mm512_storeu_ps(
                        ex[j].as_mut_ptr(),
                        super::super::vexp::x86::exp16(_mm512_loadu_ps(arg.as_ptr())),
                    );
                } else {
                    exp_visible(&arg[..nc], mk, &mut ex[j]);
                }
            }
            // phase 2: weighted values into the f16 accumulators, several queries at a time
            // so that their (latency-bound) update chains overlap
            let st = VState {
                masks: &masks,
                resc: &resc,
                ex: &ex,
                vp: vp_const,
                accp,
                hd,
                nc,
            };
            let mut j0 = 0;
            while j0 < nq {
                match nv {
                    4 if j0 + 4 <= nq => vupdate::<4, 4>(&st, j0, &mut sum),
                    8 if j0 + 2 <= nq => vupdate::<8, 2>(&st, j0, &mut sum),
                    4 => vupdate::<4, 1>(&st, j0, &mut sum),
                    8 => vupdate::<8, 1>(&st, j0, &mut sum),
                    // head size 256 (Gemma): 16 accumulators, half the register file
                    16 => vupdate::<16, 1>(&st, j0, &mut sum),
                    _ => vupdate_any(&st, j0, nv, &mut sum),
                }
                j0 += match nv {
                    4 if j0 + 4 <= nq => 4,
                    8 if j0 + 2 <= nq => 2,
                    _ => 1,
                };
            }
            c0 += nc;
        }
        for (j, gq) in qs.iter_mut().enumerate() {
            assert_eq!(gq.out.len(), hd);
            if sum[j] == 0.0 {
                gq.out.fill(0.0);
                continue;
            }
            let inv = _mm512_set1_ps(1.0 / sum[j]);
            for i in 0..nv {
                let a = _mm512_loadu_ps(accp.add(j * hd + 16 * i));
                _mm512_storeu_ps(gq.out.as_mut_ptr().add(16 * i), _mm512_mul_ps(a, inv));
            }
        }
    }

    /// Lane `i` is the sum of the lanes of `z[i]`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn transpose_sum8(z: &[__m256; 8]) -> __m256 {
        let t0 = _mm256_hadd_ps(z[0], z[1]);
        let t1 = _mm256_hadd_ps(z[2], z[3]);
        let t2 = _mm256_hadd_ps(z[4], z[5]);
        let t3 = _mm256_hadd_ps(z[6], z[7]);
        // per 128-bit half: lanes 0-3 the half-sums of z[0..4], of z[4..8]
        let u0 = _mm256_hadd_ps(t0, t1);
        let u1 = _mm256_hadd_ps(t2, t3);
        _mm256_add_ps(
            _mm256_permute2f128_ps::<0x20>(u0, u1),
            _mm256_permute2f128_ps::<0x31>(u0, u1),
        )
    }

    /// What the value update of one 8-cell chunk needs (AVX2).
    struct VState8<'a> {
        masks: &'a [u32; MAX_Q],
        resc: &'a [u32; MAX_Q],
        ex: &'a [[f32; 8]; MAX_Q],
        vp: *const f32,
        accp: *mut f32,
        hd: usize,
        nc: usize,
    }

    /// The value update for queries `j0..j0 + P` (head size `8 * NV`), accumulators in
    /// registers; the arithmetic of [`attend_avx2`]'s update, cell by cell.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn vupdate8<const NV: usize, const P: usize>(
        st: &VState8<'_>,
        j0: usize,
        sum: &mut [f32; MAX_Q],
    ) {
        let mut a = [[_mm256_setzero_ps(); NV]; P];
        for (jj, aj) in a.iter_mut().enumerate() {
            for (i, ai) in aj.iter_mut().enumerate() {
                *ai = _mm256_loadu_ps(st.accp.add((j0 + jj) * st.hd + 8 * i));
            }
        }
        for c in 0..st.nc {
            for (jj, aj) in a.iter_mut().enumerate() {
                let j = j0 + jj;
                if st.masks[j] & (1 << c) == 0 {
                    continue;
                }
                let e = st.ex[j][c];
                let (ms, vs) = if st.resc[j] & (1 << c) != 0 {
                    let msv = _mm256_set1_ps(e);
                    for ai in aj.iter_mut() {
                        *ai = _mm256_cvtph_ps(_mm256_cvtps_ph::<RNE>(_mm256_mul_ps(*ai, msv)));
                    }
                    (e, 1.0f32)
                } else {
                    (1.0f32, e)
                };
                let vsv = _mm256_set1_ps(vs);
                for (i, ai) in aj.iter_mut().enumerate() {
                    let t = _mm256_add_ps(
                        *ai,
                        _mm256_mul_ps(_mm256_loadu_ps(st.vp.add(c * st.hd + 8 * i)), vsv),
                    );
                    *ai = _mm256_cvtph_ps(_mm256_cvtps_ph::<RNE>(t));
                }
                sum[j] = sum[j] * ms + vs;
            }
        }
        for (jj, aj) in a.iter().enumerate() {
            for (i, ai) in aj.iter().enumerate() {
                _mm256_storeu_ps(st.accp.add((j0 + jj) * st.hd + 8 * i), *ai);
            }
        }
    }

    /// [`vupdate8`] for one query of any head size (multiple of 8), accumulators in memory.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn vupdate8_any(st: &VState8<'_>, j: usize, nv: usize, sum: &mut [f32; MAX_Q]) {
        let ap = st.accp.add(j * st.hd);
        for c in 0..st.nc {
            if st.masks[j] & (1 << c) == 0 {
                continue;
            }
            let e = st.ex[j][c];
            let rescale = st.resc[j] & (1 << c) != 0;
            let (ms, vs) = if rescale { (e, 1.0f32) } else { (1.0f32, e) };
            let (msv, vsv) = (_mm256_set1_ps(ms), _mm256_set1_ps(vs));
            for i in 0..nv {
                let mut a = _mm256_loadu_ps(ap.add(8 * i));
                if rescale {
                    a = _mm256_cvtph_ps(_mm256_cvtps_ph::<RNE>(_mm256_mul_ps(a, msv)));
                }
                let t = _mm256_add_ps(
                    a,
                    _mm256_mul_ps(_mm256_loadu_ps(st.vp.add(c * st.hd + 8 * i)), vsv),
                );
                _mm256_storeu_ps(ap.add(8 * i), _mm256_cvtph_ps(_mm256_cvtps_ph::<RNE>(t)));
            }
            sum[j] = sum[j] * ms + vs;
        }
    }

    /// [`attend_group_avx512`] with 8-wide vectors: up to [`MAX_Q`] queries over the same
    /// cells in chunks of 8, each chunk's keys and values converted from f16 once, the
    /// chunk's 8 scores of a query summed by one transpose and exponentiated by one vector
    /// `exp` (glibc's `expf` to the bit, `vexp`). Each output is [`attend_avx2`]'s for that
    /// query up to the key dot product's summation order.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn attend_group_avx2(
        h: &HeadAttn<'_>,
        qs: &mut [super::GroupQuery<'_>],
        vexp: bool,
    ) {
        const CH8: usize = 8;
        let nq = qs.len();
        assert!(nq <= MAX_Q);
        let hd = qs[0].q.len();
        let nv = hd / 8;
        let wide16 = hd.is_multiple_of(16);
        let zero = _mm256_setzero_ps();
        use std::mem::MaybeUninit;
        // Scratch rows of `hd` floats (only written parts are ever read).
        let mut qbuf = MaybeUninit::<[f32; MAX_Q * 256]>::uninit();
        let mut abuf = MaybeUninit::<[f32; MAX_Q * 256]>::uninit();
        let mut kbuf = MaybeUninit::<[f32; CH8 * 256]>::uninit();
        let mut vbuf = MaybeUninit::<[f32; CH8 * 256]>::uninit();
        let (qp, accp) = (qbuf.as_mut_ptr() as *mut f32, abuf.as_mut_ptr() as *mut f32);
        let (kp, vp) = (kbuf.as_mut_ptr() as *mut f32, vbuf.as_mut_ptr() as *mut f32);
        let mut m = [f32::NEG_INFINITY; MAX_Q];
        let mut sum = [0f32; MAX_Q];
        for (j, gq) in qs.iter().enumerate() {
            assert_eq!(gq.q.len(), hd);
            for i in 0..nv {
                let x = _mm256_loadu_ps(gq.q.as_ptr().add(8 * i));
                _mm256_storeu_ps(
                    qp.add(j * hd + 8 * i),
                    _mm256_cvtph_ps(_mm256_cvtps_ph::<RNE>(x)),
                );
                _mm256_storeu_ps(accp.add(j * hd + 8 * i), zero);
            }
        }
        let ncell = h.pos.len();
        let mut c0 = 0;
        while c0 < ncell {
            let nc = (ncell - c0).min(CH8);
            let mut masks = [0u32; MAX_Q];
            let mut any = 0u32;
            for (j, gq) in qs.iter().enumerate() {
                let mut mk = 0u32;
                for c in 0..nc {
                    let p = h.pos[c0 + c];
                    if p <= gq.max_pos && p >= gq.min_pos {
                        mk |= 1 << c;
                    }
                }
                masks[j] = mk;
                any |= mk;
            }
            if any == 0 {
                c0 += nc;
                continue;
            }
            for c in 0..nc {
                if any & (1 << c) == 0 {
                    continue;
                }
                let base = (c0 + c) * h.stride + h.offset;
                assert!(base + hd <= h.k.len() && base + hd <= h.v.len());
                for i in 0..nv {
                    let k = _mm256_cvtph_ps(_mm_loadu_si128(
                        h.k.as_ptr().add(base + 8 * i) as *const __m128i
                    ));
                    let v = _mm256_cvtph_ps(_mm_loadu_si128(
                        h.v.as_ptr().add(base + 8 * i) as *const __m128i
                    ));
                    _mm256_storeu_ps(kp.add(c * hd + 8 * i), k);
                    _mm256_storeu_ps(vp.add(c * hd + 8 * i), v);
                }
            }
            // phase 1, per query: the 8 scores, the online-max scan (exponent arguments in
            // cell order) and one vector exp
            let mut ex = [[0f32; 8]; MAX_Q];
            let mut resc = [0u32; MAX_Q];
            for j in 0..nq {
                let mk = masks[j];
                if mk == 0 {
                    continue;
                }
                // Head sizes that are a multiple of 16 sum each key dot as the AVX-512
                // kernel does (one accumulator per 16 elements' lane: here its two halves,
                // `z` and `zh`, then the same tree), so that both levels give the same
                // scores; other head sizes in 8-wide steps.
                let mut z = [zero; 8];
                let mut zh = [zero; 8];
                for (c, (zc, zhc)) in z.iter_mut().zip(zh.iter_mut()).enumerate().take(nc) {
                    if mk & (1 << c) == 0 {
                        continue;
                    }
                    let (q, k) = (qp.add(j * hd), kp.add(c * hd));
                    if wide16 {
                        let (mut lo, mut hi) = (zero, zero);
                        for i in 0..nv / 2 {
                            let (a, b) = (16 * i, 16 * i + 8);
                            lo = _mm256_fmadd_ps(
                                _mm256_loadu_ps(q.add(a)),
                                _mm256_loadu_ps(k.add(a)),
                                lo,
                            );
                            hi = _mm256_fmadd_ps(
                                _mm256_loadu_ps(q.add(b)),
                                _mm256_loadu_ps(k.add(b)),
                                hi,
                            );
                        }
                        *zc = lo;
                        *zhc = hi;
                    } else {
                        let mut a = zero;
                        for i in 0..nv {
                            a = _mm256_fmadd_ps(
                                _mm256_loadu_ps(q.add(8 * i)),
                                _mm256_loadu_ps(k.add(8 * i)),
                                a,
                            );
                        }
                        *zc = a;
                    }
                }
                let dots = if wide16 {
                    _mm256_add_ps(transpose_sum8(&z), transpose_sum8(&zh))
                } else {
                    transpose_sum8(&z)
                };
                let sv = _mm256_mul_ps(dots, _mm256_set1_ps(h.scale));
                let mut sc = [0f32; 8];
                _mm256_storeu_ps(sc.as_mut_ptr(), sv);
                if h.softcap != 0.0 {
                    for v in sc.iter_mut() {
                        *v = h.cap(*v);
                    }
                }
                let mut arg = [0f32; 8];
                resc[j] = scan_chunk(&sc[..nc], mk, &mut m[j], &mut arg[..nc]);
                if vexp {
                    _mm256_storeu_ps(
                        ex[j].as_mut_ptr(),
                        super::super::vexp::x86::exp8(_mm256_loadu_ps(arg.as_ptr())),
                    );
                } else {
                    exp_visible(&arg[..nc], mk, &mut ex[j]);
                }
            }
            // phase 2: weighted values into the f16 accumulators, several queries at a time
            // where the registers hold them
            let st = VState8 {
                masks: &masks,
                resc: &resc,
                ex: &ex,
                vp: vp as *const f32,
                accp,
                hd,
                nc,
            };
            let mut j0 = 0;
            while j0 < nq {
                let step = match nv {
                    4 if j0 + 2 <= nq => {
                        vupdate8::<4, 2>(&st, j0, &mut sum);
                        2
                    }
                    4 => {
                        vupdate8::<4, 1>(&st, j0, &mut sum);
                        1
                    }
                    8 => {
                        vupdate8::<8, 1>(&st, j0, &mut sum);
                        1
                    }
                    _ => {
                        vupdate8_any(&st, j0, nv, &mut sum);
                        1
                    }
                };
                j0 += step;
            }
            c0 += nc;
        }
        for (j, gq) in qs.iter_mut().enumerate() {
            assert_eq!(gq.out.len(), hd);
            if sum[j] == 0.0 {
                gq.out.fill(0.0);
                continue;
            }
            let inv = _mm256_set1_ps(1.0 / sum[j]);
            for i in 0..nv {
                let a = _mm256_loadu_ps(accp.add(j * hd + 8 * i));
                _mm256_storeu_ps(gq.out.as_mut_ptr().add(8 * i), _mm256_mul_ps(a, inv));
            }
        }
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn hsum(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_movehdup_ps(s));
        _mm_cvtss_f32(s)
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn attend_avx2(h: &HeadAttn<'_>, out: &mut [f32]) {
        let hd = h.q.len();
        let nv = hd / 8;
        let mut q = [0f32; 256];
        let mut acc = [0f32; 256];
        for i in 0..nv {
            let x = _mm256_loadu_ps(h.q.as_ptr().add(8 * i));
            _mm256_storeu_ps(
                q.as_mut_ptr().add(8 * i),
                _mm256_cvtph_ps(_mm256_cvtps_ph::<RNE>(x)),
            );
        }
        let mut m = f32::NEG_INFINITY;
        let mut sum = 0f32;
        let (kp, vp) = (h.k.as_ptr(), h.v.as_ptr());
        let (qp, ap) = (q.as_ptr(), acc.as_mut_ptr());
        for (c, &p) in h.pos.iter().enumerate() {
            if p > h.max_pos || p < h.min_pos {
                continue;
            }
            let base = c * h.stride + h.offset;
            assert!(base + hd <= h.k.len() && base + hd <= h.v.len());
            let mut s0 = _mm256_setzero_ps();
            let mut s1 = _mm256_setzero_ps();
            let mut i = 0;
            while i + 1 < nv {
                let k0 = _mm256_cvtph_ps(_mm_loadu_si128(kp.add(base + 8 * i) as *const __m128i));
                let k1 =
                    _mm256_cvtph_ps(_mm_loadu_si128(kp.add(base + 8 * i + 8) as *const __m128i));
                s0 = _mm256_fmadd_ps(_mm256_loadu_ps(qp.add(8 * i)), k0, s0);
                s1 = _mm256_fmadd_ps(_mm256_loadu_ps(qp.add(8 * i + 8)), k1, s1);
                i += 2;
            }
            if i < nv {
                let k0 = _mm256_cvtph_ps(_mm_loadu_si128(kp.add(base + 8 * i) as *const __m128i));
                s0 = _mm256_fmadd_ps(_mm256_loadu_ps(qp.add(8 * i)), k0, s0);
            }
            let s = h.cap(hsum(_mm256_add_ps(s0, s1)) * h.scale);
            let (ms, vs, new_max) = crate::kernels::attn::online_step(&mut m, s);
            if new_max {
                let msv = _mm256_set1_ps(ms);
                for i in 0..nv {
                    let a = _mm256_mul_ps(_mm256_loadu_ps(ap.add(8 * i)), msv);
                    _mm256_storeu_ps(ap.add(8 * i), _mm256_cvtph_ps(_mm256_cvtps_ph::<RNE>(a)));
                }
            }
            let vsv = _mm256_set1_ps(vs);
            for i in 0..nv {
                let v = _mm256_cvtph_ps(_mm_loadu_si128(vp.add(base + 8 * i) as *const __m128i));
                let t = _mm256_add_ps(_mm256_loadu_ps(ap.add(8 * i)), _mm256_mul_ps(v, vsv));
                _mm256_storeu_ps(ap.add(8 * i), _mm256_cvtph_ps(_mm256_cvtps_ph::<RNE>(t)));
            }
            sum = sum * ms + vs;
        }
        if sum == 0.0 {
            out.fill(0.0);
            return;
        }
        let inv = _mm256_set1_ps(1.0 / sum);
        for i in 0..nv {
            _mm256_storeu_ps(
                out.as_mut_ptr().add(8 * i),
                _mm256_mul_ps(_mm256_loadu_ps(ap.add(8 * i)), inv),
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::f32_to_f16;

    /// Deterministic values in (-1, 1).
    fn noise(seed: u64, n: usize) -> Vec<f32> {
        let mut s = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (0..n)
            .map(|_| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            })
            .collect()
    }

    /// Random keys, values and queries for one KV head (the second of two) over `ncell`
    /// cells; query j sees cells up to ncell - 1 - 3j, every third one a window of 16.
    struct Case {
        hd: usize,
        k: Vec<u16>,
        v: Vec<u16>,
        pos: Vec<u32>,
        q: Vec<f32>,
        bounds: Vec<(u32, u32)>,
        softcap: f32,
    }

    impl Case {
        fn new(hd: usize, nq: usize, ncell: usize, softcap: f32) -> Case {
            let kvd = 2 * hd;
            let half = |seed| -> Vec<u16> {
                noise(seed, ncell * kvd)
                    .iter()
                    .map(|&x| f32_to_f16(x))
                    .collect()
            };
            let bounds = (0..nq)
                .map(|j| {
                    let hi = (ncell - 1).saturating_sub(3 * j) as u32;
                    let lo = if j % 3 == 2 { hi.saturating_sub(15) } else { 0 };
                    (lo, hi)
                })
                .collect();
            Case {
                hd,
                k: half(1),
                v: half(2),
                pos: (0..ncell as u32).collect(),
                q: noise(3, nq * hd),
                bounds,
                softcap,
            }
        }

        fn head(&self) -> HeadAttn<'_> {
            let scale = 1.0 / (self.hd as f32).sqrt();
            HeadAttn {
                q: &[],
                k: &self.k,
                v: &self.v,
                stride: 2 * self.hd,
                offset: self.hd,
                pos: &self.pos,
                min_pos: 0,
                max_pos: 0,
                scale: if self.softcap != 0.0 {
                    scale / self.softcap
                } else {
                    scale
                },
                softcap: self.softcap,
                native_f16: false,
            }
        }

        /// Every query's output from one grouped call.
        fn grouped(&self, isa: Isa) -> Vec<f32> {
            let hd = self.hd;
            let mut outs = vec![0f32; self.bounds.len() * hd];
            let mut queries: Vec<GroupQuery<'_>> = outs
                .chunks_mut(hd)
                .enumerate()
                .map(|(j, out)| GroupQuery {
                    q: &self.q[j * hd..(j + 1) * hd],
                    min_pos: self.bounds[j].0,
                    max_pos: self.bounds[j].1,
                    out,
                })
                .collect();
            attend_group(isa, &self.head(), &mut queries);
            drop(queries);
            outs
        }
    }

    /// The grouped kernels of every level this CPU has give each query what the one-query
    /// kernel of that level gives it (up to the key dot product's summation order: within a
    /// few f16 steps of the accumulator), for head sizes 32 to 256, causal and sliding
    /// windows, soft-capping, and more queries than one call takes.
    #[test]
    fn grouped_equals_one_query() {
        for isa in Isa::available() {
            for &(hd, nq, ncell, softcap) in &[
                (64usize, 12usize, 100usize, 0.0f32),
                (32, 20, 37, 0.0),
                (128, 5, 70, 0.0),
                (256, 3, 41, 30.0),
                (72, 4, 19, 0.0),
            ] {
                let case = Case::new(hd, nq, ncell, softcap);
                let outs = case.grouped(isa);
                for j in 0..nq {
                    let one = HeadAttn {
                        q: &case.q[j * hd..(j + 1) * hd],
                        min_pos: case.bounds[j].0,
                        max_pos: case.bounds[j].1,
                        ..case.head()
                    };
                    let mut want = vec![0f32; hd];
                    attend_head(isa, &one, &mut want);
                    let got = &outs[j * hd..(j + 1) * hd];
                    let amax = want.iter().fold(0f32, |a, &x| a.max(x.abs()));
                    assert!(amax > 0.0, "{isa:?} hd {hd} query {j}: empty output");
                    for (i, (&g, &w)) in got.iter().zip(&want).enumerate() {
                        assert!(
                            (g - w).abs() <= 4e-3 * amax,
                            "{isa:?} hd {hd} query {j} value {i}: grouped {g}, one query {w}"
                        );
                    }
                }
            }
        }
    }

    /// For head sizes that are a multiple of 16 the AVX2 grouped kernel sums each key dot
    /// as the AVX-512 one does, so a long prompt's attention (and the text after it) does
    /// not depend on which of the two levels the CPU has: every output equal to the bit.
    #[test]
    fn avx2_equals_avx512_on_heads_of_16() {
        let levels = Isa::available();
        if !levels.contains(&Isa::Avx512) || !levels.contains(&Isa::Avx2) {
            eprintln!("SKIPPED: avx2_equals_avx512_on_heads_of_16: this CPU lacks AVX-512");
            return;
        }
        for &(hd, nq, ncell, softcap) in &[
            (64usize, 12usize, 100usize, 0.0f32),
            (128, 5, 70, 0.0),
            (256, 3, 41, 30.0),
            (64, 16, 300, 0.0),
        ] {
            let case = Case::new(hd, nq, ncell, softcap);
            let (a, b) = (case.grouped(Isa::Avx2), case.grouped(Isa::Avx512));
            for (i, (x, y)) in a.iter().zip(&b).enumerate() {
                assert_eq!(
                    x.to_bits(),
                    y.to_bits(),
                    "hd {hd} value {i}: AVX2 {x}, AVX-512 {y}"
                );
            }
        }
    }
}
