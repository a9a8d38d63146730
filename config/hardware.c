/* hardware.c — hardware profiles (see hardware.h): the file read and checked key by key, each
 * missing or malformed figure an error naming the file, the key and what it means; the torus of
 * a slice size looked up on demand; the profile a config selects read once and kept in it. */
#include "config/hardware.h"
#include "config/internal.h"

#include <dirent.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int cmp_str(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

const char *cfg_hw_names(const char *configs_dir, char *buf, size_t cap)
{
    char dir[4200];
    snprintf(dir, sizeof dir, "%s/hardware", configs_dir);
    buf[0] = '\0';
    DIR *d = opendir(dir);
    if (!d) return buf;
    char *names[64];
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d)) && n < 64) {
        size_t l = strlen(e->d_name);
        if (l > 4 && !strcmp(e->d_name + l - 4, ".yml")) names[n++] = strndup(e->d_name, l - 4);
    }
    closedir(d);
    qsort(names, (size_t)n, sizeof names[0], cmp_str);
    size_t used = 0;
    for (int i = 0; i < n; i++) {
        if (used < cap) used += (size_t)snprintf(buf + used, cap - used, "%s%s", i ? ", " : "", names[i]);
        free(names[i]);
    }
    return buf;
}

/* A number of the profile, or 0 for null/absent (a figure not published). */
sim_status cfg_hw_figure(const cfg_value *v, const char *file, const char *key, double *out)
{
    *out = 0;
    if (!v || (v->kind == CFG_SCALAR && cfg_scalar_type(v) == CFG_NULL)) return SIM_OK;
    char what[600];
    snprintf(what, sizeof what, "%s: '%s'", file, key);
    SIM_TRY(cfg_value_double(v, what, out));
    if (*out < 0)
        return sim_err(SIM_ERR_INPUT, "%s = %g: expected a figure >= 0 (or null when not published)", what, *out);
    return SIM_OK;
}

/* A key of two spellings: *on = (its value is `yes`); a missing key or another value is an error that
 * names both and what they mean. */
static sim_status choice_key(const cfg_config *cfg, const char *path, const char *key, const char *yes, const char *no,
                             const char *meaning, bool *on)
{
    const cfg_entry *e = cfg_find(cfg, key);
    const char *t = e && e->value.kind == CFG_SCALAR ? e->value.text : NULL;
    if (!t || (strcmp(t, yes) && strcmp(t, no)))
        return sim_err(SIM_ERR_INPUT, "%s: '%s' = %s: expected %s, with its source in a comment", path, key,
                       t ? t : "(missing)", meaning);
    *on = !strcmp(t, yes);
    return SIM_OK;
}

/* A whole number from 0 to max. */
static sim_status count_key(const cfg_config *cfg, const char *path, const char *key, int max, const char *meaning,
                            int *out)
{
    const cfg_entry *e = cfg_find(cfg, key);
    double v = -1;
    if (e) SIM_TRY(cfg_hw_figure(&e->value, path, key, &v));
    if (!(v >= 0 && v <= max && v == (int)v))
        return sim_err(SIM_ERR_INPUT,
                       "%s: '%s' = %s%g: expected a whole number from 0 to %d, %s, with its source in "
                       "a comment",
                       path, key, e ? "" : "(missing) ", v, max, meaning);
    *out = (int)v;
    return SIM_OK;
}

/* Reads <configs>/hardware/NAME.yml: the figures and rules into *out (torus_n = 0), the file's
 * values into *file (kept for the torus of each slice size). */
