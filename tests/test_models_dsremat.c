/* test_models_dsremat.c — remat policies that save MLP and MoE tensors on DeepSeek, on
 * a deepseek3-tiny variant (1 dense + 2 MoE layers, 8 experts top-2, one shared expert):
 *   - peak device memory grows by exactly the tensors MaxText 0.2.5 tags (moe.py, linears.py)
 *     for the layers whose backward has not run at the peak: the dense MLP's and the shared
 *     expert's wi_0/wi_1/wo products (tokens x width), and inside the routed experts the grouped
 *     matmul's products over MaxText's static receive buffer (tokens x min(top_k, local experts)
 *     x ep rows: wi_0 and wi_1 moe_mlp_dim wide, wo emb_dim wide); mlpwi_1 names the routed wi_1
 *     product only on the dense path (sparse_matmul=false); offloaded tensors cost nothing;
 *   - remat does not change numerics: one step's gradients are bitwise those of remat_policy=full;
 *   - parity (5 steps, loss and every gradient within rtol 1e-4 of the 1-device run) with minimal
 *     and save_dot_except_mlpwi on fsdp=2 x expert=2, auto and explicit;
 *   - moe_x_sorted / moe_routing_maps kept are refused, naming the key. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tests/helpers.h"
#include "tests/model_run.h"

/* tests/data/tiny-deepseek.yml (1 dense + 2 MoE layers, 8 experts top-2, MLA with q_lora, sigmoid
 * routing with the bias) with a fixed seed, rate and the load-balance loss (no z-loss) */
static const char *const TINY[] = {TINY_DEEPSEEK_YML, "init_weights_seed=5", "learning_rate=3e-3",
                                   "warmup_steps_fraction=0.0", "load_balance_loss_weight=0.01"};
enum { NTINY = sizeof TINY / sizeof TINY[0], ROWS = 8, SEQ = 16, STEPS = 5 };
/* the model's widths, as TINY sets them */
enum { EMB = 32, MLP = 48, MOE_MLP = 16, SHARED = 1 * MOE_MLP, EXPERTS = 8, TOPK = 2 };
/* bytes of one saved activation element: dtype's default, bfloat16 (configs/base.yml) */
enum { ACT = 2 };

/* Device 0's peak bytes of one forward and backward pass on `devices` devices, and the gradients. */
static size_t peak_on(const char *const *extra, int n, int devices, model_grads *g)
{
    model_run r;
    model_run_open(&r, TINY, NTINY, ROWS, extra, n, devices, 1);
    int32_t in[ROWS * SEQ], tg[ROWS * SEQ], pos[ROWS * SEQ];
    for (int i = 0; i < ROWS * SEQ; i++) {
        in[i] = (int32_t)((i * 7 + 3) % 64);
        tg[i] = (int32_t)((i * 5 + 1) % 64);
        pos[i] = i % SEQ;
    }
    double loss;
    if (model_loss_and_grads(r.def, r.m, in, tg, pos, &loss, g) != SIM_OK) fail_msg("%s: %s", extra[0], sim_errmsg());
    sim_arena_stats sa;
    sim_arena_get_stats(sim_device_arena(sim_machine_device(r.m, 0)), &sa);
    model_run_close(&r);
    return sa.peak;
}

static size_t peak_of(const char *const *extra, int n, model_grads *g) { return peak_on(extra, n, 1, g); }

