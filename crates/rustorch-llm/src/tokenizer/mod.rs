//! Tokenizers built from GGUF metadata alone, producing the same ids as llama.cpp's
//! `llama_tokenize` and the same bytes as its `llama_token_to_piece` /
//! `llama_detokenize`.
//!
//! Supported `tokenizer.ggml.model` values:
//!
//! * `llama`: SentencePiece BPE by scores with `<0xXX>` byte fallback (Llama 2,
//!   TinyLlama, Gemma 3, Phi-3, ...).
//! * `gpt2`: byte-level BPE by merge ranks, with the pre-tokenizer named by
//!   `tokenizer.ggml.pre` (default, llama3/llama-bpe, qwen2, qwen35, smollm, gpt-2,
//!   phi-2, mpt, starcoder, refact, command-r, deepseek-llm, deepseek-coder, falcon,
//!   bloom, viking and their llama.cpp aliases). Other pre-tokenizers llama.cpp knows
//!   are reported as [`TokenizerError::UnsupportedPreTokenizer`]; unknown ones as
//!   [`TokenizerError::UnknownPreTokenizer`].
//! * `gemma4`: SentencePiece-style BPE by merge ranks on raw UTF-8.
//! * `bert`: WordPiece.
//! * `t5`: Unigram with the precompiled normalization map.
//!
//! Input that is not valid UTF-8 ([`Tokenizer::encode_bytes`]) is handled as
//! llama.cpp handles it: SentencePiece vocabularies see the raw bytes (so they come out
//! as byte tokens), the others decode with U+FFFD for each undecodable byte. Where
//! llama.cpp would throw or abort (a four-byte sequence above U+10FFFF, a byte with no
//! byte token, adding a BOS the vocabulary does not have), this module substitutes
//! U+FFFD, `<unk>`, or nothing, and never panics.
//!
//! Special tokens written in the text are cut out first, as llama.cpp's
//! `tokenizer_st_partition` does: longest first, control tokens only with
//! `parse_special`, user-defined ones always, honouring lstrip/rstrip. The EOT, FIM and
//! end-of-generation tokens that llama.cpp recognises by their text are found the same
//! way, down to which candidate wins when a vocabulary has several (SmolLM2's EOT is
//! `<|endoftext|>`, not `<|im_end|>`), by replaying libstdc++'s hash-map order.

mod bpe;
mod decode;
mod hash;
mod pretokenize;
mod queue;
mod special;
mod spm;
mod stl_order;
mod ugm;
mod unicode;
mod unicode_data;
mod vocab;
mod wpm;

use rustorch_core::gguf::{GgufError, GgufFile};

pub use decode::StreamDecoder;
pub use vocab::VocabType;

use special::{Fragment, SpecialMatcher};
use vocab::{attr, Vocab};

/// Why a tokenizer could not be built. Each variant names the metadata key or value.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    /// A required key is missing or unreadable (the error names the key).
    #[error(transparent)]
    Metadata(#[from] GgufError),
    #[error("tokenizer.ggml.model = '{model}' is not a tokenizer type llama.cpp knows")]
    UnknownModel { model: String },
    #[error("tokenizer.ggml.model = '{model}' is not supported")]
    UnsupportedModel { model: String },
    #[error("tokenizer.ggml.pre = '{pre}' is not a pre-tokenizer llama.cpp knows")]
    UnknownPreTokenizer { pre: String },
    #[error(
        "tokenizer.ggml.pre = '{pre}' is a llama.cpp pre-tokenizer this crate does not implement"
    )]
    UnsupportedPreTokenizer { pre: String },
    #[error("metadata key '{key}' has type {found}, expected {expected}")]
    WrongType {
        key: String,
        expected: &'static str,
        found: String,
    },
    #[error("metadata key '{key}' has {len} entries for {n_vocab} tokens")]
    ArrayTooShort {
        key: String,
        len: usize,
        n_vocab: usize,
    },
    #[error("metadata key '{key}' is malformed: {reason}")]
    Malformed { key: String, reason: String },
    #[error("tokenizer.ggml.tokens is empty")]
    EmptyVocab,
    #[error("input of {len} bytes is larger than the {max} bytes a tokenizer call accepts")]
    InputTooLarge { len: usize, max: usize },
}

/// Largest input of one call, 1 GiB: positions are kept as `u32`, and escaping
/// spaces or replacing invalid bytes can triple the text.
const MAX_INPUT: usize = 1 << 30;

#[derive(Debug, Clone)]
enum Engine {
    Spm(Box<spm::Spm>),
    Bpe(Box<bpe::Bpe>),
    Wpm,
    Ugm(Box<ugm::Ugm>),
}

/// A tokenizer: vocabulary, algorithm and special-token handling of one GGUF model.
#[derive(Debug, Clone)]
pub struct Tokenizer {
    vocab: Vocab,
    engine: Engine,
    specials: SpecialMatcher,
}

