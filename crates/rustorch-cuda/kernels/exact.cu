// The CPU backend's arithmetic on the GPU, bit for bit (RUSTORCH_CUDA_EXACT=1): the float
// steps of llama.cpp's x86 CPU kernels as rustorch-core reproduces them, op by op, so that a
// decode step gives the CPU's logits to the last bit instead of values within rounding.
// Every float operation is an explicit round-to-nearest intrinsic (no contraction into
// fused multiply-adds that the CPU does not do).
//
//   - expf_glibc: glibc's expf (FMA build), as f32::exp on the host (vexp.rs).
//   - expf_ggml:  ggml's vectorised expf (gexp.rs), for SiLU.
//   - mmve_*, mmvd_*: products (prompts; one to three tokens) as dot::dot_legacy /
//                 dot::dot_q6_k / the repacked Q4_K: per block of 32 (legacy) or
//                 256 (Q6_K) eight exact integer lane sums (lane l: values 4l..4l+3 of each
//                 32), fused-multiply-added into eight f32 accumulators in block order with
//                 the block's scale d_w * d_a, then ggml's hsum_float_8 (+ the Q4_1/Q5_1
//                 minimum term, its own fused chain).
//   - quantize_q8_k: ggml's quantize_row_q8_K_ref.
//   - rope_table: the host's angles (Rope::angles, glibc cosf/sinf) looked up by position.

__device__ __constant__ unsigned long long EXP2F_TAB[32] = {
    0x3ff0000000000000ull, 0x3fefd9b0d3158574ull, 0x3fefb5586cf9890full, 0x3fef9301d0125b51ull,
    0x3fef72b83c7d517bull, 0x3fef54873168b9aaull, 0x3fef387a6e756238ull, 0x3fef1e9df51fdee1ull,
    0x3fef06fe0a31b715ull, 0x3feef1a7373aa9cbull, 0x3feedea64c123422ull, 0x3feece086061892dull,
    0x3feebfdad5362a27ull, 0x3feeb42b569d4f82ull, 0x3feeab07dd485429ull, 0x3feea47eb03a5585ull,
    0x3feea09e667f3bcdull, 0x3fee9f75e8ec5f74ull, 0x3feea11473eb0187ull, 0x3feea589994cce13ull,
    0x3feeace5422aa0dbull, 0x3feeb737b0cdc5e5ull, 0x3feec49182a3f090ull, 0x3feed503b23e255dull,
    0x3feee89f995ad3adull, 0x3feeff76f2fb5e47ull, 0x3fef199bdd85529cull, 0x3fef3720dcef9069ull,
    0x3fef5818dcfba487ull, 0x3fef7c97337b9b5full, 0x3fefa4afa2a490daull, 0x3fefd0765b6e4540ull,
};

// Where expf_glibc reads the table: EXP2F_TAB itself, or a copy (e.g. in shared memory,
// where a warp's different entries do not serialize as in the constant cache).
struct ConstTab {
    __device__ __forceinline__ u64 operator[](u32 i) const { return EXP2F_TAB[i]; }
};
struct CopyTab {
    const u64 *p;
    __device__ __forceinline__ u64 operator[](u32 i) const { return p[i]; }
};

// glibc's expf: x·32/ln2 split into k and r in f64, 2^(k/32) from the table, a cubic in r,
// one rounding to f32.
template <class Tab = ConstTab>
__device__ __forceinline__ float expf_glibc(float x, Tab tab = Tab()) {
    const u32 abstop = (__float_as_uint(x) >> 20) & 0x7ff;
    if (abstop > 0x42a) {  // |x| >= 88, infinities, NaN
        if (__float_as_uint(x) == 0xff800000u) return 0.0f;
        if (abstop >= 0x7f8) return __fadd_rn(x, x);
        if (x > 88.72283172607421875f) return __uint_as_float(0x7f800000u);
        if (x < -103.972076416015625f) return 0.0f;
    }
    const double inv = __longlong_as_double(0x40471547652b82fell);
    const double shift = __longlong_as_double(0x4338000000000000ll);
    const double xd = (double)x;
    double kd = __fma_rn(inv, xd, shift);
    const unsigned long long ki = (unsigned long long)__double_as_longlong(kd);
    kd = __dsub_rn(kd, shift);
    const double r = __fma_rn(inv, xd, -kd);
    const unsigned long long t = tab[(u32)(ki & 31)] + (ki << 47);
    const double s = __longlong_as_double((long long)t);
    const double z = __fma_rn(r, __longlong_as_double(0x3ebc6af84b912394ll),
                              __longlong_as_double(0x3f2ebfce50fac4f3ll));
    const double r2 = __dmul_rn(r, r);
    double y = __fma_rn(r, __longlong_as_double(0x3f962e42ff0c52d6ll), 1.0);
    y = __fma_rn(z, r2, y);
    return __double2float_rn(__dmul_rn(y, s));
}

// ggml's ggml_v_expf, one lane (gexp::expf).
__device__ __forceinline__ float expf_ggml(float x) {
    const float shift = 12582912.0f;
    const float z = __fmaf_rn(x, __uint_as_float(0x3fb8aa3bu), shift);
    const float n = __fsub_rn(z, shift);
    const float b = __fmaf_rn(-n, __uint_as_float(0x35bfbe8eu),
                              __fmaf_rn(-n, __uint_as_float(0x3f317200u), x));
    const float u = __fmul_rn(b, b);
    const float j = __fmaf_rn(
        __fmaf_rn(__fmaf_rn(__uint_as_float(0x3c072010u), b, __uint_as_float(0x3d2b9f17u)), u,
                  __fmaf_rn(__uint_as_float(0x3e2aaf33u), b, __uint_as_float(0x3efffedbu))),
        u, __fmaf_rn(__uint_as_float(0x3f7ffff6u), b, 1.0f));
    if (fabsf(n) > 192.0f) return n <= 0.0f ? 0.0f : __uint_as_float(0x7f800000u);
    if (n != n) return n;
    // j · 2^n, exact in f64, rounded once
    const double p2 = __longlong_as_double((long long)((int)n + 1023) << 52);
    return __double2float_rn(__dmul_rn((double)j, p2));
}

// silu(x) = x / (1 + expf(0 - x)) as ggml_v_silu.
__device__ __forceinline__ float silu_ggml(float x) {
    return __fdiv_rn(x, __fadd_rn(1.0f, expf_ggml(__fsub_rn(0.0f, x))));
}

// silu(gate) * up for element i of a row of n: ggml_vec_swiglu_f32 takes the vectorised
// SiLU for the first n & ~15 elements and the C library's expf for the rest (gexp::swiglu).
__device__ __forceinline__ float swiglu_cpu(float g, float u, int i, int n) {
    if (i < (n & ~15)) return __fmul_rn(silu_ggml(g), u);
    return __fmul_rn(__fdiv_rn(g, __fadd_rn(1.0f, expf_glibc(-g))), u);
}

// ---------------------------------------------------------------------------------------
// Products. One warp per output row (up to three matrices per launch, an MmvJob; with glu, two
// warps per row: gate and up, then silu(gate) * up), grid (ceil(rows / 4), n_tok). Each pass
// the 32 threads decode 32 * G consecutive groups of 32 weights (all loads issued together)
// into integer lane sums in shared memory; then threads 0..7 (one per lane) run the
// accumulator chains in block order.

#define MMVE_WARPS 4
// groups per lane and pass: G_SHORT, or G_LONG for rows that one pass of G_SHORT does not
// cover (the `_l` kernels, e.g. a down product's 5632 columns: one pass instead of two, so
// the warp waits on memory once)
#define MMVE_G_SHORT 4
#define MMVE_G_LONG 6

// ggml's hsum_float_8 of the accumulators held by lanes 0..7: lane 0 gets
// ((v0 + v4) + (v2 + v6)) + ((v1 + v5) + (v3 + v7)).
__device__ __forceinline__ float hsum8_lanes(float acc) {
    const float r = __fadd_rn(acc, __shfl_down_sync(FULL_MASK, acc, 4));
    const float p = __fadd_rn(r, __shfl_down_sync(FULL_MASK, r, 2));
    return __fadd_rn(p, __shfl_down_sync(FULL_MASK, p, 1));
}

// This warp's matrix m and row wi (glu: warps 2k and 2k + 1 take row k of gate and up).
__device__ __forceinline__ bool mmve_row(const MmvJob &j, int &m, int &wi) {
    const int warp = threadIdx.x >> 5;
    if (j.glu) {
        m = warp & 1;
        wi = blockIdx.x * (MMVE_WARPS / 2) + (warp >> 1);
        return wi < j.rows[0];
    }
    wi = blockIdx.x * MMVE_WARPS + warp;
    return job_row(j, m, wi);
}

// Lane 0's value v of (matrix m, row wi, token blockIdx.y) to its output; with glu the gate
// warp writes silu(gate) * up (every warp of the block reaches the barrier).
__device__ __forceinline__ void mmve_store(const MmvJob &j, int m, int wi, bool has, float v) {
    __shared__ float up[MMVE_WARPS];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const size_t t = blockIdx.y;
    if (!j.glu) {
        if (has && lane == 0) job_out(j, m)[t * job_rows(j, m) + wi] = v;
        return;
    }
    if (lane == 0) up[warp] = v;
    __syncthreads();
    if (has && m == 0 && lane == 0)
        j.out[0][t * j.rows[0] + wi] = swiglu_cpu(v, up[warp + 1], wi, j.rows[0]);
}

// With glu and two rows per warp: lane 0 holds gate row wi's value, lane 8 up's; lane 0
// stores silu(gate) * up for token blockIdx.y.
__device__ __forceinline__ void mmve_glu_store(const MmvJob &j, int wi, float v) {
    const float u = __shfl_sync(FULL_MASK, v, 8);
    if ((threadIdx.x & 31) == 0)
        j.out[0][(size_t)blockIdx.y * j.rows[0] + wi] = swiglu_cpu(v, u, wi, j.rows[0]);
}

