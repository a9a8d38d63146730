/* test_models_mixtral.c — MaxText 0.2.5's mixtral decoder block (models/families/mixtral.c).
 *
 *   - losses: from the same parameters and tokens, shardsim's loss at step 0 and after one step equals
 *     real MaxText 0.2.5's on CPU (tests/data/maxtext-0.2.5/losses/mixtral/, measured by gen.sh there with
 *     the peer's MaxText venv: never computed here) within 1e-6 relative: the sparse path on
 *     fsdp x tensor, the dense path on fsdp x expert with the load-balance loss and
 *     norm_topk_prob, the sparse path in explicit mode on data x fsdp (XLA:CPU cannot compile the
 *     sparse path's ragged all-to-all, so MaxText's sparse runs keep the expert axis at 1 and the
 *     expert axis is measured on the dense path).  The sparse path's load-balance loss is a known
 *     difference (MaxText reports one batch shard's; see LOSS_CASES).  The parameters are
 *     shardsim's after one step of training from its init, written and read as a checkpoint;
 *   - sharding dumps: `shardsim dump` of the full-size mixtral-8x7b (fsdp=4 expert=2) and
 *     mixtral-8x22b (fsdp=2 tensor=2 expert=2, dense path) equal MaxText 0.2.5's own dumps;
 *   - parity: losses and every gradient equal (rtol 1e-4) to one device's over data, fsdp, tensor,
 *     context, expert and mixed meshes, sparse and dense paths, in auto and explicit mode;
 *   - the routing weights are a softmax over the k selected logits (checked on one token by hand);
 *   - what MaxText's layer would not apply (attention_type=local_sliding: its Attention is global;
 *     attn_logits_soft_cap: not passed) or shardsim does not simulate is refused naming the key. */
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

/* The small Mistral of the loss data (losses/gen.sh: MIXTRAL). */
static const char *const MIXTRAL[] = {
    "model_name=mixtral-8x7b", "override_model_config=true", "base_emb_dim=64",
    "base_num_query_heads=4",  "base_num_kv_heads=2",        "head_dim=16",
    "base_mlp_dim=96",         "base_moe_mlp_dim=96",        "base_num_decoder_layers=2",
    "vocab_size=256",          "max_target_length=32",       "per_device_batch_size=2",
    "num_experts=4",
};
enum { NMIXTRAL = sizeof MIXTRAL / sizeof MIXTRAL[0] };

static const family_loss_case LOSS_CASES[] = {
    {"mixtral/sparse_fsdp2_tensor2", {"ici_fsdp_parallelism=2", "ici_tensor_parallelism=2"}, 1e-6, 0, NULL},
    {"mixtral/sparse_data2_fsdp2_explicit",
     {"ici_data_parallelism=2", "ici_fsdp_parallelism=2", "shard_mode=explicit"},
     1e-6,
     0,
     NULL},
    {"mixtral/dense_fsdp2_expert2_lb_norm",
     {"ici_fsdp_parallelism=2", "ici_expert_parallelism=2", "sparse_matmul=false", "load_balance_loss_weight=0.01",
      "norm_topk_prob=true"},
     1e-6,
     0,
     NULL},
    /* the sparse path's load-balance loss: MaxText 0.2.5 computes it inside its shard_map on each
     * device's own rows and returns it with out_specs P() (moe.py sparse_matmul), so the value it
     * reports is one batch shard's; shardsim's is the batch's, the dense path's figure above,
     * which MaxText matches exactly.  Held within 2e-4 and above 1e-5, so a change shows */
    {"mixtral/sparse_fsdp2_tensor2_lb",
     {"ici_fsdp_parallelism=2", "ici_tensor_parallelism=2", "load_balance_loss_weight=0.01"},
     2e-4,
     1e-5,
     "MaxText's per-shard sparse load-balance loss"},
};

static void test_losses_equal_maxtext(void **state)
{
    (void)state;
    family_check_losses("mixtral", MIXTRAL, NMIXTRAL, LOSS_CASES, (int)(sizeof LOSS_CASES / sizeof LOSS_CASES[0]));
}

static void test_dumps_equal_maxtext(void **state)
{
    (void)state;
    /* 12 parameters (gate and three expert kernels), their two Adam moments and the step counters */
    family_check_moe_dumps("mixtral-8x7b", "mixtral-8x22b");
}

