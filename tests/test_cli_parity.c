/* test_cli_parity.c — cli/parity.c, `shardsim parity`: one model trained under several
 * configurations on the small Llama of tests/data/small-llama.yml:
 *   - exit 0 and PASS when every configuration agrees with the first; a tolerance no float32 run
 *     can meet exits 1 naming the first diverging step and parameter;
 *   - under hbm_limit_gb a configuration that does not fit is reported as it runs, the others
 *     still run and are compared, exit 1; a reference that does not fit stops parity;
 *   - without configs= (nothing to compare) it exits 2 naming the key. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <string.h>

#include "cli/cli.h"
#include "tests/cli_capture.h"
#include "tests/helpers.h"

#define SMALL SMALL_LLAMA_YML

static void test_parity_exit_codes(void **state)
{
    (void)state;
    const char *ok[] = {SMALL, "per_device_batch_size=4", "steps=2",
                        "configs=ici_fsdp_parallelism=1;ici_fsdp_parallelism=2 ici_tensor_parallelism=2"};
    cli_capture r = cli_capture_run(cli_cmd_parity, (int)(sizeof ok / sizeof ok[0]), ok);
    if (r.rc) fail_msg("parity failed: %s%s", r.out, r.err);
    assert_non_null(strstr(r.out, "PASS"));
    cli_capture_free(&r);
    /* a tolerance no float32 run can meet: exit 1, naming where it diverged */
    const char *bad[] = {SMALL, "per_device_batch_size=4", "steps=2", "parity_rtol=1e-12",
                         "configs=ici_fsdp_parallelism=1;ici_fsdp_parallelism=2 ici_tensor_parallelism=2"};
    r = cli_capture_run(cli_cmd_parity, (int)(sizeof bad / sizeof bad[0]), bad);
    assert_int_equal(r.rc, 1);
    assert_non_null(strstr(r.out, "first diverging gradient: step 0"));
    assert_non_null(strstr(r.out, "params."));
    cli_capture_free(&r);
}

/* parity under hbm_limit_gb: a configuration that does not fit is reported as
 * out of memory as it runs, the others still run and are compared, and the
 * exit code is 1; a reference that does not fit stops parity (exit 1). */
static void test_parity_hbm_limit(void **state)
{
    (void)state;
    const char *a[] = {
        SMALL, "per_device_batch_size=2", "steps=2",
        "configs=ici_fsdp_parallelism=1;ici_fsdp_parallelism=2 hbm_limit_gb=0.0002;ici_fsdp_parallelism=2"};
    cli_capture r = cli_capture_run(cli_cmd_parity, (int)(sizeof a / sizeof a[0]), a);
    assert_int_equal(r.rc, 1);
    const char *oom = strstr(r.out, "out of simulated memory (hbm_limit_gb=0.0002)");
    assert_non_null(oom);
    const char *third = strstr(r.out, "[3/3]");
    assert_non_null(third);
    assert_true(oom < third);
    assert_non_null(strstr(third, "2 steps in"));
    assert_non_null(strstr(r.out, "INCOMPLETE: 1 configuration"));
    cli_capture_free(&r);
    const char *b[] = {SMALL, "per_device_batch_size=2", "steps=2", "hbm_limit_gb=0.0002",
                       "configs=ici_fsdp_parallelism=1;ici_fsdp_parallelism=2"};
    r = cli_capture_run(cli_cmd_parity, (int)(sizeof b / sizeof b[0]), b);
    assert_int_equal(r.rc, 1);
    assert_non_null(strstr(r.err, "reference configuration"));
    assert_non_null(strstr(r.err, "hbm_limit_gb=0.0002"));
    assert_null(strstr(r.out, "[2/2]"));
    cli_capture_free(&r);
}

static void test_parity_without_configs(void **state)
{
    (void)state;
    const char *none[] = {SMALL, "per_device_batch_size=4", "steps=1"};
    cli_capture r = cli_capture_run(cli_cmd_parity, (int)(sizeof none / sizeof none[0]), none);
    assert_int_equal(r.rc, 2);
    assert_contains(r.err, "configs");
    cli_capture_free(&r);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_parity_exit_codes),
        cmocka_unit_test(test_parity_hbm_limit),
        cmocka_unit_test(test_parity_without_configs),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
