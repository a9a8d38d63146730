/* test_cli_keys.c — the key contract (configs/keys.yml), key by key.
 *
 * Every key shardsim knows is set, one at a time, to a valid non-default value
 * on a tiny model trained for two steps in-process, and must pass the check of
 * its class:
 *   refused  -> the config is rejected (exit code 2) with a message naming the key;
 *   inert    -> accepted, marked for run.json's inert_keys_set, and the losses,
 *               gradient norms, learning rates, parameter count, shardings, peak
 *               memory, collective bytes and the step time the time model gives
 *               the run on a v5p profile are bitwise those of the baseline;
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
#include <sys/wait.h>
#include <unistd.h>

#include "cli/artifacts.h"
#include "cli/cli.h"
#include "cli/common.h"
#include "cli/report.h"
#include "config/config.h"
#include "config/json.h"
#include "models/core/pipeline.h"
#include "models/core/timemodel.h"
#include "models/core/train.h"
#include "tests/cli_capture.h"
#include "tests/helpers.h"

#define MAX_WORDS 64

/* A tiny Llama and a tiny DeepSeek (MLA + MoE), two steps on one device. */
/* tests/data/tiny-llama-mha.yml, one row per device, two steps */
static const char *const LLAMA[] = {TINY_LLAMA_MHA_YML, "per_device_batch_size=1", "steps=2"};
static const char *const DEEPSEEK[] = {"model_name=deepseek3-tiny",
                                       "override_model_config=true",
                                       "base_num_decoder_layers=2",
                                       "first_num_dense_layers=1",
                                       "vocab_size=64",
                                       "max_target_length=16",
                                       "per_device_batch_size=1",
                                       "steps=2"};
enum { NLLAMA = sizeof LLAMA / sizeof LLAMA[0], NDEEPSEEK = sizeof DEEPSEEK / sizeof DEEPSEEK[0] };

typedef struct {
    int rc;         /* 0 ran, 2 rejected */
    char err[1024]; /* the message when rejected */
    double loss[3], gnorm[3], lr[3];
    uint64_t param_bytes;
    int nparams, ndev;
    char specs[16384]; /* every parameter's PartitionSpec */
    size_t peak;
    uint64_t bytes_sent; /* all collectives, all devices */
    uint64_t n_records;
    double step_s; /* the step-time model's figure of the last step on v5p (-1: not estimated) */
} fingerprint;

/* ---- the tiny run -------------------------------------------------------- */

/* The modelled step time of step `step` on a v5p profile, whatever profile the
 * config names: a key that only moves this figure (a kernel choice, a tile) is
 * not inert.  -1 when the model cannot time the run. */
static double tiny_step_time(const cfg_config *cfg, const model_def *def, sim_machine *m, int step)
{
    cfg_hw hw;
    model_tm_eff eff;
    model_tm_result tm;
    memset(&tm, 0, sizeof tm);
    const cfg_entry *dt = cfg_find(cfg, "dtype");
    const char *dtype = dt && dt->value.kind == CFG_SCALAR && *dt->value.text ? dt->value.text : "float32";
    double bubble = def->d.pipe.on ? model_pipe_bubble_fraction(&def->d.pipe) : 0.0;
    if (cfg_hw_load(cli_configs_dir(), "v5p", def->mesh.num_devices, &hw) != SIM_OK ||
        model_tm_eff_load(cli_configs_dir(), &eff) != SIM_OK ||
        model_tm_estimate(&hw, &eff, dtype, m, step, bubble, model_opt_step_bytes(def), false, &tm) != SIM_OK) {
        sim_err_clear();
        return -1;
    }
    return tm.step_s;
}

static sim_status train_tiny(const cfg_config *cfg, fingerprint *fp)
{
    model_def def;
    sim_status st0 = model_def_from_config(cfg, &def);
    if (st0) {
        model_def_free(&def); /* what it built before failing (the rules) */
        return st0;
    }
    model_data data;
    memset(&data, 0, sizeof data);
    data.fd = -1;
    model_train_job job;
    memset(&job, 0, sizeof job);
    sim_machine *m = NULL;
    long long steps = 0;
    double hbm = 0;
    sim_status st = cfg_get_int(cfg, "steps", &steps);
    if (!st) st = cfg_get_double(cfg, "hbm_limit_gb", &hbm);
    if (!st && (steps < 1 || steps > 3)) steps = 2; /* the tiny runs: 2 steps, or 3 where set */
    if (!st) st = model_optim_from_config(cfg, &job.opt);
    if (!st) st = model_data_from_config(cfg, &data);
    if (!st) st = model_machine_new(&def, hbm, false, &m);
    if (!st) sim_machine_set_record_costs(m, true); /* for the step-time figure */
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
            fp->gnorm[s] = stats[s].raw_grad_norm; /* before clipping: the clipped one is often the threshold */
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
        fp->step_s = tiny_step_time(cfg, &def, m, (int)job.steps - 1);
    }
    sim_machine_free(m);
    model_data_close(&data);
    model_def_free(&def);
    return st;
}

