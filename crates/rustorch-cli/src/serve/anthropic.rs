//! Anthropic's Messages API: `POST /v1/messages` and `POST /v1/messages/count_tokens`.
//!
//! Messages (text content blocks) and `system` are rendered with the model's chat
//! template, as `/v1/chat/completions` does, and run on the same scheduler. Answers,
//! streamed events and errors take Anthropic's shapes (errors are reshaped for these
//! paths by [`routes::error_shape`](super::routes::error_shape)).
//!
//! `stop_sequences` are matched here rather than in the scheduler, so that the answer
//! can say which one ended it (`stop_reason: "stop_sequence"`, `stop_sequence`); once
//! one appears the request's channel is dropped, which ends it in the scheduler.
//!
//! Tools (`tools` with `input_schema`, `tool_choice` `auto` / `any` / `tool` / `none`)
//! go through the same tool-calling core as `/v1/chat/completions`
//! ([`super::tools`]): answers carry `tool_use` blocks (`stop_reason: "tool_use"`,
//! streamed as `input_json_delta`s), and `tool_use` / `tool_result` blocks of earlier
//! turns are rendered as the template's calls and tool messages.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures_util::stream::{self, Stream};
use rustorch_llm::chat::ChatTemplate;
use rustorch_llm::engine::TextStream;
use rustorch_llm::grammar::GrammarEngine;
use rustorch_llm::sampler::SamplerParams;
use rustorch_llm::scheduler::{Event, FinishReason, GenRequest};
use rustorch_llm::tokenizer::Tokenizer;
use rustorch_llm::tools::{ToolCallParser, ToolDelta};
use serde_json::{json, Map, Value};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

use super::api::{self, json_response, ApiError, Fields};
use super::routes::ChannelSink;
use super::tools;
use super::AppState;

/// Whether a path belongs to this API (its errors take Anthropic's shape).
pub fn is_anthropic_path(path: &str) -> bool {
    path == "/v1/messages" || path.starts_with("/v1/messages/")
}

/// Anthropic's error type for an HTTP status.
pub fn error_type(status: StatusCode) -> &'static str {
    match status.as_u16() {
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        503 | 529 => "overloaded_error",
        s if s >= 500 => "api_error",
        _ => "invalid_request_error",
    }
}

/// `{"type": "error", "error": {"type", "message"}}`.
pub fn error_body(status: StatusCode, message: &str) -> Value {
    json!({
        "type": "error",
        "error": {"type": error_type(status), "message": message},
    })
}

/// Rewrites an error response in OpenAI's shape (`{"error": {"message", ...}}`) into
/// Anthropic's, keeping its status and headers.
pub async fn reshape_error(res: Response) -> Response {
    let (mut parts, body) = res.into_parts();
    let bytes = axum::body::to_bytes(body, 1 << 20)
        .await
        .unwrap_or_default();
    let message = serde_json::from_slice::<Value>(&bytes)
        .ok()
        .and_then(|v| {
            v.pointer("/error/message")
                .and_then(Value::as_str)
                .map(str::to_string)
        })
        .unwrap_or_else(|| String::from_utf8_lossy(&bytes).trim().to_string());
    let body = error_body(parts.status, &message).to_string();
    parts.headers.remove(axum::http::header::CONTENT_LENGTH);
    parts.headers.insert(
        axum::http::header::CONTENT_TYPE,
        axum::http::HeaderValue::from_static("application/json"),
    );
    Response::from_parts(parts, axum::body::Body::from(body))
}

/// A parsed Messages request.
struct Parsed {
    gen: GenRequest,
    stream: bool,
    /// The client's `stop_sequences` (matched here, not by the scheduler).
    stop_sequences: Vec<String>,
    /// Reads `tool_use` blocks out of the answer when the request has tools.
    tools: Option<ToolCallParser>,
}

