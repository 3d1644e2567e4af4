//! Model loading: hyper-parameters from GGUF metadata, weights as views into the
//! memory-mapped file, and the architectures that run them.

mod gemma;
mod gpt_oss;
mod llama;
mod ops;
mod phi3;

use std::sync::{Arc, Mutex};

use rustorch_core::backend::cpu::{Cpu, CpuAngles, CpuDevice};
pub use rustorch_core::backend::cpu::{ProductObserver, TensorHook};
use rustorch_core::backend::{AttnSpec, BackendError, Device, Rows, WeightRef};
use rustorch_core::gguf::{GgufError, GgufFile, TensorInfo};
use rustorch_core::kernels::ops::{Rope, RopeMode, Yarn};
use rustorch_core::kernels::ThreadPool;
use rustorch_core::quant::{self, QuantError};
use rustorch_core::GgmlType;

use ops::{Io, Step, Workspace};
use rustorch_cuda::{Cuda, CudaAngles, CudaDevice, CudaKvStore, CudaState, GpuVec, KeyRope};

use crate::batch::Batch;
use crate::kv_cache::{KvCache, KvCacheError, KvTypeError, KvTypes};

/// Architectures this engine runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arch {
    /// llama, SmolLM2, TinyLlama, Llama-2/3, Mistral
    Llama,
    /// Qwen2 / Qwen2.5: llama with QKV bias and NEOX RoPE
    Qwen2,
    /// Qwen3: llama with per-head Q/K RMSNorm and NEOX RoPE
    Qwen3,
    /// Qwen3-MoE: qwen3 with a mixture-of-experts feed-forward
    Qwen3Moe,
    /// Phi-3: llama with fused QKV and gate/up weights, queries scaled before attention
    Phi3,
    /// Gemma 2: GeGLU, post-norms, soft-capped attention and logits, alternating windows
    Gemma2,
    /// Gemma 3: GeGLU, post-norms, Q/K norm, sliding-window layers with their own RoPE base
    Gemma3,
    /// gpt-oss: biased attention with sinks, YaRN RoPE, alternating windows, biased MoE
    /// with clamped SwiGLU experts
    GptOss,
}

impl Arch {
    /// Every architecture name this engine runs, as GGUF files spell them.
    pub const NAMES: &'static [&'static str] = &[
        "llama", "qwen2", "qwen3", "qwen3moe", "phi3", "gemma2", "gemma3", "gpt-oss",
    ];

    pub fn from_name(name: &str) -> Option<Self> {
        match name {
            "llama" => Some(Arch::Llama),
            "qwen2" => Some(Arch::Qwen2),
            "qwen3" => Some(Arch::Qwen3),
            "qwen3moe" => Some(Arch::Qwen3Moe),
            "phi3" => Some(Arch::Phi3),
            "gemma2" => Some(Arch::Gemma2),
            "gemma3" => Some(Arch::Gemma3),
            "gpt-oss" => Some(Arch::GptOss),
            _ => None,
        }
    }
}

/// Hyper-parameters, all read from GGUF metadata.
#[derive(Debug, Clone)]
pub struct HParams {
    pub arch: Arch,
    pub arch_name: String,
    pub n_vocab: usize,
    pub n_ctx_train: usize,
    pub n_embd: usize,
    pub n_layer: usize,
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim: usize,
    pub n_ff: usize,
    pub rms_eps: f32,
    pub rope: Rope,
    /// Sliding-window size of the windowed layers (0 = no windowed layers).
    pub n_swa: u32,
    /// Per layer: whether it attends over a sliding window (with [`HParams::rope_swa`]).
    pub swa_layers: Vec<bool>,
    /// RoPE of the sliding-window layers.
    pub rope_swa: Rope,
    /// Attention-logit soft-capping (0 = none).
    pub attn_softcap: f32,
    /// Final-logit soft-capping (0 = none).
    pub final_softcap: f32,
    /// Mixture of experts: experts per layer (0 = a dense feed-forward), experts used per
    /// token, and each expert's feed-forward length.
    pub n_expert: usize,
    pub n_expert_used: usize,
    pub n_ff_exp: usize,
    /// Attention sinks: a learned logit per query head in every softmax (gpt-oss).
    pub attn_sinks: bool,
}

impl HParams {
    pub fn kv_dim(&self) -> usize {
        self.n_head_kv * self.head_dim
    }

    /// Bytes one cache cell takes: K and V of every layer, f16.
    pub fn kv_bytes_per_cell(&self) -> usize {
        self.kv_bytes_per_cell_as(KvTypes::default())
    }

    /// Bytes one cache cell takes with keys and values encoded as `types`.
    pub fn kv_bytes_per_cell_as(&self, types: KvTypes) -> usize {
        let row = |t| rustorch_core::kv_cache::row_bytes(t, self.kv_dim());
        self.n_layer * (row(types.k) + row(types.v))
    }

    /// Layer `il`'s attention: scores times `scale`, this architecture's soft-cap, and its
    /// sliding window when the layer slides.
    pub(crate) fn attn_spec(&self, il: usize, scale: f32) -> AttnSpec {
        AttnSpec {
            layer: il,
            n_head: self.n_head,
            n_head_kv: self.n_head_kv,
            head_dim: self.head_dim,
            scale,
            softcap: self.attn_softcap,
            window: self.swa_layers[il].then_some(self.n_swa),
        }
    }
    pub fn q_dim(&self) -> usize {
        self.n_head * self.head_dim
    }

