//! `rustorch inspect --json` on every real model and vocab GGUF, compared with the
//! fixtures that `scripts/record_gguf_fixtures.py` recorded with gguf-py's
//! `GGUFReader`: header numbers, metadata key count, and each tensor's name, type
//! and shape. A model that is absent is skipped with a note on stderr
//! (`scripts/fetch-models.sh --all` fetches them all).

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value as Json;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn fixtures() -> PathBuf {
    root().join("tests/fixtures/gguf")
}

fn skip(what: &str) {
    // Straight to stderr, not through the test harness's capture, so a skip shows.
    let _ = writeln!(std::io::stderr(), "SKIPPED: {what}");
}

fn inspect(path: &Path, extra: &[&str]) -> Json {
    let out = Command::new(env!("CARGO_BIN_EXE_rustorch"))
        .arg("inspect")
        .arg(path)
        .args(extra)
        .output()
        .expect("run rustorch");
    assert!(
        out.status.success(),
        "rustorch inspect {} failed: {}",
        path.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    if extra.contains(&"--json") {
        serde_json::from_slice(&out.stdout).expect("inspect --json prints one JSON document")
    } else {
        Json::String(String::from_utf8(out.stdout).expect("UTF-8 output"))
    }
}

fn u(j: &Json, key: &str) -> u64 {
    j[key]
        .as_u64()
        .unwrap_or_else(|| panic!("{key} missing in {j:.200}"))
}

/// Checks one GGUF file against its fixture; false if the file is absent.
fn check(gguf: &Path) -> bool {
    let stem = gguf
        .file_name()
        .and_then(|n| n.to_str())
        .expect("name")
        .trim_end_matches(".gguf");
    let fixture_path = fixtures().join(format!("{stem}.json"));
    if !gguf.is_file() {
        skip(&format!(
            "{} absent (scripts/fetch-models.sh --all)",
            gguf.display()
        ));
        return false;
    }
    let text = std::fs::read_to_string(&fixture_path).unwrap_or_else(|e| {
        panic!(
            "{}: {e} (scripts/record_gguf_fixtures.py records it)",
            fixture_path.display()
        )
    });
    let want: Json = serde_json::from_str(&text).expect("fixture JSON");
    let got = inspect(gguf, &["--json"]);

    for (ours, theirs) in [
        ("version", "version"),
        ("tensor_count", "tensor_count"),
        ("metadata_count", "kv_count"),
        ("alignment", "alignment"),
        ("data_offset", "data_offset"),
    ] {
        assert_eq!(u(&got, ours), u(&want, theirs), "{stem}: {ours}");
    }
    assert_eq!(
        got["metadata"].as_array().expect("metadata").len() as u64,
        u(&want, "kv_count")
    );

    let got_t = got["tensors"].as_array().expect("tensors");
    let want_t = want["tensors"].as_array().expect("tensors");
    assert_eq!(got_t.len(), want_t.len(), "{stem}: tensor count");
    for (i, (g, w)) in got_t.iter().zip(want_t).enumerate() {
        assert_eq!(g["name"], w["name"], "{stem}: tensor {i} name");
        assert_eq!(
            g["type"], w["type"],
            "{stem}: tensor {i} ({}) type",
            w["name"]
        );
        assert_eq!(
            g["shape"], w["shape"],
            "{stem}: tensor {i} ({}) shape",
            w["name"]
        );
    }

    // Internal consistency of what inspect reports.
    let file_size = u(&got, "file_size");
    assert_eq!(file_size, std::fs::metadata(gguf).expect("stat").len());
    let data_offset = u(&got, "data_offset");
    let (mut params, mut bytes, mut end) = (0u64, 0u64, data_offset);
    for t in got_t {
        let shape: Vec<u64> = t["shape"]
            .as_array()
            .expect("shape")
            .iter()
            .filter_map(Json::as_u64)
            .collect();
        assert_eq!(u(t, "n_elements"), shape.iter().product::<u64>());
        assert_eq!(u(t, "offset"), data_offset + u(t, "relative_offset"));
        assert!(
            u(t, "offset") >= end,
            "{stem}: {} overlaps the previous tensor",
            t["name"]
        );
        end = u(t, "offset") + u(t, "n_bytes");
        assert!(end <= file_size);
        params += u(t, "n_elements");
        bytes += u(t, "n_bytes");
    }
    let totals = &got["totals"];
    assert_eq!(u(totals, "tensors"), got_t.len() as u64);
    assert_eq!(u(totals, "parameters"), params);
    assert_eq!(u(totals, "bytes"), bytes);
    let by_type = totals["by_type"].as_array().expect("by_type");
    assert_eq!(by_type.iter().map(|t| u(t, "bytes")).sum::<u64>(), bytes);
    assert_eq!(
        by_type.iter().map(|t| u(t, "tensors")).sum::<u64>(),
        got_t.len() as u64
    );

    // The vocabulary size is the length of the tokens array.
    let tokens = got["metadata"]
        .as_array()
        .expect("metadata")
        .iter()
        .find(|m| m["key"] == "tokenizer.ggml.tokens");
    if let Some(tokens) = tokens {
        assert_eq!(
            got["architecture"]["vocab_size"], tokens["n_items"],
            "{stem}"
        );
        assert_eq!(tokens["truncated"], true);
        assert_eq!(tokens["value"].as_array().map(Vec::len), Some(8));
    }
    true
}

fn model(file: &str) -> PathBuf {
    root().join("models").join(file)
}

#[test]
fn smollm2_135m_q4_1() {
    let path = model("SmolLM2-135M-Instruct.Q4_1.gguf");
    if !check(&path) {
        return;
    }
    let j = inspect(&path, &["--json"]);
    let a = &j["architecture"];
    assert_eq!(a["name"], "llama");
    assert_eq!(a["block_count"], 30);
    assert_eq!(a["embedding_length"], 576);
    assert_eq!(a["feed_forward_length"], 1536);
    assert_eq!(a["head_count"], 9);
    assert_eq!(a["head_count_kv"], 3);
    assert_eq!(a["head_dim"], 64);
    assert_eq!(a["context_length"], 8192);
    assert_eq!(a["rope_freq_base"], 100000.0);
    assert_eq!(a["vocab_size"], 49152);
    assert_eq!(a["parameters"], 134_515_008u64);
    // f32 values print as stored (1e-5), not widened (9.999999747378752e-06).
    let eps = j["metadata"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["key"] == "llama.attention.layer_norm_rms_epsilon");
    assert_eq!(eps.unwrap()["value"], 1e-5);

    // The chat template is shortened unless --full.
    let template = |j: &Json| -> Json {
        j["metadata"]
            .as_array()
            .unwrap()
            .iter()
            .find(|m| m["key"] == "tokenizer.chat_template")
            .unwrap()
            .clone()
    };
    let short = template(&j);
    assert_eq!(short["truncated"], true);
    assert!(
        short["value"].as_str().unwrap().chars().count()
            < short["n_chars"].as_u64().unwrap() as usize
    );
    let full = inspect(&path, &["--json", "--full"]);
    let long = template(&full);
    assert_eq!(long["truncated"], Json::Null);
    assert_eq!(
        long["value"].as_str().unwrap().chars().count() as u64,
        long["n_chars"].as_u64().unwrap()
    );
    for m in full["metadata"].as_array().unwrap() {
        if let Some(n) = m["n_items"].as_u64() {
            assert_eq!(
                m["value"].as_array().unwrap().len() as u64,
                n,
                "{}",
                m["key"]
            );
        }
    }

    // The tables carry the same information.
    let text = inspect(&path, &[]);
    let text = text.as_str().unwrap();
    for needle in [
        "version 3, alignment 32, data offset 1785664",
        "architecture: llama",
        "head dim             64 (embedding_length / head_count)",
        "vocab size           49152 (tokenizer.ggml.tokens)",
        "tokenizer.ggml.tokens",
        "(49152 items)",
        "token_embd.weight",
        "[576, 49152]",
        "Q8_0",
        "parameters   134515008",
    ] {
        assert!(text.contains(needle), "text output lacks {needle:?}");
    }
    assert_eq!(
        text.lines()
            .filter(|l| l.contains("blk.") && l.contains("Q4_1"))
            .count(),
        210
    );
}

#[test]
fn qwen25_coder_05b_q4_k_m() {
    let path = model("qwen2.5-coder-0.5b-instruct-q4km.gguf");
    if check(&path) {
        let a = inspect(&path, &["--json"])["architecture"].clone();
        assert_eq!(
            (
                a["name"].as_str(),
                a["head_count"].as_u64(),
                a["head_count_kv"].as_u64()
            ),
            (Some("qwen2"), Some(14), Some(2))
        );
        assert_eq!(a["head_dim"], 64);
        assert_eq!(a["vocab_size"], 151936);
    }
}

#[test]
fn qwen25_coder_15b_q4_k_m() {
    let path = model("qwen2.5-coder-1.5b-instruct-q4_k_m.gguf");
    if check(&path) {
        let a = inspect(&path, &["--json"])["architecture"].clone();
        assert_eq!(a["block_count"], 28);
        assert_eq!(a["head_dim"], 128);
        assert_eq!(a["rope_freq_base"], 1000000.0);
    }
}

#[test]
fn gemma3_270m_q4_k_m() {
    let path = model("gemma-3-270m-q4_k_m.gguf");
    if check(&path) {
        let a = inspect(&path, &["--json"])["architecture"].clone();
        assert_eq!(a["name"], "gemma3");
        // gemma3 sets key_length (256), not embedding_length / heads (160).
        assert_eq!(a["head_dim"], 256);
        assert_eq!(a["head_dim_source"], "key_length");
        assert_eq!(a["vocab_size"], 262144);
    }
}

/// Every vocab-only GGUF: no tensors, and the vocabulary summarised. Driven by the
/// committed fixtures (an absent vocab file is skipped); a vocab file present without
/// a fixture fails, so that a new one is not silently left out.
#[test]
fn vocab_ggufs() {
    let dir = root().join("models/vocab");
    let mut fixtures: Vec<String> = std::fs::read_dir(fixtures())
        .expect("fixture directory")
        .filter_map(Result::ok)
        .filter_map(|e| e.file_name().to_str().map(str::to_string))
        .filter(|n| n.starts_with("ggml-vocab-") && n.ends_with(".json"))
        .collect();
    fixtures.sort();
    assert!(!fixtures.is_empty(), "no vocab fixtures");
    let mut checked = 0;
    for name in &fixtures {
        let gguf = dir.join(name.replace(".json", ".gguf"));
        if !check(&gguf) {
            continue;
        }
        let j = inspect(&gguf, &["--json"]);
        assert_eq!(j["tensor_count"], 0, "{}", gguf.display());
        assert_eq!(j["totals"]["parameters"], 0);
        assert!(
            j["architecture"]["vocab_size"].as_u64().unwrap_or(0) > 0,
            "{}",
            gguf.display()
        );
        checked += 1;
    }
    if let Ok(entries) = std::fs::read_dir(&dir) {
        for e in entries.filter_map(Result::ok) {
            let n = e.file_name().to_string_lossy().into_owned();
            if let Some(stem) = n.strip_suffix(".gguf") {
                assert!(
                    fixtures.contains(&format!("{stem}.json")),
                    "{n} has no fixture: run scripts/record_gguf_fixtures.py"
                );
            }
        }
    }
    let _ = writeln!(
        std::io::stderr(),
        "checked {checked} of {} vocab GGUFs",
        fixtures.len()
    );
}

/// The gguf-py writer reference (always present): every value type, nested arrays.
#[test]
fn writer_reference_file() {
    let path = fixtures().join("writer-reference.gguf");
    let j = inspect(&path, &["--json"]);
    assert_eq!(j["tensor_count"], 5);
    assert_eq!(j["architecture"]["name"], "rustorch-test");
    assert_eq!(j["architecture"]["block_count"], Json::Null);
    let meta = j["metadata"].as_array().unwrap();
    let get = |k: &str| {
        meta.iter()
            .find(|m| m["key"] == k)
            .unwrap_or_else(|| panic!("{k}"))
            .clone()
    };
    assert_eq!(get("test.u64")["value"], u64::MAX);
    assert_eq!(get("test.i64")["value"], i64::MIN);
    assert_eq!(get("test.f32")["value"], 0.1);
    assert_eq!(get("test.f32.inf")["value"], "inf");
    assert_eq!(get("test.array.nested")["type"], "ARRAY[ARRAY[INT32]]");
    assert_eq!(
        get("test.array.nested3")["type"],
        "ARRAY[ARRAY[ARRAY[STRING]]]"
    );
    assert_eq!(
        get("test.array.nested")["value"],
        serde_json::json!([[1, 2], [3], [4, 5, 6]])
    );
    assert_eq!(get("test.array.long")["n_items"], 20);
    assert_eq!(get("test.array.long")["truncated"], true);
    let q8 = &j["tensors"][2];
    assert_eq!(
        (q8["type"].as_str(), q8["n_bytes"].as_u64()),
        (Some("Q8_0"), Some(204))
    );
    assert_eq!(q8["shape"], serde_json::json!([64, 3]));

    let text = inspect(&path, &[]);
    let text = text.as_str().unwrap();
    assert!(
        text.contains("[0, 1, 2, 3, 4, 5, 6, 7, …] (20 items)"),
        "{text}"
    );
    assert!(text.contains("[[1, 2], [3], [4, 5, 6]]"));
    let full = inspect(&path, &["--full"]);
    assert!(full
        .as_str()
        .unwrap()
        .contains("[0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19]"));
}
