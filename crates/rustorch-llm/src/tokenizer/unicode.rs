//! Codepoint classification and UTF-8 handling with llama.cpp's exact semantics
//! (`src/unicode.cpp`): its category table, its lenient decoder and its GPT-2 byte map.

use std::sync::OnceLock;

use super::unicode_data::{LOWERCASE, RANGES_FLAGS, RANGES_NFD, WHITESPACE};

/// One past the largest codepoint in the tables.
const MAX_CODEPOINTS: u32 = 0x11_0000;

/// The replacement character llama.cpp substitutes for undecodable bytes.
pub(crate) const REPLACEMENT: u32 = 0xFFFD;

/// Category bits of a codepoint, as llama.cpp's `unicode_cpt_flags` (only the bits the
/// tokenizers read are kept).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Flags(u16);

impl Flags {
    pub(crate) const UNDEFINED: u16 = 0x0001;
    pub(crate) const NUMBER: u16 = 0x0002;
    pub(crate) const LETTER: u16 = 0x0004;
    pub(crate) const ACCENT_MARK: u16 = 0x0010;
    pub(crate) const PUNCTUATION: u16 = 0x0020;
    pub(crate) const SYMBOL: u16 = 0x0040;
    pub(crate) const CONTROL: u16 = 0x0080;
    pub(crate) const CATEGORIES: u16 = 0x00FF;
    pub(crate) const WHITESPACE: u16 = 0x0100;

    /// Flags of a position outside the text being scanned: no bit set.
    pub(crate) const NONE: Flags = Flags(0);

    #[inline]
    pub(crate) fn is_empty(self) -> bool {
        self.0 == 0
    }
    #[inline]
    pub(crate) fn is_number(self) -> bool {
        self.0 & Self::NUMBER != 0
    }
    #[inline]
    pub(crate) fn is_letter(self) -> bool {
        self.0 & Self::LETTER != 0
    }
    #[inline]
    pub(crate) fn is_accent_mark(self) -> bool {
        self.0 & Self::ACCENT_MARK != 0
    }
    #[inline]
    pub(crate) fn is_punctuation(self) -> bool {
        self.0 & Self::PUNCTUATION != 0
    }
    #[inline]
    pub(crate) fn is_symbol(self) -> bool {
        self.0 & Self::SYMBOL != 0
    }
    #[inline]
    pub(crate) fn is_control(self) -> bool {
        self.0 & Self::CONTROL != 0
    }
    #[inline]
    pub(crate) fn is_whitespace(self) -> bool {
        self.0 & Self::WHITESPACE != 0
    }
    /// The category bits alone (llama.cpp's `category_flag()`).
    #[inline]
    pub(crate) fn category(self) -> u16 {
        self.0 & Self::CATEGORIES
    }
}

fn flags_table() -> &'static [u16] {
    static TABLE: OnceLock<Vec<u16>> = OnceLock::new();
    TABLE.get_or_init(|| {
        let mut table = vec![Flags::UNDEFINED; MAX_CODEPOINTS as usize];
        let ranges: Vec<(u32, u16)> = RANGES_FLAGS
            .chunks_exact(2)
            .map(|p| (p[0], p[1] as u16))
            .collect();
        for w in ranges.windows(2) {
            let (start, flags) = w[0];
            let end = w[1].0.min(MAX_CODEPOINTS);
            for slot in &mut table[start as usize..end as usize] {
                *slot = flags;
            }
        }
        for &cpt in WHITESPACE.iter() {
            table[cpt as usize] |= Flags::WHITESPACE;
        }
        table
    })
}

/// Flags of a codepoint; codepoints beyond U+10FFFF are undefined.
#[inline]
pub(crate) fn flags(cpt: u32) -> Flags {
    match flags_table().get(cpt as usize) {
        Some(&f) => Flags(f),
        None => Flags(Flags::UNDEFINED),
    }
}

/// Simple one-to-one lowercase mapping (llama.cpp's `unicode_tolower`).
pub(crate) fn to_lower(cpt: u32) -> u32 {
    if cpt < 0x80 {
        return (cpt as u8).to_ascii_lowercase() as u32;
    }
    let n = LOWERCASE.len() / 2;
    let (mut lo, mut hi) = (0usize, n);
    while lo < hi {
        let mid = (lo + hi) / 2;
        let key = LOWERCASE[2 * mid];
        if key == cpt {
            return LOWERCASE[2 * mid + 1];
        }
        if key < cpt {
            lo = mid + 1;
        } else {
            hi = mid;
        }
    }
    cpt
}

