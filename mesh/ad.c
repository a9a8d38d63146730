/* ad.c — einsum, add, the constraint primitives and the layout ops on the tape (see ad.h). */
#include "mesh/ad.h"

#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "mesh/nn.h"
#include "mesh/ops.h"
#include "mesh/reshard.h"

/* ------------------------------------------------------------ einsum */

/* "ab,bc->ac" -> the three index strings. */
static sim_status split_sub(const char *sub, char *l, char *r, char *o)
{
    const char *comma = strchr(sub, ','), *arrow = strstr(sub, "->");
    if (!comma || !arrow || arrow < comma || comma - sub > 15 || arrow - comma - 1 > 15 || strlen(arrow + 2) > 15)
        return sim_err(SIM_ERR_INTERNAL, "einsum '%s': expected 'lhs,rhs->out'", sub);
    sim_str_put(l, 16, 0, sub, (size_t)(comma - sub));
    sim_str_put(r, 16, 0, comma + 1, (size_t)(arrow - comma - 1));
    sim_str_put(o, 16, 0, arrow + 2, SIZE_MAX);
    return SIM_OK;
}

/* "x,y->z" */
static void join_sub(char *sub, size_t cap, const char *x, const char *y, const char *z)
{
    size_t n = sim_str_put(sub, cap, 0, x, SIZE_MAX);
    n = sim_str_put(sub, cap, n, ",", 1);
    n = sim_str_put(sub, cap, n, y, SIZE_MAX);
    n = sim_str_put(sub, cap, n, "->", 2);
    sim_str_put(sub, cap, n, z, SIZE_MAX);
}

/* Contributions added into a cotangent sum by sgemm (mesh_einsum_into), over every device and
 * run; and whether that is allowed (tests turn it off to compare with the separate add). */
static atomic_llong fused_count;
static atomic_bool fuse_off;

void mesh_ad_set_fuse(bool on) { atomic_store(&fuse_off, !on); }
long long mesh_ad_fused_count(void) { return atomic_load(&fused_count); }

/* mesh_einsum with the tape's reshard cache installed on the context; with acc, mesh_einsum_into
 * (no out_sharding then), *fused telling whether the product went into acc. */
static sim_status einsum_cached(mesh_tape *t, const char *sub, const mesh_array *a, const mesh_array *b,
                                const mesh_spec *out_sharding, const char *name, sim_mem_cat cat, mesh_array *out,
                                mesh_array *acc, bool *fused)
{
    mesh_ctx *c = mesh_tape_ctx(t);
    struct mesh_reshard_cache *saved = c->cache;
    bool saved_single = c->single_use;
    c->cache = mesh_tape_cache(t);
    c->single_use = mesh_tape_single_use(t); /* whether a weight's gather serves this product alone */
    char tag[SIM_TAG_MAX];
    int span = sim_span_begin(c->dev, mesh_tape_tag(t, name, tag, sizeof tag)); /* a compute span in the trace */
    sim_status st = acc ? mesh_einsum_into(c, sub, a, b, acc, name, cat, out, fused)
                        : mesh_einsum(c, sub, a, b, out_sharding, name, cat, out, NULL);
    sim_span_end(c->dev, span);
    c->cache = saved;
    c->single_use = saved_single;
    return st;
}

/* One contribution of an einsum VJP to v's cotangent: added by sgemm into the sum v already holds
 * when mesh_einsum_into can (the normed x feeding q, k and v, or wi_0 and wi_1), else made on its
 * own and accumulated.  The arena counts the contribution either way (a ghost when fused): the
 * compiled program may well fuse the add into the dot too, but the memory figures then stay those
 * the seeds, the tests and the README were measured with, and a dry run, which has no data to
 * add, counts exactly what a real run counts without having to follow the choice. */
