/* nn.c — fused neural-network ops with sharding rules and VJPs (see nn.h).
 *
 * Conventions: `operand` copies an input into the sharding the kernel needs
 * (never touching the tape's value); every op saves what its VJP needs with
 * mesh_entry_save; cotangents arrive in the output's dims plus partial axes
 * P, and since every VJP here is linear in the cotangent, the input
 * cotangents simply carry P too (plus the axes the math adds). */
#include "mesh/nn.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "blas_kernels/bk.h"
#include "blas_kernels/bk_activation.h"
#include "blas_kernels/bk_parallel.h"
#include "blas_kernels/bk_attention.h"
#include "blas_kernels/bk_dropout.h"
#include "blas_kernels/bk_embedding.h"
#include "blas_kernels/bk_softcap.h"
#include "blas_kernels/bk_xent.h"
#include "config/release.h"
#include "mesh/ops.h"
#include "mesh/replay.h"
#include "mesh/reshard.h"

/* ------------------------------------------------------------ helpers */

void mesh_nn_cost_memory(mesh_tape *t, double elements, const char *tag)
{
    sim_device_add_cost(mesh_tape_ctx(t)->dev, 0.0, elements, 0.0, tag);
}

void mesh_nn_cost_memory_bwd(mesh_tape *t, const mesh_entry *e, double elements)
{
    char tag[SIM_TAG_MAX];
    sim_str_put(tag, sizeof tag, sim_str_put(tag, sizeof tag, 0, e->tag, SIZE_MAX), "/bwd", 4);
    mesh_nn_cost_memory(t, elements, tag);
}

sim_status mesh_nn_operand(mesh_tape *t, const mesh_array *src, const mesh_spec *spec, const char *tag, mesh_array *out,
                           bool *owned)
{
    mesh_ctx *c = mesh_tape_ctx(t);
    *owned = false;
    if (mesh_spec_equal(&src->spec, spec)) {
        *out = *src;
        return SIM_OK;
    }
    /* made before on this tape (e.g. the K/V gather of a recomputed layer): reuse it */
    mesh_reshard_cache *cache = mesh_tape_cache(t);
    if (mesh_reshard_cache_get(cache, src, &src->spec, spec, out)) return SIM_OK;
    /* counted as a clone; the reshard reads src's shard (a copy only where its first step works in place) */
    SIM_TRY(mesh_array_borrow(c->dev, c->mesh, src, src->name, SIM_MEM_ACTIVATIONS, out));
    /* a weight moves in its own dtype, or in the one the hardware profile's compiler casts it to
     * first (MaxText casts the table, the expert kernels, ... to dtype before using them) */
    if (src->cat == SIM_MEM_PARAMS) mesh_array_recount(c->dev, out, mesh_array_gather_dtype(c->dev, src));
    else if (src->cat == SIM_MEM_GRADS || src->cat == SIM_MEM_OPTIMIZER) mesh_array_recount(c->dev, out, src->counted);
    sim_meta meta = c->mode == MESH_MODE_AUTO ? sim_meta_implicit(tag) : sim_meta_tag(tag);
    meta.weight = src->cat == SIM_MEM_PARAMS; /* not windowed: only an einsum's weight product is */
    /* every caller only reads the operand (its VJP writes fresh gradients; every model and mesh test
     * passes with shared buffers mapped read-only, sim_machine_set_shared_guard): a gather, of a
     * weight or an activation, is one buffer for the group */
    sim_status st = mesh_reshard_shared(c->dev, c->mesh, out, spec, meta);
    if (st) {
        mesh_array_free(c->dev, out);
        return st;
    }
    mesh_reshard_cache_put(cache, src, &src->spec, out); /* the tape's cache owns it now */
    return SIM_OK;
}

static void drop(mesh_tape *t, mesh_array *a, bool owned)
{
    if (owned) mesh_array_free(mesh_tape_ctx(t)->dev, a);
}

/* Saves a into e, or frees it now when nothing was recorded. */
static void keep(mesh_tape *t, mesh_entry *e, const mesh_array *a, bool owned)
{
    if (e) mesh_entry_save(e, a, owned);
    else if (owned) {
        mesh_array tmp = *a;
        mesh_array_free(mesh_tape_ctx(t)->dev, &tmp);
    }
}

static sim_axes dim_axes(const mesh_spec *s, int d)
{
    sim_axes a = sim_axes_none();
    for (int i = 0; i < s->n_axes[d]; i++) a.axis[a.n++] = s->axes[d][i];
    return a;
}

static void set_dim(mesh_spec *s, int d, const mesh_spec *from, int fd)
{
    s->n_axes[d] = from->n_axes[fd];
    memcpy(s->axes[d], from->axes[fd], sizeof s->axes[d]);
}

static uint32_t axes_mask(sim_axes a)
{
    uint32_t m = 0;
    for (int i = 0; i < a.n; i++) m |= 1u << a.axis[i];
    return m;
}

static sim_status new_out(mesh_tape *t, const char *name, int rank, const int64_t *shape, const mesh_spec *spec,
                          mesh_var **out)
{
    mesh_ctx *c = mesh_tape_ctx(t);
    *out = mesh_tape_var(t);
    /* every op below writes all of its output */
    return mesh_array_new_raw(c->dev, c->mesh, name, rank, shape, spec, SIM_F32, SIM_MEM_ACTIVATIONS, &(*out)->val);
}

/* A cotangent array (zeroed) in the temporaries category. */
static sim_status new_cot(mesh_tape *t, const char *name, int rank, const int64_t *shape, const mesh_spec *spec,
                          mesh_array *out)
{
    return mesh_tape_zeros(t, name, rank, shape, spec, SIM_MEM_TEMP, out);
}

/* The same, not zeroed: for a VJP that writes every element of it. */
static sim_status new_cot_raw(mesh_tape *t, const char *name, int rank, const int64_t *shape, const mesh_spec *spec,
                              mesh_array *out)
{
    mesh_ctx *c = mesh_tape_ctx(t);
    return mesh_array_new_raw(c->dev, c->mesh, name, rank, shape, spec, SIM_F32, SIM_MEM_TEMP, out);
}

static int64_t local_rows(const mesh_array *a) { return a->rank ? (int64_t)a->nlocal / a->local[a->rank - 1] : 1; }

/* ------------------------------------------------------------ RMSNorm */

enum { NORM_GRAIN = 64 }; /* rows per parallel chunk */

/* Row loops of RMSNorm, cut into chunks for the kernel pool. */
typedef struct {
    const float *x, *dy, *scale;
    float *dot, *rstd, *out;
    double *partial; /* backward: dscale partial sums, [chunk][C] */
    void *unused;
    int64_t C;
    double E, eps;
    int64_t grain;
} norm_job;

/* A row's sums run in NORM_LANES double lanes, lane l taking every NORM_LANES-th element in
 * order, then the lanes in order: the loops vectorise (a single running sum is one dependent add
 * per element) and every clone gives the same bits. */
enum { NORM_LANES = 16 };

BK_CLONES static void norm_sumsq_rows(int64_t lo, int64_t hi, void *arg)
{
    const norm_job *J = arg;
    const int64_t C = J->C, body = C - C % NORM_LANES;
    for (int64_t n = lo; n < hi; n++) {
        const float *row = J->x + n * C;
        double lane[NORM_LANES] = {0};
        for (int64_t j = 0; j < body; j += NORM_LANES)
            for (int l = 0; l < NORM_LANES; l++) lane[l] += (double)row[j + l] * row[j + l];
        for (int64_t j = body; j < C; j++) lane[j - body] += (double)row[j] * row[j];
        double acc = 0;
        for (int l = 0; l < NORM_LANES; l++) acc += lane[l];
        J->rstd[n] = (float)acc;
    }
}

BK_CLONES static void norm_apply_rows(int64_t lo, int64_t hi, void *arg)
{
    const norm_job *J = arg;
    for (int64_t n = lo; n < hi; n++) {
        double rr = 1.0 / sqrt((double)J->rstd[n] / J->E + J->eps);
        J->rstd[n] = (float)rr;
        const float *row = J->x + n * J->C;
        float *o = J->out + n * J->C;
        for (int64_t j = 0; j < J->C; j++) o[j] = (float)(row[j] * rr) * J->scale[j];
    }
}

BK_CLONES static void norm_dot_rows(int64_t lo, int64_t hi, void *arg)
{
    const norm_job *J = arg;
    const int64_t C = J->C, body = C - C % NORM_LANES;
    const float *sc = J->scale;
    for (int64_t n = lo; n < hi; n++) {
        const float *dy = J->dy + n * C, *x = J->x + n * C;
        double lane[NORM_LANES] = {0};
        for (int64_t j = 0; j < body; j += NORM_LANES)
            for (int l = 0; l < NORM_LANES; l++) lane[l] += (double)dy[j + l] * sc[j + l] * x[j + l];
        for (int64_t j = body; j < C; j++) lane[j - body] += (double)dy[j] * sc[j] * x[j];
        double acc = 0;
        for (int l = 0; l < NORM_LANES; l++) acc += lane[l];
        J->dot[n] = (float)acc;
    }
}

BK_CLONES static void norm_dx_rows(int64_t lo, int64_t hi, void *arg)
{
    const norm_job *J = arg;
    double *acc = J->partial + (lo / J->grain) * J->C;
    for (int64_t n = lo; n < hi; n++) {
        double rr = J->rstd[n], k = rr * rr * rr * J->dot[n] / J->E;
        for (int64_t j = 0; j < J->C; j++) {
            int64_t i = n * J->C + j;
            J->out[i] = (float)(rr * J->dy[i] * J->scale[j] - k * J->x[i]);
            acc[j] += (double)J->dy[i] * J->x[i] * rr;
        }
    }
}

/* With the normalised dim unsharded (no all-reduce between the two row loops) each chunk runs both
 * while its rows are still in cache: one pass over x and one pool job instead of two, the same
 * operations on every element. */
static void norm_fwd_rows(int64_t lo, int64_t hi, void *arg)
{
    norm_sumsq_rows(lo, hi, arg);
    norm_apply_rows(lo, hi, arg);
}

static void norm_bwd_rows(int64_t lo, int64_t hi, void *arg)
{
    norm_dot_rows(lo, hi, arg);
    norm_dx_rows(lo, hi, arg);
}

