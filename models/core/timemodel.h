/* timemodel.h — a step-time model on a hardware profile (config/hardware.h) over what a run recorded: each kernel's cost (sim_cost: FLOPs and
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
#include "config/hardware.h"
#include "config/json.h"
#include "sim/collectives.h"
#include "sim/machine.h"

/* The model's efficiency constants (configs/timemodel.yml). */
typedef struct {
    double mxu;           /* fraction of peak FLOP/s a matmul sustains */
    double hbm;           /* fraction of HBM bandwidth a memory-bound kernel sustains */
    double layout;        /* the same for a layout op (sim_cost.layout: MLA's splits, concatenations and
                                 head broadcasts, copies that change the array's tiling) */
    double ici;           /* fraction of link bandwidth a collective sustains */
    double dcn;           /* fraction of DCN bandwidth */
    double hop_latency_s; /* alpha: per step of a ring / per collective hop */
    int prefetch;         /* weight collectives that may run ahead of compute */
    bool overlap_weights; /* weight collectives run asynchronously beside compute (else they serialise) */
} model_tm_eff;

sim_status model_tm_eff_load(const char *configs_dir, model_tm_eff *out);
/* The dtypes float32-stored weights are all-gathered and their gradients reduced in, as the compiler of
 * the profile the config selects moves them: `act` (dtype) where the profile says dtype and act is the
 * narrower, else `weight` (weight_dtype: XLA:CPU's behaviour, and the rule with no profile).  rule: one
 * line saying which rule applied (run.json, the config box). */
sim_status model_hw_wire_dtypes(const cfg_config *cfg, sim_dtype act, sim_dtype weight, sim_dtype *gather,
                                sim_dtype *reduce, char *rule, size_t cap);

/* The compiler rules of the profile the config selects, for `dtype` act and `weight_dtype` weight: the
 * profile's keys where one is selected and a rule applies (the hoisted copy only when act is narrower;
 * bfloat16 Newton-Schulz gathers only at matmul_precision default or bfloat16, one bfloat16 pass), all
 * off without a profile (XLA:CPU, the peer on this machine). */
sim_status model_hw_xla_rules(const cfg_config *cfg, sim_dtype act, sim_dtype weight, cfg_xla_rules *out);
/* The rules in force, one line ("hoisted weight copies, windowed einsums over >= 8 devices, ..." or "none"):
 * the config box and run.json. */
const char *model_xla_rules_text(const cfg_xla_rules *r, char *buf, size_t cap);

/* Peak FLOP/s for an activation dtype name; *note set when the dtype's figure is not published
 * and the bfloat16 figure stands in. */
double model_hw_peak(const cfg_hw *hw, const char *dtype, const char **note);

/* Time of one collective record (seconds); links and bandwidth used for the listing. */
double model_tm_collective(const cfg_hw *hw, const model_tm_eff *eff, const sim_record *r, int *links, double *bw);

enum { MODEL_TM_MAX_AXES = 16, MODEL_TM_TOP = 8 };

/* One collective as the model timed it. */
typedef struct {
    sim_record rec;
    int links;
    double bw; /* bytes/s the model gives its group, per device */
    double time_s;
    bool async;
} model_tm_coll;

/* The kernels of one kind (their tags with the layer numbers left out) as the model timed them. */
typedef struct {
    char name[SIM_TAG_MAX]; /* tag with every digit run replaced by '*' */
    int calls;
    double flops;     /* useful FLOPs */
    double mxu_flops; /* the matrix unit's work (padded tiles included) */
    double bytes;     /* HBM bytes read and written */
    double time_s;
    int compute_bound; /* calls whose FLOPs (not bytes) set the time */
} model_tm_kernel;

/* The collectives of one kind (op, axes, phase and tag without its layer numbers) as timed. */
typedef struct {
    sim_record rec; /* the first one (its tag with digit runs as '*') */
    int calls;
    double bytes; /* bytes sent, all calls */
    int links;
    double bw;
    double time_s; /* all calls */
} model_tm_coll_kind;

/* A span of the modelled timeline (for trace.json). */
typedef struct {
    double t0, t1; /* seconds from the step start */
    int lane;      /* 0 compute, 1 blocking collectives, 2 asynchronous collectives */
    char name[SIM_TAG_MAX];
} model_tm_span;

typedef struct {
    double step_s;      /* estimated step time */
    double compute_s;   /* kernel time on the slowest device (includes bubbles) */
    double bubble_s;    /* of compute_s, pipeline bubble iterations */
    double optimizer_s; /* optimizer update (memory-bound) */
    double exposed_s;   /* communication compute waited for */
    int naxes;          /* exposed communication per group of mesh axes */
    sim_axes axes[MODEL_TM_MAX_AXES];
    double exposed_axes_s[MODEL_TM_MAX_AXES];
    double model_flops; /* per device: 3 x forward FLOPs (without remat recompute or bubbles) */
    double mfu;         /* model_flops / (step_s x peak) */
    double peak;        /* FLOP/s used */
    int device;         /* the slowest device */
    int ntop;           /* the slowest collectives of that device */
    model_tm_coll top[MODEL_TM_TOP];
    int ncolls; /* the slowest kinds of collective of that device, slowest first */
    model_tm_coll_kind colls[MODEL_TM_TOP];
    int nkernels; /* the slowest kinds of kernel of that device, slowest first */
    model_tm_kernel kernels[MODEL_TM_TOP];
    model_tm_span *spans; /* the slowest device's timeline when asked for (free with free()) */
    size_t nspans;
} model_tm_result;

/* The model for one device's records and costs of step `step`: fills everything of *out but
 * optimizer_s, model_flops and mfu; with want_spans, out->spans (caller frees). */
sim_status model_tm_device(const cfg_hw *hw, const model_tm_eff *eff, double peak, double act_bytes,
                           const sim_record *recs, size_t nrec, const sim_cost *costs, size_t ncost, int step,
                           bool want_spans, model_tm_result *out);

/* Whole machine: the slowest device's step `step`, plus the optimizer update (optimizer_bytes: what
 * it reads and writes per device, model_opt_step_bytes) and MFU. */
sim_status model_tm_estimate(const cfg_hw *hw, const model_tm_eff *eff, const char *dtype, sim_machine *m, int step,
                             double bubble_fraction, double optimizer_bytes, bool want_spans, model_tm_result *out);

/* Console summary (device 0 style): step time, MFU, breakdown, slowest collectives. */
void model_tm_print(FILE *f, const cfg_hw *hw, const sim_mesh_desc *mesh, const model_tm_result *r);
/* The same as a JSON object, added to the writer (run.json's "step_time_model"). */
void model_tm_json(cfg_jw *w, const cfg_hw *hw, const sim_mesh_desc *mesh, const model_tm_result *r);
/* Chrome trace of the modelled timeline of the slowest device, to f (sim/trace.h's writer; the
 * caller makes the file appear whole, e.g. through cli_artifact_write). */
sim_status model_tm_write_trace(FILE *f, const cfg_hw *hw, const model_tm_result *r);

#endif
