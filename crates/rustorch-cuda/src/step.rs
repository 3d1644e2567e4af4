//! What a GPU forward call keeps from one call to the next ([`CudaState`]): the kernels'
//! scratch buffers, the call's inputs in device memory, and the decode steps captured as
//! CUDA graphs.
//!
//! **Inputs.** [`crate::Cuda::prepare`] packs everything a call reads from the host (token
//! ids, positions, the rows that want logits, the slot of every new cache cell, each row's
//! attention descriptor and its sequence's slots and positions) into one pinned buffer and
//! uploads it with one asynchronous copy; the ops then read it in place. The only other
//! transfer of a call is the download of its logits.
//!
//! **Graphs.** A call that [`crate::Cuda::run`] may replay first runs the architecture's
//! code with launches switched off: every launch adds its kernel, grid and argument bytes
//! to a signature. A graph captured from a call with the same signature launches exactly
//! those kernels with exactly those arguments (every input that changes from step to step
//! is data in device memory), so it is replayed in the call's place; otherwise the call is
//! captured (launches recorded into a new graph, which must have the same signature) and
//! then replayed. A few graphs are kept, the least recently used dropped first.
//!
//! **Early launch.** The dry run costs the host ~50 µs a step, time the GPU would spend
//! waiting. So where the last call replayed a graph, the next call on the same KV cache with
//! as many tokens and logit rows, no device buffer allocated or freed in between (every
//! address in the graph is live), launches that graph *first* and does its dry run while the
//! GPU works (a graph holds its cache's addresses: on another cache it would write this
//! step's cells into the wrong one). Only a
//! dry run with the same signature (and the same logits buffer) lets the call return the
//! graph's results; otherwise the call goes on as above (replay, capture or op by op),
//! which runs the step again after the early graph on the same stream: a step's writes
//! (its new cache cells, scratch, logits) depend only on its inputs, so the second run
//! overwrites every one of them. Four misses in a row pause early launches for 64 calls.

use std::ffi::c_void;

use cudarc::driver::sys;
use cudarc::driver::CudaGraph;

use crate::device::{CudaDevice, GpuVec};
use crate::error::{CudaError, Result};
use crate::kernels::Scratch;

/// Graphs kept per model.
const MAX_GRAPHS: usize = 8;

/// Host memory the driver can copy from asynchronously (page-locked), holding u32 words.
pub(crate) struct Pinned {
    ptr: *mut u32,
    cap: usize,
}

// SAFETY: the buffer is plain host memory owned by this value; access goes through &mut.
unsafe impl Send for Pinned {}

impl Default for Pinned {
    fn default() -> Self {
        Pinned {
            ptr: std::ptr::null_mut(),
            cap: 0,
        }
    }
}

impl Pinned {
    /// Room for `n` words (contents lost when it grows).
    fn reserve(&mut self, dev: &CudaDevice, n: usize) -> Result<()> {
        if n <= self.cap {
            return Ok(());
        }
        self.free();
        let cap = n.max(2 * self.cap).max(1024);
        dev.context().bind_to_thread()?;
        // SAFETY: a fresh allocation of `cap` words, freed in `free`.
        let p = unsafe { cudarc::driver::result::malloc_host(cap * 4, 0) }?;
        self.ptr = p.cast::<u32>();
        self.cap = cap;
        Ok(())
    }

    /// The values of `n` f32 at device address `src` (waits for the stream), copied through
    /// this page-locked buffer: the driver then copies them directly, not through a staging
    /// buffer of its own.
    ///
    /// # Safety
    /// `src` must be live device memory of at least `n` values. `synced` is set to when
    /// the wait for the device ended.
    pub(crate) unsafe fn read_f32(
        &mut self,
        dev: &CudaDevice,
        src: u64,
        n: usize,
        synced: &mut std::time::Instant,
    ) -> Result<Vec<f32>> {
        self.reserve(dev, n)?;
        copy_back(dev, self.words(n), src, synced)?;
        Ok(self.words(n).iter().map(|&b| f32::from_bits(b)).collect())
    }

