// Decode attention over an f16 K/V cache (flash-attention style: one pass, online softmax).
//
// The cache is a pool of slots per layer: slot j's key for all KV heads is kv_stride halves
// at K + j * kv_stride (V likewise). Each query row t reads the cells of its sequence:
// `rows[3t..3t+3]` = { slots (u32 per cell; 0 = cell c is slot c), positions (u32 per
// cell), n_cells | max_pos << 32 }. These descriptors do not depend on the layer, so a
// forward call uploads them once. Query head h reads KV head h / (n_head / n_head_kv). A
// cell is visible when min_pos <= pos <= max_pos, min_pos = max_pos + 1 - window (0 when
// window is 0 or reaches past position 0).
//
// The cells of a row are split into n_split contiguous ranges (grid z); each block of
// ATTN_WARPS warps walks its range in passes of ATTN_WARPS * G cells loaded at once (G
// cells per warp, see attn_split), keeping running maxima m, sums s and unnormalized
// outputs. With one split the block writes the output; otherwise it writes (acc[hd], m, s)
// to `part` and attn_combine merges the splits. With `quant` (hd a multiple of 32) the
// output rows are also quantized into (aq, ads) for the product that follows, as
// quantize_q8_1 does.

#ifndef ATTN_WARPS
#define ATTN_WARPS 4
#endif

// Rotates the head a warp holds (lane's elements lane*E .. lane*E+E-1) by one row's RoPE
// angles (cs/sn: n_rot / 2 per row), with rope_kv_write's arithmetic: pairs (2i, 2i + 1), or
// with neox (i, i + n_rot / 2), the partner then fetched from the lane n_rot / 2 / E away
// (the host checks that n_rot / 2 is a multiple of E). Elements from n_rot on stay.
template <int E>
__device__ __forceinline__ void rope_lane(float (&x)[E], int lane, const float *__restrict__ cs,
                                          const float *__restrict__ sn, int n_rot, int neox) {
    const int half = n_rot / 2;
    if (!neox) {
#pragma unroll
        for (int e = 0; e < E; e += 2) {
            const int i0 = lane * E + e;
            if (i0 + 1 < n_rot) {
                const float c = cs[i0 / 2], sv = sn[i0 / 2];
                const float x0 = x[e], x1 = x[e + 1];
                x[e] = __fmaf_rn(x0, c, -__fmul_rn(x1, sv));
                x[e + 1] = __fmaf_rn(x0, sv, __fmul_rn(x1, c));
            }
        }
        return;
    }
    const int dl = half / E;
    const int i0 = lane * E;
    const int src = i0 < half ? lane + dl : (i0 < n_rot ? lane - dl : lane);
#pragma unroll
    for (int e = 0; e < E; e++) {
        const float other = __shfl_sync(FULL_MASK, x[e], src & 31);
        const int i = i0 + e;
        if (i < half) {
            const float c = cs[i], sv = sn[i];
            x[e] = __fmaf_rn(x[e], c, -__fmul_rn(other, sv));
        } else if (i < n_rot) {
            const float c = cs[i - half], sv = sn[i - half];
            x[e] = __fmaf_rn(other, sv, __fmul_rn(x[e], c));
        }
    }
}

// ROPE (one query row, t = 0): q and the row's new k arrive unrotated, with k and v not yet
// in the cache (the work of rope_kv_write, done here): each block rotates its query head
// and its KV head's new key itself (warp 0, into shared memory), the first query head of
// each KV head (split 0) stores the new key and value in slot new_slot[0], and every block
// takes that cell's key and value from shared memory (rounded to f16, as stored) instead
// of the cache. The other cells, the descriptors and new_slot were all written before
// this step's kernels, so a ROPE block loads its first cells before the PDL wait.
struct AttnRope {
    const float *k, *v, *cs, *sn;
    u16 *K, *V;  // the cache, writable
    const u32 *new_slot;
    int n_rot, neox;
};

// Query row t's cells: slots, positions, count and the visible positions min_pos..max_pos.
struct AttnCells {
    const u32 *SL, *P;
    int nc;
    u32 max_pos, min_pos;
};

__device__ __forceinline__ AttnCells attn_cells(const u64 *rows, int t, u32 window) {
    const u64 *r = rows + 3 * (size_t)t;
    AttnCells c;
    c.SL = (const u32 *)r[0];
    c.P = (const u32 *)r[1];
    c.nc = (int)(r[2] & 0xffffffffull);
    c.max_pos = (u32)(r[2] >> 32);
    c.min_pos = (window != 0 && c.max_pos + 1 > window) ? c.max_pos + 1 - window : 0;
    return c;
}

// A lane's 8 halves i0 .. i0+7 of an f16 row (0 past hd): one 16-byte load when `vec`
// (hd and the row stride multiples of 8, rows 16-byte aligned).
__device__ __forceinline__ uint4 load8h(const u16 *row, int i0, int hd, bool vec) {
    if (vec) return i0 < hd ? *(const uint4 *)(row + i0) : make_uint4(0, 0, 0, 0);
    u32 w[4];
#pragma unroll
    for (int k = 0; k < 4; k++) {
        const int i = i0 + 2 * k;
        const u32 lo = i < hd ? row[i] : 0, hi = i + 1 < hd ? row[i + 1] : 0;
        w[k] = lo | (hi << 16);
    }
    return make_uint4(w[0], w[1], w[2], w[3]);
}

