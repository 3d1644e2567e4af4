//! Parity with llama.cpp: greedy continuations and per-step logits of SmolLM2-135M Q4_1,
//! Qwen2.5-Coder-0.5B, Qwen2.5-Coder-1.5B Q4_K_M and Gemma-3-270M Q4_K_M against fixtures recorded from
//! llama.cpp by `scripts/record_parity_fixtures.py` (12 prompts per model).

mod common;

use std::fs;

use rustorch_llm::{Batch, Runtime};
use serde_json::Value;

use common::{argmax, batch_vs_sequential, kl, load_model, logsumexp, root};

/// A step where llama.cpp's own top-2 logits are closer than this is a near-tie: a
/// different choice there is within float noise.
const NEAR_TIE: f32 = 0.05;

struct Step {
    top: Vec<(u32, f32)>,
    lse: f64,
}

struct Case {
    tokens: Vec<u32>,
    continuation: Vec<u32>,
    steps: Vec<Step>,
}

/// A runtime computing as the llama.cpp build that recorded `key`'s fixture: with or without
/// AVX512-FP16 in attention's f16 accumulator (recorded in the fixture), whatever this CPU is.
fn runtime_for(key: &str, threads: usize) -> Runtime {
    let path = root().join(format!("tests/fixtures/parity/{key}.json"));
    let doc: Value = serde_json::from_slice(&fs::read(&path).expect("fixture")).expect("json");
    let mut rt = Runtime::new(threads);
    rt.native_f16 = doc["avx512fp16"].as_bool();
    rt
}

fn load_fixture(key: &str) -> (String, Vec<Case>) {
    let path = root().join(format!("tests/fixtures/parity/{key}.json"));
    let doc: Value = serde_json::from_slice(&fs::read(&path).expect("fixture")).expect("json");
    let ids = |v: &Value| -> Vec<u32> {
        v.as_array()
            .expect("array")
            .iter()
            .map(|x| x.as_u64().expect("id") as u32)
            .collect()
    };
    let cases = doc["cases"]
        .as_array()
        .expect("cases")
        .iter()
        .map(|c| Case {
            tokens: ids(&c["tokens"]),
            continuation: ids(&c["continuation"]),
            steps: c["steps"]
                .as_array()
                .expect("steps")
                .iter()
                .map(|s| Step {
                    top: s["top"]
                        .as_array()
                        .expect("top")
                        .iter()
                        .map(|p| {
                            (
                                p[0].as_u64().expect("id") as u32,
                                p[1].as_f64().expect("logit") as f32,
                            )
                        })
                        .collect(),
                    lse: s["lse"].as_f64().expect("lse"),
                })
                .collect(),
        })
        .collect();
    (doc["model"].as_str().expect("model").to_string(), cases)
}

fn margin(step: &Step) -> f32 {
    step.top[0].1 - step.top[1].1
}

/// KL(llama.cpp ‖ ours) over llama.cpp's top-20 ids plus one bucket for the rest of the
/// vocabulary (a lower bound of the full KL by the data-processing inequality; the top
/// 20 hold nearly all of the mass in these greedy steps).
fn kl_top(step: &Step, ours: &[f32]) -> f64 {
    let our_lse = logsumexp(ours);
    let mut kl = 0.0;
    let (mut p_rest, mut q_rest) = (1.0f64, 1.0f64);
    for &(id, l) in &step.top {
        let lp = l as f64 - step.lse;
        let lq = ours[id as usize] as f64 - our_lse;
        kl += lp.exp() * (lp - lq);
        p_rest -= lp.exp();
        q_rest -= lq.exp();
    }
    if p_rest > 1e-12 && q_rest > 1e-12 {
        kl += p_rest * (p_rest / q_rest).ln();
    }
    kl
}

