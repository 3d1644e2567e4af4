//! `rustorch inspect FILE [--json] [--full]`: a GGUF file's header, metadata, tensor
//! directory, totals and an architecture summary, as tables (comparable to gguf-py's
//! `gguf-dump`) or as one JSON document.
//!
//! Long arrays (more than [`ARRAY_ITEMS`] items) and long strings (more than
//! [`STRING_CHARS`] characters) are shortened unless `--full` is given; in JSON a
//! shortened value carries `"truncated": true` and its full length in `n_items` /
//! `n_chars`.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::io::Write as _;
use std::path::{Path, PathBuf};

use anyhow::Context as _;
use rustorch_core::gguf::{GgufError, GgufFile, Value, ValueType};
use rustorch_core::GgmlType;
use rustorch_llm::Arch;
use serde::Serialize;
use serde_json::Value as Json;

/// Array items shown before an array is summarised.
const ARRAY_ITEMS: usize = 8;
/// Characters of a string shown before it is shortened.
const STRING_CHARS: usize = 64;
/// Characters of a string inside a shortened array.
const ITEM_CHARS: usize = 24;

#[derive(clap::Args)]
pub struct Args {
    /// GGUF file
    pub file: PathBuf,
    /// Print one JSON document instead of tables
    #[arg(long)]
    pub json: bool,
    /// Print arrays and long strings (the chat template, the vocabulary) in full
    #[arg(long)]
    pub full: bool,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let file = open(&args.file)?;
    let report = Report::new(&args.file, &file, args.full);
    let out = if args.json {
        let mut s = serde_json::to_string_pretty(&report)?;
        s.push('\n');
        s
    } else {
        report.to_text()?
    };
    let mut stdout = std::io::stdout().lock();
    match stdout
        .write_all(out.as_bytes())
        .and_then(|()| stdout.flush())
    {
        // `rustorch inspect … | head` is not an error.
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => Err(e.into()),
        _ => Ok(()),
    }
}

fn open(path: &Path) -> anyhow::Result<GgufFile> {
    match GgufFile::open(path) {
        Ok(f) => Ok(f),
        // These already name the path.
        Err(e @ (GgufError::Io { .. } | GgufError::IsDirectory(_))) => Err(e.into()),
        Err(e) => Err(e).with_context(|| format!("'{}' is not a valid GGUF file", path.display())),
    }
}

// ---------------------------------------------------------------------------
// The report (serialised as is for --json)
// ---------------------------------------------------------------------------

#[derive(Serialize)]
struct Report {
    file: String,
    file_size: u64,
    version: u32,
    alignment: u64,
    data_offset: u64,
    metadata_count: usize,
    tensor_count: usize,
    architecture: Architecture,
    metadata: Vec<MetaEntry>,
    tensors: Vec<TensorEntry>,
    totals: Totals,
}

#[derive(Serialize)]
struct MetaEntry {
    index: usize,
    key: String,
    #[serde(rename = "type")]
    ty: String,
    /// Number of items of an array (outer level).
    #[serde(skip_serializing_if = "Option::is_none")]
    n_items: Option<usize>,
    /// Length in characters of a string.
    #[serde(skip_serializing_if = "Option::is_none")]
    n_chars: Option<usize>,
    value: Json,
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    truncated: bool,
    #[serde(skip)]
    text: String,
}

#[derive(Serialize)]
struct TensorEntry {
    index: usize,
    name: String,
    #[serde(rename = "type")]
    ty: String,
    type_id: u32,
    /// ggml order: `shape[0]` is the row length.
    shape: Vec<u64>,
    n_elements: u64,
    /// Absolute file offset of the data.
    offset: u64,
    /// Offset relative to the data section, as stored in the file.
    relative_offset: u64,
    n_bytes: u64,
}

#[derive(Serialize)]
struct Totals {
    tensors: usize,
    parameters: u64,
    bytes: u64,
    bits_per_weight: Option<f64>,
    by_type: Vec<TypeTotal>,
}

