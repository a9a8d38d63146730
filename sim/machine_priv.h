/* machine_priv.h — the machine's insides, shared by machine.c,
 * collectives.c and trace.c only.  Not part of the public API.
 *
 * Synchronisation: one machine-wide mutex guards every group's rendezvous
 * state and the alive/blocked counters; each device sleeps on its own
 * semaphore, outside the lock.  A device that arrives last at a rendezvous
 * releases the others itself (clearing their `waiting` flags under the lock,
 * setting their `released` flags, then posting their semaphores after
 * unlocking), so a released device resumes without taking the lock again:
 * with hundreds of device threads on a few cores, re-taking one mutex on
 * every wake-up was most of a dry run's time.  A failure posts every
 * device's semaphore without `released`; a woken device that finds its flag
 * unset looks at the machine under the lock (failure or spurious post).  So
 * `n_blocked == n_alive` can only hold when no device can ever move again:
 * that is the deadlock test, exact and immediate. */
#ifndef SIM_MACHINE_PRIV_H
#define SIM_MACHINE_PRIV_H

#include <pthread.h>
#include <semaphore.h>
#include <stdatomic.h>

#include "sim/fiber.h"
#include "sim/machine.h"
#include "sim/record.h"

/* A collective call as posted at a rendezvous. */
typedef struct sim_call {
    sim_op op;
    sim_dtype dt;
    sim_dtype counted; /* the dtype the bytes are counted in (run_collective resolves it) */
    bool counted_set;  /* sim_meta named it */
    sim_axes axes;
    const char *tag;
    int device;
    size_t p[4]; /* op-specific sizes (see collectives.c) */
    const void *send;
    void *recv;
    const int *perm;                                         /* ppermute table, k entries */
    const size_t *send_off, *send_cnt, *recv_off, *recv_cnt; /* ragged */
    size_t recv_cap;
    bool shared; /* all-gather into one buffer for the group (sim_all_gather_dim_shared) */
} sim_call;

typedef enum { SIM_RV_ARRIVE = 0, SIM_RV_DEPART, SIM_RV_BARRIER } sim_rv_kind;

typedef struct sim_group sim_group;
struct sim_trace_range; /* sim/trace.h */
/* Task `task` of an exchange's data movement over g (see sim_exchange). */
typedef void (*sim_task_fn)(sim_machine *m, sim_group *g, int task);

/* A call posted in a dry run, with copies of what the match reads. */
typedef struct {
    sim_call call;
    char tag[SIM_TAG_MAX];
    size_t *cnt; /* ragged: send_cnt then recv_cnt (k each) */
    int *perm;   /* ppermute: k entries */
} sim_posted;

struct sim_group {
    int k;           /* members */
    unsigned mask;   /* axes of the group (bit per mesh axis) */
    int arrived;     /* members at the current rendezvous */
    uint64_t gen;    /* completed rendezvous */
    int *members;    /* device ids, canonical (mesh) order */
    sim_call **slot; /* posted call per canonical member */
    /* dry runs (sim_post): calls posted without waiting, matched when the
     * last member posts; a ring of `cap` generations from `base` */
    sim_posted *posted; /* [cap][k] */
    int *npost;         /* [cap]: members that posted that generation */
    uint64_t *seq;      /* [k]: calls each member posted */
    uint64_t base;      /* oldest generation not complete */
    int cap;
    int nahead;         /* members sleeping because they are too far ahead */
    uint64_t ahead_gen; /* the lowest generation one of them wants to post */
    /* the data movement of the exchange in progress (sim_exchange) */
    sim_task_fn task_fn;
    int ntask;
    atomic_int task_next; /* the next task to claim */
    int workers;          /* threads still claiming tasks (under the lock) */
    uint64_t moved;       /* exchanges whose data movement completed (under the lock) */
    sim_call **byrank;    /* [k]: the posted calls by rank in the calls' axes order */
    /* spread over MPI ranks (sim/xrank.h): members on this rank, each member's rank, the
     * group's message tag, and the exchange in progress (collectives.c) */
    int local_k; /* members run by this process (k in a one-process run) */
    int *owner;  /* [k]: the rank running each canonical member */
    int tag;
    struct sim_xgroup *x;
};

typedef struct {
    uint64_t t0, t1;
    int lane; /* 0 = compute, 1 + axes mask for collectives; -1 = a step marker */
    char name[SIM_TAG_MAX];
    sim_op op;         /* for collective spans */
    uint64_t bytes;    /* bytes sent, collectives */
    size_t live_bytes; /* arena live bytes at the end of the span */
    int64_t rec;       /* collectives: index of its sim_record on the device, else -1 */
} sim_span;

