/* pipeline_run.c — the pipelined decoder stack on the tape (MaxText's
 * NNXPipeline, layers/pipeline.py); the config and the schedule's arithmetic
 * are pipeline.c's.
 *
 * Design.  The whole stack is two reshapes around one tape entry.  The entry
 * is a manual region over `stage` (MaxText's shard_maps): every device is one
 * stage s and works on its own slot of the [S, mb, seq, emb] buffers, which
 * it sees as a [mb, seq, emb] array sharded on the other axes only, so every
 * collective a layer makes stays inside its stage.  Forward runs the
 * M*R + d*(S-1) iterations; each keeps its layers' inputs (MaxText's remat
 * policy saves iteration_input and decoder_layer_input) and ends with the
 * ppermutes of get_new_loop_state.  Backward runs the iterations in reverse:
 * the transpose of each buffer update (inverse permutations), then each layer
 * recomputed from its saved input and back-propagated.  Bubble iterations run
 * like the others (their results never reach state_io, so their cotangents
 * are zero) because hardware spends that compute too. */
#include "models/core/pipeline_run.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "config/release.h"
#include "mesh/ops.h"
#include "mesh/reshard.h"

/* MaxText's logical names of the buffers (pipeline.py _setup_pipeline_attributes). */
static const char *const STAGES_IN[4] = {"activation_stage", "activation_batch", "activation_length",
                                         "activation_embed"};
static const char *const STATE_IO[5] = {"activation_stage", NULL, "activation_batch", "activation_length",
                                        "activation_embed"};
static const char *const INPUT4[4] = {NULL, "activation_batch", "activation_length", "activation_embed"};
static const char *const OUTPUT3[3] = {"activation_batch", "activation_length", "activation_embed"};

/* pipeline_fsdp_ag_once: one layer's weight gathered over fsdp for the whole step. */
typedef struct {
    int param, layer;
    mesh_array w, g;           /* gathered weight, and its gradient (partial over the gathered axes) */
    mesh_array w_keep, g_keep; /* the stored shard and gradient while swapped out */
    bool g_born_after;         /* the stored gradient is released while the loop runs and born at the reduce-scatter */
} pipe_ag;

typedef struct {
    model_dev *md;
    const model_pipe *p;
    model_layer_fn fn;
    int64_t first_layer;     /* model layer index of the stack's layer 0 (DeepSeek: the dense layers come first) */
    int64_t iters, stage, n; /* n: local elements of one [mb, seq, emb] slot */
    int64_t slot_shape[3];   /* [mb, seq, emb] */
    mesh_spec inner;         /* a slot as its stage sees it: the shift spec without the stage dim */
    mesh_spec s_io, s_shift; /* state_io [S, M/S, mb, seq, emb] and shift [S, mb, seq, emb] */
    int64_t io_shape[5], shift_shape[4];
    mesh_array *saved;    /* [iters * L] layer inputs (iteration_input, decoder_layer_input) */
    mesh_replay **replay; /* [iters * L] each layer run's values for its recomputation (NULL: none kept) */
    model_batch *mbs;     /* [M] each microbatch's positions, replicated (MaxText gathers them) */
    mesh_array pos;       /* all positions, replicated */
    int nag;
    pipe_ag *ag;
    pipe_ag *rep; /* pipeline_fsdp_ag_per_repeat: [R * nparams] repeat r's gathered layer */
} pipe_run;

static sim_device *dev_of(const pipe_run *pr) { return pr->md->ctx.dev; }
static const mesh_shape *mesh_of(const pipe_run *pr) { return &pr->md->def->mesh; }

static void copy_n(float *dst, const float *src, int64_t n)
{
    if (dst && src) memcpy(dst, src, (size_t)n * sizeof *dst);
}

static void zero_n(float *dst, int64_t n)
{
    if (dst) memset(dst, 0, (size_t)n * sizeof *dst);
}

static void add_n(float *dst, const float *src, int64_t n)
{
    if (!dst || !src) return;
    for (int64_t i = 0; i < n; i++) dst[i] += src[i];
}

static float *col(mesh_array *a, int64_t k, int64_t n) { return a->data ? (float *)a->data + k * n : NULL; }

static sim_status slot_new(pipe_run *pr, const char *name, sim_mem_cat cat, mesh_array *a)
{
    return mesh_array_new(dev_of(pr), mesh_of(pr), name, 3, pr->slot_shape, &pr->inner, SIM_F32, cat, a);
}

/* One ppermute of a slot over `stage`: dir +1 sends stage j to j+1 (MaxText's
 * _rotate_right / _shift_right pairs), -1 sends j to j-1 (state_io's
 * _rotate_left); every pair is sent, the wrap-around one included. */
static sim_status ppermute(pipe_run *pr, const float *send, float *recv, int dir, const char *tag)
{
    int S = (int)pr->p->stages, perm[SIM_MAX_DEVICES];
    SIM_ASSERT(S <= SIM_MAX_DEVICES);
    for (int j = 0; j < S; j++) perm[j] = ((j + dir) % S + S) % S;
    return sim_ppermute(dev_of(pr), send, recv, (size_t)pr->n, perm, SIM_F32, sim_axes_1(pr->p->stage_axis),
                        sim_meta_tag(tag));
}

static int64_t layer_of(const pipe_run *pr, int64_t i, int64_t l, int64_t *micro)
{
    const model_pipe *p = pr->p;
    int64_t rep;
    model_pipe_ids(p, i, pr->stage, micro, &rep);
    if (rep >= p->repeats) rep = p->repeats - 1; /* cool-down bubbles: JAX clamps the repeat index */
    return pr->first_layer + (rep * p->stages + pr->stage) * p->layers_per_stage + l;
}

/* Brings a layer output (or input cotangent) to the slot's spec: the shard_map's in_specs. */
static sim_status to_inner(pipe_run *pr, mesh_array *a, const char *tag)
{
    if (mesh_spec_equal(&a->spec, &pr->inner)) return SIM_OK;
    return mesh_reshard(dev_of(pr), mesh_of(pr), a, &pr->inner, sim_meta_implicit(tag));
}

/* The stage's L layers on the saved input of iteration i (no tape): out. */
static sim_status stage_forward(pipe_run *pr, int64_t i, mesh_array *out)
{
    model_dev *md = pr->md;
    int64_t L = pr->p->layers_per_stage;
    for (int64_t l = 0; l < L; l++) {
        int64_t micro, layer = layer_of(pr, i, l, &micro);
        mesh_tape *scratch = mesh_tape_new(&md->ctx, false);
        mesh_var *xin = mesh_tape_input(scratch, &pr->saved[i * L + l], false), *yin = NULL, *aux = NULL;
        if (pr->replay) pr->replay[i * L + l] = model_replay_begin(md, true);
        sim_status st = pr->fn(md, scratch, &pr->mbs[micro], (int)layer, xin, &yin, &aux);
        model_replay_end(md);
        mesh_array y;
        memset(&y, 0, sizeof y);
        if (st == SIM_OK && aux)
            st =
                sim_err(SIM_ERR_INTERNAL, "pipeline: layer %lld has a second output (not supported)", (long long)layer);
        if (st == SIM_OK) y = mesh_tape_take(scratch, yin);
        mesh_tape_free(scratch);
        SIM_TRY(st);
        SIM_TRY(to_inner(pr, &y, "pipeline/stage_out"));
        if (l + 1 < L) {
            st = mesh_array_clone(dev_of(pr), mesh_of(pr), &y, "pipeline/decoder_layer_input", SIM_MEM_ACTIVATIONS,
                                  &pr->saved[i * L + l + 1]);
            mesh_array_free(dev_of(pr), &y);
            SIM_TRY(st);
        } else *out = y;
    }
    return SIM_OK;
}

