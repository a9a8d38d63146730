/* planmemo.h — planning decisions remembered instead of made again, shared by
 * all threads: whole decisions (einsum placements, resharding plans) keyed by
 * their complete inputs packed as bytes (see below).  It knows keys and bytes,
 * not plans: the planner (reshard.c) and the einsum placement (ops.c) pack
 * their own inputs and values.  The per-thread memo of a plan's bytes is the
 * planner's (mesh_plan_bytes_memo in reshard.h). */
#ifndef MESH_PLANMEMO_H
#define MESH_PLANMEMO_H

#include <stdbool.h>
#include <stdint.h>

#include "mesh/mesh_shape.h"
#include "mesh/spec.h"

/* ---- decisions shared by the devices ------------------------------------------
 * Every device of an SPMD program plans the same op on the same global shapes
 * and specs, so a decision that is a function of those inputs (the einsum
 * placement search) is made once and read by the others.  The memo is
 * process-wide, insert-only and keyed by the complete input packed as bytes;
 * a lookup takes no lock.  It holds at most a few thousand decisions (the
 * rest are recomputed), for as long as the process lives. */

/* A small number naming the mesh `m` (equal meshes, equal numbers) to put in
 * a key, or -1 when too many meshes were seen (then do not memoise). */
int mesh_memo_mesh_id(const mesh_shape *m);
/* Copies the value stored under key[0..key_len) into val (val_len bytes, as
 * stored); false when there is none. */
bool mesh_memo_get(const void *key, int key_len, void *val, int val_len);
/* The value stored under the key, in place (immutable, valid for the life
 * of the process) with its length; NULL when there is none. */
const void *mesh_memo_find(const void *key, int key_len, int *val_len);
/* Key building: appends len bytes of v, or spec s packed (rank, each dim's
 * axes, the partial set), to k (n bytes used of cap); returns the new
 * length, or -1 when n < 0 or there is no room. */
int mesh_memo_key_bytes(unsigned char *k, int n, int cap, const void *v, int len);
int mesh_memo_key_spec(unsigned char *k, int n, int cap, const mesh_spec *s);
/* Stores a value under a key (a key already present keeps its first value,
 * which any device computing it would have computed too). */
void mesh_memo_put(const void *key, int key_len, const void *val, int val_len);
/* Turns the shared memo off (every get misses, puts are dropped) or on (the
 * default): tests compare decisions made afresh with remembered ones. */
void mesh_memo_set_enabled(bool on);

#endif
