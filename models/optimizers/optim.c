/* optim.c — learning-rate schedule, global gradient norm, AdamW (see optim.h).
 *
 * The schedule mirrors optax.join_schedules over MaxText's pieces exactly,
 * edge cases included (W = 1 gives a zero first step; C = 1 jumps straight
 * to the final value).  The update is elementwise float32 in optax's order
 * of operations, so a shard's values do not depend on the mesh. */
#include "models/optimizers/optim.h"

#include "blas_kernels/bk_optim.h"

#include <math.h>
#include <string.h>

#include "sim/collectives.h"

/* ---------------------------------------------------------------- config */

sim_status model_optim_from_config(const cfg_config *cfg, model_optim_cfg *o)
{
    static const char *const types[] = {"adamw", "sgd", "muon"};
    static const char *const schedules[] = {"cosine"};
    memset(o, 0, sizeof *o);
    int type, sched;
    SIM_TRY(cfg_get_enum(cfg, "opt_type", types, 3, &type));
    SIM_TRY(cfg_get_enum(cfg, "lr_schedule_type", schedules, 1, &sched));
    o->type = (model_opt_type)type;
    SIM_TRY(cfg_get_double(cfg, "learning_rate", &o->lr));
    SIM_TRY(cfg_get_double(cfg, "warmup_steps_fraction", &o->warmup_fraction));
    SIM_TRY(cfg_get_double(cfg, "learning_rate_final_fraction", &o->final_fraction));
    SIM_TRY(cfg_get_int(cfg, "learning_rate_schedule_steps", &o->schedule_steps));
    SIM_TRY(cfg_get_int(cfg, "steps", &o->steps));
    SIM_TRY(cfg_get_double(cfg, "adam_b1", &o->b1));
    SIM_TRY(cfg_get_double(cfg, "adam_b2", &o->b2));
    SIM_TRY(cfg_get_double(cfg, "adam_eps", &o->eps));
    SIM_TRY(cfg_get_double(cfg, "adam_eps_root", &o->eps_root));
    SIM_TRY(cfg_get_double(cfg, "adam_weight_decay", &o->weight_decay));
    SIM_TRY(cfg_get_double(cfg, "gradient_clipping_threshold", &o->clip));
    if (o->type == MODEL_OPT_MUON) SIM_TRY(model_muon_from_config(cfg, &o->muon));
    if (o->schedule_steps == -1) o->schedule_steps = o->steps;
    if (o->schedule_steps < 1)
        return sim_err(SIM_ERR_INPUT, "learning_rate_schedule_steps=%lld: use a positive number of steps or -1 (= steps)",
                       o->schedule_steps);
    if (!(o->warmup_fraction >= 0 && o->warmup_fraction <= 1))
        return sim_err(SIM_ERR_INPUT, "warmup_steps_fraction=%g: it must lie in [0, 1]", o->warmup_fraction);
    if (!(o->b1 >= 0 && o->b1 < 1) || !(o->b2 >= 0 && o->b2 < 1))
        return sim_err(SIM_ERR_INPUT, "adam_b1=%g adam_b2=%g: both must lie in [0, 1)", o->b1, o->b2);
    if (!(o->eps >= 0) || !(o->eps_root >= 0))
        return sim_err(SIM_ERR_INPUT, "adam_eps=%g adam_eps_root=%g: both must be >= 0", o->eps, o->eps_root);
    return SIM_OK;
}

/* ---------------------------------------------------------------- schedule */

/* optax.linear_schedule(0, lr, transition_steps) at count c */
static double linear_piece(double lr, long long transition, long long c)
{
    if (transition <= 0) return 0.0; /* optax: a constant schedule at init_value */
    double k = (double)(c < 0 ? 0 : c > transition ? transition : c);
    return -lr * (1.0 - k / (double)transition) + lr;
}

/* MaxText's make_cos_schedule(lr, final, len) at count c */
static double cos_piece(double lr, double final, long long len, long long c)
{
    double pct = len > 1 ? (double)c / (double)(len - 1) : 1.0;
    double a = 0.5 * (cos(M_PI * pct) + 1.0);
    return lr * a + final * (1.0 - a);
}

double model_lr_at(const model_optim_cfg *o, long long s)
{
    long long S = o->schedule_steps;
    long long W = (long long)((double)S * o->warmup_fraction); /* Python int(): truncation */
    long long C = S - W;
    double final = o->lr * o->final_fraction;
    /* pieces and boundaries as MaxText builds them; join: piece k+1 takes over at boundary k */
    enum { WARM, COS, ZERO };
    int piece[3], np = 0;
    long long bound[3];
    if (W > 0) piece[np] = WARM, bound[np++] = W;
    if (C > 0) piece[np] = COS, bound[np++] = W + C;
    if (o->steps - S > 0) piece[np] = ZERO, bound[np++] = S;
    if (np == 0) return 0.0;
    int k = 0;
    long long start = 0;
    for (int i = 0; i + 1 < np; i++)
        if (s >= bound[i]) k = i + 1, start = bound[i];
    long long c = s - start;
    switch (piece[k]) {
    case WARM: return linear_piece(o->lr, W - 1, c);
    case COS: return cos_piece(o->lr, final, C, c);
    default: return 0.0;
    }
}

bool model_clip_applies(const model_optim_cfg *o, double norm) { return o->clip > 0 && !(norm < o->clip); }