/* Backward of the stage's layers at iteration i: cotangent g_out (consumed) -> g_in. */
static sim_status stage_backward(pipe_run *pr, int64_t i, mesh_array *g_out, mesh_array *g_in)
{
    model_dev *md = pr->md;
    int64_t L = pr->p->layers_per_stage;
    mesh_array g = *g_out;
    for (int64_t l = L - 1; l >= 0; l--) {
        int64_t micro, layer = layer_of(pr, i, l, &micro);
        mesh_tape *inner = mesh_tape_new(&md->ctx, true);
        mesh_var *xin = mesh_tape_input(inner, &pr->saved[i * L + l], true), *yin = NULL, *aux = NULL;
        mesh_replay **rp = pr->replay ? &pr->replay[i * L + l] : NULL;
        model_replay_use(md, rp ? *rp : NULL);
        sim_status st = pr->fn(md, inner, &pr->mbs[micro], (int)layer, xin, &yin, &aux);
        model_replay_end(md);
        if (rp) mesh_replay_free(*rp), *rp = NULL; /* every value went back into the recomputation */
        if (st == SIM_OK) st = mesh_tape_backward_from(inner, yin, &g);
        else mesh_array_free(dev_of(pr), &g);
        memset(&g, 0, sizeof g);
        if (st == SIM_OK && xin->has_grad) {
            g = xin->grad;
            xin->has_grad = false;
        } else if (st == SIM_OK) st = slot_new(pr, "pipeline/dx", SIM_MEM_TEMP, &g);
        mesh_tape_free(inner);
        if (st == SIM_OK) st = to_inner(pr, &g, "pipeline/stage_in_grad");
        if (st != SIM_OK) {
            mesh_array_free(dev_of(pr), &g);
            return st;
        }
    }
    *g_in = g;
    return SIM_OK;
}

/* ---- pipeline_fsdp_ag_once: gather every held layer once, swap it in while the stack runs */
/* A stage weight's gathered copy is held and moved in the weight's own dtype (weight_dtype, or dtype
 * where ZeRO-1 with accumulation fixed it), or in `dtype` where the hardware profile's compiler casts
 * the fsdp shard before the all-gather (mesh_array_gather_dtype; XLA:TPU: MaxText 0.2.5's llama2-7b
 * pipeline compiled for v5p-8 gathers its stage's layers in bf16, 6176 MiB instead of 12353).  The
 * gathered gradient's float32 accumulator stays as counted (XLA:TPU carries it in float32 in the
 * gathered shape too); its reduction moves the profile's reduction dtype (mesh_array_reduce_dtype). */

static void ag_swap(pipe_run *pr, bool in)
{
    for (int k = 0; k < pr->nag; k++) {
        pipe_ag *a = &pr->ag[k];
        model_param *p = &pr->md->p[a->param];
        if (in) {
            a->w_keep = p->w[a->layer];
            p->w[a->layer] = a->w;
            if (p->g) {
                a->g_keep = p->g[a->layer];
                p->g[a->layer] = a->g;
            }
        } else {
            a->w = p->w[a->layer];
            p->w[a->layer] = a->w_keep;
            if (p->g) {
                a->g = p->g[a->layer];
                p->g[a->layer] = a->g_keep;
            }
        }
    }
}

static sim_status ag_gather(pipe_run *pr, bool with_grads)
{
    model_dev *md = pr->md;
    const model_def *m = md->def;
    uint32_t gone = 0;
    static const char *const fsdp_axes[2] = {"fsdp", "fsdp_transpose"};
    for (int k = 0; k < 2; k++) {
        int ax = mesh_shape_axis_index(&m->mesh, fsdp_axes[k]);
        if (ax >= 0) gone |= 1u << ax;
    }
    int count = 0;
    for (int i = 0; i < m->nparams; i++)
        if (model_param_pipelined(m, i)) count += md->p[i].n_layers;
    pr->ag = calloc((size_t)count, sizeof *pr->ag);
    SIM_ASSERT(pr->ag);
    for (int i = 0; i < m->nparams; i++) {
        model_param *p = &md->p[i];
        if (!model_param_pipelined(m, i)) continue;
        for (int l = 0; l < p->n_layers; l++) {
            if (!model_holds_layer(m, sim_device_id(md->ctx.dev), l)) continue;
            if (!(mesh_spec_dim_axes(&p->w[l].spec) & gone)) continue; /* nothing to gather */
            pipe_ag *a = &pr->ag[pr->nag++];
            a->param = i;
            a->layer = l;
            mesh_spec to = p->w[l].spec;
            for (int dd = 0; dd < to.rank; dd++) {
                int kept = 0;
                for (int q = 0; q < to.n_axes[dd]; q++)
                    if (!(gone & (1u << to.axes[dd][q]))) to.axes[dd][kept++] = to.axes[dd][q];
                to.n_axes[dd] = kept;
            }
            SIM_TRY(
                mesh_array_clone(md->ctx.dev, &m->mesh, &p->w[l], "pipeline/fsdp_ag_once", SIM_MEM_ACTIVATIONS, &a->w));
            mesh_array_recount(md->ctx.dev, &a->w, mesh_array_gather_dtype(md->ctx.dev, &p->w[l]));
            SIM_TRY(mesh_reshard(md->ctx.dev, &m->mesh, &a->w, &to, sim_meta_weight("pipeline/fsdp_ag_once")));
            if (with_grads && p->g) {
                /* partial over the gathered axes: one reduce-scatter after the loop */
                to.partial = mesh_spec_dim_axes(&p->w[l].spec) & gone;
                SIM_TRY(mesh_array_new(md->ctx.dev, &m->mesh, "pipeline/fsdp_ag_once (grad)", a->w.rank, a->w.shape,
                                       &to, SIM_F32, SIM_MEM_GRADS, &a->g));
                /* The layer's sharded gradient does not exist while the loop runs: in MaxText's compiled
                 * step (peers/maxtext/hlo_bytes.sh, llama2-7b 4 layers, stage=2 fsdp=2, ag_once, dtype
                 * bfloat16) the backward while loop carries the gradient as a float32 accumulator in the
                 * gathered shape (f32[R,1,emb,mlp], zeros as its initial carry), and the fsdp-sharded
                 * gradient is first written by the reduction after that loop.  So it is released here and
                 * born in ag_release.  Not with gradient accumulation, where it carries the sum of the
                 * earlier microbatches. */
                if (md->def->d.ga == 1) {
                    mesh_array_free(md->ctx.dev, &p->g[l]);
                    a->g_born_after = true;
                }
            }
        }
    }
    return SIM_OK;
}

