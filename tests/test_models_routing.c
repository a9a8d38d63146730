/* test_models_routing.c — MaxText 0.2.5's MoE routing semantics in training
 * runs of a small deepseek3-tiny variant (1 dense + 2 MoE layers, 8 experts
 * top-2, sigmoid routing with the gate bias):
 *   - capacity_factor is ignored on the sparse path: capacity_factor=1.0
 *     gives bitwise the losses of capacity_factor=-1 with sparse_matmul=true,
 *     and drops tokens (other losses) with sparse_matmul=false;
 *   - group-limited routing (n_routing_groups=4, topk_routing_group=2):
 *     parity (loss and every gradient, 5 steps, rtol 1e-4) of fsdp=2 x
 *     expert=4 with the 1-device run, in auto and explicit mode;
 *   - refusals naming the key (bad groups). */
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

#include "model_run.h"

static const char *const TINY[] = {
    "model_name=deepseek3-tiny", "override_model_config=true", "base_emb_dim=32",       "base_num_query_heads=4",
    "base_num_kv_heads=4",       "base_mlp_dim=48",            "base_moe_mlp_dim=16",   "base_num_decoder_layers=3",
    "first_num_dense_layers=1",  "num_experts=8",              "num_experts_per_tok=2", "q_lora_rank=16",
    "kv_lora_rank=8",            "qk_nope_head_dim=8",         "qk_rope_head_dim=4",    "v_head_dim=8",
    "vocab_size=64",             "max_target_length=16",       "init_weights_seed=5",   "learning_rate=3e-3",
    "warmup_steps_fraction=0.0", "load_balance_loss_weight=0.01",
};
enum { NTINY = sizeof TINY / sizeof TINY[0], ROWS = 8, STEPS = 5 };

static void run(model_run *r, const char *const *extra, int n, int devices, bool grads)
{
    model_run_open(r, TINY, NTINY, ROWS, extra, n, devices, STEPS);
    model_run_train(r, grads);
}

/* Loss and every gradient of every step within rtol 1e-4 of the reference. */
static void compare(const char *what, const model_run *a, const model_run *ref)
{
    double worst = 0;
    for (int s = 0; s < STEPS; s++) {
        double l = a->job.stats[s].loss, lr = ref->job.stats[s].loss;
        if (fabs(l - lr) > 1e-4 * fabs(lr)) fail_msg("%s step %d: loss %.7f vs %.7f", what, s, l, lr);
        for (int i = 0; i < a->def->nparams; i++) {
            const model_grads *g = &a->job.step_grads[s], *gr = &ref->job.step_grads[s];
            if (!g->g[i]) continue; /* not trained (the MoEBiasVar gate bias) */
            double e = model_rel_norm_diff(g->g[i], gr->g[i], g->layer_elems[i] * g->n_layers[i]);
            worst = fmax(worst, e);
            if (e > 1e-4) fail_msg("%s step %d: gradient of %s differs by %.3g", what, s, a->def->defs[i].path, e);
        }
    }
    printf("  %s: parity over %d steps, worst gradient difference %.2e\n", what, STEPS, worst);
}

static void test_capacity_ignored_on_sparse_path(void **state)
{
    (void)state;
    const char *dropless[] = {"capacity_factor=-1"}, *cf1[] = {"capacity_factor=1.0"},
               *dense_cf1[] = {"capacity_factor=1.0", "sparse_matmul=false"};
    model_run a, b, c;
    run(&a, dropless, 1, 1, false);
    run(&b, cf1, 1, 1, false);
    run(&c, dense_cf1, 2, 1, false);
    int differ = 0;
    for (int s = 0; s < STEPS; s++) {
        double la = a.job.stats[s].loss, lb = b.job.stats[s].loss;
        if (memcmp(&la, &lb, sizeof la)) fail_msg("step %d: capacity_factor=1 %.9g vs -1 %.9g", s, lb, la);
        differ += c.job.stats[s].loss != la;
    }
    /* capacity ceil(16*2/8)*1 = 4 slots per expert and sequence: the dense path drops tokens */
    printf("  sparse path: capacity_factor=1.0 and -1 give bitwise equal losses; dense path with 1.0: %d of %d "
           "steps differ (%.6f vs %.6f at step 0)\n",
           differ, STEPS, c.job.stats[0].loss, a.job.stats[0].loss);
    assert_int_equal(differ, STEPS);
    model_run_close(&a);
    model_run_close(&b);
    model_run_close(&c);
}

static void test_group_limited_parity(void **state)
{
    (void)state;
    const char *one[] = {"n_routing_groups=4", "topk_routing_group=2"};
    model_run ref, plain;
    run(&ref, one, 2, 1, true);
    run(&plain, NULL, 0, 1, false);
    /* the groups change the routing: the losses leave the ungrouped run's */
    assert_true(fabs(ref.job.stats[STEPS - 1].loss - plain.job.stats[STEPS - 1].loss) > 1e-5);
    model_run_close(&plain);
    for (int mode = 0; mode < 2; mode++) {
        const char *extra[] = {"n_routing_groups=4", "topk_routing_group=2", "ici_fsdp_parallelism=2",
                               "ici_expert_parallelism=4", mode ? "shard_mode=explicit" : "shard_mode=auto"};
        model_run r;
        run(&r, extra, 5, 8, true);
        char what[96];
        snprintf(what, sizeof what, "groups 4/2 fsdp=2 expert=4 %s", extra[4]);
        compare(what, &r, &ref);
        model_run_close(&r);
    }
    model_run_close(&ref);
}

static void expect_refused(const char *const *extra, int n, const char *needle)
{
    const char *argv[64];
    int argc = 0;
    for (int i = 0; i < NTINY; i++) argv[argc++] = TINY[i];
    for (int i = 0; i < n; i++) argv[argc++] = extra[i];
    mesh_cfg *cfg;
    if (mesh_cfg_load_argv("configs/base.yml", argc, argv, &cfg) != SIM_OK) fail_msg("config: %s", sim_errmsg());
    model_def *def = calloc(1, sizeof *def);
    sim_status st = model_def_from_config(cfg, def);
    if (st == SIM_OK) fail_msg("accepted: %s", extra[0]);
    assert_int_equal(st, SIM_ERR_INPUT);
    if (!strstr(sim_errmsg(), needle)) fail_msg("message without '%s': %s", needle, sim_errmsg());
    model_def_free(def);
    free(def);
    mesh_cfg_free(cfg);
}

static void test_refusals(void **state)
{
    (void)state;
    const char *g3[] = {"n_routing_groups=3", "topk_routing_group=1"};
    expect_refused(g3, 2, "n_routing_groups=3");
    const char *k0[] = {"n_routing_groups=4", "topk_routing_group=-1"};
    expect_refused(k0, 2, "topk_routing_group=-1");
    const char *rr[] = {"use_random_routing=true"};
    expect_refused(rr, 1, "When EP rank is 1, use_random_routing must be False");
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_capacity_ignored_on_sparse_path),
        cmocka_unit_test(test_group_limited_parity),
        cmocka_unit_test(test_refusals),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
