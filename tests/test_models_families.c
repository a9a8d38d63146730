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
 *     only DeepSeek's MoE weights are pipelined. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <string.h>

#include "config/config.h"
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
    mesh_cfg *cfg = NULL;
    if (mesh_cfg_load_argv("configs/base.yml", 0, NULL, &cfg) != SIM_OK) fail_msg("%s", sim_errmsg());
    for (int i = 0; i < model_n_families; i++) {
        const model_family *f = model_families[i];
        assert_non_null(f->name);
        assert_non_null(f->define);
        assert_non_null(f->loss);
        assert_true(mesh_cfg_block_simulated(cfg, f->name));
        for (int j = 0; j < i; j++) assert_string_not_equal(f->name, model_families[j]->name);
    }
    assert_non_null(row("llama2"));
    assert_non_null(row("deepseek"));
    assert_false(mesh_cfg_block_simulated(cfg, "gemma"));
    assert_null(row("gemma"));
    mesh_cfg_free(cfg);
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

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_table),
        cmocka_unit_test(test_llama_row),
        cmocka_unit_test(test_deepseek_row),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
