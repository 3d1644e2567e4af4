// Streaming read bandwidth of N threads over 1 GiB of huge-page memory (AVX2 loads), six
// repetitions: the roof a decode that reads every weight once per token runs into.
//
//   gcc -O2 -mavx2 -pthread scripts/membw.c -o /tmp/membw && /tmp/membw 2
#include <immintrin.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#define SIZE (1024UL * 1024 * 1024)
static char *buf;
static int n_threads;

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static void *reader(void *arg) {
    const long id = (long)arg;
    const size_t per = SIZE / n_threads;
    const __m256i *p = (const __m256i *)(buf + id * per);
    __m256i acc = _mm256_setzero_si256();
    for (size_t i = 0; i + 4 <= per / 32; i += 4) {
        acc = _mm256_xor_si256(acc, _mm256_load_si256(p + i));
        acc = _mm256_xor_si256(acc, _mm256_load_si256(p + i + 1));
        acc = _mm256_xor_si256(acc, _mm256_load_si256(p + i + 2));
        acc = _mm256_xor_si256(acc, _mm256_load_si256(p + i + 3));
    }
    static volatile int sink;
    sink = _mm256_extract_epi32(acc, 0);
    return 0;
}

int main(int argc, char **argv) {
    n_threads = argc > 1 ? atoi(argv[1]) : 2;
    if (n_threads < 1 || n_threads > 64) return 2;
    buf = mmap(0, SIZE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (buf == MAP_FAILED) return 1;
    madvise(buf, SIZE, MADV_HUGEPAGE);
    memset(buf, 1, SIZE);
    for (int r = 0; r < 6; r++) {
        pthread_t th[64];
        const double t0 = now();
        for (long i = 0; i < n_threads; i++) pthread_create(&th[i], 0, reader, (void *)i);
        for (int i = 0; i < n_threads; i++) pthread_join(th[i], 0);
        printf("%d threads: %.1f GB/s\n", n_threads, SIZE / (now() - t0) / 1e9);
    }
    return 0;
}