static sim_status read_profile(const char *configs_dir, const char *name, cfg_hw *out, cfg_config **file)
{
    *file = NULL;
    memset(out, 0, sizeof *out);
    char path[4300], names[1024];
    bool bad = !*name || strlen(name) >= sizeof out->name || strpbrk(name, "/.");
    snprintf(path, sizeof path, "%s/hardware/%s.yml", configs_dir, name);
    FILE *f = bad ? NULL : fopen(path, "r");
    if (!f)
        return sim_err(SIM_ERR_INPUT, "hardware profile '%s': not one of %s/hardware (%s); use one of those names",
                       name, configs_dir, cfg_hw_names(configs_dir, names, sizeof names));
    fclose(f);
    cfg_config *cfg;
    SIM_TRY(cfg_load_file(path, &cfg));
    snprintf(out->name, sizeof out->name, "%s", name);
    const cfg_entry *kind = cfg_find(cfg, "kind");
    out->gpu = kind && kind->value.text && !strcmp(kind->value.text, "gpu");
    double dpc = 1, v;
    sim_status st = SIM_OK;
    const cfg_entry *e = cfg_find(cfg, "devices_per_chip");
    if (e) st = cfg_hw_figure(&e->value, path, "devices_per_chip", &dpc);
    if (!st && dpc < 1) st = sim_err(SIM_ERR_INPUT, "%s: devices_per_chip must be >= 1", path);
    out->devices_per_chip = (int)dpc;
    const cfg_entry *pk = cfg_find(cfg, "peak_tflops");
    if (!st) st = cfg_hw_figure(cfg_map_get(pk ? &pk->value : NULL, "bfloat16"), path, "peak_tflops.bfloat16", &v);
    out->peak_bf16 = v * 1e12 / dpc;
    if (!st && out->peak_bf16 <= 0) st = sim_err(SIM_ERR_INPUT, "%s: peak_tflops.bfloat16 is required", path);
    if (!st) st = cfg_hw_figure(cfg_map_get(pk ? &pk->value : NULL, "float8"), path, "peak_tflops.float8", &v);
    out->peak_fp8 = v * 1e12 / dpc;
    if (!st) st = cfg_hw_figure(cfg_map_get(pk ? &pk->value : NULL, "float32"), path, "peak_tflops.float32", &v);
    out->peak_f32 = v * 1e12 / dpc;
    static const char *const keys[] = {
        "hbm_gib", "hbm_gbps", "ici_gbps_bidirectional", "ici_ports", "nvlink_gbps_bidirectional", "dcn_gbits"};
    double val[6] = {0};
    for (int i = 0; i < 6 && !st; i++) {
        e = cfg_find(cfg, keys[i]);
        if (e) st = cfg_hw_figure(&e->value, path, keys[i], &val[i]);
    }
    out->hbm_bytes = val[0] * 1073741824.0 / dpc;
    out->hbm_bw = val[1] * 1e9 / dpc;
    if (!st && (out->hbm_bytes <= 0 || out->hbm_bw <= 0))
        st = sim_err(SIM_ERR_INPUT, "%s: hbm_gib and hbm_gbps are required", path);
    if (out->gpu)
        out->link_bw = val[4] * 1e9 / 2.0; /* NVLink switch: a GPU injects half its bidirectional figure each way */
    else if (val[2] > 0 && val[3] > 0) out->link_bw = val[2] * 1e9 / val[3] / 2.0; /* one port, one direction */
    out->link_bw /= dpc;
    out->dcn_bw = val[5] * 1e9 / 8.0 / dpc;
    /* the dtypes the profile's compiler moves weight collectives in (the comment above the keys
     * in each file gives the source) */
    static const char *const wire_keys[] = {"weight_gather_dtype", "gradient_reduction_dtype"};
    bool *wire_out[] = {&out->gather_in_dtype, &out->reduce_in_dtype};
    for (int i = 0; i < 2 && !st; i++) {
        e = cfg_find(cfg, wire_keys[i]);
        const char *t = e && e->value.kind == CFG_SCALAR ? e->value.text : NULL;
        if (!t || (strcmp(t, "dtype") && strcmp(t, "weight_dtype")))
            st = sim_err(SIM_ERR_INPUT,
                         "%s: '%s' = %s: expected dtype (the compiler casts the float32 weight to `dtype` "
                         "before the collective) or weight_dtype (it moves the stored dtype), with its source "
                         "in a comment",
                         path, wire_keys[i], t ? t : "(missing)");
        else *wire_out[i] = !strcmp(t, "dtype");
    }
    /* the compiler's program transformations (the comment above each key in each file gives the source) */
    cfg_xla_rules *rules = &out->xla;
    if (!st)
        st = choice_key(cfg, path, "hoisted_weight_copies", "dtype", "none",
                        "dtype (each layer stack's float32 weights cast to `dtype` once, before the layer loops) "
                        "or none (each layer casts its own)",
                        &rules->hoist_casts);
    if (!st)
        st = count_key(cfg, path, "accumulation_gradient_copies", 8,
                       "gradient sets the compiler holds beside the gradients during gradient accumulation",
                       &rules->ga_grad_copies);
    if (!st)
        st = count_key(cfg, path, "saved_product_gradient_copies", 8,
                       "weight_dtype copies of a layer weight's shard the compiler's peak holds for each product "
                       "whose output the remat policy saves",
                       &rules->saved_grad_copies);
    if (!st)
        st = choice_key(cfg, path, "newton_schulz_gather_dtype", "bfloat16", "float32",
                        "bfloat16 (a float32 product at the default matmul precision is one bfloat16 pass, "
                        "its operands cast before their gathers) or float32",
                        &rules->ns_gather_bf16);
    if (!st)
        st = choice_key(cfg, path, "newton_schulz_operand_gathers", "once", "per_product",
                        "once (one gather of X serves X X^T and B X) or per_product", &rules->ns_gather_once);
    if (!st)
        st = choice_key(cfg, path, "muon_update_buffers", "stacked", "per_leaf",
                        "stacked (every Muon leaf's float32 estimate formed before the first Newton-Schulz and "
                        "held until its update, with each step's product B X) or per_leaf (one leaf at a time)",
                        &rules->muon_stacked);
    if (!st)
        st = count_key(cfg, path, "windowed_einsum_min_group", 1 << 20,
                       "the smallest group (0: never) whose weight products the compiler windows",
                       &rules->windowed_min_group);
    if (!st) {
        const cfg_entry *w = cfg_find(cfg, "windowed_einsum_ici_gbps");
        double gbps = -1;
        if (w) st = cfg_hw_figure(&w->value, path, "windowed_einsum_ici_gbps", &gbps);
        if (!st && !(gbps >= 0))
            st = sim_err(SIM_ERR_INPUT,
                         "%s: 'windowed_einsum_ici_gbps' = %s: expected a rate >= 0 in GB/s (the link rate "
                         "the compiler's windowed-einsum cost model times collectives at; 0: the group size "
                         "alone decides), with its source in a comment",
                         path, w ? "(not a number)" : "(missing)");
        rules->windowed_ici_bw = gbps * 1e9;
        const cfg_entry *t = cfg_find(cfg, "windowed_einsum_tflops");
        double tflops = -1;
        if (!st && t) st = cfg_hw_figure(&t->value, path, "windowed_einsum_tflops", &tflops);
        if (!st && !(tflops >= 0))
            st = sim_err(SIM_ERR_INPUT,
                         "%s: 'windowed_einsum_tflops' = %s: expected a rate >= 0 in TFLOP/s (the peak the "
                         "compiler's windowed-einsum cost model times a product at; 0: peak_tflops.bfloat16), "
                         "with its source in a comment",
                         path, t ? "(not a number)" : "(missing)");
        rules->windowed_peak = tflops > 0 ? tflops * 1e12 / dpc : out->peak_bf16;
    }
    if (!st)
        st = count_key(cfg, path, "psum_scatter_max_group", 1 << 20,
                       "the largest group (0: any) over which a shard_map's gradient psum and slice become a "
                       "reduce-scatter",
                       &rules->psum_scatter_max_group);
    if (!st)
        st = choice_key(cfg, path, "weight_gather_cse", "near", "all",
                        "near (the compiler merges two gathers of one weight only when their products lie close "
                        "in the layer: a MoE layer's products ahead of the routing are gathered again for their "
                        "input gradients) or all (one gather serves every product of a layer's backward)",
                        &rules->regather_far);
    if (!st)
        st = count_key(cfg, path, "gradient_lane_scatter_max_all_reduce", 1 << 20,
                       "the largest per-device slice of a gradient's last dim (0: none) whose reduce-scatter "
                       "the compiler leaves an all-reduce",
                       &rules->lane_scatter_ar_max);
    if (!st)
        st = choice_key(cfg, path, "embedding_lookup", "all_to_all", "gather_table",
                        "all_to_all (under FSDP the compiler all-gathers the token ids, looks them up on the "
                        "table's shard and all-to-alls the rows) or gather_table (it all-gathers the table)",
                        &rules->embed_all_to_all);
    if (!st)
        st = choice_key(cfg, path, "low_rank_norm_sharding", "scale", "whole",
                        "scale (in auto mode MLA's q_norm and kv_norm scales, split on the normalised dim, split "
                        "the low-rank product they normalise, gathered after the norm) or whole (the product "
                        "stays whole, as its weight)",
                        &rules->norm_splits_product);
    if (st != SIM_OK) {
        cfg_free(cfg);
        return st;
    }
    *file = cfg;
    return SIM_OK;
}

