/* models.c — model files and decoder blocks (see models.h): listing them, choosing the model file
 * a config names, refusing a block that is not simulated, and override_model_config. */
#include "config/models.h"
#include "config/internal.h"

#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* keys.yml's decoder_block line: `simulated` (the blocks shardsim runs) and `choices` (MaxText's
 * DecoderBlockType values); NULL without keys.yml or without the field. */
static const cfg_value *block_field(const cfg_config *cfg, const char *field)
{
    const cfg_entry *e = cfg_find(cfg, "decoder_block");
    return e ? cfg_entry_field(e, field) : NULL;
}

static int block_in(const cfg_value *list, const char *block)
{
    for (int i = 0; list && list->kind == CFG_LIST && i < list->n; i++)
        if (list->items[i].kind == CFG_SCALAR && !strcmp(list->items[i].text, block)) return 1;
    return 0;
}

int cfg_block_simulated(const cfg_config *cfg, const char *block)
{
    const cfg_value *sim = block_field(cfg, "simulated");
    return !sim || block_in(sim, block);
}

/* Calls fn with the block's line of <configs>/decoder_blocks.yml (NULL when the file, the block
 * or the file's parse is missing: a broken description file only loses what it describes). */
static void with_block_line(const cfg_config *cfg, const char *block, void (*fn)(const cfg_value *b, void *arg),
                            void *arg)
{
    char *path = cfg_join_path(cfg->configs_dir, "decoder_blocks.yml");
    cfg_config *holder = cfg_new();
    cfg_value doc = {0};
    const cfg_value *b = NULL;
    if (cfg_file_exists(path) && cfg_yaml_read(holder, path, NULL, &doc) == SIM_OK)
        b = cfg_map_get(cfg_map_get(&doc, "blocks"), block);
    sim_err_clear();
    fn(b, arg);
    cfg_value_free(&doc);
    cfg_free(holder);
    free(path);
}

static void about_of(const cfg_value *b, void *arg)
{
    const char *cls = b ? cfg_map_text(b, "layer") : NULL, *has = b ? cfg_map_text(b, "has") : NULL;
    if (cls && has) *(char **)arg = cfg_asprintf("%s: %s", cls, has);
}

char *cfg_block_about(const cfg_config *cfg, const char *block)
{
    char *about = NULL;
    with_block_line(cfg, block, about_of, &about);
    return about;
}

typedef struct {
    const char *field;
    int on;
} flag_arg;

static void flag_of(const cfg_value *b, void *arg)
{
    flag_arg *f = arg;
    const cfg_value *v = b ? cfg_map_get(b, f->field) : NULL;
    int on = 0;
    f->on = v && cfg_value_bool(v, f->field, &on) == SIM_OK && on;
    sim_err_clear();
}

int cfg_block_flag(const cfg_config *cfg, const char *block, const char *field)
{
    flag_arg f = {field, 0};
    with_block_line(cfg, block, flag_of, &f);
    return f.on;
}

/* "the llama2 and deepseek decoder blocks" */
static char *simulated_blocks_text(const cfg_config *cfg)
{
    const cfg_value *sim = block_field(cfg, "simulated");
    cfg_sbuf b = {0};
    cfg_sb_putf(&b, "the ");
    int n = sim && sim->kind == CFG_LIST ? sim->n : 0;
    for (int i = 0; i < n; i++) cfg_sb_putf(&b, "%s%s", i == 0 ? "" : i == n - 1 ? " and " : ", ", sim->items[i].text);
    cfg_sb_putf(&b, " decoder block%s", n == 1 ? "" : "s");
    return b.s;
}

/* A layer that sets decoder_block to a MaxText block shardsim does not simulate is refused by its
 * block before its keys are checked: its other keys belong to that block's layer
 * (vision_encoder_block, log_moe_bias_norms, ...), and an unknown or refused key would hide the
 * reason.  A value MaxText does not know is left to the registry check (its `choices`). */
sim_status cfg_block_refuse(const cfg_config *cfg, const cfg_value *v, const char *model_name)
{
    if (!v || v->kind != CFG_SCALAR || cfg_is_null(v) || cfg_block_simulated(cfg, v->text)) return SIM_OK;
    const cfg_value *choices = block_field(cfg, "choices");
    if (choices && !block_in(choices, v->text)) return SIM_OK;
    char where[512];
    char *about = cfg_block_about(cfg, v->text);
    char *sim = simulated_blocks_text(cfg);
    char *who = model_name
                    ? cfg_asprintf("model_name=%s is refused: %s sets decoder_block=%s", model_name,
                                   cfg_value_where(v, where, sizeof where), v->text)
                    : cfg_asprintf("%s: decoder_block=%s is refused", cfg_value_where(v, where, sizeof where), v->text);
    sim_status st = sim_err(SIM_ERR_INPUT,
                            "%s: MaxText's %s decoder block%s%s%s is not simulated yet; shardsim simulates %s "
                            "(`shardsim models` lists every model name with its decoder block and status)",
                            who, v->text, about ? " (" : "", about ? about : "", about ? ")" : "", sim);
    free(who);
    free(sim);
    free(about);
    return st;
}

