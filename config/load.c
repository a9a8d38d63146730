/* load.c — MaxText's merge (see config.h): the base chain, the user layers, the model file,
 * the rules, custom_mesh_and_rule, compile_topology and the checks, in that order.
 *
 * (maxtext_release's base rules and unknown keys come after the model file, before the rules.)
 * The merged base becomes the entries (the known keys); each later layer is read and checked
 * first (so its mistakes surface before anything is applied), then applied in MaxText's order;
 * logical_axis_rules are merged on the side, as pyconfig.py does, and written back. */
#include "config/internal.h"
#include "config/release.h"

#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Merges child into parent (child wins; new keys appended, base_config dropped). */
static void cfg_map_overlay(cfg_value *parent, cfg_value *child)
{
    for (int i = 0; i < child->n; i++) {
        if (strcmp(child->keys[i], "base_config") == 0) continue;
        int k = cfg_map_index(parent, child->keys[i]);
        cfg_value *slot = k >= 0 ? &parent->items[k] : cfg_value_push(parent, child->keys[i]);
        if (k >= 0) cfg_value_free(slot);
        *slot = child->items[i];
        memset(&child->items[i], 0, sizeof child->items[i]);
    }
}

/* Loads path and its base_config ancestors into *out (merged). chain[] collects
 * the real paths (for cycle checks and overlay base_config checks). */
static sim_status cfg_load_chain(cfg_config *cfg, const char *path, char **chain, int *n_chain, cfg_value *out)
{
    char real[PATH_MAX];
    if (!realpath(path, real)) return sim_err(SIM_ERR_IO, "cannot open config file %s: %s", path, strerror(errno));
    for (int i = 0; i < *n_chain; i++)
        if (strcmp(chain[i], real) == 0)
            return sim_err(SIM_ERR_INPUT, "config file %s: base_config chain loops back to %s", path, real);
    if (*n_chain >= CFG_CHAIN_MAX)
        return sim_err(SIM_ERR_INPUT, "config file %s: base_config chain deeper than %d files", path, CFG_CHAIN_MAX);
    chain[(*n_chain)++] = cfg_strdup(real);
    cfg_value map = {0}, base = {0};
    char *parent = NULL;
    sim_status st;
    SIM_TRY_GOTO(cfg_yaml_read(cfg, path, NULL, &map), st, fail);
    int bi = cfg_map_index(&map, "base_config");
    if (bi < 0) {
        *out = map;
        return SIM_OK;
    }
    const cfg_value *bv = &map.items[bi];
    if (bv->kind != CFG_SCALAR || cfg_scalar_type(bv) == CFG_NULL)
        SIM_TRY_GOTO(cfg_value_error(bv, "key 'base_config'", "a file name"), st, fail);
    char *dir = cfg_dir_of(path);
    parent = cfg_join_path(dir, bv->text);
    free(dir);
    if (!cfg_file_exists(parent) && cfg_file_exists(bv->text)) {
        free(parent);
        parent = cfg_strdup(bv->text);
    }
    if (!cfg_file_exists(parent)) {
        char where[512];
        SIM_TRY_GOTO(sim_err(SIM_ERR_INPUT, "%s: base_config '%s': no such file (looked for %s)",
                             cfg_value_where(bv, where, sizeof where), bv->text, parent),
                     st, fail);
    }
    SIM_TRY_GOTO(cfg_load_chain(cfg, parent, chain, n_chain, &base), st, fail);
    cfg_map_overlay(&base, &map);
    *out = base;
fail:
    free(parent);
    cfg_value_free(&map);
    return st;
}

/* Checks a layer's keys (known, typed, well-formed rules). */
sim_status cfg_check_layer(const cfg_config *cfg, const cfg_value *base_vals, const cfg_layer *l, int allow_base_config)
{
    for (int i = 0; i < l->map.n; i++) {
        const char *key = l->map.keys[i];
        const cfg_value *v = &l->map.items[i];
        if (allow_base_config && strcmp(key, "base_config") == 0) continue;
        const cfg_entry *e = cfg_find(cfg, key);
        if (!e) return cfg_keys_unknown(cfg, key, v, l->name);
        SIM_TRY(cfg_keys_check_type(e, &base_vals[e - cfg->entries], v));
        if (strcmp(key, CFG_RULES_KEY) == 0) SIM_TRY(cfg_rules_check(v));
        if (strcmp(key, "mesh_axes") == 0) SIM_TRY(cfg_axes_check(v, "key 'mesh_axes'", 0));
    }
    return SIM_OK;
}

