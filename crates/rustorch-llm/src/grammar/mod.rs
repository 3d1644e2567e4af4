//! Constrained generation: grammars that restrict which tokens the sampler may pick.
//!
//! The token masks come from [llguidance](https://github.com/guidance-ai/llguidance)
//! (an Earley parser over regex lexemes with a token trie; see `docs/grammar.md` for why
//! it and not an engine of our own). In front of it:
//!
//! - [`gbnf`]: llama.cpp's GBNF format, parsed and checked here as llama.cpp does and
//!   translated into llguidance's Lark dialect, plus an independent recognizer;
//! - JSON Schema, which llguidance compiles itself (types, `enum`, `const`, properties,
//!   `required`, `additionalProperties`, arrays with `minItems`/`maxItems`, `anyOf`,
//!   `oneOf`, `allOf`, `$ref`/`$defs`, string `format`s, `pattern`, length and numeric
//!   bounds); a keyword it does not implement is an error, never ignored.
//!
//! A [`GrammarEngine`] is built once per vocabulary; [`GrammarEngine::compile`] turns a
//! [`GrammarSpec`] into a [`Constraint`], the per-sequence state the [`Sampler`]
//! consults every step (see [`Sampler::set_grammar`]).
//!
//! A constraint can be *lazy* ([`Constraint::lazy`]): it allows everything until one of
//! its trigger strings appears in the generated text, then constrains what follows from
//! the trigger on (the text already generated from the trigger is fed to it first). Tool
//! calls use this: free text until `<tool_call>`, then JSON that matches the tools.
//!
//! [`Sampler`]: crate::sampler::Sampler
//! [`Sampler::set_grammar`]: crate::sampler::Sampler::set_grammar

pub mod gbnf;

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{ApproximateTokEnv, SimpleVob, TokEnv, TokRxInfo, TokTrie};
use llguidance::{Matcher, ParserFactory};
use serde_json::Value;

use crate::tokenizer::Tokenizer;

pub use gbnf::{Gbnf, GbnfError, Match, Recognizer};

/// What constrains a generation.
#[derive(Debug, Clone, PartialEq)]
pub enum GrammarSpec {
    /// llama.cpp GBNF text.
    Gbnf(String),
    /// A JSON Schema (the output is one JSON value that validates against it).
    JsonSchema(Value),
    /// Any JSON object (OpenAI's `response_format: {"type": "json_object"}`).
    JsonObject,
    /// llguidance's Lark dialect, as is.
    Lark(String),
}

/// Why a grammar or schema cannot be used.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum GrammarError {
    #[error("invalid grammar: {0}")]
    Gbnf(GbnfError),
    #[error("invalid or unsupported JSON schema: {0}")]
    Schema(String),
    #[error("invalid grammar: {0}")]
    Compile(String),
}

/// The default separators of generated JSON: `", "` between items and `": "` after
/// keys, no other whitespace (what models write most; forcing it also keeps small models
/// from padding with endless whitespace, which llama.cpp's converter limits the same way).
const JSON_OPTIONS: &str =
    r#"{"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "}"#;

/// Compiled grammars kept per engine: a clone of a compiled matcher shares its lexer
/// caches, so a schema used again starts with the token-trie walks it has already done.
const CACHE_SIZE: usize = 64;

/// Per-vocabulary grammar compiler: llguidance's token trie and parser factory, and the
/// grammars compiled so far (up to [`CACHE_SIZE`], oldest dropped first).
#[derive(Clone)]
pub struct GrammarEngine {
    factory: Arc<ParserFactory>,
    cache: Arc<Mutex<VecDeque<(String, Matcher)>>>,
    eog: Arc<[u32]>,
    eos: u32,
    n_vocab: usize,
    /// For resolving `<token>` items of GBNF grammars.
    tokenizer: Arc<Tokenizer>,
}

impl std::fmt::Debug for GrammarEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrammarEngine")
            .field("n_vocab", &self.n_vocab)
            .field("eos", &self.eos)
            .finish_non_exhaustive()
    }
}

