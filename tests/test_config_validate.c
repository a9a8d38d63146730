/* test_config_validate.c — the checks after merging (config/validate.c): numeric keys are
 * range-checked as configs/ranges.yml says (MaxText's ranges where it has them); a rule of
 * combinations.yml whose every condition holds refuses the config, naming the keys, MaxText's
 * message and the fix, and one whose key the config lacks does not apply; MaxText's checks that
 * need more than key comparisons (MoE widths, context_sharding) refuse with their reason. */
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
#include "tests/config_fixture.h"

static sim_status load(const char *base, const char *file, int n, const char *const *ovr, cfg_config **out)
{
    const char *files[1] = {file};
    cfg_args a = {base, NULL, files, file ? 1 : 0, ovr, n};
    *out = NULL;
    return cfg_load(&a, out);
}

/* ---- ranges ---------------------------------------------------------------- */

static void test_ranges_refuse(void **state)
{
    (void)state;
    /* the values the adversarial run crashed on, and the range each must name
     * (MaxText: learning_rate NonNegativeFloat; the others > 0 as their
     * formulas need: log(0), division, sqrt of a negative) */
    static const struct {
        const char *ovr, *range;
    } bad[] = {
        {"learning_rate=1e30", "0 <= learning_rate <= 100"},
        {"learning_rate=-1", "0 <= learning_rate"},
        {"normalization_layer_epsilon=-1", "0 < normalization_layer_epsilon"},
        {"rope_max_timescale=0", "0 < rope_max_timescale"},
        {"adam_eps=0", "0 < adam_eps"},
        {"rope_factor=0", "0 < rope_factor"},
        {"adam_b1=1", "adam_b1 < 1"},
        {"adam_b2=.nan", "not a finite number"},
        {"warmup_steps_fraction=1.5", "0 <= warmup_steps_fraction <= 1"},
        {"base_num_decoder_layers=4294967298", "1 <= base_num_decoder_layers <= 4096"},
        {"base_num_decoder_layers=100000000", "base_num_decoder_layers <= 4096"},
        {"vocab_size=0", "1 <= vocab_size"},
        {"per_device_batch_size=0", "0 < per_device_batch_size"},
        {"base_moe_mlp_dim=0", "or -1"},
        {"hbm_limit_gb=-3", "0 <= hbm_limit_gb"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        cfg_config *cfg;
        const char *o[] = {bad[i].ovr};
        assert_int_equal(load(NULL, NULL, 1, o, &cfg), SIM_ERR_INPUT);
        assert_null(cfg);
        assert_contains(sim_errmsg(), bad[i].ovr);     /* key=value */
        assert_contains(sim_errmsg(), "command line"); /* its source */
        assert_contains(sim_errmsg(), bad[i].range);   /* the valid range */
    }
    /* the bounds themselves and the "off" values are accepted */
    const char *ok[] = {"learning_rate=0",         "adam_b1=0",
                        "base_moe_mlp_dim=-1",     "base_num_decoder_layers=4096",
                        "warmup_steps_fraction=1", "capacity_factor=-1"};
    cfg_config *cfg;
    if (load(NULL, NULL, 6, ok, &cfg) != SIM_OK) fail_msg("%s", sim_errmsg());
    cfg_free(cfg);
}

static void test_ranges_name_real_keys(void **state)
{
    (void)state;
    /* every entry of ranges.yml is a key of base.yml (or a glob) with a map of known bounds */
    cfg_config *base, *ranges;
    if (load(NULL, NULL, 0, NULL, &base) != SIM_OK) fail_msg("%s", sim_errmsg());
    if (cfg_load_file("configs/ranges.yml", &ranges) != SIM_OK) fail_msg("%s", sim_errmsg());
    assert_true(ranges->n >= 40);
    for (int i = 0; i < ranges->n; i++) {
        const cfg_entry *e = &ranges->entries[i];
        if (!strchr(e->key, '*') && !cfg_find(base, e->key)) fail_msg("ranges.yml: '%s' is not a base key", e->key);
        assert_int_equal(e->value.kind, CFG_MAP);
        for (int k = 0; k < e->value.n; k++) {
            const char *f = e->value.keys[k];
            if (strcmp(f, "gt") && strcmp(f, "ge") && strcmp(f, "lt") && strcmp(f, "le") && strcmp(f, "or"))
                fail_msg("ranges.yml: '%s' has unknown field '%s'", e->key, f);
        }
    }
    cfg_free(ranges);
    cfg_free(base);
}

/* ---- combinations.yml ---------------------------------------------------------- */

/* A scratch configs dir: a base with keys.yml (combination checks run with the key contract),
 * and a combinations.yml of one rule. */
static char *combo_dir(const char *rule)
{
    char *dir = cfgt_mkdir();
    free(cfgt_write(dir, "base.yml",
                    "num_experts: 1\nnum_slices: 1\ncontext_sharding: context\nmode: a\n"
                    "base_mlp_dim: 64\nbase_moe_mlp_dim: 64\nfirst_num_dense_layers: 0\n"
                    "decoder_block: llama2\nload_parameters_path: ''\nload_full_state_path: ''\n"));
    free(cfgt_write(dir, "keys.yml",
                    "keys:\n"
                    "  num_experts: {class: honoured, type: int, default: 1, why: x}\n"
                    "  num_slices: {class: honoured, type: int, default: 1, why: x}\n"
                    "  context_sharding: {class: honoured, type: str, default: context, why: x}\n"
                    "  mode: {class: honoured, type: str, default: a, why: x}\n"
                    "  base_mlp_dim: {class: honoured, type: int, default: 64, why: x}\n"
                    "  base_moe_mlp_dim: {class: honoured, type: int, default: 64, why: x}\n"
                    "  first_num_dense_layers: {class: honoured, type: int, default: 0, why: x}\n"
                    "  decoder_block: {class: honoured, type: str, default: llama2, why: x}\n"
                    "  load_parameters_path: {class: honoured, type: str, default: '', why: x}\n"
                    "  load_full_state_path: {class: honoured, type: str, default: '', why: x}\n"));
    free(cfgt_write(dir, "combinations.yml", rule));
    return dir;
}

static void test_combinations(void **state)
{
    (void)state;
    char *dir = combo_dir("rules:\n  - {where: types.py f, when: {mode: b, num_slices: {gt: 1}}, says: \"b needs one "
                          "slice\", fix: \"set num_slices=1\"}\n");
    char base[256];
    snprintf(base, sizeof base, "%s/base.yml", dir);
    cfg_config *cfg;
    /* one condition holds, the other not: accepted */
    const char *one[] = {"mode=b"};
    assert_int_equal(cfgt_load(base, NULL, 1, one, &cfg), SIM_OK);
    cfg_free(cfg);
    /* both hold: refused with the keys, the source, MaxText's words and the fix */
    const char *both[] = {"mode=B", "num_slices=2"}; /* text compares without case */
    assert_int_equal(cfgt_load(base, NULL, 2, both, &cfg), SIM_ERR_INPUT);
    assert_contains(sim_errmsg(), "mode=B, num_slices=2");
    assert_contains(sim_errmsg(), "(types.py f): b needs one slice; set num_slices=1");
    cfgt_rmdir(dir);

    /* a rule on a key this config does not have does not apply */
    dir = combo_dir("rules:\n  - {where: w, when: {no_such_key: 1}, says: s, fix: f}\n");
    snprintf(base, sizeof base, "%s/base.yml", dir);
    assert_int_equal(cfgt_load(base, NULL, 0, NULL, &cfg), SIM_OK);
    cfg_free(cfg);
    cfgt_rmdir(dir);

    /* a malformed rule names its line */
    dir = combo_dir("rules:\n  - {where: w, when: {mode: a}}\n");
    snprintf(base, sizeof base, "%s/base.yml", dir);
    assert_int_equal(cfgt_load(base, NULL, 0, NULL, &cfg), SIM_ERR_INPUT);
    assert_contains(sim_errmsg(), "combinations.yml:2: a rule needs where, when");
    cfgt_rmdir(dir);
}

/* MaxText's checks in C (types.py), on the project's configs. */
static void test_maxtext_rules(void **state)
{
    (void)state;
    cfg_config *cfg;
    /* a fully MoE model has one MLP width */
    const char *moe[] = {"num_experts=4", "base_moe_mlp_dim=64", "base_mlp_dim=128", "first_num_dense_layers=0"};
    assert_int_equal(cfgt_load(NULL, NULL, 4, moe, &cfg), SIM_ERR_INPUT);
    assert_contains(sim_errmsg(), "base_mlp_dim (128) to equal base_moe_mlp_dim (64)");
    /* ... except for qwen3_moe, whose config check sets mlp_dim to moe_mlp_dim (types.py) */
    const char *qmoe[] = {"decoder_block=qwen3_moe", "num_experts=4", "base_moe_mlp_dim=64", "base_mlp_dim=128",
                          "first_num_dense_layers=0"};
    assert_int_equal(cfgt_load(NULL, NULL, 5, qmoe, &cfg), SIM_OK);
    cfg_free(cfg);
    /* MoE needs an expert width */
    const char *width[] = {"num_experts=4", "base_moe_mlp_dim=-1",
                           "first_num_dense_layers=1"}; /* -1 passes ranges.yml */
    assert_int_equal(cfgt_load(NULL, NULL, 3, width, &cfg), SIM_ERR_INPUT);
    assert_contains(sim_errmsg(), "needs base_moe_mlp_dim > 0");
    /* both load paths */
    const char *paths[] = {"load_parameters_path=/a", "load_full_state_path=/b"};
    assert_int_equal(cfgt_load(NULL, NULL, 2, paths, &cfg), SIM_ERR_INPUT);
    assert_contains(sim_errmsg(), "both set");
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_ranges_refuse),
        cmocka_unit_test(test_ranges_name_real_keys),
        cmocka_unit_test(test_combinations),
        cmocka_unit_test(test_maxtext_rules),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