/// Text of `content`: a string or an array of text blocks.
fn blocks_text(param: &str, v: &Value) -> Result<String, ApiError> {
    match v {
        Value::String(s) => Ok(s.clone()),
        Value::Array(blocks) => {
            let mut texts = Vec::with_capacity(blocks.len());
            for (j, b) in blocks.iter().enumerate() {
                let p = format!("{param}[{j}]");
                let Value::Object(o) = b else {
                    return Err(Fields::wrong(&p, "a content block object", b));
                };
                match o.get("type").and_then(Value::as_str) {
                    Some("text") => match o.get("text") {
                        Some(Value::String(t)) => texts.push(t.as_str()),
                        Some(other) => {
                            return Err(Fields::wrong(&format!("{p}.text"), "a string", other))
                        }
                        None => {
                            return Err(ApiError::param(
                                &format!("{p}.text"),
                                format!("{p}.text: Field required"),
                            ))
                        }
                    },
                    Some(t @ ("tool_use" | "tool_result" | "server_tool_use")) => {
                        return Err(ApiError::param(
                            &p,
                            format!(
                                "{p}: content blocks of type '{t}' belong in messages (text \
                                 blocks only here)"
                            ),
                        ))
                    }
                    Some(t) => {
                        return Err(ApiError::param(
                            &p,
                            format!(
                                "{p}: content blocks of type '{t}' are not supported (text only)"
                            ),
                        ))
                    }
                    None => {
                        return Err(ApiError::param(
                            &format!("{p}.type"),
                            format!("{p}.type: Field required"),
                        ))
                    }
                }
            }
            Ok(texts.join("\n"))
        }
        other => Err(Fields::wrong(
            param,
            "a string or an array of content blocks",
            other,
        )),
    }
}

/// A string field of a content block.
fn block_str<'a>(o: &'a Map<String, Value>, p: &str, key: &str) -> Result<&'a str, ApiError> {
    match o.get(key) {
        Some(Value::String(s)) => Ok(s),
        Some(v) => Err(Fields::wrong(&format!("{p}.{key}"), "a string", v)),
        None => Err(ApiError::param(
            &format!("{p}.{key}"),
            format!("{p}.{key}: Field required"),
        )),
    }
}

/// One message's content as chat messages: text blocks join into the message's
/// text; an assistant's `tool_use` blocks become its `tool_calls`; a user's
/// `tool_result` blocks become `tool` messages, put before the user's text.
fn message_parts(role: &str, param: &str, v: &Value) -> Result<Vec<Value>, ApiError> {
    let blocks = match v {
        Value::String(s) => return Ok(vec![json!({"role": role, "content": s})]),
        Value::Array(blocks) => blocks,
        other => {
            return Err(Fields::wrong(
                param,
                "a string or an array of content blocks",
                other,
            ))
        }
    };
    let mut texts = Vec::new();
    let mut calls = Vec::new();
    let mut results = Vec::new();
    for (j, b) in blocks.iter().enumerate() {
        let p = format!("{param}[{j}]");
        let Value::Object(o) = b else {
            return Err(Fields::wrong(&p, "a content block object", b));
        };
        match o.get("type").and_then(Value::as_str) {
            Some("text") => texts.push(block_str(o, &p, "text")?.to_string()),
            Some("tool_use") if role == "assistant" => {
                let input = match o.get("input") {
                    Some(v @ Value::Object(_)) => v.clone(),
                    None | Some(Value::Null) => json!({}),
                    Some(v) => return Err(Fields::wrong(&format!("{p}.input"), "an object", v)),
                };
                calls.push(tools::call_json(
                    block_str(o, &p, "id")?,
                    block_str(o, &p, "name")?,
                    input,
                ));
            }
            Some("tool_result") if role == "user" => {
                let id = block_str(o, &p, "tool_use_id")?;
                let mut content = match o.get("content") {
                    None | Some(Value::Null) => String::new(),
                    Some(v) => blocks_text(&format!("{p}.content"), v)?,
                };
                if o.get("is_error") == Some(&Value::Bool(true)) {
                    content = format!("Error: {content}");
                }
                results.push(json!({"role": "tool", "tool_call_id": id, "content": content}));
            }
            Some(t @ ("tool_use" | "tool_result")) => {
                return Err(ApiError::param(
                    &p,
                    format!("{p}: '{t}' blocks cannot be in a message of role '{role}'"),
                ))
            }
            Some(t) => {
                return Err(ApiError::param(
                    &p,
                    format!(
                        "{p}: content blocks of type '{t}' are not supported (text, tool_use \
                         and tool_result only)"
                    ),
                ))
            }
            None => {
                return Err(ApiError::param(
                    &format!("{p}.type"),
                    format!("{p}.type: Field required"),
                ))
            }
        }
    }
    let text = texts.join("\n");
    let mut out = results;
    if role == "assistant" {
        let mut m = json!({"role": role, "content": text});
        if !calls.is_empty() {
            m["tool_calls"] = Value::Array(calls);
        }
        out.push(m);
    } else if !text.is_empty() || out.is_empty() {
        out.push(json!({"role": role, "content": text}));
    }
    Ok(out)
}

