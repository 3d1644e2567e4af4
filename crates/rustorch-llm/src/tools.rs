//! Tool calling: how a chat template's model family writes function calls, the prompt
//! that describes the tools, the grammar that keeps calls well formed, and the parser
//! that turns generated text back into calls.
//!
//! The call syntax depends on what the model was trained on; [`ToolFormat::detect`]
//! reads it from the chat template's text, as llama.cpp does:
//!
//! | format | templates | a call |
//! |---|---|---|
//! | [`Hermes`](ToolFormat::Hermes) | Qwen2.5, Qwen3, Hermes 2/3 (`<tool_call>` in the template) | `<tool_call>{"name": .., "arguments": {..}}</tool_call>` |
//! | [`Llama3`](ToolFormat::Llama3) | Llama 3.1–3.3 (an `ipython` role) | `{"name": .., "parameters": {..}}` |
//! | [`Mistral`](ToolFormat::Mistral) | Mistral Nemo and friends (`[TOOL_CALLS]`) | `[TOOL_CALLS][{"name": .., "arguments": {..}, "id": ".."}]` |
//! | [`Generic`](ToolFormat::Generic) | any other template | the whole answer is JSON: `{"tool_call": {"name": .., "arguments": {..}}}` or `{"response": ".."}` |
//!
//! The three native formats get the tools through the template (`tools` in its context)
//! and render earlier calls and results themselves. For the generic format, which
//! llama.cpp's `common/chat.cpp` also has, the system prompt lists the tools and asks for
//! JSON, and earlier calls and tool results are written into the messages as that JSON.
//!
//! The grammar ([`ToolCalling::grammar`], llguidance's Lark with each tool's
//! `parameters` schema embedded as `%json`) is lazy for `tool_choice: auto` in the native
//! formats: free text until the call marker, then only well-formed calls whose arguments
//! validate against the schema. `required` and a named function force a call from the
//! first token; the generic format is always constrained (text goes in `response`).
//! [`ToolCallParser`] reads the output incrementally, for streaming, and in full.

use std::sync::Arc;

use serde_json::{json, Map, Value};

use crate::grammar::{
    json_with_options, Constraint, GrammarEngine, GrammarError, GrammarSpec, Trigger,
};
use crate::tokenizer::Tokenizer;

/// A function the model may call.
#[derive(Debug, Clone, PartialEq)]
pub struct Tool {
    pub name: String,
    pub description: Option<String>,
    /// JSON Schema of the arguments (an object schema).
    pub parameters: Value,
}

impl Tool {
    /// `{"type": "function", "function": {"name", "description", "parameters"}}`, the
    /// shape chat templates receive (transformers' `get_json_schema` output).
    pub fn openai_json(&self) -> Value {
        let mut f = Map::new();
        f.insert("name".into(), Value::String(self.name.clone()));
        if let Some(d) = &self.description {
            f.insert("description".into(), Value::String(d.clone()));
        }
        f.insert("parameters".into(), self.parameters.clone());
        json!({"type": "function", "function": Value::Object(f)})
    }
}

/// Whether `name` can name a tool: 1 to 128 ASCII letters, digits, `_`, `-` or `.`
/// (OpenAI's and Anthropic's rules, which also keep names literal in JSON and grammars).
pub fn valid_tool_name(name: &str) -> bool {
    (1..=128).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.'))
}

/// Which calls the model may or must make.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolChoice {
    /// Text or calls, as the model decides.
    Auto,
    /// No call: plain text (the tools are still described to the model).
    None,
    /// At least one call.
    Required,
    /// A call of this function.
    Function(String),
}

/// How a model family writes calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolFormat {
    Hermes,
    Llama3,
    Mistral,
    Generic,
}

impl ToolFormat {
    /// The format of a chat template, from its text (llama.cpp's checks).
    pub fn detect(template_source: &str) -> ToolFormat {
        let has = |s: &str| template_source.contains(s);
        if has("[TOOL_CALLS]") {
            ToolFormat::Mistral
        } else if has("<tool_call>") && !(has("<function=") && has("<parameter=")) {
            // Qwen3-Coder's XML calls (<function=...><parameter=...>) are another syntax
            ToolFormat::Hermes
        } else if has("<|start_header_id|>ipython<|end_header_id|>") {
            ToolFormat::Llama3
        } else {
            ToolFormat::Generic
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            ToolFormat::Hermes => "hermes",
            ToolFormat::Llama3 => "llama3",
            ToolFormat::Mistral => "mistral",
            ToolFormat::Generic => "generic",
        }
    }

    /// The text that opens a call section, for the formats that have one.
    fn marker(self) -> Option<&'static str> {
        match self {
            ToolFormat::Hermes => Some(HERMES_OPEN),
            ToolFormat::Mistral => Some(MISTRAL_OPEN),
            ToolFormat::Llama3 | ToolFormat::Generic => None,
        }
    }
}

const HERMES_OPEN: &str = "<tool_call>";
const HERMES_CLOSE: &str = "</tool_call>";
const MISTRAL_OPEN: &str = "[TOOL_CALLS]";

/// The system prompt of the generic format when calls are expected.
const GENERIC_INSTRUCTION: &str = "Respond in JSON format, either with `tool_call` (a request \
    to call tools) or with `response` reply to the user's request";

/// The grammar of a request's calls.
#[derive(Debug, Clone)]
pub struct ToolGrammar {
    /// Lark text (each tool's arguments schema embedded with `%json`).
    pub spec: GrammarSpec,
    /// What starts a call, for a lazy grammar ([`Constraint::lazy_on`]); empty when
    /// the output is constrained from its first token.
    ///
    /// [`Constraint::lazy_on`]: crate::grammar::Constraint::lazy_on
    pub triggers: Vec<Trigger>,
}

/// Why the tools' grammar cannot be built.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ToolGrammarError {
    /// A tool's `parameters` schema (`index`: the tool's place in the request).
    #[error("the parameters schema of tool '{tool}': {error}")]
    Schema {
        index: usize,
        tool: String,
        error: GrammarError,
    },
    #[error("the tools' grammar cannot be built: {0}")]
    Grammar(GrammarError),
}

