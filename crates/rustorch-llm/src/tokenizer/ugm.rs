//! T5 Unigram (llama.cpp's `llm_tokenizer_ugm`): SentencePiece normalization through
//! the precompiled character map (an XOR-compressed double array of replacement
//! rules), then the Viterbi best segmentation by piece scores, with runs of unknown
//! characters folded into one `<unk>`.

use rustorch_core::gguf::{GgufFile, Value};

use super::hash::FxHashMap;
use super::unicode::{decode_one, utf8_len_from_lead};
use super::vocab::{attr, Vocab, KEY_CHARSMAP};
use super::TokenizerError;

const UNKNOWN_PENALTY: f32 = 10.0;
const REPLACEMENT_UTF8: &[u8] = "\u{FFFD}".as_bytes();

#[derive(Debug, Clone)]
pub(crate) struct Ugm {
    /// XCDA entries of the charsmap.
    xcda: Vec<u32>,
    /// NUL-terminated replacement strings of the charsmap.
    replacements: Vec<u8>,
    /// Normal, user-defined and unused tokens.
    pieces: FxHashMap<Box<[u8]>, u32>,
    max_piece_len: usize,
    user_defined: ByteTrie,
    unknown_score: f32,
}

/// A byte trie answering llama.cpp's `naive_trie::get_longest_prefix`, which returns
/// the depth of the deepest matching path whether or not a token ends there.
#[derive(Debug, Default, Clone)]
struct ByteTrie {
    children: Vec<FxHashMap<u8, u32>>,
}

impl ByteTrie {
    fn insert(&mut self, key: &[u8]) {
        if self.children.is_empty() {
            self.children.push(Default::default());
        }
        let mut node = 0usize;
        for &b in key {
            let next = match self.children[node].get(&b) {
                Some(&n) => n as usize,
                None => {
                    let n = self.children.len();
                    self.children.push(Default::default());
                    self.children[node].insert(b, n as u32);
                    n
                }
            };
            node = next;
        }
    }

    fn longest_path(&self, key: &[u8]) -> usize {
        let mut node = 0usize;
        let mut depth = 0;
        if self.children.is_empty() {
            return 0;
        }
        for &b in key {
            match self.children[node].get(&b) {
                Some(&n) => {
                    node = n as usize;
                    depth += 1;
                }
                None => break,
            }
        }
        depth
    }
}

impl Ugm {
    pub(crate) fn new(vocab: &Vocab, file: &GgufFile) -> Result<Self, TokenizerError> {
        let malformed = |reason: &str| TokenizerError::Malformed {
            key: KEY_CHARSMAP.to_string(),
            reason: reason.to_string(),
        };
        let (mut xcda, mut replacements) = (Vec::new(), Vec::new());
        if let Some(v) = file.get(KEY_CHARSMAP) {
            let items = v.as_array().ok_or_else(|| TokenizerError::WrongType {
                key: KEY_CHARSMAP.to_string(),
                expected: "ARRAY[UINT8]",
                found: v.type_name(),
            })?;
            let bytes: Vec<u8> = items
                .iter()
                .map(|x| match *x {
                    Value::U8(b) => Some(b),
                    Value::I8(b) => Some(b as u8),
                    _ => None,
                })
                .collect::<Option<_>>()
                .ok_or_else(|| TokenizerError::WrongType {
                    key: KEY_CHARSMAP.to_string(),
                    expected: "ARRAY[UINT8]",
                    found: v.type_name(),
                })?;
            if !bytes.is_empty() {
                if bytes.len() < 4 {
                    return Err(malformed("shorter than its 4-byte header"));
                }
                let blob = u32::from_le_bytes(bytes[..4].try_into().expect("4 bytes")) as usize;
                if blob + 4 >= bytes.len() {
                    return Err(malformed("double-array size beyond the data"));
                }
                xcda = bytes[4..4 + blob]
                    .chunks_exact(4)
                    .map(|c| u32::from_le_bytes(c.try_into().expect("4 bytes")))
                    .collect();
                replacements = bytes[4 + blob..].to_vec();
            }
        }

        let mut pieces: FxHashMap<Box<[u8]>, u32> = Default::default();
        let mut user_defined = ByteTrie::default();
        let mut max_piece_len = 0;
        let (mut min_score, mut _max_score) = (f32::MAX, f32::MIN);
        for (id, text) in vocab.texts.iter().enumerate() {
            let a = vocab.raw_attrs[id];
            if a & attr::NORMAL != 0 {
                min_score = min_score.min(vocab.scores[id]);
                _max_score = _max_score.max(vocab.scores[id]);
            }
            if a & (attr::NORMAL | attr::USER_DEFINED | attr::UNUSED) != 0 {
                pieces.insert(text.as_bytes().into(), id as u32);
                max_piece_len = max_piece_len.max(text.len());
            }
            if a & attr::USER_DEFINED != 0 {
                user_defined.insert(text.as_bytes());
            }
        }
        Ok(Self {
            xcda,
            replacements,
            pieces,
            max_piece_len,
            user_defined,
            unknown_score: min_score - UNKNOWN_PENALTY,
        })
    }

