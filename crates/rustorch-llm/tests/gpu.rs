//! The CUDA backend against our CPU backend on real weights: teacher-forced along the CPU's
//! greedy continuation (8 prompts × 64 steps), the KL divergence of the GPU's distribution
//! from the CPU's and how often the top token agrees; and free-running greedy 32-token
//! continuations. Skips (with a line saying so) where no GPU is usable.
//!
//! Models: SmolLM2 (the parity fixture's prompts), and every GGUF named in
//! `RUSTORCH_GPU_MODELS` (comma-separated paths) with the same prompts' text re-tokenized.

mod common;

use std::sync::Arc;

use rustorch_core::gguf::GgufFile;
use rustorch_llm::tokenizer::Tokenizer;
use rustorch_llm::{Batch, KvCache, Model, Placement, Runtime};
use serde_json::Value;

use common::{argmax, ids, kl, root};

const STEPS: usize = 64;
const GREEDY: usize = 32;

struct Report {
    mean_kl: f64,
    max_kl: f64,
    top1: f64,
    greedy_equal: usize,
    prompts: usize,
    /// Teacher-forced steps whose logits equal the CPU's to the bit, of `steps`.
    identical: usize,
    steps: usize,
}

fn prompt_logits(model: &Model, tokens: &[u32], cache: &mut KvCache, rt: &Runtime) -> Vec<f32> {
    let nv = model.hparams().n_vocab;
    model
        .forward(&Batch::from_prompt(tokens, 0, 0, false), cache, rt)
        .expect("prompt")
        .last(nv)
        .expect("logits")
        .to_vec()
}

fn step(model: &Model, tok: u32, pos: usize, cache: &mut KvCache, rt: &Runtime) -> Vec<f32> {
    let nv = model.hparams().n_vocab;
    let mut b = Batch::new();
    b.push(tok, pos as u32, 0, true);
    model
        .forward(&b, cache, rt)
        .expect("decode")
        .last(nv)
        .expect("logits")
        .to_vec()
}

fn compare(cpu: &Model, gpu: &Model, prompts: &[Vec<u32>]) -> Report {
    let rt = Runtime::new(std::thread::available_parallelism().map_or(2, |n| n.get()));
    let (mut kl_sum, mut kl_max, mut agree, mut n, mut greedy_equal) = (0f64, 0f64, 0, 0, 0);
    let mut identical = 0;
    for tokens in prompts {
        let np = tokens.len();
        let ctx = np + STEPS + 1;
        // the CPU's greedy continuation and its logits
        let mut cc = cpu.new_cache(ctx);
        let mut logits = prompt_logits(cpu, tokens, &mut cc, &rt);
        let mut cpu_steps = Vec::new();
        let mut cpu_toks = Vec::new();
        for s in 0..STEPS {
            let t = argmax(&logits) as u32;
            cpu_toks.push(t);
            cpu_steps.push(logits);
            logits = step(cpu, t, np + s, &mut cc, &rt);
        }
        // the GPU fed the same tokens
        let mut gc = gpu.new_cache(ctx);
        let mut g = prompt_logits(gpu, tokens, &mut gc, &rt);
        for s in 0..STEPS {
            let k = kl(&cpu_steps[s], &g);
            kl_sum += k;
            kl_max = kl_max.max(k);
            agree += usize::from(argmax(&g) == argmax(&cpu_steps[s]));
            identical += usize::from(differing_steps(&cpu_steps[s..s + 1], &[g.clone()]) == 0);
            n += 1;
            g = step(gpu, cpu_toks[s], np + s, &mut gc, &rt);
        }
        // the GPU's own greedy continuation
        let mut gc = gpu.new_cache(ctx);
        let mut g = prompt_logits(gpu, tokens, &mut gc, &rt);
        let mut own = Vec::new();
        for s in 0..GREEDY {
            let t = argmax(&g) as u32;
            own.push(t);
            g = step(gpu, t, np + s, &mut gc, &rt);
        }
        greedy_equal += usize::from(own[..] == cpu_toks[..GREEDY]);
    }
    Report {
        mean_kl: kl_sum / n as f64,
        max_kl: kl_max,
        top1: agree as f64 / n as f64,
        greedy_equal,
        prompts: prompts.len(),
        identical,
        steps: n,
    }
}

