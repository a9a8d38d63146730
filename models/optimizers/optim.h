/* optim.h — AdamW with MaxText's learning-rate schedule, global-norm
 * gradient clipping, and the global gradient norm over the mesh.
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
 * Update (optax.adamw + optax.clip_by_global_norm as MaxText chains them):
 *   g <- g                       if threshold <= 0 or norm < threshold
 *   g <- (g / norm) * threshold  otherwise
 *   mu <- (1 - b1) g + b1 mu;  nu <- (1 - b2) g^2 + b2 nu
 *   mu_hat = mu / (1 - b1^(s+1)); nu_hat = nu / (1 - b2^(s+1))
 *   u = mu_hat / (sqrt(nu_hat + eps_root) + eps) + weight_decay * p
 *   p <- p - lr(s) * u
 * in float32 per element like optax on float32 parameters (no weight-decay
 * mask: MaxText's adamw_mask is unset by default).  opt_type=sgd is plain
 * p <- p - lr(s) * g (after clipping).  opt_type=muon: models/optimizers/muon.h.
 *
 * ZeRO-1 (shard_optimizer_over_data, MaxText's layout rule in params.h
 * model_zero1_spec): the functions below run unchanged on the device's
 * stacked optimizer-layout views (model_dev.z: parameters, gradient and both
 * moments as one array each, sharded over 'data' too), so each device
 * updates only its shard; train.c all-gathers the parameters over 'data'
 * before the next forward pass and reduce-scatters the gradients into that
 * layout after the backward pass. */
#ifndef MODELS_OPTIM_H
#define MODELS_OPTIM_H

#include <stdbool.h>

#include "config/config.h"
#include "models/optimizers/muon.h"
#include "models/core/params.h"

typedef enum { MODEL_OPT_ADAMW = 0, MODEL_OPT_SGD, MODEL_OPT_MUON } model_opt_type;

typedef struct model_optim_cfg {
    model_opt_type type;      /* opt_type */
    double lr;                /* learning_rate: the peak */
    double warmup_fraction;   /* warmup_steps_fraction */
    double final_fraction;    /* learning_rate_final_fraction */
    long long schedule_steps; /* learning_rate_schedule_steps, -1 resolved to steps */
    long long steps;          /* steps */
    double b1, b2;            /* adam_b1, adam_b2 */
    double eps, eps_root;     /* adam_eps (outside the root), adam_eps_root (inside) */
    double weight_decay;      /* adam_weight_decay (decoupled) */
    double clip;              /* gradient_clipping_threshold; <= 0: no clipping */
    model_muon_cfg muon;      /* opt_type=muon: the muon_* keys (models/optimizers/muon.h) */
} model_optim_cfg;

/* Reads every key above from the config (the base config defines them all);
 * lr_schedule_type must be "cosine". */
sim_status model_optim_from_config(const cfg_config *cfg, model_optim_cfg *out);

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
 * a w/g/m/v array of that layer) that counts: it holds the layer (when the
 * stacked spec splits the layers, e.g. over 'stage', only that block's
 * devices do) and has coordinate 0 on every other mesh axis the spec does not
 * use.  Summing or writing over primaries visits each global element once.
 * Partial arrays are an error. */
sim_status model_layer_primary(const mesh_shape *m, const model_param *p, const mesh_array *a, int layer,
                               int device, bool *primary);

/* Global L2 norm of every gradient (g of each layer of each parameter) over
 * the whole mesh.  Each device sums the squares of its shard in double,
 * counting each global element once (only the replica with coordinate 0 on
 * every mesh axis its spec does not use contributes); the sums meet in one
 * float32 all-reduce over all mesh axes (as XLA reduces optax.global_norm),
 * so the result is bitwise the same on every device.  Gradients must not be
 * partial.  Dry run: 0 (the all-reduce is still counted). */
sim_status model_grad_global_norm(sim_device *d, const mesh_shape *m, model_param *params, int n, double *norm);

/* One update of every local shard in place (no communication): w, g, m, v
 * of each layer must share a spec.  s = updates already applied (0 for the
 * first); grad_norm = model_grad_global_norm's result (used for clipping).
 * Gradients are read, not changed. */
sim_status model_adamw_update(sim_device *d, const model_optim_cfg *o, model_param *params, int n, long long s,
                              double grad_norm);

#endif
