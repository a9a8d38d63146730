/* batchsplit.c — the DeepSeek batch-split schedule (see batchsplit.h).
 *
 * MaxText (models/deepseek_batchsplit.py, reference/maxtext-facts-2.md §B.3-B.5):
 *   - activations are P(('data','fsdp','expert'), None, None) ('data' kept even
 *     when it has size 1; here size-1 axes are dropped, which moves the same
 *     bytes) and each device splits its local rows into two
 *     microbatches, rows i, i+2, i+4, ... (no collectives); merge undoes it;
 *   - gather_weights all-gathers every large weight over fsdp (cast to cfg.dtype
 *     first) one layer ahead: the forward of layer l gathers layer l+1's, the
 *     backward of layer l gathers layer l-1's (held in md->bs_prefetch); the
 *     transpose is a reduce-scatter over fsdp, then a psum over expert for the
 *     weights not sharded on it (reduce_scatter_ws_grad), then a psum over data
 *     in its own step (all_reduce_ws_grad_dcn);
 *   - attention (norm, MLA, residual) runs for mb0 then mb1, then the MoE for mb0
 *     then mb1: post-attention norm, shared expert, router, all-gather of the
 *     tokens (and their routing) over expert, the local experts' grouped matmuls,
 *     local un-sort, reduce-scatter over expert, plus the shared expert and the
 *     residual.
 * Differences here (same numbers, same bytes): the schedule runs inside a
 * per-layer remat entry, so the split and the merge happen in every layer (local
 * copies), and mb1's combine ends its own layer instead of starting the next one.
 * The dispatch rows of a dry run are an equal share per expert (the real counts
 * are data); every buffer is accounted at MaxText's static size, so dry and real
 * memory agree. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "blas_kernels/bk_activation.h"
#include "blas_kernels/bk_gemm.h"
#include "blas_kernels/bk_topk.h"
#include "mesh/ad.h"
#include "models/blocks/mla.h"
#include "models/blocks/moe.h"
#include "mesh/nn.h"
#include "mesh/reshard.h"
#include "models/families/batchsplit.h"

/* ------------------------------------------------------------ the weights of a layer */

/* The weights gather_weights all-gathers: the dim fsdp shards (per-layer shape),
 * and whether expert shards dim 0 (the routed experts; the others are summed over
 * expert in backward). */
typedef struct {
    const char *suffix;
    int fsdp_dim;
    bool routed;
} bs_weight;

static const bs_weight WEIGHTS[] = {
    {"moe_layers.self_attention.wq_a.kernel", 0, false},
    {"moe_layers.self_attention.wq_b.kernel", 0, false},
    {"moe_layers.self_attention.wkv_a.kernel", 0, false},
    {"moe_layers.self_attention.wkv_b.kernel", 0, false},
    {"moe_layers.self_attention.out.kernel", 2, false},
    {"moe_layers.DeepSeekMoeBlock_0.MoeBlock_0.gate.kernel", 0, false},
    {"moe_layers.DeepSeekMoeBlock_0.MoeBlock_0.wi_0", 1, true},
    {"moe_layers.DeepSeekMoeBlock_0.MoeBlock_0.wi_1", 1, true},
    {"moe_layers.DeepSeekMoeBlock_0.MoeBlock_0.wo", 2, true},
    {"moe_layers.DeepSeekMoeBlock_0.shared_experts.wi_0.kernel", 0, false},
    {"moe_layers.DeepSeekMoeBlock_0.shared_experts.wi_1.kernel", 0, false},
    {"moe_layers.DeepSeekMoeBlock_0.shared_experts.wo.kernel", 1, false},
};
enum { NW = sizeof WEIGHTS / sizeof WEIGHTS[0], W_GATE = 5, W_WI0 = 6, W_WI1 = 7, W_WO = 8 };

/* "self_attention.wq_a", "wi_0", "shared_experts.wo": the weight's name in tags. */
static void short_name(const char *suffix, char *buf, size_t cap)
{
    const char *s = strstr(suffix, "shared_experts."), *dot = strrchr(suffix, '.');
    if (!s) s = strcmp(dot, ".kernel") ? dot + 1 : suffix + strlen("moe_layers.");
    size_t n = strlen(s);
    if (n > 7 && !strcmp(s + n - 7, ".kernel")) n -= 7;
    snprintf(buf, cap, "%.*s", (int)n, s);
}

/* Mesh axis index by name, or -1 when absent or of size 1. */
static int axis_of(const mesh_shape *m, const char *name)
{
    int a = mesh_shape_axis_index(m, name);
    return a >= 0 && m->sizes[a] > 1 ? a : -1;
}

static uint32_t bit(int a) { return a >= 0 ? 1u << a : 0; }

/* The per-layer spec gather_weights' in_specs give weight w (size-1 axes dropped). */
static void expected_spec(const mesh_shape *m, const bs_weight *w, int rank, mesh_spec *s)
{
    mesh_spec_init(s, rank);
    int f = axis_of(m, "fsdp"), e = axis_of(m, "expert");
    if (f >= 0) s->axes[w->fsdp_dim][s->n_axes[w->fsdp_dim]++] = (int8_t)f;
    if (w->routed && e >= 0) s->axes[0][s->n_axes[0]++] = (int8_t)e;
}

/* The schedule's activation spec P(('data','fsdp','expert'), None...) of rank r (size-1 axes dropped). */
static mesh_spec act_spec(const mesh_shape *m, int rank)
{
    mesh_spec s;
    mesh_spec_init(&s, rank);
    static const char *const names[3] = {"data", "fsdp", "expert"};
    for (int i = 0; i < 3; i++) {
        int a = mesh_shape_axis_index(m, names[i]);
        if (a >= 0) s.axes[0][s.n_axes[0]++] = (int8_t)a;
    }
    /* MaxText keeps 'data' at size 1 in this spec; a size-1 axis moves nothing, and leaving it out
     * keeps the planner from re-laying out activations the rule-resolved specs name without it */
    mesh_spec_drop_size_one(&s, m);
    return s;
}

/* ------------------------------------------------------------ setup */

static sim_status refuse(const char *key, const char *why)
{
    return sim_err(SIM_ERR_INPUT, "%s with use_batch_split_schedule=true: %s", key, why);
}

