//! Shared helpers for the model tests: locating real models and fixtures.
#![allow(dead_code)]

use std::path::PathBuf;
use std::sync::Arc;

use rustorch_core::gguf::GgufFile;
use rustorch_llm::{Batch, KvCache, Model, Runtime};

/// Decodes one token `tok` at position `pos` of sequence 0 and returns its logits.
pub fn decode_one(
    model: &Model,
    cache: &mut KvCache,
    rt: &Runtime,
    tok: u32,
    pos: usize,
) -> Vec<f32> {
    let mut b = Batch::new();
    b.push(tok, pos as u32, 0, true);
    model
        .forward(&b, cache, rt)
        .expect("decode")
        .last(model.hparams().n_vocab)
        .expect("logits")
        .to_vec()
}

/// The repository root: `RUSTORCH_ROOT`, or where this crate was built (a test binary
/// carried to another machine is pointed at its copy of the repository).
pub fn root() -> PathBuf {
    match std::env::var_os("RUSTORCH_ROOT") {
        Some(r) => PathBuf::from(r),
        None => PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.."),
    }
}

pub fn model_path(file: &str) -> PathBuf {
    root().join("models").join(file)
}

/// Loads `models/<file>`, or prints why the test is skipped and returns `None`.
pub fn load_model(file: &str) -> Option<Model> {
    let path = model_path(file);
    if !path.exists() {
        eprintln!(
            "SKIPPED: {} is absent (run scripts/fetch-models.sh --all)",
            path.display()
        );
        return None;
    }
    let gguf = GgufFile::open(&path).expect("open model");
    Some(Model::load(Arc::new(gguf)).expect("load model"))
}

pub fn argmax(v: &[f32]) -> usize {
    let mut best = 0;
    for (i, &x) in v.iter().enumerate() {
        if x > v[best] {
            best = i;
        }
    }
    best
}

/// log(Σ exp(v)) computed in f64.
pub fn logsumexp(v: &[f32]) -> f64 {
    let m = v.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    m + v.iter().map(|&x| (x as f64 - m).exp()).sum::<f64>().ln()
}

/// Max |Δ| between the logits of `tokens` evaluated as one batch and fed one token at a
/// time at explicit positions (asserting the same argmax at every position but near-ties).
pub fn batch_vs_sequential(model: &Model, tokens: &[u32]) -> f32 {
    let r = compare_batch_sequential(model, tokens);
    for &(i, margin) in &r.flips {
        // allowed only where the two best logits are within rounding of each other
        assert!(
            margin < 0.05,
            "position {i}: argmax differs with a top-2 margin of {margin}"
        );
    }
    r.max_delta
}

/// How the logits of `tokens` evaluated as one batch differ from those fed one token at a
/// time at explicit positions.
pub struct BatchVsSequential {
    /// The largest |Δ logit| over all positions.
    pub max_delta: f32,
    /// The positions whose argmax differs, with the one-at-a-time logits' top-2 margin.
    pub flips: Vec<(usize, f32)>,
}

pub fn compare_batch_sequential(model: &Model, tokens: &[u32]) -> BatchVsSequential {
    let nv = model.hparams().n_vocab;
    let rt = Runtime::new(2);
    let mut c1 = model.new_cache(tokens.len().max(128));
    let batched = model
        .forward(&Batch::from_prompt(tokens, 0, 0, true), &mut c1, &rt)
        .expect("batch");
    let mut c2 = model.new_cache(tokens.len().max(128));
    let mut worst = 0f32;
    let mut flips = Vec::new();
    for (i, &t) in tokens.iter().enumerate() {
        let mut b = Batch::new();
        b.push(t, i as u32, 0, true);
        let one = model.forward(&b, &mut c2, &rt).expect("one token");
        let x = one.last(nv).expect("logits");
        let y = batched.logits_for(i, nv).expect("row");
        if argmax(x) != argmax(y) {
            let mut s = x.to_vec();
            s.sort_by(|a, b| b.total_cmp(a));
            flips.push((i, s[0] - s[1]));
        }
        for (a, b) in x.iter().zip(y) {
            worst = worst.max((a - b).abs());
        }
    }
    BatchVsSequential {
        max_delta: worst,
        flips,
    }
}

/// KL(p ‖ q) of the softmax distributions of two logit rows, in f64.
pub fn kl(p: &[f32], q: &[f32]) -> f64 {
    let (lp, lq) = (logsumexp(p), logsumexp(q));
    p.iter()
        .zip(q)
        .map(|(&a, &b)| {
            let la = a as f64 - lp;
            la.exp() * (la - (b as f64 - lq))
        })
        .sum()
}

/// A JSON array of token ids.
pub fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .expect("array of ids")
        .iter()
        .map(|t| t.as_u64().expect("id") as u32)
        .collect()
}
