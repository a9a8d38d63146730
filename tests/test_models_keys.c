/* test_models_keys.c — the model keys that change numerics, on a tiny Llama (and one
 * DeepSeek case), each against an expectation derived without the program:
 *   - every key changes the loss (it is read) and keeps parity: loss and every gradient of two
 *     8-device meshes, auto and explicit, within 1e-4 of the 1-device run;
 *   - logits_via_embedding drops logits_dense (parameter bytes fall by emb x vocab x 4) and its
 *     gradients match finite differences (with normalize_embedding_logits and the final soft cap);
 *   - final_logits_soft_cap without tied logits is what MaxText makes of it: nothing;
 *   - rope_linear_scaling_factor f equals multiplying both RoPE timescales by f (timescale_i =
 *     min (max/min)^(2i/d) f);
 *   - use_qk_norm makes the Llama query init exactly sqrt(head_dim) times larger (same stream);
 *   - global_parameter_scale follows MaxText's get_individual_scales; 3 is refused;
 *   - dropout_rate (with enable_dropout): parity across meshes, finite differences, remat and
 *     no remat agree, enable_dropout=false is bitwise no dropout;
 *   - scan_layers=false and param_scan_axis: the checkpoints hold the same values as the default
 *     layout, unstacked under layers_<l> or with the layer dim moved (an index permutation
 *     checked element by element); an unscanned checkpoint loads into an unscanned model;
 *   - logits_dot_in_fp32 leaves the loss bitwise unchanged (the simulator computes in float32; its
 *     bytes are test_models_bytes's);
 *   - remat policies: gradients bitwise equal to remat_policy=full, and peak device memory grows
 *     by exactly the tensors MaxText's policy saves (hand-counted bytes of query/key/value/out/
 *     mlp projections) for the layers whose backward has not run at the peak; offloaded tensors
 *     cost no device memory; a dry run accounts the same bytes (DeepSeek's MoE tags:
 *     test_models_dsremat). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>
#include <unistd.h>

#include "cli/cli.h"
#include "models/core/checks.h"
#include "tests/cli_capture.h"
#include "models/core/train.h"
#include "tests/helpers.h"
#include "tests/model_run.h"

/* tests/data/tiny-llama.yml with a fixed seed and the z-loss */
static const char *const TINY[] = {TINY_LLAMA_YML, "init_weights_seed=7", "z_loss_multiplier=0.001"};
/* tests/data/tiny-deepseek.yml with one MoE layer of 4 experts */
static const char *const DS_TINY[] = {TINY_DEEPSEEK_YML, "base_num_decoder_layers=2", "num_experts=4",
                                      "init_weights_seed=5"};
enum { NTINY = sizeof TINY / sizeof TINY[0], ROWS = 8, SEQ = 16, VOCAB = 64 };
/* bytes of one saved activation element: dtype's default, bfloat16 (configs/base.yml) */
enum { ACT = 2 };

/* The status of loading and defining a model (the config loader or the model may refuse). */
static sim_status refusal(const char *const *base, int nbase, const char *const *extra, int n_extra)
{
    const char *argv[64];
    int argc = 0;
    for (int i = 0; i < nbase; i++) argv[argc++] = base[i];
    argv[argc++] = "per_device_batch_size=8";
    for (int i = 0; i < n_extra; i++) argv[argc++] = extra[i];
    cfg_config *cfg;
    sim_status st = cfg_load_argv("configs/base.yml", argc, argv, &cfg);
    if (st != SIM_OK) return st;
    model_def *def = calloc(1, sizeof *def);
    st = model_def_from_config(cfg, def);
    cfg_free(cfg);
    model_def_free(def);
    free(def);
    return st;
}

static model_def *load(const char *const *extra, int n, int devices)
{
    return model_run_load(TINY, sizeof TINY / sizeof TINY[0], ROWS, extra, n, devices, 0, NULL);
}

static double run(const model_def *def, const model_grads *pin, model_grads *pout, model_grads *g)
{
    model_run_batch b;
    model_run_batch_make(&b, ROWS, SEQ, VOCAB);
    return model_run_loss_grads(def, b.in, b.tg, b.pos, pin, pout, g);
}

/* Parity of loss and every gradient: 1 device vs two 8-device meshes, auto and explicit. */
static void parity(const char *const *base, int nbase, const char *const *keys, int nkeys, const char *const *meshes,
                   int nmeshes, double *loss_out)
{
    const char *extra[16];
    int n = 0;
    for (int i = 0; i < nkeys; i++) extra[n++] = keys[i];
    model_def *ref_def = model_run_load(base, nbase, ROWS, extra, n, 1, 0, NULL);
    model_grads ref;
    double ref_loss = run(ref_def, NULL, NULL, &ref);
    for (int mi = 0; mi < nmeshes; mi++)
        for (int mode = 0; mode < 2; mode++) {
            int k = n;
            char buf[2][64];
            const char *mesh = meshes[mi];
            /* "a=1 b=2" -> two flags */
            const char *sp = strchr(mesh, ' ');
            if (sp) {
                snprintf(buf[0], sizeof buf[0], "%.*s", (int)(sp - mesh), mesh);
                snprintf(buf[1], sizeof buf[1], "%s", sp + 1);
                extra[k++] = buf[0];
                extra[k++] = buf[1];
            } else extra[k++] = mesh;
            extra[k++] = mode ? "shard_mode=explicit" : "shard_mode=auto";
            model_def *def = model_run_load(base, nbase, ROWS, extra, k, 8, 0, NULL);
            model_grads g;
            double loss = run(def, NULL, NULL, &g);
            if (fabs(loss - ref_loss) > 1e-4 * fabs(ref_loss))
                fail_msg("%s %s %s: loss %.7f vs %.7f", keys[0], mesh, extra[k - 1], loss, ref_loss);
            for (int i = 0; i < def->nparams; i++) {
                double e = model_rel_norm_diff(g.g[i], ref.g[i], g.layer_elems[i] * g.n_layers[i]);
                if (e > 1e-4)
                    fail_msg("%s %s %s: gradient of %s differs by %.3g", keys[0], mesh, extra[k - 1], def->defs[i].path,
                             e);
            }
            model_grads_free(&g);
            model_run_unload(def);
        }
    model_grads_free(&ref);
    model_run_unload(ref_def);
    if (loss_out) *loss_out = ref_loss;
}

