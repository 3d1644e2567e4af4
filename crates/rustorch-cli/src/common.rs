//! What several subcommands share: finding and loading a model (with a spinner on a
//! terminal), sampling flags, threads, logging.

use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use rustorch_core::gguf::GgufFile;
use rustorch_core::kernels::physical_cores;
use rustorch_llm::chat::ChatTemplate;
use rustorch_llm::grammar::{GrammarEngine, GrammarSpec};
use rustorch_llm::kv_cache::{parse_kv_type, KvTypes};
use rustorch_llm::sampler::{Sampler, SamplerParams};
use rustorch_llm::tokenizer::Tokenizer;
use rustorch_llm::{Model, Placement};

/// The model used when `-m` is not given.
pub const DEFAULT_MODEL: &str = "models/SmolLM2-135M-Instruct.Q4_1.gguf";

/// `-m` or the default model, which must exist.
pub fn resolve_model(model: Option<&Path>) -> anyhow::Result<PathBuf> {
    match model {
        Some(p) => {
            if !p.exists() {
                bail!("model file '{}' not found", p.display());
            }
            Ok(p.to_path_buf())
        }
        None => {
            let p = PathBuf::from(DEFAULT_MODEL);
            if !p.exists() {
                bail!(
                    "the default model '{DEFAULT_MODEL}' is not there; fetch it with \
                     `scripts/fetch-models.sh` or pass another with -m PATH"
                );
            }
            Ok(p)
        }
    }
}

/// llama.cpp's escape processing of prompts (`-e/--escape`, on by default): `\n \r \t \'
/// \" \\` and `\xNN`, byte for byte as its `string_process_escapes` (an unknown escape, or
/// `\x` without two hex digits, stays as written).
#[derive(clap::Args, Debug, Clone, Default)]
pub struct EscapeArgs {
    /// Process escapes in the prompt (default)
    #[arg(short = 'e', long = "escape")]
    pub escape: bool,
    /// Take the prompt literally
    #[arg(long = "no-escape", conflicts_with = "escape")]
    pub no_escape: bool,
}

impl EscapeArgs {
    /// `text` with escapes processed unless `--no-escape`.
    pub fn apply(&self, text: &[u8]) -> Vec<u8> {
        if self.no_escape {
            text.to_vec()
        } else {
            process_escapes(text)
        }
    }
}

/// The two characters after `\x` as C's `strtol(s, &end, 16)` reads them, when it reads
/// both (leading white space, a sign, hex digits): the byte value, or `None`.
fn strtol_hex2(s: [u8; 2]) -> Option<u8> {
    let mut i = 0;
    while i < 2 && matches!(s[i], b' ' | b'\t' | b'\n' | 0x0b | 0x0c | b'\r') {
        i += 1;
    }
    let neg = i < 2 && s[i] == b'-';
    if i < 2 && (s[i] == b'-' || s[i] == b'+') {
        i += 1;
    }
    let start = i;
    let mut v: i64 = 0;
    while i < 2 {
        match (s[i] as char).to_digit(16) {
            Some(d) => v = v * 16 + d as i64,
            None => break,
        }
        i += 1;
    }
    if i == start || i != 2 {
        return None;
    }
    Some((if neg { -v } else { v }) as u8)
}

/// llama.cpp's `string_process_escapes`.
pub fn process_escapes(input: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(input.len());
    let n = input.len();
    let mut i = 0;
    while i < n {
        if input[i] == b'\\' && i + 1 < n {
            i += 1;
            match input[i] {
                b'n' => out.push(b'\n'),
                b'r' => out.push(b'\r'),
                b't' => out.push(b'\t'),
                b'\'' => out.push(b'\''),
                b'"' => out.push(b'"'),
                b'\\' => out.push(b'\\'),
                b'x' if i + 2 < n => match strtol_hex2([input[i + 1], input[i + 2]]) {
                    Some(v) => {
                        out.push(v);
                        i += 2;
                    }
                    None => out.extend_from_slice(b"\\x"),
                },
                c => {
                    out.push(b'\\');
                    out.push(c);
                }
            }
        } else {
            out.push(input[i]);
        }
        i += 1;
    }
    out
}

