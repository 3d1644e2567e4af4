//! HTTP handlers: OpenAI endpoints, tokenizer endpoints, health and metrics.

use std::convert::Infallible;
use std::fmt::Write as _;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{Request, State};
use axum::http::{header, Method, StatusCode, Uri};
use axum::middleware::Next;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures_util::stream::{self, Stream};
use rustorch_llm::grammar::GrammarEngine;
use rustorch_llm::sampler::Logprobs;
use rustorch_llm::scheduler::{Completion, Event, EventSink, FinishReason};
use rustorch_llm::tokenizer::Tokenizer;
use rustorch_llm::tools::ToolCallParser;
use serde_json::{json, Value};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};

use super::anthropic;
use super::api::{self, json_response, ApiError, Fields, LogprobsMode, Prepared};
use super::tools::{self as server_tools, OpenAiCalls};
use super::{AppState, Ready};

/// Events of one request, from the engine thread to its handler.
pub(super) struct ChannelSink(pub(super) UnboundedSender<Event>);

impl EventSink for ChannelSink {
    fn send(&mut self, event: Event) -> bool {
        self.0.send(event).is_ok()
    }
    fn is_closed(&self) -> bool {
        self.0.is_closed()
    }
}

fn now_secs() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn new_id(prefix: &str) -> String {
    format!("{prefix}-{:024x}", rand::random::<u128>() >> 32)
}

fn ready(state: &AppState) -> Result<&Arc<Ready>, ApiError> {
    state.ready.get().ok_or_else(ApiError::loading)
}

/// Rejects every request but `/health` without the API key, when one is set. The key
/// is taken as `Authorization: Bearer KEY` (OpenAI) or `x-api-key: KEY` (Anthropic), on
/// every endpoint.
pub async fn auth(State(state): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    if let Some(key) = &state.api_key {
        if req.uri().path() != "/health" {
            let headers = req.headers();
            let bearer = headers
                .get(header::AUTHORIZATION)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.strip_prefix("Bearer "))
                .map(str::trim);
            let x_api_key = headers
                .get("x-api-key")
                .and_then(|v| v.to_str().ok())
                .map(str::trim);
            let ok =
                |g: Option<&str>| g.is_some_and(|g| constant_time_eq(g.as_bytes(), key.as_bytes()));
            if !(ok(bearer) || ok(x_api_key)) {
                return ApiError::unauthorized().into_response();
            }
        }
    }
    next.run(req).await
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Turns the framework's own plain-text errors (405, 413, ...) into OpenAI's shape, and
/// every error on the Anthropic paths (`/v1/messages...`) into Anthropic's.
pub async fn error_shape(req: Request, next: Next) -> Response {
    let method = req.method().clone();
    let path = req.uri().path().to_string();
    let res = next.run(req).await;
    let status = res.status();
    let is_json = res
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/json"));
    if !(status.is_client_error() || status.is_server_error()) {
        return res;
    }
    let anthropic = anthropic::is_anthropic_path(&path);
    if is_json {
        return if anthropic {
            anthropic::reshape_error(res).await
        } else {
            res
        };
    }
    let (parts, body) = res.into_parts();
    let text = axum::body::to_bytes(body, 64 * 1024)
        .await
        .map(|b| String::from_utf8_lossy(&b).trim().to_string())
        .unwrap_or_default();
    let message = match status {
        StatusCode::METHOD_NOT_ALLOWED => format!("method {method} is not allowed on {path}"),
        StatusCode::PAYLOAD_TOO_LARGE => "the request body is too large".to_string(),
        _ if text.is_empty() => status
            .canonical_reason()
            .unwrap_or("request failed")
            .to_string(),
        _ => text,
    };
    let kind = if status.is_server_error() {
        "server_error"
    } else {
        "invalid_request_error"
    };
    let mut out = ApiError::new(status, kind, message).into_response();
    if let Some(allow) = parts.headers.get(header::ALLOW) {
        out.headers_mut().insert(header::ALLOW, allow.clone());
    }
    if anthropic {
        return anthropic::reshape_error(out).await;
    }
    out
}

