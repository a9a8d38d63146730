/* test_models_model.c — models/core/model.h: a model definition from a config, on the tiny Llama
 * of tests/data/tiny-llama.yml (width 16, 2 layers, 4 query heads over 2 KV heads of 8, MLP 24,
 * vocabulary 64), every expectation from MaxText's Llama2 parameter tree written out by hand:
 *   - the parameters, their dotted paths, stacked shapes (layers at dim 1) and byte total
 *     (7504 float32 elements); lookup by path suffix;
 *   - their shardings under the base rules on fsdp=4 x tensor=2 (embed -> fsdp, heads and mlp ->
 *     tensor, vocab -> tensor), and a logical spec resolved on demand;
 *   - a device's state: parameters and gradients in the arena, each the elements of its shard
 *     (model_run_shard_elems: the global shape over the sizes of the axes that split it) x 4 bytes;
 *   - refusals name the key: query heads that the KV heads do not divide, a mesh whose devices do
 *     not match num_devices. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <string.h>

#include "models/core/model.h"
#include "tests/helpers.h"
#include "tests/model_run.h"

static const char *const TINY[] = {TINY_LLAMA_YML};
enum { ROWS = 8 };

typedef struct {
    const char *path;
    int rank;
    int64_t shape[4];
    const char *spec; /* on fsdp=4 x tensor=2 */
} want_param;

static const want_param WANT[] = {
    {"params.token_embedder.embedding", 2, {64, 16}, "P('tensor', 'fsdp')"},
    {"params.decoder.layers.pre_self_attention_layer_norm.scale", 2, {16, 2}, "P('tensor', None)"},
    {"params.decoder.layers.self_attention.query.kernel", 4, {16, 2, 4, 8}, "P('fsdp', None, 'tensor', None)"},
    {"params.decoder.layers.self_attention.key.kernel", 4, {16, 2, 2, 8}, "P('fsdp', None, 'tensor', None)"},
    {"params.decoder.layers.self_attention.value.kernel", 4, {16, 2, 2, 8}, "P('fsdp', None, 'tensor', None)"},
    {"params.decoder.layers.self_attention.out.kernel", 4, {4, 2, 8, 16}, "P('tensor', None, None, 'fsdp')"},
    {"params.decoder.layers.post_self_attention_layer_norm.scale", 2, {16, 2}, "P('tensor', None)"},
    {"params.decoder.layers.mlp.wi_0.kernel", 3, {16, 2, 24}, "P('fsdp', None, 'tensor')"},
    {"params.decoder.layers.mlp.wi_1.kernel", 3, {16, 2, 24}, "P('fsdp', None, 'tensor')"},
    {"params.decoder.layers.mlp.wo.kernel", 3, {24, 2, 16}, "P('tensor', None, 'fsdp')"},
    {"params.decoder.decoder_norm.scale", 1, {16}, "P('tensor',)"}, /* a one-entry tuple, as Python prints it */
    {"params.decoder.logits_dense.kernel", 2, {16, 64}, "P('fsdp', 'tensor')"},
};
enum { NWANT = sizeof WANT / sizeof WANT[0] };

static model_def *load_8(void)
{
    const char *mesh[] = {"ici_fsdp_parallelism=4", "ici_tensor_parallelism=2"};
    return model_run_load(TINY, 1, ROWS, mesh, 2, 8, 0, NULL);
}

static void test_parameters(void **state)
{
    (void)state;
    model_def *d = load_8();
    assert_int_equal(d->nparams, NWANT);
    uint64_t elems = 0;
    for (int k = 0; k < NWANT; k++) {
        int i = model_param_index(d, WANT[k].path);
        if (i < 0) fail_msg("no parameter %s", WANT[k].path);
        assert_string_equal(d->defs[i].path, WANT[k].path);
        assert_int_equal(d->defs[i].rank, WANT[k].rank);
        uint64_t n = 1;
        for (int r = 0; r < WANT[k].rank; r++) {
            assert_int_equal(d->defs[i].shape[r], WANT[k].shape[r]);
            n *= (uint64_t)WANT[k].shape[r];
        }
        elems += n;
        assert_int_equal(d->defs[i].scan_dim, strstr(WANT[k].path, ".layers.") ? 1 : -1);
        char buf[128];
        mesh_spec_format(&d->spec[i], &d->mesh, buf, sizeof buf);
        if (strcmp(buf, WANT[k].spec)) fail_msg("%s: %s, expected %s", WANT[k].path, buf, WANT[k].spec);
    }
    assert_int_equal(elems, 7504);
    assert_int_equal(model_param_bytes(d), 4 * 7504);
    assert_true(model_param_index(d, "mlp.wo.kernel") == model_param_index(d, WANT[9].path));
    assert_int_equal(model_param_index(d, "no.such.kernel"), -1);
    /* a logical spec on demand: activation_batch -> fsdp, activation_embed -> tensor */
    static const char *const names[] = {"activation_batch", "activation_length", "activation_embed"};
    mesh_spec s;
    assert_int_equal(model_logical_spec(d, "x", 3, names, &s), SIM_OK);
    char buf[128];
    mesh_spec_format(&s, &d->mesh, buf, sizeof buf);
    assert_string_equal(buf, "P('fsdp', None, 'tensor')");
    model_run_unload(d);
}

typedef struct {
    const model_def *def;
    uint64_t params_bytes[8], grads_bytes[8];
} dev_job;

static sim_status dev_device(sim_device *dev, void *arg)
{
    dev_job *j = arg;
    sim_arena_stats a, b;
    sim_arena_get_stats(sim_device_arena(dev), &a);
    model_dev md;
    SIM_TRY(model_dev_init(&md, j->def, dev, true, false));
    sim_arena_get_stats(sim_device_arena(dev), &b);
    j->params_bytes[sim_device_id(dev)] = b.live_by[SIM_MEM_PARAMS] - a.live_by[SIM_MEM_PARAMS];
    j->grads_bytes[sim_device_id(dev)] = b.live_by[SIM_MEM_GRADS] - a.live_by[SIM_MEM_GRADS];
    model_dev_free(&md);
    return SIM_OK;
}

static void test_device_state(void **state)
{
    (void)state;
    model_def *d = load_8();
    uint64_t want = 0;
    for (int i = 0; i < d->nparams; i++) want += 4 * model_run_shard_elems(d, i, NULL);
    dev_job j = {.def = d};
    sim_machine *m;
    assert_int_equal(model_machine_new(d, 0, false, &m), SIM_OK);
    sim_status st = sim_machine_run(m, dev_device, &j);
    sim_machine_free(m);
    if (st != SIM_OK) fail_msg("%s", sim_errmsg());
    for (int k = 0; k < 8; k++) {
        assert_int_equal(j.params_bytes[k], want);
        assert_int_equal(j.grads_bytes[k], want);
    }
    model_run_unload(d);
}

static void test_refusals(void **state)
{
    (void)state;
    const char *heads[] = {"base_num_query_heads=3"};
    model_run_expect_refused(TINY, 1, ROWS, heads, 1, 1, "base_num_query_heads", "base_num_kv_heads");
    const char *devices[] = {"num_devices=8", "ici_fsdp_parallelism=3"};
    model_run_expect_refused(TINY, 1, ROWS, devices, 2, 8, "ici_fsdp_parallelism", "8");
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_parameters),
        cmocka_unit_test(test_device_state),
        cmocka_unit_test(test_refusals),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
