//! `rustorch make-model`: the same seed gives the same file, byte for byte, another seed
//! another file, and the model loads and generates.

use std::path::PathBuf;
use std::process::Command;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn make(out: &std::path::Path, seed: &str, vocab: &std::path::Path) {
    make_shape(out, "tiny", seed, vocab)
}

fn make_shape(out: &std::path::Path, shape: &str, seed: &str, vocab: &std::path::Path) {
    let o = Command::new(env!("CARGO_BIN_EXE_rustorch"))
        .args([
            "make-model",
            "--shape",
            shape,
            "--type",
            "q4_0",
            "--seed",
            seed,
        ])
        .arg("--vocab")
        .arg(vocab)
        .arg("--force")
        .arg(out)
        .output()
        .expect("run");
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}

/// The vocabulary `name` under models/vocab, or None (with a SKIPPED line) where absent.
fn vocab(name: &str) -> Option<PathBuf> {
    let v = root().join("models/vocab").join(name);
    if !v.exists() {
        eprintln!("SKIPPED: {} is absent", v.display());
        return None;
    }
    Some(v)
}

/// A fresh temporary folder for one test.
fn temp_dir(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("rustorch-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    dir
}

/// `rustorch run` of four greedy tokens on the CPU succeeds with `model`.
fn runs(model: &std::path::Path) {
    let o = Command::new(env!("CARGO_BIN_EXE_rustorch"))
        .args([
            "run", "--device", "cpu", "-p", "Hello", "-n", "4", "--temp", "0", "-m",
        ])
        .arg(model)
        .output()
        .expect("run");
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}

#[test]
fn make_model_is_reproducible_and_runs() {
    let Some(vocab) = vocab("ggml-vocab-llama-spm.gguf") else {
        return;
    };
    let dir = temp_dir("make-model");
    let (a, b, c) = (dir.join("a.gguf"), dir.join("b.gguf"), dir.join("c.gguf"));
    make(&a, "7", &vocab);
    make(&b, "7", &vocab);
    make(&c, "8", &vocab);
    let read = |p: &PathBuf| std::fs::read(p).expect("read");
    assert_eq!(read(&a), read(&b), "same seed, different bytes");
    assert_ne!(read(&a), read(&c), "different seeds, same bytes");
    runs(&a);
    let _ = std::fs::remove_dir_all(&dir);
}

/// The qwen2 shapes: the architecture's keys, Q/K/V biases and vocabulary, read back by
/// `inspect` and run (the loader needs every qwen2 tensor).
#[test]
fn make_model_qwen2_shape_loads_and_runs() {
    let Some(vocab) = vocab("ggml-vocab-qwen2.gguf") else {
        return;
    };
    let dir = temp_dir("make-qwen2");
    let m = dir.join("q.gguf");
    make_shape(&m, "tiny-qwen2", "3", &vocab);
    let o = Command::new(env!("CARGO_BIN_EXE_rustorch"))
        .arg("inspect")
        .arg(&m)
        .output()
        .expect("inspect");
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(text.contains("architecture: qwen2"), "{text}");
    assert!(text.contains("151936"), "{text}");
    for t in [
        "blk.1.attn_q.bias",
        "blk.1.attn_k.bias",
        "blk.1.attn_v.bias",
        "output.weight",
    ] {
        assert!(text.contains(t), "{t} missing: {text}");
    }
    runs(&m);
    let _ = std::fs::remove_dir_all(&dir);
}
