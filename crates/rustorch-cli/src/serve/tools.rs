//! Tool calling on the server: reading `tools` / `tool_choice` and the messages that
//! carry calls and results (OpenAI's and Anthropic's shapes), and writing calls back
//! (whole answers and streamed deltas). The call formats, grammars and parsing are
//! [`rustorch_llm::tools`]'s; both APIs go through [`prepare`].

use rand::Rng;
use rustorch_llm::chat::ChatTemplate;
use rustorch_llm::grammar::GrammarEngine;
use rustorch_llm::scheduler::GenRequest;
use rustorch_llm::tokenizer::Tokenizer;
use rustorch_llm::tools::{
    valid_tool_name, ParsedOutput, Tool, ToolCallParser, ToolCalling, ToolChoice, ToolDelta,
    ToolFormat, ToolGrammarError,
};
use serde_json::{json, Map, Value};

use super::api::{ApiError, Fields};

/// A random id: `prefix` and 24 letters and digits.
pub fn call_id(prefix: &str) -> String {
    let tail: String = rand::thread_rng()
        .sample_iter(&rand::distributions::Alphanumeric)
        .take(24)
        .map(char::from)
        .collect();
    format!("{prefix}{tail}")
}

/// The tools of a request, what it lets the model do with them, and whether several
/// calls may come in one answer.
pub struct ToolRequest {
    pub tools: Vec<Tool>,
    pub choice: ToolChoice,
    pub parallel: bool,
}

/// A tool's name, checked.
fn tool_name(param: &str, v: Option<&Value>) -> Result<String, ApiError> {
    match v {
        Some(Value::String(n)) if valid_tool_name(n) => Ok(n.clone()),
        Some(Value::String(n)) => Err(ApiError::param(
            param,
            format!(
                "'{param}' must be 1 to 128 letters, digits, '_', '-' or '.', got {:?}",
                n
            ),
        )),
        Some(v) => Err(Fields::wrong(param, "a string", v)),
        None => Err(ApiError::param(param, format!("'{param}' is required"))),
    }
}

/// A tool's arguments schema: an object (a missing one takes no arguments).
fn tool_schema(param: &str, v: Option<&Value>) -> Result<Value, ApiError> {
    match v {
        None | Some(Value::Null) => Ok(json!({"type": "object", "properties": {}})),
        Some(v @ Value::Object(_)) => Ok(v.clone()),
        Some(v) => Err(Fields::wrong(param, "a JSON schema object", v)),
    }
}

fn no_duplicates(tools: &[Tool], param: &str) -> Result<(), ApiError> {
    for (i, t) in tools.iter().enumerate() {
        if tools[..i].iter().any(|u| u.name == t.name) {
            return Err(ApiError::param(
                &format!("{param}[{i}]"),
                format!("two tools are named '{}'", t.name),
            ));
        }
    }
    Ok(())
}

