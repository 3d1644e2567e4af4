//! The sampler: each stage against hand-computed distributions, the whole chain
//! against llama.cpp's own sampler (token-for-token with the same seed), a chi-square
//! test that it really samples, seed determinism, greedy = argmax, and penalties.

use std::collections::HashMap;

use rustorch_llm::sampler::{
    apply_logit_bias, apply_penalties, argmax, dist, logprobs, min_p, softmax, temperature, top_k,
    top_p, typical, Candidates, Mt19937, Sampler, SamplerError, SamplerParams,
};

/// Logits whose softmax is exactly `probs` (up to rounding).
fn logits_of(probs: &[f64]) -> Vec<f32> {
    probs.iter().map(|p| p.ln() as f32).collect()
}

/// The five-token distribution most stage tests use.
const P5: [f64; 5] = [0.4, 0.3, 0.15, 0.1, 0.05];

fn close(a: f32, b: f64, tol: f64) -> bool {
    ((a as f64) - b).abs() <= tol
}

// ---------------------------------------------------------------------------
// Stages
// ---------------------------------------------------------------------------

#[test]
fn softmax_of_log_probs_gives_the_probs() {
    let mut c = Candidates::from_logits(&logits_of(&[0.1, 0.2, 0.3, 0.4]));
    softmax(&mut c, false);
    for (t, want) in c.data.iter().zip([0.1, 0.2, 0.3, 0.4]) {
        assert!(close(t.p, want, 1e-6), "{t:?} vs {want}");
    }
    assert!(!c.sorted);
    softmax(&mut c, true);
    assert!(c.sorted);
    assert_eq!(c.ids(), [3, 2, 1, 0]);
}

#[test]
fn top_k_keeps_the_k_largest_sorted() {
    let logits = [1.0, 5.0, 3.0, 4.0, 2.0];
    let mut c = Candidates::from_logits(&logits);
    top_k(&mut c, 3);
    assert_eq!(c.ids(), [1, 3, 2]);
    assert!(c.sorted);

    let mut c = Candidates::from_logits(&logits);
    top_k(&mut c, 0); // disabled
    assert_eq!(c.ids(), [0, 1, 2, 3, 4]);
    assert!(!c.sorted);

    let mut c = Candidates::from_logits(&logits);
    top_k(&mut c, 99); // more than there are: all, sorted
    assert_eq!(c.ids(), [1, 3, 2, 4, 0]);

    // Ties go to the smaller id.
    let mut c = Candidates::from_logits(&[1.0, 2.0, 2.0, 0.0]);
    top_k(&mut c, 2);
    assert_eq!(c.ids(), [1, 2]);
}

#[test]
fn top_p_on_five_tokens() {
    // Probabilities 0.4, 0.3, 0.15, 0.1, 0.05; cumulative 0.4, 0.7, 0.85, 0.95, 1.0.
    // The smallest prefix whose sum reaches p is kept.
    for (p, min_keep, want) in [
        (0.3f32, 0usize, vec![0u32]),   // 0.4 >= 0.3
        (0.5, 0, vec![0, 1]),           // 0.7 >= 0.5
        (0.75, 0, vec![0, 1, 2]),       // 0.85 >= 0.75
        (0.9, 0, vec![0, 1, 2, 3]),     // 0.95 >= 0.9
        (0.99, 0, vec![0, 1, 2, 3, 4]), // only the full sum reaches 0.99
        (0.5, 4, vec![0, 1, 2, 3]),     // min_keep wins
        (1.0, 0, vec![0, 1, 2, 3, 4]),  // disabled (and left unsorted)
    ] {
        // Shuffle the ids so that sorting matters.
        let order = [3usize, 0, 4, 2, 1];
        let logits = logits_of(&P5);
        let shuffled: Vec<f32> = order.iter().map(|&i| logits[i]).collect();
        let mut c = Candidates::from_logits(&shuffled);
        top_p(&mut c, p, min_keep);
        let got: Vec<u32> = c
            .ids()
            .iter()
            .map(|&id| order[id as usize] as u32)
            .collect();
        if p >= 1.0 {
            assert_eq!(c.len(), 5);
            continue;
        }
        assert_eq!(got, want, "top_p {p} min_keep {min_keep}");
        assert!(c.sorted);
        // top_p leaves the softmax of its input in p.
        for (t, &i) in c.data.iter().zip(&got) {
            assert!(close(t.p, P5[i as usize], 1e-6));
        }
    }
}

