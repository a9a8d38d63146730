/* test_models_families.c — models/families/families.c: the family table, one row per simulated
 * decoder_block, and the hooks core reaches the families through:
 *   - the rows' names are distinct, every row defines and has a loss, and the rows are exactly the
 *     blocks configs/keys.yml marks simulated among MaxText's (llama2 and deepseek simulated,
 *     gemma not, and no row for it);
 *   - a model gets the row of its decoder_block: the tiny Llama llama2's, the tiny DeepSeek
 *     deepseek's;
 *   - the hooks answer from the config as MaxText's model does: multi-token prediction layers 0 for
 *     Llama (no hook) and mtp_num_layers for DeepSeek; the layers before a pipeline are DeepSeek's
 *     dense layers (first_num_dense_layers=1) and none for Llama; the gate bias's per-step
 *     statistics are experts x MoE layers (8 x 2) with routed_bias_update_rate > 0, none without;
 *     only DeepSeek's MoE weights are pipelined;
 *   - the words that shorten a model for `shardsim plan`'s sampled dry runs come from the row:
 *     base_num_decoder_layers alone for a family without the hook (Llama, Qwen3), DeepSeek's two
 *     keys for DeepSeek, and whatever a new two-stack family's hook writes. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <string.h>

#include "config/config.h"
#include "config/models.h"
#include "models/core/model.h"
#include "tests/helpers.h"
#include "tests/model_run.h"

enum { ROWS = 8 };

static const model_family *row(const char *name)
{
    for (int i = 0; i < model_n_families; i++)
        if (!strcmp(model_families[i]->name, name)) return model_families[i];
    return NULL;
}

static void test_table(void **state)
{
    (void)state;
    assert_true(model_n_families >= 2);
    cfg_config *cfg = NULL;
    if (cfg_load_argv("configs/base.yml", 0, NULL, &cfg) != SIM_OK) fail_msg("%s", sim_errmsg());
    for (int i = 0; i < model_n_families; i++) {
        const model_family *f = model_families[i];
        assert_non_null(f->name);
        assert_non_null(f->define);
        assert_non_null(f->loss);
        assert_true(cfg_block_simulated(cfg, f->name));
        for (int j = 0; j < i; j++) assert_string_not_equal(f->name, model_families[j]->name);
    }
    assert_non_null(row("llama2"));
    assert_non_null(row("deepseek"));
    assert_false(cfg_block_simulated(cfg, "gemma"));
    assert_null(row("gemma"));
    cfg_free(cfg);
}

static model_def *load(const char *const *base, int nbase, const char *const *extra, int n)
{
    return model_run_load(base, nbase, ROWS, extra, n, 1, 0, NULL);
}

static void test_llama_row(void **state)
{
    (void)state;
    const char *base[] = {TINY_LLAMA_YML};
    model_def *d = load(base, 1, NULL, 0);
    assert_ptr_equal(d->d.family, row("llama2"));
    assert_int_equal(model_mtp_layers(d), 0);
    assert_null(d->d.family->layers_before_pipeline);
    assert_null(d->d.family->step_counts);
    model_run_unload(d);
}

static void test_deepseek_row(void **state)
{
    (void)state;
    const char *base[] = {TINY_DEEPSEEK_YML};
    const char *mtp[] = {"mtp_num_layers=1"};
    model_def *d = load(base, 1, mtp, 1);
    assert_ptr_equal(d->d.family, row("deepseek"));
    assert_int_equal(model_mtp_layers(d), 1);
    model_run_unload(d);
    const char *bias[] = {"routed_bias_update_rate=0.01"};
    d = load(base, 1, bias, 1);
    const model_family *f = d->d.family;
    assert_int_equal(model_mtp_layers(d), 0);
    assert_int_equal(f->layers_before_pipeline(d), 1);
    assert_int_equal(f->step_counts(d), 8 * 2);
    int moe = -1, dense = -1;
    for (int i = 0; i < d->nparams; i++) {
        if (strstr(d->defs[i].path, ".moe_layers.") && moe < 0) moe = i;
        if (strstr(d->defs[i].path, ".dense_layers.") && dense < 0) dense = i;
    }
    assert_true(moe >= 0 && dense >= 0);
    assert_true(f->param_pipelined(d, &d->defs[moe]));
    assert_false(f->param_pipelined(d, &d->defs[dense]));
    model_run_unload(d);
    const char *still[] = {"routed_bias_update_rate=0"};
    d = load(base, 1, still, 1);
    assert_int_equal(d->d.family->step_counts(d), 0);
    model_run_unload(d);
}

/* A two-stack family that is not DeepSeek: plan asks its row, not a key name it knows. */
static int other_depth_words(int64_t first, int64_t rest, char (*words)[MODEL_WORD_MAX], int cap)
{
    if (cap < 3) return 0;
    snprintf(words[0], MODEL_WORD_MAX, "base_num_decoder_layers=%lld", (long long)(first + rest));
    snprintf(words[1], MODEL_WORD_MAX, "first_k_dense_replace=%lld", (long long)first);
    snprintf(words[2], MODEL_WORD_MAX, "moe_layer_freq=1");
    return 3;
}

static void test_depth_words(void **state)
{
    (void)state;
    char w[4][MODEL_WORD_MAX];
    const model_family *llama = row("llama2"), *ds = row("deepseek");
    assert_non_null(llama);
    assert_non_null(ds);
    assert_int_equal(model_depth_words(llama, 0, 3, w, 4), 1);
    assert_string_equal(w[0], "base_num_decoder_layers=3");
    assert_int_equal(model_depth_words(ds, 1, 2, w, 4), 2);
    assert_string_equal(w[0], "base_num_decoder_layers=3");
    assert_string_equal(w[1], "first_num_dense_layers=1");
    const model_family other = {.name = "other", .depth_words = other_depth_words};
    assert_int_equal(model_depth_words(&other, 2, 1, w, 4), 3);
    assert_string_equal(w[1], "first_k_dense_replace=2");
    assert_string_equal(w[2], "moe_layer_freq=1");
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_table),
        cmocka_unit_test(test_llama_row),
        cmocka_unit_test(test_deepseek_row),
        cmocka_unit_test(test_depth_words),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