/* The physical shape of a slice of devices_per_slice devices: the profile's `torus` entry for
 * its chip count (none: torus_n stays 0). */
static sim_status profile_torus(const cfg_config *file, int devices_per_slice, cfg_hw *out)
{
    out->torus_n = out->xla.torus_n = 0;
    const cfg_entry *tor = cfg_find(file, "torus");
    int chips = devices_per_slice / out->devices_per_chip;
    if (!tor || chips <= 0) return SIM_OK;
    char key[32];
    snprintf(key, sizeof key, "%d", chips);
    const cfg_value *shape = cfg_map_get(&tor->value, key);
    for (int i = 0; shape && shape->kind == CFG_LIST && i < shape->n && i < 3; i++) {
        long long x;
        SIM_TRY(cfg_value_int(&shape->items[i], "a torus dimension", &x));
        out->torus[out->torus_n++] = (int)x;
    }
    out->xla.torus_n = out->devices_per_chip == 1 ? out->torus_n : 0; /* one device per chip: ids are chips */
    for (int i = 0; i < out->xla.torus_n; i++) out->xla.torus[i] = out->torus[i];
    return SIM_OK;
}

sim_status cfg_hw_load(const char *configs_dir, const char *name, int devices_per_slice, cfg_hw *out)
{
    cfg_config *file;
    SIM_TRY(read_profile(configs_dir, name, out, &file));
    sim_status st = profile_torus(file, devices_per_slice, out);
    cfg_free(file);
    return st;
}

