/* test_bk_gemm.c — bk_gemm, strided batched and grouped gemm against their _ref twins, and the
 * grouped backward against central finite differences of the _ref forward. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include <cblas.h>

#include "blas_kernels/bk_check.h"
#include "blas_kernels/bk_gemm.h"
#include "blas_kernels/bk_parallel.h"

/* sgemm accumulates in float: per-element error ~ sqrt(K) * 2^-24 * |a||b| for random data, so a
 * norm-wise relative error of 1e-5 leaves >10x margin at K <= 64 and still catches any wrong
 * index (which gives O(1) error). */
#define GEMM_RTOL 1e-5

static void test_gemm_all_transposes(void **state)
{
    (void)state;
    bk_rng r = {1};
    const int sizes[][3] = {{1, 1, 1}, {5, 17, 3}, {17, 5, 33}, {33, 64, 7}, {8, 1, 17}};
    for (size_t s = 0; s < sizeof sizes / sizeof sizes[0]; s++) {
        int M = sizes[s][0], N = sizes[s][1], K = sizes[s][2];
        for (int ta = 0; ta < 2; ta++)
            for (int tb = 0; tb < 2; tb++) {
                int pad = 3; // leading dimensions larger than the row length
                int lda = (ta ? M : K) + pad, ldb = (tb ? K : N) + pad, ldc = N + pad;
                size_t na = (size_t)(ta ? K : M) * lda, nb = (size_t)(tb ? N : K) * ldb, nc = (size_t)M * ldc;
                float *A = malloc(na * sizeof *A), *B = malloc(nb * sizeof *B);
                float *C = malloc(nc * sizeof *C), *Cr = malloc(nc * sizeof *Cr);
                bk_rng_fill(&r, A, na, -1, 1);
                bk_rng_fill(&r, B, nb, -1, 1);
                bk_rng_fill(&r, C, nc, -1, 1);
                memcpy(Cr, C, nc * sizeof *C);
                bk_gemm(ta, tb, M, N, K, 0.7f, A, lda, B, ldb, -0.3f, C, ldc);
                bk_gemm_ref(ta, tb, M, N, K, 0.7f, A, lda, B, ldb, -0.3f, Cr, ldc);
                double e = bk_rel_err(C, Cr, nc);
                if (e > GEMM_RTOL) print_error("M=%d N=%d K=%d ta=%d tb=%d rel err %g\n", M, N, K, ta, tb, e);
                assert_true(e <= GEMM_RTOL);
                /* beta = 0 must ignore C (fill it with NaN) */
                for (size_t i = 0; i < nc; i++) C[i] = NAN;
                memcpy(Cr, C, nc * sizeof *C);
                bk_gemm(ta, tb, M, N, K, 1.0f, A, lda, B, ldb, 0.0f, C, ldc);
                bk_gemm_ref(ta, tb, M, N, K, 1.0f, A, lda, B, ldb, 0.0f, Cr, ldc);
                for (int i = 0; i < M; i++)
                    for (int j = 0; j < N; j++) {
                        float c = C[(size_t)i * ldc + j], cr = Cr[(size_t)i * ldc + j];
                        assert_false(isnan(c));
                        assert_true(fabs((double)c - cr) <= 1e-5 * (1.0 + fabs(cr)) * K);
                    }
                free(A), free(B), free(C), free(Cr);
            }
    }
}

