//! Greedy decoding from raw token ids (a debugging aid):
//! `cargo run --release -p rustorch-llm --example greedy_ids -- MODEL N ID ID ...`
use std::sync::Arc;

use rustorch_core::gguf::GgufFile;
use rustorch_llm::{Batch, Model, Runtime};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    if args.len() < 4 {
        return Err("usage: greedy_ids MODEL N_PREDICT ID [ID ...]".into());
    }
    let model = Model::load(Arc::new(GgufFile::open(&args[1])?))?;
    let n: usize = args[2].parse()?;
    let mut tokens: Vec<u32> = args[3..]
        .iter()
        .map(|s| s.parse())
        .collect::<Result<_, _>>()?;
    let rt = Runtime::new(2);
    let mut cache = model.new_cache(512);
    let nv = model.hparams().n_vocab;
    let t0 = std::time::Instant::now();
    let mut out = model.forward(&Batch::from_prompt(&tokens, 0, 0, false), &mut cache, &rt)?;
    let mut gen = Vec::new();
    for _ in 0..n {
        let logits = out.last(nv).ok_or("no logits")?;
        let (best, _) = logits
            .iter()
            .enumerate()
            .fold(
                (0, f32::NEG_INFINITY),
                |acc, (i, &v)| if v > acc.1 { (i, v) } else { acc },
            );
        gen.push(best as u32);
        let mut b = Batch::new();
        b.push(best as u32, tokens.len() as u32, 0, true);
        tokens.push(best as u32);
        out = model.forward(&b, &mut cache, &rt)?;
    }
    println!("{gen:?}");
    println!("{:.1} ms", t0.elapsed().as_secs_f64() * 1e3);
    Ok(())
}
