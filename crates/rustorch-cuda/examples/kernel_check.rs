//! Correctness harness for the CUDA kernels: seeded random inputs, each kernel on the GPU,
//! compared with the CPU code of rustorch-core (dequantizers, f32 ops) or an f64
//! reference. Prints one line per check (max |Δ|, ‖Δ‖/‖ref‖, tolerance) and a timing table,
//! and exits 1 if any check is past its tolerance (2 if no GPU could be opened).
//!
//! ```sh
//! cargo build --release -p rustorch-cuda --example kernel_check
//! target/release/examples/kernel_check [--seed N] [--no-timing]
//! ```
//!
//! Matrix products are checked twice: against the same arithmetic done exactly on the host
//! (dequantized weights times the activations quantized to 8 bits exactly as the GPU does:
//! a tight tolerance that catches any layout error), and against the unquantized product
//! (`vs f32 x`, the error the 8-bit activations cost; the CPU's llama.cpp path is shown
//! beside it for scale).

use std::time::Instant;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rustorch_core::kernels::ops::{self, Rope, RopeMode};
use rustorch_core::kernels::{self, QActs, QMatrix, ThreadPool};
use rustorch_core::quant::{self, f16_to_f32, f32_to_f16};
use rustorch_core::GgmlType;
use rustorch_cuda::kernels::FORMATS;
use rustorch_cuda::{AttnRow, AttnShape, CudaDevice, CudaMatrix, GpuVec, Scratch};

struct Check {
    kernel: String,
    case: String,
    max_abs: f64,
    rel: f64,
    tol: f64,
    note: String,
}

impl Check {
    fn ok(&self) -> bool {
        self.rel.is_finite() && self.max_abs.is_finite() && self.rel <= self.tol
    }
}

/// max |got - want| and ‖got - want‖ / ‖want‖ (NaN anywhere gives NaN).
fn compare(got: &[f32], want: &[f64]) -> (f64, f64) {
    assert_eq!(got.len(), want.len(), "length mismatch");
    let (mut max_abs, mut d2, mut r2) = (0f64, 0f64, 0f64);
    for (&g, &w) in got.iter().zip(want) {
        let d = g as f64 - w;
        if d.is_nan() {
            return (f64::NAN, f64::NAN);
        }
        max_abs = max_abs.max(d.abs());
        d2 += d * d;
        r2 += w * w;
    }
    let rel = if r2 > 0.0 {
        (d2 / r2).sqrt()
    } else if d2 == 0.0 {
        0.0
    } else {
        f64::INFINITY
    };
    (max_abs, rel)
}

struct Harness {
    dev: CudaDevice,
    s: Scratch,
    rng: StdRng,
    checks: Vec<Check>,
}