/// Checks one model against its fixture; returns the (case, step, margin) of each greedy
/// divergence (all at near-ties, or the call fails).
fn run_model(key: &str, threads: usize) -> Vec<(usize, usize, f32)> {
    let (file, cases) = load_fixture(key);
    let Some(model) = load_model(&file) else {
        return Vec::new();
    };
    let nv = model.hparams().n_vocab;
    let rt = runtime_for(key, threads);
    let (mut kl_sum, mut kl_max, mut n_steps, mut max_delta) = (0.0f64, 0.0f64, 0usize, 0.0f32);
    let mut top1_mismatch_non_tie = Vec::new();
    let mut greedy_diverged = Vec::new();
    let mut greedy_bad = Vec::new();
    let mut full_logits_bad = Vec::new();
    for (ci, case) in cases.iter().enumerate() {
        // Teacher-forced along llama.cpp's tokens, computed the way llama.cpp computed them
        // while recording: the prompt as one batch, then one token at a time at explicit
        // positions. (Its arithmetic depends on the batch size, e.g. Q4_K gemm vs gemv, so
        // feeding prompt and continuation as one batch would not reproduce its numbers.)
        // Until our argmax first differs from llama.cpp's token, the tokens fed are exactly
        // our own greedy continuation, so the first such step is where greedy diverges.
        // The fixtures were recorded with logits for every prompt token (llama-cpp-python's
        // `logits_all`), so the prompt batch asks for all of them too: the last layer then
        // runs all rows, as it did in llama.cpp.
        let np = case.tokens.len();
        let mut cache = model.new_cache(512);
        let mut out = model
            .forward(
                &Batch::from_prompt(&case.tokens, 0, 0, true),
                &mut cache,
                &rt,
            )
            .expect("prompt");
        let mut diverged = false;
        for (s, step) in case.steps.iter().enumerate() {
            let ours = out.last(nv).expect("logits");
            let kl = kl_top(step, ours);
            kl_sum += kl;
            kl_max = kl_max.max(kl);
            n_steps += 1;
            for &(id, l) in &step.top {
                max_delta = max_delta.max((ours[id as usize] - l).abs());
            }
            let expected = case.continuation[s];
            if argmax(ours) as u32 != expected {
                let m = margin(step);
                if m >= NEAR_TIE {
                    top1_mismatch_non_tie.push((ci, s, m));
                }
                if !diverged {
                    diverged = true;
                    greedy_diverged.push((ci, s, m));
                    if m >= NEAR_TIE {
                        greedy_bad.push((ci, s, m));
                    }
                }
            }
            if s == 0 && ci < 2 {
                let path = root().join(format!("tests/fixtures/parity/{key}-case{ci}-logits.f32"));
                let raw = fs::read(&path).expect("full logits fixture");
                let reference: Vec<f32> = raw
                    .chunks_exact(4)
                    .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                    .collect();
                assert_eq!(reference.len(), nv);
                let d = ours
                    .iter()
                    .zip(&reference)
                    .map(|(a, b)| (a - b).abs())
                    .fold(0f32, f32::max);
                eprintln!("{key} case {ci}: full first-step logits max |Δ| = {d:.5}");
                if d > 0.05 || argmax(ours) != argmax(&reference) {
                    full_logits_bad.push((ci, d));
                }
            }
            if s + 1 == case.steps.len() {
                break;
            }
            let mut b = Batch::new();
            b.push(expected, (np + s) as u32, 0, true);
            out = model.forward(&b, &mut cache, &rt).expect("decode");
        }
    }
    let mean_kl = kl_sum / n_steps as f64;
    eprintln!(
        "{key} ({threads} threads): {} cases, {n_steps} steps, mean KL {mean_kl:.2e}, max KL {kl_max:.2e}, \
         max |Δ logit| (top-20) {max_delta:.4}, greedy divergences {:?} (case, step, llama.cpp margin)",
        cases.len(),
        greedy_diverged
    );
    assert!(cases.len() >= 12, "{key}: need at least 12 recorded cases");
    assert!(
        full_logits_bad.is_empty(),
        "{key}: full first-step logits differ by more than 0.05 or in argmax: {full_logits_bad:?}"
    );
    assert!(mean_kl <= 1e-3, "{key}: mean KL {mean_kl} > 1e-3");
    assert!(
        top1_mismatch_non_tie.is_empty(),
        "{key}: top-1 differs outside near-ties at {top1_mismatch_non_tie:?}"
    );
    assert!(
        greedy_bad.is_empty(),
        "{key}: greedy diverged where llama.cpp's margin was not a near-tie: {greedy_bad:?}"
    );
    assert!(
        greedy_diverged.len() * 12 <= cases.len(),
        "{key}: {} of {} cases diverged (near-ties), more than 1 in 12",
        greedy_diverged.len(),
        cases.len()
    );
    greedy_diverged
}

#[test]
fn parity_smollm2() {
    run_model("smollm2", 2);
}

#[test]
fn parity_smollm2_one_thread() {
    run_model("smollm2", 1);
}

#[test]
fn parity_qwen05() {
    run_model("qwen05", 2);
}

#[test]
fn parity_qwen05_one_thread() {
    run_model("qwen05", 1);
}

#[test]
fn parity_qwen15() {
    run_model("qwen15", 2);
}

#[test]
fn parity_qwen15_one_thread() {
    run_model("qwen15", 1);
}

/// Gemma 3 (270M, a base model): every greedy continuation equal to llama.cpp's.
#[test]
fn parity_gemma3() {
    let diverged = run_model("gemma3", 2);
    assert!(
        diverged.is_empty(),
        "gemma3: greedy diverged at {diverged:?}"
    );
}

#[test]
fn parity_gemma3_one_thread() {
    let diverged = run_model("gemma3", 1);
    assert!(
        diverged.is_empty(),
        "gemma3: greedy diverged at {diverged:?}"
    );
}

