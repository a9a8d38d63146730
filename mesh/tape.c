/* tape.c — the autodiff tape (see tape.h).
 *
 * Vars and entries live in slabs the tape owns (a var per value and an
 * entry per op, on every layer, pass and device: a 256-device dry run of
 * deepseek3-671b made about two million of them with calloc and free, on
 * malloc arenas shared by the device threads).  A freed tape hands its slabs
 * to a free list of its thread, which the next tape takes them from (the
 * per-layer tapes of remat come and go inside the step's tape); the list is
 * emptied when the thread's last tape is freed.  Only spare slabs are shared
 * through the thread: a tape's own objects never move, so devices that share
 * an OS thread (or a tape freed on another thread) at worst keep spares
 * longer. */
#include "mesh/tape.h"

#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "blas_kernels/bk.h"
#include "blas_kernels/bk_parallel.h"
#include "mesh/reshard.h"

/* ---- slabs ---------------------------------------------------------------- */

enum { SLAB_BYTES = 32 << 10, SLAB_ALIGN = 16 };

typedef struct slab {
    struct slab *next;
    size_t used; /* bytes of mem handed out */
    _Alignas(SLAB_ALIGN) unsigned char mem[];
} slab;

#define SLAB_ROOM (SLAB_BYTES - offsetof(slab, mem))
_Static_assert(sizeof(mesh_entry) <= SLAB_ROOM && sizeof(mesh_var) <= SLAB_ROOM, "a slab holds one object at least");

/* this thread's spare slabs and live tapes (a tape is made and freed by its device's thread) */
static _Thread_local slab *spare_slabs;
static _Thread_local int live_tapes;

/* One simulated layer of a stack and the copies it stands for: its entries [e0, e1) and variables
 * [v0, v1); what it left held in the arena per category after its forward (fwd), backward (bwd) and
 * the flush of its parameters' gradients (flush), each copy as much again. */
typedef struct {
    int e0, e1, v0, v1;
    uint64_t times;
    int64_t fwd[SIM_NMEM], bwd[SIM_NMEM], flush[SIM_NMEM], at[SIM_NMEM];
    bool bwd_done, flush_done; /* their copies were accounted (not after an OOM in them) */
} tape_repeat;

struct mesh_tape {
    mesh_ctx *ctx;
    slab *slabs; /* the newest first; objects are never moved or freed one by one */
    bool recording;
    mesh_reshard_cache *cache;
    mesh_var **vars;
    int nvars, capvars;
    mesh_entry **entries;
    int nentries, capentries;
    bool backward; /* a backward pass is running (mesh_tape_single_use) */
    tape_repeat reps[MESH_TAPE_REPEATS]; /* a dry run's layers that stand for more (mesh_tape_repeat_end) */
    int nreps;
};

mesh_tape *mesh_tape_new(mesh_ctx *ctx, bool recording)
{
    mesh_tape *t = calloc(1, sizeof *t);
    SIM_ASSERT(t);
    t->ctx = ctx;
    t->recording = recording;
    t->cache = mesh_reshard_cache_new(ctx->dev);
    live_tapes++;
    return t;
}

/* `bytes` bytes from t's slabs, uninitialised. */
static void *slab_alloc(mesh_tape *t, size_t bytes)
{
    bytes = (bytes + SLAB_ALIGN - 1) / SLAB_ALIGN * SLAB_ALIGN;
    slab *s = t->slabs;
    if (!s || s->used + bytes > SLAB_ROOM) {
        s = spare_slabs;
        if (s) spare_slabs = s->next;
        else {
            s = malloc(SLAB_BYTES);
            SIM_ASSERT(s);
        }
        s->used = 0;
        s->next = t->slabs;
        t->slabs = s;
    }
    void *p = s->mem + s->used;
    s->used += bytes;
    return p;
}

static void slabs_release(slab *list)
{
    while (list) {
        slab *n = list->next;
#ifdef __SANITIZE_ADDRESS__
        free(list); /* no reuse: a var or entry read after its tape is freed stays an ASan error */
#else
        list->next = spare_slabs;
        spare_slabs = list;
#endif
        list = n;
    }
    if (--live_tapes <= 0) { /* nothing left on this thread to reuse them */
        live_tapes = 0;
        while (spare_slabs) {
            slab *n = spare_slabs->next;
            free(spare_slabs);
            spare_slabs = n;
        }
    }
}

mesh_ctx *mesh_tape_ctx(mesh_tape *t) { return t->ctx; }
mesh_reshard_cache *mesh_tape_cache(mesh_tape *t) { return t->cache; }

