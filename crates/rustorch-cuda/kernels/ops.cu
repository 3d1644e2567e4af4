// Element-wise and row-wise transformer ops on f32 activations, computed like the CPU
// kernels of rustorch-core (kernels/ops.rs): same rounding points where that is cheap.

// out = rms_norm(x) * w per row of n values (out may equal x). Sum of squares in f64 as the
// CPU does; one block per row, blockDim a multiple of 32. With y, first x += y (stored).
// With quant (n a multiple of 32), out is also quantized into (aq, ads) as quantize_q8_1
// does (cpu: its ggml-cpu rule): each warp's 32 consecutive values form one block. With eq
// (n a multiple of 256; exact mode), out is also quantized to Q8_K into (eq, edq) as
// quantize_q8_k does (rows below n_4x8 with the 4x8 rule), for the products that take Q8_K.
#define RMS_REG 4
extern "C" __global__ void rms_norm(float *x, const float *__restrict__ y,
                                    const float *__restrict__ w, float *out, int n, float eps,
                                    i8 *__restrict__ aq, float2 *__restrict__ ads, int quant,
                                    int cpu, i8 *__restrict__ eq, float *__restrict__ edq,
                                    int n_4x8) {
    PDL_ENTRY_INSIDE();
    // the first RMS_REG weights of each thread (see below) are loaded before the wait:
    // no kernel writes them, and they are often no longer in L2
    float wv[RMS_REG];
#pragma unroll
    for (int k = 0; k < RMS_REG; k++) {
        const int i = threadIdx.x + k * blockDim.x;
        wv[k] = i < n ? w[i] : 0.0f;
    }
    PDL_ENTRY();
#if defined(RT_NORM_EMPTY)
    return;  // timing only: the stage without its work
#elif defined(RT_NORM_NOQ)
    quant = 0;  // timing only: the norm without its quantizations
    eq = 0;
#endif
    __shared__ double sm[32];
    const size_t base = (size_t)blockIdx.x * n;
    double s = 0.0;
    // the first RMS_REG values of each thread (all of them up to RMS_REG * blockDim) stay in
    // registers with their weights, all loaded before any is used, so neither pass waits on
    // memory more than once
    float xv[RMS_REG];
#pragma unroll
    for (int k = 0; k < RMS_REG; k++) {
        const int i = threadIdx.x + k * blockDim.x;
        xv[k] = 0.0f;
        if (i < n) {
            xv[k] = x[base + i];
            if (y != 0) xv[k] = xv[k] + y[base + i];
        }
    }
#pragma unroll
    for (int k = 0; k < RMS_REG; k++) {
        const int i = threadIdx.x + k * blockDim.x;
        if (i < n) {
            if (y != 0) x[base + i] = xv[k];
            s += (double)__fmul_rn(xv[k], xv[k]);
        }
    }
#pragma unroll 4
    for (int i = threadIdx.x + RMS_REG * blockDim.x; i < n; i += blockDim.x) {
        float v = x[base + i];
        if (y != 0) {
            v = v + y[base + i];
            x[base + i] = v;
        }
        s += (double)__fmul_rn(v, v);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(FULL_MASK, s, o);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (lane == 0) sm[warp] = s;
    __syncthreads();
    if (warp == 0) {
        s = lane < (int)(blockDim.x >> 5) ? sm[lane] : 0.0;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(FULL_MASK, s, o);
#ifdef RT_NORM_ONCE
        // (prepared, not yet timed on a GPU: the scale's f64 division, square root and f32
        // division by one thread instead of every warp; docs/performance.md, session 23)
        if (lane == 0) ((float *)sm)[0] = 1.0f / sqrtf((float)(s / (double)n) + eps);
#else
        if (lane == 0) sm[0] = s;
#endif
    }
    __syncthreads();
#ifdef RT_NORM_ONCE
    const float scale = ((const float *)sm)[0];
#else
    // (n a power of two: the division as a multiplication by 2^-k, the same rounding of the
    // same real value, one DMUL instead of a DDIV sequence)
    const double inv2k = __longlong_as_double((long long)(1023 - (__ffs(n) - 1)) << 52);
    const float mean = (float)((n & (n - 1)) == 0 ? sm[0] * inv2k : sm[0] / (double)n);
    const float scale = 1.0f / sqrtf(mean + eps);
#endif
    const int ng = n >> 5;
    // (i < n is the same for a whole warp: n and blockDim are multiples of 32 when quant)
#pragma unroll
    for (int k = 0; k < RMS_REG; k++) {
        const int i = threadIdx.x + k * blockDim.x;
        if (i < n) {
            const float o = __fmul_rn(__fmul_rn(xv[k], scale), wv[k]);
            out[base + i] = o;
            if (quant)  // the warp holds block i / 32
                quantize_lane(o, aq, base + i, &ads[(size_t)blockIdx.x * ng + (i >> 5)], cpu);
        }
    }
#pragma unroll 4
    for (int i = threadIdx.x + RMS_REG * blockDim.x; i < n; i += blockDim.x) {
        const float o = __fmul_rn(__fmul_rn(x[base + i], scale), w[i]);
        out[base + i] = o;
        if (quant)
            quantize_lane(o, aq, base + i, &ads[(size_t)blockIdx.x * ng + (i >> 5)], cpu);
    }
    if (eq != 0) {
        __syncthreads();  // (this block's `out` visible to all its threads)
        const int nsb = n >> 8, nw = blockDim.x >> 5;
        for (int sb = warp; sb < nsb; sb += nw)
            q8k_warp(out + base + (size_t)sb * 256, eq + base + (size_t)sb * 256,
                     edq + (size_t)blockIdx.x * nsb + sb, (int)blockIdx.x < n_4x8);
    }
}

// cos/sin of the RoPE angle of pair i for each row's position: theta = pos * theta_scale^i
// by repeated f32 multiplication (as the CPU does), divided by the pair's frequency factor,
// times freq_scale.
extern "C" __global__ void rope_angles(const u32 *__restrict__ pos, const float *__restrict__ ff,
                                       float *__restrict__ cs, float *__restrict__ sn, int n_rows,
                                       int half, float theta_scale, float freq_scale) {
    PDL_ENTRY();
    const int idx = blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= n_rows * half) return;
    const int r = idx / half, i = idx % half;
    float theta = (float)pos[r];
    for (int k = 0; k < i; k++) theta = __fmul_rn(theta, theta_scale);
    const float f = ff != 0 ? ff[i] : 1.0f;
    const float t = __fmul_rn(freq_scale, __fdiv_rn(theta, f));
    cs[idx] = cosf(t);
    sn[idx] = sinf(t);
}

