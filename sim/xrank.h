/* xrank.h — the simulated machine spread over processes: MPI ranks started by a launcher
 * (`mpirun -np R shardsim ...`).  Each rank runs a contiguous block of the mesh's device ids
 * (sim/machine.c); a collective whose group spans ranks moves the slices remote members need as
 * point-to-point messages (sim/collectives.c), so reductions still sum in group-rank order and
 * the bits are those of a one-process run.  MPI's own float reductions are never used.
 *
 * MPI is optional: built with -DSHARDSIM_MPI it is initialised only when a launcher's variables
 * are in the environment (OMPI_COMM_WORLD_SIZE, PMIX_RANK, PMI_SIZE); otherwise, and in a build
 * without MPI, there is one rank and nothing here does anything.
 *
 * No thread ever blocks inside MPI (a rank blocked in MPI spins a core): every wait is
 * nonblocking requests polled with MPI_Test and short sleeps. */
#ifndef SIM_XRANK_H
#define SIM_XRANK_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "sim/types.h"
#include "sim/status.h"

/* Initialises MPI (MPI_THREAD_MULTIPLE) when launched by an MPI launcher; a no-op otherwise.
 * Call once, first thing in main.  Fails when MPI cannot give thread support. */
sim_status sim_xrank_init(void);
/* MPI_Finalize when initialised (MPI_Abort instead when sim_xrank_conclude gave up waiting). */
void sim_xrank_finalize(void);
/* Ends every rank of the job with exit code `code` (MPI_Abort, and Open MPI's notice of it);
 * exit(code) without MPI.  The last resort: sim_xrank_conclude ends a failed job quietly. */
_Noreturn void sim_xrank_abort(int code);
/* This process's rank and the number of ranks (0 and 1 without a launcher). */
int sim_xrank_rank(void);
int sim_xrank_size(void);
/* Whether this build can run under a launcher at all (compiled with SHARDSIM_MPI). */
bool sim_xrank_built(void);

/* Where the mesh's devices go over the ranks: shardsim's key rank_placement, one setting for the
 * process (every rank reads the same config), applied by every machine made after it is set.
 *   contiguous         (the default) blocks of device ids in id order: rank r of R runs ids
 *                      [r*n/R, (r+1)*n/R), the first ranks one device smaller when R does not
 *                      divide n;
 *   axis:A[,B...]      the named mesh axes kept inside each rank: every group over them (a
 *                      tensor-parallel group, say) runs whole on one rank, so its collectives
 *                      never leave the process.  The devices are ordered with those axes
 *                      innermost, then cut into R equal blocks; R must divide the number of
 *                      such groups.
 * The placement changes where each device runs, never what it computes: the run is bitwise the
 * one-process run under any placement.  Errors (SIM_ERR_INPUT) name the key, the value and what
 * to write instead. */
sim_status sim_xrank_set_placement(const char *text);
/* The setting as text ("contiguous", "axis:tensor"). */
const char *sim_xrank_placement(void);
/* The axes the placement keeps inside a rank, *names[i] for i < the count returned (0: contiguous).
 * sim_mesh_place_ranks (sim/machine.h) applies the setting to a mesh. */
int sim_xrank_placement_axes(const char (**names)[SIM_AXIS_NAME_MAX]);

/* Host-level gathers between whole ranks (not devices): every rank calls them at the same point of
 * its program, from one thread.  allgather: `bytes` from each rank into all[r * bytes]. */
sim_status sim_xrank_allgather(const void *mine, size_t bytes, void *all);
/* Variable sizes: *all (malloc'd, free it) is rank 0's bytes, then rank 1's, ...; sizes[r] (R
 * entries) each rank's byte count. */
sim_status sim_xrank_allgatherv(const void *mine, size_t bytes, void **all, size_t *sizes);
/* The largest of every rank's value. */
sim_status sim_xrank_max_u64(uint64_t *v);
/* Every rank's buf becomes rank 0's. */
sim_status sim_xrank_from_rank0(void *buf, size_t bytes);
/* Every rank's buf becomes the bitwise OR of all ranks' bufs: for host arrays each rank filled only
 * where its devices wrote (zeros elsewhere), and devices that write one element write the same bits. */
sim_status sim_xrank_or_merge(void *buf, size_t bytes);

/* Failures across ranks.  A rank that fails tells every other rank at once with a small control
 * message (status and text); a rank that receives one stops waiting on the others: every exchange
 * in progress or to come returns an error ("MPI rank r failed: ..."), so its devices and host code
 * unwind instead of waiting for data that will never come.  At the end each rank calls
 * sim_xrank_conclude, which gathers every rank's outcome: all ranks exit with the same code and
 * the failure that started it is printed once, by rank 0. */

/* Sends (st, msg) to every other rank; once per process, and not when another rank's failure
 * arrived first (this failure is then its consequence).  Safe from any thread, under any lock of
 * the simulator (it only posts nonblocking sends).  A no-op with one rank. */
void sim_xrank_post_failure(sim_status st, const char *msg);
/* Whether another rank's failure has arrived (polled by every exchange; this call polls too). */
bool sim_xrank_failed_elsewhere(void);

/* Ends this rank's part of the job: every rank calls it once, from the main thread, with its exit
 * code and, when non-zero, its message.  It posts this rank's failure if not done yet, gathers
 * every rank's (code, message, whether the failure was its own) and returns the job's exit code,
 * the same on every rank: that of the lowest rank whose failure was its own (else the first
 * non-zero).  `out` receives the message to print, on rank 0 only ("" elsewhere and on success):
 * the failure that started it all, once for the job ("MPI rank r: " before another rank's).  A failed rank waits at most a minute for
 * the others (a rank far slower to notice, or stuck); then `out` is its own message and
 * sim_xrank_finalize ends the job with MPI_Abort.  With one rank: rc, and msg in out. */
int sim_xrank_conclude(int rc, const char *msg, char *out, size_t cap);

/* One message of a point-to-point batch (sim_xrank_exchange). */
typedef struct {
    int peer;  /* the other rank */
    bool send; /* true: buf is sent to peer; false: received into buf */
    void *buf;
    size_t bytes; /* may be 0 (a pure synchronisation); any size (split in pieces below 2^31) */
} sim_xmsg;

/* Posts every message of the batch on `tag` (a group's own channel: messages between two ranks
 * on one tag arrives in the order they were sent) and returns when all completed, sleeping
 * between polls.  Safe from several threads at once (each with its own tag).  It gives up when
 * *stop turns true (this rank failed: SIM_ERR_ABORTED), when another rank's failure arrives
 * (its status, "MPI rank r failed: ..."), and after timeout_s seconds (> 0; the collective
 * watchdog: SIM_ERR_DEADLOCK).  Giving up cancels its receives; the job is then over
 * (sim_xrank_conclude). */
sim_status sim_xrank_exchange(sim_xmsg *msgs, int n, int tag, const atomic_bool *stop, double timeout_s);

#endif