#[derive(Serialize)]
struct TypeTotal {
    #[serde(rename = "type")]
    ty: String,
    tensors: usize,
    parameters: u64,
    bytes: u64,
}

#[derive(Serialize)]
struct Architecture {
    name: Option<String>,
    block_count: Option<Json>,
    embedding_length: Option<Json>,
    feed_forward_length: Option<Json>,
    head_count: Option<Json>,
    head_count_kv: Option<Json>,
    head_dim: Option<u64>,
    /// `key_length` or `embedding_length / head_count`.
    head_dim_source: Option<&'static str>,
    context_length: Option<Json>,
    rope_freq_base: Option<Json>,
    vocab_size: Option<u64>,
    /// `tokenizer.ggml.tokens` or `{arch}.vocab_size`.
    vocab_size_source: Option<String>,
    tokenizer: Option<String>,
    parameters: u64,
    /// How this engine runs the model: `null` fields where the feature is absent.
    engine: Engine,
}

/// What the engine reads from the metadata (the architecture's own rules applied: default
/// windows and layer patterns, soft-caps), or why it cannot run the file.
#[derive(Serialize, Default)]
struct Engine {
    /// `null` when the engine runs this architecture, else the reason.
    unsupported: Option<String>,
    sliding_window: Option<u32>,
    /// Layers attending over the whole context when others slide.
    global_layers: Option<Vec<usize>>,
    experts: Option<usize>,
    experts_used: Option<usize>,
    expert_feed_forward_length: Option<usize>,
    attn_logit_softcap: Option<f32>,
    final_logit_softcap: Option<f32>,
    /// How the chosen experts are weighted (when there are experts).
    expert_gating: Option<&'static str>,
    /// A learned logit per query head in every attention softmax (gpt-oss).
    attention_sinks: Option<bool>,
    /// YaRN RoPE scaling as the engine applies it.
    rope_yarn: Option<Yarn>,
}

/// YaRN as the engine applies it: positions scaled by `1 / factor`, angles of the pairs
/// from `ramp[0]` to `ramp[1]` mixed with the unscaled ones (unscaled below), cos and sin
/// times `magnitude`.
#[derive(Serialize)]
struct Yarn {
    factor: f32,
    ramp: [f32; 2],
    magnitude: f32,
}

impl Engine {
    fn new(f: &GgufFile) -> Self {
        let hp = match rustorch_llm::HParams::from_gguf(f) {
            Ok(hp) => hp,
            Err(e) => {
                return Engine {
                    unsupported: Some(e.to_string()),
                    ..Engine::default()
                }
            }
        };
        let some = |v: f32| (v != 0.0).then_some(v);
        Engine {
            unsupported: None,
            sliding_window: (hp.n_swa > 0).then_some(hp.n_swa),
            global_layers: (hp.n_swa > 0)
                .then(|| (0..hp.n_layer).filter(|&il| !hp.swa_layers[il]).collect()),
            experts: (hp.n_expert > 0).then_some(hp.n_expert),
            experts_used: (hp.n_expert > 0).then_some(hp.n_expert_used),
            expert_feed_forward_length: (hp.n_expert > 0).then_some(hp.n_ff_exp),
            attn_logit_softcap: some(hp.attn_softcap),
            final_logit_softcap: some(hp.final_softcap),
            expert_gating: (hp.n_expert > 0).then_some(if hp.arch == Arch::GptOss {
                "softmax of the chosen experts' logits (biased router, clamped SwiGLU experts)"
            } else {
                "softmax of all logits, the chosen renormalised"
            }),
            attention_sinks: hp.attn_sinks.then_some(true),
            rope_yarn: hp.rope.yarn.map(|y| Yarn {
                factor: 1.0 / hp.rope.freq_scale,
                ramp: y.corr_dims,
                magnitude: y.mscale,
            }),
        }
    }
}