/* Sets the layer's values (all but the rules) into the config. */
static void cfg_apply_layer(cfg_config *cfg, const cfg_layer *l, int is_model)
{
    for (int i = 0; i < l->map.n; i++) {
        const char *key = l->map.keys[i];
        if (strcmp(key, CFG_RULES_KEY) == 0 || strcmp(key, "base_config") == 0) continue;
        cfg_entry *e = cfg_find_mut(cfg, key);
        SIM_ASSERT(e);
        cfg_value_free(&e->value);
        cfg_value_copy(&e->value, &l->map.items[i]);
        free(e->where);
        e->where = cfg_where_of(&e->value);
        if (is_model > 0) e->from_model = 1;
        else if (is_model == 0) e->from_user = 1;
    }
}

int cfg_layer_flag(const cfg_layer *l, const char *key)
{
    int i = cfg_map_index(&l->map, key);
    int b = 0;
    if (i >= 0 && cfg_value_bool(&l->map.items[i], key, &b) == SIM_OK) return b;
    return 0;
}

const cfg_value *cfg_layer_value(const cfg_layer *l, const char *key)
{
    int i = cfg_map_index(&l->map, key);
    return i >= 0 ? &l->map.items[i] : NULL;
}

/* ---- the steps of a load ---------------------------------------------------- */

/* 1. The base chain: its keys are the known keys (with keys.yml's classes and defaults). */
static sim_status load_base(cfg_loader *ld)
{
    const cfg_args *args = ld->args;
    cfg_config *cfg = ld->cfg;
    cfg_value base_map = {0};
    SIM_TRY(cfg_load_chain(cfg, cfg->base_file, ld->chain, &ld->n_chain, &base_map));
    cfg_take_map(cfg, &base_map);
    ld->dirs[ld->n_dirs++] = cfg_strdup(args && args->configs_dir ? args->configs_dir : "");
    if (!*ld->dirs[0]) {
        free(ld->dirs[0]);
        ld->dirs[0] = cfg_dir_of(cfg->base_file);
    }
    if (ld->n_chain > 1) ld->dirs[ld->n_dirs++] = cfg_dir_of(ld->chain[ld->n_chain - 1]);
    cfg->configs_dir = cfg_strdup(ld->dirs[0]);
    SIM_TRY(cfg_keys_apply(cfg, ld->dirs[0]));
    ld->n_base = cfg->n;
    ld->base_vals = calloc(cfg->n > 0 ? (size_t)cfg->n : 1, sizeof *ld->base_vals);
    SIM_ASSERT(ld->base_vals);
    for (int i = 0; i < cfg->n; i++) cfg_value_copy(&ld->base_vals[i], &cfg->entries[i].value);
    return cfg_check_final(cfg);
}

/* A user file may name the base it was written against (MaxText style); it must be a file of
 * the loaded base chain. */
static sim_status check_user_base(const cfg_loader *ld, const char *file, const cfg_value *bc)
{
    char *d = cfg_dir_of(file);
    char *p = cfg_join_path(d, bc->kind == CFG_SCALAR ? bc->text : "");
    char real[PATH_MAX];
    int ok = 0;
    if (realpath(p, real) || (bc->kind == CFG_SCALAR && realpath(bc->text, real)))
        for (int k = 0; k < ld->n_chain; k++) ok |= strcmp(ld->chain[k], real) == 0;
    free(d);
    free(p);
    if (ok) return SIM_OK;
    char where[512];
    return sim_err(SIM_ERR_INPUT,
                   "%s: base_config '%s' is not the loaded base config %s; pass that file "
                   "as the base config, or drop base_config from %s",
                   cfg_value_where(bc, where, sizeof where), bc->kind == CFG_SCALAR ? bc->text : "?",
                   ld->cfg->base_file, file);
}

/* The user layers (extra files, then the command line): read and checked now, before anything
 * is applied, so that their mistakes surface first. */
