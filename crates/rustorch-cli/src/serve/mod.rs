//! `rustorch serve`: an OpenAI-compatible HTTP server with streaming and continuous
//! batching.
//!
//! The port is bound first (`GET /health` answers 503 `{"status":"loading"}` while the
//! model loads), then the model is loaded on a thread and handed to a
//! [`Scheduler`](rustorch_llm::scheduler::Scheduler), whose engine thread batches every
//! running request into one forward pass per step. HTTP runs on a small tokio runtime.
//!
//! Endpoints: `POST /v1/chat/completions`, `POST /v1/completions`, `GET /v1/models`,
//! `GET /health`, `POST /tokenize`, `POST /detokenize`, `GET /metrics`, and Anthropic's
//! `POST /v1/messages` and `POST /v1/messages/count_tokens` ([`anthropic`]).
//!
//! # Shutdown
//!
//! SIGTERM or Ctrl-C starts a drain that loses no request:
//!
//! 1. The server stops taking work but keeps listening, so that every client gets an
//!    answer rather than a refused or reset connection: new generation requests get
//!    HTTP 503 (`shutting_down` in OpenAI's error shape, `overloaded_error` in
//!    Anthropic's), `/health` answers 503 `{"status":"draining"}` (a load balancer or
//!    Kubernetes stops sending traffic), and every response carries
//!    `Connection: close`.
//! 2. Requests already accepted, running or queued, go on to their end for up to
//!    `--shutdown-timeout` seconds (30 by default: the grace period Kubernetes gives a
//!    pod).
//! 3. Past that (or at a second signal) the scheduler ends every request still there
//!    with the text generated so far, as [`FinishReason::Interrupted`]: `finish_reason`
//!    `"length"` (Anthropic: `stop_reason` `"max_tokens"`), the value OpenAI's clients
//!    already read as "cut short". A stream gets its last chunk with that reason (and
//!    usage, when asked for) then `data: [DONE]`, or `message_delta` + `message_stop`;
//!    a non-streamed request gets its whole JSON with the partial text. vLLM reports
//!    such requests as `"abort"`, a value outside OpenAI's set; llama-server does not
//!    drain at all (its streams are cut).
//! 4. Once nothing runs the listener closes, the last responses are written (open
//!    connections get [`FLUSH_GRACE`] more) and the process exits with code 0.
//!
//! [`FinishReason::Interrupted`]: rustorch_llm::scheduler::FinishReason::Interrupted

mod anthropic;
mod api;
mod routes;
mod tools;

use std::future::IntoFuture;
use std::path::PathBuf;
use std::sync::atomic::{fence, AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use anyhow::Context;
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{header, HeaderValue};
use axum::middleware::Next;
use axum::response::Response;
use axum::routing::{get, post};
use axum::Router;
use rustorch_llm::chat::ChatTemplate;
use rustorch_llm::scheduler::{Scheduler, SchedulerConfig};
use rustorch_llm::tokenizer::Tokenizer;
use rustorch_llm::{Model, Runtime};

use crate::common;

/// Environment variable read for the API key when `--api-key` is not given.
pub const API_KEY_ENV: &str = "RUSTORCH_API_KEY";

/// How long connections may stay open once the drain is over (every request has ended
/// and its last bytes are on their way); a client that does not read them is then cut.
const FLUSH_GRACE: Duration = Duration::from_secs(5);

#[derive(clap::Args, Debug)]
pub struct Args {
    /// GGUF model (default: models/SmolLM2-135M-Instruct.Q4_1.gguf)
    #[arg(short = 'm', long = "model")]
    pub model: Option<PathBuf>,
    /// Address to listen on (loopback by default)
    #[arg(long = "host", default_value = "127.0.0.1")]
    pub host: String,
    /// Port to listen on (0 = any free port; the address is printed on stderr)
    #[arg(long = "port", default_value_t = 8080)]
    pub port: u16,
    /// Total context size, shared by all slots: each gets ctx/np (0 = the model's
    /// training context)
    #[arg(short = 'c', long = "ctx-size")]
    pub ctx_size: Option<usize>,
    /// Requests generated at the same time (`-np` also works)
    #[arg(long = "parallel", default_value_t = 4)]
    pub parallel: usize,
    /// Most tokens evaluated in one forward pass
    #[arg(short = 'b', long = "batch-size", default_value_t = rustorch_llm::engine::DEFAULT_N_BATCH)]
    pub batch_size: usize,
    /// Most requests waiting for a slot (default 4 × --parallel); more get HTTP 429
    #[arg(long = "queue-size")]
    pub queue_size: Option<usize>,
    /// Evaluate every prompt in full, even where requests begin alike (by default a new
    /// request copies the cache cells of the beginning it shares with a live request)
    #[arg(long = "no-prefix-sharing")]
    pub no_prefix_sharing: bool,
    /// Require `Authorization: Bearer KEY` (or `x-api-key: KEY`) on every endpoint but
    /// /health (default: $RUSTORCH_API_KEY)
    #[arg(long = "api-key")]
    pub api_key: Option<String>,
    /// After SIGTERM / Ctrl-C, how long running and queued requests may go on. Meanwhile
    /// new generation requests and /health get HTTP 503. Past it (or at a second signal)
    /// every request still there ends with the text it has and finish_reason "length"
    /// (Anthropic: "max_tokens"): streams get their last chunk and [DONE], never a cut
    /// connection. Then the server exits with code 0
    #[arg(
        long = "shutdown-timeout",
        value_name = "SECONDS",
        default_value_t = 30
    )]
    pub shutdown_timeout: u64,
    /// Threads (default: physical cores)
    #[arg(short = 't', long = "threads")]
    pub threads: Option<usize>,
    #[command(flatten)]
    pub device: common::DeviceArgs,
    /// Built-in chat template (chatml, llama2, llama3, zephyr, mistral, gemma, phi3) or a file
    #[arg(long = "chat-template")]
    pub chat_template: Option<String>,
    /// Jinja chat template file
    #[arg(long = "chat-template-file")]
    pub chat_template_file: Option<PathBuf>,
    /// Debug logging (every request and forward pass)
    #[arg(long = "verbose", short = 'v')]
    pub verbose: bool,
    /// Testing aid: wait this long before loading the model
    #[arg(long = "debug-load-delay-ms", hide = true)]
    pub debug_load_delay_ms: Option<u64>,
}