    /// What the CUDA backend lacks to run this model, if anything (such a model runs on
    /// the CPU only).
    pub fn cpu_only(&self) -> Option<&'static str> {
        if self.arch == Arch::GptOss {
            Some("attention sinks, biased MXFP4 experts or YaRN RoPE")
        } else if self.rope.yarn.is_some() {
            Some("YaRN RoPE")
        } else {
            None
        }
    }
}

/// Everything that can go wrong loading or running a model.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error(transparent)]
    Gguf(#[from] GgufError),
    #[error("unsupported architecture '{0}' (supported: {list})", list = Arch::NAMES.join(", "))]
    UnsupportedArch(String),
    #[error("tensor '{name}' is missing")]
    MissingTensor { name: String },
    #[error("tensor '{name}' has shape {found:?}, expected {expected:?}")]
    BadShape {
        name: String,
        expected: Vec<u64>,
        found: Vec<u64>,
    },
    #[error("tensor '{name}' has type {ty}, which this engine cannot compute with")]
    UnsupportedType { name: String, ty: GgmlType },
    #[error("metadata '{key}': {reason}")]
    BadHParam { key: String, reason: String },
    #[error("empty batch: nothing to evaluate")]
    EmptyBatch,
    #[error(
        "token id {token} at batch index {index} is out of range (vocabulary has {n_vocab} tokens)"
    )]
    TokenOutOfRange {
        token: u32,
        index: usize,
        n_vocab: usize,
    },
    #[error("batch fields have different lengths")]
    MalformedBatch,
    #[error(transparent)]
    Cache(#[from] KvCacheError),
    #[error(transparent)]
    CacheType(#[from] KvTypeError),
    #[error(
        "KV cache types K {k}, V {v} are supported on the CPU only; this model runs on \
         {device}, whose cache is f16 (use --device cpu, or -ctk f16 -ctv f16)"
    )]
    CacheTypeOnDevice {
        k: &'static str,
        v: &'static str,
        device: String,
    },
    #[error(
        "{arch} runs on the CPU only for now: the CUDA backend has no {what} (use --device cpu)"
    )]
    CpuOnly { arch: String, what: &'static str },
    #[error(transparent)]
    Quant(#[from] QuantError),
    #[error(transparent)]
    Backend(#[from] BackendError),
    #[error(transparent)]
    Cuda(#[from] rustorch_cuda::CudaError),
    #[error(
        "the model does not fit on {device}: its weights take {need_mib:.1} MiB and the KV cache \
         up to {kv_mib:.1} MiB, but {free_mib:.1} MiB of {total_mib:.1} MiB are free"
    )]
    DoesNotFit {
        device: String,
        need_mib: f64,
        kv_mib: f64,
        free_mib: f64,
        total_mib: f64,
    },
}

/// Where a model's weights live and its forward pass runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Placement {
    Cpu,
    /// GPU `N` through the CUDA backend.
    Cuda(usize),
}

/// Reads weights by name, checking shape and type.
pub(crate) struct Loader<'a, D> {
    pub gguf: &'a GgufFile,
    pub dev: &'a D,
}

