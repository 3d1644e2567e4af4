//! CPU kernels: quantized matrix multiplication and the element-wise operations of a
//! transformer layer.

mod dot;
pub mod ops;
mod pool;

pub use dot::{has_kernel, vec_dot, vec_dot_type};
pub use pool::{physical_cores, ThreadPool};

use crate::quant;
use crate::types::GgmlType;

/// A row-major weight matrix kept in its GGUF encoding: `n_rows` rows of `n_cols`
/// elements (ggml's `ne[1]` × `ne[0]`).
#[derive(Clone, Copy, Debug)]
pub struct QMatrix<'a> {
    pub ty: GgmlType,
    pub data: &'a [u8],
    pub n_rows: usize,
    pub n_cols: usize,
}

impl<'a> QMatrix<'a> {
    pub fn row_bytes(&self) -> usize {
        self.n_cols / self.ty.block_size() * self.ty.type_size()
    }

    pub fn row(&self, r: usize) -> &'a [u8] {
        let rb = self.row_bytes();
        &self.data[r * rb..(r + 1) * rb]
    }

    /// Decodes row `r` into `out` (`n_cols` values).
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) -> Result<(), quant::QuantError> {
        quant::dequantize(self.ty, self.row(r), out)
    }
}

/// Encodes activation rows for [`vec_dot`] against weights of type `wty`: each of the
/// `x.len() / n_cols` rows becomes `vec_dot_type(wty)` blocks, stored back to back in `out`.
pub fn quantize_activations(
    wty: GgmlType,
    x: &[f32],
    n_cols: usize,
    out: &mut Vec<u8>,
) -> Result<usize, quant::QuantError> {
    let (aty, n_cols) = if has_kernel(wty) {
        (vec_dot_type(wty), n_cols)
    } else {
        (GgmlType::F32, n_cols)
    };
    let row_bytes = n_cols / aty.block_size() * aty.type_size();
    let n_rows = x.len() / n_cols;
    out.resize(row_bytes * n_rows, 0);
    for (xr, or) in x.chunks_exact(n_cols).zip(out.chunks_exact_mut(row_bytes)) {
        quant::quantize(aty, xr, or)?;
    }
    Ok(row_bytes)
}

#[derive(Clone, Copy)]
struct SendPtr(*mut f32);
unsafe impl Send for SendPtr {}
unsafe impl Sync for SendPtr {}

/// `out[t][r] = dot(w[r], x[t])` for `n_tok = x.len() / w.n_cols` activation rows:
/// activations are quantized once to the weight's vec-dot type, then output rows are
/// split across the pool. `out` holds `n_tok * w.n_rows` values, token-major.
pub fn matmul(
    pool: &ThreadPool,
    w: &QMatrix<'_>,
    x: &[f32],
    out: &mut [f32],
    scratch: &mut Vec<u8>,
) -> Result<(), quant::QuantError> {
    let n_tok = x.len() / w.n_cols;
    debug_assert_eq!(out.len(), n_tok * w.n_rows);
    let a_row_bytes = quantize_activations(w.ty, x, w.n_cols, scratch)?;
    let acts: &[u8] = scratch;
    let n_rows = w.n_rows;
    let dst = SendPtr(out.as_mut_ptr());
    let fast = has_kernel(w.ty);
    // rows per task: enough work to amortise scheduling, several tasks per thread
    let chunk = (n_rows / (pool.n_threads() * 8)).clamp(1, 64);
    let n_chunks = n_rows.div_ceil(chunk);
    pool.run(n_chunks, &|c| {
        let dst = dst;
        let r0 = c * chunk;
        let r1 = (r0 + chunk).min(n_rows);
        let mut deq = if fast {
            Vec::new()
        } else {
            vec![0f32; w.n_cols]
        };
        for r in r0..r1 {
            let wr = w.row(r);
            if !fast && w.dequantize_row(r, &mut deq).is_err() {
                deq.fill(0.0);
            }
            for t in 0..n_tok {
                let a = &acts[t * a_row_bytes..(t + 1) * a_row_bytes];
                let v = if fast {
                    vec_dot(w.ty, w.n_cols, wr, a)
                } else {
                    ops::dot_f32_bytes(&deq, a)
                };
                // SAFETY: each (t, r) is written by exactly one task; r < n_rows, t < n_tok.
                unsafe { *dst.0.add(t * n_rows + r) = v };
            }
        }
    });
    Ok(())
}

/// The slow reference: dequantize every weight row to f32 and take plain f32 dot
/// products with unquantized activations. Used by tests to check the fast path.
pub fn matmul_reference(
    w: &QMatrix<'_>,
    x: &[f32],
    out: &mut [f32],
) -> Result<(), quant::QuantError> {
    let n_tok = x.len() / w.n_cols;
    let mut row = vec![0f32; w.n_cols];
    for r in 0..w.n_rows {
        w.dequantize_row(r, &mut row)?;
        for t in 0..n_tok {
            let xr = &x[t * w.n_cols..(t + 1) * w.n_cols];
            let mut s = 0.0f64;
            for (a, b) in row.iter().zip(xr) {
                s += (*a as f64) * (*b as f64);
            }
            out[t * w.n_rows + r] = s as f32;
        }
    }
    Ok(())
}
