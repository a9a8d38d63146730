/* timemodel.h — hardware profiles (configs/hardware/NAME.yml) and a step-time
 * model over what a run recorded: each kernel's cost (sim_cost: FLOPs and
 * HBM elements) on the roofline of the profile, each collective (sim_record)
 * by an alpha-beta model over the links its group uses (ICI within a slice,
 * DCN across), replayed in call order.  Overlap is data: by default every
 * collective serialises with compute (MaxText gets FSDP overlap from libtpu
 * flags, not by default); with overlap_weight_collectives, collectives that
 * move weights (FSDP gathers, weight-gradient reductions) run asynchronously
 * on the network and everything else waits.  A kernel's time is that of the
 * matrix unit's real work (sim_cost.mxu_flops: padded megablox tiles, visited
 * splash blocks); a memory-bound op (norm, RoPE, activation, residual add:
 * no FLOPs recorded) streams its bytes at hbm_efficiency of HBM bandwidth,
 * a layout op (a split, concatenation or head broadcast: sim_cost.layout)
 * at layout_op_efficiency.  The constants are data (configs/timemodel.yml); the
 * README's "Hardware profiles and the step-time model" states the rules. */
#ifndef MODELS_TIMEMODEL_H
#define MODELS_TIMEMODEL_H

#include <stdbool.h>
#include <stdio.h>

#include "config/config.h"
#include "sim/collectives.h"
#include "sim/machine.h"

/* What the profile's compiler does to MaxText's step beyond the dtypes it moves weights in: each field
 * a key of the profile (configs/hardware/v5p.yml gives each one's evidence; docs/xla-fidelity.md). */
typedef struct {
    bool hoist_casts;         /* hoisted_weight_copies: dtype -- each layer stack's float32 weights cast to
                                 `dtype` once, the device's shard held through the forward and backward loops */
    int ga_grad_copies;       /* accumulation_gradient_copies: gradient sets held beside the gradients while
                                 gradient accumulation runs */
    bool ns_gather_bf16;      /* newton_schulz_gather_dtype: bfloat16 -- float32 Newton-Schulz operands cast
                                 before their gathers (with a one-pass matmul_precision) */
    bool ns_gather_once;      /* newton_schulz_operand_gathers: once -- one gather of X serves X X^T and B X */
    int windowed_min_group;   /* windowed_einsum_min_group: weight products over groups at least this large
                                 run as windowed einsums (0: never) */
    int psum_scatter_max_group; /* psum_scatter_max_group: a shard_map's gradient psum and slice become a
                                 reduce-scatter over at most this many devices, else an all-reduce (0: always) */
    bool embed_all_to_all;    /* embedding_lookup: all_to_all -- under FSDP the token ids are all-gathered, the
                                 rows looked up on the table's shard and all-to-all'd back (gather_table: the
                                 table is all-gathered and its gradient reduce-scattered) */
} model_xla_rules;

/* One accelerator, per JAX device (a chip's figures divided by devices_per_chip). */
typedef struct {
    char name[32];            /* profile name (file stem): "v5p" */
    bool gpu;                 /* kind: gpu (NVLink switch in a node) or tpu (torus links) */
    int devices_per_chip;     /* JAX devices per chip */
    double peak_bf16;         /* FLOP/s, dense bfloat16 */
    double peak_fp8;          /* FLOP/s, dense float8; 0 = not published */
    double peak_f32;          /* FLOP/s, float32; 0 = not published */
    double hbm_bytes;         /* HBM capacity, bytes */
    double hbm_bw;            /* HBM bandwidth, bytes/s */
    double link_bw;           /* TPU: one ICI link, one direction, bytes/s; GPU: NVLink injection per
                                 direction; 0 = not published (collectives cannot be timed) */
    double dcn_bw;            /* DCN per device, bytes/s; 0 = not published */
    int torus[3], torus_n;    /* physical shape of the slice (torus_n = 0 when the profile has none) */
    bool gather_in_dtype;     /* weight_gather_dtype: dtype -- the compiler casts a float32 weight's shard to
                                 `dtype` before its all-gather (false: weight_dtype, the stored dtype) */
    bool reduce_in_dtype;     /* gradient_reduction_dtype: dtype -- parameter gradients are reduced in `dtype` */
    model_xla_rules xla;      /* the compiler's program transformations (hoisted_weight_copies, ...) */
} model_hw;

