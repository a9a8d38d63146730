/* block_run.c — test support: a block run alone on the model's mesh (see block_run.h). */
#include "tests/block_run.h"

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "mesh/ad.h"
#include "mesh/tape.h"
#include "models/core/train.h"
#include "tests/helpers.h"
#include "tests/model_run.h"

typedef struct {
    block_run *r;
    const float *x, *c;
    int32_t *in, *tg, *pos;
} job;

/* The residual stream's names: the input as a family's layer receives it. */
static const char *const A[3] = {"activation_batch", "activation_norm_length", "activation_embed"};

static sim_status block_device(sim_device *dev, void *arg)
{
    job *j = arg;
    block_run *r = j->r;
    const model_def *def = r->def;
    const mesh_shape *m = &def->mesh;
    int64_t shape[3] = {def->d.batch, def->d.seq, def->d.emb};
    model_dev md;
    model_batch b;
    mesh_array xa = {0}, xg = {0}, cot = {0};
    mesh_tape *t = NULL;
    bool have_md = false, have_b = false;
    mesh_spec xs;
    sim_status st;
    SIM_TRY_GOTO(model_dev_init(&md, def, dev, true, false), st, fail);
    have_md = true;
    model_dev_zero_grads(&md);
    SIM_TRY_GOTO(model_batch_load(&md, j->in, j->tg, j->pos, &b), st, fail);
    have_b = true;
    SIM_TRY_GOTO(model_logical_spec(def, "block_run/x", 3, A, &xs), st, fail);
    SIM_TRY_GOTO(mesh_array_new(dev, m, "x", 3, shape, &xs, SIM_F32, SIM_MEM_ACTIVATIONS, &xa), st, fail);
    SIM_TRY_GOTO(mesh_array_new(dev, m, "dx", 3, shape, &xs, SIM_F32, SIM_MEM_GRADS, &xg), st, fail);
    mesh_array_load_global(dev, m, &xa, j->x);
    t = mesh_tape_new(&md.ctx, true);
    mesh_var *y;
    SIM_TRY_GOTO(r->fn(&md, t, &b, mesh_tape_param(t, &xa, &xg), &y, r->arg), st, fail);
    /* a block may leave its output partial (the out projection's sum, reduced where the layer
     * constrains it next): reduce it as that constraint would */
    mesh_spec cs = y->val.spec;
    cs.partial = 0;
    if (y->val.spec.partial) SIM_TRY_GOTO(mesh_ad_shard_as(t, y, &cs, "block_run/y", &y), st, fail);
    SIM_TRY_GOTO(mesh_array_store_global(dev, m, &y->val, r->y), st, fail);
    SIM_TRY_GOTO(mesh_array_new(dev, m, "cot", 3, shape, &cs, SIM_F32, SIM_MEM_TEMP, &cot), st, fail);
    mesh_array_load_global(dev, m, &cot, j->c);
    mesh_array seed = cot; /* consumed by the backward pass, whatever it returns */
    memset(&cot, 0, sizeof cot);
    SIM_TRY_GOTO(mesh_tape_backward_from(t, y, &seed), st, fail);
    SIM_TRY_GOTO(mesh_array_store_global(dev, m, &xg, r->dx), st, fail);
    for (int k = 0; k < r->nparams; k++) {
        const model_param *p = &md.p[r->params[k]];
        int l = p->n_layers > 1 ? r->layer : 0;
        SIM_TRY_GOTO(mesh_array_store_global(dev, m, &p->w[l], r->w[k]), st, fail);
        SIM_TRY_GOTO(mesh_array_store_global(dev, m, &p->g[l], r->dw[k]), st, fail);
    }
fail:
    mesh_tape_free(t);
    mesh_array_free(dev, &cot);
    mesh_array_free(dev, &xg);
    mesh_array_free(dev, &xa);
    if (have_b) model_batch_free(&md, &b);
    if (have_md) model_dev_free(&md);
    return st;
}

