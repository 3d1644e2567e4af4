//! The generation engine: a session that owns one sequence of a KV cache, evaluates
//! prompts at explicit positions, and a generation loop that samples, streams UTF-8 text
//! safely, stops at end-of-generation tokens or stop strings, and can shift the context
//! the way llama.cpp does when it fills.

use std::time::{Duration, Instant};

use crate::batch::{Batch, SeqId};
use crate::kv_cache::KvCache;
use crate::model::{ForwardOutput, Model, ModelError, Runtime};
use crate::sampler::Sampler;
use crate::tokenizer::{Tokenizer, TokenizerError};

/// Largest number of tokens evaluated in one forward call (llama.cpp's `n_batch`).
pub const DEFAULT_N_BATCH: usize = 512;

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),
    #[error("the prompt is {n_prompt} tokens long, but the context holds only {n_ctx} (raise --ctx-size)")]
    PromptTooLong { n_prompt: usize, n_ctx: usize },
    #[error("the prompt is empty: nothing to evaluate")]
    EmptyPrompt,
}

/// One sequence of a KV cache and the tokens it holds, at positions `0..n_past`.
pub struct Session<'a> {
    model: &'a Model,
    rt: &'a Runtime,
    cache: KvCache,
    seq: SeqId,
    tokens: Vec<u32>,
    n_batch: usize,
    observer: Option<Observer<'a>>,
}

/// Called after every forward call with the batch and its output (debug tooling:
/// `--dump-layers`, `--top-logits`).
pub type Observer<'a> = Box<dyn FnMut(&Batch, &ForwardOutput) + 'a>;

impl<'a> Session<'a> {
    pub fn new(model: &'a Model, rt: &'a Runtime, n_ctx: usize) -> Self {
        Session {
            model,
            rt,
            cache: model.new_cache(n_ctx),
            seq: 0,
            tokens: Vec::new(),
            n_batch: DEFAULT_N_BATCH,
            observer: None,
        }
    }

    /// Installs a callback that sees every forward call.
    pub fn set_observer(&mut self, observer: Observer<'a>) {
        self.observer = Some(observer);
    }

    pub fn model(&self) -> &Model {
        self.model
    }
    pub fn n_ctx(&self) -> usize {
        self.cache.n_ctx()
    }
    /// Tokens held in the cache, in position order.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }
    pub fn n_past(&self) -> usize {
        self.tokens.len()
    }

    /// Forgets everything.
    pub fn clear(&mut self) {
        self.cache.clear();
        self.tokens.clear();
    }

    /// Drops the tokens from position `n` on.
    pub fn truncate(&mut self, n: usize) {
        if n < self.tokens.len() {
            self.cache.seq_rm(self.seq, Some(n as u32), None);
            self.tokens.truncate(n);
        }
    }

    /// Evaluates `tokens` after those already held (positions `n_past..`), in batches of
    /// at most `n_batch`, and returns the logits of the last one.
    pub fn append(&mut self, tokens: &[u32]) -> Result<Vec<f32>, EngineError> {
        if tokens.is_empty() {
            return Err(EngineError::EmptyPrompt);
        }
        if self.tokens.len() + tokens.len() > self.n_ctx() {
            return Err(EngineError::PromptTooLong {
                n_prompt: self.tokens.len() + tokens.len(),
                n_ctx: self.n_ctx(),
            });
        }
        let nv = self.model.hparams().n_vocab;
        let mut last = Vec::new();
        for chunk in tokens.chunks(self.n_batch) {
            let start = self.tokens.len() as u32;
            let batch = Batch::from_prompt(chunk, start, self.seq, false);
            let out = self.model.forward(&batch, &mut self.cache, self.rt)?;
            if let Some(obs) = self.observer.as_mut() {
                obs(&batch, &out);
            }
            self.tokens.extend_from_slice(chunk);
            last = out.last(nv).map(<[f32]>::to_vec).unwrap_or_default();
        }
        Ok(last)
    }

    /// Makes the session hold exactly `tokens`, keeping the longest prefix already
    /// cached and evaluating only the rest (at least the last token, for its logits).
    /// Returns the logits of the last token and how many tokens were evaluated.
    pub fn sync(&mut self, tokens: &[u32]) -> Result<(Vec<f32>, usize), EngineError> {
        if tokens.is_empty() {
            return Err(EngineError::EmptyPrompt);
        }
        if tokens.len() > self.n_ctx() {
            return Err(EngineError::PromptTooLong {
                n_prompt: tokens.len(),
                n_ctx: self.n_ctx(),
            });
        }
        let common = self
            .tokens
            .iter()
            .zip(tokens)
            .take_while(|(a, b)| a == b)
            .count()
            .min(tokens.len() - 1);
        self.truncate(common);
        let rest = &tokens[common..];
        Ok((self.append(rest)?, rest.len()))
    }