sim_status batchsplit_setup(model_def *m, const cfg_config *cfg)
{
    const model_dims *d = &m->d;
    ds_dims *ds = deepseek_dims(m);
    bool on;
    SIM_TRY(model_cfg_bool(cfg, "use_batch_split_schedule", &on));
    SIM_TRY(model_cfg_i64(cfg, "batch_split_factor", &ds->split_factor));
    if (!on) return SIM_OK; /* MaxText reads batch_split_factor only with the schedule */
    ds->batch_split = true;
    char buf[512];
    if (ds->split_factor != 2) {
        snprintf(buf, sizeof buf,
                 "batch_split_factor=%lld: MaxText's bf16 batch-split path (deepseek_batchsplit.py) only traces with "
                 "two microbatches (its MoE out_specs and the layer scan read microbatch 1); set batch_split_factor=2",
                 (long long)ds->split_factor);
        return sim_err(SIM_ERR_INPUT, "%s", buf);
    }
    if (d->mode != MESH_MODE_EXPLICIT)
        return refuse(
            "shard_mode=auto",
            "the schedule is written with jax.reshard, reduced/unreduced specs and pcast, which need explicit "
            "mesh axes; set shard_mode=explicit");
    if (!d->scan_layers)
        return refuse("scan_layers=false",
                      "MaxText runs the schedule inside the scanned DeepSeek branch only; set scan_layers=true");
    if (d->pipe.on)
        return refuse("ici_pipeline_parallelism",
                      "the pipeline branch of MaxText's decoder has no batch-split schedule; use 1 stage");
    if (d->zero1) return refuse("shard_optimizer_over_data=true", "not simulated together; drop one of the two");
    int64_t moe_layers = d->layers - ds->dense_layers;
    if (moe_layers < 4) {
        snprintf(buf, sizeof buf,
                 "base_num_decoder_layers=%lld with first_num_dense_layers=%lld gives %lld MoE layers; MaxText's "
                 "scan_batch_split_layers asserts num_layers >= 4: use at least 4 MoE layers",
                 (long long)d->layers, (long long)ds->dense_layers, (long long)moe_layers);
        return refuse("base_num_decoder_layers", buf);
    }
    /* what the schedule hard-codes (deepseek_batchsplit.py reads none of these keys) */
    if (!ds->moe.routed_sigmoid)
        return refuse("routed_score_func", "the schedule's router always uses sigmoid scores; set \"sigmoid\"");
    if (!ds->moe.routed_bias)
        return refuse("routed_bias=false", "the schedule always adds the gate bias; set routed_bias=true");
    if (ds->mla.q_lora < 1)
        return refuse("q_lora_rank=0",
                      "the schedule's MLA always has the wq_a/wq_b low-rank query; set q_lora_rank > 0");
    if (ds->moe.shared_experts < 1)
        return refuse("shared_experts=0", "the schedule always runs a shared expert; use shared_experts >= 1");
    if (ds->moe.lb_weight > 0)
        return refuse("load_balance_loss_weight",
                      "the schedule computes no load-balance loss (MaxText ignores the key there); set 0");
    if (d->dropout > 0)
        return refuse("enable_dropout", "the schedule has no dropout (MaxText ignores it there); set false");
    int64_t mtp;
    SIM_TRY(model_cfg_i64(cfg, "mtp_num_layers", &mtp));
    if (mtp > 0) /* MaxText runs them through the schedule's own per-layer variant (batch_split_layer) */
        return refuse("mtp_num_layers", "the multi-token-prediction layers of the schedule are not simulated; set 0");
    if (ds->moe.shard_exp_on_fsdp)
        return refuse(
            "shard_exp_on_fsdp=true",
            "the schedule's gather_weights expects the routed experts on ('expert', 'fsdp', None); set false");
    /* group-limited routing, top 2 experts per group (hard-coded top_k_in_group=2); deepseek.c read
     * and checked the groups (routing_groups = 0: off) */
    if (ds->moe.routing_groups < 1)
        return refuse("n_routing_groups",
                      "the schedule always routes by expert groups (deepseek_batchsplit.py reshapes the scores by "
                      "n_routing_groups); set n_routing_groups and topk_routing_group (the model file's 8 and 4), "
                      "with a DeepSeek-V3 model_name");
    if (ds->moe.bias_update_rate > 0)
        return refuse("routed_bias_update_rate",
                      "the schedule's router records no expert counts for the loss-free bias update; set 0");
    /* only data, fsdp and expert may shard */
    for (int a = 0; a < m->mesh.n_axes; a++) {
        const char *n = m->mesh.names[a];
        if (m->mesh.sizes[a] > 1 && strcmp(n, "data") && strcmp(n, "fsdp") && strcmp(n, "expert")) {
            snprintf(buf, sizeof buf,
                     "mesh axis %s has size %d; the schedule's activations and weights are sharded over data, fsdp "
                     "and expert only (other axes would hold replicas); set ici_%s_parallelism=1",
                     n, m->mesh.sizes[a], n);
            return refuse(n, buf);
        }
    }
    /* every gathered weight must be stored as gather_weights' in_specs expect */
    for (int w = 0; w < NW; w++) {
        int i = model_param_index(m, WEIGHTS[w].suffix);
        SIM_ASSERT(i >= 0);
        const model_param_def *pd = &m->defs[i];
        mesh_spec have, want;
        mesh_spec_init(&have, pd->rank - 1);
        for (int k = 0, j = 0; k < pd->rank; k++) {
            if (k == pd->scan_dim) continue;
            have.n_axes[j] = m->spec[i].n_axes[k];
            memcpy(have.axes[j], m->spec[i].axes[k], sizeof have.axes[j]);
            j++;
        }
        expected_spec(&m->mesh, &WEIGHTS[w], pd->rank - 1, &want);
        if (!mesh_spec_equal(&have, &want)) {
            char hs[128], ws[128];
            mesh_spec_format(&have, &m->mesh, hs, sizeof hs);
            mesh_spec_format(&want, &m->mesh, ws, sizeof ws);
            snprintf(buf, sizeof buf,
                     "%s is stored as %s per layer under these rules, while the schedule's gather_weights takes it "
                     "as %s; use the rules of configs/models/deepseek3-671b-batchsplit.yml "
                     "(override_logical_axis_rules=true)",
                     pd->path, hs, ws);
            return refuse("logical_axis_rules", buf);
        }
    }
    return SIM_OK;
}

/* ------------------------------------------------------------ helpers */

static const char *tagof(mesh_tape *t, const char *name, char *buf, size_t cap)
{
    return mesh_tape_tag(t, name, buf, cap);
}

/* An arena block (NULL data in a dry run). */
typedef struct {
    void *p;
    size_t bytes, counted; /* stored; as the modelled program holds it (dtype) */
    sim_mem_cat cat;
} bs_buf;

static sim_status buf_alloc_dt(sim_device *d, bs_buf *b, size_t bytes, sim_dtype dt, sim_mem_cat cat, const char *name,
                               bool zero)
{
    b->bytes = bytes;
    b->counted = bytes / sim_dtype_size(dt) * sim_dtype_size(sim_device_counted_dtype(d, dt, cat));
    b->cat = cat;
    b->p = NULL;
    sim_status st = sim_arena_alloc_counted(sim_device_arena(d), bytes, b->counted, cat, name, zero, &b->p);
    if (st) memset(b, 0, sizeof *b); /* nothing was charged: buf_free on it is a no-op */
    return st;
}

static sim_status buf_alloc(sim_device *d, bs_buf *b, size_t bytes, sim_mem_cat cat, const char *name, bool zero)
{
    return buf_alloc_dt(d, b, bytes, SIM_F32, cat, name, zero);
}

static void buf_free(sim_device *d, bs_buf *b)
{
    if (b->bytes || b->p) sim_arena_release_counted(sim_device_arena(d), b->p, b->bytes, b->counted, b->cat);
    memset(b, 0, sizeof *b);
}

static sim_status new_out(mesh_tape *t, const char *name, int rank, const int64_t *shape, const mesh_spec *spec,
                          sim_dtype dt, mesh_var **out)
{
    mesh_ctx *c = mesh_tape_ctx(t);
    *out = mesh_tape_var(t);
    return mesh_array_new_raw(c->dev, c->mesh, name, rank, shape, spec, dt, SIM_MEM_ACTIVATIONS, &(*out)->val);
}

/* The cotangent of y brought to `spec` with exactly the partial axes `partial` (widening is
 * free; other partial axes are summed by the planner). */
static sim_status cot_as(mesh_tape *t, mesh_var *y, const mesh_spec *spec, uint32_t partial, const char *tag)
{
    mesh_ctx *c = mesh_tape_ctx(t);
    mesh_spec want = *spec;
    want.partial = partial;
    if (mesh_spec_equal(&y->grad.spec, &want)) return SIM_OK;
    return mesh_reshard(c->dev, c->mesh, &y->grad, &want, sim_meta_tag(tag));
}

