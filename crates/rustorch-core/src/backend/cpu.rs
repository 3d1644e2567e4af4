//! The CPU backend: llama.cpp's CPU arithmetic bit for bit (see `docs/parity.md`), on the
//! kernels of [`crate::kernels`] and their thread pool. Weights stay in the memory-mapped
//! file; activations are `Vec<f32>`.

use std::borrow::Cow;
use std::sync::Mutex;

use super::{AttnSpec, Backend, BackendError, BiasedMoe, Device, Glu, Moe, Rows, WeightRef};
use crate::kernels::attn::{self, GroupQuery, HeadAttn};
use crate::kernels::attn_q::{self, KvRows, QuantAttn};
use crate::kernels::ops::{self, rms_norm, Rope};
use crate::kernels::{
    attn_tiled, gexp, isa, matmul, matmul_many, matmul_reference, matmul_swiglu, par_rows, QActs,
    QMatrix, ThreadPool,
};
use crate::kv_cache::{self, decode_row, words_as_bytes, KvCache, SeqId};
use crate::quant::f32_to_f16_row;
use crate::GgmlType;

/// Called with (llama.cpp's tensor name, layer, values) at each step of the graph, for
/// comparing intermediate tensors with llama.cpp's `llama-eval-callback`.
pub type TensorHook = Box<dyn Fn(&str, usize, &[f32]) + Send + Sync>;

/// Sees the input of every weight product as llama.cpp's `llama-imatrix` callback sees
/// `src1` of each `MUL_MAT` / `MUL_MAT_ID`: the f32 activations, before a product quantizes
/// them. Products of one input (Q/K/V, gate/up) report it once per weight.
pub trait ProductObserver: Send + Sync {
    /// One product: rows of `w.n_cols` values multiplied by `w`.
    fn product(&self, w: &WeightRef, x: &[f32]);
    /// A mixture-of-experts product: `experts[e]` is expert `e`'s matrix, batch row `t`
    /// goes to experts `ids[t*k .. t*k + k]` in the router's order, and `x` holds a row per
    /// batch row given to each of its experts (`per_slot = false`: gate/up) or a row per
    /// (batch row, slot) (`per_slot = true`: down).
    fn expert_product(
        &self,
        experts: &[WeightRef],
        ids: &[usize],
        k: usize,
        x: &[f32],
        per_slot: bool,
    );
}

/// Weights of the CPU backend are views of the mapped file; nothing is copied.
#[derive(Default)]
pub struct CpuDevice {
    /// Quantized-activation buffers kept between calls (a concurrent call makes its own).
    scratch: Mutex<Vec<QActs>>,
}

impl Device for CpuDevice {
    type Mat = WeightRef;
    type Vector = Vec<f32>;

    fn matrix(&self, _bytes: &[u8], w: &WeightRef) -> Result<WeightRef, BackendError> {
        Ok(*w)
    }

    fn vector(&self, v: Vec<f32>) -> Result<Vec<f32>, BackendError> {
        Ok(v)
    }
}

/// One forward call on the CPU.
pub struct Cpu<'a> {
    bytes: &'a [u8],
    pool: &'a ThreadPool,
    /// Dequantize and multiply in f32 instead of llama.cpp's quantized dot products.
    reference: bool,
    hook: Option<&'a TensorHook>,
    observer: Option<&'a dyn ProductObserver>,
    dev: &'a CpuDevice,
    qa: Vec<QActs>,
    /// The layer of the last hooked tensor (names the tensors hooked inside fused ops).
    layer: usize,
    /// Attention's f16 accumulator arithmetic (see [`crate::kernels::native_f16`]).
    native_f16: bool,
}