static sim_status read_user_layers(cfg_loader *ld)
{
    const cfg_args *args = ld->args;
    cfg_config *cfg = ld->cfg;
    for (int i = 0; args && i < args->n_files; i++) {
        cfg_layer *l = &ld->user[i];
        const char *file = args->files[i];
        l->name = cfg_intern(cfg, file);
        SIM_TRY(cfg_yaml_read(cfg, file, NULL, &l->map));
        const cfg_value *bc = cfg_layer_value(l, "base_config");
        const char *slash = strrchr(file, '/');
        l->config_file = bc != NULL || !strcmp(slash ? slash + 1 : file, "base.yml");
        if (bc) SIM_TRY(check_user_base(ld, file, bc));
        SIM_TRY(cfg_block_refuse(cfg, cfg_layer_value(l, "decoder_block"), NULL));
        SIM_TRY(cfg_check_layer(cfg, ld->base_vals, l, 1));
        /* as MaxText: model and custom mesh-and-rule files beside the config file come first */
        if (l->config_file && ld->n_dirs < CFG_MAX_DIRS) {
            memmove(ld->dirs + 1, ld->dirs, (size_t)ld->n_dirs * sizeof *ld->dirs);
            ld->dirs[0] = cfg_dir_of(file);
            ld->n_dirs++;
        }
    }
    cfg_layer *cli = &ld->user[ld->n_user - 1];
    cli->name = "the command line";
    cli->map.kind = CFG_MAP;
    cli->map.file = cfg_cli_source;
    for (int i = 0; args && i < args->n_overrides; i++) SIM_TRY(cfg_yaml_override(cfg, args->overrides[i], &cli->map));
    SIM_TRY(cfg_block_refuse(cfg, cfg_layer_value(cli, "decoder_block"), NULL));
    return cfg_check_layer(cfg, ld->base_vals, cli, 0);
}

/* Values: base <- MaxText config files <- model <- extra files <- command line. */
static void apply_layers(cfg_loader *ld)
{
    for (int i = 0; i < ld->n_user; i++)
        if (ld->user[i].config_file) cfg_apply_layer(ld->cfg, &ld->user[i], -1);
    if (ld->model.map.n) cfg_apply_layer(ld->cfg, &ld->model, 1);
    for (int i = 0; i < ld->n_user; i++)
        if (!ld->user[i].config_file) cfg_apply_layer(ld->cfg, &ld->user[i], 0);
}

/* maxtext_release (config/release.h): a key the release does not know is refused, naming the
 * release; the release's base rule set (mesh_axes, data_sharding, logical_axis_rules) takes the
 * place of the base file's, before the model's and the user's rules merge in, as the release's own
 * base.yml would.  Values a model file or the user set are kept. */
static sim_status apply_release(cfg_loader *ld)
{
    cfg_config *cfg = ld->cfg;
    if (!cfg_find(cfg, "maxtext_release")) return SIM_OK; /* a base without the key: no release */
    const cfg_release *r;
    SIM_TRY(cfg_release_of(cfg, &r));
    for (int i = 0; i < ld->n_user; i++) {
        const cfg_layer *l = &ld->user[i];
        if (l->config_file) continue;
        for (int k = 0; k < l->map.n; k++) {
            if (!cfg_release_lacks_key(r, l->map.keys[k])) continue;
            char where[512];
            return sim_err(SIM_ERR_INPUT,
                           "key '%s' (%s): MaxText %s has no such key (maxtext_release=%s follows that release; "
                           "the key came later); drop it, or follow a release that has it (maxtext_release=%s)",
                           l->map.keys[k], cfg_value_where(&l->map.items[k], where, sizeof where),
                           cfg_release_maxtext(r), cfg_release_maxtext(r), CFG_RELEASE_DEFAULT);
        }
    }
    const char *br = cfg_release_base_rules(r);
    if (!br) return SIM_OK;
    cfg_value doc = {0};
    sim_status st;
    SIM_TRY_GOTO(cfg_yaml_read(cfg, br, NULL, &doc), st, fail);
    static const char *const replaced[] = {"mesh_axes", "logical_axis_rules", "data_sharding"};
    for (int k = 0; k < 3; k++) {
        const cfg_value *v = cfg_map_get(&doc, replaced[k]);
        cfg_entry *e = cfg_find_mut(cfg, replaced[k]);
        if (!v)
            SIM_TRY_GOTO(sim_err(SIM_ERR_INPUT, "%s: a release's base_rules file needs %s", br, replaced[k]), st, fail);
        if (!e || e->from_user || e->from_model) continue;
        cfg_value_free(&e->value);
        cfg_value_copy(&e->value, v);
        free(e->where);
        e->where = cfg_where_of(v);
    }
    SIM_TRY_GOTO(cfg_check_final(cfg), st, fail);
fail:
    cfg_value_free(&doc);
    return st;
}

