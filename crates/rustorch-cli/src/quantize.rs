//! `rustorch quantize`: llama-quantize's command. Converts a GGUF model to one of llama.cpp's
//! file types (a quantization *mix*: `Q4_K_M` keeps some attention-V and FFN-down matrices at
//! Q6_K, the output matrix at Q6_K, and so on), tensor for tensor as llama.cpp 0.3.36 decides
//! it ([`recipe`]), with the same bytes: ggml's reference quantizers from `rustorch_core::quant`,
//! tensors in the model loader's order, `general.quantization_version` and `general.file_type`
//! appended last, data aligned to 32 bytes (or the input's `general.alignment`, where
//! llama.cpp would write offsets for 32 that the key then contradicts).
//!
//! `--imatrix FILE` quantizes with an importance matrix (a GGUF or legacy `.dat` file from
//! `rustorch imatrix` or `llama-imatrix`) as llama-quantize does: each matrix's rows are
//! quantized by ggml's weighted quantizers (`quant::quantize_rows`) with the per-column
//! importance `sum / count` (per expert for MoE weights), the recipe takes its imatrix
//! branches, and the output carries `quantize.imatrix.file`, `.dataset`, `.entries_count`
//! and `.chunks_count`. `--include-weights` / `--exclude-weights` keep or drop entries whose
//! name contains the given text.

mod recipe;

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufWriter, IsTerminal as _, Seek as _, Write};
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context};
use rayon::prelude::*;
use rustorch_core::gguf::{GgufFile, TensorInfo, Value, ValueType};
use rustorch_core::quant;
use rustorch_core::GgmlType;

use crate::imatrix::file as imatrix_file;
use recipe::{Ftype, ModelInfo, Params, Recipe};

#[derive(clap::Args, Debug)]
#[command(
    override_usage = "rustorch quantize [OPTIONS] IN [OUT] FTYPE [THREADS]",
    after_help = "FTYPE: Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 Q2_K Q3_K_S Q3_K_M Q3_K_L Q4_K_S Q4_K_M Q5_K_S \
                  Q5_K_M Q6_K IQ4_NL IQ4_XS F16 BF16 F32 (Q3_K, Q4_K, Q5_K: the _M mixes), or \
                  llama.cpp's number for it. Without OUT the output is ggml-model-FTYPE.gguf next \
                  to IN."
)]
pub struct Args {
    /// Allow requantizing tensors that are already quantized (loses quality compared to
    /// quantizing from 16 or 32 bit)
    #[arg(long)]
    pub allow_requantize: bool,
    /// Leave output.weight un(re)quantized
    #[arg(long)]
    pub leave_output_tensor: bool,
    /// No k-quant mixture: every quantizable tensor gets the file type's base type
    /// (rows that do not fit still fall back)
    #[arg(long)]
    pub pure: bool,
    /// ggml type for output.weight (e.g. q8_0, f16)
    #[arg(long, value_name = "T")]
    pub output_tensor_type: Option<String>,
    /// ggml type for token_embd.weight
    #[arg(long, value_name = "T")]
    pub token_embedding_type: Option<String>,
    /// Importance matrix (GGUF or legacy .dat, from `rustorch imatrix` or llama-imatrix)
    #[arg(long, value_name = "FILE")]
    pub imatrix: Option<PathBuf>,
    /// Use importance-matrix entries whose name contains this (repeatable)
    #[arg(
        long,
        value_name = "NAME",
        requires = "imatrix",
        conflicts_with = "exclude_weights"
    )]
    pub include_weights: Vec<String>,
    /// Drop importance-matrix entries whose name contains this (repeatable)
    #[arg(long, value_name = "NAME", requires = "imatrix")]
    pub exclude_weights: Vec<String>,
    /// Print each tensor's type and size without writing a file
    #[arg(long)]
    pub dry_run: bool,
    /// IN [OUT] FTYPE [THREADS]
    #[arg(required = true, num_args = 2..=4, value_name = "ARGS")]
    pub positional: Vec<String>,
}

/// The parsed positional arguments.
struct Plan {
    input: PathBuf,
    output: PathBuf,
    ftype: Ftype,
    ftype_name: &'static str,
    threads: usize,
}

