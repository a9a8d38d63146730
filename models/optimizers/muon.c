/* muon.c — opt_type=muon on sharded weights (see muon.h).
 *
 * Design: a Muon leaf is handled as one stacked tensor, as optax sees it
 * (MaxText's [dim0, L, ...] parameter), so the collectives per step are those
 * of one vmapped leaf, not one per layer.  The per-layer shards a device
 * stores are copied into a local stacked shard (the layer dim is never split
 * outside pipelining, which Muon refuses), the Newton–Schulz iteration runs
 * there as einsums whose letters name the weight's own dims (no transpose or
 * reshape: batch letters stay batch indices, the row group is the smaller of
 * the reduction and output groups, as optax transposes when R > O), and the
 * result is copied back layer by layer into the elementwise update.  The ops
 * run in auto placement whatever shard_mode says: optax's update is not
 * sharding-annotated, so GSPMD places it. */
#include "models/optimizers/muon.h"
#include "models/core/timemodel.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "blas_kernels/bk_parallel.h"
#include "mesh/ops.h"
#include "mesh/reshard.h"

/* Newton–Schulz coefficients (optimizers.get_optimizer for every decoder block but deepseek4) */
static const double NS_A = 3.4445, NS_B = -4.7750, NS_C = 2.0315;

/* ---------------------------------------------------------------- config */

static sim_status refuse(const cfg_config *cfg, const char *key, const char *why)
{
    const cfg_entry *en = cfg_find(cfg, key);
    return sim_err(SIM_ERR_INPUT, "opt_type=muon with %s=%s (%s): %s", key, en && en->value.text ? en->value.text : "?",
                   en ? en->where : "", why);
}

sim_status model_muon_from_config(const cfg_config *cfg, model_muon_cfg *c)
{
    memset(c, 0, sizeof *c);
    static const char *const types[] = {"optax_muon", "optax", "maxtext_muon", "maxtext"};
    int type, b;
    SIM_TRY(cfg_get_enum(cfg, "muon_type", types, 4, &type));
    if (type >= 2)
        return refuse(cfg, "muon_type",
                      "MaxText's sharding-aware Muon (all-to-all reshards around Newton-Schulz) is not simulated; "
                      "use muon_type=optax_muon");
    SIM_TRY(cfg_get_bool(cfg, "muon_use_all_to_all", &b));
    if (b)
        return refuse(cfg, "muon_use_all_to_all",
                      "MaxText asserts that all-to-all Newton-Schulz needs muon_type=maxtext_muon, which is not "
                      "simulated; set muon_use_all_to_all=false");
    SIM_TRY(cfg_get_double(cfg, "muon_beta", &c->beta));
    if (!(c->beta >= 0 && c->beta < 1))
        return sim_err(SIM_ERR_INPUT, "muon_beta=%g: the momentum decay must lie in [0, 1)", c->beta);
    SIM_TRY(cfg_get_double(cfg, "muon_weight_decay", &c->weight_decay));
    const char *rms;
    SIM_TRY(cfg_get_str(cfg, "muon_consistent_rms", &rms));
    if (rms) {
        SIM_TRY(cfg_get_double(cfg, "muon_consistent_rms", &c->consistent_rms));
        c->consistent_rms_on = true;
    }
    SIM_TRY(cfg_get_bool(cfg, "muon_include_routers", &b));
    c->include_routers = b;
    SIM_TRY(model_muon_rules_load(cfg->configs_dir, &c->rules));
    cfg_xla_rules xla; /* weight_dtype float32 and dtype bfloat16: only the Newton-Schulz rules are read */
    SIM_TRY(model_hw_xla_rules(cfg, SIM_BF16, SIM_F32, &xla));
    c->ns_gather_bf16 = xla.ns_gather_bf16;
    c->ns_gather_once = xla.ns_gather_once;
    c->stacked = xla.muon_stacked;
    long long ici_pp, dcn_pp;
    SIM_TRY(cfg_get_int(cfg, "ici_pipeline_parallelism", &ici_pp));
    SIM_TRY(cfg_get_int(cfg, "dcn_pipeline_parallelism", &dcn_pp));
    if (ici_pp != 1)
        return refuse(cfg, "ici_pipeline_parallelism",
                      "MaxText's Muon dimension numbers assume the [dim0, layers, ...] layout and do not handle the "
                      "stage/repeat dims of pipelined weights; use opt_type=adamw with pipelining, or no pipelining");
    if (dcn_pp != 1)
        return refuse(cfg, "dcn_pipeline_parallelism",
                      "MaxText's Muon dimension numbers do not handle pipelined weights; use opt_type=adamw with "
                      "pipelining, or no pipelining");
    SIM_TRY(cfg_get_bool(cfg, "shard_optimizer_over_data", &b));
    if (b)
        return refuse(cfg, "shard_optimizer_over_data",
                      "ZeRO-1 with Muon is broken at MaxText's head (Linen raises NotImplementedError; NNX shards only "
                      "the AdamW branch's state); set shard_optimizer_over_data=false or use opt_type=adamw");
    return SIM_OK;
}

/* ---------------------------------------------------------------- rules (configs/muon.yml) */

static const char *const LIST_KEYS[MODEL_MUON_NLISTS] = {"adamw_segment_contains",
                                                         "adamw_segment_equals",
                                                         "adamw_segment_suffixes",
                                                         "adamw_suffix_exceptions",
                                                         "moe_blocks",
                                                         "shared_experts",
                                                         "expert_weights",
                                                         "routers",
                                                         "grouped_linear",
                                                         "attention_blocks",
                                                         "attention_qkv",
                                                         "attention_out",
                                                         "attention_out_blocks"};