/* The block on every device with input x and cotangent c (global): r's outputs. */
static void run(block_run *r, const float *x, const float *c)
{
    const model_def *def = r->def;
    int64_t B = def->d.batch, T = def->d.seq, E = def->d.emb, n = B * T * E;
    job j = {.r = r, .x = x, .c = c};
    j.in = calloc((size_t)(B * T), sizeof *j.in);
    j.tg = calloc((size_t)(B * T), sizeof *j.tg);
    j.pos = calloc((size_t)(B * T), sizeof *j.pos);
    r->y = calloc((size_t)n, sizeof *r->y);
    r->dx = calloc((size_t)n, sizeof *r->dx);
    assert_non_null(j.in);
    assert_non_null(j.tg);
    assert_non_null(j.pos);
    assert_non_null(r->y);
    assert_non_null(r->dx);
    model_run_pattern((int)B, (int)T, (int)def->d.vocab, j.in, j.tg, j.pos);
    for (int k = 0; k < r->nparams; k++) {
        const model_param_def *pd = &def->defs[r->params[k]];
        int64_t e = 1;
        for (int d = 0; d < pd->rank; d++)
            if (d != pd->scan_dim) e *= pd->shape[d];
        r->wn[k] = e;
        r->w[k] = calloc((size_t)e, sizeof(float));
        r->dw[k] = calloc((size_t)e, sizeof(float));
        assert_non_null(r->w[k]);
        assert_non_null(r->dw[k]);
    }
    sim_machine *m;
    assert_int_equal(model_machine_new(def, 0, false, &m), SIM_OK);
    sim_status st = sim_machine_run(m, block_device, &j);
    sim_machine_free(m);
    free(j.in);
    free(j.tg);
    free(j.pos);
    if (st != SIM_OK) fail_msg("block run: %s", sim_errmsg());
}

/* sum(c * reference(x)) for the central differences. */
typedef struct {
    const block_run *r;
    block_run_ref ref;
    const void *arg;
    const float *x, *c;
} objective;

static double sum_cy(const objective *o)
{
    const model_def *def = o->r->def;
    int64_t n = def->d.batch * def->d.seq * def->d.emb;
    double *x = malloc((size_t)n * sizeof *x), *y = malloc((size_t)n * sizeof *y), s = 0;
    assert_true(x && y);
    for (int64_t i = 0; i < n; i++) x[i] = o->x[i];
    o->ref(o->r, o->arg, x, y);
    for (int64_t i = 0; i < n; i++) s += (double)o->c[i] * y[i];
    free(x);
    free(y);
    return s;
}

/* Central difference of f at element e of v (the step as float32 holds it). */
static double central(const objective *o, float *v, int64_t e, double h)
{
    float x0 = v[e];
    v[e] = x0 + (float)h;
    double fp = sum_cy(o);
    v[e] = x0 - (float)h;
    double fm = sum_cy(o);
    double hp = (double)(x0 + (float)h) - (double)x0, hm = (double)x0 - (double)(x0 - (float)h);
    v[e] = x0;
    return (fp - fm) / (hp + hm);
}

/* Worst |gradient - central difference| at 10 spread elements, relative to the largest difference. */
static double grad_error(const objective *o, float *v, const float *got, int64_t n)
{
    double worst = 0, big = 1e-6;
    for (int p = 0; p < 10; p++) {
        int64_t e = (int64_t)((p * 7919 + 5) % n);
        double fd = central(o, v, e, 1e-2);
        big = fmax(big, fabs(fd));
        worst = fmax(worst, fabs(fd - got[e]));
    }
    return worst / big;
}

void block_run_check(block_run *r, block_run_ref ref, const void *arg, double rtol, double gtol)
{
    const model_def *def = r->def;
    int64_t n = def->d.batch * def->d.seq * def->d.emb;
    float *x = malloc((size_t)n * sizeof *x), *c = malloc((size_t)n * sizeof *c);
    double *xd = malloc((size_t)n * sizeof *xd), *yref = malloc((size_t)n * sizeof *yref);
    assert_true(x && c && xd && yref);
    for (int64_t i = 0; i < n; i++) {
        x[i] = helper_det_val((uint32_t)i, 1.0f);
        c[i] = helper_det_val((uint32_t)(i + 77777), 1.0f);
        xd[i] = x[i];
    }
    run(r, x, c);
    ref(r, arg, xd, yref);
    double worst = 0, big = 0;
    for (int64_t i = 0; i < n; i++) {
        worst = fmax(worst, fabs(r->y[i] - yref[i]));
        big = fmax(big, fabs(yref[i]));
    }
    if (!(big > 1e-3)) fail_msg("the reference output is (nearly) zero: %g", big);
    if (worst > rtol * big) fail_msg("block output differs from the reference by %g (largest %g)", worst, big);
    objective o = {.r = r, .ref = ref, .arg = arg, .x = x, .c = c};
    double e = grad_error(&o, x, r->dx, n);
    if (e > gtol) fail_msg("input gradient off by %g (relative)", e);
    for (int k = 0; k < r->nparams; k++) {
        e = grad_error(&o, r->w[k], r->dw[k], r->wn[k]);
        if (e > gtol) fail_msg("gradient of %s off by %g (relative)", def->defs[r->params[k]].path, e);
    }
    free(x);
    free(c);
    free(xd);
    free(yref);
    free(r->y);
    free(r->dx);
    for (int k = 0; k < r->nparams; k++) {
        free(r->w[k]);
        free(r->dw[k]);
    }
}
