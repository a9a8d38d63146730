/* test_models_gpt_oss.c — MaxText 0.2.5's gpt_oss decoder block (models/families/gpt_oss.c).
 *
 *   - losses: from the same parameters and tokens, shardsim's loss at step 0 and after one step equals
 *     real MaxText 0.2.5's on CPU (tests/data/maxtext-0.2.5/losses/gpt_oss/, measured by gen.sh there
 *     with the peer's MaxText venv: never computed here) within 1e-6 relative: the sparse path on
 *     fsdp x tensor, data x fsdp and context x fsdp, the dense path on fsdp x expert
 *     with the load-balance loss; the parameters come from one shardsim step, so the attention, gate
 *     and expert biases and the sinks are not zero;
 *   - sharding dumps: `shardsim dump` of the full-size gpt-oss-20b (fsdp=4 expert=2) equals MaxText
 *     0.2.5's own dump;
 *   - parity: losses and every gradient equal (rtol 1e-4) to one device's over data, fsdp, tensor,
 *     context (the window and the sinks with a sharded sequence, load-balanced or not), expert and
 *     mixed meshes, sparse and dense paths, with remat policies; auto mode only, as MaxText 0.2.5
 *     refuses gpt_oss with shard_mode=explicit (configs/types.py), which shardsim refuses with it;
 *   - the definition: the scanned block's layers_0 and layers_1, each stacked over half the layers,
 *     with the projection biases, the sinks, the gate bias and the experts' biases as MaxText names
 *     them;
 *   - the block's pieces change the loss (sinks, window, clamp), each measured by hand against the
 *     same run without it;
 *   - what shardsim does not simulate is refused naming the key, and gpt-oss's keys are refused by
 *     the other blocks. */
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
#include "models/core/model.h"
#include "tests/cli_capture.h"
#include "tests/family_check.h"
#include "tests/helpers.h"
#include "tests/model_run.h"

/* The small gpt-oss of the loss data (losses/gen.sh: GPTOSS). */
static const char *const GOSS[] = {
    "model_name=gpt-oss-20b", "override_model_config=true", "base_emb_dim=64",
    "base_num_query_heads=4", "base_num_kv_heads=2",        "head_dim=16",
    "base_mlp_dim=48",        "base_moe_mlp_dim=48",        "base_num_decoder_layers=4",
    "vocab_size=256",         "max_target_length=32",       "per_device_batch_size=2",
    "num_experts=4",          "num_experts_per_tok=2",      "sliding_window_size=8",
};
enum { NGOSS = sizeof GOSS / sizeof GOSS[0] };

static const family_loss_case LOSS_CASES[] = {
    {"gpt_oss/sparse_fsdp2_tensor2", {"ici_fsdp_parallelism=2", "ici_tensor_parallelism=2"}, 1e-6, 0, NULL},
    {"gpt_oss/sparse_data2_fsdp2", {"ici_data_parallelism=2", "ici_fsdp_parallelism=2"}, 1e-6, 0, NULL},
    {"gpt_oss/dense_fsdp2_expert2_lb",
     {"ici_fsdp_parallelism=2", "ici_expert_parallelism=2", "sparse_matmul=false", "load_balance_loss_weight=0.01"},
     1e-6,
     0,
     NULL},
    {"gpt_oss/sparse_context2_fsdp2", {"ici_context_parallelism=2", "ici_fsdp_parallelism=2"}, 1e-6, 0, NULL},
};

static void test_losses_equal_maxtext(void **state)
{
    (void)state;
    family_check_losses("gpt_oss", GOSS, NGOSS, LOSS_CASES, (int)(sizeof LOSS_CASES / sizeof LOSS_CASES[0]));
}

static void test_dumps_equal_maxtext(void **state)
{
    (void)state;
    const char *a20[] = {"model_name=gpt-oss-20b", "num_devices=8", "ici_fsdp_parallelism=4",
                         "ici_expert_parallelism=2"};
    /* 38 layer parameters (19 in each of layers_0 and layers_1) and 3 more, their two Adam moments */
    assert_true(family_check_dump("gpt-oss-20b fsdp=4 expert=2", "gpt-oss-20b",
                                  "ici_fsdp_parallelism=4_ici_expert_parallelism=2", 4, a20) >= 3 * 41);
}