__device__ __forceinline__ void unpack8h(uint4 x, float (&f)[8]) {
    const u32 w[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
    for (int j = 0; j < 4; j++) {
        f[2 * j] = h2f((u16)(w[j] & 0xffff));
        f[2 * j + 1] = h2f((u16)(w[j] >> 16));
    }
}

// Block (head h, row t, split sp) over the split's cells. A cell's key and value are read
// by LPC = 4E lanes, 8 halves each, so a warp takes G = 32 / LPC cells at once and the
// block ATTN_WARPS * G: every cell of a pass is loaded at the same time (the next pass's
// loads are issued before the current pass is used). Each lane group keeps a running max
// m, sum s and unnormalized output for its cells; the groups of a warp merge by shuffles,
// the warps through shared memory.
template <int E, bool ROPE>
__device__ __forceinline__ void attn_split(const float *__restrict__ q, const u64 *__restrict__ rows,
                                           const u16 *__restrict__ K, const u16 *__restrict__ V,
                                           float *__restrict__ part, float *__restrict__ out,
                                           int n_head, int n_head_kv, int hd, int kv_stride,
                                           float scale, float softcap, u32 window, int n_split,
                                           i8 *__restrict__ aq, float2 *__restrict__ ads,
                                           int quant, int cpu, const AttnRope &ar) {
    constexpr int LPC = 4 * E, G = 32 / LPC, HD = 32 * E, STEP = ATTN_WARPS * G;
    __shared__ float sm_m[ATTN_WARPS], sm_s[ATTN_WARPS];
    __shared__ float sm_acc[ATTN_WARPS][HD];
    __shared__ float sm_q[HD];
    __shared__ __align__(16) u16 sm_kn[HD], sm_vn[HD];
    if (!ROPE) PDL_ENTRY();
    const int h = blockIdx.x, t = blockIdx.y, sp = blockIdx.z;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane / LPC, i0 = (lane % LPC) * 8;
    const AttnCells cells = attn_cells(rows, t, window);
    const u32 *SL = cells.SL, *P = cells.P;
    const int nc = cells.nc;
    const u32 max_pos = cells.max_pos, min_pos = cells.min_pos;
    const int kvh = h / (n_head / n_head_kv);
    const int chunk = (nc + n_split - 1) / n_split;
    const int c0 = sp * chunk;
    const int c1 = min(nc, c0 + chunk);
    const bool vec = (hd % 8) == 0 && (kv_stride % 8) == 0;
    const u16 *Kh = K + (size_t)kvh * hd, *Vh = V + (size_t)kvh * hd;
    const size_t jnew = ROPE ? (size_t)ar.new_slot[0] : ~(size_t)0;

    // this lane group's first cell (with ROPE, before the wait)
    int c = c0 + warp * G + g;
    bool have = c < c1, isnew = false;
    u32 p = 0;
    uint4 kr = make_uint4(0, 0, 0, 0), vr = kr;
    if (have) {
        p = P[c];
        const size_t j = SL ? SL[c] : (u32)c;
        isnew = j == jnew;
        if (!isnew) {
            kr = load8h(Kh + j * kv_stride, i0, hd, vec);
            vr = load8h(Vh + j * kv_stride, i0, hd, vec);
        }
    }
    float q8[8];
    if (ROPE) {
        PDL_ENTRY();
        if (warp == 0) {
            float qr[E], kn[E], vn[E];
            const float *qh = q + ((size_t)t * n_head + h) * hd;
            const float *kh = ar.k + (size_t)kvh * hd, *vh = ar.v + (size_t)kvh * hd;
#pragma unroll
            for (int e = 0; e < E; e++) {
                const int i = lane * E + e;
                qr[e] = i < hd ? qh[i] : 0.0f;
                kn[e] = i < hd ? kh[i] : 0.0f;
                vn[e] = i < hd ? vh[i] : 0.0f;
            }
            rope_lane<E>(qr, lane, ar.cs, ar.sn, ar.n_rot, ar.neox);
            rope_lane<E>(kn, lane, ar.cs, ar.sn, ar.n_rot, ar.neox);
            const bool store = sp == 0 && h % (n_head / n_head_kv) == 0;
#pragma unroll
            for (int e = 0; e < E; e++) {
                const int i = lane * E + e;
                const u16 kb = f2h(kn[e]), vb = f2h(vn[e]);
                if (store && i < hd) {
                    ar.K[jnew * kv_stride + (size_t)kvh * hd + i] = kb;
                    ar.V[jnew * kv_stride + (size_t)kvh * hd + i] = vb;
                }
                sm_q[i] = i < hd ? h2f(f2h(qr[e])) : 0.0f;
                sm_kn[i] = i < hd ? kb : (u16)0;
                sm_vn[i] = i < hd ? vb : (u16)0;
            }
        }
        __syncthreads();
#pragma unroll
        for (int e = 0; e < 8; e++) q8[e] = sm_q[i0 + e];
    } else {
        // the query rounded to f16, as the CPU's f16 K.Q product takes it
        const float *qh = q + ((size_t)t * n_head + h) * hd;
#pragma unroll
        for (int e = 0; e < 8; e++) q8[e] = i0 + e < hd ? h2f(f2h(qh[i0 + e])) : 0.0f;
    }

    float m = NEG_INF, s = 0.0f, acc[8];
#pragma unroll
    for (int e = 0; e < 8; e++) acc[e] = 0.0f;
    // the loop runs while the warp has a cell (shuffles need the whole warp)
    for (int cw = c0 + warp * G; cw < c1; cw += STEP) {
        const int cn = c + STEP;
        const bool hn = cn < c1;
        bool nnew = false;
        u32 pn = 0;
        uint4 kn = make_uint4(0, 0, 0, 0), vn = kn;
        if (hn) {
            pn = P[cn];
            const size_t j = SL ? SL[cn] : (u32)cn;
            nnew = j == jnew;
            if (!nnew) {
                kn = load8h(Kh + j * kv_stride, i0, hd, vec);
                vn = load8h(Vh + j * kv_stride, i0, hd, vec);
            }
        }
        if (ROPE && isnew) {
            kr = *(const uint4 *)(sm_kn + i0);
            vr = *(const uint4 *)(sm_vn + i0);
        }
        float f[8];
        unpack8h(kr, f);
        float dot = 0.0f;
#pragma unroll
        for (int e = 0; e < 8; e++) dot = __fmaf_rn(q8[e], f[e], dot);
#pragma unroll
        for (int o = LPC / 2; o > 0; o >>= 1) dot += __shfl_xor_sync(FULL_MASK, dot, o);
        if (have && p <= max_pos && p >= min_pos) {
            float sc = dot * scale;
            if (softcap != 0.0f) sc = softcap * tanhf(sc / softcap);
            const float mn = fmaxf(m, sc);
            const float corr = expf(m - mn);
            const float pw = expf(sc - mn);
            s = s * corr + pw;
            unpack8h(vr, f);
#pragma unroll
            for (int e = 0; e < 8; e++) acc[e] = acc[e] * corr + pw * f[e];
            m = mn;
        }
        c = cn;
        have = hn;
        isnew = nnew;
        p = pn;
        kr = kn;
        vr = vn;
    }
    // the warp's lane groups merged
#pragma unroll
    for (int o = LPC; o < 32; o <<= 1) {
        const float mo = __shfl_xor_sync(FULL_MASK, m, o);
        const float so = __shfl_xor_sync(FULL_MASK, s, o);
        const float M = fmaxf(m, mo);
        const float wa = s > 0.0f ? expf(m - M) : 0.0f;
        const float wb = so > 0.0f ? expf(mo - M) : 0.0f;
        s = s * wa + so * wb;
#pragma unroll
        for (int e = 0; e < 8; e++) acc[e] = acc[e] * wa + __shfl_xor_sync(FULL_MASK, acc[e], o) * wb;
        m = M;
    }

    if (lane == 0) {
        sm_m[warp] = m;
        sm_s[warp] = s;
    }
    if (g == 0) {
#pragma unroll
        for (int e = 0; e < 8; e++) sm_acc[warp][i0 + e] = acc[e];
    }
    __syncthreads();

    float M = NEG_INF;
#pragma unroll
    for (int w = 0; w < ATTN_WARPS; w++)
        if (sm_s[w] > 0.0f) M = fmaxf(M, sm_m[w]);
    float S = 0.0f;
    float wt[ATTN_WARPS];
#pragma unroll
    for (int w = 0; w < ATTN_WARPS; w++) {
        wt[w] = sm_s[w] > 0.0f ? expf(sm_m[w] - M) : 0.0f;
        S += sm_s[w] * wt[w];
    }
    const size_t o = ((size_t)t * n_head + h) * hd;
    if (n_split == 1) {
        const float inv = S > 0.0f ? 1.0f / S : 0.0f;
        for (int i = threadIdx.x; i < hd; i += blockDim.x) {
            float a = 0.0f;
#pragma unroll
            for (int w = 0; w < ATTN_WARPS; w++) a += sm_acc[w][i] * wt[w];
            out[o + i] = a * inv;
            if (quant) quantize_lane(a * inv, aq, o + i, &ads[(o + i) >> 5], cpu);
        }
    } else {
        float *pp = part + (((size_t)t * n_head + h) * n_split + sp) * (hd + 2);
        for (int i = threadIdx.x; i < hd; i += blockDim.x) {
            float a = 0.0f;
#pragma unroll
            for (int w = 0; w < ATTN_WARPS; w++) a += sm_acc[w][i] * wt[w];
            pp[i] = a;
        }
        if (threadIdx.x == 0) {
            pp[hd] = M;
            pp[hd + 1] = S;
        }
    }
}

#define ATTN_KERNEL(E)                                                                        \
    extern "C" __global__ void __launch_bounds__(ATTN_WARPS * 32)                            \
        attn_split_##E(const float *q, const u64 *rows, const u16 *K, const u16 *V,          \
                       float *part, float *out, int n_head, int n_head_kv, int hd,           \
                       int kv_stride, float scale, float softcap, u32 window, int n_split,   \
                       i8 *aq, float2 *ads, int quant, int cpu) {                            \
        PDL_ENTRY_INSIDE();                                                                  \
        const AttnRope none = {};                                                            \
        attn_split<E, false>(q, rows, K, V, part, out, n_head, n_head_kv, hd, kv_stride,     \
                             scale, softcap, window, n_split, aq, ads, quant, cpu, none);    \
    }                                                                                        \
    extern "C" __global__ void __launch_bounds__(ATTN_WARPS * 32)                            \
        attn_rope_##E(const float *q, const u64 *rows, const u16 *K, const u16 *V,           \
                      float *part, float *out, int n_head, int n_head_kv, int hd,            \
                      int kv_stride, float scale, float softcap, u32 window, int n_split,    \
                      i8 *aq, float2 *ads, int quant, int cpu, AttnRope ar) {                \
        PDL_ENTRY_INSIDE();                                                                  \
        attn_split<E, true>(q, rows, K, V, part, out, n_head, n_head_kv, hd, kv_stride,      \
                            scale, softcap, window, n_split, aq, ads, quant, cpu, ar);       \
    }