impl GrammarEngine {
    /// Builds the token trie of `tokenizer`'s vocabulary (a few hundred milliseconds for
    /// 152k tokens). Control tokens and tokens without text are special: only a grammar
    /// that names them (`<[id]>`) allows them.
    pub fn new(tokenizer: Arc<Tokenizer>) -> Self {
        let n = tokenizer.n_vocab();
        let words: Vec<Vec<u8>> = (0..n as u32)
            .map(|id| {
                let piece = tokenizer.token_to_piece(id, false);
                if tokenizer.is_control(id) || tokenizer.is_eog(id) || piece.is_empty() {
                    let mut w = vec![TokTrie::SPECIAL_TOKEN_MARKER];
                    let text = tokenizer.token_to_piece(id, true);
                    if text.is_empty() || text.contains(&TokTrie::SPECIAL_TOKEN_MARKER) {
                        w.extend_from_slice(format!("<[{id}]>").as_bytes());
                    } else {
                        w.extend_from_slice(&text);
                    }
                    w
                } else {
                    piece
                }
            })
            .collect();
        let eog: Vec<u32> = tokenizer.eog_ids().collect();
        let eos = tokenizer
            .eos()
            .or_else(|| eog.first().copied())
            .unwrap_or(0);
        let info = TokRxInfo::new(n as u32, eos);
        let trie = TokTrie::from(&info, &words);
        let env: TokEnv = Arc::new(ApproximateTokEnv::new(trie));
        let mut factory = ParserFactory::new_simple(&env).expect("llguidance parser factory");
        factory.quiet();
        GrammarEngine {
            factory: Arc::new(factory),
            cache: Arc::new(Mutex::new(VecDeque::new())),
            eog: eog.into(),
            eos,
            n_vocab: n,
            tokenizer,
        }
    }

    pub fn n_vocab(&self) -> usize {
        self.n_vocab
    }

    /// The token id of a `<token>` item: the text must encode to exactly one token.
    fn resolve_token(&self, text: &str) -> Option<u32> {
        match self.tokenizer.encode(text, false, true) {
            Ok(ids) if ids.len() == 1 => Some(ids[0]),
            _ => None,
        }
    }

    /// The Lark text llguidance receives for `spec` (GBNF is translated), or the JSON
    /// schema with this engine's whitespace options.
    fn top_level(&self, spec: &GrammarSpec) -> Result<TopLevelGrammar, GrammarError> {
        Ok(match spec {
            GrammarSpec::Gbnf(text) => {
                let g =
                    Gbnf::parse(text, &|t| self.resolve_token(t)).map_err(GrammarError::Gbnf)?;
                for alts in &g.rules {
                    for s in alts {
                        check_token_ids(s, self.n_vocab)?;
                    }
                }
                TopLevelGrammar::from_lark(g.to_lark())
            }
            GrammarSpec::Lark(text) => TopLevelGrammar::from_lark(text.clone()),
            GrammarSpec::JsonObject => {
                TopLevelGrammar::from_json_schema(json_with_options(&serde_json::json!({
                    "type": "object"
                }))?)
            }
            GrammarSpec::JsonSchema(schema) => {
                TopLevelGrammar::from_json_schema(json_with_options(schema)?)
            }
        })
    }

    /// Compiles `spec` into a fresh constraint (or reuses the compiled grammar of an
    /// equal spec). Errors name what is wrong.
    pub fn compile(&self, spec: &GrammarSpec) -> Result<Constraint, GrammarError> {
        let key = match spec {
            GrammarSpec::Gbnf(t) => format!("g{t}"),
            GrammarSpec::Lark(t) => format!("l{t}"),
            GrammarSpec::JsonSchema(v) => format!("j{v}"),
            GrammarSpec::JsonObject => "o".to_string(),
        };
        let cached = {
            let cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
            cache
                .iter()
                .find(|(k, _)| *k == key)
                .map(|(_, m)| m.clone())
        };
        let matcher = match cached {
            Some(m) => m,
            None => {
                let top = self.top_level(spec)?;
                let parser = self.factory.create_parser(top).map_err(|e| {
                    let msg = first_line(&e.to_string());
                    match spec {
                        GrammarSpec::JsonSchema(_) | GrammarSpec::JsonObject => {
                            GrammarError::Schema(msg)
                        }
                        _ => GrammarError::Compile(msg),
                    }
                })?;
                let m = Matcher::new(Ok(parser));
                let mut cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
                if cache.len() >= CACHE_SIZE {
                    cache.pop_front();
                }
                cache.push_back((key, m.clone()));
                m
            }
        };
        Ok(Constraint {
            initial: matcher.clone(),
            matcher,
            eog: self.eog.clone(),
            eos: self.eos,
            n_vocab: self.n_vocab,
            triggers: Vec::new(),
            active: true,
            text: Vec::new(),
            failed: None,
            mask: None,
        })
    }
}

