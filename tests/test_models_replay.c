/* test_models_replay.c — remat's recomputation with the forward's values kept in host memory
 * (remat_recompute=never, mesh/replay.h) against the same run computing them again
 * (remat_recompute=always), two training steps each:
 *   - every loss and every step's gradients are the same bits;
 *   - every collective record (op, phase, tag, axes, dtype, elements, bytes) and every arena
 *     figure (peak, live, allocations, per category) is the same on every device;
 *   - the values were kept (a host peak on every device) with never, none with always, and
 *     none are left once the backward pass has run;
 * on Llama (remat_policy full, minimal, custom; fsdp x tensor; a pipeline of 2 stages) and on
 * DeepSeek (full, minimal, custom, with expert parallelism; the batch-split schedule), where every
 * recomputation stays on the forward's path; and on a Qwen3 mesh whose recomputation places a
 * product differently (auto mode), where the kernels run from there on and the bits still agree. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "mesh/replay.h"
#include "tests/helpers.h"
#include "tests/model_run.h"

enum { STEPS = 2, MAX_EXTRA = 12 };

typedef struct {
    const char *what;
    const char *const *base;
    int nbase;
    int rows, devices;
    const char *extra[MAX_EXTRA];
    unsigned flags; /* model_run_expect_same_records' */
    bool departs;   /* auto mode places a product differently in the recomputation: the kernels run from there */
} replay_case;

static int n_extra(const replay_case *c)
{
    int n = 0;
    while (n < MAX_EXTRA && c->extra[n]) n++;
    return n;
}

/* One run of case c with remat_recompute=mode: trained, gradients kept. */
static void run_mode(const replay_case *c, const char *mode, model_run *r)
{
    const char *ex[MAX_EXTRA + 1];
    int n = n_extra(c);
    for (int i = 0; i < n; i++) ex[i] = c->extra[i];
    ex[n++] = mode;
    model_run_open(r, c->base, c->nbase, c->rows, ex, n, c->devices, STEPS);
    model_run_train(r, true);
}

static void expect_same(const replay_case *c)
{
    model_run a, b; /* a recomputes, b replays */
    run_mode(c, "remat_recompute=always", &a);
    unsigned long departed = mesh_replay_departures();
    run_mode(c, "remat_recompute=never", &b);
    departed = mesh_replay_departures() - departed;
    if (c->departs && !departed) fail_msg("%s: every recomputation stayed on the forward's path", c->what);
    if (!c->departs && departed) fail_msg("%s: %lu recomputations left the forward's path", c->what, departed);
    assert_false(a.def->d.remat_replay);
    assert_true(b.def->d.remat_replay);
    for (int s = 0; s < STEPS; s++) {
        if (memcmp(&a.job.stats[s].loss, &b.job.stats[s].loss, sizeof(double)))
            fail_msg("%s: step %d loss %.17g (recomputed) vs %.17g (replayed)", c->what, s, a.job.stats[s].loss,
                     b.job.stats[s].loss);
        if (memcmp(&a.job.stats[s].grad_norm, &b.job.stats[s].grad_norm, sizeof(double)))
            fail_msg("%s: step %d grad norm differs", c->what, s);
        const model_grads *ga = &a.job.step_grads[s], *gb = &b.job.step_grads[s];
        assert_int_equal(ga->n, gb->n);
        for (int i = 0; i < ga->n; i++) {
            assert_true((ga->g[i] == NULL) == (gb->g[i] == NULL));
            if (!ga->g[i]) continue;
            size_t bytes = (size_t)(ga->layer_elems[i] * ga->n_layers[i]) * sizeof(float);
            if (memcmp(ga->g[i], gb->g[i], bytes))
                fail_msg("%s: step %d gradient of '%s' differs", c->what, s, a.def->defs[i].path);
        }
    }
    model_run_expect_same_records(c->what, &a, &b, c->devices, c->flags);
    for (int d = 0; d < c->devices; d++) {
        sim_arena_stats sa, sb;
        sim_arena_get_stats(sim_device_arena(sim_machine_device(a.m, d)), &sa);
        sim_arena_get_stats(sim_device_arena(sim_machine_device(b.m, d)), &sb);
        if (sa.host_peak != 0) fail_msg("%s: device %d kept values while recomputing", c->what, d);
        if (sb.host_peak == 0) fail_msg("%s: device %d kept no values for its recomputation", c->what, d);
        if (sb.host_live != 0) fail_msg("%s: device %d still holds %zu bytes of values", c->what, d, sb.host_live);
    }
    model_run_close(&a);
    model_run_close(&b);
}

static const char *const LLAMA[] = {SMALL_LLAMA_YML, "init_weights_seed=3", "learning_rate=3e-3"};
static const char *const DS[] = {TINY_DEEPSEEK_YML, "init_weights_seed=5", "learning_rate=3e-3",
                                 "load_balance_loss_weight=0.01"};
