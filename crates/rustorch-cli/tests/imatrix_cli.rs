//! `rustorch imatrix` and `rustorch quantize --imatrix` against llama.cpp 0.3.36.
//!
//! `tests/fixtures/imatrix/` (written by `scripts/compare-quantize.py --imatrix ...
//! --record-imatrix`): `text.txt`, the importance matrix llama-imatrix computed of SmolLM2-135M
//! Q4_1 over it (`-c 128 -ub 32 --chunks 8`, run beside a copy of the text so that the file
//! names it `text.txt`), its perplexity output, and for seven file types the SHA-256 of the
//! file llama-quantize wrote with `--allow-requantize --imatrix imatrix.gguf` (that matrix
//! under that name) and of each of its tensors.
//!
//! * `rustorch imatrix` with the same flags must print the same perplexity lines and write the
//!   same matrix: the same entries and counts, and sums within a tolerance of 0 (each
//!   micro-batch of 32 rows stays under the 64 query rows from which llama.cpp's flash
//!   attention changes algorithm, so every activation, and every f32 sum in llama.cpp's
//!   order, is the same; `scripts/compare-quantize.py` measures the other case). The file must
//!   be byte-identical.
//! * `rustorch quantize --imatrix` with llama-imatrix's matrix must write llama-quantize's
//!   files, tensor for tensor and byte for byte.
//!
//! An absent model is skipped with a note.

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use rustorch_core::gguf::GgufFile;
use serde_json::Value as Json;
use sha2::{Digest, Sha256};

const MODEL: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn fixtures() -> PathBuf {
    root().join("tests/fixtures/imatrix")
}

fn model() -> Option<PathBuf> {
    let p = root().join("models").join(MODEL);
    if p.is_file() {
        Some(p.canonicalize().expect("model path"))
    } else {
        let _ = writeln!(
            std::io::stderr(),
            "SKIPPED: {} is absent (scripts/fetch-models.sh)",
            p.display()
        );
        None
    }
}

fn fixture() -> Json {
    let p = fixtures().join("SmolLM2-135M-Instruct.Q4_1.json");
    serde_json::from_str(&std::fs::read_to_string(&p).expect("read fixture")).expect("JSON")
}

