/* test_mesh_tape.c — mesh/tape.h: reverse-mode autodiff over sharded ops, on 2 devices (mesh axis
 * 'data'), with small integer-valued data so every expected gradient is exact:
 *   - an op written against the tape's public API (mesh_tape_record, a VJP that makes its
 *     cotangent with mesh_tape_zeros and hands it to mesh_tape_accumulate) gets y = 3 x's
 *     gradient 3 c exactly; a value used twice gets the sum of both contributions;
 *   - backward from a scalar (cotangent 1): the mean's gradient is 1/n everywhere;
 *   - a parameter's sink is added to, not overwritten: two backward passes leave twice the
 *     gradient;
 *   - a weight gradient left partial over 'data' by a batch-sharded product is reduced onto the
 *     parameter's own sharding: dw = x^T c (computed here in integers) on a weight sharded over
 *     'data', with a reduce-scatter over 'data' in device 0's backward records;
 *   - a tape that does not record makes no entries; mesh_tape_take hands a value to the caller;
 *     freeing the tape gives back every byte it took (the arena's live bytes as before). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <string.h>

#include "mesh/ad.h"
#include "mesh/nn.h"
#include "tests/helpers.h"

enum { NDEV = 2, R = 4, C = 8, K = 3 }; /* R x C = 32: the mean's 1/32 is exact */

typedef struct {
    mesh_shape mesh;
    float x[R * C], c[R * C];    /* inputs and the cotangent, global */
    float dx[R * C], dx2[R * C]; /* results, global */
    float w[C * K], cw[R * K], dw[C * K];
    float mean_grad[R * C];
    bool no_entry, took, leak_free;
    int rs_backward; /* device 0's backward reduce-scatters over 'data' */
} job;

/* ---- y = 3 x, written as a user of the tape would write an op */

static sim_status triple_vjp(mesh_tape *t, mesh_entry *e)
{
    mesh_var *x = e->in[0], *y = e->out[0];
    mesh_array g;
    SIM_TRY(mesh_tape_zeros(t, "triple/dx", y->grad.rank, y->grad.shape, &y->grad.spec, SIM_MEM_TEMP, &g));
    const float *dy = y->grad.data;
    float *dx = g.data;
    for (size_t i = 0; i < g.nlocal; i++) dx[i] = 3.0f * dy[i];
    return mesh_tape_accumulate(t, x, &g, e->tag);
}

static sim_status triple(mesh_tape *t, mesh_var *x, mesh_var **out)
{
    mesh_ctx *ctx = mesh_tape_ctx(t);
    mesh_var *y = mesh_tape_var(t);
    SIM_TRY(mesh_array_new(ctx->dev, ctx->mesh, "triple", x->val.rank, x->val.shape, &x->val.spec, SIM_F32,
                           SIM_MEM_ACTIVATIONS, &y->val));
    const float *a = x->val.data;
    float *b = y->val.data;
    for (size_t i = 0; i < y->val.nlocal; i++) b[i] = 3.0f * a[i];
    mesh_entry *e = mesh_tape_record(t, triple_vjp, "test/triple", 1, &x, 1, &y);
    (void)e;
    *out = y;
    return SIM_OK;
}

static size_t live(sim_device *dev)
{
    sim_arena_stats s;
    sim_arena_get_stats(sim_device_arena(dev), &s);
    return s.live;
}

