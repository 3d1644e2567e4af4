//! `rustorch quantize`: convert a GGUF model's weight matrices to another tensor format
//! (a "pure" conversion: every 2-D weight whose rows fit the format's block size gets the
//! target type; norms, biases and other 1-D tensors stay as they are).

use std::path::PathBuf;

use anyhow::{bail, Context};
use rustorch_core::gguf::{GgufFile, GgufWriter, Value};
use rustorch_core::quant;
use rustorch_core::GgmlType;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Input GGUF
    pub input: PathBuf,
    /// Output GGUF
    pub output: PathBuf,
    /// Target type: q4_0, q4_1, q5_0, q5_1, q8_0, q2_k, q3_k, q4_k, q5_k, q6_k, iq4_nl, iq4_xs, f16, bf16, f32
    pub ty: String,
    /// Overwrite the output file if it exists
    #[arg(long = "force")]
    pub force: bool,
}

/// llama.cpp's `general.file_type` value for a pure conversion to `ty`.
fn file_type(ty: GgmlType) -> Option<u32> {
    use GgmlType::*;
    Some(match ty {
        F32 => 0,
        F16 => 1,
        Q4_0 => 2,
        Q4_1 => 3,
        Q8_0 => 7,
        Q5_0 => 8,
        Q5_1 => 9,
        Q2_K => 10,
        Q3_K => 12,
        Q4_K => 15,
        Q5_K => 17,
        Q6_K => 18,
        IQ4_NL => 25,
        IQ4_XS => 30,
        BF16 => 32,
        _ => return None,
    })
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let target = GgmlType::from_name(&args.ty)
        .filter(|t| quant::supports_quantize(*t) && file_type(*t).is_some())
        .with_context(|| {
            format!(
                "unknown or unsupported target type '{}' (use q4_0, q4_1, q5_0, q5_1, q8_0, q2_k, q3_k, q4_k, q5_k, q6_k, iq4_nl, iq4_xs, f16, bf16, f32)",
                args.ty
            )
        })?;
    if args.output.exists() && !args.force {
        bail!(
            "'{}' exists; pass --force to overwrite it",
            args.output.display()
        );
    }
    let src = GgufFile::open(&args.input)?;
    let mut w = GgufWriter::new();
    for (k, v) in src.metadata() {
        w.add(k.clone(), v.clone());
    }
    w.add(
        "general.file_type",
        Value::U32(file_type(target).unwrap_or(0)),
    );
    w.add("general.quantization_version", Value::U32(2));
    let (mut converted, mut kept) = (0usize, 0usize);
    let t0 = std::time::Instant::now();
    for t in src.tensors() {
        let data = src.tensor_data(t);
        let is_matrix = t.dims.len() >= 2 && t.dims.iter().skip(1).any(|&d| d > 1);
        let fits = t.ne0() % target.block_size() == 0;
        if !is_matrix || !fits || t.ty == target || !quant::supports_dequantize(t.ty) {
            w.add_tensor(t.name.clone(), t.ty, &t.dims, data.to_vec())?;
            kept += 1;
            continue;
        }
        let n = t.n_elements() as usize;
        let mut f = vec![0f32; n];
        quant::dequantize(t.ty, data, &mut f)
            .with_context(|| format!("decoding tensor '{}'", t.name))?;
        let bytes = target
            .bytes_for(n as u64)
            .with_context(|| format!("tensor '{}' does not fit {target}", t.name))?;
        let mut q = vec![0u8; bytes as usize];
        quant::quantize(target, &f, &mut q)
            .with_context(|| format!("encoding tensor '{}'", t.name))?;
        w.add_tensor(t.name.clone(), target, &t.dims, q)?;
        converted += 1;
    }
    let mut file = std::fs::File::create(&args.output)
        .with_context(|| format!("cannot create '{}'", args.output.display()))?;
    w.write_to(&mut file)?;
    eprintln!(
        "quantize: {converted} tensors converted to {target}, {kept} kept, in {:.1} s -> {}",
        t0.elapsed().as_secs_f64(),
        args.output.display()
    );
    Ok(())
}
