//! `rustorch bench`: prompt-processing and generation speed, modelled on llama-bench.
//!
//! For each model, thread count and test: a warm-up run, then `-r` timed repetitions on a
//! fresh KV cache of `(n_prompt + n_gen) * parallel` cells. `ppN` evaluates N random tokens as one batch
//! (logits for the last one only); `tgN` decodes N random tokens one at a time from an empty
//! cache; with `--parallel N` there are N sequences (as llama-batched-bench's `-npl`): the
//! prompt test is one batch holding all N prompts, and each generation step one batch
//! holding the next token of every sequence; such tests are named `ppN xN`, `tgN xN`. Speed is tokens per
//! second per repetition; the table shows mean ± sample standard
//! deviation. `-o json` prints a JSON array with llama-bench's field names (plus load time and
//! peak RSS), `-o jsonl` one object per line.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context};
use rustorch_core::gguf::GgufFile;
use rustorch_core::GgmlType;
use rustorch_llm::{Batch, Model, Runtime, SeqId};
use serde_json::{json, Value};

use crate::common;

#[derive(clap::Args)]
pub struct Args {
    /// GGUF model (repeatable; default: the SmolLM2 model)
    #[arg(short = 'm', long = "model")]
    pub model: Vec<PathBuf>,
    /// Prompt lengths to test (comma-separated; 0 = no prompt test)
    #[arg(
        short = 'p',
        long = "n-prompt",
        value_delimiter = ',',
        default_value = "512"
    )]
    pub n_prompt: Vec<usize>,
    /// Generation lengths to test (comma-separated; 0 = no generation test)
    #[arg(
        short = 'n',
        long = "n-gen",
        value_delimiter = ',',
        default_value = "128"
    )]
    pub n_gen: Vec<usize>,
    /// Repetitions of each test
    #[arg(short = 'r', long = "repetitions", default_value_t = 5)]
    pub repetitions: usize,
    /// Thread counts (comma-separated; default: physical cores)
    #[arg(short = 't', long = "threads", value_delimiter = ',')]
    pub threads: Vec<usize>,
    /// Sequences evaluated together (comma-separated), as llama-batched-bench's `-npl`: the
    /// prompts of all of them in one batch, then one batch per step with a token of each
    #[arg(
        long = "parallel",
        visible_alias = "npl",
        value_delimiter = ',',
        default_value = "1"
    )]
    pub parallel: Vec<usize>,
    /// Output format: md, json or jsonl
    #[arg(short = 'o', long = "output", default_value = "md")]
    pub output: String,
    /// Skip the warm-up run before each test
    #[arg(long = "no-warmup")]
    pub no_warmup: bool,
    #[command(flatten)]
    pub device: common::DeviceArgs,
    /// Print progress to stderr
    #[arg(long = "progress")]
    pub progress: bool,
}

/// One finished test, in llama-bench's terms.
struct TestResult {
    model: ModelInfo,
    n_threads: usize,
    n_prompt: usize,
    n_gen: usize,
    n_parallel: usize,
    samples_ns: Vec<u64>,
    test_time: String,
}

#[derive(Clone)]
struct ModelInfo {
    filename: String,
    model_type: String,
    size: u64,
    n_params: u64,
    load_ms: f64,
    peak_rss: u64,
    file_size: u64,
    kv_bytes_per_cell: u64,
    /// The KV cache types (llama-bench's `type_k`, `type_v`).
    type_k: &'static str,
    type_v: &'static str,
    /// `CPU` or `CUDA`, the GPU's name, and the layers on it (llama-bench's fields).
    backend: &'static str,
    gpu_info: String,
    n_gpu_layers: usize,
}

impl TestResult {
    fn n_tokens(&self) -> usize {
        (self.n_prompt + self.n_gen) * self.n_parallel
    }
    fn samples_ts(&self) -> Vec<f64> {
        self.samples_ns
            .iter()
            .map(|&ns| 1e9 * self.n_tokens() as f64 / ns.max(1) as f64)
            .collect()
    }
    fn name(&self) -> String {
        let base = match (self.n_prompt, self.n_gen) {
            (p, 0) => format!("pp{p}"),
            (0, g) => format!("tg{g}"),
            (p, g) => format!("pp{p}+tg{g}"),
        };
        if self.n_parallel > 1 {
            format!("{base} x{}", self.n_parallel)
        } else {
            base
        }
    }
}

