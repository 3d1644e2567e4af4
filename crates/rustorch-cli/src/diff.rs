//! `rustorch diff`: one prompt through two backends (or ours against a llama.cpp tensor
//! dump), every intermediate tensor compared in graph order, naming the first operation
//! whose difference passes the tolerance.
//!
//! ```text
//! rustorch diff -p "The capital of France is" --a cpu --b cuda
//! rustorch diff -p "..." --b dir:/tmp/llama-dump      # scripts/dump_llama_tensors.py --dir
//! ```

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use anyhow::{bail, Context};
use clap::Args as ClapArgs;
use rustorch_core::gguf::GgufFile;
use rustorch_llm::model::Fault;
use rustorch_llm::tokenizer::Tokenizer;
use rustorch_llm::{Batch, Model, Placement, Runtime};

use crate::common::{self, DeviceArgs};

#[derive(ClapArgs, Debug)]
pub struct Args {
    /// GGUF model (default: models/SmolLM2-135M-Instruct.Q4_1.gguf)
    #[arg(short = 'm', long = "model")]
    pub model: Option<PathBuf>,
    /// The prompt (tokenized with BOS as `run` does)
    #[arg(short = 'p', long = "prompt")]
    pub prompt: String,
    /// First side: cpu, cuda, cuda:N
    #[arg(long = "a", default_value = "cpu")]
    pub a: String,
    /// Second side: cpu, cuda, cuda:N, or dir:PATH (NAME.f32 files of a llama.cpp dump)
    #[arg(long = "b", default_value = "cuda")]
    pub b: String,
    /// Relative tolerance: max |Δ| / max |a| of a tensor
    #[arg(long = "tol", default_value_t = 1e-2)]
    pub tol: f64,
    /// Threads for CPU sides (default: physical cores)
    #[arg(short = 't', long = "threads")]
    pub threads: Option<usize>,
    /// The GPU side computes as the CPU backend does, bit for bit (see `run --gpu-exact`)
    #[arg(long = "gpu-exact")]
    pub gpu_exact: bool,
    /// Print every tensor, not only up to the first past the tolerance
    #[arg(long = "all")]
    pub all: bool,
    /// Testing `diff` itself: plant a known bug in side b (`rope`: positions one off)
    #[arg(long = "fault-b", hide = true)]
    pub fault_b: Option<String>,
}

/// Tensors in graph order: (llama.cpp name with layer, values).
type Trace = Vec<(String, Vec<f32>)>;

/// Side b's tensor matching side a's `(name, values)`.
type Lookup = Box<dyn Fn(&str, &[f32]) -> Option<Vec<f32>>>;

fn run_side(
    gguf: &Arc<GgufFile>,
    spec: &str,
    tokens: &[u32],
    threads: usize,
    fault: Option<Fault>,
    exact: bool,
) -> anyhow::Result<Trace> {
    let placement = DeviceArgs {
        device: spec.to_string(),
        ..DeviceArgs::default()
    }
    .placement(usize::MAX)?;
    let placement = match placement {
        Placement::Cpu if spec.trim() != "cpu" => bail!("--a/--b {spec}: no GPU here"),
        p => p,
    };
    let model = Model::load_on(gguf.clone(), placement, tokens.len() + 1)
        .with_context(|| format!("loading the model on {spec}"))?;
    if exact {
        model.set_cuda_exact(true);
    }
    let trace: Arc<Mutex<Trace>> = Arc::default();
    let sink = trace.clone();
    let mut rt = Runtime::new(threads);
    rt.fault = fault;
    rt.tensor_hook = Some(Box::new(move |name, il, x| {
        let key = if name.starts_with("result") {
            name.to_string()
        } else {
            format!("{name}-{il}")
        };
        if let Ok(mut t) = sink.lock() {
            t.push((key, x.to_vec()));
        }
    }));
    let mut cache = model.new_cache(tokens.len() + 1);
    model
        .forward(&Batch::from_prompt(tokens, 0, 0, true), &mut cache, &rt)
        .with_context(|| format!("running the prompt on {spec}"))?;
    drop(rt);
    let t = trace
        .lock()
        .map_err(|_| anyhow::anyhow!("tensor trace poisoned"))?;
    Ok(t.clone())
}