    /// llama.cpp's context shift: keep the first `n_keep` tokens, drop `n_discard` after
    /// them, and move the rest back, re-rotating their cached keys.
    pub fn shift(&mut self, n_keep: usize, n_discard: usize) {
        let n_past = self.tokens.len();
        let n_keep = n_keep.min(n_past);
        let n_discard = n_discard.min(n_past - n_keep);
        if n_discard == 0 {
            return;
        }
        let (k0, k1) = (n_keep as u32, (n_keep + n_discard) as u32);
        self.cache.seq_rm(self.seq, Some(k0), Some(k1));
        let model = self.model;
        self.cache
            .seq_add(self.seq, k1, None, -(n_discard as i64), &|row, delta| {
                model.rotate_keys(row, delta)
            });
        self.tokens.drain(n_keep..n_keep + n_discard);
        tracing::debug!(
            n_keep,
            n_discard,
            n_past = self.tokens.len(),
            "context shift"
        );
    }
}

/// Why generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopReason {
    /// The model produced an end-of-generation token.
    EndOfGeneration,
    /// `n_predict` tokens were generated.
    Length,
    /// A stop string appeared.
    StopString,
    /// The context filled and shifting was off.
    ContextFull,
    /// The caller asked to stop.
    Cancelled,
}

/// Settings of one generation.
#[derive(Debug, Clone, Default)]
pub struct GenerateParams {
    /// Most tokens to generate; `None` = until end of generation or context.
    pub n_predict: Option<usize>,
    /// Stop strings (reverse prompts): generation ends where one appears; it is not output.
    pub stop: Vec<String>,
    /// When the context fills: shift it (llama.cpp `--context-shift`) instead of stopping.
    pub context_shift: bool,
    /// Tokens at the start kept by a context shift (`--keep`).
    pub n_keep: usize,
    /// Do not stop at end-of-generation tokens.
    pub ignore_eos: bool,
}

/// What a generation produced, with llama.cpp-style timings.
#[derive(Debug, Clone)]
pub struct Generation {
    pub text: String,
    pub tokens: Vec<u32>,
    pub stop: StopReason,
    pub prompt_tokens: usize,
    pub prompt_time: Duration,
    pub gen_time: Duration,
}

/// Runs prompt evaluation and sampling. `on_text` receives each piece of text as soon as
/// it is complete UTF-8 and cannot be part of a stop string; returning `false` cancels.
/// The prompt is synced against the session (only new tokens are evaluated).
pub fn generate(
    session: &mut Session<'_>,
    tokenizer: &Tokenizer,
    sampler: &mut Sampler,
    prompt: &[u32],
    params: &GenerateParams,
    on_text: &mut dyn FnMut(&str) -> bool,
) -> Result<Generation, EngineError> {
    let t0 = Instant::now();
    let (mut logits, evaluated) = session.sync(prompt)?;
    let prompt_time = t0.elapsed();
    for &t in prompt {
        sampler.accept(t);
    }
    sampler.restart_grammar();
    let t1 = Instant::now();
    let mut stream = TextStream::new(params.stop.clone());
    let mut tokens = Vec::new();
    let stop = loop {
        if params.n_predict.is_some_and(|n| tokens.len() >= n) {
            break StopReason::Length;
        }
        let token = sampler.sample(&logits);
        let bytes = tokenizer.token_to_piece(token, false);
        // with an active grammar an end-of-generation token means it is complete
        let grammar_end = sampler.grammar_active();
        sampler.accept_generated(token, &bytes);
        if tokenizer.is_eog(token) && (!params.ignore_eos || grammar_end) {
            break StopReason::EndOfGeneration;
        }
        tokens.push(token);
        let (piece, stopped) = stream.push(&bytes);
        if !piece.is_empty() && !on_text(&piece) {
            break StopReason::Cancelled;
        }
        if stopped {
            break StopReason::StopString;
        }
        if params.n_predict.is_some_and(|n| tokens.len() >= n) {
            break StopReason::Length;
        }
        if session.n_past() + 1 > session.n_ctx() {
            if !params.context_shift {
                break StopReason::ContextFull;
            }
            let n_keep = params.n_keep.min(session.n_past());
            let n_discard = (session.n_past() - n_keep) / 2;
            session.shift(n_keep, n_discard);
        }
        logits = session.append(&[token])?;
    };
    let rest = stream.finish(stop == StopReason::StopString);
    if !rest.is_empty() && stop != StopReason::Cancelled {
        on_text(&rest);
    }
    Ok(Generation {
        text: stream.text,
        tokens,
        stop,
        prompt_tokens: evaluated,
        prompt_time,
        gen_time: t1.elapsed(),
    })
}