/// OpenAI's `tools` (`[{"type": "function", "function": {"name", "description",
/// "parameters", "strict"}}]`), `tool_choice` (`"auto"`, `"none"`, `"required"` or
/// `{"type": "function", "function": {"name"}}`) and `parallel_tool_calls` (default
/// false, as llama-server).
pub fn openai_request(f: &Fields<'_>) -> Result<ToolRequest, ApiError> {
    let mut tools = Vec::new();
    match f.0.get("tools") {
        None | Some(Value::Null) => {}
        Some(Value::Array(a)) => {
            for (i, t) in a.iter().enumerate() {
                let p = format!("tools[{i}]");
                let Value::Object(o) = t else {
                    return Err(Fields::wrong(&p, "an object", t));
                };
                match o.get("type") {
                    None => {}
                    Some(Value::String(s)) if s == "function" => {}
                    Some(v) => {
                        return Err(ApiError::param(
                            &format!("{p}.type"),
                            format!("'{p}.type' must be 'function', got {v}"),
                        ))
                    }
                }
                let Some(Value::Object(func)) = o.get("function") else {
                    return Err(ApiError::param(
                        &format!("{p}.function"),
                        format!("'{p}.function' must be an object with 'name' and 'parameters'"),
                    ));
                };
                let description = match func.get("description") {
                    None | Some(Value::Null) => None,
                    Some(Value::String(d)) => Some(d.clone()),
                    Some(v) => {
                        return Err(Fields::wrong(
                            &format!("{p}.function.description"),
                            "a string",
                            v,
                        ))
                    }
                };
                tools.push(Tool {
                    name: tool_name(&format!("{p}.function.name"), func.get("name"))?,
                    description,
                    parameters: tool_schema(
                        &format!("{p}.function.parameters"),
                        func.get("parameters"),
                    )?,
                });
            }
        }
        Some(v) => return Err(Fields::wrong("tools", "an array of tools", v)),
    }
    no_duplicates(&tools, "tools")?;
    let choice = match f.0.get("tool_choice") {
        None | Some(Value::Null) => ToolChoice::Auto,
        Some(Value::String(s)) => match s.as_str() {
            "auto" => ToolChoice::Auto,
            "none" => ToolChoice::None,
            "required" => ToolChoice::Required,
            other => {
                return Err(ApiError::param(
                    "tool_choice",
                    format!(
                        "'tool_choice' must be 'auto', 'none', 'required' or \
                         {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}, got '{other}'"
                    ),
                ))
            }
        },
        Some(Value::Object(o)) => {
            // {"type": "function", "function": {"name": ..}}; also {"type": "function", "name": ..}
            let name = o
                .get("function")
                .and_then(|f| f.get("name"))
                .or_else(|| o.get("name"));
            ToolChoice::Function(tool_name("tool_choice.function.name", name)?)
        }
        Some(v) => return Err(Fields::wrong("tool_choice", "a string or an object", v)),
    };
    let parallel = f.bool("parallel_tool_calls")?.unwrap_or(false);
    check_choice(&tools, &choice, "tool_choice", "tool_choice.function.name")?;
    Ok(ToolRequest {
        tools,
        choice,
        parallel,
    })
}

/// A choice that needs tools has them, and a named tool exists.
fn check_choice(
    tools: &[Tool],
    choice: &ToolChoice,
    param: &str,
    name_param: &str,
) -> Result<(), ApiError> {
    match choice {
        ToolChoice::Required if tools.is_empty() => Err(ApiError::param(
            param,
            format!("'{param}' asks for a tool call, but the request has no tools"),
        )),
        ToolChoice::Function(name) if !tools.iter().any(|t| t.name == *name) => {
            Err(ApiError::param(
                name_param,
                format!("'{name_param}' names '{name}', which is not one of the request's tools"),
            ))
        }
        _ => Ok(()),
    }
}

/// Anthropic's `tools` (`[{"name", "description", "input_schema"}]`) and
/// `tool_choice` (`{"type": "auto" | "any" | "tool" | "none", "name",
/// "disable_parallel_tool_use"}`; several calls are allowed unless that is set).
pub fn anthropic_request(body: &Map<String, Value>) -> Result<ToolRequest, ApiError> {
    let mut tools = Vec::new();
    match body.get("tools") {
        None | Some(Value::Null) => {}
        Some(Value::Array(a)) => {
            for (i, t) in a.iter().enumerate() {
                let p = format!("tools.{i}");
                let Value::Object(o) = t else {
                    return Err(Fields::wrong(&p, "an object", t));
                };
                match o.get("type").and_then(Value::as_str) {
                    None | Some("custom") => {}
                    Some(other) => {
                        return Err(ApiError::param(
                            &format!("{p}.type"),
                            format!(
                                "{p}.type: server tools ('{other}') are not supported; give \
                                 'name', 'description' and 'input_schema'"
                            ),
                        ))
                    }
                }
                let description = match o.get("description") {
                    None | Some(Value::Null) => None,
                    Some(Value::String(d)) => Some(d.clone()),
                    Some(v) => {
                        return Err(Fields::wrong(&format!("{p}.description"), "a string", v))
                    }
                };
                if o.get("input_schema").is_none_or(Value::is_null) {
                    return Err(ApiError::param(
                        &format!("{p}.input_schema"),
                        format!("{p}.input_schema: Field required"),
                    ));
                }
                tools.push(Tool {
                    name: tool_name(&format!("{p}.name"), o.get("name"))?,
                    description,
                    parameters: tool_schema(&format!("{p}.input_schema"), o.get("input_schema"))?,
                });
            }
        }
        Some(v) => return Err(Fields::wrong("tools", "an array of tools", v)),
    }
    no_duplicates(&tools, "tools")?;
    let (choice, parallel) = match body.get("tool_choice") {
        None | Some(Value::Null) => (ToolChoice::Auto, true),
        Some(Value::Object(o)) => {
            let f = Fields(o);
            let parallel = !f
                .bool("disable_parallel_tool_use")
                .map_err(|mut e| {
                    e.param = Some("tool_choice.disable_parallel_tool_use".into());
                    e
                })?
                .unwrap_or(false);
            let choice = match o.get("type").and_then(Value::as_str) {
                Some("auto") => ToolChoice::Auto,
                Some("any") => ToolChoice::Required,
                Some("none") => ToolChoice::None,
                Some("tool") => ToolChoice::Function(tool_name("tool_choice.name", o.get("name"))?),
                _ => {
                    return Err(ApiError::param(
                        "tool_choice.type",
                        "tool_choice.type: must be 'auto', 'any', 'tool' or 'none'",
                    ))
                }
            };
            (choice, parallel)
        }
        Some(v) => return Err(Fields::wrong("tool_choice", "an object", v)),
    };
    check_choice(&tools, &choice, "tool_choice", "tool_choice.name")?;
    Ok(ToolRequest {
        tools,
        choice,
        parallel,
    })
}

