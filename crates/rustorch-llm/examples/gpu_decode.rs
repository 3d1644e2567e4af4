//! Greedy decoding on the GPU with a breakdown of where the host's time goes (debugging
//! aid): tokens per second, and per token the host time of uploading inputs, the graph
//! dry run, captures and replays (launch + logits read), plus how many steps replayed.
//! `cargo run --release -p rustorch-llm --example gpu_decode -- [MODEL] [N] [PROMPT_LEN]`
use std::sync::Arc;
use std::time::Instant;

use rustorch_core::gguf::GgufFile;
use rustorch_llm::{Batch, Model, Placement, Runtime};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let path = args
        .get(1)
        .cloned()
        .unwrap_or_else(|| "models/SmolLM2-135M-Instruct.Q4_1.gguf".into());
    let n: usize = args.get(2).map_or(Ok(256), |s| s.parse())?;
    let np: usize = args.get(3).map_or(Ok(16), |s| s.parse())?;
    let model = Model::load_on(
        Arc::new(GgufFile::open(&path)?),
        Placement::Cuda(0),
        np + n + 4,
    )?;
    let rt = Runtime::new(1);
    let nv = model.hparams().n_vocab;
    let mut cache = model.new_cache(np + n + 4);
    let prompt: Vec<u32> = (0..np as u32).map(|i| 100 + 7 * i).collect();
    let mut out = model.forward(&Batch::from_prompt(&prompt, 0, 0, false), &mut cache, &rt)?;
    let argmax = |x: &[f32]| (0..x.len()).fold(0, |b, i| if x[i] > x[b] { i } else { b });
    // GD_RANDOM=1: random tokens as `rustorch bench` feeds them, no argmax on the host
    let random = std::env::var("GD_RANDOM").is_ok_and(|v| v == "1");
    let mut seed = 42u64;
    let before = model.cuda_graph_stats().unwrap_or_default();
    let t0 = Instant::now();
    for s in 0..n {
        let t = if random {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((seed >> 33) % nv as u64) as u32
        } else {
            argmax(out.last(nv).ok_or("logits")?) as u32
        };
        let mut b = Batch::new();
        b.push(t, (np + s) as u32, 0, true);
        out = model.forward(&b, &mut cache, &rt)?;
    }
    let dt = t0.elapsed().as_secs_f64();
    let st = model.cuda_graph_stats().unwrap_or_default();
    let per = |a: u64, b: u64| (a - b) as f64 / 1e3 / n as f64;
    println!(
        "{n} tokens: {:.1} t/s ({:.1} µs/token); replayed {} ({} launched early, {} early \
         launches not confirmed), captured {}, eager {}, failed {}",
        n as f64 / dt,
        dt * 1e6 / n as f64,
        st.replayed - before.replayed,
        st.early - before.early,
        st.early_missed - before.early_missed,
        st.captured - before.captured,
        st.eager - before.eager,
        st.failed - before.failed
    );
    println!(
        "host µs/token: prepare {:.1}, dry run {:.1}, capture {:.1}, replay (launch + read) {:.1}",
        per(st.prepare_ns, before.prepare_ns),
        per(st.dry_ns, before.dry_ns),
        per(st.capture_ns, before.capture_ns),
        per(st.replay_ns, before.replay_ns)
    );
    println!(
        "critical path µs/token: wait for the device {:.1}, logits copy {:.1}, read-back to \
         next launch {:.1} (its input copy call {:.1}), launch call {:.1} (over {} calls)",
        per(st.sync_ns, before.sync_ns),
        per(st.copy_ns, before.copy_ns),
        (st.gap_ns - before.gap_ns) as f64 / 1e3 / (st.gaps - before.gaps).max(1) as f64,
        per(st.upload_ns, before.upload_ns),
        (st.launch_ns - before.launch_ns) as f64 / 1e3 / (st.gaps - before.gaps).max(1) as f64,
        st.gaps - before.gaps
    );
    // with kernels built with RUSTORCH_CUDA_DEFS=RT_STAMP and RUSTORCH_STAMP_OUT=FILE: the
    // stamps of 4 more steps, one line per grid (start µs from the first, µs to the next
    // grid's start, µs from its first to its last block's start, blocks, threads)
    if let Ok(file) = std::env::var("RUSTORCH_STAMP_OUT") {
        model
            .cuda_stamps()
            .ok_or("no stamps: kernels built without RT_STAMP")?;
        for s in 0..4 {
            let t = argmax(out.last(nv).ok_or("logits")?) as u32;
            let mut b = Batch::new();
            b.push(t, (np + n + s) as u32, 0, true);
            out = model.forward(&b, &mut cache, &rt)?;
        }
        let st = model.cuda_stamps().ok_or("stamps")?;
        let mut grids: Vec<(u64, u64, u32, u32)> = Vec::new();
        let mut left = 0u32;
        for &(t, g, b) in &st {
            match grids.last_mut() {
                Some(last) if left > 0 && last.2 == g && last.3 == b => {
                    last.1 = t;
                    left -= 1;
                }
                _ => {
                    grids.push((t, t, g, b));
                    left = g.saturating_sub(1);
                }
            }
        }
        let t0 = grids.first().map_or(0, |g| g.0);
        let mut text = String::new();
        for (i, g) in grids.iter().enumerate() {
            let next = grids.get(i + 1).map_or(g.1, |n| n.0);
            text.push_str(&format!(
                "{:.3} {:.3} {:.3} {} {}\n",
                (g.0 - t0) as f64 / 1e3,
                (next - g.0) as f64 / 1e3,
                (g.1 - g.0) as f64 / 1e3,
                g.2,
                g.3
            ));
        }
        std::fs::write(&file, text)?;
        println!(
            "{} blocks in {} grids written to {file}",
            st.len(),
            grids.len()
        );
    }
    Ok(())
}
