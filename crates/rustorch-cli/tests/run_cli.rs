//! `rustorch run` end to end: answers, llama.cpp chat parity, seeds, and errors.

use std::path::PathBuf;
use std::process::{Command, Output};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn model(file: &str) -> Option<PathBuf> {
    let p = root().join("models").join(file);
    if p.exists() {
        Some(p)
    } else {
        eprintln!(
            "SKIPPED: {} is absent (run scripts/fetch-models.sh --all)",
            p.display()
        );
        None
    }
}

const SMOL: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

fn rustorch(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_rustorch"))
        .args(args)
        .current_dir(root())
        .output()
        .expect("run rustorch")
}

fn stdout(o: &Output) -> String {
    String::from_utf8(o.stdout.clone()).expect("utf-8 stdout")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[test]
fn capital_of_france_on_the_default_model() {
    if model(SMOL).is_none() {
        return;
    }
    // no -m: the default model
    let o = rustorch(&[
        "run",
        "-p",
        "The capital of France is",
        "-n",
        "16",
        "--temp",
        "0",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let text = stdout(&o);
    assert!(text.contains("Paris"), "{text:?}");
    assert!(!text.contains("[end of text]"));
    // timings go to stderr, like llama.cpp's
    let err = stderr(&o);
    assert!(
        err.contains("prompt eval time") && err.contains("tokens per second"),
        "{err}"
    );
}

/// Runs `rustorch run --chat` on every case of tests/fixtures/chat_answers.json
/// (recorded from `llama-completion -cnv -st --jinja` by scripts/record_chat_answers.py)
/// and returns (case, our prompt tokens, our answer) for the models present.
fn chat_cases() -> Vec<(serde_json::Value, Vec<u64>, String)> {
    let raw = std::fs::read(root().join("tests/fixtures/chat_answers.json")).expect("fixture");
    let cases: serde_json::Value = serde_json::from_slice(&raw).expect("json");
    let mut out = Vec::new();
    for c in cases.as_array().expect("cases") {
        let file = c["model"].as_str().expect("model");
        let Some(path) = model(file) else { continue };
        let n = c["n_predict"].as_u64().expect("n").to_string();
        let mut args = vec![
            "run",
            "-m",
            path.to_str().expect("path"),
            "--chat",
            "--temp",
            "0",
            "-n",
            &n,
            "--verbose-prompt",
            "-p",
            c["prompt"].as_str().expect("prompt"),
        ];
        if let Some(s) = c["system"].as_str() {
            args.extend(["-sys", s]);
        }
        let o = rustorch(&args);
        assert!(o.status.success(), "{}", stderr(&o));
        let err = stderr(&o);
        let line = err
            .lines()
            .find(|l| l.contains("prompt tokens"))
            .expect("--verbose-prompt line");
        let list = &line[line.find('[').expect("[")..];
        let ours: Vec<u64> = serde_json::from_str(list).expect("token list");
        out.push((
            c.clone(),
            ours,
            stdout(&o).trim_end_matches('\n').to_string(),
        ));
    }
    out
}

/// The chat template renders, and the tokenizer encodes, exactly llama.cpp's prompt tokens
/// (with the template's default system prompt when `-sys` is absent).
#[test]
fn chat_prompt_tokens_equal_llama_cpp() {
    let cases = chat_cases();
    for (c, ours, _) in &cases {
        let expected: Vec<u64> = c["prompt_tokens"]
            .as_array()
            .expect("tokens")
            .iter()
            .map(|t| t.as_u64().expect("id"))
            .collect();
        assert_eq!(
            ours, &expected,
            "{}: rendered prompt tokens differ",
            c["model"]
        );
    }
    eprintln!(
        "{} chat prompts tokenized exactly as llama.cpp does",
        cases.len()
    );
}

/// The acceptance questions: "Paris" from SmolLM2 with the system prompt and from
/// Qwen2.5-1.5B without one (its template's default system prompt).
#[test]
fn chat_answers_paris() {
    for (c, _, answer) in chat_cases() {
        if c["prompt"] == "What is the capital of France?"
            && (c["system"].is_string() || c["model"].as_str().is_some_and(|m| m.contains("1.5b")))
        {
            assert!(answer.contains("Paris"), "{}: {answer:?}", c["model"]);
        }
    }
}

fn check_chat_answers(smollm2: bool) {
    for (c, _, answer) in chat_cases() {
        if c["model"]
            .as_str()
            .is_some_and(|m| m.starts_with("SmolLM2"))
            != smollm2
        {
            continue;
        }
        assert_eq!(
            answer,
            c["answer"].as_str().expect("answer"),
            "{} {:?}",
            c["model"],
            c["system"]
        );
    }
}

/// Greedy chat answers equal llama.cpp's (`llama-completion -cnv -st --jinja`) word for word:
/// SmolLM2, whose forward pass is bit-identical to llama.cpp's.
#[test]
fn chat_answers_equal_llama_cpp_smollm2() {
    check_chat_answers(true);
}

/// The same for the Qwen models.
#[test]
fn chat_answers_equal_llama_cpp_qwen() {
    check_chat_answers(false);
}

#[test]
fn seeded_runs_repeat_and_seeds_differ() {
    if model(SMOL).is_none() {
        return;
    }
    let go = |seed: &str, threads: &str| {
        let o = rustorch(&[
            "run",
            "-p",
            "Once upon a time",
            "-n",
            "24",
            "--temp",
            "0.8",
            "-s",
            seed,
            "-t",
            threads,
        ]);
        assert!(o.status.success(), "{}", stderr(&o));
        stdout(&o)
    };
    let a = go("42", "2");
    assert_eq!(a, go("42", "2"));
    assert_eq!(a, go("42", "2"));
    assert_eq!(a, go("42", "1"), "thread count changed a seeded run");
    let b = go("43", "2");
    assert_ne!(a, b, "different seeds gave the same text");
}

#[test]
fn bad_input_gives_clear_errors() {
    let o = rustorch(&["run", "-m", "models/no-such-model.gguf", "-p", "hi"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("not found"), "{}", stderr(&o));

    let o = rustorch(&["run", "-f", "/nonexistent/prompt.txt"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).contains("cannot read prompt file"),
        "{}",
        stderr(&o)
    );

    if model(SMOL).is_none() {
        return;
    }
    let o = rustorch(&["run", "--chat", "--chat-template", "nonsense", "-p", "hi"]);
    assert_eq!(o.status.code(), Some(1));
    let err = stderr(&o);
    assert!(err.contains("nonsense") && err.contains("chatml"), "{err}");

    let o = rustorch(&["run", "-c", "32", "-n", "100", "-p", "hello"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).contains("exceeds the context size 32"),
        "{}",
        stderr(&o)
    );

    let long = "word ".repeat(100);
    let o = rustorch(&["run", "-c", "16", "-p", &long]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).contains("context holds only 16"),
        "{}",
        stderr(&o)
    );
    assert!(!stderr(&o).contains("panicked"));
}