/* Parity: every mesh trains as one device does (losses and every gradient, rtol 1e-4). */
static const char *const TINY[] = {
    "model_name=gpt-oss-20b",
    "override_model_config=true",
    "base_emb_dim=32",
    "base_num_query_heads=4",
    "base_num_kv_heads=2",
    "head_dim=8",
    "base_mlp_dim=24",
    "base_moe_mlp_dim=24",
    "base_num_decoder_layers=2",
    "vocab_size=64",
    "max_target_length=16",
    "learning_rate=1e-3",
    "num_experts=4",
    "num_experts_per_tok=2",
    "sliding_window_size=4",
    "load_balance_loss_weight=0.01",
};
enum { NTINY = sizeof TINY / sizeof TINY[0], ROWS = 8, STEPS = 3 };

static void test_parity_across_meshes(void **state)
{
    (void)state;
    static const family_mesh meshes[] = {
        {2, {"ici_data_parallelism=2"}},
        {4, {"ici_fsdp_parallelism=4"}},
        {2, {"ici_tensor_parallelism=2"}},
        {2, {"ici_context_parallelism=2"}},
        {2, {"ici_expert_parallelism=2"}},
        {4, {"ici_fsdp_parallelism=2", "ici_expert_parallelism=2"}},
        {4, {"ici_expert_parallelism=2", "ici_tensor_parallelism=2", "sparse_matmul=false"}},
        {4, {"ici_context_parallelism=2", "ici_tensor_parallelism=2", "attention=flash", "hardware=tpu"}},
        {4, {"ici_fsdp_parallelism=2", "ici_context_parallelism=2", "context_parallel_load_balance=false"}},
        {8, {"ici_data_parallelism=2", "ici_fsdp_parallelism=2", "ici_expert_parallelism=2", "norm_topk_prob=true"}},
        {4, {"ici_fsdp_parallelism=2", "ici_expert_parallelism=2", "remat_policy=minimal"}},
        {4, {"ici_fsdp_parallelism=2", "ici_tensor_parallelism=2", "remat_policy=full"}},
    };
    family_check_parity(TINY, NTINY, ROWS, STEPS, meshes, (int)(sizeof meshes / sizeof meshes[0]));
}

static void test_definition(void **state)
{
    (void)state;
    model_def *def = model_run_load(TINY, NTINY, ROWS, NULL, 0, 1, 0, NULL);
    assert_string_equal(def->d.family->name, "gpt_oss");
    /* no unscanned-cycle or other blocks' names */
    assert_int_equal(model_param_index(def, "self_attention.query.kernel"), -1);
    assert_int_equal(model_param_index(def, "moe_block.wi_0"), -1);
    for (int c = 0; c < 2; c++) {
        char p[160];
#define IDX(leaf) (snprintf(p, sizeof p, "params.decoder.layers.layers_%d.%s", c, leaf), model_param_index(def, p))
        int q = IDX("GptOssAttention.query.kernel"), qb = IDX("GptOssAttention.query.bias"),
            kb = IDX("GptOssAttention.key.bias"), ob = IDX("GptOssAttention.out.bias"),
            sk = IDX("GptOssAttention.sinks"), g = IDX("GptOssMlp.gate.kernel"), gb = IDX("GptOssMlp.gate.bias"),
            w0 = IDX("GptOssMlp.wi_0"), w0b = IDX("GptOssMlp.wi_0_bias"), wob = IDX("GptOssMlp.wo_bias");
#undef IDX
        assert_true(q >= 0 && qb >= 0 && kb >= 0 && ob >= 0 && sk >= 0 && g >= 0 && gb >= 0 && w0 >= 0 && w0b >= 0 &&
                    wob >= 0);
        /* stacked over half the layers (2 layers: 1 per cycle position) */
        assert_int_equal(def->defs[q].shape[1], 1);
        assert_int_equal(def->defs[sk].shape[0], 4);
        assert_int_equal(def->defs[sk].shape[1], 1);
        assert_null(def->defs[sk].logical[0]); /* Attention.sinks: out_sharding (None,) */
        assert_string_equal(def->defs[qb].logical[0], "q_heads");
        assert_string_equal(def->defs[kb].logical[2], "kv_head_dim");
        assert_string_equal(def->defs[ob].logical[0], "embed_attn");
        assert_int_equal(def->defs[gb].shape[0], 4); /* routed_bias: (experts,) */
        assert_string_equal(def->defs[w0b].logical[2], "activation_mlp");
        assert_string_equal(def->defs[wob].logical[2], "activation_embed");
        assert_int_equal(def->defs[w0b].shape[2], 24);
        assert_int_equal(def->defs[wob].shape[2], 32);
    }
    model_run_unload(def);
}

/* The final loss of `tiny` + words on one device. */
static double loss_with(const char *w1, const char *w2)
{
    const char *extra[2] = {w1, w2};
    int n = (w1 != NULL) + (w2 != NULL);
    model_run r;
    model_run_open(&r, TINY, NTINY, ROWS, extra, n, 1, 2);
    model_run_train(&r, false);
    double l = r.job.stats[1].loss;
    model_run_close(&r);
    return l;
}

