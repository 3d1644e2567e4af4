//! Continuous batching: many generation requests share one [`Model`] and one
//! [`KvCache`], like llama-server's slots.
//!
//! A [`Scheduler`] owns an engine thread. Requests are [submitted](Scheduler::submit)
//! with an [`EventSink`] that receives their text; they wait in a bounded queue until
//! one of the `n_slots` slots is free. Each slot is one sequence of the shared cache
//! (its [`SeqId`] is its index) and holds at most `n_ctx / n_slots` tokens.
//!
//! Every step of the engine thread:
//!
//! 1. drops slots whose sink is closed (the client went away) and admits waiting
//!    requests into free slots;
//! 2. lets new requests reuse the cells of prompt tokens already evaluated (see *Shared
//!    prompt beginnings* below);
//! 3. builds ONE [`Batch`]: one token for every generating slot, then the next chunk of
//!    the prompt of every slot still evaluating its prompt, up to `n_batch` tokens. Each
//!    token carries its slot's own position (the count of tokens that slot has fed so
//!    far), never one derived from the cache;
//! 4. calls [`Model::forward`] once;
//! 5. samples, for every slot that got logits, with the slot's own [`Sampler`], and
//!    streams the text through a [`TextStream`] (UTF-8 safe, stop strings held back and
//!    cut) to the slot's sink;
//! 6. finishes slots that produced an end-of-generation token, a stop string, reached
//!    their token limit or filled their share of the context, and releases their cache
//!    cells.
//!
//! Because the forward pass computes every token independently of the other tokens of
//! the batch, greedy output is the same whether a request ran alone or with others.
//!
//! # Shared prompt beginnings
//!
//! A token's keys and values depend only on the tokens before it, so requests whose
//! prompts begin alike (the same system prompt, say) need not each evaluate that
//! beginning. When [`SchedulerConfig::share_prefixes`] is on (the default), a request
//! that has not started its prompt yet:
//!
//! - copies the cells of the longest beginning it shares with the evaluated prompt of a
//!   live slot ([`KvCache::seq_cp_range`]);
//! - otherwise, when it shares a beginning with other requests that start in the same
//!   step, one of them evaluates that beginning alone in a forward call of its own and
//!   the others copy its cells.
//!
//! At least [`MIN_SHARED_PREFIX`] tokens are shared, and never a prompt's last token
//! (its logits give the first generated token). The cells are copies: every slot still
//! releases its own when it finishes, and the output is bit for bit what the request
//! would have produced alone.
//!
//! Nothing here prints; progress is reported through `tracing`.

use std::collections::VecDeque;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::batch::{Batch, SeqId};
use crate::engine::{TextStream, DEFAULT_N_BATCH};
use crate::grammar::Constraint;
use crate::kv_cache::KvCache;
use crate::model::{ForwardOutput, Model, ModelError, Runtime};
use crate::sampler::{logprobs, Logprobs, Sampler, SamplerParams};
use crate::tokenizer::Tokenizer;

/// How a [`Scheduler`] is laid out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SchedulerConfig {
    /// Requests generated at the same time (llama.cpp's `--parallel`).
    pub n_slots: usize,
    /// Cells of the shared KV cache; each slot gets `n_ctx / n_slots`.
    pub n_ctx: usize,
    /// Most tokens evaluated in one forward call.
    pub n_batch: usize,
    /// Most requests waiting for a slot; more are refused with
    /// [`SubmitError::QueueFull`].
    pub queue_capacity: usize,
    /// Requests whose prompts begin alike evaluate that beginning once (see the module
    /// documentation).
    pub share_prefixes: bool,
}

impl SchedulerConfig {
    /// `n_slots` slots sharing `n_ctx` cells, batches of [`DEFAULT_N_BATCH`] tokens and
    /// a queue of `4 × n_slots`.
    pub fn new(n_ctx: usize, n_slots: usize) -> Self {
        let n_slots = n_slots.max(1);
        SchedulerConfig {
            n_slots,
            n_ctx,
            n_batch: DEFAULT_N_BATCH,
            queue_capacity: 4 * n_slots,
            share_prefixes: true,
        }
    }

    /// Tokens one slot may hold (prompt plus generated).
    pub fn slot_ctx(&self) -> usize {
        self.n_ctx / self.n_slots.max(1)
    }
}

/// One generation request.
#[derive(Debug, Clone, Default)]
pub struct GenRequest {
    /// The prompt, already tokenized (with BOS if the model wants one).
    pub prompt: Vec<u32>,
    /// Sampling settings; `ignore_eos` also makes the slot keep going past
    /// end-of-generation tokens.
    pub sampling: SamplerParams,
    /// Most tokens to generate; `None` = until end of generation or the slot's context.
    pub max_tokens: Option<usize>,
    /// Stop strings: generation ends where one appears; it is not output.
    pub stop: Vec<String>,
    /// `Some(n)`: report the log-probability of each generated token and of the `n`
    /// most likely ones.
    pub logprobs: Option<usize>,
    /// A grammar the output must follow (compiled with
    /// [`GrammarEngine::compile`](crate::grammar::GrammarEngine::compile)).
    pub grammar: Option<Constraint>,
}

/// Why a request ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// An end-of-generation token or a stop string.
    Stop,
    /// `max_tokens` tokens were generated or the slot's context is full.
    Length,
    /// The scheduler was shut down ([`Scheduler::cancel_all`]).
    Cancelled,
    /// The server stopped the request before its end ([`Scheduler::finish_all`]): the
    /// output so far is a complete answer, cut short. Reported as `length`.
    Interrupted,
}

