/* test_models_accum.c — einsum VJP contributions added into an existing cotangent by sgemm itself
 * (beta = 1, mesh_einsum_into) instead of made apart and added (mesh_tape_accumulate), on Llama:
 *   - the fused path is taken: in each decoder layer the normed input feeds q, k and v (two
 *     contributions join the first) and the MLP's wi_0 and wi_1 (one joins), so 3 per layer,
 *     device and pass, on one device and on fsdp=2 x tensor=2, auto and explicit mode (there every
 *     contribution comes out partial over tensor, as the sum it joins);
 *   - the collectives (every record, its bytes) and the arena's figures (peak, per-category peaks
 *     and breakdown, live, allocation count) are those of the separate add, in a real run and in
 *     a dry run, which takes the same decisions without data;
 *   - losses and every gradient agree with the separate add within the parity tolerance (rtol
 *     1e-4): the two differ only in where the old value joins each dot product (bound derived per
 *     product in test_mesh_accum), which a training step carries through the rest of backward.
 *     The MLP is wide (1024) so that the wi_1 contribution's dot products span more than one of
 *     sgemm's K blocks on one device: there the bits do differ (about 5e-7 relative at worst on
 *     this machine's kernel); a single block adds the old value last either way. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <string.h>

#include "mesh/ad.h"
#include "sim/arena.h"
#include "tests/model_run.h"

static const char *const TINY[] = {
    "model_name=llama2-7b",   "override_model_config=true", "base_emb_dim=16",
    "base_num_query_heads=4", "base_num_kv_heads=4",        "head_dim=8",
    "base_mlp_dim=1024",      "base_num_decoder_layers=2",  "vocab_size=64",
    "max_target_length=16",   "learning_rate=1e-2",
};
enum { NTINY = sizeof TINY / sizeof TINY[0], ROWS = 8, LAYERS = 2, STEPS = 2, PER_LAYER = 3 };

/* Trains STEPS steps (with gradients unless dry) with the fused path on or off; returns the
 * contributions fused meanwhile.  The run stays open for comparison. */
static long long train(model_run *r, const char *const *extra, int n, int devices, bool fuse, bool grads)
{
    mesh_ad_set_fuse(fuse);
    model_run_open(r, TINY, NTINY, ROWS, extra, n, devices, STEPS);
    long long before = mesh_ad_fused_count();
    model_run_train(r, grads);
    mesh_ad_set_fuse(true);
    return mesh_ad_fused_count() - before;
}

static void fused_vs_separate(const char *what, const char *const *extra, int n, int devices)
{
    model_run on, off;
    long long fused = train(&on, extra, n, devices, true, true);
    long long none = train(&off, extra, n, devices, false, true);
    printf("%s: %lld contributions fused\n", what, fused);
    assert_int_equal(fused, (long long)PER_LAYER * LAYERS * devices * STEPS);
    assert_int_equal(none, 0);
    model_run_expect_same_records(what, &on, &off, devices, 0);
    model_run_compare(what, &on, &off, STEPS);
    model_run_close(&on);
    model_run_close(&off);
}

static void test_one_device(void **state)
{
    (void)state;
    fused_vs_separate("1 device", NULL, 0, 1);
}

static void test_fsdp_tensor(void **state)
{
    (void)state;
    const char *mesh[] = {"ici_fsdp_parallelism=2", "ici_tensor_parallelism=2"};
    fused_vs_separate("fsdp=2 tensor=2", mesh, 2, 4);
}

/* explicit mode resolves the forward's einsums by JAX's dot_general rule; the backward runs as auto
 * mode (mesh_tape_backward_from) and fuses alike */
static void test_fsdp_tensor_explicit(void **state)
{
    (void)state;
    const char *mesh[] = {"ici_fsdp_parallelism=2", "ici_tensor_parallelism=2", "shard_mode=explicit"};
    fused_vs_separate("fsdp=2 tensor=2 explicit", mesh, 3, 4);
}

static void test_dry_run_decides_alike(void **state)
{
    (void)state;
    const char *real[] = {"ici_fsdp_parallelism=2", "ici_tensor_parallelism=2"};
    const char *dry[] = {"ici_fsdp_parallelism=2", "ici_tensor_parallelism=2", "dry_run=true"};
    model_run a, b;
    long long fa = train(&a, real, 2, 4, true, false), fb = train(&b, dry, 3, 4, true, false);
    assert_int_equal(fa, fb);
    assert_true(fa > 0);
    model_run_expect_same_records("dry run", &a, &b, 4, 0);
    model_run_close(&a);
    model_run_close(&b);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_one_device),
        cmocka_unit_test(test_fsdp_tensor),
        cmocka_unit_test(test_fsdp_tensor_explicit),
        cmocka_unit_test(test_dry_run_decides_alike),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
