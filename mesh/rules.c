/* rules.c — rule tables from configs and flax/MaxText resolution (see rules.h). */
#include "mesh/rules.h"

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "config/release.h"

/* ---- resolution memo --------------------------------------------------------
 * A training step resolves the same few dozen logical-name tuples once per
 * layer, pass and device (a 256-device dry run of a 61-layer model: millions
 * of resolutions, each a scan of the rule table with string compares).  Each
 * thread keeps the results it made, keyed by the rule table and the names;
 * any change to any rule table (init, add, free, load) bumps a global epoch
 * that empties every thread's memo, and a different mesh empties it too.
 * Failed resolutions are never kept (they are recomputed for their message). */

enum { MEMO_SLOTS = 64, MEMO_KEY = 160 };

typedef struct {
    unsigned long gen; /* valid while equal to memo_gen */
    const mesh_rules *r;
    int rank;
    uint64_t hash;
    char key[MEMO_KEY]; /* the names, each NUL-terminated ("\1" for None) */
    int key_len;
    mesh_resolved res;
} memo_slot;

static unsigned long rules_epoch = 1; /* atomically bumped on every rule-table change */
static _Thread_local unsigned long memo_epoch, memo_gen;
static _Thread_local mesh_shape memo_mesh;
static _Thread_local memo_slot memo[MEMO_SLOTS];

static void rules_changed(void) { __atomic_add_fetch(&rules_epoch, 1, __ATOMIC_RELEASE); }

/* Packs the names into key; -1 when they do not fit (then no memo). */
static int memo_key(int rank, const char *const *names, char *key, uint64_t *hash)
{
    int n = 0;
    uint64_t h = 1469598103934665603ull ^ (uint64_t)rank;
    for (int d = 0; d < rank; d++) {
        const char *s = names[d] ? names[d] : "\1";
        size_t l = strlen(s) + 1;
        if (n + (int)l > MEMO_KEY) return -1;
        memcpy(key + n, s, l);
        for (size_t i = 0; i < l; i++) h = (h ^ (unsigned char)s[i]) * 1099511628211ull;
        n += (int)l;
    }
    *hash = h;
    return n;
}

static memo_slot *memo_find(const mesh_rules *r, const mesh_shape *m, int rank, const char *key, int key_len,
                            uint64_t hash, bool *hit)
{
    unsigned long epoch = __atomic_load_n(&rules_epoch, __ATOMIC_ACQUIRE);
    if (epoch != memo_epoch || memcmp(&memo_mesh, m, sizeof *m)) {
        memo_gen++; /* empties every slot without touching them (256 device threads: memory stays unpaged) */
        memo_mesh = *m;
        memo_epoch = epoch;
    }
    memo_slot *s = &memo[(hash ^ (uintptr_t)r) % MEMO_SLOTS];
    *hit = s->gen == memo_gen && s->r == r && s->rank == rank && s->hash == hash && s->key_len == key_len &&
           !memcmp(s->key, key, (size_t)key_len);
    return s;
}

static char *dup_str(const char *s)
{
    char *d = strdup(s ? s : "");
    SIM_ASSERT(d);
    return d;
}

void mesh_rules_init(mesh_rules *r)
{
    rules_changed();
    memset(r, 0, sizeof *r);
}

void mesh_rules_free(mesh_rules *r)
{
    rules_changed();
    for (int i = 0; i < r->n; i++) {
        mesh_rule *x = &r->rules[i];
        for (int j = 0; j < x->n_axes; j++) free(x->axes[j]);
        free(x->axes);
        free(x->name);
        free(x->where);
    }
    free(r->rules);
    memset(r, 0, sizeof *r);
}

static mesh_rule *rules_push(mesh_rules *r, const char *name, int n, const char *where)
{
    rules_changed();
    if (r->n == r->cap) {
        r->cap = r->cap ? 2 * r->cap : 32;
        r->rules = realloc(r->rules, (size_t)r->cap * sizeof *r->rules);
        SIM_ASSERT(r->rules);
    }
    mesh_rule *x = &r->rules[r->n++];
    x->name = dup_str(name);
    x->n_axes = n;
    x->axes = calloc(n > 0 ? (size_t)n : 1, sizeof *x->axes);
    SIM_ASSERT(x->axes);
    x->where = dup_str(where);
    return x;
}

