//! Splitting raw text around special tokens written in it, with the semantics of
//! llama.cpp's `tokenizer_st_partition`.
//!
//! llama.cpp takes the special tokens longest first and, for each, cuts every
//! remaining text fragment at its leftmost non-overlapping occurrences (stripping
//! whitespace next to tokens that carry the lstrip/rstrip attributes). Done literally
//! that costs one scan of the text per special token (Gemma 3 has 6,414). Here one
//! Aho-Corasick pass finds which special tokens occur at all; then either
//!
//! * all their occurrences are collected and replayed in priority order against a
//!   map of claimed bytes (the usual case), or, when occurrences are so dense that
//!   collecting them would cost too much memory (e.g. megabytes of newlines against
//!   Gemma's newline-run tokens),
//! * llama.cpp's procedure is run, but only for the tokens that occur.
//!
//! Both give exactly llama.cpp's fragments. Special tokens of equal length are taken in
//! id order; llama.cpp's order among them is whatever `std::sort` leaves, which only
//! matters when two equal-length special tokens overlap in the text (no shipped vocab
//! has such a pair).

use aho_corasick::automaton::{Automaton, StateID};
use aho_corasick::nfa::contiguous::NFA;
use aho_corasick::{Anchored, MatchKind};

use super::unicode::is_c_space;

/// A piece of the input: raw text, or a special token found in it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Fragment {
    Text { start: usize, end: usize },
    Token(u32),
}

#[derive(Debug, Clone)]
struct Special {
    id: u32,
    text: Box<[u8]>,
    len: usize,
    lstrip: bool,
    rstrip: bool,
    /// Control and unknown tokens are only matched when parsing specials; user-defined
    /// tokens always are.
    needs_parse_special: bool,
}

/// The special tokens of a vocabulary, in llama.cpp's priority order.
#[derive(Clone)]
pub(crate) struct SpecialMatcher {
    specials: Vec<Special>,
    nfa: Option<NFA>,
    strategy: Strategy,
}

impl std::fmt::Debug for SpecialMatcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SpecialMatcher")
            .field("n_specials", &self.specials.len())
            .finish()
    }
}

/// Above this many occurrences per input byte the occurrence list is not built.
const MAX_OCCURRENCES_PER_BYTE: usize = 2;

/// Which strategy [`SpecialMatcher::partition`] uses (tests force one or the other).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Strategy {
    Auto,
    #[cfg(test)]
    Replay,
    #[cfg(test)]
    PerToken,
}

/// Token `id`, its text and its lstrip/rstrip/needs-parse-special attributes.
pub(crate) type SpecialSpec<'a> = (u32, &'a [u8], bool, bool, bool);

impl SpecialMatcher {
    /// `tokens` must already be in priority order (longest text first). Fails only if
    /// the automaton cannot be built (a pattern set beyond aho-corasick's limits).
    pub(crate) fn new(tokens: &[SpecialSpec]) -> Result<Self, String> {
        let specials: Vec<Special> = tokens
            .iter()
            .map(|&(id, text, lstrip, rstrip, needs)| Special {
                id,
                text: text.into(),
                len: text.len(),
                lstrip,
                rstrip,
                needs_parse_special: needs,
            })
            .collect();
        let nfa = if tokens.is_empty() {
            None
        } else {
            let nfa = NFA::builder()
                .match_kind(MatchKind::Standard)
                .build(tokens.iter().map(|t| t.1))
                .map_err(|e| e.to_string())?;
            // Unanchored search is what the scans below use; check it once here.
            nfa.start_state(Anchored::No).map_err(|e| e.to_string())?;
            Some(nfa)
        };
        Ok(Self {
            specials,
            nfa,
            strategy: Strategy::Auto,
        })
    }

    fn max_occurrences(&self, text_len: usize) -> usize {
        match self.strategy {
            Strategy::Auto => MAX_OCCURRENCES_PER_BYTE * text_len + 1024,
            #[cfg(test)]
            Strategy::Replay => usize::MAX,
            #[cfg(test)]
            Strategy::PerToken => 0,
        }
    }

