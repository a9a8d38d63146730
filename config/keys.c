/* keys.c — configs/keys.yml, the key contract (see keys.h): parsed once per process, every entry
 * classed and typed by it, and after merging every changed key checked against its class,
 * `simulated` list and MaxText's `choices`. */
#include "config/internal.h"

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

static const char *const KEY_CLASS_NAMES[] = {"unclassified", "honoured", "inert", "refused"};

static const char *const KEY_TYPES[] = {"bool", "int", "float", "str", "list", "map", "any"};

const char *cfg_key_class_name(cfg_key_class c) { return (unsigned)c < 4 ? KEY_CLASS_NAMES[c] : "?"; }

const cfg_value *cfg_entry_field(const cfg_entry *e, const char *field)
{
    return e->spec ? cfg_map_get(e->spec, field) : NULL;
}

/* Checks one keys.yml line: a map with a known class and type. */
static sim_status registry_check_line(const char *key, const cfg_value *spec)
{
    char where[512];
    cfg_value_where(spec, where, sizeof where);
    if (spec->kind != CFG_MAP)
        return sim_err(SIM_ERR_INPUT, "%s: key '%s' must be a map like {class: inert, type: int, default: 0, why: ...}",
                       where, key);
    const char *c = cfg_map_text(spec, "class");
    int ok = 0;
    for (int k = 1; c && k < 4; k++) ok |= !strcmp(c, KEY_CLASS_NAMES[k]);
    if (!ok)
        return sim_err(SIM_ERR_INPUT, "%s: key '%s' has class '%s'; expected honoured, inert or refused", where, key,
                       c ? c : "(none)");
    const char *t = cfg_map_text(spec, "type");
    ok = 0;
    for (size_t k = 0; t && k < sizeof KEY_TYPES / sizeof *KEY_TYPES; k++) ok |= !strcmp(t, KEY_TYPES[k]);
    if (!ok)
        return sim_err(SIM_ERR_INPUT, "%s: key '%s' has type '%s'; expected bool, int, float, str, list, map or any",
                       where, key, t ? t : "(none)");
    return SIM_OK;
}

/* ---- a small hash index of names (open addressing) ---- */

typedef struct {
    int cap;   /* power of two, > 2 x count */
    int *slot; /* position + 1, 0 = empty */
} name_index;

/* names(arg, i) gives the i-th name. */
static void name_index_build(name_index *ix, int n, const char *(*names)(const void *, int), const void *arg)
{
    ix->cap = 16;
    while (ix->cap < 2 * n + 2) ix->cap *= 2;
    ix->slot = calloc((size_t)ix->cap, sizeof *ix->slot);
    SIM_ASSERT(ix->slot);
    for (int i = 0; i < n; i++) {
        unsigned h = (unsigned)cfg_hash(names(arg, i)) & (unsigned)(ix->cap - 1);
        while (ix->slot[h]) h = (h + 1) & (unsigned)(ix->cap - 1);
        ix->slot[h] = i + 1;
    }
}

static int name_index_get(const name_index *ix, const char *key, const char *(*names)(const void *, int),
                          const void *arg)
{
    if (!ix->slot) return -1;
    for (unsigned h = (unsigned)cfg_hash(key) & (unsigned)(ix->cap - 1); ix->slot[h];
         h = (h + 1) & (unsigned)(ix->cap - 1))
        if (!strcmp(names(arg, ix->slot[h] - 1), key)) return ix->slot[h] - 1;
    return -1;
}

static const char *map_key_at(const void *map, int i) { return ((const cfg_value *)map)->keys[i]; }
static const char *entry_key_at(const void *cfg, int i) { return ((const cfg_config *)cfg)->entries[i].key; }

/* ---- keys.yml, parsed once per process ---- */

/* Loading a config is frequent (parity loads one per configuration, the key
 * test hundreds) and keys.yml is ~800 lines, so its parse is kept for the
 * process, keyed by path and modification time; configs point into it. */
typedef struct {
    char *path;
    struct timespec mtime;
    cfg_config *holder; /* owns the parsed file (strings, values) */
    cfg_value keys;
    name_index ix;
} registry_cache;

