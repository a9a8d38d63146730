/* test_cli_keys.c — the key contract (configs/keys.yml), key by key.
 *
 * Every key shardsim knows is set, one at a time, to a valid non-default value
 * on a tiny model trained for two steps in-process, and must pass the check of
 * its class:
 *   refused  -> the config is rejected (exit code 2) with a message naming the key;
 *   inert    -> accepted, marked for run.json's inert_keys_set, and the losses,
 *               gradient norms, learning rates, parameter count, shardings, peak
 *               memory and collective bytes are bitwise those of the baseline;
 *   honoured -> accepted and one of those observables changes, or
 *               tests/data/keys_check.yml names the key's effect.
 * The value is keys_check.yml's when it gives one, else derived from the key's
 * type and default (a bool flipped, a number moved, a choice other than the
 * default).  Then: run.json lists inert keys with their reason, unknown keys get
 * a suggestion from all MaxText keys, MaxText's own base.yml, model and
 * custom mesh-and-rule files load unmodified, and every class is counted. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cli/cli.h"
#include "cli/common.h"
#include "cli/report.h"
#include "mesh/config.h"
#include "mesh/json.h"
#include "models/train.h"
#include "tests/cli_capture.h"

#define MAX_WORDS 64

/* A tiny Llama and a tiny DeepSeek (MLA + MoE), two steps on one device. */
static const char *const LLAMA[] = {"base_num_decoder_layers=2", "base_emb_dim=16", "base_num_query_heads=2",
                                    "base_num_kv_heads=2",       "head_dim=8",      "base_mlp_dim=32",
                                    "vocab_size=64",             "max_target_length=16", "per_device_batch_size=1",
                                    "steps=2"};
static const char *const DEEPSEEK[] = {"model_name=deepseek3-tiny", "override_model_config=true",
                                       "base_num_decoder_layers=2", "first_num_dense_layers=1",
                                       "vocab_size=64",             "max_target_length=16",
                                       "per_device_batch_size=1",   "steps=2"};

typedef struct {
    int rc;                /* 0 ran, 2 rejected */
    char err[1024];        /* the message when rejected */
    double loss[3], gnorm[3], lr[3];
    uint64_t param_bytes;
    int nparams, ndev;
    char specs[16384];     /* every parameter's PartitionSpec */
    size_t peak;
    uint64_t bytes_sent;   /* all collectives, all devices */
    uint64_t n_records;
} fingerprint;

/* ---- the tiny run -------------------------------------------------------- */

static sim_status train_tiny(const mesh_cfg *cfg, fingerprint *fp)
{
    model_def def;
    SIM_TRY(model_def_from_config(cfg, &def));
    model_data data;
    memset(&data, 0, sizeof data);
    data.fd = -1;
    model_train_job job;
    memset(&job, 0, sizeof job);
    sim_machine *m = NULL;
    long long steps = 0;
    double hbm = 0;
    sim_status st = mesh_cfg_get_int(cfg, "steps", &steps);
    if (!st) st = mesh_cfg_get_double(cfg, "hbm_limit_gb", &hbm);
    if (!st && (steps < 1 || steps > 3)) steps = 2; /* the tiny runs: 2 steps, or 3 where set */
    if (!st) st = model_optim_from_config(cfg, &job.opt);
    if (!st) st = model_data_from_config(cfg, &data);
    if (!st) st = model_machine_new(&def, hbm, false, &m);
    model_step_stats stats[3];
    memset(stats, 0, sizeof stats);
    if (!st) {
        job.def = &def;
        job.data = &data;
        job.steps = def.d.dry_run ? 1 : steps;
        job.stats = stats;
        st = model_train(&job, m);
    }
    if (!st) {
        for (int s = 0; s < 3; s++) {
            fp->loss[s] = stats[s].loss;
            fp->gnorm[s] = stats[s].grad_norm;
            fp->lr[s] = stats[s].lr;
            if (stats[s].peak_bytes > fp->peak) fp->peak = stats[s].peak_bytes;
        }
        fp->param_bytes = model_param_bytes(&def);
        fp->nparams = def.nparams;
        fp->ndev = def.mesh.num_devices;
        size_t n = 0;
        for (int i = 0; i < def.nparams && n + 600 < sizeof fp->specs; i++) {
            n += (size_t)snprintf(fp->specs + n, sizeof fp->specs - n, "%s:", def.defs[i].path);
            n += (size_t)mesh_spec_format(&def.spec[i], &def.mesh, fp->specs + n, (int)(sizeof fp->specs - n));
            n += (size_t)snprintf(fp->specs + n, sizeof fp->specs - n, "|");
        }
        cli_records recs;
        cli_records_from_machine(m, &recs);
        for (int d = 0; d < recs.n_devices; d++)
            for (size_t r = 0; r < recs.n[d]; r++) {
                fp->bytes_sent += recs.recs[d][r].bytes_sent;
                fp->n_records++;
            }
    }
    sim_machine_free(m);
    model_data_close(&data);
    model_def_free(&def);
    return st;
}

