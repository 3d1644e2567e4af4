//! Token sampling with llama.cpp's default sampler chain.
//!
//! The chain, in llama.cpp's order (`common/sampling.cpp`, `common_sampler_init`):
//!
//! 1. logit bias (the user's biases, plus `-inf` on every end-of-generation token when
//!    `ignore_eos` is set),
//! 2. repetition penalties over the last `penalty_last_n` accepted tokens,
//! 3. top-k, 4. typical-p, 5. top-p, 6. min-p, 7. temperature,
//! 8. a draw from the softmax of what is left.
//!
//! With a grammar ([`Sampler::set_grammar`]), the tokens it does not allow get `-inf`
//! before the chain runs (llama.cpp applies its grammar sampler first too), so every
//! stage and the draw see only allowed tokens.
//!
//! Each stage is a public function on a [`Candidates`] list so that it can be tested on
//! its own; [`Sampler`] strings them together and keeps the state (penalty history and
//! random number generator).
//!
//! The random number generator is a Mersenne Twister (`std::mt19937`) and uniform numbers
//! are made the way libstdc++'s `generate_canonical<double, 53>` makes them, so that a
//! seed that fits in 32 bits gives the same draws as llama.cpp given the same logits.
//! Sampling is single-threaded: the same seed gives the same tokens whatever the number
//! of threads used elsewhere.

use std::cmp::Ordering;
use std::collections::{HashMap, VecDeque};

use crate::grammar::Constraint;

/// Errors reported by [`SamplerParams::validate`].
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SamplerError {
    #[error("repeat penalty must be finite and greater than 0, got {0}")]
    BadRepeatPenalty(f32),
    #[error("{name} must be a finite number, got {value}")]
    NotFinite { name: &'static str, value: f32 },
    #[error("{name} must not be NaN")]
    NaN { name: &'static str },
    #[error("logit bias for token {token} is NaN")]
    NaNBias { token: u32 },
}

/// Sampling settings. `Default` gives llama.cpp's defaults.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplerParams {
    /// Seed of the random number generator; `None` picks a random one (see
    /// [`Sampler::seed`]). Seeds up to `u32::MAX` give llama.cpp's random stream.
    pub seed: Option<u64>,
    /// How many of the last accepted tokens the penalties look at (0 disables them).
    pub penalty_last_n: usize,
    /// Repetition penalty: a penalized positive logit is divided by it, a negative one
    /// multiplied (1.0 = off).
    pub repeat_penalty: f32,
    /// Subtracted `count` times from a penalized logit (0.0 = off).
    pub frequency_penalty: f32,
    /// Subtracted once from the logit of every token seen in the window (0.0 = off).
    pub presence_penalty: f32,
    /// Added to the logit of the token (`-inf` bans it).
    pub logit_bias: HashMap<u32, f32>,
    /// Ban every token of `eog_tokens` (their logits become `-inf`).
    pub ignore_eos: bool,
    /// The end-of-generation tokens (EOS, EOT, ...) that `ignore_eos` bans.
    pub eog_tokens: Vec<u32>,
    /// Keep the `top_k` most likely tokens (`<= 0` keeps all).
    pub top_k: i32,
    /// Locally typical sampling (1.0 = off).
    pub typical_p: f32,
    /// Nucleus sampling (1.0 = off).
    pub top_p: f32,
    /// Drop tokens whose probability is below `min_p` times the largest (0.0 = off).
    pub min_p: f32,
    /// Temperature; `<= 0` samples greedily (the largest logit after bias and
    /// penalties).
    pub temperature: f32,
    /// Fewest tokens that typical-p, top-p and min-p keep (0 = no minimum).
    pub min_keep: usize,
}

impl Default for SamplerParams {
    fn default() -> Self {
        SamplerParams {
            seed: None,
            penalty_last_n: 64,
            repeat_penalty: 1.0,
            frequency_penalty: 0.0,
            presence_penalty: 0.0,
            logit_bias: HashMap::new(),
            ignore_eos: false,
            eog_tokens: Vec::new(),
            top_k: 40,
            typical_p: 1.0,
            top_p: 0.95,
            min_p: 0.05,
            temperature: 0.8,
            min_keep: 0,
        }
    }
}

impl SamplerParams {
    /// Greedy decoding: temperature 0, everything else at its default.
    pub fn greedy() -> Self {
        SamplerParams {
            temperature: 0.0,
            ..Self::default()
        }
    }

    /// Checks the values the way llama.cpp does before building its chain.
    /// [`Sampler::new`] does not fail: it treats values rejected here as "off".
    pub fn validate(&self) -> Result<(), SamplerError> {
        let r = self.repeat_penalty;
        if !r.is_finite() || r <= 0.0 || !(1.0 / r).is_finite() {
            return Err(SamplerError::BadRepeatPenalty(r));
        }
        for (name, value) in [
            ("frequency penalty", self.frequency_penalty),
            ("presence penalty", self.presence_penalty),
        ] {
            if !value.is_finite() {
                return Err(SamplerError::NotFinite { name, value });
            }
        }
        for (name, value) in [
            ("temperature", self.temperature),
            ("top-p", self.top_p),
            ("min-p", self.min_p),
            ("typical-p", self.typical_p),
        ] {
            if value.is_nan() {
                return Err(SamplerError::NaN { name });
            }
        }
        let mut biased: Vec<_> = self.logit_bias.iter().collect();
        biased.sort_by_key(|(t, _)| **t);
        if let Some((&token, _)) = biased.iter().find(|(_, b)| b.is_nan()) {
            return Err(SamplerError::NaNBias { token });
        }
        Ok(())
    }
}

/// One candidate token: its id, its (modified) logit and, once a stage has computed it,
/// its probability.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TokenData {
    pub id: u32,
    pub logit: f32,
    pub p: f32,
}