/// Parses a Messages request and renders its prompt. `engine`: the grammar compiler
/// for tool calls; `None` for `count_tokens`, which needs no grammar and does not ask
/// for `max_tokens`.
fn parse(
    body: &Map<String, Value>,
    tokenizer: &Tokenizer,
    template: &ChatTemplate,
    engine: Option<&dyn Fn() -> GrammarEngine>,
) -> Result<Parsed, ApiError> {
    let count_only = engine.is_none();
    let f = Fields(body);
    f.str("model")?;
    let tool_req = tools::anthropic_request(body)?;
    let max_tokens = f.int("max_tokens", 1, i64::MAX)?;
    if max_tokens.is_none() && !count_only {
        return Err(ApiError::param("max_tokens", "max_tokens: Field required"));
    }

    let mut msgs = Vec::new();
    match body.get("system") {
        None | Some(Value::Null) => {}
        Some(v) => {
            let text = blocks_text("system", v)?;
            if !text.is_empty() {
                msgs.push(json!({"role": "system", "content": text}));
            }
        }
    }
    let messages = match body.get("messages") {
        None | Some(Value::Null) => {
            return Err(ApiError::param("messages", "messages: Field required"))
        }
        Some(Value::Array(a)) if a.is_empty() => {
            return Err(ApiError::param(
                "messages",
                "messages: at least one message is required",
            ))
        }
        Some(Value::Array(a)) => a,
        Some(v) => return Err(Fields::wrong("messages", "an array of messages", v)),
    };
    for (i, m) in messages.iter().enumerate() {
        let p = format!("messages[{i}]");
        let Value::Object(o) = m else {
            return Err(Fields::wrong(&p, "an object", m));
        };
        let role = match o.get("role") {
            Some(Value::String(r)) if r == "user" || r == "assistant" => r.as_str(),
            Some(Value::String(r)) => {
                return Err(ApiError::param(
                    &format!("{p}.role"),
                    format!("{p}.role: must be 'user' or 'assistant', got '{r}'"),
                ))
            }
            Some(v) => return Err(Fields::wrong(&format!("{p}.role"), "a string", v)),
            None => {
                return Err(ApiError::param(
                    &format!("{p}.role"),
                    format!("{p}.role: Field required"),
                ))
            }
        };
        match o.get("content") {
            None | Some(Value::Null) => {
                return Err(ApiError::param(
                    &format!("{p}.content"),
                    format!("{p}.content: Field required"),
                ))
            }
            Some(v) => msgs.extend(message_parts(role, &format!("{p}.content"), v)?),
        }
    }
    // a last assistant message (without calls) is a prefill: the answer continues it
    let prefill = match msgs.last() {
        Some(m) if m["role"] == "assistant" && m.get("tool_calls").is_none() => msgs
            .pop()
            .and_then(|m| m["content"].as_str().map(str::to_string)),
        _ => None,
    };
    let mut gen = GenRequest::default();
    let (rendered, tool_parser) =
        tools::prepare(tool_req, msgs, template, tokenizer, engine, &mut gen, None)?;
    let mut text = template
        .strip_special_affixes(&rendered, tokenizer.add_bos(), tokenizer.add_eos())
        .to_string();
    if let Some(p) = prefill {
        text.push_str(&p);
    }
    tracing::debug!(prompt = %text, "rendered messages prompt");
    let prompt = tokenizer
        .encode(&text, true, true)
        .map_err(|e| ApiError::param("messages", e.to_string()))?;

    let mut p = SamplerParams {
        // Anthropic's default
        temperature: 1.0,
        ..SamplerParams::default()
    };
    if let Some(t) = f.f32("temperature", 0.0, 1.0)? {
        p.temperature = t;
    }
    if let Some(x) = f.f32("top_p", 0.0, 1.0)? {
        p.top_p = x;
    }
    if let Some(k) = f.int("top_k", 0, i32::MAX as i64)? {
        p.top_k = k as i32;
    }
    p.eog_tokens = tokenizer.eog_ids().collect();
    let stop_sequences: Vec<String> = f
        .stop("stop_sequences")?
        .into_iter()
        .filter(|s| !s.is_empty())
        .collect();
    let stream = f.bool("stream")?.unwrap_or(false);
    // the call marker's ban (tool_choice none) goes with the sampling settings
    p.logit_bias = std::mem::take(&mut gen.sampling.logit_bias);
    Ok(Parsed {
        gen: GenRequest {
            prompt,
            sampling: p,
            max_tokens: max_tokens.map(|m| m as usize),
            stop: template.stop_strings().to_vec(),
            logprobs: None,
            grammar: gen.grammar,
        },
        stream,
        stop_sequences,
        tools: tool_parser,
    })
}

