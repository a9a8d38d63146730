/* array.h — the distributed array: a global shape, a PartitionSpec (with
 * partial axes) on a mesh, and this device's shard in its arena.  Every
 * device holds its own mesh_array value describing the same global array
 * (SPMD); model code reasons in global shapes and specs, never local sizes.
 * In dry run `data` is NULL and only the accounting happens. */
#ifndef MESH_ARRAY_H
#define MESH_ARRAY_H

#include <stdbool.h>

#include "mesh/spec.h"
#include "sim/collectives.h"
#include "sim/machine.h"

enum { MESH_NAME_MAX = 128 };

/* Whose storage an array's shard is.  Only MESH_HOLD_OWN may be written:
 * every function that writes a shard in place asserts it (mesh_array_owned). */
typedef enum {
    MESH_HOLD_OWN = 0,  /* a block of the device's arena */
    MESH_HOLD_SHARED,   /* the buffer of a shared all-gather (sim_all_gather_dim_shared), one for the whole
                           group: read-only, counted in the arena without storage (sim_arena_charge);
                           mesh_array_free gives the reference back */
    MESH_HOLD_BORROWED, /* another array's shard, about to be resharded (mesh_array_borrow): read-only,
                           counted only; never outlives the reshard that follows */
    MESH_HOLD_GHOST     /* no storage (data NULL): a product the simulator added straight into another
                           array (mesh_einsum_into), counted as the modelled program holds it */
} mesh_hold;

typedef struct {
    char name[MESH_NAME_MAX];          /* MaxText path for parameters, layer/op for activations */
    int rank;                          /* number of dims */
    int64_t shape[MESH_SPEC_MAX_RANK]; /* global shape */
    int64_t local[MESH_SPEC_MAX_RANK]; /* this device's shard shape */
    mesh_spec spec;                    /* placement, with partial axes */
    sim_dtype dtype;                   /* as stored (float32 for every computed value) */
    sim_dtype counted;                 /* as counted in the arena: the dtype the modelled program
                                               holds it in (sim_device_counted_dtype, or mesh_array_recount) */
    bool counted_fixed;                /* `counted` set by mesh_array_recount: clones keep it */
    sim_mem_cat cat;                   /* arena category of the shard */
    size_t nlocal;                     /* elements of the shard */
    void *data;                        /* the shard, row-major; NULL in dry run */
    uint64_t uid;                      /* identity of this shard on its device (new per allocation) */
    mesh_hold hold;                    /* whose storage `data` is (MESH_HOLD_OWN: the arena's) */
} mesh_array;

/* For functions that write a shard in place: a shared or borrowed one would be a bug. */
#define mesh_array_owned(a) SIM_ASSERT((a)->hold == MESH_HOLD_OWN)

/* Converts a mesh shape to the simulator's mesh description (same axis order). */
sim_status mesh_shape_to_sim(const mesh_shape *m, sim_mesh_desc *out);

/* JAX pads a PartitionSpec shorter than the array with None: returns `s`
 * widened to `rank` dims, or an error naming `name` when it is longer. */
sim_status mesh_spec_fit_rank(const mesh_spec *s, int rank, const char *name, mesh_spec *out);

/* A zero-filled array with `spec`; checks divisibility (errors name `name`). */
sim_status mesh_array_new(sim_device *d, const mesh_shape *m, const char *name, int rank, const int64_t *shape,
                          const mesh_spec *spec, sim_dtype dt, sim_mem_cat cat, mesh_array *out);
/* The same without zero-filling: for outputs the caller overwrites entirely. */
sim_status mesh_array_new_raw(sim_device *d, const mesh_shape *m, const char *name, int rank, const int64_t *shape,
                              const mesh_spec *spec, sim_dtype dt, sim_mem_cat cat, mesh_array *out);
/* An array counted in the arena exactly as mesh_array_new_raw counts it (sim_arena_charge), with
 * no storage (MESH_HOLD_GHOST, data NULL): a value the modelled program holds on its own while the
 * simulator adds it straight into another array (mesh_einsum_into).  mesh_array_recount and
 * mesh_array_free treat it as any array. */
