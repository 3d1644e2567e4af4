//! llama.cpp's per-tensor quantization recipe, ported from `src/llama-quant.cpp` of
//! llama.cpp 0.3.36 (the copy vendored by llama-cpp-python 0.3.36): the file types
//! (`LLAMA_FTYPE_*`), the tensor categories, `tensor_allows_quantization`,
//! `llama_tensor_get_type(_impl)` with its attention-V / FFN counters, and
//! `tensor_type_fallback` for rows that are not a multiple of the block size.
//!
//! Only what can change the result for the file types offered here is kept; branches for
//! file types this crate cannot produce (IQ1..IQ3 mixes, MXFP4_MOE, TQ*) are left out and
//! named where they were.

use rustorch_core::GgmlType;

/// A llama.cpp file type (`enum llama_ftype`), i.e. a quantization mix.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[allow(non_camel_case_types)]
pub enum Ftype {
    AllF32,
    F16,
    Q4_0,
    Q4_1,
    Q8_0,
    Q5_0,
    Q5_1,
    Q2_K,
    Q3_K_S,
    Q3_K_M,
    Q3_K_L,
    Q4_K_S,
    Q4_K_M,
    Q5_K_S,
    Q5_K_M,
    Q6_K,
    IQ4_NL,
    IQ4_XS,
    BF16,
}

/// llama-quantize's names (its `QUANT_OPTIONS`, in its order, limited to the types offered
/// here), with the aliases `Q3_K`, `Q4_K` and `Q5_K` for the `_M` mixes.
pub const FTYPE_NAMES: &[(&str, Ftype)] = &[
    ("Q4_0", Ftype::Q4_0),
    ("Q4_1", Ftype::Q4_1),
    ("Q5_0", Ftype::Q5_0),
    ("Q5_1", Ftype::Q5_1),
    ("Q2_K", Ftype::Q2_K),
    ("Q3_K", Ftype::Q3_K_M),
    ("Q3_K_S", Ftype::Q3_K_S),
    ("Q3_K_M", Ftype::Q3_K_M),
    ("Q3_K_L", Ftype::Q3_K_L),
    ("IQ4_NL", Ftype::IQ4_NL),
    ("IQ4_XS", Ftype::IQ4_XS),
    ("Q4_K", Ftype::Q4_K_M),
    ("Q4_K_S", Ftype::Q4_K_S),
    ("Q4_K_M", Ftype::Q4_K_M),
    ("Q5_K", Ftype::Q5_K_M),
    ("Q5_K_S", Ftype::Q5_K_S),
    ("Q5_K_M", Ftype::Q5_K_M),
    ("Q6_K", Ftype::Q6_K),
    ("Q8_0", Ftype::Q8_0),
    ("F16", Ftype::F16),
    ("BF16", Ftype::BF16),
    ("F32", Ftype::AllF32),
];

impl Ftype {
    /// Parses a name case-insensitively, or llama.cpp's number for the file type, as
    /// llama-quantize's `try_parse_ftype` does. Returns the canonical name too.
    pub fn parse(s: &str) -> Option<(Ftype, &'static str)> {
        if let Some(&(name, ft)) = FTYPE_NAMES.iter().find(|(n, _)| n.eq_ignore_ascii_case(s)) {
            return Some((ft, name));
        }
        let id: u32 = s.trim().parse().ok()?;
        FTYPE_NAMES
            .iter()
            .find(|(_, ft)| ft.id() == id)
            .map(|&(name, ft)| (ft, name))
    }

    /// The value llama.cpp stores in `general.file_type`.
    pub fn id(self) -> u32 {
        use Ftype::*;
        match self {
            AllF32 => 0,
            F16 => 1,
            Q4_0 => 2,
            Q4_1 => 3,
            Q8_0 => 7,
            Q5_0 => 8,
            Q5_1 => 9,
            Q2_K => 10,
            Q3_K_S => 11,
            Q3_K_M => 12,
            Q3_K_L => 13,
            Q4_K_S => 14,
            Q4_K_M => 15,
            Q5_K_S => 16,
            Q5_K_M => 17,
            Q6_K => 18,
            IQ4_NL => 25,
            IQ4_XS => 30,
            BF16 => 32,
        }
    }