static const char *const DIMS_KEYS[MODEL_MUON_NDIMS] = {"expert_dims", "router_dims", "grouped_dims",
                                                        "qkv_dims",    "out_dims",    "standard_dims"};

/* [[reduction dims], [output dims]] */
static sim_status read_dims(const cfg_config *f, const char *path, const char *key, int *nr, int *red, int *no,
                            int *out)
{
    const cfg_entry *e = cfg_find(f, key);
    const cfg_value *v = e ? &e->value : NULL;
    if (!v || v->kind != CFG_LIST || v->n != 2)
        return sim_err(SIM_ERR_INPUT, "%s: '%s' must be [[reduction dims], [output dims]], e.g. [[0], [-1]]", path,
                       key);
    for (int g = 0; g < 2; g++) {
        const cfg_value *l = &v->items[g];
        if (l->kind != CFG_LIST || l->n < 1 || l->n > 4)
            return sim_err(SIM_ERR_INPUT, "%s: '%s' item %d must be a list of 1 to 4 dims", path, key, g);
        for (int i = 0; i < l->n; i++) {
            long long d;
            SIM_TRY(cfg_value_int(&l->items[i], key, &d));
            if (d < -4 || d > 3) return sim_err(SIM_ERR_INPUT, "%s: '%s' dim %lld: use -4..3", path, key, d);
            (g ? out : red)[i] = (int)d;
        }
        *(g ? no : nr) = l->n;
    }
    return SIM_OK;
}

sim_status model_muon_rules_load(const char *configs_dir, model_muon_rules *r)
{
    memset(r, 0, sizeof *r);
    char path[4096];
    snprintf(path, sizeof path, "%s/muon.yml", configs_dir && *configs_dir ? configs_dir : "configs");
    cfg_config *f;
    sim_status st = cfg_load_file(path, &f);
    if (st != SIM_OK) {
        sim_err_append(" (opt_type=muon reads MaxText's Muon classification rules from configs/muon.yml)");
        return st;
    }
    for (int k = 0; st == SIM_OK && k < MODEL_MUON_NLISTS; k++) {
        const char **items;
        int n;
        if (!cfg_find(f, LIST_KEYS[k])) {
            st = sim_err(SIM_ERR_INPUT, "%s: the list '%s' is missing", path, LIST_KEYS[k]);
            break;
        }
        st = cfg_get_str_list(f, LIST_KEYS[k], &items, &n);
        if (st != SIM_OK) break;
        if (n > MODEL_MUON_LIST_MAX)
            st = sim_err(SIM_ERR_INPUT, "%s: '%s' has %d names (at most %d)", path, LIST_KEYS[k], n,
                         MODEL_MUON_LIST_MAX);
        for (int i = 0; st == SIM_OK && i < n; i++) {
            if (strlen(items[i]) >= MODEL_MUON_NAME_MAX)
                st = sim_err(SIM_ERR_INPUT, "%s: '%s' name '%s' is longer than %d characters", path, LIST_KEYS[k],
                             items[i], MODEL_MUON_NAME_MAX - 1);
            else snprintf(r->name[k][i], MODEL_MUON_NAME_MAX, "%s", items[i]);
        }
        r->n[k] = n;
        free(items);
    }
    for (int k = 0; st == SIM_OK && k < MODEL_MUON_NDIMS; k++)
        st = read_dims(f, path, DIMS_KEYS[k], &r->n_red[k], r->red[k], &r->n_out[k], r->out[k]);
    cfg_free(f);
    return st;
}

/* ---------------------------------------------------------------- classification */

static bool seg_in(const model_muon_rules *r, model_muon_list k, const char *seg)
{
    for (int i = 0; i < r->n[k]; i++)
        if (!strcmp(seg, r->name[k][i])) return true;
    return false;
}

/* Some segment of the path is one of list k's names (MaxText: `x in path` on the tuple). */
static bool path_has(const model_muon_rules *r, model_muon_list k, const char *const *segs, int n)
{
    for (int i = 0; i < n; i++)
        if (seg_in(r, k, segs[i])) return true;
    return false;
}

static bool adamw_segment(const model_muon_rules *r, const char *seg)
{
    if (seg_in(r, MODEL_MUON_ADAMW_EQUALS, seg)) return true;
    size_t len = strlen(seg);
    for (int i = 0; i < r->n[MODEL_MUON_ADAMW_SUFFIXES]; i++) {
        const char *suf = r->name[MODEL_MUON_ADAMW_SUFFIXES][i];
        size_t ls = strlen(suf);
        if (len >= ls && !strcmp(seg + len - ls, suf) && !seg_in(r, MODEL_MUON_ADAMW_SUFFIX_EXCEPT, seg)) return true;
    }
    for (int i = 0; i < r->n[MODEL_MUON_ADAMW_CONTAINS]; i++)
        if (strstr(seg, r->name[MODEL_MUON_ADAMW_CONTAINS][i])) return true;
    return false;
}

static void set_dims(model_muon_dims *d, const model_muon_rules *r, model_muon_rule_dims k, int rank)
{
    d->muon = true;
    d->n_red = r->n_red[k];
    d->n_out = r->n_out[k];
    for (int i = 0; i < d->n_red; i++) d->red[i] = r->red[k][i] < 0 ? r->red[k][i] + rank : r->red[k][i];
    for (int i = 0; i < d->n_out; i++) d->out[i] = r->out[k][i] < 0 ? r->out[k][i] + rank : r->out[k][i];
}

