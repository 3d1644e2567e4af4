//! Element-wise transformer operations, computed the way ggml's CPU backend computes
//! them (same accumulation precision and rounding points) so that results track
//! llama.cpp closely.

use super::dot::rd_f32;
use crate::quant::{f16_to_f32, f32_to_f16};

/// RMS normalisation in place, then multiplication by `weight`:
/// `x = (x / sqrt(mean(x²) + eps)) * weight`. The sum of squares is accumulated in f64
/// as ggml does.
pub fn rms_norm(x: &mut [f32], weight: &[f32], eps: f32) {
    let sum: f64 = x.iter().map(|&v| (v * v) as f64).sum();
    let mean = (sum / x.len() as f64) as f32;
    let scale = 1.0f32 / (mean + eps).sqrt();
    for (v, w) in x.iter_mut().zip(weight) {
        *v = (*v * scale) * *w;
    }
}

/// How RoPE pairs up the dimensions of a head.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RopeMode {
    /// Adjacent pairs `(2i, 2i+1)` (llama).
    Normal,
    /// Split halves `(i, i + n_rot/2)` (GPT-NeoX, qwen2, gemma).
    Neox,
}

/// Rotary position embedding parameters.
#[derive(Debug, Clone, Copy)]
pub struct Rope {
    pub mode: RopeMode,
    /// Number of dimensions rotated (the first `n_rot` of each head).
    pub n_rot: usize,
    pub freq_base: f32,
    /// Linear scaling: positions are multiplied by this (1 / scaling factor).
    pub freq_scale: f32,
    /// YaRN's corrections of the scaled angles (`rope.scaling.type` `yarn`), if any.
    pub yarn: Option<Yarn>,
}

/// YaRN (llama.cpp's `rope_yarn` in ggml-cpu): pair `i`'s angle mixes the interpolated angle
/// `freq_scale·θ` and the extrapolated one `θ` by a ramp over the pairs between
/// `corr_dims[0]` and `corr_dims[1]` (`θ` alone below, `freq_scale·θ` above), and cos and
/// sin are multiplied by `mscale`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Yarn {
    /// How much of the extrapolated angle the ramp mixes in (llama.cpp's
    /// `yarn_ext_factor`: 1 for YaRN models).
    pub ext_factor: f32,
    /// The ramp's first and last pair (`ggml_rope_yarn_corr_dims`).
    pub corr_dims: [f32; 2],
    /// The magnitude factor of cos and sin: llama.cpp's `yarn_attn_factor` times
    /// `1 + 0.1·ln(1 / freq_scale)` (ggml-cpu's fused multiply-add).
    pub mscale: f32,
}

impl Yarn {
    /// llama.cpp's YaRN for `n_rot` rotated dimensions of a layer with base `freq_base`
    /// whose positions are scaled by `freq_scale`, trained on an original context of
    /// `n_ctx_orig` (`rope.scaling.original_context_length`), with `attn_factor` from
    /// [`Yarn::attn_factor`] and llama.cpp's defaults `yarn_beta_fast` 32, `yarn_beta_slow`
    /// 1 and `yarn_ext_factor` 1 (it reads none of them from the file). f32 arithmetic as
    /// ggml's: the correction dimensions in ggml-base, the magnitude in ggml-cpu (whose
    /// build contracts it into a fused multiply-add).
    pub fn new(
        n_rot: usize,
        freq_base: f32,
        freq_scale: f32,
        n_ctx_orig: u32,
        attn_factor: f32,
    ) -> Self {
        let (beta_fast, beta_slow, ext_factor) = (32.0f32, 1.0f32, 1.0f32);
        // ggml_rope_yarn_corr_dim(n_dims, n_ctx_orig, n_rot, base)
        let corr_dim = |beta: f32| {
            n_rot as f32 * (n_ctx_orig as f32 / (beta * 2.0 * std::f32::consts::PI)).ln()
                / (2.0 * freq_base.ln())
        };
        let start = corr_dim(beta_fast).floor();
        let end = corr_dim(beta_slow).ceil();
        let last = n_rot as f32 - 1.0;
        let corr_dims = [
            if 0.0 > start { 0.0 } else { start },
            if last < end { last } else { end },
        ];
        // rope_yarn: mscale *= 1 + 0.1·logf(1 / freq_scale)
        let mscale = attn_factor * 0.1f32.mul_add((1.0f32 / freq_scale).ln(), 1.0);
        Yarn {
            ext_factor,
            corr_dims,
            mscale,
        }
    }