/// The slow scalar f32 path (dequantize + naive matmul, unquantized activations) and the
/// fast quantized path agree on every model.
#[test]
fn reference_path_agrees_with_fast_path() {
    for key in ["smollm2", "qwen05", "qwen15"] {
        let (file, cases) = load_fixture(key);
        let Some(model) = load_model(&file) else {
            continue;
        };
        let nv = model.hparams().n_vocab;
        let tokens = &cases[0].tokens;
        let batch = Batch::from_prompt(tokens, 0, 0, false);
        let fast = Runtime::new(2);
        let mut slow = Runtime::new(2);
        slow.reference = true;
        let a = model
            .forward(&batch, &mut model.new_cache(64), &fast)
            .expect("fast");
        let b = model
            .forward(&batch, &mut model.new_cache(64), &slow)
            .expect("reference");
        let (a, b) = (a.last(nv).expect("a"), b.last(nv).expect("b"));
        let d = a
            .iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs())
            .fold(0f32, f32::max);
        eprintln!("{key}: reference vs fast path, max |Δ logit| = {d:.4}");
        assert_eq!(argmax(a), argmax(b), "{key}: argmax differs between paths");
        // The fast path quantizes activations to 8 bits; on these models that moves single
        // logits by up to ~1 (docs/parity.md), while the prediction stays the same.
        assert!(d < 1.5, "{key}: paths differ by {d}");
    }
}

/// Largest |Δ logit| between the prompt run as one batch and fed one token at a time
/// (explicit positions), after checking that every position's argmax agrees.
/// The regression test for the seed bug (positions derived from cache lengths): a
/// prompt evaluated as one batch equals the same prompt fed one token at a time with
/// explicit positions.
///
/// Bit for bit wherever llama.cpp's own arithmetic does not depend on the batch size: every
/// SmolLM2 prompt (Q4_1/Q8_0 products are computed per element in one order), and Qwen
/// batches of fewer than 4 tokens. From 4 tokens on llama.cpp multiplies Q4_K weights with
/// its gemm kernel (another activation rounding rule and float order than its single-token
/// gemv), and from 8 tokens Q6_K with its tiled kernel; we reproduce that, so there the batch
/// and the single-token logits differ by rounding, and the check is the same argmax at every
/// position and a small difference (a position bug moves logits by whole units).
#[test]
fn batch_equals_one_token_at_a_time() {
    let (file, cases) = load_fixture("smollm2");
    if let Some(model) = load_model(&file) {
        for case in &cases[..4] {
            assert_eq!(batch_vs_sequential(&model, &case.tokens), 0.0, "smollm2");
        }
    }
    let (file, cases) = load_fixture("qwen05");
    if let Some(model) = load_model(&file) {
        let toks = &cases[2].tokens;
        assert_eq!(
            batch_vs_sequential(&model, &toks[..3]),
            0.0,
            "qwen05, 3 tokens"
        );
        let d = batch_vs_sequential(&model, &cases[4].tokens);
        eprintln!(
            "qwen05, {} tokens: max |Δ logit| {d}",
            cases[4].tokens.len()
        );
        assert!(d < 0.5, "qwen05: batch and one-at-a-time differ by {d}");
    }
}

/// The same across Gemma 3's 512-token sliding window: 530 tokens (the twelve prompts,
/// repeated) in one batch and one at a time at explicit positions. Q4_K/Q6_K products and
/// attention over 64 or more rows take other kernels for a batch, as in llama.cpp, and
/// Gemma's logits are large (a 262k vocabulary, no soft-cap), so the two agree to rounding
/// in distribution, not bit for bit: llama.cpp's own batch-versus-one-at-a-time KL on these
/// tokens reaches 0.03 within the first 120 positions, ours 0.08 over 530. The check is the
/// KL at every position, which catches position bugs. It does not pin the window: Gemma 3's
/// attention 512 tokens back is so weak that batches with no window at all give 7.0e-4 past
/// the window against 3.4e-4 (measured by disabling it); the synthetic models' tests, with
/// 16-token windows, do.
#[test]
fn gemma3_window_batch_equals_one_token_at_a_time() {
    let (file, cases) = load_fixture("gemma3");
    let Some(model) = load_model(&file) else {
        return;
    };
    let window = model.hparams().n_swa as usize;
    assert_eq!(window, 512);
    let mut tokens: Vec<u32> = vec![cases[0].tokens[0]];
    while tokens.len() < window + 18 {
        for c in &cases {
            tokens.extend_from_slice(&c.tokens[1..]);
        }
    }
    tokens.truncate(window + 18);
    let nv = model.hparams().n_vocab;
    let rt = Runtime::new(2);
    let mut c1 = model.new_cache(tokens.len());
    let batched = model
        .forward(&Batch::from_prompt(&tokens, 0, 0, true), &mut c1, &rt)
        .expect("batch");
    let mut c2 = model.new_cache(tokens.len());
    let (mut worst, mut at, mut flips, mut tail) = (0f64, 0, 0, 0f64);
    for (i, &t) in tokens.iter().enumerate() {
        let mut b = Batch::new();
        b.push(t, i as u32, 0, true);
        let one = model.forward(&b, &mut c2, &rt).expect("one token");
        let (p, q) = (
            one.last(nv).expect("logits"),
            batched.logits_for(i, nv).expect("row"),
        );
        let kl = kl(p, q);
        if kl > worst {
            (worst, at) = (kl, i);
        }
        if i >= window {
            tail = tail.max(kl);
        }
        flips += usize::from(argmax(p) != argmax(q));
    }
    eprintln!(
        "gemma3, {} tokens: max KL {worst:.2e} at position {at}, {tail:.2e} past the window, {flips} argmax flips",
        tokens.len()
    );
    assert!(worst < 0.25, "gemma3: KL {worst} at position {at}");
}

