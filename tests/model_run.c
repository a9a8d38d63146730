/* model_run.c — test support: one training run (see model_run.h). */
#include "tests/model_run.h"

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "sim/trace.h"

void model_run_start(model_run *r, cfg_config *cfg, model_def *def, long long steps)
{
    memset(r, 0, sizeof *r);
    r->cfg = cfg;
    r->def = def;
    if (model_data_from_config(r->cfg, &r->data) != SIM_OK) fail_msg("data: %s", sim_errmsg());
    if (model_optim_from_config(r->cfg, &r->job.opt) != SIM_OK) fail_msg("optim: %s", sim_errmsg());
    r->job.def = r->def;
    r->job.data = &r->data;
    r->job.steps = steps;
    r->job.stats = calloc((size_t)steps, sizeof *r->job.stats);
    assert_int_equal(model_machine_new(r->def, 0, false, &r->m), SIM_OK);
}

model_def *model_run_load(const char *const *base, int nbase, int rows, const char *const *extra, int n_extra,
                          int devices, long long steps, cfg_config **cfg_out)
{
    const char *argv[64];
    int argc = 0;
    assert_true(nbase + n_extra + 2 <= 64);
    for (int i = 0; i < nbase; i++) argv[argc++] = base[i];
    char pdbs[64], st[32];
    snprintf(pdbs, sizeof pdbs, "per_device_batch_size=%g", (double)rows / devices);
    argv[argc++] = pdbs;
    if (steps > 0) {
        snprintf(st, sizeof st, "steps=%lld", steps);
        argv[argc++] = st;
    }
    for (int i = 0; i < n_extra; i++) argv[argc++] = extra[i];
    cfg_config *cfg = NULL;
    if (cfg_load_argv("configs/base.yml", argc, argv, &cfg) != SIM_OK) fail_msg("config: %s", sim_errmsg());
    model_def *def = calloc(1, sizeof *def);
    if (model_def_from_config(cfg, def) != SIM_OK) fail_msg("model: %s", sim_errmsg());
    if (def->mesh.num_devices != devices) fail_msg("mesh has %d devices, expected %d", def->mesh.num_devices, devices);
    if (cfg_out) *cfg_out = cfg;
    else cfg_free(cfg);
    return def;
}

void model_run_unload(model_def *def)
{
    model_def_free(def);
    free(def);
}

void model_run_open(model_run *r, const char *const *base, int nbase, int rows, const char *const *extra, int n_extra,
                    int devices, long long steps)
{
    cfg_config *cfg;
    model_def *def = model_run_load(base, nbase, rows, extra, n_extra, devices, steps, &cfg);
    model_run_start(r, cfg, def, steps);
}

void model_run_train(model_run *r, bool grads)
{
    if (grads) r->job.step_grads = calloc((size_t)r->job.steps, sizeof *r->job.step_grads);
    if (model_train(&r->job, r->m) != SIM_OK) fail_msg("train: %s", sim_errmsg());
}

char *model_run_train_traced(model_run *r)
{
    sim_machine_free(r->m);
    assert_int_equal(model_machine_new(r->def, 0, true, &r->m), SIM_OK);
    model_run_train(r, false);
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    assert_non_null(f);
    assert_int_equal(sim_trace_write_chrome(r->m, f, 0), SIM_OK);
    fclose(f);
    return buf;
}

void model_run_close(model_run *r)
{
    if (r->job.step_grads) {
        for (long long s = 0; s < r->job.steps; s++) model_grads_free(&r->job.step_grads[s]);
        free(r->job.step_grads);
    }
    free(r->job.stats);
    sim_machine_free(r->m);
    model_data_close(&r->data);
    model_run_unload(r->def);
    cfg_free(r->cfg);
}

void model_run_pattern(int rows, int seq, int vocab, int32_t *in, int32_t *tg, int32_t *pos)
{
    for (int r = 0; r < rows; r++)
        for (int t = 0; t < seq; t++) {
            in[r * seq + t] = (r * 5 + t * 3 + (t * t) % 7) % vocab;
            tg[r * seq + t] = (r * 5 + (t + 1) * 3 + ((t + 1) * (t + 1)) % 7) % vocab;
            pos[r * seq + t] = t;
        }
}

void model_run_batch_make(model_run_batch *b, int rows, int seq, int vocab)
{
    assert_true(rows * seq <= MODEL_RUN_BATCH_MAX);
    model_run_pattern(rows, seq, vocab, b->in, b->tg, b->pos);
}

double model_run_loss_grads(const model_def *def, const int32_t *in, const int32_t *tg, const int32_t *pos,
                            const model_grads *pin, model_grads *pout, model_grads *g)
{
    sim_machine *m;
    assert_int_equal(model_machine_new(def, 0, false, &m), SIM_OK);
    double loss;
    sim_status st = model_loss_and_grads_from(def, m, in, tg, pos, pin, pout, &loss, g);
    sim_machine_free(m);
    if (st != SIM_OK) fail_msg("run: %s", sim_errmsg());
    return loss;
}

