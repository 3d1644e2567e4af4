//! Reading the vocabulary and its settings from GGUF metadata, following
//! `llama_vocab::impl::load` in llama.cpp: token attributes, special-token ids and
//! their defaults, the end-of-generation set, and the per-model quirks llama.cpp
//! applies by token text or model name.

use std::collections::BTreeSet;

use rustorch_core::gguf::{GgufFile, Value};

use super::hash::FxHashMap;
use super::pretokenize::{patterns, Pass};
use super::{stl_order, TokenizerError};

/// Token attributes (llama.cpp's `llama_token_attr` bits).
pub(crate) mod attr {
    pub const UNKNOWN: u32 = 1 << 0;
    pub const UNUSED: u32 = 1 << 1;
    pub const NORMAL: u32 = 1 << 2;
    pub const CONTROL: u32 = 1 << 3;
    pub const USER_DEFINED: u32 = 1 << 4;
    pub const BYTE: u32 = 1 << 5;
    pub const LSTRIP: u32 = 1 << 7;
    pub const RSTRIP: u32 = 1 << 8;
}

/// The tokenization algorithm of a vocabulary (`tokenizer.ggml.model`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VocabType {
    /// SentencePiece BPE by piece scores (`llama`).
    Spm,
    /// Byte-level or SentencePiece-style BPE by merge ranks (`gpt2`, `gemma4`).
    Bpe,
    /// BERT WordPiece (`bert`).
    Wpm,
    /// T5 Unigram (`t5`).
    Ugm,
}

pub(crate) const KEY_MODEL: &str = "tokenizer.ggml.model";
pub(crate) const KEY_PRE: &str = "tokenizer.ggml.pre";
pub(crate) const KEY_TOKENS: &str = "tokenizer.ggml.tokens";
pub(crate) const KEY_SCORES: &str = "tokenizer.ggml.scores";
pub(crate) const KEY_TOKEN_TYPE: &str = "tokenizer.ggml.token_type";
pub(crate) const KEY_MERGES: &str = "tokenizer.ggml.merges";
pub(crate) const KEY_CHARSMAP: &str = "tokenizer.ggml.precompiled_charsmap";

/// Special-token ids (`None` is llama.cpp's `LLAMA_TOKEN_NULL`).
#[derive(Debug, Clone, Default)]
pub(crate) struct SpecialIds {
    pub bos: Option<u32>,
    pub eos: Option<u32>,
    pub eot: Option<u32>,
    pub eom: Option<u32>,
    pub unk: Option<u32>,
    pub sep: Option<u32>,
    pub pad: Option<u32>,
    pub mask: Option<u32>,
    pub fim_pre: Option<u32>,
    pub fim_suf: Option<u32>,
    pub fim_mid: Option<u32>,
    pub fim_pad: Option<u32>,
    pub fim_rep: Option<u32>,
    pub fim_sep: Option<u32>,
}

/// Which BPE pre-tokenizer family applies, where it changes more than the split.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PreKind {
    Other,
    /// Gemma 4: newline-only words that are tokens skip the merges.
    Gemma4,
}

#[derive(Debug, Clone)]
pub(crate) struct Vocab {
    pub kind: VocabType,
    pub texts: Vec<String>,
    pub scores: Vec<f32>,
    pub attrs: Vec<u32>,
    /// Attributes from `tokenizer.ggml.token_type` alone, before llama.cpp's fix-ups
    /// (the Unigram matcher is built from these, as llama.cpp builds it first).
    pub raw_attrs: Vec<u32>,
    pub token_to_id: FxHashMap<Box<[u8]>, u32>,
    pub max_token_len: usize,
    pub ids: SpecialIds,
    pub add_bos: bool,
    pub add_eos: bool,
    pub add_space_prefix: bool,
    pub remove_extra_whitespaces: bool,
    pub escape_whitespaces: bool,
    pub treat_whitespace_as_suffix: bool,
    pub clean_spaces: bool,
    pub ignore_merges: bool,
    pub byte_encode: bool,
    pub lowercase: bool,
    pub strip_accents: bool,
    pub pre_kind: PreKind,
    pub passes: Vec<Pass>,
    pub eog: BTreeSet<u32>,
    /// llama.cpp's `cache_special_tokens`: control, user-defined and unknown tokens,
    /// longest text first.
    pub specials: Vec<u32>,
    /// `token_to_piece(id, special = true)` for every token.
    pub pieces: Vec<Box<[u8]>>,
}

