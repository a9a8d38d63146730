/* models.c — `shardsim models [pattern]`: every model name of configs/models (MaxText's model
 * files) with its decoder block and whether shardsim runs it.  The status is found the way `train`
 * finds it, not guessed: the config is loaded with model_name=NAME and the model defined from it;
 * the first refusal (a decoder block not simulated, or a key such as use_indexer) is shown as it
 * would be printed.  A pattern selects names containing it, or block=NAME one decoder block. */
#include "cli/cli.h"
#include "cli/common.h"

#include <stdlib.h>
#include <string.h>

#include "config/config.h"
#include "config/models.h"
#include "models/core/model.h"

/* NULL when model_name=name loads and defines; else the refusal (malloc'd). */
static char *model_refusal(const char *name)
{
    char arg[300];
    snprintf(arg, sizeof arg, "model_name=%s", name);
    const char *argv[] = {arg};
    cfg_config *cfg = NULL;
    sim_status st = cfg_load_argv(cli_base_config(), 1, argv, &cfg);
    if (st == SIM_OK) {
        model_def *def = calloc(1, sizeof *def);
        if (!def) {
            cfg_free(cfg);
            return strdup("out of host memory");
        }
        st = model_def_from_config(cfg, def);
        if (st == SIM_OK) model_def_free(def);
        free(def);
    }
    cfg_free(cfg);
    if (st == SIM_OK) return NULL;
    char *msg = strdup(sim_errmsg());
    sim_err_clear();
    return msg;
}

static int selected(const cfg_model_file *m, const char *pattern)
{
    if (!pattern || !*pattern) return 1;
    if (!strncmp(pattern, "block=", 6)) return !strcmp(m->block, pattern + 6);
    return strstr(m->name, pattern) != NULL;
}

int cli_models(int argc, char **argv, FILE *out, FILE *err)
{
    if (argc > 1) {
        fprintf(err,
                "shardsim models: one pattern at most (got %d words); usage: shardsim models [pattern|block=NAME]\n",
                argc);
        return 2;
    }
    const char *pattern = argc ? argv[0] : NULL;
    cfg_config *cfg = NULL;
    cfg_model_file *m = NULL;
    int n = 0, shown = 0;
    sim_status st;
    SIM_TRY_GOTO(cfg_load_argv(cli_base_config(), 0, NULL, &cfg), st, fail);
    SIM_TRY_GOTO(cfg_model_files(cfg, &m, &n), st, fail);
    size_t wname = 5, wblock = 13;
    for (int i = 0; i < n; i++) {
        if (!selected(&m[i], pattern)) continue;
        if (strlen(m[i].name) > wname) wname = strlen(m[i].name);
        if (strlen(m[i].block) > wblock) wblock = strlen(m[i].block);
    }
    fprintf(out, "%-*s  %-*s  %s\n", (int)wname, "model", (int)wblock, "decoder_block", "status");
    int runs = 0, by_block = 0, by_key = 0;
    for (int i = 0; i < n; i++) {
        if (!selected(&m[i], pattern)) continue;
        shown++;
        if (!cfg_block_simulated(cfg, m[i].block)) {
            by_block++;
            char *about = cfg_block_about(cfg, m[i].block);
            fprintf(out, "%-*s  %-*s  refused: block not simulated%s%s\n", (int)wname, m[i].name, (int)wblock,
                    m[i].block, about ? " -- " : "", about ? about : "");
            free(about);
            continue;
        }
        char *why = model_refusal(m[i].name);
        if (why) by_key++;
        else runs++;
        fprintf(out, "%-*s  %-*s  %s%s\n", (int)wname, m[i].name, (int)wblock, m[i].block,
                why ? "refused: " : "simulated", why ? why : "");
        free(why);
    }
    fprintf(out,
            "\n%d model%s: %d simulated, %d refused by a key of the model file or a setting it needs, "
            "%d refused by decoder block (from %s/models)\n",
            shown, shown == 1 ? "" : "s", runs, by_key, by_block, cfg->configs_dir);
fail:
    cfg_model_files_free(m, n);
    cfg_free(cfg);
    if (st) return cli_fail(err, st);
    if (!shown && pattern) {
        fprintf(err, "shardsim models: no model matches '%s'\n", pattern);
        return 2;
    }
    return 0;
}