/// Where the model runs and how its KV cache is kept (run, chat, serve, bench, perplexity).
#[derive(clap::Args, Debug, Clone)]
pub struct DeviceArgs {
    /// auto (the GPU when there is one), cpu, cuda or cuda:N
    #[arg(long = "device", default_value = "auto")]
    pub device: String,
    /// Layers on the GPU, as llama.cpp's -ngl: 0 = all on the CPU, the layer count or more
    /// = all on the GPU (a split is not supported yet)
    #[arg(long = "n-gpu-layers", visible_alias = "gpu-layers")]
    pub n_gpu_layers: Option<usize>,
    /// KV cache type of the keys (`-ctk`): f32, f16, q8_0, q4_0, q4_1, q5_0, q5_1, iq4_nl
    #[arg(long = "cache-type-k", default_value = "f16")]
    pub cache_type_k: String,
    /// KV cache type of the values (`-ctv`): f32, f16, q8_0, q4_0, q4_1, q5_0, q5_1, iq4_nl
    #[arg(long = "cache-type-v", default_value = "f16")]
    pub cache_type_v: String,
    /// Flash attention (`-fa`), accepted as llama.cpp takes it: on, auto (attention is always
    /// computed as llama.cpp's CPU flash attention computes it; off is refused)
    #[arg(long = "flash-attn", default_value = "auto")]
    pub flash_attn: String,
    /// Compute on the CPU from a memory map of the file (less memory, about 15% slower
    /// decoding) instead of a copy read into memory backed by huge pages, which is the
    /// default when the model fits in half the available memory
    #[arg(long = "mmap")]
    pub mmap: bool,
    /// On the GPU, compute as the CPU backend does, bit for bit: the CPU's logits and text
    /// exactly for weights in Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K and Q6_K, SwiGLU models,
    /// prompt batches under 64 tokens, an x86-64 host (start-up names what a model lacks);
    /// decoding about 2x slower (also `RUSTORCH_CUDA_EXACT=1`)
    #[arg(long = "gpu-exact")]
    pub gpu_exact: bool,
}

impl Default for DeviceArgs {
    fn default() -> Self {
        DeviceArgs {
            device: "auto".to_string(),
            n_gpu_layers: None,
            cache_type_k: "f16".to_string(),
            cache_type_v: "f16".to_string(),
            flash_attn: "auto".to_string(),
            mmap: false,
            gpu_exact: false,
        }
    }
}

impl DeviceArgs {
    /// The file `gguf` (opened mapped) as the CPU backend should read it at `placement`:
    /// read into memory with huge pages (see [`GgufFile::open_in_memory`]) unless `--mmap`,
    /// a GPU placement, or a model larger than half the available memory keeps the map.
    pub fn cpu_weights(
        &self,
        path: &Path,
        gguf: Arc<GgufFile>,
        placement: Placement,
    ) -> anyhow::Result<Arc<GgufFile>> {
        if self.mmap || placement != Placement::Cpu {
            return Ok(gguf);
        }
        if mem_available().is_some_and(|avail| gguf.file_size() > avail / 2) {
            return Ok(gguf);
        }
        let context = || format!("reading '{}' into memory", path.display());
        // the parsed header is reused when nothing else holds the file yet
        let file = match Arc::try_unwrap(gguf) {
            Ok(file) => file.into_memory(path).with_context(context)?,
            Err(_) => GgufFile::open_in_memory(path).with_context(context)?,
        };
        Ok(Arc::new(file))
    }

