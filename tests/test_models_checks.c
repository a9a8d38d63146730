/* test_models_checks.c — models/core/checks.h: MaxText's sharding checks on a tiny Llama
 * (tests/data/tiny-llama.yml):
 *   - sharding_tolerance: MaxText's share (unsharded elements over total bytes) on meshes where
 *     it is known by hand, the error text, and no check without a sharding axis;
 *   - the commands: train and parity stop with exit 1 above the tolerance; train prints the
 *     shardings with debug_sharding;
 *   - debug_sharding prints parameter and activation shardings in MaxText's wording. */
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
#include "models/core/checks.h"
#include "tests/cli_capture.h"
#include "tests/helpers.h"
#include "tests/model_run.h"

/* tests/data/tiny-llama.yml with a fixed seed and the z-loss */
static const char *const TINY[] = {TINY_LLAMA_YML, "init_weights_seed=7", "z_loss_multiplier=0.001"};
enum { NTINY = sizeof TINY / sizeof TINY[0], ROWS = 8, SEQ = 16, VOCAB = 64 };

static model_def *load(const char *const *extra, int n, int devices)
{
    return model_run_load(TINY, NTINY, ROWS, extra, n, devices, 0, NULL);
}

/* One forward and backward pass (the forward logs the activations' shardings). */
static void run(const model_def *def)
{
    model_run_batch b;
    model_run_batch_make(&b, ROWS, SEQ, VOCAB);
    model_run_loss_grads(def, b.in, b.tg, b.pos, NULL, NULL, NULL);
}

static void test_sharding_tolerance(void **state)
{
    (void)state;
    /* data only: no axis of the check has more than one device, MaxText skips it */
    const char *data8[] = {"ici_data_parallelism=8", "ici_fsdp_parallelism=1"};
    model_def *d = load(data8, 2, 8);
    assert_true(model_unsharded_share(d) == -1.0);
    assert_int_equal(model_check_sharding_tolerance(d, 0.0), SIM_OK);
    model_run_unload(d);
    /* no rule shards a parameter on context_autoregressive: every element is "unsharded", and
     * MaxText divides elements by float32 bytes: 1/4 */
    const char *car[] = {"ici_fsdp_parallelism=4", "ici_context_autoregressive_parallelism=2"};
    d = load(car, 2, 8);
    assert_true(model_unsharded_share(d) == 0.25);
    assert_int_equal(model_check_sharding_tolerance(d, 0.3), SIM_OK);
    assert_int_equal(model_check_sharding_tolerance(d, 0.02), SIM_ERR_CHECK);
    assert_non_null(strstr(sim_errmsg(), "Unsharded parameter percentage (25.00%)exceeds tolerance (2.00%)."));
    assert_non_null(strstr(sim_errmsg(), "is unsharded on axis: ['context_autoregressive']"));
    assert_non_null(strstr(sim_errmsg(), "raise sharding_tolerance"));
    model_run_unload(d);
    /* fsdp=8: only the norm scales (logical 'norm') stay unsharded on fsdp: 2 x (16 x 2) + 16 = 80
     * elements of 64*16*2 (embedding, logits) + 16*2*4*8*2 (query, out) + 16*2*2*8*2 (key, value)
     * + 16*2*24*3 (mlp) + 80 = 7504 */
    const char *f8[] = {"ici_fsdp_parallelism=8"};
    d = load(f8, 1, 8);
    double share = model_unsharded_share(d);
    model_run_unload(d);
    if (fabs(share - 80.0 / (4.0 * 7504.0)) > 1e-12)
        fail_msg("fsdp=8: share %.8g, want %.8g", share, 80.0 / (4.0 * 7504.0));
}

/* The commands: train and parity stop with exit 1 above the tolerance; train prints the shardings. */
static void test_checks_in_commands(void **state)
{
    (void)state;
    const char *argv[24];
    int argc = 0;
    for (int i = 0; i < NTINY; i++) argv[argc++] = TINY[i];
    argv[argc++] = "per_device_batch_size=1";
    argv[argc++] = "steps=1";
    argv[argc++] = "ici_fsdp_parallelism=4";
    argv[argc++] = "ici_context_autoregressive_parallelism=2";
    cli_capture r = cli_capture_run(cli_train, argc, argv);
    assert_int_equal(r.rc, 1);
    assert_non_null(strstr(r.err, "Unsharded parameter percentage (25.00%)exceeds tolerance (2.00%)."));
    assert_null(strstr(r.out, "step")); /* stopped before training */
    cli_capture_free(&r);
    argv[argc] = "configs=sharding_tolerance=0.3;sharding_tolerance=0.02";
    r = cli_capture_run(cli_cmd_parity, argc + 1, argv);
    assert_int_equal(r.rc, 1);
    assert_non_null(strstr(r.err, "exceeds tolerance (2.00%)"));
    cli_capture_free(&r);
    argv[argc - 1] = "ici_tensor_parallelism=2";
    argv[argc] = "debug_sharding=true";
    r = cli_capture_run(cli_train, argc + 1, argv);
    assert_int_equal(r.rc, 0);
    assert_non_null(strstr(r.out, "debug_sharding:\nfsdp: 4\ntensor: 2\n"));
    assert_non_null(strstr(r.out, " params/decoder/logits_dense/kernel\n    Shape:     float32[16,64]\n"));
    cli_capture_free(&r);
}

static void test_debug_sharding(void **state)
{
    (void)state;
    const char *k[] = {"ici_fsdp_parallelism=4", "ici_tensor_parallelism=2"};
    model_def *d = load(k, 2, 8);
    run(d); /* the forward pass logs the activations */
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    model_print_shardings(d, "bfloat16", f);
    fclose(f);
    model_run_unload(d);
    /* base rules: embed -> fsdp, q_heads -> tensor; activation_batch -> fsdp, activation_embed -> tensor */
    assert_non_null(strstr(buf, "fsdp: 4\ntensor: 2\n"));
    assert_non_null(strstr(buf, " params/decoder/layers/self_attention/query/kernel\n    Shape:     float32[16,2,4,8]\n"
                                "    Physical:  ('fsdp', None, 'tensor', None)\n"));
    char want[256];
    snprintf(want, sizeof want, "llama2/inputs Physical: bfloat16[8,16,16]%.*s ('fsdp', None, 'tensor').\n", 60 - 17,
             "............................................................");
    assert_non_null(strstr(buf, want));
    assert_non_null(strstr(buf, "('activation_batch', 'activation_norm_length', 'activation_embed').\n"));
    free(buf);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_sharding_tolerance),
        cmocka_unit_test(test_checks_in_commands),
        cmocka_unit_test(test_debug_sharding),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