static int model_file_cmp(const void *a, const void *b)
{
    return strcmp(((const cfg_model_file *)a)->name, ((const cfg_model_file *)b)->name);
}

/* A model file's decoder_block (def when the file sets none). */
static sim_status file_block(const char *file, const cfg_value *def, char **block)
{
    cfg_config *holder = cfg_new();
    cfg_value doc = {0};
    sim_status st;
    SIM_TRY_GOTO(cfg_yaml_read(holder, file, NULL, &doc), st, fail);
    const cfg_value *b = cfg_map_get(&doc, "decoder_block");
    *block = cfg_strdup(b && b->kind == CFG_SCALAR ? b->text : def && def->kind == CFG_SCALAR ? def->text : "default");
fail:
    cfg_value_free(&doc);
    cfg_free(holder);
    return st;
}

sim_status cfg_model_files(const cfg_config *cfg, cfg_model_file **out, int *n_out)
{
    *out = NULL;
    *n_out = 0;
    char *dir = cfg_join_path(cfg->configs_dir, "models");
    DIR *d = opendir(dir);
    cfg_model_file *m = NULL;
    int n = 0, cap = 0;
    sim_status st;
    if (!d)
        SIM_TRY_GOTO(sim_err(SIM_ERR_INPUT, "cannot list the model files in %s: %s", dir, strerror(errno)), st, fail);
    const cfg_entry *db = cfg_find(cfg, "decoder_block");
    const cfg_value *def = db ? cfg_entry_field(db, "default") : NULL;
    st = SIM_OK;
    struct dirent *de;
    while ((de = readdir(d))) {
        size_t len = strlen(de->d_name);
        if (len <= 4 || strcmp(de->d_name + len - 4, ".yml") != 0) continue;
        if (n == cap) {
            cap = cap ? 2 * cap : 64;
            m = realloc(m, (size_t)cap * sizeof *m);
            SIM_ASSERT(m);
        }
        cfg_model_file *f = &m[n++];
        memset(f, 0, sizeof *f);
        f->name = strndup(de->d_name, len - 4);
        SIM_ASSERT(f->name);
        f->file = cfg_join_path(dir, de->d_name);
        SIM_TRY_GOTO(file_block(f->file, def, &f->block), st, fail);
    }
    if (n) qsort(m, (size_t)n, sizeof *m, model_file_cmp);
    *out = m;
    *n_out = n;
fail:
    if (d) closedir(d);
    free(dir);
    if (st != SIM_OK) cfg_model_files_free(m, n);
    return st;
}

void cfg_model_files_free(cfg_model_file *m, int n)
{
    for (int i = 0; i < n; i++) {
        free(m[i].name);
        free(m[i].file);
        free(m[i].block);
    }
    free(m);
}

/* The model names of the configs directory grouped by decoder block, simulated blocks first:
 * "llama2 (simulated): llama2-7b, llama3-8b; ...; gemma (not simulated): gemma-2b, ...". */
static char *cfg_models_available(const cfg_config *cfg)
{
    cfg_model_file *m = NULL;
    int n = 0;
    if (cfg_model_files(cfg, &m, &n) != SIM_OK) {
        char *s = cfg_asprintf("(%s)", sim_errmsg());
        sim_err_clear();
        return s;
    }
    cfg_sbuf b = {0};
    cfg_sb_putf(&b, "%s", n ? "" : "(no model files)");
    int groups = 0;
    for (int pass = 0; pass < 2; pass++)
        for (int i = 0; i < n; i++) {
            int first = 1;
            for (int k = 0; k < i && first; k++) first = strcmp(m[k].block, m[i].block) != 0;
            if (!first || cfg_block_simulated(cfg, m[i].block) != (pass == 0)) continue;
            cfg_sb_putf(&b, "%s%s (%s):", groups++ ? "; " : "", m[i].block, pass == 0 ? "simulated" : "not simulated");
            for (int k = i; k < n; k++)
                if (!strcmp(m[k].block, m[i].block)) cfg_sb_putf(&b, " %s", m[k].name);
        }
    cfg_model_files_free(m, n);
    return b.s;
}

/* MaxText's model file name for a model_name: pyconfig drops "-Instruct" (an instruction-tuned
 * model has its base model's architecture, so llama3.1-8b-Instruct reads llama3.1-8b.yml). */