/// What every handler sees.
pub struct AppState {
    /// The model's file name, as `model` in responses.
    model_name: String,
    /// When the server started (unix seconds).
    created: u64,
    api_key: Option<String>,
    /// Set once the model is loaded.
    ready: OnceLock<Arc<Ready>>,
    /// Set at SIGTERM / Ctrl-C: the server is draining (see the module documentation).
    draining: AtomicBool,
}

impl AppState {
    /// Whether the server is shutting down.
    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::SeqCst)
    }
}

/// The loaded model and its scheduler.
pub struct Ready {
    model: Arc<Model>,
    tokenizer: Arc<Tokenizer>,
    template: ChatTemplate,
    sched: Scheduler,
    /// Grammar compiler for this vocabulary, built by the first request with a grammar.
    grammar: OnceLock<rustorch_llm::grammar::GrammarEngine>,
}

fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/health", get(routes::health))
        .route("/v1/health", get(routes::health))
        .route("/v1/models", get(routes::models))
        .route("/models", get(routes::models))
        .route("/v1/chat/completions", post(routes::chat_completions))
        .route("/chat/completions", post(routes::chat_completions))
        .route("/v1/completions", post(routes::completions))
        .route("/completions", post(routes::completions))
        .route("/v1/messages", post(anthropic::messages))
        .route("/v1/messages/count_tokens", post(anthropic::count_tokens))
        .route("/tokenize", post(routes::tokenize))
        .route("/detokenize", post(routes::detokenize))
        .route("/metrics", get(routes::metrics))
        .fallback(routes::not_found)
        .layer(DefaultBodyLimit::max(16 << 20))
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            routes::auth,
        ))
        .layer(axum::middleware::from_fn(routes::error_shape))
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            close_while_draining,
        ))
        .with_state(state)
}

/// While draining, every response closes its connection, so that clients open their
/// next one elsewhere rather than reuse this one.
async fn close_while_draining(
    State(state): State<Arc<AppState>>,
    req: Request,
    next: Next,
) -> Response {
    let mut res = next.run(req).await;
    if state.is_draining() {
        res.headers_mut()
            .insert(header::CONNECTION, HeaderValue::from_static("close"));
    }
    res
}

pub fn run(args: Args) -> anyhow::Result<()> {
    common::init_logging(args.verbose);
    let path = common::resolve_model(args.model.as_deref())?;
    let api_key = args
        .api_key
        .clone()
        .or_else(|| std::env::var(API_KEY_ENV).ok())
        .filter(|k| !k.is_empty());
    let model_name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| path.display().to_string());
    let state = Arc::new(AppState {
        model_name,
        created: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
        api_key,
        ready: OnceLock::new(),
        draining: AtomicBool::new(false),
    });

    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("rustorch-http")
        .enable_all()
        .build()
        .context("starting the HTTP runtime")?;
    let result = rt.block_on(serve(args, path, state));
    // a model still loading must not hold the process
    rt.shutdown_timeout(Duration::from_millis(200));
    result
}

