//! `rustorch perplexity`: perplexity over a text file, computed as llama.cpp's
//! `llama-perplexity` does: the text is cut into chunks of `-c` tokens (the first token of
//! each replaced by BOS when the vocabulary adds one) and only the second half of each
//! chunk is scored, so every scored token has at least `c/2` tokens of context.

use std::io::Write;
use std::path::PathBuf;

use anyhow::{bail, Context};
use rustorch_llm::{Batch, Runtime};

use crate::common;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// GGUF model (default: models/SmolLM2-135M-Instruct.Q4_1.gguf)
    #[arg(short = 'm', long = "model")]
    pub model: Option<PathBuf>,
    /// Text file to score
    #[arg(short = 'f', long = "file")]
    pub file: PathBuf,
    /// Tokens per chunk
    #[arg(short = 'c', long = "ctx-size", default_value_t = 512)]
    pub ctx_size: usize,
    /// Score at most this many chunks (-1 = all)
    #[arg(long = "chunks", default_value_t = -1, allow_hyphen_values = true)]
    pub chunks: i64,
    /// Threads (default: physical cores)
    #[arg(short = 't', long = "threads")]
    pub threads: Option<usize>,
    #[command(flatten)]
    pub device: common::DeviceArgs,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let text = std::fs::read_to_string(&args.file)
        .with_context(|| format!("cannot read '{}'", args.file.display()))?;
    let path = common::resolve_model(args.model.as_deref())?;
    let loaded = common::load(&path, Some(&args.device), args.ctx_size)?;
    let (model, tok) = (&loaded.model, &loaded.tokenizer);
    let n_ctx = args.ctx_size;
    if n_ctx < 8 {
        bail!("-c {n_ctx} is too small for perplexity (at least 8)");
    }
    let tokens = tok.encode(&text, true, false)?;
    let mut n_chunks = tokens.len() / n_ctx;
    if args.chunks >= 0 {
        n_chunks = n_chunks.min(args.chunks as usize);
    }
    if n_chunks == 0 {
        bail!(
            "'{}' has {} tokens, fewer than one chunk of {n_ctx} (lower -c)",
            args.file.display(),
            tokens.len()
        );
    }
    eprintln!(
        "perplexity: {} tokens, {n_chunks} chunks of {n_ctx}, scoring the second half of each",
        tokens.len()
    );
    let rt = Runtime::new(common::threads(args.threads));
    let nv = model.hparams().n_vocab;
    let first = n_ctx / 2;
    let (mut nll, mut nll2, mut count) = (0f64, 0f64, 0usize);
    let t0 = std::time::Instant::now();
    let mut out = std::io::stdout().lock();
    for c in 0..n_chunks {
        let mut chunk = tokens[c * n_ctx..(c + 1) * n_ctx].to_vec();
        if tok.add_bos() {
            if let Some(bos) = tok.bos() {
                chunk[0] = bos;
            }
        }
        let mut batch = Batch::new();
        for (i, &t) in chunk.iter().enumerate() {
            batch.push(t, i as u32, 0, i >= first && i + 1 < n_ctx);
        }
        let mut cache = model.new_cache(n_ctx);
        let fwd = model.forward(&batch, &mut cache, &rt)?;
        for i in first..n_ctx - 1 {
            let logits = fwd.logits_for(i, nv).context("missing logits row")?;
            let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
            let lse = max
                + logits
                    .iter()
                    .map(|&l| (l as f64 - max).exp())
                    .sum::<f64>()
                    .ln();
            let lp = logits[chunk[i + 1] as usize] as f64 - lse;
            nll -= lp;
            nll2 += lp * lp;
            count += 1;
        }
        write!(out, "[{}]{:.4},", c + 1, (nll / count as f64).exp())?;
        out.flush()?;
    }
    let mean = nll / count as f64;
    let ppl = mean.exp();
    let var = (nll2 / count as f64 - mean * mean).max(0.0);
    let err = ppl * (var / (count as f64 - 1.0).max(1.0)).sqrt();
    writeln!(out, "\nFinal estimate: PPL = {ppl:.4} +/- {err:.5}")?;
    eprintln!(
        "perplexity: {count} tokens scored in {:.2} s",
        t0.elapsed().as_secs_f64()
    );
    Ok(())
}