pub async fn not_found(method: Method, uri: Uri) -> Response {
    ApiError::new(
        StatusCode::NOT_FOUND,
        "invalid_request_error",
        format!("Invalid URL ({method} {})", uri.path()),
    )
    .code("not_found")
    .into_response()
}

/// 200 `{"status":"ok"}`; 503 `{"status":"loading"}` while the model loads and
/// `{"status":"draining"}` once the server is shutting down.
pub async fn health(State(state): State<Arc<AppState>>) -> Response {
    if state.is_draining() {
        return json_response(
            StatusCode::SERVICE_UNAVAILABLE,
            &json!({"status": "draining"}),
        );
    }
    match state.ready.get() {
        Some(_) => json_response(StatusCode::OK, &json!({"status": "ok"})),
        None => json_response(
            StatusCode::SERVICE_UNAVAILABLE,
            &json!({"status": "loading"}),
        ),
    }
}

pub async fn models(State(state): State<Arc<AppState>>) -> Response {
    let mut model = json!({
        "id": state.model_name,
        "object": "model",
        "created": state.created,
        "owned_by": "rustorch",
    });
    if let Some(r) = state.ready.get() {
        let hp = r.model.hparams();
        model["meta"] = json!({
            "arch": hp.arch_name,
            "n_vocab": hp.n_vocab,
            "n_ctx_train": hp.n_ctx_train,
            "n_embd": hp.n_embd,
            "n_ctx": r.sched.config().n_ctx,
            "n_ctx_slot": r.sched.slot_ctx(),
            "n_slots": r.sched.config().n_slots,
        });
    }
    json_response(StatusCode::OK, &json!({"object": "list", "data": [model]}))
}

pub async fn metrics(State(state): State<Arc<AppState>>) -> Result<Response, ApiError> {
    let r = ready(&state)?;
    let s = r.sched.stats();
    let mut out = String::new();
    let mut metric = |name: &str, kind: &str, help: &str, value: String| {
        let _ = writeln!(out, "# HELP rustorch_{name} {help}");
        let _ = writeln!(out, "# TYPE rustorch_{name} {kind}");
        let _ = writeln!(out, "rustorch_{name} {value}");
    };
    metric(
        "requests_total",
        "counter",
        "Generation requests accepted.",
        s.requests_total.to_string(),
    );
    metric(
        "requests_rejected_total",
        "counter",
        "Generation requests refused because the queue was full.",
        s.requests_rejected.to_string(),
    );
    metric(
        "requests_finished_total",
        "counter",
        "Generation requests that ended (done, failed, cancelled or abandoned).",
        s.requests_finished.to_string(),
    );
    metric(
        "prompt_tokens_total",
        "counter",
        "Prompt tokens evaluated.",
        s.prompt_tokens_total.to_string(),
    );
    metric(
        "prompt_tokens_shared_total",
        "counter",
        "Prompt tokens not evaluated: their cache cells were copied from a request that begins alike.",
        s.prompt_tokens_shared_total.to_string(),
    );
    metric(
        "generated_tokens_total",
        "counter",
        "Tokens generated.",
        s.generated_tokens_total.to_string(),
    );
    metric(
        "tokens_per_second",
        "gauge",
        "Decoding throughput: generated tokens per second of decoding steps, all slots together.",
        format!("{:.3}", s.tokens_per_second()),
    );
    metric(
        "forward_calls_total",
        "counter",
        "Forward passes (batches) evaluated.",
        s.steps_total.to_string(),
    );
    metric(
        "forward_seconds_total",
        "counter",
        "Time spent in forward passes.",
        format!("{:.6}", s.forward_time.as_secs_f64()),
    );
    metric(
        "slots_busy",
        "gauge",
        "Slots serving a request.",
        s.slots_busy.to_string(),
    );
    metric(
        "slots_total",
        "gauge",
        "Slots (-np).",
        s.n_slots.to_string(),
    );
    metric(
        "queue_depth",
        "gauge",
        "Requests waiting for a slot.",
        s.queue_depth.to_string(),
    );
    Ok((
        StatusCode::OK,
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        out,
    )
        .into_response())
}