static sim_status rmsnorm_vjp(mesh_tape *t, mesh_entry *e)
{
    mesh_ctx *c = mesh_tape_ctx(t);
    mesh_var *x = e->in[0], *scale = e->in[1], *y = e->out[0];
    const mesh_array *xa = &e->saved[0], *sa = &e->saved[1], *rstd = &e->saved[2];
    mesh_array *dy = &y->grad;
    int r = xa->rank;
    double E = e->f[0];
    mesh_spec xs = xa->spec;
    sim_axes xe = dim_axes(&xs, r - 1);
    mesh_spec dxs = dy->spec; /* x dims + partial P */
    mesh_array dx, dscale, dot;
    SIM_TRY(new_cot_raw(t, "rmsnorm/dx", r, xa->shape, &dxs, &dx)); /* norm_dx_rows writes every element */
    mesh_spec ss;
    mesh_spec_init(&ss, 1);
    set_dim(&ss, 0, &xs, r - 1);
    ss.partial = dy->spec.partial | (mesh_spec_dim_axes(&xs) & ~axes_mask(xe));
    SIM_TRY(new_cot_raw(t, "rmsnorm/dscale", 1, sa->shape, &ss, &dscale)); /* written below */
    SIM_TRY(mesh_array_clone(c->dev, c->mesh, rstd, "rmsnorm/dot", SIM_MEM_TEMP, &dot));
    int64_t N = local_rows(xa), C = xa->local[r - 1];
    int64_t nchunks = (N + NORM_GRAIN - 1) / NORM_GRAIN;
    norm_job J = {xa->data, dy->data, sa->data, dot.data, rstd->data, dx.data, NULL, NULL, C, E, 0, NORM_GRAIN};
    if (dy->data) /* dscale sums over rows: per-chunk partial sums added in chunk order, so the
                   * result does not depend on how many threads ran the chunks */
        J.partial = calloc((size_t)(nchunks * C), sizeof *J.partial);
    if (dy->data && xe.n) bk_parallel_for(N, NORM_GRAIN, norm_dot_rows, &J);
    char tag[SIM_TAG_MAX];
    if (xe.n)
        SIM_TRY(
            sim_all_reduce(c->dev, dot.data, dot.data, dot.nlocal, SIM_F32, xe,
                           mesh_array_meta(&dot, sim_meta_tag(mesh_tape_tag(t, "rmsnorm/bwd_sum", tag, sizeof tag)))));
    if (dy->data) {
        bk_parallel_for(N, NORM_GRAIN, xe.n ? norm_dx_rows : norm_bwd_rows, &J);
        float *ds = dscale.data;
        for (int64_t j = 0; j < C; j++) {
            double acc = 0;
            for (int64_t k = 0; k < nchunks; k++) acc += J.partial[k * C + j];
            ds[j] = (float)acc;
        }
        free(J.partial);
    }
    mesh_nn_cost_memory_bwd(t, e, 3.0 * (double)xa->nlocal); /* x and dy read, dx written */
    mesh_array_free(c->dev, &dot);
    SIM_TRY(mesh_tape_accumulate(t, x, &dx, mesh_tape_tag(t, "rmsnorm/dx", tag, sizeof tag)));
    return mesh_tape_accumulate(t, scale, &dscale, mesh_tape_tag(t, "rmsnorm/dscale", tag, sizeof tag));
}

sim_status mesh_nn_rmsnorm(mesh_tape *t, mesh_var *x, mesh_var *scale, double eps, const char *name, mesh_var **y)
{
    mesh_ctx *c = mesh_tape_ctx(t);
    char tag[SIM_TAG_MAX];
    mesh_tape_tag(t, name, tag, sizeof tag);
    mesh_spec xs = x->val.spec;
    xs.partial = 0;
    mesh_array xa, sa, rstd;
    bool xo, so;
    SIM_TRY(mesh_nn_operand(t, &x->val, &xs, tag, &xa, &xo));
    int r = xa.rank;
    int64_t E = xa.shape[r - 1];
    mesh_spec ss;
    mesh_spec_init(&ss, 1);
    set_dim(&ss, 0, &xs, r - 1);
    SIM_TRY(mesh_nn_operand(t, &scale->val, &ss, tag, &sa, &so));
    SIM_TRY(new_out(t, name, r, xa.shape, &xs, y));
    mesh_spec rs;
    mesh_spec_init(&rs, r - 1);
    for (int d = 0; d < r - 1; d++) set_dim(&rs, d, &xs, d);
    SIM_TRY(mesh_array_new(c->dev, c->mesh, "rmsnorm/rstd", r - 1, xa.shape, &rs, SIM_F32, SIM_MEM_ACTIVATIONS, &rstd));
    /* MaxText's RMSNorm casts x to float32 for the mean of squares (layers/normalizations.py) */
    mesh_array_recount(c->dev, &rstd, SIM_F32);
    int64_t N = local_rows(&xa), C = xa.local[r - 1];
    norm_job J = {xa.data, NULL, sa.data, NULL, rstd.data, (*y)->val.data, NULL, NULL, C, (double)E, eps, 0};
    sim_axes xe = dim_axes(&xs, r - 1);
    if (xa.data && xe.n) bk_parallel_for(N, NORM_GRAIN, norm_sumsq_rows, &J);
    if (xe.n)
        SIM_TRY(sim_all_reduce(c->dev, rstd.data, rstd.data, rstd.nlocal, SIM_F32, xe,
                               mesh_array_meta(&rstd, sim_meta_tag(tag))));
    if (xa.data) bk_parallel_for(N, NORM_GRAIN, xe.n ? norm_apply_rows : norm_fwd_rows, &J);
    mesh_nn_cost_memory(t, 2.0 * (double)xa.nlocal, tag); /* x read, y written (one fused pass) */
    mesh_var *in[2] = {x, scale};
    mesh_entry *e = mesh_tape_record(t, rmsnorm_vjp, tag, 2, in, 1, y);
    if (e) e->f[0] = (double)E;
    keep(t, e, &xa, xo);
    keep(t, e, &sa, so);
    keep(t, e, &rstd, true);
    return SIM_OK;
}

/* ------------------------------------------------------------ RoPE */

typedef struct {
    bk_rope_params p;
} rope_payload;

static sim_status rope_vjp(mesh_tape *t, mesh_entry *e)
{
    mesh_var *x = e->in[0], *y = e->out[0];
    const mesh_array *pos = &e->saved[0];
    const rope_payload *rp = e->payload;
    mesh_array *dy = &y->grad, dx;
    SIM_TRY(new_cot(t, "rope/dx", dy->rank, dy->shape, &dy->spec, &dx));
    if (dy->data)
        bk_rope_bwd(dx.data, dy->data, pos->data, (int)(dy->local[0] * dy->local[1]), (int)dy->local[2],
                    (int)dy->local[3], (int)dy->local[3], &rp->p);
    mesh_nn_cost_memory_bwd(t, e, 2.0 * (double)dy->nlocal);
    char tag[SIM_TAG_MAX];
    return mesh_tape_accumulate(t, x, &dx, mesh_tape_tag(t, "rope/dx", tag, sizeof tag));
}

sim_status mesh_nn_rope(mesh_tape *t, mesh_var *x, const mesh_array *positions, const bk_rope_params *p,
                        const char *name, mesh_var **y)
{
    char tag[SIM_TAG_MAX];
    mesh_tape_tag(t, name, tag, sizeof tag);
    mesh_spec xs = x->val.spec;
    xs.n_axes[3] = 0; /* the rotated dim must be whole */
    mesh_spec ps;
    mesh_spec_init(&ps, 2);
    set_dim(&ps, 0, &xs, 0);
    set_dim(&ps, 1, &xs, 1);
    mesh_array xa, pa;
    bool xo, po;
    SIM_TRY(mesh_nn_operand(t, &x->val, &xs, tag, &xa, &xo));
    SIM_TRY(mesh_nn_operand(t, positions, &ps, tag, &pa, &po));
    SIM_TRY(new_out(t, name, 4, xa.shape, &xa.spec, y));
    if (xa.data)
        bk_rope_fwd((*y)->val.data, xa.data, pa.data, (int)(xa.local[0] * xa.local[1]), (int)xa.local[2],
                    (int)xa.local[3], (int)xa.local[3], p);
    drop(t, &xa, xo);
    mesh_nn_cost_memory(t, 2.0 * (double)xa.nlocal, tag); /* x read, y written */
    mesh_entry *e = mesh_tape_record(t, rope_vjp, tag, 1, &x, 1, y);
    if (e) {
        rope_payload *rp = malloc(sizeof *rp);
        rp->p = *p;
        e->payload = rp;
        e->free_payload = free;
    }
    keep(t, e, &pa, po);
    return SIM_OK;
}

/* ------------------------------------------------------------ bias */

static sim_status bias_vjp(mesh_tape *t, mesh_entry *e)
{
    mesh_ctx *c = mesh_tape_ctx(t);
    mesh_var *x = e->in[0], *bias = e->in[1], *y = e->out[0];
    const mesh_array *ba = &e->saved[0];
    mesh_array *dy = &y->grad; /* y's dims + partial P */
    const int r = y->val.rank, rb = ba->rank;
    mesh_spec bs = ba->spec;
    bs.partial = dy->spec.partial;
    for (int d = 0; d < r - rb; d++) bs.partial |= axes_mask(dim_axes(&dy->spec, d));
    mesh_array db;
    SIM_TRY(new_cot(t, "bias/dbias", rb, ba->shape, &bs, &db));
    if (dy->data) { /* the sum over the leading rows, in row order */
        const int64_t w = (int64_t)ba->nlocal, rows = w ? (int64_t)dy->nlocal / w : 0;
        double *acc = calloc((size_t)w + 1, sizeof *acc);
        SIM_ASSERT(acc);
        const float *g = dy->data;
        for (int64_t i = 0; i < rows; i++)
            for (int64_t j = 0; j < w; j++) acc[j] += g[i * w + j];
        for (int64_t j = 0; j < w; j++) ((float *)db.data)[j] = (float)acc[j];
        free(acc);
    }
    sim_device_add_cost(c->dev, 0.0, (double)dy->nlocal + (double)ba->nlocal, 0.0, e->tag);
    char tag[SIM_TAG_MAX];
    SIM_TRY(mesh_tape_accumulate(t, bias, &db, mesh_tape_tag(t, "bias/dbias", tag, sizeof tag)));
    mesh_array dx = *dy; /* x's cotangent is y's */
    y->has_grad = false;
    return mesh_tape_accumulate(t, x, &dx, e->tag);
}

sim_status mesh_nn_bias_add(mesh_tape *t, mesh_var *x, mesh_var *bias, const char *name, mesh_var **out)
{
    mesh_ctx *c = mesh_tape_ctx(t);
    const int r = x->val.rank, rb = bias->val.rank;
    char tag[SIM_TAG_MAX];
    mesh_tape_tag(t, name, tag, sizeof tag);
    SIM_ASSERT(rb >= 1 && rb <= r);
    for (int d = 0; d < rb; d++)
        if (bias->val.shape[d] != x->val.shape[r - rb + d])
            return sim_err(SIM_ERR_INTERNAL, "%s: bias dim %d (%lld) does not fit x's dim %d (%lld)", tag, d,
                           (long long)bias->val.shape[d], r - rb + d, (long long)x->val.shape[r - rb + d]);
    mesh_spec xs = x->val.spec, bs;
    xs.partial = 0; /* a partial sum gets its bias once: reduced first */
    mesh_spec_init(&bs, rb);
    for (int d = 0; d < rb; d++) set_dim(&bs, d, &xs, r - rb + d);
    mesh_array xa, ba;
    bool xo, bo;
    SIM_TRY(mesh_nn_operand(t, &x->val, &xs, tag, &xa, &xo));
    SIM_TRY(mesh_nn_operand(t, &bias->val, &bs, tag, &ba, &bo));
    SIM_TRY(new_out(t, name, r, x->val.shape, &xs, out));
    if (xa.data) {
        const int64_t w = (int64_t)ba.nlocal, rows = w ? (int64_t)xa.nlocal / w : 0;
        const float *xv = xa.data, *bv = ba.data;
        float *yv = (*out)->val.data;
        for (int64_t i = 0; i < rows; i++)
            for (int64_t j = 0; j < w; j++) yv[i * w + j] = xv[i * w + j] + bv[j];
    }
    if (xo) mesh_array_free(c->dev, &xa);
    sim_device_add_cost(c->dev, 0.0, 2.0 * (double)(*out)->val.nlocal + (double)ba.nlocal, 0.0, tag);
    mesh_var *in[2] = {x, bias};
    mesh_entry *e = mesh_tape_record(t, bias_vjp, tag, 2, in, 1, out);
    keep(t, e, &ba, bo);
    return SIM_OK;
}