/* ------------------------------------------------------------ split and merge */

/* Local rows (R = rows of the shard, W floats each): mb[i] row r <-> x row 2r + i. */
static void interleave(float *x, float *mb0, float *mb1, int64_t R, int64_t W, bool to_x)
{
    if (!x) return;
    float *mb[2] = {mb0, mb1};
    for (int64_t r = 0; r < R; r++)
        for (int i = 0; i < 2; i++) {
            if (!mb[i]) continue;
            float *xr = x + (2 * r + i) * W, *mr = mb[i] + r * W;
            if (to_x) memcpy(xr, mr, (size_t)W * sizeof(float));
            else memcpy(mr, xr, (size_t)W * sizeof(float));
        }
}

static int64_t row_width(const mesh_array *a)
{
    int64_t w = 1;
    for (int i = 1; i < a->rank; i++) w *= a->local[i];
    return w;
}

static sim_status split_vjp(mesh_tape *t, mesh_entry *e)
{
    mesh_var *x = e->in[0], *y[2] = {e->out[0], e->out[1]};
    const mesh_array *xa = &x->val;
    char tag[SIM_TAG_MAX];
    tagof(t, "split/dx", tag, sizeof tag);
    uint32_t P = (y[0]->has_grad ? y[0]->grad.spec.partial : 0) | (y[1]->has_grad ? y[1]->grad.spec.partial : 0);
    for (int i = 0; i < 2; i++)
        if (y[i]->has_grad) SIM_TRY(cot_as(t, y[i], &y[i]->val.spec, P, tag));
    mesh_spec ds = xa->spec;
    ds.partial = P;
    mesh_array dx;
    SIM_TRY(mesh_tape_zeros(t, "split/dx", xa->rank, xa->shape, &ds, SIM_MEM_TEMP, &dx));
    interleave(dx.data, y[0]->has_grad ? y[0]->grad.data : NULL, y[1]->has_grad ? y[1]->grad.data : NULL,
               xa->local[0] / 2, row_width(xa), true);
    return mesh_tape_accumulate(t, x, &dx, tag);
}

/* x (B, ...) with spec s (batch dim 0) -> two microbatches (B/2, ...), same spec. */
static sim_status split(mesh_tape *t, mesh_var *x, mesh_var **mb0, mesh_var **mb1)
{
    const mesh_array *xa = &x->val;
    if (xa->local[0] % 2)
        return sim_err(SIM_ERR_INPUT,
                       "batch_split_factor=2: each device splits its rows into two microbatches, but it holds %lld "
                       "rows; use an even number of rows per device (per_device_batch_size)",
                       (long long)xa->local[0]);
    int64_t shape[MESH_SPEC_MAX_RANK];
    memcpy(shape, xa->shape, sizeof shape);
    shape[0] /= 2;
    SIM_TRY(new_out(t, "batch_split/mb0", xa->rank, shape, &xa->spec, SIM_F32, mb0));
    SIM_TRY(new_out(t, "batch_split/mb1", xa->rank, shape, &xa->spec, SIM_F32, mb1));
    interleave(xa->data, (*mb0)->val.data, (*mb1)->val.data, xa->local[0] / 2, row_width(xa), false);
    char tag[SIM_TAG_MAX];
    mesh_var *outs[2] = {*mb0, *mb1};
    mesh_tape_record(t, split_vjp, tagof(t, "split", tag, sizeof tag), 1, &x, 2, outs);
    return SIM_OK;
}

static sim_status merge_vjp(mesh_tape *t, mesh_entry *e)
{
    mesh_var *y = e->out[0], *mb[2] = {e->in[0], e->in[1]};
    char tag[SIM_TAG_MAX];
    tagof(t, "merge/d", tag, sizeof tag);
    SIM_TRY(cot_as(t, y, &y->val.spec, y->grad.spec.partial, tag));
    for (int i = 0; i < 2; i++) {
        mesh_spec ds = mb[i]->val.spec;
        ds.partial = y->grad.spec.partial;
        mesh_array d;
        SIM_TRY(mesh_tape_zeros(t, "merge/d", mb[i]->val.rank, mb[i]->val.shape, &ds, SIM_MEM_TEMP, &d));
        interleave(y->grad.data, i ? NULL : d.data, i ? d.data : NULL, y->val.local[0] / 2, row_width(&y->val), false);
        SIM_TRY(mesh_tape_accumulate(t, mb[i], &d, tag));
    }
    return SIM_OK;
}

static sim_status merge(mesh_tape *t, mesh_var *mb0, mesh_var *mb1, mesh_var **y)
{
    const mesh_array *a = &mb0->val;
    char tag[SIM_TAG_MAX];
    tagof(t, "merge", tag, sizeof tag);
    mesh_var *in[2] = {mb0, mb1};
    mesh_array ops[2];
    bool owned[2];
    for (int i = 0; i < 2; i++) SIM_TRY(mesh_nn_operand(t, &in[i]->val, &a->spec, tag, &ops[i], &owned[i]));
    int64_t shape[MESH_SPEC_MAX_RANK];
    memcpy(shape, a->shape, sizeof shape);
    shape[0] *= 2;
    mesh_spec s = a->spec;
    s.partial = 0;
    SIM_TRY(new_out(t, "batch_split/merged", a->rank, shape, &s, SIM_F32, y));
    interleave((*y)->val.data, ops[0].data, ops[1].data, a->local[0], row_width(a), true);
    for (int i = 0; i < 2; i++)
        if (owned[i]) mesh_array_free(mesh_tape_ctx(t)->dev, &ops[i]);
    mesh_tape_record(t, merge_vjp, tag, 2, in, 1, y);
    return SIM_OK;
}

/* The positions (B, T) int32 of microbatch i: the same interleave, no gradient.  The array
 * belongs to the tape (the rope VJPs read it in backward). */
static sim_status split_positions(model_dev *md, mesh_tape *t, const mesh_array *pos, int i, mesh_array *out)
{
    mesh_ctx *c = &md->ctx;
    mesh_var *v = mesh_tape_var(t);
    mesh_spec s = act_spec(c->mesh, 2);
    mesh_array p;
    SIM_TRY(mesh_array_clone(c->dev, c->mesh, pos, "batch_split/positions", SIM_MEM_TEMP, &p));
    if (!mesh_spec_equal(&p.spec, &s))
        SIM_TRY(mesh_reshard(c->dev, c->mesh, &p, &s, sim_meta_tag("batch_split/positions")));
    int64_t shape[2] = {p.shape[0] / 2, p.shape[1]};
    sim_status st =
        mesh_array_new_raw(c->dev, c->mesh, "batch_split/positions_mb", 2, shape, &s, SIM_I32, SIM_MEM_TEMP, &v->val);
    *out = v->val;
    if (st == SIM_OK && p.data) {
        const int32_t *src = p.data;
        int32_t *dst = out->data;
        int64_t T = p.local[1];
        for (int64_t r = 0; r < p.local[0] / 2; r++)
            memcpy(dst + r * T, src + (2 * r + i) * T, (size_t)T * sizeof(int32_t));
    }
    mesh_array_free(c->dev, &p);
    return st;
}

/* ------------------------------------------------------------ gather_weights */

