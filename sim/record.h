/* record.h — what a device keeps of the work it did: the collective ops, one record per
 * collective call (bytes sent and received, the group, the tag), one cost per local kernel (for
 * the step-time model) and per-op totals.  Plain data: the collectives (collectives.c) write
 * them, the machine (machine.c) holds them per device, the trace and the reports read them. */
#ifndef SIM_RECORD_H
#define SIM_RECORD_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "sim/types.h"

typedef enum {
    SIM_OP_ALL_GATHER = 0,
    SIM_OP_REDUCE_SCATTER,
    SIM_OP_ALL_REDUCE,
    SIM_OP_ALL_TO_ALL,
    SIM_OP_PPERMUTE,
    SIM_OP_RAGGED_ALL_TO_ALL,
    SIM_NOP
} sim_op;
const char *sim_op_name(sim_op op);

/* One collective call as seen by one device. */
typedef struct {
    int step; /* sim_device_step() at the call */
    sim_op op;
    sim_phase phase;
    sim_axes axes;           /* mesh axes of the group, in rank order */
    int group_size;          /* k */
    sim_dtype dtype;         /* the counted dtype (sim_meta), which sets the bytes */
    uint64_t elements;       /* local input elements */
    uint64_t bytes_sent;     /* by this device to other devices */
    uint64_t bytes_sent_dcn; /* of bytes_sent, to devices in other slices (DCN; the rest is ICI) */
    uint64_t bytes_recv;     /* by this device from other devices */
    bool implicit;           /* inserted by the planner */
    bool weight;             /* moves a parameter or a parameter's gradient (sim_meta.weight) */
    char tag[SIM_TAG_MAX];   /* layer/op that caused it */
} sim_record;

/* The work of one local kernel, for the step-time model: FLOPs, the elements
 * it reads and writes in HBM (counted in the model's dtype by the reader),
 * of which weight_elements are parameters (read in weight_dtype-cast form).
 * Kept in call order beside the collective records: nrec_before collective
 * records of the device precede it. */
typedef struct {
    int step;
    sim_phase phase;
    double flops;
    double mxu_flops; /* the matrix unit's work: flops plus the padding of a tiled kernel
                               * (megablox gmm tiles, sim_device_add_cost_tiled); = flops otherwise */
    double elements;
    double weight_elements;
    bool layout; /* a layout op (split, concatenation, head broadcast): no FLOPs, a copy that
                               * changes the array's tiling (sim_device_add_cost_layout) */
    size_t nrec_before;
    char tag[SIM_TAG_MAX];
} sim_cost;

/* A block of a device's records and kernel costs that repeats `times` more times right after
 * itself: a dry run simulates one steady-state iteration of a loop whose iterations are alike
 * (gradient accumulation's microbatches, a stack's identical layers) and accounts the rest as this
 * block, so what it keeps does not grow with the loop's count.  Blocks nest (a layer's inside a
 * microbatch's) or follow one another.  A reader sees the stored records and costs with every block
 * expanded, walking them in order (sim_walk). */
typedef struct {
    size_t rec0, rec1;   /* records [rec0, rec1) as stored */
    size_t cost0, cost1; /* costs [cost0, cost1) as stored */
    uint64_t times;      /* copies after the block itself */
    /* a stack of identical layers: the walk renumbers the layer in the tags of the block's records
     * and costs (the number after the tag's first "layers_"), by tag_first + j tag_step in its
     * j-th walk (0: the block as stored); 0 and 0 leave the tags as stored */
    int64_t tag_first, tag_step;
} sim_repeat;

/* A walk over records and costs in call order, every repeated block expanded (sim_walk_next). */
enum { SIM_WALK_DEPTH = 8 };
typedef struct {
    const sim_record *rec;
    size_t nrec;
    const sim_cost *cost;
    size_t ncost;
    const sim_repeat *reps; /* in the order the blocks began (an outer one before those inside it) */
    size_t nreps;
    size_t ri, ci;     /* the next stored record and cost */
    size_t next;       /* the next block not yet entered */
    size_t vrec;       /* records walked so far, repeats counted */
    int depth;         /* blocks entered */
    size_t open[SIM_WALK_DEPTH];
    uint64_t left[SIM_WALK_DEPTH];
    sim_record renamed; /* the last record given, where a block renumbered its tag */
} sim_walk;

/* Per-device totals of one op. */
typedef struct {
    uint64_t calls;
    uint64_t bytes_sent;
    uint64_t bytes_recv;
} sim_op_totals;

#endif