static pthread_mutex_t registry_lock = PTHREAD_MUTEX_INITIALIZER;

static registry_cache registry_cached[4];

/* Parses keys.yml at path into a free slot of the cache (the oldest makes room: a process rarely
 * sees more than one keys.yml); called with the lock held. */
static sim_status registry_parse(const char *path, const struct stat *sb, registry_cache **out)
{
    cfg_config *holder = cfg_new();
    cfg_value doc = {0};
    sim_status st;
    SIM_TRY_GOTO(cfg_yaml_read(holder, path, NULL, &doc), st, fail);
    int ki = doc.kind == CFG_MAP ? cfg_map_index(&doc, "keys") : -1;
    if (ki < 0 || doc.items[ki].kind != CFG_MAP)
        SIM_TRY_GOTO(
            sim_err(SIM_ERR_INPUT, "%s: expected a top-level map `keys:` of key -> {class, type, default, why}", path),
            st, fail);
    for (int i = 0; i < doc.items[ki].n; i++)
        SIM_TRY_GOTO(registry_check_line(doc.items[ki].keys[i], &doc.items[ki].items[i]), st, fail);
    registry_cache *c = &registry_cached[0];
    for (int i = 0; i < 4; i++)
        if (!registry_cached[i].path) {
            c = &registry_cached[i];
            break;
        }
    if (c->path) {
        free(c->path);
        cfg_value_free(&c->keys);
        cfg_free(c->holder);
        free(c->ix.slot);
    }
    c->path = cfg_strdup(path);
    c->mtime = sb->st_mtim;
    c->holder = holder;
    c->keys = doc.items[ki];
    memset(&doc.items[ki], 0, sizeof doc.items[ki]);
    name_index_build(&c->ix, c->keys.n, map_key_at, &c->keys);
    holder = NULL;
    *out = c;
fail:
    cfg_value_free(&doc);
    cfg_free(holder);
    return st;
}

static sim_status registry_get(const char *path, const registry_cache **out)
{
    struct stat sb;
    if (stat(path, &sb) != 0) return sim_err(SIM_ERR_IO, "cannot read %s: %s", path, strerror(errno));
    pthread_mutex_lock(&registry_lock);
    registry_cache *c = NULL;
    for (int i = 0; i < 4 && !c; i++)
        if (registry_cached[i].path && !strcmp(registry_cached[i].path, path) &&
            registry_cached[i].mtime.tv_sec == sb.st_mtim.tv_sec &&
            registry_cached[i].mtime.tv_nsec == sb.st_mtim.tv_nsec)
            c = &registry_cached[i];
    sim_status st = c ? SIM_OK : registry_parse(path, &sb, &c);
    pthread_mutex_unlock(&registry_lock);
    *out = c;
    return st;
}

/* Reads <configs_dir>/keys.yml when it exists: classes every entry, adds the
 * keys the base file lacks with their keys.yml default. */
