/* test_models_mistral.c — MaxText 0.2.5's mistral decoder block (models/families/mistral.c).
 *
 *   - losses: from the same parameters and tokens, shardsim's loss at step 0 and after one step equals
 *     real MaxText 0.2.5's on CPU (tests/data/maxtext-0.2.5/losses/mistral/, measured by gen.sh there with
 *     the peer's MaxText venv: never computed here) within 1e-6 relative, on a sharded mesh in auto
 *     and in explicit mode.  The parameters are shardsim's after one step of training from its init
 *     (so the norms' scales are not ones), written and read as a checkpoint;
 *   - sharding dump: `shardsim dump` of the full-size mistral-7b (fsdp=4 tensor=2) equals MaxText
 *     0.2.5's own dump (named shardings, logical names);
 *   - parity: losses and every gradient equal (rtol 1e-4) to one device's over data, fsdp, tensor,
 *     context and mixed meshes, in auto and explicit mode;
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
#include "models/core/model.h"
#include "tests/cli_capture.h"
#include "tests/family_check.h"
#include "tests/helpers.h"
#include "tests/model_run.h"

/* The small Mistral of the loss data (losses/gen.sh: MISTRAL). */
static const char *const MISTRAL[] = {
    "model_name=mistral-7b",  "override_model_config=true", "base_emb_dim=64",
    "base_num_query_heads=4", "base_num_kv_heads=2",        "head_dim=16",
    "base_mlp_dim=128",       "base_num_decoder_layers=2",  "vocab_size=256",
    "max_target_length=32",   "per_device_batch_size=2",
};
enum { NMISTRAL = sizeof MISTRAL / sizeof MISTRAL[0] };

static const family_loss_case LOSS_CASES[] = {
    {"mistral/fsdp2_tensor2", {"ici_fsdp_parallelism=2", "ici_tensor_parallelism=2"}, 1e-6, 0, NULL},
    {"mistral/data2_fsdp2_explicit",
     {"ici_data_parallelism=2", "ici_fsdp_parallelism=2", "shard_mode=explicit"},
     1e-6,
     0,
     NULL},
};

static void test_losses_equal_maxtext(void **state)
{
    (void)state;
    family_check_losses("mistral", MISTRAL, NMISTRAL, LOSS_CASES, (int)(sizeof LOSS_CASES / sizeof LOSS_CASES[0]));
}

static void test_dumps_equal_maxtext(void **state)
{
    (void)state;
    const char *a[] = {"model_name=mistral-7b", "num_devices=8", "ici_fsdp_parallelism=4", "ici_tensor_parallelism=2"};
    /* 12 parameters, their two Adam moments and the step counters */
    assert_true(family_check_dump("mistral-7b fsdp=4 tensor=2", "mistral-7b",
                                  "ici_fsdp_parallelism=4_ici_tensor_parallelism=2", 4, a) >= 3 * 12);
}

/* Parity: every mesh trains as one device does (losses and every gradient, rtol 1e-4). */
static const char *const TINY[] = {
    "model_name=mistral-7b",  "override_model_config=true", "base_emb_dim=32",
    "base_num_query_heads=4", "base_num_kv_heads=2",        "head_dim=8",
    "base_mlp_dim=48",        "base_num_decoder_layers=2",  "vocab_size=64",
    "max_target_length=16",   "learning_rate=1e-3",
};
enum { NTINY = sizeof TINY / sizeof TINY[0], ROWS = 8, STEPS = 3 };

static void test_parity_across_meshes(void **state)
{
    (void)state;
    static const family_mesh own[] = {
        {4, {"ici_context_parallelism=2", "context_parallel_load_balance=true", "ici_fsdp_parallelism=2"}},
        {8, {"ici_data_parallelism=2", "ici_fsdp_parallelism=2", "ici_tensor_parallelism=2"}},
    };
    family_check_dense_parity(TINY, NTINY, ROWS, STEPS, "ici_tensor_parallelism=2", own,
                              (int)(sizeof own / sizeof own[0]));
}

static void test_definition(void **state)
{
    (void)state;
    model_def *def = model_run_load(TINY, NTINY, ROWS, NULL, 0, 1, 0, NULL);
    assert_string_equal(def->d.family->name, "mistral");
    assert_int_equal(model_param_index(def, "query_norm.scale"), -1);
    int q = model_param_index(def, "self_attention.query.kernel"), wi = model_param_index(def, "mlp.wi_0.kernel");
    assert_true(q >= 0 && wi >= 0);
    /* init_query_w: fan-in init divided by sqrt(head_dim) (the score scale is 1) */
    assert_true(fabs(def->defs[q].scale - 1.0 / sqrt(32.0) / sqrt(8.0)) < 1e-12);
    assert_string_equal(def->defs[wi].logical[0], "embed");
    assert_string_equal(def->defs[wi].logical[1], "layers");
    assert_string_equal(def->defs[wi].logical[2], "mlp");
    assert_true(def->d.tied_logits == false); /* mistral-7b.yml: logits_via_embedding: false */
    model_run_unload(def);
}

static void test_refusals_name_the_key(void **state)
{
    (void)state;
    static const family_refusal own[] = {
        {"attn_logits_soft_cap=30", "attn_logits_soft_cap", "does not pass", "attention=flash"},
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