    /// Applies the flags that act on a loaded model (`--gpu-exact`, saying on stderr what
    /// it does not cover for this model).
    pub fn configure(&self, model: &Model, gguf: &GgufFile) {
        if !self.gpu_exact {
            return;
        }
        model.set_cuda_exact(true);
        if model.backend_name() == "CPU" {
            return;
        }
        let gaps = exact_gaps(model, gguf);
        if !gaps.is_empty() {
            eprintln!(
                "--gpu-exact: not bit for bit for this model ({}): those ops agree with the CPU \
                 to rounding only",
                gaps.join("; ")
            );
        }
        eprintln!(
            "--gpu-exact: a prompt of 64 or more tokens in one batch is computed to rounding \
             (the CPU's long-prompt attention order is not reproduced), and so is what follows it"
        );
    }

    /// The KV cache types `-ctk` / `-ctv` name; an unknown name is an error listing the
    /// valid ones.
    pub fn cache_types(&self) -> anyhow::Result<KvTypes> {
        // checked here, where every command that takes these flags reads them
        match self.flash_attn.trim().to_ascii_lowercase().as_str() {
            "on" | "auto" | "1" | "true" | "enabled" => {}
            "off" | "0" | "false" | "disabled" => bail!(
                "-fa/--flash-attn {}: rustorch computes attention as llama.cpp's flash \
                 attention only (on or auto)",
                self.flash_attn
            ),
            other => bail!("-fa/--flash-attn {other}: expected on, off or auto"),
        }
        let k = parse_kv_type(&self.cache_type_k)
            .map_err(|e| anyhow::anyhow!("-ctk/--cache-type-k: {e}"))?;
        let v = parse_kv_type(&self.cache_type_v)
            .map_err(|e| anyhow::anyhow!("-ctv/--cache-type-v: {e}"))?;
        Ok(KvTypes { k, v })
    }

    /// The placement these flags ask for, for a model of `n_layer` layers. `auto` without a
    /// usable GPU, or with a KV cache type other than f16, is the CPU; an explicit `cuda`
    /// without one is an error naming what is missing.
    pub fn placement(&self, n_layer: usize) -> anyhow::Result<Placement> {
        let d = self.device.trim().to_ascii_lowercase();
        let explicit = match d.as_str() {
            "auto" => None,
            "cpu" => Some(Placement::Cpu),
            "cuda" | "gpu" => Some(Placement::Cuda(0)),
            other => match other.strip_prefix("cuda:") {
                Some(n) => Some(Placement::Cuda(n.parse().with_context(|| {
                    format!("--device {other}: '{n}' is not a device index")
                })?)),
                None => bail!("--device {other}: expected auto, cpu, cuda or cuda:N"),
            },
        };
        match self.n_gpu_layers {
            Some(0) => {
                if matches!(explicit, Some(Placement::Cuda(_))) {
                    bail!("--device {d} with -ngl 0: nothing would run on the GPU");
                }
                return Ok(Placement::Cpu);
            }
            Some(n) if n < n_layer => bail!(
                "-ngl {n}: splitting layers between GPU and CPU is not supported yet; use \
                 -ngl 0 (CPU) or -ngl {n_layer} or more (all {n_layer} layers on the GPU)"
            ),
            _ => {}
        }
        match explicit {
            Some(p) => Ok(p),
            None if self.n_gpu_layers.is_some() => Ok(Placement::Cuda(0)),
            // `auto` with a KV cache type the GPU backend does not keep (only f16) is the CPU
            None if self.cache_types().is_ok_and(|t| !t.is_f16()) => Ok(Placement::Cpu),
            None => Ok(match rustorch_cuda::device_count() {
                Ok(n) if n > 0 => Placement::Cuda(0),
                _ => Placement::Cpu,
            }),
        }
    }
}

