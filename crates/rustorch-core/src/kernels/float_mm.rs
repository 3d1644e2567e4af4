//! Products with F16 and F32 weight matrices, computed as llama.cpp's CPU backend (an
//! AVX-512 build) computes them, bit for bit:
//!
//! * F16 weights take f16 activations (each value rounded to nearest even);
//! * one activation row: `ggml_vec_dot_f16` / `ggml_vec_dot_f32`: four 16-lane f32
//!   accumulators fed by fused multiply-adds over blocks of 64, lanes reduced
//!   `(a0 + a2) + (a1 + a3)`, then `v[l] + v[l+8]`, `w[l] + w[l+4]`, `(u0 + u2) + (u1 + u3)`,
//!   leftover elements added in f64;
//! * two or more rows, `n_cols % 16 == 0` and `n_rows % 4 == 0`: llamafile's tinyBLAS, one
//!   16-lane f32 accumulator per output fed along the row, reduced like
//!   `_mm512_reduce_add_ps`;
//! * otherwise the one-row dot for every (row, activation row).

use super::cpu::Isa;
use super::pool::ThreadPool;
use super::QMatrix;
use crate::quant::{f16_to_f32, f32_to_f16_row};
use crate::types::GgmlType;

#[derive(Clone, Copy)]
struct SendPtr(*mut f32);
unsafe impl Send for SendPtr {}
unsafe impl Sync for SendPtr {}

/// Reads element `i` of a row of F16 or F32 values as f32.
trait Elem: Copy + Sync {
    fn get(row: &[Self], i: usize) -> f32;
}

impl Elem for u16 {
    #[inline(always)]
    fn get(row: &[u16], i: usize) -> f32 {
        f16_to_f32(row[i])
    }
}

impl Elem for f32 {
    #[inline(always)]
    fn get(row: &[f32], i: usize) -> f32 {
        row[i]
    }
}

/// `_mm512_reduce_add_ps` of gcc: halves, then quarters, then `(u0 + u2) + (u1 + u3)`.
#[inline(always)]
fn reduce16(v: &[f32; 16]) -> f32 {
    let w: [f32; 8] = std::array::from_fn(|l| v[l + 8] + v[l]);
    let u: [f32; 4] = std::array::from_fn(|l| w[l + 4] + w[l]);
    (u[0] + u[2]) + (u[1] + u[3])
}

/// `ggml_vec_dot_f16` / `ggml_vec_dot_f32` of an AVX-512 build.
#[inline(always)]
fn dot64<E: Elem>(x: &[E], y: &[E]) -> f32 {
    let n = x.len().min(y.len());
    let np = n & !63;
    let mut acc = [[0f32; 16]; 4];
    for i in (0..np).step_by(64) {
        for (j, lanes) in acc.iter_mut().enumerate() {
            for (l, a) in lanes.iter_mut().enumerate() {
                let k = i + 16 * j + l;
                *a = E::get(x, k).mul_add(E::get(y, k), *a);
            }
        }
    }
    let v: [f32; 16] = std::array::from_fn(|l| (acc[0][l] + acc[2][l]) + (acc[1][l] + acc[3][l]));
    let mut sum = reduce16(&v) as f64;
    for i in np..n {
        sum += (E::get(x, i) * E::get(y, i)) as f64;
    }
    sum as f32
}

/// tinyBLAS's per-output sum: one 16-lane accumulator along the row (`n % 16 == 0`).
#[inline(always)]
fn dot_tiny<E: Elem>(x: &[E], y: &[E]) -> f32 {
    let mut acc = [0f32; 16];
    for i in (0..x.len().min(y.len())).step_by(16) {
        for (l, a) in acc.iter_mut().enumerate() {
            *a = E::get(x, i + l).mul_add(E::get(y, i + l), *a);
        }
    }
    reduce16(&acc)
}

/// One product: weights and activations (`k` values per row), output layout, algorithm.
#[derive(Clone, Copy)]
struct Job<'a, E> {
    w: &'a [E],
    x: &'a [E],
    k: usize,
    n_rows: usize,
    tiny: bool,
    dst: SendPtr,
}

