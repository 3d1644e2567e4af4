//! OpenAI request parsing and error responses.
//!
//! Request bodies are parsed by hand from `serde_json::Value` so that every wrong field
//! gets a 400 that names it (`param`), in OpenAI's error shape.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use rustorch_llm::chat::ChatTemplate;
use rustorch_llm::grammar::{GrammarEngine, GrammarSpec};
use rustorch_llm::sampler::SamplerParams;
use rustorch_llm::scheduler::{GenRequest, SubmitError};
use rustorch_llm::tokenizer::Tokenizer;
use rustorch_llm::tools::ToolCallParser;
use serde_json::{json, Map, Value};

use super::tools;

/// An error answered as `{"error": {"message", "type", "param", "code"}}`.
#[derive(Debug, Clone)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub kind: &'static str,
    pub param: Option<String>,
    pub code: Option<&'static str>,
}

impl ApiError {
    pub fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> Self {
        ApiError {
            status,
            message: message.into(),
            kind,
            param: None,
            code: None,
        }
    }

    /// 400 `invalid_request_error`.
    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
    }

    /// 400 about one field.
    pub fn param(param: &str, message: impl Into<String>) -> Self {
        let mut e = Self::invalid(message);
        e.param = Some(param.to_string());
        e.code = Some("invalid_value");
        e
    }

    pub fn code(mut self, code: &'static str) -> Self {
        self.code = Some(code);
        self
    }

    pub fn unauthorized() -> Self {
        Self::new(
            StatusCode::UNAUTHORIZED,
            "invalid_request_error",
            "Incorrect API key provided. Pass it as `Authorization: Bearer KEY` or `x-api-key: KEY`.",
        )
        .code("invalid_api_key")
    }

    pub fn loading() -> Self {
        Self::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "unavailable_error",
            "the model is still loading; retry when GET /health answers {\"status\":\"ok\"}",
        )
        .code("model_loading")
    }

    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", message)
    }

    pub fn body(&self) -> Value {
        json!({
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        })
    }

    /// Maps a scheduler refusal; `param` names the field holding the prompt.
    pub fn from_submit(e: SubmitError, param: &str, n_slots: usize, n_ctx: usize) -> Self {
        match e {
            SubmitError::EmptyPrompt => {
                Self::param(param, "the prompt is empty after tokenization")
            }
            SubmitError::PromptTooLong {
                n_prompt,
                n_ctx: slot_ctx,
            } => Self::param(
                param,
                format!(
                    "the prompt is {n_prompt} tokens long, but a slot's context holds only \
                     {slot_ctx} tokens (context size {n_ctx} shared by {n_slots} slots; \
                     raise -c or lower -np)"
                ),
            )
            .code("context_length_exceeded"),
            SubmitError::TokenOutOfRange { .. } => Self::param(param, e.to_string()),
            SubmitError::QueueFull { .. } => Self::new(
                StatusCode::TOO_MANY_REQUESTS,
                "rate_limit_error",
                format!("{e} (all {n_slots} slots are busy)"),
            )
            .code("rate_limit_exceeded"),
            SubmitError::ShuttingDown => Self::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "unavailable_error",
                e.to_string(),
            )
            .code("shutting_down"),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        json_response(self.status, &self.body())
    }
}

/// A JSON response.
pub fn json_response(status: StatusCode, body: &Value) -> Response {
    (
        status,
        [(axum::http::header::CONTENT_TYPE, "application/json")],
        body.to_string(),
    )
        .into_response()
}

/// Parses a request body into a JSON object.
pub fn parse_object(body: &[u8]) -> Result<Map<String, Value>, ApiError> {
    let v: Value = serde_json::from_slice(body).map_err(|e| {
        ApiError::invalid(format!("the request body is not valid JSON: {e}")).code("invalid_json")
    })?;
    match v {
        Value::Object(m) => Ok(m),
        other => Err(ApiError::invalid(format!(
            "the request body must be a JSON object, got {}",
            type_name(&other)
        ))
        .code("invalid_json")),
    }
}

pub fn type_name(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// Typed access to optional fields; `null` counts as absent.
pub struct Fields<'a>(pub &'a Map<String, Value>);