/// The candidate list the stages work on (llama.cpp's `llama_token_data_array`).
/// `sorted` says that `data` is in descending order of logit.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Candidates {
    pub data: Vec<TokenData>,
    pub sorted: bool,
}

impl Candidates {
    /// Every token of the vocabulary, in id order, unsorted, probabilities 0.
    pub fn from_logits(logits: &[f32]) -> Self {
        let mut c = Candidates::default();
        c.fill(logits);
        c
    }

    /// Refills the list from `logits`, reusing its allocation.
    pub fn fill(&mut self, logits: &[f32]) {
        self.data.clear();
        self.data
            .extend(logits.iter().enumerate().map(|(i, &logit)| TokenData {
                id: i as u32,
                logit,
                p: 0.0,
            }));
        self.sorted = false;
    }

    pub fn len(&self) -> usize {
        self.data.len()
    }

    pub fn is_empty(&self) -> bool {
        self.data.is_empty()
    }

    /// The ids, in list order.
    pub fn ids(&self) -> Vec<u32> {
        self.data.iter().map(|t| t.id).collect()
    }

    /// `(id, p)` pairs, in list order.
    pub fn probs(&self) -> Vec<(u32, f32)> {
        self.data.iter().map(|t| (t.id, t.p)).collect()
    }
}

/// Descending logit; ties go to the smaller id so that results never depend on the
/// sort algorithm.
fn by_logit_desc(a: &TokenData, b: &TokenData) -> Ordering {
    b.logit.total_cmp(&a.logit).then(a.id.cmp(&b.id))
}

/// Puts the `k` largest first, in order; the rest follow in no particular order.
fn partial_sort(data: &mut [TokenData], k: usize) {
    if k == 0 || data.is_empty() {
        return;
    }
    if k < data.len() {
        data.select_nth_unstable_by(k - 1, by_logit_desc);
        data[..k].sort_unstable_by(by_logit_desc);
    } else {
        data.sort_unstable_by(by_logit_desc);
    }
}

/// Computes `p` as the softmax of the logits (in f32, as llama.cpp does); sorts first
/// when `sort` is set.
pub fn softmax(c: &mut Candidates, sort: bool) {
    if c.data.is_empty() {
        return;
    }
    if sort && !c.sorted {
        c.data.sort_unstable_by(by_logit_desc);
        c.sorted = true;
    }
    let max_l = if c.sorted {
        c.data[0].logit
    } else {
        c.data
            .iter()
            .map(|t| t.logit)
            .fold(f32::NEG_INFINITY, f32::max)
    };
    let mut sum = 0.0f32;
    for t in &mut c.data {
        t.p = (t.logit - max_l).exp();
        sum += t.p;
    }
    for t in &mut c.data {
        t.p /= sum;
    }
}

/// Adds each bias to its token's logit. A token may appear more than once (the biases
/// add up); ids that are not in the list are ignored.
pub fn apply_logit_bias(c: &mut Candidates, bias: &[(u32, f32)]) {
    if bias.is_empty() {
        return;
    }
    for &(token, b) in bias {
        let i = token as usize;
        if i < c.data.len() && c.data[i].id == token {
            c.data[i].logit += b;
        } else if let Some(t) = c.data.iter_mut().find(|t| t.id == token) {
            t.logit += b;
        }
    }
    c.sorted = false;
}