struct sim_device {
    sim_machine *m;
    int id;
    int coords[SIM_MAX_AXES];
    char label[192];
    sim_arena *arena;
    sim_phase phase;
    int step;
    /* rendezvous state (guarded by m->lock) */
    sem_t wake;           /* posted to wake the device (not guarded: see above) */
    atomic_bool released; /* set with the post of a normal release */
    bool waiting;
    bool finished;
    bool helper;         /* released from an exchange's ARRIVE to move data (sim_exchange) */
    uint64_t help_moved; /* its group's `moved` when it was asked: a different value when it
                              starts means the exchange finished without it */
    sim_group *wait_group;
    const sim_call *wait_call;
    sim_rv_kind wait_kind;
    /* the groups this device used last, by axes mask: found without the machine lock
     * (a group never moves once made; every collective looks its group up) */
    unsigned gcache_mask[8];
    sim_group *gcache[8];
    unsigned ngcache;
    /* records */
    sim_record *rec;
    size_t nrec, caprec;
    sim_cost *cost; /* kernel costs for the step-time model (sim_device_add_cost) */
    size_t ncost, capcost;
    /* repeated blocks (sim_repeat: a dry run's steady-state microbatch and layers) */
    sim_repeat *reps;
    size_t nreps, capreps;
    size_t open[SIM_WALK_DEPTH]; /* blocks begun, not ended */
    sim_op_totals open_totals[SIM_WALK_DEPTH][SIM_NOP];
    size_t open_vrec[SIM_WALK_DEPTH], open_vcost[SIM_WALK_DEPTH];
    int nopen;
    size_t rec_extra, cost_extra; /* records and costs the blocks' copies add */
    size_t open_vspans[SIM_WALK_DEPTH];
    uint64_t span_extra; /* spans the blocks' copies stand for: not kept, trace.json says how many */
    sim_op_totals totals[SIM_NOP];
    /* trace */
    sim_span *spans;         /* NULL once dropped */
    size_t nspans, capspans; /* nspans counts every span, kept or not (other devices read it: atomics) */
    bool spans_dropped;      /* this device cannot be in the trace (sim_trace_keeps): spans counted, not kept */
    bool step_untraced;      /* the current step is not among the trace's steps (sim_trace_set_steps) */
    uint64_t spans_skipped;  /* spans of untraced steps: neither kept nor counted in nspans */
    uint64_t steps_traced, steps_skipped; /* steps started, by whether the trace keeps them */
    /* run */
    pthread_t thread;
    sim_fiber *fib; /* the device's fiber when it runs as one (then `wake` is unused) */
    sim_status st;
};

struct sim_machine {
    sim_mesh_desc mesh;
    sim_machine_opts opts;
    int n;
    int blas_threads;
    int cores;          /* of the host: the threads an exchange's data movement is shared by */
    sim_fibers *fibers; /* the run's fibers, NULL when every device has a thread */
    int workers;        /* the run's OS threads: m->n, or the fibers' workers */
    uint64_t t_origin;
    sim_device *dev;
    pthread_mutex_t lock;
    sim_group ***by_mask; /* [1 << naxes] -> array of groups by group index */
    sim_group *world;     /* every device, for sim_device_barrier */
    int n_alive, n_blocked;
    bool failed;
    atomic_bool xstop; /* `failed`, readable without the lock: stops this rank's MPI waits */
    sim_status fail_st;
    char fail_msg[8192];
    /* run */
    sim_device_fn fn;
    void *arg;
    size_t trace_limit;                  /* sim_trace_set_limit: the trace's max_events (0 = every device) */
    struct sim_trace_range *trace_steps; /* sim_trace_set_steps (trace.h): the steps whose spans are kept
                                            (NULL = all) */
    int ntrace_steps;
    char trace_steps_text[256]; /* how the user named them ("first,last") */
    /* the live buffers of shared all-gathers (collectives.c), freed with the machine if a
     * failed run left references behind */
    pthread_mutex_t shared_lock;
    struct sim_shared_buf *shared;
    uint64_t shared_made;                  /* buffers made so far */
    uint64_t shared_live;                  /* of which not yet released by every member */
    struct sim_shared_buf *shared_kept[4]; /* released large buffers kept for reuse (SHARED_KEEP) */
    int shared_nkept;
    /* MPI ranks (sim/xrank.h): this process is rank `rank` of `nranks`; owner_of[id] runs device id
     * (rank_placement), and this rank runs local[0..nlocal), in id order */
    int rank, nranks, nlocal;
    int *owner_of, *local;
    uint64_t *xbytes; /* [nxbytes]: bytes this rank sent to other ranks, by step (under lock) */
    int nxbytes;
    sim_status match_fail; /* set by a match function failing for another reason than a mismatch
                              (a shared buffer's host allocation); SIM_OK otherwise */
};