/// The products of output rows `r0..r1` for every activation row.
#[inline(always)]
fn rows<E: Elem>(j: Job<'_, E>, r0: usize, r1: usize) {
    let k = j.k;
    let n_tok = j.x.len() / k;
    for r in r0..r1 {
        let wr = &j.w[r * k..(r + 1) * k];
        for t in 0..n_tok {
            let xr = &j.x[t * k..(t + 1) * k];
            let v = if j.tiny {
                dot_tiny(wr, xr)
            } else {
                dot64(wr, xr)
            };
            // SAFETY: each (t, r) is written by exactly one task.
            unsafe { *j.dst.0.add(t * j.n_rows + r) = v };
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
unsafe fn rows_fma<E: Elem>(j: Job<'_, E>, r0: usize, r1: usize) {
    // same operations; the multiply-adds become instructions instead of library calls
    rows(j, r0, r1)
}

fn rows_isa<E: Elem>(isa: Isa, j: Job<'_, E>, r0: usize, r1: usize) {
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx512 {
        // SAFETY: the family (AVX-512F with FMA and F16C) was detected.
        unsafe { rows_fma(j, r0, r1) };
        return;
    }
    let _ = isa;
    rows(j, r0, r1)
}

/// Little-endian values of `T` in `bytes`: borrowed when aligned (GGUF tensor data is),
/// copied otherwise.
fn cast<T: Elem + Default + FromLe>(bytes: &[u8]) -> std::borrow::Cow<'_, [T]> {
    // SAFETY: u16 and f32 have no invalid bit patterns; only the aligned middle is used.
    let (pre, mid, post) = unsafe { bytes.align_to::<T>() };
    if pre.is_empty() && post.is_empty() && cfg!(target_endian = "little") {
        std::borrow::Cow::Borrowed(mid)
    } else {
        std::borrow::Cow::Owned(
            bytes
                .chunks_exact(std::mem::size_of::<T>())
                .map(T::from_le)
                .collect(),
        )
    }
}

trait FromLe {
    fn from_le(b: &[u8]) -> Self;
}

impl FromLe for u16 {
    fn from_le(b: &[u8]) -> u16 {
        u16::from_le_bytes([b[0], b[1]])
    }
}

impl FromLe for f32 {
    fn from_le(b: &[u8]) -> f32 {
        f32::from_le_bytes([b[0], b[1], b[2], b[3]])
    }
}

/// Whether [`matmul_float`] handles weights of type `ty`.
pub fn is_float(ty: GgmlType) -> bool {
    matches!(ty, GgmlType::F16 | GgmlType::F32)
}

/// `out[t][r] = dot(w[r], x[t])` for F16 or F32 weights, with llama.cpp's arithmetic.
pub fn matmul_float(pool: &ThreadPool, isa: Isa, w: &QMatrix<'_>, x: &[f32], out: &mut [f32]) {
    let k = w.n_cols;
    let n_tok = x.len() / k;
    let n_rows = w.n_rows;
    let tiny = n_tok >= 2 && k.is_multiple_of(16) && n_rows.is_multiple_of(4);
    let dst = SendPtr(out.as_mut_ptr());
    let n_tasks = (pool.n_threads() * 4).min(n_rows.div_ceil(16)).max(1);
    let per = n_rows.div_ceil(n_tasks);
    match w.ty {
        GgmlType::F16 => {
            let wv = cast::<u16>(w.data);
            let mut xv = vec![0u16; x.len()];
            f32_to_f16_row(x, &mut xv);
            let job = Job {
                w: &wv,
                x: &xv,
                k,
                n_rows,
                tiny,
                dst,
            };
            pool.run(n_tasks, &|task| {
                rows_isa(isa, job, task * per, ((task + 1) * per).min(n_rows));
            });
        }
        _ => {
            let wv = cast::<f32>(w.data);
            let job = Job {
                w: &wv,
                x,
                k,
                n_rows,
                tiny,
                dst,
            };
            pool.run(n_tasks, &|task| {
                rows_isa(isa, job, task * per, ((task + 1) * per).min(n_rows));
            });
        }
    }
}