/* Loads base words + extra, trains; cfg_out (optional) keeps the config. */
static fingerprint run_fp(const char *const *base, int n_base, const char *const *extra, int n_extra,
                          mesh_cfg **cfg_out)
{
    fingerprint fp;
    memset(&fp, 0, sizeof fp);
    const char *words[MAX_WORDS];
    int n = 0;
    for (int i = 0; i < n_base; i++) words[n++] = base[i];
    for (int i = 0; i < n_extra; i++) words[n++] = extra[i];
    mesh_cfg *cfg = NULL;
    sim_status st = mesh_cfg_load_argv(cli_base_config(), n, words, &cfg);
    if (!st) st = train_tiny(cfg, &fp);
    if (st) {
        fp.rc = sim_status_exit_code(st);
        snprintf(fp.err, sizeof fp.err, "%s", sim_errmsg());
        sim_err_clear();
    }
    if (cfg_out) *cfg_out = cfg;
    else mesh_cfg_free(cfg);
    return fp;
}

static int same_results(const fingerprint *a, const fingerprint *b)
{
    for (int s = 0; s < 3; s++)
        if (memcmp(&a->loss[s], &b->loss[s], sizeof(double)) || memcmp(&a->gnorm[s], &b->gnorm[s], sizeof(double)) ||
            memcmp(&a->lr[s], &b->lr[s], sizeof(double)))
            return 0;
    return a->param_bytes == b->param_bytes && a->nparams == b->nparams && a->ndev == b->ndev &&
           !strcmp(a->specs, b->specs) && a->peak == b->peak && a->bytes_sent == b->bytes_sent &&
           a->n_records == b->n_records;
}

/* ---- the value to set ------------------------------------------------------ */

/* A valid non-default value for a key from its keys.yml line, as key=value. */
static void auto_value(const mesh_cfg_entry *e, char *buf, size_t cap)
{
    const mesh_cfg_value *sim = mesh_cfg_entry_field(e, "simulated");
    const mesh_cfg_value *choices = mesh_cfg_entry_field(e, "choices");
    const mesh_cfg_value *pick = sim ? sim : choices;
    if (pick && pick->kind == MESH_CFG_LIST) {
        /* MaxText's choices list honoured keys' refused values too; the first one
         * that differs from the default */
        for (int i = 0; i < pick->n; i++)
            if (!mesh_cfg_value_equal(&pick->items[i], &e->value)) {
                char *t = mesh_cfg_value_to_text(&pick->items[i], 0);
                snprintf(buf, cap, "%s=%s", e->key, t);
                free(t);
                return;
            }
    }
    const mesh_cfg_value *tv = mesh_cfg_entry_field(e, "type");
    const char *type = tv ? tv->text : "any";
    const mesh_cfg_value *v = &e->value;
    int is_null = v->kind == MESH_CFG_SCALAR && mesh_cfg_scalar_type(v) == MESH_CFG_NULL;
    long long i;
    double d;
    int b;
    if (!strcmp(type, "bool")) {
        if (is_null || mesh_cfg_value_bool(v, e->key, &b) != SIM_OK) b = 0;
        snprintf(buf, cap, "%s=%s", e->key, b ? "false" : "true");
    } else if (!strcmp(type, "int")) {
        if (is_null || mesh_cfg_value_int(v, e->key, &i) != SIM_OK) i = 0;
        snprintf(buf, cap, "%s=%lld", e->key, i < 0 ? 2 : i + 1);
    } else if (!strcmp(type, "float")) {
        if (is_null || mesh_cfg_value_double(v, e->key, &d) != SIM_OK) d = 0;
        snprintf(buf, cap, "%s=%.17g", e->key, d == 0 ? 0.5 : d < 0 ? 0.5 : d * 1.5);
    } else if (!strcmp(type, "list")) {
        snprintf(buf, cap, "%s=['x']", e->key);
    } else if (!strcmp(type, "map")) {
        snprintf(buf, cap, "%s={x: 1}", e->key);
    } else {
        snprintf(buf, cap, "%s=shardsim_test_value", e->key);
    }
    sim_err_clear();
}

/* tests/data/keys_check.yml */
static mesh_cfg *check_data(void)
{
    static mesh_cfg *data;
    if (!data) {
        char path[4200];
        snprintf(path, sizeof path, "%s/../tests/data/keys_check.yml", cli_configs_dir());
        if (mesh_cfg_load_file(path, &data) != SIM_OK) fail_msg("%s", sim_errmsg());
    }
    return data;
}