// The 32 activation codes of group gi as eight words.
__device__ __forceinline__ void group_acts(const i8 *__restrict__ a, int gi, int (&av)[8]) {
    const int4 a0 = ((const int4 *)(a + (size_t)gi * 32))[0];
    const int4 a1 = ((const int4 *)(a + (size_t)gi * 32))[1];
    av[0] = a0.x, av[1] = a0.y, av[2] = a0.z, av[3] = a0.w;
    av[4] = a1.x, av[5] = a1.y, av[6] = a1.z, av[7] = a1.w;
}

// A decoded legacy group's eight exact lane sums (values 4l..4l+3) against codes av.
__device__ __forceinline__ void legacy_lane_sums(const Group &g, const int (&av)[8], int (&v)[8]) {
#pragma unroll
    for (int q = 0; q < 8; q++) v[q] = dp4a(g.v[q], av[q], g.z0 * dp4a(0x01010101, av[q], 0));
}

// Group g (0..7) of the Q6_K super-block blk against codes av: lane k's sum is sc * dot of
// values 4k..4k+3 (q unsigned); ggml puts the -32 offset of sub-blocks 2l and 2l + 1 (this
// group's halves when l = g) into lane l.
__device__ __forceinline__ void q6k_group_sums(const u8 *blk, int g, const int (&av)[8],
                                               int (&v)[8]) {
    Group w;
    FQ6_K::decode(blk, g, w);
    const i8 *sc = (const i8 *)(blk + 192 + 8 * (g >> 2) + 2 * (g & 3));
    int corr = 0;
#pragma unroll
    for (int k = 0; k < 8; k++) corr += (int)sc[k >> 2] * dp4a(0x01010101, av[k], 0);
#pragma unroll
    for (int k = 0; k < 8; k++)
        v[k] = (int)sc[k >> 2] * dp4a(w.v[k], av[k], 0) - (k == g ? 32 * corr : 0);
}

// Sub-block g (0..7) of the Q4_K super-block blk against codes av: sc * dot and
// m * (the codes' sum).
__device__ __forceinline__ void q4k_group_sums(const u8 *blk, int g, const int (&av)[8],
                                               int &scdot, int &mnsum) {
    Group w;
    FQ4_K::decode(blk, g, w);
    int sc, mn;
    scale_min_k4(blk + 4, g, sc, mn);
    int dot = 0, bs = 0;
#pragma unroll
    for (int k = 0; k < 8; k++) {
        dot = dp4a(w.v[k], av[k], dot);
        bs = dp4a(0x01010101, av[k], bs);
    }
    scdot = sc * dot;
    mnsum = mn * bs;
}

// Legacy formats (blocks of 32) against Q8_0 / Q8_1 activations quantized with the CPU's
// rule (ads: per block d and s, each rounded to f16), R (1 or 2) rows of one warp against
// the same activations (gate and up: a lane decodes block b of both rows against one load
// of its activations). Each pass a lane stages G / R blocks of each row: the eight integer
// lane sums (two 16-byte stores) and d_w * d_a (and the minimum term's two factors); then
// lanes 8r .. 8r + 7 walk row r's lane chains and lane 16 + 8r its minimum term. Row r's
// slots start at r * (H + 1), so the two rows' chain lanes read other banks. Lane 8r
// returns row r's dot product.
template <bool MIN, int G>
struct LegacySmem {
    int4 si[32 * G + 1][2];
    float d[32 * G + 1];
    float2 m[MIN ? 32 * G + 1 : 1];
};

template <class F, bool MIN, int R, int G>
__device__ __forceinline__ float mmve_legacy_rows(const u8 *__restrict__ w0,
                                                  const u8 *__restrict__ w1,
                                                  const i8 *__restrict__ a,
                                                  const float2 *__restrict__ ad, int nb,
                                                  LegacySmem<MIN, G> &st) {
    const int lane = threadIdx.x & 31;
    const int H = 32 * G / R;
    float acc = 0.0f, summs = 0.0f;
    for (int b0 = 0; b0 < nb; b0 += H) {
#pragma unroll
        for (int i = 0; i < G / R; i++) {
            const int j = 32 * i + lane, b = b0 + j;
            if (b < nb) {
                int av[8];
                group_acts(a, b, av);
                const float2 ds = ad[b];
#pragma unroll
                for (int r = 0; r < R; r++) {
                    Group g;
                    decode_group<F>(r ? w1 : w0, b, g);
                    int sv[8];
                    legacy_lane_sums(g, av, sv);
                    const int sl = r * (H + 1) + j;
                    st.si[sl][0] = make_int4(sv[0], sv[1], sv[2], sv[3]);
                    st.si[sl][1] = make_int4(sv[4], sv[5], sv[6], sv[7]);
                    st.d[sl] = __fmul_rn(g.d0, ds.x);
                    if (MIN) st.m[sl] = make_float2(g.m0, ds.y);
                }
            }
        }
        __syncwarp();
        const int n = min(H, nb - b0);
        if (lane < 8 * R) {
            const int base = (lane >> 3) * (H + 1), l = lane & 7;
            const int *sv = (const int *)st.si;
#pragma unroll 8
            for (int jj = 0; jj < n; jj++)
                acc = __fmaf_rn(st.d[base + jj], __int2float_rn(sv[(base + jj) * 8 + l]), acc);
        } else if (MIN && (lane == 16 || (R == 2 && lane == 24))) {
            const int base = lane == 24 ? H + 1 : 0;
#pragma unroll 8
            for (int jj = 0; jj < n; jj++)
                summs = __fmaf_rn(st.m[base + jj].x, st.m[base + jj].y, summs);
        }
        __syncwarp();
    }
    const float sum = hsum8_lanes(acc);
    const float sm = __shfl_down_sync(FULL_MASK, summs, 16);
    return MIN ? __fadd_rn(sum, sm) : sum;
}

// Q6_K against Q8_K activations (dq: per 256 values the f32 scale): per super-block eight
// lane sums (dot::q6k_lanes: lane l holds sc * q * a of values 4l..4l+3 of every 32, q
// unsigned, minus 32 * sc * a over sub-blocks 2l and 2l + 1), one fused multiply-add each
// with d_a * d_w, then hsum_float_8. With `tiled` (batches of 8+ rows, the CPU's q6k_tiled):
// one accumulator, acc = fma(f32(s1) * d_w, d_a, acc) per super-block, s1 the super-block's
// whole integer sum.
template <int G>
__device__ __forceinline__ float mmve_q6k_row(const u8 *__restrict__ wr, const i8 *__restrict__ a,
                                              const float *__restrict__ d, int ng, int tiled,
                                              int (*sh)[8]) {
    const int lane = threadIdx.x & 31;
    float acc = 0.0f;
    for (int g0 = 0; g0 < ng; g0 += 32 * G) {
#pragma unroll
        for (int i = 0; i < G; i++) {
            const int gl = 32 * i + lane, gi = g0 + gl;
            if (gi < ng) {
                int av[8];
                group_acts(a, gi, av);
                q6k_group_sums(wr + (size_t)(gi >> 3) * 210, gi & 7, av, sh[gl]);
            }
        }
        __syncwarp();
        const int n = min(32 * G, ng - g0);
        if (tiled) {
            if (lane == 0) {
                for (int j = 0; j < n; j += 8) {
                    int s1 = 0;
                    for (int q = 0; q < 64; q++) s1 += sh[j + (q >> 3)][q & 7];
                    const int sb = (g0 + j) >> 3;
                    const float r =
                        __fmul_rn(__int2float_rn(s1), h2f(ld_u16(wr + (size_t)sb * 210 + 208)));
                    acc = __fmaf_rn(r, d[sb], acc);
                }
            }
        } else if (lane < 8) {
            for (int j = 0; j < n; j += 8) {
                int s = 0;
#pragma unroll
                for (int q = 0; q < 8; q++) s += sh[j + q][lane];
                const int sb = (g0 + j) >> 3;
                const float ds = __fmul_rn(d[sb], h2f(ld_u16(wr + (size_t)sb * 210 + 208)));
                acc = __fmaf_rn(ds, __int2float_rn(s), acc);
            }
        }
        __syncwarp();
    }
    return tiled ? acc : hsum8_lanes(acc);
}

// Q4_K (rows a multiple of 8: the CPU multiplies them as llama.cpp's repacked kernels,
// q4k_ggml) against Q8_K activations: per super-block isum = sum of sc[s] * dot[s] and
// imin = sum of m[s] * B[s] (B: the sub-block's activation code sum), then
// acc = fma(f32(isum), d_w * d_a, acc), accm = fma(f32(imin), dmin_w * d_a, accm); the
// result acc - accm. With `gemm` (the CPU's gemm rows) the fused steps go per pair of
// sub-blocks instead of per super-block. R (1 or 2) rows per warp as mmve_legacy_rows:
// lanes 8r and 8r + 1 walk row r's two chains; lane 8r returns row r's value.
template <int R, int G>
__device__ __forceinline__ float mmve_q4k_rows(const u8 *__restrict__ w0,
                                               const u8 *__restrict__ w1,
                                               const i8 *__restrict__ a,
                                               const float *__restrict__ d, int ng, bool gemm,
                                               int (*sh)[2]) {
    const int lane = threadIdx.x & 31;
    const int H = 32 * G / R;
    float acc = 0.0f;
    for (int g0 = 0; g0 < ng; g0 += H) {
#pragma unroll
        for (int i = 0; i < G; i++) {
            const int sl = 32 * i + lane, r = sl / H, gi = g0 + sl - r * H;
            if (gi < ng) {
                int av[8];
                group_acts(a, gi, av);
                q4k_group_sums((r ? w1 : w0) + (size_t)(gi >> 3) * 144, gi & 7, av, sh[sl][0],
                               sh[sl][1]);
            }
        }
        __syncwarp();
        if ((lane & 7) < 2 && lane < 8 * R) {
            const int c = lane & 1, base = (lane >> 3) * H;
            const u8 *wr = lane >= 8 ? w1 : w0;
            const int n = min(H, ng - g0);
            for (int j = 0; j < n; j += 8) {
                const int sb = (g0 + j) >> 3;
                const float ds = __fmul_rn(h2f(ld_u16(wr + (size_t)sb * 144 + 2 * c)), d[sb]);
                if (gemm) {
#pragma unroll
                    for (int p = 0; p < 4; p++) {
                        const int v = sh[base + j + 2 * p][c] + sh[base + j + 2 * p + 1][c];
                        acc = __fmaf_rn(__int2float_rn(v), ds, acc);
                    }
                } else {
                    int v = 0;
#pragma unroll
                    for (int q = 0; q < 8; q++) v += sh[base + j + q][c];
                    acc = __fmaf_rn(__int2float_rn(v), ds, acc);
                }
            }
        }
        __syncwarp();
    }
    return __fsub_rn(acc, __shfl_down_sync(FULL_MASK, acc, 1));
}