/// Two different sequences decoded in one batch give the same logits as each alone.
#[test]
fn two_sequences_in_one_batch() {
    let (file, cases) = load_fixture("smollm2");
    let Some(model) = load_model(&file) else {
        return;
    };
    let nv = model.hparams().n_vocab;
    let rt = Runtime::new(2);
    let (a, b) = (&cases[0].tokens, &cases[1].tokens);
    let alone = |toks: &[u32]| {
        let mut c = model.new_cache(128);
        let out = model
            .forward(&Batch::from_prompt(toks, 0, 0, false), &mut c, &rt)
            .expect("alone");
        out.last(nv).expect("logits").to_vec()
    };
    let (la, lb) = (alone(a), alone(b));
    // both prompts in one batch, as sequences 3 and 7
    let mut batch = Batch::new();
    for (i, &t) in a.iter().enumerate() {
        batch.push(t, i as u32, 3, i + 1 == a.len());
    }
    for (i, &t) in b.iter().enumerate() {
        batch.push(t, i as u32, 7, i + 1 == b.len());
    }
    let mut cache = model.new_cache(256);
    let out = model.forward(&batch, &mut cache, &rt).expect("joint");
    assert_eq!(out.logits_for(a.len() - 1, nv).expect("a"), &la[..]);
    assert_eq!(
        out.logits_for(a.len() + b.len() - 1, nv).expect("b"),
        &lb[..]
    );
    // then one decode step for each sequence, together, against each alone
    let (ta, tb) = (argmax(&la) as u32, argmax(&lb) as u32);
    let mut step = Batch::new();
    step.push(ta, a.len() as u32, 3, true);
    step.push(tb, b.len() as u32, 7, true);
    let joint = model.forward(&step, &mut cache, &rt).expect("joint step");
    let single = |toks: &[u32], t: u32| {
        let mut c = model.new_cache(128);
        model
            .forward(&Batch::from_prompt(toks, 0, 0, false), &mut c, &rt)
            .expect("prompt");
        let mut s = Batch::new();
        s.push(t, toks.len() as u32, 0, true);
        model
            .forward(&s, &mut c, &rt)
            .expect("step")
            .last(nv)
            .expect("l")
            .to_vec()
    };
    assert_eq!(joint.logits_for(0, nv).expect("a"), &single(a, ta)[..]);
    assert_eq!(joint.logits_for(1, nv).expect("b"), &single(b, tb)[..]);
}

/// What holds today on every model and prompt (run in CI): the first predicted token
/// equals llama.cpp's, and the first-step distribution is close (KL reported).
#[test]
fn first_step_prediction_matches_llama_cpp() {
    for key in ["smollm2", "qwen05", "qwen15"] {
        let (file, cases) = load_fixture(key);
        let Some(model) = load_model(&file) else {
            continue;
        };
        let nv = model.hparams().n_vocab;
        let rt = runtime_for(key, 2);
        let mut kls = Vec::new();
        for (ci, case) in cases.iter().enumerate() {
            let out = model
                .forward(
                    &Batch::from_prompt(&case.tokens, 0, 0, false),
                    &mut model.new_cache(256),
                    &rt,
                )
                .expect("forward");
            let ours = out.last(nv).expect("logits");
            let step = &case.steps[0];
            kls.push(kl_top(step, ours));
            if margin(step) >= NEAR_TIE {
                assert_eq!(
                    argmax(ours) as u32,
                    step.top[0].0,
                    "{key} case {ci}: first token differs from llama.cpp's"
                );
            }
        }
        let mean = kls.iter().sum::<f64>() / kls.len() as f64;
        let max = kls.iter().copied().fold(0f64, f64::max);
        eprintln!(
            "{key}: first step of {} prompts: same top token; KL mean {mean:.2e}, max {max:.2e}",
            kls.len()
        );
    }
}