/* The model's efficiency constants (configs/timemodel.yml). */
typedef struct {
    double mxu;               /* fraction of peak FLOP/s a matmul sustains */
    double hbm;               /* fraction of HBM bandwidth a memory-bound kernel sustains */
    double layout;            /* the same for a layout op (sim_cost.layout: MLA's splits, concatenations and
                                 head broadcasts, copies that change the array's tiling) */
    double ici;               /* fraction of link bandwidth a collective sustains */
    double dcn;               /* fraction of DCN bandwidth */
    double hop_latency_s;     /* alpha: per step of a ring / per collective hop */
    int prefetch;             /* weight collectives that may run ahead of compute */
    bool overlap_weights;     /* weight collectives run asynchronously beside compute (else they serialise) */
} model_tm_eff;

/* Profile names in <configs>/hardware (sorted, comma separated) into buf. */
const char *model_hw_names(const char *configs_dir, char *buf, size_t cap);
/* Loads <configs>/hardware/NAME.yml for a slice of `devices_per_slice` devices (0: unknown);
 * an unknown name is SIM_ERR_INPUT listing the valid ones. */
sim_status model_hw_load(const char *configs_dir, const char *name, int devices_per_slice, model_hw *out);
/* The profile a config selects: hardware_profile=NAME, else compile_topology's family
 * (v5p-8 -> v5p).  *found = false when neither is set. */
sim_status model_hw_from_config(const mesh_cfg *cfg, const char *configs_dir, int devices_per_slice,
                                model_hw *out, bool *found);
sim_status model_tm_eff_load(const char *configs_dir, model_tm_eff *out);
/* The dtypes float32-stored weights are all-gathered and their gradients reduced in, as the compiler of
 * the profile the config selects moves them: `act` (dtype) where the profile says dtype and act is the
 * narrower, else `weight` (weight_dtype: XLA:CPU's behaviour, and the rule with no profile).  rule: one
 * line saying which rule applied (run.json, the config box). */
sim_status model_hw_wire_dtypes(const mesh_cfg *cfg, const char *configs_dir, sim_dtype act, sim_dtype weight,
                                sim_dtype *gather, sim_dtype *reduce, char *rule, size_t cap);

/* The compiler rules of the profile the config selects, for `dtype` act and `weight_dtype` weight: the
 * profile's keys where one is selected and a rule applies (the hoisted copy only when act is narrower;
 * bfloat16 Newton-Schulz gathers only at matmul_precision default or bfloat16, one bfloat16 pass), all
 * off without a profile (XLA:CPU, the peer on this machine). */
sim_status model_hw_xla_rules(const mesh_cfg *cfg, const char *configs_dir, sim_dtype act, sim_dtype weight,
                              model_xla_rules *out);
/* The rules in force, one line ("hoisted weight copies, windowed einsums over >= 8 devices, ..." or "none"):
 * the config box and run.json. */
const char *model_xla_rules_text(const model_xla_rules *r, char *buf, size_t cap);

/* Peak FLOP/s for an activation dtype name; *note set when the dtype's figure is not published
 * and the bfloat16 figure stands in. */
double model_hw_peak(const model_hw *hw, const char *dtype, const char **note);

/* Time of one collective record (seconds); links and bandwidth used for the listing. */
double model_tm_collective(const model_hw *hw, const model_tm_eff *eff, const sim_record *r, int *links,
                           double *bw);

enum { MODEL_TM_MAX_AXES = 16, MODEL_TM_TOP = 8 };

/* One collective as the model timed it. */
typedef struct {
    sim_record rec;
    int links;
    double bw;                /* bytes/s the model gives its group, per device */
    double time_s;
    bool async;
} model_tm_coll;

