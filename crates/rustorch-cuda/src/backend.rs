//! The backend seam on the GPU: [`CudaDevice`] as a [`Device`] (weights uploaded once in
//! their GGUF formats) and [`Cuda`], the per-call [`Backend`] whose activations live in
//! device memory.
//!
//! Attention reads the K/V rows where they are: the cache's rows live on the GPU
//! ([`CudaKvStore`], which `Model::new_cache` gives a cache of a model placed here), and
//! each forward call uploads only small descriptors once (the slot of every new cell, and
//! the slots and positions of the cells of the batch's sequences), shared by all layers.
//! A model's calls share a [`CudaState`]: [`Cuda::prepare`] uploads all of a call's inputs
//! in one copy, and [`Cuda::run`] replays decode steps as CUDA graphs (see [`crate::step`]).
//!
//! Ops of the trait that return nothing cannot report a failed launch; the first such error
//! is kept and returned by the next op that returns a `Result` (or by [`Cuda::finish`]).

use std::borrow::Cow;

use rustorch_core::backend::{AttnSpec, Backend, BackendError, Device, Glu, Moe, Rows, WeightRef};
use rustorch_core::kernels::ops::{Rope, RopeMode};
use rustorch_core::kv_cache::{KvCache, SeqId};

use crate::device::LaunchMode;
use crate::device::{CudaDevice, GpuVec};
use crate::error::CudaError;
use crate::kernels::{AttnRow, AttnShape, CudaMatrix, FoldNorm, NORM_Q8, NORM_Q8K};
use crate::kv::CudaKvStore;
use crate::step::{self, Captured, CudaState, GraphBox};

/// Launches a captured decode step. Timing only, `RUSTORCH_CUDA_REPLAYX=N`: N times back to
/// back (a step given the same inputs writes the same values, so the results do not change),
/// so that N = 2 against N = 1 measures the step on the GPU alone and the rest of a token's
/// time is the host's.
fn replay(g: &cudarc::driver::CudaGraph) -> std::result::Result<(), cudarc::driver::DriverError> {
    static X: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    let x = *X.get_or_init(|| {
        std::env::var("RUSTORCH_CUDA_REPLAYX")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(1usize)
            .clamp(1, 16)
    });
    for _ in 0..x {
        g.launch()?;
    }
    Ok(())
}

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
    /// With `RUSTORCH_CUDA_EXACT=1`: every position's angles as the host computes them.
    table: RopeTable,
}

/// The host's RoPE angles ([`Rope::angles`]) of positions `0..n_pos` on the device, for
/// the rotation parameters and frequency factors of `key`.
#[derive(Default)]
struct RopeTable {
    key: Option<RopeKey>,
    n_pos: usize,
    cos: GpuVec<f32>,
    sin: GpuVec<f32>,
}

/// What a table of angles depends on: rotated dimensions, base, scale, YaRN's parameters
/// (as bits) and the frequency factors' buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct RopeKey {
    n_rot: usize,
    bits: [u32; 6],
    freqs: (u64, usize),
}

impl RopeKey {
    fn of(rope: &Rope, freqs: Option<&GpuVec<f32>>) -> Self {
        let y = rope.yarn.map_or([0.0; 4], |y| {
            [y.ext_factor, y.corr_dims[0], y.corr_dims[1], y.mscale]
        });
        RopeKey {
            n_rot: rope.n_rot,
            bits: [
                rope.freq_base.to_bits(),
                rope.freq_scale.to_bits(),
                y[0].to_bits(),
                y[1].to_bits(),
                y[2].to_bits(),
                y[3].to_bits(),
            ],
            freqs: freqs.map_or((0, 0), |f| (f.ptr(), f.len())),
        }
    }
}

/// Called with (llama.cpp's tensor name, layer, values) at each step of the graph.
pub type TensorHook = Box<dyn Fn(&str, usize, &[f32]) + Send + Sync>;

/// The most rows of a product that computes a folded norm in each of its blocks (beyond,
/// e.g. the output matrix, the norm's own launch costs less than every block's copy).
const FOLD_MAX_ROWS: usize = 16384;

/// The widest rows whose folded norm fits a block's shared memory (x and the product's
/// activations, 4 bytes each, under the default 48 KiB with room for the static arrays).
const FOLD_MAX_COLS: usize = 10240;

/// A held-back product (see `Cuda::pending_mm`): the matrix, input and output (address,
/// length).
struct PendingMm {
    w: *const CudaMatrix,
    x: (u64, usize),
    out: (u64, usize),
}

/// A held-back norm (see `Cuda::pending_norm`): `out = rms_norm(x) * w`; with `y` (exact
/// mode), first `x += y`.
struct PendingNorm {
    x: (u64, usize),
    y: Option<u64>,
    w: (u64, usize),
    eps: f32,
    out: (u64, usize),
}

/// What a deferred rotation rotates with: the RoPE, the head size, and the angles' device
/// addresses and lengths.
#[derive(Debug, Clone, Copy)]
struct RopeArgs {
    rope: Rope,
    head_dim: usize,
    cos: (u64, usize),
    sin: (u64, usize),
}

impl RopeArgs {
    fn same(&self, o: &RopeArgs) -> bool {
        let (a, b) = (&self.rope, &o.rope);
        a.mode == b.mode
            && a.n_rot == b.n_rot
            && a.freq_base.to_bits() == b.freq_base.to_bits()
            && a.freq_scale.to_bits() == b.freq_scale.to_bits()
            && self.head_dim == o.head_dim
            && self.cos == o.cos
            && self.sin == o.sin
    }
}

