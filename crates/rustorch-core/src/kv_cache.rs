//! The key/value cache: per sequence, a list of cells each holding the position it was
//! written at and, per layer, its key and value vectors (f16 by default, like llama.cpp;
//! or any of llama.cpp's `--cache-type-k/-v` types, see [`KvTypes`]). Attention looks at
//! the cells of the query's sequence whose position is not after the query's, so the cache
//! never needs positions to be contiguous.
//!
//! Where the rows live is pluggable. A cache made with [`KvCache::new`] keeps them on the
//! host, per sequence and layer, cell after cell (the CPU attention walks them in place).
//! One made with [`KvCache::with_store`] keeps the same bookkeeping (sequences, cells,
//! positions, `n_ctx`) and its rows in a [`KvStore`], a pool of slots in a device's memory:
//! every cell holds one slot, so removing cells moves no rows, copying cells copies slot
//! rows on the device, and a context shift re-rotates keys there. Cell indices are the
//! same either way.

use std::any::Any;
use std::collections::BTreeMap;

use crate::kernels::{ops::fwht, quantize_scalar};
use crate::quant::{self, f16_to_f32, f32_to_f16, f32_to_f16_row, IQ4NL_VALUES};
use crate::GgmlType;

/// Identifies a sequence (a conversation, a server slot) in a batch and in the cache.
pub type SeqId = u32;

#[derive(Debug, Default, Clone)]
pub struct SeqCells {
    pub pos: Vec<u32>,
    /// The store slot of each cell (see [`KvStore`]; bookkeeping only for a host cache).
    pub slots: Vec<u32>,
    /// per layer: the keys (already rotated), one row per cell encoded as the cache's key
    /// type and kept in 16-bit words (f16 values, or the bytes of quantized blocks, see
    /// [`words_as_bytes`]); empty when the rows live in a [`KvStore`]
    pub k: Vec<Vec<u16>>,
    /// per layer: values, one row per cell as the value type (empty with a [`KvStore`])
    pub v: Vec<Vec<u16>>,
}

/// Key/value rows kept outside the host cache (in a GPU's memory): for every layer, one
/// key row and one value row (f16, `kv_dim` values) per slot. The cache decides which
/// slot each cell holds and tells the store what to move; the store never sees cells.
///
/// Operations that cannot return an error keep it; the backend that reads the store
/// reports it.
pub trait KvStore: Send + Sync + Any {
    /// Slots the store holds.
    fn n_slots(&self) -> usize;
    /// Grows to `n` slots, keeping every slot's rows.
    fn grow(&mut self, n: usize);
    /// For each `(src, dst)`: slot `dst`'s key and value rows of every layer become slot
    /// `src`'s.
    fn copy(&mut self, pairs: &[(u32, u32)]);
    /// Re-rotates the keys of `slots` (every layer) by `delta` positions, as
    /// [`KvCache::seq_add`]'s `rotate` does for a host cache (the store knows its model's
    /// RoPE).
    fn shift(&mut self, slots: &[u32], delta: i64);
    /// Stores one slot's key and value rows of `layer`, rounded to f16.
    fn write(&mut self, slot: u32, layer: usize, k: &[f32], v: &[f32]);
    /// The key and value rows (f16 bits) of `slots` for `layer`, back to back.
    fn read(&self, layer: usize, slots: &[u32]) -> (Vec<u16>, Vec<u16>);
    fn as_any(&self) -> &dyn Any;
    fn as_any_mut(&mut self) -> &mut dyn Any;
}

/// The names `--cache-type-k` / `--cache-type-v` accept, as llama.cpp spells them.
pub const KV_CACHE_TYPES: [&str; 8] = [
    "f32", "f16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "iq4_nl",
];

/// The encodings of cached keys and values (llama.cpp's `type_k` / `type_v`).
///
/// Attention then computes what llama.cpp's CPU flash attention computes for those types
/// (`ggml_compute_forward_flash_attn_ext_f16_one_chunk`): the query in the key type's
/// vec-dot format (f16, or Q8_0 / Q8_1 blocks), `K·Q` by that type's dot product, values
/// decoded to f32 and accumulated in f32 (or, for f16 values, in the f16 accumulator). A
/// quantized type also turns on llama.cpp's Hadamard rotation of that side
/// ([`KvCache::k_rot`], [`KvCache::v_rot`]). `f32` keys and values are stored as f32 and
/// rounded to f16 when attended, as llama.cpp casts them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvTypes {
    pub k: GgmlType,
    pub v: GgmlType,
}

