/* test_models_catalog.c — every model file of configs/models (MaxText 0.2.5's, copied) is either
 * simulated or refused, as `shardsim train model_name=NAME` meets it:
 *   - a file whose decoder_block shardsim simulates (keys.yml's decoder_block `simulated`) dry-runs
 *     the full model on 8 devices (fsdp=8), or is refused naming a key: one the file sets ("K=V is
 *     refused"), or a setting the file needs, in which case the message says "set K=V" and the dry
 *     run with it must succeed;
 *   - any other file is refused (exit 2) naming the model, its decoder block, and the simulated
 *     blocks, before any of its keys is read;
 *   - the expectations come from the files themselves (their decoder_block), so a file added to
 *     configs/models is covered without editing this test; the counts per block are printed.
 * Also: `shardsim models` labels each file the same way; an unknown name lists the names by
 * block; model_name=NAME-Instruct reads NAME.yml; and which models get Llama 3.1's RoPE. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/cli.h"
#include "cli/common.h"
#include "config/config.h"
#include "config/models.h"
#include "models/core/model.h"
#include "tests/cli_capture.h"

static cfg_config *base_config(void)
{
    cfg_config *cfg = NULL;
    if (cfg_load_argv(cli_base_config(), 0, NULL, &cfg) != SIM_OK) fail_msg("base config: %s", sim_errmsg());
    return cfg;
}

/* `shardsim train model_name=NAME <the dry run> [extra]`: the full model on 8 devices, fsdp=8, two
 * rows a device (the batch-split schedule splits each device's rows in two). */
static cli_capture dry_run(const char *name, const char *extra)
{
    char mn[300];
    snprintf(mn, sizeof mn, "model_name=%s", name);
    const char *argv[] = {mn, "dry_run=true", "steps=1", "per_device_batch_size=2", "ici_fsdp_parallelism=8", extra};
    return cli_capture_run(cli_train, extra ? 6 : 5, argv);
}

/* The key=value a refusal asks to set ("...; set batch_split_factor=2"), into buf; 0 if none. */
static int asked_setting(const char *msg, const cfg_config *cfg, char *buf, size_t cap)
{
    const char *s = strstr(msg, "set ");
    while (s) {
        const char *k = s + 4, *eq = k;
        while (*eq && (*eq == '_' || (*eq >= 'a' && *eq <= 'z') || (*eq >= '0' && *eq <= '9'))) eq++;
        if (*eq == '=' && eq > k) {
            size_t n = strcspn(k, " ;,)\n");
            if (n < cap) {
                snprintf(buf, cap, "%.*s", (int)n, k);
                buf[eq - k] = '\0';
                int known = cfg_find(cfg, buf) != NULL;
                snprintf(buf, cap, "%.*s", (int)n, k);
                if (known) return 1;
            }
        }
        s = strstr(s + 1, "set ");
    }
    return 0;
}

/* The file sets `key` (its own line "key:"). */
static int file_sets(const char *file, const char *key)
{
    cfg_config *raw = NULL;
    if (cfg_load_file(file, &raw) != SIM_OK) fail_msg("%s: %s", file, sim_errmsg());
    int found = cfg_find(raw, key) != NULL;
    cfg_free(raw);
    return found;
}

enum { MAX_BLOCKS = 64 };