/// The state a call uses: its own, or its model's.
enum StateRef<'a> {
    Own(Box<CudaState>),
    Model(&'a mut CudaState),
}

/// One forward call on the GPU.
pub struct Cuda<'a> {
    dev: &'a CudaDevice,
    st: StateRef<'a>,
    hook: Option<&'a TensorHook>,
    /// The first error of an op that cannot return one.
    err: Option<CudaError>,
    /// Buffers read while launches were recorded: (address, length).
    reads: Vec<(u64, usize)>,
    /// A residual add `x += y` not launched yet (addresses, length): the next norm of `x`
    /// does it in the same launch; any other op launches it first.
    pending_add: Option<(u64, u64, usize)>,
    /// Rotations not launched yet (buffer address, length; at most two: the call's q and
    /// k), all with `rope_args`: attention rotates q and k and writes the cache in one
    /// launch; any other op launches them first.
    pending_rope: Vec<(u64, usize)>,
    rope_args: Option<RopeArgs>,
    /// A one-token float product not launched yet: an `add(x, out)` next makes it add its
    /// rows into `x` in the same launch; any other op launches it first.
    pending_mm: Option<PendingMm>,
    /// An RMSNorm not launched yet: a one-token float product of its output next computes
    /// it in each of its blocks (see [`FoldNorm`]); any other op launches it first.
    pending_norm: Option<PendingNorm>,
    /// This call's attention inputs, uploaded by its first attention op, and the layer of
    /// the last attention op (a layer not after it starts another forward call).
    attn_in: Option<AttnInputs>,
    attn_layer: usize,
    /// The layer of the last hooked tensor (names the tensors hooked inside fused ops).
    layer: usize,
}

impl<'a> Cuda<'a> {
    /// A call with its own scratch state (nothing kept for later calls).
    pub fn new(dev: &'a CudaDevice, hook: Option<&'a TensorHook>) -> Self {
        Self::with(dev, StateRef::Own(Box::default()), hook)
    }

    /// A call using (and keeping buffers and graphs in) a model's state.
    pub fn with_state(
        dev: &'a CudaDevice,
        state: &'a mut CudaState,
        hook: Option<&'a TensorHook>,
    ) -> Self {
        Self::with(dev, StateRef::Model(state), hook)
    }

    fn with(dev: &'a CudaDevice, st: StateRef<'a>, hook: Option<&'a TensorHook>) -> Self {
        Cuda {
            dev,
            st,
            hook,
            err: None,
            reads: Vec::new(),
            pending_add: None,
            pending_rope: Vec::new(),
            rope_args: None,
            pending_mm: None,
            pending_norm: None,
            attn_in: None,
            attn_layer: 0,
            layer: 0,
        }
    }

    fn st(&mut self) -> &mut CudaState {
        match &mut self.st {
            StateRef::Own(b) => b,
            StateRef::Model(m) => m,
        }
    }

    /// Uploads the call's inputs (see [`crate::step`]) in one copy: `tokens`, each row's
    /// position and sequence, its new cell in `cache`, and the rows that want logits. Ops
    /// given these same values read them in place.
    pub fn prepare(
        &mut self,
        tokens: &[u32],
        rows: Rows<'_>,
        cells: &[usize],
        out_rows: &[usize],
        cache: &KvCache,
    ) -> Result<(), BackendError> {
        let n = tokens.len();
        if rows.positions.len() != n || rows.seq_ids.len() != n || cells.len() != n {
            return Err(be_err(CudaError::Unsupported(
                "prepare: batch fields of different lengths".into(),
            )));
        }
        let mut new_slots = Vec::with_capacity(n);
        for (i, &cell) in cells.iter().enumerate() {
            let slot = cache
                .seq(rows.seq_ids[i])
                .and_then(|c| c.slots.get(cell))
                .copied()
                .ok_or_else(|| {
                    be_err(CudaError::Unsupported(format!(
                        "batch row {i}: cell {cell} of sequence {} is not in the cache",
                        rows.seq_ids[i]
                    )))
                })?;
            new_slots.push(slot);
        }
        let mut ids: Vec<SeqId> = rows.seq_ids.to_vec();
        ids.sort_unstable();
        ids.dedup();
        let seqs: Vec<(u32, &[u32], &[u32])> = ids
            .iter()
            .filter_map(|&id| cache.seq(id).map(|c| (id, &c.slots[..], &c.pos[..])))
            .collect();
        let dev = self.dev;
        let t0 = std::time::Instant::now();
        let in_graph = step::inputs_in_graph() && !self.mega();
        let r = self
            .st()
            .inp
            .upload(
                dev,
                tokens,
                rows.positions,
                rows.seq_ids,
                cells,
                &new_slots,
                out_rows,
                &seqs,
                in_graph,
            )
            .map_err(be_err);
        let st = self.st();
        st.graphs.stats.prepare_ns += t0.elapsed().as_nanos() as u64;
        if let Ok(ns) = r {
            st.graphs.stats.upload_ns += ns;
        }
        st.inp.cache = cache
            .store()
            .and_then(|s| s.as_any().downcast_ref::<CudaKvStore>())
            .map_or((0, 0), |s| (s.layer_k(0), s.layer_v(0)));
        r.map(|_| ())
    }

