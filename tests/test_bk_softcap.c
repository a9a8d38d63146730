/* test_bk_softcap.c — the logits soft cap y = cap tanh(a x / cap) (and y = a x without a cap):
 * fast kernel vs the double twin, backward vs finite differences of the twin, and the bound
 * |y| < cap that defines a soft cap. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "blas_kernels/bk_check.h"
#include "blas_kernels/bk_softcap.h"

/* tanhf vs double tanh: a few ulps; the backward recovers tanh from the float output */
#define REF_RTOL 1e-6
#define BWD_RTOL 1e-5
#define FD_EPS 1e-2
#define FD_RTOL 3e-4
#define N 301

typedef struct {
    const float *x;
    const float *w;
    float a, cap;
} fd_ctx;

static double fd_loss(void *c_)
{
    fd_ctx *c = c_;
    float y[N];
    bk_softcap_fwd_ref(y, c->x, N, c->a, c->cap);
    return bk_dot_d(c->w, y, N);
}

static void check(float a, float cap)
{
    bk_rng r = {61};
    float x[N], y[N], yr[N], dy[N], dx[N], dxr[N];
    bk_rng_fill(&r, x, N, -30, 30);
    bk_rng_fill(&r, dy, N, -1, 1);
    x[0] = 0.0f, x[1] = 1e30f, x[2] = -1e30f;
    bk_softcap_fwd(y, x, N, a, cap);
    bk_softcap_fwd_ref(yr, x, N, a, cap);
    assert_true(bk_rel_err(y, yr, N) <= REF_RTOL);
    memset(dx, 0, sizeof dx), memset(dxr, 0, sizeof dxr);
    bk_softcap_bwd(dx, dy, y, N, a, cap);
    bk_softcap_bwd_ref(dxr, dy, x, N, a, cap);
    assert_true(bk_rel_err(dx, dxr, N) <= BWD_RTOL);
    if (cap > 0) {
        for (int i = 0; i < N; i++) assert_true(fabsf(y[i]) <= cap);
        assert_true(y[0] == 0.0f && y[1] == cap && y[2] == -cap && dx[1] == 0.0f);
    }
    /* finite differences away from the huge inputs */
    x[1] = 3.0f, x[2] = -3.0f;
    memset(dx, 0, sizeof dx);
    bk_softcap_fwd(y, x, N, a, cap);
    bk_softcap_bwd(dx, dy, y, N, a, cap);
    fd_ctx c = {x, dy, a, cap};
    double g[N];
    bk_fd_grad(fd_loss, &c, x, N, FD_EPS, g);
    assert_true(bk_rel_err_fd(dx, g, N) <= FD_RTOL);
}

static void test_softcap(void **state)
{
    (void)state;
    check(1.0f, 5.0f);   /* final_logits_soft_cap alone */
    check(0.125f, 2.0f); /* with normalize_embedding_logits (emb 64) */
    check(0.125f, 0.0f); /* normalisation only */
    float x[3] = {1.0f, -2.0f, 8.0f}, y[3];
    bk_softcap_fwd(y, x, 3, 0.5f, 0.0f);
    assert_true(y[0] == 0.5f && y[1] == -1.0f && y[2] == 4.0f);
}

int main(void)
{
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_softcap)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}
