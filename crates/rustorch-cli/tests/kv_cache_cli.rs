//! `-ctk` / `-ctv` end to end: `rustorch run` with a quantized KV cache prints llama.cpp's
//! greedy continuation (tests/fixtures/kv_quant, recorded by
//! scripts/record_kv_quant_fixtures.py) and the cache's size line; bad names are errors
//! listing the valid ones; bench reports the types.

use std::path::PathBuf;
use std::process::{Command, Output};

use rustorch_core::gguf::GgufFile;
use rustorch_llm::tokenizer::Tokenizer;
use serde_json::Value;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

const SMOL: &str = "models/SmolLM2-135M-Instruct.Q4_1.gguf";

fn smol_present() -> bool {
    let ok = root().join(SMOL).exists();
    if !ok {
        eprintln!("SKIPPED: {SMOL} is absent (run scripts/fetch-models.sh)");
    }
    ok
}

fn rustorch(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_rustorch"))
        .args(args)
        .current_dir(root())
        .output()
        .expect("run rustorch")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// `rustorch run --temp 0` prints llama.cpp's greedy continuation of the first prompt of
/// each fixture (SmolLM2's arithmetic does not depend on the batch size, so computing logits
/// for the last prompt token only gives the recorded ones).
#[test]
fn run_with_a_quantized_cache_prints_llama_cpp_s_continuation() {
    if !smol_present() {
        return;
    }
    let gguf = GgufFile::open(root().join(SMOL)).expect("model");
    let tok = Tokenizer::from_gguf(&gguf).expect("vocabulary");
    for (k, v) in [("q8_0", "q8_0"), ("q4_0", "q4_0"), ("q4_1", "q5_1")] {
        let path = root().join(format!("tests/fixtures/kv_quant/smollm2-{k}-{v}.json"));
        let doc: Value =
            serde_json::from_slice(&std::fs::read(&path).expect("fixture")).expect("json");
        let case = &doc["cases"][0];
        let cont: Vec<u32> = case["continuation"]
            .as_array()
            .expect("continuation")
            .iter()
            .map(|t| t.as_u64().expect("id") as u32)
            .collect();
        let want = String::from_utf8_lossy(&tok.detokenize(&cont, false)).into_owned();
        let n = cont.len().to_string();
        let o = rustorch(&[
            "run",
            "-m",
            SMOL,
            "-p",
            case["prompt"].as_str().expect("prompt"),
            "-n",
            &n,
            "--temp",
            "0",
            "-c",
            "512",
            "-t",
            "2",
            "-ctk",
            k,
            "-ctv",
            v,
            // llama.cpp's flag, which it needs for a quantized V cache
            "-fa",
            "on",
        ]);
        assert!(o.status.success(), "{}", stderr(&o));
        let got = String::from_utf8_lossy(&o.stdout).into_owned();
        assert_eq!(got.trim_end(), want.trim_end(), "K {k} V {v}");
        let err = stderr(&o);
        assert!(
            err.contains("KV cache: size =")
                && err.contains(&format!("K ({k}):"))
                && err.contains(&format!("V ({v}):")),
            "{err}"
        );
    }
}

/// The cache line's sizes are llama.cpp's (`llama_kv_cache: size = 5.98 MiB (512 cells, 30
/// layers, 1/1 seqs), K (q8_0): 2.99 MiB, V (q8_0): 2.99 MiB` for SmolLM2 with `-c 512`).
#[test]
fn the_size_line_matches_llama_cpp() {
    if !smol_present() {
        return;
    }
    let o = rustorch(&[
        "run", "-m", SMOL, "-p", "Hi", "-n", "1", "-c", "512", "-ctk", "q8_0", "-ctv", "q8_0",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let err = stderr(&o);
    assert!(
        err.contains(
            "KV cache: size =    5.98 MiB (   512 cells,  30 layers), K (q8_0):    2.99 MiB, V (q8_0):    2.99 MiB"
        ),
        "{err}"
    );
}

#[test]
fn unknown_cache_types_are_errors_listing_the_valid_ones() {
    for args in [
        &["run", "-p", "hi", "-ctk", "q9_0"][..],
        &["run", "-p", "hi", "--cache-type-v", "bf16"][..],
        &["bench", "-p", "0", "-n", "1", "-ctv", "int8"][..],
    ] {
        let o = rustorch(args);
        assert_eq!(o.status.code(), Some(1), "{args:?}");
        let err = stderr(&o);
        assert!(
            err.contains("unsupported KV cache type")
                && err.contains("f32, f16, q8_0, q4_0, q4_1, q5_0, q5_1, iq4_nl"),
            "{args:?}: {err}"
        );
        assert!(!err.contains("panicked"), "{err}");
    }
    let o = rustorch(&["run", "-p", "hi", "-fa", "off"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).contains("flash attention only (on or auto)"),
        "{}",
        stderr(&o)
    );
}

#[test]
fn bench_reports_the_cache_types() {
    if !smol_present() {
        return;
    }
    let o = rustorch(&[
        "bench", "-m", SMOL, "-p", "0", "-n", "2", "-r", "1", "-t", "2", "--device", "cpu", "-ctk",
        "q4_0", "-ctv", "iq4_nl", "-o", "json",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: Value = serde_json::from_slice(&o.stdout).expect("json");
    assert_eq!(v[0]["type_k"], "q4_0");
    assert_eq!(v[0]["type_v"], "iq4_nl");
}

/// `rustorch perplexity -ctk/-ctv` writes log-probabilities byte-identical to
/// llama-perplexity's (tests/fixtures/kv_quant/perplexity.json: SHA-256 of its
/// `--kl-divergence-base` file) at llama.cpp's default micro-batch size: with a quantized
/// cache its flash attention keeps the one-row algorithm for these 128-row sequences.
#[test]
fn perplexity_with_a_quantized_cache_equals_llama_perplexity() {
    if !smol_present() {
        return;
    }
    use sha2::{Digest, Sha256};
    let fix: Value = serde_json::from_slice(
        &std::fs::read(root().join("tests/fixtures/kv_quant/perplexity.json")).expect("fixture"),
    )
    .expect("json");
    let dir =
        PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("kvq-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("scratch dir");
    let args: Vec<String> = fix["args"]
        .as_array()
        .expect("args")
        .iter()
        .map(|a| a.as_str().expect("arg").to_string())
        .collect();
    for run in fix["runs"].as_array().expect("runs") {
        let (k, v) = (
            run["type_k"].as_str().expect("type_k"),
            run["type_v"].as_str().expect("type_v"),
        );
        let out = dir.join(format!("base-{k}-{v}.bin"));
        let mut cmd: Vec<&str> = vec![
            "perplexity",
            "-m",
            SMOL,
            "-f",
            "tests/fixtures/kld/text.txt",
        ];
        cmd.extend(args.iter().map(String::as_str));
        cmd.extend(["-ctk", k, "-ctv", v, "--kl-divergence-base"]);
        let out_s = out.to_string_lossy().into_owned();
        cmd.push(&out_s);
        let o = rustorch(&cmd);
        assert!(o.status.success(), "{}", stderr(&o));
        let final_line = run["final"].as_str().expect("final");
        let said = format!("{}{}", String::from_utf8_lossy(&o.stdout), stderr(&o));
        assert!(said.contains(final_line), "K {k} V {v}: {said}");
        let data = std::fs::read(&out).expect("base file");
        assert_eq!(
            data.len() as u64,
            run["base_bytes"].as_u64().expect("bytes")
        );
        let sha: String = Sha256::digest(&data)
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        assert_eq!(
            sha,
            run["base_sha256"].as_str().expect("sha"),
            "K {k} V {v}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}
