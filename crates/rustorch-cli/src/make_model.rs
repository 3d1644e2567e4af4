//! `rustorch make-model`: a GGUF with random N(0, 0.02) weights in the shape of a known
//! model (llama or qwen2 architecture), reproducible from a seed, with the tokenizer of a
//! vocabulary GGUF: benchmark models a GPU host makes locally instead of copying gigabytes.
//!
//! ```text
//! rustorch make-model --shape tinyllama --type q4_0 --seed 1 \
//!     --vocab models/vocab/ggml-vocab-llama-spm.gguf tinyllama-q4_0.gguf
//! rustorch make-model --shape qwen2.5-1.5b qwen-1.5b-f16.gguf   # then quantize Q4_K_M
//! ```

use std::path::PathBuf;

use anyhow::{bail, Context};
use rayon::prelude::*;
use rustorch_core::gguf::{GgufFile, GgufWriter, Value};
use rustorch_core::quant;
use rustorch_core::GgmlType;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Output GGUF
    pub output: PathBuf,
    /// Shape: tinyllama (22 layers, 2048 wide, 32 heads, 4 KV heads, FFN 5632), tiny
    /// (2 layers, 256 wide, for tests), or Qwen2.5's qwen2.5-0.5b (24 layers, 896 wide, 14
    /// heads, 2 KV heads, FFN 4864) and qwen2.5-1.5b (28, 1536, 12, 2, 8960), qwen2
    /// architecture with Q/K/V biases and its own output matrix (tiny-qwen2: 2 layers, 256
    /// wide, for tests)
    #[arg(long = "shape", default_value = "tinyllama")]
    pub shape: String,
    /// Weight type of the matrices: f16, q8_0, q4_0, q4_k, ... (norms stay f32)
    #[arg(long = "type", default_value = "f16")]
    pub ty: String,
    /// Seed of the weights
    #[arg(long = "seed", default_value_t = 1)]
    pub seed: u64,
    /// Vocabulary GGUF whose tokenizer the model takes (its token count is the model's);
    /// default models/vocab/ggml-vocab-llama-spm.gguf, or ggml-vocab-qwen2.gguf for the
    /// qwen2 shapes
    #[arg(long = "vocab")]
    pub vocab: Option<PathBuf>,
    /// Overwrite the output file if it exists
    #[arg(long = "force")]
    pub force: bool,
}

struct Shape {
    /// GGUF architecture: "llama", or "qwen2" (Q/K/V biases, rope base 1e6, eps 1e-6)
    arch: &'static str,
    n_layer: usize,
    n_embd: usize,
    n_head: usize,
    n_head_kv: usize,
    n_ff: usize,
    n_ctx: usize,
}

fn shape(name: &str) -> anyhow::Result<Shape> {
    Ok(match name {
        "tinyllama" => Shape {
            arch: "llama",
            n_layer: 22,
            n_embd: 2048,
            n_head: 32,
            n_head_kv: 4,
            n_ff: 5632,
            n_ctx: 2048,
        },
        "tiny" => Shape {
            arch: "llama",
            n_layer: 2,
            n_embd: 256,
            n_head: 4,
            n_head_kv: 2,
            n_ff: 512,
            n_ctx: 512,
        },
        "tiny-qwen2" => Shape {
            arch: "qwen2",
            ..shape("tiny")?
        },
        "qwen2.5-0.5b" => Shape {
            arch: "qwen2",
            n_layer: 24,
            n_embd: 896,
            n_head: 14,
            n_head_kv: 2,
            n_ff: 4864,
            n_ctx: 32768,
        },
        "qwen2.5-1.5b" => Shape {
            arch: "qwen2",
            n_layer: 28,
            n_embd: 1536,
            n_head: 12,
            n_head_kv: 2,
            n_ff: 8960,
            n_ctx: 32768,
        },
        other => bail!(
            "unknown shape '{other}' (tinyllama, tiny, tiny-qwen2, qwen2.5-0.5b, qwen2.5-1.5b)"
        ),
    })
}