static void test_every_model_file(void **state)
{
    (void)state;
    cfg_config *cfg = base_config();
    cfg_model_file *m = NULL;
    int n = 0;
    assert_int_equal(cfg_model_files(cfg, &m, &n), SIM_OK);
    assert_true(n > 0);
    const char *blocks[MAX_BLOCKS];
    int runs[MAX_BLOCKS] = {0}, by_key[MAX_BLOCKS] = {0}, by_block[MAX_BLOCKS] = {0}, nb = 0;
    int total_runs = 0, total_key = 0, total_block = 0;
    for (int i = 0; i < n; i++) {
        int b = 0;
        while (b < nb && strcmp(blocks[b], m[i].block)) b++;
        if (b == nb) {
            assert_true(nb < MAX_BLOCKS);
            blocks[nb++] = m[i].block;
        }
        cli_capture r = dry_run(m[i].name, NULL);
        if (!cfg_block_simulated(cfg, m[i].block)) {
            /* refused by its block: the model, the block, the simulated blocks */
            char want[300];
            snprintf(want, sizeof want, "model_name=%s is refused", m[i].name);
            char block[200];
            snprintf(block, sizeof block, "decoder_block=%s", m[i].block);
            /* ... and the simulated blocks, each row of the family table */
            const char *sims = strstr(r.err, "shardsim simulates the ");
            int all = sims != NULL;
            for (int f = 0; f < model_n_families && all; f++) all = strstr(sims, model_families[f]->name) != NULL;
            if (r.rc != 2 || !strstr(r.err, want) || !strstr(r.err, block) || !strstr(r.err, "not simulated yet") ||
                !all)
                fail_msg("%s (decoder_block %s): exit %d, expected a refusal by its block; stderr: %s", m[i].name,
                         m[i].block, r.rc, r.err);
            by_block[b]++;
            total_block++;
            cli_capture_free(&r);
            continue;
        }
        if (r.rc == 0) {
            runs[b]++;
            total_runs++;
            cli_capture_free(&r);
            continue;
        }
        /* refused by a key the file sets, or asked for a setting the file needs */
        if (r.rc != 2) fail_msg("%s: dry run exit %d: %s", m[i].name, r.rc, r.err);
        char set[200];
        if (asked_setting(r.err, cfg, set, sizeof set)) {
            cli_capture r2 = dry_run(m[i].name, set);
            if (r2.rc != 0) fail_msg("%s with %s (as its refusal asks): exit %d: %s", m[i].name, set, r2.rc, r2.err);
            printf("  %-28s %-9s runs with %s (refused without: %.100s...)\n", m[i].name, m[i].block, set, r.err);
            cli_capture_free(&r2);
        } else {
            const char *eq = strstr(r.err, " is refused");
            const char *k = eq;
            while (k && k > r.err && k[-1] != ' ') k--;
            char key[100] = "";
            if (k) snprintf(key, sizeof key, "%.*s", (int)strcspn(k, "="), k);
            if (!eq || !*key || !cfg_find(cfg, key) || !file_sets(m[i].file, key))
                fail_msg("%s: refused without naming a key the model file sets: %s", m[i].name, r.err);
            printf("  %-28s %-9s refused by %s, which the model file sets\n", m[i].name, m[i].block, key);
        }
        by_key[b]++;
        total_key++;
        cli_capture_free(&r);
    }
    printf("  %d model files: %d dry-run, %d refused by a key (or run only with a setting they need), %d refused by "
           "decoder block\n",
           n, total_runs, total_key, total_block);
    for (int b = 0; b < nb; b++)
        printf("    %-17s %2d run  %2d by key  %2d by block\n", blocks[b], runs[b], by_key[b], by_block[b]);
    /* both simulated blocks have files that run */
    int llama = 0, deepseek = 0;
    for (int b = 0; b < nb; b++) {
        if (!strcmp(blocks[b], "llama2")) llama = runs[b];
        if (!strcmp(blocks[b], "deepseek")) deepseek = runs[b];
    }
    assert_true(llama > 0 && deepseek > 0);
    cfg_model_files_free(m, n);
    cfg_free(cfg);
}

/* `shardsim models` names every file once with its block, and says "simulated" exactly for the
 * files that dry-run above without a setting (the status comes from the same load and define). */
static void test_models_command(void **state)
{
    (void)state;
    cfg_config *cfg = base_config();
    cfg_model_file *m = NULL;
    int n = 0;
    assert_int_equal(cfg_model_files(cfg, &m, &n), SIM_OK);
    cli_capture r = cli_capture_run(cli_models, 0, NULL);
    assert_int_equal(r.rc, 0);
    for (int i = 0; i < n; i++) {
        char line[400];
        snprintf(line, sizeof line, "\n%s ", m[i].name);
        const char *at = strstr(r.out, line);
        if (!at) fail_msg("shardsim models does not list %s", m[i].name);
        const char *eol = strchr(at + 1, '\n');
        size_t len = eol ? (size_t)(eol - at) : strlen(at);
        char row[2000];
        snprintf(row, sizeof row, "%.*s", (int)(len < sizeof row ? len : sizeof row - 1), at + 1);
        assert_non_null(strstr(row, m[i].block));
        int simulated = strstr(row, " simulated") != NULL && !strstr(row, "refused");
        if (!cfg_block_simulated(cfg, m[i].block)) assert_non_null(strstr(row, "refused: block not simulated"));
        if (simulated) {
            cli_capture d = dry_run(m[i].name, NULL);
            if (d.rc != 0)
                fail_msg("shardsim models says %s is simulated, but its dry run exits %d: %s", m[i].name, d.rc, d.err);
            cli_capture_free(&d);
        }
    }
    char total[100];
    snprintf(total, sizeof total, "\n%d models: ", n);
    assert_non_null(strstr(r.out, total));
    cli_capture_free(&r);
    /* one block */
    const char *argv[] = {"block=deepseek"};
    r = cli_capture_run(cli_models, 1, argv);
    assert_int_equal(r.rc, 0);
    assert_null(strstr(r.out, " llama2 "));
    assert_non_null(strstr(r.out, "deepseek3-671b "));
    cli_capture_free(&r);
    cfg_model_files_free(m, n);
    cfg_free(cfg);
}

