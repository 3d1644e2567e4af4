//! The llama architecture (SmolLM2, TinyLlama, Llama-2/3, Mistral) and its qwen2
//! variant, read top to bottom:
//!
//! ```text
//! x = embed(tokens)
//! for each layer:
//!     h = rms_norm(x) * attn_norm
//!     q, k, v = h·Wq (+bq), h·Wk (+bk), h·Wv (+bv)      qwen2 has the biases
//!     q, k = rope(q, pos), rope(k, pos)                  llama: adjacent pairs, qwen2: NEOX halves
//!     cache[seq][pos] = k, v
//!     a = softmax(q·Kᵀ / √d, causal by position) · V     grouped-query: head h reads KV head h / (n_head / n_kv)
//!     x = x + a·Wo
//!     h = rms_norm(x) * ffn_norm
//!     x = x + (silu(h·Wgate) ⊙ h·Wup)·Wdown             SwiGLU
//! logits = rms_norm(x) * output_norm · Woutᵀ            Wout may be tied to the embedding
//! ```

use rustorch_core::kernels::attn::{self, GroupQuery, HeadAttn};
use rustorch_core::kernels::attn_long;
use rustorch_core::kernels::ops::rms_norm;
use rustorch_core::kernels::{
    gexp, isa, matmul, matmul_many, matmul_reference, matmul_swiglu, QActs,
};

use super::{Arch, ForwardOutput, HParams, LayerStat, Loader, ModelError, Runtime, Weight};
use crate::batch::Batch;
use crate::kv_cache::KvCache;

struct Layer {
    attn_norm: Vec<f32>,
    wq: Weight,
    wk: Weight,
    wv: Weight,
    wo: Weight,
    bq: Option<Vec<f32>>,
    bk: Option<Vec<f32>>,
    bv: Option<Vec<f32>>,
    ffn_norm: Vec<f32>,
    w_gate: Weight,
    w_up: Weight,
    w_down: Weight,
}

/// Activation buffers kept between forward calls, so decoding allocates nothing per token
/// besides the returned logits.
#[derive(Default)]
struct Workspace {
    x: Vec<f32>,
    h: Vec<f32>,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    attn: Vec<f32>,
    proj: Vec<f32>,
    gate: Vec<f32>,
    up: Vec<f32>,
    cos: Vec<f32>,
    sin: Vec<f32>,
    cells: Vec<usize>,
    hout: Vec<f32>,
    qa: Vec<QActs>,
}

/// `v` holding exactly `n` values (contents unspecified: every caller overwrites them).
fn resized(v: &mut Vec<f32>, n: usize) -> &mut [f32] {
    v.resize(n, 0.0);
    &mut v[..n]
}

pub(crate) struct Llama {
    ws: std::sync::Mutex<Workspace>,
    tok_embd: Weight,
    layers: Vec<Layer>,
    output_norm: Vec<f32>,
    output: Weight,
    rope_freqs: Option<Vec<f32>>,
}

impl Llama {
    pub fn load(ld: &Loader<'_>, hp: &HParams) -> Result<Self, ModelError> {
        let (e, q, kv, ff) = (hp.n_embd, hp.q_dim(), hp.kv_dim(), hp.n_ff);
        let tok_embd = ld.matrix("token_embd.weight", e, hp.n_vocab)?;
        let output = if ld.has("output.weight") {
            ld.matrix("output.weight", e, hp.n_vocab)?
        } else {
            tok_embd.clone()
        };
        let biased = hp.arch == Arch::Qwen2;
        let mut layers = Vec::with_capacity(hp.n_layer);
        for i in 0..hp.n_layer {
            let n = |s: &str| format!("blk.{i}.{s}");
            let bias = |s: &str, len| {
                if biased {
                    ld.vector(&n(s), len).map(Some)
                } else {
                    ld.optional_vector(&n(s), len)
                }
            };
            layers.push(Layer {
                attn_norm: ld.vector(&n("attn_norm.weight"), e)?,
                wq: ld.matrix(&n("attn_q.weight"), e, q)?,
                wk: ld.matrix(&n("attn_k.weight"), e, kv)?,
                wv: ld.matrix(&n("attn_v.weight"), e, kv)?,
                wo: ld.matrix(&n("attn_output.weight"), q, e)?,
                bq: bias("attn_q.bias", q)?,
                bk: bias("attn_k.bias", kv)?,
                bv: bias("attn_v.bias", kv)?,
                ffn_norm: ld.vector(&n("ffn_norm.weight"), e)?,
                w_gate: ld.matrix(&n("ffn_gate.weight"), e, ff)?,
                w_up: ld.matrix(&n("ffn_up.weight"), e, ff)?,
                w_down: ld.matrix(&n("ffn_down.weight"), ff, e)?,
            });
        }
        Ok(Llama {
            ws: std::sync::Mutex::new(Workspace::default()),
            tok_embd,
            layers,
            output_norm: ld.vector("output_norm.weight", e)?,
            output,
            rope_freqs: ld.optional_vector("rope_freqs.weight", hp.rope.n_rot / 2)?,
        })
    }

