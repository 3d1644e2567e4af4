//! ggml tensor formats: block layouts, dequantization to `f32` and quantization from `f32`.
//!
//! These are the scalar reference implementations. They reproduce ggml bit for bit: quantizing
//! gives the bytes of ggml's reference quantizers (`quantize_row_*_ref`, i.e. what
//! `ggml_quantize_chunk` / `llama-quantize` produce without an importance matrix; for IQ4_NL and
//! IQ4_XS the `quantize_iq4_nl` / `quantize_iq4_xs` path), and dequantizing gives the f32 bits of
//! ggml's `to_float`. `tests/quant_reference.rs` checks both against fixtures recorded from
//! libggml itself, `tests/quant_models.rs` checks dequantization of every tensor of real models.
//!
//! Floating-point evaluation order follows the C code operation by operation, with each `*`, `/`,
//! `+` rounded separately, and no `mul_add` anywhere. That is what the reference does: ggml's
//! CMake builds `libggml-base` (home of the `quantize_row_*_ref` quantizers and the `to_float`
//! dequantizers) without any `-march` flag, so on x86-64 it is plain SSE2 code with no fused
//! multiply-add at all (`objdump -d libggml-base.so | grep -c vfmadd` is 0; only the separate
//! `libggml-cpu` SIMD backend is built with `-march=native`). Per format, that means:
//!
//! * F16/BF16 conversions, Q4_0..Q8_1, IQ4_NL/IQ4_XS dequantization: products and sums rounded
//!   separately (e.g. Q4_1 is `(q as f32 * d) + m`, two roundings).
//! * Q2_K..Q6_K, Q8_K, IQ4_NL, IQ4_XS quantization: every `a * b + c` in the scale searches and
//!   in `nearest_int(a * b)` (which adds 1.5·2^23) is rounded twice.
//!
//! For contrast, a copy of ggml-base rebuilt with `-march=native` (GCC contracts to FMA by
//! default) was measured against these fixtures: its Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, Q8_K, IQ4_NL
//! and IQ4_XS quantizers and its Q2_K dequantizer give different bits on some blocks, while
//! F32/F16/BF16 and Q4_0..Q8_1 are unaffected. ggml output is therefore build-dependent for those
//! formats (e.g. on aarch64, where FMA is baseline); this module matches the stock, un-fused build.
//!
//! Where C converts floats to integers with a plain cast we reproduce the x86 `cvttss2si` result
//! (truncation, `i32::MIN` for NaN or out-of-range) so that even non-finite inputs quantize to
//! the same bytes as ggml on x86-64.
//!
//! Formats, by module:
//! * [`float`]: F32, F16, BF16
//! * [`legacy`]: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q8_1 (blocks of 32)
//! * [`kquants`]: Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, Q8_K (super-blocks of 256)
//! * [`iquants`]: IQ4_NL (blocks of 32), IQ4_XS (super-blocks of 256)
//! * [`iqgrid`]: IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S (super-blocks of 256 over
//!   the lookup tables of [`grids`], generated from ggml's `ggml-common.h`); dequantization only
//! * [`ternary`]: TQ1_0, TQ2_0 (super-blocks of 256)
//! * [`mxfp4`]: MXFP4, blocks of 32 with a power-of-two (E8M0) scale; NVFP4, blocks of 64 with
//!   four UE4M3 scales
//! * [`q1q2`]: Q1_0 (sign bits, blocks of 128) and Q2_0 (2 bits, blocks of 64)
//! * [`weighted`]: quantization with an importance matrix (`llama-quantize --imatrix`):
//!   ggml's weighted Q4_0/Q4_1/Q5_0/Q5_1, Q2_K..Q6_K, IQ4_NL and IQ4_XS, row by row
//!   ([`quantize_rows`], ggml's `ggml_quantize_chunk`)
//!
//! Every format here dequantizes ([`supports_dequantize`]); all but the grid i-quants also
//! quantize ([`supports_quantize`]). ggml's grid i-quant quantizers need an importance matrix and
//! long searches, which this crate does not reproduce.
//!
//! Each block type is a `#[repr(C)]` struct with ggml's field order and size, plus byte-offset
//! constants and `from_bytes` / `to_bytes`, so other kernels can share the layout.

