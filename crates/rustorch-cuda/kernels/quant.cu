// Weights in their GGUF block layouts: matrix-vector products against activations quantized
// to 8-bit blocks of 32 (MMVQ), dequantized rows (embedding look-ups), and the activation
// quantizer.
//
// Every format is read 32 weights at a time (a "group": one activation block). A group
// decodes to 32 small integers (8 ints of 4 signed bytes, in activation order) and, for
// each half of 16 weights, a scale `d`, an integer zero point `z` and a float offset `m`:
//
//     weight[i] = d[i/16] * (v[i] + z[i/16]) + m[i/16]
//
// so the product with activation block (a, ad) is exact integer dot products (dp4a) scaled
// once per half: ad * (d0*(S0 + z0*A0) + d1*(S1 + z1*A1) + m0*A0 + m1*A1), where S is
// sum(v*a) and A is sum(a) over the half.

struct Group {
    int v[8];
    float d0, d1;
    int z0, z1;
    float m0, m1;
};

__device__ __forceinline__ void set_scales(Group &o, float d, int z, float m) {
    o.d0 = d; o.d1 = d; o.z0 = z; o.z1 = z; o.m0 = m; o.m1 = m;
}

// The 16 IQ4_NL grid values as signed bytes, four per int.
#define IQ4_T0 0xBFAD9881u  // -127, -104, -83, -65
#define IQ4_T1 0xF6EADDCFu  //  -49,  -35, -22, -10
#define IQ4_T2 0x26190D01u  //    1,   13,  25,  38
#define IQ4_T3 0x71594535u  //   53,   69,  89, 113

__device__ __forceinline__ u32 prmt(u32 a, u32 b, u32 sel) {
    u32 r;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(sel));
    return r;
}

// Four 4-bit codes (the low nibble of each byte of x) looked up in the IQ4_NL grid.
__device__ __forceinline__ int iq4_lookup(u32 x) {
    u32 sel = (x & 7) | ((x >> 4) & 0x70) | ((x >> 8) & 0x700) | ((x >> 12) & 0x7000);
    u32 lo = prmt(IQ4_T0, IQ4_T1, sel);
    u32 hi = prmt(IQ4_T2, IQ4_T3, sel);
    u32 mask = ((x >> 3) & 0x01010101u) * 0xFFu;
    return (int)((lo & ~mask) | (hi & mask));
}

// ---------------------------------------------------------------------------------------
// Formats. QK: weights per block; BYTES: bytes per block; decode(block, g, out) reads
// group g (0 .. QK/32) of a block.

// Q4_0's 16 code bytes q: the low nibbles are weights 0..15, the high ones 16..31.
__device__ __forceinline__ void q4_0_codes(const int (&q)[4], float d, Group &o) {
#pragma unroll
    for (int k = 0; k < 4; k++) {
        o.v[k] = q[k] & 0x0F0F0F0F;
        o.v[k + 4] = (q[k] >> 4) & 0x0F0F0F0F;
    }
    set_scales(o, d, -8, 0.0f);
}

struct FQ4_0 {
    enum { QK = 32, BYTES = 18 };
    static __device__ __forceinline__ void decode(const u8 *b, int, Group &o) {
        const float d = h2f(ld_u16(b));
        int q[4];
        ld_ints_a2<4>(b + 2, q);
        q4_0_codes(q, d, o);
    }
};

struct FQ4_1 {
    enum { QK = 32, BYTES = 20 };
    static __device__ __forceinline__ void decode(const u8 *b, int, Group &o) {
        float d = h2f(ld_u16(b));
        float m = h2f(ld_u16(b + 2));
#pragma unroll
        for (int k = 0; k < 4; k++) {
            int w = ld_i32_a4(b + 4 + 4 * k);
            o.v[k] = w & 0x0F0F0F0F;
            o.v[k + 4] = (w >> 4) & 0x0F0F0F0F;
        }
        set_scales(o, d, 0, m);
    }
};

// The fifth bits of weights 4k..4k+3 (bits 4k.. of qh) moved to bit 4 of each byte.
__device__ __forceinline__ int spread_bits4(u32 qh, int first) {
    u32 r = 0;
#pragma unroll
    for (int i = 0; i < 4; i++) r |= ((qh >> (first + i)) & 1u) << (8 * i + 4);
    return (int)r;
}

struct FQ5_0 {
    enum { QK = 32, BYTES = 22 };
    static __device__ __forceinline__ void decode(const u8 *b, int, Group &o) {
        float d = h2f(ld_u16(b));
        int q[5];  // qh, then the 16 bytes of low nibbles
        ld_ints_a2<5>(b + 2, q);
        const u32 qh = (u32)q[0];
#pragma unroll
        for (int k = 0; k < 4; k++) {
            int w = q[k + 1];
            o.v[k] = (w & 0x0F0F0F0F) | spread_bits4(qh, 4 * k);
            o.v[k + 4] = ((w >> 4) & 0x0F0F0F0F) | spread_bits4(qh, 16 + 4 * k);
        }
        set_scales(o, d, -16, 0.0f);
    }
};

struct FQ5_1 {
    enum { QK = 32, BYTES = 24 };
    static __device__ __forceinline__ void decode(const u8 *b, int, Group &o) {
        float d = h2f(ld_u16(b));
        float m = h2f(ld_u16(b + 2));
        u32 qh = (u32)ld_i32_a4(b + 4);
#pragma unroll
        for (int k = 0; k < 4; k++) {
            int w = ld_i32_a4(b + 8 + 4 * k);
            o.v[k] = (w & 0x0F0F0F0F) | spread_bits4(qh, 4 * k);
            o.v[k + 4] = ((w >> 4) & 0x0F0F0F0F) | spread_bits4(qh, 16 + 4 * k);
        }
        set_scales(o, d, 0, m);
    }
};

struct FQ8_0 {
    enum { QK = 32, BYTES = 34 };
    static __device__ __forceinline__ void decode(const u8 *b, int, Group &o) {
        float d = h2f(ld_u16(b));
#pragma unroll
        ld_ints_a2<8>(b + 2, o.v);
        set_scales(o, d, 0, 0.0f);
    }
};

// Q8_0 and Q4_0 as the device keeps rows whose width is a multiple of 512 (the host reorders
// them at upload: kernels.rs, `tiled`; the same bytes, not a dequantized copy): tiles of 16
// blocks, the 16 f16 scales, then the blocks' code bytes in 16-byte pieces, piece p of every
// block together (Q8_0: 544 bytes, two pieces; Q4_0: 288 bytes, one). So a block's codes
// are aligned 16-byte loads, where GGUF's 34- and 18-byte blocks at 2-byte alignment take
// nine (five) 4-byte loads and eight (four) funnel shifts, and lanes reading consecutive
// blocks read consecutive pieces. Group g is block g of the tile.
__device__ __forceinline__ void tile_piece(const u8 *b, int g, int p, int (&q)[4]) {
    const int4 c = *(const int4 *)(b + 32 + 256 * p + 16 * g);
    q[0] = c.x; q[1] = c.y; q[2] = c.z; q[3] = c.w;
}

