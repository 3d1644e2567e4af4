//! `rustorch perplexity`: perplexity over a text file, computed as llama.cpp's
//! `llama-perplexity` does: the text is cut into chunks of `-c` tokens (the first token of
//! each replaced by BOS when the vocabulary adds one) and only the second half of each
//! chunk is scored, so every scored token has at least `c/2` tokens of context.
//!
//! KL-divergence against a base model, as `llama-perplexity` does it and in its file
//! format, so either tool reads the other's base file:
//! - `--kl-divergence-base FILE` (without `--kl-divergence`) saves the base model's
//!   log-probabilities while computing perplexity: `_logits_`, `n_ctx` (i32), `n_vocab`
//!   (i32), `n_chunk` (i32), the `n_chunk·n_ctx` evaluated tokens (i32), then for every
//!   scored position (`n_ctx - 1 - n_ctx/2` a chunk) a row of `nv = 2·⌈n_vocab/2⌉ + 4`
//!   u16: the scale and the minimum log-probability as two f32, then each token's
//!   log-probability quantized to 16 bits over `[max - 16, max]` (llama.cpp's
//!   `log_softmax(..., uint16_t * log_prob, ...)`); all little-endian.
//! - `--kl-divergence --kl-divergence-base FILE` runs the model over the file's tokens and
//!   compares with the saved base: PPL(Q) and PPL(base), their correlation and ratio, the
//!   mean KL-divergence with its uncertainty, its percentiles, top-token agreement and the
//!   statistics of Δp (the change in the probability of the right token), with the
//!   float/double arithmetic of llama.cpp's `kl_divergence()` line by line.

use std::fs::File;
use std::io::{BufReader, BufWriter, Read, Write};
use std::path::{Path, PathBuf};

use anyhow::{bail, ensure, Context};
use rustorch_llm::{Batch, Model, Runtime};

