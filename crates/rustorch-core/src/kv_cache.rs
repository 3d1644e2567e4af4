//! The key/value cache: per sequence, a list of cells each holding the position it was
//! written at and, per layer, its key and value vectors (f16, like llama.cpp's default
//! cache type). Attention looks at the cells of the query's sequence whose position is
//! not after the query's, so the cache never needs positions to be contiguous.

use std::collections::BTreeMap;

use crate::quant::{f16_to_f32, f32_to_f16, f32_to_f16_row};

/// Identifies a sequence (a conversation, a server slot) in a batch and in the cache.
pub type SeqId = u32;

#[derive(Debug, Default, Clone)]
pub struct SeqCells {
    pub pos: Vec<u32>,
    /// per layer: `pos.len() * kv_dim` keys, row per cell (already rotated)
    pub k: Vec<Vec<u16>>,
    /// per layer: values, row per cell
    pub v: Vec<Vec<u16>>,
}

/// Key/value cache for all sequences, holding at most `n_ctx` cells in total.
#[derive(Debug, Clone)]
pub struct KvCache {
    n_layer: usize,
    kv_dim: usize,
    n_ctx: usize,
    seqs: BTreeMap<SeqId, SeqCells>,
}

/// Why the cache refused an operation.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KvCacheError {
    #[error(
        "context is full: {used} of {n_ctx} cells used, {needed} more needed (raise --ctx-size)"
    )]
    Full {
        n_ctx: usize,
        used: usize,
        needed: usize,
    },
}

impl KvCache {
    pub fn new(n_layer: usize, kv_dim: usize, n_ctx: usize) -> Self {
        KvCache {
            n_layer,
            kv_dim,
            n_ctx,
            seqs: BTreeMap::new(),
        }
    }

    /// Total cells (tokens) the cache may hold.
    pub fn n_ctx(&self) -> usize {
        self.n_ctx
    }

    /// Cells in use across all sequences.
    pub fn used(&self) -> usize {
        self.seqs.values().map(|s| s.pos.len()).sum()
    }

    /// Cells held by sequence `seq`.
    pub fn seq_len(&self, seq: SeqId) -> usize {
        self.seqs.get(&seq).map_or(0, |s| s.pos.len())
    }

    /// Largest position stored for `seq`, if any.
    pub fn seq_pos_max(&self, seq: SeqId) -> Option<u32> {
        self.seqs
            .get(&seq)
            .and_then(|s| s.pos.iter().copied().max())
    }

    pub fn check_room(&self, needed: usize) -> Result<(), KvCacheError> {
        let used = self.used();
        if used + needed > self.n_ctx {
            return Err(KvCacheError::Full {
                n_ctx: self.n_ctx,
                used,
                needed,
            });
        }
        Ok(())
    }

    /// Appends a cell for `seq` at `pos`; returns its index. K/V rows are zero until written.
    pub fn add_cell(&mut self, seq: SeqId, pos: u32) -> usize {
        let (n_layer, kv_dim) = (self.n_layer, self.kv_dim);
        let s = self.seqs.entry(seq).or_insert_with(|| SeqCells {
            pos: Vec::new(),
            k: vec![Vec::new(); n_layer],
            v: vec![Vec::new(); n_layer],
        });
        // a token written again at a position replaces the old cell
        if let Some(i) = s.pos.iter().position(|&p| p == pos) {
            return i;
        }
        s.pos.push(pos);
        for l in 0..n_layer {
            s.k[l].resize(s.pos.len() * kv_dim, 0);
            s.v[l].resize(s.pos.len() * kv_dim, 0);
        }
        s.pos.len() - 1
    }

    pub fn write(&mut self, seq: SeqId, cell: usize, layer: usize, k: &[f32], v: &[f32]) {
        let d = self.kv_dim;
        if let Some(s) = self.seqs.get_mut(&seq) {
            f32_to_f16_row(k, &mut s.k[layer][cell * d..(cell + 1) * d]);
            f32_to_f16_row(v, &mut s.v[layer][cell * d..(cell + 1) * d]);
        }
    }

