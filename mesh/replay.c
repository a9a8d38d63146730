/* replay.c — a rematerialised layer's forward values on the host (see replay.h).
 *
 * One entry per kernel output, in the order the kernels ran: the op's tag (as a
 * hash: the check needs equality only), the local shape and a copy of the
 * shard in a host block (sim_arena_block_new).  Using an entry hands its block
 * to the output's arena block instead of copying it back (sim_arena_swap), so
 * the host bytes fall as the recomputation advances and the recomputation
 * moves no data. */
#include "mesh/replay.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "blas_kernels/bk_parallel.h"
#include "sim/arena.h"

typedef struct {
    uint64_t tag; /* FNV-1a of the op's tag */
    int rank;
    int64_t local[MESH_SPEC_MAX_RANK];
    size_t bytes; /* the shard's bytes (counted, stored or not) */
    void *data;   /* the copy; NULL in a dry run and once used */
    int nplaced;
    mesh_spec placed[MESH_REPLAY_MAX_PLACED]; /* how the kernel ran (mesh_replay_put) */
} replay_value;

struct mesh_replay {
    sim_device *dev;
    mesh_replay_mode mode;
    replay_value *v;
    int n, cap, next;
    size_t held;   /* host bytes held now (counted in the arena's host figures) */
    bool departed; /* the recomputation left the forward's path: no value is used any more */
};

static unsigned long departures;

static uint64_t tag_hash(const char *s)
{
    uint64_t h = 1469598103934665603ull;
    for (; s && *s; s++) h = (h ^ (unsigned char)*s) * 1099511628211ull;
    return h;
}

static void hold(mesh_replay *r, size_t bytes, bool add)
{
    sim_arena *a = sim_device_arena(r->dev);
    if (add) r->held += bytes;
    else r->held -= bytes;
    sim_arena_host(a, add ? (ptrdiff_t)bytes : -(ptrdiff_t)bytes);
}

mesh_replay *mesh_replay_new(sim_device *dev)
{
    mesh_replay *r = calloc(1, sizeof *r);
    SIM_ASSERT(r);
    r->dev = dev;
    return r;
}

void mesh_replay_free(mesh_replay *r)
{
    if (!r) return;
    for (int i = 0; i < r->n; i++) sim_arena_block_free(r->v[i].data);
    if (r->held) hold(r, r->held, false);
    free(r->v);
    free(r);
}

void mesh_replay_start(mesh_replay *r, mesh_replay_mode mode)
{
    r->mode = mode;
    r->next = 0;
}

bool mesh_replay_saving(const mesh_replay *r) { return r && r->mode == MESH_REPLAY_SAVE; }

bool mesh_replay_using(const mesh_replay *r) { return r && r->mode == MESH_REPLAY_USE; }

size_t mesh_replay_bytes(const mesh_replay *r) { return r ? r->held : 0; }

unsigned long mesh_replay_departures(void) { return __atomic_load_n(&departures, __ATOMIC_RELAXED); }

/* Frees value e (used, passed over or dropped) and gives its host bytes back. */
static void drop(mesh_replay *r, replay_value *e)
{
    sim_arena_block_free(e->data);
    e->data = NULL;
    hold(r, e->bytes, false);
    e->bytes = 0;
}

void mesh_replay_put(mesh_replay *r, const char *tag, const mesh_array *a, const mesh_spec *placed, int nplaced)
{
    SIM_ASSERT(r->mode == MESH_REPLAY_SAVE);
    if (r->n == r->cap) {
        r->cap = r->cap ? 2 * r->cap : 32;
        r->v = realloc(r->v, (size_t)r->cap * sizeof *r->v);
        SIM_ASSERT(r->v);
    }
    replay_value *e = &r->v[r->n++];
    memset(e, 0, sizeof *e);
    e->tag = tag_hash(tag);
    e->rank = a->rank;
    memcpy(e->local, a->local, sizeof e->local);
    e->bytes = a->nlocal * sim_dtype_size(a->dtype);
    SIM_ASSERT(nplaced >= 0 && nplaced <= MESH_REPLAY_MAX_PLACED);
    e->nplaced = nplaced;
    for (int i = 0; i < nplaced; i++) e->placed[i] = placed[i];
    if (a->data) {
        e->data = sim_arena_block_new(e->bytes);
        SIM_ASSERT(e->data);
        bk_parallel_copy(e->data, a->data, e->bytes);
    }
    hold(r, e->bytes, true);
}

bool mesh_replay_take(mesh_replay *r, const char *tag, mesh_array *a, const mesh_spec *placed, int nplaced)
{
    SIM_ASSERT(r->mode == MESH_REPLAY_USE);
    if (r->departed) return false;
    bool same = r->next < r->n;
    replay_value *e = same ? &r->v[r->next++] : NULL;
    same = same && e->tag == tag_hash(tag) && e->rank == a->rank &&
           !memcmp(e->local, a->local, (size_t)a->rank * sizeof a->local[0]) &&
           e->bytes == a->nlocal * sim_dtype_size(a->dtype) && e->nplaced == nplaced;
    for (int i = 0; same && i < nplaced; i++) same = mesh_spec_equal(&e->placed[i], &placed[i]);
    if (!same) { /* off the forward's path: the kernels run from here on, every value is dropped */
        r->departed = true;
        __atomic_add_fetch(&departures, 1, __ATOMIC_RELAXED);
        for (int i = 0; i < r->n; i++) drop(r, &r->v[i]);
        return false;
    }
    bool filled = false;
    if (a->data) {
        SIM_ASSERT(e->data);
        mesh_array_owned(a);
        /* the kept block becomes the output's storage (a's own block goes back to its arena) */
        sim_arena_swap(sim_device_arena(r->dev), &a->data, e->data, e->bytes);
        e->data = NULL;
        filled = true;
    }
    drop(r, e);
    return filled;
}
