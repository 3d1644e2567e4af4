//! Bit-exact scalar emulation of llama.cpp's CPU *tiled* K-quant matmul
//! (`ggml-cpu/tiled/tiled.cpp` + `tiled/tiled-kernel.cpp`) for Q6_K weights × f32
//! activations, on this build (x86 with AVX-512 F/BW/VL/DQ/VNNI, `-march=native`, so the
//! `__AVX512VNNI__ && __AVX512VL__ && __AVX512DQ__` microkernel `tiled_run_micro_vnni_8x16`
//! is the one compiled in), working on the original GGUF Q6_K bytes.
//!
//! # When llama.cpp uses this path
//!
//! `ggml_compute_forward_mul_mat` first calls `ggml_compute_forward_mul_mat_tiled`, which
//! takes over when: the tiled switch is on (env `GGML_CPU_TILED_MM` unset or non-zero), the
//! weight is not in a repack buffer (`src0->extra == NULL`; on x86 Q6_K is never repacked —
//! repack.cpp only has NEON Q6_K layouts), the type is one of the supported K/IQ quants
//! (Q6_K is) and `src1->ne[1] >= 8` (`ggml_tiled_min_batch`; `GGML_CPU_TILED_MM_FORCE=1`
//! forces it for any batch). So with 10 prompt tokens every Q6_K matmul goes here; with
//! < 8 rows the ordinary `vec_dot` path (`dot.rs::dot_q6_k`) is used instead.
//! Q6_K is instantiated as `SUBBLK = 16, HAS_MIN = false, BIAS = 32, ACTBIAS = true`.
//!
//! # Activation quantization
//!
//! src1 (f32) is converted with the Q8_K type traits' `from_float` = `quantize_row_q8_K`,
//! which on x86 is literally `quantize_row_q8_K_ref` (arch/x86/quants.c). Per row and per
//! 256-element super-block: `amax`/`max` = first element with the largest |x|,
//! `iscale = -127 / max`, `d = 1 / iscale` (f32), `q = nearest_int(iscale * x)` clamped to
//! 127, bsums = exact i16 sums of 16 consecutive quants; `amax == 0` → `d = 0`, q = 0.
//! The crate's `crate::quant::quantize(GgmlType::Q8_K, ..)` is that quantizer (not
//! duplicated; [`quantize_act_q8k_tiled`] wraps it). The threads split each row by whole
//! blocks (`ne10_block_start/end`) — blocks are independent, so no effect. The tiled
//! unpack (`tiled_unpack_src1_q8_K`) copies the 256 codes, widens the 16 bsums to i32 and
//! keeps `d` as the f32 stored in the block (no f16 rounding, despite a comment).
//!
//! # Weight decoding (exact)
//!
//! `tiled_unpack_src0(block_q6_K)`: per super-block `d0 = f16_to_f32(d)`, 16 int8 scales
//! `sc[s]` (one per 16 elements, natural order), unsigned 6-bit codes `w[e]` in 0..64 in the
//! natural dequantization order (element `e = 128 h + 32 quarter + l`:
//! low 4 bits = nibble `quarter >= 2` of `ql[64 h + 32 (quarter & 1) + l]`,
//! high 2 bits = bits `2 quarter .. 2 quarter + 2` of `qh[32 h + l]`). The bias 32 is *not*
//! subtracted from the codes (unlike `vec_dot`); it is corrected with the activation bsums.
//! (`tiled_repack_src0` also computes an AVX2-only act-bias correction into `mins[]`; the
//! VNNI kernel with `HAS_MIN = false` never reads it. `tiled_repack_src1` on VNNI only
//! transposes codes, the +128 act-bias is AVX2-only.)
//!
//! # Arithmetic per output element (weight row `i`, activation row `j`)
//!
//! For each super-block `b` (one 256-K "slab") the VNNI kernel computes in i32 (all exact;
//! `vpdpbusd` u8×s8 with no saturation, `vpmulld`/`vpaddd` wrap but never overflow here):
//! ```text
//! raw[s] = Σ_{e<16} w[16 s + e] * q[16 s + e]          (codes 0..63 times i8)
//! s1     = Σ_{s<16} sc[s] * (raw[s] - 32 * bsums[s])   (= Σ sc[s] Σ (w-32) q, exactly)
//! ```
//! then the float epilogue, once per (element, super-block) — checked in the disassembly of
//! `tiled_run_micro_vnni_8x16<16, false, 32, *>` (`vcvtdq2ps`, `vmulps`, `vfmadd213ps`; GCC
//! contracts the `_mm512_add_ps(buf, _mm512_mul_ps(result, d1))` into one FMA):
//! ```text
//! r   = f32(s1) * d0                 (cvtdq2ps = round-to-nearest-even, then one f32 mul)
//! acc = fma(r, d1, acc)              (d1 = the activation block's f32 d)
//! ```
//! starting from `acc = +0.0` (the 256×256 `acc` window is memset once per macrotile), with
//! `b` strictly in order `0, 1, .., nb-1`; the result is `acc`, stored as is (no further
//! reduction, no `d0 * d1` pre-product, unlike `vec_dot`).
//!
//! # Dependence on tiling / threads
//!
//! None. Both K schedules accumulate into the same `acc` cell in super-block order:
//! * standard path (window of > 16 activation rows): `ib` over 256-K slabs in order, one
//!   microtile call per slab;
//! * narrow path (≤ 16 activation rows in the 256-row window, e.g. 10 tokens):
//!   `ggml_tiled_narrow_k_extent` picks chunks of `k_extent = 256 * num_k` (≤ 31 KiB / (16 +
//!   rows), floored to a multiple of 256 that divides `ne00`), chunks `k0` in order and
//!   inside each chunk slabs `0..num_k` in order, again one microtile call (one fma) per slab.
//!
//! Every microtile call handles exactly one super-block and does the epilogue for it, so the
//! float sequence per element is the same for any `k_extent`, window (256×256 macrotiles,
//! ragged edges, 16×16 microtiles as two 8×16 bands) or thread chunking (chunks of 256 rows /
//! columns; each output is owned by one thread). Zero-padded activation rows / ragged weight
//! rows only produce outputs that are not stored.

