/* test_models_gemma3.c — MaxText 0.2.5's gemma3 decoder block (models/families/gemma3.c).
 *
 *   - losses: from the same parameters and tokens, shardsim's loss at step 0 and after one step equals
 *     real MaxText 0.2.5's on CPU (tests/data/maxtext-0.2.5/losses/gemma3/, measured by gen.sh there with
 *     the peer's MaxText venv: never computed here) within 1e-6 relative, on sharded meshes in auto and
 *     explicit mode and with context parallelism; the model has one scanned block of six layers (five
 *     local with a window shorter than the sequence, one global) and a remainder of two, tied logits
 *     (attend_on_embedding's bfloat16 table);
 *   - sharding dump: `shardsim dump` of the full-size gemma3-4b (34 layers: 5 scanned blocks and a
 *     remainder of 4; fsdp=4 tensor=2) equals MaxText 0.2.5's own dump (named shardings, logical names);
 *   - parity: losses and every gradient equal (rtol 1e-4) to one device's over data, fsdp, tensor,
 *     context (the local layers' window under context parallelism) and mixed meshes, in auto and
 *     explicit mode;
 *   - the definition: the blocks of six and layers_remainder as MaxText names and shapes them, the query
 *     init without 1/sqrt(head_dim), the post norms only where use_post_attn_norm / use_post_ffw_norm;
 *   - what MaxText would not run or shardsim does not simulate is refused naming the key. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "models/core/model.h"
#include "tests/family_check.h"
#include "tests/model_run.h"

/* The small Gemma 3 of the loss data (losses/gen.sh: GEMMA3). */
static const char *const GEMMA3[] = {
    "model_name=gemma3-4b",   "override_model_config=true", "base_emb_dim=64",
    "base_num_query_heads=4", "base_num_kv_heads=2",        "head_dim=16",
    "base_mlp_dim=128",       "base_num_decoder_layers=8",  "vocab_size=256",
    "max_target_length=32",   "per_device_batch_size=2",    "sliding_window_size=8",
};
enum { NGEMMA3 = sizeof GEMMA3 / sizeof GEMMA3[0] };

static const family_loss_case LOSS_CASES[] = {
    {"gemma3/fsdp2_tensor2", {"ici_fsdp_parallelism=2", "ici_tensor_parallelism=2"}, 1e-6, 0, NULL},
    {"gemma3/data2_fsdp2_explicit",
     {"ici_data_parallelism=2", "ici_fsdp_parallelism=2", "shard_mode=explicit"},
     1e-6,
     0,
     NULL},
    {"gemma3/context2_fsdp2", {"ici_context_parallelism=2", "ici_fsdp_parallelism=2"}, 1e-6, 0, NULL},
};

static void test_losses_equal_maxtext(void **state)
{
    (void)state;
    family_check_losses("gemma3", GEMMA3, NGEMMA3, LOSS_CASES, (int)(sizeof LOSS_CASES / sizeof LOSS_CASES[0]));
}

static void test_dumps_equal_maxtext(void **state)
{
    (void)state;
    const char *a[] = {"model_name=gemma3-4b", "num_devices=8", "ici_fsdp_parallelism=4", "ici_tensor_parallelism=2"};
    /* 13 parameters in each of 6 scanned and 4 remainder layers, the embedding and the final norm, their
     * two Adam moments and the step counters */
    assert_true(family_check_dump("gemma3-4b fsdp=4 tensor=2", "gemma3-4b",
                                  "ici_fsdp_parallelism=4_ici_tensor_parallelism=2", 4, a) >= 3 * (13 * 10 + 2));
}

/* Parity: every mesh trains as one device does (losses and every gradient, rtol 1e-4).  Eight layers
 * (one block of six, a remainder of two), a window of 4 in a sequence of 16.  The logits are untied here:
 * attend_on_embedding rounds the tied table's gradient to bfloat16 (XLA:CPU keeps the transposed
 * convert pair), so a float32 sum in another order can move an element by a bfloat16 ulp (2^-8
 * relative), as it can between MaxText's meshes; the loss cases above keep the tied head. */
static const char *const TINY[] = {
    "model_name=gemma3-4b",
    "override_model_config=true",
    "base_emb_dim=32",
    "base_num_query_heads=4",
    "base_num_kv_heads=2",
    "head_dim=8",
    "base_mlp_dim=48",
    "base_num_decoder_layers=8",
    "vocab_size=64",
    "max_target_length=16",
    "learning_rate=1e-3",
    "sliding_window_size=4",
    "logits_via_embedding=false",
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
        {4, {"ici_context_parallelism=2", "context_parallel_load_balance=true", "ici_fsdp_parallelism=2"}},
        {8, {"ici_data_parallelism=2", "ici_fsdp_parallelism=2", "ici_tensor_parallelism=2"}},
        {4, {"ici_fsdp_parallelism=4", "shard_mode=explicit"}},
        {4, {"ici_data_parallelism=2", "ici_tensor_parallelism=2", "shard_mode=explicit"}},
        /* a sharded sequence in explicit mode needs the flash kernel (MaxText's dot-product path refuses it) */
        {4,
         {"ici_fsdp_parallelism=2", "ici_context_parallelism=2", "shard_mode=explicit", "attention=flash",
          "hardware=tpu"}},
        {4, {"ici_fsdp_parallelism=2", "ici_tensor_parallelism=2", "remat_policy=minimal", "shard_mode=explicit"}},
    };
    family_check_parity(TINY, NTINY, ROWS, STEPS, meshes, (int)(sizeof meshes / sizeof meshes[0]));
}