impl Default for KvTypes {
    fn default() -> Self {
        KvTypes {
            k: GgmlType::F16,
            v: GgmlType::F16,
        }
    }
}

/// Why a cache type was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KvTypeError {
    #[error(
        "unsupported KV cache type '{name}' (valid: {valid})",
        valid = KV_CACHE_TYPES.join(", ")
    )]
    Unknown { name: String },
    #[error(
        "KV cache type {ty} needs a head size that is a multiple of {block}, but this model's \
         is {head_dim}"
    )]
    HeadSize {
        ty: &'static str,
        block: usize,
        head_dim: usize,
    },
}

/// The cache type named `name` (one of [`KV_CACHE_TYPES`], case-insensitive).
pub fn parse_kv_type(name: &str) -> Result<GgmlType, KvTypeError> {
    let n = name.trim().to_ascii_lowercase();
    KV_CACHE_TYPES
        .iter()
        .position(|&t| t == n)
        .map(|i| match i {
            0 => GgmlType::F32,
            1 => GgmlType::F16,
            2 => GgmlType::Q8_0,
            3 => GgmlType::Q4_0,
            4 => GgmlType::Q4_1,
            5 => GgmlType::Q5_0,
            6 => GgmlType::Q5_1,
            _ => GgmlType::IQ4_NL,
        })
        .ok_or_else(|| KvTypeError::Unknown {
            name: name.to_string(),
        })
}

impl KvTypes {
    /// Whether both are f16 (the default, and the only types a [`KvStore`] holds).
    pub fn is_f16(&self) -> bool {
        self.k == GgmlType::F16 && self.v == GgmlType::F16
    }

    /// Checks that both are cache types and fit heads of `head_dim` values.
    pub fn check(&self, head_dim: usize) -> Result<(), KvTypeError> {
        for ty in [self.k, self.v] {
            if !KV_CACHE_TYPES.contains(&ty.name()) {
                return Err(KvTypeError::Unknown {
                    name: ty.name().to_string(),
                });
            }
            if !head_dim.is_multiple_of(ty.block_size()) {
                return Err(KvTypeError::HeadSize {
                    ty: ty.name(),
                    block: ty.block_size(),
                    head_dim,
                });
            }
        }
        Ok(())
    }
}

/// Bytes of one cache row of `n` values encoded as `ty`.
pub fn row_bytes(ty: GgmlType, n: usize) -> usize {
    n / ty.block_size() * ty.type_size()
}

/// The bytes of a row kept in 16-bit words (every cache type's blocks have an even size).
pub fn words_as_bytes(w: &[u16]) -> &[u8] {
    // SAFETY: the same memory, read as bytes (alignment 1, twice as many elements).
    unsafe { std::slice::from_raw_parts(w.as_ptr() as *const u8, w.len() * 2) }
}

fn words_as_bytes_mut(w: &mut [u16]) -> &mut [u8] {
    // SAFETY: as in `words_as_bytes`; the borrow is exclusive.
    unsafe { std::slice::from_raw_parts_mut(w.as_mut_ptr() as *mut u8, w.len() * 2) }
}

/// Whether `ty` is a block (quantized) cache type.
fn quantized(ty: GgmlType) -> bool {
    ty.block_size() > 1
}

/// The size of llama.cpp's Hadamard rotation for the keys of a quantized key type: the
/// largest power of two (64 or more) that divides the head size; `None` for an unquantized
/// type or a head size that is not a multiple of 64 (`llama_kv_cache::build_input_k_rot`).
pub fn k_rotation(ty: GgmlType, head_dim: usize) -> Option<usize> {
    if !quantized(ty) || head_dim == 0 || !head_dim.is_multiple_of(64) {
        return None;
    }
    let mut n = 64;
    while head_dim.is_multiple_of(n * 2) {
        n *= 2;
    }
    Some(n)
}

/// The Hadamard rotation of values of a quantized value type: 64 when the head size is a
/// multiple of 64 (`llama_kv_cache::build_input_v_rot`).
pub fn v_rotation(ty: GgmlType, head_dim: usize) -> Option<usize> {
    (quantized(ty) && head_dim > 0 && head_dim.is_multiple_of(64)).then_some(64)
}

