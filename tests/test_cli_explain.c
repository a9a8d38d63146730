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

/* s without its spaces (a grid's cells are padded to scale: compare labels). */
static char *squash(const char *s)
{
    char *t = malloc(strlen(s) + 1), *o = t;
    for (; *s; s++)
        if (*s != ' ') *o++ = *s;
    *o = '\0';
    return t;
}

/* Lines and widest line of the grid that follows `marker` in s (up to the
 * next empty line). */
static void grid_size(const char *s, const char *marker, int *lines, int *width)
{
    const char *p = strstr(s, marker);
    assert_non_null(p);
    p = strchr(p, '\n') + 1;
    *lines = *width = 0;
    while (*p == '+' || *p == '|' || !strncmp(p, "rows:", 5) || !strncmp(p, "columns:", 8)) {
        const char *e = strchr(p, '\n');
        if (*p == '+' || *p == '|') {
            (*lines)++;
            if ((int)(e - p) > *width) *width = (int)(e - p);
        }
        p = e + 1;
    }
}

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
    char *sq = squash(r.out);
    assert_non_null(strstr(sq, "|6,7|"));
    assert_non_null(strstr(sq, "|0,2,4,6|1,3,5,7|"));
    free(sq);
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

/* Rank 3: with two sharded dims a grid over them (device r*2+c in row r,
 * column c of P(('data','fsdp'), None, 'tensor') on data=2 fsdp=2 tensor=2);
 * with three, one line per block with its index ranges. */
static void test_rank3(void **state)
{
    (void)state;
    const char *argv[] = {"mesh=data=2,fsdp=2,tensor=2", "shape=8,64,16", "from=P('data','fsdp','tensor')",
                          "to=P(('data','fsdp'),None,'tensor')"};
    result r = run(4, argv);
    if (r.rc) fail_msg("%s", r.err);
    assert_non_null(strstr(r.out, "rows: dim 0, columns: dim 2"));
    char *sq = squash(r.out);
    for (int row = 0; row < 4; row++) {
        char cells[32];
        snprintf(cells, sizeof cells, "|%d|%d|", 2 * row, 2 * row + 1);
        assert_non_null(strstr(sq, cells));
    }
    free(sq);
    /* from: device d = 4*data + 2*fsdp + tensor holds data block d/4 (rows 4 each), fsdp block (d/2)%2 (32
     * each) and tensor block d%2 (8 each) */
    for (int d = 0; d < 8; d++) {
        char line[96];
        snprintf(line, sizeof line, "  [%d:%d, %d:%d, %d:%d]  devices %d\n", 4 * (d / 4), 4 * (d / 4) + 4,
                 32 * ((d / 2) % 2), 32 * ((d / 2) % 2) + 32, 8 * (d % 2), 8 * (d % 2) + 8, d);
        if (!strstr(r.out, line)) fail_msg("missing block line '%s' in:\n%s", line, r.out);
    }
    done(&r);
}

/* Grids are to scale: a wide array gives a wide, flat grid; a tall one a
 * narrow, tall grid. */
static void test_grid_to_scale(void **state)
{
    (void)state;
    const char *wide[] = {"mesh=fsdp=4", "shape=8,1024", "from=P(None,'fsdp')", "to=P()", "verify=false"};
    const char *tall[] = {"mesh=fsdp=4", "shape=1024,8", "from=P('fsdp',None)", "to=P()", "verify=false"};
    result rw = run(5, wide), rt = run(5, tall);
    assert_int_equal(rw.rc, 0);
    assert_int_equal(rt.rc, 0);
    int wl, ww, tl, tw;
    grid_size(rw.out, "from:", &wl, &ww);
    grid_size(rt.out, "from:", &tl, &tw);
    assert_true(ww > 2 * tw); /* wider */
    assert_true(tl > 2 * wl); /* taller */
    assert_true(ww <= 81);    /* within 80 columns (+ the closing bar) */
    done(&rw);
    done(&rt);
}

/* Without mesh= the output says where the mesh came from; a logical name no
 * rule mentions is an error naming it, with the close name suggested. */
static void test_mesh_source_and_unknown_logical_name(void **state)
{
    (void)state;
    const char *ok[] = {"shape=16,32", "from_logical=activation_batch,activation_embed", "to_logical=embed,mlp",
                        "ici_fsdp_parallelism=8"};
    result r = run(4, ok);
    if (r.rc) fail_msg("%s", r.err);
    assert_non_null(strstr(r.out, "from the config's ici_*/dcn_* flags"));
    done(&r);
    const char *bad[] = {"shape=16,32", "from_logical=activation_bach,activation_embed", "to_logical=embed,mlp",
                         "ici_fsdp_parallelism=8"};
    r = run(4, bad);
    assert_int_equal(r.rc, 2);
    assert_non_null(strstr(r.err, "'activation_bach' is not a logical axis name"));
    assert_non_null(strstr(r.err, "did you mean 'activation_batch'?"));
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
        cmocka_unit_test(test_rank3),
        cmocka_unit_test(test_grid_to_scale),
        cmocka_unit_test(test_mesh_source_and_unknown_logical_name),
        cmocka_unit_test(test_bad_input),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
