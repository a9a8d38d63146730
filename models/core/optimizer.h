/* optimizer.h — the optimizer interface: the table's row type, what every optimizer shares
 * (MaxText's learning-rate schedule, global-norm gradient clipping, the global gradient norm over
 * the mesh, adamw_mask), and a parameter's optimizer state as named slots.
 *
 * The rows live above core, one file each in models/optimizers/ (adamw.c, sgd.c, muon.c,
 * adam_pax.c), and are listed in models/optimizers/optim.h (MODEL_OPTIMIZERS; the array
 * model_optimizers); core reaches them only through that array.  Everything else asks the row:
 * the config (model_optim_from_config), the model definition (which parameters keep which slots:
 * model_opt_define), the device state (model_dev_init allocates model_param.slot[] as the row
 * says), the update (model_opt_update), ZeRO-1's placement (model_opt_zero1_check), pipeline
 * support, the checkpoint (slot k of a parameter is saved as "opt_state.<slot name>.<path>") and
 * the train-state dump (the row writes optax's state tree, model_opt_tree).  A new optimizer is
 * one C file that defines its row, and one line in MODEL_OPTIMIZERS.
 *
 * Schedule (maxtext_utils.create_learning_rate_schedule, lr_schedule_type
 * cosine), for the 0-based update count s (optax evaluates the schedule at
 * the count of updates already applied), with S = learning_rate_schedule_steps
 * (-1: steps), W = int(S * warmup_steps_fraction), C = S - W, peak lr and
 * final = lr * learning_rate_final_fraction:
 *   s < W:          lr * s / (W - 1)     (optax.linear_schedule over W-1 steps; 0 when W = 1)
 *   W <= s < S:     final + (lr - final) * (1 + cos(pi * p)) / 2, p = (s - W) / (C - 1) (p = 1 when C = 1)
 *   s >= S:         0 when steps > S     (MaxText's "constant learning rate of 0" tail)
 * (pieces joined as optax.join_schedules does; with steps <= S training never
 * reaches s >= S, where MaxText's last piece just continues).  So the first
 * update has lr 0 whenever W >= 1 (MaxText behaves the same).
 *
 * Clipping (maxtext_utils.apply_gradient_clipping, before any optimizer):
 *   g <- g                       if threshold <= 0 or norm < threshold
 *   g <- (g / norm) * threshold  otherwise
 *
 * Weight-decay mask (optimizers.get_adamw_mask, for the optimizers whose row
 * sets decay_mask): adamw_mask is a list of regular expressions; a parameter
 * whose path ("decoder/layers/mlp/wi_0/kernel": jax.tree_util.keystr(path,
 * simple=True, separator="/") of the NNX parameter state) matches one of them
 * (re.search) gets no weight decay.
 *
 * ZeRO-1 (shard_optimizer_over_data, MaxText's layout rule in params.h
 * model_zero1_spec): the update runs unchanged on the device's stacked
 * optimizer-layout views (model_dev.z: parameters, gradient and every slot as
 * one array each, sharded over 'data' too), so each device updates only its
 * shard; train.c all-gathers the parameters over 'data' before the next
 * forward pass and reduce-scatters the gradients into that layout after the
 * backward pass. */
#ifndef MODELS_CORE_OPTIMIZER_H
#define MODELS_CORE_OPTIMIZER_H

#include <stdbool.h>
#include <stddef.h>

#include "config/config.h"
#include "mesh/ctx.h"
#include "models/core/params.h"

/* The per-optimizer settings a row reads (model_muon_cfg for Muon), kept inside model_optim_cfg
 * so that the config is one value that copies. */
enum { MODEL_OPT_PRIV_BYTES = 8192, MODEL_OPT_PARAM_PRIV_BYTES = 128 };

typedef struct model_optimizer model_optimizer;

typedef struct model_optim_cfg {
    int type;                   /* opt_type: its row's number in model_optimizers (MODEL_OPT_<NAME>,
                                        models/optimizers/optim.h) */
    const model_optimizer *row; /* its row */
    double lr;                  /* learning_rate: the peak */
    double warmup_fraction;     /* warmup_steps_fraction */
    double final_fraction;      /* learning_rate_final_fraction */
    long long schedule_steps;   /* learning_rate_schedule_steps, -1 resolved to steps */
    long long steps;            /* steps */
    double b1, b2;              /* adam_b1, adam_b2 */
    double eps, eps_root;       /* adam_eps (outside the root), adam_eps_root (inside) */
    double weight_decay;        /* adam_weight_decay (decoupled) */
    double clip;                /* gradient_clipping_threshold; <= 0: no clipping */
    _Alignas(max_align_t) unsigned char priv[MODEL_OPT_PRIV_BYTES]; /* the row's own keys (row->from_config) */
} model_optim_cfg;

