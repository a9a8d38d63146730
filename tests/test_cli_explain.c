/* test_cli_explain.c — `shardsim explain` end to end: output shape (steps,
 * the closing total line, the grids), logical specs through the config's
 * rules, and bad input exiting 2 with a message that names it. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/cli.h"
#include "tests/cli_capture.h"

typedef cli_capture result;

static result run(int argc, const char **argv) { return cli_capture_run(cli_explain, argc, argv); }
static void done(result *r) { cli_capture_free(r); }

/* The last non-empty line of s. */
static const char *last_line(const char *s, char *buf, size_t cap)
{
    const char *end = s + strlen(s);
    while (end > s && end[-1] == '\n') end--;
    const char *start = end;
    while (start > s && start[-1] != '\n') start--;
    snprintf(buf, cap, "%.*s", (int)(end - start), start);
    return buf;
}

static void test_issue_example(void **state)
{
    (void)state;
    const char *argv[] = {"mesh=data=2,fsdp=2,tensor=2", "shape=8,16", "dtype=float32",
                          "from=P(('data','fsdp'),None)", "to=P(None,'tensor')"};
    result r = run(5, argv);
    assert_int_equal(r.rc, 0);
    char buf[256];
    /* slice tensor on dim 1 (local 2x8), then all-gather dim 0 over (data, fsdp): 3 * 64 B */
    assert_string_equal(last_line(r.out, buf, sizeof buf), "total bytes sent per device: 192");
    assert_non_null(strstr(r.out, "step 1: slice"));
    assert_non_null(strstr(r.out, "step 2: all-gather     dim 0            over (data, fsdp)"));
    assert_non_null(strstr(r.out, "values preserved, counted bytes equal the plan"));
    /* grids: four row blocks of two devices each; two column blocks of four */
    assert_non_null(strstr(r.out, "| 6,7 |"));
    assert_non_null(strstr(r.out, "| 0,2,4,6 | 1,3,5,7 |"));
    done(&r);
}

static void test_logical_specs(void **state)
{
    (void)state;
    /* data=2 fsdp=4 mesh: activation_batch -> (data, fsdp); embed -> fsdp under the base rules */
    const char *argv[] = {"mesh=data=2,fsdp=4", "shape=16,32", "from_logical=activation_batch,activation_embed",
                          "to_logical=embed,mlp"};
    result r = run(4, argv);
    if (r.rc) fail_msg("%s", r.err);
    assert_non_null(strstr(r.out, "from: P(('data', 'fsdp'), None)"));
    assert_non_null(strstr(r.out, "to:   P('fsdp', None)"));
    done(&r);
}

static void test_bad_input(void **state)
{
    (void)state;
    const char *a1[] = {"mesh=data=2", "shape=8,16", "from=P('fsdp')", "to=P()"};
    result r = run(4, a1);
    assert_int_equal(r.rc, 2);
    assert_non_null(strstr(r.err, "'fsdp' is not a mesh axis"));
    assert_string_equal(r.out, "");
    done(&r);
    const char *a2[] = {"mesh=x=4", "shape=6,16", "from=P('x', None)", "to=P()"};
    r = run(4, a2);
    assert_int_equal(r.rc, 2);
    assert_non_null(strstr(r.err, "dim 0 has size 6"));
    done(&r);
    const char *a3[] = {"mesh=x=4", "shape=8", "from=P('x')"};
    r = run(3, a3);
    assert_int_equal(r.rc, 2);
    assert_non_null(strstr(r.err, "to="));
    done(&r);
    const char *a4[] = {"shape=8,16", "from_logical=embed,mlp", "to_logical=mlp,embed", "ici_tensr_parallelism=2"};
    r = run(4, a4);
    assert_int_equal(r.rc, 2);
    assert_non_null(strstr(r.err, "ici_tensor_parallelism"));
    done(&r);
    const char *a5[] = {"mesh=x=4", "shape=8,a", "from=P()", "to=P()"};
    r = run(4, a5);
    assert_int_equal(r.rc, 2);
    assert_non_null(strstr(r.err, "shape='8,a'"));
    done(&r);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_issue_example),
        cmocka_unit_test(test_logical_specs),
        cmocka_unit_test(test_bad_input),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
