//! SentencePiece BPE by piece scores (llama.cpp's `llm_tokenizer_spm_session`): the
//! text is split into UTF-8 characters, then the adjacent pair whose concatenation is
//! the highest-scoring vocabulary piece is merged, leftmost first on ties, until no
//! pair forms a piece. Characters left outside the vocabulary become `<0xXX>` byte
//! tokens.
//!
//! A character that occurs in no piece of two or more characters can never merge, so
//! the merges on either side of it are independent: the text is cut there (at
//! newlines, for Llama's vocabulary) and each run merged on its own, which keeps the
//! queues small without changing the result.

use super::queue::Queue;
use super::unicode::utf8_len_from_lead;
use super::vocab::Vocab;

const NONE: u32 = u32::MAX;

#[derive(Debug, Clone)]
pub(crate) struct Spm {
    /// Token for each byte: `<0xXX>`, else the one-byte text, else `<unk>`.
    byte_tokens: [Option<u32>; 256],
    /// Each token's place among the distinct scores, highest first: the queue key.
    score_order: Vec<u32>,
    /// Bit per codepoint: set when the character occurs in a piece of two or more
    /// characters.
    merging: Vec<u64>,
}

#[derive(Clone, Copy)]
struct Sym {
    start: u32,
    len: u32,
    prev: u32,
    next: u32,
}

impl Spm {
    pub(crate) fn new(vocab: &Vocab) -> Self {
        let mut byte_tokens = [None; 256];
        for (b, slot) in byte_tokens.iter_mut().enumerate() {
            *slot = vocab
                .find(format!("<0x{b:02X}>").as_bytes())
                .or_else(|| vocab.find(&[b as u8]))
                .or(vocab.ids.unk);
        }
        let mut distinct: Vec<f32> = vocab.scores.clone();
        distinct.sort_by(|a, b| b.total_cmp(a));
        distinct.dedup();
        let score_order = vocab
            .scores
            .iter()
            .map(|s| distinct.partition_point(|d| d.total_cmp(s).is_gt()) as u32)
            .collect();
        let mut merging = vec![0u64; 0x11_0000usize.div_ceil(64)];
        for text in &vocab.texts {
            if text.chars().nth(1).is_some() {
                for c in text.chars() {
                    merging[c as usize / 64] |= 1 << (c as usize % 64);
                }
            }
        }
        Self {
            byte_tokens,
            score_order,
            merging,
        }
    }

    /// The token for one byte (llama.cpp's `byte_to_token`).
    pub(crate) fn byte_token(&self, b: u8) -> Option<u32> {
        self.byte_tokens[b as usize]
    }

    /// Whether a symbol (one character, or stray bytes) can never be merged.
    fn is_barrier(&self, sym: &[u8]) -> bool {
        let Ok(s) = std::str::from_utf8(sym) else {
            return false;
        };
        let mut chars = s.chars();
        match (chars.next(), chars.next()) {
            (Some(c), None) => self.merging[c as usize / 64] >> (c as usize % 64) & 1 == 0,
            _ => false,
        }
    }

    /// A final symbol: its token, or its bytes.
    fn emit(&self, vocab: &Vocab, piece: &[u8], out: &mut Vec<u32>) {
        match vocab.find(piece) {
            Some(id) => out.push(id),
            None => out.extend(piece.iter().filter_map(|&b| self.byte_token(b))),
        }
    }

    /// Tokenizes `text`, already whitespace-escaped.
    pub(crate) fn tokenize(&self, vocab: &Vocab, text: &[u8], out: &mut Vec<u32>) {
        let mut syms = Vec::new();
        let mut queue = Queue::default();
        let mut run_start = 0;
        let mut pos = 0;
        while pos < text.len() {
            let len = utf8_len_from_lead(text[pos]).min(text.len() - pos);
            if self.is_barrier(&text[pos..pos + len]) {
                if run_start < pos {
                    self.merge(vocab, &text[run_start..pos], &mut syms, &mut queue, out);
                }
                self.emit(vocab, &text[pos..pos + len], out);
                run_start = pos + len;
            }
            pos += len;
        }
        if run_start < text.len() {
            self.merge(vocab, &text[run_start..], &mut syms, &mut queue, out);
        }
    }

    fn merge(
        &self,
        vocab: &Vocab,
        text: &[u8],
        syms: &mut Vec<Sym>,
        queue: &mut Queue,
        out: &mut Vec<u32>,
    ) {
        syms.clear();
        let mut pos = 0usize;
        while pos < text.len() {
            let len = utf8_len_from_lead(text[pos]).min(text.len() - pos);
            let i = syms.len() as u32;
            syms.push(Sym {
                start: pos as u32,
                len: len as u32,
                prev: i.wrapping_sub(1),
                next: i + 1,
            });
            pos += len;
        }
        let Some(last) = syms.last_mut() else {
            return;
        };
        last.next = NONE;

        // Highest score first, leftmost on ties (scores are canonical: no NaN, no -0).
        let max_len = vocab.max_token_len;
        let push = |queue: &mut Queue, syms: &[Sym], l: u32, r: u32| {
            if l == NONE || r == NONE {
                return;
            }
            let (a, b) = (syms[l as usize], syms[r as usize]);
            let size = (a.len + b.len) as usize;
            if size > max_len {
                return;
            }
            if let Some(id) = vocab.find(&text[a.start as usize..a.start as usize + size]) {
                let order = self.score_order[id as usize] as u64;
                queue.push(order << 32 | l as u64, size as u32);
            }
        };

        queue.reset(syms.len());
        for i in 1..syms.len() as u32 {
            push(queue, syms, i - 1, i);
        }
        while let Some((key, size)) = queue.pop() {
            let l = key as u32;
            let a = syms[l as usize];
            if a.len == 0 || a.next == NONE {
                continue;
            }
            let r = a.next;
            let b = syms[r as usize];
            // Skip pairs whose symbols changed since they were queued.
            if a.len + b.len != size {
                continue;
            }
            syms[l as usize].len += b.len;
            syms[l as usize].next = b.next;
            syms[r as usize].len = 0;
            if b.next != NONE {
                syms[b.next as usize].prev = l;
            }
            push(queue, syms, a.prev, l);
            push(queue, syms, l, b.next);
        }

        let mut i = 0u32;
        while i != NONE {
            let s = syms[i as usize];
            self.emit(
                vocab,
                &text[s.start as usize..(s.start + s.len) as usize],
                out,
            );
            i = s.next;
        }
    }
}
