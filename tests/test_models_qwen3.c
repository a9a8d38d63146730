/* test_models_qwen3.c — MaxText 0.2.5's qwen3 decoder block (models/families/qwen3.c).
 *
 *   - losses: from the same parameters and tokens, shardsim's loss at step 0 and after one step equals
 *     real MaxText 0.2.5's on CPU (tests/data/maxtext-0.2.5/losses/qwen3/, measured by gen.sh there with
 *     the peer's MaxText venv: never computed here) within 1e-6 relative, on a sharded mesh in auto
 *     and in explicit mode.  The parameters are shardsim's after one step of training from its init
 *     (so the norms' scales are not ones), written and read as a checkpoint;
 *   - the tied-logits case (logits_via_embedding, the small Qwen3 files) too: MaxText 0.2.5's
 *     attend_on_embedding (layers/embeddings.py) casts the embedding table to bfloat16 before the
 *     logits product, and shardsim rounds it (and its gradient) alike;
 *   - sharding dumps: `shardsim dump` of the full-size qwen3-8b (fsdp=4 tensor=2) and qwen3-0.6b
 *     (tied, fsdp=8) equal MaxText 0.2.5's own dumps (named shardings, logical names);
 *   - parity: losses and every gradient equal (rtol 1e-4) to one device's over data, fsdp, tensor,
 *     context and mixed meshes, in auto and explicit mode;
 *   - auto mode: the bytes a Llama of the same shape sends, as MaxText's compiled step (XLA's
 *     propagation gives the unconstrained Qwen3 residual its neighbours' sharding);
 *   - the definition: the query/key norm scales per layer (head_dim, layers), the query init without
 *     1/sqrt(head_dim) (query_pre_attn_scalar), none without use_qk_norm;
 *   - what the block does not simulate is refused naming the key. */
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

/* The small Qwen3 of the loss data (losses/gen.sh: QWEN3). */
static const char *const QWEN3[] = {
    "model_name=qwen3-0.6b",  "override_model_config=true", "base_emb_dim=64",
    "base_num_query_heads=4", "base_num_kv_heads=2",        "head_dim=16",
    "base_mlp_dim=128",       "base_num_decoder_layers=2",  "vocab_size=256",
    "max_target_length=32",   "per_device_batch_size=2",
};
enum { NQWEN3 = sizeof QWEN3 / sizeof QWEN3[0] };

static const family_loss_case LOSS_CASES[] = {
    {"qwen3/untied_fsdp2_tensor2",
     {"logits_via_embedding=false", "ici_fsdp_parallelism=2", "ici_tensor_parallelism=2"},
     1e-6,
     0,
     NULL},
    {"qwen3/untied_data2_fsdp2_explicit",
     {"logits_via_embedding=false", "ici_data_parallelism=2", "ici_fsdp_parallelism=2", "shard_mode=explicit"},
     1e-6,
     0,
     NULL},
    /* tied logits: attend_on_embedding's bfloat16 table (see the header) */
    {"qwen3/tied_fsdp2_tensor2", {"ici_fsdp_parallelism=2", "ici_tensor_parallelism=2"}, 1e-6, 0, NULL},
};

static void test_losses_equal_maxtext(void **state)
{
    (void)state;
    family_check_losses("qwen3", QWEN3, NQWEN3, LOSS_CASES, (int)(sizeof LOSS_CASES / sizeof LOSS_CASES[0]));
}

static void test_dumps_equal_maxtext(void **state)
{
    (void)state;
    const char *a8[] = {"model_name=qwen3-8b", "num_devices=8", "ici_fsdp_parallelism=4", "ici_tensor_parallelism=2"};
    /* 13 parameters (query/key norms included), their two Adam moments and the step counters */
    assert_true(family_check_dump("qwen3-8b fsdp=4 tensor=2", "qwen3-8b", "ici_fsdp_parallelism=4_ici_tensor_parallelism=2",
                                  4, a8) >= 3 * 13);
    const char *a06[] = {"model_name=qwen3-0.6b", "num_devices=8", "ici_fsdp_parallelism=8"};
    assert_true(family_check_dump("qwen3-0.6b fsdp=8 (tied logits)", "qwen3-0.6b", "ici_fsdp_parallelism=8", 3, a06) >=
                3 * 12);
}

/* Parity: every mesh trains as one device does (losses and every gradient, rtol 1e-4). */
static const char *const TINY[] = {
    "model_name=qwen3-0.6b",  "override_model_config=true", "base_emb_dim=32",
    "base_num_query_heads=4", "base_num_kv_heads=2",        "head_dim=8",
    "base_mlp_dim=48",        "base_num_decoder_layers=2",  "vocab_size=64",
    "max_target_length=16",   "learning_rate=1e-3",         "logits_via_embedding=false",
};
enum { NTINY = sizeof TINY / sizeof TINY[0], ROWS = 8, STEPS = 3 };

static void test_parity_across_meshes(void **state)
{
    (void)state;
    static const family_mesh own[] = {
        {8, {"ici_data_parallelism=2", "ici_fsdp_parallelism=2", "ici_tensor_parallelism=2"}},
    };
    family_check_dense_parity(TINY, NTINY, ROWS, STEPS, "ici_tensor_parallelism=2", own,
                              (int)(sizeof own / sizeof own[0]));
}