    /// Whether decode steps run as the persistent kernel (`RUSTORCH_CUDA_MEGA=1`, not turned
    /// off for this model).
    fn mega(&mut self) -> bool {
        !self.st().mega_off && crate::mega::mega_enabled()
    }

    /// The call's inputs from page-locked host memory into device memory, by a kernel (see
    /// [`step::Prepared::copy_in`]): the first launch of every run of the call, so a captured
    /// step's graph holds it and a replay needs no copy call of its own.
    fn copy_inputs(&mut self) {
        let dev = self.dev;
        let inp = &self.st().inp;
        if !inp.valid || inp.copy_in == 0 {
            return;
        }
        let r = dev.copy_words(inp.buf.ptr(), inp.host_words(), inp.copy_in);
        self.keep(r);
    }

    /// Runs one call: `f` is the architecture's forward pass on this backend. With `graph`
    /// (a decode step without hooks), the call may be replayed from, or captured into, a
    /// CUDA graph (see [`crate::step`]); then `f`'s own reads return nothing and the second
    /// value holds the values of the one buffer it read (the logits), in page-locked memory
    /// shared with the caller ([`step::HostValues`]). `f` may run more than once. Waits for
    /// the device before returning.
    pub fn run<T, E: From<BackendError>>(
        &mut self,
        graph: bool,
        mut f: impl FnMut(&mut Self) -> Result<T, E>,
    ) -> Result<(T, Option<step::HostValues>), E> {
        if !graph || self.hook.is_some() || !step::graphs_enabled() {
            return self.eager(&mut f);
        }
        let dev = self.dev;
        let mega = self.mega();
        // the last call's graph, launched before the dry run (see crate::step)
        let early = if mega { None } else { self.launch_early()? };
        // dry run: the signature of what the call would launch
        let t0 = std::time::Instant::now();
        self.reset_call();
        let allocs = dev.alloc_count();
        dev.set_launch_mode(LaunchMode::DryRun);
        self.copy_inputs();
        let dry = f(self);
        self.touch();
        let (sig, launches) = dev.launch_signature();
        dev.set_launch_mode(LaunchMode::Run);
        let reads = std::mem::take(&mut self.reads);
        self.st().graphs.stats.dry_ns += t0.elapsed().as_nanos() as u64;
        let clean = dry.is_ok() && self.err.is_none() && reads.len() == 1 && launches > 0;
        let dry = match (early, dry) {
            (Some(e), Ok(out))
                if clean && sig == e.sig && reads[0] == e.read && dev.alloc_count() == allocs =>
            {
                let t1 = std::time::Instant::now();
                let logits = self.read_back(e.read)?;
                let g = &mut self.st().graphs;
                g.stats.early += 1;
                g.stats.replayed += 1;
                g.stats.replay_ns += t1.elapsed().as_nanos() as u64;
                g.early_misses = 0;
                self.note_replay(sig, e.read);
                return Ok((out, Some(logits)));
            }
            (Some(_), dry) => {
                let g = &mut self.st().graphs;
                g.stats.early_missed += 1;
                g.early_misses += 1;
                if g.early_misses >= step::EARLY_MISSES {
                    g.early_misses = 0;
                    g.early_pause = step::EARLY_PAUSE;
                }
                dry
            }
            (None, dry) => dry,
        };
        if !clean || self.st().graphs.bad.contains(&sig) {
            return self.eager(&mut f);
        }
        let Ok(out) = dry else {
            return self.eager(&mut f);
        };
        let read = reads[0];
        let t1 = std::time::Instant::now();
        // a dry run that allocated may have recorded buffers it then replaced: no program
        // of it (a later step, with the buffers grown, makes one)
        if mega && dev.alloc_count() == allocs {
            if let Ok(m) = dev.mega() {
                let st = self.st();
                if st.progs.run(dev, &m, sig).map_err(be_err)? {
                    st.graphs.stats.mega += 1;
                    let logits = self.read_back(read)?;
                    self.st().graphs.stats.replay_ns += t1.elapsed().as_nanos() as u64;
                    return Ok((out, Some(logits)));
                }
            }
        }
        let g = &mut self.st().graphs;
        if let Some(c) = g.find(sig) {
            let r = replay(&c.graph.0);
            g.stats.replayed += 1;
            r.map_err(|e| be_err(e.into()))?;
            let logits = self.read_back(read)?;
            self.st().graphs.stats.replay_ns += t1.elapsed().as_nanos() as u64;
            self.note_replay(sig, read);
            return Ok((out, Some(logits)));
        }
        // capture the call (nothing runs), check that it launched the same, replay it
        self.reset_call();
        let cap = step::capture(dev, || {
            dev.set_launch_mode(LaunchMode::Record);
            self.copy_inputs();
            let r = f(self);
            self.touch();
            let s = dev.launch_signature();
            dev.set_launch_mode(LaunchMode::Run);
            (r.is_ok(), s)
        });
        let reads = std::mem::take(&mut self.reads);
        let graph = match cap {
            Ok(((true, (sig2, _)), Ok(Some(graph))))
                if sig2 == sig && self.err.is_none() && reads == [read] =>
            {
                graph
            }
            _ => {
                let g = &mut self.st().graphs;
                g.bad.push(sig);
                g.stats.failed += 1;
                return self.eager(&mut f);
            }
        };
        let r = graph.launch();
        let g = &mut self.st().graphs;
        g.stats.captured += 1;
        g.stats.capture_ns += t1.elapsed().as_nanos() as u64;
        g.insert(Captured {
            sig,
            graph: GraphBox(graph),
            used: g.tick,
        });
        r.map_err(|e| be_err(e.into()))?;
        let logits = self.read_back(read)?;
        self.note_replay(sig, read);
        Ok((out, Some(logits)))
    }

