//! Rank-based BPE (llama.cpp's `llm_tokenizer_bpe_session`): words from the
//! pre-tokenizer are split into characters (of the GPT-2 byte encoding, or of the raw
//! UTF-8 for SentencePiece-style vocabularies such as Gemma 4), then the adjacent pair
//! with the lowest merge rank is merged, leftmost first, until no pair has a rank.
//!
//! Strings are interned: every vocabulary text and every string a merge mentions gets
//! an id (a vocabulary text's id is its token id), and merges become a table from id
//! pairs to `(rank, merged id)`. Words that repeat within one call are tokenized once.

use super::hash::FxHashMap;
use super::pretokenize;
use super::queue::Queue;
use super::unicode::{self, push_utf8, Decoded};
use super::vocab::{PreKind, Vocab};

const NONE: u32 = u32::MAX;

#[derive(Debug, Clone)]
pub(crate) struct Bpe {
    /// `(left << 32 | right)` -> `(rank, merged)`.
    merges: FxHashMap<u64, (u32, u32)>,
    /// Interned id of each byte's GPT-2 character (byte-level vocabularies).
    byte_syms: [u32; 256],
    /// Interned ids of strings that are not vocabulary texts (UTF-8 characters and merge
    /// parts), numbered from `n_vocab`.
    extra: FxHashMap<Box<[u8]>, u32>,
    /// Fallback for a leftover symbol's bytes: the token of that byte's one-character
    /// text (byte-level) or of `<0xXX>` (SentencePiece-style).
    byte_fallback: [Option<u32>; 256],
    n_vocab: u32,
}

#[derive(Clone, Copy)]
struct Sym {
    id: u32,
    /// Byte span within the word.
    start: u32,
    len: u32,
    prev: u32,
    next: u32,
}

/// Reusable buffers for one encode call, with the tokens of the words seen so far.
#[derive(Default)]
pub(crate) struct Scratch {
    syms: Vec<Sym>,
    queue: Queue,
    encoded: Vec<u8>,
    cache: FxHashMap<Box<[u8]>, (u32, u32)>,
    cached: Vec<u32>,
}

/// Words longer than this are not cached, nor are words past this many.
const CACHE_MAX_WORD: usize = 64;
const CACHE_MAX_ENTRIES: usize = 1 << 20;

impl Bpe {
    pub(crate) fn new(vocab: &Vocab, merges: &[&str]) -> Self {
        let n_vocab = vocab.n_tokens() as u32;
        let mut extra: FxHashMap<Box<[u8]>, u32> = Default::default();
        let intern = |s: &[u8], extra: &mut FxHashMap<Box<[u8]>, u32>| -> u32 {
            if let Some(id) = vocab.find(s) {
                return id;
            }
            let next = n_vocab + extra.len() as u32;
            *extra.entry(s.into()).or_insert(next)
        };

        let mut table: FxHashMap<u64, (u32, u32)> = Default::default();
        table.reserve(merges.len());
        let mut joined = Vec::new();
        for (rank, m) in merges.iter().enumerate() {
            let m = m.as_bytes();
            // llama.cpp splits at the first space after the first byte; a line without
            // one registers the pair ("", ""), which no symbol ever forms.
            let Some(pos) = m.iter().skip(1).position(|&b| b == b' ').map(|p| p + 1) else {
                continue;
            };
            let (left, right) = (&m[..pos], &m[pos + 1..]);
            if left.is_empty() || right.is_empty() {
                continue;
            }
            let l = intern(left, &mut extra);
            let r = intern(right, &mut extra);
            joined.clear();
            joined.extend_from_slice(left);
            joined.extend_from_slice(right);
            let merged = intern(&joined, &mut extra);
            table
                .entry((l as u64) << 32 | r as u64)
                .or_insert((rank as u32, merged));
        }

        let mut byte_syms = [NONE; 256];
        let mut byte_fallback = [None; 256];
        for b in 0..=255u8 {
            if vocab.byte_encode {
                let mut s = Vec::new();
                push_utf8(&mut s, unicode::byte_to_unicode()[b as usize]);
                byte_syms[b as usize] = vocab
                    .find(&s)
                    .or_else(|| extra.get(&s[..]).copied())
                    .unwrap_or(NONE);
                // llama.cpp looks each byte of the leftover text up as a one-byte
                // string; only ASCII can be a (valid UTF-8) token text.
                if b < 0x80 {
                    byte_fallback[b as usize] = vocab.find(&[b]);
                }
            } else {
                byte_fallback[b as usize] = vocab.find(format!("<0x{b:02X}>").as_bytes());
            }
        }

        Self {
            merges: table,
            byte_syms,
            extra,
            byte_fallback,
            n_vocab,
        }
    }

