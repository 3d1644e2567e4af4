//! Typed wrappers of the kernels in `kernels/*.cu`: each checks the sizes of its buffers and
//! launches on the device's stream (nothing waits; [`GpuVec::read`] synchronizes).

use rustorch_core::kernels::ops::{Rope, RopeMode};
use rustorch_core::GgmlType;

use crate::device::{CudaDevice, GpuVec, KernelArg};
use crate::error::{CudaError, Result};

/// Weight formats with a matrix-vector kernel, and the kernel-name stem of each.
pub const FORMATS: [(GgmlType, &str); 15] = [
    (GgmlType::F32, "f32"),
    (GgmlType::F16, "f16"),
    (GgmlType::BF16, "bf16"),
    (GgmlType::Q4_0, "q4_0"),
    (GgmlType::Q4_1, "q4_1"),
    (GgmlType::Q5_0, "q5_0"),
    (GgmlType::Q5_1, "q5_1"),
    (GgmlType::Q8_0, "q8_0"),
    (GgmlType::Q2_K, "q2_k"),
    (GgmlType::Q3_K, "q3_k"),
    (GgmlType::Q4_K, "q4_k"),
    (GgmlType::Q5_K, "q5_k"),
    (GgmlType::Q6_K, "q6_k"),
    (GgmlType::IQ4_NL, "iq4_nl"),
    (GgmlType::IQ4_XS, "iq4_xs"),
];

/// Tokens per matrix-vector launch (kernels exist for 1, 2, 4 and 8).
const TOKEN_TILES: [usize; 4] = [1, 2, 4, 8];
/// Head sizes up to 32 * E for the attention kernels of E values per lane.
pub(crate) const ATTN_E: [usize; 3] = [2, 4, 8];
const MMV_THREADS: usize = 128;
/// Default threads of an `attn_exact` block (`AE_THREADS` in kernels/attn.cu).
pub(crate) const EXACT_ATTN_THREADS: usize = 288;
/// Groups of 32 per lane and pass of the short exact products (`MMVE_G_SHORT` in
/// kernels/exact.cu).
const MMVE_G_SHORT: usize = 4;
/// Threads of a fused gate/up product block (`GLUQ_THREADS` in kernels/quant.cu).
const GLUQ_THREADS: u32 = 512;

/// Arithmetic choices where the GPU follows our CPU backend (llama.cpp's CPU) more or less
/// closely, read once from the environment:
/// activations are quantized as ggml-cpu does (`127 / max` inverse scale, ties to even,
/// block scales rounded to f16, so legacy-format products equal the CPU's up to f32
/// summation order); `RUSTORCH_CUDA_Q8=f32` keeps f32 block scales instead.
/// `RUSTORCH_CUDA_ATTN=cpu` runs attention as the CPU's flash attention (`attn_exact`: scores
/// summed in the CPU's order, the value accumulators rounded to f16 after every cell in cell
/// order) instead of the split f32 kernel: slower, for comparisons.
/// `RUSTORCH_CUDA_DECODE=tiled` runs one-token products with the multi-token kernels
/// (several threads per row, shared-memory sums) instead of a warp per row: for comparisons.
/// `RUSTORCH_CUDA_EXACT=1` computes as the CPU backend does, bit for bit where the formats
/// allow (see [`CudaDevice::set_exact`]).
/// `RUSTORCH_CUDA_MEGA=1` runs decode steps as one persistent kernel (see [`crate::mega`];
/// slower than graphs so far) and launches RMSNorm with its block size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Arith {
    pub q8_cpu: bool,
    pub attn_cpu: bool,
    pub decode_kernels: bool,
    pub mega: bool,
    /// Programmatic dependent launch (`RUSTORCH_CUDA_PDL`: `0` off, `1` on, default on with
    /// the one-token products prefetching their weights into L2 before they wait).
    pub pdl: Pdl,
    /// Timing only, results wrong (`RUSTORCH_CUDA_PROBE=nonorm,noattn,noqkv,noglu,noo,nodown,
    /// noout`): one-row launches of that kind skipped (RMSNorm, attention with its rotation
    /// and cache write, the Q/K/V, gate/up, square, wider-than-tall and output products), to
    /// measure what each costs in a decode step; `samew`: every weight matrix a view of the
    /// first of its shape (one layer's weights, L2-resident).
    pub probe: u32,
    /// Exact mode: every norm quantizes its output both ways, as before the norms learnt
    /// which their products take (`RUSTORCH_CUDA_NORMQ=both`; for comparisons).
    pub norm_both: bool,
    /// Exact mode: Q4_K and Q6_K matrices of one input share a launch (`RUSTORCH_CUDA_MIXQ=0`:
    /// a launch per type, as before; for comparisons).
    pub mixq: bool,
}

/// See [`Arith::pdl`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pdl {
    Off,
    On,
    Prefetch,
}

pub fn arith() -> Arith {
    static A: std::sync::OnceLock<Arith> = std::sync::OnceLock::new();
    *A.get_or_init(|| {
        let var = |k: &str| std::env::var(k).unwrap_or_default();
        Arith {
            q8_cpu: var("RUSTORCH_CUDA_Q8") != "f32",
            attn_cpu: var("RUSTORCH_CUDA_ATTN") == "cpu",
            decode_kernels: var("RUSTORCH_CUDA_DECODE") != "tiled",
            mega: var("RUSTORCH_CUDA_MEGA") == "1",
            pdl: match var("RUSTORCH_CUDA_PDL").as_str() {
                "0" => Pdl::Off,
                "1" => Pdl::On,
                _ => Pdl::Prefetch,
            },
            probe: var("RUSTORCH_CUDA_PROBE")
                .split(',')
                .map(|m| match m {
                    "nonorm" => 1,
                    "noattn" => 2,
                    "noqkv" => 4,
                    "noglu" => 8,
                    "noo" => 16,
                    "nodown" => 32,
                    "noout" => 64,
                    "samew" => 128,
                    _ => 0,
                })
                .fold(0, |a, b| a | b),
            norm_both: var("RUSTORCH_CUDA_NORMQ") == "both",
            mixq: var("RUSTORCH_CUDA_MIXQ") != "0",
        }
    })
}

/// Whether `RUSTORCH_CUDA_PROBE` skips this one-token product (see [`Arith::probe`]).
fn probe_skip(ws: &[&CudaMatrix], glu: bool) -> bool {
    let p = arith().probe;
    let w0 = ws[0];
    (p & 4 != 0 && ws.len() == 3)
        || (p & 8 != 0 && glu)
        || (p & 16 != 0 && !glu && ws.len() == 1 && w0.n_rows == w0.n_cols)
        || (p & 32 != 0 && !glu && ws.len() == 1 && w0.n_cols > w0.n_rows)
        || (p & 64 != 0 && !glu && ws.len() == 1 && w0.n_rows >= 8 * w0.n_cols)
}

fn stem(ty: GgmlType) -> Option<&'static str> {
    FORMATS.iter().find(|(t, _)| *t == ty).map(|(_, s)| *s)
}

fn is_float(ty: GgmlType) -> bool {
    matches!(ty, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16)
}

/// Whether the CUDA backend multiplies weights of type `ty`.
pub fn supports(ty: GgmlType) -> bool {
    stem(ty).is_some()
}

/// Every kernel the module must contain.
pub fn kernel_names() -> Vec<String> {
    let mut v: Vec<String> = [
        "quantize_q8_1",
        "quantize_q8_k",
        "rope_table",
        "attn_exact",
        "mmvd_q4k6k_c",
        "mmvd_q4k6k_w",
        "mmvd_q4k6k_w2",
        "mmvd_q6_k_p2",
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
        "kv_copy",
        "kv_shift",
        "attn_combine",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    for (ty, s) in FORMATS.iter().chain(TILED.iter()) {
        format_kernel_names(*ty, s, &mut v);
    }
    for e in ATTN_E {
        v.push(format!("attn_split_{e}"));
        v.push(format!("attn_rope_{e}"));
    }
    v
}

/// The kernels of weights of type `ty` whose kernel-name stem is `s` (a format of
/// [`FORMATS`], or a tiled layout of [`TILED`]).
fn format_kernel_names(ty: GgmlType, s: &str, v: &mut Vec<String>) {
    let kind = if is_float(ty) { "mmv" } else { "mmvq" };
    for nt in TOKEN_TILES {
        v.push(format!("{kind}_{s}_{nt}"));
    }
    v.push(format!("{kind}1_{s}"));
    if is_float(ty) {
        v.push(format!("mmv1j_{s}"));
    } else {
        v.push(format!("mmvq1g_{s}"));
    }
    v.push(format!("get_rows_{s}"));
    if exact_kind(ty).is_some() {
        v.push(format!("mmve_{s}"));
        v.push(format!("mmve_{s}_l"));
        v.push(format!("mmvd_{s}_c"));
        if matches!(ty, GgmlType::Q4_K | GgmlType::Q6_K) {
            v.push(format!("mmvd_{s}_w"));
            v.push(format!("mmvd_{s}_w2"));
        } else {
            v.push(format!("mmvd_{s}"));
            v.push(format!("mmvd_{s}_r2"));
            v.push(format!("mmvd_{s}_gq"));
        }
        if ty == GgmlType::Q8_0 {
            v.push(format!("mmvd_{s}_cp"));
        }
    }
}

/// A weight matrix on the device in its GGUF block format: `n_rows` rows of `n_cols`
/// (Q8_0 and Q4_0 rows of a multiple of 512 reordered: see [`tiled`]).
pub struct CudaMatrix {
    pub ty: GgmlType,
    pub n_rows: usize,
    pub n_cols: usize,
    /// Whether the rows are in the tiled layout (kernels `*_q8_0t*`, `*_q4_0t*`).
    tiled: bool,
    data: GpuVec<u8>,
}

impl CudaMatrix {
    /// Bytes on the device.
    pub fn bytes(&self) -> usize {
        self.data.len()
    }

    /// The kernel-name stem of its format and layout.
    fn stem(&self) -> Option<&'static str> {
        if self.tiled {
            tiled_stem(self.ty)
        } else {
            stem(self.ty)
        }
    }
}

/// The formats with a tiled layout ([`tiled`]) and the stem of the kernels reading it.
const TILED: [(GgmlType, &str); 2] = [(GgmlType::Q8_0, "q8_0t"), (GgmlType::Q4_0, "q4_0t")];

fn tiled_stem(ty: GgmlType) -> Option<&'static str> {
    TILED.iter().find(|(t, _)| *t == ty).map(|(_, s)| *s)
}

/// Whether a matrix of `ty` with rows of `n_cols` goes to the device tiled (`FQ8_0T` and
/// `FQ4_0T` in kernels/quant.cu): per 16 blocks of a row their 16 f16 scales, then the
/// blocks' code bytes in 16-byte pieces (Q8_0: every block's first piece, then every
/// block's second), so that a block's codes are aligned 16-byte loads where GGUF's 34- and
/// 18-byte blocks at 2-byte alignment take nine (five) 4-byte loads and eight (four) shifts.
/// The same bytes, moved (not a dequantized copy); the same arithmetic. Q8_0 and Q4_0, rows
/// of a multiple of 512 (whole tiles); not with the persistent decode kernel.
/// `RUSTORCH_CUDA_TILED=0` keeps GGUF's layout, `=q8_0` or `=q4_0` tiles only that format
/// (for comparisons).
fn tiled(ty: GgmlType, n_cols: usize) -> bool {
    static ON: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    let on = ON.get_or_init(|| std::env::var("RUSTORCH_CUDA_TILED").unwrap_or_default());
    tiled_stem(ty).is_some_and(|st| match on.as_str() {
        "" | "1" => true,
        "0" => false,
        f => st.strip_suffix('t') == Some(f),
    }) && n_cols.is_multiple_of(512)
        && !arith().mega
}