    /// `llama_ftype_get_default_type`.
    pub fn default_type(self) -> GgmlType {
        use Ftype::*;
        match self {
            AllF32 => GgmlType::F32,
            F16 => GgmlType::F16,
            BF16 => GgmlType::BF16,
            Q4_0 => GgmlType::Q4_0,
            Q4_1 => GgmlType::Q4_1,
            Q5_0 => GgmlType::Q5_0,
            Q5_1 => GgmlType::Q5_1,
            Q8_0 => GgmlType::Q8_0,
            Q2_K => GgmlType::Q2_K,
            Q3_K_S | Q3_K_M | Q3_K_L => GgmlType::Q3_K,
            Q4_K_S | Q4_K_M => GgmlType::Q4_K,
            Q5_K_S | Q5_K_M => GgmlType::Q5_K,
            Q6_K => GgmlType::Q6_K,
            IQ4_NL => GgmlType::IQ4_NL,
            IQ4_XS => GgmlType::IQ4_XS,
        }
    }
}

/// `ggml_is_quantized`: block formats, as opposed to plain floats and integers.
pub fn is_quantized(ty: GgmlType) -> bool {
    use GgmlType::*;
    !matches!(ty, F32 | F16 | BF16 | I8 | I16 | I32 | I64 | F64)
}

/// `ggml_n_dims`: one more than the index of the last dimension above 1 (at least 1).
pub fn n_dims(dims: &[u64]) -> usize {
    dims.iter().rposition(|&d| d > 1).map_or(1, |i| i + 1)
}

/// Broad tensor categories (`enum tensor_category`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Category {
    TokenEmbd,
    AttentionQ,
    AttentionV,
    AttentionK,
    AttentionQkv,
    AttentionKvB,
    AttentionOutput,
    FfnUp,
    FfnGate,
    FfnDown,
    Output,
    Other,
}

impl Category {
    /// `tensor_get_category`: by name, first match wins.
    pub fn of(name: &str) -> Category {
        use Category::*;
        if name == "output.weight" {
            return Output;
        }
        if name == "token_embd.weight" || name == "per_layer_token_embd.weight" {
            return TokenEmbd;
        }
        for (needle, cat) in [
            ("attn_qkv.weight", AttentionQkv),
            ("attn_kv_b.weight", AttentionKvB),
            ("attn_v.weight", AttentionV),
            ("attn_k.weight", AttentionK),
            ("attn_q.weight", AttentionQ),
            ("attn_output.weight", AttentionOutput),
            ("ffn_up", FfnUp),
            ("ffn_gate", FfnGate),
            ("ffn_down", FfnDown),
        ] {
            if name.contains(needle) {
                return cat;
            }
        }
        Other
    }

    /// `category_is_attn_v`.
    fn is_attn_v(self) -> bool {
        matches!(
            self,
            Category::AttentionV | Category::AttentionQkv | Category::AttentionKvB
        )
    }
}

/// The model hyper-parameters the recipe reads (from the GGUF metadata, as llama.cpp's
/// `load_hparams` fills them).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelInfo {
    pub arch: String,
    /// `hparams.n_layer_all` (`{arch}.block_count`).
    pub n_layer: u32,
    /// Heads of layer 0 (`hparams.n_head()`).
    pub n_head: u32,
    /// KV heads of layer 0 (`hparams.n_head_kv()`, defaults to `n_head`).
    pub n_head_kv: u32,
    /// `{arch}.expert_count` (0 without experts).
    pub n_expert: u32,
}

impl ModelInfo {
    /// `hparams.n_gqa()`.
    fn n_gqa(&self) -> u32 {
        self.n_head.checked_div(self.n_head_kv).unwrap_or(0)
    }

    /// Whether llama.cpp's `load_arch_hparams` sets `LLM_TYPE_70B`, the only model type the
    /// recipe looks at (llama with 80 grouped-query layers and no 8 experts; qwen2, deci and
    /// olmo with 80 layers; jais2 with 68).
    fn is_70b(&self) -> bool {
        match self.arch.as_str() {
            "llama" => self.n_expert != 8 && self.n_layer == 80 && self.n_head != self.n_head_kv,
            "qwen2" | "deci" | "olmo" => self.n_layer == 80,
            "jais2" => self.n_layer == 68,
            _ => false,
        }
    }
}

/// The user's choices (`llama_model_quantize_params`, the fields that matter here).
#[derive(Debug, Clone, Default)]
pub struct Params {
    pub pure: bool,
    pub quantize_output_tensor: bool,
    pub output_tensor_type: Option<GgmlType>,
    pub token_embedding_type: Option<GgmlType>,
    /// An importance matrix is given (`qs.has_imatrix`): IQ4_NL/IQ4_XS keep their type in
    /// the first eighth of FFN-down, Q4_0/Q5_0 take Q4_1/Q5_1 there.
    pub has_imatrix: bool,
}