/// What `--gpu-exact` does not compute bit for bit for this model: weight formats without an
/// exact product, GeGLU and soft-capping (gemma), a CPU other than x86-64 (whose kernels the
/// GPU does not follow).
fn exact_gaps(model: &Model, gguf: &GgufFile) -> Vec<String> {
    use rustorch_core::GgmlType::*;
    let mut gaps = Vec::new();
    let mut types: Vec<String> = gguf
        .tensors()
        .iter()
        .filter(|t| t.dims.len() == 2)
        .filter(|t| {
            let covered = matches!(t.ty, Q4_0 | Q4_1 | Q5_0 | Q5_1 | Q8_0 | Q6_K)
                || (t.ty == Q4_K && t.dims[1] % 8 == 0);
            !covered
        })
        .map(|t| format!("{}", t.ty))
        .collect();
    types.sort();
    types.dedup();
    if !types.is_empty() {
        gaps.push(format!("{} matrices", types.join(", ")));
    }
    if model.hparams().arch_name.starts_with("gemma") {
        gaps.push("GeGLU and soft-capping".into());
    }
    if !cfg!(target_arch = "x86_64") {
        gaps.push("a CPU other than x86-64".into());
    }
    gaps
}

/// `MemAvailable` of `/proc/meminfo` in bytes, where there is one.
fn mem_available() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// A model, its vocabulary and how long loading took.
pub struct Loaded {
    pub gguf: Arc<GgufFile>,
    pub model: Model,
    pub tokenizer: Tokenizer,
    pub load_time: Duration,
}

/// Opens, maps and checks the model, with a spinner on stderr when it is a terminal, on the
/// device `dev` asks for (`None`: the CPU); `n_ctx` sizes the check that it fits. On a GPU,
/// says on stderr where the model runs and what it takes.
pub fn load(path: &Path, dev: Option<&DeviceArgs>, n_ctx: usize) -> anyhow::Result<Loaded> {
    let t0 = Instant::now();
    let spinner = std::io::stderr().is_terminal().then(|| {
        let s = indicatif::ProgressBar::new_spinner();
        s.set_message(format!("loading {}", path.display()));
        s.enable_steady_tick(Duration::from_millis(80));
        s
    });
    // a misspelt cache type fails before the model loads
    let types = dev.map(DeviceArgs::cache_types).transpose()?;
    let result = (|| -> anyhow::Result<Loaded> {
        let gguf = Arc::new(
            GgufFile::open(path).with_context(|| format!("loading '{}'", path.display()))?,
        );
        let tokenizer = Tokenizer::from_gguf(&gguf).context("reading the vocabulary")?;
        let placement = match dev {
            Some(d) => {
                let hp = rustorch_llm::HParams::from_gguf(&gguf).context("loading the model")?;
                let n_ctx = if n_ctx == 0 { hp.n_ctx_train } else { n_ctx };
                let mut p = d.placement(hp.n_layer)?;
                // `auto`: a model the GPU backend cannot run yet stays on the CPU
                let auto = d.device.trim().eq_ignore_ascii_case("auto") && d.n_gpu_layers.is_none();
                if auto && hp.cpu_only().is_some() {
                    p = Placement::Cpu;
                }
                (p, n_ctx)
            }
            None => (Placement::Cpu, 0),
        };
        let gguf = match dev {
            Some(d) => d.cpu_weights(path, gguf, placement.0)?,
            None => gguf,
        };
        let mut model =
            Model::load_on(gguf.clone(), placement.0, placement.1).context("loading the model")?;
        if let Some(t) = types {
            model.set_cache_types(t)?;
        }
        if let Some(d) = dev {
            d.configure(&model, &gguf);
        }
        if model.backend_name() != "CPU" {
            let hp = model.hparams();
            let mib = |b: f64| b / (1024.0 * 1024.0);
            let weights = gguf.tensor_bytes();
            let kv = (placement.1 * hp.kv_bytes_per_cell()) as f64;
            eprintln!(
                "device: {}; weights {:.1} MiB, KV cache {:.1} MiB ({} cells, f16)",
                model.device_description(),
                mib(weights as f64),
                mib(kv),
                placement.1
            );
        }
        Ok(Loaded {
            gguf,
            model,
            tokenizer,
            load_time: Duration::ZERO,
        })
    })();
    if let Some(s) = spinner {
        s.finish_and_clear();
    }
    let mut loaded = result?;
    loaded.load_time = t0.elapsed();
    Ok(loaded)
}

