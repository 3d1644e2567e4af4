//! Prompt escapes as llama.cpp processes them (`-e/--escape`, on by default; `--no-escape`):
//! `rustorch tokenize -p` gives llama-tokenize's ids for every recorded prompt
//! (tests/fixtures/escapes/escapes.json, from scripts/record_escape_fixtures.py).

use std::path::PathBuf;
use std::process::Command;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

#[test]
fn escapes_tokenize_like_llama_tokenize() {
    let doc: serde_json::Value = serde_json::from_slice(
        &std::fs::read(root().join("tests/fixtures/escapes/escapes.json")).expect("fixture"),
    )
    .expect("json");
    let mut checked = 0;
    for c in doc["cases"].as_array().expect("cases") {
        let vocab = root()
            .join("models/vocab")
            .join(c["vocab"].as_str().expect("vocab"));
        if !vocab.exists() {
            eprintln!("SKIPPED: {} is absent", vocab.display());
            continue;
        }
        let prompt = c["prompt"].as_str().expect("prompt");
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_rustorch"));
        cmd.arg("tokenize")
            .arg("-m")
            .arg(&vocab)
            .args(["-p", prompt, "--ids"]);
        if !c["escape"].as_bool().expect("escape") {
            cmd.arg("--no-escape");
        }
        let o = cmd.output().expect("run");
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let got: Vec<u64> =
            serde_json::from_slice(String::from_utf8_lossy(&o.stdout).trim().as_bytes())
                .expect("ids");
        let want: Vec<u64> = c["ids"]
            .as_array()
            .expect("ids")
            .iter()
            .map(|v| v.as_u64().expect("id"))
            .collect();
        assert_eq!(got, want, "{c}");
        checked += 1;
    }
    eprintln!("{checked} prompts tokenized as llama-tokenize does");
}