impl Fields<'_> {
    fn get(&self, key: &str) -> Option<&Value> {
        self.0.get(key).filter(|v| !v.is_null())
    }

    pub fn wrong(key: &str, expected: &str, v: &Value) -> ApiError {
        ApiError::param(
            key,
            format!("'{key}' must be {expected}, got {}", type_name(v)),
        )
    }

    pub fn bool(&self, key: &str) -> Result<Option<bool>, ApiError> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(v) => Err(Self::wrong(key, "a boolean", v)),
        }
    }

    pub fn f32(&self, key: &str, min: f32, max: f32) -> Result<Option<f32>, ApiError> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Number(n)) => {
                let x = n.as_f64().unwrap_or(f64::NAN) as f32;
                if !(min..=max).contains(&x) {
                    return Err(ApiError::param(
                        key,
                        format!("'{key}' must be between {min} and {max}, got {n}"),
                    ));
                }
                Ok(Some(x))
            }
            Some(v) => Err(Self::wrong(key, "a number", v)),
        }
    }

    pub fn int(&self, key: &str, min: i64, max: i64) -> Result<Option<i64>, ApiError> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Number(n)) => {
                let x = match (n.as_i64(), n.as_f64()) {
                    (Some(i), _) => i,
                    (None, Some(f)) if f.fract() == 0.0 && f.abs() < 9e18 => f as i64,
                    _ => {
                        return Err(ApiError::param(
                            key,
                            format!("'{key}' must be an integer, got {n}"),
                        ))
                    }
                };
                if !(min..=max).contains(&x) {
                    return Err(ApiError::param(
                        key,
                        format!("'{key}' must be between {min} and {max}, got {x}"),
                    ));
                }
                Ok(Some(x))
            }
            Some(v) => Err(Self::wrong(key, "an integer", v)),
        }
    }

    /// A seed: any integer (negative ones are taken modulo 2^64).
    pub fn seed(&self, key: &str) -> Result<Option<u64>, ApiError> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Number(n)) => match (n.as_u64(), n.as_i64()) {
                (Some(u), _) => Ok(Some(u)),
                (None, Some(i)) => Ok(Some(i as u64)),
                _ => Err(ApiError::param(
                    key,
                    format!("'{key}' must be an integer, got {n}"),
                )),
            },
            Some(v) => Err(Self::wrong(key, "an integer", v)),
        }
    }

    pub fn str(&self, key: &str) -> Result<Option<&str>, ApiError> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(v) => Err(Self::wrong(key, "a string", v)),
        }
    }

    /// `stop`: a string or an array of strings.
    pub fn stop(&self, key: &str) -> Result<Vec<String>, ApiError> {
        match self.get(key) {
            None => Ok(Vec::new()),
            Some(Value::String(s)) => Ok(vec![s.clone()]),
            Some(Value::Array(a)) => {
                if a.len() > 16 {
                    return Err(ApiError::param(
                        key,
                        format!("'{key}' may hold at most 16 strings, got {}", a.len()),
                    ));
                }
                a.iter()
                    .map(|v| match v {
                        Value::String(s) => Ok(s.clone()),
                        other => Err(Self::wrong(key, "a string or an array of strings", other)),
                    })
                    .collect()
            }
            Some(v) => Err(Self::wrong(key, "a string or an array of strings", v)),
        }
    }
}

/// How the client wants log-probabilities.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogprobsMode {
    None,
    /// Chat: `logprobs: true`, `top_logprobs: n`.
    Chat(usize),
    /// Legacy completions: `logprobs: n`.
    Legacy(usize),
}

/// A parsed generation request.
pub struct Prepared {
    pub gen: GenRequest,
    pub stream: bool,
    pub include_usage: bool,
    pub logprobs: LogprobsMode,
    /// Reads calls out of the answer when the request has tools (and `tool_choice` is
    /// not `none`).
    pub tools: Option<ToolCallParser>,
}