sim_status mesh_array_new_ghost(sim_device *d, const mesh_shape *m, const char *name, int rank, const int64_t *shape,
                                const mesh_spec *spec, sim_dtype dt, sim_mem_cat cat, mesh_array *out);
/* Either of the two, counted in `counted` whatever the category (fixed: see mesh_array_recount). */
sim_status mesh_array_new_as(sim_device *d, const mesh_shape *m, const char *name, int rank, const int64_t *shape,
                             const mesh_spec *spec, sim_dtype dt, sim_dtype counted, sim_mem_cat cat, bool zero,
                             mesh_array *out);
/* A copy of `src` (same spec and shard) under a new name and category. */
sim_status mesh_array_clone(sim_device *d, const mesh_shape *m, const mesh_array *src, const char *name,
                            sim_mem_cat cat, mesh_array *out);
/* What mesh_array_clone counts, without the copy: `out` views src's shard
 * (MESH_HOLD_BORROWED), counted in the arena as the clone would be, for a
 * reshard that reads it into a new buffer anyway (mesh_plan_run makes the
 * copy itself when its first step works in place). */
sim_status mesh_array_borrow(sim_device *d, const mesh_shape *m, const mesh_array *src, const char *name,
                             sim_mem_cat cat, mesh_array *out);
/* Releases the shard (the struct may be reused); a shared one gives its reference back. */
void mesh_array_free(sim_device *d, mesh_array *a);
/* Counts `a` in dtype `dt` from now on (where the modelled program casts:
 * float32 logits, say); the arena's live bytes change by the difference. */
void mesh_array_recount(sim_device *d, mesh_array *a, sim_dtype dt);
/* The dtype a copy of parameter w made for a kernel (its all-gather, any reshard) is held and moved
 * in: w's own, or the narrower dtype the accelerator's compiler casts float32 weights to before
 * moving them (sim_machine_opts.counted_gather, from the hardware profile).  A w whose count was
 * fixed (mesh_array_recount: cast by MaxText's code already, or a float32 dot) keeps it. */
sim_dtype mesh_array_gather_dtype(const sim_device *d, const mesh_array *w);
/* The dtype a float32 parameter gradient counted in `counted` is reduced in (counted_grad_reduce). */
sim_dtype mesh_array_reduce_dtype(const sim_device *d, sim_dtype counted);
/* The meta of a collective on `a`: counted in a->counted when that was
 * fixed (mesh_array_recount) or `a` is a parameter, gradient or optimizer
 * state (which move in their own dtype), else as the device counts wires. */
sim_meta mesh_array_meta(const mesh_array *a, sim_meta meta);
/* Fills this device's shard from a global row-major buffer (host memory all
 * devices may read).  Partial axes: the value is kept where the device's
 * coordinates on them are all 0, zero elsewhere, so the sum is the global. */
void mesh_array_load_global(sim_device *d, const mesh_shape *m, mesh_array *a, const void *global);
/* Writes this device's shard into a global row-major buffer.  Only one
 * replica writes each block (the one with coordinate 0 on every axis the
 * spec does not use); partial arrays are refused (reshard them first). */
sim_status mesh_array_store_global(sim_device *d, const mesh_shape *m, const mesh_array *a, void *global);
/* The same for an array whose replicas along the axes `held_apart` hold
 * different parts of a larger whole (a pipeline stage's layers): the
 * replica with coordinate 0 on the other unused axes writes, whatever its
 * coordinates on held_apart. */
sim_status mesh_array_store_global_except(sim_device *d, const mesh_shape *m, const mesh_array *a, void *global,
                                          uint32_t held_apart);

/* Copies the block of `src` (local shape `in`) selected along each dim into
 * `dst`: dst has shape `out`, and dim i starts at `start[i]` of src. */
void mesh_copy_block(void *dst, const void *src, int rank, const int64_t *in, const int64_t *out, const int64_t *start,
                     size_t es);

#endif