static void test_definition(void **state)
{
    (void)state;
    model_def *def = model_run_load(TINY, NTINY, ROWS, NULL, 0, 1, 0, NULL);
    assert_string_equal(def->d.family->name, "gemma3");
    /* 8 layers: layers.layers_0..5 stacked over 8 // 6 = 1 block, layers_remainder.layers_0..1 */
    assert_int_equal(def->nparams, 1 + 6 * 13 + 2 * 13 + 2);
    assert_false(def->d.tied_logits); /* TINY unties them */
    assert_true(model_param_index(def, "logits_dense.kernel") >= 0);
    int wo = model_param_index(def, "decoder.layers.layers_5.mlp.wo.kernel");
    assert_true(wo >= 0);
    assert_int_equal(def->defs[wo].rank, 3);
    assert_int_equal(def->defs[wo].shape[0], 48);
    assert_int_equal(def->defs[wo].shape[1], 1);
    assert_int_equal(def->defs[wo].scan_dim, 1);
    assert_string_equal(def->defs[wo].logical[1], "layers");
    int rq = model_param_index(def, "decoder.layers_remainder.layers_1.self_attention.query.kernel");
    assert_true(rq >= 0);
    assert_int_equal(def->defs[rq].rank, 3); /* (embed, heads, head_dim): no stacked dim */
    assert_int_equal(def->defs[rq].scan_dim, -1);
    assert_string_equal(def->defs[rq].logical[0], "embed_attn");
    assert_string_equal(def->defs[rq].logical[1], "q_heads");
    assert_int_equal(model_param_index(def, "decoder.layers_remainder.layers_2.mlp.wo.kernel"), -1);
    /* init_query_w: query_pre_attn_scalar != 1 leaves the fan-in init unscaled */
    assert_true(fabs(def->defs[rq].scale - 1.0 / sqrt(32.0)) < 1e-12);
    /* the post norms of the model file, query/key norms over head_dim */
    int kn = model_param_index(def, "decoder.layers.layers_0.self_attention.key_norm.scale");
    assert_true(kn >= 0 && def->defs[kn].shape[0] == 8);
    assert_true(model_param_index(def, "decoder.layers.layers_3.post_ffw_norm.scale") >= 0);
    assert_true(model_param_index(def, "decoder.layers_remainder.layers_0.post_self_attention_norm.scale") >= 0);
    model_run_unload(def);

    /* 6 layers: no remainder; 4: no scanned block; without the post norms, none defined */
    const char *six[] = {"base_num_decoder_layers=6"};
    def = model_run_load(TINY, NTINY, ROWS, six, 1, 1, 0, NULL);
    assert_int_equal(def->nparams, 1 + 6 * 13 + 2);
    assert_int_equal(model_param_index(def, "layers_remainder.layers_0.mlp.wo.kernel"), -1);
    model_run_unload(def);
    const char *four[] = {"base_num_decoder_layers=4", "use_post_attn_norm=false", "use_post_ffw_norm=false",
                          "logits_via_embedding=true"};
    def = model_run_load(TINY, NTINY, ROWS, four, 4, 1, 0, NULL);
    assert_true(def->d.tied_logits); /* the model file's head: attend_on_embedding, no logits_dense */
    assert_int_equal(model_param_index(def, "logits_dense.kernel"), -1);
    assert_int_equal(def->nparams, 1 + 4 * 11 + 1);
    assert_int_equal(model_param_index(def, "decoder.layers.layers_0.mlp.wo.kernel"), -1);
    assert_int_equal(model_param_index(def, "post_ffw_norm.scale"), -1);
    assert_int_equal(model_param_index(def, "post_self_attention_norm.scale"), -1);
    model_run_unload(def);
}

static void test_refusals_name_the_key(void **state)
{
    (void)state;
    static const family_refusal cases[] = {
        {"model_name=default", "model_name", "get_query_pre_attn_scalar", "decoder_block=gemma3"},
        {"attention_type=mla", "attention_type", "GEMMA3_ATTENTION_PATTERN", NULL},
        {"sliding_window_size=0", "sliding_window_size", "sliding_window_size > 0", NULL},
        {"rope_type=yarn", "rope_type", "default", NULL},
        {"scan_layers=false", "scan_layers", "scan_layers=true", NULL},
        {"fused_qkv=true", "fused_qkv", "fused_qkv=false", NULL},
        {"fused_mlp=true", "fused_mlp", "fused_mlp=false", NULL},
        {"ici_pipeline_parallelism=2", "ici_pipeline_parallelism", "not simulated", "num_devices=2"},
        {"mtp_num_layers=1", "mtp_num_layers", "deepseek", NULL},
        {"use_batch_split_schedule=true", "use_batch_split_schedule", "deepseek", NULL},
        {"use_multimodal=true", "use_multimodal", "refused", NULL},
        {"mlp_activations=[relu]", "mlp_activations", "refused", NULL},
    };
    family_check_refusals(TINY, NTINY, cases, (int)(sizeof cases / sizeof cases[0]));
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
