/* train.c — running the model on the simulated machine.
 *
 * A training step: the step's rows from the data stream; with ZeRO-1 the
 * parameters all-gathered over 'data' from the optimizer layout; one forward
 * and backward pass per microbatch (gradient_accumulation_steps), each adding
 * its gradient with weight 1/ga into the same float32 sinks, which reduce over
 * the batch axes as each pass ends (as XLA leaves MaxText's reduction inside
 * its accumulation loop) -- except 'data' under ZeRO-1 without accumulation,
 * left pending for one reduce-scatter into the optimizer layout; the global
 * norm and the update; the metrics. */
#include "models/core/train.h"

#include "blas_kernels/bk_parallel.h"
#include "config/release.h"
#include "mesh/ops.h"
#include "mesh/reshard.h"
#include "models/core/checkpoint.h"
#include "sim/xrank.h"

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
    /* bytes in MaxText's dtypes (model_dims: act_dtype, weight_dtype) */
    for (int c = 0; c < SIM_NMEM; c++) o.counted[c] = def->d.act_dtype;
    o.counted[SIM_MEM_PARAMS] = o.counted[SIM_MEM_GRADS] = o.counted[SIM_MEM_OPTIMIZER] = def->d.weight_dtype;
    o.counted_wire = def->d.act_dtype;
    o.counted_optimizer = def->d.weight_dtype; /* optax updates float32 parameters with float32 gradients */
    /* weight gathers and gradient reductions as the hardware profile's compiler moves them */
    o.counted_gather = def->d.gather_dtype;
    o.counted_grad_reduce = def->d.reduce_dtype;
    o.windowed_min_group = def->d.xla.windowed_min_group;
    o.windowed_ici_bw = def->d.xla.windowed_ici_bw;
    o.windowed_peak = def->d.xla.windowed_peak;
    o.windowed_torus_n = def->d.xla.torus_n;
    for (int i = 0; i < def->d.xla.torus_n; i++) o.windowed_torus[i] = def->d.xla.torus[i];
    o.psum_scatter_max_group = def->d.xla.psum_scatter_max_group;
    o.lane_scatter_ar_max = def->d.xla.lane_scatter_ar_max;
    o.trace = trace;
    o.pin_threads = true;
    o.whole = def->mesh.num_devices < sim_xrank_size(); /* too small to spread: every rank runs it all */
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
        for (int l = 0; l < p->n_layers && (!grads || p->g); l++) {
            mesh_array *a = grads ? &p->g[l] : &p->w[l];
            if (src)
                mesh_array_load_global(md->ctx.dev, &def->mesh, a, src->g[i] + (size_t)l * (size_t)src->layer_elems[i]);
            else SIM_TRY(model_store_layer(md, p, a, l, dst->g[i] + (size_t)l * (size_t)dst->layer_elems[i]));
        }
    }
    return SIM_OK;
}

static sim_status grads_device(sim_device *dev, void *arg)
{
    grads_job *job = arg;
    model_dev md;
    model_batch b;
    memset(&b, 0, sizeof b);
    mesh_tape *t = NULL;
    mesh_var *loss;
    sim_status st;
    SIM_TRY_GOTO(model_dev_init(&md, job->def, dev, true, false), st, fail);
    if (job->params_in) SIM_TRY_GOTO(params_global(&md, NULL, job->params_in, false), st, fail);
    if (job->params_out) SIM_TRY_GOTO(params_global(&md, job->params_out, NULL, false), st, fail);
    SIM_TRY_GOTO(model_batch_load(&md, job->inputs, job->targets, job->positions, &b), st, fail);
    model_dev_zero_grads(&md);
    t = mesh_tape_new(&md.ctx, true);
    sim_device_set_phase(dev, SIM_PHASE_FORWARD);
    SIM_TRY_GOTO(model_loss(&md, t, &b, &loss), st, fail);
    if (sim_device_id(dev) == 0 && loss->val.data) job->loss = ((float *)loss->val.data)[0];
    sim_device_set_phase(dev, SIM_PHASE_BACKWARD);
    SIM_TRY_GOTO(mesh_tape_backward(t, loss), st, fail);
    mesh_tape_free(t);
    t = NULL;
    sim_device_set_phase(dev, SIM_PHASE_OTHER);
    if (job->grads) SIM_TRY_GOTO(params_global(&md, job->grads, NULL, true), st, fail);
fail:
    if (t) {
        mesh_tape_free(t);
        sim_device_set_phase(dev, SIM_PHASE_OTHER);
    }
    if (b.tokens.nlocal) model_batch_free(&md, &b);
    model_dev_free(&md);
    return st;
}