/* How the optimizer treats one parameter, decided once when the model is defined. */
typedef struct {
    int n_slots; /* state slots the parameter keeps: model_param.slot[0 .. n_slots) */
    bool decay;  /* weight decay applies (not excluded by adamw_mask) */
    int branch;  /* a partitioned optimizer's part (Muon: 1 a Muon leaf, -1 its AdamW fallback); 0 none */
    _Alignas(max_align_t) unsigned char priv[MODEL_OPT_PARAM_PRIV_BYTES]; /* the row's own classification */
} model_opt_param;

/* One update, as the step loop hands it to a row. */
typedef struct {
    mesh_ctx *ctx; /* the device (and its mesh) */
    const model_optim_cfg *o;
    const model_opt_param *pp; /* [n]: each parameter's treatment */
    model_param *params;       /* [n]: values, gradients and slots; updated in place */
    int n;
    long long s;      /* updates already applied (0 for the first) */
    double grad_norm; /* model_grad_global_norm's result (clipping) */
} model_opt_step;

/* The optimizer's part of MaxText's train-state tree (named_shardings.json, logical_shardings.json),
 * for a row's `tree` to emit in JAX's order: keys are whole keystrs (".opt_state/[0]/.count"). */
typedef struct {
    int n;                  /* parameters, in JAX's tree order (sorted paths) */
    const char *const *rel; /* each one's keystr below ['params'] ("/['decoder']/['norm']/['scale']") */
    const bool *stateless;  /* [n]: no optimizer state (a non-trainable variable) */
    const int *branch;      /* [n]: model_opt_param.branch */
    /* one leaf: param >= 0 a slot of that parameter (its shape, the optimizer layout), else a scalar
     * (len 0) or a replicated vector of len elements */
    sim_status (*leaf)(void *arg, const char *key, int param, int64_t len);
    void *arg;
} model_opt_tree;

enum { MODEL_OPT_KEY_MAX = 1024 };

struct model_optimizer {
    const char *name;                      /* opt_type */
    int n_slots;                           /* state slots per parameter (at most) */
    const char *slot[MODEL_OPT_SLOTS_MAX]; /* their names, as optax's state calls them ("mu", "nu") */
    bool decay_mask;                       /* adamw_mask decides which parameters decay */
    /* shard_optimizer_over_data=true: NULL (MaxText shards the state over 'data'), or the whole
     * refusal message */
    const char *zero1_refused;
    /* pipeline parallelism: NULL (supported), or why not and what to use instead */
    const char *pipeline_refused;
    /* Reads the row's own keys into o->priv, refuses what is not supported (NULL: nothing to read). */
    sim_status (*from_config)(const cfg_config *cfg, model_optim_cfg *o);
    /* At model definition: checks the parameters and classifies each (out[i] comes with the row's
     * n_slots, the decay mask and branch 0 filled in); NULL keeps that. */
    sim_status (*define)(const cfg_config *cfg, const model_param_def *defs, int n, model_opt_param *out);
    /* One update of every local shard, in place, and its collectives (phase optimizer). */
    sim_status (*update)(const model_opt_step *st);
    /* optax's state tree for the dump: every leaf below .opt_state, in JAX's order. */
    sim_status (*tree)(const model_opt_tree *t);
    /* The update's HBM traffic for one trained parameter, as the number of arrays the size of its
     * shard that the update's elementwise kernels read plus write (the step-time model's optimizer
     * term, model_opt_step_bytes; the update's mesh ops, e.g. Muon's Newton-Schulz einsums, are
     * timed from their own records).  NULL: the parameter, its gradient and every slot read, the
     * parameter and every slot written, 3 + 2 n_slots (AdamW's one fused pass: 7). */
    int (*traffic)(const model_opt_param *pp);
};