fn parse_positional(p: &[String]) -> anyhow::Result<Plan> {
    let input = PathBuf::from(&p[0]);
    let (output, ftype, rest) = match Ftype::parse(&p[1]) {
        // IN FTYPE [THREADS]: llama-quantize writes ggml-model-FTYPE.gguf beside IN.
        Some((ft, name)) if p.len() <= 3 => {
            let dir = input.parent().unwrap_or(Path::new(""));
            (
                dir.join(format!("ggml-model-{name}.gguf")),
                (ft, name),
                &p[2..],
            )
        }
        _ => {
            let f = p.get(2).context("missing FTYPE")?;
            let ft = Ftype::parse(f).with_context(|| {
                format!(
                    "invalid ftype '{f}' (one of {})",
                    recipe::FTYPE_NAMES
                        .iter()
                        .map(|(n, _)| *n)
                        .collect::<Vec<_>>()
                        .join(" ")
                )
            })?;
            (PathBuf::from(&p[1]), ft, &p[3..])
        }
    };
    let threads = match rest {
        [] => 0,
        [t] => t
            .trim()
            .parse::<i64>()
            .with_context(|| format!("invalid nthread '{t}'"))?
            .max(0) as usize,
        _ => bail!("too many arguments: IN [OUT] FTYPE [THREADS]"),
    };
    let threads = if threads == 0 {
        std::thread::available_parallelism().map_or(1, |n| n.get())
    } else {
        threads
    };
    Ok(Plan {
        input,
        output,
        ftype: ftype.0,
        ftype_name: ftype.1,
        threads,
    })
}

/// A ggml type name given to `--output-tensor-type` / `--token-embedding-type`.
fn parse_type(flag: &str, s: &Option<String>) -> anyhow::Result<Option<GgmlType>> {
    s.as_deref()
        .map(|s| GgmlType::from_name(s).with_context(|| format!("{flag}: invalid ggml_type '{s}'")))
        .transpose()
}

/// The hyper-parameters the recipe reads, from the file's metadata.
fn model_info(src: &GgufFile) -> anyhow::Result<ModelInfo> {
    let arch = src
        .architecture()
        .context("reading general.architecture")?
        .to_string();
    let key = |k: &str| format!("{arch}.{k}");
    let n_layer = src
        .get_u32(&key("block_count"))
        .with_context(|| format!("reading {}", key("block_count")))?;
    // A count may be a per-layer array; llama.cpp's n_head() is layer 0's.
    let first = |k: &str| -> Option<u32> {
        match src.get(&key(k))? {
            Value::Array(_, items) => items.first()?.as_u64(),
            v => v.as_u64(),
        }
        .map(|v| v as u32)
    };
    let n_head = first("attention.head_count").unwrap_or(0);
    let n_head_kv = first("attention.head_count_kv").unwrap_or(n_head);
    let n_expert = first("expert_count").unwrap_or(0);
    Ok(ModelInfo {
        arch,
        n_layer,
        n_head,
        n_head_kv,
        n_expert,
    })
}

/// One output tensor: where it comes from and what it becomes.
struct Job<'a> {
    info: &'a TensorInfo,
    dims: Vec<u64>,
    new_type: GgmlType,
    new_bytes: u64,
    /// Importance weights: one per column, per expert for a 3-D tensor.
    imatrix: Option<&'a [f32]>,
}

/// The importance matrix as llama-quantize prepares it: per-column weights by tensor name,
/// after `--exclude-weights` / `--include-weights`.
struct Importance {
    weights: BTreeMap<String, Vec<f32>>,
    file: String,
    dataset: Option<String>,
    /// Chunks the matrix was computed on (0: unknown).
    chunks: i32,
}