/// What constrains the output: llama-server's `grammar` (GBNF) and `json_schema`
/// fields, and OpenAI's `response_format` (`text`, `json_object`, `json_schema` with
/// `name`, `schema`, `strict`; llama-server's `{"type": "json_object", "schema": ...}`
/// too). Returns the grammar and the field it came from; at most one may be given.
pub fn grammar_spec(f: &Fields<'_>) -> Result<Option<(GrammarSpec, String)>, ApiError> {
    let mut found: Vec<(GrammarSpec, String)> = Vec::new();
    if let Some(g) = f.str("grammar")? {
        if !g.trim().is_empty() {
            found.push((GrammarSpec::Gbnf(g.to_string()), "grammar".into()));
        }
    }
    match f.0.get("json_schema").filter(|v| !v.is_null()) {
        None => {}
        Some(v @ (Value::Object(_) | Value::Bool(_))) => {
            found.push((GrammarSpec::JsonSchema(v.clone()), "json_schema".into()))
        }
        Some(v) => return Err(Fields::wrong("json_schema", "a JSON schema object", v)),
    }
    match f.0.get("response_format").filter(|v| !v.is_null()) {
        None => {}
        Some(Value::Object(o)) => {
            let rf = Fields(o);
            let param = "response_format.type";
            match rf.str("type")? {
                Some("text") => {}
                Some("json_object") => match o.get("schema").filter(|v| !v.is_null()) {
                    Some(schema) => found.push((
                        GrammarSpec::JsonSchema(schema.clone()),
                        "response_format.schema".into(),
                    )),
                    None => found.push((GrammarSpec::JsonObject, "response_format".into())),
                },
                Some("json_schema") => {
                    // OpenAI: {"json_schema": {"name", "schema", "strict"}}; llama-server
                    // also takes {"schema": ...} directly
                    let (holder, base) = match o.get("json_schema").filter(|v| !v.is_null()) {
                        Some(Value::Object(js)) => (js, "response_format.json_schema"),
                        Some(v) => {
                            return Err(Fields::wrong(
                                "response_format.json_schema",
                                "an object with 'name' and 'schema'",
                                v,
                            ))
                        }
                        None => (o, "response_format"),
                    };
                    let h = Fields(holder);
                    h.str("name").map_err(|mut e| {
                        e.param = Some(format!("{base}.name"));
                        e
                    })?;
                    h.bool("strict").map_err(|mut e| {
                        e.param = Some(format!("{base}.strict"));
                        e
                    })?;
                    match holder.get("schema").filter(|v| !v.is_null()) {
                        Some(schema) => found.push((
                            GrammarSpec::JsonSchema(schema.clone()),
                            format!("{base}.schema"),
                        )),
                        None if base == "response_format" => {
                            return Err(ApiError::param(
                                "response_format.json_schema",
                                "'response_format' of type 'json_schema' needs 'json_schema': \
                                 {\"name\": ..., \"schema\": {...}}",
                            ))
                        }
                        None => found.push((GrammarSpec::JsonObject, base.to_string())),
                    }
                }
                Some(other) => {
                    return Err(ApiError::param(
                        param,
                        format!(
                            "'response_format.type' must be 'text', 'json_object' or \
                             'json_schema', got '{other}'"
                        ),
                    ))
                }
                None => {
                    return Err(ApiError::param(
                        param,
                        "'response_format' needs a 'type' ('text', 'json_object' or 'json_schema')",
                    ))
                }
            }
        }
        Some(v) => return Err(Fields::wrong("response_format", "an object", v)),
    }
    if found.len() > 1 {
        let names: Vec<&str> = found.iter().map(|(_, p)| p.as_str()).collect();
        return Err(ApiError::param(
            &found[1].1,
            format!(
                "give only one of 'grammar', 'json_schema' and 'response_format' (got {})",
                names.join(", ")
            ),
        ));
    }
    Ok(found.pop())
}

/// Compiles the request's grammar, if any, and names the field it came from; a bad one
/// is a 400 naming its field.
fn compile_grammar(
    f: &Fields<'_>,
    engine: &dyn Fn() -> GrammarEngine,
) -> Result<Option<(rustorch_llm::grammar::Constraint, String)>, ApiError> {
    let Some((spec, param)) = grammar_spec(f)? else {
        return Ok(None);
    };
    engine()
        .compile(&spec)
        .map(|c| Some((c, param.clone())))
        .map_err(|e| ApiError::param(&param, format!("'{param}': {e}")).code("invalid_grammar"))
}