impl<D: Device> Loader<'_, D> {
    fn info(&self, name: &str) -> Result<&TensorInfo, ModelError> {
        self.gguf
            .tensor_info(name)
            .ok_or_else(|| ModelError::MissingTensor {
                name: name.to_string(),
            })
    }

    pub fn has(&self, name: &str) -> bool {
        self.gguf.tensor_info(name).is_some()
    }

    fn check_shape(&self, t: &TensorInfo, expected: &[u64]) -> Result<(), ModelError> {
        let mut found = t.dims.clone();
        while found.len() > expected.len() && found.last() == Some(&1) {
            found.pop();
        }
        if found != expected {
            return Err(ModelError::BadShape {
                name: t.name.clone(),
                expected: expected.to_vec(),
                found: t.dims.clone(),
            });
        }
        Ok(())
    }

    /// A 2-D weight of `n_rows` rows by `n_cols` columns (ggml shape `[n_cols, n_rows]`).
    pub fn matrix(&self, name: &str, n_cols: usize, n_rows: usize) -> Result<D::Mat, ModelError> {
        let mut m = self.matrices(name, &[n_cols, n_rows], &[n_rows])?;
        Ok(m.remove(0))
    }

    /// A fused weight of shape `[n_cols, Σ parts]` split into row blocks of `parts` rows
    /// (phi3's `attn_qkv` and gate+up `ffn_up`): each output row is its own dot product, so
    /// the blocks compute exactly what the fused product does.
    pub fn matrix_parts(
        &self,
        name: &str,
        n_cols: usize,
        parts: &[usize],
    ) -> Result<Vec<D::Mat>, ModelError> {
        self.matrices(name, &[n_cols, parts.iter().sum()], parts)
    }

    /// A stack of `n` matrices, ggml shape `[n_cols, n_rows, n]` (MoE experts).
    pub fn matrix_stack(
        &self,
        name: &str,
        n_cols: usize,
        n_rows: usize,
        n: usize,
    ) -> Result<Vec<D::Mat>, ModelError> {
        self.matrices(name, &[n_cols, n_rows, n], &vec![n_rows; n])
    }

    /// The tensor `name` of ggml shape `dims`, cut into consecutive blocks of `parts` rows.
    fn matrices(
        &self,
        name: &str,
        dims: &[usize],
        parts: &[usize],
    ) -> Result<Vec<D::Mat>, ModelError> {
        let t = self.info(name)?;
        let want: Vec<u64> = dims.iter().map(|&d| d as u64).collect();
        self.check_shape(t, &want)?;
        if !quant::supports_dequantize(t.ty) {
            return Err(ModelError::UnsupportedType {
                name: name.to_string(),
                ty: t.ty,
            });
        }
        let n_cols = dims[0];
        let row_bytes = n_cols / t.ty.block_size() * t.ty.type_size();
        let mut start = (self.gguf.data_offset() + t.offset) as usize;
        let mut out = Vec::with_capacity(parts.len());
        for &n_rows in parts {
            let w = WeightRef {
                ty: t.ty,
                start,
                len: n_rows * row_bytes,
                n_rows,
                n_cols,
            };
            start += w.len;
            out.push(self.dev.matrix(self.gguf.bytes(), &w)?);
        }
        Ok(out)
    }

    /// `output.weight`, or the token embedding when the output is tied to it.
    pub fn output_or_tied(&self, n_embd: usize, n_vocab: usize) -> Result<D::Mat, ModelError> {
        if self.has("output.weight") {
            self.matrix("output.weight", n_embd, n_vocab)
        } else {
            self.matrix("token_embd.weight", n_embd, n_vocab)
        }
    }

    /// A 1-D tensor decoded to f32 (norm weights, biases), on the device.
    pub fn vector(&self, name: &str, n: usize) -> Result<D::Vector, ModelError> {
        Ok(self.dev.vector(self.host_vector(name, n)?)?)
    }

    /// A 1-D tensor decoded to f32 on the host.
    pub fn host_vector(&self, name: &str, n: usize) -> Result<Vec<f32>, ModelError> {
        self.host_rows(name, &[n as u64])
    }

    /// A 2-D tensor of `rows` rows of `n` values (ggml shape `[n, rows]`, e.g. a bias per
    /// expert), decoded to f32 as one vector, on the device.
    pub fn vector_rows(&self, name: &str, n: usize, rows: usize) -> Result<D::Vector, ModelError> {
        Ok(self
            .dev
            .vector(self.host_rows(name, &[n as u64, rows as u64])?)?)
    }

    /// The tensor `name` of ggml shape `dims`, decoded to f32 on the host.
    fn host_rows(&self, name: &str, dims: &[u64]) -> Result<Vec<f32>, ModelError> {
        let t = self.info(name)?;
        self.check_shape(t, dims)?;
        let n = dims.iter().product::<u64>() as usize;
        let mut out = vec![0f32; n];
        quant::dequantize(t.ty, self.gguf.tensor_data(t), &mut out).map_err(|_| {
            ModelError::UnsupportedType {
                name: name.to_string(),
                ty: t.ty,
            }
        })?;
        Ok(out)
    }

    pub fn optional_vector(&self, name: &str, n: usize) -> Result<Option<D::Vector>, ModelError> {
        if self.has(name) {
            self.vector(name, n).map(Some)
        } else {
            Ok(None)
        }
    }
}

fn hp_u32(g: &GgufFile, key: &str) -> Result<usize, ModelError> {
    Ok(g.get_u32(key)? as usize)
}

fn hp_opt_u32(g: &GgufFile, key: &str) -> Result<Option<usize>, ModelError> {
    match g.get(key) {
        None => Ok(None),
        Some(_) => hp_u32(g, key).map(Some),
    }
}

