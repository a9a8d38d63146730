/* test_config_keys.c — the key contract (config/keys.c) on a scratch configs dir: keys.yml
 * classes every key and adds the keys the base lacks with its default; a refused key may keep
 * only its default; `simulated` and `choices` bound a key's values; types come from keys.yml;
 * a key of the base without a line, and a malformed line, are errors naming the file. */
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

static const char KEYS[] = "keys:\n"
                           "  steps: {class: honoured, type: int, default: 1, why: the steps}\n"
                           "  color: {class: inert, type: str, default: red, why: paints nothing}\n"
                           "  quantize: {class: refused, type: str, default: '', why: int8 training is not simulated}\n"
                           "  mode: {class: honoured, type: str, default: a, simulated: [a, b], choices: [a, b, c], "
                           "why: the modes}\n"
                           "  extra: {class: honoured, type: float, default: 0.5, why: not in the base}\n"
                           /* the keys MaxText's combination checks read (they run under a key contract) */
                           "  num_experts: {class: honoured, type: int, default: 1, why: x}\n"
                           "  first_num_dense_layers: {class: honoured, type: int, default: 0, why: x}\n"
                           "  base_mlp_dim: {class: honoured, type: int, default: 8, why: x}\n"
                           "  base_moe_mlp_dim: {class: honoured, type: int, default: 8, why: x}\n"
                           "  decoder_block: {class: honoured, type: str, default: llama2, why: x}\n"
                           "  context_sharding: {class: honoured, type: str, default: context, why: x}\n"
                           "  load_parameters_path: {class: honoured, type: str, default: '', why: x}\n"
                           "  load_full_state_path: {class: honoured, type: str, default: '', why: x}\n";

static char *keys_dir(const char *keys)
{
    char *dir = cfgt_mkdir();
    free(cfgt_write(dir, "base.yml", "steps: 1\ncolor: red\nquantize: ''\nmode: a\n"));
    free(cfgt_write(dir, "keys.yml", keys));
    return dir;
}

static void test_classes_and_defaults(void **state)
{
    (void)state;
    char *dir = keys_dir(KEYS);
    char base[256];
    snprintf(base, sizeof base, "%s/base.yml", dir);
    const char *o[] = {"color=blue"};
    cfg_config *cfg = cfgt_load_ok(base, 1, o);
    assert_non_null(cfg->keys_file);
    assert_int_equal(cfg_find(cfg, "steps")->cls, CFG_KEY_HONOURED);
    assert_int_equal(cfg_find(cfg, "color")->cls, CFG_KEY_INERT);
    assert_int_equal(cfg_find(cfg, "quantize")->cls, CFG_KEY_REFUSED);
    assert_string_equal(cfg_key_class_name(cfg_find(cfg, "color")->cls), "inert");
    assert_string_equal(cfg_find(cfg, "color")->why, "paints nothing");
    assert_true(cfg_find(cfg, "color")->changed);
    assert_false(cfg_find(cfg, "steps")->changed);
    /* a key the base lacks: keys.yml's default, and its line as the source */
    double d;
    assert_int_equal(cfg_get_double(cfg, "extra", &d), SIM_OK);
    assert_true(d == 0.5);
    assert_contains(cfg_find(cfg, "extra")->where, "keys.yml:");
    assert_string_equal(cfg_entry_field(cfg_find(cfg, "mode"), "simulated")->items[1].text, "b");
    cfg_free(cfg);
    cfgt_rmdir(dir);
}

static void test_refusals(void **state)
{
    (void)state;
    char *dir = keys_dir(KEYS);
    char base[256];
    snprintf(base, sizeof base, "%s/base.yml", dir);
    cfg_config *cfg;
    const char *refused[] = {"quantize=int8"};
    assert_int_equal(cfgt_load(base, NULL, 1, refused, &cfg), SIM_ERR_INPUT);
    assert_contains(sim_errmsg(), "quantize=int8 is refused: int8 training is not simulated");
    const char *unsimulated[] = {"mode=c"};
    assert_int_equal(cfgt_load(base, NULL, 1, unsimulated, &cfg), SIM_ERR_INPUT);
    assert_contains(sim_errmsg(), "mode=c is refused: shardsim simulates only mode in [a, b]");
    const char *unknown_choice[] = {"mode=z"};
    assert_int_equal(cfgt_load(base, NULL, 1, unknown_choice, &cfg), SIM_ERR_INPUT);
    assert_contains(sim_errmsg(), "mode=z is not a value MaxText accepts; use one of [a, b, c]");
    const char *typed[] = {"extra=fast"};
    assert_int_equal(cfgt_load(base, NULL, 1, typed, &cfg), SIM_ERR_INPUT);
    assert_contains(sim_errmsg(), "key 'extra' = fast is a string, expected a number");
    const char *misspelt[] = {"colour=blue"};
    assert_int_equal(cfgt_load(base, NULL, 1, misspelt, &cfg), SIM_ERR_INPUT);
    assert_contains(sim_errmsg(), "unknown key 'colour'");
    assert_contains(sim_errmsg(), "did you mean 'color'?");
    cfgt_rmdir(dir);
}

static void test_registry_errors(void **state)
{
    (void)state;
    cfg_config *cfg;
    char base[256];
    /* a key of the base without a line */
    char *dir = keys_dir("keys:\n  steps: {class: honoured, type: int, default: 1, why: x}\n");
    snprintf(base, sizeof base, "%s/base.yml", dir);
    assert_int_equal(cfgt_load(base, NULL, 0, NULL, &cfg), SIM_ERR_INPUT);
    assert_contains(sim_errmsg(), "key 'color' has no line in");
    cfgt_rmdir(dir);
    /* a line with a class that is not one */
    dir = keys_dir("keys:\n  steps: {class: maybe, type: int, default: 1, why: x}\n");
    snprintf(base, sizeof base, "%s/base.yml", dir);
    assert_int_equal(cfgt_load(base, NULL, 0, NULL, &cfg), SIM_ERR_INPUT);
    assert_contains(sim_errmsg(), "key 'steps' has class 'maybe'; expected honoured, inert or refused");
    cfgt_rmdir(dir);
    /* no keys map */
    dir = keys_dir("other: 1\n");
    snprintf(base, sizeof base, "%s/base.yml", dir);
    assert_int_equal(cfgt_load(base, NULL, 0, NULL, &cfg), SIM_ERR_INPUT);
    assert_contains(sim_errmsg(), "expected a top-level map `keys:`");
    cfgt_rmdir(dir);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_classes_and_defaults),
        cmocka_unit_test(test_refusals),
        cmocka_unit_test(test_registry_errors),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