/* Reduce-scatters the gathered gradients into the stored ones and frees the copies. */
static sim_status ag_release(pipe_run *pr)
{
    model_dev *md = pr->md;
    sim_status st = SIM_OK;
    for (int k = 0; k < pr->nag; k++) {
        pipe_ag *a = &pr->ag[k];
        model_param *p = &md->p[a->param];
        if (st == SIM_OK && a->g.rank > 0 && p->g) {
            mesh_array *own = &p->g[a->layer];
            st = mesh_reshard(md->ctx.dev, &md->def->mesh, &a->g, &own->spec,
                              sim_meta_counted(sim_meta_weight("pipeline/fsdp_ag_once (grad)"),
                                               mesh_array_reduce_dtype(md->ctx.dev, a->g.counted)));
            if (st == SIM_OK && a->g_born_after) { /* the reduce-scatter's result is the gradient */
                char name[sizeof own->name];
                memcpy(name, own->name, sizeof name);
                *own = a->g;
                memcpy(own->name, name, sizeof name);
                memset(&a->g, 0, sizeof a->g);
                a->g_born_after = false;
            } else if (st == SIM_OK) mesh_local_add(own, &a->g);
        }
        if (a->g_born_after) { /* an error on the way: the stored gradient exists again (zero) */
            mesh_array *own = &p->g[a->layer];
            mesh_array old = *own;
            sim_status st2 = mesh_array_new(md->ctx.dev, &md->def->mesh, old.name, old.rank, old.shape, &old.spec,
                                            SIM_F32, SIM_MEM_GRADS, own);
            if (st == SIM_OK) st = st2;
        }
        mesh_array_free(md->ctx.dev, &a->g);
        mesh_array_free(md->ctx.dev, &a->w);
    }
    free(pr->ag);
    pr->ag = NULL;
    pr->nag = 0;
    return st;
}

/* ---- pipeline_fsdp_ag_per_repeat: MaxText's buffer sliding window (NNXCircularPipeline).
 *
 * With one layer per stage (types.py requires it) a stage holds one layer per
 * repeat.  Forward: at the start of repeat r the stage's layer of repeat r is
 * all-gathered over fsdp/fsdp_transpose (bsw[1] = w_next); the previous
 * repeat's (bsw[0] = w_curr, still run by the last stage at the repeat's first
 * iteration) stays until the repeat ends, so at most two gathered layers live
 * at once; the drain bubbles use the last one.  Backward: MaxText remats each
 * repeat (the gathered weights are not among the saved names), so every
 * gathered layer is gathered again, again at most two at once: the last
 * repeat's before the drain, repeat r-1's when repeat r starts.  The layer's
 * gradient stays gathered (partial over fsdp) until repeats r and r+1 and
 * the drain have added to it, then one reduce-scatter (the transpose of the
 * gather) brings it to the stored shard. */

static pipe_ag *rep_slot(pipe_run *pr, int64_t r, int i) { return &pr->rep[r * pr->md->def->nparams + i]; }

static uint32_t fsdp_mask(const mesh_shape *mesh)
{
    uint32_t gone = 0;
    static const char *const fsdp_axes[2] = {"fsdp", "fsdp_transpose"};
    for (int k = 0; k < 2; k++) {
        int ax = mesh_shape_axis_index(mesh, fsdp_axes[k]);
        if (ax >= 0) gone |= 1u << ax;
    }
    return gone;
}

/* Gathers the stage's layer of repeat r (and, with_grads, opens its gathered gradient), swapped in. */
static sim_status rep_gather(pipe_run *pr, int64_t r, bool with_grads)
{
    model_dev *md = pr->md;
    const model_def *m = md->def;
    const uint32_t gone = fsdp_mask(&m->mesh);
    const int64_t l = r * pr->p->stages + pr->stage; /* stack index (one layer per stage) */
    for (int i = 0; i < m->nparams; i++) {
        model_param *p = &md->p[i];
        if (!model_param_pipelined(m, i) || l >= p->n_layers) continue;
        SIM_ASSERT(model_holds_layer(m, sim_device_id(md->ctx.dev), l));
        if (!(mesh_spec_dim_axes(&p->w[l].spec) & gone)) continue; /* nothing to gather */
        pipe_ag *a = rep_slot(pr, r, i);
        SIM_ASSERT(a->w.rank == 0 && a->g.rank == 0);
        a->param = i;
        a->layer = (int)l;
        mesh_spec to = p->w[l].spec;
        for (int dd = 0; dd < to.rank; dd++) {
            int kept = 0;
            for (int q = 0; q < to.n_axes[dd]; q++)
                if (!(gone & (1u << to.axes[dd][q]))) to.axes[dd][kept++] = to.axes[dd][q];
            to.n_axes[dd] = kept;
        }
        mesh_array w, g;
        memset(&w, 0, sizeof w);
        memset(&g, 0, sizeof g);
        sim_status st =
            mesh_array_clone(md->ctx.dev, &m->mesh, &p->w[l], "pipeline/fsdp_ag_per_repeat", SIM_MEM_ACTIVATIONS, &w);
        if (st == SIM_OK) mesh_array_recount(md->ctx.dev, &w, mesh_array_gather_dtype(md->ctx.dev, &p->w[l]));
        if (st == SIM_OK)
            st = mesh_reshard(md->ctx.dev, &m->mesh, &w, &to, sim_meta_weight("pipeline/fsdp_ag_per_repeat"));
        if (st == SIM_OK && with_grads && p->g) {
            to.partial = mesh_spec_dim_axes(&p->w[l].spec) & gone;
            st = mesh_array_new(md->ctx.dev, &m->mesh, "pipeline/fsdp_ag_per_repeat (grad)", w.rank, w.shape, &to,
                                SIM_F32, SIM_MEM_GRADS, &g);
        }
        if (st != SIM_OK) {
            mesh_array_free(md->ctx.dev, &w);
            mesh_array_free(md->ctx.dev, &g);
            return st;
        }
        a->w = w;
        a->g = g;
        /* swap in: the layer function sees the gathered weight and accumulates into the gathered gradient */
        a->w_keep = p->w[l];
        p->w[l] = a->w;
        if (p->g && a->g.rank > 0) {
            a->g_keep = p->g[l];
            p->g[l] = a->g;
        }
    }
    return SIM_OK;
}