/// `tokenizer.ggml.token_type` values (llama.cpp's `llama_token_type`) to attributes.
fn attr_from_type(t: i64) -> u32 {
    match t {
        1 => attr::NORMAL,
        2 => attr::UNKNOWN,
        3 => attr::CONTROL,
        4 => attr::USER_DEFINED,
        5 => attr::UNUSED,
        6 => attr::BYTE,
        _ => 0,
    }
}

/// An integer metadata value that is a valid token id, if present.
fn opt_u32(f: &GgufFile, key: &str) -> Option<u32> {
    f.get(key)
        .and_then(Value::as_u64)
        .and_then(|v| u32::try_from(v).ok())
}

fn opt_bool(f: &GgufFile, key: &str) -> Result<Option<bool>, TokenizerError> {
    match f.get(key) {
        None => Ok(None),
        Some(v) => v
            .as_bool()
            .map(Some)
            .ok_or_else(|| TokenizerError::WrongType {
                key: key.to_string(),
                expected: "BOOL",
                found: v.type_name(),
            }),
    }
}

/// A numeric array of at least `n` entries, as f64.
fn numeric_array(f: &GgufFile, key: &str, n: usize) -> Result<Option<Vec<f64>>, TokenizerError> {
    let Some(v) = f.get(key) else {
        return Ok(None);
    };
    let wrong = || TokenizerError::WrongType {
        key: key.to_string(),
        expected: "ARRAY of numbers",
        found: v.type_name(),
    };
    let items = v.as_array().ok_or_else(wrong)?;
    let values: Vec<f64> = items
        .iter()
        .map(Value::as_f64)
        .collect::<Option<_>>()
        .ok_or_else(wrong)?;
    if values.len() < n {
        return Err(TokenizerError::ArrayTooShort {
            key: key.to_string(),
            len: values.len(),
            n_vocab: n,
        });
    }
    Ok(Some(values))
}

/// Settings of a BPE pre-tokenizer name.
struct PreSettings {
    passes: Vec<Pass>,
    ignore_merges: bool,
    clean_spaces: bool,
    add_bos: bool,
    escape_whitespaces: bool,
    byte_encode: bool,
    kind: PreKind,
    no_bos: bool,
}