// Rotates the first n_rot values of every head (head_dim values) of every row (width
// values) by the row's angles. neox: pairs (i, i + n_rot/2); otherwise (2i, 2i + 1).
extern "C" __global__ void rope(float *x, const float *__restrict__ cs, const float *__restrict__ sn,
                                int n_rows, int width, int head_dim, int n_rot, int neox) {
    PDL_ENTRY();
    const int half = n_rot / 2;
    const int heads = width / head_dim;
    const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long long)n_rows * heads * half) return;
    const int i = (int)(idx % half);
    const long long rh = idx / half;
    const int r = (int)(rh / heads), h = (int)(rh % heads);
    float *hp = x + (size_t)r * width + (size_t)h * head_dim;
    const float c = cs[(size_t)r * half + i], s = sn[(size_t)r * half + i];
    const int i0 = neox ? i : 2 * i;
    const int i1 = neox ? i + half : 2 * i + 1;
    const float x0 = hp[i0], x1 = hp[i1];
    hp[i0] = __fmaf_rn(x0, c, -__fmul_rn(x1, s));
    hp[i1] = __fmaf_rn(x0, s, __fmul_rn(x1, c));
}

extern "C" __global__ void copy_f32(float *__restrict__ x, const float *__restrict__ y,
                                    long long n) {
    PDL_ENTRY();
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = y[i];
}

