//! The iteration order of llama.cpp's `std::unordered_map<std::string, llama_token>
//! token_to_id`, as built by GCC's libstdc++.
//!
//! llama.cpp detects EOT and FIM tokens by walking that map and keeping the first
//! candidate it meets (e.g. SmolLM2 has both `<|im_end|>` and `<|endoftext|>`; the
//! map's order decides which one becomes EOT, and for FIM tokens, which one joins the
//! end-of-generation set). To pick the same token from the GGUF metadata alone, this
//! module replays libstdc++'s hash table: `std::_Hash_bytes` (MurmurHash2-64 variant),
//! its prime bucket-count growth, and its bucket-list threading on insert and rehash.

/// `std::hash<std::string>`: libstdc++'s `_Hash_bytes(data, len, 0xc70f6907)` on a
/// 64-bit target.
pub(crate) fn stl_hash(data: &[u8]) -> u64 {
    const MUL: u64 = (0xc6a4_a793u64 << 32) + 0x5bd1_e995;
    let shift_mix = |v: u64| v ^ (v >> 47);
    let len = data.len();
    let aligned = len & !7;
    let mut hash = 0xc70f_6907u64 ^ (len as u64).wrapping_mul(MUL);
    for chunk in data[..aligned].chunks_exact(8) {
        let word = u64::from_le_bytes(chunk.try_into().expect("chunk of 8"));
        hash ^= shift_mix(word.wrapping_mul(MUL)).wrapping_mul(MUL);
        hash = hash.wrapping_mul(MUL);
    }
    if len & 7 != 0 {
        let mut buf = [0u8; 8];
        buf[..len - aligned].copy_from_slice(&data[aligned..]);
        hash ^= u64::from_le_bytes(buf);
        hash = hash.wrapping_mul(MUL);
    }
    hash = shift_mix(hash).wrapping_mul(MUL);
    shift_mix(hash)
}

/// `(size after the insert, new bucket count)`: when libstdc++'s default
/// `_Prime_rehash_policy` (max load factor 1) grows a table filled one insert at a
/// time. Measured with GCC 12; the policy has been stable since GCC 5.
const GROWTH: [(usize, usize); 22] = [
    (1, 13),
    (14, 29),
    (30, 59),
    (60, 127),
    (128, 257),
    (258, 541),
    (542, 1109),
    (1110, 2357),
    (2358, 5087),
    (5088, 10273),
    (10274, 20753),
    (20754, 42043),
    (42044, 85229),
    (85230, 172933),
    (172934, 351061),
    (351062, 712697),
    (712698, 1447153),
    (1447154, 2938679),
    (2938680, 5967347),
    (5967348, 12117689),
    (12117690, 24607243),
    (24607244, 49969847),
];

const NONE: u32 = u32::MAX;
const SENTINEL: u32 = 0;

/// The order in which a `std::unordered_map<std::string, _>` filled with
/// `map[keys[i]] = i` for `i = 0, 1, ...` iterates. Returns, in that order, the index
/// of the first occurrence of each distinct key.
pub(crate) fn iteration_order(keys: &[&[u8]]) -> Vec<usize> {
    use std::collections::hash_map::Entry;
    let mut seen: super::hash::FxHashMap<&[u8], ()> = Default::default();
    // Node 0 is the list head (`_M_before_begin`); node k >= 1 is the k-th distinct key.
    let mut key_of = vec![usize::MAX];
    let mut code = vec![0u64];
    let mut next = vec![NONE];
    let mut buckets: Vec<u32> = vec![NONE];
    let mut growth = GROWTH.iter().peekable();

    for (i, key) in keys.iter().enumerate() {
        match seen.entry(key) {
            Entry::Occupied(_) => continue,
            Entry::Vacant(v) => {
                v.insert(());
            }
        }
        let node = key_of.len() as u32;
        let size_after = node as usize;
        if let Some(&&(at, n_buckets)) = growth.peek() {
            if size_after == at {
                growth.next();
                rehash(&mut buckets, &mut next, &code, n_buckets);
            }
        }
        key_of.push(i);
        code.push(stl_hash(key));
        next.push(NONE);
        let n = buckets.len() as u64;
        let b = (code[node as usize] % n) as usize;
        if buckets[b] != NONE {
            let before = buckets[b] as usize;
            next[node as usize] = next[before];
            next[before] = node;
        } else {
            next[node as usize] = next[SENTINEL as usize];
            next[SENTINEL as usize] = node;
            let after = next[node as usize];
            if after != NONE {
                buckets[(code[after as usize] % n) as usize] = node;
            }
            buckets[b] = SENTINEL;
        }
    }

    let mut order = Vec::with_capacity(key_of.len() - 1);
    let mut p = next[SENTINEL as usize];
    while p != NONE {
        order.push(key_of[p as usize]);
        p = next[p as usize];
    }
    order
}