// The legacy formats' and Q4_K's kernels: a policy P gives the bytes of a weight row, the
// per-warp shared memory and P::rows<R> (R rows of one warp against token blockIdx.y's
// activations: `aq` codes, `sc` scales); with glu a warp takes gate and up row wi together,
// else the one row of mmve_row.
template <class F, bool MIN, int G>
struct MmveLegacy {
    typedef LegacySmem<MIN, G> Smem;
    static __device__ __forceinline__ size_t row_bytes(int n_cols) {
        return fmt_row_bytes<F>(n_cols);
    }
    template <int R>
    static __device__ __forceinline__ float rows(const u8 *w0, const u8 *w1, const i8 *aq,
                                                 const void *sc, int n_cols, int, Smem &m) {
        const size_t t = blockIdx.y;
        const int nb = n_cols >> 5;
        return mmve_legacy_rows<F, MIN, R, G>(w0, w1, aq + t * n_cols, (const float2 *)sc + t * nb,
                                              nb, m);
    }
};

template <int G>
struct Q4kSmem {
    int sh[32 * G][2];
};

template <int G>
struct MmveQ4K {
    typedef Q4kSmem<G> Smem;
    static __device__ __forceinline__ size_t row_bytes(int n_cols) {
        return (size_t)(n_cols >> 8) * 144;
    }
    // (mode: the tokens below it take the gemm steps)
    template <int R>
    static __device__ __forceinline__ float rows(const u8 *w0, const u8 *w1, const i8 *aq,
                                                 const void *sc, int n_cols, int mode, Smem &m) {
        const size_t t = blockIdx.y;
        return mmve_q4k_rows<R, G>(w0, w1, aq + t * n_cols, (const float *)sc + t * (n_cols >> 8),
                                n_cols >> 5, (int)t < mode, m.sh);
    }
};

template <class P>
__device__ __forceinline__ void mmve_kernel(const MmvJob &j, const i8 *__restrict__ aq,
                                            const void *__restrict__ sc, int n_cols, int mode) {
    __shared__ typename P::Smem smem[MMVE_WARPS];
    typename P::Smem &m = smem[threadIdx.x >> 5];
    const size_t rb = P::row_bytes(n_cols);
    if (j.glu) {
        // (a warp per row: no block barrier)
        const int wi = blockIdx.x * MMVE_WARPS + (threadIdx.x >> 5);
        if (wi >= j.rows[0]) return;
        const float v = P::template rows<2>(j.w[0] + (size_t)wi * rb, j.w[1] + (size_t)wi * rb,
                                            aq, sc, n_cols, mode, m);
        mmve_glu_store(j, wi, v);
        return;
    }
    int mi, wi;
    const bool has = mmve_row(j, mi, wi);
    float v = 0.0f;
    if (has) {
        const u8 *wr = job_w(j, mi) + (size_t)wi * rb;
        v = P::template rows<1>(wr, wr, aq, sc, n_cols, mode, m);
    }
    mmve_store(j, mi, wi, has, v);
}

#define MMVE_LEGACY_G(NAME, F, MIN, G)                                                        \
    extern "C" __global__ void __launch_bounds__(MMVE_WARPS * 32)                            \
        mmve_##NAME(MmvJob j, const i8 *aq, const float2 *ads, int n_cols, int mode) {       \
        PDL_ENTRY_AFTER(mmvq1_prefetch<F>(j, n_cols, 1));                                    \
        mmve_kernel<MmveLegacy<F, MIN, G>>(j, aq, ads, n_cols, mode);                        \
    }
#define MMVE_LEGACY(NAME, F, MIN)                  \
    MMVE_LEGACY_G(NAME, F, MIN, MMVE_G_SHORT)      \
    MMVE_LEGACY_G(NAME##_l, F, MIN, MMVE_G_LONG)

MMVE_LEGACY(q4_0, FQ4_0, false)
MMVE_LEGACY(q4_0t, FQ4_0T, false)
MMVE_LEGACY(q4_1, FQ4_1, true)
MMVE_LEGACY(q5_0, FQ5_0, false)
MMVE_LEGACY(q5_1, FQ5_1, true)
MMVE_LEGACY(q8_0, FQ8_0, false)
MMVE_LEGACY(q8_0t, FQ8_0T, false)

// (mode: Q6_K, tiled or not; Q4_K, the tokens below it take the gemm steps)
template <int G>
__device__ __forceinline__ void mmve_q6k_kernel(const MmvJob &j, const i8 *aq, const float *dq,
                                                int n_cols, int mode) {
    __shared__ int sh[MMVE_WARPS][32 * G][8];
    const size_t t = blockIdx.y;
    const int nsb = n_cols >> 8;
    int m, wi;
    const bool has = mmve_row(j, m, wi);
    float v = 0.0f;
    if (has)
        v = mmve_q6k_row<G>(job_w(j, m) + (size_t)wi * nsb * 210, aq + t * n_cols, dq + t * nsb,
                            n_cols >> 5, mode, sh[threadIdx.x >> 5]);
    mmve_store(j, m, wi, has, v);
}

#define MMVE_K(NAME, BODY, F)                                                                \
    extern "C" __global__ void __launch_bounds__(MMVE_WARPS * 32)                            \
        NAME(MmvJob j, const i8 *aq, const float *dq, int n_cols, int mode) {                \
        PDL_ENTRY_AFTER(mmvq1_prefetch<F>(j, n_cols, 1));                                    \
        BODY;                                                                                \
    }
MMVE_K(mmve_q6_k, (mmve_q6k_kernel<MMVE_G_SHORT>(j, aq, dq, n_cols, mode)), FQ6_K)
MMVE_K(mmve_q6_k_l, (mmve_q6k_kernel<MMVE_G_LONG>(j, aq, dq, n_cols, mode)), FQ6_K)
MMVE_K(mmve_q4_k, (mmve_kernel<MmveQ4K<MMVE_G_SHORT>>(j, aq, dq, n_cols, mode)), FQ4_K)
MMVE_K(mmve_q4_k_l, (mmve_kernel<MmveQ4K<MMVE_G_LONG>>(j, aq, dq, n_cols, mode)), FQ4_K)

// ggml's quantize_row_q8_K_ref, by one warp for the 256 values at x: max = the first value
// of largest magnitude, iscale = -127 / max, q = min(127, round_half_even(iscale * x)),
// d = 1 / iscale. With `four`, ggml_quantize_mat_q8_K_4x8's rule instead (the CPU's Q4_K
// gemm rows): iscale = -127 / amax if some value equals +amax, else 127 / amax.
__device__ __forceinline__ void q8k_warp(const float *x, i8 *q, float *d, bool four) {
    const int lane = threadIdx.x & 31;
    float v[8];
    float amax = 0.0f;
#pragma unroll
    for (int k = 0; k < 8; k++) {
        v[k] = x[32 * k + lane];
        amax = fmaxf(amax, fabsf(v[k]));
    }
    amax = warp_amax(amax);  // (each lane's amax is a number: fmaxf from 0)
    int first = 256;
#pragma unroll
    for (int k = 7; k >= 0; k--)
        if (fabsf(v[k]) == amax) first = min(first, 32 * k + lane);
    first = warp_min_i(first);
    if (amax == 0.0f) {
#pragma unroll
        for (int k = 0; k < 8; k++) q[32 * k + lane] = 0;
        if (lane == 0) *d = 0.0f;
        return;
    }
    float iscale;
    if (four) {
        bool pos = false;
#pragma unroll
        for (int k = 0; k < 8; k++) pos = pos || v[k] == amax;
        pos = __any_sync(FULL_MASK, pos);
        iscale = pos ? __fdiv_rn(-127.0f, amax) : __fdiv_rn(127.0f, amax);
    } else {
        iscale = __fdiv_rn(-127.0f, x[first]);
    }
#pragma unroll
    for (int k = 0; k < 8; k++)
        q[32 * k + lane] = (i8)max(-128, min(127, __float2int_rn(__fmul_rn(iscale, v[k]))));
    if (lane == 0) *d = __fdiv_rn(1.0f, iscale);
}

// Q8_K activations (q8k_warp; tokens below n_4x8 take the 4x8 rule): one warp per block of
// 256, grid (blocks / 4, n_tok), 128 threads.
extern "C" __global__ void quantize_q8_k(const float *__restrict__ x, i8 *__restrict__ aq,
                                         float *__restrict__ dq, int n_cols, int n_4x8) {
    PDL_ENTRY();
    const int nsb = n_cols >> 8;
    const int sb = blockIdx.x * 4 + (threadIdx.x >> 5);
    const int t = blockIdx.y;
    if (sb >= nsb) return;
    const size_t base = (size_t)t * n_cols + (size_t)sb * 256;
    q8k_warp(x + base, aq + base, dq + (size_t)t * nsb + sb, t < n_4x8);
}

// cs/sn[r][i] = the host's table at row r's position (positions beyond the table give 0;
// the host grows the table before any such launch).
extern "C" __global__ void rope_table(const u32 *__restrict__ pos, const float *__restrict__ tc,
                                      const float *__restrict__ ts, float *__restrict__ cs,
                                      float *__restrict__ sn, int n_rows, int half, int n_pos) {
    PDL_ENTRY();
    const int idx = blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= n_rows * half) return;
    const int r = idx / half, i = idx % half;
    const u32 p = pos[r];
    const bool ok = p < (u32)n_pos;
    cs[idx] = ok ? tc[(size_t)p * half + i] : 0.0f;
    sn[idx] = ok ? ts[(size_t)p * half + i] : 0.0f;
}

