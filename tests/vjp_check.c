/* vjp_check.c — test support: VJPs against finite differences (see vjp_check.h). */
#include "tests/vjp_check.h"

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tests/helpers.h"

enum { FD_POINTS = 24 }; /* elements checked per input */

typedef struct {
    const vjp_case *c;
    const mesh_shape *m;
    float *in[VJP_MAX_IN];   /* global inputs (int32 for integer ones) */
    float *grad[VJP_MAX_IN]; /* global gradients */
    float *cot;              /* the output cotangent, global */
    int64_t n_out;
    int out_rank;
    int64_t out_shape[4];
    /* finite differences: the elements and their results */
    int64_t fd_at[VJP_MAX_IN][FD_POINTS];
    double fd[VJP_MAX_IN][FD_POINTS];
    int n_fd[VJP_MAX_IN];
    double h;
} job;

static int64_t count_of(int rank, const int64_t *shape)
{
    int64_t n = 1;
    for (int d = 0; d < rank; d++) n *= shape[d];
    return n;
}

static sim_status make_inputs(job *j, sim_device *dev, mesh_array *a)
{
    const vjp_case *c = j->c;
    for (int i = 0; i < c->nin; i++) {
        mesh_spec s;
        if (c->spec[i]) SIM_TRY(mesh_spec_parse(c->spec[i], j->m, &s));
        else mesh_spec_init(&s, c->rank[i]);
        SIM_TRY(mesh_array_new(dev, j->m, "in", c->rank[i], c->shape[i], &s, c->integer[i] ? SIM_I32 : SIM_F32,
                               SIM_MEM_ACTIVATIONS, &a[i]));
        mesh_array_load_global(dev, j->m, &a[i], j->in[i]);
    }
    return SIM_OK;
}

/* sum(c * out) in double, from out's global values. */
static double dot_out(const job *j, const float *out)
{
    double s = 0;
    for (int64_t k = 0; k < j->n_out; k++) s += (double)j->cot[k] * (double)out[k];
    return s;
}

static sim_status forward(job *j, mesh_tape *t, mesh_array *a, mesh_var **out)
{
    mesh_var *v[VJP_MAX_IN];
    for (int i = 0; i < j->c->nin; i++) v[i] = mesh_tape_input(t, &a[i], !j->c->integer[i]);
    return j->c->op(t, v, j->c->arg, out);
}

/* The gradients on the mesh (every device). */
static sim_status grad_device(sim_device *dev, void *arg)
{
    job *j = arg;
    const vjp_case *c = j->c;
    mesh_ctx ctx = {.dev = dev, .mesh = j->m, .mode = MESH_MODE_AUTO, .drop_size_one = true, .layer = "vjp"};
    mesh_tape *t = mesh_tape_new(&ctx, true);
    mesh_array a[VJP_MAX_IN], sink[VJP_MAX_IN];
    SIM_TRY(make_inputs(j, dev, a));
    mesh_var *v[VJP_MAX_IN];
    for (int i = 0; i < c->nin; i++) {
        if (c->integer[i]) {
            v[i] = mesh_tape_input(t, &a[i], false);
            continue;
        }
        SIM_TRY(
            mesh_array_new(dev, j->m, "grad", c->rank[i], c->shape[i], &a[i].spec, SIM_F32, SIM_MEM_GRADS, &sink[i]));
        v[i] = mesh_tape_param(t, &a[i], &sink[i]);
    }
    mesh_var *out;
    SIM_TRY(c->op(t, v, c->arg, &out));
    if (sim_device_id(dev) == 0) {
        j->out_rank = out->val.rank;
        for (int d = 0; d < out->val.rank && d < 4; d++) j->out_shape[d] = out->val.shape[d];
    }
    mesh_array cot;
    mesh_spec cs = out->val.spec;
    cs.partial = 0;
    SIM_TRY(mesh_array_new(dev, j->m, "cot", out->val.rank, out->val.shape, &cs, SIM_F32, SIM_MEM_TEMP, &cot));
    mesh_array_load_global(dev, j->m, &cot, j->cot);
    SIM_TRY(mesh_tape_backward_from(t, out, &cot));
    for (int i = 0; i < c->nin; i++)
        if (!c->integer[i]) {
            SIM_TRY(mesh_array_store_global(dev, j->m, &sink[i], j->grad[i]));
            mesh_array_free(dev, &sink[i]);
        }
    mesh_tape_free(t);
    for (int i = 0; i < c->nin; i++) mesh_array_free(dev, &a[i]);
    return SIM_OK;
}