static void test_saved_bytes(void **state)
{
    (void)state;
    const int64_t tokens = ROWS * SEQ;
    /* the routed experts' grouped-matmul rows on one device: every assignment (1 device holds every
     * expert, so min(top_k, experts) slots per token) */
    const int64_t rows = tokens * (TOPK < EXPERTS ? TOPK : EXPERTS);
    /* elements kept per layer: dense layer (its MLP), MoE layer (shared expert + routed experts) */
    const int64_t d_wi = tokens * MLP, d_wo = tokens * EMB;
    const int64_t s_wi = tokens * SHARED, s_wo = tokens * EMB, r_wi = rows * MOE_MLP, r_wo = rows * EMB;
    const struct {
        const char *keys[4];
        int64_t dense, moe; /* elements saved by the dense layer and by each MoE layer */
        bool attn;          /* plus the attention tags (query/key/value/out_proj) */
    } cases[] = {
        {{"remat_policy=custom", "moe_mlpwi_0=device"}, 0, r_wi, false},
        {{"remat_policy=custom", "moe_mlpwi_1=device"}, 0, r_wi, false},
        {{"remat_policy=custom", "moe_mlpwo=device"}, 0, r_wo, false},
        /* mlpwi_1 tags the routed wi_1 product on the dense path only (moe.py gmm_up vs dense_matmul) */
        {{"remat_policy=custom", "mlpwi_1=device"}, d_wi, s_wi, false},
        {{"remat_policy=custom", "mlpwi_1=device", "sparse_matmul=false", "capacity_factor=-1"},
         d_wi,
         s_wi + tokens * EXPERTS * MOE_MLP,
         false},
        /* two tags on one tensor: saved once */
        {{"remat_policy=custom", "mlpwi_0=device", "moe_mlpwi_0=device"}, d_wi, s_wi + r_wi, false},
        {{"remat_policy=save_dot_except_mlpwi"}, d_wo, s_wo + r_wo, true},
        /* minimal: mlpwi_0, mlpwi_1, mlpwo (the routed wi_1 product is only moe_mlpwi_1 on the sparse path) */
        {{"remat_policy=minimal"}, 2 * d_wi + d_wo, 2 * s_wi + s_wo + r_wi + r_wo, true},
        {{"remat_policy=minimal_with_context"}, 2 * d_wi + d_wo, 2 * s_wi + s_wo + r_wi + r_wo, true},
        {{"remat_policy=custom", "mlpwo=offload", "moe_mlpwi_0=offload"}, 0, 0, false},
    };
    model_grads gf;
    const char *full[] = {"remat_policy=full"};
    size_t pf = peak_of(full, 1, &gf);
    size_t attn = 0; /* save_dot_except_mlpwi's attention tags, measured by save_dot_except_mlp */
    {
        const char *dot[] = {"remat_policy=save_dot_except_mlp"};
        attn = peak_of(dot, 1, NULL) - pf;
    }
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        int nk = 0;
        while (nk < 4 && cases[c].keys[nk]) nk++;
        bool dense_path = nk > 2 && !strcmp(cases[c].keys[2], "sparse_matmul=false");
        model_grads g, gref;
        size_t p = peak_of(cases[c].keys, nk, &g);
        size_t pref = pf;
        model_grads *ref = &gf;
        if (dense_path) { /* against full remat on the same path */
            const char *fd[] = {"remat_policy=full", "sparse_matmul=false", "capacity_factor=-1"};
            pref = peak_of(fd, 3, &gref);
            ref = &gref;
        }
        for (int i = 0; i < g.n; i++)
            if (g.g[i] && memcmp(g.g[i], ref->g[i], (size_t)(g.layer_elems[i] * g.n_layers[i]) * sizeof(float)))
                fail_msg("%s %s: gradient %d differs from remat_policy=full", cases[c].keys[0], cases[c].keys[1], i);
        model_grads_free(&g);
        if (dense_path) model_grads_free(&gref);
        /* at the peak (the last MoE layer's backward) the dense layer's and the first MoE layer's
         * saved tensors are alive */
        size_t want = pref + (size_t)((cases[c].dense + cases[c].moe) * ACT);
        if (cases[c].attn) want += attn;
        printf("  %s %s %s: peak %zu = full %zu + %zu\n", cases[c].keys[0], nk > 1 ? cases[c].keys[1] : "",
               nk > 2 ? cases[c].keys[2] : "", p, pref, p - pref);
        if (p != want)
            fail_msg("%s %s: peak %zu bytes, want %zu (full %zu + dense layer %lld + MoE layer %lld elements)",
                     cases[c].keys[0], nk > 1 ? cases[c].keys[1] : "", p, want, pref, (long long)cases[c].dense,
                     (long long)cases[c].moe);
    }
    model_grads_free(&gf);
    /* fsdp=2 x expert=2: each device holds 128 / 4 = 32 tokens and 8 / 2 = 4 experts; MaxText's
     * receive buffer has ep x tokens x min(top_k, local experts) = 2 x 32 x 2 rows */
    {
        const char *f4[] = {"remat_policy=full", "ici_fsdp_parallelism=2", "ici_expert_parallelism=2"},
                   *k4[] = {"remat_policy=custom", "moe_mlpwi_0=device", "ici_fsdp_parallelism=2",
                            "ici_expert_parallelism=2"};
        size_t p4f = peak_on(f4, 3, 4, NULL), p4 = peak_on(k4, 4, 4, NULL);
        printf("  fsdp=2 expert=2 moe_mlpwi_0=device: peak %zu = full %zu + %zu\n", p4, p4f, p4 - p4f);
        assert_true(p4 == p4f + (size_t)(2 * (tokens / 4) * TOPK * MOE_MLP * ACT));
    }
    /* a dry run accounts the same bytes */
    const char *wet[] = {"remat_policy=minimal"}, *dry[] = {"remat_policy=minimal", "dry_run=true"};
    assert_true(peak_of(dry, 2, NULL) == peak_of(wet, 1, NULL));
}