impl<'a> Cpu<'a> {
    pub fn new(
        dev: &'a CpuDevice,
        bytes: &'a [u8],
        pool: &'a ThreadPool,
        reference: bool,
        hook: Option<&'a TensorHook>,
    ) -> Self {
        let mut qa = dev
            .scratch
            .try_lock()
            .map(|mut s| std::mem::take(&mut *s))
            .unwrap_or_default();
        if qa.is_empty() {
            qa.push(QActs::new());
        }
        Cpu {
            bytes,
            pool,
            reference,
            hook,
            observer: None,
            dev,
            qa,
            layer: 0,
            native_f16: crate::kernels::native_f16(),
        }
    }

    /// Computes the attention's f16 accumulator as a llama.cpp build with (`true`) or
    /// without (`false`) AVX512-FP16 does, whatever this CPU has.
    pub fn with_native_f16(mut self, native: bool) -> Self {
        self.native_f16 = native;
        self
    }

    /// Reports every product's input to `observer` (`rustorch imatrix`).
    pub fn with_observer(mut self, observer: &'a dyn ProductObserver) -> Self {
        self.observer = Some(observer);
        self
    }

    fn observe(&self, w: &WeightRef, x: &[f32]) {
        if let Some(o) = self.observer {
            o.product(w, x);
        }
    }

    fn view(&self, w: &WeightRef) -> QMatrix<'a> {
        QMatrix {
            ty: w.ty,
            data: &self.bytes[w.start..w.start + w.len],
            n_rows: w.n_rows,
            n_cols: w.n_cols,
        }
    }

    fn mm(&mut self, w: &WeightRef, x: &[f32], out: &mut Vec<f32>) -> Result<(), BackendError> {
        let m = self.view(w);
        let out = resized(out, x.len() / w.n_cols * w.n_rows);
        if self.reference {
            matmul_reference(&m, x, out)?;
        } else {
            matmul(self.pool, &m, x, out, &mut self.qa[0])?;
        }
        Ok(())
    }
}

/// An expert's gated activation.
#[derive(Clone, Copy)]
enum ExpertAct {
    /// `silu(gate) ⊙ up` ([`gexp::swiglu`]).
    Silu,
    /// gpt-oss's clamped SwiGLU ([`ops::swiglu_oai`]).
    SwigluOai { alpha: f32, limit: f32 },
}

/// The experts of a mixture: matrices, biases (gate, up, down; a row per expert) and
/// activation.
struct Experts<'w> {
    gate: &'w [WeightRef],
    up: &'w [WeightRef],
    down: &'w [WeightRef],
    biases: Option<[&'w Vec<f32>; 3]>,
    act: ExpertAct,
}

