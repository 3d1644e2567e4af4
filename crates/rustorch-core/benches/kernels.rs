//! Kernel micro-benchmarks (no external harness):
//! `cargo bench -p rustorch-core --bench kernels -- [filter] [--threads N]`
//!
//! For each weight type: GEMV (one activation row) on a cache-resident matrix and on a
//! DRAM-sized one (GB/s of weights streamed), the packed GEMM with 8 rows (a decode step of
//! eight sequences) on the cache-resident matrix and with 512 rows (GMAC/s), for every kernel
//! family the CPU has. Also the activation quantizers.

use std::time::Instant;

use rustorch_core::kernels::{
    matmul_q, quantize_simd, vec_dot_type, Isa, MatmulPath, QActs, QMatrix, ThreadPool,
};
use rustorch_core::quant;
use rustorch_core::GgmlType;

fn rand_f32(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32) - 0.5
        })
        .collect()
}

fn weights(ty: GgmlType, rows: usize, cols: usize) -> Vec<u8> {
    // quantize a few distinct rows, then tile them (quantizing 100s of MB is slow)
    let rb = cols / ty.block_size() * ty.type_size();
    let distinct = rows.min(64);
    let mut base = vec![0u8; rb * distinct];
    quant::quantize(ty, &rand_f32(cols * distinct, 7), &mut base).unwrap();
    let mut w = Vec::with_capacity(rb * rows);
    while w.len() < rb * rows {
        let take = (rb * rows - w.len()).min(base.len());
        w.extend_from_slice(&base[..take]);
    }
    w
}

/// Median seconds of `reps` runs of `f`.
fn time(reps: usize, mut f: impl FnMut()) -> f64 {
    f();
    let mut v: Vec<f64> = (0..reps)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64()
        })
        .collect();
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

fn main() {
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| a != "--bench")
        .collect();
    let mut threads = 1;
    let mut filter = String::new();
    let mut i = 0;
    while i < args.len() {
        if args[i] == "--threads" {
            threads = args[i + 1].parse().unwrap();
            i += 2;
        } else {
            filter = args[i].clone();
            i += 1;
        }
    }
    let pool = ThreadPool::new(threads);
    let isas = Isa::available();
    println!("threads {threads}, families {isas:?}");
    println!(
        "| type | family | gemv L2 (GMAC/s) | gemv DRAM (GB/s) | gemm 8 tok L2 (GMAC/s) | gemm 512 tok (GMAC/s) |"
    );
    println!("| --- | --- | ---: | ---: | ---: | ---: |");
    let types = [
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q5_0,
        GgmlType::Q8_0,
        GgmlType::Q4_K,
        GgmlType::Q5_K,
        GgmlType::Q6_K,
        GgmlType::F16,
    ];
    for ty in types {
        if !filter.is_empty()
            && !ty
                .to_string()
                .to_lowercase()
                .contains(&filter.to_lowercase())
        {
            continue;
        }
        let cols = 1536;
        let small_rows = 512;
        let big_rows = (256 << 20) / (cols / ty.block_size() * ty.type_size());
        let ws = weights(ty, small_rows, cols);
        let wb = weights(ty, big_rows, cols);
        let ms = QMatrix {
            ty,
            data: &ws,
            n_rows: small_rows,
            n_cols: cols,
        };
        let mb = QMatrix {
            ty,
            data: &wb,
            n_rows: big_rows,
            n_cols: cols,
        };
        let x1 = rand_f32(cols, 1);
        let xp = rand_f32(cols * 512, 2);
        let x8 = rand_f32(cols * 8, 4);
        for &isa in &isas {
            let mut qa1 = QActs::new();
            qa1.quantize(None, isa, vec_dot_type(ty), &x1, cols)
                .unwrap();
            let mut qap = QActs::new();
            qap.quantize(Some(&pool), isa, vec_dot_type(ty), &xp, cols)
                .unwrap();
            let mut out_s = vec![0f32; small_rows];
            let mut out_b = vec![0f32; big_rows];
            let mut qa8 = QActs::new();
            qa8.quantize(None, isa, vec_dot_type(ty), &x8, cols)
                .unwrap();
            let mut out_p = vec![0f32; small_rows * 512];
            let reps = if isa == Isa::Scalar { 3 } else { 21 };
            let t_small = time(reps * 5, || {
                matmul_q(&pool, isa, MatmulPath::Gemv, &ms, &qa1, &mut out_s)
            });
            let t_big = time(reps.min(7), || {
                matmul_q(&pool, isa, MatmulPath::Gemv, &mb, &qa1, &mut out_b)
            });
            let gemm_path = if isa == Isa::Scalar {
                MatmulPath::Gemv
            } else {
                MatmulPath::Gemm
            };
            let t_gemm8 = time(reps * 5, || {
                matmul_q(&pool, isa, gemm_path, &ms, &qa8, &mut out_p)
            });
            let t_gemm = time(3, || matmul_q(&pool, isa, gemm_path, &ms, &qap, &mut out_p));
            println!(
                "| {ty} | {} | {:.1} | {:.2} | {:.1} | {:.1} |",
                isa.name(),
                (small_rows * cols) as f64 / t_small / 1e9,
                wb.len() as f64 / t_big / 1e9,
                (small_rows * cols * 8) as f64 / t_gemm8 / 1e9,
                (small_rows * cols * 512) as f64 / t_gemm / 1e9
            );
        }
    }
    // activation quantizers
    let x = rand_f32(1536 * 64, 3);
    for ty in [GgmlType::Q8_0, GgmlType::Q8_1, GgmlType::Q8_K] {
        let mut out = vec![0u8; x.len() / ty.block_size() * ty.type_size()];
        for &isa in &isas {
            let t = time(21, || quantize_simd(isa, ty, &x, &mut out).unwrap());
            let mut qa = QActs::new();
            let t2 = time(21, || qa.quantize(None, isa, ty, &x, 1536).unwrap());
            println!(
                "quantize {ty} {}: blocks {:.2} Gvalues/s, rows with side data {:.2} Gvalues/s",
                isa.name(),
                x.len() as f64 / t / 1e9,
                x.len() as f64 / t2 / 1e9
            );
        }
    }
}