    fn words(&mut self, n: usize) -> &mut [u32] {
        assert!(n <= self.cap);
        if n == 0 {
            return &mut [];
        }
        // SAFETY: `n` words of the allocation, borrowed mutably through self.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, n) }
    }

    fn free(&mut self) {
        if !self.ptr.is_null() {
            // SAFETY: allocated by malloc_host; callers synchronize before dropping (every
            // forward call ends by waiting for the stream).
            unsafe {
                let _ = cudarc::driver::result::free_host(self.ptr.cast::<c_void>());
            }
            self.ptr = std::ptr::null_mut();
            self.cap = 0;
        }
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        self.free();
    }
}

/// Copies `dst.len()` words from device address `src` into page-locked `dst` and waits for
/// the stream; `synced` is set to when the wait ended.
///
/// # Safety
/// `src` must be live device memory of at least `dst.len()` words.
unsafe fn copy_back(
    dev: &CudaDevice,
    dst: &mut [u32],
    src: u64,
    synced: &mut std::time::Instant,
) -> Result<()> {
    if !dst.is_empty() {
        cudarc::driver::result::memcpy_dtoh_async(dst, src, dev.stream().cu_stream())?;
    }
    dev.stream().synchronize()?;
    *synced = std::time::Instant::now();
    Ok(())
}

/// Page-locked host memory for f32 values read back from the device, shared with the
/// [`HostValues`] views handed out of it (the context is kept alive until it is freed).
pub(crate) struct PinnedF32 {
    ptr: *mut f32,
    cap: usize,
    ctx: std::sync::Arc<cudarc::driver::CudaContext>,
}

// SAFETY: plain host memory owned by this value; written only through `&mut` (a pool
// entry no view shares, `Arc::get_mut`), read-only while shared.
unsafe impl Send for PinnedF32 {}
unsafe impl Sync for PinnedF32 {}

impl PinnedF32 {
    fn new(dev: &CudaDevice, cap: usize) -> Result<Self> {
        dev.context().bind_to_thread()?;
        // SAFETY: a fresh allocation of `cap` values, freed in drop.
        let p = unsafe { cudarc::driver::result::malloc_host(cap.max(1) * 4, 0) }?;
        Ok(PinnedF32 {
            ptr: p.cast::<f32>(),
            cap,
            ctx: dev.context().clone(),
        })
    }
}

impl Drop for PinnedF32 {
    fn drop(&mut self) {
        // SAFETY: allocated by malloc_host; no copy into it is in flight (a read-back waits
        // for its copy before returning a view, and the pool drops its entries only after
        // the calls that filled them).
        unsafe {
            let _ = self.ctx.bind_to_thread();
            let _ = cudarc::driver::result::free_host(self.ptr.cast::<c_void>());
        }
    }
}

/// Values a step read back from the device (its logits), without a copy on the host: a
/// view of the page-locked buffer the device copied them into, which the backend does not
/// reuse while a view of it lives (or, past [`READ_POOL`] such buffers in use, an owned
/// copy). llama.cpp likewise hands out its output buffer.
#[derive(Clone)]
pub struct HostValues(HostRepr);

#[derive(Clone)]
enum HostRepr {
    Pinned(std::sync::Arc<PinnedF32>, usize),
    Owned(Vec<f32>),
}

impl std::ops::Deref for HostValues {
    type Target = [f32];
    fn deref(&self) -> &[f32] {
        match &self.0 {
            // SAFETY: `len` <= the buffer's capacity, filled before the view was made and
            // not written while the view (a strong count) lives.
            HostRepr::Pinned(b, len) => unsafe { std::slice::from_raw_parts(b.ptr, *len) },
            HostRepr::Owned(v) => v,
        }
    }
}

impl std::fmt::Debug for HostValues {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "HostValues({} values)", self.len())
    }
}

