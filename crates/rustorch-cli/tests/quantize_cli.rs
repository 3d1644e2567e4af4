//! `rustorch quantize` against llama-quantize: the fixtures in `tests/fixtures/quantize/` list
//! each tensor of llama-quantize's output (llama.cpp 0.3.36, `--allow-requantize`) in file
//! order with its type, shape and the SHA-256 of its data, plus the whole file's SHA-256
//! (`scripts/compare-quantize.py --record` wrote them). SmolLM2 -> Q4_K_M is quantized for
//! real and must give the same file; Qwen2.5-1.5B -> Q4_K_M is checked with `--dry-run` (the
//! recipe's per-tensor types, without writing 1 GB). An absent model is skipped with a note.

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use rustorch_core::gguf::GgufFile;
use serde_json::Value as Json;
use sha2::{Digest, Sha256};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn skip(what: &str) {
    let _ = writeln!(std::io::stderr(), "SKIPPED: {what}");
}

fn model(name: &str) -> Option<PathBuf> {
    let p = root().join("models").join(name);
    if p.is_file() {
        Some(p)
    } else {
        skip(&format!(
            "{} is absent (scripts/fetch-models.sh --all)",
            p.display()
        ));
        None
    }
}

fn fixture(name: &str) -> Json {
    let p = root().join("tests/fixtures/quantize").join(name);
    serde_json::from_str(&std::fs::read_to_string(&p).expect("read fixture")).expect("JSON")
}

fn quantize(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_rustorch"))
        .arg("quantize")
        .args(args)
        .output()
        .expect("run rustorch")
}

fn tmp(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("rustorch-quantize-{}-{name}", std::process::id()))
}

fn hex(d: &[u8]) -> String {
    d.iter().map(|b| format!("{b:02x}")).collect()
}

#[test]
fn smollm2_q4_k_m_is_llama_quantize_byte_for_byte() {
    let Some(input) = model("SmolLM2-135M-Instruct.Q4_1.gguf") else {
        return;
    };
    let fx = fixture("SmolLM2-135M-Instruct.Q4_1.Q4_K_M.json");
    let out = tmp("smol-q4_k_m.gguf");
    let r = quantize(&[
        "--allow-requantize",
        input.to_str().unwrap(),
        out.to_str().unwrap(),
        "Q4_K_M",
        "2",
    ]);
    let stderr = String::from_utf8_lossy(&r.stderr).to_string();
    assert!(r.status.success(), "quantize failed: {stderr}");
    assert!(
        stderr.contains("180 of 272 tensor(s) required fallback quantization"),
        "fallback count: {stderr}"
    );
    let g = GgufFile::open(&out).expect("open output");
    let want = fx["tensors"].as_array().unwrap();
    assert_eq!(g.tensors().len(), want.len(), "tensor count");
    let mut bad = Vec::new();
    for (t, w) in g.tensors().iter().zip(want) {
        let shape: Vec<u64> = w["shape"]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| d.as_u64().unwrap())
            .collect();
        let digest = hex(&Sha256::digest(g.tensor_data(t)));
        if t.name != w["name"] || t.ty.name() != w["type"] || t.dims != shape {
            bad.push(format!(
                "{} {} {:?}, llama-quantize {} {} {:?}",
                t.name, t.ty, t.dims, w["name"], w["type"], shape
            ));
        } else if digest != w["sha256"] {
            bad.push(format!("{}: data differs", t.name));
        }
    }
    assert!(
        bad.is_empty(),
        "{} tensors differ:\n{}",
        bad.len(),
        bad.join("\n")
    );
    assert_eq!(g.get_u32("general.file_type").unwrap(), 15);
    assert_eq!(g.get_u32("general.quantization_version").unwrap(), 2);
    let keys: Vec<&str> = g.metadata().iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(
        keys[keys.len() - 2..],
        ["general.quantization_version", "general.file_type"]
    );
    let bytes = std::fs::read(&out).expect("read output");
    assert_eq!(bytes.len() as u64, fx["file_size"].as_u64().unwrap());
    assert_eq!(
        hex(&Sha256::digest(&bytes)),
        fx["file_sha256"],
        "whole file"
    );
    let _ = std::fs::remove_file(&out);
}

