/* test_config_load.c — config loading (config/load.c): MaxText merge order, key checks,
 * sources; every project and reference YAML file loads, and the project's configs/ agree with
 * MaxText's files on mesh axes, rule tables and model dims. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <dirent.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmocka.h>

#include "config/config.h"
#include "config/models.h"
#include "tests/helpers.h"

static const char *const MODELS[] = {"llama2-7b",      "deepseek3-test", "deepseek3-tiny",
                                     "deepseek3-671b", "deepseek2-16b",  "deepseek3-671b-batchsplit"};
static const char *const CUSTOMS[] = {"pure-fsdp", "ep-as-cp",          "cp-as-ep",
                                      "ep-as-dp",  "shard-exp-on-fsdp", "pipeline-large-moe"};
enum { N_MODELS = 6, N_CUSTOMS = 6 };

static char ref_path[1024];
static const char *ref(const char *rel)
{
    /* the MaxText release shardsim follows: 0.2.5 (its configs; the older files stay in maxtext/) */
    snprintf(ref_path, sizeof ref_path, "%s/maxtext-0.2.5/%s", helper_reference_dir(), rel);
    return ref_path;
}

/* Loads configs/base.yml (or base) with overrides; fails the test on error. */
static cfg_config *load_ok(const char *base, const char *configs_dir, int n, const char *const *ovr)
{
    cfg_args a = {base, configs_dir, NULL, 0, ovr, n};
    cfg_config *cfg = NULL;
    sim_status st = cfg_load(&a, &cfg);
    if (st != SIM_OK)
        fail_msg("loading %s with %d overrides failed: %s", base ? base : "configs/base.yml", n, sim_errmsg());
    return cfg;
}

/* Loads expecting failure; returns the message (static copy). */
static const char *load_err(const char *base, const char *const *files, int n_files, int n, const char *const *ovr)
{
    static char msg[4096];
    cfg_args a = {base, NULL, files, n_files, ovr, n};
    cfg_config *cfg = NULL;
    sim_status st = cfg_load(&a, &cfg);
    if (st == SIM_OK) {
        cfg_free(cfg);
        fail_msg("expected the load to fail");
    }
    assert_int_equal(st, SIM_ERR_INPUT);
    snprintf(msg, sizeof msg, "%s", sim_errmsg());
    return msg;
}

static const cfg_value *val(const cfg_config *cfg, const char *key)
{
    const cfg_entry *e = cfg_find(cfg, key);
    if (!e) fail_msg("key '%s' missing", key);
    return &e->value;
}

static void assert_value_equal(const cfg_config *a, const cfg_config *b, const char *key, const char *ctx)
{
    const cfg_value *x = val(a, key), *y = val(b, key);
    if (!cfg_value_equal(x, y)) {
        char *tx = cfg_value_to_text(x, 0), *ty = cfg_value_to_text(y, 0);
        fail_msg("%s: key '%s' differs:\n  shardsim %s\n  maxtext  %s", ctx, key, tx, ty);
    }
}

static char tmpdir[256];
static const char *write_tmp(const char *name, const char *text)
{
    static char path[512];
    if (!tmpdir[0]) {
        snprintf(tmpdir, sizeof tmpdir, "/tmp/shardsim_cfg_XXXXXX");
        assert_non_null(mkdtemp(tmpdir));
    }
    snprintf(path, sizeof path, "%s/%s", tmpdir, name);
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    fputs(text, f);
    fclose(f);
    return path;
}

/* ------------------------------------------------------------------------ */

static void test_base_loads(void **state)
{
    (void)state;
    cfg_config *cfg = load_ok(NULL, NULL, 0, NULL);
    const char **axes;
    int n;
    assert_int_equal(cfg_get_str_list(cfg, "mesh_axes", &axes, &n), SIM_OK);
    assert_int_equal(n, 12);
    assert_string_equal(axes[0], "diloco");
    assert_string_equal(axes[5], "context");
    assert_string_equal(axes[11], "autoregressive");
    free(axes);
    assert_int_equal(val(cfg, "logical_axis_rules")->n, 80);
    const cfg_value *ds = val(cfg, "data_sharding");
    assert_int_equal(ds->kind, CFG_LIST);
    assert_int_equal(ds->n, 1);
    assert_int_equal(ds->items[0].n, 11);
    const char *s;
    assert_int_equal(cfg_get_str(cfg, "dtype", &s), SIM_OK);
    assert_string_equal(s, "bfloat16");
    assert_int_equal(cfg_get_str(cfg, "shard_mode", &s), SIM_OK);
    assert_string_equal(s, "auto");
    long long v;
    assert_int_equal(cfg_get_int(cfg, "ici_fsdp_parallelism", &v), SIM_OK);
    assert_int_equal(v, -1);
    assert_int_equal(cfg_get_int(cfg, "checkpoint_period", &v), SIM_OK); /* 10_000 */
    assert_int_equal(v, 10000);
    assert_null(cfg->model_file);
    assert_contains(cfg_find(cfg, "dtype")->where, "configs/base.yml:");
    cfg_free(cfg);
}