impl From<HostValues> for Vec<f32> {
    fn from(v: HostValues) -> Vec<f32> {
        match v.0 {
            HostRepr::Owned(v) => v,
            HostRepr::Pinned(..) => v.to_vec(),
        }
    }
}

/// Whether a call's inputs reach the device through its first kernel
/// ([`Prepared::copy_in`]) rather than a copy call before it (`RUSTORCH_CUDA_INPUT_COPY=1`,
/// timing only).
pub(crate) fn inputs_in_graph() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("RUSTORCH_CUDA_INPUT_COPY").map_or(true, |v| v != "1"))
}

/// Timing only (`RUSTORCH_CUDA_READ_COPY=1`): every read-back copied into a new vector,
/// as before [`HostValues`] views.
fn read_copies() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("RUSTORCH_CUDA_READ_COPY").is_ok_and(|v| v == "1"))
}

/// Read-back buffers kept per model: a caller holding this many steps' logits at once
/// gets copies from then on.
pub(crate) const READ_POOL: usize = 4;

/// The page-locked buffers steps' logits are read back into (see [`HostValues`]).
#[derive(Default)]
pub(crate) struct ReadPool {
    bufs: Vec<std::sync::Arc<PinnedF32>>,
    /// For copies once every buffer is in use.
    spare: Pinned,
}

impl ReadPool {
    /// The `n` values at device address `src` (waits for the stream); `synced` is set to
    /// when the wait ended.
    ///
    /// # Safety
    /// `src` must be live device memory of at least `n` values.
    pub(crate) unsafe fn read(
        &mut self,
        dev: &CudaDevice,
        src: u64,
        n: usize,
        synced: &mut std::time::Instant,
    ) -> Result<HostValues> {
        if read_copies() {
            let v = self.spare.read_f32(dev, src, n, synced)?;
            return Ok(HostValues(HostRepr::Owned(v)));
        }
        let free = self
            .bufs
            .iter()
            .position(|b| std::sync::Arc::strong_count(b) == 1 && b.cap >= n);
        let unused = self
            .bufs
            .iter()
            .position(|b| std::sync::Arc::strong_count(b) == 1);
        let cap = n.next_multiple_of(1 << 16);
        let at = match (free, unused) {
            (Some(i), _) => i,
            // one no view holds, too small: replaced by a larger one
            (None, Some(i)) => {
                self.bufs[i] = std::sync::Arc::new(PinnedF32::new(dev, cap)?);
                i
            }
            (None, None) if self.bufs.len() < READ_POOL => {
                self.bufs
                    .push(std::sync::Arc::new(PinnedF32::new(dev, cap)?));
                self.bufs.len() - 1
            }
            (None, None) => {
                // every buffer is still viewed: a copy
                let v = self.spare.read_f32(dev, src, n, synced)?;
                return Ok(HostValues(HostRepr::Owned(v)));
            }
        };
        let Some(buf) = std::sync::Arc::get_mut(&mut self.bufs[at]) else {
            return Err(CudaError::Unsupported(
                "read-back buffer still shared".into(),
            ));
        };
        // SAFETY: `n` values of this buffer, which no view shares (get_mut).
        let dst = std::slice::from_raw_parts_mut(buf.ptr.cast::<u32>(), n);
        copy_back(dev, dst, src, synced)?;
        Ok(HostValues(HostRepr::Pinned(self.bufs[at].clone(), n)))
    }
}

/// One call's inputs on the device (see the module doc), and their host values, so that
/// an op can tell that what it is given is what was uploaded.
#[derive(Default)]
pub(crate) struct Prepared {
    pub valid: bool,
    host: Pinned,
    pub buf: GpuVec<u32>,
    pub tokens: Vec<u32>,
    pub positions: Vec<u32>,
    pub seq_ids: Vec<u32>,
    pub cells: Vec<usize>,
    pub out_rows: Vec<u32>,
    /// Words the call's first kernel copies from `host` into `buf` (0: copied by the
    /// upload itself).
    pub copy_in: usize,
    /// The device may still read `host` (an upload since the last wait for the stream; a
    /// call that failed before its wait leaves it set, and the next upload waits first).
    pub in_flight: bool,
    /// Word offsets in `buf`.
    pub tok_off: usize,
    pub pos_off: usize,
    pub out_off: usize,
    pub slot_off: usize,
    pub desc_off: usize,
    /// The most cells of a row's sequence.
    pub max_cells: usize,
    /// The KV cache the call runs on: its key and value rows' device addresses (a graph
    /// holds them; another cache's step must not replay it).
    pub cache: (u64, u64),
}