impl Cpu<'_> {
    /// Stores each row's `k`/`v` in `cache`, then attends (with `sinks`, one logit per query
    /// head, when given). A quantized cache type turns on llama.cpp's Hadamard rotation of
    /// queries and keys (key type) and of values and the output (value type).
    #[allow(clippy::too_many_arguments)]
    fn attend(
        &mut self,
        spec: &AttnSpec,
        rows: Rows<'_>,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        cache: &mut KvCache,
        cells: &[usize],
        sinks: Option<&[f32]>,
        out: &mut Vec<f32>,
    ) {
        let kvd = cache.kv_dim();
        let (k_rot, v_rot) = (cache.k_rot(), cache.v_rot());
        let rotated = |x: &[f32], n: Option<usize>| {
            n.map(|n| {
                let mut r = x.to_vec();
                ops::fwht(&mut r, n);
                r
            })
        };
        let (qr, kr, vr) = (rotated(q, k_rot), rotated(k, k_rot), rotated(v, v_rot));
        let (q, k, v) = (
            qr.as_deref().unwrap_or(q),
            kr.as_deref().unwrap_or(k),
            vr.as_deref().unwrap_or(v),
        );
        for (i, &cell) in cells.iter().enumerate() {
            cache.write(
                rows.seq_ids[i],
                cell,
                spec.layer,
                &k[i * kvd..(i + 1) * kvd],
                &v[i * kvd..(i + 1) * kvd],
            );
        }
        let out = resized(out, rows.positions.len() * spec.n_head * spec.head_dim);
        attention(self.pool, self.native_f16, spec, rows, cache, q, sinks, out);
        if let Some(n) = v_rot {
            ops::fwht(out, n);
        }
    }

    /// `out[t] = Σ_slot weights[t·k + slot] · expert(x[t])` over the experts `picked` for
    /// row `t`, summed in slot order: each expert over the rows routed to it, one row at a
    /// time (llama.cpp's `mul_mat_id` takes its single-row kernels), `+ bias` after each
    /// product (`ggml_add_id`).
    fn run_experts(
        &mut self,
        ex: &Experts<'_>,
        x: &[f32],
        picked: &[usize],
        weights: &[f32],
        k: usize,
        out: &mut Vec<f32>,
    ) -> Result<(), BackendError> {
        let Some(first) = ex.down.first() else {
            return Err(BackendError::Device("a mixture without experts".into()));
        };
        let e = first.n_rows;
        let n = picked.len() / k.max(1);
        if let Some(o) = self.observer {
            o.expert_product(ex.gate, picked, k, x, false);
            o.expert_product(ex.up, picked, k, x, false);
        }
        // the down products' inputs, one row per (token, slot), for the observer
        let mut down_in = Vec::new();
        if self.observer.is_some() {
            down_in = vec![0f32; n * k * first.n_cols];
        }
        let bias = |b: Option<&Vec<f32>>, e: usize, len: usize, v: &mut [f32]| {
            if let Some(b) = b {
                add_into(v, &b[e * len..(e + 1) * len]);
            }
        };
        let [bg, bu, bd] = match ex.biases {
            Some([g, u, d]) => [Some(g), Some(u), Some(d)],
            None => [None; 3],
        };
        let mut slots: Vec<Vec<f32>> = vec![Vec::new(); n * k];
        let (mut g, mut u, mut d) = (Vec::new(), Vec::new(), Vec::new());
        for (id, (wg, (wu, wd))) in ex.gate.iter().zip(ex.up.iter().zip(ex.down)).enumerate() {
            let n_ff = wg.n_rows;
            for (i, _) in picked.iter().enumerate().filter(|&(_, &p)| p == id) {
                let xr = &x[(i / k) * wg.n_cols..(i / k + 1) * wg.n_cols];
                self.mm(wg, xr, &mut g)?;
                bias(bg, id, n_ff, &mut g);
                self.mm(wu, xr, &mut u)?;
                bias(bu, id, n_ff, &mut u);
                match ex.act {
                    ExpertAct::Silu => gexp::swiglu(isa(), &mut g, &u, n_ff),
                    ExpertAct::SwigluOai { alpha, limit } => {
                        ops::swiglu_oai(&mut g, &u, alpha, limit)
                    }
                }
                if !down_in.is_empty() {
                    down_in[i * g.len()..(i + 1) * g.len()].copy_from_slice(&g);
                }
                self.mm(wd, &g, &mut d)?;
                bias(bd, id, e, &mut d);
                let wt = weights[i];
                slots[i] = d.iter().map(|&v| v * wt).collect();
            }
        }
        if let Some(o) = self.observer {
            o.expert_product(ex.down, picked, k, &down_in, true);
        }
        let out = resized(out, n * e);
        for t in 0..n {
            let o = &mut out[t * e..(t + 1) * e];
            o.copy_from_slice(&slots[t * k]);
            for s in 1..k {
                add_into(o, &slots[t * k + s]);
            }
        }
        Ok(())
    }
}

impl Drop for Cpu<'_> {
    fn drop(&mut self) {
        if let Ok(mut s) = self.dev.scratch.try_lock() {
            if s.is_empty() {
                *s = std::mem::take(&mut self.qa);
            }
        }
    }
}

/// `v` holding exactly `n` values (contents unspecified: every caller overwrites them).
fn resized(v: &mut Vec<f32>, n: usize) -> &mut [f32] {
    v.resize(n, 0.0);
    &mut v[..n]
}