    /// llama.cpp's `yarn_attn_factor` for a model whose positions are scaled by
    /// `freq_scale` (1 / `rope.scaling.factor`), times `rope_attn_factor`
    /// (`rope.scaling.attn_factor`, 1 by default): `llama_context`'s
    /// `get_mscale(factor) · (1 / (1 + 0.1·ln factor))` in f32 (that library is built
    /// without fused multiply-adds), which cancels the magnitude `rope_yarn` applies up to
    /// rounding.
    pub fn attn_factor(freq_scale: f32, rope_attn_factor: f32) -> f32 {
        let factor = 1.0f32 / freq_scale;
        let get_mscale = if factor <= 1.0 {
            1.0
        } else {
            0.1f32 * factor.ln() + 1.0
        };
        get_mscale * (1.0f32 / (1.0 + 0.1f32 * factor.ln())) * rope_attn_factor
    }

    /// The angle of pair `i` from its extrapolated angle `theta_extrap` (`θ`) and
    /// interpolated angle `theta_interp` (`freq_scale·θ`): `rope_yarn`'s ramp and mix.
    #[inline]
    fn mix(&self, i: usize, theta_extrap: f32, theta_interp: f32) -> f32 {
        if self.ext_factor == 0.0 {
            return theta_interp;
        }
        let [low, high] = self.corr_dims;
        let d = high - low;
        let y = (i as f32 - low) / if 0.001f32 > d { 0.001 } else { d };
        // MIN(1, MAX(0, y)), NaN included
        let ramp_mix = (1.0 - y.clamp(0.0, 1.0)) * self.ext_factor;
        theta_interp.mul_add(1.0 - ramp_mix, theta_extrap * ramp_mix)
    }
}

impl Rope {
    /// Fills `cos`/`sin` (`n_rot / 2` each) for position `pos`. The angle of pair `i` is
    /// `pos * base^(-2i/n_rot)`, computed by repeated multiplication in f32 like ggml,
    /// divided by the pair's frequency factor and scaled by `freq_scale` (with YaRN: mixed
    /// with the unscaled angle, and cos and sin multiplied by its magnitude factor).
    pub fn angles(&self, pos: f32, freq_factors: Option<&[f32]>, cos: &mut [f32], sin: &mut [f32]) {
        let theta_scale = self.freq_base.powf(-2.0 / self.n_rot as f32);
        let mut theta = pos;
        for i in 0..self.n_rot / 2 {
            let ff = freq_factors.map_or(1.0, |f| f[i]);
            let t = self.freq_scale * (theta / ff);
            match &self.yarn {
                None => {
                    cos[i] = t.cos();
                    sin[i] = t.sin();
                }
                Some(y) => {
                    let t = y.mix(i, theta / ff, t);
                    cos[i] = t.cos() * y.mscale;
                    sin[i] = t.sin() * y.mscale;
                }
            }
            theta *= theta_scale;
        }
    }

    /// Rotates one head vector in place with precomputed angles.
    pub fn apply(&self, head: &mut [f32], cos: &[f32], sin: &[f32]) {
        #[cfg(target_arch = "x86_64")]
        if matches!(super::isa(), super::Isa::Avx2 | super::Isa::Avx512) {
            #[target_feature(enable = "avx2,fma")]
            unsafe fn with_fma(r: &Rope, head: &mut [f32], cos: &[f32], sin: &[f32]) {
                r.apply_portable(head, cos, sin)
            }
            // SAFETY: the family (which includes FMA) was detected. Same operations; the
            // fused multiply-adds become instructions instead of library calls.
            unsafe { with_fma(self, head, cos, sin) };
            return;
        }
        self.apply_portable(head, cos, sin)
    }

    #[inline(always)]
    fn apply_portable(&self, head: &mut [f32], cos: &[f32], sin: &[f32]) {
        let half = self.n_rot / 2;
        match self.mode {
            RopeMode::Normal => {
                for i in 0..half {
                    let (x0, x1) = (head[2 * i], head[2 * i + 1]);
                    head[2 * i] = x0.mul_add(cos[i], -(x1 * sin[i]));
                    head[2 * i + 1] = x0.mul_add(sin[i], x1 * cos[i]);
                }
            }
            RopeMode::Neox => {
                for i in 0..half {
                    let (x0, x1) = (head[i], head[i + half]);
                    head[i] = x0.mul_add(cos[i], -(x1 * sin[i]));
                    head[i + half] = x0.mul_add(sin[i], x1 * cos[i]);
                }
            }
        }
    }
}