static const char *const MESHES[] = {"ici_fsdp_parallelism=4 ici_tensor_parallelism=2",
                                     "ici_data_parallelism=2 ici_fsdp_parallelism=4"};

static double base_loss(void)
{
    model_def *d = load(NULL, 0, 1);
    double l = run(d, NULL, NULL, NULL);
    model_run_unload(d);
    return l;
}

/* Central differences on the largest-gradient elements of every parameter (1 device). */
static void finite_differences(const char *const *keys, int nkeys)
{
    model_def *def = load(keys, nkeys, 1);
    model_grads params, grads;
    run(def, NULL, &params, &grads);
    for (int i = 0; i < def->nparams; i++) {
        int64_t n = params.layer_elems[i] * params.n_layers[i], best = 0;
        for (int64_t j = 1; j < n; j++)
            if (fabsf(grads.g[i][j]) > fabsf(grads.g[i][best])) best = j;
        float g = grads.g[i][best];
        if (fabsf(g) < 1e-4f) continue;
        float saved = params.g[i][best];
        double h = 1e-2;
        params.g[i][best] = saved + (float)h;
        double lp = run(def, &params, NULL, NULL);
        params.g[i][best] = saved - (float)h;
        double lm = run(def, &params, NULL, NULL);
        params.g[i][best] = saved;
        double fd = (lp - lm) / (2 * h);
        if (fabs(fd - g) > 0.02 * fabs(g) + 2e-5)
            fail_msg("%s: %s element %lld: backward %.6g, finite differences %.6g", keys[0], def->defs[i].path,
                     (long long)best, g, fd);
    }
    model_grads_free(&params);
    model_grads_free(&grads);
    model_run_unload(def);
}

/* ------------------------------------------------------------ tied logits, soft caps */

static void test_logits_via_embedding(void **state)
{
    (void)state;
    double l0 = base_loss();
    model_def *untied = load(NULL, 0, 1);
    const char *tied_keys[] = {"logits_via_embedding=true"};
    model_def *tied = load(tied_keys, 1, 1);
    assert_int_equal(tied->nparams, untied->nparams - 1);
    assert_int_equal(model_param_index(tied, "logits_dense.kernel"), -1);
    assert_int_equal(model_param_bytes(untied) - model_param_bytes(tied), 16 * 64 * 4);
    model_run_unload(untied);
    model_run_unload(tied);

    double lt, ln, lc;
    const char *norm[] = {"logits_via_embedding=true"};
    parity(TINY, NTINY, norm, 1, MESHES, 2, &lt);
    const char *raw[] = {"logits_via_embedding=true", "normalize_embedding_logits=false"};
    model_def *d = load(raw, 2, 1);
    ln = run(d, NULL, NULL, NULL);
    model_run_unload(d);
    const char *capped[] = {"logits_via_embedding=true", "final_logits_soft_cap=0.05"};
    parity(TINY, NTINY, capped, 2, MESHES, 2, &lc);
    assert_true(fabs(lt - l0) > 1e-4 && fabs(ln - lt) > 1e-4 && fabs(lc - lt) > 1e-4);
    /* a cap of 0.05 squeezes every logit into (-0.05, 0.05): the loss is within 0.1 of ln(64) */
    assert_true(fabs(lc - log(64.0)) < 0.1 + 0.001 * 20);
    finite_differences(capped, 2);
}

static void test_final_soft_cap_untied_is_nothing(void **state)
{
    (void)state;
    /* MaxText applies final_logits_soft_cap inside the logits_via_embedding branch only */
    const char *k[] = {"final_logits_soft_cap=0.05"};
    model_def *d = load(k, 1, 1);
    double l = run(d, NULL, NULL, NULL);
    model_run_unload(d);
    assert_true(l == base_loss());
}