/* Central differences on one device: the forward only, once per perturbation. */
static sim_status fd_device(sim_device *dev, void *arg)
{
    job *j = arg;
    const vjp_case *c = j->c;
    mesh_ctx ctx = {.dev = dev, .mesh = j->m, .mode = MESH_MODE_AUTO, .drop_size_one = true, .layer = "vjp"};
    float *out = malloc((size_t)j->n_out * sizeof *out);
    SIM_ASSERT(out);
    for (int i = 0; i < c->nin; i++)
        for (int p = 0; p < j->n_fd[i]; p++) {
            int64_t e = j->fd_at[i][p];
            float x0 = j->in[i][e];
            double f[2];
            for (int s = 0; s < 2; s++) {
                j->in[i][e] = x0 + (float)(s ? -j->h : j->h);
                mesh_tape *t = mesh_tape_new(&ctx, false);
                mesh_array a[VJP_MAX_IN];
                SIM_TRY(make_inputs(j, dev, a));
                mesh_var *o;
                SIM_TRY(forward(j, t, a, &o));
                SIM_TRY(mesh_array_store_global(dev, j->m, &o->val, out));
                f[s] = dot_out(j, out);
                mesh_tape_free(t);
                for (int k = 0; k < c->nin; k++) mesh_array_free(dev, &a[k]);
            }
            j->in[i][e] = x0;
            /* the perturbation as float32 holds it */
            double hp = (double)(x0 + (float)j->h) - (double)x0, hm = (double)x0 - (double)(x0 - (float)j->h);
            j->fd[i][p] = (f[0] - f[1]) / (hp + hm);
        }
    free(out);
    return SIM_OK;
}

double vjp_check(const vjp_case *c, const mesh_shape *m, double tol)
{
    job *j = calloc(1, sizeof *j);
    SIM_ASSERT(j);
    j->c = c;
    j->m = m;
    float scale = c->scale > 0 ? c->scale : 1.0f;
    j->h = 1e-2 * scale;
    for (int i = 0; i < c->nin; i++) {
        int64_t n = count_of(c->rank[i], c->shape[i]);
        j->in[i] = calloc((size_t)n, sizeof(float));
        j->grad[i] = calloc((size_t)n, sizeof(float));
        for (int64_t k = 0; k < n; k++) {
            if (c->integer[i]) ((int32_t *)j->in[i])[k] = (int32_t)((k * 7 + 3 * i + 1) % c->int_bound[i]);
            else j->in[i][k] = helper_det_val((uint32_t)(k + 1000 * i), scale);
        }
        if (!c->integer[i]) {
            j->n_fd[i] = n < FD_POINTS ? (int)n : FD_POINTS;
            for (int p = 0; p < j->n_fd[i]; p++) j->fd_at[i][p] = n < FD_POINTS ? p : (p * (n - 1)) / (FD_POINTS - 1);
        }
    }
    j->n_out = count_of(c->out_rank, c->out_shape);
    j->cot = malloc((size_t)j->n_out * sizeof *j->cot);
    for (int64_t k = 0; k < j->n_out; k++) j->cot[k] = helper_det_val((uint32_t)(k + 7777), 1.0f);

    sim_machine *mach = helper_machine(m, false);
    sim_status st = sim_machine_run(mach, grad_device, j);
    sim_machine_free(mach);
    if (st != SIM_OK) fail_msg("%s: gradient run: %s", c->what, sim_errmsg());
    assert_int_equal(j->out_rank, c->out_rank);
    for (int d = 0; d < c->out_rank; d++) assert_int_equal(j->out_shape[d], c->out_shape[d]);

    /* one device: m's axes, each of size 1 (the ops' own specs still name them) */
    const char *one_names[MESH_MAX_AXES];
    int one_sizes[MESH_MAX_AXES];
    for (int a = 0; a < m->n_axes; a++) one_names[a] = m->names[a], one_sizes[a] = 1;
    mesh_shape one = helper_mesh(m->n_axes, one_names, one_sizes);
    j->m = &one;
    mach = helper_machine(&one, false);
    st = sim_machine_run(mach, fd_device, j);
    sim_machine_free(mach);
    if (st != SIM_OK) fail_msg("%s: finite differences: %s", c->what, sim_errmsg());

    double worst = 0;
    for (int i = 0; i < c->nin; i++) {
        if (c->integer[i]) continue;
        double top = 0, err = 0;
        for (int p = 0; p < j->n_fd[i]; p++) top = fmax(top, fabs(j->fd[i][p]));
        for (int p = 0; p < j->n_fd[i]; p++) {
            double g = j->grad[i][j->fd_at[i][p]];
            err = fmax(err, fabs(g - j->fd[i][p]));
        }
        if (!(top > 0))
            fail_msg("%s: input %d: every finite difference is 0 (the check would see nothing)", c->what, i);
        double rel = err / top;
        worst = fmax(worst, rel);
        if (!(rel <= tol))
            fail_msg("%s: input %d: gradient differs from finite differences by %.3g of the largest (%.3g)", c->what, i,
                     rel, top);
    }
    for (int i = 0; i < c->nin; i++) {
        free(j->in[i]);
        free(j->grad[i]);
    }
    free(j->cot);
    free(j);
    return worst;
}