void model_muon_classify(const model_muon_cfg *c, const model_param_def *def, model_muon_dims *d)
{
    const model_muon_rules *r = &c->rules;
    memset(d, 0, sizeof *d);
    int rank = def->rank;
    if (rank < 2) return;
    char buf[MODEL_PATH_MAX];
    snprintf(buf, sizeof buf, "%s", def->path);
    const char *segs[32];
    int n = 0;
    /* split on '.' by hand: every device thread may classify at once (no strtok) */
    for (char *t = buf; t && n < 32;) {
        segs[n++] = t;
        char *dot = strchr(t, '.');
        if (dot) *dot++ = '\0';
        t = dot;
    }
    for (int i = 0; i < n; i++)
        if (adamw_segment(r, segs[i])) return;
    model_muon_rule_dims k = MODEL_MUON_DIMS_STANDARD;
    if (path_has(r, MODEL_MUON_MOE_BLOCKS, segs, n) && !path_has(r, MODEL_MUON_SHARED_EXPERTS, segs, n) &&
        (path_has(r, MODEL_MUON_EXPERT_WEIGHTS, segs, n) || path_has(r, MODEL_MUON_ROUTERS, segs, n))) {
        if (path_has(r, MODEL_MUON_EXPERT_WEIGHTS, segs, n)) k = MODEL_MUON_DIMS_EXPERT;
        else if (!c->include_routers) return;
        else k = MODEL_MUON_DIMS_ROUTER;
    } else if (path_has(r, MODEL_MUON_GROUPED, segs, n)) {
        k = MODEL_MUON_DIMS_GROUPED;
    } else if (path_has(r, MODEL_MUON_ATTN_BLOCKS, segs, n) && rank > 2) {
        if (path_has(r, MODEL_MUON_ATTN_QKV, segs, n)) k = MODEL_MUON_DIMS_QKV;
        else if (path_has(r, MODEL_MUON_ATTN_OUT, segs, n) &&
                 (path_has(r, MODEL_MUON_ATTN_OUT_BLOCKS, segs, n) || rank == 4))
            k = MODEL_MUON_DIMS_OUT;
    }
    set_dims(d, r, k, rank);
}

static int64_t group_size(const model_param_def *def, int n, const int *dims)
{
    int64_t s = 1;
    for (int i = 0; i < n; i++) s *= def->shape[dims[i]];
    return s;
}

float model_muon_scale(const model_muon_cfg *c, const model_param_def *def, const model_muon_dims *dims)
{
    int64_t fan_in = group_size(def, dims->n_red, dims->red), fan_out = group_size(def, dims->n_out, dims->out);
    if (c->consistent_rms_on) /* jnp.sqrt(jnp.maximum(fan_in, fan_out)) * consistent_rms, in float32 */
        return sqrtf((float)(fan_in > fan_out ? fan_in : fan_out)) * (float)c->consistent_rms;
    double r = (double)fan_out / (double)fan_in; /* Python division, then float32 */
    return sqrtf((float)(r > 1.0 ? r : 1.0));
}

/* ---------------------------------------------------------------- Newton–Schulz */

/* out[i] = k * in[i] */
static void scale_fn(float *out, const float *in, size_t n, void *arg)
{
    const float k = *(const float *)arg;
    for (size_t i = 0; i < n; i++) out[i] = k * in[i];
}

static sim_status scaled(mesh_ctx *c, const mesh_array *a, float k, const char *name, mesh_array *out)
{
    return mesh_map(c, a, scale_fn, &k, name, out);
}

typedef struct {
    const float *x;
    float *y;
    float alpha, beta;
} axpby_job;

static void axpby_chunk(int64_t lo, int64_t hi, void *arg)
{
    const axpby_job *J = arg;
    for (int64_t i = lo; i < hi; i++) J->y[i] = J->alpha * J->x[i] + J->beta * J->y[i];
}

/* out = alpha x + beta y, consuming y (it becomes out or is freed).  Equal
 * shardings (the usual case) run as one local pass into y's buffer, as XLA
 * fuses the elementwise tail: one temporary less at the peak.  Otherwise the
 * sharded elementwise ops place it. */
static sim_status axpby(mesh_ctx *c, float alpha, const mesh_array *x, float beta, mesh_array *y, const char *name,
                        mesh_array *out)
{
    if (!x->spec.partial && !y->spec.partial && mesh_spec_equal(&x->spec, &y->spec)) {
        if (x->data && y->data) {
            axpby_job J = {x->data, y->data, alpha, beta};
            bk_parallel_for((int64_t)y->nlocal, 1 << 15, axpby_chunk, &J);
        }
        *out = *y;
        memset(y, 0, sizeof *y);
        return SIM_OK;
    }
    mesh_array ax = {0}, by = {0};
    sim_status st = scaled(c, x, alpha, name, &ax);
    if (st == SIM_OK) st = beta == 1.0f ? SIM_OK : scaled(c, y, beta, name, &by);
    if (st == SIM_OK) st = mesh_add(c, &ax, beta == 1.0f ? y : &by, name, out);
    mesh_array_free(c->dev, &ax);
    mesh_array_free(c->dev, &by);
    mesh_array_free(c->dev, y);
    return st;
}

/* x / (norm + eps) per matrix, locally: nrm holds the Frobenius norms of x's
 * local batch block (dims flagged in `batch`, same order, same sharding). */