/// Parses on a blocking thread (tokenizing and rendering can take a while).
async fn prepare(
    state: &Arc<AppState>,
    body: Bytes,
    count_only: bool,
) -> Result<(Arc<super::Ready>, Parsed), ApiError> {
    let r = state.ready.get().ok_or_else(ApiError::loading)?.clone();
    let obj = api::parse_object(&body)?;
    let r2 = r.clone();
    let parsed = tokio::task::spawn_blocking(move || {
        // the grammar engine (the vocabulary's token trie) is built at the first request
        // that needs it
        let engine = || {
            r2.grammar
                .get_or_init(|| GrammarEngine::new(r2.tokenizer.clone()))
                .clone()
        };
        let engine: Option<&dyn Fn() -> GrammarEngine> = (!count_only).then_some(&engine);
        parse(&obj, &r2.tokenizer, &r2.template, engine)
    })
    .await
    .map_err(|_| ApiError::internal("the request could not be prepared"))??;
    Ok((r, parsed))
}

pub async fn count_tokens(State(state): State<Arc<AppState>>, body: Bytes) -> Response {
    match prepare(&state, body, true).await {
        Ok((_, p)) => json_response(StatusCode::OK, &json!({"input_tokens": p.gen.prompt.len()})),
        Err(e) => e.into_response(),
    }
}

