//! The KV cache's rows in device memory: [`CudaKvStore`], the [`KvStore`] that a model on
//! the GPU gives its caches. One pool per cache, allocated when the cache is made: for
//! every layer, `n_slots` key rows and then `n_slots` value rows of f16 (`kv_dim` halves
//! each). Attention reads the rows where they are; the cache's bookkeeping names the slot
//! of every cell.

use std::any::Any;

use rustorch_core::kernels::ops::Rope;
use rustorch_core::kv_cache::KvStore;
use rustorch_core::quant::f32_to_f16_row;

use crate::device::{CudaDevice, GpuVec};
use crate::error::{CudaError, Result};

/// How the model rotates keys (for a context shift): its RoPE, head size and optional
/// per-pair frequency factors.
#[derive(Debug, Clone)]
pub struct KeyRope {
    pub rope: Rope,
    pub head_dim: usize,
    pub freqs: Option<Vec<f32>>,
}

/// A cache's K/V rows on one GPU.
pub struct CudaKvStore {
    dev: CudaDevice,
    n_layer: usize,
    kv_dim: usize,
    n_slots: usize,
    k: GpuVec<u16>,
    v: GpuVec<u16>,
    rope: KeyRope,
    ids: GpuVec<u32>,
    cos: GpuVec<f32>,
    sin: GpuVec<f32>,
    /// The first failure (sticky: the rows may be wrong after it).
    err: Option<String>,
}

impl CudaKvStore {
    /// Allocates (and zeroes) `n_slots` slots of `n_layer` layers.
    pub fn new(
        dev: &CudaDevice,
        n_layer: usize,
        kv_dim: usize,
        n_slots: usize,
        rope: KeyRope,
    ) -> Result<Self> {
        let mut s = CudaKvStore {
            dev: dev.clone(),
            n_layer,
            kv_dim,
            n_slots: 0,
            k: GpuVec::default(),
            v: GpuVec::default(),
            rope,
            ids: GpuVec::default(),
            cos: GpuVec::default(),
            sin: GpuVec::default(),
            err: None,
        };
        s.resize(n_slots)?;
        Ok(s)
    }

    /// A store whose allocation failed: it holds no slots and every use reports `err`.
    pub fn failed(
        dev: &CudaDevice,
        n_layer: usize,
        kv_dim: usize,
        rope: KeyRope,
        err: CudaError,
    ) -> Self {
        CudaKvStore {
            dev: dev.clone(),
            n_layer,
            kv_dim,
            n_slots: 0,
            k: GpuVec::default(),
            v: GpuVec::default(),
            rope,
            ids: GpuVec::default(),
            cos: GpuVec::default(),
            sin: GpuVec::default(),
            err: Some(format!("KV cache on the GPU: {err}")),
        }
    }

    /// Whether `dev` is the device the rows live on.
    pub fn on(&self, dev: &CudaDevice) -> bool {
        std::sync::Arc::ptr_eq(dev.context(), self.dev.context())
    }

    /// The first error of an operation on the store, if any (it stays).
    pub fn error(&self) -> Option<&str> {
        self.err.as_deref()
    }

    pub fn n_layer(&self) -> usize {
        self.n_layer
    }

    pub fn kv_dim(&self) -> usize {
        self.kv_dim
    }

    /// Halves between one layer's slot 0 and the next layer's.
    pub fn layer_stride(&self) -> usize {
        self.n_slots * self.kv_dim
    }

    /// Device address of `layer`'s key rows (slot 0).
    pub fn layer_k(&self, layer: usize) -> u64 {
        self.k.ptr() + (layer * self.layer_stride() * 2) as u64
    }

    /// Device address of `layer`'s value rows (slot 0).
    pub fn layer_v(&self, layer: usize) -> u64 {
        self.v.ptr() + (layer * self.layer_stride() * 2) as u64
    }

    /// Bytes of device memory the rows take.
    pub fn bytes(&self) -> usize {
        2 * 2 * self.n_layer * self.layer_stride()
    }

    fn keep(&mut self, r: Result<()>) {
        if let Err(e) = r {
            self.err.get_or_insert(format!("KV cache on the GPU: {e}"));
        }
    }

    /// Reallocates to `n` slots, copying the slots both sizes hold.
    fn resize(&mut self, n: usize) -> Result<()> {
        let (nl, d) = (self.n_layer, self.kv_dim);
        let mut k: GpuVec<u16> = self.dev.alloc(nl * n * d)?;
        let mut v: GpuVec<u16> = self.dev.alloc(nl * n * d)?;
        k.zero(&self.dev)?;
        v.zero(&self.dev)?;
        let keep = self.n_slots.min(n) * d * 2;
        for l in 0..nl {
            // SAFETY: both layers' first `keep` bytes lie inside their buffers.
            unsafe {
                self.dev
                    .copy_raw(k.ptr() + (l * n * d * 2) as u64, self.layer_k(l), keep)?;
                self.dev
                    .copy_raw(v.ptr() + (l * n * d * 2) as u64, self.layer_v(l), keep)?;
            }
        }
        self.k = k;
        self.v = v;
        self.n_slots = n;
        Ok(())
    }

