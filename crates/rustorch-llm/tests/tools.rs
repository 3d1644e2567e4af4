//! Tool calling: each format's grammar accepts well-formed calls and refuses calls of
//! unknown tools, arguments that break the tool's schema and text where a call is
//! required; what it accepts parses back into the call; and each template family renders
//! tools, earlier calls and tool results (Qwen2.5's GGUF template, Llama 3.2's and
//! Mistral Nemo's from tests/fixtures/chat/templates/, copied from llama.cpp's
//! models/templates/, and SmolLM2's through the generic format).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustorch_core::gguf::GgufFile;
use rustorch_llm::chat::ChatTemplate;
use rustorch_llm::grammar::{Constraint, GrammarEngine, GrammarSpec, Trigger};
use rustorch_llm::tokenizer::Tokenizer;
use rustorch_llm::tools::{Tool, ToolCalling, ToolChoice, ToolFormat, ToolGrammarError};
use serde_json::{json, Value};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn open(name: &str) -> Option<(Arc<GgufFile>, Arc<Tokenizer>)> {
    let path = root().join("models").join(name);
    if !path.is_file() {
        eprintln!(
            "SKIPPED: {} is absent (scripts/fetch-models.sh)",
            path.display()
        );
        return None;
    }
    let gguf = Arc::new(GgufFile::open(&path).expect("open"));
    let tok = Tokenizer::from_gguf(&gguf).expect("tokenizer");
    Some((gguf, Arc::new(tok)))
}

fn tools() -> Vec<Tool> {
    vec![
        Tool {
            name: "get_weather".into(),
            description: Some("Current weather of a city".into()),
            parameters: json!({
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "days": {"type": "integer", "minimum": 1, "maximum": 7},
                },
                "required": ["city"],
                "additionalProperties": false,
            }),
        },
        Tool {
            name: "get_time".into(),
            description: None,
            parameters: json!({"type": "object", "properties": {"zone": {"type": "string"}}}),
        },
    ]
}

/// Whether the constraint lets `text` through to a complete end.
fn accepts(c: &mut Constraint, tok: &Tokenizer, text: &str) -> bool {
    c.reset();
    for t in tok.encode(text, false, true).expect("encode") {
        if !c.allows(t) {
            return false;
        }
        c.accept(t, &tok.token_to_piece(t, false));
    }
    c.error().is_none() && c.is_accepting()
}