/// The fields shared by chat and text completions.
fn common_fields(
    f: &Fields<'_>,
    tokenizer: &Tokenizer,
    chat: bool,
) -> Result<(GenRequest, bool, bool, LogprobsMode), ApiError> {
    if let Some(n) = f.int("n", i64::MIN, i64::MAX)? {
        if n != 1 {
            return Err(ApiError::param(
                "n",
                format!("only n = 1 is supported, got {n}"),
            ));
        }
    }
    f.str("model")?;
    let stream = f.bool("stream")?.unwrap_or(false);
    let include_usage = match f.0.get("stream_options").filter(|v| !v.is_null()) {
        None => false,
        Some(Value::Object(o)) => Fields(o).bool("include_usage")?.unwrap_or(false),
        Some(v) => return Err(Fields::wrong("stream_options", "an object", v)),
    };
    let mut max_tokens = f.int("max_tokens", 1, i64::MAX)?;
    if let Some(m) = f.int("max_completion_tokens", 1, i64::MAX)? {
        max_tokens = Some(m);
    }

    let mut p = SamplerParams::default();
    if let Some(t) = f.f32("temperature", 0.0, 100.0)? {
        p.temperature = t;
    }
    if let Some(x) = f.f32("top_p", 0.0, 1.0)? {
        p.top_p = x;
    }
    if let Some(k) = f.int("top_k", 0, i32::MAX as i64)? {
        p.top_k = k as i32;
    }
    if let Some(x) = f.f32("min_p", 0.0, 1.0)? {
        p.min_p = x;
    }
    if let Some(x) = f.f32("typical_p", 0.0, 1.0)? {
        p.typical_p = x;
    }
    if let Some(x) = f.f32("presence_penalty", -2.0, 2.0)? {
        p.presence_penalty = x;
    }
    if let Some(x) = f.f32("frequency_penalty", -2.0, 2.0)? {
        p.frequency_penalty = x;
    }
    if let Some(x) = f.f32("repeat_penalty", 1e-6, 100.0)? {
        p.repeat_penalty = x;
    }
    if let Some(n) = f.int("repeat_last_n", 0, 1 << 20)? {
        p.penalty_last_n = n as usize;
    }
    p.seed = f.seed("seed")?;
    p.ignore_eos = f.bool("ignore_eos")?.unwrap_or(false);
    p.eog_tokens = tokenizer.eog_ids().collect();
    p.logit_bias = logit_bias(f, tokenizer.n_vocab())?;

    let logprobs = if chat {
        let on = f.bool("logprobs")?.unwrap_or(false);
        let top = f.int("top_logprobs", 0, 20)?;
        match (on, top) {
            (false, Some(_)) => {
                return Err(ApiError::param(
                    "top_logprobs",
                    "'top_logprobs' needs 'logprobs' set to true",
                ))
            }
            (true, top) => LogprobsMode::Chat(top.unwrap_or(0) as usize),
            (false, None) => LogprobsMode::None,
        }
    } else {
        match f.int("logprobs", 0, 20)? {
            Some(n) => LogprobsMode::Legacy(n as usize),
            None => LogprobsMode::None,
        }
    };
    let gen = GenRequest {
        prompt: Vec::new(),
        sampling: p,
        max_tokens: max_tokens.map(|m| m as usize),
        stop: f.stop("stop")?,
        logprobs: match logprobs {
            LogprobsMode::None => None,
            LogprobsMode::Chat(n) | LogprobsMode::Legacy(n) => Some(n),
        },
        grammar: None,
    };
    Ok((gen, stream, include_usage, logprobs))
}

