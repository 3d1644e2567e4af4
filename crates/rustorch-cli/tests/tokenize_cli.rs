//! `rustorch tokenize --ids` prints what `llama-tokenize --ids` prints. The expected
//! lists were produced by llama.cpp's llama-tokenize (llama-cpp-python 0.3.36 vendored
//! tree) on SmolLM2-135M-Instruct.Q4_1.gguf for the same text.

use std::process::Command;

const TEXT: &str = "Hello <|im_start|> world, 3333+777 日本語 🎉";

fn run(extra: &[&str]) -> Option<String> {
    let root = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let model = root.join("models/SmolLM2-135M-Instruct.Q4_1.gguf");
    if !model.exists() {
        eprintln!(
            "SKIPPED: {} is absent (run scripts/fetch-models.sh)",
            model.display()
        );
        return None;
    }
    let o = Command::new(env!("CARGO_BIN_EXE_rustorch"))
        .args(["tokenize", "-m"])
        .arg(&model)
        .args(["-p", TEXT, "--ids"])
        .args(extra)
        .output()
        .expect("run");
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    Some(String::from_utf8(o.stdout).expect("utf-8"))
}

#[test]
fn ids_equal_llama_tokenize() {
    if let Some(out) = run(&[]) {
        assert_eq!(out.trim(), "[19556, 216, 1, 905, 28, 216, 35, 35, 35, 35, 27, 39, 39, 39, 17097, 241, 115, 40993, 179, 120, 248, 15107, 232, 227]");
    }
    if let Some(out) = run(&["--no-parse-special"]) {
        assert_eq!(out.trim(), "[19556, 2067, 108, 306, 79, 3738, 108, 46, 905, 28, 216, 35, 35, 35, 35, 27, 39, 39, 39, 17097, 241, 115, 40993, 179, 120, 248, 15107, 232, 227]");
    }
}

#[test]
fn exactly_one_input_source() {
    let o = Command::new(env!("CARGO_BIN_EXE_rustorch"))
        .args(["tokenize", "-p", "a", "--stdin"])
        .output()
        .expect("run");
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stderr).contains("exactly one"));
}
