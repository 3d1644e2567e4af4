//! Hostile and degenerate input: invalid UTF-8, empty input, 10 MiB single lines,
//! broken vocabularies (merges removed, keys missing or mistyped, unknown
//! pre-tokenizer). Every case gives a defined result or a clear error, never a panic.
//!
//! Run: `cargo test -p rustorch-llm --test tokenizer_bad_input --release -- --nocapture`

use std::path::{Path, PathBuf};
use std::time::Instant;

use rustorch_core::gguf::{GgufFile, GgufWriter, Value, ValueType};
use rustorch_llm::tokenizer::{StreamDecoder, Tokenizer, TokenizerError};

fn vocab_path(name: &str) -> Option<PathBuf> {
    let p = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../models/vocab")
        .join(format!("ggml-vocab-{name}.gguf"));
    if p.is_file() {
        Some(p)
    } else {
        eprintln!("SKIPPED: {} not found", p.display());
        None
    }
}

fn load(name: &str) -> Option<Tokenizer> {
    let path = vocab_path(name)?;
    let file = GgufFile::open(&path).expect("open vocab");
    Some(Tokenizer::from_gguf(&file).expect("build tokenizer"))
}

/// The vocabulary's metadata with `edit` applied, as an in-memory GGUF file.
fn edited(name: &str, edit: impl Fn(&str, &Value) -> Option<Value>) -> Option<GgufFile> {
    let path = vocab_path(name)?;
    let file = GgufFile::open(&path).expect("open vocab");
    let mut w = GgufWriter::new();
    for (k, v) in file.metadata() {
        if let Some(v) = edit(k, v) {
            w.add(k.clone(), v);
        }
    }
    Some(GgufFile::from_bytes(w.to_bytes().expect("write gguf")).expect("reparse gguf"))
}

const NASTY: &[&[u8]] = &[
    b"\xff",
    b"\x80\x80\x80",
    b"abc\xff\xfe def \xe4\xb8 end \xc3",
    b"\xc0\x80 overlong \xe0\x80\x80",
    b"\xed\xa0\x80 surrogate \xed\xbf\xbf",
    b"\xf4\x90\x80\x80 above U+10FFFF \xf5\x80\x80\x80 \xf8\x88\x80\x80\x80",
    b"\x00\x00 nul \x00",
    b"<|im_start|\xff|> <s\xff> </s>\xff",
    b"\xe2\x96",
    b"\xf0\x9f\x98",
];

#[test]
fn invalid_utf8_never_panics() {
    for name in [
        "llama-spm",
        "qwen2",
        "gpt-2",
        "bert-bge",
        "gemma-4",
        "nomic-bert-moe",
        "deepseek-llm",
        "falcon",
    ] {
        let Some(tok) = load(name) else { continue };
        for &input in NASTY {
            for (add, parse) in [(false, false), (true, true)] {
                let ids = tok.encode_bytes(input, add, parse).expect("encode");
                assert!(
                    ids.iter().all(|&id| (id as usize) < tok.n_vocab()),
                    "{name}: id out of range for {input:?}"
                );
                let _ = tok.detokenize(&ids, true);
            }
        }
    }
}

#[test]
fn invalid_utf8_semantics_match_llama_cpp() {
    // SentencePiece sees raw bytes: invalid ones become <0xXX> tokens and every byte
    // comes back. (A stray lead byte swallows the bytes after it into one "character",
    // so an escaped space right after it comes back as the three bytes of `▁`, exactly
    // as llama.cpp does.)
    if let Some(spm) = load("llama-spm") {
        for &input in NASTY {
            let ids = spm.encode_bytes(input, false, false).unwrap();
            let back = spm.detokenize(&ids, false);
            let back = String::from_utf8_lossy(&back).replace('\u{2581}', " ");
            assert_eq!(back, String::from_utf8_lossy(input), "llama-spm round trip");
        }
        let ids = spm.encode_bytes(b"\xff", false, false).unwrap();
        assert_eq!(
            ids,
            vec![
                spm.find_token("\u{2581}").unwrap(),
                spm.find_token("<0xFF>").unwrap()
            ]
        );
    }
    // Byte-level BPE decodes first: each undecodable byte is U+FFFD.
    if let Some(bpe) = load("qwen2") {
        let a = bpe.encode_bytes(b"a\xffb\xe4\xb8", false, false).unwrap();
        let b = bpe
            .encode("a\u{FFFD}b\u{FFFD}\u{FFFD}", false, false)
            .unwrap();
        assert_eq!(a, b);
    }
}

