//! llama.cpp's tokenizer test vectors: every `models/vocab/ggml-vocab-*.gguf` that has
//! `.inp`/`.out` files (written by llama.cpp's `tests/test-tokenizer-0.py`, read here
//! the way `tests/test-tokenizer-0.cpp` reads them: inputs separated by
//! `\n__ggml_vocab_test__\n`, one line of ids per input, tokenized with
//! `add_special = false, parse_special = false`). Every case must match.
//!
//! Run: `cargo test -p rustorch-llm --test tokenizer_vocab --release -- --nocapture`

use std::path::{Path, PathBuf};

use rustorch_core::gguf::GgufFile;
use rustorch_llm::tokenizer::{Tokenizer, VocabType};

fn vocab_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/vocab")
}

/// `(input bytes, expected ids)` pairs.
fn read_cases(inp: &Path, out: &Path) -> Vec<(Vec<u8>, Vec<u32>)> {
    let raw = std::fs::read(inp).expect("read .inp");
    let sep = b"\n__ggml_vocab_test__\n";
    let mut inputs = Vec::new();
    let mut pos = 0;
    while pos < raw.len() {
        match raw[pos..].windows(sep.len()).position(|w| w == sep) {
            Some(i) => {
                inputs.push(raw[pos..pos + i].to_vec());
                pos += i + sep.len();
            }
            None => {
                inputs.push(raw[pos..].to_vec());
                break;
            }
        }
    }
    let outputs: Vec<Vec<u32>> = std::fs::read_to_string(out)
        .expect("read .out")
        .lines()
        .map(|l| {
            l.split_whitespace()
                .map(|t| t.parse().expect("token id"))
                .collect()
        })
        .collect();
    assert_eq!(inputs.len(), outputs.len(), "{}: case count", inp.display());
    inputs.into_iter().zip(outputs).collect()
}

/// Vocabularies whose detokenization gives back every test input byte for byte.
/// (The others lowercase (bert) or clean up spaces before punctuation.)
const LOSSLESS: &[&str] = &[
    "ggml-vocab-command-r.gguf",
    "ggml-vocab-deepseek-coder.gguf",
    "ggml-vocab-deepseek-llm.gguf",
    "ggml-vocab-llama-spm.gguf",
    "ggml-vocab-phi-3.gguf",
    "ggml-vocab-qwen2.gguf",
    "ggml-vocab-qwen35.gguf",
];

#[test]
fn ggml_vocab_test_vectors() {
    let dir = vocab_dir();
    if !dir.is_dir() {
        eprintln!("SKIPPED: {} not found", dir.display());
        return;
    }
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .expect("read models/vocab")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            let name = p.file_name().and_then(|n| n.to_str()).unwrap_or_default();
            name.starts_with("ggml-vocab-") && name.ends_with(".gguf")
        })
        .filter(|p| {
            p.with_extension("gguf.inp").is_file() && p.with_extension("gguf.out").is_file()
        })
        .collect();
    files.sort();
    assert!(
        !files.is_empty(),
        "no vocab test vectors in {}",
        dir.display()
    );

    let mut failures = Vec::new();
    eprintln!(
        "{:<34} {:>5} {:>10} {:>12}",
        "vocab", "type", "encode", "round-trip"
    );
    for path in &files {
        let name = path.file_name().unwrap().to_string_lossy().to_string();
        let cases = read_cases(
            &path.with_extension("gguf.inp"),
            &path.with_extension("gguf.out"),
        );
        let file = GgufFile::open(path).expect("open vocab");
        let tok = match Tokenizer::from_gguf(&file) {
            Ok(t) => t,
            Err(e) => {
                failures.push(format!("{name}: cannot build tokenizer: {e}"));
                continue;
            }
        };
        let (mut ok, mut rt_ok) = (0, 0);
        for (input, want) in &cases {
            let got = tok.encode_bytes(input, false, false).expect("encode");
            if &got == want {
                ok += 1;
            } else {
                failures.push(format!(
                    "{name}: {:?}\n    want {want:?}\n    got  {got:?}",
                    String::from_utf8_lossy(input)
                ));
            }
            if tok.detokenize(want, false) == *input {
                rt_ok += 1;
            } else if LOSSLESS.contains(&name.as_str()) {
                failures.push(format!(
                    "{name}: round trip of {:?} gave {:?}",
                    String::from_utf8_lossy(input),
                    String::from_utf8_lossy(&tok.detokenize(want, false))
                ));
            }
        }
        let kind = match tok.vocab_type() {
            VocabType::Spm => "SPM",
            VocabType::Bpe => "BPE",
            VocabType::Wpm => "WPM",
            VocabType::Ugm => "UGM",
        };
        let n = cases.len();
        eprintln!("{name:<34} {kind:>5} {ok:>6}/{n:<3} {rt_ok:>8}/{n:<3}");
    }
    assert!(
        failures.is_empty(),
        "{} failures:\n{}",
        failures.len(),
        failures.join("\n")
    );
}
