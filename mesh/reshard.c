/* reshard.c — the resharding planner and its executor (see reshard.h). */
#include "mesh/reshard.h"

#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "mesh/planmemo.h"
#include "sim/arena.h"

const char *mesh_step_name(mesh_step_kind k)
{
    static const char *names[] = {"slice",      "all-gather",   "reduce-scatter", "all-reduce",
                                  "all-to-all", "make-partial", "ppermute"};
    return names[k];
}

/* ------------------------------------------------------------ spec helpers */

/* C's axes on dim d are a prefix of T's. */
static bool is_prefix(const mesh_spec *c, const mesh_spec *t, int d)
{
    if (c->n_axes[d] > t->n_axes[d]) return false;
    for (int i = 0; i < c->n_axes[d]; i++)
        if (c->axes[d][i] != t->axes[d][i]) return false;
    return true;
}

static int common_prefix(const mesh_spec *c, const mesh_spec *t, int d)
{
    int n = 0;
    while (n < c->n_axes[d] && n < t->n_axes[d] && c->axes[d][n] == t->axes[d][n]) n++;
    return n;
}

static bool axis_used(const mesh_spec *s, int a) { return (s->partial & (1u << a)) || mesh_spec_axis_dim(s, a) >= 0; }

static int64_t prod(const int64_t *v, int lo, int hi)
{
    int64_t p = 1;
    for (int i = lo; i < hi; i++) p *= v[i];
    return p;
}

/* ------------------------------------------------------------ planning */

typedef struct {
    const mesh_shape *m;
    mesh_plan *p;
    mesh_spec cur;
    int64_t local[MESH_SPEC_MAX_RANK];
    size_t es;
} planner;

/* Mixed-radix index of coordinates `coord` (indexed by mesh axis) over axes,
 * the first most significant. */
static int radix_index(const mesh_shape *m, const int *coord, const int8_t *axes, int n)
{
    int b = 0;
    for (int i = 0; i < n; i++) b = b * m->sizes[axes[i]] + coord[axes[i]];
    return b;
}

/* Permute over group axes g (current order) to order h: for the group member
 * of rank r (coordinates decoded from r over g), the rank whose block it
 * must receive is its index over h.  perm[src] = dst, as sim_ppermute takes it. */
static int permute_table(const mesh_shape *m, const sim_axes *g, const sim_axes *h, int *perm)
{
    int k = 1, movers = 0;
    for (int i = 0; i < g->n; i++) k *= m->sizes[g->axis[i]];
    for (int r = 0; r < k; r++) {
        int coord[MESH_MAX_AXES] = {0}, rem = r;
        for (int i = g->n - 1; i >= 0; i--) {
            coord[g->axis[i]] = rem % m->sizes[g->axis[i]];
            rem /= m->sizes[g->axis[i]];
        }
        int want = radix_index(m, coord, h->axis, h->n); /* the block r holds afterwards */
        perm[want] = r;
        movers += want != r;
    }
    return movers;
}