    /// Where the call may launch the last call's graph before its dry run (see
    /// [`crate::step`]): launches it and returns what the dry run must confirm.
    fn launch_early(&mut self) -> Result<Option<step::LastReplay>, BackendError> {
        let buffers = self.dev.alloc_count();
        let st = self.st();
        let last = st.graphs.last.take();
        if st.graphs.early_pause > 0 {
            st.graphs.early_pause -= 1;
            return Ok(None);
        }
        let Some(last) = last else {
            return Ok(None);
        };
        let same = last.buffers == buffers
            && st.inp.valid
            && st.inp.cache == last.cache
            && last.cache.0 != 0
            && st.inp.tokens.len() == last.tokens
            && st.inp.out_rows.len() == last.out_rows;
        if !same || st.early_off || !step::early_enabled() {
            return Ok(None);
        }
        if let Some(t) = st.graphs.read_done.take() {
            st.graphs.stats.gap_ns += t.elapsed().as_nanos() as u64;
            st.graphs.stats.gaps += 1;
        }
        let Some(c) = st.graphs.find(last.sig) else {
            return Ok(None);
        };
        let t = std::time::Instant::now();
        let r = replay(&c.graph.0);
        st.graphs.stats.launch_ns += t.elapsed().as_nanos() as u64;
        r.map_err(|e| be_err(e.into()))?;
        Ok(Some(last))
    }

    /// Remembers the graph this call replayed, for the next call's early launch.
    fn note_replay(&mut self, sig: u64, read: (u64, usize)) {
        let buffers = self.dev.alloc_count();
        let st = self.st();
        st.graphs.last = Some(step::LastReplay {
            sig,
            read,
            buffers,
            tokens: st.inp.tokens.len(),
            out_rows: st.inp.out_rows.len(),
            cache: st.inp.cache,
        });
    }

    fn eager<T, E: From<BackendError>>(
        &mut self,
        f: &mut impl FnMut(&mut Self) -> Result<T, E>,
    ) -> Result<(T, Option<step::HostValues>), E> {
        self.reset_call();
        let g = &mut self.st().graphs;
        g.stats.eager += 1;
        // (no early launch after a call run op by op: whatever it changed is unchecked)
        g.last = None;
        self.copy_inputs();
        let out = f(self)?;
        self.finish()?;
        Ok((out, None))
    }

    /// Whether products and norms may be held back for folding (one token, no hook, not the
    /// persistent kernel; `RUSTORCH_CUDA_FOLD=0` turns it off).
    fn fold_ok(&self) -> bool {
        let a = crate::kernels::arith();
        self.hook.is_none() && crate::kernels::fold_enabled() && !a.mega && !self.dev.exact()
    }

    /// [`Backend::rope_angles`] with the host's angles (`RUSTORCH_CUDA_EXACT=1`): looked up
    /// in a table of every position so far, made on the host (glibc's cosf and sinf, as the
    /// CPU backend) and grown, outside recorded steps, when a position passes its end.
    fn exact_angles(
        &mut self,
        rope: &Rope,
        positions: &[u32],
        freqs: Option<&GpuVec<f32>>,
        out: &mut CudaAngles,
    ) -> Result<(), CudaError> {
        let dev = self.dev;
        let half = rope.n_rot / 2;
        let need = positions.iter().max().map_or(0, |&p| p as usize + 1);
        let key = RopeKey::of(rope, freqs);
        let t = &mut out.table;
        if t.key != Some(key) || t.n_pos < need {
            // (grown outside dry runs and captures: a step that needs it runs op by op)
            if dev.launch_mode() != LaunchMode::Run {
                return Err(CudaError::Unsupported(
                    "the RoPE table grows inside a recorded step".into(),
                ));
            }
            let n_pos = need.next_power_of_two().max(4096);
            let ff = match freqs {
                Some(f) => Some(f.read(dev)?),
                None => None,
            };
            let (mut c, mut s) = (vec![0f32; n_pos * half], vec![0f32; n_pos * half]);
            for p in 0..n_pos {
                let r = p * half..(p + 1) * half;
                rope.angles(p as f32, ff.as_deref(), &mut c[r.clone()], &mut s[r]);
            }
            t.key = None;
            t.cos.write(dev, &c)?;
            t.sin.write(dev, &s)?;
            t.key = Some(key);
            t.n_pos = n_pos;
        }
        let inp = &self.st().inp;
        let p = if inp.valid && inp.positions == positions {
            inp.at(inp.pos_off)
        } else {
            out.pos.write(dev, positions)?;
            out.pos.ptr()
        };
        // SAFETY: `p` holds the batch's positions (prepared, or just written).
        unsafe {
            dev.rope_table_at(
                p,
                positions.len(),
                half,
                &out.table.cos,
                &out.table.sin,
                &mut out.cos,
                &mut out.sin,
            )
        }
    }