    pub fn seq(&self, seq: SeqId) -> Option<&SeqCells> {
        self.seqs.get(&seq)
    }

    pub fn kv_dim(&self) -> usize {
        self.kv_dim
    }

    /// Removes the cells of `seq` with position in `p0..p1` (`None` = unbounded), like
    /// `llama_memory_seq_rm`.
    pub fn seq_rm(&mut self, seq: SeqId, p0: Option<u32>, p1: Option<u32>) {
        let d = self.kv_dim;
        let Some(s) = self.seqs.get_mut(&seq) else {
            return;
        };
        let keep: Vec<bool> = s
            .pos
            .iter()
            .map(|&p| !(p0.is_none_or(|a| p >= a) && p1.is_none_or(|b| p < b)))
            .collect();
        retain_cells(s, &keep, d);
        if s.pos.is_empty() {
            self.seqs.remove(&seq);
        }
    }

    /// Drops every sequence but `seq`.
    pub fn seq_keep(&mut self, seq: SeqId) {
        self.seqs.retain(|&s, _| s == seq);
    }

    /// Forgets everything.
    pub fn clear(&mut self) {
        self.seqs.clear();
    }

    /// Copies the cells of `src` into `dst` (replacing `dst`).
    pub fn seq_cp(&mut self, src: SeqId, dst: SeqId) {
        if let Some(s) = self.seqs.get(&src).cloned() {
            self.seqs.insert(dst, s);
        }
    }

    /// Gives `dst` a copy of the cells of `src` with position in `p0..p1` (`None` =
    /// unbounded), after removing what `dst` held at those positions, like
    /// `llama_memory_seq_cp`. Fails, changing nothing, when the cache has no room for them.
    pub fn seq_cp_range(
        &mut self,
        src: SeqId,
        dst: SeqId,
        p0: Option<u32>,
        p1: Option<u32>,
    ) -> Result<(), KvCacheError> {
        if src == dst {
            return Ok(());
        }
        let d = self.kv_dim;
        let in_range = |p: u32| p0.is_none_or(|a| p >= a) && p1.is_none_or(|b| p < b);
        let picked: Vec<usize> = match self.seqs.get(&src) {
            Some(s) => (0..s.pos.len()).filter(|&i| in_range(s.pos[i])).collect(),
            None => return Ok(()),
        };
        let freed = self
            .seqs
            .get(&dst)
            .map_or(0, |s| s.pos.iter().filter(|&&p| in_range(p)).count());
        self.check_room(picked.len().saturating_sub(freed))?;
        self.seq_rm(dst, p0, p1);
        let Some(s) = self.seqs.get(&src) else {
            return Ok(());
        };
        let mut copy = SeqCells {
            pos: picked.iter().map(|&i| s.pos[i]).collect(),
            k: vec![Vec::with_capacity(picked.len() * d); self.n_layer],
            v: vec![Vec::with_capacity(picked.len() * d); self.n_layer],
        };
        for l in 0..self.n_layer {
            for &i in &picked {
                copy.k[l].extend_from_slice(&s.k[l][i * d..(i + 1) * d]);
                copy.v[l].extend_from_slice(&s.v[l][i * d..(i + 1) * d]);
            }
        }
        match self.seqs.get_mut(&dst) {
            Some(t) => {
                t.pos.extend_from_slice(&copy.pos);
                for l in 0..copy.k.len() {
                    t.k[l].extend_from_slice(&copy.k[l]);
                    t.v[l].extend_from_slice(&copy.v[l]);
                }
            }
            None if !copy.pos.is_empty() => {
                self.seqs.insert(dst, copy);
            }
            None => {}
        }
        Ok(())
    }