fn mean_sd(v: &[f64]) -> (f64, f64) {
    let n = v.len() as f64;
    if v.is_empty() {
        return (0.0, 0.0);
    }
    let mean = v.iter().sum::<f64>() / n;
    let sd = if v.len() > 1 {
        (v.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1.0)).sqrt()
    } else {
        0.0
    };
    (mean, sd)
}

/// Peak and current resident set size of this process, in bytes (Linux).
fn rss() -> (u64, u64) {
    let Ok(s) = std::fs::read_to_string("/proc/self/status") else {
        return (0, 0);
    };
    let field = |k: &str| {
        s.lines()
            .find(|l| l.starts_with(k))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse::<u64>().ok())
            .map_or(0, |kb| kb * 1024)
    };
    (field("VmHWM:"), field("VmRSS:"))
}

fn cpu_info() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|v| v.trim().to_string())
        })
        .unwrap_or_default()
}

/// llama.cpp's names for `general.file_type`.
fn ftype_name(g: &GgufFile) -> String {
    let ft = g.get_u32("general.file_type").ok();
    let name = match ft {
        Some(0) => "all F32",
        Some(1) => "F16",
        Some(2) => "Q4_0",
        Some(3) => "Q4_1",
        Some(7) => "Q8_0",
        Some(8) => "Q5_0",
        Some(9) => "Q5_1",
        Some(10) => "Q2_K - Medium",
        Some(11) => "Q3_K - Small",
        Some(12) => "Q3_K - Medium",
        Some(13) => "Q3_K - Large",
        Some(14) => "Q4_K - Small",
        Some(15) => "Q4_K - Medium",
        Some(16) => "Q5_K - Small",
        Some(17) => "Q5_K - Medium",
        Some(18) => "Q6_K",
        Some(25) => "IQ4_NL",
        Some(30) => "IQ4_XS",
        Some(32) => "BF16",
        _ => "",
    };
    if !name.is_empty() {
        return name.to_string();
    }
    // the type holding the most bytes
    let mut by_type: Vec<(GgmlType, u64)> = Vec::new();
    for t in g.tensors() {
        match by_type.iter_mut().find(|(ty, _)| *ty == t.ty) {
            Some(e) => e.1 += t.n_bytes,
            None => by_type.push((t.ty, t.n_bytes)),
        }
    }
    by_type.sort_by_key(|e| std::cmp::Reverse(e.1));
    by_type
        .first()
        .map_or_else(String::new, |e| e.0.to_string())
}

fn human_params(n: u64) -> String {
    if n >= 1_000_000_000 {
        format!("{:.2} B", n as f64 / 1e9)
    } else {
        format!("{:.2} M", n as f64 / 1e6)
    }
}

fn size_label(n: u64) -> String {
    let b = n as f64 / 1e9;
    if b >= 1.0 {
        format!("{:.1}B", b)
    } else {
        format!("{}M", (n as f64 / 1e6).round())
    }
}

fn now_iso() -> String {
    let d = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    chrono_like(d.as_secs())
}

/// `YYYY-MM-DDTHH:MM:SSZ` for a Unix time (UTC), without a date library.
fn chrono_like(secs: u64) -> String {
    let days = secs / 86_400;
    let rem = secs % 86_400;
    // civil-from-days (Howard Hinnant)
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = if m <= 2 { y + 1 } else { y };
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        (rem % 3600) / 60,
        rem % 60
    )
}

/// A small deterministic generator for the random prompt tokens.
struct Lcg(u64);
impl Lcg {
    fn next(&mut self, n: u32) -> u32 {
        self.0 = self
            .0
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        ((self.0 >> 33) % n as u64) as u32
    }
}

fn load_model(
    path: &Path,
    dev: &common::DeviceArgs,
    n_ctx: usize,
) -> anyhow::Result<(Model, ModelInfo)> {
    let t0 = Instant::now();
    let gguf =
        Arc::new(GgufFile::open(path).with_context(|| format!("loading '{}'", path.display()))?);
    let hp = rustorch_llm::HParams::from_gguf(&gguf).context("loading the model")?;
    let placement = dev.placement(hp.n_layer)?;
    let types = dev.cache_types()?;
    let gguf = dev.cpu_weights(path, gguf, placement)?;
    let mut model = Model::load_on(gguf.clone(), placement, n_ctx).context("loading the model")?;
    model.set_cache_types(types)?;
    dev.configure(&model, &gguf);
    let load_ms = t0.elapsed().as_secs_f64() * 1e3;
    let hp = model.hparams();
    let size = gguf.tensor_bytes();
    let n_params: u64 = gguf.tensors().iter().map(|t| t.n_elements()).sum();
    let info = ModelInfo {
        filename: path.display().to_string(),
        model_type: format!(
            "{} {} {}",
            hp.arch_name,
            size_label(n_params),
            ftype_name(&gguf)
        ),
        size,
        n_params,
        load_ms,
        peak_rss: 0,
        file_size: gguf.file_size(),
        kv_bytes_per_cell: hp.kv_bytes_per_cell_as(types) as u64,
        type_k: types.k.name(),
        type_v: types.v.name(),
        backend: model.backend_name(),
        gpu_info: model.gpu_name().unwrap_or_default(),
        n_gpu_layers: if model.gpu_name().is_some() {
            hp.n_layer
        } else {
            0
        },
    };
    Ok((model, info))
}