    /// Launches a deferred product.
    fn flush_mm(&mut self) {
        if let Some(p) = self.pending_mm.take() {
            // SAFETY: the matrix and buffers `matmul` was given, alive through the call
            // (the model's weights, the architecture's workspace); `out` already has its
            // length.
            let r = unsafe {
                let x = GpuVec::<f32>::borrowed(p.x.0, p.x.1);
                let mut out = GpuVec::<f32>::borrowed(p.out.0, p.out.1);
                self.dev.matmul(&*p.w, &x, &mut out, &mut self.st().s)
            };
            self.keep(r);
        }
    }

    /// Launches a deferred norm.
    fn flush_norm(&mut self) {
        self.flush_norm_kinds(NORM_Q8 | NORM_Q8K);
    }

    /// Launches a deferred norm, in exact mode quantizing its output only as `kinds` asks
    /// (see [`CudaDevice::norm_kinds`]).
    fn flush_norm_kinds(&mut self, kinds: u8) {
        if let Some(p) = self.pending_norm.take() {
            // SAFETY: as in flush_mm: the buffers `rms_norm` was given (`y`: the live buffer
            // `add` was given, of x's length), `out` sized.
            let r = unsafe {
                let x = GpuVec::<f32>::borrowed(p.x.0, p.x.1);
                let y = p.y.map(|py| GpuVec::<f32>::borrowed(py, p.x.1));
                let w = GpuVec::<f32>::borrowed(p.w.0, p.w.1);
                let mut out = GpuVec::<f32>::borrowed(p.out.0, p.out.1);
                let dev = self.dev;
                let s = Some(&mut self.st().s);
                dev.add_rms_norm(&x, y.as_ref(), &w, p.eps, &mut out, s, kinds)
            };
            self.keep(r);
        }
    }

    /// Before products `ws` of `x`: launches a deferred norm, in exact mode with only the
    /// quantizations they take when `x` is its output.
    fn flush_norm_for(&mut self, x: &GpuVec<f32>, ws: &[&CudaMatrix]) {
        match &self.pending_norm {
            Some(p) if self.dev.exact() && p.out == (x.ptr(), x.len()) => {
                self.flush_norm_kinds(CudaDevice::norm_kinds(ws));
            }
            _ => self.flush_norm(),
        }
    }

    /// The deferred norm as a [`FoldNorm`] when `x` is its output (and it then counts as
    /// launched), else None after launching it. Also None where the product's blocks could
    /// not hold it (rows wider than [`FOLD_MAX_COLS`]) or where the product writes the
    /// norm's input (`outs`: every block reads all of it while others store their rows).
    fn take_norm_of(&mut self, x: &GpuVec<f32>, outs: &[u64]) -> Option<FoldNorm> {
        match &self.pending_norm {
            Some(p)
                if p.out == (x.ptr(), x.len())
                    && p.y.is_none()
                    && x.len() <= FOLD_MAX_COLS
                    && !outs.contains(&p.x.0) =>
            {
                let p = self.pending_norm.take()?;
                Some(FoldNorm {
                    x: p.x.0,
                    w: p.w.0,
                    eps: p.eps,
                    h: p.out.0,
                })
            }
            _ => {
                self.flush_norm();
                None
            }
        }
    }

    /// Launches a deferred residual add.
    fn flush_add(&mut self) {
        if let Some((x, y, n)) = self.pending_add.take() {
            // SAFETY: the addresses are of the two buffers `add` was given, which the
            // architecture keeps alive through the call.
            let r = unsafe { self.dev.add_raw(x, y, n) };
            self.keep(r);
            self.st().s.acts_of = None;
        }
    }

    /// Launches deferred rotations.
    fn flush_rope(&mut self) {
        let Some(a) = self.rope_args.take() else {
            self.pending_rope.clear();
            return;
        };
        for (p, n) in std::mem::take(&mut self.pending_rope) {
            // SAFETY: the buffers `rope` was given and the angles stay alive through the
            // call (the architecture's workspace).
            let r = unsafe {
                let mut x = GpuVec::<f32>::borrowed(p, n);
                let (c, s) = (
                    GpuVec::<f32>::borrowed(a.cos.0, a.cos.1),
                    GpuVec::<f32>::borrowed(a.sin.0, a.sin.1),
                );
                self.dev.rope(&mut x, &a.rope, a.head_dim, &c, &s)
            };
            self.keep(r);
        }
    }

    /// Before an op other than a product: launches deferred adds and rotations, and
    /// forgets the quantized activations a norm left (the op may change their buffer).
    fn touch(&mut self) {
        self.flush_mm();
        self.flush_norm();
        self.flush_add();
        self.flush_rope();
        self.st().s.acts_of = None;
    }

    /// Forgets what the last run of the architecture's code left behind.
    fn reset_call(&mut self) {
        self.err = None;
        self.reads.clear();
        self.pending_add = None;
        self.pending_rope.clear();
        self.rope_args = None;
        self.pending_mm = None;
        self.pending_norm = None;
        self.st().s.acts_of = None;
        self.attn_in = None;
        self.attn_layer = 0;
        self.layer = 0;
    }

    /// Values of a device buffer (waits for the stream).
    fn read_back(&mut self, (ptr, len): (u64, usize)) -> Result<step::HostValues, BackendError> {
        let dev = self.dev;
        let t0 = std::time::Instant::now();
        let mut synced = t0;
        // SAFETY: the buffer was read by the call (it is a live workspace buffer).
        let r = unsafe { self.st().out_host.read(dev, ptr, len, &mut synced) };
        let t1 = std::time::Instant::now();
        if r.is_ok() {
            self.st().inp.in_flight = false;
        }
        let g = &mut self.st().graphs;
        g.stats.sync_ns += (synced - t0).as_nanos() as u64;
        g.stats.copy_ns += (t1 - synced).as_nanos() as u64;
        g.read_done = Some(t1);
        r.map_err(be_err)
    }