/// The `tool_calls` of an OpenAI assistant message, with their arguments (a JSON string)
/// parsed into objects for the template, as llama.cpp does.
pub fn openai_tool_calls(param: &str, v: &Value) -> Result<Vec<Value>, ApiError> {
    let Value::Array(calls) = v else {
        return Err(Fields::wrong(param, "an array of tool calls", v));
    };
    let mut out = Vec::with_capacity(calls.len());
    for (j, c) in calls.iter().enumerate() {
        let p = format!("{param}[{j}]");
        let Value::Object(o) = c else {
            return Err(Fields::wrong(&p, "an object", c));
        };
        let Some(Value::Object(func)) = o.get("function") else {
            return Err(ApiError::param(
                &format!("{p}.function"),
                format!("'{p}.function' must be an object with 'name' and 'arguments'"),
            ));
        };
        let name = match func.get("name") {
            Some(Value::String(n)) => n.clone(),
            Some(v) => return Err(Fields::wrong(&format!("{p}.function.name"), "a string", v)),
            None => {
                return Err(ApiError::param(
                    &format!("{p}.function.name"),
                    format!("'{p}.function.name' is required"),
                ))
            }
        };
        let ap = format!("{p}.function.arguments");
        let arguments = match func.get("arguments") {
            None | Some(Value::Null) => json!({}),
            Some(Value::String(s)) if s.trim().is_empty() => json!({}),
            Some(Value::String(s)) => serde_json::from_str::<Value>(s)
                .map_err(|e| ApiError::param(&ap, format!("'{ap}' is not valid JSON: {e}")))?,
            Some(v @ Value::Object(_)) => v.clone(),
            Some(v) => return Err(Fields::wrong(&ap, "a JSON string", v)),
        };
        let id = match o.get("id") {
            Some(Value::String(s)) => s.clone(),
            None | Some(Value::Null) => format!("call_{j}"),
            Some(v) => return Err(Fields::wrong(&format!("{p}.id"), "a string", v)),
        };
        out.push(call_json(&id, &name, arguments));
    }
    Ok(out)
}

/// A call in the shape the templates read.
pub fn call_json(id: &str, name: &str, arguments: Value) -> Value {
    json!({"id": id, "type": "function", "function": {"name": name, "arguments": arguments}})
}

