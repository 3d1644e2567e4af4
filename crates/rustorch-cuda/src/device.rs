//! Opening a GPU: probe the libraries, create the context and stream, and load the kernels
//! (from the on-disk cache, or compiled with NVRTC on first use).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::Instant;

use cudarc::driver::{
    sys, CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, DevicePtr,
};
use cudarc::driver::{DeviceRepr, LaunchConfig, PushKernelArg, ValidAsZeroBits};
use cudarc::nvrtc::Ptx;

use crate::error::{CudaError, Result};
use crate::mega::MegaModule;
use crate::nvrtc::{self, Image, Nvrtc};

/// The kernel sources, compiled together as one program (common.cuh first).
pub const KERNEL_SOURCES: [(&str, &str); 5] = [
    ("common.cuh", include_str!("../kernels/common.cuh")),
    ("quant.cu", include_str!("../kernels/quant.cu")),
    ("exact.cu", include_str!("../kernels/exact.cu")),
    ("ops.cu", include_str!("../kernels/ops.cu")),
    ("attn.cu", include_str!("../kernels/attn.cu")),
];

/// NVRTC options (part of the cache key).
pub(crate) const NVRTC_OPTS: [&str; 2] = ["--std=c++17", "--device-as-default-execution-space"];

/// The kernels' source as compiled.
pub fn kernel_source() -> String {
    let mut s = String::new();
    match crate::kernels::arith().pdl {
        crate::kernels::Pdl::Off => s.push_str("#define RT_NO_PDL\n"),
        crate::kernels::Pdl::On => {}
        crate::kernels::Pdl::Prefetch => s.push_str("#define RT_PDL_PREFETCH\n"),
    }
    let aw = crate::kernels::attn_warps();
    if aw != 4 {
        s.push_str(&format!("#define ATTN_WARPS {aw}\n"));
    }
    let at = crate::kernels::exact_attn_threads();
    if at != crate::kernels::EXACT_ATTN_THREADS {
        s.push_str(&format!("#define AE_THREADS {at}\n"));
    }
    // experimental variants for A/B runs on one build: `RUSTORCH_CUDA_DEFS=NAME[=VALUE],...`
    // prepends `#define NAME VALUE` (part of the source, so of the module cache's key)
    if let Ok(defs) = std::env::var("RUSTORCH_CUDA_DEFS") {
        for d in defs.split(',').filter(|d| !d.is_empty()) {
            let (k, v) = d.split_once('=').unwrap_or((d, ""));
            if k == "AE_THREADS" {
                // (the launch's block size: RUSTORCH_CUDA_AE_THREADS sets both)
                continue;
            }
            s.push_str(&format!("#define {k} {v}\n"));
        }
    }
    for (name, src) in KERNEL_SOURCES {
        s.push_str(&format!("// ---- {name}\n"));
        s.push_str(src);
        s.push('\n');
    }
    s
}

/// How the kernels reached the GPU at open.
#[derive(Debug, Clone)]
pub struct ModuleInfo {
    /// Loaded from the cache (no compilation).
    pub cached: bool,
    /// Seconds spent compiling (0 when cached) and loading.
    pub compile_s: f64,
    pub load_s: f64,
    /// "sm_90" (cubin) or "compute_90" (PTX, finished by the driver).
    pub target: String,
    /// The cache file, when the cache is usable.
    pub cache_file: Option<std::path::PathBuf>,
    /// Where NVRTC was found (empty when it was not needed).
    pub nvrtc: String,
}

/// What the device is.
#[derive(Debug, Clone)]
pub struct DeviceInfo {
    pub index: usize,
    pub name: String,
    pub compute_capability: (i32, i32),
    pub total_mem: usize,
    pub multiprocessors: usize,
    /// e.g. 13000 for CUDA 13.0.
    pub driver_version: i32,
}