/// `logit_bias`: `{"token id": bias}`; a bias of `false` (or -100 and below) bans the
/// token.
fn logit_bias(
    f: &Fields<'_>,
    n_vocab: usize,
) -> Result<std::collections::HashMap<u32, f32>, ApiError> {
    let mut out = std::collections::HashMap::new();
    let Some(v) = f.0.get("logit_bias").filter(|v| !v.is_null()) else {
        return Ok(out);
    };
    let Value::Object(map) = v else {
        return Err(Fields::wrong(
            "logit_bias",
            "an object mapping token ids to biases",
            v,
        ));
    };
    for (k, b) in map {
        let id: u32 = k.trim().parse().map_err(|_| {
            ApiError::param(
                "logit_bias",
                format!("'logit_bias' key '{k}' is not a token id"),
            )
        })?;
        if id as usize >= n_vocab {
            return Err(ApiError::param(
                "logit_bias",
                format!("'logit_bias' token {id} is beyond the vocabulary ({n_vocab} tokens)"),
            ));
        }
        let bias = match b {
            Value::Number(n) => {
                let x = n.as_f64().unwrap_or(f64::NAN) as f32;
                if !(-100.0..=100.0).contains(&x) {
                    return Err(ApiError::param(
                        "logit_bias",
                        format!("'logit_bias' values must be between -100 and 100, got {n}"),
                    ));
                }
                if x <= -100.0 {
                    f32::NEG_INFINITY
                } else {
                    x
                }
            }
            Value::Bool(false) => f32::NEG_INFINITY,
            other => {
                return Err(ApiError::param(
                    "logit_bias",
                    format!(
                        "'logit_bias' values must be numbers (or false), got {}",
                        type_name(other)
                    ),
                ))
            }
        };
        out.insert(id, bias);
    }
    Ok(out)
}

/// One part of an array `content`: a string or `{"type": "text", "text": ...}`.
fn content_part<'a>(param: &str, part: &'a Value) -> Result<&'a str, ApiError> {
    let Value::Object(o) = part else {
        return part
            .as_str()
            .ok_or_else(|| ApiError::param(param, format!("'{param}' parts must be text parts")));
    };
    match o.get("type").and_then(Value::as_str) {
        Some("text") | None => o
            .get("text")
            .and_then(Value::as_str)
            .ok_or_else(|| ApiError::param(param, format!("'{param}' text parts need 'text'"))),
        Some(other) => Err(ApiError::param(
            param,
            format!("content parts of type '{other}' are not supported (text only)"),
        )),
    }
}

/// Text of a message's `content`: a string, null, or an array of text parts.
fn message_content(i: usize, v: Option<&Value>) -> Result<String, ApiError> {
    let param = format!("messages[{i}].content");
    match v {
        None | Some(Value::Null) => Ok(String::new()),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(parts)) => {
            let mut texts = Vec::new();
            for part in parts {
                texts.push(content_part(&param, part)?);
            }
            Ok(texts.join("\n"))
        }
        Some(other) => Err(ApiError::param(
            &param,
            format!(
                "'{param}' must be a string or an array of text parts, got {}",
                type_name(other)
            ),
        )),
    }
}