static void test_attn_logits_soft_cap(void **state)
{
    (void)state;
    double l0 = base_loss(), l;
    /* scores are O(0.1) at init: a cap of 0.1 bends them (and keeps finite differences at h = 1e-2 exact enough) */
    /* the cap is simulated in the blocked (flash) kernel; the dot-product one refuses it */
    const char *k[] = {"attn_logits_soft_cap=0.1", "attention=flash"};
    parity(TINY, NTINY, k, 2, MESHES, 2, &l);
    assert_true(fabs(l - l0) > 1e-5);
    finite_differences(k, 2);
    /* DeepSeek (MLA) with the cap and tied logits */
    const char *ds[] = {"attn_logits_soft_cap=0.5", "logits_via_embedding=true", "attention=flash"};
    /* (no tensor axis: MaxText's MLA norms refuse tensor > 1 in explicit mode, test_models_verdicts) */
    const char *ds_meshes[] = {"ici_fsdp_parallelism=8", "ici_fsdp_parallelism=4 ici_expert_parallelism=2"};
    double lds;
    parity(DS_TINY, sizeof DS_TINY / sizeof DS_TINY[0], ds, 3, ds_meshes, 2, &lds);
    model_def *plain = model_run_load(DS_TINY, sizeof DS_TINY / sizeof DS_TINY[0], ROWS, NULL, 0, 1, 0, NULL);
    double lp = run(plain, NULL, NULL, NULL);
    model_run_unload(plain);
    assert_true(fabs(lds - lp) > 1e-5);
}

/* ------------------------------------------------------------ RoPE, query init, scale */

static void test_rope_linear_scaling(void **state)
{
    (void)state;
    const char *k[] = {"rope_linear_scaling_factor=4"};
    double l;
    parity(TINY, NTINY, k, 1, MESHES, 1, &l);
    assert_true(fabs(l - base_loss()) > 1e-6);
    const char *same[] = {"rope_min_timescale=4", "rope_max_timescale=40000"};
    model_def *d = load(same, 2, 1);
    double ls = run(d, NULL, NULL, NULL);
    model_run_unload(d);
    assert_true(fabs(ls - l) <= 1e-6 * fabs(l));
}

static void test_use_qk_norm_query_init(void **state)
{
    (void)state;
    model_def *a = load(NULL, 0, 1);
    const char *k[] = {"use_qk_norm=true"};
    model_def *b = load(k, 1, 1);
    model_grads pa, pb;
    run(a, NULL, &pa, NULL);
    double lb = run(b, NULL, &pb, NULL);
    assert_true(fabs(lb - base_loss()) > 1e-6);
    int q = model_param_index(a, "self_attention.query.kernel");
    for (int i = 0; i < a->nparams; i++) {
        int64_t n = pa.layer_elems[i] * pa.n_layers[i];
        for (int64_t j = 0; j < n; j++) {
            double want = i == q ? pa.g[i][j] * sqrt(8.0) : pa.g[i][j];
            assert_true(fabs(pb.g[i][j] - want) <= 1e-6 * fabs(want) + 1e-12);
        }
    }
    model_grads_free(&pa);
    model_grads_free(&pb);
    model_run_unload(a);
    model_run_unload(b);
}

static void test_global_parameter_scale(void **state)
{
    (void)state;
    /* MaxText: log2(s) = 3 base + rem; heads, mlp x 2^(base + (rem > 0)); emb x 2^(base + (rem > 1));
     * layers x 2^base */
    const struct {
        const char *key;
        int64_t emb, heads, kv, mlp, layers;
    } want[] = {
        {"global_parameter_scale=1", 16, 4, 2, 24, 2},
        {"global_parameter_scale=2", 16, 8, 4, 48, 2},
        {"global_parameter_scale=4", 32, 8, 4, 48, 2},
        {"global_parameter_scale=8", 32, 8, 4, 48, 4},
    };
    for (int i = 0; i < 4; i++) {
        model_def *d = load(&want[i].key, 1, 1);
        assert_int_equal(d->d.emb, want[i].emb);
        assert_int_equal(d->d.q_heads, want[i].heads);
        assert_int_equal(d->d.kv_heads, want[i].kv);
        assert_int_equal(d->d.mlp, want[i].mlp);
        assert_int_equal(d->d.layers, want[i].layers);
        model_run_unload(d);
    }
    const char *bad[] = {"global_parameter_scale=3"};
    assert_int_equal(refusal(TINY, NTINY, bad, 1), SIM_ERR_INPUT);
    assert_non_null(strstr(sim_errmsg(), "global_parameter_scale=3"));
    assert_non_null(strstr(sim_errmsg(), "power of two"));
    const char *two[] = {"global_parameter_scale=2"};
    double l;
    parity(TINY, NTINY, two, 1, MESHES, 1, &l);
}

static void test_logits_dot_in_fp32_is_float32_already(void **state)
{
    (void)state;
    const char *k[] = {"logits_dot_in_fp32=true"};
    model_def *d = load(k, 1, 1);
    double l = run(d, NULL, NULL, NULL);
    model_run_unload(d);
    assert_true(l == base_loss());
}

static size_t peak_of(const char *const *keys, int nkeys, int devices, bool dry, model_grads *g);

/* ------------------------------------------------------------ fused_mlp */