// ---------------------------------------------------------------------------------------
// Products for one to three tokens (`mmvd_*`): the same float steps as mmve_*, with every
// lane of a chain-walking warp busy. Four rows per group (with glu: gate and up of two rows),
// each row's eight accumulator chains walked by eight threads (r, l) = lane 8r + l of one
// warp; the integer sums they walk are staged lane-major in shared memory, so a thread
// reads four of its chain's sums per 16-byte load. Two layouts: `mmvd_*` (legacy formats,
// rows of at most RUSTORCH_CUDA_COOP_MIN groups of 32) a warp per group of rows, decoding
// 32 blocks per pass; `mmvd_*_c` (longer rows, and Q4_K / Q6_K) a block of four warps per
// group, all decoding a whole row's groups in one round, then warp 0 walking the chains.
// The legacy formats' weights are prefetched into L2 before the PDL wait (see mmvd_rows).

// Row rr (0..3) of group gw (default: this warp's; the cooperative kernels pass their block's):
// its matrix m and row wi; false past the last row.
__device__ __forceinline__ bool mmvd_row_of(const MmvJob &j, int rr, int &m, int &wi,
                                            int gw = -1) {
    if (gw < 0) gw = blockIdx.x * 4 + (threadIdx.x >> 5);
    if (j.glu) {
        m = rr & 1;
        wi = 2 * gw + (rr >> 1);
        return wi < j.rows[0];
    }
    m = 0;
    wi = 4 * gw + rr;
    return job_row(j, m, wi);
}

// Lane 8r's value v of its row to the output; with glu, gate lanes (r even) write
// silu(gate) * up with up from lane 8r + 8.
__device__ __forceinline__ void mmvd_store(const MmvJob &j, int m, int wi, bool has, float v) {
    const size_t t = blockIdx.y;
    const bool lead = (threadIdx.x & 7) == 0;
    if (j.glu) {
        const float u = __shfl_down_sync(FULL_MASK, v, 8);
        if (has && lead && m == 0)
            j.out[0][t * j.rows[0] + wi] = swiglu_cpu(v, u, wi, j.rows[0]);
        return;
    }
    if (has && lead) job_out(j, m)[t * job_rows(j, m) + wi] = v;
}

// One thread's walk of n staged sums sp (lane-major, 16-byte aligned) with their factors dp:
// acc = fma(dp[j], f32(sp[j]), acc) in order, four per load; with MIN and `mins`, the
// minimum term's chain summs = fma(m.x, m.y, summs) in the same loop (the two chains are
// independent, so their latencies overlap).
template <bool MIN>
__device__ __forceinline__ void chain_walk(const int *sp, const float *dp, const float2 *mm, int n,
                                           bool mins, float &acc, float &summs) {
    int jj = 0;
    for (; jj + 4 <= n; jj += 4) {
        const int4 s4 = *(const int4 *)(sp + jj);
        const float4 d4 = *(const float4 *)(dp + jj);
        acc = __fmaf_rn(d4.x, __int2float_rn(s4.x), acc);
        acc = __fmaf_rn(d4.y, __int2float_rn(s4.y), acc);
        acc = __fmaf_rn(d4.z, __int2float_rn(s4.z), acc);
        acc = __fmaf_rn(d4.w, __int2float_rn(s4.w), acc);
        if (MIN && mins) {
#pragma unroll
            for (int q = 0; q < 4; q++) summs = __fmaf_rn(mm[jj + q].x, mm[jj + q].y, summs);
        }
    }
    for (; jj < n; jj++) {
        acc = __fmaf_rn(dp[jj], __int2float_rn(sp[jj]), acc);
        if (MIN && mins) summs = __fmaf_rn(mm[jj].x, mm[jj].y, summs);
    }
}

// Legacy formats, four rows per warp, staged by lanes and walked by rows: each pass of 32
// blocks every lane decodes block b0 + lane of all four rows against one load of its
// activations and stores the eight integer lane sums of each (lane-major: the sums of lane
// l of row r consecutive) and d_w * d_a; then thread (r, l) walks its 32 sums in block
// order, four per 16-byte shared load (every lane walks a chain).
// (R rows per warp: 4, passes of 32 blocks; 2 (mmvd_legacy2), passes of 64)
template <bool MIN, int R>
struct __align__(16) RSmem {
    int si[R][8][128 / R + 4];
    float d[R][128 / R + 4];
    float2 m[MIN ? R : 1][MIN ? 128 / R : 1];
};

// Block j's staging for row rr: its eight lane sums, d_w * d_a and the minimum term's factors.
template <bool MIN, int R>
__device__ __forceinline__ void stage_legacy(RSmem<MIN, R> &st, int rr, int j, const Group &g,
                                             const int (&av)[8], float2 ds) {
    int v[8];
    legacy_lane_sums(g, av, v);
#pragma unroll
    for (int q = 0; q < 8; q++) st.si[rr][q][j] = v[q];
    st.d[rr][j] = __fmul_rn(g.d0, ds.x);
    if (MIN) st.m[rr][j] = make_float2(g.m0, ds.y);
}

template <class F, bool MIN>
__device__ __forceinline__ float mmvd_legacy(const u8 *const (&wp)[4], const i8 *__restrict__ a,
                                             const float2 *__restrict__ ad, int nb,
                                             RSmem<MIN, 4> &st) {
    const int lane = threadIdx.x & 31, r = lane >> 3, l = lane & 7;
    float acc = 0.0f, summs = 0.0f;
    for (int b0 = 0; b0 < nb; b0 += 32) {
        const int b = b0 + lane;
        if (b < nb) {
            int av[8];
            group_acts(a, b, av);
            const float2 ds = ad[b];
#pragma unroll
            for (int rr = 0; rr < 4; rr++) {
                Group g;
                decode_group<F>(wp[rr], b, g);
                stage_legacy(st, rr, lane, g, av, ds);
            }
        }
        __syncwarp();
        const int n = min(32, nb - b0);
        const int *sp = st.si[r][l];
        const float *dp = st.d[r];
        chain_walk<MIN>(sp, dp, st.m[MIN ? r : 0], n, l == 0, acc, summs);
        __syncwarp();
    }
    const float sum = hsum8_lanes(acc);
    return MIN ? __fadd_rn(sum, summs) : sum;
}

// Legacy formats, two rows per warp (`mmvd_*_r2`, RUSTORCH_CUDA_MMVD_R2): as mmvd_legacy with
// passes of 64 blocks, each lane decoding blocks b0 + lane and b0 + lane + 32 of both rows
// (all four loads issued before any is used), so a row of up to 64 groups takes one pass
// and one wait on memory instead of two; threads 0..15 walk the chains (row lane / 8).
template <class F, bool MIN>
__device__ __forceinline__ float mmvd_legacy2(const u8 *const (&wp)[2], const i8 *__restrict__ a,
                                              const float2 *__restrict__ ad, int nb,
                                              RSmem<MIN, 2> &st) {
    const int lane = threadIdx.x & 31, r = (lane >> 3) & 1, l = lane & 7;
    float acc = 0.0f, summs = 0.0f;
    for (int b0 = 0; b0 < nb; b0 += 64) {
        int av[2][8];
        float2 ds[2];
        Group g[2][2];
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int b = min(b0 + lane + 32 * h, nb - 1);
            group_acts(a, b, av[h]);
            ds[h] = ad[b];
#pragma unroll
            for (int rr = 0; rr < 2; rr++) decode_group<F>(wp[rr], b, g[h][rr]);
        }
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int j = lane + 32 * h;
            if (b0 + j < nb) {
#pragma unroll
                for (int rr = 0; rr < 2; rr++) stage_legacy(st, rr, j, g[h][rr], av[h], ds[h]);
            }
        }
        __syncwarp();
        if (lane < 16) {
            const int n = min(64, nb - b0);
            chain_walk<MIN>(st.si[r][l], st.d[r], st.m[MIN ? r : 0], n, l == 0, acc, summs);
        }
        __syncwarp();
    }
    const float sum = hsum8_lanes(acc);
    return MIN ? __fadd_rn(sum, summs) : sum;
}

// The two rows of warp gw of a two-rows-per-warp product: with GLU and j.glu the gate and up
// rows of output gw, else rows 2 gw and 2 gw + 1; their matrices, rows, presence and weights
// (row 0 of the first matrix, read and not stored, past the end), and with PF (and
// RT_PDL_PREFETCH) their L2 prefetch by this warp, before the wait.
struct Rows2 {
    const u8 *wp[2];
    int m[2], wi[2];
    bool has[2];
};
template <bool GLU, bool PF>
__device__ __forceinline__ void rows2_of(const MmvJob &j, int gw, size_t rb, Rows2 &w) {
#pragma unroll
    for (int rr = 0; rr < 2; rr++) {
        if (GLU && j.glu) {
            w.m[rr] = rr;
            w.wi[rr] = gw;
            w.has[rr] = gw < j.rows[0];
        } else {
            w.wi[rr] = 2 * gw + rr;
            w.has[rr] = job_row(j, w.m[rr], w.wi[rr]);
        }
        w.wp[rr] = w.has[rr] ? job_w(j, w.m[rr]) + (size_t)w.wi[rr] * rb : j.w[0];
#ifdef RT_PDL_PREFETCH
        if (PF && w.has[rr]) pdl_prefetch(w.wp[rr], rb, threadIdx.x & 31, 32);
#endif
    }
}

