//! Activation rows quantized for the integer dot kernels.
//!
//! Rows are encoded to the weight type's vec-dot type (Q8_0, Q8_1 or Q8_K) with exactly the
//! bytes of the reference [`quant::quantize`], by SIMD code where the CPU allows it. Beside the
//! bytes, per-block side arrays hold what the kernels would otherwise recompute for every
//! weight row: the scale as `f32`, the Q8_1 `s` as `f32`, and the integer sum of each 32-block's
//! quants (Q8_0/Q8_1).

use super::cpu::Isa;
use super::pool::ThreadPool;
use crate::quant::{self, f16_to_f32, QuantError};
use crate::types::GgmlType;

/// Quantized activation rows plus per-block side data.
#[derive(Default, Debug, Clone)]
pub struct QActs {
    pub(crate) ty: Option<GgmlType>,
    pub(crate) n_rows: usize,
    pub(crate) n_cols: usize,
    pub(crate) row_bytes: usize,
    /// Blocks per row.
    pub(crate) nb: usize,
    /// Reference-format bytes, `row_bytes` per row.
    pub(crate) data: Vec<u8>,
    /// Per block (row-major): the scale as f32.
    pub(crate) d: Vec<f32>,
    /// Per block: Q8_1's `s` as f32.
    pub(crate) s: Vec<f32>,
    /// Per block: the sum of the block's quants (Q8_0/Q8_1).
    pub(crate) isum: Vec<i32>,
}

#[derive(Clone, Copy)]
struct SendMut(*mut u8);
unsafe impl Send for SendMut {}
unsafe impl Sync for SendMut {}

impl QActs {
    pub fn new() -> Self {
        Self::default()
    }

    /// Activation type of the current contents.
    pub fn ty(&self) -> Option<GgmlType> {
        self.ty
    }

    /// The reference-format bytes of all rows.
    pub fn bytes(&self) -> &[u8] {
        &self.data
    }

    pub fn row_bytes(&self) -> usize {
        self.row_bytes
    }

    /// Row `r`'s bytes.
    pub fn row(&self, r: usize) -> &[u8] {
        &self.data[r * self.row_bytes..(r + 1) * self.row_bytes]
    }

    /// Encodes the `x.len() / n_cols` rows of `x` as `ty` (Q8_0, Q8_1, Q8_K, F16 or F32),
    /// reusing this buffer's allocations. Large batches are split over `pool`.
    pub fn quantize(
        &mut self,
        pool: Option<&ThreadPool>,
        isa: Isa,
        ty: GgmlType,
        x: &[f32],
        n_cols: usize,
    ) -> Result<(), QuantError> {
        let bs = ty.block_size();
        if n_cols == 0 || !n_cols.is_multiple_of(bs) || !x.len().is_multiple_of(n_cols) {
            return Err(QuantError::NotBlockAligned {
                ty,
                len: n_cols,
                multiple: bs,
                unit: "f32 values",
            });
        }
        if !matches!(
            ty,
            GgmlType::Q8_0 | GgmlType::Q8_1 | GgmlType::Q8_K | GgmlType::F16 | GgmlType::F32
        ) {
            return Err(QuantError::Unsupported(ty));
        }
        let n_rows = x.len() / n_cols;
        let nb = n_cols / bs;
        let row_bytes = nb * ty.type_size();
        self.ty = Some(ty);
        self.n_rows = n_rows;
        self.n_cols = n_cols;
        self.nb = nb;
        self.row_bytes = row_bytes;
        self.data.resize(n_rows * row_bytes, 0);
        let with_meta = matches!(ty, GgmlType::Q8_0 | GgmlType::Q8_1 | GgmlType::Q8_K);
        let n_meta = if with_meta { n_rows * nb } else { 0 };
        self.d.resize(n_meta, 0.0);
        self.isum.resize(n_meta, 0);
        self.s
            .resize(if ty == GgmlType::Q8_1 { n_meta } else { 0 }, 0.0);

        let data = SendMut(self.data.as_mut_ptr());
        let d = SendMut(self.d.as_mut_ptr() as *mut u8);
        let s = SendMut(self.s.as_mut_ptr() as *mut u8);
        let isum = SendMut(self.isum.as_mut_ptr() as *mut u8);
        let work = |r0: usize, r1: usize| {
            let (data, d, s, isum) = (data, d, s, isum);
            for r in r0..r1 {
                let xr = &x[r * n_cols..(r + 1) * n_cols];
                // SAFETY: rows are disjoint; every buffer was sized above.
                let out =
                    unsafe { std::slice::from_raw_parts_mut(data.0.add(r * row_bytes), row_bytes) };
                let (dm, sm, im) = unsafe {
                    (
                        std::slice::from_raw_parts_mut(
                            (d.0 as *mut f32).add(r * nb),
                            if with_meta { nb } else { 0 },
                        ),
                        std::slice::from_raw_parts_mut(
                            (s.0 as *mut f32).add(r * nb),
                            if ty == GgmlType::Q8_1 { nb } else { 0 },
                        ),
                        std::slice::from_raw_parts_mut(
                            (isum.0 as *mut i32).add(r * nb),
                            if with_meta { nb } else { 0 },
                        ),
                    )
                };
                quantize_row(isa, ty, xr, out, dm, sm, im);
            }
        };
        match pool {
            // a few short rows cost less than a round trip through the pool
            Some(p) if p.n_threads() > 1 && n_rows >= 8 && x.len() >= 32 * 1024 => {
                let per = n_rows.div_ceil(p.n_threads() * 2).max(1);
                let n_tasks = n_rows.div_ceil(per);
                p.run(n_tasks, &|t| work(t * per, ((t + 1) * per).min(n_rows)));
            }
            _ => work(0, n_rows),
        }
        Ok(())
    }
}

