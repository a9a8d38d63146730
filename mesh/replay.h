/* replay.h — a rematerialised layer's forward values, kept in host memory so
 * that the layer's recomputation for the backward pass takes them instead of
 * computing them again.
 *
 * The recomputation runs the layer's code as it stands (the same arena
 * allocations and frees, collectives, records and modelled costs); only the
 * heavy kernels (einsum products, attention) are skipped and their outputs
 * copied from what the forward pass computed, which are bitwise the values
 * the kernels would give again: same inputs, same kernels, same threads.
 * Values are kept in the order the kernels ran (per device, per layer) and
 * checked on the way back by the op's tag, local shape and placement (see
 * mesh_replay_take).  The bytes held are
 * host memory outside the arena's accounting (sim_arena_host): in a dry run
 * they are counted only, for the host-memory check before a real run. */
#ifndef MESH_REPLAY_H
#define MESH_REPLAY_H

#include <stdbool.h>
#include <stddef.h>

#include "mesh/array.h"

typedef struct mesh_replay mesh_replay;

typedef enum {
    MESH_REPLAY_SAVE = 0, /* the forward pass: each kernel output is copied in */
    MESH_REPLAY_USE       /* the recomputation: each kernel output is taken back (its kept block becomes the
                             output's storage, sim_arena_swap), the kernel skipped */
} mesh_replay_mode;

/* An empty store for one layer run of device dev (its arena counts the host bytes). */
mesh_replay *mesh_replay_new(sim_device *dev);
/* Frees the values and gives their host bytes back. */
void mesh_replay_free(mesh_replay *r);
/* Saving (the forward) or using (from the first value on). */
void mesh_replay_start(mesh_replay *r, mesh_replay_mode mode);
/* r is saving / using (false for NULL: no store, the kernels run as ever). */
bool mesh_replay_saving(const mesh_replay *r);
bool mesh_replay_using(const mesh_replay *r);

/* SAVE: keeps a copy of a's shard (nothing stored when a has no data: a dry run counts the bytes),
 * with the op's tag, a's local shape and the nplaced specs (at most MESH_REPLAY_MAX_PLACED) that
 * describe how the kernel ran: its operands' specs before and after staging, its output's.
 * USE: gives a the next value (the kept block replaces a's shard) when the recomputation is still on
 * the forward's path: the same op (tag), local shape and placement.  Auto mode may place a product
 * differently the second time (the placement weighs the operands already gathered, which differ),
 * and its result may then differ in the last bits: from the first difference on, every value is
 * dropped and the kernels run (the recomputation's bits, as remat_recompute=always gives).
 * Returns true when a was filled; false (a untouched) when a has no data or the path left.
 * Call both where the kernel output is complete, once per kernel in the same order. */
enum { MESH_REPLAY_MAX_PLACED = 5 };
void mesh_replay_put(mesh_replay *r, const char *tag, const mesh_array *a, const mesh_spec *placed, int nplaced);
bool mesh_replay_take(mesh_replay *r, const char *tag, mesh_array *a, const mesh_spec *placed, int nplaced);

/* Host bytes held now. */
size_t mesh_replay_bytes(const mesh_replay *r);
/* Recomputations, process-wide, that left the forward's path (their kernels ran from there on). */
unsigned long mesh_replay_departures(void);

#endif