/// One request's tool setup: the tools, the choice, and how the model writes calls.
#[derive(Debug, Clone)]
pub struct ToolCalling {
    pub format: ToolFormat,
    pub tools: Vec<Tool>,
    pub choice: ToolChoice,
    /// Several calls in one answer.
    pub parallel: bool,
    /// The call marker's token when the marker is one token of the vocabulary (and
    /// whether that token is a control token, whose text is not part of the output).
    marker_token: Option<(u32, bool)>,
}

impl ToolCalling {
    pub fn new(
        format: ToolFormat,
        tools: Vec<Tool>,
        choice: ToolChoice,
        parallel: bool,
        tokenizer: &Tokenizer,
    ) -> Self {
        let marker_token = format.marker().and_then(|m| {
            let id = tokenizer.find_token(m)?;
            Some((id, tokenizer.is_control(id)))
        });
        ToolCalling {
            format,
            tools,
            choice,
            parallel,
            marker_token,
        }
    }

    /// Whether the output may hold calls (tools given and `tool_choice` is not `none`).
    pub fn is_active(&self) -> bool {
        !self.tools.is_empty() && self.choice != ToolChoice::None
    }

    /// Tokens to ban: with `tool_choice: none`, the token that would open a call.
    pub fn banned_tokens(&self) -> Vec<u32> {
        match (&self.choice, self.marker_token) {
            (ToolChoice::None, Some((id, _))) if !self.tools.is_empty() => vec![id],
            _ => Vec::new(),
        }
    }

    /// The messages and extra template context to render. `messages` are chat messages
    /// as JSON objects: `role`, `content` (a string), and for calls `tool_calls`
    /// (`[{"id", "type": "function", "function": {"name", "arguments": {..}}}]`, the
    /// arguments an object) and `tool_call_id` / `name` on `tool` messages.
    pub fn render_inputs(&self, messages: Vec<Value>) -> (Value, Option<Value>) {
        let tools: Vec<Value> = self.tools.iter().map(Tool::openai_json).collect();
        match self.format {
            ToolFormat::Generic => (Value::Array(self.polyfill(messages, &tools)), None),
            format => {
                let messages = if format == ToolFormat::Mistral {
                    messages.into_iter().map(mistral_ids).collect()
                } else {
                    messages
                };
                let extra = (!tools.is_empty()).then(|| json!({"tools": tools}));
                (Value::Array(messages), extra)
            }
        }
    }

    /// Generic format: calls and results written into the messages as the JSON the
    /// model answers with, and the tools described in the system prompt.
    fn polyfill(&self, messages: Vec<Value>, tools: &[Value]) -> Vec<Value> {
        let mut names: Vec<(String, String)> = Vec::new();
        let mut out = Vec::with_capacity(messages.len() + 1);
        for mut m in messages {
            let role = m["role"].as_str().unwrap_or_default().to_string();
            let calls = m
                .get("tool_calls")
                .and_then(Value::as_array)
                .cloned()
                .unwrap_or_default();
            if role == "assistant" && !calls.is_empty() {
                let mut list = Vec::new();
                for c in &calls {
                    let f = &c["function"];
                    let name = f["name"].as_str().unwrap_or_default().to_string();
                    if let Some(id) = c["id"].as_str() {
                        names.push((id.to_string(), name.clone()));
                    }
                    list.push(json!({"name": name, "arguments": f["arguments"].clone()}));
                }
                let mut obj = if list.len() == 1 {
                    json!({"tool_call": list.remove(0)})
                } else {
                    json!({"tool_calls": list})
                };
                if let Some(text) = m["content"].as_str().filter(|t| !t.is_empty()) {
                    obj["content"] = Value::String(text.to_string());
                }
                out.push(
                    json!({"role": "assistant", "content": crate::chat::python_json(&obj, None)}),
                );
                continue;
            }
            if role == "tool" {
                let name = m
                    .get("name")
                    .and_then(Value::as_str)
                    .map(str::to_string)
                    .or_else(|| {
                        let id = m.get("tool_call_id")?.as_str()?;
                        names
                            .iter()
                            .rev()
                            .find(|(i, _)| i == id)
                            .map(|(_, n)| n.clone())
                    });
                let mut resp = Map::new();
                if let Some(n) = name {
                    resp.insert("tool".into(), Value::String(n));
                }
                resp.insert("content".into(), m["content"].clone());
                let obj = json!({"tool_response": Value::Object(resp)});
                out.push(json!({"role": "user", "content": crate::chat::python_json(&obj, None)}));
                continue;
            }
            if let Some(o) = m.as_object_mut() {
                o.remove("tool_calls");
            }
            out.push(m);
        }
        if !tools.is_empty() {
            let mut text = format!(
                "You can call any of the following tools to satisfy the user's requests: {}",
                crate::chat::python_json(&Value::Array(tools.to_vec()), Some(2))
            );
            if self.is_active() {
                let example = json!({"tool_call": {"name": self.tools[0].name, "arguments": {}}});
                text.push_str("\n\n");
                text.push_str(GENERIC_INSTRUCTION);
                text.push_str(&format!(
                    ", for example {} or {}.",
                    crate::chat::python_json(&example, None),
                    crate::chat::python_json(&json!({"response": "..."}), None)
                ));
            }
            add_system(&mut out, &text);
        }
        out
    }

    /// The tools a call may name under the choice.
    fn callable(&self) -> Vec<&Tool> {
        match &self.choice {
            ToolChoice::Function(name) => self.tools.iter().filter(|t| t.name == *name).collect(),
            _ => self.tools.iter().collect(),
        }
    }