static char *model_file_name(const char *model_name)
{
    cfg_sbuf b = {0};
    cfg_sb_putf(&b, "%s", "");
    for (const char *s = model_name; *s;) {
        if (!strncmp(s, "-Instruct", 9)) {
            s += 9;
            continue;
        }
        cfg_sb_putf(&b, "%c", *s++);
    }
    return b.s;
}

/* The model_name the user layers leave (the last layer that sets it), else the base's. */
static const cfg_value *selected_model_name(const cfg_loader *ld)
{
    const cfg_value *mn = NULL;
    const cfg_entry *mne = cfg_find(ld->cfg, "model_name");
    if (mne) mn = &mne->value;
    for (int i = 0; i < ld->n_user; i++)
        if (cfg_layer_value(&ld->user[i], "model_name")) mn = cfg_layer_value(&ld->user[i], "model_name");
    return mn;
}

/* A model name is a file name in models/, never a path out of it; the file must exist. */
static sim_status find_model_file(const cfg_loader *ld, const cfg_value *mn, char **path)
{
    char where[512];
    cfg_value_where(mn, where, sizeof where);
    if (strchr(mn->text, '/') || strchr(mn->text, '\\') || mn->text[0] == '.' || !mn->text[0]) {
        char *avail = cfg_models_available(ld->cfg);
        sim_status st = sim_err(SIM_ERR_INPUT,
                                "%s: model_name=%s is not a model name (no '/', '\\' or leading '.'); "
                                "the model names by decoder block: %s",
                                where, mn->text, avail);
        free(avail);
        return st;
    }
    char *file_name = model_file_name(mn->text);
    *path = cfg_find_named_file(ld->dirs, ld->n_dirs, "models", file_name);
    sim_status st = SIM_OK;
    if (!*path) {
        char *sub = cfg_asprintf("%s/models", ld->dirs[0]);
        char *avail = cfg_models_available(ld->cfg);
        st = sim_err(SIM_ERR_INPUT,
                     "%s: model_name=%s is not a model name shardsim knows (no %s/%s.yml); "
                     "the model names by decoder block: %s",
                     where, mn->text, sub, file_name, avail);
        free(sub);
        free(avail);
    }
    free(file_name);
    return st;
}

sim_status cfg_models_read(cfg_loader *ld)
{
    const cfg_value *mn = selected_model_name(ld);
    if (!mn || mn->kind != CFG_SCALAR || cfg_is_null(mn) || strcmp(mn->text, "default") == 0) return SIM_OK;
    cfg_config *cfg = ld->cfg;
    char *path = NULL;
    SIM_TRY(find_model_file(ld, mn, &path));
    cfg->model_file = path;
    SIM_TRY(cfg_yaml_read(cfg, path, NULL, &ld->model.map));
    /* the block refusal first, unless a user layer picks the block itself */
    const cfg_value *block = cfg_layer_value(&ld->model, "decoder_block");
    for (int i = 0; i < ld->n_user; i++)
        if (!ld->user[i].config_file && cfg_layer_value(&ld->user[i], "decoder_block")) block = NULL;
    SIM_TRY(cfg_block_refuse(cfg, block, mn->text));
    return cfg_check_layer(cfg, ld->base_vals, &ld->model, 0);
}

/* A key set by the model file and, differently, by the user needs override_model_config=true
 * (pyconfig validate_no_keys_overridden_twice).  Rules are merged by name, not overridden, so
 * they never conflict; a MaxText config file sits below the model file, which overrides it. */
sim_status cfg_models_check_overrides(const cfg_loader *ld)
{
    const cfg_config *cfg = ld->cfg;
    const cfg_layer *model = &ld->model;
    int override_model = 0;
    if (cfg_find(cfg, "override_model_config")) cfg_get_bool(cfg, "override_model_config", &override_model);
    for (int i = 0; i < model->map.n && !override_model; i++) {
        const char *key = model->map.keys[i];
        if (strcmp(key, CFG_RULES_KEY) == 0) continue;
        for (int u = ld->n_user - 1; u >= 0; u--) {
            if (ld->user[u].config_file) continue;
            const cfg_value *uv = cfg_layer_value(&ld->user[u], key);
            if (!uv) continue;
            if (cfg_value_equal(uv, &model->map.items[i])) break;
            char w1[512], w2[512];
            char *t1 = cfg_value_to_text(&model->map.items[i], 0);
            char *t2 = cfg_value_to_text(uv, 0);
            sim_status st = sim_err(SIM_ERR_INPUT,
                                    "key '%s' is set by the model file (%s = %s) and by %s (%s = %s); "
                                    "MaxText forbids changing a model's keys unless override_model_config=true: "
                                    "add override_model_config=true to override it",
                                    key, cfg_value_where(&model->map.items[i], w1, sizeof w1), t1, ld->user[u].name,
                                    cfg_value_where(uv, w2, sizeof w2), t2);
            free(t1);
            free(t2);
            return st;
        }
    }
    return SIM_OK;
}