fn first_line(s: &str) -> String {
    let s = s.trim();
    // llguidance appends its parser state after the message; keep the message
    let s = s.split("\n<state>").next().unwrap_or(s);
    s.lines().take(6).collect::<Vec<_>>().join(" ")
}

fn check_token_ids(s: &[gbnf::Node], n_vocab: usize) -> Result<(), GrammarError> {
    for n in s {
        match n {
            gbnf::Node::Token { id, .. } if *id as usize >= n_vocab => {
                return Err(GrammarError::Gbnf(GbnfError(format!(
                    "token <[{id}]> is beyond the vocabulary ({n_vocab} tokens)"
                ))))
            }
            gbnf::Node::Group(alts) => {
                for a in alts {
                    check_token_ids(a, n_vocab)?;
                }
            }
            gbnf::Node::Repeat { item, .. } => {
                check_token_ids(std::slice::from_ref(item), n_vocab)?
            }
            _ => {}
        }
    }
    Ok(())
}

/// Adds this engine's whitespace options to a schema (unless it sets its own
/// `x-guidance`), after checking that it is a schema at all. Tool grammars embed schemas
/// prepared this way in Lark (`%json`).
pub(crate) fn json_with_options(schema: &Value) -> Result<Value, GrammarError> {
    match schema {
        Value::Object(o) => {
            let mut o = o.clone();
            for v in o.values_mut() {
                bound_integers(v);
            }
            bound_integers_here(&mut o);
            if !o.contains_key("x-guidance") {
                let opts: Value = serde_json::from_str(JSON_OPTIONS).expect("valid options");
                o.insert("x-guidance".into(), opts);
            }
            Ok(Value::Object(o))
        }
        Value::Bool(true) => json_with_options(&serde_json::json!({})),
        Value::Bool(false) => Err(GrammarError::Schema(
            "the schema `false` matches nothing".into(),
        )),
        other => Err(GrammarError::Schema(format!(
            "a schema must be a JSON object, got {}",
            match other {
                Value::Null => "null",
                Value::Number(_) => "a number",
                Value::String(_) => "a string",
                Value::Array(_) => "an array",
                _ => "a boolean",
            }
        ))),
    }
}

/// Largest magnitude of an integer without bounds: 15 digits, as llama.cpp's
/// json-schema-to-grammar allows 16 (a small model otherwise writes digits until its
/// token limit).
const INTEGER_LIMIT: i64 = 999_999_999_999_999;

/// Gives every `"type": "integer"` schema inside `v` default bounds (see
/// [`INTEGER_LIMIT`]); values of `const`, `enum`, `default` and `examples` are data, not
/// schemas, and are left alone.
fn bound_integers(v: &mut Value) {
    match v {
        Value::Object(o) => {
            for (k, child) in o.iter_mut() {
                if !matches!(k.as_str(), "const" | "enum" | "default" | "examples") {
                    bound_integers(child);
                }
            }
            bound_integers_here(o);
        }
        Value::Array(a) => a.iter_mut().for_each(bound_integers),
        _ => {}
    }
}

fn bound_integers_here(o: &mut serde_json::Map<String, Value>) {
    let integer = match o.get("type") {
        Some(Value::String(t)) => t == "integer",
        Some(Value::Array(ts)) => ts.iter().any(|t| t == "integer"),
        _ => false,
    };
    if !integer {
        return;
    }
    if !o.contains_key("minimum") && !o.contains_key("exclusiveMinimum") {
        o.insert("minimum".into(), Value::from(-INTEGER_LIMIT));
    }
    if !o.contains_key("maximum") && !o.contains_key("exclusiveMaximum") {
        o.insert("maximum".into(), Value::from(INTEGER_LIMIT));
    }
}

/// What switches a lazy [`Constraint`] on.
#[derive(Clone)]
pub enum Trigger {
    /// This text appears in the output; the grammar matches from its start.
    Word(String),
    /// This token is generated (a control token, whose text the output leaves out, such
    /// as Mistral's `[TOOL_CALLS]`); the grammar matches from that token (`<[id]>` in
    /// Lark).
    Token(u32),
    /// A search: given the output so far, where the constrained part starts, if it has
    /// begun (for starts that a fixed string cannot describe, such as a JSON object
    /// whose whitespace varies).
    Find(TriggerFinder),
}