pub mod float;
pub mod grids;
pub mod iqgrid;
pub mod iquants;
pub mod kquants;
pub mod legacy;
pub mod mxfp4;
pub mod q1q2;
pub mod ternary;
pub mod weighted;

pub use float::{bf16_to_f32, f16_to_f32, f16_to_f32_row, f32_to_bf16, f32_to_f16, f32_to_f16_row};
pub use iqgrid::{
    BlockIq1M, BlockIq1S, BlockIq2S, BlockIq2Xs, BlockIq2Xxs, BlockIq3S, BlockIq3Xxs,
};
pub use iquants::{BlockIq4Nl, BlockIq4Xs, IQ4NL_VALUES};
pub use kquants::{BlockQ2K, BlockQ3K, BlockQ4K, BlockQ5K, BlockQ6K, BlockQ8K, QK_K};
pub use legacy::{BlockQ4_0, BlockQ4_1, BlockQ5_0, BlockQ5_1, BlockQ8_0, BlockQ8_1, QK};
pub use mxfp4::{BlockMxfp4, BlockNvfp4, QK_MXFP4, QK_NVFP4};
pub use q1q2::{BlockQ1_0, BlockQ2_0, QK1_0, QK2_0};
pub use ternary::{BlockTq1_0, BlockTq2_0};
pub use weighted::quantize_rows;

use crate::types::GgmlType;

/// Why a (de)quantization request was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum QuantError {
    /// The type has no (de)quantizer here.
    #[error("ggml type {0} is not supported by this operation")]
    Unsupported(GgmlType),
    /// The destination does not hold exactly as many values/bytes as the source implies.
    #[error("{ty}: {blocks} block(s) need a destination of {expected} {unit}, got {actual}")]
    LengthMismatch {
        ty: GgmlType,
        blocks: usize,
        expected: usize,
        actual: usize,
        unit: &'static str,
    },
    /// The source is not a whole number of blocks.
    #[error(
        "{ty}: source of {len} {unit} is not a whole number of blocks ({multiple} {unit} each)"
    )]
    NotBlockAligned {
        ty: GgmlType,
        len: usize,
        multiple: usize,
        unit: &'static str,
    },
}

/// Whether [`dequantize`] handles `ty`: every format [`quantize`] handles, plus the grid
/// i-quants (IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S).
pub fn supports_dequantize(ty: GgmlType) -> bool {
    use GgmlType::*;
    supports_quantize(ty)
        || matches!(
            ty,
            IQ1_S | IQ1_M | IQ2_XXS | IQ2_XS | IQ2_S | IQ3_XXS | IQ3_S
        )
}

/// Whether [`quantize`] handles `ty`.
pub fn supports_quantize(ty: GgmlType) -> bool {
    use GgmlType::*;
    matches!(
        ty,
        F32 | F16
            | BF16
            | Q4_0
            | Q4_1
            | Q5_0
            | Q5_1
            | Q8_0
            | Q8_1
            | Q2_K
            | Q3_K
            | Q4_K
            | Q5_K
            | Q6_K
            | Q8_K
            | IQ4_NL
            | IQ4_XS
            | TQ1_0
            | TQ2_0
            | MXFP4
            | NVFP4
            | Q1_0
            | Q2_0
    )
}