async fn serve(args: Args, path: PathBuf, state: Arc<AppState>) -> anyhow::Result<()> {
    // handlers first, so that a SIGTERM right after the address is printed is graceful too
    let signals = Signals::install().context("installing signal handlers")?;
    let listener = tokio::net::TcpListener::bind((args.host.as_str(), args.port))
        .await
        .with_context(|| format!("cannot listen on {}:{}", args.host, args.port))?;
    let addr = listener.local_addr()?;
    eprintln!(
        "rustorch: listening on http://{addr} (loading {})",
        path.display()
    );
    if state.api_key.is_none() && !addr.ip().is_loopback() {
        eprintln!("rustorch: warning: listening beyond loopback without --api-key");
    }

    // load on a thread of its own; the result comes back through a channel
    let (load_tx, load_rx) = tokio::sync::oneshot::channel::<anyhow::Result<()>>();
    {
        let state = state.clone();
        let args = LoadArgs {
            ctx_size: args.ctx_size,
            parallel: args.parallel,
            batch_size: args.batch_size,
            queue_size: args.queue_size,
            share_prefixes: !args.no_prefix_sharing,
            threads: args.threads,
            device: args.device.clone(),
            chat_template: args.chat_template.clone(),
            chat_template_file: args.chat_template_file.clone(),
            delay: Duration::from_millis(args.debug_load_delay_ms.unwrap_or(0)),
        };
        std::thread::Builder::new()
            .name("rustorch-load".into())
            .spawn(move || {
                let r = load(&path, &args).map(|ready| {
                    let ready = Arc::new(ready);
                    let _ = state.ready.set(ready.clone());
                    // a drain that began while loading did not see the scheduler
                    // (the fence pairs with the one in `drain`)
                    fence(Ordering::SeqCst);
                    if state.is_draining() {
                        ready.sched.stop_accepting();
                    }
                });
                let _ = load_tx.send(r);
            })
            .context("starting the loader thread")?;
    }

    let (fail_tx, fail_rx) = tokio::sync::oneshot::channel::<anyhow::Error>();
    {
        let state = state.clone();
        tokio::spawn(async move {
            match load_rx.await {
                Ok(Ok(())) => {
                    if let Some(r) = state.ready.get() {
                        let c = r.sched.config();
                        eprintln!(
                            "rustorch: model loaded: {} slots × {} tokens of context; ready",
                            c.n_slots,
                            r.sched.slot_ctx()
                        );
                    }
                }
                Ok(Err(e)) => {
                    let _ = fail_tx.send(e);
                }
                Err(_) => {
                    let _ = fail_tx.send(anyhow::anyhow!("the loader thread died"));
                }
            }
        });
    }

    let load_error: Arc<std::sync::Mutex<Option<anyhow::Error>>> = Default::default();
    // sent (or dropped) when the listener is to close
    let (drained_tx, drained_rx) = tokio::sync::oneshot::channel::<()>();
    let shutdown = {
        let state = state.clone();
        let load_error = load_error.clone();
        let timeout = Duration::from_secs(args.shutdown_timeout);
        let mut signals = signals;
        async move {
            tokio::select! {
                _ = signals.recv() => {}
                Ok(e) = fail_rx => {
                    *load_error.lock().unwrap_or_else(|p| p.into_inner()) = Some(e);
                    return;
                }
            }
            drain(&state, &mut signals, timeout).await;
            let _ = drained_tx.send(());
        }
    };
    let server = axum::serve(listener, router(state.clone())).with_graceful_shutdown(shutdown);
    // once drained, the last responses are written; a client that does not read its
    // own does not hold the process
    let flushed = async {
        let _ = drained_rx.await;
        tokio::time::sleep(FLUSH_GRACE).await;
    };
    tokio::select! {
        r = server.into_future() => r.context("serving HTTP")?,
        _ = flushed => eprintln!("rustorch: closing connections still open after the drain"),
    }
    if let Some(e) = load_error.lock().unwrap_or_else(|p| p.into_inner()).take() {
        return Err(e);
    }
    if let Some(r) = state.ready.get() {
        r.sched.cancel_all();
    }
    Ok(())
}

