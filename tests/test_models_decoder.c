/* test_models_decoder.c — MaxText's Decoder around the dense layer (models/blocks/decoder.h): the
 * whole model's loss (token embedding, the layers, the final RMSNorm, the output head, the mean
 * cross-entropy) against a float64 reference from the seeded initial weights (tests/block_ref.c
 * for the layers), with logits_dense and with logits_via_embedding (normalize_embedding_logits:
 * divided by sqrt(emb); attend_on_embedding's table rounded to bfloat16), on fsdp=2 tensor=2 with remat
 * and without.  The layer itself:
 * test_models_dense_layer. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "models/core/init.h"

/* x to the nearest bfloat16 (8 significant bits, ties to even under the default rounding mode):
 * attend_on_embedding's jnp.asarray(embedding_table, jnp.bfloat16) */
static double bf16(double x)
{
    int e;
    double m = frexp(x, &e); /* |m| in [0.5, 1) */
    return ldexp(nearbyint(m * 256.0) / 256.0, e);
}
#include "tests/block_ref.h"
#include "tests/helpers.h"
#include "tests/model_run.h"

static const char *const TINY[] = {TINY_LLAMA_YML, "init_weights_seed=11"};
enum { ROWS = 4, DEVICES = 4 };

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
        ref_dense_layer L = {.a = {.E = E,
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
        ref_dense_layer_fwd(&L, B, T, x, y);
        memcpy(x, y, (size_t)(N * E) * sizeof *x);
        for (int k = 0; k < 9; k++) free(w[k]);
    }
    ref_rmsnorm(N, E, x, fnorm, d->eps, y);
    double loss = 0, *logit = malloc((size_t)V * sizeof *logit);
    assert_non_null(logit);
    for (int64_t n = 0; n < N; n++) {
        for (int64_t v = 0; v < V; v++) {
            double s = 0;
            for (int64_t e = 0; e < E; e++) s += y[n * E + e] * (head ? head[e * V + v] : bf16(table[v * E + e]));
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
        cmocka_unit_test(test_loss_logits_dense),
        cmocka_unit_test(test_loss_tied_no_remat),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
