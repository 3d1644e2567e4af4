//! gpt-oss (OpenAI's open-weight mixture of experts), read top to bottom:
//!
//! ```text
//! x = embed(tokens)
//! for each layer:                                  even layers slide over a window, odd ones see everything
//!     h = rms_norm(x) * attn_norm
//!     q, k, v = h·Wq + bq, h·Wk + bk, h·Wv + bv
//!     q, k = rope(q, pos), rope(k, pos)            NEOX with YaRN: scaled and mixed angles, cos and sin × mscale
//!     cache[seq][pos] = k, v
//!     a = softmax(q·Kᵀ / √d ∪ sink_head) · V       a learned logit per head joins the softmax with no value
//!     x = x + a·Wo + bo
//!     h = rms_norm(x) * post_attention_norm
//!     ℓ = h·Wrouter + brouter                      one logit per expert
//!     x = x + Σ_{e ∈ top-k(ℓ)} softmax_k(ℓ)_e · ((swiglu_oai(h·Wgate_e + bgate_e, h·Wup_e + bup_e))·Wdown_e + bdown_e)
//!         swiglu_oai(g, u) = min(g, 7)·σ(1.702·min(g, 7)) · (clamp(u, ±7) + 1)
//! logits = rms_norm(x) * output_norm · Woutᵀ       the last layer keeps every row; the output rows are picked after it
//! ```
//!
//! As llama.cpp's `openai-moe` graph: the expert matrices are MXFP4, multiplied one routed
//! row at a time, and the softmax weights cover only the chosen experts' logits
//! (`SOFTMAX_WEIGHT` gating, no renormalisation).

use rustorch_core::backend::{Backend, BiasedMoe, Device};

use super::ops::{self, Step};
use super::{ForwardOutput, HParams, Loader, ModelError};

/// llama.cpp's constants of the clamped SwiGLU (`LLM_FFN_SWIGLU_OAI_MOE`).
const SWIGLU_ALPHA: f32 = 1.702;
const SWIGLU_LIMIT: f32 = 7.0;

struct Layer<D: Device> {
    attn_norm: D::Vector,
    wq: D::Mat,
    bq: Option<D::Vector>,
    wk: D::Mat,
    bk: Option<D::Vector>,
    wv: D::Mat,
    bv: Option<D::Vector>,
    wo: D::Mat,
    bo: D::Vector,
    sinks: D::Vector,
    post_attn_norm: D::Vector,
    router: D::Mat,
    router_bias: D::Vector,
    gate: Vec<D::Mat>,
    gate_bias: D::Vector,
    up: Vec<D::Mat>,
    up_bias: D::Vector,
    down: Vec<D::Mat>,
    down_bias: D::Vector,
}

pub(crate) struct GptOss<D: Device> {
    tok_embd: D::Mat,
    layers: Vec<Layer<D>>,
    output_norm: D::Vector,
    output: D::Mat,
}

impl<D: Device> GptOss<D> {
    pub fn load(ld: &Loader<'_, D>, hp: &HParams) -> Result<Self, ModelError> {
        let (e, q, kv) = (hp.n_embd, hp.q_dim(), hp.kv_dim());
        let (ne, fe) = (hp.n_expert, hp.n_ff_exp);
        let mut layers = Vec::with_capacity(hp.n_layer);
        for i in 0..hp.n_layer {
            let n = |s: &str| format!("blk.{i}.{s}");
            layers.push(Layer {
                attn_norm: ld.vector(&n("attn_norm.weight"), e)?,
                wq: ld.matrix(&n("attn_q.weight"), e, q)?,
                bq: ld.optional_vector(&n("attn_q.bias"), q)?,
                wk: ld.matrix(&n("attn_k.weight"), e, kv)?,
                bk: ld.optional_vector(&n("attn_k.bias"), kv)?,
                wv: ld.matrix(&n("attn_v.weight"), e, kv)?,
                bv: ld.optional_vector(&n("attn_v.bias"), kv)?,
                wo: ld.matrix(&n("attn_output.weight"), q, e)?,
                bo: ld.vector(&n("attn_output.bias"), e)?,
                sinks: ld.vector(&n("attn_sinks.weight"), hp.n_head)?,
                post_attn_norm: ld.vector(&n("post_attention_norm.weight"), e)?,
                router: ld.matrix(&n("ffn_gate_inp.weight"), e, ne)?,
                router_bias: ld.vector(&n("ffn_gate_inp.bias"), ne)?,
                gate: ld.matrix_stack(&n("ffn_gate_exps.weight"), e, fe, ne)?,
                gate_bias: ld.vector_rows(&n("ffn_gate_exps.bias"), fe, ne)?,
                up: ld.matrix_stack(&n("ffn_up_exps.weight"), e, fe, ne)?,
                up_bias: ld.vector_rows(&n("ffn_up_exps.bias"), fe, ne)?,
                down: ld.matrix_stack(&n("ffn_down_exps.weight"), fe, e, ne)?,
                down_bias: ld.vector_rows(&n("ffn_down_exps.bias"), e, ne)?,
            });
        }
        Ok(GptOss {
            tok_embd: ld.matrix("token_embd.weight", e, hp.n_vocab)?,
            layers,
            output_norm: ld.vector("output_norm.weight", e)?,
            output: ld.matrix("output.weight", e, hp.n_vocab)?,
        })
    }

