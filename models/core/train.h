/* train.h — running the model on a simulated machine: one forward/backward
 * pass with the gradients brought back as global tensors (tests, parity),
 * and the training loop (steps of data, forward, backward, clipping, AdamW,
 * checkpoints) with its per-step metrics. */
#ifndef MODELS_TRAIN_H
#define MODELS_TRAIN_H

#include "models/core/data.h"
#include "models/core/model.h"
#include "models/core/optimizer.h"
#include "sim/machine.h"

/* Global host copies of every parameter's gradient (layer-major: layer l of
 * parameter i at grads[i] + l * per-layer elements). */
typedef struct {
    int n;
    float *g[MODEL_MAX_PARAMS];
    int64_t layer_elems[MODEL_MAX_PARAMS];
    int n_layers[MODEL_MAX_PARAMS];
} model_grads;

void model_grads_free(model_grads *g);
/* ||a - ref|| / ||ref|| over n values (in double): how parity compares gradients. */
double model_rel_norm_diff(const float *a, const float *ref, int64_t n);

/* One forward and backward pass of a batch (host arrays of def->d.batch x
 * seq int32) on machine m: the loss and, if grads != NULL, every gradient
 * as a global tensor.  The machine's mesh must be def->mesh. */
sim_status model_loss_and_grads(const model_def *def, sim_machine *m, const int32_t *inputs, const int32_t *targets,
                                const int32_t *positions, double *loss, model_grads *grads);
/* The same, starting from the global parameter values in params_in (same
 * layout as model_grads; NULL: the seeded init), and copying the parameters
 * used into params_out (NULL: not wanted). */
sim_status model_loss_and_grads_from(const model_def *def, sim_machine *m, const int32_t *inputs,
                                     const int32_t *targets, const int32_t *positions, const model_grads *params_in,
                                     model_grads *params_out, double *loss, model_grads *grads);
/* Allocates g with the layout of the model's parameters (zeroed). */
void model_grads_alloc(const model_def *def, model_grads *g);

/* A machine for the model's mesh (capacity from hbm_limit_gb, dry run, trace). */
/* Under MPI each rank's global arrays hold its devices' shards (zeros elsewhere): after this every
 * rank holds them all (sim_xrank_or_merge). */
sim_status model_grads_merge_ranks(model_grads *g);
sim_status model_machine_new(const model_def *def, double hbm_limit_gb, bool trace, sim_machine **out);

/* One training step's figures (device 0's view; the loss is replicated). */
typedef struct {
    int64_t step;
    double loss;          /* mean token loss before the update */
    double mtp_loss;      /* of which the multi-token prediction loss (MaxText's learning/mtp_loss; 0 without) */
    double grad_norm;     /* global norm of the gradients the update applied, after clipping (MaxText's
                           * learning/grad_norm; model_clipped_norm) */
    double raw_grad_norm; /* global gradient norm before clipping (MaxText's learning/raw_grad_norm) */
    double lr;            /* learning rate of the update */
    double time_s;        /* wall time of the step (all devices) */
    size_t peak_bytes;    /* highest arena peak over devices so far */
} model_step_stats;

typedef void (*model_step_cb)(const model_step_stats *s, void *arg);

typedef struct {
    const model_def *def;
    const model_data *data; /* opened by the caller */
    model_optim_cfg opt;
    long long steps;
    const char *checkpoint_dir; /* "" or NULL: none; else DIR/step_<s>.safetensors after step s (see below) */
    long long checkpoint_period;
    const char *load_path; /* "" or NULL: start from the seeded init */
    /* load_path holds the full state (load_full_state_path, or the latest
     * checkpoint of checkpoint_dir): the parameters, the optimizer moments
     * and the step it was saved after, which must be start_step - 1
     * (model_checkpoint_step).  Training then runs steps start_step..steps-1:
     * the schedule, the update count, the dropout masks and the data are
     * functions of the step, so they continue where the saving run stopped.
     * false: load_path holds the parameters to start from at step 0
     * (load_parameters_path).  Checkpoints are saved as MaxText saves them:
     * after step s when s % checkpoint_period == 0 (step 0 unless
     * skip_save_on_start), and after the last step (unless
     * skip_save_on_completion). */
    bool load_full_state;
    long long start_step;
    bool skip_save_on_start;      /* save_checkpoint_on_start=false: no checkpoint after step 0 */
    bool skip_save_on_completion; /* save_checkpoint_on_completion=false: none after the last step off the period */
    model_step_cb on_step;        /* called by device 0 after every step */
    void *cb_arg;
    /* optional: called by device 0 after each layer's forward or backward (remat_policy=full) */
    void (*on_layer)(void *arg, int64_t step, int layer, bool backward);
    int64_t step;                          /* the step running (for on_layer) */
    model_step_stats *stats;               /* [steps], filled from start_step on */
    model_grads *step_grads;               /* [steps] or NULL: every step's gradients (before clipping) */
    model_grads *final_params;             /* NULL or: every parameter after the last step (allocated by model_train) */
    int32_t *inputs, *targets, *positions; /* host scratch: the step's rows (ga x rows_loaded) x seq (model_train) */
    int32_t *mb_inputs, *mb_targets, *mb_positions; /* one microbatch, rows_loaded x seq (the above when ga = 1) */
    float *scratch;                                 /* one stacked parameter (ZeRO-1 step_grads), or NULL */
    /* A dry run simulates the first microbatch and one steady-state one, and accounts the other
     * ga - 2 as repeats of the second (sim_repeat: the same records, costs and peaks, figures
     * alike); dry_full simulates every one (the reference the shortcut is tested against). */
    bool dry_full;
} model_train_job;

/* Microbatch g of a step's host rows (ga x rows, seq each) into out (rows x
 * seq), as MaxText splits them (reshape [rows, ga] then swap): row j of
 * microbatch g is row j * ga + g of the step. */
void model_microbatch_rows(const int32_t *step, int64_t rows, int64_t seq, int64_t ga, int64_t g, int32_t *out);

/* Trains job->steps steps on machine m.  A step (gradient_accumulation_steps
 * = ga) runs ga forward/backward passes over its microbatches, adding each
 * one's gradient with weight 1/ga into the same float32 gradients; the loss
 * is the mean of the microbatch losses.  With ZeRO-1 the parameters are
 * all-gathered over 'data' once before the passes and the gradients brought
 * to the optimizer layout once after them (models/core/optimizer.h). */
sim_status model_train(model_train_job *job, sim_machine *m);

#endif