/* Loss and every gradient of every step within rtol 1e-4 of the reference. */
static void compare(const char *what, const model_run *a, const model_run *ref)
{
    model_run_compare(what, a, ref, STEPS);
}

static void test_parity(void **state)
{
    (void)state;
    /* learning_rate=3e-4 as test_models_routing's parity: at the suite's 3e-3 Adam's first update turns
     * float32 rounding into gradient differences that pass rtol by step 3 with or without remat */
    const char *full[] = {"remat_policy=full", "learning_rate=3e-4"};
    model_run ref;
    model_run_open(&ref, TINY, NTINY, ROWS, full, 2, 1, STEPS);
    model_run_train(&ref, true);
    static const char *const policies[] = {"remat_policy=minimal", "remat_policy=save_dot_except_mlpwi"};
    for (int p = 0; p < 2; p++) {
        /* the same mesh: bitwise the losses of full remat */
        model_run one;
        const char *k1[] = {policies[p], "learning_rate=3e-4"};
        model_run_open(&one, TINY, NTINY, ROWS, k1, 2, 1, STEPS);
        model_run_train(&one, false);
        for (int s = 0; s < STEPS; s++)
            if (memcmp(&one.job.stats[s].loss, &ref.job.stats[s].loss, sizeof(double)))
                fail_msg("%s step %d: loss %.9g, full remat %.9g", policies[p], s, one.job.stats[s].loss,
                         ref.job.stats[s].loss);
        model_run_close(&one);
        for (int mode = 0; mode < 2; mode++) {
            const char *extra[] = {policies[p], "ici_fsdp_parallelism=2", "ici_expert_parallelism=2",
                                   mode ? "shard_mode=explicit" : "shard_mode=auto", "learning_rate=3e-4"};
            model_run r, rf;
            model_run_open(&r, TINY, NTINY, ROWS, extra, 5, 4, STEPS);
            model_run_train(&r, true);
            /* and bitwise the losses of full remat on the same mesh */
            extra[0] = "remat_policy=full";
            model_run_open(&rf, TINY, NTINY, ROWS, extra, 5, 4, STEPS);
            model_run_train(&rf, false);
            for (int s = 0; s < STEPS; s++)
                if (memcmp(&r.job.stats[s].loss, &rf.job.stats[s].loss, sizeof(double)))
                    fail_msg("%s %s step %d: loss %.9g, full remat %.9g", policies[p], extra[3], s, r.job.stats[s].loss,
                             rf.job.stats[s].loss);
            model_run_close(&rf);
            char what[128];
            snprintf(what, sizeof what, "%s fsdp=2 expert=2 %s", policies[p], extra[3]);
            compare(what, &r, &ref);
            model_run_close(&r);
        }
    }
    model_run_close(&ref);
}

static void test_refusals(void **state)
{
    (void)state;
    static const char *const keys[] = {"moe_x_sorted", "moe_routing_maps"};
    for (int i = 0; i < 2; i++) {
        char kv[64];
        snprintf(kv, sizeof kv, "%s=device", keys[i]);
        const char *argv[NTINY + 3];
        int argc = 0;
        for (int j = 0; j < NTINY; j++) argv[argc++] = TINY[j];
        argv[argc++] = "per_device_batch_size=8";
        argv[argc++] = "remat_policy=custom";
        argv[argc++] = kv;
        cfg_config *cfg;
        assert_int_equal(cfg_load_argv("configs/base.yml", argc, argv, &cfg), SIM_OK);
        model_def *def = calloc(1, sizeof *def);
        assert_int_equal(model_def_from_config(cfg, def), SIM_ERR_INPUT);
        assert_non_null(strstr(sim_errmsg(), keys[i]));
        assert_non_null(strstr(sim_errmsg(), "=remat"));
        cfg_free(cfg);
        model_def_free(def);
        free(def);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_saved_bytes),
        cmocka_unit_test(test_parity),
        cmocka_unit_test(test_refusals),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