static void divide_by_norm(mesh_array *x, const mesh_array *nrm, const bool *batch, float eps)
{
    if (!x->data) return;
    float *xv = x->data;
    const float *nv = nrm->data;
    int64_t idx[MESH_SPEC_MAX_RANK] = {0};
    for (size_t i = 0; i < x->nlocal; i++) {
        int64_t b = 0;
        for (int d = 0; d < x->rank; d++)
            if (batch[d]) b = b * x->local[d] + idx[d];
        xv[i] = xv[i] / (nv[b] + eps);
        for (int d = x->rank - 1; d >= 0; d--) {
            if (++idx[d] < x->local[d]) break;
            idx[d] = 0;
        }
    }
}

/* Every device holds all of a (no dim split, no partial sums). */
static bool whole(const mesh_array *a)
{
    if (a->spec.partial) return false;
    for (int d = 0; d < a->rank; d++)
        if (a->spec.n_axes[d] > 0) return false;
    return true;
}

sim_status model_muon_orthogonalize(const mesh_ctx *ctx, const model_muon_dims *dims, double eps, const char *path,
                                    const sim_dtype *gather, bool once, bool hold_products, mesh_array *x)
{
    mesh_ctx c = *ctx;
    c.mode = MESH_MODE_AUTO; /* optax's update carries no sharding annotations: the partitioner places it */
    c.tape = NULL;
    c.cache = NULL;
    c.operand_gather = gather;
    char layer[MESH_NAME_MAX];
    snprintf(layer, sizeof layer, "optimizer/%s", path);
    c.layer = layer;
    const int rank = x->rank;
    /* rows: the smaller group (optax transposes [R, O] to [O, R] when R > O) */
    int64_t R = 1, O = 1;
    for (int i = 0; i < dims->n_red; i++) R *= x->shape[dims->red[i]];
    for (int i = 0; i < dims->n_out; i++) O *= x->shape[dims->out[i]];
    const int *rows = R > O ? dims->out : dims->red;
    const int nrows = R > O ? dims->n_out : dims->n_red;
    bool batch[MESH_SPEC_MAX_RANK], is_row[MESH_SPEC_MAX_RANK];
    int mat[MESH_SPEC_MAX_RANK], nmat = 0;
    for (int d = 0; d < rank; d++) batch[d] = true, is_row[d] = false;
    for (int i = 0; i < dims->n_red; i++) batch[dims->red[i]] = false, mat[nmat++] = dims->red[i];
    for (int i = 0; i < dims->n_out; i++) batch[dims->out[i]] = false, mat[nmat++] = dims->out[i];
    for (int i = 0; i < nrows; i++) is_row[rows[i]] = true;
    /* einsum letters: x's dims 'a'.., its rows renamed 'm'.. (second factor) and 'q'.. (third) */
    char xl[9] = {0}, x2[9] = {0}, gram[17] = {0}, g2[17] = {0}, g3[17] = {0};
    int ng = 0;
    for (int d = 0; d < rank; d++) {
        xl[d] = (char)('a' + d);
        if (batch[d]) gram[ng++] = xl[d];
    }
    int nb = ng;
    for (int d = 0, k = 0; d < rank; d++) {
        x2[d] = is_row[d] ? (char)('m' + k++) : xl[d];
        if (is_row[d]) gram[ng++] = xl[d];
    }
    for (int d = 0; d < rank; d++)
        if (is_row[d]) gram[ng++] = x2[d];
    /* g2: (batch, m.., q..) and g3: (batch, rows, q..) for A @ A */
    memcpy(g2, gram, (size_t)nb);
    memcpy(g3, gram, (size_t)nb + (size_t)nrows);
    for (int k = 0; k < nrows; k++) {
        g2[nb + k] = (char)('m' + k);
        g2[nb + nrows + k] = (char)('q' + k);
        g3[nb + nrows + k] = (char)('q' + k);
    }
    char s_gram[64], s_sq[64], s_bx[64];
    snprintf(s_gram, sizeof s_gram, "%s,%s->%s", xl, x2, gram);
    snprintf(s_sq, sizeof s_sq, "%s,%s->%s", gram, g2, g3);
    /* B (batch, rows, m..) times x with its rows renamed m..: back to x's own letters */
    snprintf(s_bx, sizeof s_bx, "%s,%s->%s", gram, x2, xl);

    mesh_spec keep = x->spec;
    sim_status st = SIM_OK;
    mesh_array sq = {0}, nrm = {0}, a = {0}, aa = {0}, bm = {0}, bx = {0}, nx = {0};
    sim_arena *arena = sim_device_arena(c.dev);
    size_t held = 0; /* hold_products: the steps' products B X counted until the update (counted only) */
    /* Frobenius normalisation: the sum over the matrix dims all-reduces what they shard */
    st = mesh_mul(&c, x, x, "ns_sq", &sq);
    if (st == SIM_OK) st = mesh_reduce_sum(&c, &sq, nmat, mat, NULL, "ns_norm", &nrm);
    mesh_array_free(c.dev, &sq);
    if (st == SIM_OK && nrm.data) {
        float *v = nrm.data;
        for (size_t i = 0; i < nrm.nlocal; i++) v[i] = sqrtf(v[i]);
    }
    if (st == SIM_OK) divide_by_norm(x, &nrm, batch, (float)eps);
    mesh_array_free(c.dev, &nrm);
    if (st == SIM_OK && hold_products) { /* the normalised estimate X0 too: the update's chain starts there */
        size_t b = x->nlocal * sim_dtype_size(x->counted);
        st = sim_arena_charge(arena, b, SIM_MEM_TEMP, "Newton-Schulz estimate held for the update");
        if (st == SIM_OK) held += b;
    }
    for (int step = 0; st == SIM_OK && step < MODEL_MUON_NS_STEPS; step++) {
        /* once: one gather of X serves X X^T and B X (XLA:TPU's compile of optax's Muon on llama2-7b,
         * fsdp=8: one all-gather of each MLP stack per step, tests/data/xla/tpu.json); XLA:CPU gathers X
         * for each product (maxtext-facts-2 A.4: three all-gathers a step) */
        c.cache = once ? mesh_reshard_cache_new(c.dev) : NULL;
        st = mesh_einsum(&c, s_gram, x, x, NULL, "ns_gram", SIM_MEM_TEMP, &a, NULL);
        if (st == SIM_OK && a.spec.partial) { /* a sum over a sharded long dim: all-reduce the Gram matrix */
            mesh_spec full = a.spec;
            full.partial = 0;
            st = mesh_with_sharding_constraint(&c, &a, &full, "ns_gram");
        }
        /* stacked: where A is whole on every device, XLA:TPU writes B = b A + c A A in the dtype of the one
         * pass that reads it (muon_update_buffers in configs/hardware/v5p.yml); counted only */
        c.out_counted = st == SIM_OK && hold_products && gather && whole(&a) ? gather : NULL;
        if (st == SIM_OK) st = mesh_einsum(&c, s_sq, &a, &a, NULL, "ns_gram_sq", SIM_MEM_TEMP, &aa, NULL);
        c.out_counted = NULL;
        if (st == SIM_OK) st = axpby(&c, (float)NS_B, &a, (float)NS_C, &aa, "ns_poly", &bm); /* b A + c A A */
        mesh_array_free(c.dev, &a);
        if (st == SIM_OK) st = mesh_einsum(&c, s_bx, &bm, x, NULL, "ns_bx", SIM_MEM_TEMP, &bx, NULL);
        mesh_array_free(c.dev, &bm);
        if (st == SIM_OK && hold_products) {
            size_t b = bx.nlocal * sim_dtype_size(bx.counted);
            st = sim_arena_charge(arena, b, SIM_MEM_TEMP, "Newton-Schulz product held for the update");
            if (st == SIM_OK) held += b;
        }
        if (c.cache) mesh_reshard_cache_free(c.cache);
        c.cache = NULL;
        if (st == SIM_OK) st = axpby(&c, (float)NS_A, x, 1.0f, &bx, "ns_step", &nx); /* a X + B X */
        if (st == SIM_OK) {
            mesh_array_free(c.dev, x);
            *x = nx;
            memset(&nx, 0, sizeof nx);
        }
    }
    /* back to the weight's sharding for the elementwise update */
    if (st == SIM_OK && (x->spec.partial || !mesh_spec_equal(&x->spec, &keep)))
        st = mesh_with_sharding_constraint(&c, x, &keep, "ns_out");
    if (held) sim_arena_discharge(arena, held, SIM_MEM_TEMP);
    return st;
}

