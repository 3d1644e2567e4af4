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

mod anthropic;
mod api;
mod routes;

use std::path::PathBuf;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use anyhow::Context;
use axum::extract::DefaultBodyLimit;
use axum::routing::{get, post};
use axum::Router;
use rustorch_llm::chat::ChatTemplate;
use rustorch_llm::scheduler::{Scheduler, SchedulerConfig};
use rustorch_llm::tokenizer::Tokenizer;
use rustorch_llm::{Model, Runtime};

use crate::common;

/// Environment variable read for the API key when `--api-key` is not given.
pub const API_KEY_ENV: &str = "RUSTORCH_API_KEY";

/// How long running requests may go on after SIGTERM / Ctrl-C before they are cancelled.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);

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
        .with_state(state)
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
                    let _ = state.ready.set(Arc::new(ready));
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
    let shutdown = {
        let state = state.clone();
        let load_error = load_error.clone();
        async move {
            tokio::select! {
                _ = signals.recv() => {
                    eprintln!("rustorch: shutting down");
                }
                Ok(e) = fail_rx => {
                    *load_error.lock().unwrap_or_else(|p| p.into_inner()) = Some(e);
                    return;
                }
            }
            if let Some(r) = state.ready.get() {
                r.sched.stop_accepting();
                let r = r.clone();
                // let running requests finish for a while, then cancel them
                tokio::spawn(async move {
                    let t0 = tokio::time::Instant::now();
                    while !r.sched.is_idle() && t0.elapsed() < SHUTDOWN_GRACE {
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                    r.sched.cancel_all();
                });
            }
        }
    };
    axum::serve(listener, router(state.clone()))
        .with_graceful_shutdown(shutdown)
        .await
        .context("serving HTTP")?;
    if let Some(e) = load_error.lock().unwrap_or_else(|p| p.into_inner()).take() {
        return Err(e);
    }
    if let Some(r) = state.ready.get() {
        r.sched.cancel_all();
    }
    Ok(())
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

    /// Waits for the first of them.
    async fn recv(mut self) {
        #[cfg(unix)]
        tokio::select! {
            _ = self.int.recv() => {}
            _ = self.term.recv() => {}
        }
        #[cfg(not(unix))]
        {
            let _ = &mut self;
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}
