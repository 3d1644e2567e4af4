//! Constrained generation with real sampling on SmolLM2-135M: every grammar of
//! llama.cpp's `grammars/` folder (llama-cpp-python 0.3.36's vendored llama.cpp, fetched
//! by `scripts/fetch-models.sh` into `models/grammars/`) loads, and five outputs of each,
//! sampled at temperature 0.8 with fixed seeds, are accepted by an independent
//! recognizer of the grammar (`grammar::Recognizer`, an Earley parser over code points
//! that shares only the GBNF parser with the constrained sampler). JSON schemas produce
//! JSON that satisfies them; bad grammars and schemas are errors that say why.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustorch_core::gguf::GgufFile;
use rustorch_llm::engine::{generate, GenerateParams, Session, StopReason};
use rustorch_llm::grammar::{Gbnf, GrammarEngine, GrammarError, GrammarSpec, Match, Recognizer};
use rustorch_llm::sampler::{Sampler, SamplerParams};
use rustorch_llm::tokenizer::Tokenizer;
use rustorch_llm::{Model, Runtime};
use serde_json::{json, Value};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn load() -> Option<(Model, Arc<Tokenizer>)> {
    let path = root().join("models/SmolLM2-135M-Instruct.Q4_1.gguf");
    if !path.is_file() {
        eprintln!(
            "SKIPPED: {} is absent (scripts/fetch-models.sh)",
            path.display()
        );
        return None;
    }
    let gguf = Arc::new(GgufFile::open(&path).expect("open"));
    let tok = Tokenizer::from_gguf(&gguf).expect("tokenizer");
    Some((Model::load(gguf).expect("model"), Arc::new(tok)))
}

fn grammars_dir() -> Option<PathBuf> {
    let fetched = root().join("models/grammars");
    if fetched.join("json.gbnf").is_file() {
        return Some(fetched);
    }
    let home = std::env::var_os("HOME")?;
    let cached =
        Path::new(&home).join(".cache/rustorch/llama_cpp_python-0.3.36/vendor/llama.cpp/grammars");
    cached.join("json.gbnf").is_file().then_some(cached)
}

/// The generated text as bytes, cut before an incomplete UTF-8 character at the end.
fn output_text(tok: &Tokenizer, tokens: &[u32]) -> String {
    let mut bytes = Vec::new();
    for &t in tokens {
        bytes.extend(tok.token_to_piece(t, false));
    }
    match String::from_utf8(bytes) {
        Ok(s) => s,
        Err(e) => {
            let valid = e.utf8_error().valid_up_to();
            assert!(
                e.utf8_error().error_len().is_none(),
                "invalid UTF-8 inside the output: {:?}",
                e.as_bytes()
            );
            String::from_utf8(e.as_bytes()[..valid].to_vec()).expect("valid prefix")
        }
    }
}

/// Samples `n` tokens at temperature 0.8 under `spec`.
fn sample(
    model: &Model,
    tok: &Tokenizer,
    engine: &GrammarEngine,
    spec: &GrammarSpec,
    prompt: &str,
    seed: u64,
    n: usize,
) -> (String, StopReason) {
    let rt = Runtime::new(2);
    let mut session = Session::new(model, &rt, 512);
    let params = SamplerParams {
        seed: Some(seed),
        temperature: 0.8,
        ..SamplerParams::default()
    };
    let mut sampler = Sampler::new(params, tok.n_vocab());
    sampler.set_grammar(Some(engine.compile(spec).expect("compile")));
    let prompt = tok.encode(prompt, true, true).expect("encode");
    let g = generate(
        &mut session,
        tok,
        &mut sampler,
        &prompt,
        &GenerateParams {
            n_predict: Some(n),
            ..GenerateParams::default()
        },
        &mut |_| true,
    )
    .expect("generate");
    assert!(
        sampler.grammar().and_then(|c| c.error()).is_none(),
        "the grammar failed: {:?}",
        sampler.grammar().and_then(|c| c.error())
    );
    (output_text(tok, &g.tokens), g.stop)
}

