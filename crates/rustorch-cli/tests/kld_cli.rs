//! `rustorch perplexity --kl-divergence-base / --kl-divergence` against llama-perplexity,
//! with the runs recorded in tests/fixtures/kld/smollm2.json by
//! scripts/record_kld_fixtures.py: SmolLM2 Q4_1 is the base, its Q8_0 made by
//! `rustorch quantize --allow-requantize` (llama-quantize's bytes) the tested model,
//! tests/fixtures/kld/text.txt the text. Both tools evaluate in micro-batches of 32 tokens
//! (`-ub 32` / `--ubatch-size 32`): from 64 query rows on llama.cpp's CPU flash attention
//! takes a tiled algorithm that rustorch does not reproduce bit for bit (docs/parity.md).
//!
//! - llama.cpp's own base file (tests/fixtures/kld/base-c8.bin) read by rustorch gives
//!   llama-perplexity's figures to 4 decimals;
//! - the base files rustorch writes are llama.cpp's byte for byte (on an AVX-512 CPU, the
//!   arithmetic they were recorded with) and, read back, give llama-perplexity's figures,
//!   the summary statistics included (the 2×128-token run scores 126 positions, past
//!   llama.cpp's 100);
//! - the base model against its own base file diverges by nothing but the 16-bit rounding.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;

use serde_json::Value;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn fixture() -> Value {
    let raw = std::fs::read(root().join("tests/fixtures/kld/smollm2.json")).expect("fixture");
    serde_json::from_slice(&raw).expect("json")
}

fn run_fixture(name: &str) -> Value {
    fixture()["runs"]
        .as_array()
        .expect("runs")
        .iter()
        .find(|r| r["name"] == name)
        .expect("run")
        .clone()
}

fn rustorch(args: &[&str]) -> Output {
    // the recording's attention arithmetic (llama.cpp built with or without AVX512-FP16)
    let native = fixture()["avx512fp16"].as_bool().expect("avx512fp16");
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_rustorch"));
    if !native {
        cmd.env("RUSTORCH_NO_AVX512FP16", "1");
    }
    cmd.args(args)
        .args(["--device", "cpu", "-t", "2"])
        .current_dir(root())
        .output()
        .expect("run rustorch")
}

fn ok_stdout(o: &Output) -> String {
    assert!(
        o.status.success(),
        "rustorch failed: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8(o.stdout.clone()).expect("utf-8 stdout")
}

fn base_model() -> Option<PathBuf> {
    let p = root().join("models/SmolLM2-135M-Instruct.Q4_1.gguf");
    if p.exists() {
        Some(p)
    } else {
        eprintln!(
            "SKIPPED: {} is absent (run scripts/fetch-models.sh)",
            p.display()
        );
        None
    }
}

/// Per-process scratch files (base files, bad inputs) under cargo's test temp dir.
fn scratch() -> PathBuf {
    let d = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("kld-{}", std::process::id()));
    std::fs::create_dir_all(&d).expect("scratch dir");
    d
}

/// The tested model: the base quantized to Q8_0 by `rustorch quantize`, made once per
/// process into cargo's test temp dir (the fixture's `model_sha256` is llama-quantize's
/// file, which it writes byte for byte).
fn q8_model() -> Option<&'static Path> {
    static Q8: OnceLock<Option<PathBuf>> = OnceLock::new();
    Q8.get_or_init(|| {
        let base = base_model()?;
        let tmp = scratch().join("smol-q8_0.gguf");
        std::fs::remove_file(&tmp).ok();
        let o = Command::new(env!("CARGO_BIN_EXE_rustorch"))
            .args(["quantize", "--allow-requantize"])
            .arg(&base)
            .arg(&tmp)
            .arg("q8_0")
            .output()
            .expect("run rustorch quantize");
        assert!(
            o.status.success(),
            "rustorch quantize --allow-requantize BASE OUT q8_0: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        // one model file however many test processes ran; each makes its own first
        let out = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("kld-smol-q8_0.gguf");
        std::fs::rename(&tmp, &out).expect("move the Q8_0 model");
        Some(out)
    })
    .as_deref()
}

