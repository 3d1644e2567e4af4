//! Shared helpers for the model tests: locating real models and fixtures.
#![allow(dead_code)]

use std::path::PathBuf;
use std::sync::Arc;

use rustorch_core::gguf::GgufFile;
use rustorch_llm::Model;

pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
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
