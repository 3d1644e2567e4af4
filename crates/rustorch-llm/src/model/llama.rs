//! The llama architecture (SmolLM2, TinyLlama, Llama-2/3, Mistral) and its qwen2, qwen3
//! and qwen3moe variants, read top to bottom:
//!
//! ```text
//! x = embed(tokens)
//! for each layer:
//!     h = rms_norm(x) * attn_norm
//!     q, k, v = h·Wq (+bq), h·Wk (+bk), h·Wv (+bv)      qwen2 has the biases
//!     q, k = rms_norm(q) * q_norm, rms_norm(k) * k_norm  per head; qwen3 only
//!     q, k = rope(q, pos), rope(k, pos)                  llama: adjacent pairs, qwen: NEOX halves
//!     cache[seq][pos] = k, v
//!     a = softmax(q·Kᵀ / √d, causal by position) · V     grouped-query: head h reads KV head h / (n_head / n_kv)
//!     x = x + a·Wo
//!     h = rms_norm(x) * ffn_norm
//!     x = x + (silu(h·Wgate) ⊙ h·Wup)·Wdown             SwiGLU
//!       qwen3moe: x = x + Σ_{e ∈ top-k(softmax(h·Wrouter))} w_e · SwiGLU_e(h),
//!                 the k weights normalised to sum 1
//! logits = rms_norm(x) * output_norm · Woutᵀ            Wout may be tied to the embedding
//! ```

use rustorch_core::backend::{Backend, Device, Glu, Moe};

use super::ops::{self, Step};
use super::{Arch, ForwardOutput, HParams, Loader, ModelError};

struct Layer<D: Device> {
    attn_norm: D::Vector,
    wq: D::Mat,
    wk: D::Mat,
    wv: D::Mat,
    wo: D::Mat,
    bq: Option<D::Vector>,
    bk: Option<D::Vector>,
    bv: Option<D::Vector>,
    q_norm: Option<D::Vector>,
    k_norm: Option<D::Vector>,
    ffn_norm: D::Vector,
    ffn: Ffn<D>,
}

/// The feed-forward of a layer: one SwiGLU, or a router over SwiGLU experts.
enum Ffn<D: Device> {
    Dense {
        gate: D::Mat,
        up: D::Mat,
        down: D::Mat,
    },
    Experts {
        router: D::Mat,
        gate: Vec<D::Mat>,
        up: Vec<D::Mat>,
        down: Vec<D::Mat>,
    },
}

pub(crate) struct Llama<D: Device> {
    tok_embd: D::Mat,
    layers: Vec<Layer<D>>,
    output_norm: D::Vector,
    output: D::Mat,
    rope_freqs: Option<D::Vector>,
}