/// libstdc++'s `_M_rehash_aux` for unique keys.
fn rehash(buckets: &mut Vec<u32>, next: &mut [u32], code: &[u64], n_buckets: usize) {
    let mut fresh = vec![NONE; n_buckets];
    let mut p = next[SENTINEL as usize];
    next[SENTINEL as usize] = NONE;
    let mut begin_bucket = 0usize;
    while p != NONE {
        let after = next[p as usize];
        let b = (code[p as usize] % n_buckets as u64) as usize;
        if fresh[b] == NONE {
            next[p as usize] = next[SENTINEL as usize];
            next[SENTINEL as usize] = p;
            fresh[b] = SENTINEL;
            if next[p as usize] != NONE {
                fresh[begin_bucket] = p;
            }
            begin_bucket = b;
        } else {
            let before = fresh[b] as usize;
            next[p as usize] = next[before];
            next[before] = p;
        }
        p = after;
    }
    *buckets = fresh;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hash_matches_libstdcxx() {
        // Values printed by `std::hash<std::string>` (GCC 12, x86-64).
        assert_eq!(stl_hash(b""), 6142509188972423790);
        assert_eq!(stl_hash(b"a"), 4993892634952068459);
        assert_eq!(stl_hash(b"hello"), 2762169579135187400);
        assert_eq!(stl_hash(b"<|im_end|>"), 2038672007907099973);
        assert_eq!(stl_hash(b"0123456789abcdef0"), 4013166917474506472);
        assert_eq!(stl_hash("\u{2581}the".as_bytes()), 16230366170308768533);
    }

    #[test]
    fn map_order_matches_libstdcxx() {
        // Orders printed by GCC 12's std::unordered_map<std::string, int>.
        let keys: Vec<&[u8]> = vec![b"a", b"b", b"c", b"a"];
        assert_eq!(iteration_order(&keys), vec![2, 1, 0]);

        let owned: Vec<String> = (0..100).map(|i| (i * 7919 % 1000).to_string()).collect();
        let keys: Vec<&[u8]> = owned.iter().map(|s| s.as_bytes()).collect();
        let got: Vec<&str> = iteration_order(&keys)
            .into_iter()
            .map(|i| owned[i].as_str())
            .collect();
        let want = "143 224 305 386 467 548 710 629 953 196 358 439 520 844 925 6 981 87 249 115 \
                    492 654 735 816 59 168 140 514 327 601 894 84 461 330 137 841 542 190 676 947 \
                    352 785 623 0 56 517 866 28 218 34 274 838 489 813 869 595 380 355 788 433 436 \
                    757 408 978 271 975 464 791 109 872 760 112 651 763 573 221 950 570 411 31 246 \
                    165 62 897 3 682 919 922 626 679 732 704 598 193 707 299 545 383 277 302";
        assert_eq!(got, want.split_whitespace().collect::<Vec<_>>());
    }
}