#[test]
fn llama_cpp_grammars_load_and_constrain_sampling() {
    let Some(dir) = grammars_dir() else {
        eprintln!("SKIPPED: llama.cpp's grammars/ folder is absent (scripts/fetch-models.sh)");
        return;
    };
    let Some((model, tok)) = load() else { return };
    let engine = GrammarEngine::new(tok.clone());
    let prompts = [
        ("arithmetic", "An arithmetic expression: "),
        ("c", "A C program:\n"),
        ("chess", "A chess game:\n"),
        ("english", "An English sentence: "),
        ("japanese", "A Japanese sentence: "),
        ("json", "A JSON object that describes a person: "),
        ("json_arr", "A JSON array of three people: "),
        ("list", "A shopping list:\n"),
    ];
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .expect("grammars dir")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "gbnf"))
        .collect();
    files.sort();
    assert!(
        files.len() >= 8,
        "{} grammars in {}",
        files.len(),
        dir.display()
    );
    let mut summary = Vec::new();
    for f in &files {
        let name = f.file_stem().unwrap().to_string_lossy().into_owned();
        let text = std::fs::read_to_string(f).expect("read grammar");
        let g = Gbnf::parse(&text, &|_| None).unwrap_or_else(|e| panic!("{name}: {e}"));
        let rec = Recognizer::new(&g);
        let spec = GrammarSpec::Gbnf(text);
        engine
            .compile(&spec)
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        let prompt = prompts
            .iter()
            .find(|(n, _)| *n == name)
            .map_or("Output: ", |(_, p)| p);
        let mut complete = 0;
        for seed in 1..=5u64 {
            let (out, stop) = sample(&model, &tok, &engine, &spec, prompt, seed, 48);
            let m = rec.check(&out);
            if stop == StopReason::EndOfGeneration {
                assert_eq!(
                    m,
                    Match::Complete,
                    "{name} seed {seed}: {out:?} ended but is incomplete"
                );
                complete += 1;
            } else {
                assert_ne!(
                    m,
                    Match::Invalid,
                    "{name} seed {seed}: {out:?} is not in the grammar"
                );
            }
        }
        summary.push(format!("{name}: 5/5 accepted ({complete} complete)"));
    }
    eprintln!("{}", summary.join("; "));
}

#[test]
fn json_schema_outputs_satisfy_the_schema() {
    let Some((model, tok)) = load() else { return };
    let engine = GrammarEngine::new(tok.clone());
    let schema = json!({
        "$defs": {"color": {"enum": ["red", "green", "blue"]}},
        "type": "object",
        "properties": {
            "name": {"type": "string", "minLength": 2, "maxLength": 12, "pattern": "^[A-Z][a-z]+$"},
            "age": {"type": "integer", "minimum": 18, "maximum": 99},
            "color": {"$ref": "#/$defs/color"},
            "kind": {"const": "person"},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "minItems": 1, "maxItems": 3},
            "score": {"anyOf": [{"type": "number", "exclusiveMinimum": 0, "maximum": 10}, {"type": "null"}]},
            "born": {"type": "string", "format": "date"}
        },
        "required": ["name", "age", "color", "kind", "tags", "score", "born"],
        "additionalProperties": false
    });
    let spec = GrammarSpec::JsonSchema(schema);
    let date = |s: &str| {
        let b = s.as_bytes();
        b.len() == 10 && b[4] == b'-' && b[7] == b'-'
    };
    for seed in 1..=3u64 {
        let (out, stop) = sample(
            &model,
            &tok,
            &engine,
            &spec,
            "A person as JSON: ",
            seed,
            160,
        );
        assert_eq!(stop, StopReason::EndOfGeneration, "seed {seed}: {out:?}");
        let v: Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{out:?}: {e}"));
        let o = v.as_object().expect("object");
        assert_eq!(o.len(), 7, "{out}");
        let name = o["name"].as_str().expect("name");
        assert!((2..=12).contains(&name.chars().count()), "{out}");
        assert!(name.chars().next().unwrap().is_ascii_uppercase(), "{out}");
        assert!(
            name.chars().skip(1).all(|c| c.is_ascii_lowercase()),
            "{out}"
        );
        let age = o["age"].as_i64().expect("integer age");
        assert!((18..=99).contains(&age), "{out}");
        assert!(
            ["red", "green", "blue"].contains(&o["color"].as_str().unwrap()),
            "{out}"
        );
        assert_eq!(o["kind"], "person");
        let tags = o["tags"].as_array().expect("tags");
        assert!((1..=3).contains(&tags.len()), "{out}");
        assert!(
            tags.iter()
                .all(|t| t.as_str().is_some_and(|s| s.chars().count() <= 8)),
            "{out}"
        );
        match &o["score"] {
            Value::Null => {}
            Value::Number(n) => {
                let x = n.as_f64().unwrap();
                assert!(x > 0.0 && x <= 10.0, "{out}");
            }
            other => panic!("score {other}"),
        }
        assert!(date(o["born"].as_str().unwrap()), "{out}");
    }
    // any JSON object
    for seed in 1..=2u64 {
        let (out, stop) = sample(
            &model,
            &tok,
            &engine,
            &GrammarSpec::JsonObject,
            "JSON: ",
            seed,
            96,
        );
        if stop == StopReason::EndOfGeneration {
            let v: Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{out:?}: {e}"));
            assert!(v.is_object(), "{out}");
        } else {
            assert!(out.starts_with('{'), "{out}");
        }
    }
}