fn pre_settings(pre: &str) -> Result<PreSettings, TokenizerError> {
    let mut s = PreSettings {
        passes: Vec::new(),
        ignore_merges: false,
        clean_spaces: true,
        add_bos: false,
        escape_whitespaces: false,
        byte_encode: true,
        kind: PreKind::Other,
        no_bos: false,
    };
    let no_clean = [
        "deepseek-llm",
        "deepseek-coder",
        "command-r",
        "qwen2",
        "deepseek-r1-qwen",
        "kormo",
        "f2llmv2",
        "qwen35",
        "poro-chat",
        "viking",
        "smollm",
    ];
    s.clean_spaces = !no_clean.contains(&pre);
    s.passes = match pre {
        // llama.cpp warns and uses the default when the key is missing.
        "" | "default" => patterns::default(),
        "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "falcon-h1" | "pixtral" | "midm-2.0"
        | "lfm2" | "jina-v5-nano" => {
            s.ignore_merges = true;
            s.add_bos = true;
            vec![Pass::Llama3]
        }
        "dbrx" | "smaug-bpe" => vec![Pass::Llama3],
        "chatglm-bpe" => {
            s.no_bos = true;
            vec![Pass::Llama3]
        }
        "glm4" | "glm5" => {
            s.no_bos = true;
            s.ignore_merges = true;
            vec![Pass::Llama3]
        }
        "deepseek-llm" => patterns::deepseek_llm(),
        "deepseek-coder" => patterns::deepseek_coder(),
        "falcon" => patterns::falcon(),
        "mpt" | "gpt-2" | "phi-2" | "jina-es" | "jina-de" | "gigachat" | "jina-v2-es"
        | "jina-v2-de" | "a.x-4.0" | "mellum" | "modern-bert" | "exaone4" | "olmo" | "jais"
        | "jina-v1-en" | "jina-v2-code" | "roberta-bpe" => vec![Pass::Gpt2],
        "trillion" | "granite-docling" => {
            s.clean_spaces = false;
            vec![Pass::Gpt2]
        }
        "starcoder" | "refact" | "command-r" | "smollm" | "codeshell" | "exaone" | "minerva-7b"
        | "mellum2" => patterns::starcoder(),
        "qwen2" | "deepseek-r1-qwen" | "kormo" | "f2llmv2" | "megrez" | "stablelm2" => {
            vec![Pass::Qwen2]
        }
        "hunyuan" | "solar-open" | "grok-2" => {
            s.clean_spaces = false;
            vec![Pass::Qwen2]
        }
        "qwen35" => vec![Pass::Qwen35],
        "gemma4" | "granite-embed-multi-311m" => {
            s.escape_whitespaces = true;
            s.byte_encode = false;
            s.kind = PreKind::Gemma4;
            vec![Pass::Newlines]
        }
        "sarvam-moe" => {
            s.escape_whitespaces = true;
            s.byte_encode = false;
            s.clean_spaces = false;
            vec![Pass::Newlines]
        }
        "bloom" | "gpt3-finnish" | "poro-chat" => patterns::bloom(),
        "viking" => patterns::viking(),
        known_elsewhere @ ("minicpm5"
        | "deepseek-v3"
        | "spark2_5"
        | "youtu"
        | "jais-2"
        | "whitespace"
        | "chameleon"
        | "gpt-4o"
        | "llama4"
        | "kanana2"
        | "talkie"
        | "granite-embed-multi-97m"
        | "tiny_aya"
        | "cohere2moe"
        | "superbpe"
        | "bailingmoe"
        | "bailingmoe2"
        | "llada-moe"
        | "seed-coder"
        | "hunyuan-dense"
        | "hy_v4"
        | "joyai-llm"
        | "kimi-k2"
        | "ufakzeka"
        | "afmoe"
        | "laguna"
        | "minimax-m2"
        | "exaone-moe"
        | "tekken") => {
            return Err(TokenizerError::UnsupportedPreTokenizer {
                pre: known_elsewhere.to_string(),
            })
        }
        other => {
            return Err(TokenizerError::UnknownPreTokenizer {
                pre: other.to_string(),
            })
        }
    };
    Ok(s)
}

// Texts llama.cpp recognises (see `llama_vocab::impl::load`).
const EOT_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "<｜end▁of▁sentence｜>",
    "<end_of_utterance>",
];
const EOM_TEXTS: &[&str] = &["<|eom_id|>"];
const FIM_PRE_TEXTS: &[&str] = &[
    "<|fim_prefix|>",
    "<fim-prefix>",
    "<fim_prefix>",
    "<｜fim▁begin｜>",
    "<PRE>",
    "▁<PRE>",
    "<|code_prefix|>",
    "<|prefix|>",
];
const FIM_SUF_TEXTS: &[&str] = &[
    "<|fim_suffix|>",
    "<fim-suffix>",
    "<fim_suffix>",
    "<｜fim▁hole｜>",
    "<SUF>",
    "▁<SUF>",
    "<|code_suffix|>",
    "<|suffix|>",
];
const FIM_MID_TEXTS: &[&str] = &[
    "<|fim_middle|>",
    "<fim-middle>",
    "<fim_middle>",
    "<｜fim▁end｜>",
    "<MID>",
    "▁<MID>",
    "<|code_middle|>",
    "<|middle|>",
];
const FIM_PAD_TEXTS: &[&str] = &["<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"];
const FIM_REP_TEXTS: &[&str] = &[
    "<|fim_repo|>",
    "<|repo_name|>",
    "<fim-repo>",
    "<REPO>",
    "<reponame>",
];
const FIM_SEP_TEXTS: &[&str] = &["<|file_sep|>"];
const EOG_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<|flush|>",
    "<|calls|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "</s>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "[EOS]",
    "<|end_of_text|>",
    "<end_of_utterance>",
    "<eos>",
    "<turn|>",
    "<|tool_response>",
    "<｜end▁of▁sentence｜>",
    "[e~[",
];

