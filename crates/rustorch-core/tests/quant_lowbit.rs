//! The low-bit formats against ggml itself: IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS,
//! IQ3_S, TQ1_0, TQ2_0, MXFP4, NVFP4, Q1_0 and Q2_0.
//!
//! `scripts/record_lowbit_fixtures.py` recorded, from libggml-base's `to_float` (llama.cpp
//! vendored in llama-cpp-python 0.3.36), per type in `tests/fixtures/quant/<type>.json`:
//!
//! * `edge_blocks`: hand-made blocks (every f16 scale class incl. ±0, subnormals, the largest
//!   finite value, ±inf and NaNs with payloads; payloads of all-zero and all-one bits; MXFP4's
//!   E8M0 and NVFP4's UE4M3 scales at their limits with every code) and ggml's f32 output,
//!   compared element for element as bit patterns;
//! * `random_blocks`: random bytes, element for element;
//! * `sweep`: blocks that together use every entry of the format's lookup table (grid, byte
//!   values, exponents), one SHA-256 of ggml's output per block;
//! * `bulk`: SHA-256 of ggml's dequantization of 16384 blocks of generated arbitrary bytes;
//! * for the formats we also quantize (all but the grid i-quants), `extra_cases`: inputs aimed at those
//!   quantizers (rounding ties, maxima around powers of two, subnormal/huge maxima, NaN/inf at
//!   block ends) with ggml's bytes and their dequantization. (Their `cases` and `bulk`
//!   quantization digests over the shared inputs are checked by `quant_reference.rs`.)
//!
//! Run: `cargo test -p rustorch-core --release --test quant_lowbit -- --nocapture`

use std::path::PathBuf;

use rustorch_core::quant;
use rustorch_core::GgmlType;
use serde_json::Value;
use sha2::{Digest, Sha256};

const TYPES: [GgmlType; 13] = [
    GgmlType::IQ2_XXS,
    GgmlType::IQ2_XS,
    GgmlType::IQ2_S,
    GgmlType::IQ3_XXS,
    GgmlType::IQ3_S,
    GgmlType::IQ1_S,
    GgmlType::IQ1_M,
    GgmlType::TQ1_0,
    GgmlType::TQ2_0,
    GgmlType::MXFP4,
    GgmlType::NVFP4,
    GgmlType::Q1_0,
    GgmlType::Q2_0,
];

/// The ones we also quantize.
const QUANTIZED: [GgmlType; 6] = [
    GgmlType::TQ1_0,
    GgmlType::TQ2_0,
    GgmlType::MXFP4,
    GgmlType::NVFP4,
    GgmlType::Q1_0,
    GgmlType::Q2_0,
];

fn load(ty: GgmlType) -> Value {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/quant")
        .join(format!("{}.json", ty.name()));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| {
        panic!(
            "{}: {e} (run scripts/record_lowbit_fixtures.py)",
            path.display()
        )
    });
    let v: Value =
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    assert_eq!(v["id"].as_u64(), Some(u64::from(ty.id())), "{ty}: id");
    assert_eq!(
        v["block_size"].as_u64(),
        Some(ty.block_size() as u64),
        "{ty}: block size"
    );
    assert_eq!(
        v["type_size"].as_u64(),
        Some(ty.type_size() as u64),
        "{ty}: type size"
    );
    v
}

fn b64(s: &str) -> Vec<u8> {
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

fn str_at<'a>(v: &'a Value, key: &str) -> &'a str {
    v[key]
        .as_str()
        .unwrap_or_else(|| panic!("fixture lacks string '{key}'"))
}

fn bytes_at(v: &Value, key: &str) -> Vec<u8> {
    b64(str_at(v, key))
}

