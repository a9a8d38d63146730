/* machine.h — the simulated machine: N devices, one thread each (or, with
 * more devices than cores, fibers on a thread per core: sim/fiber.h), on an N-D
 * mesh.  Device id = row-major index of the mesh coordinates, first axis most
 * significant.  sim_machine_run() runs one SPMD function on every device and
 * returns when all have returned; the first failure (a device's own error, a
 * collective mismatch, a deadlock) stops every device and is returned with
 * its message.  Arenas, collective records and trace spans belong to the
 * machine and survive from one run to the next. */
#ifndef SIM_MACHINE_H
#define SIM_MACHINE_H

#include <stdbool.h>
#include <stdio.h>

#include "sim/arena.h"
#include "sim/status.h"
#include "sim/types.h"

typedef struct sim_machine sim_machine;
typedef struct sim_device sim_device;

/* Mesh axes of the machine, in mesh order. */
typedef struct {
    int naxes;                                   /* 1..SIM_MAX_AXES */
    char names[SIM_MAX_AXES][SIM_AXIS_NAME_MAX]; /* axis names ("data", "fsdp", ...) */
    int sizes[SIM_MAX_AXES];                     /* devices along each axis, >= 1 */
    int dcn[SIM_MAX_AXES];                       /* slice factor of each axis (the outer part of a
                                                    coordinate, MaxText's dcn_*); 0 or 1: one slice */
} sim_mesh_desc;

typedef struct {
    size_t capacity_bytes;       /* arena capacity per device; 0 = unlimited */
    bool dry_run;                /* arenas account without allocating; collectives move nothing */
    bool trace;                  /* record compute and collective spans */
    bool pin_threads;            /* bind device threads to cores round-robin (best effort) */
    int workers;                 /* OS threads the devices run on when there are more devices than this:
                              each device is then a fiber (sim/fiber.h) on worker id % workers, and
                              waiting at a collective swaps to another device instead of sleeping;
                              0 = the host's cores.  Sanitizer builds always run a thread per device */
    bool quiet;                  /* no warnings on stderr */
    bool no_costs;               /* skip kernel costs (sim_device_add_cost): no step-time model reads them */
    double collective_timeout_s; /* watchdog: a device that waits longer than this on one
                                    collective ends the run naming it, the op and the peers
                                    it waits for (a blocking timed wait, no spinning); 0 = off */
    /* Counted dtypes: the simulator computes in float32, but a float32 buffer
     * is counted (arena bytes, collective records) in the dtype the modelled
     * program would hold it in -- MaxText's weight_dtype for parameters,
     * dtype for activations.  SIM_F32 (the zero value) counts as stored. */
    sim_dtype counted[SIM_NMEM];   /* per arena category, for float32 buffers */
    sim_dtype counted_wire;        /* float32 collectives, unless their sim_meta names a dtype */
    sim_dtype counted_optimizer;   /* in the optimizer phase, float32 temporaries, activations, comm
                                    buffers and collectives (the update works in weight_dtype) */
    sim_dtype counted_gather;      /* a float32 parameter's gathered copy and its all-gather, where the
                                    accelerator's compiler casts the shard before gathering it
                                    (SIM_F32, the zero value: as the parameter is counted) */
    sim_dtype counted_grad_reduce; /* a float32 parameter gradient's reductions, likewise */
    bool copy_gathers;             /* parameters' FSDP gathers run as the plain all-gather, each member copying
                              the whole array, instead of one buffer the group shares
                              (sim_all_gather_dim_shared): the same bits, for tests comparing the two */
    bool copy_activation_gathers;  /* only parameters' gathers are shared (tests: what sharing
                                     activations adds) */
    bool whole;                    /* run every device in this process even under mpirun (sim/xrank.h): a machine
                              with fewer devices than ranks; dry runs always are */
    bool guard_shared;             /* tests: each shared all-gather buffer is its own mapping, read-only once
                              filled, so a write into a shared operand faults where it happens */
    int windowed_min_group;        /* > 0: a weight's all-gather whose copy serves one product, and a weight
                              gradient's reduce-scatter, over a group of at least this many devices run
                              as the compiler's windowed einsum: a bidirectional ring of
                              collective-permutes that sends (k+1)/k of the whole array instead of
                              (k-1)/k (recorded as ppermute; the data moves as before) */
    double windowed_ici_bw;        /* > 0: the rate (bytes/s) at which the compiler's windowed-einsum cost model
                              times a collective over one link: a single_use collective whose product is
                              known (sim_meta.product_flops, timed at windowed_peak FLOP/s) windows only
                              where that model finds the ring faster (sim_collective_windowed) */
    double windowed_peak;          /* the FLOP/s that model times a product at */
    int windowed_torus[3];         /* the slice's chips along x (fastest), y, z, for the links a group's plain
                              collective uses in that model */
    int windowed_torus_n;          /* dims in windowed_torus; 0: the slice's shape is not known */
    int psum_scatter_max_group;    /* > 0: the reduce-scatter of a gradient a shard_map sums (sim_meta.psum) is
                              the compiler's psum-then-slice fused only over groups of at most this many
                              devices; over larger ones it stays an all-reduce of the whole array
                              (recorded as all-reduce; the data moves as before) */
    int lane_scatter_ar_max;       /* > 0: a weight gradient's reduce-scatter along its last dim (sim_meta.lane_slice)
                              keeping at most this many elements per device stays the compiler's all-reduce
                              of the whole gradient (recorded as all-reduce; the data moves as before) */
} sim_machine_opts;