impl HParams {
    /// Reads the hyper-parameters of `{arch}.*` keys.
    pub fn from_gguf(g: &GgufFile) -> Result<Self, ModelError> {
        let arch_name = g.architecture()?.to_string();
        let arch = Arch::from_name(&arch_name)
            .ok_or_else(|| ModelError::UnsupportedArch(arch_name.clone()))?;
        let k = |s: &str| format!("{arch_name}.{s}");
        let n_embd = hp_u32(g, &k("embedding_length"))?;
        let n_head = hp_u32(g, &k("attention.head_count"))?;
        let n_head_kv = hp_opt_u32(g, &k("attention.head_count_kv"))?.unwrap_or(n_head);
        if n_head == 0 || n_head_kv == 0 || n_head % n_head_kv != 0 {
            return Err(ModelError::BadHParam {
                key: k("attention.head_count_kv"),
                reason: format!("{n_head} heads cannot be grouped over {n_head_kv} KV heads"),
            });
        }
        let head_dim = hp_opt_u32(g, &k("attention.key_length"))?.unwrap_or(n_embd / n_head);
        let n_rot = hp_opt_u32(g, &k("rope.dimension_count"))?.unwrap_or(head_dim);
        if n_rot > head_dim || n_rot % 2 != 0 {
            return Err(ModelError::BadHParam {
                key: k("rope.dimension_count"),
                reason: format!("{n_rot} rotated dimensions for head size {head_dim}"),
            });
        }
        let freq_base = match g.get(&k("rope.freq_base")) {
            Some(_) => g.get_f32(&k("rope.freq_base"))?,
            None => 10000.0,
        };
        let mut freq_scale = 1.0f32;
        let mut yarn = false;
        if let Ok(kind) = g.get_str(&k("rope.scaling.type")) {
            if kind == "linear" || kind == "yarn" {
                let f = g.get_f32(&k("rope.scaling.factor"))?;
                if f > 0.0 {
                    freq_scale = 1.0 / f;
                }
                yarn = kind == "yarn";
            }
        }
        let n_vocab = match g.get_string_array("tokenizer.ggml.tokens") {
            Ok(t) => t.len(),
            Err(_) => hp_u32(g, &k("vocab_size"))?,
        };
        let mode = match arch {
            Arch::Llama => RopeMode::Normal,
            _ => RopeMode::Neox,
        };
        let n_layer = hp_u32(g, &k("block_count"))?;
        let n_ctx_train = hp_u32(g, &k("context_length"))?;
        let f32_or = |key: &str, default: f32| -> Result<f32, ModelError> {
            match g.get(&k(key)) {
                Some(_) => Ok(g.get_f32(&k(key))?),
                None => Ok(default),
            }
        };
        // YaRN (llama.cpp applies it to any architecture whose file asks for it): the
        // attention factor of the whole model, each layer's ramp from its own base and scale
        let yarn_attn = Yarn::attn_factor(freq_scale, f32_or("rope.scaling.attn_factor", 1.0)?);
        let n_ctx_orig = hp_opt_u32(g, &k("rope.scaling.original_context_length"))?
            .filter(|&n| n > 0)
            .unwrap_or(n_ctx_train) as u32;
        let yarn_for = |base: f32, scale: f32| {
            yarn.then(|| Yarn::new(n_rot, base, scale, n_ctx_orig, yarn_attn))
        };
        let rope = Rope {
            mode,
            n_rot,
            freq_base,
            freq_scale,
            yarn: yarn_for(freq_base, freq_scale),
        };
        // Sliding windows (llama.cpp's standard SWA): a window size and a layer pattern
        // whose every n-th layer attends globally.
        let (n_swa, default_pattern, rope_swa) = match arch {
            Arch::Gemma2 => {
                let base = f32_or("rope.freq_base_swa", freq_base)?;
                (
                    hp_opt_u32(g, &k("attention.sliding_window"))?.unwrap_or(4096),
                    2,
                    Rope {
                        freq_base: base,
                        yarn: yarn_for(base, freq_scale),
                        ..rope
                    },
                )
            }
            Arch::Gemma3 => {
                let base = f32_or("rope.freq_base_swa", 10000.0)?;
                (
                    hp_opt_u32(g, &k("attention.sliding_window"))?.unwrap_or(0),
                    6,
                    Rope {
                        freq_base: base,
                        freq_scale: 1.0,
                        yarn: yarn_for(base, 1.0),
                        ..rope
                    },
                )
            }
            Arch::GptOss => {
                let base = f32_or("rope.freq_base_swa", freq_base)?;
                (
                    hp_u32(g, &k("attention.sliding_window"))?,
                    2,
                    Rope {
                        freq_base: base,
                        yarn: yarn_for(base, freq_scale),
                        ..rope
                    },
                )
            }
            _ => (0, 0, rope),
        };
        let swa_layers = if n_swa == 0 {
            vec![false; n_layer]
        } else {
            swa_pattern(
                g,
                &k("attention.sliding_window_pattern"),
                default_pattern,
                n_layer,
            )?
        };
        let (attn_softcap, final_softcap) = match arch {
            Arch::Gemma2 => (
                f32_or("attn_logit_softcapping", 50.0)?,
                f32_or("final_logit_softcapping", 30.0)?,
            ),
            Arch::Gemma3 => (0.0, f32_or("final_logit_softcapping", 0.0)?),
            _ => (0.0, 0.0),
        };
        let n_ff = match hp_opt_u32(g, &k("feed_forward_length"))? {
            Some(v) => v,
            // gpt-oss has experts only; llama.cpp does not need the key
            None if arch == Arch::GptOss => 0,
            None => hp_u32(g, &k("feed_forward_length"))?,
        };
        let n_expert = hp_opt_u32(g, &k("expert_count"))?.unwrap_or(0);
        let n_expert_used = hp_opt_u32(g, &k("expert_used_count"))?.unwrap_or(0);
        if n_expert > 0 && (n_expert_used == 0 || n_expert_used > n_expert) {
            return Err(ModelError::BadHParam {
                key: k("expert_used_count"),
                reason: format!("{n_expert_used} experts used of {n_expert}"),
            });
        }
        let n_ff_exp = match hp_opt_u32(g, &k("expert_feed_forward_length"))? {
            Some(v) => v,
            None if n_expert_used > 0 => n_ff / n_expert_used,
            None => 0,
        };
        if arch == Arch::GptOss && n_expert == 0 {
            return Err(ModelError::BadHParam {
                key: k("expert_count"),
                reason: "gpt-oss needs experts".into(),
            });
        }
        Ok(HParams {
            arch,
            arch_name: arch_name.clone(),
            n_vocab,
            n_ctx_train,
            n_embd,
            n_layer,
            n_head,
            n_head_kv,
            head_dim,
            n_ff,
            rms_eps: g.get_f32(&k("attention.layer_norm_rms_epsilon"))?,
            rope,
            n_swa: n_swa as u32,
            swa_layers,
            rope_swa,
            attn_softcap,
            final_softcap,
            n_expert,
            n_expert_used,
            n_ff_exp,
            attn_sinks: arch == Arch::GptOss,
        })
    }
}