fn f32s_at(v: &Value, key: &str) -> Vec<f32> {
    bytes_at(v, key)
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn f32_bytes(x: &[f32]) -> Vec<u8> {
    x.iter().flat_map(|v| v.to_le_bytes()).collect()
}

fn dequant(ty: GgmlType, bytes: &[u8]) -> Vec<f32> {
    let mut y = vec![0f32; bytes.len() / ty.type_size() * ty.block_size()];
    quant::dequantize(ty, bytes, &mut y).unwrap_or_else(|e| panic!("{ty}: {e}"));
    y
}

/// Compares our dequantization of `bytes` with ggml's `want`, bit for bit; one message per
/// differing block, naming its label and first differing element.
fn compare_blocks(
    ty: GgmlType,
    what: &str,
    labels: Option<&[String]>,
    bytes: &[u8],
    want: &[f32],
    failures: &mut Vec<String>,
) -> usize {
    let got = dequant(ty, bytes);
    assert_eq!(got.len(), want.len(), "{ty} {what}: element count");
    let bs = ty.block_size();
    let mut blocks = 0;
    for (b, (g, w)) in got.chunks(bs).zip(want.chunks(bs)).enumerate() {
        blocks += 1;
        if let Some(i) = g
            .iter()
            .zip(w)
            .position(|(x, y)| x.to_bits() != y.to_bits())
        {
            let label = labels
                .and_then(|l| l.get(b))
                .map_or(String::new(), |l| format!(" ({l})"));
            failures.push(format!(
                "{ty} {what} block {b}{label}: element {i}: got {:#010x} want {:#010x}",
                g[i].to_bits(),
                w[i].to_bits()
            ));
        }
    }
    blocks
}

#[test]
fn every_lowbit_type_dequantizes() {
    for ty in TYPES {
        assert!(quant::supports_dequantize(ty), "{ty}");
    }
    for ty in QUANTIZED {
        assert!(quant::supports_quantize(ty), "{ty}");
    }
}

#[test]
fn dequantize_matches_ggml_element_for_element() {
    let mut failures = Vec::new();
    println!("dequantize vs ggml (f32 bits, element for element):");
    for ty in TYPES {
        let v = load(ty);
        let edge = &v["edge_blocks"];
        let labels: Vec<String> = edge["labels"]
            .as_array()
            .expect("labels")
            .iter()
            .map(|l| l.as_str().expect("label").to_string())
            .collect();
        let bytes = bytes_at(edge, "bytes_b64");
        assert_eq!(
            bytes.len(),
            labels.len() * ty.type_size(),
            "{ty}: edge blocks"
        );
        let want = f32s_at(edge, "dequant_f32_le_b64");
        let n_edge = compare_blocks(ty, "edge", Some(&labels), &bytes, &want, &mut failures);

        let rnd = &v["random_blocks"];
        let bytes = bytes_at(rnd, "bytes_b64");
        let want = f32s_at(rnd, "dequant_f32_le_b64");
        let n_rnd = compare_blocks(ty, "random", None, &bytes, &want, &mut failures);
        println!(
            "  {:8} {n_edge:3} edge + {n_rnd:3} random blocks ({} values)",
            ty.name(),
            (n_edge + n_rnd) * ty.block_size()
        );
    }
    for f in &failures {
        eprintln!("{f}");
    }
    assert!(
        failures.is_empty(),
        "{} blocks differ from ggml:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

#[test]
fn every_table_entry_matches_ggml() {
    let mut failures = Vec::new();
    println!("table sweeps vs ggml (SHA-256 per block):");
    for ty in TYPES {
        let v = load(ty);
        let sweep = &v["sweep"];
        let bytes = bytes_at(sweep, "bytes_b64");
        let digests = sweep["block_sha256"].as_array().expect("block_sha256");
        assert_eq!(bytes.len(), digests.len() * ty.type_size(), "{ty}: sweep");
        let got = dequant(ty, &bytes);
        for (b, (y, want)) in got.chunks(ty.block_size()).zip(digests).enumerate() {
            if sha256_hex(&f32_bytes(y)) != want.as_str().expect("digest") {
                failures.push(format!("{ty} sweep block {b}"));
            }
        }
        println!(
            "  {:8} {:3} blocks: {}",
            ty.name(),
            digests.len(),
            str_at(sweep, "note")
        );
    }
    assert!(failures.is_empty(), "differ from ggml: {failures:?}");
}

/// splitmix64 of a counter, as in `scripts/record_quant_fixtures.py`'s `bulk_random_bytes`.
fn splitmix64(k: u64) -> u64 {
    let mut z = k.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

#[test]
fn bulk_random_blocks_match_ggml_digests() {
    let mut failures = Vec::new();
    for ty in TYPES {
        let v = load(ty);
        let b = &v["bulk"];
        let blocks = b["random_blocks"].as_u64().expect("random_blocks") as usize;
        let bytes: Vec<u8> = (0..(blocks * ty.type_size()) as u64)
            .map(|k| splitmix64((1 << 40) + k) as u8)
            .collect();
        let y = dequant(ty, &bytes);
        if sha256_hex(&f32_bytes(&y)) != str_at(b, "random_dequant_sha256") {
            failures.push(ty);
        }
        println!("  {:8} {blocks} random blocks dequantized", ty.name());
    }
    assert!(failures.is_empty(), "differ from ggml: {failures:?}");
}

#[test]
fn quantize_extra_cases_match_ggml() {
    let mut failures = Vec::new();
    for ty in QUANTIZED {
        let v = load(ty);
        let cases = v["extra_cases"].as_array().expect("extra_cases");
        let (mut blocks, mut equal) = (0, 0);
        for c in cases {
            let name = str_at(c, "name");
            let x = f32s_at(c, "f32_le_b64");
            let want = bytes_at(c, "quant_b64");
            let mut got = vec![0u8; want.len()];
            quant::quantize(ty, &x, &mut got).unwrap_or_else(|e| panic!("{ty}: {e}"));
            let ts = ty.type_size();
            for (i, (g, w)) in got.chunks(ts).zip(want.chunks(ts)).enumerate() {
                blocks += 1;
                if g == w {
                    equal += 1;
                } else {
                    failures.push(format!("{ty} {name} block {i}: got {g:02x?} want {w:02x?}"));
                }
            }
            let want = f32s_at(c, "dequant_f32_le_b64");
            compare_blocks(ty, name, None, &got, &want, &mut failures);
        }
        println!(
            "  {:8} {equal}/{blocks} blocks identical over {} extra cases",
            ty.name(),
            cases.len()
        );
    }
    assert!(
        failures.is_empty(),
        "{} differ from ggml:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

#[test]
fn block_bytes_round_trip() {
    use rustorch_core::quant::*;
    let bytes: Vec<u8> = (0..4096u64).map(|k| splitmix64(k) as u8).collect();
    macro_rules! check {
        ($t:ty) => {{
            let b: &[u8; <$t>::SIZE] = bytes[..<$t>::SIZE].try_into().unwrap();
            assert_eq!(&<$t>::from_bytes(b).to_bytes(), b, stringify!($t));
        }};
    }
    check!(BlockIq2Xxs);
    check!(BlockIq2Xs);
    check!(BlockIq2S);
    check!(BlockIq3Xxs);
    check!(BlockIq3S);
    check!(BlockIq1S);
    check!(BlockIq1M);
    check!(BlockTq1_0);
    check!(BlockTq2_0);
    check!(BlockMxfp4);
    check!(BlockNvfp4);
    check!(BlockQ1_0);
    check!(BlockQ2_0);
}
