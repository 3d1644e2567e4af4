//! What every architecture's step shares: the activation workspace, the per-call inputs and
//! outputs ([`Step`]), and building blocks made of backend ops (biases, the gated
//! feed-forward, the final norm and logits).

use rustorch_core::backend::{AttnSpec, Backend, Device, Glu, Rows};
use rustorch_core::kernels::ops::Rope;
use rustorch_core::kv_cache::KvCache;

use super::{ForwardOutput, HParams, LayerStat, ModelError};

/// Activation buffers kept between forward calls, so decoding allocates nothing per token
/// besides the returned logits.
#[derive(Default)]
pub(crate) struct Workspace<Buf, Ang> {
    pub x: Buf,
    pub h: Buf,
    pub q: Buf,
    pub k: Buf,
    pub v: Buf,
    pub attn: Buf,
    pub proj: Buf,
    pub gate: Buf,
    pub up: Buf,
    pub angles: Ang,
    /// Angles of the sliding-window layers (architectures with a second RoPE base).
    pub angles_swa: Ang,
}

/// A step's workspace on backend `B`.
pub(crate) type Ws<B> = Workspace<<B as Backend>::Buf, <B as Backend>::Angles>;

/// Everything of one forward call besides the backend and the activations.
pub(crate) struct Io<'s> {
    pub hp: &'s HParams,
    pub tokens: &'s [u32],
    pub rows: Rows<'s>,
    /// The positions RoPE rotates by (the rows' positions, unless a test plants a fault).
    pub rope_pos: &'s [u32],
    pub cache: &'s mut KvCache,
    /// The cache cell of each batch row.
    pub cells: &'s [usize],
    /// Batch rows that want logits.
    pub out_rows: Vec<usize>,
    /// Whether the last layer kept only `out_rows` (see [`Io::keep_output_rows`]).
    pub kept: bool,
    pub dump_layers: bool,
    pub stats: Vec<LayerStat>,
}

/// One forward call: the backend, the activations and the rest.
pub(crate) struct Step<'s, B: Backend> {
    pub be: &'s mut B,
    pub w: &'s mut Ws<B>,
    pub io: Io<'s>,
}

impl Io<'_> {
    /// The last layer's output only feeds the logits: like llama.cpp, keep just the rows
    /// that want logits from there on (its kernels depend on the row count).
    pub fn keep_output_rows<B: Backend>(&mut self, be: &mut B, bufs: &mut [&mut B::Buf]) {
        if self.out_rows.len() < self.tokens.len() {
            for b in bufs.iter_mut() {
                be.keep_rows(b, self.hp.n_embd, &self.out_rows);
            }
            self.kept = true;
        }
    }

    /// Rows still carried through the layers (fewer once the last layer kept only the
    /// output rows).
    pub fn n_rows(&self) -> usize {
        if self.kept {
            self.out_rows.len()
        } else {
            self.tokens.len()
        }
    }

    /// Records `--dump-layers` statistics of the residual stream after layer `il`.
    pub fn layer_stats<B: Backend>(&mut self, be: &mut B, il: usize, x: &B::Buf) {
        if !self.dump_layers {
            return;
        }
        let e = self.hp.n_embd;
        let x = be.read(x);
        for (k, row) in x.chunks_exact(e).enumerate() {
            let i = if self.kept { self.out_rows[k] } else { k };
            self.stats
                .push(layer_stat(il, i, self.rows.positions[i], row));
        }
    }

    /// `logits = (rms_norm(x) * norm) · Woutᵀ` for the rows that want them, with llama.cpp's
    /// names for the two tensors; `finish` (e.g. final-logit soft-capping) runs in between.
    pub fn logits<B: Backend>(
        self,
        be: &mut B,
        w: &mut Ws<B>,
        norm: &<B::Dev as Device>::Vector,
        output: &<B::Dev as Device>::Mat,
        finish: impl FnOnce(&mut B, &mut B::Buf),
    ) -> Result<ForwardOutput, ModelError> {
        if !self.kept {
            be.keep_rows(&mut w.x, self.hp.n_embd, &self.out_rows);
        }
        be.rms_norm(&w.x, norm, self.hp.rms_eps, &mut w.h);
        be.hook("result_norm", 0, &w.h);
        let logits = if self.out_rows.is_empty() {
            Vec::new()
        } else {
            be.matmul(output, &w.h, &mut w.gate)?;
            finish(be, &mut w.gate);
            be.hook("result_output", 0, &w.gate);
            be.read(&w.gate).into_owned()
        };
        Ok(ForwardOutput {
            logits: logits.into(),
            rows: self.out_rows,
            layer_stats: self.stats,
        })
    }
}

/// One layer's attention after the Q/K/V projections (in `w.q`, `w.k`, `w.v`).
pub(crate) struct Attention<'a, D: Device> {
    pub spec: AttnSpec,
    /// The layer's RoPE; sliding-window layers (`spec.window`) rotate with `w.angles_swa`.
    pub rope: &'a Rope,
    /// Per-head RMSNorm of queries and keys before RoPE (qwen3, gemma3).
    pub qk_norm: Option<(&'a D::Vector, &'a D::Vector)>,
    /// Multiply the queries by this after RoPE, before attention (gemma, phi3).
    pub q_scale: Option<f32>,
    /// A logit per query head that joins its softmax without a value (gpt-oss).
    pub sinks: Option<&'a D::Vector>,
    pub wo: &'a D::Mat,
    /// Added to the output projection (gpt-oss).
    pub wo_bias: Option<&'a D::Vector>,
}