pub async fn messages(State(state): State<Arc<AppState>>, body: Bytes) -> Response {
    match messages_inner(state, body).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

async fn messages_inner(state: Arc<AppState>, body: Bytes) -> Result<Response, ApiError> {
    let (r, parsed) = prepare(&state, body, false).await?;
    let input_tokens = parsed.gen.prompt.len();
    let (tx, rx) = unbounded_channel();
    let cfg = r.sched.config();
    r.sched
        .submit(parsed.gen, Box::new(ChannelSink(tx)))
        .map_err(|e| ApiError::from_submit(e, "messages", cfg.n_slots, cfg.n_ctx))?;
    let run = Run {
        rx: Some(rx),
        watch: StopWatch::new(parsed.stop_sequences),
        n_out: 0,
        pending: VecDeque::new(),
        marker: parsed
            .tools
            .as_ref()
            .and_then(|t| t.marker().map(|(id, text)| (id, text.to_string()))),
    };
    let blocks = Blocks::new(parsed.tools);
    let meta = Meta {
        id: format!("msg_{:024x}", rand::random::<u128>() >> 32),
        model: state.model_name.clone(),
        input_tokens,
    };
    if parsed.stream {
        Ok(Sse::new(sse_stream(meta, run, blocks))
            .keep_alive(KeepAlive::default())
            .into_response())
    } else {
        collect(meta, run, blocks).await
    }
}

struct Meta {
    id: String,
    model: String,
    input_tokens: usize,
}

/// Finds the client's stop sequences in the generated text, holding back text that
/// could still become one.
struct StopWatch {
    stream: TextStream,
    /// Everything received, the stop sequence included.
    raw: String,
    stops: Vec<String>,
}

impl StopWatch {
    fn new(stops: Vec<String>) -> Self {
        StopWatch {
            stream: TextStream::new(stops.clone()),
            raw: String::new(),
            stops,
        }
    }

    /// Text now safe to show, and the stop sequence that appeared, if one did.
    fn push(&mut self, text: &str) -> (String, Option<String>) {
        self.raw.push_str(text);
        let (out, stopped) = self.stream.push(text.as_bytes());
        if !stopped {
            return (out, None);
        }
        let at = self.stream.text.len();
        let which = self
            .stops
            .iter()
            .filter(|s| {
                self.raw
                    .get(at..)
                    .is_some_and(|r| r.starts_with(s.as_str()))
            })
            .max_by_key(|s| s.len())
            .cloned()
            .unwrap_or_default();
        (out, Some(which))
    }

    fn finish(&mut self) -> String {
        self.stream.finish(false)
    }
}

/// What a generation yields, in order: text, then one end or failure.
enum Step {
    Text(String),
    End {
        stop_reason: &'static str,
        stop_sequence: Option<String>,
        output_tokens: usize,
    },
    Fail(ApiError),
}

struct Run {
    /// Dropped when a stop sequence ends the answer (which ends the request).
    rx: Option<UnboundedReceiver<Event>>,
    watch: StopWatch,
    /// Tokens generated so far.
    n_out: usize,
    pending: VecDeque<Step>,
    /// A control token that opens tool calls, and the text it stands for (the output
    /// leaves control tokens out; the call parser needs to see it).
    marker: Option<(u32, String)>,
}

impl Run {
    /// The next step; `None` after the end or a failure.
    async fn next(&mut self) -> Option<Step> {
        loop {
            if let Some(s) = self.pending.pop_front() {
                return Some(s);
            }
            let rx = self.rx.as_mut()?;
            match rx.recv().await {
                Some(Event::Token {
                    token, mut text, ..
                }) => {
                    if token.is_some() {
                        self.n_out += 1;
                    }
                    if let (Some(t), Some((id, marker))) = (token, &self.marker) {
                        if t == *id {
                            text.push_str(marker);
                        }
                    }
                    let (out, stop) = self.watch.push(&text);
                    if !out.is_empty() {
                        self.pending.push_back(Step::Text(out));
                    }
                    if let Some(s) = stop {
                        self.rx = None;
                        self.pending.push_back(Step::End {
                            stop_reason: "stop_sequence",
                            stop_sequence: Some(s),
                            output_tokens: self.n_out,
                        });
                    }
                }
                Some(Event::Done(c)) => {
                    self.rx = None;
                    if c.finish == FinishReason::Cancelled {
                        self.pending.push_back(Step::Fail(
                            ApiError::new(
                                StatusCode::SERVICE_UNAVAILABLE,
                                "unavailable_error",
                                "the request was cancelled: the server is shutting down",
                            )
                            .code("shutting_down"),
                        ));
                        continue;
                    }
                    let rest = self.watch.finish();
                    if !rest.is_empty() {
                        self.pending.push_back(Step::Text(rest));
                    }
                    self.pending.push_back(Step::End {
                        stop_reason: match c.finish {
                            // a request ended by the server's shutdown is cut short too
                            FinishReason::Length | FinishReason::Interrupted => "max_tokens",
                            _ => "end_turn",
                        },
                        stop_sequence: None,
                        output_tokens: c.completion_tokens,
                    });
                }
                Some(Event::Error(e)) => {
                    self.rx = None;
                    self.pending.push_back(Step::Fail(ApiError::internal(e)));
                }
                None => {
                    self.rx = None;
                    self.pending.push_back(Step::Fail(ApiError::internal(
                        "generation stopped unexpectedly",
                    )));
                }
            }
        }
    }
}

/// Waits for the whole answer.
async fn collect(meta: Meta, mut run: Run, mut blocks: Blocks) -> Result<Response, ApiError> {
    let mut text = String::new();
    while let Some(step) = run.next().await {
        match step {
            Step::Text(t) => text.push_str(&t),
            Step::Fail(e) => return Err(e),
            Step::End {
                stop_reason,
                stop_sequence,
                output_tokens,
            } => {
                let (content, stop_reason) = match blocks.tools.as_mut() {
                    None => (json!([{"type": "text", "text": text}]), stop_reason),
                    Some(parser) => {
                        parser.push(None, &text);
                        let parsed = parser.result();
                        let mut content = Vec::new();
                        if !parsed.content.trim().is_empty() {
                            content.push(json!({"type": "text", "text": parsed.content}));
                        }
                        for c in &parsed.calls {
                            content.push(json!({
                                "type": "tool_use",
                                "id": tools::call_id("toolu_"),
                                "name": c.name,
                                "input": tools::arguments_object(&c.arguments),
                            }));
                        }
                        let reason = if parsed.calls.is_empty() || stop_reason != "end_turn" {
                            stop_reason
                        } else {
                            "tool_use"
                        };
                        (Value::Array(content), reason)
                    }
                };
                let body = json!({
                    "id": meta.id,
                    "type": "message",
                    "role": "assistant",
                    "model": meta.model,
                    "content": content,
                    "stop_reason": stop_reason,
                    "stop_sequence": stop_sequence,
                    "usage": {
                        "input_tokens": meta.input_tokens,
                        "output_tokens": output_tokens,
                    },
                });
                return Ok(json_response(StatusCode::OK, &body));
            }
        }
    }
    Err(ApiError::internal("generation stopped unexpectedly"))
}

fn event(name: &str, data: Value) -> SseEvent {
    SseEvent::default().event(name).data(data.to_string())
}

/// The content blocks of a streamed answer: one text block without tools; with tools,
/// text and `tool_use` blocks in the order the answer gives them.
struct Blocks {
    tools: Option<ToolCallParser>,
    /// The block being written: its index and whether it is text.
    open: Option<(usize, bool)>,
    next: usize,
    /// `tool_use` blocks so far.
    calls: usize,
}

impl Blocks {
    fn new(tools: Option<ToolCallParser>) -> Self {
        Blocks {
            tools,
            open: None,
            next: 0,
            calls: 0,
        }
    }

    fn start(&mut self, block: Value, is_text: bool, out: &mut VecDeque<SseEvent>) -> usize {
        self.close(out);
        let index = self.next;
        self.next += 1;
        self.open = Some((index, is_text));
        out.push_back(event(
            "content_block_start",
            json!({"type": "content_block_start", "index": index, "content_block": block}),
        ));
        index
    }

    fn close(&mut self, out: &mut VecDeque<SseEvent>) {
        if let Some((index, _)) = self.open.take() {
            out.push_back(event(
                "content_block_stop",
                json!({"type": "content_block_stop", "index": index}),
            ));
        }
    }

    fn text_delta(&mut self, text: String, out: &mut VecDeque<SseEvent>) {
        let index = match self.open {
            Some((i, true)) => i,
            _ => self.start(json!({"type": "text", "text": ""}), true, out),
        };
        out.push_back(event(
            "content_block_delta",
            json!({
                "type": "content_block_delta",
                "index": index,
                "delta": {"type": "text_delta", "text": text},
            }),
        ));
    }

    /// Streams a piece of the answer.
    fn push(&mut self, text: String, out: &mut VecDeque<SseEvent>) {
        let deltas = match self.tools.as_mut() {
            None => return self.text_delta(text, out),
            Some(p) => p.push(None, &text),
        };
        self.deltas(deltas, out);
    }

    fn deltas(&mut self, deltas: Vec<ToolDelta>, out: &mut VecDeque<SseEvent>) {
        for d in deltas {
            match d {
                ToolDelta::Content(t) => self.text_delta(t, out),
                ToolDelta::CallStart { name, .. } => {
                    self.calls += 1;
                    let block = json!({
                        "type": "tool_use",
                        "id": tools::call_id("toolu_"),
                        "name": name,
                        "input": {},
                    });
                    self.start(block, false, out);
                }
                ToolDelta::Arguments { text, .. } => {
                    if let Some((index, false)) = self.open {
                        out.push_back(event(
                            "content_block_delta",
                            json!({
                                "type": "content_block_delta",
                                "index": index,
                                "delta": {"type": "input_json_delta", "partial_json": text},
                            }),
                        ));
                    }
                }
            }
        }
    }

    /// Ends the answer: what the call parser held back, and the open block closed.
    fn end(&mut self, out: &mut VecDeque<SseEvent>) {
        let deltas = self.tools.as_mut().map(|p| p.finish()).unwrap_or_default();
        self.deltas(deltas, out);
        self.close(out);
    }
}

/// Anthropic's events: `message_start`, `content_block_start`, `ping`,
/// `content_block_delta`s, `content_block_stop`, `message_delta`, `message_stop`
/// (or an `error` event). Without tools the answer is one text block, opened at once;
/// with tools each block opens when its first piece comes.
fn sse_stream(
    meta: Meta,
    run: Run,
    mut blocks: Blocks,
) -> impl Stream<Item = Result<SseEvent, Infallible>> {
    let mut out = VecDeque::new();
    out.push_back(event(
        "message_start",
        json!({
            "type": "message_start",
            "message": {
                "id": meta.id,
                "type": "message",
                "role": "assistant",
                "model": meta.model,
                "content": [],
                "stop_reason": null,
                "stop_sequence": null,
                "usage": {"input_tokens": meta.input_tokens, "output_tokens": 0},
            },
        }),
    ));
    if blocks.tools.is_none() {
        blocks.start(json!({"type": "text", "text": ""}), true, &mut out);
    }
    out.push_back(event("ping", json!({"type": "ping"})));
    stream::unfold(
        (run, out, blocks, false),
        |(mut run, mut out, mut blocks, mut done)| async move {
            loop {
                if let Some(e) = out.pop_front() {
                    return Some((Ok(e), (run, out, blocks, done)));
                }
                if done {
                    return None;
                }
                match run.next().await {
                    Some(Step::Text(t)) => blocks.push(t, &mut out),
                    Some(Step::End {
                        stop_reason,
                        stop_sequence,
                        output_tokens,
                    }) => {
                        blocks.end(&mut out);
                        let stop_reason = if blocks.calls > 0 && stop_reason == "end_turn" {
                            "tool_use"
                        } else {
                            stop_reason
                        };
                        out.push_back(event(
                            "message_delta",
                            json!({
                                "type": "message_delta",
                                "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                                "usage": {"output_tokens": output_tokens},
                            }),
                        ));
                        out.push_back(event("message_stop", json!({"type": "message_stop"})));
                        done = true;
                    }
                    Some(Step::Fail(e)) => {
                        out.push_back(event("error", error_body(e.status, &e.message)));
                        done = true;
                    }
                    None => done = true,
                }
            }
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stop_watch_names_the_stop_sequence_and_holds_back_prefixes() {
        let mut w = StopWatch::new(vec!["END".into(), "xy".into()]);
        assert_eq!(w.push("hello E"), ("hello ".to_string(), None));
        assert_eq!(w.push("N"), (String::new(), None));
        let (out, stop) = w.push("D and more");
        assert_eq!(out, "");
        assert_eq!(stop.as_deref(), Some("END"));

        let mut w = StopWatch::new(vec!["END".into()]);
        assert_eq!(w.push("ab E").0, "ab ");
        assert_eq!(w.finish(), "E");
    }

    #[test]
    fn error_types_follow_anthropic() {
        assert_eq!(error_type(StatusCode::BAD_REQUEST), "invalid_request_error");
        assert_eq!(error_type(StatusCode::UNAUTHORIZED), "authentication_error");
        assert_eq!(error_type(StatusCode::NOT_FOUND), "not_found_error");
        assert_eq!(
            error_type(StatusCode::TOO_MANY_REQUESTS),
            "rate_limit_error"
        );
        assert_eq!(
            error_type(StatusCode::SERVICE_UNAVAILABLE),
            "overloaded_error"
        );
        assert_eq!(error_type(StatusCode::INTERNAL_SERVER_ERROR), "api_error");
        assert!(is_anthropic_path("/v1/messages"));
        assert!(is_anthropic_path("/v1/messages/count_tokens"));
        assert!(!is_anthropic_path("/v1/chat/completions"));
    }
}