static sim_status add_step(planner *pl, mesh_step_kind kind, int dim, int dim_to, const int *axes, int n)
{
    mesh_plan *p = pl->p;
    if (p->n == MESH_PLAN_MAX) return sim_err(SIM_ERR_INTERNAL, "resharding plan longer than %d steps", MESH_PLAN_MAX);
    mesh_step *s = &p->step[p->n++];
    memset(s, 0, sizeof *s);
    s->kind = kind;
    s->dim = dim;
    s->dim_to = dim_to;
    s->group = 1;
    for (int i = 0; i < n; i++) {
        s->axes.axis[s->axes.n++] = (int8_t)axes[i];
        s->group *= pl->m->sizes[axes[i]];
    }
    memcpy(s->local_in, pl->local, sizeof s->local_in);
    uint64_t k = (uint64_t)s->group, nb = (uint64_t)prod(pl->local, 0, p->rank) * pl->es;
    mesh_spec *c = &pl->cur;
    switch (kind) {
    case MESH_STEP_SLICE:
        for (int i = 0; i < n; i++) c->axes[dim][c->n_axes[dim]++] = (int8_t)axes[i];
        pl->local[dim] /= s->group;
        break;
    case MESH_STEP_ALL_GATHER:
        c->n_axes[dim] -= n;
        pl->local[dim] *= s->group;
        s->bytes_sent = (k - 1) * nb;
        break;
    case MESH_STEP_REDUCE_SCATTER:
        for (int i = 0; i < n; i++) {
            c->axes[dim][c->n_axes[dim]++] = (int8_t)axes[i];
            c->partial &= ~(1u << axes[i]);
        }
        pl->local[dim] /= s->group;
        s->bytes_sent = (k - 1) * nb / k;
        break;
    case MESH_STEP_ALL_REDUCE:
        for (int i = 0; i < n; i++) c->partial &= ~(1u << axes[i]);
        s->bytes_sent = 2 * (k - 1) * nb / k;
        break;
    case MESH_STEP_ALL_TO_ALL:
        c->n_axes[dim] -= n;
        for (int i = 0; i < n; i++) c->axes[dim_to][c->n_axes[dim_to]++] = (int8_t)axes[i];
        pl->local[dim] *= s->group;
        pl->local[dim_to] /= s->group;
        s->bytes_sent = (k - 1) * nb / k;
        break;
    case MESH_STEP_MAKE_PARTIAL:
        for (int i = 0; i < n; i++) c->partial |= 1u << axes[i];
        break;
    case MESH_STEP_PERMUTE: {
        /* axes[0..n) = the new order of the last n axes of dim */
        int cp = c->n_axes[dim] - n;
        s->axes.n = 0;
        for (int i = 0; i < n; i++) {
            s->axes.axis[s->axes.n++] = c->axes[dim][cp + i];
            s->to_axes.axis[s->to_axes.n++] = (int8_t)axes[i];
            c->axes[dim][cp + i] = (int8_t)axes[i];
        }
        int perm[SIM_MAX_DEVICES];
        s->movers = permute_table(pl->m, &s->axes, &s->to_axes, perm);
        s->bytes_sent = s->movers ? nb : 0;
        break;
    }
    }
    s->after = *c;
    memcpy(s->local_out, pl->local, sizeof s->local_out);
    p->total_bytes += s->bytes_sent;
    return SIM_OK;
}

