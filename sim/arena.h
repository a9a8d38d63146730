/* arena.h — one device's memory: every tensor byte a device holds comes from
 * its arena, which tracks live and peak bytes in total and per category and
 * enforces an optional capacity (a simulated HBM size).  Going over capacity
 * is a simulated OOM whose message names the device, the tensor, the request
 * and the breakdown at that moment.  In dry-run mode the arena accounts the
 * same bytes but allocates nothing (pointers come back NULL).
 * An arena is used by its own device thread only: no locking. */
#ifndef SIM_ARENA_H
#define SIM_ARENA_H

#include <stdbool.h>
#include <stddef.h>

#include "sim/status.h"
#include "sim/types.h"

typedef struct sim_arena sim_arena;

typedef struct {
    size_t live;                 /* bytes allocated now */
    size_t peak;                 /* highest `live` so far */
    size_t live_by[SIM_NMEM];    /* live bytes per category */
    size_t peak_by[SIM_NMEM];    /* highest live bytes per category (each on its own) */
    size_t at_peak_by[SIM_NMEM]; /* the per-category breakdown when `peak` was reached */
    size_t capacity;             /* 0 = unlimited */
    uint64_t n_allocs;           /* allocations so far */
    size_t host_live;            /* host memory the device keeps outside the accounting now (a remat
                                    layer's forward values kept for its recomputation, mesh/replay.h);
                                    in none of the figures above */
    size_t host_peak;            /* highest `host_live` so far */
} sim_arena_stats;

/* label names the device in messages ("device 3 (data=1, fsdp=1)"). */
sim_arena *sim_arena_new(const char *label, size_t capacity, bool dry_run);
/* Frees every block still live and the arena. */
void sim_arena_free_all(sim_arena *a);

/* Allocates `bytes` (64-byte aligned) in category `cat`; `name` names the
 * tensor in an OOM message.  Zero bytes gives a valid unique pointer.  In dry
 * run *out is NULL.  Contents are uninitialised unless `zero`. */
sim_status sim_arena_alloc(sim_arena *a, size_t bytes, sim_mem_cat cat, const char *name, bool zero, void **out);
/* Releases a block; bytes and cat must be those it was allocated with
 * (checked in real mode).  p may be NULL only in dry run or when bytes==0. */
void sim_arena_release(sim_arena *a, void *p, size_t bytes, sim_mem_cat cat);
/* The same for a block whose accounted size differs from its storage: the
 * simulator stores float32 while the modelled program holds `counted` bytes
 * (bfloat16 activations, say).  Live, peak, category and capacity figures
 * use `counted`; the host allocation uses `bytes`.  Release with both. */
sim_status sim_arena_alloc_counted(sim_arena *a, size_t bytes, size_t counted, sim_mem_cat cat, const char *name,
                                   bool zero, void **out);
void sim_arena_release_counted(sim_arena *a, void *p, size_t bytes, size_t counted, sim_mem_cat cat);
/* Counted-only entries: bytes the device holds whose storage is not the
 * arena's (a group's shared all-gather buffer, sim_all_gather_dim_shared; a
 * view of another array's shard while it is resharded).  A charge makes the
 * same capacity check (a simulated OOM names `name`) and moves the same live,
 * peak and allocation figures as sim_arena_alloc_counted of `counted` bytes,
 * as a dry run does, and holds no memory; sim_arena_discharge undoes it.
 * sim_arena_back gives a charged entry its storage (NULL in dry run) without
 * counting anything: the block is then released as any other with
 * sim_arena_release_counted (and the same `counted`). */
sim_status sim_arena_charge(sim_arena *a, size_t counted, sim_mem_cat cat, const char *name);
void sim_arena_discharge(sim_arena *a, size_t counted, sim_mem_cat cat);
sim_status sim_arena_back(sim_arena *a, size_t bytes, sim_mem_cat cat, const char *name, void **out);
/* A live block of category cat counted `from` bytes is counted `to` bytes
 * from now on (a cast in the modelled program); may raise the peak. */
void sim_arena_recount(sim_arena *a, size_t from, size_t to, sim_mem_cat cat);

/* Host blocks: storage made like an arena block but held by no arena (a remat layer's forward
 * values kept for its recomputation, mesh/replay.c), so that a live block can take one over
 * instead of copying it.  sim_arena_block_new returns NULL when the host has no memory left;
 * sim_arena_block_free takes NULL.  sim_arena_swap: the live block *p of `bytes` gives its storage
 * back (to the arena's cache of released blocks, or the host) and holds the host block `host`
 * (made for the same bytes) from now on: *p = host; the host block is the arena's then (released
 * with the block, never with sim_arena_block_free).  No figure of the accounting moves. */
void *sim_arena_block_new(size_t bytes);
void sim_arena_block_free(void *p);
void sim_arena_swap(sim_arena *a, void **p, void *host, size_t bytes);

/* Host bytes the device takes (delta > 0) or gives back, outside the simulated
 * memory: moves host_live and host_peak only (counted in a dry run as well). */
void sim_arena_host(sim_arena *a, ptrdiff_t delta);

void sim_arena_get_stats(const sim_arena *a, sim_arena_stats *out);
/* Puts another process's figures in an arena that holds nothing here: a device another MPI rank
 * ran (sim/xrank.h), so this rank's reports show every device. */
void sim_arena_set_stats(sim_arena *a, const sim_arena_stats *st);
/* Forget the peak: peak := live (e.g. after initialisation). */
void sim_arena_reset_peak(sim_arena *a);
bool sim_arena_dry(const sim_arena *a);

/* "1.50 GiB", "12.0 KiB", "512 B" into buf. */
const char *sim_fmt_bytes(double bytes, char *buf, size_t cap);

#endif