/* An unknown name lists the names by block (never "no model file"); the -Instruct names read the
 * base model's file, as MaxText's pyconfig; a file given directly is refused by its block too. */
static void test_names(void **state)
{
    (void)state;
    /* a dry run of the full Llama 3.1 8B, as a MaxText user types it */
    const char *l31[] = {"model_name=llama3.1-8b", "dry_run=true", "steps=1", "per_device_batch_size=1",
                         "ici_fsdp_parallelism=8"};
    cli_capture r = cli_capture_run(cli_train, 5, l31);
    if (r.rc != 0) fail_msg("model_name=llama3.1-8b dry run: exit %d: %s", r.rc, r.err);
    cli_capture_free(&r);
    r = dry_run("llama9-1b", NULL);
    assert_int_equal(r.rc, 2);
    assert_null(strstr(r.err, "no model file"));
    assert_non_null(strstr(r.err, "model_name=llama9-1b is not a model name shardsim knows"));
    assert_non_null(strstr(r.err, "llama2 (simulated): "));
    assert_non_null(strstr(r.err, "llama3.1-8b"));
    cli_capture_free(&r);
    cfg_config *cfg = base_config();
    cfg_model_file *m = NULL;
    int n = 0;
    assert_int_equal(cfg_model_files(cfg, &m, &n), SIM_OK);
    for (int i = 0; i < n; i++)
        if (!cfg_block_simulated(cfg, m[i].block)) {
            const char *argv[] = {m[i].file, "dry_run=true"};
            r = cli_capture_run(cli_train, 2, argv);
            char want[300];
            snprintf(want, sizeof want, "decoder_block=%s is refused", m[i].block);
            if (r.rc != 2 || !strstr(r.err, want)) fail_msg("%s as a file: exit %d: %s", m[i].file, r.rc, r.err);
            cli_capture_free(&r);
            break;
        }
    cfg_model_files_free(m, n);
    cfg_free(cfg);
}

/* MaxText's attentions.py gives LLaMARotaryEmbedding to every llama3.1* model name (its -Instruct
 * names too) and to rope_type=llama3.1; Llama 3, 3.3 and 2 keep the default RoPE. */
static void test_llama31_rope_by_name(void **state)
{
    (void)state;
    static const struct {
        const char *words[3];
        int llama31;
    } cases[] = {{{"model_name=llama3.1-8b"}, 1},   {{"model_name=llama3.1-8b-Instruct"}, 1},
                 {{"model_name=llama3.1-405b"}, 1}, {{"model_name=llama3.1-70b", "rope_use_scale=false"}, 1},
                 {{"model_name=llama3-8b"}, 0},     {{"model_name=llama3.3-70b"}, 0},
                 {{"model_name=llama2-7b"}, 0},     {{"model_name=llama3-8b", "rope_type=llama3.1"}, 1}};
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        int argc = 0;
        const char *argv[4];
        for (int k = 0; k < 3 && cases[c].words[k]; k++) argv[argc++] = cases[c].words[k];
        cfg_config *cfg = NULL;
        if (cfg_load_argv(cli_base_config(), argc, argv, &cfg) != SIM_OK) fail_msg("%s: %s", argv[0], sim_errmsg());
        model_def *def = calloc(1, sizeof *def);
        assert_non_null(def);
        if (model_def_from_config(cfg, def) != SIM_OK) fail_msg("%s: %s", argv[0], sim_errmsg());
        assert_int_equal(def->d.rope_llama31, cases[c].llama31);
        assert_int_equal(def->d.rope_use_scale, argc == 1 || strcmp(argv[1], "rope_use_scale=false"));
        model_def_free(def);
        free(def);
        cfg_free(cfg);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_every_model_file),
        cmocka_unit_test(test_models_command),
        cmocka_unit_test(test_names),
        cmocka_unit_test(test_llama31_rope_by_name),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