#![allow(dead_code)]

use crate::quant::f16_to_f32;

/// Bytes of one Q6_K block: ql[128], qh[64], scales[16] (i8), d (f16).
const Q6K_BYTES: usize = 210;
/// Bytes of one Q8_K block: d (f32), qs[256] (i8), bsums[16] (i16).
const Q8K_BYTES: usize = 292;
const QK_K: usize = 256;

/// Quantizes one activation row (length a multiple of 256) to Q8_K bytes
/// (`nb * 292`: f32 d, 256 i8 quants, 16 i16 bsums per block), as the tiled path's
/// `from_float` (= `quantize_row_q8_K_ref` on x86) does.
pub(crate) fn quantize_act_q8k_tiled(x: &[f32]) -> Vec<u8> {
    assert_eq!(x.len() % QK_K, 0);
    let mut out = vec![0u8; x.len() / QK_K * Q8K_BYTES];
    crate::quant::quantize(crate::types::GgmlType::Q8_K, x, &mut out)
        .expect("Q8_K quantization of a whole number of blocks");
    out
}

/// The 256 unsigned 6-bit codes (0..63) of a Q6_K block, natural element order.
#[inline]
fn q6k_codes(blk: &[u8]) -> [u8; QK_K] {
    let ql = &blk[0..128];
    let qh = &blk[128..192];
    let mut w = [0u8; QK_K];
    for h in 0..2 {
        for quarter in 0..4 {
            for l in 0..32 {
                let lo = ql[64 * h + 32 * (quarter & 1) + l];
                let lo = if quarter >= 2 { lo >> 4 } else { lo & 0x0f };
                let hi = (qh[32 * h + l] >> (2 * quarter)) & 3;
                w[128 * h + 32 * quarter + l] = lo | (hi << 4);
            }
        }
    }
    w
}

/// Per super-block exact integer `s1 = Σ_s sc[s] * (Σ_e w*q - 32 * bsums[s])` and the two
/// scales (`d0` of the weight block as f32, `d1` of the activation block).
#[inline]
fn block_s1(w: &[u8], a: &[u8]) -> (i32, f32, f32) {
    let codes = q6k_codes(w);
    let sc = &w[192..208];
    let d0 = f16_to_f32(u16::from_le_bytes([w[208], w[209]]));
    let d1 = f32::from_le_bytes([a[0], a[1], a[2], a[3]]);
    let q8 = &a[4..4 + QK_K];
    let mut s1 = 0i32;
    for s in 0..16 {
        let mut raw = 0i32;
        for e in 16 * s..16 * s + 16 {
            raw += codes[e] as i32 * (q8[e] as i8 as i32);
        }
        let bsum = i16::from_le_bytes([a[4 + QK_K + 2 * s], a[4 + QK_K + 2 * s + 1]]) as i32;
        let corr = raw.wrapping_sub(32i32.wrapping_mul(bsum));
        s1 = s1.wrapping_add((sc[s] as i8 as i32).wrapping_mul(corr));
    }
    (s1, d0, d1)
}

