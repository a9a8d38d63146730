/* optimizer.c — what the optimizer table's rows share: the lookup, the config,
 * the model-definition pass (slots, adamw_mask), the dispatch of the update, the
 * learning-rate schedule, clipping, the global gradient norm (see optimizer.h).
 *
 * The schedule mirrors optax.join_schedules over MaxText's pieces exactly,
 * edge cases included (W = 1 gives a zero first step; C = 1 jumps straight
 * to the final value).  Nothing here names an optimizer: the rows do. */
#include "models/core/optimizer.h"

#include "blas_kernels/bk_optim.h"

#include <ctype.h>
#include <math.h>
#include <regex.h>
#include <stdlib.h>
#include <string.h>

#include "sim/collectives.h"

/* ---------------------------------------------------------------- the table */

const model_optimizer *model_optimizer_find(const char *name)
{
    for (int i = 0; name && i < model_n_optimizers; i++)
        if (!strcmp(model_optimizers[i]->name, name)) return model_optimizers[i];
    return NULL;
}

/* opt_type's row number, with the config's wording for a value outside the table. */
static sim_status opt_type(const cfg_config *cfg, int *type)
{
    enum { MAX_ROWS = 64 };
    const char *names[MAX_ROWS];
    SIM_ASSERT(model_n_optimizers <= MAX_ROWS);
    for (int i = 0; i < model_n_optimizers; i++) names[i] = model_optimizers[i]->name;
    return cfg_get_enum(cfg, "opt_type", names, model_n_optimizers, type);
}

/* ---------------------------------------------------------------- config */

sim_status model_optim_from_config(const cfg_config *cfg, model_optim_cfg *o)
{
    static const char *const schedules[] = {"cosine"};
    memset(o, 0, sizeof *o);
    int type, sched;
    SIM_TRY(opt_type(cfg, &type));
    SIM_TRY(cfg_get_enum(cfg, "lr_schedule_type", schedules, 1, &sched));
    o->type = type;
    o->row = model_optimizers[type];
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
    if (o->row->from_config) SIM_TRY(o->row->from_config(cfg, o));
    if (o->schedule_steps == -1) o->schedule_steps = o->steps;
    if (o->schedule_steps < 1)
        return sim_err(SIM_ERR_INPUT,
                       "learning_rate_schedule_steps=%lld: use a positive number of steps or -1 (= steps)",
                       o->schedule_steps);
    if (!(o->warmup_fraction >= 0 && o->warmup_fraction <= 1))
        return sim_err(SIM_ERR_INPUT, "warmup_steps_fraction=%g: it must lie in [0, 1]", o->warmup_fraction);
    if (!(o->b1 >= 0 && o->b1 < 1) || !(o->b2 >= 0 && o->b2 < 1))
        return sim_err(SIM_ERR_INPUT, "adam_b1=%g adam_b2=%g: both must lie in [0, 1)", o->b1, o->b2);
    if (!(o->eps >= 0) || !(o->eps_root >= 0))
        return sim_err(SIM_ERR_INPUT, "adam_eps=%g adam_eps_root=%g: both must be >= 0", o->eps, o->eps_root);
    return SIM_OK;
}

sim_status model_opt_zero1_check(const cfg_config *cfg)
{
    int type;
    SIM_TRY(opt_type(cfg, &type));
    if (model_optimizers[type]->zero1_refused)
        return sim_err(SIM_ERR_INPUT, "%s", model_optimizers[type]->zero1_refused);
    return SIM_OK;
}

/* ---------------------------------------------------------------- model definition */

/* Python's re.search for one adamw_mask pattern, as POSIX extended syntax: the constructs the two
 * read alike (., *, +, ?, |, (), [], {m,n}, ^, $, escaped punctuation); Python's own escapes and
 * groups (\d, \w, \s, \b, (?...)) are refused rather than read differently. */
static sim_status mask_compile(const char *pattern, regex_t *re)
{
    for (const char *c = pattern; *c; c++)
        if ((c[0] == '\\' && c[1] && isalnum((unsigned char)c[1])) || (c[0] == '(' && c[1] == '?'))
            return sim_err(SIM_ERR_INPUT,
                           "adamw_mask: pattern '%s' uses Python-only regular-expression syntax (%.2s); "
                           "write it with plain ., *, +, ?, |, (), [] and {m,n} (e.g. '.*norm.*' or 'bias$')",
                           pattern, c);
    int rc = regcomp(re, pattern, REG_EXTENDED | REG_NOSUB);
    if (rc) {
        char why[128];
        regerror(rc, re, why, sizeof why);
        return sim_err(SIM_ERR_INPUT,
                       "adamw_mask: pattern '%s' is not a valid regular expression (%s); fix or "
                       "remove it",
                       pattern, why);
    }
    return SIM_OK;
}