/* Swaps repeat r's gathered layer out; reduce_scatter: its gradient goes into the stored shard. */
static sim_status rep_release(pipe_run *pr, int64_t r, bool reduce_scatter)
{
    model_dev *md = pr->md;
    sim_status st = SIM_OK;
    for (int i = 0; i < md->def->nparams; i++) {
        pipe_ag *a = rep_slot(pr, r, i);
        if (a->w.rank == 0) continue;
        model_param *p = &md->p[a->param];
        a->w = p->w[a->layer];
        p->w[a->layer] = a->w_keep;
        if (a->g.rank > 0) {
            a->g = p->g[a->layer];
            p->g[a->layer] = a->g_keep;
            if (st == SIM_OK && reduce_scatter) {
                st = mesh_reshard(md->ctx.dev, &md->def->mesh, &a->g, &p->g[a->layer].spec,
                                  sim_meta_counted(sim_meta_weight("pipeline/fsdp_ag_per_repeat (grad)"),
                                                   mesh_array_reduce_dtype(md->ctx.dev, a->g.counted)));
                if (st == SIM_OK) mesh_local_add(&p->g[a->layer], &a->g);
            }
        }
        mesh_array_free(md->ctx.dev, &a->g);
        mesh_array_free(md->ctx.dev, &a->w);
        memset(a, 0, sizeof *a);
    }
    return st;
}

static void rep_release_all(pipe_run *pr)
{
    if (!pr->rep) return;
    for (int64_t r = 0; r < pr->p->repeats; r++) (void)rep_release(pr, r, false);
    free(pr->rep);
    pr->rep = NULL;
}

static void run_free(void *arg)
{
    pipe_run *pr = arg;
    sim_device *d = dev_of(pr);
    if (pr->saved) {
        int64_t ns = pr->iters * pr->p->layers_per_stage;
        for (int64_t k = 0; k < ns; k++) mesh_array_free(d, &pr->saved[k]);
        free(pr->saved);
    }
    if (pr->replay) {
        for (int64_t k = 0; k < pr->iters * pr->p->layers_per_stage; k++) mesh_replay_free(pr->replay[k]);
        free(pr->replay);
    }
    if (pr->mbs) {
        for (int64_t m = 0; m < pr->p->microbatches; m++) mesh_array_free(d, &pr->mbs[m].positions);
        free(pr->mbs);
    }
    mesh_array_free(d, &pr->pos);
    if (pr->ag) (void)ag_release(pr);
    rep_release_all(pr);
    free(pr);
}

/* Each microbatch's positions: MaxText all-gathers them to P(None, None) and
 * reshapes to [M, mb, seq]; stage s reads its microbatch's rows. */
static sim_status microbatch_positions(pipe_run *pr, const model_batch *b)
{
    const model_pipe *p = pr->p;
    sim_device *d = dev_of(pr);
    mesh_spec rep;
    mesh_spec_init(&rep, 2);
    SIM_TRY(mesh_array_clone(d, mesh_of(pr), &b->positions, "pipeline/positions", SIM_MEM_ACTIVATIONS, &pr->pos));
    SIM_TRY(mesh_reshard(d, mesh_of(pr), &pr->pos, &rep, sim_meta_tag("pipeline/positions")));
    pr->mbs = calloc((size_t)p->microbatches, sizeof *pr->mbs);
    SIM_ASSERT(pr->mbs);
    int64_t shape[2] = {p->micro_rows, pr->slot_shape[1]};
    size_t per = (size_t)(shape[0] * shape[1]);
    for (int64_t m = 0; m < p->microbatches; m++) {
        SIM_TRY(mesh_array_new_raw(d, mesh_of(pr), "pipeline/positions", 2, shape, &rep, SIM_I32, SIM_MEM_ACTIVATIONS,
                                   &pr->mbs[m].positions));
        if (pr->pos.data && pr->mbs[m].positions.data)
            memcpy(pr->mbs[m].positions.data, (const int32_t *)pr->pos.data + (size_t)m * per, per * sizeof(int32_t));
    }
    return SIM_OK;
}

/* MaxText 0.2.5's explicit-mode verdict on the positions gather.
 *
 * Each iteration picks every stage's microbatch of positions by vmapping
 * `x.at[i].get(out_sharding=...)` over the microbatch ids, which
 * get_microbatch_and_repeat_ids places on `stage` (NNXPipeline.vmap_gather;
 * NNXCircularPipeline.gather_microbatch_inputs_vmap, used with
 * pipeline_fsdp_ag_per_repeat, does the same).  The positions stay
 * unbatched (all-gathered, reshaped to [M, mb, seq]), so the gather JAX
 * traces has a replicated operand int32[M, mb, seq] and indices
 * int32[S, 3] sharded on `stage` along the vmapped dim, which is not a
 * batching dim of the operand: JAX 0.12's gather sharding rule
 * (lax/slicing.py) requires such index dims replicated, finds no output
 * sharding and raises ShardingTypeError.  Nothing but the pipeline being
 * on decides it: every explicit-mode pipeline fails there (measured with
 * the peer's verdict.py for stage alone, circular repeats, fsdp with
 * ag_once on and off and with ag_per_repeat, data, ZeRO-1, tensor,
 * DeepSeek: rows P* of tests/data/maxtext-0.2.5/verdicts).  Auto mode types
 * no shardings at trace time and runs them.  JAX 0.8.1's gather rule accepts
 * the same gather: MaxText 0.2.0 on it traces these pipelines
 * (tests/data/maxtext-0.2.0/verdicts), so it is an error of the release
 * followed (maxtext_release). */
static sim_status explicit_positions_gather(const pipe_run *pr)
{
    const model_dev *md = pr->md;
    const model_pipe *p = pr->p;
    if (md->ctx.mode != MESH_MODE_EXPLICIT) return SIM_OK;
    const char *where =
        cfg_release_error(md->ctx.release, "pipeline_positions_gather", "layers/pipeline.py:_gather_one");
    if (!where) return SIM_OK;
    const char *rel = cfg_release_maxtext(md->ctx.release);
    const mesh_shape *ms = &md->def->mesh;
    int64_t op_shape[3] = {p->microbatches, p->micro_rows, pr->slot_shape[1]}, ix_shape[2] = {p->stages, 3};
    mesh_spec op_spec, ix_spec;
    mesh_spec_init(&op_spec, 3);
    mesh_spec_init(&ix_spec, 2);
    ix_spec.n_axes[0] = 1;
    ix_spec.axes[0][0] = (int8_t)p->stage_axis;
    char op_t[128], ix_t[128];
    /* JAX prints ShapedArray(int32[...]); mesh_type_format writes "i32[...]" */
    mesh_type_format(ms, SIM_I32, 3, op_shape, &op_spec, op_t, sizeof op_t);
    mesh_type_format(ms, SIM_I32, 2, ix_shape, &ix_spec, ix_t, sizeof ix_t);
    return sim_err(SIM_ERR_SHARDING,
                   "decoder/pipeline/positions (gather): ShardingTypeError: Use `.at[...].get(out_sharding=)` to "
                   "provide output PartitionSpec for the gather indexing as out sharding could not be resolved "
                   "unambiguously (or would require collectives on inputs). Got operand=ShapedArray(int32%s), "
                   "indices=ShapedArray(int32%s)\n"
                   "  operand 'positions' [num_pipeline_microbatches, microbatch, seq], replicated; indices: each "
                   "stage's microbatch id (vmapped dim on 'stage', not a batching dim of the operand)\n"
                   "  MaxText %s fails here too: %s\n"
                   "  fix: run the pipeline in shard_mode=auto (MaxText %s traces it there), or set "
                   "ici_pipeline_parallelism=1 and dcn_pipeline_parallelism=1 to keep shard_mode=explicit",
                   op_t + 3, ix_t + 3, rel, where, rel);
}