fn add_into(x: &mut [f32], y: &[f32]) {
    for (a, b) in x.iter_mut().zip(y) {
        *a += *b;
    }
}

/// Cosines and sines of the RoPE angles, `n_rot / 2` of each per row.
#[derive(Default)]
pub struct CpuAngles {
    half: usize,
    cos: Vec<f32>,
    sin: Vec<f32>,
}

impl<'a> Backend for Cpu<'a> {
    type Dev = CpuDevice;
    type Buf = Vec<f32>;
    type Angles = CpuAngles;

    fn embed(
        &mut self,
        table: &WeightRef,
        tokens: &[u32],
        out: &mut Vec<f32>,
    ) -> Result<(), BackendError> {
        let e = table.n_cols;
        let out = resized(out, tokens.len() * e);
        let t = self.view(table);
        for (i, &tok) in tokens.iter().enumerate() {
            t.dequantize_row(tok as usize, &mut out[i * e..(i + 1) * e])?;
        }
        Ok(())
    }

    fn rms_norm(&mut self, x: &Vec<f32>, w: &Vec<f32>, eps: f32, out: &mut Vec<f32>) {
        out.clear();
        out.extend_from_slice(x);
        self.rms_norm_inplace(out, w, eps);
    }

    fn rms_norm_inplace(&mut self, x: &mut Vec<f32>, w: &Vec<f32>, eps: f32) {
        // rows of a prompt (or per-head Q/K norms) over the pool, at least 8 rows a task
        par_rows(self.pool, x, w.len(), 8, &|_, rows| {
            for row in rows.chunks_exact_mut(w.len()) {
                rms_norm(row, w, eps);
            }
        });
    }

    fn matmul(
        &mut self,
        w: &WeightRef,
        x: &Vec<f32>,
        out: &mut Vec<f32>,
    ) -> Result<(), BackendError> {
        self.observe(w, x);
        self.mm(w, x, out)
    }

    fn matmul_many(
        &mut self,
        ws: &[&WeightRef],
        x: &Vec<f32>,
        outs: &mut [&mut Vec<f32>],
    ) -> Result<(), BackendError> {
        for w in ws {
            self.observe(w, x);
        }
        if self.reference {
            for (w, out) in ws.iter().zip(outs.iter_mut()) {
                self.mm(w, x, out)?;
            }
            return Ok(());
        }
        // one parallel job for all products (same results as separate calls)
        let views: Vec<QMatrix<'_>> = ws.iter().map(|w| self.view(w)).collect();
        let mut slices: Vec<&mut [f32]> = outs
            .iter_mut()
            .zip(ws)
            .map(|(o, w)| resized(o, x.len() / w.n_cols * w.n_rows))
            .collect();
        matmul_many(self.pool, &views, x, &mut slices, &mut self.qa)?;
        Ok(())
    }

    fn glu(
        &mut self,
        act: Glu,
        wg: &WeightRef,
        wu: &WeightRef,
        x: &Vec<f32>,
        gate: &mut Vec<f32>,
        up: &mut Vec<f32>,
    ) -> Result<(), BackendError> {
        let n_ff = wg.n_rows;
        self.observe(wg, x);
        self.observe(wu, x);
        if act == Glu::Silu && !self.reference && self.hook.is_none() {
            // one parallel job for gate, up and SwiGLU (same results as the steps below)
            let n = x.len() / wg.n_cols * n_ff;
            let (g, u) = (resized(gate, n), resized(up, n));
            matmul_swiglu(
                self.pool,
                &self.view(wg),
                &self.view(wu),
                x,
                g,
                u,
                &mut self.qa,
            )?;
            return Ok(());
        }
        self.mm(wg, x, gate)?;
        self.mm(wu, x, up)?;
        let il = self.layer;
        self.hook("ffn_gate", il, gate);
        self.hook("ffn_up", il, up);
        match act {
            Glu::Silu => gexp::swiglu(isa(), gate, up, n_ff),
            Glu::Gelu => par_rows(self.pool, gate, n_ff, 4, &|r0, g| {
                ops::geglu(g, &up[r0 * n_ff..r0 * n_ff + g.len()])
            }),
        }
        Ok(())
    }

