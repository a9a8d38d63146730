/* test_bk_dropout.c — the counter-based dropout mask: the kept share is 1 - rate (binomial
 * bounds), kept elements are scaled by 1/keep and the rest are 0, one draw is shared along the
 * broadcast dim, any block of a tensor computed from its global offsets equals that block of the
 * whole tensor (what makes the mask mesh-independent), and the backward applies the same mask. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>
#include <math.h>

#include "blas_kernels/bk_dropout.h"

static void test_keep_share(void **state)
{
    (void)state;
    const double rates[] = {0.1, 0.5, 0.9};
    for (int r = 0; r < 3; r++) {
        const int n = 200000;
        int kept = 0;
        for (int j = 0; j < n; j++) kept += bk_dropout_keep(12345, (uint64_t)j, rates[r]);
        double p = 1.0 - rates[r], sd = sqrt(n * p * (1 - p));
        assert_true(fabs(kept - n * p) < 6 * sd); /* 6 sigma: a false failure is ~1e-9 */
    }
    assert_true(bk_dropout_keep(1, 7, 0.0));
    assert_false(bk_dropout_keep(1, 7, 1.0));
    /* different keys give different masks */
    int same = 0;
    for (int j = 0; j < 1000; j++) same += bk_dropout_keep(1, (uint64_t)j, 0.5) == bk_dropout_keep(2, (uint64_t)j, 0.5);
    assert_true(same > 400 && same < 600);
}

enum { B = 4, T = 6, F = 10 };

static void test_blocks_and_broadcast(void **state)
{
    (void)state;
    float x[B * T * F], y[B * T * F];
    for (int i = 0; i < B * T * F; i++) x[i] = (float)(i % 13) - 6.0f + 0.5f;
    const int64_t g[3] = {B, T, F}, zero[3] = {0, 0, 0};
    const double rate = 0.25;
    bk_dropout_fwd(y, x, 3, g, zero, g, 1, 99, rate);
    for (int b = 0; b < B; b++)
        for (int f = 0; f < F; f++) {
            bool keep = bk_dropout_keep(99, (uint64_t)(b * F + f), rate);
            for (int t = 0; t < T; t++) {
                int i = (b * T + t) * F + f;
                assert_true(y[i] == (keep ? x[i] / 0.75f : 0.0f));
            }
        }
    /* a (2, 6, 5) block at offset (2, 0, 5): the same elements as the whole tensor's */
    const int64_t loc[3] = {2, T, 5}, off[3] = {2, 0, 5};
    float xb[2 * T * 5], yb[2 * T * 5];
    for (int b = 0; b < 2; b++)
        for (int t = 0; t < T; t++)
            for (int f = 0; f < 5; f++) xb[(b * T + t) * 5 + f] = x[((b + 2) * T + t) * F + f + 5];
    bk_dropout_fwd(yb, xb, 3, loc, off, g, 1, 99, rate);
    for (int b = 0; b < 2; b++)
        for (int t = 0; t < T; t++)
            for (int f = 0; f < 5; f++) assert_true(yb[(b * T + t) * 5 + f] == y[((b + 2) * T + t) * F + f + 5]);
    /* backward: din += mask * dout / keep */
    float din[B * T * F];
    for (int i = 0; i < B * T * F; i++) din[i] = 1.0f;
    bk_dropout_bwd(din, x, 3, g, zero, g, 1, 99, rate);
    for (int i = 0; i < B * T * F; i++) assert_true(din[i] == 1.0f + y[i]);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_keep_share),
        cmocka_unit_test(test_blocks_and_broadcast),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
