//! Dequantization of every tensor of the real test models, compared with ggml's.
//!
//! `scripts/record_dequant_hashes.py` recorded, per tensor, its type, shape, absolute file offset,
//! byte size, and the SHA-256 of ggml's `to_float` output (f32 little-endian). This test reads
//! each tensor's bytes straight from the model file (no GGUF parser involved), dequantizes them
//! with `rustorch_core::quant::dequantize` and compares the digests. Models missing from
//! `models/` are skipped with a message (`scripts/fetch-models.sh --all` fetches them).
//!
//! Run in release (it hashes ~9 GB of f32):
//! `cargo test -p rustorch-core --release --test quant_models -- --nocapture`

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::Instant;

use rustorch_core::quant;
use rustorch_core::GgmlType;
use serde_json::Value;
use sha2::{Digest, Sha256};

const MODELS: [&str; 4] = [
    "SmolLM2-135M-Instruct.Q4_1.gguf",
    "qwen2.5-coder-0.5b-instruct-q4km.gguf",
    "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
    "gemma-3-270m-q4_k_m.gguf",
];

/// Elements dequantized per step (a multiple of every block size).
const CHUNK: usize = 1 << 20;

fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

struct Tensor {
    name: String,
    ty: GgmlType,
    n_elements: usize,
    offset: u64,
    n_bytes: usize,
    raw_sha256: String,
    sha256: String,
}

fn parse_tensor(t: &Value) -> Tensor {
    let s = |k: &str| {
        t.get(k)
            .and_then(Value::as_str)
            .unwrap_or_else(|| panic!("tensor lacks '{k}'"))
            .to_string()
    };
    let u = |k: &str| {
        t.get(k)
            .and_then(Value::as_u64)
            .unwrap_or_else(|| panic!("tensor lacks '{k}'"))
    };
    let type_id = u("type_id") as u32;
    let ty = GgmlType::from_id(type_id).unwrap_or_else(|| panic!("unknown type id {type_id}"));
    assert_eq!(ty.name(), s("type"));
    let shape_product: u64 = t
        .get("shape")
        .and_then(Value::as_array)
        .expect("shape")
        .iter()
        .map(|d| d.as_u64().expect("dim"))
        .product();
    assert_eq!(shape_product, u("n_elements"), "{}", s("name"));
    Tensor {
        name: s("name"),
        ty,
        n_elements: u("n_elements") as usize,
        offset: u("offset"),
        n_bytes: u("n_bytes") as usize,
        raw_sha256: s("raw_sha256"),
        sha256: s("sha256"),
    }
}

fn hex(digest: &[u8]) -> String {
    digest.iter().map(|b| format!("{b:02x}")).collect()
}

/// Dequantizes one tensor from `file`; returns the digest of the f32 output and the number of
/// blocks.
fn digest_tensor(file: &mut File, t: &Tensor) -> Result<(String, usize), String> {
    let expected = t.ty.bytes_for(t.n_elements as u64);
    if expected != Some(t.n_bytes as u64) {
        return Err(format!(
            "{}: {} bytes for {} elements",
            t.name, t.n_bytes, t.n_elements
        ));
    }
    let mut raw = vec![0u8; t.n_bytes];
    file.seek(SeekFrom::Start(t.offset))
        .and_then(|_| file.read_exact(&mut raw))
        .map_err(|e| format!("{}: read: {e}", t.name))?;

    let (block, bytes) = (t.ty.block_size(), t.ty.type_size());
    let chunk_bytes = CHUNK / block * bytes;
    let mut out = vec![0f32; CHUNK];
    let mut le = vec![0u8; CHUNK * 4];
    let mut hasher = Sha256::new();
    for src in raw.chunks(chunk_bytes) {
        let y = &mut out[..src.len() / bytes * block];
        quant::dequantize(t.ty, src, y).map_err(|e| format!("{}: {e}", t.name))?;
        let le = &mut le[..y.len() * 4];
        for (d, v) in le.chunks_exact_mut(4).zip(y.iter()) {
            d.copy_from_slice(&v.to_le_bytes());
        }
        hasher.update(&*le);
    }
    let digest = hex(&hasher.finalize());
    if digest != t.sha256 && hex(&Sha256::digest(&raw)) != t.raw_sha256 {
        return Err(format!(
            "{}: the tensor's bytes differ from the recorded model",
            t.name
        ));
    }
    Ok((digest, t.n_bytes / bytes))
}

