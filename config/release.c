/* release.c — configs/releases/<version>.yml: what differs between the MaxText releases followed. */
#include "config/release.h"

#include <dirent.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

struct cfg_release {
    char *configs_dir, *version; /* the cache key */
    char *file;
    cfg_config *doc; /* the parsed file (owns the values below) */
    const char *maxtext, *jax;
    char *base_rules; /* resolved path, or NULL */
    const cfg_value *names, *unknown, *errors, *refusals, *absent, *jax_rules, *grad_names, *variables, *formulas;
};

#define RELEASES_MAX 16
static cfg_release *cache[RELEASES_MAX];
static int n_cache;
static pthread_mutex_t cache_lock = PTHREAD_MUTEX_INITIALIZER;

static char *dup_str(const char *s)
{
    size_t n = strlen(s) + 1;
    char *d = malloc(n);
    SIM_ASSERT(d);
    memcpy(d, s, n);
    return d;
}

static const cfg_value *field(const cfg_config *doc, const char *key)
{
    const cfg_entry *e = cfg_find(doc, key);
    return e ? &e->value : NULL;
}

static const cfg_value *map_at(const cfg_value *map, const char *key)
{
    if (!map || map->kind != CFG_MAP) return NULL;
    for (int i = 0; i < map->n; i++)
        if (!strcmp(map->keys[i], key)) return &map->items[i];
    return NULL;
}

static const char *scalar(const cfg_value *v) { return v && v->kind == CFG_SCALAR && v->text ? v->text : NULL; }

/* "0.2.0, 0.2.5": the release files of <configs_dir>/releases (the *-rules.yml aside), malloc'd */
static char *available(const char *configs_dir)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/releases", configs_dir);
    char *out = calloc(1, 1024);
    SIM_ASSERT(out);
    DIR *d = opendir(path);
    if (!d) return out;
    char *names[64];
    int n = 0;
    for (struct dirent *e; (e = readdir(d)) && n < 64;) {
        size_t l = strlen(e->d_name);
        if (l < 5 || strcmp(e->d_name + l - 4, ".yml") || strstr(e->d_name, "-rules")) continue;
        names[n] = dup_str(e->d_name);
        names[n][l - 4] = '\0';
        n++;
    }
    closedir(d);
    for (int i = 1; i < n; i++) /* sorted, so the message does not depend on the directory order */
        for (int j = i; j > 0 && strcmp(names[j - 1], names[j]) > 0; j--) {
            char *t = names[j];
            names[j] = names[j - 1];
            names[j - 1] = t;
        }
    size_t k = 0;
    for (int i = 0; i < n; i++) {
        k += (size_t)snprintf(out + k, k < 1024 ? 1024 - k : 0, "%s%s", i ? ", " : "", names[i]);
        if (k >= 1024) k = 1023;
        free(names[i]);
    }
    return out;
}