const char *mesh_tape_tag(mesh_tape *t, const char *name, char *buf, size_t cap)
{
    const char *layer = t->ctx->layer;
    size_t n = 0;
    if (cap) buf[0] = '\0';
    if (layer && *layer) n = sim_str_put(buf, cap, sim_str_put(buf, cap, 0, layer, SIZE_MAX), "/", 1);
    sim_str_put(buf, cap, n, name, SIZE_MAX);
    return buf;
}
bool mesh_tape_recording(const mesh_tape *t) { return t->recording; }

static void free_grad(mesh_tape *t, mesh_var *v)
{
    if (v->has_grad) mesh_array_free(t->ctx->dev, &v->grad);
    v->has_grad = false;
}

static void free_entry(mesh_tape *t, mesh_entry *e)
{
    for (int i = 0; i < e->nsaved; i++)
        if (e->saved_owned[i]) mesh_array_free(t->ctx->dev, &e->saved[i]);
    if (e->payload && e->free_payload) e->free_payload(e->payload);
}

void mesh_tape_free(mesh_tape *t)
{
    if (!t) return;
    for (int i = t->nentries - 1; i >= 0; i--) free_entry(t, t->entries[i]);
    for (int i = t->nvars - 1; i >= 0; i--) {
        mesh_var *v = t->vars[i];
        free_grad(t, v);
        if (v->owned) mesh_array_free(t->ctx->dev, &v->val);
    }
    slabs_release(t->slabs);
    mesh_reshard_cache_free(t->cache);
    /* the copies of a repeated layer held what the simulated one held until now: released with it
     * (only releases happen here, so no peak moves) */
    sim_arena *arena = sim_device_arena(t->ctx->dev);
    for (int r = 0; r < t->nreps; r++)
        for (int c = 0; c < SIM_NMEM; c++) {
            const tape_repeat *p = &t->reps[r];
            int64_t held = p->fwd[c] + (p->bwd_done ? p->bwd[c] : 0) + (p->flush_done ? p->flush[c] : 0);
            if (held > 0) sim_arena_discharge(arena, (size_t)held * p->times, (sim_mem_cat)c);
        }
    free(t->entries);
    free(t->vars);
    free(t);
}

static mesh_var *add_var(mesh_tape *t)
{
    if (t->nvars == t->capvars) {
        t->capvars = t->capvars ? 2 * t->capvars : 64;
        t->vars = realloc(t->vars, (size_t)t->capvars * sizeof *t->vars);
        SIM_ASSERT(t->vars);
    }
    mesh_var *v = slab_alloc(t, sizeof *v);
    memset(v, 0, sizeof *v); /* as calloc gave it */
    v->id = t->nvars;
    t->vars[t->nvars++] = v;
    return v;
}

mesh_var *mesh_tape_input(mesh_tape *t, const mesh_array *val, bool needs_grad)
{
    mesh_var *v = add_var(t);
    v->val = *val;
    v->needs_grad = needs_grad;
    return v;
}

mesh_var *mesh_tape_param(mesh_tape *t, const mesh_array *val, mesh_array *sink)
{
    mesh_var *v = mesh_tape_input(t, val, sink != NULL);
    v->sink = sink;
    return v;
}

mesh_var *mesh_tape_var(mesh_tape *t)
{
    mesh_var *v = add_var(t);
    v->owned = true;
    return v;
}

mesh_array mesh_tape_take(mesh_tape *t, mesh_var *v)
{
    (void)t;
    mesh_array a = v->val;
    v->owned = false;
    memset(&v->val, 0, sizeof v->val);
    return a;
}

mesh_entry *mesh_tape_record(mesh_tape *t, mesh_vjp_fn vjp, const char *tag, int nin, mesh_var *const *in, int nout,
                             mesh_var *const *out)
{
    SIM_ASSERT(nin <= MESH_ENTRY_MAX_IN && nout <= 2);
    bool need = false;
    for (int i = 0; i < nin; i++) need |= in[i] && in[i]->needs_grad;
    if (!t->recording || !need) return NULL;
    for (int i = 0; i < nout; i++) out[i]->needs_grad = true;
    if (t->nentries == t->capentries) {
        t->capentries = t->capentries ? 2 * t->capentries : 64;
        t->entries = realloc(t->entries, (size_t)t->capentries * sizeof *t->entries);
        SIM_ASSERT(t->entries);
    }
    mesh_entry *e = slab_alloc(t, sizeof *e);
    /* zeroed but for saved[], which holds nsaved arrays (8 mesh_arrays: nine tenths of an entry) */
    memset(e, 0, offsetof(mesh_entry, saved));
    memset(e->saved_owned, 0, sizeof *e - offsetof(mesh_entry, saved_owned));
    e->vjp = vjp;
    sim_str_put(e->tag, sizeof e->tag, 0, tag, SIZE_MAX);
    e->nin = nin;
    e->nout = nout;
    for (int i = 0; i < nin; i++) e->in[i] = in[i];
    for (int i = 0; i < nout; i++) e->out[i] = out[i];
    t->entries[t->nentries++] = e;
    return e;
}