/* ------------------------------------------------------------ attention */

static bk_attn_dims attn_dims(const mesh_array *q, const mesh_array *k, const mesh_array *v, double scale,
                              double soft_cap, int64_t window)
{
    bk_attn_dims d;
    memset(&d, 0, sizeof d);
    d.B = (int)q->local[0];
    d.Tq = (int)q->local[1];
    d.Tk = (int)k->local[1];
    d.Hq = (int)q->local[2];
    d.Hkv = (int)k->local[2];
    d.Dqk = (int)q->local[3];
    d.Dv = (int)v->local[3];
    d.scale = (float)scale;
    d.soft_cap = (float)soft_cap;
    d.window = (int)window;
    return d;
}

/* Attention's cost for the step-time model: QK^T and PV over the causal half of the score
 * matrix (a flash kernel skips the masked blocks), and q, k, v and the output read or written
 * once.  Backward recomputes the scores and makes dV, dP, dQ, dK: 2.5 times the forward's
 * products, and twice its elements (the cotangents).  mxu: the kernel's real work (0: these
 * FLOPs), from splash_work. */
static void attention_cost(sim_device *dev, const mesh_array *q, const mesh_array *k, const mesh_array *v,
                           int64_t window, bool backward, double mxu, const char *tag)
{
    double B = (double)q->local[0], Tq = (double)q->local[1], Tk = (double)k->local[1], H = (double)q->local[2];
    /* the visible share of the score matrix: the causal half, or with a sliding window W < Tk the
     * W T - W (W - 1) / 2 pairs of a causal band over Tk keys (maxtext_utils.py counts the same band) */
    double W = (double)window, vis = 0.5;
    if (window > 0 && W < Tk) vis = (W * Tk - 0.5 * W * (W - 1.0)) / (Tk * Tk);
    double flops = 2.0 * B * H * Tq * Tk * (double)(q->local[3] + v->local[3]) * vis;
    double el = (double)q->nlocal + (double)k->nlocal + (double)v->nlocal + B * Tq * H * (double)v->local[3];
    if (backward) flops *= 2.5, el *= 2.0;
    sim_device_add_cost_tiled(dev, flops, mxu, el, 0.0, tag);
}

/* (bq x bkv) blocks of a causal grid over T x T positions (0..T-1 on both sides) that hold an
 * unmasked score: the splash kernel visits those and computes each whole. */
static double causal_blocks(int64_t T, int64_t bq, int64_t bkv)
{
    double n = 0;
    for (int64_t q0 = 0; q0 < T; q0 += bq) {
        int64_t last = (q0 + bq < T ? q0 + bq : T) - 1;
        int64_t nk = last / bkv + 1, all = (T + bkv - 1) / bkv;
        n += (double)(nk < all ? nk : all);
    }
    return n;
}

static int64_t clip(int64_t b, int64_t T) { return b > 0 && b < T ? b : T; }

/* The splash kernel's products (jax splash_attention_kernel.py): forward QK^T (Dqk) and PV (Dv)
 * per visited (block_q, block_kv) block; backward the dq kernel's QK^T, dO V^T, dS K (2 Dqk + Dv)
 * and the dkv kernel's K Q^T, P^T dO, V dO^T, dS^T Q (2 Dqk + 2 Dv) over their own blocks, or with
 * the fused backward the dkv kernel alone, dQ included (3 Dqk + 2 Dv).  Only for a causal
 * self-attention over the whole local sequence (Tq = Tk); else 0 (the FLOPs stand). */
static double splash_work(const mesh_nn_splash *sp, const mesh_array *q, const mesh_array *k, const mesh_array *v,
                          bool backward)
{
    int64_t T = q->local[1];
    if (!sp || sp->q <= 0 || k->local[1] != T) return 0.0;
    double BH = (double)q->local[0] * (double)q->local[2], Dqk = (double)q->local[3], Dv = (double)v->local[3];
    int64_t bq = clip(sp->q, T), bkv = clip(sp->kv, T), bqk = clip(sp->q_dkv, T), bkk = clip(sp->kv_dkv, T),
            bqq = clip(sp->q_dq, T), bkq = clip(sp->kv_dq, T);
    if (!backward) return 2.0 * BH * causal_blocks(T, bq, bkv) * (double)(bq * bkv) * (Dqk + Dv);
    if (sp->fused_bwd) return 2.0 * BH * causal_blocks(T, bqk, bkk) * (double)(bqk * bkk) * (3.0 * Dqk + 2.0 * Dv);
    return 2.0 * BH *
           (causal_blocks(T, bqq, bkq) * (double)(bqq * bkq) * (2.0 * Dqk + Dv) +
            causal_blocks(T, bqk, bkk) * (double)(bqk * bkk) * (2.0 * Dqk + 2.0 * Dv));
}

static sim_status attention_vjp(mesh_tape *t, mesh_entry *e)
{
    mesh_var *q = e->in[0], *k = e->in[1], *v = e->in[2], *y = e->out[0];
    const mesh_array *qa = &e->saved[0], *ka = &e->saved[1], *va = &e->saved[2], *lse = &e->saved[3],
                     *qp = &e->saved[4], *kp = &e->saved[5];
    mesh_array *dy = &y->grad, dq, dk, dv;
    uint32_t P = dy->spec.partial;
    mesh_spec qs = qa->spec, ks = ka->spec, vs = va->spec;
    qs.partial = P;
    /* the key/value cotangents are partial over the axes that shard the queries' sequence */
    uint32_t tmask = 0;
    for (int i = 0; i < qa->spec.n_axes[1]; i++) tmask |= 1u << qa->spec.axes[1][i];
    ks.partial = vs.partial = P | tmask;
    SIM_TRY(new_cot(t, "attention/dq", 4, qa->shape, &qs, &dq));
    SIM_TRY(new_cot(t, "attention/dk", 4, ka->shape, &ks, &dk));
    SIM_TRY(new_cot(t, "attention/dv", 4, va->shape, &vs, &dv));
    /* the sinks' cotangent: on the heads' axes, partial over the axes of the batch and the sequence */
    mesh_array dsink = {0};
    const mesh_array *sa = e->nin == 4 ? &e->saved[6] : NULL;
    if (sa) {
        mesh_spec ss = sa->spec;
        ss.partial = P | tmask;
        for (int i = 0; i < qa->spec.n_axes[0]; i++) ss.partial |= 1u << qa->spec.axes[0][i];
        SIM_TRY(new_cot(t, "attention/dsinks", 1, sa->shape, &ss, &dsink));
    }
    attention_cost(mesh_tape_ctx(t)->dev, qa, ka, va, (int64_t)e->f[4], true, e->f[3], e->tag);
    if (dy->data) {
        bk_attn_dims d = attn_dims(qa, ka, va, e->f[0], e->f[2], (int64_t)e->f[4]);
        if (sa) d.sinks = sa->data, d.dsinks = dsink.data;
        if (e->f[1] != 0.0) /* dot-product: `lse` holds the saved probabilities */
            bk_attention_dot_bwd(dq.data, dk.data, dv.data, dy->data, lse->data, qa->data, ka->data, va->data, &d);
        else
            bk_attention_bwd(dq.data, dk.data, dv.data, dy->data, NULL, y->val.data, lse->data, qa->data, ka->data,
                             va->data, qp->data, kp->data, &d);
    }
    char tag[SIM_TAG_MAX];
    SIM_TRY(mesh_tape_accumulate(t, q, &dq, mesh_tape_tag(t, "attention/dq", tag, sizeof tag)));
    SIM_TRY(mesh_tape_accumulate(t, k, &dk, mesh_tape_tag(t, "attention/dk", tag, sizeof tag)));
    SIM_TRY(mesh_tape_accumulate(t, v, &dv, mesh_tape_tag(t, "attention/dv", tag, sizeof tag)));
    if (e->nin < 4) return SIM_OK;
    return mesh_tape_accumulate(t, e->in[3], &dsink, mesh_tape_tag(t, "attention/dsinks", tag, sizeof tag));
}

/* MaxText's qk_product in explicit mode: einsum('btkgd,bskd->bkgts', query reshaped to
 * (b, t, kv_heads, groups, d), key), which jnp.einsum hands to dot_general as (key, query).  With
 * the sequence sharded the result would carry that axis on both lengths: JAX refuses it. */
static sim_status qk_product_check(mesh_ctx *c, const mesh_var *q, const mesh_var *k, const char *name)
{
    const mesh_array *qa = &q->val, *ka = &k->val;
    int64_t Hq = qa->shape[2], Hkv = ka->shape[2];
    int64_t qshape[5] = {qa->shape[0], qa->shape[1], Hkv, Hq / Hkv, qa->shape[3]};
    mesh_spec qs;
    mesh_spec_init(&qs, 5);
    qs.partial = qa->spec.partial;
    set_dim(&qs, 0, &qa->spec, 0);
    set_dim(&qs, 1, &qa->spec, 1);
    set_dim(&qs, 2, &qa->spec, 2); /* the heads' axes go to the kv-head dim (major) of the split */
    set_dim(&qs, 4, &qa->spec, 3);
    mesh_array qv = mesh_array_view(qa, 5, qshape, &qs);
    char tag[SIM_TAG_MAX];
    snprintf(tag, sizeof tag, "%s/qk_product", name);
    /* the op raising it in the release followed (maxtext_release); NULL: that release traces it */
    const char *where = cfg_release_error(c->release, "attention_qk_product", "layers/attention_op.py:qk_product");
    if (!where) return SIM_OK;
    return mesh_einsum_check(c, "btkgd,bskd->bkgts", &qv, ka, tag, where,
                             "dot-product attention cannot shard the sequence in explicit mode: use attention=flash "
                             "on hardware=tpu (or autoselected with max_target_length >= 128 there), a mesh without "
                             "the axes that shard the attention length, or shard_mode=auto");
}