/* The profile name a config selects (hardware_profile, else compile_topology's family, written into
 * fam); NULL when neither is set. */
static const char *profile_name(const cfg_config *cfg, char *fam, size_t cap, const char **topo)
{
    const char *name = NULL;
    *topo = NULL;
    const cfg_entry *e = cfg_find(cfg, "hardware_profile");
    if (e && e->value.text && *e->value.text) name = e->value.text;
    e = cfg_find(cfg, "compile_topology");
    if (e && e->value.text && *e->value.text) *topo = e->value.text;
    if (!name && *topo) { /* "v5p-8" -> "v5p" */
        snprintf(fam, cap, "%s", *topo);
        char *dash = strrchr(fam, '-');
        if (dash) *dash = '\0';
        name = fam;
    }
    return name;
}

/* The profile a config read, kept in the config (cfg_config.hw) so that it is read once. */
struct cfg_hw_cache {
    char name[64];    /* the profile name it was read for */
    cfg_hw hw;        /* its figures and rules (torus_n = 0) */
    cfg_config *file; /* its values: the torus of each slice size */
};

void cfg_hw_cache_free(struct cfg_hw_cache *c)
{
    if (!c) return;
    cfg_free(c->file);
    free(c);
}

/* A config is read by one thread at a time in practice, but the cache is written through a const
 * pointer: the lock keeps two readers from filling it twice. */
static pthread_mutex_t cache_lock = PTHREAD_MUTEX_INITIALIZER;

static sim_status cached_profile(const cfg_config *cfg, const char *name, const struct cfg_hw_cache **out)
{
    pthread_mutex_lock(&cache_lock);
    struct cfg_hw_cache *c = cfg->hw;
    sim_status st = SIM_OK;
    if (!c || strcmp(c->name, name)) {
        struct cfg_hw_cache *fresh = calloc(1, sizeof *fresh);
        SIM_ASSERT(fresh);
        snprintf(fresh->name, sizeof fresh->name, "%s", name);
        st = read_profile(cfg->configs_dir, name, &fresh->hw, &fresh->file);
        if (st == SIM_OK) {
            cfg_hw_cache_free(c);
            ((cfg_config *)cfg)->hw = c = fresh;
        } else {
            cfg_hw_cache_free(fresh);
        }
    }
    pthread_mutex_unlock(&cache_lock);
    *out = c;
    return st;
}

sim_status cfg_hw_from_config(const cfg_config *cfg, int devices_per_slice, cfg_hw *out, bool *found)
{
    *found = false;
    const char *topo;
    char fam[64];
    const char *name = profile_name(cfg, fam, sizeof fam, &topo);
    if (!name) return SIM_OK;
    const struct cfg_hw_cache *c = NULL;
    sim_status st = cached_profile(cfg, name, &c);
    if (st == SIM_OK) {
        *out = c->hw;
        st = profile_torus(c->file, devices_per_slice, out);
    }
    if (st && topo && name == fam)
        sim_err_append(" (the family of compile_topology=%s; set hardware_profile=NAME to choose one)", topo);
    else if (st) sim_err_append(" (hardware_profile=%s)", name);
    *found = st == SIM_OK;
    return st;
}