/* After merging: data_sharding's grouping, compile_topology, then every check. */
static sim_status finish(cfg_loader *ld)
{
    cfg_config *cfg = ld->cfg;
    cfg_data_sharding_normalize(cfg);
    SIM_TRY(cfg_topology_apply(cfg, cfg->configs_dir));
    SIM_TRY(cfg_check_final(cfg));
    SIM_TRY(cfg_keys_check(cfg, ld->base_vals, ld->n_base));
    SIM_TRY(cfg_ranges_check(cfg, ld->dirs, ld->n_dirs));
    if (cfg->keys_file) SIM_TRY(cfg_maxtext_rules(cfg));
    if (cfg->keys_file) SIM_TRY(cfg_combinations_check(cfg, ld->dirs, ld->n_dirs));
    return SIM_OK;
}

static void loader_free(cfg_loader *ld)
{
    for (int i = 0; i < ld->n_chain; i++) free(ld->chain[i]);
    for (int i = 0; i < ld->n_user; i++) cfg_value_free(&ld->user[i].map);
    free(ld->user);
    cfg_value_free(&ld->model.map);
    for (int i = 0; ld->base_vals && i < ld->n_base; i++) cfg_value_free(&ld->base_vals[i]);
    free(ld->base_vals);
    for (int i = 0; i < ld->n_dirs; i++) free(ld->dirs[i]);
}

sim_status cfg_load(const cfg_args *args, cfg_config **out)
{
    *out = NULL;
    cfg_loader ld = {.args = args, .model = {{0}, "the model file", 0}};
    ld.cfg = cfg_new();
    ld.cfg->base_file = cfg_strdup(args && args->base_file ? args->base_file : "configs/base.yml");
    ld.n_user = (args ? args->n_files : 0) + 1;
    ld.user = calloc((size_t)ld.n_user, sizeof *ld.user);
    SIM_ASSERT(ld.user);
    sim_status st;
    SIM_TRY_GOTO(load_base(&ld), st, fail);
    SIM_TRY_GOTO(read_user_layers(&ld), st, fail);
    SIM_TRY_GOTO(cfg_models_read(&ld), st, fail);
    apply_layers(&ld);
    SIM_TRY_GOTO(cfg_models_check_overrides(&ld), st, fail);
    SIM_TRY_GOTO(apply_release(&ld), st, fail);
    cfg_rules_merge_layers(&ld);
    SIM_TRY_GOTO(cfg_custom_apply_selected(&ld), st, fail);
    SIM_TRY_GOTO(finish(&ld), st, fail);
    *out = ld.cfg;
fail:
    loader_free(&ld);
    if (st != SIM_OK) cfg_free(ld.cfg);
    return st;
}

sim_status cfg_load_argv(const char *base_file, int argc, const char *const *argv, cfg_config **out)
{
    const char **files = calloc((size_t)(argc + 1), sizeof *files);
    const char **ovr = calloc((size_t)(argc + 1), sizeof *ovr);
    SIM_ASSERT(files && ovr);
    cfg_args a = {base_file, NULL, files, 0, ovr, 0};
    sim_status st = SIM_OK;
    for (int i = 0; i < argc; i++) {
        const char *s = argv[i];
        if (strchr(s, '=')) ovr[a.n_overrides++] = s;
        else if (cfg_ends_with(s, ".yml") || cfg_ends_with(s, ".yaml")) files[a.n_files++] = s;
        else
            SIM_TRY_GOTO(sim_err(SIM_ERR_INPUT, "argument '%s' is neither a config file (*.yml) nor key=value", s), st,
                         fail);
    }
    SIM_TRY_GOTO(cfg_load(&a, out), st, fail);
fail:
    free(files);
    free(ovr);
    return st;
}

sim_status cfg_load_file(const char *path, cfg_config **out)
{
    *out = NULL;
    cfg_config *cfg = cfg_new();
    cfg->base_file = cfg_strdup(path);
    cfg->configs_dir = cfg_dir_of(path);
    cfg_value map;
    sim_status st;
    SIM_TRY_GOTO(cfg_yaml_read(cfg, path, NULL, &map), st, fail);
    cfg_take_map(cfg, &map);
    *out = cfg;
fail:
    if (st != SIM_OK) cfg_free(cfg);
    return st;
}