impl Tokenizer {
    /// Builds the tokenizer described by the `tokenizer.ggml.*` keys of `file`.
    pub fn from_gguf(file: &GgufFile) -> Result<Self, TokenizerError> {
        let vocab = Vocab::load(file)?;
        let engine = match vocab.kind {
            VocabType::Spm => Engine::Spm(Box::new(spm::Spm::new(&vocab))),
            VocabType::Bpe => {
                let merges = file.get_string_array(vocab::KEY_MERGES)?;
                Engine::Bpe(Box::new(bpe::Bpe::new(&vocab, &merges)))
            }
            VocabType::Wpm => Engine::Wpm,
            VocabType::Ugm => Engine::Ugm(Box::new(ugm::Ugm::new(&vocab, file)?)),
        };
        let specs: Vec<special::SpecialSpec> = vocab
            .specials
            .iter()
            .map(|&id| {
                let a = vocab.attrs[id as usize];
                (
                    id,
                    vocab.texts[id as usize].as_bytes(),
                    a & attr::LSTRIP != 0,
                    a & attr::RSTRIP != 0,
                    a & (attr::CONTROL | attr::UNKNOWN) != 0,
                )
            })
            .collect();
        let specials = SpecialMatcher::new(&specs).map_err(|reason| TokenizerError::Malformed {
            key: vocab::KEY_TOKENS.to_string(),
            reason: format!("special tokens: {reason}"),
        })?;
        Ok(Self {
            vocab,
            engine,
            specials,
        })
    }

    /// Tokenizes `text` like `llama_tokenize(vocab, text, add_special, parse_special)`:
    /// `add_special` adds BOS/EOS as the vocabulary asks (see [`Self::add_bos`]),
    /// `parse_special` turns control tokens written in the text (`<|im_start|>`) into
    /// their ids. User-defined tokens are always recognised.
    pub fn encode(
        &self,
        text: &str,
        add_special: bool,
        parse_special: bool,
    ) -> Result<Vec<u32>, TokenizerError> {
        self.encode_bytes(text.as_bytes(), add_special, parse_special)
    }

    /// [`Self::encode`] for arbitrary bytes. Invalid UTF-8 is handled as llama.cpp
    /// does: byte tokens for SentencePiece vocabularies, U+FFFD per undecodable byte
    /// for the others.
    pub fn encode_bytes(
        &self,
        text: &[u8],
        add_special: bool,
        parse_special: bool,
    ) -> Result<Vec<u32>, TokenizerError> {
        if text.len() > MAX_INPUT {
            return Err(TokenizerError::InputTooLarge {
                len: text.len(),
                max: MAX_INPUT,
            });
        }
        let v = &self.vocab;
        let fragments = self.specials.partition(text, parse_special);
        let mut out = Vec::with_capacity(text.len() / 3 + 4);
        let bos = add_special && v.add_bos;
        let eos = add_special && v.add_eos;
        match &self.engine {
            Engine::Spm(spm) => {
                if bos {
                    out.extend(v.ids.bos);
                }
                // A space is prefixed to the first text and to text after a special
                // token.
                let mut prev_special = true;
                let mut buf = Vec::new();
                for frag in fragments {
                    match frag {
                        Fragment::Text { start, end } => {
                            buf.clear();
                            if v.add_space_prefix && prev_special {
                                buf.extend_from_slice(ESCAPED_SPACE);
                            }
                            escape_whitespace(&text[start..end], &mut buf);
                            spm.tokenize(v, &buf, &mut out);
                            prev_special = false;
                        }
                        Fragment::Token(id) => {
                            out.push(id);
                            prev_special = true;
                        }
                    }
                }
                if eos {
                    out.extend(v.ids.eos);
                }
            }
            Engine::Bpe(bpe) => {
                if bos {
                    out.extend(v.ids.bos);
                }
                let mut scratch = bpe::Scratch::default();
                let mut buf = Vec::new();
                for frag in fragments {
                    match frag {
                        Fragment::Text { start, end } => {
                            let raw = &text[start..end];
                            let raw = if v.escape_whitespaces {
                                buf.clear();
                                escape_whitespace(raw, &mut buf);
                                &buf[..]
                            } else {
                                raw
                            };
                            let decoded = unicode::Decoded::new(raw);
                            bpe.tokenize(v, &decoded, &mut scratch, &mut out);
                        }
                        Fragment::Token(id) => out.push(id),
                    }
                }
                if eos {
                    out.extend(v.ids.eos);
                }
            }
            Engine::Wpm => {
                if add_special {
                    out.extend(v.ids.bos);
                }
                for frag in fragments {
                    match frag {
                        Fragment::Text { start, end } => {
                            wpm::tokenize(v, &text[start..end], &mut out)
                        }
                        Fragment::Token(id) => out.push(id),
                    }
                }
                if add_special {
                    out.extend(v.ids.sep);
                }
            }
            Engine::Ugm(ugm) => {
                if bos {
                    out.extend(v.ids.bos);
                }
                for frag in fragments {
                    match frag {
                        Fragment::Text { start, end } => {
                            ugm.tokenize(v, &text[start..end], &mut out)
                        }
                        Fragment::Token(id) => out.push(id),
                    }
                }
                if eos {
                    out.extend(v.ids.eos);
                }
            }
        }
        Ok(out)
    }