#[test]
fn top_p_on_a_large_unsorted_vocabulary() {
    // 3000 tokens (more than llama.cpp's 1024 threshold for its partial-sort path):
    // token i has logit -i/100, so the kept set is a prefix of ids.
    let logits: Vec<f32> = (0..3000).rev().map(|i| -(i as f32) / 100.0).collect();
    // logits[j] = -(2999 - j)/100: the largest is the last id.
    let mut c = Candidates::from_logits(&logits);
    top_p(&mut c, 0.9, 0);
    // Geometric probabilities with ratio r = e^-0.01: the smallest n with
    // 1 - r^n >= 0.9 (the tail past 3000 is negligible) is ceil(ln 0.1 / -0.01) = 231.
    assert_eq!(c.len(), 231);
    assert_eq!(c.data[0].id, 2999);
    assert!(c.data.windows(2).all(|w| w[0].logit >= w[1].logit));
    // Needs more than the first 256 sorted: still right.
    let mut c = Candidates::from_logits(&logits);
    top_p(&mut c, 0.95, 0);
    assert_eq!(c.len(), 300); // ceil(ln 0.05 / -0.01) = ceil(299.57)
}

#[test]
fn min_p_keeps_tokens_above_a_fraction_of_the_max() {
    // p = 0.3: threshold 0.3 * 0.4 = 0.12, so 0.4, 0.3, 0.15 stay; 0.1 and 0.05 go.
    let logits = logits_of(&P5);
    let mut c = Candidates::from_logits(&logits);
    min_p(&mut c, 0.3, 0);
    assert_eq!(c.ids(), [0, 1, 2]);
    assert!(!c.sorted, "the unsorted path keeps vocabulary order");

    // Same on a sorted list.
    let mut c = Candidates::from_logits(&logits);
    top_k(&mut c, 5);
    min_p(&mut c, 0.3, 0);
    assert_eq!(c.ids(), [0, 1, 2]);

    // p = 0.05: threshold 0.02, everything stays; p = 0 disables.
    let mut c = Candidates::from_logits(&logits);
    min_p(&mut c, 0.05, 0);
    assert_eq!(c.len(), 5);
    let mut c = Candidates::from_logits(&logits);
    min_p(&mut c, 0.0, 0);
    assert_eq!(c.len(), 5);

    // p = 0.9 keeps only the max, unless min_keep asks for more.
    let mut c = Candidates::from_logits(&logits);
    min_p(&mut c, 0.9, 0);
    assert_eq!(c.ids(), [0]);
    let mut c = Candidates::from_logits(&logits);
    min_p(&mut c, 0.9, 2);
    assert_eq!(c.ids(), [0, 1]);
}

#[test]
fn typical_p_on_five_tokens() {
    // Entropy H = -sum p ln p = 1.39232. |-ln p - H| per token:
    //   0.4: 0.47603, 0.3: 0.18835, 0.15: 0.50480, 0.1: 0.91026, 0.05: 1.60341
    // so the typical order is ids 1, 0, 2, 3, 4 with cumulative 0.3, 0.7, 0.85, 0.95, 1.
    // A prefix is kept until the sum exceeds p.
    for (p, want) in [
        (0.2f32, vec![1u32]),
        (0.5, vec![1, 0]),
        (0.8, vec![1, 0, 2]),
        (0.9, vec![1, 0, 2, 3]),
    ] {
        let mut c = Candidates::from_logits(&logits_of(&P5));
        typical(&mut c, p, 0);
        assert_eq!(c.ids(), want, "typical {p}");
        assert!(!c.sorted);
    }
    let mut c = Candidates::from_logits(&logits_of(&P5));
    typical(&mut c, 0.2, 3);
    assert_eq!(c.ids(), [1, 0, 2]);
    let mut c = Candidates::from_logits(&logits_of(&P5));
    typical(&mut c, 1.0, 0);
    assert_eq!(c.ids(), [0, 1, 2, 3, 4]);
}

#[test]
fn temperature_scales_logits_and_zero_is_greedy() {
    let mut c = Candidates::from_logits(&[1.0, -2.0, 3.0]);
    temperature(&mut c, 0.5);
    let l: Vec<f32> = c.data.iter().map(|t| t.logit).collect();
    assert_eq!(l, [2.0, -4.0, 6.0]);

    let mut c = Candidates::from_logits(&[1.0, 3.0, -2.0, 3.0]);
    temperature(&mut c, 0.0);
    let l: Vec<f32> = c.data.iter().map(|t| t.logit).collect();
    assert_eq!(
        l,
        [f32::NEG_INFINITY, 3.0, f32::NEG_INFINITY, f32::NEG_INFINITY]
    );
    // softmax after temperature T is p^(1/T) renormalized: for 0.5/0.5-split it stays.
    let mut c = Candidates::from_logits(&logits_of(&[0.8, 0.2]));
    temperature(&mut c, 0.5);
    softmax(&mut c, false);
    // 0.8^2 / (0.8^2 + 0.2^2) = 0.64 / 0.68 = 0.941176
    assert!(close(c.data[0].p, 0.64 / 0.68, 1e-6));
}