static sim_status contribute(mesh_tape *t, mesh_var *v, const char *sub, const mesh_array *x, const mesh_array *y,
                             const char *name)
{
    char tag[SIM_TAG_MAX];
    mesh_array g, *acc = atomic_load(&fuse_off) ? NULL : mesh_tape_grad_sum(v);
    bool fused = false;
    SIM_TRY(einsum_cached(t, sub, x, y, NULL, name, SIM_MEM_TEMP, &g, acc, &fused));
    if (!fused) {
        /* a weight's gradient made by this product: its reduce-scatter is the product's own, which the
         * compiler may window (sim_machine_opts.windowed_min_group) */
        mesh_ctx *c = mesh_tape_ctx(t);
        bool saved = c->single_use;
        c->single_use = v->sink != NULL;
        sim_status st = mesh_tape_accumulate(t, v, &g, mesh_tape_tag(t, name, tag, sizeof tag));
        c->single_use = saved;
        return st;
    }
    atomic_fetch_add(&fused_count, 1);
    mesh_tape_accumulated(t, v, &g);
    return SIM_OK;
}

static sim_status einsum_vjp(mesh_tape *t, mesh_entry *e)
{
    mesh_ctx *c = mesh_tape_ctx(t);
    mesh_var *a = e->in[0], *b = e->in[1], *y = e->out[0];
    char l[16], r[16], o[16], sub[64];
    SIM_TRY(split_sub(e->sub, l, r, o));
    for (const char *p = l; *p; p++)
        if (!strchr(o, *p) && !strchr(r, *p))
            return sim_err(SIM_ERR_INTERNAL, "einsum '%s': no VJP for an index summed in one operand only", e->sub);
    for (const char *p = r; *p; p++)
        if (!strchr(o, *p) && !strchr(l, *p))
            return sim_err(SIM_ERR_INTERNAL, "einsum '%s': no VJP for an index summed in one operand only", e->sub);
    const char *layer = c->layer;
    bool regather = c->regather;
    c->layer = e->tag;
    c->regather = e->regather; /* the weight operand read below is gathered anew (mesh_tape_mark_regather) */
    sim_status st = SIM_OK;
    if (a->needs_grad) {
        join_sub(sub, sizeof sub, o, r, l);
        st = contribute(t, a, sub, &y->grad, &b->val, "bwd_lhs");
    }
    if (st == SIM_OK && b->needs_grad) {
        join_sub(sub, sizeof sub, l, o, r);
        /* where the product's output was reduced over other axes (partial: tensor), XLA:TPU gathers
         * the output's cotangent inside the weight's gradient product, and weighs that gather
         * against the gradient's windowed reduce-scatter (sim_collective_windowed) */
        c->product_other_bytes = y->val.spec.partial ? y->grad.nlocal * sim_dtype_size(y->grad.counted) : 0;
        st = contribute(t, b, sub, &a->val, &y->grad, "bwd_rhs");
        c->product_other_bytes = 0;
    }
    c->layer = layer;
    c->regather = regather;
    return st;
}

sim_status mesh_ad_einsum(mesh_tape *t, const char *sub, mesh_var *a, mesh_var *b, const mesh_spec *out_sharding,
                          const char *name, mesh_var **out)
{
    mesh_var *y = mesh_tape_var(t);
    SIM_TRY(einsum_cached(t, sub, &a->val, &b->val, out_sharding, name, SIM_MEM_ACTIVATIONS, &y->val, NULL, NULL));
    char tag[SIM_TAG_MAX];
    mesh_var *in[2] = {a, b};
    mesh_entry *e = mesh_tape_record(t, einsum_vjp, mesh_tape_tag(t, name, tag, sizeof tag), 2, in, 1, &y);
    if (e) sim_str_put(e->sub, sizeof e->sub, 0, sub, SIZE_MAX);
    *out = y;
    return SIM_OK;
}

/* ------------------------------------------------------------ add */

static sim_status add_vjp(mesh_tape *t, mesh_entry *e)
{
    mesh_ctx *c = mesh_tape_ctx(t);
    mesh_var *a = e->in[0], *b = e->in[1], *y = e->out[0];
    mesh_array da;
    if (a->needs_grad) {
        SIM_TRY(mesh_array_clone(c->dev, c->mesh, &y->grad, y->grad.name, SIM_MEM_TEMP, &da));
        SIM_TRY(mesh_tape_accumulate(t, a, &da, e->tag));
    }
    mesh_array db = y->grad;
    y->has_grad = false; /* moved */
    return mesh_tape_accumulate(t, b, &db, e->tag);
}