impl Prepared {
    /// Device address of word `off`.
    pub fn at(&self, off: usize) -> u64 {
        self.buf.ptr() + (off * 4) as u64
    }

    /// The page-locked words the call's first kernel copies (see `copy_in`); with unified
    /// addressing the device reads them at their host address.
    pub fn host_words(&self) -> u64 {
        self.host.ptr as u64
    }

    /// Packs and uploads one call's inputs. `seqs`: each sequence of the batch with its
    /// cells' slots and positions. Returns the host time of its copy call in nanoseconds (0
    /// with `in_graph`: the call's first kernel copies them).
    #[allow(clippy::too_many_arguments)]
    pub fn upload(
        &mut self,
        dev: &CudaDevice,
        tokens: &[u32],
        positions: &[u32],
        seq_ids: &[u32],
        cells: &[usize],
        new_slots: &[u32],
        out_rows: &[usize],
        seqs: &[(u32, &[u32], &[u32])],
        in_graph: bool,
    ) -> Result<u64> {
        self.valid = false;
        if self.in_flight {
            dev.stream().synchronize()?;
            self.in_flight = false;
        }
        let n = tokens.len();
        let n_out = out_rows.len();
        self.tok_off = 0;
        self.pos_off = n;
        self.out_off = 2 * n;
        self.slot_off = 2 * n + n_out;
        // descriptors are u64 triples: 8-byte aligned
        self.desc_off = (3 * n + n_out).next_multiple_of(2);
        let table_off = self.desc_off + 6 * n;
        let total = table_off + seqs.iter().map(|s| 2 * s.1.len()).sum::<usize>();
        if self.buf.capacity() < total {
            let cap = total.max(2 * self.buf.capacity()).max(4096);
            self.buf.resize(dev, cap)?;
        }
        self.buf.resize(dev, total)?;
        // (the whole capacity may be copied: see `in_graph`)
        self.host.reserve(dev, self.buf.capacity())?;
        let base = self.buf.ptr();
        let w = self.host.words(total);
        w[..n].copy_from_slice(tokens);
        w[n..2 * n].copy_from_slice(positions);
        for (k, &r) in out_rows.iter().enumerate() {
            w[2 * n + k] = r as u32;
        }
        w[self.slot_off..self.slot_off + n].copy_from_slice(new_slots);
        let mut at = Vec::with_capacity(seqs.len());
        let mut off = table_off;
        for &(seq, slots, pos) in seqs {
            at.push((seq, off, slots.len()));
            w[off..off + slots.len()].copy_from_slice(slots);
            w[off + slots.len()..off + 2 * slots.len()].copy_from_slice(pos);
            off += 2 * slots.len();
        }
        self.max_cells = 0;
        for i in 0..n {
            let (o, nc) = at
                .iter()
                .find(|a| a.0 == seq_ids[i])
                .map_or((0, 0), |a| (a.1, a.2));
            self.max_cells = self.max_cells.max(nc);
            let d = [
                base + (o * 4) as u64,
                base + ((o + nc) * 4) as u64,
                nc as u64 | (u64::from(positions[i]) << 32),
            ];
            let dw = self.desc_off + 6 * i;
            for (j, v) in d.iter().enumerate() {
                w[dw + 2 * j] = *v as u32;
                w[dw + 2 * j + 1] = (*v >> 32) as u32;
            }
        }
        let t0 = std::time::Instant::now();
        self.copy_in = 0;
        if in_graph {
            // copied by the call's first kernel (Cuda::copy_inputs): in a replayed step, a
            // node of its graph, so no copy call here
            self.copy_in = self.buf.capacity();
        } else {
            dev.check_copy_allowed()?;
            dev.context().bind_to_thread()?;
            // SAFETY: `total` words of pinned host memory into the buffer sized above; the
            // host words are not touched again before the call ends (it waits for the
            // stream).
            unsafe {
                sys::cuMemcpyHtoDAsync_v2(
                    base,
                    self.host.ptr.cast::<c_void>(),
                    total * 4,
                    dev.stream().cu_stream(),
                )
                .result()?;
            }
        }
        let copy_ns = t0.elapsed().as_nanos() as u64;
        self.tokens.clear();
        self.tokens.extend_from_slice(tokens);
        self.positions.clear();
        self.positions.extend_from_slice(positions);
        self.seq_ids.clear();
        self.seq_ids.extend_from_slice(seq_ids);
        self.cells.clear();
        self.cells.extend_from_slice(cells);
        self.out_rows.clear();
        self.out_rows.extend(out_rows.iter().map(|&r| r as u32));
        self.valid = true;
        self.in_flight = true;
        Ok(copy_ns)
    }
}