static sim_status load(const char *configs_dir, const char *version, cfg_release **out)
{
    /* a release is a file name in releases/, never a path out of it */
    if (!version[0] || strchr(version, '/') || strchr(version, '\\') || version[0] == '.') {
        char *av = available(configs_dir);
        sim_status st = sim_err(SIM_ERR_INPUT,
                                "maxtext_release=%s is not a release name; the releases shardsim "
                                "follows: %s",
                                version, av);
        free(av);
        return st;
    }
    char path[4096];
    snprintf(path, sizeof path, "%s/releases/%s.yml", configs_dir, version);
    struct stat sb;
    if (stat(path, &sb) != 0) {
        char *av = available(configs_dir);
        sim_status st = sim_err(SIM_ERR_INPUT,
                                "maxtext_release=%s: shardsim has no data for MaxText %s (no %s); the releases it "
                                "follows: %s (set maxtext_release to one of them)",
                                version, version, path, av);
        free(av);
        return st;
    }
    cfg_release *r = calloc(1, sizeof *r);
    SIM_ASSERT(r);
    sim_status st = cfg_load_file(path, &r->doc);
    if (st != SIM_OK) {
        free(r);
        return st;
    }
    r->configs_dir = dup_str(configs_dir);
    r->version = dup_str(version);
    r->file = dup_str(path);
    r->maxtext = scalar(field(r->doc, "maxtext"));
    r->jax = scalar(field(r->doc, "jax"));
    r->names = field(r->doc, "logical_names");
    r->unknown = field(r->doc, "unknown_keys");
    r->errors = field(r->doc, "explicit_errors");
    r->refusals = field(r->doc, "refusals");
    r->absent = field(r->doc, "absent_axes");
    r->jax_rules = field(r->doc, "jax_rules");
    r->grad_names = field(r->doc, "grad_logical_names");
    r->variables = field(r->doc, "variables");
    r->formulas = field(r->doc, "formulas");
    const char *br = scalar(field(r->doc, "base_rules"));
    if (!r->maxtext || strcmp(r->maxtext, version) != 0)
        st = sim_err(SIM_ERR_INPUT, "%s: 'maxtext' must name the release of the file's name (%s)", path, version);
    else if (!r->jax) st = sim_err(SIM_ERR_INPUT, "%s: 'jax' must name the JAX release it runs on", path);
    else if ((r->names && r->names->kind != CFG_MAP) || (r->errors && r->errors->kind != CFG_MAP) ||
             (r->refusals && r->refusals->kind != CFG_MAP) || (r->absent && r->absent->kind != CFG_MAP) ||
             (r->unknown && r->unknown->kind != CFG_LIST))
        st = sim_err(SIM_ERR_INPUT,
                     "%s: logical_names, explicit_errors, absent_axes and refusals must be maps, "
                     "unknown_keys a list",
                     path);
    if (st == SIM_OK && br && br[0]) {
        char p[4096];
        snprintf(p, sizeof p, "%s/%s", configs_dir, br);
        if (stat(p, &sb) != 0) st = sim_err(SIM_ERR_INPUT, "%s: base_rules file %s does not exist", path, p);
        else r->base_rules = dup_str(p);
    }
    if (st != SIM_OK) {
        cfg_free(r->doc);
        free(r->configs_dir);
        free(r->version);
        free(r->file);
        free(r->base_rules);
        free(r);
        return st;
    }
    *out = r;
    return SIM_OK;
}

sim_status cfg_release_get(const char *configs_dir, const char *version, const cfg_release **out)
{
    pthread_mutex_lock(&cache_lock);
    for (int i = 0; i < n_cache; i++)
        if (!strcmp(cache[i]->configs_dir, configs_dir) && !strcmp(cache[i]->version, version)) {
            *out = cache[i];
            pthread_mutex_unlock(&cache_lock);
            return SIM_OK;
        }
    cfg_release *r = NULL;
    sim_status st = n_cache < RELEASES_MAX
                        ? load(configs_dir, version, &r)
                        : sim_err(SIM_ERR_INPUT, "maxtext_release=%s: more than %d release files in one process",
                                  version, RELEASES_MAX);
    if (st == SIM_OK) cache[n_cache++] = r, *out = r;
    pthread_mutex_unlock(&cache_lock);
    return st;
}

sim_status cfg_release_of(const cfg_config *cfg, const cfg_release **out)
{
    const cfg_entry *e = cfg_find(cfg, "maxtext_release");
    const char *v = e ? scalar(&e->value) : NULL;
    return cfg_release_get(cfg->configs_dir ? cfg->configs_dir : "configs", v ? v : CFG_RELEASE_DEFAULT, out);
}

const char *cfg_release_maxtext(const cfg_release *r) { return r ? r->maxtext : CFG_RELEASE_DEFAULT; }
const char *cfg_release_jax(const cfg_release *r) { return r ? r->jax : ""; }
const char *cfg_release_file(const cfg_release *r) { return r ? r->file : ""; }
const char *cfg_release_base_rules(const cfg_release *r) { return r ? r->base_rules : NULL; }

