/* lookup.c — the config object: its entries, their hash index, lookup by key with the closest
 * key for a misspelt one, and the typed getters (see config.h). */
#include "config/internal.h"

#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Interns a string in the config (values keep `file` pointers into it). */
const char *cfg_intern(cfg_config *cfg, const char *s)
{
    for (int i = 0; i < cfg->n_strings; i++)
        if (strcmp(cfg->strings[i], s) == 0) return cfg->strings[i];
    if (cfg->n_strings == cfg->cap_strings) {
        cfg->cap_strings = cfg->cap_strings ? 2 * cfg->cap_strings : 16;
        cfg->strings = realloc(cfg->strings, (size_t)cfg->cap_strings * sizeof *cfg->strings);
        SIM_ASSERT(cfg->strings);
    }
    cfg->strings[cfg->n_strings] = cfg_strdup(s);
    return cfg->strings[cfg->n_strings++];
}

cfg_config *cfg_new(void)
{
    cfg_config *cfg = calloc(1, sizeof *cfg);
    SIM_ASSERT(cfg);
    return cfg;
}

void cfg_free(cfg_config *cfg)
{
    if (!cfg) return;
    for (int i = 0; i < cfg->n; i++) {
        free(cfg->entries[i].key);
        free(cfg->entries[i].where);
        cfg_value_free(&cfg->entries[i].value);
    }
    free(cfg->entries);
    for (int i = 0; i < cfg->n_strings; i++) free(cfg->strings[i]);
    free(cfg->strings);
    free(cfg->base_file);
    free(cfg->configs_dir);
    free(cfg->model_file);
    free(cfg->custom_file);
    free(cfg->keys_file);
    free(cfg->index);
    cfg_hw_cache_free(cfg->hw);
    free(cfg);
}

char *cfg_where_of(const cfg_value *v)
{
    char buf[1024];
    return cfg_strdup(cfg_value_where(v, buf, sizeof buf));
}

/* Moves the items of a MAP value into entries (the MAP is left empty). */
void cfg_take_map(cfg_config *cfg, cfg_value *map)
{
    cfg->entries = calloc(map->n > 0 ? (size_t)map->n : 1, sizeof *cfg->entries);
    SIM_ASSERT(cfg->entries);
    cfg->n = map->n;
    for (int i = 0; i < map->n; i++) {
        cfg_entry *e = &cfg->entries[i];
        e->key = map->keys[i];
        e->value = map->items[i];
        e->where = cfg_where_of(&e->value);
    }
    free(map->keys);
    free(map->items);
    memset(map, 0, sizeof *map);
}

/* (Re)builds the hash index of the entries (after entries are added). */
void cfg_index(cfg_config *cfg)
{
    free(cfg->index);
    cfg->index_cap = 16;
    while (cfg->index_cap < 2 * cfg->n + 2) cfg->index_cap *= 2;
    cfg->index = calloc((size_t)cfg->index_cap, sizeof *cfg->index);
    SIM_ASSERT(cfg->index);
    for (int i = 0; i < cfg->n; i++) {
        unsigned h = (unsigned)cfg_hash(cfg->entries[i].key) & (unsigned)(cfg->index_cap - 1);
        while (cfg->index[h]) h = (h + 1) & (unsigned)(cfg->index_cap - 1);
        cfg->index[h] = i + 1;
    }
    cfg->index_n = cfg->n;
}

const cfg_entry *cfg_find(const cfg_config *cfg, const char *key)
{
    if (cfg->index && cfg->index_n == cfg->n) {
        unsigned mask = (unsigned)(cfg->index_cap - 1);
        for (unsigned h = (unsigned)cfg_hash(key) & mask; cfg->index[h]; h = (h + 1) & mask)
            if (!strcmp(cfg->entries[cfg->index[h] - 1].key, key)) return &cfg->entries[cfg->index[h] - 1];
        return NULL;
    }
    for (int i = 0; i < cfg->n; i++)
        if (strcmp(cfg->entries[i].key, key) == 0) return &cfg->entries[i];
    return NULL;
}

cfg_entry *cfg_find_mut(cfg_config *cfg, const char *key) { return (cfg_entry *)cfg_find(cfg, key); }

const char *cfg_closest_key(const cfg_config *cfg, const char *key)
{
    const char *best = NULL;
    int best_d = INT_MAX;
    for (int i = 0; i < cfg->n; i++) {
        int d = cfg_edit_distance(key, cfg->entries[i].key);
        if (d < best_d) {
            best_d = d;
            best = cfg->entries[i].key;
        }
    }
    return best;
}