    pub(crate) fn tokenize(&self, vocab: &Vocab, text: &[u8], out: &mut Vec<u32>) {
        let norm = self.normalize(vocab, text);
        let n = norm.len();
        if n == 0 {
            return;
        }
        let unk = vocab.ids.unk;
        // (token, start of the token, best score of the text up to here)
        let mut best: Vec<(Option<u32>, usize, f64)> = vec![(unk, 0, -f64::MAX); n + 1];
        best[0] = (unk, 0, 0.0);
        let mut off = 0;
        while off < n {
            let units = utf8_len_from_lead(norm[off]).min(n - off);
            let base = best[off].2;
            let mut single_found = false;
            for len in 1..=self.max_piece_len.min(n - off) {
                let Some(&id) = self.pieces.get(&norm[off..off + len]) else {
                    continue;
                };
                if len == units {
                    single_found = true;
                }
                let user = vocab.attrs[id as usize] & attr::USER_DEFINED != 0;
                let score = base
                    + if user {
                        0.0
                    } else {
                        vocab.scores[id as usize] as f64
                    };
                if score > best[off + len].2 {
                    best[off + len] = (Some(id), off, score);
                }
            }
            if !single_found {
                let score = base + self.unknown_score as f64;
                if score > best[off + units].2 {
                    best[off + units] = (unk, off, score);
                }
            }
            off += units;
        }

        let start = out.len();
        let mut pos = n;
        let mut prev_unknown = false;
        loop {
            let (tok, from, _) = best[pos];
            let is_unknown = tok == unk;
            if !(prev_unknown && is_unknown) {
                out.extend(tok);
            }
            if from == 0 || from >= pos {
                break;
            }
            prev_unknown = is_unknown;
            pos = from;
        }
        out[start..].reverse();
    }

    fn normalize(&self, vocab: &Vocab, input: &[u8]) -> Vec<u8> {
        let mut out = Vec::with_capacity(input.len() * 3);
        let space: &[u8] = if vocab.escape_whitespaces {
            "\u{2581}".as_bytes()
        } else {
            b" "
        };
        let prepend = !vocab.treat_whitespace_as_suffix && vocab.add_space_prefix;
        let append = vocab.treat_whitespace_as_suffix && vocab.add_space_prefix;
        let merge = vocab.remove_extra_whitespaces;
        let mut space_prepended = false;
        let mut in_word = false;
        let mut off = 0;
        while off < input.len() {
            let (piece, consumed) = self.normalize_prefix(input, off);
            for &c in piece {
                if c != b' ' {
                    if !in_word {
                        in_word = true;
                        if (prepend && !space_prepended) || merge {
                            out.extend_from_slice(space);
                            space_prepended = true;
                        }
                    }
                    out.push(c);
                } else {
                    in_word = false;
                    if !merge {
                        out.extend_from_slice(space);
                    }
                }
            }
            off += consumed.max(1);
        }
        if append {
            out.extend_from_slice(space);
        }
        out
    }

    /// The normalized form of the longest rule matching at `input[off..]`, and how many
    /// input bytes it consumes.
    fn normalize_prefix<'a>(&'a self, input: &'a [u8], off: usize) -> (&'a [u8], usize) {
        let user = self.user_defined.longest_path(&input[off..]);
        if user > 0 {
            return (&input[off..off + user], user);
        }

        let (mut best_len, mut best_value) = (0usize, 0usize);
        if !self.xcda.is_empty() {
            let node = |i: usize| self.xcda.get(i).copied();
            let base = |p: u32| (p >> 10) << ((p & (1 << 9)) >> 6);
            if let Some(root) = node(0) {
                let mut index = base(root) as usize;
                for (k, &c) in input[off..].iter().enumerate() {
                    if c == 0 {
                        break;
                    }
                    index ^= c as usize;
                    // An index outside the array ends the match (llama.cpp throws).
                    let Some(p) = node(index) else { break };
                    if p & ((1 << 31) | 0xFF) != c as u32 {
                        break;
                    }
                    let leaf = (p >> 8) & 1 != 0;
                    index ^= base(p) as usize;
                    if leaf {
                        let Some(v) = node(index) else { break };
                        best_len = k + 1;
                        best_value = (v & ((1 << 31) - 1)) as usize;
                    }
                }
            }
        }
        if best_len > 0 {
            if let Some(rest) = self.replacements.get(best_value..) {
                if let Some(end) = rest.iter().position(|&b| b == 0) {
                    return (&rest[..end], best_len);
                }
            }
            // A dangling rule (llama.cpp throws): fall through to the input itself.
        }

        match decode_one(input, off) {
            Some((_, len)) => (&input[off..off + len], len),
            None => (REPLACEMENT_UTF8, 1),
        }
    }
}
