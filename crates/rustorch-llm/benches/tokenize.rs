//! Tokenizer throughput on 1 MiB of mixed English, code and Unicode text.
//!
//! `cargo bench -p rustorch-llm --bench tokenize`
//!
//! A plain `harness = false` benchmark (criterion is too heavy to build on the shared
//! 2-core machine): for each vocabulary found under `models/`, it reports the best of a
//! few runs in wall time and in this thread's CPU time (the machine is shared, so CPU
//! time is the steadier number). With `LLAMA_TOKENIZE=/path/to/llama-tokenize` set it
//! also times llama.cpp on the same file: the run minus a run on an empty file, i.e.
//! tokenization without model loading.

use std::hint::black_box;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use rustorch_core::gguf::GgufFile;
use rustorch_llm::tokenizer::Tokenizer;

const SIZE: usize = 1 << 20;
const RUNS: usize = 5;

/// Deterministic xorshift.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn pick<'a>(&mut self, xs: &[&'a str]) -> &'a str {
        xs[(self.next() % xs.len() as u64) as usize]
    }
}

/// 1 MiB of prose, code, numbers and non-Latin scripts.
fn corpus() -> String {
    const WORDS: &[&str] = &[
        "the",
        "of",
        "and",
        "to",
        "in",
        "is",
        "that",
        "for",
        "it",
        "as",
        "was",
        "with",
        "be",
        "by",
        "on",
        "not",
        "he",
        "I",
        "this",
        "are",
        "or",
        "his",
        "from",
        "at",
        "which",
        "but",
        "have",
        "an",
        "had",
        "they",
        "you",
        "were",
        "their",
        "one",
        "all",
        "we",
        "can",
        "her",
        "has",
        "there",
        "been",
        "if",
        "more",
        "when",
        "will",
        "would",
        "who",
        "so",
        "no",
        "tokenizer",
        "model",
        "inference",
        "quantization",
        "attention",
        "transformer",
        "throughput",
        "latency",
        "benchmark",
        "vocabulary",
        "merges",
        "weights",
        "layer",
        "don't",
        "it's",
        "we're",
        "they'll",
        "I've",
        "Hello",
        "World",
        "Rust",
        "GGUF",
        "naïve",
        "café",
        "résumé",
        "Zürich",
        "façade",
        "coöperate",
    ];
    const CODE: &[&str] = &[
        "fn main() {\n    let mut total: u64 = 0;\n",
        "\tfor (i, x) in xs.iter().enumerate() {\n\t\ttotal += x * i as u64;\n\t}\n",
        "def forward(self, x):\n    return self.proj(F.gelu(self.fc(x)))\n",
        "if (ptr == NULL) { return -EINVAL; }\n",
        "    # TODO: handle the empty case\n",
        "const std::vector<int32_t> ids = {1, 2, 3};\n",
        "SELECT name, COUNT(*) FROM users WHERE age >= 21 GROUP BY name;\n",
        "{\"key\": [1, 2.5, null], \"nested\": {\"a\": true}}\n",
        "}\n\n",
    ];
    const OTHER: &[&str] = &[
        "Быстрая коричневая лиса прыгает через ленивую собаку.",
        "我想在apple工作，今天天气很好。",
        "日本語のテキストとカタカナ。",
        "한국어 텍스트입니다.",
        "Ελληνικά γράμματα και αριθμοί.",
        "العربية نص قصير",
        "🚀 🦙 ✅ 😶‍🌫️ 👨‍👩‍👧‍👦",
        "e\u{301} a\u{308} क्षि ที่",
    ];
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    let mut s = String::with_capacity(SIZE + 256);
    while s.len() < SIZE {
        match rng.next() % 10 {
            0..=5 => {
                let n = 8 + rng.next() % 24;
                for i in 0..n {
                    if i > 0 {
                        s.push(' ');
                    }
                    s.push_str(rng.pick(WORDS));
                    if rng.next().is_multiple_of(11) {
                        s.push_str(&format!(" {}", rng.next() % 100_000));
                    }
                }
                s.push_str(if rng.next().is_multiple_of(4) {
                    ".\n\n"
                } else {
                    ". "
                });
            }
            6..=7 => {
                s.push_str(rng.pick(CODE));
                s.push_str(&format!(
                    "let v{} = {} + {};\n",
                    rng.next() % 1000,
                    rng.next() % 9999,
                    rng.next() % 777
                ));
            }
            _ => {
                s.push_str(rng.pick(OTHER));
                // Random CJK so the text is not just a few repeated words.
                for _ in 0..(rng.next() % 12) {
                    s.push(char::from_u32(0x4E00 + (rng.next() % 0x5000) as u32).unwrap_or('字'));
                }
                s.push('\n');
            }
        }
    }
    let mut end = SIZE;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    s.truncate(end);
    s
}