    /// The grammar that keeps calls well formed, or `None` when no call may be made.
    /// A tool whose schema llguidance cannot use is an error naming it.
    pub fn grammar(&self) -> Result<Option<ToolGrammar>, ToolGrammarError> {
        if !self.is_active() {
            return Ok(None);
        }
        let callable = self.callable();
        if callable.is_empty() {
            return Ok(None);
        }
        let forced = !matches!(self.choice, ToolChoice::Auto);
        let args_key = if self.format == ToolFormat::Llama3 {
            "parameters"
        } else {
            "arguments"
        };
        // one rule per tool: the call object with its name fixed and its arguments
        // matching the tool's schema; blank space around the keys as the model likes
        // (models that pretty-print their calls), none inside the arguments
        let mut rules = String::new();
        let mut alts = Vec::new();
        let key = |k: &str| format!("{} WS? \":\" WS?", lark_str(&format!("\"{k}\"")));
        for (k, tool) in callable.iter().enumerate() {
            let schema =
                json_with_options(&tool.parameters).map_err(|error| ToolGrammarError::Schema {
                    index: self.tool_index(&tool.name),
                    tool: tool.name.clone(),
                    error,
                })?;
            let tail = if self.format == ToolFormat::Mistral {
                format!(
                    "\",\" WS? {} \"\\\"\" MISTRAL_ID \"\\\"\" WS? \"}}\"",
                    key("id")
                )
            } else {
                "\"}\"".to_string()
            };
            rules.push_str(&format!(
                "fn_{k}: \"{{\" WS? {} {} WS? \",\" WS? {} %json {} WS? {tail}\n",
                key("name"),
                lark_str(&format!("\"{}\"", tool.name)),
                key(args_key),
                serde_json::to_string(&schema).unwrap_or_default()
            ));
            alts.push(format!("fn_{k}"));
        }
        let call = format!("call: {}\nWS: /[ \\t\\r\\n]{{1,32}}/\n", alts.join(" | "));
        // the marker as the grammar names it: a control token by id, else its text
        let marker = |text: &str| match self.marker_token {
            Some((id, true)) => format!("<[{id}]>"),
            _ => lark_str(text),
        };
        let start = match self.format {
            ToolFormat::Hermes => {
                let one = format!(
                    "tc: {} WS? call WS? {} WS?\n",
                    marker(HERMES_OPEN),
                    lark_str(HERMES_CLOSE)
                );
                let mut start = if self.parallel { "tc+" } else { "tc" }.to_string();
                if !forced {
                    // a bare call object, maybe in a code fence (Qwen2.5-Coder writes them)
                    start.push_str(&format!(" | call WS? {}?", lark_str(FENCE)));
                }
                format!("start: {start}\n{one}")
            }
            ToolFormat::Mistral => {
                let more = if self.parallel {
                    " (\",\" WS? call)*"
                } else {
                    ""
                };
                format!(
                    "start: {} \"[\" call{more} \"]\"\nMISTRAL_ID: /[a-zA-Z0-9]{{9}}/\n",
                    marker(MISTRAL_OPEN)
                )
            }
            ToolFormat::Llama3 => "start: call\n".to_string(),
            ToolFormat::Generic => {
                let calls = if self.parallel {
                    format!(
                        "{} call ({} call)* \"]\"",
                        lark_str("{\"tool_calls\": ["),
                        lark_str(", ")
                    )
                } else {
                    format!("{} call", lark_str("{\"tool_call\": "))
                };
                if forced {
                    format!("start: {calls} \"}}\"\n")
                } else {
                    format!(
                        "start: ({calls} | {} %json {{\"type\": \"string\"}}) \"}}\"\n",
                        lark_str("{\"response\": ")
                    )
                }
            }
        };
        let mut triggers = Vec::new();
        if !forced && self.format != ToolFormat::Generic {
            if let Some((id, true)) = self.marker_token {
                triggers.push(Trigger::Token(id));
            }
            let starts = self.call_starts();
            triggers.push(Trigger::Find(Arc::new(move |text: &[u8]| {
                starts.find(text)
            })));
        }
        let text = format!("%llguidance {{}}\n{start}{call}{rules}");
        Ok(Some(ToolGrammar {
            spec: GrammarSpec::Lark(text),
            triggers,
        }))
    }

    /// The grammar compiled into a constraint (lazy when calls are optional), or
    /// `None` when no call may be made. When it does not compile, each tool's schema is
    /// compiled alone to name the one at fault.
    pub fn compile(&self, engine: &GrammarEngine) -> Result<Option<Constraint>, ToolGrammarError> {
        let Some(g) = self.grammar()? else {
            return Ok(None);
        };
        match engine.compile(&g.spec) {
            Ok(c) => Ok(Some(c.lazy_on(g.triggers))),
            Err(e) => {
                for tool in self.callable() {
                    let spec = GrammarSpec::JsonSchema(tool.parameters.clone());
                    if let Err(error) = engine.compile(&spec) {
                        return Err(ToolGrammarError::Schema {
                            index: self.tool_index(&tool.name),
                            tool: tool.name.clone(),
                            error,
                        });
                    }
                }
                Err(ToolGrammarError::Grammar(e))
            }
        }
    }

    fn tool_index(&self, name: &str) -> usize {
        self.tools
            .iter()
            .position(|t| t.name == name)
            .unwrap_or_default()
    }

    /// Where calls begin in this format's output.
    fn call_starts(&self) -> CallStarts {
        let names = match self.format {
            // bare call objects (Qwen2.5-Coder writes Hermes calls without their tags)
            ToolFormat::Hermes | ToolFormat::Llama3 => {
                self.callable().iter().map(|t| t.name.clone()).collect()
            }
            ToolFormat::Mistral | ToolFormat::Generic => Vec::new(),
        };
        CallStarts {
            marker: self.format.marker(),
            names,
        }
    }

    /// A parser for one answer (only meaningful when [`is_active`](Self::is_active)).
    pub fn parser(&self) -> ToolCallParser {
        let marker = match (self.format.marker(), self.marker_token) {
            (Some(text), Some((id, true))) => Some((id, text.to_string())),
            _ => None,
        };
        ToolCallParser {
            format: self.format,
            starts: self.call_starts(),
            marker,
            text: String::new(),
            sent_content: 0,
            sent_args: Vec::new(),
        }
    }
}

/// Whether a call starts at some offset of the output.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum StartMatch {
    Yes,
    /// The output ends where a call could still be starting.
    Prefix,
    No,
}

/// How calls begin: the format's marker (`<tool_call>`, `[TOOL_CALLS]`), and for
/// Hermes and Llama 3.x a bare call object, `{"name": "<one of the tools>"` with any
/// blank space around its punctuation.
#[derive(Debug, Clone)]
struct CallStarts {
    marker: Option<&'static str>,
    names: Vec<String>,
}