struct FQ8_0T {
    enum { QK = 512, BYTES = 544 };
    static __device__ __forceinline__ void decode(const u8 *b, int g, Group &o) {
        const float d = h2f(ld_u16(b + 2 * g));
        int q[2][4];
        tile_piece(b, g, 0, q[0]);
        tile_piece(b, g, 1, q[1]);
#pragma unroll
        for (int k = 0; k < 8; k++) o.v[k] = q[k >> 2][k & 3];
        set_scales(o, d, 0, 0.0f);
    }
};

struct FQ4_0T {
    enum { QK = 512, BYTES = 288 };
    static __device__ __forceinline__ void decode(const u8 *b, int g, Group &o) {
        const float d = h2f(ld_u16(b + 2 * g));
        int q[4];
        tile_piece(b, g, 0, q);
        q4_0_codes(q, d, o);
    }
};

// Group gi (of 32 weights) of a row of format F, and the bytes of a row of n_cols: the
// tiled formats' block index and byte count in unsigned arithmetic, shifts instead of a
// signed division's sequence (H200, tg128 --gpu-exact, 8 runs each: Q8_0 median 1307 against
// 1290 t/s, Q4_0 1482 against 1469; docs/performance.md, session 30).
template <class F>
__device__ __forceinline__ void decode_group(const u8 *row, int gi, Group &o) {
    constexpr int GPB = F::QK / 32;
    if constexpr (GPB > 1)
        F::decode(row + (size_t)((u32)gi / (u32)GPB) * F::BYTES, (int)((u32)gi % (u32)GPB), o);
    else
        F::decode(row + (size_t)gi * F::BYTES, 0, o);
}
template <class F>
__device__ __forceinline__ size_t fmt_row_bytes(int n_cols) {
    if constexpr (F::QK > 32)
        return (size_t)((u32)n_cols / (u32)F::QK) * F::BYTES;
    else
        return (size_t)(n_cols >> 5) * F::BYTES;
}

struct FIQ4_NL {
    enum { QK = 32, BYTES = 18 };
    static __device__ __forceinline__ void decode(const u8 *b, int, Group &o) {
        float d = h2f(ld_u16(b));
        int q[4];
        ld_ints_a2<4>(b + 2, q);
#pragma unroll
        for (int k = 0; k < 4; k++) {
            u32 w = (u32)q[k];
            o.v[k] = iq4_lookup(w & 0x0F0F0F0Fu);
            o.v[k + 4] = iq4_lookup((w >> 4) & 0x0F0F0F0Fu);
        }
        set_scales(o, d, 0, 0.0f);
    }
};

struct FIQ4_XS {
    enum { QK = 256, BYTES = 136 };
    static __device__ __forceinline__ void decode(const u8 *b, int g, Group &o) {
        float d = h2f(ld_u16(b));
        u32 sh = ld_u16(b + 2);
        int ls = ((b[4 + g / 2] >> (4 * (g % 2))) & 15) | (((sh >> (2 * g)) & 3) << 4);
        const u8 *q = b + 8 + 16 * g;
#pragma unroll
        for (int k = 0; k < 4; k++) {
            u32 w = (u32)ld_i32_a4(q + 4 * k);
            o.v[k] = iq4_lookup(w & 0x0F0F0F0Fu);
            o.v[k + 4] = iq4_lookup((w >> 4) & 0x0F0F0F0Fu);
        }
        set_scales(o, __fmul_rn(d, (float)(ls - 32)), 0, 0.0f);
    }
};

struct FQ2_K {
    enum { QK = 256, BYTES = 84 };
    static __device__ __forceinline__ void decode(const u8 *b, int g, Group &o) {
        float d = h2f(ld_u16(b + 80));
        float dmin = h2f(ld_u16(b + 82));
        int half = g >> 2, shift = 2 * (g & 3);
        const u8 *q = b + 16 + 32 * half;
#pragma unroll
        for (int k = 0; k < 8; k++) o.v[k] = (ld_i32_a4(q + 4 * k) >> shift) & 0x03030303;
        int sc0 = b[half * 8 + 2 * (g & 3)], sc1 = b[half * 8 + 2 * (g & 3) + 1];
        o.d0 = __fmul_rn(d, (float)(sc0 & 15));
        o.d1 = __fmul_rn(d, (float)(sc1 & 15));
        o.z0 = 0; o.z1 = 0;
        o.m0 = -__fmul_rn(dmin, (float)(sc0 >> 4));
        o.m1 = -__fmul_rn(dmin, (float)(sc1 >> 4));
    }
};

__device__ __forceinline__ int scale_q3k(const u8 *s, int j) {
    int low = j < 8 ? (s[j] & 15) : (s[j - 8] >> 4);
    return low | (((s[8 + j % 4] >> (2 * (j / 4))) & 3) << 4);
}

struct FQ3_K {
    enum { QK = 256, BYTES = 110 };
    static __device__ __forceinline__ void decode(const u8 *b, int g, Group &o) {
        float d = h2f(ld_u16(b + 108));
        int half = g >> 2, shift = 2 * (g & 3);
        const u8 *q = b + 32 + 32 * half;
        int ql[8], qm[8];
        ld_ints_a2<8>(q, ql);
        ld_ints_a2<8>(b, qm);
#pragma unroll
        for (int k = 0; k < 8; k++) {
            int lo = (ql[k] >> shift) & 0x03030303;
            int hi = (((u32)qm[k]) >> g) & 0x01010101u;
            o.v[k] = lo | (hi << 2);
        }
        o.d0 = __fmul_rn(d, (float)(scale_q3k(b + 96, 2 * g) - 32));
        o.d1 = __fmul_rn(d, (float)(scale_q3k(b + 96, 2 * g + 1) - 32));
        o.z0 = -4; o.z1 = -4;
        o.m0 = 0.0f; o.m1 = 0.0f;
    }
};

