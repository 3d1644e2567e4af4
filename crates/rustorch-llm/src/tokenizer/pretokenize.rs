//! BPE pre-tokenization: splitting text into words before merges, as llama.cpp's
//! `unicode_regex_split` does.
//!
//! llama.cpp runs a list of regexes in turn, each refining the pieces left by the
//! previous one. The common patterns (GPT-2, Llama-3, Qwen2, Qwen3.5, newline runs) go
//! through hand-written scanners there, and so here: the scanners below reproduce
//! those, quirks included. The remaining patterns go through `std::regex` on a
//! "collapsed" text in which every non-ASCII codepoint stands for its category
//! (letter, number, punctuation, ...), or, when the pattern names no category, on the
//! codepoints with non-ASCII whitespace folded to `\v`. The few such patterns the
//! supported pre-tokenizers need are single-class runs, matched here by a small
//! leftmost-first matcher with the same semantics.

use super::unicode::{self, is_c_space, Decoded, Flags};

const OUT_OF_RANGE: u32 = u32::MAX;

/// One splitting step.
#[derive(Debug, Clone)]
pub(crate) enum Pass {
    /// `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)`
    Gpt2,
    /// `(?i:'s|...)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+`
    Llama3,
    /// As Llama-3 with single digits.
    Qwen2,
    /// As Qwen2 with combining marks inside words.
    Qwen35,
    /// `[^\n]+|[\n]+`
    Newlines,
    /// A `std::regex` pattern, emulated.
    Regex(Regex),
}

/// The emulated `std::regex` patterns.
#[derive(Debug, Clone)]
pub(crate) struct Regex {
    kind: RegexKind,
    /// Whether llama.cpp matches this pattern on the category-collapsed text.
    collapsed: bool,
}

#[derive(Debug, Clone)]
enum RegexKind {
    /// `P?X+` (or `P?X` when `repeat` is false), `P` a one-character class.
    Run {
        prefix: Option<CharClass>,
        class: CharClass,
        repeat: bool,
    },
    /// `[0-9][0-9][0-9]`
    ThreeAsciiDigits,
    /// `\s+$`
    TrailingSpace,
}

/// A bracket expression over the matcher's view of the text (see [`Pass::Regex`]).
#[derive(Debug, Clone, Default)]
struct CharClass {
    ascii: u128,
    /// Collapsed category codes 0xD0..=0xD5, bit `code - 0xD0`.
    codes: u8,
    /// Non-ASCII codepoint ranges, for patterns matched on codepoints.
    ranges: Vec<(u32, u32)>,
    negated: bool,
}

// Collapsed category codes (llama.cpp's `k_ucat_cpt`).
const CODE_OTHER: u32 = 0xD0;
const CODE_NUMBER: u32 = 0xD1;
const CODE_LETTER: u32 = 0xD2;
const CODE_PUNCT: u32 = 0xD3;
const CODE_ACCENT: u32 = 0xD4;
const CODE_SYMBOL: u32 = 0xD5;

const ASCII_PUNCT: &str = "!\"#%&'()*,-./:;?@[\\]_{}";

impl CharClass {
    fn new() -> Self {
        Self::default()
    }
    fn chars(mut self, s: &str) -> Self {
        for c in s.chars() {
            self = self.range(c as u32, c as u32);
        }
        self
    }
    fn range(mut self, a: u32, b: u32) -> Self {
        for v in a..=b.min(127) {
            self.ascii |= 1u128 << v;
        }
        if b >= 128 {
            self.ranges.push((a.max(128), b));
        }
        self
    }
    fn space(self) -> Self {
        self.chars("\t\n\x0B\x0C\r ")
    }
    fn code(mut self, code: u32) -> Self {
        self.codes |= 1 << (code - CODE_OTHER);
        self
    }
    /// `\p{N}` on collapsed text.
    fn number() -> Self {
        Self::new().range('0' as u32, '9' as u32).code(CODE_NUMBER)
    }
    /// `\p{L}` on collapsed text.
    fn letter() -> Self {
        Self::new()
            .range('A' as u32, 'Z' as u32)
            .range('a' as u32, 'z' as u32)
            .code(CODE_LETTER)
    }
    /// `\p{P}` on collapsed text.
    fn punct() -> Self {
        Self::new().chars(ASCII_PUNCT).code(CODE_PUNCT)
    }
    /// Literal characters and `a-b` ranges, as written inside `[...]`.
    fn parse(body: &str) -> Self {
        let chars: Vec<char> = body.chars().collect();
        let mut class = Self::new();
        let mut i = 0;
        while i < chars.len() {
            if i + 2 < chars.len() && chars[i + 1] == '-' {
                class = class.range(chars[i] as u32, chars[i + 2] as u32);
                i += 3;
            } else {
                class = class.range(chars[i] as u32, chars[i] as u32);
                i += 1;
            }
        }
        class
    }
    fn negate(mut self) -> Self {
        self.negated = !self.negated;
        self
    }