/// The search of a [`Trigger::Find`].
pub type TriggerFinder = Arc<dyn Fn(&[u8]) -> Option<usize> + Send + Sync>;

impl std::fmt::Debug for Trigger {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Trigger::Word(w) => f.debug_tuple("Word").field(w).finish(),
            Trigger::Token(t) => f.debug_tuple("Token").field(t).finish(),
            Trigger::Find(_) => f.write_str("Find(..)"),
        }
    }
}

/// The grammar state of one sequence.
#[derive(Clone)]
pub struct Constraint {
    matcher: Matcher,
    /// The state before the first token, for [`reset`](Self::reset).
    initial: Matcher,
    eog: Arc<[u32]>,
    eos: u32,
    n_vocab: usize,
    /// Lazy constraints: what switches them on.
    triggers: Vec<Trigger>,
    active: bool,
    /// Generated bytes while inactive (to find triggers in).
    text: Vec<u8>,
    /// Set when the grammar refused a token it had allowed (never expected); the
    /// constraint then allows only end of generation.
    failed: Option<String>,
    /// The mask of the current step, kept until the next token is accepted.
    mask: Option<SimpleVob>,
}

impl std::fmt::Debug for Constraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Constraint")
            .field("active", &self.active)
            .field("triggers", &self.triggers)
            .field("failed", &self.failed)
            .finish_non_exhaustive()
    }
}

impl Constraint {
    /// Makes the constraint lazy: it allows anything until one of `triggers` appears in
    /// the generated text, and from there on the grammar must match the text starting
    /// at the trigger.
    pub fn lazy(self, triggers: Vec<String>) -> Self {
        self.lazy_on(triggers.into_iter().map(Trigger::Word).collect())
    }

    /// [`lazy`](Self::lazy) with any kind of [`Trigger`]; the earliest one that appears
    /// switches the grammar on.
    pub fn lazy_on(mut self, triggers: Vec<Trigger>) -> Self {
        self.triggers = triggers
            .into_iter()
            .filter(|t| !matches!(t, Trigger::Word(w) if w.is_empty()))
            .collect();
        self.active = self.triggers.is_empty();
        self
    }

    /// Whether the grammar constrains the next token (a lazy one once triggered).
    pub fn is_active(&self) -> bool {
        self.active
    }

    /// Back to the state before the first generated token.
    pub fn reset(&mut self) {
        self.matcher = self.initial.clone();
        self.active = self.triggers.is_empty();
        self.text.clear();
        self.failed = None;
        self.mask = None;
    }

    /// Why the grammar stopped constraining, if it failed.
    pub fn error(&self) -> Option<&str> {
        self.failed.as_deref()
    }

    /// Whether the text so far is a complete sentence of the grammar.
    pub fn is_accepting(&mut self) -> bool {
        !self.active || self.matcher.is_accepting().unwrap_or(false)
    }

    /// Whether `token` may come next: computes the step's mask (once per step) when the
    /// grammar is active. End-of-generation tokens are allowed exactly when the grammar
    /// is complete.
    pub fn allows(&mut self, token: u32) -> bool {
        if !self.active {
            return true;
        }
        self.ensure_mask();
        let eog_ok = self.mask.as_ref().is_some_and(|m| m.is_allowed(self.eos));
        if self.eog.contains(&token) {
            return eog_ok;
        }
        self.mask.as_ref().is_some_and(|m| m.is_allowed(token))
    }

    fn ensure_mask(&mut self) {
        if self.mask.is_some() {
            return;
        }
        let mask = if self.failed.is_some() {
            Err("failed".to_string())
        } else {
            self.matcher
                .compute_mask_or_eos()
                .map_err(|e| first_line(&e.to_string()))
        };
        self.mask = Some(match mask {
            Ok(m) => m,
            Err(e) => {
                if self.failed.is_none() {
                    tracing::warn!(error = %e, "the grammar cannot continue; ending generation");
                    self.failed = Some(e);
                }
                let mut m = SimpleVob::alloc(self.n_vocab);
                m.allow_token(self.eos);
                m
            }
        });
    }