impl Report {
    fn new(path: &Path, f: &GgufFile, full: bool) -> Self {
        let metadata = f
            .metadata()
            .iter()
            .enumerate()
            .map(|(index, (key, value))| MetaEntry::new(index, key, value, full))
            .collect();
        let tensors: Vec<TensorEntry> = f
            .tensors()
            .iter()
            .enumerate()
            .map(|(index, t)| TensorEntry {
                index,
                name: t.name.clone(),
                ty: t.ty.dump_name(),
                type_id: t.ty.id(),
                shape: t.dims.clone(),
                n_elements: t.n_elements(),
                offset: f.data_offset().saturating_add(t.offset),
                relative_offset: t.offset,
                n_bytes: t.n_bytes,
            })
            .collect();
        let totals = Totals::new(f);
        Report {
            file: path.display().to_string(),
            file_size: f.file_size(),
            version: f.version(),
            alignment: f.alignment(),
            data_offset: f.data_offset(),
            metadata_count: f.metadata().len(),
            tensor_count: f.tensors().len(),
            architecture: Architecture::new(f, totals.parameters),
            metadata,
            tensors,
            totals,
        }
    }
}

impl MetaEntry {
    fn new(index: usize, key: &str, value: &Value, full: bool) -> Self {
        let (json, truncated) = to_json(value, full, STRING_CHARS);
        let (n_items, n_chars) = match value {
            Value::Array(_, items) => (Some(items.len()), None),
            Value::String(s) => (None, Some(s.chars().count())),
            _ => (None, None),
        };
        MetaEntry {
            index,
            key: key.to_string(),
            ty: type_name(value),
            n_items,
            n_chars,
            value: json,
            truncated,
            text: to_text(value, full),
        }
    }
}

impl Totals {
    fn new(f: &GgufFile) -> Self {
        let mut by_type: BTreeMap<GgmlType, TypeTotal> = BTreeMap::new();
        for t in f.tensors() {
            let e = by_type.entry(t.ty).or_insert_with(|| TypeTotal {
                ty: t.ty.dump_name(),
                tensors: 0,
                parameters: 0,
                bytes: 0,
            });
            e.tensors += 1;
            e.parameters = e.parameters.saturating_add(t.n_elements());
            e.bytes = e.bytes.saturating_add(t.n_bytes);
        }
        let parameters = by_type
            .values()
            .fold(0u64, |a, t| a.saturating_add(t.parameters));
        let bytes = by_type
            .values()
            .fold(0u64, |a, t| a.saturating_add(t.bytes));
        Totals {
            tensors: f.tensors().len(),
            parameters,
            bytes,
            bits_per_weight: (parameters > 0).then(|| bytes as f64 * 8.0 / parameters as f64),
            by_type: by_type.into_values().collect(),
        }
    }
}

impl Architecture {
    fn new(f: &GgufFile, parameters: u64) -> Self {
        let name = f
            .get("general.architecture")
            .and_then(Value::as_str)
            .map(str::to_string);
        let key = |suffix: &str| name.as_ref().and_then(|a| f.get(&format!("{a}.{suffix}")));
        // A number, or a per-layer array (some architectures vary it by layer).
        let field = |suffix: &str| key(suffix).and_then(number_or_array);
        let scalar = |suffix: &str| key(suffix).and_then(Value::as_u64);

        let (head_dim, head_dim_source) = match (
            scalar("attention.key_length"),
            scalar("embedding_length"),
            scalar("attention.head_count"),
        ) {
            (Some(k), _, _) => (Some(k), Some("key_length")),
            (None, Some(e), Some(h)) if h > 0 => {
                (Some(e / h), Some("embedding_length / head_count"))
            }
            _ => (None, None),
        };
        let tokens = f
            .get("tokenizer.ggml.tokens")
            .and_then(Value::as_array)
            .map(<[Value]>::len);
        let (vocab_size, vocab_size_source) = match (tokens, scalar("vocab_size")) {
            (Some(n), _) => (Some(n as u64), Some("tokenizer.ggml.tokens".to_string())),
            (None, Some(n)) => (Some(n), name.as_ref().map(|a| format!("{a}.vocab_size"))),
            _ => (None, None),
        };
        Architecture {
            block_count: field("block_count"),
            embedding_length: field("embedding_length"),
            feed_forward_length: field("feed_forward_length"),
            head_count: field("attention.head_count"),
            head_count_kv: field("attention.head_count_kv"),
            head_dim,
            head_dim_source,
            context_length: field("context_length"),
            rope_freq_base: field("rope.freq_base"),
            vocab_size,
            vocab_size_source,
            tokenizer: f
                .get("tokenizer.ggml.model")
                .and_then(Value::as_str)
                .map(str::to_string),
            parameters,
            name,
            engine: Engine::new(f),
        }
    }
}