#[test]
fn penalties_follow_llama_cpp() {
    // repeat 2, frequency 0.1, presence 0.5:
    //   token 0 (logit 2, seen twice):  2 / 2 - (2 * 0.1 + 0.5) = 0.3
    //   token 1 (logit -1, seen once): -1 * 2 - (0.1 + 0.5)     = -2.6
    //   token 2 (not seen) and token 3 (not seen) unchanged
    let mut c = Candidates::from_logits(&[2.0, -1.0, 0.5, 3.0]);
    let counts = HashMap::from([(0u32, 2u32), (1, 1)]);
    apply_penalties(&mut c, &counts, 2.0, 0.1, 0.5);
    let l: Vec<f32> = c.data.iter().map(|t| t.logit).collect();
    assert!(close(l[0], 0.3, 1e-6) && close(l[1], -2.6, 1e-6), "{l:?}");
    assert_eq!(&l[2..], [0.5, 3.0]);
    // A logit of exactly 0 is multiplied (stays 0).
    let mut c = Candidates::from_logits(&[0.0]);
    apply_penalties(&mut c, &HashMap::from([(0u32, 1u32)]), 1.5, 0.0, 0.0);
    assert_eq!(c.data[0].logit, 0.0);
}

#[test]
fn logit_bias_adds_and_bans() {
    let mut c = Candidates::from_logits(&[0.0, 0.0, 0.0]);
    apply_logit_bias(
        &mut c,
        &[(1, 2.0), (2, f32::NEG_INFINITY), (1, 0.5), (99, 1.0)],
    );
    let l: Vec<f32> = c.data.iter().map(|t| t.logit).collect();
    assert_eq!(l, [0.0, 2.5, f32::NEG_INFINITY]);
    // Also on a reordered list.
    let mut c = Candidates::from_logits(&[0.0, 1.0, 2.0]);
    top_k(&mut c, 3);
    apply_logit_bias(&mut c, &[(0, 5.0)]);
    assert_eq!(
        c.data.iter().find(|t| t.id == 0).map(|t| t.logit),
        Some(5.0)
    );
}

#[test]
fn dist_draws_by_cumulative_probability() {
    // With probabilities 0.4/0.3/0.15/0.1/0.05 a draw u picks the first index whose
    // cumulative sum reaches u. Check against the generator's own numbers.
    let logits = logits_of(&P5);
    let mut rng = Mt19937::new(5);
    let mut check = Mt19937::new(5);
    for _ in 0..1000 {
        let mut c = Candidates::from_logits(&logits);
        let i = dist(&mut c, &mut rng).unwrap();
        let u = check.next_f64();
        let cum = [0.4, 0.7, 0.85, 0.95, 1.0];
        let want = cum.iter().position(|&x| x >= u).unwrap();
        // Only a u within rounding of a boundary could disagree.
        if cum.iter().all(|&x| (x - u).abs() > 1e-6) {
            assert_eq!(i, want, "u = {u}");
        }
        let sum: f32 = c.data.iter().map(|t| t.p).sum();
        assert!(close(sum, 1.0, 1e-6));
    }
    let mut empty = Candidates::default();
    assert_eq!(dist(&mut empty, &mut rng), None);
}

// ---------------------------------------------------------------------------
// The chain
// ---------------------------------------------------------------------------

/// The example the chain tests share: probabilities 0.7, 0.2, 0.03, 0.03, 0.02, 0.02.
/// With llama.cpp's defaults:
///   top-k 40: all six stay (sorted);
///   top-p 0.95: cumulative 0.7, 0.9, 0.93, 0.96 -> four stay;
///   min-p 0.05: threshold 0.05 * 0.7 = 0.035 -> 0.03 goes, 0.7 and 0.2 stay;
///   temperature 0.8: p^(1/0.8) renormalized:
///     0.7^1.25 = 0.640310, 0.2^1.25 = 0.133748 -> 0.827206, 0.172794.
const CHAIN_EXAMPLE: [f64; 6] = [0.7, 0.2, 0.03, 0.03, 0.02, 0.02];
const CHAIN_EXPECTED: [(u32, f64); 2] = [(0, 0.827206), (1, 0.172794)];

#[test]
fn probs_after_chain_with_defaults() {
    let s = Sampler::new(SamplerParams::default(), 6);
    let probs = s.probs_after_chain(&logits_of(&CHAIN_EXAMPLE));
    assert_eq!(probs.len(), 2, "{probs:?}");
    for ((id, p), (want_id, want_p)) in probs.iter().zip(CHAIN_EXPECTED) {
        assert_eq!(*id, want_id);
        assert!(close(*p, want_p, 1e-5), "{probs:?}");
    }
    // Greedy: one token with probability 1.
    let g = Sampler::new(SamplerParams::greedy(), 6);
    assert_eq!(g.probs_after_chain(&logits_of(&CHAIN_EXAMPLE)), [(0, 1.0)]);
}