/* Fills a mesh description from names and sizes (a 1-D mesh: n=1). */
sim_status sim_mesh_desc_make(int n, const char *const *names, const int *sizes, sim_mesh_desc *out);
int sim_mesh_num_devices(const sim_mesh_desc *m);
/* Index of a named axis, or -1. */
int sim_mesh_axis_index(const sim_mesh_desc *m, const char *name);
void sim_mesh_coords(const sim_mesh_desc *m, int id, int *coords);
int sim_mesh_device_id(const sim_mesh_desc *m, const int *coords);
/* Product of the sizes of the listed axes (1 for none). */
int sim_mesh_group_size(const sim_mesh_desc *m, sim_axes axes);
/* owner[id]: the MPI rank running each device of the mesh over R ranks under rank_placement
 * (sim_xrank_set_placement, sim/xrank.h: contiguous blocks of ids, or the named axes kept inside
 * each rank; n = sim_mesh_num_devices entries).  Fails (SIM_ERR_INPUT, naming rank_placement) when
 * an axis is not the mesh's, or when R cannot split the kept groups evenly. */
sim_status sim_mesh_place_ranks(const sim_mesh_desc *m, int R, int *owner);
/* The slice a device lies in (mixed radix of the outer, dcn part of its
 * coordinates); 0 for every device of a single-slice mesh. */
int sim_mesh_slice(const sim_mesh_desc *m, int id);
/* "(data=1, fsdp=0)": the axes of size > 1 ("(single device)" when none) */
const char *sim_mesh_coord_label(const sim_mesh_desc *m, int id, char *buf, size_t cap);
/* "(data, fsdp)" */
const char *sim_axes_label(const sim_mesh_desc *m, sim_axes axes, char *buf, size_t cap);

sim_status sim_machine_new(const sim_mesh_desc *mesh, const sim_machine_opts *opts, sim_machine **out);
void sim_machine_free(sim_machine *m);

typedef sim_status (*sim_device_fn)(sim_device *dev, void *arg);
/* Runs fn(dev, arg) on every device thread; returns the first failure with
 * its message in sim_errmsg() of the calling thread. */
sim_status sim_machine_run(sim_machine *m, sim_device_fn fn, void *arg);

int sim_machine_num_devices(const sim_machine *m);
const sim_mesh_desc *sim_machine_mesh(const sim_machine *m);
const sim_machine_opts *sim_machine_options(const sim_machine *m);
/* Sets the collective watchdog (opts.collective_timeout_s) before a run. */
void sim_machine_set_collective_timeout(sim_machine *m, double seconds);
/* Turns kernel-cost recording (sim_device_add_cost) off or on (on by default): a run without a
 * hardware profile has no step-time model to read them, and a 256-device dry run of a deep model
 * would hold hundreds of MB of them. */
void sim_machine_set_record_costs(sim_machine *m, bool on);
/* Turns the shared all-gather of parameters on or off (on by default: opts.copy_gathers). */
void sim_machine_set_shared_gathers(sim_machine *m, bool on);
/* Shares the gathers of activations (and gradients) too, or only those of parameters (on by
 * default: opts.copy_activation_gathers). */
