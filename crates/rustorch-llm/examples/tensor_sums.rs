//! Prints the sum of every intermediate tensor of one forward pass, named as llama.cpp's
//! `llama-eval-callback` names them, to find where two implementations part:
//! `cargo run --release -p rustorch-llm --example tensor_sums -- MODEL ID ...`
use std::sync::Arc;

use rustorch_core::gguf::GgufFile;
use rustorch_llm::{Batch, Model, Runtime};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.len() < 2 {
        return Err("usage: tensor_sums MODEL ID [ID ...]".into());
    }
    let model = Model::load(Arc::new(GgufFile::open(&args[0])?))?;
    let tokens: Vec<u32> = args[1..]
        .iter()
        .map(|s| s.parse())
        .collect::<Result<_, _>>()?;
    let mut rt = Runtime::new(2);
    rt.tensor_hook = Some(Box::new(|name, il, x| {
        let sum: f64 = x.iter().map(|&v| v as f64).sum();
        println!("{name}-{il} {sum:.6}");
    }));
    model.forward(
        &Batch::from_prompt(&tokens, 0, 0, false),
        &mut model.new_cache(64),
        &rt,
    )?;
    Ok(())
}