/* One step towards T; *done when the spec is T. */
static sim_status plan_one(planner *pl, const mesh_spec *t, bool *done)
{
    mesh_spec *c = &pl->cur;
    int rank = t->rank, list[MESH_MAX_AXES], n;
    *done = mesh_spec_equal(c, t);
    if (*done) return SIM_OK;
    /* 1. free slices: T appends an axis the array does not use yet */
    for (int d = 0; d < rank; d++) {
        if (!is_prefix(c, t, d)) continue;
        n = 0;
        for (int p = c->n_axes[d]; p < t->n_axes[d] && !axis_used(c, t->axes[d][p]); p++) list[n++] = t->axes[d][p];
        if (n) return add_step(pl, MESH_STEP_SLICE, d, -1, list, n);
    }
    uint32_t reduce = c->partial & ~t->partial;
    /* 2. reduce-scatter where T appends a partial axis to a dim now */
    for (int d = 0; d < rank; d++) {
        if (!is_prefix(c, t, d)) continue;
        n = 0;
        for (int p = c->n_axes[d]; p < t->n_axes[d] && (reduce & (1u << t->axes[d][p])); p++) list[n++] = t->axes[d][p];
        if (n) return add_step(pl, MESH_STEP_REDUCE_SCATTER, d, -1, list, n);
    }
    /* 3. every other partial axis T does not keep: one all-reduce (before any gather grows the array) */
    if (reduce) {
        n = 0;
        for (int a = 0; a < pl->m->n_axes; a++)
            if (reduce & (1u << a)) list[n++] = a;
        return add_step(pl, MESH_STEP_ALL_REDUCE, -1, -1, list, n);
    }
    /* 4. a dim whose remaining axes are T's in another order: one ppermute */
    for (int d = 0; d < rank; d++) {
        int cp = common_prefix(c, t, d), nc = c->n_axes[d] - cp;
        if (nc < 2 || nc != t->n_axes[d] - cp) continue;
        bool same_set = true;
        for (int x = cp; x < t->n_axes[d] && same_set; x++) same_set = mesh_spec_axis_dim(c, t->axes[d][x]) == d;
        if (!same_set) continue;
        for (int x = 0; x < nc; x++) list[x] = t->axes[d][cp + x];
        return add_step(pl, MESH_STEP_PERMUTE, d, -1, list, nc);
    }
    /* 5. all-to-all: the trailing axes of dim i are what T appends to dim j next */
    for (int i = 0; i < rank; i++) {
        if (is_prefix(c, t, i)) continue;
        int ni = c->n_axes[i], last = c->axes[i][ni - 1], j = mesh_spec_axis_dim(t, last);
        if (j < 0 || j == i || !is_prefix(c, t, j)) continue;
        int p = c->n_axes[j], q = -1;
        for (int x = p; x < t->n_axes[j]; x++)
            if (t->axes[j][x] == last) q = x;
        int mlen = q - p + 1;
        if (q < 0 || mlen > ni - common_prefix(c, t, i)) continue;
        bool ok = true;
        for (int x = 0; x < mlen; x++) ok = ok && c->axes[i][ni - mlen + x] == t->axes[j][p + x];
        if (!ok) continue;
        for (int x = 0; x < mlen; x++) list[x] = c->axes[i][ni - mlen + x];
        return add_step(pl, MESH_STEP_ALL_TO_ALL, i, j, list, mlen);
    }
    /* 6. all-gather: first trailing axes T does not place on any dim, then any trailing axis */
    for (int pass = 0; pass < 2; pass++) {
        for (int i = 0; i < rank; i++) {
            if (is_prefix(c, t, i)) continue;
            int ni = c->n_axes[i], cp = common_prefix(c, t, i), take = 0;
            while (take < ni - cp && mesh_spec_axis_dim(t, c->axes[i][ni - 1 - take]) < 0) take++;
            if (pass == 1 && take == 0) take = 1;
            if (!take) continue;
            for (int x = 0; x < take; x++) list[x] = c->axes[i][ni - take + x];
            return add_step(pl, MESH_STEP_ALL_GATHER, i, -1, list, take);
        }
    }
    /* 7. partial axes T introduces */
    uint32_t make = t->partial & ~c->partial;
    n = 0;
    for (int a = 0; a < pl->m->n_axes; a++)
        if ((make & (1u << a)) && mesh_spec_axis_dim(c, a) < 0) list[n++] = a;
    if (n) return add_step(pl, MESH_STEP_MAKE_PARTIAL, -1, -1, list, n);
    return sim_err(SIM_ERR_INTERNAL, "the resharding planner found no step towards the target spec");
}

sim_status mesh_plan_make(const mesh_shape *m, const char *name, int rank, const int64_t *shape, sim_dtype dt,
                          const mesh_spec *from, const mesh_spec *to, mesh_plan *out)
{
    /* the header only: add_step clears each step it appends, and the einsum
     * placement search makes thousands of plans (a whole-plan memset of
     * MESH_PLAN_MAX steps was a tenth of a large dry run) */
    memset(out, 0, offsetof(mesh_plan, step));
    out->total_bytes = 0;
    mesh_spec f, t;
    SIM_TRY(mesh_spec_fit_rank(from, rank, name, &f));
    SIM_TRY(mesh_spec_fit_rank(to, rank, name, &t));
    from = &f;
    to = &t;
    SIM_TRY(mesh_spec_check(from, m));
    SIM_TRY(mesh_spec_check(to, m));
    SIM_TRY(mesh_spec_check_shape(from, m, rank, shape, name));
    SIM_TRY(mesh_spec_check_shape(to, m, rank, shape, name));
    out->rank = rank;
    if (rank) memcpy(out->shape, shape, (size_t)rank * sizeof *shape);
    out->dtype = dt;
    out->from = *from;
    out->to = *to;
    planner pl = {m, out, *from, {0}, sim_dtype_size(dt)};
    mesh_spec_local_shape(from, m, shape, pl.local);
    if ((from->partial & ~to->partial) && dt != SIM_F32 && dt != SIM_I32)
        return sim_err(SIM_ERR_INPUT, "array '%s': partial sums need float32 or int32, not %s", name,
                       sim_dtype_name(dt));
    for (;;) {
        bool done;
        SIM_TRY(plan_one(&pl, to, &done));
        if (done) break;
    }
    return SIM_OK;
}

