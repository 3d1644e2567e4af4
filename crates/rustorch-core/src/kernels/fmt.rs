//! Weight formats with SIMD kernels, as small integer ids usable as const generics, and
//! their block layouts as seen by the kernels.
//!
//! Every SIMD kernel computes, per output, exactly the float operations of its scalar
//! reference (`kernels::matmul_scalar`): integer partial sums are exact in any order, the
//! float steps are the same operations in the same order.

// Only the x86-64 kernels read these layouts so far.
#![cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]

use crate::types::GgmlType;

pub(crate) const Q4_0: u8 = 0;
pub(crate) const Q4_1: u8 = 1;
pub(crate) const Q5_0: u8 = 2;
pub(crate) const Q5_1: u8 = 3;
pub(crate) const Q8_0: u8 = 4;
pub(crate) const IQ4_NL: u8 = 5;
pub(crate) const Q4_K: u8 = 6;
pub(crate) const Q5_K: u8 = 7;
pub(crate) const Q6_K: u8 = 8;

pub(crate) fn from_type(ty: GgmlType) -> Option<u8> {
    Some(match ty {
        GgmlType::Q4_0 => Q4_0,
        GgmlType::Q4_1 => Q4_1,
        GgmlType::Q5_0 => Q5_0,
        GgmlType::Q5_1 => Q5_1,
        GgmlType::Q8_0 => Q8_0,
        GgmlType::IQ4_NL => IQ4_NL,
        GgmlType::Q4_K => Q4_K,
        GgmlType::Q5_K => Q5_K,
        GgmlType::Q6_K => Q6_K,
        _ => return None,
    })
}

pub(crate) const fn is_k(f: u8) -> bool {
    f >= Q4_K
}

/// Bytes per weight block.
pub(crate) const fn block_bytes(f: u8) -> usize {
    match f {
        Q4_0 | IQ4_NL => 18,
        Q4_1 => 20,
        Q5_0 => 22,
        Q5_1 => 24,
        Q8_0 => 34,
        Q4_K => 144,
        Q5_K => 176,
        _ => 210,
    }
}

/// Offset of the 4-bit quants in a legacy block.
pub(crate) const fn qs_off(f: u8) -> usize {
    match f {
        Q4_1 => 4,
        Q5_0 => 6,
        Q5_1 => 8,
        _ => 2,
    }
}

/// Offset of the 32 high bits of Q5_0/Q5_1.
pub(crate) const fn qh_off(f: u8) -> usize {
    match f {
        Q5_1 => 4,
        _ => 2,
    }
}

/// Legacy formats whose unpacked values are signed bytes (Q8_0, IQ4_NL).
pub(crate) const fn signed(f: u8) -> bool {
    matches!(f, Q8_0 | IQ4_NL)
}

/// The zero point subtracted from unsigned unpacked values (AVX2 view: signed formats have 0).
pub(crate) const fn offset(f: u8) -> i32 {
    match f {
        Q4_0 => 8,
        Q5_0 => 16,
        _ => 0,
    }
}

pub(crate) const fn has_min(f: u8) -> bool {
    matches!(f, Q4_1 | Q5_1)
}

/// Bytes per activation block (Q8_0 34, Q8_1 36, Q8_K 292).
pub(crate) const fn act_block_bytes(f: u8) -> usize {
    match f {
        Q4_1 | Q5_1 => 36,
        Q4_K | Q5_K | Q6_K => 292,
        _ => 34,
    }
}

/// Offset of the quants in an activation block.
pub(crate) const fn act_qs_off(f: u8) -> usize {
    match f {
        Q4_1 | Q5_1 => 4,
        Q4_K | Q5_K | Q6_K => 4,
        _ => 2,
    }
}

/// Values per weight block.
pub(crate) const fn block_len(f: u8) -> usize {
    if is_k(f) {
        256
    } else {
        32
    }
}

/// Bytes of one packed GEMM panel block (16 rows): the bytes in `[quad][row][4]` order, then
/// the per-row scales.
///
/// * legacy: 512 bytes of values, `f32 d[16]`, and for Q4_1/Q5_1 `f32 m[16]`;
/// * Q4_K/Q5_K: 4096 bytes, `i32 sc[8][16]`, `i32 (m | m << 16)[8][16]`, `f32 d[16]`, `f32 dmin[16]`;
/// * Q6_K: 4096 bytes, `i32 sc[16][16]`, `i32 (sc[2k] | sc[2k+1] << 16)[8][16]`, `f32 d[16]`.
pub(crate) const fn panel_block_bytes(f: u8) -> usize {
    match f {
        Q4_K | Q5_K => 4096 + 512 + 512 + 64 + 64,
        Q6_K => 4096 + 1024 + 512 + 64,
        _ => 512 + 64 + if has_min(f) { 64 } else { 0 },
    }
}

/// Rows per GEMM panel.
pub(crate) const PANEL: usize = 16;

/// One activation row as the kernels read it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct ActRow {
    /// The row's reference-format bytes.
    pub q: *const u8,
    /// Per-block scale.
    pub d: *const f32,
    /// Per-block Q8_1 `s` (Q4_1/Q5_1 only).
    pub s: *const f32,
    /// Per-block quant sums (legacy formats).
    pub isum: *const i32,
}

/// A tile of up to `T` consecutive activation rows and where their outputs go.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Tile {
    /// The tile's first activation row.
    pub a: ActRow,
    /// Bytes between activation rows.
    pub row_bytes: usize,
    /// Blocks per activation row (stride of the side arrays).
    pub nb: usize,
    /// Valid rows in the tile; rows past it repeat the last one and are not stored.
    pub nt: usize,
    /// Output of the tile's first row (first panel row).
    pub out: *mut f32,
    /// Floats between consecutive rows' outputs.
    pub ostride: usize,
}

impl Tile {
    /// Activation row `t` of the tile.
    #[inline(always)]
    pub fn act(&self, t: usize) -> ActRow {
        let t = t.min(self.nt - 1);
        ActRow {
            q: self.a.q.wrapping_add(t * self.row_bytes),
            d: self.a.d.wrapping_add(t * self.nb),
            s: self.a.s.wrapping_add(t * self.nb),
            isum: self.a.isum.wrapping_add(t * self.nb),
        }
    }
}
