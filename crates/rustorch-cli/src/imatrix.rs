//! `rustorch imatrix`: the importance matrix of a model over a text, as llama.cpp's
//! `llama-imatrix` (0.3.36) computes it, for `rustorch quantize --imatrix` (or
//! llama-quantize).
//!
//! The text (`-f`, one trailing newline dropped) is tokenized whole (BOS added when the
//! vocabulary asks for it), cut into chunks of `-c` tokens, and each chunk's first token is
//! replaced by BOS. Chunks are evaluated as llama-imatrix evaluates them: `n_seq =
//! max(1, b / c)` chunks side by side in one batch (one sequence each, a KV cache of
//! `n_seq · c` cells), each batch split into micro-batches of `-ub` tokens as llama.cpp
//! splits it (consecutive tokens for one sequence; with several, the same number of
//! tokens from each sequence, sequence by sequence: `split_equal`). Every product's f32
//! input is reported to the [`collect::Collector`] in that order, so the sums are added in
//! llama.cpp's order. Unless `--no-ppl`, the perplexity of each chunk's second half is
//! printed as llama-imatrix prints it.
//!
//! The activations equal llama.cpp's where the forward pass does (`docs/parity.md`): its
//! CPU flash attention takes another algorithm from 64 query rows of one sequence in a
//! micro-batch, so `-ub 32` on both sides (or any micro-batch giving each sequence fewer
//! than 64 rows, e.g. `-c 128` with the default `-b 2048 -ub 512` over 16 or more chunks)
//! gives byte-identical files (measured: SmolLM2-135M, Qwen2.5-1.5B, synthetic qwen3moe,
//! phi3, gemma3, llama, gemma2, qwen3; `tests/imatrix_cli.rs`). Otherwise the activations
//! differ by rounding, which the products' 8-bit activation quantization amplifies: with
//! llama.cpp's defaults (`-c 512`, 128 rows a sequence) on SmolLM2 the sums differ from
//! llama-imatrix's by 0.19% (median) and 11.5% (largest), as much as llama-imatrix's own
//! sums differ between `-ub 512` and `-ub 32` (0.20%, 12.3%).

pub mod collect;
pub mod file;

use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, ensure, Context};
use rustorch_llm::{Batch, Runtime};

use crate::common;
use collect::{Collector, SaveParams};

#[derive(clap::Args, Debug)]
#[command(after_help = "llama-imatrix's flags; -ub and -ofreq are accepted as aliases.")]
pub struct Args {
    /// GGUF model (default: models/SmolLM2-135M-Instruct.Q4_1.gguf)
    #[arg(short = 'm', long = "model")]
    pub model: Option<PathBuf>,
    /// Text to compute the matrix over (without it: combine the --in-file matrices)
    #[arg(short = 'f', long = "file")]
    pub file: Option<PathBuf>,
    /// Output file
    #[arg(
        short = 'o',
        long = "output-file",
        alias = "output",
        default_value = "imatrix.gguf"
    )]
    pub output: PathBuf,
    /// Output format: gguf (default) or dat (the legacy format)
    #[arg(long = "output-format", default_value = "gguf", value_parser = ["gguf", "dat"])]
    pub output_format: String,
    /// Tokens per chunk
    #[arg(short = 'c', long = "ctx-size", default_value_t = 512)]
    pub ctx_size: usize,
    /// Process at most this many chunks (-1 = all)
    #[arg(long = "chunks", default_value_t = -1, allow_hyphen_values = true)]
    pub chunks: i64,
    /// Skip this many chunks at the start of the text
    #[arg(long = "chunk", alias = "from-chunk", default_value_t = 0)]
    pub from_chunk: usize,
    /// Tokens per batch: b / c chunks are evaluated side by side
    #[arg(short = 'b', long = "batch-size", default_value_t = 2048)]
    pub batch_size: usize,
    /// Tokens per forward pass (-ub)
    #[arg(long = "ubatch-size", default_value_t = 512)]
    pub ubatch_size: usize,
    /// Save the matrix every N chunks (-ofreq)
    #[arg(long = "output-frequency", default_value_t = 10)]
    pub output_frequency: i32,
    /// Also save a copy OUT.at_N every N chunks (0 = never)
    #[arg(long = "save-frequency", default_value_t = 0)]
    pub save_frequency: i32,
    /// Collect data for output.weight too
    #[arg(long = "process-output")]
    pub process_output: bool,
    /// Do not compute perplexity
    #[arg(long = "no-ppl")]
    pub no_ppl: bool,
    /// Compute perplexity (the default)
    #[arg(long = "ppl", conflicts_with = "no_ppl")]
    pub ppl: bool,
    /// Earlier matrices to add to (repeatable, or comma-separated)
    #[arg(long = "in-file", value_delimiter = ',')]
    pub in_file: Vec<PathBuf>,
    /// Tokenize special tokens written in the text
    #[arg(long = "parse-special")]
    pub parse_special: bool,
    /// Threads (default: physical cores)
    #[arg(short = 't', long = "threads")]
    pub threads: Option<usize>,
}