/// The KV cache's size as llama.cpp prints it at start-up (`llama_kv_cache: size = ...`):
/// `KV cache: size =    5.98 MiB (  512 cells,  30 layers), K (q8_0):    2.99 MiB, V (q8_0):
/// 2.99 MiB`.
pub fn kv_cache_line(model: &Model, n_ctx: usize) -> String {
    let hp = model.hparams();
    let t = model.cache_types();
    let row = |ty| rustorch_core::kv_cache::row_bytes(ty, hp.kv_dim()) * hp.n_layer * n_ctx;
    let (k, v) = (row(t.k), row(t.v));
    let mib = |b: usize| b as f64 / (1024.0 * 1024.0);
    format!(
        "KV cache: size = {:7.2} MiB ({n_ctx:6} cells, {:3} layers), K ({}): {:7.2} MiB, V ({}): {:7.2} MiB",
        mib(k + v),
        hp.n_layer,
        t.k.name(),
        mib(k),
        t.v.name(),
        mib(v)
    )
}

/// The chat template: a built-in name or file given by the user, else the GGUF's own,
/// else chatml.
pub fn chat_template(
    gguf: &GgufFile,
    name: Option<&str>,
    file: Option<&Path>,
) -> anyhow::Result<ChatTemplate> {
    let own = ChatTemplate::from_gguf(gguf)?;
    let (bos, eos) = own
        .as_ref()
        .map(|t| (t.bos_token().to_string(), t.eos_token().to_string()))
        .unwrap_or_default();
    if let Some(f) = file {
        return Ok(ChatTemplate::from_file(f, bos, eos)?);
    }
    if let Some(n) = name {
        return Ok(ChatTemplate::from_name_or_file(n, bos, eos)?);
    }
    match own {
        Some(t) => Ok(t),
        None => Ok(ChatTemplate::builtin("chatml")?.with_special_tokens(bos, eos)),
    }
}

/// Thread count: `-t` or the number of physical cores.
pub fn threads(t: Option<usize>) -> usize {
    t.filter(|&n| n > 0).unwrap_or_else(physical_cores)
}

/// Context size: `-c`, or the model's training context when 0 / absent (llama.cpp).
pub fn ctx_size(c: Option<usize>, model: &Model) -> usize {
    match c {
        Some(n) if n > 0 => n,
        _ => model.hparams().n_ctx_train,
    }
}

/// Logging to stderr: warnings by default, debug with `--verbose`, or `RUST_LOG`.
pub fn init_logging(verbose: bool) {
    let default = if verbose { "debug" } else { "warn" };
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_target(false)
        .try_init();
}

/// Sampling flags, named as in llama.cpp.
#[derive(clap::Args, Debug, Clone)]
pub struct SamplingArgs {
    /// Random seed (default: random, printed with --verbose)
    #[arg(short = 's', long = "seed")]
    pub seed: Option<u64>,
    /// Temperature; 0 or below samples greedily
    #[arg(long = "temp", default_value_t = 0.8, allow_hyphen_values = true)]
    pub temp: f32,
    /// Top-k sampling (0 = off)
    #[arg(long = "top-k", default_value_t = 40, allow_hyphen_values = true)]
    pub top_k: i32,
    /// Top-p (nucleus) sampling (1.0 = off)
    #[arg(long = "top-p", default_value_t = 0.95)]
    pub top_p: f32,
    /// Min-p sampling (0.0 = off)
    #[arg(long = "min-p", default_value_t = 0.05)]
    pub min_p: f32,
    /// Locally typical sampling (1.0 = off)
    #[arg(long = "typical", default_value_t = 1.0)]
    pub typical: f32,
    /// Penalise repeated tokens (1.0 = off)
    #[arg(long = "repeat-penalty", default_value_t = 1.0)]
    pub repeat_penalty: f32,
    /// Tokens the penalties look back over (0 = off, -1 = context size)
    #[arg(
        long = "repeat-last-n",
        default_value_t = 64,
        allow_hyphen_values = true
    )]
    pub repeat_last_n: i64,
    /// Presence penalty (0.0 = off)
    #[arg(
        long = "presence-penalty",
        default_value_t = 0.0,
        allow_hyphen_values = true
    )]
    pub presence_penalty: f32,
    /// Frequency penalty (0.0 = off)
    #[arg(
        long = "frequency-penalty",
        default_value_t = 0.0,
        allow_hyphen_values = true
    )]
    pub frequency_penalty: f32,
    /// Bias a token's logit, e.g. `15043+1` or `15043-inf` (repeatable)
    #[arg(short = 'l', long = "logit-bias", allow_hyphen_values = true)]
    pub logit_bias: Vec<String>,
    /// Keep generating past end-of-generation tokens
    #[arg(long = "ignore-eos")]
    pub ignore_eos: bool,
}