impl CallStarts {
    /// Whether a call starts at `i`.
    fn at(&self, s: &[u8], i: usize) -> StartMatch {
        let rest = &s[i..];
        if rest.is_empty() {
            return StartMatch::No;
        }
        if let Some(m) = self.marker {
            if rest.starts_with(m.as_bytes()) {
                return StartMatch::Yes;
            }
            if m.as_bytes().starts_with(rest) {
                return StartMatch::Prefix;
            }
        }
        if self.names.is_empty() || rest[0] != b'{' {
            return StartMatch::No;
        }
        let key = b"\"name\"";
        let mut j = skip_ws(rest, 1);
        let n = key.len().min(rest.len() - j);
        if rest[j..j + n] != key[..n] {
            return StartMatch::No;
        }
        if n < key.len() {
            return StartMatch::Prefix;
        }
        j = skip_ws(rest, j + key.len());
        match rest.get(j) {
            None => return StartMatch::Prefix,
            Some(b':') => {}
            Some(_) => return StartMatch::No,
        }
        j = skip_ws(rest, j + 1);
        match rest.get(j) {
            None => return StartMatch::Prefix,
            Some(b'"') => {}
            Some(_) => return StartMatch::No,
        }
        let name = &rest[j + 1..];
        match name.iter().position(|&c| c == b'"') {
            Some(q) if self.names.iter().any(|t| t.as_bytes() == &name[..q]) => StartMatch::Yes,
            Some(_) => StartMatch::No,
            None if self.names.iter().any(|t| t.as_bytes().starts_with(name)) => StartMatch::Prefix,
            None => StartMatch::No,
        }
    }

    /// The offset of the first call in `s`.
    fn find(&self, s: &[u8]) -> Option<usize> {
        (0..s.len()).find(|&i| self.at(s, i) == StartMatch::Yes)
    }

    /// How many bytes at the end of `s` may be the beginning of a call.
    fn hold(&self, s: &[u8]) -> usize {
        (0..s.len())
            .find(|&i| self.at(s, i) == StartMatch::Prefix)
            .map_or(0, |i| s.len() - i)
    }
}

/// A Lark string literal.
fn lark_str(s: &str) -> String {
    serde_json::to_string(s).unwrap_or_else(|_| "\"\"".into())
}

/// Appends `text` to the first system message, or puts one first.
fn add_system(messages: &mut Vec<Value>, text: &str) {
    if let Some(first) = messages.first_mut() {
        if first["role"] == "system" {
            let old = first["content"].as_str().unwrap_or_default();
            let joined = if old.is_empty() {
                text.to_string()
            } else {
                format!("{old}\n\n{text}")
            };
            first["content"] = Value::String(joined);
            return;
        }
    }
    messages.insert(0, json!({"role": "system", "content": text}));
}

/// Mistral's templates want call ids of 9 letters and digits: other ids are replaced by
/// 9 characters derived from them (the same for a call and its result).
fn mistral_ids(mut m: Value) -> Value {
    if let Some(calls) = m.get_mut("tool_calls").and_then(Value::as_array_mut) {
        for c in calls {
            if let Some(id) = c.get("id").and_then(Value::as_str) {
                c["id"] = Value::String(mistral_id(id));
            }
        }
    }
    if let Some(id) = m.get("tool_call_id").and_then(Value::as_str) {
        m["tool_call_id"] = Value::String(mistral_id(id));
    }
    m
}

fn mistral_id(id: &str) -> String {
    if id.len() == 9 && id.bytes().all(|b| b.is_ascii_alphanumeric()) {
        return id.to_string();
    }
    // FNV-1a, written in base 62
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in id.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    const DIGITS: &[u8] = b"0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ";
    (0..9)
        .map(|_| {
            let d = DIGITS[(h % 62) as usize] as char;
            h /= 62;
            d
        })
        .collect()
}

/// A call read from the output.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParsedCall {
    pub name: String,
    /// The arguments as the model wrote them (JSON text; a prefix of it while the call
    /// is incomplete).
    pub arguments: String,
    /// Whether the call was written to its end.
    pub complete: bool,
}

/// An answer split into text and calls.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ParsedOutput {
    /// The text outside the calls.
    pub content: String,
    pub calls: Vec<ParsedCall>,
}

/// What a streamed answer adds, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolDelta {
    /// More text.
    Content(String),
    /// A call begins (its name is known).
    CallStart { index: usize, name: String },
    /// More of a call's arguments (JSON text).
    Arguments { index: usize, text: String },
}

/// Reads calls out of generated text as it arrives. Each [`push`](Self::push) re-reads
/// the answer so far and returns what it adds; text that may still turn out to be the
/// start of a call is held back until it is clear.
#[derive(Debug, Clone)]
pub struct ToolCallParser {
    format: ToolFormat,
    /// Where calls begin.
    starts: CallStarts,
    /// A control token whose text is not in the output: the text it stands for.
    marker: Option<(u32, String)>,
    text: String,
    sent_content: usize,
    sent_args: Vec<usize>,
}

impl ToolCallParser {
    /// Adds a generated token's text (`token`: its id, to recognize a control-token
    /// call marker, whose text the output leaves out).
    pub fn push(&mut self, token: Option<u32>, text: &str) -> Vec<ToolDelta> {
        self.text.push_str(text);
        if let (Some(t), Some((id, marker))) = (token, &self.marker) {
            if t == *id {
                self.text.push_str(marker);
            }
        }
        let parsed = self.parse(false);
        self.diff(parsed)
    }

    /// What is left at the end of the answer (text held back, the last arguments).
    pub fn finish(&mut self) -> Vec<ToolDelta> {
        let parsed = self.parse(true);
        self.diff(parsed)
    }

    /// The whole answer, read to its end.
    pub fn result(&self) -> ParsedOutput {
        self.parse(true)
    }

    /// The control token that opens calls, and the text it stands for, when the
    /// output leaves it out ([`push`](Self::push) adds the text when given the token).
    pub fn marker(&self) -> Option<(u32, &str)> {
        self.marker.as_ref().map(|(id, t)| (*id, t.as_str()))
    }

