/* adamw.h — opt_type=adamw: optax.adamw as MaxText builds it (optimizers.get_optimizer), the
 * table's row model_opt_adamw (models/optimizers/optim.h).
 *
 * Update of every parameter (after clipping, optim.h), t = s + 1, in float32 per element like
 * optax on float32 parameters:
 *   mu <- (1 - b1) g + b1 mu;  nu <- (1 - b2) g^2 + b2 nu
 *   mu_hat = mu / (1 - b1^t); nu_hat = nu / (1 - b2^t)
 *   u = mu_hat / (sqrt(nu_hat + eps_root) + eps) + weight_decay * p   (no decay where adamw_mask matches)
 *   p <- p - lr(s) * u
 * State: chain(scale_by_adam, add_decayed_weights, scale_by_learning_rate): slots mu, nu, and
 * the counts at .opt_state/[0] and [2]. */
#ifndef MODELS_ADAMW_H
#define MODELS_ADAMW_H

#include "models/core/optimizer.h"

/* One update of every local shard in place (no communication), every parameter decaying: w, g
 * and slots mu (slot[0]), nu (slot[1]) of each layer must share a spec.  s = updates already
 * applied (0 for the first); grad_norm = model_grad_global_norm's result (used for clipping).
 * Gradients are read, not changed. */
sim_status model_adamw_update(sim_device *d, const model_optim_cfg *o, model_param *params, int n, long long s,
                              double grad_norm);

#endif