    fn copy_slots(&mut self, pairs: &[(u32, u32)]) -> Result<()> {
        let flat: Vec<u32> = pairs.iter().flat_map(|&(a, b)| [a, b]).collect();
        self.ids.write(&self.dev, &flat)?;
        // SAFETY: the cache hands out slots below n_slots only.
        unsafe {
            self.dev.kv_copy(
                self.k.ptr(),
                self.v.ptr(),
                self.ids.ptr(),
                pairs.len(),
                self.n_layer,
                self.layer_stride(),
                self.kv_dim,
            )
        }
    }

    fn shift_slots(&mut self, slots: &[u32], delta: i64) -> Result<()> {
        let r = &self.rope;
        let half = r.rope.n_rot / 2;
        let (mut c, mut s) = (vec![0f32; half], vec![0f32; half]);
        r.rope
            .angles(delta as f32, r.freqs.as_deref(), &mut c, &mut s);
        self.cos.write(&self.dev, &c)?;
        self.sin.write(&self.dev, &s)?;
        self.ids.write(&self.dev, slots)?;
        // SAFETY: as in copy_slots.
        unsafe {
            self.dev.kv_shift(
                self.k.ptr(),
                self.ids.ptr(),
                slots.len(),
                self.n_layer,
                self.layer_stride(),
                self.kv_dim,
                self.rope.head_dim,
                &self.rope.rope,
                &self.cos,
                &self.sin,
            )
        }
    }

    fn write_slot(&mut self, slot: u32, layer: usize, k: &[f32], v: &[f32]) -> Result<()> {
        let d = self.kv_dim;
        if slot as usize >= self.n_slots || layer >= self.n_layer || k.len() < d || v.len() < d {
            return Err(CudaError::Unsupported(format!(
                "write of slot {slot} layer {layer} ({} slots, {} layers)",
                self.n_slots, self.n_layer
            )));
        }
        let (mut hk, mut hv) = (vec![0u16; d], vec![0u16; d]);
        f32_to_f16_row(&k[..d], &mut hk);
        f32_to_f16_row(&v[..d], &mut hv);
        let off = (slot as usize * d * 2) as u64;
        // SAFETY: the slot lies inside the layer (checked above).
        unsafe {
            self.dev.write_raw(self.layer_k(layer) + off, &hk)?;
            self.dev.write_raw(self.layer_v(layer) + off, &hv)
        }
    }
}

impl KvStore for CudaKvStore {
    fn n_slots(&self) -> usize {
        self.n_slots
    }

    fn grow(&mut self, n: usize) {
        if self.err.is_none() && n > self.n_slots {
            let r = self.resize(n);
            self.keep(r);
        }
    }

    fn copy(&mut self, pairs: &[(u32, u32)]) {
        if self.err.is_none() && !pairs.is_empty() {
            let r = self.copy_slots(pairs);
            self.keep(r);
        }
    }

    fn shift(&mut self, slots: &[u32], delta: i64) {
        if self.err.is_none() && !slots.is_empty() {
            let r = self.shift_slots(slots, delta);
            self.keep(r);
        }
    }

    fn write(&mut self, slot: u32, layer: usize, k: &[f32], v: &[f32]) {
        if self.err.is_none() {
            let r = self.write_slot(slot, layer, k, v);
            self.keep(r);
        }
    }

    fn read(&self, layer: usize, slots: &[u32]) -> (Vec<u16>, Vec<u16>) {
        let d = self.kv_dim;
        let (mut k, mut v) = (Vec::new(), Vec::new());
        if self.err.is_some() || layer >= self.n_layer {
            return (k, v);
        }
        // SAFETY: one whole layer of each pool.
        let whole = unsafe {
            self.dev
                .read_raw::<u16>(self.layer_k(layer), self.layer_stride())
                .and_then(|a| {
                    Ok((
                        a,
                        self.dev
                            .read_raw::<u16>(self.layer_v(layer), self.layer_stride())?,
                    ))
                })
        };
        if let Ok((hk, hv)) = whole {
            for &s in slots {
                let s = s as usize;
                if s < self.n_slots {
                    k.extend_from_slice(&hk[s * d..(s + 1) * d]);
                    v.extend_from_slice(&hv[s * d..(s + 1) * d]);
                }
            }
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
