//! Phi-3 (mini, medium, 3.5, 4-mini), read top to bottom:
//!
//! ```text
//! x = embed(tokens)
//! for each layer:
//!     h = rms_norm(x) * attn_norm
//!     q, k, v = h·Wqkv                         one fused weight: Q rows, then K, then V
//!     q, k = rope(q, pos), rope(k, pos)        NEOX; long/short frequency factors when present
//!     q = q / √head_dim                        before the f16 product, as llama.cpp
//!     cache[seq][pos] = k, v
//!     a = softmax(q·Kᵀ, causal) · V
//!     x = x + a·Wo
//!     h = rms_norm(x) * ffn_norm
//!     g, u = h·Wup                             one fused weight: gate rows, then up rows
//!     x = x + (silu(g) ⊙ u)·Wdown
//! logits = rms_norm(x) * output_norm · Woutᵀ
//! ```

use rustorch_core::backend::{Backend, Device, Glu};

use super::ops::{self, Step};
use super::{ForwardOutput, HParams, Loader, ModelError};

struct Layer<D: Device> {
    attn_norm: D::Vector,
    /// Q, K and V row blocks of the fused `attn_qkv` (or the separate weights).
    wqkv: Vec<D::Mat>,
    wo: D::Mat,
    ffn_norm: D::Vector,
    /// Gate and up row blocks of the fused `ffn_up`.
    w_gate_up: Vec<D::Mat>,
    w_down: D::Mat,
}

pub(crate) struct Phi3<D: Device> {
    tok_embd: D::Mat,
    layers: Vec<Layer<D>>,
    output_norm: D::Vector,
    output: D::Mat,
    rope_factors: Option<D::Vector>,
}

impl<D: Device> Phi3<D> {
    pub fn load(ld: &Loader<'_, D>, hp: &HParams) -> Result<Self, ModelError> {
        let (e, q, kv, ff) = (hp.n_embd, hp.q_dim(), hp.kv_dim(), hp.n_ff);
        let mut layers = Vec::with_capacity(hp.n_layer);
        for i in 0..hp.n_layer {
            let n = |s: &str| format!("blk.{i}.{s}");
            let wqkv = if ld.has(&n("attn_qkv.weight")) {
                ld.matrix_parts(&n("attn_qkv.weight"), e, &[q, kv, kv])?
            } else {
                vec![
                    ld.matrix(&n("attn_q.weight"), e, q)?,
                    ld.matrix(&n("attn_k.weight"), e, kv)?,
                    ld.matrix(&n("attn_v.weight"), e, kv)?,
                ]
            };
            layers.push(Layer {
                attn_norm: ld.vector(&n("attn_norm.weight"), e)?,
                wqkv,
                wo: ld.matrix(&n("attn_output.weight"), q, e)?,
                ffn_norm: ld.vector(&n("ffn_norm.weight"), e)?,
                w_gate_up: ld.matrix_parts(&n("ffn_up.weight"), e, &[ff, ff])?,
                w_down: ld.matrix(&n("ffn_down.weight"), ff, e)?,
            });
        }
        // Contexts up to the original training length use the short factors (llama.cpp
        // picks by the context size; ours is not known at load time, so the short ones).
        let rope_factors = ld.optional_vector("rope_factors_short.weight", hp.rope.n_rot / 2)?;
        Ok(Phi3 {
            tok_embd: ld.matrix("token_embd.weight", e, hp.n_vocab)?,
            layers,
            output_norm: ld.vector("output_norm.weight", e)?,
            output: ld.output_or_tied(e, hp.n_vocab)?,
            rope_factors,
        })
    }

    /// One forward step of the batch in `st`.
    pub fn forward<B: Backend<Dev = D>>(
        &self,
        st: Step<'_, B>,
    ) -> Result<ForwardOutput, ModelError> {
        let Step { be, w, mut io } = st;
        let hp = io.hp;
        let n_layer = self.layers.len();
        be.rope_angles(
            &hp.rope,
            io.rope_pos,
            self.rope_factors.as_ref(),
            &mut w.angles,
        );

        be.embed(&self.tok_embd, io.tokens, &mut w.x)?;
        be.hook("embd", 0, &w.x);
        for (il, l) in self.layers.iter().enumerate() {
            be.rms_norm(&w.x, &l.attn_norm, hp.rms_eps, &mut w.h);
            be.hook("attn_norm", il, &w.h);
            let [wq, wk, wv] = [&l.wqkv[0], &l.wqkv[1], &l.wqkv[2]];
            ops::qkv(be, w, il, [wq, wk, wv], [None; 3])?;
            // queries scaled by 1/√d before the f16 product, attention scale 1
            ops::attention(
                be,
                &mut io,
                w,
                ops::Attention {
                    spec: hp.attn_spec(il, 1.0),
                    rope: &hp.rope,
                    qk_norm: None,
                    q_scale: Some(1.0 / (hp.head_dim as f32).sqrt()),
                    sinks: None,
                    wo: &l.wo,
                    wo_bias: None,
                },
            )?;
            if il + 1 == n_layer {
                io.keep_output_rows(be, &mut [&mut w.x, &mut w.proj]);
            }
            be.add(&mut w.x, &w.proj);
            be.hook("ffn_inp", il, &w.x);

            be.rms_norm(&w.x, &l.ffn_norm, hp.rms_eps, &mut w.h);
            be.hook("ffn_norm", il, &w.h);
            if io.n_rows() > 0 {
                let (gate, up) = (&l.w_gate_up[0], &l.w_gate_up[1]);
                ops::ffn_glu(be, Glu::Silu, gate, up, &l.w_down, w, il)?;
                be.add(&mut w.x, &w.proj);
            }
            be.hook("l_out", il, &w.x);
            io.layer_stats(be, il, &w.x);
        }
        io.logits(be, w, &self.output_norm, &self.output, |_, _| {})
    }
}
