/* test_config_topology.c — compile_topology=NAME (config/topology.c): num_devices is the
 * topology's devices per slice (MaxText's v5p-8 is 8 TensorCores, 4 chips, 4 JAX devices) times
 * compile_topology_num_slices, num_slices that count, dry_run true; a count the user gave must
 * agree; an unknown name is refused with the closest known one. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "config/config.h"
#include "tests/config_fixture.h"

static long long get_int(const cfg_config *cfg, const char *key)
{
    long long v;
    if (cfg_get_int(cfg, key, &v) != SIM_OK) fail_msg("%s", sim_errmsg());
    return v;
}

static void test_topology_sets_devices(void **state)
{
    (void)state;
    const char *o[] = {"compile_topology=v5p-8", "compile_topology_num_slices=2"};
    cfg_config *cfg = cfgt_load_ok(NULL, 2, o);
    assert_int_equal(get_int(cfg, "num_devices"), 8);
    assert_int_equal(get_int(cfg, "num_slices"), 2);
    int dry;
    assert_int_equal(cfg_get_bool(cfg, "dry_run", &dry), SIM_OK);
    assert_int_equal(dry, 1);
    assert_contains(cfg_find(cfg, "num_devices")->where, "compile_topology=v5p-8 x compile_topology_num_slices=2");
    cfg_free(cfg);
    /* a count that agrees is accepted */
    const char *agree[] = {"compile_topology=v5p-16", "compile_topology_num_slices=1", "num_devices=8"};
    cfg = cfgt_load_ok(NULL, 3, agree);
    assert_int_equal(get_int(cfg, "num_devices"), 8);
    cfg_free(cfg);
}

static void test_topology_refusals(void **state)
{
    (void)state;
    cfg_config *cfg;
    const char *disagree[] = {"compile_topology=v5p-8", "compile_topology_num_slices=1", "num_devices=16"};
    assert_int_equal(cfgt_load(NULL, NULL, 3, disagree, &cfg), SIM_ERR_INPUT);
    assert_contains(sim_errmsg(), "num_devices=16 (command line) disagrees with compile_topology=v5p-8");
    const char *unknown[] = {"compile_topology=v5p-9", "compile_topology_num_slices=1"};
    assert_int_equal(cfgt_load(NULL, NULL, 2, unknown, &cfg), SIM_ERR_INPUT);
    assert_contains(sim_errmsg(), "not a topology");
    assert_contains(sim_errmsg(), "did you mean 'v5p-8'?");
    const char *slices[] = {"compile_topology=v5p-8", "compile_topology_num_slices=0"};
    assert_int_equal(cfgt_load(NULL, NULL, 2, slices, &cfg), SIM_ERR_INPUT);
    assert_contains(sim_errmsg(), "needs compile_topology_num_slices >= 1");
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_topology_sets_devices),
        cmocka_unit_test(test_topology_refusals),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