/// GGUF row bytes of Q8_0 or Q4_0 (`block` = 34 or 18 bytes per 32 weights; `n_cols` a
/// multiple of 512) in [`tiled`]'s layout.
fn tile_rows(bytes: &[u8], n_cols: usize, block: usize) -> Vec<u8> {
    let mut out = vec![0u8; bytes.len()];
    let (row, tile, pieces) = (n_cols / 32 * block, 16 * block, (block - 2) / 16);
    for (src, dst) in bytes.chunks_exact(row).zip(out.chunks_exact_mut(row)) {
        for (s, d) in src.chunks_exact(tile).zip(dst.chunks_exact_mut(tile)) {
            for (g, b) in s.chunks_exact(block).enumerate() {
                d[2 * g..2 * g + 2].copy_from_slice(&b[..2]);
                for p in 0..pieces {
                    let o = 32 + 256 * p + 16 * g;
                    d[o..o + 16].copy_from_slice(&b[2 + 16 * p..18 + 16 * p]);
                }
            }
        }
    }
    out
}

/// Device scratch reused from call to call: quantized activations, small index arrays and
/// the attention's partial results.
#[derive(Default)]
pub struct Scratch {
    aq: GpuVec<i8>,
    ads: GpuVec<f32>,
    ids: GpuVec<u32>,
    part: GpuVec<f32>,
    /// Where a fused gate/up product quantizes its output ([`CudaDevice::glu_fused`]): its
    /// input's quantization is still being read from `aq`/`ads`.
    gq: GpuVec<i8>,
    gds: GpuVec<f32>,
    /// The exact gate/up product's counts per block of 32 outputs (`mmvd_*_gq`).
    gcnt: GpuVec<u32>,
    /// The buffer (address, length, row width) whose quantization `aq`/`ads` hold (`gq`/`gds`
    /// with `alt`), when a fused op left it there for the next product
    /// ([`CudaDevice::add_rms_norm`]).
    pub(crate) acts_of: Option<(u64, usize, usize)>,
    alt: bool,
    /// Activations quantized for the exact products (codes; per block d and s, or per 256
    /// values d).
    eq: GpuVec<i8>,
    eds: GpuVec<f32>,
    /// When the op that set `acts_of` (a fused norm) also left that buffer's Q8_K
    /// quantization in `eq`/`eds`: the tokens taking the 4x8 rule.
    eacts_of: Option<usize>,
    /// Whether `aq`/`ads` hold `acts_of`'s 8-bit blocks (an exact-mode norm whose products
    /// take only Q8_K leaves just those: [`CudaDevice::norm_kinds`]).
    q8_ok: bool,
}

/// The activation format of an exact product ([`CudaDevice::set_exact`]) of weights of type `ty`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ExactActs {
    /// Q8_0 / Q8_1 blocks of 32 with the CPU's rule (`quantize_q8_1`, cpu = 1).
    Q8,
    /// Q8_K blocks of 256.
    Q8K,
}

/// (Q4_K: the CPU's repacked kernels, rows a multiple of 8; other Q4_K matrices keep the fast
/// kernel.)
fn exact_kind(ty: GgmlType) -> Option<ExactActs> {
    use GgmlType::*;
    match ty {
        Q4_0 | Q4_1 | Q5_0 | Q5_1 | Q8_0 => Some(ExactActs::Q8),
        Q4_K | Q6_K => Some(ExactActs::Q8K),
        _ => None,
    }
}

fn exact_ok(w: &CudaMatrix) -> bool {
    exact_kind(w.ty).is_some() && (w.ty != GgmlType::Q4_K || w.n_rows.is_multiple_of(8))
}

/// What an exact-mode norm quantizes its output into: [`NORM_Q8`] blocks of 32 (legacy
/// formats' products, and every product without an exact kernel), [`NORM_Q8K`] blocks of
/// 256 (Q4_K, Q6_K); both where the products that read it are not known.
pub const NORM_Q8: u8 = 1;
pub const NORM_Q8K: u8 = 2;

impl CudaDevice {
    /// The quantizations an exact-mode norm's output needs when `ws` are the products that
    /// read it next (a product finding one missing quantizes for itself).
    pub fn norm_kinds(ws: &[&CudaMatrix]) -> u8 {
        if arith().norm_both {
            return NORM_Q8 | NORM_Q8K;
        }
        ws.iter().fold(0, |k, w| {
            k | match exact_kind(w.ty) {
                Some(ExactActs::Q8K) if exact_ok(w) => NORM_Q8K,
                _ => NORM_Q8,
            }
        })
    }
}

impl Scratch {
    /// Device addresses of the quantized activations the next product reads.
    fn acts(&self) -> (u64, u64) {
        if self.alt {
            (self.gq.ptr(), self.gds.ptr())
        } else {
            (self.aq.ptr(), self.ads.ptr())
        }
    }

    /// Records that the next product's quantized activations (`gq`/`gds` with `alt`, else
    /// `aq`/`ads`) are those of the buffer `of` (address, length, row width), and no Q8_K
    /// quantization of it yet.
    fn claim_acts(&mut self, of: (u64, usize, usize), alt: bool) {
        self.acts_of = Some(of);
        self.eacts_of = None;
        self.q8_ok = true;
        self.alt = alt;
    }
}

/// The matrices of one `mmvq_*` launch (the kernels' `MmvJob`).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
struct MmvJob {
    w: [u64; 3],
    out: [u64; 3],
    rows: [i32; 3],
    n: i32,
    glu: i32,
    /// `mmvd_q4k6k_c`: bit m set where matrix m is Q6_K (the others Q4_K).
    q6k: i32,
}

// SAFETY: plain old data laid out as the kernels' struct (no padding: 72 bytes).
unsafe impl cudarc::driver::DeviceRepr for MmvJob {}

/// One query row's cells for [`CudaDevice::attention`]: the device address of their slots
/// in the K/V pools (u32 per cell; 0 = cell `c` is slot `c`) and of their positions (u32 per
/// cell), the cell count, and the query's position (cells after it are not visible).
#[derive(Debug, Clone, Copy)]
pub struct AttnRow {
    pub slots: u64,
    pub pos: u64,
    pub n_cells: u32,
    pub max_pos: u32,
}

impl AttnRow {
    /// Values per row in the packed descriptor array the kernel reads.
    pub const WORDS: usize = 3;

    /// Appends the row's descriptor as the kernel reads it.
    pub fn pack(&self, out: &mut Vec<u64>) {
        out.extend_from_slice(&[
            self.slots,
            self.pos,
            u64::from(self.n_cells) | (u64::from(self.max_pos) << 32),
        ]);
    }
}

/// What [`CudaDevice::attention`] needs to do `rope_kv_write`'s work itself for one query
/// row (the kernels' `AttnRope`): the row's unrotated `k` and its `v`, the row's angles,
/// the layer's cache pools, the device address of the row's new slot, the rotation.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct AttnRope {
    pub k: u64,
    pub v: u64,
    pub cos: u64,
    pub sin: u64,
    pub pool_k: u64,
    pub pool_v: u64,
    pub new_slot: u64,
    pub n_rot: i32,
    pub neox: i32,
}

// SAFETY: plain old data laid out as the kernels' struct (64 bytes, no padding).
unsafe impl cudarc::driver::DeviceRepr for AttnRope {}

/// Shapes and scaling of one attention call.
#[derive(Debug, Clone, Copy)]
pub struct AttnShape {
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim: usize,
    /// Halves between consecutive cells' rows (the cache's kv_dim).
    pub kv_stride: usize,
    pub scale: f32,
    /// Scores become `softcap · tanh(score / softcap)`; 0 = none.
    pub softcap: f32,
    /// Sliding window: a query at `p` sees positions `p + 1 - window ..= p`; 0 = none.
    pub window: u32,
}

fn check_len(what: &str, have: usize, need: usize) -> Result<()> {
    if have < need {
        return Err(CudaError::Unsupported(format!(
            "{what}: buffer holds {have} values, {need} needed"
        )));
    }
    Ok(())
}

fn blocks(n: usize, per: usize) -> u32 {
    n.div_ceil(per) as u32
}

/// Threads serving one output row: enough to cover `items` work items without many idle.
fn threads_per_row(items: usize) -> usize {
    if items <= 32 {
        32
    } else if items <= 128 {
        64
    } else {
        128
    }
}

/// Sequence splits for attention: enough blocks for two per multiprocessor, and at most 8
/// passes per split for long contexts (a block loads `per_pass` cells at once, see
/// [`attn_per_pass`]), but no split under 4 passes and at most 64 splits (the merge reads
/// every split).
pub fn auto_splits(
    multiprocessors: usize,
    heads_x_rows: usize,
    max_cells: usize,
    per_pass: usize,
) -> usize {
    let fill = (2 * multiprocessors).div_ceil(heads_x_rows.max(1));
    let long = max_cells.div_ceil(8 * per_pass);
    fill.max(long)
        .clamp(1, max_cells.div_ceil(4 * per_pass).max(1))
        .min(64)
}

/// Cells an attention block loads at once for heads of at most `32 * e` values: every warp
/// takes 8 / e cells (4e lanes read a cell's 8-value slices).
pub fn attn_per_pass(e: usize) -> usize {
    attn_warps() * (8 / e).max(1)
}

/// An RMSNorm folded into the one-token float product that reads its output: `h =
/// rms_norm(x) * w` (rows of `w.len()` values) computed by every block of the product into
/// shared memory, block 0 also storing `h`. Saves the norm's launch.
pub(crate) struct FoldNorm {
    pub x: u64,
    pub w: u64,
    pub eps: f32,
    pub h: u64,
}

/// Whether a residual add and an RMSNorm may fold into the one-token float products around
/// them (`RUSTORCH_CUDA_FOLD=0` turns it off).
pub fn fold_enabled() -> bool {
    static F: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *F.get_or_init(|| std::env::var("RUSTORCH_CUDA_FOLD").map_or(true, |v| v != "0"))
}

/// Threads per block of a one-token float product that computes a folded norm in each
/// block: `RUSTORCH_CUDA_FOLD_THREADS` (128, 256 or 512), default 128.
pub fn fold_threads() -> usize {
    static T: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *T.get_or_init(|| {
        env_usize(
            "RUSTORCH_CUDA_FOLD_THREADS",
            |t| matches!(t, 128 | 256 | 512),
            128,
        )
    })
}

/// The value of environment variable `name` where it parses and `ok` accepts it, else
/// `default`.
fn env_usize(name: &str, ok: impl Fn(usize) -> bool, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .filter(|&v| ok(v))
        .unwrap_or(default)
}

/// `s` warps per row for rows of at least `RUSTORCH_CUDA_MMV_SPLIT_MIN` values (default
/// 4096), else 1.
fn split_for(s: usize, n_cols: usize) -> usize {
    static M: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    let min = *M.get_or_init(|| env_usize("RUSTORCH_CUDA_MMV_SPLIT_MIN", |_| true, 4096));
    if n_cols >= min {
        s
    } else {
        1
    }
}

