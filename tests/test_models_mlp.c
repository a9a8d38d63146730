/* test_models_mlp.c — the SwiGLU MlpBlock (models/blocks/mlp.h) against a float64 reference
 * computed here from MaxText's definition (layers/linears.py MlpBlock with mlp_activations
 * [silu, linear]): y = (silu(x . wi_0) * (x . wi_1)) . wo, and its gradients (input and every
 * kernel) against central differences of that reference.  On a 2x2 mesh (fsdp, tensor), in both
 * kernel layouts (two kernels; fused_mlp's one (embed, 2, mlp) kernel). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include <math.h>
#include <stdlib.h>

#include "models/blocks/mlp.h"
#include "tests/block_run.h"
#include "tests/helpers.h"
#include "tests/model_run.h"

static const char *const TINY[] = {TINY_LLAMA_YML, "init_weights_seed=3"};
enum { ROWS = 4, DEVICES = 4 };
static const char *const MID[3] = {"activation_batch", "activation_length", "activation_mlp"};
static const char *const OUT[3] = {"activation_batch", "activation_norm_length", "activation_embed"};

static sim_status mlp_fn(model_dev *md, mesh_tape *t, const model_batch *b, mesh_var *x, mesh_var **y,
                         const void *arg)
{
    (void)b;
    return model_mlp(md, t, arg, x, y);
}

/* The reference: sum(c * y) and y (when out is not NULL), in double. */
typedef struct {
    int64_t N, E, F; /* tokens, width, hidden */
    const float *x, *c;
    const float *wi0, *wi1; /* (E, F) each; fused: wi (E, 2, F), gate at [e, 0, f] */
    const float *wi;
    const float *wo; /* (F, E) */
    double *out;
} ref;

static double ref_run(const void *arg)
{
    const ref *r = arg;
    double s = 0, *h = malloc((size_t)r->F * sizeof *h);
    assert_non_null(h);
    for (int64_t n = 0; n < r->N; n++) {
        const float *x = r->x + n * r->E;
        for (int64_t f = 0; f < r->F; f++) {
            double g = 0, u = 0;
            for (int64_t e = 0; e < r->E; e++) {
                double w0 = r->wi ? r->wi[(e * 2 + 0) * r->F + f] : r->wi0[e * r->F + f];
                double w1 = r->wi ? r->wi[(e * 2 + 1) * r->F + f] : r->wi1[e * r->F + f];
                g += (double)x[e] * w0;
                u += (double)x[e] * w1;
            }
            h[f] = g / (1 + exp(-g)) * u;
        }
        for (int64_t e = 0; e < r->E; e++) {
            double y = 0;
            for (int64_t f = 0; f < r->F; f++) y += h[f] * r->wo[f * r->E + e];
            if (r->out) r->out[n * r->E + e] = y;
            s += y * r->c[n * r->E + e];
        }
    }
    free(h);
    return s;
}

/* Worst difference of a block gradient from the reference's central differences at a spread of
 * elements, relative to the largest of them. */
static double grad_error(ref *r, float *v, const float *got, int64_t n)
{
    double worst = 0, big = 1e-6;
    for (int p = 0; p < 12; p++) {
        int64_t e = (int64_t)((p * 7919 + 13) % n);
        double fd = block_run_fd(ref_run, r, v, e, 1e-2);
        double d = fabs(fd - got[e]);
        if (fabs(fd) > big) big = fabs(fd);
        if (d > worst) worst = d;
    }
    return worst / big;
}

static void check_mlp(bool fused)
{
    const char *extra[] = {"ici_fsdp_parallelism=2", "ici_tensor_parallelism=2", fused ? "fused_mlp=true" : "fused_mlp=false"};
    model_def *def = model_run_load(TINY, 2, ROWS, extra, 3, DEVICES, 0, NULL);
    const int layer = 1;
    model_mlp_block mb = {.wi_0 = fused ? -1 : model_param_index(def, "mlp.wi_0.kernel"),
                          .wi_1 = fused ? -1 : model_param_index(def, "mlp.wi_1.kernel"),
                          .wi = fused ? model_param_index(def, "mlp.wi.kernel") : -1,
                          .wo = model_param_index(def, "mlp.wo.kernel"),
                          .layer = layer,
                          .intermediate = MID,
                          .out = OUT};
    block_run r = {.def = def, .fn = mlp_fn, .arg = &mb, .layer = layer};
    if (fused) {
        r.params[r.nparams++] = mb.wi;
    } else {
        r.params[r.nparams++] = mb.wi_0;
        r.params[r.nparams++] = mb.wi_1;
    }
    r.params[r.nparams++] = mb.wo;
    int64_t N = def->d.batch * def->d.seq, E = def->d.emb, F = def->d.mlp;
    float *x = malloc((size_t)(N * E) * sizeof *x), *c = malloc((size_t)(N * E) * sizeof *c);
    assert_non_null(x);
    assert_non_null(c);
    for (int64_t i = 0; i < N * E; i++) {
        x[i] = helper_det_val((uint32_t)i, 1.0f);
        c[i] = helper_det_val((uint32_t)(i + 77777), 1.0f);
    }
    block_run_go(&r, x, c);

    ref rf = {.N = N, .E = E, .F = F, .x = x, .c = c, .wo = r.w[r.nparams - 1]};
    if (fused) rf.wi = r.w[0];
    else {
        rf.wi0 = r.w[0];
        rf.wi1 = r.w[1];
    }
    rf.out = malloc((size_t)(N * E) * sizeof *rf.out);
    assert_non_null(rf.out);
    ref_run(&rf);
    double worst = 0, big = 0;
    for (int64_t i = 0; i < N * E; i++) {
        worst = fmax(worst, fabs(r.y[i] - rf.out[i]));
        big = fmax(big, fabs(rf.out[i]));
    }
    free(rf.out);
    rf.out = NULL;
    if (worst > 1e-5 * big) fail_msg("MLP output differs from the reference by %g (largest %g)", worst, big);
    assert_true(big > 1e-3); /* a real output, not zeros */

    double e = grad_error(&rf, x, r.dx, N * E);
    if (e > 2e-3) fail_msg("input gradient off by %g (relative)", e);
    for (int k = 0; k < r.nparams; k++) {
        float *w = r.w[k]; /* the reference reads the same buffer the difference perturbs */
        e = grad_error(&rf, w, r.dw[k], r.wn[k]);
        if (e > 2e-3) fail_msg("gradient of %s off by %g (relative)", def->defs[r.params[k]].path, e);
    }
    block_run_free(&r);
    free(x);
    free(c);
    model_run_unload(def);
}

static void test_mlp_two_kernels(void **state)
{
    (void)state;
    check_mlp(false);
}

static void test_mlp_fused(void **state)
{
    (void)state;
    check_mlp(true);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_mlp_two_kernels),
        cmocka_unit_test(test_mlp_fused),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
