//! `rustorch serve` over raw HTTP (std `TcpStream`, no client library): health and
//! loading, OpenAI error shapes for every bad input, authentication, the queue limit,
//! a client disconnecting mid-stream, greedy output alone vs batched, SIGTERM (the
//! drain: 503s, then every request ended with a finish reason), and tool calls as
//! OpenAI's and Anthropic's wire formats write them.
//!
//! Each test starts the binary on a free loopback port (`--port 0`; the address is read
//! from its stderr) with SmolLM2. Without the model (`scripts/fetch-models.sh`) the tests
//! are skipped with a note on stderr.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use serde_json::{json, Value as Json};

const MODEL_NAME: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

fn model() -> Option<PathBuf> {
    let p = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../models")
        .join(MODEL_NAME);
    if p.is_file() {
        Some(p)
    } else {
        let _ = writeln!(
            std::io::stderr(),
            "SKIPPED: {} is absent (scripts/fetch-models.sh)",
            p.display()
        );
        None
    }
}

/// A running server; killed on drop.
struct Server {
    child: Child,
    addr: String,
}

impl Server {
    /// Starts `rustorch serve -m SmolLM2 --port 0 ARGS` and waits for its address (not
    /// for the model to load). `None` when the model is absent.
    fn spawn(args: &[&str], envs: &[(&str, &str)]) -> Option<Server> {
        let model = model()?;
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_rustorch"));
        cmd.arg("serve")
            .arg("-m")
            .arg(&model)
            .args(["--host", "127.0.0.1", "--port", "0", "-t", "1"])
            .args(args)
            .env_remove("RUSTORCH_API_KEY")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        for (k, v) in envs {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().expect("start rustorch serve");
        let stderr = child.stderr.take().expect("stderr");
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let mut tx = Some(tx);
            for line in BufReader::new(stderr).lines() {
                let Ok(line) = line else { break };
                if let Some(rest) = line.split("listening on http://").nth(1) {
                    let addr = rest.split_whitespace().next().unwrap_or("").to_string();
                    if let Some(tx) = tx.take() {
                        let _ = tx.send(addr);
                    }
                }
            }
        });
        let addr = rx
            .recv_timeout(Duration::from_secs(60))
            .expect("the server printed its address");
        Some(Server { child, addr })
    }

    /// [`spawn`](Self::spawn), then waits until `/health` says ok.
    fn start(args: &[&str]) -> Option<Server> {
        let s = Self::spawn(args, &[])?;
        s.wait_ready();
        Some(s)
    }

    fn wait_ready(&self) {
        let t0 = Instant::now();
        loop {
            let r = self.get("/health");
            if r.status == 200 {
                assert_eq!(r.json(), json!({"status": "ok"}));
                return;
            }
            assert_eq!(r.status, 503, "health while loading: {}", r.body);
            assert!(
                t0.elapsed() < Duration::from_secs(120),
                "model never loaded"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn get(&self, path: &str) -> Resp {
        http(&self.addr, "GET", path, &[], None)
    }

    fn post(&self, path: &str, body: &str) -> Resp {
        http(&self.addr, "POST", path, &[], Some(body))
    }

    fn post_json(&self, path: &str, body: &Json) -> Resp {
        self.post(path, &body.to_string())
    }

    /// A gauge or counter of `/metrics`.
    fn metric(&self, name: &str) -> f64 {
        let r = self.get("/metrics");
        assert_eq!(r.status, 200, "{}", r.body);
        r.body
            .lines()
            .find_map(|l| l.strip_prefix(&format!("rustorch_{name} ")))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or_else(|| panic!("metric {name} missing in:\n{}", r.body))
    }

    fn wait_metric(&self, name: &str, want: f64, within: Duration) {
        let t0 = Instant::now();
        while self.metric(name) != want {
            assert!(
                t0.elapsed() < within,
                "{name} stayed at {} (want {want})",
                self.metric(name)
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[derive(Debug)]
struct Resp {
    status: u16,
    headers: Vec<(String, String)>,
    body: String,
}

impl Resp {
    fn json(&self) -> Json {
        serde_json::from_str(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {:?}", self.body))
    }

    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

fn send_request(
    addr: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<&str>,
) -> TcpStream {
    let mut s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(300))).ok();
    let mut req = format!("{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n");
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    if let Some(b) = body {
        req.push_str(&format!(
            "Content-Type: application/json\r\nContent-Length: {}\r\n",
            b.len()
        ));
    }
    req.push_str("\r\n");
    if let Some(b) = body {
        req.push_str(b);
    }
    s.write_all(req.as_bytes()).expect("send request");
    s
}

/// One HTTP/1.1 exchange (`Connection: close`), chunked bodies decoded.
fn http(
    addr: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<&str>,
) -> Resp {
    let mut s = send_request(addr, method, path, headers, body);
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).expect("read response");
    parse_response(&raw)
}

fn parse_response(raw: &[u8]) -> Resp {
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .unwrap_or_else(|| panic!("no header end in {:?}", String::from_utf8_lossy(raw)));
    let head = String::from_utf8_lossy(&raw[..split]).into_owned();
    let mut lines = head.split("\r\n");
    let status: u16 = lines
        .next()
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|c| c.parse().ok())
        .expect("status line");
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
        .collect();
    let mut body = raw[split + 4..].to_vec();
    let chunked = headers.iter().any(|(k, v)| {
        k.eq_ignore_ascii_case("transfer-encoding") && v.eq_ignore_ascii_case("chunked")
    });
    if chunked {
        body = dechunk(&body);
    }
    Resp {
        status,
        headers,
        body: String::from_utf8(body).expect("UTF-8 body"),
    }
}

fn dechunk(mut b: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    while let Some(eol) = b.windows(2).position(|w| w == b"\r\n") {
        let size_text = String::from_utf8_lossy(&b[..eol]);
        let size = usize::from_str_radix(size_text.split(';').next().unwrap_or("").trim(), 16)
            .unwrap_or(0);
        if size == 0 {
            break;
        }
        let start = eol + 2;
        let end = (start + size).min(b.len());
        out.extend_from_slice(&b[start..end]);
        b = &b[(end + 2).min(b.len())..];
    }
    out
}

/// The `data:` payloads of an SSE body.
fn sse_data(body: &str) -> Vec<String> {
    body.split("\n\n")
        .filter_map(|ev| {
            let data: Vec<&str> = ev
                .lines()
                .filter_map(|l| l.strip_prefix("data:"))
                .map(|d| d.strip_prefix(' ').unwrap_or(d))
                .collect();
            (!data.is_empty()).then(|| data.join("\n"))
        })
        .collect()
}

/// Checks the OpenAI error shape and returns the error object.
fn openai_error(r: &Resp, status: u16) -> Json {
    assert_eq!(r.status, status, "body: {}", r.body);
    assert!(
        r.header("content-type")
            .is_some_and(|c| c.starts_with("application/json")),
        "content-type of {}: {:?}",
        r.body,
        r.headers
    );
    let j = r.json();
    let e = j["error"].clone();
    assert!(e["message"].as_str().is_some_and(|m| !m.is_empty()), "{j}");
    assert!(e["type"].is_string(), "{j}");
    let obj = e.as_object().expect("error object");
    assert!(obj.contains_key("param") && obj.contains_key("code"), "{j}");
    e
}

fn chat_body(user: &str, extra: Json) -> Json {
    let mut b = json!({
        "model": MODEL_NAME,
        "messages": [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": user},
        ],
        "temperature": 0,
    });
    if let (Some(o), Json::Object(e)) = (b.as_object_mut(), extra) {
        o.extend(e);
    }
    b
}

fn chat_text(r: &Resp) -> String {
    assert_eq!(r.status, 200, "{}", r.body);
    r.json()["choices"][0]["message"]["content"]
        .as_str()
        .expect("content")
        .to_string()
}

#[test]
fn endpoints_and_error_shapes() {
    let Some(s) = Server::start(&["-c", "256", "-np", "2"]) else {
        return;
    };
    // health, models
    assert_eq!(s.get("/health").json(), json!({"status": "ok"}));
    let models = s.get("/v1/models");
    assert_eq!(models.status, 200);
    let m = models.json();
    assert_eq!(m["object"], "list");
    assert_eq!(m["data"][0]["id"], MODEL_NAME);
    assert_eq!(m["data"][0]["object"], "model");

    // chat completion: shape, usage, finish reason
    let r = s.post_json(
        "/v1/chat/completions",
        &chat_body("What is the capital of France?", json!({})),
    );
    let j = r.json();
    assert_eq!(j["object"], "chat.completion");
    assert!(j["id"].as_str().is_some_and(|i| i.starts_with("chatcmpl-")));
    assert!(j["created"].as_u64().is_some_and(|t| t > 1_600_000_000));
    assert_eq!(j["model"], MODEL_NAME);
    assert_eq!(j["choices"][0]["message"]["role"], "assistant");
    assert_eq!(j["choices"][0]["finish_reason"], "stop");
    let text = chat_text(&r);
    assert!(text.contains("Paris"), "{text}");
    assert!(!text.contains("<|im_end|>"), "{text}");
    let u = &j["usage"];
    assert_eq!(
        u["total_tokens"].as_u64(),
        Some(
            u["prompt_tokens"].as_u64().unwrap_or(0) + u["completion_tokens"].as_u64().unwrap_or(0)
        )
    );
    assert!(u["completion_tokens"].as_u64().unwrap_or(0) > 0);

    // the same answer streamed
    let r = s.post_json(
        "/v1/chat/completions",
        &chat_body("What is the capital of France?", json!({"stream": true})),
    );
    assert_eq!(r.status, 200);
    assert!(r
        .header("content-type")
        .is_some_and(|c| c.starts_with("text/event-stream")));
    let data = sse_data(&r.body);
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"));
    let chunks: Vec<Json> = data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d).expect("chunk JSON"))
        .collect();
    assert!(chunks.len() >= 3, "{chunks:?}");
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let id = chunks[0]["id"].clone();
    let mut streamed = String::new();
    for c in &chunks {
        assert_eq!(c["object"], "chat.completion.chunk");
        assert_eq!(c["id"], id);
        streamed.push_str(c["choices"][0]["delta"]["content"].as_str().unwrap_or(""));
    }
    let last = &chunks[chunks.len() - 1];
    assert_eq!(last["choices"][0]["finish_reason"], "stop");
    assert_eq!(streamed, text);

    // text completion with a length limit and a stop string
    let r = s.post_json(
        "/v1/completions",
        &json!({"prompt": "The capital of France is", "max_tokens": 3, "temperature": 0}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let j = r.json();
    assert_eq!(j["object"], "text_completion");
    assert_eq!(j["choices"][0]["finish_reason"], "length");
    assert_eq!(j["usage"]["completion_tokens"], 3);
    let full = j["choices"][0]["text"].as_str().unwrap_or("").to_string();
    let word = full.split_whitespace().next().unwrap_or("").to_string();
    assert!(!word.is_empty(), "{full}");
    let r = s.post_json(
        "/v1/completions",
        &json!({"prompt": "The capital of France is", "max_tokens": 3, "temperature": 0, "stop": [word.clone()]}),
    );
    let j = r.json();
    assert_eq!(j["choices"][0]["finish_reason"], "stop", "{j}");
    let cut = j["choices"][0]["text"].as_str().unwrap_or("");
    assert!(
        !cut.contains(&word),
        "{cut:?} still holds the stop string {word:?}"
    );
    assert!(full.starts_with(cut));

    // logprobs
    let r = s.post_json(
        "/v1/chat/completions",
        &chat_body(
            "Say hi",
            json!({"max_tokens": 2, "logprobs": true, "top_logprobs": 3}),
        ),
    );
    let j = r.json();
    let content = j["choices"][0]["logprobs"]["content"]
        .as_array()
        .expect("logprobs.content");
    assert_eq!(content.len(), 2, "{j}");
    assert_eq!(content[0]["top_logprobs"].as_array().map(Vec::len), Some(3));
    assert!(content[0]["logprob"].as_f64().is_some_and(|l| l <= 0.0));

    // logit_bias that bans the greedy first token changes the answer
    let first = s.post_json("/tokenize", &json!({"content": text})).json()["tokens"][0]
        .as_u64()
        .expect("a token");
    let biased = chat_text(&s.post_json(
        "/v1/chat/completions",
        &chat_body(
            "What is the capital of France?",
            json!({"max_tokens": 4, "logit_bias": {first.to_string(): -100}}),
        ),
    ));
    let unbiased_first = s
        .post_json("/detokenize", &json!({"tokens": [first]}))
        .json()["content"]
        .as_str()
        .unwrap_or("")
        .to_string();
    assert!(
        !biased.starts_with(&unbiased_first),
        "{biased:?} vs {unbiased_first:?}"
    );

    // tokenize / detokenize
    let toks = s.post_json("/tokenize", &json!({"content": "Hello world"}));
    assert_eq!(toks.status, 200);
    let ids = toks.json()["tokens"].clone();
    assert!(ids.as_array().is_some_and(|a| !a.is_empty()));
    let back = s.post_json("/detokenize", &json!({"tokens": ids}));
    assert_eq!(back.json()["content"], "Hello world");

    // malformed JSON, wrong types, unsupported values: 400 naming the field
    let e = openai_error(&s.post("/v1/chat/completions", "{not json"), 400);
    assert_eq!(e["type"], "invalid_request_error");
    openai_error(&s.post("/v1/chat/completions", "[1, 2]"), 400);
    openai_error(&s.post("/v1/chat/completions", ""), 400);
    let cases: Vec<(&str, Json, &str)> = vec![
        (
            "/v1/chat/completions",
            json!({"messages": "hi"}),
            "messages",
        ),
        ("/v1/chat/completions", json!({}), "messages"),
        ("/v1/chat/completions", json!({"messages": []}), "messages"),
        (
            "/v1/chat/completions",
            json!({"messages": [{"content": "x"}]}),
            "messages[0].role",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": 5}]}),
            "messages[0].content",
        ),
        (
            "/v1/chat/completions",
            chat_body("x", json!({"temperature": "hot"})),
            "temperature",
        ),
        (
            "/v1/chat/completions",
            chat_body("x", json!({"temperature": -1})),
            "temperature",
        ),
        (
            "/v1/chat/completions",
            chat_body("x", json!({"max_tokens": -1})),
            "max_tokens",
        ),
        (
            "/v1/chat/completions",
            chat_body("x", json!({"max_tokens": 1.5})),
            "max_tokens",
        ),
        (
            "/v1/chat/completions",
            chat_body("x", json!({"top_p": 2})),
            "top_p",
        ),
        (
            "/v1/chat/completions",
            chat_body("x", json!({"top_k": "many"})),
            "top_k",
        ),
        (
            "/v1/chat/completions",
            chat_body("x", json!({"min_p": [0.1]})),
            "min_p",
        ),
        (
            "/v1/chat/completions",
            chat_body("x", json!({"seed": "abc"})),
            "seed",
        ),
        (
            "/v1/chat/completions",
            chat_body("x", json!({"stop": 5})),
            "stop",
        ),
        (
            "/v1/chat/completions",
            chat_body("x", json!({"stop": ["a", 1]})),
            "stop",
        ),
        (
            "/v1/chat/completions",
            chat_body("x", json!({"presence_penalty": 3})),
            "presence_penalty",
        ),
        (
            "/v1/chat/completions",
            chat_body("x", json!({"frequency_penalty": "x"})),
            "frequency_penalty",
        ),
        (
            "/v1/chat/completions",
            chat_body("x", json!({"logit_bias": {"abc": 1}})),
            "logit_bias",
        ),
        (
            "/v1/chat/completions",
            chat_body("x", json!({"logit_bias": {"99999999": 1}})),
            "logit_bias",
        ),
        (
            "/v1/chat/completions",
            chat_body("x", json!({"logit_bias": [1]})),
            "logit_bias",
        ),
        ("/v1/chat/completions", chat_body("x", json!({"n": 2})), "n"),
        (
            "/v1/chat/completions",
            chat_body("x", json!({"stream": "yes"})),
            "stream",
        ),
        (
            "/v1/chat/completions",
            chat_body("x", json!({"top_logprobs": 2})),
            "top_logprobs",
        ),
        (
            "/v1/chat/completions",
            chat_body("x", json!({"logprobs": true, "top_logprobs": 50})),
            "top_logprobs",
        ),
        ("/v1/completions", json!({"prompt": 5}), "prompt"),
        ("/v1/completions", json!({}), "prompt"),
        ("/v1/completions", json!({"prompt": ["a", "b"]}), "prompt"),
        (
            "/v1/completions",
            json!({"prompt": [1, 99999999]}),
            "prompt",
        ),
        ("/v1/completions", json!({"prompt": "x", "n": 3}), "n"),
        ("/tokenize", json!({"content": 5}), "content"),
        ("/tokenize", json!({}), "content"),
        ("/detokenize", json!({"tokens": ["a"]}), "tokens"),
        ("/detokenize", json!({"tokens": [-1]}), "tokens"),
        ("/detokenize", json!({"tokens": 7}), "tokens"),
    ];
    for (path, body, param) in cases {
        let r = s.post_json(path, &body);
        let e = openai_error(&r, 400);
        assert_eq!(e["param"], param, "{path} {body}: {}", r.body);
    }

    // a prompt longer than a slot's context (256 / 2 = 128 tokens): 400 naming both
    let long = "the quick brown fox jumps over the lazy dog ".repeat(40);
    let n_long = s
        .post_json("/tokenize", &json!({"content": long, "add_special": true}))
        .json()["tokens"]
        .as_array()
        .map_or(0, Vec::len);
    assert!(n_long > 128);
    for (path, body) in [
        ("/v1/completions", json!({"prompt": long})),
        (
            "/v1/chat/completions",
            chat_body(&long, json!({"stream": true})),
        ),
    ] {
        let e = openai_error(&s.post_json(path, &body), 400);
        let msg = e["message"].as_str().unwrap_or("");
        assert!(msg.contains("128"), "{msg}");
        assert_eq!(e["code"], "context_length_exceeded");
        if path == "/v1/completions" {
            assert!(
                msg.contains(&n_long.to_string()),
                "{msg} (prompt is {n_long})"
            );
        }
    }

    // unknown endpoint, wrong method
    let e = openai_error(&s.get("/v1/nothing"), 404);
    assert!(e["message"].as_str().unwrap_or("").contains("/v1/nothing"));
    openai_error(&s.post("/v2/chat/completions", "{}"), 404);
    openai_error(&s.get("/v1/chat/completions"), 405);

    // metrics
    let body = s.get("/metrics").body;
    for name in [
        "rustorch_requests_total",
        "rustorch_prompt_tokens_total",
        "rustorch_generated_tokens_total",
        "rustorch_tokens_per_second",
        "rustorch_slots_busy",
        "rustorch_queue_depth",
    ] {
        assert!(
            body.contains(&format!("\n{name} ")),
            "{name} missing:\n{body}"
        );
    }
    assert!(s.metric("generated_tokens_total") > 0.0);
    assert_eq!(s.metric("slots_busy"), 0.0);

    // still alive after all that
    assert_eq!(s.get("/health").status, 200);
}

#[test]
fn health_is_503_while_loading() {
    let Some(s) = Server::spawn(&["--debug-load-delay-ms", "1500"], &[]) else {
        return;
    };
    let r = s.get("/health");
    assert_eq!(r.status, 503, "{}", r.body);
    assert_eq!(r.json(), json!({"status": "loading"}));
    // other endpoints say so in OpenAI's shape
    let e = openai_error(
        &s.post_json("/v1/completions", &json!({"prompt": "x"})),
        503,
    );
    assert_eq!(e["code"], "model_loading");
    s.wait_ready();
}

#[test]
fn api_key_is_required_except_for_health() {
    let Some(s) = Server::start(&["--api-key", "sekrit"]) else {
        return;
    };
    let check = |headers: &[(&str, &str)], want: u16| {
        let r = http(&s.addr, "GET", "/v1/models", headers, None);
        if want == 401 {
            let e = openai_error(&r, 401);
            assert_eq!(e["code"], "invalid_api_key");
        } else {
            assert_eq!(r.status, want, "{}", r.body);
        }
    };
    check(&[], 401);
    check(&[("Authorization", "Bearer wrong")], 401);
    check(&[("Authorization", "sekrit")], 401);
    check(&[("Authorization", "Bearer sekrit")], 200);
    assert_eq!(s.get("/health").status, 200);
    openai_error(&s.get("/metrics"), 401);
    openai_error(&s.post("/v1/chat/completions", "{}"), 401);

    // from the environment too
    drop(s);
    let Some(s) = Server::spawn(&[], &[("RUSTORCH_API_KEY", "from-env")]) else {
        return;
    };
    s.wait_ready();
    openai_error(&s.get("/v1/models"), 401);
    let r = http(
        &s.addr,
        "GET",
        "/v1/models",
        &[("Authorization", "Bearer from-env")],
        None,
    );
    assert_eq!(r.status, 200);
}

/// Opens a streaming request and reads until `n` data events arrived; returns the
/// open connection.
fn open_stream(addr: &str, body: &Json, n: usize) -> TcpStream {
    let mut s = send_request(
        addr,
        "POST",
        "/v1/chat/completions",
        &[],
        Some(&body.to_string()),
    );
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    while String::from_utf8_lossy(&seen).matches("data: ").count() < n {
        let k = s.read(&mut buf).expect("read stream");
        assert!(
            k > 0,
            "stream ended early: {}",
            String::from_utf8_lossy(&seen)
        );
        seen.extend_from_slice(&buf[..k]);
    }
    assert!(String::from_utf8_lossy(&seen).starts_with("HTTP/1.1 200"));
    s
}

fn endless(user: &str) -> Json {
    chat_body(
        user,
        json!({"stream": true, "max_tokens": 2000, "ignore_eos": true}),
    )
}

#[test]
fn disconnect_mid_stream_frees_the_slot() {
    let Some(s) = Server::start(&["-np", "2", "-c", "4096"]) else {
        return;
    };
    let conn = open_stream(&s.addr, &endless("Write a very long story."), 4);
    assert_eq!(s.metric("slots_busy"), 1.0);
    drop(conn);
    s.wait_metric("slots_busy", 0.0, Duration::from_secs(30));
    assert_eq!(s.metric("queue_depth"), 0.0);
    // the server goes on serving
    let text = chat_text(&s.post_json(
        "/v1/chat/completions",
        &chat_body("What is the capital of France?", json!({})),
    ));
    assert!(text.contains("Paris"), "{text}");
    assert_eq!(s.metric("slots_busy"), 0.0);
}

#[test]
fn full_queue_answers_429() {
    let Some(s) = Server::start(&["-np", "1", "--queue-size", "1", "-c", "4096"]) else {
        return;
    };
    let running = open_stream(&s.addr, &endless("Tell me a story."), 2);
    s.wait_metric("slots_busy", 1.0, Duration::from_secs(30));
    // the next one waits in the queue (its first chunk comes at once)
    let waiting = open_stream(&s.addr, &endless("Tell me another story."), 1);
    s.wait_metric("queue_depth", 1.0, Duration::from_secs(30));
    let r = s.post_json("/v1/chat/completions", &chat_body("Hi", json!({})));
    let e = openai_error(&r, 429);
    assert_eq!(e["code"], "rate_limit_exceeded");
    assert!(e["message"].as_str().unwrap_or("").contains("busy"));
    assert!(s.metric("requests_rejected_total") >= 1.0);
    drop(running);
    drop(waiting);
    s.wait_metric("slots_busy", 0.0, Duration::from_secs(30));
    s.wait_metric("queue_depth", 0.0, Duration::from_secs(30));
}

/// Greedy output of each prompt run alone equals its output when all run together,
/// batched into shared forward passes (8 at once: enough for the matmul to take its
/// multi-row path, where one alone takes the single-row one).
#[test]
fn greedy_output_is_the_same_alone_and_batched() {
    let Some(s) = Server::start(&["-np", "8", "-c", "2048"]) else {
        return;
    };
    let prompts = [
        "What is the capital of France?",
        "Name three colors.",
        "Write a haiku about the sea.",
        "What is 2 + 2?",
        "Describe a cat.",
        "Why is the sky blue?",
        "Give me a recipe for pancakes.",
        "Tell me a joke.",
    ];
    let body = |p: &str, stream: bool| {
        chat_body(
            p,
            json!({"max_tokens": 16, "ignore_eos": true, "stream": stream, "seed": 1}),
        )
    };
    let alone: Vec<String> = prompts
        .iter()
        .map(|p| chat_text(&s.post_json("/v1/chat/completions", &body(p, false))))
        .collect();
    let steps_before = s.metric("forward_calls_total");
    let tokens_before = s.metric("generated_tokens_total");
    // all at once, half of them streamed
    let addr = s.addr.clone();
    let handles: Vec<_> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let addr = addr.clone();
            let b = body(p, i % 2 == 1).to_string();
            std::thread::spawn(move || {
                let r = http(&addr, "POST", "/v1/chat/completions", &[], Some(&b));
                assert_eq!(r.status, 200, "{}", r.body);
                if i % 2 == 1 {
                    sse_data(&r.body)
                        .iter()
                        .filter(|d| d.as_str() != "[DONE]")
                        .map(|d| {
                            let c: Json = serde_json::from_str(d).expect("chunk");
                            c["choices"][0]["delta"]["content"]
                                .as_str()
                                .unwrap_or("")
                                .to_string()
                        })
                        .collect::<String>()
                } else {
                    chat_text(&r)
                }
            })
        })
        .collect();
    let batched: Vec<String> = handles
        .into_iter()
        .map(|h| h.join().expect("request thread"))
        .collect();
    for (i, p) in prompts.iter().enumerate() {
        assert_eq!(
            alone[i], batched[i],
            "prompt {p:?} differs alone vs batched"
        );
    }
    let steps = s.metric("forward_calls_total") - steps_before;
    let tokens = s.metric("generated_tokens_total") - tokens_before;
    assert!(
        steps < tokens,
        "{steps} forward calls for {tokens} tokens: requests were not batched"
    );
}

#[cfg(unix)]
fn sigterm(s: &Server) {
    let pid = s.child.id().to_string();
    let ok = Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .expect("kill");
    assert!(ok.success());
}

#[cfg(unix)]
fn wait_exit(s: &mut Server, within: Duration) -> std::process::ExitStatus {
    let t0 = Instant::now();
    loop {
        if let Some(st) = s.child.try_wait().expect("wait") {
            return st;
        }
        assert!(t0.elapsed() < within, "server did not exit");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Reads the rest of a response whose beginning was read already and checks that the
/// chunked body ended properly (its last, empty chunk), not with a cut connection.
fn read_rest(mut conn: TcpStream) -> String {
    let mut rest = Vec::new();
    conn.read_to_end(&mut rest)
        .expect("read the rest of the response");
    let rest = String::from_utf8_lossy(&rest).into_owned();
    assert!(rest.ends_with("0\r\n\r\n"), "not a complete body: {rest:?}");
    rest
}

#[cfg(unix)]
#[test]
fn sigterm_stops_gracefully_with_exit_0() {
    let Some(mut s) = Server::start(&["-np", "2", "-c", "4096", "--shutdown-timeout", "1"]) else {
        return;
    };
    let conn = open_stream(&s.addr, &endless("Write a very long story."), 3);
    sigterm(&s);
    // after the timeout the stream ends with its last chunk and [DONE], and the process
    // exits 0
    let rest = read_rest(conn);
    assert!(rest.contains(r#""finish_reason":"length""#), "{rest}");
    assert!(rest.contains("data: [DONE]"), "{rest}");
    let status = wait_exit(&mut s, Duration::from_secs(30));
    assert_eq!(status.code(), Some(0), "exit status {status:?}");
    // nothing listens any more
    assert!(TcpStream::connect(&s.addr).is_err());
}

/// During the drain `/health` and new generation requests get 503 in each API's shape;
/// a second SIGTERM ends at once, cleanly, a running stream, a running non-streamed
/// request (its whole JSON, with the text so far) and a queued Anthropic stream.
#[cfg(unix)]
#[test]
fn drain_answers_503_and_a_second_sigterm_ends_every_request_cleanly() {
    let Some(mut s) = Server::start(&["-np", "2", "-c", "4096"]) else {
        return;
    };
    let stream = open_stream(&s.addr, &endless("Write a very long story."), 3);
    let addr = s.addr.clone();
    let body = chat_body(
        "Write a very long poem.",
        json!({"max_tokens": 2000, "ignore_eos": true}),
    )
    .to_string();
    let plain =
        std::thread::spawn(move || http(&addr, "POST", "/v1/chat/completions", &[], Some(&body)));
    s.wait_metric("slots_busy", 2.0, Duration::from_secs(30));
    let messages = json!({
        "model": MODEL_NAME,
        "max_tokens": 2000,
        "stream": true,
        "messages": [{"role": "user", "content": "Write a very long story."}],
    });
    let mut queued = send_request(
        &s.addr,
        "POST",
        "/v1/messages",
        &[],
        Some(&messages.to_string()),
    );
    let mut head = [0u8; 12];
    queued.read_exact(&mut head).expect("response head");
    assert_eq!(&head, b"HTTP/1.1 200");
    s.wait_metric("queue_depth", 1.0, Duration::from_secs(30));
    // the non-streamed request has some text (the two running ones take turns)
    let t0 = Instant::now();
    let before = s.metric("generated_tokens_total");
    while s.metric("generated_tokens_total") < before + 20.0 {
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "no tokens generated"
        );
        std::thread::sleep(Duration::from_millis(50));
    }

    sigterm(&s);
    let t0 = Instant::now();
    loop {
        let r = s.get("/health");
        if r.status == 503 {
            assert_eq!(r.json(), json!({"status": "draining"}));
            assert_eq!(r.header("connection"), Some("close"));
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(10), "never draining");
        std::thread::sleep(Duration::from_millis(20));
    }
    let r = s.post_json("/v1/chat/completions", &chat_body("Hi", json!({})));
    assert_eq!(openai_error(&r, 503)["code"], "shutting_down");
    let r = s.post_json("/v1/completions", &json!({"prompt": "Hi", "max_tokens": 4}));
    assert_eq!(openai_error(&r, 503)["code"], "shutting_down");
    let r = s.post_json(
        "/v1/messages",
        &json!({"model": MODEL_NAME, "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]}),
    );
    assert_eq!(r.status, 503, "{}", r.body);
    assert_eq!(r.json()["error"]["type"], "overloaded_error");
    assert_eq!(s.metric("slots_busy"), 2.0, "the running requests go on");

    sigterm(&s);
    let rest = read_rest(stream);
    assert!(rest.contains(r#""finish_reason":"length""#), "{rest}");
    assert!(rest.contains("data: [DONE]"), "{rest}");

    let r = plain.join().expect("request thread");
    assert_eq!(r.status, 200, "{}", r.body);
    let j = r.json();
    assert_eq!(j["choices"][0]["finish_reason"], "length", "{j}");
    let n = j["usage"]["completion_tokens"].as_u64().unwrap_or(0);
    assert!((1..2000).contains(&n), "{j}");
    assert!(!chat_text(&r).is_empty(), "{j}");

    let rest = read_rest(queued);
    assert!(rest.contains(r#""stop_reason":"max_tokens""#), "{rest}");
    assert!(rest.contains("event: message_stop"), "{rest}");

    let status = wait_exit(&mut s, Duration::from_secs(30));
    assert_eq!(status.code(), Some(0), "exit status {status:?}");
}

#[test]
fn a_model_that_does_not_load_exits_1() {
    let not_gguf = Path::new(env!("CARGO_MANIFEST_DIR")).join("Cargo.toml");
    let out = Command::new(env!("CARGO_BIN_EXE_rustorch"))
        .args(["serve", "--port", "0", "-m"])
        .arg(&not_gguf)
        .stdin(Stdio::null())
        .output()
        .expect("run rustorch serve");
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("error:"), "{err}");
}

/// Tool calls on the wire: `message.tool_calls` and `finish_reason: "tool_calls"`, the
/// same call streamed as `delta.tool_calls` (id, type and name first, then the arguments
/// in pieces, no content), and Anthropic's `tool_use` block, streamed as
/// `content_block_start` + `input_json_delta`s. SmolLM2's template has no tool support:
/// the generic JSON format, forced by `tool_choice`.
#[test]
fn tool_calls_on_the_wire() {
    let Some(s) = Server::start(&["-c", "2048", "-np", "1"]) else {
        return;
    };
    let schema = json!({
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 30}},
        "required": ["city"],
        "additionalProperties": false,
    });
    let tools = json!([{"type": "function", "function": {
        "name": "get_weather", "description": "Weather of a city", "parameters": schema,
    }}]);
    let body = chat_body(
        "What is the weather in Paris?",
        json!({"tools": tools, "tool_choice": "required", "max_tokens": 40}),
    );
    let r = s.post_json("/v1/chat/completions", &body);
    assert_eq!(r.status, 200, "{}", r.body);
    let choice = r.json()["choices"][0].clone();
    assert_eq!(choice["finish_reason"], "tool_calls", "{choice}");
    assert_eq!(choice["message"]["content"], Json::Null, "{choice}");
    let calls = choice["message"]["tool_calls"]
        .as_array()
        .expect("calls")
        .clone();
    assert_eq!(calls.len(), 1, "{choice}");
    assert!(calls[0]["id"]
        .as_str()
        .is_some_and(|i| i.starts_with("call_")));
    assert_eq!(calls[0]["type"], "function");
    assert_eq!(calls[0]["function"]["name"], "get_weather");
    let arguments = calls[0]["function"]["arguments"]
        .as_str()
        .expect("arguments are a string")
        .to_string();
    let args: Json = serde_json::from_str(&arguments).expect("arguments are JSON");
    assert!(args["city"].is_string(), "{args}");

    let mut body = body;
    body["stream"] = json!(true);
    let r = s.post_json("/v1/chat/completions", &body);
    assert_eq!(r.status, 200, "{}", r.body);
    let (mut streamed, mut pieces, mut finish, mut content) =
        (String::new(), 0, None, String::new());
    let mut started = false;
    for data in sse_data(&r.body) {
        if data == "[DONE]" {
            continue;
        }
        let chunk: Json = serde_json::from_str(&data).expect("chunk");
        let c = &chunk["choices"][0];
        content.push_str(c["delta"]["content"].as_str().unwrap_or_default());
        if let Some(tc) = c["delta"]["tool_calls"].as_array() {
            assert_eq!(tc.len(), 1, "{data}");
            assert_eq!(tc[0]["index"], 0, "{data}");
            if started {
                assert!(tc[0].get("id").is_none(), "{data}");
                assert!(tc[0]["function"].get("name").is_none(), "{data}");
            } else {
                // the first piece of a call names it
                started = true;
                assert!(tc[0]["id"].as_str().is_some_and(|i| i.starts_with("call_")));
                assert_eq!(tc[0]["type"], "function", "{data}");
                assert_eq!(tc[0]["function"]["name"], "get_weather", "{data}");
            }
            if let Some(a) = tc[0]["function"]["arguments"]
                .as_str()
                .filter(|a| !a.is_empty())
            {
                streamed.push_str(a);
                pieces += 1;
            }
        }
        if let Some(f) = c["finish_reason"].as_str() {
            finish = Some(f.to_string());
        }
    }
    assert_eq!(content, "", "call text leaked into content");
    assert_eq!(finish.as_deref(), Some("tool_calls"));
    assert_eq!(streamed, arguments, "greedy: the same call streamed");
    assert!(pieces > 1, "the arguments came in one piece");

    // Anthropic
    let body = json!({
        "model": MODEL_NAME, "max_tokens": 40, "temperature": 0,
        "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
        "tools": [{"name": "get_weather", "description": "Weather of a city", "input_schema": schema}],
        "tool_choice": {"type": "any"},
    });
    let r = s.post_json("/v1/messages", &body);
    assert_eq!(r.status, 200, "{}", r.body);
    let m = r.json();
    assert_eq!(m["stop_reason"], "tool_use", "{m}");
    let blocks = m["content"].as_array().expect("content").clone();
    assert_eq!(blocks.len(), 1, "{m}");
    assert_eq!(blocks[0]["type"], "tool_use");
    assert!(blocks[0]["id"]
        .as_str()
        .is_some_and(|i| i.starts_with("toolu_")));
    assert_eq!(blocks[0]["name"], "get_weather");
    assert_eq!(
        blocks[0]["input"], args,
        "the same call as on the OpenAI endpoint"
    );

    let mut body = body;
    body["stream"] = json!(true);
    let r = s.post_json("/v1/messages", &body);
    assert_eq!(r.status, 200, "{}", r.body);
    let events: Vec<Json> = sse_data(&r.body)
        .iter()
        .map(|d| serde_json::from_str(d).expect("event"))
        .collect();
    let kinds: Vec<&str> = events.iter().filter_map(|e| e["type"].as_str()).collect();
    assert_eq!(kinds.first(), Some(&"message_start"), "{kinds:?}");
    assert_eq!(kinds.last(), Some(&"message_stop"), "{kinds:?}");
    let starts: Vec<&Json> = events
        .iter()
        .filter(|e| e["type"] == "content_block_start")
        .collect();
    assert_eq!(starts.len(), 1, "{kinds:?}");
    assert_eq!(starts[0]["index"], 0);
    assert_eq!(starts[0]["content_block"]["type"], "tool_use");
    assert_eq!(starts[0]["content_block"]["input"], json!({}));
    let json_text: String = events
        .iter()
        .filter(|e| e["type"] == "content_block_delta")
        .map(|e| {
            assert_eq!(e["delta"]["type"], "input_json_delta", "{e}");
            e["delta"]["partial_json"]
                .as_str()
                .expect("partial_json")
                .to_string()
        })
        .collect();
    let input: Json = serde_json::from_str(&json_text).expect("streamed input is JSON");
    assert_eq!(input, args);
    let delta = events
        .iter()
        .find(|e| e["type"] == "message_delta")
        .expect("message_delta");
    assert_eq!(delta["delta"]["stop_reason"], "tool_use");
}
