//! Which SIMD instruction set the kernels use, chosen once at run time.
//!
//! The binary is built for baseline x86-64 (or aarch64); faster paths are compiled with
//! `#[target_feature]` and only entered after `is_x86_feature_detected!` confirmed the CPU
//! has them. `RUSTORCH_ISA=scalar|avx2|avx512` lowers the choice (never raises it), for
//! comparisons and debugging.

use std::sync::atomic::{AtomicU8, Ordering};

/// A kernel family. Every family computes bit-identical results for the quantized
/// formats (see `dot.rs`); they differ only in speed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Isa {
    /// Portable Rust, the reference.
    Scalar,
    /// x86-64 with AVX2, FMA and F16C.
    Avx2,
    /// x86-64 with AVX-512 F/BW/VL and VNNI (plus AVX2, FMA, F16C).
    Avx512,
    /// aarch64 with NEON (only the F32/F16 dots use it; quantized formats run scalar).
    Neon,
}

impl Isa {
    pub fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512",
            Isa::Neon => "neon",
        }
    }

    /// Every family this CPU can run, slowest first.
    pub fn available() -> Vec<Isa> {
        let mut v = vec![Isa::Scalar];
        #[cfg(target_arch = "x86_64")]
        {
            if has_avx2() {
                v.push(Isa::Avx2);
            }
            if has_avx512() {
                v.push(Isa::Avx512);
            }
        }
        #[cfg(target_arch = "aarch64")]
        {
            if std::arch::is_aarch64_feature_detected!("neon") {
                v.push(Isa::Neon);
            }
        }
        v
    }

    fn to_u8(self) -> u8 {
        match self {
            Isa::Scalar => 1,
            Isa::Avx2 => 2,
            Isa::Avx512 => 3,
            Isa::Neon => 4,
        }
    }

    fn from_u8(v: u8) -> Isa {
        match v {
            2 => Isa::Avx2,
            3 => Isa::Avx512,
            4 => Isa::Neon,
            _ => Isa::Scalar,
        }
    }
}

#[cfg(target_arch = "x86_64")]
fn has_avx2() -> bool {
    is_x86_feature_detected!("avx2")
        && is_x86_feature_detected!("fma")
        && is_x86_feature_detected!("f16c")
}

#[cfg(target_arch = "x86_64")]
fn has_avx512() -> bool {
    has_avx2()
        && is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512bw")
        && is_x86_feature_detected!("avx512vl")
        && is_x86_feature_detected!("avx512vnni")
        && is_x86_feature_detected!("avx512dq")
}

static ACTIVE: AtomicU8 = AtomicU8::new(0);
static NATIVE_F16: AtomicU8 = AtomicU8::new(0);

/// Whether llama.cpp, built for this CPU, does f16 vector arithmetic natively (AVX512-FP16,
/// Sapphire Rapids and later): its f16 multiply-adds and scalings then round once in f16
/// instead of going through f32. Off below AVX-512, or with `RUSTORCH_NO_AVX512FP16=1`
/// (to reproduce a build for a CPU without it, such as AMD Zen 4).
#[inline]
pub fn native_f16() -> bool {
    match NATIVE_F16.load(Ordering::Relaxed) {
        1 => false,
        2 => true,
        _ => {
            #[cfg(target_arch = "x86_64")]
            let has = isa() == Isa::Avx512
                && is_x86_feature_detected!("avx512fp16")
                && std::env::var_os("RUSTORCH_NO_AVX512FP16").is_none_or(|v| v == "0");
            #[cfg(not(target_arch = "x86_64"))]
            let has = false;
            NATIVE_F16.store(if has { 2 } else { 1 }, Ordering::Relaxed);
            has
        }
    }
}

/// The family the kernels use: the best available, lowered by `RUSTORCH_ISA`.
#[inline]
pub fn isa() -> Isa {
    let v = ACTIVE.load(Ordering::Relaxed);
    if v != 0 {
        return Isa::from_u8(v);
    }
    let avail = Isa::available();
    let best = *avail.last().unwrap_or(&Isa::Scalar);
    let chosen = match std::env::var("RUSTORCH_ISA").ok().as_deref() {
        Some(name) => avail
            .iter()
            .copied()
            .find(|i| i.name() == name)
            .unwrap_or(best),
        None => best,
    };
    ACTIVE.store(chosen.to_u8(), Ordering::Relaxed);
    chosen
}