impl Vocab {
    pub(crate) fn load(f: &GgufFile) -> Result<Self, TokenizerError> {
        let model = f.get_str(KEY_MODEL)?.to_string();
        let mut pre = match f.get(KEY_PRE) {
            Some(v) => v
                .as_str()
                .ok_or_else(|| TokenizerError::WrongType {
                    key: KEY_PRE.to_string(),
                    expected: "STRING",
                    found: v.type_name(),
                })?
                .to_string(),
            None => String::new(),
        };

        let mut ids = SpecialIds::default();
        let kind = match model.as_str() {
            "llama" => {
                ids.bos = Some(1);
                ids.eos = Some(2);
                ids.unk = Some(0);
                VocabType::Spm
            }
            "bert" => {
                ids.bos = Some(101);
                ids.unk = Some(100);
                ids.sep = Some(102);
                ids.pad = Some(0);
                ids.mask = Some(103);
                VocabType::Wpm
            }
            "gpt2" => {
                ids.bos = Some(11);
                ids.eos = Some(11);
                VocabType::Bpe
            }
            "gemma4" => {
                pre = "gemma4".to_string();
                VocabType::Bpe
            }
            "t5" => {
                ids.eos = Some(1);
                ids.unk = Some(2);
                ids.pad = Some(0);
                VocabType::Ugm
            }
            "no_vocab" | "none" | "rwkv" | "plamo2" | "test" | "hybriddna" | "whitespace" => {
                return Err(TokenizerError::UnsupportedModel { model });
            }
            _ => return Err(TokenizerError::UnknownModel { model }),
        };
        if kind == VocabType::Bpe && f.get(KEY_MERGES).is_none() {
            return Err(TokenizerError::Metadata(
                rustorch_core::gguf::GgufError::MissingKey {
                    key: KEY_MERGES.to_string(),
                },
            ));
        }

        let mut add_space_prefix = false;
        let mut escape_whitespaces = true;
        let mut clean_spaces = false;
        let mut ignore_merges = false;
        let mut byte_encode = true;
        let mut pre_kind = PreKind::Other;
        let mut passes = Vec::new();
        let (mut add_bos, mut add_eos) = (false, false);
        match kind {
            VocabType::Bpe => {
                let s = pre_settings(&pre)?;
                escape_whitespaces = s.escape_whitespaces;
                clean_spaces = s.clean_spaces;
                ignore_merges = s.ignore_merges;
                add_bos = s.add_bos;
                byte_encode = s.byte_encode;
                pre_kind = s.kind;
                passes = s.passes;
                if s.no_bos {
                    ids.bos = None;
                }
            }
            VocabType::Spm => {
                add_space_prefix = true;
                add_bos = true;
            }
            VocabType::Wpm => {
                clean_spaces = true;
                add_bos = true;
            }
            VocabType::Ugm => {
                add_eos = true;
            }
        }
        if let Some(v) = opt_bool(f, "tokenizer.ggml.add_space_prefix")? {
            add_space_prefix = v;
        }
        let remove_extra_whitespaces =
            opt_bool(f, "tokenizer.ggml.remove_extra_whitespaces")?.unwrap_or(false);

        // Tokens, scores and types.
        let words = f.get_string_array(KEY_TOKENS)?;
        let n = words.len();
        if n == 0 {
            return Err(TokenizerError::EmptyVocab);
        }
        if n > (u32::MAX - 1) as usize {
            return Err(TokenizerError::ArrayTooShort {
                key: KEY_TOKENS.to_string(),
                len: n,
                n_vocab: n,
            });
        }
        let scores = numeric_array(f, KEY_SCORES, n)?;
        let types = numeric_array(f, KEY_TOKEN_TYPE, n)?;

        let mut texts = Vec::with_capacity(n);
        let mut token_to_id: FxHashMap<Box<[u8]>, u32> = Default::default();
        token_to_id.reserve(n);
        let mut max_token_len = 0;
        let mut scores_out = Vec::with_capacity(n);
        let mut attrs = Vec::with_capacity(n);
        for (i, w) in words.iter().enumerate() {
            let text = if w.is_empty() {
                format!("[EMPTY_{i}]")
            } else {
                w.to_string()
            };
            token_to_id.insert(text.as_bytes().into(), i as u32);
            max_token_len = max_token_len.max(text.len());
            texts.push(text);
            let score = scores.as_ref().map_or(0.0, |s| s[i] as f32);
            // Canonical order for the SPM queue: no NaN, no negative zero.
            scores_out.push(if score.is_nan() {
                f32::NEG_INFINITY
            } else {
                score + 0.0
            });
            attrs.push(
                types
                    .as_ref()
                    .map_or(attr::NORMAL, |t| attr_from_type(t[i] as i64)),
            );
        }

        // Special token ids: defaults out of range are dropped; keys in range win.
        let n32 = n as u32;
        for id in [
            &mut ids.bos,
            &mut ids.eos,
            &mut ids.unk,
            &mut ids.sep,
            &mut ids.pad,
            &mut ids.mask,
        ] {
            if id.is_some_and(|v| v >= n32) {
                *id = None;
            }
        }
        type Slot = fn(&mut SpecialIds) -> &mut Option<u32>;
        let keyed: [(&str, Slot); 17] = [
            ("tokenizer.ggml.bos_token_id", |s| &mut s.bos),
            ("tokenizer.ggml.eos_token_id", |s| &mut s.eos),
            ("tokenizer.ggml.eot_token_id", |s| &mut s.eot),
            ("tokenizer.ggml.eom_token_id", |s| &mut s.eom),
            ("tokenizer.ggml.unknown_token_id", |s| &mut s.unk),
            ("tokenizer.ggml.seperator_token_id", |s| &mut s.sep),
            ("tokenizer.ggml.padding_token_id", |s| &mut s.pad),
            ("tokenizer.ggml.mask_token_id", |s| &mut s.mask),
            ("tokenizer.ggml.fim_pre_token_id", |s| &mut s.fim_pre),
            ("tokenizer.ggml.fim_suf_token_id", |s| &mut s.fim_suf),
            ("tokenizer.ggml.fim_mid_token_id", |s| &mut s.fim_mid),
            ("tokenizer.ggml.fim_pad_token_id", |s| &mut s.fim_pad),
            ("tokenizer.ggml.fim_rep_token_id", |s| &mut s.fim_rep),
            ("tokenizer.ggml.fim_sep_token_id", |s| &mut s.fim_sep),
            // Deprecated names.
            ("tokenizer.ggml.prefix_token_id", |s| &mut s.fim_pre),
            ("tokenizer.ggml.suffix_token_id", |s| &mut s.fim_suf),
            ("tokenizer.ggml.middle_token_id", |s| &mut s.fim_mid),
        ];
        for (key, slot) in keyed {
            if let Some(v) = opt_u32(f, key) {
                if v < n32 {
                    *slot(&mut ids) = Some(v);
                }
            }
        }

        if let Some(v) = opt_bool(f, "tokenizer.ggml.add_bos_token")? {
            add_bos = v;
        }
        if let Some(v) = opt_bool(f, "tokenizer.ggml.add_eos_token")? {
            add_eos = v;
        }
        // tokenizer.ggml.add_sep_token only matters to rerankers, not to tokenization.
        if pre_kind == PreKind::Gemma4 {
            add_bos = true;
        }
        let lowercase = opt_bool(f, "tokenizer.ggml.normalizer.lowercase")?.unwrap_or(true);
        let strip_accents =
            opt_bool(f, "tokenizer.ggml.normalizer.strip_accents")?.unwrap_or(lowercase);

        let mut v = Vocab {
            kind,
            texts,
            scores: scores_out,
            raw_attrs: attrs.clone(),
            attrs,
            token_to_id,
            max_token_len,
            ids,
            add_bos,
            add_eos,
            add_space_prefix,
            remove_extra_whitespaces,
            escape_whitespaces,
            treat_whitespace_as_suffix: false,
            clean_spaces,
            ignore_merges,
            byte_encode,
            lowercase,
            strip_accents,
            pre_kind,
            passes,
            eog: BTreeSet::new(),
            specials: Vec::new(),
            pieces: Vec::new(),
        };
        v.detect_special_tokens();
        v.specials = (0..n32)
            .filter(|&id| {
                v.attrs[id as usize] & (attr::CONTROL | attr::USER_DEFINED | attr::UNKNOWN) != 0
            })
            .collect();
        // Stable: ties keep id order (see special.rs).
        v.specials
            .sort_by_key(|&id| std::cmp::Reverse(v.texts[id as usize].len()));
        v.pieces = (0..n32).map(|id| v.piece_for_cache(id)).collect();
        v.apply_model_attrs(f);
        Ok(v)
    }

