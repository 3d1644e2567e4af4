//! `quant` against ggml itself.
//!
//! The fixtures in `tests/fixtures/quant/` were recorded from libggml-base (llama.cpp vendored in
//! llama-cpp-python 0.3.36) by `scripts/record_quant_fixtures.py` (TQ1_0, TQ2_0, MXFP4, NVFP4,
//! Q1_0 and Q2_0 by
//! `scripts/record_lowbit_fixtures.py`, in the same layout; `quant_lowbit.rs` checks the rest of
//! those files and the dequantize-only grid i-quants): shared f32 inputs (Gaussian,
//! zeros, tiny and f16-subnormal magnitudes, outliers, one-signed, huge ranges, ties, NaN/inf,
//! ...), and per type ggml's quantized bytes, ggml's dequantization of those bytes, and ggml's
//! dequantization of arbitrary random block bytes. Here we require:
//!
//! * our `quantize` gives ggml's bytes exactly, for every case and type;
//! * our `dequantize` gives ggml's f32 bit patterns exactly (NaN payloads included);
//! * f16/bf16 conversions equal ggml's over all 65536 halves and a strided sweep of f32 bit
//!   patterns (the full 2^32 sweep is the ignored test `float_conversions_exhaustive`);
//! * the round-trip error `|x - dequantize(quantize(x))|` of each block stays within a bound
//!   derived from the format's step size (see `error_bound`);
//! * no input length panics.
//!
//! Run: `cargo test -p rustorch-core --release --test quant_reference -- --nocapture`

use std::path::PathBuf;

use rustorch_core::quant::{self, QuantError};
use rustorch_core::GgmlType;
use serde_json::Value;
use sha2::{Digest, Sha256};

const TYPES: [GgmlType; 23] = [
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::BF16,
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q8_0,
    GgmlType::Q8_1,
    GgmlType::Q2_K,
    GgmlType::Q3_K,
    GgmlType::Q4_K,
    GgmlType::Q5_K,
    GgmlType::Q6_K,
    GgmlType::Q8_K,
    GgmlType::IQ4_NL,
    GgmlType::IQ4_XS,
    GgmlType::TQ1_0,
    GgmlType::TQ2_0,
    GgmlType::MXFP4,
    GgmlType::NVFP4,
    GgmlType::Q1_0,
    GgmlType::Q2_0,
];

fn fixture_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/quant")
}

fn load(name: &str) -> Value {
    let path = fixture_dir().join(name);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| {
        panic!(
            "{}: {e} (run scripts/record_quant_fixtures.py)",
            path.display()
        )
    });
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
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
        let bytes = acc.to_be_bytes();
        out.extend_from_slice(&bytes[1..chunk.len()]);
    }
    out
}

fn field<'a>(v: &'a Value, key: &str) -> &'a Value {
    v.get(key)
        .unwrap_or_else(|| panic!("fixture lacks '{key}'"))
}

fn str_field<'a>(v: &'a Value, key: &str) -> &'a str {
    field(v, key)
        .as_str()
        .unwrap_or_else(|| panic!("'{key}' is not a string"))
}