/// Times `reps` runs of one test: a prompt of `n_prompt` tokens as one batch, then `n_gen`
/// steps of one batch holding the next token of each of `n_par` sequences.
#[allow(clippy::too_many_arguments)]
fn run_test(
    model: &Model,
    rt: &Runtime,
    n_prompt: usize,
    n_gen: usize,
    n_par: usize,
    reps: usize,
    warmup: bool,
) -> anyhow::Result<Vec<u64>> {
    let n_vocab = model.hparams().n_vocab as u32;
    let mut rng = Lcg(42);
    let n_ctx = (n_prompt + n_gen) * n_par;
    let prompt: Vec<u32> = (0..n_prompt).map(|_| rng.next(n_vocab)).collect();
    let run_once = |n_prompt: usize, n_gen: usize, rng: &mut Lcg| -> anyhow::Result<u64> {
        let mut cache = model.new_cache(n_ctx.max(1));
        let t0 = Instant::now();
        if n_prompt > 0 {
            // one batch: the prompt of every sequence (each its own copy of the tokens)
            let mut b = Batch::new();
            for s in 0..n_par {
                for (i, &t) in prompt[..n_prompt].iter().enumerate() {
                    b.push(t, i as u32, s as SeqId, i + 1 == n_prompt);
                }
            }
            model.forward(&b, &mut cache, rt)?;
        }
        let mut b = Batch::new();
        for i in 0..n_gen {
            b.clear();
            for s in 0..n_par {
                b.push(rng.next(n_vocab), (n_prompt + i) as u32, s as SeqId, true);
            }
            model.forward(&b, &mut cache, rt)?;
        }
        Ok(t0.elapsed().as_nanos() as u64)
    };
    if warmup {
        if n_prompt > 0 {
            run_once(n_prompt, 0, &mut rng)?;
        }
        if n_gen > 0 {
            run_once(0, 1, &mut rng)?;
        }
    }
    (0..reps)
        .map(|_| run_once(n_prompt, n_gen, &mut rng))
        .collect()
}

fn to_json(r: &TestResult, cpu: &str) -> Value {
    let ts = r.samples_ts();
    let (avg_ts, sd_ts) = mean_sd(&ts);
    let ns: Vec<f64> = r.samples_ns.iter().map(|&x| x as f64).collect();
    let (avg_ns, sd_ns) = mean_sd(&ns);
    json!({
        "build_commit": env!("CARGO_PKG_VERSION"),
        "build_number": 0,
        "cpu_info": cpu,
        "gpu_info": r.model.gpu_info,
        "backends": r.model.backend,
        "model_filename": r.model.filename,
        "model_type": r.model.model_type,
        "model_size": r.model.size,
        "model_n_params": r.model.n_params,
        "n_batch": r.n_prompt.max(1),
        "n_ubatch": r.n_prompt.max(1),
        "n_threads": r.n_threads,
        "type_k": r.model.type_k,
        "type_v": r.model.type_v,
        "n_gpu_layers": r.model.n_gpu_layers,
        "flash_attn": true,
        "n_prompt": r.n_prompt,
        "n_gen": r.n_gen,
        "n_parallel": r.n_parallel,
        "n_depth": 0,
        "test_time": r.test_time,
        "avg_ns": avg_ns as u64,
        "stddev_ns": sd_ns as u64,
        "avg_ts": avg_ts,
        "stddev_ts": sd_ts,
        "samples_ns": r.samples_ns,
        "samples_ts": ts,
        "isa": rustorch_core::kernels::isa().name(),
        "load_ms": r.model.load_ms,
        "peak_rss_bytes": r.model.peak_rss,
        "file_size": r.model.file_size,
        "kv_cache_bytes": r.model.kv_bytes_per_cell * (r.n_prompt + r.n_gen) as u64,
    })
}