/// A fresh directory holding the given fixture files under the given names.
fn workdir(tag: &str, files: &[(&str, &str)]) -> PathBuf {
    let d = std::env::temp_dir().join(format!("rustorch-imatrix-{}-{tag}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).expect("temp dir");
    for (from, to) in files {
        std::fs::copy(fixtures().join(from), d.join(to)).expect("copy fixture");
    }
    d
}

fn rustorch(dir: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_rustorch"))
        .args(args)
        .current_dir(dir)
        .output()
        .expect("run rustorch")
}

fn hex(d: &[u8]) -> String {
    d.iter().map(|b| format!("{b:02x}")).collect()
}

/// name -> f32 values of an imatrix file's tensors.
fn values(g: &GgufFile) -> Vec<(String, Vec<f32>)> {
    g.tensors()
        .iter()
        .map(|t| {
            let v = g
                .tensor_data(t)
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect();
            (t.name.clone(), v)
        })
        .collect()
}

#[test]
fn imatrix_equals_llama_imatrix() {
    let Some(m) = model() else {
        return;
    };
    let fx = fixture();
    let dir = workdir("compute", &[("text.txt", "text.txt")]);
    let mut args = vec!["imatrix", "-m", m.to_str().unwrap(), "-f", "text.txt"];
    args.extend(["-o", "imatrix.gguf", "-t", "2"]);
    let flags: Vec<&str> = fx["imatrix_args"].as_str().unwrap().split(' ').collect();
    args.extend(&flags);
    let r = rustorch(&dir, &args);
    let stderr = String::from_utf8_lossy(&r.stderr);
    assert!(r.status.success(), "imatrix failed: {stderr}");
    // the perplexity lines, as llama-imatrix printed them
    let stdout = String::from_utf8_lossy(&r.stdout);
    let ppl: Vec<&str> = stdout
        .lines()
        .map(str::trim)
        .filter(|l| l.starts_with('[') || l.starts_with("Final estimate"))
        .collect();
    let want: Vec<&str> = fx["ppl"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap())
        .collect();
    assert_eq!(ppl, want, "perplexity output");

    let ours = GgufFile::open(dir.join("imatrix.gguf")).expect("our imatrix");
    let theirs =
        GgufFile::open(fixtures().join("SmolLM2-135M-Instruct.Q4_1.imatrix.gguf")).expect("ref");
    assert_eq!(ours.metadata(), theirs.metadata(), "imatrix metadata");
    let (a, b) = (values(&ours), values(&theirs));
    assert_eq!(
        a.iter().map(|(n, v)| (n, v.len())).collect::<Vec<_>>(),
        b.iter().map(|(n, v)| (n, v.len())).collect::<Vec<_>>(),
        "entries and shapes"
    );
    let (mut worst, mut at, mut differ, mut n) = (0f64, String::new(), 0, 0);
    for ((name, x), (_, y)) in a.iter().zip(&b) {
        if name.ends_with(".counts") {
            assert_eq!(x, y, "{name}");
            continue;
        }
        for (&p, &q) in x.iter().zip(y) {
            n += 1;
            if p != q {
                differ += 1;
                let rel = (f64::from(p) - f64::from(q)).abs() / f64::from(q).abs().max(1e-30);
                if rel > worst {
                    (worst, at) = (rel, name.clone());
                }
            }
        }
    }
    println!("{n} sums, {differ} differ from llama-imatrix's, largest relative difference {worst:e} {at}");
    const TOLERANCE: f64 = 0.0;
    assert!(
        worst <= TOLERANCE,
        "sums differ: {differ} of {n}, largest relative difference {worst:e} in {at}"
    );
    let bytes = std::fs::read(dir.join("imatrix.gguf")).expect("read");
    assert_eq!(
        hex(&Sha256::digest(&bytes)),
        fx["imatrix_sha256"].as_str().unwrap(),
        "imatrix file bytes"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

fn quantize_with_llama_imatrix(ftype: &str) {
    let Some(m) = model() else {
        return;
    };
    let fx = fixture();
    let want = &fx["quantized"][ftype];
    let dir = workdir(
        ftype,
        &[("SmolLM2-135M-Instruct.Q4_1.imatrix.gguf", "imatrix.gguf")],
    );
    let r = rustorch(
        &dir,
        &[
            "quantize",
            "--allow-requantize",
            "--imatrix",
            "imatrix.gguf",
            m.to_str().unwrap(),
            "out.gguf",
            ftype,
            "2",
        ],
    );
    let stderr = String::from_utf8_lossy(&r.stderr);
    assert!(r.status.success(), "quantize failed: {stderr}");
    let out = dir.join("out.gguf");
    let g = GgufFile::open(&out).expect("open output");
    let tensors = want["tensors"].as_array().unwrap();
    assert_eq!(g.tensors().len(), tensors.len(), "{ftype}: tensor count");
    let mut bad = Vec::new();
    for (t, w) in g.tensors().iter().zip(tensors) {
        let got = [
            t.name.clone(),
            t.ty.name().to_string(),
            hex(&Sha256::digest(g.tensor_data(t)))[..16].to_string(),
        ];
        let w: Vec<&str> = w
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_str().unwrap())
            .collect();
        if got[0] != w[0] || got[1] != w[1] || got[2] != w[2] {
            bad.push(format!("{got:?} vs llama-quantize {w:?}"));
        }
    }
    assert!(
        bad.is_empty(),
        "{ftype}: {} of {} tensors differ:\n{}",
        bad.len(),
        tensors.len(),
        bad.join("\n")
    );
    let bytes = std::fs::read(&out).expect("read output");
    assert_eq!(
        hex(&Sha256::digest(&bytes)),
        want["file_sha256"].as_str().unwrap(),
        "{ftype}: whole file (metadata included)"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn quantize_q4_k_m_with_imatrix() {
    quantize_with_llama_imatrix("Q4_K_M");
}

#[test]
fn quantize_q5_k_m_with_imatrix() {
    quantize_with_llama_imatrix("Q5_K_M");
}

#[test]
fn quantize_q3_k_m_with_imatrix() {
    quantize_with_llama_imatrix("Q3_K_M");
}

#[test]
fn quantize_q6_k_with_imatrix() {
    quantize_with_llama_imatrix("Q6_K");
}

#[test]
fn quantize_q8_0_with_imatrix() {
    quantize_with_llama_imatrix("Q8_0");
}

#[test]
fn quantize_q4_0_with_imatrix() {
    quantize_with_llama_imatrix("Q4_0");
}

#[test]
fn quantize_iq4_xs_with_imatrix() {
    quantize_with_llama_imatrix("IQ4_XS");
}

/// The legacy format round-trips through both commands: `--output-format dat` writes a file
/// `quantize --imatrix` reads to the same weights.
#[test]
fn legacy_dat_is_read_back() {
    let Some(m) = model() else {
        return;
    };
    let dir = workdir("dat", &[("text.txt", "text.txt")]);
    let mut args = vec!["imatrix", "-m", m.to_str().unwrap(), "-f", "text.txt"];
    args.extend(["-o", "imatrix.dat", "--output-format", "dat", "-t", "2"]);
    args.extend(["-c", "128", "-ub", "32", "--chunks", "2", "--no-ppl"]);
    let r = rustorch(&dir, &args);
    assert!(
        r.status.success(),
        "imatrix failed: {}",
        String::from_utf8_lossy(&r.stderr)
    );
    assert!(!String::from_utf8_lossy(&r.stdout).contains("Final estimate"));
    let r = rustorch(
        &dir,
        &[
            "quantize",
            "--allow-requantize",
            "--imatrix",
            "imatrix.dat",
            "--dry-run",
            m.to_str().unwrap(),
            "Q4_0",
        ],
    );
    let stderr = String::from_utf8_lossy(&r.stderr);
    assert!(r.status.success(), "{stderr}");
    assert!(
        stderr.contains("loaded 210 importance matrix entries") && stderr.contains("2 chunks"),
        "{stderr}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn bad_imatrix_arguments_are_refused() {
    let Some(m) = model() else {
        return;
    };
    let dir = workdir("bad", &[("text.txt", "text.txt")]);
    let m = m.to_str().unwrap();
    for (args, msg) in [
        (
            vec!["imatrix", "-m", m, "-f", "text.txt", "-c", "4096"],
            "you need at least 8192 tokens",
        ),
        (
            vec!["imatrix", "-m", m, "-f", "missing.txt"],
            "cannot read 'missing.txt'",
        ),
        (vec!["imatrix", "-m", m], "no text (-f)"),
        (
            vec![
                "imatrix", "-m", m, "-f", "text.txt", "-c", "128", "--chunk", "30",
            ],
            "not enough tokens left after removing 30 chunks",
        ),
    ] {
        let r = rustorch(&dir, &args);
        let stderr = String::from_utf8_lossy(&r.stderr);
        assert!(!r.status.success(), "{args:?} succeeded");
        assert!(stderr.contains(msg), "{args:?}: {stderr}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
