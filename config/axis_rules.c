/* axis_rules.c — logical_axis_rules and mesh axes in a config: their shape checks, MaxText's merge
 * of rule lists by logical name (pyconfig.py _merge_logical_axis_rules), custom_mesh_and_rule
 * files (which replace mesh_axes, the rules and data_sharding) and data_sharding's grouping. */
#include "config/internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* A logical_axis_rules list: items [name, axes] with axes a name, a list of
 * names, [] or null. */
sim_status cfg_rules_check(const cfg_value *v)
{
    char where[512];
    if (cfg_is_null(v)) return SIM_OK;
    if (v->kind != CFG_LIST)
        return cfg_value_error(v, "key 'logical_axis_rules'", "a list of [logical_name, mesh_axes] pairs");
    for (int i = 0; i < v->n; i++) {
        const cfg_value *r = &v->items[i];
        cfg_value_where(r, where, sizeof where);
        if (r->kind != CFG_LIST || r->n != 2 || r->items[0].kind != CFG_SCALAR ||
            cfg_scalar_type(&r->items[0]) == CFG_NULL) {
            char *t = cfg_value_to_text(r, 0);
            sim_status st = sim_err(SIM_ERR_INPUT,
                                    "%s: logical_axis_rules item %d is %s; expected a pair "
                                    "[logical_name, mesh_axes] such as ['embed', ['fsdp', 'expert']]",
                                    where, i, t);
            free(t);
            return st;
        }
        const cfg_value *ax = &r->items[1];
        int ok = ax->kind == CFG_SCALAR;
        if (ax->kind == CFG_LIST) {
            ok = 1;
            for (int j = 0; j < ax->n; j++)
                if (ax->items[j].kind != CFG_SCALAR || cfg_is_null(&ax->items[j])) ok = 0;
            for (int j = 0; ok && j < ax->n; j++)
                for (int k = 0; k < j; k++)
                    if (strcmp(ax->items[j].text, ax->items[k].text) == 0) {
                        return sim_err(SIM_ERR_INPUT, "%s: logical_axis_rules rule '%s' lists mesh axis '%s' twice",
                                       where, r->items[0].text, ax->items[j].text);
                    }
        }
        if (!ok) {
            char *t = cfg_value_to_text(ax, 0);
            sim_status st = sim_err(SIM_ERR_INPUT,
                                    "%s: logical_axis_rules rule '%s' maps to %s; expected a mesh "
                                    "axis name, a list of mesh axis names, or []",
                                    where, r->items[0].text, t);
            free(t);
            return st;
        }
    }
    return SIM_OK;
}

/* MaxText's _merge_logical_axis_rules: drop every rule of acc whose name the
 * new list mentions, append the new rules. */
void cfg_rules_merge(cfg_value *acc, const cfg_value *add)
{
    if (cfg_is_null(add) || add->n == 0) return;
    if (cfg_is_null(acc)) {
        cfg_value_free(acc);
        acc->kind = CFG_LIST;
    }
    int w = 0;
    for (int i = 0; i < acc->n; i++) {
        int drop = 0;
        for (int j = 0; j < add->n && !drop; j++)
            drop = strcmp(acc->items[i].items[0].text, add->items[j].items[0].text) == 0;
        if (drop) cfg_value_free(&acc->items[i]);
        else acc->items[w++] = acc->items[i];
    }
    acc->n = w;
    for (int j = 0; j < add->n; j++) cfg_value_copy(cfg_value_push(acc, NULL), &add->items[j]);
}

sim_status cfg_axes_check(const cfg_value *v, const char *key, int allow_nested)
{
    if (v->kind != CFG_LIST) return cfg_value_error(v, key, "a list of mesh axis names");
    for (int i = 0; i < v->n; i++) {
        const cfg_value *it = &v->items[i];
        if (allow_nested && it->kind == CFG_LIST) {
            SIM_TRY(cfg_axes_check(it, key, 0));
            continue;
        }
        if (it->kind != CFG_SCALAR || cfg_is_null(it)) return cfg_value_error(it, key, "a mesh axis name");
        for (int j = 0; j < i; j++)
            if (v->items[j].kind == CFG_SCALAR && strcmp(v->items[j].text, it->text) == 0) {
                char where[512];
                return sim_err(SIM_ERR_INPUT, "%s: %s lists '%s' twice; each mesh axis appears once",
                               cfg_value_where(it, where, sizeof where), key, it->text);
            }
    }
    return SIM_OK;
}