/// One output of llama.cpp's tiled matmul (x86 AVX-512 VNNI build): weight row `w_row`
/// (GGUF Q6_K bytes, `nb * 210`) times activation row `act` (Q8_K bytes from
/// [`quantize_act_q8k_tiled`], `nb * 292`). Per super-block: exact i32 `s1`, then
/// `acc = fma(f32(s1) * d0, d1, acc)` from `+0.0`, blocks in order (module docs).
/// Independent of the tiling, batch size (≥ 8) and thread count.
pub(crate) fn dot_q6k_tiled_ggml(w_row: &[u8], act: &[u8]) -> f32 {
    let nb = w_row.len() / Q6K_BYTES;
    debug_assert_eq!(w_row.len(), nb * Q6K_BYTES);
    debug_assert_eq!(act.len(), nb * Q8K_BYTES);
    let mut acc = 0f32;
    for b in 0..nb {
        let (s1, d0, d1) = block_s1(
            &w_row[b * Q6K_BYTES..(b + 1) * Q6K_BYTES],
            &act[b * Q8K_BYTES..(b + 1) * Q8K_BYTES],
        );
        let r = (s1 as f32) * d0;
        acc = r.mul_add(d1, acc);
    }
    acc
}

/// SIMD versions of [`dot_q6k_tiled_ggml`] for a tile of weight rows × up to `T` activation
/// rows, bit-identical to it: the integer part of every super-block (`s1`) is exact however
/// it is summed, and the float epilogue `acc = fma(f32(s1) * d0, d1, acc)` runs per output in
/// vector lanes (one lane per activation row), super-blocks in order, from `+0.0`.
///
/// Integer layout: each weight super-block is unpacked once (32 or 64 unsigned 6-bit codes at
/// a time) and reused for the `T` activation rows: `maddubs(codes, q8)` (pairs, at most
/// `2 * 63 * 128` so no i16 saturation), times the sub-block scale (`madd` / `vpdpwssd`
/// into i32), plus `bsums · (-32 sc)` for the code bias; the `T` lane vectors are then
/// reduced with a horizontal-add tree to one i32 per activation row.
#[cfg(target_arch = "x86_64")]
pub(crate) mod x86 {
    use super::{Q6K_BYTES, Q8K_BYTES, QK_K};
    use crate::quant::f16_to_f32;
    use std::arch::x86_64::*;

    /// Offset of the 16 i16 bsums in a Q8_K block.
    const BSUMS: usize = 4 + QK_K;

    /// The 32 codes of elements `32 c .. 32 c + 32` of the Q6_K block at `blk` (`c < 8`).
    #[inline(always)]
    unsafe fn codes32(blk: *const u8, c: usize) -> __m256i {
        let (h, q) = (c / 4, c % 4);
        let ql = _mm256_loadu_si256(blk.add(64 * h + 32 * (q & 1)) as *const __m256i);
        let qh = _mm256_loadu_si256(blk.add(128 + 32 * h) as *const __m256i);
        let m4 = _mm256_set1_epi8(0x0f);
        let lo = if q >= 2 {
            _mm256_and_si256(_mm256_srli_epi16::<4>(ql), m4)
        } else {
            _mm256_and_si256(ql, m4)
        };
        // ((qh >> 2q) & 3) << 4 == (qh shifted by 4 - 2q) & 0x30; the 16-bit shifts only
        // move bits of the neighbouring byte into positions the mask clears.
        let hi = match q {
            0 => _mm256_slli_epi16::<4>(qh),
            1 => _mm256_slli_epi16::<2>(qh),
            2 => qh,
            _ => _mm256_srli_epi16::<2>(qh),
        };
        _mm256_or_si256(lo, _mm256_and_si256(hi, _mm256_set1_epi8(0x30)))
    }

    /// Sums each of the 8 vectors: lane `i` of the result = Σ lanes of `a[i]`.
    #[inline(always)]
    unsafe fn reduce8(a: &[__m256i]) -> __m256i {
        let h01 = _mm256_hadd_epi32(a[0], a[1]);
        let h23 = _mm256_hadd_epi32(a[2], a[3]);
        let h45 = _mm256_hadd_epi32(a[4], a[5]);
        let h67 = _mm256_hadd_epi32(a[6], a[7]);
        let h0123 = _mm256_hadd_epi32(h01, h23);
        let h4567 = _mm256_hadd_epi32(h45, h67);
        _mm256_add_epi32(
            _mm256_permute2x128_si256::<0x20>(h0123, h4567),
            _mm256_permute2x128_si256::<0x31>(h0123, h4567),
        )
    }