/* ---------------------------------------------------------------- the update */

/* Layer l's shard <-> its slice of the stacked local shard (layer dim sd unsplit). */
static void layer_copy(mesh_array *stacked, const mesh_array *layer, int sd, int l, int n_layers, bool to_stacked)
{
    if (!stacked->data || !layer->data) return;
    size_t outer = 1, inner = 1;
    for (int d = 0; d < sd; d++) outer *= (size_t)stacked->local[d];
    for (int d = sd + 1; d < stacked->rank; d++) inner *= (size_t)stacked->local[d];
    float *s = stacked->data, *y = layer->data;
    for (size_t o = 0; o < outer; o++) {
        float *ps = s + (o * (size_t)n_layers + (size_t)l) * inner, *py = y + o * inner;
        if (to_stacked) memcpy(ps, py, inner * sizeof(float));
        else memcpy(py, ps, inner * sizeof(float));
    }
}

typedef struct {
    float *x, *mu, *nu, *out;
    const float *g;
    bool clip;
    float gnorm, thr, neg_lr, b1, b2, omb1, omb2, bc1, bc1n, bc2, eps, eps_root, wd;
} nadam_job;

/* optax.adamw(nesterov=True) on one shard; also the momentum half of Muon (nu == NULL):
 * out = b1 * (mu / bc1n) + (1 - b1) * (g / bc1) */
static void nadam_chunk(int64_t lo, int64_t hi, void *arg)
{
    const nadam_job *J = arg;
    for (int64_t i = lo; i < hi; i++) {
        float gi = J->clip ? (J->g[i] / J->gnorm) * J->thr : J->g[i];
        float mi = J->omb1 * gi + J->b1 * J->mu[i];
        J->mu[i] = mi;
        float mhat = J->b1 * (mi / J->bc1n) + J->omb1 * (gi / J->bc1);
        if (!J->nu) {
            J->out[i] = mhat;
            continue;
        }
        float vi = J->omb2 * (gi * gi) + J->b2 * J->nu[i];
        J->nu[i] = vi;
        float u = mhat / (sqrtf(vi / J->bc2 + J->eps_root) + J->eps);
        u = u + J->wd * J->x[i];
        J->x[i] = J->x[i] + J->neg_lr * u;
    }
}

typedef struct {
    float *x;
    const float *o;
    float scale, wd, neg_lr;
} apply_job;