/// llama.cpp's repetition penalties. `counts` maps each token of the penalty window to
/// how often it occurs there. For a token seen `count > 0` times:
/// `logit = logit > 0 ? logit / repeat : logit * repeat`, then
/// `logit -= count * frequency + presence`.
pub fn apply_penalties(
    c: &mut Candidates,
    counts: &HashMap<u32, u32>,
    repeat: f32,
    frequency: f32,
    presence: f32,
) {
    let mut tokens: Vec<(u32, u32)> = counts
        .iter()
        .filter(|(_, &n)| n > 0)
        .map(|(&t, &n)| (t, n))
        .collect();
    tokens.sort_unstable();
    for (token, count) in tokens {
        let i = token as usize;
        let t = if i < c.data.len() && c.data[i].id == token {
            Some(&mut c.data[i])
        } else {
            c.data.iter_mut().find(|t| t.id == token)
        };
        if let Some(t) = t {
            if t.logit <= 0.0 {
                t.logit *= repeat;
            } else {
                t.logit /= repeat;
            }
            t.logit -= count as f32 * frequency + presence;
        }
    }
    c.sorted = false;
}

/// Keeps the `k` largest logits, sorted (`k <= 0` does nothing).
pub fn top_k(c: &mut Candidates, k: i32) {
    if k <= 0 || c.data.is_empty() {
        return;
    }
    let k = (k as usize).min(c.data.len());
    if !c.sorted {
        partial_sort(&mut c.data, k);
        c.sorted = true;
    }
    c.data.truncate(k);
}

/// Locally typical sampling (Meister et al.): keeps the tokens whose surprise is closest
/// to the entropy until their probabilities add up to more than `p`. Leaves the list
/// ordered by that closeness, not by logit.
pub fn typical(c: &mut Candidates, p: f32, min_keep: usize) {
    if p >= 1.0 || c.data.is_empty() {
        return;
    }
    softmax(c, true);
    let entropy: f32 = c
        .data
        .iter()
        .filter(|t| t.p > 0.0)
        .map(|t| -t.p * t.p.ln())
        .sum();
    let shifted: Vec<f32> = c.data.iter().map(|t| (-t.p.ln() - entropy).abs()).collect();
    let mut order: Vec<usize> = (0..c.data.len()).collect();
    order.sort_by(|&a, &b| shifted[a].total_cmp(&shifted[b]).then(a.cmp(&b)));

    let mut cum = 0.0f32;
    let mut last = order.len();
    for (i, &idx) in order.iter().enumerate() {
        cum += c.data[idx].p;
        if cum > p && (min_keep == 0 || i + 1 >= min_keep) {
            last = i + 1;
            break;
        }
    }
    let kept: Vec<TokenData> = order[..last].iter().map(|&i| c.data[i]).collect();
    c.data = kept;
    c.sorted = false;
}

/// Nucleus sampling: keeps the most likely tokens until their probabilities add up to
/// at least `p` (and at least `min_keep` tokens). Leaves the list sorted.
pub fn top_p(c: &mut Candidates, p: f32, min_keep: usize) {
    if p >= 1.0 || c.data.is_empty() {
        return;
    }
    softmax(c, false);
    let n = c.data.len();
    // Like llama.cpp: a large unsorted list is sorted only as far as needed.
    let mut k = n;
    if !c.sorted {
        if n > 1024 {
            k = 256.min(n);
        }
        partial_sort(&mut c.data, k);
    }
    let mut cum = 0.0f32;
    let mut last = n;
    for i in 0..n {
        cum += c.data[i].p;
        if cum >= p && i + 1 >= min_keep {
            last = i + 1;
            break;
        }
        if i + 1 == k && k < n {
            k = n;
            partial_sort(&mut c.data, n);
        }
    }
    c.data.truncate(last);
    c.sorted = true;
}

/// Keeps the tokens whose probability is at least `p` times the largest one, i.e.
/// whose logit is at least `max + ln(p)`.
pub fn min_p(c: &mut Candidates, p: f32, min_keep: usize) {
    if p <= 0.0 || c.data.is_empty() {
        return;
    }
    if !c.sorted {
        let max_l = c
            .data
            .iter()
            .map(|t| t.logit)
            .fold(f32::NEG_INFINITY, f32::max);
        let min_l = max_l + p.ln();
        let kept: Vec<TokenData> = c
            .data
            .iter()
            .copied()
            .filter(|t| t.logit >= min_l)
            .collect();
        if !kept.is_empty() && kept.len() >= min_keep {
            c.data = kept;
            return;
        }
        c.data.sort_unstable_by(by_logit_desc);
        c.sorted = true;
    }
    let min_l = c.data[0].logit + p.ln();
    let mut i = 1;
    while i < c.data.len() {
        if c.data[i].logit < min_l && i >= min_keep {
            break;
        }
        i += 1;
    }
    c.data.truncate(i);
}