sim_status mesh_nn_attention(mesh_tape *t, mesh_var *q, mesh_var *k, mesh_var *v, const mesh_array *q_pos, double scale,
                             const char *name, mesh_var **out)
{
    return mesh_nn_attention_kernel(t, q, k, v, q_pos, scale, 0.0, 0, false, NULL, name, out);
}

sim_status mesh_nn_attention_kernel(mesh_tape *t, mesh_var *q, mesh_var *k, mesh_var *v, const mesh_array *q_pos,
                                    double scale, double soft_cap, int64_t window, bool dot,
                                    const mesh_nn_splash *splash, const char *name, mesh_var **out)
{
    return mesh_nn_attention_sinks(t, q, k, v, NULL, q_pos, scale, soft_cap, window, dot, splash, name, out);
}

sim_status mesh_nn_attention_sinks(mesh_tape *t, mesh_var *q, mesh_var *k, mesh_var *v, mesh_var *sinks,
                                   const mesh_array *q_pos, double scale, double soft_cap, int64_t window, bool dot,
                                   const mesh_nn_splash *splash, const char *name, mesh_var **out)
{
    SIM_ASSERT(window >= 0 && window <= INT32_MAX);
    mesh_ctx *c = mesh_tape_ctx(t);
    char tag[SIM_TAG_MAX];
    mesh_tape_tag(t, name, tag, sizeof tag);
    if (dot) SIM_TRY(qk_product_check(c, q, k, name));
    mesh_spec qs = q->val.spec;
    qs.partial = 0;
    qs.n_axes[3] = 0;
    int64_t hk = mesh_spec_dim_shards(&qs, c->mesh, 2), Hq = q->val.shape[2], Hkv = k->val.shape[2];
    if (Hq % Hkv)
        return sim_err(SIM_ERR_INPUT, "%s: %lld query heads are not a multiple of %lld kv heads", tag, (long long)Hq,
                       (long long)Hkv);
    if (Hkv % hk) {
        char sp[128];
        mesh_spec_format(&qs, c->mesh, sp, sizeof sp);
        return sim_err(SIM_ERR_INPUT,
                       "%s: the query heads are split %lld ways (%s) but there are only %lld kv heads; grouped-query "
                       "attention needs the kv heads to split the same way. Use a mesh whose head-sharding axes "
                       "(tensor) divide base_num_kv_heads=%lld, or more kv heads",
                       tag, (long long)hk, sp, (long long)Hkv, (long long)Hkv);
    }
    mesh_spec ks;
    mesh_spec_init(&ks, 4);
    set_dim(&ks, 0, &qs, 0);
    set_dim(&ks, 2, &qs, 2);
    mesh_spec qps, kps;
    mesh_spec_init(&qps, 2);
    set_dim(&qps, 0, &qs, 0);
    set_dim(&qps, 1, &qs, 1);
    mesh_spec_init(&kps, 2);
    set_dim(&kps, 0, &qs, 0);
    mesh_array qa, ka, va, qp, kp, lse, sa;
    bool qo, ko, vo, qpo, kpo, so = false;
    if (sinks) { /* (heads): the query heads' sharding (attention_op.py shards sinks as HEAD) */
        if (sinks->val.rank != 1 || sinks->val.shape[0] != q->val.shape[2])
            return sim_err(SIM_ERR_INPUT, "%s: the sinks must be one logit per query head (%lld)", tag,
                           (long long)q->val.shape[2]);
        mesh_spec ss;
        mesh_spec_init(&ss, 1);
        set_dim(&ss, 0, &qs, 2);
        SIM_TRY(mesh_nn_operand(t, &sinks->val, &ss, tag, &sa, &so));
    }
    SIM_TRY(mesh_nn_operand(t, &q->val, &qs, tag, &qa, &qo));
    SIM_TRY(mesh_nn_operand(t, &k->val, &ks, tag, &ka, &ko));
    SIM_TRY(mesh_nn_operand(t, &v->val, &ks, tag, &va, &vo));
    SIM_TRY(mesh_nn_operand(t, q_pos, &qps, tag, &qp, &qpo));
    SIM_TRY(mesh_nn_operand(t, q_pos, &kps, tag, &kp, &kpo));
    int64_t oshape[4] = {qa.shape[0], qa.shape[1], qa.shape[2], va.shape[3]};
    SIM_TRY(new_out(t, name, 4, oshape, &qs, out));
    /* flash keeps the logsumexp (B, H, T); dot-product keeps its probabilities (B, H, T, S), the
     * score matrix MaxText's dot-product path materialises (and autodiff saves for the backward) */
    int64_t lshape[4] = {qa.shape[0], qa.shape[2], qa.shape[1], ka.shape[1]};
    mesh_spec ls;
    mesh_spec_init(&ls, dot ? 4 : 3);
    set_dim(&ls, 0, &qs, 0);
    set_dim(&ls, 1, &qs, 2);
    set_dim(&ls, 2, &qs, 1);
    SIM_TRY(mesh_array_new(c->dev, c->mesh, dot ? "attention/probs" : "attention/lse", dot ? 4 : 3, lshape, &ls,
                           SIM_F32, SIM_MEM_ACTIVATIONS, &lse));
    /* remat's recomputation: the forward's output and statistics (mesh/replay.h) */
    const mesh_spec placed[3] = {qa.spec, ka.spec, va.spec};
    bool replayed = false;
    if (mesh_replay_using(c->replay)) {
        replayed = mesh_replay_take(c->replay, tag, &(*out)->val, placed, 3);
        /* the statistics follow their output (both kept, or the path left at the first) */
        if (!mesh_replay_take(c->replay, tag, &lse, placed, 3)) replayed = false;
    }
    if (!replayed && qa.data) {
        bk_attn_dims d = attn_dims(&qa, &ka, &va, scale, soft_cap, window);
        if (sinks) d.sinks = sa.data;
        if (dot) bk_attention_dot_fwd((*out)->val.data, lse.data, qa.data, ka.data, va.data, qp.data, kp.data, &d);
        else bk_attention_fwd((*out)->val.data, lse.data, qa.data, ka.data, va.data, qp.data, kp.data, &d);
    }
    if (mesh_replay_saving(c->replay)) {
        mesh_replay_put(c->replay, tag, &(*out)->val, placed, 3);
        mesh_replay_put(c->replay, tag, &lse, placed, 3);
    }
    /* the splash block count is a causal grid's: with a window the FLOPs stand */
    const mesh_nn_splash *sp = dot || window > 0 ? NULL : splash;
    attention_cost(c->dev, &qa, &ka, &va, window, false, splash_work(sp, &qa, &ka, &va, false), tag);
    mesh_var *in[4] = {q, k, v, sinks};
    mesh_entry *e = mesh_tape_record(t, attention_vjp, tag, sinks ? 4 : 3, in, 1, out);
    if (e)
        e->f[0] = scale, e->f[1] = dot ? 1.0 : 0.0, e->f[2] = soft_cap, e->f[3] = splash_work(sp, &qa, &ka, &va, true),
        e->f[4] = (double)window;
    keep(t, e, &qa, qo);
    keep(t, e, &ka, ko);
    keep(t, e, &va, vo);
    keep(t, e, &lse, true);
    keep(t, e, &qp, qpo);
    keep(t, e, &kp, kpo);
    if (sinks) keep(t, e, &sa, so);
    return SIM_OK;
}

/* ------------------------------------------------------------ embedding
 *
 * Two lookups of the same values.  gather_table (XLA:CPU): the axes that shard the tokens are
 * gathered out of the table, each device looks its tokens up in that copy, and the table's
 * gradient is reduced back to its sharding.  all_to_all (XLA:TPU, mesh_ctx.embed_all_to_all):
 * where the table's embed dim is split by the trailing axes of the tokens' batch dim (FSDP),
 * the token ids are all-gathered over those k devices instead, every gathered token's row is
 * looked up on the local embed shard [k*Bl, T, E/k], and an all-to-all gives each device its
 * own tokens' full rows [Bl, T, E]; the backward all-to-alls the cotangent rows back and
 * scatter-adds them into the table's own shard (no reduction over those axes).  Where the axes
 * go on to split the tokens' length too (context parallelism), the rows are all-gathered whole and
 * sliced instead, both ways (embed_rows_allgather). */

/* The cotangent with every vocab axis of table spec ts summed (each vocab shard needs the whole
 * cotangent of its rows). */
static sim_status embed_dy_vocab_sum(mesh_ctx *c, const mesh_spec *ts, mesh_array *dy, const char *tag)
{
    uint32_t xv = 0;
    for (int i = 0; i < ts->n_axes[0]; i++) xv |= 1u << ts->axes[0][i];
    if (!(dy->spec.partial & xv)) return SIM_OK;
    mesh_spec to = dy->spec;
    to.partial &= ~xv;
    return mesh_reshard(c->dev, c->mesh, dy, &to, sim_meta_tag(tag));
}

static sim_status embed_vjp(mesh_tape *t, mesh_entry *e)
{
    mesh_ctx *c = mesh_tape_ctx(t);
    mesh_var *table = e->in[0], *y = e->out[0];
    const mesh_array *ta = &e->saved[0], *tok = &e->saved[1];
    mesh_array *dy = &y->grad;
    char tag[SIM_TAG_MAX];
    mesh_tape_tag(t, "embed/dtable", tag, sizeof tag);
    SIM_TRY(embed_dy_vocab_sum(c, &ta->spec, dy, tag));
    mesh_spec ds = ta->spec;
    ds.partial = dy->spec.partial | mesh_spec_dim_axes(&tok->spec);
    mesh_array dt;
    /* with a cotangent the kernel zero-fills the table itself, on the pool */
    SIM_TRY((dy->data ? new_cot_raw : new_cot)(t, "embed/dtable", 2, ta->shape, &ds, &dt));
    if (dy->data) {
        mesh_dim_shard sh[MESH_SPEC_MAX_RANK];
        mesh_spec_shard(&ta->spec, c->mesh, ta->shape, sim_device_id(c->dev), sh);
        bk_embedding_bwd_zero(dt.data, dy->data, tok->data, (int)tok->nlocal, (int)ta->local[1], (int)sh[0].offset,
                              (int)ta->local[0]);
    }
    mesh_nn_cost_memory(t, 2.0 * (double)dy->nlocal, tag); /* rows of dy scatter-added into the table */
    return mesh_tape_accumulate(t, table, &dt, tag);
}

/* The axes (size > 1) of the table's embed dim when the all-to-all lookup applies, else none: they
 * must be trailing axes of the tokens' batch dim followed by every axis of their length dim, in the
 * same order (the gathered ids are then k blocks [Bl, Tl] in group-rank order, and the rows' embed
 * blocks in the same order), and no vocab axis may shard the tokens (the lookup keeps the table's
 * vocab shard).  *rows_gathered: some of them split the tokens' length (context parallelism), where
 * XLA:TPU all-gathers the looked-up rows instead of all-to-alling them (embed_a2a's banner). */