/// Which layers slide: a per-layer array of booleans, or a period `n` whose last layer in
/// each period is global (`il % n < n - 1` slides; `n = 0`: every layer slides).
fn swa_pattern(
    g: &GgufFile,
    key: &str,
    default: usize,
    n_layer: usize,
) -> Result<Vec<bool>, ModelError> {
    use rustorch_core::gguf::Value;
    let n = match g.get(key) {
        None => default,
        Some(Value::Array(_, items)) => {
            let flags: Option<Vec<bool>> = items
                .iter()
                .map(|v| match v {
                    Value::Bool(b) => Some(*b),
                    _ => None,
                })
                .collect();
            return match flags {
                Some(f) if f.len() == n_layer => Ok(f),
                _ => Err(ModelError::BadHParam {
                    key: key.to_string(),
                    reason: format!("expected {n_layer} booleans"),
                }),
            };
        }
        Some(_) => hp_u32(g, key)?,
    };
    Ok((0..n_layer).map(|il| n == 0 || il % n < n - 1).collect())
}

/// Per-layer statistics of the residual stream for one token (`--dump-layers`).
#[derive(Debug, Clone, PartialEq)]
pub struct LayerStat {
    pub layer: usize,
    pub batch_index: usize,
    pub pos: u32,
    pub rms: f32,
    pub mean: f32,
    pub max_abs: f32,
}

/// A forward call's logits: computed on the host, or read back from the GPU into
/// page-locked memory that the backend hands out instead of copying
/// ([`rustorch_cuda::HostValues`]; llama.cpp likewise returns its output buffer). Reads as
/// a `[f32]`.
#[derive(Debug, Clone)]
pub enum Logits {
    Host(Vec<f32>),
    Device(rustorch_cuda::HostValues),
}

impl Default for Logits {
    fn default() -> Self {
        Logits::Host(Vec::new())
    }
}

impl std::ops::Deref for Logits {
    type Target = [f32];
    fn deref(&self) -> &[f32] {
        match self {
            Logits::Host(v) => v,
            Logits::Device(v) => v,
        }
    }
}

impl From<Vec<f32>> for Logits {
    fn from(v: Vec<f32>) -> Self {
        Logits::Host(v)
    }
}

impl From<Logits> for Vec<f32> {
    fn from(l: Logits) -> Vec<f32> {
        match l {
            Logits::Host(v) => v,
            Logits::Device(v) => v.into(),
        }
    }
}

/// What a forward call returns.
#[derive(Debug, Clone, Default)]
pub struct ForwardOutput {
    /// `n_outputs × n_vocab` logits, in batch order of the tokens that asked for them.
    pub logits: Logits,
    /// Batch index of each row of `logits`.
    pub rows: Vec<usize>,
    /// Filled when the runtime's `dump_layers` is set.
    pub layer_stats: Vec<LayerStat>,
}

impl ForwardOutput {
    /// The logits row for batch index `i`, if it asked for logits.
    pub fn logits_for(&self, i: usize, n_vocab: usize) -> Option<&[f32]> {
        let r = self.rows.iter().position(|&b| b == i)?;
        Some(&self.logits[r * n_vocab..(r + 1) * n_vocab])
    }

    /// The last row of logits.
    pub fn last(&self, n_vocab: usize) -> Option<&[f32]> {
        let n = self.rows.len();
        (n > 0).then(|| &self.logits[(n - 1) * n_vocab..n * n_vocab])
    }
}

/// How forward calls are computed: threads, reference or fast kernels, debug output.
pub struct Runtime {
    pub pool: ThreadPool,
    /// Use the slow scalar f32 path (dequantize + naive matmul) instead of quantized dots.
    pub reference: bool,
    /// Record per-layer residual statistics.
    pub dump_layers: bool,
    /// Called with (llama.cpp's tensor name, layer, values) at each step of the graph,
    /// for comparing intermediate tensors with llama.cpp's `llama-eval-callback`.
    pub tensor_hook: Option<TensorHook>,
    /// Sees every weight product's f32 input (`rustorch imatrix`); CPU only.
    pub product_observer: Option<Arc<dyn ProductObserver>>,
    /// Reproduce a llama.cpp build with (`Some(true)`) or without (`Some(false)`)
    /// AVX512-FP16 in attention's f16 accumulator; `None` follows this CPU (tests compare
    /// with fixtures recorded on either kind of machine).
    pub native_f16: Option<bool>,
    /// A bug planted on purpose, for testing the tools that must find it (`rustorch diff`).
    pub fault: Option<Fault>,
}

/// Bugs [`Runtime::fault`] can plant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// RoPE rotates every token as if it were one position later.
    RopeOffByOne,
}

impl Runtime {
    pub fn new(n_threads: usize) -> Self {
        Runtime {
            pool: ThreadPool::new(n_threads),
            reference: false,
            dump_layers: false,
            tensor_hook: None,
            product_observer: None,
            native_f16: None,
            fault: None,
        }
    }
}

/// An architecture's weights on device `D`.
enum Graph<D: Device> {
    Llama(llama::Llama<D>),
    Gemma(gemma::Gemma<D>),
    Phi3(phi3::Phi3<D>),
    GptOss(gpt_oss::GptOss<D>),
}