#[test]
fn bad_grammars_and_schemas_are_errors_that_say_why() {
    let Some((_, tok)) = load() else { return };
    let engine = GrammarEngine::new(tok);
    let gbnf = |s: &str| {
        engine
            .compile(&GrammarSpec::Gbnf(s.into()))
            .map(|_| ())
            .unwrap_err()
    };
    for (g, want) in [
        ("root ::= \"a\" | root \"a\"", "left recursion"),
        ("root ::= item+", "undefined rule 'item'"),
        ("item ::= \"a\"", "no 'root' rule"),
        ("root ::= \"a\"{5000}", "above 2000"),
        ("root ::= [a-z", "unexpected end of input"),
        ("root ::= <[99999999]>", "beyond the vocabulary"),
    ] {
        let e = gbnf(g);
        assert!(matches!(e, GrammarError::Gbnf(_)), "{g}: {e:?}");
        assert!(e.to_string().contains(want), "{g}: {e}");
    }
    let schema = |v: Value| {
        engine
            .compile(&GrammarSpec::JsonSchema(v))
            .map(|_| ())
            .unwrap_err()
            .to_string()
    };
    for (v, want) in [
        (json!({"type": "strange"}), "strange"),
        (json!({"$ref": "#/$defs/missing"}), "missing"),
        (json!({"type": "integer", "minimum": 5, "maximum": 1}), ""),
        (json!(42), "must be a JSON object"),
        (json!(false), "matches nothing"),
    ] {
        let e = schema(v.clone());
        assert!(e.contains("JSON schema"), "{v}: {e}");
        assert!(e.contains(want), "{v}: {e}");
    }
}

/// A lazy grammar lets anything through until its trigger, then constrains what follows
/// from the trigger on (the trigger may end inside a token).
#[test]
fn lazy_grammar_starts_at_its_trigger() {
    let Some((_, tok)) = load() else { return };
    let engine = GrammarEngine::new(tok.clone());
    let spec = GrammarSpec::Gbnf(r#"root ::= "<call>" [0-9]{3} "</call>""#.into());
    let mut c = engine
        .compile(&spec)
        .expect("compile")
        .lazy(vec!["<call>".into()]);
    let one = |s: &str| {
        let ids = tok.encode(s, false, false).expect("encode");
        assert_eq!(ids.len(), 1, "{s:?} is {ids:?}");
        ids[0]
    };
    let (x, seven, close) = (one("x"), one("7"), one("</"));
    assert!(!c.is_active());
    assert!(c.allows(x));
    for t in tok.encode("Sure. <call>1", false, false).expect("encode") {
        assert!(c.allows(t));
        c.accept(t, &tok.token_to_piece(t, false));
    }
    assert!(c.is_active(), "the trigger switched it on");
    // "<call>1" was fed: two more digits, then "</call>"
    assert!(c.allows(seven));
    assert!(!c.allows(x));
    assert!(!c.allows(close));
    for t in [seven, seven] {
        c.accept(t, &tok.token_to_piece(t, false));
    }
    assert!(!c.allows(seven));
    assert!(c.allows(close));
    assert!(!c.is_accepting());
    assert!(c.error().is_none());
    c.reset();
    assert!(!c.is_active(), "reset waits for the trigger again");
}
