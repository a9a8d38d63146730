/* test_bk_xent.c — cross-entropy with z-loss: fast vs _ref, finite differences, the z-loss term,
 * and the vocab-sharded composition (pieces over a split vocabulary) vs the full kernel. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "blas_kernels/bk_check.h"
#include "blas_kernels/bk_xent.h"

/* Fast: expf, row sums in double, lse in double then float; ref: all double. Differences are a
 * few float ulps of lse, so |d| <= 1e-6 * (1 + |value|) per row has >10x margin. */
#define ROW_TOL 1e-6
#define FD_EPS 1e-2
#define FD_RTOL 3e-4 // smooth; truncation and rounding both ~1e-5 at eps 1e-2

static int close_rel(double a, double b, double tol) { return fabs(a - b) <= tol * (1.0 + fabs(b)); }

static void test_xent_vs_ref(void **state)
{
    (void)state;
    bk_rng r = {61};
    const int shapes[][2] = {{1, 1}, {5, 17}, {17, 5}, {3, 1000}};
    const float zs[] = {0.0f, 1e-4f, 0.1f};
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++)
        for (int zi = 0; zi < 3; zi++) {
            int N = shapes[s][0], V = shapes[s][1];
            float z = zs[zi];
            size_t n = (size_t)N * V;
            float *x = malloc(n * 4), *dx = calloc(n, 4), *dxr = calloc(n, 4);
            float *loss = malloc(N * 4), *lossr = malloc(N * 4), *lse = malloc(N * 4), *lser = malloc(N * 4);
            float *dl = malloc(N * 4);
            int32_t *t = malloc(N * 4);
            bk_rng_fill(&r, x, n, -4, 4);
            x[0] += 50.0f; // a dominant logit must not overflow
            bk_rng_fill(&r, dl, N, -1, 1);
            for (int i = 0; i < N; i++) t[i] = bk_rng_int(&r, V);
            bk_xent_fwd(loss, lse, x, t, N, V, z);
            bk_xent_fwd_ref(lossr, lser, x, t, N, V, z);
            for (int i = 0; i < N; i++) {
                assert_true(close_rel(lse[i], lser[i], ROW_TOL));
                assert_true(close_rel(loss[i], lossr[i], ROW_TOL * (1 + 2 * z * fabs(lser[i]))));
            }
            bk_xent_bwd(dx, dl, x, lse, t, N, V, z);
            bk_xent_bwd_ref(dxr, dl, x, lser, t, N, V, z);
            double e = bk_rel_err(dx, dxr, n);
            if (e > 1e-5) print_error("N=%d V=%d z=%g dlogits rel err %g\n", N, V, (double)z, e);
            assert_true(V == 1 || e <= 1e-5); // V = 1: gradient is 2 z lse dl ~ 0, all rounding
            free(x), free(dx), free(dxr), free(loss), free(lossr), free(lse), free(lser), free(dl), free(t);
        }
}

typedef struct {
    float *x, *loss, *lse, *w;
    const int32_t *t;
    int N, V;
    float z;
} ctx_t;

static double loss_fn(void *p)
{
    ctx_t *c = p;
    bk_xent_fwd_ref(c->loss, c->lse, c->x, c->t, c->N, c->V, c->z);
    return bk_dot_d(c->w, c->loss, c->N);
}

static void test_xent_fd(void **state)
{
    (void)state;
    bk_rng r = {62};
    enum { N = 5, V = 17 };
    float x[N * V], loss[N], lse[N], w[N], dx[N * V];
    int32_t t[N] = {0, 16, 3, 3, 9};
    double g[N * V];
    bk_rng_fill(&r, x, N * V, -3, 3);
    bk_rng_fill(&r, w, N, -1, 1);
    for (int zi = 0; zi < 2; zi++) {
        float z = zi ? 0.05f : 0.0f;
        memset(dx, 0, sizeof dx);
        bk_xent_fwd(loss, lse, x, t, N, V, z);
        bk_xent_bwd(dx, w, x, lse, t, N, V, z);
        ctx_t c = {x, loss, lse, w, t, N, V, z};
        bk_fd_grad(loss_fn, &c, x, N * V, FD_EPS, g);
        double e = bk_rel_err_fd(dx, g, N * V);
        print_message("xent fd z=%g rel err %.2e\n", (double)z, e);
        assert_true(e <= FD_RTOL);
    }
}

static void test_xent_zloss_term(void **state)
{
    (void)state;
    /* uniform row of 4: lse = ln 4, loss = ln 4 - 0 + z ln^2 4 */
    float x[4] = {0, 0, 0, 0}, loss, lse;
    int32_t t = 2;
    bk_xent_fwd(&loss, &lse, x, &t, 1, 4, 0.25f);
    assert_true(fabs(lse - log(4.0)) < 1e-6);
    assert_true(fabs(loss - (log(4.0) + 0.25 * log(4.0) * log(4.0))) < 1e-6);
    /* on random rows the z term is exactly the difference loss(z) - loss(0) */
    bk_rng r = {63};
    enum { N = 7, V = 33 };
    float xs[N * V], l0[N], l1[N], s0[N], s1[N];
    int32_t ts[N];
    bk_rng_fill(&r, xs, N * V, -6, 6);
    for (int i = 0; i < N; i++) ts[i] = bk_rng_int(&r, V);
    bk_xent_fwd(l0, s0, xs, ts, N, V, 0.0f);
    bk_xent_fwd(l1, s1, xs, ts, N, V, 1e-3f);
    for (int i = 0; i < N; i++) {
        assert_true(s0[i] == s1[i]);
        assert_true(fabs((l1[i] - l0[i]) - 1e-3 * (double)s0[i] * s0[i]) < 1e-6 * (1 + fabs(l0[i])));
    }
    /* gradient rows sum to 2 z lse dloss (softmax sums to 1, one-hot to 1) */
    float dx[N * V] = {0}, ones[N];
    for (int i = 0; i < N; i++) ones[i] = 1.0f;
    bk_xent_bwd(dx, ones, xs, s1, ts, N, V, 1e-3f);
    for (int i = 0; i < N; i++) {
        double sum = 0.0;
        for (int j = 0; j < V; j++) sum += dx[i * V + j];
        assert_true(fabs(sum - 2e-3 * s1[i]) < 1e-6);
    }
}