    /// Splits `text` into fragments. Empty text gives no fragment.
    pub(crate) fn partition(&self, text: &[u8], parse_special: bool) -> Vec<Fragment> {
        let whole = || {
            if text.is_empty() {
                Vec::new()
            } else {
                vec![Fragment::Text {
                    start: 0,
                    end: text.len(),
                }]
            }
        };
        let Some(nfa) = &self.nfa else {
            return whole();
        };
        if text.is_empty() {
            return whole();
        }
        let eligible = |rank: usize| parse_special || !self.specials[rank].needs_parse_special;

        // Pass 1: which ranks occur, and how many occurrences in all.
        let mut present = vec![false; self.specials.len()];
        let mut total = 0usize;
        let mut seen_states: super::hash::FxHashMap<u32, usize> = Default::default();
        let Ok(start) = nfa.start_state(Anchored::No) else {
            return whole();
        };
        let mut sid = start;
        for &b in text {
            sid = nfa.next_state(Anchored::No, sid, b);
            if nfa.is_match(sid) {
                let key = sid.as_u32();
                let count = match seen_states.get(&key) {
                    Some(&c) => c,
                    None => {
                        let mut c = 0;
                        for i in 0..nfa.match_len(sid) {
                            let rank = nfa.match_pattern(sid, i).as_usize();
                            if eligible(rank) {
                                present[rank] = true;
                                c += 1;
                            }
                        }
                        seen_states.insert(key, c);
                        c
                    }
                };
                total += count;
            }
        }
        if total == 0 {
            return whole();
        }

        let placements = if total <= self.max_occurrences(text.len()) {
            self.replay(nfa, start, text, &eligible, total)
        } else {
            self.per_token(text, &present)
        };
        assemble(placements)
    }

    /// Collects every eligible occurrence and accepts them in priority order.
    fn replay(
        &self,
        nfa: &NFA,
        start: StateID,
        text: &[u8],
        eligible: &dyn Fn(usize) -> bool,
        total: usize,
    ) -> Placements {
        let mut occ: Vec<(u32, usize)> = Vec::with_capacity(total);
        let mut sid = start;
        for (pos, &b) in text.iter().enumerate() {
            sid = nfa.next_state(Anchored::No, sid, b);
            if nfa.is_match(sid) {
                for i in 0..nfa.match_len(sid) {
                    let rank = nfa.match_pattern(sid, i).as_usize();
                    if eligible(rank) {
                        let start = pos + 1 - self.specials[rank].len;
                        occ.push((rank as u32, start));
                    }
                }
            }
        }
        occ.sort_unstable();

        let mut claimed = vec![false; text.len()];
        let mut tokens = Vec::new();
        for (rank, start) in occ {
            let sp = &self.specials[rank as usize];
            let end = start + sp.len;
            if claimed[start..end].iter().any(|&c| c) {
                continue;
            }
            claimed[start..end].fill(true);
            tokens.push((start, end, sp.id));
            if sp.lstrip {
                let mut p = start;
                while p > 0 && !claimed[p - 1] && is_c_space(text[p - 1] as u32) {
                    p -= 1;
                    claimed[p] = true;
                }
            }
            if sp.rstrip {
                let mut p = end;
                while p < text.len() && !claimed[p] && is_c_space(text[p] as u32) {
                    claimed[p] = true;
                    p += 1;
                }
            }
        }
        // Text is whatever was not claimed by a token or stripped next to one.
        let mut free = Vec::new();
        let mut p = 0;
        while p < text.len() {
            if claimed[p] {
                p += 1;
                continue;
            }
            let s = p;
            while p < text.len() && !claimed[p] {
                p += 1;
            }
            free.push((s, p));
        }
        Placements { tokens, free }
    }

    /// llama.cpp's procedure restricted to the tokens that occur: for each, cut the
    /// free segments at its leftmost non-overlapping occurrences.
    fn per_token(&self, text: &[u8], present: &[bool]) -> Placements {
        let mut free = vec![(0usize, text.len())];
        let mut tokens = Vec::new();
        for (rank, sp) in self.specials.iter().enumerate() {
            if !present[rank] {
                continue;
            }
            let finder = memchr::memmem::Finder::new(&sp.text);
            let mut next_free = Vec::with_capacity(free.len() + 4);
            for &(seg_start, seg_end) in &free {
                let mut base = seg_start;
                loop {
                    let hit = if seg_end - base >= sp.len {
                        finder.find(&text[base..seg_end]).map(|i| base + i)
                    } else {
                        None
                    };
                    let Some(m) = hit else {
                        if base < seg_end {
                            next_free.push((base, seg_end));
                        }
                        break;
                    };
                    let mut left_end = m;
                    if sp.lstrip {
                        while left_end > base && is_c_space(text[left_end - 1] as u32) {
                            left_end -= 1;
                        }
                    }
                    if left_end > base {
                        next_free.push((base, left_end));
                    }
                    tokens.push((m, m + sp.len, sp.id));
                    let mut right = m + sp.len;
                    if right < seg_end && sp.rstrip {
                        while right < seg_end && is_c_space(text[right] as u32) {
                            right += 1;
                        }
                    }
                    base = right;
                    if base >= seg_end {
                        break;
                    }
                }
            }
            free = next_free;
        }
        Placements { tokens, free }
    }
}

struct Placements {
    /// `(start, end, id)` of each accepted token.
    tokens: Vec<(usize, usize, u32)>,
    /// Text segments left, in order.
    free: Vec<(usize, usize)>,
}

