/* test_bk_activation.c — SiLU and SwiGLU fwd/bwd against _ref twins and finite differences. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "blas_kernels/bk_activation.h"
#include "blas_kernels/bk_check.h"

/* fast (float expf) vs _ref (double exp): a few ulps per element -> 1e-6 norm-wise */
#define REF_RTOL 1e-6
/* eps 1e-2, smooth functions with O(1) third derivatives: truncation ~1e-5, rounding ~1e-5
 * (observed <= 7e-6) */
#define FD_EPS 1e-2
#define FD_RTOL 3e-4

#define N 257

static void test_silu_swiglu_vs_ref(void **state)
{
    (void)state;
    bk_rng r = {21};
    float g[N], u[N], y[N], yr[N], dy[N], dg[N], dgr[N], du[N], dur[N];
    bk_rng_fill(&r, g, N, -8, 8);
    bk_rng_fill(&r, u, N, -2, 2);
    bk_rng_fill(&r, dy, N, -1, 1);
    /* extremes must stay finite: sigmoid is evaluated without overflow */
    g[0] = -1e30f, g[1] = 1e30f, g[2] = -100.0f, g[3] = 100.0f, g[4] = 0.0f;
    bk_silu_fwd(y, g, N);
    bk_silu_fwd_ref(yr, g, N);
    assert_true(bk_rel_err(y, yr, N) <= REF_RTOL);
    memset(dg, 0, sizeof dg), memset(dgr, 0, sizeof dgr);
    bk_silu_bwd(dg, dy, g, N);
    bk_silu_bwd_ref(dgr, dy, g, N);
    assert_true(bk_rel_err(dg, dgr, N) <= REF_RTOL);
    for (int i = 0; i < N; i++) assert_true(isfinite(y[i]) && isfinite(dg[i]));
    assert_true(y[0] == 0.0f && dg[0] == 0.0f && y[1] == 1e30f && dg[1] == dy[1]);

    bk_swiglu_fwd(y, g, u, N);
    bk_swiglu_fwd_ref(yr, g, u, N);
    assert_true(bk_rel_err(y, yr, N) <= REF_RTOL);
    for (int i = 0; i < N; i++) dg[i] = dgr[i] = 0.5f, du[i] = dur[i] = -0.5f;
    bk_swiglu_bwd(dg, du, dy, g, u, N);
    bk_swiglu_bwd_ref(dgr, dur, dy, g, u, N);
    assert_true(bk_rel_err(dg, dgr, N) <= 1e-5); // +-0.5 offsets: ulps of 0.5
    assert_true(bk_rel_err(du, dur, N) <= 1e-5);
    /* the writing form over garbage equals the adding form over zeros */
    float dgz[N], duz[N];
    for (int i = 0; i < N; i++) dgz[i] = duz[i] = 0.0f, dg[i] = du[i] = 1e30f;
    bk_swiglu_bwd(dgz, duz, dy, g, u, N);
    bk_swiglu_bwd_into(dg, du, dy, g, u, N);
    for (int i = 0; i < N; i++) assert_true(dg[i] == dgz[i] && du[i] == duz[i]);
}

typedef struct {
    float *g, *u, *y, *wy;
    int swiglu;
} ctx_t;

static double loss(void *p)
{
    ctx_t *c = p;
    if (c->swiglu) bk_swiglu_fwd_ref(c->y, c->g, c->u, N);
    else bk_silu_fwd_ref(c->y, c->g, N);
    return bk_dot_d(c->wy, c->y, N);
}

static void test_silu_swiglu_fd(void **state)
{
    (void)state;
    bk_rng r = {22};
    float g[N], u[N], y[N], dy[N], dg[N] = {0}, du[N] = {0};
    double fd[N];
    bk_rng_fill(&r, g, N, -6, 6);
    bk_rng_fill(&r, u, N, -2, 2);
    bk_rng_fill(&r, dy, N, -1, 1);
    ctx_t c = {g, u, y, dy, 0};
    bk_silu_bwd(dg, dy, g, N);
    bk_fd_grad(loss, &c, g, N, FD_EPS, fd);
    assert_true(bk_rel_err_fd(dg, fd, N) <= FD_RTOL);

    c.swiglu = 1;
    memset(dg, 0, sizeof dg);
    bk_swiglu_bwd(dg, du, dy, g, u, N);
    bk_fd_grad(loss, &c, g, N, FD_EPS, fd);
    double eg = bk_rel_err_fd(dg, fd, N);
    bk_fd_grad(loss, &c, u, N, FD_EPS, fd);
    double eu = bk_rel_err_fd(du, fd, N);
    print_message("swiglu fd rel err: dgate %.2e dup %.2e\n", eg, eu);
    assert_true(eg <= FD_RTOL && eu <= FD_RTOL);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_silu_swiglu_vs_ref),
        cmocka_unit_test(test_silu_swiglu_fd),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