/// One GPU with the kernels loaded: the context, the stream every op runs on, and the
/// kernel functions by name. A clone shares the context, stream and module (a KV cache
/// keeps one to work on its own).
#[derive(Clone)]
pub struct CudaDevice {
    pub(crate) stream: Arc<CudaStream>,
    ctx: Arc<CudaContext>,
    _module: Arc<CudaModule>,
    funcs: HashMap<String, CudaFunction>,
    /// Kernels launched with programmatic dependent launch (sm_90+, a driver that
    /// captures it into graphs, not switched off by `RUSTORCH_CUDA_PDL=0`).
    pdl: bool,
    rec: Arc<Mutex<Recorder>>,
    /// The persistent decode kernel's module, loaded on first use (see [`crate::mega`]).
    mega: Arc<OnceLock<std::result::Result<Arc<MegaModule>, String>>>,
    /// Buffers allocated or freed through this device (see [`CudaDevice::alloc_count`]).
    events: Arc<AtomicU64>,
    /// The CPU backend's arithmetic, bit for bit (see [`CudaDevice::set_exact`]).
    exact: Arc<AtomicBool>,
    pub info: DeviceInfo,
    pub module: ModuleInfo,
}

/// What kernel launches do: run (the default); run and add themselves to a signature
/// (while a step is captured into a graph); or only add themselves to it (a dry run that
/// tells whether a captured graph launches exactly what the step would).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LaunchMode {
    Run,
    Record,
    DryRun,
}

/// The signature of the launches since the mode was set: an FNV-1a hash of each kernel's
/// name, grid, block and argument bytes, in order. Where `RUSTORCH_CUDA_MEGA=1`, a dry run
/// also keeps the launches themselves (for [`crate::mega`]).
struct Recorder {
    mode: LaunchMode,
    hash: u64,
    launches: usize,
    recorded: Recorded,
}

/// Launches kept by a dry run, in order, in flat buffers reused from one run to the next:
/// kernel names, and each launch's arguments packed at their natural alignment (as a C
/// struct of the kernel's parameters would hold them).
#[derive(Default)]
pub(crate) struct Recorded {
    names: String,
    args: Vec<u8>,
    meta: Vec<RecMeta>,
}

/// Where one recorded launch lies in [`Recorded`]'s buffers.
#[derive(Clone, Copy)]
struct RecMeta {
    /// End of the name in `names`.
    name_end: usize,
    grid: (u32, u32, u32),
    block: u32,
    /// Start and end of the arguments in `args`.
    args: (usize, usize),
}

/// One recorded launch.
pub(crate) struct RecLaunch<'a> {
    pub name: &'a str,
    pub grid: (u32, u32, u32),
    pub block: u32,
    pub args: &'a [u8],
}

impl Recorded {
    fn clear(&mut self) {
        self.names.clear();
        self.args.clear();
        self.meta.clear();
    }

    fn push(&mut self, name: &str, grid: (u32, u32, u32), block: u32, args: &[&dyn KernelArg]) {
        self.names.push_str(name);
        let start = self.args.len().next_multiple_of(16);
        self.args.resize(start, 0);
        for a in args {
            let at = (self.args.len() - start).next_multiple_of(a.align()) + start;
            self.args.resize(at, 0);
            self.args.extend_from_slice(a.bytes());
        }
        self.meta.push(RecMeta {
            name_end: self.names.len(),
            grid,
            block,
            args: (start, self.args.len()),
        });
    }

    pub fn len(&self) -> usize {
        self.meta.len()
    }

    pub fn iter(&self) -> impl Iterator<Item = RecLaunch<'_>> {
        let mut name0 = 0;
        self.meta.iter().map(move |m| {
            let name = &self.names[name0..m.name_end];
            name0 = m.name_end;
            RecLaunch {
                name,
                grid: m.grid,
                block: m.block,
                args: &self.args[m.args.0..m.args.1],
            }
        })
    }
}

impl Recorder {
    fn mix(&mut self, bytes: &[u8]) {
        self.hash = mix_words(self.hash, bytes);
    }
}

/// Folds `bytes` (their length first, then 8 at a time, the last word zero-padded) into a
/// 64-bit hash. Every step (xor a word, multiply by an odd constant, rotate) is a bijection
/// of the state, so two sequences of equal length that differ in one word never collide.
/// (A step's dry run hashes every launch's name and argument bytes: 8 bytes per step, not
/// one as FNV-1a does, keeps that to a few microseconds per decode step.)
fn mix_words(mut h: u64, bytes: &[u8]) -> u64 {
    const K: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut step = |w: u64| h = (h ^ w).wrapping_mul(K).rotate_left(29);
    step(bytes.len() as u64);
    let mut chunks = bytes.chunks_exact(8);
    for c in &mut chunks {
        let mut w = [0u8; 8];
        w.copy_from_slice(c);
        step(u64::from_le_bytes(w));
    }
    let rest = chunks.remainder();
    if !rest.is_empty() {
        let mut w = [0u8; 8];
        w[..rest.len()].copy_from_slice(rest);
        step(u64::from_le_bytes(w));
    }
    h
}

