/* test_models_mlp.c — the SwiGLU MlpBlock (models/blocks/mlp.h) against the float64 reference of
 * MaxText's MlpBlock with mlp_activations [silu, linear] (tests/block_ref.c:
 * y = (silu(x . wi_0) * (x . wi_1)) . wo), and its gradients (input and every kernel) against
 * central differences of that reference.  On a 2x2 mesh (fsdp, tensor), in both kernel layouts
 * (two kernels; fused_mlp's one (embed, 2, mlp) kernel); and with mlp_activations [gelu, linear]
 * (GeGLU, jax.nn.gelu's tanh form: the gemma files). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include <stdlib.h>

#include "models/blocks/mlp.h"
#include "tests/block_ref.h"
#include "tests/block_run.h"
#include "tests/helpers.h"
#include "tests/model_run.h"

static const char *const TINY[] = {TINY_LLAMA_YML, "init_weights_seed=3"};
enum { ROWS = 4, DEVICES = 4 };
static const char *const MID[3] = {"activation_batch", "activation_length", "activation_mlp"};
static const char *const OUT[3] = {"activation_batch", "activation_norm_length", "activation_embed"};

static sim_status mlp_fn(model_dev *md, mesh_tape *t, const model_batch *b, mesh_var *x, mesh_var **y, const void *arg)
{
    (void)b;
    return model_mlp(md, t, arg, x, y);
}

/* The reference from the run's weights: wi_0, wi_1 (or wi), wo. */
static void reference(const block_run *r, const void *arg, const double *x, double *y)
{
    const bool *fused = arg;
    const model_dims *d = &r->def->d;
    ref_mlp m = {.E = d->emb, .F = d->mlp, .gelu = d->mlp_gelu, .wo = r->w[r->nparams - 1]};
    if (*fused) m.wi = r->w[0];
    else {
        m.wi0 = r->w[0];
        m.wi1 = r->w[1];
    }
    ref_mlp_fwd(&m, d->batch * d->seq, x, y);
}

static void check_mlp(bool fused, bool gelu)
{
    const char *extra[] = {"ici_fsdp_parallelism=2", "ici_tensor_parallelism=2",
                           fused ? "fused_mlp=true" : "fused_mlp=false",
                           gelu ? "mlp_activations=[gelu,linear]" : "mlp_activations=[silu,linear]"};
    model_def *def = model_run_load(TINY, 2, ROWS, extra, 4, DEVICES, 0, NULL);
    assert_true(def->d.mlp_gelu == gelu);
    model_mlp_block mb = {.wi_0 = fused ? -1 : model_param_index(def, "mlp.wi_0.kernel"),
                          .wi_1 = fused ? -1 : model_param_index(def, "mlp.wi_1.kernel"),
                          .wi = fused ? model_param_index(def, "mlp.wi.kernel") : -1,
                          .wo = model_param_index(def, "mlp.wo.kernel"),
                          .layer = 1,
                          .intermediate = MID,
                          .out = OUT};
    block_run r = {.def = def, .fn = mlp_fn, .arg = &mb, .layer = mb.layer};
    if (fused) r.params[r.nparams++] = mb.wi;
    else {
        r.params[r.nparams++] = mb.wi_0;
        r.params[r.nparams++] = mb.wi_1;
    }
    r.params[r.nparams++] = mb.wo;
    block_run_check(&r, reference, &fused, 1e-5, 2e-3);
    model_run_unload(def);
}

static void test_mlp_two_kernels(void **state)
{
    (void)state;
    check_mlp(false, false);
}

static void test_mlp_fused(void **state)
{
    (void)state;
    check_mlp(true, false);
}

/* mlp_activations [gelu, linear] (the gemma files): GeGLU */
static void test_mlp_geglu(void **state)
{
    (void)state;
    check_mlp(false, true);
    check_mlp(true, true);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_mlp_two_kernels),
        cmocka_unit_test(test_mlp_fused),
        cmocka_unit_test(test_mlp_geglu),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
