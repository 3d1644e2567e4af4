//! The backend seam on the GPU: [`CudaDevice`] as a [`Device`] (weights uploaded once in
//! their GGUF formats) and [`Cuda`], the per-call [`Backend`] whose activations live in
//! device memory.
//!
//! Attention reads the K/V rows where they are: the cache's rows live on the GPU
//! ([`CudaKvStore`], which `Model::new_cache` gives a cache of a model placed here), and
//! each forward call uploads only small descriptors once (the slot of every new cell, and
//! the slots and positions of the cells of the batch's sequences), shared by all layers.
//!
//! Ops of the trait that return nothing cannot report a failed launch; the first such error
//! is kept and returned by the next op that returns a `Result` (or by [`Cuda::finish`]).

use std::borrow::Cow;

use rustorch_core::backend::{AttnSpec, Backend, BackendError, Device, Glu, Moe, Rows, WeightRef};
use rustorch_core::kernels::ops::Rope;
use rustorch_core::kv_cache::{KvCache, SeqId};

use crate::device::{CudaDevice, GpuVec};
use crate::error::CudaError;
use crate::kernels::{AttnRow, AttnShape, CudaMatrix, Scratch};
use crate::kv::CudaKvStore;

fn be_err(e: CudaError) -> BackendError {
    BackendError::Device(e.to_string())
}

impl Device for CudaDevice {
    type Mat = CudaMatrix;
    type Vector = GpuVec<f32>;

    fn matrix(&self, bytes: &[u8], w: &WeightRef) -> Result<CudaMatrix, BackendError> {
        let data = bytes.get(w.start..w.start + w.len).ok_or_else(|| {
            BackendError::Device(format!(
                "weight bytes {}..{} outside the file ({} bytes)",
                w.start,
                w.start + w.len,
                bytes.len()
            ))
        })?;
        self.upload_matrix(w.ty, data, w.n_rows, w.n_cols)
            .map_err(be_err)
    }

    fn vector(&self, v: Vec<f32>) -> Result<GpuVec<f32>, BackendError> {
        self.upload(&v).map_err(be_err)
    }
}

/// RoPE angles on the device: `n_rot / 2` cosines and sines per row.
#[derive(Default)]
pub struct CudaAngles {
    pos: GpuVec<u32>,
    cos: GpuVec<f32>,
    sin: GpuVec<f32>,
}

/// Called with (llama.cpp's tensor name, layer, values) at each step of the graph.
pub type TensorHook = Box<dyn Fn(&str, usize, &[f32]) + Send + Sync>;

/// One forward call on the GPU.
pub struct Cuda<'a> {
    dev: &'a CudaDevice,
    s: Scratch,
    hook: Option<&'a TensorHook>,
    /// The first error of an op that cannot return one.
    err: Option<CudaError>,
    tmp: GpuVec<f32>,
    /// This call's attention inputs, uploaded by its first attention op, and the layer of
    /// the last attention op (a layer not after it starts another forward call).
    attn_in: Option<AttnInputs>,
    attn_layer: usize,
    /// The layer of the last hooked tensor (names the tensors hooked inside fused ops).
    layer: usize,
}

impl<'a> Cuda<'a> {
    pub fn new(dev: &'a CudaDevice, hook: Option<&'a TensorHook>) -> Self {
        Cuda {
            dev,
            s: Scratch::default(),
            hook,
            err: None,
            tmp: GpuVec::default(),
            attn_in: None,
            attn_layer: 0,
            layer: 0,
        }
    }

    /// Waits for the queued ops and returns the first error of the call, if any.
    pub fn finish(&mut self) -> Result<(), BackendError> {
        self.check()?;
        self.dev.synchronize().map_err(be_err)
    }

    fn keep(&mut self, r: Result<(), CudaError>) {
        if let Err(e) = r {
            self.err.get_or_insert(e);
        }
    }

