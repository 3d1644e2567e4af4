//! Gemma 2 and Gemma 3, read top to bottom:
//!
//! ```text
//! x = embed(tokens) · √n_embd
//! for each layer:                                   local (sliding-window) or global
//!     h = rms_norm(x) * attn_norm
//!     q, k, v = h·Wq, h·Wk, h·Wv
//!     q, k = rms_norm(q) * q_norm, rms_norm(k) * k_norm    per head; Gemma 3 only
//!     q, k = rope(q, pos), rope(k, pos)             NEOX; local layers use their own base
//!     q = q · attention_scale                       before the f16 product, as llama.cpp
//!     cache[seq][pos] = k, v
//!     a = softmax(cap(q·Kᵀ)) · V                    local: only the last n_swa positions;
//!                                                   Gemma 2 soft-caps the scores
//!     x = x + rms_norm(a·Wo) * post_attention_norm
//!     h = rms_norm(x) * ffn_norm
//!     x = x + rms_norm((gelu(h·Wgate) ⊙ h·Wup)·Wdown) * post_ffw_norm     GeGLU
//! logits = cap(rms_norm(x) * output_norm · Woutᵀ)   Gemma 2 soft-caps; Wout tied to the embedding
//! ```

use rustorch_core::backend::{Backend, Device, Glu};

use super::ops::{self, Step};
use super::{Arch, ForwardOutput, HParams, Loader, ModelError};

struct Layer<D: Device> {
    attn_norm: D::Vector,
    wq: D::Mat,
    wk: D::Mat,
    wv: D::Mat,
    q_norm: Option<D::Vector>,
    k_norm: Option<D::Vector>,
    wo: D::Mat,
    post_attn_norm: D::Vector,
    ffn_norm: D::Vector,
    w_gate: D::Mat,
    w_up: D::Mat,
    w_down: D::Mat,
    post_ffw_norm: D::Vector,
}

pub(crate) struct Gemma<D: Device> {
    tok_embd: D::Mat,
    layers: Vec<Layer<D>>,
    output_norm: D::Vector,
    output: D::Mat,
    /// Multiplies the queries before attention.
    attn_scale: f32,
}