/// Encodes one row of `x.len()` values as the cache type `ty` into `out` (its row bytes),
/// as ggml-cpu's `from_float` of that type does when llama.cpp writes the cache
/// (`set_rows`): f16 rounding, Q8_0 with ggml-cpu's x86 encoder (`127/amax`, ties to even),
/// Q4_0/Q4_1/Q5_0/Q5_1/IQ4_NL with the reference quantizers (`quantize_row_*_ref`; IQ4_NL's
/// without the scale search).
pub fn encode_row(ty: GgmlType, x: &[f32], out: &mut [u8]) {
    match ty {
        GgmlType::F16 => {
            for (o, &v) in out.chunks_exact_mut(2).zip(x) {
                o.copy_from_slice(&f32_to_f16(v).to_le_bytes());
            }
        }
        GgmlType::Q8_0 => {
            let _ = quantize_scalar(ty, x, out);
        }
        GgmlType::IQ4_NL => {
            for (xb, ob) in x.chunks_exact(32).zip(out.chunks_exact_mut(18)) {
                iq4_nl_ref(xb, ob);
            }
        }
        _ => {
            let _ = quant::quantize(ty, x, out);
        }
    }
}

/// ggml's `quantize_row_iq4_nl_ref` for one block of 32: scale `max / -127`, codes nearest to
/// `x / scale`, then the least-squares scale for those codes with `x²` weights (no search).
/// An all-zero block gets scale 0 (ggml leaves its codes as the previous block's; they
/// decode to zeros either way).
fn iq4_nl_ref(x: &[f32], out: &mut [u8]) {
    let v = |i: u8| f32::from(IQ4NL_VALUES[usize::from(i)]);
    let best = |a: f32| -> u8 {
        if a <= v(0) {
            return 0;
        }
        if a >= v(15) {
            return 15;
        }
        let (mut lo, mut hi) = (0u8, 15u8);
        while hi - lo > 1 {
            let mid = (lo + hi) / 2;
            if a < v(mid) {
                hi = mid;
            } else {
                lo = mid;
            }
        }
        if a - v(hi - 1) < v(hi) - a {
            hi - 1
        } else {
            hi
        }
    };
    let (mut amax, mut max) = (0f32, 0f32);
    for &a in x {
        if a.abs() > amax {
            amax = a.abs();
            max = a;
        }
    }
    let mut codes = [0u8; 32];
    let mut d = 0f32;
    if amax >= quant::GROUP_MAX_EPS {
        let id = 1.0 / (max / v(0));
        let (mut sumqx, mut sumq2) = (0f32, 0f32);
        for (c, &a) in codes.iter_mut().zip(x) {
            *c = best(id * a);
            let (q, w) = (v(*c), a * a);
            sumqx += w * q * a;
            sumq2 += w * q * q;
        }
        d = if sumq2 > 0.0 { sumqx / sumq2 } else { 0.0 };
    }
    out[..2].copy_from_slice(&f32_to_f16(d).to_le_bytes());
    for j in 0..16 {
        out[2 + j] = codes[j] | (codes[j + 16] << 4);
    }
}

/// Decodes one row of cache type `ty` to f32 (ggml's `to_float`).
pub fn decode_row(ty: GgmlType, bytes: &[u8], out: &mut [f32]) {
    let _ = quant::dequantize(ty, bytes, out);
}

/// Key/value cache for all sequences, holding at most `n_ctx` cells in total.
pub struct KvCache {
    n_layer: usize,
    kv_dim: usize,
    n_ctx: usize,
    /// How keys and values are encoded, and the head size (for the Hadamard rotations).
    types: KvTypes,
    head_dim: usize,
    /// 16-bit words per key row and per value row.
    k_words: usize,
    v_words: usize,
    seqs: BTreeMap<SeqId, SeqCells>,
    /// Slots given back by removed cells.
    free: Vec<u32>,
    /// Slots `next..n_slots` were never handed out.
    next: u32,
    n_slots: usize,
    /// Where the rows live when not on the host.
    store: Option<Box<dyn KvStore>>,
}