static void cfg_rules_set(cfg_config *cfg, cfg_value *rules, const char *where)
{
    cfg_entry *e = cfg_find_mut(cfg, CFG_RULES_KEY);
    SIM_ASSERT(e);
    cfg_value_free(&e->value);
    e->value = *rules;
    memset(rules, 0, sizeof *rules);
    free(e->where);
    e->where = cfg_strdup(where);
}

/* context_sharding := first axis of the activation_length rule (types.py infer_cp_axes), unless
 * the user chose it.  MaxText accepts only `context` and `expert` there; the legacy rules start
 * activation_length with 'sequence', so other axes are skipped. */
static void infer_context_sharding(cfg_config *cfg, const char *custom_name)
{
    const cfg_entry *rules = cfg_find(cfg, CFG_RULES_KEY);
    if (!rules || !cfg_find(cfg, "context_sharding") || rules->value.kind != CFG_LIST) return;
    for (int i = 0; i < rules->value.n; i++) {
        const cfg_value *r = &rules->value.items[i];
        if (strcmp(r->items[0].text, "activation_length") != 0) continue;
        const cfg_value *ax = &r->items[1];
        const char *first = NULL;
        int n_ax = ax->kind == CFG_LIST ? ax->n : (cfg_is_null(ax) ? 0 : 1);
        for (int j = 0; j < n_ax && !first; j++) {
            const char *t = ax->kind == CFG_LIST ? ax->items[j].text : ax->text;
            if (!strcmp(t, "context") || !strcmp(t, "expert")) first = t;
        }
        if (first) {
            char where[600];
            snprintf(where, sizeof where,
                     "inferred from custom_mesh_and_rule=%s (first axis of rule activation_length)", custom_name);
            cfg_set_derived(cfg, "context_sharding", first, where);
        }
        return;
    }
}

/* custom_mesh_and_rule=NAME: <dirs>/custom_mesh_and_rule/NAME.yml (or a path) replaces
 * mesh_axes, logical_axis_rules and data_sharding; its other keys must be known but are not
 * applied. */
static sim_status cfg_custom_apply(cfg_config *cfg, const cfg_value *base_vals, char *const *dirs, int n_dirs,
                                   const cfg_entry *sel, int user_set_cp)
{
    const char *name = sel->value.text;
    char *path = NULL;
    if (cfg_ends_with(name, ".yml") || cfg_ends_with(name, ".yaml") || strchr(name, '/'))
        path = cfg_file_exists(name) ? cfg_strdup(name) : NULL;
    else path = cfg_find_named_file(dirs, n_dirs, "custom_mesh_and_rule", name);
    if (!path) {
        char *sub = cfg_asprintf("%s/custom_mesh_and_rule", dirs[0]);
        char *avail = cfg_list_yml(sub);
        sim_status st = sim_err(SIM_ERR_INPUT, "custom_mesh_and_rule=%s (%s): no file %s/%s.yml; available: %s", name,
                                sel->where, sub, name, avail);
        free(sub);
        free(avail);
        return st;
    }
    cfg_layer l = {{0}, "a custom_mesh_and_rule file", 0};
    sim_status st;
    SIM_TRY_GOTO(cfg_yaml_read(cfg, path, NULL, &l.map), st, fail);
    SIM_TRY_GOTO(cfg_check_layer(cfg, base_vals, &l, 0), st, fail);
    static const char *const replaced[] = {"mesh_axes", "logical_axis_rules", "data_sharding"};
    for (int k = 0; k < 3; k++) {
        const cfg_value *v = cfg_layer_value(&l, replaced[k]);
        if (!v) continue;
        cfg_entry *e = cfg_find_mut(cfg, replaced[k]);
        cfg_value_free(&e->value);
        cfg_value_copy(&e->value, v);
        free(e->where);
        e->where = cfg_where_of(v);
    }
    if (!user_set_cp) infer_context_sharding(cfg, name);
    free(cfg->custom_file);
    cfg->custom_file = path;
    path = NULL;
fail:
    cfg_value_free(&l.map);
    free(path);
    return st;
}

