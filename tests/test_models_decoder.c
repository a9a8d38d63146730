/* test_models_decoder.c — the dense decoder layer (models/blocks/dense_layer.h) and the Decoder
 * around it (models/blocks/decoder.h) against float64 references of MaxText's definitions
 * (tests/block_ref.c for RMSNorm, attention and the MLP):
 *   - a layer: h = x + attention(rmsnorm(x)), y = h + mlp(rmsnorm(h)) (LlamaDecoderLayer,
 *     Qwen3DecoderLayer), with Llama's choices on fsdp=2 tensor=2 and Qwen3's (query/key norms,
 *     scale head_dim^-0.5, the residual constrained in explicit mode only) on data=2 tensor=2; the
 *     input's and every parameter's gradient against central differences of the reference;
 *   - the whole model's loss (Decoder: token embedding, the layers, the final RMSNorm, the output
 *     head, the mean cross-entropy) against the reference from the seeded initial weights, with
 *     logits_dense and with logits_via_embedding (normalize_embedding_logits: divided by
 *     sqrt(emb)), on fsdp=2 tensor=2 with remat and without. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "models/blocks/dense_layer.h"
#include "models/core/init.h"
#include "tests/block_ref.h"
#include "tests/block_run.h"
#include "tests/helpers.h"
#include "tests/model_run.h"

static const char *const TINY[] = {TINY_LLAMA_YML, "init_weights_seed=11"};
enum { ROWS = 4, DEVICES = 4 };
static const char *const MID_LLAMA[3] = {"activation_batch", "activation_length", "activation_mlp"};
static const char *const MID_QWEN3[3] = {"activation_batch", "activation_norm_length", "activation_mlp"};

/* ------------------------------------------------------------ the reference layer */

/* One layer's weights, global (layer l), in the reference's terms. */
typedef struct {
    ref_attention a;
    ref_mlp m;
    const float *ln1, *ln2;
    double eps;
} ref_layer;

static void ref_layer_fwd(const ref_layer *L, int64_t B, int64_t T, const double *x, double *y)
{
    int64_t n = B * T * L->a.E;
    double *t = malloc((size_t)n * sizeof *t), *u = malloc((size_t)n * sizeof *u);
    SIM_ASSERT(t && u);
    ref_rmsnorm(B * T, L->a.E, x, L->ln1, L->eps, t);
    ref_attention_fwd(&L->a, B, T, t, u);
    for (int64_t i = 0; i < n; i++) u[i] += x[i]; /* h */
    ref_rmsnorm(B * T, L->a.E, u, L->ln2, L->eps, t);
    ref_mlp_fwd(&L->m, B * T, t, y);
    for (int64_t i = 0; i < n; i++) y[i] += u[i];
    free(t);
    free(u);
}

/* ------------------------------------------------------------ one layer */

typedef struct {
    model_dense_layer c;
    int layer;
} layer_arg;

static sim_status layer_fn(model_dev *md, mesh_tape *t, const model_batch *b, mesh_var *x, mesh_var **y,
                           const void *arg)
{
    const layer_arg *la = arg;
    return model_dense_layer_run(md, t, b, &la->c, la->layer, x, y);
}

/* The reference from the run's weights: ln1, query, key, value, out, ln2, wi_0, wi_1, wo, then the
 * query and key norms (Qwen3). */