/// splitmix64: a fixed, documented generator, so a seed gives the same file everywhere.
fn splitmix(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// `n` values of N(0, σ²) (Box–Muller on splitmix64), the stream keyed by `seed` and `key`.
fn normal(seed: u64, key: u64, n: usize, sigma: f64) -> Vec<f32> {
    let mut s = seed ^ key.wrapping_mul(0xd6e8_feb8_6659_fd93);
    let mut out = Vec::with_capacity(n + 1);
    while out.len() < n {
        let u1 = ((splitmix(&mut s) >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
        let u2 = (splitmix(&mut s) >> 11) as f64 / (1u64 << 53) as f64;
        let r = (-2.0 * u1.ln()).sqrt() * sigma;
        let t = std::f64::consts::TAU * u2;
        out.push((r * t.cos()) as f32);
        out.push((r * t.sin()) as f32);
    }
    out.truncate(n);
    out
}

/// One matrix of `rows × cols` random values, encoded as `ty` (rows in parallel).
fn matrix(ty: GgmlType, seed: u64, key: u64, rows: usize, cols: usize) -> anyhow::Result<Vec<u8>> {
    let row_bytes = ty
        .bytes_for(cols as u64)
        .with_context(|| format!("{cols} columns do not fit {ty}"))? as usize;
    let mut out = vec![0u8; rows * row_bytes];
    out.par_chunks_mut(row_bytes)
        .enumerate()
        .try_for_each(|(r, dst)| {
            let v = normal(seed, key.wrapping_mul(1 << 20) + r as u64, cols, 0.02);
            quant::quantize(ty, &v, dst)
        })?;
    Ok(out)
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let sh = shape(&args.shape)?;
    let ty = GgmlType::from_name(&args.ty)
        .filter(|t| quant::supports_quantize(*t))
        .with_context(|| format!("unknown or unsupported weight type '{}'", args.ty))?;
    if args.output.exists() && !args.force {
        bail!(
            "'{}' exists; pass --force to overwrite it",
            args.output.display()
        );
    }
    let qwen = sh.arch == "qwen2";
    let vocab_path = args.vocab.clone().unwrap_or_else(|| {
        PathBuf::from(if qwen {
            "models/vocab/ggml-vocab-qwen2.gguf"
        } else {
            "models/vocab/ggml-vocab-llama-spm.gguf"
        })
    });
    let vocab = GgufFile::open(&vocab_path)
        .with_context(|| format!("reading the vocabulary '{}'", vocab_path.display()))?;
    let n_vocab = vocab
        .get_string_array("tokenizer.ggml.tokens")
        .with_context(|| format!("'{}' has no token list", vocab_path.display()))?
        .len();
    let t0 = std::time::Instant::now();
    let mut w = GgufWriter::new();
    let a = sh.arch;
    w.add("general.architecture", Value::String(a.into()));
    w.add(
        "general.name",
        Value::String(format!(
            "rustorch make-model {} {} seed {}",
            args.shape, args.ty, args.seed
        )),
    );
    let u = |v: usize| Value::U32(v as u32);
    w.add(format!("{a}.context_length"), u(sh.n_ctx));
    w.add(format!("{a}.embedding_length"), u(sh.n_embd));
    w.add(format!("{a}.block_count"), u(sh.n_layer));
    w.add(format!("{a}.feed_forward_length"), u(sh.n_ff));
    w.add(format!("{a}.attention.head_count"), u(sh.n_head));
    w.add(format!("{a}.attention.head_count_kv"), u(sh.n_head_kv));
    w.add(
        format!("{a}.rope.dimension_count"),
        u(sh.n_embd / sh.n_head),
    );
    let (rope_base, eps) = if qwen { (1e6, 1e-6) } else { (10000.0, 1e-5) };
    w.add(format!("{a}.rope.freq_base"), Value::F32(rope_base));
    w.add(
        format!("{a}.attention.layer_norm_rms_epsilon"),
        Value::F32(eps),
    );
    w.add("general.quantization_version", Value::U32(2));
    for (k, v) in vocab.metadata() {
        if k.starts_with("tokenizer.") {
            w.add(k.clone(), v.clone());
        }
    }
    let (e, ff) = (sh.n_embd, sh.n_ff);
    let kv = sh.n_head_kv * (e / sh.n_head);
    let ones = |n: usize| -> Vec<u8> { (0..n).flat_map(|_| 1f32.to_le_bytes()).collect() };
    let dims = |cols: usize, rows: usize| [cols as u64, rows as u64];
    let mut key = 0u64;
    let mut next = || {
        key += 1;
        key
    };
    w.add_tensor(
        "token_embd.weight",
        ty,
        &dims(e, n_vocab),
        matrix(ty, args.seed, next(), n_vocab, e)?,
    )?;
    for l in 0..sh.n_layer {
        let n = |s: &str| format!("blk.{l}.{s}");
        w.add_tensor(n("attn_norm.weight"), GgmlType::F32, &[e as u64], ones(e))?;
        for (name, rows, cols) in [
            ("attn_q.weight", e, e),
            ("attn_k.weight", kv, e),
            ("attn_v.weight", kv, e),
            ("attn_output.weight", e, e),
        ] {
            let data = matrix(ty, args.seed, next(), rows, cols)?;
            w.add_tensor(n(name), ty, &dims(cols, rows), data)?;
        }
        if qwen {
            for (name, len) in [("attn_q.bias", e), ("attn_k.bias", kv), ("attn_v.bias", kv)] {
                let v = normal(args.seed, next() << 20, len, 0.02);
                let data = v.iter().flat_map(|x| x.to_le_bytes()).collect();
                w.add_tensor(n(name), GgmlType::F32, &[len as u64], data)?;
            }
        }
        w.add_tensor(n("ffn_norm.weight"), GgmlType::F32, &[e as u64], ones(e))?;
        for (name, rows, cols) in [
            ("ffn_gate.weight", ff, e),
            ("ffn_up.weight", ff, e),
            ("ffn_down.weight", e, ff),
        ] {
            let data = matrix(ty, args.seed, next(), rows, cols)?;
            w.add_tensor(n(name), ty, &dims(cols, rows), data)?;
        }
    }
    w.add_tensor("output_norm.weight", GgmlType::F32, &[e as u64], ones(e))?;
    w.add_tensor(
        "output.weight",
        ty,
        &dims(e, n_vocab),
        matrix(ty, args.seed, next(), n_vocab, e)?,
    )?;
    let mut file = std::io::BufWriter::new(
        std::fs::File::create(&args.output)
            .with_context(|| format!("cannot create '{}'", args.output.display()))?,
    );
    w.write_to(&mut file)?;
    eprintln!(
        "make-model: {} {} ({} layers, vocab {n_vocab}) in {:.1} s -> {}",
        args.shape,
        ty,
        sh.n_layer,
        t0.elapsed().as_secs_f64(),
        args.output.display()
    );
    Ok(())
}