static void test_fused_mlp(void **state)
{
    (void)state;
    const char *k[] = {"fused_mlp=true"};
    model_def *a = load(NULL, 0, 1), *b = load(k, 1, 1);
    int wi = model_param_index(b, "mlp.wi.kernel");
    assert_true(wi >= 0 && model_param_index(b, "mlp.wi_0.kernel") < 0);
    /* (embed, layers, num_activations, mlp) = (16, 2, 2, 24): the bytes of wi_0 and wi_1 together */
    assert_int_equal(b->defs[wi].rank, 4);
    assert_true(b->defs[wi].shape[0] == 16 && b->defs[wi].shape[1] == 2 && b->defs[wi].shape[2] == 2 &&
                b->defs[wi].shape[3] == 24);
    assert_int_equal(model_param_bytes(a), model_param_bytes(b));
    model_run_unload(a);
    model_run_unload(b);
    double l;
    parity(TINY, NTINY, k, 1, MESHES, 2, &l);
    assert_true(fabs(l - base_loss()) > 1e-6); /* another kernel, another init */
    finite_differences(k, 1);
    /* remat_policy=custom mlpwi=device keeps the fused product (2 x 24 floats per token) of the other layer */
    const char *full[] = {"fused_mlp=true", "remat_policy=full"},
               *keep[] = {"fused_mlp=true", "remat_policy=custom", "mlpwi=device"};
    size_t pf = peak_of(full, 2, 1, false, NULL), pk = peak_of(keep, 3, 1, false, NULL);
    if (pk != pf + (size_t)2 * ROWS * SEQ * 48 * ACT) fail_msg("mlpwi=device: peak %zu, full %zu", pk, pf);
    const char *ds[] = {"fused_mlp=true"};
    assert_int_equal(refusal(DS_TINY, sizeof DS_TINY / sizeof DS_TINY[0], ds, 1), SIM_ERR_INPUT);
    assert_non_null(strstr(sim_errmsg(), "fused_mlp"));
}

/* ------------------------------------------------------------ fused_qkv */

/* TINY's attention: H = 4 query heads, K = 2 kv heads, head_dim 8, emb 16, 2 layers. */
enum { QH = 4, KH = 2, HD = 8, EMB = 16, FH = QH + 2 * KH };

/* The fused head that MaxText's split_qkv turns into query (part 0), key (1) or value (2) head j
 * when k shards hold the fused heads dim: shard t keeps fused heads [t FH/k, (t+1) FH/k) and
 * splits them in the global ratio, H/k query heads, then K/k key heads, then K/k value heads. */
static int fused_head(int part, int j, int k)
{
    int n = part == 0 ? QH : KH, per = n / k, t = j / per, i = j % per;
    int at = part == 0 ? 0 : part == 1 ? QH / k : QH / k + KH / k;
    return t * (FH / k) + at + i;
}

/* Unfused parameters (layout of model_grads) from fused ones: q/k/v kernels taken from the fused
 * kernel's heads as k shards split them; every other parameter copied by path. */
static void unfuse(const model_def *fd, const model_grads *f, const model_def *ud, model_grads *u, int k)
{
    model_grads_alloc(ud, u);
    int fq = model_param_index(fd, "self_attention.qkv_proj.kernel");
    for (int i = 0; i < ud->nparams; i++) {
        const char *path = ud->defs[i].path;
        int part = strstr(path, "self_attention.query.")   ? 0
                   : strstr(path, "self_attention.key.")   ? 1
                   : strstr(path, "self_attention.value.") ? 2
                                                           : -1;
        if (part < 0) {
            int j = model_param_index(fd, path);
            assert_true(j >= 0);
            memcpy(u->g[i], f->g[j], sizeof(float) * (size_t)(u->layer_elems[i] * u->n_layers[i]));
            continue;
        }
        int n = part == 0 ? QH : KH;
        for (int l = 0; l < u->n_layers[i]; l++)
            for (int e = 0; e < EMB; e++)
                for (int h = 0; h < n; h++)
                    memcpy(u->g[i] + l * u->layer_elems[i] + ((int64_t)e * n + h) * HD,
                           f->g[fq] + l * f->layer_elems[fq] + ((int64_t)e * FH + fused_head(part, h, k)) * HD,
                           sizeof(float) * HD);
    }
}

static void expect_same(const model_def *def, double la, const model_grads *a, double lb, const model_grads *b,
                        double tol, const char *what)
{
    if (fabs(la - lb) > tol * fabs(lb)) fail_msg("%s: loss %.7f vs %.7f", what, la, lb);
    for (int i = 0; i < def->nparams; i++) {
        double e = model_rel_norm_diff(a->g[i], b->g[i], a->layer_elems[i] * a->n_layers[i]);
        if (e > tol) fail_msg("%s: gradient of %s differs by %.3g", what, def->defs[i].path, e);
    }
}