/* The group over `mask` that device d belongs to (created on first use). */
sim_group *sim_group_of(sim_device *d, unsigned mask);
/* Index of device d among g's canonical members. */
int sim_group_slot(const sim_group *g, const sim_device *d);
/* Waits until every member of g arrived at the same rendezvous.  At ARRIVE,
 * `call` is posted in d's slot and the last arriver checks that all posted
 * calls agree (`match`, returning a message on mismatch). */
typedef bool (*sim_match_fn)(sim_machine *m, sim_group *g, char *why, size_t cap);
sim_status sim_rendezvous(sim_device *d, sim_group *g, sim_call *call, sim_rv_kind kind, sim_match_fn match);
/* A collective in one meeting: every member of g posts its call and sleeps;
 * the last to arrive checks the calls (`match`) and runs the data movement,
 * `ntask` independent tasks (`task`, each moving what one member receives),
 * with as many sleeping members woken to help as the host has other cores
 * when `split` (a large exchange; a helper that starts after the tasks ran
 * out does not hold the exchange up); the last worker to finish releases the
 * rest.  So a member sleeps once per collective, not at an ARRIVE and again
 * at a DEPART: with 64 device threads on 2 cores the hand-offs were a large
 * part of the step.  Once the movement has started no failure wakes a
 * member (its buffers are in use); it always completes. */
sim_status sim_exchange(sim_device *d, sim_group *g, sim_call *call, sim_match_fn match, sim_task_fn task, int ntask,
                        bool split);
/* Dry runs move no data, so a device need not wait for its peers: it posts
 * a copy of its call and goes on; the member that completes a generation
 * checks that all its calls agree (`match`).  Calls left unmatched when the
 * run ends are reported by sim_machine_run as a deadlock would be.  With
 * hundreds of device threads on a few cores this removes a sleep and a
 * wake-up per device per collective. */
sim_status sim_post(sim_device *d, sim_group *g, const sim_call *call, sim_match_fn match);
/* Marks the machine failed (first failure wins) and wakes every device. */
void sim_machine_fail(sim_machine *m, sim_status st, const char *msg);
/* Appends a span to d's trace (when tracing); a device that keeps no spans only counts it. */
void sim_trace_add(sim_device *d, const sim_span *s);
/* Whether d still keeps its spans (trace.c): false once devices 0..d already hold more
 * spans than the trace limit, so d can never be written (sim_trace_devices_within); its
 * spans are then freed and only counted.  Callers skip building a span that is not kept. */
bool sim_trace_keeps(sim_device *d);
/* Whether the trace keeps the spans of `step` (sim_trace_set_steps; trace.c). */
bool sim_trace_step_selected(const sim_machine *m, int64_t step);
unsigned sim_axes_mask(sim_axes axes);
/* The rank that runs device id (rank_placement: sim_mesh_place_ranks). */
int sim_machine_owner(const sim_machine *m, int id);
/* A group spanning ranks (collectives.c), in its last local arriver: the local members' calls
 * serialised (under the lock: the calls live on the members' stacks), traded with the other
 * ranks of the group (unlocked), ghosts of the remote members' calls put in g->slot (under the
 * lock) so the ordinary match sees all k calls; then the data phase (unlocked), and the end. */
void sim_xgroup_pack_calls(sim_machine *m, sim_group *g);
sim_status sim_xgroup_trade_calls(sim_machine *m, sim_group *g);
void sim_xgroup_ghosts(sim_machine *m, sim_group *g);
sim_status sim_xgroup_move(sim_machine *m, sim_device *d, sim_group *g);
void sim_xgroup_end(sim_group *g);
/* A zero-byte message to and from every other rank of g: a barrier's cross-rank part. */
sim_status sim_xgroup_sync(sim_machine *m, sim_group *g);
/* Frees the shared all-gather buffers still referenced (sim_machine_free). */
void sim_shared_free_all(sim_machine *m);

#endif