/// Warps per row of a one-token quantized product (`mmvq1_*` without `glu`): 2 for rows of
/// at least `RUSTORCH_CUDA_MMV_SPLIT_MIN` values (default 4096), else 1;
/// `RUSTORCH_CUDA_MMVQ_SPLIT` (1, 2 or 4) sets the 2. (H100, TinyLlama shape, tg128, the
/// down product split, 1 / 2 / 4 warps, two rounds: Q4_0 1280,1348 / 1372,1392 /
/// 1328,1307; Q4_K_M 1234,1258 / 1306,1308 / 1256,1172; Q8_0 1073,1062 / 1101,1052 /
/// 1064,1109 t/s, a noisy lease.)
pub fn mmvq_split(n_cols: usize) -> usize {
    static S: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    let s = *S.get_or_init(|| env_usize("RUSTORCH_CUDA_MMVQ_SPLIT", |s| matches!(s, 1 | 2 | 4), 2));
    split_for(s, n_cols)
}

/// Warps per row of a one-token float product (`mmv1_*`, `mmv1j_*`): 4 for rows of at least
/// `RUSTORCH_CUDA_MMV_SPLIT_MIN` values (default 4096), else 1; `RUSTORCH_CUDA_MMV_SPLIT` (1,
/// 2 or 4) sets the 4. (H100, F16 TinyLlama shape, tg128, the down product's 5632-wide rows
/// split: 1 warp 750/767 t/s, 2 warps 795/801, 4 warps 818/810; the 2048-wide rows split in 2
/// as well: 793/796.)
pub fn mmv_split(n_cols: usize) -> usize {
    static S: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    let s = *S.get_or_init(|| env_usize("RUSTORCH_CUDA_MMV_SPLIT", |s| matches!(s, 1 | 2 | 4), 4));
    split_for(s, n_cols)
}

/// Groups of 32 per row and round of a cooperative exact product (`mmvd_*_c`; its shared
/// memory, at most 144 * (cap + 4) + 32 * cap bytes, under 48 KiB).
const MMVD_CAP: usize = 256;
const _: () =
    assert!(MMVD_CAP.is_multiple_of(8) && 144 * (MMVD_CAP + 4) + 32 * MMVD_CAP <= 48 * 1024);

/// Legacy-format rows of more groups of 32 than this take the cooperative exact kernels
/// (`mmvd_*_c`), the others four rows per warp: `RUSTORCH_CUDA_COOP_MIN`, default 64.
fn exact_coop_min() -> usize {
    static M: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *M.get_or_init(|| env_usize("RUSTORCH_CUDA_COOP_MIN", |_| true, 64))
}

/// Q4_K and Q6_K rows of at most [`exact_coop_min`] groups of 32 take four rows per warp
/// (`mmvd_*_w`), unless `RUSTORCH_CUDA_KWARP=0` (a block of four warps per four rows, the
/// cooperative `mmvd_*_c`, as longer rows do).
fn exact_kwarp() -> bool {
    static D: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *D.get_or_init(|| std::env::var("RUSTORCH_CUDA_KWARP").map_or(true, |v| v != "0"))
}

/// Exact Q6_K products of at least this many rows in one matrix (the output matrix) take
/// `mmvd_q6_k_p2` instead of `mmvd_q6_k_w2` (`RUSTORCH_CUDA_W2P_MIN`; a huge value turns it
/// off). H200, tg128 --gpu-exact, two leases of three rounds, medians against off: Q4_0
/// (Q6_K output matrix) +0.4% and +1.1%, Q4_K_M +0.8% and +1.5% (docs/performance.md,
/// session 26).
fn exact_w2p_min() -> usize {
    static M: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *M.get_or_init(|| env_usize("RUSTORCH_CUDA_W2P_MIN", |_| true, 16384))
}

/// Which exact products of rows up to 64 groups take two rows per warp in one pass over a
/// row (legacy formats `mmvd_*_r2`, Q4_K / Q6_K `mmvd_*_w2`) instead of four in two passes
/// (`mmvd_*`, `mmvd_*_w`): `RUSTORCH_CUDA_MMVD_R2` = 0 none, 1 all but gate/up (the
/// default), 2 all (the legacy formats; Q4_K / Q6_K as 1). H200, tg128 --gpu-exact, 1 against
/// 0: Q4_0 +5-6%, Q4_K_M +5%, Q8_0 the same; 2 is slower than 1 (docs/performance.md,
/// session 24).
fn exact_r2() -> usize {
    static M: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *M.get_or_init(|| env_usize("RUSTORCH_CUDA_MMVD_R2", |v| v <= 2, 1))
}

/// Whether exact mode's legacy-format product of one to three tokens of rows of `ng` groups
/// of 32 (at most [`exact_coop_min`]) takes two rows per warp in one pass (`mmvd_*_r2`)
/// rather than four in passes of 32 (`mmvd_*`); `glu`: a gate/up product.
fn exact_two_rows(ng: usize, glu: bool) -> bool {
    ng <= 64 && (exact_r2() == 2 || (exact_r2() == 1 && !glu))
}

/// One token's exact gate/up product quantizes its output for the down product in the same
/// launch (`mmvd_*_gq`), unless `RUSTORCH_CUDA_EXACT_GQ=0` (a `quantize_q8_1` launch).
fn exact_gq() -> bool {
    static D: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *D.get_or_init(|| std::env::var("RUSTORCH_CUDA_EXACT_GQ").map_or(true, |v| v != "0"))
}

/// Exact products of one to three tokens by the `mmvd_*` kernels (every lane of the
/// chain-walking warps busy: kernels/exact.cu), unless `RUSTORCH_CUDA_DIRECT=0` (the
/// prompts' `mmve_*`, a warp per row).
pub fn exact_direct() -> bool {
    static D: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *D.get_or_init(|| std::env::var("RUSTORCH_CUDA_DIRECT").map_or(true, |v| v != "0"))
}

/// Threads of an `attn_exact` block (`RUSTORCH_CUDA_AE_THREADS`, a multiple of 32 from 288 to
/// 1024: the head's dimensions and one more warp must fit).
pub fn exact_attn_threads() -> usize {
    static T: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *T.get_or_init(|| {
        env_usize(
            "RUSTORCH_CUDA_AE_THREADS",
            |t| (288..=1024).contains(&t) && t % 32 == 0,
            EXACT_ATTN_THREADS,
        )
    })
}

/// Warps per attention block (`ATTN_WARPS` in kernels/attn.cu): 8, or
/// `RUSTORCH_CUDA_ATTN_WARPS` (1 to 32); 4 with the persistent kernel, whose blocks have 4.
/// (On an H100, TinyLlama shape, a block loading 8 / e cells per warp at once, tg128 t/s,
/// two rounds: 2 warps Q4_0 1294/1305, F16 732/726; 4 warps 1347/1349, 727/744; 8 warps
/// 1377/1386, 768/757; 16 warps 1335/1333, 717/712; tg512 Q4_0 with 4 / 8 / 16 warps
/// 1268 / 1303 / 1218.)
pub fn attn_warps() -> usize {
    static W: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *W.get_or_init(|| {
        if arith().mega {
            return 4;
        }
        env_usize("RUSTORCH_CUDA_ATTN_WARPS", |w| (1..=32).contains(&w), 8)
    })
}

impl CudaDevice {
    /// Uploads a weight matrix in its GGUF format (no conversion), in its own allocation:
    /// the kernels rely on its base being 16-byte aligned (Q4_K's 16-byte loads).
    pub fn upload_matrix(
        &self,
        ty: GgmlType,
        bytes: &[u8],
        n_rows: usize,
        n_cols: usize,
    ) -> Result<CudaMatrix> {
        if !supports(ty) {
            return Err(CudaError::Unsupported(format!("weights of type {ty}")));
        }
        let bs = ty.block_size();
        if !n_cols.is_multiple_of(bs) || (!is_float(ty) && !n_cols.is_multiple_of(32)) {
            return Err(CudaError::Unsupported(format!(
                "{ty} matrix with {n_cols} columns (not whole blocks)"
            )));
        }
        let need = n_rows * (n_cols / bs) * ty.type_size();
        if bytes.len() != need {
            return Err(CudaError::Unsupported(format!(
                "{ty} matrix {n_rows}x{n_cols}: {} bytes given, {need} expected",
                bytes.len()
            )));
        }
        let tiled = tiled(ty, n_cols);
        let moved;
        let bytes = if tiled {
            moved = tile_rows(bytes, n_cols, ty.type_size());
            &moved[..]
        } else {
            bytes
        };
        let data = if arith().probe & 128 != 0 {
            // timing only (results wrong): every matrix of a shape seen before is a view of
            // the first one's bytes, so a step reads one layer's weights again and again
            // (L2-resident): the ceiling of any weight prefetching
            type Seen = std::collections::HashMap<(GgmlType, usize, usize), (u64, usize)>;
            static SEEN: std::sync::Mutex<Option<Seen>> = std::sync::Mutex::new(None);
            let mut g = SEEN.lock().unwrap_or_else(|e| e.into_inner());
            let seen = g.get_or_insert_with(Default::default);
            match seen.get(&(ty, n_rows, n_cols)) {
                // SAFETY: the first matrix of the shape is kept by the model (probe only)
                Some(&(ptr, len)) => unsafe { GpuVec::borrowed(ptr, len) },
                None => {
                    let data = self.upload(bytes)?;
                    seen.insert((ty, n_rows, n_cols), (data.ptr(), data.len()));
                    data
                }
            }
        } else {
            self.upload(bytes)?
        };
        Ok(CudaMatrix {
            ty,
            n_rows,
            n_cols,
            tiled,
            data,
        })
    }