static void apply_chunk(int64_t lo, int64_t hi, void *arg)
{
    const apply_job *J = arg;
    for (int64_t i = lo; i < hi; i++) {
        float u = J->scale * J->o[i];
        u = u + J->wd * J->x[i];
        J->x[i] = J->x[i] + J->neg_lr * u;
    }
}

static sim_status check_layer(const model_param *p, int l, bool need_nu)
{
    const mesh_array *w = &p->w[l];
    if (!p->g || !p->slot[0] || (need_nu && !p->slot[1]))
        return sim_err(SIM_ERR_INTERNAL, "muon: '%s' lacks gradient or optimizer state", p->def.path);
    const mesh_array *o[3] = {&p->g[l], &p->slot[0][l], need_nu ? &p->slot[1][l] : &p->slot[0][l]};
    mesh_array_owned(w); /* the update writes the parameter and its moments in place */
    for (int i = 0; i < 3; i++) mesh_array_owned(o[i]);
    for (int i = 0; i < 3; i++)
        if (o[i]->nlocal != w->nlocal || !mesh_spec_equal(&o[i]->spec, &w->spec))
            return sim_err(SIM_ERR_INTERNAL, "muon: '%s' layer %d: state and parameter shards differ", p->def.path, l);
    return SIM_OK;
}

/* Leaf p's momentum step and Nesterov estimate, stacked into the float32 temporary x (the leaf's
 * shard, layer dim unsplit): the gradient's last read. */
static sim_status muon_estimate(mesh_ctx *ctx, const model_muon_cfg *mc, const nadam_job *base, long long s,
                                model_param *pp, mesh_array *x)
{
    const double t = (double)(s + 1); /* optax's count after the increment */
    nadam_job J = *base;
    const double beta = mc->beta;
    J.b1 = (float)beta, J.omb1 = (float)(1.0 - beta);
    J.bc1 = (float)(1.0 - pow(beta, t)), J.bc1n = (float)(1.0 - pow(beta, t + 1));
    int sd = pp->def.scan_dim;
    if (sd >= 0 && pp->spec.n_axes[sd] > 0)
        return sim_err(SIM_ERR_INPUT,
                       "opt_type=muon: '%s' has its layer dim sharded (pipelining); Muon needs the "
                       "[dim0, layers, ...] layout unsplit",
                       pp->def.path);
    SIM_TRY(mesh_array_new_raw(ctx->dev, ctx->mesh, pp->def.path, pp->def.rank, pp->def.shape, &pp->spec, SIM_F32,
                               SIM_MEM_TEMP, x));
    float *tmp = NULL;
    for (int l = 0; l < pp->n_layers; l++) {
        if (!pp->w[l].data) continue;
        if (sd < 0) { /* not stacked: the leaf is the layer */
            J.out = x->data;
        } else {
            if (!tmp) tmp = malloc(pp->w[l].nlocal * sizeof(float));
            if (!tmp) {
                mesh_array_free(ctx->dev, x);
                return sim_err(SIM_ERR_INTERNAL, "muon: out of host memory");
            }
            J.out = tmp;
        }
        J.x = pp->w[l].data, J.g = pp->g[l].data, J.mu = pp->slot[0][l].data, J.nu = NULL;
        bk_parallel_for((int64_t)pp->w[l].nlocal, 1 << 15, nadam_chunk, &J);
        if (sd >= 0) {
            mesh_array tl = pp->w[l];
            tl.data = tmp;
            layer_copy(x, &tl, sd, l, pp->n_layers, true);
        }
    }
    free(tmp);
    return SIM_OK;
}

/* Leaf p's orthogonalization of its estimate x and the parameter update; frees x. */
static sim_status muon_finish(mesh_ctx *ctx, const model_muon_cfg *mc, const model_optim_cfg *o,
                              const model_muon_dims *dims, float neg_lr, model_param *pp, mesh_array *x)
{
    static const sim_dtype bf16 = SIM_BF16;
    const int sd = pp->def.scan_dim;
    sim_status st = model_muon_orthogonalize(ctx, dims, o->eps, pp->def.path, mc->ns_gather_bf16 ? &bf16 : NULL,
                                             mc->ns_gather_once, mc->stacked, x);
    apply_job A = {NULL, NULL, model_muon_scale(mc, &pp->def, dims), (float)mc->weight_decay, neg_lr};
    float *tmp = NULL;
    for (int l = 0; st == SIM_OK && l < pp->n_layers; l++) {
        if (!pp->w[l].data) continue;
        const float *upd = x->data;
        if (sd >= 0) {
            if (!tmp) tmp = malloc(pp->w[l].nlocal * sizeof(float));
            if (!tmp) {
                st = sim_err(SIM_ERR_INTERNAL, "muon: out of host memory");
                break;
            }
            mesh_array tl = pp->w[l];
            tl.data = tmp;
            layer_copy(x, &tl, sd, l, pp->n_layers, false);
            upd = tmp;
        }
        A.x = pp->w[l].data, A.o = upd;
        bk_parallel_for((int64_t)pp->w[l].nlocal, 1 << 15, apply_chunk, &A);
    }
    free(tmp);
    mesh_array_free(ctx->dev, x);
    return st;
}

/* optax's order of the leaves: jax flattens a dict in sorted key order, so the paths compare segment by
 * segment ("params.decoder.layers.mlp.wi_0" before "params.decoder.layers.self_attention.key"). */
