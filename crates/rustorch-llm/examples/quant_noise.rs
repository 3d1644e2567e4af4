//! How far our CPU path's own arithmetic is from f32 arithmetic on real weights: the
//! teacher-forced KL divergence of the fast path (activations quantized to 8-bit blocks, as
//! llama.cpp's CPU does) from the reference path (weights dequantized, f32 products), over
//! the SmolLM2 parity prompts, with the figures `tests/gpu.rs` reports for GPU against CPU.
//! A GPU path that differs from the CPU only in rounding lands near these figures.
//! `cargo run --release -p rustorch-llm --example quant_noise -- [MODEL] [PROMPTS] [STEPS]`
use std::sync::Arc;

use rustorch_core::gguf::GgufFile;
use rustorch_llm::{Batch, KvCache, Model, Runtime};

fn logits(model: &Model, b: &Batch, cache: &mut KvCache, rt: &Runtime) -> Vec<f32> {
    let nv = model.hparams().n_vocab;
    let out = model.forward(b, cache, rt).expect("forward");
    out.last(nv).expect("logits").to_vec()
}

fn step(tok: u32, pos: usize) -> Batch {
    let mut b = Batch::new();
    b.push(tok, pos as u32, 0, true);
    b
}

fn argmax(x: &[f32]) -> usize {
    (0..x.len()).fold(0, |b, i| if x[i] > x[b] { i } else { b })
}

fn lse(x: &[f32]) -> f64 {
    let m = x.iter().fold(f32::NEG_INFINITY, |a, &v| a.max(v)) as f64;
    m + x.iter().map(|&v| (v as f64 - m).exp()).sum::<f64>().ln()
}

fn kl(p: &[f32], q: &[f32]) -> f64 {
    let (lp, lq) = (lse(p), lse(q));
    p.iter()
        .zip(q)
        .map(|(&a, &b)| {
            let la = a as f64 - lp;
            la.exp() * (la - (b as f64 - lq))
        })
        .sum()
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let path = args
        .get(1)
        .cloned()
        .unwrap_or_else(|| "models/SmolLM2-135M-Instruct.Q4_1.gguf".into());
    let n_prompts: usize = args.get(2).map_or(Ok(8), |s| s.parse())?;
    let steps: usize = args.get(3).map_or(Ok(64), |s| s.parse())?;
    let model = Model::load(Arc::new(GgufFile::open(&path)?))?;
    let doc: serde_json::Value =
        serde_json::from_slice(&std::fs::read("tests/fixtures/parity/smollm2.json")?)?;
    let threads = std::thread::available_parallelism().map_or(2, |n| n.get());
    let fast = Runtime::new(threads);
    let mut exact = Runtime::new(threads);
    exact.reference = true;
    let (mut kl_sum, mut kl_max, mut agree, mut n, mut greedy) = (0f64, 0f64, 0, 0, 0);
    let cases = doc["cases"].as_array().ok_or("cases")?;
    for c in &cases[..n_prompts] {
        let toks: Vec<u32> = c["tokens"]
            .as_array()
            .ok_or("tokens")?
            .iter()
            .map(|t| t.as_u64().unwrap_or(0) as u32)
            .collect();
        let np = toks.len();
        let prompt = Batch::from_prompt(&toks, 0, 0, false);
        let (mut cf, mut ce) = (
            model.new_cache(np + steps + 1),
            model.new_cache(np + steps + 1),
        );
        let (mut f, mut e) = (
            logits(&model, &prompt, &mut cf, &fast),
            logits(&model, &prompt, &mut ce, &exact),
        );
        let (mut ft, mut et) = (Vec::new(), Vec::new());
        for s in 0..steps {
            let k = kl(&f, &e);
            kl_sum += k;
            kl_max = kl_max.max(k);
            agree += usize::from(argmax(&f) == argmax(&e));
            n += 1;
            let t = argmax(&f) as u32;
            ft.push(t);
            et.push(argmax(&e) as u32);
            f = logits(&model, &step(t, np + s), &mut cf, &fast);
            e = logits(&model, &step(t, np + s), &mut ce, &exact);
        }
        // the reference path's own greedy continuation
        let mut ce = model.new_cache(np + steps + 1);
        let mut e = logits(&model, &prompt, &mut ce, &exact);
        let mut own = Vec::new();
        for s in 0..32.min(steps) {
            let t = argmax(&e) as u32;
            own.push(t);
            e = logits(&model, &step(t, np + s), &mut ce, &exact);
        }
        greedy += usize::from(own[..] == ft[..own.len()]);
        let _ = et;
    }
    println!(
        "CPU fast vs f32-product reference over {n_prompts} prompts x {steps} steps: mean KL {:.2e}, max KL {:.2e}, top-1 {:.2}%, greedy {} tokens equal in {greedy}/{n_prompts}",
        kl_sum / n as f64,
        kl_max,
        100.0 * agree as f64 / n as f64,
        32.min(steps)
    );
    Ok(())
}