    /// Sets the logits of the tokens the grammar does not allow to `-inf`. Returns
    /// whether any token is left. Does nothing while a lazy constraint waits.
    pub fn apply(&mut self, logits: &mut [f32]) -> bool {
        if !self.active {
            return true;
        }
        self.ensure_mask();
        let Some(mask) = self.mask.as_ref() else {
            return true;
        };
        let eog_ok = mask.is_allowed(self.eos);
        // the mask allows only the trie's EOS; every end-of-generation token ends alike
        let saved: Vec<(usize, f32)> = self
            .eog
            .iter()
            .filter_map(|&t| logits.get(t as usize).map(|&l| (t as usize, l)))
            .collect();
        let n = logits.len().min(self.n_vocab);
        let words = mask.as_slice();
        let mut any = false;
        for (w, &bits) in words.iter().enumerate() {
            let base = w * 32;
            if base >= n {
                break;
            }
            let end = (base + 32).min(n);
            if bits == 0 {
                logits[base..end].fill(f32::NEG_INFINITY);
                continue;
            }
            if bits == u32::MAX {
                any = true;
                continue;
            }
            for (k, l) in logits[base..end].iter_mut().enumerate() {
                if bits >> k & 1 == 0 {
                    *l = f32::NEG_INFINITY;
                } else {
                    any = true;
                }
            }
        }
        for l in logits.iter_mut().skip(self.n_vocab) {
            *l = f32::NEG_INFINITY;
        }
        for (t, l) in saved {
            logits[t] = if eog_ok { l } else { f32::NEG_INFINITY };
        }
        any || eog_ok
    }

    /// The end-of-generation token to use when the grammar leaves nothing else.
    pub fn eos(&self) -> u32 {
        self.eos
    }

    /// Records a generated token: advances the grammar, or, while a lazy constraint
    /// waits, looks for a trigger in the text (`piece`: the token's bytes).
    pub fn accept(&mut self, token: u32, piece: &[u8]) {
        self.mask = None;
        if self.failed.is_some() {
            return;
        }
        if !self.active
            && self
                .triggers
                .iter()
                .any(|t| matches!(t, Trigger::Token(id) if *id == token))
        {
            self.active = true;
            self.text.clear();
            if let Err(e) = self.matcher.consume_token(token) {
                self.failed = Some(first_line(&e.to_string()));
            }
            return;
        }
        if !self.active {
            self.text.extend_from_slice(piece);
            let found = self
                .triggers
                .iter()
                .filter_map(|t| match t {
                    Trigger::Word(w) => find(&self.text, w.as_bytes()),
                    Trigger::Find(f) => f(&self.text),
                    Trigger::Token(_) => None,
                })
                .min();
            if let Some(at) = found {
                self.active = true;
                let rest = self.text.split_off(at);
                self.text.clear();
                // feed the text from the trigger on, in the trie's own tokens
                let env = self.matcher.tok_env();
                if let Ok(env) = env {
                    let toks = env.tok_trie().greedy_tokenize(&rest);
                    if let Err(e) = self.matcher.consume_tokens(&toks) {
                        self.failed = Some(first_line(&e.to_string()));
                    }
                }
            }
            return;
        }
        if self.eog.contains(&token) {
            return;
        }
        if let Err(e) = self.matcher.consume_token(token) {
            let msg = first_line(&e.to_string());
            tracing::warn!(token, error = %msg, "the grammar refused a sampled token");
            self.failed = Some(msg);
        }
    }

    /// Times one mask computation from the current state (for benchmarks); the mask is
    /// kept for the next [`apply`](Self::apply).
    pub fn compute_mask_now(&mut self) -> usize {
        self.mask = None;
        self.ensure_mask();
        self.mask.as_ref().map_or(0, |m| m.num_set())
    }

    /// The tokens the current mask allows (computing it if needed).
    pub fn allowed_tokens(&mut self) -> Vec<u32> {
        if !self.active {
            return (0..self.n_vocab as u32).collect();
        }
        self.ensure_mask();
        let mut out = self.mask.as_ref().map(|m| m.to_list()).unwrap_or_default();
        if out.contains(&self.eos) {
            for &t in self.eog.iter() {
                if !out.contains(&t) {
                    out.push(t);
                }
            }
        }
        out
    }
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    if needle.is_empty() || hay.len() < needle.len() {
        return None;
    }
    hay.windows(needle.len()).position(|w| w == needle)
}