/// `tensor_allows_quantization`: whether a tensor may change type at all.
pub fn allows_quantization(params: &Params, arch: &str, name: &str, dims: &[u64]) -> bool {
    if n_dims(dims) < 2 {
        return false;
    }
    // C++: `name.rfind("weight") == name.size() - 6`; without "weight" rfind is npos, which
    // equals size - 6 only for a 5-byte name (unsigned wrap-around).
    let mut q = match name.rfind("weight") {
        Some(p) => name.len() >= 6 && p == name.len() - 6,
        None => name.len() == 5,
    };
    q &= !name.contains("_norm.weight");
    q &= params.quantize_output_tensor || name != "output.weight";
    for needle in [
        "ffn_gate_inp.weight",
        "ffn_gate_tid2eid.weight",
        "altup",
        "laurel",
        "per_layer_model_proj",
        "ssm_conv1d",
        "shortconv.conv.weight",
        "indexer.k_proj.weight",
        "indexer.q_proj.weight",
    ] {
        q &= !name.contains(needle);
    }
    q &= name != "position_embd.weight";
    q &= name != "token_types.weight";
    if arch == "glm5-next" {
        for needle in [
            "hc_",
            "indexer.attn_q_b",
            "indexer.attn_k",
            "indexer.proj",
            "indexer_compressor_gate",
            "indexer_compressor_ape",
            "ssm_f_a.weight",
            "ssm_f_b.weight",
            "ssm_g_a.weight",
            "ssm_g_b.weight",
            "ssm_beta.weight",
            "attn_kv_a_mqa.weight",
            "attn_k_b.weight",
            "attn_v_b.weight",
        ] {
            q &= !name.contains(needle);
        }
    }
    for needle in [
        "time_mix_first.weight",
        "time_mix_w0.weight",
        "time_mix_w1.weight",
        "time_mix_w2.weight",
        "time_mix_v0.weight",
        "time_mix_v1.weight",
        "time_mix_v2.weight",
        "time_mix_a0.weight",
        "time_mix_a1.weight",
        "time_mix_a2.weight",
        "time_mix_g1.weight",
        "time_mix_g2.weight",
        "time_mix_decay_w1.weight",
        "time_mix_decay_w2.weight",
        "time_mix_lerp_fused.weight",
        "attn_rel_b.weight",
        ".position_embd",
        "sam.pos_embd",
        "sam.neck.",
        "sam.net_",
        ".rel_pos",
        ".patch_embd",
        ".patch_merger",
        "a.rvq.codebook",
        "mm.a.code_embd",
    ] {
        q &= !name.contains(needle);
    }
    q
}

/// A rule that gave up on a tensor (llama.cpp throws; so do we).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecipeError(pub String);

impl std::fmt::Display for RecipeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for RecipeError {}

/// One tensor's decision.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Choice {
    pub ty: GgmlType,
    /// The warning llama.cpp prints when the row length forced a fallback type.
    pub fallback: Option<String>,
}

/// `quantize_state_impl`: the counters that make the recipe depend on tensor order.
pub struct Recipe<'a> {
    model: &'a ModelInfo,
    params: &'a Params,
    ftype: Ftype,
    n_attention_wv: i32,
    n_ffn_down: i32,
    n_ffn_gate: i32,
    n_ffn_up: i32,
    i_attention_wv: i32,
    i_ffn_down: i32,
    i_ffn_gate: i32,
    i_ffn_up: i32,
    has_tied_embeddings: bool,
    pub n_fallback: usize,
}