/// Quantizes one row; side arrays are filled when non-empty.
fn quantize_row(
    isa: Isa,
    ty: GgmlType,
    x: &[f32],
    out: &mut [u8],
    d: &mut [f32],
    s: &mut [f32],
    isum: &mut [i32],
) {
    let bs = ty.block_size();
    let ts = ty.type_size();
    match ty {
        GgmlType::F32 | GgmlType::F16 => {
            // The reference conversion (F16 rounding is exact-to-nearest-even either way).
            let _ = quant::quantize(ty, x, out);
        }
        #[cfg(target_arch = "x86_64")]
        _ if matches!(isa, Isa::Avx2 | Isa::Avx512) => {
            // SAFETY: the family was detected.
            unsafe { x86::quantize_row(isa, ty, x, out, d, s, isum) }
        }
        _ => {
            for (b, (xb, ob)) in x.chunks_exact(bs).zip(out.chunks_exact_mut(ts)).enumerate() {
                let done: Option<(f32, f32, i32)> = match isa {
                    // SAFETY: the family was detected.
                    #[cfg(target_arch = "x86_64")]
                    Isa::Avx2 | Isa::Avx512 => unsafe { x86::quantize_block(isa, ty, xb, ob) },
                    _ => None,
                };
                let (db, sb, ib) = match done {
                    Some(meta) => meta,
                    None => quantize_block_scalar(ty, xb, ob),
                };
                d[b] = db;
                if !s.is_empty() {
                    s[b] = sb;
                }
                isum[b] = ib;
            }
        }
    }
}

/// One activation block encoded as ggml's CPU backend encodes activations on x86
/// (`quantize_row_q8_0` / `quantize_row_q8_1` in ggml-cpu, which differ from the reference
/// quantizers): `d = amax / 127`, inverse scale `127 / amax` (not `1 / d`), rounding half to
/// even, and for Q8_1 `s = f16(d * Σq)` with the unrounded `d`. Q8_K uses the reference
/// quantizer, as ggml-cpu does. Returns the side data of [`block_meta`].
pub(crate) fn quantize_block_scalar(ty: GgmlType, x: &[f32], out: &mut [u8]) -> (f32, f32, i32) {
    use crate::quant::f32_to_f16;
    match ty {
        GgmlType::Q8_0 | GgmlType::Q8_1 => {
            let amax = x.iter().fold(0f32, |m, &v| m.max(v.abs()));
            let d = amax / 127.0;
            let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
            let qo = if ty == GgmlType::Q8_1 { 4 } else { 2 };
            let mut sum = 0i32;
            for (o, &v) in out[qo..qo + 32].iter_mut().zip(x) {
                let q = ((v * id).round_ties_even() as i32).clamp(-128, 127);
                sum += q;
                *o = q as i8 as u8;
            }
            out[..2].copy_from_slice(&f32_to_f16(d).to_le_bytes());
            if ty == GgmlType::Q8_1 {
                out[2..4].copy_from_slice(&f32_to_f16(d * sum as f32).to_le_bytes());
            }
        }
        _ => {
            let _ = quant::quantize(ty, x, out);
        }
    }
    block_meta(ty, out)
}