/* A parameter's path as get_adamw_mask matches it: the NNX state's keys joined by '/', without
 * the Linen collection ("params.decoder.norm.scale" -> "decoder/norm/scale"). */
static void mask_path(const char *path, char *buf, size_t cap)
{
    if (!strncmp(path, "params.", 7)) path += 7;
    snprintf(buf, cap, "%s", path);
    for (char *c = buf; *c; c++)
        if (*c == '.') *c = '/';
}

/* out[i].decay for every parameter: false where a pattern of adamw_mask matches its path. */
static sim_status decay_mask(const cfg_config *cfg, const model_param_def *defs, int n, model_opt_param *out)
{
    const char **pat = NULL;
    int np = 0;
    if (!cfg_find(cfg, "adamw_mask")) return SIM_OK;
    SIM_TRY(cfg_get_str_list(cfg, "adamw_mask", &pat, &np));
    sim_status st = SIM_OK;
    for (int k = 0; k < np && st == SIM_OK; k++) {
        regex_t re;
        st = mask_compile(pat[k], &re);
        if (st != SIM_OK) break;
        for (int i = 0; i < n; i++) {
            char path[MODEL_PATH_MAX];
            mask_path(defs[i].path, path, sizeof path);
            if (regexec(&re, path, 0, NULL, 0) == 0) out[i].decay = false;
        }
        regfree(&re);
    }
    free(pat);
    return st;
}

sim_status model_opt_define(const cfg_config *cfg, const model_param_def *defs, int n, const model_optimizer **row,
                            model_opt_param *out)
{
    int type;
    SIM_TRY(opt_type(cfg, &type));
    *row = model_optimizers[type];
    for (int i = 0; i < n; i++) {
        memset(&out[i], 0, sizeof out[i]);
        out[i].n_slots = defs[i].state_var ? 0 : (*row)->n_slots; /* MoEBiasVar: no optimizer state */
        out[i].decay = true;
    }
    if ((*row)->decay_mask) SIM_TRY(decay_mask(cfg, defs, n, out));
    return (*row)->define ? (*row)->define(cfg, defs, n, out) : SIM_OK;
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

sim_status model_layer_primary(const mesh_shape *m, const model_param *p, const mesh_array *a, int layer, int device,
                               bool *primary)
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

sim_status model_opt_check_shard(const model_param *p, int l, const mesh_array *x, const char *what)
{
    const mesh_array *w = &p->w[l];
    if (!x) return sim_err(SIM_ERR_INTERNAL, "optimizer: '%s' has no %s storage", p->def.path, what);
    mesh_array_owned(w); /* the update writes the parameter and its slots in place */
    mesh_array_owned(x);
    if (x->nlocal != w->nlocal || !mesh_spec_equal(&x->spec, &w->spec))
        return sim_err(SIM_ERR_INTERNAL,
                       "optimizer: '%s' layer %d: the %s shard does not match the parameter's (%zu vs %zu elements); "
                       "the update is elementwise on equal shards (reshard first for ZeRO-1)",
                       p->def.path, l, what, x->nlocal, w->nlocal);
    return SIM_OK;
}

sim_status model_opt_update(mesh_ctx *ctx, const model_optim_cfg *o, const model_opt_param *pp, model_param *params,
                            int n, long long s, double grad_norm)
{
    if (s < 0) return sim_err(SIM_ERR_INTERNAL, "optimizer step %lld: counts from 0", s);
    for (int i = 0; i < n; i++)
        if (params[i].n_slots != pp[i].n_slots)
            return sim_err(SIM_ERR_INTERNAL, "opt_type=%s: '%s' holds %d state slots, the optimizer keeps %d",
                           o->row->name, params[i].def.path, params[i].n_slots, pp[i].n_slots);
    const model_opt_step st = {ctx, o, pp, params, n, s, grad_norm};
    return o->row->update(&st);
}

int model_opt_update_traffic(const model_optimizer *row, const model_opt_param *pp, bool state_var)
{
    if (state_var) return 0;
    return row && row->traffic ? row->traffic(pp) : 3 + 2 * pp->n_slots;
}

sim_status model_opt_tree_write(const model_optimizer *row, const model_opt_tree *t)
{
    if (!row) row = model_optimizers[0];
    return row->tree ? row->tree(t) : SIM_OK;
}
