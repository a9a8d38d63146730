/* test_models_qwen3_moe.c — MaxText 0.2.5's qwen3_moe decoder block (models/families/qwen3_moe.c).
 *
 *   - losses: from the same parameters and tokens, shardsim's loss at step 0 and after one step equals
 *     real MaxText 0.2.5's on CPU (tests/data/maxtext-0.2.5/losses/qwen3_moe/, measured by gen.sh there
 *     with the peer's MaxText venv: never computed here) within 1e-6 relative: the sparse path on
 *     fsdp x tensor (auto) and data x fsdp (explicit), the dense path on fsdp x expert with the
 *     load-balance loss (XLA:CPU cannot compile the sparse path's ragged all-to-all, so the expert
 *     axis is measured on the dense path); norm_topk_prob as the model file sets it, and
 *     base_mlp_dim != base_moe_mlp_dim, which MaxText settles for qwen3_moe by taking moe_mlp_dim;
 *   - sharding dumps: `shardsim dump` of the full-size qwen3-30b-a3b (fsdp=4 expert=2) and
 *     qwen3-235b-a22b (fsdp=2 tensor=2 expert=2, dense path) equal MaxText 0.2.5's own dumps;
 *   - parity: losses and every gradient equal (rtol 1e-4) to one device's over data, fsdp, tensor,
 *     context, expert and mixed meshes, sparse and dense paths, in auto and explicit mode;
 *   - the definition: moe_block's gate ("embed", None) and experts of width moe_mlp_dim, the
 *     query/key norm scales, no shared experts, no dense MLP;
 *   - what MaxText's layer would not apply or shardsim does not simulate is refused naming the key. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/cli.h"
#include "config/json.h"
#include "models/blocks/moe.h"
#include "models/core/model.h"
#include "tests/cli_capture.h"
#include "tests/family_check.h"
#include "tests/helpers.h"
#include "tests/model_run.h"

/* The small Qwen3 MoE of the loss data (losses/gen.sh: QWEN3MOE). */
static const char *const QMOE[] = {
    "model_name=qwen3-30b-a3b",
    "override_model_config=true",
    "base_emb_dim=64",
    "base_num_query_heads=4",
    "base_num_kv_heads=2",
    "head_dim=16",
    "base_mlp_dim=96",
    "base_moe_mlp_dim=48",
    "base_num_decoder_layers=2",
    "vocab_size=256",
    "max_target_length=32",
    "per_device_batch_size=2",
    "num_experts=4",
    "num_experts_per_tok=2",
};
enum { NQMOE = sizeof QMOE / sizeof QMOE[0] };

static const family_loss_case LOSS_CASES[] = {
    {"qwen3_moe/sparse_fsdp2_tensor2", {"ici_fsdp_parallelism=2", "ici_tensor_parallelism=2"}, 1e-6, 0, NULL},
    {"qwen3_moe/sparse_data2_fsdp2_explicit",
     {"ici_data_parallelism=2", "ici_fsdp_parallelism=2", "shard_mode=explicit"},
     1e-6,
     0,
     NULL},
    {"qwen3_moe/dense_fsdp2_expert2_lb",
     {"ici_fsdp_parallelism=2", "ici_expert_parallelism=2", "sparse_matmul=false", "load_balance_loss_weight=0.01"},
     1e-6,
     0,
     NULL},
};

static void test_losses_equal_maxtext(void **state)
{
    (void)state;
    family_check_losses("qwen3_moe", QMOE, NQMOE, LOSS_CASES, (int)(sizeof LOSS_CASES / sizeof LOSS_CASES[0]));
}

static void test_dumps_equal_maxtext(void **state)
{
    (void)state;
    /* 12 parameters (the query/key norms, the gate and three expert kernels), their two Adam moments */
    family_check_moe_dumps("qwen3-30b-a3b", "qwen3-235b-a22b");
}

/* Parity: every mesh trains as one device does (losses and every gradient, rtol 1e-4). */
static const char *const TINY[] = {
    "model_name=qwen3-30b-a3b",
    "override_model_config=true",
    "base_emb_dim=32",
    "base_num_query_heads=4",
    "base_num_kv_heads=2",
    "head_dim=8",
    "base_mlp_dim=48",
    "base_moe_mlp_dim=24",
    "base_num_decoder_layers=2",
    "vocab_size=64",
    "max_target_length=16",
    "learning_rate=1e-3",
    "num_experts=4",
    "num_experts_per_tok=2",
    "load_balance_loss_weight=0.01",
};
enum { NTINY = sizeof TINY / sizeof TINY[0], ROWS = 8, STEPS = 3 };

static void test_parity_across_meshes(void **state)
{
    (void)state;
    family_check_moe_parity(TINY, NTINY, ROWS, STEPS, "norm_topk_prob=false");
}

static void test_definition(void **state)
{
    (void)state;
    model_def *def = model_run_load(TINY, NTINY, ROWS, NULL, 0, 1, 0, NULL);
    assert_string_equal(def->d.family->name, "qwen3_moe");
    assert_int_equal(model_param_index(def, "MoeBlock_0.gate.kernel"), -1);
    int qn = model_param_index(def, "params.decoder.layers.self_attention.query_norm.scale"),
        kn = model_param_index(def, "params.decoder.layers.self_attention.key_norm.scale");
    assert_true(qn >= 0 && kn >= 0);
    /* the experts' width is moe_mlp_dim (24 here, base_mlp_dim 48: RoutedMoE(intermediate_dim=
     * config.moe_mlp_dim)) */
    family_check_routed_params(def, "moe_block", 32, 2, 4, 24);
    /* the query/key norms over head_dim, per layer */
    assert_int_equal(def->defs[qn].shape[0], 8);
    assert_int_equal(def->defs[qn].shape[1], 2);
    assert_string_equal(def->defs[kn].logical[0], "norm");
    model_run_unload(def);
}

static void test_refusals_name_the_key(void **state)
{
    (void)state;
    static const family_refusal own[] = {
        {"use_mrope=true", "use_mrope", "use_mrope=false", NULL},
        {"fused_mlp=true", "fused_mlp", "experts", NULL},
        {"ici_pipeline_parallelism=2", "load_balance_loss_weight", "pipeline", NULL},
    };
    family_check_dense_refusals(TINY, NTINY, own, (int)(sizeof own / sizeof own[0]));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_definition),           cmocka_unit_test(test_refusals_name_the_key),
        cmocka_unit_test(test_losses_equal_maxtext), cmocka_unit_test(test_dumps_equal_maxtext),
        cmocka_unit_test(test_parity_across_meshes),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
