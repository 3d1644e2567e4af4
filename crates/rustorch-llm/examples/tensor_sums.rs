//! Prints the sum of every intermediate tensor of one forward pass (all rows output, as the
//! parity fixtures were recorded), named as llama.cpp's `llama-eval-callback` names them, to
//! find where two implementations part:
//! `cargo run --release -p rustorch-llm --example tensor_sums -- MODEL ID ...`
//!
//! With `RUSTORCH_DUMP_DIR=DIR` every tensor is also written to `DIR/NAME.f32` (little-endian
//! f32), for an element-by-element comparison with `scripts/dump_llama_tensors.py`'s output
//! by `scripts/compare_tensors.py`.
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
    let dump_dir = std::env::var_os("RUSTORCH_DUMP_DIR").map(std::path::PathBuf::from);
    if let Some(d) = &dump_dir {
        std::fs::create_dir_all(d)?;
    }
    let mut rt = Runtime::new(2);
    rt.tensor_hook = Some(Box::new(move |name, il, x| {
        let name = if name.starts_with("result") {
            name.to_string()
        } else {
            format!("{name}-{il}")
        };
        let sum: f64 = x.iter().map(|&v| v as f64).sum();
        println!("{name} {sum:.6}");
        if let Some(d) = &dump_dir {
            let bytes: Vec<u8> = x.iter().flat_map(|v| v.to_le_bytes()).collect();
            if let Err(e) = std::fs::write(d.join(format!("{name}.f32")), bytes) {
                eprintln!("cannot write {name}: {e}");
            }
        }
    }));
    model.forward(
        &Batch::from_prompt(&tokens, 0, 0, true),
        &mut model.new_cache(64),
        &rt,
    )?;
    Ok(())
}
