/* test_models_attention.c — the Attention block (models/blocks/attention.h) against a float64
 * reference of MaxText's definition (tests/block_ref.c; layers/attentions.py Attention, train mode,
 * global causal attention): q, k, v = x . query, key, value; with use_qk_norm an RMSNorm over
 * head_dim (with its scale) on q and k; the default rotary embedding (embeddings.RotaryEmbedding:
 * timescale_i = min (max/min)^(2i/D), the halves rotated) at the token's position; scores
 * query_pre_attn_scalar q . k over the key positions up to the query's, query head h reading
 * key-value head h / (heads / kv_heads); softmax; y = (p . v) . out.  The input gradient and every
 * kernel's (and norm scale's) gradient against central differences of that reference.  Cases: a
 * Llama layer's attention (no norm, scale 1, GQA) on fsdp=2 tensor=2; Qwen3's (query/key norms,
 * scale head_dim^-0.5) on data=2 tensor=2; fused_qkv on fsdp=4 (the fused heads unsharded, so
 * query head i is fused head i). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "models/blocks/attention.h"
#include "tests/block_ref.h"
#include "tests/block_run.h"
#include "tests/helpers.h"
#include "tests/model_run.h"

static const char *const TINY[] = {TINY_LLAMA_YML, "init_weights_seed=5"};
enum { ROWS = 4, DEVICES = 4 };
static const char *const OUT[3] = {"activation_batch", "activation_norm_length", "activation_embed"};

static sim_status attention_fn(model_dev *md, mesh_tape *t, const model_batch *b, mesh_var *x, mesh_var **y,
                               const void *arg)
{
    return model_attention(md, t, b, arg, x, y);
}

typedef enum { LLAMA, QWEN3, FUSED } variant;

typedef struct {
    variant var;
    double scale;
} ref_arg;

/* The reference from the run's weights: query, key, value (or qkv_proj), out, then the norms. */
static void reference(const block_run *r, const void *arg, const double *x, double *y)
{
    const ref_arg *ra = arg;
    const model_dims *d = &r->def->d;
    ref_attention a = {.E = d->emb,
                       .H = d->q_heads,
                       .K = d->kv_heads,
                       .D = d->head_dim,
                       .eps = d->eps,
                       .scale = ra->scale,
                       .min_ts = d->rope_min,
                       .max_ts = d->rope_theta};
    int k = 0;
    if (ra->var == FUSED) a.wqkv = r->w[k++];
    else {
        a.wq = r->w[k++];
        a.wk = r->w[k++];
        a.wv = r->w[k++];
    }
    a.wo = r->w[k++];
    if (ra->var == QWEN3) {
        a.qn = r->w[k++];
        a.kn = r->w[k++];
    }
    ref_attention_fwd(&a, d->batch, d->seq, x, y);
}

static void check_attention(variant var)
{
    const char *extra[8];
    int ne = 0;
    if (var == LLAMA) {
        extra[ne++] = "ici_fsdp_parallelism=2";
        extra[ne++] = "ici_tensor_parallelism=2";
    } else if (var == QWEN3) {
        extra[ne++] = "decoder_block=qwen3";
        extra[ne++] = "use_qk_norm=true";
        extra[ne++] = "ici_data_parallelism=2";
        extra[ne++] = "ici_tensor_parallelism=2";
    } else {
        extra[ne++] = "fused_qkv=true";
        extra[ne++] = "ici_fsdp_parallelism=4";
    }
    model_def *def = model_run_load(TINY, 2, ROWS, extra, ne, DEVICES, 0, NULL);
    const model_dims *d = &def->d;
    assert_true(d->rope_linear == 1.0 && !d->rope_llama31); /* the reference's RoPE */
    const int layer = 0;
    bk_rope_params rp = bk_rope_params_default((int)d->head_dim);
    rp.min_timescale = d->rope_min;
    rp.max_timescale = d->rope_theta;
    model_attention_block ab = {.query = model_param_index(def, "self_attention.query.kernel"),
                                .key = model_param_index(def, "self_attention.key.kernel"),
                                .value = model_param_index(def, "self_attention.value.kernel"),
                                .qkv = var == FUSED ? model_param_index(def, "self_attention.qkv_proj.kernel") : -1,
                                .out = model_param_index(def, "self_attention.out.kernel"),
                                .query_norm =
                                    var == QWEN3 ? model_param_index(def, "self_attention.query_norm.scale") : -1,
                                .key_norm = var == QWEN3 ? model_param_index(def, "self_attention.key_norm.scale") : -1,
                                .norm_eps = d->eps,
                                .layer = layer,
                                .rope = rp,
                                .scale = var == QWEN3 ? 1 / sqrt((double)d->head_dim) : 1.0,
                                .soft_cap = 0,
                                .out_names = OUT};
    block_run r = {.def = def, .fn = attention_fn, .arg = &ab, .layer = layer};
    if (var == FUSED) r.params[r.nparams++] = ab.qkv;
    else {
        r.params[r.nparams++] = ab.query;
        r.params[r.nparams++] = ab.key;
        r.params[r.nparams++] = ab.value;
    }
    r.params[r.nparams++] = ab.out;
    if (var == QWEN3) {
        assert_true(ab.query_norm >= 0 && ab.key_norm >= 0);
        r.params[r.nparams++] = ab.query_norm;
        r.params[r.nparams++] = ab.key_norm;
    }
    assert_true(d->q_heads > d->kv_heads); /* grouped-query attention */
    ref_arg ra = {.var = var, .scale = ab.scale};
    block_run_check(&r, reference, &ra, 1e-5, 2e-3);
    model_run_unload(def);
}

static void test_llama_gqa(void **state)
{
    (void)state;
    check_attention(LLAMA);
}

static void test_qwen3_qk_norm(void **state)
{
    (void)state;
    check_attention(QWEN3);
}

static void test_fused_qkv(void **state)
{
    (void)state;
    check_attention(FUSED);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_llama_gqa),
        cmocka_unit_test(test_qwen3_qk_norm),
        cmocka_unit_test(test_fused_qkv),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