// Lane 0's value v of row 0 and lane 8's of row 1 to the output of token blockIdx.y (with GLU
// and j.glu: lane 0 stores silu(gate) * up, up from lane 8).
template <bool GLU>
__device__ __forceinline__ void rows2_store(const MmvJob &j, int gw, const Rows2 &w, float v) {
    const int lane = threadIdx.x & 31;
    const size_t t = blockIdx.y;
    if (GLU && j.glu) {
        const float u = __shfl_down_sync(FULL_MASK, v, 8);
        if (lane == 0 && w.has[0]) j.out[0][t * j.rows[0] + gw] = swiglu_cpu(v, u, gw, j.rows[0]);
        return;
    }
    // (selected, not indexed, to keep the arrays in registers)
    const bool one = lane == 8;
    const int m = one ? w.m[1] : w.m[0], wi = one ? w.wi[1] : w.wi[0];
    if ((lane == 0 || one) && (one ? w.has[1] : w.has[0])) job_out(j, m)[t * job_rows(j, m) + wi] = v;
}

template <class F, bool MIN>
__device__ __forceinline__ void mmvd_legacy2_kernel(const MmvJob &j, const i8 *aq,
                                                    const float2 *ads, int n_cols) {
    __shared__ RSmem<MIN, 2> smem[4];
    const int nb = n_cols >> 5;
    const int gw = blockIdx.x * 4 + (threadIdx.x >> 5);
    Rows2 w;
    rows2_of<true, true>(j, gw, fmt_row_bytes<F>(n_cols), w);
    PDL_ENTRY();
    const size_t t = blockIdx.y;
    const float v = mmvd_legacy2<F, MIN>(w.wp, aq + t * n_cols, ads + t * nb, nb,
                                         smem[threadIdx.x >> 5]);
    rows2_store<true>(j, gw, w, v);
}

// The weights of rows rr = 0..3 of group gw (as mmvd_row_of; row 0 of the first matrix, read
// and not stored, past the end), and with `pf` (and RT_PDL_PREFETCH: not with
// RUSTORCH_CUDA_PDL=1, as the other products) their L2 prefetch by this warp: part `part` of
// `parts` equal shares of each row (the cooperative kernels' four warps share their rows).
// (H100, tg128 --gpu-exact, three rounds each: without it the legacy formats lose 4-10%,
// Q4_K_M's Q4_K / Q6_K products gain 1-2%; docs/performance.md, session 16.)
__device__ __forceinline__ void mmvd_rows(const MmvJob &j, size_t row_bytes, const u8 *(&wp)[4],
                                          bool pf, int gw = -1, int part = 0, int parts = 1) {
#pragma unroll
    for (int rr = 0; rr < 4; rr++) {
        int m, wi;
        const bool has = mmvd_row_of(j, rr, m, wi, gw);
        wp[rr] = has ? job_w(j, m) + (size_t)wi * row_bytes : j.w[0];
#ifdef RT_PDL_PREFETCH
        const size_t q = (row_bytes + parts - 1) / parts, off = (size_t)part * q;
        if (pf && has && off < row_bytes)
            pdl_prefetch(wp[rr] + off, min(q, row_bytes - off), threadIdx.x & 31, 32);
#endif
    }
}

template <class F, bool MIN>
__device__ __forceinline__ void mmvd_legacy_kernel(const MmvJob &j, const i8 *aq,
                                                   const float2 *ads, int n_cols) {
    __shared__ RSmem<MIN, 4> smem[4];
    const int nb = n_cols >> 5;
    const u8 *wp[4];
    mmvd_rows(j, fmt_row_bytes<F>(n_cols), wp, true);
    PDL_ENTRY();
    int m, wi;
    const bool has = mmvd_row_of(j, (threadIdx.x & 31) >> 3, m, wi);
    const size_t t = blockIdx.y;
    const float v = mmvd_legacy<F, MIN>(wp, aq + t * n_cols, ads + t * nb, nb,
                                        smem[threadIdx.x >> 5]);
    mmvd_store(j, m, wi, has, v);
}

// Cooperative products (the `_c` kernels): a block of 128 threads per four rows. Every
// thread decodes groups of 32 of two of the rows (up to `cap` groups per row and round),
// staging their integer lane sums lane-major in dynamic shared memory as above, with each
// step's float factors; then warp 0 walks the chains. So a row's groups are loaded by four
// warps at once, in one round where they fit. A policy P stages group gi of a row:
//   LANES  integer sums per group (8: the legacy formats' and Q6_K's accumulator lanes; 2:
//          Q4_K's scale and minimum sums), GPB groups per chain step (1, or 8 for a
//          super-block), DL float factors per step (2 for Q4_K: d and dmin times d_a);
//   stage(row, gi, a, sc, v, d, m): v the sums, d the step's factors (when gi % GPB == 0),
//          m the legacy minimum term's two factors;
//   PF     whether the rows are prefetched into L2 before the wait (see mmvd_rows).
// A step is acc = fma(d, f32(sum of the step's GPB sums), acc) per chain.
// (MMVD_C_PF, and MMVD_C_PF8 for Q8_0: whether the cooperative legacy-format kernels, the
// down products, prefetch their rows into L2 before the wait. Q8_0's 12 MB streaming in
// while the short quantization launch before it runs slowed that launch more than it helped:
// H200, tg128 --gpu-exact Q8_0, three rounds: 1148.40, 1127.31, 1134.44 t/s without,
// 1105.05, 1103.96, 1114.72 with; Q4_0 the same either way, 1355.61, 1331.30, 1350.56
// against 1350.68, 1348.75, 1348.67.)
#ifndef MMVD_C_PF
#define MMVD_C_PF 1
#endif
// Session 28: where the gate/up launch made the down product's activations (mmvd_*_gq), no
// short launch runs before it for the prefetch to slow, and Q8_0's prefetching kernel
// `mmvd_q8_0_cp` is faster there (PF8 set: CoopLegacy's third parameter); elsewhere (several
// tokens: a quantization launch between) the host keeps `mmvd_q8_0_c`.
#ifndef MMVD_C_PF8
#define MMVD_C_PF8 0
#endif
template <class F, bool MIN_, bool PF8 = MMVD_C_PF8>
struct CoopLegacy {
    // (PF8 for the 8-bit format: more than 24 bytes per block of 32)
    enum {
        LANES = 8,
        GPB = 1,
        DL = 1,
        MIN = MIN_,
        PF = F::BYTES * 32 / F::QK > 24 ? PF8 : MMVD_C_PF
    };
    typedef F Fmt;
    static __device__ __forceinline__ size_t row_bytes(int n_cols) {
        return fmt_row_bytes<F>(n_cols);
    }
    static __device__ __forceinline__ void stage(const u8 *w, int gi, const i8 *a,
                                                 const void *sc, int (&v)[8], float (&d)[2],
                                                 float2 &m) {
        int av[8];
        group_acts(a, gi, av);
        const float2 ds = ((const float2 *)sc)[gi];
        Group g;
        decode_group<F>(w, gi, g);
        finish(g, av, ds, v, d, m);
    }
    // stage's work after the loads: a decoded group g against codes av with scales ds
    static __device__ __forceinline__ void finish(const Group &g, const int (&av)[8], float2 ds,
                                                  int (&v)[8], float (&d)[2], float2 &m) {
        legacy_lane_sums(g, av, v);
        d[0] = __fmul_rn(g.d0, ds.x);
        m = make_float2(g.m0, ds.y);
    }
};

// A cooperative kernel's staging of item (row rr, group jb) of a round: its LANES sums v,
// at a step's first group its DL factors d, and (P::MIN) the minimum term's factors mv.
template <class P>
__device__ __forceinline__ void coop_store(int *si, float *dd, float2 *mm, int C, int CS, int cap,
                                           int rr, int jb, const int (&v)[8], const float (&d)[2],
                                           float2 mv) {
    constexpr int L = P::LANES, GPB = P::GPB, DL = P::DL;
#pragma unroll
    for (int q = 0; q < L; q++) si[(rr * L + q) * C + jb] = v[q];
    if (GPB == 1 || (jb & (GPB - 1)) == 0) {
#pragma unroll
        for (int c = 0; c < DL; c++) dd[(rr * DL + c) * CS + jb / GPB] = d[c];
    }
    if (P::MIN) mm[rr * cap + jb] = mv;
}

// (MMVD_KC_PF: whether the cooperative Q4_K / Q6_K kernels, now only the longer rows' (down
// products), prefetch their rows before the wait too; on since session 24, about neutral
// there (session 16 measured it slower when every K-quant product was cooperative).)
#ifndef MMVD_KC_PF
#define MMVD_KC_PF 1
#endif
// Q6_K as mmve_q6k_row without `tiled`: lane k's sum of group g is sc * dot of values
// 4k..4k+3, less 32 * (the group's sc-weighted activation sum) in lane k = g.
struct CoopQ6K {
    enum { LANES = 8, GPB = 8, DL = 1, MIN = 0, PF = MMVD_KC_PF };
    static __device__ __forceinline__ size_t row_bytes(int n_cols) {
        return (size_t)(n_cols >> 8) * 210;
    }
    static __device__ __forceinline__ void stage(const u8 *w, int gi, const i8 *a,
                                                 const void *sc, int (&v)[8], float (&d)[2],
                                                 float2 &) {
        const u8 *blk = w + (size_t)(gi >> 3) * 210;
        const int g = gi & 7;
        int av[8];
        group_acts(a, gi, av);
        q6k_group_sums(blk, g, av, v);
        if (g == 0) d[0] = __fmul_rn(((const float *)sc)[gi >> 3], h2f(ld_u16(blk + 208)));
    }
};