/// Turns token pieces into text: never emits a partial UTF-8 character, and holds back
/// text that could still become a stop string.
pub struct TextStream {
    pending: Vec<u8>,
    /// All text produced so far (after a stop string is found, up to it).
    pub text: String,
    emitted: usize,
    stops: Vec<String>,
    stopped: bool,
}

impl TextStream {
    pub fn new(stops: Vec<String>) -> Self {
        TextStream {
            pending: Vec::new(),
            text: String::new(),
            emitted: 0,
            stops: stops.into_iter().filter(|s| !s.is_empty()).collect(),
            stopped: false,
        }
    }

    /// Adds bytes; returns the text now safe to show and whether a stop string appeared.
    pub fn push(&mut self, bytes: &[u8]) -> (String, bool) {
        if self.stopped {
            return (String::new(), true);
        }
        self.pending.extend_from_slice(bytes);
        self.drain_utf8(false);
        let max_stop = self.stops.iter().map(String::len).max().unwrap_or(0);
        let from = floor_boundary(&self.text, self.emitted.saturating_sub(max_stop));
        let found = self
            .stops
            .iter()
            .filter_map(|s| self.text[from..].find(s.as_str()).map(|i| from + i))
            .min();
        if let Some(at) = found {
            self.text.truncate(at);
            self.stopped = true;
            let out = self.text[self.emitted.min(at)..].to_string();
            self.emitted = self.text.len();
            return (out, true);
        }
        // hold back the longest tail that is a prefix of some stop string
        let hold = self
            .stops
            .iter()
            .map(|s| longest_suffix_prefix(&self.text, s))
            .max()
            .unwrap_or(0);
        let upto = floor_boundary(&self.text, self.text.len() - hold).max(self.emitted);
        let out = self.text[self.emitted..upto].to_string();
        self.emitted = upto;
        (out, false)
    }

    /// Everything not yet emitted (incomplete UTF-8 becomes U+FFFD).
    pub fn finish(&mut self, stopped: bool) -> String {
        if !stopped {
            self.drain_utf8(true);
        }
        let out = self.text[self.emitted..].to_string();
        self.emitted = self.text.len();
        out
    }

    fn drain_utf8(&mut self, flush: bool) {
        loop {
            match std::str::from_utf8(&self.pending) {
                Ok(s) => {
                    self.text.push_str(s);
                    self.pending.clear();
                    return;
                }
                Err(e) => {
                    let valid = e.valid_up_to();
                    // SAFETY-free: the prefix was just validated
                    self.text
                        .push_str(&String::from_utf8_lossy(&self.pending[..valid]));
                    match e.error_len() {
                        Some(bad) => {
                            self.text.push('\u{FFFD}');
                            self.pending.drain(..valid + bad);
                        }
                        None => {
                            self.pending.drain(..valid);
                            if flush && !self.pending.is_empty() {
                                self.text.push('\u{FFFD}');
                                self.pending.clear();
                            }
                            return;
                        }
                    }
                }
            }
        }
    }
}

fn floor_boundary(s: &str, mut i: usize) -> usize {
    while i > 0 && !s.is_char_boundary(i) {
        i -= 1;
    }
    i
}

/// Length of the longest suffix of `text` that is a proper prefix of `stop`.
fn longest_suffix_prefix(text: &str, stop: &str) -> usize {
    let max = stop.len().saturating_sub(1).min(text.len());
    (1..=max)
        .rev()
        .find(|&n| {
            text.is_char_boundary(text.len() - n)
                && stop
                    .as_bytes()
                    .starts_with(&text.as_bytes()[text.len() - n..])
        })
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn utf8_is_never_split() {
        let mut s = TextStream::new(vec![]);
        let euro = "€".as_bytes();
        assert_eq!(s.push(&euro[..1]).0, "");
        assert_eq!(s.push(&euro[1..2]).0, "");
        assert_eq!(s.push(&euro[2..]).0, "€");
        assert_eq!(s.push(&[0xff, b'a']).0, "\u{FFFD}a");
        assert_eq!(s.push(&euro[..2]).0, "");
        assert_eq!(s.finish(false), "\u{FFFD}");
    }

    #[test]
    fn stop_strings_are_held_back_and_cut() {
        let mut s = TextStream::new(vec!["User:".into()]);
        assert_eq!(s.push(b"Hello Us"), ("Hello ".to_string(), false));
        assert_eq!(s.push(b"ual"), ("Usual".to_string(), false));
        assert_eq!(s.push(b" U"), (" ".to_string(), false));
        assert_eq!(s.push(b"ser: hi"), (String::new(), true));
        assert_eq!(s.text, "Hello Usual ");
    }
}
