/* test_models_mla.c — DeepSeek's multi-head latent attention block (models/blocks/mla.h) against
 * a float64 reference of MaxText's definition (layers/attention_mla.py MLA, train mode), written
 * here over tests/block_ref.c's RMSNorm, RoPE and causal attention:
 *   q = x . query, or wq_b(q_norm(x . wq_a)) with q_lora_rank; q = [q_nope, rope(q_pe)];
 *   [latent, k_rope] = x . wkv_a; [k_nope, v] = kv_norm(latent) . wkv_b;
 *   key = [k_nope, rope(k_rope)] (one rope head shared by every head);
 *   y = causal_attention(q, key, v, qk_head_dim^-0.5) . out,
 * with the default rotary embedding (the YaRN frequencies are the kernel's, tested in
 * test_bk_rope) and no YaRN mscale (max_position_embeddings = original_max_position_embeddings).
 * The input's and every parameter's gradient against central differences of the reference; with
 * q_lora_rank on fsdp=2 tensor=2 (heads sharded) and without it on data=2 fsdp=2. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "models/blocks/mla.h"
#include "tests/block_ref.h"
#include "tests/block_run.h"
#include "tests/helpers.h"
#include "tests/model_run.h"

static const char *const TINY[] = {TINY_DEEPSEEK_YML, "init_weights_seed=13"};
enum { ROWS = 4, DEVICES = 4 };
static const char *const PREFIX = "params.decoder.dense_layers";

typedef struct {
    model_mla_dims dims;
    model_mla_params p;
} mla_arg;

static sim_status mla_fn(model_dev *md, mesh_tape *t, const model_batch *b, mesh_var *x, mesh_var **y, const void *arg)
{
    const mla_arg *a = arg;
    return model_mla(md, t, b, &a->dims, &a->p, 0, x, y);
}

/* The reference's weights (one layer, global) and dims. */
typedef struct {
    int64_t B, T, E, H, QL, KL, NOPE, ROPE, V;
    const float *query, *wq_a, *q_norm, *wq_b, *wkv_a, *kv_norm, *wkv_b, *out;
    double eps, min_ts, max_ts;
} ref_mla;

static void ref_mla_fwd(const ref_mla *r, const double *x, double *y)
{
    int64_t N = r->B * r->T, E = r->E, H = r->H, QK = r->NOPE + r->ROPE, KVW = r->KL + r->ROPE;
    double *q = malloc((size_t)(N * H * QK) * sizeof *q), *k = malloc((size_t)(N * H * QK) * sizeof *k);
    double *v = malloc((size_t)(N * H * r->V) * sizeof *v), *o = malloc((size_t)(N * H * r->V) * sizeof *o);
    double *lq = malloc((size_t)(r->QL > 0 ? r->QL : 1) * sizeof *lq), *low = malloc((size_t)KVW * sizeof *low);
    double *kv = malloc((size_t)(H * (r->NOPE + r->V)) * sizeof *kv);
    assert_true(q && k && v && o && lq && low && kv);
    for (int64_t n = 0; n < N; n++) {
        const double *xn = x + n * E;
        double *qn = q + n * H * QK;
        if (r->QL == 0) ref_project(E, xn, r->query, H, 0, H, QK, qn);
        else {
            ref_project(E, xn, r->wq_a, 1, 0, 1, r->QL, lq);
            ref_rmsnorm(1, r->QL, lq, r->q_norm, r->eps, lq);
            ref_project(r->QL, lq, r->wq_b, H, 0, H, QK, qn);
        }
        for (int64_t h = 0; h < H; h++) ref_rope(qn + h * QK + r->NOPE, 1, r->ROPE, n % r->T, r->min_ts, r->max_ts);
        ref_project(E, xn, r->wkv_a, 1, 0, 1, KVW, low);
        ref_rmsnorm(1, r->KL, low, r->kv_norm, r->eps, low); /* the latent; low[KL..] is the rope key */
        ref_rope(low + r->KL, 1, r->ROPE, n % r->T, r->min_ts, r->max_ts);
        ref_project(r->KL, low, r->wkv_b, H, 0, H, r->NOPE + r->V, kv);
        for (int64_t h = 0; h < H; h++) {
            double *kh = k + (n * H + h) * QK;
            memcpy(kh, kv + h * (r->NOPE + r->V), (size_t)r->NOPE * sizeof *kh);
            memcpy(kh + r->NOPE, low + r->KL, (size_t)r->ROPE * sizeof *kh);
            memcpy(v + (n * H + h) * r->V, kv + h * (r->NOPE + r->V) + r->NOPE, (size_t)r->V * sizeof *v);
        }
    }
    ref_causal_attention(r->B, r->T, H, H, QK, r->V, q, k, v, 1 / sqrt((double)QK), o);
    ref_out_proj(N, H * r->V, E, o, r->out, y);
    free(q);
    free(k);
    free(v);
    free(o);
    free(lq);
    free(low);
    free(kv);
}

