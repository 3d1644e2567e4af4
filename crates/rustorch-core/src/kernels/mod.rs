//! CPU kernels: quantized matrix multiplication and the element-wise operations of a
//! transformer layer.
//!
//! Every product follows the float order of llama.cpp's CPU backend for the same weight
//! format and batch size (the parity tests compare logits bit for bit): activations are
//! encoded as ggml-cpu encodes them (`qact`), legacy formats and Q6_K (under 8 rows) use
//! ggml's 8-lane order (`x86::lanes`, scalar reference `dot.rs`), Q4_K follows llama.cpp's
//! repacked gemm/gemv kernels (`q4k_ggml`, prompt batches on packed panels in
//! `x86::avx512::gemm_q4k_exact`), Q6_K batches of 8+ rows its tiled kernel (`q6k_tiled`).
//! [`matmul_scalar`] is the scalar statement of all of it; the SIMD paths are tested
//! against it bit for bit. A GEMV serves single rows; from [`GEMM_MIN_TOKENS`] rows on,
//! tiles share each unpacked weight block between several activation rows.

pub mod attn;
pub mod attn_q;
pub mod attn_tiled;
mod cpu;
mod dot;
mod fdot;
pub mod float_mm;
mod fmt;
pub mod gexp;
mod mxfp4;
pub mod ops;
mod pool;
mod q4k_ggml;
mod q6k_tiled;
mod qact;
pub mod vexp;
#[cfg(target_arch = "x86_64")]
mod x86;

pub use cpu::{isa, native_f16, Isa};
pub use dot::{has_kernel, vec_dot, vec_dot_type};
pub use fdot::{dot_f32_slices, dot_float};
pub use pool::{physical_cores, ThreadPool};
pub use qact::{quantize_scalar, quantize_simd, QActs};

use crate::quant;
use crate::types::GgmlType;
use fmt::ActRow;

/// Expands `$body` with `$F` bound to the const format id `$f`.
#[cfg(target_arch = "x86_64")]
macro_rules! with_fmt {
    ($f:expr, $F:ident => $body:expr) => {
        match $f {
            fmt::Q4_0 => {
                const $F: u8 = fmt::Q4_0;
                $body
            }
            fmt::Q4_1 => {
                const $F: u8 = fmt::Q4_1;
                $body
            }
            fmt::Q5_0 => {
                const $F: u8 = fmt::Q5_0;
                $body
            }
            fmt::Q5_1 => {
                const $F: u8 = fmt::Q5_1;
                $body
            }
            fmt::Q8_0 => {
                const $F: u8 = fmt::Q8_0;
                $body
            }
            fmt::IQ4_NL => {
                const $F: u8 = fmt::IQ4_NL;
                $body
            }
            fmt::Q4_K => {
                const $F: u8 = fmt::Q4_K;
                $body
            }
            fmt::Q5_K => {
                const $F: u8 = fmt::Q5_K;
                $body
            }
            _ => {
                const $F: u8 = fmt::Q6_K;
                $body
            }
        }
    };
}

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
/// (The scalar reference; [`QActs::quantize`] is the fast equivalent.)
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

#[derive(Clone, Copy)]
struct SendPtrU8(*mut u8);
unsafe impl Send for SendPtrU8 {}
unsafe impl Sync for SendPtrU8 {}
#[derive(Clone, Copy)]
struct SendConst(*const u8);
unsafe impl Send for SendConst {}
unsafe impl Sync for SendConst {}

/// Which algorithm [`matmul_with`] uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MatmulPath {
    /// GEMM from [`GEMM_MIN_TOKENS`] activation rows on, GEMV below.
    Auto,
    /// Always the row-by-row GEMV.
    Gemv,
    /// Always the packed GEMM (where the family has one).
    Gemm,
}

/// From this many activation rows on, [`MatmulPath::Auto`] multiplies tiles of activation
/// rows (each weight block unpacked once for the tile) instead of one row at a time.
pub const GEMM_MIN_TOKENS: usize = 2;

/// Runs `f(first_row, rows)` over `data` (rows of `row_len` values) split into runs of at
/// least `min_rows` rows spread over the pool; elementwise row operations give the same
/// results however the rows are split. A few rows, or few values (a decode step, per-head
/// norms), run here in one call: they cost less than a round trip through the pool.
pub fn par_rows(
    pool: &ThreadPool,
    data: &mut [f32],
    row_len: usize,
    min_rows: usize,
    f: &(dyn Fn(usize, &mut [f32]) + Sync),
) {
    if row_len == 0 {
        return;
    }
    let n_rows = data.len() / row_len;
    if n_rows < 4 || data.len() < 32 * 1024 {
        f(0, data);
        return;
    }
    let (n_tasks, per) = split(pool, n_rows, min_rows);
    let dst = SendPtr(data.as_mut_ptr());
    pool.run(n_tasks, &|task| {
        #[allow(clippy::redundant_locals)]
        // capture the whole Send wrapper, not its raw-pointer field
        let dst = dst;
        let (r0, r1) = (task * per, ((task + 1) * per).min(n_rows));
        // SAFETY: the tasks' row ranges are disjoint and inside `data`.
        let rows =
            unsafe { std::slice::from_raw_parts_mut(dst.0.add(r0 * row_len), (r1 - r0) * row_len) };
        f(r0, rows);
    });
}

/// `out[t][r] = dot(w[r], x[t])` for `n_tok = x.len() / w.n_cols` activation rows:
/// activations are quantized once to the weight's vec-dot type (into `qa`), then output rows
/// are split across the pool. `out` holds `n_tok * w.n_rows` values, token-major.
pub fn matmul(
    pool: &ThreadPool,
    w: &QMatrix<'_>,
    x: &[f32],
    out: &mut [f32],
    qa: &mut QActs,
) -> Result<(), quant::QuantError> {
    matmul_with(pool, isa(), MatmulPath::Auto, w, x, out, qa)
}