    fn moe(
        &mut self,
        moe: &Moe<'_, WeightRef>,
        x: &Vec<f32>,
        out: &mut Vec<f32>,
    ) -> Result<(), BackendError> {
        let e = moe.router.n_cols;
        let n_expert = moe.router.n_rows;
        let n = x.len() / e;
        let k = moe.n_used;
        // router probabilities, then each row's experts and weights
        let mut probs = Vec::new();
        self.observe(moe.router, x);
        self.mm(moe.router, x, &mut probs)?;
        let mut picked = vec![0usize; n * k];
        let mut weights = vec![0f32; n * k];
        for t in 0..n {
            let p = &mut probs[t * n_expert..(t + 1) * n_expert];
            ops::soft_max(p);
            let mut order: Vec<usize> = (0..n_expert).collect();
            order.sort_by(|&a, &b| p[b].total_cmp(&p[a]));
            let w = &mut weights[t * k..(t + 1) * k];
            for (s, &ex) in order[..k].iter().enumerate() {
                picked[t * k + s] = ex;
                w[s] = p[ex];
            }
            if moe.norm {
                let sum = (w.iter().map(|&v| v as f64).sum::<f64>() as f32).max(6.103_515_6e-5);
                for v in w.iter_mut() {
                    *v /= sum;
                }
            }
        }
        let experts = Experts {
            gate: moe.gate,
            up: moe.up,
            down: moe.down,
            biases: None,
            act: ExpertAct::Silu,
        };
        self.run_experts(&experts, x, &picked, &weights, k, out)
    }

    fn moe_biased(
        &mut self,
        moe: &BiasedMoe<'_, WeightRef, Vec<f32>>,
        x: &Vec<f32>,
        out: &mut Vec<f32>,
    ) -> Result<(), BackendError> {
        let n_expert = moe.router.n_rows;
        let n = x.len() / moe.router.n_cols;
        let k = moe.n_used;
        // router logits plus bias; each row's experts by logit, in descending order
        // (ggml_argsort_top_k), weighted by the softmax of their logits
        let mut logits = Vec::new();
        self.observe(moe.router, x);
        self.mm(moe.router, x, &mut logits)?;
        self.add_bias(&mut logits, moe.router_bias);
        let mut picked = vec![0usize; n * k];
        let mut weights = vec![0f32; n * k];
        for t in 0..n {
            let l = &logits[t * n_expert..(t + 1) * n_expert];
            let mut order: Vec<usize> = (0..n_expert).collect();
            order.sort_by(|&a, &b| l[b].total_cmp(&l[a]));
            let w = &mut weights[t * k..(t + 1) * k];
            for (s, &ex) in order[..k].iter().enumerate() {
                picked[t * k + s] = ex;
                w[s] = l[ex];
            }
            ops::soft_max(w);
        }
        let experts = Experts {
            gate: moe.gate,
            up: moe.up,
            down: moe.down,
            biases: Some([moe.gate_bias, moe.up_bias, moe.down_bias]),
            act: ExpertAct::SwigluOai {
                alpha: moe.alpha,
                limit: moe.limit,
            },
        };
        self.run_experts(&experts, x, &picked, &weights, k, out)
    }

    fn add(&mut self, x: &mut Vec<f32>, y: &Vec<f32>) {
        add_into(x, y);
    }

    fn add_bias(&mut self, x: &mut Vec<f32>, b: &Vec<f32>) {
        for row in x.chunks_exact_mut(b.len()) {
            add_into(row, b);
        }
    }

    fn scale(&mut self, x: &mut Vec<f32>, s: f32) {
        for v in x.iter_mut() {
            *v *= s;
        }
    }