static void reference(const block_run *r, const void *arg, const double *x, double *y)
{
    const layer_arg *la = arg;
    const model_dims *d = &r->def->d;
    bool qk = r->nparams == 11;
    ref_layer L = {.a = {.E = d->emb,
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
    ref_layer_fwd(&L, d->batch, d->seq, x, y);
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

/* ------------------------------------------------------------ the whole model's loss */

/* Parameter `suffix`, layer l (l < 0: unscanned), as the seeded init makes it (to free). */
static float *init_weight(const model_def *def, const char *suffix, int l)
{
    int i = model_param_index(def, suffix);
    if (i < 0) return NULL;
    const model_param_def *pd = &def->defs[i];
    int64_t n = 1;
    for (int k = 0; k < pd->rank; k++)
        if (k != pd->scan_dim) n *= pd->shape[k];
    float *w = malloc((size_t)n * sizeof *w);
    assert_non_null(w);
    char name[MODEL_PATH_MAX + 32];
    model_init_global(w, n, model_init_layer_name(pd->path, pd->scan_dim >= 0 ? l : -1, name, sizeof name), pd->init,
                      pd->scale, def->d.seed);
    return w;
}

/* MaxText's loss: the mean over tokens of logsumexp(logits) - logits[target] (no z-loss). */
static double ref_loss(const model_def *def, const int32_t *in, const int32_t *tg)
{
    const model_dims *d = &def->d;
    int64_t B = d->batch, T = d->seq, E = d->emb, V = d->vocab, N = B * T;
    float *table = init_weight(def, "token_embedder.embedding", -1),
          *head = init_weight(def, "logits_dense.kernel", -1);
    float *fnorm = init_weight(def, "decoder_norm.scale", -1);
    double *x = malloc((size_t)(N * E) * sizeof *x), *y = malloc((size_t)(N * E) * sizeof *y);
    assert_true(x && y);
    for (int64_t n = 0; n < N; n++)
        for (int64_t e = 0; e < E; e++) x[n * E + e] = table[(int64_t)in[n] * E + e];
    for (int l = 0; l < d->layers; l++) {
        float *w[9];
        static const char *const names[9] = {"pre_self_attention_layer_norm.scale",
                                             "self_attention.query.kernel",
                                             "self_attention.key.kernel",
                                             "self_attention.value.kernel",
                                             "self_attention.out.kernel",
                                             "post_self_attention_layer_norm.scale",
                                             "mlp.wi_0.kernel",
                                             "mlp.wi_1.kernel",
                                             "mlp.wo.kernel"};
        for (int k = 0; k < 9; k++) w[k] = init_weight(def, names[k], l);
        ref_layer L = {.a = {.E = E,
                             .H = d->q_heads,
                             .K = d->kv_heads,
                             .D = d->head_dim,
                             .wq = w[1],
                             .wk = w[2],
                             .wv = w[3],
                             .wo = w[4],
                             .eps = d->eps,
                             .scale = 1.0,
                             .min_ts = d->rope_min,
                             .max_ts = d->rope_theta},
                       .m = {.E = E, .F = d->mlp, .wi0 = w[6], .wi1 = w[7], .wo = w[8]},
                       .ln1 = w[0],
                       .ln2 = w[5],
                       .eps = d->eps};
        ref_layer_fwd(&L, B, T, x, y);
        memcpy(x, y, (size_t)(N * E) * sizeof *x);
        for (int k = 0; k < 9; k++) free(w[k]);
    }
    ref_rmsnorm(N, E, x, fnorm, d->eps, y);
    double loss = 0, *logit = malloc((size_t)V * sizeof *logit);
    assert_non_null(logit);
    for (int64_t n = 0; n < N; n++) {
        for (int64_t v = 0; v < V; v++) {
            double s = 0;
            for (int64_t e = 0; e < E; e++) s += y[n * E + e] * (head ? head[e * V + v] : table[v * E + e]);
            /* normalize_embedding_logits: tied logits divided by sqrt(emb) (Embed.attend's caller) */
            logit[v] = !head && d->normalize_tied ? s / sqrt((double)E) : s;
        }
        double mx = -INFINITY, z = 0;
        for (int64_t v = 0; v < V; v++) mx = fmax(mx, logit[v]);
        for (int64_t v = 0; v < V; v++) z += exp(logit[v] - mx);
        loss += mx + log(z) - logit[tg[n]];
    }
    free(logit);
    free(x);
    free(y);
    free(table);
    free(head);
    free(fnorm);
    return loss / (double)N;
}

static void check_loss(const char *const *extra, int n_extra)
{
    model_def *def = model_run_load(TINY, 2, ROWS, extra, n_extra, DEVICES, 0, NULL);
    const model_dims *d = &def->d;
    assert_true(d->z_loss == 0 && d->dropout == 0 && d->final_soft_cap == 0);
    assert_true(d->layers == 2);
    int64_t N = d->batch * d->seq;
    int32_t *in = malloc((size_t)N * sizeof *in), *tg = malloc((size_t)N * sizeof *tg);
    int32_t *pos = malloc((size_t)N * sizeof *pos);
    assert_true(in && tg && pos);
    model_run_pattern((int)d->batch, (int)d->seq, (int)d->vocab, in, tg, pos);
    double got = model_run_loss_grads(def, in, tg, pos, NULL, NULL, NULL), want = ref_loss(def, in, tg);
    if (fabs(got - want) > 1e-5 * fabs(want)) fail_msg("loss %.9g, the reference %.9g", got, want);
    free(in);
    free(tg);
    free(pos);
    model_run_unload(def);
}

static void test_loss_logits_dense(void **state)
{
    (void)state;
    const char *extra[] = {"ici_fsdp_parallelism=2", "ici_tensor_parallelism=2", "remat_policy=full"};
    check_loss(extra, 3);
}

static void test_loss_tied_no_remat(void **state)
{
    (void)state;
    const char *extra[] = {"ici_fsdp_parallelism=2", "ici_tensor_parallelism=2", "remat_policy=none",
                           "logits_via_embedding=true"};
    check_loss(extra, 4);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_llama_layer),
        cmocka_unit_test(test_qwen3_layer),
        cmocka_unit_test(test_loss_logits_dense),
        cmocka_unit_test(test_loss_tied_no_remat),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