static const mesh_cfg_value *check_line(const char *key)
{
    const mesh_cfg_entry *k = mesh_cfg_find(check_data(), "keys");
    if (!k || k->value.kind != MESH_CFG_MAP) fail_msg("keys_check.yml: no top-level `keys:` map");
    for (int i = 0; i < k->value.n; i++)
        if (!strcmp(k->value.keys[i], key)) return &k->value.items[i];
    return NULL;
}

static const char *line_field(const mesh_cfg_value *line, const char *field)
{
    for (int i = 0; line && line->kind == MESH_CFG_MAP && i < line->n; i++)
        if (!strcmp(line->keys[i], field)) {
            if (line->items[i].kind == MESH_CFG_SCALAR) return line->items[i].text;
            return NULL;
        }
    return NULL;
}

/* ---- every key ------------------------------------------------------------- */

static void test_every_key_passes_its_class_check(void **state)
{
    (void)state;
    mesh_cfg *cfg = NULL;
    if (mesh_cfg_load_argv(cli_base_config(), 0, NULL, &cfg) != SIM_OK) fail_msg("%s", sim_errmsg());
    assert_non_null(cfg->keys_file);
    fingerprint base_l = run_fp(LLAMA, 10, NULL, 0, NULL), base_d = run_fp(DEEPSEEK, 8, NULL, 0, NULL);
    if (base_l.rc || base_d.rc) fail_msg("baseline failed: %s%s", base_l.err, base_d.err);
    int failures = 0, counted[4] = {0}, named = 0;
    for (int k = 0; k < cfg->n; k++) {
        const mesh_cfg_entry *e = &cfg->entries[k];
        const mesh_cfg_value *line = check_line(e->key);
        const char *given = line_field(line, "value"), *effect = line_field(line, "effect");
        const char *on = line_field(line, "base");
        int deepseek = on && !strcmp(on, "deepseek");
        const char *with = line_field(line, "with");
        char word[600];
        if (given) snprintf(word, sizeof word, "%s=%s", e->key, given);
        else auto_value(e, word, sizeof word);
        /* `with`: words added to both runs (a key whose effect needs another setting) */
        char withbuf[600];
        const char *extra[8];
        int n_extra = 0;
        snprintf(withbuf, sizeof withbuf, "%s", with ? with : "");
        for (char *tok = strtok(withbuf, " "); tok && n_extra < 6; tok = strtok(NULL, " ")) extra[n_extra++] = tok;
        const char *const *bw = deepseek ? DEEPSEEK : LLAMA;
        int nbw = deepseek ? 8 : 10;
        fingerprint base_with;
        const fingerprint *base = deepseek ? &base_d : &base_l;
        if (n_extra) {
            base_with = run_fp(bw, nbw, extra, n_extra, NULL);
            if (base_with.rc) {
                print_message("%s: the baseline with '%s' fails: %s\n", e->key, with, base_with.err);
                failures++;
                continue;
            }
            base = &base_with;
        }
        extra[n_extra++] = word;
        mesh_cfg *got = NULL;
        fingerprint fp = run_fp(bw, nbw, extra, n_extra, &got);
        const mesh_cfg_entry *ge = got ? mesh_cfg_find(got, e->key) : NULL;
        const char *fail = NULL;
        switch (e->cls) {
        case MESH_KEY_REFUSED:
            if (fp.rc != 2) fail = "refused key accepted";
            else if (!strstr(fp.err, e->key)) fail = "refusal does not name the key";
            break;
        case MESH_KEY_INERT:
            if (fp.rc) fail = "inert key rejected";
            else if (!ge || !ge->changed) fail = "inert key not marked as set (run.json would not list it)";
            else if (!same_results(&fp, base)) fail = "inert key changed the results";
            break;
        case MESH_KEY_HONOURED:
            /* exit code 1 (a check failed: simulated OOM) is an observable change */
            if (fp.rc == 2 && !(effect && line_field(line, "rejects"))) fail = "honoured key rejected";
            else if (effect) named++;
            else if (fp.rc == 0 && same_results(&fp, base))
                fail = "honoured key changed nothing observable and keys_check.yml names no effect";
            break;
        default: fail = "key without a class";
        }
        counted[e->cls]++;
        if (fail) {
            failures++;
            print_message("%-40s %-8s %s: %s%s%s\n", word, mesh_key_class_name(e->cls), fail, fp.err,
                          fp.rc ? "" : "", "");
        }
        mesh_cfg_free(got);
    }
    print_message("%d keys: %d honoured (%d by a named effect), %d inert, %d refused\n", cfg->n,
                  counted[MESH_KEY_HONOURED], named, counted[MESH_KEY_INERT], counted[MESH_KEY_REFUSED]);
    mesh_cfg_free(cfg);
    if (failures) fail_msg("%d keys fail their class check (listed above)", failures);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_every_key_passes_its_class_check),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
