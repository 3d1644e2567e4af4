//! The backend seam: the operations a transformer step is built from, implemented once
//! per device.
//!
//! An architecture file (in `rustorch-llm`) is written once against [`Backend`]: it holds its
//! weights as the device's [`Device::Mat`] / [`Device::Vector`], its activations as
//! [`Backend::Buf`], and calls the ops below in the order of its paper. The CPU backend
//! ([`cpu::Cpu`]) runs llama.cpp's CPU arithmetic bit for bit; a GPU backend implements the
//! same ops with device memory. Activations are row-major matrices of `f32`: one row per
//! token, the row width implied by the op (a weight's column count, a norm's length, a head
//! size).
//!
//! Two halves: a [`Device`] owns what lives as long as the model (uploaded weights); a
//! [`Backend`] is the per-call context that runs ops on that device (thread pool, streams,
//! scratch buffers, debugging hooks).

pub mod cpu;

use std::borrow::Cow;

use crate::kernels::ops::Rope;
use crate::kv_cache::{KvCache, SeqId};
use crate::quant::QuantError;
use crate::GgmlType;

/// Where a weight matrix lies in the GGUF file and its shape: `n_rows` rows of `n_cols`
/// values each (ggml shape `[n_cols, n_rows]`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WeightRef {
    pub ty: GgmlType,
    /// Byte offset of the first row in the mapped file.
    pub start: usize,
    /// Bytes of the matrix.
    pub len: usize,
    pub n_rows: usize,
    pub n_cols: usize,
}

/// What an op can fail with.
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    #[error(transparent)]
    Quant(#[from] QuantError),
    #[error("{0}")]
    Device(String),
}

/// The activation of a gated feed-forward: `act(gate) ⊙ up`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Glu {
    /// SwiGLU: `silu(gate) ⊙ up` (llama, qwen, phi3).
    Silu,
    /// GeGLU: `gelu(gate) ⊙ up` with ggml's tanh-approximated GELU (gemma).
    Gelu,
}

/// The tokens of a batch as attention sees them: each row's position and sequence.
#[derive(Debug, Clone, Copy)]
pub struct Rows<'a> {
    pub positions: &'a [u32],
    pub seq_ids: &'a [SeqId],
}

/// One layer's attention: shapes, score scale and masking.
#[derive(Debug, Clone, Copy)]
pub struct AttnSpec {
    pub layer: usize,
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim: usize,
    /// Multiplies `q·k` (usually `1/√head_dim`).
    pub scale: f32,
    /// Attention-logit soft-capping: scores become `cap · tanh(score / cap)` (0 = none).
    pub softcap: f32,
    /// Sliding window: a query at position `p` sees cells at positions `p - window < pos ≤ p`
    /// (llama.cpp's standard SWA mask). `None` = the whole causal past.
    pub window: Option<u32>,
}

/// A mixture-of-experts feed-forward: a softmax router picks `n_used` experts per token,
/// their weights normalised to sum 1 (when `norm`), and each expert is a SwiGLU FFN.
pub struct Moe<'a, M> {
    /// `n_expert` rows: one router logit per expert.
    pub router: &'a M,
    pub gate: &'a [M],
    pub up: &'a [M],
    pub down: &'a [M],
    pub n_used: usize,
    pub norm: bool,
}

/// gpt-oss's mixture of experts (llama.cpp's `build_moe_ffn` with biases,
/// `SOFTMAX_WEIGHT` gating and `swiglu_oai`): router logits `x·router + router_bias`, the
/// `n_used` experts with the largest logits, their weights the softmax of those logits, and
/// each expert `(swiglu_oai(x·gate_e + gate_bias_e, x·up_e + up_bias_e))·down_e +
/// down_bias_e` with `swiglu_oai(g, u) = min(g, limit)·σ(alpha·min(g, limit))·(clamp(u,
/// ±limit) + 1)`. The expert biases hold one row per expert, back to back.
pub struct BiasedMoe<'a, M, V> {
    /// `n_expert` rows: one router logit per expert.
    pub router: &'a M,
    pub router_bias: &'a V,
    pub gate: &'a [M],
    pub gate_bias: &'a V,
    pub up: &'a [M],
    pub up_bias: &'a V,
    pub down: &'a [M],
    pub down_bias: &'a V,
    pub n_used: usize,
    pub alpha: f32,
    pub limit: f32,
}

/// The long-lived half of a backend: turns GGUF weights into the device's representation.
pub trait Device: Send + Sync {
    /// A weight matrix in its GGUF format.
    type Mat: Send + Sync;
    /// A vector of `f32` (norm weights, biases, RoPE frequency factors).
    type Vector: Send + Sync;

    fn matrix(&self, bytes: &[u8], w: &WeightRef) -> Result<Self::Mat, BackendError>;
    fn vector(&self, v: Vec<f32>) -> Result<Self::Vector, BackendError>;
}

/// The ops of a transformer step. Outputs are resized by the op; inputs are read whole.
pub trait Backend {
    type Dev: Device;
    /// An activation matrix on the device.
    type Buf: Default + Send;
    /// RoPE angles for a batch's positions.
    type Angles: Default + Send;

    /// `out[i] = table[tokens[i]]` (dequantized embedding rows).
    fn embed(
        &mut self,
        table: &<Self::Dev as Device>::Mat,
        tokens: &[u32],
        out: &mut Self::Buf,
    ) -> Result<(), BackendError>;