impl CudaDevice {
    /// Opens GPU `index`. Fails (never panics) with an error naming what is missing: the
    /// driver library, a device, the device index, or NVRTC (needed only when the kernels
    /// are not cached yet).
    pub fn open(index: usize) -> Result<Self> {
        probe_driver()?;
        // cudarc panics on a missing symbol; the probe above makes that unlikely, and a
        // panic that still happens becomes an error here.
        match std::panic::catch_unwind(|| Self::open_probed(index)) {
            Ok(r) => r,
            Err(p) => {
                let msg = p
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_else(|| "unknown panic".into());
                Err(CudaError::Driver(format!("CUDA library failure: {msg}")))
            }
        }
    }

    fn open_probed(index: usize) -> Result<Self> {
        let count = device_count()?;
        if index >= count {
            return Err(CudaError::BadDeviceIndex { index, count });
        }
        let ctx = CudaContext::new(index)?;
        // One stream orders every op; the kernels take raw pointers, so cudarc's per-buffer
        // events are not needed.
        // SAFETY: no other stream of this context uses our buffers.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream()?;
        let cc = ctx.compute_capability()?;
        let mut driver_version = 0;
        // SAFETY: valid out-pointer.
        unsafe { sys::cuDriverGetVersion(&mut driver_version) };
        let info = DeviceInfo {
            index,
            name: ctx.name()?,
            compute_capability: cc,
            total_mem: ctx.total_mem()?,
            multiprocessors: ctx
                .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?
                as usize,
            driver_version,
        };
        let (module, minfo) = load_module(&ctx, cc, driver_version, &kernel_source(), "kernels")?;
        let mut funcs = HashMap::new();
        for name in crate::kernels::kernel_names() {
            let f = module.load_function(&name).map_err(|e| {
                CudaError::Driver(format!("kernel {name} missing from the module: {e}"))
            })?;
            if name.starts_with("mmve_") || name == "mmvd_q6_k_p2" {
                // the exact products stage every row's integer sums in shared memory: the
                // largest carveout lets one more block per multiprocessor in (a preference;
                // a driver that refuses it only costs speed)
                let _ = f.set_attribute(
                    cudarc::driver::sys::CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT,
                    100,
                );
            }
            funcs.insert(name, f);
        }
        Ok(CudaDevice {
            stream,
            ctx,
            _module: module,
            funcs,
            pdl: cc.0 >= 9
                && driver_version >= 12030
                && crate::kernels::arith().pdl != crate::kernels::Pdl::Off,
            rec: Arc::new(Mutex::new(Recorder {
                mode: LaunchMode::Run,
                hash: 0,
                launches: 0,
                recorded: Recorded::default(),
            })),
            mega: Arc::new(OnceLock::new()),
            events: Arc::default(),
            exact: Arc::new(AtomicBool::new(
                std::env::var("RUSTORCH_CUDA_EXACT").is_ok_and(|v| v == "1"),
            )),
            info,
            module: minfo,
        })
    }

    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    pub(crate) fn func(&self, name: &str) -> Result<&CudaFunction> {
        self.funcs
            .get(name)
            .ok_or_else(|| CudaError::Unsupported(format!("no kernel named {name}")))
    }

    /// Waits for every queued op.
    pub fn synchronize(&self) -> Result<()> {
        self.stream.synchronize()?;
        Ok(())
    }

    /// (free, total) device memory in bytes.
    pub fn mem_info(&self) -> Result<(usize, usize)> {
        Ok(self.ctx.mem_get_info()?)
    }