    fn softcap(&mut self, x: &mut Vec<f32>, cap: f32) {
        ops::softcap(x, cap);
    }

    fn rope_angles(
        &mut self,
        rope: &Rope,
        positions: &[u32],
        freqs: Option<&Vec<f32>>,
        out: &mut CpuAngles,
    ) {
        let half = rope.n_rot / 2;
        let n = positions.len();
        out.half = half;
        resized(&mut out.cos, n * half);
        resized(&mut out.sin, n * half);
        for (i, &p) in positions.iter().enumerate() {
            rope.angles(
                p as f32,
                freqs.map(|f| f.as_slice()),
                &mut out.cos[i * half..(i + 1) * half],
                &mut out.sin[i * half..(i + 1) * half],
            );
        }
    }

    fn rope(&mut self, x: &mut Vec<f32>, rope: &Rope, head_dim: usize, a: &CpuAngles) {
        let half = a.half;
        let n = a.cos.len() / half.max(1);
        if n == 0 {
            return;
        }
        let width = x.len() / n;
        for (i, row) in x.chunks_exact_mut(width).enumerate() {
            let (c, s) = (
                &a.cos[i * half..(i + 1) * half],
                &a.sin[i * half..(i + 1) * half],
            );
            for head in row.chunks_exact_mut(head_dim) {
                rope.apply(head, c, s);
            }
        }
    }

    fn attention(
        &mut self,
        spec: &AttnSpec,
        rows: Rows<'_>,
        q: &Vec<f32>,
        k: &Vec<f32>,
        v: &Vec<f32>,
        cache: &mut KvCache,
        cells: &[usize],
        out: &mut Vec<f32>,
    ) {
        self.attend(spec, rows, q, k, v, cache, cells, None, out);
    }

    fn attention_sinks(
        &mut self,
        spec: &AttnSpec,
        rows: Rows<'_>,
        q: &Vec<f32>,
        k: &Vec<f32>,
        v: &Vec<f32>,
        cache: &mut KvCache,
        cells: &[usize],
        sinks: &Vec<f32>,
        out: &mut Vec<f32>,
    ) -> Result<(), BackendError> {
        if sinks.len() != spec.n_head {
            return Err(BackendError::Device(format!(
                "{} attention sinks for {} heads",
                sinks.len(),
                spec.n_head
            )));
        }
        self.attend(spec, rows, q, k, v, cache, cells, Some(sinks), out);
        Ok(())
    }

    fn keep_rows(&mut self, x: &mut Vec<f32>, width: usize, rows: &[usize]) {
        for (k, &i) in rows.iter().enumerate() {
            x.copy_within(i * width..(i + 1) * width, k * width);
        }
        x.truncate(rows.len() * width);
    }

    fn read<'b>(&mut self, x: &'b Vec<f32>) -> Cow<'b, [f32]> {
        Cow::Borrowed(x)
    }

    fn hook(&mut self, name: &str, layer: usize, x: &Vec<f32>) {
        self.layer = layer;
        if let Some(h) = self.hook {
            h(name, layer, x);
        }
    }
}

#[derive(Clone, Copy)]
struct SendPtr(*mut f32);
unsafe impl Send for SendPtr {}
unsafe impl Sync for SendPtr {}

