//! Chat templates against fixtures recorded by scripts/record_chat_fixtures.py:
//! the models' own templates rendered by Python's jinja2 the way transformers does,
//! feature probes rendered the same way, and llama.cpp's built-in formats rendered by
//! libllama. Every comparison is exact string equality.

use std::path::{Path, PathBuf};

use rustorch_core::gguf::GgufFile;
use rustorch_llm::chat::{builtin_names, ChatError, ChatMessage, ChatTemplate, TemplateOrigin};
use serde::Deserialize;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn fixture_dir() -> PathBuf {
    root().join("tests/fixtures/chat")
}

#[derive(Deserialize)]
struct Case {
    name: String,
    messages: Vec<ChatMessage>,
    add_generation_prompt: bool,
    expected: String,
}

#[derive(Deserialize)]
struct ModelFixture {
    model: String,
    template: Option<String>,
    builtin: Option<String>,
    bos_token: String,
    eos_token: String,
    cases: Vec<Case>,
}

#[derive(Deserialize)]
struct BuiltinFixture {
    templates: std::collections::BTreeMap<String, Vec<Case>>,
}

#[derive(Deserialize)]
struct Feature {
    template: String,
    messages: Vec<ChatMessage>,
    add_generation_prompt: bool,
    bos_token: String,
    eos_token: String,
    expected: Option<String>,
    error: Option<String>,
}

#[derive(Deserialize)]
struct FeatureFixture {
    templates: std::collections::BTreeMap<String, Feature>,
}

fn read_json<T: serde::de::DeserializeOwned>(name: &str) -> T {
    let path = fixture_dir().join(name);
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("parsing {}: {e}", path.display()))
}

const MODELS: &[&str] = &[
    "SmolLM2-135M-Instruct.Q4_1",
    "qwen2.5-coder-0.5b-instruct-q4km",
    "qwen2.5-coder-1.5b-instruct-q4_k_m",
    "gemma-3-270m-q4_k_m",
];

fn template_for(f: &ModelFixture) -> ChatTemplate {
    match (&f.template, &f.builtin) {
        (Some(src), _) => ChatTemplate::from_source(src.clone(), &f.bos_token, &f.eos_token)
            .unwrap_or_else(|e| panic!("{}: {e}", f.model)),
        (None, Some(name)) => ChatTemplate::builtin(name)
            .unwrap_or_else(|e| panic!("{}: {e}", f.model))
            .with_special_tokens(&f.bos_token, &f.eos_token),
        (None, None) => panic!("{}: fixture has neither template nor builtin", f.model),
    }
}

fn check_cases(label: &str, tmpl: &ChatTemplate, cases: &[Case]) -> usize {
    for c in cases {
        let got = tmpl
            .render(&c.messages, c.add_generation_prompt)
            .unwrap_or_else(|e| panic!("{label}/{}: {e}", c.name));
        assert_eq!(got, c.expected, "{label}/{}", c.name);
    }
    cases.len()
}

#[test]
fn model_templates_match_jinja2() {
    let mut n = 0;
    for model in MODELS {
        let f: ModelFixture = read_json(&format!("{model}.json"));
        assert!(f.cases.len() >= 10, "{model}: too few cases");
        n += check_cases(model, &template_for(&f), &f.cases);
    }
    assert_eq!(n, 40);
}

#[test]
fn default_system_prompts_come_out_as_jinja2_renders_them() {
    let f: ModelFixture = read_json("SmolLM2-135M-Instruct.Q4_1.json");
    let out = template_for(&f)
        .render(&[ChatMessage::user("Hi")], true)
        .unwrap();
    assert_eq!(
        out,
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n\
         <|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    );
    let f: ModelFixture = read_json("qwen2.5-coder-0.5b-instruct-q4km.json");
    let out = template_for(&f)
        .render(&[ChatMessage::user("Hi")], false)
        .unwrap();
    assert_eq!(
        out,
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n\
         <|im_start|>user\nHi<|im_end|>\n"
    );
}