impl<D: Device> Llama<D> {
    pub fn load(ld: &Loader<'_, D>, hp: &HParams) -> Result<Self, ModelError> {
        let (e, q, kv, ff) = (hp.n_embd, hp.q_dim(), hp.kv_dim(), hp.n_ff);
        let tok_embd = ld.matrix("token_embd.weight", e, hp.n_vocab)?;
        let output = ld.output_or_tied(e, hp.n_vocab)?;
        let biased = hp.arch == Arch::Qwen2;
        let mut layers = Vec::with_capacity(hp.n_layer);
        for i in 0..hp.n_layer {
            let n = |s: &str| format!("blk.{i}.{s}");
            let bias = |s: &str, len| {
                if biased {
                    ld.vector(&n(s), len).map(Some)
                } else {
                    ld.optional_vector(&n(s), len)
                }
            };
            let qk_norm = |s: &str| {
                if matches!(hp.arch, Arch::Qwen3 | Arch::Qwen3Moe) {
                    ld.vector(&n(s), hp.head_dim).map(Some)
                } else {
                    Ok(None)
                }
            };
            layers.push(Layer {
                attn_norm: ld.vector(&n("attn_norm.weight"), e)?,
                wq: ld.matrix(&n("attn_q.weight"), e, q)?,
                wk: ld.matrix(&n("attn_k.weight"), e, kv)?,
                wv: ld.matrix(&n("attn_v.weight"), e, kv)?,
                wo: ld.matrix(&n("attn_output.weight"), q, e)?,
                bq: bias("attn_q.bias", q)?,
                bk: bias("attn_k.bias", kv)?,
                bv: bias("attn_v.bias", kv)?,
                q_norm: qk_norm("attn_q_norm.weight")?,
                k_norm: qk_norm("attn_k_norm.weight")?,
                ffn_norm: ld.vector(&n("ffn_norm.weight"), e)?,
                ffn: if hp.n_expert > 0 {
                    let (ne, fe) = (hp.n_expert, hp.n_ff_exp);
                    Ffn::Experts {
                        router: ld.matrix(&n("ffn_gate_inp.weight"), e, ne)?,
                        gate: ld.matrix_stack(&n("ffn_gate_exps.weight"), e, fe, ne)?,
                        up: ld.matrix_stack(&n("ffn_up_exps.weight"), e, fe, ne)?,
                        down: ld.matrix_stack(&n("ffn_down_exps.weight"), fe, e, ne)?,
                    }
                } else {
                    Ffn::Dense {
                        gate: ld.matrix(&n("ffn_gate.weight"), e, ff)?,
                        up: ld.matrix(&n("ffn_up.weight"), e, ff)?,
                        down: ld.matrix(&n("ffn_down.weight"), ff, e)?,
                    }
                },
            });
        }
        Ok(Llama {
            tok_embd,
            layers,
            output_norm: ld.vector("output_norm.weight", e)?,
            output,
            rope_freqs: ld.optional_vector("rope_freqs.weight", hp.rope.n_rot / 2)?,
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
            self.rope_freqs.as_ref(),
            &mut w.angles,
        );

        // x = embed(tokens)
        be.embed(&self.tok_embd, io.tokens, &mut w.x)?;
        be.hook("embd", 0, &w.x);
        for (il, l) in self.layers.iter().enumerate() {
            // h = rms_norm(x) * attn_norm
            be.rms_norm(&w.x, &l.attn_norm, hp.rms_eps, &mut w.h);
            be.hook("attn_norm", il, &w.h);
            // q, k, v projections (+ bias)
            ops::qkv(
                be,
                w,
                il,
                [&l.wq, &l.wk, &l.wv],
                [l.bq.as_ref(), l.bk.as_ref(), l.bv.as_ref()],
            )?;
            ops::attention(
                be,
                &mut io,
                w,
                ops::Attention {
                    spec: hp.attn_spec(il, 1.0 / (hp.head_dim as f32).sqrt()),
                    rope: &hp.rope,
                    qk_norm: l.q_norm.as_ref().zip(l.k_norm.as_ref()),
                    q_scale: None,
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

            // feed-forward: x = x + (silu(h·Wgate) ⊙ h·Wup)·Wdown
            be.rms_norm(&w.x, &l.ffn_norm, hp.rms_eps, &mut w.h);
            be.hook("ffn_norm", il, &w.h);
            if io.n_rows() > 0 {
                match &l.ffn {
                    Ffn::Dense { gate, up, down } => {
                        ops::ffn_glu(be, Glu::Silu, gate, up, down, w, il)?
                    }
                    Ffn::Experts {
                        router,
                        gate,
                        up,
                        down,
                    } => {
                        let moe = Moe {
                            router,
                            gate,
                            up,
                            down,
                            n_used: hp.n_expert_used,
                            norm: true,
                        };
                        be.moe(&moe, &w.h, &mut w.proj)?;
                        be.hook("ffn_moe_out", il, &w.proj);
                    }
                }
                be.add(&mut w.x, &w.proj);
            }
            be.hook("l_out", il, &w.x);
            io.layer_stats(be, il, &w.x);
        }
        io.logits(be, w, &self.output_norm, &self.output, |_, _| {})
    }
}