/* The kernels of one kind (their tags with the layer numbers left out) as the model timed them. */
typedef struct {
    char name[SIM_TAG_MAX];   /* tag with every digit run replaced by '*' */
    int calls;
    double flops;             /* useful FLOPs */
    double mxu_flops;         /* the matrix unit's work (padded tiles included) */
    double bytes;             /* HBM bytes read and written */
    double time_s;
    int compute_bound;        /* calls whose FLOPs (not bytes) set the time */
} model_tm_kernel;

/* The collectives of one kind (op, axes, phase and tag without its layer numbers) as timed. */
typedef struct {
    sim_record rec;           /* the first one (its tag with digit runs as '*') */
    int calls;
    double bytes;             /* bytes sent, all calls */
    int links;
    double bw;
    double time_s;            /* all calls */
} model_tm_coll_kind;

/* A span of the modelled timeline (for trace.json). */
typedef struct {
    double t0, t1;            /* seconds from the step start */
    int lane;                 /* 0 compute, 1 blocking collectives, 2 asynchronous collectives */
    char name[SIM_TAG_MAX];
} model_tm_span;

typedef struct {
    double step_s;            /* estimated step time */
    double compute_s;         /* kernel time on the slowest device (includes bubbles) */
    double bubble_s;          /* of compute_s, pipeline bubble iterations */
    double optimizer_s;       /* optimizer update (memory-bound) */
    double exposed_s;         /* communication compute waited for */
    int naxes;                /* exposed communication per group of mesh axes */
    sim_axes axes[MODEL_TM_MAX_AXES];
    double exposed_axes_s[MODEL_TM_MAX_AXES];
    double model_flops;       /* per device: 3 x forward FLOPs (without remat recompute or bubbles) */
    double mfu;               /* model_flops / (step_s x peak) */
    double peak;              /* FLOP/s used */
    int device;               /* the slowest device */
    int ntop;                 /* the slowest collectives of that device */
    model_tm_coll top[MODEL_TM_TOP];
    int ncolls;               /* the slowest kinds of collective of that device, slowest first */
    model_tm_coll_kind colls[MODEL_TM_TOP];
    int nkernels;             /* the slowest kinds of kernel of that device, slowest first */
    model_tm_kernel kernels[MODEL_TM_TOP];
    model_tm_span *spans;     /* the slowest device's timeline when asked for (free with free()) */
    size_t nspans;
} model_tm_result;

/* The model for one device's records and costs of step `step`: fills everything of *out but
 * optimizer_s, model_flops and mfu; with want_spans, out->spans (caller frees). */
sim_status model_tm_device(const model_hw *hw, const model_tm_eff *eff, double peak, double act_bytes,
                           const sim_record *recs, size_t nrec, const sim_cost *costs, size_t ncost, int step,
                           bool want_spans, model_tm_result *out);

/* Whole machine: the slowest device's step `step`, plus the optimizer update (bytes per device it
 * reads and writes: params, grads, optimizer state at peak) and MFU. */
sim_status model_tm_estimate(const model_hw *hw, const model_tm_eff *eff, const char *dtype, sim_machine *m,
                             int step, double bubble_fraction, double optimizer_bytes, bool want_spans,
                             model_tm_result *out);

/* Bytes the optimizer update reads and writes on the busiest device: AdamW reads parameters,
 * gradients and both moments and writes parameters and moments (2 P + G + 2 O, each category
 * as held at the device's peak), and MaxText's step reads the raw and the clipped gradients and
 * the new parameters once more for its norms (+ 2 G + P). */
double model_tm_optimizer_bytes(sim_machine *m);

/* Console summary (device 0 style): step time, MFU, breakdown, slowest collectives. */
void model_tm_print(FILE *f, const model_hw *hw, const sim_mesh_desc *mesh, const model_tm_result *r);
/* The same as a JSON object (no trailing newline). */
void model_tm_write_json(FILE *f, const model_hw *hw, const sim_mesh_desc *mesh, const model_tm_result *r);
/* Chrome trace of the modelled timeline of the slowest device, to f (sim/trace.h's writer; the
 * caller makes the file appear whole, e.g. through cli_artifact_write). */
sim_status model_tm_write_trace(FILE *f, const model_hw *hw, const model_tm_result *r);

#endif
