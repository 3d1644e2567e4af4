//! Quantized KV caches (`-ctk` / `-ctv`) against llama.cpp: greedy continuations and every
//! step's full logits (by SHA-256) of SmolLM2-135M Q4_1 and Qwen2.5-Coder-0.5B with
//! `q8_0`/`q8_0` and `q4_0`/`q4_0` caches, and of SmolLM2 with other types and mixed pairs,
//! recorded from llama.cpp (flash attention on) by `scripts/record_kv_quant_fixtures.py`.

mod common;

use std::fs;

use rustorch_llm::kv_cache::{parse_kv_type, KvTypes};
use rustorch_llm::{Batch, Runtime};
use serde_json::Value;
use sha2::{Digest, Sha256};

use common::{argmax, ids, load_model, logsumexp, root};

/// What one fixture gave: steps compared, steps whose logits equal llama.cpp's bit for bit,
/// the first greedy divergence (case, step), the largest |Δ| over the recorded top logits.
struct Outcome {
    steps: usize,
    exact: usize,
    inexact: Vec<(usize, usize)>,
    diverged: Option<(usize, usize)>,
    max_delta: f32,
    /// Largest KL(llama.cpp ‖ ours) over the recorded top-5 ids and one bucket for the rest.
    max_kl: f64,
    /// SHA-256 of our logits at every step.
    shas: Vec<String>,
}