extern "C" __global__ void add_f32(float *x, const float *__restrict__ y, long long n) {
    PDL_ENTRY();
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = x[i] + y[i];
}

// x[i] += b[i % len]
extern "C" __global__ void add_bias(float *x, const float *__restrict__ b, long long n, int len) {
    PDL_ENTRY();
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = x[i] + b[i % len];
}

extern "C" __global__ void scale_f32(float *x, float s, long long n) {
    PDL_ENTRY();
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = __fmul_rn(x[i], s);
}

// x = tanh(x / cap) * cap
extern "C" __global__ void softcap_f32(float *x, float cap, long long n) {
    PDL_ENTRY();
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = __fmul_rn(tanhf(__fmul_rn(x[i], 1.0f / cap)), cap);
}

// gate = silu(gate) * up over rows of n_row values, as ggml's CPU backend computes it
// (exact.cu swiglu_cpu)
extern "C" __global__ void swiglu(float *gate, const float *__restrict__ up, long long n,
                                  int n_row) {
    PDL_ENTRY();
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) gate[i] = swiglu_cpu(gate[i], up[i], (int)(i % n_row), n_row);
}

// gate = gelu(gate) * up, ggml's tanh approximation
extern "C" __global__ void geglu(float *gate, const float *__restrict__ up, long long n) {
    PDL_ENTRY();
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        const float x = gate[i];
        const float inner = __fmaf_rn(__fmul_rn(0.044715f, x), x, 1.0f);
        const float g = __fmul_rn(1.0f + tanhf(__fmul_rn(__fmul_rn(0.7978846f, x), inner)),
                                  __fmul_rn(0.5f, x));
        gate[i] = __fmul_rn(g, up[i]);
    }
}

// Keeps rows `rows[k]` of x (rows of width values) as rows k of out.
extern "C" __global__ void gather_rows(const float *__restrict__ x, const u32 *__restrict__ rows,
                                       float *__restrict__ out, int width, int n_out) {
    PDL_ENTRY();
    const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long long)n_out * width) return;
    const int k = (int)(idx / width), i = (int)(idx % width);
    out[idx] = x[(size_t)rows[k] * width + i];
}

// Writes row r of k and v (kv_dim values) as f16 into slot slots[r] of one layer's pools.
extern "C" __global__ void kv_write(const float *__restrict__ k, const float *__restrict__ v,
                                    u16 *__restrict__ K, u16 *__restrict__ V,
                                    const u32 *__restrict__ slots, int n_rows, int kv_dim) {
    PDL_ENTRY();
    const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long long)n_rows * kv_dim) return;
    const int r = (int)(idx / kv_dim), i = (int)(idx % kv_dim);
    const size_t o = (size_t)slots[r] * kv_dim + i;
    K[o] = f2h(k[idx]);
    V[o] = f2h(v[idx]);
}

// Cache pools of n_layer layers, layer_stride halves apart: for each pair j, slot
// pairs[2j+1] of every layer becomes a copy of slot pairs[2j] (keys and values).
extern "C" __global__ void kv_copy(u16 *K, u16 *V, const u32 *__restrict__ pairs, int n_pairs,
                                   int n_layer, long long layer_stride, int kv_dim) {
    PDL_ENTRY();
    const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long long)n_layer * n_pairs * kv_dim) return;
    const int i = (int)(idx % kv_dim);
    const long long lj = idx / kv_dim;
    const int j = (int)(lj % n_pairs), l = (int)(lj / n_pairs);
    const size_t base = (size_t)l * layer_stride + i;
    const size_t src = base + (size_t)pairs[2 * j] * kv_dim;
    const size_t dst = base + (size_t)pairs[2 * j + 1] * kv_dim;
    K[dst] = K[src];
    V[dst] = V[src];
}