/// Stops taking work and lets what was accepted finish, for up to `timeout` or until a
/// second signal, then ends the rest (see the module documentation). Returns once no
/// request is left (or at a third signal).
async fn drain(state: &AppState, signals: &mut Signals, timeout: Duration) {
    state.draining.store(true, Ordering::SeqCst);
    // pairs with the loader's fence: either it sees `draining` or this sees the model
    fence(Ordering::SeqCst);
    let Some(r) = state.ready.get() else {
        eprintln!("rustorch: shutting down (the model was still loading)");
        return;
    };
    r.sched.stop_accepting();
    let n = r.sched.in_flight();
    if n == 0 {
        eprintln!("rustorch: shutting down");
        return;
    }
    eprintln!(
        "rustorch: shutting down: finishing {n} request(s) (up to {} s; a second \
         Ctrl-C / SIGTERM ends them now)",
        timeout.as_secs()
    );
    let idle = wait_idle(r);
    tokio::pin!(idle);
    tokio::select! {
        _ = &mut idle => {
            eprintln!("rustorch: every request finished");
            return;
        }
        _ = tokio::time::sleep(timeout) => {
            eprintln!(
                "rustorch: shutdown timeout: ending {} request(s) with what they have",
                r.sched.in_flight()
            );
        }
        _ = signals.recv() => {
            eprintln!(
                "rustorch: second signal: ending {} request(s) with what they have",
                r.sched.in_flight()
            );
        }
    }
    r.sched.finish_all();
    // at most one forward pass away
    tokio::select! {
        _ = idle => {}
        _ = signals.recv() => eprintln!("rustorch: third signal: not waiting any more"),
    }
}

/// Resolves once the scheduler has no request left.
async fn wait_idle(r: &Ready) {
    while !r.sched.is_idle() {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

struct LoadArgs {
    ctx_size: Option<usize>,
    parallel: usize,
    batch_size: usize,
    queue_size: Option<usize>,
    share_prefixes: bool,
    threads: Option<usize>,
    device: common::DeviceArgs,
    chat_template: Option<String>,
    chat_template_file: Option<PathBuf>,
    delay: Duration,
}

fn load(path: &std::path::Path, args: &LoadArgs) -> anyhow::Result<Ready> {
    std::thread::sleep(args.delay);
    let loaded = common::load(path, Some(&args.device), args.ctx_size.unwrap_or(0))?;
    let template = common::chat_template(
        &loaded.gguf,
        args.chat_template.as_deref(),
        args.chat_template_file.as_deref(),
    )?;
    let model = Arc::new(loaded.model);
    let tokenizer = Arc::new(loaded.tokenizer);
    let n_slots = args.parallel.max(1);
    let n_ctx = common::ctx_size(args.ctx_size, &model);
    if n_ctx < n_slots {
        anyhow::bail!("-c {n_ctx} is too small for {n_slots} slots (each needs at least 1 token)");
    }
    let mut config = SchedulerConfig::new(n_ctx, n_slots);
    config.n_batch = args.batch_size.max(1);
    config.share_prefixes = args.share_prefixes;
    if let Some(q) = args.queue_size {
        config.queue_capacity = q;
    }
    let rt = Runtime::new(common::threads(args.threads));
    let sched = Scheduler::start(model.clone(), tokenizer.clone(), rt, config)
        .context("starting the engine thread")?;
    eprintln!("rustorch: {}", common::kv_cache_line(&model, n_ctx));
    tracing::info!(
        load_ms = loaded.load_time.as_millis() as u64,
        "model loaded"
    );
    Ok(Ready {
        model,
        tokenizer,
        template,
        sched,
        grammar: OnceLock::new(),
    })
}

/// Ctrl-C and SIGTERM, registered when installed.
struct Signals {
    #[cfg(unix)]
    int: tokio::signal::unix::Signal,
    #[cfg(unix)]
    term: tokio::signal::unix::Signal,
}

impl Signals {
    fn install() -> std::io::Result<Self> {
        #[cfg(unix)]
        {
            use tokio::signal::unix::{signal, SignalKind};
            Ok(Signals {
                int: signal(SignalKind::interrupt())?,
                term: signal(SignalKind::terminate())?,
            })
        }
        #[cfg(not(unix))]
        Ok(Signals {})
    }

    /// Waits for the next of them.
    async fn recv(&mut self) {
        #[cfg(unix)]
        tokio::select! {
            _ = self.int.recv() => {}
            _ = self.term.recv() => {}
        }
        #[cfg(not(unix))]
        {
            let _ = &self;
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}
