/* reshard.h — the resharding planner: turns spec S into spec T with the
 * fewest bytes, as a list of steps that every device computes identically
 * from (mesh, global shape, S, T), then runs them through sim/ collectives.
 *
 *   change                                   step
 *   axis drops off a dim                     all-gather along that dim
 *   axis added to a dim                      local slice, no bytes
 *   axis moves from dim i to dim j           all-to-all (split j, concat i)
 *   partial axis, T shards a dim on it       reduce-scatter along that dim
 *   partial axis, T replicates               all-reduce
 *   replicated -> partial                    free (one contribution kept, the rest zero)
 *   a dim's trailing axes reorder            ppermute over them (('a','b') -> ('b','a')):
 *                                            each block goes straight to its new owner
 *
 * Order: free slices first (they shrink what later steps move), then
 * reductions (reduce-scatter where T can take the axis right away, else one
 * all-reduce over every axis still partial), then reorders within a dim
 * (a ppermute: devices whose block keeps its place send nothing, the others
 * send their block once), then all-to-all moves, then
 * all-gathers (of axes T does not use elsewhere first), repeating until the
 * spec is T.  Axes leave and join a dim at its least significant end, which
 * is what keeps blocks contiguous; consecutive axes that travel together go
 * in one collective over their ordered group. */
#ifndef MESH_RESHARD_H
#define MESH_RESHARD_H

#include <stdio.h>

#include "mesh/array.h"
#include "sim/collectives.h"

typedef enum {
    MESH_STEP_SLICE = 0,      /* keep block (coords on axes) of dim `dim` */
    MESH_STEP_ALL_GATHER,     /* gather dim `dim` over axes */
    MESH_STEP_REDUCE_SCATTER, /* sum partial axes, scatter dim `dim` over them */
    MESH_STEP_ALL_REDUCE,     /* sum partial axes */
    MESH_STEP_ALL_TO_ALL,     /* axes leave dim `dim` and join dim `dim_to` */
    MESH_STEP_MAKE_PARTIAL,   /* zero the copies off coordinate 0 of axes */
    MESH_STEP_PERMUTE         /* dim `dim`'s trailing axes reorder to `to_axes`: ppermute over axes */
} mesh_step_kind;

enum { MESH_STEP_KINDS = MESH_STEP_PERMUTE + 1 };

enum { MESH_PLAN_MAX = 48 };

typedef struct {
    mesh_step_kind kind;
    int dim;                               /* dim acted on (all-to-all: the dim the axes leave) */
    int dim_to;                            /* all-to-all: the dim the axes join; else -1 */
    sim_axes axes;                         /* mesh axes of the step, in significance order */
    sim_axes to_axes;                      /* permute: the same axes in their new order */
    int movers;                            /* permute: devices of a group whose block moves */
    int group;                             /* product of their sizes */
    mesh_spec after;                       /* spec once the step is done */
    int64_t local_in[MESH_SPEC_MAX_RANK];  /* local shape before */
    int64_t local_out[MESH_SPEC_MAX_RANK]; /* local shape after */
    uint64_t bytes_sent;                   /* per device, by the formulas (all-reduce: 2(k-1)n/k rounded
                                                 down; permute: a device whose block moves, others send 0) */
} mesh_step;

typedef struct {
    int rank;
    int64_t shape[MESH_SPEC_MAX_RANK];
    sim_dtype dtype;
    mesh_spec from, to;
    int n;
    mesh_step step[MESH_PLAN_MAX];
    uint64_t total_bytes; /* sum of bytes_sent: the busiest device's bytes */
} mesh_plan;

/* Bytes device `device` sends running the plan (differs from total_bytes
 * only where a permute leaves some devices' blocks in place). */
uint64_t mesh_plan_device_bytes(const mesh_plan *p, const mesh_shape *m, int device);

const char *mesh_step_name(mesh_step_kind k);