fn open(path: &std::path::Path) -> Option<(Model, Model, Tokenizer)> {
    if !path.exists() {
        eprintln!("SKIPPED: {} is absent", path.display());
        return None;
    }
    let gguf = Arc::new(GgufFile::open(path).expect("open"));
    let gpu = match Model::load_on(gguf.clone(), Placement::Cuda(0), 1024) {
        Ok(m) => m,
        Err(e) => {
            // written past the test harness's capture, so a CPU-only run shows it
            use std::io::Write;
            let _ = writeln!(std::io::stderr(), "SKIPPED: GPU tests: no usable GPU: {e}");
            return None;
        }
    };
    let cpu = Model::load(gguf.clone()).expect("cpu");
    let tok = Tokenizer::from_gguf(&gguf).expect("tokenizer");
    Some((cpu, gpu, tok))
}

fn fixture_prompts() -> Vec<(String, Vec<u32>)> {
    let path = root().join("tests/fixtures/parity/smollm2.json");
    let doc: Value = serde_json::from_slice(&std::fs::read(path).expect("fixture")).expect("json");
    doc["cases"].as_array().expect("cases")[..8]
        .iter()
        .map(|c| {
            (
                c["prompt"].as_str().unwrap_or("").to_string(),
                ids(&c["tokens"]),
            )
        })
        .collect()
}

fn check(name: &str, r: &Report) {
    eprintln!(
        "{name}: GPU vs CPU over {} prompts × {STEPS} steps: mean KL {:.2e}, max KL {:.2e}, top-1 {:.2}%, greedy {GREEDY} tokens equal in {}/{}",
        r.prompts,
        r.mean_kl,
        r.max_kl,
        100.0 * r.top1,
        r.greedy_equal,
        r.prompts
    );
    assert!(r.mean_kl <= 1e-3, "{name}: mean KL {}", r.mean_kl);
    assert!(r.top1 >= 0.98, "{name}: top-1 agreement {}", r.top1);
}

/// The fixture prompts' text in `tok`'s tokens.
fn encode_prompts(tok: &Tokenizer, prompts: &[(String, Vec<u32>)]) -> Vec<Vec<u32>> {
    prompts
        .iter()
        .map(|p| tok.encode(&p.0, true, true).expect("tokenize"))
        .collect()
}

/// SmolLM2 and the GGUFs named in `RUSTORCH_GPU_MODELS` (comma-separated).
fn gpu_models() -> Vec<std::path::PathBuf> {
    let mut models = vec![root().join("models/SmolLM2-135M-Instruct.Q4_1.gguf")];
    let extra = std::env::var("RUSTORCH_GPU_MODELS").unwrap_or_default();
    models.extend(extra.split(',').filter(|p| !p.is_empty()).map(Into::into));
    models
}

/// Steps whose logits are not equal to the bit.
fn differing_steps(a: &[Vec<f32>], b: &[Vec<f32>]) -> usize {
    a.iter()
        .zip(b)
        .filter(|(x, y)| {
            x.iter()
                .zip(y.iter())
                .any(|(p, q)| p.to_bits() != q.to_bits())
        })
        .count()
}

/// Greedy decode logits of `steps` steps after each prompt, on `gpu` as it is set.
fn decode_logits(gpu: &Model, prompts: &[Vec<u32>], steps: usize) -> Vec<Vec<f32>> {
    let rt = Runtime::new(2);
    let mut out = Vec::new();
    for tokens in prompts {
        let mut cache = gpu.new_cache(tokens.len() + steps + 1);
        let mut l = prompt_logits(gpu, tokens, &mut cache, &rt);
        for s in 0..steps {
            let t = argmax(&l) as u32;
            l = step(gpu, t, tokens.len() + s, &mut cache, &rt);
            out.push(l.clone());
        }
    }
    out
}

