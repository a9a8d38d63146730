/* collectives.h — collectives over any subset of mesh axes, counted byte by byte.
 *
 * The group of a call is the set of devices that agree on every mesh axis not
 * listed; ranks follow the listed order (first axis most significant).  Each
 * device pulls what it needs straight from its peers' buffers (data moves
 * once), reductions sum in group-rank order (bitwise reproducible), and
 * every call leaves one record with the bandwidth-optimal byte counts:
 *
 *   all-gather      s -> k*s      sent = received = (k-1)*s
 *   reduce-scatter  n -> n/k      (k-1)*n/k
 *   all-reduce      n -> n        2(k-1)*n/k  (exactly n + (k-2)*c_r with chunk c_r when k does not divide n)
 *   all-to-all      n -> n        (k-1)*n/k
 *   ppermute        n -> n        n if the peer is another device, else 0
 *   ragged a2a      per peer      sum of sizes sent to / received from other devices
 *
 * with sizes in bytes of the counted dtype (see sim_meta): float32 data moved
 * for a bfloat16 program counts 2 bytes an element.
 *
 * Members that disagree on the call (op, axes, dtype, sizes, permutation)
 * stop the machine with SIM_ERR_MISMATCH naming the devices, calls and tags.
 * Send and receive buffers must not overlap except where a function says so.
 * In dry run nothing moves (buffers may be NULL) but every record is kept. */
#ifndef SIM_COLLECTIVES_H
#define SIM_COLLECTIVES_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "sim/machine.h"
#include "sim/record.h"

/* Who asked for a collective: tag = "layer/op", implicit = inserted by the
 * resharding planner rather than written by model code, weight = it moves a
 * parameter or a parameter's gradient (the step-time model lets these run
 * asynchronously, as XLA prefetches FSDP weights and defers gradient
 * reductions).  A float32 call is counted in `counted` when counted_set (the
 * dtype the modelled program moves it in), else in the machine's
 * opts.counted_wire; other dtypes count as they are. */
typedef struct {
    const char *tag;
    bool implicit;
    bool weight;
    bool counted_set;
    sim_dtype counted;
    bool single_use;   /* a weight's gather whose copy serves one product, or the reduce-scatter of the gradient
                           one product made (sim_machine_opts.windowed_min_group may window either) */
    bool silent;       /* nothing records it: a collective of ops whose results nothing reads (the compiler
                           removes them), run only so that the simulation's values stay defined */
    bool psum;         /* a reduce-scatter standing for a shard_map's psum of a replicated input's gradient
                           and its slice (sim_machine_opts.psum_scatter_max_group) */
    size_t lane_slice; /* a reduce-scatter along the array's last dim: the elements of that dim each device
                           keeps (sim_machine_opts.lane_scatter_ar_max); 0: another dim */
    /* the product a single_use collective serves, for the windowed-einsum cost model
     * (sim_machine_opts.windowed_ici_bw): its FLOPs on this device (0: unknown, the group-size
     * rule alone decides), and the bytes of its other operand's own gather for it (0: the other
     * operand is not gathered for this product) */
    double product_flops;
    uint64_t product_other_bytes;
    uint64_t product_partial_bytes; /* the bytes of the product's output where it is partial over other axes (a
                                       reduction the product needs besides this collective), else 0 */
} sim_meta;
static inline sim_meta sim_meta_tag(const char *tag)
{
    sim_meta m = {.tag = tag, .counted = SIM_F32};
    return m;
}
static inline sim_meta sim_meta_implicit(const char *tag)
{
    sim_meta m = {.tag = tag, .implicit = true, .counted = SIM_F32};
    return m;
}
static inline sim_meta sim_meta_weight(const char *tag)
{
    sim_meta m = {.tag = tag, .weight = true, .counted = SIM_F32};
    return m;
}
static inline sim_meta sim_meta_counted(sim_meta m, sim_dtype dt)
{
    m.counted_set = true;
    m.counted = dt;
    return m;
}