/* Parity: every mesh trains as one device does (losses and every gradient, rtol 1e-4). */
static const char *const TINY[] = {
    "model_name=mixtral-8x7b", "override_model_config=true",    "base_emb_dim=32",
    "base_num_query_heads=4",  "base_num_kv_heads=2",           "head_dim=8",
    "base_mlp_dim=48",         "base_moe_mlp_dim=48",           "base_num_decoder_layers=2",
    "vocab_size=64",           "max_target_length=16",          "learning_rate=1e-3",
    "num_experts=4",           "load_balance_loss_weight=0.01",
};
enum { NTINY = sizeof TINY / sizeof TINY[0], ROWS = 8, STEPS = 3 };

static void test_parity_across_meshes(void **state)
{
    (void)state;
    family_check_moe_parity(TINY, NTINY, ROWS, STEPS, "norm_topk_prob=true");
}

static void test_definition(void **state)
{
    (void)state;
    model_def *def = model_run_load(TINY, NTINY, ROWS, NULL, 0, 1, 0, NULL);
    assert_string_equal(def->d.family->name, "mixtral");
    /* the experts' width is mlp_dim (RoutedMoE(intermediate_dim=config.mlp_dim); MaxText's config check
     * makes a model without dense layers set base_moe_mlp_dim equal to it) */
    family_check_routed_params(def, "MoeBlock_0", 32, 2, 4, 48);
    model_run_unload(def);
}

/* get_topk outside DeepSeek: weights = softmax over the k selected gate logits (no
 * routed_scaling_factor), with norm_topk_prob divided by their sum; computed here by hand. */
static void test_routing_weights(void **state)
{
    (void)state;
    const float s[5] = {0.5f, 2.0f, -1.0f, 1.25f, 2.0f};
    model_moe_route_cfg c = {.k = 2, .scaling = 2.5, .softmax_topk = true};
    float sel[5], w[2];
    int32_t idx[2];
    model_moe_route_token(s, NULL, 5, &c, 0, sel, idx, w);
    /* top-2 of the logits: 2.0 at 1 and 4 (ties to the lowest index first); softmax of equal values */
    assert_int_equal(idx[0], 1);
    assert_int_equal(idx[1], 4);
    assert_true(fabsf(w[0] - 0.5f) < 1e-7f && fabsf(w[1] - 0.5f) < 1e-7f);
    const float s2[4] = {0.1f, 1.0f, 3.0f, -2.0f};
    model_moe_route_token(s2, NULL, 4, &c, 0, sel, idx, w);
    assert_int_equal(idx[0], 2);
    assert_int_equal(idx[1], 1);
    double e = exp(-2.0); /* softmax([3, 1]) = (1, e^-2) / (1 + e^-2) */
    assert_true(fabs(w[0] - 1.0 / (1.0 + e)) < 1e-7 && fabs(w[1] - e / (1.0 + e)) < 1e-7);
    c.norm_topk = true; /* a division by a sum of 1: the same weights within rounding */
    model_moe_route_token(s2, NULL, 4, &c, 0, sel, idx, w);
    assert_true(fabs(w[0] - 1.0 / (1.0 + e)) < 1e-7 && fabs(w[1] - e / (1.0 + e)) < 1e-7);
}

static void test_refusals_name_the_key(void **state)
{
    (void)state;
    static const family_refusal own[] = {
        {"attn_logits_soft_cap=30", "attn_logits_soft_cap", "does not pass", "attention=flash"},
        {"fused_mlp=true", "fused_mlp", "experts", NULL},
        {"ici_pipeline_parallelism=2", "load_balance_loss_weight", "pipeline", NULL},
        /* GeGLU is simulated in MlpBlock (gemma3), not in the routed experts */
        {"mlp_activations=[gelu,linear]", "mlp_activations", "SwiGLU", NULL},
    };
    family_check_dense_refusals(TINY, NTINY, own, (int)(sizeof own / sizeof own[0]));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_definition),           cmocka_unit_test(test_refusals_name_the_key),
        cmocka_unit_test(test_losses_equal_maxtext), cmocka_unit_test(test_dumps_equal_maxtext),
        cmocka_unit_test(test_parity_across_meshes), cmocka_unit_test(test_routing_weights),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