#[test]
fn call_grammars_accept_calls_and_refuse_bad_ones() {
    let Some((_, tok)) = open("qwen2.5-coder-0.5b-instruct-q4km.gguf") else {
        return;
    };
    let engine = GrammarEngine::new(tok.clone());
    use ToolChoice::{Auto, Function, Required};
    use ToolFormat::{Generic, Hermes, Llama3, Mistral};
    let weather = r#"{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}"#;
    // (format, choice, text, accepted, the call it holds)
    let cases: Vec<(ToolFormat, ToolChoice, String, bool, Option<&str>)> = vec![
        (Hermes, Auto, format!("Let me look.\n<tool_call>\n{weather}\n</tool_call>"), true, Some("get_weather")),
        (Hermes, Auto, "Paris is sunny in spring.".into(), true, None),
        (Hermes, Auto, "```json\n{\n  \"name\": \"get_weather\",\n  \"arguments\": {\"city\": \"Paris\"}\n}\n```".into(), true, Some("get_weather")),
        (Hermes, Auto, "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": 12}}\n</tool_call>".into(), false, None),
        (Hermes, Auto, "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"days\": 9}}\n</tool_call>".into(), false, None),
        (Hermes, Auto, "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"town\": \"Paris\"}}\n</tool_call>".into(), false, None),
        (Hermes, Auto, "<tool_call>\n{\"name\": \"send_mail\", \"arguments\": {}}\n</tool_call>".into(), false, None),
        (Hermes, Required, format!("<tool_call>\n{weather}\n</tool_call>"), true, Some("get_weather")),
        (Hermes, Required, format!("Sure. <tool_call>\n{weather}\n</tool_call>"), false, None),
        (Hermes, Required, "Paris is sunny.".into(), false, None),
        (Hermes, Function("get_time".into()), "<tool_call>\n{\"name\": \"get_time\", \"arguments\": {\"zone\": \"UTC\"}}\n</tool_call>".into(), true, Some("get_time")),
        (Hermes, Function("get_time".into()), format!("<tool_call>\n{weather}\n</tool_call>"), false, None),
        (Llama3, Auto, "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Oslo\"}}".into(), true, Some("get_weather")),
        (Llama3, Auto, "{\"name\": \"get_weather\", \"parameters\": {\"city\": false}}".into(), false, None),
        (Mistral, Auto, "[TOOL_CALLS][{\"name\": \"get_time\", \"arguments\": {}, \"id\": \"abc123XYZ\"}]".into(), true, Some("get_time")),
        (Mistral, Auto, "[TOOL_CALLS][{\"name\": \"get_time\", \"arguments\": {}, \"id\": \"abc\"}]".into(), false, None),
        (Generic, Auto, "{\"response\": \"Hello there\"}".into(), true, None),
        (Generic, Auto, "{\"tool_call\": {\"name\": \"get_weather\", \"arguments\": {\"city\": \"Rome\"}}}".into(), true, Some("get_weather")),
        (Generic, Auto, "Hello there".into(), false, None),
        (Generic, Required, "{\"response\": \"Hello there\"}".into(), false, None),
    ];
    for (format, choice, text, want, call) in cases {
        let calling = ToolCalling::new(format, tools(), choice.clone(), false, &tok);
        let g = calling.grammar().expect("schemas").expect("a grammar");
        let lazy = !g.triggers.is_empty();
        assert_eq!(
            lazy,
            choice == Auto && format != Generic,
            "{format:?} {choice:?}"
        );
        let mut c = engine
            .compile(&g.spec)
            .unwrap_or_else(|e| panic!("{format:?} {choice:?}: {e}"))
            .lazy_on(g.triggers);
        assert_eq!(
            accepts(&mut c, &tok, &text),
            want,
            "{format:?} {choice:?}: {text}"
        );
        if want {
            let mut p = calling.parser();
            p.push(None, &text);
            let parsed = p.result();
            let names: Vec<&str> = parsed.calls.iter().map(|c| c.name.as_str()).collect();
            assert_eq!(names, call.into_iter().collect::<Vec<_>>(), "{text}");
            for c in &parsed.calls {
                let args: Value = serde_json::from_str(&c.arguments).expect("arguments are JSON");
                assert!(args.is_object(), "{}", c.arguments);
            }
        }
    }
    // with parallel calls, Hermes takes several tagged calls
    let calling = ToolCalling::new(Hermes, tools(), Required, true, &tok);
    let g = calling.grammar().expect("schemas").expect("a grammar");
    let mut c = engine
        .compile(&g.spec)
        .expect("compile")
        .lazy_on(g.triggers);
    let two = format!(
        "<tool_call>\n{weather}\n</tool_call>\n<tool_call>\n{{\"name\": \"get_time\", \"arguments\": {{}}}}\n</tool_call>"
    );
    assert!(accepts(&mut c, &tok, &two));
    let calling = ToolCalling::new(Hermes, tools(), Required, false, &tok);
    let g = calling.grammar().expect("schemas").expect("a grammar");
    let mut c = engine.compile(&g.spec).expect("compile");
    assert!(!accepts(&mut c, &tok, &two), "one call only");
    // no grammar for tool_choice none; a schema llguidance refuses is an error naming it
    let none = ToolCalling::new(Hermes, tools(), ToolChoice::None, false, &tok);
    assert!(none.grammar().expect("schemas").is_none());
    assert_eq!(
        none.banned_tokens(),
        vec![tok.find_token("<tool_call>").expect("token")]
    );
    let mut bad = tools();
    bad[1].parameters = json!({"type": "object", "properties": {"x": {"type": "strange"}}});
    let e = ToolCalling::new(Hermes, bad, Auto, false, &tok)
        .compile(&engine)
        .expect_err("bad schema");
    match e {
        ToolGrammarError::Schema { index, tool, error } => {
            assert_eq!((index, tool.as_str()), (1, "get_time"));
            assert!(error.to_string().contains("strange"), "{error}");
        }
        other => panic!("{other}"),
    }
}

/// A token trigger (a control token, whose text the output leaves out) switches a lazy
/// grammar on, and the grammar starts with that token.
#[test]
fn a_control_token_can_trigger_a_lazy_grammar() {
    let Some((_, tok)) = open("qwen2.5-coder-0.5b-instruct-q4km.gguf") else {
        return;
    };
    let engine = GrammarEngine::new(tok.clone());
    let start = tok.find_token("<|im_start|>").expect("token");
    assert!(tok.is_control(start));
    let spec = GrammarSpec::Lark(format!("start: <[{start}]> \"ok\"\n"));
    let mut c = engine
        .compile(&spec)
        .expect("compile")
        .lazy_on(vec![Trigger::Token(start)]);
    for t in tok.encode("no rules yet", false, false).expect("encode") {
        assert!(c.allows(t));
        c.accept(t, &tok.token_to_piece(t, false));
    }
    assert!(!c.is_active());
    assert!(c.allows(start));
    c.accept(start, &tok.token_to_piece(start, false));
    assert!(c.is_active());
    let ok = tok.encode("ok", false, false).expect("encode");
    let no = tok.encode("no", false, false).expect("encode");
    assert!(!c.allows(no[0]));
    assert!(c.allows(ok[0]));
}

/// The conversation of a round trip: a question, the assistant's call, the result.
fn history() -> Vec<Value> {
    vec![
        json!({"role": "system", "content": "Be brief."}),
        json!({"role": "user", "content": "Weather in Paris?"}),
        json!({"role": "assistant", "content": "", "tool_calls": [{
            "id": "call_abc", "type": "function",
            "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
        }]}),
        json!({"role": "tool", "tool_call_id": "call_abc", "content": "17 C"}),
    ]
}