pub async fn tokenize(
    State(state): State<Arc<AppState>>,
    body: Bytes,
) -> Result<Response, ApiError> {
    let r = ready(&state)?;
    let obj = api::parse_object(&body)?;
    let f = Fields(&obj);
    let content = f
        .str("content")?
        .ok_or_else(|| ApiError::param("content", "'content' is required"))?;
    let add_special = f.bool("add_special")?.unwrap_or(false);
    let parse_special = f.bool("parse_special")?.unwrap_or(true);
    let with_pieces = f.bool("with_pieces")?.unwrap_or(false);
    let tokens = r
        .tokenizer
        .encode(content, add_special, parse_special)
        .map_err(|e| ApiError::param("content", e.to_string()))?;
    let tokens: Vec<Value> = if with_pieces {
        tokens
            .iter()
            .map(|&t| json!({"id": t, "piece": piece(&r.tokenizer, t)}))
            .collect()
    } else {
        tokens.iter().map(|&t| json!(t)).collect()
    };
    Ok(json_response(StatusCode::OK, &json!({"tokens": tokens})))
}

pub async fn detokenize(
    State(state): State<Arc<AppState>>,
    body: Bytes,
) -> Result<Response, ApiError> {
    let r = ready(&state)?;
    let obj = api::parse_object(&body)?;
    let n_vocab = r.tokenizer.n_vocab();
    let ids: Vec<u32> = match obj.get("tokens") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(a)) => {
            let mut ids = Vec::with_capacity(a.len());
            for v in a {
                match v.as_u64() {
                    Some(id) if (id as usize) < n_vocab => ids.push(id as u32),
                    _ => {
                        return Err(ApiError::param(
                            "tokens",
                            format!("'tokens' must hold token ids below {n_vocab}, got {v}"),
                        ))
                    }
                }
            }
            ids
        }
        Some(v) => {
            return Err(ApiError::param(
                "tokens",
                format!(
                    "'tokens' must be an array of token ids, got {}",
                    api::type_name(v)
                ),
            ))
        }
    };
    let content = String::from_utf8_lossy(&r.tokenizer.detokenize(&ids, false)).into_owned();
    Ok(json_response(StatusCode::OK, &json!({"content": content})))
}

fn piece(tok: &Tokenizer, id: u32) -> String {
    String::from_utf8_lossy(&tok.token_to_piece(id, true)).into_owned()
}

/// Which endpoint a generation answers.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Chat,
    Text,
}

/// What every response of one request shares.
#[derive(Clone)]
struct Meta {
    kind: Kind,
    id: String,
    created: u64,
    model: String,
    logprobs: LogprobsMode,
    include_usage: bool,
}

impl Meta {
    fn object(&self, chunk: bool) -> &'static str {
        match (self.kind, chunk) {
            (Kind::Chat, false) => "chat.completion",
            (Kind::Chat, true) => "chat.completion.chunk",
            (Kind::Text, _) => "text_completion",
        }
    }

    fn envelope(&self, chunk: bool, choices: Value) -> Value {
        json!({
            "id": self.id,
            "object": self.object(chunk),
            "created": self.created,
            "model": self.model,
            "system_fingerprint": concat!("rustorch-", env!("CARGO_PKG_VERSION")),
            "choices": choices,
        })
    }
}

fn usage(c: &Completion) -> Value {
    json!({
        "prompt_tokens": c.prompt_tokens,
        "completion_tokens": c.completion_tokens,
        "total_tokens": c.prompt_tokens + c.completion_tokens,
    })
}