    /// The raw text received.
    pub fn text(&self) -> &str {
        &self.text
    }

    fn diff(&mut self, p: ParsedOutput) -> Vec<ToolDelta> {
        let mut out = Vec::new();
        if p.content.len() > self.sent_content && p.content.is_char_boundary(self.sent_content) {
            out.push(ToolDelta::Content(
                p.content[self.sent_content..].to_string(),
            ));
            self.sent_content = p.content.len();
        }
        for (index, c) in p.calls.into_iter().enumerate() {
            if index >= self.sent_args.len() {
                self.sent_args.push(0);
                out.push(ToolDelta::CallStart {
                    index,
                    name: c.name,
                });
            }
            let sent = self.sent_args[index];
            if c.arguments.len() > sent && c.arguments.is_char_boundary(sent) {
                out.push(ToolDelta::Arguments {
                    index,
                    text: c.arguments[sent..].to_string(),
                });
                self.sent_args[index] = c.arguments.len();
            }
        }
        out
    }

    /// Reads the text so far. `at_end`: nothing more comes, so nothing is held back.
    fn parse(&self, at_end: bool) -> ParsedOutput {
        match self.format {
            ToolFormat::Generic => parse_generic(&self.text, at_end),
            _ => self.parse_sections(at_end),
        }
    }

    /// Text, then calls from the first call marker on.
    fn parse_sections(&self, at_end: bool) -> ParsedOutput {
        let text = self.text.as_str();
        let Some(start) = self.starts.find(text.as_bytes()) else {
            let end = if at_end {
                text.len()
            } else {
                // hold back what may be the beginning of a marker, and the blank space
                // before it
                let hold = self
                    .starts
                    .hold(text.as_bytes())
                    .max(partial_suffix(text, "```json"));
                without_fence(&text[..text.len() - hold]).len()
            };
            return ParsedOutput {
                content: text[..end].to_string(),
                calls: Vec::new(),
            };
        };
        let mut out = ParsedOutput {
            content: without_fence(&text[..start]).to_string(),
            calls: Vec::new(),
        };
        let rest_from = match self.format {
            ToolFormat::Hermes => read_hermes(text, start, &self.starts, &mut out.calls),
            ToolFormat::Mistral => read_mistral(text, start, &mut out.calls),
            _ => read_objects(text, start, &self.starts, &mut out.calls),
        };
        // text the call syntax does not explain (a grammar cannot have allowed it)
        if let Some(from) = rest_from {
            let rest = text[from..].trim();
            if !rest.is_empty() && at_end {
                if !out.content.is_empty() {
                    out.content.push('\n');
                }
                out.content.push_str(rest);
            }
        }
        out
    }
}

/// A code fence around a bare call.
const FENCE: &str = "```";

/// `text` without blank space and a code fence opening at its end (what comes before a
/// call: a fenced call is still a call).
fn without_fence(text: &str) -> &str {
    let t = text.trim_end();
    match t.strip_suffix("```json").or_else(|| t.strip_suffix(FENCE)) {
        Some(before) => before.trim_end(),
        None => t,
    }
}

/// Length of the longest end of `text` that is a proper beginning of `marker`.
fn partial_suffix(text: &str, marker: &str) -> usize {
    (1..marker.len())
        .rev()
        .find(|&n| marker.is_char_boundary(n) && text.ends_with(&marker[..n]))
        .unwrap_or(0)
}

/// How far a JSON value (or part of one) reaches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Scan {
    /// Complete; ends before this offset.
    Done(usize),
    /// The text ends inside it.
    Partial,
    /// Not JSON.
    Invalid,
}

fn skip_ws(b: &[u8], mut i: usize) -> usize {
    while i < b.len() && matches!(b[i], b' ' | b'\t' | b'\n' | b'\r') {
        i += 1;
    }
    i
}

fn scan_string(b: &[u8], i: usize) -> Scan {
    let mut j = i + 1;
    while j < b.len() {
        match b[j] {
            b'\\' => j += 2,
            b'"' => return Scan::Done(j + 1),
            _ => j += 1,
        }
    }
    Scan::Partial
}

/// Where the JSON value at `i` ends (structure only: brackets and strings).
fn scan_value(b: &[u8], i: usize) -> Scan {
    let Some(&c) = b.get(i) else {
        return Scan::Partial;
    };
    match c {
        b'"' => scan_string(b, i),
        b'{' | b'[' => {
            let mut depth = 0usize;
            let mut j = i;
            while j < b.len() {
                match b[j] {
                    b'"' => match scan_string(b, j) {
                        Scan::Done(e) => {
                            j = e;
                            continue;
                        }
                        other => return other,
                    },
                    b'{' | b'[' => depth += 1,
                    b'}' | b']' => {
                        depth = depth.saturating_sub(1);
                        if depth == 0 {
                            return Scan::Done(j + 1);
                        }
                    }
                    _ => {}
                }
                j += 1;
            }
            Scan::Partial
        }
        b'-' | b'0'..=b'9' | b't' | b'f' | b'n' => {
            let mut j = i;
            while j < b.len()
                && matches!(b[j], b'-' | b'+' | b'.' | b'0'..=b'9' | b'a'..=b'z' | b'E')
            {
                j += 1;
            }
            if j == b.len() {
                Scan::Partial
            } else {
                Scan::Done(j)
            }
        }
        _ => Scan::Invalid,
    }
}

/// A call object as far as it goes: its name once complete, and where its arguments
/// start and (once complete) end.
#[derive(Debug, Default)]
struct RawCall {
    name: Option<String>,
    args: Option<(usize, Option<usize>)>,
}