sim_status cfg_check_final(const cfg_config *cfg)
{
    const cfg_entry *e = cfg_find(cfg, "mesh_axes");
    if (e) SIM_TRY(cfg_axes_check(&e->value, "key 'mesh_axes'", 0));
    e = cfg_find(cfg, CFG_RULES_KEY);
    if (e) SIM_TRY(cfg_rules_check(&e->value));
    e = cfg_find(cfg, "data_sharding");
    if (e && !cfg_is_null(&e->value)) SIM_TRY(cfg_axes_check(&e->value, "key 'data_sharding'", 1));
    return SIM_OK;
}

/* data_sharding given as a flat list means one group (pyconfig does the same). */
void cfg_data_sharding_normalize(cfg_config *cfg)
{
    cfg_entry *e = cfg_find_mut(cfg, "data_sharding");
    if (!e || e->value.kind != CFG_LIST || e->value.n == 0 || e->value.items[0].kind != CFG_SCALAR) return;
    cfg_value inner = e->value;
    memset(&e->value, 0, sizeof e->value);
    e->value.kind = CFG_LIST;
    e->value.file = inner.file;
    e->value.line = inner.line;
    *cfg_value_push(&e->value, NULL) = inner;
}

/* Appends ", merged with <where v was written>" to *where. */
static void add_source(char **where, const cfg_value *v)
{
    char *w = cfg_where_of(v);
    char *nw = cfg_asprintf("%s, merged with %s", *where, w);
    free(w);
    free(*where);
    *where = nw;
}

static int has_rules(const cfg_value *r) { return r && !cfg_is_null(r) && r->n > 0; }

void cfg_rules_merge_layers(cfg_loader *ld)
{
    cfg_config *cfg = ld->cfg;
    const cfg_entry *re = cfg_find(cfg, CFG_RULES_KEY);
    cfg_value rules = {0}, user_rules = {0};
    char *where = cfg_strdup(re ? re->where : "");
    if (re) cfg_value_copy(&rules, &re->value);
    else rules.kind = CFG_LIST;
    /* a MaxText config file's rules are the base rules, merged by name */
    for (int i = 0; i < ld->n_user; i++) {
        const cfg_value *cr = ld->user[i].config_file ? cfg_layer_value(&ld->user[i], CFG_RULES_KEY) : NULL;
        if (!has_rules(cr)) continue;
        cfg_rules_merge(&rules, cr);
        add_source(&where, cr);
    }
    const cfg_value *mr = cfg_layer_value(&ld->model, CFG_RULES_KEY);
    if (has_rules(mr)) {
        if (cfg_layer_flag(&ld->model, "override_logical_axis_rules")) {
            cfg_value_free(&rules);
            cfg_value_copy(&rules, mr);
        } else {
            cfg_rules_merge(&rules, mr);
        }
        add_source(&where, mr);
    }
    user_rules.kind = CFG_LIST;
    int user_replace = 0, any_user_rules = 0;
    for (int i = 0; i < ld->n_user; i++) {
        const cfg_layer *l = &ld->user[i];
        if (l->config_file) continue;
        const cfg_value *ur = cfg_layer_value(l, CFG_RULES_KEY);
        if (cfg_layer_value(l, "override_logical_axis_rules"))
            user_replace = cfg_layer_flag(l, "override_logical_axis_rules");
        if (!has_rules(ur)) continue;
        any_user_rules = 1;
        cfg_rules_merge(&user_rules, ur);
        add_source(&where, ur);
    }
    if (any_user_rules) {
        if (user_replace) {
            cfg_value_free(&rules);
            rules = user_rules;
            memset(&user_rules, 0, sizeof user_rules);
        } else {
            cfg_rules_merge(&rules, &user_rules);
        }
    }
    if (re) cfg_rules_set(cfg, &rules, where);
    free(where);
    cfg_value_free(&rules);
    cfg_value_free(&user_rules);
}

sim_status cfg_custom_apply_selected(cfg_loader *ld)
{
    const cfg_entry *sel = cfg_find(ld->cfg, "custom_mesh_and_rule");
    if (!sel || sel->value.kind != CFG_SCALAR || cfg_is_null(&sel->value) || !*sel->value.text) return SIM_OK;
    int user_set_cp = 0;
    for (int i = 0; i < ld->n_user; i++) user_set_cp |= cfg_layer_value(&ld->user[i], "context_sharding") != NULL;
    return cfg_custom_apply(ld->cfg, ld->base_vals, ld->dirs, ld->n_dirs, sel, user_set_cp);
}