/* Payload of a gathered weight: its all-gather geometry. */
static sim_status gather_vjp(mesh_tape *t, mesh_entry *e)
{
    mesh_ctx *c = mesh_tape_ctx(t);
    mesh_var *w = e->in[0], *y = e->out[0];
    int f = (int)e->i[0], ex = (int)e->i[1], da = (int)e->i[2], dim = (int)e->i[3];
    bool routed = e->f[0] != 0;
    sim_dtype wire = (sim_dtype)e->f[1];
    char tag[SIM_TAG_MAX], base[SIM_TAG_MAX];
    snprintf(base, sizeof base, "%s", e->tag);
    /* the per-device weight gradient: partial over the axes that shard the tokens */
    uint32_t P = bit(f) | bit(da) | (routed ? 0 : bit(ex));
    SIM_TRY(cot_as(t, y, &y->val.spec, P, base));
    const mesh_array *g = &y->grad, *wa = &w->val;
    mesh_spec rs = wa->spec; /* after the fsdp reduce-scatter: the stored spec, still summed over the rest */
    rs.partial = bit(da) | (routed ? 0 : bit(ex));
    mesh_array dw;
    SIM_TRY(mesh_tape_zeros(t, "gather_weights/dw", wa->rank, wa->shape, &rs, SIM_MEM_TEMP, &dw));
    if (f >= 0) {
        size_t outer = 1, inner = 1;
        for (int k = 0; k < dim; k++) outer *= (size_t)g->local[k];
        for (int k = dim + 1; k < g->rank; k++) inner *= (size_t)g->local[k];
        snprintf(tag, sizeof tag, "%.70s/reduce_scatter_ws_grad", base);
        SIM_TRY(sim_reduce_scatter_dim(c->dev, g->data, dw.data, outer, (size_t)g->local[dim], inner, SIM_F32,
                                       sim_axes_1(f), sim_meta_counted(sim_meta_weight(tag), wire)));
    } else if (g->data) {
        memcpy(dw.data, g->data, g->nlocal * sizeof(float));
    }
    if (!routed && ex >= 0) {
        snprintf(tag, sizeof tag, "%.70s/ws_grad_psum_expert", base);
        SIM_TRY(sim_all_reduce(c->dev, dw.data, dw.data, dw.nlocal, SIM_F32, sim_axes_1(ex),
                               sim_meta_counted(sim_meta_weight(tag), wire)));
    }
    if (da >= 0) { /* all_reduce_ws_grad_dcn: a separate step, meant for DCN */
        snprintf(tag, sizeof tag, "%.70s/all_reduce_ws_grad_dcn", base);
        SIM_TRY(sim_all_reduce(c->dev, dw.data, dw.data, dw.nlocal, SIM_F32, sim_axes_1(da),
                               sim_meta_counted(sim_meta_weight(tag), wire)));
    }
    dw.spec.partial = 0;
    return mesh_tape_accumulate(t, w, &dw, base);
}

/* Layer l's weight w (p->w[l], spec as gather_weights' in_specs) all-gathered over fsdp along its
 * fsdp dim into a new array (the collective, tagged with the weight's layer). */
static sim_status gather_now(model_dev *md, int l, int w, mesh_array *out)
{
    mesh_ctx *c = &md->ctx;
    const mesh_shape *m = c->mesh;
    const bs_weight *bw = &WEIGHTS[w];
    const mesh_array *wa = &md->p[model_param_index(md->def, bw->suffix)].w[l];
    int f = axis_of(m, "fsdp");
    mesh_spec s = wa->spec;
    s.n_axes[bw->fsdp_dim] = 0;
    char tag[SIM_TAG_MAX], name[48];
    short_name(bw->suffix, name, sizeof name);
    snprintf(tag, sizeof tag, "decoder/moe_layers_%d/gather_weights/%s", l, name);
    SIM_TRY(mesh_array_new_raw(c->dev, m, tag, wa->rank, wa->shape, &s, SIM_F32, SIM_MEM_TEMP, out));
    if (f >= 0) {
        size_t outer = 1, inner = 1;
        for (int k = 0; k < bw->fsdp_dim; k++) outer *= (size_t)wa->local[k];
        for (int k = bw->fsdp_dim + 1; k < wa->rank; k++) inner *= (size_t)wa->local[k];
        return sim_all_gather_dim(c->dev, wa->data, out->data, outer, (size_t)wa->local[bw->fsdp_dim], inner, SIM_F32,
                                  sim_axes_1(f), sim_meta_counted(sim_meta_weight(tag), md->def->d.act_dtype));
    }
    if (wa->data) memcpy(out->data, wa->data, wa->nlocal * sizeof(float));
    return SIM_OK;
}

/* The gathered copy g of the parameter leaf w on the tape (the tape takes g): the value is g,
 * the VJP is the gather's transpose into w's gradient. */
static sim_status use_gathered(model_dev *md, mesh_tape *t, mesh_var *w, mesh_array *g, const bs_weight *bw,
                               mesh_var **y)
{
    const mesh_shape *m = mesh_tape_ctx(t)->mesh;
    *y = mesh_tape_var(t);
    (*y)->val = *g;
    memset(g, 0, sizeof *g);
    char tag[SIM_TAG_MAX];
    snprintf(tag, sizeof tag, "%.70s", (*y)->val.name);
    mesh_entry *e = mesh_tape_record(t, gather_vjp, tag, 1, &w, 1, y);
    if (e) {
        e->i[0] = axis_of(m, "fsdp");
        e->i[1] = axis_of(m, "expert");
        e->i[2] = axis_of(m, "data");
        e->i[3] = bw->fsdp_dim;
        e->f[0] = bw->routed;
        e->f[1] = (double)md->def->d.act_dtype;
    }
    return SIM_OK;
}

/* The weights one device gathered ahead for MoE layer `layer` (-1: none). */
struct batchsplit_prefetch {
    int layer;
    mesh_array w[NW];
};

static void prefetch_drop(model_dev *md)
{
    struct batchsplit_prefetch *pf = md->bs_prefetch;
    if (!pf || pf->layer < 0) return;
    for (int w = 0; w < NW; w++) mesh_array_free(md->ctx.dev, &pf->w[w]);
    pf->layer = -1;
}

void batchsplit_dev_free(model_dev *md)
{
    prefetch_drop(md);
    free(md->bs_prefetch);
    md->bs_prefetch = NULL;
}

/* ------------------------------------------------------------ routing (expert_selection) */

static sim_status route_vjp(mesh_tape *t, mesh_entry *e)
{
    mesh_var *scores = e->in[0], *y = e->out[0];
    const mesh_array *sa = &e->saved[0], *ia = &e->saved[1];
    int k = (int)e->i[0];
    double scale = e->f[0];
    char tag[SIM_TAG_MAX];
    tagof(t, "routing/dscores", tag, sizeof tag);
    SIM_TRY(cot_as(t, y, &y->val.spec, y->grad.spec.partial, tag));
    mesh_spec ds = sa->spec;
    ds.partial = y->grad.spec.partial;
    mesh_array d;
    SIM_TRY(mesh_tape_zeros(t, "routing/dscores", sa->rank, sa->shape, &ds, SIM_MEM_TEMP, &d));
    if (sa->data) {
        int64_t E = sa->local[sa->rank - 1], N = (int64_t)sa->nlocal / E;
        const float *s = sa->data, *g = y->grad.data;
        const int32_t *idx = ia->data;
        float *o = d.data;
        for (int64_t n = 0; n < N; n++) {
            double sum = 0, dot = 0;
            for (int j = 0; j < k; j++) {
                double v = s[n * E + idx[n * k + j]];
                sum += v;
                dot += (double)g[n * k + j] * v;
            }
            for (int j = 0; j < k; j++)
                o[n * E + idx[n * k + j]] += (float)(scale * ((double)g[n * k + j] / sum - dot / (sum * sum)));
        }
    }
    return mesh_tape_accumulate(t, scores, &d, tag);
}