fn number_or_array(v: &Value) -> Option<Json> {
    match v {
        Value::Array(_, items) => Some(Json::Array(
            items.iter().filter_map(number_or_array).collect(),
        )),
        Value::String(_) | Value::Bool(_) => None,
        v => Some(to_json(v, true, 0).0),
    }
}

// ---------------------------------------------------------------------------
// Values
// ---------------------------------------------------------------------------

/// `UINT32`, `ARRAY[STRING]`, `ARRAY[ARRAY[INT32]]` (inner type from the first item).
fn type_name(v: &Value) -> String {
    match v {
        Value::Array(ValueType::Array, items) => match items.first() {
            Some(first) => format!("ARRAY[{}]", type_name(first)),
            None => "ARRAY[ARRAY]".to_string(),
        },
        v => v.type_name(),
    }
}

/// The first `max` characters of `s`, and whether that is all of it.
fn prefix(s: &str, max: usize) -> (&str, bool) {
    match s.char_indices().nth(max) {
        Some((i, _)) => (&s[..i], false),
        None => (s, true),
    }
}

fn float_json(x: f64, shortest: String) -> Json {
    if x.is_finite() {
        // The shortest text that reads back as the stored f32, not its f64 widening.
        shortest
            .parse::<f64>()
            .ok()
            .and_then(serde_json::Number::from_f64)
            .map_or(Json::Null, Json::Number)
    } else {
        Json::String(shortest)
    }
}

/// A value as JSON, shortened unless `full`; the flag says whether anything was cut.
fn to_json(v: &Value, full: bool, max_chars: usize) -> (Json, bool) {
    match v {
        Value::U8(x) => (Json::from(*x), false),
        Value::I8(x) => (Json::from(*x), false),
        Value::U16(x) => (Json::from(*x), false),
        Value::I16(x) => (Json::from(*x), false),
        Value::U32(x) => (Json::from(*x), false),
        Value::I32(x) => (Json::from(*x), false),
        Value::U64(x) => (Json::from(*x), false),
        Value::I64(x) => (Json::from(*x), false),
        Value::F32(x) => (float_json(f64::from(*x), format!("{x:?}")), false),
        Value::F64(x) => (float_json(*x, format!("{x:?}")), false),
        Value::Bool(x) => (Json::from(*x), false),
        Value::String(s) if full => (Json::from(s.as_str()), false),
        Value::String(s) => {
            let (p, whole) = prefix(s, max_chars);
            (Json::from(p), !whole)
        }
        Value::Array(_, items) => {
            let shown = if full {
                items.len()
            } else {
                items.len().min(ARRAY_ITEMS)
            };
            let mut cut = shown < items.len();
            let mut out = Vec::with_capacity(shown);
            for item in &items[..shown] {
                let (j, c) = to_json(item, full, ITEM_CHARS);
                cut |= c;
                out.push(j);
            }
            (Json::Array(out), cut)
        }
    }
}

fn float_text(x: f64, shortest: String) -> String {
    if x.is_finite() {
        shortest
    } else {
        x.to_string()
    }
}