    /// Whether the class matches `v`, a value of the collapsed view when `collapsed`,
    /// else a codepoint.
    #[inline]
    fn contains(&self, v: u32, collapsed: bool) -> bool {
        let hit = if v < 128 {
            self.ascii >> v & 1 != 0
        } else if collapsed {
            (CODE_OTHER..=CODE_SYMBOL).contains(&v) && self.codes >> (v - CODE_OTHER) & 1 != 0
        } else {
            self.ranges.iter().any(|&(a, b)| a <= v && v <= b)
        };
        hit != self.negated
    }
}

impl Regex {
    fn run(prefix: Option<CharClass>, class: CharClass, repeat: bool, collapsed: bool) -> Pass {
        Pass::Regex(Regex {
            kind: RegexKind::Run {
                prefix,
                class,
                repeat,
            },
            collapsed,
        })
    }

    /// Leftmost match starting at or after `from`, within `view[..end]`.
    fn find(&self, view: &[u32], from: usize, end: usize) -> Option<(usize, usize)> {
        let collapsed = self.collapsed;
        match &self.kind {
            RegexKind::Run {
                prefix,
                class,
                repeat,
            } => {
                let run_end = |mut p: usize| {
                    if *repeat {
                        while p < end && class.contains(view[p], collapsed) {
                            p += 1;
                        }
                        p
                    } else {
                        p + 1
                    }
                };
                for i in from..end {
                    if let Some(prefix) = prefix {
                        if prefix.contains(view[i], collapsed)
                            && i + 1 < end
                            && class.contains(view[i + 1], collapsed)
                        {
                            return Some((i, run_end(i + 1)));
                        }
                    }
                    if class.contains(view[i], collapsed) {
                        return Some((i, run_end(i)));
                    }
                }
                None
            }
            RegexKind::ThreeAsciiDigits => {
                let digit = |v: u32| (b'0' as u32..=b'9' as u32).contains(&v);
                (from..end.saturating_sub(2))
                    .find(|&i| digit(view[i]) && digit(view[i + 1]) && digit(view[i + 2]))
                    .map(|i| (i, i + 3))
            }
            RegexKind::TrailingSpace => {
                let mut t = end;
                while t > from && is_c_space(view[t - 1]) {
                    t -= 1;
                }
                (t < end).then_some((t, end))
            }
        }
    }
}

/// The pass lists of the supported pre-tokenizer types.
pub(crate) mod patterns {
    use super::*;

    /// llama.cpp's `default` BPE pre-tokenizer.
    pub(crate) fn default() -> Vec<Pass> {
        vec![
            Regex::run(None, punct_and_symbols(), true, true),
            Pass::Gpt2,
            Regex::run(None, CharClass::number(), true, true),
            three_digits(),
        ]
    }

    pub(crate) fn falcon() -> Vec<Pass> {
        vec![
            Regex::run(None, punct_and_symbols(), true, true),
            Pass::Gpt2,
            three_digits(),
        ]
    }

    /// starcoder, refact, command-r, smollm, codeshell, exaone, minerva, mellum2.
    pub(crate) fn starcoder() -> Vec<Pass> {
        vec![
            Regex::run(None, CharClass::number(), false, true),
            Pass::Gpt2,
        ]
    }