/* scores (B, S, E) (sigmoid of the gate logits) and the gate bias (E) -> weights (B, S, k) on the
 * tape and indices (B, S, k) int32.  The bias only ranks (no gradient reaches it). */
static sim_status route(model_dev *md, mesh_tape *t, mesh_var *scores, const mesh_array *bias, mesh_var **weights,
                        mesh_var **indices)
{
    const ds_dims *ds = deepseek_dims(md->def);
    char tag[SIM_TAG_MAX];
    tagof(t, "routing", tag, sizeof tag);
    mesh_spec ss = scores->val.spec;
    ss.partial = 0;
    ss.n_axes[2] = 0;
    mesh_array sa, ba;
    bool so, bo;
    SIM_TRY(mesh_nn_operand(t, &scores->val, &ss, tag, &sa, &so));
    mesh_spec bs;
    mesh_spec_init(&bs, 1);
    SIM_TRY(mesh_nn_operand(t, bias, &bs, tag, &ba, &bo));
    int k = (int)ds->moe.top_k;
    int64_t E = ds->moe.experts, shape[3] = {sa.shape[0], sa.shape[1], k};
    SIM_ASSERT(k <= 64 && E <= 4096);
    SIM_TRY(new_out(t, "routing/weights", 3, shape, &ss, SIM_F32, weights));
    SIM_TRY(new_out(t, "routing/indices", 3, shape, &ss, SIM_I32, indices));
    if (sa.data) {
        int64_t N = (int64_t)sa.nlocal / E;
        float *sel = malloc((size_t)E * sizeof *sel);
        /* the schedule's routing (deepseek_batchsplit.py): sigmoid scores, group-limited top-k of
         * scores + bias, weights the chosen pre-bias scores renormalised without an epsilon */
        const model_moe_route_cfg rc = {.k = k,
                                        .sigmoid = true,
                                        .scaling = ds->moe.routed_scale,
                                        .bias_selects_only = true,
                                        .groups = ds->moe.routing_groups,
                                        .topk_groups = ds->moe.topk_groups,
                                        .no_eps = true};
        for (int64_t n = 0; n < N; n++)
            model_moe_route_token((const float *)sa.data + n * E, ba.data, E, &rc, (uint64_t)n, sel,
                                  (int32_t *)(*indices)->val.data + n * k, (float *)(*weights)->val.data + n * k);
        free(sel);
    }
    if (bo) mesh_array_free(mesh_tape_ctx(t)->dev, &ba);
    mesh_entry *e = mesh_tape_record(t, route_vjp, tag, 1, &scores, 1, weights);
    if (e) {
        e->i[0] = k;
        e->f[0] = ds->moe.routed_scale;
        mesh_entry_save(e, &sa, so);
        mesh_entry_save(e, &(*indices)->val, false);
    } else if (so) {
        mesh_array_free(mesh_tape_ctx(t)->dev, &sa);
    }
    return SIM_OK;
}

/* ------------------------------------------------------------ route, compute, unroute */

/* Saved state of one microbatch's expert region. */
typedef struct {
    sim_device *dev;
    int64_t Tl, M, H, k, XL, EP, lo; /* local tokens, dims, local experts, expert shards, first local expert */
    int64_t N, cap;                  /* local assignment rows (real), static rows */
    int ax;                          /* expert mesh axis, or -1 */
    sim_dtype wire;
    int32_t *row;      /* [EP*Tl*k] row of assignment (t, j) in the sorted rows, or -1 */
    int32_t *gsz;      /* [XL] rows per local expert */
    int32_t *tok;      /* [cap] token of each sorted row, [cap] its slot j after */
    float *rw;         /* [N] router weight of each sorted row */
    bs_buf xr, h0, h1; /* sorted inputs and the two gating products (activations) */
    char tag[SIM_TAG_MAX];
} bs_moe;

static void moe_free(void *p)
{
    bs_moe *s = p;
    buf_free(s->dev, &s->xr);
    buf_free(s->dev, &s->h0);
    buf_free(s->dev, &s->h1);
    free(s->row);
    free(s->gsz);
    free(s->tok);
    free(s->rw);
    free(s);
}

static const char *stag(const bs_moe *s, const char *what, char *buf, size_t cap)
{
    snprintf(buf, cap, "%.60s/%.30s", s->tag, what);
    return buf;
}

static sim_status gather_tokens(const bs_moe *s, const void *src, void *dst, size_t count, sim_dtype dt, sim_dtype wire,
                                const char *what)
{
    char tag[SIM_TAG_MAX];
    if (s->ax < 0) {
        if (src && dst) memcpy(dst, src, count * sim_dtype_size(dt));
        return SIM_OK;
    }
    sim_meta meta = sim_meta_tag(stag(s, what, tag, sizeof tag));
    if (dt == SIM_F32) meta = sim_meta_counted(meta, wire); /* other dtypes count as they are */
    return sim_all_gather(s->dev, src, dst, count, dt, sim_axes_1(s->ax), meta);
}

static sim_status scatter_tokens(const bs_moe *s, const void *src, void *dst, size_t count, const char *what)
{
    char tag[SIM_TAG_MAX];
    if (s->ax < 0) {
        if (src && dst) memcpy(dst, src, count * sizeof(float));
        return SIM_OK;
    }
    return sim_reduce_scatter(s->dev, src, dst, count, SIM_F32, sim_axes_1(s->ax),
                              sim_meta_counted(sim_meta_tag(stag(s, what, tag, sizeof tag)), s->wire));
}