/* Each piece of the block is live: turning it off (or making it inert) changes the loss, and making it
 * inert by its own arithmetic leaves the loss as without it. */
static void test_pieces_are_live(void **state)
{
    (void)state;
    double base = loss_with(NULL, NULL);
    /* a window as long as the sequence is global attention on every layer: the same as no window
     * would be; a window of 2 differs */
    double wide = loss_with("sliding_window_size=16", NULL), narrow = loss_with("sliding_window_size=2", NULL);
    assert_true(fabs(wide - base) > 1e-7 && fabs(narrow - base) > 1e-7);
    /* without sinks the softmax changes (init sinks are zero: e^0 = 1 extra mass) */
    double nosink = loss_with("attention_sink=false", NULL);
    assert_true(fabs(nosink - base) > 1e-5);
    /* a limit far above any pre-activation clips nothing: the same loss as a larger one */
    double big = loss_with("mlp_activations_limit=1000", NULL), bigger = loss_with("mlp_activations_limit=1e6", NULL);
    assert_true(big == bigger);
    double tiny_limit = loss_with("mlp_activations_limit=0.01", NULL);
    assert_true(fabs(tiny_limit - big) > 1e-5);
}

static void test_refusals_name_the_key(void **state)
{
    (void)state;
    static const family_refusal cases[] = {
        {"attention_type=local_sliding", "attention_type", "GPT_OSS_ATTENTION_PATTERN", NULL},
        {"inhomogeneous_layer_cycle_interval=1", "inhomogeneous_layer_cycle_interval", "=2", NULL},
        {"base_num_decoder_layers=3", "base_num_decoder_layers", "even", NULL},
        {"scan_layers=false", "scan_layers", "scan_layers=true", NULL},
        {"sliding_window_size=0", "sliding_window_size", "positive", NULL},
        {"mlp_activations=[silu,linear]", "mlp_activations", "sigmoid", NULL},
        {"fused_qkv=true", "fused_qkv", "biases", NULL},
        {"fused_mlp=true", "fused_mlp", "experts", NULL},
        {"use_qk_norm=true", "use_qk_norm", "use_qk_norm=false", NULL},
        {"rope_type=llama3.1", "rope_type", "yarn", NULL},
        {"mtp_num_layers=1", "mtp_num_layers", "deepseek", NULL},
        {"routed_bias_update_rate=0.01", "routed_bias_update_rate", "DeepSeek", NULL},
        {"ici_pipeline_parallelism=2", "ici_pipeline_parallelism", "pipeline", NULL},
        /* MaxText 0.2.5 refuses gpt_oss in explicit mode at config time (configs/types.py) */
        {"shard_mode=explicit", "shard_mode", "not supported with 'explicit' sharding", NULL},
    };
    family_check_refusals(TINY, NTINY, cases, (int)(sizeof cases / sizeof cases[0]));
    /* gpt-oss's keys on another block (a small Mixtral) */
    static const char *const MIX[] = {
        "model_name=mixtral-8x7b", "override_model_config=true", "base_emb_dim=32",
        "base_num_query_heads=4",  "base_num_kv_heads=2",        "head_dim=8",
        "base_mlp_dim=24",         "base_moe_mlp_dim=24",        "base_num_decoder_layers=2",
        "vocab_size=64",           "max_target_length=16",       "num_experts=4"};
    static const family_refusal elsewhere[] = {
        {"attention_sink=true", "attention_sink", "gpt_oss", NULL},
        {"attention_bias=true", "attention_bias", "gpt_oss", NULL},
        {"mlp_bias=true", "mlp_bias", "gpt_oss", NULL},
        {"mlp_activations_limit=7", "mlp_activations_limit", "gpt_oss", NULL},
        {"inhomogeneous_layer_cycle_interval=2", "inhomogeneous_layer_cycle_interval", "gpt_oss", NULL},
        {"mlp_activations=[sigmoid,linear]", "mlp_activations", "gpt_oss", NULL},
    };
    family_check_refusals(MIX, (int)(sizeof MIX / sizeof MIX[0]), elsewhere,
                          (int)(sizeof elsewhere / sizeof elsewhere[0]));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_definition),          cmocka_unit_test(test_refusals_name_the_key),
        cmocka_unit_test(test_pieces_are_live),     cmocka_unit_test(test_losses_equal_maxtext),
        cmocka_unit_test(test_dumps_equal_maxtext), cmocka_unit_test(test_parity_across_meshes),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