#[test]
fn empty_input() {
    for name in [
        "llama-spm",
        "qwen2",
        "bert-bge",
        "gemma-4",
        "nomic-bert-moe",
    ] {
        let Some(tok) = load(name) else { continue };
        assert_eq!(
            tok.encode("", false, true).unwrap(),
            Vec::<u32>::new(),
            "{name}"
        );
        let with_special = tok.encode("", true, true).unwrap();
        let mut expected = Vec::new();
        if tok.add_bos() {
            expected.extend(tok.bos());
        }
        if tok.add_eos() && name != "bert-bge" {
            expected.extend(tok.eos());
        }
        if name == "bert-bge" {
            // WordPiece always wraps in [CLS] ... [SEP].
            expected = vec![101, 102];
        }
        assert_eq!(with_special, expected, "{name}");
        assert!(tok.detokenize(&[], true).is_empty());
        assert!(tok.token_to_piece(u32::MAX, true).is_empty());
        assert!(tok.detokenize(&[u32::MAX], true).is_empty());
    }
}

/// CPU time of this thread in seconds (Linux; 0 elsewhere). The test machine is shared,
/// so wall time alone says little.
fn thread_cpu_secs() -> f64 {
    let stat = std::fs::read_to_string("/proc/thread-self/stat").unwrap_or_default();
    let rest = stat.rsplit_once(')').map(|x| x.1).unwrap_or("");
    let f: Vec<u64> = rest
        .split_whitespace()
        .map(|x| x.parse().unwrap_or(0))
        .collect();
    (f.get(11).unwrap_or(&0) + f.get(12).unwrap_or(&0)) as f64 / 100.0
}

#[test]
fn ten_mib_single_line() {
    let unit = "The quick brown fox jumps over the lazy dog; fn main() { let x = 3333+777; } \
                данные 数据 🦙 café naïve 'quoted' ";
    // 10 MiB in release; 1 MiB in unoptimized builds, which only check for panics.
    let size = if cfg!(debug_assertions) {
        1 << 20
    } else {
        10 << 20
    };
    let mut text = String::with_capacity(size + unit.len());
    while text.len() < size {
        text.push_str(unit);
    }
    let run_of_letters = "a".repeat(size);
    let run_of_spaces = " ".repeat(size);
    for name in ["qwen2", "llama-spm", "gemma-4", "bert-bge"] {
        let Some(tok) = load(name) else { continue };
        for (what, input) in [
            ("mixed", &text),
            ("aaaa", &run_of_letters),
            ("spaces", &run_of_spaces),
        ] {
            let (t, cpu) = (Instant::now(), thread_cpu_secs());
            let ids = tok.encode(input, false, true).unwrap();
            let secs = t.elapsed().as_secs_f64();
            let cpu = thread_cpu_secs() - cpu;
            eprintln!(
                "{name:>10} {what:>6}: {} MiB -> {} tokens in {secs:.2} s ({cpu:.2} s CPU)",
                input.len() >> 20,
                ids.len()
            );
            assert!(!ids.is_empty() || what == "spaces");
            assert!(secs < 60.0, "{name} {what}: {secs:.1} s");
        }
    }
}

#[test]
fn merges_removed() {
    // The key missing entirely: llama.cpp refuses the vocabulary, and so do we.
    if let Some(file) = edited("qwen2", |k, v| {
        (k != "tokenizer.ggml.merges").then(|| v.clone())
    }) {
        let err = Tokenizer::from_gguf(&file).unwrap_err();
        assert!(err.to_string().contains("tokenizer.ggml.merges"), "{err}");
    }
    // An empty merge list: every byte stays its own token.
    if let Some(file) = edited("qwen2", |k, v| {
        Some(if k == "tokenizer.ggml.merges" {
            Value::Array(ValueType::String, Vec::new())
        } else {
            v.clone()
        })
    }) {
        let tok = Tokenizer::from_gguf(&file).unwrap();
        let ids = tok.encode("Hello wörld", false, false).unwrap();
        assert_eq!(ids.len(), "Hello wörld".len());
        assert_eq!(tok.detokenize(&ids, false), "Hello wörld".as_bytes());
    }
    // Half of them: still a lossless tokenization, just a longer one.
    if let Some(file) = edited("qwen2", |k, v| {
        Some(match (k, v) {
            ("tokenizer.ggml.merges", Value::Array(t, items)) => {
                Value::Array(*t, items.iter().step_by(2).cloned().collect())
            }
            _ => v.clone(),
        })
    }) {
        let tok = Tokenizer::from_gguf(&file).unwrap();
        let text = "Some text with merges missing: 3333+777, 数据 🦙";
        let ids = tok.encode(text, false, false).unwrap();
        assert_eq!(tok.detokenize(&ids, false), text.as_bytes());
    }
}