/// `ggml_soft_max` of one row on an AVX-512 build: blocks of 16 with ggml's vectorised
/// `expf`, each block's sum reduced like `_mm512_reduce_add_ps` and added in f64, the tail
/// with the C library's `expf`, then every value scaled by `f32(1 / sum)`.
pub fn soft_max(x: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let n16 = x.len() & !15;
    let mut sum = 0f64;
    for block in x[..n16].chunks_exact_mut(16) {
        for v in block.iter_mut() {
            *v = super::gexp::expf(*v - max);
        }
        let w: [f32; 8] = std::array::from_fn(|l| block[l + 8] + block[l]);
        let u: [f32; 4] = std::array::from_fn(|l| w[l + 4] + w[l]);
        sum += ((u[0] + u[2]) + (u[1] + u[3])) as f64;
    }
    for v in x[n16..].iter_mut() {
        *v = (*v - max).exp();
        sum += *v as f64;
    }
    let inv = (1.0 / sum) as f32;
    for v in x.iter_mut() {
        *v *= inv;
    }
}

/// SiLU, `x / (1 + e^-x)`.
#[inline]
pub fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// `gate = silu(gate) * up`, element-wise (SwiGLU).
pub fn swiglu(gate: &mut [f32], up: &[f32]) {
    for (g, u) in gate.iter_mut().zip(up) {
        *g = silu(*g) * *u;
    }
}

/// gpt-oss's clamped SwiGLU (ggml's `swiglu_oai`, element-wise, scalar in ggml-cpu):
/// `g = min(gate, limit)`, `u = clamp(up, -limit, limit)`,
/// `gate = g / (1 + expf(alpha · -g)) · (u + 1)`.
pub fn swiglu_oai(gate: &mut [f32], up: &[f32], alpha: f32, limit: f32) {
    for (g, &u) in gate.iter_mut().zip(up) {
        // std::min(x, limit) and std::clamp(y, -limit, limit), NaN handling included
        let x = if limit < *g { limit } else { *g };
        let y = if u < -limit {
            -limit
        } else if limit < u {
            limit
        } else {
            u
        };
        let glu = x / (1.0 + (alpha * -x).exp());
        *g = glu * (y + 1.0);
    }
}

/// GELU with ggml's tanh approximation, computed as llama.cpp's CPU build computes each
/// entry of its f16 GELU table: `1 + A·x²` contracted to one fused multiply-add,
/// `(1 + tanh(√(2/π)·x·(1 + A·x²))) · (x/2)`.
#[inline]
pub fn gelu(x: f32) -> f32 {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    const COEF_A: f32 = 0.044715;
    let inner = (COEF_A * x).mul_add(x, 1.0);
    (1.0 + ((SQRT_2_OVER_PI * x) * inner).tanh()) * (0.5 * x)
}

/// ggml's GELU lookup table: for every f16 bit pattern `h`, `f16(gelu(f32(h)))`.
fn gelu_table() -> &'static [u16] {
    static TABLE: std::sync::OnceLock<Vec<u16>> = std::sync::OnceLock::new();
    TABLE.get_or_init(|| {
        (0..=u16::MAX)
            .map(|h| f32_to_f16(gelu(f16_to_f32(h))))
            .collect()
    })
}

/// `gate = gelu(gate) ⊙ up` (GeGLU) as ggml's CPU computes it: through the f16 GELU table
/// (the input rounded to f16), 0 from -10 down and the identity from 10 up.
pub fn geglu(gate: &mut [f32], up: &[f32]) {
    let table = gelu_table();
    for (g, &u) in gate.iter_mut().zip(up) {
        let x = *g;
        *g = if x <= -10.0 {
            0.0
        } else if x >= 10.0 {
            x * u
        } else {
            f16_to_f32(table[f32_to_f16(x) as usize]) * u
        };
    }
}