static void format_shape(const int64_t *s, int rank, char *buf, size_t cap)
{
    size_t n = (size_t)snprintf(buf, cap, "(");
    for (int i = 0; i < rank && n < cap; i++)
        n += (size_t)snprintf(buf + n, cap - n, "%s%lld", i ? "," : "", (long long)s[i]);
    if (n < cap) snprintf(buf + n, cap - n, ")");
}

uint64_t mesh_plan_device_bytes(const mesh_plan *p, const mesh_shape *m, int device)
{
    int coord[MESH_MAX_AXES] = {0}, rem = device;
    for (int a = m->n_axes - 1; a >= 0; a--) {
        coord[a] = rem % m->sizes[a];
        rem /= m->sizes[a];
    }
    uint64_t b = 0;
    for (int i = 0; i < p->n; i++) {
        const mesh_step *s = &p->step[i];
        if (s->kind != MESH_STEP_PERMUTE) b += s->bytes_sent;
        else if (radix_index(m, coord, s->axes.axis, s->axes.n) != radix_index(m, coord, s->to_axes.axis, s->to_axes.n))
            b += s->bytes_sent; /* its block is needed elsewhere (a permutation moves blocks in cycles) */
    }
    return b;
}

void mesh_plan_print(const mesh_plan *p, const mesh_shape *m, FILE *f)
{
    char spec[256], ax[128], li[64], lo[64];
    sim_mesh_desc md;
    if (mesh_shape_to_sim(m, &md) != SIM_OK) return;
    if (p->n == 0) fprintf(f, "no step: the array already has the target sharding\n");
    for (int i = 0; i < p->n; i++) {
        const mesh_step *s = &p->step[i];
        mesh_spec_format(&s->after, m, spec, sizeof spec);
        format_shape(s->local_in, p->rank, li, sizeof li);
        format_shape(s->local_out, p->rank, lo, sizeof lo);
        char where[32] = "";
        if (s->kind == MESH_STEP_ALL_TO_ALL) snprintf(where, sizeof where, "dim %d -> dim %d", s->dim, s->dim_to);
        else if (s->dim >= 0) snprintf(where, sizeof where, "dim %d", s->dim);
        else snprintf(where, sizeof where, "all dims");
        fprintf(f, "step %d: %-14s %-16s over %-22s k=%-3d local %s -> %s  sent/device %llu B  now %s\n", i + 1,
                mesh_step_name(s->kind), where, sim_axes_label(&md, s->axes, ax, sizeof ax), s->group, li, lo,
                (unsigned long long)s->bytes_sent, spec);
    }
    bool uneven = false;
    for (int i = 0; i < p->n; i++)
        uneven |= p->step[i].kind == MESH_STEP_PERMUTE && p->step[i].movers < p->step[i].group;
    if (uneven)
        fprintf(f, "(ppermute: a device whose block keeps its place sends nothing; figures are for one that moves)\n");
    fprintf(f, "total bytes sent per device: %llu\n", (unsigned long long)p->total_bytes);
}

/* ------------------------------------------------------------ execution */

static int block_index(sim_device *d, sim_axes axes, const mesh_shape *m)
{
    int b = 0;
    for (int i = 0; i < axes.n; i++) b = b * m->sizes[axes.axis[i]] + sim_device_coord(d, axes.axis[i]);
    return b;
}

/* A shard of its own for `a` (mesh_array hold), before a step that writes it in place or when the
 * plan ends: a borrowed or shared shard is copied into an arena block, which takes over the bytes
 * already counted (sim_arena_back), and a shared buffer's reference is given back. */
static sim_status own_shard(sim_device *d, mesh_array *a)
{
    if (a->hold == MESH_HOLD_OWN) return SIM_OK;
    size_t bytes = a->nlocal * sim_dtype_size(a->dtype);
    void *own = NULL;
    SIM_TRY(sim_arena_back(sim_device_arena(d), bytes, a->cat, a->name, &own));
    if (own && a->data) memcpy(own, a->data, bytes);
    if (a->hold == MESH_HOLD_SHARED) sim_shared_release(d, a->data);
    a->data = own;
    a->hold = MESH_HOLD_OWN;
    return SIM_OK;
}