    fn launch_1d(&self, name: &str, n: usize, args: &[&dyn KernelArg]) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        // the persistent decode kernel (crate::mega) runs blocks of 128 threads
        let bs = if arith().mega { 128 } else { 256 };
        self.launch(name, (blocks(n, bs), 1, 1), bs as u32, args)
    }

    /// Quantizes `n_tok` rows of `n_cols` activations into `s` (8-bit codes and a scale
    /// per 32).
    fn quantize_acts(
        &self,
        x: &GpuVec<f32>,
        n_tok: usize,
        n_cols: usize,
        s: &mut Scratch,
    ) -> Result<()> {
        check_len("activations", x.len(), n_tok * n_cols)?;
        if s.acts_of == Some((x.ptr(), x.len(), n_cols)) && s.q8_ok {
            return Ok(());
        }
        s.acts_of = None;
        s.alt = false;
        let ng = n_cols / 32;
        s.aq.resize(self, n_tok * n_cols)?;
        s.ads.resize(self, n_tok * ng * 2)?;
        let (xp, aq, ads, nc) = (x.ptr(), s.aq.ptr(), s.ads.ptr(), n_cols as i32);
        let cpu = i32::from(arith().q8_cpu);
        // warps per block (a block of 32 values each): 4 for the persistent decode kernel
        let warps = if arith().mega { 4 } else { 8 };
        self.launch(
            "quantize_q8_1",
            (blocks(ng, warps), n_tok as u32, 1),
            32 * warps as u32,
            &[&xp, &aq, &ads, &nc, &cpu],
        )?;
        Ok(())
    }

    /// `out[t] = W · x[t]` for the `x.len() / n_cols` rows of `x`.
    pub fn matmul(
        &self,
        w: &CudaMatrix,
        x: &GpuVec<f32>,
        out: &mut GpuVec<f32>,
        s: &mut Scratch,
    ) -> Result<()> {
        self.matmul_many(&[w], x, &mut [out], s)
    }

    /// Several products of one input (its quantization is shared). All matrices must have
    /// the same column count.
    pub fn matmul_many(
        &self,
        ws: &[&CudaMatrix],
        x: &GpuVec<f32>,
        outs: &mut [&mut GpuVec<f32>],
        s: &mut Scratch,
    ) -> Result<()> {
        let Some(first) = ws.first() else {
            return Ok(());
        };
        let n_cols = first.n_cols;
        if ws.iter().any(|w| w.n_cols != n_cols) || outs.len() != ws.len() {
            return Err(CudaError::Unsupported(
                "matmul_many: matrices of different widths".into(),
            ));
        }
        if !x.len().is_multiple_of(n_cols) {
            return Err(CudaError::Unsupported(format!(
                "matmul: {} activations in rows of {n_cols}",
                x.len()
            )));
        }
        let n_tok = x.len() / n_cols;
        if self.exact() && ws.iter().any(|w| exact_ok(w)) {
            if ws.iter().all(|w| exact_ok(w)) {
                return self.mmv_exact(ws, x, n_tok, outs, false, s);
            }
            // the matrices with an exact product take it, the others the default kernels
            for (w, out) in ws.iter().zip(outs.iter_mut()) {
                self.matmul_many(&[w], x, &mut [&mut **out], s)?;
            }
            return Ok(());
        }
        if ws.iter().any(|w| !is_float(w.ty)) {
            self.quantize_acts(x, n_tok, n_cols, s)?;
        }
        // quantized matrices of one format share a launch (up to three); so do float ones
        // for one token
        if ws.len() <= 3 && ws.iter().all(|w| w.ty == first.ty) {
            if !is_float(first.ty) {
                return self.mmvq(ws, n_tok, outs, 0, s);
            }
            if n_tok == 1 && ws.len() > 1 && self.float_job_ok(first) {
                return self.mmv1_job(ws, x, outs, 0, None);
            }
        }
        for (w, out) in ws.iter().zip(outs.iter_mut()) {
            if is_float(w.ty) {
                self.mmv_float(w, x, n_tok, out)?;
            } else {
                self.mmvq(&[w], n_tok, &mut [&mut **out], 0, s)?;
            }
        }
        Ok(())
    }

    /// Products with the CPU's arithmetic ([`CudaDevice::set_exact`]): `x` quantized as the CPU
    /// quantizes it for each format (the legacy formats' Q8 blocks shared with the fused
    /// norm's), then `mmvd_*` for one to three tokens (four rows per group of eight-thread
    /// chains) or a warp per row and token (`mmve_*`), up to three matrices of one type per
    /// launch (or of Q4_K and Q6_K together, `mmvd_q4k6k_c`). With `glu` (`ws` = gate and up,
    /// one output): `silu(gate) * up`.
    fn mmv_exact(
        &self,
        ws: &[&CudaMatrix],
        x: &GpuVec<f32>,
        n_tok: usize,
        outs: &mut [&mut GpuVec<f32>],
        glu: bool,
        s: &mut Scratch,
    ) -> Result<()> {
        let n_cols = ws[0].n_cols;
        let nc = n_cols as i32;
        let n_gemm = n_tok - n_tok % 4;
        let mut q8k_done: Option<usize> = None;
        let mut i = 0;
        while i < ws.len() {
            let ty = ws[i].ty;
            // Q4_K and Q6_K matrices share a launch (`mmvd_q4k6k_c`) where each but the last
            // has whole blocks of four rows
            let kq = |t: GgmlType| matches!(t, GgmlType::Q4_K | GgmlType::Q6_K);
            let mix = !glu && n_tok < 4 && exact_direct() && arith().mixq && kq(ty);
            let mut k = i + 1;
            while k < ws.len()
                && (glu
                    || (k - i < 3
                        && ((ws[k].ty == ty && ws[i..k].iter().all(|w| w.ty == ty))
                            || (mix
                                && kq(ws[k].ty)
                                && ws[i..k].iter().all(|w| w.n_rows.is_multiple_of(4))))))
            {
                k += 1;
            }
            let q6k = if ws[i..k].iter().any(|w| w.ty != ty) {
                ws[i..k]
                    .iter()
                    .enumerate()
                    .filter(|(_, w)| w.ty == GgmlType::Q6_K)
                    .fold(0, |a, (m, _)| a | (1 << m))
            } else {
                0
            };
            let (Some(kind), Some(st)) = (exact_kind(ty), ws[i].stem()) else {
                return Err(CudaError::Unsupported(format!("exact product of {ty}")));
            };
            // the CPU's Q4_K gemm rows (their own activation rule and float steps), Q6_K's
            // tiled kernel from 8 rows
            let (n_4x8, mode) = match ty {
                GgmlType::Q4_K => (n_gemm, n_gemm as i32),
                GgmlType::Q6_K => (0, i32::from(n_tok >= 8)),
                _ => (0, 0),
            };
            let (aq, ads) = match kind {
                ExactActs::Q8 if arith().q8_cpu => {
                    self.quantize_acts(x, n_tok, n_cols, s)?;
                    s.acts()
                }
                ExactActs::Q8 => {
                    // (RUSTORCH_CUDA_Q8=f32: the shared quantization is not the CPU's)
                    q8k_done = None;
                    self.quantize_exact(x, n_tok, n_cols, 32, 1, s)?
                }
                ExactActs::Q8K => {
                    if !n_cols.is_multiple_of(256) {
                        return Err(CudaError::Unsupported(format!(
                            "Q8_K activations of rows of {n_cols}"
                        )));
                    }
                    let fused =
                        s.acts_of == Some((x.ptr(), x.len(), n_cols)) && s.eacts_of == Some(n_4x8);
                    if q8k_done != Some(n_4x8) && !fused {
                        q8k_done = Some(n_4x8);
                        self.quantize_exact(x, n_tok, n_cols, 256, n_4x8 as i32, s)?
                    } else {
                        (s.eq.ptr(), s.eds.ptr())
                    }
                }
            };
            let mut job = MmvJob {
                n: (k - i) as i32,
                glu: i32::from(glu),
                q6k,
                ..MmvJob::default()
            };
            for (m, w) in ws[i..k].iter().enumerate() {
                job.w[m] = w.data.ptr();
                job.rows[m] = w.n_rows as i32;
            }
            let n_out = if glu { 1 } else { k - i };
            for m in 0..n_out {
                outs[i + m].resize(self, n_tok * ws[i + m].n_rows)?;
                job.out[m] = outs[i + m].ptr();
            }
            if n_tok == 1 && probe_skip(&ws[i..k], glu) {
                i = k;
                continue;
            }
            if n_tok < 4 && exact_direct() {
                let rows: usize = if glu {
                    2 * ws[i].n_rows
                } else {
                    ws[i..k].iter().map(|w| w.n_rows).sum()
                };
                let ng = n_cols / 32;
                if kq(ty) && ng <= exact_coop_min() && exact_kwarp() {
                    // four rows per warp (mmvd_warp_kernel), or two in one pass where the
                    // rows take one (mmvd_warp2_kernel, as the legacy formats' mmvd_*_r2)
                    let two = ng <= 64 && !glu && exact_r2() != 0;
                    let sfx = if two { "_w2" } else { "_w" };
                    if two
                        && q6k == 0
                        && ty == GgmlType::Q6_K
                        && k - i == 1
                        && rows >= exact_w2p_min()
                        && (n_cols / ty.block_size() * ty.type_size()).is_multiple_of(16)
                    {
                        // many rows (the output matrix): warps walking row pairs, each
                        // pair's bytes copied into shared memory (mmvd_q6_k_p2), as many
                        // blocks as fit at once (the occupancy calculator's count: five a
                        // multiprocessor on sm_90, by its 44.7 KB of shared memory)
                        let per_sm = self.blocks_per_sm("mmvd_q6_k_p2", 128, 0);
                        let nb = blocks(rows, 8).min(per_sm * self.info.multiprocessors as u32);
                        self.launch(
                            "mmvd_q6_k_p2",
                            (nb, n_tok as u32, 1),
                            128,
                            &[&job, &aq, &ads, &nc, &mode],
                        )?;
                        i = k;
                        continue;
                    }
                    let name = if q6k != 0 {
                        format!("mmvd_q4k6k{sfx}")
                    } else {
                        format!("mmvd_{st}{sfx}")
                    };
                    self.launch(
                        &name,
                        (blocks(rows, if two { 8 } else { 16 }), n_tok as u32, 1),
                        128,
                        &[&job, &aq, &ads, &nc, &mode],
                    )?;
                } else if kq(ty) || ng > exact_coop_min() {
                    // a block of four warps per four rows (mmvd_coop_kernel)
                    let cap = ng.next_multiple_of(8).min(MMVD_CAP);
                    let smem_of = |ty: GgmlType| {
                        let (lanes, dl, gpb) = match ty {
                            GgmlType::Q4_K => (2, 2, 8),
                            GgmlType::Q6_K => (8, 1, 8),
                            _ => (8, 1, 1),
                        };
                        let min = matches!(ty, GgmlType::Q4_1 | GgmlType::Q5_1);
                        16 * lanes * (cap + 4)
                            + 16 * dl * (cap / gpb + 4)
                            + if min { 32 * cap } else { 0 }
                    };
                    let smem = ws[i..k].iter().map(|w| smem_of(w.ty)).max().unwrap_or(0);
                    let capi = cap as i32;
                    // Q8_0's rows asked of L2 before the wait (`_cp`) only where no short
                    // launch (a quantization) runs then: it slowed that launch more than it
                    // helped (kernels/exact.cu, MMVD_C_PF8). In exact mode `alt` activations
                    // come only from the gate/up launch that quantized its own output.
                    let pf8 = ty == GgmlType::Q8_0 && kind == ExactActs::Q8 && s.alt;
                    let name = if q6k != 0 {
                        "mmvd_q4k6k_c".to_string()
                    } else if pf8 {
                        format!("mmvd_{st}_cp")
                    } else {
                        format!("mmvd_{st}_c")
                    };
                    self.launch_smem(
                        &name,
                        (blocks(rows, 4), n_tok as u32, 1),
                        128,
                        smem as u32,
                        &[&job, &aq, &ads, &nc, &capi],
                    )?;
                } else {
                    // eight threads per row, two rows (glu: a gate/up pair) per warp in one
                    // pass (mmvd_*_r2), or four (two gate/up pairs) in passes of 32 blocks
                    let two = exact_two_rows(ng, glu);
                    self.launch(
                        &format!("mmvd_{st}{}", if two { "_r2" } else { "" }),
                        (blocks(rows, if two { 8 } else { 16 }), n_tok as u32, 1),
                        128,
                        &[&job, &aq, &ads, &nc, &mode],
                    )?;
                }
                i = k;
                continue;
            }
            // (with glu, the gate and up rows share a warp, except Q6_K's: one each)
            let warps: usize = if glu && ty != GgmlType::Q6_K {
                ws[i].n_rows
            } else if glu {
                2 * ws[i].n_rows
            } else {
                ws[i..k].iter().map(|w| w.n_rows).sum()
            };
            // rows one pass of the short kernel does not cover take the long one (32 * G
            // groups of 32 per warp and pass, shared by R rows: see kernels/exact.cu)
            let rows_per_warp = if glu && ty != GgmlType::Q6_K { 2 } else { 1 };
            let long = n_cols / 32 > 32 * MMVE_G_SHORT / rows_per_warp;
            self.launch(
                &format!("mmve_{st}{}", if long { "_l" } else { "" }),
                (blocks(warps, 4), n_tok as u32, 1),
                128,
                &[&job, &aq, &ads, &nc, &mode],
            )?;
            i = k;
        }
        Ok(())
    }

    /// `x` quantized into `s.eq`/`s.eds` with the CPU's rule: blocks of 32 (Q8_0 / Q8_1,
    /// `quantize_q8_1` with `arg` = 1, the CPU flag) or of 256 (Q8_K, `quantize_q8_k` with
    /// `arg` tokens taking the 4x8 rule). Returns the codes' and scales' addresses.
    fn quantize_exact(
        &self,
        x: &GpuVec<f32>,
        n_tok: usize,
        n_cols: usize,
        block: usize,
        arg: i32,
        s: &mut Scratch,
    ) -> Result<(u64, u64)> {
        let per32 = block == 32;
        s.eacts_of = None;
        s.eq.resize(self, n_tok * n_cols)?;
        s.eds
            .resize(self, n_tok * n_cols / block * if per32 { 2 } else { 1 })?;
        let (xp, eq, eds, nc) = (x.ptr(), s.eq.ptr(), s.eds.ptr(), n_cols as i32);
        let (name, per_block, threads) = if per32 {
            ("quantize_q8_1", 8, 256)
        } else {
            ("quantize_q8_k", 4, 128)
        };
        self.launch(
            name,
            (blocks(n_cols / block, per_block), n_tok as u32, 1),
            threads,
            &[&xp, &eq, &eds, &nc, &arg],
        )?;
        Ok((eq, eds))
    }

    /// Makes room in `s` for the 8-bit quantization of an attention output `out` (`len`
    /// values in rows of `width`; heads of `hd` values, a multiple of 32, else none) and
    /// records it as the activations of the product that follows. Returns the kernels'
    /// `quant` flag.
    fn quantized_out(
        &self,
        s: &mut Scratch,
        out: &GpuVec<f32>,
        len: usize,
        width: usize,
        hd: usize,
    ) -> Result<i32> {
        if !hd.is_multiple_of(32) {
            s.acts_of = None;
            return Ok(0);
        }
        s.aq.resize(self, len)?;
        s.ads.resize(self, len / 32 * 2)?;
        s.claim_acts((out.ptr(), len, width), false);
        Ok(1)
    }

    /// Tokens of each launch: tiles of 1, 2, 4 or 8 over `n_tok`, as `(first, count, tile)`.
    fn token_tiles(n_tok: usize) -> impl Iterator<Item = (usize, usize, usize)> {
        let mut t0 = 0;
        std::iter::from_fn(move || {
            if t0 >= n_tok {
                return None;
            }
            let left = n_tok - t0;
            let nt = TOKEN_TILES
                .iter()
                .copied()
                .find(|&t| t >= left.min(8))
                .unwrap_or(8);
            let cnt = left.min(nt);
            let r = (t0, cnt, nt);
            t0 += cnt;
            Some(r)
        })
    }

    /// The product of a float matrix (F32, F16, BF16) with f32 activations.
    fn mmv_float(
        &self,
        w: &CudaMatrix,
        x: &GpuVec<f32>,
        n_tok: usize,
        out: &mut GpuVec<f32>,
    ) -> Result<()> {
        out.resize(self, n_tok * w.n_rows)?;
        let st = w
            .stem()
            .ok_or_else(|| CudaError::Unsupported(format!("{}", w.ty)))?;
        let (wp, nr, nc) = (w.data.ptr(), w.n_rows as i32, w.n_cols as i32);
        let per = if w.ty == GgmlType::F32 { 4 } else { 8 };
        if n_tok == 1 && w.n_cols.is_multiple_of(per) && arith().decode_kernels {
            // one token: a warp per row, 16-byte loads (rows stay 16-byte aligned)
            return self.launch_mmv1(w, st, x, out, 0);
        }
        let tpr = threads_per_row(w.n_cols);
        let grid = blocks(w.n_rows, MMV_THREADS / tpr);
        let tpr_i = tpr as i32;
        for (t0, cnt, nt) in Self::token_tiles(n_tok) {
            let cnt_i = cnt as i32;
            let op = out.ptr() + (t0 * w.n_rows * 4) as u64;
            let xp = x.ptr() + (t0 * w.n_cols * 4) as u64;
            self.launch(
                &format!("mmv_{st}_{nt}"),
                (grid, 1, 1),
                MMV_THREADS as u32,
                &[&wp, &xp, &op, &nr, &nc, &cnt_i, &tpr_i],
            )?;
        }
        Ok(())
    }

    /// One token, a float matrix: `out = x·W` and also `acc += out` in the same launch (a
    /// residual add folded into the product). None where the one-token float kernel does
    /// not apply.
    pub fn matmul_acc(
        &self,
        w: &CudaMatrix,
        x: &GpuVec<f32>,
        out: &mut GpuVec<f32>,
        acc: &GpuVec<f32>,
    ) -> Option<Result<()>> {
        if x.len() != w.n_cols || acc.len() != w.n_rows || !self.float_job_ok(w) {
            return None;
        }
        let st = w.stem()?;
        Some(
            out.resize(self, w.n_rows)
                .and_then(|_| self.launch_mmv1(w, st, x, out, acc.ptr())),
        )
    }

    /// The one-token float kernel `mmv1_{st}` (`out` sized): `out = x·W`, and with `acc`
    /// (an address, 0 for none) `acc += out` too.
    fn launch_mmv1(
        &self,
        w: &CudaMatrix,
        st: &str,
        x: &GpuVec<f32>,
        out: &GpuVec<f32>,
        acc: u64,
    ) -> Result<()> {
        let (wp, nr, nc) = (w.data.ptr(), w.n_rows as i32, w.n_cols as i32);
        let (xp, op) = (x.ptr(), out.ptr());
        if probe_skip(&[w], false) {
            return Ok(());
        }
        let sp = mmv_split(w.n_cols);
        let spi = sp as i32;
        self.launch(
            &format!("mmv1_{st}"),
            (blocks(w.n_rows * sp, MMV_THREADS / 32), 1, 1),
            MMV_THREADS as u32,
            &[&wp, &xp, &op, &nr, &nc, &spi, &acc],
        )
    }

    /// Whether one-token float products of `w`'s type and width can share a launch.
    pub(crate) fn float_job_ok(&self, w: &CudaMatrix) -> bool {
        let per = if w.ty == GgmlType::F32 { 4 } else { 8 };
        is_float(w.ty) && w.n_cols.is_multiple_of(per) && arith().decode_kernels && !arith().mega
    }

    /// One token: up to three float matrices of one type and width in one launch, or with
    /// `glu` (two matrices of equal rows) `outs[0] = act(x·W0) ⊙ x·W1`. With `norm`, `x` is
    /// `norm`'s output, which every block computes itself (see [`FoldNorm`]).
    pub(crate) fn mmv1_job(
        &self,
        ws: &[&CudaMatrix],
        x: &GpuVec<f32>,
        outs: &mut [&mut GpuVec<f32>],
        glu: i32,
        norm: Option<&FoldNorm>,
    ) -> Result<()> {
        let first = ws[0];
        let st = first
            .stem()
            .ok_or_else(|| CudaError::Unsupported(format!("{}", first.ty)))?;
        let mut job = MmvJob {
            n: ws.len() as i32,
            glu,
            ..MmvJob::default()
        };
        for (m, w) in ws.iter().enumerate() {
            job.w[m] = w.data.ptr();
            job.rows[m] = w.n_rows as i32;
        }
        let n_out = if glu != 0 { 1 } else { ws.len() };
        for (m, out) in outs.iter_mut().enumerate().take(n_out) {
            out.resize(self, ws[m].n_rows)?;
            job.out[m] = out.ptr();
        }
        let rows: usize = if glu != 0 {
            first.n_rows
        } else {
            ws.iter().map(|w| w.n_rows).sum()
        };
        let (xp, nc) = (x.ptr(), first.n_cols as i32);
        if probe_skip(ws, glu != 0) {
            return Ok(());
        }
        let sp = mmv_split(first.n_cols);
        let spi = sp as i32;
        let (nx, nw, eps, hp) = norm.map_or((0, 0, 0.0f32, 0), |f| (f.x, f.w, f.eps, f.h));
        let (smem, threads) = match norm {
            Some(_) => (first.n_cols * 4, fold_threads()),
            None => (0, MMV_THREADS),
        };
        self.launch_smem(
            &format!("mmv1j_{st}"),
            (blocks(rows * sp, threads / 32), 1, 1),
            threads as u32,
            smem as u32,
            &[&job, &xp, &nc, &spi, &nx, &nw, &eps, &hp],
        )
    }

    /// Products of up to three quantized matrices of one format and width with the
    /// activations already quantized into `s`, one launch per token tile; with `glu` (1 =
    /// SiLU, 2 = GELU; two matrices of equal rows) `outs[0]` gets `act(x·W0) ⊙ x·W1`.
    fn mmvq(
        &self,
        ws: &[&CudaMatrix],
        n_tok: usize,
        outs: &mut [&mut GpuVec<f32>],
        glu: i32,
        s: &Scratch,
    ) -> Result<()> {
        let first = ws[0];
        let st = first
            .stem()
            .ok_or_else(|| CudaError::Unsupported(format!("{}", first.ty)))?;
        let n_cols = first.n_cols;
        let tpr = threads_per_row(n_cols / 32);
        let rpb = MMV_THREADS / tpr;
        let mut job = MmvJob::default();
        let n_out = if glu != 0 { 1 } else { ws.len() };
        for (m, out) in outs.iter_mut().enumerate().take(n_out) {
            out.resize(self, n_tok * ws[m].n_rows)?;
        }
        let grid: usize = if glu != 0 {
            ws[0].n_rows.div_ceil(rpb)
        } else {
            ws.iter().map(|w| w.n_rows.div_ceil(rpb)).sum()
        };
        job.n = ws.len() as i32;
        job.glu = glu;
        for (m, w) in ws.iter().enumerate() {
            job.w[m] = w.data.ptr();
            job.rows[m] = w.n_rows as i32;
        }
        let (nc, tpr_i) = (n_cols as i32, tpr as i32);
        if n_tok == 1 && arith().decode_kernels {
            // one token: a warp per row (gate and up rows together with `glu`)
            for (slot, out) in job.out.iter_mut().zip(outs.iter()).take(n_out) {
                *slot = out.ptr();
            }
            let rows: usize = if glu != 0 {
                ws[0].n_rows
            } else {
                ws.iter().map(|w| w.n_rows).sum()
            };
            let (aq, ads) = s.acts();
            if probe_skip(ws, glu != 0) {
                return Ok(());
            }
            let sp = if glu != 0 { 1 } else { mmvq_split(n_cols) };
            let spi = sp as i32;
            return self.launch(
                &format!("mmvq1_{st}"),
                (blocks(rows * sp, MMV_THREADS / 32), 1, 1),
                MMV_THREADS as u32,
                &[&job, &aq, &ads, &nc, &spi],
            );
        }
        for (t0, cnt, nt) in Self::token_tiles(n_tok) {
            for m in 0..n_out {
                job.out[m] = outs[m].ptr() + (t0 * ws[m].n_rows * 4) as u64;
            }
            let cnt_i = cnt as i32;
            let (aq0, ads0) = s.acts();
            let aq = aq0 + (t0 * n_cols) as u64;
            let ads = ads0 + (t0 * (n_cols / 32) * 8) as u64;
            self.launch(
                &format!("mmvq_{st}_{nt}"),
                (grid as u32, 1, 1),
                MMV_THREADS as u32,
                &[&job, &aq, &ads, &nc, &cnt_i, &tpr_i],
            )?;
        }
        Ok(())
    }

    /// `gate = act(x·Wg) ⊙ x·Wu` in one launch per token tile (same quantized format and
    /// shape); `gelu`: ggml's tanh GELU, else SiLU. `None` when the matrices do not allow it
    /// (nothing was done).
    pub fn glu_fused(
        &self,
        gelu: bool,
        wg: &CudaMatrix,
        wu: &CudaMatrix,
        x: &GpuVec<f32>,
        gate: &mut GpuVec<f32>,
        s: &mut Scratch,
    ) -> Option<Result<()>> {
        if wg.ty != wu.ty || wg.n_rows != wu.n_rows || wg.n_cols != wu.n_cols {
            return None;
        }
        let n_cols = wg.n_cols;
        if !x.len().is_multiple_of(n_cols) {
            return None;
        }
        let n_tok = x.len() / n_cols;
        if is_float(wg.ty) {
            if n_tok != 1 || !self.float_job_ok(wg) {
                return None;
            }
            let mut spare = GpuVec::default();
            return Some(self.mmv1_job(
                &[wg, wu],
                x,
                &mut [gate, &mut spare],
                1 + i32::from(gelu),
                None,
            ));
        }
        if self.exact() {
            // SiLU with both matrices' exact products (GELU: the default steps)
            if gelu || !exact_ok(wg) || !exact_ok(wu) {
                return None;
            }
            let ng = n_cols / 32;
            if n_tok == 1
                && exact_gq()
                && !arith().mega
                && exact_kind(wg.ty) == Some(ExactActs::Q8)
                && arith().q8_cpu
                && exact_direct()
                && ng <= exact_coop_min()
                && !exact_two_rows(ng, true)
                && wg.n_rows.is_multiple_of(32)
            {
                return Some(self.glu_quantized(false, wg, wu, x, gate, s, true));
            }
            return Some(self.mmv_exact(&[wg, wu], x, n_tok, &mut [gate], true, s));
        }
        if n_tok == 1 && wg.n_rows.is_multiple_of(32) && arith().decode_kernels && !arith().mega {
            return Some(self.glu_quantized(gelu, wg, wu, x, gate, s, false));
        }
        let mut spare = GpuVec::default();
        Some(self.quantize_acts(x, n_tok, n_cols, s).and_then(|_| {
            self.mmvq(
                &[wg, wu],
                n_tok,
                &mut [gate, &mut spare],
                1 + i32::from(gelu),
                s,
            )
        }))
    }

    /// One token: [`CudaDevice::glu_fused`]'s product in one launch that also quantizes
    /// `gate` for the next product (into `s`'s second buffers: the first still hold `x`'s).
    /// With `exact` (SiLU only): [`CudaDevice::mmv_exact`]'s product (`mmvd_*`, four rows
    /// per warp) quantizing as `quantize_q8_1` does (`mmvd_*_gq`).
    #[allow(clippy::too_many_arguments)]
    fn glu_quantized(
        &self,
        gelu: bool,
        wg: &CudaMatrix,
        wu: &CudaMatrix,
        x: &GpuVec<f32>,
        gate: &mut GpuVec<f32>,
        s: &mut Scratch,
        exact: bool,
    ) -> Result<()> {
        let (n_rows, n_cols) = (wg.n_rows, wg.n_cols);
        let st = wg
            .stem()
            .ok_or_else(|| CudaError::Unsupported(format!("{}", wg.ty)))?;
        self.quantize_acts(x, 1, n_cols, s)?;
        gate.resize(self, n_rows)?;
        s.gq.resize(self, n_rows)?;
        s.gds.resize(self, n_rows / 32 * 2)?;
        if exact && s.gcnt.len() < n_rows / 32 {
            // (a new buffer: the counts start at 0; each launch adds 4 to each)
            s.gcnt = self.alloc::<u32>(n_rows / 32)?;
            s.gcnt.zero(self)?;
        }
        let mut job = MmvJob {
            n: 2,
            glu: 1 + i32::from(gelu),
            ..MmvJob::default()
        };
        job.w[0] = wg.data.ptr();
        job.w[1] = wu.data.ptr();
        job.out[0] = gate.ptr();
        job.rows = [n_rows as i32, n_rows as i32, 0];
        let (aq, ads) = s.acts();
        let (gq, gds, cnt) = (s.gq.ptr(), s.gds.ptr(), s.gcnt.ptr());
        let (nc, cpu) = (n_cols as i32, i32::from(arith().q8_cpu));
        // (set before the launch: the timing probe may skip it)
        s.claim_acts((gate.ptr(), n_rows, n_rows), true);
        if probe_skip(&[wg, wu], true) {
            return Ok(());
        }
        if exact {
            return self.launch(
                &format!("mmvd_{st}_gq"),
                (blocks(2 * n_rows, 16), 1, 1),
                128,
                &[&job, &aq, &ads, &nc, &gq, &gds, &cnt, &cpu],
            );
        }
        self.launch(
            &format!("mmvq1g_{st}"),
            ((n_rows / 32) as u32, 1, 1),
            GLUQ_THREADS,
            &[&job, &aq, &ads, &nc, &gq, &gds, &cpu],
        )
    }

    /// `out[i] = dequantize(table[ids[i]])`, the host dequantizer's values exactly.
    pub fn get_rows(
        &self,
        table: &CudaMatrix,
        ids: &[u32],
        out: &mut GpuVec<f32>,
        s: &mut Scratch,
    ) -> Result<()> {
        if let Some(&bad) = ids.iter().find(|&&i| i as usize >= table.n_rows) {
            return Err(CudaError::Unsupported(format!(
                "row {bad} of a {}-row table",
                table.n_rows
            )));
        }
        if ids.is_empty() {
            out.resize(self, 0)?;
            return Ok(());
        }
        s.ids.write(self, ids)?;
        // SAFETY: the ids were just uploaded, and checked against the table.
        unsafe { self.get_rows_at(table, s.ids.ptr(), ids.len(), out) }
    }

    /// [`CudaDevice::get_rows`] with `n` row ids (u32) already on the device at `ids`.
    ///
    /// # Safety
    /// `ids` must hold `n` ids, each below the table's row count.
    pub unsafe fn get_rows_at(
        &self,
        table: &CudaMatrix,
        ids: u64,
        n: usize,
        out: &mut GpuVec<f32>,
    ) -> Result<()> {
        let st = table
            .stem()
            .ok_or_else(|| CudaError::Unsupported(format!("{}", table.ty)))?;
        out.resize(self, n * table.n_cols)?;
        if n == 0 {
            return Ok(());
        }
        let (wp, op, nc) = (table.data.ptr(), out.ptr(), table.n_cols as i32);
        let per_thread = if is_float(table.ty) { 1 } else { 32 };
        let items = table.n_cols / per_thread;
        self.launch(
            &format!("get_rows_{st}"),
            (blocks(items, 128), n as u32, 1),
            128,
            &[&wp, &ids, &op, &nc],
        )
    }

    /// `out = rms_norm(x) * w` per row of `w.len()` values.
    pub fn rms_norm(
        &self,
        x: &GpuVec<f32>,
        w: &GpuVec<f32>,
        eps: f32,
        out: &mut GpuVec<f32>,
    ) -> Result<()> {
        out.resize(self, x.len())?;
        self.norm_raw(x.ptr(), 0, x.len(), w, eps, out.ptr(), None, NORM_Q8)
    }

    /// `x = rms_norm(x) * w` in place.
    pub fn rms_norm_inplace(&self, x: &mut GpuVec<f32>, w: &GpuVec<f32>, eps: f32) -> Result<()> {
        self.norm_raw(x.ptr(), 0, x.len(), w, eps, x.ptr(), None, NORM_Q8)
    }

    /// One launch: `x += y` (when given), `out = rms_norm(x) * w` per row of `w.len()`
    /// values, and with `s` (rows a multiple of 32 wide) `out` quantized into `s` for the
    /// next product of `out`, which then skips its own quantization: in exact mode only
    /// into `kinds` ([`CudaDevice::norm_kinds`]; [`NORM_Q8`] in other modes). `x` is changed
    /// through its address (the caller owns it).
    #[allow(clippy::too_many_arguments)]
    pub fn add_rms_norm(
        &self,
        x: &GpuVec<f32>,
        y: Option<&GpuVec<f32>>,
        w: &GpuVec<f32>,
        eps: f32,
        out: &mut GpuVec<f32>,
        s: Option<&mut Scratch>,
        kinds: u8,
    ) -> Result<()> {
        if let Some(y) = y {
            check_len("add", y.len(), x.len())?;
        }
        out.resize(self, x.len())?;
        let n = w.len();
        let s = s.filter(|_| n.is_multiple_of(32) && n > 0 && x.len().is_multiple_of(n));
        self.norm_raw(
            x.ptr(),
            y.map_or(0, |y| y.ptr()),
            x.len(),
            w,
            eps,
            out.ptr(),
            s,
            kinds,
        )?;
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    fn norm_raw(
        &self,
        x: u64,
        y: u64,
        len: usize,
        w: &GpuVec<f32>,
        eps: f32,
        out: u64,
        s: Option<&mut Scratch>,
        kinds: u8,
    ) -> Result<()> {
        let n = w.len();
        if n == 0 || !len.is_multiple_of(n) {
            return Err(CudaError::Unsupported(format!(
                "rms_norm of {len} values in rows of {n}"
            )));
        }
        // exact mode: the Q8_K quantization too, for products that take it (rows below
        // n_4x8 with the CPU's Q4_K gemm rule, as mmv_exact asks for Q4_K)
        let n_tok = len / n;
        let n_4x8 = n_tok - n_tok % 4;
        let (aq, ads, quant, eq, edq) = match s {
            Some(s) => {
                s.aq.resize(self, len)?;
                s.ads.resize(self, len / 32 * 2)?;
                s.claim_acts((out, len, n), false);
                let (mut eq, mut edq) = (0u64, 0u64);
                let exact = self.exact();
                if exact && n.is_multiple_of(256) && kinds & NORM_Q8K != 0 {
                    s.eq.resize(self, len)?;
                    s.eds.resize(self, len / 256)?;
                    s.eacts_of = Some(n_4x8);
                    (eq, edq) = (s.eq.ptr(), s.eds.ptr());
                }
                // (exact mode: the 8-bit blocks only where a product takes them)
                s.q8_ok = !exact || kinds & NORM_Q8 != 0 || eq == 0;
                (s.aq.ptr(), s.ads.ptr(), i32::from(s.q8_ok), eq, edq)
            }
            None => (0u64, 0u64, 0i32, 0u64, 0u64),
        };
        let n4 = n_4x8 as i32;
        if len == 0 {
            return Ok(());
        }
        let (wp, ni, cpu) = (w.ptr(), n as i32, i32::from(arith().q8_cpu));
        // with the persistent decode kernel, 128 threads at most: its blocks (crate::mega)
        // run the norm with 128, so the f64 sum of squares is summed in the same order here
        if arith().probe & 1 != 0 && len == n {
            return Ok(());
        }
        let most = if arith().mega { 128 } else { 1024 };
        let threads = (n.div_ceil(32) * 32).clamp(32, most) as u32;
        self.launch(
            "rms_norm",
            ((len / n) as u32, 1, 1),
            threads,
            &[
                &x, &y, &wp, &out, &ni, &eps, &aq, &ads, &quant, &cpu, &eq, &edq, &n4,
            ],
        )
    }

    /// `x += y` at device addresses (`n` values).
    ///
    /// # Safety
    /// Both must hold `n` values of live device memory.
    pub unsafe fn add_raw(&self, x: u64, y: u64, n: usize) -> Result<()> {
        let ni = n as i64;
        self.launch_1d("add_f32", n, &[&x, &y, &ni])
    }

    /// cos/sin of `rope`'s angles for each position (`pos`: u32 positions on the device,
    /// `ff`: optional per-pair frequency factors), `n_rot / 2` per row.
    pub fn rope_angles(
        &self,
        rope: &Rope,
        pos: &GpuVec<u32>,
        ff: Option<&GpuVec<f32>>,
        cos: &mut GpuVec<f32>,
        sin: &mut GpuVec<f32>,
    ) -> Result<()> {
        // SAFETY: `pos` holds its `len()` positions.
        unsafe { self.rope_angles_at(rope, pos.ptr(), pos.len(), ff, cos, sin) }
    }

    /// [`CudaDevice::rope_angles`] of `n` positions (u32) on the device at `pos`.
    ///
    /// # Safety
    /// `pos` must hold `n` positions.
    pub unsafe fn rope_angles_at(
        &self,
        rope: &Rope,
        pos: u64,
        n: usize,
        ff: Option<&GpuVec<f32>>,
        cos: &mut GpuVec<f32>,
        sin: &mut GpuVec<f32>,
    ) -> Result<()> {
        let half = rope.n_rot / 2;
        if let Some(f) = ff {
            check_len("rope frequency factors", f.len(), half)?;
        }
        cos.resize(self, n * half)?;
        sin.resize(self, n * half)?;
        let theta_scale = rope.freq_base.powf(-2.0 / rope.n_rot as f32);
        let (pp, fp, cp, sp) = (pos, ff.map_or(0, |f| f.ptr()), cos.ptr(), sin.ptr());
        let (nr, hf, fs) = (n as i32, half as i32, rope.freq_scale);
        self.launch_1d(
            "rope_angles",
            n * half,
            &[&pp, &fp, &cp, &sp, &nr, &hf, &theta_scale, &fs],
        )
    }

    /// The angles of `n` positions (u32) on the device at `pos`, looked up in a table of
    /// `n_pos` positions made on the host (`tc`/`ts`: `half` values per position).
    ///
    /// # Safety
    /// `pos` must hold `n` positions.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn rope_table_at(
        &self,
        pos: u64,
        n: usize,
        half: usize,
        tc: &GpuVec<f32>,
        ts: &GpuVec<f32>,
        cos: &mut GpuVec<f32>,
        sin: &mut GpuVec<f32>,
    ) -> Result<()> {
        let n_pos = tc.len() / half.max(1);
        check_len("rope table", ts.len(), tc.len())?;
        cos.resize(self, n * half)?;
        sin.resize(self, n * half)?;
        let (tcp, tsp, cp, sp) = (tc.ptr(), ts.ptr(), cos.ptr(), sin.ptr());
        let (nr, hf, np) = (n as i32, half as i32, n_pos as i32);
        self.launch_1d(
            "rope_table",
            n * half,
            &[&pos, &tcp, &tsp, &cp, &sp, &nr, &hf, &np],
        )
    }

    /// Rotates every head of every row of `x` by its row's angles.
    pub fn rope(
        &self,
        x: &mut GpuVec<f32>,
        rope: &Rope,
        head_dim: usize,
        cos: &GpuVec<f32>,
        sin: &GpuVec<f32>,
    ) -> Result<()> {
        let half = rope.n_rot / 2;
        if half == 0 {
            return Ok(());
        }
        let n_rows = cos.len() / half;
        if n_rows == 0 {
            return Ok(());
        }
        let width = x.len() / n_rows;
        if width * n_rows != x.len() || head_dim == 0 || !width.is_multiple_of(head_dim) {
            return Err(CudaError::Unsupported(format!(
                "rope of {} values over {n_rows} rows, head size {head_dim}",
                x.len()
            )));
        }
        let neox = i32::from(rope.mode == RopeMode::Neox);
        let (xp, cp, sp) = (x.ptr(), cos.ptr(), sin.ptr());
        let (nr, wd, hd, rot) = (
            n_rows as i32,
            width as i32,
            head_dim as i32,
            rope.n_rot as i32,
        );
        self.launch_1d(
            "rope",
            n_rows * (width / head_dim) * half,
            &[&xp, &cp, &sp, &nr, &wd, &hd, &rot, &neox],
        )
    }

    /// `x = y` (resizing `x`).
    pub fn copy(&self, x: &mut GpuVec<f32>, y: &GpuVec<f32>) -> Result<()> {
        x.resize(self, y.len())?;
        let (xp, yp, n) = (x.ptr(), y.ptr(), y.len() as i64);
        self.launch_1d("copy_f32", y.len(), &[&xp, &yp, &n])
    }

    /// `n` 32-bit words from `src` to `dst` (device addresses; `src` may be page-locked
    /// host memory, read over the bus).
    pub(crate) fn copy_words(&self, dst: u64, src: u64, n: usize) -> Result<()> {
        let nn = n as i64;
        self.launch_1d("copy_f32", n, &[&dst, &src, &nn])
    }

    /// `x += y`.
    pub fn add(&self, x: &mut GpuVec<f32>, y: &GpuVec<f32>) -> Result<()> {
        check_len("add", y.len(), x.len())?;
        let (xp, yp, n) = (x.ptr(), y.ptr(), x.len() as i64);
        self.launch_1d("add_f32", x.len(), &[&xp, &yp, &n])
    }

    /// `x[row] += b` for every row of `b.len()` values.
    pub fn add_bias(&self, x: &mut GpuVec<f32>, b: &GpuVec<f32>) -> Result<()> {
        if b.is_empty() || !x.len().is_multiple_of(b.len()) {
            return Err(CudaError::Unsupported(format!(
                "bias of {} values on {} values",
                b.len(),
                x.len()
            )));
        }
        let (xp, bp, n, l) = (x.ptr(), b.ptr(), x.len() as i64, b.len() as i32);
        self.launch_1d("add_bias", x.len(), &[&xp, &bp, &n, &l])
    }

    /// `x *= s`.
    pub fn scale(&self, x: &mut GpuVec<f32>, s: f32) -> Result<()> {
        let (xp, n) = (x.ptr(), x.len() as i64);
        self.launch_1d("scale_f32", x.len(), &[&xp, &s, &n])
    }

    /// `x = tanh(x / cap) · cap`.
    pub fn softcap(&self, x: &mut GpuVec<f32>, cap: f32) -> Result<()> {
        let (xp, n) = (x.ptr(), x.len() as i64);
        self.launch_1d("softcap_f32", x.len(), &[&xp, &cap, &n])
    }

    /// `gate = act(gate) ⊙ up` (`gelu`: ggml's tanh approximation; else SiLU).
    pub fn glu(
        &self,
        gelu: bool,
        gate: &mut GpuVec<f32>,
        up: &GpuVec<f32>,
        n_row: usize,
    ) -> Result<()> {
        check_len("glu", up.len(), gate.len())?;
        let (gp, up_, n, nr) = (gate.ptr(), up.ptr(), gate.len() as i64, n_row.max(1) as i32);
        if gelu {
            self.launch_1d("geglu", gate.len(), &[&gp, &up_, &n])
        } else {
            self.launch_1d("swiglu", gate.len(), &[&gp, &up_, &n, &nr])
        }
    }

    /// `out` = rows `rows` of `x` (rows of `width` values), in that order.
    pub fn gather_rows(
        &self,
        x: &GpuVec<f32>,
        width: usize,
        rows: &[u32],
        out: &mut GpuVec<f32>,
        s: &mut Scratch,
    ) -> Result<()> {
        if let Some(&bad) = rows.iter().find(|&&r| (r as usize + 1) * width > x.len()) {
            return Err(CudaError::Unsupported(format!("row {bad} out of range")));
        }
        if rows.is_empty() {
            out.resize(self, 0)?;
            return Ok(());
        }
        s.ids.write(self, rows)?;
        // SAFETY: the row numbers were just uploaded, and checked against `x`.
        unsafe { self.gather_rows_at(x, width, s.ids.ptr(), rows.len(), out) }
    }

    /// [`CudaDevice::gather_rows`] with `n` row numbers (u32) on the device at `rows`.
    ///
    /// # Safety
    /// `rows` must hold `n` row numbers, each a row of `x`.
    pub unsafe fn gather_rows_at(
        &self,
        x: &GpuVec<f32>,
        width: usize,
        rows: u64,
        n: usize,
        out: &mut GpuVec<f32>,
    ) -> Result<()> {
        out.resize(self, n * width)?;
        let (xp, op, w, ni) = (x.ptr(), out.ptr(), width as i32, n as i32);
        self.launch_1d("gather_rows", n * width, &[&xp, &rows, &op, &w, &ni])
    }

    /// Writes row `r` of `k` and `v` (`kv_dim` values each) as f16 into slot `slots[r]`
    /// (u32 on the device) of the pools at `pool_k`, `pool_v`.
    ///
    /// # Safety
    /// The pools must hold every slot named (`kv_dim` halves each) in live device memory.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn kv_write(
        &self,
        k: &GpuVec<f32>,
        v: &GpuVec<f32>,
        kv_dim: usize,
        pool_k: u64,
        pool_v: u64,
        slots: u64,
        n: usize,
    ) -> Result<()> {
        check_len("kv_write k", k.len(), n * kv_dim)?;
        check_len("kv_write v", v.len(), n * kv_dim)?;
        let (kp, vp) = (k.ptr(), v.ptr());
        let (nr, kd) = (n as i32, kv_dim as i32);
        self.launch_1d(
            "kv_write",
            n * kv_dim,
            &[&kp, &vp, &pool_k, &pool_v, &slots, &nr, &kd],
        )
    }

    /// Attention of each of the `n` query rows of `q` (`n_head · head_dim` values) over
    /// its cells (`rows`: `n` descriptors packed by [`AttnRow::pack`], on the device) in the
    /// pools `pool_k`, `pool_v` (one layer): `out = softmax(q·Kᵀ·scale, visible cells) · V`,
    /// zeros where no cell is visible. `max_cells` (the most cells of a row) sizes the
    /// sequence splits; `split` forces their number (default: enough blocks to fill the GPU).
    /// With `rope` (one row), `q` and the row's key arrive unrotated and the key and value
    /// are not yet in the pools: the launch does [`CudaDevice::rope_kv_write`]'s work too.
    ///
    /// # Safety
    /// Every descriptor must point to live device memory holding its `n_cells` slots and
    /// positions, and every slot must lie inside the pools; so must `rope`'s addresses.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn attention(
        &self,
        shape: &AttnShape,
        q: &GpuVec<f32>,
        pool_k: u64,
        pool_v: u64,
        rows: u64,
        n: usize,
        max_cells: usize,
        out: &mut GpuVec<f32>,
        split: Option<usize>,
        rope: Option<&AttnRope>,
        s: &mut Scratch,
    ) -> Result<()> {
        let (nh, hd) = (shape.n_head, shape.head_dim);
        if rope.is_some() && n != 1 {
            return Err(CudaError::Unsupported(
                "attention with the rotation inside: one row, split kernel".into(),
            ));
        }
        if shape.n_head_kv == 0 || !nh.is_multiple_of(shape.n_head_kv) {
            return Err(CudaError::Unsupported(format!(
                "{nh} heads over {} KV heads",
                shape.n_head_kv
            )));
        }
        let Some(e) = ATTN_E.iter().copied().find(|&e| hd > 0 && hd <= 32 * e) else {
            return Err(CudaError::Unsupported(format!("head size {hd} (max 256)")));
        };
        check_len("attention q", q.len(), n * nh * hd)?;
        out.resize(self, n * nh * hd)?;
        if n == 0 {
            return Ok(());
        }
        // the CPU's arithmetic (attn_exact) or the default kernels; the output quantized for
        // the product that follows (with attn_exact only where the products take the CPU's
        // activation rule)
        let cpu_attn = split.is_none() && (arith().attn_cpu || self.exact());
        let quant = if !cpu_attn || self.exact() || arith().q8_cpu {
            self.quantized_out(s, out, n * nh * hd, nh * hd, hd)?
        } else {
            s.acts_of = None;
            0
        };
        if arith().probe & 2 != 0 && n == 1 {
            return Ok(());
        }
        if cpu_attn {
            let scale = if shape.softcap != 0.0 {
                shape.scale / shape.softcap
            } else {
                shape.scale
            };
            let native = i32::from(rustorch_core::kernels::native_f16());
            let (qp, op, aq, ads) = (q.ptr(), out.ptr(), s.aq.ptr(), s.ads.ptr());
            let (nhi, nkv, hdi, kvs) = (
                nh as i32,
                shape.n_head_kv as i32,
                hd as i32,
                shape.kv_stride as i32,
            );
            let (cap, win) = (shape.softcap, shape.window);
            let inline = i32::from(rope.is_some());
            let ar = rope.copied().unwrap_or_default();
            return self.launch(
                "attn_exact",
                (nh as u32, n as u32, 1),
                exact_attn_threads() as u32,
                &[
                    &qp, &rows, &pool_k, &pool_v, &op, &nhi, &nkv, &hdi, &kvs, &scale, &cap, &win,
                    &native, &aq, &ads, &quant, &inline, &ar,
                ],
            );
        }
        let n_split = match split {
            Some(k) => k.max(1),
            None => auto_splits(
                self.info.multiprocessors,
                n * nh,
                max_cells,
                attn_per_pass(e),
            ),
        };
        if n_split > 1 {
            s.part.resize(self, n * nh * n_split * (hd + 2))?;
        }
        let (aq, ads, cpu) = (s.aq.ptr(), s.ads.ptr(), i32::from(arith().q8_cpu));
        let (qp, pp, op) = (q.ptr(), s.part.ptr(), out.ptr());
        let (nhi, nkv, hdi, kvs, ns) = (
            nh as i32,
            shape.n_head_kv as i32,
            hd as i32,
            shape.kv_stride as i32,
            n_split as i32,
        );
        let (sc, cap, win) = (shape.scale, shape.softcap, shape.window);
        let grid = (nh as u32, n as u32, n_split as u32);
        match rope {
            Some(ar) => self.launch(
                &format!("attn_rope_{e}"),
                grid,
                (attn_warps() * 32) as u32,
                &[
                    &qp, &rows, &pool_k, &pool_v, &pp, &op, &nhi, &nkv, &hdi, &kvs, &sc, &cap,
                    &win, &ns, &aq, &ads, &quant, &cpu, ar,
                ],
            )?,
            None => self.launch(
                &format!("attn_split_{e}"),
                grid,
                (attn_warps() * 32) as u32,
                &[
                    &qp, &rows, &pool_k, &pool_v, &pp, &op, &nhi, &nkv, &hdi, &kvs, &sc, &cap,
                    &win, &ns, &aq, &ads, &quant, &cpu,
                ],
            )?,
        }
        if n_split > 1 {
            // one thread per output value (128 per block for the persistent kernel)
            let bs = if arith().mega { 128 } else { 32 };
            self.launch(
                "attn_combine",
                (nh as u32, n as u32, hd.div_ceil(bs) as u32),
                bs as u32,
                &[&pp, &op, &nhi, &hdi, &ns, &aq, &ads, &quant, &cpu],
            )?;
        }
        Ok(())
    }

    /// [`CudaDevice::rope`] of `q` and `k` (rows of `n_head`, `n_head_kv` heads) and the
    /// [`CudaDevice::kv_write`] of the rotated `k` and of `v`, in one launch.
    ///
    /// # Safety
    /// As [`CudaDevice::kv_write`]; `slots` holds one slot per row.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn rope_kv_write(
        &self,
        q: &mut GpuVec<f32>,
        k: &mut GpuVec<f32>,
        v: &GpuVec<f32>,
        rope: &Rope,
        head_dim: usize,
        cos: &GpuVec<f32>,
        sin: &GpuVec<f32>,
        n_head_kv: usize,
        pool_k: u64,
        pool_v: u64,
        slots: u64,
        n: usize,
    ) -> Result<()> {
        let half = rope.n_rot / 2;
        let kv_dim = n_head_kv * head_dim;
        if head_dim == 0
            || rope.n_rot > head_dim
            || !q.len().is_multiple_of(head_dim)
            || n == 0
            || k.len() != n * kv_dim
            || v.len() != n * kv_dim
            || cos.len() < n * half
            || sin.len() < n * half
        {
            return Err(CudaError::Unsupported(format!(
                "rope_kv_write: {} q, {} k, {} v values over {n} rows",
                q.len(),
                k.len(),
                v.len()
            )));
        }
        let nh = q.len() / n / head_dim;
        let total =
            n * (nh * half + n_head_kv * half + kv_dim + n_head_kv * (head_dim - rope.n_rot));
        let neox = i32::from(rope.mode == RopeMode::Neox);
        let (qp, kp, vp, cp, sp) = (q.ptr(), k.ptr(), v.ptr(), cos.ptr(), sin.ptr());
        let (nr, nhi, nkv, hd, rot) = (
            n as i32,
            nh as i32,
            n_head_kv as i32,
            head_dim as i32,
            rope.n_rot as i32,
        );
        self.launch_1d(
            "rope_kv_write",
            total,
            &[
                &qp, &kp, &vp, &cp, &sp, &pool_k, &pool_v, &slots, &nr, &nhi, &nkv, &hd, &rot,
                &neox,
            ],
        )
    }

    /// For each pair `(src, dst)` (u32 pairs on the device at `pairs`): slot `dst` of every
    /// layer of the pools becomes a copy of slot `src` (keys and values).
    ///
    /// # Safety
    /// The pools hold `n_layer` layers of `layer_stride` halves; every slot lies inside.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn kv_copy(
        &self,
        pool_k: u64,
        pool_v: u64,
        pairs: u64,
        n_pairs: usize,
        n_layer: usize,
        layer_stride: usize,
        kv_dim: usize,
    ) -> Result<()> {
        let (np, nl, ls, kd) = (
            n_pairs as i32,
            n_layer as i32,
            layer_stride as i64,
            kv_dim as i32,
        );
        self.launch_1d(
            "kv_copy",
            n_layer * n_pairs * kv_dim,
            &[&pool_k, &pool_v, &pairs, &np, &nl, &ls, &kd],
        )
    }

    /// Rotates the keys of `n` slots (u32 on the device at `slots`) of every layer by the
    /// angles `cos`/`sin` (`rope.n_rot / 2` values), each head of `head_dim` values.
    ///
    /// # Safety
    /// As [`CudaDevice::kv_copy`].
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn kv_shift(
        &self,
        pool_k: u64,
        slots: u64,
        n: usize,
        n_layer: usize,
        layer_stride: usize,
        kv_dim: usize,
        head_dim: usize,
        rope: &Rope,
        cos: &GpuVec<f32>,
        sin: &GpuVec<f32>,
    ) -> Result<()> {
        let half = rope.n_rot / 2;
        if head_dim == 0 || !kv_dim.is_multiple_of(head_dim) || rope.n_rot > head_dim {
            return Err(CudaError::Unsupported(format!(
                "key shift: rows of {kv_dim} in heads of {head_dim}, {} rotated",
                rope.n_rot
            )));
        }
        check_len("kv_shift angles", cos.len().min(sin.len()), half)?;
        let neox = i32::from(rope.mode == RopeMode::Neox);
        let (ni, nl, ls, kd, hd, nr) = (
            n as i32,
            n_layer as i32,
            layer_stride as i64,
            kv_dim as i32,
            head_dim as i32,
            rope.n_rot as i32,
        );
        let (cp, sp) = (cos.ptr(), sin.ptr());
        self.launch_1d(
            "kv_shift",
            n_layer * n * (kv_dim / head_dim) * half,
            &[
                &pool_k, &slots, &ni, &nl, &ls, &kd, &hd, &nr, &neox, &cp, &sp,
            ],
        )
    }
}