/// A line's numbers, and the line with each number replaced by `#` (white space collapsed).
fn numbers(line: &str) -> (String, Vec<f64>) {
    let b = line.as_bytes();
    let (mut label, mut nums, mut i) = (String::new(), Vec::new(), 0);
    while i < b.len() {
        let starts =
            b[i].is_ascii_digit() || (b[i] == b'-' && i + 1 < b.len() && b[i + 1].is_ascii_digit());
        if starts {
            let s = i;
            i += 1;
            while i < b.len() && (b[i].is_ascii_digit() || b[i] == b'.') {
                i += 1;
            }
            nums.push(line[s..i].parse::<f64>().expect("number"));
            label.push('#');
        } else {
            let ch = line[i..].chars().next().expect("char");
            label.push(ch);
            i += ch.len_utf8();
        }
    }
    (label.split_whitespace().collect::<Vec<_>>().join(" "), nums)
}

/// Our KL-divergence output against llama-perplexity's, line by line: the same lines, and
/// every printed figure equal to 4 decimals (|Δ| ≤ 5e-5). Returns how many lines are
/// identical character for character.
fn assert_same_figures(ours: &str, theirs: &str) -> usize {
    let lines = |s: &str| -> Vec<String> {
        s.lines()
            .map(str::trim_end)
            .filter(|l| !l.is_empty())
            .map(String::from)
            .collect()
    };
    let (a, b) = (lines(ours), lines(theirs));
    assert_eq!(
        a.len(),
        b.len(),
        "line count differs\n--- rustorch\n{ours}\n--- llama-perplexity\n{theirs}"
    );
    let mut identical = 0;
    for (x, y) in a.iter().zip(&b) {
        let ((lx, nx), (ly, ny)) = (numbers(x), numbers(y));
        assert_eq!(lx, ly, "\nrustorch:           {x}\nllama-perplexity:   {y}");
        assert_eq!(nx.len(), ny.len(), "{x} / {y}");
        for (p, q) in nx.iter().zip(&ny) {
            assert!(
                (p - q).abs() <= 5e-5 + 1e-12,
                "figures differ past 4 decimals:\nrustorch:           {x}\nllama-perplexity:   {y}"
            );
        }
        identical += (x == y) as usize;
    }
    identical
}

/// Whether this CPU computes as the one the fixture was recorded on (AVX-512).
fn recorded_arithmetic() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::is_x86_feature_detected!("avx512f") && std::env::var_os("RUSTORCH_ISA").is_none()
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

fn fnv1a64(data: &[u8]) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in data {
        h = (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3);
    }
    format!("{h:016x}")
}

/// Header fields and tokens of a base file (the layout llama.cpp writes).
fn header(data: &[u8]) -> (i32, i32, i32, Vec<i64>) {
    assert_eq!(&data[..8], b"_logits_");
    let i32_at = |o: usize| i32::from_le_bytes(data[o..o + 4].try_into().unwrap());
    let (n_ctx, n_vocab, n_chunk) = (i32_at(8), i32_at(12), i32_at(16));
    let tokens = (0..(n_ctx * n_chunk) as usize)
        .map(|k| i32_at(20 + 4 * k) as i64)
        .collect();
    (n_ctx, n_vocab, n_chunk, tokens)
}