/* Every project file: each model and each custom rule set, found by walking
 * the folders (so a new file is covered without editing this test).  A model
 * file of a decoder block shardsim simulates loads, or is refused by a key it
 * sets; any other is refused by its block (test_models_catalog dry-runs them). */
static void test_project_files_load(void **state)
{
    (void)state;
    const char *dirs[] = {"configs/models", "configs/custom_mesh_and_rule"};
    const char *keys[] = {"model_name", "custom_mesh_and_rule"};
    int seen[2] = {0, 0}, loaded = 0;
    cfg_config *base = load_ok(NULL, NULL, 0, NULL);
    for (int k = 0; k < 2; k++) {
        DIR *d = opendir(dirs[k]);
        assert_non_null(d);
        struct dirent *de;
        while ((de = readdir(d))) {
            size_t len = strlen(de->d_name);
            if (len < 5 || strcmp(de->d_name + len - 4, ".yml") != 0) continue;
            char ovr[300];
            snprintf(ovr, sizeof ovr, "%s=%.*s", keys[k], (int)(len - 4), de->d_name);
            const char *o[] = {ovr};
            seen[k]++;
            if (k == 0) {
                char file[300];
                snprintf(file, sizeof file, "%s/%s", dirs[k], de->d_name);
                cfg_config *raw = NULL;
                assert_int_equal(cfg_load_file(file, &raw), SIM_OK);
                const cfg_entry *b = cfg_find(raw, "decoder_block");
                assert_non_null(b);
                int sim = cfg_block_simulated(base, b->value.text);
                cfg_args a = {NULL, NULL, NULL, 0, o, 1};
                cfg_config *cfg = NULL;
                sim_status st = cfg_load(&a, &cfg);
                if (st == SIM_OK) {
                    assert_true(sim);
                    assert_non_null(cfg->model_file);
                    loaded++;
                } else if (sim) {
                    /* refused naming a key the file sets: "<file>:<line>: key=value is refused" */
                    if (!strstr(sim_errmsg(), file) || !strstr(sim_errmsg(), " is refused"))
                        fail_msg("%s: %s", file, sim_errmsg());
                } else {
                    char want[300];
                    snprintf(want, sizeof want, "sets decoder_block=%s: MaxText's", b->value.text);
                    if (!strstr(sim_errmsg(), want)) fail_msg("%s: %s", file, sim_errmsg());
                }
                cfg_free(cfg);
                cfg_free(raw);
                continue;
            }
            cfg_config *cfg = load_ok(NULL, NULL, 1, o);
            assert_non_null(cfg->custom_file);
            cfg_free(cfg);
        }
        closedir(d);
    }
    cfg_free(base);
    assert_true(loaded >= N_MODELS);
    assert_true(seen[1] >= N_CUSTOMS + 1); /* + legacy */
}

/* MaxText's own files: its base.yml as a base, each model and custom file on
 * top of it, and each of those also as an extra file on top of OUR base (so
 * our base knows every key they use). */