fn f32s(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

struct Case {
    name: String,
    x: Vec<f32>,
}

fn inputs() -> Vec<Case> {
    let v = load("inputs.json");
    field(&v, "cases")
        .as_array()
        .expect("cases")
        .iter()
        .map(|c| Case {
            name: str_field(c, "name").to_string(),
            x: f32s(&b64(str_field(c, "f32_le_b64"))),
        })
        .collect()
}

/// One recorded case: name, ggml's bytes, ggml's dequantization of them.
type GgmlCase = (String, Vec<u8>, Vec<f32>);

/// The fixture of `ty` and its cases.
fn type_fixture(ty: GgmlType) -> (Value, Vec<GgmlCase>) {
    let v = load(&format!("{}.json", ty.name()));
    assert_eq!(field(&v, "id").as_u64(), Some(u64::from(ty.id())));
    assert_eq!(
        field(&v, "block_size").as_u64(),
        Some(ty.block_size() as u64)
    );
    assert_eq!(field(&v, "type_size").as_u64(), Some(ty.type_size() as u64));
    let cases = field(&v, "cases")
        .as_array()
        .expect("cases")
        .iter()
        .map(|c| {
            (
                str_field(c, "name").to_string(),
                b64(str_field(c, "quant_b64")),
                f32s(&b64(str_field(c, "dequant_f32_le_b64"))),
            )
        })
        .collect();
    (v, cases)
}

#[test]
fn quantize_matches_ggml_bytes() {
    let inputs = inputs();
    let mut failures = Vec::new();
    let mut total = 0;
    println!("quantize vs ggml (bytes):");
    for ty in TYPES {
        let (_, cases) = type_fixture(ty);
        assert_eq!(cases.len(), inputs.len(), "{ty}: case count");
        let (mut blocks, mut equal) = (0usize, 0usize);
        for (case, (name, want, _)) in inputs.iter().zip(&cases) {
            assert_eq!(&case.name, name);
            let mut got = vec![0u8; want.len()];
            quant::quantize(ty, &case.x, &mut got).unwrap_or_else(|e| panic!("{ty}: {e}"));
            let bs = ty.type_size();
            for (i, (g, w)) in got.chunks(bs).zip(want.chunks(bs)).enumerate() {
                blocks += 1;
                if g == w {
                    equal += 1;
                } else {
                    failures.push(format!(
                        "{ty} case {name} block {i}: got {g:02x?} want {w:02x?}"
                    ));
                }
            }
        }
        total += blocks;
        println!("  {:7} {equal:4}/{blocks:4} blocks identical", ty.name());
    }
    println!("  total {total} blocks over {} types", TYPES.len());
    for f in failures.iter().take(10) {
        eprintln!("{f}");
    }
    assert!(
        failures.is_empty(),
        "{} blocks differ from ggml",
        failures.len()
    );
}

fn bits_equal(a: &[f32], b: &[f32]) -> Option<usize> {
    if a.len() != b.len() {
        return Some(usize::MAX);
    }
    a.iter()
        .zip(b)
        .position(|(x, y)| x.to_bits() != y.to_bits())
}

#[test]
fn dequantize_matches_ggml_bits() {
    let mut failures = Vec::new();
    println!("dequantize vs ggml (f32 bits):");
    let mut total = 0;
    for ty in TYPES {
        let (v, cases) = type_fixture(ty);
        let bs = ty.type_size();
        let check = |what: &str, bytes: &[u8], want: &[f32], failures: &mut Vec<String>| {
            let mut got = vec![0f32; want.len()];
            quant::dequantize(ty, bytes, &mut got).unwrap_or_else(|e| panic!("{ty}: {e}"));
            if let Some(i) = bits_equal(&got, want) {
                failures.push(format!(
                    "{ty} {what}: element {i}: got {:#010x} want {:#010x}",
                    got.get(i).map_or(0, |x| x.to_bits()),
                    want.get(i).map_or(0, |x| x.to_bits())
                ));
            }
            bytes.len() / bs
        };
        let mut quantized_blocks = 0;
        for (name, bytes, want) in &cases {
            quantized_blocks += check(&format!("case {name}"), bytes, want, &mut failures);
        }
        let rnd = field(&v, "random_blocks");
        let bytes = b64(str_field(rnd, "bytes_b64"));
        let want = f32s(&b64(str_field(rnd, "dequant_f32_le_b64")));
        let random_blocks = check("random blocks", &bytes, &want, &mut failures);
        println!(
            "  {:7} {quantized_blocks:4} quantized + {random_blocks:4} random blocks  [ggml: {}]",
            ty.name(),
            str_field(&v, "dequantize_with")
        );
        let blocks = quantized_blocks + random_blocks;
        total += blocks;
    }
    println!("  total {total} blocks");
    for f in &failures {
        eprintln!("{f}");
    }
    assert!(
        failures.is_empty(),
        "{} dequantizations differ",
        failures.len()
    );
}

fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn conversion_fixture(ty: GgmlType) -> Value {
    let v = load(&format!("{}.json", ty.name()));
    field(&v, "exhaustive").clone()
}

fn from_f32(ty: GgmlType) -> fn(f32) -> u16 {
    if ty == GgmlType::F16 {
        quant::f32_to_f16
    } else {
        quant::f32_to_bf16
    }
}

#[test]
fn float_conversions_match_ggml() {
    for ty in [GgmlType::F16, GgmlType::BF16] {
        let fx = conversion_fixture(ty);
        let to_f32: fn(u16) -> f32 = if ty == GgmlType::F16 {
            quant::f16_to_f32
        } else {
            quant::bf16_to_f32
        };
        let all: Vec<u8> = (0..=u16::MAX)
            .flat_map(|h| to_f32(h).to_le_bytes())
            .collect();
        assert_eq!(
            sha256_hex(&all),
            str_field(&fx, "to_f32_all_65536_sha256"),
            "{ty} -> f32"
        );

        let stride = field(&fx, "from_f32_stride").as_u64().expect("stride");
        let conv = from_f32(ty);
        let mut out = Vec::new();
        let mut bits = 0u64;
        while bits < 1 << 32 {
            out.extend_from_slice(&conv(f32::from_bits(bits as u32)).to_le_bytes());
            bits += stride;
        }
        assert_eq!(
            out.len() as u64 / 2,
            field(&fx, "from_f32_strided_count")
                .as_u64()
                .expect("count")
        );
        assert_eq!(
            sha256_hex(&out),
            str_field(&fx, "from_f32_strided_sha256"),
            "f32 -> {ty}, every {stride}th bit pattern"
        );
        println!(
            "{ty}: all 65536 -> f32 and {} strided f32 -> {ty} conversions match ggml",
            out.len() / 2
        );
    }
}

/// Every one of the 2^32 f32 bit patterns through f32 -> f16 and f32 -> bf16 (~1 min in release).
#[test]
#[ignore]
fn float_conversions_exhaustive() {
    for ty in [GgmlType::F16, GgmlType::BF16] {
        let fx = conversion_fixture(ty);
        let conv = from_f32(ty);
        let mut hasher = Sha256::new();
        let mut buf = vec![0u8; 1 << 25];
        for hi in 0u32..256 {
            for (i, out) in buf.chunks_exact_mut(2).enumerate() {
                let bits = (hi << 24) | i as u32;
                out.copy_from_slice(&conv(f32::from_bits(bits)).to_le_bytes());
            }
            hasher.update(&buf);
        }
        let got: String = hasher
            .finalize()
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        assert_eq!(
            got,
            str_field(&fx, "from_f32_all_2pow32_sha256"),
            "f32 -> {ty}"
        );
        println!("{ty}: all 2^32 f32 -> {ty} conversions match ggml");
    }
}

/// splitmix64 of a counter; the same function as in `scripts/record_quant_fixtures.py`.
fn splitmix64(k: u64) -> u64 {
    let mut z = k.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The script's `bulk_inputs`, bit for bit: every step is exact or one f32 rounding done in the
/// same order.
fn bulk_inputs(n: u64) -> Vec<f32> {
    let unif = |k: u64| (splitmix64(k) >> 40) as f32 * (1.0 / 16_777_216.0);
    (0..n)
        .map(|i| {
            let (u0, u1, u2) = (unif(3 * i + 1), unif(3 * i + 2), unif(3 * i + 3));
            let block = i / 256;
            let kind = block % 4;
            let exp = ((block * 7) % 41) as i32 - 20;
            let scale = f32::from_bits(((exp + 127) as u32) << 23);
            let t = u0 * 2.0 - 1.0;
            let mut x = match kind {
                0 => t,
                1 => ((u0 + u1) + u2) - 1.5,
                2 => (t * t) * t,
                _ => t,
            };
            if kind == 3 && i % 256 == (block * 37) % 256 {
                x *= 16.0;
            }
            x * scale
        })
        .collect()
}

fn f32_bytes(x: &[f32]) -> Vec<u8> {
    x.iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// 2^20 generated values per type (4096 super-blocks / 32768 blocks of 32) through quantize and
/// dequantize, plus 16384 blocks of arbitrary bytes through dequantize, compared with ggml by
/// SHA-256.
#[test]
fn bulk_matches_ggml_digests() {
    let spec = load("inputs.json");
    let bulk_spec = field(&spec, "bulk");
    let n = field(bulk_spec, "n").as_u64().expect("n");
    let x = bulk_inputs(n);
    assert_eq!(
        sha256_hex(&f32_bytes(&x)),
        str_field(bulk_spec, "sha256"),
        "bulk input generator differs from the script's"
    );
    let mut failures = Vec::new();
    println!("bulk vs ggml (SHA-256):");
    for ty in TYPES {
        let v = load(&format!("{}.json", ty.name()));
        let b = field(&v, "bulk");
        let mut q = vec![0u8; x.len() / ty.block_size() * ty.type_size()];
        quant::quantize(ty, &x, &mut q).expect("quantize");
        if sha256_hex(&q) != str_field(b, "quant_sha256") {
            failures.push(format!("{ty}: quantized bytes"));
        }
        let mut y = vec![0f32; x.len()];
        quant::dequantize(ty, &q, &mut y).expect("dequantize");
        if sha256_hex(&f32_bytes(&y)) != str_field(b, "dequant_sha256") {
            failures.push(format!("{ty}: dequantized quantized bytes"));
        }
        let blocks = field(b, "random_blocks").as_u64().expect("random_blocks") as usize;
        let bytes: Vec<u8> = (0..(blocks * ty.type_size()) as u64)
            .map(|k| splitmix64((1 << 40) + k) as u8)
            .collect();
        let mut y = vec![0f32; blocks * ty.block_size()];
        quant::dequantize(ty, &bytes, &mut y).expect("dequantize");
        if sha256_hex(&f32_bytes(&y)) != str_field(b, "random_dequant_sha256") {
            failures.push(format!("{ty}: dequantized random bytes"));
        }
        println!(
            "  {:7} {:6} blocks quantized + dequantized, {blocks} random blocks dequantized",
            ty.name(),
            q.len() / ty.type_size()
        );
    }
    assert!(failures.is_empty(), "differ from ggml: {failures:?}");
}

/// Largest `|x - dequantize(quantize(x))|` allowed in a block whose largest magnitude is `a`,
/// as `rel * a + abs`.
///
/// Derivation, per format (`u = 2^-11`: relative rounding of a scale stored as f16; `s = 2^-25`:
/// half an ulp of an f16 subnormal, the absolute rounding of tiny f16 scales):
///
/// * F16 / BF16: half an ulp, `2^-11` / `2^-8` relative; F32 is exact.
/// * Q4_0 (`d = max/-8`): rounding costs half a step `a/16`, but the value opposite the signed max
///   (at `+8` steps) clamps to `+7`: one full step, `a/8`. Scale rounding adds `8 * u * a/8`.
///   Q5_0 likewise: `a/16 + u*a`.
/// * Q4_1 / Q5_1: half a step of `(max - min) / nmax <= 2a/nmax`, plus f16 rounding of `d`
///   (times `nmax`) and of `m`: `a/nmax + 3u*a`.
/// * Q8_0 / Q8_1: half a step `a/254`, plus `u*a`. Q8_K has an f32 scale: `a/254` (+ f32 eps).
/// * IQ4_NL: codes are grid values times `d`, `|d| ≈ a/127`; the widest gap of the grid is 23
///   (-127..-104), so rounding costs ≤ 11.5/127 a, and clamping at the short end (113 vs 127)
///   ≤ 14/127 a. The scale search may shrink or stretch `d` (±7/127 candidates and a
///   least-squares refit), so allow `(14 + 8)/127 a` plus f16 rounding ~ 0.18a. IQ4_XS adds the
///   6-bit sub-block scale (`|d_sub| <= 32 d_super`, half-step of that quantization is 1/64
///   relative): 0.2a.
/// * k-quants: codes are re-chosen by nearest rounding against the final (quantized) sub-block
///   scales, so the error is half a sub-block step unless a value falls outside the span the
///   fitted (scale, min) covers; the fits clamp at most by a fraction of a step. The sub-block
///   step is at most the block span `2a` over `nmax` intervals, which, taking one full step as
///   the bound, gives Q2_K `2a/3`, Q3_K (symmetric, 8 levels over `2a`) `2a/7`, Q4_K `2a/15`,
///   Q5_K `2a/31`, Q6_K (64 levels) `2a/63`; each plus the f16 scale rounding term.
/// * TQ1_0 / TQ2_0 (`d = a`, codes -1, 0, 1): a value just under `a/2` rounds to 0, so half a
///   step `a/2`, plus f16 rounding of `d`.
/// * MXFP4 (`d = 2^(E - 3)` with `E = floor(log2 a)`, codes ±{0, 1, 2, 3, 4, 6, 8, 12}·d, i.e.
///   up to `1.5·2^E`): the widest step, 1.0 → 1.5 (·2^E), costs at most `0.25·2^E <= 0.25a`,
///   and values above `1.5·2^E` clamp to it, less than `a - 0.75a` away since `a < 2^(E+1)`:
///   `0.25a`, with no rounding term (the scale is a power of two). Maxima below 2^-125 wrap the
///   E8M0 byte, as in ggml, and fall under the absolute floor.
/// * NVFP4 (per 16 weights `s = UE4M3(m/6)`, `m` their largest magnitude, codes up to `6s`):
///   the scale keeps 3 mantissa bits (rounding ≤ 1/16 relative), the widest code step is 4s → 6s
///   (half: `s ≈ a/6 · 17/16`), and the clamp at `6s` costs at most `a/17`: 0.18a. Subnormal
///   scales (below 2^-6, step 2^-10 after halving) add `6 · 2^-10` absolutely. Scales of 256 or
///   more all become 448 (ggml's encoder maps exponent 15 to 0x7E), so magnitudes above
///   `6 · 256` are skipped, as overflowing f16 scales are.
/// * Q1_0 (`±d`, `d` = mean magnitude ≤ a): at most `a` away, plus f16 rounding of `d`.
/// * Q2_0 (`d = a`, codes -1..=2): half a step `a/2`, plus f16 rounding of `d`.
/// * Groups with magnitude below ggml's `GROUP_MAX_EPS` (1e-15) are zeroed on purpose, so every
///   bound has an absolute floor of 1e-15 on top of the f16-subnormal term.
fn error_bound(ty: GgmlType, a: f32) -> f32 {
    let (rel, abs) = bound_terms(ty);
    rel * a + abs + 1e-15
}

fn bound_terms(ty: GgmlType) -> (f32, f32) {
    use GgmlType::*;
    let u = 2f32.powi(-11);
    let s = 2f32.powi(-25);
    match ty {
        F32 => (0.0, 0.0),
        F16 => (u, s),
        BF16 => (2f32.powi(-8), 0.0),
        Q4_0 => (1.0 / 8.0 + u, 8.0 * s),
        Q5_0 => (1.0 / 16.0 + u, 16.0 * s),
        Q4_1 => (1.0 / 15.0 + 3.0 * u, 16.0 * s),
        Q5_1 => (1.0 / 31.0 + 3.0 * u, 32.0 * s),
        Q8_0 | Q8_1 => (1.0 / 254.0 + u, 128.0 * s),
        Q8_K => (1.0 / 254.0 + 2f32.powi(-16), 0.0),
        IQ4_NL => (0.18, 128.0 * s),
        IQ4_XS => (0.2, 128.0 * 32.0 * s),
        Q2_K => (2.0 / 3.0 + 4.0 * u, 64.0 * s),
        Q3_K => (2.0 / 7.0 + 4.0 * u, 4.0 * 32.0 * s),
        Q4_K => (2.0 / 15.0 + 4.0 * u, 2.0 * 15.0 * 63.0 * s),
        Q5_K => (2.0 / 31.0 + 4.0 * u, 2.0 * 31.0 * 63.0 * s),
        Q6_K => (2.0 / 63.0 + 4.0 * u, 32.0 * 128.0 * s),
        TQ1_0 | TQ2_0 => (0.5 + u, s),
        MXFP4 => (0.25, 0.0),
        NVFP4 => (0.18, 6.0 * 2f32.powi(-10)),
        Q1_0 => (1.0 + u, s),
        Q2_0 => (0.5 + u, s),
        _ => unreachable!("not a tested type"),
    }
}

#[test]
fn round_trip_error_within_bounds() {
    let mut inputs = inputs();
    inputs.push(Case {
        name: "bulk".to_string(),
        x: bulk_inputs(1 << 20),
    });
    let mut failures = Vec::new();
    println!("round trip max |x - deq(q(x))| / block absmax (finite inputs whose scales fit f16):");
    for ty in TYPES {
        // Per ggml block; per 256 values for the float types, whose "block" is one value.
        let block = if ty.block_size() == 1 {
            256
        } else {
            ty.block_size()
        };
        let (rel_bound, _) = bound_terms(ty);
        let (mut checked, mut skipped) = (0usize, 0usize);
        let mut worst = (0f32, String::new());
        for case in &inputs {
            if case.x.iter().any(|v| !v.is_finite()) {
                continue;
            }
            let mut q = vec![0u8; case.x.len() / ty.block_size() * ty.type_size()];
            let mut y = vec![0f32; case.x.len()];
            quant::quantize(ty, &case.x, &mut q).expect("quantize");
            quant::dequantize(ty, &q, &mut y).expect("dequantize");
            for (xb, yb) in case.x.chunks(block).zip(y.chunks(block)) {
                let a = xb.iter().fold(0f32, |m, v| m.max(v.abs()));
                // f16 scales and mins overflow near 65504 (Q8_K's scale is an f32, MXFP4's a
                // power of two up to 2^127); NVFP4's scales of 256 and up all become 448.
                let limit = match ty {
                    GgmlType::F32 | GgmlType::BF16 | GgmlType::Q8_K | GgmlType::MXFP4 => {
                        f32::INFINITY
                    }
                    GgmlType::NVFP4 => 1500.0,
                    _ => 60000.0,
                };
                if a > limit {
                    skipped += 1;
                    continue;
                }
                checked += 1;
                // A NaN difference counts as an infinite error (f32::max would drop it).
                let err = xb
                    .iter()
                    .zip(yb)
                    .map(|(x, y)| (x - y).abs())
                    .map(|e| if e.is_nan() { f32::INFINITY } else { e })
                    .fold(0f32, f32::max);
                let bound = error_bound(ty, a);
                if err > bound {
                    failures.push(format!(
                        "{ty} case {}: error {err:e} > bound {bound:e} (absmax {a:e})",
                        case.name
                    ));
                }
                // Relative error is only meaningful well above the f16-subnormal floor.
                if a > 1e-2 && err / a > worst.0 {
                    worst = (err / a, case.name.clone());
                }
            }
        }
        println!(
            "  {:7} {checked:5} blocks checked ({skipped:3} skipped), worst {:.5} ({}), bound {rel_bound:.5}",
            ty.name(),
            worst.0,
            worst.1,
        );
    }
    for f in failures.iter().take(20) {
        eprintln!("{f}");
    }
    assert!(
        failures.is_empty(),
        "{} blocks exceed their bound",
        failures.len()
    );
}

#[test]
fn no_input_length_panics() {
    let x: Vec<f32> = (0..600).map(|i| (i as f32 * 0.37).sin()).collect();
    let bytes: Vec<u8> = (0..700).map(|i| (i * 73 % 256) as u8).collect();
    for ty in rustorch_core::types::ALL_TYPES {
        for n in [0usize, 1, 2, 31, 32, 33, 255, 256, 257, 512, 600] {
            for out_len in [0usize, 1, n, n + 1, 1000] {
                let mut q = vec![0u8; out_len];
                let r = quant::quantize(ty, &x[..n], &mut q);
                if !quant::supports_quantize(ty) {
                    assert_eq!(r, Err(QuantError::Unsupported(ty)));
                } else if n % ty.block_size() != 0 {
                    assert!(
                        matches!(r, Err(QuantError::NotBlockAligned { .. })),
                        "{ty} {n}"
                    );
                } else {
                    let ok = out_len == n / ty.block_size() * ty.type_size();
                    assert_eq!(r.is_ok(), ok, "{ty} {n} -> {out_len}");
                }
                let mut y = vec![0f32; out_len];
                let r = quant::dequantize(ty, &bytes[..n], &mut y);
                if !quant::supports_dequantize(ty) {
                    assert_eq!(r, Err(QuantError::Unsupported(ty)));
                } else if n % ty.type_size() != 0 {
                    assert!(
                        matches!(r, Err(QuantError::NotBlockAligned { .. })),
                        "{ty} {n}"
                    );
                } else {
                    let ok = out_len == n / ty.type_size() * ty.block_size();
                    assert_eq!(r.is_ok(), ok, "{ty} {n} bytes -> {out_len}");
                }
            }
        }
    }
}