/// Writes the base file of `run` with rustorch from the base model; checks its layout and
/// tokens against llama.cpp's and its "Final estimate" figures; returns the file.
fn write_base(run: &Value, base: &Path) -> PathBuf {
    let name = run["name"].as_str().unwrap();
    let out = scratch().join(format!("base-{name}-rustorch.bin"));
    let ctx = run["ctx"].as_u64().unwrap().to_string();
    let chunks = run["chunks"].as_u64().unwrap().to_string();
    let ubatch = run["ubatch"].as_u64().unwrap().to_string();
    let o = rustorch(&[
        "perplexity",
        "-m",
        base.to_str().unwrap(),
        "-f",
        "tests/fixtures/kld/text.txt",
        "-c",
        &ctx,
        "--chunks",
        &chunks,
        "--ubatch-size",
        &ubatch,
        "--kl-divergence-base",
        out.to_str().unwrap(),
    ]);
    let text = ok_stdout(&o);
    // "[1]43.2251,[2]44.2861," and "Final estimate: PPL = 44.2861 +/- 13.50619"
    let ours_ppl = text.lines().next().unwrap_or("");
    let ours_final = text
        .lines()
        .find(|l| l.starts_with("Final estimate"))
        .expect("Final estimate line");
    assert_same_figures(ours_ppl, run["ppl_stdout"].as_str().unwrap());
    assert_same_figures(ours_final, run["final_estimate"].as_str().unwrap());

    let data = std::fs::read(&out).expect("our base file");
    assert_eq!(
        data.len() as u64,
        run["base_bytes"].as_u64().unwrap(),
        "base file size"
    );
    let (n_ctx, n_vocab, n_chunk, tokens) = header(&data);
    assert_eq!(n_ctx.to_string(), ctx);
    assert_eq!(n_chunk.to_string(), chunks);
    assert_eq!(n_vocab as u64, run["n_vocab"].as_u64().unwrap());
    let theirs: Vec<i64> = run["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_i64().unwrap())
        .collect();
    assert_eq!(tokens, theirs, "evaluated tokens differ from llama.cpp's");
    out
}

/// The rows (after the header) of a base file, one slice per scored position.
fn rows(data: &[u8]) -> Vec<&[u8]> {
    let (n_ctx, n_vocab, n_chunk, _) = header(data);
    let off = 20 + 4 * (n_ctx * n_chunk) as usize;
    let row = 2 * (2 * (n_vocab as usize).div_ceil(2) + 4);
    data[off..].chunks(row).collect()
}

fn kld(run: &Value, model: &Path, base_file: &Path) -> String {
    let ubatch = run["ubatch"].as_u64().unwrap().to_string();
    ok_stdout(&rustorch(&[
        "perplexity",
        "--ubatch-size",
        &ubatch,
        "-m",
        model.to_str().unwrap(),
        "--kl-divergence-base",
        base_file.to_str().unwrap(),
        "--kl-divergence",
    ]))
}

#[test]
fn llama_cpp_base_file_read_by_rustorch() {
    let Some(q8) = q8_model() else { return };
    let run = run_fixture("c8");
    let base_file = root()
        .join("tests/fixtures/kld")
        .join(run["base_file"].as_str().unwrap());
    let ours = kld(&run, q8, &base_file);
    let theirs = run["kld_stdout"].as_str().unwrap();
    let same = assert_same_figures(&ours, theirs);
    assert!(same >= 1, "{ours}");
}

#[test]
fn rustorch_base_file_is_llama_cpps_and_reads_back_small() {
    let Some(base) = base_model() else { return };
    let Some(q8) = q8_model() else { return };
    let run = run_fixture("c8");
    let ours_file = write_base(&run, &base);
    let committed = root()
        .join("tests/fixtures/kld")
        .join(run["base_file"].as_str().unwrap());
    let (a, b) = (
        std::fs::read(&ours_file).unwrap(),
        std::fs::read(&committed).unwrap(),
    );
    if recorded_arithmetic() {
        let (ra, rb) = (rows(&a), rows(&b));
        for (i, (x, y)) in ra.iter().zip(&rb).enumerate() {
            assert!(x == y, "row {i} of the base file differs from llama.cpp's");
        }
        assert!(a == b, "base file differs from llama.cpp's");
    } else {
        eprintln!("NOTE: not an AVX-512 CPU: base file bytes not compared with llama.cpp's");
    }
    // our file read back gives llama.cpp's figures
    assert_same_figures(
        &kld(&run, q8, &ours_file),
        run["kld_stdout"].as_str().unwrap(),
    );
    std::fs::remove_file(ours_file).ok();
}

#[test]
fn rustorch_base_file_is_llama_cpps_and_reads_back_with_statistics() {
    let Some(base) = base_model() else { return };
    let Some(q8) = q8_model() else { return };
    let run = run_fixture("c128");
    let ours_file = write_base(&run, &base);
    let data = std::fs::read(&ours_file).unwrap();
    let hashes: Vec<&str> = run["row_fnv1a64"]
        .as_array()
        .unwrap()
        .iter()
        .map(|h| h.as_str().unwrap())
        .collect();
    let ours_rows = rows(&data);
    assert_eq!(ours_rows.len(), hashes.len());
    if recorded_arithmetic() {
        for (i, (r, h)) in ours_rows.iter().zip(&hashes).enumerate() {
            assert_eq!(
                fnv1a64(r),
                *h,
                "row {i} of the base file differs from llama.cpp's"
            );
        }
    } else {
        eprintln!("NOTE: not an AVX-512 CPU: base file bytes not compared with llama.cpp's");
    }
    let ours = kld(&run, q8, &ours_file);
    let theirs = run["kld_stdout"].as_str().unwrap();
    assert!(ours.contains("====== KL divergence statistics ======"));
    let same = assert_same_figures(&ours, theirs);
    eprintln!(
        "{same} of {} lines identical to llama-perplexity's",
        theirs.lines().filter(|l| !l.trim().is_empty()).count()
    );

    // the base model against its own file: nothing but the 16-bit rounding
    let own = kld(&run, &base, &ours_file);
    let line = |label: &str| -> Vec<f64> {
        let l = own
            .lines()
            .find(|l| l.starts_with(label))
            .unwrap_or_else(|| panic!("no '{label}' in\n{own}"));
        numbers(l.split_once(':').unwrap().1).1
    };
    assert!(line("Mean    KLD")[0] < 1e-5, "{own}");
    assert!(line("Maximum KLD")[0] < 1e-4, "{own}");
    assert!(line("Same top p")[0] >= 99.0, "{own}");
    let (q, b) = (line("Mean PPL(Q)  ")[0], line("Mean PPL(base)")[0]);
    assert!((q - b).abs() / b < 1e-4, "{own}");
    std::fs::remove_file(ours_file).ok();
}

#[test]
fn kl_divergence_errors() {
    let Some(base) = base_model() else { return };
    let dir = scratch();
    let bad = dir.join("not-logits.bin");
    std::fs::write(&bad, b"GGUF and more bytes than a header").unwrap();
    let o = rustorch(&[
        "perplexity",
        "-m",
        base.to_str().unwrap(),
        "--kl-divergence-base",
        bad.to_str().unwrap(),
        "--kl-divergence",
    ]);
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("log-probabilities"), "{err}");

    // a file cut short: its rows are missing
    let run = run_fixture("c8");
    let full = std::fs::read(
        root()
            .join("tests/fixtures/kld")
            .join(run["base_file"].as_str().unwrap()),
    )
    .unwrap();
    let cut = dir.join("cut.bin");
    std::fs::write(&cut, &full[..full.len() - 1000]).unwrap();
    let o = rustorch(&[
        "perplexity",
        "-m",
        base.to_str().unwrap(),
        "--kl-divergence-base",
        cut.to_str().unwrap(),
        "--kl-divergence",
    ]);
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("chunk 1"), "{err}");

    std::fs::remove_file(bad).ok();
    std::fs::remove_file(cut).ok();

    // --kl-divergence without a base file
    let o = rustorch(&["perplexity", "--kl-divergence"]);
    assert!(!o.status.success());
}