sim_status mesh_ad_add(mesh_tape *t, mesh_var *a, mesh_var *b, const char *name, mesh_var **out)
{
    mesh_var *y = mesh_tape_var(t);
    SIM_TRY(mesh_add(mesh_tape_ctx(t), &a->val, &b->val, name, &y->val));
    char tag[SIM_TAG_MAX];
    mesh_var *in[2] = {a, b};
    mesh_tape_tag(t, name, tag, sizeof tag);
    /* memory-bound for the step-time model: a and b read, y written (the VJP passes the cotangent on) */
    sim_device_add_cost(mesh_tape_ctx(t)->dev, 0.0,
                        (double)a->val.nlocal + (double)b->val.nlocal + (double)y->val.nlocal, 0.0, tag);
    mesh_tape_record(t, add_vjp, tag, 2, in, 1, &y);
    *out = y;
    return SIM_OK;
}

/* ------------------------------------------------------------ constraints */

/* The cotangent goes back to the input unchanged (accumulate reshards it). */
static sim_status identity_vjp(mesh_tape *t, mesh_entry *e)
{
    mesh_var *x = e->in[0], *y = e->out[0];
    mesh_array g = y->grad;
    y->has_grad = false;
    return mesh_tape_accumulate(t, x, &g, e->tag);
}

typedef sim_status (*inplace_fn)(mesh_ctx *, mesh_array *, const mesh_spec *, const char *);

static sim_status resharded(mesh_tape *t, mesh_var *x, const mesh_spec *spec, const char *name, inplace_fn fn,
                            mesh_var **out)
{
    mesh_ctx *c = mesh_tape_ctx(t);
    mesh_spec want;
    SIM_TRY(mesh_spec_fit_rank(spec, x->val.rank, name, &want));
    if (mesh_spec_equal(&x->val.spec, &want)) {
        *out = x;
        return SIM_OK;
    }
    mesh_var *y = mesh_tape_var(t);
    if (c->dead_outputs) /* nothing reads it: the layout without the collective (the VJP still runs) */
        SIM_TRY(mesh_array_new_as(c->dev, c->mesh, x->val.name, x->val.rank, x->val.shape, &want, x->val.dtype,
                                  x->val.counted, SIM_MEM_ACTIVATIONS, true, &y->val));
    else {
        /* counted as a clone, resharded from x's shard where it lies: the reshard writes a new buffer
         * anyway (mesh_plan_run copies first only where its first step works in place) */
        SIM_TRY(mesh_array_borrow(c->dev, c->mesh, &x->val, x->val.name, SIM_MEM_ACTIVATIONS, &y->val));
        SIM_TRY(fn(c, &y->val, &want, name));
    }
    char tag[SIM_TAG_MAX];
    mesh_tape_record(t, identity_vjp, mesh_tape_tag(t, name, tag, sizeof tag), 1, &x, 1, &y);
    *out = y;
    return SIM_OK;
}

sim_status mesh_ad_shard_as(mesh_tape *t, mesh_var *x, const mesh_spec *spec, const char *name, mesh_var **out)
{
    return resharded(t, x, spec, name, mesh_shard_as, out);
}

sim_status mesh_ad_constraint(mesh_tape *t, mesh_var *x, const mesh_spec *spec, const char *name, mesh_var **out)
{
    mesh_ctx *c = mesh_tape_ctx(t);
    if (c->mode == MESH_MODE_EXPLICIT) { /* an assert: nothing moves */
        SIM_TRY(mesh_with_sharding_constraint(c, &x->val, spec, name));
        *out = x;
        return SIM_OK;
    }
    return resharded(t, x, spec, name, mesh_with_sharding_constraint, out);
}

/* ------------------------------------------------------------ a split counted, not made */

/* A transient array of like's shape in `from` (zeros: no value is read), resharded to `to`: the
 * collective that reshard makes is counted and its result dropped. */