    pub(crate) fn n_tokens(&self) -> usize {
        self.texts.len()
    }

    pub(crate) fn find(&self, text: &[u8]) -> Option<u32> {
        self.token_to_id.get(text).copied()
    }

    /// EOT/EOM/FIM detection by text, the end-of-generation set and its fix-ups.
    fn detect_special_tokens(&mut self) {
        let keys: Vec<&[u8]> = self.texts.iter().map(|t| t.as_bytes()).collect();
        let order = stl_order::iteration_order(&keys);
        let n = self.texts.len();
        // (text, id) in the order llama.cpp's token_to_id map iterates.
        let entries: Vec<(usize, u32)> = order
            .into_iter()
            .map(|i| (i, self.find(self.texts[i].as_bytes()).unwrap_or(i as u32)))
            .collect();

        let ids = &mut self.ids;
        let attrs = &mut self.attrs;
        let texts = &self.texts;
        for &(i, id) in &entries {
            let text = texts[i].as_str();
            let slots: [(&mut Option<u32>, &[&str]); 8] = [
                (&mut ids.eot, EOT_TEXTS),
                (&mut ids.eom, EOM_TEXTS),
                (&mut ids.fim_pre, FIM_PRE_TEXTS),
                (&mut ids.fim_suf, FIM_SUF_TEXTS),
                (&mut ids.fim_mid, FIM_MID_TEXTS),
                (&mut ids.fim_pad, FIM_PAD_TEXTS),
                (&mut ids.fim_rep, FIM_REP_TEXTS),
                (&mut ids.fim_sep, FIM_SEP_TEXTS),
            ];
            for (slot, candidates) in slots {
                if slot.is_none() && candidates.contains(&text) {
                    *slot = Some(id);
                    attrs[id as usize] |= attr::CONTROL;
                }
            }
        }

        // Control tokens named "unused" are unused.
        for &(i, id) in &entries {
            let a = &mut attrs[id as usize];
            if *a & attr::CONTROL != 0 && texts[i].contains("unused") {
                *a |= attr::UNUSED;
            }
        }

        let mut eog = BTreeSet::new();
        eog.extend(ids.fim_pad);
        eog.extend(ids.fim_rep);
        eog.extend(ids.fim_sep);
        for &(i, id) in &entries {
            if EOG_TEXTS.contains(&texts[i].as_str()) {
                eog.insert(id);
                attrs[id as usize] |= attr::CONTROL;
            }
        }
        // gpt-oss: these are always rendered.
        for &(i, id) in &entries {
            if ["<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"]
                .contains(&texts[i].as_str())
            {
                attrs[id as usize] = attr::USER_DEFINED;
            }
        }
        eog.extend(ids.eos);
        eog.extend(ids.eot);
        eog.extend(ids.eom);

        // o200k_harmony / solar-open: "<|end|>" is not end-of-generation there.
        let has = |eog: &BTreeSet<u32>, t: &str| {
            eog.iter()
                .find(|&&id| (id as usize) < n && texts[id as usize] == t)
                .copied()
        };
        let end_id = has(&eog, "<|end|>");
        let has_return = has(&eog, "<|return|>").is_some();
        let has_call = has(&eog, "<|call|>").is_some() || has(&eog, "<|calls|>").is_some();
        let has_flush = has(&eog, "<|flush|>").is_some();
        if let Some(end_id) = end_id {
            if has_call && (has_return || has_flush) {
                eog.remove(&end_id);
                attrs[end_id as usize] = attr::USER_DEFINED;
            }
        }
        // Gemma 4 and PLaMo have a normal "</s>".
        let normal_s_marker =
            has(&eog, "<|tool_response>").is_some() || has(&eog, "<|plamo:eos|>").is_some();
        if let (true, Some(s_id)) = (normal_s_marker, has(&eog, "</s>")) {
            eog.remove(&s_id);
            attrs[s_id as usize] = attr::NORMAL;
        }
        self.eog = eog;
    }