void mesh_rules_add(mesh_rules *r, const char *name, int n, const char *const *axes)
{
    mesh_rule *x = rules_push(r, name, n, "");
    for (int j = 0; j < n; j++) x->axes[j] = dup_str(axes[j]);
    rules_changed();
}

static int scalar_is_null(const cfg_value *v) { return v->kind == CFG_SCALAR && cfg_scalar_type(v) == CFG_NULL; }

sim_status mesh_rules_from_value(const cfg_value *list, mesh_rules *out)
{
    mesh_rules_init(out);
    if (scalar_is_null(list)) return SIM_OK;
    char where[512];
    if (list->kind != CFG_LIST)
        return sim_err(SIM_ERR_INPUT, "%s: logical_axis_rules must be a list of [logical_name, mesh_axes] pairs",
                       cfg_value_where(list, where, sizeof where));
    for (int i = 0; i < list->n; i++) {
        const cfg_value *it = &list->items[i];
        cfg_value_where(it, where, sizeof where);
        const cfg_value *ax = it->kind == CFG_LIST && it->n == 2 ? &it->items[1] : NULL;
        int ok = ax && it->items[0].kind == CFG_SCALAR && !scalar_is_null(&it->items[0]);
        if (ok && ax->kind == CFG_LIST)
            for (int j = 0; j < ax->n; j++) ok &= ax->items[j].kind == CFG_SCALAR && !scalar_is_null(&ax->items[j]);
        if (ok && ax->kind == CFG_MAP) ok = 0;
        if (!ok) {
            char *t = cfg_value_to_text(it, 0);
            sim_status st = sim_err(SIM_ERR_INPUT,
                                    "%s: logical_axis_rules item %d is %s; expected [logical_name, "
                                    "mesh_axes] with mesh_axes a name, a list of names, or []",
                                    where, i, t);
            free(t);
            mesh_rules_free(out);
            return st;
        }
        mesh_rule *x;
        if (ax->kind == CFG_LIST) {
            x = rules_push(out, it->items[0].text, ax->n, where);
            for (int j = 0; j < ax->n; j++) {
                for (int k = 0; k < j; k++)
                    if (strcmp(x->axes[k], ax->items[j].text) == 0) {
                        sim_status st =
                            sim_err(SIM_ERR_INPUT, "%s: logical_axis_rules rule '%s' lists mesh axis '%s' twice", where,
                                    x->name, ax->items[j].text);
                        x->n_axes = j;
                        mesh_rules_free(out);
                        return st;
                    }
                x->axes[j] = dup_str(ax->items[j].text);
            }
        } else if (scalar_is_null(ax)) {
            rules_push(out, it->items[0].text, 0, where);
        } else {
            x = rules_push(out, it->items[0].text, 1, where);
            x->axes[0] = dup_str(ax->text);
        }
    }
    return SIM_OK;
}

sim_status mesh_rules_from_config(const cfg_config *cfg, mesh_rules *out)
{
    const cfg_entry *e;
    mesh_rules_init(out);
    SIM_TRY(cfg_entry_get(cfg, "logical_axis_rules", &e));
    SIM_TRY(mesh_rules_from_value(&e->value, out));
    /* A release that names a dim differently from the models here (maxtext_release's logical_names:
     * 0.2.0 writes 'embed' where 0.2.5 writes 'embed_attn'): each of its rules also applies, at
     * the same priority, to the names it stands for, and a renamed name's own rules (0.2.0's
     * 'activation_length', which its default attention and MLP do not use) are dropped.  No tensor
     * carries both names, so this is the release's resolution of that dim. */
    const cfg_release *rel = NULL;
    if (!cfg_find(cfg, "maxtext_release")) return SIM_OK;
    SIM_TRY(cfg_release_of(cfg, &rel));
    const char *alias[16];
    bool any = false;
    for (int i = 0; i < out->n && !any; i++) any = cfg_release_aliases(rel, out->rules[i].name, alias, 16) > 0;
    if (!any) return SIM_OK;
    mesh_rules all;
    mesh_rules_init(&all);
    for (int i = 0; i < out->n; i++) {
        const mesh_rule *x = &out->rules[i];
        int na = cfg_release_aliases(rel, x->name, alias, 16);
        bool renamed = strcmp(cfg_release_logical_name(rel, x->name), x->name) != 0;
        for (int k = renamed ? 0 : -1; k < na; k++) {
            mesh_rule *y = rules_push(&all, k < 0 ? x->name : alias[k], x->n_axes, x->where);
            for (int j = 0; j < x->n_axes; j++) y->axes[j] = dup_str(x->axes[j]);
        }
    }
    mesh_rules_free(out);
    *out = all;
    rules_changed();
    return SIM_OK;
}

