//! llama.cpp's tiled flash attention (`ggml_compute_forward_flash_attn_ext_tiled`: prompt
//! batches of 64 or more query rows over an f16 or f32 cache) with its float steps, so that
//! long prompts give llama.cpp's values to the bit as short ones do. Per query row, the
//! cells in tiles of 64 from cell 0:
//!   - scores: the f32 query (not rounded to f16) against the keys converted to f32, one
//!     fused multiply-add chain per cell over the head's elements in order, from 0 (ggml's
//!     `simd_gemm`, the same per element at every vector width); times `scale`; with
//!     soft-capping `softcap · tanhf(s)`; invisible cells −∞;
//!   - the tile's maximum; on a new running maximum the accumulator and the sum are scaled
//!     by `expf(M_old − M_new)` (the C library's `expf`);
//!   - weights `ggml_v_expf(s − M)` (its AVX-512 build, `gexp`), summed per 16 cells by
//!     `_mm512_reduce_add_ps`'s tree, the four sums added in f64 to the running sum;
//!   - the f32 accumulator: per element one fused multiply-add per cell, in order;
//!
//! then the output `acc · (1 / S)`. Every step is element-wise, so the kernel is the same at
//! every x86 level.

use super::cpu::Isa;
use crate::quant::f16_to_f32_row;

pub use super::attn::{GroupQuery, HeadAttn};

const TILE: usize = 64;

/// The attention outputs of the queries sharing one KV head (`h`: keys, values, positions,
/// scale; its `q`, `min_pos` and `max_pos` are unused).
pub fn attend_group(isa: Isa, h: &HeadAttn<'_>, queries: &mut [GroupQuery<'_>]) {
    #[cfg(target_arch = "x86_64")]
    if matches!(isa, Isa::Avx2 | Isa::Avx512) {
        // SAFETY: the family was detected (AVX-512 implies AVX2 and FMA here).
        unsafe { x86::attend_group_avx2(h, queries) };
        return;
    }
    let _ = isa;
    body(
        h,
        queries,
        scores,
        |p| {
            for x in p.iter_mut() {
                *x = super::gexp::expf(*x);
            }
        },
        accumulate,
    );
}

/// A tile's scores before scaling: for each cell j, the fused multiply-add chain of the
/// query against the cell's key (`kt`: element d of cell j at d * TILE + j), from 0 over the
/// elements in order.
#[inline(always)]
fn scores(q: &[f32], kt: &[f32], sc: &mut [f32; TILE]) {
    *sc = [0f32; TILE];
    for (d, &qd) in q.iter().enumerate() {
        let row = &kt[d * TILE..d * TILE + TILE];
        for j in 0..TILE {
            sc[j] = qd.mul_add(row[j], sc[j]);
        }
    }
}

/// `_mm512_reduce_add_ps` of 16 values (GCC's tree: halves, quarters, then pairs).
#[inline(always)]
fn reduce16(v: &[f32]) -> f32 {
    let t: [f32; 4] = std::array::from_fn(|i| (v[i] + v[i + 8]) + (v[i + 4] + v[i + 12]));
    (t[0] + t[2]) + (t[1] + t[3])
}

/// The tile's values into the accumulators of the live queries: per element one fused
/// multiply-add per cell in cell order, `acc = fma(p, v, acc)`; with a head size that is a
/// multiple of 32 a weight of 0 (an invisible cell) leaves the accumulator as it is.
fn accumulate(w: &[f32], live: &[bool], vt: &[f32], nt: usize, hd: usize, acc: &mut [f32]) {
    for qi in (0..live.len()).filter(|&qi| live[qi]) {
        let a = &mut acc[qi * hd..qi * hd + hd];
        let sc = &w[qi * TILE..qi * TILE + TILE];
        if hd.is_multiple_of(32) {
            // 32 elements at a time in locals, so they stay in registers across the cells
            for d0 in (0..hd).step_by(32) {
                let mut r: [f32; 32] = std::array::from_fn(|l| a[d0 + l]);
                for (j, &p) in sc.iter().enumerate().take(nt) {
                    if p == 0.0 {
                        continue;
                    }
                    let v = &vt[j * hd + d0..j * hd + d0 + 32];
                    for l in 0..32 {
                        r[l] = p.mul_add(v[l], r[l]);
                    }
                }
                a[d0..d0 + 32].copy_from_slice(&r);
            }
        } else {
            for (j, &p) in sc.iter().enumerate().take(nt) {
                let v = &vt[j * hd..j * hd + hd];
                for d in 0..hd {
                    a[d] = p.mul_add(v[d], a[d]);
                }
            }
        }
    }
}

