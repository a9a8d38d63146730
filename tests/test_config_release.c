/* test_config_release.c — maxtext_release: the release files and what they change.
 *
 * configs/releases/0.2.0*.yml are checked against MaxText 0.2.0's own base.yml (copied unmodified
 * from the PyPI wheel into tests/data/maxtext-0.2.0/configs): its rule set verbatim, and the keys
 * it does not know.  Then the behaviours that follow, with expectations worked out by hand from
 * the two rule tables: a key 0.2.0 lacks refused naming it; an axis 0.2.5 lacks refused naming it;
 * 0.2.5's logical names resolve by 0.2.0's rules; ZeRO-1 with FSDP refused by 0.2.5 only; `parity`
 * across releases shows both answers where one release traces and the other fails. */
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include <cmocka.h>

#include "cli/cli.h"
#include "cli/common.h"
#include "config/config.h"
#include "mesh/mesh_shape.h"
#include "config/release.h"
#include "mesh/rules.h"
#include "tests/cli_capture.h"

/* the 0.2.0 reference data: $SHARDSIM_REFERENCE, else tests/data */
static const char *ref(const char *rel)
{
    static char buf[1024];
    const char *env = getenv("SHARDSIM_REFERENCE");
    snprintf(buf, sizeof buf, "%s/%s", env && *env ? env : "tests/data", rel);
    return buf;
}

static const char *cfgpath(const char *rel)
{
    static char buf[1024];
    snprintf(buf, sizeof buf, "%s/%s", cli_configs_dir(), rel);
    return buf;
}

static const cfg_value *value(const cfg_config *c, const char *key)
{
    const cfg_entry *e = cfg_find(c, key);
    if (!e) fail_msg("no key %s", key);
    return &e->value;
}

/* keys.yml's default and choices of maxtext_release are the C default and the release files */
static void test_default_and_files(void **state)
{
    (void)state;
    cfg_config *k = NULL;
    if (cfg_load_file(cfgpath("keys.yml"), &k) != SIM_OK) fail_msg("%s", sim_errmsg());
    const cfg_value *keys = value(k, "keys"), *line = NULL;
    for (int i = 0; i < keys->n; i++)
        if (!strcmp(keys->keys[i], "maxtext_release")) line = &keys->items[i];
    assert_non_null(line);
    const cfg_value *def = NULL, *choices = NULL;
    for (int i = 0; i < line->n; i++) {
        if (!strcmp(line->keys[i], "default")) def = &line->items[i];
        if (!strcmp(line->keys[i], "choices")) choices = &line->items[i];
    }
    assert_non_null(def);
    assert_string_equal(def->text, CFG_RELEASE_DEFAULT);
    assert_non_null(choices);
    assert_true(choices->n >= 2);
    for (int i = 0; i < choices->n; i++) {
        const cfg_release *r;
        if (cfg_release_get(cli_configs_dir(), choices->items[i].text, &r) != SIM_OK) fail_msg("%s", sim_errmsg());
        assert_string_equal(cfg_release_maxtext(r), choices->items[i].text);
        assert_true(strlen(cfg_release_jax(r)) > 0);
    }
    cfg_free(k);
    /* a release without a file, or a path, is an input error listing the releases */
    const cfg_release *r;
    assert_int_equal(cfg_release_get(cli_configs_dir(), "0.1.0", &r), SIM_ERR_INPUT);
    assert_non_null(strstr(sim_errmsg(), "0.2.0, 0.2.5"));
    assert_int_equal(cfg_release_get(cli_configs_dir(), "../keys", &r), SIM_ERR_INPUT);
    sim_err_clear();
}

/* 0.2.0-rules.yml is 0.2.0's base.yml rule set: mesh_axes, data_sharding, logical_axis_rules */
static void test_0_2_0_rules_are_its_base_yml(void **state)
{
    (void)state;
    cfg_config *mt = NULL, *ours = NULL;
    if (cfg_load_file(ref("maxtext-0.2.0/configs/base.yml"), &mt) != SIM_OK) fail_msg("%s", sim_errmsg());
    if (cfg_load_file(cfgpath("releases/0.2.0-rules.yml"), &ours) != SIM_OK) fail_msg("%s", sim_errmsg());
    static const char *const keys[] = {"mesh_axes", "data_sharding", "logical_axis_rules"};
    for (int k = 0; k < 3; k++)
        if (!cfg_value_equal(value(mt, keys[k]), value(ours, keys[k]))) fail_msg("%s differs", keys[k]);
    assert_int_equal(value(ours, "logical_axis_rules")->n, 84);
    cfg_free(mt);
    cfg_free(ours);
}

