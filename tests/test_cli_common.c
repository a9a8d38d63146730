/* test_cli_common.c — cli/common.h: what the commands share.
 *   - configs/ is found beside this build (the repository's configs/, holding base.yml), and the
 *     base config is its base.yml; the check passes;
 *   - words split into the command's own keys and the config loader's words (YAML files and other
 *     key=value), in order; a key that only starts like an own key is not one; too many words are
 *     refused;
 *   - shapes and meshes parse ("8,16"; "data=2,fsdp=4" as a single-slice mesh, ids row-major), and
 *     bad ones are refused naming the flag and an example;
 *   - cli_fail prints "shardsim: <message>" and returns the status's exit code (2 for input, 1
 *     otherwise). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cli/common.h"
#include "tests/helpers.h"

static void test_configs_dir(void **state)
{
    (void)state;
    assert_int_equal(cli_configs_check(), SIM_OK);
    char want[PATH_MAX], got[PATH_MAX];
    assert_non_null(realpath("configs", want)); /* the tests run from the repository root */
    assert_non_null(realpath(cli_configs_dir(), got));
    assert_string_equal(got, want);
    char base[PATH_MAX + 16];
    snprintf(base, sizeof base, "%s/base.yml", cli_configs_dir());
    assert_string_equal(cli_base_config(), base);
    assert_int_equal(access(cli_base_config(), R_OK), 0);
}

static void test_split_args(void **state)
{
    (void)state;
    const char *own[] = {"mesh", "shape"};
    char *argv[] = {"a.yml", "mesh=data=2", "steps=3", "meshes=x", "shape=8,16", "b.yaml", "mesh=fsdp=4"};
    cli_args a;
    assert_int_equal(cli_split_args(7, argv, own, 2, &a), SIM_OK);
    assert_int_equal(a.n_own, 3);
    assert_string_equal(a.own_key[0], "mesh");
    assert_string_equal(a.own_val[0], "data=2");
    assert_string_equal(a.own_val[1], "8,16");
    assert_int_equal(a.n_cfg, 4);
    assert_string_equal(a.cfg[0], "a.yml");
    assert_string_equal(a.cfg[1], "steps=3");
    assert_string_equal(a.cfg[2], "meshes=x"); /* only starts like "mesh" */
    assert_string_equal(a.cfg[3], "b.yaml");
    assert_string_equal(cli_arg(&a, "shape"), "8,16");
    assert_non_null(cli_arg(&a, "mesh"));
    assert_null(cli_arg(&a, "from"));
    /* more words than the loader takes */
    char *many[300];
    for (int i = 0; i < 300; i++) many[i] = "steps=1";
    assert_int_equal(cli_split_args(300, many, own, 2, &a), SIM_ERR_INPUT);
    assert_contains(sim_errmsg(), "too many arguments");
    sim_err_clear();
}

static void test_parse_shape(void **state)
{
    (void)state;
    int rank;
    int64_t shape[MESH_SPEC_MAX_RANK];
    assert_int_equal(cli_parse_shape("8,16", "shape", &rank, shape), SIM_OK);
    assert_int_equal(rank, 2);
    assert_int_equal(shape[0], 8);
    assert_int_equal(shape[1], 16);
    static const char *const bad[] = {"8,-2", "8,,16", "x", "", "0", "1000000,1000000,1000"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        if (cli_parse_shape(bad[i], "shape", &rank, shape) != SIM_ERR_INPUT) fail_msg("shape='%s' accepted", bad[i]);
        assert_contains(sim_errmsg(), "shape=");
        sim_err_clear();
    }
}

static void test_parse_mesh(void **state)
{
    (void)state;
    mesh_shape m;
    assert_int_equal(cli_parse_mesh("data=2,fsdp=4", &m), SIM_OK);
    assert_int_equal(m.n_axes, 2);
    assert_string_equal(m.names[0], "data");
    assert_int_equal(m.sizes[1], 4);
    assert_int_equal(m.num_devices, 8);
    assert_int_equal(m.num_slices, 1);
    int c[2] = {1, 3};
    assert_int_equal(mesh_shape_device(&m, c), 7);
    static const char *const bad[] = {"", "data", "data=0", "data=2,fsdp", "data=x"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        if (cli_parse_mesh(bad[i], &m) != SIM_ERR_INPUT) fail_msg("mesh='%s' accepted", bad[i]);
        assert_contains(sim_errmsg(), "mesh=");
        sim_err_clear();
    }
}

static void test_fail(void **state)
{
    (void)state;
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    assert_int_equal(cli_fail(f, sim_err(SIM_ERR_INPUT, "steps=-1: expected a count")), 2);
    assert_int_equal(cli_fail(f, sim_err(SIM_ERR_OOM, "device 0 is out of memory")), 1);
    fclose(f);
    assert_string_equal(buf, "shardsim: steps=-1: expected a count\nshardsim: device 0 is out of memory\n");
    free(buf);
    sim_err_clear();
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_configs_dir), cmocka_unit_test(test_split_args), cmocka_unit_test(test_parse_shape),
        cmocka_unit_test(test_parse_mesh),  cmocka_unit_test(test_fail),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