/* share: a plan that is one all-gather gathers into the group's one buffer (mesh_reshard_shared). */
static sim_status plan_run(sim_device *d, const mesh_shape *m, const mesh_plan *p, mesh_array *a, sim_meta meta,
                           bool share)
{
    sim_arena *arena = sim_device_arena(d);
    size_t es = sim_dtype_size(a->dtype), cs = sim_dtype_size(a->counted);
    meta = mesh_array_meta(a, meta);
    const sim_machine_opts *opts = sim_machine_options(sim_device_machine(d));
    share = share && p->n == 1 && p->step[0].kind == MESH_STEP_ALL_GATHER && !opts->copy_gathers &&
            (meta.weight || !opts->copy_activation_gathers);
    for (int i = 0; i < p->n; i++) {
        const mesh_step *s = &p->step[i];
        int64_t outer = prod(s->local_in, 0, s->dim < 0 ? 0 : s->dim);
        int64_t inner = s->dim < 0 ? 1 : prod(s->local_in, s->dim + 1, p->rank);
        int64_t mid = s->dim < 0 ? prod(s->local_in, 0, p->rank) : s->local_in[s->dim];
        size_t n_out = (size_t)prod(s->local_out, 0, p->rank);
        bool fresh = s->kind != MESH_STEP_ALL_REDUCE && s->kind != MESH_STEP_MAKE_PARTIAL;
        /* a fresh output reads the shard wherever it is; a step in place needs one of a's own */
        if (!fresh) SIM_TRY(own_shard(d, a));
        void *out = a->data;
        if (fresh && share) /* counted as the plain gather's output is, held in the group's buffer */
            SIM_TRY(sim_arena_charge(arena, n_out * cs, a->cat, a->name));
        else if (fresh) SIM_TRY(sim_arena_alloc_counted(arena, n_out * es, n_out * cs, a->cat, a->name, false, &out));
        sim_status st = SIM_OK;
        switch (s->kind) {
        case MESH_STEP_SLICE:
            if (a->data) {
                int64_t start[MESH_SPEC_MAX_RANK] = {0};
                start[s->dim] = (int64_t)block_index(d, s->axes, m) * s->local_out[s->dim];
                mesh_copy_block(out, a->data, p->rank, s->local_in, s->local_out, start, es);
            }
            break;
        case MESH_STEP_ALL_GATHER:
            if (share)
                st = sim_all_gather_dim_shared(d, a->data, &out, (size_t)outer, (size_t)mid, (size_t)inner, a->dtype,
                                               s->axes, meta);
            else
                st = sim_all_gather_dim(d, a->data, out, (size_t)outer, (size_t)mid, (size_t)inner, a->dtype, s->axes,
                                        meta);
            break;
        case MESH_STEP_REDUCE_SCATTER: {
            sim_meta rs = meta; /* along the last dim: the slice each device keeps (an XLA:TPU rule reads it) */
            rs.lane_slice = s->dim == p->rank - 1 ? (size_t)s->local_out[s->dim] : 0;
            st = sim_reduce_scatter_dim(d, a->data, out, (size_t)outer, (size_t)mid, (size_t)inner, a->dtype, s->axes,
                                        rs);
            break;
        }
        case MESH_STEP_ALL_REDUCE:
            mesh_array_owned(a);
            st = sim_all_reduce(d, a->data, a->data, a->nlocal, a->dtype, s->axes, meta);
            break;
        case MESH_STEP_ALL_TO_ALL: {
            size_t shape[MESH_SPEC_MAX_RANK];
            for (int x = 0; x < p->rank; x++) shape[x] = (size_t)s->local_in[x];
            st = sim_all_to_all_dims(d, a->data, out, p->rank, shape, s->dim_to, s->dim, a->dtype, s->axes, meta);
            break;
        }
        case MESH_STEP_MAKE_PARTIAL:
            mesh_array_owned(a);
            if (a->data && block_index(d, s->axes, m) != 0) memset(a->data, 0, a->nlocal * es);
            break;
        case MESH_STEP_PERMUTE: {
            int perm[SIM_MAX_DEVICES];
            permute_table(m, &s->axes, &s->to_axes, perm);
            st = sim_ppermute(d, a->data, out, a->nlocal, perm, a->dtype, s->axes, meta);
            break;
        }
        }
        if (fresh) {
            if (st != SIM_OK) {
                if (share) sim_arena_discharge(arena, n_out * cs, a->cat);
                else sim_arena_release_counted(arena, out, n_out * es, n_out * cs, a->cat);
                return st;
            }
            mesh_array_free(d, a); /* the shard it replaces: a block, a reference or a borrowed count */
            a->data = out;
            a->hold = share ? MESH_HOLD_SHARED : MESH_HOLD_OWN;
        }
        SIM_TRY(st);
        a->nlocal = n_out;
        memcpy(a->local, s->local_out, sizeof a->local);
        a->spec = s->after;
    }
    if (a->hold == MESH_HOLD_BORROWED) return own_shard(d, a); /* no step replaced it: a view never outlives its plan */
    return SIM_OK;
}

