/* bench/gemm.c — sgemm roofline: GFLOP/s for square products on 1 thread and on all cores.
 * Each size's product is checked (sampled entries against a double dot product, the `#wrong`
 * column, as nccl-tests) before it is timed. Results to stdout; exit 1 if any entry is wrong. */
#include <cblas.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "bench/lib/bench_host.h"
#include "blas_kernels/bk_gemm.h"
#include "blas_kernels/bk_roofline.h"

enum { SAMPLES = 256 };

/* C = A B on `threads`, then SAMPLES entries checked; the bound is 1e-5 of sum |a||b| (float
 * accumulation over n terms stays far below that for n <= 2048). */
static int count_wrong(int threads, int n)
{
    size_t nn = (size_t)n * n;
    float *A = malloc(nn * sizeof *A), *B = malloc(nn * sizeof *B), *C = malloc(nn * sizeof *C);
    if (!A || !B || !C) {
        fprintf(stderr, "gemm: out of memory at n=%d\n", n);
        exit(2);
    }
    uint64_t s = 12345;
    for (size_t i = 0; i < nn; i++) {
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        A[i] = (float)((s >> 40) & 0xffff) / 65536.0f - 0.5f;
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        B[i] = (float)((s >> 40) & 0xffff) / 65536.0f - 0.5f;
    }
    int prev = openblas_get_num_threads();
    openblas_set_num_threads(threads);
    bk_gemm(0, 0, n, n, n, 1.0f, A, n, B, n, 0.0f, C, n);
    openblas_set_num_threads(prev);
    int wrong = 0;
    for (int t = 0; t < SAMPLES; t++) {
        size_t i = ((size_t)t * 2654435761u) % (size_t)n, j = ((size_t)t * 40503u + 17) % (size_t)n;
        double ref = 0.0, mag = 0.0;
        for (int p = 0; p < n; p++) {
            ref += (double)A[i * n + p] * B[(size_t)p * n + j];
            mag += fabs((double)A[i * n + p] * B[(size_t)p * n + j]);
        }
        if (fabs(C[i * n + j] - ref) > 1e-5 * mag) wrong++;
    }
    free(A), free(B), free(C);
    return wrong;
}

int main(void)
{
    bench_host_print(stdout);
    const int sizes[] = {256, 512, 1024, 2048};
    const int nsizes = (int)(sizeof sizes / sizeof sizes[0]);
    int cores = bk_num_cores();
    int thread_counts[2] = {1, cores};
    double peak[2] = {0.0, 0.0};
    int any_wrong = 0;
    printf("# sgemm (OpenBLAS), row-major float32, C = A B with M = N = K = size; best run of >= 3\n");
    printf("%8s %8s %12s %10s %7s\n", "size", "threads", "time(ms)", "GFLOP/s", "#wrong");
    for (int c = 0; c < (cores > 1 ? 2 : 1); c++) {
        int th = thread_counts[c];
        for (int s = 0; s < nsizes; s++) {
            int n = sizes[s];
            int wrong = count_wrong(th, n);
            any_wrong |= wrong != 0;
            double g = bk_sgemm_gflops(th, n, n, n, n >= 2048 ? 0.5 : 0.25);
            double ms = 2.0 * n * n * (double)n / (g * 1e9) * 1e3;
            printf("%8d %8d %12.3f %10.2f %7d\n", n, th, ms, g, wrong);
            fflush(stdout);
            if (g > peak[c]) peak[c] = g;
        }
    }
    if (cores == 1) peak[1] = peak[0];
    printf("sgemm peak GFLOP/s: 1-thread %.2f, all-cores %.2f (%d cores)\n", peak[0], peak[1], cores);
    return any_wrong ? 1 : 0;
}