sim_status model_grads_merge_ranks(model_grads *g)
{
    for (int i = 0; i < g->n; i++)
        SIM_TRY(sim_xrank_or_merge(g->g[i], (size_t)(g->layer_elems[i] * g->n_layers[i]) * sizeof(float)));
    return SIM_OK;
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

/* ---- ZeRO-1 (shard_optimizer_over_data; see models/core/optimizer.h) */

/* Re-makes per-layer array a (released: name, shape and spec kept) in category cat, zeroed. */
static sim_status remake(model_dev *md, mesh_array *a, sim_mem_cat cat)
{
    mesh_array old = *a;   /* mesh_array_new clears its output before reading the shape */
    if (old.counted_fixed) /* ZeRO-1 with accumulation: dtype */
        return mesh_array_new_as(md->ctx.dev, &md->def->mesh, old.name, old.rank, old.shape, &old.spec, SIM_F32,
                                 old.counted, cat, true, a);
    return mesh_array_new(md->ctx.dev, &md->def->mesh, old.name, old.rank, old.shape, &old.spec, SIM_F32, cat, a);
}

/* The optimizer layout with 'data' moved from the front to the back of its
 * dim ('data', 'expert') -> ('expert', 'data'): the layout one all-gather
 * (or reduce-scatter) over 'data' alone connects to the parameters' layout.
 * MaxText prepends 'data', so where the dim was already sharded the blocks
 * also change hands between devices: one ppermute between the two layouts. */
static void zero1_mid_spec(const model_def *def, const mesh_spec *z, mesh_spec *mid)
{
    int data = mesh_shape_axis_index(&def->mesh, "data");
    *mid = *z;
    for (int d = 0; d < mid->rank; d++) {
        int n = mid->n_axes[d];
        if (n < 2 || mid->axes[d][0] != data) continue;
        memmove(&mid->axes[d][0], &mid->axes[d][1], (size_t)(n - 1) * sizeof mid->axes[d][0]);
        mid->axes[d][n - 1] = (int8_t)data;
    }
}

/* a resharded in two moves, through mid when it differs from both ends. */
static sim_status reshard_via(model_dev *md, mesh_array *a, const mesh_spec *mid, const mesh_spec *to, sim_meta meta)
{
    if (!mesh_spec_equal(&a->spec, mid) && !mesh_spec_equal(mid, to))
        SIM_TRY(mesh_reshard(md->ctx.dev, &md->def->mesh, a, mid, meta));
    return mesh_reshard(md->ctx.dev, &md->def->mesh, a, to, meta);
}

/* Before the step: every parameter all-gathered over 'data' from its stored
 * optimizer-layout copy (md->z) into the working copy the forward pass reads,
 * and the gradient sinks made again (both were released after the last
 * backward pass, as a compiler frees buffers no longer read). */
static sim_status zero1_gather_params(model_dev *md)
{
    const model_def *def = md->def;
    sim_device *dev = md->ctx.dev;
    for (int i = 0; i < def->nparams; i++) {
        model_param *p = &md->p[i];
        if (p->def.state_var) continue; /* kept in place (not released, no optimizer layout) */
        mesh_spec to;
        model_param_stacked_spec(p, &p->w[0].spec, &to);
        char tag[SIM_TAG_MAX];
        snprintf(tag, sizeof tag, "zero1/params/%.80s", p->def.path);
        mesh_array a;
        SIM_TRY(mesh_array_clone(dev, &def->mesh, md->z[i].w, tag, SIM_MEM_COMM, &a));
        /* gathered in weight_dtype (the cast to dtype comes at each dot), except with accumulation,
         * where MaxText casts to dtype before the gather (p->w counted in dtype, fixed) */
        mesh_array_recount(dev, &a, p->w[0].counted_fixed ? p->w[0].counted : md->z[i].w->counted);
        mesh_spec mid;
        zero1_mid_spec(def, &md->z[i].spec, &mid);
        sim_status st = reshard_via(md, &a, &mid, &to, sim_meta_tag(tag));
        /* the gathered stacked tensor into the per-layer arrays (a copy: one parameter's size at a time) */
        for (int l = 0; st == SIM_OK && md->zero1_released && l < p->n_layers; l++)
            if (model_param_holds_layer(&def->mesh, p, sim_device_id(dev), l)) /* a pipeline: its stage's only */
                st = remake(md, &p->w[l], SIM_MEM_PARAMS);
        if (st == SIM_OK) model_param_unstack(dev, &def->mesh, p, &a, p->w);
        mesh_array_free(dev, &a);
        SIM_TRY(st);
    }
    if (md->zero1_released)
        for (int i = 0; i < def->nparams; i++)
            for (int l = 0; md->p[i].g && l < md->p[i].n_layers; l++)
                if (model_param_holds_layer(&def->mesh, &md->p[i], sim_device_id(dev), l))
                    SIM_TRY(remake(md, &md->p[i].g[l], SIM_MEM_GRADS));
    md->zero1_released = false;
    return SIM_OK;
}

/* After the backward pass(es): each gradient brought to the optimizer layout
 * in md->z[i].g: a reduce-scatter over 'data' of the sum the sinks kept
 * pending (without accumulation), or a local slice of the already reduced
 * sum (with accumulation, whose carry MaxText keeps in the parameters'
 * layout).  The working parameters and the per-layer sums are dead from here
 * to the next step and are released. */
/* Releases the working parameters (and the gradient sinks: with_grads). */
static void zero1_release(model_dev *md, bool with_grads)
{
    for (int i = 0; i < md->def->nparams; i++)
        for (int l = 0; !md->p[i].def.state_var && l < md->p[i].n_layers; l++) { /* a state variable stays */
            mesh_array_free(md->ctx.dev, &md->p[i].w[l]);
            if (with_grads) mesh_array_free(md->ctx.dev, &md->p[i].g[l]);
        }
    md->zero1_released = true;
}

static sim_status zero1_reduce_grads(model_dev *md)
{
    const model_def *def = md->def;
    sim_device *dev = md->ctx.dev;
    zero1_release(md, false);
    const int table = model_param_index(def, "token_embedder.embedding");
    for (int i = 0; i < def->nparams; i++) {
        model_param *p = &md->p[i], *z = &md->z[i];
        if (!p->g) continue; /* a state variable: no gradient */
        char tag[SIM_TAG_MAX];
        snprintf(tag, sizeof tag, "zero1/grads/%.80s", p->def.path);
        z->g = calloc(1, sizeof(mesh_array));
        SIM_ASSERT(z->g);
        /* with accumulation the gradients stay in dtype into the optimizer (facts-2 §D) */
        SIM_TRY(model_param_stack(dev, &def->mesh, p, p->g, tag, SIM_MEM_GRADS, z->g));
        for (int l = 0; l < p->n_layers; l++) mesh_array_free(dev, &p->g[l]);
        mesh_spec mid;
        zero1_mid_spec(def, &z->spec, &mid);
        /* reduced in the dtype the hardware profile's compiler reduces parameter gradients in (XLA:TPU:
         * bfloat16 all-reduces over data in MaxText 0.2.5's ZeRO-1 pipeline step compiled for v5p-8).  XLA
         * reduce-scatters each kernel's gradient inside the backward loop, as the product that makes it
         * (a windowed einsum over groups of windowed_einsum_min_group: llama2-7b data=8 ZeRO-1 on
         * v5p-16 sends 9/7 of the reduce-scatter's bytes as collective-permutes); the embedding table's
         * gradient is no product's (a scatter-add of looked-up rows) */
        sim_meta meta = sim_meta_counted(sim_meta_tag(tag), mesh_array_reduce_dtype(dev, z->g->counted));
        meta.weight = true;
        int rank = p->def.rank - (p->def.scan_dim >= 0);
        meta.single_use = rank >= 2 && i != table;
        SIM_TRY(reshard_via(md, z->g, &mid, &z->spec, meta));
    }
    return SIM_OK;
}

/* After the update: the optimizer-layout gradients go. */
static void zero1_free_grads(model_dev *md)
{
    for (int i = 0; i < md->def->nparams; i++) {
        model_param *z = &md->z[i];
        if (!z->g || z->def.state_var) continue;
        mesh_array_free(md->ctx.dev, z->g);
        free(z->g);
        z->g = NULL;
    }
}

/* Global layer-major copies of every gradient (job->step_grads[s]). */
static sim_status store_step_grads(model_train_job *job, model_dev *md, model_grads *g)
{
    const model_def *def = md->def;
    sim_device *dev = md->ctx.dev;
    for (int i = 0; i < def->nparams; i++) {
        if (!md->p[i].g) continue; /* a state variable: its step gradient stays zero */
        if (!md->zero1) {
            for (int l = 0; l < md->p[i].n_layers; l++)
                SIM_TRY(model_store_layer(md, &md->p[i], &md->p[i].g[l], l,
                                          g->g[i] + (size_t)l * (size_t)g->layer_elems[i]));
            continue;
        }
        /* ZeRO-1: the stacked gradient, then device 0 reorders it layer-major (under MPI each rank
         * holds its devices' shards: zeros elsewhere, merged before the reorder) */
        bool spread = sim_machine_ranks(sim_device_machine(dev)) > 1;
        size_t scratch_bytes = sizeof(float);
        for (int d = 0; d < def->defs[i].rank; d++) scratch_bytes *= (size_t)def->defs[i].shape[d];
        if (spread && sim_device_rank_lead(dev)) memset(job->scratch, 0, scratch_bytes);
        if (spread) SIM_TRY(sim_device_barrier(dev));
        SIM_TRY(mesh_array_store_global(dev, &def->mesh, md->z[i].g, job->scratch));
        SIM_TRY(sim_device_barrier(dev));
        if (spread && sim_device_rank_lead(dev)) SIM_TRY(sim_xrank_or_merge(job->scratch, scratch_bytes));
        if (sim_device_id(dev) == 0) {
            const model_param_def *pd = &def->defs[i];
            int64_t outer = 1, inner = 1, L = g->n_layers[i];
            for (int d = 0; d < pd->rank; d++)
                if (pd->scan_dim >= 0 && d < pd->scan_dim) outer *= pd->shape[d];
                else if (d != pd->scan_dim) inner *= pd->shape[d];
            for (int64_t o = 0; o < outer; o++)
                for (int64_t q = 0; q < L; q++) { /* stacked position q holds layer l (stage-major when pipelined) */
                    int64_t l = pd->scan_dim >= 0 ? model_param_stack_layer(&def->mesh, &md->p[i], q) : q;
                    memcpy(g->g[i] + (size_t)(l * g->layer_elems[i] + o * inner), job->scratch + (o * L + q) * inner,
                           (size_t)inner * sizeof(float));
                }
        }
        SIM_TRY(sim_device_barrier(dev));
    }
    return SIM_OK;
}

/* ---- one step */

void model_microbatch_rows(const int32_t *step, int64_t rows, int64_t seq, int64_t ga, int64_t g, int32_t *out)
{
    for (int64_t j = 0; j < rows; j++) memcpy(out + j * seq, step + (j * ga + g) * seq, (size_t)seq * sizeof(int32_t));
}

/* Device 0: microbatch g of the step's rows into the host microbatch arrays. */
static sim_status fill_microbatch(model_train_job *job, const model_def *def, int64_t g)
{
    int64_t G = def->d.ga, T = def->d.seq, rows = def->d.rows_loaded;
    int32_t *src[3] = {job->inputs, job->targets, job->positions};
    int32_t *dst[3] = {job->mb_inputs, job->mb_targets, job->mb_positions};
    for (int a = 0; a < 3; a++) {
        if (G > 1) model_microbatch_rows(src[a], rows, T, G, g, dst[a]);
        if (def->d.cp > 1 && def->d.cp_load_balance)
            SIM_TRY(model_reorder_load_balanced(dst[a], def->d.batch, T, def->d.cp));
    }
    return SIM_OK;
}

/* Forward and backward of one microbatch; its gradient is added to the sinks
 * with weight 1/ga (MaxText differentiates the token sum and divides the
 * accumulated gradient by the step's token count: with equal microbatches
 * that is each microbatch's mean loss weighted 1/ga). */
static sim_status microbatch_pass(model_train_job *job, model_dev *md, int64_t g, double *loss_value)
{
    const model_def *def = md->def;
    sim_device *dev = md->ctx.dev;
    sim_device_set_phase(dev, SIM_PHASE_OTHER);
    if (sim_device_rank_lead(dev) && job->inputs) SIM_TRY(fill_microbatch(job, def, g)); /* each MPI rank its own copy */
    SIM_TRY(sim_device_barrier(dev));
    model_batch b;
    SIM_TRY(model_batch_load(md, job->mb_inputs, job->mb_targets, job->mb_positions, &b));
    SIM_TRY(sim_device_barrier(dev)); /* device 0 may refill the host microbatch after this */
    mesh_tape *t = mesh_tape_new(&md->ctx, true);
    mesh_var *loss;
    sim_status st;
    *loss_value = 0;
    sim_device_set_phase(dev, SIM_PHASE_FORWARD);
    SIM_TRY_GOTO(model_loss(md, t, &b, &loss), st, fail);
    *loss_value = loss->val.data ? ((float *)loss->val.data)[0] : 0;
    sim_device_set_phase(dev, SIM_PHASE_BACKWARD);
    if (def->d.ga == 1) SIM_TRY_GOTO(mesh_tape_backward(t, loss), st, fail);
    else if (def->d.ga > 1) {
        mesh_spec s;
        mesh_spec_init(&s, 0);
        mesh_array cot;
        SIM_TRY_GOTO(mesh_tape_zeros(t, "loss/grad", 0, NULL, &s, SIM_MEM_TEMP, &cot), st, fail);
        if (cot.data) ((float *)cot.data)[0] = (float)(1.0 / (double)def->d.ga);
        SIM_TRY_GOTO(mesh_tape_backward_from(t, loss, &cot), st, fail);
    }
fail:
    mesh_tape_free(t);
    model_saved_products_release(md); /* the pass's backward is done */
    model_batch_free(md, &b);
    return st;
}

/* The `dtype` copy of the scanned layers' weights a compiler that hoists the layer's cast out of the
 * layer loop holds (cfg_xla_rules.hoist_casts): the device's shard of every scanned, trainable weight, in
 * `dtype`, charged before the first forward layer and discharged after the last backward one, so it
 * sits under every peak of the layer loops as XLA:TPU's buffer assignment has it (configs/hardware/
 * v5p.yml: hoisted_weight_copies).  Counted only: the simulator reads the float32 weights. */
static size_t hoisted_copy_bytes(const model_dev *md)
{
    const model_def *def = md->def;
    /* a pipeline that gathers its stage's layers itself holds them gathered in `dtype` instead
     * (pipeline_fsdp_ag_once / _per_repeat: counted there) */
    if (!def->d.xla.hoist_casts || !def->d.scan_layers || def->d.pipe.ag_once || def->d.pipe.ag_per_repeat) return 0;
    int id = sim_device_id(md->ctx.dev);
    size_t n = 0;
    for (int i = 0; i < def->nparams; i++) {
        const model_param *p = &md->p[i];
        if (p->def.scan_dim < 0 || p->def.state_var || !p->w) continue;
        for (int l = 0; l < p->n_layers; l++)
            if (model_param_holds_layer(&def->mesh, p, id, l)) n += p->w[l].nlocal;
    }
    return n * sim_dtype_size(def->d.act_dtype);
}

/* The gradient sets a compiler holds beside the gradients while gradient accumulation runs
 * (cfg_xla_rules.ga_grad_copies; configs/hardware/v5p.yml: accumulation_gradient_copies): copies x
 * the device's gradient bytes, charged over the microbatches.  Counted only: the simulator adds
 * each microbatch's cotangents straight into the gradients. */
static size_t accumulation_copy_bytes(const model_dev *md)
{
    const model_def *def = md->def;
    if (def->d.ga <= 1 || def->d.xla.ga_grad_copies <= 0 || md->zero1 || def->d.pipe.on) return 0;
    size_t n = 0;
    for (int i = 0; i < def->nparams; i++) {
        const model_param *p = &md->p[i];
        if (!p->g) continue;
        for (int l = 0; l < p->n_layers; l++) n += p->g[l].nlocal * sim_dtype_size(p->g[l].counted);
    }
    return n * (size_t)def->d.xla.ga_grad_copies;
}

static sim_status train_step(model_train_job *job, model_dev *md, int64_t s)
{
    const model_def *def = md->def;
    sim_device *dev = md->ctx.dev;
    int id = sim_device_id(dev);
    sim_device_set_step(dev, (int)s);
    sim_device_set_phase(dev, SIM_PHASE_OTHER);
    /* device 0; under MPI each rank's first device fills the rank's copy.  A dry run keeps no host
     * rows (it moves no data): a text dataset is still read through, for its errors */
    bool rows_needed = job->inputs || (job->data && job->data->type != MODEL_DATA_SYNTHETIC);
    if (sim_device_rank_lead(dev) && rows_needed)
        SIM_TRY(model_batch_global(job->data, s, def->d.rows_loaded * def->d.ga, job->inputs, job->targets,
                                   job->positions));
    SIM_TRY(sim_device_barrier(dev));
    uint64_t t0 = sim_now_ns();
    if (md->zero1) {
        sim_device_set_phase(dev, SIM_PHASE_FORWARD);
        SIM_TRY(zero1_gather_params(md));
    }
    model_dev_zero_grads(md);
    size_t nbc = md->n_bias_counts;
    if (nbc) memset(md->bias_counts_step, 0, nbc * sizeof(float));
    double loss_sum = 0;
    size_t wcopy = hoisted_copy_bytes(md), gacc = accumulation_copy_bytes(md);
    if (wcopy) SIM_TRY(sim_arena_charge(sim_device_arena(dev), wcopy, SIM_MEM_WCOPY, "hoisted weight copies"));
    sim_status st =
        gacc ? sim_arena_charge(sim_device_arena(dev), gacc, SIM_MEM_GRADS, "gradient accumulation buffers") : SIM_OK;
    bool gacc_held = gacc && st == SIM_OK;
    /* a dry run moves no data, so microbatches 1..ga-1 do alike: the second is simulated as their
     * template and the rest are its repeats (on the last step only: one repeated block per device) */
    bool shortcut = sim_device_dry(dev) && !job->dry_full && def->d.ga > 2 && s == job->steps - 1;
    /* and so do a stack's layers after its second but for the last (model_layers_bounded) */
    md->bound_layers = sim_device_dry(dev) && !job->dry_full && s == job->steps - 1;
    for (int64_t g = 0; g < def->d.ga && st == SIM_OK; g++) {
        double lg = 0;
        if (shortcut && g == 1) sim_device_repeat_begin(dev);
        st = microbatch_pass(job, md, g, &lg);
        loss_sum += lg;
        /* the gate bias update takes one sign over the whole step's counts (MaxText sums them over microbatches) */
        for (size_t i = 0; i < nbc; i++) md->bias_counts_step[i] += md->bias_counts[i];
        if (shortcut && g == 1 && st == SIM_OK) {
            for (size_t i = 0; i < nbc; i++) md->bias_counts_step[i] += (float)(def->d.ga - 2) * md->bias_counts[i];
            st = sim_device_repeat_end(dev, (uint64_t)(def->d.ga - 2));
            break;
        }
    }
    if (gacc_held) sim_arena_discharge(sim_device_arena(dev), gacc, SIM_MEM_GRADS);
    if (wcopy) sim_arena_discharge(sim_device_arena(dev), wcopy, SIM_MEM_WCOPY);
    SIM_TRY(st);
    /* MaxText: sum of token losses / all tokens + mean of the auxiliary losses (equal microbatches) */
    double loss_value = def->d.ga == 1 ? loss_sum : loss_sum / (double)def->d.ga;
    model_param *opt = md->p;
    if (md->zero1) {
        sim_device_set_phase(dev, SIM_PHASE_BACKWARD);
        SIM_TRY(zero1_reduce_grads(md));
        opt = md->z;
    }
    if (job->step_grads) SIM_TRY(store_step_grads(job, md, &job->step_grads[s]));
    sim_device_set_phase(dev, SIM_PHASE_OPTIMIZER);
    double norm;
    SIM_TRY(model_grad_global_norm(dev, &def->mesh, opt, def->nparams, &norm));
    if (job->opt.row != def->opt)
        return sim_err(SIM_ERR_INTERNAL, "opt_type=%s: the model was defined with opt_type=%s", job->opt.row->name,
                       def->opt->name);
    SIM_TRY(model_opt_update(&md->ctx, &job->opt, def->opt_param, opt, def->nparams, s, norm));
    if (md->zero1) zero1_free_grads(md);
    if (def->d.family->after_step) def->d.family->after_step(md); /* after the optimizer, as MaxText's train_step */
    SIM_TRY(sim_device_barrier(dev));
    uint64_t peak = 0;
    if (sim_device_rank_lead(dev)) { /* every device's peak: this process's, then the largest over MPI ranks */
        sim_machine *m = sim_device_machine(dev);
        for (int d = 0; d < sim_machine_num_devices(m); d++) {
            sim_arena_stats as;
            sim_arena_get_stats(sim_device_arena(sim_machine_device(m, d)), &as);
            if (as.peak > peak) peak = as.peak;
        }
        if (sim_machine_ranks(m) > 1) SIM_TRY(sim_xrank_max_u64(&peak));
    }
    if (id == 0) {
        model_step_stats *ss = &job->stats[s];
        ss->step = s;
        ss->loss = loss_value;
        ss->mtp_loss = md->mtp_loss; /* MTP refuses gradient accumulation: one pass per step */
        ss->raw_grad_norm = norm;
        ss->grad_norm = model_clipped_norm(&job->opt, norm); /* both optimizers clip with model_clip_applies */
        ss->lr = model_lr_at(&job->opt, s);
        ss->time_s = (double)(sim_now_ns() - t0) / 1e9;
        ss->peak_bytes = (size_t)peak;
        if (job->on_step) job->on_step(ss, job->cb_arg);
    }
    return sim_device_barrier(dev); /* others wait while device 0 reads their arenas */
}

static void layer_done(void *arg, int layer, bool backward)
{
    model_train_job *job = arg;
    job->on_layer(job->cb_arg, job->step, layer, backward);
}

/* jax.jit's NamedSharding repr: NamedSharding(mesh=Mesh('data': 2, ..., axis_types=(Explicit, ...)),
 * spec=PartitionSpec(...), memory_kind=device) */
static void named_sharding_text(const mesh_shape *m, const mesh_spec *s, char *buf, size_t cap)
{
    size_t n = (size_t)snprintf(buf, cap, "NamedSharding(mesh=Mesh(");
    for (int a = 0; a < m->n_axes && n < cap; a++)
        n += (size_t)snprintf(buf + n, cap - n, "'%s': %d, ", m->names[a], m->sizes[a]);
    for (int a = 0; a < m->n_axes && n < cap; a++)
        n += (size_t)snprintf(buf + n, cap - n, "%s%s", a ? ", " : "axis_types=(", "Explicit");
    char spec[256];
    mesh_spec_format(s, m, spec, sizeof spec);
    if (n < cap) snprintf(buf + n, cap - n, ")), spec=PartitionSpec%s, memory_kind=device)", spec + 1);
}

/* MaxText 0.2.0's ZeRO-1 in explicit mode: the optimizer state's jit in_shardings carry 'data'
 * (ZeRO-1's layout) while the abstract state built under the explicit mesh is typed with the
 * parameters' shardings, and jax.jit refuses the mismatch when it lowers the step (rows P10, Z05,
 * Z06 of tests/data/maxtext-0.2.0/verdicts); 0.2.5 builds the state in ZeRO-1's layout
 * (sharding.build_zero1_input_state_mesh_shardings).  The first state leaf whose layouts differ is
 * named, in shardsim's parameter order (JAX's leaf may be another). */
static sim_status zero1_state_check(const model_dev *md)
{
    const model_def *def = md->def;
    if (!md->zero1 || md->ctx.mode != MESH_MODE_EXPLICIT) return SIM_OK;
    if (!cfg_release_error(md->ctx.release, "zero1_state_sharding", NULL)) return SIM_OK;
    for (int i = 0; i < def->nparams; i++) {
        if (mesh_spec_equal(&def->opt_unpruned[i], &def->unpruned[i])) continue;
        char jit[2048], arg[2048], type[256];
        named_sharding_text(&def->mesh, &def->opt_unpruned[i], jit, sizeof jit);
        named_sharding_text(&def->mesh, &def->unpruned[i], arg, sizeof arg);
        mesh_spec none;
        mesh_spec_init(&none, def->defs[i].rank);
        mesh_type_format(&def->mesh, SIM_F32, def->defs[i].rank, def->defs[i].shape, &none, type, sizeof type);
        return sim_err(SIM_ERR_SHARDING,
                       "opt_state/%s (jit): ValueError: Sharding passed to jit does not match the sharding on the "
                       "respective arg. Got jit sharding: %s,\narg sharding: %s for arg type: float32%s\n"
                       "  MaxText %s fails here too: the step's lowering (jax.jit in_shardings)\n"
                       "  fix: shard_mode=auto (MaxText %s trains ZeRO-1 there), shard_optimizer_over_data=false, or "
                       "follow maxtext_release=0.2.5 (it builds the state in ZeRO-1's layout)",
                       def->defs[i].path, jit, arg, type + 3, cfg_release_maxtext(md->ctx.release),
                       cfg_release_maxtext(md->ctx.release));
    }
    return SIM_OK;
}

/* JAX's repr of a spec's entries as a tuple: ('fsdp',), (None, None, ('fsdp', 'x'), None) */
static void spec_tuple(const mesh_shape *m, const mesh_spec *s, char *buf, size_t cap)
{
    size_t n = (size_t)snprintf(buf, cap, "(");
    for (int d = 0; d < s->rank && n < cap; d++) {
        if (d) n += (size_t)snprintf(buf + n, cap - n, ", ");
        if (!s->n_axes[d]) n += (size_t)snprintf(buf + n, cap - n, "None");
        else if (s->n_axes[d] == 1) n += (size_t)snprintf(buf + n, cap - n, "'%s'", m->names[s->axes[d][0]]);
        else
            for (int j = 0; j < s->n_axes[d] && n < cap; j++)
                n += (size_t)snprintf(buf + n, cap - n, "%s'%s'%s", j ? ", " : "(", m->names[s->axes[d][j]],
                                      j == s->n_axes[d] - 1 ? ")" : "");
    }
    if (n < cap) snprintf(buf + n, cap - n, s->rank == 1 ? ",)" : ")");
}

/* MaxText 0.2.0's optimizer update (train.py train_step, state.apply_gradients): optax adds each
 * gradient to its moment, and JAX 0.8.1's broadcasting rule refuses a dim both sharded, differently:
 * with ZeRO-1 and fsdp > 1 (gradient P('fsdp') against moment P(('data', 'fsdp'))), and with the sparse
 * MoE, whose expert kernels' gradients come out of its shard_map with its in_specs (0.2.0:
 * embed_tensor_transpose, not the kernels' embed_no_exp: a tensor_transpose mesh with fsdp, seed
 * 000's FSDP2+TPT2).  Rows Z03 and Z06 of tests/data/maxtext-0.2.0/verdicts.  The first such
 * parameter in JAX's tree order (paths sorted) is named, as JAX does. */
static sim_status optimizer_add_check(const model_dev *md)
{
    const model_def *def = md->def;
    if (md->ctx.mode != MESH_MODE_EXPLICIT) return SIM_OK;
    const char *where = cfg_release_error(md->ctx.release, "optimizer_update_add", NULL);
    if (!where) return SIM_OK;
    const model_family *fam = def->d.family;
    int best = -1;
    mesh_spec best_g, best_m;
    for (int i = 0; i < def->nparams; i++) {
        /* (a pipeline's ZeRO-1 moments in 0.2.0 take 'data' where the gradient is unsharded, so the add
         * traces there and jax.jit refuses the state at lowering instead: rows P10, Z05, S02) */
        mesh_spec g = def->spec[i], mom = md->zero1 && !def->d.pipe.on ? def->opt_spec[i] : def->spec[i];
        const char *names[MESH_SPEC_MAX_RANK];
        int n = fam && fam->grad_names ? fam->grad_names(def, i, names, MESH_SPEC_MAX_RANK) : 0;
        if (n == def->defs[i].rank) SIM_TRY(model_logical_spec(def, def->defs[i].path, n, names, &g));
        bool clash = false;
        for (int d = 0; d < g.rank && !clash; d++)
            clash = g.n_axes[d] && mom.n_axes[d] &&
                    (g.n_axes[d] != mom.n_axes[d] || memcmp(g.axes[d], mom.axes[d], (size_t)g.n_axes[d]) != 0);
        if (!clash || (best >= 0 && strcmp(def->defs[i].path, def->defs[best].path) >= 0)) continue;
        best = i, best_g = g, best_m = mom;
    }
    if (best < 0) return SIM_OK;
    char a[512], b[512];
    spec_tuple(&def->mesh, &best_g, a, sizeof a);
    spec_tuple(&def->mesh, &best_m, b, sizeof b);
    return sim_err(SIM_ERR_SHARDING,
                   "opt_state/%s (add): ShardingTypeError: add got incompatible shardings for broadcasting: %s, %s.\n"
                   "  MaxText %s fails here too: %s\n"
                   "  fix: shard_mode=auto, or a mesh where the gradient and its optimizer moment agree",
                   def->defs[best].path, a, b, cfg_release_maxtext(md->ctx.release), where);
}

static sim_status train_device(sim_device *dev, void *arg)
{
    model_train_job *job = arg;
    model_dev md;
    const model_def *def = job->def;
    sim_status st;
    SIM_TRY_GOTO(model_dev_init(&md, def, dev, true, true), st, fail);
    SIM_TRY_GOTO(optimizer_add_check(&md), st, fail); /* traced before the step is lowered */
    SIM_TRY_GOTO(zero1_state_check(&md), st, fail);
    if (sim_device_id(dev) == 0 && job->on_layer) {
        md.on_layer = layer_done;
        md.on_layer_arg = job;
    }
    long long loaded_step = 0;
    if (job->load_path && *job->load_path)
        SIM_TRY_GOTO(model_checkpoint_load(dev, &def->mesh, job->load_path, md.zero1 ? md.z : md.p, def->nparams,
                                           job->load_full_state, &loaded_step),
                     st, fail);
    if (job->load_full_state && !sim_device_dry(dev) && loaded_step != job->start_step - 1)
        SIM_TRY_GOTO(sim_err(SIM_ERR_INPUT,
                             "checkpoint %s was saved after step %lld, not after step %lld as read from it "
                             "before the run; it changed while the run started: run again",
                             job->load_path, loaded_step, job->start_step - 1),
                     st, fail);
    /* ZeRO-1 holds only the optimizer-layout state between steps (the first step gathers too) */
    if (md.zero1) zero1_release(&md, true);
    bool ckpt = job->checkpoint_dir && *job->checkpoint_dir && job->checkpoint_period > 0;
    /* ZeRO-1 saves (and loads) its stored state: the same tensors, written from the optimizer layout */
    model_param *state = md.zero1 ? md.z : md.p;
    for (int64_t s = job->load_full_state ? job->start_step : 0; s < job->steps; s++) {
        if (sim_device_id(dev) == 0) job->step = s;
        SIM_TRY_GOTO(train_step(job, &md, s), st, fail);
        /* MaxText's schedule (checkpointing.maybe_save_checkpoint): after step s when
         * s % checkpoint_period == 0, step 0 only with save_checkpoint_on_start; and after
         * the last step with save_checkpoint_on_completion when the period did not save it */
        bool periodic = ckpt && s % job->checkpoint_period == 0 && (s != 0 || !job->skip_save_on_start);
        bool final = ckpt && s == job->steps - 1 && !job->skip_save_on_completion && s % job->checkpoint_period != 0;
        if (periodic || final)
            SIM_TRY_GOTO(model_checkpoint_save(dev, &def->mesh, job->checkpoint_dir, s, state, def->nparams), st, fail);
    }
    if (job->final_params) { /* ZeRO-1 first gathers its stored state into the parameters */
        if (md.zero1) SIM_TRY_GOTO(zero1_gather_params(&md), st, fail);
        SIM_TRY_GOTO(params_global(&md, job->final_params, NULL, false), st, fail);
    }
fail:
    model_dev_free(&md);
    return st;
}

sim_status model_train(model_train_job *job, sim_machine *m)
{
    const model_def *def = job->def;
    size_t n = (size_t)(def->d.rows_loaded * def->d.ga * def->d.seq), nmb = (size_t)(def->d.rows_loaded * def->d.seq);
    /* a dry run moves no data: no host rows (their size grows with gradient_accumulation_steps) */
    bool host = !def->d.dry_run;
    job->inputs = host ? calloc(n, sizeof(int32_t)) : NULL;
    job->targets = host ? calloc(n, sizeof(int32_t)) : NULL;
    job->positions = host ? calloc(n, sizeof(int32_t)) : NULL;
    /* one microbatch: its own arrays when accumulating, else the step's */
    bool own = host && def->d.ga > 1;
    job->mb_inputs = own ? calloc(nmb, sizeof(int32_t)) : job->inputs;
    job->mb_targets = own ? calloc(nmb, sizeof(int32_t)) : job->targets;
    job->mb_positions = own ? calloc(nmb, sizeof(int32_t)) : job->positions;
    size_t biggest = 0;
    for (int i = 0; i < def->nparams; i++) {
        size_t e = 1;
        for (int d = 0; d < def->defs[i].rank; d++) e *= (size_t)def->defs[i].shape[d];
        if (e > biggest) biggest = e;
    }
    job->scratch = job->step_grads && def->d.zero1 ? calloc(biggest, sizeof(float)) : NULL;
    if (job->step_grads)
        for (long long s = 0; s < job->steps; s++) model_grads_alloc(def, &job->step_grads[s]);
    if (job->final_params) model_grads_alloc(def, job->final_params);
    sim_status st = sim_machine_run(m, train_device, job);
    if (st == SIM_OK && sim_machine_ranks(m) > 1) { /* under MPI: device 0's step stats, every device's stores */
        if (job->stats) st = sim_xrank_from_rank0(job->stats, (size_t)job->steps * sizeof *job->stats);
        for (long long s = 0; job->step_grads && s < job->steps && st == SIM_OK; s++)
            st = model_grads_merge_ranks(&job->step_grads[s]);
        if (st == SIM_OK && job->final_params) st = model_grads_merge_ranks(job->final_params);
    }
    if (own) {
        free(job->mb_inputs);
        free(job->mb_targets);
        free(job->mb_positions);
    }
    free(job->inputs);
    free(job->targets);
    free(job->positions);
    free(job->scratch);
    job->inputs = job->targets = job->positions = NULL;
    job->mb_inputs = job->mb_targets = job->mb_positions = NULL;
    job->scratch = NULL;
    return st;
}