/// Divides the logits by `t`. With `t <= 0` only the first largest logit is kept finite
/// and every other becomes `-inf` (greedy).
pub fn temperature(c: &mut Candidates, t: f32) {
    if c.data.is_empty() {
        return;
    }
    if t <= 0.0 {
        let mut max_i = 0;
        for i in 1..c.data.len() {
            if c.data[i].logit > c.data[max_i].logit {
                c.data[max_i].logit = f32::NEG_INFINITY;
                max_i = i;
            } else {
                c.data[i].logit = f32::NEG_INFINITY;
            }
        }
        return;
    }
    for d in &mut c.data {
        d.logit /= t;
    }
}

/// The final probabilities the draw uses: `exp(logit - max)` normalized by their sum
/// (summed in f64 as llama.cpp's `dist` sampler does). Returns the sum.
fn final_probs(c: &mut Candidates) -> f64 {
    let max_l = if c.sorted {
        c.data.first().map_or(0.0, |t| t.logit)
    } else {
        c.data
            .iter()
            .map(|t| t.logit)
            .fold(f32::NEG_INFINITY, f32::max)
    };
    let mut sum = 0.0f64;
    for t in &mut c.data {
        t.p = (t.logit - max_l).exp();
        sum += t.p as f64;
    }
    sum
}

/// Draws one candidate with probability proportional to `exp(logit)` and returns its
/// index in the list (`None` for an empty list). Leaves the normalized probabilities in
/// `p`. Uses one uniform number per call.
pub fn dist(c: &mut Candidates, rng: &mut Mt19937) -> Option<usize> {
    if c.data.is_empty() {
        return None;
    }
    let r = rng.next_f64();
    if c.data.len() == 1 {
        c.data[0].p = 1.0;
        return Some(0);
    }
    let sum = final_probs(c);
    let target = sum * r;
    let mut run = 0.0f64;
    let mut selected = None;
    for (i, t) in c.data.iter_mut().enumerate() {
        if selected.is_none() {
            run += t.p as f64;
            if run >= target {
                selected = Some(i);
            }
        }
        t.p = (t.p as f64 / sum) as f32;
    }
    Some(selected.unwrap_or(c.data.len() - 1))
}

/// Index of the largest logit (the first one on ties); 0 for an empty slice.
pub fn argmax(logits: &[f32]) -> u32 {
    // the first index holding the largest value, found in two passes that vectorize: the
    // largest value (NaN is never larger than anything), then where it first occurs
    match logits.first() {
        Some(x) if !x.is_nan() => {}
        _ => return 0,
    }
    let mut lanes = [f32::NEG_INFINITY; 16];
    let chunks = logits.chunks_exact(16);
    let rest = chunks.remainder();
    for c in chunks {
        for (m, &x) in lanes.iter_mut().zip(c) {
            *m = if x > *m { x } else { *m };
        }
    }
    let mut max = f32::NEG_INFINITY;
    for &x in lanes.iter().chain(rest) {
        if x > max {
            max = x;
        }
    }
    logits.iter().position(|&x| x == max).unwrap_or(0) as u32
}

/// The greedy choice with logit biases and no penalties, without copying the logits:
/// the first token with the largest `logit + bias`. `None` when the largest unbiased logit
/// belongs to a biased token (the caller then runs the stages in full).
fn biased_argmax(logits: &[f32], bias: &[(u32, f32)]) -> Option<u32> {
    if logits.is_empty() {
        return None;
    }
    let m = argmax(logits);
    if logits[m as usize].is_nan() || bias.iter().any(|&(t, _)| t == m) {
        return None;
    }
    // every token before `m` is smaller and none after it larger, so only a biased token
    // can win instead (on a tie, the earlier one)
    let (mut best, mut value) = (m, logits[m as usize]);
    for &(t, b) in bias {
        let Some(&l) = logits.get(t as usize) else {
            continue;
        };
        let v = l + b;
        if v > value || (v == value && t < best) {
            (best, value) = (t, v);
        }
    }
    Some(best)
}

