/* adam_pax.c — opt_type=adam_pax: MaxText's adam_pax (maxtext/optimizers/optimizers.py, adam_pax,
 * after praxis' sharded_adam), the table's row model_opt_adam_pax (models/optimizers/optim.h).
 *
 * Adam with the bias correction folded into the decay rates (optimizers.py bias_corrected_decay,
 * Shazeer & Stern 2018 section 7.1) instead of applied to the moments.  For the update count
 * s (0-based: optax's state.count before the update), t = float32(s) + 1, in float32 as MaxText
 * computes it on float32 parameters (a decay is a Python float, so JAX computes in float32):
 *   d(beta)  = beta * (1 - beta^(t-1)) / (1 - beta^t)          (0 at the first update)
 *   mu <- (1 - d(b1)) g + d(b1) mu;   nu <- (1 - d(b2)) g^2 + d(b2) nu
 *   u  =  mu / (sqrt(nu + epsilon_root) + epsilon)              (adam_eps_root inside, adam_eps outside)
 *   u  <- u + weight_decay p   when weight_decay > 0 and adamw_mask does not exclude p (get_adamw_mask)
 *   p  <- p + (-lr(s)) u                                        (step_size = -1.0 * learning_rate_fn(count))
 * after global-norm clipping as for every optimizer, on the schedule of models/core/optimizer.h.  The
 * update is elementwise: a shard's values do not depend on the mesh, and ZeRO-1 shards mu and nu
 * over 'data' as for AdamW (MaxText's validate_optimizer_sharding_over_data allows adam_pax).
 *
 * State: optax.ScaleByAdamState(count, mu, nu) itself, not a chain: slots mu and nu (saved as
 * opt_state.mu.<path>, opt_state.nu.<path>), and the dump's .opt_state/.count, .opt_state/.mu/...,
 * .opt_state/.nu/... */
#include "models/core/optimizer.h"

#include <math.h>
#include <stdio.h>

#include "blas_kernels/bk_parallel.h"

/* optimizers.py bias_corrected_decay(step, decay) for step = s, in float32 */
static float corrected_decay(double decay, long long s)
{
    const float d = (float)decay, t = (float)s + 1.0f;
    return d * (1.0f - powf(d, t - 1.0f)) / (1.0f - powf(d, t));
}

typedef struct {
    float *x, *mu, *nu;
    const float *g;
    bool clip, decay;
    float gnorm, thr, neg_lr, d1, omd1, d2, omd2, eps, eps_root, wd;
} pax_job;

static void pax_chunk(int64_t lo, int64_t hi, void *arg)
{
    const pax_job *J = arg;
    for (int64_t i = lo; i < hi; i++) {
        float g = J->clip ? (J->g[i] / J->gnorm) * J->thr : J->g[i];
        float m = J->omd1 * g + J->d1 * J->mu[i];
        float v = J->omd2 * (g * g) + J->d2 * J->nu[i];
        J->mu[i] = m;
        J->nu[i] = v;
        float u = m / (sqrtf(v + J->eps_root) + J->eps);
        if (J->decay) u = u + J->wd * J->x[i];
        J->x[i] = J->x[i] + J->neg_lr * u;
    }
}

static sim_status update(const model_opt_step *st)
{
    const model_optim_cfg *o = st->o;
    pax_job base = {0};
    base.clip = model_clip_applies(o, st->grad_norm);
    base.gnorm = (float)st->grad_norm;
    base.thr = (float)o->clip;
    base.neg_lr = (float)-model_lr_at(o, st->s);
    base.d1 = corrected_decay(o->b1, st->s), base.omd1 = 1.0f - base.d1;
    base.d2 = corrected_decay(o->b2, st->s), base.omd2 = 1.0f - base.d2;
    base.eps = (float)o->eps, base.eps_root = (float)o->eps_root, base.wd = (float)o->weight_decay;
    for (int p = 0; p < st->n; p++) {
        model_param *pp = &st->params[p];
        if (pp->def.state_var) continue; /* not trained: no gradient, no moments */
        pax_job J = base;
        J.decay = o->weight_decay > 0 && st->pp[p].decay;
        for (int l = 0; l < pp->n_layers; l++) {
            SIM_TRY(model_opt_check_shard(pp, l, pp->g ? &pp->g[l] : NULL, "gradient"));
            if (!pp->w[l].data) continue; /* dry run */
            SIM_TRY(model_opt_check_shard(pp, l, pp->slot[0] ? &pp->slot[0][l] : NULL, "first moment (mu)"));
            SIM_TRY(model_opt_check_shard(pp, l, pp->slot[1] ? &pp->slot[1][l] : NULL, "second moment (nu)"));
            J.x = pp->w[l].data, J.g = pp->g[l].data, J.mu = pp->slot[0][l].data, J.nu = pp->slot[1][l].data;
            bk_parallel_for((int64_t)pp->w[l].nlocal, 1 << 15, pax_chunk, &J);
        }
    }
    return SIM_OK;
}

/* ScaleByAdamState(count, mu, nu), un-chained */
static sim_status tree(const model_opt_tree *t)
{
    char key[MODEL_OPT_KEY_MAX];
    SIM_TRY(t->leaf(t->arg, ".opt_state/.count", -1, 0));
    static const char *const slot[2] = {"mu", "nu"};
    for (int k = 0; k < 2; k++)
        for (int i = 0; i < t->n; i++) {
            if (t->stateless[i]) continue;
            snprintf(key, sizeof key, ".opt_state/.%s/['params']%.900s", slot[k], t->rel[i]);
            SIM_TRY(t->leaf(t->arg, key, i, 0));
        }
    return SIM_OK;
}

const model_optimizer model_opt_adam_pax = {
    .name = "adam_pax",
    .n_slots = 2,
    .slot = {"mu", "nu"},
    .decay_mask = true, /* optimizers.get_optimizer: adam_pax(..., mask=get_adamw_mask(config)) */
    .update = update,
    .tree = tree,
};