void mesh_entry_save(mesh_entry *e, const mesh_array *a, bool owned)
{
    SIM_ASSERT(e->nsaved < MESH_ENTRY_MAX_SAVED);
    e->saved[e->nsaved] = *a;
    e->saved_owned[e->nsaved++] = owned;
}

sim_status mesh_tape_zeros(mesh_tape *t, const char *name, int rank, const int64_t *shape, const mesh_spec *spec,
                           sim_mem_cat cat, mesh_array *out)
{
    /* zero-filled on the kernel pool: cotangents (attention dq/dk/dv, RoPE dx, ...) are large */
    SIM_TRY(mesh_array_new_raw(t->ctx->dev, t->ctx->mesh, name, rank, shape, spec, SIM_F32, cat, out));
    bk_parallel_zero(out->data, out->nlocal * sizeof(float));
    return SIM_OK;
}

typedef struct {
    float *y;
    const float *x;
} add_job;

BK_CLONES static void add_chunk(int64_t lo, int64_t hi, void *arg)
{
    add_job *j = arg;
    float *restrict y = j->y; /* restrict locals and wide vectors (bk.h): same bits, fewer instructions */
    const float *restrict x = j->x;
    for (int64_t i = lo; i < hi; i++) y[i] += x[i];
}

void mesh_local_add(mesh_array *y, const mesh_array *x)
{
    SIM_ASSERT(y->nlocal == x->nlocal);
    mesh_array_owned(y);
    if (!y->data || !x->data) return;
    add_job j = {y->data, x->data};
    bk_parallel_for((int64_t)y->nlocal, 1 << 16, add_chunk, &j);
}

/* g resharded to spec `to` (dims and partial set). */
static sim_status reshard_to(mesh_tape *t, mesh_array *g, const mesh_spec *to, const char *tag, bool weight)
{
    if (mesh_spec_equal(&g->spec, to)) return SIM_OK;
    sim_meta meta = sim_meta_tag(tag);
    meta.weight = weight; /* a weight gradient's reduction: deferred by XLA, off the critical path */
    meta.single_use = weight && t->ctx->single_use; /* made by one product (an einsum's weight gradient) */
    if (meta.single_use) {                          /* that product (mesh_ad's contribute) */
        meta.product_flops = t->ctx->product_flops;
        meta.product_other_bytes = t->ctx->product_other_bytes;
    }
    meta.psum = weight && t->ctx->psum_grads;
    return mesh_reshard(t->ctx->dev, t->ctx->mesh, g, to, meta);
}

/* The spec a cotangent of v is brought to before use: v's dims, plus the
 * partial axes of the cotangent that v does not shard. */
static mesh_spec canonical(const mesh_var *v, uint32_t partial)
{
    mesh_spec to = v->val.spec;
    to.partial = partial & ~mesh_spec_dim_axes(&v->val.spec);
    return to;
}

/* A cotangent has its primal's dtype: a value counted in a fixed dtype
 * (float32 logits, say) has a gradient counted in it too.  True when it did. */
static bool count_as_primal(mesh_tape *t, const mesh_var *v, mesh_array *g)
{
    if (!v->val.counted_fixed) return false;
    if (g->counted != v->val.counted || !g->counted_fixed) mesh_array_recount(t->ctx->dev, g, v->val.counted);
    return true;
}

