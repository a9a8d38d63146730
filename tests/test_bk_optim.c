/* test_bk_optim.c — the optimizer kernels: the fused AdamW pass and SGD against their plain
 * _ref loops (bitwise: the same float operations in the same order, whatever vector width the
 * CPU's clone uses), with and without clipping, on lengths that leave partial chunks; the same
 * bits on 1 and 2 pool threads; the sum of squares exact on values whose squares add exactly in
 * double, and within double rounding of a plain sum otherwise. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "blas_kernels/bk_check.h"
#include "blas_kernels/bk_optim.h"
#include "blas_kernels/bk_parallel.h"

enum { N = 3 * (1 << 15) + 4099 }; /* three whole AdamW chunks and a partial one, odd tail */

static bk_adamw_hp hp_of(int clip)
{
    bk_adamw_hp h = {.clip = clip != 0,
                     .gnorm = 3.5f,
                     .thr = 1.25f,
                     .neg_lr = -3e-3f,
                     .b1 = 0.9f,
                     .b2 = 0.95f,
                     .omb1 = (float)(1.0 - 0.9),
                     .omb2 = (float)(1.0 - 0.95),
                     .bc1 = 0.271f,
                     .bc2 = 0.142625f,
                     .eps = 1e-8f,
                     .eps_root = 1e-12f,
                     .wd = 0.1f};
    return h;
}

static void fill(float *x, float *mu, float *nu, float *g, unsigned seed)
{
    bk_rng r = {seed};
    bk_rng_fill(&r, x, N, -1, 1);
    bk_rng_fill(&r, mu, N, -0.1f, 0.1f);
    bk_rng_fill(&r, nu, N, 0, 0.01f);
    bk_rng_fill(&r, g, N, -2, 2);
}

static void test_adamw_vs_ref_bitwise(void **state)
{
    (void)state;
    size_t b = N * sizeof(float);
    float *x = malloc(b), *mu = malloc(b), *nu = malloc(b), *g = malloc(b);
    float *xr = malloc(b), *mur = malloc(b), *nur = malloc(b), *x1 = malloc(b), *mu1 = malloc(b), *nu1 = malloc(b);
    for (int clip = 0; clip < 2; clip++) {
        bk_adamw_hp h = hp_of(clip);
        fill(x, mu, nu, g, 7);
        memcpy(xr, x, b), memcpy(mur, mu, b), memcpy(nur, nu, b);
        memcpy(x1, x, b), memcpy(mu1, mu, b), memcpy(nu1, nu, b);
        bk_parallel_set_threads(2);
        bk_adamw_update(x, mu, nu, g, N, &h);
        bk_parallel_set_threads(1);
        bk_adamw_update(x1, mu1, nu1, g, N, &h);
        bk_adamw_update_ref(xr, mur, nur, g, N, &h);
        assert_memory_equal(x, xr, b);
        assert_memory_equal(mu, mur, b);
        assert_memory_equal(nu, nur, b);
        assert_memory_equal(x, x1, b);
        /* and one element by hand in double (float rounding: a few ulps) */
        bk_rng r = {7};
        double x0 = bk_rng_uniform(&r, -1, 1); /* element 0 of x, mu, nu and g, as fill draws them */
        for (int i = 1; i < N; i++) bk_rng_uniform(&r, -1, 1);
        double m0 = bk_rng_uniform(&r, -0.1f, 0.1f);
        for (int i = 1; i < N; i++) bk_rng_uniform(&r, -0.1f, 0.1f);
        double v0 = bk_rng_uniform(&r, 0, 0.01f);
        for (int i = 1; i < N; i++) bk_rng_uniform(&r, 0, 0.01f);
        double g0 = bk_rng_uniform(&r, -2, 2);
        if (clip) g0 = g0 / 3.5 * 1.25;
        double m = 0.1 * g0 + 0.9 * m0, v = 0.05 * g0 * g0 + 0.95 * v0;
        double want = x0 - 3e-3 * ((m / 0.271) / (sqrt(v / 0.142625 + 1e-12) + 1e-8) + 0.1 * x0);
        assert_float_equal(x[0], want, 1e-6);
        assert_float_equal(mu[0], m, 1e-7);
    }
    /* SGD: x - lr g' */
    bk_adamw_hp h = hp_of(1);
    fill(x, mu, nu, g, 9);
    memcpy(xr, x, b);
    bk_parallel_set_threads(2);
    bk_sgd_update(x, g, N, &h);
    bk_parallel_set_threads(1);
    for (int i = 0; i < N; i++) assert_true(x[i] == xr[i] + -3e-3f * ((g[i] / 3.5f) * 1.25f));
    free(x), free(mu), free(nu), free(g), free(xr), free(mur), free(nur), free(x1), free(mu1), free(nu1);
}

static void test_sumsq(void **state)
{
    (void)state;
    enum { M = 5 * BK_SUMSQ_GRAIN + 37 };
    float *x = malloc(M * sizeof *x);
    /* multiples of 1/8 below 4: squares are multiples of 1/64 below 16, so every partial sum
     * of fewer than 2^40 of them is exact in double and any order gives the exact total */
    double want = 0.0;
    for (int i = 0; i < M; i++) {
        int k = (int)((i * 2654435761u) % 63u) - 31;
        x[i] = (float)k / 8.0f;
        want += (double)(k * k) / 64.0; /* exact too */
    }
    bk_parallel_set_threads(2);
    assert_true(bk_sumsq(x, M) == want);
    assert_true(bk_sumsq(x, 5) == bk_sumsq_ref(x, 5)); /* a tail alone */
    assert_true(bk_sumsq(x, 0) == 0.0);
    /* random values: within double rounding of the plain sum; the same bits on 1 thread */
    bk_rng r = {11};
    bk_rng_fill(&r, x, M, -3, 3);
    double s2 = bk_sumsq(x, M), ref = bk_sumsq_ref(x, M);
    bk_parallel_set_threads(1);
    double s1 = bk_sumsq(x, M);
    assert_true(s1 == s2);
    assert_true(fabs(s2 - ref) <= 1e-12 * ref);
    free(x);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_adamw_vs_ref_bitwise),
        cmocka_unit_test(test_sumsq),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