impl<D: Device> Graph<D> {
    fn load(ld: &Loader<'_, D>, hp: &HParams) -> Result<Self, ModelError> {
        Ok(match hp.arch {
            Arch::Llama | Arch::Qwen2 | Arch::Qwen3 | Arch::Qwen3Moe => {
                Graph::Llama(llama::Llama::load(ld, hp)?)
            }
            Arch::Phi3 => Graph::Phi3(phi3::Phi3::load(ld, hp)?),
            Arch::Gemma2 | Arch::Gemma3 => Graph::Gemma(gemma::Gemma::load(ld, hp)?),
            Arch::GptOss => Graph::GptOss(gpt_oss::GptOss::load(ld, hp)?),
        })
    }

    fn forward<B: rustorch_core::backend::Backend<Dev = D>>(
        &self,
        st: Step<'_, B>,
    ) -> Result<ForwardOutput, ModelError> {
        match self {
            Graph::Llama(g) => g.forward(st),
            Graph::Gemma(g) => g.forward(st),
            Graph::Phi3(g) => g.forward(st),
            Graph::GptOss(g) => g.forward(st),
        }
    }
}

/// The model on its device, with the activation workspace kept between calls.
enum Placed {
    Cpu(Box<On<CpuDevice, Vec<f32>, CpuAngles>>),
    Cuda(Box<CudaOn>),
}

/// The model on a GPU, and what its forward calls keep between them (scratch buffers,
/// uploaded inputs, captured graphs); one call at a time holds it.
struct CudaOn {
    on: On<CudaDevice, GpuVec<f32>, CudaAngles>,
    state: Mutex<CudaState>,
}

impl std::ops::Deref for CudaOn {
    type Target = On<CudaDevice, GpuVec<f32>, CudaAngles>;
    fn deref(&self) -> &Self::Target {
        &self.on
    }
}

/// A device, the graph's weights on it and the activation workspace.
struct On<D: Device, Buf, Ang> {
    dev: D,
    graph: Graph<D>,
    ws: Mutex<Workspace<Buf, Ang>>,
}

impl<D: Device, Buf: Default, Ang: Default> On<D, Buf, Ang> {
    /// The architecture's weights placed on `dev`.
    fn load(gguf: &GgufFile, hp: &HParams, dev: D) -> Result<Self, ModelError> {
        let graph = Graph::load(&Loader { gguf, dev: &dev }, hp)?;
        Ok(On {
            dev,
            graph,
            ws: Mutex::new(Workspace::default()),
        })
    }

    /// Runs `f` with the activation buffers kept between calls (a concurrent call gets
    /// fresh ones).
    fn with_workspace<R>(&self, f: impl FnOnce(&mut Workspace<Buf, Ang>) -> R) -> R {
        match self.ws.try_lock() {
            Ok(mut g) => f(&mut g),
            Err(_) => f(&mut Workspace::default()),
        }
    }
}

/// A loaded model: hyper-parameters plus weights borrowed from the memory-mapped GGUF.
pub struct Model {
    gguf: Arc<GgufFile>,
    hp: HParams,
    /// RoPE frequency factors on the host (for shifting cached keys).
    rope_freqs: Option<Vec<f32>>,
    placed: Placed,
    /// How [`Model::new_cache`] encodes keys and values.
    cache_types: KvTypes,
}

impl Model {
    /// Builds the model described by `gguf`'s metadata, on the CPU.
    pub fn load(gguf: Arc<GgufFile>) -> Result<Self, ModelError> {
        Self::load_on(gguf, Placement::Cpu, 0)
    }

    /// Builds the model on `placement`; `n_ctx` (the KV cache the caller will make) only
    /// enters the check that the model fits on a GPU.
    pub fn load_on(
        gguf: Arc<GgufFile>,
        placement: Placement,
        n_ctx: usize,
    ) -> Result<Self, ModelError> {
        let hp = HParams::from_gguf(&gguf)?;
        let rope_freqs = Loader {
            gguf: &gguf,
            dev: &CpuDevice::default(),
        }
        .optional_vector("rope_freqs.weight", hp.rope.n_rot / 2)?;
        let placed = match placement {
            Placement::Cpu => Placed::Cpu(Box::new(On::load(&gguf, &hp, CpuDevice::default())?)),
            Placement::Cuda(_) if hp.cpu_only().is_some() => {
                return Err(ModelError::CpuOnly {
                    arch: hp.arch_name.clone(),
                    what: hp.cpu_only().unwrap_or_default(),
                });
            }
            Placement::Cuda(index) => {
                let dev = CudaDevice::open(index)?;
                let (free, total) = dev.mem_info()?;
                let weights = gguf.tensor_bytes();
                let kv = (n_ctx * hp.kv_bytes_per_cell()) as f64;
                let mib = |b: f64| b / (1024.0 * 1024.0);
                // leave room for activations and the kernels' scratch
                if weights as f64 + kv + 256.0 * 1024.0 * 1024.0 > free as f64 {
                    return Err(ModelError::DoesNotFit {
                        device: format!("CUDA{index} ({})", dev.info.name),
                        need_mib: mib(weights as f64),
                        kv_mib: mib(kv),
                        free_mib: mib(free as f64),
                        total_mib: mib(total as f64),
                    });
                }
                Placed::Cuda(Box::new(CudaOn {
                    on: On::load(&gguf, &hp, dev)?,
                    state: Mutex::new(CudaState::default()),
                }))
            }
        };
        Ok(Model {
            hp,
            rope_freqs,
            placed,
            gguf,
            cache_types: KvTypes::default(),
        })
    }

