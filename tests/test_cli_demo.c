/* test_cli_demo.c — cli/demo.c's `shardsim collectives`, run as the program of this build: every
 * collective on an 8-device mesh (data=2 fsdp=2 tensor=2) with real data, each result checked by
 * the job against its definition, and the bytes each device sent printed next to the formula.
 * Here the table is read back: every row's bytes equal its formula column, and the rows whose
 * formula needs only the buffer size are recomputed by hand (n = 1 MiB of float32 per device, s the
 * quarter of it each device contributes to the gather): all-gather over fsdp (k = 2) sends
 * (k-1) s = 256 KiB, reduce-scatter over (data, fsdp) (k = 4) (k-1) n / k = 768 KiB, all-reduce over
 * data (k = 2) 2 (k-1) n / k = 1 MiB, all-to-all over tensor (k = 2) (k-1) n / k = 512 KiB; no wrong
 * value.  (`shardsim demo`, the README's job, trains for tens of seconds on a busy machine:
 * bench/same-behaviour.sh runs it.) */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <string.h>

#include "tests/helpers.h"

static char out[1 << 16];

static void test_collectives_job(void **state)
{
    (void)state;
    const char *p = helper_program();
    if (!p) fail_msg("no program beside this test's build: build it first");
    char cmd[1200];
    snprintf(cmd, sizeof cmd, "%s collectives 2>&1", p);
    assert_int_equal(helper_run_shell(cmd, out, sizeof out), 0);
    assert_contains(out, "mesh data=2 fsdp=2 tensor=2");
    assert_contains(out, "; 0 wrong values or byte counts");
    static const struct {
        const char *op;
        long long bytes; /* by hand, -1: the formula column only */
    } want[] = {{"all-gather", 262144}, {"reduce-scatter", 786432}, {"all-reduce", 1048576},
                {"all-to-all", 524288}, {"ppermute", -1},           {"ragged-all-to-all", -1}};
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) {
        char key[64];
        snprintf(key, sizeof key, "\n%s ", want[i].op);
        const char *row = strstr(out, key);
        if (!row) fail_msg("no row for %s:\n%s", want[i].op, out);
        char axes[64];
        int k;
        long long sent, formula;
        if (sscanf(row + strlen(key), " %63[^)]) %d %lld %lld", axes, &k, &sent, &formula) != 4)
            fail_msg("cannot read the %s row:\n%s", want[i].op, row);
        if (sent != formula) fail_msg("%s: sent %lld B, formula %lld B", want[i].op, sent, formula);
        if (want[i].bytes >= 0 && sent != want[i].bytes)
            fail_msg("%s: sent %lld B, by hand %lld B", want[i].op, sent, want[i].bytes);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_collectives_job),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
