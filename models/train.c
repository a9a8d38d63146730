/* train.c — running the model on the simulated machine. */
#include "models/train.h"

#include "blas_kernels/bk_parallel.h"
#include "models/checkpoint.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

double model_rel_norm_diff(const float *a, const float *ref, int64_t n)
{
    double num = 0, den = 0;
    for (int64_t i = 0; i < n; i++) {
        double d = (double)a[i] - ref[i];
        num += d * d;
        den += (double)ref[i] * ref[i];
    }
    return sqrt(num) / (sqrt(den) + 1e-30);
}

void model_grads_free(model_grads *g)
{
    for (int i = 0; i < g->n; i++) free(g->g[i]);
    memset(g, 0, sizeof *g);
}

sim_status model_machine_new(const model_def *def, double hbm_limit_gb, bool trace, sim_machine **out)
{
    sim_mesh_desc md;
    SIM_TRY(mesh_shape_to_sim(&def->mesh, &md));
    sim_machine_opts o = {0};
    o.capacity_bytes = (size_t)(hbm_limit_gb * 1e9);
    o.dry_run = def->d.dry_run;
    o.trace = trace;
    o.pin_threads = true;
    SIM_TRY(sim_machine_new(&md, &o, out));
    /* a device that owns several cores uses them for the non-sgemm kernels too */
    bk_parallel_set_threads(sim_machine_blas_threads(*out));
    return SIM_OK;
}

typedef struct {
    const model_def *def;
    const int32_t *inputs, *targets, *positions;
    double loss;
    model_grads *grads;
    const model_grads *params_in;
    model_grads *params_out;
} grads_job;

/* Copies every parameter shard to (store) or from (load) the global layout. */
static sim_status params_global(model_dev *md, model_grads *dst, const model_grads *src, bool grads)
{
    const model_def *def = md->def;
    for (int i = 0; i < def->nparams; i++) {
        model_param *p = &md->p[i];
        for (int l = 0; l < p->n_layers; l++) {
            mesh_array *a = grads ? &p->g[l] : &p->w[l];
            if (src)
                mesh_array_load_global(md->ctx.dev, &def->mesh, a, src->g[i] + (size_t)l * (size_t)src->layer_elems[i]);
            else
                SIM_TRY(model_store_layer(md, p, a, l, dst->g[i] + (size_t)l * (size_t)dst->layer_elems[i]));
        }
    }
    return SIM_OK;
}

static sim_status grads_device(sim_device *dev, void *arg)
{
    grads_job *job = arg;
    model_dev md;
    sim_status st = model_dev_init(&md, job->def, dev, true, false);
    model_batch b;
    memset(&b, 0, sizeof b);
    mesh_tape *t = NULL;
    if (st == SIM_OK && job->params_in) st = params_global(&md, NULL, job->params_in, false);
    if (st == SIM_OK && job->params_out) st = params_global(&md, job->params_out, NULL, false);
    if (st == SIM_OK) st = model_batch_load(&md, job->inputs, job->targets, job->positions, &b);
    if (st == SIM_OK) {
        model_dev_zero_grads(&md);
        t = mesh_tape_new(&md.ctx, true);
        mesh_var *loss;
        sim_device_set_phase(dev, SIM_PHASE_FORWARD);
        st = model_loss(&md, t, &b, &loss);
        if (st == SIM_OK && sim_device_id(dev) == 0 && loss->val.data) job->loss = ((float *)loss->val.data)[0];
        sim_device_set_phase(dev, SIM_PHASE_BACKWARD);
        if (st == SIM_OK) st = mesh_tape_backward(t, loss);
        mesh_tape_free(t);
        sim_device_set_phase(dev, SIM_PHASE_OTHER);
    }
    if (st == SIM_OK && job->grads) st = params_global(&md, job->grads, NULL, true);
    if (b.tokens.nlocal) model_batch_free(&md, &b);
    model_dev_free(&md);
    return st;
}

void model_grads_alloc(const model_def *def, model_grads *g)
{
    memset(g, 0, sizeof *g);
    g->n = def->nparams;
    for (int i = 0; i < def->nparams; i++) {
        const model_param_def *pd = &def->defs[i];
        int64_t e = 1;
        for (int d = 0; d < pd->rank; d++)
            if (d != pd->scan_dim) e *= pd->shape[d];
        g->layer_elems[i] = e;
        g->n_layers[i] = pd->scan_dim >= 0 ? (int)pd->shape[pd->scan_dim] : 1;
        g->g[i] = calloc((size_t)(e * g->n_layers[i]), sizeof(float));
    }
}

sim_status model_loss_and_grads_from(const model_def *def, sim_machine *m, const int32_t *inputs,
                                     const int32_t *targets, const int32_t *positions, const model_grads *params_in,
                                     model_grads *params_out, double *loss, model_grads *grads)
{
    grads_job job = {def, inputs, targets, positions, 0, grads, params_in, params_out};
    if (grads) model_grads_alloc(def, grads);
    if (params_out) model_grads_alloc(def, params_out);
    sim_status st = sim_machine_run(m, grads_device, &job);
    *loss = job.loss;
    return st;
}

sim_status model_loss_and_grads(const model_def *def, sim_machine *m, const int32_t *inputs, const int32_t *targets,
                                const int32_t *positions, double *loss, model_grads *grads)
{
    return model_loss_and_grads_from(def, m, inputs, targets, positions, NULL, NULL, loss, grads);
}

/* ------------------------------------------------------------ training */

typedef struct {
    model_train_job *job;
} train_ctx;