    pub(crate) fn deepseek_llm() -> Vec<Pass> {
        const LETTERS: &str = "A-Za-zµÀ-ÖØ-öø-ƺƼ-ƿǄ-ʓʕ-ʯͰ-ͳͶͷͻ-ͽͿΆΈ-ΊΌΎ-ΡΣ-ϵϷ-ҁҊ-ԯԱ-ՖႠ-ჅᎠ-Ᏽᏸ-ᏽᲐ-ᲺᲽ-Ჿᴀ-ᴫᵫ-ᵷᵹ-ᶚḀ-ἕἘ-Ἕἠ-ὅὈ-Ὅὐ-ὗὙὛὝὟ-ώᾀ-ᾴᾶ-ᾼιῂ-ῄῆ-ῌῐ-ΐῖ-Ίῠ-Ῥῲ-ῴῶ-ῼℂℇℊ-ℓℕℙ-ℝℤΩℨK-ℭℯ-ℴℹℼ-ℿⅅ-ⅉⅎↃↄⰀ-ⱻⱾ-ⳤⳫ-ⳮⳲⳳꙀ-ꙭꚀ-ꚛꜢ-ꝯꝱ-ꞇꞋ-ꞎꭰ-ꮿﬀ-ﬆﬓ-ﬗＡ-Ｚａ-ｚ𐐀-𐑏𐒰-𐓓𐓘-𐓻𐲀-𐲲𐳀-𐳲𑢠-𑣟𞤀-𞥃";
        const PUNCT: &str = "!-/:-~！-／：-～‘-‟　-。";
        let space = || Some(CharClass::new().space());
        vec![
            Regex::run(None, CharClass::new().chars("\r\n"), false, false),
            Regex::run(space(), CharClass::parse(LETTERS), true, false),
            Regex::run(space(), CharClass::parse(PUNCT), true, false),
            Pass::Regex(Regex {
                kind: RegexKind::TrailingSpace,
                collapsed: false,
            }),
            Regex::run(None, cjk(), true, false),
            Regex::run(None, CharClass::number(), true, true),
        ]
    }

    pub(crate) fn deepseek_coder() -> Vec<Pass> {
        let space = || Some(CharClass::new().space());
        vec![
            Regex::run(None, CharClass::new().chars("\r\n"), false, false),
            Regex::run(space(), CharClass::letter(), true, true),
            Regex::run(space(), CharClass::punct(), true, true),
            Regex::run(None, cjk(), true, false),
            Regex::run(None, CharClass::number(), false, true),
        ]
    }

    /// bloom, poro-chat, gpt3-finnish: ` ?[^(\s|.,!?…。，、।۔،)]+`
    pub(crate) fn bloom() -> Vec<Pass> {
        vec![bloom_words()]
    }

    /// viking: bloom's words, then single digits.
    pub(crate) fn viking() -> Vec<Pass> {
        vec![
            bloom_words(),
            Regex::run(None, CharClass::number(), false, true),
        ]
    }

    fn bloom_words() -> Pass {
        let class = CharClass::new().space().chars("(|.,!?…。，、।۔،)").negate();
        Regex::run(Some(CharClass::new().chars(" ")), class, true, false)
    }

    fn punct_and_symbols() -> CharClass {
        CharClass::punct().chars("$+<=>^~|")
    }

    fn three_digits() -> Pass {
        Pass::Regex(Regex {
            kind: RegexKind::ThreeAsciiDigits,
            collapsed: false,
        })
    }

    fn cjk() -> CharClass {
        CharClass::parse("一-龥ࠀ-一가-퟿")
    }
}

/// A piece of the text being split: codepoints `start..end`.
#[derive(Clone, Copy)]
struct Piece<'a> {
    cpts: &'a [u32],
    start: usize,
    end: usize,
}

impl Piece<'_> {
    #[inline]
    fn cpt(&self, pos: usize) -> u32 {
        if pos < self.end {
            self.cpts[pos]
        } else {
            OUT_OF_RANGE
        }
    }
    #[inline]
    fn flags(&self, pos: usize) -> Flags {
        if pos < self.end {
            unicode::flags(self.cpts[pos])
        } else {
            Flags::NONE
        }
    }
}

/// Collects consecutive word boundaries of one piece.
struct Words<'o> {
    out: &'o mut Vec<(u32, u32)>,
    prev: usize,
}

impl Words<'_> {
    #[inline]
    fn cut(&mut self, end: usize) {
        if end > self.prev {
            self.out.push((self.prev as u32, end as u32));
        }
        self.prev = end;
    }
}

#[inline]
fn is_contraction(c1: u32, c2: u32) -> Option<usize> {
    match char::from_u32(c1) {
        Some('s' | 't' | 'm' | 'd') => Some(2),
        Some('r' | 'v') if c2 == 'e' as u32 => Some(3),
        Some('l') if c2 == 'l' as u32 => Some(3),
        _ => None,
    }
}