static sim_status moe_vjp(mesh_tape *t, mesh_entry *e)
{
    mesh_ctx *c = mesh_tape_ctx(t);
    bs_moe *s = e->payload;
    mesh_var *x = e->in[0], *rwv = e->in[1], *w0 = e->in[2], *w1 = e->in[3], *wo = e->in[4], *y = e->out[0];
    sim_device *dev = s->dev;
    int64_t Tl = s->Tl, M = s->M, H = s->H, k = s->k, EP = s->EP, N = s->N, cap = s->cap, XL = s->XL;
    char tag[SIM_TAG_MAX];
    SIM_TRY(cot_as(t, y, &y->val.spec, 0, stag(s, "dout", tag, sizeof tag)));
    bs_buf dall, dy, act, da, dh0, dh1, dxr, dxall, drw_all;
    SIM_TRY(buf_alloc(dev, &dall, (size_t)(EP * Tl * M) * 4, SIM_MEM_TEMP, "moe/dout_gathered", false));
    /* the transpose of the combine's reduce-scatter: an all-gather over expert */
    SIM_TRY(gather_tokens(s, y->grad.data, dall.p, (size_t)(Tl * M), SIM_F32, s->wire, "unroute_bwd_all_gather"));
    SIM_TRY(buf_alloc(dev, &dy, (size_t)(cap * M) * 4, SIM_MEM_TEMP, "moe/dy", false));
    SIM_TRY(buf_alloc(dev, &act, (size_t)(cap * H) * 4, SIM_MEM_TEMP, "moe/act", false));
    SIM_TRY(buf_alloc(dev, &da, (size_t)(cap * H) * 4, SIM_MEM_TEMP, "moe/dact", true));
    SIM_TRY(buf_alloc(dev, &dh0, (size_t)(cap * H) * 4, SIM_MEM_TEMP, "moe/dh0", true));
    SIM_TRY(buf_alloc(dev, &dh1, (size_t)(cap * H) * 4, SIM_MEM_TEMP, "moe/dh1", true));
    SIM_TRY(buf_alloc(dev, &dxr, (size_t)(cap * M) * 4, SIM_MEM_TEMP, "moe/dxr", true));
    SIM_TRY(buf_alloc(dev, &dxall, (size_t)(EP * Tl * M) * 4, SIM_MEM_TEMP, "moe/dx_gathered", true));
    SIM_TRY(buf_alloc(dev, &drw_all, (size_t)(EP * Tl * k) * 4, SIM_MEM_TEMP, "moe/dweights_gathered", true));
    /* weight gradients: per expert shard, partial over the token axes */
    const mesh_shape *m = c->mesh;
    uint32_t P = bit(axis_of(m, "data")) | bit(axis_of(m, "fsdp"));
    mesh_var *ws[3] = {w0, w1, wo};
    mesh_array dw[3];
    for (int i = 0; i < 3; i++) {
        mesh_spec sp = ws[i]->val.spec;
        sp.partial = P;
        SIM_TRY(mesh_tape_zeros(t, "moe/dw", ws[i]->val.rank, ws[i]->val.shape, &sp, SIM_MEM_TEMP, &dw[i]));
    }
    mesh_spec xs = x->val.spec, rs = rwv->val.spec;
    mesh_array dx, drw;
    SIM_TRY(mesh_tape_zeros(t, "moe/dx", x->val.rank, x->val.shape, &xs, SIM_MEM_TEMP, &dx));
    SIM_TRY(mesh_tape_zeros(t, "moe/dweights", rwv->val.rank, rwv->val.shape, &rs, SIM_MEM_TEMP, &drw));
    if (dall.p) {
        const float *dallp = dall.p, *h0 = s->h0.p, *h1 = s->h1.p;
        float *dyp = dy.p, *actp = act.p, *dap = da.p, *dxallp = dxall.p, *drwp = drw_all.p;
        for (int64_t r = 0; r < N; r++) memcpy(dyp + r * M, dallp + (int64_t)s->tok[r] * M, (size_t)M * 4);
        bk_swiglu_fwd(actp, h0, h1, (size_t)(N * H));
        float *scaled = dxr.p; /* borrowed as act * weight, then cleared */
        float *scaled_act = malloc((size_t)(N * H) * sizeof *scaled_act);
        for (int64_t r = 0; r < N; r++)
            for (int64_t h = 0; h < H; h++) scaled_act[r * H + h] = actp[r * H + h] * s->rw[r];
        (void)scaled;
        bk_grouped_gemm_bwd(dap, dw[2].data, dyp, scaled_act, wo->val.data, s->gsz, (int)XL, (int)N, (int)H, (int)M);
        free(scaled_act);
        for (int64_t r = 0; r < N; r++) {
            double g = 0;
            for (int64_t h = 0; h < H; h++) {
                g += (double)dap[r * H + h] * actp[r * H + h];
                dap[r * H + h] *= s->rw[r];
            }
            int64_t tk = s->tok[r], j = s->tok[cap + r];
            drwp[tk * k + j] = (float)g;
        }
        bk_swiglu_bwd(dh0.p, dh1.p, dap, h0, h1, (size_t)(N * H));
        bk_grouped_gemm_bwd(dxr.p, dw[0].data, dh0.p, s->xr.p, w0->val.data, s->gsz, (int)XL, (int)N, (int)M, (int)H);
        bk_grouped_gemm_bwd(dxr.p, dw[1].data, dh1.p, s->xr.p, w1->val.data, s->gsz, (int)XL, (int)N, (int)M, (int)H);
        /* un-sort: each token sums its assignments in slot order */
        const float *dxrp = dxr.p;
        for (int64_t tk = 0; tk < EP * Tl; tk++)
            for (int64_t j = 0; j < k; j++) {
                int32_t r = s->row[tk * k + j];
                if (r < 0) continue;
                for (int64_t mm = 0; mm < M; mm++) dxallp[tk * M + mm] += dxrp[(int64_t)r * M + mm];
            }
    }
    /* transposes of the dispatch all-gathers: reduce-scatters over expert */
    SIM_TRY(scatter_tokens(s, dxall.p, dx.data, (size_t)(EP * Tl * M), "route_bwd_reduce_scatter"));
    SIM_TRY(scatter_tokens(s, drw_all.p, drw.data, (size_t)(EP * Tl * k), "weights_bwd_reduce_scatter"));
    buf_free(dev, &drw_all);
    buf_free(dev, &dxall);
    buf_free(dev, &dxr);
    buf_free(dev, &dh1);
    buf_free(dev, &dh0);
    buf_free(dev, &da);
    buf_free(dev, &act);
    buf_free(dev, &dy);
    buf_free(dev, &dall);
    SIM_TRY(mesh_tape_accumulate(t, x, &dx, stag(s, "dx", tag, sizeof tag)));
    SIM_TRY(mesh_tape_accumulate(t, rwv, &drw, stag(s, "dweights", tag, sizeof tag)));
    for (int i = 0; i < 3; i++) SIM_TRY(mesh_tape_accumulate(t, ws[i], &dw[i], stag(s, "dw", tag, sizeof tag)));
    return SIM_OK;
}

/* The routed experts of one microbatch: x (B, S, M) with the activation spec, the routing
 * (B, S, k), the gathered expert weights w0/w1 (X, M, H) and wo (X, H, M), P('expert', None, None).
 * out = sum_j FFN_{idx_j}(x) with FFN_e(x) = ((silu(x w0[e]) * (x w1[e])) * weight_j) wo[e]. */