impl<'a> Recipe<'a> {
    /// `init_quantize_state_counters` over the names of all tensors of the file.
    pub fn new<'n>(
        model: &'a ModelInfo,
        params: &'a Params,
        ftype: Ftype,
        names: impl IntoIterator<Item = &'n str>,
    ) -> Self {
        let mut n_attention_wv = 0;
        let mut has_tied_embeddings = true;
        for name in names {
            let cat = Category::of(name);
            if cat.is_attn_v() {
                n_attention_wv += 1;
            }
            if cat == Category::Output {
                has_tied_embeddings = false;
            }
        }
        let n = model.n_layer as i32;
        Recipe {
            model,
            params,
            ftype,
            n_attention_wv,
            n_ffn_down: n,
            n_ffn_gate: n,
            n_ffn_up: n,
            i_attention_wv: 0,
            i_ffn_down: 0,
            i_ffn_gate: 0,
            i_ffn_up: 0,
            has_tied_embeddings,
            n_fallback: 0,
        }
    }

    /// The type of one tensor: its own when it may not be quantized, else
    /// `llama_tensor_get_type`. Call in the output order (the counters advance).
    pub fn choose(
        &mut self,
        name: &str,
        dims: &[u64],
        cur: GgmlType,
    ) -> Result<Choice, RecipeError> {
        let keep = Choice {
            ty: cur,
            fallback: None,
        };
        if !allows_quantization(self.params, &self.model.arch, name, dims) {
            return Ok(keep);
        }
        let cat = Category::of(name);
        if let (Some(t), Category::TokenEmbd) = (self.params.token_embedding_type, cat) {
            // (--tensor-type patterns, which could name per_layer_token_embd, are not offered)
            return Ok(Choice {
                ty: t,
                fallback: None,
            });
        }
        if let (Some(t), Category::Output) = (self.params.output_tensor_type, cat) {
            return Ok(Choice {
                ty: t,
                fallback: None,
            });
        }
        let mut ty = self.ftype.default_type();
        let mut fallback = None;
        if is_quantized(ty) {
            if !self.params.pure {
                ty = self.type_impl(ty, name, dims, cat)?;
            }
            let ne0 = dims.first().copied().unwrap_or(1);
            let (t, warn) = fallback_type(name, ne0, ty)?;
            ty = t;
            if warn.is_some() {
                self.n_fallback += 1;
            }
            fallback = warn;
        }
        Ok(Choice { ty, fallback })
    }

    /// `llama_tensor_get_type_impl`, for the file types of [`Ftype`]. Kept branch for branch
    /// like the C++ (hence branches with the same body).
    #[allow(clippy::if_same_then_else)]
    fn type_impl(
        &mut self,
        mut new_type: GgmlType,
        name: &str,
        dims: &[u64],
        cat: Category,
    ) -> Result<GgmlType, RecipeError> {
        use Ftype as F;
        use GgmlType as T;
        let ftype = self.ftype;
        let m = self.model;
        let arch = m.arch.as_str();
        let falcon = arch == "falcon";
        let use_more_bits = |i_layer: i32, n_layers: i32| -> bool {
            i_layer < n_layers / 8
                || i_layer >= 7 * n_layers / 8
                || (i_layer - n_layers / 8) % 3 == 2
        };
        let n_expert = m.n_expert.max(1);
        // With experts, the layer comes from the name (experts are not consecutive).
        let layer_info = |i_layer: i32, n_layer: i32| -> Result<(i32, i32), RecipeError> {
            if n_expert > 1 {
                let i = scan_blk(name).ok_or_else(|| {
                    RecipeError(format!("Failed to determine layer for tensor {name}"))
                })?;
                if i < 0 || i >= n_layer {
                    return Err(RecipeError(format!(
                        "Bad layer {i} for tensor {name}. Must be in [0, {n_layer})"
                    )));
                }
                return Ok((i, n_layer));
            }
            Ok((i_layer, n_layer))
        };

        // (glm5-next's Q8_0 floor for attn_q_a / attn_q_b / nextn.eh_proj)
        if arch == "glm5-next"
            && (name.contains("attn_q_a")
                || name.contains("attn_q_b")
                || name.contains("nextn.eh_proj"))
            && !matches!(new_type, T::F32 | T::BF16 | T::F16)
        {
            return Ok(T::Q8_0);
        }

        if cat == Category::Output || (self.has_tied_embeddings && cat == Category::TokenEmbd) {
            if let Some(t) = self.params.output_tensor_type {
                new_type = t;
            } else {
                let nx = dims.first().copied().unwrap_or(1);
                let qk_k = new_type.block_size() as u64;
                if falcon || nx % qk_k != 0 {
                    new_type = T::Q8_0;
                } else if new_type != T::Q8_0 {
                    // (the IQ1/IQ2/IQ3_XXS mixes take Q5_K here)
                    new_type = T::Q6_K;
                }
            }
        } else if cat == Category::TokenEmbd {
            if let Some(t) = self.params.token_embedding_type {
                new_type = t;
            }
            // (the IQ1/IQ2/IQ3_XXS/TQ mixes pick their own embedding type here)
        } else if cat.is_attn_v() {
            // (Q2_K_S, IQ3_XXS, IQ3_XS, IQ3_S, IQ3_M branches omitted: not offered)
            if ftype == F::Q2_K {
                new_type = if m.n_gqa() >= 4 { T::Q4_K } else { T::Q3_K };
            } else if ftype == F::Q3_K_M {
                new_type = if self.i_attention_wv < 2 {
                    T::Q5_K
                } else {
                    T::Q4_K
                };
            } else if ftype == F::Q3_K_L {
                new_type = T::Q5_K;
            } else if matches!(ftype, F::IQ4_NL | F::IQ4_XS) && m.n_gqa() >= 4 {
                new_type = T::Q5_K;
            } else if matches!(ftype, F::Q4_K_M | F::Q5_K_M)
                && use_more_bits(self.i_attention_wv, self.n_attention_wv)
            {
                new_type = T::Q6_K;
            } else if ftype == F::Q4_K_S && self.i_attention_wv < 4 {
                new_type = T::Q5_K;
            }
            if m.is_70b() && matches!(new_type, T::Q3_K | T::Q4_K) {
                new_type = T::Q5_K;
            }
            if m.n_expert == 8 {
                new_type = T::Q8_0;
            }
            self.i_attention_wv += 1;
        } else if cat == Category::AttentionK {
            if m.n_expert == 8 {
                new_type = T::Q8_0;
            }
            // (IQ3_XS / IQ3_XXS branches omitted)
        } else if cat == Category::AttentionQ {
            // (IQ3_XS / IQ3_XXS branches only)
        } else if cat == Category::FfnDown {
            let (i_layer, n_layer) = layer_info(self.i_ffn_down, self.n_ffn_down)?;
            if ftype == F::Q2_K {
                new_type = T::Q3_K;
            } else if ftype == F::Q3_K_M {
                new_type = if i_layer < n_layer / 16 {
                    T::Q5_K
                } else if !falcon || use_more_bits(i_layer, n_layer) {
                    T::Q4_K
                } else {
                    T::Q3_K
                };
            } else if ftype == F::Q3_K_L {
                new_type = if falcon { T::Q4_K } else { T::Q5_K };
            } else if ftype == F::Q4_K_M {
                if falcon {
                    new_type = if i_layer < n_layer / 16 {
                        T::Q6_K
                    } else if use_more_bits(i_layer, n_layer) {
                        T::Q5_K
                    } else {
                        T::Q4_K
                    };
                } else if use_more_bits(i_layer, n_layer) {
                    new_type = T::Q6_K;
                }
            } else if i_layer < n_layer / 8
                && matches!(ftype, F::IQ4_NL | F::IQ4_XS)
                && !self.params.has_imatrix
            {
                new_type = T::Q5_K;
            } else if ftype == F::Q5_K_M && use_more_bits(i_layer, n_layer) {
                new_type = T::Q6_K;
            } else if ftype == F::Q4_K_S && !falcon && i_layer < n_layer / 8 {
                new_type = T::Q5_K;
            } else if matches!(ftype, F::Q4_0 | F::Q5_0)
                && self.params.has_imatrix
                && i_layer < n_layer / 8
            {
                // llama.cpp guards the first FFN-down layers against Q4_0/Q5_0 "craziness",
                // only with an imatrix (without one the quantization stays what it was)
                new_type = if ftype == F::Q4_0 { T::Q4_1 } else { T::Q5_1 };
            }
            self.i_ffn_down += 1;
        } else if cat == Category::AttentionOutput {
            if !falcon {
                if m.n_expert == 8 {
                    if matches!(
                        ftype,
                        F::Q2_K
                            | F::Q3_K_S
                            | F::Q3_K_M
                            | F::IQ4_NL
                            | F::Q4_K_S
                            | F::Q4_K_M
                            | F::IQ4_XS
                    ) {
                        new_type = T::Q5_K;
                    }
                } else if ftype == F::Q2_K {
                    new_type = T::Q3_K;
                } else if ftype == F::Q3_K_M {
                    new_type = T::Q4_K;
                } else if ftype == F::Q3_K_L {
                    new_type = T::Q5_K;
                }
            } else if ftype == F::Q3_K_L {
                new_type = T::Q4_K;
            }
        } else if cat == Category::AttentionQkv {
            if matches!(ftype, F::Q3_K_M | F::Q3_K_L) {
                new_type = T::Q4_K;
            } else if ftype == F::Q4_K_M {
                new_type = T::Q5_K;
            } else if ftype == F::Q5_K_M {
                new_type = T::Q6_K;
            }
        } else if cat == Category::FfnGate {
            layer_info(self.i_ffn_gate, self.n_ffn_gate)?;
            // (IQ3_XS only)
            self.i_ffn_gate += 1;
        } else if cat == Category::FfnUp {
            layer_info(self.i_ffn_up, self.n_ffn_up)?;
            // (IQ3_XS only)
            self.i_ffn_up += 1;
        }
        Ok(new_type)
    }
}