    /// Sums each of the 4 vectors: lane `i` of the result = Σ lanes of `a[i]`.
    #[inline(always)]
    unsafe fn reduce4(a: &[__m256i]) -> __m128i {
        let h01 = _mm256_hadd_epi32(a[0], a[1]);
        let h23 = _mm256_hadd_epi32(a[2], a[3]);
        let h = _mm256_hadd_epi32(h01, h23);
        _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256::<1>(h))
    }

    /// The float epilogue of one super-block for `T` (4 or 8) lanes: `acc = fma(f32(s1) * d0,
    /// d1, acc)` with `s1` the lane sums of `accs`, `d1` = `d1s[..T]`. `acc` holds `T` f32.
    #[inline(always)]
    unsafe fn epilogue<const T: usize>(
        accs: &[__m256i],
        d0: f32,
        d1s: *const f32,
        acc: &mut [f32; T],
    ) {
        if T == 8 {
            let s = _mm256_cvtepi32_ps(reduce8(accs));
            let r = _mm256_mul_ps(s, _mm256_set1_ps(d0));
            let a = _mm256_loadu_ps(acc.as_ptr());
            let a = _mm256_fmadd_ps(r, _mm256_loadu_ps(d1s), a);
            _mm256_storeu_ps(acc.as_mut_ptr(), a);
        } else if T == 4 {
            let s = _mm_cvtepi32_ps(reduce4(accs));
            let r = _mm_mul_ps(s, _mm_set1_ps(d0));
            let a = _mm_loadu_ps(acc.as_ptr());
            let a = _mm_fmadd_ps(r, _mm_loadu_ps(d1s), a);
            _mm_storeu_ps(acc.as_mut_ptr(), a);
        } else {
            for t in 0..T {
                let mut l = [0i32; 8];
                _mm256_storeu_si256(l.as_mut_ptr() as *mut __m256i, accs[t]);
                let s1 = l.iter().fold(0i32, |x, &y| x.wrapping_add(y));
                acc[t] = ((s1 as f32) * d0).mul_add(*d1s.add(t), acc[t]);
            }
        }
    }

    /// Token pointers with the unused slots (`t >= nt`) aliased to row 0, and the activation
    /// scales `d1` as `[block][token]` (`nb * T`).
    #[inline(always)]
    unsafe fn prepare<const T: usize>(
        acts: &[*const u8; T],
        nt: usize,
        nb: usize,
    ) -> ([*const u8; T], Vec<f32>) {
        assert!(nt >= 1 && nt <= T);
        let mut a = *acts;
        for p in a.iter_mut().skip(nt) {
            *p = acts[0];
        }
        let mut d1s = vec![0f32; nb * T];
        for b in 0..nb {
            for t in 0..T {
                d1s[b * T + t] = (a[t].add(b * Q8K_BYTES) as *const f32).read_unaligned();
            }
        }
        (a, d1s)
    }

    #[inline(always)]
    unsafe fn store<const T: usize>(
        acc: &[f32; T],
        nt: usize,
        out: *mut f32,
        ostride: usize,
        r: usize,
    ) {
        for (t, &v) in acc.iter().enumerate().take(nt) {
            *out.add(t * ostride + r) = v;
        }
    }

    /// `out[t * ostride + r] = dot_q6k_tiled_ggml(row r, act row t)` for `r < nrows`,
    /// `t < nt <= T` (weight row `r` at `w + r * rb`, `nb` Q6_K blocks; activation row `t`:
    /// `nb` Q8_K blocks at `acts[t]`). AVX2 + FMA; `T` is best 4 or 8.
    ///
    /// # Safety
    /// The CPU must have AVX2, FMA and F16C; all pointers valid for the sizes above, `nt >= 1`.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) unsafe fn tile<const T: usize>(
        w: *const u8,
        rb: usize,
        nrows: usize,
        nb: usize,
        acts: &[*const u8; T],
        nt: usize,
        out: *mut f32,
        ostride: usize,
    ) {
        let (a, d1s) = prepare(acts, nt, nb);
        let shuf = _mm256_setr_epi8(
            0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2,
            3, 2, 3,
        );
        for r in 0..nrows {
            let wr = w.add(r * rb);
            let mut acc = [0f32; T];
            for b in 0..nb {
                let blk = wr.add(b * Q6K_BYTES);
                let sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(blk.add(192) as *const __m128i));
                let neg32 = _mm256_sub_epi16(_mm256_setzero_si256(), _mm256_slli_epi16::<5>(sc16));
                let mut accs = [_mm256_setzero_si256(); T];
                for (t, s) in accs.iter_mut().enumerate() {
                    let bs = _mm256_loadu_si256(a[t].add(b * Q8K_BYTES + BSUMS) as *const __m256i);
                    *s = _mm256_madd_epi16(bs, neg32);
                }
                for c in 0..8 {
                    let codes = codes32(blk, c);
                    // i16 lanes: sc[2c] in the low 128 bits, sc[2c + 1] in the high ones
                    let scv = _mm256_shuffle_epi8(
                        _mm256_permutevar8x32_epi32(sc16, _mm256_set1_epi32(c as i32)),
                        shuf,
                    );
                    for (t, s) in accs.iter_mut().enumerate() {
                        let q = _mm256_loadu_si256(
                            a[t].add(b * Q8K_BYTES + 4 + 32 * c) as *const __m256i
                        );
                        *s = _mm256_add_epi32(
                            *s,
                            _mm256_madd_epi16(_mm256_maddubs_epi16(codes, q), scv),
                        );
                    }
                }
                epilogue::<T>(
                    &accs,
                    f16_to_f32(u16::from_le_bytes([*blk.add(208), *blk.add(209)])),
                    d1s.as_ptr().add(b * T),
                    &mut acc,
                );
            }
            store(&acc, nt, out, ostride, r);
        }
    }

    /// As [`tile`], with AVX-512 BW + VNNI (64 codes per step, `vpdpwssd`).
    ///
    /// # Safety
    /// The CPU must have AVX-512 F/BW/VL/VNNI, AVX2, FMA and F16C; pointers as for [`tile`].
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    pub(crate) unsafe fn tile_avx512<const T: usize>(
        w: *const u8,
        rb: usize,
        nrows: usize,
        nb: usize,
        acts: &[*const u8; T],
        nt: usize,
        out: *mut f32,
        ostride: usize,
    ) {
        let (a, d1s) = prepare(acts, nt, nb);
        let m4 = _mm512_set1_epi8(0x0f);
        let m30 = _mm512_set1_epi8(0x30);
        // 16-bit shift counts per 256-bit half: quarters (0, 1) shift left by (4, 2),
        // quarters (2, 3) shift right by (0, 2) before the 0x30 mask
        let cnt_l = _mm512_inserti64x4::<1>(_mm512_set1_epi16(4), _mm256_set1_epi16(2));
        let cnt_r = _mm512_inserti64x4::<1>(_mm512_setzero_si512(), _mm256_set1_epi16(2));
        for r in 0..nrows {
            let wr = w.add(r * rb);
            let mut acc = [0f32; T];
            for b in 0..nb {
                let blk = wr.add(b * Q6K_BYTES);
                let sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(blk.add(192) as *const __m128i));
                let neg32 = _mm512_zextsi256_si512(_mm256_sub_epi16(
                    _mm256_setzero_si256(),
                    _mm256_slli_epi16::<5>(sc16),
                ));
                let scz = _mm512_zextsi256_si512(sc16);
                let mut accs = [_mm512_setzero_si512(); T];
                for (t, s) in accs.iter_mut().enumerate() {
                    let bs = _mm256_loadu_si256(a[t].add(b * Q8K_BYTES + BSUMS) as *const __m256i);
                    *s = _mm512_madd_epi16(_mm512_zextsi256_si512(bs), neg32);
                }
                for c in 0..4 {
                    let h = c / 2;
                    let ql = _mm512_loadu_si512(blk.add(64 * h) as *const _);
                    let qh = _mm256_loadu_si256(blk.add(128 + 32 * h) as *const __m256i);
                    let qh = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(qh), qh);
                    let (lo, hi) = if c % 2 == 0 {
                        (_mm512_and_si512(ql, m4), _mm512_sllv_epi16(qh, cnt_l))
                    } else {
                        (
                            _mm512_and_si512(_mm512_srli_epi16::<4>(ql), m4),
                            _mm512_srlv_epi16(qh, cnt_r),
                        )
                    };
                    let codes = _mm512_or_si512(lo, _mm512_and_si512(hi, m30));
                    // i16 lanes: 128-bit lane k holds sc[4c + k]
                    let idx = _mm512_add_epi16(
                        _mm512_set1_epi16(4 * c as i16),
                        _mm512_inserti64x4::<1>(
                            _mm512_castsi256_si512(_mm256_setr_epi16(
                                0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                            )),
                            _mm256_setr_epi16(2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3),
                        ),
                    );
                    let scv = _mm512_permutexvar_epi16(idx, scz);
                    for (t, s) in accs.iter_mut().enumerate() {
                        let q =
                            _mm512_loadu_si512(a[t].add(b * Q8K_BYTES + 4 + 64 * c) as *const _);
                        *s = _mm512_dpwssd_epi32(*s, _mm512_maddubs_epi16(codes, q), scv);
                    }
                }
                let mut y = [_mm256_setzero_si256(); T];
                for (yt, s) in y.iter_mut().zip(accs.iter()) {
                    *yt = _mm256_add_epi32(
                        _mm512_castsi512_si256(*s),
                        _mm512_extracti64x4_epi64::<1>(*s),
                    );
                }
                epilogue::<T>(
                    &y,
                    f16_to_f32(u16::from_le_bytes([*blk.add(208), *blk.add(209)])),
                    d1s.as_ptr().add(b * T),
                    &mut acc,
                );
            }
            store(&acc, nt, out, ostride, r);
        }
    }
}