static sim_status counted_reshard(mesh_tape *t, const mesh_array *like, const mesh_spec *from, const mesh_spec *to,
                                  const char *tag)
{
    mesh_ctx *c = mesh_tape_ctx(t);
    mesh_array a;
    SIM_TRY(mesh_array_new_as(c->dev, c->mesh, like->name, like->rank, like->shape, from, SIM_F32, like->counted,
                              SIM_MEM_TEMP, true, &a));
    sim_status st = mesh_reshard(c->dev, c->mesh, &a, to, sim_meta_implicit(tag)); /* the compiler's */
    mesh_array_free(c->dev, &a);
    return st;
}

static sim_status counted_split_vjp(mesh_tape *t, mesh_entry *e)
{
    mesh_var *x = e->in[0], *y = e->out[0];
    const mesh_spec *split = &e->saved[0].spec;
    /* the cotangent onto the split (a reduce-scatter where it is partial over the split's axes) */
    mesh_spec to = *split;
    to.partial = y->grad.spec.partial & ~(uint32_t)e->i[0];
    SIM_TRY(counted_reshard(t, &x->val, &y->grad.spec, &to, e->tag));
    if (e->i[1]) SIM_TRY(counted_reshard(t, &x->val, split, &x->val.spec, e->tag)); /* read again */
    mesh_array g = y->grad;
    y->has_grad = false;
    return mesh_tape_accumulate(t, x, &g, e->tag);
}

sim_status mesh_ad_counted_split_last(mesh_tape *t, mesh_var *x, const mesh_spec *along, bool gather, bool regather,
                                      const char *name, mesh_var **out)
{
    mesh_ctx *c = mesh_tape_ctx(t);
    *out = x;
    const mesh_array *a = &x->val;
    int r = a->rank;
    mesh_spec split = a->spec;
    split.partial = 0;
    uint32_t used = mesh_spec_dim_axes(&a->spec), added = 0;
    int64_t k = 1;
    for (int i = 0; along->rank >= 1 && i < along->n_axes[0]; i++) {
        int ax = along->axes[0][i];
        if ((used >> ax) & 1 || c->mesh->sizes[ax] <= 1) continue;
        if (split.n_axes[r - 1] >= MESH_MAX_AXES) break;
        split.axes[r - 1][split.n_axes[r - 1]++] = (int8_t)ax;
        added |= 1u << ax;
        k *= c->mesh->sizes[ax];
    }
    if (k <= 1 || a->local[r - 1] % k != 0) return SIM_OK;
    char tag[SIM_TAG_MAX];
    mesh_tape_tag(t, name, tag, sizeof tag);
    if (gather) SIM_TRY(counted_reshard(t, a, &split, &a->spec, tag));
    if (!mesh_tape_recording(t) || !x->needs_grad) return SIM_OK; /* no backward: x itself goes on */
    /* the output shares x's value (not owned by the tape: nothing is copied or freed twice) */
    mesh_var *y = mesh_tape_input(t, a, false);
    mesh_entry *e = mesh_tape_record(t, counted_split_vjp, tag, 1, &x, 1, &y);
    SIM_ASSERT(e);
    mesh_array shape_only = *a; /* the split, for the VJP: shape and spec only */
    shape_only.spec = split;
    mesh_entry_save(e, &shape_only, false);
    e->i[0] = (int64_t)added;
    e->i[1] = regather;
    *out = y;
    return SIM_OK;
}

/* ------------------------------------------------------------ layout ops */

static sim_status new_var(mesh_tape *t, const char *name, int rank, const int64_t *shape, const mesh_spec *spec,
                          mesh_var **out)
{
    mesh_ctx *c = mesh_tape_ctx(t);
    *out = mesh_tape_var(t);
    return mesh_array_new(c->dev, c->mesh, name, rank, shape, spec, SIM_F32, SIM_MEM_ACTIVATIONS, &(*out)->val);
}