int mesh_rules_find(const mesh_rules *r, const char *name)
{
    for (int i = 0; i < r->n; i++)
        if (strcmp(r->rules[i].name, name) == 0) return i;
    return -1;
}

static sim_status resolve(const mesh_rules *r, const mesh_shape *m, const char *tensor, int rank,
                          const char *const *names, mesh_resolved *out)
{
    const char *what = tensor ? tensor : "(unnamed)";
    if (rank < 0 || rank > MESH_SPEC_MAX_RANK)
        return sim_err(SIM_ERR_INPUT, "tensor '%s' has rank %d; shardsim supports rank 0 to %d", what, rank,
                       MESH_SPEC_MAX_RANK);
    for (int d = 0; d < rank; d++)
        for (int e = 0; e < d && names[d]; e++)
            if (names[e] && strcmp(names[d], names[e]) == 0)
                return sim_err(SIM_ERR_INPUT,
                               "tensor '%s': logical axis name '%s' names dims %d and %d; a logical "
                               "name may name one dim only",
                               what, names[d], e, d);
    /* Step 2: scan the rules in table order.  `used` holds the axis names
     * assigned so far (by name: sizes and mesh membership do not matter). */
    const char *used[MESH_SPEC_MAX_RANK * 64];
    int n_used = 0;
    for (int d = 0; d < rank; d++) out->rule[d] = -1;
    int assigned[MESH_SPEC_MAX_RANK] = {0};
    for (int i = 0; i < r->n; i++) {
        const mesh_rule *x = &r->rules[i];
        int pos = -1;
        for (int d = 0; d < rank && pos < 0; d++)
            if (names[d] && strcmp(names[d], x->name) == 0) pos = d;
        if (pos < 0 || assigned[pos]) continue;
        int clash = 0;
        for (int j = 0; j < x->n_axes && !clash; j++)
            for (int k = 0; k < n_used && !clash; k++) clash = strcmp(x->axes[j], used[k]) == 0;
        if (clash) continue;
        assigned[pos] = 1;
        out->rule[pos] = i;
        for (int j = 0; j < x->n_axes && n_used < (int)(sizeof used / sizeof used[0]); j++) used[n_used++] = x->axes[j];
    }
    /* Steps 3-4: map to mesh indices, drop absent axes, then size-1 axes. */
    mesh_spec_init(&out->unpruned, rank);
    for (int d = 0; d < rank; d++) {
        if (out->rule[d] < 0) continue;
        const mesh_rule *x = &r->rules[out->rule[d]];
        int n = 0;
        for (int j = 0; j < x->n_axes; j++) {
            int a = mesh_shape_axis_index(m, x->axes[j]);
            if (a >= 0) out->unpruned.axes[d][n++] = (int8_t)a;
        }
        out->unpruned.n_axes[d] = n;
    }
    /* The name check above keeps axes apart across dims; a rule that lists an
     * axis twice (possible via mesh_rules_add) is caught here. */
    if (mesh_spec_check(&out->unpruned, m) != SIM_OK) {
        sim_err_append(" (resolving tensor '%s')", what);
        return SIM_ERR_INPUT;
    }
    out->spec = out->unpruned;
    mesh_spec_drop_size_one(&out->spec, m);
    return SIM_OK;
}

sim_status mesh_rules_resolve(const mesh_rules *r, const mesh_shape *m, const char *tensor, int rank,
                              const char *const *names, mesh_resolved *out)
{
    char key[MEMO_KEY];
    uint64_t hash;
    int key_len = rank >= 0 && rank <= MESH_SPEC_MAX_RANK ? memo_key(rank, names, key, &hash) : -1;
    if (key_len < 0) return resolve(r, m, tensor, rank, names, out);
    bool hit;
    memo_slot *s = memo_find(r, m, rank, key, key_len, hash, &hit);
    if (hit) {
        *out = s->res;
        return SIM_OK;
    }
    SIM_TRY(resolve(r, m, tensor, rank, names, out));
    s->gen = memo_gen;
    s->r = r;
    s->rank = rank;
    s->hash = hash;
    s->key_len = key_len;
    memcpy(s->key, key, (size_t)key_len);
    s->res = *out;
    return SIM_OK;
}