/// One token and its log-probability.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct TokenLogprob {
    pub token: u32,
    pub logprob: f32,
}

/// OpenAI-style log-probabilities: those of the chosen token and of the `n` most likely
/// tokens, from the softmax of the raw logits (before any sampling stage).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Logprobs {
    pub chosen: TokenLogprob,
    /// Most likely first; ties go to the smaller id.
    pub top: Vec<TokenLogprob>,
}

/// Log-softmax of `logits` (computed in f64) for `chosen` and the `n_top` most likely
/// tokens. A `chosen` outside the vocabulary gets `-inf`.
pub fn logprobs(logits: &[f32], chosen: u32, n_top: usize) -> Logprobs {
    let max_l = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let sum: f64 = logits.iter().map(|&l| (l as f64 - max_l).exp()).sum();
    let lse = max_l + sum.ln();
    let lp = |l: f32| (l as f64 - lse) as f32;
    let chosen = TokenLogprob {
        token: chosen,
        logprob: logits
            .get(chosen as usize)
            .map_or(f32::NEG_INFINITY, |&l| lp(l)),
    };
    let mut c = Candidates::from_logits(logits);
    let n = n_top.min(c.data.len());
    partial_sort(&mut c.data, n);
    let top = c.data[..n]
        .iter()
        .map(|t| TokenLogprob {
            token: t.id,
            logprob: lp(t.logit),
        })
        .collect();
    Logprobs { chosen, top }
}

/// The 32-bit Mersenne Twister, `std::mt19937`.
#[derive(Clone)]
pub struct Mt19937 {
    state: [u32; 624],
    index: usize,
}

impl std::fmt::Debug for Mt19937 {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mt19937")
            .field("index", &self.index)
            .finish_non_exhaustive()
    }
}

impl Mt19937 {
    const N: usize = 624;
    const M: usize = 397;

    pub fn new(seed: u32) -> Self {
        let mut state = [0u32; Self::N];
        state[0] = seed;
        for i in 1..Self::N {
            let prev = state[i - 1];
            state[i] = 1_812_433_253u32
                .wrapping_mul(prev ^ (prev >> 30))
                .wrapping_add(i as u32);
        }
        Mt19937 {
            state,
            index: Self::N,
        }
    }

    fn twist(&mut self) {
        for i in 0..Self::N {
            let y = (self.state[i] & 0x8000_0000) | (self.state[(i + 1) % Self::N] & 0x7fff_ffff);
            let mut v = self.state[(i + Self::M) % Self::N] ^ (y >> 1);
            if y & 1 != 0 {
                v ^= 0x9908_b0df;
            }
            self.state[i] = v;
        }
        self.index = 0;
    }

    pub fn next_u32(&mut self) -> u32 {
        if self.index >= Self::N {
            self.twist();
        }
        let mut y = self.state[self.index];
        self.index += 1;
        y ^= y >> 11;
        y ^= (y << 7) & 0x9d2c_5680;
        y ^= (y << 15) & 0xefc6_0000;
        y ^ (y >> 18)
    }

    /// A uniform number in `[0, 1)` made from two outputs, exactly as libstdc++'s
    /// `std::generate_canonical<double, 53>` (behind `std::uniform_real_distribution`).
    pub fn next_f64(&mut self) -> f64 {
        const R: f64 = 4_294_967_296.0;
        let mut sum = self.next_u32() as f64;
        sum += self.next_u32() as f64 * R;
        let r = sum / (R * R);
        if r >= 1.0 {
            1.0 - f64::EPSILON / 2.0
        } else {
            r
        }
    }
}

/// The 32-bit generator seed for a user seed: the seed itself when it fits (as in
/// llama.cpp), else both halves folded together.
fn rng_seed(seed: u64) -> u32 {
    match u32::try_from(seed) {
        Ok(s) => s,
        Err(_) => (seed ^ (seed >> 32)) as u32,
    }
}

fn pick_seed(seed: Option<u64>) -> u64 {
    seed.unwrap_or_else(|| u64::from(rand::random::<u32>()))
}

/// llama.cpp's default sampler chain with its state: the penalty window and the random
/// number generator. Single-threaded and deterministic for a given seed.
#[derive(Debug, Clone)]
pub struct Sampler {
    params: SamplerParams,
    n_vocab: usize,
    /// User biases then, with `ignore_eos`, `-inf` for each EOG token.
    bias: Vec<(u32, f32)>,
    seed: u64,
    rng: Mt19937,
    window: VecDeque<u32>,
    counts: HashMap<u32, u32>,
    scratch: Candidates,
    /// The grammar that restricts the tokens, if any.
    grammar: Option<Constraint>,
    /// Logits with the grammar's mask applied.
    masked: Vec<f32>,
}