/* ---- the loop (forward) and its transpose (backward) */

/* Device 0 adds the layer time of iteration i (bubble or not) to the model's counters. */
static void count_time(pipe_run *pr, int64_t i, uint64_t t0)
{
    if (sim_device_id(dev_of(pr)) != 0) return;
    uint64_t dt = sim_now_ns() - t0;
    model_def *m =
        (model_def *)pr->md->def; /* like the activation log: device 0 writes, the caller reads after the run */
    m->pipe_layer_ns += dt;
    if (model_pipe_is_bubble(pr->p, i, pr->stage)) m->pipe_bubble_ns += dt;
}

/* Opens the trace span of iteration i on stage s: "<what> i: bubble", or the microbatch and repeat
 * the stage works on. */
static int iteration_span(sim_device *d, const model_pipe *p, int64_t i, int64_t s, const char *what)
{
    char name[160];
    int64_t micro, rep;
    model_pipe_ids(p, i, s, &micro, &rep);
    if (model_pipe_is_bubble(p, i, s)) snprintf(name, sizeof name, "%s %lld: bubble", what, (long long)i);
    else
        snprintf(name, sizeof name, "%s %lld: microbatch %lld repeat %lld", what, (long long)i, (long long)micro,
                 (long long)rep);
    return sim_span_begin(d, name);
}

static sim_status loop_vjp(mesh_tape *t, mesh_entry *e)
{
    pipe_run *pr = e->payload;
    const model_pipe *p = pr->p;
    sim_device *d = dev_of(pr);
    const int64_t S = p->stages, M = p->microbatches, MS = M / S, n = pr->n, s = pr->stage, L = p->layers_per_stage;
    const int64_t idx0 = (M * (p->repeats - 1) + p->delay * (S - 1)) % MS;
    const bool zero_first = p->repeats == 1 || p->circ_storage; /* _shift_right, else _rotate_right */
    mesh_var *y = e->out[0];
    const char *saved_layer = pr->md->ctx.layer;
    pr->md->ctx.layer = "decoder/pipeline";
    SIM_TRY(mesh_reshard(d, mesh_of(pr), &y->grad, &pr->s_io, sim_meta_implicit("pipeline/output_grad")));
    mesh_array g_io, g_shift, g_circ, g_mover, tmp, g_prev;
    memset(&g_circ, 0, sizeof g_circ);
    memset(&g_mover, 0, sizeof g_mover);
    memset(&g_prev, 0, sizeof g_prev);
    if (p->delay == 2) SIM_TRY(slot_new(pr, "pipeline/prev_outputs (grad)", SIM_MEM_TEMP, &g_prev));
    SIM_TRY(mesh_array_new(d, mesh_of(pr), "pipeline/state_io (grad)", 5, pr->io_shape, &pr->s_io, SIM_F32,
                           SIM_MEM_TEMP, &g_io));
    for (int64_t j = 0; j < MS; j++) copy_n(col(&g_io, (j + idx0) % MS, n), col(&y->grad, j, n), n);
    SIM_TRY(slot_new(pr, "pipeline/shift (grad)", SIM_MEM_TEMP, &g_shift));
    SIM_TRY(slot_new(pr, "pipeline/ppermute", SIM_MEM_COMM, &tmp));
    if (p->circ_storage) {
        int64_t cs[5] = {S, M, pr->slot_shape[0], pr->slot_shape[1], pr->slot_shape[2]};
        SIM_TRY(mesh_array_new(d, mesh_of(pr), "pipeline/circ_storage (grad)", 5, cs, &pr->s_io, SIM_F32, SIM_MEM_TEMP,
                               &g_circ));
        SIM_TRY(slot_new(pr, "pipeline/circ_storage_mover (grad)", SIM_MEM_TEMP, &g_mover));
    }
    if (p->ag_once) ag_swap(pr, true);
    sim_status st = SIM_OK;
    const int64_t RM = M * p->repeats;
    if (pr->rep) st = rep_gather(pr, p->repeats - 1, true); /* remat of the last repeat (and the drain) */
    for (int64_t i = pr->iters - 1; i >= 0 && st == SIM_OK; i--) {
        /* ag_per_repeat: the remat of repeat r gathers its bsw[0] (repeat r-1's layer) again */
        if (pr->rep && i < RM && (i + 1) % M == 0 && i / M >= 1) st = rep_gather(pr, i / M - 1, true);
        if (st != SIM_OK) break;
        int span = iteration_span(d, p, i, s, "pipeline backward");
        mesh_array g_out, g_in;
        st = slot_new(pr, "pipeline/output (grad)", SIM_MEM_TEMP, &g_out);
        /* shift: the transpose of the right shift/rotation is a left one */
        if (st == SIM_OK) {
            if (zero_first && s == 0) zero_n(g_shift.data, n);
            st = ppermute(pr, g_shift.data, tmp.data, -1, "pipeline/shift");
            if (p->delay == 2) { /* the shift carried prev_outputs; prev_outputs became this output */
                add_n(g_out.data, g_prev.data, n);
                copy_n(g_prev.data, tmp.data, n);
            } else add_n(g_out.data, tmp.data, n);
            zero_n(g_shift.data, n);
        }
        /* circ_storage: column c was overwritten by the rotated previous output */
        if (st == SIM_OK && p->circ_storage) {
            int64_t c = (((i - p->delay * (S - 1) - 1) % M) + M) % M;
            st = ppermute(pr, col(&g_circ, c, n), tmp.data, -1, "pipeline/circ_storage");
            zero_n(col(&g_circ, c, n), n);
            add_n(g_out.data, g_mover.data, n);
            copy_n(g_mover.data, tmp.data, n);
        }
        /* state_io: column k was rotated left and its last stage replaced by the output */
        if (st == SIM_OK) {
            int64_t k = i % MS;
            float *gc = col(&g_io, k, n);
            if (s == S - 1) {
                add_n(g_out.data, gc, n);
                zero_n(gc, n);
            }
            st = ppermute(pr, gc, tmp.data, +1, "pipeline/state_io");
            copy_n(gc, tmp.data, n);
        }
        uint64_t t0 = sim_now_ns();
        if (st == SIM_OK) st = stage_backward(pr, i, &g_out, &g_in);
        else mesh_array_free(d, &g_out);
        count_time(pr, i, t0);
        if (st == SIM_OK) {
            float *dst = g_shift.data;
            if (s == 0 && i < M) dst = col(&g_io, i % MS, n);
            else if (s == 0 && p->circ_storage) dst = col(&g_circ, i % M, n);
            add_n(dst, g_in.data, n);
            mesh_array_free(d, &g_in);
        }
        for (int64_t l = 0; l < L; l++) mesh_array_free(d, &pr->saved[i * L + l]);
        /* ag_per_repeat: repeat r's layer is complete (repeat r, repeat r+1's bsw[0], the drain): reduce-scatter */
        if (pr->rep && st == SIM_OK && i < RM && i % M == 0) st = rep_release(pr, i / M, true);
        sim_span_end(d, span);
    }
    if (p->ag_once) {
        ag_swap(pr, false);
        if (st == SIM_OK) st = ag_release(pr);
    }
    mesh_array_free(d, &tmp);
    mesh_array_free(d, &g_shift);
    mesh_array_free(d, &g_circ);
    mesh_array_free(d, &g_mover);
    mesh_array_free(d, &g_prev);
    pr->md->ctx.layer = saved_layer;
    if (st != SIM_OK) {
        mesh_array_free(d, &g_io);
        return st;
    }
    return mesh_tape_accumulate(t, e->in[0], &g_io, "pipeline/state_io");
}