use crate::common;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// GGUF model (default: models/SmolLM2-135M-Instruct.Q4_1.gguf)
    #[arg(short = 'm', long = "model")]
    pub model: Option<PathBuf>,
    /// Text file to score (not used with --kl-divergence: the base file holds the tokens)
    #[arg(short = 'f', long = "file", required_unless_present = "kl_divergence")]
    pub file: Option<PathBuf>,
    /// Tokens per chunk (with --kl-divergence the base file's is used)
    #[arg(short = 'c', long = "ctx-size", default_value_t = 512)]
    pub ctx_size: usize,
    /// Score at most this many chunks (-1 = all)
    #[arg(long = "chunks", default_value_t = -1, allow_hyphen_values = true)]
    pub chunks: i64,
    /// Threads (default: physical cores)
    #[arg(short = 't', long = "threads")]
    pub threads: Option<usize>,
    /// Evaluate each chunk in forward passes of at most this many tokens (llama.cpp's
    /// n_ubatch, also 512 by default; llama.cpp's CPU attention changes algorithm from 64
    /// query rows on, so `--ubatch-size 32` on both sides compares bit for bit)
    #[arg(long = "ubatch-size", default_value_t = 512)]
    pub ubatch_size: usize,
    /// Base model's log-probabilities, in llama-perplexity's format: written here while
    /// computing perplexity, or read with --kl-divergence
    #[arg(long = "kl-divergence-base", value_name = "FILE")]
    pub kl_divergence_base: Option<PathBuf>,
    /// Compare this model with the base file of --kl-divergence-base (KL-divergence,
    /// top-token agreement, Δp, PPL ratio)
    #[arg(long = "kl-divergence", requires = "kl_divergence_base")]
    pub kl_divergence: bool,
    #[command(flatten)]
    pub device: common::DeviceArgs,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    if args.kl_divergence {
        return kl_divergence(&args);
    }
    let file = args.file.as_deref().context("-f FILE is required")?;
    let text = std::fs::read_to_string(file)
        .with_context(|| format!("cannot read '{}'", file.display()))?;
    let path = common::resolve_model(args.model.as_deref())?;
    let n_ctx = args.ctx_size;
    if n_ctx < 8 {
        bail!("-c {n_ctx} is too small for perplexity (at least 8)");
    }
    let loaded = common::load(&path, Some(&args.device), n_ctx)?;
    eprintln!("rustorch: {}", common::kv_cache_line(&loaded.model, n_ctx));
    let (model, tok) = (&loaded.model, &loaded.tokenizer);
    let tokens = tok.encode(&text, true, false)?;
    let mut n_chunks = tokens.len() / n_ctx;
    if args.chunks >= 0 {
        n_chunks = n_chunks.min(args.chunks as usize);
    }
    if n_chunks == 0 {
        bail!(
            "'{}' has {} tokens, fewer than one chunk of {n_ctx} (lower -c)",
            file.display(),
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
    let mut base = match &args.kl_divergence_base {
        Some(p) => {
            let mut w = BufWriter::new(
                File::create(p).with_context(|| format!("cannot create '{}'", p.display()))?,
            );
            write_base_header(&mut w, n_ctx, nv, &tokens[..n_chunks * n_ctx])
                .with_context(|| format!("writing '{}'", p.display()))?;
            eprintln!(
                "perplexity: saving the log-probabilities to {}",
                p.display()
            );
            Some((w, vec![0u16; row_len(nv)], p))
        }
        None => None,
    };
    let (mut nll, mut nll2, mut count) = (0f64, 0f64, 0usize);
    let t0 = std::time::Instant::now();
    let mut out = std::io::stdout().lock();
    for c in 0..n_chunks {
        let chunk = &tokens[c * n_ctx..(c + 1) * n_ctx];
        let bos = tok.add_bos().then(|| tok.bos()).flatten();
        let logits = chunk_logits(model, bos, chunk, args.ubatch_size, &rt)?;
        for (i, row) in logits.chunks_exact(nv).take(n_ctx - 1 - first).enumerate() {
            let next = chunk[first + i + 1] as usize;
            let v = match &mut base {
                // llama.cpp scores from the same log-softmax it saves (float arithmetic)
                Some((w, q, p)) => {
                    let v = base_row(row, next, q);
                    write_u16s(w, q).with_context(|| format!("writing '{}'", p.display()))?;
                    v
                }
                None => nll_of(row, next),
            };
            nll += v;
            nll2 += v * v;
            count += 1;
        }
        write!(out, "[{}]{:.4},", c + 1, (nll / count as f64).exp())?;
        out.flush()?;
    }
    if let Some((mut w, _, p)) = base {
        w.flush()
            .with_context(|| format!("writing '{}'", p.display()))?;
    }
    let mean = nll / count as f64;
    let ppl = mean.exp();
    let var = nll2 / count as f64 - mean * mean;
    if var > 0.0 {
        let err = ppl * (var / (count as f64 - 1.0)).sqrt();
        writeln!(out, "\nFinal estimate: PPL = {ppl:.4} +/- {err:.5}")?;
    } else {
        writeln!(out, "\nFinal estimate: PPL = {ppl:.4}")?;
    }
    eprintln!(
        "perplexity: {count} tokens scored in {:.2} s",
        t0.elapsed().as_secs_f64()
    );
    Ok(())
}

/// Logits of positions `n_ctx/2 ..` of one chunk (its first token replaced by `bos`), one
/// `n_vocab` row per position, as llama.cpp asks for them (every position from the middle
/// on, the last included), the chunk fed in pieces of at most `ubatch` tokens.
fn chunk_logits(
    model: &Model,
    bos: Option<u32>,
    chunk: &[u32],
    ubatch: usize,
    rt: &Runtime,
) -> anyhow::Result<Vec<f32>> {
    let n_ctx = chunk.len();
    let first = n_ctx / 2;
    let nv = model.hparams().n_vocab;
    let mut cache = model.new_cache(n_ctx);
    let mut rows = Vec::with_capacity((n_ctx - first) * nv);
    for start in (0..n_ctx).step_by(ubatch.max(1)) {
        let end = (start + ubatch.max(1)).min(n_ctx);
        let mut batch = Batch::new();
        for (i, &t) in chunk.iter().enumerate().take(end).skip(start) {
            let t = if i == 0 { bos.unwrap_or(t) } else { t };
            batch.push(t, i as u32, 0, i >= first);
        }
        let fwd = model.forward(&batch, &mut cache, rt)?;
        for i in start.max(first)..end {
            rows.extend_from_slice(
                fwd.logits_for(i - start, nv)
                    .context("missing logits row")?,
            );
        }
    }
    Ok(rows)
}

/// `std::max` over a row from its first element, as llama.cpp's loops do.
fn max_of(logits: &[f32]) -> f32 {
    let mut m = logits[0];
    for &l in &logits[1..] {
        if m < l {
            m = l;
        }
    }
    m
}

/// `Σ expf(l - max)`, accumulated in double in index order.
fn sum_exp(logits: &[f32], max: f32) -> f64 {
    let mut s = 0f64;
    for &l in logits {
        s += (l - max).exp() as f64;
    }
    s
}

/// The negative log-likelihood of `tok` as llama.cpp's plain perplexity computes it
/// (`log_softmax(n_vocab, logits, tok)`): `(logit - max)` in float, `log(Σ)` in double.
fn nll_of(logits: &[f32], tok: usize) -> f64 {
    let max = max_of(logits);
    let s = sum_exp(logits, max);
    -((logits[tok] - max) as f64 - s.ln())
}

/// u16s per position in a base file: `2·⌈n_vocab/2⌉ + 4`.
pub fn row_len(n_vocab: usize) -> usize {
    2 * n_vocab.div_ceil(2) + 4
}

/// ggml's `nearest_int`: round to nearest even through the `1.5·2²³` trick.
fn nearest_int(f: f32) -> i32 {
    let v = f + 12_582_912.0;
    (v.to_bits() as i32 & 0x007f_ffff) - 0x0040_0000
}

/// llama.cpp's `log_softmax(n_vocab, logits, uint16_t * log_prob, tok)`: fills one base-file
/// row (`row_len(n_vocab)` u16: scale and minimum log-probability as f32, then each token
/// quantized over `[max - 16, max]`; padding stays 0) and returns the negative
/// log-likelihood of `tok` in its float arithmetic.
pub fn base_row(logits: &[f32], tok: usize, row: &mut [u16]) -> f64 {
    let n = logits.len();
    let (mut max, mut min) = (logits[0], logits[0]);
    for &l in &logits[1..] {
        if max < l {
            max = l;
        }
        if l < min {
            min = l;
        }
    }
    let floor = max - 16.0;
    if min < floor {
        min = floor;
    }
    let log_sum_exp = sum_exp(logits, max).ln() as f32;
    let min_log_prob = min - max - log_sum_exp;
    let scale = (max - min) / 65535.0;
    let (s, m) = (scale.to_le_bytes(), min_log_prob.to_le_bytes());
    row[0] = u16::from_le_bytes([s[0], s[1]]);
    row[1] = u16::from_le_bytes([s[2], s[3]]);
    row[2] = u16::from_le_bytes([m[0], m[1]]);
    row[3] = u16::from_le_bytes([m[2], m[3]]);
    let q = &mut row[4..4 + n];
    if scale != 0.0 {
        let inv_scale = 1.0 / scale;
        for (q, &l) in q.iter_mut().zip(logits) {
            // C's int -> uint16_t conversion wraps, as `as u16` does
            *q = if l > min {
                nearest_int(inv_scale * (l - min)) as u16
            } else {
                0
            };
        }
    } else {
        q.fill(0);
    }
    row[4 + n..].fill(0);
    (max + log_sum_exp - logits[tok]) as f64
}

/// The scale and minimum log-probability at the head of a base-file row.
fn row_scale_min(row: &[u16]) -> (f32, f32) {
    let f = |a: u16, b: u16| {
        let (a, b) = (a.to_le_bytes(), b.to_le_bytes());
        f32::from_le_bytes([a[0], a[1], b[0], b[1]])
    };
    (f(row[0], row[1]), f(row[2], row[3]))
}

/// A base file's header: `_logits_`, n_ctx, n_vocab, n_chunk and the evaluated tokens.
#[derive(Debug, Clone, PartialEq)]
pub struct BaseHeader {
    pub n_ctx: usize,
    pub n_vocab: usize,
    pub n_chunk: usize,
    pub tokens: Vec<u32>,
}

fn write_base_header(
    w: &mut impl Write,
    n_ctx: usize,
    n_vocab: usize,
    tokens: &[u32],
) -> std::io::Result<()> {
    w.write_all(b"_logits_")?;
    w.write_all(&(n_ctx as i32).to_le_bytes())?;
    w.write_all(&(n_vocab as i32).to_le_bytes())?;
    w.write_all(&((tokens.len() / n_ctx) as i32).to_le_bytes())?;
    let mut bytes = Vec::with_capacity(tokens.len() * 4);
    for &t in tokens {
        bytes.extend_from_slice(&(t as i32).to_le_bytes());
    }
    w.write_all(&bytes)
}

fn write_u16s(w: &mut impl Write, v: &[u16]) -> std::io::Result<()> {
    let mut bytes = Vec::with_capacity(v.len() * 2);
    for &x in v {
        bytes.extend_from_slice(&x.to_le_bytes());
    }
    w.write_all(&bytes)
}

fn read_i32(r: &mut impl Read) -> std::io::Result<i32> {
    let mut b = [0u8; 4];
    r.read_exact(&mut b)?;
    Ok(i32::from_le_bytes(b))
}

fn read_u16s(r: &mut impl Read, v: &mut [u16]) -> std::io::Result<()> {
    let mut bytes = vec![0u8; v.len() * 2];
    r.read_exact(&mut bytes)?;
    for (x, b) in v.iter_mut().zip(bytes.chunks_exact(2)) {
        *x = u16::from_le_bytes([b[0], b[1]]);
    }
    Ok(())
}

pub fn read_base_header(r: &mut impl Read) -> anyhow::Result<BaseHeader> {
    let mut magic = [0u8; 8];
    r.read_exact(&mut magic)
        .context("does not look like a file of log-probabilities")?;
    ensure!(
        &magic == b"_logits_",
        "does not look like a file of log-probabilities (no '_logits_' magic)"
    );
    let n_ctx = read_i32(r).context("reading n_ctx")?;
    let n_vocab = read_i32(r).context("reading n_vocab")?;
    let n_chunk = read_i32(r).context("reading n_chunk")?;
    ensure!(
        n_ctx >= 4 && n_vocab > 0 && n_chunk > 0,
        "bad header: n_ctx {n_ctx}, n_vocab {n_vocab}, n_chunk {n_chunk}"
    );
    let (n_ctx, n_vocab, n_chunk) = (n_ctx as usize, n_vocab as usize, n_chunk as usize);
    let mut bytes = vec![0u8; n_ctx * n_chunk * 4];
    r.read_exact(&mut bytes)
        .context("reading the evaluated tokens")?;
    let mut tokens = Vec::with_capacity(n_ctx * n_chunk);
    for b in bytes.chunks_exact(4) {
        let t = i32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        ensure!(
            t >= 0 && (t as usize) < n_vocab,
            "token {t} outside the vocabulary of {n_vocab}"
        );
        tokens.push(t as u32);
    }
    Ok(BaseHeader {
        n_ctx,
        n_vocab,
        n_chunk,
        tokens,
    })
}

/// llama.cpp's `kl_divergence_result`: the sums, in double, over scored positions.
#[derive(Debug, Default, Clone)]
pub struct Kld {
    pub sum_nll: f64,
    pub sum_nll2: f64,
    pub sum_nll_base: f64,
    pub sum_nll_base2: f64,
    pub sum_nll_nll_base: f64,
    pub sum_kld: f64,
    pub sum_kld2: f64,
    pub sum_p_diff: f64,
    pub sum_p_diff2: f64,
    pub sum_p_diff4: f64,
    pub max_p_diff: f32,
    pub n_same_top: usize,
    pub count: usize,
}

/// llama.cpp's `log_softmax(n_vocab, logits, base_log_prob, tok, kld)`: one position
/// against its base-file row, every operation in the type llama.cpp computes it in (float
/// products squared before they reach the double sums). Returns (KL-divergence, Δp).
pub fn kld_row(logits: &[f32], base: &[u16], tok: usize, kld: &mut Kld) -> (f64, f32) {
    let n = logits.len();
    let mut max_logit = logits[0];
    let mut imax = 0;
    for (i, &l) in logits.iter().enumerate().skip(1) {
        if l > max_logit {
            max_logit = l;
            imax = i;
        }
    }
    let log_sum_exp = sum_exp(logits, max_logit).ln() as f32;
    let (scale, min_log_prob) = row_scale_min(base);
    let base = &base[4..4 + n];

    let nll: f32 = max_logit + log_sum_exp - logits[tok];
    kld.sum_nll += nll as f64;
    kld.sum_nll2 += (nll * nll) as f64;

    let nll_base: f32 = -(scale * base[tok] as f32 + min_log_prob);
    kld.sum_nll_base += nll_base as f64;
    kld.sum_nll_base2 += (nll_base * nll_base) as f64;

    kld.sum_nll_nll_base += (nll * nll_base) as f64;

    max_logit += log_sum_exp;
    let mut sum = 0f64;
    let mut imax_base = 0;
    let mut p_log_base_max = 0f32;
    for (i, (&q, &l)) in base.iter().zip(logits).enumerate() {
        let p_log_base = scale * q as f32 + min_log_prob;
        if i == 0 || p_log_base > p_log_base_max {
            p_log_base_max = p_log_base;
            imax_base = i;
        }
        if p_log_base > -16.0 {
            let p_base = p_log_base.exp();
            sum += (p_base * (p_log_base - l + max_logit)) as f64;
        }
    }
    kld.sum_kld += sum;
    kld.sum_kld2 += sum * sum;
    kld.count += 1;
    if imax == imax_base {
        kld.n_same_top += 1;
    }

    let p_base = (-nll_base).exp();
    let p = (-nll).exp();
    let p_diff = p - p_base;
    kld.sum_p_diff += p_diff as f64;
    let p_diff2 = (p_diff * p_diff) as f64;
    kld.sum_p_diff2 += p_diff2;
    kld.sum_p_diff4 += p_diff2 * p_diff2;
    kld.max_p_diff = kld.max_p_diff.max(p_diff.abs());
    (sum, p_diff)
}

/// Mean and its standard error as llama.cpp's `mean_and_uncertainty` (0 for 10 values or fewer).
fn mean_and_uncertainty(sum: f64, sum2: f64, count: usize) -> (f64, f64) {
    if count < 1 {
        return (0.0, 0.0);
    }
    let f = sum / count as f64;
    let df = sum2 / count as f64 - f * f;
    let df = if df > 0.0 && count > 10 {
        (df / (count - 1) as f64).sqrt()
    } else {
        0.0
    };
    (f, df)
}

/// llama.cpp's `covariance` (0 below 10 values).
fn covariance(suma: f64, sumb: f64, sumab: f64, count: usize) -> f64 {
    if count < 10 {
        return 0.0;
    }
    let c = count as f64;
    (sumab / c - (suma / c) * (sumb / c)) / (c - 1.0)
}

/// llama.cpp's `percentile` over sorted values, in float.
fn percentile(values: &[f32], fraction: f32) -> f32 {
    if fraction <= 0.0 {
        return values[0];
    }
    if fraction >= 1.0 {
        return values[values.len() - 1];
    }
    let mut p = fraction * (values.len() - 1) as f32;
    let ip = p as usize;
    p -= ip as f32;
    (1.0 - p) * values[ip] + p * values[(ip + 1).min(values.len() - 1)]
}

/// The middle of sorted values: `0.5f*(a + b)` for an even count.
fn median(v: &[f32]) -> f32 {
    let n = v.len();
    if n.is_multiple_of(2) {
        0.5 * (v[n / 2] + v[n / 2 - 1])
    } else {
        v[n / 2]
    }
}

/// printf's `%W.Pf`: NaN and infinities spelled as glibc spells them.
fn cf(v: f64, w: usize, p: usize) -> String {
    if v.is_nan() {
        let s = if v.is_sign_negative() { "-nan" } else { "nan" };
        format!("{s:>w$}")
    } else if v.is_infinite() {
        let s = if v < 0.0 { "-inf" } else { "inf" };
        format!("{s:>w$}")
    } else {
        format!("{v:w$.p$}")
    }
}

/// The running line llama.cpp prints after each chunk.
fn chunk_line(c: usize, k: &Kld) -> String {
    let log_ppl = mean_and_uncertainty(k.sum_nll, k.sum_nll2, k.count);
    let ppl_val = log_ppl.0.exp();
    let ppl_unc = ppl_val * log_ppl.1;
    let log_ppl_base = mean_and_uncertainty(k.sum_nll_base, k.sum_nll_base2, k.count);
    let cov = covariance(k.sum_nll, k.sum_nll_base, k.sum_nll_nll_base, k.count);
    let ratio_val = log_ppl.0 - log_ppl_base.0;
    let ratio_unc = (log_ppl.1 * log_ppl.1 + log_ppl_base.1 * log_ppl_base.1 - 2.0 * cov).sqrt();
    let kl = mean_and_uncertainty(k.sum_kld, k.sum_kld2, k.count);
    let mse = mean_and_uncertainty(k.sum_p_diff2, k.sum_p_diff4, k.count);
    let rms_val = mse.0.sqrt();
    let rms_unc = 0.5 / rms_val * mse.1;
    let top = k.n_same_top as f64 / k.count as f64;
    let top_unc = (top * (1.0 - top) / (k.count as f64 - 1.0)).sqrt();
    format!(
        "{c:4}    {} ± {}    {} ± {}    {} ± {}    {} ± {} %    {} ± {} %",
        cf(ppl_val, 9, 4),
        cf(ppl_unc, 9, 4),
        cf(ratio_val, 10, 5),
        cf(ratio_unc, 10, 5),
        cf(kl.0, 10, 5),
        cf(kl.1, 10, 5),
        cf(100.0 * rms_val, 6, 3),
        cf(100.0 * rms_unc, 6, 3),
        cf(100.0 * top, 6, 3),
        cf(100.0 * top_unc, 6, 3),
    )
}

/// The three summary sections of llama.cpp's `kl_divergence()`; `kld_values` and
/// `p_diff_values` are sorted here.
fn summary(k: &Kld, kld_values: &mut [f32], p_diff_values: &mut [f32]) -> String {
    kld_values.sort_by(f32::total_cmp);
    p_diff_values.sort_by(f32::total_cmp);
    let mut s = String::new();
    let mut line = |l: String| {
        s.push_str(&l);
        s.push('\n');
    };
    line("====== Perplexity statistics ======".into());
    let log_ppl = mean_and_uncertainty(k.sum_nll, k.sum_nll2, k.count);
    let ppl_val = log_ppl.0.exp();
    let ppl_unc = ppl_val * log_ppl.1;
    line(format!(
        "Mean PPL(Q)                   : {} ± {}",
        cf(ppl_val, 10, 6),
        cf(ppl_unc, 10, 6)
    ));
    let log_ppl_base = mean_and_uncertainty(k.sum_nll_base, k.sum_nll_base2, k.count);
    let ppl_base_val = log_ppl_base.0.exp();
    let ppl_base_unc = ppl_base_val * log_ppl_base.1;
    line(format!(
        "Mean PPL(base)                : {} ± {}",
        cf(ppl_base_val, 10, 6),
        cf(ppl_base_unc, 10, 6)
    ));
    let cov = covariance(k.sum_nll, k.sum_nll_base, k.sum_nll_nll_base, k.count);
    let cor = cov / (log_ppl.1 * log_ppl_base.1);
    line(format!(
        "Cor(ln(PPL(Q)), ln(PPL(base))): {}%",
        cf(100.0 * cor, 6, 2)
    ));
    let ratio_val = log_ppl.0 - log_ppl_base.0;
    let ratio_unc = (log_ppl.1 * log_ppl.1 + log_ppl_base.1 * log_ppl_base.1 - 2.0 * cov).sqrt();
    line(format!(
        "Mean ln(PPL(Q)/PPL(base))     : {} ± {}",
        cf(ratio_val, 10, 6),
        cf(ratio_unc, 10, 6)
    ));
    let ppl_ratio_val = ratio_val.exp();
    let ppl_ratio_unc = ppl_ratio_val * ratio_unc;
    line(format!(
        "Mean PPL(Q)/PPL(base)         : {} ± {}",
        cf(ppl_ratio_val, 10, 6),
        cf(ppl_ratio_unc, 10, 6)
    ));
    let ppl_cov = ppl_val * ppl_base_val * cov;
    let diff_val = ppl_val - ppl_base_val;
    let diff_unc = (ppl_unc * ppl_unc + ppl_base_unc * ppl_base_unc - 2.0 * ppl_cov).sqrt();
    line(format!(
        "Mean PPL(Q)-PPL(base)         : {} ± {}",
        cf(diff_val, 10, 6),
        cf(diff_unc, 10, 6)
    ));
    line(String::new());

    line("====== KL divergence statistics ======".into());
    let kl = mean_and_uncertainty(k.sum_kld, k.sum_kld2, k.count);
    line(format!(
        "Mean    KLD: {} ± {}",
        cf(kl.0, 10, 6),
        cf(kl.1, 10, 6)
    ));
    let kv = &*kld_values;
    let f = |v: f32| cf(v as f64, 10, 6);
    line(format!("Maximum KLD: {}", f(kv[kv.len() - 1])));
    for (label, fr) in [("99.9%", 0.999f32), ("99.0%", 0.990), ("95.0%", 0.950)] {
        line(format!("{label}   KLD: {}", f(percentile(kv, fr))));
    }
    line(format!("90.0%   KLD: {}", f(percentile(kv, 0.900))));
    line(format!("Median  KLD: {}", f(median(kv))));
    for (label, fr) in [
        ("10.0%", 0.100f32),
        (" 5.0%", 0.050),
        (" 1.0%", 0.010),
        (" 0.1%", 0.001),
    ] {
        line(format!("{label}   KLD: {}", f(percentile(kv, fr))));
    }
    line(format!("Minimum KLD: {}", f(kv[0])));
    line(String::new());

    line("====== Token probability statistics ======".into());
    let pd = mean_and_uncertainty(k.sum_p_diff, k.sum_p_diff2, k.count);
    line(format!(
        "Mean    Δp: {} ± {} %",
        cf(100.0 * pd.0, 6, 3),
        cf(100.0 * pd.1, 5, 3)
    ));
    let pv = &*p_diff_values;
    let g = |v: f32| cf(100.0 * v as f64, 6, 3);
    line(format!("Maximum Δp: {}%", g(pv[pv.len() - 1])));
    for (label, fr) in [
        ("99.9%", 0.999f32),
        ("99.0%", 0.990),
        ("95.0%", 0.950),
        ("90.0%", 0.900),
        ("75.0%", 0.750),
    ] {
        line(format!("{label}   Δp: {}%", g(percentile(pv, fr))));
    }
    line(format!("Median  Δp: {}%", g(median(pv))));
    for (label, fr) in [
        ("25.0%", 0.250f32),
        ("10.0%", 0.100),
        (" 5.0%", 0.050),
        (" 1.0%", 0.010),
        (" 0.1%", 0.001),
    ] {
        line(format!("{label}   Δp: {}%", g(percentile(pv, fr))));
    }
    line(format!("Minimum Δp: {}%", g(pv[0])));
    let mse = mean_and_uncertainty(k.sum_p_diff2, k.sum_p_diff4, k.count);
    let rms_val = mse.0.sqrt();
    let rms_unc = 0.5 / rms_val * mse.1;
    line(format!(
        "RMS Δp    : {} ± {} %",
        cf(100.0 * rms_val, 6, 3),
        cf(100.0 * rms_unc, 5, 3)
    ));
    let top = k.n_same_top as f64 / k.count as f64;
    line(format!(
        "Same top p: {} ± {} %",
        cf(100.0 * top, 6, 3),
        cf(
            100.0 * (top * (1.0 - top) / (k.count as f64 - 1.0)).sqrt(),
            5,
            3
        )
    ));
    s
}

/// `--kl-divergence`: this model over the base file's tokens, against its log-probabilities.
fn kl_divergence(args: &Args) -> anyhow::Result<()> {
    let base_path: &Path = args
        .kl_divergence_base
        .as_deref()
        .context("--kl-divergence needs --kl-divergence-base FILE")?;
    let mut r = BufReader::with_capacity(
        1 << 20,
        File::open(base_path).with_context(|| format!("cannot open '{}'", base_path.display()))?,
    );
    let hdr = read_base_header(&mut r).with_context(|| format!("'{}'", base_path.display()))?;
    let path = common::resolve_model(args.model.as_deref())?;
    let loaded = common::load(&path, Some(&args.device), hdr.n_ctx)?;
    eprintln!(
        "rustorch: {}",
        common::kv_cache_line(&loaded.model, hdr.n_ctx)
    );
    let (model, tok) = (&loaded.model, &loaded.tokenizer);
    let n_vocab = model.hparams().n_vocab;
    if hdr.n_vocab != n_vocab {
        bail!(
            "inconsistent vocabulary: '{}' has {} tokens, the model {n_vocab}",
            base_path.display(),
            hdr.n_vocab
        );
    }
    let n_ctx = hdr.n_ctx;
    let first = n_ctx / 2;
    let per_chunk = n_ctx - 1 - first;
    let mut n_chunk = hdr.n_chunk;
    if args.chunks >= 0 {
        n_chunk = n_chunk.min(args.chunks as usize);
    }
    eprintln!(
        "kl-divergence: {n_chunk} chunks of {n_ctx} from '{}', {per_chunk} positions scored in each",
        base_path.display()
    );
    let rt = Runtime::new(common::threads(args.threads));
    let nv = row_len(n_vocab);
    let mut base = vec![0u16; per_chunk * nv];
    let mut kld = Kld::default();
    let mut kld_values = Vec::with_capacity(per_chunk * n_chunk);
    let mut p_diff_values = Vec::with_capacity(per_chunk * n_chunk);
    let bos = tok.add_bos().then(|| tok.bos()).flatten();
    let t0 = std::time::Instant::now();
    let mut out = std::io::stdout().lock();
    writeln!(
        out,
        "chunk             PPL               ln(PPL(Q)/PPL(base))          KL Divergence              Δp RMS            Same top p"
    )?;
    for c in 0..n_chunk {
        let chunk = &hdr.tokens[c * n_ctx..(c + 1) * n_ctx];
        let logits = chunk_logits(model, bos, chunk, args.ubatch_size, &rt)?;
        read_u16s(&mut r, &mut base).with_context(|| {
            format!(
                "reading the log-probabilities of chunk {c} from '{}'",
                base_path.display()
            )
        })?;
        for i in 0..per_chunk {
            let (k, pd) = kld_row(
                &logits[i * n_vocab..(i + 1) * n_vocab],
                &base[i * nv..(i + 1) * nv],
                chunk[first + i + 1] as usize,
                &mut kld,
            );
            kld_values.push(k as f32);
            p_diff_values.push(pd);
        }
        writeln!(out, "{}", chunk_line(c + 1, &kld))?;
        out.flush()?;
    }
    writeln!(out)?;
    eprintln!(
        "kl-divergence: {} positions in {:.2} s",
        kld.count,
        t0.elapsed().as_secs_f64()
    );
    if kld.count < 100 {
        // llama-perplexity does no statistics on so few values either
        eprintln!(
            "kl-divergence: {} positions, fewer than 100: no summary statistics",
            kld.count
        );
        return Ok(());
    }
    write!(
        out,
        "{}",
        summary(&kld, &mut kld_values, &mut p_diff_values)
    )?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A row of pseudo-random logits (splitmix64) spread over about ±12.
    fn logits(seed: u64, n: usize) -> Vec<f32> {
        let mut s = seed;
        (0..n)
            .map(|_| {
                s = s.wrapping_add(0x9e37_79b9_7f4a_7c15);
                let mut z = s;
                z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
                z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
                z ^= z >> 31;
                (z >> 40) as f32 / (1u64 << 24) as f32 * 24.0 - 12.0
            })
            .collect()
    }

    #[test]
    fn nearest_int_rounds_ties_to_even() {
        assert_eq!(nearest_int(0.5), 0);
        assert_eq!(nearest_int(1.5), 2);
        assert_eq!(nearest_int(2.5), 2);
        assert_eq!(nearest_int(65534.6), 65535);
        assert_eq!(nearest_int(-3.4), -3);
    }

    #[test]
    fn row_holds_scale_min_and_padding() {
        assert_eq!((row_len(7), row_len(8), row_len(49152)), (12, 12, 49156));
        for n in [7usize, 8] {
            let l = logits(n as u64, n);
            let mut row = vec![0xffffu16; row_len(n)];
            let nll = base_row(&l, 3, &mut row);
            let (scale, min) = row_scale_min(&row);
            let max = max_of(&l);
            // the largest logit maps to the top code, the row's log-probability is exact there
            let imax = l.iter().position(|&x| x == max).unwrap();
            assert_eq!(row[4 + imax], 65535);
            let lse = (sum_exp(&l, max).ln() as f32) + max;
            assert!((scale * 65535.0 + min - (max - lse)).abs() < 1e-5);
            assert!((nll - (lse - l[3]) as f64).abs() < 1e-5);
            assert!(row[4 + n..].iter().all(|&x| x == 0));
        }
    }

    #[test]
    fn a_model_against_its_own_base_has_no_divergence() {
        let n = 4097;
        let mut k = Kld::default();
        for seed in 0..20 {
            let l = logits(seed, n);
            // a token above the row's 16-nat floor, where the file holds its log-probability
            let max = max_of(&l);
            let tok = l.iter().position(|&x| x > max - 8.0).unwrap();
            let mut row = vec![0u16; row_len(n)];
            let nll = base_row(&l, tok, &mut row);
            let before = k.sum_nll_base;
            let (kl, pd) = kld_row(&l, &row, tok, &mut k);
            assert!(kl.abs() < 1e-4, "{kl}");
            assert!(pd.abs() < 1e-4, "{pd}");
            // the 16-bit code is within half a step (16/65535 nats) of the exact value
            assert!((k.sum_nll_base - before - nll).abs() < 1.3e-4);
        }
        assert_eq!(k.n_same_top, 20);
        assert!((k.sum_nll - k.sum_nll_base).abs() < 20.0 * 1.3e-4);
    }

    #[test]
    fn header_round_trip() {
        let tokens: Vec<u32> = (0..24).collect();
        let mut buf = Vec::new();
        write_base_header(&mut buf, 8, 100, &tokens).unwrap();
        assert_eq!(buf.len(), 8 + 12 + 24 * 4);
        let h = read_base_header(&mut buf.as_slice()).unwrap();
        assert_eq!(
            h,
            BaseHeader {
                n_ctx: 8,
                n_vocab: 100,
                n_chunk: 3,
                tokens
            }
        );
        let mut bad = buf.clone();
        bad[0] = b'x';
        assert!(read_base_header(&mut bad.as_slice()).is_err());
    }

    #[test]
    fn percentiles_and_median_as_llama_cpp() {
        let v: Vec<f32> = (0..11).map(|i| i as f32).collect();
        assert_eq!(percentile(&v, 0.5), 5.0);
        assert_eq!(percentile(&v, 0.05), 0.5);
        assert_eq!(percentile(&v, 0.0), 0.0);
        assert_eq!(percentile(&v, 1.0), 10.0);
        assert_eq!(median(&v), 5.0);
        assert_eq!(median(&v[..10]), 4.5);
    }
}