static void test_fused_qkv(void **state)
{
    (void)state;
    const char *k[] = {"fused_qkv=true"};
    model_def *u = load(NULL, 0, 1), *f = load(k, 1, 1);
    int qkv = model_param_index(f, "self_attention.qkv_proj.kernel");
    assert_true(qkv >= 0 && model_param_index(f, "self_attention.query.kernel") < 0 &&
                model_param_index(f, "self_attention.key.kernel") < 0);
    /* (embed_attn, layers, heads, kv) = (16, 2, 4 + 2 x 2, 8): the bytes of query, key and value together */
    assert_int_equal(f->defs[qkv].rank, 4);
    assert_true(f->defs[qkv].shape[0] == EMB && f->defs[qkv].shape[1] == 2 && f->defs[qkv].shape[2] == FH &&
                f->defs[qkv].shape[3] == HD);
    assert_string_equal(f->defs[qkv].logical[2], "heads");
    assert_int_equal(model_param_bytes(u), model_param_bytes(f));
    /* the same weights unfused give the same loss and gradients (one shard on the heads dim) */
    model_grads pf, gf, pu, gu;
    double lf = run(f, NULL, &pf, &gf);
    unfuse(f, &pf, u, &pu, 1);
    double lu = run(u, &pu, NULL, &gu);
    model_grads gfu;
    unfuse(f, &gf, u, &gfu, 1);
    expect_same(u, lu, &gu, lf, &gfu, 1e-5, "fused vs unfused, tensor=1");
    model_grads_free(&gu);
    model_grads_free(&gfu);
    /* tensor=2: each shard splits its own 4 fused heads (2 query, 1 key, 1 value): the same
     * weights now mean another unfused model, derived by hand in fused_head */
    const char *t2[] = {"fused_qkv=true", "ici_fsdp_parallelism=1", "ici_tensor_parallelism=2"};
    model_def *f2 = load(t2, 3, 2);
    model_grads g2, pu2;
    double l2 = run(f2, &pf, NULL, &g2);
    unfuse(f, &pf, u, &pu2, 2);
    lu = run(u, &pu2, NULL, &gu);
    unfuse(f, &g2, u, &gfu, 2);
    expect_same(u, lu, &gu, l2, &gfu, 1e-5, "fused tensor=2 vs unfused with the per-shard split");
    assert_true(fabs(l2 - lf) > 1e-4); /* the split depends on the mesh, as in MaxText */
    /* parity among meshes with the same heads sharding, auto and explicit */
    const char *m8[][5] = {
        {"fused_qkv=true", "ici_fsdp_parallelism=4", "ici_tensor_parallelism=2", "shard_mode=auto"},
        {"fused_qkv=true", "ici_data_parallelism=4", "ici_fsdp_parallelism=1", "ici_tensor_parallelism=2",
         "shard_mode=explicit"},
        {"fused_qkv=true", "ici_data_parallelism=2", "ici_fsdp_parallelism=4", "shard_mode=explicit"},
    };
    for (int c = 0; c < 3; c++) {
        static const int n8[] = {4, 5, 4};
        model_def *d8 = load(m8[c], n8[c], 8);
        model_grads g8;
        double l8 = run(d8, &pf, NULL, &g8);
        if (c < 2) expect_same(f, l8, &g8, l2, &g2, 1e-4, m8[c][2]);
        else expect_same(f, l8, &g8, lf, &gf, 1e-4, m8[c][2]);
        model_grads_free(&g8);
        model_run_unload(d8);
    }
    parity(TINY, NTINY, k, 1, (const char *const[]){"ici_data_parallelism=2 ici_fsdp_parallelism=4"}, 1, NULL);
    finite_differences(k, 1);
    model_grads_free(&gu);
    model_grads_free(&gfu);
    model_grads_free(&g2);
    model_grads_free(&pu2);
    model_grads_free(&pf);
    model_grads_free(&gf);
    model_grads_free(&pu);
    model_run_unload(f2);
    model_run_unload(u);
    model_run_unload(f);
    /* remat_policy=custom qkv_proj=device keeps the fused product (8 x 8 floats per token) of the other layer */
    const char *full[] = {"fused_qkv=true", "remat_policy=full"},
               *keep[] = {"fused_qkv=true", "remat_policy=custom", "qkv_proj=device"};
    size_t pfull = peak_of(full, 2, 1, false, NULL), pk = peak_of(keep, 3, 1, false, NULL);
    if (pk != pfull + (size_t)2 * ROWS * SEQ * FH * HD * ACT)
        fail_msg("qkv_proj=device: peak %zu, full %zu", pk, pfull);
    const char *ds[] = {"fused_qkv=true"};
    assert_int_equal(refusal(DS_TINY, sizeof DS_TINY / sizeof DS_TINY[0], ds, 1), SIM_ERR_INPUT);
    assert_non_null(strstr(sim_errmsg(), "fused_qkv"));
    assert_non_null(strstr(sim_errmsg(), "MLA"));
}

/* ------------------------------------------------------------ dropout */

static void test_dropout(void **state)
{
    (void)state;
    double l0 = base_loss(), l;
    const char *k[] = {"dropout_rate=0.3"};
    const char *meshes[] = {"ici_fsdp_parallelism=4 ici_tensor_parallelism=2",
                            "ici_data_parallelism=4 ici_tensor_parallelism=2"};
    parity(TINY, NTINY, k, 1, meshes, 2, &l);
    assert_true(fabs(l - l0) > 1e-3);
    finite_differences(k, 1); /* the mask is fixed for a step: the loss is smooth in the parameters */
    /* enable_dropout=false trains without dropout, as MaxText's deterministic=True */
    const char *off[] = {"dropout_rate=0.3", "enable_dropout=false"};
    model_def *d = load(off, 2, 1);
    assert_true(run(d, NULL, NULL, NULL) == l0);
    model_run_unload(d);
    /* remat recomputes the same mask: remat_policy=none over unscanned layers (no recomputation)
     * gives the same loss and gradients */
    const char *full[] = {"dropout_rate=0.3"},
               *none[] = {"dropout_rate=0.3", "remat_policy=none", "scan_layers=false"};
    model_def *a = load(full, 1, 1), *b = load(none, 3, 1);
    model_grads ga, gb;
    double la = run(a, NULL, NULL, &ga), lb = run(b, NULL, NULL, &gb);
    assert_true(fabs(la - lb) <= 1e-6 * fabs(la));
    for (int i = 0; i < ga.n; i++)
        assert_true(model_rel_norm_diff(ga.g[i], gb.g[i], ga.layer_elems[i] * ga.n_layers[i]) < 1e-6);
    model_grads_free(&ga);
    model_grads_free(&gb);
    model_run_unload(a);
    model_run_unload(b);
    /* DeepSeek: parity with dropout (dense MLP, shared experts and layer outputs) */
    const char *ds[] = {"dropout_rate=0.2"};
    const char *ds_meshes[] = {"ici_fsdp_parallelism=4 ici_expert_parallelism=2"};
    parity(DS_TINY, sizeof DS_TINY / sizeof DS_TINY[0], ds, 1, ds_meshes, 1, NULL);
}