    /// Where the model runs, for start-up messages: `CPU`, or `CUDA0 (NVIDIA H100 80GB
    /// HBM3, 79.2 GiB free of 79.6 GiB)`.
    pub fn device_description(&self) -> String {
        match &self.placed {
            Placed::Cpu(_) => "CPU".to_string(),
            Placed::Cuda(c) => {
                let dev = &c.dev;
                let gib = |b: usize| b as f64 / (1024.0 * 1024.0 * 1024.0);
                match dev.mem_info() {
                    Ok((free, total)) => format!(
                        "CUDA{} ({}, {:.1} GiB free of {:.1} GiB)",
                        dev.info.index,
                        dev.info.name,
                        gib(free),
                        gib(total)
                    ),
                    Err(_) => format!("CUDA{} ({})", dev.info.index, dev.info.name),
                }
            }
        }
    }

    /// The backend name llama-bench prints: `CPU` or `CUDA`.
    pub fn backend_name(&self) -> &'static str {
        match &self.placed {
            Placed::Cpu(_) => "CPU",
            Placed::Cuda(_) => "CUDA",
        }
    }

    /// `f` of the model's GPU state (its lock held) when the model runs on a GPU.
    fn with_cuda_state<T>(&self, f: impl FnOnce(&mut CudaState) -> T) -> Option<T> {
        match &self.placed {
            Placed::Cpu(_) => None,
            Placed::Cuda(c) => Some(f(&mut c.state.lock().unwrap_or_else(|p| p.into_inner()))),
        }
    }

    /// How the GPU's forward calls ran (graph replays, captures, op by op, host times)
    /// when the model runs on one.
    pub fn cuda_graph_stats(&self) -> Option<rustorch_cuda::GraphStats> {
        self.with_cuda_state(|s| s.graph_stats())
    }

    /// On the GPU, with kernels built with `RUSTORCH_CUDA_DEFS=RT_STAMP` (timing only): when
    /// each block since the last call passed its wait, with its grid's and block's sizes
    /// (see `CudaDevice::take_stamps`).
    pub fn cuda_stamps(&self) -> Option<Vec<(u64, u32, u32)>> {
        match &self.placed {
            Placed::Cuda(c) => c.dev.take_stamps(),
            Placed::Cpu(_) => None,
        }
    }

    /// On the GPU with `RUSTORCH_CUDA_MEGA=1`: whether decode steps may run as one
    /// persistent kernel or replay CUDA graphs; nothing otherwise.
    pub fn set_cuda_megakernel(&self, on: bool) {
        self.with_cuda_state(|s| s.set_mega(on));
    }

    /// On the GPU: whether a decode step may launch the last step's CUDA graph before its
    /// dry run confirms it (on by default unless `RUSTORCH_CUDA_EARLY=0`); nothing
    /// otherwise.
    pub fn set_cuda_early_launch(&self, on: bool) {
        self.with_cuda_state(|s| s.set_early(on));
    }

    /// On the GPU: whether to compute as the CPU backend does, bit for bit, where the
    /// formats allow (`rustorch_cuda::CudaDevice::set_exact`: logits identical to the CPU's
    /// for the legacy formats, Q4_K and Q6_K; slower); off by default unless
    /// `RUSTORCH_CUDA_EXACT=1`. Nothing on the CPU.
    pub fn set_cuda_exact(&self, on: bool) {
        if let Placed::Cuda(c) = &self.placed {
            c.dev.set_exact(on);
        }
    }

    /// The GPU's name when the model runs on one.
    pub fn gpu_name(&self) -> Option<String> {
        match &self.placed {
            Placed::Cpu(_) => None,
            Placed::Cuda(c) => Some(c.dev.info.name.clone()),
        }
    }

    pub fn hparams(&self) -> &HParams {
        &self.hp
    }

    pub fn gguf(&self) -> &Arc<GgufFile> {
        &self.gguf
    }

    /// Rotates a row of cached keys (all KV heads) by `delta` positions: RoPE angles are
    /// linear in the position, so this moves keys written at `p` to `p + delta`.
    pub fn rotate_keys(&self, row: &mut [f32], delta: i64) {
        let hp = &self.hp;
        let half = hp.rope.n_rot / 2;
        let mut cos = vec![0f32; half];
        let mut sin = vec![0f32; half];
        hp.rope
            .angles(delta as f32, self.rope_freqs.as_deref(), &mut cos, &mut sin);
        for head in row.chunks_exact_mut(hp.head_dim) {
            hp.rope.apply(head, &cos, &sin);
        }
    }

    /// Makes [`Model::new_cache`] encode keys and values as `types` (llama.cpp's
    /// `--cache-type-k/-v`; f16 by default). Other types than f16 are for the CPU: on a GPU
    /// they are refused. Also refused: a block type whose block does not divide the head
    /// size.
    pub fn set_cache_types(&mut self, types: KvTypes) -> Result<(), ModelError> {
        types.check(self.hp.head_dim)?;
        if !types.is_f16() && !matches!(self.placed, Placed::Cpu(_)) {
            return Err(ModelError::CacheTypeOnDevice {
                k: types.k.name(),
                v: types.v.name(),
                device: self.device_description(),
            });
        }
        self.cache_types = types;
        Ok(())
    }

    /// How [`Model::new_cache`] encodes keys and values.
    pub fn cache_types(&self) -> KvTypes {
        self.cache_types
    }

    /// A KV cache for this model holding `n_ctx` tokens in total, its rows where the model
    /// runs (host memory, or one pool in the GPU's memory; a pool that cannot be allocated
    /// makes the first forward call fail with the reason), encoded as
    /// [`Model::cache_types`].
    pub fn new_cache(&self, n_ctx: usize) -> KvCache {
        let (n_layer, kv_dim) = (self.hp.n_layer, self.hp.kv_dim());
        match &self.placed {
            Placed::Cpu(_) => {
                KvCache::with_types(n_layer, kv_dim, self.hp.head_dim, n_ctx, self.cache_types)
                    // checked by set_cache_types
                    .unwrap_or_else(|_| KvCache::new(n_layer, kv_dim, n_ctx))
            }
            Placed::Cuda(c) => {
                let rope = KeyRope {
                    rope: self.hp.rope,
                    head_dim: self.hp.head_dim,
                    freqs: self.rope_freqs.clone(),
                };
                let store = CudaKvStore::new(&c.dev, n_layer, kv_dim, n_ctx, rope.clone())
                    .unwrap_or_else(|e| CudaKvStore::failed(&c.dev, n_layer, kv_dim, rope, e));
                KvCache::with_store(n_layer, kv_dim, n_ctx, Box::new(store))
            }
        }
    }

    /// Evaluates `batch`, writing its keys/values into `cache`, and returns logits for the
    /// tokens that asked for them.
    pub fn forward(
        &self,
        batch: &Batch,
        cache: &mut KvCache,
        rt: &Runtime,
    ) -> Result<ForwardOutput, ModelError> {
        let n = batch.len();
        if n == 0 {
            return Err(ModelError::EmptyBatch);
        }
        if batch.positions.len() != n || batch.seq_ids.len() != n || batch.logits.len() != n {
            return Err(ModelError::MalformedBatch);
        }
        if let Some((index, &token)) = batch
            .tokens
            .iter()
            .enumerate()
            .find(|(_, &t)| t as usize >= self.hp.n_vocab)
        {
            return Err(ModelError::TokenOutOfRange {
                token,
                index,
                n_vocab: self.hp.n_vocab,
            });
        }
        tracing::debug!(
            n_tokens = n,
            positions = ?batch.positions,
            seq_ids = ?batch.seq_ids,
            "forward"
        );
        // Reserve one cache cell per token, at the position the caller gave.
        cache.check_room(n)?;
        let cells: Vec<usize> = (0..n)
            .map(|i| cache.add_cell(batch.seq_ids[i], batch.positions[i]))
            .collect();
        let shifted: Vec<u32>;
        let rope_pos = match rt.fault {
            Some(Fault::RopeOffByOne) => {
                shifted = batch.positions.iter().map(|&p| p + 1).collect();
                &shifted[..]
            }
            None => &batch.positions[..],
        };
        let io = Io {
            hp: &self.hp,
            tokens: &batch.tokens,
            rope_pos,
            rows: Rows {
                positions: &batch.positions,
                seq_ids: &batch.seq_ids,
            },
            cache,
            cells: &cells,
            out_rows: (0..n).filter(|&i| batch.logits[i]).collect(),
            kept: false,
            dump_layers: rt.dump_layers,
            stats: Vec::new(),
        };
        match &self.placed {
            Placed::Cpu(c) => {
                let mut be = Cpu::new(
                    &c.dev,
                    self.gguf.bytes(),
                    &rt.pool,
                    rt.reference,
                    rt.tensor_hook.as_ref(),
                );
                if let Some(native) = rt.native_f16 {
                    be = be.with_native_f16(native);
                }
                if let Some(o) = rt.product_observer.as_deref() {
                    be = be.with_observer(o);
                }
                c.with_workspace(|w| c.graph.forward(Step { be: &mut be, w, io }))
            }
            Placed::Cuda(_) if rt.product_observer.is_some() => {
                Err(BackendError::Device("product observers run on the CPU only".into()).into())
            }
            Placed::Cuda(c) => {
                // one call at a time on the GPU (its stream may be capturing a graph)
                let mut state = c.state.lock().unwrap_or_else(|p| p.into_inner());
                let mut be = Cuda::with_state(&c.dev, &mut state, rt.tensor_hook.as_ref());
                be.prepare(io.tokens, io.rows, io.cells, &io.out_rows, io.cache)?;
                // decode steps may be replayed as CUDA graphs (the call may run twice)
                let graphable = n <= 8 && !rt.dump_layers && rt.tensor_hook.is_none();
                let Io {
                    hp,
                    tokens,
                    rope_pos,
                    rows,
                    cache,
                    cells,
                    out_rows,
                    dump_layers,
                    ..
                } = io;
                let (mut out, logits) = c.with_workspace(|w| {
                    be.run(graphable, |be| {
                        let io = Io {
                            hp,
                            tokens,
                            rope_pos,
                            rows,
                            cache: &mut *cache,
                            cells,
                            out_rows: out_rows.clone(),
                            kept: false,
                            dump_layers,
                            stats: Vec::new(),
                        };
                        c.graph.forward(Step { be, w: &mut *w, io })
                    })
                })?;
                if let Some(l) = logits {
                    out.logits = Logits::Device(l);
                }
                Ok(out)
            }
        }
    }
}