/* Copies columns: dst (rows, dw) [.., doff .. doff+n) <- src (rows, sw) [.., soff ..). */
static void copy_cols(float *dst, int64_t dw, int64_t doff, const float *src, int64_t sw, int64_t soff, int64_t n,
                      int64_t rows)
{
    if (!dst || !src) return;
    for (int64_t r = 0; r < rows; r++) memcpy(dst + r * dw + doff, src + r * sw + soff, (size_t)n * sizeof(float));
}

/* A layout op's VJP cost (step-time model), tagged as its forward op with "/bwd". */
static void layout_cost_bwd(mesh_tape *t, const mesh_entry *e, double elements)
{
    char tag[SIM_TAG_MAX];
    sim_str_put(tag, sizeof tag, sim_str_put(tag, sizeof tag, 0, e->tag, SIZE_MAX), "/bwd", 4);
    sim_device_add_cost_layout(mesh_tape_ctx(t)->dev, elements, tag);
}

static sim_status split_vjp(mesh_tape *t, mesh_entry *e)
{
    mesh_ctx *c = mesh_tape_ctx(t);
    mesh_var *x = e->in[0], *y1 = e->out[0], *y2 = e->out[1];
    const mesh_array *xa = &e->saved[0];
    uint32_t P = (y1->has_grad ? y1->grad.spec.partial : 0) | (y2->has_grad ? y2->grad.spec.partial : 0);
    char tag[SIM_TAG_MAX];
    mesh_tape_tag(t, "split/dx", tag, sizeof tag);
    mesh_spec ds = xa->spec;
    ds.partial = P;
    mesh_array dx;
    SIM_TRY(mesh_tape_zeros(t, "split/dx", xa->rank, xa->shape, &ds, SIM_MEM_TEMP, &dx));
    int64_t W = xa->local[xa->rank - 1], rows = (int64_t)xa->nlocal / W, D1 = e->i[0];
    mesh_var *ys[2] = {y1, y2};
    for (int i = 0; i < 2; i++) {
        if (!ys[i]->has_grad) continue;
        mesh_spec want = ys[i]->val.spec;
        want.partial = P; /* widening to more partial axes is free */
        if (!mesh_spec_equal(&ys[i]->grad.spec, &want))
            SIM_TRY(mesh_reshard(c->dev, c->mesh, &ys[i]->grad, &want, sim_meta_tag(tag)));
        int64_t n = i ? W - D1 : D1;
        copy_cols(dx.data, W, i ? D1 : 0, ys[i]->grad.data, n, 0, n, rows);
    }
    layout_cost_bwd(t, e, 2.0 * (double)xa->nlocal); /* the two cotangents read, dx written */
    return mesh_tape_accumulate(t, x, &dx, tag);
}

sim_status mesh_ad_split_last(mesh_tape *t, mesh_var *x, int64_t d1, bool expand, const char *name, mesh_var **y1,
                              mesh_var **y2)
{
    char tag[SIM_TAG_MAX];
    mesh_tape_tag(t, name, tag, sizeof tag);
    mesh_spec s = x->val.spec;
    s.partial = 0;
    s.n_axes[s.rank - 1] = 0;
    mesh_array xa;
    bool xo;
    SIM_TRY(mesh_nn_operand(t, &x->val, &s, tag, &xa, &xo));
    int r = xa.rank;
    int64_t W = xa.shape[r - 1], shape[MESH_SPEC_MAX_RANK];
    memcpy(shape, xa.shape, sizeof shape);
    shape[r - 1] = d1;
    SIM_TRY(new_var(t, name, r, shape, &s, y1));
    mesh_spec s2 = s;
    int r2 = r;
    shape[r - 1] = W - d1;
    if (expand) {
        shape[r] = W - d1;
        shape[r - 1] = 1;
        r2 = r + 1;
        mesh_spec_init(&s2, r2);
        for (int d = 0; d < r - 1; d++) {
            s2.n_axes[d] = s.n_axes[d];
            memcpy(s2.axes[d], s.axes[d], sizeof s2.axes[d]);
        }
    }
    SIM_TRY(new_var(t, name, r2, shape, &s2, y2));
    int64_t rows = xa.data ? (int64_t)xa.nlocal / W : 0;
    copy_cols((*y1)->val.data, d1, 0, xa.data, W, 0, d1, rows);
    copy_cols((*y2)->val.data, W - d1, 0, xa.data, W, d1, W - d1, rows);
    /* XLA:TPU materialises MLA's splits (slices changing the tiling): x read, both parts written */
    sim_device_add_cost_layout(mesh_tape_ctx(t)->dev, 2.0 * (double)xa.nlocal, tag);
    mesh_var *outs[2] = {*y1, *y2};
    mesh_entry *e = mesh_tape_record(t, split_vjp, tag, 1, &x, 2, outs);
    if (e) {
        e->i[0] = d1;
        mesh_entry_save(e, &xa, xo);
    } else if (xo) {
        mesh_array_free(mesh_tape_ctx(t)->dev, &xa);
    }
    return SIM_OK;
}