sim_status cfg_keys_apply(cfg_config *cfg, const char *configs_dir)
{
    char *path = cfg_join_path(configs_dir, "keys.yml");
    if (!cfg_file_exists(path)) {
        free(path);
        return SIM_OK;
    }
    const registry_cache *rc = NULL;
    sim_status st = registry_get(path, &rc);
    if (st != SIM_OK) {
        free(path);
        return st;
    }
    cfg->keys_file = path;
    cfg->registry = &rc->keys;
    const cfg_value *reg = cfg->registry;
    /* every key of the base file needs a class */
    for (int i = 0; i < cfg->n; i++)
        if (name_index_get(&rc->ix, cfg->entries[i].key, map_key_at, reg) < 0)
            return sim_err(SIM_ERR_INPUT,
                           "%s: key '%s' has no line in %s; every key needs a class: add `%s: {class: honoured|inert|"
                           "refused, type: ..., why: ...}` there",
                           cfg->entries[i].where, cfg->entries[i].key, path, cfg->entries[i].key);
    /* keys the base file lacks: the keys.yml default */
    name_index base_ix;
    name_index_build(&base_ix, cfg->n, entry_key_at, cfg);
    int n_base = cfg->n;
    cfg->entries = realloc(cfg->entries, (size_t)(cfg->n + reg->n + 1) * sizeof *cfg->entries);
    SIM_ASSERT(cfg->entries);
    for (int i = 0; i < reg->n && st == SIM_OK; i++) {
        int at = name_index_get(&base_ix, reg->keys[i], entry_key_at, cfg);
        if (at >= 0 && at < n_base) continue;
        const cfg_value *def = cfg_map_get(&reg->items[i], "default");
        if (!def) {
            char where[512];
            st = sim_err(SIM_ERR_INPUT,
                         "%s: key '%s' has no default and the base config %s does not set it; add "
                         "`default: ...` to its line",
                         cfg_value_where(&reg->items[i], where, sizeof where), reg->keys[i], cfg->base_file);
            break;
        }
        cfg_entry *e = &cfg->entries[cfg->n++];
        memset(e, 0, sizeof *e);
        e->key = cfg_strdup(reg->keys[i]);
        cfg_value_copy(&e->value, def);
        e->where = cfg_where_of(def);
    }
    free(base_ix.slot);
    for (int i = 0; i < cfg->n && st == SIM_OK; i++) {
        cfg_entry *e = &cfg->entries[i];
        e->spec = &reg->items[name_index_get(&rc->ix, e->key, map_key_at, reg)];
        const char *c = cfg_map_text(e->spec, "class");
        for (int k = 1; k < 4; k++)
            if (!strcmp(c, KEY_CLASS_NAMES[k])) e->cls = (cfg_key_class)k;
        e->why = cfg_map_text(e->spec, "why");
    }
    cfg_index(cfg);
    return st;
}

static int value_in_list(const cfg_value *v, const cfg_value *list)
{
    if (!list || list->kind != CFG_LIST) return 0;
    for (int i = 0; i < list->n; i++)
        if (cfg_value_equal(v, &list->items[i])) return 1;
    return 0;
}

/* After merging: marks changed keys, refuses what is not simulated. */
sim_status cfg_keys_check(cfg_config *cfg, const cfg_value *base_vals, int n_base)
{
    if (!cfg->keys_file) return SIM_OK;
    for (int i = 0; i < cfg->n && i < n_base; i++) {
        cfg_entry *e = &cfg->entries[i];
        e->changed = !cfg_value_equal(&e->value, &base_vals[i]);
        if (!e->changed) continue;
        char *text = cfg_value_to_text(&e->value, 0);
        char *dtext = cfg_value_to_text(&base_vals[i], 0);
        const cfg_value *choices = cfg_entry_field(e, "choices");
        const cfg_value *sim = cfg_entry_field(e, "simulated");
        sim_status st = SIM_OK;
        if (choices && !value_in_list(&e->value, choices)) {
            char *ctext = cfg_value_to_text(choices, 0);
            st = sim_err(SIM_ERR_INPUT, "%s: %s=%s is not a value MaxText accepts; use one of %s (default %s)",
                         e->where, e->key, text, ctext, dtext);
            free(ctext);
        } else if (e->cls == CFG_KEY_REFUSED) {
            st = sim_err(SIM_ERR_INPUT,
                         "%s: %s=%s is refused: %s. shardsim does not simulate this feature and will not answer "
                         "for a configuration it did not simulate; remove the key (default %s) or use MaxText itself",
                         e->where, e->key, text, e->why ? e->why : "not simulated", dtext);
        } else if (sim && !value_in_list(&e->value, sim)) {
            char *stext = cfg_value_to_text(sim, 0);
            st = sim_err(SIM_ERR_INPUT,
                         "%s: %s=%s is refused: shardsim simulates only %s in %s%s%s%s; choose one of those", e->where,
                         e->key, text, e->key, stext, e->why ? " (" : "", e->why ? e->why : "", e->why ? ")" : "");
            free(stext);
        }
        free(text);
        free(dtext);
        if (st != SIM_OK) return st;
    }
    return SIM_OK;
}