static void test_reference_files_load(void **state)
{
    (void)state;
    char base[1024], dir[1024];
    snprintf(base, sizeof base, "%s", ref("configs/base.yml"));
    snprintf(dir, sizeof dir, "%s", ref("configs"));
    cfg_config *cfg = load_ok(base, NULL, 0, NULL);
    assert_int_equal(val(cfg, "logical_axis_rules")->n, 80);
    cfg_free(cfg);
    for (int k = 0; k < 2; k++) {
        char sub[1100];
        snprintf(sub, sizeof sub, "%s/%s", dir, k == 0 ? "models" : "custom_mesh_and_rule");
        DIR *d = opendir(sub);
        assert_non_null(d);
        struct dirent *de;
        int n = 0;
        while ((de = readdir(d))) {
            size_t len = strlen(de->d_name);
            if (len < 5 || strcmp(de->d_name + len - 4, ".yml") != 0) continue;
            char ovr[300];
            snprintf(ovr, sizeof ovr, "%s=%.*s", k == 0 ? "model_name" : "custom_mesh_and_rule", (int)(len - 4),
                     de->d_name);
            const char *o[] = {ovr};
            cfg_free(load_ok(base, NULL, 1, o));
            /* the same file as an extra file over the project base */
            char file[1400];
            snprintf(file, sizeof file, "%s/%s", sub, de->d_name);
            const char *files[] = {file};
            cfg_args a = {NULL, NULL, files, 1, NULL, 0};
            cfg_config *c2 = NULL;
            if (cfg_load(&a, &c2) != SIM_OK) fail_msg("%s over configs/base.yml: %s", file, sim_errmsg());
            cfg_free(c2);
            n++;
        }
        closedir(d);
        assert_true(n >= (k == 0 ? N_MODELS : N_CUSTOMS));
    }
}

/* The project's data agree with MaxText's, compared as loaded values. */
static void test_project_agrees_with_maxtext(void **state)
{
    (void)state;
    char base[1024];
    snprintf(base, sizeof base, "%s", ref("configs/base.yml"));
    static const char *const base_keys[] = {"mesh_axes",
                                            "logical_axis_rules",
                                            "data_sharding",
                                            "input_data_sharding_logical_axes",
                                            "context_sharding",
                                            "ulysses_context_sharding",
                                            "model_name",
                                            "shard_mode",
                                            "base_emb_dim",
                                            "base_num_query_heads",
                                            "base_num_kv_heads",
                                            "base_mlp_dim",
                                            "base_num_decoder_layers",
                                            "head_dim",
                                            "vocab_size",
                                            "mlp_activations",
                                            "normalization_layer_epsilon",
                                            "per_device_batch_size",
                                            "max_target_length",
                                            "learning_rate",
                                            "adam_b1",
                                            "adam_b2",
                                            "adam_eps",
                                            "adam_eps_root",
                                            "adam_weight_decay",
                                            "gradient_clipping_threshold",
                                            "capacity_factor",
                                            "rope_max_timescale",
                                            "remat_policy",
                                            "z_loss_multiplier",
                                            "init_weights_seed",
                                            "weight_dtype"};
    cfg_config *ours = load_ok(NULL, NULL, 0, NULL), *theirs = load_ok(base, NULL, 0, NULL);
    for (size_t i = 0; i < sizeof base_keys / sizeof base_keys[0]; i++)
        assert_value_equal(ours, theirs, base_keys[i], "base");
    /* every ici/dcn flag MaxText has exists in ours with the same default */
    for (int i = 0; i < theirs->n; i++) {
        const char *k = theirs->entries[i].key;
        if ((!strncmp(k, "ici_", 4) || !strncmp(k, "dcn_", 4)) && strstr(k, "_parallelism"))
            assert_value_equal(ours, theirs, k, "base flags");
    }
    cfg_free(ours);
    cfg_free(theirs);

    for (int m = 0; m < N_MODELS; m++) {
        char ovr[200], file[1200], what[300];
        snprintf(ovr, sizeof ovr, "model_name=%s", MODELS[m]);
        snprintf(what, sizeof what, "model %s", MODELS[m]);
        const char *o[] = {ovr};
        ours = load_ok(NULL, NULL, 1, o);
        theirs = load_ok(base, NULL, 1, o);
        /* every key MaxText's model file sets, and every key ours sets */
        for (int side = 0; side < 2; side++) {
            cfg_config *raw = NULL;
            if (side == 0) snprintf(file, sizeof file, "%s/models/%s.yml", ref("configs"), MODELS[m]);
            else snprintf(file, sizeof file, "configs/models/%s.yml", MODELS[m]);
            assert_int_equal(cfg_load_file(file, &raw), SIM_OK);
            assert_true(raw->n > 10);
            for (int i = 0; i < raw->n; i++) assert_value_equal(ours, theirs, raw->entries[i].key, what);
            cfg_free(raw);
        }
        assert_value_equal(ours, theirs, "logical_axis_rules", what);
        cfg_free(ours);
        cfg_free(theirs);
    }

    for (int c = 0; c < N_CUSTOMS; c++) {
        char ovr[200], what[300];
        snprintf(ovr, sizeof ovr, "custom_mesh_and_rule=%s", CUSTOMS[c]);
        snprintf(what, sizeof what, "custom_mesh_and_rule %s", CUSTOMS[c]);
        const char *o[] = {ovr};
        ours = load_ok(NULL, NULL, 1, o);
        theirs = load_ok(base, NULL, 1, o);
        assert_value_equal(ours, theirs, "mesh_axes", what);
        assert_value_equal(ours, theirs, "logical_axis_rules", what);
        assert_value_equal(ours, theirs, "data_sharding", what);
        assert_value_equal(ours, theirs, "context_sharding", what);
        cfg_free(ours);
        cfg_free(theirs);
    }
}