sim_status cfg_entry_get(const cfg_config *cfg, const char *key, const cfg_entry **out)
{
    *out = cfg_find(cfg, key);
    if (*out) return SIM_OK;
    const char *near = cfg_closest_key(cfg, key);
    return sim_err(SIM_ERR_INPUT,
                   "config key '%s' is missing: the base config %s does not define it%s%s%s; "
                   "add `%s: <value>` to the base config",
                   key, cfg->base_file ? cfg->base_file : "(none)", near ? " (closest key: '" : "", near ? near : "",
                   near ? "')" : "", key);
}

static sim_status getter_what(const cfg_config *cfg, const char *key, const cfg_entry **e, char *what, size_t cap)
{
    SIM_TRY(cfg_entry_get(cfg, key, e));
    snprintf(what, cap, "key '%s'", key);
    return SIM_OK;
}

sim_status cfg_get_int(const cfg_config *cfg, const char *key, long long *out)
{
    const cfg_entry *e;
    char what[300];
    SIM_TRY(getter_what(cfg, key, &e, what, sizeof what));
    return cfg_value_int(&e->value, what, out);
}

sim_status cfg_get_double(const cfg_config *cfg, const char *key, double *out)
{
    const cfg_entry *e;
    char what[300];
    SIM_TRY(getter_what(cfg, key, &e, what, sizeof what));
    return cfg_value_double(&e->value, what, out);
}

sim_status cfg_get_bool(const cfg_config *cfg, const char *key, int *out)
{
    const cfg_entry *e;
    char what[300];
    SIM_TRY(getter_what(cfg, key, &e, what, sizeof what));
    return cfg_value_bool(&e->value, what, out);
}

sim_status cfg_get_str(const cfg_config *cfg, const char *key, const char **out)
{
    const cfg_entry *e;
    char what[300];
    SIM_TRY(getter_what(cfg, key, &e, what, sizeof what));
    if (e->value.kind != CFG_SCALAR) return cfg_value_error(&e->value, what, "a string");
    *out = cfg_scalar_type(&e->value) == CFG_NULL ? NULL : e->value.text;
    return SIM_OK;
}

sim_status cfg_get_enum(const cfg_config *cfg, const char *key, const char *const *allowed, int n_allowed, int *out)
{
    const cfg_entry *e;
    char what[300];
    SIM_TRY(getter_what(cfg, key, &e, what, sizeof what));
    if (e->value.kind == CFG_SCALAR) {
        for (int i = 0; i < n_allowed; i++) {
            if (strcmp(e->value.text, allowed[i]) == 0) {
                *out = i;
                return SIM_OK;
            }
        }
    }
    cfg_sbuf b = {0};
    cfg_sb_putf(&b, "one of");
    for (int i = 0; i < n_allowed; i++) cfg_sb_putf(&b, "%s '%s'", i ? "," : "", allowed[i]);
    sim_status st = cfg_value_error(&e->value, what, b.s);
    free(b.s);
    return st;
}

sim_status cfg_get_str_list(const cfg_config *cfg, const char *key, const char ***items, int *n)
{
    const cfg_entry *e;
    char what[300];
    SIM_TRY(getter_what(cfg, key, &e, what, sizeof what));
    *items = NULL;
    *n = 0;
    if (e->value.kind == CFG_SCALAR && cfg_scalar_type(&e->value) == CFG_NULL) return SIM_OK;
    if (e->value.kind != CFG_LIST) return cfg_value_error(&e->value, what, "a list of names");
    for (int i = 0; i < e->value.n; i++)
        if (e->value.items[i].kind != CFG_SCALAR)
            return cfg_value_error(&e->value.items[i], what, "a name (a list item of a flat list)");
    const char **arr = calloc(e->value.n > 0 ? (size_t)e->value.n : 1, sizeof *arr);
    SIM_ASSERT(arr);
    for (int i = 0; i < e->value.n; i++) arr[i] = e->value.items[i].text;
    *items = arr;
    *n = e->value.n;
    return SIM_OK;
}

/* Sets a derived scalar value with a descriptive source. */
void cfg_set_derived(cfg_config *cfg, const char *key, const char *text, const char *where)
{
    cfg_entry *e = cfg_find_mut(cfg, key);
    SIM_ASSERT(e);
    cfg_value_free(&e->value);
    e->value.kind = CFG_SCALAR;
    e->value.text = cfg_strdup(text);
    e->value.quoted = 1;
    e->value.file = cfg_intern(cfg, where);
    e->value.line = 0;
    free(e->where);
    e->where = cfg_strdup(where);
}