/// Upper regularized incomplete gamma Q(a, x) (Numerical Recipes' gammq).
fn gamma_q(a: f64, x: f64) -> f64 {
    fn ln_gamma(x: f64) -> f64 {
        // Lanczos approximation (g = 7, n = 9).
        const C: [f64; 9] = [
            0.999_999_999_999_809_9,
            676.520_368_121_885_1,
            -1_259.139_216_722_402_8,
            771.323_428_777_653_1,
            -176.615_029_162_140_6,
            12.507_343_278_686_905,
            -0.138_571_095_265_720_12,
            9.984_369_578_019_572e-6,
            1.505_632_735_149_311_6e-7,
        ];
        let x = x - 1.0;
        let mut a = C[0];
        let t = x + 7.5;
        for (i, c) in C.iter().enumerate().skip(1) {
            a += c / (x + i as f64);
        }
        0.5 * (2.0 * std::f64::consts::PI).ln() + (x + 0.5) * t.ln() - t + a.ln()
    }
    let gln = ln_gamma(a);
    if x < a + 1.0 {
        // Series for P, Q = 1 - P.
        let (mut ap, mut sum) = (a, 1.0 / a);
        let mut del = sum;
        for _ in 0..1000 {
            ap += 1.0;
            del *= x / ap;
            sum += del;
            if del.abs() < sum.abs() * 1e-15 {
                break;
            }
        }
        1.0 - sum * (-x + a * x.ln() - gln).exp()
    } else {
        // Continued fraction (Lentz).
        let tiny = 1e-300;
        let mut b = x + 1.0 - a;
        let mut c = 1.0 / tiny;
        let mut d = 1.0 / b;
        let mut h = d;
        for i in 1..1000 {
            let an = -(i as f64) * (i as f64 - a);
            b += 2.0;
            d = an * d + b;
            if d.abs() < tiny {
                d = tiny;
            }
            c = b + an / c;
            if c.abs() < tiny {
                c = tiny;
            }
            d = 1.0 / d;
            let del = d * c;
            h *= del;
            if (del - 1.0).abs() < 1e-15 {
                break;
            }
        }
        (-x + a * x.ln() - gln).exp() * h
    }
}

/// Draws `n` tokens and returns Pearson's chi-square statistic against `expected`
/// (token -> probability), its p-value, and the counts.
fn chi_square(
    sampler: &mut Sampler,
    logits: &[f32],
    expected: &[(u32, f64)],
    n: usize,
) -> (f64, f64, HashMap<u32, usize>) {
    let mut counts: HashMap<u32, usize> = HashMap::new();
    for _ in 0..n {
        *counts.entry(sampler.sample(logits)).or_insert(0) += 1;
    }
    for t in counts.keys() {
        assert!(
            expected.iter().any(|(id, _)| id == t),
            "drew token {t} outside the support"
        );
    }
    let stat: f64 = expected
        .iter()
        .map(|&(id, p)| {
            let e = p * n as f64;
            let o = *counts.get(&id).unwrap_or(&0) as f64;
            (o - e) * (o - e) / e
        })
        .sum();
    let df = (expected.len() - 1) as f64;
    (stat, gamma_q(df / 2.0, stat / 2.0), counts)
}

#[test]
fn chi_square_helper_is_right() {
    // Known values: chi2 = 3.841 with 1 dof has p = 0.05; 9.488 with 4 dof, p = 0.05.
    assert!((gamma_q(0.5, 3.841 / 2.0) - 0.05).abs() < 1e-3);
    assert!((gamma_q(2.0, 9.488 / 2.0) - 0.05).abs() < 1e-3);
    // For integer a, Q(a, x) = P(Poisson(x) <= a - 1):
    //   Q(20, 10) = sum_{k<20} e^-10 10^k / k! = 0.9965457, Q(5, 2) = 0.9473470.
    assert!((gamma_q(20.0, 10.0) - 0.996_545_7).abs() < 1e-6);
    assert!((gamma_q(5.0, 2.0) - 0.947_347_0).abs() < 1e-6);
}