/// `sscanf(name, "blk.%d.", &i)`: the layer number after `blk.` (the trailing dot need not
/// match for the number to count).
pub fn scan_blk(name: &str) -> Option<i32> {
    let rest = name.strip_prefix("blk.")?;
    let rest = rest.trim_start_matches([' ', '\t', '\n', '\r', '\x0b', '\x0c']);
    let (sign, digits) = match rest.as_bytes().first() {
        Some(b'-') => (-1i64, &rest[1..]),
        Some(b'+') => (1, &rest[1..]),
        _ => (1, rest),
    };
    let end = digits
        .bytes()
        .position(|b| !b.is_ascii_digit())
        .unwrap_or(digits.len());
    if end == 0 {
        return None;
    }
    // (overflow is undefined in C; saturate)
    let v = digits[..end].parse::<i64>().unwrap_or(i64::MAX) * sign;
    Some(v.clamp(i32::MIN as i64, i32::MAX as i64) as i32)
}

/// The order llama.cpp's model loader keeps weights in (`weight_name_comparer`): by layer
/// number (`blk.N.`, -1 for the rest), then by name, bytewise.
pub fn weight_order(a: &str, b: &str) -> std::cmp::Ordering {
    let la = scan_blk(a).unwrap_or(-1);
    let lb = scan_blk(b).unwrap_or(-1);
    la.cmp(&lb).then_with(|| a.as_bytes().cmp(b.as_bytes()))
}