// The 6-bit scale and min of sub-block j of Q4_K / Q5_K.
__device__ __forceinline__ void scale_min_k4(const u8 *q, int j, int &sc, int &m) {
    if (j < 4) {
        sc = q[j] & 63;
        m = q[j + 4] & 63;
    } else {
        sc = (q[j + 4] & 15) | ((q[j - 4] >> 6) << 4);
        m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

// Byte k (0..11) of the 12 scale bytes held in three words.
__device__ __forceinline__ u32 byte_of3(u32 s0, u32 s1, u32 s2, int k) {
    const u32 w = k < 4 ? s0 : (k < 8 ? s1 : s2);
    return (w >> (8 * (k & 3))) & 0xFF;
}

// Q4_K blocks are 144 bytes, so in rows of whole blocks at a 16-byte-aligned base (every
// weight upload) each block, its header and its 32-byte quant runs are 16-byte aligned:
// one 16-byte load for d, dmin and the scales, two for a group's quants.
struct FQ4_K {
    enum { QK = 256, BYTES = 144 };
    static __device__ __forceinline__ void decode(const u8 *b, int g, Group &o) {
        const uint4 h = *(const uint4 *)b;
        float d = h2f((u16)(h.x & 0xFFFF));
        float dmin = h2f((u16)(h.x >> 16));
        const uint4 *q = (const uint4 *)(b + 16 + 32 * (g >> 1));
        const uint4 q0 = q[0], q1 = q[1];
        const u32 qw[8] = {q0.x, q0.y, q0.z, q0.w, q1.x, q1.y, q1.z, q1.w};
        int shift = 4 * (g & 1);
#pragma unroll
        for (int k = 0; k < 8; k++) o.v[k] = ((int)qw[k] >> shift) & 0x0F0F0F0F;
        // scale_min_k4 on the header's scale bytes
        int sc, m;
        if (g < 4) {
            sc = (int)byte_of3(h.y, h.z, h.w, g) & 63;
            m = (int)byte_of3(h.y, h.z, h.w, g + 4) & 63;
        } else {
            sc = (int)((byte_of3(h.y, h.z, h.w, g + 4) & 15) |
                       ((byte_of3(h.y, h.z, h.w, g - 4) >> 6) << 4));
            m = (int)((byte_of3(h.y, h.z, h.w, g + 4) >> 4) |
                      ((byte_of3(h.y, h.z, h.w, g) >> 6) << 4));
        }
        set_scales(o, __fmul_rn(d, (float)sc), 0, -__fmul_rn(dmin, (float)m));
    }
};

struct FQ5_K {
    enum { QK = 256, BYTES = 176 };
    static __device__ __forceinline__ void decode(const u8 *b, int g, Group &o) {
        float d = h2f(ld_u16(b));
        float dmin = h2f(ld_u16(b + 2));
        const u8 *q = b + 48 + 32 * (g >> 1);
        int shift = 4 * (g & 1);
#pragma unroll
        for (int k = 0; k < 8; k++) {
            int lo = (ld_i32_a4(q + 4 * k) >> shift) & 0x0F0F0F0F;
            int hi = (((u32)ld_i32_a4(b + 16 + 4 * k)) >> g) & 0x01010101u;
            o.v[k] = lo | (hi << 4);
        }
        int sc, m;
        scale_min_k4(b + 4, g, sc, m);
        set_scales(o, __fmul_rn(d, (float)sc), 0, -__fmul_rn(dmin, (float)m));
    }
};

struct FQ6_K {
    enum { QK = 256, BYTES = 210 };
    static __device__ __forceinline__ void decode(const u8 *b, int g, Group &o) {
        float d = h2f(ld_u16(b + 208));
        int h = g >> 2, j = g & 3;
        const u8 *ql = b + 64 * h + 32 * (j & 1);
        const u8 *qh = b + 128 + 32 * h;
        int sl = 4 * (j >> 1), shh = 2 * j;
        int wl[8], wh[8];
        ld_ints_a2<8>(ql, wl);
        ld_ints_a2<8>(qh, wh);
#pragma unroll
        for (int k = 0; k < 8; k++) {
            int lo = (wl[k] >> sl) & 0x0F0F0F0F;
            int hi = (((u32)wh[k]) >> shh) & 0x03030303u;
            o.v[k] = lo | (hi << 4);
        }
        const i8 *sc = (const i8 *)(b + 192 + 8 * h + 2 * j);
        o.d0 = __fmul_rn(d, (float)sc[0]);
        o.d1 = __fmul_rn(d, (float)sc[1]);
        o.z0 = -32; o.z1 = -32;
        o.m0 = 0.0f; o.m1 = 0.0f;
    }
};

// ---------------------------------------------------------------------------------------
// Activations: per token, n_cols int8 codes (aq) and per block of 32 (d, s = d * sum of
// codes) (ads), with d = max|x| / 127. Two rules: code = round(x * (1 / d)) with d and s kept
// in f32; or (cpu != 0) ggml-cpu's x86 encoding, which our CPU backend reproduces:
// code = round_half_even(x * (127 / max|x|)), d and s rounded to f16 (as its Q8_0/Q8_1
// blocks store them).

extern "C" __global__ void quantize_q8_1(const float *__restrict__ x, i8 *__restrict__ aq,
                                         float2 *__restrict__ ads, int n_cols, int cpu) {
    PDL_ENTRY();
    const int ng = n_cols >> 5;
    const int g = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    const int t = blockIdx.y;
    if (g >= ng) return;
    const size_t i = (size_t)t * n_cols + g * 32 + lane;
    quantize_lane(x[i], aq, i, &ads[(size_t)t * ng + g], cpu);
}

// ---------------------------------------------------------------------------------------
// out[t][row] = sum over groups of W[row] . act[t], for n_tok <= NT tokens at once. Each row
// is served by `tpr` threads (32, 64 or 128) of a 128-thread block.

#define MMV_THREADS 128

// One group's product with an activation block (a, ads = (d, s)). Legacy formats (one
// block of 32, one scale and offset) as ggml-cpu: (d_w * d_a) * sum_i + m * s.
template <class F>
__device__ __forceinline__ float group_dot(const Group &w, const int4 *a, float2 ads) {
    const float ad = ads.x;
    int4 a0 = a[0], a1 = a[1];
    int s0 = dp4a(w.v[0], a0.x, 0);
    s0 = dp4a(w.v[1], a0.y, s0);
    s0 = dp4a(w.v[2], a0.z, s0);
    s0 = dp4a(w.v[3], a0.w, s0);
    int s1 = dp4a(w.v[4], a1.x, 0);
    s1 = dp4a(w.v[5], a1.y, s1);
    s1 = dp4a(w.v[6], a1.z, s1);
    s1 = dp4a(w.v[7], a1.w, s1);
    const int ones = 0x01010101;
    int u0 = dp4a(ones, a0.x, 0);
    u0 = dp4a(ones, a0.y, u0);
    u0 = dp4a(ones, a0.z, u0);
    u0 = dp4a(ones, a0.w, u0);
    int u1 = dp4a(ones, a1.x, 0);
    u1 = dp4a(ones, a1.y, u1);
    u1 = dp4a(ones, a1.z, u1);
    u1 = dp4a(ones, a1.w, u1);
    if (F::QK == 32) {
        const int si = s0 + s1 + w.z0 * (u0 + u1);
        return __fmaf_rn(__fmul_rn(w.d0, ad), (float)si, __fmul_rn(w.m0, ads.y));
    }
    float r = w.d0 * (float)(s0 + w.z0 * u0) + w.d1 * (float)(s1 + w.z1 * u1) +
              w.m0 * (float)u0 + w.m1 * (float)u1;
    return ad * r;
}

// Sums acc[t] over the `tpr` threads of each row; the row's first thread (threadIdx.x % tpr
// == 0) ends with the totals. Every thread of the block must call it.
template <int NT>
__device__ __forceinline__ void row_reduce(float (&acc)[NT], int tpr) {
    __shared__ float sm[NT][MMV_THREADS / 32];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
#pragma unroll
    for (int t = 0; t < NT; t++) acc[t] = warp_sum(acc[t]);
    if (tpr <= 32) return;
    __syncthreads();  // a previous reduction may still read sm
    if (lane == 0) {
#pragma unroll
        for (int t = 0; t < NT; t++) sm[t][warp] = acc[t];
    }
    __syncthreads();
    const int wpr = tpr >> 5;
    if ((threadIdx.x % tpr) == 0) {
#pragma unroll
        for (int t = 0; t < NT; t++) {
            float s = 0.0f;
            for (int w = 0; w < wpr; w++) s += sm[t][warp + w];
            acc[t] = s;
        }
    }
}

// Sums acc[t] over the `tpr` threads of each row and writes the row's outputs.
template <int NT>
__device__ __forceinline__ void row_reduce_store(float (&acc)[NT], float *out, int row, int n_rows,
                                                 int n_tok, int tpr) {
    row_reduce<NT>(acc, tpr);
    if ((threadIdx.x % tpr) == 0 && row < n_rows) {
#pragma unroll
        for (int t = 0; t < NT; t++)
            if (t < n_tok) out[(size_t)t * n_rows + row] = acc[t];
    }
}

// This thread's partial sums of row `row` of W against the quantized activations.
template <class F, int NT>
__device__ __forceinline__ void mmvq_acc(const u8 *__restrict__ W, const i8 *__restrict__ aq,
                                         const float2 *__restrict__ ads, int row, int n_rows,
                                         int n_cols, int n_tok, int tpr, float (&acc)[NT]) {
    const int lane = threadIdx.x % tpr;
    const int ng = n_cols >> 5;
    const int gpb = F::QK / 32;
    const size_t row_bytes = (size_t)(n_cols / F::QK) * F::BYTES;
#pragma unroll
    for (int t = 0; t < NT; t++) acc[t] = 0.0f;
    if (row < n_rows) {
        const u8 *wr = W + (size_t)row * row_bytes;
        for (int gi = lane; gi < ng; gi += tpr) {
            Group w;
            F::decode(wr + (size_t)(gi / gpb) * F::BYTES, gi % gpb, w);
#pragma unroll
            for (int t = 0; t < NT; t++) {
                if (t < n_tok) {
                    const int4 *a = (const int4 *)(aq + (size_t)t * n_cols) + 2 * gi;
                    acc[t] += group_dot<F>(w, a, ads[(size_t)t * ng + gi]);
                }
            }
        }
    }
}

// Up to three matrices of one format and width against the same activations, in one launch:
// blocks 0.. serve matrix 0's rows, the next ones matrix 1's, ... With `glu` (1 = SiLU,
// 2 = GELU) blocks serve rows of matrices 0 and 1 (same row count) together and write
// out[0] = act(x.W0) * (x.W1), the arithmetic of the swiglu/geglu kernels.
struct MmvJob {
    const u8 *w[3];
    float *out[3];
    int rows[3];
    int n;
    int glu;
    int q6k;  // (mmvd_q4k6k_c: bit m set where matrix m is Q6_K, the others Q4_K)
};

// Matrix m's fields by selects, not by indexing: indexing the parameter with a run-time m
// makes the compiler copy the whole struct to local memory.
__device__ __forceinline__ int job_rows(const MmvJob &j, int m) {
    return m == 0 ? j.rows[0] : m == 1 ? j.rows[1] : j.rows[2];
}
__device__ __forceinline__ const u8 *job_w(const MmvJob &j, int m) {
    return m == 0 ? j.w[0] : m == 1 ? j.w[1] : j.w[2];
}
__device__ __forceinline__ float *job_out(const MmvJob &j, int m) {
    return m == 0 ? j.out[0] : m == 1 ? j.out[1] : j.out[2];
}

// Row `wi` of a one-token product counted matrix after matrix (with `glu`, row `wi` of
// both): which matrix `m`, and `wi` within it. False past the last row.
__device__ __forceinline__ bool job_row(const MmvJob &j, int &m, int &wi) {
    m = 0;
    if (!j.glu) {
        for (; m < j.n - 1; m++) {
            if (wi < job_rows(j, m)) break;
            wi -= job_rows(j, m);
        }
    }
    return wi < job_rows(j, m);
}

// The row of a one-token product's warp (a warp per row), as job_row.
__device__ __forceinline__ bool job_warp_row(const MmvJob &j, int &m, int &wi) {
    wi = blockIdx.x * (MMV_THREADS / 32) + (threadIdx.x >> 5);
    return job_row(j, m, wi);
}

// The gated activation of gate value x and up value u: glu 1 = SiLU, 2 = ggml's tanh GELU.
__device__ __forceinline__ float glu_act(int glu, float x, float u) {
    float g;
    if (glu == 1) {
        g = __fdiv_rn(x, 1.0f + expf(-x));
    } else {
        const float inner = __fmaf_rn(__fmul_rn(0.044715f, x), x, 1.0f);
        g = __fmul_rn(1.0f + tanhf(__fmul_rn(__fmul_rn(0.7978846f, x), inner)), __fmul_rn(0.5f, x));
    }
    return __fmul_rn(g, u);
}

template <class F, int NT>
__device__ __forceinline__ void mmvq(const MmvJob &j, const i8 *__restrict__ aq,
                                     const float2 *__restrict__ ads, int n_cols, int n_tok,
                                     int tpr) {
    const int rpb = MMV_THREADS / tpr;
    int b = blockIdx.x, m = 0;
    if (!j.glu) {
        for (; m < j.n - 1; m++) {
            const int nb = (job_rows(j, m) + rpb - 1) / rpb;
            if (b < nb) break;
            b -= nb;
        }
    }
    const int n_rows = job_rows(j, m);
    const int row = b * rpb + threadIdx.x / tpr;
    float acc[NT];
    mmvq_acc<F, NT>(job_w(j, m), aq, ads, row, n_rows, n_cols, n_tok, tpr, acc);
    if (!j.glu) {
        row_reduce_store<NT>(acc, job_out(j, m), row, n_rows, n_tok, tpr);
        return;
    }
    row_reduce<NT>(acc, tpr);
    float up[NT];
    mmvq_acc<F, NT>(j.w[1], aq, ads, row, n_rows, n_cols, n_tok, tpr, up);
    row_reduce<NT>(up, tpr);
    if ((threadIdx.x % tpr) == 0 && row < n_rows) {
#pragma unroll
        for (int t = 0; t < NT; t++) {
            if (t < n_tok) j.out[0][(size_t)t * n_rows + row] = glu_act(j.glu, acc[t], up[t]);
        }
    }
}

// One token (decode): a warp per row, each lane walking groups lane, lane + 32, ... with its
// loads for several groups in flight, summed by shuffles alone (no shared memory, no block
// barrier). Rows are mapped as in `mmvq`; with `glu` the warp computes the gate and up rows.
// (Staging each 32-group chunk through shared memory with 16-byte loads was slower on an
// H100: fewer loads in flight per warp.)
// Largest block of the one-token float job kernels (mmv1j_*: MMV_THREADS, or more where
// each block computes a folded norm).
#define MMV1J_MAX_THREADS 512

// One-token float products with S warps per row (S = 1, 2 or 4, consecutive warps of a
// block): the parts' sums added in part order through shared memory; true in part 0.
__device__ __forceinline__ bool split_sum2(float2 &v, int S) {
    if (S == 1) return true;
    __shared__ float2 sm_split[32];
    const int warp = threadIdx.x >> 5;
    if ((threadIdx.x & 31) == 0) sm_split[warp] = v;
    __syncthreads();
    if (warp % S != 0) return false;
    float2 r = sm_split[warp];
    for (int k = 1; k < S; k++) {
        r.x += sm_split[warp + k].x;
        r.y += sm_split[warp + k].y;
    }
    v = r;
    return true;
}

// With MMV_PF_BYTES > 0 (and RT_PDL_PREFETCH), before a one-token float product waits for
// the kernel before it, the first warp of each row asks L2 for the row's first
// MMV_PF_BYTES bytes (both rows with `glu`), so the first loads after the wait hit L2.
// (H100, F16 TinyLlama shape, tg128: none 789/802 t/s, 1024 bytes 828/843, 4096 bytes 783,
// whole rows 769/759: whole rows are what session 10 found slower.)
#ifndef MMV_PF_BYTES
#define MMV_PF_BYTES 1024
#endif
__device__ __forceinline__ void mmv_pf_row(const u8 *w, size_t rb) {
#if defined(RT_PDL_PREFETCH) && MMV_PF_BYTES > 0
    pdl_prefetch(w, min(rb, (size_t)MMV_PF_BYTES), threadIdx.x & 31, 32);
#endif
}

template <int TY>
__device__ __forceinline__ void mmv1_prefetch(const u8 *W, int n_rows, int n_cols, int S) {
    const int gw = blockIdx.x * (MMV_THREADS / 32) + (threadIdx.x >> 5);
    const size_t rb = (size_t)n_cols * (TY == 0 ? 4 : 2);
    if (gw % S == 0 && gw / S < n_rows) mmv_pf_row(W + (size_t)(gw / S) * rb, rb);
}

template <int TY>
__device__ __forceinline__ void mmv1j_prefetch(const MmvJob &j, int n_cols, int S) {
    const int gw = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    int m, wi = gw / S;
    if (gw % S != 0 || !job_row(j, m, wi)) return;
    const size_t rb = (size_t)n_cols * (TY == 0 ? 4 : 2);
    mmv_pf_row(job_w(j, m) + (size_t)wi * rb, rb);
    if (j.glu) mmv_pf_row(j.w[1] + (size_t)wi * rb, rb);
}

// With `acc` the row's value is also added into acc[row] (a residual add folded into the
// product that feeds it; each row is one warp's, so no two warps touch one value).
template <class F>
__device__ __forceinline__ float mmvq_row1(const u8 *__restrict__ wr, const i8 *__restrict__ aq,
                                           const float2 *__restrict__ ads, int ng, int part = 0,
                                           int S = 1) {
    const int lane = threadIdx.x & 31;
    const int gpb = F::QK / 32;
    float acc = 0.0f;
    // (part of S: the lane's groups part * 32 + lane, then every 32 * S)
#pragma unroll 4
    for (int gi = part * 32 + lane; gi < ng; gi += 32 * S) {
        Group w;
        F::decode(wr + (size_t)(gi / gpb) * F::BYTES, gi % gpb, w);
        const int4 *a = (const int4 *)aq + 2 * gi;
        acc += group_dot<F>(w, a, ads[gi]);
    }
    return warp_sum(acc);
}

// Two rows of one format against the same activations in one walk (gate and up): both
// rows' loads are in flight together instead of one row's after the other's.
template <class F>
__device__ __forceinline__ float2 mmvq_row1x2(const u8 *__restrict__ w0, const u8 *__restrict__ w1,
                                              const i8 *__restrict__ aq,
                                              const float2 *__restrict__ ads, int ng) {
    const int lane = threadIdx.x & 31;
    const int gpb = F::QK / 32;
    float a0 = 0.0f, a1 = 0.0f;
#pragma unroll 2
    for (int gi = lane; gi < ng; gi += 32) {
        const size_t o = (size_t)(gi / gpb) * F::BYTES;
        Group g0, g1;
        F::decode(w0 + o, gi % gpb, g0);
        F::decode(w1 + o, gi % gpb, g1);
        const int4 *a = (const int4 *)aq + 2 * gi;
        const float2 ad = ads[gi];
        a0 += group_dot<F>(g0, a, ad);
        a1 += group_dot<F>(g1, a, ad);
    }
    float2 r;
    r.x = warp_sum(a0);
    r.y = warp_sum(a1);
    return r;
}

// With RT_PDL_PREFETCH, before a one-token product waits for the kernel before it (see
// PDL_ENTRY), each warp asks L2 for its rows' weights, which no kernel writes: the weights
// stream in while the previous kernel finishes. (The float products do not: on an H100
// prefetching F16 rows cost 2.5%, 576 against 590 t/s.)
// (With S warps per row, each warp its part's share of the row's bytes.)
template <class F>
__device__ __forceinline__ void mmvq1_prefetch(const MmvJob &j, int n_cols, int S) {
#ifdef RT_PDL_PREFETCH
    const int gw = blockIdx.x * (MMV_THREADS / 32) + (threadIdx.x >> 5);
    int m, wi = gw / S;
    if (!job_row(j, m, wi)) return;
    const size_t row_bytes = (size_t)(n_cols / F::QK) * F::BYTES;
    const size_t share = (row_bytes / S + 127) & ~(size_t)127, off = (size_t)(gw % S) * share;
    if (off >= row_bytes) return;
    const size_t len = min(share, row_bytes - off);
    const int lane = threadIdx.x & 31;
    pdl_prefetch(job_w(j, m) + (size_t)wi * row_bytes + off, len, lane, 32);
    if (j.glu) pdl_prefetch(j.w[1] + (size_t)wi * row_bytes + off, len, lane, 32);
#endif
}

// A warp per row, or S (1, 2 or 4) consecutive warps of a block per row without `glu` (the
// parts' sums added through shared memory, as the float products do).
template <class F>
__device__ __forceinline__ void mmvq1(const MmvJob &j, const i8 *__restrict__ aq,
                                      const float2 *__restrict__ ads, int n_cols, int S) {
    const int ng = n_cols >> 5;
    const size_t row_bytes = (size_t)(n_cols / F::QK) * F::BYTES;
    if (S > 1 && !j.glu) {
        const int gw = blockIdx.x * (MMV_THREADS / 32) + (threadIdx.x >> 5);
        int m, wi = gw / S;
        const bool has = job_row(j, m, wi);
        float2 v = make_float2(0.0f, 0.0f);
        if (has) v.x = mmvq_row1<F>(job_w(j, m) + (size_t)wi * row_bytes, aq, ads, ng, gw % S, S);
        if (split_sum2(v, S) && has && (threadIdx.x & 31) == 0) job_out(j, m)[wi] = v.x;
        return;
    }
    int m, wi;
    if (!job_warp_row(j, m, wi)) return;  // the whole warp: no block barrier follows
    if (!j.glu) {
        const float x = mmvq_row1<F>(job_w(j, m) + (size_t)wi * row_bytes, aq, ads, ng);
        if ((threadIdx.x & 31) == 0) job_out(j, m)[wi] = x;
        return;
    }
    const float2 xu =
        mmvq_row1x2<F>(j.w[0] + (size_t)wi * row_bytes, j.w[1] + (size_t)wi * row_bytes, aq, ads, ng);
    if ((threadIdx.x & 31) == 0) j.out[0][wi] = glu_act(j.glu, xu.x, xu.y);
}

// Gate and up rows r and r + 1 (rows rb bytes apart) in one walk: four rows' loads in flight,
// each row summed in the order of mmvq_row1x2. (gate r, up r, gate r + 1, up r + 1)
template <class F>
__device__ __forceinline__ float4 mmvq_row2x2(const u8 *__restrict__ w0, const u8 *__restrict__ w1,
                                              size_t rb, const i8 *__restrict__ aq,
                                              const float2 *__restrict__ ads, int ng) {
    const int lane = threadIdx.x & 31;
    const int gpb = F::QK / 32;
    float a0 = 0.0f, a1 = 0.0f, a2 = 0.0f, a3 = 0.0f;
    for (int gi = lane; gi < ng; gi += 32) {
        const size_t o = (size_t)(gi / gpb) * F::BYTES;
        Group g0, g1, g2, g3;
        F::decode(w0 + o, gi % gpb, g0);
        F::decode(w1 + o, gi % gpb, g1);
        F::decode(w0 + rb + o, gi % gpb, g2);
        F::decode(w1 + rb + o, gi % gpb, g3);
        const int4 *a = (const int4 *)aq + 2 * gi;
        const float2 ad = ads[gi];
        a0 += group_dot<F>(g0, a, ad);
        a1 += group_dot<F>(g1, a, ad);
        a2 += group_dot<F>(g2, a, ad);
        a3 += group_dot<F>(g3, a, ad);
    }
    return make_float4(warp_sum(a0), warp_sum(a1), warp_sum(a2), warp_sum(a3));
}

// One token: `out = act(x·W0) ⊙ x·W1` as mmvq1 computes it with `glu`, and `out` quantized
// into (oq, ods) as quantize_q8_1 does, for the next product, in the same launch: a block of
// GLUQ_THREADS takes 32 consecutive rows (two per warp; rows a multiple of 32), so that one
// warp then holds a whole block of 32 values to quantize.
#define GLUQ_THREADS 512
template <class F>
__device__ __forceinline__ void mmvq1_gluq(const MmvJob &j, const i8 *__restrict__ aq,
                                           const float2 *__restrict__ ads, int n_cols,
                                           i8 *__restrict__ oq, float2 *__restrict__ ods,
                                           int cpu) {
    __shared__ float vals[32];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int row0 = blockIdx.x * 32, r = row0 + 2 * warp;
    const size_t rb = (size_t)(n_cols / F::QK) * F::BYTES;
    const float4 s = mmvq_row2x2<F>(j.w[0] + (size_t)r * rb, j.w[1] + (size_t)r * rb, rb, aq,
                                    ads, n_cols >> 5);
    if (lane == 0) {
        const float o0 = glu_act(j.glu, s.x, s.y), o1 = glu_act(j.glu, s.z, s.w);
        j.out[0][r] = o0;
        j.out[0][r + 1] = o1;
        vals[2 * warp] = o0;
        vals[2 * warp + 1] = o1;
    }
    __syncthreads();
    if (warp == 0) quantize_lane(vals[lane], oq, (size_t)row0 + lane, &ods[blockIdx.x], cpu);
}

// Its prefetch (see mmvq1_prefetch): each warp its two rows of both matrices.
template <class F>
__device__ __forceinline__ void mmvq1_gluq_prefetch(const MmvJob &j, int n_cols) {
#ifdef RT_PDL_PREFETCH
    const int r = blockIdx.x * 32 + 2 * (threadIdx.x >> 5), lane = threadIdx.x & 31;
    const size_t rb = (size_t)(n_cols / F::QK) * F::BYTES;
    pdl_prefetch(j.w[0] + (size_t)r * rb, 2 * rb, lane, 32);
    pdl_prefetch(j.w[1] + (size_t)r * rb, 2 * rb, lane, 32);
#endif
}

// Float weights (F32, F16, BF16) against f32 activations.
template <int TY>
__device__ __forceinline__ float ld_w(const u8 *W, size_t i) {
    if (TY == 0) return ((const float *)W)[i];
    if (TY == 1) return h2f(((const u16 *)W)[i]);
    return bf2f(((const u16 *)W)[i]);
}

template <int TY, int NT>
__device__ __forceinline__ void mmv_float(const u8 *__restrict__ W, const float *__restrict__ x,
                                          float *__restrict__ out, int n_rows, int n_cols,
                                          int n_tok, int tpr) {
    const int row = blockIdx.x * (MMV_THREADS / tpr) + threadIdx.x / tpr;
    const int lane = threadIdx.x % tpr;
    float acc[NT];
#pragma unroll
    for (int t = 0; t < NT; t++) acc[t] = 0.0f;
    if (row < n_rows) {
        const size_t base = (size_t)row * n_cols;
        for (int i = lane; i < n_cols; i += tpr) {
            float w = ld_w<TY>(W, base + i);
#pragma unroll
            for (int t = 0; t < NT; t++)
                if (t < n_tok) acc[t] += w * x[(size_t)t * n_cols + i];
        }
    }
    row_reduce_store<NT>(acc, out, row, n_rows, n_tok, tpr);
}

// One token, float weights: a warp per row, 16-byte weight loads (8 F16/BF16 or 4 F32
// values per lane and step), several in flight. Needs n_cols a multiple of 8 (F16/BF16) or
// 4 (F32) and 16-byte-aligned rows (the host checks). Every one-token float product sums a
// row the same way: each lane its 16-byte chunks lane, lane + 32, ... in order (mmv_chunk),
// then across the warp.
template <int TY>
__device__ __forceinline__ float mmv_chunk(float acc, const uint4 w, const float4 *xv, int i) {
    if (TY == 0) {
        const float4 a = xv[i];
        acc += __uint_as_float(w.x) * a.x + __uint_as_float(w.y) * a.y +
               __uint_as_float(w.z) * a.z + __uint_as_float(w.w) * a.w;
    } else {
        const float4 a = xv[2 * i], b = xv[2 * i + 1];
        const u32 ws[4] = {w.x, w.y, w.z, w.w};
        const float av[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
        for (int k = 0; k < 4; k++) {
            const float lo = TY == 1 ? h2f((u16)(ws[k] & 0xFFFF)) : bf2f((u16)(ws[k] & 0xFFFF));
            const float hi = TY == 1 ? h2f((u16)(ws[k] >> 16)) : bf2f((u16)(ws[k] >> 16));
            acc += lo * av[2 * k] + hi * av[2 * k + 1];
        }
    }
    return acc;
}

// Part `part` of `S` of a row's sum: the lane's 16-byte chunks part * 32 + lane, then every
// 32 * S (S = 1: the whole row), summed across the warp.
template <int TY>
__device__ __forceinline__ float mmv_row1(const u8 *__restrict__ wrow, const float *__restrict__ x,
                                          int n_cols, int part = 0, int S = 1) {
    const int lane = threadIdx.x & 31;
    const uint4 *wr = (const uint4 *)wrow;
    const float4 *xv = (const float4 *)x;
    const int nv = n_cols / (TY == 0 ? 4 : 8);
    float acc = 0.0f;
#pragma unroll 4
    for (int i = part * 32 + lane; i < nv; i += 32 * S) acc = mmv_chunk<TY>(acc, wr[i], xv, i);
    return warp_sum(acc);
}

// Two rows against the same activations in one walk (gate and up), each summed as mmv_row1.
template <int TY>
__device__ __forceinline__ float2 mmv_row1x2(const u8 *__restrict__ w0, const u8 *__restrict__ w1,
                                             const float *__restrict__ x, int n_cols, int part = 0,
                                             int S = 1) {
    const int lane = threadIdx.x & 31;
    const uint4 *r0 = (const uint4 *)w0, *r1 = (const uint4 *)w1;
    const float4 *xv = (const float4 *)x;
    const int nv = n_cols / (TY == 0 ? 4 : 8);
    float a0 = 0.0f, a1 = 0.0f;
#pragma unroll 2
    for (int i = part * 32 + lane; i < nv; i += 32 * S) {
        const uint4 u0 = r0[i], u1 = r1[i];
        a0 = mmv_chunk<TY>(a0, u0, xv, i);
        a1 = mmv_chunk<TY>(a1, u1, xv, i);
    }
    return make_float2(warp_sum(a0), warp_sum(a1));
}

template <int TY>
__device__ __forceinline__ void mmv_float1(const u8 *__restrict__ W, const float *__restrict__ x,
                                           float *__restrict__ out, int n_rows, int n_cols, int S,
                                           float *__restrict__ acc) {
    const int gw = blockIdx.x * (MMV_THREADS / 32) + (threadIdx.x >> 5);
    const int row = gw / S, part = gw % S;
    // (with S > 1 every warp reaches the block barrier)
    float2 v = make_float2(0.0f, 0.0f);
    if (row < n_rows)
        v.x = mmv_row1<TY>(W + (size_t)row * n_cols * (TY == 0 ? 4 : 2), x, n_cols, part, S);
    if (split_sum2(v, S) && row < n_rows && (threadIdx.x & 31) == 0) {
        out[row] = v.x;
        if (acc != nullptr) acc[row] = acc[row] + v.x;
    }
}

// An RMSNorm folded into the one-token float product that reads its output: with nx given,
// every block computes h = rms_norm(nx) * nw itself into dynamic shared memory (n floats;
// the rms_norm kernel's arithmetic: squares rounded to f32 and summed in f64, then (x *
// scale) * w), block 0 also storing h to hout; returns the activations the product reads
// (x itself without nx). n a multiple of 4, rows 16-byte aligned. Every thread of the block
// must call it.
#define NORM_REG 4
// s += v's four squares, each rounded to f32 and added in f64 (two pairs).
__device__ __forceinline__ void add_sq4(double &s, float4 v) {
    s += (double)__fmul_rn(v.x, v.x) + (double)__fmul_rn(v.y, v.y);
    s += (double)__fmul_rn(v.z, v.z) + (double)__fmul_rn(v.w, v.w);
}
// (v * scale) * w per element, the rms_norm kernel's rounding.
__device__ __forceinline__ float4 norm4(float4 v, float scale, float4 w) {
    return make_float4(__fmul_rn(__fmul_rn(v.x, scale), w.x), __fmul_rn(__fmul_rn(v.y, scale), w.y),
                       __fmul_rn(__fmul_rn(v.z, scale), w.z), __fmul_rn(__fmul_rn(v.w, scale), w.w));
}
__device__ __forceinline__ const float *mmv_norm(const float *x, int n, const float *nx,
                                                 const float *__restrict__ nw, float eps,
                                                 float *hout) {
    if (nx == nullptr) return x;
    extern __shared__ float4 mmv_dyn[];
    __shared__ double sm_ss[32];
    const int n4 = n / 4, tid = threadIdx.x, nt = blockDim.x;
    const float4 *x4 = (const float4 *)nx, *w4 = (const float4 *)nw;
    float4 xv[NORM_REG], wv[NORM_REG];
#pragma unroll
    for (int k = 0; k < NORM_REG; k++) {
        const int i = tid + k * nt;
        xv[k] = i < n4 ? x4[i] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        wv[k] = i < n4 ? w4[i] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
    double s = 0.0;
#pragma unroll
    for (int k = 0; k < NORM_REG; k++) {
        const float4 v = xv[k];
        add_sq4(s, v);
    }
    for (int i = tid + NORM_REG * nt; i < n4; i += nt) {
        const float4 v = x4[i];
        mmv_dyn[i] = v;
        add_sq4(s, v);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(FULL_MASK, s, o);
    if ((tid & 31) == 0) sm_ss[tid >> 5] = s;
    __syncthreads();
    double tot = 0.0;
    for (int k = 0; k < nt / 32; k++) tot += sm_ss[k];
    const float mean = (float)(tot / (double)n);
    const float scale = 1.0f / sqrtf(mean + eps);
    float4 *h4 = (float4 *)hout;
#pragma unroll
    for (int k = 0; k < NORM_REG; k++) {
        const int i = tid + k * nt;
        if (i < n4) {
            const float4 o = norm4(xv[k], scale, wv[k]);
            mmv_dyn[i] = o;
            if (blockIdx.x == 0) h4[i] = o;
        }
    }
    for (int i = tid + NORM_REG * nt; i < n4; i += nt) {
        const float4 o = norm4(mmv_dyn[i], scale, w4[i]);
        mmv_dyn[i] = o;
        if (blockIdx.x == 0) h4[i] = o;
    }
    __syncthreads();
    return (const float *)mmv_dyn;
}

// One token, up to three float matrices of one type and width in one launch (rows as in
// mmvq1 but blockDim.x / 32 per block, S warps per row), or with `glu` the gate and up rows of one warp and act(gate) * up
// stored (the swiglu / geglu kernels' arithmetic): each row summed as mmv_row1 sums it.
template <int TY>
__device__ __forceinline__ void mmv1_job(const MmvJob &j, const float *x, int n_cols, int S) {
    const int gw = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    int m, wi = gw / S;
    const int part = gw % S;
    const bool has = job_row(j, m, wi);
    const size_t rb = (size_t)n_cols * (TY == 0 ? 4 : 2);
    float2 v = make_float2(0.0f, 0.0f);
    if (has) {
        if (!j.glu)
            v.x = mmv_row1<TY>(job_w(j, m) + (size_t)wi * rb, x, n_cols, part, S);
        else
            v = mmv_row1x2<TY>(j.w[0] + (size_t)wi * rb, j.w[1] + (size_t)wi * rb, x, n_cols, part, S);
    }
    if (!split_sum2(v, S) || !has || (threadIdx.x & 31) != 0) return;
    if (!j.glu)
        job_out(j, m)[wi] = v.x;
    else
        j.out[0][wi] = glu_act(j.glu, v.x, v.y);
}

#define MMVQ1_KERNEL(NAME, F)                                                                 \
    extern "C" __global__ void __launch_bounds__(MMV_THREADS)                                \
        mmvq1_##NAME(MmvJob j, const i8 *aq, const float2 *ads, int n_cols, int S) {        \
        PDL_ENTRY_AFTER(mmvq1_prefetch<F>(j, n_cols, S));                                    \
        mmvq1<F>(j, aq, ads, n_cols, S);                                                     \
    }

#define MMVQ1G_KERNEL(NAME, F)                                                                \
    extern "C" __global__ void __launch_bounds__(GLUQ_THREADS)                               \
        mmvq1g_##NAME(MmvJob j, const i8 *aq, const float2 *ads, int n_cols, i8 *oq,         \
                      float2 *ods, int cpu) {                                                \
        PDL_ENTRY_AFTER(mmvq1_gluq_prefetch<F>(j, n_cols));                                  \
        mmvq1_gluq<F>(j, aq, ads, n_cols, oq, ods, cpu);                                     \
    }

#define MMVQ_KERNEL(NAME, F, NT)                                                              \
    extern "C" __global__ void __launch_bounds__(MMV_THREADS)                                \
        mmvq_##NAME##_##NT(MmvJob j, const i8 *aq, const float2 *ads, int n_cols, int n_tok,  \
                           int tpr) {                                                        \
        PDL_ENTRY();                                                                         \
        mmvq<F, NT>(j, aq, ads, n_cols, n_tok, tpr);                                         \
    }

#define MMVQ_ALL(NAME, F)                                                                     \
    MMVQ1_KERNEL(NAME, F)                                                                    \
    MMVQ1G_KERNEL(NAME, F)                                                                   \
    MMVQ_KERNEL(NAME, F, 1)                                                                  \
    MMVQ_KERNEL(NAME, F, 2)                                                                  \
    MMVQ_KERNEL(NAME, F, 4)                                                                  \
    MMVQ_KERNEL(NAME, F, 8)

MMVQ_ALL(q4_0, FQ4_0)
MMVQ_ALL(q4_0t, FQ4_0T)
MMVQ_ALL(q4_1, FQ4_1)
MMVQ_ALL(q5_0, FQ5_0)
MMVQ_ALL(q5_1, FQ5_1)
MMVQ_ALL(q8_0, FQ8_0)
MMVQ_ALL(q8_0t, FQ8_0T)
MMVQ_ALL(q2_k, FQ2_K)
MMVQ_ALL(q3_k, FQ3_K)
MMVQ_ALL(q4_k, FQ4_K)
MMVQ_ALL(q5_k, FQ5_K)
MMVQ_ALL(q6_k, FQ6_K)
MMVQ_ALL(iq4_nl, FIQ4_NL)
MMVQ_ALL(iq4_xs, FIQ4_XS)

#define MMVF_KERNEL(NAME, TY, NT)                                                             \
    extern "C" __global__ void __launch_bounds__(MMV_THREADS)                                \
        mmv_##NAME##_##NT(const u8 *W, const float *x, float *out, int n_rows, int n_cols,   \
                          int n_tok, int tpr) {                                              \
        PDL_ENTRY();                                                                         \
        mmv_float<TY, NT>(W, x, out, n_rows, n_cols, n_tok, tpr);                            \
    }

#define MMVF_ALL(NAME, TY)                                                                    \
    extern "C" __global__ void __launch_bounds__(MMV_THREADS)                                \
        mmv1_##NAME(const u8 *W, const float *x, float *out, int n_rows, int n_cols, int S,  \
                    float *acc) {                                                            \
        PDL_ENTRY_AFTER(mmv1_prefetch<TY>(W, n_rows, n_cols, S));                            \
        mmv_float1<TY>(W, x, out, n_rows, n_cols, S, acc);                                   \
    }                                                                                        \
    extern "C" __global__ void __launch_bounds__(MMV1J_MAX_THREADS)                          \
        mmv1j_##NAME(MmvJob j, const float *x, int n_cols, int S, const float *nx,           \
                     const float *nw, float eps, float *hout) {                              \
        PDL_ENTRY_AFTER(mmv1j_prefetch<TY>(j, n_cols, S));                                   \
        mmv1_job<TY>(j, mmv_norm(x, n_cols, nx, nw, eps, hout), n_cols, S);                  \
    }                                                                                        \
    MMVF_KERNEL(NAME, TY, 1)                                                                 \
    MMVF_KERNEL(NAME, TY, 2)                                                                 \
    MMVF_KERNEL(NAME, TY, 4)                                                                 \
    MMVF_KERNEL(NAME, TY, 8)