/// `POST /v1/chat/completions`: renders the messages with the chat template.
pub fn chat_request(
    body: &Map<String, Value>,
    tokenizer: &Tokenizer,
    template: &ChatTemplate,
    grammar: &dyn Fn() -> GrammarEngine,
) -> Result<Prepared, ApiError> {
    let f = Fields(body);
    let messages = match body.get("messages") {
        None | Some(Value::Null) => {
            return Err(ApiError::param("messages", "'messages' is required"))
        }
        Some(Value::Array(a)) if a.is_empty() => {
            return Err(ApiError::param("messages", "'messages' must not be empty"))
        }
        Some(Value::Array(a)) => a,
        Some(v) => return Err(Fields::wrong("messages", "an array of messages", v)),
    };
    let mut msgs = Vec::with_capacity(messages.len());
    for (i, m) in messages.iter().enumerate() {
        let Value::Object(o) = m else {
            return Err(Fields::wrong(&format!("messages[{i}]"), "an object", m));
        };
        let role = match o.get("role") {
            Some(Value::String(r)) => r.as_str(),
            Some(v) => return Err(Fields::wrong(&format!("messages[{i}].role"), "a string", v)),
            None => {
                return Err(ApiError::param(
                    &format!("messages[{i}].role"),
                    format!("'messages[{i}].role' is required"),
                ))
            }
        };
        // newer OpenAI clients send "developer" where templates know "system"
        let role = if role == "developer" { "system" } else { role };
        let content = message_content(i, o.get("content"))?;
        let mut msg = json!({"role": role, "content": content});
        match role {
            "assistant" => {
                if let Some(calls) = o.get("tool_calls").filter(|v| !v.is_null()) {
                    let calls =
                        tools::openai_tool_calls(&format!("messages[{i}].tool_calls"), calls)?;
                    if !calls.is_empty() {
                        msg["tool_calls"] = Value::Array(calls);
                    }
                }
            }
            "tool" => {
                for key in ["tool_call_id", "name"] {
                    let p = format!("messages[{i}].{key}");
                    if let Some(v) = Fields(o).str(key).map_err(|mut e| {
                        e.param = Some(p.clone());
                        e
                    })? {
                        msg[key] = Value::String(v.to_string());
                    }
                }
            }
            _ => {}
        }
        msgs.push(msg);
    }
    let tool_req = tools::openai_request(&f)?;
    let (mut gen, stream, include_usage, logprobs) = common_fields(&f, tokenizer, true)?;
    let own = compile_grammar(&f, grammar)?;
    let own_param = own.as_ref().map(|(_, p)| p.clone());
    gen.grammar = own.map(|(c, _)| c);
    let (rendered, tools) = tools::prepare(
        tool_req,
        msgs,
        template,
        tokenizer,
        Some(grammar),
        &mut gen,
        own_param.as_deref(),
    )?;
    let text = template.strip_special_affixes(&rendered, tokenizer.add_bos(), tokenizer.add_eos());
    tracing::debug!(prompt = %text, "rendered chat prompt");
    gen.prompt = tokenizer
        .encode(text, true, true)
        .map_err(|e| ApiError::param("messages", e.to_string()))?;
    for s in template.stop_strings() {
        if !gen.stop.contains(s) {
            gen.stop.push(s.clone());
        }
    }
    Ok(Prepared {
        gen,
        stream,
        include_usage,
        logprobs,
        tools,
    })
}

/// `POST /v1/completions`: `prompt` is a string, an array of one string, or an array of
/// token ids.
pub fn completion_request(
    body: &Map<String, Value>,
    tokenizer: &Tokenizer,
    grammar: &dyn Fn() -> GrammarEngine,
) -> Result<Prepared, ApiError> {
    let f = Fields(body);
    let encode = |s: &str| {
        tokenizer
            .encode(s, true, true)
            .map_err(|e| ApiError::param("prompt", e.to_string()))
    };
    let prompt = match body.get("prompt") {
        None | Some(Value::Null) => return Err(ApiError::param("prompt", "'prompt' is required")),
        Some(Value::String(s)) => encode(s)?,
        Some(Value::Array(a)) if a.len() == 1 && a[0].is_string() => {
            encode(a[0].as_str().unwrap_or_default())?
        }
        Some(Value::Array(a)) if !a.is_empty() && a.iter().all(Value::is_number) => {
            let mut ids = Vec::with_capacity(a.len());
            for v in a {
                match v.as_u64() {
                    Some(id) if (id as usize) < tokenizer.n_vocab() => ids.push(id as u32),
                    _ => {
                        return Err(ApiError::param(
                            "prompt",
                            format!(
                                "prompt token {v} is not a token id (the vocabulary has {} tokens)",
                                tokenizer.n_vocab()
                            ),
                        ))
                    }
                }
            }
            ids
        }
        Some(Value::Array(_)) => {
            return Err(ApiError::param(
                "prompt",
                "'prompt' must be a string, an array of one string, or an array of token ids \
                 (several prompts in one request are not supported)",
            ))
        }
        Some(v) => return Err(Fields::wrong("prompt", "a string", v)),
    };
    if f.bool("echo")? == Some(true) {
        return Err(ApiError::param("echo", "'echo' is not supported"));
    }
    if let Some(b) = f.int("best_of", i64::MIN, i64::MAX)? {
        if b != 1 {
            return Err(ApiError::param("best_of", "only best_of = 1 is supported"));
        }
    }
    let (mut gen, stream, include_usage, logprobs) = common_fields(&f, tokenizer, false)?;
    gen.grammar = compile_grammar(&f, grammar)?.map(|(c, _)| c);
    gen.prompt = prompt;
    Ok(Prepared {
        gen,
        stream,
        include_usage,
        logprobs,
        tools: None,
    })
}
