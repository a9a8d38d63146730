/* test_models_llama.c — Llama2 end to end on small shapes:
 *   - the whole-model gradient, checked by central finite differences of the
 *     loss on one device;
 *   - parity of the loss and of every parameter gradient with the 1-device
 *     run on the meshes below (data, FSDP, tensor and their mixes), in auto and explicit mode
 *     (tolerance: |loss - ref| <= 1e-4 |ref|, and per parameter
 *     ||g - g_ref|| <= 1e-4 ||g_ref||);
 *   - Llama 3.1's RoPE: it changes the loss, and keeps parity on sharded meshes;
 *   - grouped-query attention whose kv heads cannot split over tensor is
 *     refused with a message naming the fix. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "models/core/train.h"
#include "tests/helpers.h"
#include "tests/model_run.h"

/* tests/data/tiny-llama.yml with a fixed seed and the z-loss */
static const char *const TINY[] = {TINY_LLAMA_YML, "init_weights_seed=7", "z_loss_multiplier=0.001"};
enum { NTINY = sizeof TINY / sizeof TINY[0], ROWS = 8 };

static model_def *load(const char *const *extra, int n_extra, int devices)
{
    model_def *def = model_run_load(TINY, NTINY, ROWS, extra, n_extra, devices, 0, NULL);
    assert_int_equal(def->d.batch, ROWS);
    return def;
}

/* A fixed batch: row r is a walk through the vocabulary; positions 0..T-1,
 * reordered for load-balanced context parallelism when cp > 1 (facts §8). */
typedef struct {
    int32_t in[ROWS * 16], tg[ROWS * 16], pos[ROWS * 16];
} batch;

static void make_batch(batch *b, int T, int V, int cp)
{
    for (int r = 0; r < ROWS; r++)
        for (int t = 0; t < T; t++) {
            b->in[r * T + t] = (r * 5 + t * 3 + (t * t) % 7) % V;
            b->tg[r * T + t] = (r * 5 + (t + 1) * 3 + ((t + 1) * (t + 1)) % 7) % V;
            b->pos[r * T + t] = t;
        }
    if (cp <= 1) return;
    int c = T / (2 * cp);
    int32_t *arrs[3] = {b->in, b->tg, b->pos};
    for (int a = 0; a < 3; a++)
        for (int r = 0; r < ROWS; r++) {
            int32_t tmp[16], *row = arrs[a] + r * T;
            int o = 0;
            for (int dd = 0; dd < cp; dd++) {
                for (int i = 0; i < c; i++) tmp[o++] = row[dd * c + i];
                for (int i = 0; i < c; i++) tmp[o++] = row[(2 * cp - 1 - dd) * c + i];
            }
            memcpy(row, tmp, (size_t)T * sizeof *row);
        }
}

static double run(model_def *def, const batch *b, const model_grads *pin, model_grads *pout, model_grads *g)
{
    sim_machine *m;
    assert_int_equal(model_machine_new(def, 0, false, &m), SIM_OK);
    double loss;
    sim_status st = model_loss_and_grads_from(def, m, b->in, b->tg, b->pos, pin, pout, &loss, g);
    sim_machine_free(m);
    if (st != SIM_OK) fail_msg("run: %s", sim_errmsg());
    return loss;
}

/* ------------------------------------------------------------ gradient check */

static void test_gradient_finite_differences(void **state)
{
    (void)state;
    model_def *def = load(NULL, 0, 1);
    batch b;
    make_batch(&b, 16, 64, 1);
    model_grads params, grads;
    double loss = run(def, &b, NULL, &params, &grads);
    assert_true(loss > 3.0 && loss < 5.5); /* about ln(64) = 4.16 at init */
    int checked = 0;
    for (int i = 0; i < def->nparams; i++) {
        /* the three largest-gradient elements of each parameter */
        int64_t n = params.layer_elems[i] * params.n_layers[i];
        for (int pick = 0; pick < 3; pick++) {
            int64_t best = -1;
            for (int64_t j = 0; j < n; j++) {
                bool taken = false;
                (void)taken;
                if (best < 0 || fabsf(grads.g[i][j]) > fabsf(grads.g[i][best])) best = j;
            }
            float g = grads.g[i][best];
            if (fabsf(g) < 1e-4f) break;
            float saved = params.g[i][best];
            /* float32 loss: a step of 1e-2 keeps the rounding error (~1e-7 * loss / h) far below the tolerance */
            double h = 1e-2;
            params.g[i][best] = saved + (float)h;
            double lp = run(def, &b, &params, NULL, NULL);
            params.g[i][best] = saved - (float)h;
            double lm = run(def, &b, &params, NULL, NULL);
            params.g[i][best] = saved;
            double fd = (lp - lm) / (2 * h);
            /* central differences are exact to O(h^2 f'''): 2% covers it at h = 1e-2 */
            if (fabs(fd - g) > 0.02 * fabs(g) + 2e-5)
                fail_msg("%s element %lld: backward %.6g, finite differences %.6g", def->defs[i].path, (long long)best,
                         g, fd);
            checked++;
            grads.g[i][best] = 0; /* next pick */
        }
    }
    assert_true(checked >= 2 * def->nparams);
    model_grads_free(&params);
    model_grads_free(&grads);
    model_run_unload(def);
}