fn render(template: &ChatTemplate, tok: &Tokenizer, choice: ToolChoice) -> String {
    let format = ToolFormat::detect(template.source());
    let calling = ToolCalling::new(format, tools(), choice, false, tok);
    let (messages, extra) = calling.render_inputs(history());
    template
        .render_json(&messages, true, extra.as_ref())
        .unwrap_or_else(|e| panic!("{format:?}: {e}"))
}

#[test]
fn templates_render_tools_calls_and_results() {
    let Some((gguf, tok)) = open("qwen2.5-coder-0.5b-instruct-q4km.gguf") else {
        return;
    };
    let qwen = ChatTemplate::from_gguf(&gguf)
        .expect("template")
        .expect("present");
    assert_eq!(ToolFormat::detect(qwen.source()), ToolFormat::Hermes);
    let text = render(&qwen, &tok, ToolChoice::Auto);
    for want in [
        "<tools>\n{\"type\": \"function\", \"function\": {\"name\": \"get_weather\", \"description\": \"Current weather of a city\"",
        "<|im_start|>assistant\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call><|im_end|>",
        "<|im_start|>user\n<tool_response>\n17 C\n</tool_response><|im_end|>\n<|im_start|>assistant\n",
    ] {
        assert!(text.contains(want), "missing {want:?} in {text}");
    }

    let dir = root().join("tests/fixtures/chat/templates");
    let llama = ChatTemplate::from_file(
        dir.join("meta-llama-Llama-3.2-3B-Instruct.jinja"),
        "<|begin_of_text|>",
        "<|eot_id|>",
    )
    .expect("template");
    assert_eq!(ToolFormat::detect(llama.source()), ToolFormat::Llama3);
    let text = render(&llama, &tok, ToolChoice::Auto);
    for want in [
        "Given the following functions, please respond with a JSON for a function call",
        "\"name\": \"get_weather\"",
        "<|start_header_id|>assistant<|end_header_id|>\n\n{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\"}}<|eot_id|>",
        // the template writes strings through tojson (a string is iterable in jinja)
        "<|start_header_id|>ipython<|end_header_id|>\n\n\"17 C\"<|eot_id|>",
    ] {
        assert!(text.contains(want), "missing {want:?} in {text}");
    }

    let mistral = ChatTemplate::from_file(
        dir.join("mistralai-Mistral-Nemo-Instruct-2407.jinja"),
        "<s>",
        "</s>",
    )
    .expect("template");
    assert_eq!(ToolFormat::detect(mistral.source()), ToolFormat::Mistral);
    // its template refuses ids that are not 9 letters and digits: "call_abc" is mapped
    let text = render(&mistral, &tok, ToolChoice::Auto);
    assert!(
        text.contains(
            "[AVAILABLE_TOOLS][{\"type\": \"function\", \"function\": {\"name\": \"get_weather\""
        ),
        "{text}"
    );
    let id_at = text.find("\"id\": \"").expect("call id") + 7;
    let id = &text[id_at..id_at + 9];
    assert!(id.bytes().all(|b| b.is_ascii_alphanumeric()), "{text}");
    assert!(text.contains(&format!(
        "[TOOL_CALLS][{{\"name\": \"get_weather\", \"arguments\": {{\"city\": \"Paris\"}}, \"id\": \"{id}\"}}]</s>"
    )), "{text}");
    assert!(
        text.contains(&format!(
            "[TOOL_RESULTS]{{\"content\": 17 C, \"call_id\": \"{id}\"}}[/TOOL_RESULTS]"
        )),
        "{text}"
    );

    let Some((gguf, tok)) = open("SmolLM2-135M-Instruct.Q4_1.gguf") else {
        return;
    };
    let smol = ChatTemplate::from_gguf(&gguf)
        .expect("template")
        .expect("present");
    assert_eq!(ToolFormat::detect(smol.source()), ToolFormat::Generic);
    let text = render(&smol, &tok, ToolChoice::Auto);
    for want in [
        "<|im_start|>system\nBe brief.\n\nYou can call any of the following tools to satisfy the user's requests: [\n  {\n    \"type\": \"function\"",
        "Respond in JSON format, either with `tool_call`",
        "<|im_start|>assistant\n{\"tool_call\": {\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}}<|im_end|>",
        "<|im_start|>user\n{\"tool_response\": {\"tool\": \"get_weather\", \"content\": \"17 C\"}}<|im_end|>",
    ] {
        assert!(text.contains(want), "missing {want:?} in {text}");
    }
    // tool_choice none: the tools are described, no JSON answer is asked for
    let text = render(&smol, &tok, ToolChoice::None);
    assert!(text.contains("You can call any of the following tools"));
    assert!(!text.contains("Respond in JSON format"));
}
