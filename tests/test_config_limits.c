/* test_config_limits.c — hostile and out-of-range config input.
 *
 * Numeric keys are range-checked as configs/ranges.yml says (MaxText's
 * ranges where it has them); YAML is bounded: alias expansion ("billion
 * laughs"), multi-document files, path traversal through model_name; a
 * 40k-key file loads (linearly: the suite would stall otherwise). */
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
#include "tests/helpers.h"

static sim_status load(const char *base, const char *file, int n, const char *const *ovr, mesh_cfg **out)
{
    const char *files[1] = {file};
    mesh_cfg_args a = {base, NULL, files, file ? 1 : 0, ovr, n};
    *out = NULL;
    return mesh_cfg_load(&a, out);
}

static void write_text(const char *path, const char *text)
{
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    fputs(text, f);
    fclose(f);
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
        mesh_cfg *cfg;
        const char *o[] = {bad[i].ovr};
        assert_int_equal(load(NULL, NULL, 1, o, &cfg), SIM_ERR_INPUT);
        assert_null(cfg);
        assert_contains(sim_errmsg(), bad[i].ovr);      /* key=value */
        assert_contains(sim_errmsg(), "command line");  /* its source */
        assert_contains(sim_errmsg(), bad[i].range);    /* the valid range */
    }
    /* the bounds themselves and the "off" values are accepted */
    const char *ok[] = {"learning_rate=0", "adam_b1=0", "base_moe_mlp_dim=-1", "base_num_decoder_layers=4096",
                        "warmup_steps_fraction=1", "capacity_factor=-1"};
    mesh_cfg *cfg;
    if (load(NULL, NULL, 6, ok, &cfg) != SIM_OK) fail_msg("%s", sim_errmsg());
    mesh_cfg_free(cfg);
}

static void test_ranges_name_real_keys(void **state)
{
    (void)state;
    /* every entry of ranges.yml is a key of base.yml (or a glob) with a map of known bounds */
    mesh_cfg *base, *ranges;
    if (load(NULL, NULL, 0, NULL, &base) != SIM_OK) fail_msg("%s", sim_errmsg());
    if (mesh_cfg_load_file("configs/ranges.yml", &ranges) != SIM_OK) fail_msg("%s", sim_errmsg());
    assert_true(ranges->n >= 40);
    for (int i = 0; i < ranges->n; i++) {
        const mesh_cfg_entry *e = &ranges->entries[i];
        if (!strchr(e->key, '*') && !mesh_cfg_find(base, e->key)) fail_msg("ranges.yml: '%s' is not a base key", e->key);
        assert_int_equal(e->value.kind, MESH_CFG_MAP);
        for (int k = 0; k < e->value.n; k++) {
            const char *f = e->value.keys[k];
            if (strcmp(f, "gt") && strcmp(f, "ge") && strcmp(f, "lt") && strcmp(f, "le") && strcmp(f, "or"))
                fail_msg("ranges.yml: '%s' has unknown field '%s'", e->key, f);
        }
    }
    mesh_cfg_free(ranges);
    mesh_cfg_free(base);
}

/* ---- YAML ------------------------------------------------------------------ */

