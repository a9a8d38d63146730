/* ops.c — sharded ops and their sharding rules (see ops.h).
 *
 * Every op has the same shape: (1) work out the spec each operand must have when the local kernel
 * runs and the spec the kernel's output then has — by JAX's rule in explicit mode (or its error),
 * by a search over candidate placements in auto mode; (2) reshard copies of the operands that
 * need it (the caller's arrays are never touched; copies live in the temporaries category);
 * (3) run the kernel on the local shards; (4) reshard the output to out_sharding if one was
 * asked for.  Every device computes the same plan from global information, so the collectives
 * match across the group.
 *
 * The placement search treats every einsum index (every output dim of an elementwise op) as a
 * "letter" and tries, per letter, the shardings the operands and out_sharding give it, plus
 * replicated; a candidate is valid when no mesh axis serves two letters, and costs the bytes of the
 * planner's reshards (operands, and the output when out_sharding is given).  A contraction letter
 * keeps its sharding only when both operands already shard it identically (local product, partial
 * output); auto mode never moves data just to create a partial sum. */
#include "mesh/ops.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "blas_kernels/bk.h"
#include "blas_kernels/bk_einsum.h"
#include "blas_kernels/bk_parallel.h"
#include "config/release.h"
#include "mesh/planmemo.h"
#include "mesh/replay.h"
#include "sim/arena.h"

/* ======================================================================== */
/* text helpers                                                              */
/* ======================================================================== */

typedef struct {
    char *buf;
    int cap;
    int n;
} sbuf;