/// Decodes `src` (whole blocks of `ty`) into `dst`, which must hold exactly
/// `src.len() / type_size * block_size` values.
///
/// Q8_1 has no dequantizer in ggml; here it decodes as `d * q` (the `s` field is ignored).
pub fn dequantize(ty: GgmlType, src: &[u8], dst: &mut [f32]) -> Result<(), QuantError> {
    if !supports_dequantize(ty) {
        return Err(QuantError::Unsupported(ty));
    }
    let (block, bytes) = (ty.block_size(), ty.type_size());
    let blocks = src.len() / bytes;
    if blocks * bytes != src.len() {
        return Err(QuantError::NotBlockAligned {
            ty,
            len: src.len(),
            multiple: bytes,
            unit: "bytes",
        });
    }
    let expected = blocks.checked_mul(block);
    if expected != Some(dst.len()) {
        return Err(QuantError::LengthMismatch {
            ty,
            blocks,
            expected: expected.unwrap_or(usize::MAX),
            actual: dst.len(),
            unit: "f32 values",
        });
    }
    use GgmlType::*;
    match ty {
        F32 => float::dequantize_f32(src, dst),
        F16 => float::dequantize_f16(src, dst),
        BF16 => float::dequantize_bf16(src, dst),
        Q4_0 => blocks_to_f32(src, dst, |b, y| BlockQ4_0::from_bytes(b).dequantize(y)),
        Q4_1 => blocks_to_f32(src, dst, |b, y| BlockQ4_1::from_bytes(b).dequantize(y)),
        Q5_0 => blocks_to_f32(src, dst, |b, y| BlockQ5_0::from_bytes(b).dequantize(y)),
        Q5_1 => blocks_to_f32(src, dst, |b, y| BlockQ5_1::from_bytes(b).dequantize(y)),
        Q8_0 => blocks_to_f32(src, dst, |b, y| BlockQ8_0::from_bytes(b).dequantize(y)),
        Q8_1 => blocks_to_f32(src, dst, |b, y| BlockQ8_1::from_bytes(b).dequantize(y)),
        Q2_K => blocks_to_f32(src, dst, |b, y| BlockQ2K::from_bytes(b).dequantize(y)),
        Q3_K => blocks_to_f32(src, dst, |b, y| BlockQ3K::from_bytes(b).dequantize(y)),
        Q4_K => blocks_to_f32(src, dst, |b, y| BlockQ4K::from_bytes(b).dequantize(y)),
        Q5_K => blocks_to_f32(src, dst, |b, y| BlockQ5K::from_bytes(b).dequantize(y)),
        Q6_K => blocks_to_f32(src, dst, |b, y| BlockQ6K::from_bytes(b).dequantize(y)),
        Q8_K => blocks_to_f32(src, dst, |b, y| BlockQ8K::from_bytes(b).dequantize(y)),
        IQ4_NL => blocks_to_f32(src, dst, |b, y| BlockIq4Nl::from_bytes(b).dequantize(y)),
        IQ4_XS => blocks_to_f32(src, dst, |b, y| BlockIq4Xs::from_bytes(b).dequantize(y)),
        IQ2_XXS => blocks_to_f32(src, dst, |b, y| BlockIq2Xxs::from_bytes(b).dequantize(y)),
        IQ2_XS => blocks_to_f32(src, dst, |b, y| BlockIq2Xs::from_bytes(b).dequantize(y)),
        IQ2_S => blocks_to_f32(src, dst, |b, y| BlockIq2S::from_bytes(b).dequantize(y)),
        IQ3_XXS => blocks_to_f32(src, dst, |b, y| BlockIq3Xxs::from_bytes(b).dequantize(y)),
        IQ3_S => blocks_to_f32(src, dst, |b, y| BlockIq3S::from_bytes(b).dequantize(y)),
        IQ1_S => blocks_to_f32(src, dst, |b, y| BlockIq1S::from_bytes(b).dequantize(y)),
        IQ1_M => blocks_to_f32(src, dst, |b, y| BlockIq1M::from_bytes(b).dequantize(y)),
        TQ1_0 => blocks_to_f32(src, dst, |b, y| BlockTq1_0::from_bytes(b).dequantize(y)),
        TQ2_0 => blocks_to_f32(src, dst, |b, y| BlockTq2_0::from_bytes(b).dequantize(y)),
        MXFP4 => blocks_to_f32(src, dst, |b, y| BlockMxfp4::from_bytes(b).dequantize(y)),
        NVFP4 => blocks_to_f32(src, dst, |b, y| BlockNvfp4::from_bytes(b).dequantize(y)),
        Q1_0 => blocks_to_f32(src, dst, |b, y| BlockQ1_0::from_bytes(b).dequantize(y)),
        Q2_0 => blocks_to_f32(src, dst, |b, y| BlockQ2_0::from_bytes(b).dequantize(y)),
        _ => return Err(QuantError::Unsupported(ty)),
    }
    Ok(())
}