// Q4_K as mmve_q4k_rows without gemm: sums sc * dot and m * (activation sum) per group;
// per super-block acc = fma(f32(isum), d_w * d_a, acc) and accm likewise with dmin; the
// value acc - accm.
struct CoopQ4K {
    enum { LANES = 2, GPB = 8, DL = 2, MIN = 0, PF = MMVD_KC_PF };
    static __device__ __forceinline__ size_t row_bytes(int n_cols) {
        return (size_t)(n_cols >> 8) * 144;
    }
    static __device__ __forceinline__ void stage(const u8 *w, int gi, const i8 *a,
                                                 const void *sc, int (&v)[8], float (&d)[2],
                                                 float2 &) {
        const u8 *blk = w + (size_t)(gi >> 3) * 144;
        const int g = gi & 7;
        int av[8];
        group_acts(a, gi, av);
        q4k_group_sums(blk, g, av, v[0], v[1]);
        if (g == 0) {
            const float da = ((const float *)sc)[gi >> 3];
            d[0] = __fmul_rn(h2f(ld_u16(blk)), da);
            d[1] = __fmul_rn(h2f(ld_u16(blk + 2)), da);
        }
    }
};

// A super-block policy's chain (GPB = 8): acc = fma(dp[s], f32(the sum of step s's eight
// staged sums), acc) for steps s = 0..n-1, the sums at sp (16-byte aligned).
__device__ __forceinline__ float kq_chain(const int *sp, const float *dp, int n, float acc) {
    for (int s = 0; s < n; s++) {
        const int4 s0 = *(const int4 *)(sp + 8 * s);
        const int4 s1 = *(const int4 *)(sp + 8 * s + 4);
        const int v = s0.x + s0.y + s0.z + s0.w + s1.x + s1.y + s1.z + s1.w;
        acc = __fmaf_rn(dp[s], __int2float_rn(v), acc);
    }
    return acc;
}

// (MMVD_C_ITEMS: how many items of a round each thread of a cooperative legacy-format
// kernel decodes with all their loads issued before any is staged, so that a down product's
// 2 x 176 items per round take one wait on memory per thread instead of three; 1: one item
// at a time, as the K-quant policies)
#ifndef MMVD_C_ITEMS
#define MMVD_C_ITEMS 3
#endif
// A legacy-format round of the cooperative kernel (P = CoopLegacy): the same stagings as
// P::stage, MMVD_C_ITEMS items per thread at once, their loads (block index clamped to the
// last item, the extra results dropped) before any store.
template <class P>
__device__ __forceinline__ void coop_legacy_items(const u8 *const (&wp)[4], int g0, int n,
                                                  const i8 *__restrict__ a,
                                                  const float2 *__restrict__ ads, int *si,
                                                  float *dd, float2 *mm, int C, int cap) {
    typedef typename P::Fmt F;
    constexpr int QI = MMVD_C_ITEMS;
    const int tid = threadIdx.x;
    for (int it0 = tid; it0 < 2 * n; it0 += 128 * QI) {
        int av[QI][8];
        float2 ds[QI];
        Group g[QI][2];
#pragma unroll
        for (int q = 0; q < QI; q++) {
            const int it = min(it0 + 128 * q, 2 * n - 1);
            const int half = it >= n, gi = g0 + it - half * n;
            group_acts(a, gi, av[q]);
            ds[q] = ads[gi];
#pragma unroll
            for (int k = 0; k < 2; k++)
                decode_group<F>(half ? wp[2 + k] : wp[k], gi, g[q][k]);
        }
#pragma unroll
        for (int q = 0; q < QI; q++) {
            const int it = it0 + 128 * q;
            if (it < 2 * n) {
                const int half = it >= n, jb = it - half * n;
#pragma unroll
                for (int k = 0; k < 2; k++) {
                    int v[8];
                    float d[2];
                    float2 mv;
                    P::finish(g[q][k], av[q], ds[q], v, d, mv);
                    coop_store<P>(si, dd, mm, C, cap + 4, cap, 2 * half + k, jb, v, d, mv);
                }
            }
        }
    }
}

template <class P>
__device__ __forceinline__ void mmvd_coop_kernel(const MmvJob &j, const i8 *__restrict__ aq,
                                                 const void *__restrict__ scales, int n_cols,
                                                 int cap) {
    extern __shared__ int4 dyn[];
    constexpr int L = P::LANES, GPB = P::GPB, DL = P::DL;
    const int C = cap + 4, CS = cap / GPB + 4;
    int *si = (int *)dyn;                      // [4][L][C]
    float *dd = (float *)(si + 4 * L * C);     // [4][DL][CS]
    float2 *mm = (float2 *)(dd + 4 * DL * CS); // [4][cap] (P::MIN)
    // (cap: a multiple of 8, so every 16-byte shared load is aligned and a round holds
    // whole super-blocks)
    const int ng = n_cols >> 5, tid = threadIdx.x;
    const size_t rb = P::row_bytes(n_cols);
    const u8 *wp[4];
    mmvd_rows(j, rb, wp, P::PF, blockIdx.x, tid >> 5, 4);
    PDL_ENTRY();
    const size_t t = blockIdx.y;
    const i8 *a = aq + t * n_cols;
    const void *sc = GPB == 8 ? (const void *)((const float *)scales + t * (ng >> 3))
                              : (const void *)((const float2 *)scales + t * ng);
    const int lane = tid & 31, r = lane >> 3, l = lane & 7;
    float acc = 0.0f, summs = 0.0f;
    for (int g0 = 0; g0 < ng; g0 += cap) {
        const int n = min(cap, ng - g0);
        // items: (pair of rows, group), the group fastest
        if constexpr (GPB == 1 && MMVD_C_ITEMS > 1) {
            coop_legacy_items<P>(wp, g0, n, a, (const float2 *)sc, si, dd, mm, C, cap);
        } else {
            for (int it = tid; it < 2 * n; it += 128) {
                const int half = it >= n, jb = it - half * n;
#pragma unroll
                for (int k = 0; k < 2; k++) {
                    const int rr = 2 * half + k;
                    int v[8];
                    float d[2];
                    float2 mv;
                    P::stage(rr == 0 ? wp[0] : rr == 1 ? wp[1] : rr == 2 ? wp[2] : wp[3],
                             g0 + jb, a, sc, v, d, mv);
                    coop_store<P>(si, dd, mm, C, CS, cap, rr, jb, v, d, mv);
                }
            }
        }
        __syncthreads();
        if (tid < 32 && l < L) {
            const int *sp = si + (r * L + l) * C;
            const float *dp = dd + (r * DL + (DL == 2 ? l : 0)) * CS;
            if constexpr (GPB == 1) {
                chain_walk<P::MIN>(sp, dp, mm + r * cap, n, l == 0, acc, summs);
            } else {
                acc = kq_chain(sp, dp, n / GPB, acc);
            }
        }
        __syncthreads();
    }
    if (tid >= 32) return;
    float v;
    if (DL == 2) {
        v = __fsub_rn(acc, __shfl_down_sync(FULL_MASK, acc, 1));
    } else {
        const float sum = hsum8_lanes(acc);
        v = P::MIN ? __fadd_rn(sum, summs) : sum;
    }
    int m, wi;
    const bool has = mmvd_row_of(j, r, m, wi, blockIdx.x);
    mmvd_store(j, m, wi, has, v);
}

#define MMVD_LEGACY(NAME, F, MIN)                                                             \
    extern "C" __global__ void __launch_bounds__(128)                                         \
        mmvd_##NAME(MmvJob j, const i8 *aq, const float2 *ads, int n_cols, int) {             \
        PDL_ENTRY_INSIDE();                                                                   \
        mmvd_legacy_kernel<F, MIN>(j, aq, ads, n_cols);                                       \
    }                                                                                         \
    extern "C" __global__ void __launch_bounds__(128)                                         \
        mmvd_##NAME##_c(MmvJob j, const i8 *aq, const float2 *ads, int n_cols, int cap) {     \
        PDL_ENTRY_INSIDE();                                                                   \
        mmvd_coop_kernel<CoopLegacy<F, MIN>>(j, aq, ads, n_cols, cap);                        \
    }
#define MMVD_LEGACY2(NAME, F, MIN)                                                            \
    extern "C" __global__ void __launch_bounds__(128)                                         \
        mmvd_##NAME##_r2(MmvJob j, const i8 *aq, const float2 *ads, int n_cols, int) {        \
        PDL_ENTRY_INSIDE();                                                                   \
        mmvd_legacy2_kernel<F, MIN>(j, aq, ads, n_cols);                                      \
    }