/// `log_softmax(n_vocab, logits, tok)` of llama-imatrix: `-log p(tok)` with a double sum of
/// f32 `expf`.
fn nll(logits: &[f32], tok: usize) -> f64 {
    let mut max = logits[0];
    for &l in &logits[1..] {
        max = max.max(l);
    }
    let mut sum = 0f64;
    for &l in logits {
        sum += f64::from((l - max).exp());
    }
    -(f64::from(logits[tok] - max) - sum.ln())
}

/// The micro-batches llama.cpp cuts a batch of `n_seqs` sequences of `len` tokens each
/// into (rows listed sequence-major, as the batch holds them): as `split_simple` for one
/// stream (`n_stream == 1`), else as `split_equal` with sequential sequence ids. Each
/// micro-batch is a list of (sequence, token index within the sequence's batch part).
fn micro_batches(
    n_stream: usize,
    n_seqs: usize,
    len: usize,
    n_ubatch: usize,
) -> Vec<Vec<(usize, usize)>> {
    let n_ubatch = n_ubatch.max(1);
    let mut out = Vec::new();
    if n_stream == 1 {
        let all: Vec<(usize, usize)> = (0..n_seqs)
            .flat_map(|s| (0..len).map(move |t| (s, t)))
            .collect();
        for c in all.chunks(n_ubatch) {
            out.push(c.to_vec());
        }
        return out;
    }
    let mut next = vec![0usize; n_seqs];
    loop {
        // the sequences taking part: consecutive ids from the first one with tokens left
        let mut seqs: Vec<usize> = Vec::new();
        for (s, &at) in next.iter().enumerate() {
            if at < len && seqs.last().is_none_or(|&l| s == l + 1) {
                seqs.push(s);
                if seqs.len() > n_ubatch {
                    break;
                }
            }
        }
        if seqs.is_empty() {
            return out;
        }
        // one token from each at a time, while all have one and the batch has room
        let mut per = vec![Vec::new(); seqs.len()];
        loop {
            if seqs.iter().any(|&s| next[s] >= len) {
                break;
            }
            for (i, &s) in seqs.iter().enumerate() {
                per[i].push((s, next[s]));
                next[s] += 1;
            }
            if (per[0].len() + 1) * seqs.len() > n_ubatch {
                break;
            }
        }
        out.push(per.concat());
    }
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let n_ctx = args.ctx_size;
    ensure!(n_ctx > 0, "imatrix requires --ctx-size > 0");
    // llama-imatrix: b / c chunks side by side, one sequence (and KV stream) each
    let n_seq = (args.batch_size / n_ctx).max(1);
    let n_kv = n_seq * n_ctx;
    let n_batch = args.batch_size.min(n_kv).max(1);
    let n_ubatch = args.ubatch_size.min(n_batch).max(1);
    let legacy = args.output_format == "dat";
    if !legacy && args.output.extension().is_none_or(|e| e != "gguf") {
        eprintln!(
            "imatrix: saving imatrix using GGUF format with a different suffix than .gguf \
             (use --output-format dat for the previous format)"
        );
    }

    let in_files: Vec<file::Imatrix> = args
        .in_file
        .iter()
        .map(|p| {
            eprintln!("imatrix: loading imatrix from '{}'", p.display());
            file::load(p)
        })
        .collect::<anyhow::Result<_>>()?;
    let mut datasets: Vec<String> = in_files.iter().flat_map(|m| m.datasets.clone()).collect();
    if let Some(f) = &args.file {
        datasets.push(f.to_string_lossy().into_owned());
    }
    let save = SaveParams {
        out: args.output.clone(),
        legacy,
        chunk_size: n_ctx as i64,
        out_freq: args.output_frequency,
        save_freq: args.save_frequency,
        datasets,
    };

    let Some(text_path) = &args.file else {
        // combine earlier matrices only
        ensure!(
            !in_files.is_empty(),
            "no text (-f) and no precomputed matrices (--in-file) to combine"
        );
        let path = common::resolve_model(args.model.as_deref())?;
        let gguf = rustorch_core::gguf::GgufFile::open(&path)
            .with_context(|| format!("loading '{}'", path.display()))?;
        let c = Collector::new(&gguf, args.process_output, save);
        for m in &in_files {
            c.load(m)?;
        }
        eprintln!(
            "imatrix: saving combined imatrix to '{}'",
            args.output.display()
        );
        return c.save(None);
    };

    let mut text = std::fs::read(text_path)
        .with_context(|| format!("cannot read '{}'", text_path.display()))?;
    if text.last() == Some(&b'\n') {
        text.pop();
    }
    let path = common::resolve_model(args.model.as_deref())?;
    let loaded = common::load(&path, None, n_kv)?;
    let (model, tok) = (&loaded.model, &loaded.tokenizer);
    let collector = Arc::new(Collector::new(&loaded.gguf, args.process_output, save));
    for m in &in_files {
        collector.load(m)?;
    }

    let t0 = Instant::now();
    eprintln!("imatrix: tokenizing the input ..");
    let mut tokens = tok.encode_bytes(&text, true, args.parse_special)?;
    eprintln!(
        "imatrix: tokenization took {:.3} ms",
        t0.elapsed().as_secs_f64() * 1e3
    );
    if args.from_chunk > 0 {
        if (args.from_chunk + 2) * n_ctx >= tokens.len() {
            bail!(
                "there will be not enough tokens left after removing {} chunks",
                args.from_chunk
            );
        }
        eprintln!(
            "imatrix: removing initial {} chunks ({} tokens)",
            args.from_chunk,
            args.from_chunk * n_ctx
        );
        tokens.drain(..args.from_chunk * n_ctx);
    }
    if tokens.len() < 2 * n_ctx {
        bail!(
            "you need at least {} tokens for a context of {n_ctx} tokens; '{}' tokenizes to \
             only {}",
            2 * n_ctx,
            text_path.display(),
            tokens.len()
        );
    }
    let n_chunk_max = tokens.len() / n_ctx;
    let n_chunk = if args.chunks < 0 {
        n_chunk_max
    } else {
        (args.chunks as usize).min(n_chunk_max)
    };
    let compute_ppl = !args.no_ppl;
    let nv = model.hparams().n_vocab;
    let bos = tok.add_bos().then(|| tok.bos()).flatten();
    let num_batches = n_ctx.div_ceil(n_batch);
    eprintln!(
        "imatrix: computing over {n_chunk} chunks, n_ctx={n_ctx}, batch_size={n_batch}, \
         n_seq={n_seq}"
    );

    let mut rt = Runtime::new(common::threads(args.threads));
    rt.product_observer = Some(collector.clone());
    let mut cache = model.new_cache(n_kv);
    let first = n_ctx / 2;
    let (mut nll_sum, mut nll2, mut count) = (0f64, 0f64, 0usize);
    // stdout carries what llama-imatrix prints there: the ETA's minutes, the perplexity
    // values, and a newline per save (printed by the collector, on this thread)
    let out = || std::io::stdout().lock();
    let mut i = 0;
    while i < n_chunk {
        let start = i * n_ctx;
        let n_seq_batch = n_seq.min(n_chunk - i);
        let t_pass = Instant::now();
        cache.clear();
        // -log p of each scored token (positions `first` .. n_ctx - 2 predict the next),
        // per sequence of this batch
        let mut scored: Vec<Vec<f64>> = vec![Vec::new(); n_seq_batch];
        for j in 0..num_batches {
            let batch_start = start + j * n_batch;
            let batch_size = (start + n_ctx - batch_start).min(n_batch);
            for ub in micro_batches(n_seq, n_seq_batch, batch_size, n_ubatch) {
                let mut batch = Batch::new();
                for &(s, k) in &ub {
                    let at = batch_start + s * n_ctx + k;
                    let t = if j == 0 && k == 0 {
                        bos.unwrap_or(tokens[at])
                    } else {
                        tokens[at]
                    };
                    // every position asks for logits, as llama-imatrix's (so the last
                    // layer runs on every row)
                    batch.push(t, (j * n_batch + k) as u32, s as u32, true);
                }
                let fwd = model.forward(&batch, &mut cache, &rt)?;
                if let Some(e) = collector.error() {
                    bail!("{e}");
                }
                if compute_ppl {
                    for (r, &(s, k)) in ub.iter().enumerate() {
                        let pos = j * n_batch + k;
                        if pos >= first && pos < n_ctx - 1 {
                            let row = fwd.logits_for(r, nv).context("missing logits row")?;
                            let next = tokens[start + s * n_ctx + pos + 1] as usize;
                            scored[s].push(nll(row, next));
                        }
                    }
                }
            }
        }
        if i == 0 {
            let secs = t_pass.elapsed().as_secs_f64();
            let total = (secs * n_chunk as f64 / n_seq as f64) as u64;
            eprintln!("imatrix: {secs:.2} seconds per pass - ETA");
            let mut o = out();
            if total >= 3600 {
                write!(o, "{} hours ", total / 3600)?;
            }
            writeln!(o, "{:.2} minutes", (total % 3600) as f64 / 60.0)?;
        }
        if compute_ppl {
            for (s, vs) in scored.iter().enumerate() {
                for &v in vs {
                    nll_sum += v;
                    nll2 += v * v;
                    count += 1;
                }
                write!(
                    out(),
                    "[{}]{:.4},",
                    i + s + 1,
                    (nll_sum / count as f64).exp()
                )?;
            }
            out().flush()?;
        }
        i += n_seq;
    }
    writeln!(out())?;
    if compute_ppl && count > 0 {
        let mean = nll_sum / count as f64;
        let ppl = mean.exp();
        let var = nll2 / count as f64 - mean * mean;
        if var > 0.0 {
            let err = (var / (count as f64 - 1.0)).sqrt() * ppl;
            writeln!(out(), "Final estimate: PPL = {ppl:.4} +/- {err:.5}")?;
        } else {
            writeln!(out(), "Unexpected negative standard deviation of log(prob)")?;
        }
    }
    for (name, pct) in collector.partial() {
        eprintln!("imatrix: entry '{name:>40}' has partial data ({pct:.2}%)");
    }
    collector.save(None)?;
    writeln!(out())?;
    eprintln!(
        "imatrix: {} entries, {} chunks of {n_ctx} tokens, {:.2} s -> {}",
        collector.n_entries(),
        collector.last_chunk(),
        t0.elapsed().as_secs_f64(),
        args.output.display()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::micro_batches;

    #[test]
    fn one_stream_takes_consecutive_tokens() {
        let u = micro_batches(1, 1, 10, 4);
        assert_eq!(u.len(), 3);
        assert_eq!(u[2], vec![(0, 8), (0, 9)]);
    }

    #[test]
    fn several_streams_take_equal_parts() {
        // 4 sequences of 8 tokens, 16 a micro-batch: 4 tokens of each, sequence-major
        let u = micro_batches(4, 4, 8, 16);
        assert_eq!(u.len(), 2);
        assert_eq!(&u[0][..5], &[(0, 0), (0, 1), (0, 2), (0, 3), (1, 0)]);
        assert_eq!(u[1][15], (3, 7));
        // a last batch of fewer sequences than streams
        let u = micro_batches(4, 2, 8, 16);
        assert_eq!(u.len(), 1);
        assert_eq!(u[0].len(), 16);
        // more sequences than a micro-batch holds: ubatch + 1 sequences, one token each
        let u = micro_batches(8, 8, 2, 4);
        assert_eq!(u[0], vec![(0, 0), (1, 0), (2, 0), (3, 0), (4, 0)]);
        assert_eq!(u.iter().map(Vec::len).sum::<usize>(), 16);
    }
}