/// `w.proj = attention(rope(norm(q)), rope(norm(k)), v) · Wo (+ bo)`, storing K/V in the
/// cache, with llama.cpp's tensor names.
pub(crate) fn attention<B: Backend>(
    be: &mut B,
    io: &mut Io<'_>,
    w: &mut Ws<B>,
    a: Attention<'_, B::Dev>,
) -> Result<(), ModelError> {
    let (il, hd) = (a.spec.layer, a.spec.head_dim);
    if let Some((qn, kn)) = a.qk_norm {
        be.rms_norm_inplace(&mut w.q, qn, io.hp.rms_eps);
        be.rms_norm_inplace(&mut w.k, kn, io.hp.rms_eps);
        be.hook("Qcur_normed", il, &w.q);
        be.hook("Kcur_normed", il, &w.k);
    }
    // rotate q and k by each token's own position
    let angles = if a.spec.window.is_some() {
        &w.angles_swa
    } else {
        &w.angles
    };
    be.rope(&mut w.q, a.rope, hd, angles);
    be.rope(&mut w.k, a.rope, hd, angles);
    be.hook("Qcur_rope", il, &w.q);
    be.hook("Kcur_rope", il, &w.k);
    if let Some(s) = a.q_scale {
        be.scale(&mut w.q, s);
        be.hook("Qcur_scaled", il, &w.q);
    }
    // store k, v in the cache, then attend
    match a.sinks {
        None => be.attention(
            &a.spec,
            io.rows,
            &w.q,
            &w.k,
            &w.v,
            io.cache,
            io.cells,
            &mut w.attn,
        ),
        Some(sinks) => be.attention_sinks(
            &a.spec,
            io.rows,
            &w.q,
            &w.k,
            &w.v,
            io.cache,
            io.cells,
            sinks,
            &mut w.attn,
        )?,
    }
    be.hook("kqv_out", il, &w.attn);
    be.matmul(a.wo, &w.attn, &mut w.proj)?;
    add_bias(be, &mut w.proj, a.wo_bias);
    be.hook("attn_out", il, &w.proj);
    Ok(())
}

/// The attention inputs of `w.h`: `q, k, v = h·Wq (+ bq), h·Wk (+ bk), h·Wv (+ bv)` in one
/// product call, hooked as `Qcur`, `Kcur`, `Vcur`.
pub(crate) fn qkv<B: Backend>(
    be: &mut B,
    w: &mut Ws<B>,
    il: usize,
    [wq, wk, wv]: [&<B::Dev as Device>::Mat; 3],
    [bq, bk, bv]: [Option<&<B::Dev as Device>::Vector>; 3],
) -> Result<(), ModelError> {
    be.matmul_many(&[wq, wk, wv], &w.h, &mut [&mut w.q, &mut w.k, &mut w.v])?;
    add_bias(be, &mut w.q, bq);
    add_bias(be, &mut w.k, bk);
    add_bias(be, &mut w.v, bv);
    be.hook("Qcur", il, &w.q);
    be.hook("Kcur", il, &w.k);
    be.hook("Vcur", il, &w.v);
    Ok(())
}

/// `x[row] += b` when the layer has a bias.
pub(crate) fn add_bias<B: Backend>(
    be: &mut B,
    x: &mut B::Buf,
    b: Option<&<B::Dev as Device>::Vector>,
) {
    if let Some(b) = b {
        be.add_bias(x, b);
    }
}

/// The gated feed-forward of `w.h` into `w.proj`: `(act(h·Wgate) ⊙ h·Wup)·Wdown`.
pub(crate) fn ffn_glu<B: Backend>(
    be: &mut B,
    act: Glu,
    gate: &<B::Dev as Device>::Mat,
    up: &<B::Dev as Device>::Mat,
    down: &<B::Dev as Device>::Mat,
    w: &mut Ws<B>,
    il: usize,
) -> Result<(), ModelError> {
    be.glu(act, gate, up, &w.h, &mut w.gate, &mut w.up)?;
    be.hook(
        match act {
            Glu::Silu => "ffn_swiglu",
            Glu::Gelu => "ffn_geglu",
        },
        il,
        &w.gate,
    );
    be.matmul(down, &w.gate, &mut w.proj)?;
    be.hook("ffn_out", il, &w.proj);
    Ok(())
}

fn layer_stat(layer: usize, batch_index: usize, pos: u32, row: &[f32]) -> LayerStat {
    let n = row.len() as f64;
    let sum: f64 = row.iter().map(|&v| v as f64).sum();
    let sq: f64 = row.iter().map(|&v| (v as f64) * (v as f64)).sum();
    LayerStat {
        layer,
        batch_index,
        pos,
        rms: (sq / n).sqrt() as f32,
        mean: (sum / n) as f32,
        max_abs: row.iter().fold(0f32, |m, &v| m.max(v.abs())),
    }
}
