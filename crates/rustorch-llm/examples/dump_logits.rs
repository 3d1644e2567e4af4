//! Writes the last-token logits of a prompt (raw token ids) as little-endian f32, for
//! comparing with llama.cpp by hand:
//! `cargo run --release -p rustorch-llm --example dump_logits -- MODEL OUT.f32 [--reference] ID ...`
use std::io::Write;
use std::sync::Arc;

use rustorch_core::gguf::GgufFile;
use rustorch_llm::{Batch, Model, Runtime};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    let reference = args.iter().any(|a| a == "--reference");
    args.retain(|a| a != "--reference");
    if args.len() < 3 {
        return Err("usage: dump_logits MODEL OUT.f32 [--reference] ID [ID ...]".into());
    }
    let model = Model::load(Arc::new(GgufFile::open(&args[0])?))?;
    let tokens: Vec<u32> = args[2..]
        .iter()
        .map(|s| s.parse())
        .collect::<Result<_, _>>()?;
    let mut rt = Runtime::new(2);
    rt.reference = reference;
    let out = model.forward(
        &Batch::from_prompt(&tokens, 0, 0, false),
        &mut model.new_cache(256),
        &rt,
    )?;
    let logits = out.last(model.hparams().n_vocab).ok_or("no logits")?;
    let mut f = std::fs::File::create(&args[1])?;
    for v in logits {
        f.write_all(&v.to_le_bytes())?;
    }
    Ok(())
}