static void test_legacy_rules(void **state)
{
    (void)state;
    const char *o[] = {"custom_mesh_and_rule=legacy"};
    cfg_config *cfg = load_ok(NULL, NULL, 1, o);
    const cfg_value *axes = val(cfg, "mesh_axes");
    assert_int_equal(axes->n, 13);
    assert_string_equal(axes->items[5].text, "sequence");
    assert_string_equal(axes->items[9].text, "tensor_transpose");
    const cfg_value *rules = val(cfg, "logical_axis_rules");
    assert_int_equal(rules->n, 98);
    assert_string_equal(rules->items[0].items[0].text, "activation_batch");
    assert_string_equal(rules->items[97].items[0].text, "diloco");
    /* activation_length starts with 'sequence'; context_sharding stays a CP axis */
    const char *cs;
    assert_int_equal(cfg_get_str(cfg, "context_sharding", &cs), SIM_OK);
    assert_string_equal(cs, "context");
    cfg_free(cfg);
}

static void test_model_rules_merge_by_name(void **state)
{
    (void)state;
    const char *o[] = {"model_name=llama2-7b"};
    cfg_config *cfg = load_ok(NULL, NULL, 1, o);
    const cfg_value *rules = val(cfg, "logical_axis_rules");
    assert_int_equal(rules->n, 80); /* one 'norm' rule replaced by one */
    const cfg_value *last = &rules->items[79];
    assert_string_equal(last->items[0].text, "norm");
    assert_string_equal(last->items[1].text, "fsdp");
    for (int i = 0; i < 75; i++) assert_string_not_equal(rules->items[i].items[0].text, "norm");
    assert_contains(last->file, "configs/models/llama2-7b.yml");
    assert_contains(cfg_find(cfg, "logical_axis_rules")->where, "merged with");
    assert_contains(cfg_find(cfg, "base_emb_dim")->where, "configs/models/llama2-7b.yml:");
    assert_int_equal(cfg_find(cfg, "base_emb_dim")->from_model, 1);
    cfg_free(cfg);

    /* command-line rules merge after the model's: every 'embed' rule goes */
    const char *o2[] = {"model_name=llama2-7b", "logical_axis_rules=[['embed', ['fsdp']], ['extra', []]]"};
    cfg = load_ok(NULL, NULL, 2, o2);
    rules = val(cfg, "logical_axis_rules");
    assert_int_equal(rules->n, 80 - 2 + 2);
    int n_embed = 0;
    for (int i = 0; i < rules->n; i++) n_embed += !strcmp(rules->items[i].items[0].text, "embed");
    assert_int_equal(n_embed, 1);
    assert_string_equal(rules->items[rules->n - 2].items[0].text, "embed");
    assert_string_equal(rules->items[rules->n - 1].items[0].text, "extra");
    assert_int_equal(rules->items[rules->n - 1].items[1].n, 0);
    assert_string_equal(rules->items[rules->n - 3].items[0].text, "norm"); /* model's rule stays */
    cfg_free(cfg);

    /* override_logical_axis_rules=true: the user's list replaces the table */
    const char *o3[] = {"override_logical_axis_rules=true", "logical_axis_rules=[[embed, fsdp]]"};
    cfg = load_ok(NULL, NULL, 2, o3);
    assert_int_equal(val(cfg, "logical_axis_rules")->n, 1);
    cfg_free(cfg);
}