/// `tensor_type_fallback`: a type whose block fits a row of `ne0` values. Returns the type
/// and, when it had to change, llama.cpp's warning text.
pub fn fallback_type(
    name: &str,
    ne0: u64,
    target: GgmlType,
) -> Result<(GgmlType, Option<String>), RecipeError> {
    use GgmlType as T;
    let qk_k = target.block_size() as u64;
    if ne0.is_multiple_of(qk_k) {
        return Ok((target, None));
    }
    let mut ret = match target {
        T::IQ1_S
        | T::IQ1_M
        | T::IQ2_XXS
        | T::IQ2_XS
        | T::IQ2_S
        | T::IQ3_XXS
        | T::IQ3_S
        | T::IQ4_XS => T::IQ4_NL,
        T::Q2_0 | T::Q2_K | T::Q3_K | T::TQ1_0 | T::TQ2_0 => T::Q4_0,
        T::Q4_K => T::Q5_0,
        T::Q5_K => T::Q5_1,
        T::Q6_K => T::Q8_0,
        _ if qk_k <= 32 => target,
        _ => {
            return Err(RecipeError(format!(
                "no tensor type fallback is defined for type {target}"
            )))
        }
    };
    let mut msg = format!(
        "{name:<36} - ncols {ne0:>6} not divisible by {qk_k:>3} (required for type {:>7}) ",
        target.name()
    );
    if !ne0.is_multiple_of(ret.block_size() as u64) {
        msg.push_str("(WARNING: must use F16 due to unusual shape) ");
        ret = T::F16;
    }
    msg.push_str(&format!("-> falling back to {:>7}", ret.name()));
    Ok((ret, Some(msg)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn smol() -> ModelInfo {
        ModelInfo {
            arch: "llama".into(),
            n_layer: 30,
            n_head: 9,
            n_head_kv: 3,
            n_expert: 0,
        }
    }

    #[test]
    fn ftype_names_and_numbers() {
        assert_eq!(Ftype::parse("q4_k_m"), Some((Ftype::Q4_K_M, "Q4_K_M")));
        assert_eq!(Ftype::parse("Q4_K"), Some((Ftype::Q4_K_M, "Q4_K")));
        assert_eq!(Ftype::parse("15"), Some((Ftype::Q4_K_M, "Q4_K")));
        assert_eq!(Ftype::parse("30"), Some((Ftype::IQ4_XS, "IQ4_XS")));
        assert_eq!(Ftype::parse("iq2_xxs"), None);
        assert_eq!(Ftype::parse("4"), None);
    }

    #[test]
    fn blk_scan_and_order() {
        assert_eq!(scan_blk("blk.12.attn_q.weight"), Some(12));
        assert_eq!(scan_blk("blk.7"), Some(7));
        assert_eq!(scan_blk("token_embd.weight"), None);
        assert_eq!(scan_blk("blk.x.y"), None);
        let mut v = vec![
            "blk.10.attn_q.weight",
            "blk.2.ffn_up.weight",
            "token_embd.weight",
            "blk.2.attn_k.weight",
            "output_norm.weight",
        ];
        v.sort_by(|a, b| weight_order(a, b));
        assert_eq!(
            v,
            [
                "output_norm.weight",
                "token_embd.weight",
                "blk.2.attn_k.weight",
                "blk.2.ffn_up.weight",
                "blk.10.attn_q.weight"
            ]
        );
    }

    #[test]
    fn what_may_be_quantized() {
        let p = Params {
            quantize_output_tensor: true,
            ..Params::default()
        };
        let q = |n: &str, d: &[u64]| allows_quantization(&p, "llama", n, d);
        assert!(q("blk.0.attn_q.weight", &[576, 576]));
        assert!(!q("blk.0.attn_norm.weight", &[576]));
        assert!(!q("blk.0.attn_q.weight", &[576, 1]));
        assert!(!q("blk.0.attn_q.bias", &[576, 2]));
        assert!(!q("blk.0.ffn_gate_inp.weight", &[576, 8]));
        assert!(!q("position_embd.weight", &[576, 8]));
        assert!(q("abcde", &[32, 2])); // C++'s npos wrap-around
        let keep = Params {
            quantize_output_tensor: false,
            ..p.clone()
        };
        assert!(!allows_quantization(
            &keep,
            "llama",
            "output.weight",
            &[576, 8]
        ));
    }

    #[test]
    fn fallbacks() {
        use GgmlType as T;
        let f = |ne0, t| fallback_type("x", ne0, t).unwrap().0;
        assert_eq!(f(576, T::Q4_K), T::Q5_0);
        assert_eq!(f(576, T::Q5_K), T::Q5_1);
        assert_eq!(f(576, T::Q6_K), T::Q8_0);
        assert_eq!(f(576, T::Q3_K), T::Q4_0);
        assert_eq!(f(576, T::Q2_K), T::Q4_0);
        assert_eq!(f(576, T::IQ4_XS), T::IQ4_NL);
        assert_eq!(f(512, T::Q4_K), T::Q4_K);
        assert_eq!(f(100, T::Q4_K), T::F16);
        assert_eq!(f(100, T::Q8_0), T::F16);
        assert_eq!(f(96, T::Q2_0), T::Q4_0);
        assert!(fallback_type("x", 100, T::Q8_K).is_err());
    }

    #[test]
    fn q4_k_m_attention_v_and_ffn_down_counters() {
        use GgmlType as T;
        let m = smol();
        let p = Params {
            quantize_output_tensor: true,
            ..Params::default()
        };
        let names: Vec<String> = (0..30)
            .flat_map(|i| {
                [
                    format!("blk.{i}.attn_v.weight"),
                    format!("blk.{i}.ffn_down.weight"),
                ]
            })
            .collect();
        let mut r = Recipe::new(&m, &p, Ftype::Q4_K_M, names.iter().map(|s| s.as_str()));
        let mut v = Vec::new();
        let mut d = Vec::new();
        for i in 0..30 {
            v.push(r.choose(&names[2 * i], &[1024, 192], T::F32).unwrap().ty);
            d.push(
                r.choose(&names[2 * i + 1], &[1536, 576], T::F32)
                    .unwrap()
                    .ty,
            );
        }
        // use_more_bits(i, 30): i < 3 || i >= 26 || (i - 3) % 3 == 2
        for i in 0..30 {
            let more = !(3..26).contains(&i) || (i as i32 - 3) % 3 == 2;
            let want = if more { T::Q6_K } else { T::Q4_K };
            assert_eq!(v[i], want, "attn_v {i}");
            assert_eq!(d[i], want, "ffn_down {i}");
        }
    }
}