/* Loads base words + extra, trains; cfg_out (optional) keeps the config. */
static fingerprint run_fp(const char *const *base, int n_base, const char *const *extra, int n_extra,
                          cfg_config **cfg_out)
{
    fingerprint fp;
    memset(&fp, 0, sizeof fp);
    const char *words[MAX_WORDS];
    int n = 0;
    for (int i = 0; i < n_base; i++) words[n++] = base[i];
    for (int i = 0; i < n_extra; i++) words[n++] = extra[i];
    cfg_config *cfg = NULL;
    sim_status st = cfg_load_argv(cli_base_config(), n, words, &cfg);
    if (!st) st = train_tiny(cfg, &fp);
    if (st) {
        fp.rc = sim_status_exit_code(st);
        snprintf(fp.err, sizeof fp.err, "%s", sim_errmsg());
        sim_err_clear();
    }
    if (cfg_out) *cfg_out = cfg;
    else cfg_free(cfg);
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
           a->n_records == b->n_records && !memcmp(&a->step_s, &b->step_s, sizeof(double));
}

/* ---- the value to set ------------------------------------------------------ */

/* A valid non-default value for a key from its keys.yml line, as key=value. */
static void auto_value(const cfg_entry *e, char *buf, size_t cap)
{
    const cfg_value *sim = cfg_entry_field(e, "simulated");
    const cfg_value *choices = cfg_entry_field(e, "choices");
    const cfg_value *pick = sim ? sim : choices;
    if (pick && pick->kind == CFG_LIST) {
        /* MaxText's choices list honoured keys' refused values too; the first one
         * that differs from the default */
        for (int i = 0; i < pick->n; i++)
            if (!cfg_value_equal(&pick->items[i], &e->value)) {
                char *t = cfg_value_to_text(&pick->items[i], 0);
                snprintf(buf, cap, "%s=%s", e->key, t);
                free(t);
                return;
            }
    }
    const cfg_value *tv = cfg_entry_field(e, "type");
    const char *type = tv ? tv->text : "any";
    const cfg_value *v = &e->value;
    int is_null = v->kind == CFG_SCALAR && cfg_scalar_type(v) == CFG_NULL;
    long long i;
    double d;
    int b;
    if (!strcmp(type, "bool")) {
        if (is_null || cfg_value_bool(v, e->key, &b) != SIM_OK) b = 0;
        snprintf(buf, cap, "%s=%s", e->key, b ? "false" : "true");
    } else if (!strcmp(type, "int")) {
        if (is_null || cfg_value_int(v, e->key, &i) != SIM_OK) i = 0;
        snprintf(buf, cap, "%s=%lld", e->key, i < 0 ? 2 : i + 1);
    } else if (!strcmp(type, "float")) {
        if (is_null || cfg_value_double(v, e->key, &d) != SIM_OK) d = 0;
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
static cfg_config *check_data(void)
{
    static cfg_config *data;
    if (!data) {
        char path[4200];
        snprintf(path, sizeof path, "%s/../tests/data/keys_check.yml", cli_configs_dir());
        if (cfg_load_file(path, &data) != SIM_OK) fail_msg("%s", sim_errmsg());
    }
    return data;
}

static const cfg_value *check_line(const char *key)
{
    const cfg_entry *k = cfg_find(check_data(), "keys");
    if (!k || k->value.kind != CFG_MAP) fail_msg("keys_check.yml: no top-level `keys:` map");
    for (int i = 0; i < k->value.n; i++)
        if (!strcmp(k->value.keys[i], key)) return &k->value.items[i];
    return NULL;
}

static const char *line_field(const cfg_value *line, const char *field)
{
    for (int i = 0; line && line->kind == CFG_MAP && i < line->n; i++)
        if (!strcmp(line->keys[i], field)) {
            if (line->items[i].kind == CFG_SCALAR) return line->items[i].text;
            return NULL;
        }
    return NULL;
}

/* ---- every key ------------------------------------------------------------- */

static void test_every_key_passes_its_class_check(void **state)
{
    (void)state;
    cfg_config *cfg = NULL;
    if (cfg_load_argv(cli_base_config(), 0, NULL, &cfg) != SIM_OK) fail_msg("%s", sim_errmsg());
    assert_non_null(cfg->keys_file);
    fingerprint base_l = run_fp(LLAMA, NLLAMA, NULL, 0, NULL), base_d = run_fp(DEEPSEEK, NDEEPSEEK, NULL, 0, NULL);
    if (base_l.rc || base_d.rc) fail_msg("baseline failed: %s%s", base_l.err, base_d.err);
    int failures = 0, counted[4] = {0}, named = 0;
    for (int k = 0; k < cfg->n; k++) {
        const cfg_entry *e = &cfg->entries[k];
        const cfg_value *line = check_line(e->key);
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
        int nbw = deepseek ? NDEEPSEEK : NLLAMA;
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
        int n_extra_with = n_extra;
        extra[n_extra++] = word;
        cfg_config *got = NULL;
        fingerprint fp = run_fp(bw, nbw, extra, n_extra, &got);
        const cfg_entry *ge = got ? cfg_find(got, e->key) : NULL;
        const char *fail = NULL;
        switch (e->cls) {
        case CFG_KEY_REFUSED:
            if (fp.rc != 2) fail = "refused key accepted";
            else if (!strstr(fp.err, e->key)) fail = "refusal does not name the key";
            break;
        case CFG_KEY_INERT:
            /* `combination`: MaxText rejects every other value with the simulated decoders
             * (configs/combinations.yml): exit 2 naming the key and MaxText's rule */
            if (line_field(line, "combination")) {
                if (fp.rc != 2) fail = "MaxText's combination rule not applied";
                else if (!strstr(fp.err, e->key) || !strstr(fp.err, "MaxText 0.2.5 rejects this combination"))
                    fail = "the combination refusal does not name the key and MaxText's rule";
                break;
            }
            if (fp.rc) fail = "inert key rejected";
            else if (!ge || !ge->changed) fail = "inert key not marked as set (run.json would not list it)";
            else if (!same_results(&fp, base)) fail = "inert key changed the results";
            else if (!n_extra_with && !on) {
                /* and on the other model: a MoE or MLA key does nothing to the Llama */
                const fingerprint *other = deepseek ? &base_l : &base_d;
                fingerprint fo =
                    run_fp(deepseek ? LLAMA : DEEPSEEK, deepseek ? NLLAMA : NDEEPSEEK, extra, n_extra, NULL);
                if (fo.rc) fail = "inert key rejected on the other model";
                else if (!same_results(&fo, other)) fail = "inert key changed the results of the other model";
            }
            break;
        case CFG_KEY_HONOURED:
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
            print_message("%-40s %-8s %s: %s%s%s\n", word, cfg_key_class_name(e->cls), fail, fp.err, fp.rc ? "" : "",
                          "");
        }
        cfg_free(got);
    }
    print_message("%d keys: %d honoured (%d by a named effect), %d inert, %d refused\n", cfg->n,
                  counted[CFG_KEY_HONOURED], named, counted[CFG_KEY_INERT], counted[CFG_KEY_REFUSED]);
    cfg_free(cfg);
    if (failures) fail_msg("%d keys fail their class check (listed above)", failures);
}

/* ---- run.json, messages, MaxText habits ------------------------------------ */

/* tests/data/tiny-llama-mha.yml with one layer, one row per device */
#define TINY TINY_LLAMA_MHA_YML, "base_num_decoder_layers=1", "per_device_batch_size=1"

static void test_run_json_lists_inert_keys_set(void **state)
{
    (void)state;
    char dir[] = "/tmp/shardsim_keys_XXXXXX";
    assert_non_null(mkdtemp(dir));
    char od[300];
    snprintf(od, sizeof od, "output_dir=%s", dir);
    /* two inert keys set, one inert key given at its default (not listed) */
    const char *argv[] = {
        TINY, "steps=1", "profiler=xplane", "enable_goodput_recording=true", "jax_cache_dir=~/jax_cache", od};
    cli_capture r = cli_capture_run(cli_train, (int)(sizeof argv / sizeof argv[0]), argv);
    if (r.rc) fail_msg("train failed: %s", r.err);
    cli_capture_free(&r);
    cfg_json *run = helper_read_json(dir, "run.json");
    const cfg_json *inert = cfg_json_get(run, "inert_keys_set");
    assert_non_null(inert);
    assert_int_equal(inert->n, 2);
    const cfg_json *p = cfg_json_get(inert, "profiler");
    assert_non_null(p);
    assert_string_equal(cfg_json_get(p, "value")->str, "xplane");
    assert_string_equal(cfg_json_get(p, "source")->str, "command line");
    assert_non_null(strstr(cfg_json_get(p, "why")->str, "profiler"));
    assert_non_null(cfg_json_get(inert, "enable_goodput_recording"));
    assert_null(cfg_json_get(inert, "jax_cache_dir"));
    cfg_json_free(run);
    helper_rm_rf(dir);
}

static void test_unknown_and_refused_keys(void **state)
{
    (void)state;
    /* a typo: the suggestion comes from all keys, MaxText's included */
    const char *a1[] = {TINY, "profiler_step=3"};
    cli_capture r = cli_capture_run(cli_train, (int)(sizeof a1 / sizeof a1[0]), a1);
    assert_int_equal(r.rc, 2);
    assert_non_null(strstr(r.err, "unknown key 'profiler_step'"));
    assert_non_null(strstr(r.err, "did you mean 'profiler_steps'?"));
    cli_capture_free(&r);
    /* a MaxText key shardsim refuses: it says so, with no neighbour suggested */
    const char *a2[] = {TINY, "use_dpo=true"};
    r = cli_capture_run(cli_train, (int)(sizeof a2 / sizeof a2[0]), a2);
    assert_int_equal(r.rc, 2);
    assert_non_null(strstr(r.err, "use_dpo=true is refused"));
    assert_non_null(strstr(r.err, "DPO"));
    assert_null(strstr(r.err, "did you mean"));
    cli_capture_free(&r);
    /* a value MaxText itself does not accept */
    const char *a3[] = {TINY, "profiler=perfetto"};
    r = cli_capture_run(cli_train, (int)(sizeof a3 / sizeof a3[0]), a3);
    assert_int_equal(r.rc, 2);
    assert_non_null(strstr(r.err, "profiler=perfetto is not a value MaxText accepts"));
    cli_capture_free(&r);
    /* a value of an honoured key outside what is simulated */
    const char *a4[] = {TINY, "weight_dtype=float16"};
    r = cli_capture_run(cli_train, (int)(sizeof a4 / sizeof a4[0]), a4);
    assert_int_equal(r.rc, 2);
    assert_non_null(strstr(r.err, "weight_dtype=float16 is refused"));
    cli_capture_free(&r);
    /* MaxText's type: an int key given a fraction */
    const char *a5[] = {TINY, "steps=1.5"};
    r = cli_capture_run(cli_train, (int)(sizeof a5 / sizeof a5[0]), a5);
    assert_int_equal(r.rc, 2);
    assert_non_null(strstr(r.err, "steps"));
    cli_capture_free(&r);
}

static void test_maxtext_outputs(void **state)
{
    (void)state;
    char dir[] = "/tmp/shardsim_keys_XXXXXX";
    assert_non_null(mkdtemp(dir));
    char bo[300], mf[300];
    snprintf(bo, sizeof bo, "base_output_directory=%s", dir);
    snprintf(mf, sizeof mf, "metrics_file=%s/m.jsonl", dir);
    const char *argv[] = {TINY, "steps=3", bo, "run_name=r7", mf, "checkpoint_period=2"};
    cli_capture r = cli_capture_run(cli_train, (int)(sizeof argv / sizeof argv[0]), argv);
    if (r.rc) fail_msg("train failed: %s", r.err);
    cli_capture_free(&r);
    /* MaxText's layout: base_output_directory/run_name, checkpoints/ under it
     * (enable_checkpointing defaults to true) */
    char p[700];
    snprintf(p, sizeof p, "%s/r7/run.json", dir);
    assert_int_equal(access(p, R_OK), 0);
    snprintf(p, sizeof p, "%s/r7/checkpoints/step_2.safetensors", dir);
    assert_int_equal(access(p, R_OK), 0);
    /* metrics_file: one JSON object per step with MaxText's names */
    snprintf(p, sizeof p, "%s/m.jsonl", dir);
    FILE *f = fopen(p, "r");
    assert_non_null(f);
    char line[2048];
    int n = 0;
    while (fgets(line, sizeof line, f)) {
        cfg_json *j = NULL;
        if (cfg_json_parse(line, strlen(line), "metrics_file", &j) != SIM_OK)
            fail_msg("metrics line %d: %s", n, sim_errmsg());
        assert_true(cfg_json_get(j, "step")->number == (double)n);
        assert_string_equal(cfg_json_get(j, "run_name")->str, "r7");
        double loss = cfg_json_get(j, "learning/loss")->number;
        assert_true(loss > 0 && isfinite(loss));
        assert_non_null(cfg_json_get(j, "learning/grad_norm"));
        assert_non_null(cfg_json_get(j, "learning/raw_grad_norm"));
        cfg_json_free(j);
        n++;
    }
    fclose(f);
    assert_int_equal(n, 3);
    helper_rm_rf(dir);
    /* enable_checkpointing=false writes none; with checkpoint_dir it is a contradiction */
    assert_non_null(mkdtemp(strcpy(dir, "/tmp/shardsim_keys_XXXXXX")));
    snprintf(bo, sizeof bo, "base_output_directory=%s", dir);
    const char *a2[] = {TINY, "steps=2", bo, "run_name=r8", "checkpoint_period=1", "enable_checkpointing=false"};
    r = cli_capture_run(cli_train, (int)(sizeof a2 / sizeof a2[0]), a2);
    if (r.rc) fail_msg("train failed: %s", r.err);
    cli_capture_free(&r);
    snprintf(p, sizeof p, "%s/r8/checkpoints", dir);
    assert_int_not_equal(access(p, F_OK), 0);
    const char *a3[] = {TINY, "steps=1", "checkpoint_dir=/tmp/x", "enable_checkpointing=false"};
    r = cli_capture_run(cli_train, (int)(sizeof a3 / sizeof a3[0]), a3);
    assert_int_equal(r.rc, 2);
    assert_non_null(strstr(r.err, "enable_checkpointing=false"));
    cli_capture_free(&r);
    /* metrics_file on a dry run: no losses to write, said so */
    const char *a4[] = {TINY, "dry_run=true", "metrics_file=/tmp/never.jsonl"};
    r = cli_capture_run(cli_train, (int)(sizeof a4 / sizeof a4[0]), a4);
    assert_int_equal(r.rc, 2);
    assert_non_null(strstr(r.err, "metrics_file"));
    cli_capture_free(&r);
    helper_rm_rf(dir);
}

static void test_compile_topology(void **state)
{
    (void)state;
    /* v5p-8 has 4 devices per slice (MaxText's table): 2 slices -> 8 devices, a dry run */
    const char *w1[] = {TINY, "compile_topology=v5p-8", "compile_topology_num_slices=2"};
    cfg_config *cfg = NULL;
    if (cfg_load_argv(cli_base_config(), (int)(sizeof w1 / sizeof w1[0]), w1, &cfg) != SIM_OK)
        fail_msg("%s", sim_errmsg());
    long long nd = 0, ns = 0;
    int dry = 0;
    assert_int_equal(cfg_get_int(cfg, "num_devices", &nd), SIM_OK);
    assert_int_equal(cfg_get_int(cfg, "num_slices", &ns), SIM_OK);
    assert_int_equal(cfg_get_bool(cfg, "dry_run", &dry), SIM_OK);
    assert_int_equal(nd, 8);
    assert_int_equal(ns, 2);
    assert_true(dry);
    cfg_free(cfg);
    /* a train_compile command line sizes the model */
    const char *w2[] = {TINY, "compile_topology=v5e-16", "compile_topology_num_slices=1", "ici_tensor_parallelism=2"};
    cli_capture r = cli_capture_run(cli_train, (int)(sizeof w2 / sizeof w2[0]), w2);
    if (r.rc) fail_msg("train failed: %s", r.err);
    assert_non_null(strstr(r.out, "fsdp=8 tensor=2"));
    cli_capture_free(&r);
    /* as MaxText's train_compile: the slice count must be given */
    const char *w3[] = {TINY, "compile_topology=v5p-8"};
    r = cli_capture_run(cli_train, (int)(sizeof w3 / sizeof w3[0]), w3);
    assert_int_equal(r.rc, 2);
    assert_non_null(strstr(r.err, "compile_topology_num_slices"));
    cli_capture_free(&r);
    const char *w4[] = {TINY, "compile_topology=v5p-9", "compile_topology_num_slices=1"};
    r = cli_capture_run(cli_train, (int)(sizeof w4 / sizeof w4[0]), w4);
    assert_int_equal(r.rc, 2);
    assert_non_null(strstr(r.err, "did you mean 'v5p-8'"));
    cli_capture_free(&r);
    const char *w5[] = {TINY, "compile_topology=v5p-8", "compile_topology_num_slices=1", "num_devices=8"};
    r = cli_capture_run(cli_train, (int)(sizeof w5 / sizeof w5[0]), w5);
    assert_int_equal(r.rc, 2);
    assert_non_null(strstr(r.err, "num_devices=8"));
    cli_capture_free(&r);
}

/* Bad input exits 2 naming its key: every dcn_*_parallelism key set to 2 with
 * one slice (MaxText 0.2.5: "DCN parallelism requested but only one slice
 * available"), the legacy keys outside mesh_axes included. */
static void test_dcn_with_one_slice(void **state)
{
    (void)state;
    cfg_config *cfg = NULL;
    const char *none[] = {TINY};
    if (cfg_load_argv(cli_base_config(), (int)(sizeof none / sizeof none[0]), none, &cfg) != SIM_OK)
        fail_msg("%s", sim_errmsg());
    int checked = 0;
    for (int i = 0; i < cfg->n; i++) {
        const char *key = cfg->entries[i].key;
        size_t n = strlen(key);
        if (strncmp(key, "dcn_", 4) != 0 || n < 12 || strcmp(key + n - 12, "_parallelism") != 0) continue;
        char word[128];
        snprintf(word, sizeof word, "%s=2", key);
        const char *w[] = {TINY, "dry_run=true", word};
        cli_capture r = cli_capture_run(cli_train, (int)(sizeof w / sizeof w[0]), w);
        if (r.rc != 2 || !strstr(r.err, word) || !strstr(r.err, "num_slices"))
            fail_msg("%s: rc %d, stderr: %s", word, r.rc, r.err);
        cli_capture_free(&r);
        checked++;
    }
    cfg_free(cfg);
    assert_true(checked >= 14);
}

/* MaxText's own files, unmodified, as arguments (copies in tests/data). */
static void test_maxtext_files_as_arguments(void **state)
{
    (void)state;
    char base[4200], model[4300], custom[4300], old[4200];
    snprintf(base, sizeof base, "%s/../tests/data/maxtext-0.2.5/configs/base.yml", cli_configs_dir());
    snprintf(model, sizeof model, "%s/../tests/data/maxtext-0.2.5/configs/models/llama2-7b.yml", cli_configs_dir());
    snprintf(custom, sizeof custom,
             "custom_mesh_and_rule=%s/../tests/data/maxtext-0.2.5/configs/custom_mesh_and_rule/ep-as-cp.yml",
             cli_configs_dir());
    snprintf(old, sizeof old, "%s/../tests/data/maxtext/configs/base.yml", cli_configs_dir());
    /* base.yml is MaxText's config file: the model file (found beside it) overrides it */
    const char *w1[] = {base,
                        "run_name=x",
                        "model_name=llama2-7b",
                        "dry_run=true",
                        "ici_fsdp_parallelism=8",
                        "per_device_batch_size=1"};
    cli_capture r = cli_capture_run(cli_train, 6, w1);
    if (r.rc) fail_msg("MaxText base.yml + model_name: %s", r.err);
    assert_non_null(strstr(r.out, "emb 4096, heads 32 (kv 32) x 128, mlp 11008, layers 32, vocab 32000"));
    cli_capture_free(&r);
    /* a model file and a custom mesh-and-rule file as arguments */
    const char *w2[] = {base,
                        model,
                        custom,
                        "run_name=x",
                        "dry_run=true",
                        "num_devices=8",
                        "ici_expert_parallelism=2",
                        "per_device_batch_size=1"};
    r = cli_capture_run(cli_train, 8, w2);
    if (r.rc) fail_msg("MaxText model + custom file: %s", r.err);
    assert_non_null(strstr(r.out, "expert=2"));
    cli_capture_free(&r);
    /* the older reference base.yml (e591f30c) uses dataset_type=tfds: refused, named */
    const char *w3[] = {old, "run_name=x", "dry_run=true"};
    r = cli_capture_run(cli_train, 3, w3);
    assert_int_equal(r.rc, 2);
    assert_non_null(strstr(r.err, "dataset_type=tfds is refused"));
    cli_capture_free(&r);
    const char *w4[] = {old, "run_name=x", "dry_run=true", "dataset_type=synthetic"};
    r = cli_capture_run(cli_train, 4, w4);
    if (r.rc) fail_msg("e591f30c base.yml: %s", r.err);
    cli_capture_free(&r);
}

static void test_keys_command(void **state)
{
    (void)state;
    const char *a1[] = {"ici_fsdp_parallelism"};
    cli_capture r = cli_capture_run(cli_keys, 1, a1);
    assert_int_equal(r.rc, 0);
    assert_non_null(strstr(r.out, "ici_fsdp_parallelism"));
    assert_non_null(strstr(r.out, "honoured"));
    assert_non_null(strstr(r.out, "1 key: 1 honoured, 0 inert, 0 refused"));
    cli_capture_free(&r);
    const char *a2[] = {"class=refused"};
    r = cli_capture_run(cli_keys, 1, a2);
    assert_int_equal(r.rc, 0);
    assert_non_null(strstr(r.out, "use_dpo"));
    assert_null(strstr(r.out, " inert "));
    cli_capture_free(&r);
    const char *a3[] = {"no_such_key_anywhere"};
    r = cli_capture_run(cli_keys, 1, a3);
    assert_int_equal(r.rc, 2);
    cli_capture_free(&r);
    /* every MaxText key of both base.yml files is known (the union: 789) */
    cfg_config *cfg = NULL, *mt = NULL, *old = NULL;
    char p1[4200], p2[4200];
    snprintf(p1, sizeof p1, "%s/../tests/data/maxtext-0.2.5/configs/base.yml", cli_configs_dir());
    snprintf(p2, sizeof p2, "%s/../tests/data/maxtext/configs/base.yml", cli_configs_dir());
    if (cfg_load_argv(cli_base_config(), 0, NULL, &cfg) || cfg_load_file(p1, &mt) || cfg_load_file(p2, &old))
        fail_msg("%s", sim_errmsg());
    int union_n = mt->n;
    for (int i = 0; i < mt->n; i++) assert_non_null(cfg_find(cfg, mt->entries[i].key));
    for (int i = 0; i < old->n; i++) {
        assert_non_null(cfg_find(cfg, old->entries[i].key));
        union_n += cfg_find(mt, old->entries[i].key) == NULL;
    }
    assert_int_equal(mt->n, 786);
    assert_int_equal(old->n, 696);
    assert_int_equal(union_n, 789);
    cfg_free(cfg);
    cfg_free(mt);
    cfg_free(old);
}

/* MaxText's combination checks (types.py), with its conditions. */
static void test_maxtext_combination_rules(void **state)
{
    (void)state;
    struct {
        const char *words[5];
        int n;
        const char *needle; /* NULL: accepted */
    } cases[] = {
        {{"num_experts=4"}, 1, "base_moe_mlp_dim > 0"},
        {{"model_name=deepseek3-tiny", "override_model_config=true", "first_num_dense_layers=0", "base_mlp_dim=32"},
         4,
         "fully MoE"},
        /* with a dense layer first, the widths may differ */
        {{"model_name=deepseek3-tiny", "override_model_config=true", "first_num_dense_layers=1", "base_mlp_dim=32"},
         4,
         NULL},
        {{"model_name=deepseek3-tiny", "override_model_config=true", "first_num_dense_layers=0", "base_mlp_dim=64"},
         4,
         NULL},
        {{"context_sharding=tensor"}, 1, "context_sharding=tensor"},
        {{"context_sharding=expert"}, 1, NULL},
        /* configs/combinations.yml, one line per rule (and an accepted neighbour where the condition is subtle) */
        {{"check_vma=true", "shard_mode=explicit"}, 2, "check_vma requires shard_mode='auto'"},
        {{"check_vma=true", "use_tokamax_gmm=true"}, 2, "check_vma is not yet supported with tokamax gmm kernel"},
        {{"check_vma=true", "ici_data_parallelism=2"}, 2, "check_vma=True only supports"},
        {{"check_vma=true", "ici_pipeline_parallelism=2"}, 2, "ici_pipeline_parallelism=2"},
        {{"check_vma=true", "ici_tensor_parallelism=2"}, 2, "ici_tensor_parallelism=2"},
        {{"check_vma=true", "ici_context_parallelism=2"}, 2, "ici_context_parallelism=2"},
        {{"check_vma=true", "ici_fsdp_transpose_parallelism=2"}, 2, "ici_fsdp_transpose_parallelism=2"},
        {{"check_vma=true", "ici_sequence_parallelism=2"}, 2, "ici_sequence_parallelism=2"},
        {{"check_vma=true", "ici_tensor_transpose_parallelism=2"}, 2, "ici_tensor_transpose_parallelism=2"},
        {{"check_vma=true", "ici_tensor_sequence_parallelism=2"}, 2, "ici_tensor_sequence_parallelism=2"},
        {{"check_vma=true", "ici_context_usp_ulysses_parallelism=2"}, 2, "ici_context_usp_ulysses_parallelism=2"},
        {{"check_vma=true", "ici_context_autoregressive_parallelism=2"}, 2, "ici_context_autoregressive_parallelism=2"},
        {{"check_vma=true", "ici_autoregressive_parallelism=2"}, 2, "ici_autoregressive_parallelism=2"},
        {{"check_vma=true", "ici_diloco_parallelism=2"}, 2, "ici_diloco_parallelism=2"},
        {{"check_vma=true", "ici_fsdp_parallelism=4", "ici_expert_parallelism=2"}, 3, NULL},
        {{"deepstack_visual_indexes_for_vit=[3]"},
         1,
         "Deepstack visual embedding injection requires scan_layers=False"},
        {{"deepstack_visual_indexes_for_vit=[3]", "scan_layers=false"}, 2, NULL},
        {{"distill_beta=0.5", "scan_layers=false"}, 2, "distill_beta > 0.0 requires scan_layers = True"},
        {{"distill_alpha_end=-0.5"}, 1, "distill_alpha_end must be in [0, 1]"},
        {{"distill_alpha_end=1.5"}, 1, "distill_alpha_end must be in [0, 1]"},
        {{"distill_alpha_end=1.0"}, 1, NULL},
        {{"distill_temperature_end=0"}, 1, "distill_temperature_end must be > 0"},
        {{"distill_beta_end=-1"}, 1, "distill_beta_end must be >= 0"},
        {{"distill_beta_end=0.5"}, 1, "distill_beta_end > 0 needs distill_beta > 0"},
        {{"internal_compile=true"}, 1, "Set internal_compile_num_devices to a positive integer"},
        {{"elastic_enabled=true"}, 1, "Elastic training is only supported with Pathways"},
        {{"elastic_backup_kind=tape"}, 1, "elastic_backup_kind must be one of"},
        {{"colocated_python_data_input=true"}, 1, "colocated_python_data_input is only supported with Pathways"},
        {{"grain_use_elastic_iterator=true", "packing=false", "grain_file_type=parquet"},
         3,
         "grain_use_elastic_iterator=True requires grain_file_type='arrayrecord'"},
        {{"grain_use_elastic_iterator=true"}, 1, "grain_use_elastic_iterator=True requires packing=False"},
        {{"grain_use_elastic_iterator=true", "packing=false", "use_truncation=false"},
         3,
         "grain_use_elastic_iterator=True requires use_truncation=True"},
        {{"enable_multi_tier_checkpointing=true"}, 1, "local_checkpoint_directory must be set for multi-tier"},
        {{"enable_multi_tier_checkpointing=true", "local_checkpoint_directory=/tmp/x"},
         2,
         "local_checkpoint_period must be > 0 for multi-tier"},
        {{"enable_multi_tier_checkpointing=true", "local_checkpoint_directory=/tmp/x", "local_checkpoint_period=5"},
         3,
         "Exactly one of multi_tier_checkpointing_backup_interval_minutes"},
        {{"enable_multi_tier_checkpointing=true", "local_checkpoint_directory=/tmp/x", "local_checkpoint_period=5",
          "multi_tier_checkpointing_backup_interval_minutes=3", "multi_tier_checkpointing_backup_interval_steps=3"},
         5,
         "Exactly one of multi_tier_checkpointing_backup_interval_minutes"},
        {{"colocated_python_checkpointing=true"}, 1, "colocated_python_checkpointing is only supported"},
        {{"enable_emergency_checkpoint=true"}, 1, "local_checkpoint_directory must be set for emergency"},
        {{"enable_emergency_checkpoint=true", "local_checkpoint_directory=/tmp/x"},
         2,
         "local_checkpoint_period must be > 0 for emergency"},
        {{"quantize_kvcache=true", "kv_quant_axis="}, 2, "kv_quant_axis cannot be empty when quantize_kvcache is True"},
        {{"quantize_logits_proj=true", "logits_via_embedding=true"}, 2, "quantize_logits_proj cannot be enabled"},
        {{"force_q_layout=true"}, 1, "force_q_layout can only be true if use_jax_splash is also true"},
        {{"use_gmm_v2=true"}, 1, "GMM v2 requires use_tokamax_gmm=True"},
        {{"use_gmm_v2_heuristic_tiling=true"}, 1, "use_gmm_v2_heuristic_tiling=True requires use_gmm_v2=True"},
        {{"partial_rotary_factor=0.5"}, 1, "partial_rotary_factor is only effective"},
        {{"attention_type=local_sliding"}, 1, "`sliding_window_size` must be an integer > 0 for 'local_sliding'"},
        {{"experimental_sa_quant_q_fp8=true"},
         1,
         "Q quantization is currently only supported with attention_type='mla'"},
        {{"experimental_sa_quant_k_fp8=true"},
         1,
         "K quantization is currently only supported with attention_type='mla'"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        cfg_config *cfg = NULL;
        sim_status st = cfg_load_argv(cli_base_config(), cases[i].n, cases[i].words, &cfg);
        if (!cases[i].needle) {
            if (st) fail_msg("case %zu rejected: %s", i, sim_errmsg());
        } else {
            assert_int_equal(st, SIM_ERR_INPUT);
            if (!strstr(sim_errmsg(), cases[i].needle))
                fail_msg("case %zu: '%s' not in: %s", i, cases[i].needle, sim_errmsg());
            /* the message names every key the case set */
            for (int w = 0; w < cases[i].n; w++) {
                char key[96];
                snprintf(key, sizeof key, "%.*s", (int)strcspn(cases[i].words[w], "="), cases[i].words[w]);
                if (!strstr(sim_errmsg(), key) && strncmp(key, "model_name", 10) && strncmp(key, "override", 8) &&
                    strncmp(key, "first_num", 9) && strncmp(key, "base_mlp", 8) && strncmp(key, "num_experts", 11) &&
                    !strstr(key, "_parallelism") && strcmp(key, "packing") &&
                    strcmp(key, "local_checkpoint_directory") && strcmp(key, "local_checkpoint_period"))
                    fail_msg("case %zu: the message does not name %s: %s", i, key, sim_errmsg());
            }
            sim_err_clear();
        }
        cfg_free(cfg);
    }
    /* every rule of configs/combinations.yml has a case above: its `says` text appears in a needle */
    char path[4096];
    snprintf(path, sizeof path, "%s", cli_base_config());
    char *slash = strrchr(path, '/');
    assert_non_null(slash);
    snprintf(slash + 1, sizeof path - (size_t)(slash + 1 - path), "combinations.yml");
    FILE *f = fopen(path, "r");
    assert_non_null(f);
    char line[1024];
    int rules = 0;
    while (fgets(line, sizeof line, f)) {
        char *q = strstr(line, "says: \"");
        if (!q) continue;
        q += 7;
        q[strcspn(q, "\"")] = '\0';
        rules++;
        bool hit = false;
        for (size_t i = 0; i < sizeof cases / sizeof cases[0] && !hit; i++)
            hit = cases[i].needle && (strstr(q, cases[i].needle) || strstr(cases[i].needle, q));
        if (!hit) fail_msg("combinations.yml rule '%s' has no case in test_maxtext_combination_rules", q);
    }
    fclose(f);
    assert_true(rules >= 40);
}

/* The program itself (main.c): --version, help COMMAND, COMMAND --help. */
static int run_program(const char *args, char *out, size_t cap)
{
    char exe[4096];
    ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
    if (n <= 0) fail_msg("cannot find the test binary");
    exe[n] = '\0';
    *strrchr(exe, '/') = '\0'; /* build/tests */
    *strrchr(exe, '/') = '\0'; /* build */
    char cmd[4600];
    snprintf(cmd, sizeof cmd, "'%s/shardsim' %s 2>&1", exe, args);
    FILE *p = popen(cmd, "r");
    if (!p) fail_msg("cannot run %s", cmd);
    size_t got = fread(out, 1, cap - 1, p);
    out[got] = '\0';
    int status = pclose(p);
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

static void test_help_and_version(void **state)
{
    (void)state;
    static char out[65536];
    assert_int_equal(run_program("--version", out, sizeof out), 0);
    assert_non_null(strstr(out, CLI_SHARDSIM_VERSION));
    assert_int_equal(run_program("help train", out, sizeof out), 0);
    assert_non_null(strstr(out, "usage: shardsim train"));
    assert_non_null(strstr(out, "compile_topology"));
    assert_int_equal(run_program("keys --help", out, sizeof out), 0);
    assert_non_null(strstr(out, "usage: shardsim keys [pattern]"));
    assert_int_equal(run_program("parity -h", out, sizeof out), 0);
    assert_non_null(strstr(out, "usage: shardsim parity"));
    assert_int_equal(run_program("help nosuchcommand", out, sizeof out), 2);
    assert_non_null(strstr(out, "unknown command 'nosuchcommand'"));
    assert_int_equal(run_program("help", out, sizeof out), 0);
    assert_non_null(strstr(out, "keys "));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_every_key_passes_its_class_check),
        cmocka_unit_test(test_run_json_lists_inert_keys_set),
        cmocka_unit_test(test_unknown_and_refused_keys),
        cmocka_unit_test(test_maxtext_outputs),
        cmocka_unit_test(test_compile_topology),
        cmocka_unit_test(test_dcn_with_one_slice),
        cmocka_unit_test(test_maxtext_files_as_arguments),
        cmocka_unit_test(test_keys_command),
        cmocka_unit_test(test_maxtext_combination_rules),
        cmocka_unit_test(test_help_and_version),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
