//! Every SIMD kernel against its scalar reference, on random blocks.
//!
//! * Activation quantizers (Q8_0, Q8_1, Q8_K): the SIMD encoders give the reference bytes.
//! * Quantized matmul (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL, Q4_K, Q5_K, Q6_K): every family
//!   (AVX2, AVX-512 where the CPU has them), both algorithms (GEMV and packed GEMM), several
//!   shapes, batch sizes and thread counts give results bit-identical to the scalar
//!   `vec_dot` (exact integer block sums, then the same float operations in the same order).
//! * F16 / F32 dots: equal up to summation order.

use rustorch_core::kernels::{
    dot_float, matmul_q, matmul_scalar, matmul_with, quantize_scalar, quantize_simd, vec_dot,
    vec_dot_type, Isa, MatmulPath, QActs, QMatrix, ThreadPool,
};
use rustorch_core::quant::{self, f32_to_f16};
use rustorch_core::GgmlType;

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        // splitmix64
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32
    }
    /// Roughly normal, times a per-call scale.
    fn normal(&mut self) -> f32 {
        (0..4).map(|_| self.unit()).sum::<f32>() - 2.0
    }
    fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next() as u8).collect()
    }
}

fn simd_isas() -> Vec<Isa> {
    let v: Vec<Isa> = Isa::available()
        .into_iter()
        .filter(|i| *i != Isa::Scalar)
        .collect();
    eprintln!("SIMD families on this CPU: {v:?}");
    v
}

/// Random activations with varied magnitudes, exact ties and zero blocks.
fn activations(rng: &mut Rng, n: usize) -> Vec<f32> {
    let mut x: Vec<f32> = (0..n).map(|_| rng.normal()).collect();
    for (i, chunk) in x.chunks_mut(32).enumerate() {
        let scale = match i % 5 {
            0 => 1.0,
            1 => 1e-3,
            2 => 37.0,
            3 => 1e-30,
            _ => 0.5,
        };
        for v in chunk.iter_mut() {
            *v *= scale;
        }
        if i % 7 == 3 {
            // exact ties: with amax = 127 the scale is 1 and k + 0.5 must round
            for (j, v) in chunk.iter_mut().enumerate() {
                *v = if j == 0 { 127.0 } else { j as f32 - 16.5 };
            }
        }
        if i % 11 == 5 {
            chunk.fill(0.0);
        }
    }
    x
}

#[test]
fn activation_quantizers_match_reference_bytes() {
    let mut rng = Rng(1);
    for isa in simd_isas() {
        for ty in [GgmlType::Q8_0, GgmlType::Q8_1, GgmlType::Q8_K] {
            for round in 0..20 {
                let n = 256 * (1 + round % 4);
                let mut x = activations(&mut rng, n);
                if round == 7 {
                    x[3] = f32::NAN;
                    x[300 % n] = f32::INFINITY;
                }
                if round == 8 {
                    x[5] = 1e-39; // subnormal-only block
                    for v in x[..32].iter_mut() {
                        *v = 1e-40;
                    }
                }
                if round == 9 {
                    // equal magnitudes of both signs: Q8_K takes the first
                    x[10] = -5.0;
                    x[20] = 5.0;
                }
                let bytes = n / ty.block_size() * ty.type_size();
                let mut want = vec![0u8; bytes];
                quantize_scalar(ty, &x, &mut want).unwrap();
                let mut got = vec![0u8; bytes];
                quantize_simd(isa, ty, &x, &mut got).unwrap();
                assert_eq!(got, want, "{isa:?} {ty} round {round}");
                let mut qa = QActs::new();
                let pool = ThreadPool::new(2);
                let x2: Vec<f32> = x.iter().chain(x.iter()).copied().collect();
                qa.quantize(Some(&pool), isa, ty, &x2, n).unwrap();
                assert_eq!(&qa.bytes()[..bytes], &want[..], "{isa:?} {ty} QActs row 0");
                assert_eq!(&qa.bytes()[bytes..], &want[..], "{isa:?} {ty} QActs row 1");
            }
        }
    }
}