/// The algorithm, written once; `dot` computes a tile's scores as [`scores`] does, `exp`
/// turns 64 arguments into `ggml_v_expf` of them, `vdo` accumulates the values as
/// [`accumulate`] does (arguments: the queries' weights, which queries have any, the tile's
/// values, its cells, the head size and the accumulators).
#[inline(always)]
fn body(
    h: &HeadAttn<'_>,
    queries: &mut [GroupQuery<'_>],
    dot: impl Fn(&[f32], &[f32], &mut [f32; TILE]),
    exp: impl Fn(&mut [f32; TILE]),
    vdo: impl Fn(&[f32], &[bool], &[f32], usize, usize, &mut [f32]),
) {
    let Some(hd) = queries.first().map(|q| q.q.len()) else {
        return;
    };
    let n = h.pos.len();
    let nq = queries.len();
    // the tile's keys transposed (element d of cell j at d * TILE + j) and values (cell j's
    // at j * hd), in f32; cells past the end stay 0
    let mut kt = vec![0f32; hd * TILE];
    let mut vt = vec![0f32; TILE * hd];
    let mut m = vec![f32::NEG_INFINITY; nq];
    let mut s = vec![0f32; nq];
    let mut acc = vec![0f32; nq * hd];
    // each query's weights of the tile's cells, and whether it has any this tile
    let mut wts = vec![0f32; nq * TILE];
    let mut live = vec![false; nq];
    let lo = queries.iter().map(|g| g.min_pos).min().unwrap_or(0);
    let hi = queries.iter().map(|g| g.max_pos).max().unwrap_or(0);
    for t0 in (0..n).step_by(TILE) {
        let nt = (n - t0).min(TILE);
        let pos = &h.pos[t0..t0 + nt];
        if !pos.iter().any(|&p| p >= lo && p <= hi) {
            continue;
        }
        for j in 0..nt {
            let base = (t0 + j) * h.stride + h.offset;
            let v = &mut vt[j * hd..j * hd + hd];
            f16_to_f32_row(&h.k[base..base + hd], v);
            for d in 0..hd {
                kt[d * TILE + j] = v[d];
            }
            f16_to_f32_row(&h.v[base..base + hd], v);
        }
        live.fill(false);
        for (qi, g) in queries.iter().enumerate() {
            let vis = |j: usize| j < nt && pos[j] >= g.min_pos && pos[j] <= g.max_pos;
            if !(0..nt).any(vis) {
                continue;
            }
            // the scores, then the weights, in place in the query's row of `wts`
            let sc: &mut [f32; TILE] = (&mut wts[qi * TILE..qi * TILE + TILE])
                .try_into()
                .expect("a row of TILE weights");
            dot(&g.q[..hd], &kt, sc);
            let mut tmax = f32::NEG_INFINITY;
            for (j, x) in sc.iter_mut().enumerate() {
                *x = if vis(j) {
                    h.cap(*x * h.scale)
                } else {
                    f32::NEG_INFINITY
                };
                tmax = tmax.max(*x);
            }
            if tmax == f32::NEG_INFINITY {
                continue;
            }
            let a = &mut acc[qi * hd..qi * hd + hd];
            let mnew = m[qi].max(tmax);
            if mnew > m[qi] {
                let ms = (m[qi] - mnew).exp();
                for x in a.iter_mut() {
                    *x *= ms;
                }
                s[qi] *= ms;
            }
            m[qi] = mnew;
            for x in sc.iter_mut() {
                *x -= mnew;
            }
            exp(sc);
            let mut sum = 0f64;
            for c in sc.chunks_exact(16) {
                sum += reduce16(c) as f64;
            }
            s[qi] = (s[qi] as f64 + sum) as f32;
            live[qi] = true;
        }
        vdo(&wts, &live, &vt, nt, hd, &mut acc);
    }
    for (qi, g) in queries.iter_mut().enumerate() {
        let inv = if s[qi] == 0.0 { 0.0 } else { 1.0 / s[qi] };
        for (o, &x) in g.out.iter_mut().zip(&acc[qi * hd..qi * hd + hd]) {
            *o = x * inv;
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::*;
    use std::arch::x86_64::*;

    /// [`scores`] with the 64 sums in eight registers (each lane one cell's chain).
    ///
    /// # Safety
    /// AVX2 and FMA must be available.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn scores_avx2(q: &[f32], kt: &[f32], sc: &mut [f32; TILE]) {
        assert!(kt.len() >= q.len() * TILE);
        let mut a = [_mm256_setzero_ps(); TILE / 8];
        for (d, &qd) in q.iter().enumerate() {
            let b = _mm256_set1_ps(qd);
            // SAFETY: row d of kt is in bounds (asserted above).
            let row = unsafe { kt.as_ptr().add(d * TILE) };
            for (i, x) in a.iter_mut().enumerate() {
                // SAFETY: as above; AVX2 and FMA as this function requires.
                *x = unsafe { _mm256_fmadd_ps(b, _mm256_loadu_ps(row.add(8 * i)), *x) };
            }
        }
        for (i, x) in a.iter().enumerate() {
            // SAFETY: 8 values of the 64 in bounds.
            unsafe { _mm256_storeu_ps(sc.as_mut_ptr().add(8 * i), *x) };
        }
    }

    /// [`accumulate`] for head sizes that are multiples of 32, two live queries at a time:
    /// each 32 elements of a cell's value are loaded once for both (a weight of 0 skips that
    /// query's multiply-adds, as in `accumulate`; the order per element is unchanged).
    ///
    /// # Safety
    /// AVX2 and FMA must be available.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn accumulate_avx2(
        w: &[f32],
        live: &[bool],
        vt: &[f32],
        nt: usize,
        hd: usize,
        acc: &mut [f32],
    ) {
        if !hd.is_multiple_of(32) {
            return accumulate(w, live, vt, nt, hd, acc);
        }
        assert!(w.len() >= live.len() * TILE && acc.len() >= live.len() * hd);
        assert!(vt.len() >= nt * hd);
        let ap = acc.as_mut_ptr();
        // queries a and b (b = a for one query alone)
        let run = |a: usize, b: usize| {
            let (pa, pb) = (&w[a * TILE..a * TILE + nt], &w[b * TILE..b * TILE + nt]);
            for d0 in (0..hd).step_by(32) {
                // SAFETY: rows a and b of acc are in bounds (asserted) and distinct or the
                // same row used once; AVX2 and FMA as the function requires.
                unsafe {
                    let (xa, xb) = (ap.add(a * hd + d0), ap.add(b * hd + d0));
                    let mut ra: [__m256; 4] =
                        std::array::from_fn(|k| _mm256_loadu_ps(xa.add(8 * k)));
                    let mut rb: [__m256; 4] =
                        std::array::from_fn(|k| _mm256_loadu_ps(xb.add(8 * k)));
                    for j in 0..nt {
                        let (x, y) = (pa[j], if b != a { pb[j] } else { 0.0 });
                        if x == 0.0 && y == 0.0 {
                            continue;
                        }
                        let vp = vt.as_ptr().add(j * hd + d0);
                        let v: [__m256; 4] =
                            std::array::from_fn(|k| _mm256_loadu_ps(vp.add(8 * k)));
                        if x != 0.0 {
                            let bx = _mm256_set1_ps(x);
                            for k in 0..4 {
                                ra[k] = _mm256_fmadd_ps(bx, v[k], ra[k]);
                            }
                        }
                        if y != 0.0 {
                            let by = _mm256_set1_ps(y);
                            for k in 0..4 {
                                rb[k] = _mm256_fmadd_ps(by, v[k], rb[k]);
                            }
                        }
                    }
                    for (k, r) in ra.iter().enumerate() {
                        _mm256_storeu_ps(xa.add(8 * k), *r);
                    }
                    if b != a {
                        for (k, r) in rb.iter().enumerate() {
                            _mm256_storeu_ps(xb.add(8 * k), *r);
                        }
                    }
                }
            }
        };
        let mut pending = None;
        for qi in (0..live.len()).filter(|&qi| live[qi]) {
            match pending.take() {
                None => pending = Some(qi),
                Some(a) => run(a, qi),
            }
        }
        if let Some(a) = pending {
            run(a, a);
        }
    }

    /// [`body`] compiled for AVX2 and FMA (the loops over cells and elements vectorised),
    /// the scores by [`scores_avx2`], the weights by `gexp`'s 8-lane `ggml_v_expf`, the
    /// values by [`accumulate_avx2`].
    ///
    /// # Safety
    /// AVX2 and FMA must be available.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn attend_group_avx2(h: &HeadAttn<'_>, queries: &mut [GroupQuery<'_>]) {
        // SAFETY: AVX2 and FMA as this function requires.
        let dot = |q: &[f32], kt: &[f32], sc: &mut [f32; TILE]| unsafe { scores_avx2(q, kt, sc) };
        let exp = |p: &mut [f32; TILE]| {
            for c in p.chunks_exact_mut(8) {
                // SAFETY: 8 values in bounds; AVX2 and FMA as this function requires.
                unsafe {
                    let e = crate::kernels::gexp::x86::expf8(_mm256_loadu_ps(c.as_ptr()));
                    _mm256_storeu_ps(c.as_mut_ptr(), e);
                }
            }
        };
        // SAFETY: AVX2 and FMA as this function requires.
        let vdo = |w: &[f32], live: &[bool], vt: &[f32], nt: usize, hd: usize, acc: &mut [f32]| unsafe {
            accumulate_avx2(w, live, vt, nt, hd, acc)
        };
        body(h, queries, dot, exp, vdo)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::{f16_to_f32, f32_to_f16};

    fn noise(seed: u64, n: usize, amp: f32) -> Vec<f32> {
        let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                amp * ((x >> 40) as f32 / (1u64 << 24) as f32 - 0.5)
            })
            .collect()
    }

    /// Every level the CPU has gives the portable reference's outputs to the bit (the
    /// vectorised loops, F16C conversion and 8-lane `ggml_v_expf` change no float step), for
    /// head sizes with and without the 32-wide accumulator path, causal rows, a window and
    /// soft-capping; and each output is a weighted mean of the visible values.
    #[test]
    fn every_level_equals_the_reference() {
        for (case, &(hd, n, softcap)) in [
            (64, 70, 0.0f32),
            (128, 200, 0.0),
            (80, 131, 30.0),
            (256, 64, 0.0),
        ]
        .iter()
        .enumerate()
        {
            let (kvh, nkv) = (1usize, 2usize);
            let stride = nkv * hd;
            let k: Vec<u16> = noise(case as u64 + 1, n * stride, 4.0)
                .iter()
                .map(|&x| f32_to_f16(x))
                .collect();
            let v: Vec<u16> = noise(case as u64 + 7, n * stride, 2.0)
                .iter()
                .map(|&x| f32_to_f16(x))
                .collect();
            let pos: Vec<u32> = (0..n as u32).collect();
            let q = noise(case as u64 + 13, n * hd, 3.0);
            let kv = HeadAttn {
                q: &[],
                k: &k,
                v: &v,
                stride,
                offset: kvh * hd,
                pos: &pos,
                min_pos: 0,
                max_pos: 0,
                scale: 1.0 / (hd as f32).sqrt() / if softcap != 0.0 { softcap } else { 1.0 },
                softcap,
                native_f16: false,
            };
            let run = |isa: Isa| {
                let mut out = vec![f32::NAN; n * hd];
                let mut qs: Vec<GroupQuery<'_>> = out
                    .chunks_mut(hd)
                    .enumerate()
                    .map(|(r, o)| GroupQuery {
                        q: &q[r * hd..(r + 1) * hd],
                        // rows from 48 on see a window of 48 positions
                        min_pos: if r >= 48 { r as u32 - 47 } else { 0 },
                        max_pos: r as u32,
                        out: o,
                    })
                    .collect();
                attend_group(isa, &kv, &mut qs);
                out
            };
            let want = run(Isa::Scalar);
            // a weighted mean of the visible values: within their range, element by element
            for r in [0, 1, 47, 48, n - 1] {
                for d in 0..hd {
                    let lo = if r >= 48 { r - 47 } else { 0 };
                    let vals = (lo..=r).map(|c| f16_to_f32(v[c * stride + kvh * hd + d]));
                    let (mn, mx) =
                        vals.fold((f32::MAX, f32::MIN), |(a, b), x| (a.min(x), b.max(x)));
                    let o = want[r * hd + d];
                    assert!(
                        o >= mn - 1e-4 && o <= mx + 1e-4,
                        "case {case} row {r} elem {d}: {o}"
                    );
                }
            }
            for isa in Isa::available() {
                let got = run(isa);
                let same = got
                    .iter()
                    .zip(&want)
                    .all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(
                    same,
                    "case {case} (hd {hd}): {isa:?} differs from the reference"
                );
            }
        }
    }
}