// Context shift: rotates the keys of slots[0..n] (every layer, every head of head_dim
// values) by one angle set (cs/sn, n_rot/2 values), in f32 between f16 loads and stores,
// as the host cache does.
extern "C" __global__ void kv_shift(u16 *K, const u32 *__restrict__ slots, int n,
                                    int n_layer, long long layer_stride, int kv_dim,
                                    int head_dim, int n_rot, int neox,
                                    const float *__restrict__ cs, const float *__restrict__ sn) {
    PDL_ENTRY();
    const int half = n_rot / 2;
    const int heads = kv_dim / head_dim;
    const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long long)n_layer * n * heads * half) return;
    const int i = (int)(idx % half);
    long long rest = idx / half;
    const int h = (int)(rest % heads);
    rest /= heads;
    const int j = (int)(rest % n), l = (int)(rest / n);
    u16 *hp = K + (size_t)l * layer_stride + (size_t)slots[j] * kv_dim + (size_t)h * head_dim;
    const int i0 = neox ? i : 2 * i;
    const int i1 = neox ? i + half : 2 * i + 1;
    const float c = cs[i], s = sn[i];
    const float x0 = h2f(hp[i0]), x1 = h2f(hp[i1]);
    hp[i0] = f2h(__fmaf_rn(x0, c, -__fmul_rn(x1, s)));
    hp[i1] = f2h(__fmaf_rn(x0, s, __fmul_rn(x1, c)));
}

// RoPE of q and k and their cache write in one launch, for one batch of n_rows rows:
// q (nh heads) and k (nkv heads) rotated in place as `rope` does (head_dim values per head,
// the first n_rot rotated), and row r's rotated k and its v written as f16 into slot
// slots[r] of one layer's pools. Index space: q pairs, k pairs (each also written to the
// cache), v values, then the unrotated tail of each k head.
extern "C" __global__ void rope_kv_write(float *q, float *k, const float *__restrict__ v,
                                         const float *__restrict__ cs,
                                         const float *__restrict__ sn, u16 *__restrict__ K,
                                         u16 *__restrict__ V, const u32 *__restrict__ slots,
                                         int n_rows, int nh, int nkv, int head_dim, int n_rot,
                                         int neox) {
    PDL_ENTRY();
    const int half = n_rot / 2;
    const int kv_dim = nkv * head_dim;
    const long long nq = (long long)n_rows * nh * half;
    const long long nk = (long long)n_rows * nkv * half;
    const long long nv = (long long)n_rows * kv_dim;
    const long long nt = (long long)n_rows * nkv * (head_dim - n_rot);
    long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx < nq + nk) {
        const bool is_k = idx >= nq;
        if (is_k) idx -= nq;
        const int heads = is_k ? nkv : nh;
        const int i = (int)(idx % half);
        const long long rh = idx / half;
        const int r = (int)(rh / heads), h = (int)(rh % heads);
        float *hp = (is_k ? k : q) + (size_t)r * heads * head_dim + (size_t)h * head_dim;
        const float c = cs[(size_t)r * half + i], s = sn[(size_t)r * half + i];
        const int i0 = neox ? i : 2 * i;
        const int i1 = neox ? i + half : 2 * i + 1;
        const float x0 = hp[i0], x1 = hp[i1];
        const float y0 = __fmaf_rn(x0, c, -__fmul_rn(x1, s));
        const float y1 = __fmaf_rn(x0, s, __fmul_rn(x1, c));
        hp[i0] = y0;
        hp[i1] = y1;
        if (is_k) {
            u16 *kr = K + (size_t)slots[r] * kv_dim + (size_t)h * head_dim;
            kr[i0] = f2h(y0);
            kr[i1] = f2h(y1);
        }
        return;
    }
    idx -= nq + nk;
    if (idx < nv) {
        const int r = (int)(idx / kv_dim), i = (int)(idx % kv_dim);
        V[(size_t)slots[r] * kv_dim + i] = f2h(v[idx]);
        return;
    }
    idx -= nv;
    if (idx < nt) {
        const int tail = head_dim - n_rot;
        const int j = (int)(idx % tail);
        const long long rh = idx / tail;
        const int r = (int)(rh / nkv), h = (int)(rh % nkv);
        const size_t e = (size_t)h * head_dim + n_rot + j;
        K[(size_t)slots[r] * kv_dim + e] = f2h(k[(size_t)r * kv_dim + e]);
    }
}