fn assemble(mut p: Placements) -> Vec<Fragment> {
    p.tokens.sort_unstable_by_key(|t| t.0);
    let mut out = Vec::with_capacity(p.tokens.len() + p.free.len());
    let (mut i, mut j) = (0, 0);
    while i < p.tokens.len() || j < p.free.len() {
        let take_token = match (p.tokens.get(i), p.free.get(j)) {
            (Some(t), Some(f)) => t.0 < f.0,
            (Some(_), None) => true,
            _ => false,
        };
        if take_token {
            out.push(Fragment::Token(p.tokens[i].2));
            i += 1;
        } else {
            let (start, end) = p.free[j];
            out.push(Fragment::Text { start, end });
            j += 1;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// llama.cpp's `tokenizer_st_partition`, transcribed literally, as the reference.
    fn reference(
        text: &[u8],
        specs: &[(u32, Vec<u8>, bool, bool, bool)],
        parse_special: bool,
    ) -> Vec<Fragment> {
        #[derive(Clone)]
        enum F {
            Raw(usize, usize),
            Tok(u32),
        }
        let mut buf = if text.is_empty() {
            vec![]
        } else {
            vec![F::Raw(0, text.len())]
        };
        for (id, tt, lstrip, rstrip, needs) in specs {
            if !parse_special && *needs {
                continue;
            }
            let mut i = 0;
            while i < buf.len() {
                let F::Raw(mut off, mut len) = buf[i] else {
                    i += 1;
                    continue;
                };
                let mut replacement = Vec::new();
                loop {
                    let hay = &text[off..off + len];
                    let Some(m) = hay
                        .windows(tt.len())
                        .position(|w| w == &tt[..])
                        .map(|p| p + off)
                    else {
                        replacement.push(F::Raw(off, len));
                        break;
                    };
                    if m > off {
                        let mut l = m - off;
                        if *lstrip {
                            while l > 0 && is_c_space(text[off + l - 1] as u32) {
                                l -= 1;
                            }
                        }
                        if l > 0 {
                            replacement.push(F::Raw(off, l));
                        }
                    }
                    replacement.push(F::Tok(*id));
                    if m + tt.len() < off + len {
                        let mut r_off = m + tt.len();
                        let mut r_len = len - (m - off) - tt.len();
                        if *rstrip {
                            while r_len > 0 && is_c_space(text[r_off] as u32) {
                                r_off += 1;
                                r_len -= 1;
                            }
                        }
                        if r_len == 0 {
                            break;
                        }
                        off = r_off;
                        len = r_len;
                    } else {
                        break;
                    }
                }
                let n = replacement.len();
                buf.splice(i..i + 1, replacement);
                i += n;
            }
        }
        buf.into_iter()
            .map(|f| match f {
                F::Raw(s, l) => Fragment::Text {
                    start: s,
                    end: s + l,
                },
                F::Tok(id) => Fragment::Token(id),
            })
            .collect()
    }

    #[test]
    fn both_strategies_match_llama_cpp() {
        let mut x = 0x2545_F491_4F6C_DD1Du64;
        let mut rnd = move |n: u64| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % n
        };
        let alphabet = b"ab <>|\n\t";
        for round in 0..2000 {
            // A few specials over a tiny alphabet so that they overlap a lot.
            let mut specs: Vec<(u32, Vec<u8>, bool, bool, bool)> = Vec::new();
            for id in 0..(1 + rnd(6)) as u32 {
                let len = 1 + rnd(4) as usize;
                let t: Vec<u8> = (0..len)
                    .map(|_| alphabet[rnd(alphabet.len() as u64) as usize])
                    .collect();
                if specs.iter().any(|s| s.1 == t) {
                    continue;
                }
                specs.push((id, t, rnd(3) == 0, rnd(3) == 0, rnd(2) == 0));
            }
            specs.sort_by_key(|s| std::cmp::Reverse(s.1.len()));
            let text: Vec<u8> = (0..rnd(40))
                .map(|_| alphabet[rnd(alphabet.len() as u64) as usize])
                .collect();
            let views: Vec<SpecialSpec> = specs
                .iter()
                .map(|s| (s.0, &s.1[..], s.2, s.3, s.4))
                .collect();
            for parse_special in [false, true] {
                let want = reference(&text, &specs, parse_special);
                for strategy in [Strategy::Replay, Strategy::PerToken] {
                    let mut m = SpecialMatcher::new(&views).unwrap();
                    m.strategy = strategy;
                    let got = m.partition(&text, parse_special);
                    assert_eq!(
                        got,
                        want,
                        "round {round} {strategy:?} text {:?} specs {specs:?}",
                        String::from_utf8_lossy(&text)
                    );
                }
            }
        }
    }
}