sim_status cfg_keys_unknown(const cfg_config *cfg, const char *key, const cfg_value *v, const char *layer)
{
    char where[512];
    const char *near = cfg_closest_key(cfg, key);
    if (cfg->keys_file)
        return sim_err(SIM_ERR_INPUT,
                       "%s: unknown key '%s' in %s: neither MaxText nor shardsim has such a key (%s lists every "
                       "key)%s%s%s; check the spelling (`shardsim keys PATTERN` searches the keys)",
                       cfg_value_where(v, where, sizeof where), key, layer, cfg->keys_file,
                       near ? "; did you mean '" : "", near ? near : "", near ? "'?" : "");
    return sim_err(SIM_ERR_INPUT,
                   "%s: unknown key '%s' in %s: the base config %s has no such key%s%s%s; "
                   "check the spelling, or add the key to the base config",
                   cfg_value_where(v, where, sizeof where), key, layer, cfg->base_file, near ? "; did you mean '" : "",
                   near ? near : "", near ? "'?" : "");
}

/* The value must have the type of the base default (data as schema). */
sim_status cfg_keys_check_type(const cfg_entry *e, const cfg_value *base, const cfg_value *v)
{
    char what[300], where[512];
    snprintf(what, sizeof what, "key '%s'", e->key);
    int v_null = v->kind == CFG_SCALAR && cfg_scalar_type(v) == CFG_NULL;
    const char *expected = NULL;
    /* the default itself always passes (MaxText writes '' for some list keys) */
    if (cfg_value_equal(v, base)) return SIM_OK;
    const char *rtype = e->spec ? cfg_map_text(e->spec, "type") : NULL;
    int null_ok = base->kind == CFG_SCALAR && cfg_scalar_type(base) == CFG_NULL;
    if (rtype) {
        /* keys.yml types the value (MaxText's type); null only where the default is null */
        cfg_type vt = cfg_scalar_type(v);
        long long i;
        if (!strcmp(rtype, "any") || (v_null && null_ok)) expected = NULL;
        else if (!strcmp(rtype, "list")) expected = v->kind == CFG_LIST || v_null ? NULL : "a list";
        else if (!strcmp(rtype, "map")) expected = v->kind == CFG_MAP || v_null ? NULL : "a map";
        else if (v->kind != CFG_SCALAR) expected = !strcmp(rtype, "str") ? "a string" : "a scalar";
        else if (!strcmp(rtype, "bool")) expected = vt == CFG_BOOL ? NULL : cfg_type_name(CFG_BOOL);
        else if (!strcmp(rtype, "int"))
            expected = vt == CFG_INT || (vt == CFG_FLOAT && cfg_value_int(v, what, &i) == SIM_OK)
                           ? NULL
                           : cfg_type_name(CFG_INT);
        else if (!strcmp(rtype, "float")) expected = vt == CFG_INT || vt == CFG_FLOAT ? NULL : cfg_type_name(CFG_FLOAT);
        sim_err_clear();
    } else if (base->kind == CFG_LIST) {
        if (v->kind != CFG_LIST && !v_null) expected = "a list";
    } else if (base->kind == CFG_MAP) {
        if (v->kind != CFG_MAP && !v_null) expected = "a map";
    } else {
        cfg_type bt = cfg_scalar_type(base);
        cfg_type vt = cfg_scalar_type(v);
        if (bt == CFG_NULL) {
            /* no default type: anything goes */
        } else if (v->kind != CFG_SCALAR) {
            expected = bt == CFG_STRING ? "a string" : cfg_type_name(bt);
        } else if (bt == CFG_BOOL) {
            if (vt != CFG_BOOL) expected = cfg_type_name(bt);
        } else if (bt == CFG_INT) {
            long long i;
            if (vt != CFG_INT && !(vt == CFG_FLOAT && cfg_value_int(v, what, &i) == SIM_OK))
                expected = cfg_type_name(bt);
        } else if (bt == CFG_FLOAT) {
            if (vt != CFG_INT && vt != CFG_FLOAT) expected = cfg_type_name(bt);
        }
    }
    if (!expected) return SIM_OK;
    char *text = cfg_value_to_text(v, 0);
    char *btext = cfg_value_to_text(base, 0);
    sim_status st =
        sim_err(SIM_ERR_INPUT, "%s: key '%s' = %s is %s, expected %s (its default is %s at %s)",
                cfg_value_where(v, where, sizeof where), e->key, text, cfg_kind_name(v), expected, btext, e->where);
    free(text);
    free(btext);
    return st;
}