/// Sets up a chat request's tools: renders `messages` through the template (with the
/// tools, or the generic format's prompt), puts the call grammar (and, for
/// `tool_choice: none`, the ban of the call marker) on `gen`, and returns the parser
/// for the answer when calls may come. `gen.grammar` must be the request's own grammar
/// or `None`; with tools a grammar of the request's own is an error (as in llama.cpp).
/// Without `engine` (counting tokens) no grammar is built.
pub fn prepare(
    req: ToolRequest,
    messages: Vec<Value>,
    template: &ChatTemplate,
    tokenizer: &Tokenizer,
    engine: Option<&dyn Fn() -> GrammarEngine>,
    gen: &mut GenRequest,
    grammar_param: Option<&str>,
) -> Result<(String, Option<ToolCallParser>), ApiError> {
    let format = ToolFormat::detect(template.source());
    let calling = ToolCalling::new(format, req.tools, req.choice, req.parallel, tokenizer);
    if calling.is_active() {
        if let (Some(_), Some(param)) = (&gen.grammar, grammar_param) {
            return Err(ApiError::param(
                param,
                format!(
                    "'{param}' cannot be combined with tools (set tool_choice to 'none' to \
                     use it)"
                ),
            ));
        }
    }
    let (messages, extra) = calling.render_inputs(messages);
    let rendered = template
        .render_json(&messages, true, extra.as_ref())
        .map_err(|e| {
            ApiError::param(
                "messages",
                format!("the chat template cannot render these messages: {e}"),
            )
        })?;
    if let (Some(engine), true) = (engine, calling.is_active()) {
        let tool_grammar = calling.compile(&engine()).map_err(|e| match e {
            ToolGrammarError::Schema { index, .. } => {
                ApiError::param(&format!("tools[{index}]"), e.to_string()).code("invalid_grammar")
            }
            ToolGrammarError::Grammar(_) => {
                ApiError::param("tools", e.to_string()).code("invalid_grammar")
            }
        })?;
        if tool_grammar.is_some() {
            gen.grammar = tool_grammar;
        }
    }
    for t in calling.banned_tokens() {
        gen.sampling.logit_bias.insert(t, f32::NEG_INFINITY);
    }
    tracing::debug!(format = format.name(), "tool calling");
    let parser = calling.is_active().then(|| calling.parser());
    Ok((rendered, parser))
}

/// An answer's calls in OpenAI's shape, with fresh ids.
pub fn openai_message(parsed: &ParsedOutput) -> Value {
    let calls: Vec<Value> = parsed
        .calls
        .iter()
        .map(|c| {
            json!({
                "id": call_id("call_"),
                "type": "function",
                "function": {"name": c.name, "arguments": c.arguments},
            })
        })
        .collect();
    let content = if calls.is_empty() || !parsed.content.trim().is_empty() {
        Value::String(parsed.content.clone())
    } else {
        Value::Null
    };
    let mut m = json!({"role": "assistant", "content": content});
    if !calls.is_empty() {
        m["tool_calls"] = Value::Array(calls);
    }
    m
}

/// Streams an answer as OpenAI's deltas: `content`, then `tool_calls` entries (the
/// first of a call with its id, type and name, then its arguments in pieces).
pub struct OpenAiCalls {
    parser: ToolCallParser,
    ids: Vec<String>,
}

impl OpenAiCalls {
    pub fn new(parser: ToolCallParser) -> Self {
        OpenAiCalls {
            parser,
            ids: Vec::new(),
        }
    }

    /// The deltas a generated piece of text adds.
    pub fn push(&mut self, token: Option<u32>, text: &str) -> Vec<Value> {
        let ds = self.parser.push(token, text);
        self.deltas(ds)
    }

    /// The last deltas.
    pub fn finish(&mut self) -> Vec<Value> {
        let ds = self.parser.finish();
        self.deltas(ds)
    }

    pub fn has_calls(&self) -> bool {
        !self.ids.is_empty()
    }

    fn deltas(&mut self, ds: Vec<ToolDelta>) -> Vec<Value> {
        ds.into_iter()
            .map(|d| match d {
                ToolDelta::Content(t) => json!({"content": t}),
                ToolDelta::CallStart { index, name } => {
                    let id = call_id("call_");
                    self.ids.push(id.clone());
                    json!({"tool_calls": [{
                        "index": index,
                        "id": id,
                        "type": "function",
                        "function": {"name": name, "arguments": ""},
                    }]})
                }
                ToolDelta::Arguments { index, text } => json!({"tool_calls": [{
                    "index": index,
                    "function": {"arguments": text},
                }]}),
            })
            .collect()
    }
}

/// A call's arguments as an object (Anthropic's `input`): the JSON the model wrote, or
/// `{}` when it was cut short.
pub fn arguments_object(arguments: &str) -> Value {
    match serde_json::from_str::<Value>(arguments) {
        Ok(v @ Value::Object(_)) => v,
        _ => json!({}),
    }
}
