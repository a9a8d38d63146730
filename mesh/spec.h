/* spec.h — PartitionSpec on a mesh, and the shard geometry it implies.
 *
 * A spec gives, per tensor dim, an ordered tuple of mesh axes (first = most
 * significant part of the block index), plus a set of PARTIAL axes (JAX
 * "unreduced": the value is a sum over those axes still to be taken).  An axis
 * appears at most once per spec, on one dim or in the partial set.
 *
 * Text form (parse and print), JAX repr style:
 *   P()   P('fsdp', None, None)   P(('data', 'fsdp'), None)   P(None,)
 *   P('fsdp', None, unreduced={'data'})        <- printed form of partial axes
 * The parser also takes "PartitionSpec(...)", double quotes, spaces, a 1-tuple
 * ('fsdp',) for 'fsdp', () or [] for None, lists [...] for tuples, and
 * partial=('data',) / partial={'data'} / unreduced=('data',) for the partial
 * set.  A one-axis tuple prints as the bare name; a rank-1 spec prints with
 * the trailing comma Python gives a 1-tuple: P('fsdp',), P(None,).
 * JSON form (named_shardings.json "partition_spec"): ["fsdp", null, ["data", "fsdp"]]. */
#ifndef MESH_SPEC_H
#define MESH_SPEC_H

#include <stdint.h>

#include "config/json.h"
#include "mesh/mesh_shape.h"
#include "sim/status.h"

enum { MESH_SPEC_MAX_RANK = 8 };

typedef struct {
    int rank;                                       /* number of tensor dims (0..8) */
    int n_axes[MESH_SPEC_MAX_RANK];                 /* how many mesh axes shard dim d */
    int8_t axes[MESH_SPEC_MAX_RANK][MESH_MAX_AXES]; /* their mesh axis indices, major first */
    uint32_t partial;                               /* bit a set: partial sum over mesh axis a */
} mesh_spec;

/* Shard of one dim on one device. */
typedef struct {
    int64_t nshards; /* number of blocks (product of the dim's axis sizes) */
    int64_t block;   /* this device's block (mixed radix of its coords, first axis major) */
    int64_t local;   /* block length = global / nshards */
    int64_t offset;  /* global index of the block's first element = block * local */
} mesh_dim_shard;

/* A fully replicated spec of the given rank. */
void mesh_spec_init(mesh_spec *s, int rank);
/* Sets dim d to the given axes (replacing), checking that no axis is used twice. */
sim_status mesh_spec_set_dim(mesh_spec *s, const mesh_shape *m, int d, int n, const int *axes);
/* Checks the invariants (rank, axis indices, each axis once) against a mesh. */
sim_status mesh_spec_check(const mesh_spec *s, const mesh_shape *m);
int mesh_spec_equal(const mesh_spec *a, const mesh_spec *b);
/* Bitmask of axes that shard some dim (partial axes not included). */
uint32_t mesh_spec_dim_axes(const mesh_spec *s);
/* The dim that axis a shards, or -1. */
int mesh_spec_axis_dim(const mesh_spec *s, int a);
/* Drops axes of size 1 (MaxText remove_size_one_mesh_axis), from dims and partials. */
void mesh_spec_drop_size_one(mesh_spec *s, const mesh_shape *m);

/* Text form (see above).  Errors name the text, the position and the bad token;
 * an unknown axis lists the mesh's axes. */
sim_status mesh_spec_parse(const char *text, const mesh_shape *m, mesh_spec *out);
/* Writes the JAX repr; returns the length it needs (snprintf style). */
int mesh_spec_format(const mesh_spec *s, const mesh_shape *m, char *buf, int cap);
/* JSON list form: ["fsdp", null, ["data", "fsdp"]], [] for rank 0; partial
 * axes are not part of this form.  Returns the length needed. */
int mesh_spec_format_json(const mesh_spec *s, const mesh_shape *m, char *buf, int cap);
/* Reads the JSON list form (`what` names it in messages). */
sim_status mesh_spec_from_json(const cfg_json *v, const mesh_shape *m, const char *what, mesh_spec *out);

/* ---- geometry --------------------------------------------------------------- */
/* Number of blocks dim d is cut into. */
int64_t mesh_spec_dim_shards(const mesh_spec *s, const mesh_shape *m, int d);
/* Checks rank and that every dim divides by its number of shards; the error
 * names the tensor, the dim, its size and the axes with their sizes. */
sim_status mesh_spec_check_shape(const mesh_spec *s, const mesh_shape *m, int rank, const int64_t *shape,
                                 const char *tensor);
/* Per dim shard of `device` (shape must pass mesh_spec_check_shape). */
void mesh_spec_shard(const mesh_spec *s, const mesh_shape *m, const int64_t *shape, int device, mesh_dim_shard *out);
/* Local shape of every device's shard (the same on all devices). */
void mesh_spec_local_shape(const mesh_spec *s, const mesh_shape *m, const int64_t *shape, int64_t *local);

#endif
