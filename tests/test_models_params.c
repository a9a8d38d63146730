/* test_models_params.c — models/core/params.h: parameters as MaxText names and shapes them, and how
 * a device stores them, on hand-made parameters (expected values from the stacking rule):
 *   - a scanned weight (16, layers 3, 24) stacked at dim 1: its per-layer shape is (16, 24) and
 *     spec P('fsdp', 'tensor') for the stacked P('fsdp', None, 'tensor'), and back;
 *   - unscanned, MaxText's tensors are one per layer, named layers_<l> with the scan dim dropped;
 *   - pipelined over 2 stages with 4 layers, one per stage and repeat: the stacked order is
 *     stage-major (positions 0, 1, 2, 3 hold layers 0, 2, 1, 3) and a device holds the layers of
 *     its own stage (l % 2 = its stage coordinate);
 *   - stack then unstack on 2 devices over fsdp is the identity, and the stacked array holds layer
 *     l at index l of the scan dim (values l * 1000 + element). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <string.h>

#include "models/core/params.h"
#include "tests/helpers.h"

enum { E = 16, L = 3, F = 24 };

static model_param wo_param(const mesh_shape *m, const char *spec)
{
    model_param p;
    memset(&p, 0, sizeof p);
    snprintf(p.def.path, sizeof p.def.path, "params.decoder.layers.mlp.wo.kernel");
    p.def.rank = 3;
    p.def.shape[0] = E, p.def.shape[1] = L, p.def.shape[2] = F;
    p.def.scan_dim = 1;
    p.n_layers = L;
    p.spec = helper_spec(m, spec);
    return p;
}

static mesh_shape fsdp_tensor(void)
{
    static const char *const names[] = {"fsdp", "tensor"};
    static const int sizes[] = {2, 2};
    return helper_mesh(2, names, sizes);
}

static void test_layer_shape_and_spec(void **state)
{
    (void)state;
    mesh_shape m = fsdp_tensor();
    model_param p = wo_param(&m, "P('fsdp', None, 'tensor')");
    int rank;
    int64_t shape[MESH_SPEC_MAX_RANK];
    model_param_layer_shape(&p, &rank, shape);
    assert_int_equal(rank, 2);
    assert_int_equal(shape[0], E);
    assert_int_equal(shape[1], F);
    mesh_spec ls, back;
    model_param_layer_spec(&p, &ls);
    char buf[128];
    mesh_spec_format(&ls, &m, buf, sizeof buf);
    assert_string_equal(buf, "P('fsdp', 'tensor')");
    model_param_stacked_spec(&p, &ls, &back);
    mesh_spec_format(&back, &m, buf, sizeof buf);
    assert_string_equal(buf, "P('fsdp', None, 'tensor')");
}

static void test_unscanned_tensors(void **state)
{
    (void)state;
    mesh_shape m = fsdp_tensor();
    model_param p = wo_param(&m, "P('fsdp', None, 'tensor')");
    assert_int_equal(model_param_def_tensors(&p.def), 1);
    p.def.unscanned = true;
    assert_int_equal(model_param_def_tensors(&p.def), L);
    model_param_def t;
    mesh_spec ts;
    model_param_def_tensor(&p.def, &p.spec, 2, &t, &ts);
    assert_string_equal(t.path, "params.decoder.layers_2.mlp.wo.kernel");
    assert_int_equal(t.rank, 2);
    assert_int_equal(t.shape[0], E);
    assert_int_equal(t.shape[1], F);
    char buf[128];
    mesh_spec_format(&ts, &m, buf, sizeof buf);
    assert_string_equal(buf, "P('fsdp', 'tensor')");
}

static void test_pipelined_order(void **state)
{
    (void)state;
    static const char *const names[] = {"stage", "fsdp"};
    static const int sizes[] = {2, 2};
    mesh_shape m = helper_mesh(2, names, sizes);
    model_param p;
    memset(&p, 0, sizeof p);
    p.def.rank = 3;
    p.def.shape[0] = E, p.def.shape[1] = 4, p.def.shape[2] = F;
    p.def.scan_dim = 1;
    p.n_layers = 4;
    p.stage_span = 1;
    assert_int_equal(mesh_spec_parse("P('fsdp', 'stage', None)", &m, &p.spec), SIM_OK);
    static const int64_t order[4] = {0, 2, 1, 3};
    for (int q = 0; q < 4; q++) assert_int_equal(model_param_stack_layer(&m, &p, q), order[q]);
    for (int d = 0; d < 4; d++) {
        int c[2];
        mesh_shape_coords(&m, d, c);
        for (int l = 0; l < 4; l++) assert_int_equal(model_param_holds_layer(&m, &p, d, l), l % 2 == c[0]);
    }
    /* not pipelined: the identity, every layer everywhere */
    p.stage_span = 0;
    for (int q = 0; q < 4; q++) assert_int_equal(model_param_stack_layer(&m, &p, q), q);
    for (int d = 0; d < 4; d++) assert_true(model_param_holds_layer(&m, &p, d, 3));
}