impl std::fmt::Debug for KvCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvCache")
            .field("n_layer", &self.n_layer)
            .field("kv_dim", &self.kv_dim)
            .field("n_ctx", &self.n_ctx)
            .field("types", &self.types)
            .field("used", &self.used())
            .field("n_slots", &self.n_slots)
            .field("store", &self.store.is_some())
            .finish()
    }
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
    /// A cache whose rows live on the host, f16.
    pub fn new(n_layer: usize, kv_dim: usize, n_ctx: usize) -> Self {
        KvCache {
            n_layer,
            kv_dim,
            n_ctx,
            types: KvTypes::default(),
            head_dim: kv_dim,
            k_words: kv_dim,
            v_words: kv_dim,
            seqs: BTreeMap::new(),
            free: Vec::new(),
            next: 0,
            n_slots: n_ctx,
            store: None,
        }
    }

    /// A cache whose rows live on the host, keys and values encoded as `types`, for heads
    /// of `head_dim` values (`kv_dim` is a multiple of it).
    pub fn with_types(
        n_layer: usize,
        kv_dim: usize,
        head_dim: usize,
        n_ctx: usize,
        types: KvTypes,
    ) -> Result<Self, KvTypeError> {
        types.check(head_dim)?;
        Ok(KvCache {
            types,
            head_dim,
            k_words: row_bytes(types.k, kv_dim) / 2,
            v_words: row_bytes(types.v, kv_dim) / 2,
            ..KvCache::new(n_layer, kv_dim, n_ctx)
        })
    }

    /// How keys and values are encoded.
    pub fn types(&self) -> KvTypes {
        self.types
    }

    /// 16-bit words of one cell's key row and value row (in [`SeqCells::k`] / `v`).
    pub fn row_words(&self) -> (usize, usize) {
        (self.k_words, self.v_words)
    }

    /// Bytes the keys and the values of `n_ctx` cells take (every layer).
    pub fn size_bytes(&self) -> (usize, usize) {
        let cells = self.n_ctx * self.n_layer;
        (
            cells * row_bytes(self.types.k, self.kv_dim),
            cells * row_bytes(self.types.v, self.kv_dim),
        )
    }

    /// The Hadamard rotation llama.cpp applies to queries and keys of this cache (chunks
    /// of this many values), when the key type is quantized: see [`k_rotation`].
    pub fn k_rot(&self) -> Option<usize> {
        k_rotation(self.types.k, self.head_dim)
    }

    /// The rotation of values and of the attention output: see [`v_rotation`].
    pub fn v_rot(&self) -> Option<usize> {
        v_rotation(self.types.v, self.head_dim)
    }

    /// A cache whose rows live in `store` (its slots as allocated, usually `n_ctx`), f16.
    pub fn with_store(
        n_layer: usize,
        kv_dim: usize,
        n_ctx: usize,
        store: Box<dyn KvStore>,
    ) -> Self {
        let n_slots = store.n_slots();
        KvCache {
            n_slots,
            store: Some(store),
            ..KvCache::new(n_layer, kv_dim, n_ctx)
        }
    }

    /// The store holding the rows, when they are not on the host.
    pub fn store(&self) -> Option<&dyn KvStore> {
        self.store.as_deref()
    }

    pub fn store_mut(&mut self) -> Option<&mut dyn KvStore> {
        match &mut self.store {
            Some(s) => Some(&mut **s),
            None => None,
        }
    }

    /// Total cells (tokens) the cache may hold.
    pub fn n_ctx(&self) -> usize {
        self.n_ctx
    }

    pub fn n_layer(&self) -> usize {
        self.n_layer
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

    /// A slot no cell holds; the store grows when every slot is taken (only a copy past
    /// `n_ctx` through [`KvCache::seq_cp`] or cells added without [`KvCache::check_room`]).
    fn alloc_slot(&mut self) -> u32 {
        if let Some(s) = self.free.pop() {
            return s;
        }
        if self.next as usize >= self.n_slots {
            let n = (self.n_slots * 2).max(16);
            if let Some(st) = &mut self.store {
                st.grow(n);
            }
            self.n_slots = n;
        }
        self.next += 1;
        self.next - 1
    }

    /// Appends a cell for `seq` at `pos`; returns its index. K/V rows are zero until written.
    pub fn add_cell(&mut self, seq: SeqId, pos: u32) -> usize {
        // a token written again at a position replaces the old cell
        if let Some(i) = self
            .seqs
            .get(&seq)
            .and_then(|s| s.pos.iter().position(|&p| p == pos))
        {
            return i;
        }
        let slot = self.alloc_slot();
        let (n_layer, kw, vw, host) = (
            self.n_layer,
            self.k_words,
            self.v_words,
            self.store.is_none(),
        );
        let s = self.seqs.entry(seq).or_insert_with(|| SeqCells {
            pos: Vec::new(),
            slots: Vec::new(),
            k: vec![Vec::new(); n_layer],
            v: vec![Vec::new(); n_layer],
        });
        s.pos.push(pos);
        s.slots.push(slot);
        if host {
            for l in 0..n_layer {
                s.k[l].resize(s.pos.len() * kw, 0);
                s.v[l].resize(s.pos.len() * vw, 0);
            }
        }
        s.pos.len() - 1
    }

    /// Stores one cell's key and value rows of `layer` (`kv_dim` values each), encoded as
    /// the cache's types. Rows of a rotated type ([`KvCache::k_rot`], [`KvCache::v_rot`])
    /// come already rotated.
    pub fn write(&mut self, seq: SeqId, cell: usize, layer: usize, k: &[f32], v: &[f32]) {
        let (kw, vw, types) = (self.k_words, self.v_words, self.types);
        if let Some(s) = self.seqs.get_mut(&seq) {
            match &mut self.store {
                None => {
                    store_row(types.k, k, &mut s.k[layer][cell * kw..(cell + 1) * kw]);
                    store_row(types.v, v, &mut s.v[layer][cell * vw..(cell + 1) * vw]);
                }
                Some(st) => st.write(s.slots[cell], layer, k, v),
            }
        }
    }

    pub fn seq(&self, seq: SeqId) -> Option<&SeqCells> {
        self.seqs.get(&seq)
    }

    /// The sequences held, in id order.
    pub fn seq_ids(&self) -> impl Iterator<Item = SeqId> + '_ {
        self.seqs.keys().copied()
    }

    pub fn kv_dim(&self) -> usize {
        self.kv_dim
    }

    /// Removes the cells of `seq` with position in `p0..p1` (`None` = unbounded), like
    /// `llama_memory_seq_rm`.
    pub fn seq_rm(&mut self, seq: SeqId, p0: Option<u32>, p1: Option<u32>) {
        let Some(s) = self.seqs.get(&seq) else {
            return;
        };
        let keep: Vec<bool> = s
            .pos
            .iter()
            .map(|&p| !(p0.is_none_or(|a| p >= a) && p1.is_none_or(|b| p < b)))
            .collect();
        self.retain_cells(seq, &keep);
    }

    /// Drops every sequence but `seq`.
    pub fn seq_keep(&mut self, seq: SeqId) {
        let free = &mut self.free;
        self.seqs.retain(|&s, c| {
            if s != seq {
                free.extend_from_slice(&c.slots);
            }
            s == seq
        });
    }

    /// Forgets everything.
    pub fn clear(&mut self) {
        self.seqs.clear();
        self.free.clear();
        self.next = 0;
    }

    /// Copies the cells of `src` into `dst` (replacing `dst`).
    pub fn seq_cp(&mut self, src: SeqId, dst: SeqId) {
        if src == dst {
            return;
        }
        let Some(mut s) = self.seqs.get(&src).cloned() else {
            return;
        };
        self.seq_rm(dst, None, None);
        let pairs: Vec<(u32, u32)> = s.slots.iter().map(|&a| (a, self.alloc_slot())).collect();
        if let Some(st) = &mut self.store {
            st.copy(&pairs);
        }
        s.slots = pairs.iter().map(|p| p.1).collect();
        self.seqs.insert(dst, s);
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
        let (kw, vw) = (self.k_words, self.v_words);
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
        let host = self.store.is_none();
        let mut copy = SeqCells {
            pos: picked.iter().map(|&i| s.pos[i]).collect(),
            slots: picked.iter().map(|&i| s.slots[i]).collect(),
            k: vec![Vec::with_capacity(picked.len() * kw); self.n_layer],
            v: vec![Vec::with_capacity(picked.len() * vw); self.n_layer],
        };
        if host {
            for l in 0..self.n_layer {
                for &i in &picked {
                    copy.k[l].extend_from_slice(&s.k[l][i * kw..(i + 1) * kw]);
                    copy.v[l].extend_from_slice(&s.v[l][i * vw..(i + 1) * vw]);
                }
            }
        }
        let pairs: Vec<(u32, u32)> = copy.slots.iter().map(|&a| (a, self.alloc_slot())).collect();
        if let Some(st) = &mut self.store {
            st.copy(&pairs);
        }
        copy.slots = pairs.iter().map(|p| p.1).collect();
        match self.seqs.get_mut(&dst) {
            Some(t) => {
                t.pos.extend_from_slice(&copy.pos);
                t.slots.extend_from_slice(&copy.slots);
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
    /// `rotate(key_row, delta)` (RoPE is additive in the angle; a [`KvStore`] rotates with
    /// its own RoPE instead). Cells whose position would become negative are removed.
    pub fn seq_add(
        &mut self,
        seq: SeqId,
        p0: u32,
        p1: Option<u32>,
        delta: i64,
        rotate: &dyn Fn(&mut [f32], i64),
    ) {
        let (d, kw, kty, krot) = (self.kv_dim, self.k_words, self.types.k, self.k_rot());
        let host = self.store.is_none();
        let Some(s) = self.seqs.get_mut(&seq) else {
            return;
        };
        let mut row = vec![0f32; d];
        let mut keep = vec![true; s.pos.len()];
        let mut moved = Vec::new();
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
            if !host {
                moved.push(s.slots[i]);
                continue;
            }
            for l in 0..self.n_layer {
                let k = &mut s.k[l][i * kw..(i + 1) * kw];
                if kty == GgmlType::F16 {
                    for (r, h) in row.iter_mut().zip(k.iter()) {
                        *r = f16_to_f32(*h);
                    }
                    rotate(&mut row, delta);
                    for (h, r) in k.iter_mut().zip(row.iter()) {
                        *h = f32_to_f16(*r);
                    }
                    continue;
                }
                // llama.cpp's shift of other types: decode to f32, undo the Hadamard
                // rotation, RoPE, rotate again, encode (`build_rope_shift`)
                decode_row(kty, words_as_bytes(k), &mut row);
                if let Some(n) = krot {
                    fwht(&mut row, n);
                }
                rotate(&mut row, delta);
                if let Some(n) = krot {
                    fwht(&mut row, n);
                }
                encode_row(kty, &row, words_as_bytes_mut(k));
            }
        }
        if let (Some(st), false) = (&mut self.store, moved.is_empty()) {
            st.shift(&moved, delta);
        }
        self.retain_cells(seq, &keep);
    }

    /// Keeps the cells of `seq` whose flag in `keep` is set, preserving their order; the
    /// slots of the others are free again, and a sequence left empty is forgotten.
    fn retain_cells(&mut self, seq: SeqId, keep: &[bool]) {
        let (kw, vw) = (self.k_words, self.v_words);
        let Some(s) = self.seqs.get_mut(&seq) else {
            return;
        };
        if !keep.iter().all(|&k| k) {
            let filter = |data: &mut Vec<u16>, d: usize| {
                if data.is_empty() {
                    return;
                }
                let mut out = Vec::with_capacity(data.len());
                for (i, k) in keep.iter().enumerate() {
                    if *k {
                        out.extend_from_slice(&data[i * d..(i + 1) * d]);
                    }
                }
                *data = out;
            };
            for l in 0..s.k.len() {
                filter(&mut s.k[l], kw);
                filter(&mut s.v[l], vw);
            }
            let mut slots = Vec::with_capacity(s.slots.len());
            for (i, &slot) in s.slots.iter().enumerate() {
                if keep.get(i).copied().unwrap_or(true) {
                    slots.push(slot);
                } else {
                    self.free.push(slot);
                }
            }
            s.slots = slots;
            let mut it = keep.iter();
            s.pos.retain(|_| *it.next().unwrap_or(&true));
        }
        if s.pos.is_empty() {
            self.seqs.remove(&seq);
        }
    }
}

/// Writes one row of `x` encoded as `ty` into its words.
fn store_row(ty: GgmlType, x: &[f32], out: &mut [u16]) {
    if ty == GgmlType::F16 {
        f32_to_f16_row(x, out);
    } else {
        encode_row(ty, x, words_as_bytes_mut(out));
    }
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
        let before = c.seqs.clone();
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

    /// Quantized rows (keys and values of different widths) follow their cells through
    /// copies and removals, and decode to what was written.
    #[test]
    fn quantized_rows_follow_their_cells() {
        let types = KvTypes {
            k: GgmlType::Q4_1,
            v: GgmlType::Q8_0,
        };
        let (d, n_layer) = (64, 2);
        let mut c = KvCache::with_types(n_layer, d, 32, 16, types).unwrap();
        // 2 blocks of 20 and of 34 bytes, in 16-bit words
        assert_eq!(c.row_words(), (20, 34));
        let row = |p: u32, l: usize, s: f32| -> Vec<f32> {
            (0..d)
                .map(|i| s * ((i as f32 + 1.0) * (p as f32 + 1.0 + l as f32)).sin())
                .collect()
        };
        for p in 0..5u32 {
            let cell = c.add_cell(0, p);
            for l in 0..n_layer {
                c.write(0, cell, l, &row(p, l, 1.0), &row(p, l, -2.0));
            }
        }
        let enc = |ty: GgmlType, x: &[f32]| {
            let mut b = vec![0u8; row_bytes(ty, d)];
            encode_row(ty, x, &mut b);
            b
        };
        let check = |c: &KvCache, seq: SeqId, want: &[u32]| {
            let (kw, vw) = c.row_words();
            let s = c.seq(seq).unwrap();
            assert_eq!(s.pos, want);
            for l in 0..n_layer {
                for (i, &p) in want.iter().enumerate() {
                    let k = words_as_bytes(&s.k[l][i * kw..(i + 1) * kw]);
                    let v = words_as_bytes(&s.v[l][i * vw..(i + 1) * vw]);
                    assert_eq!(k, enc(types.k, &row(p, l, 1.0)), "key p {p} layer {l}");
                    assert_eq!(v, enc(types.v, &row(p, l, -2.0)), "value p {p} layer {l}");
                }
            }
        };
        c.seq_cp_range(0, 1, Some(1), Some(4)).unwrap();
        check(&c, 1, &[1, 2, 3]);
        c.seq_rm(0, Some(1), Some(3));
        check(&c, 0, &[0, 3, 4]);
        assert_eq!(c.size_bytes(), (16 * 2 * 40, 16 * 2 * 68));
        // a head size the blocks do not divide is refused
        assert!(KvCache::with_types(1, 48, 48, 8, types).is_err());
    }

    /// A store on the host, as a device store would be: one pool of slots per layer.
    struct Pool {
        kv_dim: usize,
        k: Vec<Vec<u16>>,
        v: Vec<Vec<u16>>,
        n: usize,
    }

    /// The test's "RoPE": rotates pairs by 0.1 radians per position.
    fn rotate(row: &mut [f32], delta: i64) {
        let (s, c) = (0.1 * delta as f32).sin_cos();
        for p in row.chunks_exact_mut(2) {
            let (a, b) = (p[0], p[1]);
            p[0] = a.mul_add(c, -(b * s));
            p[1] = a.mul_add(s, b * c);
        }
    }

    impl KvStore for Pool {
        fn n_slots(&self) -> usize {
            self.n
        }
        fn grow(&mut self, n: usize) {
            for l in 0..self.k.len() {
                self.k[l].resize(n * self.kv_dim, 0);
                self.v[l].resize(n * self.kv_dim, 0);
            }
            self.n = n;
        }
        fn copy(&mut self, pairs: &[(u32, u32)]) {
            let d = self.kv_dim;
            for l in 0..self.k.len() {
                for &(a, b) in pairs {
                    let (a, b) = (a as usize * d, b as usize * d);
                    self.k[l].copy_within(a..a + d, b);
                    self.v[l].copy_within(a..a + d, b);
                }
            }
        }
        fn shift(&mut self, slots: &[u32], delta: i64) {
            let d = self.kv_dim;
            for l in 0..self.k.len() {
                for &s in slots {
                    let k = &mut self.k[l][s as usize * d..(s as usize + 1) * d];
                    let mut row: Vec<f32> = k.iter().map(|&h| f16_to_f32(h)).collect();
                    rotate(&mut row, delta);
                    for (h, r) in k.iter_mut().zip(&row) {
                        *h = f32_to_f16(*r);
                    }
                }
            }
        }
        fn write(&mut self, slot: u32, layer: usize, k: &[f32], v: &[f32]) {
            let (d, s) = (self.kv_dim, slot as usize);
            f32_to_f16_row(k, &mut self.k[layer][s * d..(s + 1) * d]);
            f32_to_f16_row(v, &mut self.v[layer][s * d..(s + 1) * d]);
        }
        fn read(&self, layer: usize, slots: &[u32]) -> (Vec<u16>, Vec<u16>) {
            let d = self.kv_dim;
            let mut k = Vec::new();
            let mut v = Vec::new();
            for &s in slots {
                let s = s as usize;
                k.extend_from_slice(&self.k[layer][s * d..(s + 1) * d]);
                v.extend_from_slice(&self.v[layer][s * d..(s + 1) * d]);
            }
            (k, v)
        }
        fn as_any(&self) -> &dyn Any {
            self
        }
        fn as_any_mut(&mut self) -> &mut dyn Any {
            self
        }
    }

    /// Both caches hold the same sequences, positions and rows, and no slot is held twice.
    fn same(host: &KvCache, dev: &KvCache) {
        assert_eq!(host.seqs.len(), dev.seqs.len());
        let mut seen = std::collections::HashSet::new();
        for (id, h) in &host.seqs {
            let d = dev.seq(*id).expect("sequence in both");
            assert_eq!(h.pos, d.pos, "seq {id}");
            for l in 0..host.n_layer {
                let (k, v) = dev.store().unwrap().read(l, &d.slots);
                assert_eq!(h.k[l], k, "seq {id} layer {l} keys");
                assert_eq!(h.v[l], v, "seq {id} layer {l} values");
            }
            for &s in &d.slots {
                assert!(seen.insert(s), "slot {s} held twice");
                assert!((s as usize) < dev.store().unwrap().n_slots());
            }
        }
        assert_eq!(host.used(), dev.used());
    }

    /// Random structural operations on a host cache and a store-backed one keep them equal.
    #[test]
    fn a_store_mirrors_the_host_cache() {
        let (n_layer, d, n_ctx) = (2, 6, 24);
        let mut host = KvCache::new(n_layer, d, n_ctx);
        let pool = Pool {
            kv_dim: d,
            k: vec![vec![0; n_ctx * d]; n_layer],
            v: vec![vec![0; n_ctx * d]; n_layer],
            n: n_ctx,
        };
        let mut dev = KvCache::with_store(n_layer, d, n_ctx, Box::new(pool));
        let mut seed = 0x2545f4914f6cdd1du64;
        let mut rnd = |n: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % n
        };
        for step in 0..3000 {
            let seq = rnd(3) as SeqId;
            let other = rnd(3) as SeqId;
            let (a, b) = (rnd(20) as u32, rnd(20) as u32);
            let (p0, p1) = (a.min(b), a.max(b) + 1);
            match rnd(16) {
                0..=6 => {
                    if host.check_room(1).is_ok() {
                        let pos = host.seq_pos_max(seq).map_or(0, |p| p + 1 + rnd(2) as u32);
                        for c in [&mut host, &mut dev] {
                            let cell = c.add_cell(seq, pos);
                            for l in 0..n_layer {
                                let k: Vec<f32> =
                                    (0..d).map(|i| (step * 7 + i + l) as f32 * 0.37).collect();
                                let v: Vec<f32> =
                                    (0..d).map(|i| (step + 3 * i + l) as f32 * -0.11).collect();
                                c.write(seq, cell, l, &k, &v);
                            }
                        }
                    }
                }
                7 | 8 => {
                    host.seq_rm(seq, Some(p0), Some(p1));
                    dev.seq_rm(seq, Some(p0), Some(p1));
                }
                9 | 10 => {
                    let r = host.seq_cp_range(seq, other, None, Some(p1));
                    assert_eq!(r, dev.seq_cp_range(seq, other, None, Some(p1)));
                }
                11 => {
                    if host.used() + host.seq_len(seq) <= n_ctx + 8 {
                        host.seq_cp(seq, other);
                        dev.seq_cp(seq, other);
                    }
                }
                12 | 13 => {
                    let delta = rnd(7) as i64 - 4;
                    host.seq_add(seq, p0, Some(p1), delta, &rotate);
                    dev.seq_add(seq, p0, Some(p1), delta, &|_, _| unreachable!());
                }
                14 => {
                    host.seq_keep(seq);
                    dev.seq_keep(seq);
                }
                _ => {
                    if rnd(8) == 0 {
                        host.clear();
                        dev.clear();
                    }
                }
            }
            same(&host, &dev);
        }
    }
}