static sim_status train_step(model_train_job *job, model_dev *md, int64_t s)
{
    const model_def *def = md->def;
    sim_device *dev = md->ctx.dev;
    int id = sim_device_id(dev);
    sim_device_set_step(dev, (int)s);
    sim_device_set_phase(dev, SIM_PHASE_OTHER);
    if (id == 0) {
        SIM_TRY(model_batch_global(job->data, s, def->d.rows_loaded, job->inputs, job->targets, job->positions));
        if (def->d.cp > 1 && def->d.cp_load_balance) {
            int32_t *arrs[3] = {job->inputs, job->targets, job->positions};
            for (int a = 0; a < 3; a++) SIM_TRY(model_reorder_load_balanced(arrs[a], def->d.batch, def->d.seq, def->d.cp));
        }
    }
    SIM_TRY(sim_device_barrier(dev));
    uint64_t t0 = sim_now_ns();
    model_batch b;
    SIM_TRY(model_batch_load(md, job->inputs, job->targets, job->positions, &b));
    SIM_TRY(sim_device_barrier(dev)); /* device 0 may refill the host batch after this */
    model_dev_zero_grads(md);
    mesh_tape *t = mesh_tape_new(&md->ctx, true);
    mesh_var *loss;
    sim_device_set_phase(dev, SIM_PHASE_FORWARD);
    sim_status st = model_loss(md, t, &b, &loss);
    double loss_value = st == SIM_OK && loss->val.data ? ((float *)loss->val.data)[0] : 0;
    sim_device_set_phase(dev, SIM_PHASE_BACKWARD);
    if (st == SIM_OK) st = mesh_tape_backward(t, loss);
    mesh_tape_free(t);
    model_batch_free(md, &b);
    SIM_TRY(st);
    if (job->step_grads) {
        model_grads *g = &job->step_grads[s];
        for (int i = 0; i < def->nparams; i++)
            for (int l = 0; l < md->p[i].n_layers; l++)
                SIM_TRY(model_store_layer(md, &md->p[i], &md->p[i].g[l], l,
                                          g->g[i] + (size_t)l * (size_t)g->layer_elems[i]));
    }
    sim_device_set_phase(dev, SIM_PHASE_OPTIMIZER);
    double norm;
    SIM_TRY(model_grad_global_norm(dev, &def->mesh, md->p, def->nparams, &norm));
    SIM_TRY(model_adamw_update(dev, &job->opt, md->p, def->nparams, s, norm));
    SIM_TRY(sim_device_barrier(dev));
    if (id == 0) {
        model_step_stats *ss = &job->stats[s];
        ss->step = s;
        ss->loss = loss_value;
        ss->grad_norm = norm;
        ss->lr = model_lr_at(&job->opt, s);
        ss->time_s = (double)(sim_now_ns() - t0) / 1e9;
        size_t peak = 0;
        sim_machine *m = sim_device_machine(dev);
        for (int d = 0; d < sim_machine_num_devices(m); d++) {
            sim_arena_stats as;
            sim_arena_get_stats(sim_device_arena(sim_machine_device(m, d)), &as);
            if (as.peak > peak) peak = as.peak;
        }
        ss->peak_bytes = peak;
        if (job->on_step) job->on_step(ss, job->cb_arg);
    }
    return sim_device_barrier(dev); /* others wait while device 0 reads their arenas */
}

static void layer_done(void *arg, int layer, bool backward)
{
    model_train_job *job = arg;
    job->on_layer(job->cb_arg, job->step, layer, backward);
}

static sim_status train_device(sim_device *dev, void *arg)
{
    model_train_job *job = arg;
    model_dev md;
    const model_def *def = job->def;
    sim_status st = model_dev_init(&md, def, dev, true, true);
    if (sim_device_id(dev) == 0 && job->on_layer) {
        md.on_layer = layer_done;
        md.on_layer_arg = job;
    }
    long long loaded_step = 0;
    if (st == SIM_OK && job->load_path && *job->load_path)
        st = model_checkpoint_load(dev, &def->mesh, job->load_path, md.p, def->nparams, false, &loaded_step);
    bool ckpt = job->checkpoint_dir && *job->checkpoint_dir && job->checkpoint_period > 0;
    if (st == SIM_OK && ckpt) st = model_checkpoint_save(dev, &def->mesh, job->checkpoint_dir, 0, md.p, def->nparams);
    for (int64_t s = 0; st == SIM_OK && s < job->steps; s++) {
        if (sim_device_id(dev) == 0) job->step = s;
        st = train_step(job, &md, s);
        if (st == SIM_OK && ckpt && (s + 1) % job->checkpoint_period == 0)
            st = model_checkpoint_save(dev, &def->mesh, job->checkpoint_dir, s + 1, md.p, def->nparams);
    }
    model_dev_free(&md);
    return st;
}

sim_status model_train(model_train_job *job, sim_machine *m)
{
    const model_def *def = job->def;
    size_t n = (size_t)(def->d.rows_loaded * def->d.seq);
    job->inputs = calloc(n, sizeof(int32_t));
    job->targets = calloc(n, sizeof(int32_t));
    job->positions = calloc(n, sizeof(int32_t));
    if (job->step_grads)
        for (long long s = 0; s < job->steps; s++) model_grads_alloc(def, &job->step_grads[s]);
    sim_status st = sim_machine_run(m, train_device, job);
    free(job->inputs);
    free(job->targets);
    free(job->positions);
    job->inputs = job->targets = job->positions = NULL;
    return st;
}
