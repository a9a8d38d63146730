/* test_xla_truth.c — shardsim's sizing against XLA:TPU's own compile of
 * MaxText 0.2.5's train step (tests/data/xla/tpu.json: the figures of
 * ahead-of-time compiles, made by peers/maxtext/xla_tpu/aot.py with the
 * command each entry gives; no libtpu on the test path).
 *
 * For every compiled configuration, a dry run of the same keys on the same
 * topology: the peak per device within 3% of memory_analysis(), and every
 * collective kind with at least 1% of the bytes within 5% (xla_truth.h).
 * A configuration whose entry names a known miss (a program transformation
 * of XLA's that shardsim does not model yet, with the reason) must still
 * miss: the list stays true in both directions, and bench/xla prints the
 * figures of every entry. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>

#include "bench/lib/xla_truth.h"

static void test_against_xla_tpu(void **state)
{
    (void)state;
    xt_set set;
    char err[512];
    if (!xt_load("tests/data/xla/tpu.json", &set, err, sizeof err)) fail_msg("%s", err);
    int compiled = 0, within = 0, bad = 0;
    for (int i = 0; i < set.n; i++) {
        const xt_config *c = &set.c[i];
        if (!c->compiled) continue;
        compiled++;
        xt_result r;
        xt_compare(c, &r);
        if (r.refused) {
            printf("%s: refused by shardsim: %s\n", c->name, r.why);
            bad++;
            continue;
        }
        within += r.all_ok;
        if (!c->miss[0] && !r.all_ok) {
            printf("%s: outside the targets: peak %.4f of XLA's", c->name, r.peak_ratio);
            for (int k = 0; k < XT_NKINDS; k++)
                if (r.kind_checked[k] && !r.kind_ok[k]) printf(", %s %.4f", sim_op_name((sim_op)k), r.kind_ratio[k]);
            printf("\n");
            bad++;
        }
        if (c->miss[0] && r.all_ok) {
            printf("%s: within the targets now: remove its known_miss (%s)\n", c->name, c->miss);
            bad++;
        }
    }
    printf("%d of %d compiled configurations within the targets\n", within, compiled);
    xt_free(&set);
    assert_true(compiled >= 24);
    assert_int_equal(bad, 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_against_xla_tpu),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