impl Sampler {
    /// Builds the chain. Never fails: values that [`SamplerParams::validate`] rejects
    /// are treated as "off" (a bad repeat penalty as 1.0, non-finite frequency/presence
    /// penalties as 0, NaN top-p/min-p/typical-p as off, a NaN temperature as 1.0, NaN
    /// biases dropped). Biases for ids `>= n_vocab` are ignored.
    pub fn new(params: SamplerParams, n_vocab: usize) -> Self {
        let mut params = params;
        let r = params.repeat_penalty;
        if !r.is_finite() || r <= 0.0 || !(1.0 / r).is_finite() {
            params.repeat_penalty = 1.0;
        }
        if !params.frequency_penalty.is_finite() {
            params.frequency_penalty = 0.0;
        }
        if !params.presence_penalty.is_finite() {
            params.presence_penalty = 0.0;
        }
        if params.temperature.is_nan() {
            params.temperature = 1.0;
        }
        if params.top_p.is_nan() {
            params.top_p = 1.0;
        }
        if params.typical_p.is_nan() {
            params.typical_p = 1.0;
        }
        if params.min_p.is_nan() {
            params.min_p = 0.0;
        }
        let mut bias: Vec<(u32, f32)> = params
            .logit_bias
            .iter()
            .filter(|(&t, b)| (t as usize) < n_vocab && !b.is_nan())
            .map(|(&t, &b)| (t, b))
            .collect();
        bias.sort_by_key(|&(t, _)| t);
        if params.ignore_eos {
            bias.extend(
                params
                    .eog_tokens
                    .iter()
                    .filter(|&&t| (t as usize) < n_vocab)
                    .map(|&t| (t, f32::NEG_INFINITY)),
            );
        }
        let seed = pick_seed(params.seed);
        Sampler {
            params,
            n_vocab,
            bias,
            seed,
            rng: Mt19937::new(rng_seed(seed)),
            window: VecDeque::new(),
            counts: HashMap::new(),
            scratch: Candidates::default(),
            grammar: None,
            masked: Vec::new(),
        }
    }

    /// Restricts the tokens to those `grammar` allows from now on (`None` lifts it).
    /// Generated tokens must then be recorded with
    /// [`accept_generated`](Self::accept_generated), which advances the grammar.
    pub fn set_grammar(&mut self, grammar: Option<Constraint>) {
        self.grammar = grammar;
    }

    pub fn grammar(&self) -> Option<&Constraint> {
        self.grammar.as_ref()
    }

    pub fn grammar_mut(&mut self) -> Option<&mut Constraint> {
        self.grammar.as_mut()
    }

    /// Whether a grammar restricts the next token (a lazy one only once triggered).
    pub fn grammar_active(&self) -> bool {
        self.grammar.as_ref().is_some_and(Constraint::is_active)
    }

    pub fn params(&self) -> &SamplerParams {
        &self.params
    }

    pub fn n_vocab(&self) -> usize {
        self.n_vocab
    }

    /// The seed in use: the one given, or the random one picked when none was.
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// Whether this sampler always takes the most likely token.
    pub fn is_greedy(&self) -> bool {
        self.params.temperature <= 0.0
    }

    fn penalties_active(&self) -> bool {
        let p = &self.params;
        p.penalty_last_n > 0
            && !(p.repeat_penalty == 1.0 && p.frequency_penalty == 0.0 && p.presence_penalty == 0.0)
    }

    /// How often each token occurs in the penalty window.
    pub fn penalty_counts(&self) -> &HashMap<u32, u32> {
        &self.counts
    }

    /// Runs every stage but the draw.
    fn run_chain(&self, logits: &[f32], c: &mut Candidates) {
        let p = &self.params;
        self.run_adjust(logits, c);
        top_k(c, p.top_k);
        typical(c, p.typical_p, p.min_keep);
        top_p(c, p.top_p, p.min_keep);
        min_p(c, p.min_p, p.min_keep);
        temperature(c, p.temperature);
    }

    /// The stages that change logits without removing candidates: bias, then penalties.
    fn run_adjust(&self, logits: &[f32], c: &mut Candidates) {
        let p = &self.params;
        c.fill(logits);
        apply_logit_bias(c, &self.bias);
        if self.penalties_active() {
            apply_penalties(
                c,
                &self.counts,
                p.repeat_penalty,
                p.frequency_penalty,
                p.presence_penalty,
            );
        }
    }