/// Encodes `src` (a whole number of `ty` blocks of values) into `dst`, which must hold exactly
/// `src.len() / block_size * type_size` bytes. Gives the same bytes as ggml's reference quantizer.
pub fn quantize(ty: GgmlType, src: &[f32], dst: &mut [u8]) -> Result<(), QuantError> {
    if !supports_quantize(ty) {
        return Err(QuantError::Unsupported(ty));
    }
    let (block, bytes) = (ty.block_size(), ty.type_size());
    let blocks = src.len() / block;
    if blocks * block != src.len() {
        return Err(QuantError::NotBlockAligned {
            ty,
            len: src.len(),
            multiple: block,
            unit: "f32 values",
        });
    }
    let expected = blocks.checked_mul(bytes);
    if expected != Some(dst.len()) {
        return Err(QuantError::LengthMismatch {
            ty,
            blocks,
            expected: expected.unwrap_or(usize::MAX),
            actual: dst.len(),
            unit: "bytes",
        });
    }
    use GgmlType::*;
    match ty {
        F32 => float::quantize_f32(src, dst),
        F16 => float::quantize_f16(src, dst),
        BF16 => float::quantize_bf16(src, dst),
        Q4_0 => f32_to_blocks(src, dst, |x, b| *b = BlockQ4_0::quantize(x).to_bytes()),
        Q4_1 => f32_to_blocks(src, dst, |x, b| *b = BlockQ4_1::quantize(x).to_bytes()),
        Q5_0 => f32_to_blocks(src, dst, |x, b| *b = BlockQ5_0::quantize(x).to_bytes()),
        Q5_1 => f32_to_blocks(src, dst, |x, b| *b = BlockQ5_1::quantize(x).to_bytes()),
        Q8_0 => f32_to_blocks(src, dst, |x, b| *b = BlockQ8_0::quantize(x).to_bytes()),
        Q8_1 => f32_to_blocks(src, dst, |x, b| *b = BlockQ8_1::quantize(x).to_bytes()),
        Q2_K => f32_to_blocks(src, dst, |x, b| *b = BlockQ2K::quantize(x).to_bytes()),
        Q3_K => f32_to_blocks(src, dst, |x, b| *b = BlockQ3K::quantize(x).to_bytes()),
        Q4_K => f32_to_blocks(src, dst, |x, b| *b = BlockQ4K::quantize(x).to_bytes()),
        Q5_K => f32_to_blocks(src, dst, |x, b| *b = BlockQ5K::quantize(x).to_bytes()),
        Q6_K => f32_to_blocks(src, dst, |x, b| *b = BlockQ6K::quantize(x).to_bytes()),
        Q8_K => f32_to_blocks(src, dst, |x, b| *b = BlockQ8K::quantize(x).to_bytes()),
        IQ4_NL => f32_to_blocks(src, dst, |x, b| *b = BlockIq4Nl::quantize(x).to_bytes()),
        IQ4_XS => f32_to_blocks(src, dst, |x, b| *b = BlockIq4Xs::quantize(x).to_bytes()),
        TQ1_0 => f32_to_blocks(src, dst, |x, b| *b = BlockTq1_0::quantize(x).to_bytes()),
        TQ2_0 => f32_to_blocks(src, dst, |x, b| *b = BlockTq2_0::quantize(x).to_bytes()),
        MXFP4 => f32_to_blocks(src, dst, |x, b| *b = BlockMxfp4::quantize(x).to_bytes()),
        NVFP4 => f32_to_blocks(src, dst, |x, b| *b = BlockNvfp4::quantize(x).to_bytes()),
        Q1_0 => f32_to_blocks(src, dst, |x, b| *b = BlockQ1_0::quantize(x).to_bytes()),
        Q2_0 => f32_to_blocks(src, dst, |x, b| *b = BlockQ2_0::quantize(x).to_bytes()),
        _ => return Err(QuantError::Unsupported(ty)),
    }
    Ok(())
}