static void test_gemm_strided_batched(void **state)
{
    (void)state;
    bk_rng r = {2};
    int M = 5, N = 7, K = 9, batch = 4;
    long long sa = M * K + 2, sb = K * N + 1, sc = M * N + 3; // strides with gaps
    size_t na = (size_t)sa * batch, nb = (size_t)sb * batch, nc = (size_t)sc * batch;
    float *A = malloc(na * 4), *B = malloc(nb * 4), *C = malloc(nc * 4), *Cr = malloc(nc * 4);
    bk_rng_fill(&r, A, na, -1, 1);
    bk_rng_fill(&r, B, nb, -1, 1);
    bk_rng_fill(&r, C, nc, -1, 1);
    memcpy(Cr, C, nc * 4);
    bk_gemm_strided_batched(0, 1, M, N, K, 1.0f, A, K, sa, B, K, sb, 0.5f, C, N, sc, batch);
    bk_gemm_strided_batched_ref(0, 1, M, N, K, 1.0f, A, K, sa, B, K, sb, 0.5f, Cr, N, sc, batch);
    assert_true(bk_rel_err(C, Cr, nc) <= GEMM_RTOL);
    /* stride 0 broadcasts B; the gaps between C matrices must be untouched */
    float *C2 = malloc(nc * 4);
    memcpy(C2, Cr, nc * 4);
    bk_gemm_strided_batched(0, 0, M, N, K, 1.0f, A, K, sa, B, N, 0, 0.0f, C, N, sc, batch);
    for (int b = 0; b < batch; b++) {
        float *cb = Cr + b * sc;
        bk_gemm_ref(0, 0, M, N, K, 1.0f, A + b * sa, K, B, N, 0.0f, cb, N);
    }
    assert_true(bk_rel_err(C, Cr, nc) <= GEMM_RTOL);
    for (int b = 0; b < batch; b++)
        for (long long i = M * N; i < sc; i++) assert_true(C[b * sc + i] == C2[b * sc + i]);
    free(A), free(B), free(C), free(Cr), free(C2);
}

/* ---- grouped ---- */

typedef struct {
    float *x, *w, *y, *wy; // wy: random weights of the scalar loss sum(wy * y)
    const int32_t *gs;
    int G, M, K, N;
} grouped_ctx;

static double grouped_loss(void *p)
{
    grouped_ctx *c = p;
    bk_grouped_gemm_fwd_ref(c->y, c->x, c->w, c->gs, c->G, c->M, c->K, c->N);
    return bk_dot_d(c->wy, c->y, (size_t)c->M * c->N);
}

static void test_grouped_gemm(void **state)
{
    (void)state;
    bk_rng r = {3};
    const int32_t gs[] = {3, 0, 5, 1, 0, 8}; // empty groups included, odd sizes
    int G = 6, M = 17, K = 6, N = 5;
    size_t nx = (size_t)M * K, nw = (size_t)G * K * N, ny = (size_t)M * N;
    float *x = malloc(nx * 4), *w = malloc(nw * 4), *y = malloc(ny * 4), *yr = malloc(ny * 4);
    float *dy = malloc(ny * 4), *dx = calloc(nx, 4), *dw = calloc(nw, 4);
    float *dxr = calloc(nx, 4), *dwr = calloc(nw, 4);
    bk_rng_fill(&r, x, nx, -1, 1);
    bk_rng_fill(&r, w, nw, -1, 1);
    bk_rng_fill(&r, dy, ny, -1, 1);
    bk_grouped_gemm_fwd(y, x, w, gs, G, M, K, N);
    bk_grouped_gemm_fwd_ref(yr, x, w, gs, G, M, K, N);
    assert_true(bk_rel_err(y, yr, ny) <= GEMM_RTOL);

    /* backward accumulates: start from a non-zero gradient and check the increment */
    for (size_t i = 0; i < nx; i++) dx[i] = dxr[i] = 0.25f;
    bk_grouped_gemm_bwd(dx, dw, dy, x, w, gs, G, M, K, N);
    bk_grouped_gemm_bwd_ref(dxr, dwr, dy, x, w, gs, G, M, K, N);
    assert_true(bk_rel_err(dx, dxr, nx) <= GEMM_RTOL);
    assert_true(bk_rel_err(dw, dwr, nw) <= GEMM_RTOL);
    for (size_t i = 0; i < nx; i++) dx[i] -= 0.25f;

    /* finite differences of the _ref forward; the loss is bilinear so central differences are
   * exact up to float rounding of y (~1e-7 relative): 1e-4 is a tight, meaningful bound */
    grouped_ctx c = {x, w, yr, dy, gs, G, M, K, N};
    double *g = malloc((nx > nw ? nx : nw) * sizeof *g);
    bk_fd_grad(grouped_loss, &c, x, nx, 1e-2, g);
    assert_true(bk_rel_err_fd(dx, g, nx) <= 1e-4);
    bk_fd_grad(grouped_loss, &c, w, nw, 1e-2, g);
    assert_true(bk_rel_err_fd(dw, g, nw) <= 1e-4);
    /* weights of the empty groups get exactly zero gradient */
    for (int k = 0; k < K * N; k++) assert_true(dw[1 * K * N + k] == 0.0f && dw[4 * K * N + k] == 0.0f);
    free(x), free(w), free(y), free(yr), free(dy), free(dx), free(dw), free(dxr), free(dwr), free(g);
}