/* ------------------------------------------------------------ parity */

typedef struct {
    const char *label;
    const char *flags[6];
    int devices;
    int cp;
    const char *explicit_err; /* MaxText 0.2.5 cannot trace it in explicit mode: the error expected */
} mesh_case;

/* The two explicit-mode failures are MaxText 0.2.5's (tests/data/maxtext-0.2.5/verdicts rows L09-L14):
 * dot-product attention (T = 16 < 128) with the sequence sharded, and the layer scan's carry with
 * tensor_sequence; their parity is checked in auto mode. */
static const mesh_case MESHES[] = {
    {"data=8", {"ici_data_parallelism=8", "ici_fsdp_parallelism=1"}, 8, 1, NULL},
    {"fsdp=8", {"ici_fsdp_parallelism=8"}, 8, 1, NULL},
    {"fsdp=4 tensor=2", {"ici_fsdp_parallelism=4", "ici_tensor_parallelism=2"}, 8, 1, NULL},
    {"data=2 fsdp=2 tensor=2",
     {"ici_data_parallelism=2", "ici_fsdp_parallelism=2", "ici_tensor_parallelism=2"},
     8,
     1,
     NULL},
    {"fsdp=2 context=2 tensor=2",
     {"ici_fsdp_parallelism=2", "ici_context_parallelism=2", "ici_tensor_parallelism=2"},
     8,
     2,
     /* key (B=8, S, Hkv=2, D=8), query as (B, T, Hkv, groups=2, D): batch b,k ++ key's s ++ query's t,g */
     "ShardingTypeError: dot_general operation with inputs: f32[8@fsdp,16@context,2@tensor,8], "
     "f32[8@fsdp,16@context,2@tensor,2,8] produces an illegally sharded result: "
     "f32[8@fsdp,2@tensor,16@context,16@context,2]"},
    {"tensor_sequence=2 fsdp=4",
     {"ici_tensor_sequence_parallelism=2", "ici_fsdp_parallelism=4"},
     8,
     1,
     "TypeError: scan body function carry input and carry output must have equal types"},
    {"fsdp_transpose=2 fsdp=4", {"ici_fsdp_transpose_parallelism=2", "ici_fsdp_parallelism=4"}, 8, 1, NULL},
};

static void test_parity_meshes(void **state)
{
    (void)state;
    model_def *ref_def = load(NULL, 0, 1);
    batch b;
    make_batch(&b, 16, 64, 1);
    model_grads ref;
    double ref_loss = run(ref_def, &b, NULL, NULL, &ref);
    for (size_t mi = 0; mi < sizeof MESHES / sizeof MESHES[0]; mi++) {
        for (int mode = 0; mode < 2; mode++) {
            const mesh_case *mc = &MESHES[mi];
            const char *extra[8];
            int n = 0;
            for (int f = 0; f < 6 && mc->flags[f]; f++) extra[n++] = mc->flags[f];
            extra[n++] = mode ? "shard_mode=explicit" : "shard_mode=auto";
            model_def *def = load(extra, n, mc->devices);
            batch bb;
            make_batch(&bb, 16, 64, mc->cp);
            model_grads g;
            if (mode && mc->explicit_err) {
                sim_machine *m;
                assert_int_equal(model_machine_new(def, 0, false, &m), SIM_OK);
                double l;
                sim_status st = model_loss_and_grads_from(def, m, bb.in, bb.tg, bb.pos, NULL, NULL, &l, &g);
                sim_machine_free(m);
                model_grads_free(&g); /* allocated before the pass failed */
                assert_int_equal(st, SIM_ERR_SHARDING);
                if (!strstr(sim_errmsg(), mc->explicit_err))
                    fail_msg("%s explicit: expected '%s', got: %s", mc->label, mc->explicit_err, sim_errmsg());
                model_run_unload(def);
                continue;
            }
            double loss = run(def, &bb, NULL, NULL, &g);
            double dl = fabs(loss - ref_loss) / fabs(ref_loss);
            if (dl > 1e-4) fail_msg("%s %s: loss %.7f vs %.7f", mc->label, extra[n - 1], loss, ref_loss);
            for (int i = 0; i < def->nparams; i++) {
                double e = model_rel_norm_diff(g.g[i], ref.g[i], g.layer_elems[i] * g.n_layers[i]);
                if (e > 1e-4)
                    fail_msg("%s %s: gradient of %s differs by %.3g", mc->label, extra[n - 1], def->defs[i].path, e);
            }
            model_grads_free(&g);
            model_run_unload(def);
        }
    }
    model_grads_free(&ref);
    model_run_unload(ref_def);
}

