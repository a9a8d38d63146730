/* adamw.c — opt_type=adamw (see adamw.h): the update as one fused kernel pass per shard
 * (bk_adamw_update, in optax's order of operations, so a shard's values do not depend on the
 * mesh), and optax.adamw's state tree for the dump. */
#include "models/optimizers/adamw.h"

#include <math.h>
#include <stdio.h>

#include "blas_kernels/bk_optim.h"

/* pp == NULL: every parameter decays */
static sim_status adamw_update(const model_optim_cfg *o, const model_opt_param *pp, model_param *params, int n,
                               long long s, double grad_norm)
{
    if (s < 0) return sim_err(SIM_ERR_INTERNAL, "optimizer step %lld: counts from 0", s);
    const double t = (double)(s + 1); /* optax's count after the increment */
    const bk_adamw_hp hp = {
        .clip = model_clip_applies(o, grad_norm),
        .gnorm = (float)grad_norm,
        .thr = (float)o->clip,
        .neg_lr = (float)-model_lr_at(o, s),
        .b1 = (float)o->b1,
        .b2 = (float)o->b2,
        .omb1 = (float)(1.0 - o->b1),
        .omb2 = (float)(1.0 - o->b2),
        .bc1 = (float)(1.0 - pow(o->b1, t)),
        .bc2 = (float)(1.0 - pow(o->b2, t)),
        .eps = (float)o->eps,
        .eps_root = (float)o->eps_root,
        .wd = (float)o->weight_decay,
    };
    for (int p = 0; p < n; p++) {
        model_param *pp_ = &params[p];
        if (pp_->def.state_var) continue; /* not trained: no gradient, no moments */
        bk_adamw_hp h = hp;
        if (pp && !pp[p].decay) h.wd = 0.0f; /* optax.masked(add_decayed_weights): the update passes unchanged */
        for (int l = 0; l < pp_->n_layers; l++) {
            mesh_array *w = &pp_->w[l];
            SIM_TRY(model_opt_check_shard(pp_, l, pp_->g ? &pp_->g[l] : NULL, "gradient"));
            if (!w->data) continue; /* dry run */
            SIM_TRY(model_opt_check_shard(pp_, l, pp_->slot[0] ? &pp_->slot[0][l] : NULL, "first moment (mu)"));
            SIM_TRY(model_opt_check_shard(pp_, l, pp_->slot[1] ? &pp_->slot[1][l] : NULL, "second moment (nu)"));
            bk_adamw_update(w->data, pp_->slot[0][l].data, pp_->slot[1][l].data, pp_->g[l].data, w->nlocal,
                            &h); /* one fused pass */
        }
    }
    return SIM_OK;
}

sim_status model_adamw_update(sim_device *d, const model_optim_cfg *o, model_param *params, int n, long long s,
                              double grad_norm)
{
    (void)d;
    return adamw_update(o, NULL, params, n, s, grad_norm);
}

static sim_status update(const model_opt_step *st)
{
    return adamw_update(st->o, st->pp, st->params, st->n, st->s, st->grad_norm);
}

/* chain(scale_by_adam (count, mu, nu), add_decayed_weights (no state), scale_by_learning_rate (count)) */
static sim_status tree(const model_opt_tree *t)
{
    char key[MODEL_OPT_KEY_MAX];
    SIM_TRY(t->leaf(t->arg, ".opt_state/[0]/.count", -1, 0));
    static const char *const slot[2] = {"mu", "nu"};
    for (int k = 0; k < 2; k++)
        for (int i = 0; i < t->n; i++) {
            if (t->stateless[i]) continue;
            snprintf(key, sizeof key, ".opt_state/[0]/.%s/['params']%.900s", slot[k], t->rel[i]);
            SIM_TRY(t->leaf(t->arg, key, i, 0));
        }
    return t->leaf(t->arg, ".opt_state/[2]/.count", -1, 0);
}

const model_optimizer model_opt_adamw = {
    .name = "adamw",
    .n_slots = 2,
    .slot = {"mu", "nu"},
    .decay_mask = true, /* optimizers.get_optimizer: optax.adamw(..., mask=get_adamw_mask(config)) */
    .update = update,
    .tree = tree,
};