ATTN_KERNEL(2)
ATTN_KERNEL(4)
ATTN_KERNEL(8)

// Merges the n_split partial results of each (row, head): grid (n_head, n_rows, hd /
// blockDim rounded up), one output element per thread.
extern "C" __global__ void attn_combine(const float *__restrict__ part, float *__restrict__ out,
                                        int n_head, int hd, int n_split, i8 *__restrict__ aq,
                                        float2 *__restrict__ ads, int quant, int cpu) {
    PDL_ENTRY();
    const int h = blockIdx.x, t = blockIdx.y;
    const float *pp = part + ((size_t)t * n_head + h) * n_split * (hd + 2);
    float M = NEG_INF;
    for (int j = 0; j < n_split; j++) {
        const float *pj = pp + (size_t)j * (hd + 2);
        if (pj[hd + 1] > 0.0f) M = fmaxf(M, pj[hd]);
    }
    float S = 0.0f;
    for (int j = 0; j < n_split; j++) {
        const float *pj = pp + (size_t)j * (hd + 2);
        if (pj[hd + 1] > 0.0f) S += pj[hd + 1] * expf(pj[hd] - M);
    }
    const float inv = S > 0.0f ? 1.0f / S : 0.0f;
    const size_t o = ((size_t)t * n_head + h) * hd;
    const int i = blockIdx.z * blockDim.x + threadIdx.x;
    if (i < hd) {
        float a = 0.0f;
        for (int j = 0; j < n_split; j++) {
            const float *pj = pp + (size_t)j * (hd + 2);
            if (pj[hd + 1] > 0.0f) a += pj[i] * expf(pj[hd] - M);
        }
        out[o + i] = a * inv;
        if (quant) quantize_lane(a * inv, aq, o + i, &ads[(o + i) >> 5], cpu);
    }
}