    /// Per-token lstrip/rstrip that llama.cpp sets by tokenizer or model name.
    fn apply_model_attrs(&mut self, f: &GgufFile) {
        let get = |key: &str| {
            f.get(key)
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_string()
        };
        let name = get("general.name").to_ascii_lowercase();
        let pre = get(KEY_PRE);
        let arch = get("general.architecture");
        let contains_any = |s: &str, subs: &[&str]| subs.iter().any(|x| s.contains(x));
        let set = |v: &mut Vocab, text: &str, a: u32, on: bool| {
            if let Some(id) = v.find(text.as_bytes()) {
                let slot = &mut v.attrs[id as usize];
                *slot = if on { *slot | a } else { *slot & !a };
            }
        };
        if contains_any(&pre, &["jina-v2-de", "jina-v2-es", "jina-v2-code"])
            || contains_any(&arch, &["nomic-bert-moe", "jina-bert-v3"])
        {
            set(self, "<mask>", attr::LSTRIP, true);
        } else if contains_any(&name, &["phi-3", "phi3"]) {
            for id in self.specials.clone() {
                self.attrs[id as usize] |= attr::RSTRIP;
            }
            set(self, "</s>", attr::RSTRIP, true);
            for t in ["<unk>", "<s>", "<|endoftext|>"] {
                set(self, t, attr::RSTRIP, false);
            }
        } else if contains_any(&name, &["modern-bert"]) {
            set(self, "[MASK]", attr::LSTRIP, true);
        }
    }