pub fn run(args: Args) -> anyhow::Result<()> {
    common::init_logging(false);
    if !matches!(args.output.as_str(), "md" | "json" | "jsonl") {
        bail!("unknown output format '{}' (md, json, jsonl)", args.output);
    }
    let models: Vec<PathBuf> = if args.model.is_empty() {
        vec![common::resolve_model(None)?]
    } else {
        args.model
            .iter()
            .map(|m| common::resolve_model(Some(m)))
            .collect::<Result<_, _>>()?
    };
    let threads: Vec<usize> = if args.threads.is_empty() {
        vec![common::threads(None)]
    } else {
        args.threads
            .iter()
            .map(|&t| common::threads(Some(t)))
            .collect()
    };
    let reps = args.repetitions.max(1);
    let cpu = cpu_info();
    let mut results: Vec<TestResult> = Vec::new();
    let mut printed_header = false;
    for path in &models {
        let longest =
            args.n_prompt.iter().max().unwrap_or(&0) + args.n_gen.iter().max().unwrap_or(&0);
        let n_ctx = longest * args.parallel.iter().max().unwrap_or(&1);
        let (model, mut info) = load_model(path, &args.device, n_ctx.max(1))?;
        let mut tests: Vec<(usize, usize)> = Vec::new();
        tests.extend(args.n_prompt.iter().filter(|&&p| p > 0).map(|&p| (p, 0)));
        tests.extend(args.n_gen.iter().filter(|&&g| g > 0).map(|&g| (0, g)));
        let mut tests: Vec<(usize, usize, usize)> = tests
            .into_iter()
            .flat_map(|(p, g)| {
                let pars = args.parallel.clone();
                pars.into_iter().map(move |n| (p, g, n.max(1)))
            })
            .collect();
        tests.dedup();
        let first = results.len();
        for &t in &threads {
            let rt = Runtime::new(t);
            for &(p, g, np) in &tests {
                if args.progress {
                    eprintln!("bench: {} t={t} p={p} n={g} np={np}", path.display());
                }
                let test_time = now_iso();
                let samples_ns = run_test(&model, &rt, p, g, np, reps, !args.no_warmup)?;
                results.push(TestResult {
                    model: info.clone(),
                    n_threads: t,
                    n_prompt: p,
                    n_gen: g,
                    n_parallel: np,
                    samples_ns,
                    test_time,
                });
            }
        }
        info.peak_rss = rss().0;
        for r in &mut results[first..] {
            r.model.peak_rss = info.peak_rss;
        }
        if args.output == "md" {
            if !printed_header {
                println!("| model | size | params | backend | threads | test | t/s |");
                println!("| ----- | ---: | -----: | ------- | ------: | ---: | --: |");
                printed_header = true;
            }
            for r in &results[first..] {
                let (m, sd) = mean_sd(&r.samples_ts());
                println!(
                    "| {} | {:.2} MiB | {} | {} | {} | {} | {:.2} ± {:.2} |",
                    r.model.model_type,
                    r.model.size as f64 / (1024.0 * 1024.0),
                    human_params(r.model.n_params),
                    r.model.backend,
                    r.n_threads,
                    r.name(),
                    m,
                    sd
                );
            }
            let kv = info.kv_bytes_per_cell
                * tests
                    .iter()
                    .map(|(p, g, n)| ((p + g) * n) as u64)
                    .max()
                    .unwrap_or(0);
            eprintln!(
                "{}: load {:.1} ms, peak RSS {:.1} MiB (file {:.1} MiB + KV cache {:.1} MiB, K {}, V {}), kernels {}",
                path.display(),
                info.load_ms,
                info.peak_rss as f64 / 1048576.0,
                info.file_size as f64 / 1048576.0,
                kv as f64 / 1048576.0,
                info.type_k,
                info.type_v,
                rustorch_core::kernels::isa().name()
            );
        }
    }
    match args.output.as_str() {
        "json" => {
            let arr: Vec<Value> = results.iter().map(|r| to_json(r, &cpu)).collect();
            println!("{}", serde_json::to_string_pretty(&arr)?);
        }
        "jsonl" => {
            for r in &results {
                println!("{}", serde_json::to_string(&to_json(r, &cpu))?);
            }
        }
        _ => {}
    }
    Ok(())
}
