// Microbenchmark (docs/performance.md, session 19): what one dependent-kernel boundary costs
// in a CUDA graph of 200 launches: plain stream order, programmatic dependent launch
// (griddepcontrol.wait, as rustorch's kernels begin), or a counter in global memory that
// each block of the kernel before bumps (release) and the next kernel's blocks poll
// (acquire) instead of waiting for the grid; each with empty blocks or 2 us of work each.
// On a GPU host: nvcc -O3 -arch=sm_90 -o launch-boundary scripts/launch-boundary.cu && ./launch-boundary
// (A cycle of nine grid shapes like a layer's hung in the counter mode on an H200; left out.)
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <algorithm>
#include <cuda_runtime.h>

#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("ERR %s line %d: %s\n", #x, __LINE__, cudaGetErrorString(e)); exit(1);} } while (0)

__device__ __forceinline__ unsigned long long gtime() {
    unsigned long long t; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); return t;
}
__device__ __forceinline__ void work(int ns) {
    if (ns <= 0) return;
    unsigned long long t0 = gtime();
    while (gtime() - t0 < (unsigned long long)ns) {}
}
__device__ __forceinline__ unsigned ld_acq(const unsigned *p) {
    unsigned v; asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory"); return v;
}
__device__ __forceinline__ void red_rel(unsigned *p, unsigned v) {
    asm volatile("red.release.gpu.global.add.u32 [%0], %1;" :: "l"(p), "r"(v) : "memory");
}

// mode 1: PDL wait then trigger
__global__ void k_pdl(int ns) {
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    work(ns);
}
// mode 0: plain
__global__ void k_plain(int ns) { work(ns); }
// mode 2: flag. waits for cnt[prev] >= need, trigger after wait (or before: early)
__global__ void k_flag(unsigned *cnt, int k, int prev, unsigned need, int reset, int early, int ns, int sleep) {
    if (early) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    if (threadIdx.x == 0) {
        if (prev >= 0) {
            while (ld_acq(&cnt[prev]) < need) { if (sleep) __nanosleep(sleep); }
        }
        if (reset >= 0 && blockIdx.x == 0) cnt[reset] = 0;
    }
    __syncthreads();
    if (!early) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    work(ns);
    __syncthreads();
    if (threadIdx.x == 0) { red_rel(&cnt[k], 1u); }
}

int main(int argc, char **argv) {
    int K = 200;
    CK(cudaSetDevice(0));
    cudaStream_t st; CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    unsigned *cnt; CK(cudaMalloc(&cnt, 4096 * 4)); CK(cudaMemset(cnt, 0, 4096 * 4));
    struct Cfg { const char *name; std::vector<std::pair<int,int>> shape; };
    std::vector<Cfg> cfgs = {
        {"G528xT128", {{528,128}}},
        {"G704xT128", {{704,128}}},
        {"G132xT128", {{132,128}}},
        {"norm1x1024/prod704x128", {{1,1024},{704,128}}},
    };
    int works[] = {0, 2000};
    const char *mname[] = {"plain", "pdl", "flag", "flag-early", "flag-sleep"};
    for (auto &c : cfgs) for (int ns : works) for (int mode = 0; mode < 5; mode++) {
        cudaGraph_t g; cudaGraphExec_t ge;
        CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
        for (int k = 0; k < K; k++) {
            auto sh = c.shape[k % c.shape.size()];
            auto shp = c.shape[(k + K - 1) % c.shape.size()];
            cudaLaunchConfig_t lc = {};
            lc.gridDim = dim3(sh.first); lc.blockDim = dim3(sh.second); lc.stream = st;
            cudaLaunchAttribute at[1];
            at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
            at[0].val.programmaticStreamSerializationAllowed = 1;
            lc.attrs = at; lc.numAttrs = mode == 0 ? 0 : 1;
            if (mode == 0) CK(cudaLaunchKernelEx(&lc, k_plain, ns));
            else if (mode == 1) CK(cudaLaunchKernelEx(&lc, k_pdl, ns));
            else {
                int prev = k - 1; unsigned need = prev >= 0 ? (unsigned)shp.first : 0;
                int reset = k >= 2 ? k - 2 : (k == 0 ? K - 2 : K - 1);
                CK(cudaLaunchKernelEx(&lc, k_flag, cnt, k, prev, need, reset, mode == 3 ? 1 : 0, ns, mode == 4 ? 100 : 0));
            }
        }
        CK(cudaStreamEndCapture(st, &g));
        CK(cudaGraphInstantiate(&ge, g, 0));
        // first replay: counters start at 0; kernel 0 resets K-2 (and kernel 1 resets K-1)
        for (int w = 0; w < 3; w++) CK(cudaGraphLaunch(ge, st));
        CK(cudaStreamSynchronize(st));
        cudaEvent_t a, b; CK(cudaEventCreate(&a)); CK(cudaEventCreate(&b));
        std::vector<float> v;
        for (int r = 0; r < 15; r++) {
            CK(cudaEventRecord(a, st));
            CK(cudaGraphLaunch(ge, st));
            CK(cudaEventRecord(b, st));
            CK(cudaEventSynchronize(b));
            float ms; CK(cudaEventElapsedTime(&ms, a, b)); v.push_back(ms * 1000.0f / K);
        }
        std::sort(v.begin(), v.end());
        printf("%-26s work=%4dns %-11s  us/kernel median %.3f  min %.3f  max %.3f\n", c.name, ns, mname[mode], v[v.size()/2], v[0], v.back());
        fflush(stdout);
        CK(cudaGraphExecDestroy(ge)); CK(cudaGraphDestroy(g));
    }
    return 0;
}