static sim_status tape_device(sim_device *dev, void *arg)
{
    job *j = arg;
    const mesh_shape *m = &j->mesh;
    mesh_ctx ctx = {.dev = dev, .mesh = m, .mode = MESH_MODE_AUTO, .drop_size_one = true, .layer = "test"};
    mesh_spec rows, rep;
    SIM_TRY(mesh_spec_parse("P('data', None)", m, &rows));
    mesh_spec_init(&rep, 2);
    int64_t shape[2] = {R, C};
    mesh_array xa, sink, cot;
    SIM_TRY(mesh_array_new(dev, m, "x", 2, shape, &rows, SIM_F32, SIM_MEM_ACTIVATIONS, &xa));
    mesh_array_load_global(dev, m, &xa, j->x);
    SIM_TRY(mesh_array_new(dev, m, "dx", 2, shape, &rows, SIM_F32, SIM_MEM_GRADS, &sink));
    size_t base = live(dev);

    /* 1. y = 3x + 3x (x used twice through the same op): dx = 6 c; twice over the same sink: 12 c */
    for (int pass = 0; pass < 2; pass++) {
        mesh_tape *t = mesh_tape_new(&ctx, true);
        mesh_var *x = mesh_tape_param(t, &xa, &sink), *y1, *y2, *y;
        SIM_TRY(triple(t, x, &y1));
        SIM_TRY(triple(t, x, &y2));
        SIM_TRY(mesh_ad_add(t, y1, y2, "sum", &y));
        SIM_TRY(mesh_array_new(dev, m, "cot", 2, shape, &y->val.spec, SIM_F32, SIM_MEM_TEMP, &cot));
        mesh_array_load_global(dev, m, &cot, j->c);
        SIM_TRY(mesh_tape_backward_from(t, y, &cot));
        SIM_TRY(mesh_array_store_global(dev, m, &sink, pass ? j->dx2 : j->dx));
        mesh_tape_free(t);
    }
    bool leak_free = live(dev) == base;

    /* 2. the mean: d mean / dx = 1 / (R C) */
    {
        mesh_array g;
        SIM_TRY(mesh_array_new(dev, m, "dmean", 2, shape, &rows, SIM_F32, SIM_MEM_GRADS, &g));
        mesh_tape *t = mesh_tape_new(&ctx, true);
        mesh_var *x = mesh_tape_param(t, &xa, &g), *loss;
        SIM_TRY(mesh_nn_mean(t, x, "mean", &loss));
        SIM_TRY(mesh_tape_backward(t, loss));
        SIM_TRY(mesh_array_store_global(dev, m, &g, j->mean_grad));
        mesh_tape_free(t);
        mesh_array_free(dev, &g);
    }

    /* 3. dw of y = x w with x batch-sharded and w sharded over 'data' on its rows: partial over
     * 'data' before the reduction, reduce-scattered onto w's spec */
    {
        mesh_spec wspec;
        SIM_TRY(mesh_spec_parse("P('data', None)", m, &wspec));
        int64_t ws[2] = {C, K}, ys[2] = {R, K};
        mesh_array wa, dwa, cy;
        SIM_TRY(mesh_array_new(dev, m, "w", 2, ws, &wspec, SIM_F32, SIM_MEM_PARAMS, &wa));
        mesh_array_load_global(dev, m, &wa, j->w);
        SIM_TRY(mesh_array_new(dev, m, "dw", 2, ws, &wspec, SIM_F32, SIM_MEM_GRADS, &dwa));
        mesh_tape *t = mesh_tape_new(&ctx, true);
        mesh_var *x = mesh_tape_input(t, &xa, false), *w = mesh_tape_param(t, &wa, &dwa), *y;
        SIM_TRY(mesh_ad_einsum(t, "rc,ck->rk", x, w, NULL, "proj", &y));
        SIM_TRY(mesh_array_new(dev, m, "cy", 2, ys, &y->val.spec, SIM_F32, SIM_MEM_TEMP, &cy));
        mesh_array_load_global(dev, m, &cy, j->cw);
        sim_device_set_phase(dev, SIM_PHASE_BACKWARD);
        SIM_TRY(mesh_tape_backward_from(t, y, &cy));
        sim_device_set_phase(dev, SIM_PHASE_FORWARD);
        SIM_TRY(mesh_array_store_global(dev, m, &dwa, j->dw));
        mesh_tape_free(t);
        mesh_array_free(dev, &wa);
        mesh_array_free(dev, &dwa);
        if (sim_device_id(dev) == 0) {
            size_t n;
            const sim_record *r = sim_device_records(dev, &n);
            for (size_t i = 0; i < n; i++)
                j->rs_backward += r[i].op == SIM_OP_REDUCE_SCATTER && r[i].phase == SIM_PHASE_BACKWARD;
        }
    }

    /* 4. a tape that does not record; a value taken out of a tape */
    {
        mesh_tape *t = mesh_tape_new(&ctx, false);
        mesh_var *x = mesh_tape_input(t, &xa, true), *y;
        bool recording = mesh_tape_recording(t);
        mesh_entry *e = mesh_tape_record(t, triple_vjp, "test/none", 1, &x, 1, &x);
        SIM_TRY(triple(t, x, &y));
        mesh_array kept = mesh_tape_take(t, y);
        mesh_tape_free(t);
        bool still = kept.data && ((const float *)kept.data)[0] == 3.0f * ((const float *)xa.data)[0];
        mesh_array_free(dev, &kept);
        if (sim_device_id(dev) == 0) {
            j->no_entry = !recording && e == NULL;
            j->took = still;
        }
    }
    if (sim_device_id(dev) == 0) j->leak_free = leak_free && live(dev) == base;
    mesh_array_free(dev, &xa);
    mesh_array_free(dev, &sink);
    return SIM_OK;
}

static void test_tape(void **state)
{
    (void)state;
    static job j; /* large for a stack frame of cmocka's */
    memset(&j, 0, sizeof j);
    const char *names[] = {"data"};
    int sizes[] = {NDEV};
    j.mesh = helper_mesh(1, names, sizes);
    for (int i = 0; i < R * C; i++) {
        j.x[i] = (float)(i % 7 - 3);
        j.c[i] = (float)(i % 5 - 2);
    }
    for (int i = 0; i < C * K; i++) j.w[i] = (float)(i % 3 - 1);
    for (int i = 0; i < R * K; i++) j.cw[i] = (float)(i % 4 - 1);
    sim_machine *m = helper_machine(&j.mesh, false);
    sim_status st = sim_machine_run(m, tape_device, &j);
    sim_machine_free(m);
    if (st != SIM_OK) fail_msg("run: %s", sim_errmsg());
    for (int i = 0; i < R * C; i++) {
        assert_true(j.dx[i] == 6.0f * j.c[i]);
        assert_true(j.dx2[i] == 12.0f * j.c[i]);
        if (j.mean_grad[i] != 1.0 / (R * C))
            fail_msg("d mean / dx[%d] = %.9g, expected 1/%d", i, j.mean_grad[i], R * C);
    }
    for (int c = 0; c < C; c++)
        for (int k = 0; k < K; k++) {
            int want = 0;
            for (int r = 0; r < R; r++) want += (int)j.x[r * C + c] * (int)j.cw[r * K + k];
            assert_true(j.dw[c * K + k] == (float)want);
        }
    assert_true(j.rs_backward >= 1);
    assert_true(j.no_entry);
    assert_true(j.took);
    assert_true(j.leak_free);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_tape),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