static sim_axes embed_a2a_axes(const mesh_ctx *c, const mesh_spec *table, const mesh_spec *tokens, bool *rows_gathered)
{
    sim_axes ex = sim_axes_none(), bx = sim_axes_none(), lx = sim_axes_none();
    *rows_gathered = false;
    if (!c->embed_all_to_all) return ex;
    const int *size = c->mesh->sizes;
    uint32_t used = mesh_spec_dim_axes(tokens);
    for (int i = 0; i < table->n_axes[0]; i++)
        if (size[table->axes[0][i]] > 1 && (used & (1u << table->axes[0][i]))) return ex;
    for (int i = 0; i < table->n_axes[1]; i++)
        if (size[table->axes[1][i]] > 1) ex.axis[ex.n++] = table->axes[1][i];
    for (int i = 0; i < tokens->n_axes[0]; i++)
        if (size[tokens->axes[0][i]] > 1) bx.axis[bx.n++] = tokens->axes[0][i];
    for (int i = 0; i < tokens->n_axes[1]; i++)
        if (size[tokens->axes[1][i]] > 1) lx.axis[lx.n++] = tokens->axes[1][i];
    /* ex = a suffix of bx (the rows all-to-all'd), or a suffix of bx then lx (the rows gathered) */
    for (int with_length = 0; with_length < 2; with_length++) {
        int nl = with_length ? lx.n : 0, nb = ex.n - nl;
        bool ok = ex.n > 0 && nb >= 0 && nb <= bx.n && (!with_length || lx.n > 0);
        for (int i = 0; ok && i < nb; i++) ok = ex.axis[i] == bx.axis[bx.n - nb + i];
        for (int i = 0; ok && i < nl; i++) ok = ex.axis[nb + i] == lx.axis[i];
        if (ok) {
            *rows_gathered = with_length;
            return ex;
        }
    }
    ex.n = 0;
    return ex;
}

/* The tokens' spec with the axes ex taken off their batch and length dims: the gathered ids'. */
static mesh_spec embed_ids_spec(const mesh_spec *tokens, sim_axes ex)
{
    mesh_spec s = *tokens;
    uint32_t drop = axes_mask(ex);
    for (int d = 0; d < 2; d++) {
        int n = 0;
        for (int i = 0; i < s.n_axes[d]; i++)
            if (!(drop & (1u << s.axes[d][i]))) s.axes[d][n++] = s.axes[d][i];
        s.n_axes[d] = n;
    }
    return s;
}

/* The looked-up rows' spec, (batch, length, embed) = (ids' batch, tokens' length, ex), partial
 * over `partial`. */
static mesh_spec embed_rows_spec(const mesh_spec *ids, sim_axes ex, uint32_t partial)
{
    mesh_spec s;
    mesh_spec_init(&s, 3);
    set_dim(&s, 0, ids, 0);
    set_dim(&s, 1, ids, 1);
    for (int i = 0; i < ex.n; i++) s.axes[2][s.n_axes[2]++] = ex.axis[i];
    s.partial = partial;
    return s;
}

/* The rows' exchange where ex also splits the tokens' length (XLA:TPU under context parallelism:
 * llama2-7b context=2 x fsdp=4 on v5p-16, fsdp=2 x context=2 on v5p-8 and deepseek2-16b ep-as-cp
 * have `all-gather bf16[8,2048,4096]` (op_name jvp()/gather) of the rows looked up on the embed shard
 * and `all-gather bf16[16,1024,4096]` (transpose(jvp())/scatter-add) of their cotangents, each
 * followed by a slice, in place of the all-to-alls; no gather of the table, no reduce-scatter of its
 * gradient).  Forward (to_own): `from` [k*n, E/k] (member-major: member q's n tokens on this embed
 * shard) is all-gathered whole over ex, [k][k*n][E/k], and this device (rank r) keeps its own
 * tokens' rows [n, E]: block s of the embed dim from member s's rows r.  Backward: `from` [n, E]
 * (the cotangent of this device's tokens) is all-gathered, [k][n][E], and `to` gets every member's
 * rows on this device's embed block [k*n, E/k].  The gathered copy is a temporary of the whole
 * group's rows in `from`'s counted dtype.  The same values as the all-to-all, which moves them
 * directly. */
static sim_status embed_rows_allgather(mesh_ctx *c, const mesh_array *from, const mesh_spec *gspec, sim_axes ex,
                                       bool to_own, mesh_array *to, sim_meta meta)
{
    int k = sim_mesh_group_size(sim_machine_mesh(sim_device_machine(c->dev)), ex);
    int r = sim_device_group_rank(c->dev, ex);
    mesh_spec gs = *gspec; /* the gathered copy: the embed dim whole */
    gs.n_axes[2] = 0;
    int64_t shape[3] = {to_own ? to->shape[0] : from->shape[0], to_own ? to->shape[1] : from->shape[1],
                        to_own ? to->shape[2] : from->shape[2]};
    mesh_array g;
    SIM_TRY(mesh_array_new_raw(c->dev, c->mesh, "embed/rows_gathered", 3, shape, &gs, SIM_F32, SIM_MEM_TEMP, &g));
    mesh_array_recount(c->dev, &g, meta.counted_set ? meta.counted : from->counted);
    sim_status st = sim_all_gather(c->dev, from->data, g.data, from->nlocal, SIM_F32, ex, meta);
    if (!st && g.data) {
        const size_t E = (size_t)(to_own ? to->local[2] : from->local[2]), Ek = E / (size_t)k;
        const size_t n = (to_own ? to->nlocal : from->nlocal) / E;
        const float *G = g.data;
        float *o = to->data;
        for (size_t q = 0; q < (size_t)k; q++)
            for (size_t i = 0; i < n; i++)
                if (to_own) /* member q's rows of this device's tokens: embed block q */
                    memcpy(o + i * E + q * Ek, G + (q * (size_t)k * n + (size_t)r * n + i) * Ek, Ek * sizeof *o);
                else /* member q's token i on this device's embed block r */
                    memcpy(o + (q * n + i) * Ek, G + (q * n + i) * E + (size_t)r * Ek, Ek * sizeof *o);
    }
    mesh_array_free(c->dev, &g);
    return st;
}

static sim_status embed_a2a_vjp(mesh_tape *t, mesh_entry *e)
{
    mesh_ctx *c = mesh_tape_ctx(t);
    mesh_var *table = e->in[0], *y = e->out[0];
    const mesh_array *tw = &table->val, *ids = &e->saved[0], *tok = &e->saved[1];
    mesh_array *dy = &y->grad;
    char tag[SIM_TAG_MAX];
    mesh_tape_tag(t, "embed/dtable", tag, sizeof tag);
    SIM_TRY(embed_dy_vocab_sum(c, &tw->spec, dy, tag));
    bool gathered;
    sim_axes ex = embed_a2a_axes(c, &tw->spec, &tok->spec, &gathered);
    int k = sim_mesh_group_size(sim_machine_mesh(sim_device_machine(c->dev)), ex);
    /* the cotangent rows back to the devices that looked them up: [Bl, Tl, E] -> [k*Bl*Tl, E/k] */
    mesh_spec rs = embed_rows_spec(&ids->spec, ex, dy->spec.partial);
    mesh_array dr, dt;
    SIM_TRY(new_cot_raw(t, "embed/drows", 3, y->val.shape, &rs, &dr));
    if (dy->counted_fixed) mesh_array_recount(c->dev, &dr, dy->counted);
    sim_status st;
    if (gathered)
        SIM_TRY_GOTO(embed_rows_allgather(c, dy, &rs, ex, false, &dr, mesh_array_meta(dy, sim_meta_tag(tag))), st, fail);
    else {
        size_t dshape[3] = {(size_t)dy->local[0], (size_t)dy->local[1], (size_t)dy->local[2]};
        SIM_TRY_GOTO(sim_all_to_all_dims(c->dev, dy->data, dr.data, 3, dshape, 2, 0, SIM_F32, ex,
                                         mesh_array_meta(dy, sim_meta_tag(tag))),
                     st, fail);
    }
    /* the table's own shard: what the tokens' other axes hold is summed by the accumulation */
    mesh_spec ds = tw->spec;
    ds.partial = dy->spec.partial | (mesh_spec_dim_axes(&tok->spec) & ~axes_mask(ex));
    SIM_TRY_GOTO((dr.data ? new_cot_raw : new_cot)(t, "embed/dtable", 2, tw->shape, &ds, &dt), st, fail);
    if (dr.data) {
        /* member q's rows summed on their own, then the members' sums in rank order: the bits of the
         * gather path, whose per-device sums the gradient's reduce-scatter adds in group-rank order
         * (sim_reduce_scatter_dim) before any other partial axis is summed */
        mesh_dim_shard sh[MESH_SPEC_MAX_RANK];
        mesh_spec_shard(&tw->spec, c->mesh, tw->shape, sim_device_id(c->dev), sh);
        const int64_t nl = (int64_t)tok->nlocal, C = tw->local[1], V = tw->local[0];
        const int32_t *id = ids->data;
        const float *g = dr.data;
        float *d = dt.data;
        bk_embedding_bwd_zero(d, g, id, (int)nl, (int)C, (int)sh[0].offset, (int)V);
        float *part = k > 1 ? malloc((size_t)(V * C) * sizeof *part) : NULL;
        SIM_ASSERT(k == 1 || part);
        for (int q = 1; q < k; q++) {
            bk_embedding_bwd_zero(part, g + q * nl * C, id + q * nl, (int)nl, (int)C, (int)sh[0].offset, (int)V);
            for (int64_t j = 0; j < V * C; j++) d[j] += part[j];
        }
        free(part);
    }
fail: /* the rows go on every path; dt is the accumulation's once made */
    mesh_array_free(c->dev, &dr);
    if (st != SIM_OK) return st;
    mesh_nn_cost_memory(t, 2.0 * (double)dy->nlocal, tag); /* rows of dy scatter-added into the table */
    return mesh_tape_accumulate(t, table, &dt, tag);
}

