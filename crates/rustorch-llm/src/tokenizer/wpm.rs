//! BERT WordPiece (llama.cpp's `llm_tokenizer_wpm_session`): lowercasing and accent
//! stripping by llama.cpp's tables, splitting at whitespace and around punctuation and
//! CJK ideographs, then greedy longest-match of `▁word` against the vocabulary.

use super::unicode::{self, push_utf8};
use super::vocab::Vocab;

pub(crate) fn tokenize(vocab: &Vocab, text: &[u8], out: &mut Vec<u32>) {
    for word in preprocess(text, vocab.lowercase, vocab.strip_accents) {
        if word.is_empty() {
            continue;
        }
        let mut w = "\u{2581}".as_bytes().to_vec();
        w.extend_from_slice(&word);
        let n = w.len();
        let before = out.len();
        let mut i = 0;
        while i < n {
            let mut matched = false;
            let mut j = n.min(i + vocab.max_token_len + 1);
            while j > i {
                if let Some(id) = vocab.find(&w[i..j]) {
                    out.push(id);
                    matched = true;
                    i = j - 1;
                    break;
                }
                j -= 1;
            }
            if !matched {
                out.truncate(before);
                break;
            }
            i += 1;
        }
        if out.len() == before {
            out.extend(vocab.ids.unk);
        }
    }
}

fn is_chinese_char(c: u32) -> bool {
    (0x4E00..=0x9FFF).contains(&c)
        || (0x3400..=0x4DBF).contains(&c)
        || (0x20000..=0x2A6DF).contains(&c)
        || (0x2A700..=0x2B73F).contains(&c)
        || (0x2B740..=0x2B81F).contains(&c)
        || (0x2B920..=0x2CEAF).contains(&c)
        || (0xF900..=0xFAFF).contains(&c)
        || (0x2F800..=0x2FA1F).contains(&c)
}

fn preprocess(text: &[u8], lowercase: bool, strip_accents: bool) -> Vec<Vec<u8>> {
    let mut words: Vec<Vec<u8>> = vec![Vec::new()];
    for mut cpt in unicode::codepoints(text) {
        if strip_accents {
            cpt = unicode::nfd_first(cpt);
        }
        let f = unicode::flags(cpt);
        if f.is_whitespace() {
            if !words.last().is_some_and(Vec::is_empty) {
                words.push(Vec::new());
            }
            continue;
        }
        if cpt == 0 || cpt == unicode::REPLACEMENT || f.is_control() {
            continue;
        }
        if strip_accents && f.is_accent_mark() {
            continue;
        }
        let mut s = Vec::new();
        push_utf8(
            &mut s,
            if lowercase {
                unicode::to_lower(cpt)
            } else {
                cpt
            },
        );
        if f.is_punctuation() || (cpt < 0x7F && f.is_symbol()) || is_chinese_char(cpt) {
            if !words.last().is_some_and(Vec::is_empty) {
                words.push(Vec::new());
            }
            if let Some(last) = words.last_mut() {
                *last = s;
            }
            words.push(Vec::new());
        } else if let Some(last) = words.last_mut() {
            last.extend_from_slice(&s);
        }
    }
    if words.last().is_some_and(Vec::is_empty) {
        words.pop();
    }
    words
}