// ---------------------------------------------------------------------------------------
// Attention with the CPU backend's arithmetic (llama.cpp's CPU flash attention, see
// rustorch-core kernels/attn.rs; RUSTORCH_CUDA_ATTN=cpu and exact mode): the score is the
// f16 dot product summed in the CPU's order (four 16-lane accumulators over blocks of 64,
// reduced (a0 + a2) + (a1 + a3), lanes l + 8, l + 4, then (u0 + u2) + (u1 + u3), leftovers
// added in f64), times `scale` (already divided by `softcap` when capping); the online
// softmax rescales on a new maximum (glibc's expf); the value accumulator is an f16 vector
// rounded after every update (f32 fused multiply-add then f16; with `native`, elements
// below the last multiple of 128 are rounded once from the exact value with the weight
// rounded to f16, as AVX512-FP16 builds do).

// f64 to f16 with one rounding: round to odd into f32, then to nearest even.
__device__ __forceinline__ u16 f64_to_f16(double x) {
    float f = __double2float_rn(x);
    if (isfinite(f) && (double)f != x) {
        u32 b = __float_as_uint(f);
        if (fabs((double)f) > fabs(x)) b -= 1;
        f = __uint_as_float(b | 1u);
    }
    return f2h(f);
}


// ---------------------------------------------------------------------------------------
// attn_exact: that arithmetic, bit for bit, with the independent parts in parallel. Per
// (head, row) block, in chunks of at most AE_KV / hd cells (AE_CELLS at most):
//   0. the chunk's slots and positions, then its keys and values into shared memory, every
//      load of the chunk in flight together (16 bytes a load where the rows allow).
//   1. every visible cell's score, four threads per cell: the four running sums of elements
//      64b + 16k + l (k = 0..3) of each of the CPU's 16 lanes l, then (a0 + a2) + (a1 + a3)
//      per lane, then the lane tree of _mm512_reduce_add_ps; leftovers past a multiple of 64
//      added in f64; times `scale`. Thread j of a cell has lanes j, j + 4, j + 8, j + 12,
//      so the tree's first two levels are its own and the last two are shuffles; the keys
//      (and the query) are staged with each thread's values in one run (kperm). (A
//      half-warp per cell, the CPU's lanes in its lanes, took 3.4k cycles at 64 cells and
//      5.7k at 130; a thread per cell about 1.8k at either: docs/performance.md, session
//      21; four threads: session 23.)
//   2. the running maximum before each cell (a block-wide scan of maxima, a thread per cell;
//      exact), hence each cell's rescale ms and weight vs exactly as the sequential walk
//      finds them: a new maximum gives ms = expf(m - s), vs = 1, otherwise ms = 1,
//      vs = expf(s - m) (glibc's expf); masked cells ms = 1, vs = 0 (skipped). A bit per
//      cell marks the odd ones: ms != 1 or vs = 0.
//   3. the chains that must stay sequential: each dimension's f16 accumulator (one thread per
//      dimension, cells in order, values from shared memory) and the running sum
//      S = fma(S, ms, vs) (the last warp). A dimension's step is acc = f16(f16(acc * ms) +
//      v * vs) with one fused multiply-add; with ms = 1 the scaling gives acc back to the bit
//      (acc is an f16 value), so eight cells none of which is odd take only
//      acc = f16(v * vs + acc). The loop is bound by the instructions it issues, so each
//      dimension's values are staged transposed (vat) and read eight cells a load
//      (docs/performance.md, session 23).
// The running maximum, sum and accumulators carry from chunk to chunk. Then out = acc *
// (1 / S), quantized for the next product with `quant` (as quantize_q8_1, the CPU's rule).
// Grid (n_head, n_rows), AE_THREADS threads, head size <= 256. With `rope` (one row):
// rope_kv_write's work inside, as attn_rope does (q and the new k rotated here, stored by
// each KV head's first query head; every block takes the new cell's key and value from its
// own rotation, not from the cache); and as there, every other cell, the descriptors and
// the new cell's slot were written before this step's kernels, so the first chunk is
// loaded before the wait for the kernel before (the Q/K/V product).