// One token's gate/up product (`mmvd_*` with glu) and, in the same launch, the quantization
// of its output that the down product takes (quantize_q8_1's, with `cpu`): blocks 4k..4k + 3
// store outputs 32k..32k + 31; each block, its stores done, counts itself in cnt[k], and
// the fourth to do so quantizes those 32 into (oq, ods). Rows a multiple of 32; every
// launch adds 4 to each count (they start at 0). (No quantize_q8_1 launch between the two
// products: docs/performance.md, session 28.)
template <class F, bool MIN>
__device__ __forceinline__ void mmvd_legacy_gq(const MmvJob &j, const i8 *aq, const float2 *ads,
                                               int n_cols, i8 *__restrict__ oq,
                                               float2 *__restrict__ ods, u32 *cnt, int cpu) {
    mmvd_legacy_kernel<F, MIN>(j, aq, ads, n_cols);
    __shared__ u32 last;
#ifdef RT_GQ_FENCE_ALL
    __threadfence();  // (timing only: every thread fences its own stores)
#endif
    __syncthreads();  // (the block's stores before thread 0's fence: cooperative groups'
                      // grid barrier pattern)
    const u32 k = blockIdx.x >> 2;
    if (threadIdx.x == 0) {
        __threadfence();  // (the block's stores, before the count)
        const bool l = (atomicAdd(cnt + k, 1u) & 3u) == 3u;
        if (l) __threadfence();  // (the other blocks' stores, before the loads below)
        last = l;
    }
    __syncthreads();
    if (!last || threadIdx.x >= 32) return;
    const size_t i = (size_t)k * 32 + threadIdx.x;
    quantize_lane(__ldcg(j.out[0] + i), oq, i, &ods[k], cpu);
}
#define MMVD_GQ(NAME, F, MIN)                                                                  \
    extern "C" __global__ void __launch_bounds__(128)                                         \
        mmvd_##NAME##_gq(MmvJob j, const i8 *aq, const float2 *ads, int n_cols, i8 *oq,       \
                         float2 *ods, u32 *cnt, int cpu) {                                    \
        PDL_ENTRY_INSIDE();                                                                   \
        mmvd_legacy_gq<F, MIN>(j, aq, ads, n_cols, oq, ods, cnt, cpu);                        \
    }
MMVD_GQ(q4_0, FQ4_0, false)
MMVD_GQ(q4_0t, FQ4_0T, false)
MMVD_GQ(q4_1, FQ4_1, true)
MMVD_GQ(q5_0, FQ5_0, false)
MMVD_GQ(q5_1, FQ5_1, true)
MMVD_GQ(q8_0, FQ8_0, false)
MMVD_GQ(q8_0t, FQ8_0T, false)
MMVD_LEGACY2(q4_0, FQ4_0, false)
MMVD_LEGACY2(q4_0t, FQ4_0T, false)
MMVD_LEGACY2(q4_1, FQ4_1, true)
MMVD_LEGACY2(q5_0, FQ5_0, false)
MMVD_LEGACY2(q5_1, FQ5_1, true)
MMVD_LEGACY2(q8_0, FQ8_0, false)
MMVD_LEGACY2(q8_0t, FQ8_0T, false)
MMVD_LEGACY(q4_0, FQ4_0, false)
MMVD_LEGACY(q4_0t, FQ4_0T, false)
MMVD_LEGACY(q4_1, FQ4_1, true)
MMVD_LEGACY(q5_0, FQ5_0, false)
MMVD_LEGACY(q5_1, FQ5_1, true)
MMVD_LEGACY(q8_0, FQ8_0, false)
MMVD_LEGACY(q8_0t, FQ8_0T, false)
extern "C" __global__ void __launch_bounds__(128)
    mmvd_q8_0_cp(MmvJob j, const i8 *aq, const float2 *ads, int n_cols, int cap) {
    PDL_ENTRY_INSIDE();
    mmvd_coop_kernel<CoopLegacy<FQ8_0, false, true>>(j, aq, ads, n_cols, cap);
}
extern "C" __global__ void __launch_bounds__(128)
    mmvd_q8_0t_cp(MmvJob j, const i8 *aq, const float2 *ads, int n_cols, int cap) {
    PDL_ENTRY_INSIDE();
    mmvd_coop_kernel<CoopLegacy<FQ8_0T, false, true>>(j, aq, ads, n_cols, cap);
}

#define MMVD_COOP(NAME, P, BOUNDS)                                                           \
    extern "C" __global__ void BOUNDS                                                       \
        mmvd_##NAME##_c(MmvJob j, const i8 *aq, const float *dq, int n_cols, int cap) {     \
        PDL_ENTRY_INSIDE();                                                                 \
        mmvd_coop_kernel<P>(j, aq, dq, n_cols, cap);                                        \
    }
// (MMVD_Q4K_MINB=N: Q4_K's blocks of 128 held N to a multiprocessor, the compiler keeping to
// 65536 / (128 N) registers a thread: fewer waves for the gate/up product's 2816 blocks.
// Default 8: 64 registers, no spills, against 68 with no bound (the build before this one).
// H200, tg128 --gpu-exact Q4_K_M, three rounds: 1129.8, 1131.4, 1129.7 t/s against 1107.8,
// 1118.8, 1121.4; N = 9: 56 registers with spills, 1086.3, 1101.7, 1079.2.)
#ifndef MMVD_Q4K_MINB
#define MMVD_Q4K_MINB 8
#endif
MMVD_COOP(q4_k, CoopQ4K, __launch_bounds__(128, MMVD_Q4K_MINB))
MMVD_COOP(q6_k, CoopQ6K, __launch_bounds__(128))

// Q4_K and Q6_K rows of up to RUSTORCH_CUDA_COOP_MIN groups (`mmvd_*_w`): four rows per warp,
// as the legacy formats' `mmvd_*` (a cooperative block per four rows made a gate/up product
// of 2816 blocks, about three waves). Each pass of 32 groups every lane stages group
// g0 + lane of all four rows with the cooperative policy P; then thread (r, l), l < LANES,
// walks row r's chain l over the pass's super-blocks, the cooperative kernel's steps in the
// same order (so the same bits). Their rows are prefetched into L2 before the wait, unlike
// the cooperative K-quant kernels' (H200, tg128 --gpu-exact Q4_K_M, two rounds: 1088.04,
// 1093.47 t/s without it, 1218.60, 1226.34 with it, 1213.27, 1218.64 cooperative;
// `RUSTORCH_CUDA_DEFS=MMVD_W_PF=0` for the variant without).
#ifndef MMVD_W_PF
#define MMVD_W_PF 1
#endif
// (R rows per warp: 4, passes of 32 groups; 2 (mmvd_warp2_kernel), passes of 64)
template <class P, int R>
struct __align__(16) WarpKSmem {
    int si[R][P::LANES][128 / R + 4];
    float dd[R][P::DL][128 / R / P::GPB + 4];
};

// Group jj's staging for row rr: its LANES sums, and at a super-block's first group its
// factors.
template <class P, int R>
__device__ __forceinline__ void kq_store(WarpKSmem<P, R> &st, int rr, int jj, const int (&v)[8],
                                         const float (&d)[2]) {
#pragma unroll
    for (int q = 0; q < P::LANES; q++) st.si[rr][q][jj] = v[q];
    if ((jj & (P::GPB - 1)) == 0) {
#pragma unroll
        for (int c = 0; c < P::DL; c++) st.dd[rr][c][jj / P::GPB] = d[c];
    }
}

// Thread (r, l)'s walk of a pass's n super-blocks of row r (l < LANES).
template <class P, int R>
__device__ __forceinline__ float kq_pass(const WarpKSmem<P, R> &st, int r, int l, int n,
                                         float acc) {
    return kq_chain(st.si[r][l], st.dd[r][P::DL == 2 ? l : 0], n, acc);
}

// A row's value from its walked chains, at lane 8r: acc - accm (Q4_K's two chains) or the
// sum of the eight lanes' (Q6_K).
template <class P>
__device__ __forceinline__ float kq_value(float acc) {
    return P::DL == 2 ? __fsub_rn(acc, __shfl_down_sync(FULL_MASK, acc, 1)) : hsum8_lanes(acc);
}

template <class P>
__device__ __forceinline__ void mmvd_warp_kernel(const MmvJob &j, const i8 *__restrict__ aq,
                                                 const float *__restrict__ scales, int n_cols,
                                                 WarpKSmem<P, 4> &st) {
    constexpr int L = P::LANES, GPB = P::GPB;
    static_assert(GPB == 8, "super-block policies only");
    const int ng = n_cols >> 5;
    const u8 *wp[4];
    mmvd_rows(j, P::row_bytes(n_cols), wp, MMVD_W_PF);
    PDL_ENTRY();
    const size_t t = blockIdx.y;
    const i8 *a = aq + t * n_cols;
    const float *sc = scales + t * (ng >> 3);
    const int lane = threadIdx.x & 31, r = lane >> 3, l = lane & 7;
    float acc = 0.0f;
    for (int g0 = 0; g0 < ng; g0 += 32) {
        const int gi = g0 + lane;
        if (gi < ng) {
#pragma unroll
            for (int rr = 0; rr < 4; rr++) {
                int v[8];
                float d[2];
                float2 mv;
                P::stage(wp[rr], gi, a, sc, v, d, mv);
                kq_store(st, rr, lane, v, d);
            }
        }
        __syncwarp();
        if (l < L) acc = kq_pass(st, r, l, min(32, ng - g0) / GPB, acc);
        __syncwarp();
    }
    const float v = kq_value<P>(acc);
    int m, wi;
    const bool has = mmvd_row_of(j, r, m, wi);
    mmvd_store(j, m, wi, has, v);
}

// One pass of mmvd_warp2_kernel (groups g0 .. g0 + 63 of rows wp[0] and wp[1]): each lane
// stages groups g0 + lane and g0 + lane + 32 of both rows (all four stagings' loads before
// any store), then threads (r, l), r < 2, l < LANES, walk the chains.
template <class P>
__device__ __forceinline__ float kq2_pass(WarpKSmem<P, 2> &st, const u8 *const (&wp)[2], int g0,
                                          int ng, const i8 *a, const float *sc, float acc) {
    constexpr int L = P::LANES, GPB = P::GPB;
    const int lane = threadIdx.x & 31, r = (lane >> 3) & 1, l = lane & 7;
    int v[2][2][8];
    float d[2][2][2];
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const int gi = min(g0 + lane + 32 * h, ng - 1);
#pragma unroll
        for (int rr = 0; rr < 2; rr++) {
            float2 mv;
            P::stage(wp[rr], gi, a, sc, v[h][rr], d[h][rr], mv);
        }
    }
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const int jj = lane + 32 * h;
        if (g0 + jj < ng) {
#pragma unroll
            for (int rr = 0; rr < 2; rr++) kq_store(st, rr, jj, v[h][rr], d[h][rr]);
        }
    }
    __syncwarp();
    if (lane < 16 && l < L) acc = kq_pass(st, r, l, min(64, ng - g0) / GPB, acc);
    __syncwarp();
    return acc;
}