/// `--dry-run` lines: `[   i/   n] NAME - [shape], type = CUR, [converting to NEW .. ]size = ...`.
fn dry_run_types(stderr: &str) -> Vec<(String, String)> {
    stderr
        .lines()
        .filter(|l| l.starts_with('['))
        .map(|l| {
            let rest = &l[l.find("] ").unwrap() + 2..];
            let name = rest[..rest.find(" - [").unwrap()].trim().to_string();
            let after = |key: &str| {
                l.find(key).map(|i| {
                    l[i + key.len()..]
                        .trim_start()
                        .split([',', ' '])
                        .next()
                        .unwrap()
                        .to_string()
                })
            };
            let ty = after("converting to ")
                .or_else(|| after("type = "))
                .unwrap();
            (name, ty)
        })
        .collect()
}

#[test]
fn qwen_1_5b_q4_k_m_recipe_is_llama_quantize_s() {
    let Some(input) = model("qwen2.5-coder-1.5b-instruct-q4_k_m.gguf") else {
        return;
    };
    let fx = fixture("qwen2.5-coder-1.5b-instruct-q4_k_m.Q4_K_M.json");
    let r = quantize(&["--dry-run", input.to_str().unwrap(), "Q4_K_M"]);
    let stderr = String::from_utf8_lossy(&r.stderr).to_string();
    assert!(r.status.success(), "dry run failed: {stderr}");
    let got = dry_run_types(&stderr);
    let want: Vec<(String, String)> = fx["tensors"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| {
            (
                t["name"].as_str().unwrap().to_string(),
                t["type"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    assert_eq!(got.len(), want.len(), "{stderr}");
    let diff: Vec<String> = got
        .iter()
        .zip(&want)
        .filter(|(g, w)| g != w)
        .map(|(g, w)| format!("{g:?} vs llama-quantize {w:?}"))
        .collect();
    assert!(diff.is_empty(), "types differ:\n{}", diff.join("\n"));
    // Qwen2.5-1.5B has 28 layers: use_more_bits picks Q6_K for attn_v and ffn_down in
    // layers 0-2, 5, 8, ..., 23 and 24-27 (the source is Q4_K_M, so most tensors are copied).
    assert!(want
        .iter()
        .any(|(n, t)| n == "output.weight" && t == "q6_K"));
}

#[test]
fn requantizing_needs_the_flag_and_leaves_no_file() {
    let Some(input) = model("SmolLM2-135M-Instruct.Q4_1.gguf") else {
        return;
    };
    let out = tmp("refused.gguf");
    let r = quantize(&[input.to_str().unwrap(), out.to_str().unwrap(), "q8_0"]);
    let stderr = String::from_utf8_lossy(&r.stderr);
    assert!(!r.status.success());
    assert!(
        stderr.contains("requantizing from type q4_1 is disabled"),
        "{stderr}"
    );
    assert!(!out.exists(), "no output file after a refusal");
}

#[test]
fn bad_arguments_are_refused() {
    let Some(input) = model("SmolLM2-135M-Instruct.Q4_1.gguf") else {
        return;
    };
    let i = input.to_str().unwrap();
    let out = tmp("bad.gguf");
    let o = out.to_str().unwrap();
    for (args, msg) in [
        (vec![i, o, "Q9_K"], "invalid ftype 'Q9_K'"),
        (vec![i, i, "Q8_0"], "input and output files are the same"),
        (
            vec!["--imatrix", "no-such-imatrix.dat", i, o, "Q4_K_M"],
            "cannot read 'no-such-imatrix.dat'",
        ),
        (
            vec!["--imatrix", i, i, o, "Q4_K_M"],
            "missing imatrix metadata",
        ),
        (
            vec!["--output-tensor-type", "q7_0", i, o, "Q4_K_M"],
            "invalid ggml_type 'q7_0'",
        ),
        (vec![i, o, "Q4_K_M", "two"], "invalid nthread 'two'"),
    ] {
        let r = quantize(&args);
        let stderr = String::from_utf8_lossy(&r.stderr);
        assert!(!r.status.success(), "{args:?} succeeded");
        assert!(stderr.contains(msg), "{args:?}: {stderr}");
    }
    assert!(!out.exists());
}