static sim_status loop_forward(pipe_run *pr, const mesh_array *io_in, mesh_array *out)
{
    const model_pipe *p = pr->p;
    sim_device *d = dev_of(pr);
    const int64_t S = p->stages, M = p->microbatches, MS = M / S, n = pr->n, s = pr->stage, L = p->layers_per_stage;
    const bool zero_first = p->repeats == 1 || p->circ_storage;
    mesh_array io, shift, shift2, circ, mover, tmp, prev;
    memset(&circ, 0, sizeof circ);
    memset(&mover, 0, sizeof mover);
    memset(&prev, 0, sizeof prev);
    if (p->delay == 2) SIM_TRY(slot_new(pr, "pipeline/prev_outputs", SIM_MEM_TEMP, &prev));
    SIM_TRY(mesh_array_clone(d, mesh_of(pr), io_in, "pipeline/state_io", SIM_MEM_TEMP, &io));
    SIM_TRY(mesh_array_new(d, mesh_of(pr), "pipeline/shift", 4, pr->shift_shape, &pr->s_shift, SIM_F32, SIM_MEM_TEMP,
                           &shift));
    SIM_TRY(mesh_array_new(d, mesh_of(pr), "pipeline/shift", 4, pr->shift_shape, &pr->s_shift, SIM_F32, SIM_MEM_TEMP,
                           &shift2));
    SIM_TRY(slot_new(pr, "pipeline/ppermute", SIM_MEM_COMM, &tmp));
    SIM_ASSERT(shift.nlocal == (size_t)n && io.nlocal == (size_t)(MS * n));
    if (p->circ_storage) {
        int64_t cs[5] = {S, M, pr->slot_shape[0], pr->slot_shape[1], pr->slot_shape[2]};
        SIM_TRY(
            mesh_array_new(d, mesh_of(pr), "pipeline/circ_storage", 5, cs, &pr->s_io, SIM_F32, SIM_MEM_TEMP, &circ));
        SIM_TRY(mesh_array_new(d, mesh_of(pr), "pipeline/circ_storage_mover", 4, pr->shift_shape, &pr->s_shift, SIM_F32,
                               SIM_MEM_TEMP, &mover));
    }
    sim_status st = SIM_OK;
    for (int64_t i = 0; i < pr->iters && st == SIM_OK; i++) {
        int span = iteration_span(d, p, i, s, "pipeline iteration");
        /* ag_per_repeat: the repeat's prefetch (bsw[1]) at its first iteration */
        if (pr->rep && i % M == 0 && i / M < p->repeats) st = rep_gather(pr, i / M, false);
        if (st != SIM_OK) {
            sim_span_end(d, span);
            break;
        }
        /* get_iteration_inputs: stage 0 takes a new microbatch from state_io, later the
         * circulating one; the other stages take their shift slot */
        const float *in = shift.data;
        if (s == 0 && i < M) in = col(&io, i % MS, n);
        else if (s == 0 && p->circ_storage) in = col(&circ, i % M, n);
        st = slot_new(pr, "pipeline/iteration_input", SIM_MEM_ACTIVATIONS, &pr->saved[i * L]);
        if (st == SIM_OK) copy_n(pr->saved[i * L].data, in, n);
        mesh_array o;
        memset(&o, 0, sizeof o);
        uint64_t t0 = sim_now_ns();
        if (st == SIM_OK) st = stage_forward(pr, i, &o);
        count_time(pr, i, t0);
        /* get_new_loop_state */
        if (st == SIM_OK) {
            /* with pipeline_delay_activation_forwarding the previous iteration's output moves on */
            st = ppermute(pr, p->delay == 2 ? prev.data : o.data, shift2.data, +1, "pipeline/shift");
            if (p->delay == 2) copy_n(prev.data, o.data, n);
            if (zero_first && s == 0) zero_n(shift2.data, n);
            mesh_array sw = shift;
            shift = shift2;
            shift2 = sw;
        }
        if (st == SIM_OK && p->circ_storage) {
            int64_t c = (((i - p->delay * (S - 1) - 1) % M) + M) % M;
            st = ppermute(pr, mover.data, tmp.data, +1, "pipeline/circ_storage");
            copy_n(col(&circ, c, n), tmp.data, n);
            copy_n(mover.data, o.data, n);
        }
        if (st == SIM_OK) {
            int64_t k = i % MS;
            st = ppermute(pr, col(&io, k, n), tmp.data, -1, "pipeline/state_io");
            copy_n(col(&io, k, n), s == S - 1 ? (const float *)o.data : (const float *)tmp.data, n);
        }
        mesh_array_free(d, &o);
        /* ag_per_repeat: at the end of repeat r its bsw[0] (repeat r-1's layer) is dropped */
        if (pr->rep && st == SIM_OK && (i + 1) % M == 0 && (i + 1) / M >= 2 && (i + 1) / M <= p->repeats)
            st = rep_release(pr, (i + 1) / M - 2, false);
        sim_span_end(d, span);
    }
    if (pr->rep) /* the last repeat's layer served the drain bubbles */
        for (int64_t r = 0; r < p->repeats; r++) (void)rep_release(pr, r, false);
    if (st == SIM_OK) {
        /* permute_output_micro_per_stage_dim: microbatch 0 finished at column idx0 */
        const int64_t idx0 = (M * (p->repeats - 1) + p->delay * (S - 1)) % MS;
        st = mesh_array_new_raw(d, mesh_of(pr), "pipeline/output", 5, pr->io_shape, &pr->s_io, SIM_F32,
                                SIM_MEM_ACTIVATIONS, out);
        for (int64_t j = 0; j < MS && st == SIM_OK; j++) copy_n(col(out, j, n), col(&io, (j + idx0) % MS, n), n);
    }
    mesh_array_free(d, &io);
    mesh_array_free(d, &shift);
    mesh_array_free(d, &shift2);
    mesh_array_free(d, &circ);
    mesh_array_free(d, &mover);
    mesh_array_free(d, &tmp);
    mesh_array_free(d, &prev);
    return st;
}