/// One sequence's key and value rows of a layer as attention reads them: f16 (f32 caches
/// rounded to f16, as llama.cpp casts them before its flash attention) or quantized bytes.
enum Side<'a> {
    F16(Cow<'a, [u16]>),
    Quant(GgmlType, &'a [u8]),
}

impl<'a> Side<'a> {
    fn of(ty: GgmlType, words: &'a [u16], kvd: usize) -> Side<'a> {
        match ty {
            GgmlType::F16 => Side::F16(Cow::Borrowed(words)),
            GgmlType::F32 => {
                let mut row = vec![0f32; kvd];
                let mut h = vec![0u16; words.len() / 2];
                for (src, dst) in words.chunks_exact(2 * kvd).zip(h.chunks_exact_mut(kvd)) {
                    decode_row(GgmlType::F32, words_as_bytes(src), &mut row);
                    f32_to_f16_row(&row, dst);
                }
                Side::F16(Cow::Owned(h))
            }
            _ => Side::Quant(ty, words_as_bytes(words)),
        }
    }

    /// The rows of KV head `kvh` (heads of `hd` values, rows of `kvd`).
    fn rows(&self, kvd: usize, kvh: usize, hd: usize) -> KvRows<'_> {
        match self {
            Side::F16(w) => KvRows::F16 {
                data: w,
                stride: kvd,
                offset: kvh * hd,
            },
            Side::Quant(ty, b) => KvRows::Quant {
                ty: *ty,
                data: b,
                stride: kv_cache::row_bytes(*ty, kvd),
                offset: kv_cache::row_bytes(*ty, kvh * hd),
            },
        }
    }
}

/// A sequence's rows of one layer.
struct SeqRows<'a> {
    seq: SeqId,
    k: Side<'a>,
    v: Side<'a>,
    pos: &'a [u32],
}