    /// `out = rms_norm(x) * w` per row of `w.len()` values.
    fn rms_norm(
        &mut self,
        x: &Self::Buf,
        w: &<Self::Dev as Device>::Vector,
        eps: f32,
        out: &mut Self::Buf,
    );

    /// `x = rms_norm(x) * w` in place, per row of `w.len()` values (e.g. each head).
    fn rms_norm_inplace(&mut self, x: &mut Self::Buf, w: &<Self::Dev as Device>::Vector, eps: f32);

    /// `out[t] = W · x[t]` for every activation row.
    fn matmul(
        &mut self,
        w: &<Self::Dev as Device>::Mat,
        x: &Self::Buf,
        out: &mut Self::Buf,
    ) -> Result<(), BackendError>;

    /// Several products of one input (Q/K/V); equal to separate [`Backend::matmul`] calls.
    fn matmul_many(
        &mut self,
        ws: &[&<Self::Dev as Device>::Mat],
        x: &Self::Buf,
        outs: &mut [&mut Self::Buf],
    ) -> Result<(), BackendError>;

    /// The gated feed-forward input: `gate = act(x·Wg) ⊙ (x·Wu)`; `up` is scratch.
    fn glu(
        &mut self,
        act: Glu,
        wg: &<Self::Dev as Device>::Mat,
        wu: &<Self::Dev as Device>::Mat,
        x: &Self::Buf,
        gate: &mut Self::Buf,
        up: &mut Self::Buf,
    ) -> Result<(), BackendError>;

    /// `out[t] = Σ_slot w[t][slot] · down_e((silu(x[t]·gate_e) ⊙ x[t]·up_e))` over the experts
    /// the router picks for row `t`, summed in the router's order (llama.cpp's
    /// `build_moe_ffn` with softmax gating).
    fn moe(
        &mut self,
        moe: &Moe<'_, <Self::Dev as Device>::Mat>,
        x: &Self::Buf,
        out: &mut Self::Buf,
    ) -> Result<(), BackendError>;

    /// gpt-oss's biased mixture of experts (see [`BiasedMoe`]), the experts summed in the
    /// router's order. Backends without it answer with an error.
    fn moe_biased(
        &mut self,
        moe: &BiasedMoe<'_, <Self::Dev as Device>::Mat, <Self::Dev as Device>::Vector>,
        x: &Self::Buf,
        out: &mut Self::Buf,
    ) -> Result<(), BackendError> {
        let _ = (moe, x, out);
        Err(BackendError::Device(
            "this backend has no biased mixture of experts (gpt-oss)".into(),
        ))
    }

    /// `x = x + y`.
    fn add(&mut self, x: &mut Self::Buf, y: &Self::Buf);

    /// `x[row] += b` for every row of `b.len()` values.
    fn add_bias(&mut self, x: &mut Self::Buf, b: &<Self::Dev as Device>::Vector);

    /// `x = x * s`.
    fn scale(&mut self, x: &mut Self::Buf, s: f32);

    /// Soft-capping, `x = tanh(x / cap) · cap` (gemma2's final logits).
    fn softcap(&mut self, x: &mut Self::Buf, cap: f32);

    /// The angles of `rope` for each position (`freqs`: per-pair frequency divisors).
    fn rope_angles(
        &mut self,
        rope: &Rope,
        positions: &[u32],
        freqs: Option<&<Self::Dev as Device>::Vector>,
        out: &mut Self::Angles,
    );

    /// Rotates every head (`head_dim` values) of every row by its row's angles.
    fn rope(&mut self, x: &mut Self::Buf, rope: &Rope, head_dim: usize, angles: &Self::Angles);

    /// Stores each row's `k`/`v` in `cache` at `cells[row]` for `spec.layer`, then
    /// `out = softmax(q·Kᵀ·scale, masked) · V` over the cells of the row's sequence.
    #[allow(clippy::too_many_arguments)]
    fn attention(
        &mut self,
        spec: &AttnSpec,
        rows: Rows<'_>,
        q: &Self::Buf,
        k: &Self::Buf,
        v: &Self::Buf,
        cache: &mut KvCache,
        cells: &[usize],
        out: &mut Self::Buf,
    );

    /// [`Backend::attention`] with attention sinks (gpt-oss): `sinks` holds a logit per query
    /// head that joins that head's softmax without a value, so the weights of the cells sum
    /// to less than 1. Backends without it answer with an error.
    #[allow(clippy::too_many_arguments)]
    fn attention_sinks(
        &mut self,
        spec: &AttnSpec,
        rows: Rows<'_>,
        q: &Self::Buf,
        k: &Self::Buf,
        v: &Self::Buf,
        cache: &mut KvCache,
        cells: &[usize],
        sinks: &<Self::Dev as Device>::Vector,
        out: &mut Self::Buf,
    ) -> Result<(), BackendError> {
        let _ = (spec, rows, q, k, v, cache, cells, sinks, out);
        Err(BackendError::Device(
            "this backend has no attention sinks (gpt-oss)".into(),
        ))
    }

    /// Keeps rows `rows` (rows of `width` values), in that order, dropping the others.
    fn keep_rows(&mut self, x: &mut Self::Buf, width: usize, rows: &[usize]);

    /// The values of `x` on the host.
    fn read<'b>(&mut self, x: &'b Self::Buf) -> Cow<'b, [f32]>;

    /// Called with llama.cpp's name of each intermediate tensor; a backend with a debugging
    /// hook installed reads `x` and hands it over.
    fn hook(&mut self, name: &str, layer: usize, x: &Self::Buf);
}