sim_status mesh_tape_accumulate(mesh_tape *t, mesh_var *v, mesh_array *g, const char *tag)
{
    mesh_array_owned(g); /* the tape keeps it as the gradient or adds into it */
    if (!v->needs_grad) {
        mesh_array_free(t->ctx->dev, g);
        return SIM_OK;
    }
    /* a parameter's gradient is reduced in the sink's dtype where the compiler casts back to
     * weight_dtype before the reduction (XLA:CPU: MaxText's compiled step all-reduces f32), in
     * `dtype` where it reduces first (XLA:TPU: bf16 reduce-scatters, then the add into float32) --
     * opts.counted_grad_reduce, from the hardware profile (SIM_F32: the sink's dtype) */
    if (!count_as_primal(t, v, g) && v->sink) {
        sim_dtype want = mesh_array_reduce_dtype(t->ctx->dev, v->sink->counted);
        if (g->counted != want || !g->counted_fixed) mesh_array_recount(t->ctx->dev, g, want);
    }
    char leaf_tag[SIM_TAG_MAX];
    mesh_spec to;
    if (v->sink) {
        /* a parameter: reduce at once (as a compiler reduce-scatters a weight
         * gradient as soon as it is made) and report it under the parameter */
        sim_str_put(leaf_tag, sizeof leaf_tag, sim_str_put(leaf_tag, sizeof leaf_tag, 0, "grad/", 5), v->sink->name,
                    80);
        tag = leaf_tag;
        to = canonical(v, g->spec.partial | (v->has_grad ? v->grad.spec.partial : 0));
    } else if (!v->has_grad) {
        /* an activation: keep the contribution as it comes; several partial
         * contributions are added locally and reduced once, when the VJP of
         * v's producer reads the sum (mesh_tape_backward_from) */
        v->grad = *g;
        v->has_grad = true;
        return SIM_OK;
    } else {
        to = v->grad.spec;
        to.partial |= g->spec.partial & ~mesh_spec_dim_axes(&to);
    }
    bool weight = v->sink != NULL;
    sim_status st = reshard_to(t, g, &to, tag, weight);
    if (st == SIM_OK && v->has_grad) st = reshard_to(t, &v->grad, &to, tag, weight); /* widening: free make-partial */
    if (st != SIM_OK) {
        mesh_array_free(t->ctx->dev, g);
        return st;
    }
    if (!v->has_grad) {
        v->grad = *g;
        v->has_grad = true;
        return SIM_OK;
    }
    mesh_local_add(&v->grad, g);
    mesh_array_free(t->ctx->dev, g);
    return SIM_OK;
}

mesh_array *mesh_tape_grad_sum(mesh_var *v) { return v->needs_grad && v->has_grad && !v->sink ? &v->grad : NULL; }

void mesh_tape_accumulated(mesh_tape *t, mesh_var *v, mesh_array *ghost)
{
    /* mesh_tape_accumulate's path for a contribution of v->grad's spec: the recount, no reshard
     * (specs equal), the add (done), the release */
    SIM_ASSERT(mesh_tape_grad_sum(v) && ghost->hold == MESH_HOLD_GHOST && mesh_spec_equal(&ghost->spec, &v->grad.spec));
    count_as_primal(t, v, ghost);
    mesh_array_free(t->ctx->dev, ghost);
}

static void repeats_open(mesh_tape *t, int i, bool flush);
static sim_status repeats_close(mesh_tape *t, int i, bool flush);

static sim_status flush_leaves(mesh_tape *t)
{
    for (int i = 0; i < t->nvars; i++) {
        mesh_var *v = t->vars[i];
        if (t->nreps) {
            repeats_open(t, i, true);
            if (!v->sink || !v->has_grad) {
                SIM_TRY(repeats_close(t, i, true));
                continue;
            }
        }
        if (!v->sink || !v->has_grad) continue;
        char tag[SIM_TAG_MAX];
        sim_str_put(tag, sizeof tag, sim_str_put(tag, sizeof tag, 0, "grad/", 5), v->sink->name, 80);
        SIM_TRY(reshard_to(t, &v->grad, &v->sink->spec, tag, true));
        mesh_local_add(v->sink, &v->grad);
        free_grad(t, v);
        if (t->nreps) SIM_TRY(repeats_close(t, i, true));
    }
    return SIM_OK;
}

/* ------------------------------------------------------------ repeated layers */

static void live_by(const mesh_tape *t, int64_t *out)
{
    sim_arena_stats s;
    sim_arena_get_stats(sim_device_arena(t->ctx->dev), &s);
    for (int c = 0; c < SIM_NMEM; c++) out[c] = (int64_t)s.live_by[c];
}

void mesh_tape_repeat_begin(mesh_tape *t, mesh_tape_mark *m)
{
    m->e0 = t->nentries;
    m->v0 = t->nvars;
    live_by(t, m->live0);
    sim_device_repeat_begin(t->ctx->dev);
}

sim_status mesh_tape_repeat_end(mesh_tape *t, const mesh_tape_mark *m, uint64_t times)
{
    SIM_ASSERT(t->nreps < MESH_TAPE_REPEATS);
    tape_repeat *r = &t->reps[t->nreps++];
    memset(r, 0, sizeof *r);
    r->e0 = m->e0, r->e1 = t->nentries, r->v0 = m->v0, r->v1 = t->nvars;
    r->times = times;
    live_by(t, r->fwd);
    for (int c = 0; c < SIM_NMEM; c++) r->fwd[c] -= m->live0[c];
    /* the copies are the next layers: tags renumbered upwards; after an OOM in them nothing of the
     * copies is held, so the tape has nothing to account for them */
    sim_status st = sim_device_repeat_end_layers(t->ctx->dev, times, 0, 1);
    if (st != SIM_OK) t->nreps--;
    return st;
}

