//! A decode step as one persistent kernel.
//!
//! A decode step on a small model is a few hundred short kernels (ten per layer); each
//! costs microseconds of launch, ramp-up and drain even inside a CUDA graph, more than its
//! weights take to read. Here the same step runs as **one** cooperative launch of
//! `mega_step` (`kernels/mega.cu`): every block of a grid sized to be resident at once walks
//! the step's list of launches (a *program*), sharing each launch's blocks out, with a
//! grid-wide barrier between launches. The kernels are the very same code, compiled a second
//! time as device functions (`blockIdx` read from shared memory), so a step's results are
//! bit for bit those of the same launches made one by one.
//!
//! Programs are made from the dry run that [`crate::Cuda::run`] already does for graphs:
//! the launches it records (kernel, grid, block, argument bytes) are exactly what the step
//! would launch, every per-step input being data in device memory, so a program with the
//! dry run's signature is replayed in the step's place. A step with a kernel the program
//! cannot hold (one not in [`mega_ops`], or launched with a block size other than
//! [`MEGA_THREADS`]) runs as a CUDA graph instead.
//!
//! The second module is compiled on the first step that uses it (NVRTC, tens of seconds
//! on first use; cached on disk like the first module). The path is **off** unless
//! `RUSTORCH_CUDA_MEGA=1`: on an H100 it is still slower than graph replays (TinyLlama
//! shape Q4_0: 416-428 against 808-827 t/s; docs/performance.md, "Session 8", has the
//! breakdown): a step's ~225 barriers alone cost about 0.6 ms, and the kernels' work in the
//! resident grid (128 registers, 4 blocks of 4 warps per multiprocessor) takes longer than
//! the whole graph step, the products keeping fewer loads in flight than as separate
//! kernels. `RUSTORCH_CUDA_MEGA_BLOCKS=N` sets the resident blocks per multiprocessor
//! (default: up to 4, as many as fit); `RUSTORCH_CUDA_MEGA_BAR=tree` the barrier;
//! `RUSTORCH_CUDA_MEGA_PROBE` the timing-only modes of that breakdown.

use std::collections::HashMap;
use std::sync::Arc;

use cudarc::driver::{CudaFunction, CudaModule, LaunchConfig, PushKernelArg};

use crate::device::{CudaDevice, GpuVec, ModuleInfo, Recorded};
use crate::error::{CudaError, Result};
use crate::kernels::{ATTN_E, FORMATS};

/// Threads of every block of the persistent kernel; every launch of a program must use
/// this many (or, for the kernels that adapt to their block size, at most this many).
pub const MEGA_THREADS: u32 = 128;

/// Kernels that compute the same for any block size (multiple of 32) and run with
/// [`MEGA_THREADS`] whatever they were launched with (their grid does not depend on it).
const ANY_BLOCK: [&str; 1] = ["rms_norm"];

/// Programs kept per model.
const MAX_PROGRAMS: usize = 8;

/// Words of the barrier buffer (see `mega_grid_sync`): the generation, 16 group counters
/// and the counter over groups, each on its own 128-byte line.
const BAR_WORDS: usize = 32 * 18;