MMVF_ALL(f32, 0)
MMVF_ALL(f16, 1)
MMVF_ALL(bf16, 2)

// ---------------------------------------------------------------------------------------
// Embedding rows: out[t] = dequantize(W[ids[t]]), the host dequantizers' values exactly
// (same products and sums, no fused multiply-add).

template <class F>
__device__ __forceinline__ void get_rows_q(const u8 *__restrict__ W, const u32 *__restrict__ ids,
                                           float *__restrict__ out, int n_cols) {
    const int ng = n_cols >> 5;
    const int gi = blockIdx.x * blockDim.x + threadIdx.x;
    const int t = blockIdx.y;
    if (gi >= ng) return;
    const int gpb = F::QK / 32;
    const size_t row_bytes = (size_t)(n_cols / F::QK) * F::BYTES;
    const u8 *wr = W + (size_t)ids[t] * row_bytes;
    Group w;
    F::decode(wr + (size_t)(gi / gpb) * F::BYTES, gi % gpb, w);
    float *o = out + (size_t)t * n_cols + gi * 32;
#pragma unroll
    for (int k = 0; k < 8; k++) {
        float d = k < 4 ? w.d0 : w.d1;
        int z = k < 4 ? w.z0 : w.z1;
        float m = k < 4 ? w.m0 : w.m1;
#pragma unroll
        for (int b = 0; b < 4; b++) {
            int q = (int)(i8)((w.v[k] >> (8 * b)) & 0xFF) + z;
            o[4 * k + b] = __fadd_rn(__fmul_rn(d, (float)q), m);
        }
    }
}