static void sb_put(sbuf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void sb_put(sbuf *b, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    int room = b->n < b->cap ? b->cap - b->n : 0;
    int k = vsnprintf(room ? b->buf + b->n : NULL, (size_t)room, fmt, ap);
    va_end(ap);
    if (k > 0) b->n += k;
}

static const char *dtype_short(sim_dtype dt)
{
    switch (dt) {
    case SIM_F32: return "f32";
    case SIM_I32: return "i32";
    case SIM_BF16: return "bf16";
    case SIM_U8: return "u8";
    default: return "?";
    }
}

/* Mesh axes of a partial mask as JAX prints a tuple of them: x or (x,y). */
static void sb_axes_mask(sbuf *b, const mesh_shape *m, uint32_t mask)
{
    int cnt = 0;
    for (int a = 0; a < m->n_axes; a++) cnt += (mask >> a) & 1;
    if (cnt > 1) sb_put(b, "(");
    int first = 1;
    for (int a = 0; a < m->n_axes; a++)
        if (mask & (1u << a)) {
            sb_put(b, first ? "%s" : ",%s", m->names[a]);
            first = 0;
        }
    if (cnt > 1) sb_put(b, ")");
}

int mesh_type_format(const mesh_shape *m, sim_dtype dt, int rank, const int64_t *shape, const mesh_spec *s, char *buf,
                     int cap)
{
    sbuf b = {buf, cap, 0};
    if (cap > 0) buf[0] = '\0';
    sb_put(&b, "%s[", dtype_short(dt));
    for (int d = 0; d < rank; d++) {
        sb_put(&b, d ? ",%lld" : "%lld", (long long)shape[d]);
        int n = s->n_axes[d];
        if (n == 1) sb_put(&b, "@%s", m->names[s->axes[d][0]]);
        else if (n > 1) {
            sb_put(&b, "@(");
            for (int j = 0; j < n; j++) sb_put(&b, j ? ",%s" : "%s", m->names[s->axes[d][j]]);
            sb_put(&b, ")");
        }
    }
    sb_put(&b, "]");
    if (s->partial) {
        sb_put(&b, "{U:");
        sb_axes_mask(&b, m, s->partial);
        sb_put(&b, "}");
    }
    return b.n;
}

/* One spec entry in Python repr: None, 'x' or ('x', 'y'). */
static void sb_entry(sbuf *b, const mesh_shape *m, const mesh_spec *s, int d)
{
    int n = s->n_axes[d];
    if (n == 0) sb_put(b, "None");
    else if (n == 1) sb_put(b, "'%s'", m->names[s->axes[d][0]]);
    else {
        sb_put(b, "(");
        for (int j = 0; j < n; j++) sb_put(b, j ? ", '%s'" : "'%s'", m->names[s->axes[d][j]]);
        sb_put(b, ")");
    }
}

/* A Python tuple of the entries of dims[0..n): (), ('x',), ('x', None). */
static void sb_entries(sbuf *b, const mesh_shape *m, const mesh_spec *s, int n, const int *dims)
{
    sb_put(b, "(");
    for (int i = 0; i < n; i++) {
        if (i) sb_put(b, ", ");
        sb_entry(b, m, s, dims[i]);
    }
    sb_put(b, n == 1 ? ",)" : ")");
}

/* A Python set of axis names: {'x', 'y'}. */
static void sb_axis_set(sbuf *b, const mesh_shape *m, uint32_t mask)
{
    if (!mask) {
        sb_put(b, "set()");
        return;
    }
    sb_put(b, "{");
    int first = 1;
    for (int a = 0; a < m->n_axes; a++)
        if (mask & (1u << a)) {
            sb_put(b, first ? "'%s'" : ", '%s'", m->names[a]);
            first = 0;
        }
    sb_put(b, "}");
}

static void sb_type(sbuf *b, const mesh_shape *m, const mesh_array *x, const mesh_spec *s)
{
    char t[256];
    mesh_type_format(m, x->dtype, x->rank, x->shape, s, t, sizeof t);
    sb_put(b, "%s", t);
}

static void sb_spec(sbuf *b, const mesh_shape *m, const mesh_spec *s)
{
    char t[256];
    mesh_spec_format(s, m, t, sizeof t);
    sb_put(b, "%s", t);
}

static void sb_shape(sbuf *b, int rank, const int64_t *shape)
{
    sb_put(b, "(");
    for (int i = 0; i < rank; i++) sb_put(b, i ? ", %lld" : "%lld", (long long)shape[i]);
    sb_put(b, rank == 1 ? ",)" : ")");
}

/* "layer/name" (or just name). */
static void make_tag(const mesh_ctx *ctx, const char *name, char *buf, size_t cap)
{
    if (!name || !name[0]) name = "op";
    size_t n = 0;
    if (ctx->layer && ctx->layer[0]) n = sim_str_put(buf, cap, sim_str_put(buf, cap, 0, ctx->layer, SIZE_MAX), "/", 1);
    sim_str_put(buf, cap, n, name, SIZE_MAX);
}

/* The error every explicit-mode rule raises: "<tag> (<op>): <JAX text>", then the operands with
 * their types and specs, then how to fix it. */
typedef struct {
    const mesh_ctx *ctx;
    const char *tag;
    const char *op; /* "einsum 'btd,dh->bth'", "add", ... */
    int n;
    const mesh_array *x[2]; /* operands as passed */
    const mesh_spec *s[2];  /* the specs the rule saw */
    const char *where; /* the MaxText op that raises it ("file:function") in the release followed, NULL = none named */
    const char *fix;   /* the caller's advice, replacing the rule's generic one; NULL = the rule's */
} err_ctx;

static sim_status rule_error(const err_ctx *e, sim_status st, const char *jax_text, const char *fix)
{
    const mesh_shape *m = e->ctx->mesh;
    char buf[3072];
    sbuf b = {buf, sizeof buf, 0};
    /* JAX raises ShardingTypeError from its sharding rules, AssertionError from an explicit-mode
     * with_sharding_constraint; the class leads the JAX text, as in a Python traceback */
    const char *cls = strcmp(e->op, "with_sharding_constraint") ? "ShardingTypeError" : "AssertionError";
    sb_put(&b, "%s (%s): %s: %s", e->tag, e->op, cls, jax_text);
    static const char *role[2] = {"lhs", "rhs"};
    for (int i = 0; i < e->n; i++) {
        sb_put(&b, "\n  %s '%s': ", e->n == 1 ? "operand" : role[i], e->x[i]->name);
        sb_type(&b, m, e->x[i], e->s[i]);
        sb_put(&b, "  ");
        sb_spec(&b, m, e->s[i]);
    }
    if (e->where) sb_put(&b, "\n  MaxText %s fails here too: %s", cfg_release_maxtext(e->ctx->release), e->where);
    if (e->fix) fix = e->fix;
    if (fix) sb_put(&b, "\n  fix: %s", fix);
    return sim_err(st, "%s", buf);
}

/* ======================================================================== */
/* spec helpers                                                              */
/* ======================================================================== */

typedef struct {
    int n;
    int8_t ax[MESH_MAX_AXES];
} tup;

static tup tup_of(const mesh_spec *s, int d)
{
    tup t = {0, {0}};
    if (d < 0) return t;
    t.n = s->n_axes[d];
    memcpy(t.ax, s->axes[d], (size_t)t.n);
    return t;
}

static bool tup_eq(const tup *a, const tup *b) { return a->n == b->n && memcmp(a->ax, b->ax, (size_t)a->n) == 0; }

static uint32_t tup_mask(const tup *t)
{
    uint32_t m = 0;
    for (int i = 0; i < t->n; i++) m |= 1u << t->ax[i];
    return m;
}

static void set_dim(mesh_spec *s, int d, const tup *t)
{
    s->n_axes[d] = t->n;
    memcpy(s->axes[d], t->ax, (size_t)t->n);
}

/* The spec the rules see: size-1 axes removed when ctx->drop_size_one. */
static mesh_spec work_spec(const mesh_ctx *ctx, const mesh_spec *s)
{
    mesh_spec w = *s;
    if (ctx->drop_size_one) mesh_spec_drop_size_one(&w, ctx->mesh);
    return w;
}

static sim_meta op_meta(const mesh_ctx *ctx, const char *tag)
{
    return ctx->mode == MESH_MODE_AUTO ? sim_meta_implicit(tag) : sim_meta_tag(tag);
}

static sim_status check_f32(const char *tag, const char *op, const mesh_array *x)
{
    if (x->dtype != SIM_F32)
        return sim_err(SIM_ERR_INPUT, "%s (%s): operand '%s' is %s; this op computes in float32 only", tag, op, x->name,
                       sim_dtype_name(x->dtype));
    return SIM_OK;
}

/* ======================================================================== */
/* operand staging: a copy resharded to the spec the kernel needs            */
/* ======================================================================== */

/* The bytes of x's copy in spec `to` on a device, counted as its gather would be. */
static uint64_t staged_bytes(const mesh_ctx *ctx, const mesh_array *x, const mesh_spec *to)
{
    int64_t local[MESH_SPEC_MAX_RANK];
    mesh_spec_local_shape(to, ctx->mesh, x->shape, local);
    uint64_t n = 1;
    for (int i = 0; i < x->rank; i++) n *= (uint64_t)local[i];
    sim_dtype counted = x->cat == SIM_MEM_PARAMS ? mesh_array_gather_dtype(ctx->dev, x) : x->counted;
    return n * sim_dtype_size(counted);
}

/* The bytes of x's copy resharded from `from` to `to` for a product (0: none is needed). */
static uint64_t gathered_bytes(const mesh_ctx *ctx, const mesh_array *x, const mesh_spec *from, const mesh_spec *to)
{
    return mesh_spec_equal(from, to) ? 0 : staged_bytes(ctx, x, to);
}

/* Whether operand `which` (0: left) of product `sub` ("ab,bc->ac") is gathered (from -> to) along
 * an index the product sums over: the weight's gather a windowed einsum would loop over its
 * contracting dims (XLA:TPU then weighs it against gathering the other operand instead). */
static bool contracted_gather(const char *sub, int which, const mesh_spec *from, const mesh_spec *to)
{
    const char *arrow = strstr(sub, "->"), *comma = strchr(sub, ',');
    if (!arrow || !comma) return false;
    const char *letters = which ? comma + 1 : sub;
    for (int i = 0; letters[i] && letters[i] != ',' && letters[i] != '-' && i < from->rank; i++) {
        bool gathered = false;
        for (int j = 0; j < from->n_axes[i]; j++) {
            bool kept = false;
            for (int m = 0; m < to->n_axes[i]; m++) kept |= to->axes[i][m] == from->axes[i][j];
            gathered |= !kept;
        }
        if (gathered && !strchr(arrow + 2, letters[i])) return true;
    }
    return false;
}

typedef struct {
    mesh_array arr;
    bool owned;
} staged;

/* With ctx->cache (the tape's), a reshard of the same array (uid) from the same spec to the same
 * target is made once and borrowed afterwards, as a compiler reuses one all-gather. */
static sim_status stage(mesh_ctx *ctx, const mesh_array *x, const mesh_spec *work, const mesh_spec *to, sim_meta meta,
                        staged *out)
{
    out->arr = *x;
    out->arr.spec = *work; /* differs from x->spec by size-1 axes at most: same shard */
    out->owned = false;
    if (mesh_spec_equal(work, to)) return SIM_OK;
    /* a weight the compiler gathers again for this backward product (ctx->regather) bypasses the copy
     * the recomputation gathered: a second gather, its own buffer while the product runs */
    bool regather = ctx->regather && x->cat == SIM_MEM_PARAMS;
    /* a weight's gather over a strided group is each product's own choice (sim_collective_windowed):
     * the copy a recomputation kept serves the input gradient where both gather it the same way
     * (two plain gathers: XLA's CSE makes them one; two rings over 4 devices, unrolled, likewise),
     * else this product gathers for itself */
    sim_axes gax = sim_axes_none();
    int gk = 1;
    uint64_t whole = 0;
    bool own = false;
    if (x->cat == SIM_MEM_PARAMS && !ctx->dead_outputs && !regather) {
        uint32_t gone = mesh_spec_dim_axes(work) & ~mesh_spec_dim_axes(to);
        for (int a = 0; a < ctx->mesh->n_axes; a++)
            if (gone & (1u << a)) gax.axis[gax.n++] = a, gk *= ctx->mesh->sizes[a];
        sim_meta m = meta;
        m.weight = true;
        m.single_use = ctx->single_use;
        own = sim_windowed_per_product(ctx->dev, gax, m);
        whole = own ? gathered_bytes(ctx, x, work, to) : 0;
    }
    bool cached = !regather && ctx->cache && mesh_reshard_cache_get(ctx->cache, x, work, to, &out->arr);
    bool fresh = false;
    if (cached && own) {
        sim_meta m = meta;
        m.weight = m.single_use = true;
        bool now = sim_collective_windowed(ctx->dev, SIM_OP_ALL_GATHER, gax, gk, m, whole);
        bool then = mesh_reshard_cache_windowed(ctx->cache, x, work, to);
        fresh = now != then || (now && gk > 4);
    }
    if (cached && !fresh) return SIM_OK;
    out->arr = *x;
    out->arr.spec = *work;
    /* a weight's copy: MaxText's DenseGeneral casts the kernel to `dtype` right before the dot
     * (layers/linears.py); where that cast lands is the compiler's choice.  XLA:CPU gathers the
     * cast's operand (weight_dtype: MaxText 0.2.5's compiled step, dtype=bfloat16, fsdp=4, has f32
     * all-gathers), XLA:TPU casts the shard first and gathers `dtype` (the same step compiled for
     * v5p-8) -- opts.counted_gather, from the hardware profile (SIM_F32: as the parameter) */
    bool state = x->cat == SIM_MEM_PARAMS || x->cat == SIM_MEM_GRADS || x->cat == SIM_MEM_OPTIMIZER;
    sim_dtype counted =
        x->counted_fixed || state ? x->counted : sim_device_counted_dtype(ctx->dev, x->dtype, SIM_MEM_TEMP);
    if (x->cat == SIM_MEM_PARAMS) counted = mesh_array_gather_dtype(ctx->dev, x);
    else if (ctx->operand_gather && !state) counted = *ctx->operand_gather;
    /* counted as a copy, read where it is: the reshard copies it only if its first step works in place */
    SIM_TRY(sim_arena_charge(sim_device_arena(ctx->dev), x->nlocal * sim_dtype_size(counted), SIM_MEM_TEMP, x->name));
    out->arr.hold = MESH_HOLD_BORROWED;
    out->arr.counted = counted;
    out->arr.counted_fixed = x->counted_fixed || state || (ctx->operand_gather && x->cat != SIM_MEM_PARAMS);
    out->arr.cat = SIM_MEM_TEMP;
    out->owned = true;
    meta.weight = x->cat == SIM_MEM_PARAMS; /* an FSDP gather of a parameter (prefetched by XLA) */
    /* a second gather stays an all-gather: when the partitioner chose, the cast it gathers fed two products */
    meta.single_use = ctx->single_use && !regather;
    meta.silent = ctx->dead_outputs; /* for a product nothing reads: the compiler has no such gather */
    /* the staged copy is only read (bk_einsum, local_binary, reshape's copy; a cached one by later
     * operands of the same kind and mesh_nn_operand's kernels): a gather, of a weight or of an
     * activation (the same full block on every member of the group), is one buffer for the group */
    if (fresh) meta.single_use = true; /* this product's own gather */
    if (regather) meta.product_flops = 0; /* the cost model does not make it a ring either */
    sim_status st = mesh_reshard_shared(ctx->dev, ctx->mesh, &out->arr, to, meta);
    if (st != SIM_OK) {
        mesh_array_free(ctx->dev, &out->arr);
        out->owned = false;
    } else if (ctx->cache && !ctx->dead_outputs && !fresh && !regather) { /* a later reader gathers for itself */
        mesh_reshard_cache_put(ctx->cache, x, work, &out->arr);
        if (own)
            mesh_reshard_cache_set_windowed(ctx->cache, x, work, to,
                                            sim_collective_windowed(ctx->dev, SIM_OP_ALL_GATHER, gax, gk, meta, whole));
        out->owned = false; /* the cache owns it now */
    }
    return st;
}

static void unstage(mesh_ctx *ctx, staged *s)
{
    if (s->owned) mesh_array_free(ctx->dev, &s->arr);
    s->owned = false;
}

/* Bytes the planner needs for from -> to (false when the plan is impossible, e.g. indivisible). */
static bool plan_bytes(const mesh_shape *m, mesh_plan *plan, const char *name, int rank, const int64_t *shape,
                       const mesh_spec *from, const mesh_spec *to, uint64_t *bytes)
{
    return mesh_plan_bytes_memo(m, plan, name, rank, shape, from, to, bytes); /* remembered per thread */
}

/* ======================================================================== */
/* placement search                                                          */
/* ======================================================================== */

enum { MAX_LET = 26, MAX_CHOICE = 4, SEARCH_CAP = 4096 };

typedef struct {
    const mesh_shape *m;
    int nlet;
    int nchoice[MAX_LET];
    tup choice[MAX_LET][MAX_CHOICE];
    bool contract[MAX_LET]; /* letter's axes make the output partial */
    int nops;
    const mesh_array *x[2];
    mesh_spec from[2];              /* operands' working specs */
    int map[2][MESH_SPEC_MAX_RANK]; /* letter of each operand dim; -1: broadcast dim */
    int out_rank;
    int64_t out_shape[MESH_SPEC_MAX_RANK];
    int out_map[MESH_SPEC_MAX_RANK];
    bool union_partial;          /* add/sub: one partial set for operands and output */
    const mesh_spec *out_target; /* out_sharding, or NULL */
    mesh_reshard_cache *cache;   /* reshards already made: free for the search */
    /* result */
    mesh_spec to[2], out;
    uint64_t bytes_in, bytes_out;
} placement;

static void add_choice(placement *p, int l, const tup *t)
{
    for (int i = 0; i < p->nchoice[l]; i++)
        if (tup_eq(&p->choice[l][i], t)) return;
    if (p->nchoice[l] < MAX_CHOICE) p->choice[l][p->nchoice[l]++] = *t;
}

static bool build(const placement *p, const int *pick, int ov, mesh_spec *to, mesh_spec *out)
{
    uint32_t used = 0, cmask = 0;
    for (int l = 0; l < p->nlet; l++) {
        uint32_t mk = tup_mask(&p->choice[l][pick[l]]);
        if (used & mk) return false;
        used |= mk;
        if (p->contract[l]) cmask |= mk;
    }
    uint32_t used_all = used;
    for (int k = 0; k < p->nops; k++) {
        mesh_spec_init(&to[k], p->x[k]->rank);
        for (int d = 0; d < p->x[k]->rank; d++) {
            int l = p->map[k][d];
            if (l >= 0) {
                set_dim(&to[k], d, &p->choice[l][pick[l]]);
            } else { /* broadcast size-1 dim: keep its (size-1) axes if free */
                tup t = tup_of(&p->from[k], d);
                if (!(tup_mask(&t) & used)) {
                    set_dim(&to[k], d, &t);
                    used_all |= tup_mask(&t);
                }
            }
        }
    }
    mesh_spec_init(out, p->out_rank);
    for (int d = 0; d < p->out_rank; d++) set_dim(out, d, &p->choice[p->out_map[d]][pick[p->out_map[d]]]);
    if (p->union_partial) {
        uint32_t pp = (p->from[0].partial | (p->nops > 1 ? p->from[1].partial : 0)) & ~used_all;
        for (int k = 0; k < p->nops; k++) to[k].partial = pp;
        out->partial = pp;
    } else {
        uint32_t ka = p->from[0].partial & ~used_all, kb = p->nops > 1 ? p->from[1].partial & ~used_all : 0;
        uint32_t over = ka & kb;
        if (ov == 0) ka &= ~over;
        else kb &= ~over;
        to[0].partial = ka;
        if (p->nops > 1) to[1].partial = kb;
        out->partial = ka | kb | cmask;
    }
    for (int k = 0; k < p->nops; k++)
        if (mesh_spec_check(&to[k], p->m) != SIM_OK) return false;
    return mesh_spec_check(out, p->m) == SIM_OK;
}

static sim_status place(placement *p, const char *tag)
{
    int variants = (!p->union_partial && p->nops > 1 && (p->from[0].partial & p->from[1].partial)) ? 2 : 1;
    /* keep the search small: drop the last choices of the widest letters */
    for (;;) {
        uint64_t total = (uint64_t)variants;
        int widest = -1;
        for (int l = 0; l < p->nlet; l++) {
            total *= (uint64_t)p->nchoice[l];
            if (p->nchoice[l] > 1 && (widest < 0 || p->nchoice[l] > p->nchoice[widest])) widest = l;
        }
        if (total <= SEARCH_CAP || widest < 0) break;
        p->nchoice[widest]--;
    }
    mesh_plan plan_room; /* on the stack: a heap block per einsum was a tenth of this search */
    mesh_plan *plan = &plan_room;
    int pick[MAX_LET] = {0};
    uint64_t best = UINT64_MAX;
    mesh_spec to[2], out;
    for (;;) {
        for (int ov = 0; ov < variants; ov++) {
            if (!build(p, pick, ov, to, &out)) continue;
            uint64_t in = 0, b, ob = 0;
            bool ok = true;
            for (int k = 0; k < p->nops && ok; k++) {
                mesh_array cached;
                if (p->cache && mesh_reshard_cache_get(p->cache, p->x[k], &p->from[k], &to[k], &cached))
                    b = 0; /* made before (e.g. the forward's gather, reused by the backward): free */
                else ok = plan_bytes(p->m, plan, p->x[k]->name, p->x[k]->rank, p->x[k]->shape, &p->from[k], &to[k], &b);
                in += b;
            }
            if (ok && p->out_target)
                ok = plan_bytes(p->m, plan, tag, p->out_rank, p->out_shape, &out, p->out_target, &ob);
            if (!ok || in + ob >= best) continue;
            best = in + ob;
            p->to[0] = to[0];
            if (p->nops > 1) p->to[1] = to[1];
            p->out = out;
            p->bytes_in = in;
            p->bytes_out = ob;
        }
        /* the last letter varies fastest: ties go to the earlier letters' first choices */
        int l = p->nlet - 1;
        while (l >= 0 && ++pick[l] == p->nchoice[l]) pick[l--] = 0;
        if (l < 0) break;
    }
    sim_err_clear();
    if (best == UINT64_MAX)
        return sim_err(SIM_ERR_INPUT,
                       "%s: no placement of the operands makes this op computable on this mesh "
                       "(check the shapes divide by the mesh axes)",
                       tag);
    return SIM_OK;
}

/* ---- the placement, decided once for all devices ------------------------------
 * einsum_rules + place are a function of: the mesh, the mode, the subscripts,
 * both operands' shapes and working specs, the out_sharding, and which copies
 * of each operand (from its working spec) the reshard cache holds, since a
 * held copy costs nothing.  Packed as a key, the decision (both operand
 * targets, the output spec and the bytes) is shared by every device
 * (mesh/planmemo); only decisions that succeeded are kept. */

enum { PK_MAX = 2048, PK_HELD = 4 };

typedef struct {
    mesh_spec to[2], out;
    uint64_t bytes_in, bytes_out;
} placed;

static int pk_put(unsigned char *k, int n, const void *v, int len) { return mesh_memo_key_bytes(k, n, PK_MAX, v, len); }

static int pk_spec(unsigned char *k, int n, const mesh_spec *s) { return mesh_memo_key_spec(k, n, PK_MAX, s); }

static int pk_operand(unsigned char *k, int n, const mesh_array *x, const mesh_spec *from, mesh_reshard_cache *cache)
{
    unsigned char r = (unsigned char)x->rank;
    n = pk_put(k, n, &r, 1);
    n = pk_put(k, n, x->shape, x->rank * (int)sizeof x->shape[0]);
    n = pk_spec(k, n, from);
    mesh_spec held[PK_HELD];
    int nh = mesh_reshard_cache_targets(cache, x, from, held, PK_HELD);
    if (nh > PK_HELD) return -1;
    unsigned char c = (unsigned char)nh;
    n = pk_put(k, n, &c, 1);
    for (int i = 0; i < nh; i++) n = pk_spec(k, n, &held[i]);
    return n;
}

/* The key of p's search (p filled as einsum_rules expects it, before the call), or -1. */
static int placement_key(const mesh_ctx *ctx, const char *sub, const placement *p, unsigned char *k)
{
    int head[2] = {mesh_memo_mesh_id(ctx->mesh), (int)ctx->mode};
    if (head[0] < 0) return -1;
    int n = pk_put(k, 0, head, (int)sizeof head);
    n = pk_put(k, n, sub, (int)strlen(sub) + 1);
    for (int i = 0; i < p->nops; i++) n = pk_operand(k, n, p->x[i], &p->from[i], p->cache);
    unsigned char has_out = p->out_target != NULL;
    n = pk_put(k, n, &has_out, 1);
    if (has_out) n = pk_spec(k, n, p->out_target);
    return n;
}

/* ======================================================================== */
/* reduce_sum (also used by einsum for indices found in one operand only)    */
/* ======================================================================== */

/* out (kept dims) = sum of in over the dims in `red` (bitmask), double accumulation. */
static void local_reduce(float *out, const float *in, int rank, const int64_t *shape, uint32_t red)
{
    int64_t ost[MESH_SPEC_MAX_RANK], s = 1, n_in = 1;
    for (int d = rank - 1; d >= 0; d--) {
        n_in *= shape[d];
        if (red & (1u << d)) ost[d] = 0;
        else {
            ost[d] = s;
            s *= shape[d];
        }
    }
    int64_t n_out = s;
    double *acc = calloc((size_t)(n_out ? n_out : 1), sizeof *acc);
    SIM_ASSERT(acc != NULL);
    int64_t idx[MESH_SPEC_MAX_RANK] = {0};
    for (int64_t e = 0; e < n_in; e++) {
        int64_t o = 0;
        for (int d = 0; d < rank; d++) o += idx[d] * ost[d];
        acc[o] += in[e];
        for (int d = rank - 1; d >= 0; d--) {
            if (++idx[d] < shape[d]) break;
            idx[d] = 0;
        }
    }
    for (int64_t i = 0; i < n_out; i++) out[i] = (float)acc[i];
    free(acc);
}

static sim_status reduce_sum_impl(mesh_ctx *ctx, const mesh_array *a, int ndims, const int *dims,
                                  const mesh_spec *out_sharding, const char *name, sim_mem_cat cat, mesh_array *out)
{
    char tag[SIM_TAG_MAX];
    make_tag(ctx, name, tag, sizeof tag);
    memset(out, 0, sizeof *out);
    SIM_TRY(check_f32(tag, "reduce_sum", a));
    uint32_t red = 0;
    for (int i = 0; i < ndims; i++) {
        if (dims[i] < 0 || dims[i] >= a->rank || (red & (1u << dims[i])))
            return sim_err(SIM_ERR_INPUT, "%s (reduce_sum): dims must be distinct and in 0..%d; got %d", tag,
                           a->rank - 1, dims[i]);
        red |= 1u << dims[i];
    }
    mesh_spec w = work_spec(ctx, &a->spec), local;
    int rank = a->rank - ndims;
    int64_t shape[MESH_SPEC_MAX_RANK];
    mesh_spec_init(&local, rank);
    uint32_t red_axes = 0;
    for (int d = 0, o = 0; d < a->rank; d++) {
        tup t = tup_of(&w, d);
        if (red & (1u << d)) red_axes |= tup_mask(&t);
        else {
            shape[o] = a->shape[d];
            set_dim(&local, o++, &t);
        }
    }
    local.partial = w.partial | red_axes;
    mesh_spec target = local;
    target.partial = w.partial; /* the reduced dims' axes are summed right away */
    if (out_sharding) {
        SIM_TRY(mesh_spec_fit_rank(out_sharding, rank, tag, &target));
        SIM_TRY(mesh_spec_check(&target, ctx->mesh));
        SIM_TRY(mesh_spec_check_shape(&target, ctx->mesh, rank, shape, tag));
        if (ctx->mode == MESH_MODE_EXPLICIT && (target.partial & ~(red_axes | w.partial))) {
            char buf[512];
            sbuf b = {buf, sizeof buf, 0};
            sb_put(&b, "out_sharding of reduce_sum declares unreduced axes ");
            sb_axis_set(&b, ctx->mesh, target.partial & ~(red_axes | w.partial));
            sb_put(&b, " that do not shard the reduced dims (those are ");
            sb_axis_set(&b, ctx->mesh, red_axes);
            sb_put(&b, ")");
            err_ctx e = {ctx, tag, "reduce_sum", 1, {a, NULL}, {&w, NULL}, NULL, NULL};
            return rule_error(&e, SIM_ERR_SHARDING, buf,
                              "declare as unreduced only axes that shard a reduced dim, or reshard afterwards");
        }
    }
    char full[MESH_NAME_MAX];
    snprintf(full, sizeof full, "%s", tag);
    SIM_TRY(mesh_array_new(ctx->dev, ctx->mesh, full, rank, shape, &local, SIM_F32, cat, out));
    if (out->data && a->data) local_reduce(out->data, a->data, a->rank, a->local, red);
    if (!mesh_spec_equal(&local, &target)) {
        sim_status st = mesh_reshard(ctx->dev, ctx->mesh, out, &target, op_meta(ctx, tag));
        if (st != SIM_OK) {
            mesh_array_free(ctx->dev, out);
            return st;
        }
    }
    return SIM_OK;
}

sim_status mesh_reduce_sum(mesh_ctx *ctx, const mesh_array *a, int ndims, const int *dims,
                           const mesh_spec *out_sharding, const char *name, mesh_array *out)
{
    return reduce_sum_impl(ctx, a, ndims, dims, out_sharding, name, a->cat, out);
}

/* ======================================================================== */
/* einsum                                                                    */
/* ======================================================================== */

static int letter_dim(const char *l, int n, char c)
{
    for (int i = 0; i < n; i++)
        if (l[i] == c) return i;
    return -1;
}

/* Sums away the indices of x that only it has (JAX's einsum does this with reduce_sum first). */
static sim_status sum_unique(mesh_ctx *ctx, const bk_einsum_dims *d, const mesh_array *x, const char *l, int n,
                             bk_ein_role role, const char *name, staged *out, char *kept, int *nkept)
{
    int dims[MESH_SPEC_MAX_RANK], nd = 0;
    *nkept = 0;
    for (int i = 0; i < n; i++) {
        if (d->role[l[i] - 'a'] == role) dims[nd++] = i;
        else kept[(*nkept)++] = l[i];
    }
    out->arr = *x;
    out->owned = false;
    if (!nd) return SIM_OK;
    char nm[96];
    snprintf(nm, sizeof nm, "%s/sum_unique", name);
    SIM_TRY(reduce_sum_impl(ctx, x, nd, dims, NULL, nm, SIM_MEM_TEMP, &out->arr));
    out->owned = true;
    return SIM_OK;
}

static sim_status einsum_rules(mesh_ctx *ctx, const char *tag, const char *opdesc, const bk_einsum_dims *d,
                               const mesh_array *a, const mesh_array *b, const mesh_spec *out_sharding, placement *p,
                               const char *where, const char *advice)
{
    const mesh_shape *m = ctx->mesh;
    bool expl = ctx->mode == MESH_MODE_EXPLICIT;
    err_ctx e = {ctx, tag, opdesc, 2, {a, b}, {&p->from[0], &p->from[1]}, where, advice};
    /* batch and contraction letters in lhs order: the dims JAX's dot_general compares */
    int bl[MESH_SPEC_MAX_RANK], br[MESH_SPEC_MAX_RANK], cl[MESH_SPEC_MAX_RANK], cr[MESH_SPEC_MAX_RANK], nbt = 0,
                                                                                                        nct = 0;
    for (int i = 0; i < d->ra; i++) {
        bk_ein_role r = d->role[d->la[i] - 'a'];
        int j = letter_dim(d->lb, d->rb, d->la[i]);
        if (r == BK_EIN_BATCH) bl[nbt] = i, br[nbt++] = j;
        if (r == BK_EIN_CONTRACT) cl[nct] = i, cr[nct++] = j;
    }
    if (expl && (p->from[0].partial || p->from[1].partial))
        return rule_error(&e, SIM_ERR_SHARDING,
                          "dot_general inputs may not be unreduced: an unreduced (partial) operand would need an "
                          "implicit all-reduce",
                          "reduce the operand first with reshard to a spec without unreduced axes");
    if (expl && !out_sharding) {
        char buf[1024];
        sbuf s = {buf, sizeof buf, 0};
        /* JAX 0.12 (lax.py _dot_general_sharding_rule) requires the batch dims sharded alike; JAX 0.8.1
         * only consistently (an unsharded side takes the other's), and checks the contracting dims
         * the same way first (maxtext_release's jax_rules: dot_general) */
        bool consistent = !strcmp(cfg_release_jax_rule(ctx->release, "dot_general", "same"), "consistent");
        bool same = true;
        for (int i = 0; i < nbt; i++) {
            tup x = tup_of(&p->from[0], bl[i]), y = tup_of(&p->from[1], br[i]);
            same = same && (tup_eq(&x, &y) || (consistent && (!x.n || !y.n)));
        }
        if (!same) {
            sb_put(&s,
                   "dot_general requires lhs batch dimensions and rhs batch dimensions to have the %s "
                   "sharding, got ",
                   consistent ? "consistent" : "same");
            sb_entries(&s, m, &p->from[0], nbt, bl);
            sb_put(&s, " and ");
            sb_entries(&s, m, &p->from[1], nbt, br);
            sb_put(&s, ".");
            return rule_error(&e, SIM_ERR_SHARDING, buf,
                              "reshard one operand so both shard the batch dims identically, or pass out_sharding");
        }
        for (int i = 0; i < nct && consistent; i++) {
            tup x = tup_of(&p->from[0], cl[i]), y = tup_of(&p->from[1], cr[i]);
            if (!x.n || !y.n || tup_eq(&x, &y)) continue;
            sb_put(&s, "dot_general requires contracting dimensions to have consistent sharding, got ");
            sb_entries(&s, m, &p->from[0], nct, cl);
            sb_put(&s, " and ");
            sb_entries(&s, m, &p->from[1], nct, cr);
            sb_put(&s, ".");
            return rule_error(&e, SIM_ERR_SHARDING, buf,
                              "reshard one operand so only one side (or both alike) shards each contraction dim");
        }
        for (int i = 0; i < nct; i++)
            if (p->from[0].n_axes[cl[i]] && p->from[1].n_axes[cr[i]]) {
                sb_put(&s, "Contracting dimensions are sharded and it is ambiguous how the output should be "
                           "sharded. Please specify the output sharding via the `out_sharding` parameter. Got "
                           "lhs_contracting_spec=");
                sb_entries(&s, m, &p->from[0], nct, cl);
                sb_put(&s, " and rhs_contracting_spec=");
                sb_entries(&s, m, &p->from[1], nct, cr);
                /* concrete suggestions: the inferred output, summed (all-reduce) or left unreduced */
                bool alike = true;
                uint32_t cax = 0;
                for (int j = 0; j < nct; j++) {
                    tup x = tup_of(&p->from[0], cl[j]), y = tup_of(&p->from[1], cr[j]);
                    alike = alike && tup_eq(&x, &y);
                    cax |= tup_mask(&x) | tup_mask(&y);
                }
                mesh_spec base;
                mesh_spec_init(&base, d->ro);
                for (int j = 0; j < d->ro; j++) {
                    int c = d->lo[j] - 'a';
                    tup t = d->role[c] == BK_EIN_RHS_FREE ? tup_of(&p->from[1], letter_dim(d->lb, d->rb, d->lo[j]))
                                                          : tup_of(&p->from[0], letter_dim(d->la, d->ra, d->lo[j]));
                    if (!(tup_mask(&t) & cax)) set_dim(&base, j, &t);
                }
                char fix[768];
                sbuf f = {fix, sizeof fix, 0};
                if (alike) {
                    sb_put(&f, "pass out_sharding=");
                    sb_spec(&f, m, &base);
                    sb_put(&f, " (all-reduce over the contraction axes), out_sharding=");
                    base.partial = cax;
                    sb_spec(&f, m, &base);
                    sb_put(&f, " (no communication, the sum is deferred), or an out_sharding that shards an "
                               "output dim on those axes (reduce-scatter)");
                } else {
                    sb_put(&f, "reshard one operand so that only one side shards each contraction dim (the "
                               "other is then all-gathered), or so both shard it alike and pass out_sharding");
                }
                return rule_error(&e, SIM_ERR_SHARDING, buf, fix);
            }
    }
    if (expl && out_sharding && out_sharding->partial) {
        char buf[1024];
        sbuf s = {buf, sizeof buf, 0};
        bool same = true;
        uint32_t cax = 0;
        for (int i = 0; i < nct; i++) {
            tup x = tup_of(&p->from[0], cl[i]), y = tup_of(&p->from[1], cr[i]);
            same = same && tup_eq(&x, &y);
            cax |= tup_mask(&x);
        }
        if (!same) {
            sb_put(&s, "lhs and rhs contracting dims should be sharded identically when out_sharding provided to "
                       "dot_general mentions unreduced_axes. Got lhs_contracting_spec=");
            sb_entries(&s, m, &p->from[0], nct, cl);
            sb_put(&s, " and rhs_contracting_spec=");
            sb_entries(&s, m, &p->from[1], nct, cr);
            return rule_error(&e, SIM_ERR_SHARDING, buf,
                              "reshard the operands so their contraction dims match, or drop unreduced from "
                              "out_sharding");
        }
        if (cax != out_sharding->partial) {
            sb_put(&s, "out_sharding's unreduced axes should be equal to the contracting specs. Got unreduced axes=");
            sb_axis_set(&s, m, out_sharding->partial);
            sb_put(&s, " and contracting spec=");
            sb_entries(&s, m, &p->from[0], nct, cl);
            return rule_error(&e, SIM_ERR_SHARDING, buf,
                              "declare unreduced exactly the axes that shard the contraction dims");
        }
    }
    /* choices per letter */
    p->nlet = MAX_LET;
    for (int c = 0; c < MAX_LET; c++) {
        tup none = {0, {0}};
        p->nchoice[c] = 0;
        p->contract[c] = false;
        if (d->size[c] < 0) {
            add_choice(p, c, &none);
            continue;
        }
        int ia = letter_dim(d->la, d->ra, (char)('a' + c)), ib = letter_dim(d->lb, d->rb, (char)('a' + c));
        int io = letter_dim(d->lo, d->ro, (char)('a' + c));
        tup ta = tup_of(&p->from[0], ia), tb = tup_of(&p->from[1], ib);
        tup to = out_sharding && io >= 0 ? tup_of(out_sharding, io) : none;
        bk_ein_role r = d->role[c];
        if (r == BK_EIN_CONTRACT) {
            p->contract[c] = true;
            add_choice(p, c, ta.n && tup_eq(&ta, &tb) ? &ta : &none);
        } else if (expl && !out_sharding) {
            add_choice(p, c, r == BK_EIN_RHS_FREE ? &tb : &ta);
        } else {
            if (r != BK_EIN_RHS_FREE) add_choice(p, c, &ta);
            if (r != BK_EIN_LHS_FREE) add_choice(p, c, &tb);
            if (out_sharding) add_choice(p, c, &to);
            add_choice(p, c, &none);
        }
    }
    for (int i = 0; i < d->ra; i++) p->map[0][i] = d->la[i] - 'a';
    for (int i = 0; i < d->rb; i++) p->map[1][i] = d->lb[i] - 'a';
    p->out_rank = d->ro;
    for (int i = 0; i < d->ro; i++) {
        p->out_map[i] = d->lo[i] - 'a';
        p->out_shape[i] = d->out_shape[i];
    }
    /* explicit without out_sharding: the inferred output (batch ++ lhs free ++ rhs free) may not
     * use an axis twice */
    if (expl && !out_sharding) {
        uint32_t seen = 0;
        bool twice = false;
        for (int i = 0; i < d->ro; i++) {
            uint32_t mk = tup_mask(&p->choice[p->out_map[i]][0]);
            twice = twice || (seen & mk);
            seen |= mk;
        }
        if (twice) {
            /* the dot_general output in JAX's dim order */
            mesh_spec os;
            int64_t osh[MESH_SPEC_MAX_RANK];
            int n = 0;
            mesh_spec_init(&os, d->ro);
            for (int pass = 0; pass < 3; pass++) {
                const char *l = pass == 2 ? d->lb : d->la;
                int nl = pass == 2 ? d->rb : d->ra;
                bk_ein_role want = pass == 0 ? BK_EIN_BATCH : pass == 1 ? BK_EIN_LHS_FREE : BK_EIN_RHS_FREE;
                for (int i = 0; i < nl; i++) {
                    int c = l[i] - 'a';
                    if (d->role[c] != want) continue;
                    osh[n] = d->size[c];
                    os.n_axes[n] = p->choice[c][0].n;
                    memcpy(os.axes[n], p->choice[c][0].ax, (size_t)os.n_axes[n]);
                    n++;
                }
            }
            char buf[1024], t[256];
            sbuf s = {buf, sizeof buf, 0};
            sb_put(&s, "dot_general operation with inputs: ");
            sb_type(&s, m, a, &p->from[0]);
            sb_put(&s, ", ");
            sb_type(&s, m, b, &p->from[1]);
            mesh_type_format(m, SIM_F32, n, osh, &os, t, sizeof t);
            sb_put(&s, " produces an illegally sharded result: %s", t);
            return rule_error(&e, SIM_ERR_SHARDING, buf,
                              "pass out_sharding with each mesh axis on one dim, or reshard an operand first");
        }
    }
    return SIM_OK;
}

/* The local product's cost for the step-time model: 2 FLOPs per multiply-add over every index
 * (local sizes), and the elements read and written (operands and output). */
static void einsum_cost(mesh_ctx *ctx, const char *sub, const mesh_array *a, const mesh_array *b, const mesh_array *out,
                        bool a_weight, bool b_weight, const char *tag)
{
    /* the letters seen, as a 128-bit set: only those entries of size[] are written and read (on
     * every einsum of every device, a 1 KiB clear and a 128-step loop were most of this op's own
     * time); the product runs in increasing letter code, as over the whole table */
    int64_t size[128];
    uint64_t seen[2] = {0, 0};
    const char *comma = strchr(sub, ',');
    for (int i = 0; i < a->rank && sub[i] != ','; i++) {
        int c = (unsigned char)sub[i] & 127;
        size[c] = (int64_t)a->local[i];
        seen[c >> 6] |= 1ull << (c & 63);
    }
    for (int i = 0; comma && i < b->rank && comma[1 + i] && comma[1 + i] != '-'; i++) {
        int c = (unsigned char)comma[1 + i] & 127;
        size[c] = (int64_t)b->local[i];
        seen[c >> 6] |= 1ull << (c & 63);
    }
    double flops = 2.0;
    for (int w = 0; w < 2; w++)
        for (uint64_t bits = seen[w]; bits; bits &= bits - 1) {
            int c = w * 64 + __builtin_ctzll(bits);
            if (size[c] > 0) flops *= (double)size[c];
        }
    double wel = (a_weight ? (double)a->nlocal : 0.0) + (b_weight ? (double)b->nlocal : 0.0);
    if (!ctx->dead_outputs) /* a product nothing reads is not in the compiled program */
        sim_device_add_cost(ctx->dev, flops, (double)a->nlocal + (double)b->nlocal + (double)out->nlocal, wel, tag);
}

/* The inputs of a two-operand placement search (and of its key): the operands, their specs as the
 * rules see them, the output's target (NULL: none). */
static void placement_inputs(placement *p, const mesh_ctx *ctx, const mesh_array *a, const mesh_array *b,
                             const mesh_spec *out_sharding)
{
    p->m = ctx->mesh;
    p->cache = ctx->cache;
    p->nops = 2;
    p->x[0] = a;
    p->x[1] = b;
    p->from[0] = work_spec(ctx, &a->spec);
    p->from[1] = work_spec(ctx, &b->spec);
    p->out_target = out_sharding;
}

/* mesh_einsum, and mesh_einsum_into when acc is given (*fused then says which way it went). */
/* The FLOPs on a device of product `sub` with operands of local shapes la (rank ra) and lb (rank rb):
 * 2 x the product of every index's extent. */
static double product_flops(const char *sub, int ra, const int64_t *la, int rb, const int64_t *lb)
{
    int64_t size[128] = {0};
    const char *comma = strchr(sub, ',');
    for (int i = 0; i < ra && sub[i] != ','; i++) size[(unsigned char)sub[i] & 127] = la[i];
    for (int i = 0; comma && i < rb && comma[1 + i] && comma[1 + i] != '-'; i++)
        size[(unsigned char)comma[1 + i] & 127] = lb[i];
    double flops = 2.0;
    for (int c = 0; c < 128; c++)
        if (size[c] > 0) flops *= (double)size[c];
    return flops;
}

static sim_status einsum_impl(mesh_ctx *ctx, const char *subscripts, const mesh_array *a, const mesh_array *b,
                              const mesh_spec *out_sharding, const char *name, sim_mem_cat out_cat, mesh_array *out,
                              mesh_einsum_info *info, mesh_array *acc, bool *fused)
{
    char tag[SIM_TAG_MAX], opdesc[96], err[256];
    make_tag(ctx, name, tag, sizeof tag);
    sim_str_put(opdesc, sizeof opdesc,
                sim_str_put(opdesc, sizeof opdesc, sim_str_put(opdesc, sizeof opdesc, 0, "einsum '", 8),
                            subscripts ? subscripts : "", SIZE_MAX),
                "'", 1); /* snprintf's "einsum '%s'", on every einsum of every device */
    memset(out, 0, sizeof *out);
    SIM_TRY(check_f32(tag, opdesc, a));
    SIM_TRY(check_f32(tag, opdesc, b));
    bk_einsum_dims d;
    if (bk_einsum_parse(subscripts, a->rank, a->shape, b->rank, b->shape, &d, err, sizeof err))
        return sim_err(SIM_ERR_INPUT, "%s: %s (operands '%s' and '%s')", tag, err, a->name, b->name);
    mesh_spec osh;
    if (out_sharding) {
        SIM_TRY(mesh_spec_fit_rank(out_sharding, d.ro, tag, &osh));
        SIM_TRY(mesh_spec_check(&osh, ctx->mesh));
        SIM_TRY(mesh_spec_check_shape(&osh, ctx->mesh, d.ro, d.out_shape, tag));
        out_sharding = &osh;
    }
    sim_meta meta = op_meta(ctx, tag);
    sim_status st = SIM_OK;
    bool out_made = false;
    staged ua, ub, sa, sb; /* arr is set where owned is (four cleared mesh_arrays per einsum were not free) */
    ua.owned = ub.owned = sa.owned = sb.owned = false;
    placement p_room;       /* on the stack: a heap block per einsum of every device was malloc's slow path */
    placement *p = &p_room; /* zeroed where a search starts (a remembered placement needs no search) */

    /* explicit-mode rules first, on the operands as given: an op never fails after it started a
     * collective (the indices summed away below take no part in the dot_general rule) */
    if (ctx->mode == MESH_MODE_EXPLICIT) {
        memset(p, 0, sizeof *p);
        placement_inputs(p, ctx, a, b, out_sharding); /* the rules read the specs alone */
        SIM_TRY_GOTO(einsum_rules(ctx, tag, opdesc, &d, a, b, out_sharding, p, NULL, NULL), st, fail);
        memset(p, 0, sizeof *p);
    }

    /* indices in one operand only are summed first (reduce_sum's rule: all-reduce if sharded) */
    char la[BK_EINSUM_MAX_RANK], lb[BK_EINSUM_MAX_RANK], sub[64];
    int na, nb;
    SIM_TRY_GOTO(sum_unique(ctx, &d, a, d.la, d.ra, BK_EIN_LHS_SUM, name, &ua, la, &na), st, fail);
    SIM_TRY_GOTO(sum_unique(ctx, &d, b, d.lb, d.rb, BK_EIN_RHS_SUM, name, &ub, lb, &nb), st, fail);
    { /* "la,lb->lo" without printf (every einsum of every device); at most 3 x 8 letters + 3 < 64 */
        int k = 0;
        for (int i = 0; i < na; i++) sub[k++] = la[i];
        sub[k++] = ',';
        for (int i = 0; i < nb; i++) sub[k++] = lb[i];
        sub[k++] = '-';
        sub[k++] = '>';
        for (int i = 0; i < d.ro; i++) sub[k++] = d.lo[i];
        sub[k] = '\0';
    }
    /* with nothing summed away, sub has d's letters in d's order and the same shapes: d stands */
    if ((na != d.ra || nb != d.rb) &&
        bk_einsum_parse(sub, ua.arr.rank, ua.arr.shape, ub.arr.rank, ub.arr.shape, &d, err, sizeof err))
        SIM_TRY_GOTO(sim_err(SIM_ERR_INTERNAL, "%s: %s", tag, err), st, fail);

    placement_inputs(p, ctx, &ua.arr, &ub.arr, out_sharding);
    {
        unsigned char key[PK_MAX];
        int klen = placement_key(ctx, sub, p, key);
        placed v;
        if (klen > 0 && mesh_memo_get(key, klen, &v, (int)sizeof v)) {
            p->to[0] = v.to[0];
            p->to[1] = v.to[1];
            p->out = v.out;
            p->bytes_in = v.bytes_in;
            p->bytes_out = v.bytes_out;
        } else {
            memset(p, 0, sizeof *p); /* the search starts from zero */
            placement_inputs(p, ctx, &ua.arr, &ub.arr, out_sharding);
            SIM_TRY_GOTO(einsum_rules(ctx, tag, opdesc, &d, &ua.arr, &ub.arr, out_sharding, p, NULL, NULL), st, fail);
            SIM_TRY_GOTO(place(p, tag), st, fail);
            if (klen > 0) {
                v = (placed){{p->to[0], p->to[1]}, p->out, p->bytes_in, p->bytes_out};
                mesh_memo_put(key, klen, &v, (int)sizeof v);
            }
        }
    }

    { /* the product each operand's gather serves (the windowed-einsum cost model) */
        int64_t loc_a[MESH_SPEC_MAX_RANK], loc_b[MESH_SPEC_MAX_RANK];
        mesh_spec_local_shape(&p->to[0], ctx->mesh, ua.arr.shape, loc_a);
        mesh_spec_local_shape(&p->to[1], ctx->mesh, ub.arr.shape, loc_b);
        meta.product_flops = ctx->product_flops = product_flops(sub, ua.arr.rank, loc_a, ub.arr.rank, loc_b);
    }
    sim_meta meta_a = meta, meta_b = meta;
    if (contracted_gather(sub, 0, &p->from[0], &p->to[0]))
        meta_a.product_other_bytes = staged_bytes(ctx, &ub.arr, &p->to[1]);
    if (contracted_gather(sub, 1, &p->from[1], &p->to[1]))
        meta_b.product_other_bytes = staged_bytes(ctx, &ua.arr, &p->to[0]);
    if (p->out.partial) { /* the output is reduced over other axes after the product */
        int64_t lo[MESH_SPEC_MAX_RANK];
        mesh_spec_local_shape(&p->out, ctx->mesh, d.out_shape, lo);
        uint64_t n = 1;
        for (int i = 0; i < d.ro; i++) n *= (uint64_t)lo[i];
        const mesh_array *w = ub.arr.cat == SIM_MEM_PARAMS ? &ub.arr : &ua.arr;
        meta_a.product_partial_bytes = meta_b.product_partial_bytes =
            n * sim_dtype_size(w->cat == SIM_MEM_PARAMS ? mesh_array_gather_dtype(ctx->dev, w) : w->counted);
    }
    SIM_TRY_GOTO(stage(ctx, &ua.arr, &p->from[0], &p->to[0], meta_a, &sa), st, fail);
    SIM_TRY_GOTO(stage(ctx, &ub.arr, &p->from[1], &p->to[1], meta_b, &sb), st, fail);
    /* into acc: only where adding there changes nothing else -- the placement (chosen as ever) gives
     * acc's spec, dims and partial axes, so no collective would have touched the product, and the
     * kernel writes C in place (a scratch result scattered after would still be a temporary).  A
     * function of shapes and specs alone: a dry run decides the same. */
    bool into = acc && acc->hold == MESH_HOLD_OWN && !out_sharding && acc->dtype == SIM_F32 && acc->rank == d.ro &&
                mesh_spec_equal(&p->out, &acc->spec) &&
                !memcmp(acc->shape, d.out_shape, (size_t)d.ro * sizeof d.out_shape[0]) &&
                bk_einsum_out_direct(sub, sa.arr.rank, sa.arr.local, sb.arr.rank, sb.arr.local);
    if (fused) *fused = into;
    if (into)
        SIM_TRY_GOTO(mesh_array_new_ghost(ctx->dev, ctx->mesh, tag, d.ro, d.out_shape, &p->out, SIM_F32, out_cat, out),
                     st, fail);
    else if (ctx->out_counted)
        SIM_TRY_GOTO(mesh_array_new_as(ctx->dev, ctx->mesh, tag, d.ro, d.out_shape, &p->out, SIM_F32,
                                       *ctx->out_counted, out_cat, false, out),
                     st, fail);
    else
        SIM_TRY_GOTO(mesh_array_new_raw(ctx->dev, ctx->mesh, tag, d.ro, d.out_shape, &p->out, SIM_F32, out_cat, out),
                     st, fail);
    out_made = true;
    /* remat's recomputation takes the forward's product where it runs the same product the same way
     * (mesh/replay.h); a "dead" one too: an offloaded tensor's recomputed twin is read in its stead */
    mesh_spec ran[5];
    if (ctx->replay) ran[0] = p->from[0], ran[1] = p->from[1], ran[2] = p->to[0], ran[3] = p->to[1], ran[4] = p->out;
    bool replayed = false;
    if (!into && mesh_replay_using(ctx->replay)) replayed = mesh_replay_take(ctx->replay, tag, out, ran, 5);
    if (into && acc->data && sa.arr.data && sb.arr.data) /* beta = 1: sgemm adds the product to acc */
        bk_einsum(sub, acc->data, sa.arr.data, sa.arr.rank, sa.arr.local, sb.arr.data, sb.arr.rank, sb.arr.local, 1.0f);
    else if (!into && !replayed && out->data && sa.arr.data && sb.arr.data)
        bk_einsum(sub, out->data, sa.arr.data, sa.arr.rank, sa.arr.local, sb.arr.data, sb.arr.rank, sb.arr.local, 0.0f);
    if (!into && mesh_replay_saving(ctx->replay)) mesh_replay_put(ctx->replay, tag, out, ran, 5);
    einsum_cost(ctx, sub, &sa.arr, &sb.arr, out, a->cat == SIM_MEM_PARAMS, b->cat == SIM_MEM_PARAMS, tag);
    if (info) {
        memset(info, 0, sizeof *info);
        snprintf(info->subscripts, sizeof info->subscripts, "%s", sub);
        info->a_spec = p->to[0];
        info->b_spec = p->to[1];
        info->local_out = p->out;
        info->out_spec = out_sharding ? *out_sharding : p->out;
        info->bytes_in = p->bytes_in;
        info->bytes_out = p->bytes_out;
    }
    unstage(ctx, &sa);
    unstage(ctx, &sb);
    if (out_sharding && !mesh_spec_equal(&out->spec, out_sharding))
        SIM_TRY_GOTO(mesh_reshard(ctx->dev, ctx->mesh, out, out_sharding, meta), st, fail);
fail: /* the staged operands on every path; the output, once made, only on failure */
    if (st != SIM_OK && out_made) mesh_array_free(ctx->dev, out);
    unstage(ctx, &sa);
    unstage(ctx, &sb);
    unstage(ctx, &ua);
    unstage(ctx, &ub);
    return st;
}

sim_status mesh_einsum(mesh_ctx *ctx, const char *subscripts, const mesh_array *a, const mesh_array *b,
                       const mesh_spec *out_sharding, const char *name, sim_mem_cat out_cat, mesh_array *out,
                       mesh_einsum_info *info)
{
    return einsum_impl(ctx, subscripts, a, b, out_sharding, name, out_cat, out, info, NULL, NULL);
}

sim_status mesh_einsum_into(mesh_ctx *ctx, const char *subscripts, const mesh_array *a, const mesh_array *b,
                            mesh_array *acc, const char *name, sim_mem_cat out_cat, mesh_array *out, bool *fused)
{
    *fused = false;
    return einsum_impl(ctx, subscripts, a, b, NULL, name, out_cat, out, NULL, acc, fused);
}

/* ======================================================================== */
/* elementwise                                                               */
/* ======================================================================== */

typedef enum { EW_ADD = 0, EW_SUB, EW_MUL } ew_kind;

static const char *ew_name(ew_kind k) { return k == EW_ADD ? "add" : k == EW_SUB ? "sub" : "mul"; }

/* out = a (op) b over the local shards; a size-1 local dim of an operand broadcasts. */
/* One elementwise binary op over the local blocks: the output's rows (all dims but the last) are
 * independent, so they are cut into chunks of about BINARY_GRAIN elements on the kernel pool; each
 * element is computed by the same single operation whichever thread runs it. */
enum { BINARY_GRAIN = 1 << 15 };

typedef struct {
    ew_kind k;
    float *out;
    int rank;
    const int64_t *lo;
    const float *a, *b;
    int64_t sa[MESH_SPEC_MAX_RANK], sb[MESH_SPEC_MAX_RANK], inner, ia, ib;
} binary_job;

BK_CLONES static void binary_rows(int64_t r0, int64_t r1, void *arg)
{
    const binary_job *J = arg;
    const int rank = J->rank;
    const int64_t inner = J->inner, ia = J->ia, ib = J->ib;
    int64_t idx[MESH_SPEC_MAX_RANK] = {0};
    for (int64_t d = rank - 2, r = r0; d >= 0; d--) { /* the row's coordinates */
        idx[d] = r % J->lo[d];
        r /= J->lo[d];
    }
    for (int64_t r = r0; r < r1; r++) {
        int64_t oa = 0, ob = 0;
        for (int d = 0; d < rank - 1; d++) oa += idx[d] * J->sa[d], ob += idx[d] * J->sb[d];
        const float *pa = J->a + oa, *pb = J->b + ob;
        float *o = J->out + r * inner;
        if (ia == 1 && ib == 1) { /* no broadcast in the row: unit strides, so the loops vectorise */
            switch (J->k) {
            case EW_ADD:
                for (int64_t j = 0; j < inner; j++) o[j] = pa[j] + pb[j];
                break;
            case EW_SUB:
                for (int64_t j = 0; j < inner; j++) o[j] = pa[j] - pb[j];
                break;
            case EW_MUL:
                for (int64_t j = 0; j < inner; j++) o[j] = pa[j] * pb[j];
                break;
            }
        } else {
            switch (J->k) {
            case EW_ADD:
                for (int64_t j = 0; j < inner; j++) o[j] = pa[j * ia] + pb[j * ib];
                break;
            case EW_SUB:
                for (int64_t j = 0; j < inner; j++) o[j] = pa[j * ia] - pb[j * ib];
                break;
            case EW_MUL:
                for (int64_t j = 0; j < inner; j++) o[j] = pa[j * ia] * pb[j * ib];
                break;
            }
        }
        for (int d = rank - 2; d >= 0; d--) {
            if (++idx[d] < J->lo[d]) break;
            idx[d] = 0;
        }
    }
}

static void local_binary(ew_kind k, float *out, int rank, const int64_t *lo, const float *a, int ra, const int64_t *la,
                         const float *b, int rb, const int64_t *lb)
{
    binary_job J = {.k = k, .out = out, .rank = rank, .lo = lo, .a = a, .b = b};
    int64_t s = 1;
    for (int d = rank - 1; d >= 0; d--) {
        J.sa[d] = ra == 0 || (la[d] == 1 && lo[d] != 1) ? 0 : s;
        if (ra) s *= la[d];
    }
    s = 1;
    for (int d = rank - 1; d >= 0; d--) {
        J.sb[d] = rb == 0 || (lb[d] == 1 && lo[d] != 1) ? 0 : s;
        if (rb) s *= lb[d];
    }
    int64_t rows = 1;
    J.inner = rank ? lo[rank - 1] : 1;
    for (int d = 0; d < rank - 1; d++) rows *= lo[d];
    J.ia = rank ? J.sa[rank - 1] : 0;
    J.ib = rank ? J.sb[rank - 1] : 0;
    int64_t grain = J.inner > 0 ? (BINARY_GRAIN + J.inner - 1) / J.inner : rows;
    bk_parallel_for(rows, grain, binary_rows, &J);
}

/* JAX's broadcasting_sharding_rule on the working specs; fills the chosen tuple per dim. */
static sim_status broadcast_rule(const err_ctx *e, const char *prim, int rank, const int64_t *osh,
                                 const mesh_array *const *x, const mesh_spec *w, tup *res)
{
    const mesh_shape *m = e->ctx->mesh;
    char buf[1024];
    sbuf s = {buf, sizeof buf, 0};
    int dims[MESH_SPEC_MAX_RANK];
    for (int d = 0; d < rank; d++) dims[d] = d;
    int nx = 0, idx[2];
    for (int k = 0; k < 2; k++)
        if (x[k]->rank) idx[nx++] = k; /* scalars take no part */
    for (int d = 0; d < rank; d++) {
        tup t0 = tup_of(&w[idx[0]], d);
        bool all_eq = true;
        for (int i = 1; i < nx; i++) {
            tup ti = tup_of(&w[idx[i]], d);
            all_eq = all_eq && tup_eq(&t0, &ti);
        }
        if (all_eq) {
            res[d] = t0;
            continue;
        }
        tup nt[2];
        int nn = 0;
        for (int i = 0; i < nx; i++) {
            tup ti = tup_of(&w[idx[i]], d);
            if (!(x[idx[i]]->shape[d] == 1 && ti.n == 0)) nt[nn++] = ti;
        }
        tup none = {0, {0}};
        if (nn == 0) {
            res[d] = none;
            continue;
        }
        bool agree = true;
        for (int i = 1; i < nn; i++) agree = agree && tup_eq(&nt[0], &nt[i]);
        if (agree) {
            res[d] = nt[0];
            continue;
        }
        res[d] = none;
        for (int i = 0; i < nx; i++) {
            tup ti = tup_of(&w[idx[i]], d);
            if (res[d].n == 0 && ti.n) res[d] = ti;
            else if (res[d].n && ti.n && !tup_eq(&res[d], &ti)) {
                sb_put(&s, "%s got incompatible shardings for broadcasting: ", prim);
                for (int j = 0; j < nx; j++) {
                    if (j) sb_put(&s, ", ");
                    sb_entries(&s, m, &w[idx[j]], rank, dims);
                }
                sb_put(&s, ".");
                return rule_error(e, SIM_ERR_SHARDING, buf,
                                  "reshard one operand so that both shard this dim the same way (or not at all)");
            }
        }
    }
    uint32_t seen = 0;
    bool twice = false;
    for (int d = 0; d < rank; d++) {
        twice = twice || (seen & tup_mask(&res[d]));
        seen |= tup_mask(&res[d]);
    }
    if (twice) {
        mesh_spec os;
        mesh_spec_init(&os, rank);
        for (int d = 0; d < rank; d++) set_dim(&os, d, &res[d]);
        sb_put(&s, "%s operation with inputs: ", prim);
        for (int j = 0; j < nx; j++) {
            if (j) sb_put(&s, ", ");
            sb_type(&s, m, x[idx[j]], &w[idx[j]]);
        }
        char t[256];
        mesh_type_format(m, x[idx[0]]->dtype, rank, osh, &os, t, sizeof t);
        sb_put(&s, " produces an illegally sharded result: %s", t);
        return rule_error(e, SIM_ERR_SHARDING, buf, "reshard one operand so that each mesh axis shards one dim");
    }
    return SIM_OK;
}

static sim_status partial_rule(const err_ctx *e, ew_kind k, const mesh_spec *w)
{
    const mesh_shape *m = e->ctx->mesh;
    uint32_t pa = w[0].partial, pb = w[1].partial;
    if (!pa && !pb) return SIM_OK;
    char buf[1024];
    sbuf s = {buf, sizeof buf, 0};
    const char *prim = ew_name(k);
    if (k == EW_MUL) {
        if (pa && pb) sb_put(&s, "lhs and rhs to `mul` cannot be unreduced since mul is bilinear. Got lhs=");
        else
            sb_put(&s, "%s should be reduced along the same axes %s is unreduced on. Got %s=", pa ? "RHS" : "LHS",
                   pa ? "LHS" : "RHS", pa ? "lhs" : "rhs");
        sb_axis_set(&s, m, pa ? pa : pb);
        if (pa && pb) {
            sb_put(&s, " and rhs=");
            sb_axis_set(&s, m, pb);
        }
        return rule_error(e, SIM_ERR_SHARDING, buf,
                          "reshard the unreduced operand to a spec without unreduced axes before `mul` "
                          "(shardsim has no reduced type)");
    }
    if (pa == pb) return SIM_OK;
    if (!pa || !pb) {
        const char *side = pa ? "lhs" : "rhs", *other = pa ? "rhs" : "lhs";
        sb_put(&s,
               "%s is unreduced while %s is not. `%s` operation does not allow this because there will be "
               "implicit communication. Please reduce %s via `reshard` before calling `%s`.",
               side, other, prim, side, prim);
    } else {
        sb_put(&s, "lhs and rhs to `%s` must be unreduced along the same mesh axes. Got lhs=", prim);
        sb_axis_set(&s, m, pa);
        sb_put(&s, " and rhs=");
        sb_axis_set(&s, m, pb);
    }
    return rule_error(e, SIM_ERR_SHARDING, buf, "reshard the operands to the same unreduced axes first");
}

static sim_status binary_op(mesh_ctx *ctx, ew_kind k, const mesh_array *a, const mesh_array *b, const char *name,
                            mesh_array *out)
{
    char tag[SIM_TAG_MAX];
    const char *prim = ew_name(k);
    make_tag(ctx, name, tag, sizeof tag);
    memset(out, 0, sizeof *out);
    SIM_TRY(check_f32(tag, prim, a));
    SIM_TRY(check_f32(tag, prim, b));
    const mesh_array *x[2] = {a, b};
    int rank = a->rank > b->rank ? a->rank : b->rank;
    if (a->rank && b->rank && a->rank != b->rank) {
        char buf[256];
        sbuf s = {buf, sizeof buf, 0};
        sb_shape(&s, a->rank, a->shape);
        sb_put(&s, ", ");
        sb_shape(&s, b->rank, b->shape);
        return sim_err(SIM_ERR_INPUT,
                       "%s (%s): %s: arrays must have same number of dimensions, got %s. (operands "
                       "'%s' and '%s'; add size-1 dims with mesh_reshape)",
                       tag, prim, prim, buf, a->name, b->name);
    }
    int64_t osh[MESH_SPEC_MAX_RANK];
    for (int d = 0; d < rank; d++) {
        int64_t sa = a->rank ? a->shape[d] : 1, sb = b->rank ? b->shape[d] : 1;
        if (sa != sb && sa != 1 && sb != 1) {
            char buf[256];
            sbuf s = {buf, sizeof buf, 0};
            sb_shape(&s, a->rank, a->shape);
            sb_put(&s, ", ");
            sb_shape(&s, b->rank, b->shape);
            return sim_err(SIM_ERR_INPUT,
                           "%s (%s): %s got incompatible shapes for broadcasting: %s. (operands '%s' "
                           "and '%s')",
                           tag, prim, prim, buf, a->name, b->name);
        }
        osh[d] = sa > sb ? sa : sb;
    }
    mesh_spec w[2] = {work_spec(ctx, &a->spec), work_spec(ctx, &b->spec)};
    err_ctx e = {ctx, tag, prim, 2, {a, b}, {&w[0], &w[1]}, NULL, NULL};
    placement *p = calloc(1, sizeof *p);
    if (!p) return sim_err(SIM_ERR_INTERNAL, "%s: out of host memory", tag);
    sim_status st = SIM_OK;
    staged sa = {.owned = false}, sb = {.owned = false};
    placement_inputs(p, ctx, a, b, NULL); /* from = w */
    p->nlet = rank;
    p->out_rank = rank;
    p->union_partial = k != EW_MUL;
    for (int d = 0; d < rank; d++) {
        p->out_map[d] = d;
        p->out_shape[d] = osh[d];
        for (int i = 0; i < 2; i++) p->map[i][d] = x[i]->rank && x[i]->shape[d] == osh[d] ? d : -1;
    }
    if (ctx->mode == MESH_MODE_EXPLICIT) {
        tup res[MESH_SPEC_MAX_RANK];
        SIM_TRY_GOTO(partial_rule(&e, k, w), st, fail);
        SIM_TRY_GOTO(broadcast_rule(&e, prim, rank, osh, x, w, res), st, fail);
        for (int d = 0; d < rank; d++) add_choice(p, d, &res[d]);
    } else {
        tup none = {0, {0}};
        for (int d = 0; d < rank; d++) {
            for (int i = 0; i < 2; i++)
                if (p->map[i][d] >= 0) {
                    tup t = tup_of(&w[i], d);
                    add_choice(p, d, &t);
                }
            add_choice(p, d, &none);
        }
    }
    SIM_TRY_GOTO(place(p, tag), st, fail);
    sim_meta meta = op_meta(ctx, tag);
    SIM_TRY_GOTO(stage(ctx, a, &w[0], &p->to[0], meta, &sa), st, fail);
    SIM_TRY_GOTO(stage(ctx, b, &w[1], &p->to[1], meta, &sb), st, fail);
    /* local_binary writes every element when both operands hold data: no zero-filling then (a
     * serial memset, and the page faults of a fresh block, on the device thread) */
    SIM_TRY_GOTO((sa.arr.data && sb.arr.data ? mesh_array_new_raw : mesh_array_new)(ctx->dev, ctx->mesh, tag, rank,
                                                                                    osh, &p->out, SIM_F32, a->cat, out),
                 st, fail);
    if (out->data && sa.arr.data && sb.arr.data)
        local_binary(k, out->data, rank, out->local, sa.arr.data, sa.arr.rank, sa.arr.local, sb.arr.data, sb.arr.rank,
                     sb.arr.local);
fail: /* the staged operands and the placement, on every path */
    unstage(ctx, &sa);
    unstage(ctx, &sb);
    free(p);
    return st;
}

sim_status mesh_add(mesh_ctx *ctx, const mesh_array *a, const mesh_array *b, const char *name, mesh_array *out)
{
    return binary_op(ctx, EW_ADD, a, b, name, out);
}

sim_status mesh_sub(mesh_ctx *ctx, const mesh_array *a, const mesh_array *b, const char *name, mesh_array *out)
{
    return binary_op(ctx, EW_SUB, a, b, name, out);
}

sim_status mesh_mul(mesh_ctx *ctx, const mesh_array *a, const mesh_array *b, const char *name, mesh_array *out)
{
    return binary_op(ctx, EW_MUL, a, b, name, out);
}

/* ======================================================================== */
/* map                                                                       */
/* ======================================================================== */

sim_status mesh_map(mesh_ctx *ctx, const mesh_array *a, mesh_map_fn fn, void *arg, const char *name, mesh_array *out)
{
    char tag[SIM_TAG_MAX];
    make_tag(ctx, name, tag, sizeof tag);
    memset(out, 0, sizeof *out);
    SIM_TRY(check_f32(tag, "map", a));
    mesh_spec w = work_spec(ctx, &a->spec);
    if (w.partial && ctx->mode == MESH_MODE_EXPLICIT) {
        char buf[512];
        sbuf s = {buf, sizeof buf, 0};
        sb_put(&s,
               "unreduced rule for %s is not implemented: a nonlinear op needs the reduced value, got "
               "unreduced axes ",
               name ? name : "map");
        sb_axis_set(&s, ctx->mesh, w.partial);
        err_ctx e = {ctx, tag, name ? name : "map", 1, {a, NULL}, {&w, NULL}, NULL, NULL};
        return rule_error(&e, SIM_ERR_SHARDING, buf,
                          "reshard the input to a spec without unreduced axes first (or pass out_sharding to the op "
                          "that produced it)");
    }
    mesh_spec target = w;
    target.partial = 0;
    SIM_TRY(mesh_array_new(ctx->dev, ctx->mesh, tag, a->rank, a->shape, &w, SIM_F32, a->cat, out));
    if (w.partial) { /* auto: sum the partial value first, in the output's buffer */
        if (out->data && a->data) memcpy(out->data, a->data, a->nlocal * sizeof(float));
        sim_status st = mesh_reshard(ctx->dev, ctx->mesh, out, &target, op_meta(ctx, tag));
        if (st != SIM_OK) {
            mesh_array_free(ctx->dev, out);
            return st;
        }
        if (out->data) fn(out->data, out->data, out->nlocal, arg);
    } else if (out->data && a->data) {
        fn(out->data, a->data, out->nlocal, arg);
    }
    return SIM_OK;
}

/* ======================================================================== */
/* transpose                                                                 */
/* ======================================================================== */

sim_status mesh_transpose(mesh_ctx *ctx, const mesh_array *a, const int *perm, const char *name, mesh_array *out)
{
    char tag[SIM_TAG_MAX];
    make_tag(ctx, name, tag, sizeof tag);
    memset(out, 0, sizeof *out);
    uint32_t seen = 0;
    for (int i = 0; i < a->rank; i++) {
        if (perm[i] < 0 || perm[i] >= a->rank || (seen & (1u << perm[i])))
            return sim_err(SIM_ERR_INPUT, "%s (transpose): perm must be a permutation of 0..%d; entry %d is %d", tag,
                           a->rank - 1, i, perm[i]);
        seen |= 1u << perm[i];
    }
    mesh_spec w = work_spec(ctx, &a->spec), os;
    int64_t shape[MESH_SPEC_MAX_RANK];
    mesh_spec_init(&os, a->rank);
    for (int i = 0; i < a->rank; i++) {
        tup t = tup_of(&w, perm[i]);
        set_dim(&os, i, &t);
        shape[i] = a->shape[perm[i]];
    }
    os.partial = w.partial;
    SIM_TRY(mesh_array_new(ctx->dev, ctx->mesh, tag, a->rank, shape, &os, a->dtype, a->cat, out));
    if (out->data && a->data) bk_permute(out->data, a->data, sim_dtype_size(a->dtype), a->rank, a->local, perm);
    return SIM_OK;
}

/* ======================================================================== */
/* reshape                                                                   */
/* ======================================================================== */

/* JAX's split_partitions: hands axes (major first) out to dims of `sizes`, each taking axes while
 * its remaining size is > 1; false when an axis does not divide what is left or axes remain. */
static bool split_axes(const mesh_shape *m, const tup *axes, int n, const int64_t *sizes, tup *out)
{
    int next = 0;
    for (int i = 0; i < n; i++) {
        int64_t o = sizes[i];
        out[i].n = 0;
        while (o > 1 && next < axes->n) {
            int a = axes->ax[next];
            if (o % m->sizes[a]) return false;
            o /= m->sizes[a];
            out[i].ax[out[i].n++] = (int8_t)a;
            next++;
        }
    }
    return next == axes->n;
}

/* JAX's _split_on_one_axis(op, new): whether `nw` splits exactly one dim of `op` into adjacent
 * dims.  grp[i] = number of new dims op dim i becomes (1 for unchanged).  *many: more than one
 * dim changes (JAX raises the reshape error). */
static bool split_one(const int64_t *op, int nop, const int64_t *nw, int nnw, int *grp, bool *many)
{
    *many = false;
    if (nnw <= nop) return false;
    int ones = 0;
    while (nop > 0 && nnw > 0 && op[nop - 1] == 1 && nw[nnw - 1] == 1) {
        ones++;
        nop--;
        nnw--;
    }
    int i = 0, j = 0, count = 0, ng = 0;
    while (j < nnw) {
        if (i >= nop) return false;
        if (op[i] == nw[j]) {
            grp[ng++] = 1;
        } else {
            if (++count > 1) {
                *many = true;
                return false;
            }
            int64_t prod = nw[j];
            int len = 1, next_j = j + 1, next_i = i + 1;
            while (prod != op[i] || (next_j < nnw && nw[next_j] == 1)) {
                if (prod > op[i]) return false;
                if (prod == op[i] && next_i < nop && nw[next_j] == op[next_i]) break;
                j++;
                if (j >= nnw) return false;
                prod *= nw[j];
                len++;
                next_j++;
            }
            grp[ng++] = len;
        }
        i++;
        j++;
    }
    for (int k = 0; k < ones; k++) grp[ng++] = 1;
    return ng == nop + ones;
}

/* JAX's _reshape_sharding_rule without out_sharding: false when JAX raises its reshape error. */
static bool reshape_rule(const mesh_shape *m, int ra, const int64_t *sa, const mesh_spec *w, int rank,
                         const int64_t *shape, mesh_spec *os)
{
    mesh_spec_init(os, rank);
    os->partial = w->partial;
    if (!mesh_spec_dim_axes(w)) return true;
    int64_t nz_a[MESH_SPEC_MAX_RANK], nz_b[MESH_SPEC_MAX_RANK];
    int na = 0, nb = 0;
    for (int i = 0; i < ra; i++)
        if (sa[i] != 1) nz_a[na++] = sa[i];
    for (int i = 0; i < rank; i++)
        if (shape[i] != 1) nz_b[nb++] = shape[i];
    if (na == nb && !memcmp(nz_a, nz_b, (size_t)na * sizeof *nz_a)) { /* only singleton dims change */
        int k = 0;
        for (int i = 0; i < rank; i++) {
            if (shape[i] == 1) continue;
            while (sa[k] == 1) k++;
            tup t = tup_of(w, k++);
            set_dim(os, i, &t);
        }
        return true;
    }
    int grp[MESH_SPEC_MAX_RANK * 2];
    bool many;
    if (split_one(sa, ra, shape, rank, grp, &many)) {
        int o = 0;
        for (int i = 0; i < ra; i++) {
            tup t = tup_of(w, i), parts[MESH_SPEC_MAX_RANK];
            if (grp[i] == 1) {
                set_dim(os, o++, &t);
                continue;
            }
            if (t.n && !split_axes(m, &t, grp[i], &shape[o], parts)) return false;
            for (int g = 0; g < grp[i]; g++, o++)
                if (t.n) set_dim(os, o, &parts[g]);
        }
        return true;
    }
    if (many) return false;
    if (rank < ra && split_one(shape, rank, sa, ra, grp, &many)) { /* merge: the same walk backwards */
        int k = 0;
        for (int i = 0; i < rank; i++) {
            if (grp[i] == 1) {
                tup t = tup_of(w, k++);
                set_dim(os, i, &t);
                continue;
            }
            tup flat = {0, {0}};
            int last_sharded = -1, first_none_after = -1;
            for (int g = 0; g < grp[i]; g++) {
                tup t = tup_of(w, k + g);
                if (t.n) last_sharded = g;
            }
            for (int g = 0; g <= last_sharded; g++) {
                tup t = tup_of(w, k + g);
                if (!t.n && first_none_after < 0) first_none_after = g;
                for (int j = 0; j < t.n; j++) flat.ax[flat.n++] = t.ax[j];
            }
            k += grp[i];
            if (last_sharded < 0) continue;
            if (first_none_after >= 0) return false; /* a sharded dim after an unsharded one */
            tup part;
            if (!split_axes(m, &flat, 1, &shape[i], &part)) return false;
            set_dim(os, i, &part);
        }
        return true;
    }
    return false;
}

/* Groups of a reshape: minimal runs of non-1 dims with equal products.  gin[d] / gout[d] = group of
 * a dim (-1 for size-1 dims).  Returns the number of groups (-1 when a size is 0). */
static int reshape_groups(int ra, const int64_t *sa, int rb, const int64_t *sb, int *gin, int *gout)
{
    int i = 0, j = 0, g = 0;
    for (int d = 0; d < ra; d++) {
        gin[d] = -1;
        if (sa[d] == 0) return -1;
    }
    for (int d = 0; d < rb; d++) {
        gout[d] = -1;
        if (sb[d] == 0) return -1;
    }
    for (;;) {
        while (i < ra && sa[i] == 1) i++;
        while (j < rb && sb[j] == 1) j++;
        if (i == ra || j == rb) break;
        int64_t pa = sa[i], pb = sb[j];
        gin[i++] = g;
        gout[j++] = g;
        while (pa != pb) {
            if (pa < pb) {
                while (i < ra && sa[i] == 1) i++;
                SIM_ASSERT(i < ra);
                pa *= sa[i];
                gin[i++] = g;
            } else {
                while (j < rb && sb[j] == 1) j++;
                SIM_ASSERT(j < rb);
                pb *= sb[j];
                gout[j++] = g;
            }
        }
        g++;
    }
    return g;
}

/* Whether the dims of group g (in order) hold contiguous blocks: every dim before the last sharded
 * one is fully split.  *flat = their axes, major first. */
static bool group_contiguous(const mesh_shape *m, const mesh_spec *s, const int64_t *shape, int rank, const int *grp,
                             int g, tup *flat)
{
    int last = -1;
    flat->n = 0;
    for (int d = 0; d < rank; d++)
        if (grp[d] == g && s->n_axes[d]) last = d;
    for (int d = 0; d <= last; d++) {
        if (grp[d] != g) continue;
        tup t = tup_of(s, d);
        int64_t k = 1;
        for (int j = 0; j < t.n; j++) k *= m->sizes[t.ax[j]];
        if (d < last && k != shape[d]) return false;
        for (int j = 0; j < t.n; j++) flat->ax[flat->n++] = t.ax[j];
    }
    return true;
}

/* Spreads `flat` over the dims of group g as JAX's split does; false when it does not divide. */
static bool group_spread(const mesh_shape *m, mesh_spec *s, const int64_t *shape, int rank, const int *grp, int g,
                         const tup *flat)
{
    int dims[MESH_SPEC_MAX_RANK], n = 0;
    int64_t sizes[MESH_SPEC_MAX_RANK] = {0};
    for (int d = 0; d < rank; d++)
        if (grp[d] == g) dims[n] = d, sizes[n++] = shape[d];
    tup parts[MESH_SPEC_MAX_RANK];
    if (!split_axes(m, flat, n, sizes, parts)) return false;
    for (int i = 0; i < n; i++) set_dim(s, dims[i], &parts[i]);
    return true;
}

sim_status mesh_reshape(mesh_ctx *ctx, const mesh_array *a, int rank, const int64_t *shape,
                        const mesh_spec *out_sharding, const char *name, mesh_array *out)
{
    char tag[SIM_TAG_MAX];
    make_tag(ctx, name, tag, sizeof tag);
    memset(out, 0, sizeof *out);
    const mesh_shape *m = ctx->mesh;
    int64_t na = 1, nb = 1;
    for (int i = 0; i < a->rank; i++) na *= a->shape[i];
    if (rank < 0 || rank > MESH_SPEC_MAX_RANK)
        return sim_err(SIM_ERR_INPUT, "%s (reshape): rank %d is outside 0..%d", tag, rank, MESH_SPEC_MAX_RANK);
    for (int i = 0; i < rank; i++) nb *= shape[i];
    if (na != nb) {
        char b1[128], b2[128];
        sbuf s1 = {b1, sizeof b1, 0}, s2 = {b2, sizeof b2, 0};
        sb_shape(&s1, a->rank, a->shape);
        sb_shape(&s2, rank, shape);
        return sim_err(SIM_ERR_INPUT, "%s (reshape): cannot reshape '%s' of shape %s (%lld elements) to %s (%lld)", tag,
                       a->name, b1, (long long)na, b2, (long long)nb);
    }
    mesh_spec w = work_spec(ctx, &a->spec), target, osh;
    if (out_sharding) {
        SIM_TRY(mesh_spec_fit_rank(out_sharding, rank, tag, &osh));
        SIM_TRY(mesh_spec_check(&osh, m));
        SIM_TRY(mesh_spec_check_shape(&osh, m, rank, shape, tag));
        if (ctx->mode == MESH_MODE_EXPLICIT && osh.partial != w.partial) {
            char buf[512];
            sbuf s = {buf, sizeof buf, 0};
            sb_put(&s, "reshape keeps the unreduced axes of its operand: out_sharding has unreduced ");
            sb_axis_set(&s, m, osh.partial);
            sb_put(&s, " but the operand has ");
            sb_axis_set(&s, m, w.partial);
            err_ctx e = {ctx, tag, "reshape", 1, {a, NULL}, {&w, NULL}, NULL, NULL};
            return rule_error(&e, SIM_ERR_SHARDING, buf, "give out_sharding the operand's unreduced axes");
        }
        target = osh;
    } else if (!reshape_rule(m, a->rank, a->shape, &w, rank, shape, &target)) {
        if (ctx->mode == MESH_MODE_EXPLICIT) {
            char buf[1024], t[256];
            sbuf s = {buf, sizeof buf, 0};
            mesh_type_format(m, a->dtype, a->rank, a->shape, &w, t, sizeof t);
            sb_put(&s,
                   "This reshape is not supported. Please specify the sharding of the output via the "
                   "`out_sharding` argument of jax.lax.reshape. Got operand type: %s, new sizes: ",
                   t);
            sb_shape(&s, rank, shape);
            err_ctx e = {ctx, tag, "reshape", 1, {a, NULL}, {&w, NULL}, NULL, NULL};
            return rule_error(&e, SIM_ERR_SHARDING, buf,
                              "pass out_sharding, or reshard the operand so the split/merged dims are sharded "
                              "only on their leading dim");
        }
        /* auto: keep every group whose blocks stay contiguous, replicate the rest */
        int gin[MESH_SPEC_MAX_RANK], gout[MESH_SPEC_MAX_RANK];
        int ng = reshape_groups(a->rank, a->shape, rank, shape, gin, gout);
        mesh_spec_init(&target, rank);
        target.partial = w.partial;
        for (int g = 0; g < ng; g++) {
            tup flat;
            if (group_contiguous(m, &w, a->shape, a->rank, gin, g, &flat) && flat.n)
                (void)group_spread(m, &target, shape, rank, gout, g, &flat);
        }
    }
    /* Data: the kernel is a plain row-major copy, valid when every group is contiguous with the
     * same axes on both sides.  Output groups that are not contiguous are built replicated and
     * sliced afterwards (free); the input is resharded to match. */
    int gin[MESH_SPEC_MAX_RANK], gout[MESH_SPEC_MAX_RANK];
    int ng = reshape_groups(a->rank, a->shape, rank, shape, gin, gout);
    mesh_spec s_in, s_out;
    mesh_spec_init(&s_in, a->rank);
    mesh_spec_init(&s_out, rank);
    for (int d = 0; d < a->rank; d++)
        if (gin[d] < 0) { /* size-1 dims keep their (size-1) axes */
            tup t = tup_of(&w, d);
            set_dim(&s_in, d, &t);
        }
    for (int g = 0; g < ng; g++) {
        tup flat;
        if (!group_contiguous(m, &target, shape, rank, gout, g, &flat) || !flat.n) continue;
        mesh_spec try_in = s_in;
        if (!group_spread(m, &try_in, a->shape, a->rank, gin, g, &flat)) continue;
        s_in = try_in;
        (void)group_spread(m, &s_out, shape, rank, gout, g, &flat);
    }
    uint32_t used = mesh_spec_dim_axes(&s_in);
    if (mesh_spec_check(&s_in, m) != SIM_OK) { /* a size-1 axis kept on a size-1 dim clashes: drop those */
        for (int d = 0; d < a->rank; d++)
            if (gin[d] < 0) s_in.n_axes[d] = 0;
        used = mesh_spec_dim_axes(&s_in);
    }
    s_in.partial = w.partial & ~used;
    s_out.partial = s_in.partial;
    sim_meta meta = op_meta(ctx, tag);
    staged sa = {.owned = false};
    SIM_TRY(stage(ctx, a, &w, &s_in, meta, &sa));
    /* the copy below fills every element (on the kernel pool): no zero-filling when there is one */
    sim_status st = (sa.arr.data ? mesh_array_new_raw : mesh_array_new)(ctx->dev, m, tag, rank, shape, &s_out, a->dtype,
                                                                        a->cat, out);
    if (st == SIM_OK && out->data && sa.arr.data) {
        SIM_ASSERT(out->nlocal == sa.arr.nlocal);
        bk_parallel_copy(out->data, sa.arr.data, out->nlocal * sim_dtype_size(a->dtype));
    }
    unstage(ctx, &sa);
    if (st == SIM_OK && !mesh_spec_equal(&s_out, &target)) {
        st = mesh_reshard(ctx->dev, m, out, &target, meta);
        if (st != SIM_OK) mesh_array_free(ctx->dev, out);
    }
    return st;
}

/* ======================================================================== */
/* reshard, constraints                                                      */
/* ======================================================================== */

static sim_status reshard_as(mesh_ctx *ctx, mesh_array *a, const mesh_spec *spec, const char *name, bool implicit)
{
    char tag[SIM_TAG_MAX];
    make_tag(ctx, name, tag, sizeof tag);
    mesh_spec t;
    SIM_TRY(mesh_spec_fit_rank(spec, a->rank, a->name, &t));
    SIM_TRY(mesh_spec_check(&t, ctx->mesh));
    sim_meta meta = implicit ? sim_meta_implicit(tag) : sim_meta_tag(tag);
    meta.weight = a->cat == SIM_MEM_PARAMS;
    return mesh_reshard(ctx->dev, ctx->mesh, a, &t, meta);
}

sim_status mesh_reshard_op(mesh_ctx *ctx, mesh_array *a, const mesh_spec *spec, const char *name)
{
    return reshard_as(ctx, a, spec, name, false);
}

sim_status mesh_with_sharding_constraint(mesh_ctx *ctx, mesh_array *a, const mesh_spec *spec, const char *name)
{
    if (ctx->mode == MESH_MODE_AUTO) return reshard_as(ctx, a, spec, name, true);
    char tag[SIM_TAG_MAX];
    make_tag(ctx, name, tag, sizeof tag);
    mesh_spec t;
    SIM_TRY(mesh_spec_fit_rank(spec, a->rank, a->name, &t));
    SIM_TRY(mesh_spec_check(&t, ctx->mesh));
    mesh_spec have = work_spec(ctx, &a->spec), want = work_spec(ctx, &t);
    if (mesh_spec_equal(&have, &want)) return SIM_OK;
    char buf[1024];
    sbuf s = {buf, sizeof buf, 0};
    sb_put(&s, "`with_sharding_constraint` acts as an assert when all axes of mesh are of type `Explicit`. The "
               "array sharding: ");
    sb_spec(&s, ctx->mesh, &have);
    sb_put(&s, " did not match the sharding provided: ");
    sb_spec(&s, ctx->mesh, &want);
    sb_put(&s, ". Please use `jax.sharding.reshard` to shard your input to the sharding you want.");
    err_ctx e = {ctx, tag, "with_sharding_constraint", 1, {a, NULL}, {&have, NULL}, NULL, NULL};
    mesh_spec h1 = have, w1 = want;
    mesh_spec_drop_size_one(&h1, ctx->mesh);
    mesh_spec_drop_size_one(&w1, ctx->mesh);
    return rule_error(&e, SIM_ERR_SHARDING, buf,
                      mesh_spec_equal(&h1, &w1)
                          ? "the specs differ only in size-1 mesh axes: they compare equal with drop_size_one "
                            "(MaxText's remove_size_one_mesh_axis_from_type) on; or reshard (mesh_reshard_op / "
                            "shard_as) to the spec with the size-1 axes where the sharding changes"
                          : "reshard (mesh_reshard_op / shard_as) where the sharding changes, or constrain to the "
                            "array's actual sharding");
}

sim_status mesh_shard_as(mesh_ctx *ctx, mesh_array *a, const mesh_spec *spec, const char *name)
{
    return reshard_as(ctx, a, spec, name, ctx->mode == MESH_MODE_AUTO);
}

/* ======================================================================== */
/* explicit-mode checks on types only                                        */
/* ======================================================================== */

/* Where a fused op of the simulator stands for several JAX ops of MaxText's layer code, the
 * layer calls these with the types MaxText's op would see, so explicit mode fails exactly where
 * MaxText's trace fails, with JAX's words (nothing is computed or moved). */

mesh_array mesh_array_view(const mesh_array *x, int rank, const int64_t *shape, const mesh_spec *spec)
{
    mesh_array v = *x;
    v.data = NULL;
    v.rank = rank;
    memcpy(v.shape, shape, (size_t)rank * sizeof *shape);
    v.spec = *spec;
    return v;
}

sim_status mesh_einsum_check(mesh_ctx *ctx, const char *subscripts, const mesh_array *a, const mesh_array *b,
                             const char *name, const char *where, const char *fix)
{
    if (ctx->mode != MESH_MODE_EXPLICIT) return SIM_OK;
    char tag[SIM_TAG_MAX], opdesc[96], err[256], sub[64];
    make_tag(ctx, name, tag, sizeof tag);
    snprintf(opdesc, sizeof opdesc, "einsum '%s'", subscripts);
    /* jnp.einsum's operand order for dot_general: (first, second) when batch ++ first's free ++
     * second's free is already the output order, else (second, first) */
    const char *comma = strchr(subscripts, ','), *arrow = strstr(subscripts, "->");
    if (!comma || !arrow || arrow < comma)
        return sim_err(SIM_ERR_INTERNAL, "%s: einsum '%s' needs two operands and an output", tag, subscripts);
    int na = (int)(comma - subscripts), nb = (int)(arrow - comma - 1);
    const char *sa = subscripts, *sb = comma + 1, *so = arrow + 2;
    char order[32];
    int no = 0;
    for (const char *c = so; *c && no < 30; c++)
        if (memchr(sa, *c, (size_t)na) && memchr(sb, *c, (size_t)nb)) order[no++] = *c; /* batch */
    for (int i = 0; i < na && no < 30; i++)
        if (!memchr(sb, sa[i], (size_t)nb) && strchr(so, sa[i])) order[no++] = sa[i];
    for (int i = 0; i < nb && no < 30; i++)
        if (!memchr(sa, sb[i], (size_t)na) && strchr(so, sb[i])) order[no++] = sb[i];
    order[no] = '\0';
    if (strcmp(order, so)) { /* JAX calls dot_general(second, first) */
        const mesh_array *t = a;
        a = b;
        b = t;
        snprintf(sub, sizeof sub, "%.*s,%.*s->%s", nb, sb, na, sa, so);
        subscripts = sub;
    }
    bk_einsum_dims d;
    if (bk_einsum_parse(subscripts, a->rank, a->shape, b->rank, b->shape, &d, err, sizeof err))
        return sim_err(SIM_ERR_INTERNAL, "%s: %s (operands '%s' and '%s')", tag, err, a->name, b->name);
    placement *p = calloc(1, sizeof *p);
    if (!p) return sim_err(SIM_ERR_INTERNAL, "%s: out of host memory", tag);
    p->m = ctx->mesh;
    p->nops = 2;
    p->from[0] = work_spec(ctx, &a->spec);
    p->from[1] = work_spec(ctx, &b->spec);
    sim_status st = einsum_rules(ctx, tag, opdesc, &d, a, b, NULL, p, where, fix);
    free(p);
    return st;
}

/* jax.typeof's long dtype names, used by the scan's carry message */
static const char *dtype_long(sim_dtype dt)
{
    switch (dt) {
    case SIM_F32: return "float32";
    case SIM_I32: return "int32";
    case SIM_BF16: return "bfloat16";
    case SIM_U8: return "uint8";
    default: return "?";
    }
}

sim_status mesh_scan_carry_check(mesh_ctx *ctx, const mesh_array *in, const mesh_array *out, const char *name,
                                 const char *where)
{
    if (ctx->mode != MESH_MODE_EXPLICIT) return SIM_OK;
    mesh_spec si = work_spec(ctx, &in->spec), so = work_spec(ctx, &out->spec);
    if (mesh_spec_equal(&si, &so)) return SIM_OK;
    char tag[SIM_TAG_MAX], ti[256], to[256], buf[2048];
    make_tag(ctx, name, tag, sizeof tag);
    /* JAX prints the carry types as jax.typeof does: float32[4@fsdp,128,256] */
    mesh_type_format(ctx->mesh, in->dtype, in->rank, in->shape, &si, ti, sizeof ti);
    mesh_type_format(ctx->mesh, out->dtype, out->rank, out->shape, &so, to, sizeof to);
    const char *ds = dtype_short(in->dtype), *dl = dtype_long(in->dtype);
    size_t ns = strlen(ds);
    sbuf b = {buf, sizeof buf, 0};
    /* JAX names the carry as the scanned function has it: 0.2.5's NNX scan carries the activations
     * alone ("carry"), 0.2.0's Linen scan a tuple whose second part they are ("component c[1]") */
    const char *carry = cfg_release_error_text(ctx->release, "decoder_scan_carry", "carry", "carry");
    sb_put(&b,
           "%s (scan): TypeError: scan body function carry input and carry output must have equal types, but "
           "they differ:\n  The input carry %s has type %s%s but the corresponding output carry component "
           "has type %s%s. Revise the function so that all output types match the corresponding input types.",
           tag, carry, dl, ti + ns, dl, to + ns);
    if (where) sb_put(&b, "\n  MaxText %s fails here too: %s", cfg_release_maxtext(ctx->release), where);
    sb_put(&b, "\n  fix: make the layer's output sharding equal its input's (the logical rules of the residual "
               "stream's length dim), or run in shard_mode=auto");
    return sim_err(SIM_ERR_SHARDING, "%s", buf);
}

sim_status mesh_broadcast_to_check(mesh_ctx *ctx, const char *dtype_label, int rank, const int64_t *in_shape,
                                   const mesh_spec *in_spec, const int64_t *out_shape, const mesh_spec *out_spec,
                                   const char *name, const char *where, const char *fix)
{
    if (ctx->mode != MESH_MODE_EXPLICIT) return SIM_OK;
    mesh_spec si = work_spec(ctx, in_spec), so = work_spec(ctx, out_spec);
    bool ok = true;
    /* jnp.broadcast_to(x, shape, out_sharding): a dim that is not broadcast keeps its sharding, so it
     * must already be the requested one; a broadcast (size-1) dim is unsharded */
    for (int d = 0; d < rank; d++) {
        if (in_shape[d] != out_shape[d]) continue;
        tup a = tup_of(&si, d), b = tup_of(&so, d);
        ok = ok && tup_eq(&a, &b);
    }
    if (ok) return SIM_OK;
    char tag[SIM_TAG_MAX], ti[256], to[256], buf[1536];
    make_tag(ctx, name, tag, sizeof tag);
    mesh_type_format(ctx->mesh, SIM_F32, rank, in_shape, &si, ti, sizeof ti);
    mesh_type_format(ctx->mesh, SIM_F32, rank, out_shape, &so, to, sizeof to);
    sbuf b = {buf, sizeof buf, 0};
    /* the types as JAX prints them: dtype name, then the dims ("f32" replaced by the label) */
    sb_put(&b,
           "%s (broadcast_to): ValueError: Incompatible types for broadcasting: input type=%s%s and requested "
           "type=%s%s",
           tag, dtype_label, ti + 3, dtype_label, to + 3);
    if (where) sb_put(&b, "\n  MaxText %s fails here too: %s", cfg_release_maxtext(ctx->release), where);
    if (fix) sb_put(&b, "\n  fix: %s", fix);
    return sim_err(SIM_ERR_SHARDING, "%s", buf);
}

sim_status mesh_mul_check(mesh_ctx *ctx, const mesh_array *a, const mesh_array *b, const char *name, const char *where,
                          const char *fix)
{
    if (ctx->mode != MESH_MODE_EXPLICIT) return SIM_OK;
    char tag[SIM_TAG_MAX];
    make_tag(ctx, name, tag, sizeof tag);
    if (a->rank != b->rank) return sim_err(SIM_ERR_INTERNAL, "%s: mul check needs equal ranks", tag);
    int64_t osh[MESH_SPEC_MAX_RANK];
    for (int d = 0; d < a->rank; d++) osh[d] = a->shape[d] > b->shape[d] ? a->shape[d] : b->shape[d];
    const mesh_array *x[2] = {a, b};
    mesh_spec w[2] = {work_spec(ctx, &a->spec), work_spec(ctx, &b->spec)};
    err_ctx e = {ctx, tag, "mul", 2, {a, b}, {&w[0], &w[1]}, where, fix};
    tup res[MESH_SPEC_MAX_RANK];
    return broadcast_rule(&e, "mul", a->rank, osh, x, w, res);
}