static int tree_cmp(const char *a, const char *b)
{
    for (;;) {
        size_t la = strcspn(a, "."), lb = strcspn(b, ".");
        int c = strncmp(a, b, la < lb ? la : lb);
        if (c) return c;
        if (la != lb) return la < lb ? -1 : 1;
        if (!a[la] || !b[lb]) return a[la] ? 1 : b[lb] ? -1 : 0;
        a += la + 1, b += lb + 1;
    }
}

/* A leaf's gradient bytes as the arena counts them. */
static size_t grad_bytes(const model_param *pp)
{
    size_t n = 0;
    for (int l = 0; l < pp->n_layers; l++) n += pp->g[l].nlocal * sim_dtype_size(pp->g[l].counted);
    return n;
}

sim_status model_muon_update(mesh_ctx *ctx, const model_optim_cfg *o, const model_muon_dims *all_dims,
                             model_param *params, int n, long long s, double grad_norm)
{
    if (s < 0) return sim_err(SIM_ERR_INTERNAL, "optimizer step %lld: counts from 0", s);
    const model_muon_cfg *mc = model_muon_cfg_of(o);
    const bool clip = model_clip_applies(o, grad_norm);
    const double t = (double)(s + 1); /* optax's count after the increment */
    nadam_job base = {0};
    base.clip = clip;
    base.gnorm = (float)grad_norm;
    base.thr = (float)o->clip;
    base.neg_lr = (float)-model_lr_at(o, s);
    for (int p = 0; p < n; p++) {
        model_param *pp = &params[p];
        const model_muon_dims dims = all_dims[p];
        if (pp->def.state_var) continue; /* not trained (MaxText's MoEBiasVar is no optax leaf) */
        for (int l = 0; l < pp->n_layers; l++) SIM_TRY(check_layer(pp, l, !dims.muon));
        if (dims.muon) continue;
        nadam_job J = base; /* the AdamW branch: optax.adamw(nesterov=True) */
        J.b1 = (float)o->b1, J.b2 = (float)o->b2, J.omb1 = (float)(1.0 - o->b1), J.omb2 = (float)(1.0 - o->b2);
        J.bc1 = (float)(1.0 - pow(o->b1, t)), J.bc1n = (float)(1.0 - pow(o->b1, t + 1));
        J.bc2 = (float)(1.0 - pow(o->b2, t));
        J.eps = (float)o->eps, J.eps_root = (float)o->eps_root, J.wd = (float)o->weight_decay;
        for (int l = 0; l < pp->n_layers; l++) {
            if (!pp->w[l].data) continue; /* dry run */
            J.x = pp->w[l].data, J.g = pp->g[l].data, J.mu = pp->slot[0][l].data, J.nu = pp->slot[1][l].data;
            bk_parallel_for((int64_t)pp->w[l].nlocal, 1 << 15, nadam_chunk, &J);
        }
    }
    if (!mc->stacked) { /* one leaf at a time: estimate, orthogonalize, update */
        for (int p = 0; p < n; p++) {
            if (params[p].def.state_var || !all_dims[p].muon) continue;
            mesh_array x;
            SIM_TRY(muon_estimate(ctx, mc, &base, s, &params[p], &x));
            SIM_TRY(muon_finish(ctx, mc, o, &all_dims[p], base.neg_lr, &params[p], &x));
        }
        return SIM_OK;
    }
    /* stacked: every leaf's estimate first, each gradient then dead (counted out until the step ends: the
     * simulator keeps the storage), then each leaf's Newton-Schulz and update (muon_update_buffers) */
    sim_arena *arena = sim_device_arena(ctx->dev);
    mesh_array *xs = calloc((size_t)(n > 0 ? n : 1), sizeof *xs);
    if (!xs) return sim_err(SIM_ERR_INTERNAL, "muon: out of host memory");
    size_t released = 0;
    sim_status st = SIM_OK;
    for (int p = 0; st == SIM_OK && p < n; p++) {
        if (params[p].def.state_var || !all_dims[p].muon) continue;
        st = muon_estimate(ctx, mc, &base, s, &params[p], &xs[p]);
        if (st == SIM_OK) {
            size_t g = grad_bytes(&params[p]);
            sim_arena_discharge(arena, g, SIM_MEM_GRADS);
            released += g;
        }
    }
    /* then the leaves in optax's tree order (llama2-7b on v6e-8: the MLP stacks before attention's) */
    bool *done = calloc((size_t)(n > 0 ? n : 1), sizeof *done);
    if (!done && st == SIM_OK) st = sim_err(SIM_ERR_INTERNAL, "muon: out of host memory");
    for (int k = 0; st == SIM_OK && k < n; k++) {
        int p = -1;
        for (int q = 0; q < n; q++)
            if (!done[q] && !params[q].def.state_var && all_dims[q].muon &&
                (p < 0 || tree_cmp(params[q].def.path, params[p].def.path) < 0))
                p = q;
        if (p < 0) break;
        done[p] = true;
        st = muon_finish(ctx, mc, o, &all_dims[p], base.neg_lr, &params[p], &xs[p]);
    }
    free(done);
    for (int p = 0; p < n; p++) mesh_array_free(ctx->dev, &xs[p]);
    free(xs);
    if (released) { /* the gradients' storage is the simulator's from step to step */
        sim_status c = sim_arena_charge(arena, released, SIM_MEM_GRADS, "gradients");
        if (st == SIM_OK) st = c;
    }
    return st;
}

/* ---------------------------------------------------------------- the table's row */

_Static_assert(sizeof(model_muon_cfg) <= MODEL_OPT_PRIV_BYTES, "model_muon_cfg must fit model_optim_cfg.priv");
_Static_assert(sizeof(model_muon_dims) <= MODEL_OPT_PARAM_PRIV_BYTES, "model_muon_dims must fit model_opt_param.priv");