/// llama.cpp's one-codepoint NFD approximation: the first codepoint of the
/// decomposition.
pub(crate) fn nfd_first(cpt: u32) -> u32 {
    let n = RANGES_NFD.len() / 3;
    // Last range whose first codepoint is <= cpt.
    let (mut lo, mut hi) = (0usize, n);
    while lo < hi {
        let mid = (lo + hi) / 2;
        if RANGES_NFD[3 * mid] <= cpt {
            lo = mid + 1;
        } else {
            hi = mid;
        }
    }
    if lo == 0 {
        return cpt;
    }
    let i = lo - 1;
    let (first, last, nfd) = (
        RANGES_NFD[3 * i],
        RANGES_NFD[3 * i + 1],
        RANGES_NFD[3 * i + 2],
    );
    if first <= cpt && cpt <= last {
        nfd
    } else {
        cpt
    }
}

/// Number of bytes llama.cpp assumes from a UTF-8 lead byte (`unicode_len_utf8`):
/// 1 for ASCII and stray continuation bytes, then 2, 3, 4.
#[inline]
pub(crate) fn utf8_len_from_lead(b: u8) -> usize {
    const LOOKUP: [u8; 16] = [1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 3, 4];
    LOOKUP[(b >> 4) as usize] as usize
}

/// Decodes one codepoint at `bytes[pos..]` like llama.cpp's `unicode_cpt_from_utf8`:
/// continuation bytes are checked but overlong forms and surrogates are accepted, and
/// four-byte forms may exceed U+10FFFF. Returns `None` where llama.cpp throws.
#[inline]
pub(crate) fn decode_one(bytes: &[u8], pos: usize) -> Option<(u32, usize)> {
    let b0 = *bytes.get(pos)? as u32;
    let cont = |k: usize| -> Option<u32> {
        let b = *bytes.get(pos + k)?;
        (b & 0xC0 == 0x80).then_some((b & 0x3F) as u32)
    };
    if b0 & 0x80 == 0 {
        return Some((b0, 1));
    }
    if b0 & 0x40 == 0 {
        return None;
    }
    if b0 & 0x20 == 0 {
        let c1 = cont(1)?;
        return Some(((b0 & 0x1F) << 6 | c1, 2));
    }
    if b0 & 0x10 == 0 {
        let (c1, c2) = (cont(1)?, cont(2)?);
        return Some(((b0 & 0x0F) << 12 | c1 << 6 | c2, 3));
    }
    if b0 & 0x08 == 0 {
        let (c1, c2, c3) = (cont(1)?, cont(2)?, cont(3)?);
        return Some(((b0 & 0x07) << 18 | c1 << 12 | c2 << 6 | c3, 4));
    }
    None
}

/// Appends the UTF-8 form of `cpt` (any value up to U+10FFFF, surrogates included,
/// the way llama.cpp's `unicode_cpt_to_utf8` writes them).
#[inline]
pub(crate) fn push_utf8(out: &mut Vec<u8>, cpt: u32) {
    if cpt <= 0x7F {
        out.push(cpt as u8);
    } else if cpt <= 0x7FF {
        out.extend_from_slice(&[0xC0 | (cpt >> 6) as u8, 0x80 | (cpt & 0x3F) as u8]);
    } else if cpt <= 0xFFFF {
        out.extend_from_slice(&[
            0xE0 | (cpt >> 12) as u8,
            0x80 | ((cpt >> 6) & 0x3F) as u8,
            0x80 | (cpt & 0x3F) as u8,
        ]);
    } else {
        out.extend_from_slice(&[
            0xF0 | ((cpt >> 18) & 0x07) as u8,
            0x80 | ((cpt >> 12) & 0x3F) as u8,
            0x80 | ((cpt >> 6) & 0x3F) as u8,
            0x80 | (cpt & 0x3F) as u8,
        ]);
    }
}

/// Text decoded into codepoints, with the re-encoded UTF-8 the BPE and WPM tokenizers
/// work on. Undecodable bytes become U+FFFD one byte at a time (llama.cpp's
/// `unicode_cpts_from_utf8`); codepoints above U+10FFFF, where llama.cpp throws, become
/// one U+FFFD for the whole sequence.
pub(crate) struct Decoded<'a> {
    pub cpts: Vec<u32>,
    /// `offsets[i]` is the byte offset of codepoint `i` in `utf8`; one extra entry
    /// holds the total length.
    pub offsets: Vec<u32>,
    pub utf8: std::borrow::Cow<'a, [u8]>,
}