#[cfg(test)]
mod tests {
    use super::tile_rows;

    /// Every block's scale and codes are where FQ8_0T::decode and FQ4_0T::decode
    /// (kernels/quant.cu) read them.
    #[test]
    fn tile_rows_puts_each_block_where_the_kernels_read_it() {
        for block in [34, 18] {
            let (n_rows, n_cols) = (3, 1024);
            let nb = n_cols / 32;
            let src: Vec<u8> = (0..n_rows * nb * block)
                .map(|i| (i * 7 + i / block) as u8)
                .collect();
            let t = tile_rows(&src, n_cols, block);
            assert_eq!(t.len(), src.len());
            for r in 0..n_rows {
                for b in 0..nb {
                    let blk = &src[(r * nb + b) * block..][..block];
                    let tile = &t[(r * nb + b / 16 * 16) * block..][..16 * block];
                    let g = b % 16;
                    assert_eq!(
                        &tile[2 * g..2 * g + 2],
                        &blk[..2],
                        "scale, row {r} block {b}"
                    );
                    assert_eq!(&tile[32 + 16 * g..48 + 16 * g], &blk[2..18], "codes 0..16");
                    if block == 34 {
                        assert_eq!(
                            &tile[288 + 16 * g..304 + 16 * g],
                            &blk[18..],
                            "codes 16..32"
                        );
                    }
                }
            }
        }
    }
}