/* Whether the compiler runs a weight's collective `op` over `axes` (k devices; whole_bytes: the
 * gathered array, or the gradient before its reduce-scatter, on one device, as counted) as a
 * windowed einsum: a ring of collective-permutes (sim_machine_opts.windowed_min_group,
 * windowed_ici_bw; sim_meta.single_use, product_flops, product_other_bytes). */
bool sim_collective_windowed(const sim_device *d, sim_op op, sim_axes axes, int k, sim_meta meta, uint64_t whole_bytes);
/* Whether that choice is each product's own over `axes` (a strided group under the cost model):
 * a weight gathered for two products is then not one shared gather. */
bool sim_windowed_per_product(const sim_device *d, sim_axes axes, sim_meta meta);

/* send (outer, mid, inner) -> recv (outer, k*mid, inner): gathers along the
 * middle dim; block r of the result comes from rank r.  count = outer*mid*inner. */
sim_status sim_all_gather_dim(sim_device *d, const void *send, void *recv, size_t outer, size_t mid, size_t inner,
                              sim_dtype dt, sim_axes axes, sim_meta meta);
/* The same gather into one buffer for the whole group: each member's block
 * is copied into it once (the group copies the array once, not once per
 * member) and every member gets *recv pointing at it.  The buffer is
 * read-only and belongs to no arena: each member gives its reference back
 * with sim_shared_release, and the last one frees it; a caller accounts the
 * bytes itself (sim_arena_charge).  Records, byte counts, checks, mismatch
 * reports (a shared and a plain all-gather in one group are a mismatch) and
 * dry runs (*recv = NULL) are those of sim_all_gather_dim. */
sim_status sim_all_gather_dim_shared(sim_device *d, const void *send, void **recv, size_t outer, size_t mid,
                                     size_t inner, sim_dtype dt, sim_axes axes, sim_meta meta);
/* Gives back one reference to a shared all-gather's buffer (NULL: nothing). */
void sim_shared_release(sim_device *d, const void *buf);
/* Shared all-gather buffers the machine made so far, and how many are still referenced. */
void sim_machine_shared_stats(sim_machine *m, uint64_t *made, uint64_t *live);
/* Released buffers of 32 MiB or more kept for the next shared all-gather of the same size (at most
 * 4, freed with the machine), and their bytes. */
int sim_machine_shared_kept(sim_machine *m, size_t *bytes);
/* send (count) -> recv (k*count). */
sim_status sim_all_gather(sim_device *d, const void *send, void *recv, size_t count, sim_dtype dt, sim_axes axes,
                          sim_meta meta);

/* send (outer, mid, inner) -> recv (outer, mid/k, inner): rank r keeps block r
 * of the sum.  mid must be divisible by k. */
sim_status sim_reduce_scatter_dim(sim_device *d, const void *send, void *recv, size_t outer, size_t mid, size_t inner,
                                  sim_dtype dt, sim_axes axes, sim_meta meta);
/* send (count) -> recv (count/k); count must be divisible by k. */
sim_status sim_reduce_scatter(sim_device *d, const void *send, void *recv, size_t count, sim_dtype dt, sim_axes axes,
                              sim_meta meta);

/* send (count) -> recv (count), sum over the group; send == recv allowed. */
sim_status sim_all_reduce(sim_device *d, const void *send, void *recv, size_t count, sim_dtype dt, sim_axes axes,
                          sim_meta meta);

/* Local array of `rank` dims `shape`: split dim `split` into k blocks, send
 * block r to rank r, and concatenate the blocks received along dim `concat`
 * (block q from rank q).  shape[split] must be divisible by k.  The output
 * shape is shape with shape[split]/k and shape[concat]*k (split == concat
 * exchanges blocks in place of the same dim). */
sim_status sim_all_to_all_dims(sim_device *d, const void *send, void *recv, int rank, const size_t *shape, int split,
                               int concat, sim_dtype dt, sim_axes axes, sim_meta meta);
/* send (k, count/k) -> recv (k, count/k); count must be divisible by k. */
sim_status sim_all_to_all(sim_device *d, const void *send, void *recv, size_t count, sim_dtype dt, sim_axes axes,
                          sim_meta meta);

/* perm[src_rank] = destination rank or -1; the same table on every member,
 * a destination at most once.  A device no one sends to gets zeros. */