#[derive(Default)]
struct Tally {
    tensors: usize,
    blocks: usize,
    elements: usize,
}

fn check_model(model: &str) -> Result<(), String> {
    let root = repo_root();
    let path = root.join("models").join(model);
    if !path.exists() {
        eprintln!(
            "SKIP {model}: not present under models/ (scripts/fetch-models.sh --all fetches it)"
        );
        return Ok(());
    }
    let stem = Path::new(model)
        .file_stem()
        .and_then(|s| s.to_str())
        .unwrap_or(model);
    let fixture = root
        .join("tests/fixtures/quant")
        .join(format!("dequant-{stem}.json"));
    let text = std::fs::read_to_string(&fixture).map_err(|e| {
        format!(
            "{}: {e} (run scripts/record_dequant_hashes.py)",
            fixture.display()
        )
    })?;
    let spec: Value = serde_json::from_str(&text).map_err(|e| e.to_string())?;
    let file_size = spec.get("file_size").and_then(Value::as_u64);
    let actual_size = std::fs::metadata(&path).map_err(|e| e.to_string())?.len();
    if file_size != Some(actual_size) {
        return Err(format!(
            "{model}: file is {actual_size} bytes, the fixture was recorded from {file_size:?}"
        ));
    }
    let tensors: Vec<Tensor> = spec
        .get("tensors")
        .and_then(Value::as_array)
        .ok_or("fixture has no tensors")?
        .iter()
        .map(parse_tensor)
        .collect();

    let start = Instant::now();
    let next = AtomicUsize::new(0);
    let results = Mutex::new(Vec::new());
    let workers = std::thread::available_parallelism().map_or(2, |n| n.get().min(4));
    std::thread::scope(|s| {
        for _ in 0..workers {
            s.spawn(|| {
                let mut file = match File::open(&path) {
                    Ok(f) => f,
                    Err(e) => {
                        results
                            .lock()
                            .unwrap_or_else(|p| p.into_inner())
                            .push((usize::MAX, Err(format!("open: {e}"))));
                        return;
                    }
                };
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some(t) = tensors.get(i) else { break };
                    let r = digest_tensor(&mut file, t);
                    results
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .push((i, r));
                }
            });
        }
    });

    let mut per_type: BTreeMap<&'static str, Tally> = BTreeMap::new();
    let mut failures = Vec::new();
    let results = results.into_inner().unwrap_or_else(|p| p.into_inner());
    for (i, r) in &results {
        match (r, tensors.get(*i)) {
            (Ok((digest, blocks)), Some(t)) => {
                if *digest == t.sha256 {
                    let tally = per_type.entry(t.ty.name()).or_default();
                    tally.tensors += 1;
                    tally.blocks += blocks;
                    tally.elements += t.n_elements;
                } else {
                    failures.push(format!(
                        "{} ({}): dequantization differs from ggml",
                        t.name, t.ty
                    ));
                }
            }
            (Err(e), _) => failures.push(e.clone()),
            (Ok(_), None) => failures.push(format!("result for unknown tensor {i}")),
        }
    }
    let matched: usize = per_type.values().map(|t| t.tensors).sum();
    let blocks: usize = per_type.values().map(|t| t.blocks).sum();
    println!(
        "{model}: {matched}/{} tensors ({blocks} blocks) bit-identical to ggml in {:.1}s",
        tensors.len(),
        start.elapsed().as_secs_f64()
    );
    for (ty, t) in &per_type {
        println!(
            "    {ty:5} {:4} tensors {:9} blocks {:11} values",
            t.tensors, t.blocks, t.elements
        );
    }
    if failures.is_empty() && matched == tensors.len() {
        Ok(())
    } else {
        Err(format!("{model}: {failures:?}"))
    }
}

#[test]
fn real_models_dequantize_like_ggml() {
    let mut errors = Vec::new();
    for model in MODELS {
        if let Err(e) = check_model(model) {
            errors.push(e);
        }
    }
    assert!(errors.is_empty(), "{}", errors.join("\n"));
}