/// Runs `f` on each `B`-byte block of `src` and the matching `E` values of `dst`. Lengths are
/// checked by the caller; a trailing partial chunk (impossible after that check) is skipped.
fn blocks_to_f32<const B: usize, const E: usize>(
    src: &[u8],
    dst: &mut [f32],
    mut f: impl FnMut(&[u8; B], &mut [f32; E]),
) {
    for (s, d) in src.chunks_exact(B).zip(dst.chunks_exact_mut(E)) {
        if let (Ok(s), Ok(d)) = (<&[u8; B]>::try_from(s), <&mut [f32; E]>::try_from(d)) {
            f(s, d);
        }
    }
}

/// Runs `f` on each `E` values of `src` and the matching `B`-byte block of `dst`.
fn f32_to_blocks<const E: usize, const B: usize>(
    src: &[f32],
    dst: &mut [u8],
    mut f: impl FnMut(&[f32; E], &mut [u8; B]),
) {
    for (s, d) in src.chunks_exact(E).zip(dst.chunks_exact_mut(B)) {
        if let (Ok(s), Ok(d)) = (<&[f32; E]>::try_from(s), <&mut [u8; B]>::try_from(d)) {
            f(s, d);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Small numeric helpers shared by the quantizers. They pin down C's semantics exactly.

/// Groups whose largest magnitude is below this are treated as all zero (ggml's `GROUP_MAX_EPS`).
pub(crate) const GROUP_MAX_EPS: f32 = 1e-15;

/// ggml's `nearest_int`: adds 1.5·2^23 so the FPU rounds to nearest-even into the low mantissa
/// bits, then reads them back. Exact for |x| < 2^22; beyond that (or for NaN) it returns the same
/// wrapped garbage as ggml, which callers then clamp.
#[inline]
pub(crate) fn nearest_int(x: f32) -> i32 {
    let bits = (x + 12_582_912.0).to_bits() as i32;
    (bits & 0x007f_ffff) - 0x0040_0000
}

/// C's `(int)x` as x86-64 executes it (`cvttss2si`): truncation toward zero, and `i32::MIN` (the
/// "integer indefinite" value) for NaN and out-of-range inputs. Rust's `as` saturates instead.
#[inline]
pub(crate) fn trunc_i32(x: f32) -> i32 {
    if (-2_147_483_648.0..2_147_483_648.0).contains(&x) {
        x as i32
    } else {
        i32::MIN
    }
}

/// C's `MAX(a, b)` macro, `a > b ? a : b`, including its NaN behaviour (b wins).
#[inline]
pub(crate) fn c_max(a: f32, b: f32) -> f32 {
    if a > b {
        a
    } else {
        b
    }
}

/// Reads a little-endian u16 at `off` of a fixed-size block.
#[inline]
pub(crate) fn le_u16<const N: usize>(b: &[u8; N], off: usize) -> u16 {
    u16::from_le_bytes([b[off], b[off + 1]])
}

/// Reads `M` little-endian u16 starting at `off` of a fixed-size block.
#[inline]
pub(crate) fn le_u16_array<const N: usize, const M: usize>(b: &[u8; N], off: usize) -> [u16; M] {
    let mut out = [0u16; M];
    for (i, o) in out.iter_mut().enumerate() {
        *o = le_u16(b, off + 2 * i);
    }
    out
}

/// Copies `M` bytes at `off` of a fixed-size block into an array.
#[inline]
pub(crate) fn sub_array<const N: usize, const M: usize>(b: &[u8; N], off: usize) -> [u8; M] {
    let mut out = [0u8; M];
    out.copy_from_slice(&b[off..off + M]);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn length_errors() {
        let mut out = [0f32; 32];
        assert!(matches!(
            dequantize(GgmlType::Q4_0, &[0; 17], &mut out),
            Err(QuantError::NotBlockAligned { .. })
        ));
        assert!(matches!(
            dequantize(GgmlType::Q4_0, &[0; 36], &mut out),
            Err(QuantError::LengthMismatch {
                expected: 64,
                actual: 32,
                ..
            })
        ));
        let mut bytes = [0u8; 18];
        assert!(matches!(
            quantize(GgmlType::Q4_0, &[0.0; 31], &mut bytes),
            Err(QuantError::NotBlockAligned { .. })
        ));
        assert!(matches!(
            quantize(GgmlType::IQ2_XXS, &[0.0; 256], &mut bytes),
            Err(QuantError::Unsupported(GgmlType::IQ2_XXS))
        ));
        let msg = dequantize(GgmlType::Q4_K, &[0; 144], &mut out)
            .unwrap_err()
            .to_string();
        assert_eq!(
            msg,
            "q4_K: 1 block(s) need a destination of 256 f32 values, got 32"
        );
    }

    #[test]
    fn empty_is_fine() {
        for ty in crate::types::ALL_TYPES {
            if supports_quantize(ty) {
                assert_eq!(quantize(ty, &[], &mut []), Ok(()));
                assert_eq!(dequantize(ty, &[], &mut []), Ok(()));
            }
        }
    }

    #[test]
    fn block_structs_match_type_sizes() {
        use std::mem::size_of;
        let sizes = [
            (GgmlType::Q4_0, size_of::<BlockQ4_0>()),
            (GgmlType::Q4_1, size_of::<BlockQ4_1>()),
            (GgmlType::Q5_0, size_of::<BlockQ5_0>()),
            (GgmlType::Q5_1, size_of::<BlockQ5_1>()),
            (GgmlType::Q8_0, size_of::<BlockQ8_0>()),
            (GgmlType::Q8_1, size_of::<BlockQ8_1>()),
            (GgmlType::Q2_K, size_of::<BlockQ2K>()),
            (GgmlType::Q3_K, size_of::<BlockQ3K>()),
            (GgmlType::Q4_K, size_of::<BlockQ4K>()),
            (GgmlType::Q5_K, size_of::<BlockQ5K>()),
            (GgmlType::Q6_K, size_of::<BlockQ6K>()),
            (GgmlType::Q8_K, size_of::<BlockQ8K>()),
            (GgmlType::IQ4_NL, size_of::<BlockIq4Nl>()),
            (GgmlType::IQ4_XS, size_of::<BlockIq4Xs>()),
            (GgmlType::IQ2_XXS, size_of::<BlockIq2Xxs>()),
            (GgmlType::IQ2_XS, size_of::<BlockIq2Xs>()),
            (GgmlType::IQ2_S, size_of::<BlockIq2S>()),
            (GgmlType::IQ3_XXS, size_of::<BlockIq3Xxs>()),
            (GgmlType::IQ3_S, size_of::<BlockIq3S>()),
            (GgmlType::IQ1_S, size_of::<BlockIq1S>()),
            (GgmlType::IQ1_M, size_of::<BlockIq1M>()),
            (GgmlType::TQ1_0, size_of::<BlockTq1_0>()),
            (GgmlType::TQ2_0, size_of::<BlockTq2_0>()),
            (GgmlType::MXFP4, size_of::<BlockMxfp4>()),
            (GgmlType::NVFP4, size_of::<BlockNvfp4>()),
            (GgmlType::Q1_0, size_of::<BlockQ1_0>()),
            (GgmlType::Q2_0, size_of::<BlockQ2_0>()),
        ];
        for (ty, size) in sizes {
            assert_eq!(ty.type_size(), size, "{ty}");
        }
    }

    #[test]
    fn nearest_int_rounds_half_even() {
        assert_eq!(nearest_int(0.5), 0);
        assert_eq!(nearest_int(1.5), 2);
        assert_eq!(nearest_int(-2.5), -2);
        assert_eq!(nearest_int(-3.7), -4);
        assert_eq!(trunc_i32(f32::NAN), i32::MIN);
        assert_eq!(trunc_i32(3e9), i32::MIN);
        assert_eq!(trunc_i32(-7.9), -7);
    }
}