const char *cfg_release_error(const cfg_release *r, const char *id, const char *fallback)
{
    if (!r) return fallback;
    const cfg_value *e = map_at(r->errors, id);
    return e && e->kind == CFG_MAP ? scalar(map_at(e, "where")) : scalar(e);
}

const char *cfg_release_error_text(const cfg_release *r, const char *id, const char *field, const char *fallback)
{
    const cfg_value *e = r ? map_at(r->errors, id) : NULL;
    const char *t = e && e->kind == CFG_MAP ? scalar(map_at(e, field)) : NULL;
    return t ? t : fallback;
}

const char *cfg_release_refusal(const cfg_release *r, const char *id)
{
    if (!r) return "";
    return scalar(map_at(r->refusals, id));
}

bool cfg_release_lacks_key(const cfg_release *r, const char *key)
{
    if (!r || !r->unknown) return false;
    for (int i = 0; i < r->unknown->n; i++) {
        const char *k = scalar(&r->unknown->items[i]);
        if (k && !strcmp(k, key)) return true;
    }
    return false;
}

const char *cfg_release_logical_name(const cfg_release *r, const char *name)
{
    const char *n = r ? scalar(map_at(r->names, name)) : NULL;
    return n ? n : name;
}

int cfg_release_aliases(const cfg_release *r, const char *name, const char **out, int cap)
{
    int n = 0;
    if (!r || !r->names) return 0;
    for (int i = 0; i < r->names->n && n < cap; i++) {
        const char *to = scalar(&r->names->items[i]);
        if (to && !strcmp(to, name)) out[n++] = r->names->keys[i];
    }
    return n;
}

const char *cfg_release_absent_axis(const cfg_release *r, const char *axis)
{
    return r ? scalar(map_at(r->absent, axis)) : NULL;
}

const char *cfg_release_jax_rule(const cfg_release *r, const char *rule, const char *fallback)
{
    const char *v = r ? scalar(map_at(r->jax_rules, rule)) : NULL;
    return v ? v : fallback;
}

const char *cfg_release_variable(const cfg_release *r, const char *var, const char *fallback)
{
    const char *v = r ? scalar(map_at(r->variables, var)) : NULL;
    return v ? v : fallback;
}

const char *cfg_release_formula(const cfg_release *r, const char *id, const char *fallback)
{
    const char *v = r ? scalar(map_at(r->formulas, id)) : NULL;
    return v ? v : fallback;
}

sim_status cfg_release_remat_none_keeps(const cfg_config *cfg, bool *keeps)
{
    int scan = 1;
    const cfg_release *rel;
    SIM_TRY(cfg_get_bool(cfg, "scan_layers", &scan));
    SIM_TRY(cfg_release_of(cfg, &rel));
    *keeps = !scan && !strcmp(cfg_release_formula(rel, "remat_none_unscanned", "kept"), "kept");
    return SIM_OK;
}

int cfg_release_grad_names(const cfg_release *r, const char *path, const char **names, int cap)
{
    if (!r || !r->grad_names || r->grad_names->kind != CFG_MAP) return 0;
    size_t pl = strlen(path);
    for (int i = 0; i < r->grad_names->n; i++) {
        const char *suf = r->grad_names->keys[i];
        size_t sl = strlen(suf);
        const cfg_value *v = &r->grad_names->items[i];
        if (sl > pl || strcmp(path + pl - sl, suf) || v->kind != CFG_LIST) continue;
        int n = 0;
        for (int k = 0; k < v->n && n < cap; k++) {
            const char *t = scalar(&v->items[k]);
            names[n++] = t && cfg_scalar_type(&v->items[k]) != CFG_NULL ? t : NULL;
        }
        return n;
    }
    return 0;
}