/// A captured step: its signature and when it was last used.
pub(crate) struct Captured {
    pub sig: u64,
    pub graph: GraphBox,
    pub used: u64,
}

pub(crate) struct GraphBox(pub CudaGraph);

// SAFETY: a graph is only touched by the thread holding the CudaState (behind the model's
// lock); the driver objects are not tied to a thread.
unsafe impl Send for GraphBox {}

/// Counts of how calls ran, for benchmarks and tests.
#[derive(Debug, Default, Clone, Copy)]
pub struct GraphStats {
    /// Calls run op by op.
    pub eager: u64,
    /// Calls captured into a new graph (and replayed).
    pub captured: u64,
    /// Calls replayed from a kept graph.
    pub replayed: u64,
    /// Captures that failed (those steps run op by op from then on).
    pub failed: u64,
    /// Calls run as one persistent kernel (see [`crate::mega`]).
    pub mega: u64,
    /// Replays launched before their dry run (see [`Graphs::last`]) that the dry run then
    /// confirmed (also counted in `replayed`), and those it did not (the step then ran
    /// again as the dry run said).
    pub early: u64,
    pub early_missed: u64,
    /// Host time of calls that may use graphs, in nanoseconds: uploading inputs, the dry
    /// runs, capturing, and launching and reading back replays.
    pub prepare_ns: u64,
    pub dry_ns: u64,
    pub capture_ns: u64,
    pub replay_ns: u64,
    /// Host time on a token's critical path, in nanoseconds: `sync_ns` from the read-back's
    /// start to the end of its wait for the device, `copy_ns` its copy of the values out of
    /// the page-locked buffer, `gap_ns` from the read-back's return to the next call's early
    /// launch of its graph (`gaps` such calls); the GPU idles through the last two.
    pub sync_ns: u64,
    pub copy_ns: u64,
    pub gap_ns: u64,
    pub gaps: u64,
    /// Host time of the early launches' graph launch calls, and of the input uploads' copy
    /// calls (part of `prepare_ns`).
    pub launch_ns: u64,
    pub upload_ns: u64,
}

/// The graph the last call replayed, and what must be unchanged for the next call to
/// launch it before its dry run.
#[derive(Clone, Copy)]
pub(crate) struct LastReplay {
    pub sig: u64,
    /// The buffer whose values the call returned.
    pub read: (u64, usize),
    /// [`crate::device::CudaDevice::alloc_count`] after the call: no buffer allocated or
    /// freed since, so every address the graph holds is still live.
    pub buffers: u64,
    pub tokens: usize,
    pub out_rows: usize,
    /// [`Prepared::cache`] of the call.
    pub cache: (u64, u64),
}