    /// llama.cpp's `token_to_piece(id, special = true)` before any caching.
    fn piece_for_cache(&self, id: u32) -> Box<[u8]> {
        let a = self.attrs[id as usize];
        let text = self.texts[id as usize].as_bytes();
        if a & (attr::UNKNOWN | attr::CONTROL | attr::USER_DEFINED) != 0 {
            return text.into();
        }
        if a & attr::NORMAL != 0 {
            return if self.kind == VocabType::Bpe && !self.escape_whitespaces {
                super::decode::byte_decode(text).into()
            } else {
                super::decode::unescape_whitespace(text).into()
            };
        }
        if a & attr::BYTE != 0 {
            return vec![token_to_byte(text)].into();
        }
        Box::default()
    }
}

/// The byte of a `<0xXX>` token: `strtol(text.substr(3, 2), 16)` as llama.cpp does.
pub(crate) fn token_to_byte(text: &[u8]) -> u8 {
    let digits = text.get(3..text.len().min(5)).unwrap_or_default();
    let mut it = digits.iter().copied().peekable();
    while it.peek().is_some_and(|&b| is_c_space_byte(b)) {
        it.next();
    }
    let neg = match it.peek() {
        Some(b'-') => {
            it.next();
            true
        }
        Some(b'+') => {
            it.next();
            false
        }
        _ => false,
    };
    let mut v: i64 = 0;
    for b in it {
        match (b as char).to_digit(16) {
            Some(d) => v = v * 16 + d as i64,
            None => break,
        }
    }
    (if neg { -v } else { v }) as u8
}

fn is_c_space_byte(b: u8) -> bool {
    super::unicode::is_c_space(b as u32)
}