    pub fn rope_freqs(&self) -> Option<&[f32]> {
        self.rope_freqs.as_deref()
    }

    pub fn forward(
        &self,
        hp: &HParams,
        bytes: &[u8],
        batch: &Batch,
        cache: &mut KvCache,
        rt: &Runtime,
    ) -> Result<ForwardOutput, ModelError> {
        let n = batch.len();
        let (e, qd, kvd, hd) = (hp.n_embd, hp.q_dim(), hp.kv_dim(), hp.head_dim);
        // Buffers are reused from call to call (a concurrent call gets fresh ones).
        let mut own = None;
        let mut guard = self.ws.try_lock();
        let ws: &mut Workspace = match guard {
            Ok(ref mut g) => g,
            Err(_) => own.insert(Workspace::default()),
        };
        let Workspace {
            x,
            h,
            q,
            k,
            v,
            attn,
            proj,
            gate,
            up,
            cos,
            sin,
            cells,
            hout,
            qa,
        } = ws;
        if qa.is_empty() {
            qa.push(QActs::new());
        }
        let mm = |w: &Weight, x: &[f32], out: &mut [f32], qa: &mut Vec<QActs>| {
            let m = w.view(bytes);
            if rt.reference {
                matmul_reference(&m, x, out)
            } else {
                matmul(&rt.pool, &m, x, out, &mut qa[0])
            }
        };

        // Reserve one cache cell per token, at the position the caller gave.
        cache.check_room(n)?;
        cells.clear();
        cells.extend((0..n).map(|i| cache.add_cell(batch.seq_ids[i], batch.positions[i])));

        // Rotation angles per token.
        let half = hp.rope.n_rot / 2;
        let cos = resized(cos, n * half);
        let sin = resized(sin, n * half);
        for i in 0..n {
            hp.rope.angles(
                batch.positions[i] as f32,
                self.rope_freqs.as_deref(),
                &mut cos[i * half..(i + 1) * half],
                &mut sin[i * half..(i + 1) * half],
            );
        }

        // x = embed(tokens)
        let x = resized(x, n * e);
        let embd = self.tok_embd.view(bytes);
        for (i, &t) in batch.tokens.iter().enumerate() {
            embd.dequantize_row(t as usize, &mut x[i * e..(i + 1) * e])?;
        }

        let h = resized(h, n * e);
        let q = resized(q, n * qd);
        let k = resized(k, n * kvd);
        let v = resized(v, n * kvd);
        let attn = resized(attn, n * qd);
        let proj = resized(proj, n * e);
        let gate = resized(gate, n * hp.n_ff);
        let up = resized(up, n * hp.n_ff);
        // one parallel job for Q/K/V and one for gate/up/SwiGLU (same results as separate calls)
        let fuse = !rt.reference;
        let pool = &rt.pool;
        let mut stats = Vec::new();
        let hook = |name: &str, il: usize, x: &[f32]| {
            if let Some(h) = rt.tensor_hook.as_ref() {
                h(name, il, x);
            }
        };
        hook("embd", 0, x);

        let rows: Vec<usize> = (0..n).filter(|&i| batch.logits[i]).collect();
        // rows carried through the layers (all, except in the last layer; see below)
        let mut nr = n;
        for (il, layer) in self.layers.iter().enumerate() {
            // h = rms_norm(x) * attn_norm
            h.copy_from_slice(x);
            for row in h.chunks_exact_mut(e) {
                rms_norm(row, &layer.attn_norm, hp.rms_eps);
            }
            hook("attn_norm", il, h);
            // q, k, v projections (+ bias)
            if fuse {
                let ws = [
                    layer.wq.view(bytes),
                    layer.wk.view(bytes),
                    layer.wv.view(bytes),
                ];
                matmul_many(pool, &ws, h, &mut [&mut q[..], &mut k[..], &mut v[..]], qa)?;
            } else {
                mm(&layer.wq, h, q, qa)?;
                mm(&layer.wk, h, k, qa)?;
                mm(&layer.wv, h, v, qa)?;
            }
            add_bias(q, layer.bq.as_deref());
            add_bias(k, layer.bk.as_deref());
            add_bias(v, layer.bv.as_deref());
            hook("Qcur", il, q);
            hook("Kcur", il, k);
            hook("Vcur", il, v);
            // rotate q and k by each token's own position
            for i in 0..n {
                let (c, s) = (
                    &cos[i * half..(i + 1) * half],
                    &sin[i * half..(i + 1) * half],
                );
                for head in q[i * qd..(i + 1) * qd].chunks_exact_mut(hd) {
                    hp.rope.apply(head, c, s);
                }
                for head in k[i * kvd..(i + 1) * kvd].chunks_exact_mut(hd) {
                    hp.rope.apply(head, c, s);
                }
            }
            hook("Qcur_rope", il, q);
            hook("Kcur_rope", il, k);
            // store k, v in the cache, then attend
            for i in 0..n {
                cache.write(
                    batch.seq_ids[i],
                    cells[i],
                    il,
                    &k[i * kvd..(i + 1) * kvd],
                    &v[i * kvd..(i + 1) * kvd],
                );
            }
            attention(hp, il, batch, cache, q, attn, rt);
            hook("kqv_out", il, attn);
            // x = x + attn·Wo
            mm(&layer.wo, attn, proj, qa)?;
            hook("attn_out", il, proj);
            // The last layer's output only feeds the logits: like llama.cpp, keep just the
            // rows that want logits from here on (its kernels depend on the row count).
            if il + 1 == self.layers.len() && rows.len() < n {
                for (k, &i) in rows.iter().enumerate() {
                    x.copy_within(i * e..(i + 1) * e, k * e);
                    proj.copy_within(i * e..(i + 1) * e, k * e);
                }
                nr = rows.len();
            }
            let row_index = |k: usize| if nr < n { rows[k] } else { k };
            let (x, h, proj) = (&mut x[..nr * e], &mut h[..nr * e], &mut proj[..nr * e]);
            let (gate, up) = (&mut gate[..nr * hp.n_ff], &mut up[..nr * hp.n_ff]);
            add_into(x, proj);
            hook("ffn_inp", il, x);

            // feed-forward: x = x + (silu(h·Wgate) ⊙ h·Wup)·Wdown
            h.copy_from_slice(x);
            for row in h.chunks_exact_mut(e) {
                rms_norm(row, &layer.ffn_norm, hp.rms_eps);
            }
            hook("ffn_norm", il, h);
            if nr > 0 {
                if fuse && rt.tensor_hook.is_none() {
                    let (wg, wu) = (layer.w_gate.view(bytes), layer.w_up.view(bytes));
                    matmul_swiglu(pool, &wg, &wu, h, gate, up, qa)?;
                } else {
                    mm(&layer.w_gate, h, gate, qa)?;
                    mm(&layer.w_up, h, up, qa)?;
                    hook("ffn_gate", il, gate);
                    hook("ffn_up", il, up);
                    gexp::swiglu(isa(), gate, up, hp.n_ff);
                }
                hook("ffn_swiglu", il, gate);
                mm(&layer.w_down, gate, proj, qa)?;
            }
            hook("ffn_out", il, proj);
            add_into(x, proj);
            hook("l_out", il, x);

            if rt.dump_layers {
                for (k, row) in x.chunks_exact(e).enumerate() {
                    let i = row_index(k);
                    stats.push(layer_stat(il, i, batch.positions[i], row));
                }
            }
        }

        // logits for the tokens that asked for them (row k of `x` is token `rows[k]` when the
        // last layer kept only those rows, token k otherwise)
        hout.clear();
        for (k, &i) in rows.iter().enumerate() {
            let i = if nr < n { k } else { i };
            let start = hout.len();
            hout.extend_from_slice(&x[i * e..(i + 1) * e]);
            rms_norm(&mut hout[start..], &self.output_norm, hp.rms_eps);
        }
        hook("result_norm", 0, hout);
        let mut logits = vec![0f32; rows.len() * hp.n_vocab];
        if !rows.is_empty() {
            mm(&self.output, hout, &mut logits, qa)?;
        }
        hook("result_output", 0, &logits);
        Ok(ForwardOutput {
            logits,
            rows,
            layer_stats: stats,
        })
    }
}

