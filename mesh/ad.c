/* ad.c — einsum, add and the constraint primitives on the tape (see ad.h). */
#include "mesh/ad.h"

#include <stdatomic.h>
#include <stdio.h>
#include <string.h>

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
    c->layer = e->tag;
    sim_status st = SIM_OK;
    if (a->needs_grad) {
        join_sub(sub, sizeof sub, o, r, l);
        st = contribute(t, a, sub, &y->grad, &b->val, "bwd_lhs");
    }
    if (st == SIM_OK && b->needs_grad) {
        join_sub(sub, sizeof sub, l, o, r);
        st = contribute(t, b, sub, &a->val, &y->grad, "bwd_rhs");
    }
    c->layer = layer;
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
    sim_device_add_cost(mesh_tape_ctx(t)->dev, 0.0, (double)a->val.nlocal + (double)b->val.nlocal +
                        (double)y->val.nlocal, 0.0, tag);
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
        SIM_TRY(mesh_array_clone(c->dev, c->mesh, &x->val, x->val.name, SIM_MEM_ACTIVATIONS, &y->val));
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
