/* test_bk_embedding.c — embedding gather / scatter-add, full and vocab-sharded. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "blas_kernels/bk_check.h"
#include "blas_kernels/bk_embedding.h"
#include "blas_kernels/bk_parallel.h"

enum { V = 23, C = 5, N = 41 };

static void make_ids(bk_rng *r, int32_t *ids)
{
    for (int n = 0; n < N; n++) ids[n] = bk_rng_int(r, V);
    ids[0] = ids[1] = ids[2] = 7; // repeated ids accumulate
    ids[3] = 0, ids[4] = V - 1;
}

static void test_embedding_fwd_sharded(void **state)
{
    (void)state;
    bk_rng r = {71};
    float table[V * C], out[N * C], outr[N * C], sum[N * C] = {0};
    int32_t ids[N];
    bk_rng_fill(&r, table, V * C, -1, 1);
    make_ids(&r, ids);
    bk_embedding_fwd(out, ids, table, N, C, 0, V);
    bk_embedding_fwd_ref(outr, ids, table, N, C, 0, V);
    assert_true(memcmp(out, outr, sizeof out) == 0); // a gather is exact
    for (int n = 0; n < N; n++) assert_true(memcmp(out + n * C, table + ids[n] * C, C * 4) == 0);
    /* shards [0,8) [8,9) [9,9) [9,23): each id hits exactly one, the rest give zeros */
    const int lo[5] = {0, 8, 9, 9, 23};
    for (int s = 0; s < 4; s++) {
        float part[N * C];
        bk_embedding_fwd(part, ids, table + lo[s] * C, N, C, lo[s], lo[s + 1] - lo[s]);
        bk_embedding_fwd_ref(outr, ids, table + lo[s] * C, N, C, lo[s], lo[s + 1] - lo[s]);
        assert_true(memcmp(part, outr, sizeof part) == 0);
        for (int i = 0; i < N * C; i++) sum[i] += part[i];
    }
    assert_true(memcmp(sum, out, sizeof out) == 0);
}

typedef struct {
    float *table, *out, *w;
    const int32_t *ids;
} ctx_t;

static double loss(void *p)
{
    ctx_t *c = p;
    bk_embedding_fwd_ref(c->out, c->ids, c->table, N, C, 0, V);
    return bk_dot_d(c->w, c->out, N * C);
}

static void test_embedding_bwd(void **state)
{
    (void)state;
    bk_rng r = {72};
    float table[V * C], dout[N * C], dt[V * C], dtr[V * C], dt2[V * C], out[N * C];
    int32_t ids[N];
    double g[V * C];
    bk_rng_fill(&r, table, V * C, -1, 1);
    bk_rng_fill(&r, dout, N * C, -1, 1);
    make_ids(&r, ids);
    for (int i = 0; i < V * C; i++) dt[i] = dtr[i] = dt2[i] = 0.5f; // accumulates
    bk_embedding_bwd(dt, dout, ids, N, C, 0, V);
    bk_embedding_bwd_ref(dtr, dout, ids, N, C, 0, V);
    /* token-order float sums vs double sums of <= ~6 terms: a few ulps */
    assert_true(bk_rel_err(dt, dtr, V * C) <= 1e-6);
    bk_embedding_bwd(dt2, dout, ids, N, C, 0, V);
    assert_true(memcmp(dt, dt2, sizeof dt) == 0); // deterministic
    /* the lookup is linear: central differences are exact up to output rounding */
    for (int i = 0; i < V * C; i++) dt[i] -= 0.5f;
    ctx_t c = {table, out, dout, ids};
    bk_fd_grad(loss, &c, table, V * C, 1e-2, g);
    assert_true(bk_rel_err_fd(dt, g, V * C) <= 1e-5);
    /* sharded backward writes exactly the shard's slice of the full one */
    const int lo = 8, vl = 9;
    float ds[9 * C];
    memset(ds, 0, sizeof ds);
    memset(dt2, 0, sizeof dt2);
    bk_embedding_bwd(dt2, dout, ids, N, C, 0, V);
    bk_embedding_bwd(ds, dout, ids, N, C, lo, vl);
    assert_true(memcmp(ds, dt2 + lo * C, sizeof ds) == 0);
}

/* Tables and batches big enough to be cut into several pool chunks (64K floats each), on 2 pool
 * threads: the lookup is an exact copy, and the scatter-add into a table it zero-fills itself
 * (bk_embedding_bwd_zero, on garbage) equals the plain token-order float loop bit for bit. */
static void test_embedding_pool_chunks(void **state)
{
    (void)state;
    enum { BV = 3000, BC = 64, BN = 5000 };
    bk_parallel_set_threads(2);
    bk_rng r = {73};
    float *table = malloc(sizeof(float) * BV * BC), *out = malloc(sizeof(float) * BN * BC);
    float *dout = malloc(sizeof(float) * BN * BC), *dt = malloc(sizeof(float) * BV * BC);
    float *want = calloc((size_t)BV * BC, sizeof(float));
    int32_t *ids = malloc(sizeof(int32_t) * BN);
    assert_non_null(table), assert_non_null(out), assert_non_null(dout), assert_non_null(dt);
    assert_non_null(want), assert_non_null(ids);
    bk_rng_fill(&r, table, BV * BC, -1, 1);
    bk_rng_fill(&r, dout, BN * BC, -1, 1);
    for (int n = 0; n < BN; n++) ids[n] = n % 3 ? bk_rng_int(&r, BV) : bk_rng_int(&r, 40); // many repeats
    ids[1] = BV + 5; // outside the table: a zero row, nothing scattered
    bk_embedding_fwd(out, ids, table, BN, BC, 0, BV);
    for (int n = 0; n < BN; n++) {
        const float *want_row = ids[n] < BV ? table + (size_t)ids[n] * BC : NULL;
        for (int c = 0; c < BC; c++) assert_true(out[(size_t)n * BC + c] == (want_row ? want_row[c] : 0.0f));
    }
    for (int n = 0; n < BN; n++)
        if (ids[n] < BV)
            for (int c = 0; c < BC; c++) want[(size_t)ids[n] * BC + c] += dout[(size_t)n * BC + c];
    for (int i = 0; i < BV * BC; i++) dt[i] = 1e30f; // garbage the kernel must clear
    bk_embedding_bwd_zero(dt, dout, ids, BN, BC, 0, BV);
    assert_true(memcmp(dt, want, sizeof(float) * BV * BC) == 0);
    bk_parallel_set_threads(1);
    free(table), free(out), free(dout), free(dt), free(want), free(ids);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_embedding_fwd_sharded),
        cmocka_unit_test(test_embedding_bwd),
        cmocka_unit_test(test_embedding_pool_chunks),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