// Q4_K and Q6_K rows of up to 64 groups, two rows per warp in one pass (`mmvd_*_w2`, not
// gate/up; RUSTORCH_CUDA_MMVD_R2 as the legacy formats' `mmvd_*_r2`): each lane stages groups
// lane and lane + 32 of both rows (all four stagings' loads before any store), then threads
// (r, l), r < 2, l < LANES, walk the chains as mmvd_warp_kernel does (so the same bits).
template <class P>
__device__ __forceinline__ void mmvd_warp2_kernel(const MmvJob &j, const i8 *__restrict__ aq,
                                                  const float *__restrict__ scales, int n_cols,
                                                  WarpKSmem<P, 2> &st) {
    static_assert(P::GPB == 8, "super-block policies only");
    const int ng = n_cols >> 5;
    const int gw = blockIdx.x * 4 + (threadIdx.x >> 5);
    Rows2 w;
    rows2_of<false, MMVD_W_PF>(j, gw, P::row_bytes(n_cols), w);
    PDL_ENTRY();
    const size_t t = blockIdx.y;
    const i8 *a = aq + t * n_cols;
    const float *sc = scales + t * (ng >> 3);
    float acc = 0.0f;
    for (int g0 = 0; g0 < ng; g0 += 64) acc = kq2_pass<P>(st, w.wp, g0, ng, a, sc, acc);
    rows2_store<false>(j, gw, w, kq_value<P>(acc));
}

// R = 4: mmvd_warp_kernel, 2: mmvd_warp2_kernel.
template <class P, int R>
__device__ __forceinline__ void mmvd_kwarp(const MmvJob &j, const i8 *aq, const float *dq,
                                           int n_cols, WarpKSmem<P, R> &st) {
    if constexpr (R == 4) mmvd_warp_kernel<P>(j, aq, dq, n_cols, st);
    else mmvd_warp2_kernel<P>(j, aq, dq, n_cols, st);
}

#define MMVD_WARPK(NAME, P)                                                                   \
    extern "C" __global__ void __launch_bounds__(128)                                         \
        mmvd_##NAME##_w(MmvJob j, const i8 *aq, const float *dq, int n_cols, int) {           \
        PDL_ENTRY_INSIDE();                                                                   \
        __shared__ WarpKSmem<P, 4> smem[4];                                                   \
        mmvd_kwarp<P, 4>(j, aq, dq, n_cols, smem[threadIdx.x >> 5]);                          \
    }                                                                                         \
    extern "C" __global__ void __launch_bounds__(128)                                         \
        mmvd_##NAME##_w2(MmvJob j, const i8 *aq, const float *dq, int n_cols, int) {          \
        PDL_ENTRY_INSIDE();                                                                   \
        __shared__ WarpKSmem<P, 2> smem[4];                                                   \
        mmvd_kwarp<P, 2>(j, aq, dq, n_cols, smem[threadIdx.x >> 5]);                          \
    }
MMVD_WARPK(q4_k, CoopQ4K)
MMVD_WARPK(q6_k, CoopQ6K)

// Q6_K matrices of many rows (the output matrix; the host picks it, RUSTORCH_CUDA_W2P_MIN):
// mmvd_q6_k_w2's steps in the same order (so the same bits), but each warp walks the row
// pairs gw, gw + G, gw + 2G, ... (G warps in the grid), their bytes copied into shared
// memory by coalesced 16-byte cp.async copies (a warp's copy instruction reads 512
// contiguous bytes, where the lanes' own loads of their groups touch about six lines each),
// the next pair's copy in flight while this one is staged. One matrix, rows of up to 64
// groups, 16-byte multiples (1680 bytes at 2048 columns).
#define W2P_MAX16 105
extern "C" __global__ void __launch_bounds__(128)
    mmvd_q6_k_p2(MmvJob j, const i8 *aq, const float *dq, int n_cols, int) {
    PDL_ENTRY_INSIDE();
    __shared__ WarpKSmem<CoopQ6K, 2> smem[4];
    __shared__ __align__(16) int4 raw[4][2][2 * W2P_MAX16];  // warp, buffer, both rows
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int ng = n_cols >> 5, rows = j.rows[0], npairs = (rows + 1) >> 1;
    const size_t rb = CoopQ6K::row_bytes(n_cols);
    const int n16 = (int)(rb >> 4), G = gridDim.x * 4;
    // pair p's rows into buffer b (the last row again past the end: read, not stored)
    auto issue = [&](int p, int b) {
        if (p < npairs) {
#pragma unroll
            for (int rr = 0; rr < 2; rr++) {
                const int4 *src = (const int4 *)(j.w[0] + (size_t)min(2 * p + rr, rows - 1) * rb);
                int4 *dst = raw[warp][b] + rr * n16;
                for (int i = lane; i < n16; i += 32) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
                    const u32 sa = (u32)__cvta_generic_to_shared(dst + i);
                    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(sa), "l"(src + i));
#else
                    dst[i] = src[i];  // (no cp.async before sm_80: copied at once)
#endif
                }
            }
        }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
        asm volatile("cp.async.commit_group;" ::: "memory");
#endif
    };
    int p = blockIdx.x * 4 + warp, b = 0;
    issue(p, 0);  // (weights: no kernel writes them, so before the wait)
    PDL_ENTRY();
    const size_t t = blockIdx.y;
    const i8 *a = aq + t * n_cols;
    const float *sc = dq + t * (ng >> 3);
    for (; p < npairs; p += G, b ^= 1) {
        issue(p + G, b ^ 1);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
        asm volatile("cp.async.wait_group 1;" ::: "memory");
#endif
        __syncwarp();
        const u8 *wp[2] = {(const u8 *)raw[warp][b], (const u8 *)(raw[warp][b] + n16)};
        // (kq2_pass's last __syncwarp follows every read of buffer b, which the next round's
        // copies overwrite)
        const float acc = kq2_pass<CoopQ6K>(smem[warp], wp, 0, ng, a, sc, 0.0f);
        Rows2 w;
        rows2_of<false, false>(j, p, rb, w);
        rows2_store<false>(j, p, w, kq_value<CoopQ6K>(acc));
    }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_all;" ::: "memory");
#endif
}

// Q4_K and Q6_K matrices of one launch (as mmvd_q4k6k_c below), R rows per warp: each warp's
// rows lie in one matrix (the host checks that every matrix but the last has a multiple of
// four rows) and take its policy.
template <int R>
__device__ __forceinline__ void mmvd_q4k6k_warp(const MmvJob &j, const i8 *aq, const float *dq,
                                                int n_cols) {
    constexpr size_t SZ = sizeof(WarpKSmem<CoopQ6K, R>) > sizeof(WarpKSmem<CoopQ4K, R>)
                              ? sizeof(WarpKSmem<CoopQ6K, R>)
                              : sizeof(WarpKSmem<CoopQ4K, R>);
    __shared__ int4 raw[4 * SZ / 16];
    char *mine = (char *)raw + (threadIdx.x >> 5) * SZ;
    int m = 0, wi = R * (blockIdx.x * 4 + (threadIdx.x >> 5));
    if constexpr (R == 4) mmvd_row_of(j, 0, m, wi);
    else job_row(j, m, wi);
    if ((j.q6k >> m) & 1)
        mmvd_kwarp<CoopQ6K, R>(j, aq, dq, n_cols, *(WarpKSmem<CoopQ6K, R> *)mine);
    else
        mmvd_kwarp<CoopQ4K, R>(j, aq, dq, n_cols, *(WarpKSmem<CoopQ4K, R> *)mine);
}
extern "C" __global__ void __launch_bounds__(128)
    mmvd_q4k6k_w(MmvJob j, const i8 *aq, const float *dq, int n_cols, int) {
    PDL_ENTRY_INSIDE();
    mmvd_q4k6k_warp<4>(j, aq, dq, n_cols);
}
extern "C" __global__ void __launch_bounds__(128)
    mmvd_q4k6k_w2(MmvJob j, const i8 *aq, const float *dq, int n_cols, int) {
    PDL_ENTRY_INSIDE();
    mmvd_q4k6k_warp<2>(j, aq, dq, n_cols);
}

// Q4_K and Q6_K matrices of one input in one launch (llama-quantize's Q4_K_M gives some
// layers' V a Q6_K matrix beside Q4_K Q and K: one launch instead of two). Every block's four
// rows lie in one matrix (the host checks that each matrix but the last has a multiple of 4
// rows), Q6_K where bit m of j.q6k is set; shared memory the larger policy's. (Not bounded
// as mmvd_q4_k_c: Q6_K's path then spills; a Q/K/V launch's 640 blocks fit in one wave.)
extern "C" __global__ void __launch_bounds__(128)
    mmvd_q4k6k_c(MmvJob j, const i8 *aq, const float *dq, int n_cols, int cap) {
    PDL_ENTRY_INSIDE();
    int m, wi;
    mmvd_row_of(j, 0, m, wi, blockIdx.x);
    if ((j.q6k >> m) & 1) mmvd_coop_kernel<CoopQ6K>(j, aq, dq, n_cols, cap);
    else mmvd_coop_kernel<CoopQ4K>(j, aq, dq, n_cols, cap);
}
