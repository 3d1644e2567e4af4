// Microbenchmark (docs/performance.md, session 23): cycles per step of the dependent chains
// that exact mode's attention walks (one dimension's f16 accumulator, cell after cell), for
// ways of rounding an f32 value to f16 and back. One warp, each thread its own chain of
// 8192 steps; clock64 around the loop; the per-step figure is the median over 9 launches.
// On a GPU host: nvcc -O3 -arch=sm_90 -o chain-latency scripts/chain-latency.cu && ./chain-latency
#include <cstdio>
#include <algorithm>
#include <vector>
#include <cuda_runtime.h>
#include <cuda_fp16.h>

#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("ERR %s: %s\n", #x, cudaGetErrorString(e)); return 1; } } while (0)

__device__ __forceinline__ float h2f(unsigned short h) {
    float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h)); return f;
}
__device__ __forceinline__ unsigned short f2h(float f) {
    unsigned short h; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f)); return h;
}
// f32 -> f16 -> f32 for values in f16's normal range: round the f32 bits at bit 13, ties even
__device__ __forceinline__ float rnd_int(float x) {
    unsigned u = __float_as_uint(x);
    u = (u + 0xfffu + ((u >> 13) & 1u)) & 0xffffe000u;
    return __uint_as_float(u);
}

template <int V>
__global__ void chain(const float *in, float *out, long long *cyc, int n) {
    float v[8], w[8];
#pragma unroll
    for (int k = 0; k < 8; k++) { v[k] = in[k + threadIdx.x]; w[k] = in[8 + k]; }
    const float ms = in[16];
    float acc = in[17 + threadIdx.x];
    __syncwarp();
    const long long t0 = clock64();
    for (int i = 0; i < n; i += 8) {
#pragma unroll
        for (int k = 0; k < 8; k++) {
            if (V == 0) acc = __fmaf_rn(v[k], w[k], acc);
            if (V == 1) acc = h2f(f2h(__fmaf_rn(v[k], w[k], acc)));
            if (V == 2) {
                const float sc = h2f(f2h(__fmul_rn(acc, ms)));
                acc = h2f(f2h(__fmaf_rn(v[k], w[k], sc)));
            }
            if (V == 3) acc = rnd_int(__fmaf_rn(v[k], w[k], acc));
            if (V == 4) acc = __half2float(__float2half_rn(__fmaf_rn(v[k], w[k], acc)));
        }
    }
    const long long t1 = clock64();
    out[threadIdx.x] = acc;
    if (threadIdx.x == 0) *cyc = t1 - t0;
}

template <int V>
static int run(const char *name, const float *din, float *dout, long long *dcyc) {
    const int n = 8192;
    std::vector<double> per;
    for (int r = 0; r < 9; r++) {
        chain<V><<<1, 32>>>(din, dout, dcyc, n);
        CK(cudaDeviceSynchronize());
        long long c;
        CK(cudaMemcpy(&c, dcyc, sizeof c, cudaMemcpyDeviceToHost));
        per.push_back((double)c / n);
    }
    std::sort(per.begin(), per.end());
    printf("%-44s %6.2f cycles a step\n", name, per[per.size() / 2]);
    return 0;
}

int main() {
    float h[64];
    for (int i = 0; i < 64; i++) h[i] = (i % 7 - 3) * 0.125f + 0.01f * i;
    for (int k = 0; k < 8; k++) h[8 + k] = 0.001f * (k + 1);
    h[16] = 1.0f;
    float *din, *dout;
    long long *dcyc;
    CK(cudaMalloc(&din, sizeof h));
    CK(cudaMalloc(&dout, 32 * sizeof(float)));
    CK(cudaMalloc(&dcyc, sizeof(long long)));
    CK(cudaMemcpy(din, h, sizeof h, cudaMemcpyHostToDevice));
    run<0>("fma only", din, dout, dcyc);
    run<1>("fma, cvt f16, cvt f32 (inline PTX)", din, dout, dcyc);
    run<4>("fma, __float2half_rn, __half2float", din, dout, dcyc);
    run<2>("mul, cvt, cvt, fma, cvt, cvt (a rescale)", din, dout, dcyc);
    run<3>("fma, integer rounding at bit 13", din, dout, dcyc);
    return 0;
}