/// The persistent decode kernel runs the very launches a CUDA graph would replay: its
/// logits equal the graphs' bit for bit, and it did run the steps. Needs
/// `RUSTORCH_CUDA_MEGA=1` (the path is opt-in; scripts/gpu-check.sh sets it for this test).
#[test]
fn megakernel_equals_graphs() {
    if std::env::var("RUSTORCH_CUDA_MEGA").as_deref() != Ok("1") {
        eprintln!("SKIPPED: megakernel_equals_graphs: RUSTORCH_CUDA_MEGA=1 is not set");
        return;
    }
    let prompts = fixture_prompts();
    for path in gpu_models() {
        let Some((_, gpu, tok)) = open(&path) else {
            continue;
        };
        let toks = encode_prompts(&tok, &prompts[..4]);
        let before = gpu.cuda_graph_stats().expect("stats");
        let mega = decode_logits(&gpu, &toks, 24);
        let mid = gpu.cuda_graph_stats().expect("stats");
        gpu.set_cuda_megakernel(false);
        let graphs = decode_logits(&gpu, &toks, 24);
        let after = gpu.cuda_graph_stats().expect("stats");
        eprintln!(
            "{}: {} steps as one kernel, then {} graph replays ({} captures)",
            path.display(),
            mid.mega - before.mega,
            after.replayed - mid.replayed,
            after.captured - mid.captured
        );
        assert!(
            mid.mega - before.mega >= 90,
            "the persistent kernel ran too few steps"
        );
        assert_eq!(after.mega, mid.mega);
        let bad = differing_steps(&mega, &graphs);
        assert_eq!(
            bad,
            0,
            "{}: {bad} of {} steps differ",
            path.display(),
            mega.len()
        );
    }
}

/// Whether the environment leaves decode steps to CUDA graphs with early launches (the
/// defaults); else the early-launch tests skip.
fn early_launch_default() -> bool {
    let var = |k: &str| std::env::var(k).unwrap_or_default();
    if var("RUSTORCH_CUDA_EARLY") == "0"
        || var("RUSTORCH_CUDA_GRAPHS") == "0"
        || var("RUSTORCH_CUDA_MEGA") == "1"
    {
        eprintln!(
            "SKIPPED: early-launch tests: RUSTORCH_CUDA_EARLY/GRAPHS/MEGA are not the defaults"
        );
        return false;
    }
    true
}

/// Greedy decode of two prompts on two caches of one model, one step of each in turn.
fn alternate_logits(gpu: &Model, a: &[u32], b: &[u32], steps: usize) -> Vec<Vec<f32>> {
    let rt = Runtime::new(2);
    let mut ca = gpu.new_cache(a.len() + steps + 1);
    let mut cb = gpu.new_cache(b.len() + steps + 1);
    let mut la = prompt_logits(gpu, a, &mut ca, &rt);
    let mut lb = prompt_logits(gpu, b, &mut cb, &rt);
    let mut out = Vec::new();
    for s in 0..steps {
        la = step(gpu, argmax(&la) as u32, a.len() + s, &mut ca, &rt);
        lb = step(gpu, argmax(&lb) as u32, b.len() + s, &mut cb, &rt);
        out.push(la.clone());
        out.push(lb.clone());
    }
    out
}

/// What [`early_off_then_on`] saw.
struct EarlyRun {
    /// Early launches during the run with them switched off.
    early_while_off: u64,
    /// Early launches, and early launches not confirmed, during the run with them on.
    hits: u64,
    misses: u64,
    /// Steps whose logits differ between the two runs.
    differing: usize,
}

/// `run` (decode steps returning each step's logits) with early launches off, then on.
fn early_off_then_on(gpu: &Model, run: impl Fn() -> Vec<Vec<f32>>) -> EarlyRun {
    gpu.set_cuda_early_launch(false);
    let checked = run();
    let before = gpu.cuda_graph_stats().expect("stats");
    gpu.set_cuda_early_launch(true);
    let early = run();
    let after = gpu.cuda_graph_stats().expect("stats");
    EarlyRun {
        early_while_off: before.early,
        hits: after.early - before.early,
        misses: after.early_missed - before.early_missed,
        differing: differing_steps(&early, &checked),
    }
}

/// Steps of two sequences on two caches in turn (as two sessions on one model do): a
/// graph holds its cache's addresses, so a step must never launch the other cache's graph
/// early (it would write its new cells into the other cache). Same logits as with early
/// launches off, bit for bit.
#[test]
fn early_launch_two_caches() {
    if !early_launch_default() {
        return;
    }
    let prompts = fixture_prompts();
    for path in gpu_models() {
        let Some((_, gpu, tok)) = open(&path) else {
            continue;
        };
        let enc = |i: usize| tok.encode(&prompts[i].0, true, true).expect("tokenize");
        // prompts of different lengths: one cache's new slots are cells the other uses
        let a = enc(0);
        let b = (1..prompts.len())
            .map(enc)
            .find(|b| b.len() != a.len())
            .expect("two prompts of different lengths");
        let r = early_off_then_on(&gpu, || alternate_logits(&gpu, &a, &b, 16));
        eprintln!(
            "{}: two caches in turn, 32 steps: {} launched early, {} not confirmed",
            path.display(),
            r.hits,
            r.misses
        );
        assert_eq!(
            r.differing, 0,
            "{} steps' logits differ with early launches",
            r.differing
        );
    }
}