/* Llama 3.1's RoPE (rope_type=llama3.1, as every llama3.1* model name gets it): the tiny model's
 * wavelengths 2 pi 10000^(j/4) = 6.3, 63, 628, 6283 put its last pair in the scaling's blend range,
 * so rope_use_scale=false and the default RoPE each change the loss; the sharded meshes (context
 * parallelism reorders the positions) keep the 1-device loss and gradients. */
static void test_llama31_rope(void **state)
{
    (void)state;
    static const char *const L31[] = {"rope_type=llama3.1"};
    model_def *ref_def = load(L31, 1, 1);
    assert_true(ref_def->d.rope_llama31 && ref_def->d.rope_use_scale);
    batch b;
    make_batch(&b, 16, 64, 1);
    model_grads ref;
    double ref_loss = run(ref_def, &b, NULL, NULL, &ref);
    static const char *const NOSCALE[] = {"rope_type=llama3.1", "rope_use_scale=false"};
    model_def *def = load(NOSCALE, 2, 1);
    double unscaled = run(def, &b, NULL, NULL, NULL);
    model_run_unload(def);
    def = load(NULL, 0, 1);
    assert_false(def->d.rope_llama31);
    double plain = run(def, &b, NULL, NULL, NULL);
    model_run_unload(def);
    printf("  loss: llama3.1 RoPE %.7f, unscaled %.7f, default RoPE %.7f\n", ref_loss, unscaled, plain);
    assert_true(fabs(unscaled - ref_loss) > 1e-6 && fabs(plain - ref_loss) > 1e-6);
    static const char *const MESH[][4] = {
        {"ici_fsdp_parallelism=4", "ici_tensor_parallelism=2"},
        {"ici_fsdp_parallelism=2", "ici_context_parallelism=2", "ici_tensor_parallelism=2"}};
    for (int k = 0; k < 2; k++) {
        const char *extra[5] = {"rope_type=llama3.1"};
        int n = 1;
        for (int f = 0; f < 4 && MESH[k][f]; f++) extra[n++] = MESH[k][f];
        def = load(extra, n, 8);
        batch bb;
        make_batch(&bb, 16, 64, k == 1 ? 2 : 1);
        model_grads g;
        double loss = run(def, &bb, NULL, NULL, &g);
        if (fabs(loss - ref_loss) > 1e-4 * fabs(ref_loss)) fail_msg("mesh %d: loss %.7f vs %.7f", k, loss, ref_loss);
        for (int i = 0; i < def->nparams; i++) {
            double e = model_rel_norm_diff(g.g[i], ref.g[i], g.layer_elems[i] * g.n_layers[i]);
            if (e > 1e-4) fail_msg("mesh %d: gradient of %s differs by %.3g", k, def->defs[i].path, e);
        }
        model_grads_free(&g);
        model_run_unload(def);
    }
    model_grads_free(&ref);
    model_run_unload(ref_def);
}

static void test_gqa_refused(void **state)
{
    (void)state;
    /* 2 kv heads cannot split 4 ways over tensor: refused before anything runs, naming the
     * parameter, the dim, the axis and the fix */
    const char *argv[NTINY + 3];
    int argc = 0;
    for (int i = 0; i < NTINY; i++) argv[argc++] = TINY[i];
    argv[argc++] = "ici_tensor_parallelism=4";
    argv[argc++] = "ici_fsdp_parallelism=1";
    argv[argc++] = "per_device_batch_size=2";
    cfg_config *cfg;
    assert_int_equal(cfg_load_argv("configs/base.yml", argc, argv, &cfg), SIM_OK);
    model_def *def = calloc(1, sizeof *def);
    assert_int_equal(model_def_from_config(cfg, def), SIM_ERR_INPUT);
    assert_non_null(strstr(sim_errmsg(), "self_attention.key.kernel"));
    assert_non_null(strstr(sim_errmsg(), "tensor=4"));
    assert_non_null(strstr(sim_errmsg(), "change the mesh"));
    cfg_free(cfg);
    model_run_unload(def);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_gradient_finite_differences),
        cmocka_unit_test(test_parity_meshes),
        cmocka_unit_test(test_llama31_rope),
        cmocka_unit_test(test_gqa_refused),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