impl<D: Device> Gemma<D> {
    pub fn load(ld: &Loader<'_, D>, hp: &HParams) -> Result<Self, ModelError> {
        let (e, q, kv, ff, hd) = (hp.n_embd, hp.q_dim(), hp.kv_dim(), hp.n_ff, hp.head_dim);
        let qk_norm = hp.arch == Arch::Gemma3;
        let mut layers = Vec::with_capacity(hp.n_layer);
        for i in 0..hp.n_layer {
            let n = |s: &str| format!("blk.{i}.{s}");
            let norm = |s: &str| {
                if qk_norm {
                    ld.vector(&n(s), hd).map(Some)
                } else {
                    Ok(None)
                }
            };
            layers.push(Layer {
                attn_norm: ld.vector(&n("attn_norm.weight"), e)?,
                wq: ld.matrix(&n("attn_q.weight"), e, q)?,
                wk: ld.matrix(&n("attn_k.weight"), e, kv)?,
                wv: ld.matrix(&n("attn_v.weight"), e, kv)?,
                q_norm: norm("attn_q_norm.weight")?,
                k_norm: norm("attn_k_norm.weight")?,
                wo: ld.matrix(&n("attn_output.weight"), q, e)?,
                post_attn_norm: ld.vector(&n("post_attention_norm.weight"), e)?,
                ffn_norm: ld.vector(&n("ffn_norm.weight"), e)?,
                w_gate: ld.matrix(&n("ffn_gate.weight"), e, ff)?,
                w_up: ld.matrix(&n("ffn_up.weight"), e, ff)?,
                w_down: ld.matrix(&n("ffn_down.weight"), ff, e)?,
                post_ffw_norm: ld.vector(&n("post_ffw_norm.weight"), e)?,
            });
        }
        // Gemma 2 always ties the output to the embedding; Gemma 3 may have its own.
        let output = if hp.arch == Arch::Gemma2 {
            ld.matrix("token_embd.weight", e, hp.n_vocab)?
        } else {
            ld.output_or_tied(e, hp.n_vocab)?
        };
        // The 27B models scale by 1/√(n_embd / n_head) instead of 1/√head_dim.
        let big = (hp.arch == Arch::Gemma2 && hp.n_layer == 46)
            || (hp.arch == Arch::Gemma3 && hp.n_layer == 62);
        let attn_scale = if big {
            1.0 / ((hp.n_embd / hp.n_head) as f32).sqrt()
        } else {
            1.0 / (hd as f32).sqrt()
        };
        Ok(Gemma {
            tok_embd: ld.matrix("token_embd.weight", e, hp.n_vocab)?,
            layers,
            output_norm: ld.vector("output_norm.weight", e)?,
            output,
            attn_scale,
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
        be.rope_angles(&hp.rope, io.rope_pos, None, &mut w.angles);
        be.rope_angles(&hp.rope_swa, io.rope_pos, None, &mut w.angles_swa);

        // x = embed(tokens) · √n_embd
        be.embed(&self.tok_embd, io.tokens, &mut w.x)?;
        be.hook("embd", 0, &w.x);
        be.scale(&mut w.x, (hp.n_embd as f32).sqrt());
        be.hook("inp_scaled", 0, &w.x);
        for (il, l) in self.layers.iter().enumerate() {
            let local = hp.swa_layers[il];
            // h = rms_norm(x) * attn_norm
            be.rms_norm(&w.x, &l.attn_norm, hp.rms_eps, &mut w.h);
            be.hook("attn_norm", il, &w.h);
            ops::qkv(be, w, il, [&l.wq, &l.wk, &l.wv], [None; 3])?;
            // per-head Q/K norm (Gemma 3), rotation by each token's position, queries
            // scaled before the f16 product (attention scale 1)
            ops::attention(
                be,
                &mut io,
                w,
                ops::Attention {
                    spec: hp.attn_spec(il, 1.0),
                    rope: if local { &hp.rope_swa } else { &hp.rope },
                    qk_norm: l.q_norm.as_ref().zip(l.k_norm.as_ref()),
                    q_scale: Some(self.attn_scale),
                    sinks: None,
                    wo: &l.wo,
                    wo_bias: None,
                },
            )?;
            if il + 1 == n_layer {
                io.keep_output_rows(be, &mut [&mut w.x, &mut w.proj]);
            }
            // x = x + rms_norm(a·Wo) * post_attention_norm
            be.rms_norm_inplace(&mut w.proj, &l.post_attn_norm, hp.rms_eps);
            be.hook("attn_post_norm", il, &w.proj);
            be.add(&mut w.x, &w.proj);
            be.hook("sa_out", il, &w.x);

            // x = x + rms_norm(GeGLU feed-forward) * post_ffw_norm
            be.rms_norm(&w.x, &l.ffn_norm, hp.rms_eps, &mut w.h);
            be.hook("ffn_norm", il, &w.h);
            if io.n_rows() > 0 {
                ops::ffn_glu(be, Glu::Gelu, &l.w_gate, &l.w_up, &l.w_down, w, il)?;
                be.rms_norm_inplace(&mut w.proj, &l.post_ffw_norm, hp.rms_eps);
                be.hook("ffn_post_norm", il, &w.proj);
                be.add(&mut w.x, &w.proj);
            }
            be.hook("l_out", il, &w.x);
            io.layer_stats(be, il, &w.x);
        }
        let cap = hp.final_softcap;
        io.logits(be, w, &self.output_norm, &self.output, |be, logits| {
            if cap != 0.0 {
                be.softcap(logits, cap);
            }
        })
    }
}