/* Vocab split into shards (one of width 1, one empty): simulate the all-reduces in shard order
 * and compare with the full kernel. */
static void test_xent_split_vocab(void **state)
{
    (void)state;
    bk_rng r = {64};
    enum { N = 9, V = 37, S = 5 };
    const int lo[S + 1] = {0, 10, 11, 11, 30, 37}; // shard s = [lo[s], lo[s+1]); shard 2 empty
    const float z = 1e-2f;
    float x[N * V], loss[N], lse[N], dl[N], dx[N * V] = {0};
    int32_t t[N];
    bk_rng_fill(&r, x, N * V, -5, 5);
    bk_rng_fill(&r, dl, N, -1, 1);
    for (int i = 0; i < N; i++) t[i] = bk_rng_int(&r, V);
    t[0] = 10, t[1] = 0, t[2] = 36, t[3] = 30; // shard edges
    bk_xent_fwd(loss, lse, x, t, N, V, z);
    bk_xent_bwd(dx, dl, x, lse, t, N, V, z);

    float local[S][N * V], m[N], mloc[N], s[N], sloc[N], tg[N], tloc[N], loss2[N], lse2[N];
    for (int k = 0; k < S; k++) { // shard k's columns, contiguous (N, V_local)
        int vl = lo[k + 1] - lo[k];
        for (int i = 0; i < N; i++) memcpy(&local[k][i * vl], &x[i * V + lo[k]], vl * sizeof(float));
    }
    for (int i = 0; i < N; i++) m[i] = -INFINITY, s[i] = 0.0f, tg[i] = 0.0f;
    for (int k = 0; k < S; k++) {
        bk_xent_row_max(mloc, local[k], N, lo[k + 1] - lo[k]);
        for (int i = 0; i < N; i++) m[i] = fmaxf(m[i], mloc[i]);
    }
    for (int k = 0; k < S; k++) {
        bk_xent_row_sumexp(sloc, local[k], m, N, lo[k + 1] - lo[k]);
        bk_xent_pick_target(tloc, local[k], t, N, lo[k + 1] - lo[k], lo[k]);
        for (int i = 0; i < N; i++) s[i] += sloc[i], tg[i] += tloc[i];
    }
    bk_xent_combine(loss2, lse2, m, s, tg, N, z);
    /* shard sums of exp are added in float across shards instead of double in one row: ~1 ulp */
    for (int i = 0; i < N; i++) {
        assert_true(tg[i] == x[i * V + t[i]]); // exactly one shard contributes the target
        assert_true(close_rel(lse2[i], lse[i], ROW_TOL));
        assert_true(close_rel(loss2[i], loss[i], ROW_TOL));
    }
    float dx2[N * V];
    for (int k = 0; k < S; k++) {
        int vl = lo[k + 1] - lo[k];
        float dloc[N * V];
        memset(dloc, 0, sizeof dloc);
        bk_xent_bwd_local(dloc, dl, local[k], lse2, t, N, vl, lo[k], z);
        for (int i = 0; i < N; i++) memcpy(&dx2[i * V + lo[k]], &dloc[i * vl], vl * sizeof(float));
    }
    assert_true(bk_rel_err(dx2, dx, N * V) <= 1e-6);
    /* with the same lse the local backward is the full one, bit for bit */
    memset(dx2, 0, sizeof dx2);
    for (int k = 0; k < S; k++) {
        int vl = lo[k + 1] - lo[k];
        float dloc[N * V];
        memset(dloc, 0, sizeof dloc);
        bk_xent_bwd_local(dloc, dl, local[k], lse, t, N, vl, lo[k], z);
        for (int i = 0; i < N; i++) memcpy(&dx2[i * V + lo[k]], &dloc[i * vl], vl * sizeof(float));
    }
    assert_true(memcmp(dx2, dx, sizeof dx) == 0);
    /* the writing form over garbage equals the adding form over zeros, element by element */
    for (int k = 0; k < S; k++) {
        int vl = lo[k + 1] - lo[k];
        float dz[N * V], dw[N * V];
        memset(dz, 0, sizeof dz);
        for (int i = 0; i < N * vl; i++) dw[i] = 1e30f;
        bk_xent_bwd_local(dz, dl, local[k], lse, t, N, vl, lo[k], z);
        bk_xent_bwd_local_into(dw, dl, local[k], lse, t, N, vl, lo[k], z);
        for (int i = 0; i < N * vl; i++) assert_true(dw[i] == dz[i]);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_xent_vs_ref),
        cmocka_unit_test(test_xent_fd),
        cmocka_unit_test(test_xent_zloss_term),
        cmocka_unit_test(test_xent_split_vocab),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