#[test]
fn chain_samples_the_distribution_chi_square() {
    const N: usize = 20_000;
    const ALPHA: f64 = 0.001;

    // 1. No truncation, temperature 1: the draws follow 0.4/0.3/0.15/0.1/0.05.
    let params = SamplerParams {
        seed: Some(20_240_601),
        top_k: 0,
        top_p: 1.0,
        min_p: 0.0,
        temperature: 1.0,
        ..SamplerParams::default()
    };
    let mut s = Sampler::new(params, 5);
    let expected: Vec<(u32, f64)> = P5.iter().enumerate().map(|(i, &p)| (i as u32, p)).collect();
    let (stat, p, counts) = chi_square(&mut s, &logits_of(&P5), &expected, N);
    eprintln!("chi-square: statistic {stat:.2}, p-value {p:.3}");
    assert!(
        p > ALPHA,
        "chi2 = {stat:.2}, p = {p:.2e}, counts {counts:?}"
    );
    // It samples rather than taking the argmax: every token shows up, the top one
    // about 40% of the time.
    assert_eq!(counts.len(), 5, "{counts:?}");
    assert!(counts[&0] < N / 2, "{counts:?}");

    // 2. The full default chain on the worked example: 0.827206 / 0.172794.
    let mut s = Sampler::new(
        SamplerParams {
            seed: Some(7),
            ..SamplerParams::default()
        },
        6,
    );
    let (stat, p, counts) = chi_square(&mut s, &logits_of(&CHAIN_EXAMPLE), &CHAIN_EXPECTED, N);
    eprintln!("chi-square: statistic {stat:.2}, p-value {p:.3}");
    assert!(
        p > ALPHA,
        "chi2 = {stat:.2}, p = {p:.2e}, counts {counts:?}"
    );

    // 3. A wider support (top-k 40 of 1000 tokens, temperature 0.8): the draws follow
    //    probs_after_chain.
    let logits: Vec<f32> = (0..1000u32)
        .map(|i| ((i * 7919) % 1000) as f32 / 400.0)
        .collect();
    let mut s = Sampler::new(
        SamplerParams {
            seed: Some(99),
            ..SamplerParams::default()
        },
        1000,
    );
    let expected: Vec<(u32, f64)> = s
        .probs_after_chain(&logits)
        .into_iter()
        .map(|(id, p)| (id, p as f64))
        .collect();
    assert!(expected.len() > 20, "{}", expected.len());
    assert!(expected.iter().all(|(_, p)| p * N as f64 >= 5.0));
    let (stat, p, _) = chi_square(&mut s, &logits, &expected, N);
    eprintln!("chi-square: statistic {stat:.2}, p-value {p:.3}");
    assert!(
        p > ALPHA,
        "chi2 = {stat:.2} over {} bins, p = {p:.2e}",
        expected.len()
    );
}

#[test]
fn same_seed_same_tokens_on_any_thread() {
    let logits: Vec<f32> = (0..500u32)
        .map(|i| ((i * 37) % 500) as f32 / 100.0)
        .collect();
    let run = |seed: u64| {
        let mut s = Sampler::new(
            SamplerParams {
                seed: Some(seed),
                temperature: 1.5,
                top_k: 0,
                ..SamplerParams::default()
            },
            500,
        );
        (0..300)
            .map(|_| {
                let t = s.sample(&logits);
                s.accept(t);
                t
            })
            .collect::<Vec<u32>>()
    };
    let base = run(1234);
    assert_eq!(run(1234), base);
    assert_ne!(run(1235), base);
    // Several threads at once: the same sequence on each.
    std::thread::scope(|scope| {
        let handles: Vec<_> = (0..4).map(|_| scope.spawn(|| run(1234))).collect();
        for h in handles {
            assert_eq!(h.join().unwrap(), base);
        }
    });
    // Seeds above u32::MAX work and are reported as given.
    let s = Sampler::new(
        SamplerParams {
            seed: Some(u64::MAX),
            ..SamplerParams::default()
        },
        10,
    );
    assert_eq!(s.seed(), u64::MAX);
}

#[test]
fn random_seed_is_reported_and_reproducible() {
    let logits: Vec<f32> = (0..100u32).map(|i| (i % 13) as f32 / 3.0).collect();
    let params = SamplerParams {
        top_k: 0,
        temperature: 2.0,
        ..SamplerParams::default()
    };
    let mut a = Sampler::new(params.clone(), 100);
    let seed = a.seed();
    let mut b = Sampler::new(
        SamplerParams {
            seed: Some(seed),
            ..params.clone()
        },
        100,
    );
    let da: Vec<u32> = (0..100).map(|_| a.sample(&logits)).collect();
    let db: Vec<u32> = (0..100).map(|_| b.sample(&logits)).collect();
    assert_eq!(da, db);
    // reset() with a given seed restarts the same stream.
    b.reset();
    assert_eq!(b.seed(), seed);
    let again: Vec<u32> = (0..100).map(|_| b.sample(&logits)).collect();
    assert_eq!(again, db);
}

#[test]
fn greedy_is_argmax() {
    let mut state = 12345u32;
    let mut next = || {
        state = state.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
        (state >> 8) as f32 / (1u32 << 24) as f32 * 20.0 - 10.0
    };
    for temp in [0.0f32, -1.0] {
        let mut s = Sampler::new(
            SamplerParams {
                temperature: temp,
                seed: Some(1),
                ..SamplerParams::default()
            },
            2000,
        );
        assert!(s.is_greedy());
        for _ in 0..50 {
            let logits: Vec<f32> = (0..2000).map(|_| next()).collect();
            assert_eq!(s.sample(&logits), argmax(&logits));
        }
    }
    // Greedy after bias: the bias moves the argmax.
    let mut s = Sampler::new(
        SamplerParams {
            logit_bias: HashMap::from([(2u32, 5.0f32)]),
            ..SamplerParams::greedy()
        },
        4,
    );
    assert_eq!(s.sample(&[1.0, 3.0, 0.0, 2.0]), 2);
    // Ties: the smallest id, like argmax.
    let mut s = Sampler::new(SamplerParams::greedy(), 4);
    assert_eq!(s.sample(&[1.0, 3.0, 3.0, 2.0]), 1);
    assert_eq!(argmax(&[1.0, 3.0, 3.0, 2.0]), 1);
}