static void test_yaml_bounds(void **state)
{
    (void)state;
    char dir[] = "/tmp/shardsim_cfglim_XXXXXX";
    assert_non_null(mkdtemp(dir));
    char path[128];
    mesh_cfg *cfg;

    /* billion laughs: 9 levels of 9 aliases = 9^9 strings; refused, not expanded */
    snprintf(path, sizeof path, "%s/laugh.yml", dir);
    write_text(path, "a: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n"
                     "b: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a]\n"
                     "c: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b]\n"
                     "d: &d [*c, *c, *c, *c, *c, *c, *c, *c, *c]\n"
                     "e: &e [*d, *d, *d, *d, *d, *d, *d, *d, *d]\n"
                     "f: &f [*e, *e, *e, *e, *e, *e, *e, *e, *e]\n"
                     "g: &g [*f, *f, *f, *f, *f, *f, *f, *f, *f]\n"
                     "h: &h [*g, *g, *g, *g, *g, *g, *g, *g, *g]\n"
                     "i: &i [*h, *h, *h, *h, *h, *h, *h, *h, *h]\n");
    assert_int_equal(load(NULL, path, 0, NULL, &cfg), SIM_ERR_INPUT);
    assert_contains(sim_errmsg(), path);
    assert_contains(sim_errmsg(), "expands to more than");
    /* the same through a command-line value */
    const char *o[] = {"logical_axis_rules=[&a [x, x, x, x, x, x, x, x], &b [*a, *a, *a, *a, *a, *a, *a, *a], "
                       "&c [*b, *b, *b, *b, *b, *b, *b, *b], &d [*c, *c, *c, *c, *c, *c, *c, *c], "
                       "&e [*d, *d, *d, *d, *d, *d, *d, *d], &f [*e, *e, *e, *e, *e, *e, *e, *e], "
                       "&g [*f, *f, *f, *f, *f, *f, *f, *f]]"};
    assert_int_equal(load(NULL, NULL, 1, o, &cfg), SIM_ERR_INPUT);
    assert_contains(sim_errmsg(), "expands to more than");
    /* and as the base config (model and custom files go through the same reader) */
    assert_int_equal(load(path, NULL, 0, NULL, &cfg), SIM_ERR_INPUT);
    assert_contains(sim_errmsg(), "expands to more than");

    /* a second document is refused, not dropped */
    snprintf(path, sizeof path, "%s/multi.yml", dir);
    write_text(path, "steps: 3\n---\nsteps: 5\n");
    assert_int_equal(load(NULL, path, 0, NULL, &cfg), SIM_ERR_INPUT);
    assert_contains(sim_errmsg(), path);
    assert_contains(sim_errmsg(), "second document");
    /* one document with an explicit start and end marker is fine */
    write_text(path, "---\nsteps: 3\n...\n");
    if (load(NULL, path, 0, NULL, &cfg) != SIM_OK) fail_msg("%s", sim_errmsg());
    mesh_cfg_free(cfg);

    /* a directory is not a config file */
    assert_int_equal(load(NULL, dir, 0, NULL, &cfg), SIM_ERR_INPUT);
    assert_contains(sim_errmsg(), "not a regular file");

    /* model_name cannot leave models/ (../base would load configs/base.yml as a model) */
    const char *names[] = {"model_name=../base", "model_name=../../../../etc/passwd", "model_name=.hidden",
                           "model_name=a/b"};
    for (int i = 0; i < 4; i++) {
        assert_int_equal(load(NULL, NULL, 1, &names[i], &cfg), SIM_ERR_INPUT);
        assert_contains(sim_errmsg(), names[i]);
        assert_contains(sim_errmsg(), "not a model name");
        assert_contains(sim_errmsg(), "llama2-7b"); /* the available names */
    }

    /* 40,000 keys: a base config of that size loads, every key in place */
    snprintf(path, sizeof path, "%s/big.yml", dir);
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    for (int i = 0; i < 40000; i++) fprintf(f, "key_%d: %d\n", i, i);
    fclose(f);
    if (load(path, NULL, 0, NULL, &cfg) != SIM_OK) fail_msg("%s", sim_errmsg());
    assert_int_equal(cfg->n, 40000);
    assert_string_equal(cfg->entries[39999].key, "key_39999");
    assert_string_equal(cfg->entries[39999].value.text, "39999");
    mesh_cfg_free(cfg);
    /* and a duplicate among them is still found, naming both lines */
    f = fopen(path, "a");
    fprintf(f, "key_17: 1\n");
    fclose(f);
    assert_int_equal(load(path, NULL, 0, NULL, &cfg), SIM_ERR_INPUT);
    assert_contains(sim_errmsg(), "key 'key_17' appears twice (first at line 18)");

    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    assert_int_equal(system(cmd), 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_ranges_refuse),
        cmocka_unit_test(test_ranges_name_real_keys),
        cmocka_unit_test(test_yaml_bounds),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