/// Causal grouped-query attention of every (token, head) against the cache cells of the
/// token's sequence whose position is not after the token's (and, with a sliding window,
/// not `window` or more before it).
///
/// The arithmetic follows llama.cpp's CPU flash attention, which its command-line tools
/// use by default: for an f16 cache the query is rounded to f16 for the f16 K·Q product,
/// the softmax is computed online (running max `m`, running sum `s`), and the weighted sum
/// of values is accumulated in an f16 vector, rescaled whenever a new maximum appears;
/// quantized cache types take [`attn_q`] (the query in the key type's vec-dot format,
/// quantized values accumulated in f32).
#[allow(clippy::too_many_arguments)]
fn attention(
    pool: &ThreadPool,
    native_f16: bool,
    spec: &AttnSpec,
    rows: Rows<'_>,
    cache: &KvCache,
    q: &[f32],
    sinks: Option<&[f32]>,
    out: &mut [f32],
) {
    let (hd, kvd) = (spec.head_dim, cache.kv_dim());
    let qd = spec.n_head * hd;
    let group = spec.n_head / spec.n_head_kv;
    let n = rows.positions.len();
    let dst = SendPtr(out.as_mut_ptr());
    let isa = isa();
    let types = cache.types();
    // the rows of each sequence in the batch, converted where attention reads another type
    let mut seqs: Vec<SeqRows<'_>> = Vec::new();
    for &sid in rows.seq_ids {
        if seqs.iter().any(|s| s.seq == sid) {
            continue;
        }
        if let Some(c) = cache.seq(sid) {
            seqs.push(SeqRows {
                seq: sid,
                k: Side::of(types.k, &c.k[spec.layer], kvd),
                v: Side::of(types.v, &c.v[spec.layer], kvd),
                pos: &c.pos,
            });
        }
    }
    let min_pos = |p: u32| match spec.window {
        Some(w) => (p + 1).saturating_sub(w),
        None => 0,
    };
    let scale = if spec.softcap != 0.0 {
        spec.scale / spec.softcap
    } else {
        spec.scale
    };
    // Queries of one KV head and a run of tokens of one sequence share a task, so keys and
    // values are converted once for all of them; results do not depend on the grouping.
    // Long batches take longer runs (up to 32 tokens; about 8 tasks per thread, at least 32
    // in all): the tiled attention converts and transposes each tile of 64 cells once per
    // task.
    let per_tile = if n == 1 {
        1
    } else {
        let tasks = (8 * pool.n_threads()).max(32);
        (n * spec.n_head_kv / tasks).clamp((16 / group).max(1), 32)
    };
    let mut tiles: Vec<(usize, usize)> = Vec::new();
    if n > 1 {
        let mut t0 = 0;
        while t0 < n {
            let mut t1 = t0 + 1;
            while t1 < n && t1 - t0 < per_tile && rows.seq_ids[t1] == rows.seq_ids[t0] {
                t1 += 1;
            }
            tiles.push((t0, t1));
            t0 = t1;
        }
    }
    let (n_tasks, heads_per_task) = if n == 1 {
        (spec.n_head, 1)
    } else {
        (tiles.len() * spec.n_head_kv, group)
    };
    pool.run(n_tasks, &|task| {
        #[allow(clippy::redundant_locals)]
        // capture the whole Send wrapper, not its raw-pointer field
        let dst = dst;
        let (t0, t1, head0) = if n == 1 {
            (0, 1, task)
        } else {
            // the last runs first: causal rows see more cells, so the pool's threads, which
            // claim tasks in order, end together
            let (t0, t1) = tiles[tiles.len() - 1 - task / spec.n_head_kv];
            (t0, t1, (task % spec.n_head_kv) * group)
        };
        let kvh = head0 / group;
        let Some(sr) = seqs.iter().find(|s| s.seq == rows.seq_ids[t0]) else {
            for t in t0..t1 {
                for head in head0..head0 + heads_per_task {
                    // SAFETY: as below.
                    unsafe { std::slice::from_raw_parts_mut(dst.0.add(t * qd + head * hd), hd) }
                        .fill(0.0);
                }
            }
            return;
        };
        let mut queries = Vec::with_capacity((t1 - t0) * heads_per_task);
        for t in t0..t1 {
            for head in head0..head0 + heads_per_task {
                let o = t * qd + head * hd;
                // SAFETY: each (token, head) output slice belongs to exactly one task.
                let out_head = unsafe { std::slice::from_raw_parts_mut(dst.0.add(o), hd) };
                queries.push(GroupQuery {
                    q: &q[o..o + hd],
                    min_pos: min_pos(rows.positions[t]),
                    max_pos: rows.positions[t],
                    out: out_head,
                });
            }
        }
        // each query's head's sink
        let per_query: Option<Vec<f32>> = sinks.map(|sk| {
            (t0..t1)
                .flat_map(|_| sk[head0..head0 + heads_per_task].iter().copied())
                .collect()
        });
        let (Side::F16(k16), Side::F16(v16)) = (&sr.k, &sr.v) else {
            // a quantized type: llama.cpp's one-query-row algorithm at every batch size
            let kv = QuantAttn {
                k: sr.k.rows(kvd, kvh, hd),
                v: sr.v.rows(kvd, kvh, hd),
                pos: sr.pos,
                scale,
                softcap: spec.softcap,
                native_f16,
            };
            match &per_query {
                Some(sk) => attn_q::attend_group_sinks(isa, &kv, &mut queries, sk),
                None => attn_q::attend_group(isa, &kv, &mut queries),
            }
            return;
        };
        let kv = HeadAttn {
            q: &[],
            k: k16,
            v: v16,
            stride: kvd,
            offset: kvh * hd,
            pos: sr.pos,
            min_pos: 0,
            max_pos: 0,
            scale,
            softcap: spec.softcap,
            native_f16,
        };
        if let Some(sk) = &per_query {
            // the one-row algorithm at every batch size (from 64 query rows on llama.cpp's
            // tiled one adds the sinks in its own float order)
            attn::attend_group_sinks(isa, &kv, &mut queries, sk);
            return;
        }
        // llama.cpp's flash attention takes its tiled algorithm from 64 query rows on; we
        // count the rows of this sequence only, so that a request's output does not depend
        // on what else shares the batch (for one sequence this is llama.cpp's rule)
        let seq = rows.seq_ids[t0];
        if n > 1 && rows.seq_ids.iter().filter(|&&s| s == seq).count() >= 64 {
            attn_tiled::attend_group(isa, &kv, &mut queries);
        } else {
            attn::attend_group(isa, &kv, &mut queries);
        }
    });
}