static sim_status concat_vjp(mesh_tape *t, mesh_entry *e)
{
    mesh_var *a = e->in[0], *b = e->in[1], *y = e->out[0];
    mesh_array *dy = &y->grad;
    int r = dy->rank;
    int64_t W = dy->local[r - 1], rows = (int64_t)dy->nlocal / W, D1 = e->i[0];
    char tag[SIM_TAG_MAX];
    mesh_tape_tag(t, "concat/d", tag, sizeof tag);
    int64_t shape[MESH_SPEC_MAX_RANK];
    memcpy(shape, dy->shape, sizeof shape);
    mesh_array da, db;
    shape[r - 1] = D1;
    SIM_TRY(mesh_tape_zeros(t, "concat/da", r, shape, &dy->spec, SIM_MEM_TEMP, &da));
    shape[r - 1] = W - D1;
    SIM_TRY(mesh_tape_zeros(t, "concat/db", r, shape, &dy->spec, SIM_MEM_TEMP, &db));
    copy_cols(da.data, D1, 0, dy->data, W, 0, D1, dy->data ? rows : 0);
    copy_cols(db.data, W - D1, 0, dy->data, W, D1, W - D1, dy->data ? rows : 0);
    layout_cost_bwd(t, e, 2.0 * (double)dy->nlocal); /* dy read, its two parts written */
    SIM_TRY(mesh_tape_accumulate(t, a, &da, tag));
    return mesh_tape_accumulate(t, b, &db, tag);
}

sim_status mesh_ad_concat_last(mesh_tape *t, mesh_var *a, mesh_var *b, const char *name, mesh_var **y)
{
    char tag[SIM_TAG_MAX];
    mesh_tape_tag(t, name, tag, sizeof tag);
    mesh_spec s = a->val.spec;
    s.partial = 0;
    s.n_axes[s.rank - 1] = 0;
    mesh_array aa, ba;
    bool ao, bo;
    SIM_TRY(mesh_nn_operand(t, &a->val, &s, tag, &aa, &ao));
    SIM_TRY(mesh_nn_operand(t, &b->val, &s, tag, &ba, &bo));
    int r = aa.rank;
    int64_t D1 = aa.shape[r - 1], D2 = ba.shape[r - 1], shape[MESH_SPEC_MAX_RANK];
    memcpy(shape, aa.shape, sizeof shape);
    shape[r - 1] = D1 + D2;
    SIM_TRY(new_var(t, name, r, shape, &s, y));
    int64_t rows = aa.data ? (int64_t)aa.nlocal / D1 : 0;
    copy_cols((*y)->val.data, D1 + D2, 0, aa.data, D1, 0, D1, rows);
    copy_cols((*y)->val.data, D1 + D2, D1, ba.data, D2, 0, D2, rows);
    mesh_ctx *c = mesh_tape_ctx(t);
    if (ao) mesh_array_free(c->dev, &aa);
    if (bo) mesh_array_free(c->dev, &ba);
    /* both parts read, y written */
    sim_device_add_cost_layout(mesh_tape_ctx(t)->dev, 2.0 * (double)(*y)->val.nlocal, tag);
    mesh_var *in[2] = {a, b};
    mesh_entry *e = mesh_tape_record(t, concat_vjp, tag, 2, in, 1, y);
    if (e) e->i[0] = D1;
    return SIM_OK;
}

