/* test_models_attention.c — the Attention block (models/blocks/attention.h) against a float64
 * reference computed here from MaxText's definition (layers/attentions.py Attention, train mode,
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

/* The reference; sum(c * y) and y (when out is not NULL), in double. */
typedef struct {
    int64_t B, T, E, H, K, D;
    const float *x, *c;
    const float *wq, *wk, *wv; /* (E, H|K, D); NULL with wqkv */
    const float *wqkv;         /* fused: (E, H + 2K, D) */
    const float *wo;           /* (H, D, E) */
    const float *qn, *kn;      /* (D) RMSNorm scales, or NULL */
    double eps, scale, min_ts, max_ts;
    double *out;
} ref;

/* Projection of token x (E) by kernel w (E, nh, D) at heads [h0, h0 + n) -> p (n, D). */
static void project(const ref *r, const float *x, const float *w, int64_t nh, int64_t h0, int64_t n, double *p)
{
    for (int64_t h = 0; h < n; h++)
        for (int64_t d = 0; d < r->D; d++) {
            double s = 0;
            for (int64_t e = 0; e < r->E; e++) s += (double)x[e] * w[(e * nh + h0 + h) * r->D + d];
            p[h * r->D + d] = s;
        }
}

/* RMSNorm over D with scale g, then the default RoPE at position pos, on each of n heads. */
static void norm_rope(const ref *r, double *v, int64_t n, const float *g, int64_t pos)
{
    int64_t D = r->D, half = D / 2;
    for (int64_t h = 0; h < n; h++) {
        double *a = v + h * D;
        if (g) {
            double ms = 0;
            for (int64_t d = 0; d < D; d++) ms += a[d] * a[d];
            double inv = 1 / sqrt(ms / (double)D + r->eps);
            for (int64_t d = 0; d < D; d++) a[d] = a[d] * inv * g[d];
        }
        for (int64_t i = 0; i < half; i++) {
            double ts = r->min_ts * pow(r->max_ts / r->min_ts, 2.0 * (double)i / (double)D);
            double ang = (double)pos / ts, re = a[i], im = a[i + half];
            a[i] = re * cos(ang) - im * sin(ang);
            a[i + half] = re * sin(ang) + im * cos(ang);
        }
    }
}

static double ref_run(const void *arg)
{
    const ref *r = arg;
    int64_t B = r->B, T = r->T, E = r->E, H = r->H, K = r->K, D = r->D, N = B * T;
    double *q = calloc((size_t)(N * H * D), sizeof *q), *k = calloc((size_t)(N * K * D), sizeof *k);
    double *v = calloc((size_t)(N * K * D), sizeof *v), *o = calloc((size_t)(H * D), sizeof *o);
    double *p = calloc((size_t)T, sizeof *p);
    assert_true(q && k && v && o && p);
    for (int64_t n = 0; n < N; n++) {
        const float *x = r->x + n * E;
        if (r->wqkv) {
            project(r, x, r->wqkv, H + 2 * K, 0, H, q + n * H * D);
            project(r, x, r->wqkv, H + 2 * K, H, K, k + n * K * D);
            project(r, x, r->wqkv, H + 2 * K, H + K, K, v + n * K * D);
        } else {
            project(r, x, r->wq, H, 0, H, q + n * H * D);
            project(r, x, r->wk, K, 0, K, k + n * K * D);
            project(r, x, r->wv, K, 0, K, v + n * K * D);
        }
        norm_rope(r, q + n * H * D, H, r->qn, n % T);
        norm_rope(r, k + n * K * D, K, r->kn, n % T);
    }
    double sum = 0;
    for (int64_t b = 0; b < B; b++)
        for (int64_t t = 0; t < T; t++) {
            for (int64_t h = 0; h < H; h++) {
                int64_t kv = h / (H / K);
                const double *qq = q + ((b * T + t) * H + h) * D;
                double mx = -INFINITY, z = 0;
                for (int64_t s = 0; s <= t; s++) {
                    const double *kk = k + ((b * T + s) * K + kv) * D;
                    double dot = 0;
                    for (int64_t d = 0; d < D; d++) dot += qq[d] * kk[d];
                    p[s] = r->scale * dot;
                    mx = fmax(mx, p[s]);
                }
                for (int64_t s = 0; s <= t; s++) z += (p[s] = exp(p[s] - mx));
                for (int64_t d = 0; d < D; d++) {
                    double acc = 0;
                    for (int64_t s = 0; s <= t; s++) acc += p[s] / z * v[((b * T + s) * K + kv) * D + d];
                    o[h * D + d] = acc;
                }
            }
            for (int64_t e = 0; e < E; e++) {
                double y = 0;
                for (int64_t hd = 0; hd < H * D; hd++) y += o[hd] * r->wo[hd * E + e];
                if (r->out) r->out[(b * T + t) * E + e] = y;
                sum += y * r->c[(b * T + t) * E + e];
            }
        }
    free(q);
    free(k);
    free(v);
    free(o);
    free(p);
    return sum;
}

static double grad_error(ref *r, float *v, const float *got, int64_t n)
{
    double worst = 0, big = 1e-6;
    for (int p = 0; p < 10; p++) {
        int64_t e = (int64_t)((p * 7919 + 5) % n);
        double fd = block_run_fd(ref_run, r, v, e, 1e-2);
        if (fabs(fd) > big) big = fabs(fd);
        worst = fmax(worst, fabs(fd - got[e]));
    }
    return worst / big;
}

typedef enum { LLAMA, QWEN3, FUSED } variant;

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
                                .query_norm = var == QWEN3 ? model_param_index(def, "self_attention.query_norm.scale") : -1,
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
    int64_t N = d->batch * d->seq, E = d->emb;
    float *x = malloc((size_t)(N * E) * sizeof *x), *c = malloc((size_t)(N * E) * sizeof *c);
    assert_true(x && c);
    for (int64_t i = 0; i < N * E; i++) {
        x[i] = helper_det_val((uint32_t)i, 1.0f);
        c[i] = helper_det_val((uint32_t)(i + 55555), 1.0f);
    }
    block_run_go(&r, x, c);

    ref rf = {.B = d->batch,
              .T = d->seq,
              .E = E,
              .H = d->q_heads,
              .K = d->kv_heads,
              .D = d->head_dim,
              .x = x,
              .c = c,
              .eps = d->eps,
              .scale = ab.scale,
              .min_ts = d->rope_min,
              .max_ts = d->rope_theta};
    assert_true(rf.H > rf.K); /* grouped-query attention */
    int k = 0;
    if (var == FUSED) rf.wqkv = r.w[k++];
    else {
        rf.wq = r.w[k++];
        rf.wk = r.w[k++];
        rf.wv = r.w[k++];
    }
    rf.wo = r.w[k++];
    if (var == QWEN3) {
        rf.qn = r.w[k++];
        rf.kn = r.w[k++];
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
    if (worst > 1e-5 * big) fail_msg("attention output differs from the reference by %g (largest %g)", worst, big);
    assert_true(big > 1e-3);
    double e = grad_error(&rf, x, r.dx, N * E);
    if (e > 2e-3) fail_msg("input gradient off by %g (relative)", e);
    for (k = 0; k < r.nparams; k++) {
        e = grad_error(&rf, r.w[k], r.dw[k], r.wn[k]);
        if (e > 2e-3) fail_msg("gradient of %s off by %g (relative)", def->defs[r.params[k]].path, e);
    }
    block_run_free(&r);
    free(x);
    free(c);
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
