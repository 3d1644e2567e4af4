//! Token ids back to bytes: pieces, whole sequences with llama.cpp's leading-space and
//! space-cleaning rules, and a streaming decoder that never splits a character.

use super::unicode::{self, push_utf8};
use super::vocab::Vocab;
use super::Tokenizer;

const ESCAPED_SPACE: &[u8] = "\u{2581}".as_bytes();

/// `▁` back to a space.
pub(crate) fn unescape_whitespace(text: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(text.len());
    let mut i = 0;
    while i < text.len() {
        if text[i..].starts_with(ESCAPED_SPACE) {
            out.push(b' ');
            i += ESCAPED_SPACE.len();
        } else {
            out.push(text[i]);
            i += 1;
        }
    }
    out
}

/// A byte-level BPE token's text back to bytes (llama.cpp's `llama_decode_text`).
pub(crate) fn byte_decode(text: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(text.len());
    for cpt in unicode::codepoints(text) {
        match unicode::unicode_to_byte(cpt) {
            Some(b) => out.push(b),
            None => {
                out.extend_from_slice(b"[UNK_BYTE_0x");
                let mut utf8 = Vec::new();
                push_utf8(&mut utf8, cpt);
                for b in utf8 {
                    out.extend_from_slice(format!("{b:02x}").as_bytes());
                }
                out.extend_from_slice(text);
                out.push(b']');
            }
        }
    }
    out
}

impl Vocab {
    /// llama.cpp's `token_to_piece`: empty for out-of-range ids, and for control and
    /// unknown tokens unless `special`.
    pub(crate) fn piece(&self, id: u32, special: bool) -> &[u8] {
        use super::vocab::attr;
        let Some(&a) = self.attrs.get(id as usize) else {
            return &[];
        };
        if !special && a & (attr::UNKNOWN | attr::CONTROL) != 0 {
            return &[];
        }
        &self.pieces[id as usize]
    }

    /// llama.cpp's `llama_detokenize`.
    pub(crate) fn detokenize(
        &self,
        ids: &[u32],
        remove_special: bool,
        unparse_special: bool,
    ) -> Vec<u8> {
        let mut ids = ids;
        let mut remove_space = self.add_space_prefix;
        if remove_special && self.add_bos && ids.first().is_some_and(|&t| Some(t) == self.ids.bos) {
            remove_space = false;
            ids = &ids[1..];
        }
        if remove_special && self.add_eos && ids.last().is_some_and(|&t| Some(t) == self.ids.eos) {
            ids = &ids[..ids.len() - 1];
        }
        let mut out = Vec::new();
        for &id in ids {
            let mut piece = self.piece(id, unparse_special);
            if remove_space {
                if let Some(rest) = piece.strip_prefix(b" ") {
                    piece = rest;
                }
            }
            remove_space = false;
            out.extend_from_slice(piece);
        }
        if self.clean_spaces {
            clean_up_spaces(&mut out);
        }
        out
    }
}

/// llama.cpp's three in-place "clean up tokenization spaces" passes, with their exact
/// index arithmetic (which, e.g., leaves a NUL marker behind in the second pass that the
/// third one reads).
fn clean_up_spaces(t: &mut Vec<u8>) {
    // " ?", " !", " .", " ,"
    let n = t.len();
    let mut total = usize::from(n > 0);
    for i in 1..n {
        let x = t[i];
        if t[i - 1] == b' ' && matches!(x, b'?' | b'!' | b'.' | b',') {
            total -= 1;
        }
        t[total] = x;
        total += 1;
    }

    // " ' " -> "'"
    let n = total;
    total = usize::from(n > 0);
    let mut i = 1;
    while i < n {
        let x = t[i];
        if x == b'\'' && i + 1 < n && t[i - 1] == b' ' && t[i + 1] == b' ' {
            total -= 1;
            i += 1;
            t[i] = 0;
        }
        t[total] = x;
        total += 1;
        i += 1;
    }

    // " 's", " 'm", " 're", " 've"
    let n = total;
    total = usize::from(n > 0);
    for i in 1..n {
        let x = t[i];
        if t[i - 1] == b' ' && x == b'\'' && i + 1 < n {
            let x1 = t[i + 1];
            if x1 == b's' || x1 == b'm' {
                total -= 1;
            } else if x1 != b't' && x1 != b'd' && i + 2 < n {
                let x2 = t[i + 2];
                if (x1 == b'r' || x1 == b'v') && x2 == b'e' {
                    total -= 1;
                }
            }
        }
        t[total] = x;
        total += 1;
    }
    t.truncate(total);
}

/// Turns a stream of token ids into text without ever emitting part of a character:
/// bytes of an incomplete UTF-8 sequence wait for the next token. Pieces are
/// concatenated as they come (no leading-space removal and no space cleaning, which
/// need the whole sequence; see [`Tokenizer::detokenize`]). Bytes that can never form a
/// character are emitted as U+FFFD.
#[derive(Debug, Clone, Default)]
pub struct StreamDecoder {
    pending: Vec<u8>,
    special: bool,
}

impl StreamDecoder {
    /// `special`: render control tokens' text (as `token_to_piece(id, true)`).
    pub fn new(special: bool) -> Self {
        Self {
            pending: Vec::new(),
            special,
        }
    }

    /// Adds one token; returns the text it completes (possibly empty).
    pub fn push(&mut self, tokenizer: &Tokenizer, id: u32) -> String {
        self.pending
            .extend_from_slice(&tokenizer.token_to_piece(id, self.special));
        self.take(false)
    }

    /// Returns whatever is still buffered, with U+FFFD for an incomplete tail.
    pub fn finish(&mut self) -> String {
        self.take(true)
    }

    /// Whether bytes are waiting for the rest of a character.
    pub fn has_pending(&self) -> bool {
        !self.pending.is_empty()
    }

    fn take(&mut self, flush: bool) -> String {
        let mut out = String::new();
        let mut start = 0;
        loop {
            match std::str::from_utf8(&self.pending[start..]) {
                Ok(s) => {
                    out.push_str(s);
                    start = self.pending.len();
                    break;
                }
                Err(e) => {
                    let valid = start + e.valid_up_to();
                    // SAFETY-free: the prefix was just validated.
                    out.push_str(
                        std::str::from_utf8(&self.pending[start..valid]).unwrap_or_default(),
                    );
                    match e.error_len() {
                        Some(len) => {
                            out.push(char::REPLACEMENT_CHARACTER);
                            start = valid + len;
                        }
                        None if flush => {
                            out.push(char::REPLACEMENT_CHARACTER);
                            start = self.pending.len();
                            break;
                        }
                        None => {
                            start = valid;
                            break;
                        }
                    }
                }
            }
        }
        self.pending.drain(..start);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn clean(s: &str) -> String {
        let mut v = s.as_bytes().to_vec();
        clean_up_spaces(&mut v);
        String::from_utf8(v).unwrap()
    }

    #[test]
    fn cleaning() {
        assert_eq!(clean("Hello , world !"), "Hello, world!");
        assert_eq!(clean("it ' s"), "it's");
        assert_eq!(clean("he 's we 're I 'd"), "he's we're I 'd");
        assert_eq!(clean(""), "");
    }

    #[test]
    fn byte_decoding() {
        assert_eq!(byte_decode("\u{120}hi".as_bytes()), b" hi");
        assert_eq!(unescape_whitespace("\u{2581}a\u{2581}".as_bytes()), b" a ");
    }
}