static sim_status bcast_vjp(mesh_tape *t, mesh_entry *e)
{
    mesh_var *x = e->in[0], *y = e->out[0];
    mesh_array *dy = &y->grad;
    char tag[SIM_TAG_MAX];
    mesh_tape_tag(t, "broadcast_heads/dx", tag, sizeof tag);
    /* the sum over the local heads is partial over the axes that split the heads */
    mesh_spec ds;
    mesh_spec_init(&ds, 4);
    for (int d = 0; d < 2; d++) {
        ds.n_axes[d] = dy->spec.n_axes[d];
        memcpy(ds.axes[d], dy->spec.axes[d], sizeof ds.axes[d]);
    }
    ds.partial = dy->spec.partial;
    for (int i = 0; i < dy->spec.n_axes[2]; i++) ds.partial |= 1u << dy->spec.axes[2][i];
    int64_t shape[4] = {dy->shape[0], dy->shape[1], 1, dy->shape[3]};
    mesh_array dx;
    SIM_TRY(mesh_tape_zeros(t, "broadcast_heads/dx", 4, shape, &ds, SIM_MEM_TEMP, &dx));
    if (dy->data) {
        int64_t rows = dy->local[0] * dy->local[1], Hl = dy->local[2], R = dy->local[3];
        const float *g = dy->data;
        float *o = dx.data;
        for (int64_t n = 0; n < rows; n++)
            for (int64_t h = 0; h < Hl; h++)
                for (int64_t j = 0; j < R; j++) o[n * R + j] += g[(n * Hl + h) * R + j];
    }
    layout_cost_bwd(t, e, (double)dy->nlocal + (double)dx.nlocal); /* dy read, its head sum written */
    return mesh_tape_accumulate(t, x, &dx, tag);
}

sim_status mesh_ad_broadcast_heads(mesh_tape *t, mesh_var *x, int64_t H, const mesh_spec *spec, const char *name,
                                   mesh_var **y)
{
    char tag[SIM_TAG_MAX];
    mesh_tape_tag(t, name, tag, sizeof tag);
    mesh_spec xs;
    mesh_spec_init(&xs, 4);
    for (int d = 0; d < 2; d++) {
        xs.n_axes[d] = spec->n_axes[d];
        memcpy(xs.axes[d], spec->axes[d], sizeof xs.axes[d]);
    }
    mesh_spec ys = xs;
    ys.n_axes[2] = spec->n_axes[2];
    memcpy(ys.axes[2], spec->axes[2], sizeof ys.axes[2]);
    mesh_array xa;
    bool xo;
    SIM_TRY(mesh_nn_operand(t, &x->val, &xs, tag, &xa, &xo));
    int64_t shape[4] = {xa.shape[0], xa.shape[1], H, xa.shape[3]};
    SIM_TRY(new_var(t, name, 4, shape, &ys, y));
    if (xa.data) {
        mesh_array *ya = &(*y)->val;
        int64_t rows = ya->local[0] * ya->local[1], Hl = ya->local[2], R = ya->local[3];
        const float *src = xa.data;
        float *o = ya->data;
        for (int64_t n = 0; n < rows; n++)
            for (int64_t h = 0; h < Hl; h++) memcpy(o + (n * Hl + h) * R, src + n * R, (size_t)R * sizeof(float));
    }
    if (xo) mesh_array_free(mesh_tape_ctx(t)->dev, &xa);
    /* x read, y written */
    sim_device_add_cost_layout(mesh_tape_ctx(t)->dev, (double)xa.nlocal + (double)(*y)->val.nlocal, tag);
    mesh_tape_record(t, bcast_vjp, tag, 1, &x, 1, y);
    return SIM_OK;
}