#ifndef AE_THREADS
#define AE_THREADS 288
#endif
#define AE_CELLS 256
#define AE_KV 8192
static_assert(AE_CELLS <= AE_THREADS, "a thread scans one cell at most");
static_assert(AE_THREADS >= 288 && AE_THREADS % 32 == 0,
              "the dimensions' chains (up to 256) and the sum's warp after them");

// (AE_MINB: blocks a multiprocessor the compiler keeps registers for; 1 (128 registers) is
// faster than 2 (96). Timing only, `RUSTORCH_CUDA_DEFS=AE_PHASES`: block (0, 0)'s thread 0
// prints the cycles of each phase, a line per launch.)
#ifndef AE_MINB
#define AE_MINB 1
#endif
extern "C" __global__ void __launch_bounds__(AE_THREADS, AE_MINB)
    attn_exact(const float *__restrict__ q, const u64 *__restrict__ rows,
               const u16 *__restrict__ K, const u16 *__restrict__ V, float *__restrict__ out,
               int n_head, int n_head_kv, int hd, int kv_stride, float scale, float softcap,
               u32 window, int native, i8 *__restrict__ aq, float2 *__restrict__ ads,
               int quant, int rope, AttnRope ar) {
    PDL_ENTRY_INSIDE();
    __shared__ __align__(16) float qs[272];  // (qperm: four segments, 4 apart)
    // the chunk's keys, cell after cell, in rows of ks = hd + 8 values where hd is a multiple
    // of 8 (a thread's 16-byte loads of a row; consecutive cells in different banks)
    __shared__ __align__(16) u16 kst[AE_KV + 8 * AE_CELLS];
    // and values, transposed (vat: rows of CH + 8 for head sizes up to 256)
    __shared__ __align__(16) u16 vst[AE_KV + 8 * 256];
    __shared__ float ssh[AE_CELLS];           // scores
    __shared__ __align__(16) float2 mv[AE_CELLS];  // (ms, vs) per cell
    __shared__ u32 slot[AE_CELLS];
    __shared__ u32 spos[AE_CELLS];
    __shared__ float wmax[AE_THREADS / 32];
    __shared__ u32 rsc[AE_THREADS / 32];      // the cells whose chain step rescales, a bit each
    __shared__ float Ssh;
    __shared__ int cnew;                      // the new cell's index in the chunk, or -1
    __shared__ u16 knew[256], vnew[256];      // its key and value, from this block's rotation
    // expf_glibc's table (its constant-memory copy serializes a warp's different entries;
    // AE_EXPTAB_CONST, for comparisons: read from there)
    __shared__ u64 etab[32];
#ifdef AE_EXPTAB_CONST
#define AE_TAB ConstTab()
#else
#define AE_TAB (CopyTab{etab})
#endif
#ifdef AE_PHASES
    // timing only: block (0, 0)'s thread 0 prints its phases' cycles (entry, first chunk
    // loaded, wait passed + rotation, scores, scan, chains, output)
    long long ph[8] = {0, 0, 0, 0, 0, 0, 0, 0};
#define AE_PH(i) (ph[i] = clock64())
#else
#define AE_PH(i) ((void)0)
#endif
    AE_PH(0);
    if (!rope) PDL_ENTRY();
    const int h = blockIdx.x, t = blockIdx.y, tid = threadIdx.x;
    if (tid < 32) etab[tid] = EXP2F_TAB[tid];  // (read after load_cells' barriers)
    const int lane = tid & 31, warp = tid >> 5;
    const AttnCells cells = attn_cells(rows, t, window);
    const u32 *SL = cells.SL, *P = cells.P;
    const int nc = cells.nc;
    const u32 max_pos = cells.max_pos, min_pos = cells.min_pos;
    const int kvh = h / (n_head / n_head_kv);
    // values summed in the CPU's 64-wide steps (np, nb of them), natively in f16 (npn)
    const int np = hd & ~63, nb = np / 64, npn = native ? (hd & ~127) : 0;
    const float *qh = q + ((size_t)t * n_head + h) * hd;
    const u32 jnew = rope ? ar.new_slot[0] : 0xffffffffu;
    const u16 *Kh = K + (size_t)kvh * hd, *Vh = V + (size_t)kvh * hd;
    // cells per chunk: a multiple of 64, or 32 (head sizes above 128); the chains take
    // eight at a time
    const int ch0 = min(AE_CELLS, AE_KV / hd);
    const int CH = ch0 >= 64 ? ch0 & ~63 : 32;
    // dimension d's values of the chunk in row d of vst, the groups of eight cells in an
    // order of their own (group g at g ^ (d / 8 % 8)), so that the staging's stores of
    // eight dimensions of a cell go to other banks; a row's 16-byte loads of eight cells
    // (vs_ = CH + 8 apart) to other banks than the next rows'
    const int vs_ = CH + 8, vm = min(CH, 64) / 8 - 1;
    auto vat = [&](int d, int c) { return d * vs_ + (c ^ (8 * ((d >> 3) & vm))); };
    const bool vec = (hd % 8) == 0 && (kv_stride % 8) == 0;
    const int ks = (hd % 8) == 0 ? hd + 8 : hd;  // key row stride in kst
    // A key row's first np values are stored in four segments of seg = np / 4: segment j
    // holds the values 4i + j (the CPU's lanes j, j + 4, j + 8, j + 12 of every 16), so the
    // cell's thread j reads its values in one run; the rest stay in place. The query the
    // same way in qs, its segments seg + 4 apart (their 16-byte loads in other banks).
    const int seg = np >> 2;
    auto kperm = [&](int e) { return e < np ? (e & 3) * seg + (e >> 2) : e; };
    auto qperm = [&](int e) { return e < np ? (e & 3) * (seg + 4) + (e >> 2) : 4 * (seg + 4) + e - np; };
    // The new cell (chunk index c) from this block's rotation, its value i: the cache's
    // copy is written by another block, and the first chunk was loaded before it.
    auto put_new = [&](int c, int i, u16 kb, u16 vb) {
        kst[c * ks + kperm(i)] = kb;
        vst[vat(i, c)] = vb;
    };
    // 0. the chunk's slots and positions; then (after a barrier) its keys and values
    auto load_cells = [&](int c0, int n) {
        if (tid == 0) cnew = -1;
        __syncthreads();  // (the last chunk's cells read by every thread)
        for (int ci = tid; ci < n; ci += AE_THREADS) {
            const u32 sl = SL ? SL[c0 + ci] : (u32)(c0 + ci);
            slot[ci] = sl;
            spos[ci] = P[c0 + ci];
            if (sl == jnew) cnew = ci;
        }
        __syncthreads();
    };
    auto load_kv = [&](int n) {
        if (vec) {
            const int pc = hd >> 3, tot = n * pc;
            for (int i0 = tid; i0 < tot; i0 += 4 * AE_THREADS) {
                uint4 kr[4], vr[4];
#pragma unroll
                for (int u = 0; u < 4; u++) {
                    const int i = i0 + u * AE_THREADS;
                    if (i < tot) {
                        const int c = i / pc, e = i - c * pc;
                        const size_t off = (size_t)slot[c] * kv_stride + 8 * e;
                        kr[u] = *(const uint4 *)(Kh + off);
                        vr[u] = *(const uint4 *)(Vh + off);
                    }
                }
#pragma unroll
                for (int u = 0; u < 4; u++) {
                    const int i = i0 + u * AE_THREADS;
                    if (i < tot) {
                        const int c = i / pc, e = i - c * pc;
                        if (8 * e < np) {
                            // elements 8e + jj and 8e + jj + 4 to segment jj, places 2e, 2e + 1
                            const u32 w[4] = {kr[u].x, kr[u].y, kr[u].z, kr[u].w};
                            u32 *kw = (u32 *)(kst + c * ks) + e;
#pragma unroll
                            for (int jj = 0; jj < 4; jj++) {
                                const u32 lo = jj & 1 ? w[jj >> 1] >> 16 : w[jj >> 1] & 0xffffu;
                                const u32 hi =
                                    jj & 1 ? w[2 + (jj >> 1)] >> 16 : w[2 + (jj >> 1)] & 0xffffu;
                                kw[jj * (seg >> 1)] = lo | (hi << 16);
                            }
                        } else {
                            ((uint4 *)kst)[c * (ks >> 3) + e] = kr[u];
                        }
                        const u32 vw[4] = {vr[u].x, vr[u].y, vr[u].z, vr[u].w};
#pragma unroll
                        for (int t = 0; t < 8; t++)
                            vst[vat(8 * e + t, c)] = (u16)(vw[t >> 1] >> (16 * (t & 1)));
                    }
                }
            }
        } else {
            for (int i = tid; i < n * hd; i += AE_THREADS) {
                const int c = i / hd, e = i - c * hd;
                const size_t off = (size_t)slot[c] * kv_stride + e;
                kst[c * ks + kperm(e)] = Kh[off];
                vst[vat(e, c)] = Vh[off];
            }
        }
    };
    load_cells(0, min(CH, nc));
    load_kv(min(CH, nc));
    AE_PH(1);
    if (rope) {
        __syncthreads();  // (the first chunk staged: its new cell is overwritten below)
        PDL_ENTRY();
        AE_PH(2);
        const float *kh = ar.k + (size_t)kvh * hd, *vh = ar.v + (size_t)kvh * hd;
        const int half = ar.n_rot / 2;
        const bool store = h % (n_head / n_head_kv) == 0;
        const int c_new = cnew;
        for (int i = tid; i < hd; i += AE_THREADS) {
            float qv = qh[i], kv = kh[i];
            if (i < ar.n_rot) {
                const int pi = ar.neox ? (i < half ? i : i - half) : i / 2;
                const int i0 = ar.neox ? pi : 2 * pi, i1 = ar.neox ? pi + half : 2 * pi + 1;
                const float c = ar.cs[pi], sn = ar.sn[pi];
                const float q0 = qh[i0], q1 = qh[i1], k0 = kh[i0], k1 = kh[i1];
                qv = i == i0 ? __fmaf_rn(q0, c, -__fmul_rn(q1, sn)) : __fmaf_rn(q0, sn, __fmul_rn(q1, c));
                kv = i == i0 ? __fmaf_rn(k0, c, -__fmul_rn(k1, sn)) : __fmaf_rn(k0, sn, __fmul_rn(k1, c));
            }
            qs[qperm(i)] = h2f(f2h(qv));
            const u16 kb = f2h(kv), vb = f2h(vh[i]);
            knew[i] = kb;
            vnew[i] = vb;
            if (c_new >= 0) put_new(c_new, i, kb, vb);
            if (store) {
                ar.K[(size_t)jnew * kv_stride + (size_t)kvh * hd + i] = kb;
                ar.V[(size_t)jnew * kv_stride + (size_t)kvh * hd + i] = vb;
            }
        }
    } else {
        for (int i = tid; i < hd; i += AE_THREADS) qs[qperm(i)] = h2f(f2h(qh[i]));
    }
    __syncthreads();
    AE_PH(3);
    float acc = 0.0f;     // dimension tid
    float M = NEG_INF;    // the maximum over earlier chunks
    float S = 0.0f;       // (the last warp's lane 0)
    const bool fast = tid < hd && tid >= npn;  // a dimension rounded from f32 each step
    for (int c0 = 0; c0 < nc; c0 += CH) {
        const int n = min(CH, nc - c0);
        if (c0 > 0) {
            load_cells(c0, n);
            load_kv(n);
            __syncthreads();
            if (cnew >= 0 && tid < hd) put_new(cnew, tid, knew[tid], vnew[tid]);
            __syncthreads();
        }
        // 1. scores
#ifdef AE_SKIP_SCORES
        for (int ci = tid; ci < n; ci += AE_THREADS) ssh[ci] = -(float)ci;  // timing only
        if (0)
#endif
        for (int it = tid; it < 4 * n; it += AE_THREADS) {
            // four threads j = 0..3 per cell (a cell's four in one warp, all in the loop
            // or none: AE_THREADS is a multiple of 32); thread j has the CPU's lanes
            // 4m + j (m = 0..3): their running sums a[k][m] over elements 64b + 16k + 4m + j
            const int ci = it >> 2, j = it & 3;
            const u32 p = spos[ci];
            float s = NEG_INF;
            if (p <= max_pos && p >= min_pos) {
                const u16 *kr = kst + (size_t)ci * ks;
                const float *qj = qs + j * (seg + 4);
                float a[4][4];
#pragma unroll
                for (int k = 0; k < 4; k++)
#pragma unroll
                    for (int m = 0; m < 4; m++) a[k][m] = 0.0f;
                for (int b = 0; b < nb; b++) {
                    float kf[16];
                    unpack8h(load8h(kr, j * seg + 16 * b, hd, ks != hd), *(float(*)[8])kf);
                    unpack8h(load8h(kr, j * seg + 16 * b + 8, hd, ks != hd),
                             *(float(*)[8])(kf + 8));
#pragma unroll
                    for (int k = 0; k < 4; k++) {
                        const float4 q4 = *(const float4 *)(qj + 16 * b + 4 * k);
                        const float qv[4] = {q4.x, q4.y, q4.z, q4.w};
#pragma unroll
                        for (int m = 0; m < 4; m++)
                            a[k][m] = __fadd_rn(a[k][m], __fmul_rn(qv[m], kf[4 * k + m]));
                    }
                }
                // lane 4m + j: (a0 + a2) + (a1 + a3); lanes j + (j + 8) and (j + 4) +
                // (j + 12), their sum (the tree's l + 8, l + 4); then over the four
                // threads (u0 + u2) + (u1 + u3) by two shuffles (x + y is y + x)
                float L[4];
#pragma unroll
                for (int m = 0; m < 4; m++)
                    L[m] = __fadd_rn(__fadd_rn(a[0][m], a[2][m]), __fadd_rn(a[1][m], a[3][m]));
                const float w4 = __fadd_rn(__fadd_rn(L[0], L[2]), __fadd_rn(L[1], L[3]));
                const u32 gm = 0xfu << (lane & ~3);
                const float u2 = __fadd_rn(w4, __shfl_xor_sync(gm, w4, 2));
                double sum = (double)__fadd_rn(u2, __shfl_xor_sync(gm, u2, 1));
                for (int i = np; i < hd; i++)
                    sum += (double)__fmul_rn(qs[qperm(i)], h2f(kr[i]));
                s = __fmul_rn((float)sum, scale);
                if (softcap != 0.0f) s = __fmul_rn(softcap, tanhf(s));
            }
            if (j == 0) ssh[ci] = s;
        }
        __syncthreads();
        // 2. running maxima, ms and vs
        AE_PH(4);
        // (cell tid: a thread has one cell at most, AE_CELLS <= AE_THREADS)
        const float sv = tid < n ? ssh[tid] : NEG_INF;
        float incl = sv;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const float y = __shfl_up_sync(FULL_MASK, incl, o);
            if (lane >= o) incl = fmaxf(incl, y);
        }
        const float excl = __shfl_up_sync(FULL_MASK, incl, 1);
        if (lane == 31) wmax[warp] = incl;
        __syncthreads();
        float run = M;
#pragma unroll
        for (int w = 0; w < AE_THREADS / 32; w++)
            if (w < warp) run = fmaxf(run, wmax[w]);
        if (lane > 0) run = fmaxf(run, excl);
        // odd: the cell's step rescales (ms != 1) or is skipped (vs = 0; so are the cells
        // from n to the next multiple of 8, given (1, 0) for the chains' eight at a time)
        bool odd = true;
        if (tid < n) {
            const float s = sv;
            float ms = 1.0f, vs = 0.0f;
            if (s != NEG_INF) {
                if (s > run) {
                    ms = expf_glibc(run - s, AE_TAB);
                    vs = 1.0f;
                } else {
                    vs = expf_glibc(s - run, AE_TAB);
                }
            }
            mv[tid] = make_float2(ms, vs);
            odd = ms != 1.0f || vs == 0.0f;
        } else if (tid < ((n + 7) & ~7)) {
            mv[tid] = make_float2(1.0f, 0.0f);
        }
        // the odd cells, a bit each
        const u32 bits = __ballot_sync(FULL_MASK, odd);
        if (lane == 0) rsc[warp] = bits;
#pragma unroll
        for (int w = 0; w < AE_THREADS / 32; w++) M = fmaxf(M, wmax[w]);
        __syncthreads();
        // 3. the sequential chains
        AE_PH(5);
#ifdef AE_SKIP_CHAIN
        if (0) {  // timing only
#else
        if (fast) {
#endif
            // eight cells at a time (one 16-byte load of this dimension's values, four of
            // the cells' (ms, vs)), the next eight's loads issued before this eight's steps;
            // where none of the eight is odd, only the fused multiply-add and its rounding
            // (ms = 1: acc * 1 is acc, acc holding an f16 value). (The loop is bound by the
            // instructions a warp issues, about 2.6 cycles each with one warp a scheduler:
            // docs/performance.md, session 23.)
            const uint4 *vrow = (const uint4 *)(vst + tid * vs_);
            const int vsw = (tid >> 3) & vm;  // (vat: group g at g ^ vsw)
            const float4 *mv4 = (const float4 *)mv;
            auto ld8 = [&](int b0, uint4 &v8, float4 (&m4)[4], bool &o) {
                const int bb = min(b0, ((n + 7) & ~7) - 8);  // (past the end: unused)
                v8 = vrow[(bb >> 3) ^ vsw];
#pragma unroll
                for (int k = 0; k < 4; k++) m4[k] = mv4[(bb >> 1) + k];
                o = ((rsc[bb >> 5] >> (bb & 31)) & 0xffu) != 0;
            };
            auto steps = [&](const uint4 &v8, const float4 (&m4)[4], bool o) {
                float vf[8];
                unpack8h(v8, vf);
                const float2 w[8] = {{m4[0].x, m4[0].y}, {m4[0].z, m4[0].w}, {m4[1].x, m4[1].y},
                                     {m4[1].z, m4[1].w}, {m4[2].x, m4[2].y}, {m4[2].z, m4[2].w},
                                     {m4[3].x, m4[3].y}, {m4[3].z, m4[3].w}};
                if (o) {
#pragma unroll
                    for (int k = 0; k < 8; k++) {
                        if (w[k].y != 0.0f) {
                            const float sc = h2f(f2h(__fmul_rn(acc, w[k].x)));
                            acc = h2f(f2h(__fmaf_rn(vf[k], w[k].y, sc)));
                        }
                    }
                } else {
#pragma unroll
                    for (int k = 0; k < 8; k++) acc = h2f(f2h(__fmaf_rn(vf[k], w[k].y, acc)));
                }
            };
            // (two buffers taking turns, so that no registers are copied)
            uint4 va, vb;
            float4 ma[4], mb[4];
            bool oa, ob;
            ld8(0, va, ma, oa);
            for (int b0 = 0; b0 < n; b0 += 16) {
                ld8(b0 + 8, vb, mb, ob);
                steps(va, ma, oa);
                if (b0 + 8 >= n) break;
                ld8(b0 + 16, va, ma, oa);
                steps(vb, mb, ob);
            }
        } else if (tid < npn) {
            // (AVX512-FP16 hosts: rounded once from the exact value, the weights in f16)
            for (int c = 0; c < n; c++) {
                const float2 w = mv[c];
                if (w.y == 0.0f) continue;
                const float vf = h2f(vst[vat(tid, c)]);
                if (w.x != 1.0f) acc = h2f(f64_to_f16((double)acc * (double)h2f(f2h(w.x))));
                acc = h2f(f64_to_f16(fma((double)vf, (double)h2f(f2h(w.y)), (double)acc)));
            }
        } else if (tid == AE_THREADS - 32) {
            for (int c = 0; c < n; c++) S = __fmaf_rn(S, mv[c].x, mv[c].y);
        }
    }
    if (tid == AE_THREADS - 32) Ssh = S;
    __syncthreads();
    AE_PH(6);
    if (tid < hd) {
        const float Sv = Ssh;
        const float inv = Sv == 0.0f ? 0.0f : __fdiv_rn(1.0f, Sv);
        const float o = __fmul_rn(acc, inv);
        const size_t i = ((size_t)t * n_head + h) * hd + tid;
        out[i] = o;
        if (quant) quantize_lane(o, aq, i, &ads[i >> 5], 1);
    }
#ifdef AE_PHASES
    if (h == 0 && t == 0 && tid == 0) {
        AE_PH(7);
        printf("AEPH %d %lld %lld %lld %lld %lld %lld %lld\n", nc, ph[1] - ph[0], ph[2] - ph[1],
               ph[3] - ph[2], ph[4] - ph[3], ph[5] - ph[4], ph[6] - ph[5], ph[7] - ph[6]);
    }
#endif
}