fn load_importance(args: &Args) -> anyhow::Result<Option<Importance>> {
    let Some(path) = &args.imatrix else {
        return Ok(None);
    };
    let im = imatrix_file::load(path)?;
    if !im.legacy && !im.has_metadata {
        bail!("missing imatrix metadata in file {}", path.display());
    }
    let mut weights = im.weights();
    if !im.datasets.is_empty() {
        eprintln!(
            "quantize: imatrix datasets=[{}]",
            im.datasets
                .iter()
                .map(|d| format!("'{d}'"))
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    eprintln!(
        "quantize: loaded {} importance matrix entries from {} computed on {} chunks",
        weights.len(),
        path.display(),
        im.chunk_count
    );
    for x in &args.exclude_weights {
        weights.retain(|name, _| !name.contains(x.as_str()));
    }
    if !args.include_weights.is_empty() {
        weights.retain(|name, _| {
            args.include_weights
                .iter()
                .any(|x| name.contains(x.as_str()))
        });
    }
    if weights.is_empty() {
        // (llama-quantize then quantizes as without an imatrix)
        return Ok(None);
    }
    eprintln!("quantize: have {} importance matrix entries", weights.len());
    if let Some((name, v)) = weights
        .iter()
        .find_map(|(n, w)| w.iter().find(|v| !v.is_finite()).map(|v| (n, v)))
    {
        bail!("imatrix contains non-finite value {v} (entry '{name}')");
    }
    Ok(Some(Importance {
        weights,
        file: path.to_string_lossy().into_owned(),
        dataset: im.datasets.first().cloned(),
        chunks: im.chunk_count,
    }))
}

/// The importance weights of tensor `t` (None when the matrix has no entry for it), checked
/// against its shape as llama-quantize checks them: `ne0 · n_expert` values, else an error
/// (the token embedding, which never has activations of its own, is quantized without).
fn tensor_importance<'a>(imp: &'a Importance, t: &TensorInfo) -> anyhow::Result<Option<&'a [f32]>> {
    let Some(w) = imp.weights.get(&t.name) else {
        eprintln!("quantize: did not find weights for {}", t.name);
        return Ok(None);
    };
    let expected = t.ne0() as u64 * t.dims.get(2).copied().unwrap_or(1);
    if w.len() as u64 == expected {
        return Ok(Some(w));
    }
    eprintln!(
        "quantize: imatrix size {} is different from tensor size {expected} for {}",
        w.len(),
        t.name
    );
    if t.name == "token_embd.weight" || t.name == "per_layer_token_embd.weight" {
        return Ok(None);
    }
    bail!(
        "imatrix size {} is different from tensor size {expected} for {}",
        w.len(),
        t.name
    )
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let plan = parse_positional(&args.positional)?;
    let importance = load_importance(&args)?;
    let params = Params {
        pure: args.pure,
        quantize_output_tensor: !args.leave_output_tensor,
        output_tensor_type: parse_type("--output-tensor-type", &args.output_tensor_type)?,
        token_embedding_type: parse_type("--token-embedding-type", &args.token_embedding_type)?,
        has_imatrix: importance.is_some(),
    };
    if !args.dry_run && same_file(&plan.input, &plan.output) {
        bail!(
            "input and output files are the same: '{}'",
            plan.input.display()
        );
    }
    eprintln!(
        "quantize: {} '{}' {}as {} using {} threads",
        if args.dry_run {
            "calculating the quantization size of"
        } else {
            "quantizing"
        },
        plan.input.display(),
        if args.dry_run {
            String::new()
        } else {
            format!("to '{}' ", plan.output.display())
        },
        plan.ftype_name,
        plan.threads
    );
    let src = GgufFile::open(&plan.input)
        .with_context(|| format!("loading '{}'", plan.input.display()))?;
    let model = model_info(&src)?;

    // The model loader keeps weights sorted by layer, then name; the output follows it.
    let mut order: Vec<&TensorInfo> = src.tensors().iter().collect();
    order.sort_by(|a, b| recipe::weight_order(&a.name, &b.name));

    let mut recipe = Recipe::new(
        &model,
        &params,
        plan.ftype,
        order.iter().map(|t| t.name.as_str()),
    );
    let mut jobs = Vec::with_capacity(order.len());
    for t in &order {
        let choice = recipe
            .choose(&t.name, &t.dims, t.ty)
            .map_err(anyhow::Error::msg)?;
        if let Some(w) = &choice.fallback {
            eprintln!("warning: {w}");
        }
        let new_type = choice.ty;
        // ggml writes ggml_n_dims dimensions: trailing 1s are dropped.
        let dims = t.dims[..recipe::n_dims(&t.dims).min(t.dims.len())].to_vec();
        if new_type != t.ty {
            // (a dry run only reports, as llama-quantize's does)
            check_conversion(t, new_type, args.allow_requantize || args.dry_run)?;
        }
        let new_bytes = new_type
            .bytes_for(t.n_elements())
            .with_context(|| format!("tensor '{}' does not fit {new_type}", t.name))?;
        let imatrix = match &importance {
            Some(imp) if new_type != t.ty && !args.dry_run => tensor_importance(imp, t)?,
            _ => None,
        };
        jobs.push(Job {
            info: t,
            dims,
            new_type,
            new_bytes,
            imatrix,
        });
    }

    let t0 = Instant::now();
    if args.dry_run {
        report(&src, &jobs, None, plan.threads)?;
    } else {
        write_model(&src, &jobs, &plan, importance.as_ref())?;
    }
    if recipe.n_fallback > 0 {
        eprintln!(
            "quantize: WARNING: {} of {} tensor(s) required fallback quantization",
            recipe.n_fallback,
            jobs.len()
        );
    }
    eprintln!(
        "quantize: {} in {:.2} s{}",
        plan.ftype_name,
        t0.elapsed().as_secs_f64(),
        if args.dry_run {
            String::new()
        } else {
            format!(" -> {}", plan.output.display())
        }
    );
    Ok(())
}