/* Before entry i's backward (or variable i's flush): the blocks that begin there. */
static void repeats_open(mesh_tape *t, int i, bool flush)
{
    for (int r = 0; r < t->nreps; r++) {
        tape_repeat *p = &t->reps[r];
        if ((flush ? p->v0 == p->v1 : p->e0 == p->e1) || i != (flush ? p->v0 : p->e1 - 1)) continue;
        live_by(t, p->at);
        sim_device_repeat_begin(t->ctx->dev);
    }
}

/* After entry i's backward (or variable i's flush): the blocks that end there.  The backward pass
 * meets the layers from the last: its copies are the layers below the simulated one. */
static sim_status repeats_close(mesh_tape *t, int i, bool flush)
{
    sim_status st = SIM_OK;
    for (int r = t->nreps - 1; r >= 0 && st == SIM_OK; r--) {
        tape_repeat *p = &t->reps[r];
        if ((flush ? p->v0 == p->v1 : p->e0 == p->e1) || i != (flush ? p->v1 - 1 : p->e0)) continue;
        int64_t *d = flush ? p->flush : p->bwd;
        live_by(t, d);
        for (int c = 0; c < SIM_NMEM; c++) d[c] -= p->at[c];
        st = flush ? sim_device_repeat_end_layers(t->ctx->dev, p->times, 0, 1)
                   : sim_device_repeat_end_layers(t->ctx->dev, p->times, (int64_t)p->times, -1);
        if (st == SIM_OK) *(flush ? &p->flush_done : &p->bwd_done) = true;
    }
    return st;
}

sim_status mesh_tape_backward_from(mesh_tape *t, mesh_var *out, mesh_array *cot)
{
    mesh_mode saved = t->ctx->mode;
    t->ctx->mode = MESH_MODE_AUTO;
    bool was = t->backward;
    t->backward = true;
    sim_status st = mesh_tape_accumulate(t, out, cot, "backward/seed");
    for (int i = t->nentries - 1; i >= 0 && st == SIM_OK; i--) {
        mesh_entry *e = t->entries[i];
        if (t->nreps) repeats_open(t, i, false);
        bool any = false;
        for (int o = 0; o < e->nout; o++) any |= e->out[o]->has_grad;
        if (!any) {
            if (t->nreps) st = repeats_close(t, i, false);
            continue;
        }
        /* bring each output cotangent to its value's sharding (one reduction for all its contributions) */
        for (int o = 0; o < e->nout && st == SIM_OK; o++) {
            mesh_var *y = e->out[o];
            if (!y->has_grad) continue;
            mesh_spec to = canonical(y, y->grad.spec.partial);
            st = reshard_to(t, &y->grad, &to, e->tag, false);
        }
        if (st == SIM_OK) {
            char name[SIM_TAG_MAX];
            sim_str_put(name, sizeof name, sim_str_put(name, sizeof name, 0, "backward ", 9), e->tag, 80);
            int span = sim_span_begin(t->ctx->dev, name);
            st = e->vjp(t, e);
            sim_span_end(t->ctx->dev, span);
        }
        for (int o = 0; o < e->nout; o++) free_grad(t, e->out[o]);
        if (st == SIM_OK && t->nreps) st = repeats_close(t, i, false);
    }
    if (st == SIM_OK) st = flush_leaves(t);
    t->ctx->mode = saved;
    t->backward = was;
    return st;
}

bool mesh_tape_single_use(const mesh_tape *t)
{
    /* a tape that records nothing runs a layer whose backward recomputes it; a backward pass's own
     * gathers serve the product that asks (what the forward kept is in the cache already) */
    return t && (!t->recording || t->backward);
}

void mesh_tape_mark_regather(mesh_tape *t)
{
    for (int i = 0; t && i < t->nentries; i++) t->entries[i]->regather = true;
}

sim_status mesh_tape_backward(mesh_tape *t, mesh_var *loss)
{
    mesh_array one;
    mesh_spec s;
    mesh_spec_init(&s, 0);
    SIM_TRY(mesh_tape_zeros(t, "loss/grad", 0, NULL, &s, SIM_MEM_TEMP, &one));
    if (one.data) ((float *)one.data)[0] = 1.0f;
    return mesh_tape_backward_from(t, loss, &one);
}