sim_status mesh_plan_run(sim_device *d, const mesh_shape *m, const mesh_plan *p, mesh_array *a, sim_meta meta)
{
    return plan_run(d, m, p, a, meta, false);
}

/* ---- the bytes of plans, remembered per thread ---------------------------------
 * The einsum placement search prices every candidate placement by the plans it
 * needs and finds the same few hundred (shape, from, to) triples on every layer,
 * pass and device: a 256-device dry run of a deep model makes millions of plans
 * to read their total_bytes.  A direct-mapped table of 64 slots per thread
 * (device threads make their own plans: no locks); a slot holds a packed key
 * (rank, shape, each spec's dims, axes and partial axes: the inputs the plan's
 * bytes depend on) and the figure.  A different mesh empties the table. */

enum { PM_SLOTS = 64, PM_KEY = 104 }; /* a key that does not fit (a rank-8 shape on many axes) is not kept */

typedef struct {
    unsigned long gen; /* valid while equal to pm_gen */
    uint64_t hash;
    int key_len;
    bool ok; /* a plan exists */
    uint64_t bytes;
    unsigned char key[PM_KEY];
} pm_slot;

static _Thread_local unsigned long pm_gen;
static _Thread_local mesh_shape pm_mesh;
static _Thread_local bool pm_used;
static _Thread_local pm_slot pm_slots[PM_SLOTS];

/* Bytes the packed key of (rank, from, to) needs. */
static int key_need(int rank, const mesh_spec *from, const mesh_spec *to)
{
    int n = 1 + 8 * rank;
    const mesh_spec *s[2] = {from, to};
    for (int k = 0; k < 2; k++) {
        n += 1 + 4;
        for (int d = 0; d < s[k]->rank; d++) {
            if (s[k]->n_axes[d] > MESH_MAX_AXES) return PM_KEY + 1; /* not a valid spec: no memo */
            n += 1 + (s[k]->n_axes[d] > 0 ? s[k]->n_axes[d] : 0);
        }
    }
    return n;
}

static bool make(const mesh_shape *m, mesh_plan *scratch, const char *name, int rank, const int64_t *shape,
                 const mesh_spec *from, const mesh_spec *to, uint64_t *bytes)
{
    if (mesh_plan_make(m, name, rank, shape, SIM_F32, from, to, scratch) != SIM_OK) return false;
    *bytes = scratch->total_bytes;
    return true;
}

static int pack_spec(unsigned char *k, int n, const mesh_spec *s)
{
    k[n++] = (unsigned char)s->rank;
    for (int d = 0; d < s->rank; d++) {
        int na = s->n_axes[d] > 0 ? s->n_axes[d] : 0;
        k[n++] = (unsigned char)na;
        for (int i = 0; i < na; i++) k[n++] = (unsigned char)s->axes[d][i];
    }
    memcpy(k + n, &s->partial, 4);
    return n + 4;
}