    /// Tokenizes one raw-text fragment (already whitespace-escaped if the vocabulary
    /// wants that).
    pub(crate) fn tokenize(
        &self,
        vocab: &Vocab,
        text: &Decoded,
        scratch: &mut Scratch,
        out: &mut Vec<u32>,
    ) {
        for (s, e) in pretokenize::split(&vocab.passes, text) {
            let word = text.bytes(s as usize, e as usize);
            if let Some(&(a, b)) = scratch.cache.get(word) {
                out.extend_from_slice(&scratch.cached[a as usize..b as usize]);
                continue;
            }
            let before = out.len();
            self.tokenize_word(vocab, word, scratch, out);
            if word.len() <= CACHE_MAX_WORD && scratch.cache.len() < CACHE_MAX_ENTRIES {
                let a = scratch.cached.len() as u32;
                scratch.cached.extend_from_slice(&out[before..]);
                scratch
                    .cache
                    .insert(word.into(), (a, scratch.cached.len() as u32));
            }
        }
    }

    fn tokenize_word(&self, vocab: &Vocab, word: &[u8], scratch: &mut Scratch, out: &mut Vec<u32>) {
        let byte_level = vocab.byte_encode;
        if byte_level {
            scratch.encoded.clear();
            for &b in word {
                push_utf8(&mut scratch.encoded, unicode::byte_to_unicode()[b as usize]);
            }
        }
        let whole = if byte_level {
            &scratch.encoded[..]
        } else {
            word
        };
        if vocab.ignore_merges {
            if let Some(id) = vocab.find(whole) {
                out.push(id);
                return;
            }
        }
        if vocab.pre_kind == PreKind::Gemma4 && word.iter().all(|&b| b == b'\n') {
            if let Some(id) = vocab.find(word) {
                out.push(id);
                return;
            }
        }

        // Initial symbols.
        let syms = &mut scratch.syms;
        syms.clear();
        let mut pos = 0usize;
        while pos < word.len() {
            let len = if byte_level {
                1
            } else {
                unicode::utf8_len_from_lead(word[pos]).min(word.len() - pos)
            };
            let id = if byte_level {
                self.byte_syms[word[pos] as usize]
            } else {
                let s = &word[pos..pos + len];
                vocab
                    .find(s)
                    .or_else(|| self.extra.get(s).copied())
                    .unwrap_or(NONE)
            };
            let i = syms.len() as u32;
            syms.push(Sym {
                id,
                start: pos as u32,
                len: len as u32,
                prev: i.wrapping_sub(1),
                next: i + 1,
            });
            pos += len;
        }
        if let Some(last) = syms.last_mut() {
            last.next = NONE;
        }

        // Merge lowest rank first, leftmost on ties.
        let queue = &mut scratch.queue;
        queue.reset(syms.len());
        let push = |queue: &mut Queue, syms: &[Sym], l: u32, r: u32| {
            if l == NONE || r == NONE {
                return;
            }
            let (a, b) = (syms[l as usize], syms[r as usize]);
            if a.id == NONE || b.id == NONE {
                return;
            }
            if let Some(&(rank, _)) = self.merges.get(&((a.id as u64) << 32 | b.id as u64)) {
                queue.push((rank as u64) << 32 | l as u64, a.len + b.len);
            }
        };
        for i in 1..syms.len() as u32 {
            push(queue, syms, i - 1, i);
        }
        while let Some((key, size)) = queue.pop() {
            let l = key as u32;
            let a = syms[l as usize];
            // Skip pairs whose symbols changed since they were queued.
            if a.len == 0 || a.next == NONE {
                continue;
            }
            let r = a.next;
            let b = syms[r as usize];
            if a.len + b.len != size {
                continue;
            }
            let Some(&(_, merged)) = self.merges.get(&((a.id as u64) << 32 | b.id as u64)) else {
                continue;
            };
            let left = &mut syms[l as usize];
            left.id = merged;
            left.len += b.len;
            left.next = b.next;
            syms[r as usize].len = 0;
            if b.next != NONE {
                syms[b.next as usize].prev = l;
            }
            push(queue, syms, a.prev, l);
            push(queue, syms, l, b.next);
        }

        // Emit.
        let mut i = if syms.is_empty() { NONE } else { 0 };
        while i != NONE {
            let s = syms[i as usize];
            if s.id < self.n_vocab {
                out.push(s.id);
            } else {
                let bytes = &word[s.start as usize..(s.start + s.len) as usize];
                if byte_level {
                    // Each byte's GPT-2 character, looked up byte by byte.
                    for &b in bytes {
                        let ch = unicode::byte_to_unicode()[b as usize];
                        if ch < 0x80 {
                            out.extend(self.byte_fallback[ch as usize]);
                        }
                    }
                } else {
                    out.extend(bytes.iter().filter_map(|&b| self.byte_fallback[b as usize]));
                }
            }
            i = s.next;
        }
    }
}
