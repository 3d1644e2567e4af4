//! `quant::quantize_rows` with an importance matrix against ggml itself.
//!
//! `tests/fixtures/quant/weighted.json` holds what libggml-base's
//! `ggml_quantize_chunk(type, src, dst, 0, nrows, n_per_row, imatrix)` wrote (recorded by
//! `scripts/record_weighted_quant_fixtures.py`) for every type with a weighted quantizer: each
//! named input case of `inputs.json` as one row with generated weights, and 128 rows of 2048
//! generated values with one weight per column (by SHA-256). We require the same bytes.
//!
//! Run: `cargo test -p rustorch-core --release --test quant_weighted`

use std::path::PathBuf;

use rustorch_core::quant;
use rustorch_core::GgmlType;
use serde_json::Value;
use sha2::{Digest, Sha256};

fn fixture(name: &str) -> Value {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/quant")
        .join(name);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).expect("fixture JSON")
}

fn b64(s: &Value) -> Vec<u8> {
    fn val(c: u8) -> u32 {
        match c {
            b'A'..=b'Z' => u32::from(c - b'A'),
            b'a'..=b'z' => u32::from(c - b'a') + 26,
            b'0'..=b'9' => u32::from(c - b'0') + 52,
            b'+' => 62,
            b'/' => 63,
            _ => panic!("bad base64 byte {c}"),
        }
    }
    let s = s.as_str().expect("base64 string");
    let s = s.trim_end_matches('=').as_bytes();
    let mut out = Vec::with_capacity(s.len() * 3 / 4);
    for chunk in s.chunks(4) {
        let mut acc = 0u32;
        for (i, &c) in chunk.iter().enumerate() {
            acc |= val(c) << (18 - 6 * i);
        }
        out.extend_from_slice(&acc.to_be_bytes()[1..chunk.len()]);
    }
    out
}

fn splitmix64(k: u64) -> u64 {
    let mut z = k.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

fn unif(k: u64) -> f32 {
    (splitmix64(k) >> 40) as f32 * (1.0 / 16_777_216.0)
}

/// `record_quant_fixtures.bulk_inputs`, bit for bit (as in `quant_reference.rs`).
fn bulk_inputs(n: u64) -> Vec<f32> {
    (0..n)
        .map(|i| {
            let (u0, u1, u2) = (unif(3 * i + 1), unif(3 * i + 2), unif(3 * i + 3));
            let block = i / 256;
            let exp = ((block * 7) % 41) as i32 - 20;
            let scale = f32::from_bits(((exp + 127) as u32) << 23);
            let t = u0 * 2.0 - 1.0;
            let mut x = match block % 4 {
                1 => ((u0 + u1) + u2) - 1.5,
                2 => (t * t) * t,
                _ => t,
            };
            if block % 4 == 3 && i % 256 == (block * 37) % 256 {
                x *= 16.0;
            }
            x * scale
        })
        .collect()
}

/// The script's `weights(n)`.
fn weights(n: usize) -> Vec<f32> {
    (0..n as u64)
        .map(|j| {
            if j % 97 == 0 {
                return 0.0;
            }
            let u = unif(j + (1 << 41));
            let e = (j % 11) as i32 - 5;
            (u * u) * f32::from_bits(((e + 127) as u32) << 23)
        })
        .collect()
}

fn sha(b: &[u8]) -> String {
    Sha256::digest(b)
        .iter()
        .map(|x| format!("{x:02x}"))
        .collect()
}

fn f32_bytes(x: &[f32]) -> Vec<u8> {
    x.iter().flat_map(|v| v.to_le_bytes()).collect()
}

fn ty(name: &str) -> GgmlType {
    GgmlType::from_name(name).unwrap_or_else(|| panic!("type {name}"))
}

fn quantize(t: GgmlType, x: &[f32], n_per_row: usize, w: &[f32]) -> Vec<u8> {
    let mut out = vec![0u8; x.len() / t.block_size() * t.type_size()];
    quant::quantize_rows(t, x, &mut out, n_per_row, Some(w)).expect("quantize_rows");
    out
}

#[test]
fn cases_match_ggml() {
    let spec = fixture("weighted.json");
    let inputs = fixture("inputs.json");
    let cases = inputs["cases"].as_array().expect("cases");
    let mut bad = Vec::new();
    let types = spec["types"].as_object().expect("types");
    for (name, t) in types {
        let gt = ty(name);
        for case in cases {
            let cname = case["name"].as_str().expect("name");
            let x: Vec<f32> = b64(&case["f32_le_b64"])
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect();
            let want = b64(&t["cases"][cname]);
            let got = quantize(gt, &x, x.len(), &weights(x.len()));
            if got != want {
                let first = got.iter().zip(&want).position(|(a, b)| a != b);
                bad.push(format!("{name}/{cname}: first differing byte {first:?}"));
            }
        }
    }
    println!("{} types x {} cases", types.len(), cases.len());
    assert!(bad.is_empty(), "differ from ggml:\n{}", bad.join("\n"));
}

#[test]
fn bulk_matches_ggml() {
    let spec = fixture("weighted.json");
    let b = &spec["bulk"];
    let n = b["n"].as_u64().expect("n");
    let row = b["n_per_row"].as_u64().expect("n_per_row") as usize;
    let x = bulk_inputs(n);
    let w = weights(row);
    assert_eq!(
        sha(&f32_bytes(&x)),
        b["input_sha256"].as_str().expect("sha")
    );
    assert_eq!(
        sha(&f32_bytes(&w)),
        b["weights_sha256"].as_str().expect("sha")
    );
    let mut bad = Vec::new();
    for (name, t) in spec["types"].as_object().expect("types") {
        let got = sha(&quantize(ty(name), &x, row, &w));
        let ok = got == t["bulk_sha256"].as_str().expect("sha");
        println!("{name:7} {}", if ok { "equal" } else { "DIFFERENT" });
        if !ok {
            bad.push(name.clone());
        }
    }
    assert!(bad.is_empty(), "bulk differs from ggml for {bad:?}");
}

/// Without weights `quantize_rows` is the reference quantizer; types without a weighted
/// quantizer ignore the weights.
#[test]
fn unweighted_and_ignoring_types() {
    let x = bulk_inputs(4096);
    for t in [
        GgmlType::Q4_K,
        GgmlType::Q8_0,
        GgmlType::F16,
        GgmlType::IQ4_XS,
    ] {
        let mut a = vec![0u8; x.len() / t.block_size() * t.type_size()];
        let mut b = a.clone();
        quant::quantize_rows(t, &x, &mut a, 1024, None).expect("rows");
        quant::quantize(t, &x, &mut b).expect("quantize");
        assert_eq!(a, b, "{t}");
    }
    let w = weights(1024);
    for t in [GgmlType::Q8_0, GgmlType::F16, GgmlType::BF16] {
        let mut b = vec![0u8; x.len() / t.block_size() * t.type_size()];
        quant::quantize(t, &x, &mut b).expect("quantize");
        assert_eq!(quantize(t, &x, 1024, &w), b, "{t}");
    }
}