/// Random weight rows of `ty`: quantized random floats for half the rows, random bytes with
/// sane f16 scales for the rest (covers every bit pattern of the quants).
fn weights(rng: &mut Rng, ty: GgmlType, n_rows: usize, n_cols: usize) -> Vec<u8> {
    let rb = n_cols / ty.block_size() * ty.type_size();
    let mut w = vec![0u8; rb * n_rows];
    for (r, row) in w.chunks_mut(rb).enumerate() {
        if r % 2 == 0 && quant::supports_quantize(ty) {
            let x: Vec<f32> = (0..n_cols).map(|_| rng.normal() * 0.1).collect();
            quant::quantize(ty, &x, row).unwrap();
            continue;
        }
        row.copy_from_slice(&rng.bytes(rb));
        let ts = ty.type_size();
        for blk in row.chunks_mut(ts) {
            let half_words = blk.len() / 2;
            let mut set = |off: usize, v: f32| {
                blk[off..off + 2].copy_from_slice(&f32_to_f16(v).to_le_bytes())
            };
            match ty {
                GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Q8_0 | GgmlType::IQ4_NL => {
                    set(0, rng.normal() * 0.01)
                }
                GgmlType::Q4_1 | GgmlType::Q5_1 => {
                    set(0, rng.normal() * 0.01);
                    set(2, rng.normal() * 0.1);
                }
                GgmlType::Q4_K | GgmlType::Q5_K => {
                    set(0, rng.normal() * 0.01);
                    set(2, rng.normal() * 0.01);
                }
                GgmlType::Q6_K => set(208, rng.normal() * 0.01),
                GgmlType::F16 => {
                    for k in 0..half_words {
                        set(2 * k, rng.normal());
                    }
                }
                GgmlType::F32 => blk.copy_from_slice(&rng.normal().to_le_bytes()),
                _ => {}
            }
        }
    }
    w
}

const TYPES: [GgmlType; 11] = [
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q8_0,
    GgmlType::IQ4_NL,
    GgmlType::Q4_K,
    GgmlType::Q5_K,
    GgmlType::Q6_K,
    GgmlType::F16,
    GgmlType::F32,
];