#[test]
fn penalties_change_what_greedy_picks() {
    // Token 1 leads (3.0 vs 2.0); after it is accepted twice with repeat 1.6 it drops
    // to 3.0 / 1.6 = 1.875 < 2.0 and token 0 wins. Frequency/presence penalties act the
    // same way by subtraction.
    let logits = [2.0, 3.0, -1.0];
    let mut s = Sampler::new(
        SamplerParams {
            repeat_penalty: 1.6,
            ..SamplerParams::greedy()
        },
        3,
    );
    assert_eq!(s.sample(&logits), 1);
    s.accept(1);
    assert_eq!(s.sample(&logits), 0);
    assert_eq!(s.penalty_counts().get(&1), Some(&1));

    let mut s = Sampler::new(
        SamplerParams {
            frequency_penalty: 0.4,
            presence_penalty: 0.3,
            ..SamplerParams::greedy()
        },
        3,
    );
    s.accept(1); // 3.0 - (0.4 + 0.3) = 2.3 > 2.0
    assert_eq!(s.sample(&logits), 1);
    s.accept(1); // 3.0 - (0.8 + 0.3) = 1.9 < 2.0
    assert_eq!(s.sample(&logits), 0);

    // The window forgets: with penalty_last_n = 2, token 1 falls out after two others.
    let mut s = Sampler::new(
        SamplerParams {
            repeat_penalty: 2.0,
            penalty_last_n: 2,
            ..SamplerParams::greedy()
        },
        3,
    );
    s.accept(1);
    assert_eq!(s.sample(&logits), 0);
    s.accept(2);
    s.accept(2);
    assert_eq!(s.penalty_counts().get(&1), None);
    assert_eq!(s.penalty_counts().get(&2), Some(&2));
    assert_eq!(s.sample(&logits), 1);
    s.reset();
    assert!(s.penalty_counts().is_empty());

    // penalty_last_n = 0 disables them.
    let mut s = Sampler::new(
        SamplerParams {
            repeat_penalty: 100.0,
            penalty_last_n: 0,
            ..SamplerParams::greedy()
        },
        3,
    );
    s.accept(1);
    assert_eq!(s.sample(&logits), 1);
}

#[test]
fn logit_bias_comes_before_penalties() {
    // llama.cpp applies the bias, then the penalties: (1 + 3) / 2 = 2.0 for token 0
    // (the other order would give 1 / 2 + 3 = 3.5). With temperature 1 and nothing
    // truncated, p0 = e^2 / (e^2 + e^0) = 0.880797.
    let mut s = Sampler::new(
        SamplerParams {
            logit_bias: HashMap::from([(0u32, 3.0f32)]),
            repeat_penalty: 2.0,
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            ..SamplerParams::default()
        },
        2,
    );
    s.accept(0);
    let probs = s.probs_after_chain(&[1.0, 0.0]);
    assert_eq!(probs[0].0, 0);
    assert!(close(probs[0].1, 0.880797, 1e-5), "{probs:?}");
}

#[test]
fn ignore_eos_bans_end_of_generation_tokens() {
    let logits = [0.0, 5.0, 1.0, 4.0];
    let params = SamplerParams {
        eog_tokens: vec![1, 3],
        ..SamplerParams::greedy()
    };
    let mut s = Sampler::new(params.clone(), 4);
    assert_eq!(s.sample(&logits), 1);
    let mut s = Sampler::new(
        SamplerParams {
            ignore_eos: true,
            ..params.clone()
        },
        4,
    );
    assert_eq!(s.sample(&logits), 2);
    // Sampling too never yields them.
    let mut s = Sampler::new(
        SamplerParams {
            ignore_eos: true,
            temperature: 5.0,
            seed: Some(3),
            ..params
        },
        4,
    );
    for _ in 0..500 {
        let t = s.sample(&logits);
        assert!(t == 0 || t == 2, "{t}");
    }
    let probs = s.probs_after_chain(&logits);
    assert!(
        probs.iter().all(|(id, _)| *id != 1 && *id != 3),
        "{probs:?}"
    );
}

#[test]
fn logprobs_come_from_the_raw_logits() {
    // log-softmax of ln(0.4), ln(0.3), ... is ln p itself.
    let logits = logits_of(&P5);
    let lp = logprobs(&logits, 2, 3);
    assert_eq!(lp.chosen.token, 2);
    assert!(close(lp.chosen.logprob, 0.15f64.ln(), 1e-6));
    let ids: Vec<u32> = lp.top.iter().map(|t| t.token).collect();
    assert_eq!(ids, [0, 1, 2]);
    for t in &lp.top {
        assert!(close(t.logprob, P5[t.token as usize].ln(), 1e-6));
    }
    // Unaffected by the sampler's temperature or truncation.
    let mut s = Sampler::new(
        SamplerParams {
            seed: Some(1),
            temperature: 0.1,
            top_k: 1,
            ..SamplerParams::default()
        },
        5,
    );
    let (tok, lp) = s.sample_with_logprobs(&logits, 2);
    assert_eq!(tok, 0);
    assert!(close(lp.chosen.logprob, 0.4f64.ln(), 1e-6));
    assert_eq!(lp.top.len(), 2);
    // Out-of-vocabulary chosen id: -inf, no panic; n larger than the vocabulary: all.
    let lp = logprobs(&logits, 99, 10);
    assert_eq!(lp.chosen.logprob, f32::NEG_INFINITY);
    assert_eq!(lp.top.len(), 5);
}