/// A value for the metadata table, on one line: strings quoted with escapes, long
/// strings as `"prefix…" (N chars)`, long arrays as `[first items, …] (N items)`.
fn to_text(v: &Value, full: bool) -> String {
    let mut s = String::new();
    write_text(&mut s, v, full, STRING_CHARS);
    s
}

fn write_text(out: &mut String, v: &Value, full: bool, max_chars: usize) {
    match v {
        Value::F32(x) => out.push_str(&float_text(f64::from(*x), format!("{x:?}"))),
        Value::F64(x) => out.push_str(&float_text(*x, format!("{x:?}"))),
        Value::String(s) => {
            let (p, whole) = if full {
                (s.as_str(), true)
            } else {
                prefix(s, max_chars)
            };
            let _ = write!(out, "{p:?}");
            if !whole {
                out.insert(out.len() - 1, '…');
                let _ = write!(out, " ({} chars)", s.chars().count());
            }
        }
        Value::Array(_, items) => {
            let shown = if full {
                items.len()
            } else {
                items.len().min(ARRAY_ITEMS)
            };
            out.push('[');
            for (i, item) in items[..shown].iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                write_text(out, item, full, ITEM_CHARS);
            }
            if shown < items.len() {
                out.push_str(", …]");
                let _ = write!(out, " ({} items)", items.len());
            } else {
                out.push(']');
            }
        }
        v => {
            let _ = write!(out, "{v}");
        }
    }
}

// ---------------------------------------------------------------------------
// Text output
// ---------------------------------------------------------------------------

fn human_bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut x = n as f64;
    let mut u = 0;
    while x >= 1024.0 && u + 1 < UNITS.len() {
        x /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{n} B")
    } else {
        format!("{x:.2} {}", UNITS[u])
    }
}

fn human_count(n: u64) -> String {
    match n {
        0..=9_999 => n.to_string(),
        10_000..=999_999 => format!("{:.2} K", n as f64 / 1e3),
        1_000_000..=999_999_999 => format!("{:.2} M", n as f64 / 1e6),
        _ => format!("{:.2} B", n as f64 / 1e9),
    }
}

fn opt(v: &Option<Json>) -> String {
    match v {
        None => "-".to_string(),
        Some(Json::Array(items)) => {
            let nums: Vec<String> = items.iter().map(Json::to_string).collect();
            if nums.len() > ARRAY_ITEMS {
                format!(
                    "[{}, …] (per layer, {} items)",
                    nums[..ARRAY_ITEMS].join(", "),
                    nums.len()
                )
            } else {
                format!("[{}] (per layer)", nums.join(", "))
            }
        }
        Some(j) => j.to_string(),
    }
}

fn shape_text(shape: &[u64]) -> String {
    let dims: Vec<String> = shape.iter().map(u64::to_string).collect();
    format!("[{}]", dims.join(", "))
}