impl SamplingArgs {
    pub fn to_params(&self, tokenizer: &Tokenizer, n_ctx: usize) -> anyhow::Result<SamplerParams> {
        let mut p = SamplerParams {
            seed: self.seed,
            temperature: self.temp,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            typical_p: self.typical,
            repeat_penalty: self.repeat_penalty,
            penalty_last_n: if self.repeat_last_n < 0 {
                n_ctx
            } else {
                self.repeat_last_n as usize
            },
            presence_penalty: self.presence_penalty,
            frequency_penalty: self.frequency_penalty,
            ignore_eos: self.ignore_eos,
            eog_tokens: tokenizer.eog_ids().collect(),
            ..SamplerParams::default()
        };
        for b in &self.logit_bias {
            let (id, bias) = parse_logit_bias(b)?;
            if id as usize >= tokenizer.n_vocab() {
                bail!(
                    "--logit-bias '{b}': token {id} is beyond the vocabulary ({} tokens)",
                    tokenizer.n_vocab()
                );
            }
            p.logit_bias.insert(id, bias);
        }
        p.validate()?;
        Ok(p)
    }
}

/// Constrained generation flags, named as in llama.cpp (`-j` is `--json-schema`).
#[derive(clap::Args, Debug, Clone, Default)]
pub struct GrammarArgs {
    /// GBNF grammar the output must follow (llama.cpp's format)
    #[arg(long = "grammar", allow_hyphen_values = true)]
    pub grammar: Option<String>,
    /// File holding a GBNF grammar
    #[arg(long = "grammar-file")]
    pub grammar_file: Option<PathBuf>,
    /// JSON schema the output must follow, e.g. `{}` for any JSON value
    #[arg(short = 'j', long = "json-schema", allow_hyphen_values = true)]
    pub json_schema: Option<String>,
    /// File holding a JSON schema
    #[arg(long = "json-schema-file")]
    pub json_schema_file: Option<PathBuf>,
}

impl GrammarArgs {
    /// The grammar these flags give, checked; `None` without any. At most one may be
    /// given.
    pub fn spec(&self) -> anyhow::Result<Option<GrammarSpec>> {
        let given = [
            self.grammar.is_some(),
            self.grammar_file.is_some(),
            self.json_schema.is_some(),
            self.json_schema_file.is_some(),
        ];
        if given.iter().filter(|&&g| g).count() > 1 {
            bail!(
                "give at most one of --grammar, --grammar-file, -j/--json-schema, --json-schema-file"
            );
        }
        let read = |f: &Path, what: &str| {
            std::fs::read_to_string(f)
                .with_context(|| format!("cannot read the {what} file '{}'", f.display()))
        };
        let schema = |text: &str, from: &str| -> anyhow::Result<GrammarSpec> {
            let v: serde_json::Value = serde_json::from_str(text)
                .with_context(|| format!("{from}: the JSON schema is not valid JSON"))?;
            Ok(GrammarSpec::JsonSchema(v))
        };
        Ok(if let Some(g) = &self.grammar {
            Some(GrammarSpec::Gbnf(g.clone()))
        } else if let Some(f) = &self.grammar_file {
            Some(GrammarSpec::Gbnf(read(f, "grammar")?))
        } else if let Some(s) = &self.json_schema {
            Some(schema(s, "--json-schema")?)
        } else if let Some(f) = &self.json_schema_file {
            Some(schema(&read(f, "JSON schema")?, &f.display().to_string())?)
        } else {
            None
        })
    }