/* The reference from the run's weights (those the model has, in mla_arg's order). */
static void reference(const block_run *r, const void *arg, const double *x, double *y)
{
    const mla_arg *a = arg;
    const model_dims *d = &r->def->d;
    ref_mla rf = {.B = d->batch,
                  .T = d->seq,
                  .E = d->emb,
                  .H = d->q_heads,
                  .QL = a->dims.q_lora,
                  .KL = a->dims.kv_lora,
                  .NOPE = a->dims.qk_nope,
                  .ROPE = a->dims.qk_rope,
                  .V = a->dims.v_head,
                  .eps = d->eps,
                  .min_ts = d->rope_min,
                  .max_ts = d->rope_theta};
    const int have[] = {a->p.query, a->p.wq_a, a->p.q_norm, a->p.wq_b, a->p.wkv_a, a->p.kv_norm, a->p.wkv_b, a->p.out};
    const float **slot[] = {&rf.query, &rf.wq_a, &rf.q_norm, &rf.wq_b, &rf.wkv_a, &rf.kv_norm, &rf.wkv_b, &rf.out};
    for (int k = 0, j = 0; k < 8; k++)
        if (have[k] >= 0) *slot[k] = r->w[j++];
    ref_mla_fwd(&rf, x, y);
}

static void check_mla(bool q_lora)
{
    const char *lora[] = {"ici_fsdp_parallelism=2", "ici_tensor_parallelism=2"};
    const char *plain[] = {"q_lora_rank=0", "ici_data_parallelism=2", "ici_fsdp_parallelism=2"};
    model_def *def = q_lora ? model_run_load(TINY, 2, ROWS, lora, 2, DEVICES, 0, NULL)
                            : model_run_load(TINY, 2, ROWS, plain, 3, DEVICES, 0, NULL);
    const model_dims *d = &def->d;
    mla_arg a = {.dims = {.q_lora = q_lora ? 16 : 0,
                          .kv_lora = 8,
                          .qk_nope = 8,
                          .qk_rope = 4,
                          .v_head = 8,
                          .rope_factor = 1,
                          .mscale = 1,
                          .max_pos = 0,
                          .orig_max_pos = 0,
                          .yarn = false},
                 .p = model_mla_params_at(def, PREFIX)};
    assert_true(d->rope_linear == 1.0);
    block_run r = {.def = def, .fn = mla_fn, .arg = &a, .layer = 0};
    const int want[] = {a.p.query, a.p.wq_a, a.p.q_norm, a.p.wq_b, a.p.wkv_a, a.p.kv_norm, a.p.wkv_b, a.p.out};
    for (int k = 0; k < 8; k++)
        if (want[k] >= 0) r.params[r.nparams++] = want[k];
    assert_int_equal(r.nparams, q_lora ? 7 : 5);
    block_run_check(&r, reference, &a, 1e-5, 2e-3);
    model_run_unload(def);
}

static void test_mla_q_lora(void **state)
{
    (void)state;
    check_mla(true);
}

static void test_mla_plain_query(void **state)
{
    (void)state;
    check_mla(false);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_mla_q_lora),
        cmocka_unit_test(test_mla_plain_query),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