const model_muon_cfg *model_muon_cfg_of(const model_optim_cfg *o)
{
    return (const model_muon_cfg *)(const void *)o->priv;
}

const model_muon_dims *model_muon_dims_of(const model_opt_param *p)
{
    return (const model_muon_dims *)(const void *)p->priv;
}

static sim_status row_from_config(const cfg_config *cfg, model_optim_cfg *o)
{
    return model_muon_from_config(cfg, (model_muon_cfg *)(void *)o->priv);
}

/* Which parameters Muon orthogonalizes, once (configs/muon.yml): a Muon leaf keeps one slot (mu). */
static sim_status row_define(const cfg_config *cfg, const model_param_def *defs, int n, model_opt_param *out)
{
    for (int i = 0; i < n; i++)
        if (defs[i].unscanned || (defs[i].scan_dim >= 0 && defs[i].scan_dim != 1 && !defs[i].state_var))
            return sim_err(SIM_ERR_INPUT,
                           "opt_type=muon with scan_layers=false or param_scan_axis other than 1: Muon is simulated "
                           "for MaxText's default layer layout only; drop one of the two");
    model_muon_cfg *mc = malloc(sizeof *mc);
    if (!mc) return sim_err(SIM_ERR_INTERNAL, "muon: out of host memory");
    sim_status st = model_muon_from_config(cfg, mc);
    for (int i = 0; st == SIM_OK && i < n; i++) {
        model_muon_dims *d = (model_muon_dims *)(void *)out[i].priv;
        model_muon_classify(mc, &defs[i], d);
        out[i].branch = d->muon ? 1 : -1; /* optax muon's partition: the Muon or the AdamW branch */
        if (d->muon && out[i].n_slots) out[i].n_slots = 1;
    }
    free(mc);
    return st;
}

static sim_status row_update(const model_opt_step *st)
{
    model_muon_dims *dims = calloc((size_t)(st->n > 0 ? st->n : 1), sizeof *dims);
    if (!dims) return sim_err(SIM_ERR_INTERNAL, "muon: out of host memory");
    for (int i = 0; i < st->n; i++) dims[i] = *model_muon_dims_of(&st->pp[i]);
    sim_status s = model_muon_update(st->ctx, st->o, dims, st->params, st->n, st->s, st->grad_norm);
    free(dims);
    return s;
}

/* A Muon leaf's elementwise passes: the momentum pass reads the gradient and mu and writes mu and the
 * float32 Nesterov estimate (nadam_chunk), the normalisation reads and writes the estimate
 * (divide_by_norm), the update reads the orthogonalised estimate and the parameter and writes the
 * parameter (apply_chunk): 3 + 2 n_slots + 4.  An AdamW-branch leaf is one fused pass (nadam_chunk with
 * nu): 3 + 2 n_slots.  The Newton-Schulz products between them are mesh ops, timed from their records. */
static int row_traffic(const model_opt_param *pp) { return 3 + 2 * pp->n_slots + (pp->branch == 1 ? 4 : 0); }

/* optax.contrib.muon: a partition state, branches in key order ('adam', 'muon'); adamw =
 * chain(scale_by_adam, add_decayed_weights, scale_by_learning_rate), muon's chain has
 * scale_by_shape too: the schedule's count sits at [2] and [3] */
static sim_status row_tree(const model_opt_tree *t)
{
    static const char *const br[2] = {".opt_state/.inner_states/['adam']/.inner_state",
                                      ".opt_state/.inner_states/['muon']/.inner_state"};
    char key[MODEL_OPT_KEY_MAX];
    for (int b = 0; b < 2; b++) {
        int want = b ? 1 : -1;
        snprintf(key, sizeof key, "%s/[0]/.count", br[b]);
        SIM_TRY(t->leaf(t->arg, key, -1, 0));
        for (int part = 0; part < (b ? 1 : 2); part++)
            for (int i = 0; i < t->n; i++) {
                if (t->branch[i] != want || t->stateless[i]) continue;
                snprintf(key, sizeof key, "%s/[0]/.%s/['params']%.900s", br[b], part ? "nu" : "mu", t->rel[i]);
                SIM_TRY(t->leaf(t->arg, key, i, 0));
            }
        if (b) {
            snprintf(key, sizeof key, "%s/[0]/.ns_coeffs", br[b]);
            SIM_TRY(t->leaf(t->arg, key, -1, 3)); /* (a, b, c) */
        }
        snprintf(key, sizeof key, "%s/[%d]/.count", br[b], b ? 3 : 2);
        SIM_TRY(t->leaf(t->arg, key, -1, 0));
    }
    return SIM_OK;
}

const model_optimizer model_opt_muon = {
    .name = "muon",
    .n_slots = 2, /* an AdamW-fallback leaf: mu, nu; a Muon leaf: mu (row_define) */
    .slot = {"mu", "nu"},
    .zero1_refused = "shard_optimizer_over_data=true (ZeRO-1) with opt_type=muon: ZeRO-1 with Muon is broken at "
                     "MaxText's head (Linen raises NotImplementedError; NNX shards only the AdamW branch's state); "
                     "set shard_optimizer_over_data=false or use opt_type=adamw",
    .pipeline_refused = "is not simulated yet; use opt_type=adamw or ici_pipeline_parallelism=1",
    .from_config = row_from_config,
    .define = row_define,
    .update = row_update,
    .tree = row_tree,
    .traffic = row_traffic,
};
