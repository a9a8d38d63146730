/* test_config_lookup.c — the config object (config/lookup.c): lookup by key (hashed, and the
 * closest key for a misspelt one) and the typed getters, whose errors name the key, its value,
 * where it was set and what was expected. */
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

static cfg_config *load_ok(const char *base, const char *dir, int n, const char *const *ovr)
{
    (void)dir;
    return cfgt_load_ok(base, n, ovr);
}

static void test_getters(void **state)
{
    (void)state;
    const char *o[] = {"run_name=None", "learning_rate=1e-3"};
    cfg_config *cfg = load_ok(NULL, NULL, 2, o);
    long long i;
    double d;
    int b;
    const char *s;
    assert_int_equal(cfg_get_str(cfg, "run_name", &s), SIM_OK);
    assert_null(s);
    assert_int_equal(cfg_get_double(cfg, "rope_max_timescale", &d), SIM_OK);
    assert_true(d == 10000.0);
    assert_int_equal(cfg_get_double(cfg, "learning_rate", &d), SIM_OK);
    assert_true(d == 1e-3);
    assert_int_equal(cfg_get_bool(cfg, "scan_layers", &b), SIM_OK);
    assert_int_equal(b, 1);
    assert_int_equal(cfg_get_int(cfg, "dtype", &i), SIM_ERR_INPUT);
    assert_contains(sim_errmsg(), "key 'dtype'");
    assert_contains(sim_errmsg(), "expected an integer");
    assert_contains(sim_errmsg(), "configs/base.yml:");
    assert_int_equal(cfg_get_bool(cfg, "steps", &b), SIM_ERR_INPUT);
    assert_int_equal(cfg_get_int(cfg, "no_such_key", &i), SIM_ERR_INPUT);
    assert_contains(sim_errmsg(), "no_such_key");
    static const char *const modes[] = {"auto", "explicit"};
    int idx = -1;
    assert_int_equal(cfg_get_enum(cfg, "shard_mode", modes, 2, &idx), SIM_OK);
    assert_int_equal(idx, 0);
    assert_int_equal(cfg_get_enum(cfg, "dtype", modes, 2, &idx), SIM_ERR_INPUT);
    assert_contains(sim_errmsg(), "'explicit'");
    assert_string_equal(cfg_closest_key(cfg, "ici_expert_paralelism"), "ici_expert_parallelism");
    assert_int_equal(cfg_edit_distance("kitten", "sitting"), 3);
    cfg_free(cfg);
}

/* Lists of names, and lookup in a config of many keys (the hash index). */
static void test_lists_and_index(void **state)
{
    (void)state;
    char *dir = cfgt_mkdir();
    char *text = malloc(64 * 1000 + 64);
    assert_non_null(text);
    size_t n = 0;
    for (int i = 0; i < 1000; i++) n += (size_t)sprintf(text + n, "k%d: %d\n", i, 3 * i);
    sprintf(text + n, "axes: [data, fsdp]\nnone: null\nnested: [[a]]\n");
    char *base = cfgt_write(dir, "base.yml", text);
    free(text);
    cfg_config *cfg = cfgt_load_ok(base, 0, NULL);
    for (int i = 0; i < 1000; i += 37) {
        char k[16];
        snprintf(k, sizeof k, "k%d", i);
        long long v;
        assert_int_equal(cfg_get_int(cfg, k, &v), SIM_OK);
        assert_int_equal(v, 3 * i);
    }
    assert_null(cfg_find(cfg, "k1000"));
    const char **items;
    int count;
    assert_int_equal(cfg_get_str_list(cfg, "axes", &items, &count), SIM_OK);
    assert_int_equal(count, 2);
    assert_string_equal(items[1], "fsdp");
    free(items);
    assert_int_equal(cfg_get_str_list(cfg, "none", &items, &count), SIM_OK);
    assert_int_equal(count, 0);
    free(items);
    assert_int_equal(cfg_get_str_list(cfg, "nested", &items, &count), SIM_ERR_INPUT);
    assert_contains(sim_errmsg(), "a flat list");
    const cfg_entry *e;
    assert_int_equal(cfg_entry_get(cfg, "k99x", &e), SIM_ERR_INPUT);
    assert_contains(sim_errmsg(), "config key 'k99x' is missing");
    assert_contains(sim_errmsg(), "closest key: 'k99'");
    cfg_free(cfg);
    free(base);
    cfgt_rmdir(dir);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_getters),
        cmocka_unit_test(test_lists_and_index),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