#[test]
fn broken_metadata_gives_clear_errors() {
    let check = |file: Option<GgufFile>, needle: &str| {
        if let Some(file) = file {
            let err = Tokenizer::from_gguf(&file).unwrap_err();
            assert!(
                err.to_string().contains(needle),
                "'{err}' should mention '{needle}'"
            );
        }
    };
    check(
        edited("qwen2", |k, v| {
            (k != "tokenizer.ggml.tokens").then(|| v.clone())
        }),
        "tokenizer.ggml.tokens",
    );
    check(
        edited("qwen2", |k, v| {
            Some(if k == "tokenizer.ggml.pre" {
                Value::String("no-such-pre".into())
            } else {
                v.clone()
            })
        }),
        "no-such-pre",
    );
    check(
        edited("qwen2", |k, v| {
            Some(if k == "tokenizer.ggml.model" {
                Value::String("no-such-model".into())
            } else {
                v.clone()
            })
        }),
        "no-such-model",
    );
    check(
        edited("llama-spm", |k, v| {
            Some(match (k, v) {
                ("tokenizer.ggml.scores", Value::Array(t, items)) => {
                    Value::Array(*t, items[..10].to_vec())
                }
                _ => v.clone(),
            })
        }),
        "tokenizer.ggml.scores",
    );
    check(
        edited("llama-spm", |k, v| {
            Some(if k == "tokenizer.ggml.token_type" {
                Value::String("x".into())
            } else {
                v.clone()
            })
        }),
        "tokenizer.ggml.token_type",
    );
    if let Some(file) = edited("qwen2", |k, v| {
        Some(if k == "tokenizer.ggml.pre" {
            Value::String("tekken".into())
        } else {
            v.clone()
        })
    }) {
        assert!(matches!(
            Tokenizer::from_gguf(&file),
            Err(TokenizerError::UnsupportedPreTokenizer { .. })
        ));
    }
    // Without scores an SPM vocabulary still works (all pieces score 0).
    if let Some(file) = edited("llama-spm", |k, v| {
        (k != "tokenizer.ggml.scores").then(|| v.clone())
    }) {
        let tok = Tokenizer::from_gguf(&file).unwrap();
        let ids = tok.encode("Hello world", false, false).unwrap();
        assert_eq!(tok.detokenize(&ids, false), b"Hello world");
    }
}

#[test]
fn streaming_never_splits_characters() {
    let Some(tok) = load("qwen2") else { return };
    let text = "naïve 🦙🦙 数据 \u{1F468}\u{200D}\u{1F469}\u{200D}\u{1F467} ok";
    let ids = tok.encode(text, false, false).unwrap();
    let mut dec = StreamDecoder::new(false);
    let mut out = String::new();
    let mut split_somewhere = false;
    for &id in &ids {
        let piece = tok.token_to_piece(id, false);
        split_somewhere |= std::str::from_utf8(&piece).is_err();
        out.push_str(&dec.push(&tok, id));
    }
    out.push_str(&dec.finish());
    assert!(
        split_somewhere,
        "test text should split a character across tokens"
    );
    assert_eq!(out, text);

    // Bytes that can never complete become U+FFFD instead of waiting forever.
    let mut dec = StreamDecoder::new(false);
    let ids = tok.encode_bytes(b"\xe4\xb8", false, false).unwrap();
    let mut s = String::new();
    for &id in &ids {
        s.push_str(&dec.push(&tok, id));
    }
    s.push_str(&dec.finish());
    assert!(s.chars().all(|c| c == '\u{FFFD}'));
}