fn timings(c: &Completion) -> Value {
    let ms = |d: std::time::Duration| d.as_secs_f64() * 1e3;
    let per_s = |n: usize, d: std::time::Duration| {
        if d.is_zero() {
            0.0
        } else {
            n as f64 / d.as_secs_f64()
        }
    };
    json!({
        "queue_ms": ms(c.queue_time),
        "prompt_n": c.prompt_tokens,
        "prompt_ms": ms(c.prompt_time),
        "prompt_per_second": per_s(c.prompt_tokens, c.prompt_time),
        "predicted_n": c.completion_tokens,
        "predicted_ms": ms(c.gen_time),
        "predicted_per_second": per_s(c.completion_tokens, c.gen_time),
    })
}

/// Log-probabilities of tokens, in the shape the endpoint uses.
fn logprobs_json(meta: &Meta, tok: &Tokenizer, lps: &[Logprobs]) -> Value {
    if lps.is_empty() && meta.logprobs == LogprobsMode::None {
        return Value::Null;
    }
    let entry = |id: u32, lp: f32| {
        let bytes = tok.token_to_piece(id, true);
        (
            String::from_utf8_lossy(&bytes).into_owned(),
            bytes,
            finite(lp),
        )
    };
    match meta.logprobs {
        LogprobsMode::None => Value::Null,
        LogprobsMode::Chat(_) => {
            let content: Vec<Value> = lps
                .iter()
                .map(|l| {
                    let (token, bytes, logprob) = entry(l.chosen.token, l.chosen.logprob);
                    let top: Vec<Value> = l
                        .top
                        .iter()
                        .map(|t| {
                            let (token, bytes, logprob) = entry(t.token, t.logprob);
                            json!({"token": token, "logprob": logprob, "bytes": bytes})
                        })
                        .collect();
                    json!({"token": token, "logprob": logprob, "bytes": bytes, "top_logprobs": top})
                })
                .collect();
            json!({"content": content})
        }
        LogprobsMode::Legacy(_) => {
            let mut tokens = Vec::new();
            let mut token_logprobs = Vec::new();
            let mut top_logprobs = Vec::new();
            for l in lps {
                let (token, _, logprob) = entry(l.chosen.token, l.chosen.logprob);
                tokens.push(json!(token));
                token_logprobs.push(json!(logprob));
                let mut top = serde_json::Map::new();
                for t in &l.top {
                    let (token, _, logprob) = entry(t.token, t.logprob);
                    top.insert(token, json!(logprob));
                }
                top_logprobs.push(Value::Object(top));
            }
            json!({"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs})
        }
    }
}

/// JSON has no infinities: the most negative finite value stands for `-inf`.
fn finite(x: f32) -> f32 {
    if x.is_finite() {
        x
    } else {
        -9999.0
    }
}

pub async fn chat_completions(State(state): State<Arc<AppState>>, body: Bytes) -> Response {
    generate(state, body, Kind::Chat).await
}

pub async fn completions(State(state): State<Arc<AppState>>, body: Bytes) -> Response {
    generate(state, body, Kind::Text).await
}

async fn generate(state: Arc<AppState>, body: Bytes, kind: Kind) -> Response {
    match generate_inner(state, body, kind).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

async fn generate_inner(
    state: Arc<AppState>,
    body: Bytes,
    kind: Kind,
) -> Result<Response, ApiError> {
    let r = ready(&state)?.clone();
    let obj = api::parse_object(&body)?;
    // tokenizing and template rendering can take a while on big inputs
    let r2 = r.clone();
    let prepared: Prepared = tokio::task::spawn_blocking(move || {
        // the grammar engine (the vocabulary's token trie) is built at the first request
        // that needs it
        let engine = || {
            r2.grammar
                .get_or_init(|| GrammarEngine::new(r2.tokenizer.clone()))
                .clone()
        };
        match kind {
            Kind::Chat => api::chat_request(&obj, &r2.tokenizer, &r2.template, &engine),
            Kind::Text => api::completion_request(&obj, &r2.tokenizer, &engine),
        }
    })
    .await
    .map_err(|_| ApiError::internal("the request could not be prepared"))??;
    let meta = Meta {
        kind,
        id: new_id(match kind {
            Kind::Chat => "chatcmpl",
            Kind::Text => "cmpl",
        }),
        created: now_secs(),
        model: state.model_name.clone(),
        logprobs: prepared.logprobs,
        include_usage: prepared.include_usage,
    };
    let (tx, rx) = unbounded_channel();
    let cfg = r.sched.config();
    let param = match kind {
        Kind::Chat => "messages",
        Kind::Text => "prompt",
    };
    r.sched
        .submit(prepared.gen, Box::new(ChannelSink(tx)))
        .map_err(|e| ApiError::from_submit(e, param, cfg.n_slots, cfg.n_ctx))?;
    if prepared.stream {
        let events = sse_stream(meta, r.tokenizer.clone(), rx, prepared.tools);
        Ok(Sse::new(events)
            .keep_alive(KeepAlive::default())
            .into_response())
    } else {
        collect(meta, &r.tokenizer, rx, prepared.tools).await
    }
}

/// Waits for the whole answer.
async fn collect(
    meta: Meta,
    tok: &Tokenizer,
    mut rx: UnboundedReceiver<Event>,
    mut tools: Option<ToolCallParser>,
) -> Result<Response, ApiError> {
    let mut text = String::new();
    let mut lps = Vec::new();
    loop {
        match rx.recv().await {
            Some(Event::Token {
                token,
                text: t,
                logprobs,
            }) => {
                if let Some(p) = tools.as_mut() {
                    p.push(token, &t);
                }
                text.push_str(&t);
                lps.extend(logprobs);
            }
            Some(Event::Done(c)) => {
                if c.finish == FinishReason::Cancelled {
                    return Err(ApiError::new(
                        StatusCode::SERVICE_UNAVAILABLE,
                        "unavailable_error",
                        "the request was cancelled: the server is shutting down",
                    )
                    .code("shutting_down"));
                }
                let logprobs = logprobs_json(&meta, tok, &lps);
                if let Some(p) = tools.as_ref() {
                    tracing::debug!(output = %p.text(), "answer read for tool calls");
                }
                let (message, finish) = match tools.as_ref().map(|p| p.result()) {
                    Some(parsed) => {
                        let finish = if !parsed.calls.is_empty() && c.finish == FinishReason::Stop {
                            "tool_calls"
                        } else {
                            c.finish.as_str()
                        };
                        (server_tools::openai_message(&parsed), finish)
                    }
                    None => (
                        json!({"role": "assistant", "content": text}),
                        c.finish.as_str(),
                    ),
                };
                let choice = match meta.kind {
                    Kind::Chat => json!({
                        "index": 0,
                        "message": message,
                        "logprobs": logprobs,
                        "finish_reason": finish,
                    }),
                    Kind::Text => json!({
                        "index": 0,
                        "text": text,
                        "logprobs": logprobs,
                        "finish_reason": c.finish.as_str(),
                    }),
                };
                let mut body = meta.envelope(false, json!([choice]));
                body["usage"] = usage(&c);
                body["timings"] = timings(&c);
                return Ok(json_response(StatusCode::OK, &body));
            }
            Some(Event::Error(e)) => return Err(ApiError::internal(e)),
            None => return Err(ApiError::internal("generation stopped unexpectedly")),
        }
    }
}

struct StreamState {
    meta: Meta,
    tok: Arc<Tokenizer>,
    rx: UnboundedReceiver<Event>,
    out: std::collections::VecDeque<String>,
    /// Log-probabilities of tokens whose text is not out yet.
    pending_lps: Vec<Logprobs>,
    /// Splits calls from text when the request has tools.
    tools: Option<OpenAiCalls>,
    done: bool,
}

impl StreamState {
    fn chunk(&self, delta_or_text: Value, finish: Option<&str>, lps: &[Logprobs]) -> String {
        let logprobs = if lps.is_empty() {
            Value::Null
        } else {
            logprobs_json(&self.meta, &self.tok, lps)
        };
        let choice = match self.meta.kind {
            Kind::Chat => json!({
                "index": 0,
                "delta": delta_or_text,
                "logprobs": logprobs,
                "finish_reason": finish,
            }),
            Kind::Text => json!({
                "index": 0,
                "text": delta_or_text,
                "logprobs": logprobs,
                "finish_reason": finish,
            }),
        };
        let mut v = self.meta.envelope(true, json!([choice]));
        if self.meta.include_usage {
            v["usage"] = Value::Null;
        }
        v.to_string()
    }

    fn text_chunk(&mut self, text: String) {
        let lps = std::mem::take(&mut self.pending_lps);
        let payload = match self.meta.kind {
            Kind::Chat => json!({"content": text}),
            Kind::Text => json!(text),
        };
        let c = self.chunk(payload, None, &lps);
        self.out.push_back(c);
    }

    /// A chat delta (`content` or `tool_calls`).
    fn delta_chunk(&mut self, delta: Value) {
        let lps = std::mem::take(&mut self.pending_lps);
        let c = self.chunk(delta, None, &lps);
        self.out.push_back(c);
    }

    fn on_event(&mut self, ev: Option<Event>) {
        match ev {
            Some(Event::Token {
                token,
                text,
                logprobs,
            }) => {
                self.pending_lps.extend(logprobs);
                if let Some(t) = self.tools.as_mut() {
                    for delta in t.push(token, &text) {
                        self.delta_chunk(delta);
                    }
                } else if !text.is_empty() {
                    self.text_chunk(text);
                }
            }
            Some(Event::Done(c)) if c.finish == FinishReason::Cancelled => {
                self.error("the request was cancelled: the server is shutting down");
            }
            Some(Event::Done(c)) => {
                let mut finish = c.finish.as_str();
                if let Some(mut t) = self.tools.take() {
                    for delta in t.finish() {
                        self.delta_chunk(delta);
                    }
                    if t.has_calls() && c.finish == FinishReason::Stop {
                        finish = "tool_calls";
                    }
                }
                let lps = std::mem::take(&mut self.pending_lps);
                let empty = match self.meta.kind {
                    Kind::Chat => json!({}),
                    Kind::Text => json!(""),
                };
                let last = self.chunk(empty, Some(finish), &lps);
                self.out.push_back(last);
                if self.meta.include_usage {
                    let mut u = self.meta.envelope(true, json!([]));
                    u["usage"] = usage(&c);
                    u["timings"] = timings(&c);
                    self.out.push_back(u.to_string());
                }
                self.out.push_back("[DONE]".to_string());
                self.done = true;
            }
            Some(Event::Error(e)) => self.error(&e),
            None => self.error("generation stopped unexpectedly"),
        }
    }

    fn error(&mut self, message: &str) {
        let e = ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", message);
        self.out.push_back(e.body().to_string());
        self.done = true;
    }
}

/// Server-sent events: a first chunk with the role, content chunks, a last chunk with
/// the finish reason, (usage,) then `[DONE]`.
fn sse_stream(
    meta: Meta,
    tok: Arc<Tokenizer>,
    rx: UnboundedReceiver<Event>,
    tools: Option<ToolCallParser>,
) -> impl Stream<Item = Result<SseEvent, Infallible>> {
    let mut st = StreamState {
        meta,
        tok,
        rx,
        out: Default::default(),
        pending_lps: Vec::new(),
        tools: tools.map(OpenAiCalls::new),
        done: false,
    };
    let first = match st.meta.kind {
        Kind::Chat => Some(st.chunk(json!({"role": "assistant", "content": ""}), None, &[])),
        Kind::Text => None,
    };
    st.out.extend(first);
    stream::unfold(st, |mut st| async move {
        loop {
            if let Some(data) = st.out.pop_front() {
                return Some((Ok(SseEvent::default().data(data)), st));
            }
            if st.done {
                return None;
            }
            let ev = st.rx.recv().await;
            st.on_event(ev);
        }
    })
}
