//! Fixtures recorded from llama.cpp's `llama-tokenize` by
//! `scripts/record_tokenizer_fixtures.py` (tests/fixtures/tokenizer/*.json): ids for
//! chat templates with special tokens, code, CJK, emoji, combining marks, odd
//! whitespace, digits, invalid UTF-8 and the empty string, with and without
//! `parse_special` and `add_special`; the per-token pieces llama.cpp printed; and the
//! special-token ids from its load log. Everything must match.
//!
//! Run: `cargo test -p rustorch-llm --test tokenizer_models --release -- --nocapture`

use std::path::{Path, PathBuf};

use rustorch_core::gguf::GgufFile;
use rustorch_llm::tokenizer::{Tokenizer, VocabType};
use serde::Deserialize;

#[derive(Deserialize)]
struct Fixture {
    model: String,
    recorded_with: String,
    add_bos: Option<bool>,
    n_vocab: usize,
    bos: Option<u32>,
    eos: Option<u32>,
    eot: Option<u32>,
    unk: Option<u32>,
    pad: Option<u32>,
    eog: Vec<u32>,
    cases: Vec<Case>,
}

#[derive(Deserialize)]
struct Case {
    name: String,
    parse_special: bool,
    add_special: bool,
    text: Option<String>,
    bytes_hex: Option<String>,
    ids: Vec<u32>,
    pieces_hex: Option<Vec<String>>,
}

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex"))
        .collect()
}

impl Case {
    fn input(&self) -> Vec<u8> {
        match (&self.text, &self.bytes_hex) {
            (Some(t), _) => t.as_bytes().to_vec(),
            (None, Some(h)) => unhex(h),
            (None, None) => panic!("case {} has no input", self.name),
        }
    }
}

/// Cases whose detokenization differs from the input by design: these vocabularies
/// have llama.cpp's "clean up tokenization spaces" on (" ." -> "."); and in Phi-3 and
/// Baichuan (SentencePiece with a space prefix) text after a special token gets a space
/// prefixed, and Phi-3's special tokens also strip the whitespace after them.
fn not_lossless(model: &str, case: &str) -> bool {
    let cleans = ["llama-bpe", "gemma-4", "gpt-neox", "aquila"];
    let prefixed = ["phi-3", "baichuan"];
    let with_specials = ["chat_phi3", "strip_attrs", "special_mentions"];
    cleans.iter().any(|m| model.contains(m))
        || (prefixed.iter().any(|m| model.contains(m)) && with_specials.contains(&case))
}

#[test]
fn llama_cpp_recorded_fixtures() {
    let dir = root().join("tests/fixtures/tokenizer");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .collect();
    files.sort();
    assert!(!files.is_empty(), "no fixtures in {}", dir.display());

    let mut failures = Vec::new();
    let mut checked_models = 0;
    for path in &files {
        let fx: Fixture = serde_json::from_slice(&std::fs::read(path).expect("read fixture"))
            .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let model_path = root().join("models").join(&fx.model);
        if !model_path.is_file() {
            eprintln!("SKIPPED {}: {} not found", fx.model, model_path.display());
            continue;
        }
        checked_models += 1;
        let file = GgufFile::open(&model_path).expect("open model");
        let tok = Tokenizer::from_gguf(&file).expect("build tokenizer");
        let mut fail = |msg: String| failures.push(format!("{}: {msg}", fx.model));

        if tok.n_vocab() != fx.n_vocab {
            fail(format!("n_vocab {} != {}", tok.n_vocab(), fx.n_vocab));
        }
        for (what, ours, theirs) in [
            ("bos", tok.bos(), fx.bos),
            ("eos", tok.eos(), fx.eos),
            ("eot", tok.eot(), fx.eot),
            ("unk", tok.unk(), fx.unk),
            ("pad", tok.pad(), fx.pad),
        ] {
            if ours != theirs {
                fail(format!("{what} {ours:?} != llama.cpp {theirs:?}"));
            }
        }
        let eog: Vec<u32> = tok.eog_ids().collect();
        if eog != fx.eog {
            fail(format!("EOG set {eog:?} != llama.cpp {:?}", fx.eog));
        }
        if fx.add_bos.is_some_and(|b| b != tok.add_bos()) {
            fail(format!(
                "add_bos {} != llama.cpp {:?}",
                tok.add_bos(),
                fx.add_bos
            ));
        }

        // Byte-exact round trips are expected where nothing is lost: valid UTF-8 into
        // a vocabulary that neither normalizes (Unigram) nor cleans spaces.
        let lossless_vocab = tok.vocab_type() != VocabType::Ugm;
        let (mut ok, mut pieces_ok, mut pieces_n, mut rt_ok, mut rt_n) = (0, 0, 0, 0, 0);
        for case in &fx.cases {
            let input = case.input();
            let got = tok
                .encode_bytes(&input, case.add_special, case.parse_special)
                .expect("encode");
            if got == case.ids {
                ok += 1;
            } else {
                fail(format!(
                    "{} (parse_special={}, add_special={}):\n    want {:?}\n    got  {:?}",
                    case.name, case.parse_special, case.add_special, case.ids, got
                ));
            }
            if let Some(pieces) = &case.pieces_hex {
                for (&id, hex) in case.ids.iter().zip(pieces) {
                    pieces_n += 1;
                    // llama-tokenize prints pieces with printf("%s"): up to a NUL.
                    let mine = tok.token_to_piece(id, true);
                    let mine = mine.split(|&b| b == 0).next().unwrap_or_default();
                    if mine == unhex(hex) {
                        pieces_ok += 1;
                    } else {
                        fail(format!("piece of {id}: {:?} != {:?}", mine, unhex(hex)));
                    }
                }
            }
            // With add_special, llama.cpp keeps SentencePiece's leading space when it
            // drops the BOS, so only texts tokenized without specials added round-trip.
            let valid_utf8 = std::str::from_utf8(&input).is_ok();
            if lossless_vocab
                && valid_utf8
                && case.parse_special
                && !case.add_special
                && !not_lossless(&fx.model, &case.name)
            {
                rt_n += 1;
                let back = tok.detokenize(&case.ids, true);
                if back == input {
                    rt_ok += 1;
                } else {
                    fail(format!(
                        "round trip of {}: {:?}",
                        case.name,
                        String::from_utf8_lossy(&back)
                    ));
                }
            }
        }
        eprintln!(
            "{:<45} encode {ok}/{} pieces {pieces_ok}/{pieces_n} round-trip {rt_ok}/{rt_n} ({})",
            fx.model,
            fx.cases.len(),
            fx.recorded_with
        );
    }
    assert!(checked_models > 0, "no fixture model found under models/");
    assert!(
        failures.is_empty(),
        "{} failures:\n{}",
        failures.len(),
        failures.join("\n")
    );
}