/* ---- reshapes on the tape (their VJP is the reshape back) */

static sim_status reshape_vjp(mesh_tape *t, mesh_entry *e)
{
    mesh_var *x = e->in[0], *y = e->out[0];
    mesh_ctx *ctx = mesh_tape_ctx(t);
    mesh_spec plain = y->val.spec;
    SIM_TRY(mesh_reshard(ctx->dev, ctx->mesh, &y->grad, &plain, sim_meta_implicit(e->tag)));
    mesh_array g;
    SIM_TRY(mesh_reshape(ctx, &y->grad, x->val.rank, x->val.shape, &x->val.spec, e->tag, &g));
    return mesh_tape_accumulate(t, x, &g, e->tag);
}

/* x reshaped to `shape`: out_sharding `spec` in explicit mode (MaxText passes
 * it), in auto mode a constraint to `spec` where MaxText adds one
 * (constrain_auto), else the sharding the reshape leaves. */
static sim_status reshape(model_dev *md, mesh_tape *t, mesh_var *x, int rank, const int64_t *shape,
                          const mesh_spec *spec, bool constrain_auto, const char *name, mesh_var **y)
{
    mesh_ctx *ctx = &md->ctx;
    bool expl = ctx->mode == MESH_MODE_EXPLICIT;
    char tag[SIM_TAG_MAX];
    mesh_tape_tag(t, name, tag, sizeof tag);
    *y = mesh_tape_var(t);
    SIM_TRY(mesh_reshape(ctx, &x->val, rank, shape, expl ? spec : NULL, name, &(*y)->val));
    if (!expl && constrain_auto) SIM_TRY(mesh_shard_as(ctx, &(*y)->val, spec, name));
    mesh_tape_record(t, reshape_vjp, tag, 1, &x, 1, y);
    return SIM_OK;
}

/* ---- the entry point */

sim_status model_pipeline_run(model_dev *md, mesh_tape *t, const model_batch *b, mesh_var *x, model_layer_fn fn,
                              int64_t first_layer, mesh_var **y)
{
    const model_def *m = md->def;
    const model_pipe *p = &m->d.pipe;
    const int64_t S = p->stages, M = p->microbatches, mb = p->micro_rows, T = x->val.shape[1], E = x->val.shape[2];
    if (x->val.rank != 3 || x->val.shape[0] != m->d.batch)
        return sim_err(SIM_ERR_INTERNAL, "pipeline: input '%s' is not the (batch, seq, emb) stream", x->val.name);
    pipe_run *pr = calloc(1, sizeof *pr);
    SIM_ASSERT(pr);
    pr->md = md;
    pr->p = p;
    pr->fn = fn;
    pr->first_layer = first_layer;
    pr->iters = model_pipe_iterations(p);
    pr->stage = sim_device_coord(md->ctx.dev, p->stage_axis);
    int64_t io_shape[5] = {S, M / S, mb, T, E}, shift_shape[4] = {S, mb, T, E}, in4[4] = {M, mb, T, E};
    memcpy(pr->io_shape, io_shape, sizeof io_shape);
    memcpy(pr->shift_shape, shift_shape, sizeof shift_shape);
    pr->slot_shape[0] = mb;
    pr->slot_shape[1] = T;
    pr->slot_shape[2] = E;
    mesh_spec s_in4, s_out;
    const char *saved_layer = md->ctx.layer;
    mesh_var *in4v = NULL, *io = NULL, *outv = NULL;
    mesh_array o;
    memset(&o, 0, sizeof o);
    bool swapped = false; /* the gathered weights stand in for the stored ones (ag_swap) */
    sim_status st;
    SIM_TRY_GOTO(model_logical_spec(m, "pipeline/state_io", 5, STATE_IO, &pr->s_io), st, fail);
    SIM_TRY_GOTO(model_logical_spec(m, "pipeline/shift", 4, STAGES_IN, &pr->s_shift), st, fail);
    SIM_TRY_GOTO(model_logical_spec(m, "pipeline/inputs", 4, INPUT4, &s_in4), st, fail);
    SIM_TRY_GOTO(model_logical_spec(m, "pipeline/output", 3, OUTPUT3, &s_out), st, fail);
    if (pr->s_shift.n_axes[0] != 1 || pr->s_shift.axes[0][0] != p->stage_axis || pr->s_io.n_axes[0] != 1 ||
        pr->s_io.axes[0][0] != p->stage_axis)
        SIM_TRY_GOTO(sim_err(SIM_ERR_INPUT,
                             "logical_axis_rules: activation_stage must map to 'stage' alone for pipeline parallelism "
                             "(ici_pipeline_parallelism=%lld); add the rule [activation_stage, stage]",
                             (long long)S),
                     st, fail);
    mesh_spec_init(&pr->inner, 3);
    for (int dd = 0; dd < 3; dd++) {
        pr->inner.n_axes[dd] = pr->s_shift.n_axes[dd + 1];
        memcpy(pr->inner.axes[dd], pr->s_shift.axes[dd + 1], sizeof pr->inner.axes[dd]);
    }
    SIM_TRY_GOTO(
        mesh_spec_check_shape(&pr->inner, &m->mesh, 3, pr->slot_shape, "pipeline microbatch (activation_batch)"), st,
        fail);
    mesh_dim_shard sh[3];
    mesh_spec_shard(&pr->inner, &m->mesh, pr->slot_shape, sim_device_id(md->ctx.dev), sh);
    pr->n = sh[0].local * sh[1].local * sh[2].local;
    pr->saved = calloc((size_t)(pr->iters * p->layers_per_stage), sizeof *pr->saved);
    SIM_ASSERT(pr->saved);
    /* the buffers as MaxText's activation dump logs them */
    mesh_array probe;
    memset(&probe, 0, sizeof probe);
    probe.rank = 2;
    probe.shape[0] = m->d.batch;
    probe.shape[1] = T;
    mesh_spec rep;
    mesh_spec_init(&rep, 2);
    model_note_activation(md, "pipeline/inputs", &probe, 2, NULL, &rep);
    probe.rank = 4;
    memcpy(probe.shape, shift_shape, sizeof shift_shape);
    model_note_activation(md, "pipeline/shift", &probe, 4, STAGES_IN, &pr->s_shift);
    probe.rank = 5;
    memcpy(probe.shape, io_shape, sizeof io_shape);
    model_note_activation(md, "pipeline/state_io", &probe, 5, STATE_IO, &pr->s_io);
    probe.rank = 4;
    memcpy(probe.shape, shift_shape, sizeof shift_shape);
    model_note_activation(md, "pipeline/first_stage_in", &probe, 4, STAGES_IN, &pr->s_shift);
    model_note_activation(md, "pipeline/stages_in", &probe, 4, STAGES_IN, &pr->s_shift);
    md->ctx.layer = "decoder/pipeline";
    SIM_TRY_GOTO(reshape(md, t, x, 4, in4, &s_in4, true, "inputs", &in4v), st, fail);
    SIM_TRY_GOTO(reshape(md, t, in4v, 5, io_shape, &pr->s_io, true, "state_io", &io), st, fail);
    SIM_TRY_GOTO(explicit_positions_gather(pr), st, fail);
    SIM_TRY_GOTO(microbatch_positions(pr, b), st, fail);
    bool recording = mesh_tape_recording(t);
    if (recording && m->d.remat_replay) {
        pr->replay = calloc((size_t)(pr->iters * p->layers_per_stage), sizeof *pr->replay);
        SIM_ASSERT(pr->replay);
    }
    if (p->ag_once) {
        SIM_TRY_GOTO(ag_gather(pr, recording), st, fail);
        ag_swap(pr, true);
        swapped = true;
    }
    if (p->ag_per_repeat) {
        pr->rep = calloc((size_t)(p->repeats * m->nparams), sizeof *pr->rep);
        SIM_ASSERT(pr->rep);
    }
    SIM_TRY_GOTO(loop_forward(pr, &io->val, &o), st, fail);
    if (swapped) ag_swap(pr, false);
    swapped = false;
    outv = mesh_tape_var(t);
    outv->val = o;
    mesh_entry *e = mesh_tape_record(t, loop_vjp, "decoder/pipeline", 1, &io, 1, &outv);
    if (e) {
        e->payload = pr;
        e->free_payload = run_free;
    } else {
        run_free(pr); /* a tape that records nothing: freed before the output is reshaped, as it is read */
    }
    pr = NULL;
    /* MaxText 0.2.5's pipeline output (NNXPipeline.__call__): jnp.reshape of the [S, M/S, mb, T, E] state_io
     * to [B, T, E] with out_sharding=output_sharding, which is None in auto mode: the batch keeps the
     * stage axis the state_io's leading dim had, so the decoder norm, the logits and the loss run on each
     * stage's share of the batch, and the logits kernel's gradient is summed over stage (llama2-7b
     * stage=2 x fsdp=2 on v5p-8: all-reduce bf16[2048,32000] over stage, op_name
     * transpose(jvp())/dot_general; no gather of the pipeline output).  That holds where the merged dims
     * [S, M/S, mb] keep a tiled sharding (M/S = 1: stage, then the batch axes); with several microbatches
     * per stage no compile was measured, and the output is constrained to output_sharding's layout */
    bool keeps = p->microbatches / p->stages == 1;
    SIM_TRY_GOTO(reshape(md, t, outv, 3, (int64_t[]){m->d.batch, T, E}, &s_out, !keeps, "output", y), st, fail);
fail:
    if (pr) {
        if (swapped) ag_swap(pr, false);
        run_free(pr);
    }
    md->ctx.layer = saved_layer;
    return st;
}