#[test]
fn builtins_match_llama_cpp() {
    let f: BuiltinFixture = read_json("builtins.json");
    let mut names: Vec<&str> = f.templates.keys().map(String::as_str).collect();
    let mut ours = builtin_names();
    names.sort_unstable();
    ours.sort_unstable();
    assert_eq!(names, ours, "fixture and built-in lists differ");
    let mut n = 0;
    for (name, cases) in &f.templates {
        let t = ChatTemplate::builtin(name).unwrap();
        assert_eq!(
            t.origin(),
            &TemplateOrigin::Builtin(builtin_names().into_iter().find(|b| b == name).unwrap())
        );
        n += check_cases(name, &t, cases);
    }
    assert_eq!(n, 150);
}

#[test]
fn features_match_jinja2() {
    let f: FeatureFixture = read_json("features.json");
    assert!(f.templates.len() >= 8);
    for (name, feat) in &f.templates {
        let t = ChatTemplate::from_source(feat.template.clone(), &feat.bos_token, &feat.eos_token)
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        let got = t.render(&feat.messages, feat.add_generation_prompt);
        match (&feat.expected, &feat.error) {
            (Some(expected), _) => {
                let got = got.unwrap_or_else(|e| panic!("{name}: {e}"));
                assert_eq!(&got, expected, "{name}");
            }
            (None, Some(message)) => {
                let err = got.expect_err(name);
                assert!(matches!(err, ChatError::Render(_)), "{name}: {err:?}");
                assert!(err.to_string().contains(message.as_str()), "{name}: {err}");
            }
            (None, None) => panic!("{name}: fixture has neither expected nor error"),
        }
    }
}

#[test]
fn from_gguf_reads_the_models_templates() {
    for model in MODELS {
        let path = root().join("models").join(format!("{model}.gguf"));
        if !path.exists() {
            eprintln!("skipping {model}: {} absent", path.display());
            continue;
        }
        let gguf = GgufFile::open(&path).unwrap();
        let f: ModelFixture = read_json(&format!("{model}.json"));
        let t = ChatTemplate::from_gguf(&gguf).unwrap();
        match (&f.template, t) {
            (Some(src), Some(t)) => {
                assert_eq!(t.source(), src, "{model}");
                assert_eq!(t.bos_token(), f.bos_token, "{model}");
                assert_eq!(t.eos_token(), f.eos_token, "{model}");
                assert_eq!(t.origin(), &TemplateOrigin::Gguf);
                check_cases(model, &t, &f.cases);
            }
            (None, None) => {}
            (want, got) => panic!(
                "{model}: fixture template {:?}, from_gguf {:?}",
                want.is_some(),
                got
            ),
        }
    }
}

#[test]
fn unknown_builtin_lists_known_names() {
    let err = ChatTemplate::builtin("vicuna-9000").unwrap_err();
    let msg = err.to_string();
    assert!(msg.contains("vicuna-9000"), "{msg}");
    for name in [
        "chatml", "llama2", "llama3", "zephyr", "mistral", "gemma", "phi3",
    ] {
        assert!(msg.contains(name), "{msg} lacks {name}");
    }
    let err = ChatTemplate::from_name_or_file("/no/such/template.jinja", "", "").unwrap_err();
    assert!(matches!(err, ChatError::UnknownTemplate { .. }), "{err:?}");
}

