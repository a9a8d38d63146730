/* test_bk_topk.c — top-k against the selection _ref, ties (lowest index wins), NaN/inf order,
 * both the insertion path (k <= 32) and the sort path (k > 32), and the backward scatter. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "blas_kernels/bk_check.h"
#include "blas_kernels/bk_topk.h"

static void check_same(const float *x, int N, int E, int k)
{
    float *v = malloc((size_t)N * k * 4), *vr = malloc((size_t)N * k * 4);
    int32_t *i = malloc((size_t)N * k * 4), *ir = malloc((size_t)N * k * 4);
    bk_topk_fwd(v, i, x, N, E, k);
    bk_topk_fwd_ref(vr, ir, x, N, E, k);
    for (int j = 0; j < N * k; j++) {
        if (i[j] != ir[j]) print_error("E=%d k=%d: slot %d index %d, ref %d\n", E, k, j, i[j], ir[j]);
        assert_int_equal(i[j], ir[j]);
        assert_true(memcmp(&v[j], &vr[j], 4) == 0); // same bits (NaN included)
    }
    free(v), free(vr), free(i), free(ir);
}

static void test_topk_vs_ref(void **state)
{
    (void)state;
    bk_rng r = {81};
    const int cfg[][2] = {{1, 1}, {5, 1}, {5, 5}, {17, 2}, {17, 8}, {256, 8}, {100, 33}, {100, 100}, {64, 32}};
    for (size_t c = 0; c < sizeof cfg / sizeof cfg[0]; c++) {
        int E = cfg[c][0], k = cfg[c][1], N = 17;
        float *x = malloc((size_t)N * E * 4);
        bk_rng_fill(&r, x, (size_t)N * E, -1, 1);
        check_same(x, N, E, k);
        /* coarse values: many ties */
        for (int j = 0; j < N * E; j++) x[j] = (float)bk_rng_int(&r, 4);
        check_same(x, N, E, k);
        free(x);
    }
}

static void test_topk_ties(void **state)
{
    (void)state;
    for (int big = 0; big < 2; big++) { // insertion path and sort path (k > 32)
        int E = big ? 80 : 10, k = big ? 40 : 4;
        float *x = calloc(E, 4), *v = malloc(k * 4);
        int32_t *i = malloc(k * 4);
        /* all equal: indices 0..k-1 */
        bk_topk_fwd(v, i, x, 1, E, k);
        for (int s = 0; s < k; s++) assert_int_equal(i[s], s);
        /* three equal maxima at 7, 3, 9 and a tie at the cut: 3, 7, 9 then the lowest 2.0 */
        for (int j = 0; j < E; j++) x[j] = 1.0f;
        x[7] = x[3] = x[9] = 5.0f;
        x[8] = x[2] = 2.0f;
        bk_topk_fwd(v, i, x, 1, E, 4);
        assert_int_equal(i[0], 3), assert_int_equal(i[1], 7), assert_int_equal(i[2], 9);
        assert_int_equal(i[3], 2);
        /* -0.0 and +0.0 compare equal: lowest index, whichever sign */
        for (int j = 0; j < E; j++) x[j] = -1.0f;
        x[5] = 0.0f, x[1] = -0.0f;
        bk_topk_fwd(v, i, x, 1, E, 2);
        assert_int_equal(i[0], 1), assert_int_equal(i[1], 5);
        /* NaN above +inf above finite; equal NaNs by index */
        x[6] = NAN, x[4] = INFINITY, x[2] = NAN;
        bk_topk_fwd(v, i, x, 1, E, 4);
        assert_int_equal(i[0], 2), assert_int_equal(i[1], 6), assert_int_equal(i[2], 4);
        assert_int_equal(i[3], 1);
        if (big) { // k > 32 exercised on the sort path too
            bk_topk_fwd(v, i, x, 1, E, k);
            assert_int_equal(i[0], 2), assert_int_equal(i[4], 5), assert_int_equal(i[5], 0);
            for (int s = 6; s < k; s++) assert_true(i[s] > i[s - 1]); // the -1.0 run, by index
        }
        free(x), free(v), free(i);
    }
}

typedef struct {
    float *x, *v, *w;
    int32_t *i;
    int N, E, k;
} ctx_t;

static double loss(void *p)
{
    ctx_t *c = p;
    bk_topk_fwd_ref(c->v, c->i, c->x, c->N, c->E, c->k);
    return bk_dot_d(c->w, c->v, (size_t)c->N * c->k);
}

static void test_topk_bwd(void **state)
{
    (void)state;
    bk_rng r = {82};
    enum { N = 5, E = 17, K = 3 };
    float x[N * E], v[N * K], w[N * K], dx[N * E];
    int32_t idx[N * K];
    double g[N * E];
    /* distinct values spaced 0.1 apart (a permutation), so eps 1e-2 never changes the selection */
    for (int n = 0; n < N; n++) {
        for (int j = 0; j < E; j++) x[n * E + j] = 0.1f * j;
        for (int j = E - 1; j > 0; j--) {
            int s = bk_rng_int(&r, j + 1);
            float t = x[n * E + j];
            x[n * E + j] = x[n * E + s], x[n * E + s] = t;
        }
    }
    bk_rng_fill(&r, w, N * K, -1, 1);
    for (int j = 0; j < N * E; j++) dx[j] = 0.0f;
    bk_topk_fwd(v, idx, x, N, E, K);
    bk_topk_bwd(dx, w, idx, N, E, K);
    ctx_t c = {x, v, w, idx, N, E, K};
    bk_fd_grad(loss, &c, x, N * E, 1e-2, g);
    assert_true(bk_rel_err_fd(dx, g, N * E) <= 1e-5); // piecewise linear: exact up to rounding
    int nz = 0;
    for (int j = 0; j < N * E; j++) nz += dx[j] != 0.0f;
    assert_int_equal(nz, N * K);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_topk_vs_ref),
        cmocka_unit_test(test_topk_ties),
        cmocka_unit_test(test_topk_bwd),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