/// The GPT-2 pattern, as llama.cpp's `unicode_regex_split_custom_gpt2`.
fn split_gpt2(p: Piece, out: &mut Vec<(u32, u32)>) {
    let mut w = Words { out, prev: p.start };
    let mut pos = p.start;
    while pos < p.end {
        let c = p.cpt(pos);
        let f = p.flags(pos);

        // 's|'t|'re|'ve|'m|'ll|'d
        if c == '\'' as u32 && pos + 1 < p.end {
            let c2 = if pos + 2 < p.end {
                p.cpt(pos + 2)
            } else {
                OUT_OF_RANGE
            };
            match is_contraction(p.cpt(pos + 1), c2) {
                Some(2) => {
                    pos += 2;
                    w.cut(pos);
                    continue;
                }
                Some(_) if pos + 2 < p.end => {
                    pos += 3;
                    w.cut(pos);
                    continue;
                }
                _ => {}
            }
        }

        let space = c == ' ' as u32;
        let mut f2 = if space { p.flags(pos + 1) } else { f };
        let classes: [fn(Flags) -> bool; 3] = [
            |f| f.is_letter(),
            |f| f.is_number(),
            |f| !(f.is_whitespace() || f.is_letter() || f.is_number() || f.is_empty()),
        ];
        // <space>?\p{L}+ | <space>?\p{N}+ | <space>?[^\s\p{L}\p{N}]+
        if let Some(class) = classes.iter().find(|class| class(f2)) {
            pos += space as usize;
            while class(f2) {
                pos += 1;
                f2 = p.flags(pos);
            }
            w.cut(pos);
            continue;
        }

        let mut n_ws = 0;
        while p.flags(pos + n_ws).is_whitespace() {
            n_ws += 1;
        }
        if n_ws > 1 && p.cpt(pos + n_ws) != OUT_OF_RANGE {
            // \s+(?!\S)
            pos += n_ws - 1;
        } else if n_ws > 0 {
            // \s+
            pos += n_ws;
        } else {
            pos += 1;
        }
        w.cut(pos);
    }
}

/// The Llama-3 pattern and its Qwen relatives, as llama.cpp's
/// `unicode_regex_split_custom_llama3` / `_qwen2` / `_qwen35`.
fn split_llama3(p: Piece, three_digits: bool, marks: bool, out: &mut Vec<(u32, u32)>) {
    let mut w = Words { out, prev: p.start };
    let word = |f: Flags| f.is_letter() || (marks && f.is_accent_mark());
    let mut pos = p.start;
    while pos < p.end {
        let c = p.cpt(pos);
        let f = p.flags(pos);

        // (?i:'s|'t|'re|'ve|'m|'ll|'d)
        if c == '\'' as u32 && pos + 1 < p.end {
            let c1 = unicode::to_lower(p.cpt(pos + 1));
            let c2 = if pos + 2 < p.end {
                unicode::to_lower(p.cpt(pos + 2))
            } else {
                OUT_OF_RANGE
            };
            match is_contraction(c1, c2) {
                Some(2) => {
                    pos += 2;
                    w.cut(pos);
                    continue;
                }
                Some(_) if pos + 2 < p.end => {
                    pos += 3;
                    w.cut(pos);
                    continue;
                }
                _ => {}
            }
        }

        // [^\r\n\p{L}\p{N}]?\p{L}+
        let newline = c == '\r' as u32 || c == '\n' as u32;
        if !(newline || f.is_number()) && (word(f) || word(p.flags(pos + 1))) {
            pos += 1;
            while word(p.flags(pos)) {
                pos += 1;
            }
            w.cut(pos);
            continue;
        }

        // \p{N}{1,3} or \p{N}
        if f.is_number() {
            if three_digits {
                let mut ini = pos;
                while p.flags(pos).is_number() {
                    pos += 1;
                    if pos - ini >= 3 {
                        w.cut(pos);
                        ini = pos;
                    }
                }
            } else {
                pos += 1;
            }
            w.cut(pos);
            continue;
        }

        // <space>?[^\s\p{L}\p{N}]+[\r\n]*  (llama.cpp tests the flags of `pos`, not of
        // the character after the space, for emptiness)
        let other = |f: Flags| {
            !(f.is_whitespace() || f.is_letter() || (marks && f.is_accent_mark()) || f.is_number())
        };
        let space = c == ' ' as u32;
        let mut f2 = if space { p.flags(pos + 1) } else { f };
        if other(f2) && !f.is_empty() {
            pos += space as usize;
            while other(f2) && !f2.is_empty() {
                pos += 1;
                f2 = p.flags(pos);
            }
            while matches!(char::from_u32(p.cpt(pos)), Some('\r' | '\n')) {
                pos += 1;
            }
            w.cut(pos);
            continue;
        }

        let mut n_ws = 0;
        let mut last_newline_end = 0;
        while p.flags(pos + n_ws).is_whitespace() {
            if matches!(char::from_u32(p.cpt(pos + n_ws)), Some('\r' | '\n')) {
                last_newline_end = pos + n_ws + 1;
            }
            n_ws += 1;
        }
        if last_newline_end > 0 {
            // \s*[\r\n]+
            pos = last_newline_end;
        } else if n_ws > 1 && p.cpt(pos + n_ws) != OUT_OF_RANGE {
            // \s+(?!\S)
            pos += n_ws - 1;
        } else if n_ws > 0 {
            // \s+
            pos += n_ws;
        } else {
            pos += 1;
        }
        w.cut(pos);
    }
}