bool mesh_plan_bytes_memo(const mesh_shape *m, mesh_plan *scratch, const char *name, int rank, const int64_t *shape,
                          const mesh_spec *from, const mesh_spec *to, uint64_t *bytes)
{
    if (mesh_spec_equal(from, to)) {
        *bytes = 0;
        return true;
    }
    if (rank < 0 || rank > MESH_SPEC_MAX_RANK || from->rank < 0 || from->rank > MESH_SPEC_MAX_RANK || to->rank < 0 ||
        to->rank > MESH_SPEC_MAX_RANK || key_need(rank, from, to) > PM_KEY)
        return make(m, scratch, name, rank, shape, from, to, bytes); /* its own error, as before */
    if (!pm_used || memcmp(&pm_mesh, m, sizeof *m)) {
        pm_gen++; /* empties every slot without touching them */
        pm_mesh = *m;
        pm_used = true;
    }
    unsigned char key[PM_KEY];
    int n = 0;
    key[n++] = (unsigned char)rank;
    memcpy(key + n, shape, (size_t)rank * sizeof *shape);
    n += rank * (int)sizeof *shape;
    n = pack_spec(key, n, from);
    n = pack_spec(key, n, to);
    uint64_t h = 0xcbf29ce484222325ull; /* FNV-1a 64 */
    for (int i = 0; i < n; i++) h = (h ^ key[i]) * 0x100000001b3ull;
    pm_slot *s = &pm_slots[h % PM_SLOTS];
    if (s->gen == pm_gen && s->hash == h && s->key_len == n && !memcmp(s->key, key, (size_t)n)) {
        *bytes = s->bytes;
        return s->ok;
    }
    bool ok = make(m, scratch, name, rank, shape, from, to, bytes); /* a failure leaves its error, as before */
    s->gen = pm_gen;
    s->hash = h;
    s->key_len = n;
    memcpy(s->key, key, (size_t)n);
    s->ok = ok;
    s->bytes = ok ? *bytes : 0;
    return ok;
}

/* ---- plans shared by the devices ---------------------------------------------
 * Every device reshards the same global array from the same spec to the same
 * target, and a plan is a function of (mesh, shape, dtype, from, to): the
 * first device to need one makes it, the others copy its steps from the
 * shared memo (mesh/planmemo).  A plan that fails is not kept (each device
 * makes it again, and gets the error naming its array). */

enum { PLAN_KEY_MAX = 512 };

static int plan_key(const mesh_shape *m, int rank, const int64_t *shape, sim_dtype dt, const mesh_spec *from,
                    const mesh_spec *to, unsigned char *k)
{
    int head[3] = {mesh_memo_mesh_id(m), rank, (int)dt};
    if (head[0] < 0 || rank < 0 || rank > MESH_SPEC_MAX_RANK) return -1;
    int n = mesh_memo_key_bytes(k, 0, PLAN_KEY_MAX, head, (int)sizeof head);
    n = mesh_memo_key_bytes(k, n, PLAN_KEY_MAX, shape, rank * (int)sizeof *shape);
    n = mesh_memo_key_spec(k, n, PLAN_KEY_MAX, from);
    return mesh_memo_key_spec(k, n, PLAN_KEY_MAX, to);
}

/* A kept plan: the header up to the steps, its n steps, then total_bytes (which
 * follows the MESH_PLAN_MAX steps in mesh_plan). */
static size_t plan_head(void) { return offsetof(mesh_plan, step); }

static sim_status plan_shared(const mesh_shape *m, const char *name, int rank, const int64_t *shape, sim_dtype dt,
                              const mesh_spec *from, const mesh_spec *to, mesh_plan *out)
{
    unsigned char key[PLAN_KEY_MAX];
    int klen = plan_key(m, rank, shape, dt, from, to, key);
    int vlen;
    const unsigned char *kept = klen > 0 ? mesh_memo_find(key, klen, &vlen) : NULL;
    if (kept) {
        memcpy(out, kept, plan_head());
        size_t steps = (size_t)out->n * sizeof out->step[0];
        SIM_ASSERT(out->n >= 0 && out->n <= MESH_PLAN_MAX && (size_t)vlen == plan_head() + steps + 8);
        memcpy(out->step, kept + plan_head(), steps);
        memcpy(&out->total_bytes, kept + plan_head() + steps, 8);
        return SIM_OK;
    }
    SIM_TRY(mesh_plan_make(m, name, rank, shape, dt, from, to, out));
    if (klen > 0) {
        size_t steps = (size_t)out->n * sizeof out->step[0], len = plan_head() + steps + 8;
        unsigned char *v = malloc(len);
        SIM_ASSERT(v);
        memcpy(v, out, plan_head());
        memcpy(v + plan_head(), out->step, steps);
        memcpy(v + plan_head() + steps, &out->total_bytes, 8);
        mesh_memo_put(key, klen, v, (int)len);
        free(v);
    }
    return SIM_OK;
}