    /// Shifts positions in `p0..p1` of `seq` by `delta`, re-rotating the stored keys with
    /// `rotate(key_row, old_pos, new_pos)` (RoPE is additive in the angle). Cells whose
    /// position would become negative are removed.
    pub fn seq_add(
        &mut self,
        seq: SeqId,
        p0: u32,
        p1: Option<u32>,
        delta: i64,
        rotate: &dyn Fn(&mut [f32], i64),
    ) {
        let d = self.kv_dim;
        let Some(s) = self.seqs.get_mut(&seq) else {
            return;
        };
        let mut row = vec![0f32; d];
        let mut keep = vec![true; s.pos.len()];
        for (i, p) in s.pos.iter_mut().enumerate() {
            if *p < p0 || p1.is_some_and(|b| *p >= b) {
                continue;
            }
            let np = *p as i64 + delta;
            if np < 0 {
                keep[i] = false;
                continue;
            }
            *p = np as u32;
            for l in 0..self.n_layer {
                let k = &mut s.k[l][i * d..(i + 1) * d];
                for (r, h) in row.iter_mut().zip(k.iter()) {
                    *r = f16_to_f32(*h);
                }
                rotate(&mut row, delta);
                for (h, r) in k.iter_mut().zip(row.iter()) {
                    *h = f32_to_f16(*r);
                }
            }
        }
        retain_cells(s, &keep, d);
        if s.pos.is_empty() {
            self.seqs.remove(&seq);
        }
    }
}

/// Keeps the cells of `s` whose flag in `keep` is set, preserving their order.
fn retain_cells(s: &mut SeqCells, keep: &[bool], d: usize) {
    if keep.iter().all(|&k| k) {
        return;
    }
    let filter = |data: &mut Vec<u16>| {
        let mut out = Vec::with_capacity(data.len());
        for (i, k) in keep.iter().enumerate() {
            if *k {
                out.extend_from_slice(&data[i * d..(i + 1) * d]);
            }
        }
        *data = out;
    };
    for l in 0..s.k.len() {
        filter(&mut s.k[l]);
        filter(&mut s.v[l]);
    }
    let mut it = keep.iter();
    s.pos.retain(|_| *it.next().unwrap_or(&true));
}

#[cfg(test)]
mod tests {
    use super::*;

    fn filled(n_ctx: usize) -> KvCache {
        let mut c = KvCache::new(2, 4, n_ctx);
        for p in 0..5u32 {
            let cell = c.add_cell(0, p);
            for l in 0..2 {
                let k = [p as f32, l as f32, 1.0, 2.0];
                let v = [-(p as f32), l as f32, 3.0, 4.0];
                c.write(0, cell, l, &k, &v);
            }
        }
        c
    }

    #[test]
    fn seq_cp_range_copies_the_cells_of_a_position_range() {
        let mut c = filled(16);
        c.add_cell(1, 7);
        c.add_cell(1, 1);
        c.seq_cp_range(0, 1, None, Some(3)).unwrap();
        let (src, dst) = (c.seq(0).unwrap(), c.seq(1).unwrap());
        // the old cell at position 1 was replaced; position 7 kept
        assert_eq!(dst.pos, vec![7, 0, 1, 2]);
        for l in 0..2 {
            assert_eq!(dst.k[l][4..], src.k[l][..12]);
            assert_eq!(dst.v[l][4..], src.v[l][..12]);
        }
        assert_eq!(c.used(), 9);
    }

    #[test]
    fn seq_cp_range_without_room_changes_nothing() {
        let mut c = filled(7);
        let before = c.clone().seqs;
        assert_eq!(
            c.seq_cp_range(0, 2, None, Some(3)),
            Err(KvCacheError::Full {
                n_ctx: 7,
                used: 5,
                needed: 3
            })
        );
        assert_eq!(c.seqs.len(), before.len());
        assert!(c.seq(2).is_none());
        c.seq_cp_range(0, 2, Some(3), None).unwrap();
        assert_eq!(c.seq(2).unwrap().pos, vec![3, 4]);
    }
}