fn sha_hex(logits: &[f32]) -> String {
    let mut h = Sha256::new();
    for v in logits {
        h.update(v.to_le_bytes());
    }
    h.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

/// Runs fixture `name` (tests/fixtures/kv_quant/NAME.json) the way llama.cpp computed it:
/// the prompt as one batch with logits for every token, then one token at a time along
/// llama.cpp's continuation.
fn run_fixture(name: &str, threads: usize) -> Option<Outcome> {
    run_fixture_as(name, threads, None)
}

/// [`run_fixture`] with the cache types `types` instead of the fixture's.
fn run_fixture_as(name: &str, threads: usize, types: Option<KvTypes>) -> Option<Outcome> {
    let path = root().join(format!("tests/fixtures/kv_quant/{name}.json"));
    let doc: Value = serde_json::from_slice(&fs::read(&path).expect("fixture")).expect("json");
    let mut model = load_model(doc["model"].as_str().expect("model"))?;
    let recorded = KvTypes {
        k: parse_kv_type(doc["type_k"].as_str().expect("type_k")).expect("type"),
        v: parse_kv_type(doc["type_v"].as_str().expect("type_v")).expect("type"),
    };
    model
        .set_cache_types(types.unwrap_or(recorded))
        .expect("cache types");
    let nv = model.hparams().n_vocab;
    let mut rt = Runtime::new(threads);
    rt.native_f16 = doc["avx512fp16"].as_bool();
    let mut o = Outcome {
        steps: 0,
        exact: 0,
        inexact: Vec::new(),
        diverged: None,
        max_delta: 0.0,
        max_kl: 0.0,
        shas: Vec::new(),
    };
    for (ci, case) in doc["cases"].as_array().expect("cases").iter().enumerate() {
        let tokens = ids(&case["tokens"]);
        let cont = ids(&case["continuation"]);
        let steps = case["steps"].as_array().expect("steps");
        let mut cache = model.new_cache(doc["n_ctx"].as_u64().unwrap_or(512) as usize);
        let mut out = model
            .forward(&Batch::from_prompt(&tokens, 0, 0, true), &mut cache, &rt)
            .expect("prompt");
        for (s, step) in steps.iter().enumerate() {
            let ours = out.last(nv).expect("logits");
            o.steps += 1;
            o.shas.push(sha_hex(ours));
            if o.shas[o.steps - 1] == step["sha256"].as_str().expect("sha256") {
                o.exact += 1;
            } else {
                o.inexact.push((ci, s));
            }
            let (lse, our_lse) = (step["lse"].as_f64().expect("lse"), logsumexp(ours));
            let (mut kl, mut p_rest, mut q_rest) = (0f64, 1f64, 1f64);
            for p in step["top"].as_array().expect("top") {
                let (id, l) = (
                    p[0].as_u64().expect("id") as usize,
                    p[1].as_f64().expect("logit"),
                );
                o.max_delta = o.max_delta.max((ours[id] - l as f32).abs());
                let (lp, lq) = (l - lse, ours[id] as f64 - our_lse);
                kl += lp.exp() * (lp - lq);
                p_rest -= lp.exp();
                q_rest -= lq.exp();
            }
            if p_rest > 1e-12 && q_rest > 1e-12 {
                kl += p_rest * (p_rest / q_rest).ln();
            }
            o.max_kl = o.max_kl.max(kl);
            if argmax(ours) as u32 != cont[s] && o.diverged.is_none() {
                o.diverged = Some((ci, s));
            }
            if s + 1 == steps.len() {
                break;
            }
            let mut b = Batch::new();
            b.push(cont[s], (tokens.len() + s) as u32, 0, true);
            out = model.forward(&b, &mut cache, &rt).expect("decode");
        }
    }
    eprintln!(
        "{name} ({threads} threads): {} steps, {} bit-exact, max |Δ logit| (top-5) {:.6}, \
         max KL {:.2e}, first greedy divergence {:?}, inexact steps {:?}",
        o.steps, o.exact, o.max_delta, o.max_kl, o.diverged, o.inexact
    );
    Some(o)
}

/// Every step's logits equal llama.cpp's bit for bit, so the greedy continuations do too.
fn exact(name: &str) {
    for threads in [2, 1] {
        let Some(o) = run_fixture(name, threads) else {
            return;
        };
        assert!(o.steps >= 8, "{name}: only {} steps recorded", o.steps);
        assert_eq!(o.diverged, None, "{name}: greedy diverged from llama.cpp");
        assert!(
            o.inexact.is_empty(),
            "{name}: logits differ from llama.cpp's at (case, step) {:?} (max |Δ| {})",
            o.inexact,
            o.max_delta
        );
    }
}

#[test]
fn smollm2_q8_0() {
    exact("smollm2-q8_0-q8_0");
}

#[test]
fn smollm2_q4_0() {
    exact("smollm2-q4_0-q4_0");
}

#[test]
fn qwen05_q8_0() {
    exact("qwen05-q8_0-q8_0");
}

#[test]
fn qwen05_q4_0() {
    exact("qwen05-q4_0-q4_0");
}

/// Q8_1 queries (Q4_1 keys), Q5_1 values.
#[test]
fn smollm2_q4_1_q5_1() {
    exact("smollm2-q4_1-q5_1");
}

#[test]
fn smollm2_q5_0_iq4_nl() {
    exact("smollm2-q5_0-iq4_nl");
}

/// f16 keys (no rotation, f16 query) with quantized values (f32 accumulator).
#[test]
fn smollm2_f16_q8_0() {
    exact("smollm2-f16-q8_0");
}

/// Quantized keys with f16 values (the f16 accumulator).
#[test]
fn smollm2_q4_0_f16() {
    exact("smollm2-q4_0-f16");
}

/// A 574-token prompt as one batch, then decoding over more than 512 cells: an f16 cache
/// would take llama.cpp's tiled and split-KV algorithms here, a quantized one keeps the
/// one-row algorithm, so this is bit for bit too.
#[test]
fn smollm2_q8_0_long() {
    exact("smollm2-q8_0-q8_0-long");
}

/// f32 keys and values: llama.cpp casts them to f16 before its flash attention, so they
/// compute what an f16 cache computes, including the tiled algorithm for prompt batches of
/// 64 or more rows (case 2's 70-token prompt, `kernels/attn_tiled.rs`). So: every step bit
/// for bit, and every step equal to our own f16 cache's.
#[test]
fn smollm2_f32() {
    for threads in [2, 1] {
        let Some(o) = run_fixture("smollm2-f32-f32", threads) else {
            return;
        };
        assert_eq!(o.diverged, None, "f32: greedy diverged from llama.cpp");
        assert!(
            o.inexact.is_empty(),
            "f32: logits differ from llama.cpp's: {:?}",
            o.inexact
        );
        let f16 =
            run_fixture_as("smollm2-f32-f32", threads, Some(KvTypes::default())).expect("model");
        assert_eq!(o.shas, f16.shas, "f32 and f16 caches differ");
    }
}

/// Cached keys moved to other positions, against llama.cpp: the prompt, then its cells from
/// position `from` on moved by `delta` (their keys re-rotated: for a quantized type decoded,
/// un-rotated, RoPE'd, rotated and encoded again, as llama.cpp's `build_rope_shift`), then
/// greedy decoding after them. Returns the steps whose logits differ from llama.cpp's and
/// whether greedy diverged. (llama-cli's context shift also removes cells first; llama.cpp
/// then puts the next tokens into the freed cells, before the moved ones, and attends in that
/// order, so there results agree to rounding only, for f16 caches too.)
fn run_shift(name: &str, threads: usize) -> Option<(Vec<usize>, bool)> {
    let path = root().join(format!("tests/fixtures/kv_quant/{name}.json"));
    let doc: Value = serde_json::from_slice(&fs::read(&path).expect("fixture")).expect("json");
    let mut model = load_model(doc["model"].as_str().expect("model"))?;
    let types = KvTypes {
        k: parse_kv_type(doc["type_k"].as_str().expect("type_k")).expect("type"),
        v: parse_kv_type(doc["type_v"].as_str().expect("type_v")).expect("type"),
    };
    model.set_cache_types(types).expect("cache types");
    let nv = model.hparams().n_vocab;
    let mut rt = Runtime::new(threads);
    rt.native_f16 = doc["avx512fp16"].as_bool();
    let tokens = ids(&doc["tokens"]);
    let cont = ids(&doc["continuation"]);
    let from = doc["from"].as_u64().expect("from") as u32;
    let delta = doc["delta"].as_i64().expect("delta");
    let mut cache = model.new_cache(512);
    let out = model
        .forward(&Batch::from_prompt(&tokens, 0, 0, true), &mut cache, &rt)
        .expect("prompt");
    let mut diverged = argmax(out.last(nv).expect("logits")) as u32 != cont[0];
    cache.seq_add(0, from, None, delta, &|row, d| model.rotate_keys(row, d));
    let mut inexact = Vec::new();
    for (s, step) in doc["steps"].as_array().expect("steps").iter().enumerate() {
        let mut b = Batch::new();
        b.push(
            cont[s],
            (tokens.len() as i64 + delta) as u32 + s as u32,
            0,
            true,
        );
        let out = model.forward(&b, &mut cache, &rt).expect("decode");
        let ours = out.last(nv).expect("logits");
        if sha_hex(ours) != step["sha256"].as_str().expect("sha256") {
            inexact.push(s);
        }
        diverged |= argmax(ours) as u32 != cont[s + 1];
    }
    eprintln!("{name} ({threads} threads): inexact steps {inexact:?}, greedy diverged {diverged}");
    Some((inexact, diverged))
}

/// Every step after the shift bit for bit, for quantized caches and the f16 control.
#[test]
fn key_shift() {
    for name in [
        "smollm2-f16-f16-shift",
        "smollm2-q8_0-q8_0-shift",
        "smollm2-q4_0-q4_0-shift",
        "qwen05-q8_0-q8_0-shift",
    ] {
        for threads in [2, 1] {
            let Some((inexact, diverged)) = run_shift(name, threads) else {
                continue;
            };
            assert!(!diverged, "{name}: greedy diverged from llama.cpp");
            assert!(
                inexact.is_empty(),
                "{name}: logits differ at steps {inexact:?}"
            );
        }
    }
}
