/* xla_truth.c — see xla_truth.h. */
#include "bench/lib/xla_truth.h"

#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench/lib/bench_run.h"

/* XLA's HLO opcode names of the kinds, in sim_op order (aot.py's tpu_hlo_bytes.py writes these). */
static const char *const XLA_KIND[XT_NKINDS] = {"all-gather", "reduce-scatter",     "all-reduce",
                                                "all-to-all", "collective-permute", "ragged-all-to-all"};

static bool fail(char *err, size_t cap, const char *path, const char *what)
{
    snprintf(err, cap, "%s: %s", path, what);
    return false;
}

static double num(const json_t *o, const char *k)
{
    const json_t *v = json_object_get(o, k);
    return json_is_number(v) ? json_number_value(v) : NAN;
}

static bool load_config(const json_t *j, xt_config *c, const char *path, char *err, size_t cap)
{
    const char *name = json_string_value(json_object_get(j, "name"));
    const char *topo = json_string_value(json_object_get(j, "topology"));
    const json_t *keys = json_object_get(j, "keys");
    if (!name || !topo || !json_is_array(keys) || json_array_size(keys) > XT_MAX_KEYS)
        return fail(err, cap, path, "a configuration lacks name, topology or keys (at most 24)");
    snprintf(c->name, sizeof c->name, "%s", name);
    snprintf(c->topology, sizeof c->topology, "%s", topo);
    c->num_devices = (int)num(j, "num_devices");
    c->num_slices = json_object_get(j, "num_slices") ? (int)num(j, "num_slices") : 1;
    for (size_t i = 0; i < json_array_size(keys); i++) {
        const char *k = json_string_value(json_array_get(keys, i));
        if (!k) return fail(err, cap, path, "a key is not a string");
        c->keys[c->nkeys++] = strdup(k);
    }
    const char *miss = json_string_value(json_object_get(j, "known_miss"));
    snprintf(c->miss, sizeof c->miss, "%s", miss ? miss : "");
    const char *status = json_string_value(json_object_get(j, "status"));
    c->compiled = status && !strcmp(status, "compiled");
    const char *e = json_string_value(json_object_get(j, "error"));
    snprintf(c->error, sizeof c->error, "%s", e ? e : (status ? status : "not compiled"));
    if (!c->compiled) return true;
    const json_t *mem = json_object_get(j, "memory");
    c->peak = num(mem, "peak_bytes");
    c->arguments = num(mem, "arguments_bytes");
    c->temporaries = num(mem, "temporaries_bytes");
    if (!(c->peak > 0)) return fail(err, cap, path, "a compiled configuration has no memory.peak_bytes");
    const json_t *coll = json_object_get(j, "collectives");
    const char *kind;
    const json_t *v;
    json_object_foreach((json_t *)coll, kind, v)
    {
        int k = 0;
        while (k < XT_NKINDS && strcmp(XLA_KIND[k], kind)) k++;
        if (k == XT_NKINDS) return fail(err, cap, path, "an unknown collective kind");
        c->kind_bytes[k] = num(v, "bytes_sent_per_device");
    }
    return true;
}

bool xt_load(const char *path, xt_set *out, char *err, size_t cap)
{
    memset(out, 0, sizeof *out);
    json_error_t je;
    json_t *root = json_load_file(path, 0, &je);
    if (!root) {
        snprintf(err, cap, "%s: line %d: %s", path, je.line, je.text);
        return false;
    }
    const json_t *cs = json_object_get(root, "configs");
    bool ok = json_is_array(cs) && json_array_size(cs) > 0;
    if (!ok) fail(err, cap, path, "no 'configs' list");
    const json_t *ver = json_object_get(root, "versions");
    if (ver) {
        char *s = json_dumps(ver, JSON_COMPACT | JSON_SORT_KEYS);
        snprintf(out->versions, sizeof out->versions, "%s", s ? s : "");
        free(s);
    }
    if (ok) {
        out->c = calloc(json_array_size(cs), sizeof *out->c);
        for (size_t i = 0; ok && i < json_array_size(cs); i++)
            ok = load_config(json_array_get(cs, i), &out->c[out->n++], path, err, cap);
    }
    json_decref(root);
    if (!ok) xt_free(out);
    return ok;
}

void xt_free(xt_set *s)
{
    for (int i = 0; i < s->n; i++)
        for (int k = 0; k < s->c[i].nkeys; k++) free(s->c[i].keys[k]);
    free(s->c);
    memset(s, 0, sizeof *s);
}

double xt_share(const xt_config *c, int k)
{
    double tot = 0;
    for (int i = 0; i < XT_NKINDS; i++) tot += c->kind_bytes[i];
    return tot > 0 ? c->kind_bytes[k] / tot : 0;
}

void xt_compare(const xt_config *c, xt_result *r)
{
    memset(r, 0, sizeof *r);
    char topo[64], slices[64];
    snprintf(topo, sizeof topo, "compile_topology=%s", c->topology);
    snprintf(slices, sizeof slices, "compile_topology_num_slices=%d", c->num_slices);
    const char *words[XT_MAX_KEYS + 4];
    int n = 0;
    for (int k = 0; k < c->nkeys; k++) words[n++] = c->keys[k];
    words[n++] = topo;
    words[n++] = slices;
    words[n++] = "dry_run=true";
    words[n++] = "steps=1";
    bench_result br;
    bench_run(c->name, words, n, 1, &br);
    if (br.refused) {
        r->refused = true;
        snprintf(r->why, sizeof r->why, "%s", br.why);
        return;
    }
    r->peak = (double)br.peak;
    memcpy(r->at_peak, br.at_peak, sizeof r->at_peak);
    for (int i = 0; i < br.nrows; i++) r->kind_bytes[br.rows[i].op] += br.rows[i].bytes;
    r->peak_ratio = r->peak / c->peak;
    r->peak_ok = fabs(r->peak_ratio - 1) <= XT_PEAK_TOL;
    r->all_ok = r->peak_ok;
    double ss_tot = 0;
    for (int k = 0; k < XT_NKINDS; k++) ss_tot += r->kind_bytes[k];
    for (int k = 0; k < XT_NKINDS; k++) {
        r->kind_ratio[k] = c->kind_bytes[k] > 0 ? r->kind_bytes[k] / c->kind_bytes[k] : INFINITY;
        /* a kind either side sends at least the minimum share of: one XLA has not is a miss too */
        bool big =
            xt_share(c, k) >= XT_KIND_MIN_SHARE || (ss_tot > 0 && r->kind_bytes[k] / ss_tot >= XT_KIND_MIN_SHARE);
        r->kind_checked[k] = k != SIM_OP_RAGGED_ALL_TO_ALL && big;
        r->kind_ok[k] = !r->kind_checked[k] || fabs(r->kind_ratio[k] - 1) <= XT_KIND_TOL;
        if (!r->kind_ok[k]) r->all_ok = false;
    }
}