fn gauss(rng: &mut StdRng) -> f32 {
    // Box-Muller
    let u1: f64 = rng.gen_range(1e-12..1.0);
    let u2: f64 = rng.gen::<f64>();
    ((-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()) as f32
}

/// The GPU's activation quantization, exactly: per 32 values d = max|x| / 127 and
/// q = round(x / d) (as x * (1/d)), returned dequantized as (d, q) pairs folded into f64.
/// Activations as the GPU quantizes them (its rule in effect, see `kernels::arith`), back
/// to values: code times the block scale it multiplies by.
fn q8_like_gpu(x: &[f32]) -> Vec<f64> {
    let cpu = rustorch_cuda::kernels::arith().q8_cpu;
    let mut out = Vec::with_capacity(x.len());
    for g in x.chunks(32) {
        let amax = g.iter().fold(0f32, |a, v| a.max(v.abs()));
        let d = amax / 127.0;
        for &v in g {
            let (q, dd) = if cpu {
                let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
                let q = ((v * id).round_ties_even() as i32).clamp(-128, 127);
                (q, f16_to_f32(f32_to_f16(d)))
            } else {
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                ((v * id).round() as i32, d)
            };
            out.push(dd as f64 * q as f64);
        }
    }
    out
}

impl Harness {
    fn push(
        &mut self,
        kernel: &str,
        case: String,
        got: &[f32],
        want: &[f64],
        tol: f64,
        note: String,
    ) {
        let (max_abs, rel) = compare(got, want);
        let c = Check {
            kernel: kernel.to_string(),
            case,
            max_abs,
            rel,
            tol,
            note,
        };
        println!(
            "{:<12} {:<34} max|Δ| {:>10.3e}  rel {:>10.3e}  tol {:>8.1e}  {} {}",
            c.kernel,
            c.case,
            c.max_abs,
            c.rel,
            c.tol,
            if c.ok() { "ok  " } else { "FAIL" },
            c.note
        );
        self.checks.push(c);
    }

    fn randn(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| gauss(&mut self.rng) * scale).collect()
    }

    fn up(&self, v: &[f32]) -> GpuVec<f32> {
        self.dev.upload(v).expect("upload")
    }

    fn matmul(&mut self, ty: GgmlType, n_rows: usize, n_cols: usize, toks: &[usize]) {
        let w = self.randn(n_rows * n_cols, 1.0);
        let row_bytes = n_cols / ty.block_size() * ty.type_size();
        let mut bytes = vec![0u8; n_rows * row_bytes];
        quant::quantize(ty, &w, &mut bytes).expect("quantize");
        let mut wd = vec![0f32; n_rows * n_cols];
        quant::dequantize(ty, &bytes, &mut wd).expect("dequantize");
        let m = self
            .dev
            .upload_matrix(ty, &bytes, n_rows, n_cols)
            .expect("upload matrix");
        let float = matches!(ty, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16);
        let pool = ThreadPool::new(2);
        for &nt in toks {
            let x = self.randn(nt * n_cols, 1.0);
            let xg = self.up(&x);
            let mut out = GpuVec::default();
            self.dev
                .matmul(&m, &xg, &mut out, &mut self.s)
                .expect("matmul");
            let got = out.read(&self.dev).expect("read");
            let xq: Vec<f64> = if float {
                x.iter().map(|&v| v as f64).collect()
            } else {
                q8_like_gpu(&x)
            };
            let mut emul = vec![0f64; nt * n_rows];
            let mut exact = vec![0f64; nt * n_rows];
            for t in 0..nt {
                for r in 0..n_rows {
                    let wr = &wd[r * n_cols..(r + 1) * n_cols];
                    let (mut a, mut b) = (0f64, 0f64);
                    for i in 0..n_cols {
                        a += wr[i] as f64 * xq[t * n_cols + i];
                        b += wr[i] as f64 * x[t * n_cols + i] as f64;
                    }
                    emul[t * n_rows + r] = a;
                    exact[t * n_rows + r] = b;
                }
            }
            // the CPU's llama.cpp arithmetic, for scale
            let qm = QMatrix {
                ty,
                data: &bytes,
                n_rows,
                n_cols,
            };
            let mut cpu = vec![0f32; nt * n_rows];
            let cpu_note = match kernels::matmul(&pool, &qm, &x, &mut cpu, &mut QActs::new()) {
                Ok(()) => format!("(cpu vs f32 x: {:.2e})", compare(&cpu, &exact).1),
                Err(e) => format!("(cpu: {e})"),
            };
            let case = format!("{} {}x{} t={}", ty, n_rows, n_cols, nt);
            let tol = 1e-5;
            // legacy formats with ggml-cpu's activation encoding: the CPU's own products
            // (the same block arithmetic; only the f32 summation order differs)
            let legacy = !float && ty.block_size() == 32;
            if legacy && rustorch_cuda::kernels::arith().q8_cpu && !cpu_note.starts_with("(cpu:") {
                let want: Vec<f64> = cpu.iter().map(|&v| v as f64).collect();
                self.push(
                    "matmul",
                    format!("{case} vs cpu"),
                    &got,
                    &want,
                    tol,
                    String::new(),
                );
            } else {
                self.push("matmul", case.clone(), &got, &emul, tol, String::new());
            }
            let tol_exact = if float { 1e-5 } else { 3e-2 };
            self.push(
                "matmul",
                format!("{case} vs f32 x"),
                &got,
                &exact,
                tol_exact,
                cpu_note,
            );
        }
        // embedding rows: bit-exact with the host dequantizer
        let ids: Vec<u32> = vec![
            0,
            (n_rows - 1) as u32,
            (n_rows / 2) as u32,
            3 % n_rows as u32,
        ];
        let mut out = GpuVec::default();
        self.dev
            .get_rows(&m, &ids, &mut out, &mut self.s)
            .expect("get_rows");
        let got = out.read(&self.dev).expect("read");
        let mut want = Vec::new();
        for &id in &ids {
            let r = id as usize;
            want.extend(wd[r * n_cols..(r + 1) * n_cols].iter().map(|&v| v as f64));
        }
        self.push(
            "get_rows",
            format!("{} {}x{}", ty, n_rows, n_cols),
            &got,
            &want,
            0.0,
            String::new(),
        );
    }

    fn norms(&mut self) {
        for (rows, n, inplace) in [(5usize, 2048usize, false), (40, 64, true), (3, 576, false)] {
            let x = self.randn(rows * n, 3.0);
            let w = self.randn(n, 1.0);
            let (xg, wg) = (self.up(&x), self.up(&w));
            let got = if inplace {
                let mut xg = xg;
                self.dev
                    .rms_norm_inplace(&mut xg, &wg, 1e-5)
                    .expect("rms_norm");
                xg.read(&self.dev).expect("read")
            } else {
                let mut out = GpuVec::default();
                self.dev
                    .rms_norm(&xg, &wg, 1e-5, &mut out)
                    .expect("rms_norm");
                out.read(&self.dev).expect("read")
            };
            let mut want = x.clone();
            for row in want.chunks_exact_mut(n) {
                ops::rms_norm(row, &w, 1e-5);
            }
            let want: Vec<f64> = want.iter().map(|&v| v as f64).collect();
            let case = format!("{rows}x{n}{}", if inplace { " in place" } else { "" });
            self.push("rms_norm", case, &got, &want, 1e-6, String::new());
        }
    }

    fn ropes(&mut self) {
        let positions: Vec<u32> = vec![0, 1, 17, 4095, 32767, 100_000];
        for (mode, n_rot, hd, base, fscale, ff) in [
            (RopeMode::Normal, 64, 64, 10000.0f32, 1.0f32, false),
            (RopeMode::Neox, 128, 128, 1_000_000.0, 1.0, false),
            (RopeMode::Neox, 32, 64, 10000.0, 0.25, false),
            (RopeMode::Normal, 128, 128, 500_000.0, 1.0, true),
        ] {
            let rope = Rope {
                mode,
                n_rot,
                freq_base: base,
                freq_scale: fscale,
                yarn: None,
            };
            let heads = 4;
            let width = heads * hd;
            let n = positions.len();
            let x = self.randn(n * width, 1.0);
            let freqs: Option<Vec<f32>> =
                ff.then(|| (0..n_rot / 2).map(|i| 1.0 + (i % 8) as f32).collect());
            let pos = self.dev.upload(&positions).expect("upload");
            let fg = freqs.as_ref().map(|f| self.up(f));
            let (mut cs, mut sn) = (GpuVec::default(), GpuVec::default());
            self.dev
                .rope_angles(&rope, &pos, fg.as_ref(), &mut cs, &mut sn)
                .expect("rope_angles");
            let mut xg = self.up(&x);
            self.dev.rope(&mut xg, &rope, hd, &cs, &sn).expect("rope");
            let got = xg.read(&self.dev).expect("read");
            let mut want = x.clone();
            let half = n_rot / 2;
            let (mut c, mut s) = (vec![0f32; half], vec![0f32; half]);
            for (i, row) in want.chunks_exact_mut(width).enumerate() {
                rope.angles(positions[i] as f32, freqs.as_deref(), &mut c, &mut s);
                for head in row.chunks_exact_mut(hd) {
                    rope.apply(head, &c, &s);
                }
            }
            let want: Vec<f64> = want.iter().map(|&v| v as f64).collect();
            let case = format!(
                "{mode:?} rot {n_rot}/{hd} base {base} scale {fscale}{}",
                if ff { " ff" } else { "" }
            );
            self.push("rope", case, &got, &want, 1e-5, String::new());
        }
    }

    fn elementwise(&mut self) {
        let n = 3 * 1000 + 7;
        let x = self.randn(n, 4.0);
        let y = self.randn(n, 1.0);
        let f64v = |v: Vec<f32>| v.into_iter().map(|a| a as f64).collect::<Vec<f64>>();
        // add
        let mut xg = self.up(&x);
        self.dev.add(&mut xg, &self.up(&y)).expect("add");
        let want = f64v(x.iter().zip(&y).map(|(a, b)| a + b).collect());
        let got = xg.read(&self.dev).expect("read");
        self.push("add", format!("n={n}"), &got, &want, 0.0, String::new());
        // bias
        let b = self.randn(1000, 1.0);
        let xb = &x[..3000];
        let mut xg = self.up(xb);
        self.dev.add_bias(&mut xg, &self.up(&b)).expect("bias");
        let want = f64v(
            xb.iter()
                .enumerate()
                .map(|(i, a)| a + b[i % 1000])
                .collect(),
        );
        let got = xg.read(&self.dev).expect("read");
        self.push("add_bias", "3x1000".into(), &got, &want, 0.0, String::new());
        // scale
        let mut xg = self.up(&x);
        self.dev.scale(&mut xg, 0.125).expect("scale");
        let want = f64v(x.iter().map(|a| a * 0.125).collect());
        let got = xg.read(&self.dev).expect("read");
        self.push("scale", format!("n={n}"), &got, &want, 0.0, String::new());
        // softcap
        let mut xg = self.up(&x);
        self.dev.softcap(&mut xg, 30.0).expect("softcap");
        let inv = 1.0f32 / 30.0;
        let want = f64v(x.iter().map(|a| (a * inv).tanh() * 30.0).collect());
        let got = xg.read(&self.dev).expect("read");
        self.push("softcap", "cap 30".into(), &got, &want, 1e-6, String::new());
        // swiglu, geglu
        for gelu in [false, true] {
            let mut gg = self.up(&x);
            self.dev
                .glu(gelu, &mut gg, &self.up(&y), x.len())
                .expect("glu");
            let want = f64v(
                x.iter()
                    .zip(&y)
                    .map(|(&g, &u)| {
                        if gelu {
                            ops::gelu(g) * u
                        } else {
                            ops::silu(g) * u
                        }
                    })
                    .collect(),
            );
            let got = gg.read(&self.dev).expect("read");
            let name = if gelu { "geglu" } else { "swiglu" };
            self.push(name, format!("n={n}"), &got, &want, 1e-6, String::new());
        }
        // gather rows
        let width = 100;
        let rows = [29u32, 0, 7, 7];
        let mut out = GpuVec::default();
        self.dev
            .gather_rows(&self.up(&x[..3000]), width, &rows, &mut out, &mut self.s)
            .expect("gather");
        let mut want = Vec::new();
        for &r in &rows {
            want.extend(
                x[r as usize * width..(r as usize + 1) * width]
                    .iter()
                    .map(|&v| v as f64),
            );
        }
        let got = out.read(&self.dev).expect("read");
        self.push(
            "gather_rows",
            "4 of 30".into(),
            &got,
            &want,
            0.0,
            String::new(),
        );
    }

    /// Writes K/V rows through kv_write into slots of a device pool and reads them back.
    fn kv_write(&mut self) {
        let (kv_dim, n_slots) = (256usize, 10usize);
        let cache_k: GpuVec<u16> = self.dev.alloc(n_slots * kv_dim).expect("alloc");
        let cache_v: GpuVec<u16> = self.dev.alloc(n_slots * kv_dim).expect("alloc");
        let slots = [3u32, 9, 0];
        let k = self.randn(slots.len() * kv_dim, 2.0);
        let v = self.randn(slots.len() * kv_dim, 2.0);
        let gs = self.dev.upload(&slots).expect("upload");
        // SAFETY: the slots lie inside the two pools above.
        unsafe {
            self.dev
                .kv_write(
                    &self.up(&k),
                    &self.up(&v),
                    kv_dim,
                    cache_k.ptr(),
                    cache_v.ptr(),
                    gs.ptr(),
                    slots.len(),
                )
                .expect("kv_write");
        }
        let (gk, gv) = (
            cache_k.read(&self.dev).expect("read"),
            cache_v.read(&self.dev).expect("read"),
        );
        let (mut got, mut want) = (Vec::new(), Vec::new());
        for (i, &c) in slots.iter().enumerate() {
            let c = c as usize;
            for j in 0..kv_dim {
                got.push(f16_to_f32(gk[c * kv_dim + j]));
                got.push(f16_to_f32(gv[c * kv_dim + j]));
                want.push(f16_to_f32(f32_to_f16(k[i * kv_dim + j])) as f64);
                want.push(f16_to_f32(f32_to_f16(v[i * kv_dim + j])) as f64);
            }
        }
        self.push("kv_write", "3 rows".into(), &got, &want, 0.0, String::new());
    }

    #[allow(clippy::too_many_arguments)]
    fn attention(
        &mut self,
        label: &str,
        n_head: usize,
        n_head_kv: usize,
        hd: usize,
        n_cells: usize,
        queries: &[(u32, Option<u32>)],
        softcap: f32,
        split: Option<usize>,
    ) {
        let kv_dim = n_head_kv * hd;
        // two sequences' cells in one pool: even queries read cache A (cell c = slot c),
        // odd ones cache B (its cells in reversed slots n_cells..2 n_cells)
        let mut caches = Vec::new();
        for _ in 0..2 {
            let k: Vec<u16> = self
                .randn(n_cells * kv_dim, 1.0)
                .iter()
                .map(|&v| f32_to_f16(v))
                .collect();
            let v: Vec<u16> = self
                .randn(n_cells * kv_dim, 1.0)
                .iter()
                .map(|&v| f32_to_f16(v))
                .collect();
            // positions 0..n_cells in a shuffled cell order
            let mut pos: Vec<u32> = (0..n_cells as u32).collect();
            for i in (1..pos.len()).rev() {
                let j = self.rng.gen_range(0..=i);
                pos.swap(i, j);
            }
            caches.push((k, v, pos));
        }
        let (mut pool_k, mut pool_v) = (caches[0].0.clone(), caches[0].1.clone());
        for c in (0..n_cells).rev() {
            pool_k.extend_from_slice(&caches[1].0[c * kv_dim..(c + 1) * kv_dim]);
            pool_v.extend_from_slice(&caches[1].1[c * kv_dim..(c + 1) * kv_dim]);
        }
        let b_slots: Vec<u32> = (0..n_cells).map(|c| (2 * n_cells - 1 - c) as u32).collect();
        let gk = self.dev.upload(&pool_k).expect("upload");
        let gv = self.dev.upload(&pool_v).expect("upload");
        let gpa = self.dev.upload(&caches[0].2).expect("upload");
        let gpb = self.dev.upload(&caches[1].2).expect("upload");
        let gsb = self.dev.upload(&b_slots).expect("upload");
        let n = queries.len();
        let scale = 1.0 / (hd as f32).sqrt();
        let q = self.randn(n * n_head * hd, 1.0);
        let mut packed = Vec::new();
        for (i, &(p, _)) in queries.iter().enumerate() {
            let (slots, pos) = if i % 2 == 0 {
                (0, gpa.ptr())
            } else {
                (gsb.ptr(), gpb.ptr())
            };
            AttnRow {
                slots,
                pos,
                n_cells: n_cells as u32,
                max_pos: p,
            }
            .pack(&mut packed);
        }
        let rows = self.dev.upload(&packed).expect("upload");
        // the kernel takes one window per call (per layer): the first query's
        let window = queries.first().and_then(|q| q.1).unwrap_or(0);
        let shape = AttnShape {
            n_head,
            n_head_kv,
            head_dim: hd,
            kv_stride: kv_dim,
            scale,
            softcap,
            window,
        };
        let mut out = GpuVec::default();
        // SAFETY: the rows point at the buffers above, alive until the read below.
        unsafe {
            self.dev
                .attention(
                    &shape,
                    &self.up(&q),
                    gk.ptr(),
                    gv.ptr(),
                    rows.ptr(),
                    n,
                    n_cells,
                    &mut out,
                    split,
                    None,
                    &mut self.s,
                )
                .expect("attention");
        }
        let got = out.read(&self.dev).expect("read");
        let mut want = vec![0f64; n * n_head * hd];
        let group = n_head / n_head_kv;
        for (t, &(max_pos, _)) in queries.iter().enumerate() {
            let min_pos = if window == 0 {
                0
            } else {
                (max_pos + 1).saturating_sub(window)
            };
            let (k, v, pos) = (&caches[t % 2].0, &caches[t % 2].1, &caches[t % 2].2);
            for h in 0..n_head {
                let kvh = h / group;
                let qh: Vec<f64> = q[(t * n_head + h) * hd..(t * n_head + h + 1) * hd]
                    .iter()
                    .map(|&x| f16_to_f32(f32_to_f16(x)) as f64)
                    .collect();
                let mut scores = Vec::new();
                for c in 0..n_cells {
                    if pos[c] < min_pos || pos[c] > max_pos {
                        continue;
                    }
                    let kr = &k[c * kv_dim + kvh * hd..c * kv_dim + (kvh + 1) * hd];
                    let mut d = 0f64;
                    for i in 0..hd {
                        d += qh[i] * f16_to_f32(kr[i]) as f64;
                    }
                    let mut s = d * scale as f64;
                    if softcap != 0.0 {
                        s = softcap as f64 * (s / softcap as f64).tanh();
                    }
                    scores.push((c, s));
                }
                if scores.is_empty() {
                    continue;
                }
                let m = scores.iter().fold(f64::NEG_INFINITY, |a, s| a.max(s.1));
                let sum: f64 = scores.iter().map(|s| (s.1 - m).exp()).sum();
                let o = &mut want[(t * n_head + h) * hd..(t * n_head + h + 1) * hd];
                for &(c, s) in &scores {
                    let p = (s - m).exp() / sum;
                    let vr = &v[c * kv_dim + kvh * hd..c * kv_dim + (kvh + 1) * hd];
                    for i in 0..hd {
                        o[i] += p * f16_to_f32(vr[i]) as f64;
                    }
                }
            }
        }
        let case = format!(
            "{label}: {n_head}/{n_head_kv}x{hd} cells {n_cells} q {n}{}{}",
            if softcap != 0.0 { " cap" } else { "" },
            split.map_or(String::new(), |s| format!(" split {s}"))
        );
        self.push("attention", case, &got, &want, 1e-5, String::new());
    }

    /// Median time of `f` over `reps` calls after warm-up (host timer around a sync).
    fn time(&self, reps: usize, mut f: impl FnMut()) -> f64 {
        f();
        self.dev.synchronize().expect("sync");
        let mut ts = Vec::new();
        for _ in 0..5 {
            let t0 = Instant::now();
            for _ in 0..reps {
                f();
            }
            self.dev.synchronize().expect("sync");
            ts.push(t0.elapsed().as_secs_f64() / reps as f64);
        }
        ts.sort_by(f64::total_cmp);
        ts[2]
    }

    fn timings(&mut self) {
        const COPIES: usize = 6;
        println!();
        println!(
            "matrix-vector timings, TinyLlama-1.1B decode shapes, {COPIES} copies of each matrix \
             taken in turn (not cache-resident), median of 5 x 48 launches:"
        );
        // q/k/v together, gate and up together, down, output
        let shapes = [
            (2560usize, 2048usize),
            (11264, 2048),
            (2048, 5632),
            (32000, 2048),
        ];
        println!(
            "{:<8} {:>12} {:>10} {:>10} {:>10} {:>12}",
            "format", "shape", "t=1 µs", "GB/s", "t=8 µs", "GB/s"
        );
        for (ty, _) in FORMATS {
            for &(n_rows, n_cols) in &shapes {
                if n_cols % ty.block_size() != 0 {
                    continue;
                }
                let x = self.randn(8 * n_cols, 1.0);
                let x1 = self.up(&x[..n_cols]);
                let x8 = self.up(&x);
                let bytes_n = n_rows * n_cols / ty.block_size() * ty.type_size();
                let ms: Vec<CudaMatrix> = (0..COPIES)
                    .map(|_| {
                        let mut bytes: Vec<u8> = (0..bytes_n).map(|_| self.rng.gen()).collect();
                        // keep every 16-bit word a finite f16 where scales live
                        for b in bytes.iter_mut().skip(1).step_by(2) {
                            *b &= 0x3b;
                        }
                        self.dev
                            .upload_matrix(ty, &bytes, n_rows, n_cols)
                            .expect("upload")
                    })
                    .collect();
                let mut out = GpuVec::default();
                let mut s = Scratch::default();
                let mut i = 0;
                let t1 = self.time(48, || {
                    i += 1;
                    self.dev
                        .matmul(&ms[i % COPIES], &x1, &mut out, &mut s)
                        .expect("matmul");
                });
                let t8 = self.time(48, || {
                    i += 1;
                    self.dev
                        .matmul(&ms[i % COPIES], &x8, &mut out, &mut s)
                        .expect("matmul");
                });
                let gb = ms[0].bytes() as f64 / 1e9;
                println!(
                    "{:<8} {:>12} {:>10.1} {:>10.0} {:>10.1} {:>12.0}",
                    ty.name(),
                    format!("{n_rows}x{n_cols}"),
                    t1 * 1e6,
                    gb / t1,
                    t8 * 1e6,
                    gb / t8
                );
            }
        }
        println!("(t=1 includes the activation quantization launch; GB/s = weight bytes / time)");

        println!();
        println!("decode attention, 32 heads / 8 KV heads x 128, one query, f16 K/V:");
        println!("{:>8} {:>8} {:>10} {:>8}", "cells", "splits", "µs", "GB/s");
        let (nh, nkv, hd) = (32usize, 8usize, 128usize);
        let kvd = nkv * hd;
        for n_cells in [512usize, 4096, 32768] {
            let k: Vec<u16> = (0..n_cells * kvd)
                .map(|_| f32_to_f16(gauss(&mut self.rng)))
                .collect();
            let gk = self.dev.upload(&k).expect("upload");
            let gv = self.dev.upload(&k).expect("upload");
            let pos: Vec<u32> = (0..n_cells as u32).collect();
            let gp = self.dev.upload(&pos).expect("upload");
            let qh = self.randn(nh * hd, 1.0);
            let q = self.up(&qh);
            let mut packed = Vec::new();
            AttnRow {
                slots: 0,
                pos: gp.ptr(),
                n_cells: n_cells as u32,
                max_pos: n_cells as u32,
            }
            .pack(&mut packed);
            let rows = self.dev.upload(&packed).expect("upload");
            let shape = AttnShape {
                n_head: nh,
                n_head_kv: nkv,
                head_dim: hd,
                kv_stride: kvd,
                scale: 1.0 / (hd as f32).sqrt(),
                softcap: 0.0,
                window: 0,
            };
            let mut out = GpuVec::default();
            let mut s = Scratch::default();
            let t = self.time(50, || {
                // SAFETY: the row points at the buffers above.
                unsafe {
                    self.dev
                        .attention(
                            &shape,
                            &q,
                            gk.ptr(),
                            gv.ptr(),
                            rows.ptr(),
                            1,
                            n_cells,
                            &mut out,
                            None,
                            None,
                            &mut s,
                        )
                        .expect("attention");
                }
            });
            let e = [2, 4, 8].into_iter().find(|&e| hd <= 32 * e).unwrap_or(8);
            let splits = rustorch_cuda::kernels::auto_splits(
                self.dev.info.multiprocessors,
                nh,
                n_cells,
                rustorch_cuda::kernels::attn_per_pass(e),
            );
            let bytes = 2.0 * (n_cells * kvd * 2) as f64;
            println!(
                "{:>8} {:>8} {:>10.1} {:>8.0}",
                n_cells,
                splits,
                t * 1e6,
                bytes / t / 1e9
            );
        }
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let seed = args
        .iter()
        .position(|a| a == "--seed")
        .and_then(|i| args.get(i + 1))
        .and_then(|s| s.parse().ok())
        .unwrap_or(1234u64);
    let timing = !args.iter().any(|a| a == "--no-timing");
    let t0 = Instant::now();
    let dev = match CudaDevice::open(0) {
        Ok(d) => d,
        Err(e) => {
            println!("SKIPPED kernel_check: {e}");
            std::process::exit(2);
        }
    };
    let open_s = t0.elapsed().as_secs_f64();
    let i = &dev.info;
    println!(
        "device {}: {} (sm_{}{}), {:.1} GiB, {} SMs, driver {}.{}",
        i.index,
        i.name,
        i.compute_capability.0,
        i.compute_capability.1,
        i.total_mem as f64 / (1u64 << 30) as f64,
        i.multiprocessors,
        i.driver_version / 1000,
        (i.driver_version % 1000) / 10
    );
    let m = &dev.module;
    println!(
        "kernels: {} ({}), compile {:.2} s, load {:.3} s, open total {:.2} s{}",
        if m.cached { "from cache" } else { "compiled" },
        m.target,
        m.compile_s,
        m.load_s,
        open_s,
        if m.nvrtc.is_empty() {
            String::new()
        } else {
            format!(", NVRTC {}", m.nvrtc)
        }
    );
    if let Some(p) = &m.cache_file {
        println!("cache file: {}", p.display());
    }
    // a second open hits the cache
    let t1 = Instant::now();
    match CudaDevice::open(0) {
        Ok(d2) => println!(
            "second open: {} in {:.3} s",
            if d2.module.cached {
                "from cache"
            } else {
                "compiled again"
            },
            t1.elapsed().as_secs_f64()
        ),
        Err(e) => println!("second open failed: {e}"),
    }
    println!("seed {seed}");
    let mut h = Harness {
        dev,
        s: Scratch::default(),
        rng: StdRng::seed_from_u64(seed),
        checks: Vec::new(),
    };

    for (ty, _) in FORMATS {
        let float = matches!(ty, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16);
        let k_quant = ty.block_size() == 256;
        // one shape with many groups per row (128 threads per row) and one small
        let shapes: &[(usize, usize)] = if k_quant {
            &[(300, 2048), (37, 512)]
        } else if float {
            &[(300, 2048), (37, 1000)]
        } else {
            &[(300, 2048), (37, 544)]
        };
        for &(r, c) in shapes {
            h.matmul(ty, r, c, &[1, 2, 5, 8, 11]);
        }
    }
    h.norms();
    h.ropes();
    h.elementwise();
    h.kv_write();
    h.attention("single cell", 8, 2, 64, 1, &[(0, None)], 0.0, None);
    h.attention(
        "causal",
        8,
        2,
        64,
        300,
        &[(299, None), (150, None), (0, None)],
        0.0,
        None,
    );
    h.attention(
        "window",
        8,
        2,
        64,
        300,
        &[(299, Some(50)), (10, Some(50)), (120, Some(50))],
        0.0,
        None,
    );
    h.attention("long", 32, 8, 128, 5000, &[(4999, None)], 0.0, None);
    h.attention("long", 32, 8, 128, 5000, &[(4999, None)], 0.0, Some(1));
    h.attention(
        "long",
        32,
        8,
        128,
        5000,
        &[(3000, Some(1000)), (4999, Some(1000))],
        0.0,
        Some(7),
    );
    h.attention("hd80", 4, 4, 80, 200, &[(199, None), (0, None)], 0.0, None);
    h.attention(
        "hd256 mqa",
        8,
        1,
        256,
        1000,
        &[(999, None), (500, Some(100))],
        50.0,
        None,
    );
    h.attention(
        "none visible",
        4,
        2,
        64,
        50,
        &[(10, Some(0)), (49, None)],
        0.0,
        Some(3),
    );

    if timing {
        h.timings();
    }
    let failed: Vec<&Check> = h.checks.iter().filter(|c| !c.ok()).collect();
    println!();
    println!(
        "{} checks, {} passed, {} failed",
        h.checks.len(),
        h.checks.len() - failed.len(),
        failed.len()
    );
    for c in &failed {
        println!(
            "FAILED {} {}: rel {:.3e} > {:.1e}",
            c.kernel, c.case, c.rel, c.tol
        );
    }
    if !failed.is_empty() {
        std::process::exit(1);
    }
}
