/* test_config_axis_rules.c — logical_axis_rules in a config (config/axis_rules.c): MaxText's
 * merge by logical name (every earlier rule the new list names is dropped, the new ones appended),
 * override_logical_axis_rules replacing the list, the shape checks of a rule list and of
 * mesh_axes, custom_mesh_and_rule replacing mesh_axes and the rules and inferring
 * context_sharding, and data_sharding's grouping.  Expected lists written out by hand. */
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

static const char BASE[] = "mesh_axes: [data, fsdp, context]\n"
                           "logical_axis_rules: [[batch, [data, fsdp]], [embed, fsdp], [mlp, []]]\n"
                           "override_logical_axis_rules: false\n"
                           "data_sharding: [data, fsdp]\n"
                           "custom_mesh_and_rule: ''\n"
                           "context_sharding: context\n";

static char *rules_text(const cfg_config *cfg)
{
    return cfg_value_to_text(&cfg_find(cfg, "logical_axis_rules")->value, 0);
}

static void test_merge_by_name(void **state)
{
    (void)state;
    char *dir = cfgt_mkdir();
    char *base = cfgt_write(dir, "base.yml", BASE);
    /* embed is replaced (and moves to the end), a new name is appended, the others stay */
    const char *o[] = {"logical_axis_rules=[[embed, [context]], [heads, fsdp]]"};
    cfg_config *cfg = cfgt_load_ok(base, 1, o);
    char *t = rules_text(cfg);
    assert_string_equal(t, "[[batch, [data, fsdp]], [mlp, []], [embed, [context]], [heads, fsdp]]");
    free(t);
    assert_contains(cfg_find(cfg, "logical_axis_rules")->where, "merged with command line");
    cfg_free(cfg);
    /* override_logical_axis_rules=true: the user's list is the list */
    const char *o2[] = {"logical_axis_rules=[[embed, [context]]]", "override_logical_axis_rules=true"};
    cfg = cfgt_load_ok(base, 2, o2);
    t = rules_text(cfg);
    assert_string_equal(t, "[[embed, [context]]]");
    free(t);
    /* data_sharding, a flat list, is one group */
    const cfg_value *ds = &cfg_find(cfg, "data_sharding")->value;
    assert_int_equal(ds->n, 1);
    assert_int_equal(ds->items[0].n, 2);
    cfg_free(cfg);
    free(base);
    cfgt_rmdir(dir);
}

static void test_shape_checks(void **state)
{
    (void)state;
    char *dir = cfgt_mkdir();
    char *base = cfgt_write(dir, "base.yml", BASE);
    cfg_config *cfg;
    const char *pair[] = {"logical_axis_rules=[[embed]]"};
    assert_int_equal(cfgt_load(base, NULL, 1, pair, &cfg), SIM_ERR_INPUT);
    assert_contains(sim_errmsg(), "logical_axis_rules item 0 is [embed]; expected a pair");
    const char *twice[] = {"logical_axis_rules=[[embed, [fsdp, fsdp]]]"};
    assert_int_equal(cfgt_load(base, NULL, 1, twice, &cfg), SIM_ERR_INPUT);
    assert_contains(sim_errmsg(), "rule 'embed' lists mesh axis 'fsdp' twice");
    const char *axes[] = {"mesh_axes=[data, data]"};
    assert_int_equal(cfgt_load(base, NULL, 1, axes, &cfg), SIM_ERR_INPUT);
    assert_contains(sim_errmsg(), "lists 'data' twice");
    free(base);
    cfgt_rmdir(dir);
}

static void test_custom_mesh_and_rule(void **state)
{
    (void)state;
    char *dir = cfgt_mkdir();
    char *base = cfgt_write(dir, "base.yml", BASE);
    free(cfgt_write(dir, "custom_mesh_and_rule/ep.yml",
                    "mesh_axes: [fsdp, expert]\n"
                    "logical_axis_rules: [[activation_length, [sequence, expert]], [embed, fsdp]]\n"));
    /* the custom file's keys must be known: expert is a value, context_sharding a known key */
    const char *o[] = {"custom_mesh_and_rule=ep"};
    cfg_config *cfg = cfgt_load_ok(base, 1, o);
    char *t = cfg_value_to_text(&cfg_find(cfg, "mesh_axes")->value, 0);
    assert_string_equal(t, "[fsdp, expert]");
    free(t);
    t = rules_text(cfg);
    assert_string_equal(t, "[[activation_length, [sequence, expert]], [embed, fsdp]]");
    free(t);
    /* the first of context/expert in activation_length's axes */
    assert_string_equal(cfg_find(cfg, "context_sharding")->value.text, "expert");
    assert_contains(cfg_find(cfg, "context_sharding")->where, "inferred from custom_mesh_and_rule=ep");
    assert_contains(cfg->custom_file, "custom_mesh_and_rule/ep.yml");
    cfg_free(cfg);
    /* unless the user chose it */
    const char *o2[] = {"custom_mesh_and_rule=ep", "context_sharding=context"};
    cfg = cfgt_load_ok(base, 2, o2);
    assert_string_equal(cfg_find(cfg, "context_sharding")->value.text, "context");
    cfg_free(cfg);
    /* a name without a file lists the ones there */
    const char *o3[] = {"custom_mesh_and_rule=epp"};
    assert_int_equal(cfgt_load(base, NULL, 1, o3, &cfg), SIM_ERR_INPUT);
    assert_contains(sim_errmsg(), "no file");
    assert_contains(sim_errmsg(), "available: ep");
    free(base);
    cfgt_rmdir(dir);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_merge_by_name),
        cmocka_unit_test(test_shape_checks),
        cmocka_unit_test(test_custom_mesh_and_rule),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