/// `[^\n]+|[\n]+`
fn split_newlines(p: Piece, out: &mut Vec<(u32, u32)>) {
    let mut pos = p.start;
    while pos < p.end {
        let nl = p.cpts[pos] == '\n' as u32;
        let start = pos;
        while pos < p.end && (p.cpts[pos] == '\n' as u32) == nl {
            pos += 1;
        }
        out.push((start as u32, pos as u32));
    }
}

/// The text as the emulated `std::regex` sees it.
fn regex_view(cpts: &[u32], collapsed: bool) -> Vec<u32> {
    cpts.iter()
        .map(|&c| {
            if c < 128 {
                return c;
            }
            let f = unicode::flags(c);
            if f.is_whitespace() {
                return 0x0B;
            }
            if !collapsed {
                return c;
            }
            match f.category() {
                Flags::NUMBER => CODE_NUMBER,
                Flags::LETTER => CODE_LETTER,
                Flags::PUNCTUATION => CODE_PUNCT,
                Flags::ACCENT_MARK => CODE_ACCENT,
                Flags::SYMBOL => CODE_SYMBOL,
                _ => CODE_OTHER,
            }
        })
        .collect()
}

/// Splits `text` into words: codepoint ranges, in order, covering the whole text.
pub(crate) fn split(passes: &[Pass], text: &Decoded) -> Vec<(u32, u32)> {
    let cpts = &text.cpts[..];
    let mut pieces: Vec<(u32, u32)> = if cpts.is_empty() {
        Vec::new()
    } else {
        vec![(0, cpts.len() as u32)]
    };
    let mut views: [Option<Vec<u32>>; 2] = [None, None];
    for pass in passes {
        let mut next = Vec::with_capacity(pieces.len() * 2 + 16);
        match pass {
            Pass::Regex(re) => {
                let view = views[re.collapsed as usize]
                    .get_or_insert_with(|| regex_view(cpts, re.collapsed));
                for &(s, e) in &pieces {
                    let (mut pos, end) = (s as usize, e as usize);
                    while let Some((ms, me)) = re.find(view, pos, end) {
                        if ms > pos {
                            next.push((pos as u32, ms as u32));
                        }
                        next.push((ms as u32, me as u32));
                        pos = me;
                    }
                    if pos < end {
                        next.push((pos as u32, end as u32));
                    }
                }
            }
            custom => {
                for &(s, e) in &pieces {
                    let piece = Piece {
                        cpts,
                        start: s as usize,
                        end: e as usize,
                    };
                    match custom {
                        Pass::Gpt2 => split_gpt2(piece, &mut next),
                        Pass::Llama3 => split_llama3(piece, true, false, &mut next),
                        Pass::Qwen2 => split_llama3(piece, false, false, &mut next),
                        Pass::Qwen35 => split_llama3(piece, false, true, &mut next),
                        Pass::Newlines => split_newlines(piece, &mut next),
                        // Handled above.
                        Pass::Regex(_) => next.push((s, e)),
                    }
                }
            }
        }
        pieces = next;
    }
    pieces
}

#[cfg(test)]
mod tests {
    use super::*;

    fn words(passes: &[Pass], s: &str) -> Vec<String> {
        let d = Decoded::new(s.as_bytes());
        split(passes, &d)
            .into_iter()
            .map(|(a, b)| String::from_utf8(d.bytes(a as usize, b as usize).to_vec()).unwrap())
            .collect()
    }

    #[test]
    fn gpt2() {
        assert_eq!(
            words(&[Pass::Gpt2], "Hello world's  3 cats!!\n\n x"),
            ["Hello", " world", "'s", " ", " 3", " cats", "!!", "\n\n", " x"]
        );
    }

    #[test]
    fn llama3() {
        assert_eq!(
            words(&[Pass::Llama3], "I'VE 12345 ok.\n\n  hi"),
            ["I", "'VE", " ", "123", "45", " ok", ".\n\n", " ", " hi"]
        );
    }

    #[test]
    fn default_passes() {
        assert_eq!(
            words(&patterns::default(), "a+b 12345"),
            ["a", "+", "b", " ", "123", "45"]
        );
    }
}