impl FinishReason {
    /// The OpenAI name (`stop`, `length`; `cancelled` has none there).
    ///
    /// [`Interrupted`](Self::Interrupted) is `length`: OpenAI's `finish_reason` has no
    /// value for "the server stopped it", and `length` is the one whose meaning clients
    /// already act on correctly (the text is truncated, not a finished answer; ask again
    /// or continue it). vLLM reports such requests as `abort`, a value outside OpenAI's
    /// set that typed clients may reject.
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length | FinishReason::Interrupted => "length",
            FinishReason::Cancelled => "cancelled",
        }
    }
}

/// The summary sent last for a request that ran.
#[derive(Debug, Clone, PartialEq)]
pub struct Completion {
    pub finish: FinishReason,
    pub prompt_tokens: usize,
    /// Tokens sampled, end-of-generation tokens excepted.
    pub completion_tokens: usize,
    /// Time spent waiting for a slot.
    pub queue_time: Duration,
    /// From admission to the first sampled token (prompt evaluation).
    pub prompt_time: Duration,
    /// From the first sampled token to the end.
    pub gen_time: Duration,
}

/// What a request's sink receives, in order: any number of `Token`s, then one `Done`
/// or one `Error`.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// A generated token. `text` is what may be shown now: it can be empty (an
    /// incomplete UTF-8 character, or text that might still become a stop string) or
    /// hold text of earlier tokens. The last `Token` before `Done` may carry no token
    /// (`token == None`) and only the text held back until then.
    Token {
        token: Option<u32>,
        text: String,
        logprobs: Option<Logprobs>,
    },
    Done(Completion),
    /// The request failed (a forward-pass error); nothing more follows.
    Error(String),
}

/// Where a request's events go.
pub trait EventSink: Send {
    /// Delivers an event; `false` when the receiver is gone (the request is then
    /// cancelled).
    fn send(&mut self, event: Event) -> bool;
    /// Whether the receiver is gone; checked before every step so that an abandoned
    /// request frees its slot even while it produces no text.
    fn is_closed(&self) -> bool {
        false
    }
}

impl EventSink for std::sync::mpsc::Sender<Event> {
    fn send(&mut self, event: Event) -> bool {
        std::sync::mpsc::Sender::send(self, event).is_ok()
    }
}

impl<F: FnMut(Event) -> bool + Send> EventSink for F {
    fn send(&mut self, event: Event) -> bool {
        self(event)
    }
}

/// Why a request was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SubmitError {
    #[error("the prompt is empty: nothing to evaluate")]
    EmptyPrompt,
    #[error(
        "the prompt is {n_prompt} tokens long, but a slot's context holds only {n_ctx} tokens"
    )]
    PromptTooLong { n_prompt: usize, n_ctx: usize },
    #[error("token id {token} is out of range (the vocabulary has {n_vocab} tokens)")]
    TokenOutOfRange { token: u32, n_vocab: usize },
    #[error("the server is busy: {capacity} requests are already waiting for a slot; retry later")]
    QueueFull { capacity: usize },
    #[error("the server is shutting down")]
    ShuttingDown,
}

/// Counters and gauges of a scheduler, for monitoring.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SchedulerStats {
    /// Requests accepted by [`Scheduler::submit`].
    pub requests_total: u64,
    /// Requests that ended (done, failed or cancelled).
    pub requests_finished: u64,
    /// Requests refused because the queue was full.
    pub requests_rejected: u64,
    /// Prompt tokens evaluated.
    pub prompt_tokens_total: u64,
    /// Prompt tokens not evaluated because their cells were copied from another
    /// sequence that shares the prompt's beginning.
    pub prompt_tokens_shared_total: u64,
    /// Tokens generated (end-of-generation tokens excepted, as in `usage`).
    pub generated_tokens_total: u64,
    /// Tokens sampled after evaluating a generated token (the first token of each
    /// request, sampled right after its prompt, is not counted here).
    pub decode_tokens_total: u64,
    /// Wall time of the steps that evaluated generated tokens (and whatever prompt
    /// chunks rode along in the same batch).
    pub decode_time: Duration,
    /// Forward calls made.
    pub steps_total: u64,
    /// Time spent in forward calls (the rest of a step is batching and sampling).
    pub forward_time: Duration,
    /// Slots holding a request now.
    pub slots_busy: usize,
    pub n_slots: usize,
    /// Requests waiting for a slot now.
    pub queue_depth: usize,
}

impl SchedulerStats {
    /// Decoding throughput, all slots together: `decode_tokens_total / decode_time`.
    pub fn tokens_per_second(&self) -> f64 {
        let s = self.decode_time.as_secs_f64();
        if s > 0.0 {
            self.decode_tokens_total as f64 / s
        } else {
            0.0
        }
    }
}

#[derive(Default)]
struct Counters {
    requests_total: AtomicU64,
    requests_finished: AtomicU64,
    requests_rejected: AtomicU64,
    prompt_tokens: AtomicU64,
    prompt_tokens_shared: AtomicU64,
    generated_tokens: AtomicU64,
    decode_tokens: AtomicU64,
    decode_nanos: AtomicU64,
    forward_nanos: AtomicU64,
    steps: AtomicU64,
    slots_busy: AtomicUsize,
}

struct Pending {
    id: u64,
    req: GenRequest,
    sink: Box<dyn EventSink>,
    enqueued: Instant,
}

#[derive(Default)]
struct Queue {
    waiting: VecDeque<Pending>,
    /// No new requests are accepted.
    closed: bool,
    /// End everything (queued and active) at the next step, for this reason.
    cancel: Option<FinishReason>,
    /// The engine thread should return.
    exit: bool,
}

struct Shared {
    queue: Mutex<Queue>,
    wake: Condvar,
    counters: Counters,
    next_id: AtomicU64,
    accepting: AtomicBool,
}