    fn recorder(&self) -> MutexGuard<'_, Recorder> {
        self.rec.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Sets what launches do from now on and starts a new signature (a dry run also a new
    /// list of recorded launches, kept until the next dry run).
    pub fn set_launch_mode(&self, mode: LaunchMode) {
        let mut r = self.recorder();
        r.mode = mode;
        r.hash = 0xcbf29ce484222325;
        r.launches = 0;
        if mode == LaunchMode::DryRun {
            r.recorded.clear();
        }
    }

    /// Whether ops compute as the CPU backend does, bit for bit, where the formats allow
    /// (kernels/exact.cu: the legacy formats, Q4_K and Q6_K; SiLU, softmax `expf`, RoPE
    /// angles and attention as the CPU's; no folded norms). Slower; for output identical to
    /// the CPU's (and so to llama.cpp's CPU build). Off by default unless
    /// `RUSTORCH_CUDA_EXACT=1`; graphs captured in the other mode are not replayed (their
    /// launches differ).
    pub fn set_exact(&self, on: bool) {
        self.exact.store(on, Ordering::Relaxed);
    }

    /// See [`CudaDevice::set_exact`].
    pub fn exact(&self) -> bool {
        self.exact.load(Ordering::Relaxed)
    }

    /// Where the kernels were built with `RUSTORCH_CUDA_DEFS=RT_STAMP` (timing only): the
    /// stamps noted since the last call, each (ns of `%globaltimer` when a block passed its
    /// wait for the grid before, blocks in its grid, threads per block), in time order;
    /// then forgets them. None in a normal build.
    pub fn take_stamps(&self) -> Option<Vec<(u64, u32, u32)>> {
        let stream = &self.stream;
        let mut n = self._module.get_global("rt_nstamp", stream).ok()?;
        // SAFETY: `rt_nstamp` is a u32 of the module (common.cuh, RT_STAMP)
        let mut nv = unsafe { n.transmute_mut::<u32>(1)? };
        let mut cnt = [0u32; 1];
        stream.memcpy_dtoh(&nv, &mut cnt).ok()?;
        stream.memcpy_htod(&[0u32], &mut nv).ok()?;
        let all = self._module.get_global("rt_stamps", stream).ok()?;
        let max = all.len() / 16;
        let mut raw = vec![0u64; 2 * max];
        // SAFETY: `rt_stamps` is 2 * RT_STAMP_MAX u64 of the module
        let av = unsafe { all.transmute::<u64>(2 * max)? };
        stream.memcpy_dtoh(&av, &mut raw).ok()?;
        stream.synchronize().ok()?;
        let k = (cnt[0] as usize).min(max);
        let mut v: Vec<(u64, u32, u32)> = raw[..2 * k]
            .chunks_exact(2)
            .map(|c| (c[0], c[1] as u32, (c[1] >> 32) as u32))
            .collect();
        v.sort_unstable();
        Some(v)
    }

    /// Buffers allocated or freed through this device so far (a dry run that allocates
    /// may have recorded addresses of buffers it then replaced; a graph recorded before a
    /// buffer was freed may point at it).
    pub(crate) fn alloc_count(&self) -> u64 {
        self.events.load(Ordering::Relaxed)
    }

    /// `f` of the launches the last dry run recorded.
    pub(crate) fn with_recorded<R>(&self, f: impl FnOnce(&Recorded) -> R) -> R {
        f(&self.recorder().recorded)
    }

    /// The persistent decode kernel (compiled or read from the cache on first use), or why
    /// there is none.
    pub fn mega(&self) -> std::result::Result<Arc<MegaModule>, String> {
        self.mega
            .get_or_init(|| {
                let (module, info) = load_module(
                    &self.ctx,
                    self.info.compute_capability,
                    self.info.driver_version,
                    &crate::mega::mega_source(),
                    "mega",
                )
                .map_err(|e| e.to_string())?;
                MegaModule::new(self, module, info)
                    .map(Arc::new)
                    .map_err(|e| e.to_string())
            })
            .clone()
    }

    pub fn launch_mode(&self) -> LaunchMode {
        self.recorder().mode
    }

    /// The signature of the launches since the mode was set, and their count.
    pub fn launch_signature(&self) -> (u64, usize) {
        let r = self.recorder();
        (r.hash, r.launches)
    }

    /// How many blocks of kernel `name` (`threads` threads, `smem` bytes of dynamic shared
    /// memory) one multiprocessor holds at once, by the driver's occupancy calculator (1
    /// where it cannot say).
    pub(crate) fn blocks_per_sm(&self, name: &str, threads: u32, smem: usize) -> u32 {
        self.funcs
            .get(name)
            .and_then(|f| {
                f.occupancy_max_active_blocks_per_multiprocessor(threads, smem, None)
                    .ok()
            })
            .unwrap_or(1)
            .max(1)
    }

    /// An error for host copies while launches are recorded (a graph holds kernels only).
    pub(crate) fn check_copy_allowed(&self) -> Result<()> {
        match self.launch_mode() {
            LaunchMode::Run => Ok(()),
            _ => Err(CudaError::Unsupported(
                "a host copy inside a step recorded for a graph".into(),
            )),
        }
    }

    /// Launches kernel `name` with `args` (pointers to each argument's value), or only
    /// records it (see [`LaunchMode`]).
    pub(crate) fn launch(
        &self,
        name: &str,
        grid: (u32, u32, u32),
        block: u32,
        args: &[&dyn KernelArg],
    ) -> Result<()> {
        self.launch_smem(name, grid, block, 0, args)
    }

    /// [`CudaDevice::launch`] with `smem` bytes of dynamic shared memory per block.
    pub(crate) fn launch_smem(
        &self,
        name: &str,
        grid: (u32, u32, u32),
        block: u32,
        smem: u32,
        args: &[&dyn KernelArg],
    ) -> Result<()> {
        {
            let mut r = self.recorder();
            if r.mode != LaunchMode::Run {
                r.launches += 1;
                r.mix(name.as_bytes());
                r.mix(&[0xff]);
                for d in [grid.0, grid.1, grid.2, block, smem] {
                    r.mix(&d.to_le_bytes());
                }
                for a in args {
                    r.mix(a.bytes());
                }
                if r.mode == LaunchMode::DryRun {
                    if crate::kernels::arith().mega {
                        r.recorded.push(name, grid, block, args);
                    }
                    return Ok(());
                }
            }
        }
        let f = self.func(name)?;
        if self.pdl {
            return self.launch_pdl(f, grid, block, smem, args);
        }
        let mut b = self.stream.launch_builder(f);
        for a in args.iter() {
            a.push(&mut b);
        }
        let cfg = LaunchConfig {
            grid_dim: grid,
            block_dim: (block, 1, 1),
            shared_mem_bytes: smem,
        };
        // SAFETY: each kernel's argument list is built by the wrapper in `kernels.rs` that
        // matches its C signature; pointers are to live device buffers sized by the caller.
        unsafe { b.launch(cfg) }?;
        Ok(())
    }

    /// Launches `f` so that it may start before the kernel ahead of it in the stream has
    /// finished (programmatic dependent launch; every kernel begins with `PDL_ENTRY`, which
    /// waits for that kernel before touching anything it wrote).
    fn launch_pdl(
        &self,
        f: &CudaFunction,
        grid: (u32, u32, u32),
        block: u32,
        smem: u32,
        args: &[&dyn KernelArg],
    ) -> Result<()> {
        const MAX_ARGS: usize = 32;
        if args.len() > MAX_ARGS {
            return Err(CudaError::Unsupported(format!(
                "a kernel with {} arguments (at most {MAX_ARGS})",
                args.len()
            )));
        }
        let mut params = [std::ptr::null_mut::<std::ffi::c_void>(); MAX_ARGS];
        for (p, a) in params.iter_mut().zip(args) {
            // the driver copies each argument's bytes from this address during the call
            *p = a.bytes().as_ptr() as *mut std::ffi::c_void;
        }
        // SAFETY: a plain C union; all-zero bytes are a valid value of every member.
        let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
        attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
        attr.value.programmaticStreamSerializationAllowed = 1;
        let cfg = sys::CUlaunchConfig {
            gridDimX: grid.0,
            gridDimY: grid.1,
            gridDimZ: grid.2,
            blockDimX: block,
            blockDimY: 1,
            blockDimZ: 1,
            sharedMemBytes: smem,
            hStream: self.stream.cu_stream(),
            attrs: &mut attr,
            numAttrs: 1,
        };
        self.ctx.bind_to_thread()?;
        // SAFETY: as in `launch`: the argument list matches the kernel's C signature and
        // every pointer in `params` points at a live argument value for the call.
        unsafe {
            sys::cuLaunchKernelEx(
                &cfg,
                f.cu_function(),
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        }
        .result()?;
        Ok(())
    }

    /// Copies `bytes` bytes between device addresses, in stream order.
    ///
    /// # Safety
    /// Both ranges must be live device memory; they must not overlap.
    pub unsafe fn copy_raw(&self, dst: u64, src: u64, bytes: usize) -> Result<()> {
        if bytes > 0 {
            cudarc::driver::result::memcpy_dtod_async(dst, src, bytes, self.stream.cu_stream())?;
        }
        Ok(())
    }

    /// Copies `src` from the host to the device address `dst`, in stream order (the host
    /// values are taken before this returns).
    ///
    /// # Safety
    /// `dst` must be live device memory of at least `size_of_val(src)` bytes.
    pub unsafe fn write_raw<T: DeviceRepr>(&self, dst: u64, src: &[T]) -> Result<()> {
        self.check_copy_allowed()?;
        if !src.is_empty() {
            cudarc::driver::result::memcpy_htod_async(dst, src, self.stream.cu_stream())?;
        }
        Ok(())
    }

    /// `n` values at device address `src`, on the host (waits for the stream).
    ///
    /// # Safety
    /// `src` must be live device memory of at least `n` values.
    pub unsafe fn read_raw<T: DeviceRepr + Default + Clone>(
        &self,
        src: u64,
        n: usize,
    ) -> Result<Vec<T>> {
        let mut out = vec![T::default(); n];
        if n > 0 {
            cudarc::driver::result::memcpy_dtoh_async(&mut out, src, self.stream.cu_stream())?;
        }
        self.stream.synchronize()?;
        Ok(out)
    }

    /// A device buffer of `n` values (at least one element is allocated), contents unset.
    pub fn alloc<T: DeviceRepr>(&self, n: usize) -> Result<GpuVec<T>> {
        self.events.fetch_add(1, Ordering::Relaxed);
        // SAFETY: the memory is written before it is read by every user of GpuVec.
        let buf = unsafe { self.stream.alloc::<T>(n.max(1)) }?;
        let ptr = raw_ptr(&buf, &self.stream);
        Ok(GpuVec {
            buf: Some(buf),
            ptr,
            len: n,
            events: Some(self.events.clone()),
        })
    }

    /// A device copy of `v`.
    pub fn upload<T: DeviceRepr>(&self, v: &[T]) -> Result<GpuVec<T>> {
        let mut g = self.alloc::<T>(v.len())?;
        g.write(self, v)?;
        Ok(g)
    }
}

fn probe_driver() -> Result<()> {
    crate::probe::driver_library()?;
    match std::panic::catch_unwind(cudarc::driver::result::init) {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) if e.0 == sys::CUresult::CUDA_ERROR_NO_DEVICE => Err(CudaError::NoDevice),
        Ok(Err(e)) => Err(CudaError::DriverInit(e.to_string())),
        Err(_) => Err(CudaError::DriverInit(
            "the driver library could not be used".into(),
        )),
    }
}

/// Number of CUDA devices; errors name a missing driver.
pub fn device_count() -> Result<usize> {
    probe_driver()?;
    let n = std::panic::catch_unwind(cudarc::driver::result::device::get_count)
        .map_err(|_| CudaError::DriverInit("the driver library could not be used".into()))??;
    if n <= 0 {
        return Err(CudaError::NoDevice);
    }
    Ok(n as usize)
}

fn raw_ptr<T>(s: &CudaSlice<T>, stream: &Arc<CudaStream>) -> u64 {
    let (p, _sync) = s.device_ptr(stream);
    p
}

/// Loads the kernels: from the cache file keyed by source, target and driver version, else
/// compiled with NVRTC (cubin for the device's SM, or PTX when NVRTC predates the device)
/// and written to the cache.
fn load_module(
    ctx: &Arc<CudaContext>,
    cc: (i32, i32),
    driver_version: i32,
    src: &str,
    stem: &str,
) -> Result<(Arc<CudaModule>, ModuleInfo)> {
    let sm = cc.0 * 10 + cc.1;
    let cubin_target = format!("sm_{sm}");
    let key = |target: &str| {
        nvrtc::fnv64(&[
            src.as_bytes(),
            target.as_bytes(),
            &driver_version.to_le_bytes(),
            NVRTC_OPTS.join(" ").as_bytes(),
        ])
    };
    let dir = nvrtc::cache_dir();
    let file_for = |target: &str| {
        let ext = if target.starts_with("sm_") {
            "cubin"
        } else {
            "ptx"
        };
        dir.as_ref()
            .map(|d| d.join(format!("{stem}-{target}-{:016x}.{ext}", key(target))))
    };
    // cached cubin or PTX
    for target in [cubin_target.clone(), format!("compute_{sm}")] {
        let Some(path) = file_for(&target) else {
            continue;
        };
        let Ok(bytes) = std::fs::read(&path) else {
            continue;
        };
        let t0 = Instant::now();
        let image = if target.starts_with("sm_") {
            Image::Cubin(bytes)
        } else {
            Image::Ptx(String::from_utf8_lossy(&bytes).into_owned())
        };
        if let Ok(m) = load_image(ctx, image) {
            return Ok((
                m,
                ModuleInfo {
                    cached: true,
                    compile_s: 0.0,
                    load_s: t0.elapsed().as_secs_f64(),
                    target,
                    cache_file: Some(path),
                    nvrtc: String::new(),
                },
            ));
        }
        // unusable cache entry: rebuilt below
    }
    let nv = Nvrtc::load()?;
    let archs = nv.supported_archs();
    let target = if archs.is_empty() || archs.contains(&sm) {
        cubin_target
    } else {
        // NVRTC does not know this GPU: PTX for the newest architecture it knows (not
        // above the device's), which the driver compiles at load.
        let best = archs
            .iter()
            .copied()
            .filter(|&a| a <= sm)
            .max()
            .unwrap_or(sm);
        format!("compute_{best}")
    };
    let t0 = Instant::now();
    let image = nv.compile(src, &target, &NVRTC_OPTS)?;
    let compile_s = t0.elapsed().as_secs_f64();
    let path = file_for(&target);
    if let Some(p) = &path {
        let bytes: &[u8] = match &image {
            Image::Cubin(b) => b,
            Image::Ptx(s) => s.as_bytes(),
        };
        write_cache(p, bytes);
    }
    let t1 = Instant::now();
    let m = load_image(ctx, image)?;
    Ok((
        m,
        ModuleInfo {
            cached: false,
            compile_s,
            load_s: t1.elapsed().as_secs_f64(),
            target,
            cache_file: path,
            nvrtc: nv.origin.clone(),
        },
    ))
}

fn load_image(ctx: &Arc<CudaContext>, image: Image) -> Result<Arc<CudaModule>> {
    let ptx = match image {
        Image::Cubin(b) => Ptx::from_binary(b),
        Image::Ptx(s) => Ptx::from_src(s),
    };
    Ok(ctx.load_module(ptx)?)
}

/// Writes the cache file atomically (temporary file, then rename); failures only cost a
/// recompilation next time.
fn write_cache(path: &std::path::Path, bytes: &[u8]) {
    let Some(dir) = path.parent() else {
        return;
    };
    if std::fs::create_dir_all(dir).is_err() {
        return;
    }
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    if std::fs::write(&tmp, bytes).is_ok() && std::fs::rename(&tmp, path).is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
}

/// A kernel argument: anything cudarc can pass by value.
pub(crate) trait KernelArg {
    fn push<'a>(&'a self, b: &mut cudarc::driver::LaunchArgs<'a>);
    /// The value's bytes, as the kernel receives them.
    fn bytes(&self) -> &[u8];
    /// The value's alignment.
    fn align(&self) -> usize;
}

impl<T: DeviceRepr> KernelArg for T {
    fn push<'a>(&'a self, b: &mut cudarc::driver::LaunchArgs<'a>) {
        b.arg(self);
    }