/* XLA:TPU's lookup (see the banner): ids gathered, rows looked up on the shard, all-to-all. */
static sim_status embed_a2a(mesh_tape *t, mesh_var *table, const mesh_array *tokens, sim_axes ex, bool gathered,
                            const char *name, const char *tag, mesh_var **out)
{
    mesh_ctx *c = mesh_tape_ctx(t);
    const mesh_array *tw = &table->val;
    /* the token ids of the k devices, int32 (kept for the backward): k blocks [Bl, Tl] */
    mesh_spec is = embed_ids_spec(&tokens->spec, ex);
    mesh_array ids, rows;
    SIM_TRY(
        mesh_array_new_raw(c->dev, c->mesh, "embed/ids", 2, tokens->shape, &is, SIM_I32, SIM_MEM_ACTIVATIONS, &ids));
    sim_status st = sim_all_gather(c->dev, tokens->data, ids.data, tokens->nlocal, SIM_I32, ex, sim_meta_tag(tag));
    /* their rows on this device's embed shard, [k*Bl, T, E/k], in the dtype weights are gathered in
     * (a temporary); each vocab shard looks up its own rows (partial over the vocab axes) */
    uint32_t vocab = 0;
    for (int i = 0; i < tw->spec.n_axes[0]; i++) vocab |= 1u << tw->spec.axes[0][i];
    mesh_spec rs = embed_rows_spec(&is, ex, vocab);
    int64_t shape[3] = {tokens->shape[0], tokens->shape[1], tw->shape[1]};
    if (!st) st = mesh_array_new_raw(c->dev, c->mesh, "embed/rows", 3, shape, &rs, SIM_F32, SIM_MEM_TEMP, &rows);
    if (st) {
        mesh_array_free(c->dev, &ids);
        return st;
    }
    sim_dtype gdt = mesh_array_gather_dtype(c->dev, tw);
    mesh_array_recount(c->dev, &rows, gdt);
    if (rows.data) {
        mesh_dim_shard sh[MESH_SPEC_MAX_RANK];
        mesh_spec_shard(&tw->spec, c->mesh, tw->shape, sim_device_id(c->dev), sh);
        bk_embedding_fwd(rows.data, ids.data, tw->data, (int)ids.nlocal, (int)tw->local[1], (int)sh[0].offset,
                         (int)tw->local[0]);
    }
    /* each device's own tokens, whole rows: [Bl, T, E], the gather path's output spec */
    mesh_spec os;
    mesh_spec_init(&os, 3);
    set_dim(&os, 0, &tokens->spec, 0);
    set_dim(&os, 1, &tokens->spec, 1);
    os.partial = vocab;
    st = new_out(t, name, 3, shape, &os, out);
    size_t rshape[3] = {(size_t)rows.local[0], (size_t)rows.local[1], (size_t)rows.local[2]};
    if (!st && gathered)
        st = embed_rows_allgather(c, &rows, &rs, ex, true, &(*out)->val, sim_meta_counted(sim_meta_tag(tag), gdt));
    else if (!st)
        st = sim_all_to_all_dims(c->dev, rows.data, (*out)->val.data, 3, rshape, 0, 2, SIM_F32, ex,
                                 sim_meta_counted(sim_meta_tag(tag), gdt));
    mesh_array_free(c->dev, &rows);
    if (st) {
        mesh_array_free(c->dev, &ids);
        return st;
    }
    mesh_nn_cost_memory(t, 2.0 * (double)(*out)->val.nlocal, tag); /* the rows looked up, then written */
    mesh_entry *e = mesh_tape_record(t, embed_a2a_vjp, tag, 1, &table, 1, out);
    keep(t, e, &ids, true);
    keep(t, e, tokens, false);
    return SIM_OK;
}

sim_status mesh_nn_embed(mesh_tape *t, mesh_var *table, const mesh_array *tokens, const char *name, mesh_var **out)
{
    mesh_ctx *c = mesh_tape_ctx(t);
    char tag[SIM_TAG_MAX];
    mesh_tape_tag(t, name, tag, sizeof tag);
    bool gathered;
    sim_axes ex = embed_a2a_axes(c, &table->val.spec, &tokens->spec, &gathered);
    if (ex.n) return embed_a2a(t, table, tokens, ex, gathered, name, tag, out);
    /* axes that shard the tokens cannot also split the table: gather them out */
    uint32_t used = mesh_spec_dim_axes(&tokens->spec);
    mesh_spec ts = table->val.spec;
    ts.partial = 0;
    for (int d = 0; d < 2; d++) {
        int n = 0;
        for (int i = 0; i < ts.n_axes[d]; i++)
            if (!(used & (1u << ts.axes[d][i]))) ts.axes[d][n++] = ts.axes[d][i];
            else break; /* keep a prefix so blocks stay contiguous */
        ts.n_axes[d] = n;
    }
    mesh_array ta;
    bool to;
    SIM_TRY(mesh_nn_operand(t, &table->val, &ts, tag, &ta, &to));
    mesh_spec os;
    mesh_spec_init(&os, 3);
    set_dim(&os, 0, &tokens->spec, 0);
    set_dim(&os, 1, &tokens->spec, 1);
    set_dim(&os, 2, &ts, 1);
    for (int i = 0; i < ts.n_axes[0]; i++) os.partial |= 1u << ts.axes[0][i];
    int64_t shape[3] = {tokens->shape[0], tokens->shape[1], ta.shape[1]};
    SIM_TRY(new_out(t, name, 3, shape, &os, out));
    if (ta.data) {
        mesh_dim_shard sh[MESH_SPEC_MAX_RANK];
        mesh_spec_shard(&ts, c->mesh, ta.shape, sim_device_id(c->dev), sh);
        bk_embedding_fwd((*out)->val.data, tokens->data, ta.data, (int)tokens->nlocal, (int)ta.local[1],
                         (int)sh[0].offset, (int)ta.local[0]);
    }
    mesh_nn_cost_memory(t, 2.0 * (double)(*out)->val.nlocal, tag); /* the rows gathered, then written */
    mesh_entry *e = mesh_tape_record(t, embed_vjp, tag, 1, &table, 1, out);
    keep(t, e, &ta, to);
    keep(t, e, tokens, false);
    return SIM_OK;
}

/* ------------------------------------------------------------ cross-entropy */

static sim_status xent_vjp(mesh_tape *t, mesh_entry *e)
{
    mesh_ctx *c = mesh_tape_ctx(t);
    mesh_var *logits = e->in[0], *y = e->out[0];
    const mesh_array *la = &e->saved[0], *tg = &e->saved[1], *lse = &e->saved[2];
    mesh_array *dy = &y->grad, dl;
    mesh_spec ds = la->spec;
    ds.partial = dy->spec.partial;
    /* the kernel writes every element: no zeroing (the logits' size, the largest cotangent) */
    SIM_TRY(new_cot_raw(t, "xent/dlogits", 3, la->shape, &ds, &dl));
    if (dy->data) {
        mesh_dim_shard sh[MESH_SPEC_MAX_RANK];
        mesh_spec_shard(&la->spec, c->mesh, la->shape, sim_device_id(c->dev), sh);
        bk_xent_bwd_local_into(dl.data, dy->data, la->data, lse->data, tg->data, (int)tg->nlocal, (int)la->local[2],
                               (int)sh[2].offset, (float)e->f[0]);
    } else if (dl.data) {
        memset(dl.data, 0, dl.nlocal * sizeof(float));
    }
    mesh_nn_cost_memory_bwd(t, e, 2.0 * (double)la->nlocal); /* logits read, dlogits written */
    char tag[SIM_TAG_MAX];
    return mesh_tape_accumulate(t, logits, &dl, mesh_tape_tag(t, "xent/dlogits", tag, sizeof tag));
}

sim_status mesh_nn_xent(mesh_tape *t, mesh_var *logits, const mesh_array *targets, double z_loss, const char *name,
                        mesh_var **loss)
{
    mesh_ctx *c = mesh_tape_ctx(t);
    char tag[SIM_TAG_MAX];
    mesh_tape_tag(t, name, tag, sizeof tag);
    mesh_spec ls = logits->val.spec;
    ls.partial = 0;
    mesh_spec ts;
    mesh_spec_init(&ts, 2);
    set_dim(&ts, 0, &ls, 0);
    set_dim(&ts, 1, &ls, 1);
    mesh_array la, tg, lse;
    bool lo, tgo;
    SIM_TRY(mesh_nn_operand(t, &logits->val, &ls, tag, &la, &lo));
    SIM_TRY(mesh_nn_operand(t, targets, &ts, tag, &tg, &tgo));
    SIM_TRY(new_out(t, name, 2, targets->shape, &ts, loss));
    SIM_TRY(mesh_array_new(c->dev, c->mesh, "xent/lse", 2, targets->shape, &ts, SIM_F32, SIM_MEM_ACTIVATIONS, &lse));
    /* the loss, its row sums and their collectives have the logits' dtype (float32 after
     * cast_logits_to_fp32, MaxText's default) */
    if (logits->val.counted_fixed) {
        mesh_array_recount(c->dev, &(*loss)->val, logits->val.counted);
        mesh_array_recount(c->dev, &lse, logits->val.counted);
    }
    sim_meta rows_meta = mesh_array_meta(&logits->val, sim_meta_tag(tag));
    sim_axes xv = dim_axes(&ls, 2);
    int k = sim_mesh_group_size(sim_machine_mesh(sim_device_machine(c->dev)), xv);
    int64_t N = (int64_t)tg.nlocal, V = la.local[2];
    /* scratch: k gathered row maxima, then [sum of exp, target logit] per row */
    size_t scratch = (size_t)(k + 2) * (size_t)N * sizeof(float);
    float *m = NULL;
    SIM_TRY(sim_arena_alloc(sim_device_arena(c->dev), scratch, SIM_MEM_TEMP, "xent/scratch", false, (void **)&m));
    float *st = m ? m + N * k : NULL;
    mesh_dim_shard sh[MESH_SPEC_MAX_RANK];
    mesh_spec_shard(&ls, c->mesh, la.shape, sim_device_id(c->dev), sh);
    float *mloc = NULL;
    if (la.data) {
        mloc = malloc((size_t)N * sizeof *mloc);
        bk_xent_row_max(mloc, la.data, (int)N, (int)V);
    }
    if (xv.n) {
        /* global row max: gather every shard's maxima (k floats per row) and take the largest */
        SIM_TRY(sim_all_gather(c->dev, mloc, m, (size_t)N, SIM_F32, xv, rows_meta));
        if (la.data)
            for (int64_t n = 0; n < N; n++) {
                float best = m[n];
                for (int q = 1; q < k; q++) best = fmaxf(best, m[(int64_t)q * N + n]);
                mloc[n] = best;
            }
    }
    if (la.data) {
        bk_xent_row_sumexp(st, la.data, mloc, (int)N, (int)V);
        bk_xent_pick_target(st + N, la.data, tg.data, (int)N, (int)V, (int)sh[2].offset);
    }
    if (xv.n) SIM_TRY(sim_all_reduce(c->dev, st, st, 2 * (size_t)N, SIM_F32, xv, rows_meta));
    if (la.data) bk_xent_combine((*loss)->val.data, lse.data, mloc, st, st + N, (int)N, (float)z_loss);
    free(mloc);
    sim_arena_release(sim_device_arena(c->dev), m, scratch, SIM_MEM_TEMP);
    mesh_nn_cost_memory(t, (double)la.nlocal, tag); /* the logits read (max, sum of exp and target fused) */
    mesh_entry *e = mesh_tape_record(t, xent_vjp, tag, 1, &logits, 1, loss);
    if (e) e->f[0] = z_loss;
    keep(t, e, &la, lo);
    keep(t, e, &tg, tgo);
    keep(t, e, &lse, true);
    return SIM_OK;
}

/* ------------------------------------------------------------ SwiGLU */