/// A decode step that launches the last step's graph before its dry run (the default)
/// returns the very logits of one that waits for the dry run, and most steps did launch
/// early.
#[test]
fn early_launch_equals_checked_replay() {
    if !early_launch_default() {
        return;
    }
    let prompts = fixture_prompts();
    for path in gpu_models() {
        let Some((_, gpu, tok)) = open(&path) else {
            continue;
        };
        let toks = encode_prompts(&tok, &prompts[..4]);
        let r = early_off_then_on(&gpu, || decode_logits(&gpu, &toks, 24));
        eprintln!(
            "{}: {} of 96 steps launched early, {} early launches not confirmed",
            path.display(),
            r.hits,
            r.misses
        );
        assert_eq!(r.early_while_off, 0, "early launches while switched off");
        assert!(r.hits >= 60, "only {} of 96 steps launched early", r.hits);
        assert_eq!(
            r.differing, 0,
            "{} steps' logits differ with early launches",
            r.differing
        );
    }
}

/// Logits read back from the GPU are views of page-locked buffers that the backend does not
/// reuse while a view lives: outputs held across later steps (more of them than the pool
/// keeps, so the last ones are copies) keep the values they had when returned.
#[test]
fn held_logits_stay_put() {
    let prompts = fixture_prompts();
    for path in gpu_models() {
        let Some((_, gpu, tok)) = open(&path) else {
            continue;
        };
        let rt = Runtime::new(2);
        let nv = gpu.hparams().n_vocab;
        let prompt = encode_prompts(&tok, &prompts[..1]).remove(0);
        let mut cache = gpu.new_cache(prompt.len() + 16);
        gpu.forward(&Batch::from_prompt(&prompt, 0, 0, false), &mut cache, &rt)
            .expect("prompt");
        let mut held = Vec::new();
        for s in 0..8 {
            let mut b = Batch::new();
            b.push((100 + 7 * s) % nv as u32, prompt.len() as u32 + s, 0, true);
            let out = gpu.forward(&b, &mut cache, &rt).expect("decode");
            let copy = out.last(nv).expect("logits").to_vec();
            held.push((out, copy));
        }
        for (s, (out, copy)) in held.iter().enumerate() {
            assert_eq!(
                out.last(nv).expect("logits"),
                &copy[..],
                "{}: step {s}'s held logits changed",
                path.display()
            );
        }
        // (the steps' logits differ, so a reused buffer would show)
        assert_ne!(held[0].1, held[7].1);
    }
}

/// `f(name, path, cpu, gpu, prompts)` for SmolLM2 (the parity fixture's prompts) and each model of
/// `RUSTORCH_GPU_MODELS` (the same prompts' text re-tokenized), skipping absent ones.
fn each_model(mut f: impl FnMut(&str, &std::path::Path, &Model, &Model, &[Vec<u32>])) {
    let prompts = fixture_prompts();
    for (i, path) in gpu_models().into_iter().enumerate() {
        if let Some((cpu, gpu, tok)) = open(&path) {
            let toks: Vec<Vec<u32>> = if i == 0 {
                prompts.iter().map(|p| p.1.clone()).collect()
            } else {
                encode_prompts(&tok, &prompts)
            };
            let name = if i == 0 {
                "SmolLM2-135M Q4_1".to_string()
            } else {
                path.display().to_string()
            };
            f(&name, &path, &cpu, &gpu, &toks);
        }
    }
}

#[test]
fn gpu_matches_cpu() {
    each_model(|name, _, cpu, gpu, toks| {
        let r = compare(cpu, gpu, toks);
        check(name, &r);
        if name.starts_with("SmolLM2") {
            assert!(
                r.greedy_equal >= 7,
                "SmolLM2: greedy equal in {} of 8",
                r.greedy_equal
            );
        }
    });
}

