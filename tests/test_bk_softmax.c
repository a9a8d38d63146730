/* test_bk_softmax.c — row softmax fwd/bwd against the _ref twin and finite differences. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "blas_kernels/bk_check.h"
#include "blas_kernels/bk_softmax.h"

/* fast: expf and a float reciprocal; ref: double. A few ulps per element -> 1e-6 norm-wise. */
#define REF_RTOL 1e-6
#define FD_EPS 1e-2
#define FD_RTOL 3e-4 // truncation O(eps^2) and float rounding both ~1e-5 (observed 1.3e-5)

static void test_softmax_vs_ref(void **state)
{
    (void)state;
    bk_rng r = {31};
    const int shapes[][2] = {{1, 1}, {5, 17}, {17, 5}, {3, 1000}};
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
        int Nr = shapes[s][0], V = shapes[s][1];
        size_t n = (size_t)Nr * V;
        float *x = malloc(n * 4), *y = malloc(n * 4), *yr = malloc(n * 4), *dy = malloc(n * 4);
        float *dx = malloc(n * 4), *dxr = malloc(n * 4);
        bk_rng_fill(&r, x, n, -5, 5);
        x[0] += 1e4f; // a large logit must not overflow
        bk_rng_fill(&r, dy, n, -1, 1);
        bk_softmax_fwd(y, x, Nr, V);
        bk_softmax_fwd_ref(yr, x, Nr, V);
        assert_true(bk_rel_err(y, yr, n) <= REF_RTOL);
        for (int i = 0; i < Nr; i++) {
            double sum = 0.0;
            for (int j = 0; j < V; j++) sum += y[(size_t)i * V + j];
            assert_true(fabs(sum - 1.0) < 1e-5);
        }
        memset(dx, 0, n * 4), memset(dxr, 0, n * 4);
        bk_softmax_bwd(dx, dy, y, Nr, V);
        bk_softmax_bwd_ref(dxr, dy, yr, Nr, V);
        if (V > 1) assert_true(bk_rel_err(dx, dxr, n) <= 1e-5); // V=1: gradient exactly 0 both
        free(x), free(y), free(yr), free(dy), free(dx), free(dxr);
    }
    /* in place */
    float a[3] = {1, 2, 3}, b[3];
    bk_softmax_fwd_ref(b, a, 1, 3);
    bk_softmax_fwd(a, a, 1, 3);
    assert_true(bk_rel_err(a, b, 3) <= REF_RTOL);
}

typedef struct {
    float *x, *y, *wy;
    int N, V;
} ctx_t;

static double loss(void *p)
{
    ctx_t *c = p;
    bk_softmax_fwd_ref(c->y, c->x, c->N, c->V);
    return bk_dot_d(c->wy, c->y, (size_t)c->N * c->V);
}

static void test_softmax_fd(void **state)
{
    (void)state;
    bk_rng r = {32};
    int Nr = 5, V = 17;
    size_t n = (size_t)Nr * V;
    float x[5 * 17], y[5 * 17], dy[5 * 17], dx[5 * 17] = {0};
    double g[5 * 17];
    bk_rng_fill(&r, x, n, -3, 3);
    bk_rng_fill(&r, dy, n, -1, 1);
    ctx_t c = {x, y, dy, Nr, V};
    bk_softmax_fwd(y, x, Nr, V);
    bk_softmax_bwd(dx, dy, y, Nr, V);
    bk_fd_grad(loss, &c, x, n, FD_EPS, g);
    double e = bk_rel_err_fd(dx, g, n);
    print_message("softmax fd rel err %.2e\n", e);
    assert_true(e <= FD_RTOL);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_softmax_vs_ref),
        cmocka_unit_test(test_softmax_fd),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