sim_status sim_ppermute(sim_device *d, const void *send, void *recv, size_t count, const int *perm, sim_dtype dt,
                        sim_axes axes, sim_meta meta);

/* Per-peer sizes in elements, indexed by group rank: this device sends
 * send[send_off[q] .. +send_cnt[q]) to rank q and receives recv_cnt[q]
 * elements from rank q at recv[recv_off[q] ..].  recv_cnt[q] on this device
 * must equal send_cnt[this] on rank q.  recv_cap bounds the receive buffer. */
sim_status sim_ragged_all_to_all(sim_device *d, const void *send, void *recv, size_t recv_cap, const size_t *send_off,
                                 const size_t *send_cnt, const size_t *recv_off, const size_t *recv_cnt, sim_dtype dt,
                                 sim_axes axes, sim_meta meta);

/* Records the cost of one local kernel (see sim_cost); the device keeps the costs of its
 * current step only (a new step starts a new list), and clearing the records clears them. */
void sim_device_add_cost(sim_device *d, double flops, double elements, double weight_elements, const char *tag);
/* The same for a kernel whose matrix unit does mxu_flops >= flops (padded tiles): the step-time
 * model times mxu_flops, MFU counts flops. */
void sim_device_add_cost_tiled(sim_device *d, double flops, double mxu_flops, double elements, double weight_elements,
                               const char *tag);
/* The cost of a layout op (no FLOPs; `elements` read and written): the step-time model times it at
 * its own sustained bandwidth (configs/timemodel.yml layout_op_efficiency). */
void sim_device_add_cost_layout(sim_device *d, double elements, const char *tag);
/* Cost events of a device, in call order (valid until the next add). */
const sim_cost *sim_device_costs(const sim_device *d, size_t *n);

/* Records of a device as stored (valid until the next collective on it): with repeated blocks
 * (sim_repeat), read them through sim_walk instead. */
const sim_record *sim_device_records(const sim_device *d, size_t *n);
/* Starts a block that will repeat: the records and costs from here (blocks nest, up to
 * SIM_WALK_DEPTH deep). */
void sim_device_repeat_begin(sim_device *d);
/* Ends the innermost block begun: it stands for itself and `times` more copies right after it
 * (the op totals and the counts below count them; the device's arena accounts the copies'
 * allocations and releases, sim_arena_repeat_end, and an OOM in a copy is returned).  Blocks
 * stay until the records are cleared. */
sim_status sim_device_repeat_end(sim_device *d, uint64_t times);
/* The same for a block that is one layer of a stack whose copies are the next layers (tag_step 1)
 * or, in the backward pass, the previous ones (-1): the walk renumbers their tags (sim_repeat). */
sim_status sim_device_repeat_end_layers(sim_device *d, uint64_t times, int64_t tag_first, int64_t tag_step);
/* The blocks of a device, in the order they began. */
const sim_repeat *sim_device_repeats(const sim_device *d, size_t *n);
/* The records and costs with every block expanded: their counts. */
size_t sim_device_nrecords(const sim_device *d);
size_t sim_device_ncosts(const sim_device *d);
/* A walk over a device's records and costs (or explicit arrays and blocks) in call order, every
 * block expanded; sim_walk_next gives the next record (*rec set, true) or cost (*cost set, its
 * nrec_before counted in the expanded records, true), false at the end. */
void sim_walk_device(sim_walk *w, const sim_device *d);
void sim_walk_init(sim_walk *w, const sim_record *rec, size_t nrec, const sim_cost *cost, size_t ncost,
                   const sim_repeat *reps, size_t nreps);
bool sim_walk_next(sim_walk *w, const sim_record **rec, sim_cost *cost);
/* How many times stored record `rec` occurs once the blocks are expanded (1 outside them). */
uint64_t sim_repeat_weight(const sim_repeat *reps, size_t nreps, size_t rec);
/* The same for records alone (costs skipped). */
const sim_record *sim_walk_next_record(sim_walk *w);
void sim_device_clear_records(sim_device *d);
/* Totals of one op on a device since the last clear. */
sim_op_totals sim_device_op_totals(const sim_device *d, sim_op op);

#endif