    /// The bytes of one token (`llama_token_to_piece` without lstrip). Control and
    /// unknown tokens give their text only when `special`; ids out of range give
    /// nothing. Pieces may end inside a UTF-8 character; see [`StreamDecoder`].
    pub fn token_to_piece(&self, id: u32, special: bool) -> Vec<u8> {
        self.vocab.piece(id, special).to_vec()
    }

    /// The text of a token sequence, as `llama_detokenize(.., remove_special = false,
    /// unparse_special = special)`: the leading space SentencePiece adds is removed and
    /// the vocabulary's space cleaning applied. Ids out of range are skipped.
    pub fn detokenize(&self, ids: &[u32], special: bool) -> Vec<u8> {
        self.vocab.detokenize(ids, false, special)
    }

    /// [`Self::detokenize`] with llama.cpp's `remove_special` too: drop a leading BOS
    /// and trailing EOS the vocabulary would have added.
    pub fn detokenize_with(
        &self,
        ids: &[u32],
        remove_special: bool,
        unparse_special: bool,
    ) -> Vec<u8> {
        self.vocab.detokenize(ids, remove_special, unparse_special)
    }

    pub fn n_vocab(&self) -> usize {
        self.vocab.n_tokens()
    }

    pub fn vocab_type(&self) -> VocabType {
        self.vocab.kind
    }

    pub fn bos(&self) -> Option<u32> {
        self.vocab.ids.bos
    }

    pub fn eos(&self) -> Option<u32> {
        self.vocab.ids.eos
    }

    /// End of turn, from `tokenizer.ggml.eot_token_id` or, as llama.cpp does, by text.
    pub fn eot(&self) -> Option<u32> {
        self.vocab.ids.eot
    }

    pub fn unk(&self) -> Option<u32> {
        self.vocab.ids.unk
    }

    pub fn pad(&self) -> Option<u32> {
        self.vocab.ids.pad
    }

    /// Whether `id` ends generation (EOS, EOT, EOM, FIM pad/repo/file-separator, and
    /// the tokens llama.cpp recognises by text such as `<|im_end|>`, `<end_of_turn>`).
    pub fn is_eog(&self, id: u32) -> bool {
        self.vocab.eog.contains(&id)
    }

    /// All end-of-generation ids, ascending.
    pub fn eog_ids(&self) -> impl Iterator<Item = u32> + '_ {
        self.vocab.eog.iter().copied()
    }

    /// Whether `id` is a control token (rendered only with `special`).
    pub fn is_control(&self, id: u32) -> bool {
        self.vocab
            .attrs
            .get(id as usize)
            .is_some_and(|a| a & attr::CONTROL != 0)
    }

    /// Whether `encode(.., add_special = true, ..)` adds BOS / EOS.
    pub fn add_bos(&self) -> bool {
        self.vocab.add_bos
    }

    pub fn add_eos(&self) -> bool {
        self.vocab.add_eos
    }

    /// Overrides `tokenizer.ggml.add_bos_token` (for encoding and for
    /// [`Self::detokenize_with`]'s `remove_special`).
    pub fn set_add_bos(&mut self, on: bool) {
        self.vocab.add_bos = on;
    }

    pub fn set_add_eos(&mut self, on: bool) {
        self.vocab.add_eos = on;
    }

    /// The vocabulary text of a token, as stored (`▁` for spaces in SentencePiece
    /// vocabularies, GPT-2 byte characters in byte-level ones).
    pub fn token_text(&self, id: u32) -> Option<&str> {
        self.vocab.texts.get(id as usize).map(String::as_str)
    }

    /// The token whose vocabulary text is exactly `text`.
    pub fn find_token(&self, text: &str) -> Option<u32> {
        self.vocab.find(text.as_bytes())
    }
}

const ESCAPED_SPACE: &[u8] = "\u{2581}".as_bytes();

/// Spaces to `▁`.
fn escape_whitespace(text: &[u8], out: &mut Vec<u8>) {
    for &b in text {
        if b == b' ' {
            out.extend_from_slice(ESCAPED_SPACE);
        } else {
            out.push(b);
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn tokenizer_is_shareable() {
        fn check<T: Send + Sync + Clone + std::fmt::Debug>() {}
        check::<super::Tokenizer>();
        check::<super::StreamDecoder>();
    }
}