    fn check(&mut self) -> Result<(), BackendError> {
        match self.err.take() {
            Some(e) => Err(be_err(e)),
            None => Ok(()),
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn attention_in_place(
        &mut self,
        spec: &AttnSpec,
        rows: Rows<'_>,
        q: &GpuVec<f32>,
        k: &GpuVec<f32>,
        v: &GpuVec<f32>,
        cache: &KvCache,
        cells: &[usize],
        out: &mut GpuVec<f32>,
    ) -> Result<(), CudaError> {
        let store = cache
            .store()
            .and_then(|s| s.as_any().downcast_ref::<CudaKvStore>())
            .filter(|s| s.on(self.dev))
            .ok_or_else(|| {
                CudaError::Unsupported(
                    "the KV cache's rows are not on this GPU (make the cache with Model::new_cache)"
                        .into(),
                )
            })?;
        if let Some(e) = store.error() {
            return Err(CudaError::Driver(e.to_string()));
        }
        if self.attn_in.is_none() || spec.layer <= self.attn_layer {
            self.attn_in = None;
            self.attn_in = Some(AttnInputs::upload(self.dev, rows, cache, cells)?);
        }
        self.attn_layer = spec.layer;
        let Some(ai) = self.attn_in.as_ref() else {
            return Ok(());
        };
        let (kvd, n, l) = (cache.kv_dim(), cells.len(), spec.layer);
        if l >= store.n_layer() || kvd != store.kv_dim() {
            return Err(CudaError::Unsupported(format!(
                "attention of layer {l} ({kvd} K/V values) on a cache of {} layers of {}",
                store.n_layer(),
                store.kv_dim()
            )));
        }
        let shape = AttnShape {
            n_head: spec.n_head,
            n_head_kv: spec.n_head_kv,
            head_dim: spec.head_dim,
            kv_stride: kvd,
            scale: spec.scale,
            softcap: spec.softcap,
            window: spec.window.unwrap_or(0),
        };
        // SAFETY: the slots come from the cache's bookkeeping, below the store's slot
        // count; the descriptors point into `ai.buf`, which lives as long as this call.
        unsafe {
            self.dev.kv_write(
                k,
                v,
                kvd,
                store.layer_k(l),
                store.layer_v(l),
                ai.buf.ptr(),
                n,
            )?;
            self.dev.attention(
                &shape,
                q,
                store.layer_k(l),
                store.layer_v(l),
                ai.rows.ptr(),
                n,
                ai.max_cells,
                out,
                None,
                &mut self.s,
            )
        }
    }
}

/// One forward call's attention inputs on the device, the same for every layer: `buf`
/// holds the slot of each batch row's new cell, then for each sequence of the batch the
/// slots and the positions of its cells; `rows` the descriptor of each batch row.
struct AttnInputs {
    buf: GpuVec<u32>,
    rows: GpuVec<u64>,
    max_cells: usize,
}

impl AttnInputs {
    fn upload(
        dev: &CudaDevice,
        rows: Rows<'_>,
        cache: &KvCache,
        cells: &[usize],
    ) -> Result<Self, CudaError> {
        let n = cells.len();
        let mut seqs: Vec<SeqId> = rows.seq_ids[..n].to_vec();
        seqs.sort_unstable();
        seqs.dedup();
        let mut host: Vec<u32> = Vec::with_capacity(n);
        for (i, &cell) in cells.iter().enumerate() {
            let slot = cache
                .seq(rows.seq_ids[i])
                .and_then(|c| c.slots.get(cell))
                .copied()
                .ok_or_else(|| {
                    CudaError::Unsupported(format!(
                        "batch row {i}: cell {cell} of sequence {} is not in the cache",
                        rows.seq_ids[i]
                    ))
                })?;
            host.push(slot);
        }
        let mut at: Vec<(SeqId, usize, usize)> = Vec::with_capacity(seqs.len());
        for &seq in &seqs {
            if let Some(c) = cache.seq(seq) {
                at.push((seq, host.len(), c.pos.len()));
                host.extend_from_slice(&c.slots);
                host.extend_from_slice(&c.pos);
            }
        }
        let buf = dev.upload(&host)?;
        let mut packed = Vec::with_capacity(n * AttnRow::WORDS);
        let mut max_cells = 0;
        for i in 0..n {
            let (off, nc) = at
                .iter()
                .find(|a| a.0 == rows.seq_ids[i])
                .map_or((0, 0), |a| (a.1, a.2));
            max_cells = max_cells.max(nc);
            AttnRow {
                slots: buf.ptr() + (off * 4) as u64,
                pos: buf.ptr() + ((off + nc) * 4) as u64,
                n_cells: nc as u32,
                max_pos: rows.positions[i],
            }
            .pack(&mut packed);
        }
        Ok(AttnInputs {
            rows: dev.upload(&packed)?,
            buf,
            max_cells,
        })
    }
}

impl<'a> Backend for Cuda<'a> {
    type Dev = CudaDevice;
    type Buf = GpuVec<f32>;
    type Angles = CudaAngles;

    fn embed(
        &mut self,
        table: &CudaMatrix,
        tokens: &[u32],
        out: &mut GpuVec<f32>,
    ) -> Result<(), BackendError> {
        self.check()?;
        self.dev
            .get_rows(table, tokens, out, &mut self.s)
            .map_err(be_err)
    }

    fn rms_norm(&mut self, x: &GpuVec<f32>, w: &GpuVec<f32>, eps: f32, out: &mut GpuVec<f32>) {
        let r = self.dev.rms_norm(x, w, eps, out);
        self.keep(r);
    }

    fn rms_norm_inplace(&mut self, x: &mut GpuVec<f32>, w: &GpuVec<f32>, eps: f32) {
        let r = self.dev.rms_norm_inplace(x, w, eps);
        self.keep(r);
    }

    fn matmul(
        &mut self,
        w: &CudaMatrix,
        x: &GpuVec<f32>,
        out: &mut GpuVec<f32>,
    ) -> Result<(), BackendError> {
        self.check()?;
        self.dev.matmul(w, x, out, &mut self.s).map_err(be_err)
    }

    fn matmul_many(
        &mut self,
        ws: &[&CudaMatrix],
        x: &GpuVec<f32>,
        outs: &mut [&mut GpuVec<f32>],
    ) -> Result<(), BackendError> {
        self.check()?;
        self.dev
            .matmul_many(ws, x, outs, &mut self.s)
            .map_err(be_err)
    }

    fn glu(
        &mut self,
        act: Glu,
        wg: &CudaMatrix,
        wu: &CudaMatrix,
        x: &GpuVec<f32>,
        gate: &mut GpuVec<f32>,
        up: &mut GpuVec<f32>,
    ) -> Result<(), BackendError> {
        self.check()?;
        self.dev
            .matmul_many(&[wg, wu], x, &mut [&mut *gate, &mut *up], &mut self.s)
            .map_err(be_err)?;
        if self.hook.is_some() {
            let il = self.layer;
            self.hook("ffn_gate", il, gate);
            self.hook("ffn_up", il, up);
        }
        self.dev.glu(act == Glu::Gelu, gate, up).map_err(be_err)
    }

    fn moe(
        &mut self,
        _moe: &Moe<'_, CudaMatrix>,
        _x: &GpuVec<f32>,
        _out: &mut GpuVec<f32>,
    ) -> Result<(), BackendError> {
        Err(be_err(CudaError::Unsupported(
            "mixture-of-experts feed-forward (not yet on the GPU)".into(),
        )))
    }

    fn add(&mut self, x: &mut GpuVec<f32>, y: &GpuVec<f32>) {
        let r = self.dev.add(x, y);
        self.keep(r);
    }

    fn add_bias(&mut self, x: &mut GpuVec<f32>, b: &GpuVec<f32>) {
        let r = self.dev.add_bias(x, b);
        self.keep(r);
    }

    fn scale(&mut self, x: &mut GpuVec<f32>, s: f32) {
        let r = self.dev.scale(x, s);
        self.keep(r);
    }

    fn softcap(&mut self, x: &mut GpuVec<f32>, cap: f32) {
        let r = self.dev.softcap(x, cap);
        self.keep(r);
    }

    fn rope_angles(
        &mut self,
        rope: &Rope,
        positions: &[u32],
        freqs: Option<&GpuVec<f32>>,
        out: &mut CudaAngles,
    ) {
        let r = out.pos.write(self.dev, positions).and_then(|_| {
            self.dev
                .rope_angles(rope, &out.pos, freqs, &mut out.cos, &mut out.sin)
        });
        self.keep(r);
    }

    fn rope(&mut self, x: &mut GpuVec<f32>, rope: &Rope, head_dim: usize, a: &CudaAngles) {
        let r = self.dev.rope(x, rope, head_dim, &a.cos, &a.sin);
        self.keep(r);
    }

    fn attention(
        &mut self,
        spec: &AttnSpec,
        rows: Rows<'_>,
        q: &GpuVec<f32>,
        k: &GpuVec<f32>,
        v: &GpuVec<f32>,
        cache: &mut KvCache,
        cells: &[usize],
        out: &mut GpuVec<f32>,
    ) {
        let r = self.attention_in_place(spec, rows, q, k, v, cache, cells, out);
        self.keep(r);
    }

    fn keep_rows(&mut self, x: &mut GpuVec<f32>, width: usize, rows: &[usize]) {
        let ids: Vec<u32> = rows.iter().map(|&r| r as u32).collect();
        let r = self
            .dev
            .gather_rows(x, width, &ids, &mut self.tmp, &mut self.s);
        self.keep(r);
        std::mem::swap(x, &mut self.tmp);
    }

    fn read<'b>(&mut self, x: &'b GpuVec<f32>) -> Cow<'b, [f32]> {
        match x.read(self.dev) {
            Ok(v) => Cow::Owned(v),
            Err(e) => {
                self.err.get_or_insert(e);
                Cow::Owned(Vec::new())
            }
        }
    }

    fn hook(&mut self, name: &str, layer: usize, x: &GpuVec<f32>) {
        self.layer = layer;
        if let Some(h) = self.hook {
            let v = self.read(x);
            h(name, layer, &v);
        }
    }
}