/// Refuses what llama.cpp refuses before any byte is written: requantizing without
/// `--allow-requantize`, and types this crate cannot produce.
fn check_conversion(
    t: &TensorInfo,
    new_type: GgmlType,
    allow_requantize: bool,
) -> anyhow::Result<()> {
    if recipe::is_quantized(t.ty) && !allow_requantize {
        bail!(
            "requantizing from type {} is disabled (tensor '{}'; pass --allow-requantize)",
            t.ty,
            t.name
        );
    }
    if !quant::supports_dequantize(t.ty) {
        bail!(
            "cannot dequantize/convert tensor type {} ('{}')",
            t.ty,
            t.name
        );
    }
    if !quant::supports_quantize(new_type) {
        bail!(
            "tensor '{}': quantizing to {new_type} is not supported",
            t.name
        );
    }
    if !t.ne0().is_multiple_of(new_type.block_size()) {
        bail!(
            "tensor '{}': rows of {} values do not fit {new_type} blocks of {}",
            t.name,
            t.ne0(),
            new_type.block_size()
        );
    }
    Ok(())
}

fn same_file(a: &Path, b: &Path) -> bool {
    match (a.canonicalize(), b.canonicalize()) {
        (Ok(x), Ok(y)) => x == y,
        _ => false,
    }
}

fn mib(b: u64) -> f64 {
    b as f64 / 1024.0 / 1024.0
}

/// llama.cpp's `llama_format_tensor_shape`: four dimensions, `%5d` each.
fn shape(dims: &[u64]) -> String {
    (0..4)
        .map(|i| format!("{:5}", dims.get(i).copied().unwrap_or(1)))
        .collect::<Vec<_>>()
        .join(", ")
}

fn tensor_line(i: usize, n: usize, job: &Job) -> String {
    let t = job.info;
    let head = format!(
        "[{:4}/{:4}] {:<36} - [{}], type = {:>6}, ",
        i + 1,
        n,
        t.name,
        shape(&t.dims),
        t.ty.name()
    );
    if job.new_type == t.ty {
        format!("{head}size = {:8.3} MiB", mib(t.n_bytes))
    } else {
        format!(
            "{head}converting to {} .. size = {:8.2} MiB -> {:8.2} MiB",
            job.new_type,
            mib(t.n_bytes),
            mib(job.new_bytes)
        )
    }
}

/// Progress: one llama-quantize-style line per tensor, and a bar on a terminal.
struct Progress {
    bar: Option<indicatif::ProgressBar>,
}

impl Progress {
    fn new(total_bytes: u64) -> Self {
        let bar = std::io::stderr().is_terminal().then(|| {
            let b = indicatif::ProgressBar::new(total_bytes);
            b.set_style(
                indicatif::ProgressStyle::with_template(
                    "{bar:40} {bytes}/{total_bytes} {elapsed}<{eta} {msg}",
                )
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
            );
            b
        });
        Progress { bar }
    }
    fn line(&self, s: &str) {
        match &self.bar {
            Some(b) => b.println(s),
            None => eprintln!("{s}"),
        }
    }
    fn start(&self, name: &str) {
        if let Some(b) = &self.bar {
            b.set_message(name.to_string());
        }
    }
    fn advance(&self, bytes: u64) {
        if let Some(b) = &self.bar {
            b.inc(bytes);
        }
    }
    fn finish(&self) {
        if let Some(b) = &self.bar {
            b.finish_and_clear();
        }
    }
}