/// [`matmul`] with an explicit kernel family and algorithm (tests, benchmarks).
pub fn matmul_with(
    pool: &ThreadPool,
    isa: Isa,
    path: MatmulPath,
    w: &QMatrix<'_>,
    x: &[f32],
    out: &mut [f32],
    qa: &mut QActs,
) -> Result<(), quant::QuantError> {
    let n_tok = x.len() / w.n_cols;
    debug_assert_eq!(out.len(), n_tok * w.n_rows);
    if q4k_repacked(w) {
        return matmul_q4k_ggml(pool, isa, w, x, out);
    }
    if w.ty == GgmlType::Q6_K && n_tok >= 8 && cfg!(target_arch = "x86_64") {
        return matmul_q6k_tiled(pool, isa, w, x, out);
    }
    if float_mm::is_float(w.ty) {
        float_mm::matmul_float(pool, isa, w, x, out);
        return Ok(());
    }
    if w.ty == GgmlType::MXFP4 {
        return mxfp4::matmul(pool, isa, w, x, out, qa);
    }
    if !has_kernel(w.ty) {
        return matmul_dequant(pool, w, x, out);
    }
    qa.quantize(Some(pool), isa, vec_dot_type(w.ty), x, w.n_cols)?;
    matmul_q(pool, isa, path, w, qa, out);
    Ok(())
}

/// The product with activations already quantized (by [`QActs::quantize`] for `w.ty`).
pub fn matmul_q(
    pool: &ThreadPool,
    isa: Isa,
    path: MatmulPath,
    w: &QMatrix<'_>,
    qa: &QActs,
    out: &mut [f32],
) {
    let n_tok = qa.n_rows;
    assert!(out.len() >= n_tok * w.n_rows && qa.n_cols == w.n_cols);
    #[cfg(target_arch = "x86_64")]
    if let (Some(f), Isa::Avx2 | Isa::Avx512) = (fmt::from_type(w.ty), isa) {
        let gemm = match path {
            MatmulPath::Gemm => true,
            MatmulPath::Gemv => false,
            MatmulPath::Auto => n_tok >= GEMM_MIN_TOKENS,
        };
        if gemm {
            x86_gemm(pool, isa, f, w, qa, out);
        } else {
            x86_gemv(pool, isa, f, w, qa, out);
        }
        return;
    }
    let _ = path;
    generic_matmul(pool, isa, w, qa, out);
}