/* e->i[0]: 0 silu (SwiGLU), 1 gelu (GeGLU) */
static sim_status swiglu_vjp(mesh_tape *t, mesh_entry *e)
{
    mesh_var *gate = e->in[0], *up = e->in[1], *y = e->out[0];
    const mesh_array *ga = &e->saved[0], *ua = &e->saved[1];
    mesh_array *dy = &y->grad, dg, du;
    /* the kernel writes every element: no zeroing */
    SIM_TRY(new_cot_raw(t, "swiglu/dgate", dy->rank, dy->shape, &dy->spec, &dg));
    SIM_TRY(new_cot_raw(t, "swiglu/dup", dy->rank, dy->shape, &dy->spec, &du));
    if (dy->data) {
        if (e->i[0] == 1) bk_geglu_bwd_into(dg.data, du.data, dy->data, ga->data, ua->data, dy->nlocal);
        else bk_swiglu_bwd_into(dg.data, du.data, dy->data, ga->data, ua->data, dy->nlocal);
    } else if (dg.data) {
        memset(dg.data, 0, dg.nlocal * sizeof(float));
        memset(du.data, 0, du.nlocal * sizeof(float));
    }
    mesh_nn_cost_memory_bwd(t, e, 5.0 * (double)dy->nlocal); /* gate, up, dy read; dgate, dup written */
    char tag[SIM_TAG_MAX];
    SIM_TRY(mesh_tape_accumulate(t, gate, &dg, mesh_tape_tag(t, "swiglu/dgate", tag, sizeof tag)));
    return mesh_tape_accumulate(t, up, &du, mesh_tape_tag(t, "swiglu/dup", tag, sizeof tag));
}

static sim_status glu(mesh_tape *t, mesh_var *gate, mesh_var *up, int kind, const char *name, mesh_var **out)
{
    char tag[SIM_TAG_MAX];
    mesh_tape_tag(t, name, tag, sizeof tag);
    mesh_spec s = gate->val.spec;
    s.partial = 0;
    mesh_array ga, ua;
    bool go, uo;
    SIM_TRY(mesh_nn_operand(t, &gate->val, &s, tag, &ga, &go));
    SIM_TRY(mesh_nn_operand(t, &up->val, &s, tag, &ua, &uo));
    SIM_TRY(new_out(t, name, ga.rank, ga.shape, &s, out));
    if (ga.data) {
        if (kind == 1) bk_geglu_fwd((*out)->val.data, ga.data, ua.data, ga.nlocal);
        else bk_swiglu_fwd((*out)->val.data, ga.data, ua.data, ga.nlocal);
    }
    mesh_nn_cost_memory(t, 3.0 * (double)ga.nlocal, tag); /* gate, up read, out written */
    mesh_var *in[2] = {gate, up};
    mesh_entry *e = mesh_tape_record(t, swiglu_vjp, tag, 2, in, 1, out);
    if (e) e->i[0] = kind;
    keep(t, e, &ga, go);
    keep(t, e, &ua, uo);
    return SIM_OK;
}

sim_status mesh_nn_swiglu(mesh_tape *t, mesh_var *gate, mesh_var *up, const char *name, mesh_var **out)
{
    return glu(t, gate, up, 0, name, out);
}

sim_status mesh_nn_geglu(mesh_tape *t, mesh_var *gate, mesh_var *up, const char *name, mesh_var **out)
{
    return glu(t, gate, up, 1, name, out);
}

/* ------------------------------------------------------------ bfloat16 round trip */

static sim_status round_bf16_vjp(mesh_tape *t, mesh_entry *e)
{
    mesh_var *x = e->in[0], *y = e->out[0];
    mesh_ctx *c = mesh_tape_ctx(t);
    char tag[SIM_TAG_MAX];
    mesh_tape_tag(t, "round_bf16/dx", tag, sizeof tag);
    /* the convert rounds the summed cotangent: partial sums are reduced first */
    mesh_array g = y->grad;
    y->has_grad = false;
    if (g.spec.partial) {
        mesh_spec s = g.spec;
        s.partial = 0;
        SIM_TRY(mesh_reshard(c->dev, c->mesh, &g, &s, sim_meta_tag(tag)));
    }
    if (g.data) bk_round_bf16(g.data, g.data, g.nlocal);
    mesh_nn_cost_memory_bwd(t, e, 2.0 * (double)g.nlocal);
    return mesh_tape_accumulate(t, x, &g, tag);
}

sim_status mesh_nn_round_bf16(mesh_tape *t, mesh_var *x, const char *name, mesh_var **out)
{
    char tag[SIM_TAG_MAX];
    mesh_tape_tag(t, name, tag, sizeof tag);
    mesh_spec s = x->val.spec;
    s.partial = 0; /* rounding needs the summed value */
    mesh_array xa;
    bool xo;
    SIM_TRY(mesh_nn_operand(t, &x->val, &s, tag, &xa, &xo));
    SIM_TRY(new_out(t, name, xa.rank, xa.shape, &s, out));
    if (xa.data) bk_round_bf16((*out)->val.data, xa.data, xa.nlocal);
    if (xo) mesh_array_free(mesh_tape_ctx(t)->dev, &xa);
    mesh_nn_cost_memory(t, 2.0 * (double)(*out)->val.nlocal, tag);
    mesh_tape_record(t, round_bf16_vjp, tag, 1, &x, 1, out);
    return SIM_OK;
}

/* ------------------------------------------------------------ soft cap */

static sim_status softcap_vjp(mesh_tape *t, mesh_entry *e)
{
    mesh_var *x = e->in[0], *y = e->out[0];
    mesh_array *dy = &y->grad, dx;
    SIM_TRY(new_cot(t, "softcap/dx", dy->rank, dy->shape, &dy->spec, &dx));
    if (dy->data) bk_softcap_bwd(dx.data, dy->data, y->val.data, dy->nlocal, (float)e->f[0], (float)e->f[1]);
    char tag[SIM_TAG_MAX];
    return mesh_tape_accumulate(t, x, &dx, mesh_tape_tag(t, "softcap/dx", tag, sizeof tag));
}

sim_status mesh_nn_softcap(mesh_tape *t, mesh_var *x, double a, double cap, const char *name, mesh_var **out)
{
    char tag[SIM_TAG_MAX];
    mesh_tape_tag(t, name, tag, sizeof tag);
    mesh_spec s = x->val.spec;
    s.partial = 0; /* tanh needs the summed value */
    mesh_array xa;
    bool xo;
    SIM_TRY(mesh_nn_operand(t, &x->val, &s, tag, &xa, &xo));
    SIM_TRY(new_out(t, name, xa.rank, xa.shape, &s, out));
    if (xa.data) bk_softcap_fwd((*out)->val.data, xa.data, xa.nlocal, (float)a, (float)cap);
    if (xo) mesh_array_free(mesh_tape_ctx(t)->dev, &xa);
    mesh_entry *e = mesh_tape_record(t, softcap_vjp, tag, 1, &x, 1, out);
    if (e) e->f[0] = a, e->f[1] = cap;
    return SIM_OK;
}

/* ------------------------------------------------------------ unstack */

/* Copies between x's local block (outer, 2, inner) and the two (outer, inner) halves. */
static void unstack_copy(float *x, float *a, float *b, int64_t outer, int64_t inner, bool to_halves, bool acc)
{
    for (int64_t o = 0; o < outer; o++) {
        float *x0 = x + (size_t)(2 * o) * (size_t)inner, *x1 = x0 + inner;
        float *h0 = a + (size_t)o * (size_t)inner, *h1 = b + (size_t)o * (size_t)inner;
        if (to_halves) {
            memcpy(h0, x0, (size_t)inner * sizeof *x);
            memcpy(h1, x1, (size_t)inner * sizeof *x);
        } else if (acc) {
            for (int64_t i = 0; i < inner; i++) x0[i] += h0[i], x1[i] += h1[i];
        }
    }
}

static sim_status unstack_vjp(mesh_tape *t, mesh_entry *e)
{
    mesh_var *x = e->in[0], *y0 = e->out[0], *y1 = e->out[1];
    int dim = (int)e->i[0];
    mesh_ctx *c = mesh_tape_ctx(t);
    char tag[SIM_TAG_MAX];
    mesh_tape_tag(t, "unstack/dx", tag, sizeof tag);
    /* both cotangents in the halves' sharding (keeping partial axes), then interleaved into dx */
    mesh_spec hs = e->saved[0].spec;
    uint32_t P = (y0->has_grad ? y0->grad.spec.partial : 0) | (y1->has_grad ? y1->grad.spec.partial : 0);
    hs.partial = P;
    mesh_array g[2];
    mesh_var *ys[2] = {y0, y1};
    for (int k = 0; k < 2; k++) {
        if (ys[k]->has_grad) {
            g[k] = ys[k]->grad;
            ys[k]->has_grad = false;
            if (!mesh_spec_equal(&g[k].spec, &hs))
                SIM_TRY(mesh_reshard(c->dev, c->mesh, &g[k], &hs, sim_meta_tag(tag)));
        } else SIM_TRY(new_cot(t, "unstack/zero", e->saved[0].rank, e->saved[0].shape, &hs, &g[k]));
    }
    mesh_spec xs = x->val.spec;
    xs.partial = P;
    mesh_array dx;
    SIM_TRY(new_cot(t, "unstack/dx", x->val.rank, x->val.shape, &xs, &dx));
    if (dx.data) {
        int64_t outer = 1, inner = 1;
        for (int d = 0; d < dim; d++) outer *= dx.local[d];
        for (int d = dim + 1; d < dx.rank; d++) inner *= dx.local[d];
        unstack_copy(dx.data, g[0].data, g[1].data, outer, inner, false, true);
    }
    mesh_array_free(c->dev, &g[0]);
    mesh_array_free(c->dev, &g[1]);
    return mesh_tape_accumulate(t, x, &dx, tag);
}

sim_status mesh_nn_unstack2(mesh_tape *t, mesh_var *x, int dim, const char *name, mesh_var **y0, mesh_var **y1)
{
    SIM_ASSERT(dim >= 0 && dim < x->val.rank && x->val.shape[dim] == 2);
    char tag[SIM_TAG_MAX];
    mesh_tape_tag(t, name, tag, sizeof tag);
    mesh_spec s = x->val.spec;
    s.partial = 0;
    s.n_axes[dim] = 0; /* the stacked dim whole on every device */
    mesh_array xa;
    bool xo;
    SIM_TRY(mesh_nn_operand(t, &x->val, &s, tag, &xa, &xo));
    int64_t shape[MESH_SPEC_MAX_RANK];
    mesh_spec hs;
    mesh_spec_init(&hs, xa.rank - 1);
    for (int d = 0, r = 0; d < xa.rank; d++) {
        if (d == dim) continue;
        shape[r] = xa.shape[d];
        set_dim(&hs, r, &s, d);
        r++;
    }
    SIM_TRY(new_out(t, name, xa.rank - 1, shape, &hs, y0));
    SIM_TRY(new_out(t, name, xa.rank - 1, shape, &hs, y1));
    if (xa.data) {
        int64_t outer = 1, inner = 1;
        for (int d = 0; d < dim; d++) outer *= xa.local[d];
        for (int d = dim + 1; d < xa.rank; d++) inner *= xa.local[d];
        unstack_copy(xa.data, (*y0)->val.data, (*y1)->val.data, outer, inner, true, false);
    }
    mesh_var *outs[2] = {*y0, *y1};
    mesh_entry *e = mesh_tape_record(t, unstack_vjp, tag, 1, &x, 2, outs);
    if (e) {
        e->i[0] = dim;
        mesh_array shape_only = (*y0)->val; /* the halves' global shape and spec, for the VJP */
        shape_only.data = NULL;
        shape_only.nlocal = 0;
        mesh_entry_save(e, &shape_only, false);
    }
    if (xo) mesh_array_free(mesh_tape_ctx(t)->dev, &xa);
    return SIM_OK;
}