/// Soft-capping, `tanh(x / cap) · cap`, as ggml's scale, tanh, scale sequence.
pub fn softcap(x: &mut [f32], cap: f32) {
    let inv = 1.0 / cap;
    for v in x.iter_mut() {
        *v = (*v * inv).tanh() * cap;
    }
}

/// Dot product of an f32 slice with f32 values stored as little-endian bytes.
pub fn dot_f32_bytes(a: &[f32], b: &[u8]) -> f32 {
    let mut s = 0.0f32;
    for (i, x) in a.iter().enumerate() {
        s += x * rd_f32(b, 4 * i);
    }
    s
}

/// Plain f32 dot product.
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// The orthonormal Walsh–Hadamard rotation of every chunk of `n` values (a power of two) of
/// `x`, as ggml-cpu computes llama.cpp's `llama_mul_mat_hadamard` (`ggml_compute_forward_fwht`):
/// each value times `1 / sqrtf(n)`, then the butterflies `(u + v, u − v)` over spans
/// 1, 2, 4, … (exact operations, so their order within a span does not matter). Applying it
/// twice gives the input back up to rounding.
pub fn fwht(x: &mut [f32], n: usize) {
    if n < 2 {
        return;
    }
    let scale = 1.0f32 / (n as f32).sqrt();
    for row in x.chunks_exact_mut(n) {
        for v in row.iter_mut() {
            *v *= scale;
        }
        let mut len = 1;
        while len < n {
            for i in (0..n).step_by(2 * len) {
                for j in i..i + len {
                    let (u, v) = (row[j], row[j + len]);
                    row[j] = u + v;
                    row[j + len] = u - v;
                }
            }
            len *= 2;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// gpt-oss's YaRN (base 150000, factor 32 over 4096 positions) on 32 rotated
    /// dimensions: the ramp runs over pairs 4..9; below it the angle is the unscaled one,
    /// above it the scaled one, and cos/sin carry the magnitude `1 + 0.1 ln 32` up to the
    /// rounding of llama.cpp's attention factor.
    #[test]
    fn yarn_ramp_and_magnitude() {
        let scale = 1.0 / 32.0;
        let y = Yarn::new(32, 150000.0, scale, 4096, Yarn::attn_factor(scale, 1.0));
        assert_eq!(y.corr_dims, [4.0, 9.0]);
        assert!(
            (y.mscale - (1.0 + 0.1 * 32f32.ln())).abs() < 1e-6,
            "{}",
            y.mscale
        );
        let rope = Rope {
            mode: RopeMode::Neox,
            n_rot: 32,
            freq_base: 150000.0,
            freq_scale: scale,
            yarn: Some(y),
        };
        let plain = Rope { yarn: None, ..rope };
        let unscaled = Rope {
            freq_scale: 1.0,
            ..plain
        };
        let (mut c, mut s) = ([0f32; 16], [0f32; 16]);
        let (mut cp, mut sp) = ([0f32; 16], [0f32; 16]);
        let (mut cu, mut su) = ([0f32; 16], [0f32; 16]);
        rope.angles(37.0, None, &mut c, &mut s);
        plain.angles(37.0, None, &mut cp, &mut sp);
        unscaled.angles(37.0, None, &mut cu, &mut su);
        for i in 0..16 {
            let (want_c, want_s) = match i {
                0..=4 => (cu[i], su[i]),
                9.. => (cp[i], sp[i]),
                _ => continue,
            };
            assert_eq!(c[i], want_c * y.mscale, "pair {i}");
            assert_eq!(s[i], want_s * y.mscale, "pair {i}");
        }
        // inside the ramp the angle lies between the two
        for i in 5..9 {
            let a = s[i].atan2(c[i]);
            let (lo, hi) = (sp[i].atan2(cp[i]), su[i].atan2(cu[i]));
            assert!(a > lo.min(hi) && a < lo.max(hi), "pair {i}");
        }
    }

    #[test]
    fn swiglu_oai_clamps() {
        let mut g = [10.0f32, -3.0, 1.0];
        swiglu_oai(&mut g, &[20.0, -20.0, 0.5], 1.702, 7.0);
        let f = |x: f32, y: f32| x / (1.0 + (1.702 * -x).exp()) * (y + 1.0);
        assert_eq!(g, [f(7.0, 7.0), f(-3.0, -7.0), f(1.0, 0.5)]);
    }
}