    /// Waits for the queued ops and returns the first error of the call, if any.
    pub fn finish(&mut self) -> Result<(), BackendError> {
        self.touch();
        self.check()?;
        self.dev.synchronize().map_err(be_err)?;
        self.st().inp.in_flight = false;
        Ok(())
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
        rope: Option<RopeArgs>,
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
        let dev = self.dev;
        let inp = &self.st().inp;
        let prepared = inp.valid
            && inp.positions == rows.positions
            && inp.seq_ids == rows.seq_ids
            && inp.cells == cells;
        let (slots, descs, max_cells) = if prepared {
            (inp.at(inp.slot_off), inp.at(inp.desc_off), inp.max_cells)
        } else {
            if self.attn_in.is_none() || spec.layer <= self.attn_layer {
                self.attn_in = None;
                self.attn_in = Some(AttnInputs::upload(dev, rows, cache, cells)?);
            }
            self.attn_layer = spec.layer;
            let Some(ai) = self.attn_in.as_ref() else {
                return Ok(());
            };
            (ai.buf.ptr(), ai.rows.ptr(), ai.max_cells)
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
        let (lk, lv) = (store.layer_k(l), store.layer_v(l));
        // one row (decode), no debugging hook (it would read q and k rotated): the
        // attention kernel rotates q and k and writes the cache itself
        let e = crate::kernels::ATTN_E
            .iter()
            .copied()
            .find(|&e| spec.head_dim <= 32 * e);
        let inline = rope.filter(|a| {
            n == 1
                && self.hook.is_none()
                && !crate::kernels::arith().mega
                && a.head_dim == spec.head_dim
                && a.rope.n_rot <= a.head_dim
                && a.rope.n_rot.is_multiple_of(2)
                && e.is_some_and(|e| {
                    a.rope.mode != RopeMode::Neox || (a.rope.n_rot / 2).is_multiple_of(e)
                })
                && a.cos.1 >= a.rope.n_rot / 2
                && a.sin.1 >= a.rope.n_rot / 2
                && k.len() == kvd
                && v.len() == kvd
        });
        let ar = inline.map(|a| crate::kernels::AttnRope {
            k: k.ptr(),
            v: v.ptr(),
            cos: a.cos.0,
            sin: a.sin.0,
            pool_k: lk,
            pool_v: lv,
            new_slot: slots,
            n_rot: a.rope.n_rot as i32,
            neox: i32::from(a.rope.mode == RopeMode::Neox),
        });
        // SAFETY: the slots come from the cache's bookkeeping, below the store's slot
        // count; the descriptors point into buffers that live as long as this call; with
        // `ar`, `slots` holds the row's new slot, inside the pools.
        unsafe {
            match (rope, &ar) {
                // the attention launch rotates and writes the cache itself
                (_, Some(_)) => {}
                (Some(a), None) => {
                    // q and k rotated here (their `rope` calls were deferred), k and v
                    // written to the cache in the same launch
                    let (mut qv, mut kv) = (
                        GpuVec::<f32>::borrowed(q.ptr(), q.len()),
                        GpuVec::<f32>::borrowed(k.ptr(), k.len()),
                    );
                    let (c, s) = (
                        GpuVec::<f32>::borrowed(a.cos.0, a.cos.1),
                        GpuVec::<f32>::borrowed(a.sin.0, a.sin.1),
                    );
                    dev.rope_kv_write(
                        &mut qv,
                        &mut kv,
                        v,
                        &a.rope,
                        a.head_dim,
                        &c,
                        &s,
                        spec.n_head_kv,
                        lk,
                        lv,
                        slots,
                        n,
                    )?;
                }
                (None, None) => dev.kv_write(k, v, kvd, lk, lv, slots, n)?,
            }
            dev.attention(
                &shape,
                q,
                lk,
                lv,
                descs,
                n,
                max_cells,
                out,
                None,
                ar.as_ref(),
                &mut self.st().s,
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
        self.touch();
        self.check()?;
        let dev = self.dev;
        let inp = &self.st().inp;
        if inp.valid && inp.tokens == tokens && tokens.iter().all(|&t| (t as usize) < table.n_rows)
        {
            let ids = inp.at(inp.tok_off);
            // SAFETY: the prepared ids are these tokens, checked against the table.
            return unsafe { dev.get_rows_at(table, ids, tokens.len(), out) }.map_err(be_err);
        }
        dev.get_rows(table, tokens, out, &mut self.st().s)
            .map_err(be_err)
    }

    fn rms_norm(&mut self, x: &GpuVec<f32>, w: &GpuVec<f32>, eps: f32, out: &mut GpuVec<f32>) {
        // a deferred `x += y` joins the norm's launch; the norm also quantizes its output
        // for the product that follows
        self.flush_mm();
        self.flush_norm();
        let y = match self.pending_add {
            Some((px, py, n)) if px == x.ptr() && n == x.len() => {
                self.pending_add = None;
                Some(py)
            }
            _ => {
                self.flush_add();
                None
            }
        };
        // held back (not while rotations wait for the attention: they come first in program
        // order): a float product of `out` may compute it (take_norm_of); in exact mode the
        // products that read it say which quantizations of `out` they take (flush_norm_for)
        let hold = x.len() == w.len()
            && self.pending_rope.is_empty()
            && ((y.is_none() && self.fold_ok()) || (self.dev.exact() && self.hook.is_none()));
        let dev = self.dev;
        if let Err(e) = out.resize(dev, x.len()) {
            self.keep(Err(e));
            return;
        }
        self.st().s.acts_of = None;
        self.pending_norm = Some(PendingNorm {
            x: (x.ptr(), x.len()),
            y,
            w: (w.ptr(), w.len()),
            eps,
            out: (out.ptr(), out.len()),
        });
        if !hold {
            self.flush_norm();
        }
    }

    fn rms_norm_inplace(&mut self, x: &mut GpuVec<f32>, w: &GpuVec<f32>, eps: f32) {
        self.touch();
        let r = self.dev.rms_norm_inplace(x, w, eps);
        self.keep(r);
    }

    fn matmul(
        &mut self,
        w: &CudaMatrix,
        x: &GpuVec<f32>,
        out: &mut GpuVec<f32>,
    ) -> Result<(), BackendError> {
        self.flush_mm();
        self.flush_add();
        self.flush_rope();
        let dev = self.dev;
        if self.fold_ok() && x.len() == w.n_cols && dev.float_job_ok(w) {
            if w.n_rows <= FOLD_MAX_ROWS {
                if let Some(norm) = self.take_norm_of(x, &[out.ptr()]) {
                    self.check()?;
                    return dev
                        .mmv1_job(&[w], x, &mut [out], 0, Some(&norm))
                        .map_err(be_err);
                }
            }
            // held back: an `add(_, out)` next may take it (see `add`)
            self.flush_norm();
            self.check()?;
            out.resize(dev, w.n_rows).map_err(be_err)?;
            self.pending_mm = Some(PendingMm {
                w: w as *const CudaMatrix,
                x: (x.ptr(), x.len()),
                out: (out.ptr(), out.len()),
            });
            return Ok(());
        }
        self.flush_norm_for(x, &[w]);
        self.check()?;
        dev.matmul(w, x, out, &mut self.st().s).map_err(be_err)
    }

    fn matmul_many(
        &mut self,
        ws: &[&CudaMatrix],
        x: &GpuVec<f32>,
        outs: &mut [&mut GpuVec<f32>],
    ) -> Result<(), BackendError> {
        self.flush_mm();
        self.flush_add();
        self.flush_rope();
        let dev = self.dev;
        let float_job = (1..=3).contains(&ws.len())
            && x.len() == ws[0].n_cols
            && ws
                .iter()
                .all(|w| w.ty == ws[0].ty && w.n_cols == ws[0].n_cols && dev.float_job_ok(w));
        let rows: usize = ws.iter().map(|w| w.n_rows).sum();
        if float_job && outs.len() == ws.len() && rows <= FOLD_MAX_ROWS && self.fold_ok() {
            let mut out_ptrs = [0u64; 3];
            for (d, o) in out_ptrs.iter_mut().zip(outs.iter()) {
                *d = o.ptr();
            }
            if let Some(norm) = self.take_norm_of(x, &out_ptrs[..outs.len()]) {
                self.check()?;
                return dev.mmv1_job(ws, x, outs, 0, Some(&norm)).map_err(be_err);
            }
        }
        self.flush_norm_for(x, ws);
        self.check()?;
        dev.matmul_many(ws, x, outs, &mut self.st().s)
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
        self.flush_mm();
        self.flush_add();
        self.flush_rope();
        let dev = self.dev;
        let float_job = wg.ty == wu.ty
            && wg.n_rows == wu.n_rows
            && wg.n_cols == wu.n_cols
            && x.len() == wg.n_cols
            && dev.float_job_ok(wg);
        if float_job && wg.n_rows <= FOLD_MAX_ROWS && self.fold_ok() {
            if let Some(norm) = self.take_norm_of(x, &[gate.ptr(), up.ptr()]) {
                self.check()?;
                let mut spare = GpuVec::default();
                let glu = 1 + i32::from(act == Glu::Gelu);
                return dev
                    .mmv1_job(&[wg, wu], x, &mut [gate, &mut spare], glu, Some(&norm))
                    .map_err(be_err);
            }
        }
        self.flush_norm_for(x, &[wg, wu]);
        self.check()?;
        if self.hook.is_none() {
            if let Some(r) = dev.glu_fused(act == Glu::Gelu, wg, wu, x, gate, &mut self.st().s) {
                return r.map_err(be_err);
            }
        }
        dev.matmul_many(&[wg, wu], x, &mut [&mut *gate, &mut *up], &mut self.st().s)
            .map_err(be_err)?;
        if self.hook.is_some() {
            let il = self.layer;
            self.hook("ffn_gate", il, gate);
            self.hook("ffn_up", il, up);
        }
        self.dev
            .glu(act == Glu::Gelu, gate, up, wg.n_rows)
            .map_err(be_err)
    }

    fn moe(
        &mut self,
        _moe: &Moe<'_, CudaMatrix>,
        _x: &GpuVec<f32>,
        _out: &mut GpuVec<f32>,
    ) -> Result<(), BackendError> {
        self.touch();
        Err(be_err(CudaError::Unsupported(
            "mixture-of-experts feed-forward (not yet on the GPU)".into(),
        )))
    }

    fn add(&mut self, x: &mut GpuVec<f32>, y: &GpuVec<f32>) {
        if let Some(p) = &self.pending_mm {
            if p.out == (y.ptr(), y.len()) && x.len() == y.len() && x.ptr() != p.x.0 {
                // the held-back product adds its rows into x as it stores them
                let Some(p) = self.pending_mm.take() else {
                    return;
                };
                self.flush_norm();
                self.flush_add();
                self.flush_rope();
                self.st().s.acts_of = None;
                // SAFETY: as in flush_mm.
                let r = unsafe {
                    let xin = GpuVec::<f32>::borrowed(p.x.0, p.x.1);
                    let mut out = GpuVec::<f32>::borrowed(p.out.0, p.out.1);
                    match self.dev.matmul_acc(&*p.w, &xin, &mut out, x) {
                        Some(r) => r,
                        None => self
                            .dev
                            .matmul(&*p.w, &xin, &mut out, &mut self.st().s)
                            .and_then(|_| self.dev.add(x, y)),
                    }
                };
                self.keep(r);
                return;
            }
        }
        self.touch();
        if y.len() < x.len() {
            let r = self.dev.add(x, y);
            self.keep(r);
            return;
        }
        self.pending_add = Some((x.ptr(), y.ptr(), x.len()));
    }

    fn add_bias(&mut self, x: &mut GpuVec<f32>, b: &GpuVec<f32>) {
        self.touch();
        let r = self.dev.add_bias(x, b);
        self.keep(r);
    }

    fn scale(&mut self, x: &mut GpuVec<f32>, s: f32) {
        self.touch();
        let r = self.dev.scale(x, s);
        self.keep(r);
    }

    fn softcap(&mut self, x: &mut GpuVec<f32>, cap: f32) {
        self.touch();
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
        self.touch();
        if self.dev.exact() {
            let r = self.exact_angles(rope, positions, freqs, out);
            self.keep(r);
            return;
        }
        let dev = self.dev;
        let inp = &self.st().inp;
        let r = if inp.valid && inp.positions == positions {
            let p = inp.at(inp.pos_off);
            // SAFETY: the prepared positions are these.
            unsafe {
                dev.rope_angles_at(rope, p, positions.len(), freqs, &mut out.cos, &mut out.sin)
            }
        } else {
            out.pos
                .write(dev, positions)
                .and_then(|_| dev.rope_angles(rope, &out.pos, freqs, &mut out.cos, &mut out.sin))
        };
        self.keep(r);
    }

    fn rope(&mut self, x: &mut GpuVec<f32>, rope: &Rope, head_dim: usize, a: &CudaAngles) {
        self.flush_mm();
        self.flush_norm();
        self.flush_add();
        self.st().s.acts_of = None;
        let args = RopeArgs {
            rope: *rope,
            head_dim,
            cos: (a.cos.ptr(), a.cos.len()),
            sin: (a.sin.ptr(), a.sin.len()),
        };
        let same = self.rope_args.is_some_and(|p| p.same(&args));
        if !self.pending_rope.is_empty() && (self.pending_rope.len() >= 2 || !same) {
            self.flush_rope();
        }
        if rope.n_rot < 2 {
            return;
        }
        // deferred: attention does it with its cache write (see `pending_rope`)
        self.pending_rope.push((x.ptr(), x.len()));
        self.rope_args = Some(args);
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
        self.flush_mm();
        self.flush_norm();
        self.flush_add();
        let fused = self.pending_rope[..] == [(q.ptr(), q.len()), (k.ptr(), k.len())];
        let rope = if fused {
            self.pending_rope.clear();
            self.rope_args.take()
        } else {
            None
        };
        self.touch();
        let r = self.attention_in_place(spec, rows, q, k, v, cache, cells, out, rope);
        self.keep(r);
    }

    fn keep_rows(&mut self, x: &mut GpuVec<f32>, width: usize, rows: &[usize]) {
        if x.len() == rows.len() * width && rows.iter().enumerate().all(|(i, &r)| i == r) {
            return;
        }
        self.touch();
        let dev = self.dev;
        let st = self.st();
        let ok = rows.iter().all(|&r| (r + 1) * width <= x.len());
        let r = if ok
            && st.inp.valid
            && st.inp.out_rows.len() == rows.len()
            && st
                .inp
                .out_rows
                .iter()
                .zip(rows)
                .all(|(&a, &b)| a as usize == b)
        {
            let p = st.inp.at(st.inp.out_off);
            // SAFETY: the prepared row numbers are these, checked against `x`.
            unsafe { dev.gather_rows_at(x, width, p, rows.len(), &mut st.tmp) }
        } else {
            let ids: Vec<u32> = rows.iter().map(|&r| r as u32).collect();
            dev.gather_rows(x, width, &ids, &mut st.tmp, &mut st.s)
        };
        // copied back rather than swapped: x keeps its buffer, so running the call's code
        // again (a graph's dry run, then its capture) launches the same
        let r = r.and_then(|_| dev.copy(x, &st.tmp));
        self.keep(r);
    }

    fn read<'b>(&mut self, x: &'b GpuVec<f32>) -> Cow<'b, [f32]> {
        self.touch();
        if self.dev.launch_mode() != LaunchMode::Run {
            self.reads.push((x.ptr(), x.len()));
            return Cow::Owned(Vec::new());
        }
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
