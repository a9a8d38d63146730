/* sgd.c — opt_type=sgd: optax.sgd(learning_rate_schedule) as MaxText builds it
 * (optimizers.get_optimizer): p <- p - lr(s) * g after clipping (models/core/optimizer.h), no state but the
 * schedule's count; the table's row model_opt_sgd (models/optimizers/optim.h). */
#include "models/core/optimizer.h"

#include "blas_kernels/bk_optim.h"

static sim_status update(const model_opt_step *st)
{
    const bk_adamw_hp hp = {
        .clip = model_clip_applies(st->o, st->grad_norm),
        .gnorm = (float)st->grad_norm,
        .thr = (float)st->o->clip,
        .neg_lr = (float)-model_lr_at(st->o, st->s),
    };
    for (int p = 0; p < st->n; p++) {
        model_param *pp = &st->params[p];
        if (pp->def.state_var) continue; /* not trained */
        for (int l = 0; l < pp->n_layers; l++) {
            SIM_TRY(model_opt_check_shard(pp, l, pp->g ? &pp->g[l] : NULL, "gradient"));
            if (pp->w[l].data) bk_sgd_update(pp->w[l].data, pp->g[l].data, pp->w[l].nlocal, &hp);
        }
    }
    return SIM_OK;
}

/* chain(identity (no state), scale_by_learning_rate (count)) */
static sim_status tree(const model_opt_tree *t) { return t->leaf(t->arg, ".opt_state/[1]/.count", -1, 0); }

const model_optimizer model_opt_sgd = {
    .name = "sgd",
    .n_slots = 0,
    .zero1_refused = "shard_optimizer_over_data=true (ZeRO-1) shards the Adam moments, but opt_type=sgd keeps none "
                     "(MaxText raises 'Could not find Adam/Muon optimizer state'); use opt_type=adamw or set "
                     "shard_optimizer_over_data=false",
    .update = update,
    .tree = tree,
};
