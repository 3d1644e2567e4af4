//! `rustorch diff` finds a planted bug: side b rotates every token one position late
//! (`--fault-b rope`, a test-only switch), and diff must name RoPE's output of the first
//! layer as the first operation past the tolerance, and exit 1; without the fault both
//! sides agree and it exits 0. Without a GPU both sides are the CPU backend; with one, the
//! same check runs CPU against CUDA.

use std::path::PathBuf;
use std::process::{Command, Output};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn rustorch(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_rustorch"))
        .args(args)
        .current_dir(root())
        .output()
        .expect("run rustorch")
}

fn smol() -> Option<String> {
    let p = root().join("models/SmolLM2-135M-Instruct.Q4_1.gguf");
    if p.exists() {
        Some(p.display().to_string())
    } else {
        eprintln!("SKIPPED: {} is absent", p.display());
        None
    }
}

#[test]
fn diff_names_a_planted_rope_bug() {
    let Some(m) = smol() else {
        return;
    };
    let prompt = "The capital of France is";
    let clean = rustorch(&["diff", "-m", &m, "-p", prompt, "--a", "cpu", "--b", "cpu"]);
    let out = String::from_utf8_lossy(&clean.stdout);
    assert_eq!(clean.status.code(), Some(0), "{out}");
    assert!(
        out.contains("all 453 tensors within the tolerance"),
        "{out}"
    );

    let bad = rustorch(&[
        "diff",
        "-m",
        &m,
        "-p",
        prompt,
        "--a",
        "cpu",
        "--b",
        "cpu",
        "--fault-b",
        "rope",
    ]);
    let (out, err) = (
        String::from_utf8_lossy(&bad.stdout),
        String::from_utf8_lossy(&bad.stderr),
    );
    assert_eq!(bad.status.code(), Some(1), "{out}{err}");
    let line = out
        .lines()
        .find(|l| l.contains("first past the tolerance"))
        .unwrap_or_default();
    assert!(line.starts_with("Qcur_rope-0 "), "{out}");
    assert!(
        err.contains("first difference past the tolerance: Qcur_rope-0"),
        "{err}"
    );
    // everything before RoPE agrees exactly
    for name in ["embd-0", "attn_norm-0", "Qcur-0", "Kcur-0", "Vcur-0"] {
        let l = out
            .lines()
            .find(|l| l.starts_with(name))
            .unwrap_or_default();
        assert!(l.contains(" 0.0000e0 "), "{name}: {l}");
    }
}

#[test]
fn diff_without_a_gpu_says_what_is_missing() {
    let Some(m) = smol() else {
        return;
    };
    let o = rustorch(&["diff", "-m", &m, "-p", "Hi", "--a", "cpu", "--b", "cuda"]);
    let err = String::from_utf8_lossy(&o.stderr);
    if o.status.code() == Some(0) {
        use std::io::Write;
        let _ = writeln!(
            std::io::stderr(),
            "SKIPPED: a GPU is present; CPU and CUDA agree"
        );
        return;
    }
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("CUDA") || err.contains("driver"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}