typedef struct {
    mesh_shape mesh;
    model_param p;
    float stacked[E * L * F];
    int bad[2];
} stack_job;

static sim_status stack_device(sim_device *dev, void *arg)
{
    stack_job *j = arg;
    const mesh_shape *m = &j->mesh;
    mesh_spec ls;
    model_param_layer_spec(&j->p, &ls);
    int64_t shape[2] = {E, F};
    mesh_array layers[L], back[L], st;
    float g[E * F];
    for (int l = 0; l < L; l++) {
        SIM_TRY(mesh_array_new(dev, m, "w", 2, shape, &ls, SIM_F32, SIM_MEM_PARAMS, &layers[l]));
        SIM_TRY(mesh_array_new(dev, m, "back", 2, shape, &ls, SIM_F32, SIM_MEM_PARAMS, &back[l]));
        for (int i = 0; i < E * F; i++) g[i] = (float)(l * 1000 + i);
        mesh_array_load_global(dev, m, &layers[l], g);
    }
    SIM_TRY(model_param_stack(dev, m, &j->p, layers, "stacked", SIM_MEM_TEMP, &st));
    SIM_TRY(mesh_array_store_global(dev, m, &st, j->stacked));
    model_param_unstack(dev, m, &j->p, &st, back);
    for (int l = 0; l < L; l++) {
        if (memcmp(back[l].data, layers[l].data, layers[l].nlocal * sizeof(float))) j->bad[sim_device_id(dev)]++;
        mesh_array_free(dev, &layers[l]);
        mesh_array_free(dev, &back[l]);
    }
    mesh_array_free(dev, &st);
    return SIM_OK;
}

static void test_stack_unstack(void **state)
{
    (void)state;
    static stack_job j;
    memset(&j, 0, sizeof j);
    static const char *const names[] = {"fsdp"};
    static const int sizes[] = {2};
    j.mesh = helper_mesh(1, names, sizes);
    j.p = wo_param(&j.mesh, "P('fsdp', None, None)");
    sim_machine *m = helper_machine(&j.mesh, false);
    sim_status st = sim_machine_run(m, stack_device, &j);
    sim_machine_free(m);
    if (st != SIM_OK) fail_msg("%s", sim_errmsg());
    assert_int_equal(j.bad[0] + j.bad[1], 0);
    for (int e = 0; e < E; e++)
        for (int l = 0; l < L; l++)
            for (int f = 0; f < F; f++) assert_true(j.stacked[(e * L + l) * F + f] == (float)(l * 1000 + e * F + f));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_layer_shape_and_spec),
        cmocka_unit_test(test_unscanned_tensors),
        cmocka_unit_test(test_pipelined_order),
        cmocka_unit_test(test_stack_unstack),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