#[test]
fn validation_and_sanitizing() {
    assert_eq!(SamplerParams::default().validate(), Ok(()));
    let bad = SamplerParams {
        repeat_penalty: 0.0,
        ..SamplerParams::default()
    };
    assert_eq!(bad.validate(), Err(SamplerError::BadRepeatPenalty(0.0)));
    let bad_freq = SamplerParams {
        frequency_penalty: f32::INFINITY,
        ..SamplerParams::default()
    };
    assert!(matches!(
        bad_freq.validate(),
        Err(SamplerError::NotFinite { .. })
    ));
    let nan_bias = SamplerParams {
        logit_bias: HashMap::from([(3u32, f32::NAN)]),
        ..SamplerParams::default()
    };
    assert_eq!(nan_bias.validate(), Err(SamplerError::NaNBias { token: 3 }));
    // Sampler::new treats them as off and never panics.
    let mut s = Sampler::new(
        SamplerParams {
            temperature: f32::NAN,
            top_p: f32::NAN,
            seed: Some(1),
            ..bad
        },
        3,
    );
    s.accept(0);
    let t = s.sample(&[1.0, 2.0, 3.0]);
    assert!(t < 3);
    assert_eq!(s.sample(&[]), 0);
}

#[test]
fn default_params_are_llama_cpps() {
    let p = SamplerParams::default();
    assert_eq!(p.seed, None);
    assert_eq!(p.penalty_last_n, 64);
    assert_eq!(p.repeat_penalty, 1.0);
    assert_eq!(p.frequency_penalty, 0.0);
    assert_eq!(p.presence_penalty, 0.0);
    assert_eq!(p.top_k, 40);
    assert_eq!(p.typical_p, 1.0);
    assert_eq!(p.top_p, 0.95);
    assert_eq!(p.min_p, 0.05);
    assert_eq!(p.temperature, 0.8);
    assert_eq!(p.min_keep, 0);
    assert!(!p.ignore_eos);
    assert!(p.logit_bias.is_empty());
}

// ---------------------------------------------------------------------------
// Token-for-token against llama.cpp
// ---------------------------------------------------------------------------
//
// The sequences below were produced by llama.cpp's own sampler (libllama.so built by
// scripts/build-llama-cpp.sh, called through ctypes): a chain of
// logit_bias (when any) -> penalties -> top_k -> typical -> top_p -> min_p ->
// temp_ext(t, 0, 1) -> dist(seed), applied to `llama_token_data_array`s holding the
// logits below, each sampled token then passed to `llama_sampler_accept`.
// Logits of step s: logit[i] = ((i * 37 + s * 101) % n) / 64 - 8 (all distinct and
// exact in f32); "constant" runs use s = 0 at every step.

fn ref_logits(n: usize, s: usize) -> Vec<f32> {
    (0..n)
        .map(|i| ((i * 37 + s * 101) % n) as f32 / 64.0 - 8.0)
        .collect()
}

fn run_like_llama_cpp(params: SamplerParams, n: usize, steps: usize, vary: bool) -> Vec<u32> {
    let mut s = Sampler::new(params, n);
    (0..steps)
        .map(|step| {
            let logits = ref_logits(n, if vary { step } else { 0 });
            let t = s.sample(&logits);
            s.accept(t);
            t
        })
        .collect()
}

fn seeded(seed: u64) -> SamplerParams {
    SamplerParams {
        seed: Some(seed),
        ..SamplerParams::default()
    }
}