    /// Picks the next token from `logits` (one row of the model's output). Does not
    /// record it: call [`accept`](Self::accept) with the token that is kept. Returns 0
    /// for empty logits.
    ///
    /// With an active grammar only tokens it allows are picked; when it allows nothing
    /// but the end (or every token it allows is banned), an end-of-generation token.
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        let Some(g) = self.grammar.as_mut().filter(|g| g.is_active()) else {
            return self.sample_free(logits);
        };
        let mut buf = std::mem::take(&mut self.masked);
        buf.clear();
        buf.extend_from_slice(logits);
        let any = g.apply(&mut buf);
        let eos = g.eos();
        let token = if any {
            let t = self.sample_free(&buf);
            match buf.get(t as usize) {
                Some(l) if *l > f32::NEG_INFINITY => t,
                _ => eos,
            }
        } else {
            eos
        };
        self.masked = buf;
        token
    }

    /// [`sample`](Self::sample) without the grammar.
    fn sample_free(&mut self, logits: &[f32]) -> u32 {
        let mut c = std::mem::take(&mut self.scratch);
        let p = &self.params;
        let token = if p.temperature <= 0.0 && p.typical_p >= 1.0 {
            // Greedy: top-k, top-p and min-p all keep the most likely candidate and the
            // temperature stage keeps only it, so the chain's answer is the first largest
            // logit after bias and penalties. The draw is still taken, as `dist` would.
            let penalties = self.penalties_active();
            let token = if self.bias.is_empty() && !penalties {
                (!logits.is_empty()).then(|| argmax(logits))
            } else if let Some(t) = (!penalties)
                .then(|| biased_argmax(logits, &self.bias))
                .flatten()
            {
                Some(t)
            } else {
                self.run_adjust(logits, &mut c);
                let best =
                    c.data
                        .iter()
                        .enumerate()
                        .fold(None, |b: Option<usize>, (i, t)| match b {
                            Some(j) if c.data[j].logit >= t.logit => Some(j),
                            _ => Some(i),
                        });
                best.map(|i| c.data[i].id)
            };
            if token.is_some() {
                self.rng.next_f64();
            }
            token.unwrap_or(0)
        } else {
            self.run_chain(logits, &mut c);
            dist(&mut c, &mut self.rng).map_or(0, |i| c.data[i].id)
        };
        self.scratch = c;
        token
    }

    /// [`sample`](Self::sample), plus the log-probabilities of the chosen token and
    /// of the `n_top` most likely ones, from the raw logits.
    pub fn sample_with_logprobs(&mut self, logits: &[f32], n_top: usize) -> (u32, Logprobs) {
        let token = self.sample(logits);
        (token, logprobs(logits, token, n_top))
    }

    /// The distribution the next draw would use: `(token, probability)` for every
    /// candidate left after the chain with a non-zero probability, in chain order
    /// (descending probability unless typical-p reordered them). Changes no state.
    pub fn probs_after_chain(&self, logits: &[f32]) -> Vec<(u32, f32)> {
        let mut c = Candidates::default();
        self.run_chain(logits, &mut c);
        if c.data.is_empty() {
            return Vec::new();
        }
        let sum = final_probs(&mut c);
        c.data
            .iter()
            .map(|t| (t.id, (t.p as f64 / sum) as f32))
            .filter(|&(_, p)| p > 0.0)
            .collect()
    }

    /// Records a token of the context (prompt or generated) for the penalties.
    pub fn accept(&mut self, token: u32) {
        let n = self.params.penalty_last_n;
        if n == 0 {
            return;
        }
        if self.window.len() >= n {
            if let Some(old) = self.window.pop_front() {
                if let Some(count) = self.counts.get_mut(&old) {
                    *count -= 1;
                    if *count == 0 {
                        self.counts.remove(&old);
                    }
                }
            }
        }
        self.window.push_back(token);
        *self.counts.entry(token).or_insert(0) += 1;
    }

    /// Records a generated token: for the penalties, like [`accept`](Self::accept), and
    /// for the grammar, which advances past it (`piece`: the token's bytes, which a lazy
    /// grammar searches for its trigger).
    pub fn accept_generated(&mut self, token: u32, piece: &[u8]) {
        self.accept(token);
        if let Some(g) = self.grammar.as_mut() {
            g.accept(token, piece);
        }
    }

    /// Puts the grammar back to its start (a new reply in a conversation).
    pub fn restart_grammar(&mut self) {
        if let Some(g) = self.grammar.as_mut() {
            g.reset();
        }
    }

    /// Forgets the penalty window and restarts the generator: from the same seed when
    /// one was given, from a new random one (see [`seed`](Self::seed)) otherwise. The
    /// grammar starts over too.
    pub fn reset(&mut self) {
        self.restart_grammar();
        self.window.clear();
        self.counts.clear();
        self.seed = pick_seed(self.params.seed);
        self.rng = Mt19937::new(rng_seed(self.seed));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mt19937_matches_the_standard() {
        // C++11 [rand.predef]: the 10000th output of a default-constructed mt19937
        // (seed 5489) is 4123659995.
        let mut rng = Mt19937::new(5489);
        let mut last = 0;
        for _ in 0..10_000 {
            last = rng.next_u32();
        }
        assert_eq!(last, 4_123_659_995);
    }

    #[test]
    fn rng_seed_folds_large_seeds() {
        assert_eq!(rng_seed(42), 42);
        assert_eq!(rng_seed(u64::from(u32::MAX)), u32::MAX);
        assert_eq!(rng_seed(1 << 32), 1);
    }

    /// The two-pass argmax is the first index of the largest value, as a scan with `>`
    /// finds it, ties and NaN included.
    #[test]
    fn argmax_is_the_first_largest() {
        let scan = |l: &[f32]| {
            let mut best = 0usize;
            for (i, &x) in l.iter().enumerate() {
                if x > l[best] {
                    best = i;
                }
            }
            best as u32
        };
        let mut rng = Mt19937::new(11);
        for case in 0..300usize {
            let n = 1 + case % 70;
            let mut l: Vec<f32> = (0..n).map(|_| (rng.next_u32() % 9) as f32).collect();
            if case % 4 == 1 {
                l[rng.next_u32() as usize % n] = f32::NAN;
            }
            if case % 7 == 3 {
                l[0] = f32::NAN;
            }
            if case % 5 == 2 {
                l[rng.next_u32() as usize % n] = f32::NEG_INFINITY;
            }
            assert_eq!(argmax(&l), scan(&l), "{l:?}");
        }
        assert_eq!(argmax(&[]), 0);
    }

    /// The greedy shortcut picks what the whole chain plus the draw picks, bias and
    /// penalties included, and leaves the generator where the draw leaves it.
    #[test]
    fn greedy_shortcut_equals_the_chain() {
        let mut rng = Mt19937::new(7);
        for case in 0..200u32 {
            let n = 50 + (case as usize % 7) * 13;
            let logits: Vec<f32> = (0..n)
                .map(|_| (rng.next_f64() as f32 - 0.5) * 20.0)
                .collect();
            let mut params = SamplerParams {
                temperature: 0.0,
                seed: Some(case as u64),
                repeat_penalty: 1.3,
                frequency_penalty: 0.2,
                presence_penalty: 0.5,
                top_k: [0, 1, 5, 40][case as usize % 4],
                min_p: 0.05,
                top_p: 0.9,
                ..SamplerParams::default()
            };
            if case % 3 != 2 {
                // no penalties: the plain or the biased argmax path
                params.repeat_penalty = 1.0;
                params.frequency_penalty = 0.0;
                params.presence_penalty = 0.0;
            }
            if case % 3 != 0 {
                params
                    .logit_bias
                    .insert(rng.next_u32() % n as u32, [-100.0, 3.0][case as usize % 2]);
                // the most likely token banned, another lifted to tie it, or left alone
                let top = argmax(&logits);
                match case % 5 {
                    0 => {
                        params.logit_bias.insert(top, f32::NEG_INFINITY);
                    }
                    1 => {
                        let other = (top as usize + 1 + case as usize % 9) % n;
                        let lift = logits[top as usize] - logits[other];
                        params.logit_bias.insert(other as u32, lift);
                    }
                    _ => {}
                }
            }
            let mut fast = Sampler::new(params.clone(), n);
            let mut chain = Sampler::new(params, n);
            for t in 0..6 {
                let tok = rng.next_u32() % n as u32;
                fast.accept(tok);
                chain.accept(tok);
                let mut c = Candidates::default();
                chain.run_chain(&logits, &mut c);
                let want = dist(&mut c, &mut chain.rng).map_or(0, |i| c.data[i].id);
                assert_eq!(fast.sample(&logits), want, "case {case} step {t}");
                assert_eq!(fast.rng.next_u32(), chain.rng.next_u32());
            }
        }
    }
}
