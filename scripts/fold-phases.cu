// Microbenchmark (docs/performance.md, session 20): the cycles of each phase of an RMSNorm
// of 2048 values and its Q8 quantization (the CPU's rule) done by one block of 128
// threads, as exact mode's products would do it in every block if they computed the norm
// they read (tried in session 20, commit 5948335, reverted): thread 0's clock64 after each
// phase, 20 launches on an otherwise idle GPU, with the sum of squares in f64 (as the CPU
// and rustorch's norm) and, for comparison, in f32.
// On a GPU host: nvcc -O3 -arch=sm_90 -o fold-phases scripts/fold-phases.cu && ./fold-phases
#include <cstdio>
#include <cuda_fp16.h>
__device__ __forceinline__ void add_sq4(double &s, float4 v) {
    s += (double)__fmul_rn(v.x, v.x) + (double)__fmul_rn(v.y, v.y);
    s += (double)__fmul_rn(v.z, v.z) + (double)__fmul_rn(v.w, v.w);
}
template <int MODE>
__global__ void fold(const float *nx, const float *nw, float eps, int n, long long *t, signed char *outq, float *outd) {
    __shared__ double ss[32];
    __shared__ __align__(16) signed char sq[8192];
    __shared__ float2 sds[256];
    long long c[8];
    const int tid = threadIdx.x;
    __syncthreads();
    c[0] = clock64();
    float4 r[4];
    const float4 *x4 = (const float4 *)(nx + 16 * tid);
    for (int k = 0; k < 4; k++) r[k] = x4[k];
    double s = 0.0; float sf = 0.0f;
    if (MODE == 0) { for (int k = 0; k < 4; k++) add_sq4(s, r[k]); }
    else { for (int k = 0; k < 4; k++) sf += r[k].x*r[k].x + r[k].y*r[k].y + r[k].z*r[k].z + r[k].w*r[k].w; }
    if (MODE == 0) { if (s == 12345.0) c[7] = 0; } else { if (sf == 12345.0f) c[7] = 0; }
    c[1] = clock64();
    if (MODE == 0) for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    else for (int o = 16; o > 0; o >>= 1) sf += __shfl_xor_sync(0xffffffffu, sf, o);
    c[2] = clock64();
    if ((tid & 31) == 0) ss[tid >> 5] = MODE == 0 ? s : (double)sf;
    __syncthreads();
    double tot = 0.0;
    for (int k = 0; k < 4; k++) tot += ss[k];
    c[3] = clock64();
    const float mean = (float)(tot / (double)n);
    const float scale = 1.0f / sqrtf(mean + eps);
    if (scale == 12345.0f) c[7] = 1;
    c[4] = clock64();
    float o[16];
    const float4 *w4 = (const float4 *)(nw + 16 * tid);
    for (int k = 0; k < 4; k++) {
        float4 w = w4[k];
        o[4*k] = __fmul_rn(__fmul_rn(r[k].x, scale), w.x);
        o[4*k+1] = __fmul_rn(__fmul_rn(r[k].y, scale), w.y);
        o[4*k+2] = __fmul_rn(__fmul_rn(r[k].z, scale), w.z);
        o[4*k+3] = __fmul_rn(__fmul_rn(r[k].w, scale), w.w);
    }
    float am = 0.0f;
    for (int i = 0; i < 16; i++) am = fmaxf(am, fabsf(o[i]));
    am = fmaxf(am, __shfl_xor_sync(0xffffffffu, am, 1));
    const float d = __fdiv_rn(am, 127.0f);
    const float id = am != 0.0f ? __fdiv_rn(127.0f, am) : 0.0f;
    int qs = 0; unsigned pk[4] = {0,0,0,0};
    for (int i = 0; i < 16; i++) {
        const int q = min(127, max(-128, __float2int_rn(__fmul_rn(o[i], id))));
        qs += q; pk[i >> 2] |= (unsigned)(q & 0xff) << (8 * (i & 3));
    }
    qs += __shfl_xor_sync(0xffffffffu, qs, 1);
    if ((tid & 1) == 0) sds[tid >> 1] = make_float2(__half2float(__float2half_rn(d)), __half2float(__float2half_rn(__fmul_rn(d, (float)qs))));
    *(int4 *)(sq + 16 * tid) = make_int4(pk[0], pk[1], pk[2], pk[3]);
    c[5] = clock64();
    __syncthreads();
    c[6] = clock64();
    outq[tid] = sq[(tid * 7) & 2047]; if (tid < 64) outd[tid] = sds[tid].x;
    if (tid == 0) for (int i = 0; i < 7; i++) t[i] = c[i];
}
int main() {
    const int n = 2048;
    float *x, *w; long long *t; signed char *q; float *d;
    cudaMalloc(&x, n * 4); cudaMalloc(&w, n * 4); cudaMalloc(&t, 64); cudaMalloc(&q, 128); cudaMalloc(&d, 256);
    float h[n]; for (int i = 0; i < n; i++) h[i] = 0.01f * ((i * 37) % 101 - 50);
    cudaMemcpy(x, h, n * 4, cudaMemcpyHostToDevice); cudaMemcpy(w, h, n * 4, cudaMemcpyHostToDevice);
    const char *names[] = {"load+squares", "warp shuffles", "smem+sync+tot", "div/sqrt/rcp", "norm+quantize+store", "final sync"};
    for (int mode = 0; mode < 2; mode++) {
        long long acc[6] = {0};
        const int reps = 20;
        for (int r = 0; r < reps + 1; r++) {
            if (mode == 0) fold<0><<<1, 128>>>(x, w, 1e-5f, n, t, q, d); else fold<1><<<1, 128>>>(x, w, 1e-5f, n, t, q, d);
            long long c[7]; cudaMemcpy(c, t, 56, cudaMemcpyDeviceToHost);
            if (r > 0) for (int i = 0; i < 6; i++) acc[i] += c[i + 1] - c[i];
        }
        printf("%s:", mode == 0 ? "f64 sums" : "f32 sums (for comparison)");
        long long tot = 0;
        for (int i = 0; i < 6; i++) { printf(" %s %lld,", names[i], acc[i] / reps); tot += acc[i] / reps; }
        printf(" total %lld cycles\n", tot);
    }
    return 0;
}