const A: &[u32] = &[
    681, 188, 921, 973, 725, 968, 365, 826, 578, 193, 109, 242, 239, 319, 288, 313, 583, 199, 169,
    384, 545, 788, 348, 237, 398, 13, 665, 907, 714, 929, 272, 924, 758, 618, 643, 395, 638, 826,
    796, 2, 872, 869, 267, 155, 916, 940, 774, 826, 932, 248, 599, 324, 894, 18, 970, 395, 692,
    253, 577, 329, 490, 842, 512, 127,
];
const B: &[u32] = &[
    927, 736, 408, 245, 27, 327, 109, 354, 709, 872, 708, 845, 954, 381, 681, 81, 736, 517, 627,
    490, 927, 1008, 518, 190, 217, 954, 545, 136, 627, 109, 763, 272, 926, 436, 27, 654, 217, 218,
    818, 109, 163, 845, 436, 817, 654, 354, 326, 899, 27, 327, 54, 572, 981, 927, 545, 381, 954,
    599, 681, 790, 654, 926, 518, 872,
];
const C: &[u32] = &[
    815, 869, 185, 755, 150, 886, 419, 962, 467, 791, 763, 487, 675, 864, 777, 613, 719, 388, 275,
    329, 626, 760, 485, 727, 41, 913, 881, 824, 356, 875, 733, 159, 593, 426, 451, 501, 365, 144,
    550, 629, 681, 922, 130, 125, 98, 721, 10, 224, 768, 984, 599, 815, 375, 889, 369, 476, 583,
    826, 904, 738, 844, 106, 784, 100,
];
const D: &[u32] = &[
    1547, 548, 2210, 1428, 321, 3863, 426, 3192, 972, 3518, 2077, 412, 3733, 2069, 2841, 3058,
    2725, 839, 2828, 1497, 1273, 162, 3928, 2041, 375, 1148, 2807, 3914, 1696, 30, 3905, 2351,
];
const E: &[u32] = &[
    409, 51, 758, 864, 725, 559, 229, 8, 5, 602, 218, 515, 567, 946, 834, 449, 501, 798, 169, 84,
    736, 733, 976, 455, 561, 640, 856, 689, 114, 848, 927, 106,
];
const F: &[u32] = &[
    709, 679, 649, 619, 589, 559, 529, 5, 5, 439, 409, 379, 349, 319, 289, 259,
];
const G: &[u32] = &[
    736, 841, 756, 700, 207, 994, 582, 499, 850, 383, 298, 650, 485, 345, 616, 367, 337, 608, 687,
    302, 408, 759, 729, 264, 943, 421, 583, 34, 631, 275, 107, 568, 103, 835, 343, 122, 64, 88,
    687, 383, 327, 214, 948, 400, 616, 340, 964, 962, 141, 793, 54, 624, 1003, 699, 888, 203, 256,
    389, 167, 493, 325, 297, 976, 181,
];
const H: &[u32] = &[
    326, 763, 109, 299, 927, 327, 708, 190, 818, 108, 381, 54, 599, 872, 490, 681, 544, 926, 354,
    326, 735, 436, 409, 518, 817, 709, 899, 245, 299, 927, 272, 54, 626, 818, 872, 763, 545, 326,
    354, 954, 409, 327, 572, 709, 109, 135, 190, 244,
];

#[test]
fn matches_llama_cpp_defaults() {
    assert_eq!(run_like_llama_cpp(seeded(42), 1009, 64, true), A);
}

#[test]
fn matches_llama_cpp_penalties() {
    let p = SamplerParams {
        repeat_penalty: 1.3,
        frequency_penalty: 0.2,
        presence_penalty: 0.5,
        penalty_last_n: 8,
        ..seeded(7)
    };
    assert_eq!(run_like_llama_cpp(p, 1009, 64, false), B);
}

#[test]
fn matches_llama_cpp_typical() {
    let p = SamplerParams {
        top_k: 0,
        typical_p: 0.9,
        top_p: 1.0,
        min_p: 0.0,
        temperature: 1.5,
        ..seeded(123)
    };
    assert_eq!(run_like_llama_cpp(p, 1009, 64, true), C);
}

#[test]
fn matches_llama_cpp_top_p_large_vocab() {
    let p = SamplerParams {
        top_k: 0,
        top_p: 0.9,
        min_p: 0.0,
        temperature: 1.0,
        ..seeded(1)
    };
    assert_eq!(run_like_llama_cpp(p, 4099, 32, true), D);
}

#[test]
fn matches_llama_cpp_logit_bias() {
    let p = SamplerParams {
        logit_bias: HashMap::from([
            (5u32, 2.5f32),
            (10, f32::NEG_INFINITY),
            (500, f32::NEG_INFINITY),
            (700, 1.0),
        ]),
        ..seeded(3)
    };
    assert_eq!(run_like_llama_cpp(p, 1009, 32, true), E);
}

#[test]
fn matches_llama_cpp_greedy() {
    let p = SamplerParams {
        temperature: 0.0,
        logit_bias: HashMap::from([(5u32, 3.0f32)]),
        ..seeded(3)
    };
    assert_eq!(run_like_llama_cpp(p, 1009, 16, true), F);
}

#[test]
fn matches_llama_cpp_min_p() {
    let p = SamplerParams {
        top_k: 0,
        top_p: 1.0,
        min_p: 0.3,
        temperature: 2.0,
        ..seeded(99)
    };
    assert_eq!(run_like_llama_cpp(p, 1009, 64, true), G);
}

#[test]
fn matches_llama_cpp_bias_then_penalties() {
    let p = SamplerParams {
        repeat_penalty: 1.5,
        penalty_last_n: 16,
        logit_bias: HashMap::from([(927u32, 1.0f32), (326, 3.0)]),
        ..seeded(11)
    };
    assert_eq!(run_like_llama_cpp(p, 1009, 48, false), H);
}
