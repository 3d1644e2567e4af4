// Shared helpers for every kernel file. NVRTC compiles the files as one translation unit
// (common.cuh first), with no system headers: fixed-width types, f16 conversions and dp4a are
// defined here.

typedef unsigned char u8;
typedef signed char i8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef int i32;
typedef unsigned long long u64;

#define WARP 32
#define FULL_MASK 0xffffffffu

__device__ __forceinline__ float h2f(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

// Round to nearest even, like the host's f32_to_f16.
__device__ __forceinline__ u16 f2h(float f) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

__device__ __forceinline__ float bf2f(u16 b) { return __uint_as_float(((u32)b) << 16); }

// Sum of the four signed byte products of a and b, plus c.
__device__ __forceinline__ int dp4a(int a, int b, int c) {
    int r;
    asm("dp4a.s32.s32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
    return r;
}

__device__ __forceinline__ u16 ld_u16(const u8 *p) { return *(const u16 *)p; }

// 32-bit little-endian loads from addresses aligned to 2 or 4 bytes.
__device__ __forceinline__ int ld_i32_a2(const u8 *p) {
    const u16 *q = (const u16 *)p;
    return (int)((u32)q[0] | ((u32)q[1] << 16));
}
__device__ __forceinline__ int ld_i32_a4(const u8 *p) { return *(const int *)p; }

// N consecutive 32-bit little-endian words from an address aligned to 2 bytes: N + 1
// aligned 32-bit loads (N when the address is aligned to 4) joined by funnel shifts,
// instead of 2N 16-bit loads.
template <int N>
__device__ __forceinline__ void ld_ints_a2(const u8 *p, int (&o)[N]) {
    const size_t a = (size_t)p;
    const u32 *w = (const u32 *)(a & ~(size_t)3);
    const u32 sh = (u32)(a & 2) * 8;
    u32 v[N + 1];
#pragma unroll
    for (int i = 0; i < N; i++) v[i] = w[i];
    v[N] = sh ? w[N] : 0u;  // (not read past the N words when aligned)
#pragma unroll
    for (int i = 0; i < N; i++) o[i] = (int)__funnelshift_r(v[i], v[i + 1], sh);
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}

// (sm_80+: one REDUX instruction instead of five shuffle steps; the same exact sum)
__device__ __forceinline__ int warp_sum_i(int v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800 && !defined(RT_NO_REDUX)
    return __reduce_add_sync(FULL_MASK, v);
#else
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
#endif
}

__device__ __forceinline__ int warp_min_i(int v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800 && !defined(RT_NO_REDUX)
    return __reduce_min_sync(FULL_MASK, v);
#else
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = min(v, __shfl_xor_sync(FULL_MASK, v, o));
    return v;
#endif
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, o));
    return v;
}

// warp_max(fabsf(v)): the largest magnitude over the warp (fmaxf's rule: NaN lanes count only
// when every lane is NaN). On sm_80+ one REDUX on the bit patterns, which order as the values
// do for non-negative floats.
__device__ __forceinline__ float warp_amax(float v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800 && !defined(RT_NO_REDUX)
    const u32 b = __float_as_uint(fabsf(v));
    const bool nan = b > 0x7f800000u;
    const u32 m = __reduce_max_sync(FULL_MASK, nan ? 0u : b);
    return __all_sync(FULL_MASK, nan) ? fabsf(v) : __uint_as_float(m);
#else
    return warp_max(fabsf(v));
#endif
}

#define NEG_INF __int_as_float(0xff800000)

// One value per lane of a full warp, the 32 values of one activation block: writes the
// lane's 8-bit code to aq[i] and (lane 0) the block's (d, s = d * sum of codes) to *ds.
// cpu = 0: code = round(v * (1 / d)), d and s in f32; cpu = 1: ggml-cpu's x86 encoding
// (code = round_half_even(v * (127 / max|v|)), d and s rounded to f16).
__device__ __forceinline__ void quantize_lane(float v, i8 *aq, size_t i, float2 *ds, int cpu) {
    const float amax = warp_amax(v);
    const float d = __fdiv_rn(amax, 127.0f);
    int q;
    if (cpu) {
        const float id = amax != 0.0f ? __fdiv_rn(127.0f, amax) : 0.0f;
        q = min(127, max(-128, __float2int_rn(__fmul_rn(v, id))));
    } else {
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        q = (int)roundf(__fmul_rn(v, id));
    }
    aq[i] = (i8)q;
    const int sum = warp_sum_i(q);
    if ((threadIdx.x & 31) == 0) {
        float2 r;
        const float s = __fmul_rn(d, (float)sum);
        r.x = cpu ? h2f(f2h(d)) : d;
        r.y = cpu ? h2f(f2h(s)) : s;
        *ds = r;
    }
}