static void test_model_and_user_conflict(void **state)
{
    (void)state;
    const char *o[] = {"model_name=llama2-7b", "base_emb_dim=64"};
    const char *msg = load_err(NULL, NULL, 0, 2, o);
    assert_contains(msg, "base_emb_dim");
    assert_contains(msg, "override_model_config=true");
    assert_contains(msg, "llama2-7b.yml");
    assert_contains(msg, "command line");
    /* the same value (written differently) is no conflict */
    const char *o2[] = {"model_name=llama2-7b", "base_emb_dim=4_096"};
    cfg_free(load_ok(NULL, NULL, 2, o2));
    const char *o3[] = {"model_name=llama2-7b", "base_emb_dim=64", "override_model_config=true"};
    cfg_config *cfg = load_ok(NULL, NULL, 3, o3);
    long long v;
    assert_int_equal(cfg_get_int(cfg, "base_emb_dim", &v), SIM_OK);
    assert_int_equal(v, 64);
    assert_string_equal(cfg_find(cfg, "base_emb_dim")->where, "command line");
    /* keys the model does not set are free */
    assert_int_equal(cfg_get_int(cfg, "base_num_decoder_layers", &v), SIM_OK);
    assert_int_equal(v, 32);
    cfg_free(cfg);
    const char *o4[] = {"model_name=llama2-7b", "steps=3"};
    cfg_free(load_ok(NULL, NULL, 2, o4));
}

static void test_custom_replaces(void **state)
{
    (void)state;
    const char *o[] = {"custom_mesh_and_rule=ep-as-cp", "logical_axis_rules=[[norm, fsdp]]"};
    cfg_config *cfg = load_ok(NULL, NULL, 2, o);
    const cfg_value *axes = val(cfg, "mesh_axes");
    assert_int_equal(axes->n, 4);
    assert_string_equal(axes->items[3].text, "expert");
    /* the custom table replaces everything, user rules included */
    assert_int_equal(val(cfg, "logical_axis_rules")->n, 39);
    assert_int_equal(val(cfg, "data_sharding")->items[0].n, 4);
    const char *cs;
    assert_int_equal(cfg_get_str(cfg, "context_sharding", &cs), SIM_OK);
    assert_string_equal(cs, "expert");
    assert_contains(cfg_find(cfg, "context_sharding")->where, "inferred");
    assert_contains(cfg->custom_file, "custom_mesh_and_rule/ep-as-cp.yml");
    cfg_free(cfg);
    /* a context_sharding the user sets is kept */
    const char *o2[] = {"custom_mesh_and_rule=ep-as-cp", "context_sharding=context"};
    cfg = load_ok(NULL, NULL, 2, o2);
    assert_int_equal(cfg_get_str(cfg, "context_sharding", &cs), SIM_OK);
    assert_string_equal(cs, "context");
    cfg_free(cfg);
    /* pure-fsdp has no activation_length rule: the default stays */
    const char *o3[] = {"custom_mesh_and_rule=pure-fsdp"};
    cfg = load_ok(NULL, NULL, 1, o3);
    assert_int_equal(cfg_get_str(cfg, "context_sharding", &cs), SIM_OK);
    assert_string_equal(cs, "context");
    assert_int_equal(val(cfg, "mesh_axes")->n, 1);
    cfg_free(cfg);
    const char *o4[] = {"custom_mesh_and_rule=no-such-rule"};
    const char *msg = load_err(NULL, NULL, 0, 1, o4);
    assert_contains(msg, "no-such-rule");
    assert_contains(msg, "pure-fsdp");
}

static void test_unknown_keys(void **state)
{
    (void)state;
    const char *o[] = {"ici_fsdp_paralelism=4"};
    const char *msg = load_err(NULL, NULL, 0, 1, o);
    assert_contains(msg, "'ici_fsdp_paralelism'");
    assert_contains(msg, "command line");
    assert_contains(msg, "did you mean 'ici_fsdp_parallelism'");
    const char *path = write_tmp("typo.yml", "steps: 3\nbase_emb_dimm: 64\n");
    char where[600];
    snprintf(where, sizeof where, "%s:2", path);
    const char *files[] = {path};
    msg = load_err(NULL, files, 1, 0, NULL);
    assert_contains(msg, where);
    assert_contains(msg, "'base_emb_dimm'");
    assert_contains(msg, "did you mean 'base_emb_dim'");
    const char *o2[] = {"model_name=nosuch-model"};
    msg = load_err(NULL, NULL, 0, 1, o2);
    assert_contains(msg, "nosuch-model");
    assert_contains(msg, "llama2-7b");
    const char *o3[] = {"just_a_word"};
    msg = load_err(NULL, NULL, 0, 1, o3);
    assert_contains(msg, "just_a_word");
}