    fn bytes(&self) -> &[u8] {
        // SAFETY: kernel arguments are plain values (integers, floats, device addresses)
        // without padding; the slice covers exactly the value.
        unsafe {
            std::slice::from_raw_parts((self as *const T).cast::<u8>(), std::mem::size_of::<T>())
        }
    }

    fn align(&self) -> usize {
        std::mem::align_of::<T>()
    }
}

/// A growable device array. `len` values are valid; growing reallocates (contents lost).
pub struct GpuVec<T> {
    buf: Option<CudaSlice<T>>,
    ptr: u64,
    len: usize,
    /// The allocating device's buffer events, counted again when the buffer is freed.
    events: Option<Arc<AtomicU64>>,
}

impl<T> GpuVec<T> {
    /// Frees the buffer (if it owns one).
    fn free(&mut self) {
        if self.buf.take().is_some() {
            if let Some(e) = &self.events {
                e.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
}

impl<T> Drop for GpuVec<T> {
    fn drop(&mut self) {
        self.free();
    }
}

impl<T> Default for GpuVec<T> {
    fn default() -> Self {
        GpuVec {
            buf: None,
            ptr: 0,
            len: 0,
            events: None,
        }
    }
}

impl<T: DeviceRepr> GpuVec<T> {
    /// A view of `len` values at device address `ptr` that owns nothing (dropping it frees
    /// nothing).
    ///
    /// # Safety
    /// The memory must stay live while the view is used; it must not be resized.
    pub(crate) unsafe fn borrowed(ptr: u64, len: usize) -> Self {
        GpuVec {
            buf: None,
            ptr,
            len,
            events: None,
        }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The device address of element 0.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    /// Allocated elements.
    pub fn capacity(&self) -> usize {
        // (a borrowed view: its length, so that resizing it to that length is a no-op)
        self.buf.as_ref().map_or(self.len, |b| b.len())
    }

    /// Makes room for `n` values and sets the length to `n` (old contents are kept only
    /// when no reallocation was needed).
    pub fn resize(&mut self, dev: &CudaDevice, n: usize) -> Result<()> {
        if self.capacity() < n {
            // free first, so that a large buffer does not briefly exist twice
            self.free();
            *self = dev.alloc(n)?;
        }
        self.len = n;
        Ok(())
    }

    /// Copies `v` to the device (resizing to `v.len()`).
    pub fn write(&mut self, dev: &CudaDevice, v: &[T]) -> Result<()> {
        dev.check_copy_allowed()?;
        self.resize(dev, v.len())?;
        if v.is_empty() {
            return Ok(());
        }
        if let Some(b) = self.buf.as_mut() {
            let mut view = b.slice_mut(0..v.len());
            dev.stream.memcpy_htod(v, &mut view)?;
        }
        Ok(())
    }

    /// The values on the host (waits for the stream).
    pub fn read(&self, dev: &CudaDevice) -> Result<Vec<T>>
    where
        T: Default + Clone,
    {
        dev.check_copy_allowed()?;
        let mut out = vec![T::default(); self.len];
        if let Some(b) = self.buf.as_ref() {
            if self.len > 0 {
                dev.stream.memcpy_dtoh(&b.slice(0..self.len), &mut out)?;
            }
        }
        dev.stream.synchronize()?;
        Ok(out)
    }

    /// Sets every byte to zero.
    pub fn zero(&mut self, dev: &CudaDevice) -> Result<()>
    where
        T: ValidAsZeroBits,
    {
        if let Some(b) = self.buf.as_mut() {
            dev.stream.memset_zeros(b)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::{mix_words, KERNEL_SOURCES};

    /// The launch signature's hash separates what a graph depends on: a changed byte
    /// anywhere, a moved boundary between parts, a different length.
    #[test]
    fn signature_hash_separates_launches() {
        let base: Vec<u8> = (0u8..37).collect();
        let h0 = mix_words(1, &base);
        for i in 0..base.len() {
            let mut b = base.clone();
            b[i] ^= 0x80;
            assert_ne!(mix_words(1, &b), h0, "byte {i}");
        }
        assert_ne!(mix_words(mix_words(1, &base[..8]), &base[8..]), h0);
        assert_ne!(mix_words(1, &base[..36]), h0);
        let mut longer = base.clone();
        longer.push(0);
        assert_ne!(mix_words(1, &longer), h0);
    }

    /// Kernels are launched with programmatic dependent launch, so each must wait for the
    /// kernel before it before anything else: its body's first statement is `PDL_ENTRY`.
    #[test]
    fn every_kernel_begins_with_pdl_entry() {
        let mut n = 0;
        for (file, src) in KERNEL_SOURCES {
            let mut rest = src;
            while let Some(k) = rest.find("extern \"C\" __global__") {
                let after = &rest[k..];
                let open = after.find('{').expect("a kernel body");
                let body =
                    after[open + 1..].trim_start_matches(|c: char| c.is_whitespace() || c == '\\');
                let name: String = after[..open].split('(').next().unwrap_or("").into();
                assert!(
                    body.starts_with("PDL_ENTRY"),
                    "{file}: {name} does not begin with PDL_ENTRY"
                );
                n += 1;
                rest = &after[open..];
            }
        }
        assert!(n >= 25, "found only {n} kernels");
    }
}