/// Converts each tensor in order, sending its bytes to `out` (None: a dry run).
fn report(
    src: &GgufFile,
    jobs: &[Job],
    mut out: Option<(&mut dyn Write, u64)>,
    threads: usize,
) -> anyhow::Result<()> {
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads.max(1))
        .build()
        .context("starting the worker threads")?;
    let progress = Progress::new(jobs.iter().map(|j| j.info.n_bytes).sum());
    let (mut size_org, mut size_new, mut n_elements) = (0u64, 0u64, 0u64);
    for (i, job) in jobs.iter().enumerate() {
        let t = job.info;
        progress.start(&t.name);
        if let Some((out, align)) = out.as_mut() {
            let data = src.tensor_data(t);
            if job.new_type == t.ty {
                out.write_all(data)?;
            } else {
                let q = pool.install(|| convert(t, data, job.new_type, job.imatrix))?;
                out.write_all(&q)?;
            }
            let pad = job.new_bytes.next_multiple_of(*align) - job.new_bytes;
            out.write_all(&vec![0u8; pad as usize])?;
        }
        progress.line(&tensor_line(i, jobs.len(), job));
        progress.advance(t.n_bytes);
        size_org += t.n_bytes;
        size_new += job.new_bytes;
        n_elements += t.n_elements();
    }
    progress.finish();
    let bpw = |b: u64| b as f64 * 8.0 / n_elements.max(1) as f64;
    eprintln!(
        "quantize: model size  = {:8.2} MiB ({:.2} BPW)",
        mib(size_org),
        bpw(size_org)
    );
    eprintln!(
        "quantize: quant size  = {:8.2} MiB ({:.2} BPW)",
        mib(size_new),
        bpw(size_new)
    );
    Ok(())
}

/// Dequantizes and requantizes one tensor, row chunks spread over the pool's threads. Every
/// row is quantized on its own, so the bytes do not depend on the number of threads. With
/// importance weights, each row takes its expert's (`ne1` rows per expert); chunks never
/// cross an expert boundary, as llama.cpp's.
fn convert(
    t: &TensorInfo,
    data: &[u8],
    new_type: GgmlType,
    imatrix: Option<&[f32]>,
) -> anyhow::Result<Vec<u8>> {
    let ne0 = t.ne0();
    let rows = t.n_rows();
    let rows_per_expert = (t.dims.get(1).copied().unwrap_or(1) as usize).max(1);
    let row_src = t.ty.bytes_for(ne0 as u64).context("row size")? as usize;
    let row_dst = new_type.bytes_for(ne0 as u64).context("row size")? as usize;
    // llama.cpp's chunk: at least 32*512 values, whole rows.
    let mut rows_per_chunk = (32 * 512usize).div_ceil(ne0.max(1)).max(1);
    if imatrix.is_some() {
        rows_per_chunk = rows_per_chunk.min(rows_per_expert);
    }
    // chunk starts: every rows_per_chunk rows within each expert
    let mut starts = Vec::new();
    for e0 in (0..rows).step_by(if imatrix.is_some() {
        rows_per_expert
    } else {
        rows.max(1)
    }) {
        let end = if imatrix.is_some() {
            (e0 + rows_per_expert).min(rows)
        } else {
            rows
        };
        starts.extend(
            (e0..end)
                .step_by(rows_per_chunk)
                .map(|r| (r, (r + rows_per_chunk).min(end))),
        );
    }
    let mut out = vec![0u8; rows * row_dst];
    let mut pieces: Vec<(usize, usize, &mut [u8])> = Vec::with_capacity(starts.len());
    let mut rest: &mut [u8] = &mut out;
    for &(r0, r1) in &starts {
        let (head, tail) = rest.split_at_mut((r1 - r0) * row_dst);
        pieces.push((r0, r1, head));
        rest = tail;
    }
    pieces
        .into_par_iter()
        .try_for_each(|(r0, r1, dst)| -> anyhow::Result<()> {
            let s = &data[r0 * row_src..r1 * row_src];
            let mut f = vec![0f32; (r1 - r0) * ne0];
            quant::dequantize(t.ty, s, &mut f)
                .with_context(|| format!("decoding tensor '{}'", t.name))?;
            let qw = imatrix.map(|w| {
                let e = r0 / rows_per_expert;
                &w[e * ne0..(e + 1) * ne0]
            });
            quant::quantize_rows(new_type, &f, dst, ne0, qw)
                .with_context(|| format!("encoding tensor '{}'", t.name))?;
            Ok(())
        })?;
    Ok(out)
}