/// CPU time of this thread (Linux), else zero.
fn thread_cpu() -> Duration {
    let Ok(stat) = std::fs::read_to_string("/proc/thread-self/stat") else {
        return Duration::ZERO;
    };
    // Fields after the command name, which is parenthesized.
    let rest = stat.rsplit_once(')').map(|x| x.1).unwrap_or("");
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| f.get(i).and_then(|x| x.parse::<u64>().ok()).unwrap_or(0);
    // utime and stime are fields 14 and 15 of stat(5), i.e. 11 and 12 after the name.
    Duration::from_millis((ticks(11) + ticks(12)) * 10)
}

fn time_llama_tokenize(bin: &str, model: &Path, file: &Path, empty: &Path) -> Option<(f64, f64)> {
    let run = |f: &Path| -> Option<f64> {
        let mut best = f64::MAX;
        for _ in 0..3 {
            let t = Instant::now();
            let out = Command::new(bin)
                .arg("-m")
                .arg(model)
                .arg("-f")
                .arg(f)
                .args([
                    "--ids",
                    "--log-disable",
                    "--no-escape",
                    "--no-parse-special",
                ])
                .output()
                .ok()?;
            if !out.status.success() {
                return None;
            }
            best = best.min(t.elapsed().as_secs_f64());
        }
        Some(best)
    };
    let full = run(file)?;
    let load = run(empty)?;
    Some((full, full - load))
}

fn main() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models");
    let candidates = [
        "vocab/ggml-vocab-qwen2.gguf",
        "vocab/ggml-vocab-llama-spm.gguf",
        "qwen2.5-coder-0.5b-instruct-q4km.gguf",
        "gemma-3-270m-q4_k_m.gguf",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
    ];
    let text = corpus();
    let dir = std::env::temp_dir();
    let file: PathBuf = dir.join("rustorch-tokenize-bench.txt");
    let empty: PathBuf = dir.join("rustorch-tokenize-bench-empty.txt");
    std::fs::write(&file, &text).expect("write bench input");
    std::fs::write(&empty, "").expect("write empty input");
    println!(
        "input: {} ({} bytes, {} lines)",
        file.display(),
        text.len(),
        text.lines().count()
    );
    let llama = std::env::var("LLAMA_TOKENIZE").ok();

    for rel in candidates {
        let path = root.join(rel);
        if !path.is_file() {
            println!("{rel}: not found, skipped");
            continue;
        }
        let t = Instant::now();
        let gguf = GgufFile::open(&path).expect("open");
        let tok = Tokenizer::from_gguf(&gguf).expect("tokenizer");
        let load = t.elapsed();

        let (mut best_wall, mut best_cpu, mut n) = (f64::MAX, f64::MAX, 0);
        for _ in 0..RUNS {
            let (t, c) = (Instant::now(), thread_cpu());
            let ids = black_box(tok.encode(black_box(&text), false, false).expect("encode"));
            best_wall = best_wall.min(t.elapsed().as_secs_f64());
            best_cpu = best_cpu.min((thread_cpu() - c).as_secs_f64());
            n = ids.len();
        }
        let mib = text.len() as f64 / (1 << 20) as f64;
        print!(
            "{rel:<40} load {:>6.3} s | encode 1 MiB: wall {best_wall:.3} s, cpu {best_cpu:.3} s \
             ({:.1} MiB/s), {n} tokens",
            load.as_secs_f64(),
            mib / best_wall
        );
        if let Some(bin) = &llama {
            match time_llama_tokenize(bin, &path, &file, &empty) {
                Some((full, tok_only)) => {
                    print!(" | llama-tokenize -f: {full:.3} s total, {tok_only:.3} s without load")
                }
                None => print!(" | llama-tokenize failed"),
            }
        }
        println!();
    }
}