enum { NLLAMA = sizeof LLAMA / sizeof LLAMA[0], NDS = sizeof DS / sizeof DS[0] };

static void test_llama(void **state)
{
    (void)state;
    const replay_case cases[] = {
        {"llama full fsdp=2 tensor=2",
         LLAMA,
         NLLAMA,
         8,
         4,
         {"ici_fsdp_parallelism=2", "ici_tensor_parallelism=2"},
         0,
         false},
        /* the projections' recomputation is "dead" (XLA leaves it out), yet the simulator reads the
         * recomputed twins of the offloaded tensors */
        {"llama qkv_proj_offloaded",
         LLAMA,
         NLLAMA,
         8,
         2,
         {"ici_fsdp_parallelism=2", "remat_policy=qkv_proj_offloaded"},
         0,
         false},
        {"llama minimal fsdp=2", LLAMA, NLLAMA, 8, 2, {"ici_fsdp_parallelism=2", "remat_policy=minimal"}, 0, false},
        {"llama custom explicit",
         LLAMA,
         NLLAMA,
         8,
         2,
         {"ici_tensor_parallelism=2", "remat_policy=custom", "query_proj=device", "mlpwo=offload",
          "shard_mode=explicit"},
         0,
         false},
        {"llama flash attention, 2 microbatches",
         LLAMA,
         NLLAMA,
         8,
         2,
         {"ici_fsdp_parallelism=2", "attention=flash", "gradient_accumulation_steps=2"},
         0,
         false},
        {"llama pipeline",
         LLAMA,
         NLLAMA,
         8,
         4,
         {"ici_pipeline_parallelism=2", "ici_fsdp_parallelism=2", "num_pipeline_microbatches=4"},
         0,
         false},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) expect_same(&cases[i]);
}

/* Qwen3 on fsdp=2 context=2 in explicit mode: the forward places the MLP's wi_0 product by JAX's
 * rules, the recomputation (in the backward pass, which resolves shardings as auto mode does) by the
 * cheapest placement, a different shard; from there its kernels run and the bits are still the
 * recomputation's */
static const char *const QWEN3[] = {
    "model_name=qwen3-0.6b",  "override_model_config=true", "base_emb_dim=32",
    "base_num_query_heads=4", "base_num_kv_heads=2",        "head_dim=8",
    "base_mlp_dim=48",        "base_num_decoder_layers=2",  "vocab_size=64",
    "max_target_length=16",   "learning_rate=1e-3",         "logits_via_embedding=false"};

static void test_qwen3_departs(void **state)
{
    (void)state;
    const replay_case stays = {"qwen3 1 device", QWEN3, 12, 8, 1, {NULL}, 0, false};
    expect_same(&stays);
    const replay_case leaves = {"qwen3 fsdp=2 context=2 explicit",
                                QWEN3,
                                12,
                                8,
                                4,
                                {"ici_fsdp_parallelism=2", "ici_context_parallelism=2", "shard_mode=explicit",
                                 "attention=flash", "hardware=tpu"},
                                0,
                                true};
    expect_same(&leaves);
}

static void test_deepseek(void **state)
{
    (void)state;
    const replay_case cases[] = {
        {"deepseek full fsdp=2 expert=2",
         DS,
         NDS,
         8,
         4,
         {"ici_fsdp_parallelism=2", "ici_expert_parallelism=2"},
         MODEL_RUN_DATA_ROUTED,
         false},
        {"deepseek minimal expert=2",
         DS,
         NDS,
         8,
         2,
         {"ici_expert_parallelism=2", "remat_policy=minimal"},
         MODEL_RUN_DATA_ROUTED,
         false},
        {"deepseek custom",
         DS,
         NDS,
         8,
         2,
         {"ici_fsdp_parallelism=2", "remat_policy=custom", "moe_mlpwi_0=device", "mla_kv=offload", "out_proj=device"},
         MODEL_RUN_DATA_ROUTED,
         false},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) expect_same(&cases[i]);
}

/* the batch-split schedule (DeepSeek-V3's, MaxText's deepseek_batchsplit.py) on a test-sized model */
static const char *const SPLIT[] = {TINY_BATCHSPLIT_YML};
enum { NSPLIT = sizeof SPLIT / sizeof SPLIT[0] };

static void test_batch_split(void **state)
{
    (void)state;
    const replay_case c = {"deepseek batch split fsdp=2 expert=2",
                           SPLIT,
                           NSPLIT,
                           8,
                           4,
                           {"ici_fsdp_parallelism=2", "ici_expert_parallelism=2"},
                           MODEL_RUN_DATA_ROUTED,
                           false};
    expect_same(&c);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_llama),
        cmocka_unit_test(test_deepseek),
        cmocka_unit_test(test_batch_split),
        cmocka_unit_test(test_qwen3_departs),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