/// The kernels a program can hold, in op-number order: the one-token products and every
/// element-wise or row-wise op of a decode step.
pub fn mega_ops() -> Vec<String> {
    let mut v: Vec<String> = [
        "quantize_q8_1",
        "rms_norm",
        "rope_angles",
        "rope",
        "copy_f32",
        "add_f32",
        "add_bias",
        "scale_f32",
        "softcap_f32",
        "swiglu",
        "geglu",
        "gather_rows",
        "kv_write",
        "rope_kv_write",
        "attn_combine",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    for (ty, s) in FORMATS {
        let float = matches!(
            ty,
            rustorch_core::GgmlType::F32
                | rustorch_core::GgmlType::F16
                | rustorch_core::GgmlType::BF16
        );
        v.push(format!("{}1_{s}", if float { "mmv" } else { "mmvq" }));
        v.push(format!("get_rows_{s}"));
    }
    for e in ATTN_E {
        v.push(format!("attn_split_{e}"));
    }
    v
}

/// The second module's source: the kernel files with every kernel turned into a device
/// function (`__global__` and launch bounds dropped), `blockIdx` redirected to the shared
/// variable the interpreter sets, no `__restrict__` (a buffer written by one launch of the
/// program is read by a later one: no load may take the read-only path), then
/// `kernels/mega.cu` and the op table.
pub fn mega_source() -> String {
    let mut s = String::from(
        "#define RT_NO_PDL\n\
         #define __restrict__\n\
         __device__ __forceinline__ unsigned int mega_real_block() { return blockIdx.x; }\n\
         __shared__ uint3 mega_bid;\n\
         #define blockIdx mega_bid\n",
    );
    let body = crate::device::kernel_source().replace(
        "extern \"C\" __global__",
        "extern \"C\" __device__ __noinline__",
    );
    s.push_str(&strip_launch_bounds(&body));
    s.push_str("// ---- mega.cu\n");
    s.push_str(include_str!("../kernels/mega.cu"));
    s.push_str(
        "\n__device__ __noinline__ void mega_dispatch(u32 op, const u8 *a) {\n    switch (op) {\n",
    );
    for (i, name) in mega_ops().iter().enumerate() {
        s.push_str(&format!("    case {i}: MEGA_CALL({name}); break;\n"));
    }
    s.push_str("    default: break;\n    }\n}\n");
    s
}

/// `src` without its `__launch_bounds__(...)` annotations.
fn strip_launch_bounds(src: &str) -> String {
    const KEY: &str = "__launch_bounds__(";
    let mut out = String::with_capacity(src.len());
    let mut rest = src;
    while let Some(i) = rest.find(KEY) {
        out.push_str(&rest[..i]);
        let after = &rest[i + KEY.len()..];
        let mut depth = 1;
        let mut end = after.len();
        for (j, c) in after.char_indices() {
            match c {
                '(' => depth += 1,
                ')' => {
                    depth -= 1;
                    if depth == 0 {
                        end = j + 1;
                        break;
                    }
                }
                _ => {}
            }
        }
        rest = &after[end..];
    }
    out.push_str(rest);
    out
}

/// The persistent kernel, loaded.
pub struct MegaModule {
    _module: Arc<CudaModule>,
    func: CudaFunction,
    ops: HashMap<String, u32>,
    /// Blocks of the grid (all resident at once).
    pub blocks: u32,
    /// The barrier: one counter zeroed before each launch (default), or the self-resetting
    /// tree (`RUSTORCH_CUDA_MEGA_BAR=tree`).
    pub flat: bool,
    /// For timing only (wrong results): `RUSTORCH_CUDA_MEGA_PROBE=nobar` drops the
    /// barriers, `nowork` the kernels (`mega_run`'s mode bits 1 and 2); `nosleep` (results
    /// right) polls the barrier without sleeping.
    probe: i32,
    pub info: ModuleInfo,
}

impl MegaModule {
    pub(crate) fn new(dev: &CudaDevice, module: Arc<CudaModule>, info: ModuleInfo) -> Result<Self> {
        let want = std::env::var("RUSTORCH_CUDA_MEGA_BLOCKS")
            .ok()
            .and_then(|v| v.parse::<u32>().ok())
            .unwrap_or(4);
        // more than 4 blocks per multiprocessor: the entry compiled for 64 registers
        let name = if want > 4 { "mega_step8" } else { "mega_step" };
        let func = module
            .load_function(name)
            .map_err(|e| CudaError::Driver(format!("{name} missing from the module: {e}")))?;
        let fit = func.occupancy_max_active_blocks_per_multiprocessor(MEGA_THREADS, 0, None)?;
        let per_sm = want.clamp(1, fit.max(1));
        if fit == 0 {
            return Err(CudaError::Unsupported(
                "the persistent decode kernel does not fit on a multiprocessor".into(),
            ));
        }
        let ops = mega_ops()
            .into_iter()
            .enumerate()
            .map(|(i, n)| (n, i as u32))
            .collect();
        Ok(MegaModule {
            _module: module,
            func,
            ops,
            blocks: per_sm * dev.info.multiprocessors as u32,
            flat: std::env::var("RUSTORCH_CUDA_MEGA_BAR").map_or(true, |v| v != "tree"),
            probe: match std::env::var("RUSTORCH_CUDA_MEGA_PROBE").as_deref() {
                Ok("nobar") => 2,
                Ok("nowork") => 4,
                Ok("nosleep") => 8,
                _ => 0,
            },
            info,
        })
    }

    /// The program of the recorded launches (instruction words, argument bytes), or
    /// `None` when one of them cannot be part of a program.
    fn encode(&self, rec: &Recorded) -> Option<(Vec<u32>, Vec<u8>)> {
        let mut words = Vec::with_capacity(rec.len() * 8);
        let mut args: Vec<u8> = Vec::new();
        for l in rec.iter() {
            let op = *self.ops.get(l.name)?;
            let block_ok = l.block == MEGA_THREADS
                || (ANY_BLOCK.contains(&l.name) && l.block <= MEGA_THREADS && l.block % 32 == 0);
            if !block_ok {
                return None;
            }
            let (gx, gy, gz) = l.grid;
            if gx == 0 || gy == 0 || gz == 0 {
                continue;
            }
            args.resize(args.len().next_multiple_of(16), 0);
            let off = u32::try_from(args.len()).ok()?;
            args.extend_from_slice(l.args);
            words.extend_from_slice(&[op, gx, gy, gz, off, 0, 0, 0]);
        }
        if words.is_empty() {
            return None;
        }
        args.resize(args.len().next_multiple_of(16).max(16), 0);
        Some((words, args))
    }
}

/// A step's program on the device.
pub(crate) struct Program {
    pub sig: u64,
    instr: GpuVec<u32>,
    args: GpuVec<u8>,
    n: usize,
    pub used: u64,
}

/// A model's programs and the barrier words they share.
#[derive(Default)]
pub(crate) struct Programs {
    list: Vec<Program>,
    /// Signatures that cannot be programs.
    bad: Vec<u64>,
    tick: u64,
    bar: GpuVec<u32>,
}

impl Programs {
    /// Runs the step of signature `sig` as one launch: a kept program, or one made from
    /// the launches just recorded. `Ok(false)` when the step cannot be a program (nothing
    /// was launched).
    pub fn run(&mut self, dev: &CudaDevice, m: &MegaModule, sig: u64) -> Result<bool> {
        if self.bad.contains(&sig) {
            return Ok(false);
        }
        self.tick += 1;
        let i = match self.list.iter().position(|p| p.sig == sig) {
            Some(i) => i,
            None => {
                let Some((words, args)) = dev.with_recorded(|r| m.encode(r)) else {
                    self.bad.push(sig);
                    return Ok(false);
                };
                let p = Program {
                    sig,
                    instr: dev.upload(&words)?,
                    args: dev.upload(&args)?,
                    n: words.len() / 8,
                    used: 0,
                };
                if self.list.len() >= MAX_PROGRAMS {
                    if let Some(j) = (0..self.list.len()).min_by_key(|&j| self.list[j].used) {
                        self.list.swap_remove(j);
                    }
                }
                self.list.push(p);
                self.list.len() - 1
            }
        };
        if self.bar.len() != BAR_WORDS {
            self.bar.resize(dev, BAR_WORDS)?;
            self.bar.zero(dev)?;
        }
        let mode = i32::from(m.flat) | m.probe;
        dev.context().bind_to_thread()?;
        if m.flat {
            // SAFETY: the first 64 words of the live barrier buffer, in stream order.
            unsafe {
                cudarc::driver::sys::cuMemsetD32Async(
                    self.bar.ptr(),
                    0,
                    64,
                    dev.stream().cu_stream(),
                )
                .result()?;
            }
        }
        let p = &mut self.list[i];
        p.used = self.tick;
        let (ip, ap, bp, n) = (p.instr.ptr(), p.args.ptr(), self.bar.ptr(), p.n as i32);
        let mut b = dev.stream().launch_builder(&m.func);
        b.arg(&ip);
        b.arg(&n);
        b.arg(&ap);
        b.arg(&bp);
        b.arg(&mode);
        let cfg = LaunchConfig {
            grid_dim: (m.blocks, 1, 1),
            block_dim: (MEGA_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: the arguments match mega_step's signature; the program's launches are
        // the dry run's, whose buffers the architecture keeps alive through the step; the
        // grid fits on the device at once (occupancy), as a cooperative launch requires.
        match unsafe { b.launch_cooperative(cfg) } {
            Ok(_) => Ok(true),
            Err(_) => {
                // e.g. the device cannot run this grid cooperatively: graphs from now on
                self.bad.push(sig);
                Ok(false)
            }
        }
    }
}

/// Whether steps may run as one persistent kernel (`RUSTORCH_CUDA_MEGA=1`).
pub(crate) fn mega_enabled() -> bool {
    crate::kernels::arith().mega
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn launch_bounds_are_stripped() {
        let s = strip_launch_bounds("a __launch_bounds__(X(1), 2) void f() __launch_bounds__(4)");
        assert_eq!(s, "a  void f() ");
    }

    /// Every op of a program is a kernel of the first module, and the second module's
    /// source holds no kernel but the interpreter.
    #[test]
    fn ops_are_kernels() {
        let names = crate::kernels::kernel_names();
        for op in mega_ops() {
            assert!(names.contains(&op), "{op}");
        }
        let src = mega_source();
        assert_eq!(src.matches("__global__").count(), 2);
        assert!(!src.contains("__launch_bounds__(MMV"));
    }
}