void model_run_expect_refused(const char *const *base, int nbase, int rows, const char *const *extra, int n,
                              int devices, const char *key, const char *also)
{
    const char *argv[64];
    int argc = 0;
    assert_true(nbase + n + 2 <= 64);
    for (int i = 0; i < nbase; i++) argv[argc++] = base[i];
    char pdbs[48];
    snprintf(pdbs, sizeof pdbs, "per_device_batch_size=%g", (double)rows / devices);
    argv[argc++] = pdbs;
    argv[argc++] = "steps=1";
    for (int i = 0; i < n; i++) argv[argc++] = extra[i];
    cfg_config *cfg;
    assert_int_equal(cfg_load_argv("configs/base.yml", argc, argv, &cfg), SIM_OK);
    model_def *def = calloc(1, sizeof *def);
    sim_status st = model_def_from_config(cfg, def);
    if (st == SIM_OK) { /* a layout refusal comes from the first step */
        model_run r;
        model_run_start(&r, cfg, def, 1);
        st = model_train(&r.job, r.m);
        assert_int_equal(st, SIM_ERR_INPUT);
        if (!strstr(sim_errmsg(), key) || !strstr(sim_errmsg(), also)) fail_msg("message: %s", sim_errmsg());
        model_run_close(&r);
        return;
    }
    assert_int_equal(st, SIM_ERR_INPUT);
    if (!strstr(sim_errmsg(), key) || !strstr(sim_errmsg(), also)) fail_msg("message: %s", sim_errmsg());
    model_def_free(def);
    free(def);
    cfg_free(cfg);
}

void model_run_compare(const char *what, const model_run *a, const model_run *ref, int steps)
{
    double worst = 0;
    for (int s = 0; s < steps; s++) {
        double l = a->job.stats[s].loss, lr = ref->job.stats[s].loss;
        if (fabs(l - lr) > 1e-4 * fabs(lr)) fail_msg("%s step %d: loss %.7f vs %.7f", what, s, l, lr);
        for (int i = 0; i < a->def->nparams; i++) {
            const model_grads *g = &a->job.step_grads[s], *gr = &ref->job.step_grads[s];
            if (!g->g[i] || !gr->g[i]) { /* not trained (the MoEBiasVar gate bias): in neither run */
                if (g->g[i] || gr->g[i])
                    fail_msg("%s step %d: %s has a gradient in one run only", what, s, a->def->defs[i].path);
                continue;
            }
            double e = model_rel_norm_diff(g->g[i], gr->g[i], g->layer_elems[i] * g->n_layers[i]);
            worst = fmax(worst, e);
            if (e > 1e-4) fail_msg("%s step %d: gradient of %s differs by %.3g", what, s, a->def->defs[i].path, e);
        }
    }
    printf("  %s: parity over %d steps, worst gradient difference %.2e\n", what, steps, worst);
}

uint64_t model_run_shard_elems(const model_def *def, int i, const mesh_spec *spec)
{
    uint64_t e = 1;
    for (int d = 0; d < def->defs[i].rank; d++) e *= (uint64_t)def->defs[i].shape[d];
    uint32_t axes = mesh_spec_dim_axes(spec ? spec : &def->spec[i]);
    for (int a = 0; a < def->mesh.n_axes; a++)
        if (axes & (1u << a)) e /= (uint64_t)def->mesh.sizes[a];
    return e;
}

void model_run_expect_same_records(const char *what, const model_run *a, const model_run *b, int devices,
                                   unsigned flags)
{
    for (int d = 0; d < devices; d++) {
        /* the records as read back: a dry run's repeated microbatches expanded */
        size_t na = sim_device_nrecords(sim_machine_device(a->m, d)), nb = sim_device_nrecords(sim_machine_device(b->m, d));
        if (na != nb) fail_msg("%s: device %d has %zu records against %zu", what, d, na, nb);
        sim_walk wa, wb;
        sim_walk_device(&wa, sim_machine_device(a->m, d));
        sim_walk_device(&wb, sim_machine_device(b->m, d));
        for (size_t i = 0; i < na; i++) {
            const sim_record *x = sim_walk_next_record(&wa), *y = sim_walk_next_record(&wb);
            assert_non_null(x);
            assert_non_null(y);
            bool routed = (flags & MODEL_RUN_DATA_ROUTED) && x->op == SIM_OP_RAGGED_ALL_TO_ALL;
            if (x->op != y->op || x->phase != y->phase || strcmp(x->tag, y->tag) || x->axes.n != y->axes.n ||
                x->dtype != y->dtype || x->implicit != y->implicit ||
                (!routed &&
                 (x->elements != y->elements || x->bytes_sent != y->bytes_sent || x->bytes_recv != y->bytes_recv)))
                fail_msg("%s: device %d record %zu differs: %s %s %llu B sent, %llu B received against %s %s "
                         "%llu B sent, %llu B received",
                         what, d, i, x->tag, sim_op_name(x->op), (unsigned long long)x->bytes_sent,
                         (unsigned long long)x->bytes_recv, y->tag, sim_op_name(y->op),
                         (unsigned long long)y->bytes_sent, (unsigned long long)y->bytes_recv);
        }
        sim_arena_stats sa, sb;
        sim_arena_get_stats(sim_device_arena(sim_machine_device(a->m, d)), &sa);
        sim_arena_get_stats(sim_device_arena(sim_machine_device(b->m, d)), &sb);
        if (sa.peak != sb.peak || sa.live != sb.live || sa.n_allocs != sb.n_allocs)
            fail_msg("%s: device %d arena peak %zu live %zu allocations %zu against %zu, %zu, %zu", what, d,
                     (size_t)sa.peak, (size_t)sa.live, (size_t)sa.n_allocs, (size_t)sb.peak, (size_t)sb.live,
                     (size_t)sb.n_allocs);
        for (int c = 0; c < SIM_NMEM; c++)
            if (sa.peak_by[c] != sb.peak_by[c] || sa.at_peak_by[c] != sb.at_peak_by[c])
                fail_msg("%s: device %d memory category %d differs", what, d, c);
    }
}
