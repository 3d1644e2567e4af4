//! The backend seam on the GPU: [`CudaDevice`] as a [`Device`] (weights uploaded once in
//! their GGUF formats) and [`Cuda`], the per-call [`Backend`] whose activations live in
//! device memory.
//!
//! Attention is transitional: the K/V cache is still the host [`KvCache`], so each call
//! downloads the new K/V rows into it and uploads the cells of the batch's sequences for the
//! layer before running the GPU kernel. Correct, but it moves the whole context over PCIe
//! per layer and step; it goes away once the cache can keep its rows in device memory.
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
    /// Host-cache cells of the batch's sequences for one layer, uploaded for attention.
    stage_k: GpuVec<u16>,
    stage_v: GpuVec<u16>,
    stage_pos: GpuVec<u32>,
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
            stage_k: GpuVec::default(),
            stage_v: GpuVec::default(),
            stage_pos: GpuVec::default(),
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
    fn attention_staged(
        &mut self,
        spec: &AttnSpec,
        rows: Rows<'_>,
        q: &GpuVec<f32>,
        k: &GpuVec<f32>,
        v: &GpuVec<f32>,
        cache: &mut KvCache,
        cells: &[usize],
        out: &mut GpuVec<f32>,
    ) -> Result<(), CudaError> {
        let kvd = cache.kv_dim();
        let n = cells.len();
        // new rows into the host cache
        let (hk, hv) = (k.read(self.dev)?, v.read(self.dev)?);
        for (i, &cell) in cells.iter().enumerate() {
            let r = i * kvd..(i + 1) * kvd;
            cache.write(rows.seq_ids[i], cell, spec.layer, &hk[r.clone()], &hv[r]);
        }
        // this layer's cells of each sequence in the batch, back to back
        let mut seqs: Vec<SeqId> = rows.seq_ids[..n].to_vec();
        seqs.sort_unstable();
        seqs.dedup();
        let (mut sk, mut sv, mut sp) = (Vec::new(), Vec::new(), Vec::new());
        let mut at: Vec<(SeqId, usize, usize)> = Vec::new();
        for &seq in &seqs {
            if let Some(c) = cache.seq(seq) {
                at.push((seq, sp.len(), c.pos.len()));
                sk.extend_from_slice(&c.k[spec.layer]);
                sv.extend_from_slice(&c.v[spec.layer]);
                sp.extend_from_slice(&c.pos);
            }
        }
        self.stage_k.write(self.dev, &sk)?;
        self.stage_v.write(self.dev, &sv)?;
        self.stage_pos.write(self.dev, &sp)?;
        let mut arows = Vec::with_capacity(n);
        for i in 0..n {
            let p = rows.positions[i];
            let (off, nc) = at
                .iter()
                .find(|a| a.0 == rows.seq_ids[i])
                .map_or((0, 0), |a| (a.1, a.2));
            arows.push(AttnRow {
                k: self.stage_k.ptr() + (off * kvd * 2) as u64,
                v: self.stage_v.ptr() + (off * kvd * 2) as u64,
                pos: self.stage_pos.ptr() + (off * 4) as u64,
                n_cells: nc as u32,
                min_pos: spec.window.map_or(0, |w| (p + 1).saturating_sub(w)),
                max_pos: p,
            });
        }
        let shape = AttnShape {
            n_head: spec.n_head,
            n_head_kv: spec.n_head_kv,
            head_dim: spec.head_dim,
            kv_stride: kvd,
            scale: spec.scale,
            softcap: spec.softcap,
        };
        // SAFETY: the rows point into the staging buffers, which stay allocated (and are
        // only rewritten by later, stream-ordered copies).
        unsafe {
            self.dev
                .attention(&shape, q, &arows, out, None, &mut self.s)
        }
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
        let r = self.attention_staged(spec, rows, q, k, v, cache, cells, out);
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