/// Whether `path` has a matrix type without an exact GPU product (printed as skipped).
fn no_exact_product(name: &str, path: &std::path::Path) -> bool {
    let gguf = GgufFile::open(path).expect("open");
    let odd = gguf
        .tensors()
        .iter()
        .filter(|t| t.dims.len() == 2)
        .map(|t| t.ty)
        .find(|ty| {
            use rustorch_core::GgmlType::*;
            !matches!(ty, Q4_0 | Q4_1 | Q5_0 | Q5_1 | Q8_0 | Q4_K | Q6_K)
        });
    if let Some(ty) = odd {
        eprintln!("SKIPPED: {name}: {ty} matrices have no exact GPU product");
    }
    odd.is_some()
}

/// With `--gpu-exact` (`Model::set_cuda_exact`), every teacher-forced step's logits equal the
/// CPU's to the bit and every greedy continuation is the CPU's, on models whose matrices all
/// have exact GPU products (others skip with a line).
#[test]
fn gpu_exact_equals_cpu() {
    each_model(|name, path, cpu, gpu, toks| {
        if no_exact_product(name, path) {
            return;
        }
        gpu.set_cuda_exact(true);
        let r = compare(cpu, gpu, toks);
        gpu.set_cuda_exact(false);
        eprintln!(
            "{name}, --gpu-exact: {} of {} teacher-forced steps' logits equal to the bit, mean KL {:.2e}, greedy {GREEDY} tokens equal in {}/{}",
            r.identical, r.steps, r.mean_kl, r.greedy_equal, r.prompts
        );
        assert_eq!(r.identical, r.steps, "{name}: steps whose logits differ");
        assert_eq!(
            r.greedy_equal, r.prompts,
            "{name}: greedy continuations differ"
        );
    });
}

/// Exact mode decoding several sequences at once (batches of three, then two tokens: the
/// products' multi-token kernels, a quantization launch before the down product) equals the
/// CPU to the bit, teacher-forced on the CPU's greedy tokens.
#[test]
fn gpu_exact_batched_equals_cpu() {
    const SEQS: usize = 3;
    const BSTEPS: usize = 16;
    each_model(|name, path, cpu, gpu, toks| {
        if no_exact_product(name, path) {
            return;
        }
        let rt = Runtime::new(std::thread::available_parallelism().map_or(2, |n| n.get()));
        let nv = cpu.hparams().n_vocab;
        let prompts = &toks[..SEQS];
        let ctx: usize = prompts.iter().map(|p| p.len() + BSTEPS + 1).sum();
        gpu.set_cuda_exact(true);
        let (mut cc, mut gc) = (cpu.new_cache(ctx), gpu.new_cache(ctx));
        let mut next = Vec::new();
        for (s, p) in prompts.iter().enumerate() {
            let b = Batch::from_prompt(p, 0, s as u32, false);
            let c = cpu.forward(&b, &mut cc, &rt).expect("cpu prompt");
            gpu.forward(&b, &mut gc, &rt).expect("gpu prompt");
            next.push(argmax(c.last(nv).expect("logits")) as u32);
        }
        let (mut rows, mut differ) = (0, 0);
        for step in 0..BSTEPS {
            // three sequences, then the first two
            let n = if step < BSTEPS / 2 { SEQS } else { 2 };
            let mut b = Batch::new();
            for (s, p) in prompts.iter().enumerate().take(n) {
                b.push(next[s], (p.len() + step) as u32, s as u32, true);
            }
            let c = cpu.forward(&b, &mut cc, &rt).expect("cpu step");
            let g = gpu.forward(&b, &mut gc, &rt).expect("gpu step");
            for (s, t) in next.iter_mut().enumerate().take(n) {
                let (cl, gl) = (
                    c.logits_for(s, nv).expect("cpu logits"),
                    g.logits_for(s, nv).expect("gpu logits"),
                );
                rows += 1;
                differ += usize::from(cl.iter().zip(gl).any(|(x, y)| x.to_bits() != y.to_bits()));
                *t = argmax(cl) as u32;
            }
        }
        gpu.set_cuda_exact(false);
        eprintln!(
            "{name}, --gpu-exact, batches of 3 and 2: {} of {rows} rows' logits equal to the bit",
            rows - differ
        );
        assert_eq!(differ, 0, "{name}: batched rows whose logits differ");
    });
}
