/* test_models_dense_layer.c — the dense decoder layer (models/blocks/dense_layer.h) against the
 * float64 reference of MaxText's LlamaDecoderLayer / Qwen3DecoderLayer (tests/block_ref.c:
 * h = x + attention(rmsnorm(x)), y = h + mlp(rmsnorm(h))), with Llama's choices on fsdp=2 tensor=2
 * and Qwen3's (query/key norms, scale head_dim^-0.5, the residual constrained in explicit mode
 * only) on data=2 tensor=2; the input's and every parameter's gradient against central
 * differences of the reference. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "models/blocks/dense_layer.h"
#include "tests/block_ref.h"
#include "tests/block_run.h"
#include "tests/helpers.h"
#include "tests/model_run.h"

static const char *const TINY[] = {TINY_LLAMA_YML, "init_weights_seed=11"};
enum { ROWS = 4, DEVICES = 4 };
static const char *const MID_LLAMA[3] = {"activation_batch", "activation_length", "activation_mlp"};
static const char *const MID_QWEN3[3] = {"activation_batch", "activation_norm_length", "activation_mlp"};

typedef struct {
    model_dense_layer c;
    int layer;
} layer_arg;

static sim_status layer_fn(model_dev *md, mesh_tape *t, const model_batch *b, mesh_var *x, mesh_var **y,
                           const void *arg)
{
    const layer_arg *la = arg;
    mesh_var *aux;
    sim_status st = model_dense_layer_run(md, t, b, &la->c, la->layer, x, y, &aux);
    assert_null(aux); /* the dense MlpBlock has no second output */
    return st;
}

/* The reference from the run's weights: ln1, query, key, value, out, ln2, wi_0, wi_1, wo, then the
 * query and key norms (Qwen3). */
static void reference(const block_run *r, const void *arg, const double *x, double *y)
{
    const layer_arg *la = arg;
    const model_dims *d = &r->def->d;
    bool qk = r->nparams == 11;
    ref_dense_layer L = {.a = {.E = d->emb,
                               .H = d->q_heads,
                               .K = d->kv_heads,
                               .D = d->head_dim,
                               .wq = r->w[1],
                               .wk = r->w[2],
                               .wv = r->w[3],
                               .wo = r->w[4],
                               .qn = qk ? r->w[9] : NULL,
                               .kn = qk ? r->w[10] : NULL,
                               .eps = d->eps,
                               .scale = la->c.scale,
                               .min_ts = d->rope_min,
                               .max_ts = d->rope_theta},
                         .m = {.E = d->emb, .F = d->mlp, .wi0 = r->w[6], .wi1 = r->w[7], .wo = r->w[8]},
                         .ln1 = r->w[0],
                         .ln2 = r->w[5],
                         .eps = d->eps};
    ref_dense_layer_fwd(&L, d->batch, d->seq, x, y);
}

static void check_layer(bool qwen3)
{
    const char *llama[] = {"ici_fsdp_parallelism=2", "ici_tensor_parallelism=2"};
    const char *q3[] = {"decoder_block=qwen3", "use_qk_norm=true", "ici_data_parallelism=2",
                        "ici_tensor_parallelism=2"};
    model_def *def = qwen3 ? model_run_load(TINY, 2, ROWS, q3, 4, DEVICES, 0, NULL)
                           : model_run_load(TINY, 2, ROWS, llama, 2, DEVICES, 0, NULL);
    const model_dims *d = &def->d;
    assert_true(d->rope_linear == 1.0 && !d->rope_llama31);
    layer_arg la = {.c = {.prefix = qwen3 ? "qwen3" : "llama2",
                          .residual_explicit_only = qwen3,
                          .rope = model_dense_rope(d),
                          .scale = qwen3 ? 1 / sqrt((double)d->head_dim) : 1.0,
                          .soft_cap = 0,
                          .mlp_mid = qwen3 ? MID_QWEN3 : MID_LLAMA,
                          .output_dropout = !qwen3},
                    .layer = 1};
    model_dense_ix ix = model_dense_indices(def);
    assert_true(qwen3 ? ix.qn >= 0 && ix.kn >= 0 : ix.qn < 0 && ix.kn < 0);
    block_run r = {.def = def, .fn = layer_fn, .arg = &la, .layer = la.layer};
    const int want[] = {ix.ln1, ix.q, ix.k, ix.v, ix.o, ix.ln2, ix.wi0, ix.wi1, ix.wo, ix.qn, ix.kn};
    for (int k = 0; k < (qwen3 ? 11 : 9); k++) r.params[r.nparams++] = want[k];
    block_run_check(&r, reference, &la, 1e-5, 2e-3);
    model_run_unload(def);
}

static void test_llama_layer(void **state)
{
    (void)state;
    check_layer(false);
}

static void test_qwen3_layer(void **state)
{
    (void)state;
    check_layer(true);
}
int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_llama_layer),
        cmocka_unit_test(test_qwen3_layer),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
