/* test_mesh_costs.c — the cost records memory-bound ops leave for the step-time
 * model (mesh/nn.h mesh_nn_cost_memory, mesh/ad.c's add): RMSNorm, SwiGLU and
 * a residual add of a (B, T, E) activation sharded over the batch on 2
 * devices, forward and backward.  Expected elements per device from the local
 * shape (B/2 x T x E = n) and each op's reads and writes, counted by hand:
 *   rmsnorm: x read, y written (2n); its VJP: x and dy read, dx written (3n)
 *   swiglu:  gate and up read, out written (3n); VJP: gate, up, dy read,
 *            dgate and dup written (5n)
 *   add:     a and b read, y written (3n); no VJP cost (the cotangent passes on)
 * None has FLOPs or is a layout op; backward records carry the forward tag
 * with "/bwd". */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "mesh/ad.h"
#include "mesh/nn.h"
#include "tests/helpers.h"

enum { B = 4, T = 4, E = 8, N_LOCAL = B / 2 * T * E };

typedef struct {
    mesh_shape mesh;
    double el[8]; /* device 0's elements per tag below (-1: no record) */
    int bad;      /* records with FLOPs or the layout flag */
} cost_job;

static const char *const TAGS[] = {"costs/norm",    "costs/norm/bwd", "costs/act",
                                   "costs/act/bwd", "costs/resid",    "costs/resid/bwd"};
enum { NTAGS = 6 };

static sim_status cost_device(sim_device *dev, void *arg)
{
    cost_job *j = arg;
    mesh_ctx ctx = {.dev = dev, .mesh = &j->mesh, .mode = MESH_MODE_AUTO, .drop_size_one = true, .layer = "costs"};
    mesh_tape *t = mesh_tape_new(&ctx, true);
    mesh_spec xs, rep, reps;
    SIM_TRY(mesh_spec_parse("P('data', None, None)", &j->mesh, &xs));
    mesh_spec_init(&rep, 3);
    mesh_spec_init(&reps, 1);
    int64_t shape[3] = {B, T, E}, ss[1] = {E};
    mesh_array xa, sa, xsink, ssink;
    SIM_TRY(mesh_array_new(dev, &j->mesh, "x", 3, shape, &xs, SIM_F32, SIM_MEM_ACTIVATIONS, &xa));
    SIM_TRY(mesh_array_new(dev, &j->mesh, "scale", 1, ss, &reps, SIM_F32, SIM_MEM_PARAMS, &sa));
    SIM_TRY(mesh_array_new(dev, &j->mesh, "dx", 3, shape, &rep, SIM_F32, SIM_MEM_GRADS, &xsink));
    SIM_TRY(mesh_array_new(dev, &j->mesh, "dscale", 1, ss, &reps, SIM_F32, SIM_MEM_GRADS, &ssink));
    float *xv = xa.data, *sv = sa.data;
    for (size_t i = 0; i < xa.nlocal; i++) xv[i] = 0.01f * (float)(i % 17) - 0.05f;
    for (size_t i = 0; i < sa.nlocal; i++) sv[i] = 1.0f;
    mesh_var *x = mesh_tape_param(t, &xa, &xsink), *s = mesh_tape_param(t, &sa, &ssink), *y, *a, *r, *loss;
    SIM_TRY(mesh_nn_rmsnorm(t, x, s, 1e-6, "norm", &y));
    SIM_TRY(mesh_nn_swiglu(t, y, y, "act", &a));
    SIM_TRY(mesh_ad_add(t, a, x, "resid", &r));
    SIM_TRY(mesh_nn_mean(t, r, "mean", &loss));
    SIM_TRY(mesh_tape_backward(t, loss));
    if (sim_device_id(dev) == 0) {
        size_t n;
        const sim_cost *c = sim_device_costs(dev, &n);
        for (int k = 0; k < NTAGS; k++) j->el[k] = -1;
        for (size_t i = 0; i < n; i++) {
            for (int k = 0; k < NTAGS; k++)
                if (!strcmp(c[i].tag, TAGS[k])) j->el[k] = c[i].elements;
            if (c[i].flops != 0 || c[i].layout) j->bad++;
        }
    }
    mesh_tape_free(t);
    mesh_array_free(dev, &xa);
    mesh_array_free(dev, &sa);
    mesh_array_free(dev, &xsink);
    mesh_array_free(dev, &ssink);
    return SIM_OK;
}

static void test_memory_op_records(void **state)
{
    (void)state;
    cost_job j;
    memset(&j, 0, sizeof j);
    const char *names[] = {"data"};
    int two[] = {2};
    assert_int_equal(mesh_shape_init(&j.mesh, 1, names, two), SIM_OK);
    sim_machine *m = helper_machine(&j.mesh, false);
    sim_status st = sim_machine_run(m, cost_device, &j);
    sim_machine_free(m);
    if (st) fail_msg("run failed: %s", sim_errmsg());
    const double n = N_LOCAL;
    const double expect[NTAGS] = {2 * n, 3 * n, 3 * n, 5 * n, 3 * n, -1};
    for (int k = 0; k < NTAGS; k++)
        if (j.el[k] != expect[k]) fail_msg("%s: %g elements, expected %g", TAGS[k], j.el[k], expect[k]);
    assert_int_equal(j.bad, 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_memory_op_records),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