/// The scale, Q8_1 `s`, and (Q8_0/Q8_1) quant sum of one encoded block.
fn block_meta(ty: GgmlType, b: &[u8]) -> (f32, f32, i32) {
    match ty {
        GgmlType::Q8_0 => {
            let sum = b[2..34].iter().map(|&q| q as i8 as i32).sum();
            (f16_to_f32(u16::from_le_bytes([b[0], b[1]])), 0.0, sum)
        }
        GgmlType::Q8_1 => {
            let sum = b[4..36].iter().map(|&q| q as i8 as i32).sum();
            (
                f16_to_f32(u16::from_le_bytes([b[0], b[1]])),
                f16_to_f32(u16::from_le_bytes([b[2], b[3]])),
                sum,
            )
        }
        GgmlType::Q8_K => (f32::from_le_bytes([b[0], b[1], b[2], b[3]]), 0.0, 0),
        _ => (0.0, 0.0, 0),
    }
}

/// Encodes `x` (whole blocks of Q8_0, Q8_1 or Q8_K) as ggml's CPU backend encodes
/// activations, one block at a time with the scalar code of `quantize_block_scalar` (the
/// reference the SIMD encoders are tested against).
pub fn quantize_scalar(ty: GgmlType, x: &[f32], out: &mut [u8]) -> Result<(), QuantError> {
    let (bs, ts) = (ty.block_size(), ty.type_size());
    if !matches!(ty, GgmlType::Q8_0 | GgmlType::Q8_1 | GgmlType::Q8_K)
        || !x.len().is_multiple_of(bs)
        || out.len() != x.len() / bs * ts
    {
        return quant::quantize(ty, x, out);
    }
    for (xb, ob) in x.chunks_exact(bs).zip(out.chunks_exact_mut(ts)) {
        quantize_block_scalar(ty, xb, ob);
    }
    Ok(())
}