static sim_status routed_experts(model_dev *md, mesh_tape *t, mesh_var *x, mesh_var *rwv, mesh_var *idxv, mesh_var *w0,
                                 mesh_var *w1, mesh_var *wo, mesh_var **out)
{
    mesh_ctx *c = mesh_tape_ctx(t);
    const model_dims *d = &md->def->d;
    const ds_dims *ds = deepseek_dims(md->def);
    sim_device *dev = c->dev;
    bs_moe *s = calloc(1, sizeof *s);
    SIM_ASSERT(s);
    s->dev = dev;
    tagof(t, "moe", s->tag, sizeof s->tag);
    s->ax = axis_of(c->mesh, "expert");
    s->EP = s->ax >= 0 ? c->mesh->sizes[s->ax] : 1;
    s->M = d->emb;
    s->H = ds->moe.moe_mlp;
    s->k = ds->moe.top_k;
    s->XL = ds->moe.experts / s->EP;
    s->lo = (s->ax >= 0 ? sim_device_coord(dev, s->ax) : 0) * s->XL;
    s->wire = d->act_dtype;
    mesh_spec as = act_spec(c->mesh, 3);
    /* every failure (a peer device's abort included) unwinds at `fail`: what is not made yet is
     * zeroed, so freeing it is a no-op */
    mesh_array xa = {0}, ra = {0}, ia = {0};
    bool xo = false, ro = false, io = false;
    bs_buf xg = {0}, rwg = {0}, ig = {0}, gsum = {0}, yb = {0}, oall = {0};
    mesh_spec rs = act_spec(c->mesh, 3);
    sim_status st;
    SIM_TRY_GOTO(mesh_nn_operand(t, &x->val, &as, s->tag, &xa, &xo), st, fail);
    SIM_TRY_GOTO(mesh_nn_operand(t, &rwv->val, &rs, s->tag, &ra, &ro), st, fail);
    SIM_TRY_GOTO(mesh_nn_operand(t, &idxv->val, &rs, s->tag, &ia, &io), st, fail);
    int64_t Tl = (int64_t)xa.nlocal / s->M, EP = s->EP, M = s->M, H = s->H, k = s->k, XL = s->XL;
    s->Tl = Tl;
    s->cap = EP * Tl * k; /* MaxText's sorted buffer: every gathered assignment */
    int64_t cap = s->cap;
    /* route: the tokens, their routing and the group sizes over expert */
    SIM_TRY_GOTO(buf_alloc(dev, &xg, (size_t)(EP * Tl * M) * 4, SIM_MEM_TEMP, "moe/x_gathered", false), st, fail);
    SIM_TRY_GOTO(buf_alloc(dev, &rwg, (size_t)(EP * Tl * k) * 4, SIM_MEM_TEMP, "moe/weights_gathered", false), st,
                 fail);
    SIM_TRY_GOTO(
        buf_alloc_dt(dev, &ig, (size_t)(EP * Tl * k) * 4, SIM_I32, SIM_MEM_TEMP, "moe/experts_gathered", false), st,
        fail);
    SIM_TRY_GOTO(buf_alloc_dt(dev, &gsum, (size_t)ds->moe.experts * 4, SIM_I32, SIM_MEM_TEMP, "moe/group_sizes", true),
                 st, fail);
    SIM_TRY_GOTO(gather_tokens(s, ra.data, rwg.p, (size_t)(Tl * k), SIM_F32, s->wire, "route_all_gather_weights"), st,
                 fail);
    SIM_TRY_GOTO(gather_tokens(s, ia.data, ig.p, (size_t)(Tl * k), SIM_I32, SIM_I32, "route_all_gather_experts"), st,
                 fail);
    if (ia.data)
        for (int64_t i = 0; i < Tl * k; i++) ((int32_t *)gsum.p)[((int32_t *)ia.data)[i]]++;
    if (s->ax >= 0) {
        char tag[SIM_TAG_MAX];
        SIM_TRY_GOTO(sim_all_reduce(dev, gsum.p, gsum.p, (size_t)ds->moe.experts, SIM_I32, sim_axes_1(s->ax),
                                    sim_meta_tag(stag(s, "route_psum_group_sizes", tag, sizeof tag))),
                     st, fail);
    }
    SIM_TRY_GOTO(gather_tokens(s, xa.data, xg.p, (size_t)(Tl * M), SIM_F32, s->wire, "route_all_gather_tokens"), st,
                 fail);
    /* local sort by expert (model_moe_permute): rows of this shard's experts, in (expert, token, slot) order */
    SIM_TRY_GOTO(buf_alloc(dev, &s->xr, (size_t)(cap * M) * 4, SIM_MEM_ACTIVATIONS, "moe/x_sorted", false), st, fail);
    SIM_TRY_GOTO(buf_alloc(dev, &s->h0, (size_t)(cap * H) * 4, SIM_MEM_ACTIVATIONS, "moe/mlpwi_0", false), st, fail);
    SIM_TRY_GOTO(buf_alloc(dev, &s->h1, (size_t)(cap * H) * 4, SIM_MEM_ACTIVATIONS, "moe/mlpwi_1", false), st, fail);
    SIM_TRY_GOTO(buf_alloc(dev, &yb, (size_t)(cap * M) * 4, SIM_MEM_TEMP, "moe/wo_out", false), st, fail);
    SIM_TRY_GOTO(buf_alloc(dev, &oall, (size_t)(EP * Tl * M) * 4, SIM_MEM_TEMP, "moe/out_gathered", true), st, fail);
    s->gsz = calloc((size_t)XL, sizeof *s->gsz);
    if (xg.p) {
        const int32_t *ix = ig.p;
        const float *rw = rwg.p, *xgp = xg.p;
        s->row = malloc((size_t)cap * sizeof *s->row);
        s->tok = malloc((size_t)(2 * cap) * sizeof *s->tok);
        s->rw = malloc((size_t)cap * sizeof *s->rw);
        int32_t *key = malloc((size_t)cap * sizeof *key);
        int64_t *cnt = malloc((size_t)XL * sizeof *cnt);
        for (int64_t a = 0; a < cap; a++) {
            int64_t e = ix[a] - s->lo;
            key[a] = e >= 0 && e < XL ? (int32_t)e : -1;
        }
        s->N = model_moe_permute(key, cap, XL, cnt, s->row);
        for (int64_t e = 0; e < XL; e++) s->gsz[e] = (int32_t)cnt[e];
        free(key);
        free(cnt);
        for (int64_t a = 0; a < cap; a++) {
            int64_t r = s->row[a];
            if (r < 0) continue;
            s->tok[r] = (int32_t)(a / k);
            s->tok[cap + r] = (int32_t)(a % k);
            s->rw[r] = rw[a];
            memcpy((float *)s->xr.p + r * M, xgp + (a / k) * M, (size_t)M * 4);
        }
        /* compute: gating GMMs, silu * linear, router weights on the intermediate, wo GMM */
        int N = (int)s->N;
        bk_grouped_gemm_fwd(s->h0.p, s->xr.p, w0->val.data, s->gsz, (int)XL, N, (int)M, (int)H);
        bk_grouped_gemm_fwd(s->h1.p, s->xr.p, w1->val.data, s->gsz, (int)XL, N, (int)M, (int)H);
        float *act = malloc((size_t)(N * H) * sizeof *act);
        bk_swiglu_fwd(act, s->h0.p, s->h1.p, (size_t)N * (size_t)H);
        for (int64_t r = 0; r < N; r++)
            for (int64_t h = 0; h < H; h++) act[r * H + h] *= s->rw[r];
        bk_grouped_gemm_fwd(yb.p, act, wo->val.data, s->gsz, (int)XL, N, (int)H, (int)M);
        free(act);
        /* unroute: un-sort, each token summing its slots in order */
        float *o = oall.p;
        const float *yp = yb.p;
        for (int64_t tk = 0; tk < EP * Tl; tk++)
            for (int64_t j = 0; j < k; j++) {
                int32_t r = s->row[tk * k + j];
                if (r < 0) continue;
                for (int64_t mm = 0; mm < M; mm++) o[tk * M + mm] += yp[(int64_t)r * M + mm];
            }
    } else {
        s->N = Tl * k; /* a dry run: an equal share per expert shard */
    }
    buf_free(dev, &yb);
    buf_free(dev, &gsum);
    buf_free(dev, &ig);
    buf_free(dev, &rwg);
    buf_free(dev, &xg);
    SIM_TRY_GOTO(new_out(t, "moe/out", 3, xa.shape, &as, SIM_F32, out), st, fail);
    SIM_TRY_GOTO(scatter_tokens(s, oall.p, (*out)->val.data, (size_t)(EP * Tl * M), "unroute_reduce_scatter"), st,
                 fail);
    mesh_var *in[5] = {x, rwv, w0, w1, wo};
    mesh_entry *e = mesh_tape_record(t, moe_vjp, s->tag, 5, in, 1, out);
    if (e) {
        e->payload = s;
        e->free_payload = moe_free;
        s = NULL; /* the tape's now */
    }
fail:
    buf_free(dev, &oall);
    buf_free(dev, &yb);
    buf_free(dev, &gsum);
    buf_free(dev, &ig);
    buf_free(dev, &rwg);
    buf_free(dev, &xg);
    if (xo) mesh_array_free(dev, &xa);
    if (ro) mesh_array_free(dev, &ra);
    if (io) mesh_array_free(dev, &ia);
    if (s) moe_free(s);
    return st;
}

/* ------------------------------------------------------------ the layer */

static const char *const MOE_LAYERS = "params.decoder.moe_layers";