/* A large product split into blocks on the kernel pool gives the same bits as one
 * single-threaded sgemm of the whole product, for every transpose pair, split along rows (M >= N)
 * or columns, with a ragged last block, a leading dimension wider than the matrix and beta 0.25 or 1,
 * whatever the pool's thread count (the block count follows it: two per thread below 2^26
 * multiply-adds, one from there, as the last shape has); and it still equals the
 * double-precision reference. */
static void test_gemm_split_same_bits(void **state)
{
    (void)state;
    static const int shapes[][3] = {{1000, 300, 64}, {200, 1100, 96}, {2048, 512, 64}};
    openblas_set_num_threads(1);
    for (int threads = 2; threads <= 4; threads++) {
        bk_parallel_set_threads(threads);
        for (int si = 0; si < 3; si++)
            for (int t = 0; t < 4; t++) {
                int M = shapes[si][0], N = shapes[si][1], K = shapes[si][2], ta = t & 1, tb = t >> 1, pad = 3;
                int lda = (ta ? M : K) + pad, ldb = (tb ? K : N) + pad, ldc = N + pad;
                size_t na = (size_t)(ta ? K : M) * lda, nb = (size_t)(tb ? N : K) * ldb, nc = (size_t)M * ldc;
                float *A = malloc(na * sizeof *A), *B = malloc(nb * sizeof *B), *C = malloc(nc * sizeof *C),
                      *C1 = malloc(nc * sizeof *C1), *R = malloc(nc * sizeof *R);
                bk_rng r = {7u + (uint64_t)t};
                bk_rng_fill(&r, A, na, -1, 1);
                bk_rng_fill(&r, B, nb, -1, 1);
                bk_rng_fill(&r, C, nc, -1, 1);
                memcpy(C1, C, nc * sizeof *C);
                memcpy(R, C, nc * sizeof *C);
                /* beta = 1 (a cotangent accumulated by sgemm, mesh_einsum_into) skips OpenBLAS's beta pass:
         * every shape meets it under two of the four transpose pairs */
                float beta = ((si + t) & 1) ? 1.0f : 0.25f;
                bk_gemm(ta, tb, M, N, K, 0.5f, A, lda, B, ldb, beta, C, ldc);
                cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, M, N, K,
                            0.5f, A, lda, B, ldb, beta, C1, ldc);
                assert_memory_equal(C, C1, nc * sizeof *C);
                if (threads == 2) { /* the reference is slow; the bits are the same for every thread count */
                    bk_gemm_ref(ta, tb, M, N, K, 0.5f, A, lda, B, ldb, beta, R, ldc);
                    assert_true(bk_rel_err(C, R, nc) <= GEMM_RTOL);
                }
                free(A), free(B), free(C), free(C1), free(R);
            }
    }
    bk_parallel_set_threads(1);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_gemm_all_transposes),
        cmocka_unit_test(test_gemm_strided_batched),
        cmocka_unit_test(test_grouped_gemm),
        cmocka_unit_test(test_gemm_split_same_bits),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