#[derive(Default)]
pub(crate) struct Graphs {
    pub list: Vec<Captured>,
    /// Set after a replay; see [`LastReplay`].
    pub last: Option<LastReplay>,
    /// Early launches the dry run did not confirm, in a row; at [`EARLY_MISSES`] early
    /// launches pause for [`EARLY_PAUSE`] calls.
    pub early_misses: u32,
    pub early_pause: u32,
    /// Signatures whose capture failed (run op by op from then on).
    pub bad: Vec<u64>,
    pub tick: u64,
    pub stats: GraphStats,
    /// When the last read-back returned (for [`GraphStats::gap_ns`]).
    pub read_done: Option<std::time::Instant>,
}

impl Graphs {
    pub fn find(&mut self, sig: u64) -> Option<&Captured> {
        self.tick += 1;
        let t = self.tick;
        let g = self.list.iter_mut().find(|g| g.sig == sig)?;
        g.used = t;
        Some(g)
    }

    pub fn insert(&mut self, c: Captured) {
        if self.list.len() >= MAX_GRAPHS {
            if let Some(i) = (0..self.list.len()).min_by_key(|&i| self.list[i].used) {
                self.list.swap_remove(i);
            }
        }
        self.list.push(c);
    }
}

/// Unconfirmed early launches in a row that pause them (a step that missed ran twice), and
/// for how many calls.
pub(crate) const EARLY_MISSES: u32 = 4;
pub(crate) const EARLY_PAUSE: u32 = 64;

/// Whether a decode step may launch the graph of the step before it ahead of its own dry
/// run (`RUSTORCH_CUDA_EARLY=0` turns it off).
/// (Read once: it is asked on every decode step.)
pub(crate) fn early_enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("RUSTORCH_CUDA_EARLY").map_or(true, |v| v != "0"))
}

/// Whether graphs are on (`RUSTORCH_CUDA_GRAPHS=0` turns them off).
pub(crate) fn graphs_enabled() -> bool {
    std::env::var("RUSTORCH_CUDA_GRAPHS").map_or(true, |v| v != "0")
}

/// What a GPU model keeps between forward calls (see the module doc). One call at a time
/// uses it.
#[derive(Default)]
pub struct CudaState {
    pub(crate) s: Scratch,
    pub(crate) tmp: GpuVec<f32>,
    pub(crate) inp: Prepared,
    /// Where a replayed step's logits come back to.
    pub(crate) out_host: ReadPool,
    pub(crate) graphs: Graphs,
    pub(crate) progs: crate::mega::Programs,
    /// Decode steps kept off the persistent kernel even where `RUSTORCH_CUDA_MEGA=1`.
    pub(crate) mega_off: bool,
    /// No early launches (see [`Graphs::last`]) for this model.
    pub(crate) early_off: bool,
}

impl CudaState {
    pub fn graph_stats(&self) -> GraphStats {
        self.graphs.stats
    }

    /// Where `RUSTORCH_CUDA_MEGA=1`: turns the persistent decode kernel off (steps then
    /// replay CUDA graphs) or back on.
    pub fn set_mega(&mut self, on: bool) {
        self.mega_off = !on;
    }

    /// Turns early launches of a replayed graph (before the dry run that confirms it) off
    /// or back on (on by default unless `RUSTORCH_CUDA_EARLY=0`).
    pub fn set_early(&mut self, on: bool) {
        self.early_off = !on;
        self.graphs.early_misses = 0;
        self.graphs.early_pause = 0;
    }
}

/// Captures the work `f` queues on the device's stream into a graph (nothing runs). Fails
/// without calling `f` when capture cannot begin.
pub(crate) fn capture<T>(
    dev: &CudaDevice,
    f: impl FnOnce() -> T,
) -> Result<(T, Result<Option<CudaGraph>>)> {
    dev.stream()
        .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)?;
    let out = f();
    let g = dev
        .stream()
        .end_capture(sys::CUgraphInstantiate_flags(0))
        .map_err(CudaError::from);
    Ok((out, g))
}