/* unknown_keys: exactly the keys of keys.yml (MaxText's, not shardsim's own) that 0.2.0's base.yml lacks */
static void test_0_2_0_unknown_keys(void **state)
{
    (void)state;
    cfg_config *mt = NULL, *k = NULL;
    const cfg_release *r;
    if (cfg_load_file(ref("maxtext-0.2.0/configs/base.yml"), &mt) != SIM_OK) fail_msg("%s", sim_errmsg());
    if (cfg_load_file(cfgpath("keys.yml"), &k) != SIM_OK) fail_msg("%s", sim_errmsg());
    if (cfg_release_get(cli_configs_dir(), "0.2.0", &r) != SIM_OK) fail_msg("%s", sim_errmsg());
    const cfg_value *keys = value(k, "keys");
    int lacking = 0;
    for (int i = 0; i < keys->n; i++) {
        const char *key = keys->keys[i];
        bool own = false;
        for (int j = 0; j < keys->items[i].n; j++)
            own |= !strcmp(keys->items[i].keys[j], "origin") && !strcmp(keys->items[i].items[j].text, "shardsim");
        bool in_0_2_0 = cfg_find(mt, key) != NULL;
        if (own) {
            assert_false(cfg_release_lacks_key(r, key));
            continue;
        }
        if (cfg_release_lacks_key(r, key) == in_0_2_0)
            fail_msg("%s: in 0.2.0's base.yml %d, unknown_keys %d", key, in_0_2_0, !in_0_2_0);
        lacking += !in_0_2_0;
    }
    assert_true(lacking > 200); /* custom_mesh_and_rule, check_vma, pipeline_fsdp_ag_per_repeat, ... */
    assert_true(cfg_release_lacks_key(r, "custom_mesh_and_rule"));
    cfg_free(mt);
    cfg_free(k);
}

#define TINY                                                                                                           \
    "model_name=llama2-7b", "override_model_config=true", "base_emb_dim=64", "base_num_query_heads=4",                 \
        "base_num_kv_heads=4", "head_dim=16", "base_mlp_dim=128", "base_num_decoder_layers=2", "vocab_size=256",       \
        "max_target_length=32", "hardware=cpu", "dry_run=true", "steps=1"
enum { N_TINY = 13 };

static cli_capture train(const char *const *extra, int n)
{
    const char *w[64] = {TINY};
    for (int i = 0; i < n; i++) w[N_TINY + i] = extra[i];
    return cli_capture_run(cli_train, N_TINY + n, w);
}

/* a key 0.2.0 does not know, an axis 0.2.5 does not have: exit 2 naming the release */
static void test_refusals_name_the_release(void **state)
{
    (void)state;
    const char *a[] = {"num_devices=4", "maxtext_release=0.2.0", "custom_mesh_and_rule=pure-fsdp"};
    cli_capture c = train(a, 3);
    assert_int_equal(c.rc, 2);
    assert_non_null(strstr(c.err, "custom_mesh_and_rule"));
    assert_non_null(strstr(c.err, "MaxText 0.2.0 has no such key"));
    cli_capture_free(&c);
    const char *b[] = {"num_devices=4", "ici_fsdp_parallelism=2", "ici_tensor_transpose_parallelism=2"};
    c = train(b, 3);
    assert_int_equal(c.rc, 2);
    assert_non_null(strstr(c.err, "MaxText 0.2.5 has no 'tensor_transpose' mesh axis"));
    cli_capture_free(&c);
    /* the same axis under the release that has it, and under the legacy rules of 0.2.5 */
    const char *d[] = {"num_devices=4", "ici_fsdp_parallelism=2", "ici_tensor_transpose_parallelism=2",
                       "maxtext_release=0.2.0"};
    c = train(d, 4);
    if (c.rc != 0) fail_msg("0.2.0 tensor_transpose: rc %d: %s", c.rc, c.err);
    cli_capture_free(&c);
    /* (legacy.yml names 0.2.0's dims with their old names, so 0.2.5's embed_vocab finds no rule and the
     * table stays replicated: past the unsharded-parameter tolerance) */
    const char *e[] = {"num_devices=4", "ici_fsdp_parallelism=2", "ici_tensor_transpose_parallelism=2",
                       "custom_mesh_and_rule=legacy", "sharding_tolerance=1.0"};
    c = train(e, 5);
    if (c.rc != 0) fail_msg("legacy tensor_transpose: rc %d: %s", c.rc, c.err);
    cli_capture_free(&c);
    /* ZeRO-1 with fsdp > 1: 0.2.5's types.py refuses it, 0.2.0 has no such check */
    const char *z5[] = {"num_devices=4", "ici_data_parallelism=2", "ici_fsdp_parallelism=2",
                        "shard_optimizer_over_data=true"};
    c = train(z5, 4);
    assert_int_equal(c.rc, 2);
    assert_non_null(strstr(c.err, "MaxText 0.2.5 refuses this too"));
    cli_capture_free(&c);
    const char *z0[] = {"num_devices=4", "ici_data_parallelism=2", "ici_fsdp_parallelism=2",
                        "shard_optimizer_over_data=true", "maxtext_release=0.2.0"};
    c = train(z0, 5);
    if (c.rc != 0) fail_msg("0.2.0 ZeRO-1 with fsdp: rc %d: %s", c.rc, c.err);
    cli_capture_free(&c);
}

