//! Constrained generation speed: `cargo bench -p rustorch-llm --bench grammar`.
//!
//! 1. Decode tokens per second on SmolLM2-135M with a JSON schema active against the same
//!    generation unconstrained (the mask is computed every step, inside the timing).
//! 2. Per-token mask time (the thread's CPU time, so that other processes on a busy
//!    machine do not count) with Qwen2.5's 152k-token vocabulary (only its tokenizer is
//!    loaded): every step of canonical tokenizations of schema-valid documents, and of
//!    random walks that pick any allowed token; p50, p99 and max.
//!
//! `RUSTORCH_BENCH_TOKENS` (default 128) and `RUSTORCH_BENCH_ROUNDS` (default 3) size
//! part 1.

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use rustorch_core::gguf::GgufFile;
use rustorch_core::kernels::physical_cores;
use rustorch_llm::engine::{generate, GenerateParams, Session};
use rustorch_llm::grammar::{GrammarEngine, GrammarSpec};
use rustorch_llm::sampler::{Mt19937, Sampler, SamplerParams};
use rustorch_llm::tokenizer::Tokenizer;
use rustorch_llm::{Model, Runtime};
use serde_json::json;

/// This thread's CPU time in milliseconds: unlike wall time, it does not count the time
/// other processes of a busy machine take the core away.
fn cpu_ms() -> f64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec through a valid pointer.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    ts.tv_sec as f64 * 1e3 + ts.tv_nsec as f64 / 1e6
}

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn schema() -> serde_json::Value {
    schema_with(json!({"type": "string", "format": "email"}))
}

fn schema_with(email: serde_json::Value) -> serde_json::Value {
    json!({
        "type": "array",
        "minItems": 40,
        "items": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 24},
                "age": {"type": "integer", "minimum": 0, "maximum": 120},
                "city": {"enum": ["Paris", "London", "Berlin", "Madrid", "Rome"]},
                "email": email,
                "active": {"type": "boolean"}
            },
            "required": ["name", "age", "city", "email", "active"],
            "additionalProperties": false
        }
    })
}