/// llama.cpp's dump: `NAME.f32` per tensor; names repeated in its graph carry `#2`, `#3`.
fn read_dir(dir: &Path) -> anyhow::Result<HashMap<String, Vec<f32>>> {
    let mut out = HashMap::new();
    for e in std::fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))? {
        let p = e?.path();
        let Some(name) = p
            .file_name()
            .and_then(|n| n.to_str())
            .and_then(|n| n.strip_suffix(".f32"))
        else {
            continue;
        };
        let bytes = std::fs::read(&p)?;
        let v = bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        out.insert(name.to_string(), v);
    }
    if out.is_empty() {
        bail!("{}: no NAME.f32 tensor files", dir.display());
    }
    Ok(out)
}

/// Our name for a tensor llama.cpp names by its op's output (`Qcur_rope-0` is llama.cpp's
/// third `Qcur-0`); the candidates of the same base name and size, closest first.
fn match_dump<'a>(
    dump: &'a HashMap<String, Vec<f32>>,
    name: &str,
    ours: &[f32],
) -> Option<&'a [f32]> {
    let base = name
        .replace("Qcur_rope", "Qcur")
        .replace("Kcur_rope", "Kcur");
    dump.iter()
        .filter(|(k, v)| {
            (k.as_str() == base || k.starts_with(&format!("{base}#"))) && v.len() == ours.len()
        })
        .map(|(_, v)| (max_abs_diff(ours, v), v.as_slice()))
        .min_by(|a, b| a.0.total_cmp(&b.0))
        .map(|(_, v)| v)
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(&x, &y)| (x as f64 - y as f64).abs())
        .fold(0.0, f64::max)
}

pub fn run(args: Args) -> anyhow::Result<()> {
    common::init_logging(false);
    let path = common::resolve_model(args.model.as_deref())?;
    let gguf =
        Arc::new(GgufFile::open(&path).with_context(|| format!("loading '{}'", path.display()))?);
    let tok = Tokenizer::from_gguf(&gguf).context("reading the vocabulary")?;
    let tokens = tok.encode(&args.prompt, true, true)?;
    if tokens.is_empty() {
        bail!("the prompt has no tokens");
    }
    let threads = common::threads(args.threads);
    let fault = match args.fault_b.as_deref() {
        None => None,
        Some("rope") => Some(Fault::RopeOffByOne),
        Some(f) => bail!("--fault-b {f}: known faults: rope"),
    };
    let a = run_side(&gguf, &args.a, &tokens, threads, None, args.gpu_exact)?;
    let b: Lookup = match args.b.strip_prefix("dir:") {
        Some(dir) => {
            let dump = read_dir(Path::new(dir))?;
            Box::new(move |name, ours| match_dump(&dump, name, ours).map(<[f32]>::to_vec))
        }
        None => {
            let trace = run_side(&gguf, &args.b, &tokens, threads, fault, args.gpu_exact)?;
            let map: HashMap<String, Vec<f32>> = trace.into_iter().collect();
            Box::new(move |name, _| map.get(name).cloned())
        }
    };
    println!(
        "{} tokens; a = {}, b = {}; tolerance: max |Δ| / max |a| ≤ {:e}",
        tokens.len(),
        args.a,
        args.b,
        args.tol
    );
    println!(
        "{:<22} {:>9} {:>12} {:>12} {:>10}",
        "tensor", "values", "max |a|", "max |Δ|", "rel"
    );
    let mut first: Option<String> = None;
    let mut compared = 0;
    for (name, va) in &a {
        let Some(vb) = b(name, va) else {
            continue;
        };
        if vb.len() != va.len() {
            println!("{name:<22} sizes differ: {} vs {}", va.len(), vb.len());
            continue;
        }
        compared += 1;
        let d = max_abs_diff(va, &vb);
        let scale = va.iter().fold(0f64, |m, &x| m.max((x as f64).abs()));
        let rel = d / scale.max(1e-30);
        let bad = rel > args.tol || d.is_nan();
        let mark = if bad && first.is_none() {
            "  <-- first past the tolerance"
        } else {
            ""
        };
        if first.is_none() || args.all {
            println!(
                "{name:<22} {:>9} {scale:>12.4e} {d:>12.4e} {rel:>10.2e}{mark}",
                va.len()
            );
        }
        if bad && first.is_none() {
            first = Some(name.clone());
        }
    }
    if compared == 0 {
        bail!("no tensor of a was found in b");
    }
    match first {
        None => {
            println!("all {compared} tensors within the tolerance");
            Ok(())
        }
        Some(name) => bail!("first difference past the tolerance: {name}"),
    }
}