#define GET_ROWS_KERNEL(NAME, F)                                                              \
    extern "C" __global__ void get_rows_##NAME(const u8 *W, const u32 *ids, float *out,      \
                                               int n_cols) {                                 \
        PDL_ENTRY();                                                                         \
        get_rows_q<F>(W, ids, out, n_cols);                                                  \
    }

GET_ROWS_KERNEL(q4_0, FQ4_0)
GET_ROWS_KERNEL(q4_0t, FQ4_0T)
GET_ROWS_KERNEL(q4_1, FQ4_1)
GET_ROWS_KERNEL(q5_0, FQ5_0)
GET_ROWS_KERNEL(q5_1, FQ5_1)
GET_ROWS_KERNEL(q8_0, FQ8_0)
GET_ROWS_KERNEL(q8_0t, FQ8_0T)
GET_ROWS_KERNEL(q2_k, FQ2_K)
GET_ROWS_KERNEL(q3_k, FQ3_K)
GET_ROWS_KERNEL(q4_k, FQ4_K)
GET_ROWS_KERNEL(q5_k, FQ5_K)
GET_ROWS_KERNEL(q6_k, FQ6_K)
GET_ROWS_KERNEL(iq4_nl, FIQ4_NL)
GET_ROWS_KERNEL(iq4_xs, FIQ4_XS)

#define GET_ROWS_FLOAT(NAME, TY)                                                              \
    extern "C" __global__ void get_rows_##NAME(const u8 *W, const u32 *ids, float *out,      \
                                               int n_cols) {                                 \
        PDL_ENTRY();                                                                         \
        const int i = blockIdx.x * blockDim.x + threadIdx.x;                                 \
        const int t = blockIdx.y;                                                            \
        if (i >= n_cols) return;                                                             \
        out[(size_t)t * n_cols + i] = ld_w<TY>(W, (size_t)ids[t] * n_cols + i);              \
    }

GET_ROWS_FLOAT(f32, 0)
GET_ROWS_FLOAT(f16, 1)
GET_ROWS_FLOAT(bf16, 2)