/// Encodes `x` (whole blocks) as `ty` with the fastest available code; the bytes equal
/// `quantize_block_scalar`'s (ggml-cpu's activation encoding). Exposed for tests and
/// benchmarks.
pub fn quantize_simd(isa: Isa, ty: GgmlType, x: &[f32], out: &mut [u8]) -> Result<(), QuantError> {
    let bs = ty.block_size();
    let ts = ty.type_size();
    if !x.len().is_multiple_of(bs) || out.len() != x.len() / bs * ts {
        return quant::quantize(ty, x, out);
    }
    if !matches!(ty, GgmlType::Q8_0 | GgmlType::Q8_1 | GgmlType::Q8_K) {
        return quant::quantize(ty, x, out);
    }
    for (xb, ob) in x.chunks_exact(bs).zip(out.chunks_exact_mut(ts)) {
        let done: Option<(f32, f32, i32)> = match isa {
            // SAFETY: the family was detected.
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 | Isa::Avx512 => unsafe { x86::quantize_block(isa, ty, xb, ob) },
            _ => None,
        };
        if done.is_none() {
            quantize_block_scalar(ty, xb, ob);
        }
    }
    Ok(())
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::*;
    use std::arch::x86_64::*;

    /// Quantizes one block with AVX2 and returns its side data (as [`block_meta`]); `None`
    /// (nothing written) when the block holds non-finite values or a degenerate scale, which
    /// the reference then handles.
    ///
    /// # Safety
    /// The CPU must support AVX2, FMA and F16C (and AVX-512 F/BW when `isa` is
    /// [`Isa::Avx512`]); `x`/`out` hold one block of `ty`.
    pub(super) unsafe fn quantize_block(
        isa: Isa,
        ty: GgmlType,
        x: &[f32],
        out: &mut [u8],
    ) -> Option<(f32, f32, i32)> {
        let (xp, op, n) = (x.as_ptr(), out.as_mut_ptr(), out.len());
        let legacy = |q8_1: bool| {
            if isa == Isa::Avx512 {
                q8_legacy512(xp, op, q8_1)
            } else {
                q8_legacy(xp, op, q8_1)
            }
        };
        match ty {
            GgmlType::Q8_0 if x.len() == 32 && n == 34 => legacy(false),
            GgmlType::Q8_1 if x.len() == 32 && n == 36 => legacy(true),
            GgmlType::Q8_K if x.len() == 256 && out.len() == 292 => {
                q8_k(x.as_ptr(), out.as_mut_ptr())
            }
            _ => None,
        }
    }

    /// [`super::quantize_row`] with the SIMD block encoders inlined.
    ///
    /// # Safety
    /// AVX2, FMA and F16C must be available (and AVX-512 F/BW when `isa` is
    /// [`Isa::Avx512`]).
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn quantize_row(
        isa: Isa,
        ty: GgmlType,
        x: &[f32],
        out: &mut [u8],
        d: &mut [f32],
        s: &mut [f32],
        isum: &mut [i32],
    ) {
        let (bs, ts) = (ty.block_size(), ty.type_size());
        for (b, (xb, ob)) in x.chunks_exact(bs).zip(out.chunks_exact_mut(ts)).enumerate() {
            let wide = isa == Isa::Avx512;
            let done = match ty {
                GgmlType::Q8_0 if wide => q8_legacy512(xb.as_ptr(), ob.as_mut_ptr(), false),
                GgmlType::Q8_1 if wide => q8_legacy512(xb.as_ptr(), ob.as_mut_ptr(), true),
                GgmlType::Q8_0 => q8_legacy(xb.as_ptr(), ob.as_mut_ptr(), false),
                GgmlType::Q8_1 => q8_legacy(xb.as_ptr(), ob.as_mut_ptr(), true),
                _ => q8_k(xb.as_ptr(), ob.as_mut_ptr()),
            };
            let (db, sb, ib) = match done {
                Some(meta) => meta,
                None => quantize_block_scalar(ty, xb, ob),
            };
            d[b] = db;
            if !s.is_empty() {
                s[b] = sb;
            }
            isum[b] = ib;
        }
    }

    /// f32 → f16 bits, round to nearest even (equal to `f32_to_f16` for finite values), and
    /// the f16 value back as f32.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn to_f16(x: f32) -> (u16, f32) {
        let h = _mm_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(_mm_set_ss(x));
        (
            _mm_extract_epi16::<0>(h) as u16,
            _mm_cvtss_f32(_mm_cvtph_ps(h)),
        )
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn any_nonfinite(v: __m256) -> bool {
        let a = _mm256_and_ps(v, _mm256_castsi256_ps(_mm256_set1_epi32(0x7fff_ffff)));
        let bad = _mm256_cmp_ps::<_CMP_NLE_UQ>(a, _mm256_set1_ps(f32::MAX));
        _mm256_movemask_ps(bad) != 0
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn hmax(v: __m256) -> f32 {
        let m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        let m = _mm_max_ss(m, _mm_movehdup_ps(m));
        _mm_cvtss_f32(m)
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn hsum_i32(v: __m256i) -> i32 {
        let s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
        let s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
        let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b10_11_00_01>(s));
        _mm_cvtsi128_si32(s)
    }

    /// Packs 4×8 i32 (each in -128..=127) into 32 bytes in order.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn pack32(i: [__m256i; 4]) -> __m256i {
        let a = _mm256_packs_epi32(i[0], i[1]);
        let b = _mm256_packs_epi32(i[2], i[3]);
        let c = _mm256_packs_epi16(a, b);
        _mm256_permutevar8x32_epi32(c, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7))
    }

    /// Q8_0 / Q8_1 as ggml-cpu's AVX2 `quantize_row_q8_0/1`: `d = amax / 127`,
    /// `q = round_half_even(x * (127 / amax))`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn q8_legacy(x: *const f32, out: *mut u8, q8_1: bool) -> Option<(f32, f32, i32)> {
        let v = [
            _mm256_loadu_ps(x),
            _mm256_loadu_ps(x.add(8)),
            _mm256_loadu_ps(x.add(16)),
            _mm256_loadu_ps(x.add(24)),
        ];
        let absm = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fff_ffff));
        let mut m = _mm256_setzero_ps();
        for vi in v {
            if any_nonfinite(vi) {
                return None;
            }
            m = _mm256_max_ps(m, _mm256_and_ps(vi, absm));
        }
        let amax = hmax(m);
        let d = amax / 127.0;
        let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
        if !id.is_finite() {
            return None;
        }
        let vid = _mm256_set1_ps(id);
        let mut q = [_mm256_setzero_si256(); 4];
        for k in 0..4 {
            let p = _mm256_mul_ps(v[k], vid);
            let r = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(p);
            q[k] = _mm256_cvtps_epi32(r);
        }
        let bytes = pack32(q);
        let sum = hsum_i32(_mm256_add_epi32(
            _mm256_add_epi32(q[0], q[1]),
            _mm256_add_epi32(q[2], q[3]),
        ));
        let (dh, df) = to_f16(d);
        let dh = dh.to_le_bytes();
        *out = dh[0];
        *out.add(1) = dh[1];
        if q8_1 {
            let (sh, sf) = to_f16(sum as f32 * d);
            let sh = sh.to_le_bytes();
            *out.add(2) = sh[0];
            *out.add(3) = sh[1];
            _mm256_storeu_si256(out.add(4) as *mut __m256i, bytes);
            Some((df, sf, sum))
        } else {
            _mm256_storeu_si256(out.add(2) as *mut __m256i, bytes);
            Some((df, 0.0, sum))
        }
    }

    /// [`q8_legacy`] with AVX-512: the block in two registers, the largest magnitude as the
    /// largest of the absolute values' bit patterns (which order like the values, and put
    /// infinities and NaN above every finite value), and the rounding done by the conversion
    /// to integers (nearest even, as rounding first and converting then).
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
    unsafe fn q8_legacy512(x: *const f32, out: *mut u8, q8_1: bool) -> Option<(f32, f32, i32)> {
        let v = [_mm512_loadu_ps(x), _mm512_loadu_ps(x.add(16))];
        let absm = _mm512_set1_epi32(0x7fff_ffff);
        let bits = v.map(|vi| _mm512_and_si512(_mm512_castps_si512(vi), absm));
        let top = _mm512_reduce_max_epu32(_mm512_max_epu32(bits[0], bits[1]));
        if top >= 0x7f80_0000 {
            return None;
        }
        let amax = f32::from_bits(top);
        let d = amax / 127.0;
        let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
        if !id.is_finite() {
            return None;
        }
        let vid = _mm512_set1_ps(id);
        let q = v.map(|vi| {
            _mm512_cvt_roundps_epi32::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
                _mm512_mul_ps(vi, vid),
            )
        });
        let sum = _mm512_reduce_add_epi32(_mm512_add_epi32(q[0], q[1]));
        let qo = if q8_1 { 4 } else { 2 };
        _mm_storeu_si128(out.add(qo) as *mut __m128i, _mm512_cvtsepi32_epi8(q[0]));
        _mm_storeu_si128(
            out.add(qo + 16) as *mut __m128i,
            _mm512_cvtsepi32_epi8(q[1]),
        );
        let (dh, df) = to_f16(d);
        std::ptr::copy_nonoverlapping(dh.to_le_bytes().as_ptr(), out, 2);
        if q8_1 {
            let (sh, sf) = to_f16(sum as f32 * d);
            std::ptr::copy_nonoverlapping(sh.to_le_bytes().as_ptr(), out.add(2), 2);
            Some((df, sf, sum))
        } else {
            Some((df, 0.0, sum))
        }
    }

    /// Q8_K (`-127 / max` scale, `max` the first value of largest magnitude, nearest-even).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn q8_k(x: *const f32, out: *mut u8) -> Option<(f32, f32, i32)> {
        let absm = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fff_ffff));
        let mut m = _mm256_setzero_ps();
        for i in 0..32 {
            let vi = _mm256_loadu_ps(x.add(8 * i));
            if any_nonfinite(vi) {
                return None;
            }
            m = _mm256_max_ps(m, _mm256_and_ps(vi, absm));
        }
        let amax = hmax(m);
        if amax == 0.0 {
            std::ptr::write_bytes(out, 0, 292);
            return Some((0.0, 0.0, 0));
        }
        let va = _mm256_set1_ps(amax);
        let mut max = 0.0f32;
        for i in 0..32 {
            let vi = _mm256_and_ps(_mm256_loadu_ps(x.add(8 * i)), absm);
            let mask = _mm256_movemask_ps(_mm256_cmp_ps::<_CMP_EQ_OQ>(vi, va));
            if mask != 0 {
                max = *x.add(8 * i + mask.trailing_zeros() as usize);
                break;
            }
        }
        let iscale = -127.0f32 / max;
        if !iscale.is_finite() {
            return None;
        }
        let vs = _mm256_set1_ps(iscale);
        let lim = _mm256_set1_epi32(127);
        let mut bsums = [0i16; 16];
        for g in 0..8 {
            let mut q = [_mm256_setzero_si256(); 4];
            #[allow(clippy::needless_range_loop)] // indices address several arrays in step
            for k in 0..4 {
                let vi = _mm256_loadu_ps(x.add(32 * g + 8 * k));
                q[k] = _mm256_min_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(vi, vs)), lim);
            }
            _mm256_storeu_si256(out.add(4 + 32 * g) as *mut __m256i, pack32(q));
            bsums[2 * g] = hsum_i32(_mm256_add_epi32(q[0], q[1])) as i16;
            bsums[2 * g + 1] = hsum_i32(_mm256_add_epi32(q[2], q[3])) as i16;
        }
        let d = 1.0 / iscale;
        std::ptr::copy_nonoverlapping(d.to_le_bytes().as_ptr(), out, 4);
        for (k, s) in bsums.iter().enumerate() {
            let b = s.to_le_bytes();
            *out.add(260 + 2 * k) = b[0];
            *out.add(261 + 2 * k) = b[1];
        }
        Some((d, 0.0, 0))
    }
}
