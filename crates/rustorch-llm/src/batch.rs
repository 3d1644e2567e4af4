//! A batch of tokens to evaluate, like llama.cpp's `llama_batch`: every token carries
//! its own position and sequence id, given by the caller. A position is never derived
//! from the length of a cache.

/// Identifies one sequence (one conversation, one server slot).
pub use rustorch_core::kv_cache::SeqId;

/// Tokens with explicit positions, sequence ids and whether logits are wanted.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Batch {
    pub tokens: Vec<u32>,
    pub positions: Vec<u32>,
    pub seq_ids: Vec<SeqId>,
    pub logits: Vec<bool>,
}

impl Batch {
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds one token at position `pos` of sequence `seq`.
    pub fn push(&mut self, token: u32, pos: u32, seq: SeqId, want_logits: bool) {
        self.tokens.push(token);
        self.positions.push(pos);
        self.seq_ids.push(seq);
        self.logits.push(want_logits);
    }

    /// A whole prompt for one sequence starting at `start_pos`; logits only for the
    /// last token unless `all_logits`.
    pub fn from_prompt(tokens: &[u32], start_pos: u32, seq: SeqId, all_logits: bool) -> Self {
        let mut b = Batch::new();
        let n = tokens.len();
        for (i, &t) in tokens.iter().enumerate() {
            b.push(t, start_pos + i as u32, seq, all_logits || i + 1 == n);
        }
        b
    }

    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    pub fn clear(&mut self) {
        self.tokens.clear();
        self.positions.clear();
        self.seq_ids.clear();
        self.logits.clear();
    }

    /// Number of tokens that want logits.
    pub fn n_outputs(&self) -> usize {
        self.logits.iter().filter(|&&l| l).count()
    }
}