// Programmatic dependent launch (sm_90+; the host launches every kernel with it unless
// RUSTORCH_CUDA_PDL=0). A kernel so launched may start while the kernel before it in the
// stream is still running, so every kernel begins with PDL_ENTRY: wait until the previous
// grid has completed and its writes are visible (`griddepcontrol.wait`), then let the next
// kernel's blocks be scheduled (`griddepcontrol.launch_dependents`). Nothing is read or
// written before the wait except what no kernel writes (weights, prefetched by the `pre` of
// PDL_ENTRY_AFTER), so each kernel still sees everything every earlier kernel wrote. Where the kernel was not
// launched that way, the wait returns at once. src/mega.rs defines RT_NO_PDL.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && !defined(RT_NO_PDL)
#if defined(RT_STAMP)
// timing only (RUSTORCH_CUDA_DEFS=RT_STAMP): thread 0 of every block notes when it passed
// the wait (%globaltimer, ns), its grid's block count and its block size, read back by
// CudaDevice::take_stamps; the grids of a step are ordered by these times (each waits for
// the one before)
#define RT_STAMP_MAX 65536
__device__ u64 rt_stamps[2 * RT_STAMP_MAX];
__device__ u32 rt_nstamp;
__device__ __forceinline__ void rt_stamp() {
    if (threadIdx.x | threadIdx.y | threadIdx.z) return;
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    const u32 i = atomicAdd(&rt_nstamp, 1u);
    if (i < RT_STAMP_MAX) {
        rt_stamps[2 * i] = t;
        rt_stamps[2 * i + 1] =
            (u64)(gridDim.x * gridDim.y * gridDim.z) | ((u64)(blockDim.x * blockDim.y) << 32);
    }
}
#else
#define rt_stamp() \
    do {           \
    } while (0)
#endif
#ifndef RT_NULL_BODY
#define PDL_ENTRY()                                                    \
    do {                                                               \
        asm volatile("griddepcontrol.wait;" ::: "memory");             \
        rt_stamp();                                                    \
        asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); \
    } while (0)
#else
// timing only (RUSTORCH_CUDA_DEFS=RT_NULL_BODY, results wrong): every kernel stops right
// after its entry, so a step measures its chain of launches without their work
#define PDL_ENTRY()                                                    \
    do {                                                               \
        asm volatile("griddepcontrol.wait;" ::: "memory");             \
        asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); \
        return;                                                        \
    } while (0)
#endif
// Asks L2 to fetch the `bytes` bytes at p (read-only weights), one line per lane and step.
__device__ __forceinline__ void pdl_prefetch(const void *p, size_t bytes, int lane, int lanes) {
    const char *c = (const char *)p;
    for (size_t o = (size_t)lane * 128; o < bytes; o += (size_t)lanes * 128)
        asm volatile("prefetch.global.L2 [%0];" ::"l"(c + o));
}
#else
#define PDL_ENTRY() \
    do {            \
    } while (0)
__device__ __forceinline__ void pdl_prefetch(const void *, size_t, int, int) {}
#endif
// Marks a kernel whose body calls PDL_ENTRY itself, later (attn_split: with the rotation
// inside, its first cells are loaded before the wait; rms_norm: its weights; they, like
// PDL_ENTRY_AFTER's `pre`, are only what no kernel of the step writes). Does nothing.
#define PDL_ENTRY_INSIDE() \
    do {                   \
    } while (0)
// PDL_ENTRY, after `pre` (which may only read what no kernel writes).
#define PDL_ENTRY_AFTER(pre) \
    do {                     \
        pre;                 \
        PDL_ENTRY();         \
    } while (0)
