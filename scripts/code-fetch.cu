// Microbenchmark (docs/performance.md, session 23): what a kernel's first pass through its
// machine code costs when that code is no longer cached near the SM. `big` is one warp
// running 4096 independent FMAs as straight-line code (64 KB); its clock64 time is taken
// (a) right after another run of itself, (b) after a kernel with other code of the same size,
// (c) after a kernel that streams 256 MB through L2 with plain loads, (d) the same with an
// L2 evict-first policy on the streaming loads, (e) after (c) and then a second kernel
// that touches `big`'s lines again... (not possible: code is not addressable), so (e) is
// `big` after (d) and a run of the other code. Medians of 9 rounds, cycles.
// On a GPU host: nvcc -O3 -arch=sm_90 -o code-fetch scripts/code-fetch.cu && ./code-fetch
#include <cstdio>
#include <algorithm>
#include <vector>
#include <cuda_runtime.h>

#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("ERR %s: %s\n", #x, cudaGetErrorString(e)); return 1; } } while (0)

template <int SALT>
__global__ void __launch_bounds__(32) big(float *out, long long *cyc, float a, float b) {
    float x[8];
#pragma unroll
    for (int k = 0; k < 8; k++) x[k] = threadIdx.x + k + SALT;
    const long long t0 = clock64();
#pragma unroll
    for (int i = 0; i < 512; i++)
#pragma unroll
        for (int k = 0; k < 8; k++) x[k] = __fmaf_rn(x[k], a, b + (float)(i % 3));
    const long long t1 = clock64();
    float s = 0;
#pragma unroll
    for (int k = 0; k < 8; k++) s += x[k];
    out[threadIdx.x] = s;
    if (threadIdx.x == 0) *cyc = t1 - t0;
}

template <bool EF>
__global__ void stream(const float4 *p, size_t n, float *out) {
    unsigned long long pol;
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol));
    float s = 0;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        float4 v;
        if (EF)
            asm volatile("ld.global.L2::cache_hint.v4.f32 {%0,%1,%2,%3}, [%4], %5;"
                         : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "l"(p + i), "l"(pol));
        else
            asm volatile("ld.global.v4.f32 {%0,%1,%2,%3}, [%4];"
                         : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "l"(p + i));
        s += v.x + v.y + v.z + v.w;
    }
    if (s == 12345.0f) out[0] = s;
}

int main() {
    const size_t bytes = 256ull << 20, n = bytes / 16;
    float4 *buf;
    float *out;
    long long *cyc;
    CK(cudaMalloc(&buf, bytes));
    CK(cudaMemset(buf, 0, bytes));
    CK(cudaMalloc(&out, 64 * sizeof(float)));
    CK(cudaMalloc(&cyc, sizeof(long long)));
    const char *names[] = {"(a) after itself", "(b) after other code", "(c) after streaming 256 MB",
                           "(d) after streaming 256 MB evict-first",
                           "(e) after (d) and other code"};
    std::vector<double> r[5];
    for (int round = 0; round < 9; round++) {
        for (int v = 0; v < 5; v++) {
            big<0><<<1, 32>>>(out, cyc, 0.999f, 0.001f);  // warm
            if (v == 1 || v == 4) big<1><<<1, 32>>>(out, cyc, 0.999f, 0.001f);
            if (v == 2) stream<false><<<528, 256>>>(buf, n, out);
            if (v == 3 || v == 4) stream<true><<<528, 256>>>(buf, n, out);
            if (v == 4) big<1><<<1, 32>>>(out, cyc, 0.999f, 0.001f);
            big<0><<<1, 32>>>(out, cyc, 0.999f, 0.001f);
            CK(cudaDeviceSynchronize());
            long long c;
            CK(cudaMemcpy(&c, cyc, sizeof c, cudaMemcpyDeviceToHost));
            r[v].push_back((double)c);
        }
    }
    for (int v = 0; v < 5; v++) {
        std::sort(r[v].begin(), r[v].end());
        printf("%-44s %8.0f cycles (min %.0f, max %.0f)\n", names[v], r[v][4], r[v][0], r[v][8]);
    }
    return 0;
}
