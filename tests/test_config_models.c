/* test_config_models.c — model files and decoder blocks (config/models.c): the model files of a
 * configs dir listed by name with their block; a block MaxText has and shardsim does not simulate
 * refuses the model by its block, with decoder_blocks.yml's description; a model's key changed by
 * the user needs override_model_config; and loss-free load balancing is allowed for the blocks
 * decoder_blocks.yml marks, whatever their name (data, not a name compiled in). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "config/config.h"
#include "config/models.h"
#include "tests/config_fixture.h"

static void test_model_files(void **state)
{
    (void)state;
    char *dir = cfgt_copy_configs();
    char cmd[512];
    snprintf(cmd, sizeof cmd, "rm -f '%s'/models/*.yml", dir);
    assert_int_equal(system(cmd), 0);
    free(cfgt_write(dir, "models/zeta.yml", "decoder_block: gemma2\nbase_emb_dim: 64\n"));
    free(cfgt_write(dir, "models/alpha.yml", "base_emb_dim: 64\n"));
    char base[512];
    snprintf(base, sizeof base, "%s/base.yml", dir);
    cfg_config *cfg = cfgt_load_ok(base, 0, NULL);
    cfg_model_file *m;
    int n;
    assert_int_equal(cfg_model_files(cfg, &m, &n), SIM_OK);
    assert_int_equal(n, 2);
    assert_string_equal(m[0].name, "alpha");
    assert_string_equal(m[0].block, "llama2"); /* keys.yml's decoder_block default */
    assert_string_equal(m[1].name, "zeta");
    assert_string_equal(m[1].block, "gemma2");
    cfg_model_files_free(m, n);
    assert_true(cfg_block_simulated(cfg, "deepseek"));
    assert_true(cfg_block_simulated(cfg, "mixtral"));
    assert_false(cfg_block_simulated(cfg, "gemma2"));
    char *about = cfg_block_about(cfg, "gemma2");
    assert_non_null(about);
    assert_contains(about, "models/gemma2.py Gemma2DecoderLayer: ");
    free(about);
    assert_null(cfg_block_about(cfg, "no_such_block"));
    cfg_free(cfg);
    /* the model of an unsimulated block is refused by the block, before its keys */
    const char *o[] = {"model_name=zeta"};
    assert_int_equal(cfgt_load(base, NULL, 1, o, &cfg), SIM_ERR_INPUT);
    assert_contains(sim_errmsg(), "model_name=zeta is refused");
    assert_contains(sim_errmsg(), "decoder_block=gemma2");
    assert_contains(sim_errmsg(), "Gemma2DecoderLayer");
    /* an unknown model lists the models by block */
    const char *o2[] = {"model_name=beta"};
    assert_int_equal(cfgt_load(base, NULL, 1, o2, &cfg), SIM_ERR_INPUT);
    assert_contains(sim_errmsg(), "llama2 (simulated): alpha; gemma2 (not simulated): zeta");
    cfgt_rmdir(dir);
}

static void test_override_model_config(void **state)
{
    (void)state;
    cfg_config *cfg;
    const char *o[] = {"model_name=deepseek3-tiny", "base_num_decoder_layers=3"};
    assert_int_equal(cfgt_load(NULL, NULL, 2, o, &cfg), SIM_ERR_INPUT);
    assert_contains(sim_errmsg(), "key 'base_num_decoder_layers' is set by the model file");
    assert_contains(sim_errmsg(), "override_model_config=true");
    const char *o2[] = {"model_name=deepseek3-tiny", "base_num_decoder_layers=3", "override_model_config=true"};
    cfg = cfgt_load_ok(NULL, 3, o2);
    assert_string_equal(cfg_find(cfg, "base_num_decoder_layers")->where, "command line");
    assert_true(cfg_find(cfg, "base_num_decoder_layers")->from_user);
    cfg_free(cfg);
}

/* routed_bias_update_rate > 0 (loss-free load balancing): MaxText types.py allows it for DeepSeek's
 * blocks only; which blocks is decoder_blocks.yml's loss_free_balancing. */
static void test_loss_free_balancing_is_data(void **state)
{
    (void)state;
    const char *moe[] = {"num_experts=4",    "base_moe_mlp_dim=64",         "first_num_dense_layers=1",
                         "routed_bias=true", "routed_bias_update_rate=0.1", "decoder_block=llama2"};
    cfg_config *cfg;
    assert_int_equal(cfgt_load(NULL, NULL, 6, moe, &cfg), SIM_ERR_INPUT);
    assert_contains(sim_errmsg(), "routed_bias_update_rate=0.1 with decoder_block=llama2");
    assert_contains(sim_errmsg(), "only for the DeepSeek decoder");
    moe[5] = "decoder_block=deepseek";
    cfg = cfgt_load_ok(NULL, 6, moe);
    cfg_free(cfg);
    /* mark llama2 in a copy of configs/: the same config is accepted there */
    char *dir = cfgt_copy_configs();
    char cmd[512];
    snprintf(cmd, sizeof cmd,
             "sed -i 's/^  llama2: {\\(.*\\)}$/  llama2: {\\1, loss_free_balancing: true}/' '%s/decoder_blocks.yml'",
             dir);
    assert_int_equal(system(cmd), 0);
    char base[512];
    snprintf(base, sizeof base, "%s/base.yml", dir);
    moe[5] = "decoder_block=llama2";
    cfg = cfgt_load_ok(base, 6, moe);
    cfg_free(cfg);
    cfgt_rmdir(dir);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_model_files),
        cmocka_unit_test(test_override_model_config),
        cmocka_unit_test(test_loss_free_balancing_is_data),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