fn decode_speed(root: &Path) {
    let path = root.join("models/SmolLM2-135M-Instruct.Q4_1.gguf");
    if !path.is_file() {
        println!("SKIPPED decode speed: {} is absent", path.display());
        return;
    }
    let gguf = Arc::new(GgufFile::open(&path).expect("open"));
    let tok = Arc::new(Tokenizer::from_gguf(&gguf).expect("tokenizer"));
    let model = Model::load(gguf).expect("model");
    let engine = GrammarEngine::new(tok.clone());
    let spec = GrammarSpec::JsonSchema(schema());
    let n = env_usize("RUSTORCH_BENCH_TOKENS", 128);
    let rounds = env_usize("RUSTORCH_BENCH_ROUNDS", 3);
    let threads = physical_cores();
    let rt = Runtime::new(threads);
    let prompt = tok
        .encode(
            "A JSON list of forty people with their details: ",
            true,
            true,
        )
        .expect("encode");
    let run = |constrained: bool, seed: u64| -> (Vec<u32>, f64) {
        let mut session = Session::new(&model, &rt, 1024);
        let params = SamplerParams {
            seed: Some(seed),
            temperature: 0.8,
            ignore_eos: !constrained,
            eog_tokens: tok.eog_ids().collect(),
            ..SamplerParams::default()
        };
        let mut sampler = Sampler::new(params, tok.n_vocab());
        if constrained {
            sampler.set_grammar(Some(engine.compile(&spec).expect("compile")));
        }
        let g = generate(
            &mut session,
            &tok,
            &mut sampler,
            &prompt,
            &GenerateParams {
                n_predict: Some(n),
                ignore_eos: !constrained,
                ..GenerateParams::default()
            },
            &mut |_| true,
        )
        .expect("generate");
        let n = g.tokens.len();
        (g.tokens, g.gen_time.as_secs_f64() / n as f64)
    };
    // the grammar's own work per token (mask, applying it, advancing), replayed over a
    // constrained generation's tokens: independent of what else the machine runs
    let grammar_cost = |tokens: &[u32]| -> f64 {
        let mut c = engine.compile(&spec).expect("compile");
        let logits = vec![0.0f32; tok.n_vocab()];
        let mut buf = Vec::new();
        let t0 = cpu_ms();
        for &t in tokens {
            buf.clear();
            buf.extend_from_slice(&logits);
            c.apply(&mut buf);
            c.accept(t, &tok.token_to_piece(t, false));
        }
        (cpu_ms() - t0) / 1e3 / tokens.len().max(1) as f64
    };
    run(false, 0); // warm-up
    let mut free = Vec::new();
    let mut constrained = Vec::new();
    let mut cost = Vec::new();
    for r in 0..rounds as u64 {
        let (_, tf) = run(false, r + 1);
        let (toks, tc) = run(true, r + 1);
        free.push(1.0 / tf);
        constrained.push(1.0 / tc);
        cost.push(grammar_cost(&toks));
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let (f, c, g) = (
        median(&mut free),
        median(&mut constrained),
        median(&mut cost),
    );
    println!(
        "decode SmolLM2-135M, {threads} threads, {n} tokens, median of {rounds}: unconstrained \
         {f:.1} t/s, JSON schema {c:.1} t/s = {:.1}% (target >= 90%); the grammar's own work \
         {:.3} ms/token, i.e. {:.1}% of unconstrained speed at this machine's forward time",
        100.0 * c / f,
        g * 1e3,
        100.0 / (1.0 + g * f)
    );
}

fn mask_times(root: &Path, label: &str, schema: serde_json::Value) {
    let path = root.join("models/qwen2.5-coder-0.5b-instruct-q4km.gguf");
    if !path.is_file() {
        println!("SKIPPED mask time: {} is absent", path.display());
        return;
    }
    let gguf = GgufFile::open(&path).expect("open");
    let tok = Arc::new(Tokenizer::from_gguf(&gguf).expect("tokenizer"));
    let t0 = Instant::now();
    let engine = GrammarEngine::new(tok.clone());
    let build = t0.elapsed();
    let spec = GrammarSpec::JsonSchema(schema);
    let t1 = Instant::now();
    let _ = engine.compile(&spec).expect("compile");
    let compile = t1.elapsed();
    let mut times: Vec<f64> = Vec::new();
    // documents as the tokenizer writes them
    let people = [
        ("Ana María", 34, "Madrid", "ana.maria@example.com", true),
        (
            "John Smith-Jones",
            61,
            "London",
            "j.smith@mail.co.uk",
            false,
        ),
        ("Li Wei", 7, "Paris", "li_wei99@example.org", true),
    ];
    for k in 0..8 {
        let items: Vec<String> = (0..40)
            .map(|i| {
                let p = people[(i + k) % people.len()];
                format!(
                    r#"{{"name": "{}", "age": {}, "city": "{}", "email": "{}", "active": {}}}"#,
                    p.0,
                    (p.1 + i) % 120,
                    p.2,
                    p.3,
                    p.4
                )
            })
            .collect();
        let doc = format!("[{}]", items.join(", "));
        let mut c = engine.compile(&spec).expect("compile");
        for t in tok.encode(&doc, false, false).expect("encode") {
            let t0 = cpu_ms();
            c.compute_mask_now();
            times.push(cpu_ms() - t0);
            assert!(c.allows(t), "token {t} of the document refused");
            c.accept(t, &tok.token_to_piece(t, false));
        }
    }
    let n_doc = times.len();
    let mut doc_times = times.clone();
    let n_first = n_doc / 8;
    let mut first = doc_times[..n_first].to_vec();
    first.sort_by(f64::total_cmp);
    doc_times.sort_by(f64::total_cmp);
    // random walks over allowed tokens
    let mut rng = Mt19937::new(7);
    for _ in 0..8 {
        let mut c = engine.compile(&spec).expect("compile");
        for _ in 0..200 {
            let t0 = cpu_ms();
            c.compute_mask_now();
            times.push(cpu_ms() - t0);
            let allowed = c.allowed_tokens();
            let t = allowed[rng.next_u32() as usize % allowed.len()];
            if tok.is_eog(t) {
                break;
            }
            c.accept(t, &tok.token_to_piece(t, false));
        }
    }
    let mut walk_times = times[n_doc..].to_vec();
    walk_times.sort_by(f64::total_cmp);
    times.sort_by(f64::total_cmp);
    let q = |p: f64| times[((times.len() - 1) as f64 * p).round() as usize];
    let p99 = |v: &[f64]| v[((v.len() - 1) as f64 * 0.99).round() as usize];
    println!(
        "  p99 of document steps {:.3} ms (first document, a schema not seen before: {:.3} ms), \
         of random-walk steps {:.3} ms",
        p99(&doc_times),
        p99(&first),
        p99(&walk_times)
    );
    println!(
        "mask Qwen2.5 vocabulary, {label} ({} tokens; trie built in {:.0} ms, schema compiled in {:.1} ms): \
         {} steps ({n_doc} of documents, {} of random walks): p50 {:.3} ms, p99 {:.3} ms, max {:.3} ms (target p99 <= 1 ms; CPU time)",
        tok.n_vocab(),
        build.as_secs_f64() * 1e3,
        compile.as_secs_f64() * 1e3,
        times.len(),
        times.len() - n_doc,
        q(0.5),
        q(0.99),
        times[times.len() - 1]
    );
}

fn main() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    decode_speed(&root);
    mask_times(
        &root,
        "schema with plain strings",
        schema_with(json!({"type": "string"})),
    );
    mask_times(&root, "schema with an email format", schema());
}