#[test]
fn template_from_file_and_syntax_errors() {
    let dir = std::env::temp_dir().join(format!("rustorch-chat-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("t.jinja");
    std::fs::write(
        &path,
        "{% for m in messages %}[{{ m.role }}]{{ m.content }}\n{% endfor %}",
    )
    .unwrap();
    let t = ChatTemplate::from_name_or_file(path.to_str().unwrap(), "<s>", "</s>").unwrap();
    assert_eq!(t.origin(), &TemplateOrigin::File(path.clone()));
    assert_eq!(
        t.render(&[ChatMessage::user("a"), ChatMessage::assistant("b")], true)
            .unwrap(),
        "[user]a\n[assistant]b\n"
    );
    std::fs::remove_dir_all(&dir).ok();

    let err = ChatTemplate::from_source("{% for m in messages %}", "", "").unwrap_err();
    assert!(matches!(err, ChatError::Syntax(_)), "{err:?}");
    let err = ChatTemplate::from_file("/no/such/file.jinja", "", "").unwrap_err();
    assert!(matches!(err, ChatError::Io { .. }), "{err:?}");
}

#[test]
fn strftime_now_and_generation_tags() {
    let t = ChatTemplate::from_source(
        "{{ strftime_now('%Y') }}|{{ strftime_now('%d %B %Y') }}",
        "",
        "",
    )
    .unwrap();
    let got = t.render(&[], false).unwrap();
    let now = chrono::Local::now();
    let year = now.format("%Y").to_string();
    let (y, rest) = got.split_once('|').unwrap();
    assert_eq!(y, year);
    assert!(rest.ends_with(&year), "{got}");
    // A bad format is an error, not a panic.
    let t = ChatTemplate::from_source("{{ strftime_now('%Q%') }}", "", "").unwrap();
    assert!(t.render(&[], false).is_err());

    // transformers' {% generation %} marker renders its body.
    let t = ChatTemplate::from_source(
        "{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}<{{ m.content }}>{% endgeneration %}{% else %}{{ m.content }}{% endif %}{% endfor %}",
        "",
        "",
    )
    .unwrap();
    let out = t
        .render(
            &[ChatMessage::user("q"), ChatMessage::assistant("a")],
            false,
        )
        .unwrap();
    assert_eq!(out, "q<a>");
}

#[test]
fn render_json_accepts_tools_and_extra_fields() {
    let f: ModelFixture = read_json("qwen2.5-coder-0.5b-instruct-q4km.json");
    let t = template_for(&f);
    let messages = serde_json::json!([{"role": "user", "content": "Weather in Paris?"}]);
    let extra = serde_json::json!({"tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"city": "string"}}}]});
    let out = t.render_json(&messages, true, Some(&extra)).unwrap();
    // serde_json::Value keeps keys sorted unless its preserve_order feature is on.
    assert!(out.contains("\"name\": \"get_weather\""), "{out}");
    // From JSON text the key order is kept, as Python's json.dumps(tool) writes it.
    let out2 = t
        .render_json_str(
            r#"[{"role": "user", "content": "Weather in Paris?"}]"#,
            true,
            Some(r#"{"tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"city": "string"}}}]}"#),
        )
        .unwrap();
    assert!(out2.contains(
        "<tools>\n{\"type\": \"function\", \"function\": {\"name\": \"get_weather\", \"parameters\": {\"city\": \"string\"}}}\n</tools>"
    ), "{out2}");
    assert_eq!(out2, out.replace("{\"function\": {\"name\": \"get_weather\", \"parameters\": {\"city\": \"string\"}}, \"type\": \"function\"}", "{\"type\": \"function\", \"function\": {\"name\": \"get_weather\", \"parameters\": {\"city\": \"string\"}}}"));
    assert!(matches!(
        t.render_json_str("[", true, None),
        Err(ChatError::BadJson(_))
    ));
    assert!(matches!(
        t.render_json_str("[]", true, Some("[1]")),
        Err(ChatError::BadContext)
    ));
    assert!(out.ends_with("<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n"));
    assert!(matches!(
        t.render_json(&messages, true, Some(&serde_json::json!([1]))),
        Err(ChatError::BadContext)
    ));
    // Without tools the JSON path renders exactly like `render`.
    let plain = t
        .render(&[ChatMessage::user("Weather in Paris?")], true)
        .unwrap();
    assert_eq!(t.render_json(&messages, true, None).unwrap(), plain);
}

#[test]
fn stop_strings_and_end_of_turn() {
    let cases: &[(&str, &[&str])] = &[
        ("chatml", &["<|im_end|>"]),
        ("llama3", &["<|eot_id|>"]),
        ("gemma", &["<end_of_turn>"]),
        ("phi3", &["<|end|>"]),
        ("zephyr", &["<|endoftext|>", "</s>"]),
        ("llama2", &["</s>"]),
        ("mistral-v7", &["</s>"]),
    ];
    for (name, stops) in cases {
        let t = ChatTemplate::builtin(name).unwrap();
        assert_eq!(t.stop_strings(), *stops, "{name}");
        assert!(t.is_end_of_turn(stops[0]));
        assert!(!t.is_end_of_turn("hello"));
        assert!(!t.is_end_of_turn(""));
    }
    // Gemma's built-in with the model's EOS text: both end a turn.
    let t = ChatTemplate::builtin("gemma")
        .unwrap()
        .with_special_tokens("<bos>", "<eos>");
    assert_eq!(t.stop_strings(), ["<end_of_turn>", "<eos>"]);

    // Templates from GGUFs: detected from the source, plus EOS.
    let f: ModelFixture = read_json("qwen2.5-coder-0.5b-instruct-q4km.json");
    let t = template_for(&f);
    assert_eq!(t.stop_strings(), ["<|im_end|>"]);
    assert_eq!(t.find_stop("The answer is 4.<|im_end|>\n"), Some(16));
    assert_eq!(t.find_stop("no stop here"), None);
    assert_eq!(t.partial_stop_len("The answer<|im_"), 5);
    assert_eq!(t.partial_stop_len("The answer <"), 1);
    assert_eq!(t.partial_stop_len("The answer"), 0);
    let t = ChatTemplate::from_source("{{ messages[0].content }}", "<s>", "</s>").unwrap();
    assert_eq!(t.stop_strings(), ["</s>"]);
}

#[test]
fn render_suffix_and_special_affixes() {
    let f: ModelFixture = read_json("SmolLM2-135M-Instruct.Q4_1.json");
    let t = template_for(&f);
    let history = vec![ChatMessage::user("Hi"), ChatMessage::assistant("Hello!")];
    let new = ChatMessage::user("Bye");
    let suffix = t.render_suffix(&history, &new, true).unwrap().unwrap();
    assert_eq!(
        suffix,
        "<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n"
    );
    let full = t
        .render(&[history.clone(), vec![new.clone()]].concat(), true)
        .unwrap();
    assert_eq!(full, t.render(&history, false).unwrap() + &suffix);
    // First message: the suffix is the whole render.
    let first = t.render_suffix(&[], &new, true).unwrap().unwrap();
    assert_eq!(first, t.render(std::slice::from_ref(&new), true).unwrap());
    // A template that rewrites earlier turns gives None.
    let t2 = ChatTemplate::from_source(
        "{{ messages | length }}:{% for m in messages %}{{ m.content }}{% endfor %}",
        "",
        "",
    )
    .unwrap();
    assert_eq!(t2.render_suffix(&history, &new, false).unwrap(), None);

    let t3 = ChatTemplate::from_source(
        "{{ bos_token }}{{ messages[0].content }}{{ eos_token }}",
        "<s>",
        "</s>",
    )
    .unwrap();
    let out = t3.render(&[ChatMessage::user("x")], false).unwrap();
    assert_eq!(out, "<s>x</s>");
    assert_eq!(t3.strip_special_affixes(&out, true, false), "x</s>");
    assert_eq!(t3.strip_special_affixes(&out, true, true), "x");
    assert_eq!(t3.strip_special_affixes(&out, false, false), "<s>x</s>");
}

#[test]
fn chat_message_json_round_trip() {
    let msgs = vec![
        ChatMessage::system("sys"),
        ChatMessage::user("héllo\n\"x\""),
        ChatMessage::assistant("ok"),
    ];
    let json = serde_json::to_string(&msgs).unwrap();
    assert_eq!(
        json,
        r#"[{"role":"system","content":"sys"},{"role":"user","content":"héllo\n\"x\""},{"role":"assistant","content":"ok"}]"#
    );
    let back: Vec<ChatMessage> = serde_json::from_str(&json).unwrap();
    assert_eq!(back, msgs);
}