impl Shared {
    fn new() -> Self {
        Shared {
            queue: Mutex::new(Queue::default()),
            wake: Condvar::new(),
            counters: Counters::default(),
            next_id: AtomicU64::new(1),
            accepting: AtomicBool::new(true),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Queue> {
        self.queue.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Runs generation requests on one model with continuous batching (see the module
/// documentation). Dropping it cancels what is left and joins the engine thread.
pub struct Scheduler {
    shared: Arc<Shared>,
    config: SchedulerConfig,
    n_vocab: usize,
    thread: Option<JoinHandle<()>>,
}

impl Scheduler {
    /// Starts the engine thread. `n_ctx` and `n_slots` of `config` are raised to at
    /// least 1 and `n_batch` to at least `n_slots`.
    pub fn start(
        model: Arc<Model>,
        tokenizer: Arc<Tokenizer>,
        rt: Runtime,
        config: SchedulerConfig,
    ) -> std::io::Result<Self> {
        let mut config = config;
        config.n_slots = config.n_slots.max(1);
        config.n_ctx = config.n_ctx.max(config.n_slots);
        config.n_batch = config.n_batch.max(config.n_slots);
        let shared = Arc::new(Shared::new());
        let n_vocab = model.hparams().n_vocab;
        let engine = Engine::new(model, tokenizer, rt, &config, shared.clone());
        tracing::info!(
            n_slots = config.n_slots,
            n_ctx = config.n_ctx,
            slot_ctx = config.slot_ctx(),
            n_batch = config.n_batch,
            queue = config.queue_capacity,
            "scheduler started"
        );
        let thread = std::thread::Builder::new()
            .name("rustorch-engine".into())
            .spawn(move || engine.run())?;
        Ok(Scheduler {
            shared,
            config,
            n_vocab,
            thread: Some(thread),
        })
    }

    pub fn config(&self) -> &SchedulerConfig {
        &self.config
    }

    /// Tokens one slot may hold.
    pub fn slot_ctx(&self) -> usize {
        self.config.slot_ctx()
    }

    /// Queues a request; its events go to `sink`. Returns the request's id.
    pub fn submit(&self, req: GenRequest, sink: Box<dyn EventSink>) -> Result<u64, SubmitError> {
        if req.prompt.is_empty() {
            return Err(SubmitError::EmptyPrompt);
        }
        if req.prompt.len() > self.slot_ctx() {
            return Err(SubmitError::PromptTooLong {
                n_prompt: req.prompt.len(),
                n_ctx: self.slot_ctx(),
            });
        }
        if let Some(&token) = req.prompt.iter().find(|&&t| t as usize >= self.n_vocab) {
            return Err(SubmitError::TokenOutOfRange {
                token,
                n_vocab: self.n_vocab,
            });
        }
        let mut q = self.shared.lock();
        if q.closed {
            return Err(SubmitError::ShuttingDown);
        }
        if q.waiting.len() >= self.config.queue_capacity {
            self.shared
                .counters
                .requests_rejected
                .fetch_add(1, Ordering::Relaxed);
            return Err(SubmitError::QueueFull {
                capacity: self.config.queue_capacity,
            });
        }
        let id = self.shared.next_id.fetch_add(1, Ordering::Relaxed);
        q.waiting.push_back(Pending {
            id,
            req,
            sink,
            enqueued: Instant::now(),
        });
        self.shared
            .counters
            .requests_total
            .fetch_add(1, Ordering::SeqCst);
        drop(q);
        self.shared.wake.notify_all();
        tracing::debug!(id, "request queued");
        Ok(id)
    }

    /// A snapshot of the counters.
    pub fn stats(&self) -> SchedulerStats {
        let c = &self.shared.counters;
        let queue_depth = self.shared.lock().waiting.len();
        SchedulerStats {
            requests_total: c.requests_total.load(Ordering::Relaxed),
            requests_finished: c.requests_finished.load(Ordering::Relaxed),
            requests_rejected: c.requests_rejected.load(Ordering::Relaxed),
            prompt_tokens_total: c.prompt_tokens.load(Ordering::Relaxed),
            prompt_tokens_shared_total: c.prompt_tokens_shared.load(Ordering::Relaxed),
            generated_tokens_total: c.generated_tokens.load(Ordering::Relaxed),
            decode_tokens_total: c.decode_tokens.load(Ordering::Relaxed),
            decode_time: Duration::from_nanos(c.decode_nanos.load(Ordering::Relaxed)),
            steps_total: c.steps.load(Ordering::Relaxed),
            forward_time: Duration::from_nanos(c.forward_nanos.load(Ordering::Relaxed)),
            slots_busy: c.slots_busy.load(Ordering::Relaxed),
            n_slots: self.config.n_slots,
            queue_depth,
        }
    }

    /// Requests accepted and not ended yet (queued, running, or on their way from the
    /// queue to a slot).
    pub fn in_flight(&self) -> u64 {
        let c = &self.shared.counters;
        // finished first: every request counted there was counted in total before
        let finished = c.requests_finished.load(Ordering::SeqCst);
        let total = c.requests_total.load(Ordering::SeqCst);
        total.saturating_sub(finished)
    }

    /// Whether no request is waiting or running.
    pub fn is_idle(&self) -> bool {
        self.in_flight() == 0
    }

    /// Refuses new requests ([`SubmitError::ShuttingDown`]); queued and running ones
    /// go on.
    pub fn stop_accepting(&self) {
        self.shared.accepting.store(false, Ordering::Relaxed);
        self.shared.lock().closed = true;
    }

    /// Whether [`stop_accepting`](Self::stop_accepting) was called.
    pub fn is_accepting(&self) -> bool {
        self.shared.accepting.load(Ordering::Relaxed)
    }

    /// Refuses new requests and ends every queued and running one with
    /// [`FinishReason::Cancelled`] at the next step.
    pub fn cancel_all(&self) {
        self.end_all(FinishReason::Cancelled);
    }

    /// Refuses new requests and ends every queued and running one at the next step
    /// (after the forward pass under way, if any) as if it had reached its token limit:
    /// [`FinishReason::Interrupted`], with the text generated so far (held-back text
    /// included) sent first. A request that never got a slot ends with no tokens.
    pub fn finish_all(&self) {
        self.end_all(FinishReason::Interrupted);
    }

    fn end_all(&self, reason: FinishReason) {
        self.shared.accepting.store(false, Ordering::Relaxed);
        let mut q = self.shared.lock();
        q.closed = true;
        // a cancellation is not softened into an interruption
        if q.cancel != Some(FinishReason::Cancelled) {
            q.cancel = Some(reason);
        }
        drop(q);
        self.shared.wake.notify_all();
    }
}

impl Drop for Scheduler {
    fn drop(&mut self) {
        {
            let mut q = self.shared.lock();
            q.closed = true;
            q.cancel = Some(FinishReason::Cancelled);
            q.exit = true;
        }
        self.shared.wake.notify_all();
        if let Some(t) = self.thread.take() {
            if t.join().is_err() {
                tracing::error!("the engine thread panicked");
            }
        }
    }
}

/// A request being served.
struct Slot {
    id: u64,
    seq: SeqId,
    req: GenRequest,
    sink: Box<dyn EventSink>,
    sampler: Sampler,
    stream: TextStream,
    /// Prompt tokens evaluated so far.
    n_fed: usize,
    /// Tokens in this slot's sequence: the position of the next one.
    n_past: usize,
    /// The last sampled token, to be evaluated in the next step.
    next: Option<u32>,
    n_gen: usize,
    queue_time: Duration,
    admitted: Instant,
    first_token: Option<Instant>,
}

/// What a slot put into the step's batch.
struct Entry {
    slot: usize,
    n_tokens: usize,
    prompt_tokens: usize,
    /// Batch index of the token whose logits it samples from.
    logits_at: Option<usize>,
}

struct Engine {
    model: Arc<Model>,
    tokenizer: Arc<Tokenizer>,
    rt: Runtime,
    cache: KvCache,
    slots: Vec<Option<Slot>>,
    slot_ctx: usize,
    n_batch: usize,
    share_prefixes: bool,
    n_vocab: usize,
    shared: Arc<Shared>,
}

/// Fewest prompt tokens that a request takes from another sequence's cells.
pub const MIN_SHARED_PREFIX: usize = 8;

/// Length of the common beginning of `a` and `b`.
fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

impl Engine {
    fn new(
        model: Arc<Model>,
        tokenizer: Arc<Tokenizer>,
        rt: Runtime,
        config: &SchedulerConfig,
        shared: Arc<Shared>,
    ) -> Self {
        Engine {
            cache: model.new_cache(config.n_ctx),
            slots: (0..config.n_slots).map(|_| None).collect(),
            slot_ctx: config.slot_ctx(),
            n_batch: config.n_batch,
            share_prefixes: config.share_prefixes,
            n_vocab: model.hparams().n_vocab,
            model,
            tokenizer,
            rt,
            shared,
        }
    }

    fn run(mut self) {
        let mut batch = Batch::new();
        loop {
            let (incoming, cancel, exit) = match self.wait_for_work() {
                Some(w) => w,
                None => return,
            };
            if let Some(reason) = cancel {
                for p in incoming {
                    self.finish_pending(p, reason);
                }
                for i in 0..self.slots.len() {
                    self.finish(i, reason, false);
                }
                if exit {
                    return;
                }
                continue;
            }
            for p in incoming {
                self.admit(p);
            }
            let step = std::panic::catch_unwind(AssertUnwindSafe(|| self.step(&mut batch)));
            if step.is_err() {
                tracing::error!("a step of the engine panicked; failing its requests");
                for i in 0..self.slots.len() {
                    self.fail(i, "internal error while generating");
                }
                self.cache.clear();
            }
        }
    }

    fn busy(&self) -> usize {
        self.slots.iter().filter(|s| s.is_some()).count()
    }

    /// Blocks until there is something to do. Returns the requests to admit now (as
    /// many as there are free slots), why to end everything (if so), and whether to exit
    /// afterwards; `None` to exit at once.
    fn wait_for_work(&mut self) -> Option<(Vec<Pending>, Option<FinishReason>, bool)> {
        let shared = self.shared.clone();
        let mut q = shared.lock();
        loop {
            if let Some(reason) = q.cancel.take() {
                let all: Vec<Pending> = q.waiting.drain(..).collect();
                return Some((all, Some(reason), q.exit));
            }
            if q.exit {
                return None;
            }
            // drop waiting requests whose client is gone
            let before = q.waiting.len();
            q.waiting.retain(|p| !p.sink.is_closed());
            let dropped = before - q.waiting.len();
            if dropped > 0 {
                self.shared
                    .counters
                    .requests_finished
                    .fetch_add(dropped as u64, Ordering::SeqCst);
            }
            let free = self.slots.len() - self.busy();
            let n = free.min(q.waiting.len());
            let admit: Vec<Pending> = q.waiting.drain(..n).collect();
            if !admit.is_empty() || self.busy() > 0 {
                return Some((admit, None, false));
            }
            q = shared.wake.wait(q).unwrap_or_else(|e| e.into_inner());
        }
    }

    fn admit(&mut self, mut p: Pending) {
        let Some(i) = self.slots.iter().position(Option::is_none) else {
            // cannot happen: wait_for_work admits only as many as there are free slots
            self.finish_pending(p, FinishReason::Cancelled);
            return;
        };
        let seq = i as SeqId;
        self.cache.seq_rm(seq, None, None);
        let mut sampler = Sampler::new(p.req.sampling.clone(), self.n_vocab);
        for &t in &p.req.prompt {
            sampler.accept(t);
        }
        sampler.set_grammar(p.req.grammar.take());
        tracing::debug!(
            id = p.id,
            slot = i,
            n_prompt = p.req.prompt.len(),
            seed = sampler.seed(),
            "request admitted"
        );
        let stream = TextStream::new(p.req.stop.clone());
        self.slots[i] = Some(Slot {
            id: p.id,
            seq,
            sink: p.sink,
            sampler,
            stream,
            n_fed: 0,
            n_past: 0,
            next: None,
            n_gen: 0,
            queue_time: p.enqueued.elapsed(),
            admitted: Instant::now(),
            first_token: None,
            req: p.req,
        });
        self.shared
            .counters
            .slots_busy
            .store(self.busy(), Ordering::Relaxed);
    }

    /// Ends a request that never got a slot.
    fn finish_pending(&mut self, mut p: Pending, reason: FinishReason) {
        p.sink.send(Event::Done(Completion {
            finish: reason,
            prompt_tokens: 0,
            completion_tokens: 0,
            queue_time: p.enqueued.elapsed(),
            prompt_time: Duration::ZERO,
            gen_time: Duration::ZERO,
        }));
        self.shared
            .counters
            .requests_finished
            .fetch_add(1, Ordering::SeqCst);
    }

    /// Frees slot `i` and its cache cells.
    fn release(&mut self, i: usize) -> Option<Slot> {
        let slot = self.slots.get_mut(i)?.take()?;
        self.cache.seq_rm(slot.seq, None, None);
        let c = &self.shared.counters;
        c.slots_busy.store(self.busy(), Ordering::Relaxed);
        c.requests_finished.fetch_add(1, Ordering::SeqCst);
        Some(slot)
    }

    /// Sends what is left of slot `i`'s text and its summary, then frees it.
    /// `by_stop_string`: a stop string ended it (the text after it is dropped).
    fn finish(&mut self, i: usize, reason: FinishReason, by_stop_string: bool) {
        let Some(mut slot) = self.release(i) else {
            return;
        };
        let rest = slot.stream.finish(by_stop_string);
        if !rest.is_empty() && reason != FinishReason::Cancelled {
            slot.sink.send(Event::Token {
                token: None,
                text: rest,
                logprobs: None,
            });
        }
        let now = Instant::now();
        let first = slot.first_token.unwrap_or(now);
        let done = Completion {
            finish: reason,
            prompt_tokens: slot.req.prompt.len(),
            completion_tokens: slot.n_gen,
            queue_time: slot.queue_time,
            prompt_time: first.duration_since(slot.admitted),
            gen_time: now.duration_since(first),
        };
        tracing::debug!(
            id = slot.id,
            slot = i,
            finish = reason.as_str(),
            n_prompt = done.prompt_tokens,
            n_gen = done.completion_tokens,
            prompt_ms = done.prompt_time.as_secs_f64() * 1e3,
            gen_ms = done.gen_time.as_secs_f64() * 1e3,
            "request finished"
        );
        slot.sink.send(Event::Done(done));
    }

    /// Reports an error to slot `i` and frees it.
    fn fail(&mut self, i: usize, message: &str) {
        if let Some(mut slot) = self.release(i) {
            tracing::warn!(id = slot.id, slot = i, error = message, "request failed");
            slot.sink.send(Event::Error(message.to_string()));
        }
    }

    /// Frees slot `i` because its client is gone.
    fn drop_abandoned(&mut self, i: usize) {
        if let Some(slot) = self.release(i) {
            tracing::debug!(id = slot.id, slot = i, "client gone; slot released");
        }
    }

    fn step(&mut self, batch: &mut Batch) {
        for i in 0..self.slots.len() {
            if self.slots[i].as_ref().is_some_and(|s| s.sink.is_closed()) {
                self.drop_abandoned(i);
            }
        }
        if self.share_prefixes {
            self.share_prompt_prefixes(batch);
        }
        batch.clear();
        let mut entries: Vec<Entry> = Vec::new();
        // one token for every generating slot
        for (i, slot) in self.slots.iter().enumerate() {
            let Some(s) = slot else { continue };
            if let Some(t) = s.next {
                entries.push(Entry {
                    slot: i,
                    n_tokens: 1,
                    prompt_tokens: 0,
                    logits_at: Some(batch.len()),
                });
                batch.push(t, s.n_past as u32, s.seq, true);
            }
        }
        let generating = !entries.is_empty();
        // then prompt chunks, oldest request first, while the batch has room
        let mut order: Vec<usize> = (0..self.slots.len())
            .filter(|&i| {
                self.slots[i]
                    .as_ref()
                    .is_some_and(|s| s.next.is_none() && s.n_fed < s.req.prompt.len())
            })
            .collect();
        order.sort_by_key(|&i| self.slots[i].as_ref().map_or(0, |s| s.id));
        for i in order {
            let room = self.n_batch.saturating_sub(batch.len());
            if room == 0 {
                break;
            }
            let Some(s) = self.slots[i].as_ref() else {
                continue;
            };
            let take = room.min(s.req.prompt.len() - s.n_fed);
            let last = s.n_fed + take == s.req.prompt.len();
            for (k, &t) in s.req.prompt[s.n_fed..s.n_fed + take].iter().enumerate() {
                batch.push(t, (s.n_past + k) as u32, s.seq, last && k + 1 == take);
            }
            entries.push(Entry {
                slot: i,
                n_tokens: take,
                prompt_tokens: take,
                logits_at: last.then(|| batch.len() - 1),
            });
        }
        if batch.is_empty() {
            return;
        }

        let t0 = Instant::now();
        let out = match self.forward(batch) {
            Ok(o) => o,
            Err(e) => {
                let msg = format!("forward pass failed: {e}");
                for en in &entries {
                    self.fail(en.slot, &msg);
                }
                return;
            }
        };
        let mut n_prompt = 0u64;
        for en in &entries {
            if let Some(Some(s)) = self.slots.get_mut(en.slot) {
                s.n_past += en.n_tokens;
                s.n_fed += en.prompt_tokens;
                n_prompt += en.prompt_tokens as u64;
            }
        }
        self.shared
            .counters
            .prompt_tokens
            .fetch_add(n_prompt, Ordering::Relaxed);
        for en in &entries {
            let Some(bi) = en.logits_at else { continue };
            let Some(logits) = out.logits_for(bi, self.n_vocab) else {
                self.fail(en.slot, "the forward pass returned no logits");
                continue;
            };
            self.sample(en.slot, logits, en.prompt_tokens == 0);
        }
        if generating {
            self.shared
                .counters
                .decode_nanos
                .fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
        }
    }

    /// One forward call, counted in the stats.
    fn forward(&mut self, batch: &Batch) -> Result<ForwardOutput, ModelError> {
        let t0 = Instant::now();
        let out = self.model.forward(batch, &mut self.cache, &self.rt);
        let c = &self.shared.counters;
        c.steps.fetch_add(1, Ordering::Relaxed);
        c.forward_nanos
            .fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
        out
    }

    /// Records that slot `i`, fresh, has its first `n` prompt tokens in the cache.
    fn mark_fed(&mut self, i: usize, n: usize) {
        if let Some(Some(s)) = self.slots.get_mut(i) {
            s.n_fed = n;
            s.n_past = n;
        }
    }

    /// Slot `i` takes the cells of positions `0..n` of sequence `src` as its first `n`
    /// prompt tokens; false (and nothing changes) when the cache has no room for them.
    fn take_prefix(&mut self, i: usize, src: SeqId, n: usize) -> bool {
        let Some(Some(s)) = self.slots.get(i) else {
            return false;
        };
        if self
            .cache
            .seq_cp_range(src, s.seq, None, Some(n as u32))
            .is_err()
        {
            return false;
        }
        self.mark_fed(i, n);
        self.shared
            .counters
            .prompt_tokens_shared
            .fetch_add(n as u64, Ordering::Relaxed);
        true
    }

    /// Gives requests that have not started their prompt the cells of the beginning they
    /// share with a live slot's evaluated prompt, or with other new requests (evaluated
    /// once, by one of them, in a forward call of its own). See the module documentation.
    fn share_prompt_prefixes(&mut self, batch: &mut Batch) {
        let mut fresh: Vec<(u64, usize)> = self
            .slots
            .iter()
            .enumerate()
            .filter_map(|(i, s)| {
                let s = s.as_ref()?;
                (s.n_fed == 0 && s.next.is_none()).then_some((s.id, i))
            })
            .collect();
        if fresh.is_empty() {
            return;
        }
        fresh.sort_unstable();
        let mut waiting = Vec::new();
        for &(_, i) in &fresh {
            let Some(Some(slot)) = self.slots.get(i) else {
                continue;
            };
            let p = slot.req.prompt.clone();
            let limit = p.len().saturating_sub(1);
            // the longest beginning already evaluated by a live slot
            let best = self
                .slots
                .iter()
                .flatten()
                .filter(|o| o.n_fed > 0)
                .map(|o| {
                    (
                        common_prefix(&o.req.prompt[..o.n_fed], &p).min(limit),
                        o.seq,
                    )
                })
                .max_by_key(|&(n, _)| n);
            match best {
                Some((n, src)) if n >= MIN_SHARED_PREFIX && self.take_prefix(i, src, n) => {}
                _ => waiting.push((i, p)),
            }
        }
        // new requests among themselves: the oldest evaluates what it shares with the others
        let mut taken = vec![false; waiting.len()];
        for a in 0..waiting.len() {
            if taken[a] {
                continue;
            }
            let pa = &waiting[a].1;
            let mut n = pa.len().saturating_sub(1).min(self.n_batch);
            let mut group = Vec::new();
            for b in (a + 1..waiting.len()).filter(|&b| !taken[b]) {
                let pb = &waiting[b].1;
                let c = common_prefix(pa, pb).min(pb.len().saturating_sub(1));
                if c >= MIN_SHARED_PREFIX {
                    group.push(b);
                    n = n.min(c);
                }
            }
            if group.is_empty() || n < MIN_SHARED_PREFIX {
                continue;
            }
            let Some(Some(leader)) = self.slots.get(waiting[a].0) else {
                continue;
            };
            let seq = leader.seq;
            batch.clear();
            for (k, &t) in pa[..n].iter().enumerate() {
                batch.push(t, k as u32, seq, false);
            }
            if let Err(e) = self.forward(batch) {
                // the regular step evaluates these prompts (and reports what fails)
                tracing::debug!(error = %e, "evaluating a shared prompt beginning failed");
                self.cache.seq_rm(seq, None, None);
                return;
            }
            self.shared
                .counters
                .prompt_tokens
                .fetch_add(n as u64, Ordering::Relaxed);
            self.mark_fed(waiting[a].0, n);
            for b in group {
                taken[b] = true;
                self.take_prefix(waiting[b].0, seq, n);
            }
            tracing::debug!(n_tokens = n, "shared prompt beginning evaluated once");
        }
    }

    /// Samples the next token of slot `i`, streams it, and finishes the slot when it is
    /// done. `decoding`: the logits are those of a generated token (not of the prompt).
    fn sample(&mut self, i: usize, logits: &[f32], decoding: bool) {
        let tokenizer = self.tokenizer.clone();
        let slot_ctx = self.slot_ctx;
        let Some(Some(s)) = self.slots.get_mut(i) else {
            return;
        };
        let token = s.sampler.sample(logits);
        let bytes = tokenizer.token_to_piece(token, false);
        // with an active grammar an end-of-generation token means it is complete
        let grammar_end = s.sampler.grammar_active();
        s.sampler.accept_generated(token, &bytes);
        if s.first_token.is_none() {
            s.first_token = Some(Instant::now());
        }
        let outcome = if tokenizer.is_eog(token) && (!s.req.sampling.ignore_eos || grammar_end) {
            Some((FinishReason::Stop, false))
        } else {
            s.n_gen += 1;
            // counted before the token is delivered, so that a client that has its
            // answer also sees it in the counters
            let c = &self.shared.counters;
            c.generated_tokens.fetch_add(1, Ordering::Relaxed);
            if decoding {
                c.decode_tokens.fetch_add(1, Ordering::Relaxed);
            }
            let lp = s.req.logprobs.map(|n| logprobs(logits, token, n));
            let (text, stopped) = s.stream.push(&bytes);
            let delivered = s.sink.send(Event::Token {
                token: Some(token),
                text,
                logprobs: lp,
            });
            if !delivered {
                self.drop_abandoned(i);
                return;
            }
            if stopped {
                Some((FinishReason::Stop, true))
            } else if s.req.max_tokens.is_some_and(|n| s.n_gen >= n) || s.n_past >= slot_ctx {
                Some((FinishReason::Length, false))
            } else {
                s.next = Some(token);
                None
            }
        };
        if let Some((reason, by_stop_string)) = outcome {
            self.finish(i, reason, by_stop_string);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;
    use std::sync::mpsc;

    use rustorch_core::gguf::GgufFile;

    use super::*;
    use crate::engine::{generate, GenerateParams, Session};

    fn load() -> Option<(Arc<Model>, Arc<Tokenizer>)> {
        let path = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../models/SmolLM2-135M-Instruct.Q4_1.gguf");
        if !path.is_file() {
            eprintln!("SKIPPED: {} is absent", path.display());
            return None;
        }
        let gguf = Arc::new(GgufFile::open(&path).expect("open"));
        let tok = Tokenizer::from_gguf(&gguf).expect("tokenizer");
        let model = Model::load(gguf).expect("model");
        Some((Arc::new(model), Arc::new(tok)))
    }

    fn request(tok: &Tokenizer, text: &str, n: usize) -> GenRequest {
        GenRequest {
            prompt: tok.encode(text, true, true).expect("encode"),
            sampling: SamplerParams::greedy(),
            max_tokens: Some(n),
            ..GenRequest::default()
        }
    }

    /// The greedy text of `n` tokens after `prompt` from the single-sequence engine.
    fn engine_text(model: &Model, tok: &Tokenizer, prompt: &[u32], n: usize) -> String {
        let rt = Runtime::new(1);
        let mut session = Session::new(model, &rt, 256);
        let mut sampler = Sampler::new(SamplerParams::greedy(), tok.n_vocab());
        let params = GenerateParams {
            n_predict: Some(n),
            ..GenerateParams::default()
        };
        generate(
            &mut session,
            tok,
            &mut sampler,
            prompt,
            &params,
            &mut |_| true,
        )
        .expect("generate")
        .text
    }

    /// Collects a request's text and summary.
    fn wait(rx: mpsc::Receiver<Event>) -> (String, Completion) {
        let mut text = String::new();
        for ev in rx {
            match ev {
                Event::Token { text: t, .. } => text.push_str(&t),
                Event::Done(c) => return (text, c),
                Event::Error(e) => panic!("request failed: {e}"),
            }
        }
        panic!("no Done event");
    }

    #[test]
    fn config_splits_the_context() {
        let c = SchedulerConfig::new(4096, 8);
        assert_eq!(c.slot_ctx(), 512);
        assert_eq!(c.queue_capacity, 32);
        assert_eq!(SchedulerConfig::new(100, 0).n_slots, 1);
    }

    /// Greedy output through the scheduler, alone and batched with others, equals what
    /// the single-sequence engine generates.
    #[test]
    fn batched_greedy_output_matches_the_engine() {
        let Some((model, tok)) = load() else { return };
        let prompts = [
            "The capital of France is",
            "Once upon a time",
            "1, 2, 3, 4,",
        ];
        let n = 12;
        let expected: Vec<String> = prompts
            .iter()
            .map(|p| engine_text(&model, &tok, &tok.encode(p, true, true).expect("encode"), n))
            .collect();

        let mut config = SchedulerConfig::new(1024, 4);
        config.n_batch = 8; // forces prompts to be evaluated in several chunks
        let sched =
            Scheduler::start(model.clone(), tok.clone(), Runtime::new(1), config).expect("start");
        // alone
        for (p, want) in prompts.iter().zip(&expected) {
            let (tx, rx) = mpsc::channel();
            sched
                .submit(request(&tok, p, n), Box::new(tx))
                .expect("submit");
            let (text, done) = wait(rx);
            assert_eq!(&text, want, "{p:?} alone");
            assert_eq!(done.finish, FinishReason::Length);
            assert_eq!(done.completion_tokens, n);
        }
        // all together
        let rxs: Vec<_> = prompts
            .iter()
            .map(|p| {
                let (tx, rx) = mpsc::channel();
                sched
                    .submit(request(&tok, p, n), Box::new(tx))
                    .expect("submit");
                rx
            })
            .collect();
        for ((p, want), rx) in prompts.iter().zip(&expected).zip(rxs) {
            assert_eq!(&wait(rx).0, want, "{p:?} batched");
        }
        let s = sched.stats();
        assert_eq!(s.slots_busy, 0);
        assert_eq!(s.requests_total, 6);
        assert_eq!(s.generated_tokens_total, 6 * n as u64);
    }

    /// Requests whose prompts begin alike evaluate the beginning once, whether they start
    /// in the same step (one evaluates it in a forward call of its own) or one after the
    /// other (the later ones copy a live slot's cells), and still produce exactly the
    /// engine's greedy text; with sharing off every prompt is evaluated in full.
    #[test]
    fn shared_prompt_beginnings_are_evaluated_once() {
        let Some((model, tok)) = load() else { return };
        let system = "You are a helpful assistant. You answer questions about cities, \
                      rivers and mountains in one short sentence.\nQuestion: ";
        let prompts = [
            format!("{system}What is the capital of France?"),
            format!("{system}Which river flows through London?"),
            format!("{system}How high is Mount Everest?"),
        ];
        let n = 8;
        let encoded: Vec<Vec<u32>> = prompts
            .iter()
            .map(|p| tok.encode(p, true, true).expect("encode"))
            .collect();
        let common =
            common_prefix(&encoded[0], &encoded[1]).min(common_prefix(&encoded[0], &encoded[2]));
        assert!(common >= MIN_SHARED_PREFIX + 8, "{common}");
        let expected: Vec<String> = encoded
            .iter()
            .map(|prompt| engine_text(&model, &tok, prompt, n))
            .collect();

        // (together, staggered, sharing) -> prompt tokens evaluated, copied, forward calls
        for (together, share) in [(true, true), (false, true), (true, false)] {
            let mut config = SchedulerConfig::new(1024, 4);
            config.share_prefixes = share;
            let shared = Arc::new(Shared::new());
            let mut engine = Engine::new(
                model.clone(),
                tok.clone(),
                Runtime::new(1),
                &config,
                shared.clone(),
            );
            let mut batch = Batch::new();
            let mut rxs = Vec::new();
            for (k, prompt) in encoded.iter().enumerate() {
                let (tx, rx) = mpsc::channel();
                let req = GenRequest {
                    prompt: prompt.clone(),
                    sampling: SamplerParams::greedy(),
                    max_tokens: Some(n),
                    ..GenRequest::default()
                };
                engine.admit(Pending {
                    id: k as u64 + 1,
                    req,
                    sink: Box::new(tx),
                    enqueued: Instant::now(),
                });
                rxs.push(rx);
                if !together {
                    engine.step(&mut batch);
                }
            }
            while engine.busy() > 0 {
                engine.step(&mut batch);
            }
            for ((rx, want), p) in rxs.into_iter().zip(&expected).zip(&prompts) {
                assert_eq!(&wait(rx).0, want, "{p:?} together={together} share={share}");
            }
            let c = &shared.counters;
            let total: usize = encoded.iter().map(Vec::len).sum();
            let evaluated = c.prompt_tokens.load(Ordering::Relaxed) as usize;
            let copied = c.prompt_tokens_shared.load(Ordering::Relaxed) as usize;
            let steps = c.steps.load(Ordering::Relaxed) as usize;
            assert_eq!(
                evaluated + copied,
                total,
                "together={together} share={share}"
            );
            if share {
                assert_eq!(copied, 2 * common, "together={together}");
            } else {
                assert_eq!(copied, 0);
            }
            // the shared beginning costs one forward call of its own when all start together
            let extra = usize::from(together && share);
            let gen_steps = if together { n } else { n + 2 };
            assert_eq!(
                steps,
                gen_steps + extra,
                "together={together} share={share}"
            );
            assert_eq!(engine.cache.used(), 0, "cells released");
        }
    }

    #[test]
    fn refusals() {
        let Some((model, tok)) = load() else { return };
        let mut config = SchedulerConfig::new(64, 2);
        config.queue_capacity = 1;
        let sched = Scheduler::start(model, tok.clone(), Runtime::new(1), config).expect("start");
        let sink = || Box::new(|_: Event| true) as Box<dyn EventSink>;
        assert_eq!(
            sched.submit(GenRequest::default(), sink()),
            Err(SubmitError::EmptyPrompt)
        );
        let long = GenRequest {
            prompt: vec![1; 33],
            ..GenRequest::default()
        };
        assert_eq!(
            sched.submit(long, sink()),
            Err(SubmitError::PromptTooLong {
                n_prompt: 33,
                n_ctx: 32
            })
        );
        let bad = GenRequest {
            prompt: vec![u32::MAX],
            ..GenRequest::default()
        };
        assert!(matches!(
            sched.submit(bad, sink()),
            Err(SubmitError::TokenOutOfRange { .. })
        ));
        sched.cancel_all();
        assert_eq!(
            sched.submit(request(&tok, "hi", 1), sink()),
            Err(SubmitError::ShuttingDown)
        );
    }
    /// `finish_all` ends a running request with the text it has, as `Interrupted`
    /// (`length`), and a queued one with none; nothing is in flight afterwards and new
    /// requests are refused.
    #[test]
    fn finish_all_ends_running_and_queued_requests() {
        let Some((model, tok)) = load() else { return };
        let config = SchedulerConfig::new(1024, 1);
        let sched = Scheduler::start(model, tok.clone(), Runtime::new(1), config).expect("start");
        let mut long = request(&tok, "Tell me a long story.", 1000);
        long.sampling.ignore_eos = true;
        let (tx, running) = mpsc::channel();
        sched.submit(long.clone(), Box::new(tx)).expect("submit");
        let (tx, queued) = mpsc::channel();
        sched.submit(long, Box::new(tx)).expect("submit");
        assert_eq!(sched.in_flight(), 2);
        let mut text = String::new();
        let mut n_tokens = 0;
        while n_tokens < 3 {
            match running.recv().expect("event") {
                Event::Token { token, text: t, .. } => {
                    text.push_str(&t);
                    n_tokens += usize::from(token.is_some());
                }
                other => panic!("unexpected {other:?}"),
            }
        }
        sched.finish_all();
        let (rest, done) = wait(running);
        text.push_str(&rest);
        assert_eq!(done.finish, FinishReason::Interrupted);
        assert_eq!(done.finish.as_str(), "length");
        assert!(done.completion_tokens >= 3 && done.completion_tokens < 1000);
        assert!(!text.is_empty());
        let (text, done) = wait(queued);
        assert_eq!((text.as_str(), done.completion_tokens), ("", 0));
        assert_eq!(done.finish, FinishReason::Interrupted);
        assert!(sched.is_idle());
        assert_eq!(
            sched.submit(request(&tok, "hi", 1), Box::new(|_: Event| true)),
            Err(SubmitError::ShuttingDown)
        );
    }
}
