// Times llama.cpp's model loading (llama_model_load_from_file with default CPU params: mmap,
// repacking where llama.cpp repacks) the way `rustorch bench` times its own (open, parse,
// set up the model). Built and run by scripts/compare-llama-bench.sh.
#include <stdio.h>
#include <time.h>
#include "llama.h"

static void quiet(enum ggml_log_level level, const char * text, void * user) {
    (void) level; (void) text; (void) user;
}

int main(int argc, char ** argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: %s MODEL\n", argv[0]);
        return 2;
    }
    llama_log_set(quiet, NULL);
    llama_backend_init();
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    struct llama_model_params p = llama_model_default_params();
    struct llama_model * m = llama_model_load_from_file(argv[1], p);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    if (!m) {
        fprintf(stderr, "load failed\n");
        return 1;
    }
    printf("%.3f\n", (t1.tv_sec - t0.tv_sec) * 1e3 + (t1.tv_nsec - t0.tv_nsec) / 1e6);
    llama_model_free(m);
    llama_backend_free();
    return 0;
}