sim_status mesh_reshard(sim_device *d, const mesh_shape *m, mesh_array *a, const mesh_spec *to, sim_meta meta)
{
    mesh_plan p;
    SIM_TRY(plan_shared(m, a->name, a->rank, a->shape, a->dtype, &a->spec, to, &p));
    return plan_run(d, m, &p, a, meta, false);
}

sim_status mesh_reshard_shared(sim_device *d, const mesh_shape *m, mesh_array *a, const mesh_spec *to, sim_meta meta)
{
    mesh_plan p;
    SIM_TRY(plan_shared(m, a->name, a->rank, a->shape, a->dtype, &a->spec, to, &p));
    return plan_run(d, m, &p, a, meta, true);
}

/* ------------------------------------------------------------ reshard cache */

typedef struct {
    uint64_t uid;
    mesh_spec from, to;
    mesh_array copy;
    bool windowed; /* a weight's gather run as a windowed einsum for the product that made it */
} cache_entry;

struct mesh_reshard_cache {
    sim_device *dev;
    cache_entry *e;
    int n, cap;
};

mesh_reshard_cache *mesh_reshard_cache_new(sim_device *d)
{
    mesh_reshard_cache *c = calloc(1, sizeof *c);
    SIM_ASSERT(c);
    c->dev = d;
    return c;
}

void mesh_reshard_cache_free(mesh_reshard_cache *c)
{
    if (!c) return;
    for (int i = c->n - 1; i >= 0; i--) mesh_array_free(c->dev, &c->e[i].copy);
    free(c->e);
    free(c);
}

bool mesh_reshard_cache_get(mesh_reshard_cache *c, const mesh_array *src, const mesh_spec *from, const mesh_spec *to,
                            mesh_array *out)
{
    for (int i = 0; c && i < c->n; i++) {
        const cache_entry *e = &c->e[i];
        if (e->uid == src->uid && mesh_spec_equal(&e->from, from) && mesh_spec_equal(&e->to, to)) {
            *out = e->copy;
            return true;
        }
    }
    return false;
}

int mesh_reshard_cache_targets(const mesh_reshard_cache *c, const mesh_array *src, const mesh_spec *from,
                               mesh_spec *out, int max)
{
    int n = 0;
    for (int i = 0; c && i < c->n; i++) {
        const cache_entry *e = &c->e[i];
        if (e->uid != src->uid || !mesh_spec_equal(&e->from, from)) continue;
        if (n < max) out[n] = e->to;
        n++;
    }
    return n;
}

void mesh_reshard_cache_put(mesh_reshard_cache *c, const mesh_array *src, const mesh_spec *from, const mesh_array *copy)
{
    if (c->n == c->cap) {
        c->cap = c->cap ? 2 * c->cap : 16;
        c->e = realloc(c->e, (size_t)c->cap * sizeof *c->e);
        SIM_ASSERT(c->e);
    }
    cache_entry *e = &c->e[c->n++];
    e->uid = src->uid;
    e->from = *from;
    e->to = copy->spec;
    e->copy = *copy;
    e->windowed = false;
}

void mesh_reshard_cache_set_windowed(mesh_reshard_cache *c, const mesh_array *src, const mesh_spec *from,
                                     const mesh_spec *to, bool windowed)
{
    for (int i = 0; c && i < c->n; i++) {
        cache_entry *e = &c->e[i];
        if (e->uid == src->uid && mesh_spec_equal(&e->from, from) && mesh_spec_equal(&e->to, to))
            e->windowed = windowed;
    }
}

bool mesh_reshard_cache_windowed(const mesh_reshard_cache *c, const mesh_array *src, const mesh_spec *from,
                                 const mesh_spec *to)
{
    for (int i = 0; c && i < c->n; i++) {
        const cache_entry *e = &c->e[i];
        if (e->uid == src->uid && mesh_spec_equal(&e->from, from) && mesh_spec_equal(&e->to, to)) return e->windowed;
    }
    return false;
}