/* Plans S -> T.  Errors (bad spec, indivisible shape) name `name`. */
sim_status mesh_plan_make(const mesh_shape *m, const char *name, int rank, const int64_t *shape, sim_dtype dt,
                          const mesh_spec *from, const mesh_spec *to, mesh_plan *out);
/* Remembered per thread (by mesh, shape and both specs): total_bytes of mesh_plan_make(m,
 * name, rank, shape, SIM_F32, from, to) in *bytes, or 0 when from equals to; false when no
 * plan exists (no error is left set: the caller moves on to the next candidate).  `scratch`
 * holds the plan when one is made. */
bool mesh_plan_bytes_memo(const mesh_shape *m, mesh_plan *scratch, const char *name, int rank, const int64_t *shape,
                          const mesh_spec *from, const mesh_spec *to, uint64_t *bytes);
/* One line per step, then "total bytes sent per device: N". */
void mesh_plan_print(const mesh_plan *p, const mesh_shape *m, FILE *f);

/* Reshards `a` to `to` in place (new shard replaces the old one).  meta.tag
 * names the layer/op; meta.implicit marks planner-inserted collectives. */
sim_status mesh_reshard(sim_device *d, const mesh_shape *m, mesh_array *a, const mesh_spec *to, sim_meta meta);
/* The same for a read-only copy (a kernel's operand): a plan that is one
 * all-gather fills one buffer the whole group shares (sim_all_gather_dim_shared)
 * and leaves `a` MESH_HOLD_SHARED, counted in the arena as the plain gather's
 * output; any other plan, or opts.copy_gathers, runs as mesh_reshard.  The
 * bits are the same either way. */
sim_status mesh_reshard_shared(sim_device *d, const mesh_shape *m, mesh_array *a, const mesh_spec *to, sim_meta meta);
/* Runs a plan made for `a`.  A borrowed or shared shard (mesh_array hold) is
 * read where the first step writes a fresh buffer and copied first where it
 * works in place; `a` holds its own shard (or a shared one) afterwards. */
sim_status mesh_plan_run(sim_device *d, const mesh_shape *m, const mesh_plan *p, mesh_array *a, sim_meta meta);

/* ---- reuse of operand reshards ----------------------------------------------
 * An op that needs an operand in another sharding asks the cache first: the
 * same array (uid) in the same spec resharded to the same target is made
 * once per cache lifetime, as a compiler would do one all-gather of an
 * activation feeding several matmuls, or keep an FSDP-gathered weight for
 * the backward pass of its layer.  The autodiff tape owns one cache; its
 * values are immutable while it lives. */
typedef struct mesh_reshard_cache mesh_reshard_cache;

mesh_reshard_cache *mesh_reshard_cache_new(sim_device *d);
void mesh_reshard_cache_free(mesh_reshard_cache *c);
/* A copy of src (whose spec is `from`) in spec `to`, if made before (borrowed). */
bool mesh_reshard_cache_get(mesh_reshard_cache *c, const mesh_array *src, const mesh_spec *from, const mesh_spec *to,
                            mesh_array *out);
/* The targets of the copies of src (whose spec is `from`) made so far, in the
 * order they were made, into out[0..max); returns their number (which may
 * exceed max: then only max are written).  c may be NULL (none). */
int mesh_reshard_cache_targets(const mesh_reshard_cache *c, const mesh_array *src, const mesh_spec *from,
                               mesh_spec *out, int max);
/* Keeps `copy` (src resharded from `from`); the cache now owns it. */
void mesh_reshard_cache_put(mesh_reshard_cache *c, const mesh_array *src, const mesh_spec *from,
                            const mesh_array *copy);
/* Whether the kept copy of src (from -> to) was gathered as a windowed einsum (set / read; false
 * when never set or not kept). */
void mesh_reshard_cache_set_windowed(mesh_reshard_cache *c, const mesh_array *src, const mesh_spec *from,
                                     const mesh_spec *to, bool windowed);
bool mesh_reshard_cache_windowed(const mesh_reshard_cache *c, const mesh_array *src, const mesh_spec *from,
                                 const mesh_spec *to);

#endif