/* ------------------------------------------------------------ layer layout */

/* A tensor of a safetensors file: its shape and float32 data (malloc'd), or NULL if absent. */
static float *st_tensor(const char *file, const char *name, int *rank, int64_t *shape)
{
    FILE *f = fopen(file, "rb");
    assert_non_null(f);
    uint64_t n;
    assert_int_equal(fread(&n, 8, 1, f), 1);
    char *h = malloc(n + 1);
    assert_int_equal(fread(h, 1, n, f), n);
    h[n] = 0;
    json_t *root = json_loads(h, 0, NULL);
    assert_non_null(root);
    json_t *e = json_object_get(root, name);
    float *data = NULL;
    if (e) {
        json_t *sh = json_object_get(e, "shape"), *off = json_object_get(e, "data_offsets");
        *rank = (int)json_array_size(sh);
        for (int i = 0; i < *rank; i++) shape[i] = json_integer_value(json_array_get(sh, (size_t)i));
        int64_t b = json_integer_value(json_array_get(off, 0)), end = json_integer_value(json_array_get(off, 1));
        data = malloc((size_t)(end - b));
        fseek(f, (long)(8 + n + (uint64_t)b), SEEK_SET);
        assert_int_equal(fread(data, 1, (size_t)(end - b), f), (size_t)(end - b));
    }
    json_decref(root);
    free(h);
    fclose(f);
    return data;
}

static int train_cli(const char *dir, const char *const *extra, int n)
{
    const char *argv[40];
    int argc = 0;
    for (int i = 0; i < NTINY; i++) argv[argc++] = TINY[i];
    argv[argc++] = "per_device_batch_size=1";
    argv[argc++] = "ici_fsdp_parallelism=4";
    argv[argc++] = "ici_tensor_parallelism=2";
    argv[argc++] = "steps=1";
    char ck[256];
    snprintf(ck, sizeof ck, "checkpoint_dir=%s", dir);
    argv[argc++] = ck;
    argv[argc++] = "checkpoint_period=1";
    for (int i = 0; i < n; i++) argv[argc++] = extra[i];
    cli_capture r = cli_capture_run(cli_train, argc, argv);
    int rc = r.rc;
    if (rc) print_message("%s\n", r.err);
    cli_capture_free(&r);
    return rc;
}

static void test_layer_layout(void **state)
{
    (void)state;
    char base[] = "/tmp/shardsim-keys-XXXXXX";
    assert_non_null(mkdtemp(base));
    char d0[300], d1[300], d2[300], d3[300], d4[300], f0[340], f1[340], f2[340];
    snprintf(d0, sizeof d0, "%s/scanned", base);
    snprintf(d1, sizeof d1, "%s/axis0", base);
    snprintf(d2, sizeof d2, "%s/unscanned", base);
    snprintf(d3, sizeof d3, "%s/reload", base);
    snprintf(d4, sizeof d4, "%s/reload-stacked", base); /* d3 holds a checkpoint now: it would resume */
    const char *axis0[] = {"param_scan_axis=0"}, *unscanned[] = {"scan_layers=false"};
    assert_int_equal(train_cli(d0, NULL, 0), 0);
    assert_int_equal(train_cli(d1, axis0, 1), 0);
    assert_int_equal(train_cli(d2, unscanned, 1), 0);
    /* after one step (the same training in every layout; MaxText names it step 0) */
    snprintf(f0, sizeof f0, "%s/step_0.safetensors", d0);
    snprintf(f1, sizeof f1, "%s/step_0.safetensors", d1);
    snprintf(f2, sizeof f2, "%s/step_0.safetensors", d2);
    int r0, r1, r2;
    int64_t s0[8], s1[8], s2[8];
    const char *q = "params.decoder.layers.self_attention.query.kernel";
    float *a = st_tensor(f0, q, &r0, s0), *b = st_tensor(f1, q, &r1, s1);
    assert_non_null(a);
    assert_non_null(b);
    assert_null(st_tensor(f2, q, &r2, s2)); /* unscanned: no stacked tensor */
    /* default (E, L, H, D) = (16, 2, 4, 8); axis 0: (L, E, H, D) */
    assert_int_equal(r0, 4);
    assert_true(s0[0] == 16 && s0[1] == 2 && s0[2] == 4 && s0[3] == 8);
    assert_true(r1 == 4 && s1[0] == 2 && s1[1] == 16 && s1[2] == 4 && s1[3] == 8);
    for (int l = 0; l < 2; l++) {
        char name[128];
        snprintf(name, sizeof name, "params.decoder.layers_%d.self_attention.query.kernel", l);
        float *c = st_tensor(f2, name, &r2, s2);
        assert_non_null(c);
        assert_true(r2 == 3 && s2[0] == 16 && s2[1] == 4 && s2[2] == 8);
        for (int e = 0; e < 16; e++)
            for (int hd = 0; hd < 32; hd++) {
                float want = a[(e * 2 + l) * 32 + hd];
                assert_true(b[(l * 16 + e) * 32 + hd] == want);
                assert_true(c[e * 32 + hd] == want);
            }
        free(c);
        /* and the Adam moments under the same names */
        snprintf(name, sizeof name, "opt_state.mu.params.decoder.layers_%d.mlp.wo.kernel", l);
        c = st_tensor(f2, name, &r2, s2);
        assert_non_null(c);
        free(c);
    }
    free(a);
    free(b);
    /* an unscanned checkpoint loads into an unscanned model; the stacked one does not */
    char lp[400];
    snprintf(lp, sizeof lp, "load_parameters_path=%s", f2);
    const char *reload[] = {"scan_layers=false", lp};
    assert_int_equal(train_cli(d3, reload, 2), 0);
    snprintf(lp, sizeof lp, "load_parameters_path=%s", f0);
    assert_int_equal(train_cli(d4, reload, 2), 2);
    /* ZeRO-1 is simulated for the default layout only */
    const char *z1[] = {"scan_layers=false", "shard_optimizer_over_data=true", "ici_data_parallelism=2"};
    assert_int_equal(refusal(TINY, NTINY, z1, 3), SIM_ERR_INPUT);
    assert_non_null(strstr(sim_errmsg(), "scan_layers=false"));
    char cmd[400];
    snprintf(cmd, sizeof cmd, "rm -rf %s", base);
    assert_int_equal(system(cmd), 0);
}