fn add_bias(x: &mut [f32], bias: Option<&[f32]>) {
    if let Some(b) = bias {
        for row in x.chunks_exact_mut(b.len()) {
            add_into(row, b);
        }
    }
}

fn add_into(x: &mut [f32], y: &[f32]) {
    for (a, b) in x.iter_mut().zip(y) {
        *a += *b;
    }
}

fn layer_stat(layer: usize, batch_index: usize, pos: u32, row: &[f32]) -> LayerStat {
    let n = row.len() as f64;
    let sum: f64 = row.iter().map(|&v| v as f64).sum();
    let sq: f64 = row.iter().map(|&v| (v as f64) * (v as f64)).sum();
    LayerStat {
        layer,
        batch_index,
        pos,
        rms: (sq / n).sqrt() as f32,
        mean: (sum / n) as f32,
        max_abs: row.iter().fold(0f32, |m, &v| m.max(v.abs())),
    }
}

#[derive(Clone, Copy)]
struct SendPtr(*mut f32);
unsafe impl Send for SendPtr {}
unsafe impl Sync for SendPtr {}

/// Causal grouped-query attention of every (token, head) against the cache cells of the
/// token's sequence whose position is not after the token's.
///
/// The arithmetic follows llama.cpp's CPU flash attention, which its command-line tools
/// use by default: the query is rounded to f16 for the f16 K·Q product, the softmax is
/// computed online (running max `m`, running sum `s`), and the weighted sum of values is
/// accumulated in an f16 vector, rescaled whenever a new maximum appears.
fn attention(
    hp: &HParams,
    layer: usize,
    batch: &Batch,
    cache: &KvCache,
    q: &[f32],
    out: &mut [f32],
    rt: &Runtime,
) {
    let (hd, qd, kvd) = (hp.head_dim, hp.q_dim(), cache.kv_dim());
    let group = hp.n_head / hp.n_head_kv;
    let scale = 1.0 / (hd as f32).sqrt();
    let n = batch.len();
    let dst = SendPtr(out.as_mut_ptr());
    let isa = rustorch_core::kernels::isa();
    // Queries of one KV head and a run of tokens of one sequence share a task, so keys and
    // values are converted once for all of them; results do not depend on the grouping.
    let per_tile = if n == 1 { 1 } else { (16 / group).max(1) };
    let mut tiles: Vec<(usize, usize)> = Vec::new();
    if n > 1 {
        let mut t0 = 0;
        while t0 < n {
            let mut t1 = t0 + 1;
            while t1 < n && t1 - t0 < per_tile && batch.seq_ids[t1] == batch.seq_ids[t0] {
                t1 += 1;
            }
            tiles.push((t0, t1));
            t0 = t1;
        }
    }
    let (n_tasks, heads_per_task) = if n == 1 {
        (hp.n_head, 1)
    } else {
        (tiles.len() * hp.n_head_kv, group)
    };
    rt.pool.run(n_tasks, &|task| {
        #[allow(clippy::redundant_locals)]
        // capture the whole Send wrapper, not its raw-pointer field
        let dst = dst;
        let (t0, t1, head0) = if n == 1 {
            (0, 1, task)
        } else {
            let (t0, t1) = tiles[task / hp.n_head_kv];
            (t0, t1, (task % hp.n_head_kv) * group)
        };
        let kvh = head0 / group;
        let Some(cells) = cache.seq(batch.seq_ids[t0]) else {
            for t in t0..t1 {
                for head in head0..head0 + heads_per_task {
                    // SAFETY: as below.
                    unsafe { std::slice::from_raw_parts_mut(dst.0.add(t * qd + head * hd), hd) }
                        .fill(0.0);
                }
            }
            return;
        };
        let kv = HeadAttn {
            q: &[],
            k: &cells.k[layer],
            v: &cells.v[layer],
            stride: kvd,
            offset: kvh * hd,
            pos: &cells.pos,
            max_pos: 0,
            scale,
        };
        if n == 1 {
            let o = head0 * hd;
            // SAFETY: each (token, head) output slice belongs to exactly one task.
            let out_head = unsafe { std::slice::from_raw_parts_mut(dst.0.add(o), hd) };
            let mut one = [GroupQuery {
                q: &q[o..o + hd],
                max_pos: batch.positions[0],
                out: out_head,
            }];
            attn::attend_group(isa, &kv, &mut one);
            return;
        }
        let mut queries = Vec::with_capacity((t1 - t0) * heads_per_task);
        for t in t0..t1 {
            for head in head0..head0 + heads_per_task {
                let o = t * qd + head * hd;
                // SAFETY: each (token, head) output slice belongs to exactly one task.
                let out_head = unsafe { std::slice::from_raw_parts_mut(dst.0.add(o), hd) };
                queries.push(GroupQuery {
                    q: &q[o..o + hd],
                    max_pos: batch.positions[t],
                    out: out_head,
                });
            }
        }
        // llama.cpp's flash attention takes its tiled algorithm from 64 query rows on; we
        // count the rows of this sequence only, so that a request's output does not depend
        // on what else shares the batch (for one sequence this is llama.cpp's rule)
        let seq = batch.seq_ids[t0];
        if batch.seq_ids.iter().filter(|&&s| s == seq).count() >= 64 {
            attn_long::attend_group(isa, &kv, &mut queries);
        } else {
            attn::attend_group(isa, &kv, &mut queries);
        }
    });
}