/// A different, plausible float order (vec_dot style `d = d1 * d0` then
/// `fma(f32(s1), d, acc)`), only used by the test to show the fixture discriminates.
#[cfg(test)]
fn dot_q6k_other_order(w_row: &[u8], act: &[u8]) -> f32 {
    let nb = w_row.len() / Q6K_BYTES;
    let mut acc = 0f32;
    for b in 0..nb {
        let (s1, d0, d1) = block_s1(
            &w_row[b * Q6K_BYTES..(b + 1) * Q6K_BYTES],
            &act[b * Q8K_BYTES..(b + 1) * Q8K_BYTES],
        );
        acc = (s1 as f32).mul_add(d1 * d0, acc);
    }
    acc
}

#[cfg(test)]
mod tests {
    //! Fixture written by `scripts/check_q6k_tiled.py` from llama.cpp forward-pass dumps
    //! (10 tokens ⇒ tiled path): slices of real Q6_K matmuls (weight rows, f32 inputs, the
    //! Q8_K bytes of libggml-cpu.so's `quantize_row_q8_K`, llama.cpp's outputs).
    use super::*;

    const FIXTURE: &str = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../tests/fixtures/q6k_tiled/q6k_tiled.bin"
    );

    struct Reader<'a>(&'a [u8]);
    impl<'a> Reader<'a> {
        fn u32(&mut self) -> usize {
            let v = u32::from_le_bytes(self.0[..4].try_into().unwrap());
            self.0 = &self.0[4..];
            v as usize
        }
        fn bytes(&mut self, n: usize) -> &'a [u8] {
            let (a, b) = self.0.split_at(n);
            self.0 = b;
            a
        }
        fn f32s(&mut self, n: usize) -> Vec<f32> {
            self.bytes(4 * n)
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                .collect()
        }
    }

    /// Checks every case of a fixture file; returns (q8 rows ok, rows, outputs ok, outputs,
    /// outputs the other float order would also get right).
    fn check_file(path: &str) -> [usize; 5] {
        let data = match std::fs::read(path) {
            Ok(d) => d,
            Err(e) => panic!("fixture {path}: {e}"),
        };
        let mut r = Reader(&data);
        let ncases = r.u32();
        let mut total = [0usize; 5];
        for case in 0..ncases {
            // k, n weight rows, m activation rows (top bit: the f32 inputs are included)
            let (k, n, m) = (r.u32(), r.u32(), r.u32());
            let has_x = m & 0x8000_0000 != 0;
            let m = m & 0x7fff_ffff;
            let nb = k / QK_K;
            let w = r.bytes(n * nb * Q6K_BYTES);
            let x = if has_x { r.f32s(m * k) } else { Vec::new() };
            let q8 = r.bytes(m * nb * Q8K_BYTES);
            let want = r.f32s(m * n);
            let rb = nb * Q8K_BYTES;
            let mut qok = 0;
            for i in (0..m).filter(|_| has_x) {
                let mine = quantize_act_q8k_tiled(&x[i * k..(i + 1) * k]);
                if mine[..] == q8[i * rb..(i + 1) * rb] {
                    qok += 1;
                } else {
                    eprintln!("case {case}: q8 row {i} differs");
                }
            }
            let (mut ook, mut other_ok) = (0, 0);
            for i in 0..m {
                let a = &q8[i * rb..(i + 1) * rb];
                for j in 0..n {
                    let wr = &w[j * nb * Q6K_BYTES..(j + 1) * nb * Q6K_BYTES];
                    let got = dot_q6k_tiled_ggml(wr, a);
                    let e = want[i * n + j];
                    if dot_q6k_other_order(wr, a).to_bits() == e.to_bits() {
                        other_ok += 1;
                    }
                    if got.to_bits() == e.to_bits() {
                        ook += 1;
                    } else if ook + 20 > i * n + j {
                        eprintln!("case {case}: out[{i}][{j}] = {got:e} want {e:e}");
                    }
                }
            }
            eprintln!(
                "case {case}: k={k} n={n} m={m}: q8 rows {qok}/{}, outputs {ook}/{} (other order {other_ok})",
                if has_x { m } else { 0 },
                m * n
            );
            total[0] += qok;
            total[1] += if has_x { m } else { 0 };
            total[2] += ook;
            total[3] += m * n;
            total[4] += other_ok;
        }
        assert!(r.0.is_empty());
        eprintln!(
            "total: q8 rows {}/{}, outputs {}/{} (other float order: {})",
            total[0], total[1], total[2], total[3], total[4]
        );
        total
    }

    #[test]
    fn q6k_tiled_matches_llama_cpp() {
        let t = check_file(FIXTURE);
        assert_eq!(t[0], t[1]);
        assert_eq!(t[2], t[3]);
        assert!(t[4] < t[3], "fixture does not discriminate the float order");
    }

    /// Deterministic pseudo-random f32 in about [-1, 1) (xorshift64*).
    fn rand_f32s(seed: u64, n: usize, scale: f32) -> Vec<f32> {
        let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..n)
            .map(|_| {
                s ^= s >> 12;
                s ^= s << 25;
                s ^= s >> 27;
                let v = s.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 40;
                (v as f32 / (1u64 << 23) as f32 - 1.0) * scale
            })
            .collect()
    }

    fn rand_q6k(seed: u64, nrows: usize, nb: usize) -> Vec<u8> {
        let x = rand_f32s(seed, nrows * nb * QK_K, 0.05);
        let mut w = vec![0u8; nrows * nb * Q6K_BYTES];
        crate::quant::quantize(crate::types::GgmlType::Q6_K, &x, &mut w).unwrap();
        w
    }

    fn rand_q8k(seed: u64, nt: usize, nb: usize) -> Vec<u8> {
        // a few outliers per row so the scales differ between blocks
        let mut x = rand_f32s(seed, nt * nb * QK_K, 3.0);
        for (i, v) in x.iter_mut().enumerate().filter(|(i, _)| i % 97 == 5) {
            *v *= 1.0 + (i % 7) as f32;
        }
        let mut a = vec![0u8; nt * nb * Q8K_BYTES];
        crate::quant::quantize(crate::types::GgmlType::Q8_K, &x, &mut a).unwrap();
        a
    }

    #[cfg(target_arch = "x86_64")]
    type TileFn<const T: usize> =
        unsafe fn(*const u8, usize, usize, usize, &[*const u8; T], usize, *mut f32, usize);

    /// Runs `f` on every row/token configuration and compares with the scalar function.
    #[cfg(target_arch = "x86_64")]
    fn check_tile<const T: usize>(f: TileFn<T>, name: &str) {
        let mut n = 0;
        for nb in 1..=6 {
            for nrows in [1, 7, 16, 37] {
                let w = rand_q6k((nb * 131 + nrows) as u64, nrows, nb);
                let rb = nb * Q6K_BYTES;
                for nt in 1..=T {
                    let a = rand_q8k((nb * 7919 + nrows * 31 + nt) as u64, nt, nb);
                    let ab = nb * Q8K_BYTES;
                    let mut ptrs = [std::ptr::null::<u8>(); T];
                    for (t, p) in ptrs.iter_mut().enumerate().take(nt) {
                        *p = a[t * ab..].as_ptr();
                    }
                    let ostride = nrows + 3;
                    let mut out = vec![f32::NAN; nt * ostride];
                    // SAFETY: features checked by the caller; buffers sized as documented.
                    unsafe {
                        f(
                            w.as_ptr(),
                            rb,
                            nrows,
                            nb,
                            &ptrs,
                            nt,
                            out.as_mut_ptr(),
                            ostride,
                        )
                    };
                    for t in 0..nt {
                        for r in 0..nrows {
                            let want = dot_q6k_tiled_ggml(
                                &w[r * rb..(r + 1) * rb],
                                &a[t * ab..(t + 1) * ab],
                            );
                            let got = out[t * ostride + r];
                            assert_eq!(
                                got.to_bits(),
                                want.to_bits(),
                                "{name} T={T} nb={nb} nrows={nrows} nt={nt} t={t} r={r}: {got:e} vs {want:e}"
                            );
                            n += 1;
                        }
                        assert!(out[t * ostride + nrows..(t + 1) * ostride]
                            .iter()
                            .all(|v| v.is_nan()));
                    }
                }
            }
        }
        eprintln!("{name} T={T}: {n} outputs bit-identical");
    }

    #[cfg(target_arch = "x86_64")]
    fn has_avx2() -> bool {
        crate::kernels::Isa::available().contains(&crate::kernels::Isa::Avx2)
    }

    #[cfg(target_arch = "x86_64")]
    fn has_avx512() -> bool {
        crate::kernels::Isa::available().contains(&crate::kernels::Isa::Avx512)
    }

    #[test]
    #[cfg(target_arch = "x86_64")]
    fn q6k_tiled_avx2_matches_scalar() {
        if !has_avx2() {
            eprintln!("SKIPPED: no AVX2/FMA/F16C");
            return;
        }
        check_tile::<4>(x86::tile::<4>, "avx2");
        check_tile::<8>(x86::tile::<8>, "avx2");
        check_tile::<3>(x86::tile::<3>, "avx2");
    }

    #[test]
    #[cfg(target_arch = "x86_64")]
    fn q6k_tiled_avx512_matches_scalar() {
        if !has_avx512() {
            eprintln!("SKIPPED: no AVX-512 F/BW/VL/VNNI");
            return;
        }
        check_tile::<4>(x86::tile_avx512::<4>, "avx512");
        check_tile::<8>(x86::tile_avx512::<8>, "avx512");
        check_tile::<3>(x86::tile_avx512::<3>, "avx512");
    }

    /// Single-thread timing, 896×4864 Q6_K × 16 activation rows:
    /// `cargo test --release -p rustorch-core --lib q6k_tiled_bench -- --ignored --nocapture`.
    #[test]
    #[ignore]
    #[cfg(target_arch = "x86_64")]
    fn q6k_tiled_bench() {
        let (nrows, nb, nt) = (896, 4864 / QK_K, 16);
        let w = rand_q6k(1, nrows, nb);
        let a = rand_q8k(2, nt, nb);
        let (rb, ab) = (nb * Q6K_BYTES, nb * Q8K_BYTES);
        let mut want = vec![0f32; nt * nrows];
        let t0 = std::time::Instant::now();
        for t in 0..nt {
            for r in 0..nrows {
                want[t * nrows + r] =
                    dot_q6k_tiled_ggml(&w[r * rb..(r + 1) * rb], &a[t * ab..(t + 1) * ab]);
            }
        }
        eprintln!("scalar: {:.2} ms", t0.elapsed().as_secs_f64() * 1e3);
        fn run<const T: usize>(
            f: TileFn<T>,
            w: &[u8],
            a: &[u8],
            nb: usize,
            nrows: usize,
            nt: usize,
            out: &mut [f32],
        ) {
            let (rb, ab) = (nb * Q6K_BYTES, nb * Q8K_BYTES);
            for t0 in (0..nt).step_by(T) {
                let n = T.min(nt - t0);
                let mut p = [a.as_ptr(); T];
                for (i, pi) in p.iter_mut().enumerate().take(n) {
                    *pi = a[(t0 + i) * ab..].as_ptr();
                }
                // SAFETY: features checked by the caller; buffers sized as documented.
                unsafe {
                    f(
                        w.as_ptr(),
                        rb,
                        nrows,
                        nb,
                        &p,
                        n,
                        out[t0 * nrows..].as_mut_ptr(),
                        nrows,
                    )
                };
            }
        }
        let mut got = vec![0f32; nt * nrows];
        let mut bench = |name: &str, f: &dyn Fn(&mut [f32])| {
            got.fill(0.0);
            f(&mut got);
            let t0 = std::time::Instant::now();
            let reps = 20;
            for _ in 0..reps {
                f(&mut got);
            }
            eprintln!(
                "{name}: {:.3} ms",
                t0.elapsed().as_secs_f64() * 1e3 / reps as f64
            );
            assert!(got
                .iter()
                .zip(&want)
                .all(|(x, y)| x.to_bits() == y.to_bits()));
        };
        if has_avx2() {
            bench("avx2 T=4", &|o| {
                run::<4>(x86::tile::<4>, &w, &a, nb, nrows, nt, o)
            });
            bench("avx2 T=8", &|o| {
                run::<8>(x86::tile::<8>, &w, &a, nb, nrows, nt, o)
            });
        }
        if has_avx512() {
            bench("avx512 T=4", &|o| {
                run::<4>(x86::tile_avx512::<4>, &w, &a, nb, nrows, nt, o)
            });
            bench("avx512 T=8", &|o| {
                run::<8>(x86::tile_avx512::<8>, &w, &a, nb, nrows, nt, o)
            });
        }
    }

    /// Whole matmuls: `Q6K_TILED_FULL=/path/full.bin cargo test --release -p rustorch-core
    /// --lib q6k -- --ignored` (file written by `scripts/check_q6k_tiled.py --full`).
    #[test]
    #[ignore]
    fn q6k_tiled_full_dump() {
        let Ok(path) = std::env::var("Q6K_TILED_FULL") else {
            eprintln!("Q6K_TILED_FULL not set");
            return;
        };
        let t = check_file(&path);
        assert_eq!(t[0], t[1]);
        assert_eq!(t[2], t[3]);
    }
}