/* ------------------------------------------------------------ remat policies */

/* Device 0's peak bytes and the gradients of one step (1 device, or 8 with fsdp=8). */
static size_t peak_of(const char *const *keys, int nkeys, int devices, bool dry, model_grads *g)
{
    const char *extra[16];
    int n = 0;
    for (int i = 0; i < nkeys; i++) extra[n++] = keys[i];
    extra[n++] = "base_num_decoder_layers=3";
    if (devices == 8) extra[n++] = "ici_fsdp_parallelism=8";
    if (dry) extra[n++] = "dry_run=true";
    model_def *def = load(extra, n, devices);
    model_run_batch b;
    model_run_batch_make(&b, ROWS, SEQ, VOCAB);
    sim_machine *m;
    assert_int_equal(model_machine_new(def, 0, false, &m), SIM_OK);
    double loss;
    sim_status st = model_loss_and_grads(def, m, b.in, b.tg, b.pos, &loss, g);
    if (st != SIM_OK) fail_msg("%s: %s", keys[0], sim_errmsg());
    sim_arena_stats sa;
    sim_arena_get_stats(sim_device_arena(sim_machine_device(m, 0)), &sa);
    sim_machine_free(m);
    model_run_unload(def);
    return sa.peak;
}

static void test_remat_policies(void **state)
{
    (void)state;
    /* per layer, per device (8 rows x 16 tokens / devices), float32: q 4 heads x 8, k and v 2 x 8,
     * out_proj 16, mlpwi_0/1 24, mlpwo 16 */
    const struct {
        const char *policy[3];
        int floats_per_token; /* saved per token and layer */
    } cases[] = {
        {{"remat_policy=save_qkv_proj"}, 32 + 16 + 16},
        {{"remat_policy=save_out_proj"}, 16},
        {{"remat_policy=save_dot_except_mlp"}, 32 + 16 + 16 + 16},
        {{"remat_policy=save_dot_with_context_except_mlp"}, 32 + 16 + 16 + 16}, /* no context tag with dot_product */
        {{"remat_policy=save_dot_except_mlpwi"}, 32 + 16 + 16 + 16 + 16},
        {{"remat_policy=minimal"}, 32 + 16 + 16 + 16 + 24 + 24 + 16},
        {{"remat_policy=minimal_with_context"}, 32 + 16 + 16 + 16 + 24 + 24 + 16},
        {{"remat_policy=qkv_proj_offloaded"}, 0},
        {{"remat_policy=minimal_offloaded"}, 0},
        {{"remat_policy=custom", "query_proj=device", "mlpwo=offload"}, 32},
        {{"remat_policy=custom", "mlpwi_0=device", "attention_out=device"}, 24 + 32},
    };
    for (int devices = 1; devices <= 8; devices += 7) {
        model_grads gf;
        const char *full[] = {"remat_policy=full"};
        size_t pf = peak_of(full, 1, devices, false, &gf);
        int64_t tokens = ROWS * SEQ / devices;
        for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
            int nk = 0;
            while (nk < 3 && cases[c].policy[nk]) nk++;
            model_grads g;
            size_t p = peak_of(cases[c].policy, nk, devices, false, &g);
            for (int i = 0; i < g.n; i++)
                if (memcmp(g.g[i], gf.g[i], (size_t)(g.layer_elems[i] * g.n_layers[i]) * sizeof(float)))
                    fail_msg("%s: gradient %d differs from remat_policy=full", cases[c].policy[0], i);
            model_grads_free(&g);
            /* at the peak (the last layer's backward) the two other layers' saved tensors are alive */
            size_t want = pf + (size_t)(2 * tokens * cases[c].floats_per_token * ACT);
            if (p != want)
                fail_msg(
                    "%d devices, %s %s: peak %zu bytes, want %zu (full %zu + 2 layers x %d elements x %lld tokens)",
                    devices, cases[c].policy[0], nk > 1 ? cases[c].policy[1] : "", p, want, pf,
                    cases[c].floats_per_token, (long long)tokens);
            if (devices == 8 && c == 5) assert_true(peak_of(cases[c].policy, nk, devices, true, NULL) == p);
        }
        model_grads_free(&gf);
    }
    /* DeepSeek (one dense and one MoE layer, 1 device): save_dot_except_mlp keeps MLA's query and key
     * (4 heads x (8 nope + 4 rope)), value (4 x 8) and out_proj (32) of the first layer while the
     * second runs its backward */
    {
        const char *dfull[] = {"remat_policy=full"}, *dsave[] = {"remat_policy=save_dot_except_mlp"};
        size_t peaks[2];
        model_grads gd[2];
        for (int v = 0; v < 2; v++) {
            model_def *def =
                model_run_load(DS_TINY, sizeof DS_TINY / sizeof DS_TINY[0], ROWS, v ? dsave : dfull, 1, 1, 0, NULL);
            model_run_batch b;
            model_run_batch_make(&b, ROWS, SEQ, VOCAB);
            sim_machine *m;
            assert_int_equal(model_machine_new(def, 0, false, &m), SIM_OK);
            double loss;
            assert_int_equal(model_loss_and_grads(def, m, b.in, b.tg, b.pos, &loss, &gd[v]), SIM_OK);
            sim_arena_stats sa;
            sim_arena_get_stats(sim_device_arena(sim_machine_device(m, 0)), &sa);
            peaks[v] = sa.peak;
            sim_machine_free(m);
            model_run_unload(def);
        }
        for (int i = 0; i < gd[0].n; i++)
            assert_memory_equal(gd[0].g[i], gd[1].g[i],
                                (size_t)(gd[0].layer_elems[i] * gd[0].n_layers[i]) * sizeof(float));
        size_t want = peaks[0] + (size_t)ROWS * SEQ * (48 + 48 + 32 + 32) * ACT;
        if (peaks[1] != want)
            fail_msg("deepseek save_dot_except_mlp: peak %zu, want %zu (full %zu)", peaks[1], want, peaks[0]);
        model_grads_free(&gd[0]);
        model_grads_free(&gd[1]);
    }
    /* none over scanned layers is full remat (MaxText wraps each scanned layer in
     * jax.checkpoint(policy=None)): the same peak as full; only 0.2.5's unscanned loop calls
     * the layers without a checkpoint, keeping more than any policy; 0.2.0 remats there too */
    const char *none[] = {"remat_policy=none"}, *minimal[] = {"remat_policy=minimal"},
               *fullp[] = {"remat_policy=full"};
    const char *none_unscanned[] = {"remat_policy=none", "scan_layers=false"},
               *full_unscanned[] = {"remat_policy=full", "scan_layers=false"},
               *none_020[] = {"remat_policy=none", "scan_layers=false", "maxtext_release=0.2.0"},
               *full_020[] = {"remat_policy=full", "scan_layers=false", "maxtext_release=0.2.0"};
    size_t pfull = peak_of(fullp, 1, 1, false, NULL);
    assert_true(pfull < peak_of(minimal, 1, 1, false, NULL));
    assert_int_equal(peak_of(none, 1, 1, false, NULL), pfull);
    assert_int_equal(peak_of(full_unscanned, 2, 1, false, NULL), pfull);
    assert_true(peak_of(none_unscanned, 2, 1, false, NULL) > peak_of(minimal, 1, 1, false, NULL));
    assert_int_equal(peak_of(none_020, 3, 1, false, NULL), peak_of(full_020, 3, 1, false, NULL));
    /* unknown policies are refused (DeepSeek's MoE tags: test_models_dsremat) */
    const char *bad[] = {"remat_policy=save_everything"};
    assert_int_equal(refusal(TINY, NTINY, bad, 1), SIM_ERR_INPUT);
    assert_non_null(strstr(sim_errmsg(), "save_everything"));
    const char *off[] = {"remat_policy=custom", "decoder_layer_input=offload"};
    assert_int_equal(refusal(TINY, NTINY, off, 2), SIM_ERR_INPUT);
    assert_non_null(strstr(sim_errmsg(), "decoder_layer_input"));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_logits_via_embedding),
        cmocka_unit_test(test_final_soft_cap_untied_is_nothing),
        cmocka_unit_test(test_attn_logits_soft_cap),
        cmocka_unit_test(test_rope_linear_scaling),
        cmocka_unit_test(test_use_qk_norm_query_init),
        cmocka_unit_test(test_global_parameter_scale),
        cmocka_unit_test(test_logits_dot_in_fp32_is_float32_already),
        cmocka_unit_test(test_fused_mlp),
        cmocka_unit_test(test_fused_qkv),
        cmocka_unit_test(test_dropout),
        cmocka_unit_test(test_layer_layout),
        cmocka_unit_test(test_remat_policies),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