sim_status mesh_ad_roll_tokens(mesh_tape *t, const mesh_array *src, int64_t k, const char *name, const mesh_array **out)
{
    mesh_ctx *c = mesh_tape_ctx(t);
    if (src->rank != 2 || src->spec.n_axes[1])
        return sim_err(SIM_ERR_INTERNAL, "%s: rolling tokens needs a (B, T) array with a whole sequence", name);
    mesh_var *v = mesh_tape_var(t);
    SIM_TRY(mesh_array_new(c->dev, c->mesh, name, 2, src->shape, &src->spec, SIM_I32, SIM_MEM_ACTIVATIONS, &v->val));
    if (src->data) {
        const int32_t *in = src->data;
        int32_t *o = v->val.data;
        int64_t rows = src->local[0], T = src->local[1];
        for (int64_t r = 0; r < rows; r++)
            for (int64_t i = 0; i < T; i++) o[r * T + i] = i + k < T ? in[r * T + i + k] : 0;
    }
    *out = &v->val;
    return SIM_OK;
}

static sim_status masked_sum_vjp(mesh_tape *t, mesh_entry *e)
{
    mesh_var *x = e->in[0], *y = e->out[0];
    mesh_array *dy = &y->grad, dx;
    mesh_spec s = x->val.spec;
    s.partial = dy->spec.partial & ~mesh_spec_dim_axes(&s);
    char name[SIM_TAG_MAX]; /* "<op name>/dx" */
    sim_str_put(name, sizeof name, sim_str_put(name, sizeof name, 0, e->payload, SIZE_MAX), "/dx", 3);
    SIM_TRY(mesh_tape_zeros(t, name, 2, x->val.shape, &s, SIM_MEM_TEMP, &dx));
    if (dx.data) {
        mesh_dim_shard sh[2];
        mesh_spec_shard(&x->val.spec, mesh_tape_ctx(t)->mesh, x->val.shape, sim_device_id(mesh_tape_ctx(t)->dev), sh);
        float g = (float)(((const float *)dy->data)[0] * e->f[0]);
        int64_t rows = dx.local[0], T = dx.local[1], valid = x->val.shape[1] - e->i[0];
        float *o = dx.data;
        for (int64_t r = 0; r < rows; r++)
            for (int64_t i = 0; i < T; i++) o[r * T + i] = sh[1].offset + i < valid ? g : 0.0f;
    }
    char tag[SIM_TAG_MAX];
    return mesh_tape_accumulate(t, x, &dx, mesh_tape_tag(t, name, tag, sizeof tag));
}

sim_status mesh_ad_masked_sum(mesh_tape *t, mesh_var *x, int64_t k, double scale, const char *name, mesh_var **out)
{
    mesh_ctx *c = mesh_tape_ctx(t);
    char tag[SIM_TAG_MAX];
    mesh_tape_tag(t, name, tag, sizeof tag);
    mesh_spec s;
    mesh_spec_init(&s, 0);
    s.partial = mesh_spec_dim_axes(&x->val.spec) | x->val.spec.partial; /* one addend per block */
    *out = mesh_tape_var(t);
    SIM_TRY(mesh_array_new(c->dev, c->mesh, name, 0, NULL, &s, SIM_F32, SIM_MEM_ACTIVATIONS, &(*out)->val));
    if (x->val.data) {
        mesh_dim_shard sh[2];
        mesh_spec_shard(&x->val.spec, c->mesh, x->val.shape, sim_device_id(c->dev), sh);
        int64_t rows = x->val.local[0], T = x->val.local[1], valid = x->val.shape[1] - k;
        const float *v = x->val.data;
        double acc = 0;
        for (int64_t r = 0; r < rows; r++)
            for (int64_t i = 0; i < T; i++)
                if (sh[1].offset + i < valid) acc += v[r * T + i];
        ((float *)(*out)->val.data)[0] = (float)(acc * scale);
    }
    mesh_spec full;
    mesh_spec_init(&full, 0);
    SIM_TRY(mesh_reshard(c->dev, c->mesh, &(*out)->val, &full, sim_meta_tag(tag)));
    mesh_entry *e = mesh_tape_record(t, masked_sum_vjp, tag, 1, &x, 1, out);
    if (e) {
        e->i[0] = k;
        e->f[0] = scale;
        e->payload = strdup(name); /* the VJP names its cotangent after the op */
        SIM_ASSERT(e->payload);
        e->free_payload = free;
    }
    return SIM_OK;
}