/// Reads `{"name": .., "arguments" | "parameters": .., ...}` at `i`.
fn read_call(s: &str, i: usize) -> (RawCall, Scan) {
    let b = s.as_bytes();
    let mut call = RawCall::default();
    match b.get(i) {
        None => return (call, Scan::Partial),
        Some(b'{') => {}
        Some(_) => return (call, Scan::Invalid),
    }
    let mut j = i + 1;
    loop {
        j = skip_ws(b, j);
        match b.get(j) {
            None => return (call, Scan::Partial),
            Some(b'}') => return (call, Scan::Done(j + 1)),
            Some(b'"') => {}
            Some(_) => return (call, Scan::Invalid),
        }
        let key_end = match scan_string(b, j) {
            Scan::Done(e) => e,
            other => return (call, other),
        };
        let Ok(key) = serde_json::from_str::<String>(&s[j..key_end]) else {
            return (call, Scan::Invalid);
        };
        j = skip_ws(b, key_end);
        match b.get(j) {
            None => return (call, Scan::Partial),
            Some(b':') => {}
            Some(_) => return (call, Scan::Invalid),
        }
        j = skip_ws(b, j + 1);
        let value = scan_value(b, j);
        match key.as_str() {
            "name" => match value {
                Scan::Done(e) => match serde_json::from_str::<String>(&s[j..e]) {
                    Ok(name) => {
                        call.name = Some(name);
                        j = e;
                    }
                    Err(_) => return (call, Scan::Invalid),
                },
                other => return (call, other),
            },
            "arguments" | "parameters" => match value {
                Scan::Done(e) => {
                    call.args = Some((j, Some(e)));
                    j = e;
                }
                Scan::Partial => {
                    if j < b.len() {
                        call.args = Some((j, None));
                    }
                    return (call, Scan::Partial);
                }
                Scan::Invalid => return (call, Scan::Invalid),
            },
            _ => match value {
                Scan::Done(e) => j = e,
                other => return (call, other),
            },
        }
        j = skip_ws(b, j);
        match b.get(j) {
            None => return (call, Scan::Partial),
            Some(b',') => j += 1,
            Some(b'}') => return (call, Scan::Done(j + 1)),
            Some(_) => return (call, Scan::Invalid),
        }
    }
}

/// Adds a call read by [`read_call`] once its name is known.
/// Reads the call object at `i` into `calls`: `Ok` with the offset after it and its
/// trailing blanks when it is complete; else what a reader answers there: `Err(None)` when
/// the text ends inside it (kept as a partial call), `Err(Some(i))` when no call is there.
fn take_call(s: &str, i: usize, calls: &mut Vec<ParsedCall>) -> Result<usize, Option<usize>> {
    let (raw, scan) = read_call(s, i);
    match scan {
        Scan::Done(e) => {
            push_call(s, raw, true, calls);
            Ok(skip_ws(s.as_bytes(), e))
        }
        Scan::Partial => {
            push_call(s, raw, false, calls);
            Err(None)
        }
        Scan::Invalid => Err(Some(i)),
    }
}

fn push_call(s: &str, raw: RawCall, complete: bool, calls: &mut Vec<ParsedCall>) {
    let Some(name) = raw.name else { return };
    let arguments = match raw.args {
        Some((a, Some(e))) => s[a..e].to_string(),
        Some((a, None)) => s[a..].to_string(),
        None if complete => "{}".to_string(),
        None => String::new(),
    };
    calls.push(ParsedCall {
        name,
        arguments,
        complete,
    });
}

/// Hermes calls from `i`: `<tool_call>{..}</tool_call>` repeated, or a bare call
/// object (which Qwen2.5-Coder writes, often in a code fence). Returns where
/// unexplained text starts, if any.
fn read_hermes(
    s: &str,
    mut i: usize,
    starts: &CallStarts,
    calls: &mut Vec<ParsedCall>,
) -> Option<usize> {
    let b = s.as_bytes();
    loop {
        let tagged = s[i..].starts_with(HERMES_OPEN);
        if tagged {
            i = skip_ws(b, i + HERMES_OPEN.len());
        }
        i = match take_call(s, i, calls) {
            Ok(next) => next,
            Err(answer) => return answer,
        };
        // the closing tag, or the end of a bare call's code fence
        let close = if tagged { HERMES_CLOSE } else { FENCE };
        let rest = &s[i..];
        if rest.starts_with(close) {
            i = skip_ws(b, i + close.len());
        } else if tagged && close.starts_with(rest) {
            return None;
        } else if tagged {
            return Some(i);
        }
        match starts.at(b, i) {
            _ if i == b.len() => return None,
            StartMatch::Yes => continue,
            StartMatch::Prefix => return None,
            StartMatch::No => return (!FENCE.starts_with(&s[i..])).then_some(i),
        }
    }
}

/// `[TOOL_CALLS][{..}, {..}]` from `i`.
fn read_mistral(s: &str, i: usize, calls: &mut Vec<ParsedCall>) -> Option<usize> {
    let b = s.as_bytes();
    let mut i = skip_ws(b, i + MISTRAL_OPEN.len());
    match b.get(i) {
        None => return None,
        Some(b'[') => {}
        Some(_) => return Some(i),
    }
    i += 1;
    loop {
        i = skip_ws(b, i);
        i = match take_call(s, i, calls) {
            Ok(next) => next,
            Err(answer) => return answer,
        };
        match b.get(i) {
            None => return None,
            Some(b',') => i += 1,
            Some(b']') => {
                let after = skip_ws(b, i + 1);
                return (after < b.len()).then_some(after);
            }
            Some(_) => return Some(i),
        }
    }
}

/// Call objects, each at one of `starts` (Llama 3.x).
fn read_objects(
    s: &str,
    mut i: usize,
    starts: &CallStarts,
    calls: &mut Vec<ParsedCall>,
) -> Option<usize> {
    let b = s.as_bytes();
    loop {
        i = match take_call(s, i, calls) {
            Ok(next) => next,
            Err(answer) => return answer,
        };
        match starts.at(b, i) {
            _ if i == b.len() => return None,
            StartMatch::Yes => continue,
            StartMatch::Prefix => return None,
            StartMatch::No => return Some(i),
        }
    }
}