/* ------------------------------------------------------------ sharding dump layout */

sim_status model_pipe_dump_layout(const model_def *m, int i, int64_t l, char *path, size_t cap, int *rank,
                                  int64_t *shape, const char **logical, mesh_spec *spec)
{
    const model_param_def *pd = &m->defs[i];
    const model_pipe *p = &m->d.pipe;
    if (!model_param_pipelined(m, i)) return sim_err(SIM_ERR_INTERNAL, "'%s' is not pipelined", pd->path);
    /* params.decoder.<stack>.rest -> params.decoder.pipeline_module.layers[.layers_<l>].rest */
    const char *rest = strstr(pd->path, ".layers.");
    size_t skip = rest ? strlen(".layers.") : 0;
    if (!rest) {
        rest = strstr(pd->path, ".moe_layers.");
        skip = strlen(".moe_layers.");
    }
    if (!rest) return sim_err(SIM_ERR_INTERNAL, "'%s': no layer stack in the path", pd->path);
    char sub[32] = "";
    if (p->layers_per_stage > 1) snprintf(sub, sizeof sub, "layers_%lld.", (long long)l);
    snprintf(path, cap, "%.*s.pipeline_module.layers.%s%s", (int)(rest - pd->path), pd->path, sub, rest + skip);
    /* the stage vmap (and, circular, the repeat vmap) stack each layer of a stage */
    const mesh_spec *full = &m->unpruned[i];
    int r = 0;
    mesh_spec_init(spec, 0);
    if (p->repeats > 1) {
        shape[r] = p->repeats;
        logical[r++] = "circular_repeats";
    }
    spec->n_axes[r] = 1;
    spec->axes[r][0] = (int8_t)p->stage_axis;
    shape[r] = p->stages;
    logical[r++] = "layers";
    for (int d = 0; d < pd->rank; d++)
        if (d != pd->scan_dim) {
            shape[r] = pd->shape[d];
            logical[r] = pd->logical[d];
            spec->n_axes[r] = full->n_axes[d];
            memcpy(spec->axes[r], full->axes[d], sizeof spec->axes[r]);
            r++;
        }
    *rank = r;
    spec->rank = r;
    return SIM_OK;
}

sim_status model_pipe_zero1_spec(const model_def *m, int i, mesh_spec *out)
{
    const model_param_def *pd = &m->defs[i];
    const model_pipe *p = &m->d.pipe;
    char path[MODEL_PATH_MAX + 32];
    int rank;
    int64_t shape[MESH_SPEC_MAX_RANK];
    const char *logical[MESH_SPEC_MAX_RANK];
    mesh_spec dump, z;
    SIM_TRY(model_pipe_dump_layout(m, i, 0, path, sizeof path, &rank, shape, logical, &dump));
    model_zero1_spec(&m->mesh, rank, shape, &dump, &z); /* MaxText's rule on MaxText's [(R,) S, ...] */
    *out = m->unpruned[i];
    int lead = p->repeats > 1 ? 1 : 0; /* the stage dim's index in the dump layout */
    for (int d = 0; d < rank; d++) {
        if (z.n_axes[d] == dump.n_axes[d]) continue;
        int sd = pd->scan_dim;
        if (d <= lead) { /* the repeat dim (or a size-1 data on the stage dim): after 'stage' on the scan dim */
            out->axes[sd][out->n_axes[sd]++] = z.axes[d][0];
            continue;
        }
        int k = d - lead - 1, id = k < sd ? k : k + 1; /* the per-layer dim in the stacked shape */
        out->n_axes[id] = z.n_axes[d];
        memcpy(out->axes[id], z.axes[d], sizeof out->axes[id]);
    }
    return SIM_OK;
}
