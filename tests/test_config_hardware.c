/* test_config_hardware.c — hardware profiles (config/hardware.c): a profile's figures per JSON
 * device from the chip's published ones (checked against the file's raw values read on their
 * own), the torus of each slice size, the profile a config selects (hardware_profile, else
 * compile_topology's family), and that it is read once per config: after the first read the
 * file may go and the config still answers, while a fresh config cannot. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "config/config.h"
#include "config/hardware.h"
#include "tests/config_fixture.h"

static double raw(const cfg_config *file, const char *key)
{
    double d;
    if (cfg_get_double(file, key, &d) != SIM_OK) fail_msg("%s", sim_errmsg());
    return d;
}

static void test_profile_figures(void **state)
{
    (void)state;
    cfg_hw hw;
    assert_int_equal(cfg_hw_load("configs", "v5p", 8, &hw), SIM_OK);
    cfg_config *file;
    assert_int_equal(cfg_load_file("configs/hardware/v5p.yml", &file), SIM_OK);
    double dpc = raw(file, "devices_per_chip");
    assert_true(hw.devices_per_chip == (int)dpc);
    assert_true(hw.hbm_bytes == raw(file, "hbm_gib") * 1073741824.0 / dpc);
    assert_true(hw.hbm_bw == raw(file, "hbm_gbps") * 1e9 / dpc);
    /* a TPU link: the bidirectional per-chip figure over its ports, one direction */
    assert_true(hw.link_bw == raw(file, "ici_gbps_bidirectional") * 1e9 / raw(file, "ici_ports") / 2.0 / dpc);
    assert_true(hw.dcn_bw == raw(file, "dcn_gbits") * 1e9 / 8.0 / dpc);
    /* 8 devices of one chip each: the torus of 8 chips, [2, 2, 2] in the file */
    assert_int_equal(hw.torus_n, 3);
    assert_int_equal(hw.torus[0] * hw.torus[1] * hw.torus[2], 8);
    cfg_free(file);
    /* a slice size the file has no torus for: none */
    assert_int_equal(cfg_hw_load("configs", "v5p", 6, &hw), SIM_OK);
    assert_int_equal(hw.torus_n, 0);
    /* names that are not profiles */
    assert_int_equal(cfg_hw_load("configs", "v9z", 4, &hw), SIM_ERR_INPUT);
    assert_contains(sim_errmsg(), "not one of configs/hardware");
    assert_contains(sim_errmsg(), "v5p");
    char names[512];
    assert_contains(cfg_hw_names("configs", names, sizeof names), "v5p");
    double fig;
    cfg_value neg = {CFG_SCALAR, "-1", 0, 0, NULL, NULL, "t", 1};
    assert_int_equal(cfg_hw_figure(&neg, "f.yml", "hbm_gib", &fig), SIM_ERR_INPUT);
    assert_contains(sim_errmsg(), "f.yml: 'hbm_gib' = -1");
}

static void test_selected_by_config(void **state)
{
    (void)state;
    cfg_hw hw;
    bool found = true;
    cfg_config *cfg = cfgt_load_ok(NULL, 0, NULL);
    assert_int_equal(cfg_hw_from_config(cfg, 0, &hw, &found), SIM_OK);
    assert_false(found);
    cfg_free(cfg);
    const char *o[] = {"compile_topology=v5p-16", "compile_topology_num_slices=1"};
    cfg = cfgt_load_ok(NULL, 2, o);
    assert_int_equal(cfg_hw_from_config(cfg, 8, &hw, &found), SIM_OK);
    assert_true(found);
    assert_string_equal(hw.name, "v5p");
    assert_int_equal(hw.torus_n, 3);
    cfg_free(cfg);
    const char *bad[] = {"hardware_profile=v9z"};
    cfg = cfgt_load_ok(NULL, 1, bad);
    assert_int_equal(cfg_hw_from_config(cfg, 0, &hw, &found), SIM_ERR_INPUT);
    assert_contains(sim_errmsg(), "(hardware_profile=v9z)");
    assert_false(found);
    cfg_free(cfg);
}

static void test_read_once_per_config(void **state)
{
    (void)state;
    char *dir = cfgt_copy_configs();
    char base[512], profile[512];
    snprintf(base, sizeof base, "%s/base.yml", dir);
    snprintf(profile, sizeof profile, "%s/hardware/v5p.yml", dir);
    const char *o[] = {"hardware_profile=v5p"};
    cfg_config *cfg = cfgt_load_ok(base, 1, o);
    cfg_hw first, again;
    bool found;
    assert_int_equal(cfg_hw_from_config(cfg, 4, &first, &found), SIM_OK);
    assert_int_equal(unlink(profile), 0);
    /* the same config answers from what it read, the torus for another slice size included */
    assert_int_equal(cfg_hw_from_config(cfg, 8, &again, &found), SIM_OK);
    assert_true(found);
    assert_true(again.peak_bf16 == first.peak_bf16 && again.hbm_bytes == first.hbm_bytes);
    assert_int_equal(again.torus[0] * again.torus[1] * again.torus[2], 8);
    /* a fresh config has to read the file, which is gone */
    cfg_config *fresh = cfgt_load_ok(base, 1, o);
    assert_int_equal(cfg_hw_from_config(fresh, 4, &again, &found), SIM_ERR_INPUT);
    cfg_free(fresh);
    cfg_free(cfg);
    cfgt_rmdir(dir);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_profile_figures),
        cmocka_unit_test(test_selected_by_config),
        cmocka_unit_test(test_read_once_per_config),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
