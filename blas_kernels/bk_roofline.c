/* bk_roofline.c — sgemm throughput measurement. */
#include "blas_kernels/bk_roofline.h"

#include <cblas.h>
#include <time.h>
#include <unistd.h>

#include "blas_kernels/bk.h"
#include "blas_kernels/bk_gemm.h"

int bk_num_cores(void)
{
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n > 0 ? (int)n : 1;
}

static double now_s(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

double bk_sgemm_gflops(int threads, int M, int N, int K, double min_seconds)
{
    BK_ASSERTF(M > 0 && N > 0 && K > 0, "M=%d N=%d K=%d", M, N, K);
    int prev = openblas_get_num_threads();
    openblas_set_num_threads(threads > 0 ? threads : bk_num_cores());
    float *A = bk_xmalloc((size_t)M * K * sizeof *A), *B = bk_xmalloc((size_t)K * N * sizeof *B);
    float *C = bk_xmalloc((size_t)M * N * sizeof *C);
    /* small deterministic values: no denormals, no overflow */
    for (size_t i = 0; i < (size_t)M * K; i++) A[i] = (float)((i * 7919u) % 17u) * 0.0625f - 0.5f;
    for (size_t i = 0; i < (size_t)K * N; i++) B[i] = (float)((i * 104729u) % 13u) * 0.0625f - 0.375f;
    bk_gemm(0, 0, M, N, K, 1.0f, A, K, B, N, 0.0f, C, N); // warm-up: thread pool, caches
    double best = 1e30, start = now_s();
    for (int runs = 0; runs < 3 || now_s() - start < min_seconds; runs++) {
        double t0 = now_s();
        bk_gemm(0, 0, M, N, K, 1.0f, A, K, B, N, 0.0f, C, N);
        double t = now_s() - t0;
        best = t < best ? t : best;
    }
    free(A), free(B), free(C);
    openblas_set_num_threads(prev);
    return 2.0 * M * N * K / best * 1e-9;
}

double bk_sgemm_peak_gflops(int threads)
{
    double a = bk_sgemm_gflops(threads, 1024, 1024, 1024, 0.2);
    double b = bk_sgemm_gflops(threads, 2048, 2048, 2048, 0.3);
    return a > b ? a : b;
}