    /// Compiles the grammar for `tokenizer`'s vocabulary into `sampler`; an invalid
    /// grammar or schema is an error naming the flag and the problem.
    pub fn install(&self, tokenizer: &Tokenizer, sampler: &mut Sampler) -> anyhow::Result<()> {
        let Some(spec) = self.spec()? else {
            return Ok(());
        };
        let flag = if self.grammar.is_some() {
            "--grammar".to_string()
        } else if let Some(f) = &self.grammar_file {
            format!("--grammar-file {}", f.display())
        } else if self.json_schema.is_some() {
            "--json-schema".to_string()
        } else {
            format!(
                "--json-schema-file {}",
                self.json_schema_file
                    .as_deref()
                    .unwrap_or(Path::new(""))
                    .display()
            )
        };
        let engine = GrammarEngine::new(Arc::new(tokenizer.clone()));
        let c = engine.compile(&spec).with_context(|| flag)?;
        sampler.set_grammar(Some(c));
        Ok(())
    }
}

/// Parses llama.cpp's `ID(+|-)BIAS` form (`15043+1`, `15043-inf`).
pub fn parse_logit_bias(s: &str) -> anyhow::Result<(u32, f32)> {
    let at = s
        .find(['+', '-'])
        .with_context(|| format!("--logit-bias '{s}': expected TOKEN_ID+BIAS or TOKEN_ID-BIAS"))?;
    let id: u32 = s[..at]
        .trim()
        .parse()
        .with_context(|| format!("--logit-bias '{s}': '{}' is not a token id", &s[..at]))?;
    let bias: f32 = s[at..]
        .trim()
        .parse()
        .with_context(|| format!("--logit-bias '{s}': '{}' is not a number", &s[at..]))?;
    Ok((id, bias))
}

/// llama.cpp's multi-letter single-dash flags (`-sys`, `-np`, ...) as long options, since
/// the argument parser only knows one-letter short flags.
pub fn expand_llama_aliases(args: impl Iterator<Item = String>) -> Vec<String> {
    args.map(|a| {
        match a.as_str() {
            "-sys" => "--system-prompt",
            "-np" => "--parallel",
            "-cnv" => "--conversation",
            "-no-cnv" => "--no-conversation",
            "-st" => "--single-turn",
            "-fa" => "--flash-attn",
            "-ngl" => "--n-gpu-layers",
            "-ctk" => "--cache-type-k",
            "-ctv" => "--cache-type-v",
            "-ub" => "--ubatch-size",
            "-ofreq" => "--output-frequency",
            _ => return a,
        }
        .to_string()
    })
    .collect()
}

/// llama.cpp-style timing lines for stderr.
pub fn timings(
    load: Duration,
    prompt_tokens: usize,
    prompt: Duration,
    gen_tokens: usize,
    gen: Duration,
) -> String {
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let rate = |n: usize, d: Duration| {
        if n == 0 || d.is_zero() {
            (0.0, 0.0)
        } else {
            (ms(d) / n as f64, n as f64 / d.as_secs_f64())
        }
    };
    let (pp_ms, pp_ts) = rate(prompt_tokens, prompt);
    let (tg_ms, tg_ts) = rate(gen_tokens, gen);
    format!(
        "rustorch:        load time = {:10.2} ms\n\
         rustorch: prompt eval time = {:10.2} ms / {prompt_tokens:5} tokens ({pp_ms:8.2} ms per token, {pp_ts:8.2} tokens per second)\n\
         rustorch:        eval time = {:10.2} ms / {gen_tokens:5} runs   ({tg_ms:8.2} ms per token, {tg_ts:8.2} tokens per second)\n\
         rustorch:       total time = {:10.2} ms / {:5} tokens",
        ms(load),
        ms(prompt),
        ms(gen),
        ms(load + prompt + gen),
        prompt_tokens + gen_tokens
    )
}
