//! The work queue of the merge loops: a min-queue of `u64` keys (priority in the high
//! half, symbol position in the low half, so ties go to the leftmost pair) with a
//! `u32` payload.
//!
//! Short sequences use a binary heap. Long ones (a 10 MiB line without spaces is one
//! BPE word; SentencePiece sees whole lines) use a radix heap: merging pops keys that
//! mostly increase, which a radix heap serves with sequential memory access, where a
//! binary heap of millions of entries spends its time in cache misses (~40 s for 10
//! MiB of one word). Keys pushed below the last key popped, which happen when a merge
//! creates a pair of higher priority, go to a side binary heap; pops take the smaller
//! head of the two, so the order is exact either way.

/// Above this many symbols, the radix heap.
const RADIX_THRESHOLD: usize = 4096;

#[derive(Default)]
pub(crate) struct Queue {
    small: BinaryHeap<Reverse<(u64, u32)>>,
    big: MergeQueue,
    use_big: bool,
}

impl Queue {
    /// Empties the queue for a sequence of `n` symbols.
    pub(crate) fn reset(&mut self, n: usize) {
        self.small.clear();
        if self.use_big {
            self.big.clear();
        }
        self.use_big = n > RADIX_THRESHOLD;
    }

    #[inline]
    pub(crate) fn push(&mut self, key: u64, payload: u32) {
        if self.use_big {
            self.big.push(key, payload);
        } else {
            self.small.push(Reverse((key, payload)));
        }
    }

    #[inline]
    pub(crate) fn pop(&mut self) -> Option<(u64, u32)> {
        if self.use_big {
            self.big.pop()
        } else {
            self.small.pop().map(|e| e.0)
        }
    }
}

use std::cmp::Reverse;
use std::collections::BinaryHeap;

struct MergeQueue {
    last: u64,
    /// `buckets[i]` holds keys whose highest bit differing from `last` is bit `i - 1`;
    /// `buckets[0]` holds keys equal to `last`.
    buckets: Vec<Vec<(u64, u32)>>,
    overflow: BinaryHeap<Reverse<(u64, u32)>>,
}

impl Default for MergeQueue {
    fn default() -> Self {
        Self {
            last: 0,
            buckets: (0..65).map(|_| Vec::new()).collect(),
            overflow: BinaryHeap::new(),
        }
    }
}

impl MergeQueue {
    fn clear(&mut self) {
        self.last = 0;
        for b in &mut self.buckets {
            b.clear();
        }
        self.overflow.clear();
    }

    #[inline]
    fn bucket(&self, key: u64) -> usize {
        (64 - (key ^ self.last).leading_zeros()) as usize
    }

    #[inline]
    fn push(&mut self, key: u64, payload: u32) {
        if key < self.last {
            self.overflow.push(Reverse((key, payload)));
        } else {
            let b = self.bucket(key);
            self.buckets[b].push((key, payload));
        }
    }

    fn pop(&mut self) -> Option<(u64, u32)> {
        if self.buckets[0].is_empty() {
            self.refill();
        }
        let radix = self.buckets[0].last().map(|e| e.0);
        let over = self.overflow.peek().map(|e| e.0 .0);
        match (radix, over) {
            (Some(r), Some(o)) if o < r => self.overflow.pop().map(|e| e.0),
            (Some(_), _) => self.buckets[0].pop(),
            (None, Some(_)) => self.overflow.pop().map(|e| e.0),
            (None, None) => None,
        }
    }

    /// Moves the smallest radix keys into bucket 0.
    fn refill(&mut self) {
        let Some(i) = (1..self.buckets.len()).find(|&i| !self.buckets[i].is_empty()) else {
            return;
        };
        let items = std::mem::take(&mut self.buckets[i]);
        self.last = items.iter().map(|e| e.0).min().unwrap_or(self.last);
        for e in &items {
            let b = self.bucket(e.0);
            self.buckets[b].push(*e);
        }
        // Keep the allocation for reuse.
        let mut items = items;
        items.clear();
        if self.buckets[i].is_empty() {
            self.buckets[i] = items;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pops_in_key_order_even_when_keys_go_back() {
        let mut q = MergeQueue::default();
        let mut reference = BinaryHeap::new();
        let mut x = 12345u64;
        let mut rnd = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for i in 0..20_000u32 {
            let k = rnd() % 5000;
            q.push(k, i);
            reference.push(Reverse(k));
            if rnd() % 3 == 0 {
                let got = q.pop().map(|e| e.0);
                let want = reference.pop().map(|e| e.0);
                assert_eq!(got, want);
            }
        }
        while let Some(Reverse(want)) = reference.pop() {
            assert_eq!(q.pop().map(|e| e.0), Some(want));
        }
        assert_eq!(q.pop(), None);
    }
}