/// Several products with one input, `outs[i] = ws[i] · x` (all `ws[i]` with the same column
/// count): `x` is quantized once per activation type and, for a few activation rows, all
/// products run as one parallel job (one synchronisation instead of one per matrix).
/// `qa` is grown to hold the quantized copies. Results equal separate [`matmul`] calls.
pub fn matmul_many(
    pool: &ThreadPool,
    ws: &[QMatrix<'_>],
    x: &[f32],
    outs: &mut [&mut [f32]],
    qa: &mut Vec<QActs>,
) -> Result<(), quant::QuantError> {
    matmul_fused(pool, ws, x, outs, qa, false)
}

/// `gate = silu(wg · x) * (wu · x)` as one job for a few activation rows (the SwiGLU feed-forward
/// input); `up` receives `wu · x`. Results equal [`matmul`] twice followed by [`ops::swiglu`].
pub fn matmul_swiglu(
    pool: &ThreadPool,
    wg: &QMatrix<'_>,
    wu: &QMatrix<'_>,
    x: &[f32],
    gate: &mut [f32],
    up: &mut [f32],
    qa: &mut Vec<QActs>,
) -> Result<(), quant::QuantError> {
    matmul_fused(pool, &[*wg, *wu], x, &mut [gate, up], qa, true)
}

fn matmul_fused(
    pool: &ThreadPool,
    ws: &[QMatrix<'_>],
    x: &[f32],
    outs: &mut [&mut [f32]],
    qa: &mut Vec<QActs>,
    glu: bool,
) -> Result<(), quant::QuantError> {
    let isa = isa();
    assert_eq!(ws.len(), outs.len());
    let n_cols = ws[0].n_cols;
    let n_tok = x.len() / n_cols;
    let simd_gemv = matches!(isa, Isa::Avx2 | Isa::Avx512)
        && n_tok < GEMM_MIN_TOKENS
        && ws.iter().all(|w| {
            // below 4 activation rows llama.cpp's repacked Q4_K takes only its gemv order
            w.n_cols == n_cols && fmt::from_type(w.ty).is_some() && (n_tok < 4 || !q4k_repacked(w))
        })
        && (!glu || ws[0].n_rows == ws[1].n_rows);
    if !simd_gemv {
        while qa.is_empty() {
            qa.push(QActs::new());
        }
        for (w, out) in ws.iter().zip(outs.iter_mut()) {
            matmul_with(pool, isa, MatmulPath::Auto, w, x, out, &mut qa[0])?;
        }
        if glu {
            let (g, u) = outs.split_at_mut(1);
            swiglu_rows(pool, isa, g[0], u[0], ws[0].n_rows);
        }
        return Ok(());
    }
    // quantize once per activation type
    let mut slot = [0usize; 8];
    let mut types: Vec<GgmlType> = Vec::with_capacity(ws.len());
    for (i, w) in ws.iter().enumerate() {
        let aty = vec_dot_type(w.ty);
        slot[i] = match types.iter().position(|&t| t == aty) {
            Some(k) => k,
            None => {
                types.push(aty);
                if qa.len() < types.len() {
                    qa.push(QActs::new());
                }
                let k = types.len() - 1;
                qa[k].quantize(Some(pool), isa, aty, x, n_cols)?;
                k
            }
        };
    }
    #[cfg(target_arch = "x86_64")]
    {
        struct Job {
            kern: GemvFn,
            base: usize,
            rb: usize,
            nb: usize,
            n_rows: usize,
            groups: usize,
            per: usize,
            first_task: usize,
        }
        let mut jobs: Vec<Job> = Vec::with_capacity(ws.len());
        let mut n_tasks = 0;
        let total_groups: usize = ws.iter().map(|w| w.n_rows.div_ceil(8)).sum();
        let per_all = total_groups.div_ceil(pool.n_threads() * 4).max(2);
        for (i, w) in ws.iter().enumerate() {
            let f = fmt::from_type(w.ty).unwrap_or(fmt::Q8_0);
            let groups = w.n_rows.div_ceil(8);
            let per = if glu {
                jobs.first().map_or(per_all, |j: &Job| j.per)
            } else {
                per_all
            };
            let tasks = if glu && i == 1 {
                0
            } else {
                groups.div_ceil(per)
            };
            jobs.push(Job {
                kern: if q4k_repacked(w) {
                    q4k_gemv_kern(isa)
                } else {
                    gemv_kern(isa, f)
                },
                base: w.data.as_ptr() as usize,
                rb: w.row_bytes(),
                nb: w.n_cols / fmt::block_len(f),
                n_rows: w.n_rows,
                groups,
                per,
                first_task: n_tasks,
            });
            n_tasks += tasks;
        }
        let dsts: Vec<SendPtr> = outs.iter_mut().map(|o| SendPtr(o.as_mut_ptr())).collect();
        let qa: &Vec<QActs> = qa;
        let run_groups = |i: usize, g0: usize, g1: usize| {
            let j = &jobs[i];
            let q = &qa[slot[i]];
            for g in g0..g1 {
                let r0 = 8 * g;
                let nr = (j.n_rows - r0).min(8);
                for t in 0..n_tok {
                    // SAFETY: rows r0..r0+nr exist; outputs (t, r0..r0+nr) belong to this task.
                    unsafe {
                        (j.kern)(
                            (j.base as *const u8).add(r0 * j.rb),
                            j.rb,
                            nr,
                            j.nb,
                            act_row(q, t),
                            dsts[i].0.add(t * j.n_rows + r0),
                        )
                    };
                }
            }
        };
        pool.run(n_tasks, &|task| {
            let i = jobs
                .iter()
                .rposition(|j| j.first_task <= task && (j.groups > 0))
                .unwrap_or(0);
            let i = if glu { 0 } else { i };
            let j = &jobs[i];
            let k = task - j.first_task;
            let (g0, g1) = (k * j.per, ((k + 1) * j.per).min(j.groups));
            run_groups(i, g0, g1);
            if glu {
                run_groups(1, g0, g1);
                let n_rows = j.n_rows;
                let (r0, r1) = (8 * g0, (8 * g1).min(n_rows));
                for t in 0..n_tok {
                    // SAFETY: this task owns rows r0..r1 of both outputs for every token.
                    let (g, u) = unsafe {
                        (
                            std::slice::from_raw_parts_mut(dsts[0].0.add(t * n_rows + r0), r1 - r0),
                            std::slice::from_raw_parts(dsts[1].0.add(t * n_rows + r0), r1 - r0),
                        )
                    };
                    gexp::swiglu_part(isa, g, u, r0, n_rows);
                }
            }
        });
    }
    Ok(())
}

/// `gate = silu(gate) * up` over rows of `n` values, split over the pool for large inputs.
fn swiglu_rows(pool: &ThreadPool, isa: Isa, gate: &mut [f32], up: &[f32], n: usize) {
    par_rows(pool, gate, n.max(1), 1, &|t0, g| {
        gexp::swiglu(isa, g, &up[t0 * n..t0 * n + g.len()], n)
    });
}

#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
fn act_row(qa: &QActs, t: usize) -> ActRow {
    let nb = qa.nb;
    // SAFETY (of later reads): `t < n_rows`; side arrays are empty where the format has none
    // and then never read.
    ActRow {
        q: qa.data[t * qa.row_bytes..].as_ptr(),
        d: qa.d.as_ptr().wrapping_add(t * nb),
        s: qa.s.as_ptr().wrapping_add(t * nb),
        isum: qa.isum.as_ptr().wrapping_add(t * nb),
    }
}

/// Tasks for `units` units of work: a few per thread, at least `min_per` units each.
fn split(pool: &ThreadPool, units: usize, min_per: usize) -> (usize, usize) {
    let per = units.div_ceil(pool.n_threads() * 4).max(min_per).max(1);
    (units.div_ceil(per), per)
}

/// `out[t * n_rows + r] = dot(r, t)` for every weight row `r < n_rows` and activation row
/// `t < n_tok`, weight rows split over the pool (at least 16 a task): the element-by-element
/// paths (scalar references, formats without a tiled kernel).
pub(crate) fn each_output(
    pool: &ThreadPool,
    n_rows: usize,
    n_tok: usize,
    out: &mut [f32],
    dot: &(dyn Fn(usize, usize) -> f32 + Sync),
) {
    assert!(out.len() >= n_rows * n_tok);
    let dst = SendPtr(out.as_mut_ptr());
    let (n_tasks, per) = split(pool, n_rows, 16);
    pool.run(n_tasks, &|task| {
        #[allow(clippy::redundant_locals)]
        // capture the whole Send wrapper, not its raw-pointer field
        let dst = dst;
        for r in task * per..((task + 1) * per).min(n_rows) {
            for t in 0..n_tok {
                let v = dot(r, t);
                // SAFETY: each (t, r) is written by exactly one task, inside `out` (checked).
                unsafe { *dst.0.add(t * n_rows + r) = v };
            }
        }
    });
}

fn generic_matmul(pool: &ThreadPool, isa: Isa, w: &QMatrix<'_>, qa: &QActs, out: &mut [f32]) {
    each_output(pool, w.n_rows, qa.n_rows, out, &|r, t| {
        dot_float(isa, w.ty, w.n_cols, w.row(r), qa.row(t))
    });
}

/// Encodes one activation row: `(row index, values, output bytes)`.
type RowEncoder<'a> = dyn Fn(usize, &[f32], &mut [u8]) + Sync + 'a;

/// Encodes the `x.len() / n_cols` activation rows into `out` (`arb` bytes each) with
/// `enc(row index, row, bytes)`, rows split over the pool when there are several.
fn quantize_rows_par(
    pool: &ThreadPool,
    x: &[f32],
    n_cols: usize,
    out: &mut [u8],
    arb: usize,
    enc: &RowEncoder<'_>,
) {
    let n_tok = x.len() / n_cols;
    if n_tok < 4 {
        for (t, (xr, ar)) in x
            .chunks_exact(n_cols)
            .zip(out.chunks_exact_mut(arb))
            .enumerate()
        {
            enc(t, xr, ar);
        }
        return;
    }
    #[derive(Clone, Copy)]
    struct SendU8(*mut u8);
    unsafe impl Send for SendU8 {}
    unsafe impl Sync for SendU8 {}
    let dst = SendU8(out.as_mut_ptr());
    let (n_tasks, per) = split(pool, n_tok, 1);
    pool.run(n_tasks, &|task| {
        #[allow(clippy::redundant_locals)]
        // capture the whole Send wrapper, not its raw-pointer field
        let dst = dst;
        for t in task * per..((task + 1) * per).min(n_tok) {
            // SAFETY: each task writes its own rows of `out`.
            let ar = unsafe { std::slice::from_raw_parts_mut(dst.0.add(t * arb), arb) };
            enc(t, &x[t * n_cols..(t + 1) * n_cols], ar);
        }
    });
}

/// Whether llama.cpp's CPU backend multiplies these weights through its repacked Q4_K
/// kernels (x86 with AVX2, row count a multiple of 8), whose arithmetic `q4k_ggml` emulates.
fn q4k_repacked(w: &QMatrix<'_>) -> bool {
    w.ty == GgmlType::Q4_K && w.n_rows.is_multiple_of(8) && cfg!(target_arch = "x86_64")
}

/// Q4_K weights as llama.cpp multiplies them after repacking (see `q4k_ggml`): the first
/// `n_tok - n_tok % 4` activation rows are quantized with the 4x8 rule and use the gemm
/// float order, the rest are quantized with the reference Q8_K rule and use the gemv order.
fn matmul_q4k_ggml(
    pool: &ThreadPool,
    isa: Isa,
    w: &QMatrix<'_>,
    x: &[f32],
    out: &mut [f32],
) -> Result<(), quant::QuantError> {
    let n_cols = w.n_cols;
    let n_tok = x.len() / n_cols;
    let n_gemm = n_tok - n_tok % 4;
    let arb = n_cols / 256 * GgmlType::Q8_K.type_size();
    let mut acts = vec![0u8; n_tok * arb];
    quantize_rows_par(pool, x, n_cols, &mut acts, arb, &|t, xr, ar| {
        if t < n_gemm {
            q4k_ggml::quantize_row_q8k_4x8(xr, ar);
        } else {
            let _ = quant::quantize(GgmlType::Q8_K, xr, ar);
        }
    });
    let n_rows = w.n_rows;
    #[cfg(target_arch = "x86_64")]
    if matches!(isa, Isa::Avx2 | Isa::Avx512) && n_gemm > 0 {
        x86_q4k_panels(pool, w, &acts, n_tok, n_gemm, out, isa == Isa::Avx512);
        return Ok(());
    }
    #[cfg(target_arch = "x86_64")]
    if matches!(isa, Isa::Avx2 | Isa::Avx512) {
        // only gemv rows are left (fewer than 4 tokens): rows in groups of 8 over the pool;
        // inside a task, blocks of 64 rows against each token
        let rb = w.row_bytes();
        let nb = n_cols / 256;
        let kern = q4k_gemv_kern(isa);
        run_row_groups(pool, n_rows, 8, 2, out, &|gs, dst| {
            let end = (gs.end * 8).min(n_rows);
            let mut r0 = gs.start * 8;
            while r0 < end {
                let nr = (end - r0).min(64);
                let wp = w.data[r0 * rb..(r0 + nr) * rb].as_ptr();
                for t in n_gemm..n_tok {
                    let a = ActRow {
                        q: acts[t * arb..].as_ptr(),
                        d: std::ptr::null(),
                        s: std::ptr::null(),
                        isum: std::ptr::null(),
                    };
                    // SAFETY: AVX2+FMA+F16C (and AVX-512 for its kernel) checked by `isa`;
                    // rows r0..r0+nr and token t are in bounds, each (t, r) is written by
                    // exactly one task.
                    unsafe { kern(wp, rb, nr, nb, a, dst.add(t * n_rows + r0)) };
                }
                r0 += nr;
            }
        });
        return Ok(());
    }
    each_output(pool, n_rows, n_tok, out, &|r, t| {
        let a = &acts[t * arb..(t + 1) * arb];
        if t < n_gemm {
            q4k_ggml::dot_q4k_gemm_ggml(w.row(r), a)
        } else {
            q4k_ggml::dot_q4k_gemv_ggml(w.row(r), a)
        }
    });
    Ok(())
}

/// [`matmul_q4k_ggml`] for prompt batches: each 16-row weight panel is unpacked once
/// (`x86::pack_panel`) and multiplied with tiles of 4 activation rows, rows in the lanes
/// (`avx512::gemm_q4k_exact`, or with `!avx512` its 8-lane twin `avx2::gemm_q4k_exact`), the
/// gemm rows and the gemv rows each in their order.
#[cfg(target_arch = "x86_64")]
fn x86_q4k_panels(
    pool: &ThreadPool,
    w: &QMatrix<'_>,
    acts: &[u8],
    n_tok: usize,
    n_gemm: usize,
    out: &mut [f32],
    avx512: bool,
) {
    let n_rows = w.n_rows;
    let nb = w.n_cols / 256;
    let arb = nb * GgmlType::Q8_K.type_size();
    let ds: Vec<f32> = acts
        .chunks_exact(GgmlType::Q8_K.type_size())
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    let pbytes = nb * fmt::panel_block_bytes(fmt::Q4_K);
    let dst = SendPtr(out.as_mut_ptr());
    let act = |t: usize| ActRow {
        q: acts[t * arb..].as_ptr(),
        d: ds[t * nb..].as_ptr(),
        s: std::ptr::null(),
        isum: std::ptr::null(),
    };
    // AVX2 (the packing) and, with `avx512`, AVX-512 were detected by the caller.
    for_each_panel(
        pool,
        w,
        nb,
        pbytes,
        x86::pack_panel::<{ fmt::Q4_K }>,
        true,
        &|panel, r0, nvalid| {
            #[allow(clippy::redundant_locals)]
            // capture the whole Send wrapper, not its raw-pointer field
            let dst = dst;
            // SAFETY: the features were detected; the panel holds `pbytes`; a tile writes
            // outputs (t, r0..r0+nvalid) of its own valid tokens only.
            unsafe {
                let mut t0 = 0;
                while t0 < n_tok {
                    let (end, gemm) = if t0 < n_gemm {
                        (n_gemm, true)
                    } else {
                        (n_tok, false)
                    };
                    let nt = (end - t0).min(4);
                    let tile = fmt::Tile {
                        a: act(t0),
                        row_bytes: arb,
                        nb,
                        nt,
                        out: dst.0.add(t0 * n_rows + r0),
                        ostride: n_rows,
                    };
                    match (avx512, gemm) {
                        (true, true) => {
                            x86::avx512::gemm_q4k_exact::<4, true>(panel, nb, tile, nvalid)
                        }
                        (true, false) => {
                            x86::avx512::gemm_q4k_exact::<4, false>(panel, nb, tile, nvalid)
                        }
                        (false, true) => {
                            x86::avx2::gemm_q4k_exact::<4, true>(panel, nb, tile, nvalid)
                        }
                        (false, false) => {
                            x86::avx2::gemm_q4k_exact::<4, false>(panel, nb, tile, nvalid)
                        }
                    }
                    t0 += nt;
                }
            }
        },
    );
}

/// Q6_K weights against 8 or more activation rows, as llama.cpp's tiled K-quant kernel
/// computes them (see `q6k_tiled`).
fn matmul_q6k_tiled(
    pool: &ThreadPool,
    isa: Isa,
    w: &QMatrix<'_>,
    x: &[f32],
    out: &mut [f32],
) -> Result<(), quant::QuantError> {
    let n_cols = w.n_cols;
    let n_tok = x.len() / n_cols;
    let arb = n_cols / 256 * GgmlType::Q8_K.type_size();
    let mut acts = vec![0u8; n_tok * arb];
    quantize_rows_par(pool, x, n_cols, &mut acts, arb, &|_, xr, ar| {
        let _ = quant::quantize(GgmlType::Q8_K, xr, ar);
    });
    let n_rows = w.n_rows;
    let dst = SendPtr(out.as_mut_ptr());
    let (n_tasks, per) = split(pool, n_rows, 16);
    #[cfg(target_arch = "x86_64")]
    if let isa @ (Isa::Avx2 | Isa::Avx512) = isa {
        let (rb, nb) = (w.row_bytes(), n_cols / 256);
        pool.run(n_tasks, &|task| {
            #[allow(clippy::redundant_locals)]
            // capture the whole Send wrapper, not its raw-pointer field
            let dst = dst;
            let (r0, r1) = (task * per, ((task + 1) * per).min(n_rows));
            // rows in chunks that stay in cache while every token tile passes over them
            for c0 in (r0..r1).step_by(32) {
                let nr = 32.min(r1 - c0);
                let wp = w.row(c0).as_ptr();
                let mut t0 = 0;
                while t0 < n_tok {
                    let nt = (n_tok - t0).min(8);
                    let act = |i: usize| acts[(t0 + i.min(nt - 1)) * arb..].as_ptr();
                    // SAFETY: the ISA was detected; rows c0..c0 + nr and tokens t0..t0 + nt
                    // are in bounds, and each (t, r) is written by exactly one task.
                    unsafe {
                        let o = dst.0.add(t0 * n_rows + c0);
                        if nt <= 4 {
                            let a = [act(0), act(1), act(2), act(3)];
                            if isa == Isa::Avx512 {
                                q6k_tiled::x86::tile_avx512::<4>(wp, rb, nr, nb, &a, nt, o, n_rows);
                            } else {
                                q6k_tiled::x86::tile::<4>(wp, rb, nr, nb, &a, nt, o, n_rows);
                            }
                        } else {
                            let a = std::array::from_fn::<_, 8, _>(act);
                            if isa == Isa::Avx512 {
                                q6k_tiled::x86::tile_avx512::<8>(wp, rb, nr, nb, &a, nt, o, n_rows);
                            } else {
                                q6k_tiled::x86::tile::<8>(wp, rb, nr, nb, &a, nt, o, n_rows);
                            }
                        }
                    }
                    t0 += nt;
                }
            }
        });
        return Ok(());
    }
    each_output(pool, n_rows, n_tok, out, &|r, t| {
        q6k_tiled::dot_q6k_tiled_ggml(w.row(r), &acts[t * arb..(t + 1) * arb])
    });
    Ok(())
}

/// Weights without an integer kernel: dequantize each row, f32 dot with f32 activations.
fn matmul_dequant(
    pool: &ThreadPool,
    w: &QMatrix<'_>,
    x: &[f32],
    out: &mut [f32],
) -> Result<(), quant::QuantError> {
    let n_tok = x.len() / w.n_cols;
    let n_rows = w.n_rows;
    let dst = SendPtr(out.as_mut_ptr());
    let (n_tasks, per) = split(pool, n_rows, 16);
    let isa = isa();
    pool.run(n_tasks, &|task| {
        #[allow(clippy::redundant_locals)]
        // capture the whole Send wrapper, not its raw-pointer field
        let dst = dst;
        let mut deq = vec![0f32; w.n_cols];
        for r in task * per..((task + 1) * per).min(n_rows) {
            if w.dequantize_row(r, &mut deq).is_err() {
                deq.fill(0.0);
            }
            for t in 0..n_tok {
                let v = dot_f32_slices(isa, &deq, &x[t * w.n_cols..(t + 1) * w.n_cols]);
                // SAFETY: each (t, r) is written by exactly one task.
                unsafe { *dst.0.add(t * n_rows + r) = v };
            }
        }
    });
    Ok(())
}

#[cfg(target_arch = "x86_64")]
pub(crate) type GemvFn = unsafe fn(*const u8, usize, usize, usize, ActRow, *mut f32);

#[cfg(target_arch = "x86_64")]
/// The one-token kernel of format `f` (GGUF layout, `fmt`'s gemv order) at level `isa`.
#[cfg(target_arch = "x86_64")]
fn gemv_kern(isa: Isa, f: u8) -> GemvFn {
    if isa == Isa::Avx512 {
        with_fmt!(f, F => if F == fmt::Q6_K { x86::lanes::gemv_q6k512 as GemvFn } else if fmt::is_k(F) { x86::avx512::gemv_k::<F> } else if F == fmt::IQ4_NL { x86::lanes::gemv::<F> } else { x86::lanes::gemv512::<F> })
    } else {
        with_fmt!(f, F => if F == fmt::Q6_K { x86::lanes::gemv_q6k as GemvFn } else if fmt::is_k(F) { x86::avx2::gemv_k::<F> } else { x86::lanes::gemv::<F> })
    }
}

/// The one-token kernel of the Q4_K matrices llama.cpp repacks (ggml's gemv order) at level
/// `isa` (AVX2 or AVX-512).
#[cfg(target_arch = "x86_64")]
fn q4k_gemv_kern(isa: Isa) -> GemvFn {
    if isa == Isa::Avx512 {
        q4k_ggml::x86::gemv_repacked512
    } else {
        q4k_ggml::x86::gemv_repacked
    }
}

#[cfg(target_arch = "x86_64")]
fn x86_gemv(pool: &ThreadPool, isa: Isa, f: u8, w: &QMatrix<'_>, qa: &QActs, out: &mut [f32]) {
    let kern = gemv_kern(isa, f);
    let n_rows = w.n_rows;
    let n_tok = qa.n_rows;
    let rb = w.row_bytes();
    let nb = w.n_cols / fmt::block_len(f);
    run_row_groups(pool, n_rows, 8, 2, out, &|gs, dst| {
        let base = w.data.as_ptr();
        for g in gs.clone() {
            let r0 = 8 * g;
            let nr = (n_rows - r0).min(8);
            for t in 0..n_tok {
                // SAFETY: rows r0..r0+nr exist; outputs (t, r0..r0+nr) belong to this task.
                unsafe {
                    kern(
                        base.add(r0 * rb),
                        rb,
                        nr,
                        nb,
                        act_row(qa, t),
                        dst.add(t * n_rows + r0),
                    )
                };
            }
        }
    });
}

#[cfg(target_arch = "x86_64")]
thread_local! {
    static PANEL_BUF: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

#[cfg(target_arch = "x86_64")]
type PackFn = unsafe fn(&[*const u8; fmt::PANEL], usize, bool, *mut u8);

/// Runs `f(panel, first row, valid rows)` for every 16-row panel of `w`, split over the
/// pool; each panel is packed once (`pack(rows, nblk, flag, ..)`, `pbytes` bytes) into the
/// thread's panel buffer. The last panel repeats its last row; only `valid rows` count.
/// The caller must have detected the CPU features `pack` needs.
#[cfg(target_arch = "x86_64")]
fn for_each_panel(
    pool: &ThreadPool,
    w: &QMatrix<'_>,
    nblk: usize,
    pbytes: usize,
    pack: PackFn,
    flag: bool,
    f: &(dyn Fn(*const u8, usize, usize) + Sync),
) {
    let n_rows = w.n_rows;
    let rb = w.row_bytes();
    pool.run(n_rows.div_ceil(fmt::PANEL), &|p| {
        let base = w.data.as_ptr();
        PANEL_BUF.with(|buf| {
            let mut buf = buf.borrow_mut();
            if buf.len() < pbytes {
                buf.resize(pbytes, 0);
            }
            let r0 = p * fmt::PANEL;
            let nvalid = (n_rows - r0).min(fmt::PANEL);
            let rows: [*const u8; fmt::PANEL] =
                std::array::from_fn(|i| base.wrapping_add((r0 + i).min(n_rows - 1) * rb));
            // SAFETY: the rows exist; the buffer holds `pbytes`; the features were detected.
            unsafe { pack(&rows, nblk, flag, buf.as_mut_ptr()) };
            f(buf.as_ptr(), r0, nvalid);
        });
    });
}
#[cfg(target_arch = "x86_64")]
type Gemm512Fn = unsafe fn(*const u8, usize, fmt::Tile, usize);
#[cfg(target_arch = "x86_64")]
type Gemm2Fn = unsafe fn(*const u8, usize, usize, fmt::Tile, usize);

#[cfg(target_arch = "x86_64")]
type TileFn<const T: usize> =
    unsafe fn(*const u8, usize, usize, usize, &[ActRow; T], usize, *mut f32, usize);

/// Legacy formats and Q6_K: tiles of 4 activation rows against groups of weight rows, with
/// ggml's per-element float steps (`x86::lanes`).
#[cfg(target_arch = "x86_64")]
fn x86_gemm_lanes(
    pool: &ThreadPool,
    isa: Isa,
    f: u8,
    w: &QMatrix<'_>,
    qa: &QActs,
    out: &mut [f32],
) {
    if f == fmt::Q6_K {
        run_tiles::<4>(pool, x86::lanes::tile_q6k::<4>, f, w, qa, out);
    } else if isa == Isa::Avx512 && f != fmt::IQ4_NL {
        with_fmt!(f, F => run_tiles512::<F>(pool, w, qa, out));
    } else if f == fmt::Q4_0 {
        run_tiles_unpacked::<{ fmt::Q4_0 }>(pool, w, qa, out);
    } else if f == fmt::Q5_0 {
        run_tiles_unpacked::<{ fmt::Q5_0 }>(pool, w, qa, out);
    } else if f == fmt::Q8_0 {
        run_tiles_unpacked::<{ fmt::Q8_0 }>(pool, w, qa, out);
    } else if f == fmt::Q4_1 {
        run_tiles_unpacked::<{ fmt::Q4_1 }>(pool, w, qa, out);
    } else if f == fmt::Q5_1 {
        run_tiles_unpacked::<{ fmt::Q5_1 }>(pool, w, qa, out);
    } else {
        let kern: TileFn<8> = with_fmt!(f, F => x86::lanes::tile::<F, 8> as TileFn<8>);
        run_tiles::<8>(pool, kern, f, w, qa, out);
    }
}

#[cfg(target_arch = "x86_64")]
thread_local! {
    static UNPACKED: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Q4_0/Q5_0/Q8_0/Q4_1/Q5_1 on AVX2: as [`run_tiles`] with 8-row tiles, but each group of
/// 16 weight rows is unpacked once (`lanes::unpack_rows`, into the thread's buffer) for all
/// its activation tiles (`lanes::tile_u`).
#[cfg(target_arch = "x86_64")]
fn run_tiles_unpacked<const F: u8>(
    pool: &ThreadPool,
    w: &QMatrix<'_>,
    qa: &QActs,
    out: &mut [f32],
) {
    use x86::lanes::{tile_u, unpack_rows};
    let n_rows = w.n_rows;
    let n_tok = qa.n_rows;
    let rb = w.row_bytes();
    let nb = w.n_cols / fmt::block_len(F);
    run_row_groups(pool, n_rows, 16, 1, out, &|gs, dst| {
        let base = w.data.as_ptr();
        UNPACKED.with(|buf| {
            let mut buf = buf.borrow_mut();
            // per block of 16 rows: its 32 values as bytes, then (after all values) its scale
            // and (Q4_1/Q5_1, after all scales) its minimum
            let need = 16 * nb * if fmt::has_min(F) { 40 } else { 36 };
            if buf.len() < need {
                buf.resize(need, 0);
            }
            let xs = buf.as_mut_ptr();
            let dws = xs.wrapping_add(16 * nb * 32) as *mut f32;
            let mws = dws.wrapping_add(16 * nb);
            for g in gs.clone() {
                let r0 = 16 * g;
                let nr = (n_rows - r0).min(16);
                // SAFETY: AVX2/FMA/F16C were detected by the caller; rows r0..r0+nr exist; the
                // buffer holds `need` bytes; outputs (t, r0..r0+nr) belong to this task.
                unsafe {
                    unpack_rows::<F>(base.add(r0 * rb), rb, nr, nb, xs, dws, mws);
                    for t0 in (0..n_tok).step_by(8) {
                        let nt = (n_tok - t0).min(8);
                        let acts: [ActRow; 8] =
                            std::array::from_fn(|i| act_row(qa, t0 + i.min(nt - 1)));
                        let o = dst.add(t0 * n_rows + r0);
                        let a = &acts;
                        match nt {
                            1 => tile_u::<F, 1>(xs, dws, mws, nr, nb, &[a[0]], nt, o, n_rows),
                            2 => tile_u::<F, 2>(xs, dws, mws, nr, nb, &[a[0], a[1]], nt, o, n_rows),
                            3 | 4 => tile_u::<F, 4>(
                                xs,
                                dws,
                                mws,
                                nr,
                                nb,
                                &[a[0], a[1], a[2], a[3]],
                                nt,
                                o,
                                n_rows,
                            ),
                            _ => tile_u::<F, 8>(xs, dws, mws, nr, nb, a, nt, o, n_rows),
                        }
                    }
                }
            }
        });
    });
}

#[cfg(target_arch = "x86_64")]
thread_local! {
    static ACT_TILES: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Legacy formats on AVX-512: the activation rows are packed once into tiles of 8 (the last
/// tile 1, 2, 4 or 8 wide, the fewest that hold its rows), then `lanes::tile512` runs over
/// groups of 16 weight rows (split over the pool) and those tiles.
#[cfg(target_arch = "x86_64")]
fn run_tiles512<const F: u8>(pool: &ThreadPool, w: &QMatrix<'_>, qa: &QActs, out: &mut [f32]) {
    use x86::lanes::{act_tile_stride, pack_act_tile, tile512};
    let n_rows = w.n_rows;
    let n_tok = qa.n_rows;
    let rb = w.row_bytes();
    let nb = w.n_cols / fmt::block_len(F);
    let n_full = n_tok / 8;
    let (tail_t0, tail_nt) = (8 * n_full, n_tok % 8);
    let tail_t = match tail_nt {
        0 => 0,
        1 => 1,
        2 => 2,
        3 | 4 => 4,
        _ => 8,
    };
    let full_bytes = nb * act_tile_stride(F, 8);
    let tail_off = n_full * full_bytes;
    let total = tail_off + nb * act_tile_stride(F, tail_t);
    ACT_TILES.with(|buf| {
        let mut buf = buf.borrow_mut();
        if buf.len() < total {
            buf.resize(total, 0);
        }
        let acts = |t0: usize, n: usize| -> [ActRow; 8] {
            std::array::from_fn(|i| act_row(qa, t0 + i.min(n - 1)))
        };
        // the tiles over the pool (the tail as one more task)
        let base = SendPtrU8(buf.as_mut_ptr());
        pool.run(n_full + usize::from(tail_nt > 0), &|i| {
            #[allow(clippy::redundant_locals)]
            // capture the whole Send wrapper, not its raw-pointer field
            let base = base;
            // SAFETY: AVX-512 VNNI was detected by the caller; each tile's rows exist and its
            // destination, disjoint from the other tasks', lies inside the buffer (sizes
            // computed above).
            unsafe {
                if i < n_full {
                    pack_act_tile::<F, 8>(&acts(8 * i, 8), nb, base.0.add(i * full_bytes));
                    return;
                }
                let ta = acts(tail_t0, tail_nt);
                let (ta, td) = (&ta[..tail_nt], base.0.add(tail_off));
                match tail_t {
                    1 => pack_act_tile::<F, 1>(ta, nb, td),
                    2 => pack_act_tile::<F, 2>(ta, nb, td),
                    4 => pack_act_tile::<F, 4>(ta, nb, td),
                    _ => pack_act_tile::<F, 8>(ta, nb, td),
                }
            }
        });
        let at = SendConst(buf.as_ptr());
        let groups = n_rows.div_ceil(16);
        let (n_tasks, per) = split(pool, groups, 1);
        let dst = SendPtr(out.as_mut_ptr());
        pool.run(n_tasks, &|task| {
            #[allow(clippy::redundant_locals)]
            // capture the whole Send wrappers, not their raw-pointer fields
            let (dst, at) = (dst, at);
            let base = w.data.as_ptr();
            for g in task * per..((task + 1) * per).min(groups) {
                let r0 = 16 * g;
                let nr = (n_rows - r0).min(16);
                // SAFETY: rows r0..r0+nr exist; the tiles were packed above; outputs
                // (t, r0..r0+nr) of each tile's valid rows belong to this task.
                unsafe {
                    let wp = base.add(r0 * rb);
                    for i in 0..n_full {
                        let o = dst.0.add(8 * i * n_rows + r0);
                        tile512::<F, 8>(wp, rb, nr, nb, at.0.add(i * full_bytes), 8, o, n_rows);
                    }
                    if tail_nt > 0 {
                        let (a, o) = (at.0.add(tail_off), dst.0.add(tail_t0 * n_rows + r0));
                        match tail_t {
                            1 => tile512::<F, 1>(wp, rb, nr, nb, a, tail_nt, o, n_rows),
                            2 => tile512::<F, 2>(wp, rb, nr, nb, a, tail_nt, o, n_rows),
                            4 => tile512::<F, 4>(wp, rb, nr, nb, a, tail_nt, o, n_rows),
                            _ => tile512::<F, 8>(wp, rb, nr, nb, a, tail_nt, o, n_rows),
                        }
                    }
                }
            }
        });
    });
}

/// Splits the groups of `group` rows of `n_rows` output rows over the pool (at least
/// `min_per` groups a task): each task gets `body` with its contiguous range of groups and
/// the base of `out` (rows of `n_rows` per token), whose columns of those rows it alone
/// writes.
#[cfg(target_arch = "x86_64")]
fn run_row_groups(
    pool: &ThreadPool,
    n_rows: usize,
    group: usize,
    min_per: usize,
    out: &mut [f32],
    body: &(dyn Fn(std::ops::Range<usize>, *mut f32) + Sync),
) {
    let groups = n_rows.div_ceil(group);
    let (n_tasks, per) = split(pool, groups, min_per);
    let dst = SendPtr(out.as_mut_ptr());
    pool.run(n_tasks, &|task| {
        #[allow(clippy::redundant_locals)]
        // capture the whole Send wrapper, not its raw-pointer field
        let dst = dst;
        body(task * per..((task + 1) * per).min(groups), dst.0);
    });
}

/// Runs `kern` over groups of 16 weight rows (split over the pool) and tiles of `T`
/// activation rows.
#[cfg(target_arch = "x86_64")]
fn run_tiles<const T: usize>(
    pool: &ThreadPool,
    kern: TileFn<T>,
    f: u8,
    w: &QMatrix<'_>,
    qa: &QActs,
    out: &mut [f32],
) {
    let n_rows = w.n_rows;
    let n_tok = qa.n_rows;
    let rb = w.row_bytes();
    let nb = w.n_cols / fmt::block_len(f);
    run_row_groups(pool, n_rows, 16, 1, out, &|gs, dst| {
        let base = w.data.as_ptr();
        for g in gs {
            let r0 = 16 * g;
            let nr = (n_rows - r0).min(16);
            for t0 in (0..n_tok).step_by(T) {
                let nt = (n_tok - t0).min(T);
                let acts: [ActRow; T] = std::array::from_fn(|i| act_row(qa, t0 + i.min(nt - 1)));
                // SAFETY: rows r0..r0+nr exist; outputs (t0..t0+nt, r0..r0+nr) belong to this task.
                unsafe {
                    kern(
                        base.add(r0 * rb),
                        rb,
                        nr,
                        nb,
                        &acts,
                        nt,
                        dst.add(t0 * n_rows + r0),
                        n_rows,
                    )
                };
            }
        }
    });
}

#[cfg(target_arch = "x86_64")]
fn x86_gemm(pool: &ThreadPool, isa: Isa, f: u8, w: &QMatrix<'_>, qa: &QActs, out: &mut [f32]) {
    if !fmt::is_k(f) || f == fmt::Q6_K {
        x86_gemm_lanes(pool, isa, f, w, qa, out);
        return;
    }
    // what is left for the packed K-quant GEMM: Q4_K that llama.cpp does not repack, and Q5_K
    let (pack, k512, k2): (PackFn, Gemm512Fn, Gemm2Fn) = if f == fmt::Q4_K {
        (
            x86::pack_panel::<{ fmt::Q4_K }>,
            x86::avx512::gemm_k::<{ fmt::Q4_K }, 8>,
            x86::avx2::gemm_k::<{ fmt::Q4_K }, 4>,
        )
    } else {
        (
            x86::pack_panel::<{ fmt::Q5_K }>,
            x86::avx512::gemm_k::<{ fmt::Q5_K }, 8>,
            x86::avx2::gemm_k::<{ fmt::Q5_K }, 4>,
        )
    };
    let n_rows = w.n_rows;
    let n_tok = qa.n_rows;
    let nblk = w.n_cols / fmt::block_len(f);
    let pbytes = nblk * fmt::panel_block_bytes(f);
    let dst = SendPtr(out.as_mut_ptr());
    let avx512 = isa == Isa::Avx512;
    for_each_panel(pool, w, nblk, pbytes, pack, avx512, &|panel, r0, nvalid| {
        #[allow(clippy::redundant_locals)]
        // capture the whole Send wrapper, not its raw-pointer field
        let dst = dst;
        // SAFETY: the panel holds `pbytes`; a tile writes outputs (t, r0..r0+nvalid) of its
        // own valid tokens only.
        unsafe {
            let step = if avx512 { 8 } else { 4 };
            for t0 in (0..n_tok).step_by(step) {
                let tile = fmt::Tile {
                    a: act_row(qa, t0),
                    row_bytes: qa.row_bytes,
                    nb: qa.nb,
                    nt: (n_tok - t0).min(step),
                    out: dst.0.add(t0 * n_rows + r0),
                    ostride: n_rows,
                };
                if avx512 {
                    k512(panel, nblk, tile, nvalid);
                } else {
                    k2(panel, 0, nblk, tile, nvalid.min(8));
                    if nvalid > 8 {
                        let hi = fmt::Tile {
                            out: tile.out.add(8),
                            ..tile
                        };
                        k2(panel, 1, nblk, hi, nvalid - 8);
                    }
                }
            }
        }
    });
}

/// What [`matmul`] computes, one output at a time with the scalar code: the same choice of
/// llama.cpp arithmetic per weight format and batch size (activation encoding, product
/// order), without SIMD or threads. The reference the fast kernels are tested against
/// bit for bit (F16/F32 weights: up to summation order).
pub fn matmul_scalar(w: &QMatrix<'_>, x: &[f32], out: &mut [f32]) -> Result<(), quant::QuantError> {
    let n_cols = w.n_cols;
    let n_tok = x.len() / n_cols;
    let n_rows = w.n_rows;
    let q4k = q4k_repacked(w);
    let q6k_tiled = w.ty == GgmlType::Q6_K && n_tok >= 8 && cfg!(target_arch = "x86_64");
    if !has_kernel(w.ty) && !q4k {
        return matmul_dequant(&ThreadPool::new(1), w, x, out);
    }
    let aty = if q4k {
        GgmlType::Q8_K
    } else {
        vec_dot_type(w.ty)
    };
    let arb = n_cols / aty.block_size() * aty.type_size();
    let n_gemm = n_tok - n_tok % 4;
    let mut acts = vec![0u8; n_tok * arb];
    for (t, (xr, ar)) in x
        .chunks_exact(n_cols)
        .zip(acts.chunks_exact_mut(arb))
        .enumerate()
    {
        if q4k && t < n_gemm {
            q4k_ggml::quantize_row_q8k_4x8_ggml(xr, ar);
        } else {
            quantize_scalar(aty, xr, ar)?;
        }
    }
    for t in 0..n_tok {
        let a = &acts[t * arb..(t + 1) * arb];
        for r in 0..n_rows {
            let wr = w.row(r);
            out[t * n_rows + r] = if q4k && t < n_gemm {
                q4k_ggml::dot_q4k_gemm_ggml(wr, a)
            } else if q4k {
                q4k_ggml::dot_q4k_gemv_ggml(wr, a)
            } else if q6k_tiled {
                q6k_tiled::dot_q6k_tiled_ggml(wr, a)
            } else {
                vec_dot(w.ty, n_cols, wr, a)
            };
        }
    }
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