static void test_malformed_values(void **state)
{
    (void)state;
    struct {
        const char *ovr, *needles[3];
    } cases[] = {
        {"ici_fsdp_parallelism=abc", {"ici_fsdp_parallelism", "abc", "an integer"}},
        {"steps=2.5", {"steps", "2.5", "an integer"}},
        {"dry_run=maybe", {"dry_run", "maybe", "boolean"}},
        {"learning_rate=fast", {"learning_rate", "fast", "a number"}},
        {"mesh_axes=fsdp", {"mesh_axes", "fsdp", "a list"}},
        {"mesh_axes=[data, data]", {"mesh_axes", "'data' twice", "command line"}},
        {"logical_axis_rules=[[norm]]", {"logical_axis_rules", "[norm]", "pair"}},
        {"logical_axis_rules=[[norm, [fsdp, fsdp]]]", {"norm", "'fsdp' twice", "command line"}},
        {"logical_axis_rules=[[norm, fsdp]", {"logical_axis_rules", "invalid YAML", "command-line"}},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        const char *o[] = {cases[i].ovr};
        const char *msg = load_err(NULL, NULL, 0, 1, o);
        for (int k = 0; k < 3; k++) assert_contains(msg, cases[i].needles[k]);
    }
    /* ints where floats are expected are fine, and so are integral floats */
    const char *ok[] = {"learning_rate=1",        "per_device_batch_size=0.25", "steps=3.0",    "run_name=123",
                        "dataset_path=/a b:c #d", "run_name='quoted text'",     "num_devices=8"};
    cfg_config *cfg = load_ok(NULL, NULL, 7, ok);
    const char *s;
    assert_int_equal(cfg_get_str(cfg, "dataset_path", &s), SIM_OK);
    assert_string_equal(s, "/a b:c #d");
    assert_int_equal(cfg_get_str(cfg, "run_name", &s), SIM_OK);
    assert_string_equal(s, "quoted text");
    double d;
    assert_int_equal(cfg_get_double(cfg, "per_device_batch_size", &d), SIM_OK);
    assert_true(d == 0.25);
    cfg_free(cfg);
    /* a YAML syntax error names file and line */
    const char *path = write_tmp("broken.yml", "steps: 3\nmesh_axes: [data, fsdp\nrun_name: x\n");
    const char *files[] = {path};
    const char *msg = load_err(NULL, files, 1, 0, NULL);
    assert_contains(msg, path);
    assert_contains(msg, "invalid YAML");
    /* a key written twice in one file */
    path = write_tmp("dup.yml", "steps: 3\nsteps: 4\n");
    files[0] = path;
    msg = load_err(NULL, files, 1, 0, NULL);
    assert_contains(msg, "appears twice");
}