/* MLA(pre_self_attention_layer_norm(x)) of MoE layer l, the attention of one microbatch. */
static sim_status attention_block(model_dev *md, mesh_tape *t, const model_batch *b, int l, mesh_var *x, mesh_var **y)
{
    const model_def *m = md->def;
    int ln1 = model_param_at(m, MOE_LAYERS, "pre_self_attention_layer_norm.scale");
    model_mla_params p = model_mla_params_at(m, MOE_LAYERS);
    const char *saved = md->ctx.layer;
    char attn[128];
    snprintf(attn, sizeof attn, "%s/self_attention", saved ? saved : "");
    mesh_var *lnx;
    SIM_TRY(mesh_nn_rmsnorm(t, x, model_param_leaf(md, t, ln1, l), m->d.eps, "pre_self_attention_layer_norm", &lnx));
    md->ctx.layer = attn;
    SIM_TRY(model_mla(md, t, b, &deepseek_dims(m)->mla, &p, l, lnx, y));
    md->ctx.layer = saved;
    return SIM_OK;
}

static sim_status moe_block(model_dev *md, mesh_tape *t, int gl, mesh_var *h, mesh_var *const *gw, mesh_var **y)
{
    const model_def *m = md->def;
    int l = gl - (int)deepseek_dims(m)->dense_layers;
    int ln2 = model_param_index(m, "moe_layers.post_self_attention_layer_norm.scale");
    int bias = model_param_index(m, "moe_layers.DeepSeekMoeBlock_0.MoeBlock_0.gate.bias");
    mesh_var *hs, *shared, *logits, *scores, *weights, *indices, *routed, *sum;
    model_param *pn = &md->p[ln2];
    mesh_var *scale = mesh_tape_param(t, &pn->w[l], mesh_tape_recording(t) && pn->g ? &pn->g[l] : NULL);
    SIM_TRY(mesh_nn_rmsnorm(t, h, scale, m->d.eps, "post_self_attention_layer_norm", &hs));
    SIM_TRY(model_moe_shared_experts(
        md, t, model_param_at(m, MOE_LAYERS, "DeepSeekMoeBlock_0.shared_experts.wi_0.kernel"),
        model_param_at(m, MOE_LAYERS, "DeepSeekMoeBlock_0.shared_experts.wi_1.kernel"),
        model_param_at(m, MOE_LAYERS, "DeepSeekMoeBlock_0.shared_experts.wo.kernel"), l, hs, &shared));
    /* the schedule keeps every activation in its own spec (data kept at size 1) */
    SIM_TRY(mesh_ad_shard_as(t, shared, &h->val.spec, "shared_experts/out", &shared));
    SIM_TRY(mesh_ad_einsum(t, "bte,ex->btx", hs, gw[W_GATE], NULL, "gate", &logits));
    SIM_TRY(model_moe_scores(t, logits, true, "scores", &scores));
    SIM_TRY(route(md, t, scores, &md->p[bias].w[l], &weights, &indices));
    SIM_TRY(routed_experts(md, t, hs, weights, indices, gw[W_WI0], gw[W_WI1], gw[W_WO], &routed));
    SIM_TRY(mesh_ad_add(t, routed, shared, "routed_plus_shared", &sum));
    return mesh_ad_add(t, sum, h, "residual_mlp", y);
}

sim_status batchsplit_layer(model_dev *md, mesh_tape *t, const model_batch *b, int gl, mesh_var *x, mesh_var **y,
                            mesh_var **aux)
{
    const model_def *m = md->def;
    int l = gl - (int)deepseek_dims(m)->dense_layers;
    const char *saved = md->ctx.layer;
    char layer[64], mbl[2][80], tag[SIM_TAG_MAX];
    snprintf(layer, sizeof layer, "decoder/moe_layers_%d", l);
    md->ctx.layer = layer;
    *aux = NULL;
    /* the schedule's activation sharding, then the per-device split */
    mesh_spec as = act_spec(&m->mesh, 3);
    mesh_var *xs, *mb[2], *h[2], *out[2];
    SIM_TRY(mesh_ad_shard_as(t, x, &as, "batch_split/inputs", &xs));
    SIM_TRY(split(t, xs, &mb[0], &mb[1]));
    /* gather_weights: this layer's large weights over fsdp, cast first; gathered ahead by the
     * previous layer (forward: l-1, backward: l+1) unless this is the first one to run */
    if (!md->bs_prefetch) {
        md->bs_prefetch = calloc(1, sizeof *md->bs_prefetch);
        md->bs_prefetch->layer = -1;
    }
    struct batchsplit_prefetch *pf = md->bs_prefetch;
    if (pf->layer != l) prefetch_drop(md); /* none, or left over by a pass that stopped */
    mesh_var *gw[NW];
    int span = sim_span_begin(md->ctx.dev, tagof(t, "gather_weights", tag, sizeof tag));
    for (int w = 0; w < NW; w++) {
        int i = model_param_index(m, WEIGHTS[w].suffix);
        model_param *p = &md->p[i];
        mesh_var *leaf = mesh_tape_param(t, &p->w[l], mesh_tape_recording(t) && p->g ? &p->g[l] : NULL);
        mesh_array g;
        if (pf->layer == l) g = pf->w[w];
        else SIM_TRY(gather_now(md, l, w, &g));
        memset(&pf->w[w], 0, sizeof pf->w[w]);
        SIM_TRY(use_gathered(md, t, leaf, &g, &WEIGHTS[w], &gw[w]));
        md->wover[i] = gw[w];
    }
    pf->layer = -1;
    /* the next layer's, ahead: l+1 in the forward pass, l-1 in backward (its recomputation runs now) */
    int next = mesh_tape_recording(t) ? l - 1 : l + 1, n_moe = (int)(m->d.layers - deepseek_dims(m)->dense_layers);
    if (next >= 0 && next < n_moe) {
        for (int w = 0; w < NW; w++) SIM_TRY(gather_now(md, next, w, &pf->w[w]));
        pf->layer = next;
    }
    sim_span_end(md->ctx.dev, span);
    model_batch mbb[2];
    memset(mbb, 0, sizeof mbb);
    sim_status st = SIM_OK;
    for (int i = 0; i < 2 && st == SIM_OK; i++) st = split_positions(md, t, &b->positions, i, &mbb[i].positions);
    /* attention for mb0 then mb1, then the MoE for mb0 then mb1 */
    for (int i = 0; i < 2 && st == SIM_OK; i++) {
        snprintf(mbl[i], sizeof mbl[i], "%s/mb%d", layer, i);
        md->ctx.layer = mbl[i];
        span = sim_span_begin_mb(md->ctx.dev, tagof(t, "attention", tag, sizeof tag), i);
        mesh_var *a = NULL;
        st = attention_block(md, t, &mbb[i], l, mb[i], &a);
        if (st == SIM_OK) st = mesh_ad_shard_as(t, a, &mb[i]->val.spec, "mla_out", &a);
        if (st == SIM_OK) st = mesh_ad_add(t, mb[i], a, "residual_attention", &h[i]);
        sim_span_end(md->ctx.dev, span);
    }
    for (int i = 0; i < 2 && st == SIM_OK; i++) {
        md->ctx.layer = mbl[i];
        span = sim_span_begin_mb(md->ctx.dev, tagof(t, "moe", tag, sizeof tag), i);
        st = moe_block(md, t, gl, h[i], gw, &out[i]);
        sim_span_end(md->ctx.dev, span);
    }
    for (int w = 0; w < NW; w++) md->wover[model_param_index(m, WEIGHTS[w].suffix)] = NULL;
    md->ctx.layer = layer;
    if (st == SIM_OK) st = merge(t, out[0], out[1], y);
    md->ctx.layer = saved;
    return st;
}
