/* test_bk_rmsnorm.c — RMSNorm fwd/bwd against the _ref twin and central finite differences. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "blas_kernels/bk_check.h"
#include "blas_kernels/bk_rmsnorm.h"

/* fast vs _ref: both compute mean(x^2) in double; the fast one applies r and scale in float, so
 * elements differ by a few ulps: 1e-6 norm-wise relative is ~10 ulps of margin. */
#define REF_RTOL 1e-6
/* finite differences: eps 1e-2 on O(1) inputs; truncation O(eps^2) and rounding of the float
 * outputs (~ sqrt(n) 6e-8 / eps) are both ~1e-5 (observed 9e-6): 3e-4 still catches any missing
 * term, which costs O(0.1..1). */
#define FD_EPS 1e-2
#define FD_RTOL 3e-4

static void test_rmsnorm_vs_ref(void **state)
{
    (void)state;
    bk_rng r = {11};
    const int shapes[][2] = {{1, 1}, {5, 17}, {17, 64}, {3, 129}, {1, 512}};
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
        int N = shapes[s][0], C = shapes[s][1];
        size_t n = (size_t)N * C;
        float *x = malloc(n * 4), *w = malloc(C * 4), *y = malloc(n * 4), *yr = malloc(n * 4);
        float *rs = malloc(N * 4), *rsr = malloc(N * 4), *dy = malloc(n * 4);
        float *dx = malloc(n * 4), *dxr = malloc(n * 4), *dw = malloc(C * 4), *dwr = malloc(C * 4);
        bk_rng_fill(&r, x, n, -2, 2);
        bk_rng_fill(&r, w, C, 0.5f, 1.5f);
        bk_rng_fill(&r, dy, n, -1, 1);
        bk_rmsnorm_fwd(y, rs, x, w, N, C, 1e-5f);
        bk_rmsnorm_fwd_ref(yr, rsr, x, w, N, C, 1e-5f);
        assert_true(bk_rel_err(y, yr, n) <= REF_RTOL);
        assert_true(bk_rel_err(rs, rsr, N) <= REF_RTOL);
        /* accumulation: start both from the same non-zero gradients */
        for (size_t i = 0; i < n; i++) dx[i] = dxr[i] = 1.0f;
        for (int i = 0; i < C; i++) dw[i] = dwr[i] = -1.0f;
        bk_rmsnorm_bwd(dx, dw, dy, x, rs, w, N, C);
        bk_rmsnorm_bwd_ref(dxr, dwr, dy, x, rsr, w, N, C);
        for (size_t i = 0; i < n; i++) dx[i] -= 1.0f, dxr[i] -= 1.0f;
        for (int i = 0; i < C; i++) dw[i] += 1.0f, dwr[i] += 1.0f;
        /* C = 1 is all cancellation (dx = r g w eps / (x^2 + eps)): only the scale is checked there */
        double edx = bk_rel_err(dx, dxr, n);
        if (edx > 1e-5) print_message("N=%d C=%d dx rel err %.2e\n", N, C, edx);
        assert_true(C == 1 || edx <= 1e-5); // the +-1 offsets cost a few ulps of 1
        assert_true(bk_rel_err(dw, dwr, C) <= 1e-5);
        free(x), free(w), free(y), free(yr), free(rs), free(rsr), free(dy), free(dx), free(dxr);
        free(dw), free(dwr);
    }
}

typedef struct {
    float *x, *w, *y, *rs, *wy;
    int N, C;
    float eps;
} ctx_t;

static double loss(void *p)
{
    ctx_t *c = p;
    bk_rmsnorm_fwd_ref(c->y, c->rs, c->x, c->w, c->N, c->C, c->eps);
    return bk_dot_d(c->wy, c->y, (size_t)c->N * c->C);
}

static void test_rmsnorm_fd(void **state)
{
    (void)state;
    bk_rng r = {12};
    int N = 5, C = 17;
    size_t n = (size_t)N * C;
    float *x = malloc(n * 4), *w = malloc(C * 4), *y = malloc(n * 4), *rs = malloc(N * 4);
    float *dy = malloc(n * 4), *dx = calloc(n, 4), *dw = calloc(C, 4);
    double *g = malloc(n * sizeof *g);
    bk_rng_fill(&r, x, n, -2, 2);
    bk_rng_fill(&r, w, C, 0.5f, 1.5f);
    bk_rng_fill(&r, dy, n, -1, 1);
    /* eps large enough to matter in the derivative (mean(x^2) ~ 1.3) */
    ctx_t c = {x, w, y, rs, dy, N, C, 0.1f};
    bk_rmsnorm_fwd(y, rs, x, w, N, C, c.eps);
    bk_rmsnorm_bwd(dx, dw, dy, x, rs, w, N, C);
    bk_fd_grad(loss, &c, x, n, FD_EPS, g);
    double ex = bk_rel_err_fd(dx, g, n);
    bk_fd_grad(loss, &c, w, C, FD_EPS, g);
    double ew = bk_rel_err_fd(dw, g, C);
    print_message("rmsnorm fd rel err: dx %.2e dscale %.2e\n", ex, ew);
    assert_true(ex <= FD_RTOL);
    assert_true(ew <= FD_RTOL);
    free(x), free(w), free(y), free(rs), free(dy), free(dx), free(dw), free(g);
}

static void test_rmsnorm_zero_row(void **state)
{
    (void)state;
    /* an all-zero row: rstd = 1/sqrt(eps), output and gradients 0, no NaN */
    float x[4] = {0}, w[4] = {1, 2, 3, 4}, y[4], rs[1], dy[4] = {1, 1, 1, 1}, dx[4] = {0}, dw[4] = {0};
    bk_rmsnorm_fwd(y, rs, x, w, 1, 4, 1e-6f);
    assert_true(fabsf(rs[0] - 1000.0f) < 1e-2f);
    bk_rmsnorm_bwd(dx, dw, dy, x, rs, w, 1, 4);
    for (int i = 0; i < 4; i++) {
        assert_true(y[i] == 0.0f && dw[i] == 0.0f);
        assert_true(fabsf(dx[i] - 1000.0f * w[i]) < 1e-1f); // dx = r * dout * scale at x = 0
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_rmsnorm_vs_ref),
        cmocka_unit_test(test_rmsnorm_fd),
        cmocka_unit_test(test_rmsnorm_zero_row),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