    /// One forward step of the batch in `st`.
    pub fn forward<B: Backend<Dev = D>>(
        &self,
        st: Step<'_, B>,
    ) -> Result<ForwardOutput, ModelError> {
        let Step { be, w, mut io } = st;
        let hp = io.hp;
        be.rope_angles(&hp.rope, io.rope_pos, None, &mut w.angles);
        be.rope_angles(&hp.rope_swa, io.rope_pos, None, &mut w.angles_swa);

        // x = embed(tokens)
        be.embed(&self.tok_embd, io.tokens, &mut w.x)?;
        be.hook("embd", 0, &w.x);
        for (il, l) in self.layers.iter().enumerate() {
            // h = rms_norm(x) * attn_norm
            be.rms_norm(&w.x, &l.attn_norm, hp.rms_eps, &mut w.h);
            be.hook("attn_norm", il, &w.h);
            // q, k, v projections + biases
            ops::qkv(
                be,
                w,
                il,
                [&l.wq, &l.wk, &l.wv],
                [l.bq.as_ref(), l.bk.as_ref(), l.bv.as_ref()],
            )?;
            // YaRN rotation, attention with the layer's window and sinks, a·Wo + bo
            ops::attention(
                be,
                &mut io,
                w,
                ops::Attention {
                    spec: hp.attn_spec(il, 1.0 / (hp.head_dim as f32).sqrt()),
                    rope: if hp.swa_layers[il] {
                        &hp.rope_swa
                    } else {
                        &hp.rope
                    },
                    qk_norm: None,
                    q_scale: None,
                    sinks: Some(&l.sinks),
                    wo: &l.wo,
                    wo_bias: Some(&l.bo),
                },
            )?;
            // llama.cpp picks the output rows after the last layer, not inside it
            be.add(&mut w.x, &w.proj);
            be.hook("ffn_inp", il, &w.x);

            // x = x + MoE(rms_norm(x) * post_attention_norm)
            be.rms_norm(&w.x, &l.post_attn_norm, hp.rms_eps, &mut w.h);
            be.hook("attn_post_norm", il, &w.h);
            let moe = BiasedMoe {
                router: &l.router,
                router_bias: &l.router_bias,
                gate: &l.gate,
                gate_bias: &l.gate_bias,
                up: &l.up,
                up_bias: &l.up_bias,
                down: &l.down,
                down_bias: &l.down_bias,
                n_used: hp.n_expert_used,
                alpha: SWIGLU_ALPHA,
                limit: SWIGLU_LIMIT,
            };
            be.moe_biased(&moe, &w.h, &mut w.proj)?;
            be.hook("ffn_moe_out", il, &w.proj);
            be.add(&mut w.x, &w.proj);
            be.hook("l_out", il, &w.x);
            io.layer_stats(be, il, &w.x);
        }
        io.logits(be, w, &self.output_norm, &self.output, |_, _| {})
    }
}