void sim_machine_set_shared_activations(sim_machine *m, bool on);
/* Makes shared all-gather buffers read-only once filled (opts.guard_shared; off by default): for tests. */
void sim_machine_set_shared_guard(sim_machine *m, bool on);
/* Before the first machine of a process that only makes dry runs: keep glibc's arenas per
 * thread.  By default all threads share one malloc arena (real runs' activations stay mapped
 * from step to step), but a dry run's hundreds of device threads allocate bookkeeping
 * concurrently, and on one arena they queue on its lock (deepseek3-671b on 256 devices:
 * 5.7 -> 7-13 s of CPU, 50k -> 160-370k context switches).  glibc fixes the arena count at the
 * first arena it adds, so this is a per-process choice. */
void sim_host_malloc_many_arenas(void);
sim_device *sim_machine_device(sim_machine *m, int id);
/* OS threads the last run used: the device count, or the workers its devices ran on as fibers. */
int sim_machine_threads(const sim_machine *m);
/* MPI ranks the machine is spread over (sim/xrank.h; 1 without a launcher), and this one's. */
int sim_machine_ranks(const sim_machine *m);
int sim_machine_rank(const sim_machine *m);
/* The devices rank r of R runs (rank_placement: sim_mesh_place_ranks), in id order, into ids (room for
 * every device); *count of them.  R is the machine's own ranks, or any other count for the share
 * a machine run whole (a dry run) would give each rank; fails when the placement cannot split
 * the mesh over R ranks. */
sim_status sim_machine_rank_ids(const sim_machine *m, int R, int r, int *ids, int *count);
/* Whether d is the first device this process runs: the one that fills a rank's host-side arrays
 * (the step's batch) that every device of the rank reads; device 0 in a one-process run. */
bool sim_device_rank_lead(const sim_device *d);
/* Bytes this process's ranks sent each other through MPI, per step (summed over ranks after a
 * run; the simulation's own cost, never part of the simulated traffic); NULL when none. */
const uint64_t *sim_machine_xrank_bytes(const sim_machine *m, int *nsteps);
void sim_machine_add_xrank_bytes(sim_machine *m, int step, uint64_t bytes);
/* OpenBLAS threads per device chosen for this machine. */
int sim_machine_blas_threads(const sim_machine *m);

int sim_device_id(const sim_device *d);
int sim_device_coord(const sim_device *d, int axis);
const int *sim_device_coords(const sim_device *d);
/* "device 3 (data=1, fsdp=1)" */
const char *sim_device_label(const sim_device *d);
sim_arena *sim_device_arena(sim_device *d);
sim_machine *sim_device_machine(sim_device *d);
bool sim_device_dry(const sim_device *d);
/* The dtype a buffer of dtype dt in category cat is counted in on this
 * device: opts.counted[cat] for float32 buffers (opts.counted_optimizer for
 * the short-lived categories in the optimizer phase), dt for any other. */
sim_dtype sim_device_counted_dtype(const sim_device *d, sim_dtype dt, sim_mem_cat cat);
/* This device's rank in the group over `axes` (mixed radix, first axis most significant). */
int sim_device_group_rank(const sim_device *d, sim_axes axes);
/* Device id of the member with rank r of this device's group over `axes`. */
int sim_device_group_member(const sim_device *d, sim_axes axes, int r);

/* Phase and step stamped on every collective record that follows. */
void sim_device_set_phase(sim_device *d, sim_phase p);
sim_phase sim_device_phase(const sim_device *d);
void sim_device_set_step(sim_device *d, int step);
int sim_device_step(const sim_device *d);

/* Compute spans for the trace: begin returns a token for end. */
int sim_span_begin(sim_device *d, const char *name);
/* A compute span on microbatch lane `mb` (0..15: "compute mb<mb>" in the trace), beside the
 * compute lane, for schedules that interleave microbatches; ended by sim_span_end. */
int sim_span_begin_mb(sim_device *d, const char *name, int mb);
enum {
    SIM_LANE_MB0 = 1 + (1 << SIM_MAX_AXES)
}; /* first microbatch lane: after every collective lane (1 + axes mask) */
void sim_span_end(sim_device *d, int token);

/* Blocks until every device of the machine has arrived (a full barrier). */
sim_status sim_device_barrier(sim_device *d);

#endif