static void test_extra_files_and_order(void **state)
{
    (void)state;
    const char *f1 = write_tmp("one.yml", "steps: 5\nper_device_batch_size: 2\nmodel_name: deepseek3-tiny\n");
    char p1[600];
    snprintf(p1, sizeof p1, "%s", f1);
    const char *f2 = write_tmp("two.yml", "# comment\nsteps: 6\n");
    char p2[600];
    snprintf(p2, sizeof p2, "%s", f2);
    const char *files[] = {p1, p2};
    const char *o[] = {"per_device_batch_size=3"};
    cfg_args a = {NULL, NULL, files, 2, o, 1};
    cfg_config *cfg = NULL;
    if (cfg_load(&a, &cfg) != SIM_OK) fail_msg("%s", sim_errmsg());
    long long v;
    assert_int_equal(cfg_get_int(cfg, "steps", &v), SIM_OK);
    assert_int_equal(v, 6);
    char where[700];
    snprintf(where, sizeof where, "%s:2", p2);
    assert_string_equal(cfg_find(cfg, "steps")->where, where);
    double d;
    assert_int_equal(cfg_get_double(cfg, "per_device_batch_size", &d), SIM_OK);
    assert_true(d == 3.0);
    /* the model named in a file is loaded */
    assert_int_equal(cfg_get_int(cfg, "num_experts", &v), SIM_OK);
    assert_int_equal(v, 16);
    assert_contains(cfg->model_file, "deepseek3-tiny.yml");
    cfg_free(cfg);

    /* argv form */
    const char *argv[] = {p2, "steps=9", "model_name=deepseek2-16b"};
    assert_int_equal(cfg_load_argv(NULL, 3, argv, &cfg), SIM_OK);
    assert_int_equal(cfg_get_int(cfg, "steps", &v), SIM_OK);
    assert_int_equal(v, 9);
    assert_int_equal(cfg_get_int(cfg, "num_experts", &v), SIM_OK);
    assert_int_equal(v, 64);
    cfg_free(cfg);

    /* a user file may name the base it was written for, and only that */
    char cwd[512], text[1200];
    assert_non_null(getcwd(cwd, sizeof cwd));
    snprintf(text, sizeof text, "base_config: %s/configs/base.yml\nsteps: 7\n", cwd);
    const char *f3 = write_tmp("child.yml", text);
    char p3[600];
    snprintf(p3, sizeof p3, "%s", f3);
    const char *files3[] = {p3};
    cfg_args a3 = {NULL, NULL, files3, 1, NULL, 0};
    if (cfg_load(&a3, &cfg) != SIM_OK) fail_msg("%s", sim_errmsg());
    cfg_free(cfg);
    const char *f4 = write_tmp("child2.yml", "base_config: one.yml\nsteps: 7\n");
    const char *files4[] = {f4};
    const char *msg = load_err(NULL, files4, 1, 0, NULL);
    assert_contains(msg, "base_config");
}

static void test_base_config_chain(void **state)
{
    (void)state;
    write_tmp("parent.yml", "alpha: 1\nbeta: [x, y]\nlogical_axis_rules: [[a, x]]\nmesh_axes: [x]\n");
    const char *child = write_tmp("child_base.yml", "base_config: parent.yml\nbeta: [z]\ngamma: 3.5\n");
    char cpath[600];
    snprintf(cpath, sizeof cpath, "%s", child);
    cfg_config *cfg = load_ok(cpath, NULL, 0, NULL);
    assert_int_equal(cfg->n, 5);
    assert_string_equal(cfg->entries[0].key, "alpha");
    assert_string_equal(cfg->entries[4].key, "gamma");
    const cfg_value *beta = val(cfg, "beta");
    assert_int_equal(beta->n, 1);
    assert_string_equal(beta->items[0].text, "z");
    assert_contains(cfg_find(cfg, "alpha")->where, "parent.yml:1");
    assert_contains(cfg_find(cfg, "gamma")->where, "child_base.yml:3");
    cfg_free(cfg);
    const char *loop = write_tmp("loop.yml", "base_config: loop.yml\na: 1\n");
    char lpath[600];
    snprintf(lpath, sizeof lpath, "%s", loop);
    cfg_args a = {lpath, NULL, NULL, 0, NULL, 0};
    assert_int_equal(cfg_load(&a, &cfg), SIM_ERR_INPUT);
    assert_contains(sim_errmsg(), "loops");
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_base_loads),
        cmocka_unit_test(test_project_files_load),
        cmocka_unit_test(test_reference_files_load),
        cmocka_unit_test(test_project_agrees_with_maxtext),
        cmocka_unit_test(test_legacy_rules),
        cmocka_unit_test(test_model_rules_merge_by_name),
        cmocka_unit_test(test_model_and_user_conflict),
        cmocka_unit_test(test_custom_replaces),
        cmocka_unit_test(test_unknown_keys),
        cmocka_unit_test(test_malformed_values),
        cmocka_unit_test(test_extra_files_and_order),
        cmocka_unit_test(test_base_config_chain),
    };
    int rc = cmocka_run_group_tests(tests, NULL, NULL);
    if (tmpdir[0]) {
        char cmd[400];
        snprintf(cmd, sizeof cmd, "rm -rf '%s'", tmpdir);
        if (system(cmd) != 0) fprintf(stderr, "could not remove %s\n", tmpdir);
    }
    return rc;
}