/// The output metadata: the input's keys in order, without the split keys, then
/// `general.quantization_version` and `general.file_type` (llama.cpp's gguf_set_val_u32
/// removes a key and appends it), then with an importance matrix llama-quantize's
/// `quantize.imatrix.*` keys (its KV overrides, set the same way).
fn out_metadata(src: &GgufFile, ftype: Ftype, imp: Option<&Importance>) -> Vec<(String, Value)> {
    let mut add: Vec<(String, Value)> = vec![
        ("general.quantization_version".into(), Value::U32(2)),
        ("general.file_type".into(), Value::U32(ftype.id())),
    ];
    if let Some(imp) = imp {
        // (llama.cpp copies override strings into 128-byte buffers)
        let clip = |s: &str| {
            let mut n = s.len().min(127);
            while !s.is_char_boundary(n) {
                n -= 1;
            }
            s[..n].to_string()
        };
        add.push((
            "quantize.imatrix.file".into(),
            Value::String(clip(&imp.file)),
        ));
        if let Some(d) = &imp.dataset {
            add.push(("quantize.imatrix.dataset".into(), Value::String(clip(d))));
        }
        add.push((
            "quantize.imatrix.entries_count".into(),
            Value::U32(imp.weights.len() as u32),
        ));
        if imp.chunks > 0 {
            add.push((
                "quantize.imatrix.chunks_count".into(),
                Value::U32(imp.chunks as u32),
            ));
        }
    }
    const SPLIT: [&str; 3] = ["split.no", "split.count", "split.tensors.count"];
    let mut kv: Vec<(String, Value)> = src
        .metadata()
        .iter()
        .filter(|(k, _)| !SPLIT.contains(&k.as_str()) && !add.iter().any(|(a, _)| a == k))
        .cloned()
        .collect();
    kv.extend(add);
    kv
}

fn write_model(
    src: &GgufFile,
    jobs: &[Job],
    plan: &Plan,
    imp: Option<&Importance>,
) -> anyhow::Result<()> {
    let align = src.alignment();
    let meta = out_metadata(src, plan.ftype, imp);
    let mut header = Vec::new();
    header.extend_from_slice(b"GGUF");
    header.extend_from_slice(&3u32.to_le_bytes());
    header.extend_from_slice(&(jobs.len() as u64).to_le_bytes());
    header.extend_from_slice(&(meta.len() as u64).to_le_bytes());
    for (k, v) in &meta {
        put_str(&mut header, k);
        header.extend_from_slice(&(v.value_type() as u32).to_le_bytes());
        put_value(&mut header, v)?;
    }
    let mut offset = 0u64;
    for j in jobs {
        put_str(&mut header, &j.info.name);
        header.extend_from_slice(&(j.dims.len() as u32).to_le_bytes());
        for d in &j.dims {
            header.extend_from_slice(&d.to_le_bytes());
        }
        header.extend_from_slice(&j.new_type.id().to_le_bytes());
        header.extend_from_slice(&offset.to_le_bytes());
        offset += j.new_bytes.next_multiple_of(align);
    }
    header.resize(header.len().next_multiple_of(align as usize), 0);

    let file = File::create(&plan.output)
        .with_context(|| format!("cannot create '{}'", plan.output.display()))?;
    let written = (|| -> anyhow::Result<()> {
        let mut w = BufWriter::with_capacity(8 << 20, file);
        w.write_all(&header)?;
        report(src, jobs, Some((&mut w, align)), plan.threads)?;
        let mut file = w.into_inner().map_err(|e| e.into_error())?;
        let end = file.stream_position()?;
        let expected = header.len() as u64 + offset;
        if end != expected {
            bail!("wrote {end} bytes, expected {expected}");
        }
        file.sync_all().ok();
        Ok(())
    })();
    if written.is_err() {
        // (a half-written model is worse than none)
        let _ = std::fs::remove_file(&plan.output);
    }
    written.with_context(|| format!("writing '{}'", plan.output.display()))
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

/// A metadata value as GGUF stores it (what `gguf_write_to_buf` writes).
fn put_value(out: &mut Vec<u8>, v: &Value) -> anyhow::Result<()> {
    match v {
        Value::U8(x) => out.push(*x),
        Value::I8(x) => out.push(*x as u8),
        Value::U16(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I16(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::U32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::F32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::Bool(x) => out.push(u8::from(*x)),
        Value::String(s) => put_str(out, s),
        Value::U64(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I64(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::F64(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::Array(elem, items) => {
            if *elem == ValueType::Array {
                bail!("nested metadata arrays cannot be written");
            }
            out.extend_from_slice(&(*elem as u32).to_le_bytes());
            out.extend_from_slice(&(items.len() as u64).to_le_bytes());
            for item in items {
                put_value(out, item)?;
            }
        }
    }
    Ok(())
}