fn check_type(ty: GgmlType, seed: u64) {
    let mut rng = Rng(seed);
    let exact = !matches!(ty, GgmlType::F16 | GgmlType::F32);
    // the largest sizes cross the GEMV kernels' chunks (32 super-blocks, 64 blocks)
    let col_choices: &[usize] = if ty.block_size() == 256 {
        &[256, 768, 1536, 8448]
    } else {
        &[32, 96, 576, 1024, 2080]
    };
    for (case, &n_cols) in col_choices.iter().enumerate() {
        for &n_rows in &[1usize, 7, 16, 37] {
            let w = weights(&mut rng, ty, n_rows, n_cols);
            let m = QMatrix {
                ty,
                data: &w,
                n_rows,
                n_cols,
            };
            let n_tok = [1, 3, 8, 13, 2, 9, 37][(case + n_rows) % 7];
            let x = activations(&mut rng, n_tok * n_cols);
            // llama.cpp's arithmetic for this format and batch size, scalar code
            let mut want = vec![0f32; n_tok * n_rows];
            matmul_scalar(&m, &x, &mut want).unwrap();
            for isa in Isa::available() {
                for path in [MatmulPath::Gemv, MatmulPath::Gemm, MatmulPath::Auto] {
                    for threads in [1, 3] {
                        let pool = ThreadPool::new(threads);
                        let mut qa = QActs::new();
                        let mut got = vec![f32::NAN; n_tok * n_rows];
                        matmul_with(&pool, isa, path, &m, &x, &mut got, &mut qa).unwrap();
                        for (i, (g, e)) in got.iter().zip(&want).enumerate() {
                            let ok = if exact {
                                g.to_bits() == e.to_bits()
                            } else {
                                (g - e).abs() <= 1e-5 * (1.0 + e.abs()) * (n_cols as f32).sqrt()
                            };
                            assert!(
                                ok,
                                "{ty} {isa:?} {path:?} threads {threads}: {n_rows}x{n_cols}, {n_tok} tokens, \
                                 out[{i}] = {g} want {e}"
                            );
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn matmul_q4_0() {
    check_type(GgmlType::Q4_0, 10);
}
#[test]
fn matmul_q4_1() {
    check_type(GgmlType::Q4_1, 11);
}
#[test]
fn matmul_q5_0() {
    check_type(GgmlType::Q5_0, 12);
}
#[test]
fn matmul_q5_1() {
    check_type(GgmlType::Q5_1, 13);
}
#[test]
fn matmul_q8_0() {
    check_type(GgmlType::Q8_0, 14);
}
#[test]
fn matmul_iq4_nl() {
    check_type(GgmlType::IQ4_NL, 15);
}
#[test]
fn matmul_q4_k() {
    check_type(GgmlType::Q4_K, 16);
}
#[test]
fn matmul_q5_k() {
    check_type(GgmlType::Q5_K, 17);
}
#[test]
fn matmul_q6_k() {
    check_type(GgmlType::Q6_K, 18);
}
#[test]
fn matmul_f16() {
    check_type(GgmlType::F16, 19);
}
#[test]
fn matmul_f32() {
    check_type(GgmlType::F32, 20);
}

/// GEMM tiles and GEMV agree bit for bit on the same quantized activations, for every
/// batch size around the tile widths (the property batched prompt evaluation relies on).
#[test]
fn gemm_equals_gemv_for_all_batch_sizes() {
    let mut rng = Rng(99);
    let pool = ThreadPool::new(2);
    for isa in simd_isas() {
        for ty in TYPES {
            let n_cols = if ty.block_size() == 256 { 512 } else { 64 };
            let n_rows = 24;
            let w = weights(&mut rng, ty, n_rows, n_cols);
            let m = QMatrix {
                ty,
                data: &w,
                n_rows,
                n_cols,
            };
            for n_tok in 1..=17 {
                let x = activations(&mut rng, n_tok * n_cols);
                let mut qa = QActs::new();
                qa.quantize(Some(&pool), isa, vec_dot_type(ty), &x, n_cols)
                    .unwrap();
                let mut a = vec![0f32; n_tok * n_rows];
                let mut b = vec![0f32; n_tok * n_rows];
                matmul_q(&pool, isa, MatmulPath::Gemv, &m, &qa, &mut a);
                matmul_q(&pool, isa, MatmulPath::Gemm, &m, &qa, &mut b);
                assert_eq!(a, b, "{ty} {isa:?} {n_tok} tokens");
                // and each row alone equals its row in the batch
                for t in [0, n_tok - 1] {
                    let mut qa1 = QActs::new();
                    qa1.quantize(
                        None,
                        isa,
                        vec_dot_type(ty),
                        &x[t * n_cols..(t + 1) * n_cols],
                        n_cols,
                    )
                    .unwrap();
                    let mut c = vec![0f32; n_rows];
                    matmul_q(&pool, isa, MatmulPath::Auto, &m, &qa1, &mut c);
                    assert_eq!(
                        &c[..],
                        &b[t * n_rows..(t + 1) * n_rows],
                        "{ty} {isa:?} token {t} of {n_tok}"
                    );
                }
            }
        }
    }
}

#[test]
fn float_dots_match_reference() {
    let mut rng = Rng(5);
    for isa in Isa::available() {
        for ty in [GgmlType::F32, GgmlType::F16] {
            for n in [1usize, 7, 16, 33, 100, 1000] {
                let w = weights(&mut rng, ty, 1, n);
                let a = weights(&mut rng, ty, 1, n);
                let want = vec_dot(ty, n, &w, &a);
                let got = dot_float(isa, ty, n, &w, &a);
                assert!(
                    (got - want).abs() <= 1e-5 * (1.0 + want.abs()) * (n as f32).sqrt(),
                    "{ty} {isa:?} n={n}: {got} vs {want}"
                );
            }
        }
    }
}

#[test]
fn vector_exp_and_swiglu_are_bit_exact() {
    use rustorch_core::kernels::vexp::{exp_slice, swiglu, vexp_enabled};
    let mut rng = Rng(77);
    let mut xs: Vec<f32> = (0..200_000).map(|_| -120.0 + 220.0 * rng.unit()).collect();
    xs.extend((0..50_000).map(|_| f32::from_bits(rng.next() as u32)));
    xs.extend([
        0.0,
        -0.0,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        88.72283,
        -103.97208,
        89.0,
        -104.0,
    ]);
    for isa in Isa::available() {
        eprintln!("{isa:?}: vector exp enabled = {}", vexp_enabled(isa));
        let mut got = xs.clone();
        exp_slice(isa, &mut got);
        for (x, g) in xs.iter().zip(&got) {
            let w = x.exp();
            assert!(
                g.to_bits() == w.to_bits() || (g.is_nan() && w.is_nan()),
                "{isa:?} exp({x}) = {g}, want {w}"
            );
        }
        let up: Vec<f32> = (0..xs.len()).map(|_| rng.normal()).collect();
        let gate: Vec<f32> = xs.iter().map(|x| x * 0.1).collect();
        let mut a = gate.clone();
        let mut b = gate.clone();
        rustorch_core::kernels::ops::swiglu(&mut a, &up);
        swiglu(isa, &mut b, &up);
        for (i, (x, y)) in a.iter().zip(&b).enumerate() {
            assert!(
                x.to_bits() == y.to_bits() || (x.is_nan() && y.is_nan()),
                "{isa:?} swiglu[{i}]: {y} vs {x}"
            );
        }
    }
}

/// Every f32 input (about a minute): `cargo test --release --test kernels_simd -- --ignored`.
#[test]
#[ignore]
fn vector_exp_exhaustive() {
    use rustorch_core::kernels::vexp::exp_slice;
    let isa = *Isa::available().last().unwrap();
    let mut buf = vec![0f32; 1 << 20];
    let mut bad = 0u64;
    for chunk in 0..(1u64 << 12) {
        let base = (chunk << 20) as u32;
        for (i, v) in buf.iter_mut().enumerate() {
            *v = f32::from_bits(base + i as u32);
        }
        let mut got = buf.clone();
        exp_slice(isa, &mut got);
        for (x, g) in buf.iter().zip(&got) {
            let w = x.exp();
            if !(g.to_bits() == w.to_bits() || (g.is_nan() && w.is_nan())) {
                bad += 1;
            }
        }
    }
    assert_eq!(bad, 0);
}

/// The fused entry points (Q/K/V in one job, gate/up/SwiGLU in one job) equal separate calls.
#[test]
fn fused_matmuls_equal_separate_calls() {
    use rustorch_core::kernels::{gexp, isa, matmul, matmul_many, matmul_swiglu};
    let mut rng = Rng(123);
    for threads in [1, 2, 3] {
        let pool = ThreadPool::new(threads);
        for (tq, tv, n_cols) in [
            (GgmlType::Q4_1, GgmlType::Q4_1, 576),
            (GgmlType::Q5_0, GgmlType::Q8_0, 896),
            (GgmlType::Q4_K, GgmlType::Q6_K, 512),
            (GgmlType::F16, GgmlType::Q8_0, 64),
        ] {
            let wq = weights(&mut rng, tq, 72, n_cols);
            let wv = weights(&mut rng, tv, 24, n_cols);
            let wu = weights(&mut rng, tq, 72, n_cols);
            let mq = QMatrix {
                ty: tq,
                data: &wq,
                n_rows: 72,
                n_cols,
            };
            let mv = QMatrix {
                ty: tv,
                data: &wv,
                n_rows: 24,
                n_cols,
            };
            let mu = QMatrix {
                ty: tq,
                data: &wu,
                n_rows: 72,
                n_cols,
            };
            for n_tok in [1, 2, 9] {
                let x = activations(&mut rng, n_tok * n_cols);
                let mut qa = QActs::new();
                let (mut a, mut b) = (vec![0f32; n_tok * 72], vec![0f32; n_tok * 24]);
                matmul(&pool, &mq, &x, &mut a, &mut qa).unwrap();
                matmul(&pool, &mv, &x, &mut b, &mut qa).unwrap();
                let (mut a2, mut b2) = (vec![0f32; n_tok * 72], vec![0f32; n_tok * 24]);
                let mut qas = Vec::new();
                matmul_many(
                    &pool,
                    &[mq, mv],
                    &x,
                    &mut [&mut a2[..], &mut b2[..]],
                    &mut qas,
                )
                .unwrap();
                assert_eq!(a, a2, "{tq} {n_tok}");
                assert_eq!(b, b2, "{tv} {n_tok}");
                let mut u = vec![0f32; n_tok * 72];
                matmul(&pool, &mu, &x, &mut u, &mut qa).unwrap();
                gexp::swiglu(isa(), &mut a, &u, 72);
                let (mut g3, mut u3) = (vec![0f32; n_tok * 72], vec![0f32; n_tok * 72]);
                matmul_swiglu(&pool, &mq, &mu, &x, &mut g3, &mut u3, &mut qas).unwrap();
                assert_eq!(u, u3, "{tq} up {n_tok}");
                for (i, (p, r)) in a.iter().zip(&g3).enumerate() {
                    assert!(
                        p.to_bits() == r.to_bits(),
                        "{tq} swiglu {n_tok} [{i}] {p} {r}"
                    );
                }
            }
        }
    }
}