double model_clip_factor(const model_optim_cfg *o, double norm)
{
    return model_clip_applies(o, norm) ? o->clip / norm : 1.0;
}

double model_clipped_norm(const model_optim_cfg *o, double norm)
{
    if (!model_clip_applies(o, norm)) return norm;
    return norm * ((double)(float)o->clip / (double)(float)norm); /* bk_adamw_hp's thr and gnorm */
}

/* ---------------------------------------------------------------- ownership */

sim_status model_layer_primary(const mesh_shape *m, const model_param *p, const mesh_array *a, int layer,
                               int device, bool *primary)
{
    *primary = false;
    if (a->spec.partial)
        return sim_err(SIM_ERR_INTERNAL, "'%s' layer %d holds partial sums; reduce it first", p->def.path, layer);
    int c[MESH_MAX_AXES];
    mesh_shape_coords(m, device, c);
    uint32_t used = mesh_spec_dim_axes(&a->spec);
    /* the stacked spec may split the layers (pipeline 'stage'): only that block's devices hold layer l */
    int sd = p->def.scan_dim;
    if (sd >= 0 && sd < p->spec.rank && p->spec.n_axes[sd] > 0) {
        int64_t block = 0, nblocks = 1;
        for (int i = 0; i < p->spec.n_axes[sd]; i++) {
            int ax = p->spec.axes[sd][i];
            block = block * m->sizes[ax] + c[ax];
            nblocks *= m->sizes[ax];
            used |= 1u << ax;
        }
        int64_t per = p->stage_span > 0 ? p->stage_span : p->n_layers / nblocks;
        if (per < 1 || (layer / per) % nblocks != block) return SIM_OK;
    }
    for (int ax = 0; ax < m->n_axes; ax++)
        if (!(used & (1u << ax)) && c[ax] != 0) return SIM_OK;
    *primary = true;
    return SIM_OK;
}

/* ---------------------------------------------------------------- global norm */

sim_status model_grad_global_norm(sim_device *d, const mesh_shape *m, model_param *params, int n, double *norm)
{
    double sum = 0.0;
    int dev = sim_device_id(d);
    for (int p = 0; p < n; p++) {
        const model_param *pp = &params[p];
        if (pp->def.state_var) continue; /* not trained (MaxText's MoEBiasVar) */
        if (!pp->g) return sim_err(SIM_ERR_INTERNAL, "grad norm: '%s' has no gradient storage", pp->def.path);
        for (int l = 0; l < pp->n_layers; l++) {
            const mesh_array *g = &pp->g[l];
            bool mine;
            SIM_TRY(model_layer_primary(m, pp, g, l, dev, &mine));
            if (!mine || !g->data) continue;
            sum += bk_sumsq(g->data, g->nlocal); /* a fixed order: the same bits on any thread count */
        }
    }
    float f = (float)sum;
    sim_axes all = sim_axes_none();
    for (int ax = 0; ax < m->n_axes; ax++) all.axis[all.n++] = (int8_t)ax;
    SIM_TRY(sim_all_reduce(d, &f, &f, 1, SIM_F32, all, sim_meta_counted(sim_meta_tag("optimizer/grad_norm"), SIM_F32)));
    *norm = sqrt((double)f);
    return SIM_OK;
}

/* ---------------------------------------------------------------- update */

static sim_status check_same(const model_param *p, int l, const mesh_array *w, const mesh_array *x, const char *what)
{
    if (!x) return sim_err(SIM_ERR_INTERNAL, "optimizer: '%s' has no %s storage", p->def.path, what);
    mesh_array_owned(w); /* the update writes the parameter and its moments in place */
    mesh_array_owned(x);
    if (x->nlocal != w->nlocal || !mesh_spec_equal(&x->spec, &w->spec))
        return sim_err(SIM_ERR_INTERNAL,
                       "optimizer: '%s' layer %d: the %s shard does not match the parameter's (%zu vs %zu elements); "
                       "the update is elementwise on equal shards (reshard first for ZeRO-1)",
                       p->def.path, l, what, x->nlocal, w->nlocal);
    return SIM_OK;
}

sim_status model_adamw_update(sim_device *d, const model_optim_cfg *o, model_param *params, int n, long long s,
                              double grad_norm)
{
    (void)d;
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
        model_param *pp = &params[p];
        if (pp->def.state_var) continue; /* not trained: no gradient, no moments */
        for (int l = 0; l < pp->n_layers; l++) {
            mesh_array *w = &pp->w[l];
            SIM_TRY(check_same(pp, l, w, pp->g ? &pp->g[l] : NULL, "gradient"));
            float *x = w->data;
            const float *g = pp->g[l].data;
            if (!x) continue; /* dry run */
            size_t nl = w->nlocal;
            if (o->type == MODEL_OPT_SGD) {
                bk_sgd_update(x, g, nl, &hp);
                continue;
            }
            SIM_TRY(check_same(pp, l, w, pp->m ? &pp->m[l] : NULL, "first moment (mu)"));
            SIM_TRY(check_same(pp, l, w, pp->v ? &pp->v[l] : NULL, "second moment (nu)"));
            bk_adamw_update(x, pp->m[l].data, pp->v[l].data, g, nl, &hp); /* one fused pass */
        }
    }
    return SIM_OK;
}