/// The generic format: the answer is `{"tool_call": {..}}`, `{"tool_calls": [..]}` or
/// `{"response": ".."}`; anything else is plain text.
fn parse_generic(s: &str, at_end: bool) -> ParsedOutput {
    let b = s.as_bytes();
    let plain = |at_end: bool| ParsedOutput {
        content: if at_end { s.to_string() } else { String::new() },
        calls: Vec::new(),
    };
    let mut i = skip_ws(b, 0);
    match b.get(i) {
        None => return ParsedOutput::default(),
        Some(b'{') => {}
        Some(_) => return plain(true),
    }
    i = skip_ws(b, i + 1);
    if i >= b.len() {
        return plain(at_end);
    }
    if b[i] != b'"' {
        return plain(true);
    }
    let key_end = match scan_string(b, i) {
        Scan::Done(e) => e,
        Scan::Partial => return plain(at_end),
        Scan::Invalid => return plain(true),
    };
    let Ok(key) = serde_json::from_str::<String>(&s[i..key_end]) else {
        return plain(true);
    };
    i = skip_ws(b, key_end);
    match b.get(i) {
        None => return plain(at_end),
        Some(b':') => {}
        Some(_) => return plain(true),
    }
    i = skip_ws(b, i + 1);
    let mut out = ParsedOutput::default();
    match key.as_str() {
        "response" => {
            if b.get(i) == Some(&b'"') {
                out.content = decode_partial_string(&s[i..]);
            } else if i < b.len() {
                // a non-string response (a schema-constrained one): its JSON text
                match scan_value(b, i) {
                    Scan::Done(e) => out.content = s[i..e].to_string(),
                    _ if at_end => out.content = s[i..].to_string(),
                    _ => {}
                }
            }
        }
        "tool_call" => {
            let (raw, scan) = read_call(s, i);
            match scan {
                Scan::Invalid => return plain(at_end),
                Scan::Done(_) => push_call(s, raw, true, &mut out.calls),
                Scan::Partial => push_call(s, raw, false, &mut out.calls),
            }
        }
        "tool_calls" => {
            if b.get(i) != Some(&b'[') {
                return if i < b.len() {
                    plain(true)
                } else {
                    plain(at_end)
                };
            }
            i += 1;
            loop {
                i = skip_ws(b, i);
                match take_call(s, i, &mut out.calls) {
                    Ok(next) => i = next,
                    Err(_) => break,
                }
                match b.get(i) {
                    Some(b',') => i += 1,
                    _ => break,
                }
            }
        }
        _ => return plain(at_end),
    }
    out
}