/* The table, listed in models/optimizers/optim.h (MODEL_OPTIMIZERS): row i is opt_type number i. */
extern const model_optimizer *const model_optimizers[];
extern const int model_n_optimizers;

/* The row of opt_type `name`, or NULL. */
const model_optimizer *model_optimizer_find(const char *name);

/* Reads every key above from the config (the base config defines them all), then the row's own;
 * lr_schedule_type must be "cosine". */
sim_status model_optim_from_config(const cfg_config *cfg, model_optim_cfg *out);

/* At model definition: opt_type's row (*row) and each parameter's treatment (out[n]): the row's
 * slot count (none for a non-trainable variable), the weight-decay mask, the row's own checks
 * and classification. */
sim_status model_opt_define(const cfg_config *cfg, const model_param_def *defs, int n, const model_optimizer **row,
                            model_opt_param *out);

/* The refusal of ZeRO-1 with opt_type's row as an error (SIM_OK when the row supports it). */
sim_status model_opt_zero1_check(const cfg_config *cfg);

/* One optimizer update of every parameter of this device (o->row's update); s = updates already
 * applied; grad_norm = the global norm.  Gradients are read, not changed. */
sim_status model_opt_update(mesh_ctx *ctx, const model_optim_cfg *o, const model_opt_param *pp, model_param *params,
                            int n, long long s, double grad_norm);

/* Shard-sized arrays row's update reads plus writes for a parameter treated as pp says (row->traffic, or
 * 3 + 2 n_slots); 0 for a non-trainable variable (state_var: no gradient, no state, not updated). */
int model_opt_update_traffic(const model_optimizer *row, const model_opt_param *pp, bool state_var);

/* The train state's optimizer leaves as row `row` (NULL: opt_type's default, row 0) holds them. */
sim_status model_opt_tree_write(const model_optimizer *row, const model_opt_tree *t);

/* Learning rate of update s (0-based). */
double model_lr_at(const model_optim_cfg *o, long long s);

/* Whether the update clips the gradients of global norm `norm`: a threshold > 0 and norm not below
 * it (optax.clip_by_global_norm keeps the gradients when g_norm < max_norm, a NaN norm clips). */
bool model_clip_applies(const model_optim_cfg *o, double norm);

/* Factor clipping multiplies the gradients by: min(1, threshold / norm). */
double model_clip_factor(const model_optim_cfg *o, double norm);

/* The global norm of the gradients the update applies, given the raw global norm: the raw norm,
 * or when clipping applies the raw norm times the float32 factor threshold / norm the kernels
 * scale every element by (bk_optim.h), i.e. the threshold to float32 rounding.  MaxText logs it as
 * learning/grad_norm and the raw norm as learning/raw_grad_norm (trainers/pre_train/train.py
 * train_step: max_utils.l2norm_pytree of the grads after maxtext_utils.apply_gradient_clipping,
 * optax.clip_by_global_norm, and of raw_grads). */
double model_clipped_norm(const model_optim_cfg *o, double norm);

/* Whether `device` holds the one copy of layer `layer` of p (stored in `a`,
 * a w/g/slot array of that layer) that counts: it holds the layer (when the
 * stacked spec splits the layers, e.g. over 'stage', only that block's
 * devices do) and has coordinate 0 on every other mesh axis the spec does not
 * use.  Summing or writing over primaries visits each global element once.
 * Partial arrays are an error. */
sim_status model_layer_primary(const mesh_shape *m, const model_param *p, const mesh_array *a, int layer, int device,
                               bool *primary);

/* Global L2 norm of every gradient (g of each layer of each parameter) over
 * the whole mesh.  Each device sums the squares of its shard in double,
 * counting each global element once (only the replica with coordinate 0 on
 * every mesh axis its spec does not use contributes); the sums meet in one
 * float32 all-reduce over all mesh axes (as XLA reduces optax.global_norm),
 * so the result is bitwise the same on every device.  Gradients must not be
 * partial.  Dry run: 0 (the all-reduce is still counted). */
sim_status model_grad_global_norm(sim_device *d, const mesh_shape *m, model_param *params, int n, double *norm);

/* For a row's update: layer l's array x (a gradient or a slot, `what` names it) must exist and
 * match the parameter's shard (same elements and spec): the updates are elementwise. */
sim_status model_opt_check_shard(const model_param *p, int l, const mesh_array *x, const char *what);

#endif