/* MaxText constrains the Qwen3 residual in explicit mode only, yet XLA's propagation partitions the
 * auto-mode step as a Llama's of the same shape: MaxText's compiled step (tests/data/maxtext-0.2.5/hlo_bytes,
 * XLA:CPU, 8 devices, fsdp=4 tensor=2) sends 163.458 MiB per device for qwen3-8b with these dims and
 * 163.482 MiB for llama2-7b.  shardsim's auto-mode qwen3 and llama must agree as closely. */
static void test_auto_mode_traffic_as_llama(void **state)
{
    (void)state;
    static const char *const dims[] = {"override_model_config=true",
                                       "base_emb_dim=512",
                                       "base_num_query_heads=8",
                                       "base_num_kv_heads=8",
                                       "head_dim=64",
                                       "base_mlp_dim=1536",
                                       "base_num_decoder_layers=4",
                                       "vocab_size=4096",
                                       "max_target_length=256",
                                       "logits_via_embedding=false",
                                       "dtype=float32",
                                       "dry_run=true",
                                       "ici_fsdp_parallelism=4",
                                       "ici_tensor_parallelism=2",
                                       NULL,
                                       NULL};
    enum { ND = sizeof dims / sizeof dims[0] - 2 };
    uint64_t sent[2] = {0, 0};
    for (int k = 0; k < 2; k++) {
        const char *words[ND + 1];
        for (int i = 0; i < ND; i++) words[i] = dims[i];
        words[ND] = k ? "model_name=llama2-7b" : "model_name=qwen3-8b";
        model_run r;
        model_run_open(&r, words, ND + 1, 8, NULL, 0, 8, 1);
        model_run_train(&r, false);
        size_t n;
        const sim_record *rec = sim_device_records(sim_machine_device(r.m, 0), &n);
        for (size_t i = 0; i < n; i++) sent[k] += rec[i].bytes_sent;
        model_run_close(&r);
    }
    double xla[2];
    for (int k = 0; k < 2; k++) {
        char path[1200];
        snprintf(path, sizeof path, "%s/maxtext-0.2.5/hlo_bytes/%s_fsdp4_tensor2.json", helper_reference_dir(),
                 k ? "llama2-7b" : "qwen3-8b");
        cfg_json *j = helper_read_json(NULL, path);
        xla[k] = helper_json_get(j, "total_bytes_sent_per_device")->number;
        cfg_json_free(j);
    }
    double rel = fabs((double)sent[0] - (double)sent[1]) / (double)sent[1], xrel = fabs(xla[0] - xla[1]) / xla[1];
    printf("  auto mode, bytes sent per device: shardsim qwen3 %llu, llama %llu (rel %.2e); MaxText's XLA:CPU step "
           "qwen3 %.0f, llama %.0f (rel %.2e)\n",
           (unsigned long long)sent[0], (unsigned long long)sent[1], rel, xla[0], xla[1], xrel);
    assert_true(xrel < 0.001); /* the measurement this test stands on */
    assert_true(rel < 0.001);
}

static void test_definition(void **state)
{
    (void)state;
    model_def *def = model_run_load(TINY, NTINY, ROWS, NULL, 0, 1, 0, NULL);
    assert_string_equal(def->d.family->name, "qwen3");
    int qn = model_param_index(def, "self_attention.query_norm.scale"),
        kn = model_param_index(def, "self_attention.key_norm.scale"),
        q = model_param_index(def, "self_attention.query.kernel");
    assert_true(qn >= 0 && kn >= 0 && q >= 0);
    for (int i = 0; i < 2; i++) {
        const model_param_def *pd = &def->defs[i ? kn : qn];
        assert_int_equal(pd->rank, 2);
        assert_int_equal(pd->shape[0], 8); /* head_dim */
        assert_int_equal(pd->shape[1], 2); /* layers */
        assert_string_equal(pd->logical[0], "norm");
        assert_string_equal(pd->logical[1], "layers");
        assert_int_equal(pd->scan_dim, 1);
        assert_int_equal(pd->init, MODEL_INIT_ONES);
    }
    /* init_query_w: query_pre_attn_scalar = head_dim^-0.5 != 1 leaves the fan-in init unscaled */
    assert_true(fabs(def->defs[q].scale - 1.0 / sqrt(32.0)) < 1e-12);
    model_run_unload(def);
    const char *noqk[] = {"use_qk_norm=false"};
    def = model_run_load(TINY, NTINY, ROWS, noqk, 1, 1, 0, NULL);
    assert_int_equal(model_param_index(def, "query_norm.scale"), -1);
    assert_int_equal(model_param_index(def, "key_norm.scale"), -1);
    q = model_param_index(def, "self_attention.query.kernel");
    assert_true(fabs(def->defs[q].scale - 1.0 / sqrt(32.0)) < 1e-12);
    model_run_unload(def);
}

static void test_refusals_name_the_key(void **state)
{
    (void)state;
    static const family_refusal own[] = {
        {"rope_type=llama3.1", "rope_type", "default", NULL},
        {"use_mrope=true", "use_mrope", "use_mrope=false", NULL},
        {"qk_norm_with_scale=false", "qk_norm_with_scale", "refused", NULL},
    };
    family_check_dense_refusals(TINY, NTINY, own, (int)(sizeof own / sizeof own[0]));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_definition),           cmocka_unit_test(test_refusals_name_the_key),
        cmocka_unit_test(test_losses_equal_maxtext), cmocka_unit_test(test_dumps_equal_maxtext),
        cmocka_unit_test(test_parity_across_meshes), cmocka_unit_test(test_auto_mode_traffic_as_llama),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