impl<'a> Decoded<'a> {
    pub(crate) fn new(bytes: &'a [u8]) -> Self {
        let mut cpts = Vec::with_capacity(bytes.len());
        let mut offsets = Vec::with_capacity(bytes.len() + 1);
        if let Ok(s) = std::str::from_utf8(bytes) {
            for (i, c) in s.char_indices() {
                cpts.push(c as u32);
                offsets.push(i as u32);
            }
            offsets.push(bytes.len() as u32);
            return Self {
                cpts,
                offsets,
                utf8: std::borrow::Cow::Borrowed(bytes),
            };
        }
        let mut utf8 = Vec::with_capacity(bytes.len() + 16);
        let mut pos = 0;
        while pos < bytes.len() {
            let (cpt, len) = match decode_one(bytes, pos) {
                Some((c, len)) if c < MAX_CODEPOINTS => (c, len),
                Some((_, len)) => (REPLACEMENT, len),
                None => (REPLACEMENT, 1),
            };
            offsets.push(utf8.len() as u32);
            cpts.push(cpt);
            push_utf8(&mut utf8, cpt);
            pos += len;
        }
        offsets.push(utf8.len() as u32);
        Self {
            cpts,
            offsets,
            utf8: std::borrow::Cow::Owned(utf8),
        }
    }

    /// The UTF-8 bytes of codepoints `start..end`.
    #[inline]
    pub(crate) fn bytes(&self, start: usize, end: usize) -> &[u8] {
        &self.utf8[self.offsets[start] as usize..self.offsets[end] as usize]
    }
}

/// Codepoints of `bytes` with llama.cpp's replacement rules (see [`Decoded`]).
pub(crate) fn codepoints(bytes: &[u8]) -> Vec<u32> {
    Decoded::new(bytes).cpts
}

/// GPT-2's byte-to-unicode table: printable Latin-1 bytes map to themselves, the other
/// 68 bytes to U+0100.. in byte order.
pub(crate) fn byte_to_unicode() -> &'static [u32; 256] {
    static MAP: OnceLock<[u32; 256]> = OnceLock::new();
    MAP.get_or_init(|| {
        let mut map = [0u32; 256];
        let mut n = 0;
        for (b, slot) in map.iter_mut().enumerate() {
            let printable = (0x21..=0x7E).contains(&b)
                || (0xA1..=0xAC).contains(&b)
                || (0xAE..=0xFF).contains(&b);
            *slot = if printable {
                b as u32
            } else {
                n += 1;
                255 + n
            };
        }
        map
    })
}

/// Inverse of [`byte_to_unicode`]: `None` for codepoints outside the table.
pub(crate) fn unicode_to_byte(cpt: u32) -> Option<u8> {
    static MAP: OnceLock<Vec<i16>> = OnceLock::new();
    let map = MAP.get_or_init(|| {
        let mut inv = vec![-1i16; 0x144];
        for (b, &c) in byte_to_unicode().iter().enumerate() {
            inv[c as usize] = b as i16;
        }
        inv
    });
    map.get(cpt as usize)
        .and_then(|&b| u8::try_from(b).ok().filter(|_| b >= 0))
}

/// C `isspace` in the "C" locale, which llama.cpp uses for lstrip/rstrip and
/// `std::regex`'s `\s`.
#[inline]
pub(crate) fn is_c_space(b: u32) -> bool {
    matches!(b, 0x09..=0x0D | 0x20)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn categories() {
        assert!(flags('a' as u32).is_letter());
        assert!(flags('5' as u32).is_number());
        assert!(flags(' ' as u32).is_whitespace());
        assert!(flags(0x3000).is_whitespace());
        assert!(flags(0x0301).is_accent_mark());
        assert!(flags('!' as u32).is_punctuation());
        assert!(flags('$' as u32).is_symbol());
        assert!(!flags(0x1C).is_whitespace());
        assert_eq!(flags(0x11_0000), Flags(Flags::UNDEFINED));
    }

    #[test]
    fn lowercase_and_nfd() {
        assert_eq!(to_lower('A' as u32), 'a' as u32);
        assert_eq!(to_lower(0x0391), 0x03B1);
        assert_eq!(to_lower('x' as u32), 'x' as u32);
        assert_eq!(nfd_first(0xC4), 'A' as u32);
        assert_eq!(nfd_first('z' as u32), 'z' as u32);
    }

    #[test]
    fn lenient_decoding() {
        let d = Decoded::new(b"a\xffb\xe4\xb8");
        assert_eq!(
            d.cpts,
            vec![0x61, REPLACEMENT, 0x62, REPLACEMENT, REPLACEMENT]
        );
        // Surrogates decode and re-encode unchanged, as in llama.cpp.
        let d = Decoded::new(b"\xed\xa0\x80");
        assert_eq!(d.cpts, vec![0xD800]);
        assert_eq!(&*d.utf8, b"\xed\xa0\x80");
    }

    #[test]
    fn byte_map_round_trip() {
        for b in 0..=255u8 {
            assert_eq!(unicode_to_byte(byte_to_unicode()[b as usize]), Some(b));
        }
        assert_eq!(byte_to_unicode()[b' ' as usize], 0x120);
    }
}