static void resolve1(const mesh_rules *r, const mesh_shape *m, const char *name, char *out, size_t cap)
{
    const char *names[1] = {name};
    mesh_resolved res;
    if (mesh_rules_resolve(r, m, name, 1, names, &res) != SIM_OK) fail_msg("%s", sim_errmsg());
    out[0] = '\0';
    for (int k = 0; k < res.spec.n_axes[0]; k++)
        snprintf(out + strlen(out), cap - strlen(out), "%s%s", k ? "," : "", m->names[res.spec.axes[0][k]]);
}

/* 0.2.5's names resolve by 0.2.0's rules (logical_names).  By hand, on fsdp=2 x expert=2 x
 * tensor_transpose=2: embed_attn stands for 0.2.0's 'embed' (first rule [fsdp, fsdp_transpose,
 * sequence, tensor_transpose, context, expert] -> fsdp, tensor_transpose, expert); activation_length for
 * 'activation_length_no_exp' ([sequence, context] -> nothing here), not 0.2.0's own activation_length
 * ([sequence, context, expert] -> expert); activation_batch_attn for 'activation_batch' ([data, fsdp,
 * fsdp_transpose, expert] -> fsdp, expert).  Under 0.2.5 embed_attn has no tensor_transpose (no such
 * axis: refused above) and activation_length takes no expert either. */
static void test_logical_names(void **state)
{
    (void)state;
    const char *o[] = {"maxtext_release=0.2.0", "num_devices=8", "ici_fsdp_parallelism=2", "ici_expert_parallelism=2",
                       "ici_tensor_transpose_parallelism=2"};
    cfg_config *cfg = NULL;
    if (cfg_load_argv(cli_base_config(), 5, o, &cfg) != SIM_OK) fail_msg("%s", sim_errmsg());
    mesh_shape m;
    mesh_rules r;
    if (mesh_shape_from_config(cfg, &m) != SIM_OK) fail_msg("%s", sim_errmsg());
    if (mesh_rules_from_config(cfg, &r) != SIM_OK) fail_msg("%s", sim_errmsg());
    char got[128];
    resolve1(&r, &m, "embed_attn", got, sizeof got);
    assert_string_equal(got, "fsdp,tensor_transpose,expert");
    resolve1(&r, &m, "activation_length", got, sizeof got);
    assert_string_equal(got, "");
    resolve1(&r, &m, "activation_batch_attn", got, sizeof got);
    assert_string_equal(got, "fsdp,expert");
    resolve1(&r, &m, "embed_moe", got,
             sizeof got); /* embed_no_exp: [fsdp, fsdp_transpose, sequence, tensor_transpose, context] */
    assert_string_equal(got, "fsdp,tensor_transpose");
    mesh_rules_free(&r);
    cfg_free(cfg);
}

/* parity across releases: seed 002's explicit FSDP+PP (a small Llama) traces and trains under 0.2.0
 * and fails under 0.2.5 at the pipeline's positions gather; the table says both */
static void test_parity_across_releases(void **state)
{
    (void)state;
    const char *w[] = {"model_name=llama2-7b",
                       "override_model_config=true",
                       "base_emb_dim=64",
                       "base_num_query_heads=4",
                       "base_num_kv_heads=4",
                       "head_dim=16",
                       "base_mlp_dim=128",
                       "base_num_decoder_layers=4",
                       "vocab_size=256",
                       "max_target_length=32",
                       "hardware=cpu",
                       "steps=1",
                       "num_devices=4",
                       "shard_mode=explicit",
                       "ici_pipeline_parallelism=2",
                       "ici_fsdp_parallelism=2",
                       "num_pipeline_microbatches=4",
                       "pipeline_fsdp_ag_once=true",
                       "per_device_batch_size=2",
                       "configs=maxtext_release=0.2.0;maxtext_release=0.2.5"};
    cli_capture c = cli_capture_run(cli_cmd_parity, 20, w);
    assert_int_equal(c.rc, 1);
    assert_non_null(strstr(c.out, "[1] maxtext_release=0.2.0: traces and trains"));
    assert_non_null(strstr(c.out, "[2] maxtext_release=0.2.5: fails: decoder/pipeline/positions (gather): "
                                  "ShardingTypeError"));
    assert_non_null(strstr(c.out, "at MaxText's layers/pipeline.py:_gather_one"));
    assert_non_null(strstr(c.out, "NOT COMPARED: 1 configuration fails"));
    cli_capture_free(&c);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_default_and_files),  cmocka_unit_test(test_0_2_0_rules_are_its_base_yml),
        cmocka_unit_test(test_0_2_0_unknown_keys), cmocka_unit_test(test_refusals_name_the_release),
        cmocka_unit_test(test_logical_names),      cmocka_unit_test(test_parity_across_releases),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
