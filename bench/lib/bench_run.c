/* bench_run.c — see bench_run.h. */
#include "bench/lib/bench_run.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "models/core/train.h"

static void add_traffic(bench_result *r, sim_op op, const char *axes, double bytes)
{
    for (int i = 0; i < r->nrows; i++)
        if (r->rows[i].op == op && !strcmp(r->rows[i].axes, axes)) {
            r->rows[i].bytes += bytes;
            return;
        }
    if (r->nrows == BENCH_MAX_TRAFFIC) return;
    bench_traffic *t = &r->rows[r->nrows++];
    t->op = op;
    snprintf(t->axes, sizeof t->axes, "%s", axes);
    t->bytes = bytes;
}

const bench_traffic *bench_find_traffic(const bench_result *r, sim_op op, const char *axes)
{
    for (int i = 0; i < r->nrows; i++)
        if (r->rows[i].op == op && !strcmp(r->rows[i].axes, axes)) return &r->rows[i];
    return NULL;
}

/* The peak, its breakdown and the last step's traffic of a trained machine. */
static void collect(sim_machine *m, int steps, bench_result *res)
{
    int nd = sim_machine_num_devices(m);
    const sim_mesh_desc *md = sim_machine_mesh(m);
    for (int d = 0; d < nd; d++) {
        sim_device *dev = sim_machine_device(m, d);
        sim_arena_stats as;
        sim_arena_get_stats(sim_device_arena(dev), &as);
        if (as.peak > res->peak) {
            res->peak = as.peak;
            memcpy(res->at_peak, as.at_peak_by, sizeof res->at_peak);
        }
        sim_walk w;
        sim_walk_device(&w, dev);
        for (const sim_record *r; (r = sim_walk_next_record(&w));) {
            if (r->step != steps - 1) continue; /* the last step */
            char ax[64];
            sim_axes_label(md, r->axes, ax, sizeof ax);
            add_traffic(res, r->op, ax, (double)r->bytes_sent / nd);
        }
    }
}

void bench_run(const char *who, const char *const *words, int n, int steps, bench_result *res)
{
    memset(res, 0, sizeof *res);
    cfg_config *cfg = NULL;
    model_def *def = calloc(1, sizeof *def);
    model_data data;
    memset(&data, 0, sizeof data);
    model_train_job job;
    memset(&job, 0, sizeof job);
    sim_machine *m = NULL;
    bool have_def = false, have_data = false;
    sim_status st = cfg_load_argv("configs/base.yml", n, words, &cfg);
    if (!st) st = model_def_from_config(cfg, def);
    have_def = !st;
    if (!st) st = model_data_from_config(cfg, &data);
    have_data = !st;
    if (!st) st = model_optim_from_config(cfg, &job.opt);
    if (!st) st = model_machine_new(def, 0, false, &m);
    if (!st) {
        job.def = def;
        job.data = &data;
        job.steps = steps;
        job.stats = calloc((size_t)steps, sizeof *job.stats);
        st = model_train(&job, m);
    }
    if (st && st != SIM_ERR_INPUT && st != SIM_ERR_SHARDING) {
        fprintf(stderr, "%s: %s\n", who, sim_errmsg());
        exit(1);
    }
    if (st) {
        res->refused = true;
        snprintf(res->why, sizeof res->why, "%s", sim_errmsg());
    } else {
        res->step_s = job.stats[0].time_s;
        for (int s = 1; s < steps; s++)
            if (s == 1 || job.stats[s].time_s < res->step_s) res->step_s = job.stats[s].time_s;
        collect(m, steps, res);
    }
    free(job.stats);
    if (m) sim_machine_free(m);
    if (have_data) model_data_close(&data);
    if (have_def) model_def_free(def);
    free(def);
    cfg_free(cfg);
}