/* ------------------------------------------------------------ split inside each shard */

enum { SPLIT_MAX = 2 }; /* a tape entry has at most two outputs */

/* Copies between x's local block (outer, sum of w[j], inner) and the parts (outer, w[j], inner). */
static void split_copy(float *x, float *const *parts, int n, const int64_t *w, int64_t outer, int64_t inner,
                       bool to_parts)
{
    int64_t total = 0;
    for (int j = 0; j < n; j++) total += w[j];
    for (int64_t o = 0; o < outer; o++) {
        int64_t at = 0;
        for (int j = 0; j < n; j++) {
            float *xs = x + (size_t)(o * total + at) * (size_t)inner,
                  *ps = parts[j] + (size_t)(o * w[j]) * (size_t)inner;
            size_t len = (size_t)(w[j] * inner);
            if (to_parts) memcpy(ps, xs, len * sizeof *x);
            else
                for (size_t i = 0; i < len; i++) xs[i] += ps[i];
            at += w[j];
        }
    }
}

static sim_status split_vjp(mesh_tape *t, mesh_entry *e)
{
    mesh_var *x = e->in[0];
    int dim = (int)e->i[0], n = e->nout;
    mesh_ctx *c = mesh_tape_ctx(t);
    char tag[SIM_TAG_MAX];
    mesh_tape_tag(t, "split/dx", tag, sizeof tag);
    uint32_t P = 0;
    for (int j = 0; j < n; j++)
        if (e->out[j]->has_grad) P |= e->out[j]->grad.spec.partial;
    mesh_spec ps = x->val.spec;
    ps.partial = P;
    mesh_array g[SPLIT_MAX];
    float *gd[SPLIT_MAX];
    int64_t w[SPLIT_MAX];
    for (int j = 0; j < n; j++) {
        mesh_var *y = e->out[j];
        if (y->has_grad) {
            g[j] = y->grad;
            y->has_grad = false;
            if (!mesh_spec_equal(&g[j].spec, &ps))
                SIM_TRY(mesh_reshard(c->dev, c->mesh, &g[j], &ps, sim_meta_tag(tag)));
        } else SIM_TRY(new_cot(t, "split/zero", y->val.rank, y->val.shape, &ps, &g[j]));
        gd[j] = g[j].data;
        w[j] = g[j].local[dim];
    }
    mesh_array dx;
    SIM_TRY(new_cot(t, "split/dx", x->val.rank, x->val.shape, &ps, &dx));
    if (dx.data) {
        int64_t outer = 1, inner = 1;
        for (int d = 0; d < dim; d++) outer *= dx.local[d];
        for (int d = dim + 1; d < dx.rank; d++) inner *= dx.local[d];
        split_copy(dx.data, gd, n, w, outer, inner, false);
    }
    for (int j = 0; j < n; j++) mesh_array_free(c->dev, &g[j]);
    return mesh_tape_accumulate(t, x, &dx, tag);
}

sim_status mesh_nn_split_local(mesh_tape *t, mesh_var *x, int dim, int n, const int64_t *sizes, const char *name,
                               mesh_var **ys)
{
    SIM_ASSERT(dim >= 0 && dim < x->val.rank && n >= 1 && n <= SPLIT_MAX);
    mesh_ctx *c = mesh_tape_ctx(t);
    int64_t shards = 1, total = 0;
    for (int i = 0; i < x->val.spec.n_axes[dim]; i++) shards *= c->mesh->sizes[x->val.spec.axes[dim][i]];
    for (int j = 0; j < n; j++) {
        if (sizes[j] % shards)
            return sim_err(SIM_ERR_INPUT,
                           "%s: part %d of dim %d has %lld entries, which %lld shards of that dim cannot split evenly "
                           "(each shard splits its own block); change the mesh or the sizes",
                           name, j, dim, (long long)sizes[j], (long long)shards);
        total += sizes[j];
    }
    SIM_ASSERT(total == x->val.shape[dim]);
    char tag[SIM_TAG_MAX];
    mesh_tape_tag(t, name, tag, sizeof tag);
    mesh_spec s = x->val.spec;
    s.partial = 0;
    mesh_array xa;
    bool xo;
    SIM_TRY(mesh_nn_operand(t, &x->val, &s, tag, &xa, &xo));
    float *pd[SPLIT_MAX];
    int64_t w[SPLIT_MAX];
    for (int j = 0; j < n; j++) {
        int64_t shape[MESH_SPEC_MAX_RANK];
        memcpy(shape, xa.shape, sizeof(int64_t) * (size_t)xa.rank);
        shape[dim] = sizes[j];
        SIM_TRY(new_out(t, name, xa.rank, shape, &s, &ys[j]));
        pd[j] = ys[j]->val.data;
        w[j] = sizes[j] / shards;
    }
    if (xa.data) {
        int64_t outer = 1, inner = 1;
        for (int d = 0; d < dim; d++) outer *= xa.local[d];
        for (int d = dim + 1; d < xa.rank; d++) inner *= xa.local[d];
        split_copy(xa.data, pd, n, w, outer, inner, true);
    }
    mesh_entry *e = mesh_tape_record(t, split_vjp, tag, 1, &x, n, ys);
    if (e) e->i[0] = dim;
    if (xo) mesh_array_free(c->dev, &xa);
    return SIM_OK;
}

/* ------------------------------------------------------------ dropout */

/* The global offsets of this device's block of a (shape, spec) array. */
static void block_offsets(mesh_tape *t, const mesh_array *a, int64_t *off)
{
    mesh_ctx *c = mesh_tape_ctx(t);
    mesh_dim_shard sh[MESH_SPEC_MAX_RANK];
    mesh_spec_shard(&a->spec, c->mesh, a->shape, sim_device_id(c->dev), sh);
    for (int d = 0; d < a->rank; d++) off[d] = sh[d].offset;
}

static sim_status dropout_vjp(mesh_tape *t, mesh_entry *e)
{
    mesh_var *x = e->in[0], *y = e->out[0];
    mesh_array *dy = &y->grad, dx;
    /* the mask lives on y's blocks: bring the cotangent there, keeping its partial axes */
    mesh_spec s = y->val.spec;
    s.partial |= dy->spec.partial;
    mesh_ctx *c = mesh_tape_ctx(t);
    char tag[SIM_TAG_MAX];
    mesh_tape_tag(t, "dropout/dx", tag, sizeof tag);
    if (!mesh_spec_equal(&dy->spec, &s)) SIM_TRY(mesh_reshard(c->dev, c->mesh, dy, &s, sim_meta_tag(tag)));
    SIM_TRY(new_cot(t, "dropout/dx", dy->rank, dy->shape, &dy->spec, &dx));
    if (dy->data) {
        int64_t off[MESH_SPEC_MAX_RANK];
        block_offsets(t, dy, off);
        bk_dropout_bwd(dx.data, dy->data, dy->rank, dy->local, off, dy->shape, (int)e->i[0], (uint64_t)e->i[1],
                       e->f[0]);
    }
    return mesh_tape_accumulate(t, x, &dx, tag);
}

sim_status mesh_nn_dropout(mesh_tape *t, mesh_var *x, double rate, uint64_t key, int bcast, const char *name,
                           mesh_var **out)
{
    if (rate <= 0.0) {
        *out = x;
        return SIM_OK;
    }
    SIM_ASSERT(bcast >= 0 && bcast < x->val.rank);
    char tag[SIM_TAG_MAX];
    mesh_tape_tag(t, name, tag, sizeof tag);
    /* the mask does not depend on the values: partial sums are masked as they are */
    SIM_TRY(new_out(t, name, x->val.rank, x->val.shape, &x->val.spec, out));
    if (x->val.data) {
        int64_t off[MESH_SPEC_MAX_RANK];
        block_offsets(t, &x->val, off);
        bk_dropout_fwd((*out)->val.data, x->val.data, x->val.rank, x->val.local, off, x->val.shape, bcast, key, rate);
    }
    mesh_entry *e = mesh_tape_record(t, dropout_vjp, tag, 1, &x, 1, out);
    if (e) e->f[0] = rate, e->i[0] = bcast, e->i[1] = (int64_t)key;
    return SIM_OK;
}

/* ------------------------------------------------------------ mean */

static sim_status mean_vjp(mesh_tape *t, mesh_entry *e)
{
    mesh_var *x = e->in[0], *y = e->out[0];
    mesh_array *dy = &y->grad, dx;
    mesh_spec s = x->val.spec;
    s.partial = dy->spec.partial & ~mesh_spec_dim_axes(&s);
    SIM_TRY(new_cot(t, "mean/dx", x->val.rank, x->val.shape, &s, &dx));
    if (dx.data) {
        float g = (float)(((const float *)dy->data)[0] / e->f[0]);
        float *o = dx.data;
        for (size_t i = 0; i < dx.nlocal; i++) o[i] = g;
    }
    char tag[SIM_TAG_MAX];
    return mesh_tape_accumulate(t, x, &dx, mesh_tape_tag(t, "mean/dx", tag, sizeof tag));
}

sim_status mesh_nn_mean(mesh_tape *t, mesh_var *x, const char *name, mesh_var **out)
{
    mesh_ctx *c = mesh_tape_ctx(t);
    char tag[SIM_TAG_MAX];
    mesh_tape_tag(t, name, tag, sizeof tag);
    double count = 1;
    for (int d = 0; d < x->val.rank; d++) count *= (double)x->val.shape[d];
    mesh_spec s;
    mesh_spec_init(&s, 0);
    /* the local sum is one addend per block: partial over the axes that split x (and x's own partial axes) */
    s.partial = mesh_spec_dim_axes(&x->val.spec) | x->val.spec.partial;
    SIM_TRY(new_out(t, name, 0, NULL, &s, out));
    if (x->val.counted_fixed) mesh_array_recount(c->dev, &(*out)->val, x->val.counted); /* the input's dtype */
    if (x->val.data) {
        double acc = 0;
        const float *v = x->val.data;
        for (size_t i = 0; i < x->val.nlocal; i++) acc += v[i];
        ((float *)(*out)->val.data)[0] = (float)(acc / count);
    }
    mesh_spec full;
    mesh_spec_init(&full, 0);
    SIM_TRY(mesh_reshard(c->dev, c->mesh, &(*out)->val, &full, sim_meta_tag(tag)));
    mesh_entry *e = mesh_tape_record(t, mean_vjp, tag, 1, &x, 1, out);
    if (e) e->f[0] = count;
    return SIM_OK;
}