impl Report {
    fn to_text(&self) -> Result<String, std::fmt::Error> {
        let mut o = String::new();
        writeln!(
            o,
            "file:         {} ({}, {} bytes)",
            self.file,
            human_bytes(self.file_size),
            self.file_size
        )?;
        writeln!(
            o,
            "gguf:         version {}, alignment {}, data offset {} (0x{:x})",
            self.version, self.alignment, self.data_offset, self.data_offset
        )?;
        writeln!(
            o,
            "contents:     {} metadata keys, {} tensors",
            self.metadata_count, self.tensor_count
        )?;

        let a = &self.architecture;
        writeln!(o)?;
        writeln!(
            o,
            "architecture: {}",
            a.name.as_deref().unwrap_or("- (no general.architecture)")
        )?;
        let head_dim = match (a.head_dim, a.head_dim_source) {
            (Some(d), Some(src)) => format!("{d} ({src})"),
            _ => "-".to_string(),
        };
        let vocab = match (a.vocab_size, &a.vocab_size_source) {
            (Some(n), Some(src)) => format!("{n} ({src})"),
            (Some(n), None) => n.to_string(),
            _ => "-".to_string(),
        };
        let rows = [
            ("blocks", opt(&a.block_count)),
            ("embedding length", opt(&a.embedding_length)),
            ("feed-forward length", opt(&a.feed_forward_length)),
            ("attention heads", opt(&a.head_count)),
            ("kv heads", opt(&a.head_count_kv)),
            ("head dim", head_dim),
            ("context length", opt(&a.context_length)),
            ("rope freq base", opt(&a.rope_freq_base)),
            ("vocab size", vocab),
            (
                "tokenizer",
                a.tokenizer.clone().unwrap_or_else(|| "-".to_string()),
            ),
            (
                "parameters",
                if self.tensor_count == 0 {
                    "0 (no tensors: vocabulary-only file)".to_string()
                } else {
                    format!("{} ({})", human_count(a.parameters), a.parameters)
                },
            ),
        ];
        for (k, v) in rows {
            writeln!(o, "  {k:<20} {v}")?;
        }
        let e = &a.engine;
        let mut extra: Vec<(&str, String)> = Vec::new();
        match &e.unsupported {
            Some(why) => extra.push(("runs here", format!("no: {why}"))),
            None => extra.push(("runs here", "yes".to_string())),
        }
        if let (Some(w), Some(g)) = (e.sliding_window, &e.global_layers) {
            let list: Vec<String> = g.iter().map(usize::to_string).collect();
            extra.push((
                "sliding window",
                format!("{w} tokens; global layers: {}", list.join(", ")),
            ));
        }
        if let (Some(n), Some(k), Some(ff)) =
            (e.experts, e.experts_used, e.expert_feed_forward_length)
        {
            extra.push((
                "experts",
                format!("{n}, {k} used per token, feed-forward {ff}"),
            ));
            if let Some(g) = e.expert_gating {
                extra.push(("expert weights", g.to_string()));
            }
        }
        if e.attention_sinks == Some(true) {
            extra.push(("attention sinks", "a learned logit per head".to_string()));
        }
        if let Some(y) = &e.rope_yarn {
            extra.push((
                "rope scaling",
                format!(
                    "yarn, factor {}, ramp over dimension pairs {}..{}, magnitude {}",
                    y.factor, y.ramp[0], y.ramp[1], y.magnitude
                ),
            ));
        }
        if let Some(c) = e.attn_logit_softcap {
            extra.push(("attention soft-cap", c.to_string()));
        }
        if let Some(c) = e.final_logit_softcap {
            extra.push(("final soft-cap", c.to_string()));
        }
        for (k, v) in extra {
            writeln!(o, "  {k:<20} {v}")?;
        }

        writeln!(o)?;
        writeln!(o, "metadata: {} keys", self.metadata_count)?;
        let wi = self.metadata.len().max(1).to_string().len();
        let wt = self
            .metadata
            .iter()
            .map(|m| m.ty.len())
            .max()
            .unwrap_or(4)
            .max(4);
        let wk = self
            .metadata
            .iter()
            .map(|m| m.key.chars().count())
            .max()
            .unwrap_or(3)
            .max(3);
        writeln!(o, "  {:>wi$}  {:<wt$}  {:<wk$}  value", "#", "type", "key")?;
        for m in &self.metadata {
            writeln!(
                o,
                "  {:>wi$}  {:<wt$}  {:<wk$}  {}",
                m.index, m.ty, m.key, m.text
            )?;
        }

        writeln!(o)?;
        writeln!(o, "tensors: {}", self.tensor_count)?;
        if !self.tensors.is_empty() {
            let shapes: Vec<String> = self.tensors.iter().map(|t| shape_text(&t.shape)).collect();
            let wi = self.tensors.len().to_string().len();
            let wn = self
                .tensors
                .iter()
                .map(|t| t.name.chars().count())
                .max()
                .unwrap_or(4)
                .max(4);
            let wt = self
                .tensors
                .iter()
                .map(|t| t.ty.len())
                .max()
                .unwrap_or(4)
                .max(4);
            let ws = shapes.iter().map(String::len).max().unwrap_or(5).max(5);
            let wo = self
                .tensors
                .iter()
                .map(|t| t.offset.to_string().len())
                .max()
                .unwrap_or(6)
                .max(6);
            writeln!(
                o,
                "  {:>wi$}  {:<wn$}  {:<wt$}  {:<ws$}  {:>wo$}  bytes",
                "#", "name", "type", "shape", "offset"
            )?;
            for (t, shape) in self.tensors.iter().zip(&shapes) {
                writeln!(
                    o,
                    "  {:>wi$}  {:<wn$}  {:<wt$}  {:<ws$}  {:>wo$}  {}",
                    t.index, t.name, t.ty, shape, t.offset, t.n_bytes
                )?;
            }
        }

        let t = &self.totals;
        writeln!(o)?;
        writeln!(o, "totals:")?;
        writeln!(o, "  tensors      {}", t.tensors)?;
        writeln!(
            o,
            "  parameters   {} ({})",
            t.parameters,
            human_count(t.parameters)
        )?;
        let bpw = t
            .bits_per_weight
            .map(|b| format!(", {b:.2} bits per weight"))
            .unwrap_or_default();
        writeln!(
            o,
            "  bytes        {} ({}{bpw})",
            t.bytes,
            human_bytes(t.bytes)
        )?;
        if !t.by_type.is_empty() {
            let wt = t
                .by_type
                .iter()
                .map(|x| x.ty.len())
                .max()
                .unwrap_or(4)
                .max(4);
            writeln!(o, "  by type:")?;
            writeln!(
                o,
                "    {:<wt$}  {:>7}  {:>13}  {:>13}",
                "type", "tensors", "parameters", "bytes"
            )?;
            for x in &t.by_type {
                writeln!(
                    o,
                    "    {:<wt$}  {:>7}  {:>13}  {:>13}",
                    x.ty, x.tensors, x.parameters, x.bytes
                )?;
            }
        }
        Ok(o)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_arrays_and_strings_are_summarised() {
        let arr = Value::Array(ValueType::I32, (0..20).map(Value::I32).collect());
        assert_eq!(
            to_text(&arr, false),
            "[0, 1, 2, 3, 4, 5, 6, 7, …] (20 items)"
        );
        assert_eq!(to_text(&arr, true).matches(',').count(), 19);
        let (j, cut) = to_json(&arr, false, STRING_CHARS);
        assert!(cut);
        assert_eq!(j.as_array().map(Vec::len), Some(ARRAY_ITEMS));

        let s = Value::String("é".repeat(100));
        let t = to_text(&s, false);
        assert!(
            t.starts_with("\"éé") && t.ends_with("…\" (100 chars)"),
            "{t}"
        );
        assert_eq!(to_text(&s, true).chars().count(), 102);
        assert_eq!(to_text(&Value::String("a\nb".into()), false), "\"a\\nb\"");
    }

    #[test]
    fn floats_print_as_stored() {
        assert_eq!(
            to_json(&Value::F32(1e-5), false, 0).0,
            serde_json::json!(1e-5)
        );
        assert_eq!(
            to_json(&Value::F32(f32::INFINITY), false, 0).0,
            serde_json::json!("inf")
        );
        assert_eq!(to_text(&Value::F32(100000.0), false), "100000.0");
        assert_eq!(to_text(&Value::F32(f32::NAN), false), "NaN");
    }

    #[test]
    fn counts_read_well() {
        assert_eq!(human_count(576), "576");
        assert_eq!(human_count(134_515_008), "134.52 M");
        assert_eq!(human_count(1_543_714_304), "1.54 B");
        assert_eq!(human_bytes(98_362_432), "93.81 MiB");
    }
}