/// The characters of a JSON string literal (`s` starts at its opening quote) as far as
/// they are complete; an escape cut short is left out.
fn decode_partial_string(s: &str) -> String {
    let b = s.as_bytes();
    let mut j = 1;
    let mut safe = 1;
    while j < b.len() {
        match b[j] {
            b'"' => {
                safe = j;
                break;
            }
            b'\\' => {
                let need = match b.get(j + 1) {
                    Some(b'u') => {
                        // a high surrogate needs its low half too
                        let hex = s
                            .get(j + 2..j + 6)
                            .and_then(|h| u16::from_str_radix(h, 16).ok());
                        match hex {
                            Some(h) if (0xD800..0xDC00).contains(&h) => 12,
                            _ => 6,
                        }
                    }
                    _ => 2,
                };
                if j + need > b.len() {
                    break;
                }
                j += need;
                safe = j;
            }
            _ => {
                j += 1;
                safe = j;
            }
        }
    }
    let literal = format!("{}\"", &s[..safe]);
    serde_json::from_str::<String>(&literal).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parser(format: ToolFormat, names: &[&str]) -> ToolCallParser {
        ToolCallParser {
            format,
            starts: CallStarts {
                marker: format.marker(),
                names: names.iter().map(|s| s.to_string()).collect(),
            },
            marker: None,
            text: String::new(),
            sent_content: 0,
            sent_args: Vec::new(),
        }
    }

    /// Feeds `text` a few bytes at a time and checks that the deltas add up to the
    /// final result.
    fn stream(mut p: ToolCallParser, text: &str, step: usize) -> ParsedOutput {
        let mut content = String::new();
        let mut calls: Vec<ParsedCall> = Vec::new();
        let mut apply = |ds: Vec<ToolDelta>| {
            for d in ds {
                match d {
                    ToolDelta::Content(t) => content.push_str(&t),
                    ToolDelta::CallStart { index, name } => {
                        assert_eq!(index, calls.len());
                        calls.push(ParsedCall {
                            name,
                            arguments: String::new(),
                            complete: true,
                        });
                    }
                    ToolDelta::Arguments { index, text } => calls[index].arguments.push_str(&text),
                }
            }
        };
        let chars: Vec<char> = text.chars().collect();
        for chunk in chars.chunks(step) {
            let piece: String = chunk.iter().collect();
            apply(p.push(None, &piece));
        }
        apply(p.finish());
        let result = p.result();
        assert_eq!(content, result.content, "streamed content of {text:?}");
        let names: Vec<_> = result
            .calls
            .iter()
            .map(|c| (&c.name, &c.arguments))
            .collect();
        let streamed: Vec<_> = calls.iter().map(|c| (&c.name, &c.arguments)).collect();
        assert_eq!(streamed, names, "streamed calls of {text:?}");
        result
    }

    #[test]
    fn hermes_calls_are_split_from_text_in_every_chunking() {
        let text = "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"n\": [1, {\"x\": \"}\"}]}}\n</tool_call>\n<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>";
        for step in [1, 2, 3, 7, 1000] {
            let r = stream(parser(ToolFormat::Hermes, &[]), text, step);
            assert_eq!(r.content, "Let me check.");
            assert_eq!(r.calls.len(), 2);
            assert_eq!(r.calls[0].name, "get_weather");
            assert_eq!(
                r.calls[0].arguments,
                "{\"city\": \"Paris\", \"n\": [1, {\"x\": \"}\"}]}"
            );
            assert!(r.calls[0].complete);
            assert_eq!(r.calls[1].arguments, "{}");
        }
        // plain text stays text, a marker-like ending included
        let r = stream(parser(ToolFormat::Hermes, &[]), "a < b <tool", 1);
        assert_eq!(r.content, "a < b <tool");
        assert!(r.calls.is_empty());
    }

    #[test]
    fn hermes_bare_calls_in_code_fences_are_calls() {
        let starts = ["get_weather"];
        let text =
            "```json\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n```";
        for step in [1, 2, 5, 1000] {
            let r = stream(parser(ToolFormat::Hermes, &starts), text, step);
            assert_eq!(r.content, "");
            assert_eq!(r.calls.len(), 1);
            assert_eq!(r.calls[0].arguments, "{\"city\": \"Paris\"}");
        }
        // pretty-printed, as Qwen2.5-Coder-1.5B writes them
        let text = "```json\n{\n  \"name\": \"get_weather\",\n  \"arguments\": {\"city\": \"Paris\"}\n}\n```";
        for step in [1, 4, 1000] {
            let r = stream(parser(ToolFormat::Hermes, &starts), text, step);
            assert_eq!(r.content, "");
            assert_eq!(r.calls.len(), 1);
            assert_eq!(r.calls[0].arguments, "{\"city\": \"Paris\"}");
        }
        // an object naming no tool is text
        let text = "{\"name\": \"Bob\", \"age\": 3}";
        let r = stream(parser(ToolFormat::Hermes, &starts), text, 1);
        assert_eq!(r.content, text);
        assert!(r.calls.is_empty());
        // a fenced block that is not a call stays text
        let text = "Use:\n```json\n{\"a\": 1}\n```";
        for step in [1, 3, 1000] {
            let r = stream(parser(ToolFormat::Hermes, &starts), text, step);
            assert_eq!(r.content, text);
            assert!(r.calls.is_empty());
        }
    }

    #[test]
    fn partial_text_holds_back_a_possible_marker() {
        let mut p = parser(ToolFormat::Hermes, &[]);
        assert_eq!(
            p.push(None, "Hi <tool"),
            vec![ToolDelta::Content("Hi".into())]
        );
        assert_eq!(p.push(None, "_call>{\"name\": \"g"), vec![]);
        assert_eq!(
            p.push(None, "\""),
            vec![ToolDelta::CallStart {
                index: 0,
                name: "g".into()
            }]
        );
        assert_eq!(
            p.push(None, ", \"arguments\": {\"a\""),
            vec![ToolDelta::Arguments {
                index: 0,
                text: "{\"a\"".into()
            }]
        );
        let r = p.result();
        assert!(!r.calls[0].complete);
    }

    #[test]
    fn mistral_llama3_and_generic_outputs_parse() {
        let text = "[TOOL_CALLS][{\"name\": \"a\", \"arguments\": {\"x\": 1}, \"id\": \"abcdefghi\"}, {\"name\": \"b\", \"arguments\": {}, \"id\": \"123456789\"}]";
        for step in [1, 4, 1000] {
            let r = stream(parser(ToolFormat::Mistral, &[]), text, step);
            assert_eq!(r.content, "");
            let got: Vec<_> = r
                .calls
                .iter()
                .map(|c| (c.name.as_str(), c.arguments.as_str()))
                .collect();
            assert_eq!(got, vec![("a", "{\"x\": 1}"), ("b", "{}")]);
        }
        let text = "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Oslo\"}}";
        let starts = ["get_weather"];
        for step in [1, 5, 1000] {
            let r = stream(parser(ToolFormat::Llama3, &starts), text, step);
            assert_eq!(r.calls.len(), 1);
            assert_eq!(r.calls[0].arguments, "{\"city\": \"Oslo\"}");
        }
        let text =
            "{\"tool_call\": {\"name\": \"get_weather\", \"arguments\": {\"city\": \"Rome\"}}}";
        for step in [1, 3, 1000] {
            let r = stream(parser(ToolFormat::Generic, &[]), text, step);
            assert_eq!(r.content, "");
            assert_eq!(r.calls[0].name, "get_weather");
            assert_eq!(r.calls[0].arguments, "{\"city\": \"Rome\"}");
        }
        let text = "{\"response\": \"It is 21 \\u00b0C \\\"sunny\\\"\\n\\ud83d\\ude00 now\"}";
        for step in [1, 2, 1000] {
            let r = stream(parser(ToolFormat::Generic, &[]), text, step);
            assert_eq!(r.content, "It is 21 °C \"sunny\"\n😀 now");
            assert!(r.calls.is_empty());
        }
        let r = stream(parser(ToolFormat::Generic, &[]), "not json", 2);
        assert_eq!(r.content, "not json");
        let text = "{\"tool_calls\": [{\"name\": \"a\", \"arguments\": {}}, {\"name\": \"b\", \"arguments\": {\"k\": \"v\"}}]}";
        let r = stream(parser(ToolFormat::Generic, &[]), text, 3);
        assert_eq!(r.calls.len(), 2);
        assert_eq!(r.calls[1].arguments, "{\"k\": \"v\"}");
    }

    #[test]
    fn formats_are_detected_from_template_text() {
        assert_eq!(
            ToolFormat::detect("{{ '<tool_call>' }}"),
            ToolFormat::Hermes
        );
        assert_eq!(
            ToolFormat::detect("<tool_call> <function=x> <parameter=y>"),
            ToolFormat::Generic
        );
        assert_eq!(
            ToolFormat::detect("[TOOL_CALLS] <tool_call>"),
            ToolFormat::Mistral
        );
        assert_eq!(
            ToolFormat::detect("{{ '<|start_header_id|>ipython<|end_header_id|>' }}"),
            ToolFormat::Llama3
        );
        assert_eq!(ToolFormat::detect("{{ messages }}"), ToolFormat::Generic);
    }

    #[test]
    fn mistral_ids_are_nine_characters_and_stable() {
        assert_eq!(mistral_id("abcdefghi"), "abcdefghi");
        let a = mistral_id("call_0123456789");
        assert_eq!(a.len(), 9);
        assert!(a.bytes().all(|b| b.is_ascii_alphanumeric()));
        assert_eq!(a, mistral_id("call_0123456789"));
        assert_ne!(a, mistral_id("call_0123456788"));
    }

    #[test]
    fn tool_names_follow_the_apis_rules() {
        assert!(valid_tool_name("get_weather"));
        assert!(valid_tool_name("a-b.c9"));
        assert!(!valid_tool_name(""));
        assert!(!valid_tool_name("has space"));
        assert!(!valid_tool_name("quote\""));
        assert!(!valid_tool_name(&"x".repeat(129)));
    }
}
